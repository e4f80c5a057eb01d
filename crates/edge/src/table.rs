//! The in-memory table of sandboxes: records by lease (so by sandbox id, which is
//! `<edge>.<lease>`), each with its operation lock, plus the running totals of what live
//! sandboxes hold.
//!
//! Invariants: `used` always equals the sum over live records (every change of a record goes
//! through `insert`/`publish`/`remove`, which adjust it); the table sits behind a std mutex held
//! only for short, non-async sections; records are `Arc`s so readers clone pointers under the
//! lock and build messages outside it.

use std::collections::{BTreeMap, HashMap};
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
}

#[derive(Default)]
pub(crate) struct Table {
    entries: BTreeMap<String, Entry>,
    /// Sandboxes that moved in: their ids (naming the edge they were created on) to leases.
    /// Listing merges them into id order.
    foreign: BTreeMap<String, String>,
    used: Totals,
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
        if let Some(old) = self.entries.insert(lease, Entry { rec, op }) {
            self.forget(&old.rec);
        }
    }

    /// Replaces the record of an existing sandbox (keeping its lock); inserts it if the entry
    /// went away meanwhile.
    pub fn publish(&mut self, rec: Arc<SandboxRecord>) {
        if rec.state.is_live() {
            self.used.add(rec.resources());
        }
        if is_foreign(&rec) {
            self.foreign.insert(rec.id.clone(), rec.lease_id.clone());
        }
        match self.entries.get_mut(&rec.lease_id) {
            Some(e) => {
                let old = std::mem::replace(&mut e.rec, rec);
                self.forget(&old);
            }
            None => {
                let lease = rec.lease_id.clone();
                self.entries.insert(lease, Entry { rec, op: OpLock::default() });
            }
        }
    }

    pub fn remove(&mut self, lease: &str) -> Option<Entry> {
        let e = self.entries.remove(lease)?;
        self.forget(&e.rec);
        if is_foreign(&e.rec) {
            self.foreign.remove(&e.rec.id);
        }
        Some(e)
    }

    fn forget(&mut self, old: &SandboxRecord) {
        if old.state.is_live() {
            self.used.sub(old.resources());
        }
    }

    /// Up to `limit` records matching `filter` with ids after `after`, in id order, and whether
    /// more match. The ids this edge gave out all start with `<edge>.`, so their order is lease
    /// order; those that moved in are merged in from their own index. A sandbox that moved
    /// away is not listed (the edge it went to lists it).
    pub fn list(&self, edge: &str, filter: &ListFilter, after: &str, limit: usize) -> (Vec<Arc<SandboxRecord>>, bool) {
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
        let mut out = Vec::new();
        let mut more = false;
        for e in merged.filter(|e| listed(&e.rec) && filter.matches(&e.rec)) {
            if out.len() == limit {
                more = true;
                break;
            }
            out.push(e.rec.clone());
        }
        (out, more)
    }
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
        state_ok
            && (self.project.is_empty() || ids::project_within(&rec.spec.project, &self.project))
            && self.labels.iter().all(|(k, v)| rec.spec.labels.get(k) == Some(v))
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
        let (page, more) = t.list("e", &f, "", 2);
        assert_eq!((ids(page), more), (vec!["e.a".to_string(), "e.d".to_string()], true));
        let (page, more) = t.list("e", &f, "e.d", 2);
        assert_eq!((ids(page), more), (vec!["e.e".to_string()], false));
        let f = ListFilter { states: vec![SandboxStatus::Stopped], ..Default::default() };
        assert_eq!(ids(t.list("e", &f, "", 10).0), ["e.b"]);
        let f = ListFilter { labels: [("job".to_string(), "c".to_string())].into(), ..Default::default() };
        assert_eq!(ids(t.list("e", &f, "", 10).0), ["e.c"]);
        // `after` outside this edge's ids: everything or nothing.
        assert_eq!(t.list("e", &ListFilter::default(), "a", 10).0.len(), 4);
        assert!(t.list("e", &ListFilter::default(), "f", 10).0.is_empty());
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
        // Moved away: its record stays, STOPPED, and is not listed (even asking for STOPPED).
        let mut gone = (*rec("g", "root", SandboxStatus::Stopped, 1)).clone();
        gone.moved.moved_to = "f".into();
        t.insert(Arc::new(gone), OpLock::default());
        let ids = |v: Vec<Arc<SandboxRecord>>| v.iter().map(|r| r.id.clone()).collect::<Vec<_>>();
        let all = ListFilter::default();
        // A copy still starting is not listed (its original is, on its own edge).
        assert_eq!(ids(t.list("e", &all, "", 10).0), ["a.c", "e.b", "e.d", "f.a"]);
        let (page, more) = t.list("e", &all, "", 2);
        assert_eq!((ids(page), more), (vec!["a.c".to_string(), "e.b".to_string()], true));
        assert_eq!(ids(t.list("e", &all, "a.s", 2).0), ["e.b", "e.d"]);
        assert_eq!(ids(t.list("e", &all, "e.d", 10).0), ["f.a"]);
        let stopped = ListFilter { states: vec![SandboxStatus::Stopped], ..Default::default() };
        assert!(t.list("e", &stopped, "", 10).0.is_empty());
        // Reported for routing: those that run (a copy still starting may be abandoned).
        assert_eq!(t.moved_in(), ["a.c", "f.a"]);
        t.remove("c");
        assert_eq!(t.moved_in(), ["f.a"]);
        assert_eq!(t.used().sandboxes, 4);
    }
}
