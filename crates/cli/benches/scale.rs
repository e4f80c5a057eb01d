//! Issue 16's scale benchmark (`make bench-scale`, release): a DSec-sized cluster on this
//! machine. IAM, the watcher and the apiserver each run as an `opendsec` process of its own
//! (so that each one's memory can be read), the 1,000 sim edges in this process (each with
//! its real record log, TTL sweep and watcher probes), and 400,000 live sandboxes spread over
//! 16 projects two levels deep. Prints a table and a JSON line; asserts nothing about time.
//!
//! Phases: the edges up and healthy; the fill (batches of 1,000, four calls in flight) up to
//! 400,000 less one 32,768-sandbox `CreateSandboxes` burst, then the burst; memory per live
//! sandbox of each process; a watcher probe round, the snapshot's size and decode + view
//! build; one reconcile round; placement decisions over the 1,000 edges; IAM usage of the
//! whole tree; a listing of every sandbox by pages of 1,000; and stopping them all.
//!
//! Bounded: `OPENDSEC_SCALE_EDGES` (1000) and `OPENDSEC_SCALE_LIVE` (400000) size it; it stops
//! itself (exit 2) past `OPENDSEC_SCALE_MINUTES` (40) or when its processes together hold more
//! than `OPENDSEC_SCALE_MAX_GIB` (16) of memory.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use futures::StreamExt;
use opendsec_apiserver::placement::{self, Demand, EdgeView, Params, Res};
use opendsec_common::config::{Config, EdgeEndpoint};
use opendsec_common::grpc::{self, Links};
use opendsec_common::pki::Role;
use opendsec_proto::v1 as pb;
use opendsec_testkit::rss_bytes;
use prost::Message;
use serde_json::json;

const ADMIN: &str = "dsk.admin.ScaleBenchAdminSecret0123456789";
const BURST: u32 = 32_768;
const BATCH: u32 = 1000;
const IN_FLIGHT: usize = 4;

fn env_num(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

fn ms(d: Duration) -> f64 {
    (d.as_secs_f64() * 1e6).round() / 1e3
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    v[((p / 100.0) * (v.len() - 1) as f64).round() as usize]
}

/// The daemons; killed when the bench ends, however it ends.
struct Daemons(Vec<(&'static str, Child)>);
impl Drop for Daemons {
    fn drop(&mut self) {
        for (_, c) in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Daemons {
    fn pid(&self, name: &str) -> u32 {
        self.0.iter().find(|(n, _)| *n == name).map(|(_, c)| c.id()).unwrap_or(0)
    }

    /// (iam, watcher, apiserver, edges: this process) resident bytes.
    fn rss(&self) -> [u64; 4] {
        [
            rss_bytes(self.pid("iam")),
            rss_bytes(self.pid("watcher")),
            rss_bytes(self.pid("apiserver")),
            rss_bytes(std::process::id()),
        ]
    }
}

fn spawn(dir: &Path, role: &'static str, config: &Path) -> (&'static str, Child) {
    let log = std::fs::File::create(dir.join(format!("{role}.log"))).unwrap();
    let child = Command::new(env!("CARGO_BIN_EXE_opendsec"))
        .args([role, "--config", config.to_str().unwrap()])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap();
    (role, child)
}

/// Stops the whole run past its time or its memory (a bench must not take the machine).
fn watchdog(limit: Duration, max_bytes: u64, pids: Vec<u32>) {
    let started = Instant::now();
    std::thread::spawn(move || {
        loop {
            std::thread::sleep(Duration::from_secs(2));
            let held: u64 = pids.iter().map(|p| rss_bytes(*p)).sum::<u64>() + rss_bytes(std::process::id());
            let over = if started.elapsed() > limit {
                Some(format!("over its time ({} min)", limit.as_secs() / 60))
            } else if held > max_bytes {
                Some(format!("over its memory ({} MiB held)", held >> 20))
            } else {
                None
            };
            if let Some(why) = over {
                eprintln!("bench-scale: stopping itself: {why}");
                for p in &pids {
                    let _ = Command::new("kill").args(["-9", &p.to_string()]).status();
                }
                std::process::exit(2);
            }
        }
    });
}

fn spec(project: &str) -> pb::SandboxSpec {
    pb::SandboxSpec {
        project: project.into(),
        image: "scratch".into(),
        backend: "sim".into(),
        // A thousand sandboxes' worth of a sim edge's default capacity holds 400 of these.
        resources: Some(pb::Resources { cpu_millis: 10, memory_mb: 16, disk_mb: 0, gpus: 0 }),
        ..Default::default()
    }
}

/// One CreateSandboxes call of `count` in `project`: (created, failures by reason).
async fn create_batch(
    client: &opendsec_client::Client,
    project: &str,
    count: u32,
) -> (u64, std::collections::BTreeMap<String, u64>) {
    let mut errors = std::collections::BTreeMap::new();
    let mut ok = 0;
    match client.create_sandboxes(spec(project), count).await {
        Ok(mut stream) => {
            while let Some(item) = stream.next().await {
                match item {
                    Ok(r) if r.error.is_none() => ok += 1,
                    Ok(r) => *errors.entry(r.error.map(|e| e.reason).unwrap_or_default()).or_default() += 1,
                    Err(s) => {
                        *errors.entry(format!("stream: {}", s.code())).or_default() += 1;
                        break;
                    }
                }
            }
        }
        Err(e) => *errors.entry(e.reason.to_string()).or_default() += u64::from(count),
    }
    (ok, errors)
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(run());
}

async fn run() {
    opendsec_cli::raise_fd_limit();
    let edges = env_num("OPENDSEC_SCALE_EDGES", 1000) as usize;
    let live = env_num("OPENDSEC_SCALE_LIVE", 400_000).max(u64::from(BURST)) as u32;
    let limit = Duration::from_secs(60 * env_num("OPENDSEC_SCALE_MINUTES", 40));
    let max_bytes = env_num("OPENDSEC_SCALE_MAX_GIB", 16) << 30;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_path_buf();
    let pki = dir.join("pki");
    let port = || format!("127.0.0.1:{}", opendsec_testkit::free_port());
    let (iam_addr, watcher_addr, api_addr) = (port(), port(), port());
    let cfg = json!({
        "state_dir": dir.join("state"),
        "tls": {"dir": pki},
        "sim_edges": 0,
        "iam": {"listen": iam_addr, "addrs": [iam_addr], "admin_token": ADMIN},
        // The reconcile round is timed here, by a watcher of the bench's own.
        "watcher": {"listen": watcher_addr, "addrs": [watcher_addr], "reconcile_interval": "10h"},
        "apiserver": {"listen": api_addr, "rate_per_principal": 1e9, "burst_per_principal": 1e9},
        "edge": {"listen": "127.0.0.1:0", "backends": ["sim"], "move_stale": "24h"},
    });
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
    let config = Config::load(&cfg_path).unwrap();
    opendsec_cluster::seed_images(&config.image_store_dir()).unwrap();
    // Every certificate from one CA, issued before anything starts.
    for (role, name) in [(Role::Iam, "0"), (Role::Watcher, "0"), (Role::Apiserver, "0")] {
        opendsec_testkit::creds(&pki, role, name);
    }
    let names: Vec<String> = (0..edges as u32).map(opendsec_cluster::edge_name).collect();
    for n in &names {
        opendsec_testkit::creds(&pki, Role::Edge, n);
    }

    let started = Instant::now();
    let daemons = Daemons(vec![
        spawn(&dir, "iam", &cfg_path),
        spawn(&dir, "watcher", &cfg_path),
        spawn(&dir, "apiserver", &cfg_path),
    ]);
    watchdog(limit, max_bytes, daemons.0.iter().map(|(_, c)| c.id()).collect());
    let ca = std::fs::read(pki.join(opendsec_common::pki::CA_CERT)).unwrap();
    let tls = grpc::PublicTls::with_ca(&ca, None).unwrap();
    let admin = opendsec_client::Client::new(std::slice::from_ref(&api_addr), Some(ADMIN), &tls)
        .unwrap()
        .with_retry_timeout(Duration::from_secs(60));
    for _ in 0..600 {
        if admin.who_am_i(pb::WhoAmIRequest {}).await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let base = daemons.rss();

    // The edges, then until the watcher sees every one healthy.
    let t = Instant::now();
    let sim = opendsec_cluster::SimEdges::start(&config, &names).await.unwrap();
    let edges_started = t.elapsed();
    let links = Links::new(opendsec_testkit::creds(&pki, Role::Apiserver, "0"));
    let mut watcher =
        pb::watcher_client::WatcherClient::new(links.channel(&watcher_addr, Role::Watcher, None).unwrap())
            .max_decoding_message_size(grpc::MAX_MESSAGE_BYTES);
    loop {
        let snap = watcher.get_snapshot(pb::GetSnapshotRequest {}).await.map(|s| s.into_inner());
        if snap.is_ok_and(|s| s.edges.iter().filter(|e| e.healthy).count() == edges) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let edges_healthy = t.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await; // the apiserver's next snapshot
    let empty = daemons.rss();

    // Sixteen projects two levels deep under root: root/tI/jJ.
    let mut leaves = Vec::new();
    for i in 0..4 {
        let mid = format!("root/t{i}");
        admin.create_project(pb::CreateProjectRequest { path: mid.clone(), quota: None }).await.unwrap();
        for j in 0..4 {
            let leaf = format!("{mid}/j{j}");
            admin.create_project(pb::CreateProjectRequest { path: leaf.clone(), quota: None }).await.unwrap();
            leaves.push(leaf);
        }
    }

    // The fill.
    let fill = live - BURST;
    let batches: Vec<(String, u32)> = (0..fill.div_ceil(BATCH))
        .map(|b| (leaves[b as usize % leaves.len()].clone(), BATCH.min(fill - b * BATCH)))
        .collect();
    eprintln!("bench-scale: {edges} edges healthy; filling {fill} sandboxes");
    let t = Instant::now();
    let mut filled = 0u64;
    let mut fill_errors = std::collections::BTreeMap::new();
    let mut calls =
        futures::stream::iter(batches.iter().map(|(p, n)| create_batch(&admin, p, *n))).buffer_unordered(IN_FLIGHT);
    while let Some((ok, errors)) = calls.next().await {
        filled += ok;
        for (k, v) in errors {
            *fill_errors.entry(k).or_insert(0) += v;
        }
    }
    drop(calls);
    let fill_time = t.elapsed();

    // The burst: one call.
    eprintln!("bench-scale: burst of {BURST} at {filled} live");
    let t = Instant::now();
    let (burst_ok, burst_errors) = create_batch(&admin, &leaves[0], BURST).await;
    let burst_time = t.elapsed();
    let created = filled + burst_ok;
    eprintln!("bench-scale: burst done; measuring");
    tokio::time::sleep(Duration::from_secs(3)).await; // the edges' lease checks, a probe
    let full = daemons.rss();

    // The watcher's view: a probe round of a watcher of our own over the same edges, the
    // snapshot's size, and what an apiserver does with each one (decode, one view per edge).
    let snap = watcher.get_snapshot(pb::GetSnapshotRequest {}).await.unwrap().into_inner();
    let snapshot_bytes = snap.encoded_len();
    let encoded = snap.encode_to_vec();
    let t = Instant::now();
    const DECODES: u32 = 20;
    for _ in 0..DECODES {
        let s = pb::ClusterSnapshot::decode(encoded.as_slice()).unwrap();
        let views: Vec<EdgeView> = s.edges.iter().map(EdgeView::from_info).collect();
        std::hint::black_box(views);
    }
    let snapshot_build = t.elapsed() / DECODES;
    let endpoints: Vec<EdgeEndpoint> =
        snap.edges.iter().map(|e| EdgeEndpoint { name: e.name.clone(), address: e.address.clone() }).collect();
    let ours = opendsec_watcher::Watcher::new(opendsec_watcher::WatcherOptions {
        id: "bench".into(),
        config: config.watcher.clone(),
        edges: endpoints,
        iam_addrs: vec![iam_addr.clone()],
        tls: opendsec_testkit::creds(&pki, Role::Watcher, "bench"),
    })
    .unwrap();
    let mut probes = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        ours.probe_round().await;
        probes.push(ms(t.elapsed()));
    }
    let t = Instant::now();
    let reconcile = ours.reconcile_round().await;
    let reconcile_time = t.elapsed();

    // Placement: one decision at a time over the snapshot's edges.
    let views: Vec<EdgeView> = snap.edges.iter().map(EdgeView::from_info).collect();
    let (overlay, none) = (Default::default(), Default::default());
    let demand = Demand {
        backend: "sim",
        resources: Res::from_proto(spec("root").resources.as_ref()),
        prefer: None,
        warm: false,
    };
    let params = Params { k: config.apiserver.placement.k, usage_floor: config.apiserver.placement.usage_floor };
    let mut rng = rand::rng();
    const DECISIONS: u32 = 100_000;
    let t = Instant::now();
    for _ in 0..DECISIONS {
        std::hint::black_box(placement::place(&views, &overlay, &none, &none, &demand, &params, &mut rng).unwrap());
    }
    let placement_ns = t.elapsed().as_nanos() as f64 / f64::from(DECISIONS);

    // IAM usage of the whole tree.
    let mut usage_ms = Vec::new();
    let mut root_usage = 0;
    for _ in 0..5 {
        let t = Instant::now();
        let u = admin.get_usage(pb::GetUsageRequest { project: "root".into() }).await.unwrap();
        usage_ms.push(ms(t.elapsed()));
        root_usage = u.projects.iter().find(|p| p.path == "root").and_then(|p| p.usage).map_or(0, |u| u.sandboxes);
    }

    // Every sandbox, by pages of 1,000.
    let t = Instant::now();
    let mut ids = Vec::with_capacity(created as usize);
    let mut pages = Vec::new();
    let mut token = String::new();
    loop {
        let p = Instant::now();
        let page = admin
            .list_sandboxes(pb::ListSandboxesRequest {
                project: "root".into(),
                page_size: 1000,
                page_token: token,
                ..Default::default()
            })
            .await
            .unwrap();
        pages.push(ms(p.elapsed()));
        ids.extend(page.sandboxes.into_iter().map(|sb| sb.id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    let list_time = t.elapsed();
    let listed = ids.len();
    // The listing is exact: every sandbox once, in id order.
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "the listing repeated or reordered sandboxes");
    assert_eq!(listed as u64, created, "the listing missed sandboxes");

    // And stopping them all, 64 calls at a time.
    let t = Instant::now();
    let mut stopped = 0u64;
    let mut stop_failed = 0u64;
    let mut stops = futures::stream::iter(ids.iter().map(|id| admin.stop_sandbox(id))).buffer_unordered(64);
    while let Some(r) = stops.next().await {
        if r.is_ok() { stopped += 1 } else { stop_failed += 1 }
    }
    drop(stops);
    let stop_time = t.elapsed();
    // Edges release leases in batches after the stops are answered: until when usage shows it.
    let mut left = u64::MAX;
    for _ in 0..600 {
        let after = admin.get_usage(pb::GetUsageRequest { project: "root".into() }).await.unwrap();
        left = after.projects.iter().find(|p| p.path == "root").and_then(|p| p.usage).map_or(0, |u| u.sandboxes);
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let released = t.elapsed();

    let per = |i: usize| (full[i].saturating_sub(empty[i])) as f64 / created.max(1) as f64;
    let mib = |b: u64| b as f64 / (1 << 20) as f64;
    let rate = |n: u64, d: Duration| n as f64 / d.as_secs_f64().max(1e-9);
    let component = ["iam", "watcher", "apiserver", "edges (this process)"];
    println!("\n## bench-scale: {edges} sim edges, {created} live sandboxes\n");
    println!("| phase | figure |");
    println!("|---|---|");
    println!(
        "| {edges} edges started / all healthy in the snapshot | {:.1} s / {:.1} s |",
        edges_started.as_secs_f64(),
        edges_healthy.as_secs_f64()
    );
    println!(
        "| fill: {filled} in batches of {BATCH}, {IN_FLIGHT} in flight | {:.1} s, {:.0}/s, failed {:?} |",
        fill_time.as_secs_f64(),
        rate(filled, fill_time),
        fill_errors
    );
    println!(
        "| burst: one CreateSandboxes of {BURST} (at {filled} live) | {:.2} s ({burst_ok} created, failed {:?}) |",
        burst_time.as_secs_f64(),
        burst_errors
    );
    for (i, c) in component.iter().enumerate() {
        println!(
            "| memory, {c}: before edges / empty / {created} live | {:.0} / {:.0} / {:.0} MiB: {:.0} bytes per live sandbox |",
            mib(base[i]),
            mib(empty[i]),
            mib(full[i]),
            per(i)
        );
    }
    println!(
        "| watcher probe round over {edges} edges (p50 of 5, worst) | {:.1} ms, {:.1} ms |",
        pct(&mut probes.clone(), 50.0),
        pct(&mut probes, 100.0)
    );
    println!(
        "| snapshot: size / decode + views (apiserver side) | {:.0} KiB / {:.2} ms |",
        snapshot_bytes as f64 / 1024.0,
        ms(snapshot_build)
    );
    println!(
        "| reconcile round ({} edges, {} adopted, {} released, {} errors) | {:.2} s |",
        reconcile.edges_reconciled,
        reconcile.adopted,
        reconcile.released,
        reconcile.errors,
        reconcile_time.as_secs_f64()
    );
    println!("| placement: one decision over {edges} edges | {:.1} µs |", placement_ns / 1e3);
    println!(
        "| IAM usage of root (21 projects, {root_usage} leases; p50 of 5) | {:.1} ms |",
        pct(&mut usage_ms.clone(), 50.0)
    );
    println!(
        "| list: {listed} sandboxes, {} pages of 1,000 | {:.1} s; page p50 {:.1} ms, p99 {:.1} ms |",
        pages.len(),
        list_time.as_secs_f64(),
        pct(&mut pages.clone(), 50.0),
        pct(&mut pages.clone(), 99.0)
    );
    println!(
        "| stop all, 64 in flight | {:.1} s, {:.0}/s ({stop_failed} failed); usage {left} after {:.1} s |",
        stop_time.as_secs_f64(),
        rate(stopped, stop_time),
        released.as_secs_f64()
    );
    println!("| whole run | {:.0} s |", started.elapsed().as_secs_f64());
    let figures = json!({
        "edges": edges, "live": created,
        "edges_healthy_s": edges_healthy.as_secs_f64(),
        "fill_per_s": rate(filled, fill_time), "burst_s": burst_time.as_secs_f64(),
        "bytes_per_live": {"iam": per(0), "watcher": per(1), "apiserver": per(2), "edges": per(3)},
        "rss_full_mib": {"iam": mib(full[0]), "watcher": mib(full[1]), "apiserver": mib(full[2]), "edges": mib(full[3])},
        "probe_round_ms": probes, "snapshot_bytes": snapshot_bytes, "snapshot_build_ms": ms(snapshot_build),
        "reconcile_s": reconcile_time.as_secs_f64(), "placement_us": placement_ns / 1e3,
        "usage_ms": usage_ms, "list_s": list_time.as_secs_f64(), "listed": listed,
        "stop_per_s": rate(stopped, stop_time), "left_after_stop": left,
    });
    println!("\n{figures}");
    sim.stop().await;
    drop(daemons);
}
