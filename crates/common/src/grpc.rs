//! gRPC plumbing shared by every process: the server settings, serving on a listener until a
//! shutdown future completes (plain text, TLS for the public port, mTLS with the role table of
//! [`crate::acl`] for internal servers), lazily connected channels (internal ones over mTLS,
//! pooled per address and expected identity: [`Links`]; public ones with or without TLS:
//! [`public_channel`]) and the caller's bearer token.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio_stream::StreamExt;
use tonic::Request;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::transport::{Channel, Endpoint, Server};

use crate::acl::AclLayer;
use crate::pki::Role;
use crate::reason::{ApiError, Reason};
use crate::tls::Credentials;

/// On `Runtime` and lifecycle calls from an apiserver to an edge: the project the apiserver
/// authorized the call for. The edge refuses a call without it, and answers not_found when the
/// sandbox under that id belongs to another project (an id reused after the apiserver cached
/// it).
pub const EXPECT_PROJECT_HEADER: &str = "x-opendsec-expect-project";
/// Connections a server keeps open at once (more wait in the kernel's backlog).
pub const MAX_CONNECTIONS: usize = 16_384;
/// Largest message either way (reference section 13).
pub use opendsec_proto::upload::MAX_MESSAGE_BYTES;

/// Most creations one `Edge/CreateMany` call carries (the apiserver sends at most this many;
/// an edge refuses more).
pub const MAX_CREATE_MANY: usize = 64;

/// Streams per connection.
pub const MAX_STREAMS: u32 = 1024;
/// HTTP/2 flow-control window of each stream.
pub const STREAM_WINDOW: u32 = 512 << 10;
/// HTTP/2 flow-control window of a whole connection: every stream's window at once, so that
/// streams whose reader stalls (a tenant that does not read, an answer waiting for room in a
/// budget) can never use up the connection's window and stall the other streams on it. The
/// apiserver shares one connection per edge between every tenant's calls.
pub const CONNECTION_WINDOW: u32 = MAX_STREAMS * STREAM_WINDOW;

/// A server with the settings every opendsec service uses: idle connections pinged every 20 s
/// so load balancers do not cut quiet streams; at most [`MAX_STREAMS`] streams per connection
/// and 64 KiB of headers; windows as [`CONNECTION_WINDOW`] says.
pub fn server() -> Server {
    Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(20)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        .tcp_nodelay(true)
        .max_concurrent_streams(Some(MAX_STREAMS))
        .concurrency_limit_per_connection(MAX_STREAMS as usize)
        .http2_max_header_list_size(64 << 10)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
}

/// The layers of an internal server: the role table, then what keeps answers' meters.
pub type InternalLayers = tower::layer::util::Stack<
    crate::bounds::HoldLayer,
    tower::layer::util::Stack<AclLayer, tower::layer::util::Identity>,
>;

/// An internal server: [`server`] behind the role table of [`crate::acl`], holding each
/// answer's [`crate::bounds::Meter`] until the answer has gone.
pub fn internal_server() -> Server<InternalLayers> {
    server().layer(AclLayer::default()).layer(crate::bounds::HoldLayer)
}

/// [`internal_server`] for IAM: calls its members forward to the leader are checked as their
/// original callers' (`acl::ON_BEHALF_OF`).
pub fn iam_server() -> Server<InternalLayers> {
    server().layer(AclLayer::iam()).layer(crate::bounds::HoldLayer)
}

/// The router an internal server builds.
pub type InternalRouter = tonic::transport::server::Router<InternalLayers>;

/// Serves an internal router over mTLS on an already bound listener until `shutdown`
/// completes: only callers with a certificate of the cluster CA get past the handshake, and
/// only the roles [`crate::acl::TABLE`] names reach a method.
pub async fn serve_internal(
    router: InternalRouter,
    listener: tokio::net::TcpListener,
    creds: &Arc<Credentials>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let incoming =
        crate::tls::incoming(listener, creds.server_config(true), MAX_CONNECTIONS, 0, crate::tls::HTTP2_OPENING);
    router.serve_with_incoming_shutdown(incoming, shutdown).await
}

/// Serves a router in plain text on an already bound listener until `shutdown` completes
/// (local development only: `--insecure-plaintext` on a loopback address).
pub async fn serve(
    router: tonic::transport::server::Router,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    router.serve_with_incoming_shutdown(plain_incoming(listener), shutdown).await
}

/// The connections of `listener`, for a plain-text server.
pub fn plain_incoming(
    listener: tokio::net::TcpListener,
) -> impl tokio_stream::Stream<Item = std::io::Result<tokio::net::TcpStream>> {
    // Settings given to the builder apply only to listeners it binds itself: with our own
    // listener, Nagle must be turned off here, or small answers wait for delayed ACKs (40 ms).
    tokio_stream::wrappers::TcpListenerStream::new(listener).map(|conn| {
        if let Ok(c) = &conn {
            let _ = c.set_nodelay(true);
        }
        conn
    })
}

/// The endpoint settings of every channel: clients ping every 10 s, so a silently lost
/// connection is noticed within about 15 s.
fn endpoint(addr: &str) -> Result<(Endpoint, String), ApiError> {
    let hostport = addr.strip_prefix("http://").or_else(|| addr.strip_prefix("https://")).unwrap_or(addr);
    let ep = Endpoint::from_shared(format!("http://{hostport}"))
        .map_err(|e| ApiError::invalid(format!("bad address {addr:?}: {e}")))?
        .connect_timeout(Duration::from_secs(2))
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .tcp_nodelay(true)
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW);
    Ok((ep, hostport.to_string()))
}

/// A lazily connected plain-text channel to `addr` (`host:port`).
pub fn channel(addr: &str) -> Result<Channel, ApiError> {
    Ok(endpoint(addr)?.0.connect_lazy())
}

/// A lazily connected channel to `addr` whose connections run TLS with `cfg`, checking the
/// server for `name`.
pub fn tls_channel(
    addr: &str,
    cfg: Arc<rustls::ClientConfig>,
    name: rustls_pki_types::ServerName<'static>,
) -> Result<Channel, ApiError> {
    let (ep, hostport) = endpoint(addr)?;
    Ok(ep.connect_with_connector_lazy(tower::service_fn(move |_| {
        let (hostport, cfg, name) = (hostport.clone(), cfg.clone(), name.clone());
        async move {
            Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(crate::tls::connect(&hostport, cfg, name).await?))
        }
    })))
}

/// The header in which the E2B gateway names the address of the client it calls for. The
/// apiserver believes it only on a connection whose client certificate says `gateway`, and
/// counts failed authentications against that address instead of the gateway's own.
pub const CLIENT_ADDR_HEADER: &str = "x-opendsec-client-addr";

/// The header with which the E2B gateway makes an `HttpRequest` for nobody (a request to a
/// sandbox host that brought no token): the apiserver takes such a call only from a
/// connection whose client certificate says `gateway`, without a token, and only for a
/// sandbox whose spec has `public_traffic` (another answers `permission_denied`, one that is
/// not there `not_found`; both count as failed authentications of the client it names).
pub const PUBLIC_TRAFFIC_HEADER: &str = "x-opendsec-public-traffic";

/// How a client reaches the public API.
#[derive(Clone)]
pub enum PublicTls {
    /// Plain text (a cluster started with `--insecure-plaintext`).
    Plaintext,
    /// TLS, the server's certificate checked against the CA and for `name`.
    Tls { cfg: Arc<rustls::ClientConfig>, name: rustls_pki_types::ServerName<'static> },
}

impl std::fmt::Debug for PublicTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PublicTls::Plaintext => f.write_str("Plaintext"),
            PublicTls::Tls { name, .. } => write!(f, "Tls({name:?})"),
        }
    }
}

impl PublicTls {
    /// TLS trusting the CAs in `ca_pem`, checking `name` (default [`crate::pki::PUBLIC_NAME`])
    /// and that the server is an apiserver.
    pub fn with_ca(ca_pem: &[u8], name: Option<&str>) -> Result<PublicTls, ApiError> {
        PublicTls::with_ca_as(ca_pem, name, None)
    }

    /// [`PublicTls::with_ca`], presenting `creds`' certificate to the apiserver (the E2B
    /// gateway's: the apiserver then believes the [`CLIENT_ADDR_HEADER`] it sends).
    pub fn with_ca_as(
        ca_pem: &[u8],
        name: Option<&str>,
        creds: Option<&Arc<crate::tls::Credentials>>,
    ) -> Result<PublicTls, ApiError> {
        let cfg = crate::tls::public_client_config_as(ca_pem, creds).map_err(|e| ApiError::invalid(e.to_string()))?;
        let name = rustls_pki_types::ServerName::try_from(name.unwrap_or(crate::pki::PUBLIC_NAME).to_string())
            .map_err(|e| ApiError::invalid(format!("TLS server name: {e}")))?;
        Ok(PublicTls::Tls { cfg, name })
    }

    /// From the environment, as every client reads it: `OPENDSEC_CA` (a PEM file of the
    /// cluster CA; `cluster up` prints its path) with the optional `OPENDSEC_TLS_NAME`, or
    /// `OPENDSEC_INSECURE_PLAINTEXT=1`. Neither: an error that says so (a token is never sent
    /// in plain text by default).
    pub fn from_env() -> Result<PublicTls, ApiError> {
        let ca = std::env::var_os("OPENDSEC_CA").filter(|v| !v.is_empty());
        let plain = std::env::var("OPENDSEC_INSECURE_PLAINTEXT").is_ok_and(|v| v == "1" || v == "true");
        let name = std::env::var("OPENDSEC_TLS_NAME").ok().filter(|v| !v.is_empty());
        PublicTls::choose(ca.as_deref().map(std::path::Path::new), plain, name.as_deref())
    }

    /// From explicit settings (see [`PublicTls::from_env`]).
    pub fn choose(ca: Option<&std::path::Path>, plaintext: bool, name: Option<&str>) -> Result<PublicTls, ApiError> {
        match (ca, plaintext) {
            (Some(_), true) => Err(ApiError::invalid("give either a CA (OPENDSEC_CA) or plain text, not both")),
            (Some(p), false) => {
                let pem = std::fs::read(p).map_err(|e| ApiError::invalid(format!("CA file {}: {e}", p.display())))?;
                PublicTls::with_ca(&pem, name)
            }
            (None, true) => Ok(PublicTls::Plaintext),
            (None, false) => Err(ApiError::invalid(
                "no CA to check the cluster's certificate: set OPENDSEC_CA to the cluster's CA file (cluster up prints \
                 it) or OPENDSEC_INSECURE_PLAINTEXT=1 for a cluster started with --insecure-plaintext",
            )),
        }
    }
}

/// A lazily connected channel to an apiserver's public port.
pub fn public_channel(addr: &str, tls: &PublicTls) -> Result<Channel, ApiError> {
    match tls {
        PublicTls::Plaintext => channel(addr),
        PublicTls::Tls { cfg, name } => tls_channel(addr, cfg.clone(), name.clone()),
    }
}

/// Internal links: channels over mTLS with this component's certificate, pooled per
/// (address, expected identity), one HTTP/2 connection per peer shared by every caller.
pub struct Links {
    creds: Arc<Credentials>,
    cfg: Arc<rustls::ClientConfig>,
    channels: Mutex<HashMap<(String, String), Channel>>,
}

impl std::fmt::Debug for Links {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Links").field("creds", &self.creds).finish_non_exhaustive()
    }
}

impl Links {
    pub fn new(creds: Arc<Credentials>) -> Arc<Links> {
        let cfg = creds.client_config();
        Arc::new(Links { creds, cfg, channels: Mutex::new(HashMap::new()) })
    }

    pub fn credentials(&self) -> &Arc<Credentials> {
        &self.creds
    }

    /// A channel to the `role` at `addr` (named `name`, when the caller knows which instance
    /// it means: an edge's name is checked against its certificate).
    pub fn channel(&self, addr: &str, role: Role, name: Option<&str>) -> Result<Channel, ApiError> {
        let key = (addr.to_string(), format!("{role}/{}", name.unwrap_or("*")));
        let mut map = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = map.get(&key) {
            return Ok(c.clone());
        }
        let c = tls_channel(addr, self.cfg.clone(), crate::tls::expect(role, name))?;
        map.insert(key, c.clone());
        Ok(c)
    }

    /// Drops the pooled channels to `addr` (for example after the peer's address changed).
    pub fn forget(&self, addr: &str) {
        self.channels.lock().unwrap_or_else(|p| p.into_inner()).retain(|(a, _), _| a != addr);
    }
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
}
