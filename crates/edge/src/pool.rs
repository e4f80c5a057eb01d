//! The members of one warm pool on one edge, as a state machine with no I/O: which members to
//! start and stop to hold the pool's size at its current template, and which one a claim
//! takes. The edge drives it (starting containers, stopping them) and feeds back what
//! happened.
//!
//! Invariants (OpenSandbox's pool design, with its known flaw fixed):
//! - a claim only ever takes an IDLE member of the current revision: during a rollout a
//!   member of an older revision is never handed out, even when no current one is ready (the
//!   claim misses and the caller creates cold);
//! - when the template changes, idle members of older revisions are stopped and replaced;
//!   claimed members finish their lives untouched (they are sandboxes now, no longer the
//!   pool's);
//! - a member that finishes starting after its revision was replaced is stopped at once,
//!   never made idle;
//! - the plan never has more members of the current revision starting or idle than the target
//!   size.

use std::collections::BTreeMap;

/// Where one member is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemberState {
    /// Being started (its container is not up yet).
    Starting,
    /// Up, waiting for a claim.
    Idle,
    /// Being stopped (replaced, or the pool shrank).
    Stopping,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub revision: String,
    pub state: MemberState,
}

/// What the edge should do next for a pool.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Plan {
    /// Members to start, of the current revision.
    pub start: u32,
    /// Members to stop (ids).
    pub stop: Vec<String>,
}

/// One pool's members on this edge. Claimed members are no longer here.
#[derive(Clone, Debug, Default)]
pub struct Members {
    revision: String,
    target: u32,
    members: BTreeMap<String, Member>,
    /// Claims that found no idle member of the current revision.
    pub misses: u64,
    pub claims: u64,
}

impl Members {
    pub fn new(revision: &str, target: u32) -> Members {
        Members { revision: revision.to_string(), target, ..Default::default() }
    }

    pub fn revision(&self) -> &str {
        &self.revision
    }

    /// A new template (revision) or size. Idle members of other revisions are marked to
    /// stop; starting ones are stopped when they come up ([`Members::started`]).
    /// How many idle members of the current revision the plan keeps.
    pub fn target(&self) -> u32 {
        self.target
    }

    pub fn set_template(&mut self, revision: &str, target: u32) {
        self.revision = revision.to_string();
        self.target = target;
        for m in self.members.values_mut() {
            if m.state == MemberState::Idle && m.revision != self.revision {
                m.state = MemberState::Stopping;
            }
        }
    }

    /// The edge began starting member `id` (of the revision current when it planned).
    pub fn starting(&mut self, id: &str, revision: &str) {
        self.members.insert(id.to_string(), Member { revision: revision.to_string(), state: MemberState::Starting });
    }

    /// Member `id` is up: idle if its revision is current, else to be stopped. Returns its
    /// state.
    pub fn started(&mut self, id: &str) -> Option<MemberState> {
        let current = self.revision.clone();
        let m = self.members.get_mut(id)?;
        if m.state == MemberState::Starting {
            m.state = if m.revision == current { MemberState::Idle } else { MemberState::Stopping };
        }
        Some(m.state)
    }

    /// Idle members (any revision), by id.
    pub fn idle_ids(&self) -> Vec<String> {
        self.members.iter().filter(|(_, m)| m.state == MemberState::Idle).map(|(id, _)| id.clone()).collect()
    }

    /// An idle member found broken: it is to be stopped (and replaced by the next plan).
    pub fn retire(&mut self, id: &str) {
        if let Some(m) = self.members.get_mut(id)
            && m.state == MemberState::Idle
        {
            m.state = MemberState::Stopping;
        }
    }

    /// Member `id`'s state, if it is still the pool's (not claimed, not gone).
    pub fn state_of(&self, id: &str) -> Option<MemberState> {
        self.members.get(id).map(|m| m.state)
    }

    /// Member `id` failed to start, or was stopped, or died: it is gone.
    pub fn gone(&mut self, id: &str) {
        self.members.remove(id);
    }

    /// Takes an idle member of the current revision (the first by id), or counts a miss.
    pub fn claim(&mut self) -> Option<String> {
        self.claim_preferring(None)
    }

    /// [`Members::claim`], taking member `prefer` when it is one of those.
    pub fn claim_preferring(&mut self, prefer: Option<&str>) -> Option<String> {
        let takeable = |m: &Member| m.state == MemberState::Idle && m.revision == self.revision;
        let id = prefer
            .filter(|id| self.members.get(*id).is_some_and(takeable))
            .map(str::to_string)
            .or_else(|| self.members.iter().find(|(_, m)| takeable(m)).map(|(id, _)| id.clone()));
        match &id {
            Some(id) => {
                self.members.remove(id);
                self.claims += 1;
            }
            None => self.misses += 1,
        }
        id
    }

    /// What to start and stop now: members to stop (marked, or idle beyond the target),
    /// and how many of the current revision to start to reach the target.
    pub fn plan(&mut self) -> Plan {
        let current: Vec<String> = self
            .members
            .iter()
            .filter(|(_, m)| m.revision == self.revision && m.state != MemberState::Stopping)
            .map(|(id, _)| id.clone())
            .collect();
        let mut plan = Plan::default();
        // Shrunk: stop idle members beyond the target (starting ones are counted, not killed
        // mid-start: they stop once up if still too many).
        let mut excess = (current.len() as u32).saturating_sub(self.target);
        for id in current.iter().rev() {
            if excess == 0 {
                break;
            }
            if let Some(m) = self.members.get_mut(id)
                && m.state == MemberState::Idle
            {
                m.state = MemberState::Stopping;
                excess -= 1;
            }
        }
        let alive = current.iter().filter(|id| self.members[*id].state != MemberState::Stopping).count() as u32;
        plan.start = self.target.saturating_sub(alive);
        plan.stop =
            self.members.iter().filter(|(_, m)| m.state == MemberState::Stopping).map(|(id, _)| id.clone()).collect();
        plan
    }

    /// Idle members of the current revision (the pool's ready size).
    pub fn idle(&self) -> usize {
        self.members.values().filter(|m| m.state == MemberState::Idle && m.revision == self.revision).count()
    }

    /// Members not claimed and not gone (any state, any revision).
    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// Members in `state` (any revision).
    pub fn count(&self, state: MemberState) -> usize {
        self.members.values().filter(|m| m.state == state).count()
    }

    /// Members of revisions other than the current one, not yet gone.
    pub fn stale(&self) -> usize {
        self.members.values().filter(|m| m.revision != self.revision).count()
    }
}

/// One pool's ask of an edge's pool share: its tenant (top-level project), the room one
/// member takes in each dimension (CPU, memory, disk, GPUs, sandboxes), and how many members
/// it wants (`size_per_edge`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShareAsk {
    pub tenant: String,
    pub key: String,
    pub per_member: [u64; 5],
    pub size: u32,
}

/// How many idle members each pool keeps on an edge whose pools may hold `share` (per
/// dimension): every pool its size while the tenants together fit; beyond, the share is split
/// between tenants max-min fairly in each dimension (a tenant asking less than an equal part
/// gets all it asks; what it leaves goes to the others), and each tenant's pools are scaled
/// down by the part of its ask it got in its tightest dimension. So one tenant's large pool
/// never takes the share from another's (issue 39), and more pools or subprojects get a tenant
/// nothing more. Pure: the edge applies it to IAM's pools at each refresh.
pub fn fair_targets(share: [u64; 5], asks: &[ShareAsk]) -> BTreeMap<String, u32> {
    let mut demand: BTreeMap<&str, [u64; 5]> = BTreeMap::new();
    for a in asks {
        let d = demand.entry(a.tenant.as_str()).or_default();
        for (i, v) in a.per_member.iter().enumerate() {
            d[i] = d[i].saturating_add(v.saturating_mul(u64::from(a.size)));
        }
    }
    // Each tenant's part of its ask, the least over the dimensions it asks in (as a fraction
    // num/den, kept exact).
    let mut part: BTreeMap<&str, (u64, u64)> = demand.keys().map(|t| (*t, (1, 1))).collect();
    for dim in 0..5 {
        let mut asking: Vec<(&str, u64)> = demand.iter().map(|(t, d)| (*t, d[dim])).filter(|(_, d)| *d > 0).collect();
        asking.sort_by_key(|(_, d)| *d);
        let mut left = share[dim];
        let n = asking.len();
        for (i, (tenant, want)) in asking.into_iter().enumerate() {
            let equal = left / (n - i) as u64;
            let got = want.min(equal);
            left -= got;
            let (num, den) = part[tenant];
            // got/want < num/den: this dimension is tighter.
            if u128::from(got) * u128::from(den) < u128::from(num) * u128::from(want) {
                part.insert(tenant, (got, want));
            }
        }
    }
    asks.iter()
        .map(|a| {
            let (num, den) = part.get(a.tenant.as_str()).copied().unwrap_or((1, 1));
            let target = (u128::from(a.size) * u128::from(num) / u128::from(den.max(1))) as u32;
            (a.key.clone(), target.min(a.size))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_rollout_replaces_idle_members_and_never_hands_out_a_stale_one() {
        let mut p = Members::new("r1", 2);
        let plan = p.plan();
        assert_eq!(plan, Plan { start: 2, stop: vec![] });
        p.starting("a", "r1");
        p.starting("b", "r1");
        p.started("a");
        p.started("b");
        assert_eq!(p.idle(), 2);
        p.set_template("r2", 2);
        // Nothing of r2 is up yet: a claim misses rather than take an r1 member.
        assert_eq!(p.claim(), None);
        assert_eq!(p.misses, 1);
        let plan = p.plan();
        assert_eq!(plan.start, 2);
        assert_eq!(plan.stop, vec!["a".to_string(), "b".to_string()]);
        p.starting("c", "r2");
        p.starting("late", "r1"); // planned before the rollout, comes up after it
        assert_eq!(p.started("late"), Some(MemberState::Stopping));
        p.started("c");
        assert_eq!(p.claim(), Some("c".to_string()));
        assert_eq!(p.stale(), 3);
        for id in ["a", "b", "late"] {
            p.gone(id);
        }
        assert_eq!(p.stale(), 0);
    }

    #[test]
    fn shrinking_stops_idle_members_beyond_the_target() {
        let mut p = Members::new("r", 3);
        for id in ["a", "b", "c"] {
            p.starting(id, "r");
            p.started(id);
        }
        p.set_template("r", 1);
        let plan = p.plan();
        assert_eq!((plan.start, plan.stop.len()), (0, 2));
        assert_eq!(p.idle(), 1);
    }

    #[derive(Clone, Debug)]
    enum Op {
        Plan,
        Start(usize),
        Fail(usize),
        Claim,
        Rollout(u8, u32),
        StopDone(usize),
        /// An idle member found dead.
        Retire(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => Just(Op::Plan),
            4 => (0usize..16).prop_map(Op::Start),
            1 => (0usize..16).prop_map(Op::Fail),
            4 => Just(Op::Claim),
            1 => (0u8..4, 0u32..5).prop_map(|(r, n)| Op::Rollout(r, n)),
            2 => (0usize..16).prop_map(Op::StopDone),
            1 => (0usize..16).prop_map(Op::Retire),
        ]
    }

    proptest! {
        /// Claims interleaved with template updates, starts finishing late and failures: a
        /// claim only ever takes a member of the revision current at that moment, and after
        /// a plan no idle member of another revision is left.
        #[test]
        fn claims_only_ever_take_members_of_the_current_revision(ops in proptest::collection::vec(op(), 1..200)) {
            let mut p = Members::new("r0", 2);
            let mut next = 0u32;
            let mut pending: Vec<String> = Vec::new();
            let mut revision_of: BTreeMap<String, String> = BTreeMap::new();
            for op in ops {
                match op {
                    Op::Plan => {
                        let plan = p.plan();
                        // Never more idle members of the current revision than the target.
                        prop_assert!(p.idle() as u32 <= p.target);
                        for _ in 0..plan.start {
                            let id = format!("m{next}");
                            next += 1;
                            let rev = p.revision().to_string();
                            p.starting(&id, &rev);
                            revision_of.insert(id.clone(), rev);
                            pending.push(id);
                        }
                        for id in p.members.iter() {
                            prop_assert!(!(id.1.state == MemberState::Idle && id.1.revision != p.revision));
                        }
                        // And enough starting or idle to reach it.
                        let current = p.members.values().filter(|m| m.revision == p.revision && m.state != MemberState::Stopping).count();
                        prop_assert!(current as u32 >= p.target);
                    }
                    Op::Start(i) if !pending.is_empty() => {
                        let id = pending.remove(i % pending.len());
                        p.started(&id);
                    }
                    Op::Fail(i) if !pending.is_empty() => {
                        let id = pending.remove(i % pending.len());
                        p.gone(&id);
                    }
                    Op::Claim => {
                        if let Some(id) = p.claim() {
                            prop_assert_eq!(&revision_of[&id], p.revision());
                        }
                    }
                    Op::Rollout(r, n) => p.set_template(&format!("r{r}"), n),
                    Op::Retire(i) => {
                        let idle = p.idle_ids();
                        if !idle.is_empty() {
                            let id = idle[i % idle.len()].clone();
                            p.retire(&id);
                            // Never handed out again.
                            prop_assert_eq!(p.members[&id].state, MemberState::Stopping);
                        }
                    }
                    Op::StopDone(i) => {
                        let stopping: Vec<String> = p.members.iter().filter(|(_, m)| m.state == MemberState::Stopping).map(|(id, _)| id.clone()).collect();
                        if !stopping.is_empty() {
                            p.gone(&stopping[i % stopping.len()]);
                        }
                    }
                    _ => {}
                }
            }
        }
    }

    #[test]
    fn the_pool_share_is_split_fairly_between_tenants() {
        let ask = |tenant: &str, key: &str, cpu: u64, size: u32| ShareAsk {
            tenant: tenant.into(),
            key: key.into(),
            per_member: [cpu, 100, 0, 0, 1],
            size,
        };
        let share = [10_000, 1_000_000, 0, 0, 1_000];
        // Within the share: everyone gets its size.
        let t = fair_targets(share, &[ask("root/a", "a1", 1000, 4), ask("root/b", "b1", 1000, 4)]);
        assert_eq!((t["a1"], t["b1"]), (4, 4));
        // A greedy tenant is cut to what others leave it; the modest one gets all it asks.
        let t = fair_targets(share, &[ask("root/a", "a1", 1000, 1000), ask("root/b", "b1", 1000, 2)]);
        assert_eq!((t["a1"], t["b1"]), (8, 2));
        // Three equal greedy tenants: equal parts; more pools of one tenant get it nothing more.
        let t = fair_targets(
            share,
            &[
                ask("root/a", "a1", 1000, 100),
                ask("root/a", "a2", 1000, 100),
                ask("root/b", "b1", 1000, 100),
                ask("root/c", "c1", 1000, 100),
            ],
        );
        // (Each pool is rounded down: a's two pools share a's third.)
        assert!((2..=3).contains(&(t["a1"] + t["a2"])), "{t:?}");
        assert_eq!((t["b1"], t["c1"]), (3, 3));
        // The tightest dimension decides (here the count of sandboxes, not CPU).
        let t =
            fair_targets([1_000_000, 1_000_000, 0, 0, 10], &[ask("root/a", "a1", 1, 100), ask("root/b", "b1", 1, 100)]);
        assert_eq!((t["a1"], t["b1"]), (5, 5));
    }
}
