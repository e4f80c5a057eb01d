//! Edge creations, gathered per edge: the `CreateSandbox` calls of concurrent creations bound
//! for the same edge (a batch's run of items placed together, many clients' single creations)
//! go to it together as one `CreateMany`, which answers each as soon as it is made. As with
//! IAM admissions (`crate::admits`), nothing waits to fill a call: an edge takes up to
//! [`CALLS`] calls at once, and while they are out the creations for it gather (up to
//! [`MAX_ITEMS`] a call). A lone creation goes out at once, as a plain `CreateSandbox`.
//!
//! Each creation keeps its own answer or refusal, and its own deadline: `edge_call_timeout`
//! from when its call went out, as its own call would have had. A call that fails as a whole
//! fails each of its unanswered creations with that error (a connection lost mid-call is
//! `unavailable` with `no_answer`, as for one creation: the edge may have made them).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opendsec_common::{ApiError, Reason};
use opendsec_proto::v1 as pb;
use tokio::sync::oneshot;

use crate::upstream::Upstreams;

/// Calls in flight to one edge at once.
const CALLS: usize = 2;
/// Creations in one call.
const MAX_ITEMS: usize = 64;

type Reply = oneshot::Sender<Result<pb::Sandbox, ApiError>>;

struct Item {
    req: pb::EdgeCreateRequest,
    addr: String,
    reply: Reply,
}

#[derive(Default)]
struct Lane {
    waiting: Vec<Item>,
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
        answer.await.map_err(|_| ApiError::internal(format!("the call to edge {edge} ended without an answer")))?
    }

    /// One of an edge's calls: sends what waits for the edge, then again, until nothing does.
    async fn run(self: Arc<Self>, edge: String) {
        // Creations woken together (a batch's admissions) queue before the first call goes.
        tokio::task::yield_now().await;
        loop {
            let items = {
                let mut lanes = self.lanes();
                let Some(lane) = lanes.get_mut(&edge) else { return };
                if lane.waiting.is_empty() {
                    lane.calls -= 1;
                    if lane.calls == 0 {
                        lanes.remove(&edge);
                    }
                    return;
                }
                // One address a call: an edge that moved gets the rest in the next one.
                let addr = lane.waiting[0].addr.clone();
                let n = lane.waiting.iter().take(MAX_ITEMS).take_while(|i| i.addr == addr).count();
                lane.waiting.drain(..n).collect::<Vec<_>>()
            };
            self.send(&edge, items).await;
        }
    }

    async fn send(&self, edge: &str, items: Vec<Item>) {
        let addr = items[0].addr.clone();
        let client = match self.up.edge(edge, &addr) {
            Ok(c) => c,
            Err(e) => {
                for i in items {
                    let _ = i.reply.send(Err(e.clone()));
                }
                return;
            }
        };
        let (reqs, mut replies): (Vec<_>, Vec<Option<Reply>>) =
            items.into_iter().map(|i| (i.req, Some(i.reply))).unzip();
        let deadline = tokio::time::Instant::now() + self.timeout;
        let late = || {
            ApiError::new(
                Reason::DeadlineExceeded,
                format!("edge {edge} did not answer within {} s", self.timeout.as_secs()),
            )
            .with("edge", edge)
        };
        let mut c = client;
        let ended = match tokio::time::timeout_at(deadline, c.create_many(pb::EdgeCreateManyRequest { items: reqs }))
            .await
        {
            Err(_) => Err(late()),
            Ok(Err(st)) => Err(ApiError::from_status(&st)),
            Ok(Ok(resp)) => {
                let mut stream = resp.into_inner();
                loop {
                    match tokio::time::timeout_at(deadline, stream.message()).await {
                        Err(_) => break Err(late()),
                        Ok(Err(st)) => break Err(ApiError::from_status(&st)),
                        Ok(Ok(None)) => break Ok(()),
                        Ok(Ok(Some(r))) => {
                            let Some(reply) = replies.get_mut(r.index as usize).and_then(Option::take) else {
                                tracing::warn!(edge, index = r.index, "edge answered a creation it was not asked for");
                                continue;
                            };
                            let one = match (r.sandbox, r.error) {
                                (_, Some(e)) => Err(ApiError::from_detail(&e)),
                                (Some(sb), None) => Ok(sb),
                                (None, None) => {
                                    Err(ApiError::internal(format!("edge {edge} answered a creation with nothing")))
                                }
                            };
                            let _ = reply.send(one);
                        }
                    }
                }
            }
        };
        let unanswered = match ended {
            Ok(()) => ApiError::internal(format!("edge {edge} ended the call without answering every creation")),
            Err(e) => e,
        };
        for reply in replies.into_iter().flatten() {
            let _ = reply.send(Err(unanswered.clone()));
        }
    }
}
