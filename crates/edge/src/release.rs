//! The edge's lease traffic with IAM, batched (reference section 3: stopping a million
//! sandboxes must not mean a million IAM commits, nor a million creations a million lookups):
//!
//! - releases: ended sandboxes' leases are queued and released with one ReleaseLeases call per
//!   `release_batch` leases, or every `release_interval`. Every call names this edge, so IAM
//!   frees only leases still bound here: a lease the apiserver rebound to another edge (a
//!   creation retried elsewhere) is left alone without the edge having to ask first;
//! - post-creation checks: the leases of finished creations are queued and looked up with one
//!   GetLeases call per batch, on the same schedule, once they are [`CHECK_DELAY`] old (or a
//!   whole batch is queued): a check is for a caller that gave up on the edge and placed the
//!   lease elsewhere, which takes longer than that, and checks made at once would cost one
//!   call per creation on an edge creating a few hundred a second. A lease IAM binds
//!   elsewhere or no longer knows means the caller moved on: the sandbox is stopped
//!   (`lease_moved`) without a release.
//!
//! Invariants:
//! - a lease leaves the release queue only when IAM confirmed the call; failures keep it queued
//!   and the loop backs off (up to [`MAX_BACKOFF`]);
//! - a confirmed lease is marked `lease_released` in its record (written before the mark is
//!   set in memory, so the record's deletion, which waits for the mark, never races the write);
//! - a check that cannot be made (IAM unreachable) keeps the sandbox: checks stay queued for
//!   retries, and are dropped after [`CHECK_MAX_AGE`] (keeping a sandbox is the safe default;
//!   the TTLs end it eventually);
//! - on restart, ended records not yet released are queued again (see `recover`).
//!
//! This file is the queue; the loop that drains it against IAM is `core::release`.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use tokio::sync::Notify;

/// Longest wait between two attempts after IAM failures.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// A post-creation check waits this long after the creation (unless a whole batch is queued).
pub const CHECK_DELAY: Duration = Duration::from_secs(1);
/// A post-creation check not made within this long (IAM unreachable) is given up.
pub const CHECK_MAX_AGE: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Queue {
    ready: VecDeque<String>,
    /// (queued at, lease): leases of finished creations to look up.
    checks: VecDeque<(Instant, String)>,
}

pub(crate) struct ReleaseQueue {
    q: Mutex<Queue>,
    pub(crate) wake: Notify,
    batch: usize,
}

impl ReleaseQueue {
    pub fn new(batch: usize) -> ReleaseQueue {
        ReleaseQueue { q: Mutex::new(Queue::default()), wake: Notify::new(), batch: batch.max(1) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.q.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a lease for release; a full batch wakes the loop at once.
    pub fn push(&self, lease: String) {
        let full = {
            let mut q = self.lock();
            q.ready.push_back(lease);
            q.ready.len() >= self.batch
        };
        if full {
            self.wake.notify_one();
        }
    }

    /// Queues the lease of a finished creation for the "still bound here?" check; a full
    /// batch wakes the loop at once.
    pub fn push_check(&self, lease: String) {
        let full = {
            let mut q = self.lock();
            q.checks.push_back((Instant::now(), lease));
            q.checks.len() >= self.batch
        };
        if full {
            self.wake.notify_one();
        }
    }

    pub(crate) fn take_batch(&self) -> Vec<String> {
        let mut q = self.lock();
        let n = q.ready.len().min(self.batch);
        q.ready.drain(..n).collect()
    }

    pub(crate) fn put_back(&self, leases: Vec<String>) {
        let mut q = self.lock();
        for l in leases.into_iter().rev() {
            q.ready.push_front(l);
        }
    }

    /// Drops checks queued before `now - CHECK_MAX_AGE` (returning how many), then takes a
    /// batch of the rest: a whole one, else those queued [`CHECK_DELAY`] before `now`.
    /// Checks are queued in time order and put back in front, so the oldest are always at the
    /// front.
    pub(crate) fn take_checks(&self, now: Instant) -> (Vec<(Instant, String)>, usize) {
        let mut q = self.lock();
        let before = q.checks.len();
        while q.checks.front().is_some_and(|(at, _)| now.saturating_duration_since(*at) >= CHECK_MAX_AGE) {
            q.checks.pop_front();
        }
        let dropped = before - q.checks.len();
        let n = if q.checks.len() >= self.batch {
            self.batch
        } else {
            q.checks.iter().take_while(|(at, _)| now.saturating_duration_since(*at) >= CHECK_DELAY).count()
        };
        (q.checks.drain(..n).collect(), dropped)
    }

    pub(crate) fn put_back_checks(&self, checks: Vec<(Instant, String)>) {
        let mut q = self.lock();
        for c in checks.into_iter().rev() {
            q.checks.push_front(c);
        }
    }

    /// (releases queued, post-creation checks queued).
    pub fn len(&self) -> (usize, usize) {
        let q = self.lock();
        (q.ready.len(), q.checks.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_keep_order_and_failures_go_back_in_front() {
        let q = ReleaseQueue::new(2);
        for l in ["a", "b", "c"] {
            q.push(l.to_string());
        }
        let first = q.take_batch();
        assert_eq!(first, ["a", "b"]);
        q.put_back(first);
        assert_eq!(q.take_batch(), ["a", "b"]);
        assert_eq!(q.take_batch(), ["c"]);
        assert!(q.take_batch().is_empty());
    }

    #[test]
    fn checks_are_batched_retried_in_order_and_given_up_when_old() {
        let q = ReleaseQueue::new(2);
        for l in ["a", "b", "c"] {
            q.push_check(l.to_string());
        }
        assert_eq!(q.len(), (0, 3));
        let now = Instant::now();
        // Not yet: two of them (a whole batch) are taken, the one left waits for CHECK_DELAY.
        let (first, dropped) = q.take_checks(now);
        assert_eq!((first.iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>(), dropped), (vec!["a", "b"], 0));
        let (none, _) = q.take_checks(now);
        assert!(none.is_empty(), "{none:?}");
        let (last, _) = q.take_checks(now + CHECK_DELAY);
        assert_eq!(last.iter().map(|(_, l)| l.as_str()).collect::<Vec<_>>(), vec!["c"]);
        q.put_back_checks(last);
        // A failed call puts them back in front, with their times.
        q.put_back_checks(first);
        assert_eq!(q.len(), (0, 3));
        // A minute later, every one of them is given up.
        let (late, dropped) = q.take_checks(now + CHECK_MAX_AGE);
        assert!(late.is_empty());
        assert_eq!((dropped, q.len()), (3, (0, 0)));
    }
}
