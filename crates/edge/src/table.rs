//! The in-memory table of sandboxes: records by lease (so by sandbox id, which is
//! `<edge>.<lease>`), each with its operation lock, plus the running totals of what live
//! sandboxes hold.
//!
//! Invariants: `used` always equals the sum over live records (every change of a record goes
//! through `insert`/`publish`/`remove`, which adjust it); `due` holds each entry at its `due`
//! time, which is never later than the first moment the TTL sweep has something to do with the
//! record (so a round visits what is due, not every sandbox); the table sits behind a std mutex
//! held only for short, non-async sections; records are `Arc`s so readers clone pointers under
//! the lock and build messages outside it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::ops::Bound;
use std::sync::Arc;

use opendsec_common::ids;

use crate::admission::Totals;
use crate::record::SandboxRecord;
use crate::state::SandboxStatus;

/// One lifecycle operation at a time per sandbox; held across the operation's awaits.
pub(crate) type OpLock = Arc<tokio::sync::Mutex<()>>;

pub(crate) struct Entry {
    pub rec: Arc<SandboxRecord>,
    pub op: OpLock,
    /// When the sweep looks at the record next (its key in `Table::due`), if ever.
    due: Option<i64>,
}

#[derive(Default)]
pub(crate) struct Table {
    entries: BTreeMap<String, Entry>,
    /// Sandboxes that moved in: their ids (naming the edge they were created on) to leases.
    /// Listing merges them into id order.
    foreign: BTreeMap<String, String>,
    used: Totals,
    /// (due ms, lease) of every entry that has a `due` time.
    due: BTreeSet<(i64, String)>,
}

/// The earliest moment the TTL sweep may have something to do with the record, from the record
/// alone: a move to settle (`moving_since_ms`, or at once for a live sandbox that moved away),
/// the first TTL deadline of a live sandbox, or the end of an ended, released record (deleted
/// past retention). Activity only pushes the idle deadline later, and the retention and move
/// timeouts only add to these, so the sweep, when it looks, may put the record off further.
fn first_look(rec: &SandboxRecord) -> Option<i64> {
    if rec.moved.is_moving() {
        Some(rec.moved.moving_since_ms)
    } else if !rec.moved.moved_to.is_empty() && rec.state.is_live() {
        Some(0)
    } else if rec.state.is_live() {
        crate::ttl::next_deadline(rec).map(|d| d.at_ms)
    } else if rec.lease_released {
        Some(rec.ended_at_ms)
    } else {
        None
    }
}

/// Whether the record's id names another edge than the one holding it (it moved in).
fn is_foreign(rec: &SandboxRecord) -> bool {
    rec.id.strip_prefix(rec.edge.as_str()).and_then(|r| r.strip_prefix('.')) != Some(rec.lease_id.as_str())
}

impl Table {
    pub fn get(&self, lease: &str) -> Option<&Entry> {
        self.entries.get(lease)
    }

    pub fn rec(&self, lease: &str) -> Option<Arc<SandboxRecord>> {
        self.entries.get(lease).map(|e| e.rec.clone())
    }

    pub fn used(&self) -> Totals {
        self.used
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn records(&self) -> impl Iterator<Item = &Arc<SandboxRecord>> {
        self.entries.values().map(|e| &e.rec)
    }

    /// The ids of sandboxes that moved in here and run (a copy still starting may yet be
    /// abandoned: calls stay with the original until then).
    pub fn moved_in(&self) -> Vec<String> {
        self.foreign
            .values()
            .filter_map(|lease| self.entries.get(lease))
            .filter(|e| e.rec.state.is_live() && e.rec.state != SandboxStatus::Creating)
            .map(|e| e.rec.id.clone())
            .collect()
    }

    /// Adds a sandbox with its operation lock (replacing any entry of the same lease).
    pub fn insert(&mut self, rec: Arc<SandboxRecord>, op: OpLock) {
        if rec.state.is_live() {
            self.used.add(rec.resources());
        }
        if is_foreign(&rec) {
            self.foreign.insert(rec.id.clone(), rec.lease_id.clone());
        }
        let lease = rec.lease_id.clone();
        let due = first_look(&rec);
        if let Some(old) = self.entries.insert(lease.clone(), Entry { rec, op, due }) {
            self.forget(&old.rec, old.due);
        }
        if let Some(at) = due {
            self.due.insert((at, lease));
        }
    }

    /// Replaces the record of an existing sandbox (keeping its lock); inserts it if the entry
    /// went away meanwhile.
    pub fn publish(&mut self, rec: Arc<SandboxRecord>) {
        let op = self.entries.get(&rec.lease_id).map_or_else(OpLock::default, |e| e.op.clone());
        self.insert(rec, op);
    }

    pub fn remove(&mut self, lease: &str) -> Option<Entry> {
        let e = self.entries.remove(lease)?;
        self.forget(&e.rec, e.due);
        if is_foreign(&e.rec) {
            self.foreign.remove(&e.rec.id);
        }
        Some(e)
    }

    /// Takes an entry that is being replaced or removed out of the totals and the due index.
    fn forget(&mut self, old: &SandboxRecord, due: Option<i64>) {
        if old.state.is_live() {
            self.used.sub(old.resources());
        }
        if let Some(at) = due {
            self.due.remove(&(at, old.lease_id.clone()));
        }
    }

    /// The records due at `now_ms` (in due order), for the sweep to look at; each stays due
    /// until it changes or the sweep puts it off ([`Table::put_off`]).
    pub fn due(&self, now_ms: i64) -> Vec<Arc<SandboxRecord>> {
        self.due
            .range(..(now_ms.saturating_add(1), String::new()))
            .filter_map(|(_, lease)| self.entries.get(lease))
            .map(|e| e.rec.clone())
            .collect()
    }

    /// Sets when the sweep looks at the sandbox next (`None`: only once its record changes).
    pub fn put_off(&mut self, lease: &str, until: Option<i64>) {
        let Some(e) = self.entries.get_mut(lease) else { return };
        if let Some(at) = e.due {
            self.due.remove(&(at, lease.to_string()));
        }
        e.due = until;
        if let Some(at) = until {
            self.due.insert((at, lease.to_string()));
        }
    }

    /// How many entries the sweep has a time for (tests).
    #[cfg(test)]
    pub fn due_len(&self) -> usize {
        self.due.len()
    }

    /// Up to `limit` records matching `filter` with ids after `after`, in id order, and whether
    /// more match. The ids this edge gave out all start with `<edge>.`, so their order is lease
    /// order; those that moved in are merged in from their own index. A sandbox that moved
    /// away is not listed (the edge it went to lists it): it is told in [`Listing::away`]
    /// instead, when of the filter's project.
    pub fn list(&self, edge: &str, filter: &ListFilter, after: &str, limit: usize) -> Listing {
        let prefix = format!("{edge}.");
        let range: Box<dyn Iterator<Item = &Entry>> = if after.is_empty() {
            Box::new(self.entries.values())
        } else if let Some(lease) = after.strip_prefix(&prefix) {
            Box::new(self.entries.range::<str, _>((Bound::Excluded(lease), Bound::Unbounded)).map(|(_, e)| e))
        } else if after < prefix.as_str() {
            Box::new(self.entries.values())
        } else {
            Box::new(std::iter::empty())
        };
        let own = range.filter(|e| !is_foreign(&e.rec));
        let foreign = self
            .foreign
            .range::<str, _>((
                if after.is_empty() { Bound::Unbounded } else { Bound::Excluded(after) },
                Bound::Unbounded,
            ))
            .filter_map(|(_, lease)| self.entries.get(lease));
        let merged = merge_by_id(own, foreign);
        let mut out = Listing::default();
        for e in merged {
            if !e.rec.moved.moved_to.is_empty() {
                // Its states and labels are the copy's to match, where it went.
                if out.away_upto.is_none() && filter.matches_project(&e.rec) {
                    if out.away.len() == limit {
                        out.away_upto = out.away.last().map(|(id, _)| id.clone());
                    } else {
                        out.away.push((e.rec.id.clone(), e.rec.moved.moved_to.clone()));
                    }
                }
                continue;
            }
            if !(listed(&e.rec) && filter.matches(&e.rec)) {
                continue;
            }
            if out.recs.len() == limit {
                out.more = true;
                break;
            }
            out.recs.push(e.rec.clone());
        }
        out
    }
}

/// What [`Table::list`] found.
#[derive(Debug, Default)]
pub struct Listing {
    pub recs: Vec<Arc<SandboxRecord>>,
    /// More records match after the last of `recs`.
    pub more: bool,
    /// Sandboxes that moved away, met on the way (id, the edge it went to), in id order.
    pub away: Vec<(String, String)>,
    /// Set when `away` was cut: the id past which it says nothing.
    pub away_upto: Option<String>,
}

/// Whether a listing shows the record: not one that moved away (the edge it went to lists
/// it), nor a copy moving in that is still starting or failed to (the original is listed).
fn listed(rec: &SandboxRecord) -> bool {
    rec.moved.moved_to.is_empty()
        && !(is_foreign(rec)
            && (rec.state == SandboxStatus::Creating
                || (rec.state.is_ended() && rec.end_reason == crate::state::end_reason::CREATE_FAILED)))
}

/// Two iterators of entries, each in id order, merged into one in id order.
fn merge_by_id<'a>(
    a: impl Iterator<Item = &'a Entry>,
    b: impl Iterator<Item = &'a Entry>,
) -> impl Iterator<Item = &'a Entry> {
    let (mut a, mut b) = (a.peekable(), b.peekable());
    std::iter::from_fn(move || match (a.peek(), b.peek()) {
        (Some(x), Some(y)) => {
            if x.rec.id <= y.rec.id {
                a.next()
            } else {
                b.next()
            }
        }
        (Some(_), None) => a.next(),
        (None, _) => b.next(),
    })
}

/// What ListSandboxes selects.
#[derive(Clone, Debug, Default)]
pub(crate) struct ListFilter {
    /// Project path prefix (the project and its subprojects); empty = all.
    pub project: String,
    /// Empty = every live state.
    pub states: Vec<SandboxStatus>,
    /// Every label must match exactly.
    pub labels: HashMap<String, String>,
}

impl ListFilter {
    pub fn matches(&self, rec: &SandboxRecord) -> bool {
        let state_ok = if self.states.is_empty() { rec.state.is_live() } else { self.states.contains(&rec.state) };
        state_ok && self.matches_project(rec) && self.labels.iter().all(|(k, v)| rec.spec.labels.get(k) == Some(v))
    }

    /// Whether the record is of the filter's project (or one below it).
    pub fn matches_project(&self, rec: &SandboxRecord) -> bool {
        self.project.is_empty() || ids::project_within(&rec.spec.project, &self.project)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::{RECORD_VERSION, ResourcesRecord, SpecRecord};

    fn rec(lease: &str, project: &str, state: SandboxStatus, cpu: u32) -> Arc<SandboxRecord> {
        Arc::new(SandboxRecord {
            version: RECORD_VERSION,
            id: format!("e.{lease}"),
            edge: "e".into(),
            lease_id: lease.into(),
            principal: "p".into(),
            spec: SpecRecord {
                project: project.into(),
                backend: "sim".into(),
                resources: ResourcesRecord { cpu_millis: cpu, memory_mb: 1, disk_mb: 0, gpus: 0 },
                labels: [("job".to_string(), lease.to_string())].into(),
                ..Default::default()
            },
            state,
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
        })
    }

    #[test]
    fn totals_follow_live_records() {
        let mut t = Table::default();
        t.insert(rec("a", "root", SandboxStatus::Creating, 100), OpLock::default());
        t.insert(rec("b", "root", SandboxStatus::Running, 10), OpLock::default());
        assert_eq!(t.used().cpu_millis, 110);
        assert_eq!(t.used().sandboxes, 2);
        t.publish(rec("a", "root", SandboxStatus::Running, 100));
        assert_eq!(t.used().cpu_millis, 110);
        t.publish(rec("a", "root", SandboxStatus::Stopped, 100));
        assert_eq!(t.used().cpu_millis, 10);
        assert_eq!(t.used().sandboxes, 1);
        t.remove("a");
        t.remove("b");
        assert_eq!(t.used(), Totals::default());
    }

    #[test]
    fn list_filters_sorts_and_pages() {
        let mut t = Table::default();
        for (lease, project, state) in [
            ("d", "root/a/x", SandboxStatus::Running),
            ("a", "root/a", SandboxStatus::Paused),
            ("c", "root/ab", SandboxStatus::Running),
            ("b", "root/a", SandboxStatus::Stopped),
            ("e", "root/a", SandboxStatus::Running),
        ] {
            t.insert(rec(lease, project, state, 1), OpLock::default());
        }
        let ids = |v: Vec<Arc<SandboxRecord>>| v.iter().map(|r| r.id.clone()).collect::<Vec<_>>();
        let f = ListFilter { project: "root/a".into(), ..Default::default() };
        let page = t.list("e", &f, "", 2);
        assert_eq!((ids(page.recs), page.more), (vec!["e.a".to_string(), "e.d".to_string()], true));
        let page = t.list("e", &f, "e.d", 2);
        assert_eq!((ids(page.recs), page.more), (vec!["e.e".to_string()], false));
        let f = ListFilter { states: vec![SandboxStatus::Stopped], ..Default::default() };
        assert_eq!(ids(t.list("e", &f, "", 10).recs), ["e.b"]);
        let f = ListFilter { labels: [("job".to_string(), "c".to_string())].into(), ..Default::default() };
        assert_eq!(ids(t.list("e", &f, "", 10).recs), ["e.c"]);
        // `after` outside this edge's ids: everything or nothing.
        assert_eq!(t.list("e", &ListFilter::default(), "a", 10).recs.len(), 4);
        assert!(t.list("e", &ListFilter::default(), "f", 10).recs.is_empty());
    }

    #[test]
    fn sandboxes_that_moved_in_list_in_id_order_and_those_that_left_do_not() {
        let mut t = Table::default();
        for lease in ["b", "d"] {
            t.insert(rec(lease, "root", SandboxStatus::Running, 1), OpLock::default());
        }
        // Moved in from edges named before and after this one ("e").
        let moved = |id: &str, lease: &str, state| {
            let mut r = (*rec(lease, "root", state, 1)).clone();
            r.id = id.into();
            r.moved.moved_from = "x".into();
            Arc::new(r)
        };
        t.insert(moved("a.c", "c", SandboxStatus::Running), OpLock::default());
        t.insert(moved("f.a", "a", SandboxStatus::Running), OpLock::default());
        t.insert(moved("a.s", "s", SandboxStatus::Creating), OpLock::default());
        // Moved away: its record stays, STOPPED, and is not listed (even asking for STOPPED):
        // it is told apart, with where it went.
        let mut gone = (*rec("g", "root", SandboxStatus::Stopped, 1)).clone();
        gone.moved.moved_to = "f".into();
        t.insert(Arc::new(gone), OpLock::default());
        let ids = |v: Vec<Arc<SandboxRecord>>| v.iter().map(|r| r.id.clone()).collect::<Vec<_>>();
        let all = ListFilter::default();
        let away = || vec![("e.g".to_string(), "f".to_string())];
        // A copy still starting is not listed (its original is, on its own edge).
        let page = t.list("e", &all, "", 10);
        assert_eq!(ids(page.recs), ["a.c", "e.b", "e.d", "f.a"]);
        assert_eq!((page.away, page.away_upto), (away(), None));
        let page = t.list("e", &all, "", 2);
        assert_eq!((ids(page.recs), page.more), (vec!["a.c".to_string(), "e.b".to_string()], true));
        assert!(page.away.is_empty(), "not reached");
        assert_eq!(ids(t.list("e", &all, "a.s", 2).recs), ["e.b", "e.d"]);
        let page = t.list("e", &all, "e.d", 10);
        assert_eq!((ids(page.recs), page.away), (vec!["f.a".to_string()], away()));
        assert!(t.list("e", &all, "e.g", 10).away.is_empty(), "not after the token");
        let stopped = ListFilter { states: vec![SandboxStatus::Stopped], ..Default::default() };
        let page = t.list("e", &stopped, "", 10);
        assert!(page.recs.is_empty());
        // Told whatever the states asked for (the copy's state is the one to match), not for
        // another project.
        assert_eq!(page.away, away());
        let other = ListFilter { project: "root/x".into(), ..Default::default() };
        assert!(t.list("e", &other, "", 10).away.is_empty());
        // At most `limit` of them; past that, where the report stops.
        for lease in ["h", "i"] {
            let mut gone = (*rec(lease, "root", SandboxStatus::Stopped, 1)).clone();
            gone.moved.moved_to = "f".into();
            t.insert(Arc::new(gone), OpLock::default());
        }
        let page = t.list("e", &all, "e.d", 2);
        assert_eq!(page.away.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>(), ["e.g", "e.h"]);
        assert_eq!(page.away_upto.as_deref(), Some("e.h"));
        assert_eq!(ids(page.recs), ["f.a"]);
        for lease in ["h", "i"] {
            t.remove(lease);
        }
        // Reported for routing: those that run (a copy still starting may be abandoned).
        assert_eq!(t.moved_in(), ["a.c", "f.a"]);
        t.remove("c");
        assert_eq!(t.moved_in(), ["f.a"]);
        assert_eq!(t.used().sandboxes, 4);
    }

    #[test]
    fn the_sweep_is_shown_only_what_is_due_and_each_entry_once() {
        let mut t = Table::default();
        let with_ttl = |lease: &str, state, idle: u64| {
            let mut r = (*rec(lease, "root", state, 1)).clone();
            r.spec.ttl_running_stop_s = idle;
            r
        };
        let leases = |v: Vec<Arc<SandboxRecord>>| v.iter().map(|r| r.lease_id.clone()).collect::<Vec<_>>();
        // Idle deadlines at 1 + 10 s and 1 + 5 s; no TTL at all: never due while it runs.
        t.insert(Arc::new(with_ttl("a", SandboxStatus::Running, 10)), OpLock::default());
        t.insert(Arc::new(with_ttl("b", SandboxStatus::Running, 5)), OpLock::default());
        t.insert(rec("c", "root", SandboxStatus::Running, 1), OpLock::default());
        assert!(t.due(5_000).is_empty());
        assert_eq!(leases(t.due(5_001)), ["b"]);
        assert_eq!(leases(t.due(10_001)), ["b", "a"]);
        // Put off (activity), then changed (a new deadline): one entry each, never two.
        t.put_off("b", Some(20_000));
        assert_eq!(leases(t.due(10_001)), ["a"]);
        t.publish(Arc::new(with_ttl("b", SandboxStatus::Running, 1)));
        assert_eq!(leases(t.due(10_001)), ["b", "a"]);
        assert_eq!(t.due_len(), 2);
        // Ended: not due until its lease is released, then from its end on.
        let mut ended = with_ttl("a", SandboxStatus::Stopped, 10);
        ended.ended_at_ms = 7_000;
        t.publish(Arc::new(ended.clone()));
        assert_eq!(leases(t.due(i64::MAX)), ["b"]);
        ended.lease_released = true;
        t.publish(Arc::new(ended));
        assert_eq!(leases(t.due(7_000)), ["b", "a"]);
        // A sandbox moving is due from the move's start; one that moved away, at once.
        let mut moving = with_ttl("c", SandboxStatus::Running, 0);
        moving.moved.moving_since_ms = 3_000;
        moving.moved.moving_to = "f".into();
        t.publish(Arc::new(moving));
        assert_eq!(leases(t.due(3_000)), ["b", "c"]);
        t.put_off("b", None);
        t.remove("c");
        assert_eq!(leases(t.due(i64::MAX)), ["a"]);
        assert_eq!(t.due_len(), 1);
        t.remove("a");
        assert_eq!(t.due_len(), 0);
    }
}
