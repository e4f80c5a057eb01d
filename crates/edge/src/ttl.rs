//! TTL deadlines of a sandbox, as pure functions of its record:
//!
//! - idle: `ttl_running_stop_s` after `last_active_ms`, while RUNNING (or on its way there);
//! - paused: `ttl_paused_s` after `paused_since_ms`, while PAUSED (or on its way back);
//! - lifetime: `ttl_max_s` after `created_at_ms`, in every live state.
//!
//! A TTL of 0 means "no limit" here: the apiserver fills the cluster defaults before the edge
//! sees a spec. `expires_at_ms` of a sandbox is its earliest deadline.

use crate::record::SandboxRecord;
use crate::state::{SandboxStatus, end_reason};

/// One deadline and the end reason it stops the sandbox with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline {
    pub at_ms: i64,
    pub reason: &'static str,
}

fn after(base_ms: i64, secs: u64) -> i64 {
    let ms = i64::try_from(secs.saturating_mul(1000)).unwrap_or(i64::MAX);
    base_ms.saturating_add(ms)
}

/// The deadlines in force for the record's state (none once ended).
pub fn deadlines(rec: &SandboxRecord) -> impl Iterator<Item = Deadline> {
    deadlines_active(rec, 0)
}

/// [`deadlines`] with activity the record does not hold yet: the idle clock runs from the later
/// of `rec.last_active_ms` and `active_ms` (runtime calls are counted in memory).
pub fn deadlines_active(rec: &SandboxRecord, active_ms: i64) -> impl Iterator<Item = Deadline> {
    use SandboxStatus::*;
    let s = &rec.spec;
    // A sandbox that pauses on its timeout counts no calls: its timeout is a deadline.
    let last_active = if s.pause_on_timeout { rec.last_active_ms } else { rec.last_active_ms.max(active_ms) };
    let idle = matches!(rec.state, Creating | Running | Pausing) && s.ttl_running_stop_s > 0;
    let paused = matches!(rec.state, Paused | Resuming) && s.ttl_paused_s > 0;
    let max = rec.state.is_live() && s.ttl_max_s > 0;
    [
        idle.then(|| Deadline {
            at_ms: after(last_active, s.ttl_running_stop_s),
            reason: end_reason::TTL_RUNNING_STOP,
        }),
        paused.then(|| Deadline { at_ms: after(rec.paused_since_ms, s.ttl_paused_s), reason: end_reason::TTL_PAUSED }),
        max.then(|| Deadline { at_ms: after(rec.created_at_ms, s.ttl_max_s), reason: end_reason::TTL_MAX }),
    ]
    .into_iter()
    .flatten()
}

/// The earliest deadline, if any.
pub fn next_deadline(rec: &SandboxRecord) -> Option<Deadline> {
    deadlines(rec).min_by_key(|d| d.at_ms)
}

/// `expires_at_ms` of the Sandbox message: the earliest deadline, 0 when none.
pub fn expires_at_ms(rec: &SandboxRecord) -> i64 {
    expires_at_ms_active(rec, 0)
}

/// [`expires_at_ms`] with in-memory activity (see [`deadlines_active`]).
pub fn expires_at_ms_active(rec: &SandboxRecord, active_ms: i64) -> i64 {
    deadlines_active(rec, active_ms).min_by_key(|d| d.at_ms).map_or(0, |d| d.at_ms)
}

/// The end reason if the sandbox should be stopped at `now_ms`. Only settled sandboxes
/// (RUNNING, PAUSED) expire; one in the middle of an operation is looked at next round.
pub fn expired(rec: &SandboxRecord, now_ms: i64) -> Option<&'static str> {
    expired_active(rec, now_ms, 0)
}

/// [`expired`] with in-memory activity (see [`deadlines_active`]); a call in flight passes
/// `active_ms = now_ms`, so idle expiry never interrupts it.
pub fn expired_active(rec: &SandboxRecord, now_ms: i64, active_ms: i64) -> Option<&'static str> {
    if !matches!(rec.state, SandboxStatus::Running | SandboxStatus::Paused) {
        return None;
    }
    deadlines_active(rec, active_ms).filter(|d| d.at_ms <= now_ms).min_by_key(|d| d.at_ms).map(|d| d.reason)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn activity_pushes_the_idle_deadline_only() {
        // idle 10 s after 1_050_000, max 100 s after 1_000_000.
        let r = rec(SandboxStatus::Running, 10, 100, 0);
        assert_eq!(expired_active(&r, 1_060_000, 0), Some(end_reason::TTL_RUNNING_STOP));
        assert_eq!(expired_active(&r, 1_060_000, 1_055_000), None);
        assert_eq!(expires_at_ms_active(&r, 1_055_000), 1_065_000);
        // A call in flight (active = now) never lets the idle TTL fire; the lifetime one still does.
        assert_eq!(expired_active(&r, 1_100_000, 1_100_000), Some(end_reason::TTL_MAX));
        // Older activity than the record's changes nothing.
        assert_eq!(expired_active(&r, 1_060_000, 1), Some(end_reason::TTL_RUNNING_STOP));
    }

    #[test]
    fn a_sandbox_that_pauses_on_its_timeout_counts_no_activity() {
        let mut r = rec(SandboxStatus::Running, 10, 100, 0);
        r.spec.pause_on_timeout = true;
        // Calls in flight or just ended do not push the timeout (E2B's timeout is a deadline).
        assert_eq!(expired_active(&r, 1_060_000, 1_060_000), Some(end_reason::TTL_RUNNING_STOP));
        assert_eq!(expires_at_ms_active(&r, 1_055_000), 1_060_000);
    }
    use crate::record::{RECORD_VERSION, SpecRecord};

    fn rec(state: SandboxStatus, idle: u64, max: u64, paused: u64) -> SandboxRecord {
        SandboxRecord {
            version: RECORD_VERSION,
            id: "e.l".into(),
            edge: "e".into(),
            lease_id: "l".into(),
            principal: "p".into(),
            spec: SpecRecord { ttl_running_stop_s: idle, ttl_max_s: max, ttl_paused_s: paused, ..Default::default() },
            state,
            created_at_ms: 1_000_000,
            updated_at_ms: 1_000_000,
            last_active_ms: 1_050_000,
            paused_since_ms: 1_060_000,
            end_reason: String::new(),
            ended_at_ms: 0,
            lease_released: false,
            net_slot: 0,
            member: String::new(),
            pool: String::new(),
            pool_revision: String::new(),
            moved: Default::default(),
        }
    }

    #[test]
    fn running_sandboxes_expire_on_idle_or_lifetime() {
        let r = rec(SandboxStatus::Running, 10, 3600, 5);
        assert_eq!(expires_at_ms(&r), 1_060_000);
        assert_eq!(expired(&r, 1_059_999), None);
        assert_eq!(expired(&r, 1_060_000), Some(end_reason::TTL_RUNNING_STOP));
        let r = rec(SandboxStatus::Running, 3600, 20, 5);
        assert_eq!(expired(&r, 1_020_000), Some(end_reason::TTL_MAX));
    }

    #[test]
    fn paused_sandboxes_expire_on_the_paused_clock() {
        let r = rec(SandboxStatus::Paused, 1, 3600, 5);
        // The idle TTL does not run while paused.
        assert_eq!(expires_at_ms(&r), 1_065_000);
        assert_eq!(expired(&r, 1_064_999), None);
        assert_eq!(expired(&r, 1_065_000), Some(end_reason::TTL_PAUSED));
    }

    #[test]
    fn zero_means_no_limit_and_ended_never_expire() {
        let r = rec(SandboxStatus::Running, 0, 0, 0);
        assert_eq!(expires_at_ms(&r), 0);
        assert_eq!(expired(&r, i64::MAX), None);
        for s in [SandboxStatus::Stopped, SandboxStatus::Failed] {
            let r = rec(s, 1, 1, 1);
            assert_eq!(expires_at_ms(&r), 0);
            assert_eq!(expired(&r, i64::MAX), None);
        }
    }

    #[test]
    fn sandboxes_in_operations_do_not_expire_yet() {
        for s in [SandboxStatus::Creating, SandboxStatus::Pausing, SandboxStatus::Stopping] {
            assert_eq!(expired(&rec(s, 1, 1, 1), i64::MAX), None, "{s}");
        }
    }

    #[test]
    fn huge_ttls_saturate() {
        let r = rec(SandboxStatus::Running, u64::MAX, u64::MAX, 0);
        assert_eq!(expires_at_ms(&r), i64::MAX);
        assert_eq!(expired(&r, i64::MAX - 1), None);
    }
}
