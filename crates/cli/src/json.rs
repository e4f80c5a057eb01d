//! JSON forms of the API's messages for `--json` output. Field names follow the protos;
//! enums are printed by name (`RUNNING`), times in unix milliseconds.

use opendsec_proto::v1 as pb;
use serde_json::{Value, json};

pub fn state_name(s: i32) -> &'static str {
    match pb::SandboxState::try_from(s).unwrap_or(pb::SandboxState::Unspecified) {
        pb::SandboxState::Unspecified => "UNSPECIFIED",
        pb::SandboxState::Creating => "CREATING",
        pb::SandboxState::Running => "RUNNING",
        pb::SandboxState::Pausing => "PAUSING",
        pb::SandboxState::Paused => "PAUSED",
        pb::SandboxState::Resuming => "RESUMING",
        pb::SandboxState::Stopping => "STOPPING",
        pb::SandboxState::Stopped => "STOPPED",
        pb::SandboxState::Failed => "FAILED",
    }
}

pub fn parse_state(s: &str) -> Option<pb::SandboxState> {
    pb::SandboxState::from_str_name(&format!("SANDBOX_STATE_{}", s.to_ascii_uppercase()))
        .filter(|s| *s != pb::SandboxState::Unspecified)
}

pub fn resources(r: &Option<pb::Resources>) -> Value {
    let r = r.unwrap_or_default();
    json!({"cpu_millis": r.cpu_millis, "memory_mb": r.memory_mb, "disk_mb": r.disk_mb, "gpus": r.gpus})
}

pub fn sandbox(s: &pb::Sandbox) -> Value {
    let spec = s.spec.clone().unwrap_or_default();
    json!({
        "id": s.id,
        "edge": s.edge,
        "lease_id": s.lease_id,
        "state": state_name(s.state),
        "project": spec.project,
        "image": spec.image,
        "backend": spec.backend,
        "resources": resources(&spec.resources),
        "ttl_running_stop_s": spec.ttl_running_stop_s,
        "ttl_max_s": spec.ttl_max_s,
        "ttl_paused_s": spec.ttl_paused_s,
        "labels": spec.labels,
        "principal": s.principal,
        "created_at_ms": s.created_at_ms,
        "updated_at_ms": s.updated_at_ms,
        "expires_at_ms": s.expires_at_ms,
        "last_active_ms": s.last_active_ms,
        "end_reason": s.end_reason,
    })
}

pub fn quota(q: &Option<pb::Quota>) -> Value {
    let q = q.unwrap_or_default();
    json!({"cpu_millis": q.cpu_millis, "memory_mb": q.memory_mb, "disk_mb": q.disk_mb, "gpus": q.gpus, "sandboxes": q.sandboxes})
}

pub fn project(p: &pb::Project) -> Value {
    let u = p.usage.unwrap_or_default();
    json!({
        "path": p.path,
        "quota": quota(&p.quota),
        "effective": quota(&p.effective),
        "usage": {"cpu_millis": u.cpu_millis, "memory_mb": u.memory_mb, "disk_mb": u.disk_mb, "gpus": u.gpus, "sandboxes": u.sandboxes},
        "created_at_ms": p.created_at_ms,
    })
}

pub fn principal(p: &pb::Principal) -> Value {
    json!({"name": p.name, "project": p.project, "created_at_ms": p.created_at_ms})
}

pub fn token_info(t: &pb::TokenInfo) -> Value {
    json!({"id": t.id, "principal": t.principal, "description": t.description, "created_at_ms": t.created_at_ms, "expires_at_ms": t.expires_at_ms, "revoked": t.revoked})
}

pub fn grant(g: &pb::Grant) -> Value {
    json!({"principal": g.principal, "project": g.project, "permission": g.permission})
}

pub fn image(i: &pb::Image) -> Value {
    let c = i.config.clone().unwrap_or_default();
    json!({
        "project": i.project,
        "repo": i.repo,
        "tag": i.tag,
        "layers": i.layers,
        "config": {"env": c.env, "workdir": c.workdir, "user": c.user, "entrypoint": c.entrypoint, "cmd": c.cmd},
        "created_at_ms": i.created_at_ms,
        "source": i.source,
    })
}
