//! Creation cost through gRPC with the sim backend: prints figures, never asserts on time.
//! Run with `cargo bench -p opendsec-edge --bench create`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use opendsec_common::config::EdgeConfig;
use opendsec_common::grpc;
use opendsec_common::pki::{Identity, Role};
use opendsec_common::tls::Credentials;
use opendsec_edge::backend::sim::SimBackend;
use opendsec_edge::{Edge, EdgeOptions};
use opendsec_proto::v1::edge_client::EdgeClient;
use opendsec_proto::v1::{EdgeCreateRequest, Resources, SandboxSpec};

/// CPU time of this process (user + system), from /proc/self/stat.
fn cpu_time() -> Duration {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f[11].parse::<u64>().unwrap() + f[12].parse::<u64>().unwrap();
    Duration::from_millis(ticks * 10)
}

async fn bench_creations() {
    let dir = tempfile::tempdir().unwrap();
    let opts = EdgeOptions {
        name: "bench".into(),
        state_dir: dir.path().to_path_buf(),
        config: EdgeConfig { max_sandboxes: 100_000, ..EdgeConfig::default() },
        iam_addrs: vec![],
        watcher_addrs: vec![],
        tls: Credentials::issue_local(&dir.path().join("pki"), &Identity::new(Role::Edge, "bench").unwrap()).unwrap(),
        advertise: String::new(),
        clock: Default::default(),
        network: None,
    };
    let edge = Edge::start(opts, vec![Arc::new(SimBackend::new())]).await.unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(edge.clone().serve(listener, async move {
        let _ = rx.await;
    }));
    let api = Credentials::issue_local(&dir.path().join("pki"), &Identity::new(Role::Apiserver, "0").unwrap()).unwrap();
    let client = EdgeClient::new(grpc::Links::new(api).channel(&addr, Role::Edge, Some("bench")).unwrap());
    let spec = SandboxSpec {
        project: "root".into(),
        backend: "sim".into(),
        resources: Some(Resources { cpu_millis: 1, memory_mb: 1, disk_mb: 0, gpus: 0 }),
        ttl_running_stop_s: 600,
        ttl_max_s: 3600,
        ttl_paused_s: 3600,
        ..Default::default()
    };
    let req = |i: usize| EdgeCreateRequest {
        lease_id: format!("l{i}"),
        spec: Some(spec.clone()),
        principal: "p".into(),
        ..Default::default()
    };

    // Sequential: latency of one creation.
    let mut lat = Vec::new();
    for i in 0..500 {
        let t = Instant::now();
        client.clone().create_sandbox(req(i)).await.unwrap();
        lat.push(t.elapsed());
    }
    lat.sort();
    println!("sequential: p50 {:?} p99 {:?}", lat[lat.len() / 2], lat[lat.len() * 99 / 100]);

    // Concurrent: throughput and CPU per creation.
    let n = 5000;
    let cpu0 = cpu_time();
    let t0 = Instant::now();
    let sem = Arc::new(tokio::sync::Semaphore::new(256));
    let mut tasks = Vec::new();
    for i in 0..n {
        let permit = sem.clone().acquire_owned().await.unwrap();
        let mut c = client.clone();
        let r = req(1000 + i);
        tasks.push(tokio::spawn(async move {
            c.create_sandbox(r).await.unwrap();
            drop(permit);
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let wall = t0.elapsed();
    let cpu = cpu_time() - cpu0;
    println!(
        "concurrent: {n} creations in {wall:?} = {:.0}/s; CPU (client + server) {:?} per creation",
        n as f64 / wall.as_secs_f64(),
        cpu / n as u32
    );
    println!("record log: {} syncs for {} durable writes", edge.record_syncs(), 2 * (n + 500));
    // One TTL sweep round over every sandbox.
    let (cpu0, t0) = (cpu_time(), Instant::now());
    for _ in 0..10 {
        edge.sweep_now().await;
    }
    println!(
        "ttl sweep with {} sandboxes: {:?} wall, CPU {:?} per round",
        n + 500,
        t0.elapsed() / 10,
        (cpu_time() - cpu0) / 10
    );
    // Idle: what the background loops cost with this many sandboxes.
    let cpu0 = cpu_time();
    tokio::time::sleep(Duration::from_secs(5)).await;
    println!("idle with {} sandboxes: CPU {:?} per second", n + 500, (cpu_time() - cpu0) / 5);
    let _ = tx.send(());
    served.await.unwrap().unwrap();
}

/// Runs every benchmark, or those whose names contain one of the arguments.
fn main() {
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let wanted = |n: &str| filters.is_empty() || filters.iter().any(|f| n.contains(f.as_str()));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime");
    if wanted("bench_creations") {
        println!("== bench_creations");
        rt.block_on(bench_creations());
    }
}
