//! The public `Runtime` service: shell sessions, files, HTTP and processes inside a sandbox,
//! forwarded to the edge named in the sandbox id, which serves the same service and routes it
//! on to the sandbox's agent.
//!
//! Every call validates the sandbox id first, authenticates the bearer token, then authorizes
//! `sandbox.operate` on the sandbox's project. The project comes from the edge (`GetSandbox`)
//! the first time and from a bounded cache afterwards. A sandbox's project never changes, but
//! its id can come back (lease ids are the caller's) for a sandbox of another project after the
//! first one ended: every forwarded call therefore names the project it was authorized for
//! (`EXPECT_PROJECT_HEADER`), and the edge answers `not_found` when the sandbox it holds under
//! that id is another project's (the entry is then forgotten). The permission check is
//! made on every call (cached by [`Shared::authorize`], cleared with IAM's security epoch).
//!
//! Unary calls run like the `Sandboxes` ones: in their own task, one audit line each. Streamed
//! answers are audited once the edge's stream is established; items and the final status are
//! relayed as the edge sends them. A `WriteFile` upload is authorized on its first message and
//! forwarded as it arrives; an error on the caller's stream resets the forwarded stream with an
//! error, so the edge sees a failed upload, never a short file's clean end.
//!
//! Time limits: the edge must answer within `edge_call_timeout`, plus the command's own timeout
//! for `Exec` and `HttpRequest` (an `Exec` without a timeout has no limit here: the caller's
//! deadline governs). Streams are limited only in how long they take to start.

use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::stream::BoxStream;
use futures::{StreamExt, TryStreamExt};
use opendsec_common::reason::{MOVED_TO, MOVING_TO};
use opendsec_common::{ApiError, Reason, ids};
use opendsec_proto::upload::{self, Hop};
use opendsec_proto::v1 as pb;
use opendsec_proto::v1::runtime_client::RuntimeClient;
use opendsec_proto::v1::runtime_server::Runtime;
use tonic::metadata::MetadataMap;
use tonic::transport::Channel as ServiceChannel;
use tonic::{Request, Response, Status, Streaming};

use crate::call::{PERM_OPERATE, caller, run};
use crate::forward::{self, to_edge};
use crate::guard::{PUBLIC_PRINCIPAL, PublicCaller};
use crate::state::{Call, Shared};

/// Sandboxes whose project one apiserver remembers.
pub const PROJECT_CACHE_ENTRIES: usize = 100_000;

/// Default timeout of an `HttpRequest` inside the sandbox (runtime.proto: 0 = 30 s).
const HTTP_DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// Sandbox id -> project, bounded: when full, the oldest entry goes.
#[derive(Debug)]
pub(crate) struct ProjectCache {
    cap: usize,
    inner: Mutex<CacheInner>,
}

#[derive(Debug, Default)]
struct CacheInner {
    map: HashMap<String, String>,
    /// Insertion order, for eviction; holds exactly the keys of `map`.
    order: VecDeque<String>,
}

impl ProjectCache {
    pub(crate) fn new(cap: usize) -> ProjectCache {
        ProjectCache { cap: cap.max(1), inner: Mutex::new(CacheInner::default()) }
    }

    pub(crate) fn get(&self, id: &str) -> Option<String> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).map.get(id).cloned()
    }

    pub(crate) fn put(&self, id: &str, project: &str) {
        let mut c = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if c.map.contains_key(id) {
            return;
        }
        while c.map.len() >= self.cap {
            match c.order.pop_front() {
                Some(old) => {
                    c.map.remove(&old);
                }
                None => break,
            }
        }
        c.map.insert(id.to_string(), project.to_string());
        c.order.push_back(id.to_string());
    }

    /// Forgets `id` (its sandbox turned out to be gone or another project's).
    pub(crate) fn forget(&self, id: &str) {
        let mut c = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        if c.map.remove(id).is_some() {
            c.order.retain(|k| k != id);
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.inner.lock().unwrap_or_else(|p| p.into_inner()).map.len()
    }
}

/// A runtime request: the sandbox it goes to, and how long the edge may take to answer it.
use opendsec_common::bounds::{AnswerBytes, Meter, Metered};

trait Routed {
    fn sandbox_id(&self) -> &str;

    /// The limit on the edge's answer (`None`: no limit here).
    fn limit(&self, edge_timeout: Duration) -> Option<Duration> {
        Some(edge_timeout)
    }
}

macro_rules! routed {
    ($($t:ty),* $(,)?) => {
        $(impl Routed for $t {
            fn sandbox_id(&self) -> &str {
                &self.sandbox_id
            }
        })*
    };
}

routed!(
    pb::CloseSessionRequest,
    pb::ReadFileRequest,
    pb::ListDirRequest,
    pb::StatRequest,
    pb::MakeDirRequest,
    pb::RemoveRequest,
    pb::MoveRequest,
    pb::StartProcessRequest,
    pb::ConnectProcessRequest,
    pb::SendInputRequest,
    pb::SignalProcessRequest,
    pb::ListProcessesRequest,
    pb::ResizeProcessRequest,
    pb::WatchDirRequest,
    pb::GetWatcherEventsRequest,
    pb::RemoveWatcherRequest,
    pb::CreateCodeContextRequest,
    pb::ListCodeContextsRequest,
    pb::CodeContextRequest,
    pb::RunCodeRequest,
    pb::WatchRequest,
);

impl Routed for pb::ExecRequest {
    fn sandbox_id(&self) -> &str {
        &self.sandbox_id
    }

    fn limit(&self, edge_timeout: Duration) -> Option<Duration> {
        exec_limit(self.timeout_ms, edge_timeout)
    }
}

impl Routed for pb::GetOutputRequest {
    fn sandbox_id(&self) -> &str {
        &self.sandbox_id
    }
}

impl Routed for pb::HttpRequestRequest {
    fn sandbox_id(&self) -> &str {
        &self.sandbox_id
    }

    fn limit(&self, edge_timeout: Duration) -> Option<Duration> {
        let own = if self.timeout_ms == 0 { HTTP_DEFAULT_TIMEOUT } else { Duration::from_millis(self.timeout_ms) };
        edge_timeout.checked_add(own)
    }
}

/// How long a caller refused for being busy is told to wait.
const BUSY_RETRY_AFTER_MS: u64 = 200;

/// An exec may take as long as its own timeout plus the usual edge allowance; none = no limit.
fn exec_limit(timeout_ms: u64, edge_timeout: Duration) -> Option<Duration> {
    if timeout_ms == 0 { None } else { edge_timeout.checked_add(Duration::from_millis(timeout_ms)) }
}

/// Validates the id, authenticates the caller and authorizes `sandbox.operate` on the
/// sandbox's project; returns the sandbox's edge and project, and what the caller's bounds
/// count it as ([`crate::auth::Identity::bounds_key`]).
///
/// A public call ([`PublicCaller`]: an E2B gateway's `HttpRequest` for nobody) needs no token
/// but a sandbox whose spec has `public_traffic`, read from its edge each time (one that is
/// not public answers `permission_denied`); it counts against that sandbox's calls in flight.
async fn authorized(
    s: &Shared,
    projects: &ProjectCache,
    call: &mut Call,
    md: &MetadataMap,
    id: &str,
    public: Option<PublicCaller>,
) -> Result<(String, String, String), ApiError> {
    let mut edge = crate::moves::route(s, id)?;
    call.sandbox_id = Some(id.to_string());
    if let Some(p) = public {
        call.principal = Some(PUBLIC_PRINCIPAL.to_string());
        // A sandbox that is not there, or not public, counts as a failed authentication of
        // the client: nobody may probe ids for free.
        let refuse = |e: ApiError| {
            if let Some(ip) = p.ip {
                s.failures.failed(ip, std::time::Instant::now());
            }
            e
        };
        let (_, sb) = crate::moves::follow(s, id, |edge| async move { forward::edge_get(s, &edge, id).await })
            .await
            .map_err(|e| if e.reason == Reason::NotFound { refuse(e) } else { e })?;
        let spec = sb.spec.unwrap_or_default();
        if !spec.public_traffic {
            return Err(refuse(ApiError::denied(format!("sandbox {id}'s traffic is not public: a token is needed"))));
        }
        call.project = Some(spec.project.clone());
        return Ok((edge, spec.project, format!("{PUBLIC_PRINCIPAL}@{id}")));
    }
    let (_, ident) = caller(s, call, md).await?;
    ident.may_reach(id)?;
    let project = match projects.get(id) {
        Some(p) => p,
        None => {
            let (at, sb) =
                crate::moves::follow(s, id, |edge| async move { forward::edge_get(s, &edge, id).await }).await?;
            edge = at;
            let project = sb.spec.map(|sp| sp.project).unwrap_or_default();
            if project.is_empty() {
                return Err(ApiError::denied(format!("sandbox {id} has no project")));
            }
            projects.put(id, &project);
            project
        }
    };
    call.project = Some(project.clone());
    s.authorize(&ident.principal, PERM_OPERATE, &project).await?;
    Ok((edge, project, ident.bounds_key()))
}

/// A client of an edge's Runtime service, its unary answers metered.
type EdgeRuntime = RuntimeClient<Metered<ServiceChannel>>;

fn client(s: &Shared, edge: &str, meter: Option<Meter>) -> Result<EdgeRuntime, ApiError> {
    s.up.runtime(edge, &s.edge_addr(edge)?, meter)
}

/// A stream relayed from the edge; its statuses are re-encoded so that transport failures on
/// the edge hop carry a reason too.
pub type Relay<T> = BoxStream<'static, Result<T, Status>>;

fn relay<T: Send + 'static>(s: Streaming<T>) -> Relay<T> {
    s.map_err(|st| ApiError::from_status(&st).to_status()).boxed()
}

pub struct RuntimeService {
    shared: Arc<Shared>,
    projects: Arc<ProjectCache>,
}

impl RuntimeService {
    pub fn new(shared: Arc<Shared>) -> Self {
        RuntimeService { shared, projects: Arc::new(ProjectCache::new(PROJECT_CACHE_ENTRIES)) }
    }

    /// Authorizes, forwards `f` to the sandbox's edge within `limit`, audits. The call counts
    /// against its principal's in-flight Runtime calls, and the answer of a unary one (`bytes`
    /// checks what it may hold; 0 for a stream) against the principal's share of the result
    /// budget.
    async fn forward<Q, T, F, Fut>(
        &self,
        method: &'static str,
        request: Request<Q>,
        limit: fn(&Q, Duration) -> Option<Duration>,
        metered: bool,
        f: F,
    ) -> Result<Response<T>, Status>
    where
        Q: Routed + AnswerBytes + Clone + Send + Sync + 'static,
        T: Send + 'static,
        F: Fn(EdgeRuntime, Request<Q>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Response<T>, Status>> + Send,
    {
        let (md, ext, req) = request.into_parts();
        let public = ext.get::<PublicCaller>().copied();
        let projects = self.projects.clone();
        let (answer, meter) = run(&self.shared, method, move |s, call| {
            Box::pin(async move {
                let id = req.sandbox_id().to_string();
                req.answer_bytes()?;
                let (_, project, principal) = authorized(s, &projects, call, &md, &id, public).await?;
                let _in_flight = s.runtime_calls.try_take(&principal).ok_or_else(|| {
                    ApiError::new(
                        Reason::RateLimited,
                        format!(
                            "{principal} has {} Runtime calls in flight already",
                            s.cfg.max_runtime_calls_per_principal
                        ),
                    )
                    .with("retry_after_ms", BUSY_RETRY_AFTER_MS.to_string())
                })?;
                // A unary answer's bytes count against its tenant's share of the result budget
                // from when they arrive until the caller has taken them (HoldLayer keeps the
                // meter with the response body).
                let wait = s.cfg.edge_call_timeout;
                let meter =
                    metered.then(|| Meter::new(&s.result_budget, ids::tenant_of(&project), &req, wait)).transpose()?;
                let limit = limit(&req, s.cfg.edge_call_timeout);
                // A sandbox that moved, or is moving: the call follows it (the same request
                // again, to the edge it is on now).
                let (f, req, meter_c) = (&f, &req, &meter);
                let answer = crate::moves::follow(s, &id, |edge| {
                    let project = &project;
                    async move {
                        let c = client(s, &edge, meter_c.clone())?;
                        forward::within(&edge, limit, f(c, to_edge(req.clone(), project)?)).await
                    }
                })
                .await
                .map(|(_, a)| a);
                if answer.as_ref().is_err_and(|e| e.reason == Reason::NotFound) {
                    // Gone, or the id names another project's sandbox now: ask the edge again
                    // next time.
                    projects.forget(&id);
                }
                answer.map(|a| (a, meter))
            })
        })
        .await?
        .into_inner();
        let mut resp = Response::new(answer);
        if let Some(m) = meter {
            resp.extensions_mut().insert(m);
        }
        Ok(resp)
    }

    async fn unary<Q, T, F, Fut>(&self, method: &'static str, request: Request<Q>, f: F) -> Result<Response<T>, Status>
    where
        Q: Routed + AnswerBytes + Clone + Send + Sync + 'static,
        T: Send + 'static,
        F: Fn(EdgeRuntime, Request<Q>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Response<T>, Status>> + Send,
    {
        self.forward(method, request, Q::limit, true, f).await
    }

    /// A server-streaming call: limited and audited until the edge's stream starts.
    async fn stream<Q, T, F, Fut>(
        &self,
        method: &'static str,
        request: Request<Q>,
        f: F,
    ) -> Result<Response<Relay<T>>, Status>
    where
        Q: Routed + AnswerBytes + Clone + Send + Sync + 'static,
        T: Send + 'static,
        F: Fn(EdgeRuntime, Request<Q>) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<Response<Streaming<T>>, Status>> + Send,
    {
        // A stream holds only what is in flight on it (HTTP/2 flow control): no reservation.
        let started = self.forward(method, request, |_, edge_timeout| Some(edge_timeout), false, f).await?;
        Ok(Response::new(relay(started.into_inner())))
    }
}

/// Forwards an upload: the first message is read and authorized, then it and the rest go to
/// the edge as they come. Messages after the first must name the same sandbox (or none).
///
/// A sandbox moving or moved away is followed as for every other call, as long as no message
/// past the first has been read: the edge refuses such an upload on its first message, so the
/// upload starts again where the sandbox is. Past that, the caller gets `unavailable` and sends
/// it again.
///
/// A failure on the caller's side aborts the forwarded stream with an error (see
/// `opendsec_proto::upload`: merely dropping the call would read as a clean end at the edge).
/// A caller that cancels its own call is, to tonic, a clean end: the protocol cannot tell that
/// from a complete upload.
async fn write_file(
    s: &Shared,
    projects: &ProjectCache,
    call: &mut Call,
    md: MetadataMap,
    incoming: Streaming<pb::WriteFileRequest>,
) -> Result<pb::WriteFileResponse, ApiError> {
    let mut incoming = incoming;
    let first = incoming
        .message()
        .await
        .map_err(|st| ApiError::from_status(&st))?
        .ok_or_else(|| ApiError::invalid("empty WriteFile stream: the first message names the sandbox and path"))?;
    let id = first.sandbox_id.clone();
    let (_, project, _) = authorized(s, projects, call, &md, &id, None).await?;
    let metadata = to_edge((), &project)?.into_parts().0;
    // Messages read past the first, over every attempt: an upload that read any cannot start
    // again.
    let read_on = std::sync::atomic::AtomicUsize::new(0);
    let incoming = tokio::sync::Mutex::new(incoming);
    let (_, answer) = crate::moves::follow(s, &id, |edge| {
        let (first, metadata, read_on, incoming, id) = (first.clone(), metadata.clone(), &read_on, &incoming, &id);
        async move {
            let mut incoming = incoming.lock().await;
            if read_on.load(std::sync::atomic::Ordering::SeqCst) > 0 {
                return Err(ApiError::new(
                    Reason::Unavailable,
                    format!("the upload to sandbox {id} was cut by a move; send it again"),
                ));
            }
            let ch = s.up.edge_channel(&edge, &s.edge_addr(&edge)?)?;
            let check = |m: &pb::WriteFileRequest| {
                read_on.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if m.sandbox_id.is_empty() || m.sandbox_id == *id {
                    Ok(())
                } else {
                    Err(ApiError::invalid(format!(
                        "WriteFile stream for sandbox {id} carries a message for another sandbox"
                    ))
                    .to_status())
                }
            };
            let hop = Hop { metadata, answer_wait: Some(s.cfg.edge_call_timeout), abort_wait: s.cfg.edge_call_timeout };
            let answer = upload::forward(ch, first, &mut incoming, check, hop).await;
            match answer {
                Ok(r) => Ok(r.into_inner()),
                Err(st) => {
                    let e = ApiError::from_status(&st).with("edge", edge.as_str());
                    if read_on.load(std::sync::atomic::Ordering::SeqCst) > 0
                        && (e.metadata.contains_key(MOVED_TO) || e.metadata.contains_key(MOVING_TO))
                    {
                        // Cut mid-way: what went out is gone with the refused stream.
                        return Err(ApiError::new(
                            Reason::Unavailable,
                            format!("the upload to sandbox {id} was cut by a move; send it again"),
                        ));
                    }
                    Err(e)
                }
            }
        }
    })
    .await?;
    Ok(answer)
}

#[tonic::async_trait]
impl Runtime for RuntimeService {
    async fn exec(&self, r: Request<pb::ExecRequest>) -> Result<Response<pb::ExecResult>, Status> {
        self.unary("Exec", r, |mut c, q| async move { c.exec(q).await }).await
    }

    type ExecStreamStream = Relay<pb::ExecChunk>;

    async fn exec_stream(&self, r: Request<pb::ExecRequest>) -> Result<Response<Self::ExecStreamStream>, Status> {
        self.stream("ExecStream", r, |mut c, q| async move { c.exec_stream(q).await }).await
    }

    async fn get_output(&self, r: Request<pb::GetOutputRequest>) -> Result<Response<pb::GetOutputResponse>, Status> {
        self.unary("GetOutput", r, |mut c, q| async move { c.get_output(q).await }).await
    }

    async fn close_session(
        &self,
        r: Request<pb::CloseSessionRequest>,
    ) -> Result<Response<pb::CloseSessionResponse>, Status> {
        self.unary("CloseSession", r, |mut c, q| async move { c.close_session(q).await }).await
    }

    type ReadFileStream = Relay<pb::FileChunk>;

    async fn read_file(&self, r: Request<pb::ReadFileRequest>) -> Result<Response<Self::ReadFileStream>, Status> {
        self.stream("ReadFile", r, |mut c, q| async move { c.read_file(q).await }).await
    }

    async fn write_file(
        &self,
        r: Request<Streaming<pb::WriteFileRequest>>,
    ) -> Result<Response<pb::WriteFileResponse>, Status> {
        let (md, _, incoming) = r.into_parts();
        let projects = self.projects.clone();
        run(&self.shared, "WriteFile", move |s, call| {
            Box::pin(async move { write_file(s, &projects, call, md, incoming).await })
        })
        .await
    }

    async fn list_dir(&self, r: Request<pb::ListDirRequest>) -> Result<Response<pb::ListDirResponse>, Status> {
        self.unary("ListDir", r, |mut c, q| async move { c.list_dir(q).await }).await
    }

    async fn stat(&self, r: Request<pb::StatRequest>) -> Result<Response<pb::FileInfo>, Status> {
        self.unary("Stat", r, |mut c, q| async move { c.stat(q).await }).await
    }

    async fn make_dir(&self, r: Request<pb::MakeDirRequest>) -> Result<Response<pb::MakeDirResponse>, Status> {
        self.unary("MakeDir", r, |mut c, q| async move { c.make_dir(q).await }).await
    }

    async fn remove(&self, r: Request<pb::RemoveRequest>) -> Result<Response<pb::RemoveResponse>, Status> {
        self.unary("Remove", r, |mut c, q| async move { c.remove(q).await }).await
    }

    async fn r#move(&self, r: Request<pb::MoveRequest>) -> Result<Response<pb::MoveResponse>, Status> {
        self.unary("Move", r, |mut c, q| async move { c.r#move(q).await }).await
    }

    async fn http_request(
        &self,
        r: Request<pb::HttpRequestRequest>,
    ) -> Result<Response<pb::HttpRequestResponse>, Status> {
        self.unary("HttpRequest", r, |mut c, q| async move { c.http_request(q).await }).await
    }

    async fn start_process(
        &self,
        r: Request<pb::StartProcessRequest>,
    ) -> Result<Response<pb::StartProcessResponse>, Status> {
        self.unary("StartProcess", r, |mut c, q| async move { c.start_process(q).await }).await
    }

    type ConnectProcessStream = Relay<pb::ProcessEvent>;

    async fn connect_process(
        &self,
        r: Request<pb::ConnectProcessRequest>,
    ) -> Result<Response<Self::ConnectProcessStream>, Status> {
        self.stream("ConnectProcess", r, |mut c, q| async move { c.connect_process(q).await }).await
    }

    async fn send_input(&self, r: Request<pb::SendInputRequest>) -> Result<Response<pb::SendInputResponse>, Status> {
        self.unary("SendInput", r, |mut c, q| async move { c.send_input(q).await }).await
    }

    async fn signal_process(
        &self,
        r: Request<pb::SignalProcessRequest>,
    ) -> Result<Response<pb::SignalProcessResponse>, Status> {
        self.unary("SignalProcess", r, |mut c, q| async move { c.signal_process(q).await }).await
    }

    async fn list_processes(
        &self,
        r: Request<pb::ListProcessesRequest>,
    ) -> Result<Response<pb::ListProcessesResponse>, Status> {
        self.unary("ListProcesses", r, |mut c, q| async move { c.list_processes(q).await }).await
    }

    type WatchDirStream = Relay<pb::WatchDirEvent>;
    async fn watch_dir(&self, r: Request<pb::WatchDirRequest>) -> Result<Response<Self::WatchDirStream>, Status> {
        self.stream("WatchDir", r, |mut c, q| async move { c.watch_dir(q).await }).await
    }

    async fn create_watcher(
        &self,
        r: Request<pb::WatchDirRequest>,
    ) -> Result<Response<pb::CreateWatcherResponse>, Status> {
        self.unary("CreateWatcher", r, |mut c, q| async move { c.create_watcher(q).await }).await
    }

    async fn get_watcher_events(
        &self,
        r: Request<pb::GetWatcherEventsRequest>,
    ) -> Result<Response<pb::GetWatcherEventsResponse>, Status> {
        self.unary("GetWatcherEvents", r, |mut c, q| async move { c.get_watcher_events(q).await }).await
    }

    async fn remove_watcher(
        &self,
        r: Request<pb::RemoveWatcherRequest>,
    ) -> Result<Response<pb::RemoveWatcherResponse>, Status> {
        self.unary("RemoveWatcher", r, |mut c, q| async move { c.remove_watcher(q).await }).await
    }

    type RunCodeStream = Relay<pb::CodeEvent>;
    async fn run_code(&self, r: Request<pb::RunCodeRequest>) -> Result<Response<Self::RunCodeStream>, Status> {
        self.stream("RunCode", r, |mut c, q| async move { c.run_code(q).await }).await
    }

    async fn create_code_context(
        &self,
        r: Request<pb::CreateCodeContextRequest>,
    ) -> Result<Response<pb::CodeContext>, Status> {
        self.unary("CreateCodeContext", r, |mut c, q| async move { c.create_code_context(q).await }).await
    }

    async fn list_code_contexts(
        &self,
        r: Request<pb::ListCodeContextsRequest>,
    ) -> Result<Response<pb::ListCodeContextsResponse>, Status> {
        self.unary("ListCodeContexts", r, |mut c, q| async move { c.list_code_contexts(q).await }).await
    }

    async fn restart_code_context(
        &self,
        r: Request<pb::CodeContextRequest>,
    ) -> Result<Response<pb::CodeContext>, Status> {
        self.unary("RestartCodeContext", r, |mut c, q| async move { c.restart_code_context(q).await }).await
    }

    async fn remove_code_context(
        &self,
        r: Request<pb::CodeContextRequest>,
    ) -> Result<Response<pb::RemoveCodeContextResponse>, Status> {
        self.unary("RemoveCodeContext", r, |mut c, q| async move { c.remove_code_context(q).await }).await
    }

    async fn resize_process(
        &self,
        r: Request<pb::ResizeProcessRequest>,
    ) -> Result<Response<pb::ResizeProcessResponse>, Status> {
        self.unary("ResizeProcess", r, |mut c, q| async move { c.resize_process(q).await }).await
    }

    type WatchStream = Relay<pb::Heartbeat>;

    async fn watch(&self, r: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        self.stream("Watch", r, |mut c, q| async move { c.watch(q).await }).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cache_remembers_projects() {
        let c = ProjectCache::new(10);
        assert_eq!(c.get("e1.a"), None);
        c.put("e1.a", "root/a");
        c.put("e1.b", "root/b");
        assert_eq!(c.get("e1.a").as_deref(), Some("root/a"));
        assert_eq!(c.get("e1.b").as_deref(), Some("root/b"));
    }

    #[test]
    fn a_full_cache_drops_its_oldest_entry() {
        let c = ProjectCache::new(2);
        c.put("e1.a", "root/a");
        c.put("e1.b", "root/b");
        c.put("e1.c", "root/c");
        assert_eq!(c.len(), 2);
        assert_eq!(c.get("e1.a"), None, "the oldest went");
        assert_eq!(c.get("e1.b").as_deref(), Some("root/b"));
        assert_eq!(c.get("e1.c").as_deref(), Some("root/c"));
    }

    #[test]
    fn putting_a_known_id_again_changes_nothing() {
        let c = ProjectCache::new(2);
        c.put("e1.a", "root/a");
        c.put("e1.a", "root/x");
        c.put("e1.b", "root/b");
        assert_eq!(c.len(), 2);
        assert_eq!(c.get("e1.a").as_deref(), Some("root/a"), "a project never changes");
        // Only one copy of e1.a in the eviction order: the next insert drops it, not e1.b.
        c.put("e1.c", "root/c");
        assert_eq!(c.get("e1.a"), None);
        assert_eq!(c.get("e1.b").as_deref(), Some("root/b"));
        assert_eq!(c.len(), 2);
    }

    #[test]
    fn a_cache_of_size_zero_still_holds_one() {
        let c = ProjectCache::new(0);
        c.put("e1.a", "root/a");
        assert_eq!(c.get("e1.a").as_deref(), Some("root/a"));
    }

    #[test]
    fn exec_and_http_get_their_own_timeout_on_top_of_the_edges() {
        let edge = Duration::from_secs(30);
        assert_eq!(exec_limit(0, edge), None, "no timeout: no limit here");
        assert_eq!(exec_limit(5_000, edge), Some(Duration::from_secs(35)));
        let http = pb::HttpRequestRequest::default();
        assert_eq!(http.limit(edge), Some(Duration::from_secs(60)));
        let other = pb::StatRequest::default();
        assert_eq!(other.limit(edge), Some(edge));
    }
}
