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
pub mod connect;
mod envd;
pub mod error;
mod files;
mod interp;
mod model;
mod names;
mod sandbox;

/// The envd version reported: the SDK gates features on it, and everything it gates up to
/// this version is served.
pub const ENVD_VERSION: &str = "0.6.4";
/// The in-sandbox ports E2B's SDKs address by `E2b-Sandbox-Port`.
pub const ENVD_PORT: &str = "49983";
pub const CODE_INTERPRETER_PORT: &str = "49999";

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
    client: Client,
    pub(crate) names: names::Cache,
}

impl Gateway {
    /// A client calling with `token`, on the shared connections.
    pub(crate) fn client(&self, token: &str) -> Result<Client, opendsec_common::ApiError> {
        self.client.with_token(token)
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
pub async fn serve(
    opts: GatewayOptions,
    listener: tokio::net::TcpListener,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), GatewayError> {
    let client = Client::new(&opts.apiserver_addrs, None, &opts.tls).map_err(GatewayError::Client)?;
    let gw = Arc::new(Gateway { cfg: opts.config, client, names: names::Cache::default() });
    let app = axum::Router::new().fallback(move |req: Request<Body>| {
        let gw = gw.clone();
        async move { route(gw, req).await }
    });
    // Streams (a background command, a watch) may stay open for hours: shutting down does
    // not wait for them.
    // Small messages (a stream's events, a unary answer) go out at once: with Nagle's
    // algorithm each waited for the client's delayed acknowledgement (40 ms).
    let served = async move {
        match opts.serve_tls {
            Some(creds) => axum::serve(TlsListener::new(listener, &creds)?, app).await,
            None => {
                use axum::serve::ListenerExt;
                let listener = listener.tap_io(|tcp| {
                    if let Err(e) = tcp.set_nodelay(true) {
                        tracing::warn!(error = %e, "TCP_NODELAY on a gateway connection");
                    }
                });
                axum::serve(listener, app).await
            }
        }
    };
    tokio::select! {
        r = served => r.map_err(GatewayError::Serve),
        () = shutdown => Ok(()),
    }
}

type TlsConn = opendsec_common::conn::Conn<tokio_rustls::server::TlsStream<tokio::net::TcpStream>>;

/// HTTPS connections for axum: handshaken off the accept loop, bounded in number, cut when
/// no request line follows the handshake in time ([`opendsec_common::tls::incoming`]), with
/// TCP_NODELAY set.
struct TlsListener {
    local: std::net::SocketAddr,
    incoming: tokio_stream::wrappers::ReceiverStream<std::io::Result<TlsConn>>,
}

impl TlsListener {
    fn new(listener: tokio::net::TcpListener, creds: &Arc<opendsec_common::tls::Credentials>) -> std::io::Result<Self> {
        use opendsec_common::tls;
        let local = listener.local_addr()?;
        let incoming = tls::incoming(
            listener,
            creds.https_server_config(),
            opendsec_common::grpc::MAX_CONNECTIONS,
            0,
            tls::HTTP1_OPENING,
        );
        Ok(TlsListener { local, incoming })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsConn;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        use tokio_stream::StreamExt;
        loop {
            match self.incoming.next().await {
                Some(Ok(c)) => {
                    let peer = c.get_ref().get_ref().0.peer_addr().unwrap_or(self.local);
                    return (c, peer);
                }
                Some(Err(e)) => tracing::debug!(error = %e, "a gateway connection failed"),
                // The acceptor ended: its listener failed for good. Nothing more comes.
                None => std::future::pending::<()>().await,
            }
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

pub(crate) fn header<'a>(h: &'a HeaderMap, name: &str) -> Option<&'a str> {
    h.get(name).and_then(|v| v.to_str().ok()).map(str::trim).filter(|v| !v.is_empty())
}

async fn route(gw: Arc<Gateway>, req: Request<Body>) -> Response {
    let h = req.headers();
    match (header(h, "e2b-sandbox-id"), header(h, "e2b-sandbox-port")) {
        (Some(id), Some(port)) => {
            let (id, port) = (id.to_string(), port.to_string());
            match port.as_str() {
                ENVD_PORT => envd::handle(gw, id, req).await,
                CODE_INTERPRETER_PORT => interp::handle(gw, id, req).await,
                // The sandbox's own ports are not served through the gateway yet.
                _ => error::port_not_open(&id, &port),
            }
        }
        (Some(_), None) => error::RestError::bad_request("Missing header: E2b-Sandbox-Port").response(),
        (None, Some(_)) => error::RestError::bad_request("Missing header: E2b-Sandbox-Id").response(),
        (None, None) => api::handle(gw, req).await,
    }
}
