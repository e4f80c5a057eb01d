//! The loop that drains the edge's [`ReleaseQueue`] against IAM: batched releases, then the
//! batched post-creation checks (a lease bound elsewhere stops its sandbox); the policy is
//! described in `crate::release`.
use std::time::{Duration, Instant};

use futures::StreamExt;
use tokio::sync::watch;

use opendsec_common::ApiError;

use super::Inner;
use crate::release::MAX_BACKOFF;
use crate::remote::LeaseBinding;

/// Sandboxes of moved leases stopped concurrently.
const STOP_CONCURRENCY: usize = 16;

impl Inner {
    /// Releases queued leases. Stops at the first failure, leaving the rest queued.
    pub(crate) async fn flush_releases(&self) -> Result<(), ApiError> {
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

    /// Makes the queued post-creation checks, a batch per GetLeases call, and stops the
    /// sandboxes whose lease moved. Stops at the first failed call, leaving the rest queued.
    pub(crate) async fn run_checks(&self) -> Result<(), ApiError> {
        loop {
            let (batch, dropped) = self.releases.take_checks(Instant::now());
            if dropped > 0 {
                tracing::debug!(edge = %self.name, dropped, "lease checks given up after IAM failures; sandboxes kept");
            }
            if batch.is_empty() {
                return Ok(());
            }
            let leases: Vec<String> = batch.iter().map(|(_, l)| l.clone()).collect();
            let bindings = match self.remote.lease_bindings(&leases).await {
                Ok(b) => b,
                Err(e) => {
                    tracing::debug!(edge = %self.name, leases = batch.len(), error = %e, "lease check failed; will retry");
                    self.releases.put_back_checks(batch);
                    return Err(e);
                }
            };
            let moved: Vec<(String, LeaseBinding)> =
                leases.into_iter().zip(bindings).filter(|(_, b)| *b != LeaseBinding::Here).collect();
            futures::stream::iter(moved)
                .for_each_concurrent(STOP_CONCURRENCY, |(lease, binding)| async move {
                    self.stop_moved(&lease, &binding).await
                })
                .await;
        }
    }
}

/// The loop: every `release_interval`, or at once when a batch is full, flushes releases and
/// makes the queued checks; backs off after failures. Ends when shutdown is signalled (the
/// final release flush is `Edge::close`'s).
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
        let released = inner.flush_releases().await;
        let checked = inner.run_checks().await;
        if released.is_ok() && checked.is_ok() {
            backoff = Duration::ZERO;
        } else {
            backoff = (backoff * 2).max(interval).min(MAX_BACKOFF);
            next_try = Instant::now() + backoff;
        }
    }
}
