//! `opendsecctl cluster up` as a newcomer runs it: stopping it (SIGTERM, as `make down` does;
//! Ctrl-C is the same path) stops the container sandboxes it made and says how many; with
//! `--keep-sandboxes` they stay running and the next `cluster up` on the same state directory
//! adopts them. Checked from the host: the sandboxes' processes and cgroups.
//! Root only (CI runs as root); needs `make agent`.
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use crate::common::*;

use opendsec_edge::linuxrt::cgroup::SandboxCgroup;

struct Up {
    child: Child,
    log: PathBuf,
}

impl Up {
    fn start(config: &Path, state: &Path, extra: &[&str]) -> Up {
        static STARTS: AtomicU32 = AtomicU32::new(0);
        let log = state.with_file_name(format!("up-{}.log", STARTS.fetch_add(1, Ordering::SeqCst)));
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_opendsecctl"))
            .args(["cluster", "up", "--config", config.to_str().unwrap(), "--state-dir", state.to_str().unwrap()])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out))
            .spawn()
            .unwrap();
        let up = Up { child, log };
        wait_for("the cluster to start", Duration::from_secs(120), || up.text().contains("export OPENDSEC_ADDR"));
        up
    }

    fn text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// SIGTERM, as `make down` sends; waits for the exit.
    fn down(mut self) -> String {
        // SAFETY: kill with our own child's pid and a signal number.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(120);
        while self.child.try_wait().unwrap().is_none() {
            assert!(Instant::now() < deadline, "the cluster did not stop: {}", self.text());
            std::thread::sleep(Duration::from_millis(50));
        }
        self.text()
    }
}

/// The processes of a sandbox's cgroup (None: the cgroup is gone).
fn processes(containers: &Path, id: &str) -> Option<Vec<i32>> {
    let name = opendsec_edge::backend::container::sandbox_name(containers, id);
    SandboxCgroup::open(&name).ok().and_then(|cg| cg.pids().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopping_cluster_up_stops_its_sandboxes_unless_asked_to_keep_them() {
    if !is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let dir = tempfile::tempdir().unwrap();
    let state_dir = dir.path().join("state");
    let addr = format!("127.0.0.1:{}", free_port());
    let config = dir.path().join("config.json");
    let cfg = serde_json::json!({
        "sim_edges": 1,
        "apiserver": { "listen": addr, "metrics_listen": "" },
        "edge": { "backends": ["container"], "container_setup_exe": env!("CARGO_BIN_EXE_opendsec") },
        // This test runs in the machine's own namespace: leave its network alone.
        "network": { "enabled": false },
    });
    std::fs::write(&config, cfg.to_string()).unwrap();
    let containers = state_dir.join("edges").join(EDGE).join("containers");
    let _guard = Guard { containers: containers.clone() };
    let rootfs = busybox_rootfs(dir.path(), &[]);

    // The default: stopping the cluster stops its sandboxes, and it says so.
    let up = Up::start(&config, &state_dir, &[]);
    assert!(up.text().contains("Ctrl-C stops the cluster and its sandboxes"), "{}", up.text());
    let token = std::fs::read_to_string(state_dir.join("admin.token")).unwrap().trim().to_string();
    let ca = state_dir.join("pki/ca.pem");
    import(&ca, &addr, &token, &rootfs, &state_dir.join("images"), "busybox:latest").await;
    let tls = opendsec_common::grpc::PublicTls::with_ca(&std::fs::read(&ca).unwrap(), None).unwrap();
    let client = || opendsec_client::Client::new(std::slice::from_ref(&addr), Some(&token), &tls).unwrap();
    let admin = client();
    let mut ids = Vec::new();
    for _ in 0..2 {
        ids.push(admin.create_sandbox(container_spec("busybox:latest", 64, 64)).await.unwrap().id);
    }
    for id in &ids {
        assert!(processes(&containers, id).is_some_and(|p| !p.is_empty()), "{id} runs");
    }
    let said = up.down();
    assert!(said.contains("stopped the cluster and 2 live sandboxes"), "{said}");
    for id in &ids {
        assert_eq!(processes(&containers, id), None, "{id} was left running after the cluster stopped");
    }

    // --keep-sandboxes: they outlive the cluster and the next one adopts them.
    let up = Up::start(&config, &state_dir, &["--keep-sandboxes"]);
    let admin = client();
    let kept = admin.create_sandbox(container_spec("busybox:latest", 64, 64)).await.unwrap().id;
    let before = processes(&containers, &kept).unwrap();
    assert!(!before.is_empty());
    let said = up.down();
    assert!(said.contains("its sandboxes are left running"), "{said}");
    assert_eq!(processes(&containers, &kept).as_ref(), Some(&before), "the kept sandbox still runs, untouched");

    let up = Up::start(&config, &state_dir, &[]);
    let admin = client();
    let got = admin.get_sandbox(&kept).await.unwrap();
    assert_eq!(state(&got), opendsec_proto::v1::SandboxState::Running, "adopted: {got:?}");
    let said = up.down();
    assert!(said.contains("stopped the cluster and 1 live sandbox"), "{said}");
    assert_eq!(processes(&containers, &kept), None);
}
