//! One in-sandbox request: the caller's client, the sandbox, the user; and what every
//! in-sandbox call shares (the session of a user, paths, "is the sandbox gone?").

use std::sync::Arc;

use axum::response::Response;
use opendsec_client::Client;
use opendsec_common::{ApiError, Reason};
use opendsec_proto::v1 as pb;

use crate::connect::{Code, ConnectError};
use crate::{Gateway, error};

/// One in-sandbox request's context: the caller's client, the sandbox, the user.
pub(crate) struct Ctx {
    pub gw: Arc<Gateway>,
    pub client: Client,
    pub id: String,
    /// The user named by the call (`""`: the sandbox's default user).
    pub user: String,
}

impl Ctx {
    /// The session file calls go through: one per user, so what they make is the user's.
    pub fn session(&self) -> String {
        if self.user.is_empty() { "e2b".to_string() } else { format!("e2b-{}", self.user) }
    }

    /// Whether the sandbox is gone for this caller (unknown, not theirs, stopped, failed, or
    /// paused: a call fails in a paused sandbox only when it waits for connect): then E2B's
    /// proxy answer, 502 "The sandbox was not found", is the right one.
    pub async fn gone(&self) -> bool {
        sandbox_gone(&self.client, &self.id).await
    }

    /// A failed call's answer: the proxy's 502 when the sandbox is gone, else the Connect
    /// error.
    pub async fn fail(&self, e: &ApiError) -> Response {
        if self.may_be_gone(e) && self.gone().await {
            return error::sandbox_not_found(&self.id);
        }
        error::to_connect(e).unary_response()
    }

    /// Errors that a sandbox that is not there (any more) produces.
    pub fn may_be_gone(&self, e: &ApiError) -> bool {
        matches!(
            e.reason,
            Reason::NotFound
                | Reason::InvalidState
                | Reason::InvalidArgument
                | Reason::PermissionDenied
                | Reason::Unavailable
        )
    }

    /// A not_found that names the thing asked for (a pid, a path) unless the sandbox is gone.
    pub async fn not_found_or_gone(&self, e: ApiError) -> Failure {
        if e.reason == Reason::NotFound && !self.gone().await {
            return Failure::Connect(ConnectError::new(Code::NotFound, e.message));
        }
        Failure::Api(e)
    }
}

/// [`Ctx::gone`] for any holder of a client.
pub(crate) async fn sandbox_gone(client: &Client, id: &str) -> bool {
    match client.get_sandbox(id).await {
        Ok(sb) => {
            use pb::SandboxState as S;
            matches!(
                S::try_from(sb.state),
                Ok(S::Stopping | S::Stopped | S::Failed | S::Unspecified | S::Pausing | S::Paused) | Err(_)
            )
        }
        Err(e) => matches!(e.reason, Reason::NotFound | Reason::InvalidArgument | Reason::PermissionDenied),
    }
}

/// Why a call failed: an opendsec error (which may mean the sandbox is gone) or a Connect one.
pub(crate) enum Failure {
    Api(ApiError),
    Connect(ConnectError),
}

impl From<ApiError> for Failure {
    fn from(e: ApiError) -> Failure {
        Failure::Api(e)
    }
}
impl From<ConnectError> for Failure {
    fn from(e: ConnectError) -> Failure {
        Failure::Connect(e)
    }
}

/// A user name a call may give: what the image's passwd may hold and a session id may carry.
pub fn valid_user(user: &str) -> bool {
    user.len() <= 64 && user.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// `~` and `~/x` name the user's home; relative paths are resolved by the agent against the
/// session's directory, which is that home.
pub(crate) fn user_path(p: &str) -> String {
    match p {
        "~" => ".".into(),
        _ => p.strip_prefix("~/").map(str::to_string).unwrap_or_else(|| p.to_string()),
    }
}

pub(crate) async fn stat_of(ctx: &Ctx, path: &str) -> Result<pb::FileInfo, ApiError> {
    let req = pb::StatRequest {
        sandbox_id: ctx.id.clone(),
        session_id: ctx.session(),
        path: user_path(path),
        user: ctx.user.clone(),
        // E2B's file metadata rides on every description of a file.
        xattrs: true,
    };
    ctx.client.stat(req).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tilde_paths_are_the_home() {
        assert_eq!(user_path("~/a/b"), "a/b");
        assert_eq!(user_path("~"), ".");
        assert_eq!(user_path("/etc/x"), "/etc/x");
        assert_eq!(user_path("rel"), "rel");
    }
}
