//! The `Edge` gRPC service: translates requests to the edge's operations and errors to
//! statuses (through `EdgeError::to_api`, the one mapping). No logic lives here.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use opendsec_proto::v1::edge_server::Edge as EdgeRpc;
use opendsec_proto::v1::{
    EdgeCreateManyRequest, EdgeCreateRequest, EdgeCreateResult, EdgeListRequest, EdgeListResponse, EdgeStatus,
    GetSandboxMetricsRequest, GetSandboxRequest, PauseSandboxRequest, ResumeSandboxRequest, Sandbox, SandboxMetrics,
    SetDrainingRequest, SetSandboxTimeoutRequest, StatusRequest, StopSandboxRequest, UpdateNetworkRequest,
};

use crate::core::Inner;
use crate::error::EdgeError;
use opendsec_common::grpc::MAX_CREATE_MANY;

/// The service implementation (wrapped in `EdgeServer` by [`crate::Edge::service`]; served
/// behind the role table of `opendsec_common::acl`).
pub struct EdgeService {
    pub(crate) inner: Arc<Inner>,
}
impl std::fmt::Debug for EdgeService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeService").finish_non_exhaustive()
    }
}

/// Runs a lifecycle operation in its own task: a caller that goes away (timeout, cancelled
/// call) must not cut an operation short between its record writes and backend calls.
async fn detached<T, F, Fut>(inner: &Arc<Inner>, op: &'static str, f: F) -> Result<T, EdgeError>
where
    F: FnOnce(Arc<Inner>) -> Fut,
    Fut: std::future::Future<Output = Result<T, EdgeError>> + Send + 'static,
    T: Send + 'static,
{
    tokio::spawn(f(inner.clone())).await.map_err(|e| EdgeError::TaskFailed { op, message: e.to_string() })?
}

/// A lifecycle call names the project the apiserver authorized it for; a sandbox of another
/// project under that id (an id the apiserver cached before it was reused) is not found.
fn check_project<T>(inner: &Inner, req: &Request<T>, id: &str) -> Result<(), Status> {
    let expect = crate::runtime::expected_project(req.metadata())?;
    let lease = inner.lease_of(id).map_err(|e| status("lifecycle", e))?;
    match inner.table().rec(lease) {
        Some(rec) if rec.spec.project == expect => Ok(()),
        _ => Err(status("lifecycle", inner.not_found(id))),
    }
}

fn status(method: &'static str, e: EdgeError) -> Status {
    let api = e.to_api();
    tracing::debug!(method, reason = %api.reason, error = %api.message, "edge call failed");
    api.to_status()
}

#[tonic::async_trait]
impl EdgeRpc for EdgeService {
    async fn status(&self, req: Request<StatusRequest>) -> Result<Response<EdgeStatus>, Status> {
        Ok(Response::new(self.inner.status(req.get_ref().include_leases)))
    }

    async fn set_draining(&self, req: Request<SetDrainingRequest>) -> Result<Response<EdgeStatus>, Status> {
        if !req.get_ref().query {
            self.inner.set_draining(req.get_ref().draining).map_err(|e| status("SetDraining", e))?;
        }
        Ok(Response::new(self.inner.status(false)))
    }

    async fn create_sandbox(&self, req: Request<EdgeCreateRequest>) -> Result<Response<Sandbox>, Status> {
        let req = req.into_inner();
        detached(&self.inner, "create", |i| async move { i.create(req).await })
            .await
            .map(Response::new)
            .map_err(|e| status("CreateSandbox", e))
    }

    type CreateManyStream = tokio_stream::wrappers::ReceiverStream<Result<EdgeCreateResult, Status>>;

    async fn create_many(
        &self,
        req: Request<EdgeCreateManyRequest>,
    ) -> Result<Response<Self::CreateManyStream>, Status> {
        let items = req.into_inner().items;
        if items.len() > MAX_CREATE_MANY {
            return Err(status(
                "CreateMany",
                EdgeError::InvalidArgument(format!("{} creations in one call, at most {MAX_CREATE_MANY}", items.len())),
            ));
        }
        let (tx, rx) = tokio::sync::mpsc::channel(items.len().max(1));
        Inner::create_many(&self.inner, items, move |index, r| {
            let result = match r {
                Ok(sb) => EdgeCreateResult { index, sandbox: Some(sb), error: None },
                Err(e) => {
                    let api = e.to_api();
                    tracing::debug!(method = "CreateMany", reason = %api.reason, error = %api.message, "edge call failed");
                    EdgeCreateResult { index, sandbox: None, error: Some(api.to_detail()) }
                }
            };
            // Room for every item: never waits. A caller gone is fine: the creation stands.
            let _ = tx.try_send(Ok(result));
        });
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(rx)))
    }

    async fn get_sandbox(&self, req: Request<GetSandboxRequest>) -> Result<Response<Sandbox>, Status> {
        self.inner.get(&req.get_ref().id).map(Response::new).map_err(|e| status("GetSandbox", e))
    }

    async fn list_sandboxes(&self, req: Request<EdgeListRequest>) -> Result<Response<EdgeListResponse>, Status> {
        self.inner.list(req.get_ref()).map(Response::new).map_err(|e| status("ListSandboxes", e))
    }

    async fn stop_sandbox(&self, req: Request<StopSandboxRequest>) -> Result<Response<Sandbox>, Status> {
        check_project(&self.inner, &req, &req.get_ref().id)?;
        let id = req.into_inner().id;
        detached(&self.inner, "stop", |i| async move { i.stop(&id).await })
            .await
            .map(Response::new)
            .map_err(|e| status("StopSandbox", e))
    }

    async fn pause_sandbox(&self, req: Request<PauseSandboxRequest>) -> Result<Response<Sandbox>, Status> {
        check_project(&self.inner, &req, &req.get_ref().id)?;
        let id = req.into_inner().id;
        detached(&self.inner, "pause", |i| async move { i.pause(&id).await })
            .await
            .map(Response::new)
            .map_err(|e| status("PauseSandbox", e))
    }

    async fn resume_sandbox(&self, req: Request<ResumeSandboxRequest>) -> Result<Response<Sandbox>, Status> {
        check_project(&self.inner, &req, &req.get_ref().id)?;
        let id = req.into_inner().id;
        detached(&self.inner, "resume", |i| async move { i.resume(&id).await })
            .await
            .map(Response::new)
            .map_err(|e| status("ResumeSandbox", e))
    }

    async fn set_sandbox_timeout(&self, req: Request<SetSandboxTimeoutRequest>) -> Result<Response<Sandbox>, Status> {
        check_project(&self.inner, &req, &req.get_ref().id)?;
        let req = req.into_inner();
        detached(&self.inner, "set_timeout", |i| async move { i.set_timeout(&req).await })
            .await
            .map(Response::new)
            .map_err(|e| status("SetSandboxTimeout", e))
    }

    async fn get_sandbox_metrics(
        &self,
        req: Request<GetSandboxMetricsRequest>,
    ) -> Result<Response<SandboxMetrics>, Status> {
        check_project(&self.inner, &req, &req.get_ref().id)?;
        self.inner.metrics(&req.get_ref().id).await.map(Response::new).map_err(|e| status("GetSandboxMetrics", e))
    }

    async fn create_snapshot(
        &self,
        req: Request<opendsec_proto::v1::EdgeSnapshotRequest>,
    ) -> Result<Response<opendsec_proto::v1::EdgeSnapshot>, Status> {
        check_project(&self.inner, &req, &req.get_ref().id)?;
        let req = req.into_inner();
        detached(&self.inner, "snapshot", |i| async move { i.snapshot(&req.id, req.pack_diff).await })
            .await
            .map(Response::new)
            .map_err(|e| status("CreateSnapshot", e))
    }

    async fn move_out(
        &self,
        req: Request<opendsec_proto::v1::EdgeMoveOutRequest>,
    ) -> Result<Response<opendsec_proto::v1::EdgeMoveOut>, Status> {
        check_project(&self.inner, &req, &req.get_ref().id)?;
        let req = req.into_inner();
        detached(&self.inner, "move_out", |i| async move { i.move_out(&req).await })
            .await
            .map(Response::new)
            .map_err(|e| status("MoveOut", e))
    }

    async fn finish_move(
        &self,
        req: Request<opendsec_proto::v1::EdgeFinishMoveRequest>,
    ) -> Result<Response<Sandbox>, Status> {
        check_project(&self.inner, &req, &req.get_ref().id)?;
        let req = req.into_inner();
        detached(&self.inner, "finish_move", |i| async move { i.finish_move(&req).await })
            .await
            .map(Response::new)
            .map_err(|e| status("FinishMove", e))
    }

    async fn save_session(
        &self,
        req: Request<opendsec_proto::v1::SaveSessionRequest>,
    ) -> Result<Response<opendsec_proto::v1::SessionSaved>, Status> {
        check_project(&self.inner, &req, &req.get_ref().id)?;
        let id = req.into_inner().id;
        detached(&self.inner, "save_session", |i| async move { i.save_session(&id).await })
            .await
            .map(Response::new)
            .map_err(|e| status("SaveSession", e))
    }

    async fn update_network(&self, req: Request<UpdateNetworkRequest>) -> Result<Response<Sandbox>, Status> {
        check_project(&self.inner, &req, &req.get_ref().id)?;
        let req = req.into_inner();
        detached(&self.inner, "update_network", |i| async move { i.update_network(&req).await })
            .await
            .map(Response::new)
            .map_err(|e| status("UpdateNetwork", e))
    }
}
