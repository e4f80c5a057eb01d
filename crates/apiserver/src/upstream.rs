//! Clients of the components the apiserver depends on: IAM (internal and Admin services), the
//! watchers and the edges, all over pooled mTLS channels with the apiserver's certificate; an
//! edge must present the certificate of the edge the caller meant.
//!
//! IAM may run as several replicas: calls start at the address that answered last and move on
//! to the next on `unavailable` or `not_leader`. Admin calls move on only on `not_leader` (an
//! `unavailable` mutation may have been applied, and the caller decides whether to retry it).
//! Every answer from IAM, and every snapshot, is timestamped for `/readyz`.

use std::future::Future;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use std::sync::Arc;

use opendsec_common::bounds::{Meter, Metered};
use opendsec_common::grpc::{Links, MAX_MESSAGE_BYTES};
use opendsec_common::pki::Role;
use opendsec_common::{ApiError, Reason};
use opendsec_proto::v1 as pb;
use opendsec_proto::v1::admin_client::AdminClient;
use opendsec_proto::v1::edge_client::EdgeClient;
use opendsec_proto::v1::iam_client::IamClient;
use opendsec_proto::v1::runtime_client::RuntimeClient;
use opendsec_proto::v1::watcher_client::WatcherClient;
use tonic::transport::Channel as ServiceChannel;

/// Longest wait for one IAM or watcher call.
pub const UPSTREAM_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// When the apiserver last heard from IAM and from a watcher (for `/readyz`).
#[derive(Debug, Default)]
pub struct Health {
    last_iam: Mutex<Option<Instant>>,
    last_snapshot: Mutex<Option<Instant>>,
}

impl Health {
    pub fn iam_answered(&self) {
        *self.last_iam.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    pub fn snapshot_received(&self) {
        *self.last_snapshot.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    /// Ready when both IAM and a watcher answered within `grace`; else the reason.
    pub fn check(&self, grace: Duration, now: Instant) -> Result<(), String> {
        let iam = *self.last_iam.lock().unwrap_or_else(|p| p.into_inner());
        let snap = *self.last_snapshot.lock().unwrap_or_else(|p| p.into_inner());
        let stale = |what: &str, t: Option<Instant>| match t {
            None => Err(format!("no {what} yet")),
            Some(t) if now.saturating_duration_since(t) > grace => Err(format!(
                "no {what} for {} s (grace {} s)",
                now.saturating_duration_since(t).as_secs(),
                grace.as_secs()
            )),
            Some(_) => Ok(()),
        };
        stale("answer from IAM", iam)?;
        stale("cluster snapshot from a watcher", snap)
    }
}

/// Whether a status means "no answer from this server" (the call may go to another replica).
fn no_answer(e: &ApiError) -> bool {
    matches!(e.reason, Reason::Unavailable | Reason::NotLeader | Reason::DeadlineExceeded)
}

#[derive(Debug)]
pub struct Upstreams {
    links: Arc<Links>,
    iam_addrs: Vec<String>,
    iam_next: AtomicUsize,
    watcher_addrs: Vec<String>,
    watcher_next: AtomicUsize,
    pub health: Health,
}

impl Upstreams {
    pub fn new(links: Arc<Links>, iam_addrs: Vec<String>, watcher_addrs: Vec<String>) -> Upstreams {
        Upstreams {
            links,
            iam_addrs,
            iam_next: AtomicUsize::new(0),
            watcher_addrs,
            watcher_next: AtomicUsize::new(0),
            health: Health::default(),
        }
    }

    /// The channel to edge `name` at `addr` (for calls the generated clients cannot make,
    /// such as an abortable upload). An unusable address is `unavailable`.
    pub fn edge_channel(&self, name: &str, addr: &str) -> Result<ServiceChannel, ApiError> {
        self.links
            .channel(addr, Role::Edge, Some(name))
            .map_err(|e| ApiError::unavailable(format!("edge address {addr:?} is not usable: {}", e.message)))
    }

    /// A client of edge `name` at `addr`. An unusable address means the edge cannot serve, so
    /// it is `unavailable` (a creation then tries another edge), not the caller's mistake.
    pub fn edge(&self, name: &str, addr: &str) -> Result<EdgeClient<ServiceChannel>, ApiError> {
        Ok(EdgeClient::new(self.edge_channel(name, addr)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES))
    }

    /// A client of the `Runtime` service edge `name` serves beside `Edge` (same address),
    /// its unary answers counted in `meter` when given; an unusable address is
    /// `unavailable`, as for [`Self::edge`].
    pub fn runtime(
        &self,
        name: &str,
        addr: &str,
        meter: Option<Meter>,
    ) -> Result<RuntimeClient<Metered<ServiceChannel>>, ApiError> {
        let decode = meter.as_ref().map_or(MAX_MESSAGE_BYTES, Meter::max_bytes);
        Ok(RuntimeClient::new(Metered::new(self.edge_channel(name, addr)?, meter))
            .max_decoding_message_size(decode)
            .max_encoding_message_size(MAX_MESSAGE_BYTES))
    }

    fn iam_client(&self, addr: &str) -> Result<IamClient<ServiceChannel>, ApiError> {
        Ok(IamClient::new(self.links.channel(addr, Role::Iam, None)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES))
    }

    fn admin_client(&self, addr: &str) -> Result<AdminClient<ServiceChannel>, ApiError> {
        Ok(AdminClient::new(self.links.channel(addr, Role::Iam, None)?)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES))
    }

    /// Calls IAM's internal service, moving to the next replica when one does not answer.
    pub async fn iam<T, F, Fut>(&self, mut call: F) -> Result<T, ApiError>
    where
        F: FnMut(IamClient<ServiceChannel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let n = self.iam_addrs.len();
        let start = self.iam_next.load(Ordering::Relaxed);
        let mut last = ApiError::unavailable("no IAM address configured");
        for i in 0..n {
            let idx = (start + i) % n;
            let client = self.iam_client(&self.iam_addrs[idx])?;
            let result = match tokio::time::timeout(UPSTREAM_CALL_TIMEOUT, call(client)).await {
                Ok(r) => r.map_err(|s| ApiError::from_status(&s)),
                Err(_) => Err(ApiError::new(Reason::DeadlineExceeded, "IAM did not answer in time")),
            };
            match result {
                Ok(resp) => {
                    self.iam_next.store(idx, Ordering::Relaxed);
                    self.health.iam_answered();
                    return Ok(resp.into_inner());
                }
                Err(e) if no_answer(&e) => last = e,
                Err(e) => {
                    self.iam_next.store(idx, Ordering::Relaxed);
                    self.health.iam_answered();
                    return Err(e);
                }
            }
        }
        Err(last)
    }

    /// Calls IAM's Admin service with a request built per attempt; statuses come back as they
    /// are. Moves to the next replica only on `not_leader`.
    pub async fn admin<T, F, Fut>(&self, mut call: F) -> Result<tonic::Response<T>, tonic::Status>
    where
        F: FnMut(AdminClient<ServiceChannel>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let n = self.iam_addrs.len();
        let start = self.iam_next.load(Ordering::Relaxed);
        let mut last = ApiError::unavailable("no IAM address configured").to_status();
        for i in 0..n {
            let idx = (start + i) % n;
            let client = self.admin_client(&self.iam_addrs[idx]).map_err(|e| e.to_status())?;
            let result = match tokio::time::timeout(UPSTREAM_CALL_TIMEOUT, call(client)).await {
                Ok(r) => r,
                Err(_) => return Err(ApiError::new(Reason::DeadlineExceeded, "IAM did not answer in time").to_status()),
            };
            let answered = match &result {
                Ok(_) => true,
                Err(s) => !no_answer(&ApiError::from_status(s)),
            };
            if answered {
                self.iam_next.store(idx, Ordering::Relaxed);
                self.health.iam_answered();
            }
            match result {
                Err(s) if ApiError::from_status(&s).reason == Reason::NotLeader => last = s,
                other => return other,
            }
        }
        Err(last)
    }

    /// The cluster snapshot from the first watcher that gives one.
    pub async fn snapshot(&self) -> Result<pb::ClusterSnapshot, ApiError> {
        let n = self.watcher_addrs.len();
        let start = self.watcher_next.load(Ordering::Relaxed);
        let mut last = ApiError::unavailable("no watcher address configured");
        for i in 0..n {
            let idx = (start + i) % n;
            let mut client = WatcherClient::new(self.links.channel(&self.watcher_addrs[idx], Role::Watcher, None)?)
                .max_decoding_message_size(MAX_MESSAGE_BYTES);
            let result =
                match tokio::time::timeout(UPSTREAM_CALL_TIMEOUT, client.get_snapshot(pb::GetSnapshotRequest {})).await
                {
                    Ok(r) => r.map_err(|s| ApiError::from_status(&s)),
                    Err(_) => Err(ApiError::new(Reason::DeadlineExceeded, "watcher did not answer in time")),
                };
            match result {
                Ok(resp) => {
                    self.watcher_next.store(idx, Ordering::Relaxed);
                    self.health.snapshot_received();
                    return Ok(resp.into_inner());
                }
                Err(e) => last = e,
            }
        }
        Err(last)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readiness_needs_both_and_fails_after_the_grace() {
        let h = Health::default();
        let grace = Duration::from_secs(15);
        let now = Instant::now();
        assert!(h.check(grace, now).unwrap_err().contains("IAM"));
        h.iam_answered();
        assert!(h.check(grace, Instant::now()).unwrap_err().contains("snapshot"));
        h.snapshot_received();
        assert!(h.check(grace, Instant::now()).is_ok());
        let why = h.check(grace, Instant::now() + Duration::from_secs(20)).unwrap_err();
        assert!(why.contains("grace"), "{why}");
    }
}
