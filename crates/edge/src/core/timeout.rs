//! Changing a sandbox's TTLs.

use super::*;

impl Inner {
    pub(crate) async fn set_timeout(&self, req: &SetSandboxTimeoutRequest) -> Result<Sandbox, EdgeError> {
        let (_g, rec) = self.lock_op(&req.id).await?;
        if !rec.state.can_set_timeout() {
            return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "set its timeout" });
        }
        let now = self.clock.now_ms();
        let mut r = (*rec).clone();
        if let Some(s) = req.ttl_running_stop_s {
            r.spec.ttl_running_stop_s = s;
        }
        if let Some(s) = req.ttl_max_s {
            r.spec.ttl_max_s = s;
        }
        if let Some(s) = req.ttl_paused_s {
            r.spec.ttl_paused_s = s;
            // The paused timeout counts from now, like the idle one.
            if r.state == SandboxStatus::Paused {
                r.paused_since_ms = now;
            }
        }
        r.last_active_ms = now;
        r.updated_at_ms = now;
        let r = self.persist_then_publish(r).await?;
        Ok(self.to_proto(&r))
    }
}
