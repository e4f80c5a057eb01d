//! The edge's `Runtime` service: every call names a sandbox of this edge; the edge resumes it
//! first when it is paused (transparently, as a resume call would), counts the call as activity
//! (the idle TTL restarts, and idle expiry leaves a sandbox alone while one of its calls runs),
//! and forwards the request to the sandbox's agent through its backend's [`AgentAccess`].
//!
//! Invariants:
//! - a call is counted from before its state check until its response (or its stream) ends, so
//!   the TTL loop never stops a sandbox between the check and the forward;
//! - activity lives in memory (`core::sweep::Activity`, the idle clock beside the sweeps); the
//!   record's `last_active_ms` is only rewritten by
//!   lifecycle operations; an edge restart counts as activity for every sandbox it adopts (the
//!   calls' activity was lost with the old process);
//! - a call from an apiserver names the project it was authorized for
//!   ([`EXPECT_PROJECT_HEADER`]); a sandbox of another project under that id (an id reused
//!   after the apiserver cached it) is answered not_found;
//! - what the agent answers is untrusted: its statuses pass with their code and message only
//!   (no details, no metadata), so a hostile agent cannot dress up reasons;
//! - Watch neither resumes a paused sandbox nor counts as activity: an open Watch must not keep a
//!   sandbox from idling out.
//!
//! [`EXPECT_PROJECT_HEADER`]: opendsec_common::grpc::EXPECT_PROJECT_HEADER
//!
//! [`AgentAccess`]: crate::backend::AgentAccess

use std::sync::Arc;

use futures::StreamExt;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status, Streaming};

use opendsec_common::bounds::{AnswerBytes, Meter, Metered};
use opendsec_common::grpc::{EXPECT_PROJECT_HEADER, MAX_MESSAGE_BYTES};
use opendsec_proto::upload::{self, Hop};

use opendsec_proto::v1::runtime_server::Runtime;
use opendsec_proto::v1::*;

use crate::backend::{AgentClient, BackendError, agent_client};
use crate::core::Inner;
use crate::error::EdgeError;
use crate::state::SandboxStatus;

/// How long an aborted upload's reset may take to reach the agent.
const ABORT_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// An agent client whose answers are metered.
type MeteredAgent = opendsec_proto::v1::runtime_client::RuntimeClient<Metered<tonic::transport::Channel>>;

type BoxStream<T> = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

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

/// How a runtime call treats the sandbox.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum CallKind {
    /// Resumes a paused sandbox and counts as activity until it ends.
    Call,
    /// Neither (Watch).
    Observe,
}

impl Inner {
    /// The agent of sandbox `id` (which must belong to `expect_project` when given). A
    /// [`CallKind::Call`] resumes a paused sandbox and is counted until the guard drops.
    pub(crate) async fn runtime_target(
        self: &Arc<Self>,
        id: &str,
        expect_project: &str,
        kind: CallKind,
    ) -> Result<(tonic::transport::Channel, Option<CallGuard>), EdgeError> {
        let lease = self.lease_of(id)?.to_string();
        let rec = self.table().rec(&lease).ok_or_else(|| self.not_found(id))?;
        if expect_project != rec.spec.project {
            return Err(self.not_found(id));
        }
        let mut guard = None;
        if kind == CallKind::Call {
            // Unknown sandboxes leave no activity entry behind (ended ones are forgotten with
            // their record).
            self.activity.begin(&lease);
            guard = Some(CallGuard { inner: self.clone(), lease: lease.clone() });
        }
        // Read after the call counts: the TTL loop may have acted in between, and a move
        // waits for the calls it finds counted (so one that got past here ends before the
        // sandbox is frozen).
        let rec = self.table().rec(&lease).ok_or_else(|| self.not_found(id))?;
        Inner::check_not_moving(&rec)?;
        match (rec.state, kind) {
            (SandboxStatus::Running, _) => {}
            // Resumed only by ResumeSandbox (`spec.manual_resume`): a call finds it paused.
            (SandboxStatus::Paused | SandboxStatus::Pausing, CallKind::Call) if rec.spec.manual_resume => {
                return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "run calls in it" });
            }
            (SandboxStatus::Paused | SandboxStatus::Pausing | SandboxStatus::Resuming, CallKind::Call) => {
                // In its own task, as every lifecycle operation: a caller that goes away must
                // not cut the resume short between its record writes and the backend call.
                let (inner, sid) = (self.clone(), id.to_string());
                tokio::spawn(async move { inner.resume(&sid).await })
                    .await
                    .map_err(|e| EdgeError::TaskFailed { op: "resume", message: e.to_string() })??;
            }
            (SandboxStatus::Paused | SandboxStatus::Pausing | SandboxStatus::Resuming, CallKind::Observe) => {}
            (state, _) => return Err(EdgeError::InvalidState { id: rec.id.clone(), state, op: "run calls in it" }),
        }
        let backend = self.backend_of(&rec)?;
        let access = backend.agent_access().ok_or_else(|| EdgeError::Backend {
            backend: backend.name(),
            op: "reach the agent of",
            id: rec.id.clone(),
            source: BackendError::invalid_argument(format!(
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
impl std::fmt::Debug for RuntimeService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RuntimeService").finish_non_exhaustive()
    }
}

/// What a forwarded call holds while it runs: its activity mark (calls, not observers) and
/// its slot among the sandbox's calls in flight.
pub(crate) struct Held {
    _activity: Option<CallGuard>,
    _slot: opendsec_common::bounds::KeyPermit,
}

/// How long an agent's answer may wait for room in the edge's result budget before the call
/// fails `rate_limited`.
const ANSWER_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

/// How long a caller refused for being busy is told to wait.
const BUSY_RETRY_AFTER_MS: u64 = 200;

fn busy(message: String) -> Status {
    opendsec_common::ApiError::new(opendsec_common::Reason::RateLimited, message)
        .with("retry_after_ms", BUSY_RETRY_AFTER_MS.to_string())
        .to_status()
}

impl RuntimeService {
    async fn target(&self, id: &str, md: &MetadataMap) -> Result<(AgentClient, Held), Status> {
        self.channel(id, md, CallKind::Call).await.map(|(ch, g)| (agent_client(ch), g))
    }

    /// A client for one unary call whose answer counts against the sandbox's share of the
    /// edge's result budget, from when it arrives until it has gone to the apiserver (the
    /// server's [`opendsec_common::bounds::HoldLayer`] keeps the meter with the response).
    async fn unary_target(
        &self,
        id: &str,
        md: &MetadataMap,
        req: &impl AnswerBytes,
    ) -> Result<(MeteredAgent, Meter, Held), Status> {
        let tenant = opendsec_common::ids::tenant_of(&expected_project(md)?).to_string();
        let meter = Meter::new(&self.inner.result_budget, &tenant, req, ANSWER_WAIT).map_err(|e| e.to_status())?;
        let (ch, held) = self.channel(id, md, CallKind::Call).await?;
        let c = opendsec_proto::v1::runtime_client::RuntimeClient::new(Metered::new(ch, Some(meter.clone())))
            .max_decoding_message_size(meter.max_bytes())
            .max_encoding_message_size(MAX_MESSAGE_BYTES);
        Ok((c, meter, held))
    }

    async fn channel(
        &self,
        id: &str,
        md: &MetadataMap,
        kind: CallKind,
    ) -> Result<(tonic::transport::Channel, Held), Status> {
        let expect = expected_project(md)?;
        let slot = self.inner.runtime_calls.try_take(id).ok_or_else(|| {
            busy(format!("sandbox {id} has {} calls in flight already", self.inner.cfg.max_runtime_calls_per_sandbox))
        })?;
        let (ch, activity) = self.inner.runtime_target(id, &expect, kind).await.map_err(|e| {
            let api = e.to_api();
            tracing::debug!(sandbox_id = id, reason = %api.reason, error = %api.message, "runtime call refused");
            api.to_status()
        })?;
        Ok((ch, Held { _activity: activity, _slot: slot }))
    }
}

/// The project the apiserver authorized a forwarded call for ([`EXPECT_PROJECT_HEADER`]):
/// mandatory, so that no call reaches a sandbox without a project check.
pub(crate) fn expected_project(md: &MetadataMap) -> Result<String, Status> {
    match md.get(EXPECT_PROJECT_HEADER).and_then(|v| v.to_str().ok()) {
        Some(p) if !p.is_empty() => Ok(p.to_string()),
        _ => Err(opendsec_common::ApiError::invalid(format!(
            "missing {EXPECT_PROJECT_HEADER}: the project the call was authorized for"
        ))
        .to_status()),
    }
}

/// Keeps `guard` alive as long as the stream; items' errors are the agent's (see [`untrusted`]).
fn guarded<T: Send + 'static>(s: Streaming<T>, guard: Held) -> BoxStream<T> {
    Box::pin(s.map(move |item| {
        let _ = &guard;
        item.map_err(untrusted)
    }))
}

/// A status that came from the agent (or the hop to it): its code and message only, so the
/// agent cannot forge error details or metadata; control characters in the message become
/// U+FFFD (it ends up in logs and on operators' terminals).
fn untrusted(s: Status) -> Status {
    let msg: String = s.message().chars().take(4096).map(|c| if c.is_control() { '\u{fffd}' } else { c }).collect();
    Status::new(s.code(), msg)
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
                    let (md, _, req) = r.into_parts();
                    let (mut c, meter, _guard) = self.unary_target(&req.sandbox_id, &md, &req).await?;
                    let mut resp = c.$method(req).await.map_err(untrusted)?;
                    resp.extensions_mut().insert(meter);
                    Ok(resp)
                }
            )*
            $(
                type $alias = BoxStream<$item>;
                async fn $smethod(&self, r: Request<$sreq>) -> Result<Response<Self::$alias>, Status> {
                    let (md, _, req) = r.into_parts();
                    let (mut c, guard) = self.target(&req.sandbox_id, &md).await?;
                    let s = c.$smethod(req).await.map_err(untrusted)?.into_inner();
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
        resize_process(ResizeProcessRequest) -> ResizeProcessResponse;
        create_watcher(WatchDirRequest) -> CreateWatcherResponse;
        get_watcher_events(GetWatcherEventsRequest) -> GetWatcherEventsResponse;
        remove_watcher(RemoveWatcherRequest) -> RemoveWatcherResponse;
        create_code_context(CreateCodeContextRequest) -> CodeContext;
        list_code_contexts(ListCodeContextsRequest) -> ListCodeContextsResponse;
        restart_code_context(CodeContextRequest) -> CodeContext;
        remove_code_context(CodeContextRequest) -> RemoveCodeContextResponse;
    }

    server_streaming {
        exec_stream(ExecRequest) -> ExecStreamStream<ExecChunk>;
        read_file(ReadFileRequest) -> ReadFileStream<FileChunk>;
        connect_process(ConnectProcessRequest) -> ConnectProcessStream<ProcessEvent>;
        watch_dir(WatchDirRequest) -> WatchDirStream<WatchDirEvent>;
        run_code(RunCodeRequest) -> RunCodeStream<CodeEvent>;
    }

    async fn write_file(&self, r: Request<Streaming<WriteFileRequest>>) -> Result<Response<WriteFileResponse>, Status> {
        let (md, _, mut incoming) = r.into_parts();
        let Some(first) = incoming.message().await? else {
            return Err(EdgeError::InvalidArgument("empty WriteFile stream".into()).to_api().to_status());
        };
        let id = first.sandbox_id.clone();
        let (ch, _guard) = self.channel(&id, &md, CallKind::Call).await?;
        let check = move |m: &WriteFileRequest| {
            if m.sandbox_id.is_empty() || m.sandbox_id == id {
                Ok(())
            } else {
                Err(EdgeError::InvalidArgument("a WriteFile stream names one sandbox".into()).to_api().to_status())
            }
        };
        let hop = Hop { abort_wait: ABORT_WAIT, ..Hop::default() };
        upload::forward(ch, first, &mut incoming, check, hop).await.map_err(untrusted)
    }

    /// The agent's heartbeats, for as long as the caller listens. Watching neither resumes a
    /// paused sandbox (its heartbeats resume with it) nor counts as activity.
    type WatchStream = BoxStream<Heartbeat>;
    async fn watch(&self, r: Request<WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let (md, _, req) = r.into_parts();
        let (ch, guard) = self.channel(&req.sandbox_id, &md, CallKind::Observe).await?;
        let s = agent_client(ch).watch(req).await.map_err(untrusted)?.into_inner();
        Ok(Response::new(guarded(s, guard)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agents_status_keeps_code_and_text_only() {
        let forged = opendsec_common::ApiError::new(opendsec_common::Reason::QuotaExceeded, "x\u{1b}]52;c;AA\u{7}y\nz")
            .to_status();
        let s = untrusted(forged);
        assert_eq!(s.code(), tonic::Code::ResourceExhausted);
        assert_eq!(s.message(), "x\u{fffd}]52;c;AA\u{fffd}y\u{fffd}z");
        assert!(s.details().is_empty(), "the agent's error details were kept");
        assert_eq!(untrusted(Status::internal("é".repeat(5000))).message().chars().count(), 4096);
    }
}
