//! The Rust client of opendsec's public API, used by `opendsecctl` and the end-to-end tests.
//!
//! - Several apiserver addresses are used round-robin; each attempt of a call goes to the next.
//! - Retries follow the one policy of `opendsec_common::retry` (docs/errors.md, "Retries"):
//!   each call's class says which reasons it retries; backoff with full jitter, never sooner
//!   than a `retry_after_ms` hint, within `retry_timeout` (30 s) from the first attempt.
//! - Errors are [`ApiError`]s: decide on `err.reason`, never on the message.
//! - `create_sandbox` fills in a lease id before the first attempt, so a retry after a lost
//!   answer returns the sandbox the first attempt created instead of creating a second one.
//! - Runtime calls (exec, files, processes) go through the apiserver to the sandbox's edge.
//!   `exec`/`exec_stream` fill in a request id before the first attempt: a retry then finds the
//!   command the first attempt started (the agent dedupes by request id) instead of running it
//!   twice. Calls that change something and carry no such id (start a process, send input,
//!   HTTP other than GET/HEAD, append, remove, move, mkdir without parents, signal) are made
//!   once, since an `unavailable` answer may come after the change was made.
#![forbid(unsafe_code)]

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use opendsec_common::retry::{self, CallClass, Policy};
use opendsec_common::{ApiError, Reason, grpc};
use opendsec_proto::v1 as pb;
use pb::admin_client::AdminClient;
use pb::images_client::ImagesClient;
use pb::runtime_client::RuntimeClient;
use pb::sandboxes_client::SandboxesClient;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

pub use opendsec_proto::upload;

pub use opendsec_common::{ApiError as ClientError, Reason as ErrorReason};
pub use opendsec_proto::v1 as proto;
pub use upload::Upload;

/// Environment variables every client reads.
pub const ENV_ADDR: &str = "OPENDSEC_ADDR";
pub const ENV_TOKEN: &str = "OPENDSEC_TOKEN";
pub const ENV_PROJECT: &str = "OPENDSEC_PROJECT";

/// Attaches `authorization: Bearer <token>` to every call, and the address of the client a
/// gateway calls for ([`grpc::CLIENT_ADDR_HEADER`]), if any.
#[derive(Debug, Clone)]
pub struct Bearer(Option<AsciiMetadataValue>, Option<AsciiMetadataValue>, bool);

impl Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        if let Some(v) = &self.1 {
            req.metadata_mut().insert(grpc::CLIENT_ADDR_HEADER, v.clone());
        }
        if self.2 {
            req.metadata_mut().insert(grpc::PUBLIC_TRAFFIC_HEADER, AsciiMetadataValue::from_static("1"));
        }
        Ok(req)
    }
}

pub type AuthedChannel = InterceptedService<Channel, Bearer>;

struct Inner {
    addrs: Vec<String>,
    channels: Vec<Channel>,
    next: AtomicUsize,
    bearer: Bearer,
    policy: Policy,
}

/// A cheap-to-clone handle on the public API.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}
impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").finish_non_exhaustive()
    }
}

impl Client {
    /// A client over `addrs` (`host:port`, tried round-robin) with an optional bearer token,
    /// speaking TLS (or plain text) as `tls` says. Call it inside a tokio runtime (channels
    /// connect lazily on it).
    pub fn new(addrs: &[String], token: Option<&str>, tls: &grpc::PublicTls) -> Result<Client, ApiError> {
        let addrs: Vec<String> = addrs.iter().map(|a| a.trim().to_string()).filter(|a| !a.is_empty()).collect();
        if addrs.is_empty() {
            return Err(ApiError::invalid(format!("no apiserver address (set {ENV_ADDR} or --addr)")));
        }
        let channels = addrs.iter().map(|a| grpc::public_channel(a, tls)).collect::<Result<Vec<_>, _>>()?;
        let bearer = match token {
            Some(t) => Some(
                format!("Bearer {}", t.trim())
                    .parse()
                    .map_err(|_| ApiError::new(Reason::Unauthenticated, "token is not ASCII"))?,
            ),
            None => None,
        };
        Ok(Client {
            inner: Arc::new(Inner {
                addrs,
                channels,
                next: AtomicUsize::new(rand::random::<u32>() as usize),
                bearer: Bearer(bearer, None, false),
                policy: Policy::DEFAULT,
            }),
        })
    }

    /// `OPENDSEC_ADDR` (comma-separated), `OPENDSEC_TOKEN`, and `OPENDSEC_CA` or
    /// `OPENDSEC_INSECURE_PLAINTEXT` ([`grpc::PublicTls::from_env`]).
    pub fn from_env() -> Result<Client, ApiError> {
        let addrs: Vec<String> = std::env::var(ENV_ADDR)
            .unwrap_or_else(|_| "127.0.0.1:7000".into())
            .split(',')
            .map(str::to_string)
            .collect();
        let token = std::env::var(ENV_TOKEN).ok();
        Client::new(&addrs, token.as_deref(), &grpc::PublicTls::from_env()?)
    }

    /// How long, from its first attempt, a call keeps retrying (default 30 s; zero: no
    /// retries). Which failures are retried is the call's class ([`retry::CALLS`]).
    pub fn with_retry_timeout(self, d: Duration) -> Client {
        let inner = Inner {
            addrs: self.inner.addrs.clone(),
            channels: self.inner.channels.clone(),
            next: AtomicUsize::new(self.inner.next.load(Ordering::Relaxed)),
            bearer: self.inner.bearer.clone(),
            policy: self.inner.policy.with_budget(d),
        };
        Client { inner: Arc::new(inner) }
    }

    /// The same connections, calling with another token (a gateway serving many callers each
    /// with their own).
    pub fn with_token(&self, token: &str) -> Result<Client, ApiError> {
        self.with_token_for(token, None)
    }

    /// [`Client::with_token`] for the client at `addr`, named to the apiserver in
    /// [`grpc::CLIENT_ADDR_HEADER`] (believed only from a gateway's certificate).
    pub fn with_token_for(&self, token: &str, addr: Option<std::net::IpAddr>) -> Result<Client, ApiError> {
        let bearer = format!("Bearer {}", token.trim())
            .parse()
            .map_err(|_| ApiError::new(Reason::Unauthenticated, "token is not ASCII"))?;
        let addr = addr.and_then(|a| a.to_string().parse().ok());
        let inner = Inner {
            addrs: self.inner.addrs.clone(),
            channels: self.inner.channels.clone(),
            next: AtomicUsize::new(self.inner.next.fetch_add(1, Ordering::Relaxed)),
            bearer: Bearer(Some(bearer), addr, false),
            policy: self.inner.policy,
        };
        Ok(Client { inner: Arc::new(inner) })
    }

    /// The same connections, calling for nobody on behalf of the client at `addr`
    /// ([`grpc::PUBLIC_TRAFFIC_HEADER`]): an E2B gateway reaching the ports of sandboxes
    /// whose traffic is public. Only `HttpRequest` is served so, and only from a gateway's
    /// certificate.
    pub fn public_for(&self, addr: Option<std::net::IpAddr>) -> Client {
        let addr = addr.and_then(|a| a.to_string().parse().ok());
        let inner = Inner {
            addrs: self.inner.addrs.clone(),
            channels: self.inner.channels.clone(),
            next: AtomicUsize::new(self.inner.next.fetch_add(1, Ordering::Relaxed)),
            bearer: Bearer(None, addr, true),
            policy: self.inner.policy,
        };
        Client { inner: Arc::new(inner) }
    }

    pub fn addrs(&self) -> &[String] {
        &self.inner.addrs
    }

    fn pick(&self) -> AuthedChannel {
        let i = self.inner.next.fetch_add(1, Ordering::Relaxed) % self.inner.channels.len();
        InterceptedService::new(self.inner.channels[i].clone(), self.inner.bearer.clone())
    }

    /// Raw stubs on the next address (no retries), for callers that need streaming control.
    pub fn sandboxes_stub(&self) -> SandboxesClient<AuthedChannel> {
        SandboxesClient::new(self.pick())
            .max_decoding_message_size(grpc::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(grpc::MAX_MESSAGE_BYTES)
    }

    pub fn images_stub(&self) -> ImagesClient<AuthedChannel> {
        stub_i(self.pick())
    }

    pub fn admin_stub(&self) -> AdminClient<AuthedChannel> {
        AdminClient::new(self.pick())
            .max_decoding_message_size(grpc::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(grpc::MAX_MESSAGE_BYTES)
    }

    pub fn runtime_stub(&self) -> RuntimeClient<AuthedChannel> {
        stub_r(self.pick())
    }

    /// Makes the call `f` on one address after another, again while its class retries the
    /// error ([`retry`]: backoff with full jitter, `retry_after_ms` honoured, within the budget).
    async fn call<T, F, Fut>(&self, class: CallClass, f: F) -> Result<T, ApiError>
    where
        F: Fn(AuthedChannel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        retry::run(class, self.inner.policy, || {
            let fut = f(self.pick());
            async move { fut.await.map(tonic::Response::into_inner).map_err(|s| ApiError::from_status(&s)) }
        })
        .await
    }

    // ---- sandboxes

    /// Creates a sandbox under a lease id of its own. Retried as a `create` call; after a
    /// `no_capacity` (every edge refused: nothing was made) the next attempt takes a fresh
    /// lease id, since the refused one now names a FAILED sandbox.
    pub async fn create_sandbox(&self, spec: pb::SandboxSpec) -> Result<pb::Sandbox, ApiError> {
        let req = pb::CreateSandboxRequest { spec: Some(spec), lease_id: opendsec_common::ids::new_lease_id() };
        self.create(req, true).await
    }

    /// Creates a sandbox under the caller's lease id (an idempotency key: the same key answers
    /// with the same sandbox). Retried as a `create` call except on `no_capacity`, whose
    /// refused key now names a FAILED sandbox: that outcome is the caller's to see.
    pub async fn create_sandbox_with(&self, req: pb::CreateSandboxRequest) -> Result<pb::Sandbox, ApiError> {
        self.create(req, false).await
    }

    /// One creation, retried as a `create` call; `own_lease`: the lease id is ours to replace
    /// after a `no_capacity`, else that refusal is final.
    async fn create(&self, req: pb::CreateSandboxRequest, own_lease: bool) -> Result<pb::Sandbox, ApiError> {
        let class = const { retry::class("Sandboxes/CreateSandbox") };
        let req = std::sync::Mutex::new(req);
        let current = || req.lock().unwrap_or_else(|p| p.into_inner()).clone();
        retry::run_while(
            self.inner.policy,
            |e| class.retries(e.reason) && (own_lease || e.reason != Reason::NoCapacity),
            || {
                let (ch, attempt, req) = (self.pick(), current(), &req);
                async move {
                    let answer = stub_s(ch).create_sandbox(attempt).await;
                    answer.map(tonic::Response::into_inner).map_err(|s| {
                        let e = ApiError::from_status(&s);
                        if own_lease && e.reason == Reason::NoCapacity {
                            req.lock().unwrap_or_else(|p| p.into_inner()).lease_id =
                                opendsec_common::ids::new_lease_id();
                        }
                        e
                    })
                }
            },
        )
        .await
    }

    /// Starts a batch creation; results arrive on the stream as each sandbox completes.
    pub async fn create_sandboxes(
        &self,
        spec: pb::SandboxSpec,
        count: u32,
    ) -> Result<tonic::Streaming<pb::CreateSandboxesResponse>, ApiError> {
        self.create_sandboxes_patched(spec, count, Vec::new()).await
    }

    /// [`Client::create_sandboxes`] with per-item changes: `patches[i]` adds to (or replaces)
    /// item `i`'s env and labels.
    pub async fn create_sandboxes_patched(
        &self,
        spec: pb::SandboxSpec,
        count: u32,
        patches: Vec<pb::ItemPatch>,
    ) -> Result<tonic::Streaming<pb::CreateSandboxesResponse>, ApiError> {
        let req = pb::CreateSandboxesRequest { spec: Some(spec), count, patches };
        self.call(const { retry::class("Sandboxes/CreateSandboxes") }, |ch| {
            let req = req.clone();
            async move { stub_s(ch).create_sandboxes(req).await }
        })
        .await
    }

    /// Forks sandbox `id` into `count` (1..=256) copies of its file system: one snapshot
    /// (named `snapshot_name`, or `forks/<lease>:<ms>` when empty), results streamed as a
    /// batch's.
    pub async fn fork_sandbox(
        &self,
        req: pb::ForkSandboxRequest,
    ) -> Result<tonic::Streaming<pb::CreateSandboxesResponse>, ApiError> {
        self.call(const { retry::class("Sandboxes/ForkSandbox") }, |ch| {
            let req = req.clone();
            async move { stub_s(ch).fork_sandbox(req).await }
        })
        .await
    }

    /// Moves a sandbox to edge `to` under the same id (needs `edge.manage` on root).
    pub async fn move_sandbox(&self, id: &str, to: &str) -> Result<pb::Sandbox, ApiError> {
        let req = pb::MoveSandboxRequest { id: id.to_string(), to_edge: to.to_string() };
        self.call(const { retry::class("Sandboxes/MoveSandbox") }, |ch| {
            let req = req.clone();
            async move { stub_s(ch).move_sandbox(req).await }
        })
        .await
    }

    /// Drains edge `edge` (or, with `undrain`, ends its drain); answers where it stands.
    pub async fn drain_edge(&self, edge: &str, undrain: bool) -> Result<pb::DrainEdgeResponse, ApiError> {
        self.drain_call(pb::DrainEdgeRequest { edge: edge.to_string(), undrain, query: false }).await
    }

    /// Where edge `edge` stands (draining, sandboxes on it), changing nothing.
    pub async fn edge_drain_status(&self, edge: &str) -> Result<pb::DrainEdgeResponse, ApiError> {
        self.drain_call(pb::DrainEdgeRequest { edge: edge.to_string(), undrain: false, query: true }).await
    }

    async fn drain_call(&self, req: pb::DrainEdgeRequest) -> Result<pb::DrainEdgeResponse, ApiError> {
        self.call(const { retry::class("Sandboxes/DrainEdge") }, |ch| {
            let req = req.clone();
            async move { stub_s(ch).drain_edge(req).await }
        })
        .await
    }

    /// Saves the sandbox's session now (`spec.session`), as its stop would.
    pub async fn save_session(&self, id: &str) -> Result<pb::SessionSaved, ApiError> {
        let req = pb::SaveSessionRequest { id: id.to_string() };
        self.call(const { retry::class("Sandboxes/SaveSession") }, |ch| {
            let req = req.clone();
            async move { stub_s(ch).save_session(req).await }
        })
        .await
    }

    /// The caller's tokens for sandbox `id` (the same each time): one for every Runtime call
    /// on it, one for its ports only; both end with the sandbox.
    pub async fn create_sandbox_tokens(&self, id: &str) -> Result<pb::SandboxTokens, ApiError> {
        let req = pb::CreateSandboxTokensRequest { sandbox_id: id.to_string() };
        self.call(const { retry::class("Sandboxes/CreateSandboxTokens") }, |ch| {
            let req = req.clone();
            async move { stub_s(ch).create_sandbox_tokens(req).await }
        })
        .await
    }

    pub async fn get_sandbox(&self, id: &str) -> Result<pb::Sandbox, ApiError> {
        let req = pb::GetSandboxRequest { id: id.to_string() };
        self.call(const { retry::class("Sandboxes/GetSandbox") }, |ch| {
            let req = req.clone();
            async move { stub_s(ch).get_sandbox(req).await }
        })
        .await
    }

    pub async fn get_sandbox_metrics(&self, id: &str) -> Result<pb::SandboxMetrics, ApiError> {
        let req = pb::GetSandboxMetricsRequest { id: id.to_string() };
        self.call(const { retry::class("Sandboxes/GetSandboxMetrics") }, |ch| {
            let req = req.clone();
            async move { SandboxesClient::new(ch).get_sandbox_metrics(req).await }
        })
        .await
    }

    /// Snapshots sandbox `id`'s file system into image `name` ("repo[:tag]") of its project
    /// (`pack_diff`: without /tmp, caches and histories). The sandbox keeps running.
    pub async fn create_snapshot(&self, id: &str, name: &str, pack_diff: bool) -> Result<pb::Snapshot, ApiError> {
        let req = pb::CreateSnapshotRequest { id: id.to_string(), name: name.to_string(), pack_diff };
        self.call(const { retry::class("Sandboxes/CreateSnapshot") }, |ch| {
            let req = req.clone();
            async move { SandboxesClient::new(ch).create_snapshot(req).await }
        })
        .await
    }

    pub async fn list_sandboxes(&self, req: pb::ListSandboxesRequest) -> Result<pb::ListSandboxesResponse, ApiError> {
        self.call(const { retry::class("Sandboxes/ListSandboxes") }, |ch| {
            let req = req.clone();
            async move { stub_s(ch).list_sandboxes(req).await }
        })
        .await
    }

    /// Every page of a listing.
    pub async fn list_all_sandboxes(&self, mut req: pb::ListSandboxesRequest) -> Result<Vec<pb::Sandbox>, ApiError> {
        let mut out = Vec::new();
        loop {
            let page = self.list_sandboxes(req.clone()).await?;
            out.extend(page.sandboxes);
            if page.next_page_token.is_empty() {
                return Ok(out);
            }
            req.page_token = page.next_page_token;
        }
    }

    pub async fn stop_sandbox(&self, id: &str) -> Result<pb::Sandbox, ApiError> {
        let req = pb::StopSandboxRequest { id: id.to_string() };
        self.call(const { retry::class("Sandboxes/StopSandbox") }, |ch| {
            let req = req.clone();
            async move { stub_s(ch).stop_sandbox(req).await }
        })
        .await
    }

    pub async fn pause_sandbox(&self, id: &str) -> Result<pb::Sandbox, ApiError> {
        let req = pb::PauseSandboxRequest { id: id.to_string() };
        self.call(const { retry::class("Sandboxes/PauseSandbox") }, |ch| {
            let req = req.clone();
            async move { stub_s(ch).pause_sandbox(req).await }
        })
        .await
    }

    pub async fn resume_sandbox(&self, id: &str) -> Result<pb::Sandbox, ApiError> {
        let req = pb::ResumeSandboxRequest { id: id.to_string() };
        self.call(const { retry::class("Sandboxes/ResumeSandbox") }, |ch| {
            let req = req.clone();
            async move { stub_s(ch).resume_sandbox(req).await }
        })
        .await
    }

    /// Replaces the egress rules of a running or paused sandbox.
    pub async fn update_network(&self, id: &str, egress: Vec<pb::EgressRule>) -> Result<pb::Sandbox, ApiError> {
        let req = pb::UpdateNetworkRequest { id: id.to_string(), network: Some(pb::NetworkSpec { egress }) };
        self.call(const { retry::class("Sandboxes/UpdateNetwork") }, |ch| {
            let req = req.clone();
            async move { stub_s(ch).update_network(req).await }
        })
        .await
    }

    pub async fn set_sandbox_timeout(&self, req: pb::SetSandboxTimeoutRequest) -> Result<pb::Sandbox, ApiError> {
        self.call(const { retry::class("Sandboxes/SetSandboxTimeout") }, |ch| {
            let req = req.clone();
            async move { stub_s(ch).set_sandbox_timeout(req).await }
        })
        .await
    }
}

fn stub_r(ch: AuthedChannel) -> RuntimeClient<AuthedChannel> {
    RuntimeClient::new(ch)
        .max_decoding_message_size(grpc::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(grpc::MAX_MESSAGE_BYTES)
}

fn stub_s(ch: AuthedChannel) -> SandboxesClient<AuthedChannel> {
    SandboxesClient::new(ch)
        .max_decoding_message_size(grpc::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(grpc::MAX_MESSAGE_BYTES)
}

fn stub_a(ch: AuthedChannel) -> AdminClient<AuthedChannel> {
    AdminClient::new(ch)
        .max_decoding_message_size(grpc::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(grpc::MAX_MESSAGE_BYTES)
}

fn stub_i(ch: AuthedChannel) -> ImagesClient<AuthedChannel> {
    ImagesClient::new(ch)
        .max_decoding_message_size(grpc::MAX_MESSAGE_BYTES)
        .max_encoding_message_size(grpc::MAX_MESSAGE_BYTES)
}

/// One method per RPC of a service, each made as its class ([`retry::CALLS`]) says.
macro_rules! unary_calls {
    ($service:literal $stub:ident: $($name:ident($req:ty) -> $resp:ty = $rpc:literal;)*) => {
        impl Client {
            $(
                pub async fn $name(&self, req: $req) -> Result<$resp, ApiError> {
                    self.call(const { retry::class(concat!($service, "/", $rpc)) }, |ch| {
                        let req = req.clone();
                        async move { $stub(ch).$name(req).await }
                    })
                    .await
                }
            )*
        }
    };
}

// Images: writing needs `layer.publish` on the image's project, reading `layer.use`.
unary_calls! {"Images" stub_i:
    register_image(pb::RegisterImageRequest) -> pb::Image = "RegisterImage";
    compose_image(pb::ComposeImageRequest) -> pb::Image = "ComposeImage";
    delete_image(pb::DeleteImageRequest) -> pb::DeleteImageResponse = "DeleteImage";
    list_images(pb::ListImagesRequest) -> pb::ListImagesResponse = "ListImages";
    get_image(pb::GetImageRequest) -> pb::Image = "GetImage";
}

unary_calls! {"Admin" stub_a:
    who_am_i(pb::WhoAmIRequest) -> pb::WhoAmIResponse = "WhoAmI";
    create_project(pb::CreateProjectRequest) -> pb::Project = "CreateProject";
    get_project(pb::GetProjectRequest) -> pb::Project = "GetProject";
    list_projects(pb::ListProjectsRequest) -> pb::ListProjectsResponse = "ListProjects";
    delete_project(pb::DeleteProjectRequest) -> pb::DeleteProjectResponse = "DeleteProject";
    set_quota(pb::SetQuotaRequest) -> pb::Project = "SetQuota";
    set_egress_ceiling(pb::SetEgressCeilingRequest) -> pb::Project = "SetEgressCeiling";
    create_principal(pb::CreatePrincipalRequest) -> pb::Principal = "CreatePrincipal";
    list_principals(pb::ListPrincipalsRequest) -> pb::ListPrincipalsResponse = "ListPrincipals";
    delete_principal(pb::DeletePrincipalRequest) -> pb::DeletePrincipalResponse = "DeletePrincipal";
    create_token(pb::CreateTokenRequest) -> pb::CreateTokenResponse = "CreateToken";
    list_tokens(pb::ListTokensRequest) -> pb::ListTokensResponse = "ListTokens";
    revoke_token(pb::RevokeTokenRequest) -> pb::RevokeTokenResponse = "RevokeToken";
    grant(pb::GrantRequest) -> pb::GrantResponse = "Grant";
    revoke_grant(pb::RevokeGrantRequest) -> pb::RevokeGrantResponse = "RevokeGrant";
    list_grants(pb::ListGrantsRequest) -> pb::ListGrantsResponse = "ListGrants";
    get_usage(pb::GetUsageRequest) -> pb::GetUsageResponse = "GetUsage";
    backup(pb::BackupRequest) -> pb::BackupResponse = "Backup";
    iam_members(pb::IamMembersRequest) -> pb::IamMembersResponse = "IamMembers";
    add_iam_member(pb::AddIamMemberRequest) -> pb::IamMembersResponse = "AddIamMember";
    remove_iam_member(pb::RemoveIamMemberRequest) -> pb::IamMembersResponse = "RemoveIamMember";
    transfer_iam_leader(pb::TransferIamLeaderRequest) -> pb::IamMembersResponse = "TransferIamLeader";
    restore(pb::RestoreRequest) -> pb::RestoreResponse = "Restore";
    create_pool(pb::CreatePoolRequest) -> pb::Pool = "CreatePool";
    update_pool(pb::UpdatePoolRequest) -> pb::Pool = "UpdatePool";
    delete_pool(pb::DeletePoolRequest) -> pb::DeletePoolResponse = "DeletePool";
    get_pool(pb::GetPoolRequest) -> pb::Pool = "GetPool";
    list_pools(pb::ListPoolsRequest) -> pb::ListPoolsResponse = "ListPools";
}

/// A fresh exec request id: `[A-Za-z0-9._-]`, well under the 128 the agent accepts.
pub fn new_request_id() -> String {
    format!("req-{}", grpc::random_secret(24))
}

impl Client {
    /// Runs shell text in a session and waits for it. A missing request id is filled in first,
    /// so the retries on `unavailable` find the same command instead of running it again.
    pub async fn exec(&self, mut req: pb::ExecRequest) -> Result<pb::ExecResult, ApiError> {
        if req.request_id.is_empty() {
            req.request_id = new_request_id();
        }
        self.call(const { retry::class("Runtime/Exec") }, |ch| {
            let req = req.clone();
            async move { stub_r(ch).exec(req).await }
        })
        .await
    }

    /// Like [`Client::exec`], output streamed as it comes. The first chunk carries the request
    /// id; after a broken stream, the same request with the offsets received so far re-attaches.
    pub async fn exec_stream(&self, mut req: pb::ExecRequest) -> Result<tonic::Streaming<pb::ExecChunk>, ApiError> {
        if req.request_id.is_empty() {
            req.request_id = new_request_id();
        }
        self.call(const { retry::class("Runtime/ExecStream") }, |ch| {
            let req = req.clone();
            async move { stub_r(ch).exec_stream(req).await }
        })
        .await
    }

    pub async fn read_file(&self, req: pb::ReadFileRequest) -> Result<tonic::Streaming<pb::FileChunk>, ApiError> {
        self.call(const { retry::class("Runtime/ReadFile") }, |ch| {
            let req = req.clone();
            async move { stub_r(ch).read_file(req).await }
        })
        .await
    }

    /// Makes a directory: a `repeat` call with `parents` (an existing directory is fine), else
    /// made once.
    pub async fn make_dir(&self, req: pb::MakeDirRequest) -> Result<pb::MakeDirResponse, ApiError> {
        let how = if req.parents { const { retry::class("Runtime/MakeDir") } } else { CallClass::Once };
        self.call(how, |ch| {
            let req = req.clone();
            async move { stub_r(ch).make_dir(req).await }
        })
        .await
    }

    /// An HTTP request into the sandbox: GET and HEAD are `repeat` calls, others made once.
    pub async fn http_request(&self, req: pb::HttpRequestRequest) -> Result<pb::HttpRequestResponse, ApiError> {
        let how = if matches!(req.method.as_str(), "GET" | "HEAD") {
            CallClass::Repeat
        } else {
            const { retry::class("Runtime/HttpRequest") }
        };
        self.call(how, |ch| {
            let req = req.clone();
            async move { stub_r(ch).http_request(req).await }
        })
        .await
    }

    /// Uploads a stream of messages (the first names the sandbox and path); made once, since
    /// the stream cannot be replayed. To abort an upload, send [`Upload::Abort`] and wait for
    /// this call to fail: the server then sees a reset stream, not a short file's clean end
    /// (dropping the call instead would look like a clean end; see [`upload`]).
    pub async fn write_file<S>(&self, messages: S) -> Result<pb::WriteFileResponse, ApiError>
    where
        S: futures::Stream<Item = Upload<pb::WriteFileRequest>> + Send + 'static,
    {
        upload::write_file(self.pick(), messages)
            .await
            .map(tonic::Response::into_inner)
            .map_err(|s| ApiError::from_status(&s))
    }

    /// Writes `data` whole as one upload (`first` carries the sandbox, path and options; its
    /// data is replaced). A `repeat` call unless appending: a retry rewrites the same file from
    /// the start.
    pub async fn write_file_all(
        &self,
        first: pb::WriteFileRequest,
        data: &[u8],
    ) -> Result<pb::WriteFileResponse, ApiError> {
        const CHUNK: usize = 1 << 20;
        let mut msgs = Vec::with_capacity(data.len() / CHUNK + 1);
        let mut chunks = data.chunks(CHUNK);
        msgs.push(pb::WriteFileRequest { data: chunks.next().unwrap_or_default().to_vec(), ..first.clone() });
        let id = first.sandbox_id.clone();
        msgs.extend(chunks.map(|c| pb::WriteFileRequest {
            sandbox_id: id.clone(),
            data: c.to_vec(),
            ..Default::default()
        }));
        // The last message completes the upload (without it the agent writes nothing).
        if let Some(last) = msgs.last_mut() {
            last.finish = true;
        }
        let how = if first.append { CallClass::Once } else { const { retry::class("Runtime/WriteFile") } };
        self.call(how, |ch| {
            let msgs = msgs.clone();
            async move { upload::write_file(ch, tokio_stream::iter(msgs.into_iter().map(Upload::Message))).await }
        })
        .await
    }

    pub async fn connect_process(
        &self,
        req: pb::ConnectProcessRequest,
    ) -> Result<tonic::Streaming<pb::ProcessEvent>, ApiError> {
        self.call(const { retry::class("Runtime/ConnectProcess") }, |ch| {
            let req = req.clone();
            async move { stub_r(ch).connect_process(req).await }
        })
        .await
    }

    /// Code in a context; made once (a retry would run it twice).
    pub async fn run_code(&self, req: pb::RunCodeRequest) -> Result<tonic::Streaming<pb::CodeEvent>, ApiError> {
        self.call(const { retry::class("Runtime/RunCode") }, |ch| {
            let req = req.clone();
            async move { stub_r(ch).run_code(req).await }
        })
        .await
    }

    pub async fn watch_dir(&self, req: pb::WatchDirRequest) -> Result<tonic::Streaming<pb::WatchDirEvent>, ApiError> {
        self.call(const { retry::class("Runtime/WatchDir") }, |ch| {
            let req = req.clone();
            async move { stub_r(ch).watch_dir(req).await }
        })
        .await
    }

    pub async fn watch(&self, req: pb::WatchRequest) -> Result<tonic::Streaming<pb::Heartbeat>, ApiError> {
        self.call(const { retry::class("Runtime/Watch") }, |ch| {
            let req = req.clone();
            async move { stub_r(ch).watch(req).await }
        })
        .await
    }
}

// Runtime reads (and closing a session, which a repeat only finds done): retried.
unary_calls! {"Runtime" stub_r:
    get_output(pb::GetOutputRequest) -> pb::GetOutputResponse = "GetOutput";
    close_session(pb::CloseSessionRequest) -> pb::CloseSessionResponse = "CloseSession";
    list_dir(pb::ListDirRequest) -> pb::ListDirResponse = "ListDir";
    stat(pb::StatRequest) -> pb::FileInfo = "Stat";
    list_processes(pb::ListProcessesRequest) -> pb::ListProcessesResponse = "ListProcesses";
    remove_watcher(pb::RemoveWatcherRequest) -> pb::RemoveWatcherResponse = "RemoveWatcher";
    list_code_contexts(pb::ListCodeContextsRequest) -> pb::ListCodeContextsResponse = "ListCodeContexts";
    remove_code_context(pb::CodeContextRequest) -> pb::RemoveCodeContextResponse = "RemoveCodeContext";
    resize_process(pb::ResizeProcessRequest) -> pb::ResizeProcessResponse = "ResizeProcess";
}

// Runtime changes without a request id: made once.
unary_calls! {"Runtime" stub_r:
    remove(pb::RemoveRequest) -> pb::RemoveResponse = "Remove";
    r#move(pb::MoveRequest) -> pb::MoveResponse = "Move";
    start_process(pb::StartProcessRequest) -> pb::StartProcessResponse = "StartProcess";
    send_input(pb::SendInputRequest) -> pb::SendInputResponse = "SendInput";
    signal_process(pb::SignalProcessRequest) -> pb::SignalProcessResponse = "SignalProcess";
    create_watcher(pb::WatchDirRequest) -> pb::CreateWatcherResponse = "CreateWatcher";
    create_code_context(pb::CreateCodeContextRequest) -> pb::CodeContext = "CreateCodeContext";
    restart_code_context(pb::CodeContextRequest) -> pb::CodeContext = "RestartCodeContext";
    get_watcher_events(pb::GetWatcherEventsRequest) -> pb::GetWatcherEventsResponse = "GetWatcherEvents";
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn needs_an_address() {
        assert_eq!(
            Client::new(&[], None, &grpc::PublicTls::Plaintext).err().map(|e| e.reason),
            Some(Reason::InvalidArgument)
        );
        assert!(Client::new(&["127.0.0.1:1".into(), " ".into()], Some("dsk.a.b"), &grpc::PublicTls::Plaintext).is_ok());
    }

    #[tokio::test]
    async fn unreachable_addresses_give_unavailable_after_the_retry_budget() {
        let c = Client::new(&["127.0.0.1:1".into()], None, &grpc::PublicTls::Plaintext)
            .unwrap()
            .with_retry_timeout(Duration::from_millis(100));
        let err = c.get_sandbox("e.x").await.unwrap_err();
        assert_eq!(err.reason, Reason::Unavailable);
    }

    #[test]
    fn request_ids_are_fresh_and_in_the_agents_alphabet() {
        let (a, b) = (new_request_id(), new_request_id());
        assert_ne!(a, b);
        assert!(a.len() <= 128);
        assert!(a.chars().all(|c| c.is_ascii_alphanumeric() || "._-".contains(c)), "{a}");
    }

    #[tokio::test]
    async fn runtime_calls_without_a_request_id_are_made_once() {
        // A long retry budget: a retried call would not come back within the test's timeout.
        let c = Client::new(&["127.0.0.1:1".into()], None, &grpc::PublicTls::Plaintext)
            .unwrap()
            .with_retry_timeout(Duration::from_secs(3600));
        let once = tokio::time::timeout(
            Duration::from_secs(20),
            c.start_process(pb::StartProcessRequest { sandbox_id: "e.x".into(), ..Default::default() }),
        )
        .await
        .expect("start_process is not retried");
        assert_eq!(once.unwrap_err().reason, Reason::Unavailable);
    }
}
