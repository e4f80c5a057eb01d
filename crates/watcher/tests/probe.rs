//! The watcher against fake edges over real gRPC: health after consecutive failures, an edge
//! answering under another name, registration.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opendsec_common::config::{EdgeEndpoint, WatcherConfig};
use opendsec_common::grpc;
use opendsec_proto::v1 as pb;
use opendsec_watcher::{Watcher, WatcherOptions};
use tonic::{Request, Response, Status};

const TOKEN: &str = "test-service-token";

struct FakeEdge {
    name: String,
    up: Arc<AtomicBool>,
}

#[tonic::async_trait]
impl pb::edge_server::Edge for FakeEdge {
    async fn status(&self, _r: Request<pb::StatusRequest>) -> Result<Response<pb::EdgeStatus>, Status> {
        if !self.up.load(Ordering::SeqCst) {
            return Err(Status::unavailable("down"));
        }
        Ok(Response::new(pb::EdgeStatus { edge: self.name.clone(), ..Default::default() }))
    }
    async fn create_sandbox(&self, _r: Request<pb::EdgeCreateRequest>) -> Result<Response<pb::Sandbox>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn get_sandbox(&self, _r: Request<pb::GetSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn list_sandboxes(&self, _r: Request<pb::EdgeListRequest>) -> Result<Response<pb::EdgeListResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn stop_sandbox(&self, _r: Request<pb::StopSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn pause_sandbox(&self, _r: Request<pb::PauseSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn resume_sandbox(&self, _r: Request<pb::ResumeSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn set_sandbox_timeout(
        &self,
        _r: Request<pb::SetSandboxTimeoutRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

async fn fake_edge(answers_as: &str) -> (String, Arc<AtomicBool>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let up = Arc::new(AtomicBool::new(true));
    let svc = pb::edge_server::EdgeServer::with_interceptor(
        FakeEdge { name: answers_as.into(), up: up.clone() },
        grpc::RequireServiceToken::new(TOKEN),
    );
    tokio::spawn(grpc::serve(grpc::server().add_service(svc), l, std::future::pending()));
    (addr, up)
}

fn edge_info<'a>(snap: &'a pb::ClusterSnapshot, name: &str) -> &'a pb::EdgeInfo {
    snap.edges.iter().find(|e| e.name == name).unwrap()
}

#[tokio::test]
async fn health_follows_probes() {
    let (good, good_up) = fake_edge("good").await;
    let (liar, _) = fake_edge("someone-else").await;
    let config = WatcherConfig { probe_timeout: Duration::from_millis(300), ..WatcherConfig::default() };
    let w = Watcher::new(WatcherOptions {
        id: "w1".into(),
        config,
        edges: vec![
            EdgeEndpoint { name: "good".into(), address: good },
            EdgeEndpoint { name: "liar".into(), address: liar },
        ],
        iam_addrs: vec![],
        service_token: TOKEN.into(),
    })
    .unwrap();

    w.probe_round().await;
    let snap = w.snapshot();
    assert_eq!(snap.version, 1);
    assert!(edge_info(&snap, "good").healthy);
    assert!(!edge_info(&snap, "liar").healthy, "an edge answering under another name is not healthy");

    // Two failures are tolerated, the third makes the edge unhealthy.
    good_up.store(false, Ordering::SeqCst);
    for _ in 0..2 {
        w.probe_round().await;
        assert!(edge_info(&w.snapshot(), "good").healthy);
    }
    w.probe_round().await;
    let snap = w.snapshot();
    assert!(!edge_info(&snap, "good").healthy);
    assert!(edge_info(&snap, "good").unhealthy_since_ms > 0);
    assert_eq!(snap.version, 4);

    good_up.store(true, Ordering::SeqCst);
    w.probe_round().await;
    assert!(edge_info(&w.snapshot(), "good").healthy);
    assert_eq!(edge_info(&w.snapshot(), "good").unhealthy_since_ms, 0);
}

#[tokio::test]
async fn edges_register_and_bad_registrations_are_refused() {
    let (addr, _) = fake_edge("late").await;
    let w = Watcher::new(WatcherOptions {
        id: "w1".into(),
        config: WatcherConfig::default(),
        edges: vec![],
        iam_addrs: vec![],
        service_token: TOKEN.into(),
    })
    .unwrap();
    assert!(w.register("Bad.Name", &addr).is_err());
    assert!(w.register("late", "").is_err());
    w.register("late", &addr).unwrap();
    w.probe_round().await;
    assert!(edge_info(&w.snapshot(), "late").healthy);
    // Without IAM no watcher can lead reconciliation, and it says so instead of acting.
    let r = w.reconcile_round().await;
    assert!(!r.leader);
    assert_eq!(r.errors, 1);
}
