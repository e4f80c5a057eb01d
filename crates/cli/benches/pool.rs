//! Issue 13's warm pool benchmarks (`make bench-pool`, in release, as root; `cargo bench -p
//! opendsec-cli --bench pool`). Prints figures, asserts nothing about time. Through the public
//! API of an in-process cluster (real gRPC between client, apiserver, IAM, edge and agent),
//! busybox container sandboxes with the resources a user gets by default (1 CPU, 1 GiB of
//! memory, 10 GiB of disk):
//!
//! - a claim from a full pool, one at a time: p50 and p99 of the call (the sandbox answers a
//!   command when it returns), on a quiet edge and back to back (beside the refills the
//!   claims start, on the same two cores), and a cold creation of the same template beside it;
//! - claims/s: a pool of 100 emptied by 8 callers at once, and 100 claims in one batch call
//!   (OpenSandbox publishes "100 sandboxes in 0.92 s");
//! - how long a pool takes to refill a member.

#[path = "../tests/it/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use opendsec_proto::v1 as pb;

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    ms(v[((p / 100.0) * (v.len() - 1) as f64).round() as usize])
}

fn template() -> pb::PoolTemplate {
    use opendsec_cli::ctl::{DEFAULT_CPU_MILLIS, DEFAULT_DISK_MB, DEFAULT_MEMORY_MB};
    pb::PoolTemplate {
        image: "busybox:latest".into(),
        backend: "fncall".into(),
        resources: Some(pb::Resources {
            cpu_millis: DEFAULT_CPU_MILLIS,
            memory_mb: DEFAULT_MEMORY_MB,
            disk_mb: DEFAULT_DISK_MB,
            gpus: 0,
        }),
        ..Default::default()
    }
}

async fn status(admin: &opendsec_client::Client, name: &str) -> pb::PoolStatus {
    let p = admin.get_pool(pb::GetPoolRequest { project: "root".into(), name: name.into() }).await.unwrap();
    p.edges.into_iter().next().unwrap_or_default()
}

async fn wait_idle(admin: &opendsec_client::Client, name: &str, n: u32) -> Duration {
    let t = Instant::now();
    while status(admin, name).await.idle < n {
        assert!(t.elapsed() < Duration::from_secs(600), "pool {name} never reached {n} idle");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    t.elapsed()
}

async fn stop_all(admin: &opendsec_client::Client, ids: Vec<String>) {
    let mut tasks = tokio::task::JoinSet::new();
    for id in ids {
        let a = admin.clone();
        tasks.spawn(async move { a.stop_sandbox(&id).await.unwrap() });
    }
    while tasks.join_next().await.is_some() {}
}

async fn bench() {
    let f = fixture_with(|c| {
        room_for_thousands(c);
        c.edge.backends = vec!["sim".into(), "container".into(), "fncall".into()];
        c.edge.pool_refresh = Duration::from_millis(200);
    })
    .await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    let claim = |pool: &str| pb::SandboxSpec { pool: pool.into(), ..Default::default() };

    // Cold: the same template, no pool (the image's layers cached on the edge after the first).
    let cold_spec = {
        let t = template();
        pb::SandboxSpec { image: t.image, backend: "container".into(), resources: t.resources, ..Default::default() }
    };
    let mut cold = Vec::new();
    for _ in 0..20 {
        let t = Instant::now();
        let s = admin.create_sandbox(cold_spec.clone()).await.unwrap();
        cold.push(t.elapsed());
        admin.stop_sandbox(&s.id).await.unwrap();
    }

    // The API path alone: sim sandboxes (no container), the same calls (Admit, the edge's
    // record) around nothing.
    let mut sim = Vec::new();
    for _ in 0..40 {
        let spec = pb::SandboxSpec { backend: "sim".into(), ..container_spec("busybox", 16, 0) };
        let t = Instant::now();
        let s = admin.create_sandbox(spec).await.unwrap();
        sim.push(t.elapsed());
        admin.stop_sandbox(&s.id).await.unwrap();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // One at a time from a full pool, waiting for the refill in between (every claim a hit).
    let size = 16;
    admin
        .create_pool(pb::CreatePoolRequest {
            pool: Some(pb::Pool {
                name: "one".into(),
                template: Some(template()),
                size_per_edge: size,
                ..Default::default()
            }),
        })
        .await
        .unwrap();
    let fill = wait_idle(&admin, "one", size).await;
    // Each claim on a quiet edge: the refill it starts is done before the next claim.
    let mut claims = Vec::new();
    let mut ids = Vec::new();
    for _ in 0..40 {
        let t = Instant::now();
        let s = admin.create_sandbox(claim("one")).await.unwrap();
        claims.push(t.elapsed());
        ids.push(s.id);
        tokio::time::sleep(Duration::from_millis(300)).await;
        wait_idle(&admin, "one", size).await;
    }
    // Back to back: each claim runs beside the refills the earlier ones started.
    let mut busy = Vec::new();
    for _ in 0..size {
        let t = Instant::now();
        let s = admin.create_sandbox(claim("one")).await.unwrap();
        busy.push(t.elapsed());
        ids.push(s.id);
    }
    // The sandbox a claim returns answers at once.
    let t = Instant::now();
    let s = admin.create_sandbox(claim("one")).await.unwrap();
    let r = exec_in(&mut rt, &s.id, "main", "echo $OPENDSEC_SANDBOX_ID").await;
    let claim_and_exec = t.elapsed();
    assert_eq!(out(&r), s.id);
    ids.push(s.id);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = status(&admin, "one").await;
    stop_all(&admin, ids).await;
    println!(
        "claim from the pool on a quiet edge: p50 {:.2} ms, p99 {:.2} ms (n={}); back to back beside refills: p50 {:.2} ms, p99 {:.2} ms (n={}); {} claims, {} misses; claim + first command {:.1} ms",
        pct(&mut claims, 50.0),
        pct(&mut claims, 99.0),
        claims.len(),
        pct(&mut busy, 50.0),
        pct(&mut busy, 99.0),
        busy.len(),
        st.claims,
        st.misses,
        ms(claim_and_exec)
    );
    println!(
        "the API path alone (a sim sandbox, same calls, no container): p50 {:.2} ms, p99 {:.2} ms (n={})",
        pct(&mut sim, 50.0),
        pct(&mut sim, 99.0),
        sim.len()
    );
    println!(
        "cold creation of the same template: p50 {:.1} ms, p99 {:.1} ms (n={})",
        pct(&mut cold, 50.0),
        pct(&mut cold, 99.0),
        cold.len()
    );
    println!(
        "filling a pool of {size} from empty: {:.0} ms; refill p50 per member {} ms (edge.pool_starts = 2)",
        ms(fill),
        st.refill_p50_ms
    );
    admin.delete_pool(pb::DeletePoolRequest { project: "root".into(), name: "one".into() }).await.unwrap();

    // 100 at once: 8 callers, then one batch call.
    let n = 100u32;
    admin
        .create_pool(pb::CreatePoolRequest {
            pool: Some(pb::Pool {
                name: "many".into(),
                template: Some(template()),
                size_per_edge: n,
                ..Default::default()
            }),
        })
        .await
        .unwrap();
    wait_idle(&admin, "many", n).await;
    let t = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for w in 0..8u32 {
        let a = admin.clone();
        let spec = claim("many");
        tasks.spawn(async move {
            let mut got = Vec::new();
            for _ in (w..n).step_by(8) {
                got.push(a.create_sandbox(spec.clone()).await.unwrap().id);
            }
            got
        });
    }
    let mut ids = Vec::new();
    while let Some(r) = tasks.join_next().await {
        ids.extend(r.unwrap());
    }
    let concurrent = t.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = status(&admin, "many").await;
    stop_all(&admin, ids).await;
    println!(
        "{n} claims by 8 callers: {:.0} ms, {:.0} claims/s ({} claims, {} misses)",
        ms(concurrent),
        f64::from(n) / concurrent.as_secs_f64(),
        st.claims,
        st.misses
    );
    wait_idle(&admin, "many", n).await;
    let before = status(&admin, "many").await;
    let t = Instant::now();
    let mut stream = admin.create_sandboxes(claim("many"), n).await.unwrap();
    let mut ids = Vec::new();
    while let Some(item) = stream.message().await.unwrap() {
        ids.push(item.sandbox.unwrap_or_else(|| panic!("a claim failed: {:?}", item.error)).id);
    }
    let batch = t.elapsed();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let st = status(&admin, "many").await;
    stop_all(&admin, ids).await;
    println!(
        "{n} claims in one batch call: {:.0} ms ({} claims, {} misses)",
        ms(batch),
        st.claims - before.claims,
        st.misses - before.misses
    );
    println!("published, not measured here: OpenSandbox ~80 ms per sandbox from a pool, 100 sandboxes in 0.92 s");
    admin.delete_pool(pb::DeletePoolRequest { project: "root".into(), name: "many".into() }).await.unwrap();
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime");
    println!("== bench_pool_claims");
    rt.block_on(bench());
}
