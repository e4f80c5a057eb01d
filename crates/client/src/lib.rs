//! The Rust client of opendsec's public API, used by `opendsecctl` and the end-to-end tests.
//!
//! - Several apiserver addresses are used round-robin; a call that fails with `unavailable`
//!   is retried on the next address with backoff, within `retry_timeout`.
//! - Errors are [`ApiError`]s: decide on `err.reason`, never on the message.
//! - `create_sandbox` fills in a lease id before the first attempt, so a retry after a lost
//!   answer returns the sandbox the first attempt created instead of creating a second one.
#![forbid(unsafe_code)]

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use opendsec_common::{ApiError, Reason, grpc};
use opendsec_proto::v1 as pb;
use pb::admin_client::AdminClient;
use pb::images_client::ImagesClient;
use pb::sandboxes_client::SandboxesClient;
use tonic::metadata::AsciiMetadataValue;
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::Channel;

pub use opendsec_common::{ApiError as ClientError, Reason as ErrorReason};
pub use opendsec_proto::v1 as proto;

/// Environment variables every client reads.
pub const ENV_ADDR: &str = "OPENDSEC_ADDR";
pub const ENV_TOKEN: &str = "OPENDSEC_TOKEN";
pub const ENV_PROJECT: &str = "OPENDSEC_PROJECT";

/// Attaches `authorization: Bearer <token>` to every call.
#[derive(Clone)]
pub struct Bearer(Option<AsciiMetadataValue>);

impl Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
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
    retry_timeout: Duration,
}

/// A cheap-to-clone handle on the public API.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

impl Client {
    /// A client over `addrs` (`host:port`, tried round-robin) with an optional bearer token.
    /// Call it inside a tokio runtime (channels connect lazily on it).
    pub fn new(addrs: &[String], token: Option<&str>) -> Result<Client, ApiError> {
        let addrs: Vec<String> = addrs.iter().map(|a| a.trim().to_string()).filter(|a| !a.is_empty()).collect();
        if addrs.is_empty() {
            return Err(ApiError::invalid(format!("no apiserver address (set {ENV_ADDR} or --addr)")));
        }
        let channels = addrs.iter().map(|a| grpc::channel(a)).collect::<Result<Vec<_>, _>>()?;
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
                bearer: Bearer(bearer),
                retry_timeout: Duration::from_secs(30),
            }),
        })
    }

    /// `OPENDSEC_ADDR` (comma-separated) and `OPENDSEC_TOKEN`.
    pub fn from_env() -> Result<Client, ApiError> {
        let addrs: Vec<String> = std::env::var(ENV_ADDR)
            .unwrap_or_else(|_| "127.0.0.1:7000".into())
            .split(',')
            .map(str::to_string)
            .collect();
        let token = std::env::var(ENV_TOKEN).ok();
        Client::new(&addrs, token.as_deref())
    }

    /// How long calls keep retrying `unavailable` (default 30 s; zero: no retries).
    pub fn with_retry_timeout(self, d: Duration) -> Client {
        let inner = Inner {
            addrs: self.inner.addrs.clone(),
            channels: self.inner.channels.clone(),
            next: AtomicUsize::new(self.inner.next.load(Ordering::Relaxed)),
            bearer: self.inner.bearer.clone(),
            retry_timeout: d,
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

    /// Runs `f` on one address after another while it fails with `unavailable`.
    async fn retry<T, F, Fut>(&self, f: F) -> Result<T, ApiError>
    where
        F: Fn(AuthedChannel) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let deadline = Instant::now() + self.inner.retry_timeout;
        let mut backoff = Duration::from_millis(20);
        loop {
            match f(self.pick()).await {
                Ok(resp) => return Ok(resp.into_inner()),
                Err(status) => {
                    let err = ApiError::from_status(&status);
                    if err.reason != Reason::Unavailable || Instant::now() + backoff > deadline {
                        return Err(err);
                    }
                    tracing::debug!(reason = %err.reason, message = %err.message, "retrying");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                }
            }
        }
    }

    // ---- sandboxes

    pub async fn create_sandbox(&self, spec: pb::SandboxSpec) -> Result<pb::Sandbox, ApiError> {
        let req = pb::CreateSandboxRequest { spec: Some(spec), lease_id: opendsec_common::ids::new_lease_id() };
        self.create_sandbox_with(req).await
    }

    pub async fn create_sandbox_with(&self, req: pb::CreateSandboxRequest) -> Result<pb::Sandbox, ApiError> {
        self.retry(|ch| {
            let req = req.clone();
            async move { stub_s(ch).create_sandbox(req).await }
        })
        .await
    }

    /// Starts a batch creation; results arrive on the stream as each sandbox completes.
    pub async fn create_sandboxes(
        &self,
        spec: pb::SandboxSpec,
        count: u32,
    ) -> Result<tonic::Streaming<pb::CreateSandboxesResponse>, ApiError> {
        let req = pb::CreateSandboxesRequest { spec: Some(spec), count };
        self.retry(|ch| {
            let req = req.clone();
            async move { stub_s(ch).create_sandboxes(req).await }
        })
        .await
    }

    pub async fn get_sandbox(&self, id: &str) -> Result<pb::Sandbox, ApiError> {
        let req = pb::GetSandboxRequest { id: id.to_string() };
        self.retry(|ch| {
            let req = req.clone();
            async move { stub_s(ch).get_sandbox(req).await }
        })
        .await
    }

    pub async fn list_sandboxes(&self, req: pb::ListSandboxesRequest) -> Result<pb::ListSandboxesResponse, ApiError> {
        self.retry(|ch| {
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
        self.retry(|ch| {
            let req = req.clone();
            async move { stub_s(ch).stop_sandbox(req).await }
        })
        .await
    }

    pub async fn pause_sandbox(&self, id: &str) -> Result<pb::Sandbox, ApiError> {
        let req = pb::PauseSandboxRequest { id: id.to_string() };
        self.retry(|ch| {
            let req = req.clone();
            async move { stub_s(ch).pause_sandbox(req).await }
        })
        .await
    }

    pub async fn resume_sandbox(&self, id: &str) -> Result<pb::Sandbox, ApiError> {
        let req = pb::ResumeSandboxRequest { id: id.to_string() };
        self.retry(|ch| {
            let req = req.clone();
            async move { stub_s(ch).resume_sandbox(req).await }
        })
        .await
    }

    pub async fn set_sandbox_timeout(&self, req: pb::SetSandboxTimeoutRequest) -> Result<pb::Sandbox, ApiError> {
        self.retry(|ch| {
            let req = req.clone();
            async move { stub_s(ch).set_sandbox_timeout(req).await }
        })
        .await
    }
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

/// One method per RPC of a service, each retried on `unavailable` like the sandbox calls.
macro_rules! unary_calls {
    ($stub:ident: $($name:ident($req:ty) -> $resp:ty;)*) => {
        impl Client {
            $(
                pub async fn $name(&self, req: $req) -> Result<$resp, ApiError> {
                    self.retry(|ch| {
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
unary_calls! {stub_i:
    register_image(pb::RegisterImageRequest) -> pb::Image;
    compose_image(pb::ComposeImageRequest) -> pb::Image;
    delete_image(pb::DeleteImageRequest) -> pb::DeleteImageResponse;
    list_images(pb::ListImagesRequest) -> pb::ListImagesResponse;
    get_image(pb::GetImageRequest) -> pb::Image;
}

unary_calls! {stub_a:
    who_am_i(pb::WhoAmIRequest) -> pb::WhoAmIResponse;
    create_project(pb::CreateProjectRequest) -> pb::Project;
    get_project(pb::GetProjectRequest) -> pb::Project;
    list_projects(pb::ListProjectsRequest) -> pb::ListProjectsResponse;
    delete_project(pb::DeleteProjectRequest) -> pb::DeleteProjectResponse;
    set_quota(pb::SetQuotaRequest) -> pb::Project;
    create_principal(pb::CreatePrincipalRequest) -> pb::Principal;
    list_principals(pb::ListPrincipalsRequest) -> pb::ListPrincipalsResponse;
    delete_principal(pb::DeletePrincipalRequest) -> pb::DeletePrincipalResponse;
    create_token(pb::CreateTokenRequest) -> pb::CreateTokenResponse;
    list_tokens(pb::ListTokensRequest) -> pb::ListTokensResponse;
    revoke_token(pb::RevokeTokenRequest) -> pb::RevokeTokenResponse;
    grant(pb::GrantRequest) -> pb::GrantResponse;
    revoke_grant(pb::RevokeGrantRequest) -> pb::RevokeGrantResponse;
    list_grants(pb::ListGrantsRequest) -> pb::ListGrantsResponse;
    get_usage(pb::GetUsageRequest) -> pb::GetUsageResponse;
    backup(pb::BackupRequest) -> pb::BackupResponse;
    restore(pb::RestoreRequest) -> pb::RestoreResponse;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn needs_an_address() {
        assert_eq!(Client::new(&[], None).err().map(|e| e.reason), Some(Reason::InvalidArgument));
        assert!(Client::new(&["127.0.0.1:1".into(), " ".into()], Some("dsk.a.b")).is_ok());
    }

    #[tokio::test]
    async fn unreachable_addresses_give_unavailable_after_the_retry_budget() {
        let c = Client::new(&["127.0.0.1:1".into()], None).unwrap().with_retry_timeout(Duration::from_millis(100));
        let err = c.get_sandbox("e.x").await.unwrap_err();
        assert_eq!(err.reason, Reason::Unavailable);
    }
}
