//! Wall-clock helpers. Times on the wire and on disk are unix milliseconds.
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

/// Milliseconds since the unix epoch.
pub fn now_ms() -> i64 {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

/// Where a component reads the wall clock for its deadlines (TTLs, retention): the system's,
/// or, in tests, a manual one that moves only when told, so that a test of a one-hour TTL
/// takes no hour. Cheap to clone; clones of a manual clock share its time.
#[derive(Clone, Debug, Default)]
pub struct Clock(Option<Arc<AtomicI64>>);

impl Clock {
    /// The system's wall clock ([`now_ms`]).
    pub fn system() -> Clock {
        Clock(None)
    }

    /// A clock standing at `start_ms` until [`Clock::advance`] moves it.
    pub fn manual(start_ms: i64) -> Clock {
        Clock(Some(Arc::new(AtomicI64::new(start_ms))))
    }

    /// Milliseconds since the unix epoch, by this clock.
    pub fn now_ms(&self) -> i64 {
        match &self.0 {
            None => now_ms(),
            Some(t) => t.load(Ordering::SeqCst),
        }
    }

    /// Moves a manual clock forward by `ms` (a system clock cannot be moved: panics, as a
    /// test's mistake).
    pub fn advance(&self, ms: i64) {
        let t = self.0.as_ref().expect("only a manual clock can be advanced");
        t.fetch_add(ms, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_manual_clock_moves_only_when_told_and_its_clones_follow() {
        let c = Clock::manual(1_000);
        let d = c.clone();
        assert_eq!(c.now_ms(), 1_000);
        c.advance(250);
        assert_eq!(d.now_ms(), 1_250);
        let s = Clock::system().now_ms();
        assert!((s - now_ms()).abs() < 60_000);
    }
}
