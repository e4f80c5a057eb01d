//! The edge through real gRPC and mTLS on 127.0.0.1:0, with a fake IAM (ReleaseLeases recorded
//! and applied to a map of bindings, as IAM would with the edge named; GetLeases answered from
//! it) and a fake watcher (registrations recorded), each with its own certificate of a CA made
//! per test. The harness calls the edge as an apiserver would (and as a watcher for Status).

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;
use tonic::{Request, Response, Status};

use opendsec_common::config::EdgeConfig;
use opendsec_common::grpc;
use opendsec_common::pki::Role;
use opendsec_common::time::Clock;
use opendsec_common::{ApiError, Reason};
use opendsec_edge::admission::HostReading;
use opendsec_edge::backend::sim::SimBackend;
use opendsec_edge::{Backend, BackendError, Edge, EdgeOptions, FixedHost, HostSize, SandboxRecord, Usage};
use opendsec_proto::v1::edge_client::EdgeClient;
use opendsec_proto::v1::iam_server::{Iam, IamServer};
use opendsec_proto::v1::watcher_server::WatcherServer;
use opendsec_proto::v1::*;
use opendsec_testkit::FakeWatcher;
use opendsec_testkit::creds;
use opendsec_testkit::eventually;
use tonic::transport::Channel as ServiceChannel;

const EDGE: &str = "edge-1";
const WAIT: Duration = Duration::from_secs(10);

// ---------------------------------------------------------------------------------------------
// Fakes

#[derive(Default)]
struct IamState {
    /// Every ReleaseLeases call, in order: (edge named, lease ids).
    released: Vec<(String, Vec<String>)>,
    /// Where leases are bound: lease -> Some(edge), None = not found. Leases not in the map are
    /// bound to `EDGE`. ReleaseLeases frees (removes from here) only those bound to the edge
    /// it names, like IAM.
    bindings: HashMap<String, Option<String>>,
    /// Leases a ReleaseLeases call actually freed.
    freed: Vec<String>,
    /// Every GetLeases call, in order.
    lookups: Vec<Vec<String>>,
    /// ReleaseLeases answers `unavailable` (and records nothing) while set.
    fail_releases: bool,
    /// GetLeases answers `unavailable` (and records nothing) while set.
    fail_lookups: bool,
    /// Calls refused while failing: (ReleaseLeases, GetLeases).
    refused: (u32, u32),
}

#[derive(Clone, Default)]
struct FakeIam(Arc<Mutex<IamState>>);

impl FakeIam {
    /// The lease ids of every release call, checking that each call named this edge.
    fn released(&self) -> Vec<String> {
        let st = self.0.lock().unwrap();
        for (edge, ids) in &st.released {
            assert_eq!(edge, EDGE, "a release of {ids:?} did not name the edge");
        }
        st.released.iter().flat_map(|(_, ids)| ids.clone()).collect()
    }
    fn batches(&self) -> Vec<Vec<String>> {
        self.0.lock().unwrap().released.iter().map(|(_, ids)| ids.clone()).collect()
    }
    fn freed(&self) -> Vec<String> {
        self.0.lock().unwrap().freed.clone()
    }
    fn bind(&self, lease: &str, edge: Option<&str>) {
        self.0.lock().unwrap().bindings.insert(lease.into(), edge.map(String::from));
    }
    fn fail_releases(&self, fail: bool) {
        self.0.lock().unwrap().fail_releases = fail;
    }
    fn fail_lookups(&self, fail: bool) {
        self.0.lock().unwrap().fail_lookups = fail;
    }
    fn lookups(&self) -> Vec<Vec<String>> {
        self.0.lock().unwrap().lookups.clone()
    }
    /// How many calls were refused while failing: (ReleaseLeases, GetLeases).
    fn refused(&self) -> (u32, u32) {
        self.0.lock().unwrap().refused
    }
}

fn unimplemented<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented("not in the fake"))
}

#[tonic::async_trait]
impl Iam for FakeIam {
    async fn authenticate(&self, _: Request<AuthenticateRequest>) -> Result<Response<AuthenticateResponse>, Status> {
        unimplemented()
    }
    async fn authorize(&self, _: Request<AuthorizeRequest>) -> Result<Response<AuthorizeResponse>, Status> {
        unimplemented()
    }
    async fn admit(&self, _: Request<AdmitRequest>) -> Result<Response<AdmitResponse>, Status> {
        unimplemented()
    }
    async fn admit_many(
        &self,
        _: Request<opendsec_proto::v1::AdmitManyRequest>,
    ) -> Result<Response<opendsec_proto::v1::AdmitManyResponse>, Status> {
        unimplemented()
    }
    async fn check_egress(
        &self,
        _: Request<opendsec_proto::v1::CheckEgressRequest>,
    ) -> Result<Response<opendsec_proto::v1::CheckEgressResponse>, Status> {
        unimplemented()
    }
    async fn release_leases(
        &self,
        req: Request<ReleaseLeasesRequest>,
    ) -> Result<Response<ReleaseLeasesResponse>, Status> {
        let ReleaseLeasesRequest { lease_ids, edge } = req.into_inner();
        let mut st = self.0.lock().unwrap();
        if st.fail_releases {
            st.refused.0 += 1;
            return Err(ApiError::unavailable("IAM is down").to_status());
        }
        let mut n = 0;
        for id in &lease_ids {
            let bound = st.bindings.get(id).cloned().unwrap_or(Some(EDGE.to_string()));
            if bound.is_some_and(|b| edge.is_empty() || b == edge) {
                st.bindings.insert(id.clone(), None);
                st.freed.push(id.clone());
                n += 1;
            }
        }
        st.released.push((edge, lease_ids));
        Ok(Response::new(ReleaseLeasesResponse { released: n }))
    }
    async fn get_lease(&self, _: Request<GetLeaseRequest>) -> Result<Response<GetLeaseResponse>, Status> {
        // The edge looks leases up in batches only.
        unimplemented()
    }
    async fn get_leases(&self, req: Request<GetLeasesRequest>) -> Result<Response<GetLeasesResponse>, Status> {
        let ids = req.into_inner().lease_ids;
        let mut st = self.0.lock().unwrap();
        if st.fail_lookups {
            st.refused.1 += 1;
            return Err(ApiError::unavailable("IAM is down").to_status());
        }
        let leases = ids
            .iter()
            .filter_map(|id| {
                let edge = st.bindings.get(id).cloned().unwrap_or(Some(EDGE.to_string()))?;
                Some(Lease { id: id.clone(), edge, ..Default::default() })
            })
            .collect();
        st.lookups.push(ids);
        Ok(Response::new(GetLeasesResponse { leases }))
    }
    async fn reconcile(&self, _: Request<ReconcileRequest>) -> Result<Response<ReconcileResponse>, Status> {
        unimplemented()
    }
    async fn sweep_unbound(&self, _: Request<SweepUnboundRequest>) -> Result<Response<SweepUnboundResponse>, Status> {
        unimplemented()
    }
    async fn get_epoch(&self, _: Request<GetEpochRequest>) -> Result<Response<GetEpochResponse>, Status> {
        unimplemented()
    }
    async fn mint_sandbox_tokens(
        &self,
        _: Request<opendsec_proto::v1::MintSandboxTokensRequest>,
    ) -> Result<Response<opendsec_proto::v1::SandboxTokens>, Status> {
        unimplemented()
    }
    async fn charge_image(
        &self,
        _: Request<opendsec_proto::v1::ChargeImageRequest>,
    ) -> Result<Response<opendsec_proto::v1::ChargeImageResponse>, Status> {
        unimplemented()
    }
    async fn uncharge_image(
        &self,
        _: Request<opendsec_proto::v1::UnchargeImageRequest>,
    ) -> Result<Response<opendsec_proto::v1::ChargeImageResponse>, Status> {
        unimplemented()
    }
    async fn store_room(
        &self,
        _: Request<opendsec_proto::v1::StoreRoomRequest>,
    ) -> Result<Response<opendsec_proto::v1::ChargeImageResponse>, Status> {
        unimplemented()
    }
    async fn admit_member(
        &self,
        _: Request<opendsec_proto::v1::AdmitMemberRequest>,
    ) -> Result<Response<opendsec_proto::v1::ChargeImageResponse>, Status> {
        Ok(Response::new(opendsec_proto::v1::ChargeImageResponse {}))
    }
    async fn acquire_lock(&self, _: Request<AcquireLockRequest>) -> Result<Response<AcquireLockResponse>, Status> {
        unimplemented()
    }

    async fn resolve_pool(&self, _: Request<ResolvePoolRequest>) -> Result<Response<Pool>, Status> {
        unimplemented()
    }

    async fn list_all_pools(&self, _: Request<ListAllPoolsRequest>) -> Result<Response<ListPoolsResponse>, Status> {
        unimplemented()
    }
}

/// Where the fakes serve, and the PKI of the test.
struct Fakes {
    iam: String,
    watcher: String,
    pki: std::path::PathBuf,
}

async fn serve_fakes(pki: &Path, iam: FakeIam, watcher: FakeWatcher) -> Fakes {
    let il = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let wl = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let fakes = Fakes {
        iam: il.local_addr().unwrap().to_string(),
        watcher: wl.local_addr().unwrap().to_string(),
        pki: pki.to_path_buf(),
    };
    let (it, wt) = (creds(pki, Role::Iam, "0"), creds(pki, Role::Watcher, "0"));
    let ir = grpc::internal_server().add_service(IamServer::new(iam));
    let wr = grpc::internal_server().add_service(WatcherServer::new(watcher));
    tokio::spawn(async move { grpc::serve_internal(ir, il, &it, std::future::pending()).await });
    tokio::spawn(async move { grpc::serve_internal(wr, wl, &wt, std::future::pending()).await });
    fakes
}

/// A client of the edge at `addr` as component `role`/`name`.
fn edge_client(pki: &Path, addr: &str, role: Role, name: &str) -> EdgeClient<ServiceChannel> {
    EdgeClient::new(grpc::Links::new(creds(pki, role, name)).channel(addr, Role::Edge, Some(EDGE)).unwrap())
}

/// `msg` for the edge, naming the project the call was authorized for.
fn for_project<T>(msg: T, project: &str) -> Request<T> {
    let mut r = Request::new(msg);
    r.metadata_mut().insert(grpc::EXPECT_PROJECT_HEADER, project.parse().unwrap());
    r
}

// ---------------------------------------------------------------------------------------------
// Harness

fn config() -> EdgeConfig {
    EdgeConfig {
        ttl_check_interval: Duration::from_millis(100),
        release_interval: Duration::from_millis(20),
        register_interval: Duration::from_secs(60),
        ..EdgeConfig::default()
    }
}

struct Harness {
    edge: Edge,
    /// As an apiserver.
    client: EdgeClient<ServiceChannel>,
    /// As a watcher (Status).
    watcher: EdgeClient<ServiceChannel>,
    addr: String,
    pki: std::path::PathBuf,
    stop: Option<oneshot::Sender<()>>,
    served: Option<tokio::task::JoinHandle<Result<(), opendsec_edge::EdgeError>>>,
}

impl Harness {
    async fn start(dir: &Path, cfg: EdgeConfig, fakes: &Fakes, backends: Vec<Arc<dyn Backend>>) -> Harness {
        Harness::start_with_host(dir, cfg, fakes, backends, None).await
    }

    async fn start_with_host(
        dir: &Path,
        cfg: EdgeConfig,
        fakes: &Fakes,
        backends: Vec<Arc<dyn Backend>>,
        host: Option<Arc<FixedHost>>,
    ) -> Harness {
        Harness::start_full(dir, cfg, fakes, backends, host, Clock::system()).await
    }

    /// An edge whose TTLs and retention run on `clock` (a manual one moves only when told).
    async fn start_with_clock(
        dir: &Path,
        cfg: EdgeConfig,
        fakes: &Fakes,
        backends: Vec<Arc<dyn Backend>>,
        clock: Clock,
    ) -> Harness {
        Harness::start_full(dir, cfg, fakes, backends, None, clock).await
    }

    async fn start_full(
        dir: &Path,
        cfg: EdgeConfig,
        fakes: &Fakes,
        backends: Vec<Arc<dyn Backend>>,
        host: Option<Arc<FixedHost>>,
        clock: Clock,
    ) -> Harness {
        let opts = EdgeOptions {
            name: EDGE.into(),
            state_dir: dir.to_path_buf(),
            config: cfg,
            iam_addrs: vec![fakes.iam.clone()],
            watcher_addrs: vec![fakes.watcher.clone()],
            tls: creds(&fakes.pki, Role::Edge, EDGE),
            advertise: String::new(),
            clock,
            network: None,
        };
        let edge = match host {
            Some(h) => Edge::start_with_host(opts, backends, h).await.unwrap(),
            None => Edge::start(opts, backends).await.unwrap(),
        };
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = oneshot::channel::<()>();
        let served = tokio::spawn(edge.clone().serve(listener, async move {
            let _ = rx.await;
        }));
        let client = edge_client(&fakes.pki, &addr, Role::Apiserver, "0");
        let watcher = edge_client(&fakes.pki, &addr, Role::Watcher, "0");
        Harness { edge, client, watcher, addr, pki: fakes.pki.clone(), stop: Some(tx), served: Some(served) }
    }

    /// The project of sandbox `lease` (what an apiserver learns before a lifecycle call), or
    /// "root" for one the edge does not know.
    async fn project_of(&self, lease: &str) -> String {
        match self.get(lease).await {
            Ok(sb) => sb.spec.map(|s| s.project).unwrap_or_default(),
            Err(_) => "root/team-a".into(),
        }
    }

    /// Stops serving and waits until the edge is closed.
    async fn shutdown(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(s) = self.served.take() {
            s.await.unwrap().unwrap();
        }
    }

    async fn create(&self, lease: &str, spec: SandboxSpec) -> Result<Sandbox, ApiError> {
        let req = EdgeCreateRequest {
            lease_id: lease.into(),
            spec: Some(spec),
            principal: "alice".into(),
            ..Default::default()
        };
        self.client.clone().create_sandbox(req).await.map(|r| r.into_inner()).map_err(ApiError::from)
    }

    async fn get(&self, lease: &str) -> Result<Sandbox, ApiError> {
        let req = GetSandboxRequest { id: format!("{EDGE}.{lease}") };
        self.client.clone().get_sandbox(req).await.map(|r| r.into_inner()).map_err(ApiError::from)
    }

    async fn stop(&self, lease: &str) -> Result<Sandbox, ApiError> {
        let req = for_project(StopSandboxRequest { id: format!("{EDGE}.{lease}") }, &self.project_of(lease).await);
        self.client.clone().stop_sandbox(req).await.map(|r| r.into_inner()).map_err(ApiError::from)
    }

    async fn pause(&self, lease: &str) -> Result<Sandbox, ApiError> {
        let req = for_project(PauseSandboxRequest { id: format!("{EDGE}.{lease}") }, &self.project_of(lease).await);
        self.client.clone().pause_sandbox(req).await.map(|r| r.into_inner()).map_err(ApiError::from)
    }

    async fn resume(&self, lease: &str) -> Result<Sandbox, ApiError> {
        let req = for_project(ResumeSandboxRequest { id: format!("{EDGE}.{lease}") }, &self.project_of(lease).await);
        self.client.clone().resume_sandbox(req).await.map(|r| r.into_inner()).map_err(ApiError::from)
    }

    async fn list(&self, req: EdgeListRequest) -> EdgeListResponse {
        self.client.clone().list_sandboxes(req).await.unwrap().into_inner()
    }

    async fn status(&self, include_leases: bool) -> EdgeStatus {
        self.watcher.clone().status(StatusRequest { include_leases }).await.unwrap().into_inner()
    }
}

fn spec(cpu: u32, mem: u64) -> SandboxSpec {
    SandboxSpec {
        project: "root/team-a".into(),
        image: "python".into(),
        backend: "sim".into(),
        resources: Some(Resources { cpu_millis: cpu, memory_mb: mem, disk_mb: 100, gpus: 0 }),
        ttl_running_stop_s: 600,
        ttl_max_s: 3600,
        ttl_paused_s: 3600,
        labels: [("job".to_string(), "rl".to_string())].into(),
        ..Default::default()
    }
}

fn state(sb: &Sandbox) -> SandboxState {
    SandboxState::try_from(sb.state).unwrap()
}

async fn setup() -> (tempfile::TempDir, FakeIam, FakeWatcher, Fakes) {
    let dir = tempfile::tempdir().unwrap();
    let iam = FakeIam::default();
    let watcher = FakeWatcher::default();
    let fakes = serve_fakes(&dir.path().join("pki"), iam.clone(), watcher.clone()).await;
    (dir, iam, watcher, fakes)
}

fn sim() -> Arc<SimBackend> {
    Arc::new(SimBackend::new())
}

/// The record of `lease` in the edge's record log, read beside the running edge.
fn record_file(dir: &Path, lease: &str) -> SandboxRecord {
    let records = opendsec_edge::record::peek(dir, opendsec_edge::record::RECORDS_DIR).unwrap();
    let bytes = records.get(lease).unwrap_or_else(|| panic!("no record of {lease}: {:?}", records.keys()));
    SandboxRecord::decode(bytes, Path::new(lease)).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test]
async fn lifecycle_create_get_list_pause_resume_stop() {
    let (dir, iam, watcher, fakes) = setup().await;
    let sim = sim();
    let h = Harness::start(dir.path(), config(), &fakes, vec![sim.clone()]).await;

    let sb = h.create("lease-1", spec(1000, 512)).await.unwrap();
    assert_eq!(sb.id, format!("{EDGE}.lease-1"));
    assert_eq!(state(&sb), SandboxState::Running);
    assert_eq!(sb.principal, "alice");
    assert!(sb.expires_at_ms > sb.created_at_ms);
    assert!(sim.contains(&sb.id));
    assert_eq!(record_file(dir.path(), "lease-1").state, opendsec_edge::SandboxStatus::Running);

    let got = h.get("lease-1").await.unwrap();
    assert_eq!(got.spec, sb.spec);

    h.create("lease-2", SandboxSpec { project: "root/team-b".into(), ..spec(100, 64) }).await.unwrap();
    let page = h.list(EdgeListRequest { project: "root/team-a".into(), ..Default::default() }).await;
    assert_eq!(page.sandboxes.iter().map(|s| s.lease_id.as_str()).collect::<Vec<_>>(), ["lease-1"]);
    let page = h.list(EdgeListRequest { limit: 1, ..Default::default() }).await;
    assert_eq!((page.sandboxes.len(), page.more), (1, true));
    let page = h.list(EdgeListRequest { after: page.sandboxes[0].id.clone(), limit: 1, ..Default::default() }).await;
    assert_eq!((page.sandboxes[0].lease_id.as_str(), page.more), ("lease-2", false));

    let paused = h.pause("lease-1").await.unwrap();
    assert_eq!(state(&paused), SandboxState::Paused);
    assert_eq!(sim.is_paused(&sb.id), Some(true));
    // Pausing again answers the paused sandbox; resuming a running one likewise.
    assert_eq!(state(&h.pause("lease-1").await.unwrap()), SandboxState::Paused);
    let resumed = h.resume("lease-1").await.unwrap();
    assert_eq!(state(&resumed), SandboxState::Running);
    assert_eq!(state(&h.resume("lease-1").await.unwrap()), SandboxState::Running);

    let st = h.status(true).await;
    assert_eq!(st.edge, EDGE);
    assert_eq!(st.sandboxes, 2);
    assert_eq!(st.allocated.unwrap().cpu_millis, 1100);
    assert_eq!(st.leases.len(), 2);
    assert_eq!(st.backends, ["sim"]);
    assert!(st.cpu_use > 0.0 && st.cpu_use < 0.1, "{}", st.cpu_use);

    let stopped = h.stop("lease-1").await.unwrap();
    assert_eq!(state(&stopped), SandboxState::Stopped);
    assert_eq!(stopped.end_reason, "user");
    assert!(!sim.contains(&sb.id));
    // Idempotent, and the ended sandbox stays readable.
    assert_eq!(state(&h.stop("lease-1").await.unwrap()), SandboxState::Stopped);
    assert_eq!(state(&h.get("lease-1").await.unwrap()), SandboxState::Stopped);
    // Default listing leaves ended sandboxes out; asking by state finds them.
    let page = h.list(EdgeListRequest::default()).await;
    assert_eq!(page.sandboxes.len(), 1);
    let page = h.list(EdgeListRequest { states: vec![SandboxState::Stopped as i32], ..Default::default() }).await;
    assert_eq!(page.sandboxes.len(), 1);

    eventually("the lease released", WAIT, || async { iam.released() == ["lease-1"] }).await;
    eventually("the release marked", WAIT, || async { record_file(dir.path(), "lease-1").lease_released }).await;

    // Wrong states name the state found.
    let err = h.pause("lease-1").await.unwrap_err();
    assert_eq!(err.reason, Reason::InvalidState);
    assert!(err.message.contains("STOPPED"), "{}", err.message);
    let err = h.resume("lease-1").await.unwrap_err();
    assert_eq!(err.reason, Reason::InvalidState);
    let req = SetSandboxTimeoutRequest { id: format!("{EDGE}.lease-1"), ttl_max_s: Some(10), ..Default::default() };
    let err = ApiError::from(h.client.clone().set_sandbox_timeout(for_project(req, "root/team-a")).await.unwrap_err());
    assert_eq!(err.reason, Reason::InvalidState);
    assert_eq!(h.get("nope").await.unwrap_err().reason, Reason::NotFound);
    assert_eq!(h.get("x").await.unwrap_err().reason, Reason::NotFound);
    let other = GetSandboxRequest { id: "edge-2.lease-2".into() };
    assert_eq!(ApiError::from(h.client.clone().get_sandbox(other).await.unwrap_err()).reason, Reason::NotFound);

    // The edge registered with the watcher at start, with the address it serves on.
    let regs = watcher.registrations.lock().unwrap().clone();
    assert!(regs.iter().any(|r| r.name == EDGE && r.address == h.addr), "{regs:?}");
    h.shutdown().await;
}

#[tokio::test]
async fn create_is_idempotent_per_lease() {
    let (dir, _iam, _w, fakes) = setup().await;
    let sim = sim();
    sim.set_delay(Some(Duration::from_millis(50)));
    let h = Harness::start(dir.path(), config(), &fakes, vec![sim.clone()]).await;

    // Concurrent retries of one creation make one sandbox.
    let (a, b) = tokio::join!(h.create("same", spec(1000, 512)), h.create("same", spec(1000, 512)));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.id, b.id);
    assert_eq!(state(&a), SandboxState::Running);
    assert_eq!(state(&b), SandboxState::Running);
    // A later retry, even with another spec, gets the same sandbox as it is.
    let c = h.create("same", spec(2000, 1024)).await.unwrap();
    assert_eq!(c.created_at_ms, a.created_at_ms);
    assert_eq!(c.spec.unwrap().resources.unwrap().cpu_millis, 1000);
    assert_eq!(sim.len(), 1);
    assert_eq!(h.status(false).await.sandboxes, 1);
    h.shutdown().await;
}

/// A creation's CREATING record is in the log before the backend is called, and the whole
/// creation costs the record log one sync (the RUNNING record's, which covers the intent).
#[tokio::test]
async fn a_creation_writes_its_intent_first_and_syncs_once() {
    let (dir, _iam, _w, fakes) = setup().await;
    let sim = sim();
    sim.set_delay(Some(Duration::from_millis(300)));
    let h = Harness::start(dir.path(), config(), &fakes, vec![sim.clone()]).await;
    let before = h.edge.record_syncs();
    let creating = h.create("one", spec(100, 10));
    let peek = async {
        // While the backend is still at work, the intent is in the log and nothing started.
        eventually("the intent", WAIT, || async {
            opendsec_edge::record::peek(dir.path(), opendsec_edge::record::RECORDS_DIR).unwrap().contains_key("one")
        })
        .await;
        assert_eq!(record_file(dir.path(), "one").state, opendsec_edge::SandboxStatus::Creating);
        assert_eq!(sim.len(), 0);
    };
    let (created, ()) = tokio::join!(creating, peek);
    assert_eq!(state(&created.unwrap()), SandboxState::Running);
    assert_eq!(record_file(dir.path(), "one").state, opendsec_edge::SandboxStatus::Running);
    assert_eq!(h.edge.record_syncs() - before, 1);
    h.shutdown().await;
}

/// CreateMany makes each item as its own CreateSandbox would and answers each once, by index:
/// a bad item, a backend not offered and a repeated lease are each answered on their own,
/// the rest made; a call over the bound, or from a caller other than an apiserver, makes
/// nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_many_answers_each_item_as_its_own_call_would() {
    let (dir, _iam, _w, fakes) = setup().await;
    let sim = sim();
    sim.set_delay(Some(Duration::from_millis(20)));
    let h = Harness::start(dir.path(), config(), &fakes, vec![sim.clone()]).await;
    let item = |lease: &str, spec: SandboxSpec| EdgeCreateRequest {
        lease_id: lease.into(),
        spec: Some(spec),
        principal: "alice".into(),
        ..Default::default()
    };
    let mut items: Vec<_> = (0..30).map(|i| item(&format!("m{i}"), spec(10, 10))).collect();
    items.push(item("m0", spec(10, 10)));
    items.push(item("Bad_Lease!", spec(10, 10)));
    items.push(item("vm", SandboxSpec { backend: "microvm".into(), ..spec(10, 10) }));
    let mut stream = h.client.clone().create_many(EdgeCreateManyRequest { items }).await.unwrap().into_inner();
    let mut answers: HashMap<u32, EdgeCreateResult> = HashMap::new();
    while let Some(r) = stream.message().await.unwrap() {
        assert!(answers.insert(r.index, r.clone()).is_none(), "index {} answered twice", r.index);
    }
    assert_eq!(answers.len(), 33);
    let ok = |i: u32| answers[&i].sandbox.clone().unwrap_or_else(|| panic!("item {i}: {:?}", answers[&i].error));
    for i in 0..30 {
        assert_eq!(ok(i).id, format!("{EDGE}.m{i}"));
        assert_eq!(state(&ok(i)), SandboxState::Running);
    }
    assert_eq!(
        (ok(30).id, ok(30).created_at_ms),
        (ok(0).id, ok(0).created_at_ms),
        "a repeated lease gets the same sandbox"
    );
    assert_eq!(answers[&31].error.as_ref().unwrap().reason, Reason::InvalidArgument.as_str());
    assert_eq!(answers[&32].error.as_ref().unwrap().reason, Reason::NoCapacity.as_str());
    assert_eq!(sim.len(), 30);
    assert_eq!(record_file(dir.path(), "m17").state, opendsec_edge::SandboxStatus::Running);

    // Over the bound: refused whole, nothing made.
    let items: Vec<_> = (0..=grpc::MAX_CREATE_MANY).map(|i| item(&format!("x{i}"), spec(0, 0))).collect();
    let err = h.client.clone().create_many(EdgeCreateManyRequest { items }).await.unwrap_err();
    assert_eq!(ApiError::from(err).reason, Reason::InvalidArgument);
    // Only an apiserver may create.
    let items = vec![item("w", spec(0, 0))];
    let err = h.watcher.clone().create_many(EdgeCreateManyRequest { items }).await.unwrap_err();
    assert_eq!(ApiError::from(err).reason, Reason::PermissionDenied);
    assert_eq!(sim.len(), 30);
    assert_eq!(h.status(false).await.sandboxes, 30);
    h.shutdown().await;
}

#[tokio::test]
async fn capacity_and_offered_backends_are_checked() {
    let (dir, _iam, _w, fakes) = setup().await;
    let mut cfg = config();
    cfg.capacity.cpu_millis = 2000;
    cfg.max_sandboxes = 3;
    let h = Harness::start(dir.path(), cfg, &fakes, vec![sim()]).await;

    h.create("a", spec(1500, 10)).await.unwrap();
    let err = h.create("b", spec(1000, 10)).await.unwrap_err();
    assert_eq!(err.reason, Reason::NoCapacity);
    assert!(err.message.contains("cpu"), "{}", err.message);
    h.create("b", spec(500, 10)).await.unwrap();
    h.create("c", spec(0, 10)).await.unwrap();
    let err = h.create("d", spec(0, 10)).await.unwrap_err();
    assert_eq!(err.reason, Reason::NoCapacity);
    assert!(err.message.contains("sandboxes"), "{}", err.message);

    // A stopped sandbox gives its room back.
    h.stop("a").await.unwrap();
    h.create("d", spec(1000, 10)).await.unwrap();

    // A known backend this edge does not offer: the apiserver's snapshot was stale.
    let err = h.create("e", SandboxSpec { backend: "microvm".into(), ..spec(0, 0) }).await.unwrap_err();
    assert_eq!(err.reason, Reason::NoCapacity);
    assert!(err.message.contains("microvm"), "{}", err.message);
    assert!(h.get("e").await.is_err());
    h.shutdown().await;
}

#[tokio::test]
async fn bad_input_is_refused_and_changes_nothing() {
    let (dir, _iam, _w, fakes) = setup().await;
    let sim = sim();
    let h = Harness::start(dir.path(), config(), &fakes, vec![sim.clone()]).await;

    let absurd =
        SandboxSpec { resources: Some(Resources { cpu_millis: u32::MAX, ..Default::default() }), ..spec(0, 0) };
    let cases = [
        ("Bad_Lease!", spec(1, 1)),
        ("", spec(1, 1)),
        ("ok", SandboxSpec { backend: "kvm".into(), ..spec(1, 1) }),
        ("ok", SandboxSpec { project: "not-root".into(), ..spec(1, 1) }),
        ("ok", absurd),
    ];
    for (lease, spec) in cases {
        let err = h.create(lease, spec.clone()).await.unwrap_err();
        assert_eq!(err.reason, Reason::InvalidArgument, "{lease:?} {spec:?}: {err}");
    }
    let no_spec =
        EdgeCreateRequest { lease_id: "ok".into(), spec: None, principal: "alice".into(), ..Default::default() };
    let err = ApiError::from(h.client.clone().create_sandbox(no_spec).await.unwrap_err());
    assert_eq!(err.reason, Reason::InvalidArgument);
    let err = h.pause("../etc").await.unwrap_err();
    assert_eq!(err.reason, Reason::InvalidArgument);
    let bad_list = EdgeListRequest { states: vec![99], ..Default::default() };
    let err = ApiError::from(h.client.clone().list_sandboxes(bad_list).await.unwrap_err());
    assert_eq!(err.reason, Reason::InvalidArgument);

    assert_eq!(h.status(true).await.sandboxes, 0);
    assert!(sim.is_empty());
    assert!(opendsec_edge::record::peek(dir.path(), opendsec_edge::record::RECORDS_DIR).unwrap().is_empty());
    h.shutdown().await;
}

/// Who may call the edge: apiservers its sandbox calls, watchers its status; nothing without a
/// certificate of the cluster CA; lifecycle and Runtime calls only with the project the
/// apiserver authorized them for, and only for sandboxes of that project.
#[tokio::test]
async fn callers_are_checked_by_certificate_role_and_project() {
    let (dir, _iam, _w, fakes) = setup().await;
    let h = Harness::start(dir.path(), config(), &fakes, vec![sim()]).await;
    let sb = h.create("acl", spec(1, 1)).await.unwrap();
    // Plain text, and a certificate of another CA: no call at all.
    let mut bare = EdgeClient::new(grpc::channel(&h.addr).unwrap());
    assert!(bare.status(StatusRequest::default()).await.is_err());
    let other = tempfile::tempdir().unwrap();
    let mut foreign = edge_client(other.path(), &h.addr, Role::Apiserver, "0");
    assert!(foreign.get_sandbox(GetSandboxRequest { id: sb.id.clone() }).await.is_err());
    // Roles: another edge may call nothing; a watcher only Status; an apiserver not Status.
    let reason = |s: Status| ApiError::from(s).reason;
    let mut peer = edge_client(&h.pki, &h.addr, Role::Edge, "edge-2");
    assert_eq!(
        reason(peer.get_sandbox(GetSandboxRequest { id: sb.id.clone() }).await.unwrap_err()),
        Reason::PermissionDenied
    );
    assert_eq!(reason(peer.status(StatusRequest::default()).await.unwrap_err()), Reason::PermissionDenied);
    let mut w = h.watcher.clone();
    let stop = |p: Option<&str>| match p {
        Some(p) => for_project(StopSandboxRequest { id: sb.id.clone() }, p),
        None => Request::new(StopSandboxRequest { id: sb.id.clone() }),
    };
    assert_eq!(reason(w.stop_sandbox(stop(Some("root/team-a"))).await.unwrap_err()), Reason::PermissionDenied);
    assert_eq!(reason(h.client.clone().status(StatusRequest::default()).await.unwrap_err()), Reason::PermissionDenied);
    // An edge that is not who the caller meant is refused by the caller.
    let mut wrong_edge = EdgeClient::new(
        grpc::Links::new(creds(&h.pki, Role::Apiserver, "0")).channel(&h.addr, Role::Edge, Some("edge-9")).unwrap(),
    );
    assert!(wrong_edge.get_sandbox(GetSandboxRequest { id: sb.id.clone() }).await.is_err());
    // Lifecycle calls need the project, and the right one.
    assert_eq!(reason(h.client.clone().stop_sandbox(stop(None)).await.unwrap_err()), Reason::InvalidArgument);
    assert_eq!(reason(h.client.clone().stop_sandbox(stop(Some("root/other"))).await.unwrap_err()), Reason::NotFound);
    assert_eq!(h.get("acl").await.unwrap().state, SandboxState::Running as i32, "nothing was stopped");
    h.client.clone().stop_sandbox(stop(Some("root/team-a"))).await.unwrap();
    h.shutdown().await;
}

/// The TTL sweep runs on the edge's clock: a manual one here, moved by the test, and the
/// sweep is run by hand (the loop's interval is an hour), so nothing waits for real seconds.
fn manual_clock_config() -> (Clock, EdgeConfig) {
    let cfg = EdgeConfig { ttl_check_interval: Duration::from_secs(3600), ..config() };
    (Clock::manual(opendsec_common::time::now_ms()), cfg)
}

#[tokio::test]
async fn idle_ttl_expiry_stops_and_releases_in_a_batch() {
    let (dir, iam, _w, fakes) = setup().await;
    let (clock, mut cfg) = manual_clock_config();
    // Releases go out only when a batch of two is full.
    cfg.release_batch = 2;
    cfg.release_interval = Duration::from_secs(3600);
    let h = Harness::start_with_clock(dir.path(), cfg, &fakes, vec![sim()], clock.clone()).await;
    let short = SandboxSpec { ttl_running_stop_s: 1, ..spec(100, 10) };
    let a = h.create("idle-a", short.clone()).await.unwrap();
    h.create("idle-b", short).await.unwrap();
    assert_eq!(a.expires_at_ms, a.last_active_ms + 1000);
    assert_eq!(a.last_active_ms, clock.now_ms(), "the record is stamped by the edge's clock");

    // A millisecond before the deadline: nothing expires.
    clock.advance(999);
    h.edge.sweep_now().await;
    assert_eq!(state(&h.get("idle-a").await.unwrap()), SandboxState::Running);
    assert_eq!(state(&h.get("idle-b").await.unwrap()), SandboxState::Running);
    // At the deadline, both stop in the same round.
    clock.advance(1);
    h.edge.sweep_now().await;
    for lease in ["idle-a", "idle-b"] {
        let sb = h.get(lease).await.unwrap();
        assert_eq!((state(&sb), sb.end_reason.as_str()), (SandboxState::Stopped, "ttl_running_stop"));
    }
    eventually("both released", WAIT, || async {
        let mut r = iam.released();
        r.sort();
        r == ["idle-a", "idle-b"]
    })
    .await;
    assert_eq!(iam.batches().len(), 1, "{:?}", iam.batches());
    h.shutdown().await;
}

#[tokio::test]
async fn lifetime_and_paused_ttls_and_retention_run_on_the_edge_clock() {
    let (dir, iam, _w, fakes) = setup().await;
    let (clock, cfg) = manual_clock_config();
    let retention = cfg.ended_retention.as_millis() as i64;
    let h = Harness::start_with_clock(dir.path(), cfg, &fakes, vec![sim()], clock.clone()).await;
    // An hour of lifetime, no idle limit; ten minutes of pause.
    let life = SandboxSpec { ttl_running_stop_s: 0, ttl_max_s: 3600, ..spec(100, 10) };
    h.create("life", life).await.unwrap();
    let nap = SandboxSpec { ttl_running_stop_s: 0, ttl_max_s: 0, ttl_paused_s: 600, ..spec(100, 10) };
    h.create("nap", nap).await.unwrap();
    clock.advance(1_000);
    let paused = h.pause("nap").await.unwrap();
    assert_eq!(paused.expires_at_ms, clock.now_ms() + 600_000);

    clock.advance(600_000 - 1);
    h.edge.sweep_now().await;
    assert_eq!(state(&h.get("nap").await.unwrap()), SandboxState::Paused);
    clock.advance(1);
    h.edge.sweep_now().await;
    let nap = h.get("nap").await.unwrap();
    assert_eq!((state(&nap), nap.end_reason.as_str()), (SandboxState::Stopped, "ttl_paused"));
    assert_eq!(state(&h.get("life").await.unwrap()), SandboxState::Running);

    // The lifetime counts from creation: 3,600,000 ms after it.
    clock.advance(3_600_000 - 601_000 - 1);
    h.edge.sweep_now().await;
    assert_eq!(state(&h.get("life").await.unwrap()), SandboxState::Running);
    clock.advance(1);
    h.edge.sweep_now().await;
    let life = h.get("life").await.unwrap();
    assert_eq!((state(&life), life.end_reason.as_str()), (SandboxState::Stopped, "ttl_max"));

    // Ended records go once released and past retention, not before.
    eventually("both released", WAIT, || async { iam.released().len() == 2 }).await;
    clock.advance(retention - 1);
    h.edge.sweep_now().await;
    assert_eq!(state(&h.get("life").await.unwrap()), SandboxState::Stopped);
    clock.advance(1);
    // IAM has answered the releases; the edge notes them in the records right after, so a
    // sweep on a loaded machine may still see one unreleased: the next one removes it.
    eventually("the ended records go past retention", WAIT, || async {
        h.edge.sweep_now().await;
        h.get("life").await.is_err()
    })
    .await;
    assert_eq!(h.get("life").await.unwrap_err().reason, Reason::NotFound);
    assert_eq!(h.get("nap").await.unwrap_err().reason, Reason::NotFound, "ended earlier, gone too");
    h.shutdown().await;
}

#[tokio::test]
async fn set_timeout_replaces_ttls_and_resets_the_idle_clock() {
    let (dir, _iam, _w, fakes) = setup().await;
    let h = Harness::start(dir.path(), config(), &fakes, vec![sim()]).await;
    let sb = h.create("t", spec(1, 1)).await.unwrap();
    let req = SetSandboxTimeoutRequest { id: sb.id.clone(), ttl_max_s: Some(5), ..Default::default() };
    let after = h.client.clone().set_sandbox_timeout(for_project(req, "root/team-a")).await.unwrap().into_inner();
    assert_eq!(after.spec.as_ref().unwrap().ttl_max_s, 5);
    assert_eq!(after.spec.as_ref().unwrap().ttl_running_stop_s, 600);
    assert_eq!(after.expires_at_ms, after.created_at_ms + 5000);
    assert!(after.last_active_ms >= sb.last_active_ms);
    h.shutdown().await;
}

#[tokio::test]
async fn restart_keeps_running_and_paused_sandboxes() {
    let (dir, iam, _w, fakes) = setup().await;
    let h = Harness::start(dir.path(), config(), &fakes, vec![sim()]).await;
    h.create("run", spec(100, 10)).await.unwrap();
    h.create("nap", spec(100, 10)).await.unwrap();
    h.create("gone", spec(100, 10)).await.unwrap();
    h.pause("nap").await.unwrap();
    h.stop("gone").await.unwrap();
    let first_boot = h.status(false).await.boot_id;
    h.shutdown().await;

    // A creation cut short by a crash: its record says CREATING (written into the edge's
    // record log while it is down).
    let records = opendsec_edge::record::RecordStore::open(dir.path()).unwrap();
    let durable = opendsec_edge::record::WriteMode::Durable;
    let mut creating = record_file(dir.path(), "run");
    creating.lease_id = "crashed".into();
    creating.id = format!("{EDGE}.crashed");
    creating.state = opendsec_edge::SandboxStatus::Creating;
    records.write("crashed", &creating.encode().unwrap(), durable).unwrap();
    // A pause and a stop cut short the same way.
    let mut pausing = creating.clone();
    pausing.lease_id = "mid-pause".into();
    pausing.id = format!("{EDGE}.mid-pause");
    pausing.state = opendsec_edge::SandboxStatus::Pausing;
    records.write("mid-pause", &pausing.encode().unwrap(), durable).unwrap();
    let mut stopping = creating.clone();
    stopping.lease_id = "mid-stop".into();
    stopping.id = format!("{EDGE}.mid-stop");
    stopping.state = opendsec_edge::SandboxStatus::Stopping;
    stopping.end_reason = "ttl_max".into();
    records.write("mid-stop", &stopping.encode().unwrap(), durable).unwrap();
    drop(records);

    // A fresh sim backend: sim sandboxes "survive" the restart through adoption.
    let sim2 = sim();
    let h = Harness::start(dir.path(), config(), &fakes, vec![sim2.clone()]).await;
    let st = h.status(true).await;
    assert_ne!(st.boot_id, first_boot);
    assert_eq!(st.sandboxes, 2);
    assert_eq!(state(&h.get("run").await.unwrap()), SandboxState::Running);
    assert_eq!(state(&h.get("nap").await.unwrap()), SandboxState::Paused);
    assert_eq!(state(&h.get("gone").await.unwrap()), SandboxState::Stopped);
    let crashed = h.get("crashed").await.unwrap();
    assert_eq!((state(&crashed), crashed.end_reason.as_str()), (SandboxState::Failed, "edge_restart"));
    let mid_pause = h.get("mid-pause").await.unwrap();
    assert_eq!((state(&mid_pause), mid_pause.end_reason.as_str()), (SandboxState::Failed, "edge_restart"));
    let mid_stop = h.get("mid-stop").await.unwrap();
    assert_eq!((state(&mid_stop), mid_stop.end_reason.as_str()), (SandboxState::Stopped, "ttl_max"));
    assert_eq!(sim2.len(), 2);
    assert_eq!(sim2.is_paused(&format!("{EDGE}.nap")), Some(true));

    // The adopted sandboxes work as before.
    assert_eq!(state(&h.resume("nap").await.unwrap()), SandboxState::Running);
    assert_eq!(state(&h.stop("run").await.unwrap()), SandboxState::Stopped);
    // The interrupted creation's lease is released like the others (naming the edge: IAM
    // frees it only if it is still bound here).
    eventually("releases", WAIT, || async {
        let r = iam.released();
        ["run", "crashed", "mid-pause", "mid-stop"].iter().all(|l| r.contains(&l.to_string()))
    })
    .await;
    assert_eq!(iam.released().iter().filter(|l| *l == "gone").count(), 1);
    h.shutdown().await;
}

#[tokio::test]
async fn a_lease_bound_elsewhere_stops_the_sandbox_without_releasing() {
    let (dir, iam, _w, fakes) = setup().await;
    iam.bind("moved", Some("edge-9"));
    iam.bind("vanished", None);
    // The checks go out only when a batch of three is full: one GetLeases for all three.
    let mut cfg = config();
    cfg.release_batch = 3;
    cfg.release_interval = Duration::from_secs(3600);
    let sim = sim();
    let h = Harness::start(dir.path(), cfg, &fakes, vec![sim.clone()]).await;

    let sb = h.create("moved", spec(100, 10)).await.unwrap();
    assert_eq!(state(&sb), SandboxState::Running);
    h.create("vanished", spec(100, 10)).await.unwrap();
    h.create("mine", spec(100, 10)).await.unwrap();
    for lease in ["moved", "vanished"] {
        eventually("the stop", WAIT, || async {
            let sb = h.get(lease).await.unwrap();
            state(&sb) == SandboxState::Stopped && sb.end_reason == "lease_moved"
        })
        .await;
    }
    assert_eq!(iam.lookups(), [vec!["moved".to_string(), "vanished".to_string(), "mine".to_string()]]);
    assert_eq!(sim.len(), 1);
    assert_eq!(state(&h.get("mine").await.unwrap()), SandboxState::Running);
    assert!(record_file(dir.path(), "moved").lease_released);
    assert_eq!(h.edge.pending_releases(), (0, 0));
    // Nothing of the moved leases may be released (a release of "mine" would wake at a full
    // batch only, and none is queued).
    h.stop("mine").await.unwrap();
    h.shutdown().await;
    assert_eq!(iam.released(), ["mine"]);
}

#[tokio::test]
async fn lease_checks_survive_iam_failures_and_keep_the_sandbox() {
    let (dir, iam, _w, fakes) = setup().await;
    iam.fail_lookups(true);
    iam.bind("moved", Some("edge-9"));
    let sim = sim();
    let h = Harness::start(dir.path(), config(), &fakes, vec![sim.clone()]).await;
    h.create("moved", spec(100, 10)).await.unwrap();
    // IAM cannot be asked: several rounds fail (counted on the fake), the sandbox runs on and
    // the check stays queued.
    eventually("two refused lookups", WAIT, || async { iam.refused().1 >= 2 }).await;
    // (A round takes the check out of the queue while it asks, and puts it back.)
    eventually("the check queued again", WAIT, || async { h.edge.pending_releases() == (0, 1) }).await;
    assert_eq!(state(&h.get("moved").await.unwrap()), SandboxState::Running);
    assert!(iam.lookups().is_empty());
    // Once IAM answers, the retried check finds the lease elsewhere and stops the sandbox.
    iam.fail_lookups(false);
    eventually("the stop", WAIT, || async {
        let sb = h.get("moved").await.unwrap();
        state(&sb) == SandboxState::Stopped && sb.end_reason == "lease_moved"
    })
    .await;
    assert_eq!(h.edge.pending_releases(), (0, 0));
    assert!(sim.is_empty());
    h.shutdown().await;
    assert!(iam.released().is_empty(), "{:?}", iam.released());
}

#[tokio::test]
async fn a_dead_sandbox_is_failed_and_released() {
    let (dir, iam, _w, fakes) = setup().await;
    let sim = sim();
    let h = Harness::start(dir.path(), config(), &fakes, vec![sim.clone()]).await;
    let sb = h.create("doomed", spec(100, 10)).await.unwrap();
    assert!(sim.kill(&sb.id));
    eventually("the loss noticed", WAIT, || async {
        let sb = h.get("doomed").await.unwrap();
        state(&sb) == SandboxState::Failed && sb.end_reason == "lost"
    })
    .await;
    eventually("the release", WAIT, || async { iam.released() == ["doomed"] }).await;
    assert_eq!(h.status(false).await.sandboxes, 0);
    h.shutdown().await;
}

#[tokio::test]
async fn a_failed_creation_reports_the_backend_reason() {
    let (dir, iam, _w, fakes) = setup().await;
    let sim = sim();
    sim.fail_creates(Some(Reason::NoCapacity));
    let h = Harness::start(dir.path(), config(), &fakes, vec![sim.clone()]).await;
    iam.bind("retried", Some("edge-2"));

    let err = h.create("failing", spec(100, 10)).await.unwrap_err();
    assert_eq!(err.reason, Reason::NoCapacity);
    let err = h.create("retried", spec(100, 10)).await.unwrap_err();
    assert_eq!(err.reason, Reason::NoCapacity);
    let failed = h.get("failing").await.unwrap();
    assert_eq!((state(&failed), failed.end_reason.as_str()), (SandboxState::Failed, "create_failed"));
    assert_eq!(h.status(false).await.sandboxes, 0);

    // Both leases are released naming this edge: IAM frees only the one still bound here;
    // the one the caller rebound is not ours and stays.
    eventually("the releases", WAIT, || async {
        let mut r = iam.released();
        r.sort();
        r == ["failing", "retried"]
    })
    .await;
    eventually("both settled", WAIT, || async { h.edge.pending_releases() == (0, 0) }).await;
    // The record says so once its write after the release lands (later than the queue's count
    // on a loaded machine).
    eventually("the record marked released", WAIT, || async { record_file(dir.path(), "retried").lease_released })
        .await;
    assert_eq!(iam.freed(), ["failing"]);
    // Failed creations are not checked: they are released.
    assert!(iam.lookups().is_empty());
    h.shutdown().await;
}

/// A stand-in for a real backend, so the edge checks host pressure.
struct FakeContainer(SimBackend);

#[async_trait::async_trait]
impl Backend for FakeContainer {
    fn name(&self) -> &'static str {
        "container"
    }
    async fn create(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.0.create(sb).await
    }
    async fn stop(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.0.stop(sb).await
    }
    async fn pause(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.0.pause(sb).await
    }
    async fn resume(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.0.resume(sb).await
    }
    async fn probe(&self, id: &str) -> Result<bool, BackendError> {
        self.0.probe(id).await
    }
    async fn adopt(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.0.adopt(sb).await
    }
    async fn cleanup(&self, keep: &std::collections::HashSet<String>) -> Result<usize, BackendError> {
        self.0.cleanup(keep).await
    }
    fn usage(&self) -> Option<Usage> {
        None
    }
}

#[tokio::test]
async fn host_pressure_refuses_creations_only_with_real_backends() {
    let low_memory = HostReading {
        mem_total_mb: Some(16_000),
        mem_available_mb: Some(100),
        disk_free_mb: Some(100_000),
        cpu_some_avg10: Some(0.0),
    };
    let size = HostSize { cpu_millis: 2000, memory_mb: 16_000, disk_mb: 100_000 };
    let (dir, _iam, _w, fakes) = setup().await;

    // Sim-only: a hundred sim edges share one host, so its memory says nothing.
    let host = Arc::new(FixedHost::new(low_memory, size));
    let h = Harness::start_with_host(dir.path(), config(), &fakes, vec![sim()], Some(host)).await;
    h.create("sim-ok", spec(1, 1)).await.unwrap();
    assert!(!h.status(false).await.pressure.unwrap().memory);
    h.shutdown().await;

    let dir = tempfile::tempdir().unwrap();
    let host = Arc::new(FixedHost::new(low_memory, size));
    host.set_cpu_use(Some(0.25));
    let backends: Vec<Arc<dyn Backend>> = vec![Arc::new(FakeContainer(SimBackend::new())), sim()];
    let mut cfg = config();
    cfg.capacity.cpu_millis = 0; // measured from the host
    let h = Harness::start_with_host(dir.path(), cfg, &fakes, backends, Some(host.clone())).await;
    let container = SandboxSpec { backend: "container".into(), ..spec(1, 1) };
    let err = h.create("refused", container.clone()).await.unwrap_err();
    assert_eq!(err.reason, Reason::NoCapacity);
    assert!(err.message.contains("memory pressure"), "{}", err.message);
    let st = h.status(false).await;
    assert!(st.pressure.unwrap().memory);
    assert_eq!(st.capacity.unwrap().cpu_millis, 2000);
    assert_eq!(st.cpu_use, 0.25);

    host.set_reading(HostReading { mem_available_mb: Some(8_000), ..low_memory });
    tokio::time::sleep(Duration::from_millis(150)).await; // past the pressure cache
    h.create("admitted", container).await.unwrap();
    h.shutdown().await;
}

#[tokio::test]
async fn closing_without_keep_stops_sandboxes_and_flushes_releases() {
    let (dir, iam, _w, fakes) = setup().await;
    let mut cfg = config();
    cfg.keep_sandboxes_on_exit = false;
    // Releases would wait long in the queue; only the close flushes them.
    cfg.release_interval = Duration::from_secs(3600);
    let sim = sim();
    let h = Harness::start(dir.path(), cfg, &fakes, vec![sim.clone()]).await;
    h.create("x", spec(1, 1)).await.unwrap();
    h.create("y", spec(1, 1)).await.unwrap();
    h.pause("y").await.unwrap();
    h.shutdown().await;
    assert!(sim.is_empty());
    let mut released = iam.released();
    released.sort();
    assert_eq!(released, ["x", "y"]);
    let rec = record_file(dir.path(), "x");
    assert_eq!((rec.state, rec.end_reason.as_str()), (opendsec_edge::SandboxStatus::Stopped, "edge_shutdown"));
}

#[tokio::test]
async fn many_concurrent_creations_respect_capacity() {
    let (dir, _iam, _w, fakes) = setup().await;
    let mut cfg = config();
    cfg.max_sandboxes = 50;
    let h = Arc::new(Harness::start(dir.path(), cfg, &fakes, vec![sim()]).await);
    let tasks: Vec<_> = (0..80)
        .map(|i| {
            let h = h.clone();
            tokio::spawn(async move { h.create(&format!("c{i}"), spec(10, 10)).await })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => ok += 1,
            Err(e) => assert_eq!(e.reason, Reason::NoCapacity, "{e}"),
        }
    }
    assert_eq!(ok, 50);
    assert_eq!(h.status(false).await.sandboxes, 50);
    match Arc::try_unwrap(h) {
        Ok(h) => h.shutdown().await,
        Err(_) => panic!("harness still shared"),
    }
}

#[tokio::test]
async fn ended_records_are_deleted_after_retention_once_released() {
    let (dir, iam, _w, fakes) = setup().await;
    let mut cfg = config();
    cfg.ended_retention = Duration::from_millis(300);
    let h = Harness::start(dir.path(), cfg, &fakes, vec![sim()]).await;
    h.create("old", spec(1, 1)).await.unwrap();
    h.stop("old").await.unwrap();
    // Kept for Get while the retention runs.
    assert_eq!(state(&h.get("old").await.unwrap()), SandboxState::Stopped);
    eventually("the record deleted", WAIT, || async { h.get("old").await.is_err() }).await;
    assert_eq!(h.get("old").await.unwrap_err().reason, Reason::NotFound);
    assert_eq!(iam.released(), ["old"]);
    assert!(!opendsec_edge::record::peek(dir.path(), opendsec_edge::record::RECORDS_DIR).unwrap().contains_key("old"));
    assert_eq!(h.edge.sandbox_count(), 0);
    h.shutdown().await;
}

#[tokio::test]
async fn failed_releases_stay_queued_and_are_retried() {
    let (dir, iam, _w, fakes) = setup().await;
    iam.fail_releases(true);
    let h = Harness::start(dir.path(), config(), &fakes, vec![sim()]).await;
    h.create("r", spec(1, 1)).await.unwrap();
    h.stop("r").await.unwrap();
    // Several release rounds fail (counted on the fake); the lease stays queued and unmarked.
    eventually("two refused releases", WAIT, || async { iam.refused().0 >= 2 }).await;
    // Between rounds the lease is back in the queue (during one it is out, being tried).
    eventually("the lease queued again", WAIT, || async { h.edge.pending_releases() == (1, 0) }).await;
    assert!(!record_file(dir.path(), "r").lease_released);
    iam.fail_releases(false);
    eventually("the retried release", WAIT, || async { iam.released() == ["r"] }).await;
    eventually("the release marked", WAIT, || async { record_file(dir.path(), "r").lease_released }).await;
    assert_eq!(h.edge.pending_releases(), (0, 0));
    h.shutdown().await;
}

#[tokio::test]
async fn runtime_calls_are_routed_checked_and_refused_clearly() {
    let (dir, _iam, _w, fakes) = setup().await;
    let h = Harness::start(dir.path(), config(), &fakes, vec![sim()]).await;
    h.create("rt", spec(100, 64)).await.unwrap();
    let links = grpc::Links::new(creds(&h.pki, Role::Apiserver, "0"));
    let mut rt =
        opendsec_proto::v1::runtime_client::RuntimeClient::new(links.channel(&h.addr, Role::Edge, Some(EDGE)).unwrap());
    let id = format!("{EDGE}.rt");
    let call = |project: Option<&str>| {
        let mut r = tonic::Request::new(opendsec_proto::v1::ListProcessesRequest { sandbox_id: id.clone() });
        if let Some(p) = project {
            r.metadata_mut().insert(grpc::EXPECT_PROJECT_HEADER, p.parse().unwrap());
        }
        r
    };
    // Without the project the apiserver authorized it for: refused.
    let e = ApiError::from(rt.list_processes(call(None)).await.unwrap_err());
    assert_eq!(e.reason, Reason::InvalidArgument, "{e:?}");
    assert!(e.message.contains(grpc::EXPECT_PROJECT_HEADER), "{e:?}");
    // The sim backend has no agent: a clear refusal naming why.
    let root = spec(1, 1).project;
    let e = ApiError::from(rt.list_processes(call(Some(&root))).await.unwrap_err());
    assert_eq!(e.reason, Reason::InvalidArgument, "{e:?}");
    assert!(e.message.contains("no agent"), "{e:?}");
    // An apiserver that authorized the call for another project (an id reused since it
    // cached the project) is told the sandbox does not exist.
    let e = ApiError::from(rt.list_processes(call(Some("root/other"))).await.unwrap_err());
    assert_eq!(e.reason, Reason::NotFound, "{e:?}");
    // Unknown and malformed ids, other edges' ids.
    for (bad, reason) in [("nope", Reason::InvalidArgument), ("other-edge.rt", Reason::NotFound)] {
        let r = for_project(opendsec_proto::v1::ListProcessesRequest { sandbox_id: bad.into() }, &root);
        let e = ApiError::from(rt.list_processes(r).await.unwrap_err());
        assert_eq!(e.reason, reason, "{bad}: {e:?}");
    }
    // Without a certificate, nothing.
    let mut anon = opendsec_proto::v1::runtime_client::RuntimeClient::new(grpc::channel(&h.addr).unwrap());
    assert!(anon.list_processes(opendsec_proto::v1::ListProcessesRequest { sandbox_id: id.clone() }).await.is_err());
    h.stop("rt").await.unwrap();
    let e = ApiError::from(rt.list_processes(call(Some(&root))).await.unwrap_err());
    assert_eq!(e.reason, Reason::InvalidState, "{e:?}");
    h.shutdown().await;
}
