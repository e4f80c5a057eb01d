//! The edge: the control plane of one node (reference section 5). It makes the final admission
//! decision for creations, runs the sandbox state machine through its backends, keeps one
//! durable record per sandbox, expires sandboxes by TTL, probes their liveness, releases the
//! leases of ended sandboxes to IAM and checks those of new sandboxes, both in batches, and
//! registers with the watchers.
//!
//! Invariants the crate keeps (DESIGN.md section 4):
//! - a record is written before the backend is called, and on every state change;
//! - on start, RUNNING and PAUSED sandboxes are adopted again, everything else is settled, and
//!   backends clean up leftovers no record claims, all before [`Edge::start`] returns;
//! - the edge has the last word on admission (capacity and host pressure are checked here,
//!   whatever the apiserver's snapshot said);
//! - one lifecycle operation at a time per sandbox.
//!
//! Layout: `state` (the state machine), `record` (records on disk), `admission` and `ttl`
//! (pure rules), `table` (the in-memory table), `core` (operations), `recover` (start-up),
//! `release` (lease releases and checks, batched), `remote` (IAM and watcher calls), `host` (the host's readings),
//! `service` (gRPC), `backend` (the `Backend` trait and the `sim` backend), `linuxrt` (the Linux
//! runtime of the container backend: cgroups, rootfs, setup process, seccomp, a driver).
#![deny(unsafe_code)]

use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::sync::watch;

use opendsec_common::config::EdgeConfig;
use opendsec_common::grpc::{self, MAX_MESSAGE_BYTES};
use opendsec_common::ids;
use opendsec_proto::v1::edge_server::EdgeServer;
use opendsec_proto::v1::runtime_server::RuntimeServer;

pub mod admission;
pub mod backend;
mod core;
pub mod error;
pub mod host;
pub mod linuxrt;
pub mod netpol;
pub mod pool;
pub mod record;
mod recover;
mod release;
mod remote;
pub mod runtime;
mod service;
pub mod sessions;
pub mod state;
mod table;
pub mod ttl;

pub use backend::{Backend, BackendError, Usage, Versioned};
pub use error::EdgeError;
pub use host::{FixedHost, HostProbe, HostSize, ProcHost};
pub use record::SandboxRecord;
pub use remote::LeaseBinding;
pub use service::EdgeService;
pub use state::{SandboxStatus, end_reason};

use crate::admission::Capacity;
use crate::core::{Inner, InnerParts};

/// How long `close` waits for the background loops, and for the final release flush.
const CLOSE_TIMEOUT: Duration = Duration::from_secs(5);

/// What an edge needs to start.
#[derive(Clone, Debug)]
pub struct EdgeOptions {
    pub name: String,
    /// Records live in `<state_dir>/sandboxes`.
    pub state_dir: PathBuf,
    pub config: EdgeConfig,
    pub iam_addrs: Vec<String>,
    pub watcher_addrs: Vec<String>,
    /// This edge's certificate: its server (mTLS, role table of `opendsec_common::acl`) and its
    /// calls to IAM and the watchers.
    pub tls: Arc<opendsec_common::tls::Credentials>,
    /// The address watchers and apiservers reach this edge at; empty: the listener's address
    /// once [`Edge::serve`] runs.
    pub advertise: String,
    /// The wall clock of TTLs and retention (tests move a manual one).
    pub clock: opendsec_common::time::Clock,
    /// The sandbox network ([`netpol::Network::new`]), shared with the networked backends;
    /// `None`: sandboxes get loopback only.
    pub network: Option<Arc<netpol::Network>>,
}

/// The gRPC service [`Edge::service`] returns.
pub type EdgeGrpc = EdgeServer<EdgeService>;

/// The gRPC service [`Edge::runtime_service`] returns.
pub type EdgeRuntimeGrpc = RuntimeServer<runtime::RuntimeService>;

/// A running edge. Cheap to clone; when the last handle is dropped, its background loops stop
/// (without the final release flush: call [`Edge::close`] or let [`Edge::serve`] finish for that).
#[derive(Clone)]
pub struct Edge {
    inner: Arc<Inner>,
    _guard: Arc<StopLoopsOnDrop>,
}
impl std::fmt::Debug for Edge {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Edge").finish_non_exhaustive()
    }
}

struct StopLoopsOnDrop(Arc<Inner>);

impl Drop for StopLoopsOnDrop {
    fn drop(&mut self) {
        self.0.shutdown_tx.send_replace(true);
    }
}

impl Edge {
    /// Loads the records from `state_dir`, re-adopts RUNNING and PAUSED sandboxes, settles
    /// the rest (queueing their lease releases), has the backends clean up leftovers matching
    /// no record, and only then returns; the background loops (TTL and liveness, release
    /// batching, registration) run until shutdown.
    pub async fn start(opts: EdgeOptions, backends: Vec<Arc<dyn Backend>>) -> Result<Edge, EdgeError> {
        Edge::start_with_host(opts, backends, Arc::new(ProcHost::new())).await
    }

    /// [`Edge::start`] with a chosen host probe (tests use [`FixedHost`]).
    pub async fn start_with_host(
        opts: EdgeOptions,
        backends: Vec<Arc<dyn Backend>>,
        host: Arc<dyn HostProbe>,
    ) -> Result<Edge, EdgeError> {
        check_options(&opts, &backends)?;
        let store = record::RecordStore::open(&opts.state_dir)?;
        let member_store = record::RecordStore::open_named(&opts.state_dir, "pool")?;
        let sim_only = backends.iter().all(|b| b.name() == "sim");
        let capacity = capacity(&opts, sim_only, host.as_ref());
        let links = grpc::Links::new(opts.tls.clone());
        let remote = remote::Remote::new(&opts.name, &opts.iam_addrs, &opts.watcher_addrs, &links)
            .map_err(|e| EdgeError::Options(e.message))?;
        let inner = Arc::new(Inner::new(InnerParts {
            name: opts.name.clone(),
            cfg: opts.config.clone(),
            state_dir: opts.state_dir.clone(),
            tls: opts.tls.clone(),
            capacity,
            backends,
            host,
            store,
            member_store,
            remote,
            advertise: opts.advertise.clone(),
            clock: opts.clock.clone(),
            network: opts.network.clone(),
        }));
        inner.load_draining()?;
        inner.recover().await?;
        if let Some(net) = &inner.network {
            let mut rx = inner.shutdown_tx.subscribe();
            let stop = async move {
                let _ = rx.wait_for(|closing| *closing).await;
            };
            let dns = net.serve_dns(stop).await.map_err(EdgeError::NetworkSetup)?;
            inner.tasks.lock().unwrap_or_else(|p| p.into_inner()).push(dns);
        }

        let rx = inner.shutdown_tx.subscribe();
        let tasks = vec![
            tokio::spawn(ttl_loop(inner.clone(), rx.clone())),
            tokio::spawn(core::release_loop(inner.clone(), rx.clone())),
            tokio::spawn(core::pool_loop(inner.clone(), rx.clone())),
            tokio::spawn(register_loop(inner.clone(), rx)),
        ];
        inner.tasks.lock().unwrap_or_else(|p| p.into_inner()).extend(tasks);
        tracing::info!(edge = %inner.name, boot_id = %inner.boot_id, backends = ?inner.backend_names(), "edge started");
        Ok(Edge { _guard: Arc::new(StopLoopsOnDrop(inner.clone())), inner })
    }

    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Random per start: the watchers notice a restarted edge by it.
    pub fn boot_id(&self) -> &str {
        &self.inner.boot_id
    }

    /// The `Edge` gRPC service, to add to an internal router ([`grpc::internal_server`]).
    pub fn service(&self) -> EdgeGrpc {
        EdgeServer::new(EdgeService { inner: self.inner.clone() })
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// The `Runtime` gRPC service (forwarding to sandboxes' agents), to add to the same router
    /// as [`Edge::service`].
    pub fn runtime_service(&self) -> EdgeRuntimeGrpc {
        RuntimeServer::new(runtime::RuntimeService { inner: self.inner.clone() })
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES)
    }

    /// Serves the edge on `listener` until `shutdown` completes, then [`Edge::close`]s it.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), EdgeError> {
        if let Ok(addr) = listener.local_addr() {
            let mut adv = self.inner.advertise.lock().unwrap_or_else(|p| p.into_inner());
            if adv.is_empty() {
                *adv = addr.to_string();
                self.inner.register_now.notify_one();
            }
        }
        let router = grpc::internal_server().add_service(self.service()).add_service(self.runtime_service());
        let tls = self.inner.tls.clone();
        let served = grpc::serve_internal(router, listener, &tls, shutdown).await;
        self.close().await;
        served.map_err(EdgeError::from)
    }

    /// Stops the edge: refuses new creations, stops the background loops, stops every sandbox
    /// unless `keep_sandboxes_on_exit`, and flushes queued lease releases (best effort).
    /// Calling it again does nothing.
    pub async fn close(&self) {
        let inner = &self.inner;
        if inner.closing.swap(true, Ordering::SeqCst) {
            return;
        }
        inner.shutdown_tx.send_replace(true);
        let tasks = std::mem::take(&mut *inner.tasks.lock().unwrap_or_else(|p| p.into_inner()));
        for mut t in tasks {
            if tokio::time::timeout(CLOSE_TIMEOUT, &mut t).await.is_err() {
                t.abort();
            }
        }
        if !inner.cfg.keep_sandboxes_on_exit {
            inner.stop_all(end_reason::EDGE_SHUTDOWN).await;
            inner.stop_all_members().await;
            // Nothing is left that needs the network: take it off the host.
            if let Some(net) = inner.network.clone() {
                match tokio::task::spawn_blocking(move || net.shutdown()).await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::warn!(edge = %inner.name, error = %e, "removing the network failed"),
                    Err(e) => tracing::warn!(edge = %inner.name, error = %e, "removing the network failed"),
                }
            }
        }
        match tokio::time::timeout(CLOSE_TIMEOUT, inner.flush_releases()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(edge = %inner.name, error = %e, "final lease release failed"),
            Err(_) => tracing::warn!(edge = %inner.name, "final lease release timed out"),
        }
        tracing::info!(edge = %inner.name, "edge stopped");
    }

    /// Lease work waiting for IAM: (releases queued, post-creation "still bound here?" checks
    /// queued).
    /// Runs one round of the TTL sweep now: expiry, liveness probes, deletion of ended records
    /// past retention (what the loop does every `ttl_check_interval`). With a manual
    /// [`EdgeOptions::clock`], a test moves the clock and sweeps, instead of waiting.
    pub async fn sweep_now(&self) {
        self.inner.ttl_round().await
    }

    /// Syncs the record log made so far (concurrent durable writes share them).
    pub fn record_syncs(&self) -> u64 {
        self.inner.store.syncs()
    }

    pub fn pending_releases(&self) -> (usize, usize) {
        self.inner.releases.len()
    }

    /// Records the edge holds (live and ended within retention).
    pub fn sandbox_count(&self) -> usize {
        self.inner.table_len()
    }
}

fn check_options(opts: &EdgeOptions, backends: &[Arc<dyn Backend>]) -> Result<(), EdgeError> {
    let bad = |m: String| Err(EdgeError::Options(m));
    ids::validate_edge(&opts.name).map_err(|e| EdgeError::Options(e.message))?;
    if backends.is_empty() {
        return bad("no backend given".into());
    }
    for (i, b) in backends.iter().enumerate() {
        if backends[..i].iter().any(|o| o.name() == b.name()) {
            return bad(format!("backend {} given twice", b.name()));
        }
    }
    // The config's own rules live with the config (the same checks a config file gets).
    opts.config.validate().map_err(|e| EdgeError::Options(e.to_string()))
}

/// The configured capacity; with real backends, zero fields are measured on the host.
fn capacity(opts: &EdgeOptions, sim_only: bool, host: &dyn HostProbe) -> Capacity {
    let c = &opts.config.capacity;
    let mut cap = Capacity {
        cpu_millis: u64::from(c.cpu_millis),
        memory_mb: c.memory_mb,
        disk_mb: c.disk_mb,
        gpus: u64::from(c.gpus),
        max_sandboxes: opts.config.max_sandboxes,
    };
    if !sim_only && (cap.cpu_millis == 0 || cap.memory_mb == 0 || cap.disk_mb == 0) {
        let size = host.size(&opts.state_dir);
        if cap.cpu_millis == 0 {
            cap.cpu_millis = size.cpu_millis;
        }
        if cap.memory_mb == 0 {
            cap.memory_mb = size.memory_mb;
        }
        if cap.disk_mb == 0 {
            cap.disk_mb = size.disk_mb;
        }
    }
    cap
}

/// TTL expiry, liveness probes and removal of ended records, every `ttl_check_interval`.
async fn ttl_loop(inner: Arc<Inner>, mut shutdown: watch::Receiver<bool>) {
    use opendsec_common::periodic::{Cancel, Start, every};
    let stop = async move {
        let _ = shutdown.wait_for(|closing| *closing).await;
    };
    // A round that started stopping expired sandboxes finishes.
    every(inner.cfg.ttl_check_interval, Start::AfterOnePeriod, Cancel::BetweenRounds, stop, || inner.ttl_round()).await
}

/// RegisterEdge with every watcher: at once, then every `register_interval` (and at once when
/// the advertised address becomes known).
async fn register_loop(inner: Arc<Inner>, mut shutdown: watch::Receiver<bool>) {
    loop {
        if *shutdown.borrow() {
            return;
        }
        let advertise = inner.advertise.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if !advertise.is_empty() {
            inner.remote.register(&advertise).await;
        }
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tokio::time::sleep(inner.cfg.register_interval) => {}
            _ = inner.register_now.notified() => {}
        }
    }
}
