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

/// Metadata of an error the peer did not answer with (a status without our `ErrorInfo`: the
/// connection failed or was refused, a proxy or the gRPC layer answered): whether the call
/// took effect is unknown. A creation whose last edge call went unanswered keeps its lease
/// where it was sent. It says so of one hop only: an error served on to a caller (as a status
/// or a batch item's detail) was answered, and goes without it.
pub const NO_ANSWER: &str = "no_answer";

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
        // The connection failed under the call (the peer died, or reset it): no answer came,
        // as when the peer cannot be reached at all.
        let reason = if status.code() == tonic::Code::Unknown
            && std::error::Error::source(status).is_some_and(|s| s.is::<tonic::transport::Error>())
        {
            Reason::Unavailable
        } else {
            Reason::from_code(status.code())
        };
        ApiError::new(reason, status.message().to_string()).with(NO_ANSWER, "true")
    }

    pub fn to_status(&self) -> tonic::Status {
        let details = ErrorDetails::with_error_info(self.reason.as_str(), DOMAIN, self.served_metadata());
        tonic::Status::with_error_details(self.reason.code(), self.message.clone(), details)
    }

    /// The form used inside streamed and batched answers.
    pub fn to_detail(&self) -> opendsec_proto::v1::ErrorDetail {
        opendsec_proto::v1::ErrorDetail {
            reason: self.reason.as_str().to_string(),
            message: self.message.clone(),
            metadata: self.served_metadata(),
        }
    }

    /// The metadata a caller is answered with: all but [`NO_ANSWER`], which is this hop's.
    fn served_metadata(&self) -> HashMap<String, String> {
        self.metadata.iter().filter(|(k, _)| k.as_str() != NO_ANSWER).map(|(k, v)| (k.clone(), v.clone())).collect()
    }

    pub fn from_detail(d: &opendsec_proto::v1::ErrorDetail) -> ApiError {
        let mut e = ApiError::new(Reason::parse(&d.reason).unwrap_or(Reason::Internal), d.message.clone());
        e.metadata = d.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        e
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
            assert_eq!(ApiError::from_detail(&e.to_detail()), e, "{r}: inside a batched answer");
            assert_eq!(Reason::parse(r.as_str()), Some(r));
        }
    }

    /// A call whose connection fails under it (here: the peer reads the call's first bytes
    /// and closes the connection, as a peer killed mid-call does) has no answer from the
    /// peer: `unavailable`, which callers retry or take elsewhere, not `internal`; marked as
    /// unanswered, as is every status without our `ErrorInfo`. A bare `internal` or `unknown`
    /// stays `internal`; an answer of ours is not marked.
    #[tokio::test]
    async fn a_connection_that_fails_under_a_call_is_unavailable() {
        use tokio::io::AsyncReadExt;
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                let mut buf = [0u8; 64];
                let _ = s.read(&mut buf).await;
            }
        });
        let ch = tonic::transport::Endpoint::from_shared(format!("http://{addr}")).unwrap().connect_lazy();
        let st = opendsec_proto::v1::iam_client::IamClient::new(ch)
            .get_epoch(opendsec_proto::v1::GetEpochRequest::default())
            .await
            .unwrap_err();
        assert_eq!((st.code(), st.message()), (tonic::Code::Unknown, "transport error"), "{st:?}");
        let e = ApiError::from_status(&st);
        assert_eq!((e.reason, e.metadata.get(NO_ANSWER).map(String::as_str)), (Reason::Unavailable, Some("true")));
        assert_eq!(ApiError::from_status(&tonic::Status::internal("transport error")).reason, Reason::Internal);
        assert_eq!(ApiError::from_status(&tonic::Status::unknown("boom")).reason, Reason::Internal);
        assert!(ApiError::from_status(&tonic::Status::unavailable("refused")).metadata.contains_key(NO_ANSWER));
        let ours = ApiError::unavailable("the edge is restarting").to_status();
        assert!(!ApiError::from_status(&ours).metadata.contains_key(NO_ANSWER));
        // Served on (the apiserver answering with an edge's silence), it was answered.
        let relayed = e.clone().with("edge", "e1");
        let served = ApiError::from_status(&relayed.to_status());
        assert_eq!((served.reason, served.metadata.get("edge").map(String::as_str)), (Reason::Unavailable, Some("e1")));
        assert!(!served.metadata.contains_key(NO_ANSWER), "{served:?}");
        assert!(!ApiError::from_detail(&relayed.to_detail()).metadata.contains_key(NO_ANSWER));
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
