//! The watcher against fake edges over real gRPC and mTLS: health after consecutive failures,
//! an edge answering under another name or holding another edge's certificate, registration
//! (only as the edge of the caller's certificate); reconciliation rounds against a real IAM.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
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
    /// How long a Status with leases (a reconciliation's) takes, and who asked, in order.
    slow: Duration,
    asked: Arc<Mutex<Vec<String>>>,
}

#[tonic::async_trait]
impl pb::edge_server::Edge for FakeEdge {
    async fn status(&self, r: Request<pb::StatusRequest>) -> Result<Response<pb::EdgeStatus>, Status> {
        if !self.up.load(Ordering::SeqCst) {
            return Err(Status::unavailable("down"));
        }
        if r.get_ref().include_leases {
            self.asked.lock().unwrap().push(self.name.clone());
            tokio::time::sleep(self.slow).await;
        }
        Ok(Response::new(pb::EdgeStatus { edge: self.name.clone(), ..Default::default() }))
    }
    async fn create_sandbox(&self, _r: Request<pb::EdgeCreateRequest>) -> Result<Response<pb::Sandbox>, Status> {
        Err(Status::unimplemented("fake"))
    }
    type CreateManyStream = futures::stream::Empty<Result<pb::EdgeCreateResult, Status>>;
    async fn create_many(
        &self,
        _r: Request<pb::EdgeCreateManyRequest>,
    ) -> Result<Response<Self::CreateManyStream>, Status> {
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
    slow_edge(pki, cert, answers_as, Duration::ZERO, Default::default()).await
}

async fn slow_edge(
    pki: &std::path::Path,
    cert: &str,
    answers_as: &str,
    slow: Duration,
    asked: Arc<Mutex<Vec<String>>>,
) -> (String, Arc<AtomicBool>) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let up = Arc::new(AtomicBool::new(true));
    let svc = pb::edge_server::EdgeServer::new(FakeEdge { name: answers_as.into(), up: up.clone(), slow, asked });
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

/// A real IAM served at `addr` (its data in `dir`) until the returned sender is dropped or
/// fired; the handle ends once it has shut down.
async fn iam_at(
    dir: &std::path::Path,
    pki: &std::path::Path,
    addr: &str,
) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let mut cfg = opendsec_common::config::Config { state_dir: dir.to_path_buf(), ..Default::default() };
    cfg.iam.admin_token = format!("dsk.admin.{}", "s".repeat(32));
    let iam = opendsec_iam::Iam::open(opendsec_iam::IamOptions::from_config(&cfg)).unwrap();
    let l = tokio::net::TcpListener::bind(addr).await.unwrap();
    let tls = creds(pki, Role::Iam, "0");
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let done = tokio::spawn(async move {
        let keep = iam.clone();
        let _ = opendsec_iam::serve(iam, l, &tls, async move {
            let _ = rx.await;
        })
        .await;
        keep.shutdown().await;
    });
    (tx, done)
}

/// A round longer than the lock's TTL keeps the lock and reaches every edge; a round cut short
/// (IAM gone: the lock cannot be renewed) stops at the end of its window, and the next round
/// begins with the edges it did not reach, so that no edge waits forever behind the others.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_rounds_renew_the_lock_and_resume_where_they_stopped() {
    let pki = tempfile::tempdir().unwrap();
    let data = tempfile::tempdir().unwrap();
    let iam_addr = format!("127.0.0.1:{}", opendsec_testkit::free_port());
    let (iam, iam_done) = iam_at(data.path(), pki.path(), &iam_addr).await;
    let asked = Arc::new(Mutex::new(Vec::new()));
    let mut edges = Vec::new();
    for i in 0..48 {
        let name = format!("e{i:02}");
        let (addr, _) = slow_edge(pki.path(), &name, &name, Duration::from_millis(600), asked.clone()).await;
        edges.push(EdgeEndpoint { name, address: addr });
    }
    // Leader for 1 s after each (re)acquisition, renewed at half of it; one round takes
    // 48 / 16 x 600 ms at least.
    let config = WatcherConfig { lock_ttl: Duration::from_millis(3000), ..WatcherConfig::default() };
    let w = Watcher::new(WatcherOptions {
        id: "w1".into(),
        config,
        edges: edges.clone(),
        iam_addrs: vec![iam_addr.clone()],
        tls: creds(pki.path(), Role::Watcher, "0"),
    })
    .unwrap();
    w.probe_round().await;
    let r = w.reconcile_round().await;
    assert!(r.leader, "{r:?}");
    assert_eq!((r.edges_reconciled, r.errors), (48, 0), "the whole round, under a renewed lock: {r:?}");
    let first: Vec<String> = std::mem::take(&mut *asked.lock().unwrap());
    assert_eq!(first.len(), 48);

    // IAM goes away a moment into the next round: what was asked fails, the lock cannot be
    // renewed, and the round stops without reaching every edge.
    let round = {
        let w = w.clone();
        tokio::spawn(async move { w.reconcile_round().await })
    };
    tokio::time::sleep(Duration::from_millis(150)).await;
    drop(iam);
    let r = round.await.unwrap();
    let reached: Vec<String> = std::mem::take(&mut *asked.lock().unwrap());
    assert!(r.leader && r.errors > 0, "{r:?}");
    assert!(reached.len() < 48, "the round went on without a lock: {reached:?}");
    // The next round, IAM back, starts after the last edge the cut-short one reached.
    iam_done.await.unwrap();
    let _iam = iam_at(data.path(), pki.path(), &iam_addr).await;
    let r = w.reconcile_round().await;
    assert_eq!((r.edges_reconciled, r.errors), (48, 0), "{r:?}");
    let next: Vec<String> = std::mem::take(&mut *asked.lock().unwrap());
    let last = reached.iter().max().unwrap();
    let unreached: Vec<&String> = first.iter().filter(|n| !reached.contains(n)).collect();
    let begun: Vec<&String> = next.iter().take(unreached.len()).collect();
    let mut want = unreached.clone();
    want.sort();
    let mut got = begun.clone();
    got.sort();
    assert_eq!(got, want, "the edges the last round did not reach come first (after {last})");
}
