//! The edge killed (SIGKILL) at random points while a thousand container sandboxes are created
//! and some of them stopped, then started again, over and over (issue 16's crash test). The edge
//! is the real `opendsec edge --config F` process beside an in-process IAM, watcher and
//! apiserver; its records are the append-only log of `opendsec_edge::record`. When the
//! creations are over and reconciliation has run:
//!
//! - every sandbox whose creation was answered RUNNING, and that was not stopped, is RUNNING
//!   (re-adopted after each restart) and answers a command;
//! - what the edge lists (its records) is exactly what the host holds: cgroups, sandbox
//!   directories, loop devices and user namespace id claims, each by sandbox name: no orphan
//!   either way;
//! - IAM's usage of the project equals the live sandboxes (sandboxes and memory): no leaked
//!   quota and none lost;
//! - after stopping them all, usage is 0, the host holds nothing, and the record log (read
//!   with the edge dead) has no live record.
//!
//! The seed of the kill times is printed; `OPENDSEC_CRASH_SEED=n` replays one. Root only;
//! CI runs as root.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use opendsec_edge::backend::container::{name_tag, sandbox_name};
use opendsec_edge::linuxrt::{cgroup, idmap, rootfs};
use opendsec_proto::v1 as pb;
use opendsec_testkit::eventually;

const CREATIONS: u32 = 1000;
const IN_FLIGHT: usize = 16;
const MEMORY_MB: u64 = 64;

/// xorshift64*: enough for kill times, and replayable from its printed seed.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The edge process: started, killed and started again on the same address and state.
struct EdgeProcess {
    config: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    starts: u32,
}

impl EdgeProcess {
    fn start(&mut self) {
        assert!(self.child.is_none(), "the edge is already running");
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log).unwrap();
        let child = Command::new(env!("CARGO_BIN_EXE_opendsec"))
            .args(["edge", "--config", self.config.to_str().unwrap()])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        self.child = Some(child);
        self.starts += 1;
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.kill().unwrap();
            c.wait().unwrap();
        }
    }

    /// Whether the process has exited by itself (it never should).
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().ok().flatten())
    }

    fn tail(&self) -> String {
        let t = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = t.lines().rev().take(40).collect();
        lines.into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for EdgeProcess {
    fn drop(&mut self) {
        self.kill();
    }
}

/// What the host holds of the edge's container sandboxes, each by sandbox name.
#[derive(Debug, Default, PartialEq)]
struct Held {
    cgroups: BTreeSet<String>,
    dirs: BTreeSet<String>,
    loops: BTreeSet<String>,
    claims: BTreeSet<String>,
}

fn held(containers: &Path) -> Held {
    let tag = name_tag(containers);
    let mut h = Held { cgroups: cgroup::list(&tag).unwrap().into_iter().collect(), ..Default::default() };
    for e in std::fs::read_dir(containers).into_iter().flatten().flatten() {
        if let Some(n) = e.file_name().to_str().filter(|n| n.starts_with(&tag)) {
            h.dirs.insert(n.to_owned());
        }
    }
    for (_, backing) in rootfs::loops_under(containers) {
        let name = backing.strip_prefix(containers).ok().and_then(|p| p.components().next());
        h.loops.insert(name.map_or_else(|| backing.display().to_string(), |c| c.as_os_str().to_string_lossy().into()));
    }
    for e in std::fs::read_dir(idmap::CLAIMS_DIR).into_iter().flatten().flatten() {
        let owner = std::fs::read_to_string(e.path()).unwrap_or_default().lines().next().unwrap_or("").to_owned();
        if owner.starts_with(&tag) {
            h.claims.insert(owner);
        }
    }
    h
}

fn every(names: &BTreeSet<String>) -> Held {
    Held { cgroups: names.clone(), dirs: names.clone(), loops: names.clone(), claims: names.clone() }
}

/// What root's sandboxes hold (its leases: the store's bytes, which the test's images take,
/// are not the sandboxes').
async fn root_usage(admin: &opendsec_client::Client) -> pb::Usage {
    let u = admin.get_usage(pb::GetUsageRequest { project: "root".into() }).await.unwrap();
    u.projects
        .into_iter()
        .find(|p| p.path == "root")
        .and_then(|p| p.usage)
        .map(|u| pb::Usage { store_bytes: 0, ..u })
        .unwrap_or_default()
}

/// Every live sandbox the edge lists, by id (fails while the edge is not in the snapshot).
async fn live(admin: &opendsec_client::Client) -> BTreeMap<String, pb::Sandbox> {
    let all = admin.list_all_sandboxes(pb::ListSandboxesRequest { project: "root".into(), ..Default::default() });
    all.await.unwrap().into_iter().map(|s| (s.id.clone(), s)).collect()
}

/// Whether the watcher's snapshot has the edge healthy (the apiserver lists and places only
/// on those).
async fn edge_healthy(f: &Fixture) -> bool {
    let links = f.cluster.apiserver_links().unwrap();
    let Ok(ch) = links.channel(&f.cluster.config.watcher.addrs[0], opendsec_common::pki::Role::Watcher, None) else {
        return false;
    };
    let snap = pb::watcher_client::WatcherClient::new(ch).get_snapshot(pb::GetSnapshotRequest {}).await;
    snap.is_ok_and(|s| s.into_inner().edges.iter().any(|e| e.name == EDGE && e.healthy))
}

#[derive(Default)]
struct Outcomes {
    /// Answered RUNNING and left running.
    running: BTreeSet<String>,
    /// Answered RUNNING, then stopped (the stop answered STOPPED).
    stopped: BTreeSet<String>,
    /// Other answers: the state or the reason, with how many.
    other: BTreeMap<String, u32>,
    /// Every other answer, by sandbox id.
    answered: BTreeMap<String, String>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_edge_killed_during_a_thousand_creations_leaves_no_orphan_and_no_leaked_quota() {
    let f = fixture_edges(0, |c| {
        room_for_thousands(c);
        c.edge.backends = vec!["container".into()];
        // Reconciliation often enough for a test; old enough that a lease admitted a moment
        // ago is never taken for a leak while its creation is under way.
        c.iam.reconcile_min_age = Duration::from_secs(5);
        c.watcher.reconcile_interval = Duration::from_secs(1);
    })
    .await;
    let admin = f.admin.clone().with_retry_timeout(Duration::from_secs(90));
    let dir = f._dir.path().to_path_buf();

    // The edge's certificate from the cluster's CA, and its config: the cluster's, with this
    // edge's name and a fixed address (a restart listens where the last one did).
    let cfg = &f.cluster.config;
    let id = opendsec_common::pki::Identity { role: opendsec_common::pki::Role::Edge, name: EDGE.into() };
    opendsec_common::pki::local_pki(&cfg.pki_dir(), &[id], cfg.tls.leaf_lifetime).unwrap();
    let mut ecfg = cfg.clone();
    let addr = format!("127.0.0.1:{}", free_port());
    ecfg.edge.name = EDGE.into();
    ecfg.edge.listen = addr.clone();
    ecfg.edge.advertise = addr;
    ecfg.edges.clear();
    ecfg.sim_edges = 0;
    ecfg.iam.admin_token.clear();
    let config = dir.join("edge.json");
    std::fs::write(&config, serde_json::to_vec_pretty(&ecfg).unwrap()).unwrap();
    let edge = Arc::new(Mutex::new(EdgeProcess { config, log: dir.join("edge.log"), child: None, starts: 0 }));
    edge.lock().unwrap().start();
    eventually("the edge healthy in the watcher's snapshot", Duration::from_secs(60), || edge_healthy(&f)).await;

    let seed = std::env::var("OPENDSEC_CRASH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    }) | 1;
    println!("kill times from seed {seed} (OPENDSEC_CRASH_SEED={seed} replays them)");

    // The killer: SIGKILL at a random moment, the edge down for a random while, started again.
    let creating = Arc::new(AtomicBool::new(true));
    let killer = {
        let (edge, creating) = (edge.clone(), creating.clone());
        tokio::spawn(async move {
            let mut rng = Rng(seed);
            let mut kills = 0u32;
            while creating.load(Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(300 + rng.below(2200))).await;
                if !creating.load(Ordering::SeqCst) {
                    break;
                }
                {
                    let mut e = edge.lock().unwrap();
                    if let Some(st) = e.exited() {
                        panic!("the edge exited by itself ({st}):\n{}", e.tail());
                    }
                    e.kill();
                }
                kills += 1;
                tokio::time::sleep(Duration::from_millis(rng.below(400))).await;
                edge.lock().unwrap().start();
            }
            kills
        })
    };

    // The creations, IN_FLIGHT at a time; a quarter of what comes up RUNNING is stopped at once.
    let next = Arc::new(AtomicU32::new(0));
    let outcomes = Arc::new(Mutex::new(Outcomes::default()));
    let workers: Vec<_> = (0..IN_FLIGHT)
        .map(|w| {
            let (admin, next, outcomes) = (admin.clone(), next.clone(), outcomes.clone());
            let mut rng = Rng(seed.wrapping_add(w as u64 * 0x9E37_79B9) | 1);
            tokio::spawn(async move {
                while next.fetch_add(1, Ordering::SeqCst) < CREATIONS {
                    // Our own lease ids: what became of each is known by its sandbox id (the
                    // apiserver scopes a caller's key to its project). A `no_capacity` (no edge
                    // in the snapshot: it is down) made nothing: the same creation, anew.
                    let (id, answer) = loop {
                        let lease_id = opendsec_common::ids::new_lease_id();
                        let scoped = opendsec_apiserver::admission::scoped_lease_id("root", &lease_id);
                        let id = format!("{EDGE}.{scoped}");
                        let spec = Some(container_spec("busybox", MEMORY_MB, 32));
                        match admin.create_sandbox_with(pb::CreateSandboxRequest { spec, lease_id }).await {
                            Err(e) if e.reason == opendsec_common::Reason::NoCapacity => {
                                outcomes.lock().unwrap().answered.insert(id, e.reason.to_string());
                                tokio::time::sleep(Duration::from_millis(100)).await;
                            }
                            answer => break (id, answer),
                        }
                    };
                    let sb = match answer {
                        Ok(sb) => sb,
                        Err(e) => {
                            println!("creation of {id}: {e}");
                            let mut o = outcomes.lock().unwrap();
                            *o.other.entry(e.reason.to_string()).or_default() += 1;
                            o.answered.insert(id, e.reason.to_string());
                            continue;
                        }
                    };
                    assert_eq!(sb.id, id, "the answer to the creation of {id}: {sb:?}");
                    if state(&sb) != pb::SandboxState::Running {
                        let k = format!("{:?} {}", state(&sb), sb.end_reason);
                        let mut o = outcomes.lock().unwrap();
                        *o.other.entry(k.clone()).or_default() += 1;
                        o.answered.insert(sb.id, k);
                        continue;
                    }
                    if rng.below(4) == 0 {
                        let st = admin.stop_sandbox(&sb.id).await.unwrap_or_else(|e| panic!("stop {}: {e}", sb.id));
                        assert_eq!(state(&st), pb::SandboxState::Stopped, "{st:?}");
                        outcomes.lock().unwrap().stopped.insert(sb.id);
                    } else {
                        outcomes.lock().unwrap().running.insert(sb.id);
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    creating.store(false, Ordering::SeqCst);
    let kills = killer.await.unwrap();
    let outcomes = std::mem::take(&mut *outcomes.lock().unwrap());
    let starts = edge.lock().unwrap().starts;
    println!(
        "{CREATIONS} creations: {} running, {} stopped, other {:?}; the edge killed {kills} times, started {starts} times",
        outcomes.running.len(),
        outcomes.stopped.len(),
        outcomes.other
    );
    assert!(kills >= 3, "the edge was killed only {kills} times: the test did not test");
    {
        let mut e = edge.lock().unwrap();
        if e.child.is_none() {
            e.start();
        }
    }

    // Reconciliation: the edge's list, the host and IAM's usage agree.
    let containers = f.containers.clone();
    let mut last = String::new();
    let mut settled = None;
    for _ in 0..120 {
        if edge_healthy(&f).await {
            let listed = live(&admin).await;
            let names: BTreeSet<String> = listed.keys().map(|id| sandbox_name(&containers, id)).collect();
            let usage = root_usage(&admin).await;
            let on_host = held(&containers);
            let all_running = listed.values().all(|s| state(s) == pb::SandboxState::Running);
            if on_host == every(&names) && usage.sandboxes == listed.len() as u64 && all_running {
                settled = Some((listed, usage));
                break;
            }
            last = format!(
                "listed {} ({} not RUNNING), usage {usage:?}, host holds {} cgroups, {} dirs, {} loops, {} claims",
                listed.len(),
                listed.values().filter(|s| state(s) != pb::SandboxState::Running).count(),
                on_host.cgroups.len(),
                on_host.dirs.len(),
                on_host.loops.len(),
                on_host.claims.len()
            );
        } else {
            last = "the edge is not healthy".into();
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let tail = || edge.lock().unwrap().tail();
    let Some((listed, usage)) = settled else {
        let listed = live(&admin).await;
        let names: BTreeSet<String> = listed.keys().map(|id| sandbox_name(&containers, id)).collect();
        let on_host = held(&containers);
        let orphans: Vec<_> = on_host.cgroups.union(&on_host.dirs).filter(|n| !names.contains(*n)).collect();
        let missing: Vec<_> = names.iter().filter(|n| !on_host.cgroups.contains(*n)).collect();
        panic!(
            "not reconciled within a minute: {last}\norphans on the host: {orphans:?}\nlisted, not on the host: \
             {missing:?}\n{}",
            tail()
        );
    };
    println!("reconciled: {} live sandboxes, usage {usage:?}", listed.len());
    assert_eq!(usage.memory_mb, MEMORY_MB * listed.len() as u64, "{usage:?}");
    for id in &outcomes.running {
        assert!(listed.contains_key(id), "{id} was created RUNNING, never stopped, and is gone\n{}", tail());
    }
    for id in &outcomes.stopped {
        assert!(!listed.contains_key(id), "{id} was stopped and is listed: {:?}", listed[id]);
    }
    // A sandbox whose creation was answered with an error after every retry may exist (the
    // outcome is unknown to the caller: it is listed, counted and stopped like any other); one
    // answered FAILED or `no_capacity` ("nothing was made") must not.
    let unacked: Vec<(&String, &String)> =
        outcomes.answered.iter().filter(|(id, _)| listed.contains_key(*id)).collect();
    println!("live without a RUNNING answer: {unacked:?}");
    assert!(
        unacked.iter().all(|(_, how)| !how.starts_with("Failed") && *how != "no_capacity"),
        "answered as never made, yet live: {unacked:?}"
    );
    let unknown: Vec<&String> =
        listed.keys().filter(|id| !outcomes.running.contains(*id) && !outcomes.answered.contains_key(*id)).collect();
    if !unknown.is_empty() {
        let log = std::fs::read_to_string(dir.join("edge.log")).unwrap_or_default();
        let about: Vec<&str> = unknown
            .iter()
            .take(3)
            .flat_map(|id| log.lines().filter(move |l| l.contains(id.as_str())).take(6))
            .collect();
        panic!("live sandboxes nobody asked for: {unknown:?}\n{}", about.join("\n"));
    }
    // Answered RUNNING and kept across the restarts: they still work.
    let mut rt = runtime(&f.ca, &f.addr, &f.cluster.admin_token);
    for id in outcomes.running.iter().step_by((outcomes.running.len() / 20).max(1)) {
        assert_eq!(out(&exec_in(&mut rt, id, "after", "echo ok").await), "ok", "{id}");
    }

    // Stop everything: nothing left anywhere.
    let ids: Vec<String> = listed.keys().cloned().collect();
    let next = Arc::new(AtomicU32::new(0));
    let ids = Arc::new(ids);
    let stoppers: Vec<_> = (0..IN_FLIGHT)
        .map(|_| {
            let (admin, ids, next) = (admin.clone(), ids.clone(), next.clone());
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst) as usize;
                    let Some(id) = ids.get(i) else { break };
                    let st = admin.stop_sandbox(id).await.unwrap_or_else(|e| panic!("stop {id}: {e}"));
                    assert_eq!(state(&st), pb::SandboxState::Stopped, "{st:?}");
                }
            })
        })
        .collect();
    for s in stoppers {
        s.await.unwrap();
    }
    eventually("usage back to 0 and the host clean", Duration::from_secs(60), || async {
        root_usage(&admin).await == pb::Usage::default() && held(&containers) == Held::default()
    })
    .await;
    assert!(live(&admin).await.is_empty());
    edge.lock().unwrap().kill();
    let store = opendsec_edge::record::RecordStore::open(&cfg.edge_state_dir(EDGE)).unwrap();
    let (records, bad) = store.load_all().unwrap();
    assert!(bad.is_empty(), "records the log could not read: {bad:?}");
    let live_records: Vec<_> = records.iter().filter(|r| r.state.is_live()).map(|r| &r.id).collect();
    assert!(live_records.is_empty(), "records of live sandboxes after every one was stopped: {live_records:?}");
    drop(store);
    f.cluster.shutdown().await;
}
