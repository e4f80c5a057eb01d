//! The agent's errors and their one mapping to gRPC statuses at the RPC boundary.

use std::io;

#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("unknown user {0:?} (not in the image's passwd file)")]
    UnknownUser(String),
    #[error("no such request id {0:?} in this session")]
    UnknownRequest(String),
    #[error("the output of request {0:?} was evicted (session output budget)")]
    Evicted(String),
    #[error("no such process {0}")]
    UnknownProcess(String),
    #[error("code kernel: {0}")]
    Kernel(String),
    #[error("no such code context {0:?}")]
    UnknownContext(String),
    #[error("no such watcher {0:?} in this session")]
    UnknownWatcher(String),
    #[error("tag {0:?} is in use by a running process")]
    TagInUse(String),
    #[error("{op} {path}: {source}")]
    Fs { op: &'static str, path: String, source: io::Error },
    #[error("starting {what}: {source}")]
    Spawn { what: String, source: io::Error },
    #[error("session shell: {0}")]
    Shell(io::Error),
    #[error("session {0:?} is unavailable: {1}")]
    Session(String, String),
    #[error("http request: {0}")]
    Http(String),
    /// Nothing accepts connections on the port (a closed port is the sandbox's state, not an
    /// agent or node that cannot serve: retrying at once does not help).
    #[error("nothing listens on port {0} in the sandbox")]
    PortClosed(u16),
    #[error("not supported yet: {0}")]
    Unsupported(&'static str),
}

impl AgentError {
    pub fn fs(op: &'static str, path: &std::path::Path, source: io::Error) -> Self {
        AgentError::Fs { op, path: path.display().to_string(), source }
    }
}

impl From<AgentError> for tonic::Status {
    fn from(e: AgentError) -> Self {
        let msg = e.to_string();
        match &e {
            AgentError::Invalid(_) => tonic::Status::invalid_argument(msg),
            AgentError::UnknownUser(_) => tonic::Status::invalid_argument(msg),
            AgentError::UnknownRequest(_)
            | AgentError::UnknownProcess(_)
            | AgentError::UnknownWatcher(_)
            | AgentError::UnknownContext(_) => tonic::Status::not_found(msg),
            AgentError::Evicted(_) => tonic::Status::out_of_range(msg),
            AgentError::TagInUse(_) => tonic::Status::already_exists(msg),
            AgentError::Fs { source, .. } => match source.kind() {
                io::ErrorKind::NotFound => tonic::Status::not_found(msg),
                io::ErrorKind::PermissionDenied => tonic::Status::permission_denied(msg),
                io::ErrorKind::AlreadyExists => tonic::Status::already_exists(msg),
                io::ErrorKind::InvalidInput
                | io::ErrorKind::NotADirectory
                | io::ErrorKind::IsADirectory
                | io::ErrorKind::DirectoryNotEmpty => tonic::Status::failed_precondition(msg),
                _ => tonic::Status::internal(msg),
            },
            AgentError::Spawn { .. } | AgentError::Shell(_) => tonic::Status::internal(msg),
            AgentError::Session(..) => tonic::Status::unavailable(msg),
            AgentError::Http(_) => tonic::Status::unavailable(msg),
            AgentError::PortClosed(_) => tonic::Status::failed_precondition(msg),
            AgentError::Kernel(_) => tonic::Status::failed_precondition(msg),
            AgentError::Unsupported(_) => tonic::Status::unimplemented(msg),
        }
    }
}

/// Session and request ids: `[A-Za-z0-9._-]`, 1..=128, not `.`/`..` (they name files).
pub fn check_id(kind: &str, id: &str) -> Result<(), AgentError> {
    let ok = !id.is_empty()
        && id.len() <= 128
        && id != "."
        && id != ".."
        && id.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok { Ok(()) } else { Err(AgentError::Invalid(format!("{kind} {id:?} must be 1-128 of [A-Za-z0-9._-]"))) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids() {
        assert!(check_id("s", "abc-1.2_x").is_ok());
        for bad in ["", ".", "..", "a/b", "a b", &"x".repeat(129)] {
            assert!(check_id("s", bad).is_err(), "{bad}");
        }
    }
}
