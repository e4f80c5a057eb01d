//! The edge's `Runtime` service: every call names a sandbox of this edge; the edge resumes it
//! first when it is paused (transparently, as a resume call would), counts the call as activity
//! (the idle TTL restarts, and idle expiry leaves a sandbox alone while one of its calls runs),
//! and forwards the request to the sandbox's agent through its backend's [`AgentAccess`].
//!
//! Invariants:
//! - a call is counted from before its state check until its response (or its stream) ends, so
//!   the TTL loop never stops a sandbox between the check and the forward;
//! - activity lives in memory ([`Activity`]); the record's `last_active_ms` is only rewritten by
//!   lifecycle operations. An edge restart therefore counts idle time from the last recorded
//!   activity or the restart, whichever is later (see `recover`).
//!
//! [`AgentAccess`]: crate::backend::AgentAccess

use std::collections::HashMap;
use std::sync::Arc;

use futures::StreamExt;
use tonic::{Request, Response, Status, Streaming};

use opendsec_common::time::now_ms;
use opendsec_proto::v1::runtime_server::Runtime;
use opendsec_proto::v1::*;

use crate::backend::{AgentClient, BackendError, agent_client};
use crate::core::Inner;
use crate::error::EdgeError;
use crate::state::SandboxStatus;

/// How long an aborted upload's reset may take to reach the agent.
const ABORT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

type BoxStream<T> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

/// Calls in flight and the last activity per sandbox (by lease).
#[derive(Default)]
pub(crate) struct Activity {
    map: std::sync::Mutex<HashMap<String, (u32, i64)>>,
}

impl Activity {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (u32, i64)>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn begin(&self, lease: &str) {
        let now = now_ms();
        let mut m = self.lock();
        let e = m.entry(lease.to_string()).or_insert((0, now));
        e.0 += 1;
        e.1 = now;
    }

    fn end(&self, lease: &str) {
        let now = now_ms();
        if let Some(e) = self.lock().get_mut(lease) {
            e.0 = e.0.saturating_sub(1);
            e.1 = now;
        }
    }

    /// (calls in flight, last activity in ms) of a sandbox; (0, 0) when it never had a call.
    pub(crate) fn of(&self, lease: &str) -> (u32, i64) {
        self.lock().get(lease).copied().unwrap_or((0, 0))
    }

    /// Forgets an ended sandbox.
    pub(crate) fn forget(&self, lease: &str) {
        self.lock().remove(lease);
    }
}

/// One call in flight; ends the call (and marks activity) when dropped.
pub(crate) struct CallGuard {
    inner: Arc<Inner>,
    lease: String,
}

impl Drop for CallGuard {
    fn drop(&mut self) {
        self.inner.activity.end(&self.lease);
    }
}

impl Inner {
    /// The agent of sandbox `id`, resumed if paused, with the call counted until the guard
    /// drops.
    pub(crate) async fn runtime_target(
        self: &Arc<Self>,
        id: &str,
    ) -> Result<(tonic::transport::Channel, CallGuard), EdgeError> {
        let lease = self.lease_of(id)?.to_string();
        // Unknown sandboxes leave no activity entry behind (ended ones are forgotten with
        // their record).
        if self.table().rec(&lease).is_none() {
            return Err(self.not_found(id));
        }
        self.activity.begin(&lease);
        let guard = CallGuard { inner: self.clone(), lease: lease.clone() };
        // Read after the call counts: the TTL loop may have acted in between.
        let rec = self.table().rec(&lease).ok_or_else(|| self.not_found(id))?;
        match rec.state {
            SandboxStatus::Running => {}
            SandboxStatus::Paused | SandboxStatus::Pausing | SandboxStatus::Resuming => {
                self.resume(id).await?;
            }
            state => return Err(EdgeError::InvalidState { id: rec.id.clone(), state, op: "run calls in it" }),
        }
        let backend = self.backend_of(&rec)?;
        let access = backend.agent_access().ok_or_else(|| EdgeError::Backend {
            backend: backend.name(),
            op: "reach the agent of",
            id: rec.id.clone(),
            source: BackendError::InvalidArgument(format!(
                "backend {} has no agent: sessions, files and processes need a container sandbox",
                backend.name()
            )),
        })?;
        let channel = access.agent(&rec.id).map_err(|source| EdgeError::Backend {
            backend: backend.name(),
            op: "reach the agent of",
            id: rec.id.clone(),
            source,
        })?;
        Ok((channel, guard))
    }
}

/// The `Runtime` service of an edge (behind the service-token check, see [`crate::Edge::runtime_service`]).
pub struct RuntimeService {
    pub(crate) inner: Arc<Inner>,
}

impl RuntimeService {
    async fn target(&self, id: &str) -> Result<(AgentClient, CallGuard), Status> {
        self.channel(id).await.map(|(ch, g)| (agent_client(ch), g))
    }

    async fn channel(&self, id: &str) -> Result<(tonic::transport::Channel, CallGuard), Status> {
        self.inner.runtime_target(id).await.map_err(|e| {
            let api = e.to_api();
            tracing::debug!(sandbox_id = id, reason = %api.reason, error = %api.message, "runtime call refused");
            api.to_status()
        })
    }
}

/// Keeps `guard` alive as long as the stream.
fn guarded<T: Send + 'static>(s: Streaming<T>, guard: CallGuard) -> BoxStream<T> {
    Box::pin(s.map(move |item| {
        let _ = &guard;
        item
    }))
}

/// The trait impl, generated whole (one macro) so `async_trait` sees every method expanded:
/// unary calls and server-streaming calls forward as they are; the rest is written out.
macro_rules! runtime_impl {
    (
        unary { $($method:ident($req:ty) -> $resp:ty;)* }
        server_streaming { $($smethod:ident($sreq:ty) -> $alias:ident<$item:ty>;)* }
        $($rest:tt)*
    ) => {
        #[tonic::async_trait]
        impl Runtime for RuntimeService {
            $(
                async fn $method(&self, r: Request<$req>) -> Result<Response<$resp>, Status> {
                    let req = r.into_inner();
                    let (mut c, _guard) = self.target(&req.sandbox_id).await?;
                    c.$method(req).await
                }
            )*
            $(
                type $alias = BoxStream<$item>;
                async fn $smethod(&self, r: Request<$sreq>) -> Result<Response<Self::$alias>, Status> {
                    let req = r.into_inner();
                    let (mut c, guard) = self.target(&req.sandbox_id).await?;
                    let s = c.$smethod(req).await?.into_inner();
                    Ok(Response::new(guarded(s, guard)))
                }
            )*
            $($rest)*
        }
    };
}

runtime_impl! {
    unary {
        exec(ExecRequest) -> ExecResult;
        get_output(GetOutputRequest) -> GetOutputResponse;
        close_session(CloseSessionRequest) -> CloseSessionResponse;
        list_dir(ListDirRequest) -> ListDirResponse;
        stat(StatRequest) -> FileInfo;
        make_dir(MakeDirRequest) -> MakeDirResponse;
        remove(RemoveRequest) -> RemoveResponse;
        r#move(MoveRequest) -> MoveResponse;
        http_request(HttpRequestRequest) -> HttpRequestResponse;
        start_process(StartProcessRequest) -> StartProcessResponse;
        send_input(SendInputRequest) -> SendInputResponse;
        signal_process(SignalProcessRequest) -> SignalProcessResponse;
        list_processes(ListProcessesRequest) -> ListProcessesResponse;
    }

    server_streaming {
        exec_stream(ExecRequest) -> ExecStreamStream<ExecChunk>;
        read_file(ReadFileRequest) -> ReadFileStream<FileChunk>;
        connect_process(ConnectProcessRequest) -> ConnectProcessStream<ProcessEvent>;
    }

    async fn write_file(&self, r: Request<Streaming<WriteFileRequest>>) -> Result<Response<WriteFileResponse>, Status> {
        let mut incoming = r.into_inner();
        let Some(first) = incoming.message().await? else {
            return Err(EdgeError::InvalidArgument("empty WriteFile stream".into()).to_api().to_status());
        };
        let id = first.sandbox_id.clone();
        let (ch, _guard) = self.channel(&id).await?;
        let check = move |m: &WriteFileRequest| {
            if m.sandbox_id.is_empty() || m.sandbox_id == id {
                Ok(())
            } else {
                Err(EdgeError::InvalidArgument("a WriteFile stream names one sandbox".into()).to_api().to_status())
            }
        };
        opendsec_proto::upload::forward(ch, first, incoming, check, ABORT_WAIT).await
    }

    /// The agent's heartbeats, for as long as the caller listens. Watching does not resume a
    /// paused sandbox's clock: it is a call like any other.
    type WatchStream = BoxStream<Heartbeat>;
    async fn watch(&self, r: Request<WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let req = r.into_inner();
        let (mut c, guard) = self.target(&req.sandbox_id).await?;
        let s = c.watch(req).await?.into_inner();
        Ok(Response::new(guarded(s, guard)))
    }
}
