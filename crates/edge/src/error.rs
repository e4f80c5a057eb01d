//! The edge's errors and their one mapping to [`ApiError`] at the RPC boundary.
//!
//! Errors that mean "this node cannot serve now" (a record that cannot be written, a shutdown)
//! become `unavailable`, so the apiserver retries elsewhere.

use opendsec_common::{ApiError, Reason};

use crate::backend::BackendError;
use crate::record::RecordError;
use crate::state::SandboxStatus;

/// What a call refused during a move is told to wait before asking again.
pub const MOVING_RETRY_MS: u64 = 50;

#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("sandbox {id} not found on edge {edge}")]
    NotFound { id: String, edge: String },
    #[error("sandbox {id} is {state}: cannot {op}")]
    InvalidState { id: String, state: SandboxStatus, op: &'static str },
    #[error("edge {edge} has no capacity: {detail}")]
    NoCapacity { edge: String, detail: String },
    #[error("backend {backend} failed to {op} sandbox {id}: {}", .source.report())]
    Backend {
        backend: &'static str,
        op: &'static str,
        id: String,
        #[source]
        source: BackendError,
    },
    #[error(transparent)]
    Record(#[from] RecordError),
    /// A move to another edge is under way: the caller waits and asks again (it then finds
    /// the sandbox moved, or back).
    #[error("sandbox {id} is moving to edge {to}: try again shortly")]
    Moving { id: String, to: String },
    /// The sandbox runs on another edge now.
    #[error("sandbox {id} moved to edge {to}")]
    Moved { id: String, to: String },
    #[error("edge {edge} is shutting down")]
    ShuttingDown { edge: String },
    #[error("{op} did not finish: {message}")]
    TaskFailed { op: &'static str, message: String },
    #[error("invalid edge options: {0}")]
    Options(String),
    #[error("failed to serve the edge: {0}")]
    Serve(#[from] tonic::transport::Error),
    #[error("the edge's network: {0}")]
    NetworkSetup(#[source] crate::netpol::NetworkError),
    #[error("network of sandbox {id}: {source}")]
    Network {
        id: String,
        #[source]
        source: crate::netpol::NetworkError,
    },
}

impl EdgeError {
    pub fn reason(&self) -> Reason {
        match self {
            EdgeError::InvalidArgument(_) => Reason::InvalidArgument,
            EdgeError::NotFound { .. } => Reason::NotFound,
            EdgeError::InvalidState { .. } => Reason::InvalidState,
            EdgeError::NoCapacity { .. } => Reason::NoCapacity,
            EdgeError::Backend { source, .. } => source.reason(),
            EdgeError::Record(_) | EdgeError::ShuttingDown { .. } | EdgeError::Serve(_) => Reason::Unavailable,
            EdgeError::Moving { .. } | EdgeError::Moved { .. } => Reason::Unavailable,
            EdgeError::TaskFailed { .. } | EdgeError::Options(_) => Reason::Internal,
            EdgeError::NetworkSetup(_) => Reason::Unavailable,
            EdgeError::Network { source, .. } => {
                use crate::netpol::NetworkError as N;
                match source {
                    N::Rule(_) => Reason::InvalidArgument,
                    N::NotAttached(_) => Reason::InvalidState,
                    N::Exhausted(_) => Reason::NoCapacity,
                    N::TooManyLearned { .. } => Reason::QuotaExceeded,
                    N::Netlink(_) | N::Nft { .. } | N::SubnetInUse { .. } | N::Io { .. } | N::TableInUse { .. } => {
                        Reason::Unavailable
                    }
                }
            }
        }
    }

    pub fn to_api(&self) -> ApiError {
        let e = ApiError::new(self.reason(), self.to_string());
        match self {
            EdgeError::InvalidState { state, .. } => e.with("state", state.as_str()),
            EdgeError::NoCapacity { edge, .. } | EdgeError::ShuttingDown { edge } => e.with("edge", edge.clone()),
            EdgeError::Backend { backend, .. } => e.with("backend", *backend),
            EdgeError::Moving { to, .. } => e
                .with(opendsec_common::reason::MOVING_TO, to.clone())
                .with("retry_after_ms", MOVING_RETRY_MS.to_string()),
            EdgeError::Moved { to, .. } => e.with(opendsec_common::reason::MOVED_TO, to.clone()),
            _ => e,
        }
    }
}

impl From<EdgeError> for tonic::Status {
    fn from(e: EdgeError) -> tonic::Status {
        e.to_api().to_status()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn invalid_state_names_the_state_found() {
        let e = EdgeError::InvalidState { id: "e.l".into(), state: SandboxStatus::Paused, op: "pause" };
        let api = e.to_api();
        assert_eq!(api.reason, Reason::InvalidState);
        assert!(api.message.contains("PAUSED"), "{}", api.message);
        assert_eq!(api.metadata.get("state").map(String::as_str), Some("PAUSED"));
    }

    #[test]
    fn backend_errors_keep_their_reason_and_records_mean_unavailable() {
        let e = EdgeError::Backend {
            backend: "sim",
            op: "create",
            id: "e.l".into(),
            source: BackendError::no_capacity("full"),
        };
        assert_eq!(e.reason(), Reason::NoCapacity);
        let e = EdgeError::Record(RecordError::Join { lease: "l".into(), message: "x".into() });
        assert_eq!(e.reason(), Reason::Unavailable);
    }
}
