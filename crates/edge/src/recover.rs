//! Start-up recovery (reference section 5, "Persistence and re-adoption"): before the edge
//! serves, every record is settled.
//!
//! - RUNNING and PAUSED: handed to their backend to adopt; a failed adoption (or a backend no
//!   longer offered) makes the sandbox FAILED and releases its lease;
//! - CREATING, PAUSING, RESUMING: the operation was cut short; whatever the backend left is
//!   stopped and the sandbox is FAILED and its lease released (IAM frees it only if it is still
//!   bound here: the caller has likely retried an interrupted creation elsewhere);
//! - STOPPING: the stop is completed (STOPPED, with the reason it was recorded with);
//! - STOPPED, FAILED: kept for `ended_retention`; leases not yet released are queued again.
//!
//! Then each backend removes leftovers that belong to no adopted sandbox. Records that cannot
//! be read are left alone and their sandboxes protected from that clean-up.

use std::collections::HashSet;
use std::sync::Arc;

use futures::StreamExt;

use opendsec_common::ids;

use crate::core::{Inner, Release};
use crate::error::EdgeError;
use crate::record::{RecordError, SandboxRecord, WriteMode};
use crate::state::{SandboxStatus, end_reason};
use crate::table::OpLock;

/// Sandboxes recovered concurrently.
const RECOVERY_CONCURRENCY: usize = 32;

/// What recovery did, for the start-up log.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RecoveryReport {
    pub adopted: usize,
    pub failed: usize,
    pub ended: usize,
    pub unreadable: usize,
    pub cleaned: usize,
}

enum Outcome {
    /// The sandbox's id and its container's.
    Adopted(String, String),
    Failed,
    Ended,
}

impl Inner {
    pub(crate) async fn recover(&self) -> Result<RecoveryReport, EdgeError> {
        let store = self.store.clone();
        let (records, bad) = tokio::task::spawn_blocking(move || store.load_all())
            .await
            .map_err(|e| RecordError::Join { lease: "*".into(), message: e.to_string() })??;
        let mut report = RecoveryReport { unreadable: bad.len(), ..Default::default() };
        let mut keep = HashSet::new();
        for b in bad {
            tracing::error!(edge = %self.name, lease_id = %b.lease_id, error = %b.error, "unreadable sandbox record left alone");
            keep.insert(ids::sandbox_id(&self.name, &b.lease_id));
            // Or a sandbox that moved in, whose container is named apart.
            keep.insert(format!("{}.{}{}", self.name, crate::core::MOVED_IN_PREFIX, b.lease_id));
        }
        if let Some(r) = records.iter().find(|r| r.edge != self.name) {
            return Err(EdgeError::Options(format!(
                "state dir {} holds records of edge {:?}, not {:?}",
                self.state_dir.display(),
                r.edge,
                self.name
            )));
        }
        {
            let mut t = self.table();
            for rec in &records {
                t.insert(Arc::new(rec.clone()), OpLock::default());
            }
        }
        // Pool members: those a sandbox record names became that sandbox before the restart.
        let named: HashSet<String> =
            records.iter().filter(|r| !r.member.is_empty()).map(|r| r.member.clone()).collect();
        let members = self.load_members(&named).await?;
        // The network first: adopted sandboxes keep their rules, the rest is settled below
        // through their backend's stop (which detaches them).
        if let Some(net) = self.network.clone() {
            let claims: Vec<crate::netpol::Claim> = records
                .iter()
                .filter(|r| r.net_slot != 0 && r.state.is_live())
                .chain(members.iter().filter(|m| m.net_slot != 0 && m.state == SandboxStatus::Running))
                .map(|r| crate::netpol::Claim {
                    id: r.id.clone(),
                    slot: crate::netpol::Slot(r.net_slot),
                    project: r.spec.project.clone(),
                    rules: r.spec.egress_rules(),
                })
                .collect();
            tokio::task::spawn_blocking(move || net.recover(&claims))
                .await
                .map_err(|e| EdgeError::TaskFailed { op: "network recovery", message: e.to_string() })?
                .map_err(EdgeError::NetworkSetup)?;
        }
        let outcomes: Vec<Outcome> = futures::stream::iter(records)
            .map(|rec| self.recover_one(rec))
            .buffer_unordered(RECOVERY_CONCURRENCY)
            .collect()
            .await;
        for o in outcomes {
            match o {
                Outcome::Adopted(id, container) => {
                    report.adopted += 1;
                    keep.insert(id);
                    keep.insert(container);
                }
                Outcome::Failed => report.failed += 1,
                Outcome::Ended => report.ended += 1,
            }
        }
        keep.extend(self.recover_members(members).await);
        for b in &self.backends {
            match b.cleanup(&keep).await {
                Ok(n) => report.cleaned += n,
                // Leftovers waste room but do not make serving unsafe.
                Err(e) => {
                    tracing::error!(edge = %self.name, backend = b.name(), error = %e, "cleaning up leftovers failed")
                }
            }
        }
        tracing::info!(edge = %self.name, ?report, "recovered sandbox records");
        Ok(report)
    }

    async fn recover_one(&self, rec: SandboxRecord) -> Outcome {
        let backend = self.backend(&rec.spec.backend).cloned();
        match rec.state {
            SandboxStatus::Running | SandboxStatus::Paused => {
                let Some(b) = backend else {
                    tracing::warn!(sandbox_id = %rec.id, backend = %rec.spec.backend, "backend no longer offered");
                    self.fail_locked(&rec, end_reason::BACKEND_GONE, Release::Yes).await;
                    return Outcome::Failed;
                };
                match b.adopt(&rec).await {
                    Ok(()) => {
                        // Runtime activity lives in memory and was lost with the old process:
                        // the restart counts as activity, so a sandbox in use is not idled out
                        // by a stale record.
                        self.activity.touch(&rec.lease_id);
                        Outcome::Adopted(rec.id.clone(), rec.container_id().to_string())
                    }
                    Err(e) => {
                        tracing::warn!(sandbox_id = %rec.id, error = %e, "adoption failed");
                        if let Err(e) = b.stop(&rec).await {
                            tracing::warn!(sandbox_id = %rec.id, error = %e, "stop after a failed adoption failed");
                        }
                        self.fail_locked(&rec, end_reason::ADOPT_FAILED, Release::Yes).await;
                        Outcome::Failed
                    }
                }
            }
            SandboxStatus::Creating | SandboxStatus::Pausing | SandboxStatus::Resuming => {
                if let Some(b) = &backend
                    && let Err(e) = b.stop(&rec).await
                {
                    tracing::warn!(sandbox_id = %rec.id, error = %e, "stopping leftovers of an interrupted operation failed");
                }
                // An interrupted creation's lease too: IAM frees it only if it is still bound
                // here (the caller has likely retried elsewhere and rebound it).
                self.fail_locked(&rec, end_reason::EDGE_RESTART, Release::Yes).await;
                Outcome::Failed
            }
            SandboxStatus::Stopping => {
                if let Some(b) = &backend
                    && let Err(e) = b.stop(&rec).await
                {
                    tracing::warn!(sandbox_id = %rec.id, error = %e, "completing an interrupted stop failed");
                }
                let mut stopped = rec;
                let now = self.clock.now_ms();
                stopped.state = SandboxStatus::Stopped;
                stopped.updated_at_ms = now;
                stopped.ended_at_ms = now;
                if stopped.end_reason.is_empty() {
                    stopped.end_reason = end_reason::EDGE_RESTART.to_string();
                }
                let stopped = Arc::new(stopped);
                self.table().publish(stopped.clone());
                if let Err(e) = self.persist(&stopped, WriteMode::Durable).await {
                    tracing::error!(sandbox_id = %stopped.id, error = %e, "record write failed");
                }
                self.queue_release(&stopped);
                Outcome::Ended
            }
            SandboxStatus::Stopped | SandboxStatus::Failed => {
                self.queue_release(&rec);
                Outcome::Ended
            }
        }
    }
}
