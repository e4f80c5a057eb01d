//! Sandboxes that move between edges ([C 26.2]): where calls go, and the move itself.
//!
//! A sandbox id names the edge it was created on; a sandbox that moved runs elsewhere under the
//! same id. Calls find it through, in order: what edges answered here (`moved_to`, learned in
//! [`Routes`]), the cluster snapshot (edges report the sandboxes that moved in), the id. An
//! edge a sandbox is moving away from answers `unavailable` with `moving_to`: [`follow`] waits
//! and asks again, so a call made during a move lands on the copy once it runs.
//!
//! The move ([`move_sandbox`]): the source freezes the sandbox and copies its file system
//! (`MoveOut`), IAM rebinds the lease to the target (Admit of the existing lease), the target
//! starts the copy under the same id, and the source stops the original (`FinishMove`). If the
//! copy does not start, the lease is bound back and the original runs on. The source stays
//! frozen throughout: never two running copies.

use std::future::Future;
use std::time::{Duration, Instant};

use opendsec_common::reason::{MOVED_TO, MOVING_TO};
use opendsec_common::{ApiError, Reason, ids};
use opendsec_proto::v1 as pb;

use crate::forward;
use crate::state::Shared;

/// Longest a call waits for a move to finish.
pub const MOVE_WAIT: Duration = Duration::from_secs(120);
/// Most `moved_to` hops one call follows (a sandbox moved on and on).
const MAX_HOPS: usize = 8;
/// How long the source may take to freeze and copy a sandbox (bounded by its disk).
const MOVE_OUT_TIMEOUT: Duration = Duration::from_secs(600);
/// Moving sandboxes between edges is the operator's: this permission on the root project.
pub const PERM_EDGE_MANAGE: &str = "edge.manage";

/// The edge to ask about sandbox `id` first.
pub(crate) fn route(s: &Shared, id: &str) -> Result<String, ApiError> {
    let (edge, _) = ids::split_sandbox_id(id)?;
    if let Some(e) = s.routes.get(id) {
        return Ok(e);
    }
    Ok(s.snapshot().moved.get(id).cloned().unwrap_or_else(|| edge.to_string()))
}

/// Runs `f` against the edge holding sandbox `id`, following moves: an edge the sandbox moved
/// away from names where it went, one it is moving away from says to ask again shortly.
/// Returns the edge that answered and its answer.
pub(crate) async fn follow<T, F, Fut>(s: &Shared, id: &str, mut f: F) -> Result<(String, T), ApiError>
where
    F: FnMut(String) -> Fut,
    Fut: Future<Output = Result<T, ApiError>>,
{
    let deadline = Instant::now() + MOVE_WAIT;
    let mut hops = 0;
    loop {
        let learned = s.routes.get(id).is_some();
        let edge = route(s, id)?;
        let err = match f(edge.clone()).await {
            Ok(v) => return Ok((edge, v)),
            Err(e) => e,
        };
        if err.reason == Reason::NotFound && learned && hops < MAX_HOPS {
            // The edge it moved to forgot it (it moved on, or back): the snapshot and the id
            // know better now.
            hops += 1;
            s.routes.forget(id);
            continue;
        }
        if err.reason != Reason::Unavailable {
            return Err(err);
        }
        if let Some(to) = err.metadata.get(MOVED_TO).filter(|to| ids::validate_edge(to).is_ok() && **to != edge)
            && hops < MAX_HOPS
        {
            hops += 1;
            s.routes.learn(id, to);
            continue;
        }
        if err.metadata.contains_key(MOVING_TO) && Instant::now() < deadline {
            let wait = err.metadata.get("retry_after_ms").and_then(|v| v.parse().ok()).unwrap_or(50u64).clamp(5, 1000);
            tokio::time::sleep(Duration::from_millis(wait)).await;
            continue;
        }
        return Err(err);
    }
}

/// Moves sandbox `sb`, found on `from`, to edge `to`; the caller checked the permissions.
pub(crate) async fn move_sandbox(
    s: &Shared,
    token: &str,
    from: &str,
    sb: &pb::Sandbox,
    to: &str,
) -> Result<pb::Sandbox, ApiError> {
    let project = sb.spec.as_ref().map(|sp| sp.project.clone()).unwrap_or_default();
    // A draining edge takes nothing: refused before the sandbox is frozen and copied.
    if s.snapshot().edges.iter().any(|e| e.name == to && e.draining) {
        return Err(ApiError::new(Reason::NoCapacity, format!("edge {to} is draining")).with("edge", to));
    }
    let to_addr = match s.snapshot().addrs.get(to) {
        Some((addr, true)) => addr.clone(),
        Some((_, false)) => {
            return Err(ApiError::new(Reason::Unavailable, format!("edge {to} is not healthy")).with("edge", to));
        }
        None => return Err(ApiError::not_found(format!("edge {to} is not known")).with("edge", to)),
    };
    let started = Instant::now();
    let out_req = forward::to_edge(pb::EdgeMoveOutRequest { id: sb.id.clone(), to_edge: to.to_string() }, &project)?;
    let mut c = s.up.edge(from, &s.edge_addr(from)?)?;
    let out = match forward::within(from, Some(MOVE_OUT_TIMEOUT), async move { c.move_out(out_req).await }).await {
        Ok(out) => out,
        Err(e) => {
            // An answer lost or late may leave the sandbox frozen: let it run on. Not when
            // the edge refused (another move holds it, or nothing began).
            let refused = matches!(
                e.reason,
                Reason::InvalidArgument | Reason::InvalidState | Reason::NotFound | Reason::PermissionDenied
            ) || e.metadata.contains_key(MOVING_TO)
                || e.metadata.contains_key(MOVED_TO);
            if !refused {
                abandon(s, from, &sb.id, &project).await;
            }
            return Err(e);
        }
    };
    let copied_ms = started.elapsed().as_millis();
    let spec = out.spec.clone().unwrap_or_default();

    // The lease follows the copy: the target's check after creation finds it bound there.
    if let Err(e) = rebind(s, token, &out.lease_id, &spec, to).await {
        abandon(s, from, &sb.id, &project).await;
        return Err(e);
    }
    let create = pb::EdgeCreateRequest {
        lease_id: out.lease_id.clone(),
        spec: Some(spec.clone()),
        principal: out.principal.clone(),
        pool_revision: String::new(),
        moved_in: out.moved_in.clone(),
        member_lease: String::new(),
    };
    let created = match s.up.edge(to, &to_addr) {
        Ok(mut c) => forward::edge_call(s, to, c.create_sandbox(create)).await,
        Err(e) => Err(e),
    };
    let running = |c: &pb::Sandbox| c.state == pb::SandboxState::Running as i32 && c.edge == to && c.id == sb.id;
    let created = match created {
        Ok(copy) if running(&copy) => Ok(copy),
        Ok(copy) => Err(ApiError::internal(format!(
            "edge {to} answered the copy of {} as {:?}",
            sb.id,
            pb::SandboxState::try_from(copy.state).unwrap_or_default()
        ))),
        Err(e) => Err(e),
    };
    let copy = match created {
        Ok(copy) => copy,
        Err(e) => match forward::edge_get(s, to, &sb.id).await {
            // The answer was lost, not the copy.
            Ok(copy) if running(&copy) => copy,
            Ok(copy) if copy.state == pb::SandboxState::Creating as i32 => {
                // Still starting: the source settles the move once it is old enough (from
                // where IAM binds the lease, the target's now).
                tracing::warn!(sandbox_id = %sb.id, to, error = %e, "move: the copy is still starting");
                return Err(e);
            }
            Err(ge) if ge.reason != Reason::NotFound => {
                // Whether a copy runs is unknown: thawing the original could make two. The
                // source settles the move later, from where IAM binds the lease.
                tracing::warn!(sandbox_id = %sb.id, to, error = %ge, "move: the copy's state is unknown");
                return Err(e);
            }
            _ => {
                tracing::warn!(sandbox_id = %sb.id, to, error = %e, "move: the copy did not start; the original stays");
                if let Err(be) = rebind(s, token, &out.lease_id, &spec, from).await {
                    tracing::error!(sandbox_id = %sb.id, error = %be, "move: binding the lease back failed");
                }
                abandon(s, from, &sb.id, &project).await;
                return Err(e);
            }
        },
    };
    s.routes.learn(&sb.id, to);
    let fin = forward::to_edge(pb::EdgeFinishMoveRequest { id: sb.id.clone(), committed: true }, &project)?;
    let finished = forward::edge_forward(s, from, |mut c| async move { c.finish_move(fin).await }).await;
    if let Err(e) = finished {
        // The copy runs and the lease is its; the frozen original is stopped by its edge
        // later (a stale move whose lease is bound elsewhere is committed).
        tracing::warn!(sandbox_id = %sb.id, from, error = %e, "move: stopping the original failed; its edge will");
    }
    tracing::info!(
        sandbox_id = %sb.id,
        from,
        to,
        layer_bytes = out.layer_bytes,
        frozen_ms = out.frozen_ms,
        copied_ms = copied_ms as u64,
        total_ms = started.elapsed().as_millis() as u64,
        "sandbox moved"
    );
    Ok(copy)
}

/// Binds the existing lease to `edge` (an Admit of it only rebinds).
async fn rebind(s: &Shared, token: &str, lease: &str, spec: &pb::SandboxSpec, edge: &str) -> Result<(), ApiError> {
    let admit = pb::AdmitRequest {
        token: token.to_string(),
        lease_id: lease.to_string(),
        project: spec.project.clone(),
        resources: spec.resources,
        edge: edge.to_string(),
        keep_existing: false,
        egress: spec.network.as_ref().map(|n| n.egress.clone()).unwrap_or_default(),
        pool: String::new(),
    };
    let a =
        s.up.iam(|mut c| {
            let r = admit.clone();
            async move { c.admit(r).await }
        })
        .await?;
    if !a.rebound && a.edge != edge {
        return Err(ApiError::internal(format!("IAM did not rebind lease {lease} to {edge}")));
    }
    Ok(())
}

/// The move is off: the original runs on where it was.
async fn abandon(s: &Shared, from: &str, id: &str, project: &str) {
    let req = match forward::to_edge(pb::EdgeFinishMoveRequest { id: id.to_string(), committed: false }, project) {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(sandbox_id = %id, error = %e, "move: cannot abandon");
            return;
        }
    };
    if let Err(e) = forward::edge_forward(s, from, |mut c| async move { c.finish_move(req).await }).await {
        tracing::error!(sandbox_id = %id, from, error = %e, "move: abandoning failed; the source settles it later");
    }
}
