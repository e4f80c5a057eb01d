//! The Raft log and vote in the member's redb file (tables `raft_log`: index → entry, and
//! `raft_meta`: vote, last purged log id, and the state machine's own keys). Every change is a
//! durable redb commit before openraft is told it is done.

use std::fmt::Debug;
use std::io;
use std::ops::{Bound, RangeBounds};
use std::sync::{Arc, OnceLock};

use openraft::entry::RaftEntry;
use openraft::storage::{IOFlushed, RaftLogStorage};
use openraft::type_config::alias::{EntryOf, LogIdOf, VoteOf};
use openraft::{LogState, OptionalSend, RaftLogReader};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::types::C;

pub(crate) const LOG: TableDefinition<u64, &[u8]> = TableDefinition::new("raft_log");
pub(crate) const META: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_meta");

const VOTE: &str = "vote";
const PURGED: &str = "purged";
const DATA_DIR_ID: &str = "data_dir_id";

pub(crate) fn io<E: std::fmt::Display>(what: &'static str) -> impl FnOnce(E) -> io::Error {
    move |e| io::Error::other(format!("iam raft store: {what}: {e}"))
}

pub(crate) fn read_meta<T: DeserializeOwned>(db: &Database, key: &str) -> Result<Option<T>, io::Error> {
    let rtx = db.begin_read().map_err(io("begin read"))?;
    let t = rtx.open_table(META).map_err(io("open raft_meta"))?;
    match t.get(key).map_err(io("read raft_meta"))? {
        None => Ok(None),
        Some(v) => serde_json::from_slice(v.value()).map(Some).map_err(io("decode raft_meta")),
    }
}

pub(crate) fn put_meta<T: Serialize>(tx: &redb::WriteTransaction, key: &str, value: &T) -> Result<(), io::Error> {
    let bytes = serde_json::to_vec(value).map_err(io("encode raft_meta"))?;
    let mut t = tx.open_table(META).map_err(io("open raft_meta"))?;
    t.insert(key, bytes.as_slice()).map_err(io("write raft_meta"))?;
    Ok(())
}

/// The member's redb database, which its log and its state machine share, and the first write
/// that failed on it. After a failed write redb refuses every other one ("previous I/O error");
/// whichever write openraft hears of first, the member must be reported stopped on the first
/// failure (a full disk is the one it waits out by itself, see `keep_running`).
pub struct RaftDb {
    db: Database,
    first_failure: OnceLock<String>,
}

impl RaftDb {
    pub fn new(db: Database) -> RaftDb {
        RaftDb { db, first_failure: OnceLock::new() }
    }

    /// The error to report for a failed write: the first failure is kept, and redb's refusal
    /// after it is reported with it.
    fn failed(&self, e: io::Error) -> io::Error {
        let text = e.to_string();
        if text.contains(&redb::Error::PreviousIo.to_string()) {
            return match self.first_failure.get() {
                Some(first) => io::Error::other(format!("{text}; the write that failed first: {first}")),
                None => e,
            };
        }
        let _ = self.first_failure.set(text);
        e
    }
}

impl std::fmt::Debug for RaftDb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftDb").field("first_failure", &self.first_failure.get()).finish_non_exhaustive()
    }
}

impl std::ops::Deref for RaftDb {
    type Target = Database;

    fn deref(&self) -> &Database {
        &self.db
    }
}

/// Runs a write transaction off the async threads and commits it durably; answers what `f`
/// did.
pub(crate) async fn write<F, R>(db: &Arc<RaftDb>, f: F) -> Result<R, io::Error>
where
    F: FnOnce(&redb::WriteTransaction) -> Result<R, io::Error> + Send + 'static,
    R: Send + 'static,
{
    let db = db.clone();
    tokio::task::spawn_blocking(move || {
        let tx = db.begin_write().map_err(io("begin write")).map_err(|e| db.failed(e))?;
        let r = f(&tx).map_err(|e| db.failed(e))?;
        tx.commit().map_err(io("commit")).map_err(|e| db.failed(e))?;
        Ok(r)
    })
    .await
    .map_err(io("join"))?
}

/// This data directory's id (hex of 16 random bytes), made at its first open as a member's:
/// a wiped or replaced directory gets a new one, which its cluster has not recorded.
pub(crate) fn data_dir_id(db: &Database) -> Result<String, io::Error> {
    if let Some(id) = read_meta::<String>(db, DATA_DIR_ID)? {
        return Ok(id);
    }
    let id = crate::token::to_hex(&rand::random::<[u8; 16]>());
    let tx = db.begin_write().map_err(io("begin write"))?;
    put_meta(&tx, DATA_DIR_ID, &id)?;
    tx.commit().map_err(io("commit"))?;
    Ok(id)
}

/// Creates the Raft tables (once).
pub(crate) fn create_tables(db: &Database) -> Result<(), io::Error> {
    let tx = db.begin_write().map_err(io("begin write"))?;
    tx.open_table(LOG).map_err(io("create raft_log"))?;
    tx.open_table(META).map_err(io("create raft_meta"))?;
    tx.commit().map_err(io("commit"))
}

/// The log: a handle on the member's database (its own reader too).
#[derive(Clone)]
pub struct LogStore {
    db: Arc<RaftDb>,
}

impl LogStore {
    pub fn new(db: Arc<RaftDb>) -> LogStore {
        LogStore { db }
    }

    /// Whether this member has ever held a log or a vote (so: it belongs to a cluster).
    pub fn is_blank(&self) -> Result<bool, io::Error> {
        let vote: Option<VoteOf<C>> = read_meta(&self.db, VOTE)?;
        let rtx = self.db.begin_read().map_err(io("begin read"))?;
        let t = rtx.open_table(LOG).map_err(io("open raft_log"))?;
        Ok(vote.is_none() && t.first().map_err(io("read raft_log"))?.is_none())
    }
}

fn decode(v: &[u8]) -> Result<EntryOf<C>, io::Error> {
    serde_json::from_slice(v).map_err(io("decode log entry"))
}

impl RaftLogReader<C> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<EntryOf<C>>, io::Error> {
        let rtx = self.db.begin_read().map_err(io("begin read"))?;
        let t = rtx.open_table(LOG).map_err(io("open raft_log"))?;
        let start = match range.start_bound() {
            Bound::Included(i) => Bound::Included(*i),
            Bound::Excluded(i) => Bound::Excluded(*i),
            Bound::Unbounded => Bound::Unbounded,
        };
        let end = match range.end_bound() {
            Bound::Included(i) => Bound::Included(*i),
            Bound::Excluded(i) => Bound::Excluded(*i),
            Bound::Unbounded => Bound::Unbounded,
        };
        let mut out = Vec::new();
        for item in t.range::<u64>((start, end)).map_err(io("read raft_log"))? {
            let (_, v) = item.map_err(io("read raft_log"))?;
            out.push(decode(v.value())?);
        }
        Ok(out)
    }

    async fn read_vote(&mut self) -> Result<Option<VoteOf<C>>, io::Error> {
        read_meta(&self.db, VOTE)
    }
}

impl RaftLogStorage<C> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<C>, io::Error> {
        let purged: Option<LogIdOf<C>> = read_meta(&self.db, PURGED)?;
        let rtx = self.db.begin_read().map_err(io("begin read"))?;
        let t = rtx.open_table(LOG).map_err(io("open raft_log"))?;
        let last = match t.last().map_err(io("read raft_log"))? {
            Some((_, v)) => Some(decode(v.value())?.log_id()),
            None => purged,
        };
        Ok(LogState { last_purged_log_id: purged, last_log_id: last })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &VoteOf<C>) -> Result<(), io::Error> {
        let vote = *vote;
        write(&self.db, move |tx| put_meta(tx, VOTE, &vote)).await
    }

    async fn append<I>(&mut self, entries: I, callback: IOFlushed<C>) -> Result<(), io::Error>
    where
        I: IntoIterator<Item = EntryOf<C>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let encoded: Vec<(u64, Vec<u8>)> = entries
            .into_iter()
            .map(|e| Ok((e.index(), serde_json::to_vec(&e).map_err(io("encode log entry"))?)))
            .collect::<Result<_, io::Error>>()?;
        let r = write(&self.db, move |tx| {
            let mut t = tx.open_table(LOG).map_err(io("open raft_log"))?;
            for (i, v) in &encoded {
                t.insert(*i, v.as_slice()).map_err(io("write raft_log"))?;
            }
            Ok(())
        })
        .await;
        match r {
            Ok(()) => {
                callback.io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.io_completed(Err(io::Error::other(e.to_string())));
                Err(e)
            }
        }
    }

    async fn truncate_after(&mut self, last_log_id: Option<LogIdOf<C>>) -> Result<(), io::Error> {
        let from = last_log_id.map(|l| l.index() + 1).unwrap_or(0);
        write(&self.db, move |tx| {
            let mut t = tx.open_table(LOG).map_err(io("open raft_log"))?;
            t.retain_in(from.., |_, _| false).map_err(io("truncate raft_log"))?;
            Ok(())
        })
        .await
    }

    async fn purge(&mut self, log_id: LogIdOf<C>) -> Result<(), io::Error> {
        write(&self.db, move |tx| {
            {
                let mut t = tx.open_table(LOG).map_err(io("open raft_log"))?;
                t.retain_in(..=log_id.index(), |_, _| false).map_err(io("purge raft_log"))?;
            }
            put_meta(tx, PURGED, &log_id)
        })
        .await
    }
}

impl std::fmt::Debug for LogStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LogStore").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn db() -> (tempfile::TempDir, RaftDb) {
        let dir = tempfile::tempdir().expect("tempdir");
        let db = Database::create(dir.path().join("raft.redb")).expect("create");
        (dir, RaftDb::new(db))
    }

    fn store_error(what: &'static str, e: redb::Error) -> io::Error {
        io(what)(e)
    }

    #[test]
    fn a_refusal_after_a_failed_write_is_reported_with_the_first_failure() {
        let (_dir, db) = db();
        let full = db.failed(store_error("commit", redb::Error::Io(io::Error::from_raw_os_error(28))));
        assert!(full.to_string().contains("(os error 28)"), "{full}");
        let echo = db.failed(store_error("begin write", redb::Error::PreviousIo)).to_string();
        assert!(echo.starts_with("iam raft store: begin write: "), "{echo}");
        assert!(echo.contains("; the write that failed first: iam raft store: commit: "), "{echo}");
        assert!(echo.contains("(os error 28)"), "{echo}");
        // The first failure stays the one reported.
        let _ = db.failed(store_error("commit", redb::Error::Io(io::Error::from_raw_os_error(5))));
        let echo = db.failed(store_error("write raft_log", redb::Error::PreviousIo)).to_string();
        assert!(echo.contains("(os error 28)") && !echo.contains("(os error 5)"), "{echo}");
    }

    #[test]
    fn a_refusal_with_no_failure_recorded_is_reported_as_it_is() {
        let (_dir, db) = db();
        let e = db.failed(store_error("commit", redb::Error::PreviousIo)).to_string();
        assert_eq!(e, format!("iam raft store: commit: {}", redb::Error::PreviousIo));
    }
}
