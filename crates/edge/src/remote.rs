//! The edge's calls out: IAM (ReleaseLeases, GetLease) and the watchers (RegisterEdge), over
//! lazily connected channels that carry the service token.
//!
//! IAM may run as three replicas: a call tries each address in turn, starting with the one that
//! answered last. Every call has a timeout so a dead peer never holds up a loop for long.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use opendsec_common::ApiError;
use opendsec_common::grpc::{self, AttachServiceToken, ServiceChannel};
use opendsec_proto::v1::iam_client::IamClient;
use opendsec_proto::v1::watcher_client::WatcherClient;
use opendsec_proto::v1::{GetLeaseRequest, RegisterEdgeRequest, ReleaseLeasesRequest};

/// Timeout of one call to IAM or a watcher.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Where IAM says a lease is bound.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LeaseBinding {
    /// Bound to this edge.
    Here,
    /// Bound to another edge: the caller retried the creation there.
    Elsewhere(String),
    /// IAM has no such lease (released, or never admitted).
    Gone,
}

pub(crate) struct Remote {
    edge: String,
    iam: Vec<(String, IamClient<ServiceChannel>)>,
    preferred: AtomicUsize,
    watchers: Vec<(String, WatcherClient<ServiceChannel>)>,
}

impl Remote {
    pub fn new(edge: &str, iam_addrs: &[String], watcher_addrs: &[String], token: &str) -> Result<Remote, ApiError> {
        let token = AttachServiceToken::new(token)?;
        let chan = |addr: &String| -> Result<ServiceChannel, ApiError> {
            Ok(grpc::service_channel(grpc::channel(addr)?, &token))
        };
        let iam =
            iam_addrs.iter().map(|a| Ok((a.clone(), IamClient::new(chan(a)?)))).collect::<Result<_, ApiError>>()?;
        let watchers = watcher_addrs
            .iter()
            .map(|a| Ok((a.clone(), WatcherClient::new(chan(a)?))))
            .collect::<Result<_, ApiError>>()?;
        Ok(Remote { edge: edge.to_string(), iam, preferred: AtomicUsize::new(0), watchers })
    }

    pub fn has_iam(&self) -> bool {
        !self.iam.is_empty()
    }

    /// Calls IAM, trying each address once, the last good one first.
    async fn call_iam<T, F, Fut>(&self, what: &str, f: F) -> Result<T, ApiError>
    where
        F: Fn(IamClient<ServiceChannel>) -> Fut,
        Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    {
        let n = self.iam.len();
        if n == 0 {
            return Err(ApiError::unavailable("no IAM address configured"));
        }
        let start = self.preferred.load(Ordering::Relaxed) % n;
        let mut last = ApiError::unavailable("no IAM answered");
        for i in 0..n {
            let idx = (start + i) % n;
            let (addr, client) = &self.iam[idx];
            match tokio::time::timeout(CALL_TIMEOUT, f(client.clone())).await {
                Ok(Ok(resp)) => {
                    self.preferred.store(idx, Ordering::Relaxed);
                    return Ok(resp.into_inner());
                }
                Ok(Err(status)) => {
                    let e = ApiError::from_status(&status);
                    tracing::debug!(iam = %addr, call = what, reason = %e.reason, "IAM call failed");
                    // Only "try elsewhere" answers move on to the next address.
                    if !e.reason.retryable() {
                        return Err(e);
                    }
                    last = e;
                }
                Err(_) => {
                    tracing::debug!(iam = %addr, call = what, "IAM call timed out");
                    last = ApiError::unavailable(format!("IAM at {addr} did not answer {what} in time"));
                }
            }
        }
        Err(last)
    }

    /// Releases leases in one call; returns how many IAM released.
    pub async fn release(&self, leases: &[String]) -> Result<u32, ApiError> {
        let req = ReleaseLeasesRequest { lease_ids: leases.to_vec() };
        let resp = self
            .call_iam("ReleaseLeases", |mut c| {
                let req = req.clone();
                async move { c.release_leases(req).await }
            })
            .await?;
        Ok(resp.released)
    }

    /// Where IAM binds `lease`.
    pub async fn lease_binding(&self, lease: &str) -> Result<LeaseBinding, ApiError> {
        let req = GetLeaseRequest { lease_id: lease.to_string() };
        let resp = self
            .call_iam("GetLease", |mut c| {
                let req = req.clone();
                async move { c.get_lease(req).await }
            })
            .await?;
        Ok(match (resp.found, resp.lease) {
            (true, Some(l)) if l.edge == self.edge => LeaseBinding::Here,
            (true, Some(l)) => LeaseBinding::Elsewhere(l.edge),
            _ => LeaseBinding::Gone,
        })
    }

    /// Registers this edge with every watcher; failures are logged and retried next round.
    pub async fn register(&self, advertise: &str) {
        let calls = self.watchers.iter().map(|(addr, client)| {
            let mut client = client.clone();
            let req = RegisterEdgeRequest { name: self.edge.clone(), address: advertise.to_string() };
            async move {
                match tokio::time::timeout(CALL_TIMEOUT, client.register_edge(req)).await {
                    Ok(Ok(_)) => tracing::trace!(watcher = %addr, "registered"),
                    Ok(Err(status)) => {
                        tracing::debug!(watcher = %addr, error = %ApiError::from_status(&status), "registration failed")
                    }
                    Err(_) => tracing::debug!(watcher = %addr, "registration timed out"),
                }
            }
        });
        futures::future::join_all(calls).await;
    }
}
