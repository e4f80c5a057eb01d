//! The standalone store: redb tables (one per entity kind, values versioned JSON rows) and the
//! group-commit thread that is the only writer.
//!
//! Invariants:
//! - the commit thread alone applies commands (under the state write lock) and writes the
//!   store; it replies to a caller only after the transaction holding that command's writes
//!   is durably committed;
//! - a batch's writes go in one transaction, so a crash leaves either all or none of them;
//! - if a commit fails, memory is reloaded from the store (so it never runs ahead of the disk)
//!   and the batch's callers get `unavailable`; if even the reload fails, the node refuses
//!   every later command.
//!
//! Readers may briefly see a batch's effect before its commit returns (the lock is released
//! before the fsync so reads and new proposals are not stalled by it); callers never do.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, RwLock};

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use crate::command::{Command, Output, Row, Table, Write};
use crate::error::IamError;
use crate::state::{State, apply};

/// Version of the stored rows.
pub const ROW_VERSION: u32 = 1;
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

    /// Writes everything in one durable transaction.
    pub fn persist(&self, db: &Database) -> Result<(), IamError> {
        let tx = db.begin_write().map_err(|e| IamError::Store { op: "begin write", source: e.into() })?;
        self.write_into(&tx)?;
        tx.commit().map_err(|e| IamError::Store { op: "commit", source: e.into() })
    }

    /// Writes everything into `tx` (committed by the caller, with whatever else it holds).
    pub fn write_into(&self, tx: &redb::WriteTransaction) -> Result<(), IamError> {
        let encoded: Vec<(Table, &str, Option<String>)> = self
            .rows
            .iter()
            .map(|((t, k), row)| Ok((*t, k.as_str(), row.as_ref().map(encode_row).transpose()?)))
            .collect::<Result<_, IamError>>()?;
        let mut i = 0;
        while i < encoded.len() {
            let t = encoded[i].0;
            let mut table =
                tx.open_table(def(t)).map_err(|e| IamError::Store { op: "open table", source: e.into() })?;
            while i < encoded.len() && encoded[i].0 == t {
                let (_, key, value) = &encoded[i];
                match value {
                    Some(v) => {
                        table
                            .insert(*key, v.as_str())
                            .map_err(|e| IamError::Store { op: "insert", source: e.into() })?;
                    }
                    None => {
                        table.remove(*key).map_err(|e| IamError::Store { op: "remove", source: e.into() })?;
                    }
                }
                i += 1;
            }
        }
        Ok(())
    }
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

/// A command waiting for the commit thread.
#[derive(Debug)]
pub struct Pending {
    pub cmd: Command,
    pub reply: oneshot::Sender<Result<Output, IamError>>,
}

/// Applies `cmds` in order and persists their writes in one transaction (used by the commit
/// thread for each batch, and at open for the bootstrap).
pub fn apply_and_persist(
    db: &Database,
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
    match set.persist(db) {
        Ok(()) => Ok(results),
        Err(e) => {
            tracing::error!(error = %e, "iam commit failed; reloading state from the store");
            match load(db) {
                Ok(st) => *shared.write() = st,
                Err(reload) => {
                    tracing::error!(error = %reload, "iam reload failed; refusing further commands");
                    shared.failed.store(true, Ordering::SeqCst);
                }
            }
            Err(e)
        }
    }
}

/// The group-commit loop: drains up to `batch_max` pending commands, applies and persists
/// them together, then answers each. Returns when every sender is gone.
pub fn run_committer(db: Database, shared: Arc<Shared>, rx: mpsc::Receiver<Pending>, batch_max: usize) {
    let batch_max = batch_max.max(1);
    while let Ok(first) = rx.recv() {
        let mut batch = Vec::with_capacity(64);
        batch.push(first);
        while batch.len() < batch_max {
            match rx.try_recv() {
                Ok(p) => batch.push(p),
                Err(_) => break,
            }
        }
        if shared.failed.load(Ordering::SeqCst) {
            for p in batch {
                let _ = p.reply.send(Err(IamError::StoreFailed));
            }
            continue;
        }
        let (cmds, replies): (Vec<Command>, Vec<_>) = batch.into_iter().map(|p| (p.cmd, p.reply)).unzip();
        match apply_and_persist(&db, &shared, cmds.into_iter()) {
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
    }
    tracing::debug!("iam commit thread stopping");
    drop(db);
}
