//! Shared setup of the end-to-end tests: a whole cluster in this process, on loopback, with
//! short intervals so that health, snapshots and reconciliation move quickly.

#![allow(dead_code, unused_imports)]

use std::time::Duration;

use opendsec_client::Client;
use opendsec_cluster::{Cluster, UpOptions};
use opendsec_common::config::Config;
use opendsec_common::time::Clock;
use opendsec_proto::v1 as pb;
pub use opendsec_testkit::eventually;

#[derive(Debug)]
pub struct TestCluster {
    pub cluster: Cluster,
    pub admin: Client,
    pub dir: tempfile::TempDir,
}

pub fn fast_config(dir: &std::path::Path) -> Config {
    let mut c = Config { state_dir: dir.to_path_buf(), ..Config::default() };
    c.apiserver.listen = "127.0.0.1:0".into();
    c.apiserver.metrics_listen = String::new();
    c.apiserver.snapshot_refresh = Duration::from_millis(100);
    c.watcher.probe_interval = Duration::from_millis(100);
    c.watcher.probe_timeout = Duration::from_millis(500);
    c.edge.ttl_check_interval = Duration::from_millis(100);
    c.edge.register_interval = Duration::from_millis(500);
    c
}

pub async fn start(edges: u32, tweak: impl FnOnce(&mut Config)) -> TestCluster {
    start_with_clock(edges, Clock::system(), tweak).await
}

/// A cluster whose edges run their TTLs on `clock` (a manual one moves only when told).
pub async fn start_with_clock(edges: u32, clock: Clock, tweak: impl FnOnce(&mut Config)) -> TestCluster {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = fast_config(dir.path());
    tweak(&mut cfg);
    let cluster =
        Cluster::up(cfg, UpOptions { sim_edges: Some(edges), clock, ..Default::default() }).await.expect("cluster up");
    cluster.wait_ready(Duration::from_secs(30)).await.expect("cluster ready");
    let admin = client(&cluster, &cluster.admin_token);
    TestCluster { cluster, admin, dir }
}

pub fn client(cluster: &Cluster, token: &str) -> Client {
    Client::new(&[cluster.apiserver_addr.to_string()], Some(token), &cluster.client_tls())
        .expect("client")
        .with_retry_timeout(Duration::from_secs(10))
}

pub fn spec(project: &str, cpu: u32, mem: u64) -> pb::SandboxSpec {
    pb::SandboxSpec {
        project: project.into(),
        image: "scratch".into(),
        backend: "sim".into(),
        resources: Some(pb::Resources { cpu_millis: cpu, memory_mb: mem, disk_mb: 0, gpus: 0 }),
        ..Default::default()
    }
}

/// A principal in `project` with `perms` granted there, and its token.
pub async fn principal(admin: &Client, name: &str, project: &str, perms: &[&str]) -> String {
    admin
        .create_principal(pb::CreatePrincipalRequest { name: name.into(), project: project.into() })
        .await
        .expect("create principal");
    for p in perms {
        admin
            .grant(pb::GrantRequest {
                grant: Some(pb::Grant { principal: name.into(), project: project.into(), permission: (*p).into() }),
            })
            .await
            .expect("grant");
    }
    admin
        .create_token(pb::CreateTokenRequest { principal: name.into(), ttl_s: 0, description: "test".into() })
        .await
        .expect("create token")
        .token
}

pub async fn project(admin: &Client, path: &str, quota: pb::Quota) {
    admin
        .create_project(pb::CreateProjectRequest { path: path.into(), quota: Some(quota) })
        .await
        .expect("create project");
}

pub async fn usage(admin: &Client, path: &str) -> pb::Usage {
    admin.get_project(pb::GetProjectRequest { path: path.into() }).await.expect("get project").usage.unwrap_or_default()
}
