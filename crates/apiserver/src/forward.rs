//! Forwarding to the edge named in a sandbox id: the call with the configured timeout, and the
//! project header that makes the edge refuse an id that now names another project's sandbox.

use std::future::Future;

use opendsec_common::{ApiError, Reason};
use opendsec_proto::v1 as pb;
use tonic::Request;

use crate::state::Shared;

/// Runs an edge call with the configured timeout.
pub(crate) async fn edge_call<T>(
    shared: &Shared,
    edge: &str,
    fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, ApiError> {
    within(edge, Some(shared.cfg.edge_call_timeout), fut).await
}

/// An edge's answer, or `deadline_exceeded` (naming the edge) once `limit` has passed.
pub(crate) async fn within<T>(
    edge: &str,
    limit: Option<std::time::Duration>,
    fut: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
) -> Result<T, ApiError> {
    let answer = match limit {
        Some(d) => tokio::time::timeout(d, fut).await.map_err(|_| {
            ApiError::new(Reason::DeadlineExceeded, format!("edge {edge} did not answer within {} s", d.as_secs()))
                .with("edge", edge)
        })?,
        None => fut.await,
    };
    answer.map(tonic::Response::into_inner).map_err(|st| ApiError::from_status(&st))
}

/// Gets a sandbox from the edge named in its id.
pub async fn edge_get(shared: &Shared, edge: &str, id: &str) -> Result<pb::Sandbox, ApiError> {
    let addr = shared.edge_addr(edge)?;
    let mut c = shared.up.edge(edge, &addr)?;
    edge_call(shared, edge, c.get_sandbox(pb::GetSandboxRequest { id: id.to_string() })).await
}

pub async fn edge_forward<T, F, Fut>(shared: &Shared, edge: &str, f: F) -> Result<T, ApiError>
where
    F: FnOnce(opendsec_proto::v1::edge_client::EdgeClient<tonic::transport::Channel>) -> Fut,
    Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let addr = shared.edge_addr(edge)?;
    let c = shared.up.edge(edge, &addr)?;
    edge_call(shared, edge, f(c)).await
}

/// The request to the edge, naming the project the call was authorized for: the edge refuses
/// it if the id now names another project's sandbox.
pub(crate) fn to_edge<Q>(req: Q, project: &str) -> Result<Request<Q>, ApiError> {
    let mut r = Request::new(req);
    let v = project.parse().map_err(|_| ApiError::internal(format!("project {project:?} is not ASCII")))?;
    r.metadata_mut().insert(opendsec_common::grpc::EXPECT_PROJECT_HEADER, v);
    Ok(r)
}
