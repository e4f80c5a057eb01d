//! IAM: projects (nested, with inherited quotas), principals, tokens, grants, quota leases and
//! named locks, served as the internal `Iam` service and the `Admin` service.
//!
//! Shape:
//! - [`state`]: the deterministic state machine (`apply`), the only code that changes state;
//! - [`command`]: the commands it applies and the writes it produces;
//! - [`query`]: the read side (authentication, authorization, listings);
//! - [`store`]: redb tables and the group-commit thread (standalone mode);
//! - [`service`]: the gRPC translation, nothing more;
//! - this module: [`Iam`], the proposer, which reads the clock and makes ids, secrets and
//!   hashes, puts them in a command, and hands it to the commit thread.
//!
//! - [`raft`]: the replicated mode, which commits the same commands through a Raft log shared
//!   by the members and applies them with the same `apply`.
#![forbid(unsafe_code)]

pub mod backup;
pub mod command;
pub mod error;
pub mod model;
pub mod query;
pub mod raft;
pub mod service;
pub mod state;
pub mod store;
pub mod token;
pub mod wal;

#[cfg(test)]
mod tests;

use std::future::Future;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, RwLock, mpsc};
use std::thread::JoinHandle;
use std::time::Duration;

use opendsec_common::config::{self, Config};
use opendsec_common::grpc;
use opendsec_common::ids;
use opendsec_common::time::now_ms;

pub use command::{Actor, Admission, Command, LiveLease, Output};
pub use error::{IamError, to_api};
pub use model::ProjectView;
pub use model::{GrantRecord, LeaseRecord, PrincipalRecord, Quota, Resources, TokenRecord, Usage};
pub use query::Authenticated;
pub use service::{AdminGrpc, AdminService, IamGrpc, IamService};
pub use state::State;

use backup::Snapshot;
use store::{Committer, Shared, Wake};

/// Most lease ids one GetLeases call may ask for (the answer stays far below the message
/// limit, and the read lock is held briefly).
pub const MAX_GET_LEASES: usize = 50_000;
/// Admissions in one AdmitMany call.
pub const MAX_ADMIT_MANY: usize = 1000;

/// Longest token lifetime a caller may ask for: ten years.
pub const MAX_TOKEN_TTL_S: u64 = 10 * 365 * 24 * 3600;

#[derive(Clone, Debug)]
pub struct IamOptions {
    pub data_dir: PathBuf,
    pub admin_principal: String,
    /// `dsk.<id>.<secret>`; used on the first start only.
    pub admin_token: String,
    /// Reconciliation never releases a lease bound more recently than this.
    pub reconcile_min_age: Duration,
    /// Most commands in one store transaction.
    pub commit_batch_max: usize,
}

impl IamOptions {
    pub fn from_config(cfg: &Config) -> IamOptions {
        IamOptions {
            data_dir: cfg.iam_data_dir(),
            admin_principal: cfg.iam.admin_principal.clone(),
            admin_token: cfg.iam.admin_token.clone(),
            reconcile_min_age: cfg.iam.reconcile_min_age,
            commit_batch_max: cfg.iam.commit_batch_max,
        }
    }
}

/// A handle on the running IAM (cheap to clone). The store closes when the last handle goes.
#[derive(Clone)]
pub struct Iam {
    inner: Arc<Inner>,
}
impl std::fmt::Debug for Iam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Iam").finish_non_exhaustive()
    }
}

struct Inner {
    shared: Arc<Shared>,
    /// Standalone: the group commit, the commit thread and the way to it.
    committer: Option<Arc<Committer>>,
    tx: Option<mpsc::Sender<Wake>>,
    thread: Option<JoinHandle<()>>,
    /// Replicated: this member's handle on the log.
    replica: Option<raft::Replica>,
    opts: IamOptions,
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Closing the channel ends the commit thread once it has answered what is queued;
        // once it is joined, the committer (and with it the database) closes with this, so
        // the same data dir can be opened again.
        self.tx.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn bootstrap_command(opts: &IamOptions) -> Result<Command, IamError> {
    if opts.admin_token.is_empty() {
        return Err(IamError::AdminToken("is empty; the first start needs iam.admin_token (dsk.<id>.<secret>)"));
    }
    let lower = opts.admin_token.to_ascii_lowercase();
    if config::PLACEHOLDERS.iter().any(|p| lower.contains(p)) {
        return Err(IamError::AdminToken("still holds a placeholder; set a real secret"));
    }
    let (id, secret) = config::parse_token_shape(&opts.admin_token)
        .ok_or(IamError::AdminToken("must look like dsk.<id>.<secret> (id [a-z0-9]{1,32}, secret 16..128 chars)"))?;
    ids::validate_principal(&opts.admin_principal).map_err(IamError::invalid)?;
    let hash_key = token::new_hash_key();
    let key = token::from_hex(&hash_key).ok_or(IamError::Invariant("generated hash key is not hex"))?;
    Ok(Command::Bootstrap {
        cluster: token::to_hex(&rand::random::<[u8; 16]>()),
        now_ms: now_ms(),
        admin_token_hash: token::hash_secret_hex(&key, secret),
        hash_key,
        admin_principal: opts.admin_principal.clone(),
        admin_token_id: id.to_string(),
    })
}

/// Proposes the bootstrap once this member leads, until the state is bootstrapped (by this
/// proposal or another member's: the state machine applies only the first).
async fn bootstrap_when_leader(replica: raft::Replica, shared: Arc<Shared>, cmd: Command) {
    use openraft::async_runtime::WatchReceiver;
    loop {
        if shared.read().bootstrapped() {
            return;
        }
        // A Raft stopped by a storage failure is started again (`keep_running`): only a
        // shutdown ends this.
        if replica.raft.closed() {
            return;
        }
        let state = replica.raft.get().metrics().borrow_watched().state;
        if state == openraft::ServerState::Leader {
            match replica.execute(cmd.clone()).await {
                Ok(_) => {
                    tracing::info!(member = replica.id, "iam bootstrapped");
                    return;
                }
                Err(e) => tracing::debug!(error = %e, "iam bootstrap not committed yet"),
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What a member needs to start its Raft again.
struct Start {
    id: u64,
    data_dir: std::path::PathBuf,
    config: Arc<openraft::Config>,
    network: raft::net::Network,
    shared: Arc<Shared>,
}

/// The leader records each member's data directory id the first time it hears one (its own
/// included): from then on, the cluster refuses that member on any other directory. A
/// cluster bootstrapped before cluster ids gets one. Both only once every member has
/// answered with its data directory id, so runs a release that knows these commands.
async fn record_data_dirs(replica: raft::Replica, mut seen: tokio::sync::mpsc::Receiver<(u64, String)>) {
    use openraft::async_runtime::WatchReceiver;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        let (id, dir) = tokio::select! {
            s = seen.recv() => match s {
                Some(s) => s,
                None => return,
            },
            _ = tick.tick() => (replica.id, replica.who.data_dir.clone()),
        };
        if replica.raft.closed() {
            return;
        }
        let m = replica.raft.get().metrics().borrow_watched().clone();
        if m.state != openraft::ServerState::Leader {
            continue;
        }
        let answered = replica.who.answered();
        if m.membership_config.membership().nodes().any(|(n, _)| *n != replica.id && !answered.contains(n)) {
            continue;
        }
        let (bootstrapped, recorded, cluster) = {
            let st = replica.who.shared.read();
            (st.bootstrapped(), st.meta.members.contains_key(&id), st.meta.cluster.is_empty())
        };
        if !bootstrapped {
            continue;
        }
        if cluster
            && let Err(e) =
                replica.execute(Command::SetCluster { cluster: token::to_hex(&rand::random::<[u8; 16]>()) }).await
        {
            tracing::debug!(error = %e, "iam cluster id not set yet");
        }
        if !recorded && let Err(e) = replica.execute(Command::MemberSeen { id, data_dir: dir }).await {
            tracing::debug!(member = id, error = %e, "iam member's data directory not recorded yet");
        }
    }
}

impl Start {
    async fn node(&self, db: Arc<raft::log::RaftDb>, log: raft::log::LogStore) -> Result<raft::RaftNode, IamError> {
        let sm = raft::sm::StateMachine::open(db, self.shared.clone()).map_err(|e| IamError::Raft(e.to_string()))?;
        raft::RaftNode::new(self.id, self.config.clone(), self.network.clone(), log, sm)
            .await
            .map_err(|e| IamError::Raft(e.to_string()))
    }

    /// Reopens the store and starts a new Raft on it. The state in memory is reloaded from the
    /// store first: a failed write may have left memory ahead of what was committed.
    async fn reopen(&self) -> Result<raft::RaftNode, IamError> {
        let dir = self.data_dir.clone();
        let (db, state) = tokio::task::spawn_blocking(move || -> Result<_, IamError> {
            let db = Arc::new(raft::log::RaftDb::new(store::open_db(&dir)?));
            let state = store::load(&db)?;
            Ok((db, state))
        })
        .await
        .map_err(|e| IamError::Raft(e.to_string()))??;
        *self.shared.write() = state;
        let log = raft::log::LogStore::new(db.clone());
        self.node(db, log).await
    }
}

/// Whether `dir` takes a write: 1 MiB written and synced, then removed.
fn takes_writes(dir: &std::path::Path) -> std::io::Result<()> {
    use std::io::Write;
    let probe = dir.join(".space-probe");
    let r = (|| {
        let mut f = std::fs::File::create(&probe)?;
        f.write_all(&vec![0u8; 1 << 20])?;
        f.sync_all()
    })();
    let _ = std::fs::remove_file(&probe);
    r
}

/// Whether a fatal error is a full file system (or quota): the one failure this member waits
/// out by itself. The errors reach here as text (openraft's storage error wraps ours).
fn out_of_space(fatal: &openraft::errors::Fatal<raft::C>) -> bool {
    let text = fatal.to_string();
    text.contains("(os error 28)") || text.contains("(os error 122)")
}

/// Keeps this member's Raft running across a full disk. A failed write of the log, the vote
/// or the state stops openraft for good: the member then answers no Raft message and grants
/// no vote, and the others go on without it. When the write failed for want of space, it
/// waits until its data directory takes a write again (probing with backoff: 1 s, doubling to
/// a minute), reopens the store and starts a new Raft: the member rejoins as a follower and
/// catches up from the leader. Any other failure (an I/O error, a corrupt store, a panic)
/// leaves it out until the operator restarts it: after a failed sync, what the page cache
/// shows may not be on the disk.
async fn keep_running(replica: raft::Replica, start: Start) {
    use openraft::async_runtime::WatchReceiver;
    loop {
        let node = replica.raft.get();
        let mut metrics = node.metrics();
        let fatal = loop {
            if let Err(f) = &metrics.borrow_watched().running_state {
                break f.clone();
            }
            if metrics.changed().await.is_err() {
                return;
            }
        };
        if matches!(fatal, openraft::errors::Fatal::Stopped) || replica.raft.closed() {
            return;
        }
        if !out_of_space(&fatal) {
            tracing::error!(member = replica.id, error = %fatal,
                "iam member stopped: its store failed; it stays out of the cluster until it is restarted");
            return;
        }
        tracing::error!(member = replica.id, error = %fatal,
            "iam member stopped: its data directory is full; it rejoins once that takes writes again");
        drop(metrics);
        let _ = node.shutdown().await;
        drop(node);
        let mut wait = Duration::from_secs(1);
        loop {
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_secs(60));
            if replica.raft.closed() {
                return;
            }
            let dir = start.data_dir.clone();
            match tokio::task::spawn_blocking(move || takes_writes(&dir)).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => {
                    tracing::debug!(member = replica.id, error = %e, "iam data directory still takes no writes");
                    continue;
                }
                Err(_) => continue,
            }
            match start.reopen().await {
                Ok(node) => {
                    if let Err(node) = replica.raft.replace(node) {
                        let _ = node.shutdown().await;
                        return;
                    }
                    tracing::info!(member = replica.id, "iam member started again after a storage failure");
                    break;
                }
                // The stopped Raft may still hold the store for a moment; or the disk is
                // still short of what the store needs.
                Err(e) => tracing::warn!(member = replica.id, error = %e, "iam member not started again yet"),
            }
        }
    }
}

/// A reconciliation names the lock holder it is made for (commands logged before that did not).
fn require_holder(holder: &str) -> Result<(), IamError> {
    state::validate_lock_part("holder", holder)
}

fn unexpected(_: Output) -> IamError {
    IamError::Invariant("the state machine answered with the wrong kind of output")
}

impl Iam {
    /// Opens (creates) the redb store in `data_dir`, loads state into memory, and on first
    /// start bootstraps the root project, the admin principal (`*` on root) and the admin token
    /// from the options (an error if the token is empty or malformed then; later starts ignore
    /// it).
    pub fn open(opts: IamOptions) -> Result<Iam, IamError> {
        let (db, mut wal) = store::open_standalone(&opts.data_dir)?;
        let state = store::load(&db)?;
        let bootstrapped = state.bootstrapped();
        let shared = Arc::new(Shared { state: RwLock::new(state), failed: AtomicBool::new(false) });
        if !bootstrapped {
            let cmd = bootstrap_command(&opts)?;
            let mut results = store::apply_and_persist(&db, &mut wal, &shared, std::iter::once(cmd))?;
            results.pop().ok_or(IamError::Invariant("bootstrap gave no result"))??;
            tracing::info!(principal = %opts.admin_principal, "iam bootstrapped");
        }
        let (tx, rx) = mpsc::channel();
        let committer = Arc::new(Committer::new(db, wal, shared.clone(), opts.commit_batch_max));
        let c = committer.clone();
        let thread = std::thread::Builder::new()
            .name("iam-commit".into())
            .spawn(move || store::run_committer(c, rx))
            .map_err(|source| IamError::DataDir { path: opts.data_dir.clone(), source })?;
        Ok(Iam {
            inner: Arc::new(Inner {
                shared,
                committer: Some(committer),
                tx: Some(tx),
                thread: Some(thread),
                replica: None,
                opts,
            }),
        })
    }

    /// Opens this member of a replicated IAM: its redb file holds the log, the vote and the
    /// state; the members talk over mTLS with `tls`. On a member whose log is empty and whose
    /// `initial_members` name it first, the cluster is initialized with them; the first leader
    /// then commits the bootstrap (root project, admin principal and token) through the log.
    /// A member started without `initial_members` waits to be added.
    pub async fn open_replicated(
        opts: IamOptions,
        rcfg: &config::IamRaftConfig,
        tls: Arc<opendsec_common::tls::Credentials>,
    ) -> Result<Iam, IamError> {
        let db = Arc::new(raft::log::RaftDb::new(store::open_db(&opts.data_dir)?));
        let raft_io = |e: std::io::Error| IamError::Raft(e.to_string());
        raft::log::create_tables(&db).map_err(raft_io)?;
        let data_dir_id = raft::log::data_dir_id(&db).map_err(raft_io)?;
        let log = raft::log::LogStore::new(db.clone());
        let blank = log.is_blank().map_err(raft_io)?;
        let state = store::load(&db)?;
        // A standalone IAM's log not yet written into redb holds commits too.
        let standalone_log = std::fs::metadata(opts.data_dir.join(wal::WAL_FILE)).is_ok_and(|m| m.len() > 0);
        if blank && (state.bootstrapped() || standalone_log) {
            return Err(IamError::InvalidState(format!(
                "{} holds a standalone IAM's state and no Raft log: a replicated IAM starts from empty data \
                 directories (restore a backup into the new cluster)",
                opts.data_dir.display()
            )));
        }
        let boot = if state.bootstrapped() || rcfg.initial_members.is_empty() {
            None
        } else {
            Some(bootstrap_command(&opts)?)
        };
        let shared = Arc::new(Shared { state: RwLock::new(state), failed: AtomicBool::new(false) });
        let links = grpc::Links::new(tls);
        let config = raft::raft_config(rcfg)?;
        let lease = Duration::from_millis(config.election_timeout_max);
        let (seen_tx, seen) = tokio::sync::mpsc::channel(64);
        let who = raft::net::Who::new(rcfg.id, data_dir_id, shared.clone(), seen_tx);
        let start = Start {
            id: rcfg.id,
            data_dir: opts.data_dir.clone(),
            config,
            network: raft::net::Network { from: rcfg.id, links: links.clone(), who: who.clone() },
            shared: shared.clone(),
        };
        let node = start.node(db, log).await?;
        if blank && rcfg.initial_members.keys().next() == Some(&rcfg.id) {
            let members: std::collections::BTreeMap<u64, openraft::BasicNode> =
                rcfg.initial_members.iter().map(|(id, addr)| (*id, openraft::BasicNode::new(addr))).collect();
            match node.initialize(members).await {
                Ok(()) => tracing::info!(member = rcfg.id, "iam cluster initialized"),
                Err(e) => tracing::warn!(member = rcfg.id, error = %e, "iam cluster not initialized"),
            }
        }
        let replica = raft::Replica { id: rcfg.id, raft: raft::Current::new(node), who, links, lease };
        tokio::spawn(keep_running(replica.clone(), start));
        tokio::spawn(record_data_dirs(replica.clone(), seen));
        if let Some(cmd) = boot {
            tokio::spawn(bootstrap_when_leader(replica.clone(), shared.clone(), cmd));
        }
        Ok(Iam {
            inner: Arc::new(Inner { shared, committer: None, tx: None, thread: None, replica: Some(replica), opts }),
        })
    }

    /// This member's handle on the log (replicated mode).
    pub fn replica(&self) -> Option<&raft::Replica> {
        self.inner.replica.as_ref()
    }

    /// Stops this member's Raft (replicated mode; the standalone store closes with the last
    /// handle).
    pub async fn shutdown(&self) {
        if let Some(r) = &self.inner.replica {
            r.shutdown().await;
        }
    }

    pub fn options(&self) -> &IamOptions {
        &self.inner.opts
    }

    /// Commits one command (group commit) and returns what applying it answered.
    pub async fn execute(&self, cmd: Command) -> Result<Output, IamError> {
        if let Some(r) = &self.inner.replica {
            return r.execute(cmd).await;
        }
        let (Some(c), Some(tx)) = (&self.inner.committer, &self.inner.tx) else {
            return Err(IamError::Stopped);
        };
        c.execute(cmd, tx).await
    }

    /// Standalone: the commits made so far by callers on their own threads (a command alone
    /// in the queue, on a multi-thread runtime) and by the commit thread (for tests and
    /// benchmarks; `(0, 0)` when replicated).
    pub fn commits_made(&self) -> (u64, u64) {
        self.inner.committer.as_ref().map_or((0, 0), |c| c.commits_made())
    }

    /// Runs `f` on the current state under the read lock (keep it short).
    pub fn read<R>(&self, f: impl FnOnce(&State) -> R) -> R {
        f(&self.inner.shared.read())
    }

    // ----- Iam service -----

    /// Who calls with `token`, for anything but one sandbox's calls: a token minted for a
    /// sandbox is refused here.
    pub fn authenticate(&self, token: &str) -> Result<Authenticated, IamError> {
        let who = self.authenticate_scoped(token)?;
        if who.scope.is_some() {
            return Err(IamError::SandboxToken(who.token_id));
        }
        Ok(who)
    }

    /// Who calls with `token`, sandbox tokens included (with their scope): what the
    /// apiserver's `Authenticate` asks, which then holds such a token to its sandbox.
    pub fn authenticate_scoped(&self, token: &str) -> Result<Authenticated, IamError> {
        let now = now_ms();
        self.read(|s| s.authenticate(token, now))
    }

    pub fn authorize(&self, principal: &str, permission: &str, project: &str) -> Result<bool, IamError> {
        self.read(|s| s.authorize(principal, permission, project))
    }

    pub fn epoch(&self) -> u64 {
        self.read(State::epoch)
    }

    /// The epoch, and what was taken away after `since` (`None`: not known; clear all).
    pub fn epoch_since(&self, since: u64) -> (u64, Option<Vec<state::Revoked>>) {
        self.read(|s| (s.epoch(), s.revoked_since(since)))
    }

    /// Authenticates, authorizes `sandbox.create` and reserves the lease on the project and
    /// every ancestor in one command, bound to `edge`. An existing lease is rebound to `edge`,
    /// or, with `keep_existing`, left where it is and answered from memory without a command
    /// (after the same checks: the caller must hold `sandbox.create` and the lease must be its
    /// own).
    #[allow(clippy::too_many_arguments)] // one per field of the AdmitRequest, like the command
    pub async fn admit(
        &self,
        token: &str,
        lease_id: &str,
        project: &str,
        resources: Resources,
        edge: &str,
        keep_existing: bool,
        egress: Vec<String>,
        pool: &str,
    ) -> Result<Admission, IamError> {
        let who = self.authenticate(token)?;
        state::validate_admit(lease_id, project, &resources, edge)?;
        // The ceiling first: a refusal names the rule, and costs no commit.
        self.read(|s| s.check_egress(project, &egress))?;
        // Checked here too so a refusal or a kept lease costs no commit; the state machine
        // checks again when it applies the command.
        let kept = self.read(|s| s.admit_precheck(&who.principal, lease_id, project, &resources, keep_existing))?;
        if let Some(kept) = kept {
            return Ok(kept);
        }
        let (actor, now_ms, lease_id, project, edge) =
            (who.actor(), now_ms(), lease_id.to_string(), project.to_string(), edge.to_string());
        let cmd = match pool {
            "" => Command::Admit { actor, now_ms, lease_id, project, resources, edge, keep_existing, egress },
            pool => Command::AdmitClaim {
                actor,
                now_ms,
                lease_id,
                project,
                resources,
                edge,
                keep_existing,
                egress,
                pool: pool.into(),
            },
        };
        match self.execute(cmd).await? {
            Output::Admitted(a) => Ok(a),
            o => Err(unexpected(o)),
        }
    }

    /// Releases the leases (unknown ones are skipped); with a non-empty `edge`, only those
    /// bound to that edge. Returns how many were released.
    pub async fn release_leases(&self, lease_ids: Vec<String>, edge: &str) -> Result<u32, IamError> {
        if !edge.is_empty() {
            ids::validate_edge(edge).map_err(IamError::invalid)?;
        }
        if lease_ids.is_empty() {
            return Ok(0);
        }
        // One call is one command under the state lock: bounded like lookups.
        if lease_ids.len() > MAX_GET_LEASES {
            return Err(IamError::InvalidArgument(format!(
                "{} lease ids to release; at most {MAX_GET_LEASES} per call",
                lease_ids.len()
            )));
        }
        let cmd = Command::ReleaseLeases { now_ms: now_ms(), lease_ids, edge: edge.into() };
        match self.execute(cmd).await? {
            Output::Released { released } => Ok(released),
            o => Err(unexpected(o)),
        }
    }

    pub fn get_lease(&self, lease_id: &str) -> Result<Option<LeaseRecord>, IamError> {
        ids::validate_lease(lease_id).map_err(IamError::invalid)?;
        Ok(self.read(|s| s.lease(lease_id).cloned()))
    }

    /// The leases of the ids that IAM knows, in request order; unknown (or malformed) ids
    /// are left out. At most [`MAX_GET_LEASES`] ids per call.
    pub fn get_leases(&self, lease_ids: &[String]) -> Result<Vec<LeaseRecord>, IamError> {
        if lease_ids.len() > MAX_GET_LEASES {
            return Err(IamError::InvalidArgument(format!(
                "{} lease ids asked for; at most {MAX_GET_LEASES} per call",
                lease_ids.len()
            )));
        }
        Ok(self.read(|s| lease_ids.iter().filter_map(|id| s.lease(id).cloned()).collect()))
    }

    /// Edge `edge`'s leases made to match `live`, its list read at `read_at_ms` (IAM's clock;
    /// 0: now), for `holder` of the reconcile lock. Returns (adopted, released).
    pub async fn reconcile(
        &self,
        edge: &str,
        holder: &str,
        read_at_ms: i64,
        live: Vec<LiveLease>,
    ) -> Result<(u32, u32), IamError> {
        ids::validate_edge(edge).map_err(IamError::invalid)?;
        require_holder(holder)?;
        if read_at_ms < 0 {
            return Err(IamError::InvalidArgument("read_at_ms is negative".into()));
        }
        let min_age_ms = i64::try_from(self.inner.opts.reconcile_min_age.as_millis()).unwrap_or(i64::MAX);
        let cmd = Command::FencedReconcile {
            now_ms: now_ms(),
            edge: edge.into(),
            live,
            min_age_ms,
            holder: holder.into(),
            read_at_ms,
        };
        match self.execute(cmd).await? {
            Output::Reconciled { adopted, released } => Ok((adopted, released)),
            o => Err(unexpected(o)),
        }
    }

    /// Leases bound to edges outside `known_edges`, older than `older_than_s`, released, for
    /// `holder` of the reconcile lock.
    pub async fn sweep_unbound(
        &self,
        known_edges: Vec<String>,
        older_than_s: u64,
        holder: &str,
    ) -> Result<u32, IamError> {
        require_holder(holder)?;
        let older_than_ms = i64::try_from(older_than_s.saturating_mul(1000)).unwrap_or(i64::MAX);
        let cmd = Command::FencedSweep { now_ms: now_ms(), known_edges, older_than_ms, holder: holder.into() };
        match self.execute(cmd).await? {
            Output::Released { released } => Ok(released),
            o => Err(unexpected(o)),
        }
    }

    /// Returns (acquired, holder, expires_at_ms).
    pub async fn acquire_lock(&self, name: &str, holder: &str, ttl_ms: u64) -> Result<(bool, String, i64), IamError> {
        let ttl_ms = i64::try_from(ttl_ms).unwrap_or(i64::MAX);
        let cmd = Command::AcquireLock { now_ms: now_ms(), name: name.into(), holder: holder.into(), ttl_ms };
        match self.execute(cmd).await? {
            Output::Lock { acquired, holder, expires_at_ms } => Ok((acquired, holder, expires_at_ms)),
            o => Err(unexpected(o)),
        }
    }

    // ----- Admin service (the caller already authenticated) -----

    async fn project_command(&self, cmd: Command) -> Result<ProjectView, IamError> {
        match self.execute(cmd).await? {
            Output::Project(v) => Ok(v),
            o => Err(unexpected(o)),
        }
    }

    async fn done(&self, cmd: Command) -> Result<(), IamError> {
        match self.execute(cmd).await? {
            Output::Done => Ok(()),
            o => Err(unexpected(o)),
        }
    }

    pub async fn create_project(&self, who: &Authenticated, path: &str, quota: Quota) -> Result<ProjectView, IamError> {
        self.project_command(Command::CreateProject { actor: who.actor(), now_ms: now_ms(), path: path.into(), quota })
            .await
    }

    /// Sets (or with `None` removes) the egress ceiling of a project.
    pub async fn set_egress_ceiling(
        &self,
        who: &Authenticated,
        path: &str,
        ceiling: Option<Vec<String>>,
    ) -> Result<ProjectView, IamError> {
        self.project_command(Command::SetEgressCeiling {
            actor: who.actor(),
            now_ms: now_ms(),
            path: path.into(),
            ceiling,
        })
        .await
    }

    /// Whether `rules` lie within the egress ceilings of `project` and its ancestors
    /// (`permission_denied` naming the first rule outside).
    pub fn check_egress(&self, project: &str, rules: &[String]) -> Result<(), IamError> {
        ids::validate_project(project).map_err(IamError::invalid)?;
        self.read(|s| s.check_egress(project, rules))
    }

    pub async fn set_quota(&self, who: &Authenticated, path: &str, quota: Quota) -> Result<ProjectView, IamError> {
        self.project_command(Command::SetQuota { actor: who.actor(), now_ms: now_ms(), path: path.into(), quota }).await
    }

    pub async fn delete_project(&self, who: &Authenticated, path: &str) -> Result<(), IamError> {
        self.done(Command::DeleteProject { actor: who.actor(), now_ms: now_ms(), path: path.into() }).await
    }

    pub fn get_project(&self, who: &Authenticated, path: &str) -> Result<ProjectView, IamError> {
        self.read(|s| s.get_project(who, path))
    }

    /// The project and everything below it (ListProjects and GetUsage).
    pub fn list_projects(&self, who: &Authenticated, path: &str) -> Result<Vec<ProjectView>, IamError> {
        self.read(|s| s.list_projects(who, path))
    }

    pub async fn create_principal(
        &self,
        who: &Authenticated,
        name: &str,
        project: &str,
    ) -> Result<PrincipalRecord, IamError> {
        let project = if project.is_empty() { who.project.as_str() } else { project };
        let cmd = Command::CreatePrincipal {
            actor: who.actor(),
            now_ms: now_ms(),
            name: name.into(),
            project: project.into(),
        };
        match self.execute(cmd).await? {
            Output::Principal(p) => Ok(p),
            o => Err(unexpected(o)),
        }
    }

    pub async fn delete_principal(&self, who: &Authenticated, name: &str) -> Result<(), IamError> {
        self.done(Command::DeletePrincipal { actor: who.actor(), now_ms: now_ms(), name: name.into() }).await
    }

    pub fn list_principals(&self, who: &Authenticated, project: &str) -> Result<Vec<PrincipalRecord>, IamError> {
        self.read(|s| s.list_principals(who, project))
    }

    /// Makes a token for `principal` (empty: the caller). Returns the token string, shown once,
    /// and its record.
    pub async fn create_token(
        &self,
        who: &Authenticated,
        principal: &str,
        ttl_s: u64,
        description: &str,
    ) -> Result<(String, TokenRecord), IamError> {
        let principal = if principal.is_empty() { who.principal.as_str() } else { principal };
        if ttl_s > MAX_TOKEN_TTL_S {
            return Err(IamError::InvalidArgument(format!("ttl_s {ttl_s} is above {MAX_TOKEN_TTL_S} (ten years)")));
        }
        let now = now_ms();
        // ttl_s is at most ten years, so this cannot overflow.
        let expires_at_ms = if ttl_s == 0 { 0 } else { now + ttl_s as i64 * 1000 };
        let (id, secret) = (token::new_id(), token::new_secret());
        let key = self.read(|s| s.hash_key().to_vec());
        let cmd = Command::CreateToken {
            actor: who.actor(),
            now_ms: now,
            principal: principal.into(),
            token_id: id.clone(),
            secret_hash: token::hash_secret_hex(&key, &secret),
            expires_at_ms,
            description: description.into(),
        };
        match self.execute(cmd).await? {
            Output::Token(rec) => Ok((token::format(&id, &secret), rec)),
            o => Err(unexpected(o)),
        }
    }

    /// The tokens of the sandbox of `lease_id` for the caller of `token` (made on first use,
    /// the same ones after): `(runtime, traffic)`, each `dsk.<id>.<secret>`. The caller needs
    /// `sandbox.operate` on the sandbox's project; the tokens act as its principal on that
    /// sandbox only and end with it.
    pub async fn mint_sandbox_tokens(&self, token: &str, lease_id: &str) -> Result<(String, String), IamError> {
        let who = self.authenticate(token)?;
        let key = self.read(|s| s.hash_key().to_vec());
        let format = |ids: &std::collections::BTreeMap<model::ScopeKind, String>| {
            let full = |k: model::ScopeKind| {
                ids.get(&k).map(|id| token::format(id, &token::derive_secret(&key, id))).unwrap_or_default()
            };
            (full(model::ScopeKind::Runtime), full(model::ScopeKind::Traffic))
        };
        // Minted before (and still allowed): answered without a command.
        let found = self.read(|s| {
            let lease = s.leases.get(lease_id)?;
            s.holds(&who.principal, "sandbox.operate", &lease.project)
                .then(|| s.sandbox_tokens(lease_id, &who.actor()))?
        });
        if let Some(ids) = found {
            return Ok(format(&ids));
        }
        let tokens = model::ScopeKind::ALL
            .into_iter()
            .map(|kind| {
                let id = token::new_sandbox_token_id();
                let secret_hash = token::hash_secret_hex(&key, &token::derive_secret(&key, &id));
                command::MintedToken { kind, token_id: id, secret_hash }
            })
            .collect();
        let cmd =
            Command::MintSandboxTokens { actor: who.actor(), now_ms: now_ms(), lease_id: lease_id.into(), tokens };
        match self.execute(cmd).await? {
            Output::SandboxTokens(ids) => Ok(format(&ids)),
            o => Err(unexpected(o)),
        }
    }

    /// An edge's idle member of pool `pool` of `project`, charged like a sandbox of it.
    pub async fn admit_member(
        &self,
        edge: &str,
        lease_id: &str,
        project: &str,
        pool: &str,
        resources: Resources,
    ) -> Result<(), IamError> {
        let cmd = Command::AdmitMember {
            now_ms: now_ms(),
            edge: edge.into(),
            lease_id: lease_id.into(),
            project: project.into(),
            pool: pool.into(),
            resources,
        };
        self.done(cmd).await
    }

    /// Charges an image to its project's `store_bytes` (replacing a charge of the same name).
    pub async fn charge_image(&self, charge: model::ImageCharge) -> Result<(), IamError> {
        self.done(Command::ChargeImage { now_ms: now_ms(), charge }).await
    }

    /// `quota_exceeded` unless `bytes` more fit in the project's `store_bytes` (a read).
    pub fn store_room(&self, project: &str, bytes: u64) -> Result<(), IamError> {
        self.read(|s| s.store_room(project, bytes))
    }

    /// Takes an image's charge away (none: nothing to do).
    pub async fn uncharge_image(&self, project: &str, name: &str) -> Result<(), IamError> {
        self.done(Command::UnchargeImage { now_ms: now_ms(), project: project.into(), name: name.into() }).await
    }

    pub fn list_tokens(&self, who: &Authenticated, principal: &str) -> Result<Vec<TokenRecord>, IamError> {
        self.read(|s| s.list_tokens(who, principal))
    }

    pub async fn revoke_token(&self, who: &Authenticated, token_id: &str) -> Result<(), IamError> {
        self.done(Command::RevokeToken { actor: who.actor(), now_ms: now_ms(), token_id: token_id.into() }).await
    }

    pub async fn grant(&self, who: &Authenticated, grant: GrantRecord) -> Result<(), IamError> {
        self.done(Command::Grant { actor: who.actor(), now_ms: now_ms(), grant }).await
    }

    pub async fn revoke_grant(&self, who: &Authenticated, grant: GrantRecord) -> Result<(), IamError> {
        self.done(Command::RevokeGrant { actor: who.actor(), now_ms: now_ms(), grant }).await
    }

    pub fn list_grants(
        &self,
        who: &Authenticated,
        principal: &str,
        project: &str,
    ) -> Result<Vec<GrantRecord>, IamError> {
        self.read(|s| s.list_grants(who, principal, project))
    }

    /// Creates (`create`) or replaces a pool in `pool.project` (the caller's when empty).
    pub async fn put_pool(
        &self,
        who: &Authenticated,
        mut pool: model::PoolRecord,
        create: bool,
    ) -> Result<model::PoolRecord, IamError> {
        if pool.project.is_empty() {
            pool.project = who.project.clone();
        }
        match self.execute(Command::PutPool { actor: who.actor(), now_ms: now_ms(), pool, create }).await? {
            Output::Pool(p) => Ok(p),
            o => Err(unexpected(o)),
        }
    }

    pub async fn delete_pool(&self, who: &Authenticated, project: &str, name: &str) -> Result<(), IamError> {
        let project = if project.is_empty() { who.project.as_str() } else { project };
        self.done(Command::DeletePool {
            actor: who.actor(),
            now_ms: now_ms(),
            project: project.into(),
            name: name.into(),
        })
        .await
    }

    /// The pool `name` of `project` (the caller's when empty): `pool.manage` on it.
    pub fn get_pool(&self, who: &Authenticated, project: &str, name: &str) -> Result<model::PoolRecord, IamError> {
        let project = if project.is_empty() { who.project.as_str() } else { project };
        self.read(|s| {
            s.require(&who.principal, "pool.manage", project, || format!("project {project}"))?;
            s.pool_named(project, name)
        })
    }

    /// The pools of `project` (the caller's when empty) and its subprojects.
    pub fn list_pools(&self, who: &Authenticated, project: &str) -> Result<Vec<model::PoolRecord>, IamError> {
        let project = if project.is_empty() { who.project.as_str() } else { project };
        ids::validate_project(project).map_err(IamError::invalid)?;
        self.read(|s| {
            s.require(&who.principal, "pool.manage", project, || format!("project {project}"))?;
            Ok(s.pools_within(project).cloned().collect())
        })
    }

    /// The pool `name` of `project` for a creation by `principal`, who must hold
    /// `sandbox.create` there (checked first: a pool's existence is not told to others).
    pub fn resolve_pool(&self, principal: &str, project: &str, name: &str) -> Result<model::PoolRecord, IamError> {
        ids::validate_project(project).map_err(IamError::invalid)?;
        self.read(|s| {
            s.require(principal, "sandbox.create", project, || format!("project {project}"))?;
            s.pool_named(project, name)
        })
    }

    /// Every pool (for edges, which keep their members).
    pub fn all_pools(&self) -> Vec<model::PoolRecord> {
        self.read(|s| s.pools_within(ids::ROOT_PROJECT).cloned().collect())
    }

    /// gzipped JSON of everything but leases and locks.
    pub fn backup(&self, who: &Authenticated) -> Result<Vec<u8>, IamError> {
        let snap = self.read(|s| s.backup(who))?;
        snap.encode()
    }

    pub async fn restore(&self, who: &Authenticated, data: &[u8]) -> Result<(), IamError> {
        // Refuse early without decoding anything when the caller may not restore.
        self.read(|s| s.require(&who.principal, "iam.admin", ids::ROOT_PROJECT, || "project root".into()))?;
        let snapshot = Snapshot::decode(data)?;
        self.done(Command::Restore { actor: who.actor(), now_ms: now_ms(), snapshot }).await
    }

    // ----- membership (iam.admin on root) -----

    fn require_admin(&self, who: &Authenticated) -> Result<(), IamError> {
        self.read(|s| s.require(&who.principal, "iam.admin", ids::ROOT_PROJECT, || "project root".into()))
    }

    fn replicated(&self) -> Result<&raft::Replica, IamError> {
        self.inner
            .replica
            .as_ref()
            .ok_or_else(|| IamError::Membership("this IAM runs standalone: it has no other members to change".into()))
    }

    /// The members (a standalone IAM: itself alone, not replicated).
    pub fn members(&self, who: &Authenticated) -> Result<Option<raft::Members>, IamError> {
        self.require_admin(who)?;
        Ok(self.inner.replica.as_ref().map(raft::Replica::members))
    }

    pub async fn add_member(
        &self,
        who: &Authenticated,
        id: u64,
        address: &str,
        learner_only: bool,
    ) -> Result<raft::Members, IamError> {
        self.require_admin(who)?;
        self.replicated()?.add_member(id, address, learner_only).await
    }

    pub async fn remove_member(&self, who: &Authenticated, id: u64) -> Result<raft::Members, IamError> {
        self.require_admin(who)?;
        self.replicated()?.remove_member(id).await
    }

    pub async fn transfer_leader(&self, who: &Authenticated, to: u64) -> Result<raft::Members, IamError> {
        self.require_admin(who)?;
        self.replicated()?.transfer_leader(to).await
    }

    // ----- serving -----

    /// The `Iam` gRPC service (internal: who may call which method is the role table of
    /// `opendsec_common::acl`, checked in front of the server).
    pub fn iam_service(&self) -> IamGrpc {
        service::iam_grpc(self.clone())
    }

    /// The `Admin` gRPC service (apiservers only; callers' bearer tokens are checked per call).
    pub fn admin_service(&self) -> AdminGrpc {
        service::admin_grpc(self.clone())
    }
}

/// Serves `Iam` and `Admin` over mTLS on the listener until `shutdown` completes.
pub async fn serve(
    iam: Iam,
    listener: tokio::net::TcpListener,
    tls: &std::sync::Arc<opendsec_common::tls::Credentials>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), IamError> {
    // Standalone, every call is served here as it comes; replicated, by the leader.
    let router = match iam.replica().cloned() {
        None => grpc::iam_server().add_service(iam.iam_service()).add_service(iam.admin_service()),
        Some(r) => grpc::iam_server()
            .add_service(raft::forward::Forward::new(iam.iam_service(), r.clone()))
            .add_service(raft::forward::Forward::new(iam.admin_service(), r.clone()))
            .add_service(
                opendsec_proto::v1::iam_raft_server::IamRaftServer::new(raft::net::RaftService::new(
                    r.raft.clone(),
                    r.who.clone(),
                    r.lease,
                ))
                .max_decoding_message_size(grpc::MAX_MESSAGE_BYTES)
                .max_encoding_message_size(grpc::MAX_MESSAGE_BYTES),
            ),
    };
    drop(iam);
    grpc::serve_internal(router, listener, tls, shutdown).await?;
    Ok(())
}
