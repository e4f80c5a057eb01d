//! Lease release batching: ended sandboxes' leases are queued and released with one IAM
//! ReleaseLeases call per `release_batch` leases, or every `release_interval` (reference
//! section 3: stopping a million sandboxes must not mean a million IAM commits).
//!
//! Invariants:
//! - a lease leaves the queue only when IAM confirmed its release; failures keep it queued and
//!   the loop backs off (up to [`MAX_BACKOFF`]);
//! - a confirmed lease is marked `lease_released` in its record (written before the mark is
//!   set in memory, so the record's deletion, which waits for the mark, never races the write);
//! - leases of creations the caller may have retried elsewhere (`release_if_bound`) are first
//!   checked with GetLease after [`RECHECK_DELAY`], and released only if IAM still binds them
//!   here: releasing a lease that was rebound to another edge would free quota a live sandbox
//!   holds there;
//! - on restart, ended records not yet released are queued again (see `recover`).

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::{Notify, watch};

use opendsec_common::ApiError;
use opendsec_common::time::now_ms;

use crate::core::Inner;
use crate::remote::LeaseBinding;

/// Longest wait between two attempts after IAM failures.
pub const MAX_BACKOFF: Duration = Duration::from_secs(5);
/// How long after a failed creation the edge asks IAM whether the lease is still its own
/// (long enough for the apiserver's retry on another edge to have rebound it).
pub const RECHECK_DELAY: Duration = Duration::from_secs(2);

#[derive(Default)]
struct Queue {
    ready: VecDeque<String>,
    /// (due at, lease): release only if still bound here.
    checks: Vec<(i64, String)>,
}

pub(crate) struct ReleaseQueue {
    q: Mutex<Queue>,
    wake: Notify,
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

    /// Queues a lease to be released after [`RECHECK_DELAY`] if IAM still binds it here.
    pub fn push_check(&self, lease: String) {
        let due = now_ms() + RECHECK_DELAY.as_millis() as i64;
        self.lock().checks.push((due, lease));
    }

    fn take_batch(&self) -> Vec<String> {
        let mut q = self.lock();
        let n = q.ready.len().min(self.batch);
        q.ready.drain(..n).collect()
    }

    fn put_back(&self, leases: Vec<String>) {
        let mut q = self.lock();
        for l in leases.into_iter().rev() {
            q.ready.push_front(l);
        }
    }

    fn take_due_checks(&self, now: i64) -> Vec<String> {
        let mut q = self.lock();
        let (due, later): (Vec<_>, Vec<_>) = q.checks.drain(..).partition(|(at, _)| *at <= now);
        q.checks = later;
        due.into_iter().map(|(_, l)| l).collect()
    }

    /// (ready, waiting for a check).
    pub fn len(&self) -> (usize, usize) {
        let q = self.lock();
        (q.ready.len(), q.checks.len())
    }
}

impl Inner {
    /// Releases queued leases (and resolves due checks). Stops at the first failure, leaving
    /// the rest queued.
    pub(crate) async fn flush_releases(&self, with_checks: bool) -> Result<(), ApiError> {
        if with_checks {
            self.run_due_checks().await;
        }
        loop {
            let batch = self.releases.take_batch();
            if batch.is_empty() {
                return Ok(());
            }
            if !self.remote.has_iam() {
                // Nobody holds leases without IAM (an edge run on its own): nothing to release.
                self.mark_released(&batch).await;
                continue;
            }
            match self.remote.release(&batch).await {
                Ok(released) => {
                    tracing::debug!(edge = %self.name, leases = batch.len(), released, "released leases");
                    self.mark_released(&batch).await;
                }
                Err(e) => {
                    tracing::warn!(edge = %self.name, leases = batch.len(), error = %e, "lease release failed; will retry");
                    self.releases.put_back(batch);
                    return Err(e);
                }
            }
        }
    }

    async fn run_due_checks(&self) {
        let due = self.releases.take_due_checks(now_ms());
        if due.is_empty() {
            return;
        }
        if !self.remote.has_iam() {
            self.mark_released(&due).await;
            return;
        }
        let results: Vec<(String, Result<LeaseBinding, ApiError>)> = futures::stream::iter(due)
            .map(|lease| async move {
                let r = self.remote.lease_binding(&lease).await;
                (lease, r)
            })
            .buffer_unordered(16)
            .collect()
            .await;
        let mut not_ours = Vec::new();
        for (lease, r) in results {
            match r {
                Ok(LeaseBinding::Here) => self.releases.push(lease),
                Ok(LeaseBinding::Elsewhere(_) | LeaseBinding::Gone) => not_ours.push(lease),
                Err(e) => {
                    tracing::debug!(lease_id = %lease, error = %e, "lease check failed; will retry");
                    self.releases.push_check(lease);
                }
            }
        }
        if !not_ours.is_empty() {
            self.mark_released(&not_ours).await;
        }
    }
}

/// The release loop: flushes every `release_interval`, or at once when a batch is full; backs
/// off after failures. Ends when shutdown is signalled (the final flush is `Edge::close`'s).
pub(crate) async fn run(inner: std::sync::Arc<Inner>, mut shutdown: watch::Receiver<bool>) {
    let interval = inner.cfg.release_interval;
    let mut backoff = Duration::ZERO;
    let mut next_try = Instant::now();
    loop {
        if *shutdown.borrow() {
            return;
        }
        tokio::select! {
            _ = shutdown.changed() => return,
            _ = tokio::time::sleep(interval) => {}
            _ = inner.releases.wake.notified() => {}
        }
        if Instant::now() < next_try {
            continue;
        }
        match inner.flush_releases(true).await {
            Ok(()) => backoff = Duration::ZERO,
            Err(_) => {
                backoff = (backoff * 2).max(interval).min(MAX_BACKOFF);
                next_try = Instant::now() + backoff;
            }
        }
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
    fn checks_wait_until_due() {
        let q = ReleaseQueue::new(10);
        q.push_check("x".into());
        assert!(q.take_due_checks(now_ms()).is_empty());
        assert_eq!(q.len(), (0, 1));
        assert_eq!(q.take_due_checks(i64::MAX), ["x"]);
        assert_eq!(q.len(), (0, 0));
    }
}
