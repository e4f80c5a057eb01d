//! IAM's errors and their one mapping to the wire ([`to_api`]).
//!
//! The state machine's errors (invalid input, authentication, permission, existence, quota)
//! are deterministic: every replica applying the same command reaches the same one. Store and
//! pipeline errors say "this node cannot serve" and map to `unavailable`, never to
//! `invalid_argument` or `internal`, so callers retry elsewhere.

use opendsec_common::{ApiError, Reason};

#[derive(Debug, thiserror::Error)]
pub enum IamError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    Unauthenticated(String),
    /// `target` names what was asked for ("project root/a", "principal bob"), never more than
    /// the caller said, so a denial does not reveal whether the target exists.
    #[error("permission denied: {principal} lacks {permission} on {target}")]
    PermissionDenied { principal: String, permission: String, target: String },
    /// A token minted for one sandbox used for anything but that sandbox's calls.
    #[error("token {0} acts on one sandbox only: it may not call this")]
    SandboxToken(String),
    /// A sandbox asked for egress its project's (or an ancestor's) ceiling does not allow.
    #[error("egress rule {rule:?} is outside the egress ceiling of project {project}")]
    EgressCeiling { project: String, rule: String },
    #[error("{kind} {name} not found")]
    NotFound { kind: &'static str, name: String },
    #[error("{kind} {name} already exists")]
    AlreadyExists { kind: &'static str, name: String },
    #[error("{0}")]
    InvalidState(String),
    #[error("quota exceeded on project {project}: {key} would be {used} + {requested} above the limit {limit}")]
    QuotaExceeded { project: String, key: &'static str, limit: u64, used: u64, requested: u64 },
    #[error("iam is not bootstrapped yet")]
    NotBootstrapped,
    #[error("admin token: {0}")]
    AdminToken(&'static str),
    #[error("invalid backup: {0}")]
    BadBackup(String),
    #[error("store: {op} failed: {source}")]
    Store { op: &'static str, source: redb::Error },
    /// The standalone store's write-ahead log (`iam.wal`).
    #[error("store log: {op} failed: {source}")]
    Wal { op: &'static str, source: std::io::Error },
    #[error("store: {table} row {key:?} is unreadable: {source}")]
    CorruptRow { table: &'static str, key: String, source: serde_json::Error },
    #[error("store: {table} row {key:?} has unsupported version {version}")]
    RowVersion { table: &'static str, key: String, version: u32 },
    #[error("store: failed to encode a {table} row: {source}")]
    Encode { table: &'static str, source: serde_json::Error },
    #[error("failed to create data dir {path}: {source}")]
    DataDir { path: std::path::PathBuf, source: std::io::Error },
    #[error("the store failed earlier and could not be reloaded; this node cannot serve")]
    StoreFailed,
    /// The batch holding the command could not be committed (told to every caller in it).
    #[error("store commit failed, the command was not applied: {0}")]
    CommitFailed(String),
    #[error("the commit thread has stopped")]
    Stopped,
    /// A broken invariant inside IAM (for example an answer of the wrong kind).
    #[error("internal error: {0}")]
    Invariant(&'static str),
    #[error("failed to serve: {0}")]
    Serve(#[from] tonic::transport::Error),
    /// A replicated IAM's member that is not the leader and cannot hand the call on.
    #[error("{0}")]
    NotLeader(String),
    /// The log refused or failed (a membership change it will not make, a stopped member).
    #[error("raft: {0}")]
    Raft(String),
    /// A membership change asked of a standalone IAM, or one openraft refuses in this state.
    #[error("{0}")]
    Membership(String),
    /// A member id a data directory was recorded under: the cluster would refuse any other.
    #[error("iam member id {0} was used before (its data directory is recorded): give the new member an id never used")]
    MemberIdUsed(u64),
}

impl IamError {
    /// An id validation error from `opendsec_common::ids`.
    pub(crate) fn invalid(e: ApiError) -> IamError {
        IamError::InvalidArgument(e.message)
    }
}

/// The single classification of IAM errors into wire reasons.
pub fn to_api(e: &IamError) -> ApiError {
    let msg = e.to_string();
    match e {
        IamError::InvalidArgument(_) | IamError::BadBackup(_) | IamError::AdminToken(_) => {
            ApiError::new(Reason::InvalidArgument, msg)
        }
        IamError::Unauthenticated(_) => ApiError::new(Reason::Unauthenticated, msg),
        IamError::PermissionDenied { permission, .. } => {
            ApiError::new(Reason::PermissionDenied, msg).with("permission", permission.clone())
        }
        IamError::SandboxToken(_) => ApiError::new(Reason::PermissionDenied, msg),
        IamError::EgressCeiling { project, rule } => {
            ApiError::new(Reason::PermissionDenied, msg).with("project", project.clone()).with("rule", rule.clone())
        }
        IamError::NotFound { .. } => ApiError::new(Reason::NotFound, msg),
        IamError::AlreadyExists { .. } => ApiError::new(Reason::AlreadyExists, msg),
        IamError::MemberIdUsed(id) => ApiError::new(Reason::AlreadyExists, msg).with("id", id.to_string()),
        IamError::InvalidState(_) | IamError::Membership(_) => ApiError::new(Reason::InvalidState, msg),
        IamError::NotLeader(_) => ApiError::new(Reason::NotLeader, msg),
        IamError::QuotaExceeded { project, key, limit, used, requested } => ApiError::new(Reason::QuotaExceeded, msg)
            .with("project", project.clone())
            .with("key", *key)
            .with("limit", limit.to_string())
            .with("used", used.to_string())
            .with("requested", requested.to_string()),
        IamError::NotBootstrapped
        | IamError::Store { .. }
        | IamError::Wal { .. }
        | IamError::CorruptRow { .. }
        | IamError::RowVersion { .. }
        | IamError::DataDir { .. }
        | IamError::StoreFailed
        | IamError::CommitFailed(_)
        | IamError::Stopped
        | IamError::Raft(_)
        | IamError::Serve(_) => ApiError::new(Reason::Unavailable, msg),
        IamError::Encode { .. } | IamError::Invariant(_) => ApiError::new(Reason::Internal, msg),
    }
}

impl From<IamError> for tonic::Status {
    fn from(e: IamError) -> tonic::Status {
        to_api(&e).to_status()
    }
}
