//! IAM admissions, gathered: the `Admit` calls of concurrent creations (a batch's items, many
//! clients' single creations) go to IAM together as one `AdmitMany`, instead of one call each.
//! Nothing waits to fill a batch: a call goes out as soon as one of [`CALLS`] is free, with
//! every admission queued by then (up to [`MAX_ITEMS`]). A lone creation on a quiet apiserver
//! goes out at once, as a plain `Admit`; under load, admissions gather while earlier calls are
//! answered. Each admission keeps its own answer or refusal; a call that fails as a whole
//! (IAM unreachable) fails each of its admissions with that error, as their own calls would
//! have.

use std::sync::{Arc, OnceLock};

use opendsec_common::ApiError;
use opendsec_proto::v1 as pb;
use tokio::sync::{Semaphore, mpsc, oneshot};

use crate::upstream::Upstreams;

/// `AdmitMany` calls in flight at once.
const CALLS: usize = 4;
/// Admissions in one call (IAM takes up to 1,000).
const MAX_ITEMS: usize = 256;

type Reply = oneshot::Sender<Result<pb::AdmitResponse, ApiError>>;

#[derive(Debug)]
pub struct Admits {
    up: Arc<Upstreams>,
    /// The queue, and the task that drains it (started on first use, inside the runtime).
    /// Unbounded: what waits in it is bounded by the creations in flight (`inflight`).
    queue: OnceLock<mpsc::UnboundedSender<(pb::AdmitRequest, Reply)>>,
}

impl Admits {
    pub fn new(up: Arc<Upstreams>) -> Admits {
        Admits { up, queue: OnceLock::new() }
    }

    /// IAM's answer to `req`, as `Admit` would give it.
    pub async fn admit(&self, req: pb::AdmitRequest) -> Result<pb::AdmitResponse, ApiError> {
        let queue = self.queue.get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            tokio::spawn(drain(self.up.clone(), rx));
            tx
        });
        let (reply, answer) = oneshot::channel();
        queue.send((req, reply)).map_err(|_| ApiError::unavailable("the apiserver is stopping"))?;
        answer.await.map_err(|_| ApiError::unavailable("the apiserver is stopping"))?
    }
}

/// Ends when the queue's sender is dropped (with the apiserver's state).
async fn drain(up: Arc<Upstreams>, mut rx: mpsc::UnboundedReceiver<(pb::AdmitRequest, Reply)>) {
    let calls = Arc::new(Semaphore::new(CALLS));
    loop {
        // A free call first: while every call is out, admissions gather in the queue.
        let Ok(slot) = calls.clone().acquire_owned().await else { return };
        let Some(first) = rx.recv().await else { return };
        let mut batch = vec![first];
        while batch.len() < MAX_ITEMS {
            match rx.try_recv() {
                Ok(p) => batch.push(p),
                Err(_) => break,
            }
        }
        let up = up.clone();
        tokio::spawn(async move {
            send(&up, batch).await;
            drop(slot);
        });
    }
}

async fn send(up: &Upstreams, mut batch: Vec<(pb::AdmitRequest, Reply)>) {
    if batch.len() == 1 {
        let (req, reply) = batch.pop().expect("one");
        let answer = up
            .iam(|mut c| {
                let r = req.clone();
                async move { c.admit(r).await }
            })
            .await;
        let _ = reply.send(answer);
        return;
    }
    let (items, replies): (Vec<_>, Vec<_>) = batch.into_iter().unzip();
    let req = pb::AdmitManyRequest { items };
    let answer = up
        .iam(|mut c| {
            let r = req.clone();
            async move { c.admit_many(r).await }
        })
        .await;
    match answer {
        Ok(resp) if resp.results.len() == replies.len() => {
            for (reply, r) in replies.into_iter().zip(resp.results) {
                let one = match (r.admitted, r.error) {
                    (_, Some(e)) => Err(ApiError::from_detail(&e)),
                    (Some(a), None) => Ok(a),
                    (None, None) => Err(ApiError::internal("IAM answered an admission with nothing")),
                };
                let _ = reply.send(one);
            }
        }
        Ok(resp) => {
            let e = ApiError::internal(format!(
                "IAM answered {} of {} admissions in one call",
                resp.results.len(),
                replies.len()
            ));
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
        Err(e) => {
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}
