//! Replicated IAM: the same [`Command`]s, applied by the same state machine
//! ([`crate::state::apply`]), committed through a Raft log (openraft) that the members share,
//! in place of the standalone group-commit thread.
//!
//! - [`log`]: the log and the vote, in the member's redb file beside the state's tables;
//! - [`sm`]: the state machine: applies committed commands to the state in memory and writes
//!   their rows with the last applied log id in one transaction; snapshots are the state's
//!   rows;
//! - [`net`]: the Raft messages over gRPC (`IamRaft`, mTLS, members only), serde-encoded;
//! - [`forward`]: every `Iam` and `Admin` call runs on the leader: a follower hands it on
//!   unchanged (the caller's identity in a header only members are believed about); the
//!   leader serves it after a lease read (it is still the leader, and has applied everything
//!   committed before the call arrived).
//!
//! Reads that decide (authentication, authorization, admission) are linearizable by that
//! lease: a leader serves them while a quorum acknowledged it within the election timeout,
//! which holds while the members' clocks run at the same rate (their offsets do not matter).

pub mod forward;
pub mod log;
pub mod net;
pub mod sm;
pub mod types;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use openraft::async_runtime::WatchReceiver;
use openraft::errors::{ClientWriteError, RaftError};
use openraft::{BasicNode, ChangeMembers, ReadPolicy};

use crate::command::{Command, Output};
use crate::error::IamError;

pub use types::{Applied, C, TypeConfig};
pub type RaftNode = openraft::Raft<C, sm::StateMachine>;

/// One member as `IamMembers` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    pub id: u64,
    pub address: String,
    pub voter: bool,
    pub leader: bool,
    pub matched_index: u64,
    /// The data directory id the cluster recorded for this member (empty: none yet).
    pub data_dir: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Members {
    pub members: Vec<Member>,
    pub term: u64,
    pub committed_index: u64,
}

/// The largest command one log entry holds (a quarter of a gRPC message).
pub const MAX_ENTRY_BYTES: usize = opendsec_common::grpc::MAX_MESSAGE_BYTES / 4;
/// How long a new member may take to catch up before it is promoted (below the apiserver's
/// 10 s per call to IAM).
const CATCH_UP: Duration = Duration::from_secs(6);

/// How long a membership change waits for its outcome.
const WAIT: Duration = Duration::from_secs(6);
/// How long a call waits for a leader being elected (or for its lease) before `not_leader`.
pub const READ_WAIT: Duration = Duration::from_secs(3);

/// This member's running Raft. A failed write of the log, the vote or the state (a full disk,
/// an I/O error) stops openraft for good; the member then reopens its store and starts a new
/// one in its place (`crate::keep_running`), so every holder asks here for the current one.
#[derive(Clone)]
pub struct Current(Arc<std::sync::RwLock<Running>>);

struct Running {
    node: RaftNode,
    /// When `node` started: a member grants no vote for one leader lease after that.
    started: tokio::time::Instant,
    /// Set by a deliberate shutdown: nothing starts again after it.
    closed: bool,
    /// How many times this member's Raft stopped on a storage failure and started again.
    restarts: u64,
    /// The last Raft message this member refused for its claims.
    refused: Option<String>,
    /// Who was refused for what, and when that was last logged.
    logged: Option<(u64, tonic::Code, tokio::time::Instant)>,
}

impl Current {
    pub fn new(node: RaftNode) -> Current {
        let started = tokio::time::Instant::now();
        Current(Arc::new(std::sync::RwLock::new(Running {
            node,
            started,
            closed: false,
            restarts: 0,
            refused: None,
            logged: None,
        })))
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Running> {
        self.0.read().unwrap_or_else(|p| p.into_inner())
    }

    fn write(&self) -> std::sync::RwLockWriteGuard<'_, Running> {
        self.0.write().unwrap_or_else(|p| p.into_inner())
    }

    /// The Raft running now (or the stopped one, until its replacement starts).
    pub fn get(&self) -> RaftNode {
        self.read().node.clone()
    }

    /// When the running Raft started.
    pub fn started(&self) -> tokio::time::Instant {
        self.read().started
    }

    /// How many times this member's Raft stopped on a storage failure and started again.
    pub fn restarts(&self) -> u64 {
        self.read().restarts
    }

    pub fn closed(&self) -> bool {
        self.read().closed
    }

    /// Puts `node` in place of the stopped Raft; hands it back when the member was shut down
    /// meanwhile (the caller stops it).
    pub(crate) fn replace(&self, node: RaftNode) -> Result<(), RaftNode> {
        let mut r = self.write();
        if r.closed {
            return Err(node);
        }
        let (refused, logged) = (r.refused.take(), r.logged.take());
        *r = Running {
            node,
            started: tokio::time::Instant::now(),
            closed: false,
            restarts: r.restarts + 1,
            refused,
            logged,
        };
        Ok(())
    }

    /// Notes a message refused from member `from`; answers whether to log it: once a minute
    /// per sender and kind of refusal.
    pub(crate) fn refuse(&self, from: u64, code: tonic::Code, why: &str) -> bool {
        let mut r = self.write();
        let now = tokio::time::Instant::now();
        r.refused = Some(why.to_string());
        let log = match r.logged {
            Some((f, c, at)) => (f, c) != (from, code) || now.duration_since(at) >= Duration::from_secs(60),
            None => true,
        };
        if log {
            r.logged = Some((from, code, now));
        }
        log
    }

    /// The last Raft message this member refused for what it claimed (another cluster, a
    /// wiped or replaced data directory on either side).
    pub fn refused(&self) -> Option<String> {
        self.read().refused.clone()
    }

    /// Marks the member shut down and answers the Raft to stop.
    fn close(&self) -> RaftNode {
        let mut r = self.write();
        r.closed = true;
        r.node.clone()
    }
}

/// This member's handle on the log.
#[derive(Clone)]
pub struct Replica {
    pub id: u64,
    pub raft: Current,
    /// What this member says and checks about itself in Raft messages.
    pub who: net::Who,
    /// The members' mTLS links (Raft messages, forwarded calls).
    pub links: Arc<opendsec_common::grpc::Links>,
    /// A leader's lease: the longest election timeout.
    pub lease: Duration,
}

impl std::fmt::Debug for Current {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Current").field("restarts", &self.restarts()).finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica").field("id", &self.id).finish_non_exhaustive()
    }
}

fn raft_err<E: std::fmt::Display>(e: E) -> IamError {
    IamError::Raft(e.to_string())
}

fn write_err(e: RaftError<C, ClientWriteError<C>>) -> IamError {
    match e {
        RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => {
            IamError::NotLeader(format!("this IAM member is not the leader ({:?})", f.reason))
        }
        // The leader changed while the command was in flight: it may or may not be committed.
        RaftError::APIError(ClientWriteError::LogEntryDiscarded(_)) => {
            IamError::Raft("the leader changed before the command was known to be committed".into())
        }
        RaftError::APIError(ClientWriteError::ChangeMembershipError(e)) => IamError::Membership(e.to_string()),
        e => raft_err(e),
    }
}

impl Replica {
    /// Commits `cmd` through the log; answers what applying it answered here.
    pub async fn execute(&self, cmd: Command) -> Result<Output, IamError> {
        // An entry must fit in one append message with room to spare, or the leader would
        // resend it forever and every later write would wait behind it.
        let size = serde_json::to_vec(&cmd).map(|v| v.len()).unwrap_or(usize::MAX);
        if size > MAX_ENTRY_BYTES {
            return Err(IamError::InvalidArgument(format!(
                "a {} command of {size} bytes is above the {MAX_ENTRY_BYTES} bytes one log entry of a replicated IAM \
                 holds",
                cmd.kind()
            )));
        }
        let mut cmd = cmd;
        let format = cmd.log_format();
        if format > 1
            && let Err(e) = self.refuse_while_a_member_is_behind(cmd.kind(), format)
        {
            // A claim's admit goes as a plain one (charged on its own, the member keeping its
            // charge until the edge releases it); a reconciliation leaves members' leases out
            // (an older member would adopt them: IAM may release them, and the edges charge
            // their members again once the upgrade is done); anything else waits for it.
            if matches!(e, IamError::NotLeader(_)) {
                return Err(e);
            }
            cmd = match cmd {
                Command::AdmitClaim {
                    actor,
                    now_ms,
                    lease_id,
                    project,
                    resources,
                    edge,
                    keep_existing,
                    egress,
                    ..
                } => Command::Admit { actor, now_ms, lease_id, project, resources, edge, keep_existing, egress },
                Command::FencedReconcile { now_ms, edge, mut live, min_age_ms, holder, read_at_ms } if format > 2 => {
                    live.retain(|l| l.pool.is_empty());
                    let cmd = Command::FencedReconcile { now_ms, edge, live, min_age_ms, holder, read_at_ms };
                    self.refuse_while_a_member_is_behind(cmd.kind(), cmd.log_format())?;
                    cmd
                }
                _ => return Err(e),
            };
        }
        let r = self.raft.get().client_write(cmd).await.map_err(write_err)?;
        r.data.0.ok_or(IamError::Invariant("an applied command left no answer"))?
    }

    /// Refuses (`InvalidState`) an entry of log format `format` unless this member leads and
    /// no other member, learners too, last answered as a release that does not read it
    /// ([`net::LOG_FORMAT`]). A member not heard from since this start (down, or about to
    /// answer) does not hold it back: should it run an older release, it cannot decode the
    /// entry and stops short of it until upgraded. A member that does not lead says so, as
    /// Raft would.
    fn refuse_while_a_member_is_behind(&self, kind: &str, format: u32) -> Result<(), IamError> {
        let m = self.raft.get().metrics().borrow_watched().clone();
        if m.state != openraft::ServerState::Leader {
            return Err(IamError::NotLeader(format!("IAM member {} is not the leader", self.id)));
        }
        let behind: Vec<u64> = m
            .membership_config
            .membership()
            .nodes()
            .map(|(id, _)| *id)
            .filter(|id| *id != self.id && self.who.format_of(*id).is_some_and(|f| f < format))
            .collect();
        if behind.is_empty() {
            return Ok(());
        }
        Err(IamError::InvalidState(format!(
            "IAM members {behind:?} run a release that does not read {kind} entries (log format {format}): refused \
             until they are upgraded"
        )))
    }

    /// Whether this member may serve a read now: it is the leader, its lease holds and it has
    /// applied everything committed so far.
    /// A member that was just elected (its lease not yet acknowledged) or that knows no leader
    /// waits for that to settle, up to [`READ_WAIT`]; a member that knows another leader says so
    /// at once.
    pub async fn linearize(&self) -> Result<(), IamError> {
        let deadline = tokio::time::Instant::now() + READ_WAIT;
        loop {
            let why = match self.raft.get().ensure_linearizable(ReadPolicy::LeaseRead).await {
                Ok(_) => return Ok(()),
                Err(RaftError::APIError(openraft::errors::LinearizableReadError::ForwardToLeader(f))) => {
                    if f.leader_id.is_some_and(|l| l != self.id) {
                        return Err(IamError::NotLeader(format!(
                            "IAM member {} leads, not {}",
                            f.leader_id.unwrap_or(0),
                            self.id
                        )));
                    }
                    format!("IAM member {} has no leader with a quorum ({:?})", self.id, f.reason)
                }
                Err(RaftError::APIError(e)) => format!("IAM member {}: {e}", self.id),
                Err(e) => return Err(raft_err(e)),
            };
            if self.leader_elsewhere().is_some() {
                return Err(IamError::NotLeader(why));
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(IamError::NotLeader(why));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The leader's id and address when it is another member; `None` when this one leads or
    /// no leader is known.
    pub fn leader_elsewhere(&self) -> Option<(u64, String)> {
        let m = self.raft.get().metrics().borrow_watched().clone();
        let leader = m.current_leader?;
        if leader == self.id {
            return None;
        }
        m.membership_config.membership().get_node(&leader).map(|n| (leader, n.addr.clone()))
    }

    pub fn members(&self) -> Members {
        let m = self.raft.get().metrics().borrow_watched().clone();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<u64> = membership.voter_ids().collect();
        let matched: BTreeMap<u64, u64> = m
            .replication
            .as_ref()
            .map(|r| r.iter().map(|(id, l)| (*id, l.as_ref().map(|l| l.index()).unwrap_or(0))).collect())
            .unwrap_or_default();
        let members = membership
            .nodes()
            .map(|(id, node)| Member {
                id: *id,
                address: node.addr.clone(),
                voter: voters.contains(id),
                leader: m.current_leader == Some(*id),
                matched_index: matched.get(id).copied().unwrap_or(if *id == self.id {
                    m.last_log_index.unwrap_or(0)
                } else {
                    0
                }),
                data_dir: self.who.shared.read().meta.members.get(id).cloned().unwrap_or_default(),
            })
            .collect();
        Members {
            members,
            term: m.current_term,
            committed_index: m.cluster_committed.as_ref().map(|l| l.index()).unwrap_or(0),
        }
    }

    /// Adds member `id` at `address`: a learner that catches up (by snapshot if the log it
    /// needs is gone), then, unless `learner_only`, a voter.
    pub async fn add_member(&self, id: u64, address: &str, learner_only: bool) -> Result<Members, IamError> {
        if id == 0 {
            return Err(IamError::InvalidArgument("member ids start at 1".into()));
        }
        opendsec_common::grpc::channel(address).map_err(|e| IamError::InvalidArgument(e.message))?;
        let known = self.members();
        // An id a data directory was recorded under, and no longer a member: the cluster would
        // refuse any other directory under it.
        if !known.members.iter().any(|m| m.id == id) && self.who.shared.read().meta.members.contains_key(&id) {
            return Err(IamError::MemberIdUsed(id));
        }
        if let Some(m) = known.members.iter().find(|m| m.id == id)
            && m.address != address
        {
            return Err(IamError::AlreadyExists { kind: "iam member", name: format!("{id} (at {})", m.address) });
        }
        if let Some(m) = known.members.iter().find(|m| m.id != id && m.address == address) {
            return Err(IamError::AlreadyExists {
                kind: "iam member at",
                name: format!("{address} (member {})", m.id),
            });
        }
        if !known.members.iter().any(|m| m.id == id) {
            self.raft.get().add_learner(id, BasicNode::new(address), false).await.map_err(write_err)?;
        }
        // Promoted only once it holds the log up to where it was when it was added.
        let target = self.raft.get().metrics().borrow_watched().last_log_index.unwrap_or(0);
        let caught_up = self
            .raft
            .get()
            .wait(Some(CATCH_UP))
            .metrics(
                |m| {
                    m.replication.as_ref().and_then(|r| r.get(&id)).and_then(|l| l.as_ref()).map(|l| l.index())
                        >= Some(target)
                },
                "the new member caught up",
            )
            .await;
        if caught_up.is_err() {
            return Err(IamError::Membership(format!(
                "member {id} was added as a learner and is still catching up (the log to index {target}); run the \
                 same add again to promote it"
            )));
        }
        if !learner_only {
            let voters = ChangeMembers::AddVoterIds(BTreeSet::from([id]));
            self.raft.get().change_membership(voters, false).await.map_err(write_err)?;
        }
        Ok(self.members())
    }

    /// Removes member `id` (a voter or a learner).
    pub async fn remove_member(&self, id: u64) -> Result<Members, IamError> {
        let known = self.members();
        let Some(m) = known.members.iter().find(|m| m.id == id) else {
            return Err(IamError::NotFound { kind: "iam member", name: id.to_string() });
        };
        if m.voter {
            if known.members.iter().filter(|m| m.voter).count() == 1 {
                return Err(IamError::Membership("the last voter cannot be removed".into()));
            }
            let change = ChangeMembers::RemoveVoters(BTreeSet::from([id]));
            self.raft.get().change_membership(change, false).await.map_err(write_err)?;
        } else {
            let change = ChangeMembers::RemoveNodes(BTreeSet::from([id]));
            self.raft.get().change_membership(change, false).await.map_err(write_err)?;
        }
        Ok(self.members())
    }

    /// Hands the leadership to voter `to` and waits until it has taken it.
    pub async fn transfer_leader(&self, to: u64) -> Result<Members, IamError> {
        let known = self.members();
        if !known.members.iter().any(|m| m.id == to && m.voter) {
            return Err(IamError::NotFound { kind: "iam voter", name: to.to_string() });
        }
        if self.raft.get().metrics().borrow_watched().current_leader != Some(to) {
            self.raft.get().trigger().transfer_leader(to).await.map_err(raft_err)?;
            self.raft
                .get()
                .wait(Some(WAIT))
                .metrics(|m| m.current_leader == Some(to), "the new leader")
                .await
                .map_err(raft_err)?;
        }
        Ok(self.members())
    }

    /// The last log index this member holds (None: none).
    pub fn last_log_index(&self) -> Option<u64> {
        self.raft.get().metrics().borrow_watched().last_log_index
    }

    /// The storage failure that stopped this member's Raft, while it waits to start again.
    pub fn stopped_on(&self) -> Option<String> {
        match &self.raft.get().metrics().borrow_watched().running_state {
            Err(openraft::errors::Fatal::Stopped) | Ok(()) => None,
            Err(e) => Some(e.to_string()),
        }
    }

    pub async fn shutdown(&self) {
        if let Err(e) = self.raft.close().shutdown().await {
            tracing::warn!(error = %e, "iam raft shutdown");
        }
    }
}

/// openraft's configuration from ours.
pub fn raft_config(cfg: &opendsec_common::config::IamRaftConfig) -> Result<Arc<openraft::Config>, IamError> {
    let ms = |d: Duration| u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
    let election = ms(cfg.election_timeout);
    let c = openraft::Config {
        cluster_name: "opendsec-iam".into(),
        heartbeat_interval: ms(cfg.heartbeat_interval),
        election_timeout_min: election,
        election_timeout_max: election + election / 2,
        install_snapshot_timeout: 30_000,
        snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(cfg.snapshot_every),
        // A batch of appends stays well inside one gRPC message (entries are at most a quarter
        // of one, most are far smaller).
        max_payload_entries: 64,
        // The log kept behind a snapshot: one interval, at most 1,000 entries. A member
        // further behind installs the snapshot.
        max_in_snapshot_log_to_keep: cfg.snapshot_every.min(1000),
        // Purged once this many entries can go (openraft's minimum batch).
        purge_batch_size: cfg.snapshot_every.min(256),
        enable_pre_vote: Some(true),
        ..Default::default()
    };
    Ok(Arc::new(c.validate().map_err(|e| IamError::InvalidArgument(format!("iam.raft: {e}")))?))
}
