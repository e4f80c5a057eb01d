//! What the edge's root tests of the container backend share: a busybox image in a store, the
//! static agent, backend options on a temporary directory, records, a clean-up guard.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use opendsec_edge::backend::Backend;
use opendsec_edge::backend::container::{ContainerBackend, ContainerOptions, sandbox_name};
use opendsec_edge::linuxrt::cgroup::{self, IoLimits};
use opendsec_edge::linuxrt::idmap::{self, IdPool};
use opendsec_edge::linuxrt::sandbox::{self, Sandbox};
use opendsec_edge::record::{ResourcesRecord, SandboxRecord, SpecRecord};
use opendsec_edge::state::SandboxStatus;
use opendsec_images::Store;
use opendsec_proto::v1 as pb;
#[allow(unused_imports)] // each test binary uses some of them
pub use opendsec_testkit::{busybox_rootfs, wait_for};

pub const EDGE: &str = "cbtest";

pub struct Guard {
    pub state: PathBuf,
}
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = sandbox::cleanup_leftovers(&self.state, &sandbox_name(&self.state, &format!("{EDGE}.")), &[]);
    }
}

/// `busybox:latest` in project root of the store at `store_dir`.
pub async fn busybox_image(store_dir: &Path, tmp: &Path) {
    let root = busybox_rootfs(tmp, &[]);
    image_from(store_dir, &root, "busybox").await;
}

/// The root file system at `root` as image `<repo>:latest` in project root.
pub async fn image_from(store_dir: &Path, root: &Path, repo: &str) {
    let store = Store::open(store_dir).unwrap();
    let imported = opendsec_images::offline::import_rootfs(&store, root, &Default::default()).await.unwrap();
    let manifest = opendsec_images::Manifest {
        v: 1,
        project: "root".into(),
        repo: repo.into(),
        tag: "latest".into(),
        layers: imported.layers.clone(),
        config: imported.config.clone(),
        created_at_ms: 0,
        source: "test".into(),
        vm_snapshot: String::new(),
    };
    store.write_manifest(&manifest).unwrap();
}

/// The static agent `make agent` builds (`OPENDSEC_AGENT` overrides).
pub fn static_agent() -> PathBuf {
    let p = std::env::var_os("OPENDSEC_AGENT").map(PathBuf::from).unwrap_or_else(|| {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/x86_64-unknown-linux-gnu/release/opendsec-agent")
    });
    assert!(p.exists(), "the static agent {} is missing: run `make agent` first", p.display());
    p
}

pub fn options(tmp: &Path) -> ContainerOptions {
    ContainerOptions {
        edge: EDGE.into(),
        store_dir: tmp.join("store"),
        state_dir: tmp.join("containers"),
        cache_dir: tmp.join("layers"),
        init_exe: PathBuf::from(env!("CARGO_BIN_EXE_opendsec-sandbox-init")),
        agent: static_agent(),
        pids_limit: 64,
        pause_reclaim: true,
        agent_silence: Duration::from_secs(3),
        userns: Some(IdPool::new(idmap::DEFAULT_FIRST_ID, idmap::DEFAULT_RANGES).unwrap()),
        io: IoLimits { read_bps: 64 << 20, write_bps: 64 << 20, read_iops: 4000, write_iops: 4000 },
        network: None,
        snapshot_max_layers: 32,
        sessions: None,
    }
}

pub async fn exec(b: &ContainerBackend, id: &str, session: &str, cmd: &str) -> pb::ExecResult {
    let mut c = opendsec_edge::backend::agent_client(b.agent_access().unwrap().agent(id).unwrap());
    let req = pb::ExecRequest {
        sandbox_id: id.into(),
        session_id: session.into(),
        command: cmd.into(),
        ..Default::default()
    };
    c.exec(req).await.unwrap().into_inner()
}

pub fn record(lease: &str, image: &str) -> SandboxRecord {
    SandboxRecord {
        version: 1,
        id: format!("{EDGE}.{lease}"),
        edge: EDGE.into(),
        lease_id: lease.into(),
        principal: String::new(),
        spec: SpecRecord {
            project: "root/team".into(),
            image: image.into(),
            backend: "container".into(),
            resources: ResourcesRecord { cpu_millis: 500, memory_mb: 64, disk_mb: 16, gpus: 0 },
            ..Default::default()
        },
        state: SandboxStatus::Creating,
        created_at_ms: 0,
        updated_at_ms: 0,
        last_active_ms: 0,
        paused_since_ms: 0,
        end_reason: String::new(),
        ended_at_ms: 0,
        lease_released: false,
        net_slot: 0,
        member: String::new(),
        pool: String::new(),
        pool_revision: String::new(),
        moved: Default::default(),
    }
}

pub fn freezer_state(s: &Sandbox) -> String {
    let rel = s.cgroup.rel_path().strip_prefix("/").unwrap().to_path_buf();
    let p = match s.cgroup.layout() {
        cgroup::Layout::V1 => Path::new("/sys/fs/cgroup/freezer").join(rel).join("freezer.state"),
        cgroup::Layout::V2 => Path::new("/sys/fs/cgroup").join(rel).join("cgroup.freeze"),
    };
    std::fs::read_to_string(p).unwrap_or_default().trim().to_owned()
}
