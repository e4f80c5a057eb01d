//! The plumbing of every public call: its own task and its one audit line ([`run`]), the
//! caller's identity ([`caller`]), and the sandbox permissions the services check.

use futures::future::BoxFuture;
use opendsec_common::{ApiError, grpc};
use tonic::Response;
use tonic::Status;
use tonic::metadata::MetadataMap;

use std::sync::Arc;

use crate::state::{Call, Shared};

pub const PERM_VIEW: &str = "sandbox.view";
pub const PERM_OPERATE: &str = "sandbox.operate";
/// Creating sandboxes (IAM checks it at Admit; a fork checks it before its snapshot too).
pub const PERM_CREATE: &str = "sandbox.create";

/// Runs one call in its own task (so that it completes and is audited even if the client
/// leaves) and maps its error to a status once.
pub(crate) async fn run<T, F>(shared: &Arc<Shared>, method: &'static str, f: F) -> Result<Response<T>, Status>
where
    T: Send + 'static,
    F: for<'a> FnOnce(&'a Shared, &'a mut Call) -> BoxFuture<'a, Result<T, ApiError>> + Send + 'static,
{
    let shared = shared.clone();
    let task = tokio::spawn(async move {
        let mut call = Call::new(method);
        let res = f(&shared, &mut call).await;
        shared.finish(call, res.as_ref().map(|_| ())).await;
        res
    });
    match task.await {
        Ok(Ok(v)) => Ok(Response::new(v)),
        Ok(Err(e)) => Err(e.to_status()),
        Err(e) => {
            tracing::error!(method, error = %e, "call task failed");
            Err(ApiError::internal(format!("{method} failed inside the apiserver")).to_status())
        }
    }
}

/// Authenticates the caller and notes the principal on the call.
pub(crate) async fn caller(
    s: &Shared,
    call: &mut Call,
    md: &MetadataMap,
) -> Result<(String, Arc<crate::auth::Identity>), ApiError> {
    let token = grpc::bearer(md)?.to_string();
    let ident = s.authenticate(&token).await?;
    call.principal = Some(ident.principal.clone());
    Ok((token, ident))
}
