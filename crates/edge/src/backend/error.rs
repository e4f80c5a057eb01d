//! Why a backend call failed: a [`Kind`] that maps to one public reason, the context the
//! backend adds, the error that caused it (kept whole, as a `source` chain), and, when undoing
//! a half-done call failed too, that cleanup failure beside the original one.

use std::error::Error as StdError;
use std::fmt;
use std::sync::Arc;

use opendsec_common::Reason;

/// What kind of failure, and so which public reason it surfaces as.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    /// The node cannot hold this sandbox right now (another node may).
    NoCapacity,
    /// The sandbox is not in a state that allows the call.
    InvalidState,
    /// The backend knows no such sandbox (or image, layer).
    NotFound,
    /// The spec asks for something this backend cannot do.
    InvalidArgument,
    /// The backend cannot serve now (its runtime is down, a timeout); retrying may work.
    Unavailable,
    /// A broken invariant or an unexpected failure of the backend.
    Internal,
}

impl Kind {
    pub fn reason(self) -> Reason {
        match self {
            Kind::NoCapacity => Reason::NoCapacity,
            Kind::InvalidState => Reason::InvalidState,
            Kind::NotFound => Reason::NotFound,
            Kind::InvalidArgument => Reason::InvalidArgument,
            Kind::Unavailable => Reason::Unavailable,
            Kind::Internal => Reason::Internal,
        }
    }

    /// The kind closest to `reason` (test hooks and fakes inject failures by reason).
    pub fn from_reason(reason: Reason) -> Kind {
        match reason {
            Reason::NoCapacity | Reason::QuotaExceeded | Reason::RateLimited => Kind::NoCapacity,
            Reason::InvalidState | Reason::AlreadyExists => Kind::InvalidState,
            Reason::NotFound => Kind::NotFound,
            Reason::InvalidArgument => Kind::InvalidArgument,
            Reason::Unavailable | Reason::NotLeader | Reason::DeadlineExceeded => Kind::Unavailable,
            Reason::Unauthenticated | Reason::PermissionDenied | Reason::Internal => Kind::Internal,
        }
    }
}

type Cause = Arc<dyn StdError + Send + Sync + 'static>;

/// A failed backend call. `Display` is the context (and a cleanup failure, if any); the cause
/// is [`StdError::source`]; [`BackendError::report`] renders the whole chain in one line.
#[derive(Clone, Debug)]
pub struct BackendError(Box<Inner>);

#[derive(Clone, Debug)]
struct Inner {
    kind: Kind,
    context: String,
    cause: Option<Cause>,
    cleanup: Option<BackendError>,
}

impl BackendError {
    pub fn new(kind: Kind, context: impl Into<String>) -> BackendError {
        BackendError(Box::new(Inner { kind, context: context.into(), cause: None, cleanup: None }))
    }

    pub fn no_capacity(context: impl Into<String>) -> BackendError {
        BackendError::new(Kind::NoCapacity, context)
    }
    pub fn invalid_state(context: impl Into<String>) -> BackendError {
        BackendError::new(Kind::InvalidState, context)
    }
    pub fn not_found(context: impl Into<String>) -> BackendError {
        BackendError::new(Kind::NotFound, context)
    }
    pub fn invalid_argument(context: impl Into<String>) -> BackendError {
        BackendError::new(Kind::InvalidArgument, context)
    }
    pub fn unavailable(context: impl Into<String>) -> BackendError {
        BackendError::new(Kind::Unavailable, context)
    }
    pub fn internal(context: impl Into<String>) -> BackendError {
        BackendError::new(Kind::Internal, context)
    }

    /// An error of the kind closest to `reason`.
    pub fn from_reason(reason: Reason, context: impl Into<String>) -> BackendError {
        BackendError::new(Kind::from_reason(reason), context)
    }

    /// `self`, caused by `cause`.
    pub fn caused_by(mut self, cause: impl StdError + Send + Sync + 'static) -> BackendError {
        self.0.cause = Some(Arc::new(cause));
        self
    }

    /// `self`, with the failure of undoing what the call had done so far.
    pub fn with_cleanup(mut self, cleanup: BackendError) -> BackendError {
        self.0.cleanup = Some(cleanup);
        self
    }

    pub fn kind(&self) -> Kind {
        self.0.kind
    }

    /// The public reason this error surfaces as.
    pub fn reason(&self) -> Reason {
        self.0.kind.reason()
    }

    pub fn context(&self) -> &str {
        &self.0.context
    }

    /// The failure of the cleanup after this error, if there was one.
    pub fn cleanup(&self) -> Option<&BackendError> {
        self.0.cleanup.as_ref()
    }

    /// The context, every cause in turn, and the cleanup failure: one line for logs and for
    /// the message of the public error.
    pub fn report(&self) -> String {
        let mut out = self.0.context.clone();
        if let Some(c) = self.0.cause.as_deref() {
            out.push_str(": ");
            out.push_str(&opendsec_common::reason::error_chain(c));
        }
        if let Some(c) = &self.0.cleanup {
            out.push_str("; cleaning up also failed: ");
            out.push_str(&c.report());
        }
        out
    }
}

impl fmt::Display for BackendError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.context)?;
        if let Some(c) = &self.0.cleanup {
            write!(f, "; cleaning up also failed: {}", c.report())?;
        }
        Ok(())
    }
}

impl StdError for BackendError {
    fn source(&self) -> Option<&(dyn StdError + 'static)> {
        self.0.cause.as_deref().map(|c| c as _)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_round_trip_for_backend_kinds() {
        for r in [
            Reason::NoCapacity,
            Reason::InvalidState,
            Reason::NotFound,
            Reason::InvalidArgument,
            Reason::Unavailable,
            Reason::Internal,
        ] {
            assert_eq!(BackendError::from_reason(r, "x").reason(), r);
        }
    }

    #[test]
    fn the_cause_stays_a_source_and_the_cleanup_failure_is_kept_beside_it() {
        let io = std::io::Error::new(std::io::ErrorKind::PermissionDenied, "EACCES on /sys/fs/cgroup/x");
        let e = BackendError::internal("cannot create the cgroup of sbx-1")
            .caused_by(io)
            .with_cleanup(BackendError::unavailable("cannot detach loop7").caused_by(std::io::Error::other("EBUSY")));
        assert_eq!(e.kind(), Kind::Internal);
        let source = e.source().expect("a source");
        assert_eq!(
            source.downcast_ref::<std::io::Error>().map(|e| e.kind()),
            Some(std::io::ErrorKind::PermissionDenied)
        );
        assert_eq!(e.cleanup().map(BackendError::kind), Some(Kind::Unavailable));
        assert_eq!(
            e.report(),
            "cannot create the cgroup of sbx-1: EACCES on /sys/fs/cgroup/x; cleaning up also failed: cannot detach loop7: EBUSY"
        );
        assert_eq!(
            e.to_string(),
            "cannot create the cgroup of sbx-1; cleaning up also failed: cannot detach loop7: EBUSY"
        );
    }
}
