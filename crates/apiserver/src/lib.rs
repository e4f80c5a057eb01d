//! The apiserver: the cluster's only public entry (reference sections 1, 2 and 13).
//!
//! It authenticates bearer tokens (cached, cleared when IAM's security epoch moves), admits
//! creations (spec bounds, default TTLs, per-principal rate, in-flight cap), places them on an
//! edge from the watcher snapshot plus its own in-flight overlay, reserves quota through IAM
//! `Admit`, and forwards every later call (and every `Runtime` call: exec, files, processes) to
//! the edge named in the sandbox id. It also proxies
//! IAM's `Admin` service with the caller's token, serves the `Images` API over the shared image
//! store (checking every creation's image), and writes one audit line per public call.
//!
//! Invariants: the apiserver holds no durable state (any apiserver serves any request); the
//! edge has the last word on admission; no token is ever logged or audited, and only hashes of
//! tokens are kept, in the caches.
#![forbid(unsafe_code)]

mod admin;
pub mod admission;
mod admits;
pub mod audit;
mod auth;
mod call;
mod create;
mod edge_creates;
mod forward;
mod guard;
mod image_store;
pub mod images;
pub mod limits;
mod metrics;
mod moves;
pub mod placement;
mod pools;
mod runtime;
mod sandboxes;
mod state;
mod upstream;

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use opendsec_common::ApiError;
use opendsec_common::grpc::{self, MAX_MESSAGE_BYTES};
use opendsec_proto::v1::admin_server::AdminServer;
use opendsec_proto::v1::images_server::ImagesServer;
use opendsec_proto::v1::runtime_server::RuntimeServer;
use opendsec_proto::v1::sandboxes_server::SandboxesServer;
use tokio_util::sync::CancellationToken;

use crate::audit::{AuditError, AuditLog, AuditWriter};
use crate::state::Shared;
use crate::upstream::Upstreams;

/// Everything `serve` needs, filled from the cluster config.
#[derive(Clone, Debug)]
pub struct ApiserverOptions {
    pub config: opendsec_common::config::ApiserverConfig,
    pub iam_addrs: Vec<String>,
    pub watcher_addrs: Vec<String>,
    /// This apiserver's certificate: the server certificate of the public port (unless
    /// `config.insecure_plaintext`) and the client certificate of its calls to IAM, watchers
    /// and edges.
    pub tls: Arc<opendsec_common::tls::Credentials>,
    pub audit_path: PathBuf,
    /// The shared image store (created if missing).
    pub image_store: PathBuf,
    /// Egress rules of sandboxes whose spec has none (`network.default_egress`, text form).
    pub default_egress: Vec<String>,
}

/// Largest request message of the unary public services (Sandboxes, Images).
pub const MAX_UNARY_REQUEST_BYTES: usize = 1 << 20;
/// Largest request message of Runtime: an upload chunk of 1 MiB with its header fits.
pub const MAX_RUNTIME_REQUEST_BYTES: usize = 2 << 20;
/// The longest a client's connection to the public port lives.
const PUBLIC_CONNECTION_AGE: std::time::Duration = std::time::Duration::from_secs(3600);

/// Why the apiserver could not start or stopped serving.
#[derive(Debug, thiserror::Error)]
pub enum ApiserverError {
    #[error("no IAM address given")]
    NoIamAddress,
    #[error("no watcher address given")]
    NoWatcherAddress,
    #[error("bad upstream address {addr:?}: {source}")]
    BadAddress { addr: String, source: ApiError },
    #[error("apiserver.insecure_plaintext: refused on {0}: plain text is for local development on a loopback address")]
    PlaintextNotLoopback(String),
    #[error(transparent)]
    Audit(#[from] AuditError),
    #[error("image store {path}: {source}")]
    ImageStore { path: PathBuf, source: opendsec_images::StoreError },
    #[error("gRPC server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("metrics endpoint failed: {0}")]
    Metrics(std::io::Error),
    #[error("cannot read the listen address: {0}")]
    Listen(std::io::Error),
}

/// Serves Sandboxes + Runtime + Admin + Images on `listener` (and /metrics /healthz /readyz on `metrics` when
/// given) until shutdown; background loops (epoch poll, snapshot refresh, audit writer) end
/// with it.
pub async fn serve(
    opts: ApiserverOptions,
    listener: tokio::net::TcpListener,
    metrics: Option<tokio::net::TcpListener>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ApiserverError> {
    if opts.iam_addrs.is_empty() {
        return Err(ApiserverError::NoIamAddress);
    }
    if opts.watcher_addrs.is_empty() {
        return Err(ApiserverError::NoWatcherAddress);
    }
    for addr in opts.iam_addrs.iter().chain(&opts.watcher_addrs) {
        grpc::channel(addr).map_err(|source| ApiserverError::BadAddress { addr: addr.clone(), source })?;
    }
    if opts.config.insecure_plaintext {
        let local = listener.local_addr().map_err(ApiserverError::Listen)?;
        if !local.ip().is_loopback() {
            return Err(ApiserverError::PlaintextNotLoopback(local.to_string()));
        }
        tracing::warn!(addr = %local, "serving the public API in plain text (insecure_plaintext)");
    }
    let store = opendsec_images::Store::open(&opts.image_store)
        .map_err(|source| ApiserverError::ImageStore { path: opts.image_store.clone(), source })?;
    let cfg = opts.config;
    let (audit, audit_task) = if cfg.audit.enabled {
        let writer = AuditWriter::open(&opts.audit_path, cfg.audit.max_bytes, cfg.audit.keep)?;
        let (log, task) = AuditLog::start(writer);
        (log, Some(task))
    } else {
        (AuditLog::disabled(), None)
    };
    let up = Upstreams::new(grpc::Links::new(opts.tls.clone()), opts.iam_addrs, opts.watcher_addrs);
    let plaintext = cfg.insecure_plaintext;
    let mut shared = Shared::new(cfg, up, audit, images::ImageStore::new(store));
    shared.default_egress = opts
        .default_egress
        .iter()
        .filter_map(|t| opendsec_common::egress::Rule::parse(t).ok())
        .map(|r| r.to_pb())
        .collect();
    let shared = Arc::new(shared);

    let cancel = CancellationToken::new();
    let mut loops = tokio::task::JoinSet::new();
    loops.spawn(state::epoch_loop(shared.clone(), cancel.clone()));
    loops.spawn(state::snapshot_loop(shared.clone(), cancel.clone()));
    {
        let cancel = cancel.clone();
        loops.spawn(async move {
            tokio::select! {
                _ = shutdown => cancel.cancel(),
                _ = cancel.cancelled() => {}
            }
        });
    }
    let metrics_task = metrics.map(|l| {
        let registry = shared.metrics.registry.clone();
        let s = shared.clone();
        let grace = s.cfg.readiness_grace;
        let ready: opendsec_common::http::ReadyFn = Arc::new(move || s.up.health.check(grace, Instant::now()));
        tokio::spawn(opendsec_common::http::serve_http(l, registry, ready, cancel.clone().cancelled_owned()))
    });

    // Messages are decoded only after the guard admitted the caller, and only this large:
    // unary calls carry specs and small requests, uploads stream chunks of at most 1 MiB.
    // Admin keeps the large limit for Restore (a backup file), which IAM refuses to anyone
    // without iam.admin before it decodes anything.
    let sandboxes = SandboxesServer::new(sandboxes::SandboxesService::new(shared.clone()))
        .max_decoding_message_size(MAX_UNARY_REQUEST_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let admin = AdminServer::new(admin::AdminProxy::new(shared.clone()))
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let images = ImagesServer::new(images::ImagesService::new(shared.clone()))
        .max_decoding_message_size(MAX_UNARY_REQUEST_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    let runtime = RuntimeServer::new(runtime::RuntimeService::new(shared.clone()))
        .max_decoding_message_size(MAX_RUNTIME_REQUEST_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    // A public connection lives at most an hour (then it is asked to go, its streams left to
    // finish): one that holds a slot without calls does not hold it for ever.
    let router = grpc::server()
        .max_connection_age(PUBLIC_CONNECTION_AGE)
        .layer(guard::GuardLayer::new(shared.clone()))
        .layer(opendsec_common::bounds::HoldLayer)
        .add_service(sandboxes)
        .add_service(admin)
        .add_service(images)
        .add_service(runtime);
    tracing::info!(addr = ?listener.local_addr().ok(), "apiserver serving");
    let stop = cancel.clone().cancelled_owned();
    let served = if plaintext {
        router.serve_with_incoming_shutdown(grpc::plain_incoming(listener), stop).await
    } else {
        let per_source = shared.cfg.max_connections_per_source as usize;
        let incoming = opendsec_common::tls::incoming(
            listener,
            opts.tls.server_config(false),
            grpc::MAX_CONNECTIONS,
            per_source,
            opendsec_common::tls::HTTP2_OPENING,
        );
        router.serve_with_incoming_shutdown(incoming, stop).await
    };

    cancel.cancel();
    while loops.join_next().await.is_some() {}
    let metrics_result = match metrics_task {
        Some(t) => match t.await {
            Ok(r) => r.map_err(ApiserverError::Metrics),
            Err(e) => Err(ApiserverError::Metrics(std::io::Error::other(e))),
        },
        None => Ok(()),
    };
    // Lines of calls still finishing after this are not written: the log closes with the server.
    shared.audit.close();
    if let Some(t) = audit_task {
        let _ = t.await;
    }
    served?;
    metrics_result
}
