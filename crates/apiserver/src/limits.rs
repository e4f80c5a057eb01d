//! Bounds that keep one caller from taking an apiserver's memory or another tenant's share
//! (issue 9, "limits before authentication, and per-tenant bounds"):
//!
//! - `FailureTracker` (`opendsec_common::auth_failures`, shared with the E2B gateway): after
//!   too many failed authentications from one source address in a window, that source is
//!   answered `unauthenticated` for a while without asking IAM;
//! - [`FairGate`]: the creation slots of an apiserver, handed out round-robin between the
//!   principals waiting for one, so a 32,768-item batch of one tenant cannot starve the single
//!   creations of another;
//! - per-principal in-flight Runtime calls and the budget of bytes unary answers hold, of
//!   which one principal holds at most its share (`opendsec_common::bounds`, shared with the
//!   edge).
//!
//! Pure logic over a clock the caller passes in, unit-tested here; the gRPC layer only asks.
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

pub use opendsec_common::auth_failures::FailureTracker;
pub use opendsec_common::bounds::{AnswerBudget, PerKey};

use tokio::sync::oneshot;

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
    use std::time::Duration;

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
