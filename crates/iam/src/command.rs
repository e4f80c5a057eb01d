//! Commands: every change to IAM's state is one [`Command`] value, and [`Write`]s are what
//! applying it asks the store to persist.
//!
//! Invariant: a command carries everything nondeterministic (the time, generated ids, secret
//! hashes, the hash key at bootstrap), so applying it to equal states gives equal results on
//! every node. The serde encoding ([`Command::encode`]) is versioned and persisted (Raft log,
//! golden tests): variants and fields are only ever added.

use serde::{Deserialize, Serialize};

use crate::backup::Snapshot;
use crate::error::IamError;
use crate::model::{
    GrantRecord, ImageCharge, LeaseRecord, LockRecord, Meta, PoolRecord, PrincipalRecord, ProjectRecord, Quota,
    Resources, TokenRecord,
};

/// The encoding version written by [`Command::encode`].
pub const COMMAND_VERSION: u32 = 1;

/// Who asks for an admin change: the principal and the token it authenticated with. The state
/// machine checks both again at apply time, so a token revoked between the check and the
/// commit does not slip through.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Actor {
    pub principal: String,
    pub token_id: String,
}

/// A lease an edge reports alive.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LiveLease {
    pub lease_id: String,
    pub project: String,
    #[serde(default)]
    pub principal: String,
    pub resources: Resources,
    /// An idle pool member's (`<project>//<name>`). Not written when empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pool: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Command {
    /// First start: the root project, the admin principal with `*` on root, its token.
    Bootstrap {
        now_ms: i64,
        /// Hex of 32 random bytes, made by the proposer.
        hash_key: String,
        admin_principal: String,
        admin_token_id: String,
        admin_token_hash: String,
        /// The cluster's id (hex of 16 random bytes, made by the proposer).
        #[serde(default)]
        cluster: String,
    },
    /// Replicated: the leader records the data directory id member `id` answered with, the
    /// first time it sees one (a later, different one is never recorded over it).
    MemberSeen {
        id: u64,
        data_dir: String,
    },
    /// Gives a cluster bootstrapped before cluster ids one (ignored once it has one).
    SetCluster {
        cluster: String,
    },
    CreateProject {
        actor: Actor,
        now_ms: i64,
        path: String,
        quota: Quota,
    },
    SetQuota {
        actor: Actor,
        now_ms: i64,
        path: String,
        quota: Quota,
    },
    DeleteProject {
        actor: Actor,
        now_ms: i64,
        path: String,
    },
    CreatePrincipal {
        actor: Actor,
        now_ms: i64,
        name: String,
        project: String,
    },
    DeletePrincipal {
        actor: Actor,
        now_ms: i64,
        name: String,
    },
    CreateToken {
        actor: Actor,
        now_ms: i64,
        /// Already resolved by the proposer (empty request: the actor itself).
        principal: String,
        token_id: String,
        secret_hash: String,
        /// 0 = never.
        expires_at_ms: i64,
        description: String,
    },
    RevokeToken {
        actor: Actor,
        now_ms: i64,
        token_id: String,
    },
    Grant {
        actor: Actor,
        now_ms: i64,
        grant: GrantRecord,
    },
    RevokeGrant {
        actor: Actor,
        now_ms: i64,
        grant: GrantRecord,
    },
    Restore {
        actor: Actor,
        now_ms: i64,
        snapshot: Snapshot,
    },
    Admit {
        actor: Actor,
        now_ms: i64,
        lease_id: String,
        project: String,
        resources: Resources,
        edge: String,
        /// When the lease exists: leave it where it is bound and answer that (a first attempt
        /// whose lease the client chose; a retry must find what the earlier attempt made).
        /// Not written when false, so commands without it encode as before.
        #[serde(default, skip_serializing_if = "is_false")]
        keep_existing: bool,
        /// The sandbox's egress rules (text form), checked against the ceilings of the
        /// project and its ancestors. Not written when empty.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        egress: Vec<String>,
    },
    /// An [`Command::Admit`] of a sandbox to be made from an idle member of pool `pool`
    /// (`<project>//<name>`) on `edge`: a new lease takes over the charge of one idle member
    /// lease of that pool there, of the same project and resources (released in the same
    /// command). A kind of its own, so that a member on an older release stops short of it
    /// rather than apply it as a plain admit. Log format 4.
    AdmitClaim {
        actor: Actor,
        now_ms: i64,
        lease_id: String,
        project: String,
        resources: Resources,
        edge: String,
        #[serde(default, skip_serializing_if = "is_false")]
        keep_existing: bool,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        egress: Vec<String>,
        pool: String,
    },
    SetEgressCeiling {
        actor: Actor,
        now_ms: i64,
        path: String,
        /// `None` removes the project's own ceiling.
        ceiling: Option<Vec<String>>,
    },
    ReleaseLeases {
        now_ms: i64,
        lease_ids: Vec<String>,
        /// When set, only leases bound to this edge are released (an edge releasing what it
        /// ran never frees a lease rebound elsewhere meanwhile). Not written when empty.
        #[serde(default, skip_serializing_if = "String::is_empty")]
        edge: String,
    },
    /// Logged by releases before [`Command::FencedReconcile`]: applied as then. The
    /// development release just before that wrote a holder and a read time here; such entries
    /// apply as a fenced one does.
    Reconcile {
        now_ms: i64,
        edge: String,
        live: Vec<LiveLease>,
        min_age_ms: i64,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        holder: String,
        #[serde(default, skip_serializing_if = "is_zero")]
        read_at_ms: i64,
    },
    /// Logged by releases before [`Command::FencedSweep`] (a holder, when given, fences it).
    SweepUnbound {
        now_ms: i64,
        known_edges: Vec<String>,
        older_than_ms: i64,
        #[serde(default, skip_serializing_if = "String::is_empty")]
        holder: String,
    },
    /// An edge's leases made to match its list: applied only while `holder` holds
    /// [`opendsec_common::RECONCILE_LOCK`] (unexpired at `now_ms`), lease ages measured at
    /// `read_at_ms` (when the edge was asked). A kind of its own, not fields added to
    /// [`Command::Reconcile`]: a member on a release before it cannot decode the entry, and
    /// stops short of it until upgraded, instead of applying it without the fence.
    FencedReconcile {
        now_ms: i64,
        edge: String,
        live: Vec<LiveLease>,
        min_age_ms: i64,
        holder: String,
        read_at_ms: i64,
    },
    /// [`Command::SweepUnbound`] fenced as [`Command::FencedReconcile`] is.
    FencedSweep {
        now_ms: i64,
        known_edges: Vec<String>,
        older_than_ms: i64,
        holder: String,
    },
    AcquireLock {
        now_ms: i64,
        name: String,
        holder: String,
        ttl_ms: i64,
    },
    /// Creates (`create`: the name must be free) or replaces (it must exist) a pool.
    PutPool {
        actor: Actor,
        now_ms: i64,
        pool: PoolRecord,
        create: bool,
    },
    DeletePool {
        actor: Actor,
        now_ms: i64,
        project: String,
        name: String,
    },
    /// An edge starting an idle member of pool `pool` (`<project>//<name>`): its lease,
    /// charged to the pool's project like a sandbox's, bound to the edge. Log format 4.
    AdmitMember {
        now_ms: i64,
        edge: String,
        lease_id: String,
        project: String,
        pool: String,
        resources: Resources,
    },
    /// An image published (or replaced) in the store: charged to its project's `store_bytes`
    /// (and its ancestors'), all or nothing. Sent by the apiserver before it writes the
    /// manifest. Log format 3.
    ChargeImage {
        now_ms: i64,
        charge: ImageCharge,
    },
    /// An image deleted from the store: its charge goes (nothing if it had none).
    UnchargeImage {
        now_ms: i64,
        project: String,
        name: String,
    },
    /// The actor's tokens for the sandbox of `lease_id`, one of each kind (made unless it has
    /// them already). A kind of its own: members before it cannot decode it (log format 3).
    MintSandboxTokens {
        actor: Actor,
        now_ms: i64,
        lease_id: String,
        tokens: Vec<MintedToken>,
    },
}

/// One token of [`Command::MintSandboxTokens`], as the proposer made it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MintedToken {
    pub kind: crate::model::ScopeKind,
    pub token_id: String,
    /// HMAC-SHA256(hash_key, derived secret), hex ([`crate::token::derive_secret`]).
    pub secret_hash: String,
}

fn is_false(b: &bool) -> bool {
    !*b
}

fn is_zero(n: &i64) -> bool {
    *n == 0
}

#[derive(Serialize)]
struct EnvelopeOut<'a> {
    v: u32,
    command: &'a Command,
}

#[derive(Deserialize)]
struct EnvelopeIn {
    v: u32,
    command: Command,
}

/// The command's kind only (a command may carry secret hashes; logs name kinds).
impl std::fmt::Display for Command {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.kind())
    }
}

impl Command {
    /// The versioned JSON encoding: `{"v":1,"command":{"type":...}}`.
    pub fn encode(&self) -> Result<Vec<u8>, IamError> {
        serde_json::to_vec(&EnvelopeOut { v: COMMAND_VERSION, command: self })
            .map_err(|source| IamError::Encode { table: "command", source })
    }

    pub fn decode(bytes: &[u8]) -> Result<Command, IamError> {
        let env: EnvelopeIn = serde_json::from_slice(bytes).map_err(|source| IamError::CorruptRow {
            table: "command",
            key: String::new(),
            source,
        })?;
        if env.v != COMMAND_VERSION {
            return Err(IamError::RowVersion { table: "command", key: String::new(), version: env.v });
        }
        Ok(env.command)
    }

    /// The log format a member must read to decode this entry (see
    /// [`crate::raft::net::LOG_FORMAT`]).
    pub fn log_format(&self) -> u32 {
        match self {
            Command::MintSandboxTokens { .. } | Command::ChargeImage { .. } | Command::UnchargeImage { .. } => 3,
            Command::AdmitMember { .. } | Command::AdmitClaim { .. } => 4,
            // Members' leases reported (kept, never adopted) are read by format 4 only.
            Command::FencedReconcile { live, .. } if live.iter().any(|l| !l.pool.is_empty()) => 4,
            Command::FencedReconcile { .. } | Command::FencedSweep { .. } => 2,
            _ => 1,
        }
    }

    /// A short name for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Command::Bootstrap { .. } => "bootstrap",
            Command::MemberSeen { .. } => "member_seen",
            Command::SetCluster { .. } => "set_cluster",
            Command::CreateProject { .. } => "create_project",
            Command::SetQuota { .. } => "set_quota",
            Command::DeleteProject { .. } => "delete_project",
            Command::CreatePrincipal { .. } => "create_principal",
            Command::DeletePrincipal { .. } => "delete_principal",
            Command::CreateToken { .. } => "create_token",
            Command::RevokeToken { .. } => "revoke_token",
            Command::Grant { .. } => "grant",
            Command::RevokeGrant { .. } => "revoke_grant",
            Command::Restore { .. } => "restore",
            Command::Admit { .. } => "admit",
            Command::AdmitClaim { .. } => "admit_claim",
            Command::SetEgressCeiling { .. } => "set_egress_ceiling",
            Command::ReleaseLeases { .. } => "release_leases",
            Command::Reconcile { .. } => "reconcile",
            Command::SweepUnbound { .. } => "sweep_unbound",
            Command::FencedReconcile { .. } => "fenced_reconcile",
            Command::FencedSweep { .. } => "fenced_sweep",
            Command::AcquireLock { .. } => "acquire_lock",
            Command::PutPool { .. } => "put_pool",
            Command::DeletePool { .. } => "delete_pool",
            Command::MintSandboxTokens { .. } => "mint_sandbox_tokens",
            Command::ChargeImage { .. } => "charge_image",
            Command::AdmitMember { .. } => "admit_member",
            Command::UnchargeImage { .. } => "uncharge_image",
        }
    }
}

/// The store tables, one per entity kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Table {
    Projects,
    Principals,
    Tokens,
    Grants,
    Leases,
    Locks,
    Meta,
    Pools,
    Images,
}

impl Table {
    pub const ALL: [Table; 9] = [
        Table::Projects,
        Table::Principals,
        Table::Tokens,
        Table::Grants,
        Table::Leases,
        Table::Locks,
        Table::Meta,
        Table::Pools,
        Table::Images,
    ];

    /// The table `name` names, if any.
    pub fn named(name: &str) -> Option<Table> {
        Table::ALL.into_iter().find(|t| t.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Table::Projects => "projects",
            Table::Principals => "principals",
            Table::Tokens => "tokens",
            Table::Grants => "grants",
            Table::Leases => "leases",
            Table::Locks => "locks",
            Table::Meta => "meta",
            Table::Pools => "pools",
            Table::Images => "images",
        }
    }
}

/// The key of the singleton meta row.
pub const META_KEY: &str = "meta";

/// A row as the store keeps it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Row {
    Project(ProjectRecord),
    Principal(PrincipalRecord),
    Token(TokenRecord),
    Grant(GrantRecord),
    Lease(LeaseRecord),
    Lock(LockRecord),
    Meta(Meta),
    Pool(Box<PoolRecord>),
    Image(ImageCharge),
}

impl Row {
    pub fn table(&self) -> Table {
        match self {
            Row::Project(_) => Table::Projects,
            Row::Principal(_) => Table::Principals,
            Row::Token(_) => Table::Tokens,
            Row::Grant(_) => Table::Grants,
            Row::Lease(_) => Table::Leases,
            Row::Lock(_) => Table::Locks,
            Row::Meta(_) => Table::Meta,
            Row::Pool(_) => Table::Pools,
            Row::Image(_) => Table::Images,
        }
    }

    pub fn key(&self) -> String {
        match self {
            Row::Project(r) => r.path.clone(),
            Row::Principal(r) => r.name.clone(),
            Row::Token(r) => r.id.clone(),
            Row::Grant(r) => r.key(),
            Row::Lease(r) => r.id.clone(),
            Row::Lock(r) => r.name.clone(),
            Row::Meta(_) => META_KEY.to_string(),
            Row::Pool(r) => r.key(),
            Row::Image(r) => r.key(),
        }
    }
}

/// One change to persist, in the order applying produced it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Write {
    Put(Row),
    Delete { table: Table, key: String },
}

/// What applying a command answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Output {
    Done,
    Project(crate::model::ProjectView),
    Principal(PrincipalRecord),
    Token(TokenRecord),
    Admitted(Admission),
    Released {
        released: u32,
    },
    Reconciled {
        adopted: u32,
        released: u32,
    },
    Lock {
        acquired: bool,
        holder: String,
        expires_at_ms: i64,
    },
    Pool(PoolRecord),
    /// A sandbox's tokens: kind -> token id.
    SandboxTokens(std::collections::BTreeMap<crate::model::ScopeKind, String>),
}

/// What an Admit answers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Admission {
    /// Who holds the lease (the caller for a new lease).
    pub principal: String,
    /// The lease existed and was rebound to the requested edge.
    pub rebound: bool,
    /// The lease existed and `keep_existing` left it where it was.
    pub existing: bool,
    /// The pool member lease whose charge the new lease took over (empty: none).
    pub member_lease: String,
    /// Where the lease is bound after the call.
    pub edge: String,
    pub bound_at_ms: i64,
}
