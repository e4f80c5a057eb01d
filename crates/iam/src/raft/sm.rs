//! The state machine: committed commands applied to IAM's state by [`crate::state::apply`]
//! (the standalone path's function), their rows written with the last applied log id and the
//! membership in one redb transaction. A snapshot is the state's rows as the store keeps them.

use std::io;
use std::sync::{Arc, Mutex};

use futures::{Stream, TryStreamExt};
use openraft::storage::{EntryResponder, RaftStateMachine};
use openraft::type_config::alias::{LogIdOf, SnapshotMetaOf, SnapshotOf, StoredMembershipOf};
use openraft::{EntryPayload, OptionalSend, RaftSnapshotBuilder};
use redb::{ReadableDatabase, TableDefinition};
use serde::{Deserialize, Serialize};

use super::log::{RaftDb, io, put_meta, read_meta, write};
use super::types::{Applied, C};
use crate::command::{Row, Table, Write};
use crate::state::{State, apply};
use crate::store::{Shared, WriteSet, decode_row, def, encode_row};

const APPLIED: &str = "sm_applied";
const MEMBERSHIP: &str = "sm_membership";
/// The last snapshot built or installed: its meta and its data.
const SNAPSHOT: TableDefinition<&str, &[u8]> = TableDefinition::new("raft_snapshot");

#[derive(Clone, Debug, Default)]
struct SmMeta {
    applied: Option<LogIdOf<C>>,
    membership: StoredMembershipOf<C>,
}

/// A snapshot's data: every row, as (table, key, stored JSON).
#[derive(Serialize, Deserialize)]
struct Rows {
    v: u32,
    rows: Vec<(String, String, String)>,
}

#[derive(Clone)]
pub struct StateMachine {
    db: Arc<RaftDb>,
    shared: Arc<Shared>,
    meta: Arc<Mutex<SmMeta>>,
}

impl StateMachine {
    pub fn open(db: Arc<RaftDb>, shared: Arc<Shared>) -> Result<StateMachine, io::Error> {
        let tx = db.begin_write().map_err(io("begin write"))?;
        tx.open_table(SNAPSHOT).map_err(io("create raft_snapshot"))?;
        tx.commit().map_err(io("commit"))?;
        let meta = SmMeta {
            applied: read_meta(&db, APPLIED)?.flatten(),
            membership: read_meta(&db, MEMBERSHIP)?.unwrap_or_default(),
        };
        Ok(StateMachine { db, shared, meta: Arc::new(Mutex::new(meta)) })
    }

    fn meta(&self) -> std::sync::MutexGuard<'_, SmMeta> {
        self.meta.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn encode_rows(rows: &[Row]) -> Result<Vec<(String, String, String)>, io::Error> {
    rows.iter().map(|r| Ok((r.table().name().to_string(), r.key(), encode_row(r).map_err(io("encode row"))?))).collect()
}

pub struct Builder {
    sm: StateMachine,
}

impl RaftSnapshotBuilder<C> for Builder {
    type SnapshotData = Vec<u8>;

    async fn build_snapshot(&mut self) -> Result<SnapshotOf<C, Vec<u8>>, io::Error> {
        // The rows and the log id they reflect, taken together under the state's lock.
        let (rows, meta) = {
            let st = self.sm.shared.read();
            let m = self.sm.meta().clone();
            (st.rows(), m)
        };
        let data = serde_json::to_vec(&Rows { v: 1, rows: encode_rows(&rows)? }).map_err(io("encode snapshot"))?;
        let meta = SnapshotMetaOf::<C> { last_log_id: meta.applied, last_membership: meta.membership };
        let m = serde_json::to_vec(&meta).map_err(io("encode snapshot meta"))?;
        // Stored, then handed back (one copy of the data, not two).
        let data = write(&self.sm.db, move |tx| {
            let mut t = tx.open_table(SNAPSHOT).map_err(io("open raft_snapshot"))?;
            t.insert("meta", m.as_slice()).map_err(io("write snapshot"))?;
            t.insert("data", data.as_slice()).map_err(io("write snapshot"))?;
            drop(t);
            Ok(data)
        })
        .await?;
        tracing::info!(last = ?meta.last_log_id, bytes = data.len(), "iam snapshot built");
        Ok(SnapshotOf::<C, Vec<u8>> { meta, snapshot: data })
    }
}

impl RaftStateMachine<C> for StateMachine {
    type SnapshotData = Vec<u8>;
    type SnapshotBuilder = Builder;

    async fn applied_state(&mut self) -> Result<(Option<LogIdOf<C>>, StoredMembershipOf<C>), io::Error> {
        let m = self.meta().clone();
        Ok((m.applied, m.membership))
    }

    async fn apply<Strm>(&mut self, mut entries: Strm) -> Result<(), io::Error>
    where
        Strm: Stream<Item = Result<EntryResponder<C>, io::Error>> + Unpin + OptionalSend,
    {
        let mut items = Vec::new();
        while let Some(item) = entries.try_next().await? {
            items.push(item);
        }
        if items.is_empty() {
            return Ok(());
        }
        let mut set = WriteSet::default();
        let mut answers = Vec::with_capacity(items.len());
        let meta = {
            let mut st = self.shared.write();
            let mut m = self.meta();
            for (entry, responder) in items {
                m.applied = Some(entry.log_id);
                let answer = match entry.payload {
                    EntryPayload::Normal(cmd) => {
                        let (r, w) = apply(&mut st, &cmd);
                        st.meta.applied_index += 1;
                        set.extend(w);
                        Applied(Some(r))
                    }
                    EntryPayload::Membership(ms) => {
                        m.membership = StoredMembershipOf::<C>::new(Some(entry.log_id), ms);
                        Applied(None)
                    }
                    EntryPayload::Blank => Applied(None),
                };
                answers.push((responder, answer));
            }
            set.extend(vec![Write::Put(Row::Meta(st.meta.clone()))]);
            m.clone()
        };
        write(&self.db, move |tx| {
            set.write_into(tx).map_err(io("write state"))?;
            put_meta(tx, APPLIED, &meta.applied)?;
            put_meta(tx, MEMBERSHIP, &meta.membership)
        })
        .await?;
        for (responder, answer) in answers {
            if let Some(r) = responder {
                r.send(answer);
            }
        }
        Ok(())
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        Builder { sm: self.clone() }
    }

    async fn install_snapshot(&mut self, meta: &SnapshotMetaOf<C>, data: Vec<u8>) -> Result<(), io::Error> {
        let snap: Rows = serde_json::from_slice(&data).map_err(io("decode snapshot"))?;
        if snap.v != 1 {
            return Err(io::Error::other(format!("iam snapshot version {} is not 1", snap.v)));
        }
        let mut rows = Vec::with_capacity(snap.rows.len());
        for (t, k, v) in &snap.rows {
            let table =
                Table::named(t).ok_or_else(|| io::Error::other(format!("iam snapshot: unknown table {t:?}")))?;
            rows.push(decode_row(table, k, v).map_err(io("decode snapshot row"))?);
        }
        let state = State::from_rows(rows);
        let (m, sm_meta) = (serde_json::to_vec(meta).map_err(io("encode snapshot meta"))?, meta.clone());
        write(&self.db, move |tx| {
            for t in Table::ALL {
                tx.delete_table(def(t)).map_err(io("clear table"))?;
                let mut table = tx.open_table(def(t)).map_err(io("open table"))?;
                for (name, k, v) in &snap.rows {
                    if name == t.name() {
                        table.insert(k.as_str(), v.as_str()).map_err(io("write table"))?;
                    }
                }
            }
            put_meta(tx, APPLIED, &sm_meta.last_log_id)?;
            put_meta(tx, MEMBERSHIP, &sm_meta.last_membership)?;
            let mut t = tx.open_table(SNAPSHOT).map_err(io("open raft_snapshot"))?;
            t.insert("meta", m.as_slice()).map_err(io("write snapshot"))?;
            t.insert("data", data.as_slice()).map_err(io("write snapshot"))?;
            Ok(())
        })
        .await?;
        // Both under the state's lock, as the snapshot builder reads them.
        let mut st = self.shared.write();
        *st = state;
        *self.meta() = SmMeta { applied: meta.last_log_id, membership: meta.last_membership.clone() };
        drop(st);
        tracing::info!(last = ?meta.last_log_id, "iam snapshot installed");
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<SnapshotOf<C, Vec<u8>>>, io::Error> {
        let rtx = self.db.begin_read().map_err(io("begin read"))?;
        let t = rtx.open_table(SNAPSHOT).map_err(io("open raft_snapshot"))?;
        let (Some(m), Some(d)) = (t.get("meta").map_err(io("read"))?, t.get("data").map_err(io("read"))?) else {
            return Ok(None);
        };
        let meta: SnapshotMetaOf<C> = serde_json::from_slice(m.value()).map_err(io("decode snapshot meta"))?;
        Ok(Some(SnapshotOf::<C, Vec<u8>> { meta, snapshot: d.value().to_vec() }))
    }
}

impl std::fmt::Debug for StateMachine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StateMachine").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Builder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Builder").finish_non_exhaustive()
    }
}
