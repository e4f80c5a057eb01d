//! Shared by the container end-to-end tests and benchmarks: a cluster whose edge offers `sim`
//! and `container` with a busybox image imported, a raw `Runtime` client of the apiserver with
//! a bearer token, and the test images (busybox from `busybox-static`, Debian from
//! `scripts/debian-image.sh`). Root only (CI runs as root); each binary uses part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use opendsec_cli::ctl::{Cli, run};
use opendsec_cluster::{Cluster, UpOptions};
use opendsec_common::config::Config;
use opendsec_edge::linuxrt::cgroup;
use opendsec_edge::linuxrt::sandbox::{self, Sandbox};
use opendsec_proto::v1 as pb;
#[allow(unused_imports)] // each test binary uses some of them
pub use opendsec_testkit::{busybox_rootfs, is_root, until, wait_for};

pub const EDGE: &str = "edge-000";
pub struct Guard {
    pub containers: PathBuf,
}
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = sandbox::cleanup_leftovers(
            &self.containers,
            // Every sandbox of this state directory, whatever its edge's name.
            &opendsec_edge::backend::container::name_tag(&self.containers),
            &[],
        );
    }
}

pub fn state(s: &pb::Sandbox) -> pb::SandboxState {
    pb::SandboxState::try_from(s.state).unwrap_or(pb::SandboxState::Unspecified)
}

/// Whether the container of `sb` is frozen in its cgroup: `THAWED` or `FROZEN` (or what the
/// kernel says in between).
pub fn freezer_state_of(f: &Fixture, sb: &pb::Sandbox) -> String {
    let containers = f.cluster.config.edge_state_dir(&sb.edge).join("containers");
    let name = opendsec_edge::backend::container::sandbox_name(&containers, &sb.id);
    let s = opendsec_edge::linuxrt::sandbox::Sandbox::adopt(&containers, &name).unwrap();
    let st = freezer_state(&s);
    match st.as_str() {
        "0" | "THAWED" => "THAWED".into(),
        "1" => "FROZEN".into(),
        _ => st,
    }
}

pub fn freezer_state(s: &Sandbox) -> String {
    let rel = s.cgroup.rel_path().strip_prefix("/").unwrap_or(s.cgroup.rel_path()).to_path_buf();
    let p = match s.cgroup.layout() {
        cgroup::Layout::V1 => Path::new("/sys/fs/cgroup/freezer").join(rel).join("freezer.state"),
        cgroup::Layout::V2 => Path::new("/sys/fs/cgroup").join(rel).join("cgroup.freeze"),
    };
    std::fs::read_to_string(p).unwrap_or_default().trim().to_owned()
}

/// A cluster with one edge offering `sim` and `container`, with the busybox image imported as
/// `busybox:latest` in `root`.
pub struct Fixture {
    pub _dir: tempfile::TempDir,
    pub _guard: Guard,
    /// The other edges' (with [`fixture_edges`]).
    pub _guards: Vec<Guard>,
    pub cluster: Cluster,
    pub containers: PathBuf,
    pub store: PathBuf,
    pub addr: String,
    /// The cluster's CA (its public port speaks TLS).
    pub ca: PathBuf,
    pub admin: opendsec_client::Client,
}

pub async fn fixture() -> Fixture {
    fixture_with(|_| {}).await
}

/// [`fixture`] with the config changed by `tweak` before the cluster starts.
pub async fn fixture_with(tweak: impl FnOnce(&mut Config)) -> Fixture {
    fixture_full(tweak, opendsec_common::time::Clock::system()).await
}

/// [`fixture`] whose edge runs TTLs on `clock` (a manual one moves only when told).
pub async fn fixture_with_clock(clock: opendsec_common::time::Clock) -> Fixture {
    fixture_full(|_| {}, clock).await
}

/// [`fixture_with`] with `edges` edges (`edge-000`, `edge-001`, ...), each as the one of
/// [`fixture`].
pub async fn fixture_edges(edges: u32, tweak: impl FnOnce(&mut Config)) -> Fixture {
    fixture_n(tweak, opendsec_common::time::Clock::system(), edges).await
}

async fn fixture_full(tweak: impl FnOnce(&mut Config), clock: opendsec_common::time::Clock) -> Fixture {
    fixture_n(tweak, clock, 1).await
}

async fn fixture_n(tweak: impl FnOnce(&mut Config), clock: opendsec_common::time::Clock, edges: u32) -> Fixture {
    if !is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = Config { state_dir: dir.path().join("state"), ..Config::default() };
    cfg.apiserver.listen = "127.0.0.1:0".into();
    cfg.apiserver.metrics_listen = String::new();
    cfg.apiserver.snapshot_refresh = Duration::from_millis(100);
    cfg.watcher.probe_interval = Duration::from_millis(100);
    cfg.watcher.probe_timeout = Duration::from_millis(500);
    cfg.edge.register_interval = Duration::from_millis(500);
    cfg.edge.ttl_check_interval = Duration::from_millis(200);
    cfg.edge.backends = vec!["sim".into(), "container".into()];
    cfg.edge.container_setup_exe = Some(PathBuf::from(env!("CARGO_BIN_EXE_opendsec")));
    cfg.edge.container_pids_limit = 256;
    // Tests in the machine's own namespace leave its network alone; the network tests turn
    // this on inside a namespace of their own (`opendsec_testkit::netns`).
    cfg.network.enabled = false;
    tweak(&mut cfg);
    let containers = cfg.edge_state_dir(EDGE).join("containers");
    let guard = Guard { containers: containers.clone() };
    let guards = (1..edges)
        .map(|i| Guard { containers: cfg.edge_state_dir(&opendsec_cluster::edge_name(i)).join("containers") })
        .collect();
    let cluster = Cluster::up(cfg, UpOptions { sim_edges: Some(edges), clock, ..Default::default() }).await.unwrap();
    cluster.wait_ready(Duration::from_secs(30)).await.unwrap();
    let rootfs_dir = busybox_rootfs(dir.path(), &[]);
    let store = cluster.config.image_store_dir();
    let addr = cluster.apiserver_addr.to_string();
    let ca = cluster.ca_path.clone();
    import(&ca, &addr, &cluster.admin_token, &rootfs_dir, &store, "busybox:latest").await;
    let admin =
        opendsec_client::Client::new(std::slice::from_ref(&addr), Some(&cluster.admin_token), &cluster.client_tls())
            .unwrap()
            .with_retry_timeout(Duration::from_secs(10));
    Fixture { _dir: dir, _guard: guard, _guards: guards, cluster, containers, store, addr, ca, admin }
}

/// An edge (and apiserver) that takes thousands of small sandboxes from one principal, for the
/// benchmarks: declared capacity overcommitted on purpose (idle sandboxes use little of it),
/// no creation rate limit.
pub fn room_for_thousands(c: &mut Config) {
    c.edge.container_pids_limit = 256;
    c.edge.capacity = opendsec_common::config::CapacityConfig {
        cpu_millis: 4_000_000,
        memory_mb: 400_000,
        disk_mb: 4_000_000,
        gpus: 0,
    };
    c.edge.max_sandboxes = 5000;
    c.apiserver.rate_per_principal = 100_000.0;
    c.apiserver.burst_per_principal = 100_000.0;
}

pub async fn import(ca: &Path, addr: &str, token: &str, rootfs: &Path, store: &Path, name: &str) {
    let argv = [
        "opendsecctl",
        "--addr",
        addr,
        "--token",
        token,
        "--ca",
        ca.to_str().unwrap(),
        "--json",
        "image",
        "import",
        "--rootfs",
        rootfs.to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
        "--name",
        name,
    ];
    run(Cli::try_parse_from(argv).unwrap()).await.unwrap();
}

pub fn container_spec(image: &str, memory_mb: u64, disk_mb: u64) -> pb::SandboxSpec {
    pb::SandboxSpec {
        project: "root".into(),
        image: image.into(),
        backend: "container".into(),
        resources: Some(pb::Resources { cpu_millis: 500, memory_mb, disk_mb, gpus: 0 }),
        ..Default::default()
    }
}

pub type Rt = pb::runtime_client::RuntimeClient<
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Bearer>,
>;

#[derive(Clone)]
pub struct Bearer(pub String);
impl tonic::service::Interceptor for Bearer {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        opendsec_common::grpc::set_bearer(&mut req, &self.0).map_err(|e| e.to_status())?;
        Ok(req)
    }
}

/// A raw `Runtime` client of the apiserver (TLS, trusting `ca`) with a bearer token.
pub fn runtime(ca: &Path, addr: &str, token: &str) -> Rt {
    let tls = opendsec_common::grpc::PublicTls::with_ca(&std::fs::read(ca).unwrap(), None).unwrap();
    let ch = opendsec_common::grpc::public_channel(addr, &tls).unwrap();
    pb::runtime_client::RuntimeClient::with_interceptor(ch, Bearer(token.to_string()))
        .max_decoding_message_size(64 << 20)
        .max_encoding_message_size(64 << 20)
}

pub async fn exec_in(rt: &mut Rt, id: &str, session: &str, cmd: &str) -> pb::ExecResult {
    let req = pb::ExecRequest {
        sandbox_id: id.into(),
        session_id: session.into(),
        command: cmd.into(),
        timeout_ms: 60_000,
        ..Default::default()
    };
    rt.exec(req).await.unwrap_or_else(|e| panic!("exec {cmd:?}: {e:?}")).into_inner()
}

pub fn out(r: &pb::ExecResult) -> String {
    String::from_utf8_lossy(&r.stdout).trim().to_string()
}

pub fn reason(s: &tonic::Status) -> String {
    opendsec_common::ApiError::from_status(s).reason.to_string()
}

pub async fn principal(admin: &opendsec_client::Client, name: &str, project: &str, perms: &[&str]) -> String {
    admin.create_principal(pb::CreatePrincipalRequest { name: name.into(), project: project.into() }).await.unwrap();
    for p in perms {
        let grant = pb::Grant { principal: name.into(), project: project.into(), permission: (*p).into() };
        admin.grant(pb::GrantRequest { grant: Some(grant) }).await.unwrap();
    }
    admin
        .create_token(pb::CreateTokenRequest { principal: name.into(), ttl_s: 0, description: "test".into() })
        .await
        .unwrap()
        .token
}

pub async fn read_all(rt: &mut Rt, id: &str, path: &str) -> Result<Vec<u8>, tonic::Status> {
    let req = pb::ReadFileRequest { sandbox_id: id.into(), path: path.into(), ..Default::default() };
    let mut s = rt.read_file(req).await?.into_inner();
    let mut data = Vec::new();
    while let Some(c) = s.message().await? {
        data.extend_from_slice(&c.data);
    }
    Ok(data)
}

pub async fn write_all(rt: &mut Rt, id: &str, path: &str, data: &[u8]) -> Result<u64, tonic::Status> {
    let mut msgs = vec![pb::WriteFileRequest {
        sandbox_id: id.into(),
        path: path.into(),
        make_parents: true,
        ..Default::default()
    }];
    for c in data.chunks(1 << 20) {
        msgs.push(pb::WriteFileRequest { data: c.to_vec(), ..Default::default() });
    }
    if let Some(last) = msgs.last_mut() {
        last.finish = true;
    }
    Ok(rt.write_file(tokio_stream::iter(msgs)).await?.into_inner().bytes_written)
}

/// The Debian test image's root file system (`scripts/debian-image.sh` builds it once;
/// `make test` runs it).
pub fn debian_rootfs() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/debian-image.sh");
    let o = std::process::Command::new(&script).arg("--path").output().unwrap();
    let p = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
    assert!(p.join("usr/bin/python3").exists(), "the Debian test image is missing: run {} first", script.display());
    p
}

/// The Debian test image with systemd as its init (`scripts/debian-image.sh systemd`).
pub fn debian_systemd_rootfs() -> PathBuf {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/debian-image.sh");
    let o = std::process::Command::new(&script).args(["systemd", "--path"]).output().unwrap();
    let p = PathBuf::from(String::from_utf8_lossy(&o.stdout).trim());
    assert!(
        p.join("lib/systemd/systemd").exists(),
        "the Debian systemd image is missing: run {} systemd first",
        script.display()
    );
    p
}

/// A free loopback port (for a listener a child process binds).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `opendsecctl --json ARGS` against `cluster` as its administrator, in process.
pub async fn ctl_admin(cluster: &Cluster, args: &[&str]) -> Result<(), opendsec_cli::ctl::CtlError> {
    let addr = cluster.apiserver_addr.to_string();
    let ca = cluster.ca_path.to_str().unwrap();
    let mut argv = vec!["opendsecctl", "--addr", &addr, "--token", &cluster.admin_token, "--ca", ca, "--json"];
    argv.extend_from_slice(args);
    run(Cli::try_parse_from(argv).expect("a valid command line")).await.map(|_| ())
}

/// A cluster of one sim edge in `dir` (no root needed), ready.
pub async fn sim_cluster(dir: &Path) -> Cluster {
    let mut cfg = Config { state_dir: dir.join("state"), ..Config::default() };
    cfg.apiserver.listen = "127.0.0.1:0".into();
    cfg.apiserver.metrics_listen = String::new();
    cfg.apiserver.snapshot_refresh = Duration::from_millis(100);
    cfg.watcher.probe_interval = Duration::from_millis(100);
    let cluster = Cluster::up(cfg, UpOptions { sim_edges: Some(1), ..Default::default() }).await.unwrap();
    cluster.wait_ready(Duration::from_secs(30)).await.unwrap();
    cluster
}

/// The VM backends' guest kernel (`make vm-kernel`).
pub fn vm_kernel() -> PathBuf {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/vm-kernel.sh");
    let out = std::process::Command::new(script).arg("--path").output().unwrap();
    let dir = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    assert!(dir.join("complete").exists(), "no guest kernel in {}: run `make vm-kernel`", dir.display());
    dir
}
