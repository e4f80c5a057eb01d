//! The gateway's own defence against guessing: failed authentications counted per caller (a
//! source address, as the apiserver counts its callers), and a caller with too many of them
//! paused (`e2b.auth_failures`): answered 401 without a call to the apiserver, unless it
//! brings a key that authenticated lately (one address may be a proxy or a NAT that many
//! clients share; the pause is against guessing, not against them). The apiserver counts the
//! same callers again, by the address the gateway names to it
//! ([`opendsec_common::grpc::CLIENT_ADDR_HEADER`]): a flood of bad keys from one client
//! pauses that client, never the gateway every E2B user shares.
//!
//! Keys are never kept: a key that authenticated is remembered as its SHA-256.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::http::HeaderMap;
use opendsec_common::auth_failures::FailureTracker;
use opendsec_common::config::AuthFailureConfig;
use sha2::{Digest, Sha256};

/// How long a key that authenticated is let through a paused source.
const KNOWN_TTL: Duration = Duration::from_secs(30);
/// Keys remembered at most (past it, expired ones go; then all).
const MAX_KNOWN: usize = 100_000;

/// What the gateway knows of its callers.
#[derive(Debug)]
pub(crate) struct Callers {
    failures: FailureTracker,
    known: Mutex<HashMap<[u8; 32], Instant>>,
}

/// The key a request authenticates with, from the header its route uses (as routing decided
/// it, by header or by host): in-sandbox, its access token (or the traffic token the code
/// interpreter sends); on the REST API, its API key. (A key in another header would let a paused caller pass with a key it knows while
/// its calls are made with guesses.)
pub(crate) fn key_of(h: &HeaderMap, in_sandbox: bool) -> Option<&str> {
    if in_sandbox {
        ["x-access-token", "e2b-traffic-access-token"].into_iter().find_map(|n| crate::header(h, n))
    } else {
        crate::header(h, "x-api-key")
    }
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

impl Callers {
    pub(crate) fn new(cfg: &AuthFailureConfig) -> Callers {
        Callers { failures: FailureTracker::new(cfg.max, cfg.window, cfg.pause), known: Mutex::default() }
    }

    fn known(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Instant>> {
        self.known.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How much longer a request from `ip` with `key` is refused (None: let it through).
    pub(crate) fn refused_for(&self, ip: IpAddr, key: Option<&str>, now: Instant) -> Option<Duration> {
        let left = self.failures.paused(ip, now)?;
        let known = key.is_some_and(|k| self.known().get(&digest(k)).is_some_and(|until| *until > now));
        (!known).then_some(left)
    }

    /// Records how a request from `ip` with `key` fared: `authenticated` false when it was
    /// refused for its key (a 401).
    pub(crate) fn record(&self, ip: IpAddr, key: Option<&str>, authenticated: bool, now: Instant) {
        if !authenticated {
            if self.failures.failed(ip, now) {
                tracing::warn!(source = %ip, "pausing a gateway caller with too many failed authentications");
            }
            return;
        }
        let Some(k) = key else { return };
        let mut known = self.known();
        if known.len() >= MAX_KNOWN {
            known.retain(|_, until| *until > now);
            if known.len() >= MAX_KNOWN {
                known.clear();
            }
        }
        known.insert(digest(k), now + KNOWN_TTL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guessing_caller_is_paused_but_a_key_that_worked_still_passes() {
        let cfg = AuthFailureConfig { max: 3, pause: Duration::from_secs(600), ..AuthFailureConfig::default() };
        let c = Callers::new(&cfg);
        let (bad, other): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        let t0 = Instant::now();
        c.record(bad, Some("dsk.good.key"), true, t0);
        for _ in 0..3 {
            assert_eq!(c.refused_for(bad, Some("dsk.junk"), t0), None);
            c.record(bad, Some("dsk.junk"), false, t0);
        }
        assert!(c.refused_for(bad, Some("dsk.junk.2"), t0).is_some(), "paused");
        assert!(c.refused_for(bad, None, t0).is_some());
        assert_eq!(c.refused_for(bad, Some("dsk.good.key"), t0), None, "a key that authenticated passes");
        assert_eq!(c.refused_for(other, Some("dsk.fresh"), t0), None, "another caller is not paused");
        assert!(c.refused_for(bad, Some("dsk.good.key"), t0 + KNOWN_TTL + Duration::from_secs(1)).is_some());
    }
}
