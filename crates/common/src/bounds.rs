//! Bounds on what calls in flight may hold, shared by the apiserver and the edge: in-flight
//! counts per key (principal, sandbox) and a budget of the bytes unary answers hold, with what
//! each Runtime request's answer may hold ([`AnswerBytes`]). Every Runtime answer is held whole
//! in memory at each hop it crosses; the budget is what keeps a tenant asking for many large
//! answers at once from taking a process's memory.
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

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

/// The most bytes the answer to a Runtime request can hold.
pub trait AnswerBytes {
    fn answer_bytes(&self) -> Result<u64, ApiError> {
        Ok(SMALL_ANSWER)
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
    pb::ListDirRequest,
    pb::StatRequest,
    pb::MakeDirRequest,
    pb::RemoveRequest,
    pb::MoveRequest,
    pb::StartProcessRequest,
    pb::ConnectProcessRequest,
    pb::SendInputRequest,
    pb::SignalProcessRequest,
    pb::ListProcessesRequest,
    pb::WatchRequest,
);

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

/// Bytes that answers in flight may hold, counted in KiB.
#[derive(Debug)]
pub struct ByteBudget {
    kib: Arc<tokio::sync::Semaphore>,
    total_kib: u32,
}

impl ByteBudget {
    pub fn new(bytes: u64) -> ByteBudget {
        let total_kib = u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX).max(1);
        ByteBudget { kib: Arc::new(tokio::sync::Semaphore::new(total_kib as usize)), total_kib }
    }

    /// Reserves `bytes` (at most the whole budget) until the permit is dropped; `None` when
    /// that much is not free now.
    pub fn try_reserve(&self, bytes: u64) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let kib = u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX).clamp(1, self.total_kib);
        self.kib.clone().try_acquire_many_owned(kib).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn per_key_caps_and_byte_budgets() {
        let k = PerKey::new(2);
        let (a, b) = (k.try_take("alice").unwrap(), k.try_take("alice").unwrap());
        assert!(k.try_take("alice").is_none());
        assert!(k.try_take("bob").is_some(), "caps are per key");
        drop(a);
        assert!(k.try_take("alice").is_some());
        drop(b);
        let budget = ByteBudget::new(64 << 20);
        let big = budget.try_reserve(48 << 20).unwrap();
        assert!(budget.try_reserve(32 << 20).is_none());
        let small = budget.try_reserve(8 << 20).unwrap();
        drop(big);
        assert!(budget.try_reserve(40 << 20).is_some());
        drop(small);
        // More than the whole budget takes the whole budget rather than never fitting.
        assert!(budget.try_reserve(1 << 40).is_some());
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
