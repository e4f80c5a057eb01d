//! Hermetic network tests: the edge runs in a network namespace of the test's own whose only
//! way out is a veth into a test "world" namespace, which holds the test servers on TEST-NET
//! addresses. Nothing a test sends can reach the machine's real network, even when a rule under
//! test is wrong.
//!
//! - [`enter_private_namespace`] moves the calling thread (and every thread and process it
//!   starts afterwards: build the tokio runtime after it) into a new, empty network namespace;
//! - [`World::start`] makes the world, joins it to that namespace (link [`UPLINK`], default
//!   route into the world), and serves there: HTTP on [`WEB_A`] (ports 80 and 8080) and
//!   [`WEB_B`] (port 80), an authoritative DNS server on [`DNS`] that logs every query.
//!
//! The world's zone ([`ZONE`]) maps test names to the test servers; anything else is
//! NXDOMAIN. The HTTP servers answer `GET /` with `hello <addr>:<port>`, `GET /stream` with
//! a line every 50 ms until the client goes, and `GET /bytes/<n>` with `n` bytes.

use std::net::Ipv4Addr;
use std::process::Command;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The edge namespace's link into the world, and its address there.
pub const UPLINK: &str = "odt-up";
pub const UPLINK_ADDR: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 2);
pub const WORLD_GW: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
pub const WEB_A: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
pub const WEB_B: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
pub const DNS: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 53);
/// Servers a sandbox must never reach, whatever its rules: they answer like the others, so a
/// wrong rule shows as a connection that works. They live in the world namespace like the
/// rest (the edge's namespace routes everything there, and the world routes nowhere else).
pub const METADATA: Ipv4Addr = Ipv4Addr::new(169, 254, 169, 254);
pub const PRIVATE: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 1);
/// Azure's WireServer address and one of the benchmarking range (198.18/15): public-looking
/// addresses a `*` rule must not reach either.
pub const WIRESERVER: Ipv4Addr = Ipv4Addr::new(168, 63, 129, 16);
pub const BENCHMARK: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 1);
/// UDP port on [`WEB_A`] whose server logs every datagram's text ([`World::udp_log`]).
pub const UDP_LOG_PORT: u16 = 9;
/// UDP port on [`WEB_A`] whose server answers a datagram with one every 50 ms for 20 s.
pub const UDP_STREAM_PORT: u16 = 7;

/// A name the world's DNS server never answers (a lookup of it holds the edge's proxy until
/// it gives up on the upstream).
pub const BLACKHOLE: &str = "void.test";

/// The world's names.
pub const ZONE: &[(&str, Ipv4Addr)] = &[
    ("allowed.test", WEB_A),
    ("www.allowed.test", WEB_A),
    ("other.test", WEB_B),
    ("secret.exfil.test", WEB_B),
    // A public name pointing into the metadata range (DNS rebinding).
    ("rebind.test", Ipv4Addr::new(169, 254, 169, 254)),
    // Names pointing into the private range: one an operator lists for an opened range, one
    // it does not (rebinding into the opened range).
    ("mirror.test", PRIVATE),
    ("private.test", PRIVATE),
];

/// Runs a command; panics with its output if it fails.
pub fn sh(args: &[&str]) -> String {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Moves the calling thread into a new network namespace with `lo` up. Threads and processes
/// it starts from now on are in it too.
pub fn enter_private_namespace() {
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET) (needs root)");
    sh(&["ip", "link", "set", "lo", "up"]);
}

/// The test world: its namespace, servers and query log. Dropping it removes the namespace
/// (and the veth with it).
#[derive(Debug)]
pub struct World {
    pub name: String,
    /// Every name the DNS server was asked, in order.
    pub dns_log: Arc<Mutex<Vec<String>>>,
    /// Every datagram the UDP log server got, as text.
    pub udp_log: Arc<Mutex<Vec<String>>>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl World {
    /// Makes the world and joins the calling thread's namespace to it (see the module doc).
    /// Panics unless the route to the world's servers goes through [`UPLINK`].
    pub fn start() -> World {
        let name = format!("odt-w-{:08x}", rand_u32());
        sh(&["ip", "netns", "add", &name]);
        sh(&["ip", "link", "add", UPLINK, "type", "veth", "peer", "name", "w0", "netns", &name]);
        sh(&["ip", "addr", "add", &format!("{UPLINK_ADDR}/24"), "dev", UPLINK]);
        sh(&["ip", "link", "set", UPLINK, "up"]);
        sh(&["ip", "route", "add", "default", "via", &WORLD_GW.to_string()]);
        let inw = |args: &[&str]| {
            let mut v = vec!["ip", "netns", "exec", name.as_str()];
            v.extend_from_slice(args);
            sh(&v)
        };
        inw(&["ip", "link", "set", "lo", "up"]);
        inw(&["ip", "addr", "add", &format!("{WORLD_GW}/24"), "dev", "w0"]);
        inw(&["ip", "link", "set", "w0", "up"]);
        for a in [WEB_A, WEB_B, DNS, METADATA, PRIVATE, WIRESERVER, BENCHMARK] {
            inw(&["ip", "addr", "add", &format!("{a}/32"), "dev", "lo"]);
        }
        // Before anything is sent: the route to every test address is the test's own link.
        for a in [WEB_A, WEB_B, DNS, METADATA, PRIVATE, WIRESERVER, BENCHMARK] {
            let r = sh(&["ip", "route", "get", &a.to_string()]);
            assert!(r.contains(&format!("dev {UPLINK}")), "route to the test world's {a}: {r}");
        }

        let dns_log = Arc::new(Mutex::new(Vec::new()));
        let udp_log = Arc::new(Mutex::new(Vec::new()));
        let ulog = udp_log.clone();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<()>();
        let log = dns_log.clone();
        let ns = format!("/run/netns/{name}");
        let thread = std::thread::spawn(move || {
            let f = std::fs::File::open(&ns).expect("the world's namespace");
            rustix::thread::move_into_link_name_space(
                std::os::fd::AsFd::as_fd(&f),
                Some(rustix::thread::LinkNameSpaceType::Network),
            )
            .expect("setns into the world");
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async move {
                let mut servers = Vec::new();
                let servers_at = [
                    (WEB_A, 80),
                    (WEB_A, 8080),
                    (WEB_B, 80),
                    (METADATA, 80),
                    (PRIVATE, 80),
                    (WIRESERVER, 80),
                    (BENCHMARK, 80),
                ];
                for (addr, port) in servers_at {
                    let l = tokio::net::TcpListener::bind((addr, port)).await.expect("http bind");
                    servers.push(tokio::spawn(http(l)));
                }
                let udp = tokio::net::UdpSocket::bind((DNS, 53)).await.expect("dns bind");
                let tcp = tokio::net::TcpListener::bind((DNS, 53)).await.expect("dns tcp bind");
                servers.push(tokio::spawn(dns_udp(udp, log.clone())));
                servers.push(tokio::spawn(dns_tcp(tcp, log)));
                let st =
                    Arc::new(tokio::net::UdpSocket::bind((WEB_A, UDP_STREAM_PORT)).await.expect("udp stream bind"));
                servers.push(tokio::spawn(async move {
                    let mut buf = vec![0u8; 2048];
                    loop {
                        let Ok((_, from)) = st.recv_from(&mut buf).await else { continue };
                        let st = st.clone();
                        tokio::spawn(async move {
                            for i in 0..400u32 {
                                let _ = st.send_to(format!("dgram {i}").as_bytes(), from).await;
                                tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                            }
                        });
                    }
                }));
                let u = tokio::net::UdpSocket::bind((WEB_A, UDP_LOG_PORT)).await.expect("udp log bind");
                servers.push(tokio::spawn(async move {
                    let mut buf = vec![0u8; 2048];
                    loop {
                        let Ok((n, _)) = u.recv_from(&mut buf).await else { continue };
                        ulog.lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push(String::from_utf8_lossy(&buf[..n]).into_owned());
                    }
                }));
                let _ = ready_tx.send(());
                let _ = stopped.await;
                for s in servers {
                    s.abort();
                }
            });
        });
        ready_rx.recv().expect("the world's servers came up");
        World { name, dns_log, udp_log, stop: Some(stop), thread: Some(thread) }
    }

    /// Whether the UDP log server got a datagram saying `text`.
    pub fn udp_saw(&self, text: &str) -> bool {
        self.udp_log.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|t| t == text)
    }

    /// Whether the DNS server was ever asked `name`.
    pub fn dns_saw(&self, name: &str) -> bool {
        self.dns_log.lock().unwrap_or_else(|p| p.into_inner()).iter().any(|n| n == name)
    }
}

impl Drop for World {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = Command::new("ip").args(["netns", "delete", &self.name]).output();
    }
}

pub(crate) fn rand_u32() -> u32 {
    let t = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    (t as u32) ^ std::process::id().rotate_left(16)
}

async fn http(l: tokio::net::TcpListener) {
    let me = l.local_addr().map(|a| a.to_string()).unwrap_or_default();
    loop {
        let Ok((mut c, _)) = l.accept().await else { continue };
        let me = me.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 2048];
            let mut got = 0;
            while !buf[..got].windows(4).any(|w| w == b"\r\n\r\n") && got < buf.len() {
                match c.read(&mut buf[got..]).await {
                    Ok(0) | Err(_) => return,
                    Ok(n) => got += n,
                }
            }
            let req = String::from_utf8_lossy(&buf[..got]).into_owned();
            let path = req.split_whitespace().nth(1).unwrap_or("/").to_string();
            if path == "/stream" {
                let _ = c.write_all(b"HTTP/1.0 200 OK\r\n\r\n").await;
                let mut i = 0u64;
                loop {
                    if c.write_all(format!("line {i}\n").as_bytes()).await.is_err() {
                        return;
                    }
                    i += 1;
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
            } else if let Some(n) = path.strip_prefix("/bytes/").and_then(|n| n.parse::<u64>().ok()) {
                let _ = c.write_all(format!("HTTP/1.0 200 OK\r\nContent-Length: {n}\r\n\r\n").as_bytes()).await;
                let chunk = vec![b'x'; 64 << 10];
                let mut left = n;
                while left > 0 {
                    let k = left.min(chunk.len() as u64) as usize;
                    if c.write_all(&chunk[..k]).await.is_err() {
                        return;
                    }
                    left -= k as u64;
                }
            } else {
                let body = format!("hello {me}\n");
                let _ = c
                    .write_all(format!("HTTP/1.0 200 OK\r\nContent-Length: {}\r\n\r\n{body}", body.len()).as_bytes())
                    .await;
            }
        });
    }
}

/// The answer of the world's DNS server to query bytes `q` (and the name asked).
fn dns_answer(q: &[u8]) -> Option<(Vec<u8>, String)> {
    use hickory_proto::op::{Message, OpCode, ResponseCode};
    use hickory_proto::rr::{RData, Record, RecordType, rdata::A};
    let m = Message::from_vec(q).ok()?;
    let query = m.queries.first()?.clone();
    let name = query.name().to_ascii().trim_end_matches('.').to_ascii_lowercase();
    let mut r = Message::response(m.metadata.id, OpCode::Query);
    r.metadata.authoritative = true;
    r.metadata.recursion_desired = m.metadata.recursion_desired;
    r.queries = m.queries.clone();
    match ZONE.iter().find(|(n, _)| *n == name) {
        Some((_, a)) => {
            if query.query_type() == RecordType::A {
                r.add_answer(Record::from_rdata(query.name().clone(), 60, RData::A(A(*a))));
            }
        }
        None => r.metadata.response_code = ResponseCode::NXDomain,
    }
    Some((r.to_vec().ok()?, name))
}

async fn dns_udp(s: tokio::net::UdpSocket, log: Arc<Mutex<Vec<String>>>) {
    let mut buf = vec![0u8; 4096];
    loop {
        let Ok((n, from)) = s.recv_from(&mut buf).await else { continue };
        if let Some((a, name)) = dns_answer(&buf[..n]) {
            let silent = name == BLACKHOLE;
            log.lock().unwrap_or_else(|p| p.into_inner()).push(name);
            if !silent {
                let _ = s.send_to(&a, from).await;
            }
        }
    }
}

async fn dns_tcp(l: tokio::net::TcpListener, log: Arc<Mutex<Vec<String>>>) {
    loop {
        let Ok((mut c, _)) = l.accept().await else { continue };
        let log = log.clone();
        tokio::spawn(async move {
            let mut len = [0u8; 2];
            while c.read_exact(&mut len).await.is_ok() {
                let mut q = vec![0u8; usize::from(u16::from_be_bytes(len))];
                if c.read_exact(&mut q).await.is_err() {
                    return;
                }
                let Some((a, name)) = dns_answer(&q) else { return };
                let silent = name == BLACKHOLE;
                log.lock().unwrap_or_else(|p| p.into_inner()).push(name);
                if silent {
                    // Held open, never answered, until the client goes.
                    let mut rest = Vec::new();
                    let _ = c.read_to_end(&mut rest).await;
                    return;
                }
                let mut out = (a.len() as u16).to_be_bytes().to_vec();
                out.extend_from_slice(&a);
                if c.write_all(&out).await.is_err() {
                    return;
                }
            }
        });
    }
}
