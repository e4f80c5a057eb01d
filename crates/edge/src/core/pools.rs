//! Warm pools on this edge: members started ahead of time from each pool's template (IAM's
//! pools, read every `edge.pool_refresh`), kept at the pool's size per edge, and claimed by
//! creations that name the pool. `pool::Members` decides; this file does the I/O.
//!
//! Invariants:
//! - a claim takes only an idle member of the revision the creation asked for, and only when
//!   that is the edge's current revision of the pool: a member of another template is never
//!   handed out (the creation misses and is made cold);
//! - a member has a record in `<state>/pool` from before its container exists until after it
//!   is gone. A claim writes the sandbox's record (naming the member in `member`) before the
//!   member's record goes, so after a crash a member is the pool's or a sandbox's, never both
//!   and never lost: recovery drops the member records that sandbox records name;
//! - members hold room on the edge like sandboxes (capacity checks and the reported
//!   allocation count them), and a lease of their own in IAM, charged to the pool's project
//!   like a sandbox (`AdmitMember`, before the member's container exists; the edge reports it
//!   live, and releases it when the member goes, claimed or stopped): a tenant's members on
//!   every edge together never hold more than its quota. A claim's own lease takes over one
//!   member's charge on that edge in IAM (the apiserver's Admit names the pool), so a pool
//!   sized to the whole quota can still be claimed;
//! - lock order: the table's, then the pools'.

use std::collections::{BTreeMap, HashMap, HashSet};

use opendsec_common::Reason;
use opendsec_common::pool::PoolTemplate;
use opendsec_proto::v1::{Pool, PoolStatus};

use super::*;
use crate::admission::Totals;
use crate::pool::{MemberState, Members};

/// Failed member starts of one pool wait this long at first, doubling up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(60);
/// The prefix of members' lease parts: never a lease IAM hands out (those are hex).
pub(crate) const MEMBER_PREFIX: &str = "pm-";

/// Why a member did not start.
enum StartError {
    /// Not now: no room on the edge for it.
    NoRoom(String),
    Failed(String),
}

impl From<String> for StartError {
    fn from(s: String) -> StartError {
        StartError::Failed(s)
    }
}

/// One pool on this edge.
struct Entry {
    /// As IAM gave it last (`None` before the first refresh after a restart, or once IAM no
    /// longer has it).
    pool: Option<Pool>,
    members: Members,
    /// When each starting member's start began (refill latency).
    started_at: HashMap<String, Instant>,
    failures: u32,
    retry_at: Option<Instant>,
    /// The last refills' latencies, newest last (at most [`REFILLS_KEPT`]).
    refills: std::collections::VecDeque<Duration>,
    /// Since when members of an older revision have been around (the last rollout).
    stale_since: Option<Instant>,
}

const REFILLS_KEPT: usize = 64;

impl Entry {
    fn new(revision: &str, target: u32) -> Entry {
        Entry {
            pool: None,
            members: Members::new(revision, target),
            started_at: HashMap::new(),
            failures: 0,
            retry_at: None,
            refills: Default::default(),
            stale_since: None,
        }
    }
}

/// The edge's pools and their members.
#[derive(Default)]
pub(crate) struct Pools {
    /// By `project/name`.
    entries: BTreeMap<String, Entry>,
    /// The records of members not claimed yet (starting, idle, stopping), by member id.
    records: HashMap<String, Arc<SandboxRecord>>,
    /// Member ids with a start or stop in flight.
    busy: HashSet<String>,
    /// What members hold.
    pub used: Totals,
    /// Where the next round's starts begin (pools take turns).
    cursor: usize,
    /// IAM's pools were read at least once since the edge started: until then members
    /// recovered from before the restart are kept whatever their pool's size (IAM may be
    /// unreachable in a cluster-wide restart).
    refreshed: bool,
    /// The members whose lease IAM holds (charged), by id, as the edge reports them live.
    pub(crate) charged: BTreeMap<String, opendsec_proto::v1::LiveLease>,
    /// Members to charge again (`Inner::recharge_members`): id, lease, pool key.
    recharge: Vec<(String, String, String)>,
}

pub(crate) fn pool_key(project: &str, name: &str) -> String {
    format!("{project}/{name}")
}

/// The project of a pool key (pool names have no `/`).
fn project_of(key: &str) -> &str {
    key.rsplit_once('/').map_or("", |(p, _)| p)
}

/// [`Inner::claim_member`] under the pools' lock: the member whose lease is `prefer_lease`
/// when it is idle, else another. The member leaves `charged`: its lease is to be released
/// (by the caller) whatever becomes of it.
fn take_locked(g: &mut Pools, key: &str, revision: &str, prefer_lease: &str) -> Option<Arc<SandboxRecord>> {
    let Pools { entries, records, charged, .. } = g;
    let e = entries.get_mut(key)?;
    if revision.is_empty() || e.members.revision() != revision {
        e.members.misses += 1;
        return None;
    }
    let prefer = match prefer_lease {
        "" => None,
        lease => records.values().find(|r| r.lease_id == lease && r.pool == key).map(|r| r.id.clone()),
    };
    let id = e.members.claim_preferring(prefer.as_deref())?;
    // The refill is started once the claim is done (`create`): starting a member takes the
    // CPU a claim needs.
    let rec = records.remove(&id)?;
    charged.remove(&id);
    Some(rec)
}

/// How the edge reports a charged member to IAM (reconciliation keeps or adopts its lease).
fn member_live(
    rec: &SandboxRecord,
    project: &str,
    pool: &str,
    resources: opendsec_proto::v1::Resources,
) -> opendsec_proto::v1::LiveLease {
    opendsec_proto::v1::LiveLease {
        lease_id: rec.lease_id.clone(),
        project: project.to_string(),
        principal: String::new(),
        resources: Some(resources),
        pool: format!("{project}//{pool}"),
    }
}

/// A pool's template as members are started from it.
fn template_of(p: &Pool) -> PoolTemplate {
    p.template.as_ref().map(PoolTemplate::from_pb).unwrap_or_default()
}

impl Inner {
    pub(crate) fn pools(&self) -> std::sync::MutexGuard<'_, Pools> {
        // Every update keeps the maps consistent at each step; a panic leaves them usable.
        self.pools.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether `name` is a backend this edge keeps pool members of.
    fn warm_backend(&self, name: &str) -> Option<&Arc<dyn Backend>> {
        self.backend(name).filter(|b| b.warm().is_some())
    }

    /// Takes an idle member of pool `pool` of `project` of `revision` for a creation, or
    /// counts a miss. The member leaves the pool; its room stays counted as the pool's until
    /// the sandbox's record takes it (`take_room`) or the member is stopped (`discard_member`):
    /// a running container is always counted. The caller makes it a sandbox or stops it.
    ///
    /// `moved_lease` is the member lease whose charge IAM moved to the creation's lease
    /// ([`Inner::uncharge_named`]): that member is taken if it is idle. The member taken,
    /// whichever it is, has its own lease released: the sandbox's lease holds its charge now.
    pub(crate) fn claim_member(
        &self,
        project: &str,
        pool: &str,
        revision: &str,
        moved_lease: &str,
    ) -> Option<Arc<SandboxRecord>> {
        let taken = take_locked(&mut self.pools(), &pool_key(project, pool), revision, moved_lease);
        if let Some(m) = &taken {
            self.releases.push(m.lease_id.clone());
        }
        taken
    }

    /// IAM moved the charge of the member whose lease is `lease` to a creation's lease: the
    /// member is no longer reported as charged, and is charged again (`recharge_members`)
    /// unless the creation takes it first. Every creation naming one does this first, on
    /// every path (one that goes cold, or is refused, leaves the member uncharged otherwise).
    pub(crate) fn uncharge_named(&self, lease: &str) {
        let mut g = self.pools();
        let found = g.charged.iter().find(|(_, l)| l.lease_id == lease).map(|(id, l)| (id.clone(), l.pool.clone()));
        if let Some((id, pool)) = found {
            g.charged.remove(&id);
            let key = pool.split_once("//").map(|(p, n)| pool_key(p, n)).unwrap_or_default();
            g.recharge.push((id, lease.to_string(), key));
            drop(g);
            self.pool_wake.notify_one();
        }
    }

    /// A `fncall` creation naming no pool takes an idle member of a pool of its project whose
    /// template is exactly the spec's (same revision), when there is one.
    pub(crate) fn claim_matching(&self, spec: &opendsec_proto::v1::SandboxSpec) -> Option<Arc<SandboxRecord>> {
        let r = spec.resources.unwrap_or_default();
        if spec.backend != "fncall" || r.gpus > 0 || !spec.masked_paths.is_empty() || !spec.readonly_paths.is_empty() {
            return None;
        }
        // Rules in their canonical text, as pools keep them (the revision sorts them).
        let egress: Vec<String> = spec
            .network
            .iter()
            .flat_map(|n| n.egress.iter())
            .filter_map(|e| opendsec_common::egress::Rule::from_pb(e).ok())
            .map(|e| e.to_string())
            .collect();
        let t = PoolTemplate {
            image: spec.image.clone(),
            backend: spec.backend.clone(),
            cpu_millis: r.cpu_millis,
            memory_mb: r.memory_mb,
            disk_mb: r.disk_mb,
            env: spec.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            egress,
            user: spec.user.clone(),
            workdir: spec.workdir.clone(),
        };
        let revision = t.revision();
        // The sandbox's own project exactly: a subproject's pool (its own images) is not its
        // parent's. Found and taken under one lock: no miss is counted to a pool not named.
        let mut g = self.pools();
        let key = g
            .entries
            .iter()
            .find(|(k, e)| project_of(k) == spec.project && e.members.revision() == revision && e.members.idle() > 0)
            .map(|(k, _)| k.clone())?;
        let taken = take_locked(&mut g, &key, &revision, "");
        drop(g);
        if let Some(m) = &taken {
            self.releases.push(m.lease_id.clone());
        }
        taken
    }

    /// A claimed member's record is no longer needed (the sandbox's record names it). Its
    /// own lease is released (queued: a claim's lease took its charge over, or it stopped).
    pub(crate) async fn forget_member(&self, member: &SandboxRecord) {
        if self.pools().charged.remove(&member.id).is_some() {
            self.releases.push(member.lease_id.clone());
        }
        let store = self.member_store.clone();
        let lease = member.lease_id.clone();
        match tokio::task::spawn_blocking(move || store.remove(&lease)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(member = %member.id, error = %e, "removing a claimed member's record failed"),
            Err(e) => tracing::warn!(member = %member.id, error = %e, "removing a claimed member's record failed"),
        }
    }

    /// Stops a member that left the pool without becoming a sandbox, and forgets it (its room
    /// with it).
    pub(crate) async fn discard_member(&self, member: &SandboxRecord) {
        let stopped = match self.backend(&member.spec.backend) {
            Some(b) => b.stop(member).await,
            None => Ok(()),
        };
        self.pools().used.sub(member.resources());
        if let Err(e) = stopped {
            tracing::warn!(member = %member.id, error = %e, "stopping a pool member failed");
            return; // its record stays: recovery or clean-up finishes it
        }
        self.forget_member(member).await;
    }

    /// A claimed member's room becomes its sandbox's: called with the table's lock held, as
    /// the sandbox's record goes in.
    pub(crate) fn take_room(&self, member: &SandboxRecord) {
        self.pools().used.sub(member.resources());
    }

    /// Whether a member's agent is up (its Watch stream open, its heartbeat recent).
    pub(crate) fn member_alive(&self, backend: &Arc<dyn Backend>, member: &SandboxRecord) -> bool {
        backend.agent_access().is_none_or(|a| a.agent(&member.id).is_ok())
    }

    /// [`Inner::discard_member`] in the background.
    pub(crate) fn discard_member_later(&self, member: Arc<SandboxRecord>) {
        let (backend, store) = (self.backend(&member.spec.backend).cloned(), self.member_store.clone());
        // (Its room is given back at once: for the moment the stop takes, a dead member's.)
        {
            let mut g = self.pools();
            g.used.sub(member.resources());
            if g.charged.remove(&member.id).is_some() {
                self.releases.push(member.lease_id.clone());
            }
        }
        tokio::spawn(async move {
            if let Some(b) = backend
                && let Err(e) = b.stop(&member).await
            {
                tracing::warn!(member = %member.id, error = %e, "stopping a pool member failed");
                return;
            }
            let _ = tokio::task::spawn_blocking(move || store.remove(&member.lease_id)).await;
        });
    }

    /// What members together may hold: `edge.pool_share_percent` of the edge's capacity (CPU,
    /// memory, disk, GPUs, sandboxes).
    pub(crate) fn pool_share(&self) -> [u64; 5] {
        let share = |v: u64| v.saturating_mul(u64::from(self.cfg.pool_share_percent)) / 100;
        let c = &self.capacity;
        [share(c.cpu_millis), share(c.memory_mb), share(c.disk_mb), share(c.gpus), share(u64::from(c.max_sandboxes))]
    }

    /// What members hold (for capacity checks; call with the table's lock held).
    pub(crate) fn pool_used(&self) -> Totals {
        self.pools().used
    }

    /// IAM's pools now: the ones of a backend with members here are kept, at their template
    /// and size; the others (deleted) shrink to nothing.
    pub(crate) fn apply_pools(&self, pools: &[Pool]) {
        let mut g = self.pools();
        // A draining edge keeps no pool: as if IAM had none (idle members stop). Read under
        // the lock `set_draining` swaps the flag under.
        let pools = if self.draining() { &[] } else { pools };
        g.refreshed = true;
        let mut seen = HashSet::new();
        // What each pool keeps here: its size, split fairly between tenants past the share.
        let asks: Vec<crate::pool::ShareAsk> = pools
            .iter()
            .filter_map(|p| {
                let t = p.template.as_ref()?;
                self.warm_backend(&t.backend)?;
                let r = t.resources.unwrap_or_default();
                Some(crate::pool::ShareAsk {
                    tenant: opendsec_common::ids::tenant_of(&p.project).to_string(),
                    key: pool_key(&p.project, &p.name),
                    per_member: [u64::from(r.cpu_millis), r.memory_mb, r.disk_mb, u64::from(r.gpus), 1],
                    size: p.size_per_edge,
                })
            })
            .collect();
        let targets = crate::pool::fair_targets(self.pool_share(), &asks);
        for p in pools {
            let Some(t) = p.template.as_ref() else { continue };
            if self.warm_backend(&t.backend).is_none() {
                continue;
            }
            let key = pool_key(&p.project, &p.name);
            let target = targets.get(&key).copied().unwrap_or(p.size_per_edge);
            // The revision is derived here from the template, never taken on trust.
            let revision = template_of(p).revision();
            let e = g.entries.entry(key.clone()).or_insert_with(|| Entry::new(&revision, target));
            if e.members.revision() != revision {
                // A new template: its starts get a fresh chance.
                e.failures = 0;
                e.retry_at = None;
                if !e.members.is_empty() && e.stale_since.is_none() {
                    e.stale_since = Some(Instant::now());
                }
            }
            e.members.set_template(&revision, target);
            e.pool = Some(p.clone());
            seen.insert(key);
        }
        for (k, e) in g.entries.iter_mut() {
            if !seen.contains(k) {
                // Gone from IAM: nothing is current, everything idle stops.
                e.pool = None;
                e.members.set_template("", 0);
            }
        }
    }

    /// One round: starts and stops members as each pool's plan says, in background tasks
    /// (at most `edge.pool_starts` starts at once); drops pools that are gone and empty.
    pub(crate) fn pool_round(self: &Arc<Self>) {
        if self.closing.load(Ordering::Relaxed) {
            return;
        }
        let mut starts: Vec<(String, Pool, String, String)> = Vec::new();
        let mut stops: Vec<Arc<SandboxRecord>> = Vec::new();
        {
            let mut g = self.pools();
            if !g.refreshed {
                return;
            }
            let Pools { entries, records, busy, cursor, .. } = &mut *g;
            // Idle members whose agent died are stopped (the plan then starts others).
            for e in entries.values_mut() {
                for id in e.members.idle_ids() {
                    let alive = records
                        .get(&id)
                        .is_none_or(|r| self.backend(&r.spec.backend).is_none_or(|b| self.member_alive(b, r)));
                    if !alive {
                        tracing::warn!(member = %id, "a pool member's agent is gone; replacing it");
                        e.members.retire(&id);
                    }
                }
            }
            let mut starting = entries.values().flat_map(|e| e.started_at.keys()).count();
            let now = Instant::now();
            entries.retain(|_, e| e.pool.is_some() || !e.members.is_empty());
            // Pools take turns at the start slots: one that sorts first never starves the rest.
            let n = entries.len().max(1);
            *cursor = (*cursor + 1) % n;
            let first = *cursor;
            let mut order: Vec<(&String, &mut Entry)> = entries.iter_mut().collect();
            let len = order.len();
            order.rotate_left(first.min(len));
            for (key, e) in order {
                if e.members.stale() == 0 {
                    e.stale_since = None;
                }
                let plan = e.members.plan();
                for id in plan.stop {
                    if !busy.contains(&id)
                        && let Some(r) = records.get(&id)
                    {
                        busy.insert(id);
                        stops.push(r.clone());
                    }
                }
                let Some(pool) = e.pool.clone() else { continue };
                if e.retry_at.is_some_and(|t| t > now) {
                    continue;
                }
                for _ in 0..plan.start {
                    if starting >= self.cfg.pool_starts as usize {
                        break;
                    }
                    let id = ids::sandbox_id(&self.name, &format!("{MEMBER_PREFIX}{}", ids::new_lease_id()));
                    let revision = e.members.revision().to_string();
                    e.members.starting(&id, &revision);
                    e.started_at.insert(id.clone(), now);
                    busy.insert(id.clone());
                    starting += 1;
                    starts.push((key.clone(), pool.clone(), id, revision));
                }
            }
        }
        for rec in stops {
            let me = self.clone();
            self.spawn_pool_task(async move { me.stop_member(rec).await });
        }
        for (key, pool, id, revision) in starts {
            let me = self.clone();
            self.spawn_pool_task(async move { me.start_member(key, pool, id, revision).await });
        }
    }

    fn spawn_pool_task(&self, f: impl std::future::Future<Output = ()> + Send + 'static) {
        let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
        tasks.retain(|t| !t.is_finished());
        tasks.push(tokio::spawn(f));
    }

    /// The record a member of `pool` is started with.
    fn member_record(&self, pool: &Pool, id: &str, revision: &str) -> SandboxRecord {
        let t = template_of(pool);
        let (_, lease) = ids::split_sandbox_id(id).unwrap_or(("", id));
        let spec = SpecRecord {
            project: pool.project.clone(),
            image: t.image,
            backend: t.backend,
            resources: crate::record::ResourcesRecord {
                cpu_millis: t.cpu_millis,
                memory_mb: t.memory_mb,
                disk_mb: t.disk_mb,
                gpus: 0,
            },
            env: t.env,
            user: t.user,
            workdir: t.workdir,
            egress: Some(
                t.egress
                    .iter()
                    .filter_map(|r| opendsec_common::egress::Rule::parse(r).ok())
                    .map(|r| r.to_string())
                    .collect(),
            ),
            pool: pool.name.clone(),
            ..Default::default()
        };
        SandboxRecord {
            // No lease: nothing of IAM's is released when it goes.
            lease_released: true,
            pool: pool_key(&pool.project, &pool.name),
            pool_revision: revision.to_string(),
            moved: Default::default(),
            ..self.new_record(lease, "", spec, 0)
        }
    }

    async fn start_member(self: Arc<Self>, key: String, pool: Pool, id: String, revision: String) {
        let result = self.start_member_inner(&pool, &id, &revision).await;
        let mut stop = None;
        {
            let mut g = self.pools();
            let Pools { entries, records, busy, .. } = &mut *g;
            busy.remove(&id);
            let e = entries.get_mut(&key);
            match (result, e) {
                (Ok(rec), Some(e)) => {
                    let began = e.started_at.remove(&id);
                    e.failures = 0;
                    e.retry_at = None;
                    // Its room was reserved when the start began.
                    let rec = Arc::new(rec);
                    records.insert(id.clone(), rec.clone());
                    match e.members.started(&id) {
                        Some(MemberState::Idle) => {
                            if let Some(b) = began {
                                if e.refills.len() >= REFILLS_KEPT {
                                    e.refills.pop_front();
                                }
                                e.refills.push_back(b.elapsed());
                            }
                        }
                        // Replaced while it started (or the pool went): stopped at once.
                        _ => {
                            busy.insert(id.clone());
                            stop = Some(rec);
                        }
                    }
                }
                (Ok(rec), None) => {
                    let rec = Arc::new(rec);
                    records.insert(id.clone(), rec.clone());
                    busy.insert(id.clone());
                    stop = Some(rec);
                }
                (Err(why), e) => {
                    // No room now (pressure, capacity, the pools' share) is tried again next
                    // round; anything else waits longer after each failure.
                    let (room, why) = match why {
                        StartError::NoRoom(w) => (true, w),
                        StartError::Failed(w) => (false, w),
                    };
                    if room {
                        tracing::debug!(pool = %key, member = %id, why = %why, "no room for a pool member now");
                    } else {
                        tracing::warn!(pool = %key, member = %id, error = %why, "starting a pool member failed");
                    }
                    if let Some(e) = e {
                        e.started_at.remove(&id);
                        e.members.gone(&id);
                        // Either way not before the wait: the round this start's end wakes
                        // would otherwise try again at once, round after round.
                        let wait = if room {
                            self.cfg.pool_refresh
                        } else {
                            e.failures = e.failures.saturating_add(1);
                            FIRST_BACKOFF.saturating_mul(1 << e.failures.min(6)).min(MAX_BACKOFF)
                        };
                        e.retry_at = Some(Instant::now() + wait);
                    }
                }
            }
        }
        if let Some(rec) = stop {
            self.clone().stop_member(rec).await;
        }
        self.pool_wake.notify_one();
    }

    /// Starts a member: its room, its record, its network slot, then the backend. On an error
    /// nothing of it is left.
    async fn start_member_inner(&self, pool: &Pool, id: &str, revision: &str) -> Result<SandboxRecord, StartError> {
        let mut rec = self.member_record(pool, id, revision);
        let backend = self
            .warm_backend(&rec.spec.backend)
            .cloned()
            .ok_or_else(|| StartError::Failed("backend not offered".into()))?;
        if let Some(dim) = admission::pressure_refusal(&self.pressure()) {
            return Err(StartError::NoRoom(format!("{dim} pressure")));
        }
        {
            // Members take room only where sandboxes would fit too, reserved as it is checked.
            let t = self.table();
            let mut p = self.pools();
            admission::check_capacity(&self.capacity, &t.used().plus(p.used), rec.resources())
                .map_err(|r| StartError::NoRoom(r.to_string()))?;
            // And members together hold at most `edge.pool_share_percent` of the edge.
            let [cpu, mem, disk, gpus, n] = self.pool_share();
            let pool_cap = crate::admission::Capacity {
                cpu_millis: cpu,
                memory_mb: mem,
                disk_mb: disk,
                gpus,
                max_sandboxes: u32::try_from(n).unwrap_or(u32::MAX),
            };
            admission::check_capacity(&pool_cap, &p.used, rec.resources()).map_err(|r| {
                StartError::NoRoom(format!("pool members' share of the edge (edge.pool_share_percent): {r}"))
            })?;
            p.used.add(rec.resources());
        }
        let res = rec.resources();
        let release = || self.pools().used.sub(res);
        let net = self.network.as_ref().filter(|_| backend.networked());
        if let Some(n) = net {
            match n.reserve() {
                Ok(slot) => rec.net_slot = slot.0,
                Err(e) => {
                    release();
                    return Err(StartError::NoRoom(e.to_string()));
                }
            }
        }
        let unreserve = |rec: &SandboxRecord| {
            if let Some(n) = net {
                n.unreserve(crate::netpol::Slot(rec.net_slot));
            }
        };
        let store = self.member_store.clone();
        let lease = rec.lease_id.clone();
        let written = match rec.encode() {
            Ok(bytes) => tokio::task::spawn_blocking(move || store.write(&lease, &bytes, WriteMode::DurableNew))
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string())),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = written {
            unreserve(&rec);
            release();
            return Err(e.into());
        }
        // Charged to the pool's project before its container exists (its record does: a crash
        // from here leaves a record whose lease the restart releases or adopts).
        if self.remote.has_iam() {
            let res = rec.resources().to_proto();
            if let Err(e) = self.remote.admit_member(&rec.lease_id, &pool.project, &pool.name, res).await {
                unreserve(&rec);
                release();
                self.forget_member(&rec).await;
                // Over the quota (the tenant's sandboxes and members hold it), or IAM not
                // reachable: no room for it now, tried again next round.
                return Err(StartError::NoRoom(format!("charging the member: {e}")));
            }
            self.pools().charged.insert(rec.id.clone(), member_live(&rec, &pool.project, &pool.name, res));
        }
        let created = match self.closing.load(Ordering::Relaxed) {
            true => Err(crate::backend::BackendError::unavailable("the edge is stopping")),
            false => backend.create(&rec).await,
        };
        if let Err(e) = created {
            let _ = backend.stop(&rec).await;
            unreserve(&rec);
            release();
            self.forget_member(&rec).await;
            return Err(e.report().into());
        }
        rec.state = SandboxStatus::Running;
        rec.updated_at_ms = self.clock.now_ms();
        let store = self.member_store.clone();
        let lease = rec.lease_id.clone();
        let written = match rec.encode() {
            Ok(bytes) => tokio::task::spawn_blocking(move || store.write(&lease, &bytes, WriteMode::Durable))
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string())),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = written {
            let _ = backend.stop(&rec).await;
            release();
            self.forget_member(&rec).await;
            return Err(e.into());
        }
        Ok(rec)
    }

    async fn stop_member(self: Arc<Self>, rec: Arc<SandboxRecord>) {
        let stopped = match self.backend(&rec.spec.backend) {
            Some(b) => b.stop(&rec).await,
            None => Ok(()),
        };
        {
            let mut g = self.pools();
            let Pools { entries, records, busy, used, .. } = &mut *g;
            busy.remove(&rec.id);
            if let Err(e) = &stopped {
                // Tried again next round.
                tracing::warn!(member = %rec.id, error = %e, "stopping a pool member failed");
                return;
            }
            if records.remove(&rec.id).is_some() {
                used.sub(rec.resources());
            }
            if let Some(e) = entries.get_mut(&rec.pool) {
                e.members.gone(&rec.id);
            }
        }
        self.forget_member(&rec).await;
    }

    /// Stops every member (the edge stops without keeping its sandboxes): the pools' and any
    /// other record in `<state>/pool` (a start cut short by the shutdown).
    pub(crate) async fn stop_all_members(self: &Arc<Self>) {
        let mut all: Vec<Arc<SandboxRecord>> = self.pools().records.values().cloned().collect();
        let store = self.member_store.clone();
        if let Ok(Ok((on_disk, _))) = tokio::task::spawn_blocking(move || store.load_all()).await {
            let known: HashSet<String> = all.iter().map(|r| r.id.clone()).collect();
            all.extend(on_disk.into_iter().filter(|r| !known.contains(&r.id)).map(Arc::new));
        }
        futures::stream::iter(all).for_each_concurrent(LOOP_CONCURRENCY, |r| self.clone().stop_member(r)).await;
    }

    /// Members' records at start-up (before the network is recovered): the ones a sandbox
    /// record names are that sandbox's (their records are removed), the rest are returned.
    pub(crate) async fn load_members(&self, named: &HashSet<String>) -> Result<Vec<SandboxRecord>, EdgeError> {
        let store = self.member_store.clone();
        let (records, bad) = tokio::task::spawn_blocking(move || store.load_all())
            .await
            .map_err(|e| RecordError::Join { lease: "*".into(), message: e.to_string() })??;
        for b in bad {
            tracing::error!(edge = %self.name, member = %b.lease_id, error = %b.error, "unreadable pool member record removed");
            let store = self.member_store.clone();
            let _ = tokio::task::spawn_blocking(move || store.remove(&b.lease_id)).await;
        }
        let mut out = Vec::new();
        for r in records {
            if named.contains(&r.id) {
                self.forget_member(&r).await;
            } else {
                out.push(r);
            }
        }
        Ok(out)
    }

    /// Adopts the members that were running before the restart as idle members of their
    /// pool and revision (the next refresh from IAM replaces them if the template changed);
    /// the rest are stopped. Returns the ids kept.
    pub(crate) async fn recover_members(&self, members: Vec<SandboxRecord>) -> Vec<String> {
        let mut kept = Vec::new();
        for rec in members {
            let backend = self.warm_backend(&rec.spec.backend).cloned();
            let adopted = match (&backend, rec.state) {
                (Some(b), SandboxStatus::Running) => b.adopt(&rec).await.map_err(|e| e.report()),
                (Some(_), s) => Err(format!("left {s}")),
                (None, _) => Err("backend no longer offered".into()),
            };
            match adopted {
                Ok(()) => {
                    let mut g = self.pools();
                    let Pools { entries, records, used, recharge, .. } = &mut *g;
                    let e = entries.entry(rec.pool.clone()).or_insert_with(|| Entry::new(&rec.pool_revision, 0));
                    e.members.starting(&rec.id, &rec.pool_revision);
                    e.members.started(&rec.id);
                    used.add(rec.resources());
                    kept.push(rec.id.clone());
                    // Charged again before it is reported live: a member of a release that
                    // charged none, or whose charge went while the edge was down (the watcher
                    // gives a lost edge's leases back), is charged now or retired. (A lease
                    // IAM still holds is kept by the charge, or released by a reconciliation
                    // meanwhile and charged anew.)
                    if self.remote.has_iam() {
                        recharge.push((rec.id.clone(), rec.lease_id.clone(), rec.pool.clone()));
                    }
                    records.insert(rec.id.clone(), Arc::new(rec));
                }
                Err(why) => {
                    tracing::info!(member = %rec.id, why = %why, "pool member not kept after the restart");
                    if let Some(b) = &backend {
                        let _ = b.stop(&rec).await;
                    }
                    self.forget_member(&rec).await;
                }
            }
        }
        kept
    }

    /// Charges again the members queued for it (found at a restart, or one whose charge a
    /// claim moved while the creation did not take it), reporting each live only once IAM
    /// holds its charge. IAM refusing (over the quota, its pool gone) retires the member: it
    /// is stopped next round. Anything else (IAM unreachable, or refusing a log entry while an
    /// upgrade is under way), and members still starting: tried again next round. A member
    /// claimed or stopped while its charge was on the way has it released.
    pub(crate) async fn recharge_members(&self) {
        let todo = std::mem::take(&mut self.pools().recharge);
        if todo.is_empty() {
            return;
        }
        // Members handed out meanwhile give their charges back first: at a full quota, the
        // member charged again takes the room of the one claimed.
        let _ = self.flush_releases().await;
        let mut again = Vec::new();
        let mut todo = todo.into_iter();
        for (id, lease, key) in todo.by_ref() {
            let found = {
                let g = self.pools();
                match g.records.get(&id) {
                    Some(r) => Some(r.clone()),
                    None if g.entries.get(&key).and_then(|e| e.members.state_of(&id)).is_some() => None,
                    // Gone (claimed, stopped): its lease went with it.
                    None => continue,
                }
            };
            // Still starting: its turn comes once it is idle.
            let Some(rec) = found else {
                again.push((id, lease, key));
                continue;
            };
            let (project, name) = rec.pool.rsplit_once('/').unwrap_or(("", ""));
            let res = rec.resources().to_proto();
            match self.remote.admit_member(&rec.lease_id, project, name, res).await {
                Ok(()) => {
                    let mut g = self.pools();
                    if g.records.contains_key(&id) {
                        g.charged.insert(id, member_live(&rec, project, name, res));
                    } else {
                        drop(g);
                        self.releases.push(lease);
                    }
                }
                Err(e)
                    if matches!(
                        e.reason,
                        Reason::QuotaExceeded
                            | Reason::NotFound
                            | Reason::InvalidArgument
                            | Reason::AlreadyExists
                            | Reason::PermissionDenied
                    ) =>
                {
                    tracing::info!(member = %id, reason = %e.reason, error = %e.message, "a pool member is not charged; retiring it");
                    if let Some(en) = self.pools().entries.get_mut(&key) {
                        en.members.retire(&id);
                    }
                }
                // IAM unreachable (or refusing while an upgrade is under way): the rest wait
                // for the next round too, rather than each wait out its own timeout.
                Err(_) => {
                    again.push((id, lease, key));
                    break;
                }
            }
        }
        again.extend(todo);
        self.pools().recharge.extend(again);
    }

    /// The members reported charged whose lease IAM does not hold here any more (a claim moved
    /// its charge while the member's own charge was on its way, a reconciliation or sweep gave
    /// it back while the edge was cut off): charged again, with the quota checked, or retired.
    /// One GetLeases call per round.
    pub(crate) async fn verify_charges(&self) {
        let charged: Vec<(String, String, String)> = {
            let g = self.pools();
            g.charged
                .iter()
                .map(|(id, l)| {
                    let key = l.pool.split_once("//").map(|(p, n)| pool_key(p, n)).unwrap_or_default();
                    (id.clone(), l.lease_id.clone(), key)
                })
                .collect()
        };
        if charged.is_empty() {
            return;
        }
        let leases: Vec<String> = charged.iter().map(|(_, l, _)| l.clone()).collect();
        let Ok(bindings) = self.remote.lease_bindings(&leases).await else { return };
        let mut g = self.pools();
        for ((id, lease, key), b) in charged.into_iter().zip(bindings) {
            if b != crate::remote::LeaseBinding::Here && g.charged.get(&id).is_some_and(|l| l.lease_id == lease) {
                tracing::info!(member = %id, binding = ?b, "a pool member's charge is not IAM's here; charging it again");
                g.charged.remove(&id);
                g.recharge.push((id, lease, key));
            }
        }
    }

    /// The pools as the watcher hears of them.
    pub(crate) fn pool_status(&self) -> Vec<PoolStatus> {
        let g = self.pools();
        g.entries
            .values()
            .filter_map(|e| {
                let p = e.pool.as_ref()?;
                let stale = e.members.stale();
                let mut refills: Vec<Duration> = e.refills.iter().copied().collect();
                refills.sort();
                Some(PoolStatus {
                    project: p.project.clone(),
                    name: p.name.clone(),
                    revision: e.members.revision().to_string(),
                    // What this edge keeps: the pool's size, or its tenant's fair part of the
                    // edge's pool share when tenants together ask for more.
                    target: e.members.target(),
                    idle: e.members.idle() as u32,
                    starting: e.members.count(MemberState::Starting) as u32,
                    stale: stale as u32,
                    claims: e.members.claims,
                    misses: e.members.misses,
                    refill_p50_ms: refills.get(refills.len() / 2).map_or(0, |d| d.as_millis() as u64),
                    oldest_stale_ms: e.stale_since.filter(|_| stale > 0).map_or(0, |t| t.elapsed().as_millis() as u64),
                    edge: self.name.clone(),
                })
            })
            .collect()
    }
}

/// Refreshes the pools from IAM every `edge.pool_refresh` and runs a round after each refresh,
/// each claim and each finished start or stop.
pub(crate) async fn pool_loop(inner: Arc<Inner>, mut shutdown: watch::Receiver<bool>) {
    if !inner.backends.iter().any(|b| b.warm().is_some()) {
        return;
    }
    let mut last_refresh: Option<Instant> = None;
    loop {
        if *shutdown.borrow() {
            return;
        }
        if inner.remote.has_iam() && last_refresh.is_none_or(|t| t.elapsed() >= inner.cfg.pool_refresh) {
            match inner.remote.all_pools().await {
                Ok(pools) => {
                    inner.apply_pools(&pools);
                    last_refresh = Some(Instant::now());
                }
                Err(e) => {
                    tracing::warn!(edge = %inner.name, reason = %e.reason, error = %e.message, "reading the warm pools from IAM failed");
                    last_refresh = Some(Instant::now());
                }
            }
        }
        if inner.remote.has_iam() {
            inner.verify_charges().await;
            inner.recharge_members().await;
        }
        inner.pool_round();
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tokio::time::sleep(inner.cfg.pool_refresh) => {}
            _ = inner.pool_wake.notified() => {}
        }
    }
}
