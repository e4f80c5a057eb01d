//! Issue 4's benchmarks (`make bench-container` runs them, in release, as root;
//! `cargo bench -p opendsec-cli --bench container [name]`). Prints figures, asserts nothing about time. Through the public API of an in-process
//! cluster (real gRPC between apiserver, edge and agent), beside Debian's `runc` on a bundle
//! with the same busybox root file system:
//!
//! - creation until the agent answers: one by one, and 100 in parallel (p50/p99); `runc run -d`
//!   one by one;
//! - exec round trip of `true` in an existing session through the apiserver; `runc exec true`;
//! - sustained creations per second on the node and the host memory per idle sandbox (agent +
//!   shell) with `BENCH_IDLE` (default 1,000) idle sandboxes at once;
//! - streaming throughput of a command printing 1 GiB through `ExecStream`.

#[path = "../tests/it/common/mod.rs"]
mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::*;
use opendsec_proto::v1 as pb;

fn pct(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

fn show(what: &str, mut v: Vec<Duration>) {
    v.sort();
    println!(
        "{what}: n={} p50={:.2} ms p99={:.2} ms",
        v.len(),
        pct(&v, 50).as_secs_f64() * 1e3,
        pct(&v, 99).as_secs_f64() * 1e3
    );
}

fn mem_used_mb() -> f64 {
    let t = std::fs::read_to_string("/proc/meminfo").unwrap();
    let f = |k: &str| -> f64 {
        t.lines().find_map(|l| l.strip_prefix(k)).and_then(|v| v.split_whitespace().next()).unwrap().parse().unwrap()
    };
    (f("MemTotal:") - f("MemAvailable:")) / 1024.0
}

/// Runs runc and waits for it (not for the container: a detached container keeps its stdio,
/// so runc's own stdio goes to /dev/null and a file, never to pipes we would wait on).
fn runc(args: &[&str], err: &Path) {
    let status = std::process::Command::new("runc")
        .args(args)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(err).unwrap())
        .status()
        .expect("runc (apt install runc)");
    assert!(status.success(), "runc {args:?}: {}", std::fs::read_to_string(err).unwrap_or_default());
}

/// An OCI bundle over `rootfs` whose process sleeps (no terminal, no network namespace setup
/// beyond runc's defaults).
fn runc_bundle(dir: &Path, rootfs: &Path) -> std::path::PathBuf {
    let b = dir.join("bundle");
    std::fs::create_dir_all(&b).unwrap();
    let o = std::process::Command::new("runc").args(["spec", "--bundle", b.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success());
    let mut spec: serde_json::Value = serde_json::from_slice(&std::fs::read(b.join("config.json")).unwrap()).unwrap();
    spec["process"]["terminal"] = false.into();
    spec["process"]["args"] = serde_json::json!(["sleep", "1000000"]);
    spec["root"]["readonly"] = true.into();
    spec["root"]["path"] = rootfs.to_str().unwrap().into();
    std::fs::write(b.join("config.json"), serde_json::to_vec(&spec).unwrap()).unwrap();
    b
}

async fn bench_container_sandboxes() {
    let idle: usize = std::env::var("BENCH_IDLE").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    // BENCH_USERNS=0: the same without user namespaces (to compare).
    let userns = std::env::var("BENCH_USERNS").map_or(true, |v| v != "0");
    let f = fixture_with(|c| {
        c.edge.user_namespaces = userns;
        room_for_thousands(c);
    })
    .await;
    let token = f.cluster.admin_token.clone();
    let mut rt = runtime(&f.ca, &f.addr, &token);
    let spec = pb::SandboxSpec {
        resources: Some(pb::Resources { cpu_millis: 1000, memory_mb: 64, disk_mb: 16, gpus: 0 }),
        ..container_spec("busybox", 64, 16)
    };

    // Warm the layer cache and the code paths.
    let w = f.admin.create_sandbox(spec.clone()).await.unwrap();
    f.admin.stop_sandbox(&w.id).await.unwrap();

    // 1. Creation until the agent answers, one by one.
    let mut lat = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..50 {
        let t = Instant::now();
        let s = f.admin.create_sandbox(spec.clone()).await.unwrap();
        lat.push(t.elapsed());
        ids.push(s.id);
    }
    show("create one by one (until the agent answers)", lat);
    for id in ids.drain(..) {
        f.admin.stop_sandbox(&id).await.unwrap();
    }

    // ... and 100 in parallel.
    let t0 = Instant::now();
    let tasks: Vec<_> = (0..100)
        .map(|_| {
            let (admin, spec) = (f.admin.clone(), spec.clone());
            tokio::spawn(async move {
                let t = Instant::now();
                let s = admin.create_sandbox(spec).await.unwrap();
                (t.elapsed(), s.id)
            })
        })
        .collect();
    let mut lat = Vec::new();
    for t in tasks {
        let (d, id) = t.await.unwrap();
        lat.push(d);
        ids.push(id);
    }
    let wall = t0.elapsed();
    show("create 100 in parallel", lat);
    println!("create 100 in parallel: {:.1} creations/s", 100.0 / wall.as_secs_f64());
    for id in ids.drain(..) {
        f.admin.stop_sandbox(&id).await.unwrap();
    }

    // runc beside it: the same root file system as a bundle.
    let dir = tempfile::tempdir().unwrap();
    let rootfs = busybox_rootfs(dir.path(), &[]);
    let bundle = runc_bundle(dir.path(), &rootfs);
    let mut lat = Vec::new();
    for i in 0..50 {
        let name = format!("odbench-{}-{i}", std::process::id());
        let t = Instant::now();
        runc(&["run", "-d", "--bundle", bundle.to_str().unwrap(), &name], &dir.path().join("runc.err"));
        lat.push(t.elapsed());
        ids.push(name);
    }
    show("runc run -d (peer)", lat);
    let mut lat = Vec::new();
    for _ in 0..200 {
        let t = Instant::now();
        runc(&["exec", &ids[0], "true"], &dir.path().join("runc.err"));
        lat.push(t.elapsed());
    }
    show("runc exec true (peer)", lat);
    for name in ids.drain(..) {
        let _ = std::process::Command::new("runc").args(["delete", "--force", &name]).output();
    }

    // 2. Exec round trip of `true` in an existing session, through the apiserver.
    let s = f.admin.create_sandbox(spec.clone()).await.unwrap();
    exec_in(&mut rt, &s.id, "bench", "true").await;
    let mut lat = Vec::new();
    for _ in 0..1000 {
        let t = Instant::now();
        let r = exec_in(&mut rt, &s.id, "bench", "true").await;
        lat.push(t.elapsed());
        assert_eq!(r.exit_code, 0);
    }
    show("exec `true` in a session via the apiserver", lat);

    f.admin.stop_sandbox(&s.id).await.unwrap();

    // 4. Streaming 1 GiB through ExecStream (recorded whole: a disk that holds it, a limit
    // above it).
    let big = pb::SandboxSpec {
        resources: Some(pb::Resources { cpu_millis: 2000, memory_mb: 512, disk_mb: 2048, gpus: 0 }),
        ..spec.clone()
    };
    let s = f.admin.create_sandbox(big).await.unwrap();
    let req = pb::ExecRequest {
        sandbox_id: s.id.clone(),
        session_id: "stream".into(),
        command: "dd if=/dev/zero bs=1M count=1024 2>/dev/null".into(),
        limits: Some(pb::OutputLimits { stdout_max_bytes: 2 << 30, stderr_max_bytes: 0 }),
        ..Default::default()
    };
    let t = Instant::now();
    let mut stream = rt.exec_stream(req).await.unwrap().into_inner();
    let mut got = 0usize;
    while let Some(c) = stream.message().await.unwrap() {
        if let Some(pb::exec_chunk::Kind::Output(o)) = c.kind {
            got += o.data.len();
        }
    }
    println!("ExecStream of 1 GiB: {:.0} MiB/s ({} bytes streamed)", 1024.0 / t.elapsed().as_secs_f64(), got);
    f.admin.stop_sandbox(&s.id).await.unwrap();

    // 3. Sustained creations (16 in flight), then a session in each (agent + shell), then the
    // host memory they hold, idle.
    use futures::StreamExt;
    let before = mem_used_mb();
    let t0 = Instant::now();
    let created: Vec<String> = futures::stream::iter(0..idle)
        .map(|_| {
            let (admin, spec) = (f.admin.clone(), spec.clone());
            async move { admin.create_sandbox(spec).await.unwrap().id }
        })
        .buffer_unordered(16)
        .collect()
        .await;
    let wall = t0.elapsed();
    println!(
        "sustained: {idle} creations in {:.1} s: {:.1} creations/s",
        wall.as_secs_f64(),
        idle as f64 / wall.as_secs_f64()
    );
    let t0 = Instant::now();
    futures::stream::iter(created.iter().cloned())
        .map(|id| {
            let mut rt = rt.clone();
            async move { exec_in(&mut rt, &id, "idle", "true").await }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    println!("a session started in each of {idle} in {:.1} s", t0.elapsed().as_secs_f64());
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = mem_used_mb();
    println!(
        "idle sandboxes: {idle} (agent + shell) hold {:.0} MiB of host memory: {:.2} MiB each",
        after - before,
        (after - before) / idle as f64
    );
    let t0 = Instant::now();
    futures::stream::iter(created)
        .map(|id| {
            let admin = f.admin.clone();
            async move { admin.stop_sandbox(&id).await.unwrap() }
        })
        .buffer_unordered(16)
        .collect::<Vec<_>>()
        .await;
    println!("stopped {idle} in {:.1} s (16 at a time)", t0.elapsed().as_secs_f64());
    f.cluster.shutdown().await;
}

/// Issue 9: what a user namespace per sandbox costs. Two clusters in one run, the same image
/// and spec, one with `edge.user_namespaces` (the default), one without; measured in
/// alternating rounds so that drift of the machine hits both alike.
async fn bench_user_namespace_cost() {
    let rounds: usize = std::env::var("BENCH_ROUNDS").ok().and_then(|v| v.parse().ok()).unwrap_or(4);
    let sustained: usize = std::env::var("BENCH_SUSTAINED").ok().and_then(|v| v.parse().ok()).unwrap_or(800);
    let tweak = |userns: bool| {
        move |c: &mut opendsec_common::config::Config| {
            c.edge.user_namespaces = userns;
            room_for_thousands(c);
        }
    };
    let with = fixture_with(tweak(true)).await;
    let without = fixture_with(tweak(false)).await;
    let spec = container_spec("busybox", 64, 16);
    for f in [&with, &without] {
        let w = f.admin.create_sandbox(spec.clone()).await.unwrap();
        f.admin.stop_sandbox(&w.id).await.unwrap();
    }
    let mut lat: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    let mut rate: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    use futures::StreamExt;
    let stop_all = |f: &Fixture, ids: Vec<String>| {
        let admin = f.admin.clone();
        async move {
            futures::stream::iter(ids)
                .map(|id| {
                    let admin = admin.clone();
                    async move { admin.stop_sandbox(&id).await.unwrap() }
                })
                .buffer_unordered(16)
                .collect::<Vec<_>>()
                .await;
            // Let the teardowns' kernel work (namespaces, loop devices) finish first.
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    };
    // The sandboxes stay: each round runs with more alive in both clusters (kernel work that
    // grows with the live sandboxes shows in the later rounds).
    let mut live: [Vec<String>; 2] = [Vec::new(), Vec::new()];
    let both = [&with, &without];
    for r in 0..rounds {
        // One by one, alternating between the two clusters creation by creation.
        for _ in 0..20 {
            for (i, f) in both.into_iter().enumerate() {
                let t = Instant::now();
                live[i].push(f.admin.create_sandbox(spec.clone()).await.unwrap().id);
                lat[i].push(t.elapsed());
            }
        }
        // Sustained, one cluster at a time, the first in turns.
        for k in 0..2 {
            let i = (r + k) % 2;
            let f = both[i];
            let t0 = Instant::now();
            let more: Vec<String> = futures::stream::iter(0..sustained / rounds)
                .map(|_| {
                    let (admin, spec) = (f.admin.clone(), spec.clone());
                    async move { admin.create_sandbox(spec).await.unwrap().id }
                })
                .buffer_unordered(16)
                .collect()
                .await;
            rate[i].push(more.len() as f64 / t0.elapsed().as_secs_f64());
            live[i].extend(more);
        }
    }
    let [a, b] = live;
    println!("alive at the end: {} with, {} without user namespaces", a.len(), b.len());
    stop_all(&with, a).await;
    stop_all(&without, b).await;
    for (i, what) in ["with user namespaces", "without user namespaces"].into_iter().enumerate() {
        show(&format!("create one by one {what}"), lat[i].clone());
        let mean = rate[i].iter().sum::<f64>() / rate[i].len() as f64;
        println!("sustained creations {what} (16 in flight): {mean:.1} creations/s (rounds: {:.1?})", rate[i]);
    }
    with.cluster.shutdown().await;
    without.cluster.shutdown().await;
}

/// Runs every benchmark, or those whose names contain one of the arguments.
fn main() {
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let wanted = |n: &str| filters.is_empty() || filters.iter().any(|f| n.contains(f.as_str()));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime");
    if wanted("bench_container_sandboxes") {
        println!("== bench_container_sandboxes");
        rt.block_on(bench_container_sandboxes());
    }
    if wanted("bench_user_namespace_cost") {
        println!("== bench_user_namespace_cost");
        rt.block_on(bench_user_namespace_cost());
    }
}
