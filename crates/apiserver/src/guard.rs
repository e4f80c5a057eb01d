//! What runs before any public call is decoded: the caller must authenticate first (bearer
//! token, through the authentication cache), so an unauthenticated client never gets a message
//! decoded, never reaches a handler and costs at most one IAM call per token per negative TTL.
//! A source address with too many failed authentications in a window is paused: answered
//! `unauthenticated` without asking IAM (reference section 1, "authentication is paused for a
//! source address with too many failures").
//!
//! The layer only admits; handlers authenticate again (a cache hit) to learn who calls. A call
//! it refuses for its token still gets an audit line (method, reason); calls from a paused
//! source do not, one by one: a flood cannot fill the audit log (the pause itself is logged).
use std::net::IpAddr;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use opendsec_common::{ApiError, Reason};
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::state::Shared;

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
    "ListSandboxes",
    "StopSandbox",
    "PauseSandbox",
    "ResumeSandbox",
    "SetSandboxTimeout",
    "WhoAmI",
    "CreateProject",
    "GetProject",
    "ListProjects",
    "DeleteProject",
    "SetQuota",
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
    "HttpRequest",
    "StartProcess",
    "ConnectProcess",
    "SendInput",
    "SignalProcess",
    "ListProcesses",
    "Watch",
];

/// The method of a gRPC path (`/opendsec.v1.Service/Method`), or "unknown".
fn method_of(path: &str) -> &'static str {
    let m = path.rsplit_once('/').map_or("", |(_, m)| m);
    METHODS.iter().find(|x| **x == m).copied().unwrap_or("unknown")
}

/// The caller's address, from the connection (plain or TLS).
fn source<B>(req: &http::Request<B>) -> Option<IpAddr> {
    let e = req.extensions();
    e.get::<TlsConnectInfo<TcpConnectInfo>>()
        .and_then(|i| i.get_ref().remote_addr())
        .or_else(|| e.get::<TcpConnectInfo>().and_then(|i| i.remote_addr()))
        .map(|a| a.ip())
}

/// The bearer token of the request's headers (as `grpc::bearer` reads metadata).
fn bearer<B>(req: &http::Request<B>) -> Result<String, ApiError> {
    let md = tonic::metadata::MetadataMap::from_headers(req.headers().clone());
    opendsec_common::grpc::bearer(&md).map(str::to_string)
}

impl Shared {
    /// Admits a call: not from a paused source, with a token IAM knows. A refusal for the
    /// token counts against the source.
    async fn admit_call(&self, ip: Option<IpAddr>, token: Result<String, ApiError>) -> Result<(), ApiError> {
        let now = Instant::now();
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
            Ok(t) => self.authenticate(&t).await.map(|_| ()),
            Err(e) => Err(e),
        };
        if let (Err(e), Some(ip)) = (&result, ip)
            && e.reason == Reason::Unauthenticated
            && self.failures.failed(ip, now)
        {
            tracing::warn!(source = %ip, "pausing authentication from a source with too many failures");
        }
        result
    }
}

impl<S, B, R> tower::Service<http::Request<B>> for Guard<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Send + 'static,
    R: Default + Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        // The clone that was polled ready serves this call (tower's rule for cloned services).
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        Box::pin(async move {
            let (ip, token) = (source(&req), bearer(&req));
            let paused = ip.is_some_and(|ip| shared.failures.paused(ip, Instant::now()).is_some());
            let call = crate::state::Call::new(method_of(req.uri().path()));
            match shared.admit_call(ip, token).await {
                Ok(()) => inner.call(req).await,
                Err(e) => {
                    if !paused {
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
        for text in [
            include_str!("../../../proto/opendsec/v1/opendsec.proto"),
            include_str!("../../../proto/opendsec/v1/runtime.proto"),
        ] {
            for l in text.lines().filter_map(|l| l.trim().strip_prefix("rpc ")) {
                let m = &l[..l.find('(').unwrap()];
                assert_eq!(method_of(&format!("/opendsec.v1.X/{m}")), m, "add {m} to METHODS");
            }
        }
        assert_eq!(method_of("/opendsec.v1.Sandboxes/Whatever"), "unknown");
        assert_eq!(method_of(""), "unknown");
    }
}
