//! Resuming a paused sandbox.

use super::*;

impl Inner {
    pub(crate) async fn resume(&self, id: &str) -> Result<Sandbox, EdgeError> {
        let (_g, rec) = self.lock_op(id).await?;
        if rec.state == SandboxStatus::Running {
            return Ok(self.to_proto(&rec));
        }
        if !rec.state.can_resume() {
            return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "resume" });
        }
        let running = self.resume_locked(&rec).await?;
        Ok(self.to_proto(&running))
    }

    /// Resumes a PAUSED sandbox; the caller holds its operation lock.
    pub(super) async fn resume_locked(&self, rec: &SandboxRecord) -> Result<Arc<SandboxRecord>, EdgeError> {
        let backend = self.backend_of(rec)?.clone();
        let mut resuming = rec.clone();
        resuming.state = SandboxStatus::Resuming;
        resuming.updated_at_ms = self.clock.now_ms();
        let resuming = self.persist_then_publish(resuming).await?;
        if let Err(e) = backend.resume(&resuming).await {
            return Err(self.op_failed(&backend, &resuming, SandboxStatus::Paused, "resume", e).await);
        }
        let mut running = (*resuming).clone();
        let now = self.clock.now_ms();
        running.state = SandboxStatus::Running;
        running.updated_at_ms = now;
        running.last_active_ms = now;
        running.paused_since_ms = 0;
        let (running, written) = self.publish_then_persist(running).await;
        written.map(|()| running)
    }
}
