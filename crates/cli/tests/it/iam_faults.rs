//! IAM on Raft ×3 as three `opendsec iam` processes, each on a host of its own (a network
//! namespace on a test LAN: nothing leaves the machine), talking mTLS gRPC, with the default
//! Raft timings. Calls go on at about 1,000 admissions a second from many clients, to every
//! member (followers forward), while the test
//!
//! - kills the leader with SIGKILL, and restarts it with its disk;
//! - kills a follower, and restarts it;
//! - cuts the leader off from the other members (the clients still reach it), and heals it;
//! - adds a fourth member, a fresh process started without initial members (a learner that
//!   catches up, then a voter), and removes a follower;
//! - kills all three at once, and restarts them.
//!
//! Every call is recorded (call time, answer time and answer, or no answer). At the end each
//! lease is read once more, and the history of every lease is checked for linearizability
//! (`opendsec_testkit::linear`): an admission answered and then not seen, a stale read, a
//! rebinding lost or applied twice fails it. The project's usage must equal the leases that
//! exist: nothing was counted twice. Figures (rate, time back after each fault) are printed;
//! nothing asserts on them. Root only (network namespaces); CI runs as root.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opendsec_common::grpc::{self, Links};
use opendsec_common::pki::Role;
use opendsec_proto::v1 as pb;
use opendsec_proto::v1::admin_client::AdminClient;
use opendsec_proto::v1::iam_client::IamClient;
use opendsec_testkit::lan::Lan;
use opendsec_testkit::linear::{self, Model, Op};
use tonic::transport::Channel;

const ADMIN: &str = "dsk.admin01.AdminSecretAdminSecret0123456789";
const PROJECT: &str = "root/load";
const PORT: u16 = 7100;
/// Calls a second: 70% of them admissions (about 1,000 a second), the rest lease reads and
/// releases, as an apiserver and edges make them.
const RATE: u64 = 1430;
/// Clients: calls in flight at most.
const CLIENTS: usize = 64;
/// A call without an answer in this long is recorded as unanswered.
const CALL_TIMEOUT: Duration = Duration::from_secs(2);
const EDGES: [&str; 3] = ["ea", "eb", "ec"];

// --- the model: one lease ---------------------------------------------------------------

#[derive(Clone, Debug, PartialEq)]
enum In {
    /// Admit on edge `EDGES[.0]`; `keep`: keep_existing.
    Admit(u8, bool),
    Get,
    Release,
}

#[derive(Clone, Debug, PartialEq)]
enum Out {
    Admitted { rebound: bool, existing: bool, edge: u8 },
    Found(Option<u8>),
    Released(u32),
}

/// A lease: absent, or bound to an edge.
struct Lease;

impl Model for Lease {
    type State = Option<u8>;
    type Input = In;
    type Output = Out;

    fn init(&self) -> Option<u8> {
        None
    }

    fn step(&self, s: &Option<u8>, i: &In, o: Option<&Out>) -> Option<Option<u8>> {
        match (i, *s) {
            (In::Admit(e, _), None) => match o {
                None | Some(Out::Admitted { rebound: false, existing: false, .. })
                    if o.is_none_or(|o| edge_of(o) == *e) =>
                {
                    Some(Some(*e))
                }
                _ => None,
            },
            (In::Admit(_, true), Some(b)) => match o {
                None | Some(Out::Admitted { rebound: false, existing: true, .. })
                    if o.is_none_or(|o| edge_of(o) == b) =>
                {
                    Some(Some(b))
                }
                _ => None,
            },
            (In::Admit(e, false), Some(_)) => match o {
                None | Some(Out::Admitted { rebound: true, existing: false, .. })
                    if o.is_none_or(|o| edge_of(o) == *e) =>
                {
                    Some(Some(*e))
                }
                _ => None,
            },
            (In::Get, s) => match o {
                None => Some(s),
                Some(Out::Found(f)) if *f == s => Some(s),
                _ => None,
            },
            (In::Release, s) => match o {
                None => Some(None),
                Some(Out::Released(n)) if *n == u32::from(s.is_some()) => Some(None),
                _ => None,
            },
        }
    }
}

fn edge_of(o: &Out) -> u8 {
    match o {
        Out::Admitted { edge, .. } => *edge,
        _ => u8::MAX,
    }
}

fn edge_index(name: &str) -> u8 {
    EDGES.iter().position(|e| *e == name).unwrap_or_else(|| panic!("an edge nobody named: {name:?}")) as u8
}

// --- the members ------------------------------------------------------------------------

struct Members {
    lan: Lan,
    dir: PathBuf,
    children: BTreeMap<u64, Child>,
}

impl Members {
    fn addr(&self, id: u64) -> String {
        format!("{}:{PORT}", self.lan.hosts[(id - 1) as usize].addr)
    }

    fn config(&self, id: u64) -> PathBuf {
        // The first three make the cluster; a later one starts empty and waits to be added.
        let initial: BTreeMap<String, String> =
            if id <= 3 { (1..=3).map(|i| (i.to_string(), self.addr(i))).collect() } else { BTreeMap::new() };
        let cfg = serde_json::json!({
            "state_dir": self.dir.join(format!("member-{id}")),
            "tls": { "dir": self.dir.join("pki") },
            "iam": {
                "listen": self.addr(id),
                "admin_token": ADMIN,
                "raft": { "id": id, "initial_members": initial },
            },
        });
        let path = self.dir.join(format!("iam-{id}.json"));
        std::fs::write(&path, serde_json::to_vec_pretty(&cfg).unwrap()).unwrap();
        path
    }

    fn log(&self, id: u64) -> PathBuf {
        self.dir.join(format!("iam-{id}.log"))
    }

    fn start(&mut self, id: u64) {
        let config = self.config(id);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(self.log(id)).unwrap();
        let child = self.lan.hosts[(id - 1) as usize]
            .command(env!("CARGO_BIN_EXE_opendsec"))
            .args(["iam", "--config", config.to_str().unwrap()])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .expect("start opendsec iam");
        self.children.insert(id, child);
    }

    /// SIGKILL, and the exit reaped.
    fn kill(&mut self, id: u64) {
        let mut c = self.children.remove(&id).expect("a running member");
        c.kill().expect("kill -9");
        c.wait().expect("reap");
    }

    fn logs(&self) -> String {
        (1..=4)
            .map(|id| {
                let text = std::fs::read_to_string(self.log(id)).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(40).collect();
                format!("--- member {id}:\n{}\n", tail.into_iter().rev().collect::<Vec<_>>().join("\n"))
            })
            .collect()
    }
}

impl Drop for Members {
    fn drop(&mut self) {
        for c in self.children.values_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

// --- the clients ------------------------------------------------------------------------

#[derive(Clone)]
struct Record {
    key: u64,
    op: Op<In, Out>,
}

struct Load {
    t0: Instant,
    stop: AtomicBool,
    started: AtomicU64,
    next_slot_ns: AtomicU64,
    history: Mutex<Vec<Record>>,
    /// Errors by gRPC code. Those that may hide an outcome (the call may or may not have
    /// happened) are recorded as unanswered calls; any other fails the test.
    errors: Mutex<BTreeMap<String, u64>>,
    definite: Mutex<Vec<String>>,
    iam: Vec<IamClient<Channel>>,
}

impl Load {
    fn now(&self) -> u64 {
        self.t0.elapsed().as_nanos() as u64
    }

    async fn client(self: Arc<Self>, n: usize) {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (n as u64 + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9));
        let mut member = n % self.iam.len();
        let period = 1_000_000_000 / RATE;
        while !self.stop.load(Ordering::Relaxed) {
            // Open loop at RATE: each call takes the next slot; a client that fell behind
            // does not make up more than 100 ms of slots.
            let now = self.now();
            let slot = self.next_slot_ns.fetch_add(period, Ordering::Relaxed).max(now.saturating_sub(100_000_000));
            if slot > now {
                tokio::time::sleep(Duration::from_nanos(slot - now)).await;
            }
            let seq = self.started.fetch_add(1, Ordering::Relaxed);
            // Eight leases in play at a time, each while 128 calls are made (about 16 of them
            // its own). Only even leases are released: on odd ones an admission once answered
            // must be seen to the end, with no unanswered release to explain it away.
            let key = seq / 16 + rng.below(8);
            let input = match rng.below(100) {
                0..50 => In::Admit(rng.below(3) as u8, true),
                50..70 => In::Admit(rng.below(3) as u8, false),
                70..95 => In::Get,
                _ if key.is_multiple_of(2) => In::Release,
                _ => In::Get,
            };
            let call = self.now();
            let mut iam = self.iam[member].clone();
            let answer = tokio::time::timeout(CALL_TIMEOUT, run(&mut iam, key, &input)).await;
            let ret = self.now();
            let output = match answer {
                Ok(Ok(o)) => Some(o),
                Ok(Err(s)) => {
                    let mut errors = self.errors.lock().unwrap();
                    let n = errors.entry(format!("{:?}", s.code())).or_default();
                    if *n == 0 {
                        eprintln!("first {:?}: {}", s.code(), s.message());
                    }
                    *n += 1;
                    drop(errors);
                    // What a lost connection, a leader change or a forward that failed looks
                    // like; anything else is an answer, and a wrong one here.
                    if !matches!(
                        s.code(),
                        tonic::Code::Unavailable
                            | tonic::Code::Unknown
                            | tonic::Code::Cancelled
                            | tonic::Code::DeadlineExceeded
                    ) {
                        self.definite.lock().unwrap().push(format!("{input:?} on {}: {s:?}", lease_id(key)));
                    }
                    member = (member + 1) % self.iam.len();
                    None
                }
                Err(_) => {
                    *self.errors.lock().unwrap().entry("timeout".into()).or_default() += 1;
                    member = (member + 1) % self.iam.len();
                    None
                }
            };
            let ret = output.as_ref().map(|_| ret);
            self.history.lock().unwrap().push(Record { key, op: Op { call, ret, input, output } });
        }
    }

    /// The first answer to a call made at or after `t` (ns since t0), as time after `t`.
    fn back_after(&self, t: u64) -> Option<Duration> {
        let h = self.history.lock().unwrap();
        h.iter()
            .filter(|r| r.op.call >= t && matches!(r.op.input, In::Admit(..)))
            .filter_map(|r| r.op.ret)
            .min()
            .map(|r| Duration::from_nanos(r - t))
    }
}

fn lease_id(key: u64) -> String {
    format!("lk-{key}")
}

async fn run(iam: &mut IamClient<Channel>, key: u64, input: &In) -> Result<Out, tonic::Status> {
    match input {
        In::Admit(e, keep) => {
            let r = iam
                .admit(pb::AdmitRequest {
                    token: ADMIN.into(),
                    lease_id: lease_id(key),
                    project: PROJECT.into(),
                    resources: Some(pb::Resources { cpu_millis: 1, memory_mb: 1, disk_mb: 1, gpus: 0 }),
                    edge: EDGES[*e as usize].into(),
                    keep_existing: *keep,
                    egress: vec![],
                    pool: String::new(),
                })
                .await?
                .into_inner();
            Ok(Out::Admitted { rebound: r.rebound, existing: r.existing, edge: edge_index(&r.edge) })
        }
        In::Get => {
            let r = iam.get_lease(pb::GetLeaseRequest { lease_id: lease_id(key) }).await?.into_inner();
            Ok(Out::Found(r.found.then(|| edge_index(&r.lease.unwrap_or_default().edge))))
        }
        In::Release => {
            let r = iam
                .release_leases(pb::ReleaseLeasesRequest { lease_ids: vec![lease_id(key)], edge: String::new() })
                .await?
                .into_inner();
            Ok(Out::Released(r.released))
        }
    }
}

/// xorshift: reproducible choices without a dependency.
struct Rng(u64);
impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

fn admin_request<T>(msg: T) -> tonic::Request<T> {
    let mut r = tonic::Request::new(msg);
    grpc::set_bearer(&mut r, ADMIN).expect("bearer");
    r
}

/// The membership as any member answers it (retried through faults).
async fn members(admins: &[AdminClient<Channel>]) -> pb::IamMembersResponse {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        for a in admins {
            let mut a = a.clone();
            if let Ok(Ok(r)) =
                tokio::time::timeout(Duration::from_secs(2), a.iam_members(admin_request(pb::IamMembersRequest {})))
                    .await
            {
                let r = r.into_inner();
                if r.members.iter().any(|m| m.leader) {
                    return r;
                }
            }
        }
        assert!(Instant::now() < deadline, "no member names a leader");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn leader(admins: &[AdminClient<Channel>]) -> u64 {
    members(admins).await.members.iter().find(|m| m.leader).map(|m| m.id).expect("a leader")
}

/// Until every member holds the whole committed log.
async fn caught_up(admins: &[AdminClient<Channel>], what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let m = members(admins).await;
        if m.members.len() == 3 && m.members.iter().all(|x| x.matched_index >= m.committed_index.saturating_sub(2000)) {
            return;
        }
        assert!(Instant::now() < deadline, "{what}: members never caught up: {m:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[test]
fn raft_x3_processes_survive_kills_and_partitions_under_load_and_stay_linearizable() {
    assert!(opendsec_testkit::is_root(), "this test needs root (network namespaces); CI runs as root");
    opendsec_testkit::netns::enter_private_namespace();
    let lan = Lan::start(4);
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let dir = tempfile::tempdir().unwrap();
    rt.block_on(scenario(lan, dir.path()));
}

async fn scenario(lan: Lan, dir: &Path) {
    let pki = dir.join("pki");
    for id in 1..=4 {
        opendsec_testkit::creds(&pki, Role::Iam, &id.to_string());
    }
    let links = Links::new(opendsec_testkit::creds(&pki, Role::Apiserver, "0"));
    let mut m = Members { lan, dir: dir.to_path_buf(), children: BTreeMap::new() };
    for id in 1..=3 {
        m.start(id);
    }
    // Clients and the test call every member, the fourth too (which answers once it runs).
    let channels: Vec<Channel> =
        (1..=4).map(|id| links.channel(&m.addr(id), Role::Iam, None).expect("a channel")).collect();
    let admins: Vec<AdminClient<Channel>> = channels.iter().cloned().map(AdminClient::new).collect();
    let first = leader(&admins).await;
    eprintln!("member {first} leads");
    let mut a = admins[0].clone();
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) =
        a.create_project(admin_request(pb::CreateProjectRequest { path: PROJECT.into(), quota: None })).await
    {
        assert!(Instant::now() < deadline, "create the project: {e}\n{}", m.logs());
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    let load = Arc::new(Load {
        t0: Instant::now(),
        stop: AtomicBool::new(false),
        started: AtomicU64::new(0),
        next_slot_ns: AtomicU64::new(0),
        history: Mutex::new(Vec::new()),
        errors: Mutex::new(BTreeMap::new()),
        definite: Mutex::new(Vec::new()),
        iam: channels.iter().cloned().map(IamClient::new).collect(),
    });
    let clients: Vec<_> = (0..CLIENTS).map(|n| tokio::spawn(load.clone().client(n))).collect();
    let pause = |s| tokio::time::sleep(Duration::from_secs(s));
    pause(3).await;

    // Member `id` killed for 3 s, restarted with its disk: when admissions came back.
    async fn kill_and_restart(
        m: &mut Members,
        load: &Load,
        admins: &[AdminClient<Channel>],
        id: u64,
    ) -> Option<Duration> {
        let t = load.now();
        m.kill(id);
        tokio::time::sleep(Duration::from_secs(3)).await;
        let back = load.back_after(t);
        m.start(id);
        caught_up(admins, &format!("after member {id}'s restart")).await;
        back
    }

    // 1. The leader killed, restarted.
    let l = leader(&admins).await;
    let back_leader = kill_and_restart(&mut m, &load, &admins, l).await;

    // 2. A follower killed, restarted.
    let l = leader(&admins).await;
    let f = (1..=3).find(|i| *i != l).unwrap();
    let back_follower = kill_and_restart(&mut m, &load, &admins, f).await;

    // 3. The leader cut off from the other members (clients still reach it), then healed.
    let l = leader(&admins).await;
    let peers: Vec<_> = (1..=3).filter(|i| *i != l).map(|i| m.lan.hosts[(i - 1) as usize].addr).collect();
    let t = load.now();
    m.lan.isolate((l - 1) as usize, &peers);
    pause(4).await;
    let back_partition = load.back_after(t);
    let during = members(&admins).await;
    m.lan.heal((l - 1) as usize);
    caught_up(&admins, "after the partition healed").await;

    // 4. Membership under load: a fourth member, a fresh process with no initial members,
    // is added (a learner that catches up, then a voter); then a follower is removed.
    m.start(4);
    let mut a = admins[0].clone();
    let add = pb::AddIamMemberRequest { id: 4, address: m.addr(4), learner_only: false };
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut any = admins.clone();
    loop {
        let r = tokio::time::timeout(Duration::from_secs(10), any[0].add_iam_member(admin_request(add.clone()))).await;
        match r {
            Ok(Ok(r)) if r.get_ref().members.iter().any(|x| x.id == 4 && x.voter) => break,
            other => {
                assert!(Instant::now() < deadline, "adding member 4: {other:?}\n{}", m.logs());
                any.rotate_left(1);
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }
    let l = leader(&admins).await;
    let gone = (1..=3).find(|i| *i != l).unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while let Err(e) = a.remove_iam_member(admin_request(pb::RemoveIamMemberRequest { id: gone })).await {
        assert!(Instant::now() < deadline, "removing member {gone}: {e}\n{}", m.logs());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    m.kill(gone);
    let current: Vec<u64> = (1..=4).filter(|i| *i != gone).collect();
    caught_up(&admins, "after the membership change").await;
    let changed = members(&admins).await;
    let ids: Vec<u64> = changed.members.iter().map(|x| x.id).collect();
    assert_eq!(ids, current, "{changed:?}");
    eprintln!("member 4 added, member {gone} removed, under load");

    // 5. All three killed at once, restarted.
    for id in &current {
        m.kill(*id);
    }
    let t = load.now();
    for id in &current {
        m.start(*id);
    }
    pause(4).await;
    let back_all = load.back_after(t);
    pause(2).await;

    load.stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.await.unwrap();
    }
    let elapsed = load.now();

    // Every lease read once more, after everything.
    let keys = load.started.load(Ordering::Relaxed) / 16 + 8;
    let mut iam = IamClient::new(channels[(current[0] - 1) as usize].clone());
    let mut finals: Vec<Record> = Vec::new();
    for chunk in (0..keys).collect::<Vec<_>>().chunks(500) {
        let call = load.now();
        let got = loop {
            let ids = chunk.iter().map(|k| lease_id(*k)).collect();
            match iam.get_leases(pb::GetLeasesRequest { lease_ids: ids }).await {
                Ok(r) => break r.into_inner(),
                Err(e) => {
                    assert!(load.now() - call < 30_000_000_000, "final reads: {e}\n{}", m.logs());
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        let ret = load.now();
        let found: HashMap<String, u8> = got.leases.iter().map(|l| (l.id.clone(), edge_index(&l.edge))).collect();
        for k in chunk {
            let output = Out::Found(found.get(&lease_id(*k)).copied());
            finals.push(Record { key: *k, op: Op { call, ret: Some(ret), input: In::Get, output: Some(output) } });
        }
    }
    let present = finals.iter().filter(|r| matches!(r.op.output, Some(Out::Found(Some(_))))).count() as u64;

    // Nothing counted twice: the project's usage is the leases that exist.
    let mut a = admins[(current[0] - 1) as usize].clone();
    let usage = a.get_usage(admin_request(pb::GetUsageRequest { project: PROJECT.into() })).await.expect("usage");
    let used = usage
        .into_inner()
        .projects
        .iter()
        .find(|p| p.path == PROJECT)
        .and_then(|p| p.usage)
        .map(|u| u.sandboxes)
        .unwrap_or(0);

    // The figures.
    let mut history = load.history.lock().unwrap().clone();
    let answered = history.iter().filter(|r| r.op.ret.is_some()).count();
    let admits = history.iter().filter(|r| matches!(r.op.input, In::Admit(..)) && r.op.ret.is_some()).count();
    eprintln!(
        "{} calls in {:.1} s ({} answered; {:.0} admissions/s answered), {} clients; errors {:?}",
        history.len(),
        elapsed as f64 / 1e9,
        answered,
        admits as f64 / (elapsed as f64 / 1e9),
        CLIENTS,
        load.errors.lock().unwrap()
    );
    eprintln!(
        "back after: leader killed {back_leader:?}, follower killed {back_follower:?}, leader partitioned {back_partition:?}, all three restarted {back_all:?}"
    );
    eprintln!("during the partition: {during:?}");
    eprintln!("leases present at the end {present}, usage {used}");

    // Every lease's history is linearizable. A read that never answered says nothing: left out.
    history.retain(|r| r.op.ret.is_some() || !matches!(r.op.input, In::Get));
    history.extend(finals);
    let mut by_key: BTreeMap<u64, Vec<Op<In, Out>>> = BTreeMap::new();
    for r in history {
        by_key.entry(r.key).or_default().push(r.op);
    }
    let unanswered = |ops: &Vec<Op<In, Out>>| ops.iter().filter(|o| o.ret.is_none()).count();
    let most = by_key.values().map(|o| (o.len(), unanswered(o))).max_by_key(|x| x.1);
    eprintln!("{} leases; most unanswered calls on one (calls, unanswered): {most:?}", by_key.len());
    for (key, ops) in &by_key {
        if let Err(e) = linear::check(&Lease, ops) {
            panic!("lease {}: {e}\n{}", lease_id(*key), m.logs());
        }
    }
    assert!(answered > 1000, "too few calls answered to say anything: {answered}\n{}", m.logs());
    let definite = load.definite.lock().unwrap();
    assert!(definite.is_empty(), "calls refused outright: {:?}", &definite[..definite.len().min(20)]);
    // Every kind of call was answered, each of its answers too.
    let all: Vec<&Op<In, Out>> = by_key.values().flatten().collect();
    let seen = |f: &dyn Fn(&Op<In, Out>) -> bool| all.iter().filter(|o| f(o)).count();
    for (what, n) in [
        (
            "admissions of new leases",
            seen(&|o| matches!(o.output, Some(Out::Admitted { rebound: false, existing: false, .. }))),
        ),
        ("admissions kept where they were", seen(&|o| matches!(o.output, Some(Out::Admitted { existing: true, .. })))),
        ("rebindings", seen(&|o| matches!(o.output, Some(Out::Admitted { rebound: true, .. })))),
        ("reads that found a lease", seen(&|o| matches!(o.output, Some(Out::Found(Some(_)))))),
        ("reads that found none", seen(&|o| matches!(o.output, Some(Out::Found(None))))),
        ("releases of a lease", seen(&|o| matches!(o.output, Some(Out::Released(1))))),
    ] {
        assert!(n > 10, "too few {what} answered: {n}");
    }
    for (what, back) in [("leader", back_leader), ("follower", back_follower), ("all", back_all)] {
        assert!(back.is_some(), "no admission succeeded after the {what} kill\n{}", m.logs());
    }
    assert_eq!(used, present, "usage counts what exists, nothing twice");
}
