//! Bounds on what calls in flight may hold, shared by the apiserver and the edge: in-flight
//! counts per key (principal, sandbox) and a budget of the bytes unary answers hold, with what
//! each Runtime request's answer may hold ([`AnswerBytes`]). Every Runtime answer is held whole
//! in memory at each hop it crosses; the budget is what keeps a tenant asking for many large
//! answers at once from taking a process's memory.
use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use opendsec_proto::v1 as pb;

use crate::reason::ApiError;

/// What an answer without bulk data is counted as.
pub const SMALL_ANSWER: u64 = 64 << 10;
/// The most bytes per output stream one unary Exec result or GetOutput answer carries (the
/// agent's cap): more goes through ExecStream, or GetOutput by offset.
pub const MAX_UNARY_OUTPUT: u64 = 32 << 20;
/// The agent's default per output stream when a request sets no limit.
pub const DEFAULT_OUTPUT: u64 = 16 << 20;
/// The agent's default GetOutput window.
pub const DEFAULT_OUTPUT_WINDOW: u64 = 4 << 20;
/// The most bytes of an HTTP response body one HttpRequest carries.
pub const MAX_HTTP_BODY: u64 = 32 << 20;

/// The most bytes of a listing (ListDir, ListProcesses) on the wire.
pub const LIST_ANSWER: u64 = 4 << 20;
/// How much more memory than wire bytes a listing may take once decoded (an empty entry is 2
/// bytes on the wire and about a hundred in memory).
pub const LIST_EXPANSION: u64 = 64;

/// What the answer to a Runtime request can hold.
pub trait AnswerBytes {
    /// The most bytes its (one) message can take on the wire: the decoding limit of the hops
    /// it crosses, and an error for limits past what a hop holds.
    fn answer_bytes(&self) -> Result<u64, ApiError> {
        Ok(SMALL_ANSWER)
    }

    /// Bytes of memory per wire byte once decoded, at most.
    fn expansion(&self) -> u64 {
        1
    }
}

impl AnswerBytes for pb::ExecRequest {
    fn answer_bytes(&self) -> Result<u64, ApiError> {
        let l = self.limits.unwrap_or_default();
        let each = |v: u64| if v == 0 { DEFAULT_OUTPUT } else { v.min(MAX_UNARY_OUTPUT) };
        Ok(each(l.stdout_max_bytes) + each(l.stderr_max_bytes) + SMALL_ANSWER)
    }
}

impl AnswerBytes for pb::GetOutputRequest {
    fn answer_bytes(&self) -> Result<u64, ApiError> {
        // Both streams may come back, each up to the window asked (the agent's cap).
        let w = if self.max_bytes == 0 { DEFAULT_OUTPUT_WINDOW } else { self.max_bytes.min(MAX_UNARY_OUTPUT) };
        Ok(2 * w + SMALL_ANSWER)
    }
}

impl AnswerBytes for pb::HttpRequestRequest {
    fn answer_bytes(&self) -> Result<u64, ApiError> {
        if self.max_body_bytes > MAX_HTTP_BODY {
            return Err(ApiError::invalid(format!(
                "max_body_bytes: at most {MAX_HTTP_BODY} (the answer is held whole in memory at every hop)"
            ))
            .with("field", "max_body_bytes"));
        }
        let body = if self.max_body_bytes == 0 { DEFAULT_OUTPUT } else { self.max_body_bytes };
        Ok(body + SMALL_ANSWER)
    }
}

macro_rules! small_answers {
    ($($t:ty),* $(,)?) => { $(impl AnswerBytes for $t {})* };
}

small_answers!(
    pb::CloseSessionRequest,
    pb::ReadFileRequest,
    pb::StatRequest,
    pb::MakeDirRequest,
    pb::RemoveRequest,
    pb::MoveRequest,
    pb::StartProcessRequest,
    pb::ConnectProcessRequest,
    pb::SendInputRequest,
    pb::SignalProcessRequest,
    pb::ResizeProcessRequest,
    pb::WatchDirRequest,
    pb::RemoveWatcherRequest,
    pb::CreateCodeContextRequest,
    pb::CodeContextRequest,
    pb::RunCodeRequest,
    pb::WatchRequest,
);

macro_rules! list_answers {
    ($($t:ty),* $(,)?) => {
        $(impl AnswerBytes for $t {
            fn answer_bytes(&self) -> Result<u64, ApiError> {
                Ok(LIST_ANSWER)
            }

            fn expansion(&self) -> u64 {
                LIST_EXPANSION
            }
        })*
    };
}

list_answers!(pb::ListDirRequest, pb::ListProcessesRequest, pb::GetWatcherEventsRequest, pb::ListCodeContextsRequest);

/// In-flight counts per key (principal, sandbox), each capped.
#[derive(Debug)]
pub struct PerKey {
    cap: u32,
    counts: Mutex<HashMap<String, u32>>,
}

/// One call counted by a [`PerKey`]; dropping it uncounts the call.
#[derive(Debug)]
pub struct KeyPermit {
    owner: Arc<PerKey>,
    key: String,
}

impl Drop for KeyPermit {
    fn drop(&mut self) {
        let mut m = self.owner.counts.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.key);
            }
        }
    }
}

impl PerKey {
    /// `cap == 0`: no cap.
    pub fn new(cap: u32) -> Arc<PerKey> {
        Arc::new(PerKey { cap, counts: Mutex::new(HashMap::new()) })
    }

    /// Counts one more call of `key`, or `None` when it already has `cap` in flight.
    pub fn try_take(self: &Arc<Self>, key: &str) -> Option<KeyPermit> {
        let mut m = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(key.to_string()).or_insert(0);
        if self.cap > 0 && *n >= self.cap {
            return None;
        }
        *n += 1;
        Some(KeyPermit { owner: self.clone(), key: key.to_string() })
    }
}

/// The bytes that answers in flight may hold at one hop, counted in KiB and shared fairly:
/// one key (a principal at an apiserver, a sandbox at an edge) holds at most `share` of it.
///
/// An answer reserves its exact size, which its gRPC frame header gives before any of its
/// body is taken off the connection ([`Metered`]), and waits, holding nothing, until that
/// fits: no call is refused for the budget, and the bytes of an answer that waits stay with
/// its sender (HTTP/2 flow control). Each waiter asks once, so waiters cannot hold parts of
/// the budget while waiting for more of it.
#[derive(Debug)]
pub struct AnswerBudget {
    all: Arc<Semaphore>,
    share_kib: u32,
    keys: Mutex<HashMap<String, Arc<Semaphore>>>,
}

/// What one answer holds of an [`AnswerBudget`] until dropped.
#[derive(Debug)]
pub struct AnswerPermit {
    budget: Arc<AnswerBudget>,
    key: String,
    sem: Option<Arc<Semaphore>>,
    held: Option<(OwnedSemaphorePermit, OwnedSemaphorePermit)>,
}

impl Drop for AnswerPermit {
    fn drop(&mut self) {
        self.held = None;
        let Some(sem) = self.sem.take() else { return };
        let mut keys = self.budget.keys.lock().unwrap_or_else(|p| p.into_inner());
        // The map's and this one: no other answer of the key holds or waits for its share.
        if Arc::strong_count(&sem) == 2 {
            keys.remove(&self.key);
        }
    }
}

fn kib_of(bytes: u64) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

impl AnswerBudget {
    /// `bytes` in all, at most `share_percent` of it (1..=100) per key.
    pub fn new(bytes: u64, share_percent: u32) -> Arc<AnswerBudget> {
        let total = kib_of(bytes).clamp(1, Semaphore::MAX_PERMITS as u32);
        let share = (u64::from(total) * u64::from(share_percent.clamp(1, 100)) / 100).max(1) as u32;
        Arc::new(AnswerBudget {
            all: Arc::new(Semaphore::new(total as usize)),
            share_kib: share,
            keys: Mutex::default(),
        })
    }

    /// Waits until `bytes` (at most a whole share) fit in `key`'s share and in the whole.
    pub async fn reserve(self: &Arc<Self>, key: &str, bytes: u64) -> AnswerPermit {
        let kib = kib_of(bytes).clamp(1, self.share_kib);
        let sem = {
            let mut keys = self.keys.lock().unwrap_or_else(|p| p.into_inner());
            keys.entry(key.to_string()).or_insert_with(|| Arc::new(Semaphore::new(self.share_kib as usize))).clone()
        };
        // Built first, so that a waiter dropped midway still tidies the map.
        let mut permit =
            AnswerPermit { budget: self.clone(), key: key.to_string(), sem: Some(sem.clone()), held: None };
        // Neither semaphore is ever closed.
        if let (Ok(mine), Ok(all)) = (sem.acquire_many_owned(kib).await, self.all.clone().acquire_many_owned(kib).await)
        {
            permit.held = Some((mine, all));
        }
        permit
    }

    /// KiB free in the whole budget now.
    pub fn free_kib(&self) -> usize {
        self.all.available_permits()
    }
}

/// One call's account with an [`AnswerBudget`]: what its answers reserved stays held until
/// the last clone is dropped (the caller keeps one until the answer has left the process).
#[derive(Clone, Debug)]
pub struct Meter {
    budget: Arc<AnswerBudget>,
    key: Arc<str>,
    held: Arc<Mutex<Vec<AnswerPermit>>>,
    /// Memory per wire byte reserved (see [`AnswerBytes::expansion`]).
    expansion: u64,
    /// The most wire bytes of the one message allowed.
    max_bytes: u64,
    /// How long an answer may wait for room before the call fails.
    wait: std::time::Duration,
}

impl Meter {
    /// The account of one call answering `req`, charged to `key` (a tenant at an apiserver,
    /// a sandbox's tenant at an edge); its answer waits at most `wait` for room.
    pub fn new(
        budget: &Arc<AnswerBudget>,
        key: &str,
        req: &impl AnswerBytes,
        wait: std::time::Duration,
    ) -> Result<Meter, ApiError> {
        Ok(Meter {
            budget: budget.clone(),
            key: key.into(),
            held: Arc::default(),
            expansion: req.expansion(),
            max_bytes: req.answer_bytes()?,
            wait,
        })
    }

    /// The decoding limit of the call's answer.
    pub fn max_bytes(&self) -> usize {
        usize::try_from(self.max_bytes).unwrap_or(usize::MAX)
    }

    /// How many reservations this call holds now.
    pub fn held_permits(&self) -> usize {
        self.held.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

/// A gRPC client transport whose unary answers are metered: the first message of each
/// response reserves its size in the call's [`Meter`] before tonic takes its body off the
/// connection. `None`: not metered (streams, which hold only what flow control lets through).
#[derive(Clone, Debug)]
pub struct Metered<S> {
    inner: S,
    meter: Option<Meter>,
}

impl<S> Metered<S> {
    pub fn new(inner: S, meter: Option<Meter>) -> Metered<S> {
        Metered { inner, meter }
    }
}

type Body = tonic::body::Body;

impl<S> tower::Service<http::Request<Body>> for Metered<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let fut = self.inner.call(req);
        let meter = self.meter.clone();
        Box::pin(async move {
            let resp = fut.await?;
            Ok(match meter {
                None => resp,
                Some(m) => resp.map(|b| Body::new(MeteredBody::new(b, m))),
            })
        })
    }
}

/// A response body whose first gRPC message waits for its reservation (see [`Metered`]). It
/// also holds the answer to what a unary answer is: one uncompressed message of at most the
/// request's bound; anything else fails the body (and so the call) as it arrives.
struct MeteredBody {
    inner: Body,
    meter: Meter,
    /// The first bytes of the message (flag and length: 5).
    header: MessagePrefix,
    /// Wire bytes allowed in all, once the header is known.
    allowed: Option<u64>,
    /// Wire bytes seen so far.
    seen: u64,
    /// Frames read while the header was incomplete or its reservation pending.
    queued: VecDeque<http_body::Frame<bytes::Bytes>>,
    waiting: Option<futures::future::BoxFuture<'static, Option<AnswerPermit>>>,
    reserved: bool,
    /// The inner body has ended.
    ended: bool,
}

/// A gRPC message's prefix: compression flag and a 4-byte big-endian length.
const GRPC_PREFIX: usize = 5;

/// The prefix of a body's first gRPC message, gathered from its frames as they come (a frame
/// may hold part of it). Used to size or refuse a message before it is decoded.
#[derive(Debug, Default)]
pub struct MessagePrefix {
    bytes: [u8; GRPC_PREFIX],
    have: usize,
}

impl MessagePrefix {
    /// Takes from `data` what the prefix still lacks; the call that completes it answers
    /// (compressed, declared length), every other call `None`.
    pub fn feed(&mut self, data: &[u8]) -> Option<(bool, u32)> {
        if self.have == GRPC_PREFIX {
            return None;
        }
        let take = (GRPC_PREFIX - self.have).min(data.len());
        self.bytes[self.have..self.have + take].copy_from_slice(&data[..take]);
        self.have += take;
        (self.have == GRPC_PREFIX).then(|| {
            let b = &self.bytes;
            (b[0] != 0, u32::from_be_bytes([b[1], b[2], b[3], b[4]]))
        })
    }
}

impl MeteredBody {
    fn new(inner: Body, meter: Meter) -> MeteredBody {
        MeteredBody {
            inner,
            meter,
            header: MessagePrefix::default(),
            allowed: None,
            seen: 0,
            queued: VecDeque::new(),
            waiting: None,
            reserved: false,
            ended: false,
        }
    }

    /// Takes in one data frame (queued until the reservation is held).
    fn take(&mut self, f: http_body::Frame<bytes::Bytes>) -> Result<(), tonic::Status> {
        if let Some(d) = f.data_ref() {
            self.seen += d.len() as u64;
            if let Some((compressed, len)) = self.header.feed(d) {
                self.start(compressed, len)?;
            }
            if let Some(allowed) = self.allowed
                && self.seen > allowed
            {
                return Err(ApiError::internal("a unary answer carried more than one message").to_status());
            }
        }
        self.queued.push_back(f);
        Ok(())
    }

    /// The header is in: checks it and starts waiting for room.
    fn start(&mut self, compressed: bool, len: u32) -> Result<(), tonic::Status> {
        if compressed {
            return Err(ApiError::internal("a compressed answer (none is asked for)").to_status());
        }
        let len = u64::from(len);
        if len > self.meter.max_bytes {
            return Err(ApiError::invalid(format!(
                "an answer of {len} bytes, over the {} this call carries (list a smaller directory, read output by offset)",
                self.meter.max_bytes
            ))
            .to_status());
        }
        let total = len + GRPC_PREFIX as u64;
        self.allowed = Some(total);
        let (budget, key, wait) = (self.meter.budget.clone(), self.meter.key.clone(), self.meter.wait);
        let bytes = total.saturating_mul(self.meter.expansion);
        self.waiting =
            Some(Box::pin(async move { tokio::time::timeout(wait, budget.reserve(&key, bytes)).await.ok() }));
        Ok(())
    }
}

impl http_body::Body for MeteredBody {
    type Data = bytes::Bytes;
    type Error = tonic::Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        loop {
            if let Some(w) = self.waiting.as_mut() {
                let permit = std::task::ready!(w.as_mut().poll(cx));
                self.waiting = None;
                let Some(permit) = permit else {
                    let e = ApiError::new(
                        crate::Reason::RateLimited,
                        format!("no room for this answer within {} s; try again", self.meter.wait.as_secs()),
                    )
                    .with("retry_after_ms", "1000");
                    return Poll::Ready(Some(Err(e.to_status())));
                };
                self.meter.held.lock().unwrap_or_else(|p| p.into_inner()).push(permit);
                self.reserved = true;
            }
            if (self.reserved || self.ended)
                && let Some(f) = self.queued.pop_front()
            {
                return Poll::Ready(Some(Ok(f)));
            }
            if self.ended {
                return Poll::Ready(None);
            }
            match std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
                // Ended, perhaps before a whole header (an error's trailers, or nothing): what
                // was queued goes out as it is.
                None => self.ended = true,
                Some(Err(e)) => return Poll::Ready(Some(Err(e))),
                Some(Ok(f)) => {
                    if let Err(e) = self.take(f) {
                        return Poll::Ready(Some(Err(e)));
                    }
                    if self.reserved {
                        // Past the reservation: frames go on at once, still counted.
                        if let Some(f) = self.queued.pop_front() {
                            return Poll::Ready(Some(Ok(f)));
                        }
                    }
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.queued.is_empty() && self.waiting.is_none() && (self.ended || self.inner.is_end_stream())
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::default()
    }
}

/// A server layer that keeps the [`Meter`] a handler put in its response's extensions until
/// the response body is dropped, that is, until the answer has left the process (or the call
/// is gone): bytes of an answer count until the client has taken them, however slowly it
/// reads.
#[derive(Clone, Copy, Debug, Default)]
pub struct HoldLayer;

impl<S> tower::Layer<S> for HoldLayer {
    type Service = Hold<S>;

    fn layer(&self, inner: S) -> Hold<S> {
        Hold { inner }
    }
}

#[derive(Clone, Debug)]
pub struct Hold<S> {
    inner: S,
}

impl<S, Q, B> tower::Service<http::Request<Q>> for Hold<S>
where
    S: tower::Service<http::Request<Q>, Response = http::Response<B>>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Holding<B>>;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<Q>) -> Self::Future {
        let fut = self.inner.call(req);
        Box::pin(async move {
            let mut resp = fut.await?;
            let meter = resp.extensions_mut().remove::<Meter>();
            Ok(resp.map(|inner| Holding { inner, _meter: meter, rest: bytes::Bytes::new() }))
        })
    }
}

/// A response body holding its call's [`Meter`] (see [`HoldLayer`]). A metered body hands
/// its data on in pieces of at most [`HOLD_PIECE`]: the HTTP/2 server asks for the next piece
/// only when the peer's window has room, so the meter goes only once the peer has nearly all
/// of the answer (a whole message handed on at once would sit in the connection's buffers,
/// uncounted, for as long as the peer does not read).
#[derive(Debug, Default)]
pub struct Holding<B> {
    inner: B,
    _meter: Option<Meter>,
    rest: bytes::Bytes,
}

/// The largest piece of a metered answer handed to the connection at once.
pub const HOLD_PIECE: usize = 64 << 10;

impl<B: http_body::Body<Data = bytes::Bytes> + Unpin> http_body::Body for Holding<B> {
    type Data = bytes::Bytes;
    type Error = B::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Self::Data>, Self::Error>>> {
        if self._meter.is_none() {
            return Pin::new(&mut self.inner).poll_frame(cx);
        }
        if self.rest.is_empty() {
            match std::task::ready!(Pin::new(&mut self.inner).poll_frame(cx)) {
                Some(Ok(f)) => match f.into_data() {
                    Ok(d) => self.rest = d,
                    Err(f) => return Poll::Ready(Some(Ok(f))),
                },
                other => return Poll::Ready(other),
            }
        }
        let n = self.rest.len().min(HOLD_PIECE);
        let piece = self.rest.split_to(n);
        Poll::Ready(Some(Ok(http_body::Frame::data(piece))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty() && self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let mut h = self.inner.size_hint();
        let rest = self.rest.len() as u64;
        h.set_lower(h.lower().saturating_add(rest));
        if let Some(u) = h.upper() {
            h.set_upper(u.saturating_add(rest));
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_prefix_split_across_frames_is_read_once_whole() {
        let mut p = MessagePrefix::default();
        assert_eq!(p.feed(&[0, 0]), None);
        assert_eq!(p.feed(&[]), None);
        assert_eq!(p.feed(&[1, 0x10, 0x00, 0xff, 0xee]), Some((false, 0x0001_1000)));
        assert_eq!(p.feed(&[1, 2, 3, 4, 5]), None, "only the first message's prefix");
        let mut p = MessagePrefix::default();
        assert_eq!(p.feed(&[1, 0xff, 0xff, 0xff, 0xff, 9, 9]), Some((true, u32::MAX)));
    }

    #[test]
    fn per_key_caps_and_byte_budgets() {
        let k = PerKey::new(2);
        let (a, b) = (k.try_take("alice").unwrap(), k.try_take("alice").unwrap());
        assert!(k.try_take("alice").is_none());
        assert!(k.try_take("bob").is_some(), "caps are per key");
        drop(a);
        assert!(k.try_take("alice").is_some());
        drop(b);
    }

    /// An answer waits until it fits; one key holds at most its share, so another key's
    /// answer still fits; the keys map is tidied when a key holds nothing.
    #[tokio::test]
    async fn answers_wait_their_turn_within_a_fair_share() {
        let b = AnswerBudget::new(64 << 20, 50);
        let a1 = b.reserve("alice", 30 << 20).await;
        // Alice's second 30 MiB is past her 32 MiB share: it waits, while bob's fits.
        let waiting = {
            let b = b.clone();
            tokio::spawn(async move { b.reserve("alice", 30 << 20).await })
        };
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        assert!(!waiting.is_finished(), "alice went past her share");
        let bob = tokio::time::timeout(std::time::Duration::from_secs(5), b.reserve("bob", 30 << 20)).await.unwrap();
        drop(a1);
        let a2 = tokio::time::timeout(std::time::Duration::from_secs(5), waiting).await.unwrap().unwrap();
        // More than a share takes a whole share rather than never fitting.
        drop((a2, bob));
        assert_eq!(b.free_kib(), 64 << 10);
        let huge = b.reserve("carol", 1 << 40).await;
        assert_eq!(b.free_kib(), 32 << 10);
        drop(huge);
        assert!(b.keys.lock().unwrap().is_empty(), "keys holding nothing stay in the map");
        // A waiter dropped midway leaves nothing behind either.
        let hold = b.reserve("dave", 32 << 20).await;
        let w = b.reserve("dave", 1 << 20);
        drop(tokio::time::timeout(std::time::Duration::from_millis(20), w).await);
        drop(hold);
        assert!(b.keys.lock().unwrap().is_empty());
        assert_eq!(b.free_kib(), 64 << 10);
    }

    fn grpc_message(len: usize) -> Vec<u8> {
        let mut msg = vec![0u8];
        msg.extend_from_slice(&(len as u32).to_be_bytes());
        msg.extend(std::iter::repeat_n(7u8, len));
        msg
    }

    fn body_of(frames: Vec<Vec<u8>>) -> Body {
        let frames: Vec<Result<http_body::Frame<bytes::Bytes>, tonic::Status>> =
            frames.into_iter().map(|f| Ok(http_body::Frame::data(bytes::Bytes::from(f)))).collect();
        Body::new(http_body_util::StreamBody::new(futures::stream::iter(frames)))
    }

    fn meter(budget: &Arc<AnswerBudget>, req: &impl AnswerBytes, wait_ms: u64) -> Meter {
        Meter::new(budget, "alice", req, std::time::Duration::from_millis(wait_ms)).unwrap()
    }

    /// A metered body reserves its first message's size from the gRPC prefix (split over
    /// frames or not) before passing any of it on, and the bytes come out unchanged.
    #[tokio::test]
    async fn a_metered_body_reserves_its_message_before_passing_it_on() {
        use http_body_util::BodyExt;
        let budget = AnswerBudget::new(4 << 20, 100);
        let msg = grpc_message(3 << 20);
        let body = body_of(vec![msg[..2].to_vec(), msg[2..4].to_vec(), msg[4..].to_vec()]);
        let meter = meter(&budget, &pb::ExecRequest::default(), 5_000);
        // Another answer holds 2 MiB: this one's 3 MiB waits for it.
        let other = budget.reserve("bob", 2 << 20).await;
        let mut metered = MeteredBody::new(body, meter.clone());
        let first = tokio::time::timeout(std::time::Duration::from_millis(50), metered.frame()).await;
        assert!(first.is_err(), "a frame was passed on before the answer's bytes were reserved");
        drop(other);
        let mut got = Vec::new();
        while let Some(f) = metered.frame().await {
            got.extend_from_slice(f.unwrap().data_ref().unwrap());
        }
        assert_eq!(got, msg);
        assert_eq!(meter.held_permits(), 1);
        assert_eq!(budget.free_kib(), (4 << 10) - (3 << 10) - 1, "3 MiB and the 5-byte prefix");
        drop((metered, meter));
        assert_eq!(budget.free_kib(), 4 << 10);
    }

    /// What a unary answer may not be, from a hostile agent: a second message after a small
    /// first one, one larger than the request allows, a compressed one; a listing reserves
    /// its expansion; an answer that finds no room in time fails rather than waiting forever.
    #[tokio::test]
    async fn a_metered_body_refuses_what_a_unary_answer_may_not_be() {
        use http_body_util::BodyExt;
        let budget = AnswerBudget::new(64 << 20, 100);
        let fails = |frames: Vec<Vec<u8>>, req: &dyn Fn(&Arc<AnswerBudget>) -> Meter| {
            let body = MeteredBody::new(body_of(frames), req(&budget));
            async move {
                let mut b = body;
                loop {
                    match b.frame().await {
                        Some(Ok(_)) => {}
                        Some(Err(e)) => return Some(ApiError::from_status(&e)),
                        None => return None,
                    }
                }
            }
        };
        let exec = |b: &Arc<AnswerBudget>| meter(b, &pb::ExecRequest::default(), 5_000);
        let mut two = grpc_message(10);
        two.extend(grpc_message(1 << 20));
        let e = fails(vec![two], &exec).await.expect("a second message passed");
        assert!(e.message.contains("more than one message"), "{e}");
        let stat = |b: &Arc<AnswerBudget>| meter(b, &pb::StatRequest::default(), 5_000);
        let e = fails(vec![grpc_message(SMALL_ANSWER as usize + 1)], &stat).await.expect("an oversized answer passed");
        assert_eq!(e.reason, crate::Reason::InvalidArgument, "{e}");
        let mut packed = grpc_message(10);
        packed[0] = 1;
        assert!(fails(vec![packed], &exec).await.expect("compressed").message.contains("compressed"));
        assert!(fails(vec![grpc_message(100)], &exec).await.is_none(), "a plain answer failed");

        // A 1 MiB listing reserves 64 MiB: all of the budget, so a second one waits, and
        // past its wait fails rate_limited.
        let list = |b: &Arc<AnswerBudget>| meter(b, &pb::ListDirRequest::default(), 100);
        let m = list(&budget);
        let mut held = MeteredBody::new(body_of(vec![grpc_message(1 << 20)]), m.clone());
        while held.frame().await.is_some() {}
        assert_eq!(budget.free_kib(), 0);
        let e = fails(vec![grpc_message(1 << 20)], &list).await.expect("a listing found room that was not there");
        assert_eq!(e.reason, crate::Reason::RateLimited, "{e}");
        drop((held, m));
        assert_eq!(budget.free_kib(), 64 << 10);
    }

    #[test]
    fn answers_are_bounded_by_what_was_asked() {
        let exec = pb::ExecRequest::default();
        assert_eq!(exec.answer_bytes().unwrap(), 2 * DEFAULT_OUTPUT + SMALL_ANSWER);
        let big = pb::ExecRequest {
            limits: Some(pb::OutputLimits { stdout_max_bytes: 1 << 40, stderr_max_bytes: 1 }),
            ..Default::default()
        };
        assert_eq!(big.answer_bytes().unwrap(), MAX_UNARY_OUTPUT + 1 + SMALL_ANSWER, "the agent's cap bounds it");
        let http = pb::HttpRequestRequest { max_body_bytes: MAX_HTTP_BODY + 1, ..Default::default() };
        assert_eq!(http.answer_bytes().unwrap_err().reason, crate::Reason::InvalidArgument);
        assert_eq!(pb::StatRequest::default().answer_bytes().unwrap(), SMALL_ANSWER);
    }
}
