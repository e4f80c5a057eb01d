//! The standalone store: redb tables (one per entity kind, values versioned JSON rows), its
//! write-ahead log ([`crate::wal`]) and the group-commit thread that is the only writer.
//!
//! Invariants:
//! - the commit thread alone applies commands (under the state write lock) and writes the
//!   store; it replies to a caller only after the batch holding that command's writes is
//!   durable: its frame synced in the log (redb then takes it unsynced, and is synced at
//!   checkpoints), or, for a batch too large for a frame, its redb commit synced;
//! - a batch's writes go in one frame and one transaction, so a crash leaves either all or
//!   none of them;
//! - if a commit fails before it is durable, memory is reloaded from the store (so it never
//!   runs ahead of the disk) and the batch's callers get `unavailable`; if even the reload
//!   fails, or redb fails to take a batch the log holds, the node refuses every later command
//!   (a restart writes the log into redb).
//!
//! Readers may briefly see a batch's effect before its commit returns (the lock is released
//! before the fsync so reads and new proposals are not stalled by it); callers never do.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::command::{Command, Output, Row, Table, Write};
use crate::error::IamError;
use crate::state::{State, apply};
use crate::wal::{EncodedRow, Frame, RowWrite, Wal};

/// Version of the stored rows.
pub const ROW_VERSION: u32 = 1;
/// redb's record of the last log frame whose rows it holds (key [`WAL_APPLIED`]).
const WAL_TABLE: TableDefinition<'static, &'static str, u64> = TableDefinition::new("iam_wal");
const WAL_APPLIED: &str = "applied";
/// A checkpoint (redb synced, the log emptied) once the log holds this much,
const CHECKPOINT_BYTES: u64 = 64 << 20;
/// or this many commits,
const CHECKPOINT_COMMITS: u32 = 4096;
/// or, when no command waits, this many,
const CHECKPOINT_IDLE_COMMITS: u32 = 256;
/// or after this long without a command.
const CHECKPOINT_IDLE: std::time::Duration = std::time::Duration::from_secs(1);
/// File name of the database inside the data dir.
pub const DB_FILE: &str = "iam.redb";

pub(crate) fn def(t: Table) -> TableDefinition<'static, &'static str, &'static str> {
    TableDefinition::new(t.name())
}

#[derive(Serialize)]
struct RowOut<'a, T> {
    v: u32,
    #[serde(flatten)]
    data: &'a T,
}

#[derive(Deserialize)]
struct RowIn<T> {
    v: u32,
    #[serde(flatten)]
    data: T,
}

fn ser<T: Serialize>(table: Table, data: &T) -> Result<String, IamError> {
    serde_json::to_string(&RowOut { v: ROW_VERSION, data })
        .map_err(|source| IamError::Encode { table: table.name(), source })
}

/// The stored JSON of a row: `{"v":1, ...fields}`.
pub fn encode_row(row: &Row) -> Result<String, IamError> {
    let t = row.table();
    match row {
        Row::Project(r) => ser(t, r),
        Row::Principal(r) => ser(t, r),
        Row::Token(r) => ser(t, r),
        Row::Grant(r) => ser(t, r),
        Row::Lease(r) => ser(t, r),
        Row::Lock(r) => ser(t, r),
        Row::Meta(r) => ser(t, r),
        Row::Pool(r) => ser(t, r.as_ref()),
        Row::Image(r) => ser(t, r),
    }
}

fn de<T: DeserializeOwned>(table: Table, key: &str, value: &str) -> Result<T, IamError> {
    let row: RowIn<T> = serde_json::from_str(value).map_err(|source| IamError::CorruptRow {
        table: table.name(),
        key: key.to_string(),
        source,
    })?;
    if row.v != ROW_VERSION {
        return Err(IamError::RowVersion { table: table.name(), key: key.to_string(), version: row.v });
    }
    Ok(row.data)
}

/// Reads a stored row back.
pub fn decode_row(table: Table, key: &str, value: &str) -> Result<Row, IamError> {
    Ok(match table {
        Table::Projects => Row::Project(de(table, key, value)?),
        Table::Principals => Row::Principal(de(table, key, value)?),
        Table::Tokens => Row::Token(de(table, key, value)?),
        Table::Grants => Row::Grant(de(table, key, value)?),
        Table::Leases => Row::Lease(de(table, key, value)?),
        Table::Locks => Row::Lock(de(table, key, value)?),
        Table::Meta => Row::Meta(de(table, key, value)?),
        Table::Pools => Row::Pool(Box::new(de(table, key, value)?)),
        Table::Images => Row::Image(de(table, key, value)?),
    })
}

/// Whether `iam_dir` holds an IAM's store: its own (standalone, or one member's directory) or
/// that of members in `member-<id>` beneath it (`cluster up --iam-replicas`). An empty
/// directory (a fresh mount point, a systemd state directory) holds none.
pub fn holds_state(iam_dir: &Path) -> bool {
    iam_dir.join(DB_FILE).exists()
        || std::fs::read_dir(iam_dir).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.file_name().to_string_lossy().starts_with("member-") && e.path().join(DB_FILE).exists())
        })
}

/// Opens (creates) the database in `data_dir` with every table present.
pub fn open_db(data_dir: &Path) -> Result<Database, IamError> {
    opendsec_common::fsperm::private_dir(data_dir)
        .map_err(|source| IamError::DataDir { path: data_dir.to_path_buf(), source })?;
    let db = Database::create(data_dir.join(DB_FILE)).map_err(|e| IamError::Store { op: "open", source: e.into() })?;
    let tx = db.begin_write().map_err(|e| IamError::Store { op: "begin write", source: e.into() })?;
    for t in Table::ALL {
        tx.open_table(def(t)).map_err(|e| IamError::Store { op: "create table", source: e.into() })?;
    }
    tx.commit().map_err(|e| IamError::Store { op: "commit", source: e.into() })?;
    Ok(db)
}

/// Loads the whole state from the store.
pub fn load(db: &Database) -> Result<State, IamError> {
    let rtx = db.begin_read().map_err(|e| IamError::Store { op: "begin read", source: e.into() })?;
    let mut rows = Vec::new();
    for t in Table::ALL {
        let table = rtx.open_table(def(t)).map_err(|e| IamError::Store { op: "open table", source: e.into() })?;
        let iter = table.iter().map_err(|e| IamError::Store { op: "scan", source: e.into() })?;
        for item in iter {
            let (k, v) = item.map_err(|e| IamError::Store { op: "scan", source: e.into() })?;
            rows.push(decode_row(t, k.value(), v.value())?);
        }
    }
    Ok(State::from_rows(rows))
}

/// Writes coalesced per key (the last write to a key wins), then encoded.
#[derive(Debug, Default)]
pub struct WriteSet {
    rows: BTreeMap<(Table, String), Option<Row>>,
}

impl WriteSet {
    pub fn extend(&mut self, writes: Vec<Write>) {
        for w in writes {
            match w {
                Write::Put(row) => {
                    self.rows.insert((row.table(), row.key()), Some(row));
                }
                Write::Delete { table, key } => {
                    self.rows.insert((table, key), None);
                }
            }
        }
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The rows encoded, in table and key order.
    pub fn encode(&self) -> Result<Vec<EncodedRow<'_>>, IamError> {
        self.rows.iter().map(|((t, k), row)| Ok((*t, k.as_str(), row.as_ref().map(encode_row).transpose()?))).collect()
    }

    /// Writes everything into `tx` (committed by the caller, with whatever else it holds).
    pub fn write_into(&self, tx: &redb::WriteTransaction) -> Result<(), IamError> {
        let encoded = self.encode()?;
        let rows: Vec<RowWrite<'_>> = encoded.iter().map(|(t, k, v)| (*t, *k, v.as_deref())).collect();
        write_rows(tx, &rows)
    }
}

/// Writes `rows` into `tx`, opening each table once per run of its rows.
fn write_rows(tx: &redb::WriteTransaction, rows: &[RowWrite<'_>]) -> Result<(), IamError> {
    let store = |op| move |e: redb::StorageError| IamError::Store { op, source: e.into() };
    for run in rows.chunk_by(|a, b| a.0 == b.0) {
        let mut table =
            tx.open_table(def(run[0].0)).map_err(|e| IamError::Store { op: "open table", source: e.into() })?;
        for (_, key, value) in run {
            match value {
                Some(v) => table.insert(*key, *v).map(|_| ()).map_err(store("insert"))?,
                None => table.remove(*key).map(|_| ()).map_err(store("remove"))?,
            }
        }
    }
    Ok(())
}

/// Commits `rows` into redb with the number of the log frame that holds them (synced if
/// `durable`, else with the next synced commit).
fn commit_rows(db: &Database, rows: &[RowWrite<'_>], frame: u64, durable: bool) -> Result<(), IamError> {
    let store = |op| move |e: redb::Error| IamError::Store { op, source: e };
    let mut tx = db.begin_write().map_err(|e| store("begin write")(e.into()))?;
    if !durable {
        tx.set_durability(redb::Durability::None).map_err(|e| store("set durability")(e.into()))?;
    }
    write_rows(&tx, rows)?;
    let mut t = tx.open_table(WAL_TABLE).map_err(|e| store("open table")(e.into()))?;
    t.insert(WAL_APPLIED, frame).map_err(|e| store("record the log frame")(e.into()))?;
    drop(t);
    tx.commit().map_err(|e| store("commit")(e.into()))
}

/// The last log frame whose rows redb holds (0: none).
fn wal_applied(db: &Database) -> Result<u64, IamError> {
    let rtx = db.begin_read().map_err(|e| IamError::Store { op: "begin read", source: e.into() })?;
    match rtx.open_table(WAL_TABLE) {
        Err(redb::TableError::TableDoesNotExist(_)) => Ok(0),
        Err(e) => Err(IamError::Store { op: "open table", source: e.into() }),
        Ok(t) => Ok(t
            .get(WAL_APPLIED)
            .map_err(|e| IamError::Store { op: "read", source: e.into() })?
            .map_or(0, |v| v.value())),
    }
}

/// Opens the standalone store in `data_dir`: redb, then its log, whose frames redb may not
/// hold yet are written into it (synced) before the log is emptied.
pub fn open_standalone(data_dir: &Path) -> Result<(Database, Wal), IamError> {
    let db = open_db(data_dir)?;
    let (mut wal, frames) = Wal::open(data_dir)?;
    let applied = wal_applied(&db)?;
    let todo: Vec<&Frame> = frames.iter().filter(|(seq, _)| *seq > applied).collect();
    if let Some((last, _)) = todo.last() {
        // Frame by frame, in order: the last write of each key wins, as it did.
        let mut last_of: BTreeMap<(Table, &str), Option<&str>> = BTreeMap::new();
        for (t, k, v) in todo.iter().flat_map(|(_, rows)| rows) {
            last_of.insert((*t, k.as_str()), v.as_deref());
        }
        let rows: Vec<RowWrite<'_>> = last_of.into_iter().map(|((t, k), v)| (t, k, v)).collect();
        commit_rows(&db, &rows, *last, true)?;
        tracing::info!(frames = todo.len(), "iam: commits in the log written into the store");
    }
    if !wal.is_empty() {
        wal.empty()?;
    }
    wal.number_from(applied);
    Ok((db, wal))
}

/// What the commit thread shares with readers.
#[derive(Debug)]
pub struct Shared {
    pub state: RwLock<State>,
    /// Set when a failed commit could not be followed by a reload: memory may be ahead of the
    /// disk, so nothing more is committed.
    pub failed: AtomicBool,
}

impl Shared {
    pub fn read(&self) -> std::sync::RwLockReadGuard<'_, State> {
        // A poisoned lock means a panic in apply, which only happens on a broken invariant; the
        // state is still the last consistent one written under the lock, so keep serving it.
        self.state.read().unwrap_or_else(|p| p.into_inner())
    }

    pub fn write(&self) -> std::sync::RwLockWriteGuard<'_, State> {
        self.state.write().unwrap_or_else(|p| p.into_inner())
    }
}

/// A command waiting to be committed.
#[derive(Debug)]
struct Pending {
    cmd: Command,
    reply: oneshot::Sender<Result<Output, IamError>>,
}

/// Applies `cmds` in order and persists their writes as one commit (used by the commit
/// thread for each batch, and at open for the bootstrap): through the log when there is one
/// and the batch fits a frame, else straight into redb, synced.
pub fn apply_and_persist(
    db: &Database,
    wal: &mut Wal,
    shared: &Shared,
    cmds: impl Iterator<Item = Command>,
) -> Result<Vec<Result<Output, IamError>>, IamError> {
    let mut set = WriteSet::default();
    let mut results = Vec::new();
    {
        let mut st = shared.write();
        for cmd in cmds {
            let (r, w) = apply(&mut st, &cmd);
            st.meta.applied_index += 1;
            set.extend(w);
            results.push(r);
        }
        if !set.is_empty() {
            set.extend(vec![Write::Put(Row::Meta(st.meta.clone()))]);
        }
    }
    if set.is_empty() {
        return Ok(results);
    }
    let encoded = match set.encode() {
        Ok(e) => e,
        Err(e) => return Err(undo(db, wal, shared, e)),
    };
    let rows: Vec<RowWrite<'_>> = encoded.iter().map(|(t, k, v)| (*t, *k, v.as_deref())).collect();
    let durable = if crate::wal::body_size(&rows) > crate::wal::MAX_BODY {
        // Too large for a frame: redb synced, under a number of its own that the frames
        // before it (older) are never written again after.
        commit_rows(db, &rows, wal.skip(), true).map(|()| None)
    } else {
        wal.append(&rows).map(Some)
    };
    match durable {
        Ok(None) => Ok(results),
        Ok(Some(frame)) => {
            if let Err(e) = commit_rows(db, &rows, frame, false) {
                // The batch is durable (in the log) and answered as done; memory holds it and
                // redb does not: nothing more is committed until a restart writes the log in.
                tracing::error!(error = %e, "iam: the store failed to take a commit the log holds; refusing further commands until restarted");
                shared.failed.store(true, Ordering::SeqCst);
            }
            Ok(results)
        }
        Err(e) => Err(undo(db, wal, shared, e)),
    }
}

/// A batch that did not become durable: memory goes back to what the store holds (or, if it
/// cannot, or the log can take no more, the store refuses every later command); answers `e`.
fn undo(db: &Database, wal: &Wal, shared: &Shared, e: IamError) -> IamError {
    tracing::error!(error = %e, "iam commit failed; reloading state from the store");
    if wal.is_broken() {
        // A failed sync: nothing later can be made durable through the log.
        tracing::error!("iam log failed; refusing further commands until restarted");
        shared.failed.store(true, Ordering::SeqCst);
    }
    match load(db) {
        Ok(st) => *shared.write() = st,
        Err(reload) => {
            tracing::error!(error = %reload, "iam reload failed; refusing further commands");
            shared.failed.store(true, Ordering::SeqCst);
        }
    }
    e
}

/// Makes redb durable (one synced commit, holding every commit it took unsynced) and
/// empties the log. A failure is retried at the next checkpoint: until then the log keeps
/// what redb may not hold. Never once the store failed: redb may then lack a commit only the
/// log holds.
fn checkpoint(db: &Database, wal: &mut Wal, shared: &Shared) {
    if shared.failed.load(Ordering::SeqCst) || wal.is_broken() {
        return;
    }
    let synced = match db.begin_write() {
        Ok(tx) => tx.commit().map_err(redb::Error::from),
        Err(e) => Err(e.into()),
    };
    let r = match synced {
        Ok(()) => wal.empty(),
        Err(source) => Err(IamError::Store { op: "checkpoint", source }),
    };
    if let Err(e) = r {
        tracing::warn!(error = %e, "iam checkpoint failed; the log keeps its commits");
    }
}

/// The standalone store's group commit. Commands queue; the caller that finds no commit
/// under way leads, once the commands made ready with its own (an AdmitMany's items) have
/// queued. Alone in the queue (commands come one at a time), its command is applied and made
/// durable right there, on a thread of a multi-thread runtime, so that it waits for no thread
/// to wake, neither for the commit nor for its answer. Otherwise the commit thread
/// ([`run_committer`]) commits up to `batch_max` queued commands at a time, answers them, and
/// goes on until the queue is empty, so that no batch's sync holds a runtime thread. The
/// commit thread also checkpoints (see [`CHECKPOINT_BYTES`] and below) once commits pause.
#[derive(Debug)]
pub struct Committer {
    shared: Arc<Shared>,
    batch_max: usize,
    queue: Mutex<Queue>,
    store: Mutex<Store>,
    /// A caller asked the commit thread for a checkpoint, not yet made.
    checkpoint_asked: AtomicBool,
    /// Commits made by the callers themselves, and by the commit thread.
    by_callers: AtomicU64,
    by_thread: AtomicU64,
}

#[derive(Debug, Default)]
struct Queue {
    pending: Vec<Pending>,
    /// A committer is at work (or about to be).
    running: bool,
}

#[derive(Debug)]
struct Store {
    db: Database,
    wal: Wal,
    /// Commits since the last checkpoint.
    commits: u32,
    last_commit: std::time::Instant,
}

impl Store {
    /// Whether a checkpoint is due whatever else waits.
    fn checkpoint_due(&self) -> bool {
        self.wal.len() >= CHECKPOINT_BYTES || self.commits >= CHECKPOINT_COMMITS
    }

    fn checkpoint(&mut self, shared: &Shared) {
        checkpoint(&self.db, &mut self.wal, shared);
        self.commits = 0;
    }
}

/// What the commit thread is asked to do.
#[derive(Debug)]
pub enum Wake {
    /// Commit the queue: the caller that leads does not.
    Lead,
    /// Checkpoint if one is due, or if commits paused after many.
    Checkpoint,
}

impl Committer {
    pub fn new(db: Database, wal: Wal, shared: Arc<Shared>, batch_max: usize) -> Committer {
        let store = Store { db, wal, commits: 0, last_commit: std::time::Instant::now() };
        Committer {
            shared,
            batch_max: batch_max.max(1),
            queue: Mutex::default(),
            store: Mutex::new(store),
            checkpoint_asked: AtomicBool::new(false),
            by_callers: AtomicU64::new(0),
            by_thread: AtomicU64::new(0),
        }
    }

    /// Commits made so far by callers on their own threads, and by the commit thread.
    pub fn commits_made(&self) -> (u64, u64) {
        (self.by_callers.load(Ordering::Relaxed), self.by_thread.load(Ordering::Relaxed))
    }

    /// Commits `cmd` with whatever else is queued; `thread` reaches the commit thread.
    pub async fn execute(&self, cmd: Command, thread: &mpsc::Sender<Wake>) -> Result<Output, IamError> {
        let (reply, rx) = oneshot::channel();
        let lead = {
            let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
            q.pending.push(Pending { cmd, reply });
            !std::mem::replace(&mut q.running, true)
        };
        if lead {
            let mut leader = Leader { committer: self, thread, armed: true };
            tokio::task::yield_now().await;
            leader.lead();
        }
        rx.await.map_err(|_| IamError::Stopped)?
    }

    /// Commits what is queued, batch by batch, until the queue is empty. `lone`: the caller's
    /// own command is alone in the queue and committed on its thread, under the store it
    /// holds; what queued meanwhile goes to the commit thread, as do checkpoints.
    ///
    /// Should a commit panic, nothing more is committed until IAM is restarted: the store is
    /// marked failed, and whatever is queued is answered that IAM stopped.
    fn drain(&self, lone: Option<(&mpsc::Sender<Wake>, MutexGuard<'_, Store>)>) {
        struct Unwinding<'a>(&'a Committer);
        impl Drop for Unwinding<'_> {
            fn drop(&mut self) {
                if std::thread::panicking() {
                    self.0.shared.failed.store(true, Ordering::SeqCst);
                    *self.0.queue.lock().unwrap_or_else(|p| p.into_inner()) = Queue::default();
                }
            }
        }
        let _unwinding = Unwinding(self);
        let (thread, mut held) = match lone {
            Some((t, store)) => (Some(t), Some(store)),
            None => (None, None),
        };
        let mut batches = 0;
        loop {
            let batch: Vec<Pending> = {
                let mut q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
                if q.pending.is_empty() {
                    // Under the lock: a command queued after this leads.
                    q.running = false;
                    return;
                }
                if batches == 1
                    && let Some(t) = thread
                    && t.send(Wake::Lead).is_ok()
                {
                    return;
                }
                // (Past a commit thread that is gone, the store closing, this goes on.)
                batches += 1;
                let n = q.pending.len().min(self.batch_max);
                q.pending.drain(..n).collect()
            };
            let mut store = match held.take() {
                Some(store) => store,
                None => self.store.lock().unwrap_or_else(|p| p.into_inner()),
            };
            if self.shared.failed.load(Ordering::SeqCst) {
                for p in batch {
                    let _ = p.reply.send(Err(IamError::StoreFailed));
                }
                continue;
            }
            let (cmds, replies): (Vec<Command>, Vec<_>) = batch.into_iter().map(|p| (p.cmd, p.reply)).unzip();
            let Store { db, wal, .. } = &mut *store;
            match apply_and_persist(db, wal, &self.shared, cmds.into_iter()) {
                Ok(results) => {
                    for (reply, r) in replies.into_iter().zip(results) {
                        // A caller that went away does not matter: the command is committed.
                        let _ = reply.send(r);
                    }
                }
                Err(e) => {
                    let msg = e.to_string();
                    for reply in replies {
                        let _ = reply.send(Err(IamError::CommitFailed(msg.clone())));
                    }
                }
            }
            store.commits += 1;
            store.last_commit = std::time::Instant::now();
            let by = if thread.is_some() && batches == 1 { &self.by_callers } else { &self.by_thread };
            by.fetch_add(1, Ordering::Relaxed);
            let wanted = store.checkpoint_due() || store.commits >= CHECKPOINT_IDLE_COMMITS;
            let here = match thread {
                // Not on a caller's way: asked of the commit thread once (here if it is gone).
                Some(t) => {
                    wanted && !self.checkpoint_asked.swap(true, Ordering::AcqRel) && t.send(Wake::Checkpoint).is_err()
                }
                None => store.checkpoint_due(),
            };
            if here {
                store.checkpoint(&self.shared);
            }
        }
    }

    /// On the commit thread: a checkpoint if one is due, or after many commits if none is
    /// queued or under way, or if a caller asked for one (it found the queue empty then).
    fn checkpoint_if_paused(&self, asked: bool) {
        let mut store = self.store.lock().unwrap_or_else(|p| p.into_inner());
        if asked {
            self.checkpoint_asked.store(false, Ordering::Release);
        }
        if store.checkpoint_due() || (store.commits >= CHECKPOINT_IDLE_COMMITS && (asked || self.idle())) {
            store.checkpoint(&self.shared);
        }
    }

    /// Whether no command waits or is being committed.
    fn idle(&self) -> bool {
        let q = self.queue.lock().unwrap_or_else(|p| p.into_inner());
        !q.running && q.pending.is_empty()
    }
}

/// The caller that found no commit under way, until the queue has a committer (see
/// [`Committer`]); dropped before, it hands the queue to the commit thread.
struct Leader<'a> {
    committer: &'a Committer,
    thread: &'a mpsc::Sender<Wake>,
    armed: bool,
}

impl Leader<'_> {
    /// Commits here a command alone in the queue, on a multi-thread runtime, when the store is
    /// free (not in a checkpoint); otherwise the commit thread is asked to, on drop.
    fn lead(&mut self) {
        let alone = self.committer.queue.lock().unwrap_or_else(|p| p.into_inner()).pending.len() == 1;
        if !(alone && opendsec_common::on_multi_thread_runtime()) {
            return;
        }
        let store = match self.committer.store.try_lock() {
            Ok(store) => store,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return,
        };
        self.armed = false;
        self.committer.drain(Some((self.thread, store)));
    }
}

impl Drop for Leader<'_> {
    fn drop(&mut self) {
        if self.armed && self.thread.send(Wake::Lead).is_err() {
            // The commit thread is gone (the store is closing): commit here.
            self.committer.drain(None);
        }
    }
}

/// The commit thread: commits the queue when asked (see [`Committer`]), checkpoints once
/// commits pause, and when every sender is gone commits what is still queued, checkpoints a
/// last time and returns.
pub fn run_committer(c: Arc<Committer>, rx: mpsc::Receiver<Wake>) {
    loop {
        match rx.recv_timeout(CHECKPOINT_IDLE) {
            Ok(Wake::Lead) => {
                c.drain(None);
                c.checkpoint_if_paused(false);
            }
            Ok(Wake::Checkpoint) => c.checkpoint_if_paused(true),
            Err(mpsc::RecvTimeoutError::Timeout) => {
                let mut store = c.store.lock().unwrap_or_else(|p| p.into_inner());
                if store.commits > 0 && store.last_commit.elapsed() >= CHECKPOINT_IDLE {
                    store.checkpoint(&c.shared);
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
        }
    }
    c.drain(None);
    let mut store = c.store.lock().unwrap_or_else(|p| p.into_inner());
    if store.commits > 0 {
        store.checkpoint(&c.shared);
    }
    tracing::debug!("iam commit thread stopping");
}
