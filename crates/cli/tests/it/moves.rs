//! Moving sandboxes between edges end to end, as root: two edges offering containers, a
//! busybox sandbox with a changed file system moved from one to the other while four callers
//! keep running commands in it (every call answered, every call's write found in the copy,
//! never two running copies), moved back, moved by the CLI; a move the target cannot take
//! leaves the original running where it was with its lease; and the refusals (unknown edge,
//! a backend that cannot move, a tenant without edge.manage, another tenant's sandbox); an edge
//! drained under load (`opendsecctl edge drain --move-to`) loses no sandbox.

use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::common::*;
use opendsec_common::Reason;
use opendsec_proto::v1 as pb;

const FINGERPRINT: &str = "cd / && find data etc tmp bin/cat -xdev 2>/dev/null | grep -vx -e etc/hosts -e data/log | sort | \
     while read -r p; do stat -c '%n|%A|%u|%g' \"$p\"; [ -f \"$p\" ] && md5sum < \"$p\"; done; readlink data/link";

fn other(edge: &str) -> String {
    if edge == EDGE { opendsec_cluster::edge_name(1) } else { EDGE.to_string() }
}

/// The container sandboxes of the edge whose containers live in `containers`, by cgroup.
fn held_by(containers: &std::path::Path) -> Vec<String> {
    let tag = opendsec_edge::backend::container::name_tag(containers);
    opendsec_edge::linuxrt::cgroup::list(&tag).unwrap_or_default()
}

fn containers_of(f: &Fixture, edge: &str) -> std::path::PathBuf {
    f.cluster.config.edge_state_dir(edge).join("containers")
}

async fn live_usage(admin: &opendsec_client::Client) -> u64 {
    let usage = admin.get_usage(pb::GetUsageRequest { project: "root".into() }).await.unwrap();
    usage.projects.iter().find(|p| p.path == "root").and_then(|p| p.usage).map(|u| u.sandboxes).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_moved_sandbox_keeps_its_id_files_and_calls() {
    let f = fixture_edges(2, |_| {}).await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    let sb = admin.create_sandbox(container_spec("busybox", 64, 256)).await.unwrap();
    let (from, to) = (sb.edge.clone(), other(&sb.edge));
    let setup = "mkdir -p /data && echo hello > /data/a && chown 1000:1001 /data/a && chmod 4750 /data/a && \
         ln -s a /data/link && rm /bin/cat && echo t > /tmp/t && \
         dd if=/dev/urandom of=/data/big bs=1M count=10 2>/dev/null && (sleep 1000 &)";
    assert_eq!(exec_in(&mut rt, &sb.id, "main", setup).await.exit_code, 0);
    let want = out(&exec_in(&mut rt, &sb.id, "fp", FINGERPRINT).await);
    assert!(want.contains("data/a|-rwsr-x---|1000|1001"), "{want}");
    let before = held_by(&containers_of(&f, &from));
    assert_eq!(before.len(), 1, "{before:?}");

    // Four callers append numbered lines while the sandbox moves. Every call must be
    // answered, and every answered call's line must be in the copy: calls in flight when the
    // move begins finish on the source before it is frozen and copied; later ones wait and
    // run in the copy.
    let stop = Arc::new(AtomicBool::new(false));
    let seq = Arc::new(AtomicU64::new(0));
    let mut callers = Vec::new();
    for c in 0..4 {
        let (mut rt, id, stop, seq) = (rt.clone(), sb.id.clone(), stop.clone(), seq.clone());
        callers.push(tokio::spawn(async move {
            let mut done = Vec::new();
            while !stop.load(Ordering::SeqCst) {
                let n = seq.fetch_add(1, Ordering::SeqCst);
                let req = pb::ExecRequest {
                    sandbox_id: id.clone(),
                    session_id: format!("caller-{c}"),
                    command: format!("echo {n} >> /data/log"),
                    timeout_ms: 60_000,
                    ..Default::default()
                };
                let r = rt.exec(req).await.unwrap_or_else(|e| panic!("call {n} during the move: {e:?}")).into_inner();
                assert_eq!(r.exit_code, 0, "{r:?}");
                done.push(n);
            }
            done
        }));
    }
    // And one uploader: each file written whole (one message), and answered, is in the copy.
    let uploader = {
        let (admin, id, stop) = (admin.clone(), sb.id.clone(), stop.clone());
        tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let first = pb::WriteFileRequest {
                    sandbox_id: id.clone(),
                    path: format!("/data/up/{n}"),
                    make_parents: true,
                    finish: true,
                    ..Default::default()
                };
                admin
                    .write_file_all(first, format!("upload {n}").as_bytes())
                    .await
                    .unwrap_or_else(|e| panic!("upload {n} during the move: {e:?}"));
                n += 1;
            }
            n
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let started = std::time::Instant::now();
    let moved = admin.move_sandbox(&sb.id, &to).await.unwrap();
    // A figure for people (not asserted): 10 MB written, four callers in flight.
    eprintln!("move under load: {} ms", started.elapsed().as_millis());
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    let mut answered: Vec<u64> = Vec::new();
    for c in callers {
        answered.extend(c.await.unwrap());
    }
    let uploads = uploader.await.unwrap();
    assert_eq!((moved.id.as_str(), moved.edge.as_str()), (sb.id.as_str(), to.as_str()));
    assert_eq!(state(&moved), pb::SandboxState::Running);

    let got = admin.get_sandbox(&sb.id).await.unwrap();
    assert_eq!(got.edge, to);
    let mut logged: Vec<u64> =
        out(&exec_in(&mut rt, &sb.id, "check", "cat /data/log").await).lines().map(|l| l.parse().unwrap()).collect();
    logged.sort_unstable();
    answered.sort_unstable();
    assert!(answered.len() > 8, "the callers ran through the move: {answered:?}");
    assert_eq!(logged, answered, "every answered call's write is in the copy, once");
    let listed =
        out(&exec_in(&mut rt, &sb.id, "check", "cd /data/up && for f in *; do echo \"$f $(cat $f)\"; done").await);
    let want_up: Vec<String> = (0..uploads).map(|n| format!("{n} upload {n}")).collect();
    let mut got_up: Vec<String> = listed.lines().map(str::to_string).collect();
    got_up.sort_by_key(|l| l.split(' ').next().unwrap().parse::<u64>().unwrap());
    assert!(uploads > 2, "the uploader ran through the move: {uploads}");
    assert_eq!(got_up, want_up, "every answered upload is in the copy");
    let _ = exec_in(&mut rt, &sb.id, "check", "rm -r /data/up").await;

    // The file system came along, /tmp included; the processes did not (containers).
    assert_eq!(out(&exec_in(&mut rt, &sb.id, "fp", FINGERPRINT).await), want);
    let ps = exec_in(&mut rt, &sb.id, "ps", "ps -o args | grep -c '[s]leep 1000' || true").await;
    assert_eq!(out(&ps), "0");
    let id_inside = exec_in(&mut rt, &sb.id, "id", "cat /run/opendsec/sandbox-id; echo $OPENDSEC_SANDBOX_ID").await;
    assert_eq!(out(&id_inside), format!("{}\n{}", sb.id, sb.id));

    // One copy runs, on the target; the original's container is gone from its host.
    assert!(held_by(&containers_of(&f, &from)).is_empty(), "the original still holds a container");
    assert_eq!(held_by(&containers_of(&f, &to)).len(), 1);
    let listed = admin
        .list_sandboxes(pb::ListSandboxesRequest { project: "root".into(), ..Default::default() })
        .await
        .unwrap()
        .sandboxes;
    assert_eq!(listed.iter().filter(|x| x.id == sb.id).count(), 1, "{listed:?}");
    assert_eq!(listed.iter().find(|x| x.id == sb.id).unwrap().edge, to);
    assert_eq!(live_usage(&admin).await, 1, "one lease, charged once");

    // Moved again, by the CLI, back to where it was created (its old record there goes), and
    // asked again for the edge it is on (answered as it is).
    let started = std::time::Instant::now();
    common::ctl_admin(&f.cluster, &["move", &sb.id, "--to", &from]).await.unwrap();
    eprintln!("move, quiet: {} ms", started.elapsed().as_millis());
    let back = admin.move_sandbox(&sb.id, &from).await.unwrap();
    assert_eq!(back.edge, from);
    assert!(out(&exec_in(&mut rt, &sb.id, "check", "wc -l < /data/log").await).parse::<usize>().unwrap() > 8);
    assert!(held_by(&containers_of(&f, &to)).is_empty());
    assert_eq!(held_by(&containers_of(&f, &from)).len(), 1);

    // Its lease follows it: stopping it frees the quota, nothing stays behind.
    let stopped = admin.stop_sandbox(&sb.id).await.unwrap();
    assert_eq!(state(&stopped), pb::SandboxState::Stopped);
    opendsec_testkit::eventually("the lease released", Duration::from_secs(10), || async {
        live_usage(&admin).await == 0
    })
    .await;
    assert!(held_by(&containers_of(&f, &from)).is_empty() && held_by(&containers_of(&f, &to)).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_move_the_target_cannot_take_leaves_the_sandbox_where_it_was() {
    // Three sandboxes per edge: the target is filled with sim sandboxes first.
    let f = fixture_edges(2, |c| c.edge.max_sandboxes = 3).await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    let sb = admin.create_sandbox(container_spec("busybox", 32, 64)).await.unwrap();
    let to = other(&sb.edge);
    exec_in(&mut rt, &sb.id, "main", "echo kept > /kept").await;
    let sim = pb::SandboxSpec {
        project: "root".into(),
        backend: "sim".into(),
        image: "scratch".into(),
        resources: Some(pb::Resources { cpu_millis: 10, memory_mb: 1, disk_mb: 0, gpus: 0 }),
        ..Default::default()
    };
    let mut sims = Vec::new();
    for _ in 0..5 {
        sims.push(admin.create_sandbox(sim.clone()).await.unwrap());
    }
    assert_eq!(sims.iter().filter(|s| s.edge == to).count(), 3, "the target is full");

    let e = admin.move_sandbox(&sb.id, &to).await.unwrap_err();
    assert_eq!(e.reason, Reason::NoCapacity, "{e}");
    let got = admin.get_sandbox(&sb.id).await.unwrap();
    assert_eq!((got.edge.as_str(), state(&got)), (sb.edge.as_str(), pb::SandboxState::Running));
    // It runs (not left frozen), and keeps what it had.
    assert_eq!(out(&exec_in(&mut rt, &sb.id, "main", "cat /kept").await), "kept");
    assert_eq!(freezer_state_of(&f, &sb), "THAWED");

    // The lease is bound where it runs: stopping it there releases it.
    for s in &sims {
        admin.stop_sandbox(&s.id).await.unwrap();
    }
    admin.stop_sandbox(&sb.id).await.unwrap();
    opendsec_testkit::eventually("the leases released", Duration::from_secs(10), || async {
        live_usage(&admin).await == 0
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn moves_are_refused_clearly() {
    let f = fixture_edges(2, |_| {}).await;
    let admin = f.admin.clone();
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let sb = admin.create_sandbox(container_spec("busybox", 32, 64)).await.unwrap();
    let to = other(&sb.edge);

    let e = admin.move_sandbox(&sb.id, "no-such-edge").await.unwrap_err();
    assert_eq!(e.reason, Reason::NotFound, "{e}");
    let e = admin.move_sandbox(&sb.id, "Bad Edge!").await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument, "{e}");
    let e = admin.move_sandbox("nonsense", &to).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument, "{e}");
    let same = admin.move_sandbox(&sb.id, &sb.edge).await.unwrap();
    assert_eq!(same.edge, sb.edge);

    // A backend without a file system to copy.
    let sim = admin
        .create_sandbox(pb::SandboxSpec {
            project: "root".into(),
            backend: "sim".into(),
            image: "scratch".into(),
            resources: Some(pb::Resources { cpu_millis: 10, memory_mb: 1, disk_mb: 0, gpus: 0 }),
            ..Default::default()
        })
        .await
        .unwrap();
    let e = admin.move_sandbox(&sim.id, &other(&sim.edge)).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument, "{e}");
    assert_eq!(state(&admin.get_sandbox(&sim.id).await.unwrap()), pb::SandboxState::Running);

    // A tenant who may operate its sandboxes but not manage edges, and another tenant.
    admin.create_project(pb::CreateProjectRequest { path: "root/t".into(), quota: None }).await.unwrap();
    let tok = principal(&admin, "tess", "root/t", &["sandbox.create", "sandbox.operate", "sandbox.view"]).await;
    let grant = pb::Grant { principal: "tess".into(), project: "root".into(), permission: "layer.use".into() };
    admin.grant(pb::GrantRequest { grant: Some(grant) }).await.unwrap();
    let tess =
        opendsec_client::Client::new(std::slice::from_ref(&f.addr), Some(&tok), &f.cluster.client_tls()).unwrap();
    let own = tess
        .create_sandbox(pb::SandboxSpec { project: "root/t".into(), ..container_spec("busybox", 32, 64) })
        .await
        .unwrap();
    let e = tess.move_sandbox(&own.id, &other(&own.edge)).await.unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied, "{e}");
    let e = tess.move_sandbox(&sb.id, &to).await.unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied, "{e}");
    // Nothing was frozen by the refusals.
    assert_eq!(exec_in(&mut rt, &sb.id, "main", "true").await.exit_code, 0);
    assert_eq!(exec_in(&mut rt, &own.id, "main", "true").await.exit_code, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_moves_of_one_sandbox_at_once_leave_one_copy() {
    let f = fixture_edges(2, |_| {}).await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    let sb = admin.create_sandbox(container_spec("busybox", 32, 64)).await.unwrap();
    let (from, to) = (sb.edge.clone(), other(&sb.edge));
    exec_in(&mut rt, &sb.id, "main", "echo kept > /kept").await;

    // A move has one driver: the second MoveOut is refused while the first holds the
    // sandbox (the client may ask again and find it moved: answered as it is). Without that,
    // the second driver's copy would fail on the target and thaw the original beside the
    // first's copy.
    let (a, b) = tokio::join!(admin.move_sandbox(&sb.id, &to), admin.move_sandbox(&sb.id, &to));
    let answers = [a, b];
    assert!(answers.iter().any(Result::is_ok), "{answers:?}");
    for r in &answers {
        match r {
            Ok(m) => assert_eq!(m.edge, to),
            Err(e) => assert!(matches!(e.reason, Reason::Unavailable | Reason::InvalidArgument), "{e}"),
        }
    }
    assert!(held_by(&containers_of(&f, &from)).is_empty(), "the original still runs");
    assert_eq!(held_by(&containers_of(&f, &to)).len(), 1, "one copy");
    assert_eq!(out(&exec_in(&mut rt, &sb.id, "main", "cat /kept").await), "kept");
    assert_eq!(admin.get_sandbox(&sb.id).await.unwrap().edge, to);
    assert_eq!(live_usage(&admin).await, 1);
}

/// Drives a move's steps as the apiserver does, stopping where a dying apiserver would.
struct Driver {
    links: std::sync::Arc<opendsec_common::grpc::Links>,
    addrs: std::collections::HashMap<String, String>,
    iam: String,
    token: String,
}

impl Driver {
    fn new(f: &Fixture) -> Driver {
        let c = &f.cluster;
        let addrs = c.edge_names().into_iter().map(|n| (n.clone(), c.edge_addr(&n).unwrap().to_string())).collect();
        Driver {
            links: c.apiserver_links().unwrap(),
            addrs,
            iam: c.config.iam.addrs[0].clone(),
            token: c.admin_token.clone(),
        }
    }

    fn edge(&self, name: &str) -> pb::edge_client::EdgeClient<tonic::transport::Channel> {
        let ch = self.links.channel(&self.addrs[name], opendsec_common::pki::Role::Edge, Some(name)).unwrap();
        pb::edge_client::EdgeClient::new(ch)
    }

    fn req<Q>(q: Q) -> tonic::Request<Q> {
        let mut r = tonic::Request::new(q);
        r.metadata_mut().insert(opendsec_common::grpc::EXPECT_PROJECT_HEADER, "root".parse().unwrap());
        r
    }

    async fn move_out(&self, id: &str, from: &str, to: &str) -> pb::EdgeMoveOut {
        let q = pb::EdgeMoveOutRequest { id: id.into(), to_edge: to.into() };
        self.edge(from).move_out(Self::req(q)).await.unwrap().into_inner()
    }

    async fn rebind(&self, out: &pb::EdgeMoveOut, to: &str) {
        let spec = out.spec.clone().unwrap();
        let ch = self.links.channel(&self.iam, opendsec_common::pki::Role::Iam, None).unwrap();
        let a = pb::iam_client::IamClient::new(ch)
            .admit(pb::AdmitRequest {
                token: self.token.clone(),
                lease_id: out.lease_id.clone(),
                project: spec.project.clone(),
                resources: spec.resources,
                edge: to.into(),
                keep_existing: false,
                egress: Vec::new(),
                pool: String::new(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(a.edge, to, "{a:?}");
    }

    async fn create_copy(&self, out: &pb::EdgeMoveOut, to: &str) -> pb::Sandbox {
        let q = pb::EdgeCreateRequest {
            lease_id: out.lease_id.clone(),
            spec: out.spec.clone(),
            principal: out.principal.clone(),
            pool_revision: String::new(),
            moved_in: out.moved_in.clone(),
            member_lease: String::new(),
        };
        self.edge(to).create_sandbox(Self::req(q)).await.unwrap().into_inner()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_move_its_apiserver_abandoned_is_settled_by_the_source_after_a_restart() {
    // Settled after 4 s here (10 min by default); IAM's reconciliation runs well inside that,
    // as the configuration demands.
    let mut f = fixture_edges(2, |c| {
        c.edge.move_stale = Duration::from_secs(4);
        c.iam.reconcile_min_age = Duration::from_millis(500);
        c.watcher.reconcile_interval = Duration::from_millis(500);
    })
    .await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    let driver = Driver::new(&f);
    let mut sbs = Vec::new();
    while sbs.len() < 3 {
        // All three on one edge: the source.
        let sb = admin.create_sandbox(container_spec("busybox", 32, 64)).await.unwrap();
        if sbs.first().is_none_or(|s: &pb::Sandbox| s.edge == sb.edge) {
            exec_in(&mut rt, &sb.id, "main", &format!("echo {} > /kept", sb.id)).await;
            sbs.push(sb);
        } else {
            admin.stop_sandbox(&sb.id).await.unwrap();
        }
    }
    let (from, to) = (sbs[0].edge.clone(), other(&sbs[0].edge));
    // The apiserver died: 0 after the source froze and copied it; 1 after the lease was bound
    // to the target too; 2 after the copy started there as well.
    let mut outs = Vec::new();
    for sb in &sbs {
        outs.push(driver.move_out(&sb.id, &from, &to).await);
    }
    driver.rebind(&outs[1], &to).await;
    driver.rebind(&outs[2], &to).await;
    let copy = driver.create_copy(&outs[2], &to).await;
    assert_eq!(state(&copy), pb::SandboxState::Running);
    // Nobody drives them on: no second driver may take a move up.
    let q = pb::EdgeMoveOutRequest { id: sbs[0].id.clone(), to_edge: to.clone() };
    let e = driver.edge(&from).move_out(Driver::req(q)).await.unwrap_err();
    let e = opendsec_common::ApiError::from_status(&e);
    assert_eq!((e.reason, e.metadata.get("moving_to")), (Reason::Unavailable, Some(&to)), "{e}");
    assert_eq!(held_by(&containers_of(&f, &from)).len(), 3);
    for sb in &sbs {
        assert_eq!(freezer_state_of(&f, sb), "FROZEN", "frozen while moving");
    }

    // The source edge restarts in the middle of it all; the intents are durable.
    f.cluster.stop_edge(&from).await.unwrap();
    f.cluster.start_edge(&from).await.unwrap();
    // A call made now waits for the settlement and lands where the sandbox runs.
    let waiting = {
        let (mut rt, id) = (rt.clone(), sbs[2].id.clone());
        tokio::spawn(async move { out(&exec_in(&mut rt, &id, "main", "cat /kept").await) })
    };

    // 0 and 1: the copy never ran; the originals run on, thawed, with their files.
    for sb in &sbs[..2] {
        opendsec_testkit::eventually("the original runs on", Duration::from_secs(60), || async {
            admin.get_sandbox(&sb.id).await.is_ok_and(|g| g.edge == from && state(&g) == pb::SandboxState::Running)
                && freezer_state_of(&f, sb) == "THAWED"
        })
        .await;
        assert_eq!(out(&exec_in(&mut rt, &sb.id, "main", "cat /kept").await), sb.id);
    }
    // 2: the copy runs on the target, the original is stopped.
    assert_eq!(waiting.await.unwrap(), sbs[2].id);
    let got = admin.get_sandbox(&sbs[2].id).await.unwrap();
    assert_eq!((got.edge.as_str(), state(&got)), (to.as_str(), pb::SandboxState::Running));
    opendsec_testkit::eventually("the original of the copy stopped", Duration::from_secs(30), || async {
        held_by(&containers_of(&f, &from)).len() == 2
    })
    .await;
    assert_eq!(held_by(&containers_of(&f, &to)).len(), 1);
    // Every lease bound where its sandbox runs, charged once (the one released while its
    // copy did not exist is adopted again).
    opendsec_testkit::eventually("three leases", Duration::from_secs(30), || async { live_usage(&admin).await == 3 })
        .await;
    for sb in &sbs {
        admin.stop_sandbox(&sb.id).await.unwrap();
    }
    opendsec_testkit::eventually("the leases released", Duration::from_secs(30), || async {
        live_usage(&admin).await == 0
    })
    .await;
    assert!(held_by(&containers_of(&f, &from)).is_empty() && held_by(&containers_of(&f, &to)).is_empty());
}

/// `opendsecctl edge drain` under load: while callers keep creating and stopping sandboxes,
/// edge A is drained with its sandboxes moved to B. Every sandbox it held runs on B under the
/// same id with its files, nothing runs on A any more, no creation failed and none made after
/// the drain landed on A; the mark survives A's restart; undrained, A takes sandboxes again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_edge_drained_under_load_loses_no_sandbox() {
    // The watchers give up an edge that stays away 2 s (reconciled as empty: its leases go).
    let mut f = fixture_edges(2, |c| {
        c.watcher.lost_edge_grace = Duration::from_secs(2);
        c.watcher.reconcile_interval = Duration::from_millis(500);
        c.iam.reconcile_min_age = Duration::from_millis(500);
    })
    .await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    // A: where placement puts the first sandbox.
    let first = admin.create_sandbox(container_spec("busybox", 64, 256)).await.unwrap();
    let a = first.edge.clone();
    let b = other(&a);
    admin.stop_sandbox(&first.id).await.unwrap();

    // Sandboxes, each with a file of its own, three of them on A. Placement spreads them, but
    // a host under load can keep it off A for a while (a pressure mark, a refusal's penalty):
    // what placement did not put on A is moved there, so the test does not hang on its choice.
    let mut on_a = Vec::new();
    let mut elsewhere = Vec::new();
    for _ in 0..8 {
        let sb = admin.create_sandbox(container_spec("busybox", 64, 256)).await.unwrap();
        assert_eq!(
            exec_in(&mut rt, &sb.id, "main", &format!("mkdir -p /data && echo {} > /data/me", sb.id)).await.exit_code,
            0
        );
        if sb.edge == a {
            on_a.push(sb.id);
        } else {
            elsewhere.push(sb.id);
        }
        if on_a.len() == 3 {
            break;
        }
    }
    while on_a.len() < 3 {
        let id = elsewhere.pop().expect("eight sandboxes made");
        assert_eq!(admin.move_sandbox(&id, &a).await.unwrap().edge, a);
        on_a.push(id);
    }

    // The load: creations (and stops) go on throughout; every one must succeed.
    let stop = Arc::new(AtomicBool::new(false));
    let drained_at = Arc::new(AtomicU64::new(0));
    let t0 = std::time::Instant::now();
    let load = {
        let (admin, stop, drained_at) = (admin.clone(), stop.clone(), drained_at.clone());
        let a = a.clone();
        tokio::spawn(async move {
            let mut after_drain_on_a = Vec::new();
            let mut made = 0;
            while !stop.load(Ordering::Relaxed) {
                let started = t0.elapsed().as_millis() as u64;
                let sb = admin
                    .create_sandbox(container_spec("busybox", 64, 256))
                    .await
                    .expect("a creation during the drain");
                let d = drained_at.load(Ordering::Relaxed);
                if d != 0 && started > d + 1000 && sb.edge == a {
                    after_drain_on_a.push(sb.id.clone());
                }
                admin.stop_sandbox(&sb.id).await.expect("a stop during the drain");
                made += 1;
            }
            (made, after_drain_on_a)
        })
    };

    ctl_admin(&f.cluster, &["edge", "drain", &a, "--move-to", &b, "--timeout", "5m"]).await.expect("the drain");
    drained_at.store(t0.elapsed().as_millis() as u64, Ordering::Relaxed);
    // Creations placed after the drain finished (the snapshot has long said so by then).
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    let (made, after_drain_on_a) = load.await.unwrap();
    assert!(made > 0);
    assert!(after_drain_on_a.is_empty(), "placed on the drained edge: {after_drain_on_a:?}");

    // Nothing runs on A; everything it held runs on B, the same ids, the same files.
    assert!(held_by(&containers_of(&f, &a)).is_empty(), "{:?}", held_by(&containers_of(&f, &a)));
    for id in &on_a {
        let sb = admin.get_sandbox(id).await.unwrap();
        assert_eq!(sb.edge, b, "{id}");
        assert_eq!(state(&sb), pb::SandboxState::Running, "{id}");
        assert_eq!(out(&exec_in(&mut rt, id, "check", "cat /data/me").await), *id);
    }
    let st = admin.edge_drain_status(&a).await.unwrap();
    assert!(st.draining && st.sandboxes == 0, "{st:?}");

    // The mark is the edge's own, kept across its restart (asked without setting it).
    f.cluster.stop_edge(&a).await.unwrap();
    f.cluster.start_edge(&a).await.unwrap();
    opendsec_testkit::eventually("the restarted edge answers", Duration::from_secs(30), || {
        let admin = admin.clone();
        let a = a.clone();
        async move { admin.edge_drain_status(&a).await.is_ok() }
    })
    .await;
    let st = admin.edge_drain_status(&a).await.unwrap();
    assert!(st.draining, "the drain was forgotten across the restart: {st:?}");
    // A move onto it is refused before anything is frozen; the sandbox runs on where it was.
    let e = admin.move_sandbox(&on_a[0], &a).await.unwrap_err();
    assert_eq!(e.reason, Reason::NoCapacity, "{e:?}");
    assert_eq!(out(&exec_in(&mut rt, &on_a[0], "check", "cat /data/me").await), on_a[0]);
    assert_eq!(admin.get_sandbox(&on_a[0]).await.unwrap().edge, b);
    // Draining the target itself is refused by the CLI.
    assert!(ctl_admin(&f.cluster, &["edge", "drain", &b, "--move-to", &b]).await.is_err());

    // A tenant without edge.manage may not drain.
    admin.create_project(pb::CreateProjectRequest { path: "root/t".into(), quota: None }).await.unwrap();
    let tok = principal(&admin, "tess", "root/t", &["sandbox.create", "sandbox.operate", "sandbox.view"]).await;
    let tenant =
        opendsec_client::Client::new(std::slice::from_ref(&f.addr), Some(&tok), &f.cluster.client_tls()).unwrap();
    let e = tenant.drain_edge(&b, false).await.unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied, "{e:?}");
    // An unknown edge is not found.
    assert_eq!(admin.drain_edge("no-such-edge", false).await.unwrap_err().reason, Reason::NotFound);

    // Undrained, A takes sandboxes again.
    ctl_admin(&f.cluster, &["edge", "drain", &a, "--undrain"]).await.unwrap();
    let mut back = None;
    for _ in 0..100 {
        let sb = admin.create_sandbox(container_spec("busybox", 64, 256)).await.unwrap();
        let on = sb.edge.clone();
        admin.stop_sandbox(&sb.id).await.unwrap();
        if on == a {
            back = Some(sb.id);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(back.is_some(), "no creation reached {a} after the undrain");

    // Taken out for good: drained again (nothing left to move), stopped and never started.
    // Once the watchers have given it up and reconciled it as empty, nothing it held is lost:
    // the sandboxes that moved off it still run on B with their files and their quota.
    ctl_admin(&f.cluster, &["edge", "drain", &a, "--move-to", &b, "--timeout", "1m"]).await.expect("the second drain");
    // What runs now: the sandboxes moved off A and those placed on B at the start, all on B;
    // the stops above release their leases as the edges report them.
    let running = |admin: opendsec_client::Client| async move {
        let mut ids: Vec<(String, String)> =
            admin.list_all_sandboxes(Default::default()).await.unwrap().into_iter().map(|s| (s.id, s.edge)).collect();
        ids.sort();
        ids
    };
    let before = running(admin.clone()).await;
    assert!(before.iter().all(|(_, edge)| *edge == b), "{before:?}");
    assert!(on_a.iter().all(|id| before.iter().any(|(x, _)| x == id)), "{before:?}");
    opendsec_testkit::eventually("usage is what runs", Duration::from_secs(30), || {
        let admin = admin.clone();
        let want = before.len() as u64;
        async move { live_usage(&admin).await == want }
    })
    .await;
    f.cluster.stop_edge(&a).await.unwrap();
    opendsec_testkit::eventually("the stopped edge is gone", Duration::from_secs(30), || {
        let admin = admin.clone();
        let a = a.clone();
        async move { admin.edge_drain_status(&a).await.is_err() }
    })
    .await;
    // Past the grace and a few reconciliation rounds.
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert_eq!(running(admin.clone()).await, before, "sandboxes lost with the removed edge");
    assert_eq!(live_usage(&admin).await, before.len() as u64, "leases lost with the removed edge");
    for id in &on_a {
        let sb = admin.get_sandbox(id).await.unwrap();
        assert_eq!((sb.edge.as_str(), state(&sb)), (b.as_str(), pb::SandboxState::Running), "{id}");
        assert_eq!(out(&exec_in(&mut rt, id, "check", "cat /data/me").await), *id);
    }
    for _ in 0..5 {
        let sb = admin.create_sandbox(container_spec("busybox", 64, 256)).await.expect("a creation after the removal");
        assert_eq!(sb.edge, b);
        admin.stop_sandbox(&sb.id).await.unwrap();
    }
    for id in &on_a {
        admin.stop_sandbox(id).await.unwrap();
    }
}
