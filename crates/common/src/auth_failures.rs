//! Failed authentications per source address (reference section 1, "authentication is paused
//! for a source address with too many failures"): after `max` failures within `window`, a
//! source is paused for `pause`, during which a caller answers it `unauthenticated` without
//! asking anyone. The apiserver counts its callers (or, for the E2B gateway, the clients the
//! gateway names); the gateway counts its own. Pure logic over a clock the caller passes in.
use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Most source addresses tracked at once (beyond, the oldest windows are dropped).
const MAX_SOURCES: usize = 100_000;

/// Failed authentications per source address.
#[derive(Debug)]
pub struct FailureTracker {
    max: u32,
    window: Duration,
    pause: Duration,
    sources: Mutex<HashMap<IpAddr, Source>>,
}

#[derive(Debug, Clone, Copy)]
struct Source {
    window_start: Instant,
    failures: u32,
    paused_until: Option<Instant>,
}

impl FailureTracker {
    /// `max` failures within `window` pause a source for `pause`; `max == 0` never pauses.
    pub fn new(max: u32, window: Duration, pause: Duration) -> FailureTracker {
        FailureTracker { max, window, pause, sources: Mutex::new(HashMap::new()) }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<IpAddr, Source>> {
        self.sources.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// How much longer `ip` stays paused (None: not paused). Sources are IPv4 addresses and
    /// IPv6 /64s (one host's usual allocation), as connections are counted.
    pub fn paused(&self, ip: IpAddr, now: Instant) -> Option<Duration> {
        let ip = crate::conn::Sources::source_of(ip);
        let until = self.lock().get(&ip)?.paused_until?;
        (until > now).then(|| until - now)
    }

    /// Counts a failed authentication from `ip`; true when it starts a pause.
    pub fn failed(&self, ip: IpAddr, now: Instant) -> bool {
        if self.max == 0 {
            return false;
        }
        let ip = crate::conn::Sources::source_of(ip);
        let mut map = self.lock();
        if map.len() >= MAX_SOURCES && !map.contains_key(&ip) {
            let window = self.window;
            map.retain(|_, s| {
                now.saturating_duration_since(s.window_start) < window || s.paused_until.is_some_and(|u| u > now)
            });
            if map.len() >= MAX_SOURCES {
                // Flooded from more addresses than we track: forget the oldest half of those
                // not paused (a flood never lifts a pause).
                let mut starts: Vec<Instant> = map.values().map(|s| s.window_start).collect();
                starts.sort();
                let cut = starts[starts.len() / 2];
                map.retain(|_, s| s.window_start > cut || s.paused_until.is_some_and(|u| u > now));
            }
        }
        let s = map.entry(ip).or_insert(Source { window_start: now, failures: 0, paused_until: None });
        if now.saturating_duration_since(s.window_start) >= self.window {
            *s = Source { window_start: now, failures: 0, paused_until: s.paused_until.filter(|u| *u > now) };
        }
        s.failures += 1;
        if s.failures >= self.max && s.paused_until.is_none_or(|u| u <= now) {
            s.paused_until = Some(now + self.pause);
            s.failures = 0;
            s.window_start = now;
            return true;
        }
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_pause_a_source_for_a_while() {
        let t = FailureTracker::new(3, Duration::from_secs(10), Duration::from_secs(30));
        let (a, b): (IpAddr, IpAddr) = ("192.0.2.1".parse().unwrap(), "192.0.2.2".parse().unwrap());
        let t0 = Instant::now();
        assert!(!t.failed(a, t0));
        assert!(!t.failed(a, t0 + Duration::from_secs(1)));
        assert_eq!(t.paused(a, t0), None);
        assert!(t.failed(a, t0 + Duration::from_secs(2)), "the third failure pauses");
        assert_eq!(t.paused(a, t0 + Duration::from_secs(2)), Some(Duration::from_secs(30)));
        assert_eq!(t.paused(b, t0), None, "other sources are not paused");
        assert_eq!(t.paused(a, t0 + Duration::from_secs(33)), None, "the pause ends");
        // Failures spread over longer than the window never pause.
        for i in 0..10 {
            assert!(!t.failed(b, t0 + Duration::from_secs(6 * i)));
        }
        assert!(!FailureTracker::new(0, Duration::from_secs(1), Duration::from_secs(1)).failed(a, t0));
        // An IPv6 host is one source across its /64.
        let v6 = FailureTracker::new(2, Duration::from_secs(10), Duration::from_secs(30));
        v6.failed("2001:db8::1".parse().unwrap(), t0);
        assert!(v6.failed("2001:db8::2".parse().unwrap(), t0));
        assert!(v6.paused("2001:db8::ffff".parse().unwrap(), t0).is_some());
        assert!(v6.paused("2001:db8:0:1::1".parse().unwrap(), t0).is_none());
    }
}
