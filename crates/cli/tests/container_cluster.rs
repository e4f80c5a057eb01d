//! End to end, as root: a cluster whose edge offers `sim` and `container`, a busybox image
//! imported and registered through `opendsecctl image import`, a container sandbox created,
//! paused, resumed, carried over an edge restart and stopped through the public API, checked
//! on the host (its PID 1, cgroup freezer, loop devices, holder file) at each step.
//!
//! The test binary cannot be the setup process, so the edge re-executes the `opendsec` binary
//! (`edge.container_setup_exe`), which branches off into the setup process first thing in main.
//! A guard removes the sandbox's cgroup, processes and loop device if the test fails midway.

use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Parser;
use opendsec_cli::ctl::{Cli, run};
use opendsec_cluster::{Cluster, UpOptions};
use opendsec_common::config::Config;
use opendsec_edge::linuxrt::sandbox::{self, Sandbox};
use opendsec_edge::linuxrt::{cgroup, rootfs};
use opendsec_proto::v1 as pb;

const EDGE: &str = "sim-000";

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| s.lines().find_map(|l| l.strip_prefix("Uid:").map(|v| v.split_whitespace().next() == Some("0"))))
        .unwrap_or(false)
}

struct Guard {
    containers: PathBuf,
}
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = sandbox::cleanup_leftovers(&self.containers, &format!("sbx-{EDGE}."), &[]);
    }
}

fn state(s: &pb::Sandbox) -> pb::SandboxState {
    pb::SandboxState::try_from(s.state).unwrap_or(pb::SandboxState::Unspecified)
}

fn freezer_state(s: &Sandbox) -> String {
    let rel = s.cgroup.rel_path().strip_prefix("/").unwrap_or(s.cgroup.rel_path()).to_path_buf();
    let p = match s.cgroup.layout() {
        cgroup::Layout::V1 => Path::new("/sys/fs/cgroup/freezer").join(rel).join("freezer.state"),
        cgroup::Layout::V2 => Path::new("/sys/fs/cgroup").join(rel).join("cgroup.freeze"),
    };
    std::fs::read_to_string(p).unwrap_or_default().trim().to_owned()
}

async fn eventually(what: &str, secs: u64, mut f: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(secs);
    while !f() {
        assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn busybox_rootfs(dir: &Path) -> PathBuf {
    let root = dir.join("bbroot");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    for d in ["proc", "sys", "dev", "tmp", "etc"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    let list = std::process::Command::new("/bin/busybox").arg("--list").output().unwrap();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        if applet != "busybox" {
            std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
        }
    }
    root
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn container_sandbox_through_the_api_survives_an_edge_restart() {
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
    cfg.edge.backends = vec!["sim".into(), "container".into()];
    cfg.edge.container_init = vec!["/bin/sh".into(), "-c".into(), "while :; do sleep 1; done".into()];
    cfg.edge.container_setup_exe = Some(PathBuf::from(env!("CARGO_BIN_EXE_opendsec")));
    let containers = cfg.edge_state_dir(EDGE).join("containers");
    let _guard = Guard { containers: containers.clone() };
    let mut cluster = Cluster::up(cfg, UpOptions { state_dir: None, sim_edges: Some(1) }).await.unwrap();
    cluster.wait_ready(Duration::from_secs(30)).await.unwrap();

    let rootfs_dir = busybox_rootfs(dir.path());
    let store = cluster.config.image_store_dir();
    let addr = cluster.apiserver_addr.to_string();
    let argv = [
        "opendsecctl",
        "--addr",
        &addr,
        "--token",
        &cluster.admin_token,
        "--json",
        "image",
        "import",
        "--rootfs",
        rootfs_dir.to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
        "--name",
        "busybox:latest",
    ];
    run(Cli::try_parse_from(argv).unwrap()).await.unwrap();

    let admin = opendsec_client::Client::new(std::slice::from_ref(&addr), Some(&cluster.admin_token))
        .unwrap()
        .with_retry_timeout(Duration::from_secs(10));
    let spec = pb::SandboxSpec {
        project: "root".into(),
        image: "busybox".into(),
        backend: "container".into(),
        resources: Some(pb::Resources { cpu_millis: 500, memory_mb: 64, disk_mb: 32, gpus: 0 }),
        ..Default::default()
    };
    let s = admin.create_sandbox(spec).await.unwrap();
    assert_eq!(state(&s), pb::SandboxState::Running);
    assert_eq!(s.edge, EDGE);
    let name = format!("sbx-{}", s.id);
    let host = Sandbox::adopt(&containers, &name).unwrap();
    let pid = host.pid;
    assert!(Path::new(&format!("/proc/{pid}")).exists());
    let inuse = store.join("inuse").join(&s.id);
    assert!(inuse.exists(), "no holder file {}", inuse.display());

    let p = admin.pause_sandbox(&s.id).await.unwrap();
    assert_eq!(state(&p), pb::SandboxState::Paused);
    eventually("frozen", 10, || matches!(freezer_state(&host).as_str(), "FROZEN" | "1")).await;
    let r = admin.resume_sandbox(&s.id).await.unwrap();
    assert_eq!(state(&r), pb::SandboxState::Running);
    eventually("thawed", 10, || matches!(freezer_state(&host).as_str(), "THAWED" | "0")).await;

    // Edge restart: the sandbox keeps running and is adopted by the new edge.
    cluster.stop_edge(EDGE).await.unwrap();
    assert!(Path::new(&format!("/proc/{pid}")).exists());
    cluster.start_edge(EDGE).await.unwrap();
    assert_eq!(state(&admin.get_sandbox(&s.id).await.unwrap()), pb::SandboxState::Running);
    assert_eq!(Sandbox::adopt(&containers, &name).unwrap().pid, pid);
    // A lifecycle call after the restart goes through the adopted handle.
    assert_eq!(state(&admin.pause_sandbox(&s.id).await.unwrap()), pb::SandboxState::Paused);
    assert_eq!(state(&admin.resume_sandbox(&s.id).await.unwrap()), pb::SandboxState::Running);

    let st = admin.stop_sandbox(&s.id).await.unwrap();
    assert_eq!(state(&st), pb::SandboxState::Stopped);
    eventually("PID 1 gone", 10, || !Path::new(&format!("/proc/{pid}")).exists()).await;
    assert!(cgroup::list(&format!("sbx-{EDGE}.")).unwrap().is_empty());
    assert!(rootfs::loops_under(&containers).is_empty());
    assert!(!containers.join(&name).exists());
    assert!(!inuse.exists());
    cluster.shutdown().await;
}
