//! Issue 11's benchmarks (`make bench-network` runs them, in release, as root). Prints figures,
//! asserts nothing about time. Hermetic like the tests: the clusters run in a network
//! namespace of the bench's own whose only way out is the test world
//! (`opendsec_testkit::netns`).
//!
//! 1. Creation one by one (until the agent answers) on an edge with networking beside one
//!    without, the two clusters alternating in the same run (busybox, the default resources
//!    of the CLI and SDK: 1 CPU, 1 GiB, a 10 GiB disk).
//! 2. With `BENCH_NET_SANDBOXES` (default 1,000; 0 skips it) sandboxes of 5 rules each on one
//!    edge: UpdateNetwork p50 through the API, and creation p50, beside the same with 10 and
//!    beside peers without a network under the same load. Small sandboxes (64 MiB, a 16 MiB
//!    disk): 1,000 disks of 10 GiB do not fit this machine.
//! 3. A download from the test world through a sandbox's NAT beside the same download from
//!    the edge's own namespace (the same Python client in both).
//! 4. DNS lookups per second of an allowed name through the edge's proxy (from a sandbox)
//!    beside the world's server asked directly (from the edge's namespace), same client.

#[path = "../tests/it/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use common::*;
use opendsec_proto::v1 as pb;
use opendsec_testkit::netns::{self, DNS, WEB_A, World};

fn pct(sorted: &[Duration], p: usize) -> Duration {
    sorted[(sorted.len() * p / 100).min(sorted.len() - 1)]
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn p50(mut v: Vec<Duration>) -> Duration {
    v.sort();
    pct(&v, 50)
}

fn show(what: &str, mut v: Vec<Duration>) {
    v.sort();
    println!("{what}: n={} p50={:.2} ms p99={:.2} ms", v.len(), ms(pct(&v, 50)), ms(pct(&v, 99)));
}

fn rules(texts: &[&str]) -> Vec<pb::EgressRule> {
    texts.iter().map(|t| opendsec_common::egress::Rule::parse(t).unwrap().to_pb()).collect()
}

/// Five rules of the usual kinds.
fn five() -> Vec<pb::EgressRule> {
    rules(&["allowed.test", "@pypi", "203.0.113.0/24:tcp/80", "198.51.100.0/24:tcp/443-8443", "*:udp/123"])
}

/// Downloads `bytes` from `host:80/bytes/<n>` and prints the MB/s (Python, same in both places).
const DOWNLOAD: &str = r#"
import socket, sys, time
host, n = sys.argv[1], int(sys.argv[2])
s = socket.create_connection((host, 80), timeout=30)
s.sendall(("GET /bytes/%d HTTP/1.0\r\n\r\n" % n).encode())
buf = bytearray(1 << 20); got = 0; t = time.monotonic()
while True:
    k = s.recv_into(buf)
    if not k: break
    got += k
dt = time.monotonic() - t
print("%.1f" % (got / dt / 1e6))
"#;

/// Sends `n` queries for `name` to `server`, `w` in flight at once; prints lookups per second.
const LOOKUPS: &str = r#"
import socket, struct, sys, time, select
server, name, n, w = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.setblocking(False)
qname = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
def q(i): return struct.pack(">HHHHHH", i & 0xffff, 0x0100, 1, 0, 0, 0) + qname + struct.pack(">HH", 1, 1)
sent = done = 0; t = time.monotonic()
while done < n:
    while sent < n and sent - done < w:
        s.sendto(q(sent), (server, 53)); sent += 1
    r, _, _ = select.select([s], [], [], 2.0)
    if not r: break
    while True:
        try: s.recv(4096); done += 1
        except BlockingIOError: break
print("%.0f %d" % (done / (time.monotonic() - t), done))
"#;

fn main() {
    assert!(is_root(), "the network benchmarks need root");
    netns::enter_private_namespace();
    let world = World::start();
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(bench());
    drop(world);
}

fn big_edge(c: &mut opendsec_common::config::Config) {
    // The intervals a user runs with (the test fixture's are faster: with 1,000 sandboxes
    // their probes alone would fill both cores).
    let d = opendsec_common::config::Config::default();
    c.edge.ttl_check_interval = d.edge.ttl_check_interval;
    c.edge.register_interval = d.edge.register_interval;
    c.watcher.probe_interval = d.watcher.probe_interval;
    c.watcher.probe_timeout = d.watcher.probe_timeout;
    c.apiserver.snapshot_refresh = d.apiserver.snapshot_refresh;
    room_for_thousands(c);
}

async fn bench() {
    let with = fixture_with(|c| {
        big_edge(c);
        c.network.enabled = true;
        c.network.upstream_dns = vec![DNS.to_string()];
        // The proxy's own speed, not the per-sandbox limit, is measured below.
        c.network.dns_rate = 1e6;
        c.network.dns_burst = 1e6;
    })
    .await;
    let without = fixture_with(big_edge).await;
    let spec = pb::SandboxSpec {
        resources: Some(pb::Resources { cpu_millis: 1000, memory_mb: 64, disk_mb: 16, gpus: 0 }),
        ..container_spec("busybox", 64, 16)
    };
    let mut networked = spec.clone();
    networked.network = Some(pb::NetworkSpec { egress: five() });
    // What a user gets without asking: the CLI's and SDK's default resources.
    use opendsec_cli::ctl::{DEFAULT_CPU_MILLIS, DEFAULT_DISK_MB, DEFAULT_MEMORY_MB};
    let user = pb::SandboxSpec {
        resources: Some(pb::Resources {
            cpu_millis: DEFAULT_CPU_MILLIS,
            memory_mb: DEFAULT_MEMORY_MB,
            disk_mb: DEFAULT_DISK_MB,
            gpus: 0,
        }),
        ..networked.clone()
    };

    // 1. Creation with networking beside without, alternating, default resources (the first
    // creation of each warms nothing a user would not have: the layer cache is per node).
    for f in [&with, &without] {
        let w = f.admin.create_sandbox(user.clone()).await.unwrap();
        f.admin.stop_sandbox(&w.id).await.unwrap();
    }
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..60 {
        for (f, lat) in [(&with, &mut a), (&without, &mut b)] {
            let t = Instant::now();
            let s = f.admin.create_sandbox(user.clone()).await.unwrap();
            lat.push(t.elapsed());
            f.admin.stop_sandbox(&s.id).await.unwrap();
        }
    }
    let (pa, pb_) = (p50(a.clone()), p50(b.clone()));
    show("create one by one, with networking (5 rules)", a);
    show("create one by one, without networking (same run)", b);
    println!("networking adds {:.2} ms at p50", ms(pa) - ms(pb_));

    // 2. UpdateNetwork and creation with 10, then BENCH_NET_SANDBOXES, sandboxes of 5 rules.
    let many: usize = std::env::var("BENCH_NET_SANDBOXES").ok().and_then(|v| v.parse().ok()).unwrap_or(1000);
    let f = &with;
    // BENCH_NET_SANDBOXES=0 skips this part (the longest).
    if many > 0 {
        scale(f, &without, &networked, &spec, many).await;
    }
    downloads_and_lookups(f).await;
}

async fn scale(f: &Fixture, without: &Fixture, networked: &pb::SandboxSpec, spec: &pb::SandboxSpec, many: usize) {
    let mut live = Vec::new();
    while live.len() < 10 {
        live.push(f.admin.create_sandbox(networked.clone()).await.unwrap().id);
    }
    let (u10, c10) = measure(f, &live, networked).await;
    let (s10, b10) = baseline(f, without, spec).await;
    let t = Instant::now();
    while live.len() < many {
        live.push(f.admin.create_sandbox(networked.clone()).await.unwrap().id);
    }
    println!("({} sandboxes of 5 rules up in {:.1} s)", live.len(), t.elapsed().as_secs_f64());
    let (un, cn) = measure(f, &live, networked).await;
    let (sn, bn) = baseline(f, without, spec).await;
    show("UpdateNetwork with 10 sandboxes", u10);
    show(&format!("UpdateNetwork with {many} sandboxes"), un);
    show("  peer: UpdateNetwork of a sim sandbox (no network), 10 container sandboxes", s10);
    show(&format!("  peer: UpdateNetwork of a sim sandbox (no network), {many} container sandboxes"), sn);
    show("create with 10 sandboxes", c10);
    show(&format!("create with {many} sandboxes"), cn);
    show("  peer: create on an edge without networking, beside 10", b10);
    show(&format!("  peer: create on an edge without networking, beside {many}"), bn);
    for id in live.drain(..) {
        f.admin.stop_sandbox(&id).await.unwrap();
    }
}

async fn downloads_and_lookups(f: &Fixture) {
    // 3. and 4. need python3 in the sandbox: the Debian image.
    import(&f.ca, &f.addr, &f.cluster.admin_token, &debian_rootfs(), &f.store, "debian:bookworm").await;
    let mut deb = container_spec("debian:bookworm", 1024, 256);
    deb.resources = Some(pb::Resources { cpu_millis: 2000, memory_mb: 1024, disk_mb: 256, gpus: 0 });
    deb.network = Some(pb::NetworkSpec { egress: rules(&["*", "allowed.test"]) });
    let s = f.admin.create_sandbox(deb).await.unwrap();
    let mut r = runtime(&f.ca, &f.addr, &f.cluster.admin_token);
    let py = |script: &str, args: &[String]| {
        let quoted: Vec<String> = args.iter().map(|a| format!("'{a}'")).collect();
        format!("python3 -c '{}' {}", script.replace('\'', "'\\''"), quoted.join(" "))
    };
    let host_py = |script: &str, args: &[String]| {
        let o = std::process::Command::new("python3").arg("-c").arg(script).args(args).output().unwrap();
        String::from_utf8_lossy(&o.stdout).trim().to_string()
    };
    let n = (512u64 << 20).to_string();
    for _ in 0..3 {
        let inside = out(&exec_in(&mut r, &s.id, "b", &py(DOWNLOAD, &[WEB_A.to_string(), n.clone()])).await);
        let edge = host_py(DOWNLOAD, &[WEB_A.to_string(), n.clone()]);
        let (i, e): (f64, f64) = (inside.parse().unwrap_or(0.0), edge.parse().unwrap_or(0.0));
        println!(
            "download 512 MiB: through the sandbox's NAT {i:.0} MB/s, from the edge's namespace {e:.0} MB/s, ratio {:.2}",
            i / e
        );
    }
    let dns = "10.88.0.1".to_string();
    for w in ["1", "16"] {
        let via = out(&exec_in(
            &mut r,
            &s.id,
            "b",
            &py(LOOKUPS, &[dns.clone(), "www.allowed.test".into(), "5000".into(), w.into()]),
        )
        .await);
        let direct = host_py(LOOKUPS, &[DNS.to_string(), "www.allowed.test".into(), "5000".into(), w.into()]);
        println!(
            "DNS lookups/s ({w} in flight): through the edge's proxy {via}, the upstream directly {direct} (lookups/s answered)"
        );
    }
    f.admin.stop_sandbox(&s.id).await.unwrap();
}

/// The same calls without a network, under the same load: UpdateNetwork of a sim sandbox of
/// the same edge (API, record, no kernel), creation on the edge without networking.
async fn baseline(f: &Fixture, plain: &Fixture, spec: &pb::SandboxSpec) -> (Vec<Duration>, Vec<Duration>) {
    let sim = pb::SandboxSpec { backend: "sim".into(), ..spec.clone() };
    let s = f.admin.create_sandbox(sim).await.unwrap();
    let upd = time_updates(f, std::slice::from_ref(&s.id)).await;
    f.admin.stop_sandbox(&s.id).await.unwrap();
    (upd, time_creations(plain, spec).await)
}

/// UpdateNetwork on the live sandboxes, then creations.
async fn measure(f: &Fixture, live: &[String], spec: &pb::SandboxSpec) -> (Vec<Duration>, Vec<Duration>) {
    (time_updates(f, live).await, time_creations(f, spec).await)
}

/// 200 UpdateNetwork calls spread over `ids`, alternating two lists of five rules.
async fn time_updates(f: &Fixture, ids: &[String]) -> Vec<Duration> {
    let mut upd = Vec::new();
    for i in 0..200 {
        let id = &ids[i * 7919 % ids.len()];
        let r = if i % 2 == 0 { five() } else { rules(&["*:tcp/443", "other.test", "@npm", "192.0.2.0/24", "x.test"]) };
        let t = Instant::now();
        f.admin.update_network(id, r).await.unwrap();
        upd.push(t.elapsed());
    }
    upd
}

/// 30 creations one by one (each stopped before the next).
async fn time_creations(f: &Fixture, spec: &pb::SandboxSpec) -> Vec<Duration> {
    let mut cre = Vec::new();
    for _ in 0..30 {
        let t = Instant::now();
        let s = f.admin.create_sandbox(spec.clone()).await.unwrap();
        cre.push(t.elapsed());
        f.admin.stop_sandbox(&s.id).await.unwrap();
    }
    cre
}
