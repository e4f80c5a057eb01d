//! Snapshots: under the sandbox's operation lock (no pause, resume or stop meanwhile), the
//! backend freezes a RUNNING or PAUSED sandbox, copies what it wrote into a layer of the image
//! store and lets it run again as it was. The record does not change: a snapshot is not a
//! lifecycle step. Registering the image is the apiserver's (it checks the name and the
//! caller's permissions).

use opendsec_proto::v1::EdgeSnapshot;

use super::*;

impl Inner {
    /// Saves the sandbox's session now (`Snapshotter::save_session`), under its operation lock.
    pub(crate) async fn save_session(&self, id: &str) -> Result<opendsec_proto::v1::SessionSaved, EdgeError> {
        let (_g, rec) = self.lock_op(id).await?;
        if rec.state != SandboxStatus::Running && rec.state != SandboxStatus::Paused {
            return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "save its session" });
        }
        let backend = self.backend_of(&rec)?.clone();
        let Some(snapshotter) = backend.snapshotter() else {
            return Err(EdgeError::InvalidArgument(format!("backend {} has no sessions", backend.name())));
        };
        let bytes = snapshotter.save_session(&rec).await.map_err(|source| EdgeError::Backend {
            backend: backend.name(),
            op: "save the session of",
            id: rec.id.clone(),
            source,
        })?;
        let name = rec.spec.session.as_ref().map(|s| s.name.clone()).unwrap_or_default();
        tracing::info!(sandbox_id = %rec.id, session = %name, bytes, "session saved on demand");
        Ok(opendsec_proto::v1::SessionSaved { name, bytes })
    }

    pub(crate) async fn snapshot(&self, id: &str, pack_diff: bool) -> Result<EdgeSnapshot, EdgeError> {
        let (_g, rec) = self.lock_op(id).await?;
        if rec.state != SandboxStatus::Running && rec.state != SandboxStatus::Paused {
            return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "snapshot" });
        }
        let backend = self.backend_of(&rec)?.clone();
        if let Some(vm) = backend.vm_snapshotter() {
            return self.snapshot_vm(&rec, backend.name(), vm, pack_diff).await;
        }
        let Some(snapshotter) = backend.snapshotter() else {
            return Err(EdgeError::InvalidArgument(format!(
                "backend {} cannot snapshot sandboxes (container, fncall and microvm can)",
                backend.name()
            )));
        };
        let taken = snapshotter.snapshot(&rec, pack_diff).await.map_err(|source| EdgeError::Backend {
            backend: backend.name(),
            op: "snapshot",
            id: rec.id.clone(),
            source,
        })?;
        tracing::info!(
            sandbox_id = %rec.id,
            layer = %taken.layer.id,
            bytes = taken.layer.size_bytes,
            entries = taken.layer.entries,
            frozen_ms = taken.frozen.as_millis() as u64,
            "snapshot taken"
        );
        Ok(EdgeSnapshot {
            layers: taken.layers.iter().map(|l| l.as_str().to_string()).collect(),
            layer: taken.layer.id.as_str().to_string(),
            layer_bytes: taken.layer.size_bytes,
            layer_entries: taken.layer.entries,
            frozen_ms: taken.frozen.as_millis() as u64,
            vm_snapshot: String::new(),
            vm_snapshot_bytes: 0,
        })
    }

    /// A VM's memory snapshot (under the operation lock taken by the caller).
    async fn snapshot_vm(
        &self,
        rec: &SandboxRecord,
        backend: &'static str,
        vm: &dyn crate::backend::VmSnapshotter,
        pack_diff: bool,
    ) -> Result<EdgeSnapshot, EdgeError> {
        if pack_diff {
            return Err(EdgeError::InvalidArgument(
                "pack_diff leaves files out of a file system snapshot; a microvm's snapshot keeps its memory and disk whole"
                    .into(),
            ));
        }
        let taken = vm.snapshot_vm(rec).await.map_err(|source| EdgeError::Backend {
            backend,
            op: "snapshot",
            id: rec.id.clone(),
            source,
        })?;
        tracing::info!(
            sandbox_id = %rec.id,
            vm_snapshot = %taken.id,
            bytes = taken.bytes,
            frozen_ms = taken.frozen.as_millis() as u64,
            "vm snapshot taken"
        );
        Ok(EdgeSnapshot {
            layers: taken.layers.iter().map(|l| l.as_str().to_string()).collect(),
            layer: String::new(),
            layer_bytes: 0,
            layer_entries: 0,
            frozen_ms: taken.frozen.as_millis() as u64,
            vm_snapshot: taken.id,
            vm_snapshot_bytes: taken.bytes,
        })
    }
}
