//! The edge's DNS proxy (UDP and TCP port 53 on the edge's DNS address), the only resolver a
//! sandbox can reach.
//!
//! - A sandbox is told apart by the query's source address (the table drops forged sources
//!   before they reach the proxy).
//! - Names its rules allow (and their subdomains) are forwarded to the upstream resolvers;
//!   the IPv4 addresses of the answer join the sandbox's allowed set **before** the answer
//!   is sent, so the connection that follows is never refused for being early.
//! - Other names get NXDOMAIN and no query leaves the edge (no exfiltration through names).
//!   AAAA queries get empty answers (sandboxes have IPv4 only); other types of allowed names
//!   are forwarded.
//! - Malformed or oversized queries are dropped; each sandbox has its own rate limit, so a
//!   flood from one does not starve another.
//! - The proxy's slots (queries in flight, TCP connections) are bounded per sandbox and per
//!   tenant (top-level project, `network.dns_tenant_share_percent` of them), so one tenant's
//!   sandboxes holding lookups of a name that never answers leave the rest to the others; a
//!   query over its source's or tenant's share is dropped (the client retries), a TCP
//!   connection closed.

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, OpCode, ResponseCode};
use hickory_proto::rr::{DNSClass, RData, RecordType};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream, UdpSocket};

/// Largest query accepted (a question and an EDNS record fit easily).
pub const MAX_QUERY: usize = 1232;
/// Largest answer relayed over UDP; bigger ones are sent truncated (the client retries on TCP).
pub const MAX_UDP_ANSWER: usize = 1232;
/// How long one upstream has to answer before the next is tried.
const UPSTREAM_TIMEOUT: Duration = Duration::from_secs(2);
/// An idle TCP connection is closed after this long.
const TCP_IDLE: Duration = Duration::from_secs(10);
/// Queries in flight, and TCP connections, one sandbox may hold.
const MAX_IN_FLIGHT_PER_SOURCE: u32 = 32;
const MAX_TCP_PER_SOURCE: u32 = 4;
/// How long the TCP accept loop waits after an error (out of fds) before it accepts again.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// How many queries and TCP connections the proxy holds at once, and each tenant's share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DnsSlots {
    pub in_flight: u32,
    pub tcp: u32,
    /// Of each, the percentage one tenant (top-level project) may hold.
    pub tenant_share_percent: u32,
}

impl Default for DnsSlots {
    fn default() -> Self {
        DnsSlots { in_flight: 1024, tcp: 256, tenant_share_percent: 25 }
    }
}

impl DnsSlots {
    fn tenant(&self, total: u32) -> u32 {
        (u64::from(total) * u64::from(self.tenant_share_percent.clamp(1, 100)) / 100).max(1) as u32
    }
}

/// What the proxy asks the network about a query's source.
pub trait DnsPolicy: Send + Sync + 'static {
    /// Whether sandbox `src` may resolve `name`; `None` when no sandbox has that address.
    fn allowed(&self, src: Ipv4Addr, name: &str) -> Option<bool>;
    /// The tenant (top-level project) of sandbox `src`; `None` when no sandbox has that
    /// address.
    fn tenant(&self, src: Ipv4Addr) -> Option<Arc<str>>;
    /// Lets sandbox `src` reach `addrs` (answers for `name`) for about `ttl` seconds.
    /// Blocking (one netlink batch).
    fn learn(&self, src: Ipv4Addr, name: &str, addrs: &[Ipv4Addr], ttl: u32) -> Result<(), String>;
}

/// Per-source token buckets.
#[derive(Debug)]
struct Limiter {
    rate: f64,
    burst: f64,
    buckets: Mutex<HashMap<Ipv4Addr, (f64, Instant)>>,
}

impl Limiter {
    fn allow(&self, src: Ipv4Addr) -> bool {
        let now = Instant::now();
        let mut b = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if b.len() > 65536 {
            // Full buckets are the same as no bucket: forget them.
            let burst = self.burst;
            b.retain(|_, (tokens, at)| *tokens + now.duration_since(*at).as_secs_f64() * self.rate < burst);
        }
        let (tokens, at) = b.entry(src).or_insert((self.burst, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * self.rate).min(self.burst);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// Counters, for tests and metrics.
#[derive(Debug, Default)]
pub struct DnsStats {
    pub forwarded: std::sync::atomic::AtomicU64,
    pub refused: std::sync::atomic::AtomicU64,
    pub dropped: std::sync::atomic::AtomicU64,
    /// Queries and connections refused for their sandbox's or tenant's share of the slots.
    pub shed: std::sync::atomic::AtomicU64,
}

/// The proxy.
pub struct DnsProxy {
    upstream: Vec<SocketAddr>,
    policy: Arc<dyn DnsPolicy>,
    limiter: Limiter,
    in_flight: Arc<tokio::sync::Semaphore>,
    tcp_slots: Arc<tokio::sync::Semaphore>,
    /// Each sandbox's and each tenant's share of those, so that one cannot hold them all.
    in_flight_per_source: Arc<opendsec_common::bounds::PerKey>,
    tcp_per_source: Arc<opendsec_common::bounds::PerKey>,
    in_flight_per_tenant: Arc<opendsec_common::bounds::PerKey>,
    tcp_per_tenant: Arc<opendsec_common::bounds::PerKey>,
    pub stats: DnsStats,
}

impl std::fmt::Debug for DnsProxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DnsProxy").field("upstream", &self.upstream).finish_non_exhaustive()
    }
}

fn count(c: &std::sync::atomic::AtomicU64) {
    c.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
}

impl DnsProxy {
    pub fn new(
        upstream: Vec<SocketAddr>,
        policy: Arc<dyn DnsPolicy>,
        rate: f64,
        burst: f64,
        slots: DnsSlots,
    ) -> DnsProxy {
        use opendsec_common::bounds::PerKey;
        DnsProxy {
            upstream,
            policy,
            limiter: Limiter { rate, burst: burst.max(1.0), buckets: Mutex::new(HashMap::new()) },
            in_flight: Arc::new(tokio::sync::Semaphore::new(slots.in_flight.max(1) as usize)),
            tcp_slots: Arc::new(tokio::sync::Semaphore::new(slots.tcp.max(1) as usize)),
            in_flight_per_source: PerKey::new(MAX_IN_FLIGHT_PER_SOURCE),
            tcp_per_source: PerKey::new(MAX_TCP_PER_SOURCE),
            in_flight_per_tenant: PerKey::new(slots.tenant(slots.in_flight)),
            tcp_per_tenant: PerKey::new(slots.tenant(slots.tcp)),
            stats: DnsStats::default(),
        }
    }

    /// Slots for one query or connection from `src`: its sandbox's, its tenant's, then the
    /// proxy's (`None`: a share is full, or no sandbox has `src`).
    fn take(
        &self,
        src: Ipv4Addr,
        source: &Arc<opendsec_common::bounds::PerKey>,
        tenant: &Arc<opendsec_common::bounds::PerKey>,
        all: &Arc<tokio::sync::Semaphore>,
    ) -> Option<(
        opendsec_common::bounds::KeyPermit,
        opendsec_common::bounds::KeyPermit,
        tokio::sync::OwnedSemaphorePermit,
    )> {
        let Some(t) = self.policy.tenant(src) else {
            count(&self.stats.dropped);
            return None;
        };
        let taken = (|| {
            Some((source.try_take(&src.to_string())?, tenant.try_take(&t)?, all.clone().try_acquire_owned().ok()?))
        })();
        if taken.is_none() {
            count(&self.stats.shed);
        }
        taken
    }

    /// Serves queries on `udp` and `tcp` until `shutdown` resolves.
    pub async fn serve(
        self: Arc<Self>,
        udp: UdpSocket,
        tcp: TcpListener,
        shutdown: impl std::future::Future<Output = ()>,
    ) {
        let udp = Arc::new(udp);
        let me = self.clone();
        let u = udp.clone();
        let udp_loop = async move {
            let mut buf = vec![0u8; 65536];
            loop {
                let Ok((n, from)) = u.recv_from(&mut buf).await else { continue };
                let SocketAddr::V4(src) = from else { continue };
                if n > MAX_QUERY || !me.limiter.allow(*src.ip()) {
                    count(&me.stats.dropped);
                    continue;
                }
                let Some(permits) =
                    me.take(*src.ip(), &me.in_flight_per_source, &me.in_flight_per_tenant, &me.in_flight)
                else {
                    continue;
                };
                let (me, u, q) = (me.clone(), u.clone(), buf[..n].to_vec());
                tokio::spawn(async move {
                    let _permits = permits;
                    if let Some(a) = me.answer(*src.ip(), &q, true).await {
                        let _ = u.send_to(&a, from).await;
                    }
                });
            }
        };
        let me = self.clone();
        let tcp_loop = async move {
            loop {
                let (conn, from) = match tcp.accept().await {
                    Ok(c) => c,
                    Err(_) => {
                        // Out of fds and the like: back off instead of spinning.
                        tokio::time::sleep(ACCEPT_BACKOFF).await;
                        continue;
                    }
                };
                let SocketAddr::V4(src) = from else { continue };
                let Some(permits) = me.take(*src.ip(), &me.tcp_per_source, &me.tcp_per_tenant, &me.tcp_slots) else {
                    continue;
                };
                let me = me.clone();
                tokio::spawn(async move {
                    let _permits = permits;
                    me.serve_tcp(conn, *src.ip()).await;
                });
            }
        };
        tokio::select! {
            () = udp_loop => {}
            () = tcp_loop => {}
            () = shutdown => {}
        }
    }

    async fn serve_tcp(&self, mut conn: TcpStream, src: Ipv4Addr) {
        loop {
            let mut len = [0u8; 2];
            match tokio::time::timeout(TCP_IDLE, conn.read_exact(&mut len)).await {
                Ok(Ok(_)) => {}
                _ => return,
            }
            let n = usize::from(u16::from_be_bytes(len));
            if n > MAX_QUERY || !self.limiter.allow(src) {
                count(&self.stats.dropped);
                return;
            }
            let mut q = vec![0u8; n];
            if tokio::time::timeout(TCP_IDLE, conn.read_exact(&mut q)).await.map(|r| r.is_err()).unwrap_or(true) {
                return;
            }
            let Some(a) = self.answer(src, &q, false).await else { return };
            let mut out = Vec::with_capacity(a.len() + 2);
            out.extend_from_slice(&(a.len() as u16).to_be_bytes());
            out.extend_from_slice(&a);
            if conn.write_all(&out).await.is_err() {
                return;
            }
        }
    }

    /// The answer to query bytes `q` from `src`; `None`: drop it.
    pub async fn answer(&self, src: Ipv4Addr, q: &[u8], udp: bool) -> Option<Vec<u8>> {
        let Ok(msg) = Message::from_vec(q) else {
            count(&self.stats.dropped);
            return None;
        };
        if msg.metadata.message_type != MessageType::Query {
            count(&self.stats.dropped);
            return None;
        }
        let reply = |code: ResponseCode| {
            let mut r = Message::error_msg(msg.metadata.id, msg.metadata.op_code, code);
            r.metadata.recursion_desired = msg.metadata.recursion_desired;
            r.metadata.recursion_available = true;
            r.queries = msg.queries.clone();
            r.to_vec().ok()
        };
        if msg.metadata.op_code != OpCode::Query {
            return reply(ResponseCode::NotImp);
        }
        let [query] = msg.queries.as_slice() else { return reply(ResponseCode::FormErr) };
        if query.query_class() != DNSClass::IN {
            return reply(ResponseCode::Refused);
        }
        let name = query.name().to_ascii().trim_end_matches('.').to_ascii_lowercase();
        match self.policy.allowed(src, &name) {
            None => {
                count(&self.stats.dropped);
                return None;
            }
            Some(false) => {
                count(&self.stats.refused);
                return reply(ResponseCode::NXDomain);
            }
            Some(true) => {}
        }
        if query.query_type() == RecordType::AAAA {
            return reply(ResponseCode::NoError);
        }
        let Some(raw) = self.forward(&msg, udp).await else { return reply(ResponseCode::ServFail) };
        count(&self.stats.forwarded);
        let Ok(answer) = Message::from_vec(&raw) else { return reply(ResponseCode::ServFail) };
        let addrs: Vec<Ipv4Addr> = answer
            .answers
            .iter()
            .filter_map(|r| match &r.data {
                RData::A(a) => Some(a.0),
                _ => None,
            })
            .collect();
        if !addrs.is_empty() {
            let ttl = answer.answers.iter().filter(|r| matches!(r.data, RData::A(_))).map(|r| r.ttl).min().unwrap_or(0);
            // A netlink batch under the network's lock: off the async threads.
            let (policy, n) = (self.policy.clone(), name.clone());
            let learned = tokio::task::spawn_blocking(move || policy.learn(src, &n, &addrs, ttl))
                .await
                .unwrap_or_else(|e| Err(e.to_string()));
            if let Err(e) = learned {
                tracing::warn!(source = %src, name = %name, error = %e, "could not open the addresses of an answer");
                return reply(ResponseCode::ServFail);
            }
        }
        let mut raw = raw;
        raw[..2].copy_from_slice(&msg.metadata.id.to_be_bytes());
        let limit = if udp { client_udp_limit(&msg) } else { usize::from(u16::MAX) };
        if raw.len() > limit {
            let mut t = answer.truncate();
            t.metadata.id = msg.metadata.id;
            return t.to_vec().ok();
        }
        Some(raw)
    }

    /// Asks the upstreams in turn; over TCP when the client used TCP or a UDP answer came
    /// back truncated (a UDP query that timed out is not asked again over TCP: a name that
    /// never answers holds its slot for one timeout per upstream, not two). Returns the raw
    /// answer (its id is ours, not the client's).
    async fn forward(&self, msg: &Message, udp: bool) -> Option<Vec<u8>> {
        let mut q = Message::query();
        q.metadata.recursion_desired = true;
        q.queries = msg.queries.clone();
        let id = q.metadata.id;
        let bytes = q.to_vec().ok()?;
        for up in &self.upstream {
            let got = if udp {
                match udp_exchange(*up, &bytes, id).await {
                    Some(a) if truncated(&a) => tcp_exchange(*up, &bytes, id).await,
                    got => got,
                }
            } else {
                tcp_exchange(*up, &bytes, id).await
            };
            if got.is_some() {
                return got;
            }
        }
        None
    }
}

fn truncated(a: &[u8]) -> bool {
    a.get(2).is_some_and(|b| b & 0x02 != 0)
}

/// What the client can take over UDP: 512 bytes, or what its EDNS record says (capped).
fn client_udp_limit(msg: &Message) -> usize {
    msg.edns.as_ref().map(|e| usize::from(e.max_payload()).clamp(512, MAX_UDP_ANSWER)).unwrap_or(512)
}

fn answers_id(a: &[u8], id: u16) -> bool {
    a.len() >= 12 && u16::from_be_bytes([a[0], a[1]]) == id && a[2] & 0x80 != 0
}

async fn udp_exchange(up: SocketAddr, q: &[u8], id: u16) -> Option<Vec<u8>> {
    let bind: SocketAddr = if up.is_ipv4() { "0.0.0.0:0".parse().ok()? } else { "[::]:0".parse().ok()? };
    let s = UdpSocket::bind(bind).await.ok()?;
    s.connect(up).await.ok()?;
    s.send(q).await.ok()?;
    let mut buf = vec![0u8; 65536];
    let deadline = tokio::time::Instant::now() + UPSTREAM_TIMEOUT;
    loop {
        let n = tokio::time::timeout_at(deadline, s.recv(&mut buf)).await.ok()?.ok()?;
        if answers_id(&buf[..n], id) {
            buf.truncate(n);
            return Some(buf);
        }
    }
}

async fn tcp_exchange(up: SocketAddr, q: &[u8], id: u16) -> Option<Vec<u8>> {
    let work = async {
        let mut c = TcpStream::connect(up).await.ok()?;
        let mut out = Vec::with_capacity(q.len() + 2);
        out.extend_from_slice(&(q.len() as u16).to_be_bytes());
        out.extend_from_slice(q);
        c.write_all(&out).await.ok()?;
        let mut len = [0u8; 2];
        c.read_exact(&mut len).await.ok()?;
        let mut a = vec![0u8; usize::from(u16::from_be_bytes(len))];
        c.read_exact(&mut a).await.ok()?;
        answers_id(&a, id).then_some(a)
    };
    tokio::time::timeout(UPSTREAM_TIMEOUT, work).await.ok()?
}

#[cfg(test)]
mod tests {
    use super::*;
    use hickory_proto::op::Query;
    use hickory_proto::rr::{Name, Record, rdata::A};

    /// Allows `*.allowed.test` for 10.88.0.3 and records what it learned.
    #[derive(Default)]
    struct Policy {
        learned: Mutex<Vec<(String, Vec<Ipv4Addr>, u32)>>,
    }

    impl DnsPolicy for Policy {
        fn tenant(&self, src: Ipv4Addr) -> Option<Arc<str>> {
            (src == Ipv4Addr::new(10, 88, 0, 3)).then(|| Arc::from("root/t"))
        }
        fn allowed(&self, src: Ipv4Addr, name: &str) -> Option<bool> {
            (src == Ipv4Addr::new(10, 88, 0, 3)).then(|| opendsec_common::egress::domain_within(name, "allowed.test"))
        }
        fn learn(&self, _: Ipv4Addr, name: &str, addrs: &[Ipv4Addr], ttl: u32) -> Result<(), String> {
            self.learned.lock().unwrap().push((name.into(), addrs.to_vec(), ttl));
            Ok(())
        }
    }

    /// An upstream on loopback that answers every A query with 192.0.2.7, TTL 42, and
    /// counts the queries it saw.
    async fn upstream() -> (SocketAddr, Arc<std::sync::atomic::AtomicU64>) {
        let s = UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = s.local_addr().unwrap();
        let seen = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let c = seen.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            loop {
                let (n, from) = s.recv_from(&mut buf).await.unwrap();
                c.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let q = Message::from_vec(&buf[..n]).unwrap();
                let mut r = Message::response(q.metadata.id, OpCode::Query);
                r.queries = q.queries.clone();
                let name = q.queries[0].name().clone();
                r.add_answer(Record::from_rdata(name, 42, RData::A(A(Ipv4Addr::new(192, 0, 2, 7)))));
                s.send_to(&r.to_vec().unwrap(), from).await.unwrap();
            }
        });
        (addr, seen)
    }

    fn query(name: &str, ty: RecordType) -> Vec<u8> {
        let mut m = Message::query();
        m.add_query(Query::query(Name::from_ascii(name).unwrap(), ty));
        m.to_vec().unwrap()
    }

    #[tokio::test]
    async fn allowed_names_are_forwarded_and_learned_others_never_leave() {
        let (up, seen) = upstream().await;
        let policy = Arc::new(Policy::default());
        let p = DnsProxy::new(vec![up], policy.clone(), 1000.0, 1000.0, DnsSlots::default());
        let me = Ipv4Addr::new(10, 88, 0, 3);
        let a =
            Message::from_vec(&p.answer(me, &query("www.allowed.test.", RecordType::A), true).await.unwrap()).unwrap();
        assert_eq!(a.metadata.response_code, ResponseCode::NoError);
        assert_eq!(a.answers.len(), 1);
        assert_eq!(
            policy.learned.lock().unwrap()[0],
            ("www.allowed.test".into(), vec![Ipv4Addr::new(192, 0, 2, 7)], 42)
        );
        // A name outside the rules: NXDOMAIN, and the upstream never sees it.
        let before = seen.load(std::sync::atomic::Ordering::SeqCst);
        let n =
            Message::from_vec(&p.answer(me, &query("secret.exfil.test.", RecordType::A), true).await.unwrap()).unwrap();
        assert_eq!(n.metadata.response_code, ResponseCode::NXDomain);
        // AAAA of an allowed name: empty, not forwarded.
        let v6 =
            Message::from_vec(&p.answer(me, &query("allowed.test.", RecordType::AAAA), true).await.unwrap()).unwrap();
        assert_eq!((v6.metadata.response_code, v6.answers.len()), (ResponseCode::NoError, 0));
        assert_eq!(seen.load(std::sync::atomic::Ordering::SeqCst), before);
        // Unknown sources and garbage: dropped.
        assert!(p.answer(Ipv4Addr::new(10, 88, 0, 5), &query("allowed.test.", RecordType::A), true).await.is_none());
        assert!(p.answer(me, b"\x00\x01garbage", true).await.is_none());
        let mut two = Message::query();
        two.add_query(Query::query(Name::from_ascii("a.allowed.test.").unwrap(), RecordType::A));
        two.add_query(Query::query(Name::from_ascii("b.allowed.test.").unwrap(), RecordType::A));
        let f = Message::from_vec(&p.answer(me, &two.to_vec().unwrap(), true).await.unwrap()).unwrap();
        assert_eq!(f.metadata.response_code, ResponseCode::FormErr);
    }

    #[test]
    fn a_flooding_source_runs_out_while_another_does_not() {
        let l = Limiter { rate: 0.0, burst: 5.0, buckets: Mutex::new(HashMap::new()) };
        let (a, b) = (Ipv4Addr::new(10, 0, 0, 1), Ipv4Addr::new(10, 0, 0, 2));
        assert_eq!((0..10).filter(|_| l.allow(a)).count(), 5);
        assert!(l.allow(b));
    }
}
