//! The watcher: probes every edge's Status each `probe_interval`, serves the versioned cluster
//! snapshot apiservers place from, and drives quota reconciliation.
//!
//! It keeps no durable state: after a restart its view is rebuilt from the config's edge list,
//! the edges' periodic registrations and its own probes. Several watchers may run; all probe
//! and serve snapshots, but only the one holding IAM's `watcher-reconcile` lock reconciles, and
//! it counts itself leader only until `request time + lock TTL - 2 s` by its own clock, so
//! clock skew never lets two reconcile at once. IAM fences it too: it applies a reconciliation
//! only for the lock's holder, and measures lease ages at the moment the edge's list was read
//! (in IAM's clock, as reckoned from the lock's answers), so a call that arrives late releases
//! nothing bound after its list was read.
#![forbid(unsafe_code)]

use std::collections::{BTreeMap, HashSet};

use futures::StreamExt;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opendsec_common::config::{EdgeEndpoint, WatcherConfig};
use opendsec_common::grpc::{self, Links};
use opendsec_common::pki::Role;
use opendsec_common::time::now_ms;
use opendsec_common::tls::Credentials;
use opendsec_common::{ApiError, ids};
use opendsec_proto::v1 as pb;
use pb::edge_client::EdgeClient;
use pb::iam_client::IamClient;
use pb::watcher_server::{Watcher as WatcherRpc, WatcherServer};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

/// Name of the IAM lock that elects the reconciling watcher.
pub use opendsec_common::RECONCILE_LOCK;

/// This watcher's hold of the reconcile lock, as of IAM's last answer to it.
#[derive(Clone, Copy, Debug)]
struct Lead {
    /// Until when it counts itself leader (its own clock: request time + TTL - 2 s).
    until: Instant,
    /// IAM's clock when it granted the lock (the lock's expiry less its TTL), taken as IAM's
    /// clock at `answered`: so a later instant maps to IAM's time no later than IAM's own.
    iam_ms: i64,
    answered: Instant,
}

impl Lead {
    /// IAM's time at `t` (not before `answered`), never ahead of IAM's own clock.
    fn iam_ms_at(&self, t: Instant) -> i64 {
        let since = t.saturating_duration_since(self.answered).as_millis();
        self.iam_ms.saturating_add(i64::try_from(since).unwrap_or(i64::MAX))
    }
}

/// Edges reconciled at once (each: one Status with leases from the edge, one Reconcile to IAM).
const RECONCILE_CONCURRENCY: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum WatcherError {
    #[error("invalid watcher setup: {0}")]
    Setup(ApiError),
    #[error("watcher server failed: {0}")]
    Serve(#[from] tonic::transport::Error),
}

#[derive(Debug)]
pub struct WatcherOptions {
    /// Unique per watcher instance (lock holder name).
    pub id: String,
    pub config: WatcherConfig,
    pub edges: Vec<EdgeEndpoint>,
    pub iam_addrs: Vec<String>,
    /// This watcher's certificate (mTLS to IAM, to edges and for its own server).
    pub tls: Arc<Credentials>,
}

#[derive(Clone, Debug, Default)]
struct EdgeEntry {
    address: String,
    healthy: bool,
    failures: u32,
    status: Option<pb::EdgeStatus>,
    last_seen_ms: i64,
    /// When it last turned unhealthy; for an edge never seen healthy, when it became known.
    unhealthy_since_ms: i64,
}

/// What one reconciliation round did (for tests and logs).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReconcileReport {
    pub leader: bool,
    pub edges_reconciled: u32,
    pub edges_emptied: u32,
    pub adopted: u32,
    pub released: u32,
    pub swept: u32,
    pub errors: u32,
}

/// A running watcher's shared state.
#[derive(Clone)]
pub struct Watcher {
    inner: Arc<Inner>,
}
impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher").finish_non_exhaustive()
    }
}

struct Inner {
    opts: WatcherOptions,
    edges: Mutex<BTreeMap<String, EdgeEntry>>,
    snapshot: Mutex<Arc<pb::ClusterSnapshot>>,
    links: Arc<Links>,
    iam: Vec<String>,
    /// The last edge a reconcile round reached (the next round starts after it).
    reconcile_cursor: Mutex<String>,
}

impl Watcher {
    pub fn new(opts: WatcherOptions) -> Result<Watcher, WatcherError> {
        let now = now_ms();
        let mut edges = BTreeMap::new();
        for e in &opts.edges {
            ids::validate_edge(&e.name).map_err(WatcherError::Setup)?;
            edges.insert(
                e.name.clone(),
                EdgeEntry { address: e.address.clone(), unhealthy_since_ms: now, ..EdgeEntry::default() },
            );
        }
        let iam = opts.iam_addrs.clone();
        let links = Links::new(opts.tls.clone());
        Ok(Watcher {
            inner: Arc::new(Inner {
                opts,
                edges: Mutex::new(edges),
                snapshot: Mutex::new(Arc::new(pb::ClusterSnapshot::default())),
                links,
                iam,
                reconcile_cursor: Mutex::new(String::new()),
            }),
        })
    }

    fn edges(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, EdgeEntry>> {
        self.inner.edges.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn snapshot(&self) -> Arc<pb::ClusterSnapshot> {
        self.inner.snapshot.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Adds or updates an edge (registration). A changed address resets its health.
    pub fn register(&self, name: &str, address: &str) -> Result<(), ApiError> {
        ids::validate_edge(name)?;
        if address.is_empty() || address.len() > 256 {
            return Err(ApiError::invalid("edge address must be 1..=256 characters"));
        }
        let mut edges = self.edges();
        let entry = edges.entry(name.to_string()).or_insert_with(|| EdgeEntry {
            address: address.to_string(),
            unhealthy_since_ms: now_ms(),
            ..EdgeEntry::default()
        });
        if entry.address != address {
            self.inner.links.forget(&entry.address);
            entry.address = address.to_string();
            entry.failures = 0;
        }
        Ok(())
    }

    /// The edge `name` at `addr` (its certificate must say it is that edge).
    fn edge_client(&self, name: &str, addr: &str) -> Result<EdgeClient<Channel>, ApiError> {
        let ch = self.inner.links.channel(addr, Role::Edge, Some(name))?;
        Ok(EdgeClient::new(ch).max_decoding_message_size(grpc::MAX_MESSAGE_BYTES))
    }

    fn iam_client(&self) -> Result<IamClient<Channel>, ApiError> {
        let n = self.inner.iam.len();
        if n == 0 {
            return Err(ApiError::unavailable("no IAM address configured"));
        }
        let addr = &self.inner.iam[rand::random::<u32>() as usize % n];
        let ch = self.inner.links.channel(addr, Role::Iam, None)?;
        Ok(IamClient::new(ch)
            .max_decoding_message_size(grpc::MAX_MESSAGE_BYTES)
            .max_encoding_message_size(grpc::MAX_MESSAGE_BYTES))
    }

    async fn status_of(&self, name: &str, addr: &str, include_leases: bool) -> Result<pb::EdgeStatus, ApiError> {
        let mut client = self.edge_client(name, addr)?;
        let mut req = Request::new(pb::StatusRequest { include_leases });
        req.set_timeout(self.inner.opts.config.probe_timeout);
        let status = client.status(req).await.map_err(|s| ApiError::from_status(&s))?.into_inner();
        if status.edge != name {
            return Err(ApiError::unavailable(format!(
                "edge at {addr} answered as {:?}, expected {name:?}",
                status.edge
            )));
        }
        Ok(status)
    }

    /// One probe round: every edge concurrently, then a new snapshot version.
    pub async fn probe_round(&self) {
        let targets: Vec<(String, String)> = self.edges().iter().map(|(n, e)| (n.clone(), e.address.clone())).collect();
        let results =
            futures::future::join_all(targets.iter().map(|(name, addr)| async move {
                (name.clone(), addr.clone(), self.status_of(name, addr, false).await)
            }))
            .await;
        let now = now_ms();
        let threshold = self.inner.opts.config.failure_threshold;
        let mut edges = self.edges();
        for (name, addr, result) in results {
            let Some(e) = edges.get_mut(&name) else { continue };
            if e.address != addr {
                continue; // re-registered at another address meanwhile
            }
            match result {
                Ok(status) => {
                    if !e.healthy {
                        tracing::info!(edge = %name, "edge healthy");
                    }
                    e.healthy = true;
                    e.failures = 0;
                    e.status = Some(status);
                    e.last_seen_ms = now;
                    e.unhealthy_since_ms = 0;
                }
                Err(err) => {
                    e.failures = e.failures.saturating_add(1);
                    if e.healthy && e.failures >= threshold {
                        tracing::warn!(edge = %name, reason = %err.reason, error = %err.message, "edge unhealthy");
                        e.healthy = false;
                        e.unhealthy_since_ms = now;
                    }
                }
            }
        }
        let mut snap = self.inner.snapshot.lock().unwrap_or_else(|p| p.into_inner());
        let version = snap.version + 1;
        *snap = Arc::new(pb::ClusterSnapshot {
            version,
            taken_at_ms: now,
            edges: edges
                .iter()
                .map(|(name, e)| pb::EdgeInfo {
                    name: name.clone(),
                    address: e.address.clone(),
                    healthy: e.healthy,
                    status: e.status.clone(),
                    last_seen_ms: e.last_seen_ms,
                    unhealthy_since_ms: e.unhealthy_since_ms,
                })
                .collect(),
        });
    }

    /// Takes or renews the reconcile lock: this watcher's hold of it, or `None` when another
    /// holds it.
    async fn take_lock(&self) -> Result<Option<Lead>, Status> {
        let ttl = self.inner.opts.config.lock_ttl;
        let asked = Instant::now();
        let mut iam = self.iam_client().map_err(|e| e.to_status())?;
        let mut req = Request::new(pb::AcquireLockRequest {
            name: RECONCILE_LOCK.into(),
            holder: self.inner.opts.id.clone(),
            ttl_ms: ttl.as_millis() as u64,
        });
        // A hung IAM must not hold the round (renewals are retried while the window lasts).
        req.set_timeout(self.inner.opts.config.probe_timeout);
        let r = iam.acquire_lock(req).await?.into_inner();
        let answered = Instant::now();
        let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
        Ok(r.acquired.then(|| Lead {
            until: asked + ttl.saturating_sub(Duration::from_secs(2)),
            iam_ms: r.expires_at_ms.saturating_sub(ttl_ms),
            answered,
        }))
    }

    /// One edge's reconciliation: its live leases (asked of it while healthy; none once it has
    /// been lost past the grace), told to IAM while this watcher still leads (`leader`), the
    /// call bounded by what is left of that; skipped this round when neither is known.
    async fn reconcile_edge(&self, name: &str, leader: &Mutex<Lead>, report: &Mutex<ReconcileReport>) {
        // As the edge is now, not as it was when the round began (a round can take minutes).
        let Some(e) = self.edges().get(name).cloned() else { return };
        // Before the edge is asked: the list is no older than this.
        let read_at_ms = leader.lock().unwrap_or_else(|p| p.into_inner()).iam_ms_at(Instant::now());
        let grace_ms = self.inner.opts.config.lost_edge_grace.as_millis() as i64;
        let live = if e.healthy {
            match self.status_of(name, &e.address, true).await {
                Ok(s) => s.leases,
                Err(err) => {
                    tracing::debug!(edge = %name, error = %err, "reconcile: status failed, skipping edge");
                    report.lock().unwrap_or_else(|p| p.into_inner()).errors += 1;
                    return;
                }
            }
        } else if e.unhealthy_since_ms > 0 && now_ms() - e.unhealthy_since_ms > grace_ms {
            report.lock().unwrap_or_else(|p| p.into_inner()).edges_emptied += 1;
            Vec::new()
        } else {
            return;
        };
        let left = leader.lock().unwrap_or_else(|p| p.into_inner()).until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return; // no longer the leader: another watcher may be reconciling this edge
        }
        let result = match self.iam_client() {
            Ok(mut iam) => {
                let mut req = Request::new(pb::ReconcileRequest {
                    edge: name.to_string(),
                    live,
                    holder: self.inner.opts.id.clone(),
                    read_at_ms,
                });
                req.set_timeout(left);
                iam.reconcile(req).await
            }
            Err(e) => Err(e.to_status()),
        };
        let mut report = report.lock().unwrap_or_else(|p| p.into_inner());
        match result {
            Ok(r) => {
                let r = r.into_inner();
                report.edges_reconciled += 1;
                report.adopted += r.adopted;
                report.released += r.released;
                if r.adopted > 0 || r.released > 0 {
                    tracing::info!(edge = %name, adopted = r.adopted, released = r.released, "reconciled");
                }
            }
            Err(s) => {
                tracing::warn!(edge = %name, error = %s.message(), "reconcile failed");
                report.errors += 1;
            }
        }
    }

    /// One reconciliation round, if this watcher holds (or wins) the reconcile lock: every
    /// edge, `RECONCILE_CONCURRENCY` at a time, the lock renewed once half the leadership window
    /// (TTL - 2 s) has gone, on a timer. A round that loses the lock (or cannot renew it in
    /// time) stops; the next one starts with the edges this one did not reach, so no edge waits
    /// on the others forever.
    pub async fn reconcile_round(&self) -> ReconcileReport {
        let leader = match self.take_lock().await {
            Ok(Some(lead)) => Mutex::new(lead),
            Ok(None) => return ReconcileReport::default(),
            Err(s) => {
                tracing::warn!(error = %s.message(), "reconcile: cannot take the lock");
                return ReconcileReport { errors: 1, ..ReconcileReport::default() };
            }
        };
        let until = || leader.lock().unwrap_or_else(|p| p.into_inner()).until;
        let half_window = self.inner.opts.config.lock_ttl.saturating_sub(Duration::from_secs(2)) / 2;
        let report = Mutex::new(ReconcileReport { leader: true, ..ReconcileReport::default() });
        let mut edges: Vec<String> = self.edges().keys().cloned().collect();
        // The edges after the one the last round reached first, then the rest.
        let cursor = self.inner.reconcile_cursor.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let first = edges.iter().position(|n| *n > cursor).unwrap_or(0);
        edges.rotate_left(first);
        let mut pending = edges.iter();
        let mut running = futures::stream::FuturesUnordered::new();
        let mut complete = true;
        let mut next_try = Instant::now();
        loop {
            let now = Instant::now();
            if now + half_window >= until() && now >= next_try {
                match self.take_lock().await {
                    Ok(Some(u)) => *leader.lock().unwrap_or_else(|p| p.into_inner()) = u,
                    Ok(None) => {
                        tracing::warn!("reconcile: another watcher holds the lock, stopping the round");
                        leader.lock().unwrap_or_else(|p| p.into_inner()).until = now;
                    }
                    // Tried again shortly, while the window lasts.
                    Err(_) => next_try = now + Duration::from_millis(100),
                }
            }
            if Instant::now() >= until() {
                tracing::warn!("reconcile: leadership window over, stopping the round");
                complete = false;
                break;
            }
            while running.len() < RECONCILE_CONCURRENCY {
                let Some(name) = pending.next() else { break };
                *self.inner.reconcile_cursor.lock().unwrap_or_else(|p| p.into_inner()) = name.clone();
                running.push(self.reconcile_edge(name, &leader, &report));
            }
            if running.is_empty() {
                break;
            }
            // An edge done, or the time to renew the lock.
            let wake = until().checked_sub(half_window).unwrap_or_else(Instant::now).max(next_try);
            tokio::select! {
                _ = running.next() => {}
                _ = tokio::time::sleep_until(wake.max(Instant::now()).into()) => {}
            }
        }
        // Calls already made finish (each is one edge's whole answer, applied by IAM at once).
        while running.next().await.is_some() {}
        drop(running);
        let mut report = report.into_inner().unwrap_or_else(|p| p.into_inner());
        if complete && Instant::now() < until() {
            let known: HashSet<&String> = edges.iter().collect();
            let req = pb::SweepUnboundRequest {
                known_edges: known.into_iter().cloned().collect(),
                older_than_s: self.inner.opts.config.sweep_unbound_after.as_secs(),
                holder: self.inner.opts.id.clone(),
            };
            match self.iam_client() {
                Ok(mut iam) => match iam.sweep_unbound(req).await {
                    Ok(r) => report.swept = r.into_inner().released,
                    Err(s) => {
                        tracing::warn!(error = %s.message(), "sweep failed");
                        report.errors += 1;
                    }
                },
                Err(_) => report.errors += 1,
            }
        }
        report
    }

    /// Runs the probe and reconcile loops until `shutdown`.
    pub async fn run_loops(&self, shutdown: impl Future<Output = ()> + Send) {
        let cfg = self.inner.opts.config.clone();
        use opendsec_common::periodic::{Cancel, Start, every};
        let never = std::future::pending::<()>;
        let probe = every(cfg.probe_interval, Start::Now, Cancel::Anytime, never(), || self.probe_round());
        // The first reconcile waits one interval: edges get probed first.
        let reconcile = every(cfg.reconcile_interval, Start::AfterOnePeriod, Cancel::Anytime, never(), || async {
            let r = self.reconcile_round().await;
            tracing::debug!(?r, "reconcile round");
        });
        tokio::select! {
            _ = probe => {}
            _ = reconcile => {}
            _ = shutdown => {}
        }
    }

    /// The gRPC service (internal: served over mTLS behind `opendsec_common::acl`).
    pub fn service(&self) -> WatcherServer<Rpc> {
        WatcherServer::new(Rpc(self.clone()))
    }
}

/// The gRPC face of a watcher.
#[derive(Debug)]
pub struct Rpc(Watcher);

#[tonic::async_trait]
impl WatcherRpc for Rpc {
    async fn get_snapshot(
        &self,
        _req: Request<pb::GetSnapshotRequest>,
    ) -> Result<Response<pb::ClusterSnapshot>, Status> {
        Ok(Response::new((*self.0.snapshot()).clone()))
    }

    async fn register_edge(
        &self,
        req: Request<pb::RegisterEdgeRequest>,
    ) -> Result<Response<pb::RegisterEdgeResponse>, Status> {
        // An edge registers only under the name its certificate gives it.
        opendsec_common::acl::require_self(&req, Role::Edge, &req.get_ref().name, &[]).map_err(|e| e.to_status())?;
        let r = req.into_inner();
        self.0.register(&r.name, &r.address).map_err(|e| e.to_status())?;
        Ok(Response::new(pb::RegisterEdgeResponse {}))
    }
}

/// Serves the watcher on `listener` and runs its loops until `shutdown`.
pub async fn serve(
    opts: WatcherOptions,
    listener: tokio::net::TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), WatcherError> {
    let watcher = Watcher::new(opts)?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let loops = {
        let w = watcher.clone();
        let mut rx = stop_rx.clone();
        tokio::spawn(async move {
            w.run_loops(async move {
                let _ = rx.wait_for(|v| *v).await;
            })
            .await
        })
    };
    let router = grpc::internal_server().add_service(watcher.service());
    let tls = watcher.inner.opts.tls.clone();
    let result = grpc::serve_internal(router, listener, &tls, async move {
        shutdown.await;
        let _ = stop_tx.send(true);
    })
    .await;
    let _ = loops.await;
    result.map_err(WatcherError::from)
}
