//! The errors of `opendsecctl`, their exit codes, and the hints that say what to do next.

use opendsec_common::{ApiError, Reason};

/// What a command failed with: an API error (exit code by reason) or a local one.
#[derive(Debug)]
pub enum CtlError {
    Api(ApiError),
    Local(String),
}

impl From<ApiError> for CtlError {
    fn from(e: ApiError) -> Self {
        CtlError::Api(e)
    }
}

impl CtlError {
    pub fn exit_code(&self) -> i32 {
        match self {
            CtlError::Api(e) => e.reason.exit_code(),
            CtlError::Local(_) => 1,
        }
    }
}

/// What the caller had when a command failed, for [`hint`].
#[derive(Debug)]
pub struct HintContext {
    /// The apiserver addresses tried.
    pub addr: String,
    /// Whether a token was given (flag or OPENDSEC_TOKEN).
    pub has_token: bool,
}

/// What to do next about a failure, for people (printed under the error; scripts use the exit
/// code, one per reason). None where the error says it all.
pub fn hint(e: &CtlError, cx: &HintContext) -> Option<String> {
    let CtlError::Api(e) = e else {
        return None;
    };
    let meta = |k: &str| e.metadata.get(k).map(String::as_str);
    let h = match e.reason {
        // A connection that failed (the client's own error: no server said anything).
        Reason::Unavailable if ["connect", "transport", "dns", "connection"].iter().any(|w| e.message.contains(w)) => {
            format!(
                "is a cluster running at {}? `make up` starts a local one (as root); `opendsecctl cluster up` \
             a sim-only one. Point OPENDSEC_ADDR (or --addr) at its apiserver.",
                cx.addr
            )
        }
        Reason::Unavailable => "the node or sandbox cannot serve right now; retry in a moment".into(),
        Reason::Unauthenticated if !cx.has_token => "set OPENDSEC_TOKEN (a local cluster writes its admin token to \
             opendsec-state/admin.token: export OPENDSEC_TOKEN=$(cat opendsec-state/admin.token))"
            .into(),
        Reason::Unauthenticated => {
            "the token is unknown, expired or revoked: ask for a new one (`opendsecctl token create`)".into()
        }
        Reason::PermissionDenied => "`opendsecctl whoami` shows your grants; someone who administers the project \
             adds one with `opendsecctl grant add PRINCIPAL PROJECT PERMISSION`"
            .into(),
        Reason::NotFound if meta("backend").is_some() => format!(
            "no edge of this cluster runs backend {:?}: `make up` starts a container edge, \
             `opendsecctl cluster up --sim-edges N` sim edges",
            meta("backend").unwrap_or_default()
        ),
        Reason::NotFound if meta("image").is_some() => "`opendsecctl image list` shows the images the project \
             sees; `opendsecctl image import` adds one (docs/images.md)"
            .into(),
        Reason::NotFound if e.message.contains("sandbox") => {
            "`opendsecctl sandbox list` shows the sandboxes you can see (a stopped one stays listed a while)".into()
        }
        Reason::QuotaExceeded => "`opendsecctl usage PROJECT` shows quota and usage: stop sandboxes, ask for less \
             (--cpu, --memory, --disk), or raise the quota with `opendsecctl quota set`"
            .into(),
        Reason::NoCapacity => "every edge that could run it is full or under pressure: retry later, ask for \
             less CPU or memory, or add edges"
            .into(),
        Reason::RateLimited => "too many creations at once: retry after the wait the message gives, or use \
             one batch call (`sandbox create --count N`)"
            .into(),
        Reason::InvalidState if e.message.contains("sandbox") || meta("state").is_some() => {
            "`opendsecctl sandbox get ID` shows its state".into()
        }
        Reason::DeadlineExceeded => "the call may still have taken effect: check (`sandbox get`, `sandbox list`) \
             before you repeat it"
            .into(),
        Reason::Internal => "this is a bug: please report it with the message above".into(),
        Reason::InvalidArgument
        | Reason::AlreadyExists
        | Reason::InvalidState
        | Reason::NotFound
        | Reason::NotLeader => return None,
    };
    Some(h)
}

/// Reason of a failure, for callers that want it.
pub fn reason_of(e: &CtlError) -> Option<Reason> {
    match e {
        CtlError::Api(a) => Some(a.reason),
        CtlError::Local(_) => None,
    }
}

impl std::fmt::Display for CtlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CtlError::Api(e) => write!(f, "{}: {}", e.reason, e.message),
            CtlError::Local(m) => f.write_str(m),
        }
    }
}
