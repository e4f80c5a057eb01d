//! JSON forms of the API's messages for `--json` output: the canonical proto3 JSON that
//! `opendsec-proto` generates (pbjson) with the protos' field names, every field present,
//! enums by name (`SANDBOX_STATE_RUNNING`), 64-bit integers as strings and bytes as base64,
//! so that a field added to a proto appears here by itself and any protobuf library parses
//! the output.

use opendsec_proto::v1 as pb;
use serde_json::Value;

/// A state's short name for tables and text (`RUNNING`).
pub fn state_name(s: i32) -> &'static str {
    let name = pb::SandboxState::try_from(s).unwrap_or(pb::SandboxState::Unspecified).as_str_name();
    name.strip_prefix("SANDBOX_STATE_").unwrap_or(name)
}

pub fn parse_state(s: &str) -> Option<pb::SandboxState> {
    pb::SandboxState::from_str_name(&format!("SANDBOX_STATE_{}", s.to_ascii_uppercase()))
        .filter(|s| *s != pb::SandboxState::Unspecified)
}

/// Any API message (or a list, or an optional one) as its canonical JSON.
pub fn of<T: serde::Serialize + ?Sized>(m: &T) -> Value {
    serde_json::to_value(m).expect("generated message serializers do not fail")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The output is canonical proto3 JSON: nested as the proto is, every field present,
    /// enums by name, 64-bit integers as strings; and it parses back into the same message.
    #[test]
    fn messages_print_as_canonical_json_and_parse_back() {
        let sb = pb::Sandbox {
            id: "e1.l1".into(),
            state: pb::SandboxState::Running as i32,
            created_at_ms: 1_733_000_000_123,
            spec: Some(pb::SandboxSpec {
                project: "root/a".into(),
                labels: [("job".to_string(), "rl".to_string())].into(),
                ..Default::default()
            }),
            ..Default::default()
        };
        let v = of(&sb);
        assert_eq!(v["state"], "SANDBOX_STATE_RUNNING");
        assert_eq!(v["created_at_ms"], "1733000000123");
        assert_eq!(v["spec"]["project"], "root/a");
        assert_eq!(v["spec"]["labels"]["job"], "rl");
        assert_eq!(v["end_reason"], "", "fields at their default are present too");
        let back: pb::Sandbox = serde_json::from_value(v).unwrap();
        assert_eq!(back, sb);
        assert_eq!(state_name(pb::SandboxState::Paused as i32), "PAUSED");
        assert_eq!(parse_state("paused"), Some(pb::SandboxState::Paused));
    }
}
