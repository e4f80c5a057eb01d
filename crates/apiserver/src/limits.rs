//! Bounds that keep one caller from taking an apiserver's memory or another tenant's share
//! (issue 9, "limits before authentication, and per-tenant bounds"):
//!
//! - [`FailureTracker`]: after too many failed authentications from one source address in a
//!   window, that source is answered `unauthenticated` for a while without asking IAM;
//! - [`FairGate`]: the creation slots of an apiserver, handed out round-robin between the
//!   principals waiting for one, so a 32,768-item batch of one tenant cannot starve the single
//!   creations of another;
//! - per-principal in-flight Runtime calls and the budget of bytes unary answers hold, of
//!   which one principal holds at most its share (`opendsec_common::bounds`, shared with the
//!   edge).
//!
//! Pure logic over a clock the caller passes in, unit-tested here; the gRPC layer only asks.
use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

pub use opendsec_common::bounds::{AnswerBudget, PerKey};
use std::time::{Duration, Instant};

use tokio::sync::oneshot;

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

    /// How much longer `ip` stays paused (None: not paused).
    pub fn paused(&self, ip: IpAddr, now: Instant) -> Option<Duration> {
        let until = self.lock().get(&ip)?.paused_until?;
        (until > now).then(|| until - now)
    }

    /// Counts a failed authentication from `ip`; true when it starts a pause.
    pub fn failed(&self, ip: IpAddr, now: Instant) -> bool {
        if self.max == 0 {
            return false;
        }
        let mut map = self.lock();
        if map.len() >= MAX_SOURCES && !map.contains_key(&ip) {
            let window = self.window;
            map.retain(|_, s| {
                now.saturating_duration_since(s.window_start) < window || s.paused_until.is_some_and(|u| u > now)
            });
            if map.len() >= MAX_SOURCES {
                // Flooded from more addresses than we track: forget the oldest half.
                let mut starts: Vec<Instant> = map.values().map(|s| s.window_start).collect();
                starts.sort();
                let cut = starts[starts.len() / 2];
                map.retain(|_, s| s.window_start > cut);
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

/// Slots shared fairly: while some wait, a freed slot goes to the next waiting principal in
/// round-robin order, not to whoever asked first.
#[derive(Debug)]
pub struct FairGate {
    inner: Mutex<Gate>,
}

#[derive(Debug, Default)]
struct Gate {
    free: usize,
    /// Waiters per principal, oldest first.
    queues: HashMap<String, VecDeque<oneshot::Sender<FairPermit>>>,
    /// Principals with waiters, in turn order.
    ring: VecDeque<String>,
}

/// One slot of a [`FairGate`]; dropping it hands the slot on.
#[derive(Debug)]
pub struct FairPermit {
    gate: Option<Arc<FairGate>>,
}

impl Drop for FairPermit {
    fn drop(&mut self) {
        if let Some(g) = self.gate.take() {
            g.release();
        }
    }
}

impl FairGate {
    pub fn new(slots: usize) -> Arc<FairGate> {
        Arc::new(FairGate { inner: Mutex::new(Gate { free: slots.max(1), ..Gate::default() }) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Gate> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Free slots right now.
    pub fn available(&self) -> usize {
        self.lock().free
    }

    /// A slot for `who`, waiting for its turn when none is free.
    pub async fn acquire(self: &Arc<Self>, who: &str) -> FairPermit {
        let rx = {
            let mut g = self.lock();
            if g.free > 0 && g.ring.is_empty() {
                g.free -= 1;
                return FairPermit { gate: Some(self.clone()) };
            }
            let (tx, rx) = oneshot::channel();
            let q = g.queues.entry(who.to_string()).or_default();
            if q.is_empty() {
                g.ring.push_back(who.to_string());
            }
            g.queues.get_mut(who).expect("queue inserted above").push_back(tx);
            rx
        };
        // The sender lives in the queue until a release hands it a permit; a release never
        // drops it without sending, so the receive only fails if the gate itself is gone.
        match rx.await {
            Ok(p) => p,
            Err(_) => FairPermit { gate: None },
        }
    }

    /// Hands a freed slot to the next waiter in turn (skipping ones that gave up), or keeps it.
    fn release(self: &Arc<Self>) {
        let mut g = self.lock();
        loop {
            let Some(who) = g.ring.pop_front() else {
                g.free += 1;
                return;
            };
            let Some(q) = g.queues.get_mut(&who) else { continue };
            let waiter = q.pop_front();
            if q.is_empty() {
                g.queues.remove(&who);
            } else {
                g.ring.push_back(who);
            }
            if let Some(tx) = waiter {
                // A waiter that stopped waiting (its receiver dropped) returns the permit:
                // its Drop would re-enter this lock, so detach the gate first and try on.
                match tx.send(FairPermit { gate: Some(self.clone()) }) {
                    Ok(()) => return,
                    Err(mut p) => p.gate = None,
                }
            }
        }
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
    }

    #[tokio::test]
    async fn a_big_batch_does_not_starve_a_single_creation() {
        let gate = FairGate::new(2);
        let (p1, p2) = (gate.acquire("batch").await, gate.acquire("batch").await);
        assert_eq!(gate.available(), 0);
        // The batch queues many more; then another principal asks for one.
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut waiting = Vec::new();
        // Each batch item holds its slot until told to let go.
        let (go_tx, go_rx) = tokio::sync::watch::channel(false);
        for i in 0..5 {
            let (g, o, mut go) = (gate.clone(), order.clone(), go_rx.clone());
            waiting.push(tokio::spawn(async move {
                let _p = g.acquire("batch").await;
                o.lock().unwrap().push(format!("batch{i}"));
                let _ = go.wait_for(|v| *v).await;
            }));
            tokio::task::yield_now().await;
        }
        let (g, o) = (gate.clone(), order.clone());
        let single = tokio::spawn(async move {
            let p = g.acquire("single").await;
            o.lock().unwrap().push("single".to_string());
            p
        });
        tokio::task::yield_now().await;
        // Two slots free up: one goes to the batch, the other to the single creation (its
        // turn comes before the batch's later items).
        drop(p1);
        drop(p2);
        let s = single.await.unwrap();
        let got = order.lock().unwrap().clone();
        assert!(got.contains(&"single".to_string()) && got.len() <= 2, "{got:?}");
        drop(s);
        go_tx.send_replace(true);
        for w in futures::future::join_all(waiting).await {
            w.unwrap();
        }
        assert_eq!(order.lock().unwrap().len(), 6, "every waiter got a slot");
        assert_eq!(gate.available(), 2, "every slot came back");
    }

    #[tokio::test]
    async fn a_waiter_that_gives_up_passes_its_turn_on() {
        let gate = FairGate::new(1);
        let held = gate.acquire("a").await;
        let g = gate.clone();
        let gave_up = tokio::time::timeout(Duration::from_millis(20), async move { g.acquire("b").await }).await;
        assert!(gave_up.is_err());
        let g = gate.clone();
        let next = tokio::spawn(async move { g.acquire("c").await });
        tokio::task::yield_now().await;
        drop(held);
        let p = tokio::time::timeout(Duration::from_secs(5), next).await.expect("c got the slot").unwrap();
        drop(p);
        assert_eq!(gate.available(), 1);
    }
}
