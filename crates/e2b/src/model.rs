//! The JSON messages of E2B's APIs (reference/e2b-protocol.md sections 2 and 3.2): requests
//! are read leniently (unknown keys ignored, proto JSON's snake_case names accepted beside
//! the camelCase ones), answers are written as the SDK reads them.

use std::collections::HashMap;

use base64::Engine;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

// ---- REST

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct NewSandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    pub timeout: Option<u64>,
    pub auto_pause: Option<bool>,
    /// Whether an auto-pause keeps memory (E2B's default) or the file system only.
    pub auto_pause_memory: Option<bool>,
    pub auto_resume: Option<serde_json::Value>,
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
    pub network: Option<Network>,
    pub metadata: Option<HashMap<String, String>>,
    pub env_vars: Option<HashMap<String, String>>,
    pub mcp: Option<serde_json::Value>,
    pub volume_mounts: Option<Vec<serde_json::Value>>,
    pub secure: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct Network {
    pub allow_out: Option<Vec<String>>,
    pub deny_out: Option<Vec<String>>,
    pub dns_servers: Option<Vec<String>>,
    pub allow_public_traffic: Option<bool>,
    pub egress_proxy: Option<serde_json::Value>,
    pub rules: Option<serde_json::Value>,
    #[serde(rename = "allow_internet_access")]
    pub allow_internet_access: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Timeout {
    pub timeout: Option<u64>,
}

/// The answer to create and connect.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Sandbox {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub envd_version: &'static str,
    pub alias: Option<String>,
    pub envd_access_token: String,
    pub traffic_access_token: Option<String>,
    pub domain: Option<String>,
}

/// `GET /sandboxes/{id}` and the elements of the lists.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct SandboxDetail {
    #[serde(rename = "templateID")]
    pub template_id: String,
    #[serde(rename = "sandboxID")]
    pub sandbox_id: String,
    #[serde(rename = "clientID")]
    pub client_id: String,
    pub alias: Option<String>,
    pub started_at: String,
    pub end_at: String,
    pub envd_version: &'static str,
    pub cpu_count: u32,
    #[serde(rename = "memoryMB")]
    pub memory_mb: u64,
    #[serde(rename = "diskSizeMB")]
    pub disk_size_mb: u64,
    pub state: &'static str,
    pub metadata: HashMap<String, String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub envd_access_token: Option<String>,
    pub domain: Option<String>,
}

/// RFC 3339 in UTC with milliseconds, from unix milliseconds.
pub fn rfc3339(ms: i64) -> String {
    // RFC 3339 has four-digit years: a sandbox's file may claim any time.
    const LAST_MS: i64 = 253_402_300_799_999; // 9999-12-31T23:59:59.999Z
    let ms = ms.clamp(0, LAST_MS) as u64;
    let t = std::time::UNIX_EPOCH + std::time::Duration::from_millis(ms);
    // humantime writes `2025-01-01T00:00:00.123Z` (precision as asked).
    humantime::format_rfc3339_millis(t).to_string()
}

// ---- envd: process

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ProcessConfig {
    pub cmd: String,
    pub args: Vec<String>,
    pub envs: HashMap<String, String>,
    pub cwd: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct PtySize {
    pub cols: u32,
    pub rows: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Pty {
    pub size: Option<PtySize>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StartRequest {
    pub process: Option<ProcessConfig>,
    pub pty: Option<Pty>,
    pub tag: Option<String>,
    pub stdin: Option<bool>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Selector {
    pub pid: Option<u32>,
    pub tag: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct SelectorRequest {
    pub process: Option<Selector>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct UpdateRequest {
    pub process: Option<Selector>,
    pub pty: Option<Pty>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ProcessInput {
    #[serde(deserialize_with = "b64_opt")]
    pub stdin: Option<Vec<u8>>,
    #[serde(deserialize_with = "b64_opt")]
    pub pty: Option<Vec<u8>>,
}

impl ProcessInput {
    pub fn bytes(self) -> Vec<u8> {
        self.stdin.or(self.pty).unwrap_or_default()
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct SendInputRequest {
    pub process: Option<Selector>,
    pub input: Option<ProcessInput>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StreamInputData {
    pub input: Option<ProcessInput>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct StreamInputRequest {
    pub start: Option<SelectorRequest>,
    pub data: Option<StreamInputData>,
    pub keepalive: Option<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct SendSignalRequest {
    pub process: Option<Selector>,
    pub signal: Option<serde_json::Value>,
}

/// A process's event, as `{"event": {...}}`.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Event {
    Start { pid: u32 },
    Data(Data),
    End(End),
    Keepalive {},
}

#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum Data {
    Stdout(#[serde(serialize_with = "b64")] Vec<u8>),
    Stderr(#[serde(serialize_with = "b64")] Vec<u8>),
    Pty(#[serde(serialize_with = "b64")] Vec<u8>),
}

#[derive(Debug, Serialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct End {
    #[serde(skip_serializing_if = "is_zero")]
    pub exit_code: i32,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub exited: bool,
    pub status: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

fn is_zero(v: &i32) -> bool {
    *v == 0
}

impl End {
    /// What envd reports (Go's ProcessState) for an exit code or a signal.
    pub fn of(exit_code: i32, signal: i32) -> End {
        if signal != 0 {
            let status = format!("signal: {}", signal_name(signal));
            End { exit_code: -1, exited: false, status: status.clone(), error: Some(status) }
        } else {
            let status = format!("exit status {exit_code}");
            let error = (exit_code != 0).then(|| status.clone());
            End { exit_code, exited: true, status, error }
        }
    }
}

fn signal_name(sig: i32) -> String {
    match sig {
        1 => "hangup".into(),
        2 => "interrupt".into(),
        3 => "quit".into(),
        6 => "aborted".into(),
        9 => "killed".into(),
        11 => "segmentation fault".into(),
        13 => "broken pipe".into(),
        15 => "terminated".into(),
        n => format!("signal {n}"),
    }
}

#[derive(Debug, Serialize)]
pub struct EventMessage {
    pub event: Event,
}

// ---- envd: filesystem

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct PathRequest {
    pub path: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct ListDirRequest {
    pub path: String,
    pub depth: u32,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct MoveRequest {
    pub source: String,
    pub destination: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct WatchRequest {
    pub path: String,
    pub recursive: bool,
    #[serde(alias = "include_entry")]
    pub include_entry: bool,
    #[serde(alias = "allow_network_mounts")]
    pub allow_network_mounts: bool,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct WatcherRequest {
    #[serde(alias = "watcher_id")]
    pub watcher_id: String,
}

#[derive(Debug, Serialize, Clone)]
#[serde(rename_all = "camelCase")]
pub struct EntryInfo {
    pub name: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub path: String,
    /// int64 in proto JSON: a string.
    pub size: String,
    pub mode: u32,
    pub permissions: String,
    pub owner: String,
    pub group: String,
    pub modified_time: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub symlink_target: Option<String>,
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub is_symlink: bool,
    /// E2B's file metadata (the file's `user.e2b.*` attributes).
    #[serde(skip_serializing_if = "HashMap::is_empty")]
    pub metadata: HashMap<String, String>,
}

/// The `mode` envd reports: the permission bits only (Go's `FileMode.Perm()`), whatever the
/// type; the type is in `type` and in `permissions`' first letter.
pub fn go_mode(_kind: FileKind, perm: u32) -> u32 {
    perm & 0o777
}

/// Go's `FileMode.String()` for the same: `-rw-r--r--`, `drwxr-xr-x`, `Lrwxrwxrwx`.
pub fn go_permissions(kind: FileKind, perm: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'L',
        FileKind::File | FileKind::Other => '-',
    });
    for (i, c) in "rwxrwxrwx".chars().enumerate() {
        s.push(if perm & (1 << (8 - i)) != 0 { c } else { '-' });
    }
    s
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileKind {
    File,
    Dir,
    Symlink,
    Other,
}

impl FileKind {
    pub fn proto_name(self) -> &'static str {
        match self {
            FileKind::File => "FILE_TYPE_FILE",
            FileKind::Dir => "FILE_TYPE_DIRECTORY",
            FileKind::Symlink => "FILE_TYPE_SYMLINK",
            FileKind::Other => "FILE_TYPE_UNSPECIFIED",
        }
    }
}

// ---- base64 (proto JSON bytes: standard alphabet with padding; read leniently)

fn b64<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
}

/// Standard or URL-safe, padded or not.
pub fn decode_b64(text: &str) -> Option<Vec<u8>> {
    use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD};
    let t = text.trim();
    [STANDARD, STANDARD_NO_PAD, URL_SAFE, URL_SAFE_NO_PAD].iter().find_map(|e| e.decode(t).ok())
}

fn b64_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u8>>, D::Error> {
    let s: Option<String> = Option::deserialize(d)?;
    match s {
        None => Ok(None),
        Some(s) => decode_b64(&s).map(Some).ok_or_else(|| serde::de::Error::custom("bytes are not base64")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn end_events_read_as_envd_writes_them() {
        let j = |e: End| serde_json::to_value(e).unwrap();
        assert_eq!(j(End::of(0, 0)), serde_json::json!({"exited": true, "status": "exit status 0"}));
        assert_eq!(
            j(End::of(3, 0)),
            serde_json::json!({"exitCode": 3, "exited": true, "status": "exit status 3", "error": "exit status 3"})
        );
        assert_eq!(
            j(End::of(-1, 9)),
            serde_json::json!({"exitCode": -1, "status": "signal: killed", "error": "signal: killed"})
        );
    }

    #[test]
    fn events_and_bytes_have_proto_json_names() {
        let m = EventMessage { event: Event::Data(Data::Stdout(b"hi\n".to_vec())) };
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"event":{"data":{"stdout":"aGkK"}}}"#);
        let m = EventMessage { event: Event::Start { pid: 42 } };
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"event":{"start":{"pid":42}}}"#);
        let m = EventMessage { event: Event::Keepalive {} };
        assert_eq!(serde_json::to_string(&m).unwrap(), r#"{"event":{"keepalive":{}}}"#);
        let r: SendInputRequest = serde_json::from_str(r#"{"process":{"pid":4},"input":{"stdin":"YWJj"}}"#).unwrap();
        assert_eq!(r.input.unwrap().bytes(), b"abc");
        assert!(serde_json::from_str::<SendInputRequest>(r#"{"input":{"stdin":"!!"}}"#).is_err());
    }

    #[test]
    fn modes_and_permissions_are_go_file_modes() {
        // E2B's suites: a directory's mode is 0o755, a file's 0o644.
        assert_eq!(go_mode(FileKind::Dir, 0o755), 0o755);
        assert_eq!(go_mode(FileKind::Symlink, 0o777), 0o777);
        assert_eq!(go_permissions(FileKind::Dir, 0o755), "drwxr-xr-x");
        assert_eq!(go_permissions(FileKind::File, 0o644), "-rw-r--r--");
        assert_eq!(go_permissions(FileKind::Symlink, 0o777), "Lrwxrwxrwx");
        assert_eq!(go_mode(FileKind::File, 0o4755), 0o755);
    }

    #[test]
    fn times_are_rfc3339() {
        assert_eq!(rfc3339(1_735_689_600_123), "2025-01-01T00:00:00.123Z");
        assert_eq!(rfc3339(i64::MAX), "9999-12-31T23:59:59.999Z");
        assert_eq!(rfc3339(-5), "1970-01-01T00:00:00.000Z");
    }
}
