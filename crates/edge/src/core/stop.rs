//! Stopping: by the user, at shutdown, or as the end of a failed operation (FAILED); the lease is
//! queued for release with the final record.

use super::*;

impl Inner {
    pub(crate) async fn stop(&self, id: &str) -> Result<Sandbox, EdgeError> {
        let (_g, rec) = self.lock_op(id).await?;
        // Stopping an ended sandbox is answered with it as it is (retries are idempotent).
        if rec.state.is_ended() {
            return Ok(self.to_proto(&rec));
        }
        if !rec.state.can_stop() {
            return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "stop" });
        }
        let rec = self.stop_locked(rec, end_reason::USER, Release::Yes).await?;
        Ok(self.to_proto(&rec))
    }

    /// Stops a RUNNING or PAUSED sandbox; the caller holds its operation lock.
    pub(crate) async fn stop_locked(
        &self,
        rec: Arc<SandboxRecord>,
        reason: &str,
        release: Release,
    ) -> Result<Arc<SandboxRecord>, EdgeError> {
        let backend = self.backend_of(&rec)?.clone();
        let now = self.clock.now_ms();
        let mut stopping = (*rec).clone();
        stopping.state = SandboxStatus::Stopping;
        stopping.end_reason = reason.to_string();
        stopping.updated_at_ms = now;
        stopping.last_active_ms = now;
        // Recorded now, so a restart that completes the stop knows what to release.
        Self::apply_release(&mut stopping, release);
        let stopping = self.persist_then_publish(stopping).await?;

        if let Err(source) = backend.stop(&stopping).await {
            if backend.probe(&stopping.id).await.unwrap_or(true) {
                let mut back = (*rec).clone();
                back.updated_at_ms = self.clock.now_ms();
                let _ = self.publish_then_persist(back).await;
                return Err(EdgeError::Backend { backend: backend.name(), op: "stop", id: rec.id.clone(), source });
            }
            tracing::warn!(sandbox_id = %rec.id, error = %source, "stop failed, but the sandbox is gone");
        }
        let mut stopped = (*stopping).clone();
        let now = self.clock.now_ms();
        stopped.state = SandboxStatus::Stopped;
        stopped.updated_at_ms = now;
        stopped.ended_at_ms = now;
        let (stopped, written) = self.publish_then_persist(stopped).await;
        self.queue_release(&stopped);
        written.map(|()| stopped)
    }

    /// Marks a sandbox FAILED and queues its lease as `release` says; the caller holds its
    /// operation lock (or is the recovery, before serving).
    pub(crate) async fn fail_locked(&self, rec: &SandboxRecord, reason: &str, release: Release) -> Arc<SandboxRecord> {
        let now = self.clock.now_ms();
        let mut failed = rec.clone();
        failed.state = SandboxStatus::Failed;
        failed.end_reason = reason.to_string();
        failed.updated_at_ms = now;
        failed.ended_at_ms = now;
        Self::apply_release(&mut failed, release);
        let (failed, _) = self.publish_then_persist(failed).await;
        self.queue_release(&failed);
        failed
    }

    /// Stops every settled live sandbox (shutdown without `keep_sandboxes_on_exit`).
    pub(crate) async fn stop_all(&self, reason: &'static str) {
        let leases: Vec<String> =
            self.table().records().filter(|r| r.state.is_live()).map(|r| r.lease_id.clone()).collect();
        futures::stream::iter(leases)
            .for_each_concurrent(LOOP_CONCURRENCY, |lease| async move {
                let Some(op) = self.op_lock(&lease) else { return };
                let _g = op.lock_owned().await;
                let Some(rec) = self.table().rec(&lease) else { return };
                if rec.state.can_stop()
                    && let Err(e) = self.stop_locked(rec, reason, Release::Yes).await
                {
                    tracing::warn!(lease_id = %lease, error = %e, "stop at shutdown failed");
                }
            })
            .await;
    }
}
