//! The edge's sandbox lifecycle: final admission, the state machine driven through the
//! backends, records, TTL expiry, liveness, lease releases and the stop of sandboxes whose
//! lease moved (the batched check after creation is `release`'s).
//!
//! Invariants:
//! - one lifecycle operation at a time per sandbox: every operation takes the sandbox's
//!   operation lock, then re-reads the record (a waiting operation sees what the previous one
//!   left) and checks the state machine;
//! - a record is written before the backend is called (the intent: CREATING, PAUSING, ...) and
//!   after it answered (the outcome); intents are written before they are published in memory,
//!   outcomes are published first (memory follows reality) and then written;
//! - the table's std mutex is never held across an await; only operation locks are;
//! - an ended sandbox's lease is queued for release exactly when its final record is published,
//!   unless the lease is not ours to release (`lease_moved`); IAM releases it only if it is
//!   still bound here, so a creation retried elsewhere keeps its lease.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::{Notify, OwnedMutexGuard, watch};
use tokio::task::JoinHandle;

use opendsec_common::config::EdgeConfig;
use opendsec_common::ids;
use opendsec_common::time::now_ms;
use opendsec_proto::v1::{
    EdgeCreateRequest, EdgeListRequest, EdgeListResponse, EdgeStatus, LiveLease, Pressure, Resources, Sandbox,
    SandboxState, SetSandboxTimeoutRequest,
};

use crate::admission::{self, Capacity};
use crate::backend::{Backend, BackendError};
use crate::error::EdgeError;
use crate::host::HostProbe;
use crate::record::{RECORD_VERSION, RecordError, RecordStore, SandboxRecord, SpecRecord, WriteMode};
use crate::release::ReleaseQueue;
use crate::remote::{LeaseBinding, Remote};
use crate::state::{SandboxStatus, end_reason};
use crate::table::{ListFilter, OpLock, Table};
use crate::ttl;

/// Default and largest page of ListSandboxes.
pub const LIST_DEFAULT: usize = 100;
pub const LIST_MAX: usize = 1000;
/// Operations run concurrently by the background loops (TTL expiry, probes, shutdown).
const LOOP_CONCURRENCY: usize = 64;
/// Host pressure is read at most this often.
const PRESSURE_CACHE: Duration = Duration::from_millis(100);

/// What happens to the lease of a sandbox that ends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Release {
    /// Release it (IAM frees it only if it is still bound to this edge).
    Yes,
    /// Not ours (IAM binds it elsewhere or no longer has it): nothing to release.
    No,
}

pub(crate) struct Inner {
    pub name: String,
    pub boot_id: String,
    pub cfg: EdgeConfig,
    pub state_dir: PathBuf,
    pub tls: Arc<opendsec_common::tls::Credentials>,
    pub capacity: Capacity,
    pub backends: Vec<Arc<dyn Backend>>,
    /// Only `sim` is configured: no host pressure, usage simulated.
    pub sim_only: bool,
    pub host: Arc<dyn HostProbe>,
    pub store: Arc<RecordStore>,
    table: std::sync::Mutex<Table>,
    pub releases: ReleaseQueue,
    pub remote: Remote,
    pub advertise: std::sync::Mutex<String>,
    pub register_now: Notify,
    pub shutdown_tx: watch::Sender<bool>,
    pub closing: AtomicBool,
    pressure_cache: std::sync::Mutex<Option<(Instant, Pressure)>>,
    pub tasks: std::sync::Mutex<Vec<JoinHandle<()>>>,
    /// Runtime calls in flight and last activity per sandbox.
    pub activity: crate::runtime::Activity,
    /// Runtime calls in flight per sandbox, capped.
    pub runtime_calls: Arc<opendsec_common::bounds::PerKey>,
    /// Bytes of unary Runtime answers in flight through this edge.
    pub result_budget: Arc<opendsec_common::bounds::AnswerBudget>,
}

/// Everything `Inner::new` needs.
pub(crate) struct InnerParts {
    pub name: String,
    pub cfg: EdgeConfig,
    pub state_dir: PathBuf,
    pub tls: Arc<opendsec_common::tls::Credentials>,
    pub capacity: Capacity,
    pub backends: Vec<Arc<dyn Backend>>,
    pub host: Arc<dyn HostProbe>,
    pub store: RecordStore,
    pub remote: Remote,
    pub advertise: String,
}

impl Inner {
    pub fn new(p: InnerParts) -> Inner {
        let sim_only = p.backends.iter().all(|b| b.name() == "sim");
        let (shutdown_tx, _) = watch::channel(false);
        Inner {
            boot_id: format!("{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>()),
            releases: ReleaseQueue::new(p.cfg.release_batch),
            runtime_calls: opendsec_common::bounds::PerKey::new(p.cfg.max_runtime_calls_per_sandbox),
            result_budget: opendsec_common::bounds::AnswerBudget::new(
                p.cfg.runtime_result_budget_mb.saturating_mul(1 << 20),
                p.cfg.runtime_result_share_percent,
            ),
            name: p.name,
            cfg: p.cfg,
            state_dir: p.state_dir,
            tls: p.tls,
            capacity: p.capacity,
            backends: p.backends,
            sim_only,
            host: p.host,
            store: Arc::new(p.store),
            table: std::sync::Mutex::new(Table::default()),
            remote: p.remote,
            advertise: std::sync::Mutex::new(p.advertise),
            register_now: Notify::new(),
            shutdown_tx,
            closing: AtomicBool::new(false),
            pressure_cache: std::sync::Mutex::new(None),
            tasks: std::sync::Mutex::new(Vec::new()),
            activity: Default::default(),
        }
    }

    pub(crate) fn table(&self) -> std::sync::MutexGuard<'_, Table> {
        // Every table update is a single insert/replace/remove: a panic elsewhere cannot leave
        // it half-changed, so a poisoned lock is still usable.
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn backend(&self, name: &str) -> Option<&Arc<dyn Backend>> {
        self.backends.iter().find(|b| b.name() == name)
    }

    pub(crate) fn backend_of(&self, rec: &SandboxRecord) -> Result<&Arc<dyn Backend>, EdgeError> {
        // Recovery fails every record whose backend is not offered, so this holds for any live
        // sandbox; the error only guards the invariant.
        self.backend(&rec.spec.backend).ok_or_else(|| EdgeError::Backend {
            backend: "none",
            op: "find",
            id: rec.id.clone(),
            source: BackendError::internal(format!("backend {} is not offered here", rec.spec.backend)),
        })
    }

    pub(crate) fn backend_names(&self) -> Vec<String> {
        self.backends.iter().map(|b| b.name().to_string()).collect()
    }

    pub(crate) fn not_found(&self, id: &str) -> EdgeError {
        EdgeError::NotFound { id: id.chars().take(120).collect(), edge: self.name.clone() }
    }

    /// The lease of a sandbox id of this edge.
    pub(crate) fn lease_of<'a>(&self, id: &'a str) -> Result<&'a str, EdgeError> {
        let (edge, lease) = ids::split_sandbox_id(id).map_err(|e| EdgeError::InvalidArgument(e.message))?;
        if edge != self.name {
            return Err(self.not_found(id));
        }
        Ok(lease)
    }

    fn op_lock(&self, lease: &str) -> Option<OpLock> {
        self.table().get(lease).map(|e| e.op.clone())
    }

    /// Takes the sandbox's operation lock, then reads its record as the last operation left it.
    async fn lock_op(&self, id: &str) -> Result<(OwnedMutexGuard<()>, Arc<SandboxRecord>), EdgeError> {
        let lease = self.lease_of(id)?;
        let op = self.op_lock(lease).ok_or_else(|| self.not_found(id))?;
        let guard = op.lock_owned().await;
        let rec = self.table().rec(lease).ok_or_else(|| self.not_found(id))?;
        Ok((guard, rec))
    }

    /// The sandbox's last runtime activity: `now` while a call runs.
    fn active_ms(&self, lease: &str, now: i64) -> i64 {
        match self.activity.of(lease) {
            (0, last) => last,
            _ => now,
        }
    }

    pub(crate) fn to_proto(&self, rec: &SandboxRecord) -> Sandbox {
        let active = self.active_ms(&rec.lease_id, now_ms());
        Sandbox {
            id: rec.id.clone(),
            edge: rec.edge.clone(),
            lease_id: rec.lease_id.clone(),
            spec: Some(rec.spec.to_proto()),
            state: rec.state.to_proto() as i32,
            principal: rec.principal.clone(),
            created_at_ms: rec.created_at_ms,
            updated_at_ms: rec.updated_at_ms,
            expires_at_ms: ttl::expires_at_ms_active(rec, active),
            last_active_ms: rec.last_active_ms.max(active),
            end_reason: rec.end_reason.clone(),
        }
    }

    /// Writes a record (blocking I/O on the blocking pool).
    pub(crate) async fn persist(&self, rec: &SandboxRecord, mode: WriteMode) -> Result<(), RecordError> {
        let bytes = rec.encode()?;
        let store = self.store.clone();
        let lease = rec.lease_id.clone();
        tokio::task::spawn_blocking(move || store.write(&lease, &bytes, mode))
            .await
            .map_err(|e| RecordError::Join { lease: rec.lease_id.clone(), message: e.to_string() })?
    }

    /// An intent: on disk first, then visible. Nothing changes if the write fails.
    async fn persist_then_publish(&self, rec: SandboxRecord) -> Result<Arc<SandboxRecord>, EdgeError> {
        self.persist(&rec, WriteMode::Durable).await?;
        let rec = Arc::new(rec);
        self.table().publish(rec.clone());
        Ok(rec)
    }

    /// An outcome: visible first (it already happened), then on disk.
    async fn publish_then_persist(&self, rec: SandboxRecord) -> (Arc<SandboxRecord>, Result<(), EdgeError>) {
        let rec = Arc::new(rec);
        self.table().publish(rec.clone());
        let written = self.persist(&rec, WriteMode::Durable).await.map_err(EdgeError::from);
        if let Err(e) = &written {
            tracing::error!(sandbox_id = %rec.id, state = %rec.state, error = %e, "record write failed");
        }
        (rec, written)
    }

    pub(crate) fn queue_release(&self, rec: &SandboxRecord) {
        if !rec.lease_released {
            self.releases.push(rec.lease_id.clone());
        }
    }

    fn apply_release(rec: &mut SandboxRecord, release: Release) {
        if release == Release::No {
            rec.lease_released = true;
        }
    }

    // -----------------------------------------------------------------------------------------
    // Create

    pub(crate) async fn create(&self, req: EdgeCreateRequest) -> Result<Sandbox, EdgeError> {
        if self.closing.load(Ordering::Relaxed) {
            return Err(EdgeError::ShuttingDown { edge: self.name.clone() });
        }
        admission::validate_create(&req).map_err(EdgeError::InvalidArgument)?;
        let Some(spec) = req.spec.as_ref() else {
            return Err(EdgeError::InvalidArgument("spec is required".into()));
        };
        let lease = req.lease_id.as_str();

        // Idempotent per lease: a retry gets what the first attempt made (once it finished).
        if let Some(op) = self.op_lock(lease) {
            return self.existing(op, lease).await;
        }

        let backend = self.backend(&spec.backend).ok_or_else(|| EdgeError::NoCapacity {
            edge: self.name.clone(),
            detail: format!(
                "backend {} is not offered here (offered: {})",
                spec.backend,
                self.backend_names().join(", ")
            ),
        })?;
        if let Some(dim) = admission::pressure_refusal(&self.pressure()) {
            return Err(EdgeError::NoCapacity { edge: self.name.clone(), detail: format!("{dim} pressure") });
        }

        let now = now_ms();
        let rec = SandboxRecord {
            version: RECORD_VERSION,
            id: ids::sandbox_id(&self.name, lease),
            edge: self.name.clone(),
            lease_id: lease.to_string(),
            principal: req.principal.clone(),
            spec: SpecRecord::from_proto(spec),
            state: SandboxStatus::Creating,
            created_at_ms: now,
            updated_at_ms: now,
            last_active_ms: now,
            paused_since_ms: 0,
            end_reason: String::new(),
            ended_at_ms: 0,
            lease_released: false,
        };
        let rec = Arc::new(rec);
        let op = OpLock::default();
        // Held until the creation is settled: a concurrent retry or stop waits for it.
        let guard = op.clone().lock_owned().await;
        let raced = {
            let mut t = self.table();
            match t.get(lease) {
                Some(e) => Some(e.op.clone()),
                None => {
                    // Capacity is checked and reserved in one critical section.
                    admission::check_capacity(&self.capacity, &t.used(), rec.resources())
                        .map_err(|r| EdgeError::NoCapacity { edge: self.name.clone(), detail: r.to_string() })?;
                    t.insert(rec.clone(), op);
                    None
                }
            }
        };
        if let Some(op) = raced {
            drop(guard);
            return self.existing(op, lease).await;
        }

        // The lease has no record here (a table entry would have been found above).
        if let Err(e) = self.persist(&rec, WriteMode::DurableNew).await {
            self.table().remove(lease);
            self.activity.forget(lease);
            return Err(e.into());
        }

        if let Err(mut source) = backend.create(&rec).await {
            tracing::debug!(sandbox_id = %rec.id, error = %source.report(), "creation failed");
            // The backend cleans up after itself; this stop only catches leftovers. If it
            // fails, the error says so beside the creation's own failure.
            if let Err(e) = backend.stop(&rec).await {
                tracing::warn!(sandbox_id = %rec.id, error = %e.report(), "cleanup after a failed creation failed");
                if source.cleanup().is_none() {
                    source = source.with_cleanup(e);
                }
            }
            self.fail_locked(&rec, end_reason::CREATE_FAILED, Release::Yes).await;
            return Err(EdgeError::Backend { backend: backend.name(), op: "create", id: rec.id.clone(), source });
        }

        let mut running = (*rec).clone();
        running.state = SandboxStatus::Running;
        running.updated_at_ms = now_ms();
        let running = match self.persist_then_publish(running).await {
            Ok(r) => r,
            Err(e) => {
                // Without a record the sandbox would not survive a restart: undo it.
                if let Err(se) = backend.stop(&rec).await {
                    tracing::error!(sandbox_id = %rec.id, error = %se, "stop after a failed record write failed");
                }
                self.fail_locked(&rec, end_reason::CREATE_FAILED, Release::Yes).await;
                return Err(e);
            }
        };
        drop(guard);

        // Where IAM binds the lease is looked up in batches (see `release`).
        if self.remote.has_iam() {
            self.releases.push_check(lease.to_string());
        }
        Ok(self.to_proto(&running))
    }

    async fn existing(&self, op: OpLock, lease: &str) -> Result<Sandbox, EdgeError> {
        let _g = op.lock_owned().await;
        let rec = self.table().rec(lease).ok_or_else(|| self.not_found(&ids::sandbox_id(&self.name, lease)))?;
        Ok(self.to_proto(&rec))
    }

    /// The post-creation check found the lease bound elsewhere or gone: the caller moved on
    /// (retried elsewhere, or gave up and released it). Stops the sandbox without releasing
    /// the lease, which is not ours.
    pub(crate) async fn stop_moved(&self, lease: &str, binding: &LeaseBinding) {
        let id = ids::sandbox_id(&self.name, lease);
        let Ok((_g, rec)) = self.lock_op(&id).await else { return };
        if !rec.state.can_stop() {
            return;
        }
        tracing::info!(sandbox_id = %id, binding = ?binding, "lease moved; stopping the sandbox");
        if let Err(e) = self.stop_locked(rec, end_reason::LEASE_MOVED, Release::No).await {
            tracing::warn!(sandbox_id = %id, error = %e, "stop after lease move failed");
        }
    }

    // -----------------------------------------------------------------------------------------
    // Lifecycle

    pub(crate) fn get(&self, id: &str) -> Result<Sandbox, EdgeError> {
        let lease = self.lease_of(id)?;
        let rec = self.table().rec(lease).ok_or_else(|| self.not_found(id))?;
        Ok(self.to_proto(&rec))
    }

    pub(crate) async fn stop(&self, id: &str) -> Result<Sandbox, EdgeError> {
        let (_g, rec) = self.lock_op(id).await?;
        // Stopping an ended sandbox is answered with it as it is (retries are idempotent).
        if rec.state.is_ended() {
            return Ok(self.to_proto(&rec));
        }
        if !rec.state.can_stop() {
            return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "stop" });
        }
        let rec = self.stop_locked(rec, end_reason::USER, Release::Yes).await?;
        Ok(self.to_proto(&rec))
    }

    /// Stops a RUNNING or PAUSED sandbox; the caller holds its operation lock.
    pub(crate) async fn stop_locked(
        &self,
        rec: Arc<SandboxRecord>,
        reason: &str,
        release: Release,
    ) -> Result<Arc<SandboxRecord>, EdgeError> {
        let backend = self.backend_of(&rec)?.clone();
        let now = now_ms();
        let mut stopping = (*rec).clone();
        stopping.state = SandboxStatus::Stopping;
        stopping.end_reason = reason.to_string();
        stopping.updated_at_ms = now;
        stopping.last_active_ms = now;
        // Recorded now, so a restart that completes the stop knows what to release.
        Self::apply_release(&mut stopping, release);
        let stopping = self.persist_then_publish(stopping).await?;

        if let Err(source) = backend.stop(&stopping).await {
            if backend.probe(&stopping.id).await.unwrap_or(true) {
                let mut back = (*rec).clone();
                back.updated_at_ms = now_ms();
                let _ = self.publish_then_persist(back).await;
                return Err(EdgeError::Backend { backend: backend.name(), op: "stop", id: rec.id.clone(), source });
            }
            tracing::warn!(sandbox_id = %rec.id, error = %source, "stop failed, but the sandbox is gone");
        }
        let mut stopped = (*stopping).clone();
        let now = now_ms();
        stopped.state = SandboxStatus::Stopped;
        stopped.updated_at_ms = now;
        stopped.ended_at_ms = now;
        let (stopped, written) = self.publish_then_persist(stopped).await;
        self.queue_release(&stopped);
        written.map(|()| stopped)
    }

    /// Marks a sandbox FAILED and queues its lease as `release` says; the caller holds its
    /// operation lock (or is the recovery, before serving).
    pub(crate) async fn fail_locked(&self, rec: &SandboxRecord, reason: &str, release: Release) -> Arc<SandboxRecord> {
        let now = now_ms();
        let mut failed = rec.clone();
        failed.state = SandboxStatus::Failed;
        failed.end_reason = reason.to_string();
        failed.updated_at_ms = now;
        failed.ended_at_ms = now;
        Self::apply_release(&mut failed, release);
        let (failed, _) = self.publish_then_persist(failed).await;
        self.queue_release(&failed);
        failed
    }

    pub(crate) async fn pause(&self, id: &str) -> Result<Sandbox, EdgeError> {
        let (_g, rec) = self.lock_op(id).await?;
        if rec.state == SandboxStatus::Paused {
            return Ok(self.to_proto(&rec));
        }
        if !rec.state.can_pause() {
            return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "pause" });
        }
        let backend = self.backend_of(&rec)?.clone();
        let now = now_ms();
        let mut pausing = (*rec).clone();
        pausing.state = SandboxStatus::Pausing;
        pausing.updated_at_ms = now;
        pausing.last_active_ms = now;
        let pausing = self.persist_then_publish(pausing).await?;
        if let Err(e) = backend.pause(&pausing).await {
            return Err(self.op_failed(&backend, &pausing, SandboxStatus::Running, "pause", e).await);
        }
        let mut paused = (*pausing).clone();
        let now = now_ms();
        paused.state = SandboxStatus::Paused;
        paused.updated_at_ms = now;
        paused.paused_since_ms = now;
        let (paused, written) = self.publish_then_persist(paused).await;
        written?;
        Ok(self.to_proto(&paused))
    }

    pub(crate) async fn resume(&self, id: &str) -> Result<Sandbox, EdgeError> {
        let (_g, rec) = self.lock_op(id).await?;
        if rec.state == SandboxStatus::Running {
            return Ok(self.to_proto(&rec));
        }
        if !rec.state.can_resume() {
            return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "resume" });
        }
        let backend = self.backend_of(&rec)?.clone();
        let mut resuming = (*rec).clone();
        resuming.state = SandboxStatus::Resuming;
        resuming.updated_at_ms = now_ms();
        let resuming = self.persist_then_publish(resuming).await?;
        if let Err(e) = backend.resume(&resuming).await {
            return Err(self.op_failed(&backend, &resuming, SandboxStatus::Paused, "resume", e).await);
        }
        let mut running = (*resuming).clone();
        let now = now_ms();
        running.state = SandboxStatus::Running;
        running.updated_at_ms = now;
        running.last_active_ms = now;
        running.paused_since_ms = 0;
        let (running, written) = self.publish_then_persist(running).await;
        written?;
        Ok(self.to_proto(&running))
    }

    /// A pause or resume failed: a sandbox that is still alive goes back to `back_to`, a dead
    /// one is FAILED ("lost") and its lease released.
    async fn op_failed(
        &self,
        backend: &Arc<dyn Backend>,
        rec: &SandboxRecord,
        back_to: SandboxStatus,
        op: &'static str,
        source: BackendError,
    ) -> EdgeError {
        match backend.probe(&rec.id).await {
            Ok(false) => {
                tracing::warn!(sandbox_id = %rec.id, op, error = %source, "sandbox lost during an operation");
                self.lose_locked(backend, rec).await;
            }
            _ => {
                let mut back = rec.clone();
                back.state = back_to;
                back.updated_at_ms = now_ms();
                let _ = self.publish_then_persist(back).await;
            }
        }
        EdgeError::Backend { backend: backend.name(), op, id: rec.id.clone(), source }
    }

    pub(crate) async fn set_timeout(&self, req: &SetSandboxTimeoutRequest) -> Result<Sandbox, EdgeError> {
        let (_g, rec) = self.lock_op(&req.id).await?;
        if !rec.state.can_set_timeout() {
            return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "set its timeout" });
        }
        let now = now_ms();
        let mut r = (*rec).clone();
        if let Some(s) = req.ttl_running_stop_s {
            r.spec.ttl_running_stop_s = s;
        }
        if let Some(s) = req.ttl_max_s {
            r.spec.ttl_max_s = s;
        }
        if let Some(s) = req.ttl_paused_s {
            r.spec.ttl_paused_s = s;
            // The paused timeout counts from now, like the idle one.
            if r.state == SandboxStatus::Paused {
                r.paused_since_ms = now;
            }
        }
        r.last_active_ms = now;
        r.updated_at_ms = now;
        let r = self.persist_then_publish(r).await?;
        Ok(self.to_proto(&r))
    }

    pub(crate) fn list(&self, req: &EdgeListRequest) -> Result<EdgeListResponse, EdgeError> {
        if !req.project.is_empty() {
            ids::validate_project(&req.project).map_err(|e| EdgeError::InvalidArgument(e.message))?;
        }
        let states = req
            .states
            .iter()
            .map(|s| {
                SandboxState::try_from(*s)
                    .ok()
                    .and_then(SandboxStatus::from_proto)
                    .ok_or_else(|| EdgeError::InvalidArgument(format!("states: {s} is not a sandbox state")))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let filter = ListFilter { project: req.project.clone(), states, labels: req.labels.clone() };
        let limit = match req.limit as usize {
            0 => LIST_DEFAULT,
            n => n.min(LIST_MAX),
        };
        let (recs, more) = self.table().list(&self.name, &filter, &req.after, limit);
        Ok(EdgeListResponse { sandboxes: recs.iter().map(|r| self.to_proto(r)).collect(), more })
    }

    // -----------------------------------------------------------------------------------------
    // Status

    /// Host pressure (never for sim-only edges), read at most every [`PRESSURE_CACHE`].
    pub(crate) fn pressure(&self) -> Pressure {
        if self.sim_only {
            return Pressure::default();
        }
        let cache =
            |c: &mut Option<(Instant, Pressure)>| c.filter(|(at, _)| at.elapsed() < PRESSURE_CACHE).map(|(_, p)| p);
        if let Some(p) = cache(&mut self.pressure_cache.lock().unwrap_or_else(|p| p.into_inner())) {
            return p;
        }
        let reading = self.host.reading(&self.state_dir);
        let p = admission::pressure(&reading, self.cfg.memory_reserve_fraction, self.cfg.disk_reserve_mb);
        *self.pressure_cache.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), p));
        p
    }

    pub(crate) fn status(&self, include_leases: bool) -> EdgeStatus {
        let (used, live) = {
            // Only pointers are copied under the lock; the messages are built after it.
            let t = self.table();
            let live: Vec<Arc<SandboxRecord>> =
                if include_leases { t.records().filter(|r| r.state.is_live()).cloned().collect() } else { Vec::new() };
            (t.used(), live)
        };
        let leases = live
            .iter()
            .map(|r| LiveLease {
                lease_id: r.lease_id.clone(),
                project: r.spec.project.clone(),
                principal: r.principal.clone(),
                resources: Some(r.resources().to_proto()),
            })
            .collect();
        let share = |used: u64, cap: u64| if cap == 0 { 0.0 } else { (used as f64 / cap as f64).min(1.0) };
        let reports: Option<Vec<_>> = self.backends.iter().map(|b| b.usage()).collect();
        let (cpu_use, memory_use) = match reports {
            Some(reports) => {
                let cpu = reports.iter().map(|u| u.cpu_millis).sum();
                let mem = reports.iter().map(|u| u.memory_mb).sum();
                (share(cpu, self.capacity.cpu_millis), share(mem, self.capacity.memory_mb))
            }
            None => {
                let r = self.host.reading(&self.state_dir);
                let mem = match (r.mem_total_mb, r.mem_available_mb) {
                    (Some(t), Some(a)) => share(t.saturating_sub(a), t),
                    _ => 0.0,
                };
                (self.host.cpu_use().unwrap_or(0.0), mem)
            }
        };
        let c = &self.capacity;
        EdgeStatus {
            edge: self.name.clone(),
            boot_id: self.boot_id.clone(),
            backends: self.backend_names(),
            runtime_versions: self
                .backends
                .iter()
                .filter_map(|b| b.versioned())
                .flat_map(|v| v.runtime_versions())
                .collect(),
            capacity: Some(Resources {
                cpu_millis: u32::try_from(c.cpu_millis).unwrap_or(u32::MAX),
                memory_mb: c.memory_mb,
                disk_mb: c.disk_mb,
                gpus: u32::try_from(c.gpus).unwrap_or(u32::MAX),
            }),
            allocated: Some(Resources {
                cpu_millis: u32::try_from(used.cpu_millis).unwrap_or(u32::MAX),
                memory_mb: used.memory_mb,
                disk_mb: used.disk_mb,
                gpus: u32::try_from(used.gpus).unwrap_or(u32::MAX),
            }),
            sandboxes: used.sandboxes,
            max_sandboxes: c.max_sandboxes,
            cpu_use,
            memory_use,
            pressure: Some(self.pressure()),
            draining: false,
            leases,
        }
    }

    // -----------------------------------------------------------------------------------------
    // Background work

    /// One round of the TTL loop: expire, probe liveness, delete ended records past retention.
    pub(crate) async fn ttl_round(&self) {
        let now = now_ms();
        let retention = i64::try_from(self.cfg.ended_retention.as_millis()).unwrap_or(i64::MAX);
        let mut expired = Vec::new();
        let mut probe = Vec::new();
        let mut delete = Vec::new();
        for rec in self.table().records() {
            if ttl::expired_active(rec, now, self.active_ms(&rec.lease_id, now)).is_some() {
                expired.push(rec.lease_id.clone());
            } else if rec.state.is_adoptable() {
                probe.push(rec.clone());
            } else if rec.state.is_ended() && rec.lease_released && rec.ended_at_ms.saturating_add(retention) <= now {
                delete.push(rec.lease_id.clone());
            }
        }
        futures::stream::iter(expired)
            .for_each_concurrent(LOOP_CONCURRENCY, |lease| async move { self.expire(&lease).await })
            .await;
        futures::stream::iter(probe)
            .for_each_concurrent(LOOP_CONCURRENCY, |rec| async move {
                let Some(b) = self.backend(&rec.spec.backend) else { return };
                if let Ok(false) = b.probe(&rec.id).await {
                    self.check_lost(&rec.lease_id).await;
                }
            })
            .await;
        if !delete.is_empty() {
            self.delete_ended(delete).await;
        }
        if !self.sim_only {
            // Keeps the CPU window fed and the pressure cache fresh between creations.
            let _ = self.host.cpu_use();
            let _ = self.pressure();
        }
    }

    async fn expire(&self, lease: &str) {
        let Some(op) = self.op_lock(lease) else { return };
        let _g = op.lock_owned().await;
        let Some(rec) = self.table().rec(lease) else { return };
        // Looked at again under the lock: a call may have reset the clock meanwhile.
        let now = now_ms();
        let Some(reason) = ttl::expired_active(&rec, now, self.active_ms(&rec.lease_id, now)) else { return };
        tracing::debug!(sandbox_id = %rec.id, reason, "sandbox expired");
        if let Err(e) = self.stop_locked(rec, reason, Release::Yes).await {
            tracing::warn!(lease_id = %lease, error = %e, "stopping an expired sandbox failed; will retry");
        }
    }

    async fn check_lost(&self, lease: &str) {
        let Some(op) = self.op_lock(lease) else { return };
        let _g = op.lock_owned().await;
        let Some(rec) = self.table().rec(lease) else { return };
        if !rec.state.is_adoptable() {
            return;
        }
        let Some(b) = self.backend(&rec.spec.backend) else { return };
        if let Ok(false) = b.probe(&rec.id).await {
            tracing::warn!(sandbox_id = %rec.id, "sandbox lost");
            let b = b.clone();
            self.lose_locked(&b, &rec).await;
        }
    }

    /// A sandbox found lost (its agent dead, or silent past `agent_silence`): what is left of
    /// it is torn down first (a silent agent's workload may still run, and must not go on
    /// using what its released quota no longer covers), then it is FAILED and its lease
    /// released. A teardown that fails is logged; the leftovers go at the edge's next start.
    async fn lose_locked(&self, backend: &Arc<dyn Backend>, rec: &SandboxRecord) {
        if let Err(e) = backend.stop(rec).await {
            tracing::warn!(sandbox_id = %rec.id, error = %e, "tearing down a lost sandbox failed");
        }
        self.fail_locked(rec, end_reason::LOST, Release::Yes).await;
    }

    /// Removes ended, released records past their retention: files first, then the table
    /// entries, each under its operation lock so a creation reusing the lease cannot have its
    /// new record removed.
    async fn delete_ended(&self, leases: Vec<String>) {
        let mut guards = Vec::new();
        let mut chosen = Vec::new();
        for lease in leases {
            let Some(op) = self.op_lock(&lease) else { continue };
            if let Ok(g) = op.try_lock_owned() {
                guards.push(g);
                chosen.push(lease);
            }
        }
        let store = self.store.clone();
        let files = chosen.clone();
        let removed = tokio::task::spawn_blocking(move || {
            files
                .into_iter()
                .filter(|l| match store.remove(l) {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!(error = %e, "removing an ended record failed");
                        false
                    }
                })
                .collect::<Vec<_>>()
        })
        .await
        .unwrap_or_default();
        let mut t = self.table();
        for lease in removed {
            if t.rec(&lease).is_some_and(|r| r.state.is_ended() && r.lease_released) {
                t.remove(&lease);
                self.activity.forget(&lease);
            }
        }
        drop(t);
        drop(guards);
    }

    /// Marks confirmed releases in the records (non-durable: losing the mark in a crash only
    /// repeats an idempotent release), then in memory.
    pub(crate) async fn mark_released(&self, leases: &[String]) {
        let recs: Vec<SandboxRecord> = {
            let t = self.table();
            leases
                .iter()
                .filter_map(|l| t.rec(l))
                .filter(|r| r.state.is_ended() && !r.lease_released)
                .map(|r| {
                    let mut r = (*r).clone();
                    r.lease_released = true;
                    r
                })
                .collect()
        };
        if recs.is_empty() {
            return;
        }
        let writes: Vec<(String, Vec<u8>)> =
            recs.iter().filter_map(|r| r.encode().ok().map(|b| (r.lease_id.clone(), b))).collect();
        let store = self.store.clone();
        let _ = tokio::task::spawn_blocking(move || {
            for (lease, bytes) in writes {
                if let Err(e) = store.write(&lease, &bytes, WriteMode::Lazy) {
                    tracing::warn!(error = %e, "marking a released lease failed");
                }
            }
        })
        .await;
        let mut t = self.table();
        for r in recs {
            if t.rec(&r.lease_id).is_some_and(|cur| cur.state.is_ended() && !cur.lease_released) {
                t.publish(Arc::new(r));
            }
        }
    }

    /// Stops every settled live sandbox (shutdown without `keep_sandboxes_on_exit`).
    pub(crate) async fn stop_all(&self, reason: &'static str) {
        let leases: Vec<String> =
            self.table().records().filter(|r| r.state.is_live()).map(|r| r.lease_id.clone()).collect();
        futures::stream::iter(leases)
            .for_each_concurrent(LOOP_CONCURRENCY, |lease| async move {
                let Some(op) = self.op_lock(&lease) else { return };
                let _g = op.lock_owned().await;
                let Some(rec) = self.table().rec(&lease) else { return };
                if rec.state.can_stop()
                    && let Err(e) = self.stop_locked(rec, reason, Release::Yes).await
                {
                    tracing::warn!(lease_id = %lease, error = %e, "stop at shutdown failed");
                }
            })
            .await;
    }

    pub(crate) fn table_len(&self) -> usize {
        self.table().len()
    }
}
