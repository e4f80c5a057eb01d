//! Issue 15's IAM benchmarks (`make bench-iam`, release; `cargo bench -p opendsec-cli --bench
//! iam`). Prints figures, asserts nothing about time. Everything on loopback, every store
//! durable (fsync on):
//!
//! - admissions/s and the p50/p99 of one admission, from 64 callers each admitting fresh
//!   leases back to back for 10 s, spread over every member as apiservers do: IAM standalone
//!   (one `opendsec iam` process), IAM on Raft ×3 (three processes), and beside them etcd 3.4
//!   (Debian's `etcd-server`, three members) doing the same work as a transaction per
//!   admission (put the lease's key if it does not exist: a compare on its version and a put),
//!   through a gRPC client written here (no etcd client crate needs `protoc`);
//! - failover on Raft ×3: the leader killed (SIGKILL) ten times, each time the time until an
//!   admission called after the kill is answered; p50 and the worst.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use opendsec_common::grpc::{self, Links};
use opendsec_common::pki::Role;
use opendsec_proto::v1 as pb;
use opendsec_proto::v1::admin_client::AdminClient;
use opendsec_proto::v1::iam_client::IamClient;
use tonic::transport::Channel;

const ADMIN: &str = "dsk.admin.BenchAdminSecret0123456789abcdef";
const CALLERS: usize = 64;
const RUN: Duration = Duration::from_secs(10);

fn port() -> u16 {
    opendsec_testkit::free_port()
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn pct(v: &mut [Duration], p: f64) -> f64 {
    v.sort();
    ms(v[((p / 100.0) * (v.len() - 1) as f64).round() as usize])
}

struct Procs(BTreeMap<u64, Child>);
impl Drop for Procs {
    fn drop(&mut self) {
        for c in self.0.values_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// One `opendsec iam` process: member `id` of `members` (empty: standalone).
fn start_iam(dir: &Path, id: u64, addr: &str, members: &BTreeMap<u64, String>) -> Child {
    let mut iam = serde_json::json!({"listen": addr, "admin_token": ADMIN});
    if !members.is_empty() {
        let initial: BTreeMap<String, String> = members.iter().map(|(k, v)| (k.to_string(), v.clone())).collect();
        iam["raft"] = serde_json::json!({"id": id, "initial_members": initial});
    }
    let cfg =
        serde_json::json!({"state_dir": dir.join(format!("iam-{id}")), "tls": {"dir": dir.join("pki")}, "iam": iam});
    let path = dir.join(format!("iam-{id}.json"));
    std::fs::write(&path, cfg.to_string()).unwrap();
    let log = std::fs::OpenOptions::new().create(true).append(true).open(dir.join(format!("iam-{id}.log"))).unwrap();
    Command::new(env!("CARGO_BIN_EXE_opendsec"))
        .args(["iam", "--config", path.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::from(log.try_clone().unwrap()))
        .stderr(Stdio::from(log))
        .spawn()
        .unwrap()
}

fn admin_request<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    grpc::set_bearer(&mut r, ADMIN).unwrap();
    r
}

async fn leader(admins: &[AdminClient<Channel>]) -> Option<u64> {
    for a in admins {
        let mut a = a.clone();
        if let Ok(Ok(r)) =
            tokio::time::timeout(Duration::from_secs(2), a.iam_members(admin_request(pb::IamMembersRequest {}))).await
            && let Some(m) = r.get_ref().members.iter().find(|m| m.leader)
        {
            return Some(m.id);
        }
    }
    None
}

async fn admit(iam: &mut IamClient<Channel>, lease: &str) -> Result<(), tonic::Status> {
    iam.admit(pb::AdmitRequest {
        token: ADMIN.into(),
        lease_id: lease.into(),
        project: "root".into(),
        resources: Some(pb::Resources { cpu_millis: 1, memory_mb: 1, disk_mb: 1, gpus: 0 }),
        edge: "bench".into(),
        keep_existing: false,
        egress: vec![],
        pool: String::new(),
    })
    .await
    .map(|_| ())
}

/// Runs `op` from CALLERS callers for RUN; prints ops/s, p50, p99.
async fn closed_loop<F, Fut>(what: &str, op: F)
where
    F: Fn(usize, u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send,
{
    let op = Arc::new(op);
    let stop = Arc::new(AtomicBool::new(false));
    let failed = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for c in 0..CALLERS {
        let (op, stop, failed) = (op.clone(), stop.clone(), failed.clone());
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                if op(c, n).await {
                    lat.push(t.elapsed());
                } else {
                    failed.fetch_add(1, Ordering::Relaxed);
                }
                n += 1;
            }
            lat
        }));
    }
    let t = Instant::now();
    tokio::time::sleep(RUN).await;
    stop.store(true, Ordering::Relaxed);
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let secs = t.elapsed().as_secs_f64();
    println!(
        "{what:<28} {:>8.0} admissions/s   p50 {:>6.1} ms   p99 {:>6.1} ms   ({} done, {} failed, {CALLERS} callers)",
        all.len() as f64 / secs,
        pct(&mut all, 50.0),
        pct(&mut all, 99.0),
        all.len(),
        failed.load(Ordering::Relaxed)
    );
}

async fn iam_cluster(dir: &Path, n: u64) -> (Procs, Vec<String>, Vec<Channel>, Vec<AdminClient<Channel>>) {
    let addrs: BTreeMap<u64, String> = (1..=n).map(|i| (i, format!("127.0.0.1:{}", port()))).collect();
    let members = if n == 1 { BTreeMap::new() } else { addrs.clone() };
    let pki = dir.join("pki");
    for i in 0..=n {
        opendsec_testkit::creds(&pki, Role::Iam, &i.to_string());
    }
    let procs =
        Procs(addrs.iter().map(|(id, a)| (*id, start_iam(dir, if n == 1 { 0 } else { *id }, a, &members))).collect());
    let links = Links::new(opendsec_testkit::creds(&pki, Role::Apiserver, "0"));
    let channels: Vec<Channel> = addrs.values().map(|a| links.channel(a, Role::Iam, None).unwrap()).collect();
    let admins: Vec<AdminClient<Channel>> = channels.iter().cloned().map(AdminClient::new).collect();
    let t = Instant::now();
    // Ready: an admission answered.
    let mut iam = IamClient::new(channels[0].clone());
    while admit(&mut iam, "ready").await.is_err() {
        assert!(t.elapsed() < Duration::from_secs(60), "IAM did not come up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (procs, addrs.into_values().collect(), channels, admins)
}

async fn bench_iam(dir: &Path, n: u64, what: &str) {
    let (_procs, _addrs, channels, _admins) = iam_cluster(dir, n).await;
    let channels = Arc::new(channels);
    closed_loop(what, move |c, i| {
        let mut iam = IamClient::new(channels[c % channels.len()].clone());
        async move { admit(&mut iam, &format!("l-{c}-{i}")).await.is_ok() }
    })
    .await;
}

async fn failover(dir: &Path) {
    let (mut procs, addrs, channels, admins) = iam_cluster(dir, 3).await;
    let mut times = Vec::new();
    for round in 0..10 {
        let deadline = Instant::now() + Duration::from_secs(60);
        let l = loop {
            if let Some(l) = leader(&admins).await {
                break l;
            }
            assert!(Instant::now() < deadline, "no leader");
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        // Admissions keep coming from 8 callers; the kill, then the first answer to a call
        // made after it.
        let killed_at = Arc::new(std::sync::Mutex::new(None::<Instant>));
        let back = Arc::new(std::sync::Mutex::new(None::<Duration>));
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for c in 0..8usize {
            let (channels, killed_at, back, stop) = (channels.clone(), killed_at.clone(), back.clone(), stop.clone());
            tasks.push(tokio::spawn(async move {
                let mut i = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let mut iam = IamClient::new(channels[(c + i as usize) % channels.len()].clone());
                    let called = Instant::now();
                    let ok =
                        tokio::time::timeout(Duration::from_secs(2), admit(&mut iam, &format!("f-{round}-{c}-{i}")))
                            .await
                            .is_ok_and(|r| r.is_ok());
                    let k = *killed_at.lock().unwrap();
                    if ok && let Some(k) = k.filter(|k| called >= *k) {
                        let mut b = back.lock().unwrap();
                        if b.is_none() {
                            *b = Some(k.elapsed());
                        }
                    }
                    i += 1;
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let mut child = procs.0.remove(&l).unwrap();
        child.kill().unwrap();
        *killed_at.lock().unwrap() = Some(Instant::now());
        child.wait().unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        while back.lock().unwrap().is_none() {
            assert!(Instant::now() < deadline, "no admission after killing leader {l}");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        stop.store(true, Ordering::Relaxed);
        for t in tasks {
            t.await.unwrap();
        }
        let b = back.lock().unwrap().unwrap();
        println!("  kill {round}: leader {l}, first admission after {:.0} ms", ms(b));
        times.push(b);
        let members: BTreeMap<u64, String> = addrs.iter().enumerate().map(|(i, a)| (i as u64 + 1, a.clone())).collect();
        procs.0.insert(l, start_iam(dir, l, &addrs[(l - 1) as usize], &members));
        // Back in: it answers again (through itself, forwarded to the leader).
        let mut iam = IamClient::new(channels[(l - 1) as usize].clone());
        let deadline = Instant::now() + Duration::from_secs(60);
        while admit(&mut iam, &format!("back-{round}")).await.is_err() {
            assert!(Instant::now() < deadline, "member {l} did not come back");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let worst = times.iter().max().copied().unwrap_or_default();
    println!(
        "Raft ×3 failover (leader kill -9 → first admission): p50 {:.0} ms, worst {:.0} ms over 10 kills",
        pct(&mut times, 50.0),
        ms(worst)
    );
}

// --- etcd ------------------------------------------------------------------------------
// The few messages of etcd's KV.Txn this benchmark sends, declared from etcd's API reference
// (field numbers as etcd documents them).

#[derive(Clone, PartialEq, prost::Message)]
struct Compare {
    /// 0: EQUAL.
    #[prost(int32, tag = "1")]
    result: i32,
    /// 0: VERSION.
    #[prost(int32, tag = "2")]
    target: i32,
    #[prost(bytes = "vec", tag = "3")]
    key: Vec<u8>,
    #[prost(int64, optional, tag = "4")]
    version: Option<i64>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct PutRequest {
    #[prost(bytes = "vec", tag = "1")]
    key: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RequestOp {
    #[prost(message, optional, tag = "2")]
    request_put: Option<PutRequest>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct TxnRequest {
    #[prost(message, repeated, tag = "1")]
    compare: Vec<Compare>,
    #[prost(message, repeated, tag = "2")]
    success: Vec<RequestOp>,
    #[prost(message, repeated, tag = "3")]
    failure: Vec<RequestOp>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct TxnResponse {
    #[prost(bool, tag = "2")]
    succeeded: bool,
}

async fn etcd_txn(ch: Channel, key: String) -> Result<bool, tonic::Status> {
    let mut grpc = tonic::client::Grpc::new(ch);
    grpc.ready().await.map_err(|e| tonic::Status::unavailable(e.to_string()))?;
    let value = br#"{"project":"root","resources":{"cpu_millis":1,"memory_mb":1,"disk_mb":1},"edge":"bench"}"#.to_vec();
    let req = TxnRequest {
        compare: vec![Compare { result: 0, target: 0, key: key.clone().into_bytes(), version: Some(0) }],
        success: vec![RequestOp { request_put: Some(PutRequest { key: key.into_bytes(), value }) }],
        failure: vec![],
    };
    let path = http::uri::PathAndQuery::from_static("/etcdserverpb.KV/Txn");
    let codec: tonic_prost::ProstCodec<TxnRequest, TxnResponse> = tonic_prost::ProstCodec::default();
    let r = grpc.unary(tonic::Request::new(req), path, codec).await?;
    Ok(r.into_inner().succeeded)
}

async fn bench_etcd(dir: &Path) {
    let Some(etcd) = ["/usr/bin/etcd", "/usr/local/bin/etcd"].into_iter().map(PathBuf::from).find(|p| p.exists())
    else {
        println!("etcd 3.4 ×3: not run (apt install etcd-server; make bench-iam does)");
        return;
    };
    let members: Vec<(String, u16, u16)> = (1..=3).map(|i| (format!("e{i}"), port(), port())).collect();
    let cluster: Vec<String> = members.iter().map(|(n, _, peer)| format!("{n}=http://127.0.0.1:{peer}")).collect();
    let mut procs = Procs(BTreeMap::new());
    for (i, (name, client, peer)) in members.iter().enumerate() {
        let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
        let child = Command::new(&etcd)
            .args(["--name", name, "--data-dir", dir.join(name).to_str().unwrap()])
            .args(["--listen-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--advertise-client-urls", &format!("http://127.0.0.1:{client}")])
            .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-advertise-peer-urls", &format!("http://127.0.0.1:{peer}")])
            .args(["--initial-cluster", &cluster.join(","), "--initial-cluster-state", "new"])
            .args(["--initial-cluster-token", "opendsec-bench"])
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        procs.0.insert(i as u64, child);
    }
    let channels: Vec<Channel> = members
        .iter()
        .map(|(_, client, _)| Channel::from_shared(format!("http://127.0.0.1:{client}")).unwrap().connect_lazy())
        .collect();
    let t = Instant::now();
    while !matches!(etcd_txn(channels[0].clone(), "ready".into()).await, Ok(true)) {
        assert!(t.elapsed() < Duration::from_secs(60), "etcd did not come up (see {}/e1.log)", dir.display());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let channels = Arc::new(channels);
    closed_loop("etcd 3.4 ×3 (txn per lease)", move |c, i| {
        let ch = channels[c % channels.len()].clone();
        async move { matches!(etcd_txn(ch, format!("/leases/l-{c}-{i}")).await, Ok(true)) }
    })
    .await;
    drop(procs);
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().unwrap();
    rt.block_on(async {
        println!("IAM admissions, {CALLERS} callers for {} s, loopback, fsync on", RUN.as_secs());
        let d = tempfile::tempdir().unwrap();
        bench_iam(d.path(), 1, "IAM standalone").await;
        let d = tempfile::tempdir().unwrap();
        bench_iam(d.path(), 3, "IAM Raft ×3").await;
        let d = tempfile::tempdir().unwrap();
        bench_etcd(d.path()).await;
        let d = tempfile::tempdir().unwrap();
        failover(d.path()).await;
    });
}
