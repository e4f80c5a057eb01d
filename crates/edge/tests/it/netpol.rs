//! The sandbox network on the real kernel (root; CI runs as root): veths, the nftables table,
//! the DNS proxy and conntrack, driven through `netpol::Network` with plain network
//! namespaces standing in for sandboxes.
//!
//! Hermetic: each test moves itself into a network namespace of its own whose only way out is
//! the test world (`opendsec_testkit::netns`), so even a wrong rule cannot send a packet to
//! the machine's network. The world's forbidden servers (metadata, private) answer like the
//! others: a rule that wrongly lets a packet through shows as a connection that works.

use std::collections::BTreeMap;
use std::net::Ipv4Addr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use opendsec_common::egress::{Ipv4Net, Rule};
use opendsec_edge::netpol::{self, NetOptions, Network, Slot};
use opendsec_testkit::netns::{
    self, BENCHMARK, DNS, METADATA, PRIVATE, UDP_LOG_PORT, UDP_STREAM_PORT, UPLINK_ADDR, WEB_A, WEB_B, WIRESERVER,
    World,
};
use opendsec_testkit::{is_root, wait_for};

/// A TCP request (`GET <path>`), a DNS query or a UDP datagram from inside a namespace, in
/// Python so that every timeout is bounded. Prints what it got, or `ERR <reason>`.
const CLIENT: &str = r#"
import socket, struct, sys, random
cmd = sys.argv[1]
try:
    if cmd == "get":
        s = socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=1.5)
        s.sendall(("GET %s HTTP/1.0\r\n\r\n" % sys.argv[4]).encode())
        out = b""
        while True:
            d = s.recv(4096)
            if not d: break
            out += d
        print(out.decode(errors="replace").split("\r\n\r\n", 1)[-1].strip())
    elif cmd == "dns":
        name, server, qtype = sys.argv[2], sys.argv[3], int(sys.argv[4])
        q = struct.pack(">HHHHHH", random.randint(0, 65535), 0x0100, 1, 0, 0, 0)
        q += b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0" + struct.pack(">HH", qtype, 1)
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(1.5)
        s.sendto(q, (server, int(sys.argv[5]) if len(sys.argv) > 5 else 53))
        r = s.recv(4096)
        rcode, an = r[3] & 15, struct.unpack(">H", r[6:8])[0]
        ip = ".".join(str(b) for b in r[-4:]) if an else "-"
        print("rcode=%d answers=%d ip=%s" % (rcode, an, ip))
    elif cmd == "udp":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        if len(sys.argv) > 5: s.bind((sys.argv[5], 0))
        s.sendto(sys.argv[4].encode(), (sys.argv[2], int(sys.argv[3])))
        print("sent")
    elif cmd == "flood":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        q = struct.pack(">HHHHHH", 1, 0x0100, 1, 0, 0, 0) + b"\x07allowed\x04test\x00" + struct.pack(">HH", 1, 1)
        for i in range(int(sys.argv[3])):
            s.sendto(q, (sys.argv[2], 53))
        print("flooded")
    elif cmd == "hold":
        # Keeps lookups of a name that never answers in flight: a new query (new id) every
        # 5 ms for the given seconds, answers never read.
        import time
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        name, server, end = sys.argv[2], sys.argv[3], time.time() + float(sys.argv[4])
        qname = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
        i = 0
        while time.time() < end:
            i += 1
            s.sendto(struct.pack(">HHHHHH", i & 0xffff, 0x0100, 1, 0, 0, 0) + qname + struct.pack(">HH", 1, 1), (server, 53))
            time.sleep(0.005)
        print("held")
    elif cmd == "lookups":
        # n lookups one after another, each timed; prints the p99 in ms and how many failed.
        import time
        name, server, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
        qname = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(1.0)
        times, failed = [], 0
        for i in range(n):
            t0 = time.monotonic()
            s.sendto(struct.pack(">HHHHHH", i, 0x0100, 1, 0, 0, 0) + qname + struct.pack(">HH", 1, 1), (server, 53))
            try:
                while True:
                    r = s.recv(4096)
                    if struct.unpack(">H", r[:2])[0] == i: break
                times.append((time.monotonic() - t0) * 1000)
            except socket.timeout:
                failed += 1
        times.sort()
        p99 = times[max(0, int(len(times) * 0.99) - 1)] if times else -1
        print("p99_ms=%.1f failed=%d" % (p99, failed))
    elif cmd == "conns":
        # Opens n connections (GET /stream), holds them the given seconds; prints how many
        # were established and streaming.
        import time
        ok, held = 0, []
        for _ in range(int(sys.argv[4])):
            try:
                c = socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=1)
                c.sendall(b"GET /stream HTTP/1.0\r\n\r\n")
                c.settimeout(1)
                if c.recv(64):
                    ok += 1
                    held.append(c)
            except OSError:
                pass
        print("open=%d" % ok, flush=True)
        time.sleep(float(sys.argv[5]))
    elif cmd == "udpstream":
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.settimeout(30)
        s.sendto(b"go", (sys.argv[2], int(sys.argv[3])))
        while True:
            print(s.recv(2048).decode(), flush=True)
    elif cmd == "stream":
        s = socket.create_connection((sys.argv[2], int(sys.argv[3])), timeout=30)
        s.sendall(b"GET /stream HTTP/1.0\r\n\r\n")
        f = s.makefile("rb")
        for line in f:
            print(line.decode().strip(), flush=True)
except Exception as e:
    print("ERR %s %s" % (type(e).__name__, e))
"#;

/// A stand-in sandbox: a process in a network namespace of its own.
struct Ns {
    child: Child,
}

impl Ns {
    fn new() -> Ns {
        let child = Command::new("unshare").args(["--net", "--", "sleep", "600"]).spawn().expect("unshare");
        let path = format!("/proc/{}/ns/net", child.id());
        wait_for("the namespace of the stand-in sandbox", Duration::from_secs(5), || {
            std::fs::read_link(&path).ok() != std::fs::read_link("/proc/thread-self/ns/net").ok()
        });
        let ns = Ns { child };
        // As a sandbox's init does: loopback up.
        ns.sh(&["ip", "link", "set", "lo", "up"]);
        ns
    }

    fn path(&self) -> String {
        format!("/proc/{}/ns/net", self.child.id())
    }

    fn cmd(&self, args: &[&str]) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net={}", self.path())).arg("--");
        c.args(args);
        c
    }

    /// Runs the client script inside; returns its output line.
    fn client(&self, args: &[&str]) -> String {
        let mut a = vec!["python3", "-c", CLIENT];
        a.extend_from_slice(args);
        let out = self.cmd(&a).output().expect("nsenter");
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    fn get(&self, addr: Ipv4Addr, port: u16) -> String {
        self.client(&["get", &addr.to_string(), &port.to_string(), "/"])
    }

    fn dns(&self, name: &str, server: Ipv4Addr) -> String {
        self.client(&["dns", name, &server.to_string(), "1"])
    }

    /// Starts an HTTP server on `port` inside and waits until it answers there, so that a
    /// refused connection from outside means the rules, not a missing server.
    fn serve(&self, port: u16) {
        let cmd = format!("python3 -m http.server {port} --bind 0.0.0.0 >/dev/null 2>&1 &");
        self.sh(&["sh", "-c", &cmd]);
        wait_for("the sandbox's own server", Duration::from_secs(10), || {
            !self.get(Ipv4Addr::LOCALHOST, port).starts_with("ERR")
        });
    }

    fn sh(&self, args: &[&str]) {
        let out = self.cmd(args).output().expect("nsenter");
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn r(t: &str) -> Rule {
    Rule::parse(t).unwrap()
}

struct Env {
    world: World,
    rt: tokio::runtime::Runtime,
    net: Arc<Network>,
    net_opts: NetOptions,
    _dir: tempfile::TempDir,
}

/// The test's own namespace, the world, and a network on 10.88.0.0/16 whose upstream
/// resolver is the world's DNS server.
fn env() -> Env {
    env_with(|_| {})
}

/// [`env`] with options changed by `tweak`.
fn env_with(tweak: impl FnOnce(&mut NetOptions)) -> Env {
    assert!(is_root(), "this test needs root (CI runs as root)");
    netns::enter_private_namespace();
    let world = World::start();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let opts = NetOptions {
        subnet: Ipv4Net::parse("10.88.0.0/16").unwrap(),
        tag: netpol::tag_of(dir.path()),
        owner: dir.path().display().to_string(),
        uplink: None,
        upstream: vec![(DNS, 53).into()],
        rule_sets: BTreeMap::from([("web".to_string(), vec![r("other.test:tcp/80")])]),
        open_private: Vec::new(),
        open_private_domains: Vec::new(),
        dns_rate: 20.0,
        dns_burst: 20.0,
        dns_slots: netpol::dns::DnsSlots::default(),
        tenant_conns: 16384,
        tenant_rate: 1000,
        conntrack_shed: netpol::ShedAt::Percent(0),
        dns_ttl_min: Duration::from_secs(60),
        dns_ttl_max: Duration::from_secs(3600),
    };
    let mut opts = opts;
    tweak(&mut opts);
    let net = Arc::new(Network::new(opts.clone()).expect("network"));
    net.recover(&[]).expect("table");
    let n = net.clone();
    rt.block_on(async move { n.serve_dns(std::future::pending()).await.map(|_| ()) }).expect("dns proxy");
    Env { world, rt, net, net_opts: opts, _dir: dir }
}

fn ok(out: &str) -> bool {
    out.starts_with("hello ")
}

#[test]
fn rules_open_what_they_name_and_nothing_else() {
    let e = env();
    let sb = Ns::new();
    let (_, me) = e.net.addrs(Slot(1));
    e.net
        .attach("e.s1", Slot(1), "root/t", &[r("198.51.100.10/32:tcp/80"), r("allowed.test")], sb.path().as_ref())
        .unwrap();
    let dns = e.net.dns_addr();

    // The operator can read the sandbox's rules with nft (docs/network.md, debugging).
    let (_, aset, _) = netpol::table::slot_names(1);
    let listed = netns::sh(&["nft", "list", "set", "inet", e.net.table_name(), &aset]);
    assert!(listed.contains("198.51.100.10 . tcp . 80"), "{listed}");

    // An allowed network with a port limit: that port works, another does not.
    assert!(ok(&sb.get(WEB_A, 80)), "{}", sb.get(WEB_A, 80));
    assert!(sb.get(WEB_A, 8080).starts_with("ERR"));
    // A disallowed address is unreachable by IP.
    assert!(sb.get(WEB_B, 80).starts_with("ERR"));

    // An allowed domain resolves (through the proxy) and opens its address on every port.
    assert_eq!(sb.dns("www.allowed.test", dns), format!("rcode=0 answers=1 ip={WEB_A}"));
    assert!(ok(&sb.get(WEB_A, 8080)), "learned before the answer came back");
    // AAAA: an empty answer.
    assert_eq!(sb.client(&["dns", "allowed.test", &dns.to_string(), "28"]), "rcode=0 answers=0 ip=-");
    // Another name: NXDOMAIN, and the world's DNS server never heard of it.
    assert_eq!(sb.dns("secret.exfil.test", dns), "rcode=3 answers=0 ip=-");
    assert!(!e.world.dns_saw("secret.exfil.test"), "a refused name left the edge");
    // DNS to another resolver, and DNS over TLS: dropped on the way.
    assert!(sb.dns("other.test", DNS).starts_with("ERR"));
    assert!(sb.client(&["get", &DNS.to_string(), "853", "/"]).starts_with("ERR"));
    assert!(!e.world.dns_saw("other.test"));

    // Nothing connects to the sandbox, from the host either (a server listens inside).
    sb.serve(8000);
    let conn = e.rt.block_on(async {
        tokio::time::timeout(Duration::from_secs(1), tokio::net::TcpStream::connect((me, 8000))).await
    });
    assert!(!matches!(conn, Ok(Ok(_))), "the host connected to a sandbox");
}

#[test]
fn star_opens_public_addresses_only() {
    let e = env();
    let (a, b) = (Ns::new(), Ns::new());
    e.net.attach("e.a", Slot(1), "root/t", &[r("*")], a.path().as_ref()).unwrap();
    e.net.attach("e.b", Slot(2), "root/t", &[r("*")], b.path().as_ref()).unwrap();
    let (host_end, b_addr) = e.net.addrs(Slot(2));
    // A listener on the edge's own addresses (where the edge's and apiserver's ports live).
    let l = e.rt.block_on(tokio::net::TcpListener::bind("0.0.0.0:7443")).unwrap();
    b.serve(8000);

    assert!(ok(&a.get(WEB_A, 80)) && ok(&a.get(WEB_B, 80)));
    for (addr, port, what) in [
        (METADATA, 80, "the metadata address"),
        (PRIVATE, 80, "a private address"),
        (WIRESERVER, 80, "Azure's WireServer"),
        (BENCHMARK, 80, "the benchmarking range"),
        (UPLINK_ADDR, 7443, "the host's uplink address"),
        (host_end, 7443, "the host end of another sandbox's veth"),
        (e.net.dns_addr(), 7443, "the DNS address on another port"),
        (b_addr, 8000, "another sandbox"),
    ] {
        assert!(a.get(addr, port).starts_with("ERR"), "reached {what} ({addr}:{port})");
    }
    // And the other way: b cannot reach a either.
    let (_, a_addr) = e.net.addrs(Slot(1));
    a.serve(8000);
    assert!(b.get(a_addr, 8000).starts_with("ERR"), "another sandbox reached a");
    drop(l);
    // A name that resolves into the metadata range stays closed (DNS rebinding).
    e.net.update("e.a", &[r("*"), r("rebind.test")]).unwrap();
    assert_eq!(a.dns("rebind.test", e.net.dns_addr()), format!("rcode=0 answers=1 ip={METADATA}"));
    assert!(a.get(METADATA, 80).starts_with("ERR"));
}

/// A private range the operator opened (an internal mirror's) is reached only by rules whose
/// network lies within it, or through the names listed for it: never by `*`, a wider network,
/// or another allowed name that resolves into it (rebinding). Before, opening it opened it to
/// every sandbox of the edge through all three.
#[test]
fn an_opened_range_opens_only_for_rules_naming_it() {
    let mirror = Ipv4Net::parse("10.0.0.0/24").unwrap();
    let e = env_with(|o| {
        o.open_private = vec![mirror];
        o.open_private_domains = vec![(mirror, vec!["mirror.test".into()])];
    });
    let dns = e.net.dns_addr();
    let (star, wide, named, listed) = (Ns::new(), Ns::new(), Ns::new(), Ns::new());
    e.net.attach("e.star", Slot(1), "root/t", &[r("*"), r("private.test")], star.path().as_ref()).unwrap();
    e.net.attach("e.wide", Slot(2), "root/t", &[r("0.0.0.0/0"), r("10.0.0.0/8")], wide.path().as_ref()).unwrap();
    e.net.attach("e.named", Slot(3), "root/t", &[r("10.0.0.0/24:tcp/80")], named.path().as_ref()).unwrap();
    e.net.attach("e.listed", Slot(4), "root/t", &[r("mirror.test")], listed.path().as_ref()).unwrap();

    // `*` and wide networks reach the public world, not the opened range.
    assert!(ok(&star.get(WEB_A, 80)) && ok(&wide.get(WEB_B, 80)));
    assert!(star.get(PRIVATE, 80).starts_with("ERR"), "* reached the opened range");
    assert!(wide.get(PRIVATE, 80).starts_with("ERR"), "0.0.0.0/0 or 10.0.0.0/8 reached the opened range");
    // An allowed name resolving into it opens nothing there (it is not listed for the range).
    assert_eq!(star.dns("private.test", dns), format!("rcode=0 answers=1 ip={PRIVATE}"));
    assert!(star.get(PRIVATE, 80).starts_with("ERR"), "a rebinding answer opened the range");
    // A rule naming it, and a name listed for it, do.
    assert!(ok(&named.get(PRIVATE, 80)), "{}", named.get(PRIVATE, 80));
    assert!(named.get(PRIVATE, 8080).starts_with("ERR"));
    assert!(listed.get(PRIVATE, 80).starts_with("ERR"), "open before its lookup");
    assert_eq!(listed.dns("mirror.test", dns), format!("rcode=0 answers=1 ip={PRIVATE}"));
    assert!(ok(&listed.get(PRIVATE, 80)), "{}", listed.get(PRIVATE, 80));
    // What the kernel holds for the first two: nothing of the range.
    for slot in [1, 2] {
        let (_, aset, rset) = netpol::table::slot_names(slot);
        for set in [aset, rset] {
            let listed = netns::sh(&["nft", "list", "set", "inet", e.net.table_name(), &set]);
            assert!(!listed.contains("10.0.0."), "slot {slot} {set}: {listed}");
        }
    }
}

/// One tenant's sandboxes holding lookups of a name that never answers take at most their
/// tenant's share of the DNS proxy's slots: another tenant's lookups are all answered, p99
/// under 50 ms (issue 39). Before, the slots were shared by all sandboxes of the edge, and 6
/// sandboxes of one tenant (32 each) held all 128 of them, so every other lookup was dropped.
#[test]
fn a_tenant_flooding_the_dns_proxy_leaves_another_tenants_lookups_fast() {
    let e = env_with(|o| {
        o.dns_slots = netpol::dns::DnsSlots { in_flight: 128, tcp: 32, tenant_share_percent: 50 };
        o.dns_rate = 1000.0;
        o.dns_burst = 1000.0;
    });
    let dns = e.net.dns_addr();
    let flooders: Vec<Ns> = (0..6).map(|_| Ns::new()).collect();
    for (i, f) in flooders.iter().enumerate() {
        e.net
            .attach(&format!("e.a{i}"), Slot(i as u32 + 1), "root/a", &[r("*"), r("void.test")], f.path().as_ref())
            .unwrap();
    }
    let b = Ns::new();
    e.net.attach("e.b", Slot(10), "root/b/x", &[r("other.test")], b.path().as_ref()).unwrap();

    let mut holding: Vec<Child> = flooders
        .iter()
        .map(|f| f.cmd(&["python3", "-c", CLIENT, "hold", netns::BLACKHOLE, &dns.to_string(), "8"]).spawn().unwrap())
        .collect();
    let proxy = e.net.dns_proxy().unwrap();
    let shed = || proxy.stats.shed.load(std::sync::atomic::Ordering::Relaxed);
    wait_for("tenant a at its share of the proxy", Duration::from_secs(5), || shed() > 0);

    let out = b.client(&["lookups", "other.test", &dns.to_string(), "200"]);
    let p99: f64 =
        out.split_whitespace().find_map(|w| w.strip_prefix("p99_ms=")).and_then(|v| v.parse().ok()).unwrap_or(-1.0);
    assert!(out.ends_with("failed=0"), "tenant b lost lookups while a flooded: {out}");
    assert!((0.0..50.0).contains(&p99), "tenant b's lookups slowed down: {out}");
    assert!(e.world.dns_saw(netns::BLACKHOLE), "a's lookups did go upstream");
    for h in &mut holding {
        let _ = h.kill();
        let _ = h.wait();
    }
}

/// Conntrack is bounded per tenant (all its sandboxes on the edge together) and per edge (no
/// new connection while the host's table is fuller than the edge allows), besides per
/// sandbox. Before, only each sandbox was bounded (4,096), so a tenant with many sandboxes,
/// or all sandboxes together, could fill the host's table.
#[test]
fn conntrack_is_bounded_per_tenant_and_per_edge() {
    let e = env_with(|o| {
        o.tenant_conns = 12;
        o.conntrack_shed = netpol::ShedAt::Entries(40);
    });
    let (a1, a2, b, c) = (Ns::new(), Ns::new(), Ns::new(), Ns::new());
    for (i, (ns, project)) in
        [(&a1, "root/a"), (&a2, "root/a/sub"), (&b, "root/b"), (&c, "root/c")].into_iter().enumerate()
    {
        e.net.attach(&format!("e.{i}"), Slot(i as u32 + 1), project, &[r("*")], ns.path().as_ref()).unwrap();
    }
    let web = WEB_A.to_string();
    let hold = |ns: &Ns, n: &str| {
        let mut child = ns
            .cmd(&["python3", "-u", "-c", CLIENT, "conns", &web, "80", n, "30"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(child.stdout.take().unwrap()), &mut line).unwrap();
        (child, line.trim().to_string())
    };
    // Tenant a: 8 from one sandbox, then only 4 of 8 from its other (12 in all).
    let (mut h1, got1) = hold(&a1, "8");
    let (mut h2, got2) = hold(&a2, "8");
    assert_eq!((got1.as_str(), got2.as_str()), ("open=8", "open=4"), "tenant a's bound");
    // Tenant b is not held back by a.
    let (mut h3, got3) = hold(&b, "10");
    assert_eq!(got3, "open=10");

    // The edge: past 40 entries in the host's table, no sandbox opens a connection.
    let (mut h4, got4) = hold(&c, "10");
    assert_eq!(got4, "open=10");
    let count = || {
        std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_count").unwrap().trim().parse::<u64>().unwrap()
    };
    let extra = Ns::new();
    e.net.attach("e.extra", Slot(9), "root/d", &[r("*")], extra.path().as_ref()).unwrap();
    if count() <= 40 {
        let (mut h5, _) = hold(&extra, "10");
        wait_for("more than 40 entries", Duration::from_secs(5), || count() > 40);
        let _ = h5.kill();
    }
    wait_for("the edge shedding", Duration::from_secs(5), || e.net.shedding());
    assert!(e.net.shedding());
    assert!(extra.get(WEB_B, 80).starts_with("ERR"), "a new connection while the edge sheds");
    // Once the table empties (the sandboxes end: their entries go with them), it takes them again.
    for h in [&mut h1, &mut h2, &mut h3, &mut h4] {
        let _ = h.kill();
        let _ = h.wait();
    }
    for (i, slot) in [(0, 1), (1, 2), (2, 3), (3, 4)] {
        e.net.detach(&format!("e.{i}"), Slot(slot)).unwrap();
    }
    wait_for("the edge accepting again", Duration::from_secs(5), || !e.net.shedding());
    assert!(ok(&extra.get(WEB_B, 80)), "{}", extra.get(WEB_B, 80));
}

#[test]
fn forged_sources_are_dropped() {
    let e = env();
    let sb = Ns::new();
    e.net.attach("e.s1", Slot(1), "root/t", &[r("*")], sb.path().as_ref()).unwrap();
    let (_, me) = e.net.addrs(Slot(1));
    // The sandbox's own address: the datagram arrives (the check can see it).
    sb.client(&["udp", &WEB_A.to_string(), &UDP_LOG_PORT.to_string(), "honest", &me.to_string()]);
    // Another sandbox's address, and one outside the subnet, put on the sandbox's eth0.
    for (i, forged) in ["10.88.0.5", "198.51.100.99"].into_iter().enumerate() {
        sb.sh(&["ip", "addr", "add", &format!("{forged}/32"), "dev", "eth0"]);
        sb.client(&["udp", &WEB_A.to_string(), &UDP_LOG_PORT.to_string(), &format!("forged{i}"), forged]);
    }
    wait_for("the honest datagram", Duration::from_secs(5), || e.world.udp_saw("honest"));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!e.world.udp_saw("forged0") && !e.world.udp_saw("forged1"), "{:?}", e.world.udp_log);
}

#[test]
fn updates_cut_established_connections_and_open_new_ones() {
    let e = env();
    let sb = Ns::new();
    e.net.attach("e.s1", Slot(1), "root/t", &[r("*")], sb.path().as_ref()).unwrap();
    let mut stream = sb
        .cmd(&["python3", "-u", "-c", CLIENT, "stream", &WEB_A.to_string(), "80"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = lines.clone();
    let out = stream.stdout.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for _ in std::io::BufReader::new(out).lines() {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let count = || lines.load(std::sync::atomic::Ordering::SeqCst);
    wait_for("the stream flowing", Duration::from_secs(5), || count() > 3);

    e.net.update("e.s1", &[]).unwrap();
    // Lines in flight may still land; then nothing more comes.
    std::thread::sleep(Duration::from_millis(300));
    let after = count();
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(count(), after, "the established connection kept flowing after its rule was taken back");
    assert!(sb.get(WEB_A, 80).starts_with("ERR"));

    e.net.update("e.s1", &[r("198.51.100.0/24:tcp/80")]).unwrap();
    assert!(ok(&sb.get(WEB_A, 80)));
    let _ = stream.kill();
    let _ = stream.wait();
}

#[test]
fn named_sets_and_a_dns_flood_leave_others_served() {
    let e = env();
    let (a, b) = (Ns::new(), Ns::new());
    e.net.attach("e.a", Slot(1), "root/t", &[r("allowed.test")], a.path().as_ref()).unwrap();
    e.net.attach("e.b", Slot(2), "root/t", &[r("@web")], b.path().as_ref()).unwrap();
    let dns = e.net.dns_addr();
    // The flood from a: far more than its burst.
    assert_eq!(a.client(&["flood", &dns.to_string(), "3000"]), "flooded");
    // b's lookups still work, and its named set opens other.test on port 80 only.
    assert_eq!(b.dns("other.test", dns), format!("rcode=0 answers=1 ip={WEB_B}"));
    assert!(ok(&b.get(WEB_B, 80)));
    assert_eq!(b.dns("allowed.test", dns), "rcode=3 answers=0 ip=-");
    // Of a's 3,000 queries at most its burst (20) and what its rate refilled were forwarded
    // (the kernel may drop some of the flood before the proxy reads it: the count of what
    // went upstream is what tells a limit from none).
    let stats = e.net.dns_proxy().unwrap();
    let forwarded = stats.stats.forwarded.load(std::sync::atomic::Ordering::Relaxed);
    assert!(forwarded < 200, "the flood was not limited: {forwarded} queries went upstream");
}

/// What the kernel holds for this edge: links with its prefix, elements in its sets,
/// conntrack entries from its subnet.
fn leftovers(net: &Network) -> (usize, usize, usize) {
    let links = netns::sh(&["ip", "-o", "link", "show"]).lines().filter(|l| l.contains(net.veth_prefix())).count();
    // Per-sandbox chains and sets, and the two maps every sandbox has an element in.
    let table = netns::sh(&["nft", "list", "table", "inet", net.table_name()]);
    let per_sandbox = table
        .lines()
        .filter(|l| {
            let l = l.trim();
            l.starts_with("chain s_")
                || l.starts_with("chain i_")
                || l.starts_with("chain t_")
                || l.starts_with("set a_")
                || l.starts_with("set r_")
        })
        .count();
    let in_maps: usize = ["sandboxes", "jumps", "replies", "tenants"]
        .iter()
        .map(|m| netns::sh(&["nft", "list", "map", "inet", net.table_name(), m]).matches("elements = {").count())
        .sum();
    let elems = per_sandbox + in_maps;
    let ct = std::fs::read_to_string("/proc/thread-self/net/nf_conntrack").unwrap_or_default();
    let conns = ct.lines().filter(|l| l.contains("src=10.88.")).count();
    (links, elems, conns)
}

#[test]
fn a_thousand_create_stop_cycles_leave_nothing() {
    let e = env();
    let sb = Ns::new();
    for i in 0..1000u32 {
        // A fresh namespace each time, held by an fd of a thread that ended.
        let holder = std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
            std::fs::File::open("/proc/thread-self/ns/net").unwrap()
        })
        .join()
        .unwrap();
        let path = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(&holder));
        let slot = e.net.reserve().unwrap();
        let id = format!("e.c{i}");
        e.net
            .attach(
                &id,
                slot,
                "root/t",
                &[r("*"), r("allowed.test:tcp/443"), r("203.0.113.0/24:udp/53-60")],
                path.as_ref(),
            )
            .unwrap();
        e.net.detach(&id, slot).unwrap();
    }
    // And one with live connections in conntrack when it stops.
    let slot = e.net.reserve().unwrap();
    e.net.attach("e.live", slot, "root/t", &[r("*")], sb.path().as_ref()).unwrap();
    assert!(ok(&sb.get(WEB_A, 80)));
    assert_eq!(sb.dns("www.allowed.test", e.net.dns_addr()), "rcode=3 answers=0 ip=-");
    assert!(leftovers(&e.net).2 > 0, "the connection shows in conntrack");
    e.net.detach("e.live", slot).unwrap();
    assert_eq!(leftovers(&e.net), (0, 0, 0));
    assert_eq!(e.net.attached(), 0);
}

#[test]
fn large_element_sets_go_in_several_messages_of_one_batch() {
    let e = env();
    let sb = Ns::new();
    // 64 rules: networks on distinct ports, and one domain.
    let mut rs: Vec<Rule> = (0..63).map(|i| r(&format!("198.51.100.{i}/32:tcp/{}", 1000 + i))).collect();
    rs.push(r("allowed.test"));
    e.net.attach("e.big", Slot(1), "root/t", &rs, sb.path().as_ref()).unwrap();
    // 640 learned addresses (32 per answer at most), then a change of rules, then a stop:
    // each is one batch of several messages.
    use opendsec_edge::netpol::dns::DnsPolicy;
    let (_, me) = e.net.addrs(Slot(1));
    for chunk in 0..20u8 {
        let addrs: Vec<Ipv4Addr> = (0..32u8).map(|i| Ipv4Addr::new(203, 0, chunk, i)).collect();
        e.net.learn(me, &format!("n{chunk}.allowed.test"), &addrs, 600).unwrap();
    }
    let (_, _, rset) = netpol::table::slot_names(1);
    let learned = netns::sh(&["nft", "list", "set", "inet", e.net.table_name(), &rset]);
    assert!(learned.matches(" . ").count() >= 640, "{learned}");
    e.net.update("e.big", &[r("allowed.test:tcp/443")]).unwrap();
    e.net.detach("e.big", Slot(1)).unwrap();
    assert_eq!(leftovers(&e.net), (0, 0, 0));
}

#[test]
fn an_edge_never_takes_over_another_owners_table() {
    let e = env();
    // A creation cut short before its network was attached: detaching it is no error.
    let never = e.net.reserve().unwrap();
    e.net.detach("e.never", never).unwrap();
    let mut opts = e.net_opts.clone();
    opts.owner = "/some/other/edge".into();
    let other = Network::new(opts).unwrap();
    let err = other.recover(&[]).unwrap_err();
    assert!(matches!(err, netpol::NetworkError::TableInUse { .. }), "{err}");
    // Another edge (its own tag) on the same subnet: refused at start.
    let mut opts = e.net_opts.clone();
    opts.tag = "abcdef".into();
    opts.owner = "/yet/another/edge".into();
    let err = Network::new(opts).unwrap_err();
    assert!(matches!(err, netpol::NetworkError::SubnetInUse { .. }), "{err}");
    // The first edge's table is untouched.
    let sb = Ns::new();
    e.net.attach("e.s1", Slot(1), "root/t", &[r("*")], sb.path().as_ref()).unwrap();
    assert!(ok(&sb.get(WEB_A, 80)));
}

#[test]
fn a_restart_rebuilds_every_slot_from_the_records() {
    let e = env();
    // Slot names spell no nft keyword (slot 0xdd once made a set called `add`).
    let claims: Vec<netpol::Claim> = [0xdd_u32, 0xadd, 0xfe, 1]
        .into_iter()
        .map(|s| netpol::Claim {
            id: format!("e.c{s}"),
            slot: Slot(s),
            project: format!("root/t{}", s % 2),
            rules: vec![r("203.0.113.0/24:tcp/80")],
        })
        .collect();
    e.net.recover(&claims).unwrap();
    assert_eq!(e.net.attached(), 4);
    let (_, aset, _) = netpol::table::slot_names(0xdd);
    let listed = netns::sh(&["nft", "list", "set", "inet", e.net.table_name(), &aset]);
    assert!(listed.contains("203.0.113.0/24 . tcp . 80"), "{listed}");
    // The next start without those records removes them.
    e.net.recover(&[]).unwrap();
    assert_eq!(leftovers(&e.net).1, 0);

    // An edge that stops with its sandboxes takes its network off the host; with one still
    // attached it leaves it.
    let sb = Ns::new();
    e.net.attach("e.kept", Slot(3), "root/t", &[r("*")], sb.path().as_ref()).unwrap();
    e.net.shutdown().unwrap();
    assert!(netns::sh(&["nft", "list", "tables"]).contains(e.net.table_name()));
    e.net.detach("e.kept", Slot(3)).unwrap();
    e.net.shutdown().unwrap();
    assert!(!netns::sh(&["nft", "list", "tables"]).contains(e.net.table_name()));
    assert!(!netns::sh(&["ip", "-4", "addr", "show", "lo"]).contains(&e.net.dns_addr().to_string()));
}

/// Counts the lines a command in the namespace prints, as they come.
fn count_lines(mut child: Child) -> (Child, Arc<std::sync::atomic::AtomicUsize>) {
    let lines = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let seen = lines.clone();
    let out = child.stdout.take().unwrap();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for _ in std::io::BufReader::new(out).lines() {
            seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    (child, lines)
}

#[test]
fn taking_a_rule_back_stops_replies_too() {
    let e = env();
    let sb = Ns::new();
    e.net.attach("e.s1", Slot(1), "root/t", &[r("198.51.100.0/24:udp")], sb.path().as_ref()).unwrap();
    // One datagram out, a stream of them back: the sandbox never sends again, so only the
    // replies' own check can stop them.
    let child = sb
        .cmd(&["python3", "-u", "-c", CLIENT, "udpstream", &WEB_A.to_string(), &UDP_STREAM_PORT.to_string()])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut child, lines) = count_lines(child);
    let count = || lines.load(std::sync::atomic::Ordering::SeqCst);
    wait_for("replies flowing", Duration::from_secs(5), || count() > 3);
    e.net.update("e.s1", &[r("203.0.113.0/24")]).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let after = count();
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(count(), after, "replies kept coming after their rule was taken back");
    let _ = child.kill();
    let _ = child.wait();
}
