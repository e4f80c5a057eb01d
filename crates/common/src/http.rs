//! The small HTTP endpoint every daemon serves beside gRPC: `/metrics` (Prometheus text),
//! `/healthz` (the process is alive) and `/readyz` (it can serve, with the reason when not).

use std::future::Future;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use prometheus_client::registry::Registry;

/// Says whether the process can serve; `Err` carries the reason shown by `/readyz`.
pub type ReadyFn = Arc<dyn Fn() -> Result<(), String> + Send + Sync>;

#[derive(Clone)]
struct HttpState {
    registry: Arc<Mutex<Registry>>,
    ready: ReadyFn,
}

pub async fn serve_http(
    listener: tokio::net::TcpListener,
    registry: Arc<Mutex<Registry>>,
    ready: ReadyFn,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let app = Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(|| async { "ok\n" }))
        .route("/readyz", get(readyz))
        .with_state(HttpState { registry, ready });
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}

async fn metrics(State(s): State<HttpState>) -> (StatusCode, [(&'static str, &'static str); 1], String) {
    let mut out = String::new();
    let reg = s.registry.lock().unwrap_or_else(|p| p.into_inner());
    match prometheus_client::encoding::text::encode(&mut out, &reg) {
        Ok(()) => {
            (StatusCode::OK, [("content-type", "application/openmetrics-text; version=1.0.0; charset=utf-8")], out)
        }
        Err(e) => {
            (StatusCode::INTERNAL_SERVER_ERROR, [("content-type", "text/plain")], format!("encoding failed: {e}\n"))
        }
    }
}

async fn readyz(State(s): State<HttpState>) -> (StatusCode, String) {
    match (s.ready)() {
        Ok(()) => (StatusCode::OK, "ready\n".into()),
        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("not ready: {why}\n")),
    }
}
