//! Sandbox records: one JSON file per sandbox, `<state_dir>/sandboxes/<lease>.json`.
//!
//! Invariants:
//! - the encoding is versioned (`version`, currently [`RECORD_VERSION`]); fields are only added,
//!   with serde defaults, so records written by older edges still load (golden tests below hold
//!   stored bytes that are never edited);
//! - a durable write is temp file -> fsync -> rename -> fsync of the directory, so a record is
//!   either the old or the new version after a crash, never a torn mix;
//! - the edge writes the record before it calls the backend, and on every state change.
//!
//! Everything here is blocking file I/O; the edge calls it from `spawn_blocking`.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use opendsec_proto::v1::{Priority, Resources, SandboxSpec};

use crate::state::SandboxStatus;

/// The record encoding this edge writes and the newest it reads.
pub const RECORD_VERSION: u32 = 1;

/// Sub-directory of the state dir holding the records.
pub const RECORDS_DIR: &str = "sandboxes";

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("failed to create record directory {path}: {source}")]
    CreateDir { path: PathBuf, source: std::io::Error },
    #[error("failed to list records in {path}: {source}")]
    List { path: PathBuf, source: std::io::Error },
    #[error("failed to read record {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("failed to parse record {path}: {source}")]
    Parse { path: PathBuf, source: serde_json::Error },
    #[error("record {path} has version {version}, newer than this edge reads ({RECORD_VERSION})")]
    Version { path: PathBuf, version: u32 },
    #[error("failed to encode record for lease {lease}: {source}")]
    Encode { lease: String, source: serde_json::Error },
    #[error("failed to write record {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("failed to remove record {path}: {source}")]
    Remove { path: PathBuf, source: std::io::Error },
    #[error("record write for lease {lease} did not finish: {message}")]
    Join { lease: String, message: String },
}

/// Resources as stored (CPU in millicores, memory and disk in MiB).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ResourcesRecord {
    pub cpu_millis: u32,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub gpus: u32,
}

impl ResourcesRecord {
    pub fn from_proto(r: Option<&Resources>) -> ResourcesRecord {
        r.map(|r| ResourcesRecord {
            cpu_millis: r.cpu_millis,
            memory_mb: r.memory_mb,
            disk_mb: r.disk_mb,
            gpus: r.gpus,
        })
        .unwrap_or_default()
    }

    pub fn to_proto(self) -> Resources {
        Resources { cpu_millis: self.cpu_millis, memory_mb: self.memory_mb, disk_mb: self.disk_mb, gpus: self.gpus }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PriorityRecord {
    #[default]
    Unspecified,
    Guaranteed,
    BestEffort,
}

impl PriorityRecord {
    /// `None` for a number the proto does not define.
    pub fn from_proto(p: i32) -> Option<PriorityRecord> {
        Some(match Priority::try_from(p).ok()? {
            Priority::Unspecified => PriorityRecord::Unspecified,
            Priority::Guaranteed => PriorityRecord::Guaranteed,
            Priority::BestEffort => PriorityRecord::BestEffort,
        })
    }

    pub fn to_proto(self) -> Priority {
        match self {
            PriorityRecord::Unspecified => Priority::Unspecified,
            PriorityRecord::Guaranteed => Priority::Guaranteed,
            PriorityRecord::BestEffort => Priority::BestEffort,
        }
    }
}

/// The sandbox spec as stored. Maps are ordered so that equal specs encode to equal bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SpecRecord {
    pub project: String,
    pub image: String,
    pub backend: String,
    pub resources: ResourcesRecord,
    pub ttl_running_stop_s: u64,
    pub ttl_max_s: u64,
    pub ttl_paused_s: u64,
    pub env: BTreeMap<String, String>,
    pub labels: BTreeMap<String, String>,
    pub user: String,
    pub workdir: String,
    pub priority: PriorityRecord,
}

impl SpecRecord {
    /// The caller validated `spec.priority` before (an unknown number is stored as unspecified).
    pub fn from_proto(spec: &SandboxSpec) -> SpecRecord {
        SpecRecord {
            project: spec.project.clone(),
            image: spec.image.clone(),
            backend: spec.backend.clone(),
            resources: ResourcesRecord::from_proto(spec.resources.as_ref()),
            ttl_running_stop_s: spec.ttl_running_stop_s,
            ttl_max_s: spec.ttl_max_s,
            ttl_paused_s: spec.ttl_paused_s,
            env: spec.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            labels: spec.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            user: spec.user.clone(),
            workdir: spec.workdir.clone(),
            priority: PriorityRecord::from_proto(spec.priority).unwrap_or_default(),
        }
    }

    pub fn to_proto(&self) -> SandboxSpec {
        SandboxSpec {
            project: self.project.clone(),
            image: self.image.clone(),
            backend: self.backend.clone(),
            resources: Some(self.resources.to_proto()),
            ttl_running_stop_s: self.ttl_running_stop_s,
            ttl_max_s: self.ttl_max_s,
            ttl_paused_s: self.ttl_paused_s,
            env: self.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            labels: self.labels.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            user: self.user.clone(),
            workdir: self.workdir.clone(),
            priority: self.priority.to_proto() as i32,
        }
    }
}

/// Everything the edge knows about one sandbox; what backends are handed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxRecord {
    pub version: u32,
    /// `<edge>.<lease>`.
    pub id: String,
    pub edge: String,
    pub lease_id: String,
    #[serde(default)]
    pub principal: String,
    pub spec: SpecRecord,
    pub state: SandboxStatus,
    pub created_at_ms: i64,
    #[serde(default)]
    pub updated_at_ms: i64,
    /// The idle clock: reset by every lifecycle call and by SetSandboxTimeout.
    #[serde(default)]
    pub last_active_ms: i64,
    /// The paused clock (`ttl_paused_s` counts from here); 0 unless PAUSED or RESUMING.
    #[serde(default)]
    pub paused_since_ms: i64,
    /// Why the sandbox stopped or failed ("user", "ttl_max", "lost", ...); set on STOPPING too.
    #[serde(default)]
    pub end_reason: String,
    /// When the sandbox reached STOPPED or FAILED (ended records are kept for a while after).
    #[serde(default)]
    pub ended_at_ms: i64,
    /// IAM confirmed the release of the lease (or the lease turned out not to be ours).
    #[serde(default)]
    pub lease_released: bool,
    /// Release the lease only if IAM still binds it to this edge: set when the caller may have
    /// retried the creation elsewhere with the same lease (a failed or interrupted creation).
    #[serde(default)]
    pub release_if_bound: bool,
}

impl SandboxRecord {
    pub fn resources(&self) -> ResourcesRecord {
        self.spec.resources
    }

    /// Encodes the record as stored (compact JSON and a newline).
    pub fn encode(&self) -> Result<Vec<u8>, RecordError> {
        let mut bytes =
            serde_json::to_vec(self).map_err(|source| RecordError::Encode { lease: self.lease_id.clone(), source })?;
        bytes.push(b'\n');
        Ok(bytes)
    }

    /// Decodes a stored record, refusing encodings newer than this edge knows.
    pub fn decode(bytes: &[u8], path: &Path) -> Result<SandboxRecord, RecordError> {
        #[derive(Deserialize)]
        struct Version {
            version: u32,
        }
        let v: Version =
            serde_json::from_slice(bytes).map_err(|source| RecordError::Parse { path: path.to_path_buf(), source })?;
        if v.version > RECORD_VERSION {
            return Err(RecordError::Version { path: path.to_path_buf(), version: v.version });
        }
        serde_json::from_slice(bytes).map_err(|source| RecordError::Parse { path: path.to_path_buf(), source })
    }
}

/// A record file that could not be loaded; its lease comes from the file name.
#[derive(Debug)]
pub struct BadRecord {
    pub lease_id: String,
    pub error: RecordError,
}

/// The record directory.
#[derive(Debug)]
pub struct RecordStore {
    dir: PathBuf,
    /// Kept open for the directory fsync of every durable write (one open less per write).
    dir_handle: File,
}

impl RecordStore {
    /// Opens (creating) `<state_dir>/sandboxes`.
    pub fn open(state_dir: &Path) -> Result<RecordStore, RecordError> {
        let dir = state_dir.join(RECORDS_DIR);
        fs::create_dir_all(&dir).map_err(|source| RecordError::CreateDir { path: dir.clone(), source })?;
        let dir_handle = File::open(&dir).map_err(|source| RecordError::CreateDir { path: dir.clone(), source })?;
        Ok(RecordStore { dir, dir_handle })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path(&self, lease_id: &str) -> PathBuf {
        self.dir.join(format!("{lease_id}.json"))
    }

    /// Replaces the record of `lease_id` with `bytes`. `durable`: fsync the file and the
    /// directory, so the new version survives a crash. Non-durable writes are still atomic
    /// (rename) and are used only where losing the update costs a repeated, idempotent action.
    pub fn write(&self, lease_id: &str, bytes: &[u8], durable: bool) -> Result<(), RecordError> {
        let path = self.path(lease_id);
        // A unique temp name: two writers never share a temp file.
        let tmp = self.dir.join(format!(".{lease_id}.{:016x}.tmp", rand::random::<u64>()));
        let result = (|| {
            let mut f = OpenOptions::new().write(true).create_new(true).open(&tmp)?;
            f.write_all(bytes)?;
            if durable {
                f.sync_data()?;
            }
            drop(f);
            fs::rename(&tmp, &path)?;
            if durable {
                self.dir_handle.sync_all()?;
            }
            Ok(())
        })();
        result.map_err(|source| {
            let _ = fs::remove_file(&tmp);
            RecordError::Write { path, source }
        })
    }

    /// Removes a record; a missing file is fine. Not fsync'd: a removal lost in a crash only
    /// brings back an ended record, which is removed again.
    pub fn remove(&self, lease_id: &str) -> Result<(), RecordError> {
        let path = self.path(lease_id);
        match fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(RecordError::Remove { path, source }),
        }
    }

    /// Loads every record, sorted by lease. Leftover temp files (a crash during a write) are
    /// removed: the rename never happened, so the previous version is the record.
    pub fn load_all(&self) -> Result<(Vec<SandboxRecord>, Vec<BadRecord>), RecordError> {
        let list_err = |source| RecordError::List { path: self.dir.clone(), source };
        let mut good = Vec::new();
        let mut bad = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(list_err)? {
            let entry = entry.map_err(list_err)?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let path = entry.path();
            if name.starts_with('.') && name.ends_with(".tmp") {
                let _ = fs::remove_file(&path);
                continue;
            }
            let Some(lease) = name.strip_suffix(".json") else { continue };
            let loaded = fs::read(&path)
                .map_err(|source| RecordError::Read { path: path.clone(), source })
                .and_then(|bytes| SandboxRecord::decode(&bytes, &path));
            match loaded {
                Ok(rec) => good.push(rec),
                Err(error) => bad.push(BadRecord { lease_id: lease.to_string(), error }),
            }
        }
        good.sort_by(|a, b| a.lease_id.cmp(&b.lease_id));
        Ok((good, bad))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> SandboxRecord {
        SandboxRecord {
            version: RECORD_VERSION,
            id: "edge-1.0190a1b2c3d4e5f60718293a".into(),
            edge: "edge-1".into(),
            lease_id: "0190a1b2c3d4e5f60718293a".into(),
            principal: "alice".into(),
            spec: SpecRecord {
                project: "root/team-a".into(),
                image: "python:3.12".into(),
                backend: "sim".into(),
                resources: ResourcesRecord { cpu_millis: 1000, memory_mb: 512, disk_mb: 1024, gpus: 0 },
                ttl_running_stop_s: 600,
                ttl_max_s: 3600,
                ttl_paused_s: 3600,
                env: [("A".to_string(), "1".to_string())].into(),
                labels: [("job".to_string(), "rl-7".to_string())].into(),
                user: "root".into(),
                workdir: "/work".into(),
                priority: PriorityRecord::BestEffort,
            },
            state: SandboxStatus::Paused,
            created_at_ms: 1_700_000_000_000,
            updated_at_ms: 1_700_000_005_000,
            last_active_ms: 1_700_000_004_000,
            paused_since_ms: 1_700_000_005_000,
            end_reason: String::new(),
            ended_at_ms: 0,
            lease_released: false,
            release_if_bound: false,
        }
    }

    /// A record as version 1 of the edge wrote it. These bytes are never edited: if this test
    /// fails, the change broke reading records left by running edges.
    const GOLDEN_V1: &str = r#"{"version":1,"id":"edge-1.0190a1b2c3d4e5f60718293a","edge":"edge-1","lease_id":"0190a1b2c3d4e5f60718293a","principal":"alice","spec":{"project":"root/team-a","image":"python:3.12","backend":"sim","resources":{"cpu_millis":1000,"memory_mb":512,"disk_mb":1024,"gpus":0},"ttl_running_stop_s":600,"ttl_max_s":3600,"ttl_paused_s":3600,"env":{"A":"1"},"labels":{"job":"rl-7"},"user":"root","workdir":"/work","priority":"best_effort"},"state":"PAUSED","created_at_ms":1700000000000,"updated_at_ms":1700000005000,"last_active_ms":1700000004000,"paused_since_ms":1700000005000,"end_reason":"","ended_at_ms":0,"lease_released":false,"release_if_bound":false}
"#;

    /// The smallest record version 1 accepts: every defaulted field left out.
    const GOLDEN_V1_MINIMAL: &str = r#"{"version":1,"id":"e.l1","edge":"e","lease_id":"l1","spec":{"backend":"sim"},"state":"STOPPED","created_at_ms":5}"#;

    #[test]
    fn golden_v1_still_parses() {
        let rec = SandboxRecord::decode(GOLDEN_V1.as_bytes(), Path::new("golden")).unwrap();
        assert_eq!(rec, sample());
    }

    #[test]
    fn golden_v1_minimal_still_parses() {
        let rec = SandboxRecord::decode(GOLDEN_V1_MINIMAL.as_bytes(), Path::new("golden")).unwrap();
        assert_eq!(rec.state, SandboxStatus::Stopped);
        assert_eq!(rec.spec.backend, "sim");
        assert_eq!(rec.spec.resources, ResourcesRecord::default());
        assert!(!rec.lease_released);
    }

    #[test]
    fn encoding_is_stable() {
        // Today's encoder still writes exactly the golden bytes; if a field is added, add a new
        // golden constant rather than editing the old one.
        assert_eq!(String::from_utf8(sample().encode().unwrap()).unwrap(), GOLDEN_V1);
    }

    #[test]
    fn newer_versions_are_refused() {
        let text = GOLDEN_V1.replacen("\"version\":1", "\"version\":2", 1);
        let err = SandboxRecord::decode(text.as_bytes(), Path::new("x")).unwrap_err();
        assert!(matches!(err, RecordError::Version { version: 2, .. }), "{err}");
    }

    #[test]
    fn write_read_remove() {
        let dir = tempfile::tempdir().unwrap();
        let store = RecordStore::open(dir.path()).unwrap();
        let mut rec = sample();
        store.write(&rec.lease_id, &rec.encode().unwrap(), true).unwrap();
        rec.state = SandboxStatus::Stopped;
        store.write(&rec.lease_id, &rec.encode().unwrap(), false).unwrap();
        // A torn write left behind and a corrupt record.
        fs::write(store.dir().join(".x.0000000000000001.tmp"), b"{").unwrap();
        fs::write(store.path("broken"), b"{not json").unwrap();

        let (good, bad) = store.load_all().unwrap();
        assert_eq!(good, vec![rec.clone()]);
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].lease_id, "broken");
        assert!(!store.dir().join(".x.0000000000000001.tmp").exists());
        let names: Vec<_> = fs::read_dir(store.dir()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names.len(), 2, "{names:?}");

        store.remove(&rec.lease_id).unwrap();
        store.remove(&rec.lease_id).unwrap();
        let (good, _) = store.load_all().unwrap();
        assert!(good.is_empty());
    }

    #[test]
    fn spec_round_trips_through_proto() {
        let spec = sample().spec;
        assert_eq!(SpecRecord::from_proto(&spec.to_proto()), spec);
        assert_eq!(PriorityRecord::from_proto(99), None);
    }
}
