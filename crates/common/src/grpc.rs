//! gRPC plumbing shared by every process: the server settings, `serve(listener, shutdown)`,
//! lazily connected channels pooled per address, the shared service token between components
//! (development mode until mTLS lands) and the caller's bearer token.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_stream::StreamExt;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::service::Interceptor;
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint, Server};
use tonic::{Request, Status};

use crate::reason::{ApiError, Reason};

/// Metadata key of the shared secret between components.
pub const SERVICE_TOKEN_HEADER: &str = "x-opendsec-service-token";
/// On `Runtime` calls from an apiserver to an edge: the project the apiserver authorized the
/// call for. The edge refuses the call (not_found) when the sandbox under that id belongs to
/// another project (an id reused after the apiserver cached it).
pub const EXPECT_PROJECT_HEADER: &str = "x-opendsec-expect-project";
/// Largest message either way (reference section 13).
pub use opendsec_proto::upload::MAX_MESSAGE_BYTES;

/// A server with the settings every opendsec service uses: idle connections pinged every 20 s
/// so load balancers do not cut quiet streams.
pub fn server() -> Server {
    Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .tcp_nodelay(true)
        .concurrency_limit_per_connection(4096)
}

/// Serves a router on an already bound listener until `shutdown` completes.
pub async fn serve(
    router: tonic::transport::server::Router,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    // Settings given to the builder apply only to listeners it binds itself: with our own
    // listener, Nagle must be turned off here, or small answers wait for delayed ACKs (40 ms).
    let incoming = tokio_stream::wrappers::TcpListenerStream::new(listener).map(|conn| {
        if let Ok(c) = &conn {
            let _ = c.set_nodelay(true);
        }
        conn
    });
    router.serve_with_incoming_shutdown(incoming, shutdown).await
}

/// A lazily connected channel to `addr` (`host:port` or a full `http://` URI). Internal clients
/// ping every 10 s, so a silently lost connection is noticed within about 15 s.
pub fn channel(addr: &str) -> Result<Channel, ApiError> {
    let uri = if addr.contains("://") { addr.to_string() } else { format!("http://{addr}") };
    let ep = Endpoint::from_shared(uri)
        .map_err(|e| ApiError::invalid(format!("bad address {addr:?}: {e}")))?
        .connect_timeout(Duration::from_secs(2))
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .tcp_nodelay(true);
    Ok(ep.connect_lazy())
}

/// Channels pooled per address: one HTTP/2 connection per peer, shared by every caller.
#[derive(Default)]
pub struct ChannelPool {
    channels: Mutex<HashMap<String, Channel>>,
}

impl ChannelPool {
    pub fn get(&self, addr: &str) -> Result<Channel, ApiError> {
        let mut map = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = map.get(addr) {
            return Ok(c.clone());
        }
        let c = channel(addr)?;
        map.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// Drops the pooled channel (for example after the peer's address changed).
    pub fn forget(&self, addr: &str) {
        self.channels.lock().unwrap_or_else(|p| p.into_inner()).remove(addr);
    }
}

/// Server side: refuses calls without the shared service token.
#[derive(Clone)]
pub struct RequireServiceToken {
    token: Arc<str>,
}

impl RequireServiceToken {
    pub fn new(token: &str) -> Self {
        RequireServiceToken { token: token.into() }
    }
}

impl Interceptor for RequireServiceToken {
    fn call(&mut self, req: Request<()>) -> Result<Request<()>, Status> {
        use subtle::ConstantTimeEq;
        let got = req.metadata().get(SERVICE_TOKEN_HEADER).map(|v| v.as_bytes()).unwrap_or_default();
        if got.ct_eq(self.token.as_bytes()).into() {
            Ok(req)
        } else {
            Err(ApiError::new(Reason::Unauthenticated, "missing or wrong service token").to_status())
        }
    }
}

/// Client side: attaches the shared service token, and the caller's bearer token when one is
/// being forwarded.
#[derive(Clone)]
pub struct AttachServiceToken {
    value: AsciiMetadataValue,
}

impl AttachServiceToken {
    pub fn new(token: &str) -> Result<Self, ApiError> {
        let value = token.parse().map_err(|_| ApiError::invalid("service token is not ASCII"))?;
        Ok(AttachServiceToken { value })
    }
}

impl Interceptor for AttachServiceToken {
    fn call(&mut self, mut req: Request<()>) -> Result<Request<()>, Status> {
        req.metadata_mut().insert(SERVICE_TOKEN_HEADER, self.value.clone());
        Ok(req)
    }
}

/// A channel that carries the service token.
pub type ServiceChannel = InterceptedService<Channel, AttachServiceToken>;

pub fn service_channel(channel: Channel, token: &AttachServiceToken) -> ServiceChannel {
    InterceptedService::new(channel, token.clone())
}

/// The caller's bearer token from `authorization: Bearer <token>`.
pub fn bearer(md: &MetadataMap) -> Result<&str, ApiError> {
    let v = md
        .get("authorization")
        .ok_or_else(|| ApiError::new(Reason::Unauthenticated, "missing authorization: Bearer <token>"))?;
    let s = v.to_str().map_err(|_| ApiError::new(Reason::Unauthenticated, "authorization header is not ASCII"))?;
    let t = s
        .strip_prefix("Bearer ")
        .or_else(|| s.strip_prefix("bearer "))
        .ok_or_else(|| ApiError::new(Reason::Unauthenticated, "authorization must be \"Bearer <token>\""))?;
    let t = t.trim();
    if t.is_empty() {
        return Err(ApiError::new(Reason::Unauthenticated, "empty bearer token"));
    }
    Ok(t)
}

/// Puts `authorization: Bearer <token>` on an outgoing request.
pub fn set_bearer<T>(req: &mut Request<T>, token: &str) -> Result<(), ApiError> {
    let v: AsciiMetadataValue =
        format!("Bearer {token}").parse().map_err(|_| ApiError::new(Reason::Unauthenticated, "token is not ASCII"))?;
    req.metadata_mut().insert("authorization", v);
    Ok(())
}

/// A random secret for generated tokens: `n` characters of [A-Za-z0-9].
pub fn random_secret(n: usize) -> String {
    use rand::RngExt;
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let mut rng = rand::rng();
    (0..n).map(|_| ALPHABET[rng.random_range(0..ALPHABET.len())] as char).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_parsing() {
        let mut md = MetadataMap::new();
        assert_eq!(bearer(&md).unwrap_err().reason, Reason::Unauthenticated);
        md.insert("authorization", "Basic abc".parse().unwrap());
        assert_eq!(bearer(&md).unwrap_err().reason, Reason::Unauthenticated);
        md.insert("authorization", "Bearer dsk.a.b".parse().unwrap());
        assert_eq!(bearer(&md).unwrap(), "dsk.a.b");
    }

    #[test]
    fn service_token_is_checked() {
        let mut check = RequireServiceToken::new("s3cret");
        assert!(check.call(Request::new(())).is_err());
        let mut req = Request::new(());
        AttachServiceToken::new("s3cret").unwrap().call(Request::new(())).unwrap();
        req.metadata_mut().insert(SERVICE_TOKEN_HEADER, "s3cret".parse().unwrap());
        assert!(check.call(req).is_ok());
        let mut wrong = Request::new(());
        wrong.metadata_mut().insert(SERVICE_TOKEN_HEADER, "nope".parse().unwrap());
        assert!(check.call(wrong).is_err());
    }
}
