//! Sandbox records: one JSON file per sandbox, `<state_dir>/sandboxes/<lease>.json`.
//!
//! Invariants:
//! - the encoding is versioned (`version`, currently [`RECORD_VERSION`]); fields are only added,
//!   with serde defaults, so records written by older edges still load (golden tests below hold
//!   stored bytes that are never edited);
//! - a durable write is temp file -> fsync -> rename -> fsync of the directory, so a record is
//!   either the old or the new version after a crash, never a torn mix (the directory fsync is
//!   shared by concurrent writers, and temp files are recycled: see [`RecordStore`]);
//! - the edge writes the record before it calls the backend, and on every state change.
//!
//! Everything here is blocking file I/O; the edge calls it from `spawn_blocking`.

use std::collections::{BTreeMap, VecDeque};
use std::fs::{self, File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use opendsec_proto::v1::{Priority, Resources, SandboxSpec};

use crate::state::SandboxStatus;
use opendsec_common::egress;

fn is_zero(n: &u32) -> bool {
    *n == 0
}

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
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub masked_paths: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub readonly_paths: Vec<String>,
    /// Egress rules in their canonical text form (`opendsec_common::egress`); `None`: the spec
    /// had no network part (no egress).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub egress: Option<Vec<String>>,
    /// The warm pool the spec names (`spec.pool`).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub pool: String,
    /// Session sync (`spec.session`): what is saved at stop and restored at creation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<SessionRecord>,
    /// A full VM boots the image's own init (`spec.full_init`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub full_init: bool,
}

/// A session sync as stored: its name in the project and the absolute paths it saves.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SessionRecord {
    pub name: String,
    pub paths: Vec<String>,
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
            masked_paths: spec.masked_paths.clone(),
            readonly_paths: spec.readonly_paths.clone(),
            egress: spec.network.as_ref().map(|n| {
                n.egress.iter().filter_map(|r| egress::Rule::from_pb(r).ok()).map(|r| r.to_string()).collect()
            }),
            pool: spec.pool.clone(),
            session: spec.session.as_ref().map(|s| SessionRecord { name: s.name.clone(), paths: s.paths.clone() }),
            full_init: spec.full_init,
        }
    }

    /// The egress rules (rules that no longer parse are left out: records only hold checked
    /// rules).
    pub fn egress_rules(&self) -> Vec<egress::Rule> {
        self.egress.iter().flatten().filter_map(|t| egress::Rule::parse(t).ok()).collect()
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
            masked_paths: self.masked_paths.clone(),
            readonly_paths: self.readonly_paths.clone(),
            network: self.egress.as_ref().map(|_| opendsec_proto::v1::NetworkSpec {
                egress: self.egress_rules().iter().map(egress::Rule::to_pb).collect(),
            }),
            pool: self.pool.clone(),
            session: self
                .session
                .as_ref()
                .map(|s| opendsec_proto::v1::SessionSync { name: s.name.clone(), paths: s.paths.clone() }),
            full_init: self.full_init,
        }
    }
}

/// A sandbox's part in a move between edges (`core::moves`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct MoveRecord {
    /// On the source, while moving: the target edge. Calls are held off (answered
    /// `unavailable` with `moving_to`); the sandbox is frozen.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub moving_to: String,
    /// When the move started (a move left unfinished past `edge.move_stale` is settled by the
    /// edge from where IAM binds the lease).
    #[serde(skip_serializing_if = "is_zero_i64")]
    pub moving_since_ms: i64,
    /// The move froze a RUNNING sandbox: an abandoned move lets it run again.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub resume_on_abort: bool,
    /// On the source, after the move: where the sandbox runs now (the record is STOPPED with
    /// end_reason "moved", and answers with this edge until it is deleted).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub moved_to: String,
    /// On the target: the edge the sandbox came from (its id names the edge it was created on).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub moved_from: String,
    /// On the target: the image the copy runs, pinned (layer ids bottom first, PID 1's image
    /// environment) rather than resolved by name.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub layers: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub image_env: Vec<String>,
}

impl MoveRecord {
    pub fn is_empty(&self) -> bool {
        *self == MoveRecord::default()
    }

    /// A move out of this edge is under way.
    pub fn is_moving(&self) -> bool {
        !self.moving_to.is_empty()
    }
}

fn is_zero_i64(n: &i64) -> bool {
    *n == 0
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
    /// The sandbox's slot in the edge's network (`netpol`), 0: no network.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub net_slot: u32,
    /// The container (or other backend object) the sandbox runs in when it is not named by the
    /// sandbox's id: its warm pool member's id when it was claimed from a pool,
    /// `<edge>.mv-<lease>` when it moved in (the original, named by the id, may still be on
    /// this host). Empty: the sandbox's own container, named by its id.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub member: String,
    /// A pool member's record (`<state>/pool`): its pool (`project/name`) and the template
    /// revision it was started from.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pool: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pool_revision: String,
    /// A move to or from another edge (`core::moves`); empty for most sandboxes.
    #[serde(default, skip_serializing_if = "MoveRecord::is_empty")]
    pub moved: MoveRecord,
    // Records of earlier edges may hold `release_if_bound` (release only if IAM still binds the
    // lease here). Every release names the edge now, which IAM checks, so the field is no
    // longer written and is ignored when read (serde skips unknown fields: this struct must
    // not deny them).
}

impl SandboxRecord {
    pub fn resources(&self) -> ResourcesRecord {
        self.spec.resources
    }

    /// The id of the container (or other backend object) the sandbox runs in: its pool
    /// member's when claimed from a pool, else its own.
    pub fn container_id(&self) -> &str {
        if self.member.is_empty() { &self.id } else { &self.member }
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

/// How a record is written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WriteMode {
    /// The file and the directory are fsync'd: the new version survives a crash.
    Durable,
    /// [`WriteMode::Durable`] for a record that does not exist yet (a creation's first write):
    /// a plain rename, without first trying to swap with an existing version (a failed
    /// `RENAME_EXCHANGE` still takes the directory lock). If the record exists all the same,
    /// it is replaced correctly, only its file is not recycled.
    DurableNew,
    /// Atomic (rename) but not fsync'd: only where losing the update costs a repeated,
    /// idempotent action.
    Lazy,
}

/// Most spare files kept for reuse (beyond that, replaced versions are freed).
pub const MAX_SPARES: usize = 256;

/// The record directory.
///
/// Durable writes are cheap on purpose, because a creation makes two of them:
/// - directory fsyncs are group-committed: renames take increasing tickets, and one fsync
///   makes every rename done before it durable, so concurrent writers share one;
/// - file inodes are recycled: a durable write swaps the new version in with
///   `RENAME_EXCHANGE`, which leaves the replaced version under the temp name, and that file
///   (a "spare") is overwritten by a later durable write instead of a new file being created.
///   Creating and freeing an inode per write is what costs most on a busy directory (the
///   directory lock is held while ext4 looks for a free inode, skipping recently freed ones).
///
/// A spare is reused only once the rename that made it spare is durable: until then, after a
/// crash, the record's name might still point to it. It is overwritten and fsync'd before it is
/// renamed in, so a crash shows either the old or the new version, as with a fresh temp file.
/// Non-durable writes never reuse spares (a crash could otherwise expose a spare's old bytes
/// under another record's name): they write a fresh temp file and rename it over the record.
#[derive(Debug)]
pub struct RecordStore {
    dir: PathBuf,
    /// Kept open for the directory fsyncs (one open less per write) and `renameat2`.
    dir_handle: File,
    /// Renames completed so far: each takes the next number once done.
    renamed: AtomicU64,
    /// Every rename numbered up to this is durable (a directory fsync began after it).
    synced: AtomicU64,
    /// Held during a directory fsync, so waiting writers find their rename covered by it.
    dir_sync: Mutex<()>,
    /// Spare files, oldest first, with the number of the rename that made each spare.
    spares: Mutex<VecDeque<(PathBuf, u64)>>,
    /// Cleared when the file system refuses `RENAME_EXCHANGE` (plain renames from then on).
    exchange: AtomicBool,
    /// Directory fsyncs made (for benchmarks: fewer than durable writes under concurrency).
    dir_syncs: AtomicU64,
}

impl RecordStore {
    /// Opens (creating) `<state_dir>/sandboxes`.
    pub fn open(state_dir: &Path) -> Result<RecordStore, RecordError> {
        RecordStore::open_named(state_dir, RECORDS_DIR)
    }

    /// Opens (creating) `<state_dir>/<name>` (warm pool members: `pool`).
    pub fn open_named(state_dir: &Path, name: &str) -> Result<RecordStore, RecordError> {
        let dir = state_dir.join(name);
        // Records hold each spec's env: the owner's alone (0700 directory, 0600 files).
        opendsec_common::fsperm::private_dir(state_dir)
            .and_then(|()| opendsec_common::fsperm::private_dir(&dir))
            .map_err(|source| RecordError::CreateDir { path: dir.clone(), source })?;
        let dir_handle = File::open(&dir).map_err(|source| RecordError::CreateDir { path: dir.clone(), source })?;
        Ok(RecordStore {
            dir,
            dir_handle,
            renamed: AtomicU64::new(0),
            synced: AtomicU64::new(0),
            dir_sync: Mutex::new(()),
            spares: Mutex::new(VecDeque::new()),
            exchange: AtomicBool::new(true),
            dir_syncs: AtomicU64::new(0),
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn path(&self, lease_id: &str) -> PathBuf {
        self.dir.join(format!("{lease_id}.json"))
    }

    fn temp_path(&self) -> PathBuf {
        // A unique name: two writers never share a temp file.
        self.dir.join(format!(".{:016x}.tmp", rand::random::<u64>()))
    }

    fn spares(&self) -> std::sync::MutexGuard<'_, VecDeque<(PathBuf, u64)>> {
        // Every update is one push or pop: a panic elsewhere cannot leave it half-changed.
        self.spares.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces (or creates) the record of `lease_id` with `bytes`, as `mode` says.
    pub fn write(&self, lease_id: &str, bytes: &[u8], mode: WriteMode) -> Result<(), RecordError> {
        let path = self.path(lease_id);
        let result = match mode {
            WriteMode::Durable => self.write_durable(&path, bytes, true),
            WriteMode::DurableNew => self.write_durable(&path, bytes, false),
            WriteMode::Lazy => self.write_fresh(&path, bytes),
        };
        result.map_err(|source| RecordError::Write { path, source })
    }

    /// Fresh temp file, plain rename (ext4 flushes the data of a file renamed over another).
    fn write_fresh(&self, path: &Path, bytes: &[u8]) -> std::io::Result<()> {
        let tmp = self.temp_path();
        let written = (|| {
            let mut f = opendsec_common::fsperm::private_file().write(true).create_new(true).open(&tmp)?;
            f.write_all(bytes)?;
            drop(f);
            fs::rename(&tmp, path)
        })();
        if written.is_err() {
            let _ = fs::remove_file(&tmp);
        }
        written?;
        self.renamed.fetch_add(1, Ordering::AcqRel);
        Ok(())
    }

    fn write_durable(&self, path: &Path, bytes: &[u8], replace: bool) -> std::io::Result<()> {
        let (tmp, f, reused) = match self.open_spare() {
            Some((tmp, f)) => (tmp, f, true),
            None => {
                let tmp = self.temp_path();
                let f = opendsec_common::fsperm::private_file().write(true).create_new(true).open(&tmp);
                (tmp, f?, false)
            }
        };
        let exchanged = (|| {
            let mut f = f;
            f.write_all(bytes)?;
            if reused {
                // Overwritten in place (no block freed and allocated again); a longer earlier
                // version is cut off.
                f.set_len(bytes.len() as u64)?;
            }
            f.sync_data()?;
            drop(f);
            if replace { self.swap_in(&tmp, path) } else { fs::rename(&tmp, path).map(|()| false) }
        })();
        let exchanged = match exchanged {
            Ok(x) => x,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                return Err(e);
            }
        };
        let ticket = self.renamed.fetch_add(1, Ordering::AcqRel) + 1;
        let synced = self.sync_dir_through(ticket);
        if exchanged {
            // The replaced version, now under the temp name: reusable once `ticket` is durable.
            self.keep_spare(tmp, ticket);
        }
        synced
    }

    /// The oldest spare whose rename is durable, opened for overwriting.
    fn open_spare(&self) -> Option<(PathBuf, File)> {
        let synced = self.synced.load(Ordering::Acquire);
        loop {
            let (path, _) = {
                let mut spares = self.spares();
                // Oldest first: if the front is not durable yet, no spare is.
                if spares.front().is_none_or(|(_, ticket)| *ticket > synced) {
                    return None;
                }
                spares.pop_front()?
            };
            match OpenOptions::new().write(true).open(&path) {
                Ok(f) => return Some((path, f)),
                // Gone (removed as a leftover) or unusable: forget it, try the next.
                Err(_) => {
                    let _ = fs::remove_file(&path);
                }
            }
        }
    }

    fn keep_spare(&self, path: PathBuf, ticket: u64) {
        let mut spares = self.spares();
        if spares.len() < MAX_SPARES {
            spares.push_back((path, ticket));
            return;
        }
        drop(spares);
        let _ = fs::remove_file(&path);
    }

    /// Puts `tmp` in place of `path`. Returns true when the replaced version was kept under
    /// `tmp` (exchanged), false when there was none or the file system freed it (plain rename).
    fn swap_in(&self, tmp: &Path, path: &Path) -> std::io::Result<bool> {
        if self.exchange.load(Ordering::Relaxed) {
            match rename_exchange(&self.dir_handle, tmp, path) {
                Ok(()) => return Ok(true),
                // No record yet: a plain rename puts the first version in place.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP)) => {
                    tracing::debug!(dir = %self.dir.display(), error = %e, "RENAME_EXCHANGE unsupported; plain renames");
                    self.exchange.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        fs::rename(tmp, path)?;
        Ok(false)
    }

    /// Makes every rename up to `ticket` durable with one directory fsync, unless one that
    /// began after it already did (group commit).
    fn sync_dir_through(&self, ticket: u64) -> std::io::Result<()> {
        if self.synced.load(Ordering::Acquire) >= ticket {
            return Ok(());
        }
        let _g = self.dir_sync.lock().unwrap_or_else(|p| p.into_inner());
        if self.synced.load(Ordering::Acquire) >= ticket {
            return Ok(());
        }
        // Every rename numbered up to `upto` has completed, so this fsync covers it.
        let upto = self.renamed.load(Ordering::Acquire);
        self.dir_handle.sync_all()?;
        self.dir_syncs.fetch_add(1, Ordering::Relaxed);
        self.synced.fetch_max(upto, Ordering::AcqRel);
        Ok(())
    }

    /// Directory fsyncs made so far.
    pub fn dir_syncs(&self) -> u64 {
        self.dir_syncs.load(Ordering::Relaxed)
    }

    /// Removes a record; a missing file is fine. Not fsync'd: a removal lost in a crash only
    /// brings back an ended record, which is removed again. The file is kept as a spare when
    /// there is room (renamed, reusable once a later directory fsync made that durable).
    pub fn remove(&self, lease_id: &str) -> Result<(), RecordError> {
        let path = self.path(lease_id);
        let recycle = self.exchange.load(Ordering::Relaxed) && self.spares().len() < MAX_SPARES;
        let result = if recycle {
            let spare = self.temp_path();
            fs::rename(&path, &spare).map(|()| {
                let ticket = self.renamed.fetch_add(1, Ordering::AcqRel) + 1;
                self.keep_spare(spare, ticket);
            })
        } else {
            fs::remove_file(&path)
        };
        match result {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(source) => Err(RecordError::Remove { path, source }),
        }
    }

    /// [`RecordStore::remove`], then a directory fsync: the record stays gone after a crash.
    pub fn remove_durable(&self, lease_id: &str) -> Result<(), RecordError> {
        self.remove(lease_id)?;
        let ticket = self.renamed.fetch_add(1, Ordering::AcqRel) + 1;
        self.sync_dir_through(ticket).map_err(|source| RecordError::Remove { path: self.path(lease_id), source })
    }

    /// Loads every record, sorted by lease. Leftover temp and spare files are removed: a temp
    /// file's rename never happened, so the previous version is the record.
    pub fn load_all(&self) -> Result<(Vec<SandboxRecord>, Vec<BadRecord>), RecordError> {
        self.spares().clear();
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

    /// (spares kept, spares reusable now): for tests.
    #[cfg(test)]
    fn spare_counts(&self) -> (usize, usize) {
        let synced = self.synced.load(Ordering::Acquire);
        let spares = self.spares();
        (spares.len(), spares.iter().filter(|(_, t)| *t <= synced).count())
    }
}

/// `renameat2(RENAME_EXCHANGE)` of two names in `dir`: atomically swaps what they point to.
fn rename_exchange(dir: &File, a: &Path, b: &Path) -> std::io::Result<()> {
    fn name(p: &Path) -> std::io::Result<&std::ffi::OsStr> {
        p.file_name().ok_or_else(|| std::io::Error::from(std::io::ErrorKind::InvalidInput))
    }
    Ok(rustix::fs::renameat_with(dir, name(a)?, dir, name(b)?, rustix::fs::RenameFlags::EXCHANGE)?)
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
                // Empty lists are not written: records from before these fields stay equal.
                masked_paths: vec![],
                readonly_paths: vec![],
                egress: None,
                pool: String::new(),
                session: None,
                full_init: false,
            },
            state: SandboxStatus::Paused,
            created_at_ms: 1_700_000_000_000,
            updated_at_ms: 1_700_000_005_000,
            last_active_ms: 1_700_000_004_000,
            paused_since_ms: 1_700_000_005_000,
            end_reason: String::new(),
            ended_at_ms: 0,
            lease_released: false,
            net_slot: 0,
            member: String::new(),
            pool: String::new(),
            pool_revision: String::new(),
            moved: Default::default(),
        }
    }

    /// A record as version 1 of the edge wrote it. These bytes are never edited: if this test
    /// fails, the change broke reading records left by running edges.
    const GOLDEN_V1: &str = r#"{"version":1,"id":"edge-1.0190a1b2c3d4e5f60718293a","edge":"edge-1","lease_id":"0190a1b2c3d4e5f60718293a","principal":"alice","spec":{"project":"root/team-a","image":"python:3.12","backend":"sim","resources":{"cpu_millis":1000,"memory_mb":512,"disk_mb":1024,"gpus":0},"ttl_running_stop_s":600,"ttl_max_s":3600,"ttl_paused_s":3600,"env":{"A":"1"},"labels":{"job":"rl-7"},"user":"root","workdir":"/work","priority":"best_effort"},"state":"PAUSED","created_at_ms":1700000000000,"updated_at_ms":1700000005000,"last_active_ms":1700000004000,"paused_since_ms":1700000005000,"end_reason":"","ended_at_ms":0,"lease_released":false,"release_if_bound":false}
"#;

    /// A record as the edge writes it since `release_if_bound` is no longer written (same
    /// version: readers default what is missing and skip what they do not know). These bytes
    /// are never edited either.
    const GOLDEN_V1_NO_RELEASE_IF_BOUND: &str = r#"{"version":1,"id":"edge-1.0190a1b2c3d4e5f60718293a","edge":"edge-1","lease_id":"0190a1b2c3d4e5f60718293a","principal":"alice","spec":{"project":"root/team-a","image":"python:3.12","backend":"sim","resources":{"cpu_millis":1000,"memory_mb":512,"disk_mb":1024,"gpus":0},"ttl_running_stop_s":600,"ttl_max_s":3600,"ttl_paused_s":3600,"env":{"A":"1"},"labels":{"job":"rl-7"},"user":"root","workdir":"/work","priority":"best_effort"},"state":"PAUSED","created_at_ms":1700000000000,"updated_at_ms":1700000005000,"last_active_ms":1700000004000,"paused_since_ms":1700000005000,"end_reason":"","ended_at_ms":0,"lease_released":false}
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
        // Today's encoder still writes exactly the newest golden bytes; if a field is added or
        // dropped, add a new golden constant rather than editing an old one.
        assert_eq!(String::from_utf8(sample().encode().unwrap()).unwrap(), GOLDEN_V1_NO_RELEASE_IF_BOUND);
        let rec = SandboxRecord::decode(GOLDEN_V1_NO_RELEASE_IF_BOUND.as_bytes(), Path::new("golden")).unwrap();
        assert_eq!(rec, sample());
    }

    /// A record with a network (egress rules in the spec, a slot in the edge's subnet). These
    /// bytes are never edited.
    const GOLDEN_V1_NETWORK: &str = r#"{"version":1,"id":"e.l1","edge":"e","lease_id":"l1","principal":"","spec":{"project":"root","image":"debian","backend":"container","resources":{"cpu_millis":0,"memory_mb":0,"disk_mb":0,"gpus":0},"ttl_running_stop_s":0,"ttl_max_s":0,"ttl_paused_s":0,"env":{},"labels":{},"user":"","workdir":"","priority":"unspecified","egress":["pypi.org","203.0.113.0/24:tcp/80"]},"state":"RUNNING","created_at_ms":5,"updated_at_ms":0,"last_active_ms":0,"paused_since_ms":0,"end_reason":"","ended_at_ms":0,"lease_released":false,"net_slot":7}
"#;

    #[test]
    fn golden_v1_network_round_trips() {
        let rec = SandboxRecord::decode(GOLDEN_V1_NETWORK.as_bytes(), Path::new("golden")).unwrap();
        assert_eq!(rec.net_slot, 7);
        assert_eq!(rec.spec.egress_rules().len(), 2);
        let pb = rec.spec.to_proto();
        assert_eq!(pb.network.as_ref().map(|n| n.egress.len()), Some(2));
        assert_eq!(SpecRecord::from_proto(&pb), rec.spec);
        assert_eq!(String::from_utf8(rec.encode().unwrap()).unwrap(), GOLDEN_V1_NETWORK);
        // No network part: no egress field written at all (older records stay byte-equal).
        assert_eq!(sample().spec.egress, None);
    }

    #[test]
    fn a_move_round_trips_and_an_empty_one_is_not_written() {
        assert!(!String::from_utf8(sample().encode().unwrap()).unwrap().contains("moved"));
        let mut rec = sample();
        rec.moved = MoveRecord {
            moving_to: "edge-2".into(),
            moving_since_ms: 9,
            resume_on_abort: true,
            moved_from: "edge-0".into(),
            layers: vec!["sha256-ab".into()],
            image_env: vec!["PATH=/bin".into()],
            ..Default::default()
        };
        let bytes = rec.encode().unwrap();
        assert_eq!(SandboxRecord::decode(&bytes, Path::new("moved")).unwrap(), rec);
        assert!(rec.moved.is_moving() && !MoveRecord::default().is_moving());
    }

    #[test]
    fn a_legacy_release_if_bound_still_parses() {
        // Set by earlier edges on failed creations; the release that follows names the edge now.
        let text = GOLDEN_V1.replacen("\"release_if_bound\":false", "\"release_if_bound\":true", 1);
        assert!(text.contains("\"release_if_bound\":true"));
        let rec = SandboxRecord::decode(text.as_bytes(), Path::new("legacy")).unwrap();
        assert_eq!(rec, sample());
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
        store.write(&rec.lease_id, &rec.encode().unwrap(), WriteMode::Durable).unwrap();
        rec.state = SandboxStatus::Stopped;
        store.write(&rec.lease_id, &rec.encode().unwrap(), WriteMode::Lazy).unwrap();
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

    fn names(store: &RecordStore) -> Vec<String> {
        let mut v: Vec<String> =
            fs::read_dir(store.dir()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        v.sort();
        v
    }

    #[test]
    fn durable_rewrites_recycle_the_replaced_file() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let store = RecordStore::open(dir.path()).unwrap();
        let long = vec![b'x'; 5000];
        store.write("l", &long, WriteMode::Durable).unwrap();
        let first_inode = fs::metadata(store.path("l")).unwrap().ino();
        store.write("l", b"short", WriteMode::Durable).unwrap();
        // The replaced version is kept as a spare, reusable at once (the write was durable).
        assert_eq!(store.spare_counts(), (1, 1));
        assert_eq!(names(&store).len(), 2);
        assert_eq!(fs::read(store.path("l")).unwrap(), b"short");
        // The next durable write overwrites the spare: same inode, exactly the new bytes.
        store.write("m", b"tiny", WriteMode::Durable).unwrap();
        assert_eq!(store.spare_counts(), (0, 0));
        assert_eq!(fs::metadata(store.path("m")).unwrap().ino(), first_inode);
        assert_eq!(fs::read(store.path("m")).unwrap(), b"tiny");
        assert_eq!(names(&store), ["l.json", "m.json"]);
        // A first write that finds a record all the same replaces it (without keeping it).
        store.write("n", b"first", WriteMode::DurableNew).unwrap();
        store.write("n", b"replaced", WriteMode::DurableNew).unwrap();
        assert_eq!(fs::read(store.path("n")).unwrap(), b"replaced");
        assert_eq!(store.spare_counts(), (0, 0));
        // Non-durable writes never take a spare (nor make one).
        store.write("l", b"again", WriteMode::Durable).unwrap();
        assert_eq!(store.spare_counts(), (1, 1));
        store.write("m", b"lazy", WriteMode::Lazy).unwrap();
        assert_eq!(store.spare_counts(), (1, 1));
        assert_eq!(fs::read(store.path("m")).unwrap(), b"lazy");
    }

    #[test]
    fn removed_files_are_reused_only_after_a_directory_fsync() {
        let dir = tempfile::tempdir().unwrap();
        let store = RecordStore::open(dir.path()).unwrap();
        store.write("gone", b"old record", WriteMode::Durable).unwrap();
        store.remove("gone").unwrap();
        assert!(!store.path("gone").exists());
        // Until a directory fsync covers the removal, a crash could bring "gone" back: the file
        // must not be overwritten yet.
        assert_eq!(store.spare_counts(), (1, 0));
        store.write("lazy", b"x", WriteMode::Lazy).unwrap();
        assert_eq!(store.spare_counts(), (1, 0));
        store.write("a", b"record a", WriteMode::Durable).unwrap();
        assert_eq!(store.spare_counts(), (1, 1));
        store.write("b", b"record b", WriteMode::Durable).unwrap();
        assert_eq!(store.spare_counts(), (0, 0));
        assert_eq!(fs::read(store.path("b")).unwrap(), b"record b");
        assert_eq!(names(&store), ["a.json", "b.json", "lazy.json"]);
        // Spares left over from a previous run are removed on load.
        store.remove("a").unwrap();
        assert_eq!(names(&store).len(), 3);
        store.load_all().unwrap();
        assert_eq!(names(&store), ["b.json", "lazy.json"]);
        assert_eq!(store.spare_counts(), (0, 0));
        store.write("c", b"c", WriteMode::Durable).unwrap();
        assert_eq!(names(&store), ["b.json", "c.json", "lazy.json"]);
    }

    #[test]
    fn spares_are_bounded() {
        let dir = tempfile::tempdir().unwrap();
        let store = RecordStore::open(dir.path()).unwrap();
        let n = MAX_SPARES + 5;
        for i in 0..n {
            store.write(&format!("l{i}"), b"{}", WriteMode::Lazy).unwrap();
        }
        for i in 0..n {
            store.remove(&format!("l{i}")).unwrap();
        }
        assert_eq!(store.spare_counts().0, MAX_SPARES);
        assert_eq!(names(&store).len(), MAX_SPARES);
    }

    #[test]
    fn concurrent_durable_writes_share_directory_fsyncs() {
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(RecordStore::open(dir.path()).unwrap());
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let store = store.clone();
                std::thread::spawn(move || {
                    for i in 0..25 {
                        let lease = format!("t{t}-{i}");
                        store.write(&lease, lease.as_bytes(), WriteMode::Durable).unwrap();
                        store.write(&lease, b"second", WriteMode::Durable).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let (good, bad) = store.load_all().unwrap();
        assert!(good.is_empty() && bad.len() == 200, "the bytes are not records");
        for t in 0..8 {
            assert_eq!(fs::read(store.path(&format!("t{t}-24"))).unwrap(), b"second");
        }
        // At most one fsync per write; how many fewer depends on timing, so only bounded.
        assert!(store.dir_syncs() <= 400, "{}", store.dir_syncs());
    }

    #[test]
    fn spec_round_trips_through_proto() {
        let spec = sample().spec;
        assert_eq!(SpecRecord::from_proto(&spec.to_proto()), spec);
        assert_eq!(PriorityRecord::from_proto(99), None);
    }
}
