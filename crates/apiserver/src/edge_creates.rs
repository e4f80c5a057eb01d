//! Edge creations, gathered per edge: the `CreateSandbox` calls of concurrent creations bound
//! for the same edge (a run of a batch's items, a run of single creations) go to it together
//! as one `CreateMany`, which answers each as soon as it is made. As with IAM admissions
//! (`crate::admits`), nothing waits to fill a call: a call goes out at once with what is
//! queued for the edge (up to [`MAX_CREATE_MANY`]); while [`CALLS`] calls to the edge went
//! out less than [`HOLD`] ago and are not yet answered, later creations queue for the next
//! call. A slow creation (a cold boot) therefore holds back nothing for longer than
//! [`HOLD`]. A call of one creation is a plain `CreateSandbox`.
//!
//! Each creation keeps its own answer or refusal and its own deadline: `edge_call_timeout`
//! from when its call went out, as its own call would have had. A call that fails as a whole
//! before it reached the edge fails each of its creations as their own calls would have
//! failed; one that breaks after the edge took it (a lost connection, an answer missing) is
//! `unavailable` with `no_answer` for each creation not yet answered: the edge may have made
//! them, so their leases stay bound until the edge's lease checks settle them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opendsec_common::grpc::MAX_CREATE_MANY;
use opendsec_common::reason::NO_ANSWER;
use opendsec_common::{ApiError, Reason};
use opendsec_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::upstream::Upstreams;

/// Calls to one edge that hold back the next.
const CALLS: usize = 2;
/// How long at most a call holds back the next (unanswered, it then goes on on its own).
const HOLD: Duration = Duration::from_millis(5);

type Reply = oneshot::Sender<Result<pb::Sandbox, ApiError>>;

struct Item {
    req: pb::EdgeCreateRequest,
    addr: String,
    reply: Reply,
}

#[derive(Default)]
struct Lane {
    waiting: Vec<Item>,
    /// Senders at work for the lane (each sends one call after another).
    calls: usize,
}

pub struct EdgeCreates {
    up: Arc<Upstreams>,
    timeout: Duration,
    lanes: Mutex<HashMap<String, Lane>>,
}

impl std::fmt::Debug for EdgeCreates {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EdgeCreates").field("timeout", &self.timeout).finish_non_exhaustive()
    }
}

/// The answer of a creation whose call broke after it went out: the edge may have made it.
fn no_answer(edge: &str, why: &str) -> ApiError {
    ApiError::unavailable(format!("edge {edge} {why}; the creation may have been made there"))
        .with("edge", edge)
        .with(NO_ANSWER, "true")
}

impl EdgeCreates {
    pub fn new(up: Arc<Upstreams>, timeout: Duration) -> Arc<EdgeCreates> {
        Arc::new(EdgeCreates { up, timeout, lanes: Mutex::new(HashMap::new()) })
    }

    fn lanes(&self) -> std::sync::MutexGuard<'_, HashMap<String, Lane>> {
        self.lanes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Edge `edge`'s answer to `req`, as its `CreateSandbox` would give it.
    pub async fn create(
        self: &Arc<Self>,
        edge: &str,
        addr: &str,
        req: pb::EdgeCreateRequest,
    ) -> Result<pb::Sandbox, ApiError> {
        let (reply, answer) = oneshot::channel();
        let start = {
            let mut lanes = self.lanes();
            let lane = match lanes.get_mut(edge) {
                Some(l) => l,
                None => lanes.entry(edge.to_string()).or_default(),
            };
            lane.waiting.push(Item { req, addr: addr.to_string(), reply });
            lane.calls < CALLS && {
                lane.calls += 1;
                true
            }
        };
        if start {
            tokio::spawn(self.clone().run(edge.to_string()));
        }
        // Dropped unanswered: the sender failed mid-way (a bug); the call may have gone out.
        answer.await.unwrap_or_else(|_| Err(no_answer(edge, "was called by a sender that failed")))
    }

    /// One of an edge's senders: sends what waits for the edge, then again, until nothing does.
    async fn run(self: Arc<Self>, edge: String) {
        /// Gives the sender's place back should it end other than by finding nothing to send
        /// (a panic): its lane's last sender drops what waits, whose callers then hear
        /// `no_answer` (and place the creations again), instead of waiting for ever.
        struct Sender<'a>(&'a EdgeCreates, &'a str, bool);
        impl Drop for Sender<'_> {
            fn drop(&mut self) {
                if self.2 {
                    return;
                }
                let mut lanes = self.0.lanes();
                if let Some(lane) = lanes.get_mut(self.1) {
                    lane.calls -= 1;
                    if lane.calls == 0 {
                        lanes.remove(self.1);
                    }
                }
            }
        }
        let mut sender = Sender(&self, &edge, false);
        // Creations woken together (a run's admissions) queue before the first call goes.
        tokio::task::yield_now().await;
        loop {
            let items = {
                let mut lanes = self.lanes();
                let Some(lane) = lanes.get_mut(&edge) else { return };
                if lane.waiting.is_empty() {
                    // Under the lock: a creation queued after this starts a sender of its own.
                    lane.calls -= 1;
                    if lane.calls == 0 {
                        lanes.remove(&edge);
                    }
                    sender.2 = true;
                    return;
                }
                // One address a call: an edge that moved gets the rest in the next one.
                let addr = lane.waiting[0].addr.clone();
                let n = lane.waiting.iter().take(MAX_CREATE_MANY).take_while(|i| i.addr == addr).count();
                lane.waiting.drain(..n).collect::<Vec<_>>()
            };
            let call = tokio::spawn(self.clone().send(edge.clone(), items));
            // Answered, or out long enough: the next call may go.
            let _ = tokio::time::timeout(HOLD, call).await;
        }
    }

    async fn send(self: Arc<Self>, edge: String, items: Vec<Item>) {
        let edge = edge.as_str();
        let addr = items[0].addr.clone();
        let mut client = match self.up.edge(edge, &addr) {
            Ok(c) => c,
            Err(e) => {
                for i in items {
                    let _ = i.reply.send(Err(e.clone()));
                }
                return;
            }
        };
        let deadline = tokio::time::Instant::now() + self.timeout;
        let late = || {
            ApiError::new(
                Reason::DeadlineExceeded,
                format!("edge {edge} did not answer within {} s", self.timeout.as_secs()),
            )
            .with("edge", edge)
        };
        let (reqs, mut replies): (Vec<_>, Vec<Option<Reply>>) =
            items.into_iter().map(|i| (i.req, Some(i.reply))).unzip();
        if reqs.len() == 1 {
            let req = reqs.into_iter().next().expect("one");
            let answer = match tokio::time::timeout_at(deadline, client.create_sandbox(req)).await {
                Err(_) => Err(late()),
                Ok(r) => r.map(tonic::Response::into_inner).map_err(|st| ApiError::from_status(&st)),
            };
            if let Some(reply) = replies.pop().flatten() {
                let _ = reply.send(answer);
            }
            return;
        }
        let call = tokio::time::timeout_at(deadline, client.create_many(pb::EdgeCreateManyRequest { items: reqs }));
        let ended = match call.await {
            Err(_) => Err(late()),
            // Refused before the edge took any (as each would have been refused).
            Ok(Err(st)) => Err(ApiError::from_status(&st)),
            Ok(Ok(resp)) => {
                let mut stream = resp.into_inner();
                loop {
                    match tokio::time::timeout_at(deadline, stream.message()).await {
                        Err(_) => break Err(late()),
                        // The edge took the call: whatever broke, it may have made them.
                        Ok(Err(st)) => break Err(no_answer(edge, &format!("broke off the call ({})", st.message()))),
                        Ok(Ok(None)) => break Err(no_answer(edge, "ended the call without answering every creation")),
                        Ok(Ok(Some(r))) => {
                            let Some(reply) = replies.get_mut(r.index as usize).and_then(Option::take) else {
                                tracing::warn!(
                                    edge,
                                    index = r.index,
                                    "edge answered a creation it was not asked for, or twice"
                                );
                                continue;
                            };
                            let one = match (r.sandbox, r.error) {
                                (_, Some(e)) => Err(ApiError::from_detail(&e)),
                                (Some(sb), None) => Ok(sb),
                                (None, None) => Err(no_answer(edge, "answered a creation with nothing")),
                            };
                            let _ = reply.send(one);
                            if replies.iter().all(Option::is_none) {
                                break Ok(());
                            }
                        }
                    }
                }
            }
        };
        if let Err(e) = ended {
            for reply in replies.into_iter().flatten() {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}
