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
//!   outcomes are published first (memory follows reality) and then written; intents are
//!   synced before the backend is called, except a plain creation's and a pool claim's (their
//!   outcome's sync covers them: see `create`);
//! - the table's std mutex is never held across an await; only operation locks are;
//! - an ended sandbox's lease is queued for release exactly when its final record is published,
//!   unless the lease is not ours to release (`lease_moved`); IAM releases it only if it is
//!   still bound here, so a creation retried elsewhere keeps its lease.
//!
//! Where each part lives: this file holds the shared state and the record plumbing
//! (operation locks, intents and outcomes); each verb has its own file (`create`, `stop`,
//! `pause`, `resume`, `timeout`, `list`), `status` is what the watcher hears, and `sweep`
//! holds the background sweeps with the idle clock they read; `release` drains the lease
//! queue against IAM.
//!
//! Cycles on purpose: the files under `core/` are one subsystem, methods of one `Inner`; they
//! use this module's items through `use super::*` and each other only through `Inner`'s
//! methods, and this module names `release::run` for the edge to spawn.

mod create;
mod list;
mod metrics;
pub(crate) mod moves;
mod network;
mod pause;
pub(crate) mod pools;
mod release;
mod resume;
mod snapshot;
mod status;
mod stop;
mod sweep;
mod timeout;

pub(crate) use create::MOVED_IN_PREFIX;
pub(crate) use pools::pool_loop;
pub(crate) use release::run as release_loop;

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::{Notify, OwnedMutexGuard, watch};
use tokio::task::JoinHandle;

use opendsec_common::config::EdgeConfig;
use opendsec_common::ids;
use opendsec_common::time::Clock;
use opendsec_proto::v1::{
    EdgeCreateRequest, EdgeListRequest, EdgeListResponse, EdgeStatus, LiveLease, MovedAway, Pressure, Resources,
    Sandbox, SandboxState, SetSandboxTimeoutRequest,
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
    pub activity: sweep::Activity,
    /// The last CPU reading per lease (CPU time, when), for the next reading's percentage.
    pub cpu_readings: std::sync::Mutex<std::collections::HashMap<String, (u64, Instant)>>,
    /// The wall clock of TTLs, activity and retention.
    pub clock: Clock,
    /// Runtime calls in flight per sandbox, capped.
    pub runtime_calls: Arc<opendsec_common::bounds::PerKey>,
    /// Bytes of unary Runtime answers in flight through this edge.
    pub result_budget: Arc<opendsec_common::bounds::AnswerBudget>,
    /// The sandbox network (networked backends use it too), when the edge has one.
    pub network: Option<Arc<crate::netpol::Network>>,
    /// Warm pools and their members (`pools`).
    pools: std::sync::Mutex<pools::Pools>,
    /// Members' records (`<state>/pool`).
    pub member_store: Arc<RecordStore>,
    /// Wakes the pool loop (a claim, a finished start or stop).
    pub pool_wake: Notify,
    /// Drained for maintenance: no new sandbox, no idle pool member (`<state>/draining`).
    draining: AtomicBool,
    /// Held while the mark's file and flag change together.
    drain_change: std::sync::Mutex<()>,
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
    pub member_store: RecordStore,
    pub remote: Remote,
    pub advertise: String,
    pub clock: Clock,
    pub network: Option<Arc<crate::netpol::Network>>,
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
            activity: sweep::Activity::new(p.clock.clone()),
            cpu_readings: Default::default(),
            clock: p.clock,
            network: p.network,
            pools: Default::default(),
            member_store: Arc::new(p.member_store),
            pool_wake: Notify::new(),
            draining: AtomicBool::new(false),
            drain_change: std::sync::Mutex::new(()),
        }
    }

    /// Whether the edge is drained for maintenance.
    pub(crate) fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    fn draining_path(&self) -> PathBuf {
        self.state_dir.join("draining")
    }

    /// Reads the drain mark an earlier run left (at start); a mark that cannot be read stops
    /// the start rather than forget a drain.
    pub(crate) fn load_draining(&self) -> Result<(), EdgeError> {
        let path = self.draining_path();
        let on = path.try_exists().map_err(|e| EdgeError::Options(format!("{}: {e}", path.display())))?;
        if on {
            tracing::info!(edge = %self.name, "the edge is draining (marked by an earlier run)");
        }
        self.draining.store(on, Ordering::Relaxed);
        Ok(())
    }

    /// Drains the edge (or ends the drain), durably first: a restart keeps it. A drain lets
    /// the idle pool members go at once; an undrain lets the pools fill again at their next
    /// refresh from IAM (`edge.pool_refresh`).
    pub(crate) fn set_draining(&self, on: bool) -> Result<(), EdgeError> {
        // One change at a time: the file and the flag always agree.
        let _one = self.drain_change.lock().unwrap_or_else(|p| p.into_inner());
        let path = self.draining_path();
        let io = |e: std::io::Error| EdgeError::Options(format!("{}: {e}", path.display()));
        if on {
            let f = std::fs::OpenOptions::new().create(true).truncate(true).write(true).open(&path).map_err(io)?;
            f.sync_all().map_err(io)?;
        } else {
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(e)),
                _ => {}
            }
        }
        std::fs::File::open(&self.state_dir).and_then(|d| d.sync_all()).map_err(io)?;
        // Swapped under the pools' lock, which `apply_pools` reads the flag under: a refresh
        // from IAM racing this either sees the drain or is undone by the `apply_pools` below.
        let was = {
            let _pools = self.pools();
            self.draining.swap(on, Ordering::Relaxed)
        };
        if on && !was {
            tracing::info!(edge = %self.name, "draining: no new sandboxes, idle pool members stop");
            self.apply_pools(&[]);
        } else if !on && was {
            tracing::info!(edge = %self.name, "drain ended");
        }
        self.pool_wake.notify_one();
        Ok(())
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

    /// The lease of a sandbox id of this edge: one it names, or one that moved in here (its id
    /// names the edge it was created on).
    pub(crate) fn lease_of<'a>(&self, id: &'a str) -> Result<&'a str, EdgeError> {
        let (edge, lease) = ids::split_sandbox_id(id).map_err(|e| EdgeError::InvalidArgument(e.message))?;
        if edge != self.name && self.table().get(lease).is_none_or(|e| e.rec.id != id) {
            return Err(self.not_found(id));
        }
        Ok(lease)
    }

    /// The id of the sandbox holding `lease` here (`<this edge>.<lease>` unless it moved in).
    pub(crate) fn id_of(&self, lease: &str) -> String {
        match self.table().get(lease) {
            Some(e) => e.rec.id.clone(),
            None => ids::sandbox_id(&self.name, lease),
        }
    }

    fn op_lock(&self, lease: &str) -> Option<OpLock> {
        self.table().get(lease).map(|e| e.op.clone())
    }

    /// Takes the sandbox's operation lock, then reads its record as the last operation left
    /// it. A sandbox moving away, or moved, is refused (`Moving`, `Moved`).
    async fn lock_op(&self, id: &str) -> Result<(OwnedMutexGuard<()>, Arc<SandboxRecord>), EdgeError> {
        let (guard, rec) = self.lock_op_any(id).await?;
        Self::check_not_moving(&rec)?;
        Ok((guard, rec))
    }

    /// [`Self::lock_op`] for the move itself: whatever the move left.
    async fn lock_op_any(&self, id: &str) -> Result<(OwnedMutexGuard<()>, Arc<SandboxRecord>), EdgeError> {
        let lease = self.lease_of(id)?;
        let op = self.op_lock(lease).ok_or_else(|| self.not_found(id))?;
        let guard = op.lock_owned().await;
        let rec = self.table().rec(lease).ok_or_else(|| self.not_found(id))?;
        Ok((guard, rec))
    }

    /// Calls on a sandbox that is moving away wait for the move; on one that moved, they go
    /// where it went.
    pub(crate) fn check_not_moving(rec: &SandboxRecord) -> Result<(), EdgeError> {
        if rec.moved.is_moving() {
            return Err(EdgeError::Moving { id: rec.id.clone(), to: rec.moved.moving_to.clone() });
        }
        if !rec.moved.moved_to.is_empty() {
            return Err(EdgeError::Moved { id: rec.id.clone(), to: rec.moved.moved_to.clone() });
        }
        // A copy moving in, still starting: asked again shortly, it runs (or the original
        // runs on, and its edge answers).
        if rec.state == SandboxStatus::Creating && !rec.moved.moved_from.is_empty() {
            return Err(EdgeError::Moving { id: rec.id.clone(), to: rec.edge.clone() });
        }
        Ok(())
    }

    pub(crate) fn to_proto(&self, rec: &SandboxRecord) -> Sandbox {
        let active = self.active_ms(&rec.lease_id, self.clock.now_ms());
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
            address: self.address_of(rec).map(|a| a.to_string()).unwrap_or_default(),
        }
    }

    /// The sandbox's address on this edge's network, if it has one.
    pub(crate) fn address_of(&self, rec: &SandboxRecord) -> Option<std::net::Ipv4Addr> {
        let net = self.network.as_ref()?;
        (rec.net_slot != 0 && rec.state.is_live()).then(|| net.addrs(crate::netpol::Slot(rec.net_slot)).1)
    }

    /// Writes a record (queued for the store's writer: one append and one sync for what
    /// concurrent writes queue meanwhile).
    pub(crate) async fn persist(&self, rec: &SandboxRecord, mode: WriteMode) -> Result<(), RecordError> {
        let bytes = rec.encode()?;
        self.store.write_queued(&rec.lease_id, &bytes, mode).await
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

    pub(crate) fn table_len(&self) -> usize {
        self.table().len()
    }
}
