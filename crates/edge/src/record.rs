//! Sandbox records: each sandbox's JSON record, kept in one append-only log per edge,
//! `<state_dir>/sandboxes/records.log` (pool members: `<state_dir>/pool/records.log`).
//!
//! Invariants:
//! - the encoding is versioned (`version`, currently [`RECORD_VERSION`]); fields are only added,
//!   with serde defaults, so records written by older edges still load (golden tests below hold
//!   stored bytes that are never edited);
//! - a durable write is a checksummed frame appended and synced (one sync shared by concurrent
//!   writers), so a record is either the old or the new version after a crash, never a torn
//!   mix: see [`RecordStore`];
//! - the edge writes the record before it calls the backend, and on every state change.
//!
//! Everything here is blocking file I/O; the edge calls it from `spawn_blocking`.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

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
    #[error("record log {path} is held by another process (another edge on the same state directory?): {source}")]
    Locked { path: PathBuf, source: std::io::Error },
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
    /// The sandbox's ports answer HTTP without a token through an E2B gateway
    /// (`spec.public_traffic`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub public_traffic: bool,
    /// Paused, not stopped, when the idle TTL runs out, which calls do not extend
    /// (`spec.pause_on_timeout`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub pause_on_timeout: bool,
    /// Runtime calls do not resume it when paused (`spec.manual_resume`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub manual_resume: bool,
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
            public_traffic: spec.public_traffic,
            pause_on_timeout: spec.pause_on_timeout,
            manual_resume: spec.manual_resume,
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
            public_traffic: self.public_traffic,
            pause_on_timeout: self.pause_on_timeout,
            manual_resume: self.manual_resume,
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
    /// Appended and synced: the new version survives a crash.
    Durable,
    /// [`WriteMode::Durable`] for a record that does not exist yet (a creation's first write).
    DurableNew,
    /// Appended, not synced: only where losing the update costs a repeated, idempotent action
    /// (the next sync, by any writer, makes it durable too).
    Lazy,
}

/// The log in the records directory.
pub const LOG_FILE: &str = "records.log";
/// Held locked (`flock`) while a store is open: one writer per log.
const LOCK_FILE: &str = "records.lock";
/// What the last open cut off the log's end (kept for inspection, replaced by the next cut).
const CUT_FILE: &str = "records.log.cut";
/// A compaction's new log, renamed over [`LOG_FILE`] once complete and synced.
const COMPACTING: &str = "records.log.new";
/// The log is rewritten with its live records only once it is this big and more than twice
/// their size.
const COMPACT_MIN: u64 = 4 << 20;
/// The largest record body (a spec's env and labels are bounded far below it); a frame that
/// says more is damage.
pub const MAX_BODY: usize = 16 << 20;
/// Frame: body length (u32 LE), CRC-32 of the body (u32 LE), then the body: kind (u8), key
/// length (u16 LE), key, value. A header of zeros is no frame (a body is at least 3 bytes):
/// that is where the zeros written ahead begin.
const HEADER: usize = 8;
const PUT: u8 = 1;
const DEL: u8 = 2;

/// The records of one edge (or of its pool members), in one append-only log.
///
/// A write appends a frame (checksummed) under a lock. A durable write then waits for a
/// sync that began after its append: one `fdatasync` makes every frame appended before it
/// durable, so concurrent writers share syncs (group commit) and no write creates a file.
/// Frames are written over zeros written ahead of them (see [`Log::alloc`]), so that most
/// syncs have only data to write, no file size to commit through the file system's journal.
/// A crash can only leave frames appended after the last sync incomplete or missing; on
/// open, the log is cut at the first frame that does not check out, so every record is its
/// last durable version or a later one, never a torn mix. When the log is much larger than
/// its live records it is rewritten with them (a new file, synced, renamed over the log,
/// directory synced). Records of the earlier layout (a file per record) are moved into the
/// log on the first open.
#[derive(Debug)]
pub struct RecordStore {
    dir: PathBuf,
    path: PathBuf,
    log: Mutex<Log>,
    /// Frames appended so far: each takes the next number once written.
    appended: AtomicU64,
    /// Every frame numbered up to this is durable.
    synced: AtomicU64,
    /// Held during a sync (and a compaction), so waiting writers find their frame covered.
    sync_lock: Mutex<()>,
    /// Syncs made (for benchmarks: fewer than durable writes under concurrency).
    syncs: AtomicU64,
    /// Queued writes written by their caller on its own thread (see [`Leader`]).
    in_place: AtomicU64,
    /// Writes waiting for the writer of [`RecordStore::write_queued`].
    queue: Mutex<Queue>,
    /// The lock file, locked for as long as the store is open.
    _lock: File,
}

#[derive(Debug)]
struct Log {
    /// Shared with the syncs (no new descriptor per sync).
    file: std::sync::Arc<File>,
    /// Bytes of whole frames in the file.
    len: u64,
    /// Bytes in the file: the frames, then zeros written ahead of the next ones. A sync after
    /// an append that grew the file commits the new size through the file system's journal
    /// (on ext4 a journal commit, about half again the cost of the sync); one over written
    /// zeros only writes data. A crash may leave these zeros (or a frame written over them
    /// and not yet synced) after the last frame: the open cuts them off.
    alloc: u64,
    /// Each live record's last frame: offset and length.
    live: HashMap<String, (u64, u32)>,
    /// The sum of the live frames' lengths.
    live_bytes: u64,
    /// Why nothing more is written, once something failed that leaves the file's state
    /// uncertain: an append that could not be cut back off, a failed sync (the kernel
    /// reports a writeback error once: a later sync would succeed over lost pages), a
    /// compaction that renamed its log but could not sync the directory. The edge must be
    /// restarted; it then reads what is really on disk.
    broken: Option<String>,
    /// No compaction is tried again before the log reaches this size (after a failed one).
    compact_after: u64,
}

impl Log {
    /// Writes `bytes` after the last whole frame, over zeros written ahead (see
    /// [`opendsec_common::ahead`]). The caller cuts a failed write off.
    fn put(&mut self, bytes: &[u8]) -> std::io::Result<()> {
        opendsec_common::ahead::write_at_end(&self.file, self.len, &mut self.alloc, bytes)
    }
}

/// Writes queued for one append and one sync.
#[derive(Debug, Default)]
struct Queue {
    /// Their frames, back to back.
    bytes: Vec<u8>,
    /// Each frame's key and length, in order.
    frames: Vec<(String, u32)>,
    /// Who waits for each, and whether it waits for a sync.
    waiters: Vec<(tokio::sync::oneshot::Sender<Result<(), String>>, bool)>,
    /// Whether a writer is at work.
    running: bool,
}

/// The write that found the writer idle, until the queue has a writer. Alone in the queue
/// (writes come one at a time), it is appended and synced right here, on a thread of a
/// multi-thread runtime, so that it waits for no thread to wake, neither for the write nor
/// for its answer. Several writes queued together, a runtime of one thread, or a leader
/// dropped before it wrote: a blocking thread writes, so that no batch's sync holds a
/// runtime thread.
struct Leader(Option<std::sync::Arc<RecordStore>>);

impl Leader {
    fn write(mut self) {
        let Some(store) = self.0.take() else { return };
        let alone = store.queue.lock().unwrap_or_else(|p| p.into_inner()).waiters.len() == 1;
        if alone && opendsec_common::on_multi_thread_runtime() {
            RecordStore::drain_queue(store, true);
        } else {
            RecordStore::drain_elsewhere(store);
        }
    }
}

impl Drop for Leader {
    /// Dropped before it wrote (its caller went away): a blocking thread writes.
    fn drop(&mut self) {
        if let Some(store) = self.0.take() {
            RecordStore::drain_elsewhere(store);
        }
    }
}

/// Runs `f` on a blocking thread of the current runtime, not waiting for it; outside a
/// runtime, here.
fn on_a_blocking_thread(f: impl FnOnce() + Send + 'static) {
    match tokio::runtime::Handle::try_current() {
        Ok(h) => drop(h.spawn_blocking(f)),
        Err(_) => f(),
    }
}

/// One frame read back.
struct Frame {
    kind: u8,
    key: String,
    value: Vec<u8>,
    len: u32,
}

fn frame(kind: u8, key: &str, value: &[u8]) -> std::io::Result<Vec<u8>> {
    let body_len = 3 + key.len() + value.len();
    if key.len() > u16::MAX as usize || body_len > MAX_BODY {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("a record of {} bytes is above the {MAX_BODY} bytes one holds", value.len()),
        ));
    }
    // One buffer: the header's checksum is filled in once the body follows it.
    let mut out = Vec::with_capacity(HEADER + body_len);
    out.extend_from_slice(&(body_len as u32).to_le_bytes());
    out.extend_from_slice(&[0; 4]);
    out.push(kind);
    out.extend_from_slice(&(key.len() as u16).to_le_bytes());
    out.extend_from_slice(key.as_bytes());
    out.extend_from_slice(value);
    let crc = crc32fast::hash(&out[HEADER..]);
    out[4..HEADER].copy_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// The frame at the start of `buf`, if a whole one that checks out is there.
fn parse(buf: &[u8]) -> Option<Frame> {
    let len = u32::from_le_bytes(buf.get(0..4)?.try_into().ok()?);
    let crc = u32::from_le_bytes(buf.get(4..8)?.try_into().ok()?);
    if len as usize > MAX_BODY || len < 3 {
        return None;
    }
    let body = buf.get(HEADER..HEADER + len as usize)?;
    if crc32fast::hash(body) != crc {
        return None;
    }
    let kind = body[0];
    let key_len = u16::from_le_bytes([body[1], body[2]]) as usize;
    let key = std::str::from_utf8(body.get(3..3 + key_len)?).ok()?.to_string();
    if kind != PUT && kind != DEL {
        return None;
    }
    Some(Frame { kind, key, value: body[3 + key_len..].to_vec(), len: (HEADER as u32) + len })
}

impl RecordStore {
    /// Opens (creating) `<state_dir>/sandboxes`.
    pub fn open(state_dir: &Path) -> Result<RecordStore, RecordError> {
        RecordStore::open_named(state_dir, RECORDS_DIR)
    }

    /// Opens (creating) `<state_dir>/<name>` (warm pool members: `pool`) and its log: the log
    /// is read, cut after its last whole frame, and the records of the earlier layout are
    /// moved in.
    pub fn open_named(state_dir: &Path, name: &str) -> Result<RecordStore, RecordError> {
        let dir = state_dir.join(name);
        // Records hold each spec's env: the owner's alone (0700 directory, 0600 files).
        opendsec_common::fsperm::private_dir(state_dir)
            .and_then(|()| opendsec_common::fsperm::private_dir(&dir))
            .map_err(|source| RecordError::CreateDir { path: dir.clone(), source })?;
        let path = dir.join(LOG_FILE);
        let lock_path = dir.join(LOCK_FILE);
        let lock = opendsec_common::fsperm::private_file()
            .write(true)
            .create(true)
            .truncate(false)
            .open(&lock_path)
            .map_err(|source| RecordError::Write { path: lock_path.clone(), source })?;
        rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive)
            .map_err(|e| RecordError::Locked { path: path.clone(), source: std::io::Error::from(e) })?;
        // A compaction that did not finish: the log it would have replaced is whole.
        let _ = fs::remove_file(dir.join(COMPACTING));
        let write_err = |source| RecordError::Write { path: path.clone(), source };
        // Written at offsets (not opened to append: a positioned write to a file opened to
        // append lands at its end on Linux).
        let file = opendsec_common::fsperm::private_file()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(write_err)?;
        let bytes = fs::read(&path).map_err(|source| RecordError::Read { path: path.clone(), source })?;
        let (live, len, live_bytes) = scan(&bytes);
        if len < bytes.len() as u64 {
            // Zeros written ahead are cut silently. Anything else after the last whole frame
            // was appended after the last sync (or is damage): cut, and kept aside for
            // whoever wants to look.
            let rest = &bytes[len as usize..];
            let rest = &rest[..rest.iter().rposition(|&b| b != 0).map_or(0, |i| i + 1)];
            if !rest.is_empty() {
                let cut = dir.join(CUT_FILE);
                // Records hold specs' env: the owner's alone, like the log.
                let _ = opendsec_common::fsperm::private_file()
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(&cut)
                    .and_then(|mut f| f.write_all(rest));
                tracing::error!(log = %path.display(), kept = len, cut = rest.len(), saved = %cut.display(),
                    "record log ends in a frame that does not check out; cut there");
            }
            file.set_len(len).and_then(|()| file.sync_all()).map_err(write_err)?;
        }
        // The log's own name is durable before any record in it is relied on.
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(|source| RecordError::Write { path: dir.clone(), source })?;
        let store = RecordStore {
            dir,
            path,
            log: Mutex::new(Log {
                file: std::sync::Arc::new(file),
                len,
                alloc: len,
                live,
                live_bytes,
                broken: None,
                compact_after: 0,
            }),
            appended: AtomicU64::new(0),
            synced: AtomicU64::new(0),
            sync_lock: Mutex::new(()),
            syncs: AtomicU64::new(0),
            in_place: AtomicU64::new(0),
            queue: Mutex::new(Queue::default()),
            _lock: lock,
        };
        store.migrate()?;
        Ok(store)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The log's path.
    pub fn log_path(&self) -> &Path {
        &self.path
    }

    /// Bytes of whole frames in the log (the file may hold zeros after them).
    pub fn log_len(&self) -> u64 {
        self.lock().len
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Log> {
        // Every change to the log's bookkeeping is made after its write succeeded.
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Moves the records of the earlier layout (`<lease>.json`, one file each) into the log:
    /// appended and synced first, then the files removed (a crash between the two moves them
    /// again, the same bytes). Leftover temp files of that layout go too.
    fn migrate(&self) -> Result<(), RecordError> {
        let list_err = |source| RecordError::List { path: self.dir.clone(), source };
        let mut old = Vec::new();
        for entry in fs::read_dir(&self.dir).map_err(list_err)? {
            let entry = entry.map_err(list_err)?;
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            if name.starts_with('.') && name.ends_with(".tmp") {
                let _ = fs::remove_file(entry.path());
            } else if let Some(lease) = name.strip_suffix(".json") {
                old.push((lease.to_string(), entry.path()));
            }
        }
        if old.is_empty() {
            return Ok(());
        }
        old.sort();
        for (lease, path) in &old {
            let bytes = fs::read(path).map_err(|source| RecordError::Read { path: path.clone(), source })?;
            self.append(PUT, lease, &bytes)?;
        }
        self.sync_through(self.appended.load(Ordering::Acquire))
            .map_err(|source| RecordError::Write { path: self.path.clone(), source })?;
        for (_, path) in &old {
            fs::remove_file(path).map_err(|source| RecordError::Remove { path: path.clone(), source })?;
        }
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(|source| RecordError::Write { path: self.dir.clone(), source })?;
        tracing::info!(dir = %self.dir.display(), records = old.len(), "records moved into the record log");
        Ok(())
    }

    /// Appends one frame; answers its number.
    fn append(&self, kind: u8, lease_id: &str, value: &[u8]) -> Result<u64, RecordError> {
        let bytes =
            frame(kind, lease_id, value).map_err(|source| RecordError::Write { path: self.path.clone(), source })?;
        self.append_frames(&bytes, &[(kind, lease_id, bytes.len() as u32)], true).map(|(ticket, _)| ticket)
    }

    /// Appends frames made by [`frame`], `bytes` in the order of `frames` (kind, key, length),
    /// in one write; answers the number of the last. All or none are appended.
    /// Returns the last frame's number, and whether a compaction fell due that is left to the
    /// caller (not `compact_here`).
    fn append_frames(
        &self,
        bytes: &[u8],
        frames: &[(u8, &str, u32)],
        compact_here: bool,
    ) -> Result<(u64, bool), RecordError> {
        let write_err = |source| RecordError::Write { path: self.path.clone(), source };
        let compact = {
            let mut log = self.lock();
            if let Some(why) = &log.broken {
                return Err(write_err(std::io::Error::other(format!("{why}; restart the edge"))));
            }
            if let Err(e) = log.put(bytes) {
                // A partial frame would hide every later one from the next open.
                let len = log.len;
                log.alloc = len;
                if log.file.set_len(len).is_err() {
                    log.broken = Some(format!("an append failed ({e}) and could not be cut off the record log"));
                }
                return Err(write_err(e));
            }
            for &(kind, key, len) in frames {
                let at = log.len;
                log.len += u64::from(len);
                let replaced = match kind {
                    PUT => log.live.insert(key.to_string(), (at, len)),
                    _ => log.live.remove(key),
                };
                if kind == PUT {
                    log.live_bytes += u64::from(len);
                }
                if let Some((_, old)) = replaced {
                    log.live_bytes -= u64::from(old);
                }
            }
            log.len >= COMPACT_MIN.max(log.compact_after) && log.len > 2 * log.live_bytes
        };
        let n = frames.len() as u64;
        let ticket = self.appended.fetch_add(n, Ordering::AcqRel) + n;
        if compact && compact_here {
            self.compact_or_warn();
        }
        Ok((ticket, compact && !compact_here))
    }

    fn compact_or_warn(&self) {
        if let Err(e) = self.compact() {
            tracing::warn!(log = %self.path.display(), error = %e, "record log compaction failed; the log goes on");
        }
    }

    /// [`RecordStore::write`] from async code, without a thread per write: writes queue up
    /// while one blocking thread appends everything queued in one write and syncs once for
    /// all of it, then takes what queued meanwhile, until the queue is empty. A write is
    /// answered once its frame is appended (and synced, unless `Lazy`).
    pub async fn write_queued(
        self: &std::sync::Arc<Self>,
        lease_id: &str,
        bytes: &[u8],
        mode: WriteMode,
    ) -> Result<(), RecordError> {
        let framed =
            frame(PUT, lease_id, bytes).map_err(|source| RecordError::Write { path: self.path.clone(), source })?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        let start = {
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.frames.push((lease_id.to_string(), framed.len() as u32));
            q.bytes.extend_from_slice(&framed);
            q.waiters.push((tx, mode != WriteMode::Lazy));
            !std::mem::replace(&mut q.running, true)
        };
        if start {
            // This write leads, once the writes made ready with it (a CreateMany's items) have
            // queued: see [`Leader`].
            let leader = Leader(Some(self.clone()));
            tokio::task::yield_now().await;
            leader.write();
        }
        match rx.await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(message)) => {
                Err(RecordError::Write { path: self.path.clone(), source: std::io::Error::other(message) })
            }
            Err(_) => {
                Err(RecordError::Join { lease: lease_id.to_string(), message: "the record writer stopped".into() })
            }
        }
    }

    /// The writer of [`RecordStore::write_queued`]: runs until the queue is empty. Its hold on
    /// the store ends before the last writes are answered, so that a store closed after its
    /// last write (an edge restarted in the same process) is closed, its lock free.
    ///
    /// `lone`: the caller's own write is alone in the queue and written on its thread; what
    /// queued meanwhile goes to a blocking thread.
    fn drain_queue(self: std::sync::Arc<Self>, lone: bool) {
        /// Should the writer end early (a panic), the writes still queued are answered (their
        /// callers hear that the writer stopped) and the next write starts a writer.
        struct Running(Option<std::sync::Arc<RecordStore>>);
        impl Drop for Running {
            fn drop(&mut self) {
                if let Some(store) = &self.0
                    && std::thread::panicking()
                {
                    *store.queue.lock().unwrap_or_else(|p| p.into_inner()) = Queue::default();
                }
            }
        }
        let mut running = Running(Some(self));
        let mut batches = 0;
        loop {
            let Some(store) = running.0.as_ref() else { return };
            let batch = {
                let mut q = store.queue.lock().unwrap_or_else(|p| p.into_inner());
                if q.waiters.is_empty() {
                    // Under the lock: a write queued after this starts a writer of its own.
                    q.running = false;
                    return;
                }
                if lone && batches == 1 {
                    drop(q);
                    if let Some(store) = running.0.take() {
                        RecordStore::drain_elsewhere(store);
                    }
                    return;
                }
                batches += 1;
                if lone {
                    store.in_place.fetch_add(q.waiters.len() as u64, Ordering::Relaxed);
                }
                Queue {
                    bytes: std::mem::take(&mut q.bytes),
                    frames: std::mem::take(&mut q.frames),
                    waiters: std::mem::take(&mut q.waiters),
                    running: true,
                }
            };
            let frames: Vec<(u8, &str, u32)> = batch.frames.iter().map(|(k, len)| (PUT, k.as_str(), *len)).collect();
            let (durable, lazy): (Vec<_>, Vec<_>) = batch.waiters.into_iter().partition(|(_, sync)| *sync);
            // A lone write, on a runtime thread, leaves a compaction to a blocking thread.
            let appended = store.append_frames(&batch.bytes, &frames, !lone).map(|(ticket, compact)| {
                if compact {
                    let store = store.clone();
                    on_a_blocking_thread(move || store.compact_or_warn());
                }
                ticket
            });
            let mut answers = Vec::with_capacity(lazy.len() + durable.len());
            // Lazy writes are answered once appended; the rest once synced too.
            let answer = appended.as_ref().map(|_| ()).map_err(|e| e.to_string());
            if durable.is_empty() {
                answers.extend(lazy.into_iter().map(|(w, _)| (w, answer.clone())));
            } else {
                for (w, _) in lazy {
                    let _ = w.send(answer.clone());
                }
                let synced = appended.and_then(|ticket| {
                    store.sync_through(ticket).map_err(|source| RecordError::Write { path: store.path.clone(), source })
                });
                let answer = synced.map_err(|e| e.to_string());
                answers.extend(durable.into_iter().map(|(w, _)| (w, answer.clone())));
            }
            let last = {
                let mut q = store.queue.lock().unwrap_or_else(|p| p.into_inner());
                q.waiters.is_empty() && {
                    q.running = false;
                    true
                }
            };
            if last {
                running.0 = None;
            }
            for (w, a) in answers {
                let _ = w.send(a);
            }
        }
    }

    /// The writer on a blocking thread (here, outside a runtime).
    fn drain_elsewhere(store: std::sync::Arc<Self>) {
        on_a_blocking_thread(move || RecordStore::drain_queue(store, false));
    }

    /// Replaces (or creates) the record of `lease_id` with `bytes`, as `mode` says.
    pub fn write(&self, lease_id: &str, bytes: &[u8], mode: WriteMode) -> Result<(), RecordError> {
        let ticket = self.append(PUT, lease_id, bytes)?;
        if mode != WriteMode::Lazy {
            self.sync_through(ticket).map_err(|source| RecordError::Write { path: self.path.clone(), source })?;
        }
        Ok(())
    }

    /// Removes a record (a missing one is fine). Not synced: a removal lost in a crash only
    /// brings back an ended record, which is removed again.
    pub fn remove(&self, lease_id: &str) -> Result<(), RecordError> {
        if !self.lock().live.contains_key(lease_id) {
            return Ok(());
        }
        self.append(DEL, lease_id, &[]).map(|_| ()).map_err(|e| match e {
            RecordError::Write { path, source } => RecordError::Remove { path, source },
            e => e,
        })
    }

    /// [`RecordStore::remove`], then a sync: the record stays gone after a crash.
    pub fn remove_durable(&self, lease_id: &str) -> Result<(), RecordError> {
        self.remove(lease_id)?;
        self.sync_through(self.appended.load(Ordering::Acquire))
            .map_err(|source| RecordError::Remove { path: self.path.clone(), source })
    }

    /// Makes every frame up to `ticket` durable with one sync, unless one that began after it
    /// already did (group commit).
    fn sync_through(&self, ticket: u64) -> std::io::Result<()> {
        if self.synced.load(Ordering::Acquire) >= ticket {
            return Ok(());
        }
        let _g = self.sync_lock.lock().unwrap_or_else(|p| p.into_inner());
        if self.synced.load(Ordering::Acquire) >= ticket {
            return Ok(());
        }
        // Every frame numbered up to `upto` is in the file this handle writes.
        let (upto, file) = {
            let log = self.lock();
            if let Some(why) = &log.broken {
                return Err(std::io::Error::other(format!("{why}; restart the edge")));
            }
            (self.appended.load(Ordering::Acquire), log.file.clone())
        };
        if let Err(e) = file.sync_data() {
            // The kernel reports a writeback error once: a later sync would succeed over
            // pages that never reached the disk. Nothing is acknowledged from here on.
            self.lock().broken = Some(format!("a sync of the record log failed ({e})"));
            return Err(e);
        }
        self.syncs.fetch_add(1, Ordering::Relaxed);
        self.synced.fetch_max(upto, Ordering::AcqRel);
        Ok(())
    }

    /// Syncs made so far.
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// Queued writes written so far by their caller on its own thread.
    pub fn writes_in_place(&self) -> u64 {
        self.in_place.load(Ordering::Relaxed)
    }

    /// Rewrites the log with its live records only. A failure before the rename leaves the
    /// log as it was (and no new try before it has doubled); after the rename the new log is
    /// the log, and a directory that could not be synced stops further writes.
    fn compact(&self) -> std::io::Result<()> {
        let _g = self.sync_lock.lock().unwrap_or_else(|p| p.into_inner());
        let mut log = self.lock();
        if log.broken.is_some() || !(log.len >= COMPACT_MIN.max(log.compact_after) && log.len > 2 * log.live_bytes) {
            return Ok(());
        }
        let tmp = self.dir.join(COMPACTING);
        let mut entries: Vec<(String, (u64, u32))> = log.live.iter().map(|(k, v)| (k.clone(), *v)).collect();
        entries.sort_by_key(|(_, (at, _))| *at);
        let mut live = HashMap::with_capacity(entries.len());
        let mut at = 0u64;
        // The new log is written through the handle that then serves as the log.
        let written = (|| {
            let _ = fs::remove_file(&tmp);
            let new = opendsec_common::fsperm::private_file().read(true).write(true).create_new(true).open(&tmp)?;
            let mut out = std::io::BufWriter::new(&new);
            let mut buf = Vec::new();
            for (key, (from, len)) in entries {
                buf.resize(len as usize, 0);
                std::os::unix::fs::FileExt::read_exact_at(&*log.file, &mut buf, from)?;
                out.write_all(&buf)?;
                live.insert(key, (at, len));
                at += u64::from(len);
            }
            out.flush()?;
            drop(out);
            new.sync_all()?;
            Ok(new)
        })();
        let new = match written.and_then(|new| fs::rename(&tmp, &self.path).map(|()| new)) {
            Ok(new) => new,
            Err(e) => {
                let _ = fs::remove_file(&tmp);
                log.compact_after = log.len * 2;
                return Err(e);
            }
        };
        let before = log.len;
        let dir_synced = File::open(&self.dir).and_then(|d| d.sync_all());
        *log = Log {
            file: std::sync::Arc::new(new),
            len: at,
            alloc: at,
            live,
            live_bytes: at,
            broken: None,
            compact_after: 0,
        };
        if let Err(e) = dir_synced {
            // Which log a crash would show is not known: acknowledge nothing more.
            log.broken = Some(format!("the record log was compacted but its directory could not be synced ({e})"));
            return Err(e);
        }
        // Everything appended so far is in the new log, synced.
        self.synced.fetch_max(self.appended.load(Ordering::Acquire), Ordering::AcqRel);
        tracing::debug!(log = %self.path.display(), before, after = at, "record log compacted");
        Ok(())
    }

    /// Loads every record, sorted by lease; records that do not decode are reported apart.
    pub fn load_all(&self) -> Result<(Vec<SandboxRecord>, Vec<BadRecord>), RecordError> {
        let log = self.lock();
        let read_err = |source| RecordError::Read { path: self.path.clone(), source };
        let mut good = Vec::new();
        let mut bad = Vec::new();
        let mut buf = Vec::new();
        for (lease, (at, len)) in &log.live {
            buf.resize(*len as usize, 0);
            std::os::unix::fs::FileExt::read_exact_at(&*log.file, &mut buf, *at).map_err(read_err)?;
            let Some(f) = parse(&buf) else {
                return Err(read_err(std::io::Error::other(format!(
                    "the frame of {lease} at {at} no longer checks out"
                ))));
            };
            let at_path = PathBuf::from(format!("{}#{lease}", self.path.display()));
            match SandboxRecord::decode(&f.value, &at_path) {
                Ok(rec) => good.push(rec),
                Err(error) => bad.push(BadRecord { lease_id: lease.clone(), error }),
            }
        }
        good.sort_by(|a, b| a.lease_id.cmp(&b.lease_id));
        bad.sort_by(|a, b| a.lease_id.cmp(&b.lease_id));
        Ok((good, bad))
    }

    /// The raw bytes of every live record (for tests and tools).
    pub fn raw(&self) -> Result<BTreeMap<String, Vec<u8>>, RecordError> {
        let log = self.lock();
        let mut out = BTreeMap::new();
        for (lease, (at, len)) in &log.live {
            let mut buf = vec![0; *len as usize];
            std::os::unix::fs::FileExt::read_exact_at(&*log.file, &mut buf, *at)
                .map_err(|source| RecordError::Read { path: self.path.clone(), source })?;
            out.insert(lease.clone(), parse(&buf).map(|f| f.value).unwrap_or_default());
        }
        Ok(out)
    }
}

/// The live records of the log in `<state_dir>/<name>`, read without changing anything (a
/// frame being appended meanwhile is left out): for tests and tools, beside a running edge.
pub fn peek(state_dir: &Path, name: &str) -> Result<BTreeMap<String, Vec<u8>>, RecordError> {
    let path = state_dir.join(name).join(LOG_FILE);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(source) => return Err(RecordError::Read { path, source }),
    };
    let (live, _, _) = scan(&bytes);
    Ok(live
        .into_iter()
        .filter_map(|(k, (at, len))| parse(&bytes[at as usize..(at + u64::from(len)) as usize]).map(|f| (k, f.value)))
        .collect())
}

/// Reads a log: the live records (their last frames), where its whole frames end, and the
/// live frames' total length.
fn scan(bytes: &[u8]) -> (HashMap<String, (u64, u32)>, u64, u64) {
    let mut live: HashMap<String, (u64, u32)> = HashMap::new();
    let mut at = 0usize;
    while let Some(f) = parse(&bytes[at..]) {
        match f.kind {
            PUT => {
                live.insert(f.key, (at as u64, f.len));
            }
            _ => {
                live.remove(&f.key);
            }
        }
        at += f.len as usize;
    }
    let live_bytes = live.values().map(|(_, l)| u64::from(*l)).sum();
    (live, at as u64, live_bytes)
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
                public_traffic: false,
                pause_on_timeout: false,
                manual_resume: false,
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
        store.write("broken", b"{not json", WriteMode::DurableNew).unwrap();

        let (good, bad) = store.load_all().unwrap();
        assert_eq!(good, vec![rec.clone()]);
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].lease_id, "broken");
        // The same after a reopen; one file in the directory.
        drop(store);
        let store = RecordStore::open(dir.path()).unwrap();
        assert_eq!(store.load_all().unwrap().0, vec![rec.clone()]);
        let mut names: Vec<_> = fs::read_dir(store.dir()).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, [LOCK_FILE, LOG_FILE]);
        // One writer per log.
        let e = RecordStore::open(dir.path()).unwrap_err();
        assert!(matches!(e, RecordError::Locked { .. }), "{e}");

        store.remove(&rec.lease_id).unwrap();
        store.remove(&rec.lease_id).unwrap();
        store.remove_durable("broken").unwrap();
        assert!(store.load_all().unwrap().0.is_empty());
        drop(store);
        let store = RecordStore::open(dir.path()).unwrap();
        let (good, bad) = store.load_all().unwrap();
        assert!(good.is_empty() && bad.is_empty());
    }

    /// The log's frames, without the zeros written ahead of them.
    fn frames_of(store: RecordStore) -> (PathBuf, Vec<u8>) {
        let (path, len) = (store.log_path().to_path_buf(), store.log_len() as usize);
        drop(store);
        let mut bytes = fs::read(&path).unwrap();
        assert!(bytes[len..].iter().all(|&b| b == 0), "only zeros follow the frames");
        bytes.truncate(len);
        (path, bytes)
    }

    /// What a crash can leave after the last sync: a frame cut short, a frame whose bytes
    /// did not all reach the disk. The log is cut at the first such frame: every record is
    /// its last whole version, and writes go on after it.
    #[test]
    fn a_torn_tail_is_cut_and_the_last_whole_versions_stay() {
        let dir = tempfile::tempdir().unwrap();
        let store = RecordStore::open(dir.path()).unwrap();
        store.write("a", b"a1", WriteMode::Durable).unwrap();
        store.write("b", b"b1", WriteMode::Durable).unwrap();
        let whole = store.log_len();
        store.write("a", b"a2-lost", WriteMode::Durable).unwrap();
        let (path, bytes) = frames_of(store);
        // The last frame cut short, then the zeros written ahead of it.
        let mut torn = bytes[..bytes.len() - 3].to_vec();
        torn.extend_from_slice(&[0; 1000]);
        fs::write(&path, &torn).unwrap();
        let store = RecordStore::open(dir.path()).unwrap();
        let raw = store.raw().unwrap();
        assert_eq!((raw["a"].as_slice(), raw["b"].as_slice()), (&b"a1"[..], &b"b1"[..]));
        assert_eq!(fs::metadata(&path).unwrap().len(), whole);
        // What was cut is kept aside (the zeros after it are not), not destroyed, and
        // readable by the edge's user alone.
        assert_eq!(fs::read(store.dir().join(CUT_FILE)).unwrap(), &bytes[whole as usize..bytes.len() - 3]);
        let mode = fs::metadata(store.dir().join(CUT_FILE)).unwrap().permissions();
        assert_eq!(std::os::unix::fs::PermissionsExt::mode(&mode) & 0o077, 0, "{mode:?}");
        store.write("c", b"c1", WriteMode::Durable).unwrap();
        // A frame whose body is wrong (one byte flipped), and a whole frame after it, as a
        // crash can leave frames written over zeros (pages reach the disk in any order).
        let (path, mut bytes) = frames_of(store);
        let n = bytes.len();
        bytes[n - 1] ^= 0xff;
        bytes.extend_from_slice(&frame(PUT, "d", b"after").unwrap());
        bytes.extend_from_slice(&[0; 1000]);
        fs::write(&path, &bytes).unwrap();
        let store = RecordStore::open(dir.path()).unwrap();
        let raw = store.raw().unwrap();
        assert_eq!(raw.keys().collect::<Vec<_>>(), ["a", "b"]);
        // What followed the cut does not come back once frames are written where it was.
        store.write("e", b"e1", WriteMode::Durable).unwrap();
        drop(store);
        let store = RecordStore::open(dir.path()).unwrap();
        assert_eq!(store.raw().unwrap().keys().collect::<Vec<_>>(), ["a", "b", "e"]);
        // Zeros alone after the frames (written ahead, or a size extended and its data never
        // written) are cut without a word.
        fs::remove_file(store.dir().join(CUT_FILE)).unwrap();
        let (path, mut bytes) = frames_of(store);
        bytes.extend_from_slice(&[0u8; 4096]);
        fs::write(&path, &bytes).unwrap();
        let store = RecordStore::open(dir.path()).unwrap();
        assert_eq!(store.raw().unwrap().keys().collect::<Vec<_>>(), ["a", "b", "e"]);
        assert!(!store.dir().join(CUT_FILE).exists());
        assert_eq!(fs::metadata(&path).unwrap().len(), store.log_len());
    }

    /// Frames are written over zeros written ahead of them, so that the file's size changes
    /// once per run of writes, not on every one; the zeros grow with the log, within bounds.
    #[test]
    fn frames_go_over_zeros_written_ahead() {
        let dir = tempfile::tempdir().unwrap();
        let store = RecordStore::open(dir.path()).unwrap();
        let size = |s: &RecordStore| fs::metadata(s.log_path()).unwrap().len();
        store.write("a", b"a1", WriteMode::Durable).unwrap();
        let first = size(&store);
        assert_eq!(first, store.log_len() + opendsec_common::ahead::AHEAD_MIN);
        let mut sizes = std::collections::BTreeSet::new();
        for i in 0..2000u32 {
            store.write(&format!("k{i}"), &[b'v'; 600], WriteMode::Lazy).unwrap();
            let (len, size) = (store.log_len(), size(&store));
            assert!(size > len && size <= len + opendsec_common::ahead::AHEAD_MAX, "{len} of frames in {size} bytes");
            sizes.insert(size);
        }
        // About 1.2 MiB of frames: the file grew 6 to 20 times, not 2,000.
        assert!((6..=20).contains(&sizes.len()), "{} sizes", sizes.len());
        let raw = store.raw().unwrap();
        drop(store);
        let store = RecordStore::open(dir.path()).unwrap();
        assert_eq!(store.raw().unwrap(), raw);
        assert_eq!(size(&store), store.log_len());
    }

    /// A compaction that cannot write its new log leaves the log as it was, and is not tried
    /// again on every write (only once the log has doubled).
    #[test]
    fn a_failed_compaction_changes_nothing_and_backs_off() {
        let dir = tempfile::tempdir().unwrap();
        let store = RecordStore::open(dir.path()).unwrap();
        // A directory where the new log would go: it cannot be created.
        fs::create_dir(store.dir().join(COMPACTING)).unwrap();
        let big = vec![b'y'; 64 << 10];
        for _ in 0..80 {
            store.write("hot", &big, WriteMode::Lazy).unwrap();
        }
        let len = store.log_len();
        assert!(len > COMPACT_MIN, "{len}");
        let after = store.lock().compact_after;
        assert!(after > COMPACT_MIN && after <= 2 * len, "no back-off: {after}");
        assert_eq!(store.raw().unwrap()["hot"], big);
        // Once it can, it does (when the log has grown past the back-off).
        fs::remove_dir(store.dir().join(COMPACTING)).unwrap();
        while store.log_len() >= COMPACT_MIN {
            store.write("hot", &big, WriteMode::Lazy).unwrap();
        }
        assert_eq!(store.raw().unwrap()["hot"], big);
    }

    #[test]
    fn the_log_is_compacted_to_its_live_records() {
        let dir = tempfile::tempdir().unwrap();
        let store = RecordStore::open(dir.path()).unwrap();
        let big = vec![b'x'; 64 << 10];
        for i in 0..100u32 {
            let mut v = big.clone();
            v.extend_from_slice(&i.to_le_bytes());
            store.write("hot", &v, WriteMode::Lazy).unwrap();
            store.write(&format!("gone{i}"), b"short-lived", WriteMode::Lazy).unwrap();
            store.remove(&format!("gone{i}")).unwrap();
        }
        store.write("cold", b"kept", WriteMode::Durable).unwrap();
        let len = store.log_len();
        assert!(len < COMPACT_MIN + (1 << 20), "never compacted: {len} bytes");
        let raw = store.raw().unwrap();
        assert_eq!(raw.keys().collect::<Vec<_>>(), ["cold", "hot"]);
        assert_eq!(&raw["hot"][big.len()..], &99u32.to_le_bytes());
        drop(store);
        let store = RecordStore::open(dir.path()).unwrap();
        assert_eq!(store.raw().unwrap(), raw);
        assert!(!dir.path().join(RECORDS_DIR).join(COMPACTING).exists());
    }

    /// Records of the earlier layout (a file each) move into the log on the first open; its
    /// temp files go; a record that does not decode is still reported, not lost silently.
    #[test]
    fn records_of_the_file_per_record_layout_move_into_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let old = dir.path().join(RECORDS_DIR);
        fs::create_dir_all(&old).unwrap();
        let rec = sample();
        fs::write(old.join(format!("{}.json", rec.lease_id)), rec.encode().unwrap()).unwrap();
        fs::write(old.join("broken.json"), b"{").unwrap();
        fs::write(old.join(".x.0000000000000001.tmp"), b"{").unwrap();
        let store = RecordStore::open(dir.path()).unwrap();
        let (good, bad) = store.load_all().unwrap();
        assert_eq!(good, vec![rec.clone()]);
        assert_eq!(bad.iter().map(|b| b.lease_id.as_str()).collect::<Vec<_>>(), ["broken"]);
        let mut names: Vec<_> = fs::read_dir(&old).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        assert_eq!(names, [LOCK_FILE, LOG_FILE]);
        drop(store);
        let store = RecordStore::open(dir.path()).unwrap();
        assert_eq!(store.load_all().unwrap().0, vec![rec]);
    }

    #[test]
    fn a_record_above_the_bound_is_refused_and_changes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = RecordStore::open(dir.path()).unwrap();
        store.write("a", b"a1", WriteMode::Durable).unwrap();
        let e = store.write("a", &vec![0; MAX_BODY], WriteMode::Durable).unwrap_err();
        assert!(e.to_string().contains("above"), "{e}");
        assert_eq!(store.raw().unwrap()["a"], b"a1");
        store.write("b", b"b1", WriteMode::Durable).unwrap();
        drop(store);
        assert_eq!(RecordStore::open(dir.path()).unwrap().raw().unwrap().len(), 2);
    }

    #[test]
    fn concurrent_durable_writes_share_syncs() {
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(RecordStore::open(dir.path()).unwrap());
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let store = store.clone();
                std::thread::spawn(move || {
                    for i in 0..25 {
                        let lease = format!("t{t}-{i}");
                        store.write(&lease, lease.as_bytes(), WriteMode::DurableNew).unwrap();
                        store.write(&lease, b"second", WriteMode::Durable).unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let raw = store.raw().unwrap();
        assert_eq!(raw.len(), 200);
        assert!(raw.values().all(|v| v == b"second"));
        // At most one sync per write; how many fewer depends on timing, so only bounded.
        assert!(store.syncs() <= 400, "{}", store.syncs());
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_lone_write_is_written_by_its_caller_and_a_crowd_by_a_blocking_thread() {
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(RecordStore::open(dir.path()).unwrap());
        // One at a time: each write is alone in the queue, so its caller writes and syncs it.
        for i in 0..50 {
            store.write_queued(&format!("one-{i}"), b"v", WriteMode::Durable).await.unwrap();
        }
        assert_eq!((store.writes_in_place(), store.syncs()), (50, 50));
        // Many made ready together (as a CreateMany's items are): not by the caller, and in
        // far fewer syncs than writes.
        let writes = (0..300).map(|i| {
            let store = store.clone();
            async move { store.write_queued(&format!("many-{i}"), b"v", WriteMode::Durable).await }
        });
        for r in futures::future::join_all(writes).await {
            r.unwrap();
        }
        assert_eq!(store.writes_in_place(), 50);
        assert!(store.syncs() - 50 < 300, "{}", store.syncs());
        drop(store);
        assert_eq!(RecordStore::open(dir.path()).unwrap().raw().unwrap().len(), 350);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn queued_writes_go_out_together_in_order_and_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let store = std::sync::Arc::new(RecordStore::open(dir.path()).unwrap());
        // 400 writers at once, each writing its record twice: the second version must win
        // (a writer's two writes are queued in order), and the queue shares syncs.
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..400 {
            let store = store.clone();
            tasks.spawn(async move {
                let lease = format!("l{i}");
                store.write_queued(&lease, b"first", WriteMode::DurableNew).await.unwrap();
                store.write_queued(&lease, lease.as_bytes(), WriteMode::Durable).await.unwrap();
            });
        }
        while let Some(r) = tasks.join_next().await {
            r.unwrap();
        }
        let syncs = store.syncs();
        // Each write waited for a sync; with 400 writers queued at once, far fewer syncs
        // than writes are made (at most one per write, whatever the timing).
        assert!((1..=800).contains(&syncs), "{syncs}");
        // Lazy writes alone are appended without a sync.
        store.write_queued("lazy", b"x", WriteMode::Lazy).await.unwrap();
        assert_eq!(store.syncs(), syncs);
        // An oversized record is refused before it is queued; the queue goes on.
        let big = vec![0u8; MAX_BODY + 1];
        assert!(matches!(store.write_queued("big", &big, WriteMode::Durable).await, Err(RecordError::Write { .. })));
        store.write_queued("after", b"y", WriteMode::Durable).await.unwrap();
        // A write whose caller goes away as soon as it is queued (it started the writer):
        // the writer still runs, and the next write is not left waiting behind it.
        let gone = futures::FutureExt::now_or_never(store.write_queued("gone", b"z", WriteMode::Durable));
        assert!(gone.is_none(), "the leader waits for what is made ready with it");
        tokio::time::timeout(std::time::Duration::from_secs(10), store.write_queued("next", b"n", WriteMode::Durable))
            .await
            .expect("the next write was left waiting")
            .unwrap();
        drop(store);
        let store = RecordStore::open(dir.path()).unwrap();
        let raw = store.raw().unwrap();
        assert_eq!(raw.len(), 404);
        for i in 0..400 {
            assert_eq!(raw[&format!("l{i}")], format!("l{i}").as_bytes());
        }
        assert_eq!(raw["after"], b"y");
    }

    #[test]
    fn spec_round_trips_through_proto() {
        let spec = sample().spec;
        assert_eq!(SpecRecord::from_proto(&spec.to_proto()), spec);
        assert_eq!(PriorityRecord::from_proto(99), None);
    }
}
