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

    /// Member `id` failed to start, or was stopped, or died: it is gone.
    pub fn gone(&mut self, id: &str) {
        self.members.remove(id);
    }

    /// Takes an idle member of the current revision (the first by id), or counts a miss.
    pub fn claim(&mut self) -> Option<String> {
        let id = self
            .members
            .iter()
            .find(|(_, m)| m.state == MemberState::Idle && m.revision == self.revision)
            .map(|(id, _)| id.clone());
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
}
