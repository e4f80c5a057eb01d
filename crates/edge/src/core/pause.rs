//! Pausing (and what a failed pause or resume leaves: the sandbox back as it was, or FAILED when it
//! is gone).

use super::*;

impl Inner {
    pub(crate) async fn pause(&self, id: &str) -> Result<Sandbox, EdgeError> {
        let (_g, rec) = self.lock_op(id).await?;
        if rec.state == SandboxStatus::Paused {
            return Ok(self.to_proto(&rec));
        }
        if !rec.state.can_pause() {
            return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "pause" });
        }
        let paused = self.pause_locked(&rec).await?;
        Ok(self.to_proto(&paused))
    }

    /// Pauses a RUNNING sandbox; the caller holds its operation lock.
    pub(super) async fn pause_locked(&self, rec: &SandboxRecord) -> Result<Arc<SandboxRecord>, EdgeError> {
        let backend = self.backend_of(rec)?.clone();
        let now = self.clock.now_ms();
        let mut pausing = rec.clone();
        pausing.state = SandboxStatus::Pausing;
        pausing.updated_at_ms = now;
        pausing.last_active_ms = now;
        let pausing = self.persist_then_publish(pausing).await?;
        if let Err(e) = backend.pause(&pausing).await {
            return Err(self.op_failed(&backend, &pausing, SandboxStatus::Running, "pause", e).await);
        }
        let mut paused = (*pausing).clone();
        let now = self.clock.now_ms();
        paused.state = SandboxStatus::Paused;
        paused.updated_at_ms = now;
        paused.paused_since_ms = now;
        let (paused, written) = self.publish_then_persist(paused).await;
        written.map(|()| paused)
    }

    /// A pause or resume failed: a sandbox that is still alive goes back to `back_to`, a dead
    /// one is FAILED ("lost") and its lease released.
    pub(super) async fn op_failed(
        &self,
        backend: &Arc<dyn Backend>,
        rec: &SandboxRecord,
        back_to: SandboxStatus,
        op: &'static str,
        source: BackendError,
    ) -> EdgeError {
        match backend.probe(&rec.id).await {
            Ok(false) => {
                tracing::warn!(sandbox_id = %rec.id, op, error = %source, "sandbox lost during an operation");
                self.lose_locked(backend, rec).await;
            }
            _ => {
                let mut back = rec.clone();
                back.state = back_to;
                back.updated_at_ms = self.clock.now_ms();
                let _ = self.publish_then_persist(back).await;
            }
        }
        EdgeError::Backend { backend: backend.name(), op, id: rec.id.clone(), source }
    }
}
