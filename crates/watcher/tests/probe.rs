//! The watcher against fake edges over real gRPC and mTLS: health after consecutive failures,
//! an edge answering under another name or holding another edge's certificate, registration
//! (only as the edge of the caller's certificate).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use opendsec_common::config::{EdgeEndpoint, WatcherConfig};
use opendsec_common::grpc;
use opendsec_common::pki::Role;
use opendsec_proto::v1 as pb;
use opendsec_testkit::creds;
use opendsec_watcher::{Watcher, WatcherOptions};
use tonic::{Request, Response, Status};

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
    async fn set_draining(&self, _r: Request<pb::SetDrainingRequest>) -> Result<Response<pb::EdgeStatus>, Status> {
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
    async fn update_network(&self, _r: Request<pb::UpdateNetworkRequest>) -> Result<Response<pb::Sandbox>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn get_sandbox_metrics(
        &self,
        _r: Request<pb::GetSandboxMetricsRequest>,
    ) -> Result<Response<pb::SandboxMetrics>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn create_snapshot(
        &self,
        _r: Request<pb::EdgeSnapshotRequest>,
    ) -> Result<Response<pb::EdgeSnapshot>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn move_out(&self, _r: Request<pb::EdgeMoveOutRequest>) -> Result<Response<pb::EdgeMoveOut>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn finish_move(&self, _r: Request<pb::EdgeFinishMoveRequest>) -> Result<Response<pb::Sandbox>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn save_session(&self, _r: Request<pb::SaveSessionRequest>) -> Result<Response<pb::SessionSaved>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

/// A fake edge serving with the certificate of edge `cert` and answering Status as
/// `answers_as`.
async fn fake_edge(pki: &std::path::Path, cert: &str, answers_as: &str) -> (String, Arc<AtomicBool>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let up = Arc::new(AtomicBool::new(true));
    let svc = pb::edge_server::EdgeServer::new(FakeEdge { name: answers_as.into(), up: up.clone() });
    let tls = creds(pki, Role::Edge, cert);
    tokio::spawn(async move {
        grpc::serve_internal(grpc::internal_server().add_service(svc), l, &tls, std::future::pending()).await
    });
    (addr, up)
}

fn edge_info<'a>(snap: &'a pb::ClusterSnapshot, name: &str) -> &'a pb::EdgeInfo {
    snap.edges.iter().find(|e| e.name == name).unwrap()
}

#[tokio::test]
async fn health_follows_probes() {
    let pki = tempfile::tempdir().unwrap();
    let (good, good_up) = fake_edge(pki.path(), "good", "good").await;
    let (liar, _) = fake_edge(pki.path(), "liar", "someone-else").await;
    let (impostor, _) = fake_edge(pki.path(), "someone-else", "impostor").await;
    let config = WatcherConfig { probe_timeout: Duration::from_millis(300), ..WatcherConfig::default() };
    let w = Watcher::new(WatcherOptions {
        id: "w1".into(),
        config,
        edges: vec![
            EdgeEndpoint { name: "good".into(), address: good },
            EdgeEndpoint { name: "liar".into(), address: liar },
            EdgeEndpoint { name: "impostor".into(), address: impostor },
        ],
        iam_addrs: vec![],
        tls: creds(pki.path(), Role::Watcher, "0"),
    })
    .unwrap();

    w.probe_round().await;
    let snap = w.snapshot();
    assert_eq!(snap.version, 1);
    assert!(edge_info(&snap, "good").healthy);
    assert!(!edge_info(&snap, "liar").healthy, "an edge answering under another name is not healthy");
    assert!(!edge_info(&snap, "impostor").healthy, "an edge with another edge's certificate is not healthy");

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
    let pki = tempfile::tempdir().unwrap();
    let (addr, _) = fake_edge(pki.path(), "late", "late").await;
    let w = Watcher::new(WatcherOptions {
        id: "w1".into(),
        config: WatcherConfig::default(),
        edges: vec![],
        iam_addrs: vec![],
        tls: creds(pki.path(), Role::Watcher, "0"),
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

/// Through the real server: an edge registers only under its own certificate's name; other
/// roles may not register at all; snapshots are for apiservers; no certificate, no call.
#[tokio::test]
async fn registration_is_by_certificate_and_methods_by_role() {
    let pki = tempfile::tempdir().unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let opts = WatcherOptions {
        id: "w1".into(),
        config: WatcherConfig { probe_interval: Duration::from_millis(50), ..WatcherConfig::default() },
        edges: vec![],
        iam_addrs: vec![],
        tls: creds(pki.path(), Role::Watcher, "0"),
    };
    tokio::spawn(opendsec_watcher::serve(opts, l, std::future::pending()));
    let client = |role: Role, name: &str| {
        let links = grpc::Links::new(creds(pki.path(), role, name));
        pb::watcher_client::WatcherClient::new(links.channel(&addr, Role::Watcher, None).unwrap())
    };
    let reg = |name: &str| pb::RegisterEdgeRequest { name: name.into(), address: "127.0.0.1:1".into() };
    let reason = |s: Status| opendsec_common::ApiError::from_status(&s).reason;

    client(Role::Edge, "e1").register_edge(reg("e1")).await.unwrap();
    let e = client(Role::Edge, "e1").register_edge(reg("e2")).await.unwrap_err();
    assert_eq!(reason(e), opendsec_common::Reason::PermissionDenied);
    let e = client(Role::Apiserver, "0").register_edge(reg("e3")).await.unwrap_err();
    assert_eq!(reason(e), opendsec_common::Reason::PermissionDenied);
    let e = client(Role::Edge, "e1").get_snapshot(pb::GetSnapshotRequest {}).await.unwrap_err();
    assert_eq!(reason(e), opendsec_common::Reason::PermissionDenied);
    // The next probe round's snapshot lists the edge that registered as itself only.
    let mut api = client(Role::Apiserver, "0");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    let snap = loop {
        let snap = api.get_snapshot(pb::GetSnapshotRequest {}).await.unwrap().into_inner();
        if snap.edges.iter().any(|e| e.name == "e1") {
            break snap;
        }
        assert!(tokio::time::Instant::now() < deadline, "e1 never appeared");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(!snap.edges.iter().any(|e| e.name == "e2" || e.name == "e3"), "{snap:?}");
    // Plain text and a certificate from another CA get nowhere.
    let mut plain = pb::watcher_client::WatcherClient::new(grpc::channel(&addr).unwrap());
    assert!(plain.get_snapshot(pb::GetSnapshotRequest {}).await.is_err());
    let other = tempfile::tempdir().unwrap();
    let foreign = grpc::Links::new(creds(other.path(), Role::Apiserver, "0"));
    let mut c = pb::watcher_client::WatcherClient::new(foreign.channel(&addr, Role::Watcher, None).unwrap());
    assert!(c.get_snapshot(pb::GetSnapshotRequest {}).await.is_err());
}
