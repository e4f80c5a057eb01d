//! Replacing a sandbox's egress rules (UpdateNetwork): the kernel's sets change in one
//! transaction, then the record; if the record cannot be written, the old rules go back.

use super::*;

use opendsec_common::egress;
use opendsec_proto::v1::UpdateNetworkRequest;

impl Inner {
    pub(crate) async fn update_network(&self, req: &UpdateNetworkRequest) -> Result<Sandbox, EdgeError> {
        let rules = egress::from_pb_list(req.network.as_ref().map(|n| n.egress.as_slice()).unwrap_or(&[]))
            .map_err(|e| EdgeError::InvalidArgument(format!("network: {e}")))?;
        let (_g, rec) = self.lock_op(&req.id).await?;
        if !rec.state.can_set_timeout() {
            return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "change its network" });
        }
        let old = rec.spec.egress_rules();
        let apply = |rules: Vec<egress::Rule>| {
            let net = self.network.clone();
            let (id, slot) = (rec.id.clone(), rec.net_slot);
            async move {
                let Some(net) = net.filter(|_| slot != 0) else { return Ok(()) };
                let id2 = id.clone();
                tokio::task::spawn_blocking(move || net.update(&id2, &rules))
                    .await
                    .map_err(|e| EdgeError::TaskFailed { op: "update network", message: e.to_string() })?
                    .map_err(|source| EdgeError::Network { id, source })
            }
        };
        apply(rules.clone()).await?;
        let now = self.clock.now_ms();
        let mut r = (*rec).clone();
        r.spec.egress = Some(rules.iter().map(|r| r.to_string()).collect());
        r.last_active_ms = now;
        r.updated_at_ms = now;
        match self.persist_then_publish(r).await {
            Ok(r) => Ok(self.to_proto(&r)),
            Err(e) => {
                if let Err(back) = apply(old).await {
                    tracing::error!(sandbox_id = %rec.id, error = %back, "restoring the old rules failed");
                }
                Err(e)
            }
        }
    }
}
