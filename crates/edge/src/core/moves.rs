//! Moves between edges ([C 26.2]), the source's half: the apiserver drives a move as
//! `MoveOut` here, the lease rebound to the target in IAM, a creation on the target carrying
//! [`MovedIn`], then `FinishMove` here (committed, or abandoned when the copy did not start).
//!
//! Invariants:
//! - never two running copies: the source is frozen (paused) before its file system is copied,
//!   and stays frozen until it is stopped (commit) or let run again (abort);
//! - while moving, every call on the sandbox but the move's own is refused with `Moving`
//!   (`unavailable`, `moving_to`): the apiserver waits and asks again; calls that were already
//!   in flight when the move began finish first (up to [`MOVE_DRAIN`]);
//! - after the commit the record stays, STOPPED with end reason `moved`, and answers `Moved`
//!   (`moved_to`) until it is deleted with the other ended records; its lease is not ours to
//!   release;
//! - a move has one driver: `MoveOut` on a sandbox already moving (or moved) is refused, so two
//!   apiservers moving one sandbox at once cannot both drive it (the second would undo the
//!   first's copy);
//! - a move left unfinished (the apiserver died) is settled after `edge.move_stale` from where
//!   IAM binds the lease: here or nowhere, the move is abandoned and the sandbox runs on;
//!   elsewhere for that long, it is committed. A sandbox is never stopped on a guess.

use std::time::Duration;

use opendsec_proto::v1::{EdgeFinishMoveRequest, EdgeMoveOut, EdgeMoveOutRequest, MovedIn};

use super::*;
use crate::record::MoveRecord;

/// How long a move waits for the calls in flight on the sandbox to end before freezing it
/// (longer ones are cut by the freeze and the stop).
pub(crate) const MOVE_DRAIN: Duration = Duration::from_secs(30);

impl Inner {
    /// A move's first half: calls held off, those in flight drained, the sandbox frozen and
    /// its file system snapshotted. Refused while another move holds the sandbox.
    pub(crate) async fn move_out(&self, req: &EdgeMoveOutRequest) -> Result<EdgeMoveOut, EdgeError> {
        ids::validate_edge(&req.to_edge).map_err(|e| EdgeError::InvalidArgument(format!("to_edge: {}", e.message)))?;
        if self.closing.load(Ordering::Relaxed) {
            return Err(EdgeError::ShuttingDown { edge: self.name.clone() });
        }
        let (_g, rec) = self.lock_op_any(&req.id).await?;
        if req.to_edge == self.name {
            return Err(EdgeError::InvalidArgument(format!("sandbox {} already runs on edge {}", rec.id, self.name)));
        }
        Self::check_not_moving(&rec)?;
        if !matches!(rec.state, SandboxStatus::Running | SandboxStatus::Paused) {
            return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "move" });
        }
        let backend = self.backend_of(&rec)?.clone();
        let Some(snapshotter) = backend.snapshotter() else {
            return Err(EdgeError::InvalidArgument(format!(
                "backend {} cannot move sandboxes (the container backend can)",
                backend.name()
            )));
        };
        let mut moving = (*rec).clone();
        let now = self.clock.now_ms();
        moving.moved.moving_to = req.to_edge.clone();
        moving.moved.moving_since_ms = now;
        moving.moved.resume_on_abort = rec.state == SandboxStatus::Running;
        moving.updated_at_ms = now;
        let rec = self.persist_then_publish(moving).await?;
        match self.freeze_and_copy(&rec, snapshotter).await {
            Ok(out) => Ok(out),
            Err(e) => {
                // Whatever failed, the sandbox runs on here as it was.
                let latest = self.table().rec(&rec.lease_id);
                if let Some(latest) = latest
                    && let Err(ae) = self.abort_move_locked(&latest).await
                {
                    tracing::error!(sandbox_id = %rec.id, error = %ae, "abandoning a failed move failed");
                }
                Err(e)
            }
        }
    }

    async fn freeze_and_copy(
        &self,
        rec: &Arc<SandboxRecord>,
        snapshotter: &dyn crate::backend::Snapshotter,
    ) -> Result<EdgeMoveOut, EdgeError> {
        // Calls that got in before the move wrote its intent finish first. A paused sandbox
        // runs none: its counted calls wait for the resume this move's lock holds off.
        let waited = std::time::Instant::now();
        while rec.state == SandboxStatus::Running && self.activity.of(&rec.lease_id).0 > 0 {
            if waited.elapsed() >= MOVE_DRAIN {
                tracing::warn!(sandbox_id = %rec.id, "calls still in flight after the drain; freezing anyway");
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let frozen = if rec.state == SandboxStatus::Running { self.pause_locked(rec).await? } else { rec.clone() };
        let backend = self.backend_of(&frozen)?.clone();
        // Everything the sandbox wrote goes along (no pack_diff: /tmp and caches too).
        let taken = snapshotter.snapshot(&frozen, false).await.map_err(|source| EdgeError::Backend {
            backend: backend.name(),
            op: "snapshot for a move",
            id: frozen.id.clone(),
            source,
        })?;
        // The stale clock counts from the handover, not from the start of a long copy.
        let mut handed = (*frozen).clone();
        handed.moved.moving_since_ms = self.clock.now_ms();
        let (handed, written) = self.publish_then_persist(handed).await;
        written?;
        tracing::info!(
            sandbox_id = %handed.id,
            to = %handed.moved.moving_to,
            layer = %taken.layer.id,
            bytes = taken.layer.size_bytes,
            "sandbox frozen and copied for a move"
        );
        Ok(EdgeMoveOut {
            moved_in: Some(MovedIn {
                id: handed.id.clone(),
                from_edge: self.name.clone(),
                layers: taken.layers.iter().map(|l| l.as_str().to_string()).collect(),
                image_env: taken.image_env,
                created_at_ms: handed.created_at_ms,
                last_active_ms: handed.last_active_ms.max(self.active_ms(&handed.lease_id, self.clock.now_ms())),
            }),
            lease_id: handed.lease_id.clone(),
            principal: handed.principal.clone(),
            spec: Some(handed.spec.to_proto()),
            layer_bytes: taken.layer.size_bytes,
            frozen_ms: taken.frozen.as_millis() as u64,
        })
    }

    /// A move's second half. Idempotent: a finished move answers as it ended.
    pub(crate) async fn finish_move(&self, req: &EdgeFinishMoveRequest) -> Result<Sandbox, EdgeError> {
        let (_g, rec) = self.lock_op_any(&req.id).await?;
        if !rec.moved.moved_to.is_empty() && rec.state.is_ended() {
            return if req.committed {
                Ok(self.to_proto(&rec))
            } else {
                Err(EdgeError::Moved { id: rec.id.clone(), to: rec.moved.moved_to.clone() })
            };
        }
        if !rec.moved.is_moving() && rec.moved.moved_to.is_empty() {
            return if req.committed {
                Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "finish a move it is not in" })
            } else {
                Ok(self.to_proto(&rec))
            };
        }
        let done =
            if req.committed { self.commit_move_locked(&rec).await? } else { self.abort_move_locked(&rec).await? };
        Ok(self.to_proto(&done))
    }

    /// The copy runs elsewhere: calls go there from now on, then the original is stopped
    /// (its lease is the copy's).
    async fn commit_move_locked(&self, rec: &SandboxRecord) -> Result<Arc<SandboxRecord>, EdgeError> {
        let mut moved = rec.clone();
        if moved.moved.is_moving() {
            moved.moved.moved_to = std::mem::take(&mut moved.moved.moving_to);
            moved.moved.moving_since_ms = 0;
            moved.moved.resume_on_abort = false;
            moved.updated_at_ms = self.clock.now_ms();
            moved = (*self.persist_then_publish(moved).await?).clone();
        }
        tracing::info!(sandbox_id = %moved.id, to = %moved.moved.moved_to, "move committed; stopping the original");
        self.stop_locked(Arc::new(moved), end_reason::MOVED, Release::No).await
    }

    /// The move is abandoned: the sandbox runs on here as before.
    async fn abort_move_locked(&self, rec: &SandboxRecord) -> Result<Arc<SandboxRecord>, EdgeError> {
        if !rec.moved.is_moving() {
            return Ok(Arc::new(rec.clone()));
        }
        let mut back = rec.clone();
        let resume = back.moved.resume_on_abort;
        back.moved = MoveRecord {
            moving_to: String::new(),
            moving_since_ms: 0,
            resume_on_abort: false,
            ..std::mem::take(&mut back.moved)
        };
        back.updated_at_ms = self.clock.now_ms();
        let back = self.persist_then_publish(back).await?;
        tracing::info!(sandbox_id = %back.id, "move abandoned; the sandbox stays here");
        if resume && back.state == SandboxStatus::Paused {
            return self.resume_locked(&back).await;
        }
        Ok(back)
    }

    /// Settles a move nobody finished: from where IAM binds the lease now.
    pub(super) async fn settle_stale_move(&self, lease: &str) {
        let Some(op) = self.op_lock(lease) else { return };
        let _g = op.lock_owned().await;
        let Some(rec) = self.table().rec(lease) else { return };
        let now = self.clock.now_ms();
        let stale = i64::try_from(self.cfg.move_stale.as_millis()).unwrap_or(i64::MAX);
        let unfinished_stop = !rec.moved.moved_to.is_empty() && rec.state.is_live();
        let stale_move = rec.moved.is_moving() && rec.moved.moving_since_ms.saturating_add(stale) <= now;
        if !unfinished_stop && !stale_move {
            return;
        }
        if unfinished_stop {
            if let Err(e) = self.stop_locked(rec, end_reason::MOVED, Release::No).await {
                tracing::warn!(lease_id = %lease, error = %e, "stopping a moved sandbox failed; will retry");
            }
            return;
        }
        let bound = match self.remote.lease(lease).await {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(lease_id = %lease, error = %e, "cannot settle a stale move without IAM; will retry");
                return;
            }
        };
        let settled = match bound {
            // Bound elsewhere for longer than a move takes: the lease outlived IAM's
            // reconciliation with that edge, which releases leases their edge does not hold,
            // so the copy runs there.
            Some((edge, bound_at)) if edge != self.name => {
                if bound_at.saturating_add(stale) > now {
                    return; // rebound lately: asked again next round
                }
                let mut to = (*rec).clone();
                to.moved.moving_to = edge;
                self.commit_move_locked(&to).await
            }
            // Bound here: the copy never took over. Gone: no copy holds it (a copy that
            // failed, or ended); the original runs on, and IAM's reconciliation adopts its
            // lease again. Never stopped on a guess: it may be the only instance.
            _ => self.abort_move_locked(&rec).await,
        };
        match settled {
            Ok(r) => tracing::warn!(sandbox_id = %r.id, state = %r.state, "settled a move left unfinished"),
            Err(e) => tracing::warn!(lease_id = %lease, error = %e, "settling a stale move failed; will retry"),
        }
    }
}
