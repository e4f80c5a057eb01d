//! The `sim` backend: sandbox lifecycles only, in memory, no isolation. It exists for
//! scheduling tests and scale simulation (`cluster up --sim-edges`), so it is cheap (a map
//! insert per creation) and has test hooks: a delay per operation, injected creation failures,
//! and `kill` to make a sandbox die behind the edge's back.
//!
//! Sim sandboxes are simulated, so they "survive" an edge restart: `adopt` accepts any record.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use async_trait::async_trait;

use opendsec_common::Reason;

#[cfg(test)]
use super::BackendErrorKind;
use super::{Backend, BackendError, Usage, Versioned};
use crate::record::{ResourcesRecord, SandboxRecord};
use crate::state::SandboxStatus;

#[derive(Clone, Copy, Debug)]
struct SimSandbox {
    paused: bool,
    resources: ResourcesRecord,
}

/// What the sim backend holds, with the sum of their resources kept as they come and go (the
/// edge's Status asks for it every probe: a sum over hundreds of sandboxes per probe per edge
/// is what made a thousand sim edges cost a core).
#[derive(Debug, Default)]
struct Held {
    map: HashMap<String, SimSandbox>,
    /// Killed, and not yet stopped by the edge: what `losses` names.
    lost: HashSet<String>,
    cpu_millis: u64,
    memory_mb: u64,
}

impl Held {
    fn insert(&mut self, id: String, sb: SimSandbox) {
        self.lost.remove(&id);
        self.add(&sb);
        if let Some(old) = self.map.insert(id, sb) {
            self.sub(&old);
        }
    }

    fn remove(&mut self, id: &str) -> Option<SimSandbox> {
        let old = self.map.remove(id)?;
        self.sub(&old);
        Some(old)
    }

    fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.map.retain(|id, _| keep(id));
        self.lost.retain(|id| keep(id));
        let (cpu, mem) = self
            .map
            .values()
            .fold((0u64, 0u64), |(c, m), s| (c + u64::from(s.resources.cpu_millis), m + s.resources.memory_mb));
        (self.cpu_millis, self.memory_mb) = (cpu, mem);
    }

    fn add(&mut self, sb: &SimSandbox) {
        self.cpu_millis += u64::from(sb.resources.cpu_millis);
        self.memory_mb += sb.resources.memory_mb;
    }

    fn sub(&mut self, sb: &SimSandbox) {
        self.cpu_millis -= u64::from(sb.resources.cpu_millis);
        self.memory_mb -= sb.resources.memory_mb;
    }
}

/// The simulated backend. Cheap to share: `Arc<SimBackend>` is what the edge holds.
#[derive(Debug, Default)]
pub struct SimBackend {
    sandboxes: Mutex<Held>,
    /// Delay of every lifecycle call in microseconds; 0 = none.
    delay_us: AtomicU64,
    fail_creates: Mutex<Option<Reason>>,
}

impl SimBackend {
    pub fn new() -> SimBackend {
        SimBackend::default()
    }

    /// Test hook: every lifecycle call (create, stop, pause, resume, adopt) takes this long.
    pub fn set_delay(&self, delay: Option<Duration>) {
        let us = delay.map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
        self.delay_us.store(us, Ordering::Relaxed);
    }

    /// Test hook: make every creation fail with `reason` (until called with `None`).
    pub fn fail_creates(&self, reason: Option<Reason>) {
        *self.lock_fail() = reason;
    }

    /// Test hook: the sandbox dies (the edge notices at its next liveness sweep, as the backend
    /// names it among its losses). Returns whether it existed.
    pub fn kill(&self, id: &str) -> bool {
        let mut held = self.lock();
        let existed = held.remove(id).is_some();
        if existed {
            held.lost.insert(id.to_string());
        }
        existed
    }

    /// Sandboxes the backend holds.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.lock().map.is_empty()
    }

    pub fn contains(&self, id: &str) -> bool {
        self.lock().map.contains_key(id)
    }

    /// `Some(true)` when the sandbox is held and paused.
    pub fn is_paused(&self, id: &str) -> Option<bool> {
        self.lock().map.get(id).map(|s| s.paused)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Held> {
        // The map stays consistent even if a holder panicked: every update is one insert/remove.
        self.sandboxes.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_fail(&self) -> std::sync::MutexGuard<'_, Option<Reason>> {
        self.fail_creates.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn delay(&self) {
        let us = self.delay_us.load(Ordering::Relaxed);
        if us > 0 {
            tokio::time::sleep(Duration::from_micros(us)).await;
        }
    }

    fn set_paused(&self, id: &str, paused: bool) -> Result<(), BackendError> {
        let mut map = self.lock();
        let sb =
            map.map.get_mut(id).ok_or_else(|| BackendError::not_found(format!("sim sandbox {id} does not exist")))?;
        // Pausing a paused sandbox (or resuming a running one) is a no-op, as on every backend
        // (the conformance suite): a recovery may repeat an interrupted operation.
        if sb.paused == paused {
            return Ok(());
        }
        sb.paused = paused;
        Ok(())
    }
}

#[async_trait]
impl Backend for SimBackend {
    fn name(&self) -> &'static str {
        "sim"
    }

    async fn create(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.delay().await;
        if let Some(reason) = *self.lock_fail() {
            return Err(BackendError::from_reason(reason, format!("sim: creation of {} fails on purpose", sb.id)));
        }
        let entry = SimSandbox { paused: false, resources: sb.resources() };
        self.lock().insert(sb.id.clone(), entry);
        Ok(())
    }

    async fn stop(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.delay().await;
        let mut held = self.lock();
        held.remove(&sb.id);
        held.lost.remove(&sb.id);
        Ok(())
    }

    async fn pause(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.delay().await;
        self.set_paused(&sb.id, true)
    }

    async fn resume(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.delay().await;
        self.set_paused(&sb.id, false)
    }

    async fn probe(&self, id: &str) -> Result<bool, BackendError> {
        Ok(self.contains(id))
    }

    /// Its sandboxes die only by `kill`, which it remembers: a thousand sim edges need not
    /// look up every sandbox every round.
    fn losses(&self) -> Option<Vec<String>> {
        Some(self.lock().lost.iter().cloned().collect())
    }

    async fn gone(&self, ids: &[&str]) -> Vec<usize> {
        let held = self.lock();
        ids.iter().enumerate().filter(|(_, id)| !held.map.contains_key(**id)).map(|(i, _)| i).collect()
    }

    async fn adopt(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.delay().await;
        let entry = SimSandbox { paused: sb.state == SandboxStatus::Paused, resources: sb.resources() };
        self.lock().insert(sb.id.clone(), entry);
        Ok(())
    }

    async fn cleanup(&self, keep: &HashSet<String>) -> Result<usize, BackendError> {
        let mut map = self.lock();
        let before = map.map.len();
        map.retain(|id| keep.contains(id));
        Ok(before - map.map.len())
    }

    /// Simulated: half of what the sandboxes were given.
    fn usage(&self) -> Option<Usage> {
        let held = self.lock();
        Some(Usage { cpu_millis: held.cpu_millis / 2, memory_mb: held.memory_mb / 2 })
    }

    fn versioned(&self) -> Option<&dyn Versioned> {
        Some(self)
    }
}

impl Versioned for SimBackend {
    fn runtime_versions(&self) -> Vec<String> {
        vec!["sim 1".to_string()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{RECORD_VERSION, SpecRecord};

    fn rec(id: &str, cpu: u32) -> SandboxRecord {
        SandboxRecord {
            version: RECORD_VERSION,
            id: id.into(),
            edge: "e".into(),
            lease_id: id.trim_start_matches("e.").into(),
            principal: "p".into(),
            spec: SpecRecord {
                backend: "sim".into(),
                resources: ResourcesRecord { cpu_millis: cpu, memory_mb: 100, ..Default::default() },
                ..Default::default()
            },
            state: SandboxStatus::Creating,
            created_at_ms: 1,
            updated_at_ms: 1,
            last_active_ms: 1,
            paused_since_ms: 0,
            end_reason: String::new(),
            ended_at_ms: 0,
            lease_released: false,
            net_slot: 0,
            member: String::new(),
            pool: String::new(),
            pool_revision: String::new(),
            moved: Default::default(),
        }
    }

    #[tokio::test]
    async fn lifecycle() {
        let b = SimBackend::new();
        let r = rec("e.a", 1000);
        b.create(&r).await.unwrap();
        assert!(b.probe("e.a").await.unwrap());
        b.pause(&r).await.unwrap();
        assert_eq!(b.is_paused("e.a"), Some(true));
        b.pause(&r).await.unwrap();
        assert_eq!(b.is_paused("e.a"), Some(true), "pausing again changes nothing");
        b.resume(&r).await.unwrap();
        assert_eq!(b.usage(), Some(Usage { cpu_millis: 500, memory_mb: 50 }));
        b.stop(&r).await.unwrap();
        b.stop(&r).await.unwrap();
        assert!(!b.probe("e.a").await.unwrap());
        assert!(matches!(b.resume(&r).await, Err(ref e) if e.kind() == BackendErrorKind::NotFound));
    }

    #[tokio::test]
    async fn hooks_fail_creations_and_kill() {
        let b = SimBackend::new();
        b.fail_creates(Some(Reason::NoCapacity));
        let err = b.create(&rec("e.a", 1)).await.unwrap_err();
        assert_eq!(err.reason(), Reason::NoCapacity);
        assert!(b.is_empty());
        b.fail_creates(None);
        b.set_delay(Some(Duration::from_millis(1)));
        b.create(&rec("e.a", 1)).await.unwrap();
        assert!(b.kill("e.a"));
        assert!(!b.probe("e.a").await.unwrap());
    }

    #[tokio::test]
    async fn adopt_and_cleanup() {
        let b = SimBackend::new();
        let mut r = rec("e.a", 1);
        r.state = SandboxStatus::Paused;
        b.adopt(&r).await.unwrap();
        b.create(&rec("e.b", 1)).await.unwrap();
        b.create(&rec("e.c", 1)).await.unwrap();
        let keep: HashSet<String> = ["e.a".to_string()].into();
        assert_eq!(b.cleanup(&keep).await.unwrap(), 2);
        assert_eq!(b.len(), 1);
        assert_eq!(b.is_paused("e.a"), Some(true));
        assert_eq!(b.versioned().unwrap().runtime_versions(), ["sim 1"]);
        // The totals follow what is held, through adoption, cleanup, kills and repeats.
        assert_eq!(
            b.usage(),
            Some(Usage {
                cpu_millis: rec("e.a", 1).resources().cpu_millis as u64 / 2,
                memory_mb: rec("e.a", 1).resources().memory_mb / 2
            })
        );
        b.adopt(&r).await.unwrap();
        b.create(&rec("e.d", 1)).await.unwrap();
        assert_eq!(b.gone(&["e.a", "e.x", "e.d", "e.b"]).await, [1, 3]);
        assert!(b.kill("e.d") && !b.kill("e.d"));
        b.stop(&r).await.unwrap();
        assert_eq!(b.usage(), Some(Usage { cpu_millis: 0, memory_mb: 0 }));
    }
}
