//! The Rust client's creation retries against a fake apiserver that refuses with
//! `no_capacity` first: a lease id of the client's own is replaced for the next attempt (the
//! refused one names a FAILED sandbox), a lease id the caller chose is not retried.
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opendsec_client::Client;
use opendsec_common::{ApiError, Reason, grpc};
use opendsec_proto::v1 as pb;
use pb::sandboxes_server::{Sandboxes, SandboxesServer};
use tonic::{Request, Response, Status};

#[derive(Clone, Default)]
struct Full {
    /// Lease ids asked for, in order.
    leases: Arc<Mutex<Vec<String>>>,
    /// Creations refused before one is answered.
    refuse: Arc<Mutex<u32>>,
}

fn no<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented("not in the fake"))
}

#[tonic::async_trait]
impl Sandboxes for Full {
    async fn create_sandbox(&self, req: Request<pb::CreateSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let req = req.into_inner();
        self.leases.lock().unwrap().push(req.lease_id.clone());
        let mut refuse = self.refuse.lock().unwrap();
        if *refuse > 0 {
            *refuse -= 1;
            return Err(ApiError::new(Reason::NoCapacity, "every edge is full").to_status());
        }
        Ok(Response::new(pb::Sandbox { id: format!("e.{}", req.lease_id), ..Default::default() }))
    }
    type CreateSandboxesStream = tokio_stream::Empty<Result<pb::CreateSandboxesResponse, Status>>;
    async fn create_sandboxes(
        &self,
        _: Request<pb::CreateSandboxesRequest>,
    ) -> Result<Response<Self::CreateSandboxesStream>, Status> {
        no()
    }
    type ForkSandboxStream = tokio_stream::Empty<Result<pb::CreateSandboxesResponse, Status>>;
    async fn fork_sandbox(
        &self,
        _: Request<pb::ForkSandboxRequest>,
    ) -> Result<Response<Self::ForkSandboxStream>, Status> {
        no()
    }
    async fn move_sandbox(&self, _: Request<pb::MoveSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        no()
    }
    async fn drain_edge(&self, _: Request<pb::DrainEdgeRequest>) -> Result<Response<pb::DrainEdgeResponse>, Status> {
        no()
    }
    async fn save_session(&self, _: Request<pb::SaveSessionRequest>) -> Result<Response<pb::SessionSaved>, Status> {
        no()
    }
    async fn create_sandbox_tokens(
        &self,
        _: Request<pb::CreateSandboxTokensRequest>,
    ) -> Result<Response<pb::SandboxTokens>, Status> {
        no()
    }
    async fn get_sandbox(&self, _: Request<pb::GetSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        no()
    }
    async fn list_sandboxes(
        &self,
        _: Request<pb::ListSandboxesRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        no()
    }
    async fn stop_sandbox(&self, _: Request<pb::StopSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        no()
    }
    async fn pause_sandbox(&self, _: Request<pb::PauseSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        no()
    }
    async fn resume_sandbox(&self, _: Request<pb::ResumeSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        no()
    }
    async fn set_sandbox_timeout(
        &self,
        _: Request<pb::SetSandboxTimeoutRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        no()
    }
    async fn update_network(&self, _: Request<pb::UpdateNetworkRequest>) -> Result<Response<pb::Sandbox>, Status> {
        no()
    }
    async fn get_sandbox_metrics(
        &self,
        _: Request<pb::GetSandboxMetricsRequest>,
    ) -> Result<Response<pb::SandboxMetrics>, Status> {
        no()
    }
    async fn create_snapshot(&self, _: Request<pb::CreateSnapshotRequest>) -> Result<Response<pb::Snapshot>, Status> {
        no()
    }
}

async fn serve(fake: Full) -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(SandboxesServer::new(fake))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(l)),
    );
    addr
}

#[tokio::test]
async fn after_no_capacity_an_own_lease_is_replaced_and_a_callers_is_final() {
    let fake = Full::default();
    let addr = serve(fake.clone()).await;
    let c =
        Client::new(&[addr], None, &grpc::PublicTls::Plaintext).unwrap().with_retry_timeout(Duration::from_secs(20));

    *fake.refuse.lock().unwrap() = 2;
    let sb = c.create_sandbox(pb::SandboxSpec::default()).await.unwrap();
    let leases = fake.leases.lock().unwrap().clone();
    assert_eq!(leases.len(), 3, "{leases:?}");
    assert_eq!(leases.iter().collect::<std::collections::HashSet<_>>().len(), 3, "a fresh lease each time: {leases:?}");
    assert_eq!(sb.id, format!("e.{}", leases[2]));

    fake.leases.lock().unwrap().clear();
    *fake.refuse.lock().unwrap() = 1;
    let req = pb::CreateSandboxRequest { spec: Some(pb::SandboxSpec::default()), lease_id: "my-key".into() };
    let err = c.create_sandbox_with(req).await.unwrap_err();
    assert_eq!(err.reason, Reason::NoCapacity);
    assert_eq!(*fake.leases.lock().unwrap(), ["my-key"], "the caller's key is not retried on no_capacity");
}
