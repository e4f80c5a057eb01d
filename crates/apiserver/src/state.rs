//! What every handler of one apiserver shares: the config, upstream clients, the caches, the
//! latest cluster snapshot with the in-flight overlay and penalties, the rate limiters, the
//! audit log and the metrics; plus the background loops that keep the epoch and the snapshot
//! fresh.
//!
//! The snapshot is replaced whole (an `Arc` swap), never edited: handlers read a consistent
//! view without holding a lock across an await. Placement and the overlay update happen under
//! one lock, so two placements on this apiserver always see each other.

use opendsec_common::periodic::{self, Cancel, Start};
use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use opendsec_common::config::ApiserverConfig;
use opendsec_common::{ApiError, Reason, time};
use opendsec_proto::v1 as pb;
use tokio_util::sync::CancellationToken;

use crate::admission::RateLimiter;
use crate::audit::{AuditLog, AuditRecord};
use crate::auth::{AuthCache, Identity, token_key};
use crate::image_store::ImageStore;
use crate::limits::{AnswerBudget, FailureTracker, FairGate, PerKey};
use crate::metrics::Metrics;
use crate::placement::{self, Demand, EdgeView, Inflight, Params, Penalties, PlacementError, Res};
use crate::upstream::Upstreams;

/// Completed overlay entries older than this go even if no later snapshot arrived (a watcher
/// clock far behind ours must not pin capacity).
const OVERLAY_MAX_AGE_MS: i64 = 60_000;

/// The latest cluster snapshot, in the forms placement and forwarding need.
#[derive(Debug, Default)]
pub struct Snapshot {
    pub version: u64,
    pub taken_at_ms: i64,
    pub edges: Vec<EdgeView>,
    /// Edge name -> (address, healthy).
    pub addrs: HashMap<String, (String, bool)>,
    /// Sandboxes that moved: id -> the edge holding them now (edges report them, `moved_in`).
    pub moved: HashMap<String, String>,
}

impl Snapshot {
    pub fn from_proto(s: &pb::ClusterSnapshot) -> Snapshot {
        Snapshot {
            version: s.version,
            taken_at_ms: s.taken_at_ms,
            edges: s.edges.iter().map(EdgeView::from_info).collect(),
            addrs: s.edges.iter().map(|e| (e.name.clone(), (e.address.clone(), e.healthy))).collect(),
            moved: s
                .edges
                .iter()
                .flat_map(|e| e.status.iter().flat_map(|st| st.moved_in.iter()).map(|id| (id.clone(), e.name.clone())))
                .collect(),
        }
    }
}

/// Most routes remembered; past it the map starts over (the snapshot and the source edges'
/// answers still find every moved sandbox).
const ROUTES_MAX: usize = 65_536;

/// Where moved sandboxes went, as edges answered.
#[derive(Debug, Default)]
pub struct Routes {
    learned: RwLock<HashMap<String, String>>,
}

impl Routes {
    pub(crate) fn get(&self, id: &str) -> Option<String> {
        self.learned.read().unwrap_or_else(|p| p.into_inner()).get(id).cloned()
    }

    pub(crate) fn forget(&self, id: &str) {
        self.learned.write().unwrap_or_else(|p| p.into_inner()).remove(id);
    }

    /// The edges this apiserver learned hold sandboxes with ids after `after` (a listing asks
    /// them: the snapshot may not say so yet).
    pub(crate) fn holders_after(&self, after: &str) -> BTreeSet<String> {
        let learned = self.learned.read().unwrap_or_else(|p| p.into_inner());
        learned.iter().filter(|(id, _)| id.as_str() > after).map(|(_, edge)| edge.clone()).collect()
    }

    pub(crate) fn learn(&self, id: &str, edge: &str) {
        let mut m = self.learned.write().unwrap_or_else(|p| p.into_inner());
        if m.len() >= ROUTES_MAX && !m.contains_key(id) {
            m.clear();
        }
        m.insert(id.to_string(), edge.to_string());
    }
}

/// Placement state beyond the snapshot.
#[derive(Debug, Default)]
struct Placer {
    inflight: Inflight,
    penalties: Penalties,
}

/// One edge chosen for a creation; `overlay_id` ends its overlay entry.
#[derive(Debug)]
pub struct Placed {
    pub edge: String,
    pub addr: String,
    pub overlay_id: u64,
}

/// What an audit line and the call metrics need about one public call.
#[derive(Debug)]
pub struct Call {
    pub method: &'static str,
    pub started: Instant,
    pub principal: Option<String>,
    pub project: Option<String>,
    pub sandbox_id: Option<String>,
    pub count: Option<u32>,
    pub failed: Option<u32>,
}

impl Call {
    pub fn new(method: &'static str) -> Call {
        Call {
            method,
            started: Instant::now(),
            principal: None,
            project: None,
            sandbox_id: None,
            count: None,
            failed: None,
        }
    }
}

#[derive(Debug)]
pub struct Shared {
    pub cfg: ApiserverConfig,
    pub up: Arc<Upstreams>,
    /// Creations' IAM admissions, gathered into AdmitMany calls.
    pub admits: crate::admits::Admits,
    /// Creations bound for one edge, gathered into CreateMany calls.
    pub edge_creates: Arc<crate::edge_creates::EdgeCreates>,
    pub auth: AuthCache,
    snapshot: RwLock<Arc<Snapshot>>,
    placer: Mutex<Placer>,
    pub limiter: Mutex<RateLimiter>,
    /// Creation slots, round-robin between waiting principals.
    pub inflight: Arc<FairGate>,
    /// Failed authentications per source address.
    pub failures: FailureTracker,
    /// Public calls in flight per principal (counted by the guard).
    pub calls: Arc<PerKey>,
    /// Runtime calls in flight per principal.
    pub runtime_calls: Arc<PerKey>,
    /// Bytes of unary Runtime answers in flight, shared fairly between principals.
    pub result_budget: Arc<AnswerBudget>,
    pub audit: AuditLog,
    pub metrics: Metrics,
    pub images: ImageStore,
    /// Egress rules of a sandbox whose spec has no network part (`network.default_egress`).
    pub default_egress: Vec<pb::EgressRule>,
    /// Where moved sandboxes went, as edges answered (`moves`).
    pub routes: Routes,
    /// Single creations' current runs (see [`Shared::single_run_edge`]).
    runs: Mutex<Vec<SingleRun>>,
}

/// The edge concurrent single creations of one backend and size go to, how many more may,
/// and how many of those that took it are still under way.
#[derive(Debug)]
struct SingleRun {
    backend: String,
    resources: Res,
    edge: Arc<str>,
    left: u32,
    under_way: Arc<AtomicU32>,
}

/// A single creation's part in a run: counted as under way until dropped.
#[derive(Debug)]
pub struct RunPart(Arc<AtomicU32>);

impl Drop for RunPart {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Kinds of single creations with a run at once (the oldest run is dropped past it).
const SINGLE_RUNS: usize = 64;

impl Shared {
    pub fn new(cfg: ApiserverConfig, up: Upstreams, audit: AuditLog, images: ImageStore) -> Shared {
        let up = Arc::new(up);
        Shared {
            admits: crate::admits::Admits::new(up.clone()),
            edge_creates: crate::edge_creates::EdgeCreates::new(up.clone(), cfg.edge_call_timeout),
            auth: AuthCache::new(cfg.auth_cache_ttl, cfg.auth_failures.negative_ttl),
            limiter: Mutex::new(RateLimiter::new(cfg.rate_per_principal, cfg.burst_per_principal)),
            inflight: FairGate::new(cfg.max_inflight_creations),
            failures: FailureTracker::new(cfg.auth_failures.max, cfg.auth_failures.window, cfg.auth_failures.pause),
            calls: PerKey::new(cfg.max_calls_per_principal),
            runtime_calls: PerKey::new(cfg.max_runtime_calls_per_principal),
            result_budget: AnswerBudget::new(
                cfg.runtime_result_budget_mb.saturating_mul(1 << 20),
                cfg.runtime_result_share_percent,
            ),
            snapshot: RwLock::new(Arc::new(Snapshot::default())),
            placer: Mutex::new(Placer::default()),
            metrics: Metrics::new(),
            cfg,
            up,
            audit,
            images,
            default_egress: Vec::new(),
            routes: Routes::default(),
            runs: Mutex::new(Vec::new()),
        }
    }

    pub fn snapshot(&self) -> Arc<Snapshot> {
        self.snapshot.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    pub fn set_snapshot(&self, s: &pb::ClusterSnapshot) {
        let snap = Arc::new(Snapshot::from_proto(s));
        tracing::trace!(version = snap.version, edges = snap.edges.len(), "cluster snapshot");
        self.metrics.pools.update(&snap.edges);
        {
            let mut p = self.placer.lock().unwrap_or_else(|p| p.into_inner());
            p.inflight.on_snapshot(snap.taken_at_ms, time::now_ms(), OVERLAY_MAX_AGE_MS);
        }
        *self.snapshot.write().unwrap_or_else(|p| p.into_inner()) = snap;
    }

    /// Who the bearer token belongs to (cached; see [`crate::auth`]).
    /// Who `token` is (cached). A sandbox's token whose sandbox ended answers `not_found`
    /// ("the sandbox of this token has ended"), as a call on the gone sandbox would, not
    /// `unauthenticated` (E2B's SDK then sees the sandbox as not running): its id is gone
    /// with the sandbox's lease, and its shape says what it was.
    pub async fn authenticate(&self, token: &str) -> Result<Arc<Identity>, ApiError> {
        self.authenticate_inner(token).await.map_err(|e| {
            if e.reason == Reason::Unauthenticated && opendsec_common::config::is_sandbox_token_shape(token) {
                ApiError::new(Reason::NotFound, "the sandbox of this token has ended").with("token_refused", "true")
            } else {
                e
            }
        })
    }

    async fn authenticate_inner(&self, token: &str) -> Result<Arc<Identity>, ApiError> {
        let key = token_key(token);
        if let Some(id) = self.auth.get_identity(&key, Instant::now(), time::now_ms()) {
            self.metrics.cache("authn", true);
            return Ok(id);
        }
        // Not even shaped like a token, or refused by IAM a moment ago: no IAM call.
        if opendsec_common::config::parse_token_shape(token).is_none() {
            return Err(ApiError::new(Reason::Unauthenticated, "malformed token: expected dsk.<id>.<secret>"));
        }
        if self.auth.refused(&key, Instant::now()) {
            self.metrics.cache("authn_refused", true);
            return Err(ApiError::new(Reason::Unauthenticated, "token refused"));
        }
        self.metrics.cache("authn", false);
        let generation = self.auth.generation();
        let req = pb::AuthenticateRequest { token: token.to_string() };
        let resp = self
            .up
            .iam(|mut c| {
                let r = req.clone();
                async move { c.authenticate(r).await }
            })
            .await
            .inspect_err(|e| {
                if e.reason == Reason::Unauthenticated {
                    self.auth.put_refused(key, Instant::now());
                }
            })?;
        if resp.principal.is_empty() {
            return Err(ApiError::new(Reason::Unauthenticated, "token has no principal"));
        }
        use crate::auth::{Scope, ScopeKind};
        let scope = match pb::SandboxTokenKind::try_from(resp.scope_kind) {
            _ if resp.scope_lease.is_empty() => None,
            Ok(pb::SandboxTokenKind::Runtime) => Some(Scope { lease: resp.scope_lease, kind: ScopeKind::Runtime }),
            Ok(pb::SandboxTokenKind::Traffic) => Some(Scope { lease: resp.scope_lease, kind: ScopeKind::Traffic }),
            // A scope this apiserver does not know reaches nothing.
            _ => return Err(ApiError::denied("a sandbox token of a kind this apiserver does not know")),
        };
        let id = Arc::new(Identity {
            principal: resp.principal,
            project: resp.project,
            token_id: resp.token_id,
            expires_at_ms: resp.expires_at_ms,
            scope,
        });
        self.auth.put_identity(generation, key, id.clone(), Instant::now());
        Ok(id)
    }

    /// `permission_denied` unless `principal` holds `permission` on `project` (cached).
    pub async fn authorize(&self, principal: &str, permission: &str, project: &str) -> Result<(), ApiError> {
        let allowed = match self.auth.get_authz(principal, permission, project, Instant::now()) {
            Some(a) => {
                self.metrics.cache("authz", true);
                a
            }
            None => {
                self.metrics.cache("authz", false);
                let generation = self.auth.generation();
                let req = pb::AuthorizeRequest {
                    principal: principal.to_string(),
                    permission: permission.to_string(),
                    project: project.to_string(),
                };
                let resp = self
                    .up
                    .iam(|mut c| {
                        let r = req.clone();
                        async move { c.authorize(r).await }
                    })
                    .await?;
                self.auth.put_authz(generation, principal, permission, project, resp.allowed, Instant::now());
                resp.allowed
            }
        };
        if allowed {
            Ok(())
        } else {
            Err(ApiError::denied(format!("{principal} may not {permission} in {project}"))
                .with("permission", permission)
                .with("project", project))
        }
    }

    /// The address of an edge named in a sandbox id.
    pub fn edge_addr(&self, edge: &str) -> Result<String, ApiError> {
        match self.snapshot().addrs.get(edge) {
            Some((addr, _)) => Ok(addr.clone()),
            None => Err(ApiError::not_found(format!("edge {edge} is not known")).with("edge", edge)),
        }
    }

    /// Places one demand and counts it in the overlay.
    pub fn place(
        &self,
        backend: &str,
        resources: Res,
        tried: &HashSet<String>,
        prefer: Option<&str>,
        warm: bool,
    ) -> Result<Placed, PlacementError> {
        let snap = self.snapshot();
        let params = Params { k: self.cfg.placement.k, usage_floor: self.cfg.placement.usage_floor };
        let mut p = self.placer.lock().unwrap_or_else(|p| p.into_inner());
        let penalized = p.penalties.active(Instant::now());
        let demand = Demand { backend, resources, prefer, warm };
        let i =
            placement::place(&snap.edges, p.inflight.totals(), &penalized, tried, &demand, &params, &mut rand::rng())?;
        let edge = snap.edges[i].name.clone();
        let addr = snap.addrs.get(&edge).map(|(a, _)| a.clone()).unwrap_or_default();
        let overlay_id = p.inflight.add(&edge, resources);
        Ok(Placed { edge, addr, overlay_id })
    }

    /// The edge for a run of `n` creations of `resources` each (a batch's items placed
    /// together): placed as one creation of all of them would be, counted nowhere (each item
    /// counts itself when it is placed, preferring this edge). `None` when no edge fits the
    /// whole run.
    pub fn run_edge(&self, backend: &str, resources: Res, n: u32) -> Option<String> {
        let snap = self.snapshot();
        let params = Params { k: self.cfg.placement.k, usage_floor: self.cfg.placement.usage_floor };
        let mut p = self.placer.lock().unwrap_or_else(|p| p.into_inner());
        let penalized = p.penalties.active(Instant::now());
        let demand = Demand { backend, resources: resources.times(u64::from(n)), prefer: None, warm: false };
        let i = placement::place(
            &snap.edges,
            p.inflight.totals(),
            &penalized,
            &HashSet::new(),
            &demand,
            &params,
            &mut rand::rng(),
        )
        .ok()?;
        Some(snap.edges[i].name.clone())
    }

    /// The edge a single creation prefers: single creations of one backend and size made
    /// while others of the run are under way go to one edge, in runs of
    /// `placement.batch_run`, as a batch's items do, so that concurrent ones reach it together
    /// (one call, one record write). One made when none of its run is under way starts a new
    /// run, placed as it would be without runs: creations one at a time spread as before.
    /// Each still goes elsewhere when the edge no longer fits it. `None` with runs of 1.
    pub fn single_run_edge(&self, backend: &str, resources: Res) -> Option<(Arc<str>, RunPart)> {
        let n = self.cfg.placement.batch_run;
        if n <= 1 {
            return None;
        }
        let mut runs = self.runs.lock().unwrap_or_else(|p| p.into_inner());
        let at = runs.iter().position(|r| r.backend == backend && r.resources == resources);
        if let Some(r) = at.map(|i| &mut runs[i])
            && r.left > 0
            && r.under_way.load(Ordering::Acquire) > 0
        {
            r.left -= 1;
            r.under_way.fetch_add(1, Ordering::AcqRel);
            return Some((r.edge.clone(), RunPart(r.under_way.clone())));
        }
        // Placed as one creation is (not as the whole run): a creation made alone goes where
        // it would without runs.
        let edge: Arc<str> = Arc::from(self.run_edge(backend, resources, 1)?);
        let under_way = Arc::new(AtomicU32::new(1));
        let part = RunPart(under_way.clone());
        let run = SingleRun { backend: backend.to_string(), resources, edge: edge.clone(), left: n - 1, under_way };
        match at {
            Some(i) => runs[i] = run,
            None => {
                if runs.len() >= SINGLE_RUNS {
                    runs.remove(0);
                }
                runs.push(run);
            }
        }
        Some((edge, part))
    }

    pub fn placement_done(&self, overlay_id: u64, ok: bool) {
        let mut p = self.placer.lock().unwrap_or_else(|p| p.into_inner());
        if ok {
            p.inflight.complete(overlay_id, time::now_ms());
        } else {
            p.inflight.fail(overlay_id);
        }
    }

    pub fn penalize(&self, edge: &str) {
        let until = Instant::now() + self.cfg.placement.penalty;
        self.placer.lock().unwrap_or_else(|p| p.into_inner()).penalties.penalize(edge, until);
    }

    /// Records one finished public call: metrics and its audit line.
    pub async fn finish(&self, call: Call, outcome: Result<(), &ApiError>) {
        let reason = match outcome {
            Ok(()) => "ok",
            Err(e) => e.reason.as_str(),
        };
        self.metrics.call(call.method, reason);
        let duration_ms = u64::try_from(call.started.elapsed().as_millis()).unwrap_or(u64::MAX);
        if let Err(e) = outcome {
            tracing::debug!(method = call.method, reason, message = %e.message, "call failed");
        }
        self.audit
            .write(AuditRecord {
                ts_ms: time::now_ms(),
                method: call.method,
                principal: call.principal,
                project: call.project,
                sandbox_id: call.sandbox_id,
                reason,
                duration_ms,
                count: call.count,
                failed: call.failed,
            })
            .await;
    }
}

/// Polls IAM's security epoch; a change clears the auth caches.
pub async fn epoch_loop(shared: Arc<Shared>, cancel: CancellationToken) {
    let every = shared.cfg.epoch_poll_interval;
    periodic::every(every, Start::Now, Cancel::Anytime, cancel.cancelled(), || async {
        let since = shared.auth.epoch().unwrap_or(0);
        match shared.up.iam(|mut c| async move { c.get_epoch(pb::GetEpochRequest { since }).await }).await {
            Ok(r) => {
                use crate::auth::Revocation;
                use pb::revocation::What;
                let revoked: Option<Vec<Revocation>> = r.complete.then(|| {
                    r.revoked
                        .iter()
                        .filter_map(|x| match x.what.as_ref()? {
                            What::TokenId(id) => Some(Revocation::Token(id.clone())),
                            What::Principal(p) => Some(Revocation::Principal(p.clone())),
                            What::Project(p) => Some(Revocation::Project(p.clone())),
                        })
                        .collect()
                });
                let dropped = revoked.as_ref().map(Vec::len);
                if shared.auth.observe_epoch(r.epoch, revoked.as_deref()) {
                    shared.metrics.epoch_changes.inc();
                    match dropped {
                        Some(n) => tracing::debug!(epoch = r.epoch, revocations = n, "security epoch changed"),
                        None => tracing::info!(epoch = r.epoch, "security epoch changed; auth caches cleared"),
                    }
                }
            }
            Err(e) => tracing::warn!(reason = %e.reason, error = %e.message, "polling the IAM epoch failed"),
        }
    })
    .await
}

/// Fetches the cluster snapshot every `snapshot_refresh`; on failure the last one is kept.
pub async fn snapshot_loop(shared: Arc<Shared>, cancel: CancellationToken) {
    let every = shared.cfg.snapshot_refresh;
    periodic::every(every, Start::Now, Cancel::Anytime, cancel.cancelled(), || async {
        match shared.up.snapshot().await {
            Ok(s) => shared.set_snapshot(&s),
            Err(e) => tracing::warn!(reason = %e.reason, error = %e.message, "fetching the cluster snapshot failed"),
        }
    })
    .await
}
