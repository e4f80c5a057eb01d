//! The path of one creation (DESIGN.md section 3) and of a batch of them.
//!
//! One creation: (idempotent retry: a lease already bound to an edge that has the sandbox
//! returns it), place, IAM `Admit` (authenticate, authorize `sandbox.create`, reserve quota,
//! bind to the edge; gathered with concurrent ones by `crate::admits`), then the edge's
//! `CreateSandbox` (gathered with concurrent ones for that edge by `crate::edge_creates`). An edge answering `no_capacity` or
//! `unavailable` is penalized and the creation placed again elsewhere under the SAME lease (IAM
//! only rebinds it), up to `placement.max_attempts` edges; when all refuse the lease is
//! released, unless the last edge did not answer at all (`NO_ANSWER`: it died mid-call, it may
//! have made the sandbox): then the lease stays bound there and the caller gets `unavailable`,
//! its retry under the same lease finding what that edge made. An edge that does not answer in
//! time may still create the sandbox, so its lease is left bound (reconciliation settles it)
//! and the caller gets `deadline_exceeded`.
//!
//! Creations run in their own tasks: a client that goes away does not cut one in half between
//! `Admit` and the edge. Batches admit items `batch_concurrency` at a time; rate limits and the
//! in-flight cap make items wait, never fail, and a batch whose client left starts no new item.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use opendsec_common::{ApiError, Reason, ids, time};
use opendsec_proto::v1 as pb;
use tokio::sync::{Semaphore, mpsc};

use crate::limits::FairPermit;

use crate::auth::Identity;
use crate::forward;
use crate::placement::Res;
use crate::state::{Call, Shared};

/// Retry hint when the in-flight cap refuses a single creation.
const INFLIGHT_RETRY_AFTER_MS: u64 = 100;

/// Items of a batch whose answers wait for a slow client.
const BATCH_CHANNEL: usize = 256;

async fn release(shared: &Shared, lease: &str) {
    let req = pb::ReleaseLeasesRequest { lease_ids: vec![lease.to_string()], edge: String::new() };
    let r = shared
        .up
        .iam(|mut c| {
            let r = req.clone();
            async move { c.release_leases(r).await }
        })
        .await;
    if let Err(e) = r {
        // Reconciliation releases it later: the lease is bound to an edge without the sandbox.
        tracing::warn!(lease_id = lease, reason = %e.reason, error = %e.message, "releasing a lease failed");
    }
}

fn timeout_ms(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// What to do with a lease the client chose and IAM already holds: answer with the sandbox
/// the earlier attempt created, or `None` when the creation must (still) be made.
async fn existing(shared: &Shared, lease: &str, edge: &str, bound_at_ms: i64) -> Result<Option<pb::Sandbox>, ApiError> {
    if edge.is_empty() {
        return Ok(None);
    }
    // An edge out of the snapshot (down, restarting) may hold the sandbox: creating it
    // elsewhere could run it twice, unseen. Once the edge is back the retry finds it; an edge
    // gone for good has its leases released by reconciliation, and the retry creates anew.
    if shared.edge_addr(edge).is_err() {
        return Err(ApiError::unavailable(format!(
            "edge {edge}, where lease id {lease} is bound, cannot be reached now; it may hold the sandbox"
        ))
        .with("edge", edge)
        .with("lease_id", lease));
    }
    match forward::edge_get(shared, edge, &ids::sandbox_id(edge, lease)).await {
        Ok(sb) => Ok(Some(sb)),
        // Bound so recently that the first attempt may still be on its way to the edge: placing
        // it elsewhere now could run the sandbox twice, so the client retries a little later.
        Err(e)
            if e.reason == Reason::NotFound
                && time::now_ms().saturating_sub(bound_at_ms) < timeout_ms(shared.cfg.edge_call_timeout) =>
        {
            Err(ApiError::unavailable(format!("a creation with lease id {lease} is in progress"))
                .with("lease_id", lease))
        }
        Err(e) if e.reason == Reason::NotFound => Ok(None),
        // The sandbox may exist there: creating it elsewhere could run it twice.
        Err(e) => Err(e),
    }
}

/// One creation from a validated, filled spec, under the caller's token. `pool_revision`:
/// the revision of the pool `spec.pool` names (empty without a pool); the creation then
/// prefers an edge with idle members of it.
pub async fn create_one(
    shared: &Shared,
    token: &str,
    spec: &pb::SandboxSpec,
    pool_revision: &str,
    given_lease: Option<String>,
    prefer: Option<&str>,
) -> Result<pb::Sandbox, ApiError> {
    let started = Instant::now();
    let members_on = |skip: &HashSet<String>| {
        crate::pools::edge_with_members(shared, &spec.project, &spec.pool, pool_revision, skip)
    };
    let warm = match (prefer, spec.pool.is_empty()) {
        (None, false) => members_on(&HashSet::new()),
        _ => None,
    };
    let claim = warm.is_some();
    let mut prefer: Option<String> = prefer.map(str::to_string).or(warm);
    // A claim: the new lease takes over the charge of one of the pool's members on the edge
    // placed on, if IAM knows one there (IAM's members are current, the snapshot's idle counts
    // a moment late), releasing that member's lease in the same command. Not a creation that
    // restores a session: the edge makes those cold.
    let claim_pool = match spec.pool.is_empty() || spec.session.is_some() {
        true => String::new(),
        false => format!("{}//{}", spec.project, spec.pool),
    };
    let mut admitted_once = false;
    // A lease the client chose may be a retry of an earlier attempt: the first Admit leaves an
    // existing lease where it is, so the sandbox that attempt created is found, not doubled.
    let mut keep_existing = given_lease.is_some();
    let lease = given_lease.unwrap_or_else(ids::new_lease_id);
    let resources = Res::from_proto(spec.resources.as_ref());
    let proto_resources = spec.resources.unwrap_or_default();
    let mut tried = HashSet::new();
    let mut last_refusal: Option<ApiError> = None;
    let max_attempts = shared.cfg.placement.max_attempts.max(1);
    let mut attempt = 0;
    while attempt < max_attempts {
        let placed = match shared.place(&spec.backend, resources, &tried, prefer.as_deref(), claim) {
            Ok(p) => p,
            Err(e) => match last_refusal {
                // Out of edges to try: the lease was admitted, give it back (a claim refused
                // on every edge with members was never admitted: nothing to give back).
                Some(refusal) if !admitted_once => return Err(refusal),
                Some(refusal) => return Err(give_up(shared, &lease, refusal).await),
                // A retry under the caller's lease: an earlier attempt may have made the
                // sandbox on an edge that cannot be placed on now (restarting). `no_capacity`
                // would tell the caller nothing was made; it must retry, and find it.
                None if keep_existing => {
                    return Err(bound_elsewhere(shared, &lease).await?.unwrap_or(ApiError::from(&e)));
                }
                None => return Err(ApiError::from(&e)),
            },
        };
        if attempt > 0 {
            shared.metrics.placement_retries.inc();
        }
        let admit = pb::AdmitRequest {
            token: token.to_string(),
            lease_id: lease.clone(),
            project: spec.project.clone(),
            resources: Some(proto_resources),
            edge: placed.edge.clone(),
            keep_existing,
            egress: spec.network.as_ref().map(|n| n.egress.clone()).unwrap_or_default(),
            pool: claim_pool.clone(),
        };
        let asked = Instant::now();
        let admitted = shared.admits.admit(admit).await;
        if admitted.is_ok() {
            shared.metrics.admit_seconds.observe(asked.elapsed().as_secs_f64());
        }
        // Only the first Admit that admits may find an earlier attempt; later ones rebind what
        // it reserved.
        if admitted.is_ok() {
            keep_existing = false;
        }
        let (principal, member_lease) = match admitted {
            Ok(a) if a.existing => {
                shared.placement_done(placed.overlay_id, false);
                match existing(shared, &lease, &a.edge, a.bound_at_ms).await? {
                    Some(sb) => return Ok(sb),
                    None => continue, // nothing made it to an edge: admit again, rebinding
                }
            }
            Ok(a) => {
                admitted_once = true;
                (a.principal, a.member_lease)
            }
            // A claim at a full quota, on an edge where IAM knows no member of the pool (the
            // snapshot showed idle members a moment late): another edge that has some may.
            Err(e) if e.reason == Reason::QuotaExceeded && !claim_pool.is_empty() && !admitted_once => {
                shared.placement_done(placed.overlay_id, false);
                tried.insert(placed.edge);
                prefer = members_on(&tried);
                if prefer.is_none() {
                    return Err(e);
                }
                last_refusal = Some(e);
                attempt += 1;
                continue;
            }
            Err(e) => {
                shared.placement_done(placed.overlay_id, false);
                if admitted_once {
                    release(shared, &lease).await;
                }
                return Err(e);
            }
        };
        let req = pb::EdgeCreateRequest {
            lease_id: lease.clone(),
            spec: Some(spec.clone()),
            principal,
            pool_revision: pool_revision.to_string(),
            moved_in: None,
            member_lease,
        };
        let asked = Instant::now();
        let result = shared.edge_creates.create(&placed.edge, &placed.addr, req).await;
        match result {
            Ok(sb) => {
                shared.metrics.edge_create_seconds.observe(asked.elapsed().as_secs_f64());
                shared.placement_done(placed.overlay_id, true);
                shared.metrics.creation_seconds.observe(started.elapsed().as_secs_f64());
                return Ok(sb);
            }
            Err(e) if matches!(e.reason, Reason::NoCapacity | Reason::Unavailable) => {
                shared.placement_done(placed.overlay_id, false);
                shared.penalize(&placed.edge);
                tracing::info!(edge = %placed.edge, lease_id = %lease, reason = %e.reason, "edge refused a creation; placing again");
                tried.insert(placed.edge);
                last_refusal = Some(e);
                attempt += 1;
            }
            Err(e) if e.reason == Reason::DeadlineExceeded => {
                // The edge may still create it: keep counting it there, keep the lease bound.
                shared.placement_done(placed.overlay_id, true);
                return Err(e);
            }
            Err(e) => {
                shared.placement_done(placed.overlay_id, false);
                release(shared, &lease).await;
                return Err(e);
            }
        }
    }
    match last_refusal {
        Some(refusal) if !admitted_once => Err(refusal),
        Some(refusal) => Err(give_up(shared, &lease, refusal).await),
        None => {
            release(shared, &lease).await;
            Err(ApiError::internal("creation ended without an attempt"))
        }
    }
}

/// `unavailable` when IAM binds `lease` to an edge (an earlier attempt's creation may be
/// there), else `None`.
async fn bound_elsewhere(shared: &Shared, lease: &str) -> Result<Option<ApiError>, ApiError> {
    let req = pb::GetLeaseRequest { lease_id: lease.to_string() };
    let found = shared
        .up
        .iam(|mut c| {
            let r = req.clone();
            async move { c.get_lease(r).await }
        })
        .await?;
    Ok(found.lease.filter(|l| found.found && !l.edge.is_empty()).map(|l| {
        ApiError::unavailable(format!(
            "lease id {lease} is bound to edge {}, which takes no creations now; it may hold the sandbox",
            l.edge
        ))
        .with("edge", l.edge)
        .with("lease_id", lease)
    }))
}

/// Every edge tried refused: the lease is given back and the last refusal answered, unless the
/// last edge did not answer at all (it died or dropped the connection with the request out:
/// it may have made the sandbox, and adopts it on restart). Then the lease stays bound there
/// and the caller gets `unavailable`: its retry under the same lease finds what that edge
/// has, instead of a creation elsewhere that would leave this one running unseen.
async fn give_up(shared: &Shared, lease: &str, refusal: ApiError) -> ApiError {
    if refusal.metadata.contains_key(opendsec_common::reason::NO_ANSWER) {
        return ApiError::unavailable(format!(
            "no edge answered the creation with lease id {lease}; it may have been made: retry with the same lease id"
        ))
        .with("lease_id", lease);
    }
    release(shared, lease).await;
    refusal
}

/// A single creation: refused at once (`rate_limited`) over the principal's rate or the
/// in-flight cap.
pub async fn create_single(
    shared: &Shared,
    token: &str,
    ident: &Identity,
    spec: &pb::SandboxSpec,
    pool_revision: &str,
    lease: Option<String>,
) -> Result<pb::Sandbox, ApiError> {
    let limited = shared.limiter.lock().unwrap_or_else(|p| p.into_inner()).try_take(&ident.principal, Instant::now());
    if let Err(wait) = limited {
        let ms = u64::try_from(wait.as_micros().div_ceil(1000)).unwrap_or(u64::MAX).max(1);
        return Err(ApiError::new(Reason::RateLimited, format!("creation rate of {} exceeded", ident.principal))
            .with("retry_after_ms", ms.to_string()));
    }
    // A slot in turn with every other principal waiting (a batch of another tenant does not
    // hold this creation up for longer than one round), or `rate_limited` after a while.
    let Ok(permit) =
        tokio::time::timeout(shared.cfg.creation_slot_wait, shared.inflight.acquire(&ident.principal)).await
    else {
        return Err(ApiError::new(Reason::RateLimited, "too many creations in flight on this apiserver")
            .with("retry_after_ms", INFLIGHT_RETRY_AFTER_MS.to_string()));
    };
    let _g = InflightGauge::new(shared, permit);
    // A run's edge, unless a pool's members decide (a retry under its lease finds its first
    // attempt wherever it went).
    let run = match spec.pool.is_empty() {
        true => shared.single_run_edge(&spec.backend, Res::from_proto(spec.resources.as_ref())),
        false => None,
    };
    create_one(shared, token, spec, pool_revision, lease, run.as_ref().map(|(edge, _part)| &**edge)).await
}

/// Holds an in-flight permit and mirrors it in the gauge.
struct InflightGauge<'a> {
    shared: &'a Shared,
    _permit: FairPermit,
}

impl<'a> InflightGauge<'a> {
    fn new(shared: &'a Shared, permit: FairPermit) -> Self {
        shared.metrics.inflight_creations.inc();
        InflightGauge { shared, _permit: permit }
    }
}

impl Drop for InflightGauge<'_> {
    fn drop(&mut self) {
        self.shared.metrics.inflight_creations.dec();
    }
}

pub type BatchItem = Result<pb::CreateSandboxesResponse, tonic::Status>;

/// Starts a batch; answers arrive on the returned receiver as items complete. The batch's
/// audit line is written when every started item has finished.
/// What a batch creates: `count` sandboxes of `spec`, item `i` of `patched[i]` where the
/// request patched it; `prefer`: an edge each item takes while it fits (a fork's copies: the
/// source's).
pub struct Batch {
    pub spec: pb::SandboxSpec,
    pub patched: Vec<pb::SandboxSpec>,
    pub count: u32,
    pub prefer: Option<String>,
    /// The revision of the pool the spec names (empty: none).
    pub pool_revision: String,
}

pub fn start_batch(
    shared: Arc<Shared>,
    token: String,
    ident: Arc<Identity>,
    batch: Batch,
    call: Call,
) -> mpsc::Receiver<BatchItem> {
    let (tx, rx) = mpsc::channel(BATCH_CHANNEL);
    tokio::spawn(run_batch(shared, Arc::from(token), ident, batch, call, tx));
    rx
}

async fn run_batch(
    shared: Arc<Shared>,
    token: Arc<str>,
    ident: Arc<Identity>,
    batch: Batch,
    mut call: Call,
    tx: mpsc::Sender<BatchItem>,
) {
    let count = batch.count;
    let spec = Arc::new(batch.spec);
    let patched: Vec<Arc<pb::SandboxSpec>> = batch.patched.into_iter().map(Arc::new).collect();
    let prefer: Option<Arc<str>> = batch.prefer.map(Arc::from);
    let revision: Arc<str> = Arc::from(batch.pool_revision);
    // Without an edge of its own to prefer (a fork's source, a pool's members), a batch goes
    // out in runs placed together: each run's items prefer its edge, which makes them in one
    // call (`crate::edge_creates`) and one record write.
    let run_len = match (&prefer, spec.pool.is_empty()) {
        (None, true) => shared.cfg.placement.batch_run.max(1),
        _ => 1,
    };
    let resources = Res::from_proto(spec.resources.as_ref());
    let mut run: Option<Arc<str>> = None;
    let slots = Arc::new(Semaphore::new(shared.cfg.batch_concurrency.max(1)));
    let failed = Arc::new(AtomicU32::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    let mut started = 0u32;
    for index in 0..count {
        let slot = tokio::select! {
            s = slots.clone().acquire_owned() => match s { Ok(s) => s, Err(_) => break },
            _ = tx.closed() => break,
        };
        while tasks.try_join_next().is_some() {}
        started += 1;
        let spec = patched.get(index as usize).unwrap_or(&spec).clone();
        if run_len > 1 && index % run_len == 0 {
            run = shared.run_edge(&spec.backend, resources, run_len.min(count - index)).map(Arc::from);
        }
        let prefer = prefer.clone().or_else(|| run.clone());
        let (shared, token, ident, failed, tx, prefer, revision) = (
            shared.clone(),
            token.clone(),
            ident.clone(),
            failed.clone(),
            tx.clone(),
            prefer.clone(),
            revision.clone(),
        );
        tasks.spawn(async move {
            let result = batch_item(&shared, &token, &ident, &spec, &revision, prefer.as_deref(), &tx).await;
            let resp = match result {
                None => return, // the client left before this item started
                Some(Ok(sb)) => pb::CreateSandboxesResponse { index, sandbox: Some(sb), error: None },
                Some(Err(e)) => {
                    failed.fetch_add(1, Ordering::Relaxed);
                    pb::CreateSandboxesResponse { index, sandbox: None, error: Some(e.to_detail()) }
                }
            };
            // The slot is held until the answer is queued: a slow reader slows the batch down
            // instead of piling up finished items in memory.
            let _ = tx.send(Ok(resp)).await;
            drop(slot);
        });
    }
    while tasks.join_next().await.is_some() {}
    call.count = Some(count);
    call.failed = Some(failed.load(Ordering::Relaxed) + (count - started));
    // Per-item failures are counted in `failed` and answered in the stream; the call itself
    // failed only when its client left before every item started.
    let outcome = if started < count && tx.is_closed() {
        Err(ApiError::new(Reason::Unavailable, "the client went away"))
    } else {
        Ok(())
    };
    shared.finish(call, outcome.as_ref().map(|_| ())).await;
}

/// One batch item: waits for its rate token and an in-flight slot, then creates. `None` when
/// the client left before the item was admitted.
async fn batch_item(
    shared: &Shared,
    token: &str,
    ident: &Identity,
    spec: &pb::SandboxSpec,
    pool_revision: &str,
    prefer: Option<&str>,
    tx: &mpsc::Sender<BatchItem>,
) -> Option<Result<pb::Sandbox, ApiError>> {
    loop {
        let r = shared.limiter.lock().unwrap_or_else(|p| p.into_inner()).try_take(&ident.principal, Instant::now());
        match r {
            Ok(()) => break,
            Err(wait) => {
                tokio::select! {
                    _ = tokio::time::sleep(wait.max(Duration::from_millis(1))) => {}
                    _ = tx.closed() => return None,
                }
            }
        }
    }
    let permit = tokio::select! {
        p = shared.inflight.acquire(&ident.principal) => p,
        _ = tx.closed() => return None,
    };
    if tx.is_closed() {
        return None;
    }
    let _g = InflightGauge::new(shared, permit);
    Some(create_one(shared, token, spec, pool_revision, None, prefer).await)
}
