//! Stable error reasons (DESIGN.md section 7, docs/errors.md) and their single mapping to gRPC.
//!
//! Every error that crosses a process boundary is an [`ApiError`]: a [`Reason`], a message for
//! people, and optional metadata. On the wire it is the canonical gRPC code plus
//! `google.rpc.ErrorInfo { reason, domain: "opendsec", metadata }`. Clients decide on the reason,
//! never on the message. Reasons are only ever added, never renamed.

use std::collections::HashMap;
use std::fmt;

use tonic::Code;
use tonic_types::{ErrorDetails, StatusExt};

/// The `ErrorInfo.domain` of every opendsec error.
pub const DOMAIN: &str = "opendsec";

/// Metadata of an `unavailable` answer from an edge a sandbox is moving away from: the edge it
/// is moving to (ask again shortly).
pub const MOVING_TO: &str = "moving_to";
/// Metadata of an `unavailable` answer from an edge a sandbox moved away from: where it runs.
pub const MOVED_TO: &str = "moved_to";

/// A stable, machine-readable error reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    InvalidArgument,
    Unauthenticated,
    PermissionDenied,
    NotFound,
    AlreadyExists,
    InvalidState,
    QuotaExceeded,
    RateLimited,
    NoCapacity,
    NotLeader,
    Unavailable,
    DeadlineExceeded,
    Internal,
}

impl Reason {
    /// Every reason, in catalogue order (docs/errors.md lists them in this order).
    pub const ALL: [Reason; 13] = [
        Reason::InvalidArgument,
        Reason::Unauthenticated,
        Reason::PermissionDenied,
        Reason::NotFound,
        Reason::AlreadyExists,
        Reason::InvalidState,
        Reason::QuotaExceeded,
        Reason::RateLimited,
        Reason::NoCapacity,
        Reason::NotLeader,
        Reason::Unavailable,
        Reason::DeadlineExceeded,
        Reason::Internal,
    ];

    /// The wire spelling: lowercase snake case.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::InvalidArgument => "invalid_argument",
            Reason::Unauthenticated => "unauthenticated",
            Reason::PermissionDenied => "permission_denied",
            Reason::NotFound => "not_found",
            Reason::AlreadyExists => "already_exists",
            Reason::InvalidState => "invalid_state",
            Reason::QuotaExceeded => "quota_exceeded",
            Reason::RateLimited => "rate_limited",
            Reason::NoCapacity => "no_capacity",
            Reason::NotLeader => "not_leader",
            Reason::Unavailable => "unavailable",
            Reason::DeadlineExceeded => "deadline_exceeded",
            Reason::Internal => "internal",
        }
    }

    pub fn parse(s: &str) -> Option<Reason> {
        Reason::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// The canonical gRPC code carried with the reason.
    pub fn code(self) -> Code {
        match self {
            Reason::InvalidArgument => Code::InvalidArgument,
            Reason::Unauthenticated => Code::Unauthenticated,
            Reason::PermissionDenied => Code::PermissionDenied,
            Reason::NotFound => Code::NotFound,
            Reason::AlreadyExists => Code::AlreadyExists,
            Reason::InvalidState => Code::FailedPrecondition,
            Reason::QuotaExceeded | Reason::RateLimited | Reason::NoCapacity => Code::ResourceExhausted,
            Reason::NotLeader | Reason::Unavailable => Code::Unavailable,
            Reason::DeadlineExceeded => Code::DeadlineExceeded,
            Reason::Internal => Code::Internal,
        }
    }

    /// The exit code `opendsecctl` uses for this reason (stable; docs/errors.md).
    pub fn exit_code(self) -> i32 {
        match self {
            Reason::InvalidArgument => 10,
            Reason::Unauthenticated => 11,
            Reason::PermissionDenied => 12,
            Reason::NotFound => 13,
            Reason::AlreadyExists => 14,
            Reason::InvalidState => 15,
            Reason::QuotaExceeded => 16,
            Reason::RateLimited => 17,
            Reason::NoCapacity => 18,
            Reason::NotLeader => 19,
            Reason::Unavailable => 20,
            Reason::DeadlineExceeded => 21,
            Reason::Internal => 22,
        }
    }

    /// The reason a bare gRPC code implies, for statuses that carry no ErrorInfo (transport
    /// errors, other servers). RESOURCE_EXHAUSTED without details is taken as `rate_limited`.
    pub fn from_code(code: Code) -> Reason {
        match code {
            Code::InvalidArgument | Code::OutOfRange => Reason::InvalidArgument,
            Code::Unauthenticated => Reason::Unauthenticated,
            Code::PermissionDenied => Reason::PermissionDenied,
            Code::NotFound => Reason::NotFound,
            Code::AlreadyExists => Reason::AlreadyExists,
            Code::FailedPrecondition | Code::Aborted => Reason::InvalidState,
            Code::ResourceExhausted => Reason::RateLimited,
            Code::Unavailable | Code::Cancelled => Reason::Unavailable,
            Code::DeadlineExceeded => Reason::DeadlineExceeded,
            Code::Ok | Code::Unknown | Code::Unimplemented | Code::Internal | Code::DataLoss => Reason::Internal,
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An error as it crosses a process boundary.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ApiError {
    pub reason: Reason,
    pub message: String,
    pub metadata: HashMap<String, String>,
}

impl ApiError {
    pub fn new(reason: Reason, message: impl Into<String>) -> ApiError {
        ApiError { reason, message: message.into(), metadata: HashMap::new() }
    }

    pub fn with(mut self, key: &str, value: impl Into<String>) -> ApiError {
        self.metadata.insert(key.to_string(), value.into());
        self
    }

    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(Reason::InvalidArgument, message)
    }
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(Reason::NotFound, message)
    }
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(Reason::Unavailable, message)
    }
    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(Reason::Internal, message)
    }
    pub fn denied(message: impl Into<String>) -> ApiError {
        ApiError::new(Reason::PermissionDenied, message)
    }

    /// Reads the reason back from a status (its ErrorInfo, else the bare code).
    pub fn from_status(status: &tonic::Status) -> ApiError {
        let details = status.get_error_details();
        if let Some(info) = details.error_info()
            && info.domain == DOMAIN
            && let Some(reason) = Reason::parse(&info.reason)
        {
            return ApiError { reason, message: status.message().to_string(), metadata: info.metadata.clone() };
        }
        ApiError::new(Reason::from_code(status.code()), status.message().to_string())
    }

    pub fn to_status(&self) -> tonic::Status {
        let details = ErrorDetails::with_error_info(self.reason.as_str(), DOMAIN, self.metadata.clone());
        tonic::Status::with_error_details(self.reason.code(), self.message.clone(), details)
    }

    /// The form used inside streamed and batched answers.
    pub fn to_detail(&self) -> opendsec_proto::v1::ErrorDetail {
        opendsec_proto::v1::ErrorDetail { reason: self.reason.as_str().to_string(), message: self.message.clone() }
    }

    pub fn from_detail(d: &opendsec_proto::v1::ErrorDetail) -> ApiError {
        ApiError::new(Reason::parse(&d.reason).unwrap_or(Reason::Internal), d.message.clone())
    }
}

impl fmt::Display for ApiError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.reason, self.message)
    }
}

impl std::error::Error for ApiError {}

impl From<ApiError> for tonic::Status {
    fn from(e: ApiError) -> tonic::Status {
        e.to_status()
    }
}

impl From<tonic::Status> for ApiError {
    fn from(s: tonic::Status) -> ApiError {
        ApiError::from_status(&s)
    }
}

/// An error and its causes on one line, `a: b: c` (a cause whose text the line already ends
/// with is not repeated): what logs and public messages show of a typed error, whose
/// `Display` says only its own part.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let s = c.to_string();
        if !out.ends_with(&s) {
            out.push_str(": ");
            out.push_str(&s);
        }
        cur = c.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_round_trips_through_a_status() {
        for r in Reason::ALL {
            let e = ApiError::new(r, "boom").with("edge", "e1");
            let back = ApiError::from_status(&e.to_status());
            assert_eq!(back, e, "{r}");
            assert_eq!(Reason::parse(r.as_str()), Some(r));
        }
    }

    #[test]
    fn exit_codes_are_distinct() {
        let mut codes: Vec<i32> = Reason::ALL.iter().map(|r| r.exit_code()).collect();
        codes.sort_unstable();
        codes.dedup();
        assert_eq!(codes.len(), Reason::ALL.len());
    }

    #[test]
    fn a_status_without_error_info_falls_back_to_its_code() {
        let s = tonic::Status::unavailable("connection refused");
        assert_eq!(ApiError::from_status(&s).reason, Reason::Unavailable);
    }
}

#[cfg(test)]
mod catalogue {
    use super::Reason;

    /// docs/errors.md lists every reason, in order, with its gRPC code and exit code.
    #[test]
    fn the_error_doc_matches_the_catalogue() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/errors.md")).unwrap();
        // The reasons' table comes before the retry policy's.
        let doc = doc.split("\n## Retries").next().unwrap();
        let rows: Vec<Vec<String>> = doc
            .lines()
            .filter(|l| l.starts_with("| `"))
            .map(|l| l.split('|').map(|c| c.trim().to_string()).collect())
            .collect();
        assert_eq!(rows.len(), Reason::ALL.len(), "one row per reason");
        for (row, r) in rows.iter().zip(Reason::ALL) {
            assert_eq!(row[1], format!("`{}`", r.as_str()));
            let code = format!("{:?}", r.code()).to_uppercase();
            let doc_code = row[2].replace('_', "");
            assert_eq!(doc_code, code, "{r}");
            assert_eq!(row[5], r.exit_code().to_string(), "{r}");
        }
    }
}
