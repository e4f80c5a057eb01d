//! Placement: which edge gets a new sandbox (reference section 2).
//!
//! Pure functions over plain data: no I/O, no clock, the random source passed in. Two steps:
//!
//! 1. filter: the edge offers the backend, is healthy, not draining, under no memory/disk/CPU
//!    pressure, and has the allocatable room (cpu, memory, disk, gpus, sandbox count) for the
//!    demand once this apiserver's in-flight overlay is added to what the snapshot says;
//! 2. power-of-k: draw k distinct candidates uniformly among those that pass, take the least
//!    loaded.
//!
//! Invariants kept here:
//! - a chosen edge always fits (the filter runs on snapshot + overlay + demand);
//! - edges penalized for a recent refusal are chosen only when no unpenalized edge fits (they
//!   are a last choice, never excluded: when every node restarts, trying one beats failing);
//! - edges already tried for this creation are never chosen again;
//! - `not_found` means no edge offers the backend at all; `no_capacity` means some do but none
//!   fits, and says how many edges were skipped for which reason.
//!
//! [`Inflight`] keeps the overlay: each placed demand counts on its edge until a snapshot taken
//! after the creation completed arrives (or at once stops counting when the creation failed), so
//! placements between two snapshots spread out instead of piling onto the same edge.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::time::Instant;

use opendsec_common::{ApiError, Reason};
use opendsec_proto::v1 as pb;
use rand::{Rng, RngExt};

/// Resources in the units of the API (CPU millicores, MiB), widened to u64.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Res {
    pub cpu_millis: u64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub gpus: u64,
}

impl Res {
    pub fn from_proto(r: Option<&pb::Resources>) -> Res {
        r.map(|r| Res {
            cpu_millis: u64::from(r.cpu_millis),
            memory_mb: r.memory_mb,
            disk_mb: r.disk_mb,
            gpus: u64::from(r.gpus),
        })
        .unwrap_or_default()
    }

    pub fn saturating_add(self, o: Res) -> Res {
        Res {
            cpu_millis: self.cpu_millis.saturating_add(o.cpu_millis),
            memory_mb: self.memory_mb.saturating_add(o.memory_mb),
            disk_mb: self.disk_mb.saturating_add(o.disk_mb),
            gpus: self.gpus.saturating_add(o.gpus),
        }
    }

    /// `n` of these.
    pub fn times(self, n: u64) -> Res {
        Res {
            cpu_millis: self.cpu_millis.saturating_mul(n),
            memory_mb: self.memory_mb.saturating_mul(n),
            disk_mb: self.disk_mb.saturating_mul(n),
            gpus: self.gpus.saturating_mul(n),
        }
    }

    pub fn saturating_sub(self, o: Res) -> Res {
        Res {
            cpu_millis: self.cpu_millis.saturating_sub(o.cpu_millis),
            memory_mb: self.memory_mb.saturating_sub(o.memory_mb),
            disk_mb: self.disk_mb.saturating_sub(o.disk_mb),
            gpus: self.gpus.saturating_sub(o.gpus),
        }
    }
}

/// What placement needs to know about one edge (from the watcher snapshot).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct EdgeView {
    pub name: String,
    pub healthy: bool,
    pub draining: bool,
    pub backends: Vec<String>,
    pub capacity: Res,
    pub allocated: Res,
    pub sandboxes: u32,
    pub max_sandboxes: u32,
    /// Actual use as a share of the node, 0..1.
    pub cpu_use: f64,
    pub memory_use: f64,
    pub memory_pressure: bool,
    pub disk_pressure: bool,
    pub cpu_pressure: bool,
    /// The warm pools the edge keeps members of.
    pub pools: Vec<pb::PoolStatus>,
}

impl EdgeView {
    /// The view of a snapshot entry. An edge never probed successfully has an empty status, so
    /// it offers nothing and never fits.
    pub fn from_info(info: &pb::EdgeInfo) -> EdgeView {
        let st = info.status.clone().unwrap_or_default();
        let pressure = st.pressure.unwrap_or_default();
        EdgeView {
            name: info.name.clone(),
            healthy: info.healthy,
            draining: st.draining,
            backends: st.backends,
            capacity: Res::from_proto(st.capacity.as_ref()),
            allocated: Res::from_proto(st.allocated.as_ref()),
            sandboxes: st.sandboxes,
            max_sandboxes: st.max_sandboxes,
            cpu_use: st.cpu_use,
            memory_use: st.memory_use,
            memory_pressure: pressure.memory,
            disk_pressure: pressure.disk,
            cpu_pressure: pressure.cpu,
            pools: st.pools,
        }
    }

    pub fn offers(&self, backend: &str) -> bool {
        self.backends.iter().any(|b| b == backend)
    }
}

/// What this apiserver has placed on an edge that the snapshot does not show yet.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Extra {
    pub resources: Res,
    pub sandboxes: u32,
}

/// One sandbox to place.
#[derive(Clone, Copy, Debug)]
pub struct Demand<'a> {
    pub backend: &'a str,
    pub resources: Res,
    /// An edge to take when it fits and is not penalized (fork copies: the source's edge,
    /// which holds the snapshot's layers in its cache already).
    pub prefer: Option<&'a str>,
    /// `prefer` holds an idle warm pool member for this creation: its room is in the edge's
    /// allocation already and a claim adds no load, so the edge is taken whatever its fit
    /// (healthy, not draining, not tried or penalized; the edge has the last word).
    pub warm: bool,
}

#[derive(Clone, Copy, Debug)]
pub struct Params {
    /// Candidates drawn for power-of-k (at least 1).
    pub k: usize,
    /// Actual use below this share does not count towards load.
    pub usage_floor: f64,
}

/// Why an edge that offers the backend was not a candidate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Skip {
    Unhealthy,
    Draining,
    /// Already tried (and refused) for this creation.
    Tried,
    MemoryPressure,
    DiskPressure,
    CpuPressure,
    Cpu,
    Memory,
    Disk,
    Gpus,
    Sandboxes,
}

impl Skip {
    pub const ALL: [Skip; 11] = [
        Skip::Unhealthy,
        Skip::Draining,
        Skip::Tried,
        Skip::MemoryPressure,
        Skip::DiskPressure,
        Skip::CpuPressure,
        Skip::Cpu,
        Skip::Memory,
        Skip::Disk,
        Skip::Gpus,
        Skip::Sandboxes,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Skip::Unhealthy => "unhealthy",
            Skip::Draining => "draining",
            Skip::Tried => "tried",
            Skip::MemoryPressure => "memory_pressure",
            Skip::DiskPressure => "disk_pressure",
            Skip::CpuPressure => "cpu_pressure",
            Skip::Cpu => "cpu",
            Skip::Memory => "memory",
            Skip::Disk => "disk",
            Skip::Gpus => "gpus",
            Skip::Sandboxes => "sandboxes",
        }
    }
}

/// How many edges were skipped for each reason (each edge counted once, for the first reason
/// found in [`Skip::ALL`] order).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SkipCounts([u32; Skip::ALL.len()]);

impl SkipCounts {
    pub fn add(&mut self, s: Skip) {
        self.0[s as usize] += 1;
    }

    pub fn get(&self, s: Skip) -> u32 {
        self.0[s as usize]
    }

    pub fn total(&self) -> u32 {
        self.0.iter().sum()
    }

    /// The non-zero counts, in [`Skip::ALL`] order.
    pub fn nonzero(&self) -> impl Iterator<Item = (Skip, u32)> + '_ {
        Skip::ALL.into_iter().map(|s| (s, self.get(s))).filter(|(_, n)| *n > 0)
    }
}

impl fmt::Display for SkipCounts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut first = true;
        for (s, n) in self.nonzero() {
            if !first {
                f.write_str(", ")?;
            }
            first = false;
            write!(f, "{} {n}", s.as_str())?;
        }
        if first {
            f.write_str("none")?;
        }
        Ok(())
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PlacementError {
    #[error("no edge offers backend {backend:?}")]
    NoEdgeOffers { backend: String },
    #[error("no edge offering backend {backend:?} can take the sandbox ({offering} offer it; skipped: {skipped})")]
    NoCapacity { backend: String, offering: u32, skipped: SkipCounts },
}

impl From<&PlacementError> for ApiError {
    fn from(e: &PlacementError) -> ApiError {
        match e {
            PlacementError::NoEdgeOffers { backend } => {
                ApiError::new(Reason::NotFound, e.to_string()).with("backend", backend.clone())
            }
            PlacementError::NoCapacity { backend, offering, skipped } => {
                let mut err = ApiError::new(Reason::NoCapacity, e.to_string())
                    .with("backend", backend.clone())
                    .with("edges_offering", offering.to_string());
                for (s, n) in skipped.nonzero() {
                    err = err.with(&format!("skipped_{}", s.as_str()), n.to_string());
                }
                err
            }
        }
    }
}

/// Why `edge` cannot take `demand` on top of `extra`, or `None` when it fits. Does not look at
/// the backend (the caller counts edges offering it separately) nor at tries and penalties.
pub fn skip_reason(edge: &EdgeView, extra: Extra, demand: &Demand<'_>) -> Option<Skip> {
    if !edge.healthy {
        return Some(Skip::Unhealthy);
    }
    if edge.draining {
        return Some(Skip::Draining);
    }
    if edge.memory_pressure {
        return Some(Skip::MemoryPressure);
    }
    if edge.disk_pressure {
        return Some(Skip::DiskPressure);
    }
    if edge.cpu_pressure {
        return Some(Skip::CpuPressure);
    }
    let used = edge.allocated.saturating_add(extra.resources);
    let free = edge.capacity.saturating_sub(used);
    let d = demand.resources;
    if d.cpu_millis > free.cpu_millis {
        return Some(Skip::Cpu);
    }
    if d.memory_mb > free.memory_mb {
        return Some(Skip::Memory);
    }
    if d.disk_mb > free.disk_mb {
        return Some(Skip::Disk);
    }
    if d.gpus > free.gpus {
        return Some(Skip::Gpus);
    }
    let count = u64::from(edge.sandboxes) + u64::from(extra.sandboxes);
    if count + 1 > u64::from(edge.max_sandboxes) {
        return Some(Skip::Sandboxes);
    }
    None
}

/// Load of an edge in 0..=1 (more when over-committed): the highest of its allocated share
/// (allocation plus overlay over capacity, in every dimension including the sandbox count) and
/// its actual CPU and memory use, each use counted only from `usage_floor` up.
pub fn load(edge: &EdgeView, extra: Extra, usage_floor: f64) -> f64 {
    fn share(used: u64, cap: u64) -> f64 {
        if cap == 0 { 0.0 } else { used as f64 / cap as f64 }
    }
    let used = edge.allocated.saturating_add(extra.resources);
    let count = u64::from(edge.sandboxes) + u64::from(extra.sandboxes);
    let allocated = share(used.cpu_millis, edge.capacity.cpu_millis)
        .max(share(used.memory_mb, edge.capacity.memory_mb))
        .max(share(used.disk_mb, edge.capacity.disk_mb))
        .max(share(used.gpus, edge.capacity.gpus))
        .max(share(count, u64::from(edge.max_sandboxes)));
    let floor = |u: f64| if u.is_finite() && u >= usage_floor { u } else { 0.0 };
    allocated.max(floor(edge.cpu_use)).max(floor(edge.memory_use))
}

/// Picks an edge for `demand` (see the module docs). Returns the index into `edges`.
pub fn place<R: Rng + ?Sized>(
    edges: &[EdgeView],
    overlay: &HashMap<String, Extra>,
    penalized: &HashSet<String>,
    tried: &HashSet<String>,
    demand: &Demand<'_>,
    params: &Params,
    rng: &mut R,
) -> Result<usize, PlacementError> {
    if let (true, Some(p)) = (demand.warm, demand.prefer)
        && let Some(i) = edges.iter().position(|e| {
            e.name == p
                && e.healthy
                && !e.draining
                && e.offers(demand.backend)
                && !tried.contains(&e.name)
                && !penalized.contains(&e.name)
        })
    {
        return Ok(i);
    }
    // A preferred edge (a batch's run, a fork's source) is taken when it fits, as the full
    // pass below would take it, without the pass.
    if let Some(p) = demand.prefer
        && !demand.warm
        && !tried.contains(p)
        && !penalized.contains(p)
        && let Some(i) = edges.iter().position(|e| e.name == p)
        && edges[i].offers(demand.backend)
        && skip_reason(&edges[i], overlay.get(p).copied().unwrap_or_default(), demand).is_none()
    {
        return Ok(i);
    }
    if let Some(i) = sampled(edges, overlay, penalized, tried, demand, params, rng) {
        return Ok(i);
    }
    let mut offering = 0u32;
    let mut skipped = SkipCounts::default();
    let mut fit = Vec::new();
    let mut fit_penalized = Vec::new();
    for (i, e) in edges.iter().enumerate() {
        if !e.offers(demand.backend) {
            continue;
        }
        offering += 1;
        if tried.contains(&e.name) {
            skipped.add(Skip::Tried);
            continue;
        }
        let extra = overlay.get(&e.name).copied().unwrap_or_default();
        if let Some(s) = skip_reason(e, extra, demand) {
            skipped.add(s);
            continue;
        }
        if penalized.contains(&e.name) {
            fit_penalized.push(i);
        } else {
            fit.push(i);
        }
    }
    if offering == 0 {
        return Err(PlacementError::NoEdgeOffers { backend: demand.backend.to_string() });
    }
    if let Some(p) = demand.prefer
        && let Some(&i) = fit.iter().find(|&&i| edges[i].name == p)
    {
        return Ok(i);
    }
    let mut pool = if fit.is_empty() { fit_penalized } else { fit };
    if pool.is_empty() {
        return Err(PlacementError::NoCapacity { backend: demand.backend.to_string(), offering, skipped });
    }
    // Partial Fisher-Yates: the first k slots become k distinct uniform draws.
    let k = params.k.clamp(1, pool.len());
    for j in 0..k {
        let r = rng.random_range(j..pool.len());
        pool.swap(j, r);
    }
    Ok(least_loaded(edges, overlay, &pool[..k], params.usage_floor))
}

/// Of the drawn candidates (at least one), the least loaded; the first drawn on a tie.
fn least_loaded(edges: &[EdgeView], overlay: &HashMap<String, Extra>, drawn: &[usize], usage_floor: f64) -> usize {
    let load_of = |i: usize| load(&edges[i], overlay.get(&edges[i].name).copied().unwrap_or_default(), usage_floor);
    let mut best = (drawn[0], load_of(drawn[0]));
    for &i in &drawn[1..] {
        let l = load_of(i);
        if l < best.1 {
            best = (i, l);
        }
    }
    best.0
}

/// Draws per decision [`sampled`] makes, for each of the `k` candidates.
const DRAWS_PER_CANDIDATE: usize = 8;

/// [`place`] without a pass over every edge, for the common case: `k` distinct edges drawn
/// uniformly from all of them, each kept only if it offers the backend, fits and is neither
/// tried nor penalized, which draws uniformly among the edges that qualify, as the full pass
/// does. `None` when the draws did not find `k` (a cluster nearly full, or mostly of edges
/// that do not offer the backend): the full pass then decides, and explains a refusal. At
/// 1,000 edges it is what makes a decision 0.2 µs instead of 34 µs (`make bench-scale`).
fn sampled<R: Rng + ?Sized>(
    edges: &[EdgeView],
    overlay: &HashMap<String, Extra>,
    penalized: &HashSet<String>,
    tried: &HashSet<String>,
    demand: &Demand<'_>,
    params: &Params,
    rng: &mut R,
) -> Option<usize> {
    let k = params.k.max(1);
    if edges.len() < k {
        return None;
    }
    let extra = |e: &EdgeView| overlay.get(&e.name).copied().unwrap_or_default();
    let mut picked: Vec<usize> = Vec::with_capacity(k);
    for _ in 0..k * DRAWS_PER_CANDIDATE {
        let i = rng.random_range(0..edges.len());
        let e = &edges[i];
        if picked.contains(&i)
            || !e.offers(demand.backend)
            || tried.contains(&e.name)
            || penalized.contains(&e.name)
            || skip_reason(e, extra(e), demand).is_some()
        {
            continue;
        }
        picked.push(i);
        if picked.len() == k {
            return Some(least_loaded(edges, overlay, &picked, params.usage_floor));
        }
    }
    None
}

/// The in-flight overlay: demands placed by this apiserver that the snapshot may not show yet.
#[derive(Debug, Default)]
pub struct Inflight {
    next_id: u64,
    entries: HashMap<u64, Entry>,
    totals: HashMap<String, Extra>,
}

#[derive(Debug)]
struct Entry {
    edge: String,
    resources: Res,
    completed_at_ms: Option<i64>,
}

impl Inflight {
    /// Counts `resources` (and one sandbox) on `edge`; the id ends the entry later.
    pub fn add(&mut self, edge: &str, resources: Res) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        self.entries.insert(id, Entry { edge: edge.to_string(), resources, completed_at_ms: None });
        let t = self.totals.entry(edge.to_string()).or_default();
        t.resources = t.resources.saturating_add(resources);
        t.sandboxes = t.sandboxes.saturating_add(1);
        id
    }

    /// The creation succeeded at `now_ms`: the entry stays until a snapshot taken later.
    pub fn complete(&mut self, id: u64, now_ms: i64) {
        if let Some(e) = self.entries.get_mut(&id) {
            e.completed_at_ms = Some(now_ms);
        }
    }

    /// The creation failed: nothing was allocated, the entry goes now.
    pub fn fail(&mut self, id: u64) {
        self.remove(id);
    }

    /// A snapshot taken at `taken_at_ms` arrived: entries of creations completed before it are
    /// in it. Entries completed more than `max_age_ms` ago go too, so that a watcher clock far
    /// behind ours cannot pin capacity forever.
    pub fn on_snapshot(&mut self, taken_at_ms: i64, now_ms: i64, max_age_ms: i64) {
        let done: Vec<u64> = self
            .entries
            .iter()
            .filter(|(_, e)| {
                e.completed_at_ms.is_some_and(|c| c < taken_at_ms || now_ms.saturating_sub(c) > max_age_ms)
            })
            .map(|(id, _)| *id)
            .collect();
        for id in done {
            self.remove(id);
        }
    }

    pub fn totals(&self) -> &HashMap<String, Extra> {
        &self.totals
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn remove(&mut self, id: u64) {
        let Some(e) = self.entries.remove(&id) else { return };
        if let Some(t) = self.totals.get_mut(&e.edge) {
            t.resources = t.resources.saturating_sub(e.resources);
            t.sandboxes = t.sandboxes.saturating_sub(1);
            if t.sandboxes == 0 {
                self.totals.remove(&e.edge);
            }
        }
    }
}

/// Edges that refused a creation recently, and until when they stay a last choice.
#[derive(Debug, Default)]
pub struct Penalties {
    until: HashMap<String, Instant>,
}

impl Penalties {
    pub fn penalize(&mut self, edge: &str, until: Instant) {
        self.until.insert(edge.to_string(), until);
    }

    /// The edges penalized at `now` (expired penalties are dropped).
    pub fn active(&mut self, now: Instant) -> HashSet<String> {
        self.until.retain(|_, u| *u > now);
        self.until.keys().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;
    use std::time::Duration;

    fn edge(name: &str) -> EdgeView {
        EdgeView {
            name: name.into(),
            healthy: true,
            backends: vec!["sim".into()],
            capacity: Res { cpu_millis: 64_000, memory_mb: 512 * 1024, disk_mb: 4 << 20, gpus: 0 },
            max_sandboxes: 3200,
            ..EdgeView::default()
        }
    }

    fn demand(cpu: u64, mem: u64) -> Demand<'static> {
        Demand {
            backend: "sim",
            resources: Res { cpu_millis: cpu, memory_mb: mem, disk_mb: 0, gpus: 0 },
            prefer: None,
            warm: false,
        }
    }

    const PARAMS: Params = Params { k: 2, usage_floor: 0.2 };

    fn place_simple(edges: &[EdgeView], d: &Demand<'_>) -> Result<usize, PlacementError> {
        let mut rng = StdRng::seed_from_u64(7);
        place(edges, &HashMap::new(), &HashSet::new(), &HashSet::new(), d, &PARAMS, &mut rng)
    }

    #[test]
    fn unknown_backend_is_not_found_and_full_edges_are_no_capacity() {
        let edges = vec![edge("a"), edge("b")];
        let d = Demand { backend: "microvm", resources: Res::default(), prefer: None, warm: false };
        let err = place_simple(&edges, &d).unwrap_err();
        assert_eq!(err, PlacementError::NoEdgeOffers { backend: "microvm".into() });
        assert_eq!(ApiError::from(&err).reason, Reason::NotFound);
        assert!(err.to_string().contains("no edge offers backend \"microvm\""));

        let mut full = edge("a");
        full.allocated.cpu_millis = 64_000;
        let mut sick = edge("b");
        sick.healthy = false;
        let mut pressed = edge("c");
        pressed.memory_pressure = true;
        let err = place_simple(&[full, sick, pressed], &demand(1000, 1)).unwrap_err();
        let api = ApiError::from(&err);
        assert_eq!(api.reason, Reason::NoCapacity);
        assert_eq!(api.metadata.get("skipped_cpu").map(String::as_str), Some("1"));
        assert_eq!(api.metadata.get("skipped_unhealthy").map(String::as_str), Some("1"));
        assert_eq!(api.metadata.get("skipped_memory_pressure").map(String::as_str), Some("1"));
        assert!(api.message.contains("cpu 1"), "{}", api.message);
    }

    #[test]
    fn a_preferred_edge_is_taken_when_it_fits_and_only_then() {
        let mut busy = edge("src");
        busy.allocated.cpu_millis = 60_000;
        let edges = vec![edge("a"), busy.clone(), edge("b")];
        let d = Demand { prefer: Some("src"), ..demand(1000, 1) };
        // Loaded as it is, it still fits: taken over the idle ones (power-of-k alone would not).
        for seed in 0..20 {
            let mut rng = StdRng::seed_from_u64(seed);
            let i = place(&edges, &HashMap::new(), &HashSet::new(), &HashSet::new(), &d, &PARAMS, &mut rng).unwrap();
            assert_eq!(edges[i].name, "src");
        }
        // Full, penalized or already tried: placement as usual, elsewhere.
        busy.allocated.cpu_millis = 64_000;
        let full = vec![edge("a"), busy, edge("b")];
        assert_ne!(full[place_simple(&full, &d).unwrap()].name, "src");
        let mut rng = StdRng::seed_from_u64(1);
        let penalized: HashSet<String> = ["src".to_string()].into();
        let i = place(&edges, &HashMap::new(), &penalized, &HashSet::new(), &d, &PARAMS, &mut rng).unwrap();
        assert_ne!(edges[i].name, "src");
        let i = place(&edges, &HashMap::new(), &HashSet::new(), &penalized, &d, &PARAMS, &mut rng).unwrap();
        assert_ne!(edges[i].name, "src");
    }

    #[test]
    fn a_warm_edge_is_taken_full_as_it_is_and_only_when_usable() {
        // Its idle member's room is in its allocation: "full" for a new sandbox, not for a claim.
        let mut warm = edge("warm");
        warm.allocated.cpu_millis = 64_000;
        let edges = vec![edge("a"), warm.clone(), edge("b")];
        let d = Demand { prefer: Some("warm"), warm: true, ..demand(1000, 1) };
        assert_eq!(edges[place_simple(&edges, &d).unwrap()].name, "warm");
        let cold = Demand { warm: false, ..d };
        assert_ne!(edges[place_simple(&edges, &cold).unwrap()].name, "warm");
        for broken in [|e: &mut EdgeView| e.healthy = false, |e: &mut EdgeView| e.draining = true] {
            let mut w = warm.clone();
            broken(&mut w);
            let edges = vec![edge("a"), w];
            assert_ne!(edges[place_simple(&edges, &d).unwrap()].name, "warm");
        }
        let tried: HashSet<String> = ["warm".to_string()].into();
        let mut rng = StdRng::seed_from_u64(3);
        let i = place(&edges, &HashMap::new(), &HashSet::new(), &tried, &d, &PARAMS, &mut rng).unwrap();
        assert_ne!(edges[i].name, "warm");
    }

    type Mutation = Box<dyn Fn(&mut EdgeView)>;

    #[test]
    fn every_filter_reason_is_counted() {
        let base = edge("x");
        let cases: Vec<(Mutation, Skip)> = vec![
            (Box::new(|e| e.healthy = false), Skip::Unhealthy),
            (Box::new(|e| e.draining = true), Skip::Draining),
            (Box::new(|e| e.disk_pressure = true), Skip::DiskPressure),
            (Box::new(|e| e.cpu_pressure = true), Skip::CpuPressure),
            (Box::new(|e| e.allocated.memory_mb = e.capacity.memory_mb), Skip::Memory),
            (Box::new(|e| e.allocated.disk_mb = e.capacity.disk_mb), Skip::Disk),
            (Box::new(|e| e.sandboxes = e.max_sandboxes), Skip::Sandboxes),
        ];
        for (mutate, want) in cases {
            let mut e = base.clone();
            mutate(&mut e);
            let d = Demand {
                backend: "sim",
                resources: Res { cpu_millis: 1, memory_mb: 1, disk_mb: 1, gpus: 0 },
                prefer: None,
                warm: false,
            };
            assert_eq!(skip_reason(&e, Extra::default(), &d), Some(want));
        }
        let gpu = Demand { backend: "sim", resources: Res { gpus: 1, ..Res::default() }, prefer: None, warm: false };
        assert_eq!(skip_reason(&base, Extra::default(), &gpu), Some(Skip::Gpus));
    }

    #[test]
    fn overlay_counts_against_capacity() {
        let e = edge("a");
        let extra = Extra { resources: Res { cpu_millis: 63_500, ..Res::default() }, sandboxes: 1 };
        assert_eq!(skip_reason(&e, extra, &demand(1000, 1)), Some(Skip::Cpu));
        assert_eq!(skip_reason(&e, extra, &demand(500, 1)), None);
    }

    #[test]
    fn load_ignores_use_below_the_floor() {
        let mut e = edge("a");
        e.allocated.cpu_millis = 6400; // 10 %
        e.cpu_use = 0.15;
        assert!((load(&e, Extra::default(), 0.2) - 0.1).abs() < 1e-9);
        e.memory_use = 0.5;
        assert!((load(&e, Extra::default(), 0.2) - 0.5).abs() < 1e-9);
    }

    #[test]
    fn least_loaded_of_two_wins() {
        let mut a = edge("a");
        a.allocated.cpu_millis = 32_000;
        let b = edge("b");
        for seed in 0..20 {
            let mut rng = StdRng::seed_from_u64(seed);
            let got = place(
                &[a.clone(), b.clone()],
                &HashMap::new(),
                &HashSet::new(),
                &HashSet::new(),
                &demand(1, 1),
                &PARAMS,
                &mut rng,
            )
            .unwrap();
            assert_eq!(got, 1);
        }
    }

    #[test]
    fn tried_edges_are_never_chosen_again() {
        let edges = vec![edge("a"), edge("b")];
        let tried: HashSet<String> = ["a".to_string(), "b".to_string()].into();
        let mut rng = StdRng::seed_from_u64(1);
        let err =
            place(&edges, &HashMap::new(), &HashSet::new(), &tried, &demand(1, 1), &PARAMS, &mut rng).unwrap_err();
        match err {
            PlacementError::NoCapacity { skipped, offering, .. } => {
                assert_eq!(offering, 2);
                assert_eq!(skipped.get(Skip::Tried), 2);
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn inflight_entries_leave_with_a_later_snapshot_or_on_failure() {
        let mut inf = Inflight::default();
        let r = Res { cpu_millis: 100, ..Res::default() };
        let a = inf.add("e1", r);
        let b = inf.add("e1", r);
        assert_eq!(inf.totals()["e1"], Extra { resources: Res { cpu_millis: 200, ..Res::default() }, sandboxes: 2 });
        inf.fail(a);
        assert_eq!(inf.totals()["e1"].sandboxes, 1);
        inf.complete(b, 1_000);
        inf.on_snapshot(900, 1_001, 60_000); // taken before the creation completed: kept
        assert_eq!(inf.len(), 1);
        inf.on_snapshot(1_001, 1_002, 60_000);
        assert!(inf.is_empty());
        assert!(inf.totals().is_empty());
        let c = inf.add("e2", r);
        inf.on_snapshot(5_000, 5_000, 60_000); // not completed yet: kept whatever the snapshot
        assert_eq!(inf.len(), 1);
        inf.complete(c, 5_001);
        inf.on_snapshot(0, 70_000, 60_000); // a watcher clock far behind: aged out
        assert!(inf.is_empty());
    }

    #[test]
    fn penalties_expire() {
        let now = Instant::now();
        let mut p = Penalties::default();
        p.penalize("a", now + Duration::from_secs(10));
        assert!(p.active(now).contains("a"));
        assert!(p.active(now + Duration::from_secs(11)).is_empty());
    }

    fn arb_edge(i: usize) -> impl Strategy<Value = EdgeView> {
        (
            any::<bool>(),
            prop::bool::weighted(0.1),
            prop::sample::subsequence(vec!["sim", "container", "microvm"], 0..=3),
            (1u64..100_000, 1u64..100_000, 1u64..100_000, 0u64..8),
            (0u64..100_000, 0u64..100_000, 0u64..100_000, 0u64..8),
            (0u32..50, 0u32..50),
            (0.0f64..1.0, 0.0f64..1.0),
            (prop::bool::weighted(0.1), prop::bool::weighted(0.1), prop::bool::weighted(0.1)),
        )
            .prop_map(move |(healthy, draining, backends, cap, alloc, (n, max), (cu, mu), (mp, dp, cp))| {
                EdgeView {
                    name: format!("e{i}"),
                    healthy,
                    draining,
                    backends: backends.into_iter().map(String::from).collect(),
                    capacity: Res { cpu_millis: cap.0, memory_mb: cap.1, disk_mb: cap.2, gpus: cap.3 },
                    allocated: Res { cpu_millis: alloc.0, memory_mb: alloc.1, disk_mb: alloc.2, gpus: alloc.3 },
                    sandboxes: n,
                    max_sandboxes: max,
                    cpu_use: cu,
                    memory_use: mu,
                    memory_pressure: mp,
                    disk_pressure: dp,
                    cpu_pressure: cp,
                    pools: Vec::new(),
                }
            })
    }

    fn arb_edges() -> impl Strategy<Value = Vec<EdgeView>> {
        (0usize..12).prop_flat_map(|n| (0..n).map(arb_edge).collect::<Vec<_>>())
    }

    /// Edges, overlay (cpu, sandboxes) per edge, penalized and tried flags per edge, demand,
    /// backend, rng seed.
    type Case = (Vec<EdgeView>, Vec<(u64, u32)>, Vec<bool>, Vec<bool>, Res, &'static str, u64);

    fn arb_case() -> impl Strategy<Value = Case> {
        arb_edges().prop_flat_map(|edges| {
            let n = edges.len();
            (
                Just(edges),
                prop::collection::vec((0u64..50_000, 0u32..5), n),
                prop::collection::vec(prop::bool::weighted(0.3), n),
                prop::collection::vec(prop::bool::weighted(0.2), n),
                (0u64..50_000, 0u64..50_000, 0u64..50_000, 0u64..3).prop_map(|(c, m, d, g)| Res {
                    cpu_millis: c,
                    memory_mb: m,
                    disk_mb: d,
                    gpus: g,
                }),
                prop::sample::select(vec!["sim", "container", "microvm", "fullvm"]),
                any::<u64>(),
            )
        })
    }

    /// Among many edges the decision draws instead of looking at each: it still takes only
    /// what qualifies, finds the one edge that fits among a thousand (the full pass, when the
    /// draws do not), never a penalized or tried edge while others fit, and spreads like the
    /// full pass (the less loaded of two uniform draws).
    #[test]
    fn many_edges_draw_only_what_qualifies_and_fall_back_to_the_full_pass() {
        let mut rng = StdRng::seed_from_u64(11);
        let mut edges: Vec<EdgeView> = (0..1000).map(|i| edge(&format!("e{i:03}"))).collect();
        let d = demand(10, 16);
        let none = HashSet::new();
        let overlay = HashMap::new();
        for e in edges.iter_mut() {
            e.allocated = e.capacity;
        }
        edges[777].allocated = Res::default();
        for _ in 0..50 {
            assert_eq!(place(&edges, &overlay, &none, &none, &d, &PARAMS, &mut rng).unwrap(), 777);
        }
        for e in edges.iter_mut() {
            e.allocated = Res::default();
        }
        let penalized: HashSet<String> = edges.iter().step_by(2).map(|e| e.name.clone()).collect();
        let tried: HashSet<String> = edges.iter().skip(1).step_by(4).map(|e| e.name.clone()).collect();
        let mut counts = vec![0u32; edges.len()];
        for _ in 0..20_000 {
            let i = place(&edges, &overlay, &penalized, &tried, &d, &PARAMS, &mut rng).unwrap();
            assert!(!penalized.contains(&edges[i].name) && !tried.contains(&edges[i].name), "{i}");
            counts[i] += 1;
        }
        // 250 edges qualify, 80 picks each on average: every one is picked, none by far most.
        let picked: Vec<u32> = counts.iter().copied().filter(|c| *c > 0).collect();
        assert_eq!(picked.len(), 250);
        assert!(*picked.iter().max().unwrap() < 200, "{picked:?}");
        // Loaded edges are the less likely pick of two: edges at 90 % get far fewer.
        for (i, e) in edges.iter_mut().enumerate() {
            if i % 8 == 3 {
                e.allocated = Res { cpu_millis: e.capacity.cpu_millis * 9 / 10, ..Res::default() };
            }
        }
        let mut loaded = 0;
        for _ in 0..20_000 {
            let i = place(&edges, &overlay, &penalized, &tried, &d, &PARAMS, &mut rng).unwrap();
            loaded += u32::from(i % 8 == 3);
        }
        // Half the qualifying edges are loaded: a loaded one wins only against another (1/4).
        assert!((4_000..6_000).contains(&loaded), "{loaded}");
    }

    proptest! {
        #[test]
        fn placement_picks_only_fitting_edges_and_classifies_failures(
            (edges, extras, pen, tried, res, backend, seed) in arb_case()
        ) {
            let overlay: HashMap<String, Extra> = edges.iter().zip(&extras)
                .map(|(e, (cpu, n))| (e.name.clone(), Extra { resources: Res { cpu_millis: *cpu, ..Res::default() }, sandboxes: *n }))
                .collect();
            let penalized: HashSet<String> = edges.iter().zip(&pen).filter(|(_, p)| **p).map(|(e, _)| e.name.clone()).collect();
            let tried: HashSet<String> = edges.iter().zip(&tried).filter(|(_, t)| **t).map(|(e, _)| e.name.clone()).collect();
            let d = Demand { backend, resources: res, prefer: None, warm: false };
            let mut rng = StdRng::seed_from_u64(seed);
            let got = place(&edges, &overlay, &penalized, &tried, &d, &PARAMS, &mut rng);

            // Brute force the same question independently.
            let fits = |e: &EdgeView| {
                let x = overlay[&e.name];
                e.offers(backend) && !tried.contains(&e.name) && e.healthy && !e.draining
                    && !e.memory_pressure && !e.disk_pressure && !e.cpu_pressure
                    // A dimension the sandbox does not ask for never blocks it, even on an
                    // edge already over-committed there.
                    && (res.cpu_millis == 0 || e.allocated.cpu_millis + x.resources.cpu_millis + res.cpu_millis <= e.capacity.cpu_millis)
                    && (res.memory_mb == 0 || e.allocated.memory_mb + res.memory_mb <= e.capacity.memory_mb)
                    && (res.disk_mb == 0 || e.allocated.disk_mb + res.disk_mb <= e.capacity.disk_mb)
                    && (res.gpus == 0 || e.allocated.gpus + res.gpus <= e.capacity.gpus)
                    && e.sandboxes + x.sandboxes < e.max_sandboxes
            };
            let any_offers = edges.iter().any(|e| e.offers(backend));
            let any_unpenalized_fits = edges.iter().any(|e| fits(e) && !penalized.contains(&e.name));
            match got {
                Ok(i) => {
                    let e = &edges[i];
                    prop_assert!(fits(e), "picked {e:?} which does not fit");
                    if penalized.contains(&e.name) {
                        prop_assert!(!any_unpenalized_fits, "picked penalized {} while an unpenalized edge fits", e.name);
                    }
                }
                Err(PlacementError::NoEdgeOffers { .. }) => prop_assert!(!any_offers),
                Err(PlacementError::NoCapacity { offering, skipped, .. }) => {
                    prop_assert!(any_offers);
                    prop_assert!(!edges.iter().any(fits));
                    prop_assert_eq!(skipped.total(), offering);
                }
            }
        }

        #[test]
        fn equal_edges_fill_evenly_through_the_overlay(n in 2usize..12, per_edge in 20usize..60, seed in any::<u64>()) {
            let edges: Vec<EdgeView> = (0..n).map(|i| edge(&format!("e{i}"))).collect();
            let mut inflight = Inflight::default();
            let mut rng = StdRng::seed_from_u64(seed);
            let d = demand(10, 16);
            let mut counts = vec![0usize; n];
            for _ in 0..n * per_edge {
                let i = place(&edges, inflight.totals(), &HashSet::new(), &HashSet::new(), &d, &PARAMS, &mut rng).unwrap();
                inflight.add(&edges[i].name, d.resources);
                counts[i] += 1;
            }
            let max = *counts.iter().max().unwrap() as f64;
            let min = *counts.iter().min().unwrap() as f64;
            // Two choices leave the emptiest edge well behind now and then: filling 11 edges
            // with 22 each, a minimum of 15 beside a maximum of 23 or 24 (a ratio above 1.5)
            // came up 5 times in 100,000 fills of an exact simulation, so a bound of 1.5 failed
            // about one run in a hundred. The worst of another 100,000 fills of 11 edges with
            // 20 each was 1.69.
            prop_assert!(min > 0.0 && max / min <= 2.0, "uneven: {counts:?}");
        }
    }
}
