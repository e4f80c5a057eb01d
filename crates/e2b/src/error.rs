//! Errors in the shapes E2B's SDKs decode: `{"code": int, "message": str}` on the REST API,
//! Connect errors on envd, and the edge proxy's 502 for a sandbox that is not running.

use axum::http::{HeaderValue, StatusCode};
use axum::response::Response;
use opendsec_common::{ApiError, Reason};

use crate::connect::{self, Code, ConnectError};

/// A REST error: the status the SDK maps to the right exception, and a message.
#[derive(Debug, Clone)]
pub struct RestError {
    pub status: StatusCode,
    pub message: String,
    /// Seconds to wait before a retry (rate limits).
    pub retry_after_s: Option<u64>,
    /// Whether the SDK's retry loop may try again (429, 502-504 are retried unless told not).
    pub retry: bool,
}

impl RestError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> RestError {
        RestError { status, message: message.into(), retry_after_s: None, retry: false }
    }
    pub fn bad_request(message: impl Into<String>) -> RestError {
        RestError::new(StatusCode::BAD_REQUEST, message)
    }
    pub fn not_found(message: impl Into<String>) -> RestError {
        RestError::new(StatusCode::NOT_FOUND, message)
    }
    pub fn unauthorized(message: impl Into<String>) -> RestError {
        RestError::new(StatusCode::UNAUTHORIZED, message)
    }

    pub fn response(&self) -> Response {
        let mut r = json_error(self.status, &self.message);
        let h = r.headers_mut();
        // Only rate limits and a busy cluster are worth the SDK's automatic retry; a quota or
        // a 502 "not found" is final.
        h.insert("should-retry", HeaderValue::from_static(if self.retry { "true" } else { "false" }));
        if let Some(s) = self.retry_after_s {
            h.insert("retry-after", HeaderValue::from(s));
        }
        r
    }
}

impl From<ApiError> for RestError {
    fn from(e: ApiError) -> RestError {
        let status = match e.reason {
            Reason::InvalidArgument => StatusCode::BAD_REQUEST,
            Reason::Unauthenticated => StatusCode::UNAUTHORIZED,
            Reason::PermissionDenied => StatusCode::FORBIDDEN,
            Reason::NotFound => StatusCode::NOT_FOUND,
            Reason::AlreadyExists | Reason::InvalidState => StatusCode::CONFLICT,
            Reason::QuotaExceeded | Reason::RateLimited => StatusCode::TOO_MANY_REQUESTS,
            Reason::NoCapacity | Reason::NotLeader | Reason::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
            Reason::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            Reason::Internal => StatusCode::INTERNAL_SERVER_ERROR,
        };
        let retry =
            matches!(e.reason, Reason::RateLimited | Reason::NoCapacity | Reason::Unavailable | Reason::NotLeader);
        let retry_after_s =
            e.metadata.get("retry_after_ms").and_then(|v| v.parse::<u64>().ok()).map(|ms| ms.div_ceil(1000).max(1));
        RestError { status, message: format!("{}: {}", e.reason, e.message), retry_after_s, retry }
    }
}

/// `{"code": <status>, "message"}` with that status: the error body of E2B's REST API and of
/// envd's and the code interpreter's HTTP endpoints.
pub fn json_error(status: StatusCode, message: &str) -> Response {
    connect::json_response(status, &serde_json::json!({"code": status.as_u16(), "message": message}))
}

/// What E2B's edge proxy answers for a sandbox that is unknown, killed or paused; the SDK turns
/// "was not found" into `SandboxNotRunningException` (and `is_running()` into false).
pub fn sandbox_not_found(id: &str) -> Response {
    let body =
        serde_json::json!({"sandboxId": crate::host::e2b_id(id), "message": "The sandbox was not found", "code": 502});
    let mut r = connect::json_response(StatusCode::BAD_GATEWAY, &body);
    r.headers_mut().insert("content-type", HeaderValue::from_static("application/json; charset=utf-8"));
    r
}

/// What the proxy answers for a port nothing serves (`SandboxUnreachableException`).
pub fn port_not_open(id: &str, port: &str) -> Response {
    let body = serde_json::json!({
        "sandboxId": crate::host::e2b_id(id),
        "message": format!("The sandbox is running but port is not open (port {port})"),
        "code": 502,
    });
    connect::json_response(StatusCode::BAD_GATEWAY, &body)
}

/// An opendsec error as a Connect error (the agent's and the edge's reasons).
pub fn to_connect(e: &ApiError) -> ConnectError {
    let code = match e.reason {
        Reason::InvalidArgument => Code::InvalidArgument,
        Reason::Unauthenticated => Code::Unauthenticated,
        Reason::PermissionDenied => Code::PermissionDenied,
        Reason::NotFound => Code::NotFound,
        Reason::AlreadyExists => Code::AlreadyExists,
        // The agent's "is a directory", "not a directory": a bad argument to E2B.
        Reason::InvalidState => Code::InvalidArgument,
        Reason::QuotaExceeded | Reason::RateLimited | Reason::NoCapacity => Code::ResourceExhausted,
        Reason::NotLeader | Reason::Unavailable => Code::Unavailable,
        Reason::DeadlineExceeded => Code::DeadlineExceeded,
        Reason::Internal => Code::Internal,
    };
    ConnectError::new(code, e.message.clone())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rate_limits_are_retried_after_the_hint_and_quotas_are_not() {
        let r = RestError::from(ApiError::new(Reason::RateLimited, "slow down").with("retry_after_ms", "1500"));
        assert_eq!((r.status.as_u16(), r.retry, r.retry_after_s), (429, true, Some(2)));
        let q = RestError::from(ApiError::new(Reason::QuotaExceeded, "no more"));
        assert_eq!((q.status.as_u16(), q.retry), (429, false));
        let resp = q.response();
        assert_eq!(resp.headers()["should-retry"], "false");
    }
}
