//! The one retry policy of every client: which error reasons each class of call may retry,
//! how long to wait between attempts, and for how long in all. The Rust client follows it
//! through [`run`], the Python SDK through its copy of the same tables (`opendsec._net`), and
//! `docs/errors.md` ("Retries") states them; tests in both languages check that the three agree.
//!
//! - A call's class says what a repeat could do: a `read` changes nothing; a `create` carries a
//!   lease id, so a repeat returns the sandbox the first attempt made; a `repeat` call finds its
//!   own earlier effect (a request id, the state it asked for, a whole-file rewrite); a `once`
//!   call could apply twice and is never retried.
//! - Backoff: exponential from [`Policy::first`] doubling to [`Policy::cap`], with full jitter
//!   (a uniform draw in `[0, ceiling)`), never shorter than a `retry_after_ms` hint the error
//!   carries, and never past the total [`Policy::budget`] counted from the first attempt.

use std::future::Future;
use std::time::Duration;

use backon::Retryable;
use tokio::time::Instant;

use crate::{ApiError, Reason};

/// What repeating a call could do, and so which failures it may retry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CallClass {
    /// Changes nothing.
    Read,
    /// Makes a sandbox under a lease id: a repeat returns what the first attempt made.
    Create,
    /// Finds its own earlier effect when repeated.
    Repeat,
    /// Could apply twice: made once.
    Once,
}

impl CallClass {
    /// Every class, in the order docs/errors.md lists them.
    pub const ALL: [CallClass; 4] = [CallClass::Read, CallClass::Create, CallClass::Repeat, CallClass::Once];

    pub fn as_str(self) -> &'static str {
        match self {
            CallClass::Read => "read",
            CallClass::Create => "create",
            CallClass::Repeat => "repeat",
            CallClass::Once => "once",
        }
    }

    pub fn parse(s: &str) -> Option<CallClass> {
        CallClass::ALL.into_iter().find(|c| c.as_str() == s)
    }

    /// Whether a call of this class may be made again after failing with `reason`.
    ///
    /// `unavailable` and `not_leader` say the server did not serve the call (or may have: a
    /// repeat finds the effect); `rate_limited` says it was refused before it ran. A creation
    /// also waits out `no_capacity` (edges free up) and `deadline_exceeded` (its lease id makes
    /// the repeat find a sandbox the timed-out attempt made after all).
    pub fn retries(self, reason: Reason) -> bool {
        use Reason::*;
        match self {
            CallClass::Read | CallClass::Repeat => matches!(reason, Unavailable | NotLeader | RateLimited),
            CallClass::Create => {
                matches!(reason, Unavailable | NotLeader | RateLimited | NoCapacity | DeadlineExceeded)
            }
            CallClass::Once => false,
        }
    }
}

/// The class of every public RPC (`Service/Method`). A few calls are a different class for some
/// requests, as their clients say: an appending `WriteFile` and a `MakeDir` without `parents` are
/// `once`; an `HttpRequest` with GET or HEAD is `repeat`.
pub const CALLS: &[(&str, CallClass)] = {
    use CallClass::*;
    &[
        ("Sandboxes/CreateSandbox", Create),
        ("Sandboxes/CreateSandboxes", Create),
        ("Sandboxes/GetSandbox", Read),
        ("Sandboxes/ListSandboxes", Read),
        ("Sandboxes/StopSandbox", Repeat),
        ("Sandboxes/PauseSandbox", Repeat),
        ("Sandboxes/ResumeSandbox", Repeat),
        ("Sandboxes/SetSandboxTimeout", Repeat),
        ("Sandboxes/UpdateNetwork", Repeat),
        ("Sandboxes/GetSandboxMetrics", Read),
        ("Sandboxes/CreateSnapshot", Once),
        ("Sandboxes/ForkSandbox", Once),
        ("Sandboxes/MoveSandbox", Repeat),
        ("Sandboxes/DrainEdge", Repeat),
        ("Sandboxes/SaveSession", Repeat),
        ("Sandboxes/CreateSandboxTokens", Repeat),
        ("Admin/WhoAmI", Read),
        ("Admin/CreateProject", Once),
        ("Admin/GetProject", Read),
        ("Admin/ListProjects", Read),
        ("Admin/DeleteProject", Once),
        ("Admin/SetQuota", Repeat),
        ("Admin/SetEgressCeiling", Repeat),
        ("Admin/CreatePrincipal", Once),
        ("Admin/ListPrincipals", Read),
        ("Admin/DeletePrincipal", Once),
        ("Admin/CreateToken", Once),
        ("Admin/ListTokens", Read),
        ("Admin/RevokeToken", Repeat),
        ("Admin/Grant", Repeat),
        ("Admin/RevokeGrant", Once),
        ("Admin/ListGrants", Read),
        ("Admin/GetUsage", Read),
        ("Admin/Backup", Read),
        ("Admin/Restore", Once),
        ("Admin/IamMembers", Read),
        // Adding an id at the same address again (it promotes a learner still catching up)
        // and moving the leadership to the leader are answered as done; a removal repeated
        // after it took effect would say not_found, so it is not retried.
        ("Admin/AddIamMember", Repeat),
        ("Admin/RemoveIamMember", Once),
        ("Admin/TransferIamLeader", Repeat),
        ("Admin/CreatePool", Once),
        ("Admin/UpdatePool", Repeat),
        ("Admin/DeletePool", Once),
        ("Admin/GetPool", Read),
        ("Admin/ListPools", Read),
        ("Images/RegisterImage", Once),
        ("Images/ComposeImage", Once),
        ("Images/DeleteImage", Once),
        ("Images/ListImages", Read),
        ("Images/GetImage", Read),
        ("Runtime/Exec", Repeat),
        ("Runtime/ExecStream", Repeat),
        ("Runtime/GetOutput", Read),
        ("Runtime/CloseSession", Repeat),
        ("Runtime/ReadFile", Read),
        ("Runtime/WriteFile", Repeat),
        ("Runtime/ListDir", Read),
        ("Runtime/Stat", Read),
        ("Runtime/MakeDir", Repeat),
        ("Runtime/Remove", Once),
        ("Runtime/Move", Once),
        ("Runtime/WatchDir", Read),
        ("Runtime/CreateWatcher", Once),
        ("Runtime/GetWatcherEvents", Once),
        ("Runtime/RemoveWatcher", Repeat),
        ("Runtime/HttpRequest", Once),
        ("Runtime/StartProcess", Once),
        ("Runtime/ConnectProcess", Read),
        ("Runtime/SendInput", Once),
        ("Runtime/SignalProcess", Once),
        ("Runtime/ListProcesses", Read),
        ("Runtime/ResizeProcess", Repeat),
        ("Runtime/RunCode", Once),
        ("Runtime/CreateCodeContext", Once),
        ("Runtime/ListCodeContexts", Read),
        ("Runtime/RestartCodeContext", Once),
        ("Runtime/RemoveCodeContext", Repeat),
        ("Runtime/Watch", Read),
    ]
};

/// The class of `Service/Method`, if it is a public RPC. A `const fn`, so that a client can
/// look its calls up at compile time (`const { ... }`): no search on the call path, and a name
/// missing from [`CALLS`] fails the build.
pub const fn class_of(method: &str) -> Option<CallClass> {
    let mut i = 0;
    while i < CALLS.len() {
        if bytes_eq(CALLS[i].0.as_bytes(), method.as_bytes()) {
            return Some(CALLS[i].1);
        }
        i += 1;
    }
    None
}

/// The class of a public RPC, for use in `const` context: a name not in [`CALLS`] is a
/// compile-time error there.
pub const fn class(method: &str) -> CallClass {
    match class_of(method) {
        Some(c) => c,
        None => panic!("not a public RPC in retry::CALLS"),
    }
}

const fn bytes_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Whether a call that failed with `reason` should be tried at another replica of the same
/// service (a component calling IAM): the one it asked could not serve it.
pub fn try_elsewhere(reason: Reason) -> bool {
    matches!(reason, Reason::Unavailable | Reason::NotLeader)
}

/// Backoff and budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Policy {
    /// The ceiling of the first delay.
    pub first: Duration,
    /// The ceiling delays double up to.
    pub cap: Duration,
    /// How long, from the first attempt, a call keeps retrying (zero: never).
    pub budget: Duration,
}

impl Policy {
    pub const DEFAULT: Policy =
        Policy { first: Duration::from_millis(50), cap: Duration::from_secs(2), budget: Duration::from_secs(30) };

    pub fn with_budget(self, budget: Duration) -> Policy {
        Policy { budget, ..self }
    }

    /// The ceiling of the delay before retry number `n` (0 = the first retry).
    pub fn ceiling(&self, n: u32) -> Duration {
        self.first.saturating_mul(1u32.checked_shl(n.min(31)).unwrap_or(u32::MAX)).min(self.cap)
    }

    /// A fresh backoff whose budget starts now.
    pub fn backoff(&self) -> Backoff {
        Backoff { policy: *self, deadline: Instant::now() + self.budget, attempt: 0 }
    }
}

impl Default for Policy {
    fn default() -> Policy {
        Policy::DEFAULT
    }
}

/// The delays of one call's retries: full-jitter exponential, ending when the budget is spent.
#[derive(Debug)]
pub struct Backoff {
    policy: Policy,
    deadline: Instant,
    attempt: u32,
}

impl Backoff {
    /// What is left of the budget.
    pub fn remaining(&self) -> Duration {
        self.deadline.saturating_duration_since(Instant::now())
    }

    /// The delay before the next attempt: at least `hint` (a server's `retry_after_ms`), cut to
    /// what is left of the budget; `None` once the budget is spent.
    pub fn next_delay(&mut self, hint: Option<Duration>) -> Option<Duration> {
        let remaining = self.remaining();
        if remaining.is_zero() {
            return None;
        }
        let ceiling = self.policy.ceiling(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        let drawn = ceiling.mul_f64(rand::random::<f64>());
        Some(drawn.max(hint.unwrap_or_default()).min(remaining))
    }
}

impl Iterator for Backoff {
    type Item = Duration;
    fn next(&mut self) -> Option<Duration> {
        self.next_delay(None)
    }
}

/// The server's hint of how long to wait (`retry_after_ms` in the error's metadata).
pub fn retry_after(err: &ApiError) -> Option<Duration> {
    err.metadata.get("retry_after_ms").and_then(|v| v.parse::<u64>().ok()).map(Duration::from_millis)
}

/// Makes `attempt` and makes it again while `class` retries its error, as `policy` says.
pub async fn run<T, F, Fut>(class: CallClass, policy: Policy, attempt: F) -> Result<T, ApiError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ApiError>>,
{
    run_while(policy, |e| class.retries(e.reason), attempt).await
}

/// Like [`run`], retrying the errors `retries` accepts (a narrower rule than a class's, for a
/// call that knows more: a creation under a caller's lease id does not retry `no_capacity`).
pub async fn run_while<T, F, Fut>(
    policy: Policy,
    retries: impl Fn(&ApiError) -> bool,
    attempt: F,
) -> Result<T, ApiError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, ApiError>>,
{
    let mut attempt = attempt;
    if policy.budget.is_zero() {
        return attempt().await;
    }
    let mut backoff = policy.backoff();
    // backon drives the loop; the delay is ours (it needs the error's hint and the budget).
    (|| attempt())
        .retry(std::iter::repeat(Duration::ZERO))
        .sleep(tokio::time::sleep)
        .when(|e: &ApiError| retries(e))
        .adjust(|e: &ApiError, _| backoff.next_delay(retry_after(e)))
        .notify(|e: &ApiError, d| tracing::debug!(reason = %e.reason, message = %e.message, delay = ?d, "retrying"))
        .await
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[test]
    fn each_class_retries_what_the_docs_say() {
        // The table of docs/errors.md, "Retries": class -> reasons.
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/errors.md")).unwrap();
        let section = &doc[doc.find("## Retries").expect("docs/errors.md has a Retries section")..];
        let section = &section[..section[3..].find("\n## ").map_or(section.len(), |i| i + 3)];
        let mut seen = Vec::new();
        for line in section.lines().filter(|l| l.starts_with("| `")) {
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            let name = cells[1].trim_matches('`');
            if let Some(class) = CallClass::parse(name) {
                let listed: Vec<&str> = cells[2]
                    .split(',')
                    .map(|s| s.trim().trim_matches('`'))
                    .filter(|s| !s.is_empty() && *s != "none")
                    .collect();
                let ours: Vec<&str> =
                    Reason::ALL.into_iter().filter(|r| class.retries(*r)).map(Reason::as_str).collect();
                assert_eq!(listed, ours, "class {name}");
                seen.push(class);
            } else {
                let class = CallClass::parse(cells[2].trim_matches('`')).unwrap_or_else(|| panic!("{line}"));
                assert_eq!(class_of(name), Some(class), "{name}");
                seen.push(class);
            }
        }
        for class in CallClass::ALL {
            assert!(seen.contains(&class), "docs list class {class:?}");
        }
        let documented = section.lines().filter(|l| l.starts_with("| `") && l.contains('/')).count();
        assert_eq!(documented, CALLS.len(), "every call is documented once");
    }

    #[test]
    fn every_public_rpc_has_a_class() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../proto/opendsec/v1/");
        let mut rpcs = Vec::new();
        for file in ["opendsec.proto", "runtime.proto"] {
            let text = std::fs::read_to_string(format!("{root}{file}")).unwrap();
            let mut service = "";
            for line in text.lines().map(str::trim) {
                if let Some(rest) = line.strip_prefix("service ") {
                    service = rest.split_whitespace().next().unwrap();
                } else if service == "AgentControl" {
                    // The edge's own service of the agent, not public: no client calls it.
                    continue;
                } else if let Some(rest) = line.strip_prefix("rpc ") {
                    rpcs.push(format!("{service}/{}", rest.split('(').next().unwrap().trim()));
                }
            }
        }
        let ours: Vec<String> = CALLS.iter().map(|(m, _)| m.to_string()).collect();
        assert_eq!(rpcs, ours);
    }

    #[test]
    fn lookups_find_every_call_and_nothing_else() {
        for (m, c) in CALLS {
            assert_eq!(class_of(m), Some(*c), "{m}");
        }
        assert_eq!(class_of("Runtime/Exe"), None);
        assert_eq!(class_of("Runtime/Execs"), None);
        assert_eq!(class_of(""), None);
        const EXEC: CallClass = class("Runtime/Exec");
        assert_eq!(EXEC, CallClass::Repeat);
    }

    #[test]
    fn once_never_retries_and_create_retries_the_most() {
        for r in Reason::ALL {
            assert!(!CallClass::Once.retries(r));
            assert_eq!(CallClass::Read.retries(r), CallClass::Repeat.retries(r));
            if CallClass::Read.retries(r) {
                assert!(CallClass::Create.retries(r));
            }
        }
        for r in [Reason::InvalidArgument, Reason::PermissionDenied, Reason::QuotaExceeded, Reason::Internal] {
            assert!(!CallClass::Create.retries(r), "{r}");
        }
    }

    #[test]
    fn ceilings_double_up_to_the_cap() {
        let p = Policy::DEFAULT;
        let ms: Vec<u128> = (0..8).map(|n| p.ceiling(n).as_millis()).collect();
        assert_eq!(ms, [50, 100, 200, 400, 800, 1600, 2000, 2000]);
        assert_eq!(p.ceiling(u32::MAX), p.cap);
    }

    #[tokio::test(start_paused = true)]
    async fn delays_are_jittered_below_the_ceiling_hinted_and_bounded_by_the_budget() {
        let p = Policy::DEFAULT.with_budget(Duration::from_secs(10));
        let mut b = p.backoff();
        let delays: Vec<Duration> = (0..64).map_while(|_| b.next_delay(None)).collect();
        assert_eq!(delays.len(), 64, "the budget is not spent while no time passes");
        for (n, d) in delays.iter().enumerate() {
            assert!(*d < p.ceiling(n as u32), "{n}: {d:?}");
        }
        assert!(delays.windows(2).any(|w| w[0] != w[1]), "jittered");
        let mut b = p.backoff();
        assert_eq!(b.next_delay(Some(Duration::from_secs(3))), Some(Duration::from_secs(3)));
        assert_eq!(b.next_delay(Some(Duration::from_secs(60))), Some(Duration::from_secs(10)), "cut to the budget");
        tokio::time::advance(Duration::from_secs(10)).await;
        assert_eq!(b.next_delay(None), None);
    }

    #[tokio::test(start_paused = true)]
    async fn run_retries_its_class_within_the_budget_and_honours_the_hint() {
        let tries = AtomicU32::new(0);
        let start = Instant::now();
        let out = run(CallClass::Read, Policy::DEFAULT, || async {
            match tries.fetch_add(1, Ordering::SeqCst) {
                0 => Err(ApiError::new(Reason::RateLimited, "slow down").with("retry_after_ms", "1500")),
                1 => Err(ApiError::unavailable("restarting")),
                _ => Ok(7),
            }
        })
        .await;
        assert_eq!(out, Ok(7));
        assert_eq!(tries.load(Ordering::SeqCst), 3);
        assert!(start.elapsed() >= Duration::from_millis(1500), "waited out the hint: {:?}", start.elapsed());

        // A reason the class does not retry: one attempt.
        let tries = AtomicU32::new(0);
        let err = run(CallClass::Read, Policy::DEFAULT, || async {
            tries.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(ApiError::new(Reason::NoCapacity, "full"))
        })
        .await
        .unwrap_err();
        assert_eq!((err.reason, tries.load(Ordering::SeqCst)), (Reason::NoCapacity, 1));

        // Once: one attempt whatever the reason.
        let tries = AtomicU32::new(0);
        let _ = run(CallClass::Once, Policy::DEFAULT, || async {
            tries.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(ApiError::unavailable("down"))
        })
        .await;
        assert_eq!(tries.load(Ordering::SeqCst), 1);

        // A failure that lasts: the call gives up when the budget is spent, not before.
        let tries = AtomicU32::new(0);
        let start = Instant::now();
        let err = run(CallClass::Create, Policy::DEFAULT.with_budget(Duration::from_secs(5)), || async {
            tries.fetch_add(1, Ordering::SeqCst);
            Err::<(), _>(ApiError::new(Reason::NoCapacity, "full"))
        })
        .await
        .unwrap_err();
        assert_eq!(err.reason, Reason::NoCapacity);
        assert!(tries.load(Ordering::SeqCst) > 3);
        let spent = start.elapsed();
        assert!(spent >= Duration::from_secs(5) && spent < Duration::from_secs(8), "{spent:?}");
    }
}
