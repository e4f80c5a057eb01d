//! Issue 13's snapshot and fork benchmarks (`make bench-snapshot`, in release, as root;
//! `cargo bench -p opendsec-cli --bench snapshot`). Prints figures, asserts nothing about
//! time. Through the public API of an in-process cluster (real gRPC between apiserver, edge
//! and agent), container sandboxes from the busybox image with the resources a user gets by
//! default (`opendsecctl sandbox create`: 1 CPU, 1 GiB of memory, 10 GiB of disk):
//!
//! - snapshot of a sandbox that wrote 10 MB and 1 GB: the call, and how long it was frozen;
//! - fork ×8 and ×64 of a sandbox that wrote 10 MB: from the call until every copy answered
//!   a command (and the first), beside one cold creation from the image on the same cluster.

#[path = "../tests/it/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use opendsec_proto::v1 as pb;

/// A container sandbox of `image` with the default resources.
fn spec(image: &str) -> pb::SandboxSpec {
    use opendsec_cli::ctl::{DEFAULT_CPU_MILLIS, DEFAULT_DISK_MB, DEFAULT_MEMORY_MB};
    pb::SandboxSpec {
        resources: Some(pb::Resources {
            cpu_millis: DEFAULT_CPU_MILLIS,
            memory_mb: DEFAULT_MEMORY_MB,
            disk_mb: DEFAULT_DISK_MB,
            gpus: 0,
        }),
        ..container_spec(image, DEFAULT_MEMORY_MB, DEFAULT_DISK_MB)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

async fn write_mb(rt: &mut Rt, id: &str, mb: u64) {
    let r =
        exec_in(rt, id, "main", &format!("dd if=/dev/urandom of=/data.bin bs=1M count={mb} 2>/dev/null && sync")).await;
    assert_eq!(r.exit_code, 0, "{r:?}");
}

async fn bench() {
    let f = fixture_with(room_for_thousands).await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();

    // A cold creation beside the forks: the image's layers are cached on the edge after the
    // first, as they are for the forks' lower layers.
    let mut cold = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let s = admin.create_sandbox(spec("busybox")).await.unwrap();
        exec_in(&mut rt, &s.id, "main", "true").await;
        cold.push(t.elapsed());
        admin.stop_sandbox(&s.id).await.unwrap();
    }
    cold.sort();
    println!("creation from the image until a command answers: p50 {:.1} ms (n=5)", ms(cold[2]));

    for mb in [10u64, 1024] {
        let s = admin.create_sandbox(spec("busybox")).await.unwrap();
        write_mb(&mut rt, &s.id, mb).await;
        let t = Instant::now();
        let snap = admin.create_snapshot(&s.id, &format!("bench:w{mb}"), false).await.unwrap();
        let took = t.elapsed();
        println!(
            "snapshot of {mb} MB written: {:.0} ms (frozen {} ms, layer {:.1} MB, {:.0} MB/s)",
            ms(took),
            snap.frozen_ms,
            snap.layer_bytes as f64 / 1e6,
            snap.layer_bytes as f64 / 1e6 / took.as_secs_f64()
        );
        admin.stop_sandbox(&s.id).await.unwrap();
    }

    let src = admin.create_sandbox(spec("busybox")).await.unwrap();
    write_mb(&mut rt, &src.id, 10).await;
    for count in [8u32, 64] {
        let t = Instant::now();
        let mut stream = admin
            .fork_sandbox(pb::ForkSandboxRequest { id: src.id.clone(), count, ..Default::default() })
            .await
            .unwrap();
        let mut tasks = tokio::task::JoinSet::new();
        while let Some(item) = stream.message().await.unwrap() {
            let sb = item.sandbox.unwrap_or_else(|| panic!("a copy failed: {:?}", item.error));
            let mut rt = rt.clone();
            tasks.spawn(async move {
                let r = exec_in(&mut rt, &sb.id, "main", "test -s /data.bin").await;
                assert_eq!(r.exit_code, 0);
                (sb.id, t.elapsed())
            });
        }
        let mut done = Vec::new();
        while let Some(r) = tasks.join_next().await {
            done.push(r.unwrap());
        }
        let all = t.elapsed();
        let first = done.iter().map(|(_, d)| *d).min().unwrap();
        println!(
            "fork x{count} of a sandbox with 10 MB written: all answering after {:.0} ms, the first after {:.0} ms",
            ms(all),
            ms(first)
        );
        for (id, _) in done {
            admin.stop_sandbox(&id).await.unwrap();
        }
    }
    println!("published, not measured here: hivebox fork x8 <= 300 ms, Morph < 250 ms");
    admin.stop_sandbox(&src.id).await.unwrap();
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime");
    println!("== bench_snapshots_and_forks");
    rt.block_on(bench());
}
