//! The E2B-compatible gateway: E2B's control-plane REST API and its in-sandbox APIs (envd's
//! process and filesystem services over Connect, `/files`, `/health`) on one HTTP/1.1 port,
//! so that E2B's own SDKs run against opendsec with `E2B_API_URL` and `E2B_SANDBOX_URL` both
//! set to it (docs/e2b.md).
//!
//! Invariants:
//! - stateless: every request is made through the public API with the caller's own token (the
//!   E2B API key on the REST API; on in-sandbox calls the `envdAccessToken` the create and
//!   connect answers carry, which is that same key echoed back), never with an identity of
//!   the gateway's own, so permissions, quotas and audit are the caller's;
//! - requests carrying `E2b-Sandbox-Id` go to that sandbox by `E2b-Sandbox-Port` (49983:
//!   envd, 49999: the code interpreter); the rest is the REST API;
//! - a sandbox that is unknown, not the caller's, stopped or failed answers the edge proxy's
//!   502 "The sandbox was not found", as E2B's proxy does;
//! - every error has the shape its SDK decodes (REST: `{"code": int, "message"}`; envd:
//!   Connect errors), never a bare text body.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderMap, Request};
use axum::response::Response;
use opendsec_client::Client;
use opendsec_common::config::E2bConfig;
use opendsec_common::grpc::PublicTls;

mod api;
mod callers;
pub mod connect;
mod envd;
pub mod error;
mod files;
pub mod host;
mod interp;
mod model;
mod names;
mod ports;
mod sandbox;

/// The envd version reported: the SDK gates features on it, and everything it gates up to
/// this version is served.
pub const ENVD_VERSION: &str = "0.6.4";
/// The in-sandbox ports E2B's SDKs address by `E2b-Sandbox-Port`.
pub const ENVD_PORT: &str = "49983";
pub const CODE_INTERPRETER_PORT: &str = "49999";

/// Bytes answers from sandbox ports may hold at once, per client address and in all.
const PORT_ANSWERS_PER_SOURCE: usize = 128 << 20;
const PORT_ANSWERS_TOTAL: usize = 1 << 30;

/// What a gateway needs to run.
#[derive(Debug, Clone)]
pub struct GatewayOptions {
    pub config: E2bConfig,
    /// The apiservers (`host:port`).
    pub apiserver_addrs: Vec<String>,
    /// How to reach them (TLS trusting the cluster's CA, or plain text).
    pub tls: PublicTls,
    /// The certificate the gateway presents (HTTPS), or none: plain HTTP (a loopback address
    /// only, [`opendsec_common::config::Config::validate`]).
    pub serve_tls: Option<Arc<opendsec_common::tls::Credentials>>,
}

#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("the gateway cannot reach the public API: {0}")]
    Client(opendsec_common::ApiError),
    #[error("serving the gateway: {0}")]
    Serve(std::io::Error),
}

pub(crate) struct Gateway {
    pub(crate) cfg: E2bConfig,
    /// The domain of sandbox hosts the answers name ([`host::domain`]).
    pub(crate) domain: String,
    client: Client,
    pub(crate) names: names::Cache,
    callers: callers::Callers,
    /// What answers from sandbox ports may hold at once.
    pub(crate) ports: Arc<ports::Budget>,
}

/// The client of one request (its address is named to the apiserver).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Caller(pub Option<std::net::IpAddr>);

impl Gateway {
    /// A client calling with `token` for `caller`, on the shared connections. A key in the
    /// shape E2B's SDKs check (`e2b_` + hex, `opendsecctl token create --e2b`) is the token it
    /// encodes.
    pub(crate) fn client(&self, token: &str, caller: Caller) -> Result<Client, opendsec_common::ApiError> {
        match opendsec_common::config::token_of_e2b_key(token) {
            Some(t) => self.client.with_token_for(&t, caller.0),
            None => self.client.with_token_for(token, caller.0),
        }
    }

    /// A client calling for nobody, for `caller` (an `HttpRequest` into a sandbox whose
    /// traffic is public: the apiserver checks that it is).
    pub(crate) fn public_client(&self, caller: Caller) -> Client {
        self.client.public_for(caller.0)
    }

    /// The image a template id stands for.
    pub(crate) fn image_of(&self, template: &str) -> String {
        self.cfg.templates.get(template).cloned().unwrap_or_else(|| template.to_string())
    }

    /// The template id an image stands for (the configured name, or the image itself).
    pub(crate) fn template_of(&self, image: &str) -> String {
        self.cfg
            .templates
            .iter()
            .find(|(_, i)| *i == image)
            .map(|(t, _)| t.clone())
            .unwrap_or_else(|| image.to_string())
    }
}

/// Serves the gateway on `listener` until `shutdown` resolves.
///
/// Connections are bounded in all ([`opendsec_common::grpc::MAX_CONNECTIONS`]) and per source
/// address (`e2b.max_connections_per_source`), must send their first bytes within seconds of
/// opening, and are closed when waiting for a request's headers longer than
/// `e2b.idle_timeout` (idle between requests, or sending them slowly). Streams (a background
/// command, a watch) may stay open for hours: shutting down does not wait for them.
pub async fn serve(
    opts: GatewayOptions,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    use opendsec_common::{conn, grpc, tls};
    let client = Client::new(&opts.apiserver_addrs, None, &opts.tls).map_err(GatewayError::Client)?;
    let cfg = opts.config;
    let per_source = cfg.max_connections_per_source as usize;
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(hyper_util::rt::TokioTimer::new()).header_read_timeout(cfg.idle_timeout).keep_alive(true);
    let callers = callers::Callers::new(&cfg.auth_failures);
    let port = listener.local_addr().map_err(GatewayError::Serve)?.port();
    let domain = host::domain(&cfg.domain, port);
    let ports = ports::Budget::new(PORT_ANSWERS_PER_SOURCE, PORT_ANSWERS_TOTAL);
    let gw = Arc::new(Gateway { cfg, domain, client, names: names::Cache::default(), callers, ports });
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let gw = gw.clone();
        async move { route(gw, req).await }
    });
    let served = async move {
        match opts.serve_tls {
            Some(creds) => {
                let incoming = tls::incoming(
                    listener,
                    creds.https_server_config(),
                    grpc::MAX_CONNECTIONS,
                    per_source,
                    tls::HTTP1_OPENING,
                );
                accept(incoming, |c| c.get_ref().get_ref().0.peer_addr(), app, http).await
            }
            None => {
                let incoming = conn::incoming(listener, grpc::MAX_CONNECTIONS, per_source, tls::HTTP1_OPENING, |tcp| {
                    std::future::ready(Ok(tcp))
                });
                accept(incoming, |c| c.get_ref().peer_addr(), app, http).await
            }
        }
    };
    tokio::select! {
        () = served => Ok(()),
        () = shutdown => Ok(()),
    }
}

/// The address of the client a request came from (the gateway's own caller).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ClientAddr(pub std::net::SocketAddr);

/// Serves each connection of `incoming` with `app` in a task of its own, each request
/// carrying its connection's [`ClientAddr`]. Returns when the acceptor ends (its listener
/// failed for good).
async fn accept<S, IO>(
    mut incoming: S,
    peer: fn(&IO) -> std::io::Result<std::net::SocketAddr>,
    app: axum::Router,
    http: hyper::server::conn::http1::Builder,
) where
    S: tokio_stream::Stream<Item = std::io::Result<IO>> + Unpin,
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    use tokio_stream::StreamExt;
    while let Some(c) = incoming.next().await {
        let io = match c {
            Ok(io) => io,
            Err(e) => {
                tracing::debug!(error = %e, "a gateway connection failed");
                continue;
            }
        };
        let Ok(addr) = peer(&io) else { continue };
        let app = app.clone();
        let service = hyper::service::service_fn(move |mut req: Request<hyper::body::Incoming>| {
            req.extensions_mut().insert(ClientAddr(addr));
            let app = app.clone();
            async move { tower::ServiceExt::oneshot(app, req.map(Body::new)).await }
        });
        let conn = http.serve_connection(hyper_util::rt::TokioIo::new(io), service);
        tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::debug!(peer = %addr, error = %e, "a gateway connection ended");
            }
        });
    }
}

pub(crate) fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty())
}

/// Where a request goes, decided as E2B's edge proxy decides: by the `E2b-Sandbox-Id` and
/// `E2b-Sandbox-Port` headers, else by a sandbox host (`<port>-<id>.<domain>`), else the REST
/// API.
enum Target {
    Rest,
    Envd(String),
    Interp(String),
    /// A sandbox's own port: its answers are the sandbox's, not the gateway's.
    Port(String, u16),
    Bad(String),
}

fn target_of(h: &HeaderMap, domain: &str) -> Target {
    let (id, port) = match (header(h, "e2b-sandbox-id"), header(h, "e2b-sandbox-port")) {
        (Some(id), Some(port)) => (host::opendsec_id(id), port.to_string()),
        (Some(_), None) => return Target::Bad("Missing header: E2b-Sandbox-Port".into()),
        (None, Some(_)) => return Target::Bad("Missing header: E2b-Sandbox-Id".into()),
        (None, None) => match host::target(h, domain) {
            Some((port, id)) => (id, port.to_string()),
            None => return Target::Rest,
        },
    };
    match port.as_str() {
        ENVD_PORT => Target::Envd(id),
        CODE_INTERPRETER_PORT => Target::Interp(id),
        _ => match port.parse::<u16>() {
            Ok(p) if p != 0 => Target::Port(id, p),
            _ => Target::Bad(format!("bad E2b-Sandbox-Port {port:?}")),
        },
    }
}

async fn route(gw: Arc<Gateway>, req: Request<Body>) -> Response {
    let ip = req.extensions().get::<ClientAddr>().map(|a| a.0.ip());
    let target = target_of(req.headers(), &gw.domain);
    // A sandbox port's answers are its server's: they say nothing of the caller's key (a
    // sandbox answering 401 must not pause its visitors), and nothing there is paused.
    let counted = !matches!(target, Target::Port(..) | Target::Bad(_));
    let in_sandbox = matches!(target, Target::Envd(_) | Target::Interp(_));
    let key = callers::key_of(req.headers(), in_sandbox).map(str::to_string);
    let now = std::time::Instant::now();
    if counted
        && let Some(ip) = ip
        && let Some(left) = gw.callers.refused_for(ip, key.as_deref(), now)
    {
        let message = format!("too many failed authentications from {ip}; try again in {} s", left.as_secs().max(1));
        return if in_sandbox {
            connect::ConnectError::new(connect::Code::Unauthenticated, message).unary_response()
        } else {
            let mut e = error::RestError::unauthorized(message);
            e.retry_after_s = Some(left.as_secs().max(1));
            e.response()
        };
    }
    let caller = Caller(ip);
    let resp = match target {
        Target::Rest => api::handle(gw.clone(), caller, req).await,
        Target::Envd(id) => envd::handle(gw.clone(), caller, id, req).await,
        Target::Interp(id) => interp::handle(gw.clone(), caller, id, req).await,
        Target::Port(id, port) => ports::handle(gw.clone(), caller, id, port, req).await,
        Target::Bad(m) => error::RestError::bad_request(m).response(),
    };
    if counted && let Some(ip) = ip {
        let status = resp.status();
        if status == axum::http::StatusCode::UNAUTHORIZED {
            gw.callers.record(ip, key.as_deref(), false, now);
        } else if status.is_success() {
            gw.callers.record(ip, key.as_deref(), true, now);
        }
    }
    resp
}
