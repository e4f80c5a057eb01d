//! The edge's calls out: IAM (ReleaseLeases, GetLeases) and the watchers (RegisterEdge), over
//! lazily connected mTLS channels with the edge's own certificate.
//!
//! IAM may run as three replicas: a call tries each address in turn, starting with the one that
//! answered last. Every call has a timeout so a dead peer never holds up a loop for long.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use opendsec_common::ApiError;
use opendsec_common::grpc::Links;
use opendsec_common::pki::Role;
use opendsec_proto::v1::iam_client::IamClient;
use opendsec_proto::v1::watcher_client::WatcherClient;
use opendsec_proto::v1::{GetLeasesRequest, Lease, RegisterEdgeRequest, ReleaseLeasesRequest};
use tonic::transport::Channel as ServiceChannel;

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
    pub fn new(edge: &str, iam_addrs: &[String], watcher_addrs: &[String], links: &Links) -> Result<Remote, ApiError> {
        let iam = iam_addrs
            .iter()
            .map(|a| {
                // ListAllPools carries every pool: the large limit, as for any internal answer.
                let c = IamClient::new(links.channel(a, Role::Iam, None)?)
                    .max_decoding_message_size(opendsec_common::grpc::MAX_MESSAGE_BYTES);
                Ok((a.clone(), c))
            })
            .collect::<Result<_, ApiError>>()?;
        let watchers = watcher_addrs
            .iter()
            .map(|a| Ok((a.clone(), WatcherClient::new(links.channel(a, Role::Watcher, None)?))))
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
                    if !opendsec_common::retry::try_elsewhere(e.reason) {
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

    /// Charges an idle member of pool `pool` of `project` (lease `lease`) like a sandbox of the
    /// project, bound to this edge (`quota_exceeded` past a limit).
    pub async fn admit_member(
        &self,
        lease: &str,
        project: &str,
        pool: &str,
        resources: opendsec_proto::v1::Resources,
    ) -> Result<(), ApiError> {
        let req = opendsec_proto::v1::AdmitMemberRequest {
            edge: self.edge.clone(),
            lease_id: lease.to_string(),
            project: project.to_string(),
            pool: pool.to_string(),
            resources: Some(resources),
        };
        self.call_iam("AdmitMember", |mut c| {
            let req = req.clone();
            async move { c.admit_member(req).await }
        })
        .await
        .map(|_| ())
    }

    /// Releases leases in one call, only those IAM binds to this edge (a lease rebound to
    /// another edge meanwhile is not ours to free); returns how many IAM released.
    pub async fn release(&self, leases: &[String]) -> Result<u32, ApiError> {
        let req = ReleaseLeasesRequest { lease_ids: leases.to_vec(), edge: self.edge.clone() };
        let resp = self
            .call_iam("ReleaseLeases", |mut c| {
                let req = req.clone();
                async move { c.release_leases(req).await }
            })
            .await?;
        Ok(resp.released)
    }

    /// Where IAM binds each of `leases`, in the same order (one GetLeases call).
    pub async fn lease_bindings(&self, leases: &[String]) -> Result<Vec<LeaseBinding>, ApiError> {
        let req = GetLeasesRequest { lease_ids: leases.to_vec() };
        let resp = self
            .call_iam("GetLeases", |mut c| {
                let req = req.clone();
                async move { c.get_leases(req).await }
            })
            .await?;
        Ok(bindings(&self.edge, leases, resp.leases))
    }

    /// Where IAM binds `lease` and since when; `None` if IAM has no such lease.
    pub async fn lease(&self, lease: &str) -> Result<Option<(String, i64)>, ApiError> {
        let req = GetLeasesRequest { lease_ids: vec![lease.to_string()] };
        let resp = self
            .call_iam("GetLeases", |mut c| {
                let req = req.clone();
                async move { c.get_leases(req).await }
            })
            .await?;
        Ok(resp.leases.into_iter().find(|l| l.id == lease).map(|l| (l.edge, l.bound_at_ms)))
    }

    /// Every pool IAM holds (one ListAllPools call).
    pub async fn all_pools(&self) -> Result<Vec<opendsec_proto::v1::Pool>, ApiError> {
        let resp = self
            .call_iam("ListAllPools", |mut c| async move {
                c.list_all_pools(opendsec_proto::v1::ListAllPoolsRequest {}).await
            })
            .await?;
        Ok(resp.pools)
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

/// Classifies each asked-for lease by IAM's answer: absent from it means IAM does not know the
/// lease (released, or never admitted).
fn bindings(edge: &str, asked: &[String], found: Vec<Lease>) -> Vec<LeaseBinding> {
    let mut by_id: HashMap<String, String> = found.into_iter().map(|l| (l.id, l.edge)).collect();
    asked
        .iter()
        .map(|id| match by_id.remove(id) {
            Some(e) if e == edge => LeaseBinding::Here,
            Some(e) => LeaseBinding::Elsewhere(e),
            None => LeaseBinding::Gone,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bindings_follow_the_answer_and_missing_means_gone() {
        let lease = |id: &str, edge: &str| Lease { id: id.into(), edge: edge.into(), ..Default::default() };
        let asked = ["a", "b", "c"].map(String::from);
        let got = bindings("e1", &asked, vec![lease("c", "e2"), lease("a", "e1")]);
        assert_eq!(got, [LeaseBinding::Here, LeaseBinding::Gone, LeaseBinding::Elsewhere("e2".into())]);
    }
}
