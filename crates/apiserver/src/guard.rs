//! What runs before any public call is decoded: the caller must authenticate first (bearer
//! token, through the authentication cache), so an unauthenticated client never gets a message
//! decoded, never reaches a handler and costs at most one IAM call per token per negative TTL.
//! A source address with too many failed authentications in a window is paused: answered
//! `unauthenticated` without asking IAM (reference section 1, "authentication is paused for a
//! source address with too many failures").
//!
//! A token the apiserver already knows passes even from a paused source: the pause is against
//! guessing, and one address can be many clients (a proxy, a NAT).
//!
//! Once admitted, a call counts against its principal's calls in flight
//! (`max_calls_per_principal`) until its answer has been read (a stream's, until the stream
//! starts), which bounds the decoded requests and unread answers one principal makes an
//! apiserver hold. `Restore` (the one message allowed to be large: a
//! backup) is decoded only for a principal holding `iam.admin` on root; every other `Admin`
//! call's body is cut at [`crate::MAX_UNARY_REQUEST_BYTES`] as it arrives.
//!
//! The layer only admits; handlers authenticate again (a cache hit) to learn who calls. A call
//! it refuses for its token still gets an audit line (method, reason); calls from a paused
//! source do not, one by one: a flood cannot fill the audit log (the pause itself is logged).
use std::net::IpAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use opendsec_common::grpc::{CLIENT_ADDR_HEADER, PUBLIC_TRAFFIC_HEADER};
use opendsec_common::pki::Role;
use opendsec_common::{ApiError, Reason, time};
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::auth::{Identity, token_key};
use crate::state::Shared;

/// How soon a caller at its cap of calls in flight may try again.
const BUSY_RETRY_AFTER_MS: u64 = 100;
/// The path prefix of the public Admin service.
const ADMIN_PREFIX: &str = "/opendsec.v1.Admin/";

/// The layer in front of the public services.
#[derive(Clone)]
pub struct GuardLayer {
    shared: Arc<Shared>,
}

impl GuardLayer {
    pub fn new(shared: Arc<Shared>) -> GuardLayer {
        GuardLayer { shared }
    }
}

impl<S> tower::Layer<S> for GuardLayer {
    type Service = Guard<S>;

    fn layer(&self, inner: S) -> Guard<S> {
        Guard { inner, shared: self.shared.clone() }
    }
}

#[derive(Clone)]
pub struct Guard<S> {
    inner: S,
    shared: Arc<Shared>,
}

/// The public methods, as audit lines and metrics name them (a fixed set: a path from a
/// client never becomes a label).
const METHODS: &[&str] = &[
    "CreateSandbox",
    "CreateSandboxes",
    "GetSandbox",
    "GetSandboxMetrics",
    "CreateSnapshot",
    "ForkSandbox",
    "MoveSandbox",
    "DrainEdge",
    "SaveSession",
    "ListSandboxes",
    "StopSandbox",
    "PauseSandbox",
    "ResumeSandbox",
    "SetSandboxTimeout",
    "UpdateNetwork",
    "WhoAmI",
    "CreateProject",
    "GetProject",
    "ListProjects",
    "DeleteProject",
    "SetQuota",
    "SetEgressCeiling",
    "CreatePrincipal",
    "ListPrincipals",
    "DeletePrincipal",
    "CreateToken",
    "ListTokens",
    "RevokeToken",
    "Grant",
    "RevokeGrant",
    "ListGrants",
    "GetUsage",
    "Backup",
    "Restore",
    "IamMembers",
    "AddIamMember",
    "RemoveIamMember",
    "TransferIamLeader",
    "CreatePool",
    "UpdatePool",
    "DeletePool",
    "GetPool",
    "ListPools",
    "RegisterImage",
    "ComposeImage",
    "DeleteImage",
    "ListImages",
    "GetImage",
    "Exec",
    "ExecStream",
    "GetOutput",
    "CloseSession",
    "ReadFile",
    "WriteFile",
    "ListDir",
    "Stat",
    "MakeDir",
    "Remove",
    "Move",
    "WatchDir",
    "CreateWatcher",
    "GetWatcherEvents",
    "RemoveWatcher",
    "HttpRequest",
    "StartProcess",
    "ConnectProcess",
    "SendInput",
    "SignalProcess",
    "ListProcesses",
    "ResizeProcess",
    "RunCode",
    "CreateCodeContext",
    "ListCodeContexts",
    "RestartCodeContext",
    "RemoveCodeContext",
    "Watch",
    "CreateSandboxTokens",
];

/// The method of a gRPC path (`/opendsec.v1.Service/Method`), or "unknown".
fn method_of(path: &str) -> &'static str {
    let m = path.rsplit_once('/').map_or("", |(_, m)| m);
    METHODS.iter().find(|x| **x == m).copied().unwrap_or("unknown")
}

/// The caller's address: from the connection (plain or TLS), or, on a connection whose
/// client certificate says `gateway`, the address the E2B gateway names in
/// [`CLIENT_ADDR_HEADER`] (its own caller's: failed authentications count against the client
/// that made them, not against the gateway every E2B user shares). The header is ignored from
/// anyone else.
fn source<B>(req: &http::Request<B>) -> Option<IpAddr> {
    let e = req.extensions();
    let conn = e
        .get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(|i| i.get_ref().remote_addr())
        .or_else(|| e.get::<TcpConnectInfo>().and_then(|i| i.remote_addr()))
        .map(|a| a.ip());
    let forwarded = || {
        let v = req.headers().get(CLIENT_ADDR_HEADER)?.to_str().ok()?;
        v.trim().parse::<IpAddr>().ok()
    };
    if req.headers().contains_key(CLIENT_ADDR_HEADER)
        && opendsec_common::acl::identity_of(req).is_some_and(|id| id.role == Role::Gateway)
    {
        return forwarded().or(conn);
    }
    conn
}

/// A call an E2B gateway makes for nobody ([`PUBLIC_TRAFFIC_HEADER`]): an `HttpRequest`
/// into a sandbox whose traffic is public. The guard puts it in the request's extensions;
/// the Runtime service checks the sandbox's spec.
#[derive(Clone, Copy, Debug)]
pub struct PublicCaller {
    /// The client the gateway names: calls into sandboxes that are not public, or not there,
    /// count as failed authentications against it.
    pub ip: Option<IpAddr>,
}

/// The principal audit lines and bounds name a [`PublicCaller`] by.
pub const PUBLIC_PRINCIPAL: &str = "public";

/// Whether `req` is a public call: the header, on `HttpRequest`, with no token, from a
/// gateway's certificate. The header on any other call, or from anyone else, is refused.
fn public_call<B>(req: &http::Request<B>, method: &str) -> Result<bool, ApiError> {
    if !req.headers().contains_key(PUBLIC_TRAFFIC_HEADER) {
        return Ok(false);
    }
    let gateway = opendsec_common::acl::identity_of(req).is_some_and(|id| id.role == Role::Gateway);
    if gateway && method == "HttpRequest" && !req.headers().contains_key("authorization") {
        return Ok(true);
    }
    Err(ApiError::new(
        Reason::Unauthenticated,
        format!("{PUBLIC_TRAFFIC_HEADER} is an E2B gateway's, for HttpRequest without a token only"),
    ))
}

/// The bearer token of the request's headers (as `grpc::bearer` reads metadata).
fn bearer<B>(req: &http::Request<B>) -> Result<String, ApiError> {
    let md = tonic::metadata::MetadataMap::from_headers(req.headers().clone());
    opendsec_common::grpc::bearer(&md).map(str::to_string)
}

impl Shared {
    /// Admits a call: with a token this apiserver knows, or else not from a paused source and
    /// with a token IAM knows. A refusal for the token counts against the source.
    async fn admit_call(&self, ip: Option<IpAddr>, token: Result<String, ApiError>) -> Result<Arc<Identity>, ApiError> {
        let now = Instant::now();
        if let Ok(t) = &token
            && let Some(id) = self.auth.get_identity(&token_key(t), now, time::now_ms())
        {
            return Ok(id);
        }
        if let Some(ip) = ip
            && let Some(left) = self.failures.paused(ip, now)
        {
            let ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX).max(1);
            return Err(ApiError::new(
                Reason::Unauthenticated,
                format!("too many failed authentications from {ip}; try again in {} s", ms.div_ceil(1000)),
            )
            .with("retry_after_ms", ms.to_string()));
        }
        let result = match token {
            Ok(t) => self.authenticate(&t).await,
            Err(e) => Err(e),
        };
        // A refused sandbox token answers not_found (its sandbox ended) but counts as a failure.
        let refused = |e: &ApiError| e.reason == Reason::Unauthenticated || e.metadata.contains_key("token_refused");
        if let (Err(e), Some(ip)) = (&result, ip)
            && refused(e)
            && self.failures.failed(ip, now)
        {
            tracing::warn!(source = %ip, "pausing authentication from a source with too many failures");
        }
        result
    }

    /// What an admitted call may do before its message is decoded: a slot among its
    /// principal's calls in flight, and for `Restore` the right to restore.
    async fn admit_decode(&self, id: &Identity, method: &str) -> Result<opendsec_common::bounds::KeyPermit, ApiError> {
        let permit = self.calls.try_take(&id.bounds_key()).ok_or_else(|| {
            ApiError::new(
                Reason::RateLimited,
                format!("{} has {} calls in flight already", id.principal, self.cfg.max_calls_per_principal),
            )
            .with("retry_after_ms", BUSY_RETRY_AFTER_MS.to_string())
        })?;
        if method == "Restore" {
            self.authorize(&id.principal, "iam.admin", opendsec_common::ids::ROOT_PROJECT).await?;
        }
        Ok(permit)
    }
}

type Body = tonic::body::Body;

/// A request body cut at `limit` bytes: beyond, the body fails with an `invalid_argument`
/// status (which the server answers with) instead of growing a message further. A message
/// whose gRPC prefix declares more than the limit fails before tonic reserves room for it.
struct Capped {
    inner: Body,
    left: usize,
    limit: usize,
    /// The first message's prefix, until it is whole.
    prefix: opendsec_common::bounds::MessagePrefix,
}

impl Capped {
    fn new(inner: Body, limit: usize) -> Capped {
        Capped { inner, left: limit, limit, prefix: Default::default() }
    }

    fn too_large(&self) -> tonic::Status {
        ApiError::invalid(format!("request larger than {} bytes", self.limit))
            .with("limit_bytes", self.limit.to_string())
            .to_status()
    }
}

impl http_body::Body for Capped {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        let frame = std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx));
        if let Some(Ok(f)) = &frame
            && let Some(d) = f.data_ref()
        {
            if d.len() > self.left {
                return Poll::Ready(Some(Err(self.too_large())));
            }
            self.left -= d.len();
            if let Some((_, len)) = self.prefix.feed(d)
                && len as usize > self.limit
            {
                return Poll::Ready(Some(Err(self.too_large())));
            }
        }
        Poll::Ready(frame)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Methods whose answers are streams: their call slot ends when the stream starts (what an
/// unread stream holds is bounded by HTTP/2 flow control), where a unary call keeps its slot
/// until its answer has been read.
const STREAMING: &[&str] = &["CreateSandboxes", "ExecStream", "ReadFile", "ConnectProcess", "Watch"];

/// A response body holding its call's slot until it is dropped (read whole, or the call gone).
#[derive(Debug, Default)]
pub struct Slotted<B> {
    inner: B,
    _slot: Option<opendsec_common::bounds::KeyPermit>,
}

impl<B: http_body::Body + Unpin> http_body::Body for Slotted<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

impl<S, R> tower::Service<http::Request<Body>> for Guard<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<R>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = http::Response<Slotted<R>>;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        // The clone that was polled ready serves this call (tower's rule for cloned services).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        Box::pin(async move {
            let (ip, token) = (source(&req), bearer(&req));
            let paused = ip.is_some_and(|ip| shared.failures.paused(ip, Instant::now()).is_some());
            let method = method_of(req.uri().path());
            let mut call = crate::state::Call::new(method);
            let mut req = req;
            let admitted = match public_call(&req, method) {
                Ok(true) if paused => Err(ApiError::new(
                    Reason::Unauthenticated,
                    "too many calls into sandboxes that are not public from this address; try again later",
                )),
                Ok(true) => {
                    // Nobody's call: it counts against its client's address (the gateway
                    // names it), and the Runtime service checks the sandbox is public.
                    call.principal = Some(PUBLIC_PRINCIPAL.to_string());
                    req.extensions_mut().insert(PublicCaller { ip });
                    let key = format!("{PUBLIC_PRINCIPAL}@{}", ip.map(|i| i.to_string()).unwrap_or_default());
                    shared.calls.try_take(&key).ok_or_else(|| {
                        ApiError::new(Reason::RateLimited, format!("{key} has too many calls in flight already"))
                            .with("retry_after_ms", BUSY_RETRY_AFTER_MS.to_string())
                    })
                }
                Ok(false) => match shared.admit_call(ip, token).await {
                    Ok(id) => {
                        call.principal = Some(id.principal.clone());
                        match id.may_call(req.uri().path()) {
                            Ok(()) => shared.admit_decode(&id, method).await,
                            Err(e) => Err(e),
                        }
                    }
                    Err(e) => Err(e),
                },
                Err(e) => Err(e),
            };
            match admitted {
                Ok(slot) => {
                    let req = if req.uri().path().starts_with(ADMIN_PREFIX) && method != "Restore" {
                        req.map(|b| Body::new(Capped::new(b, crate::MAX_UNARY_REQUEST_BYTES)))
                    } else {
                        req
                    };
                    let resp = inner.call(req).await?;
                    let slot = (!STREAMING.contains(&method)).then_some(slot);
                    Ok(resp.map(|inner| Slotted { inner, _slot: slot }))
                }
                Err(e) => {
                    if !paused || call.principal.is_some() {
                        shared.finish(call, Err(&e)).await;
                    }
                    Ok(e.to_status().into_http())
                }
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_public_method_has_a_name() {
        let runtime = include_str!("../../../proto/opendsec/v1/runtime.proto");
        // AgentControl is the edge's own service of the agent: no apiserver serves it.
        let public_runtime = &runtime[..runtime.find("service AgentControl").unwrap_or(runtime.len())];
        for text in [include_str!("../../../proto/opendsec/v1/opendsec.proto"), public_runtime] {
            for l in text.lines().filter_map(|l| l.trim().strip_prefix("rpc ")) {
                let m = &l[..l.find('(').unwrap()];
                assert_eq!(method_of(&format!("/opendsec.v1.X/{m}")), m, "add {m} to METHODS");
            }
        }
        assert_eq!(method_of("/opendsec.v1.Sandboxes/Whatever"), "unknown");
        assert_eq!(method_of(""), "unknown");
    }
}
