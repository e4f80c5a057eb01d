//! Warm pools end to end, as root: an edge offering `fncall` starts members of a pool ahead of
//! time; a creation naming the pool takes one and gets its own id, hostname, env, labels and
//! limits inside; a template change never hands out a member of the old template and replaces
//! only idle members; a restarted edge keeps its members; an idle member whose agent dies is
//! replaced, never handed out; a `fncall` spec matching a pool's template takes its member; a
//! pool without idle members falls back to a cold creation, counted; and the refusals (another tenant, a contradicting spec, a
//! pool over its project's quota, an unknown pool).

use std::time::Duration;

use crate::common::*;
use opendsec_common::Reason;
use opendsec_proto::v1 as pb;

fn pools_config(c: &mut opendsec_common::config::Config) {
    c.edge.backends = vec!["sim".into(), "container".into(), "fncall".into()];
    c.edge.pool_refresh = Duration::from_millis(200);
}

fn pool(name: &str, size: u32, env: &[(&str, &str)]) -> pb::Pool {
    pb::Pool {
        project: "root".into(),
        name: name.into(),
        template: Some(pb::PoolTemplate {
            image: "busybox:latest".into(),
            backend: "fncall".into(),
            resources: Some(pb::Resources { cpu_millis: 500, memory_mb: 96, disk_mb: 64, gpus: 0 }),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..Default::default()
        }),
        size_per_edge: size,
        ..Default::default()
    }
}

/// The pool on the fixture's edge, as GetPool shows it.
async fn on_edge(admin: &opendsec_client::Client, name: &str) -> pb::PoolStatus {
    let p = admin.get_pool(pb::GetPoolRequest { project: "root".into(), name: name.into() }).await.unwrap();
    p.edges.into_iter().find(|e| e.edge == EDGE).unwrap_or_default()
}

/// Waits until the pool on the edge satisfies `ok`.
async fn wait_pool(admin: &opendsec_client::Client, name: &str, what: &str, ok: impl Fn(&pb::PoolStatus) -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let s = on_edge(admin, name).await;
        if ok(&s) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "pool {name}: {what} never happened; last {s:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The host pid of the agent (PID 1) of the container named `dir`: the oldest process of
/// its cgroup running the agent.
fn pid1_of(dir: &str) -> Option<i32> {
    let mut pids: Vec<i32> = std::fs::read_dir("/proc")
        .ok()?
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| {
            let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap_or_default();
            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            cg.contains(dir) && String::from_utf8_lossy(&cmd).contains("aether")
        })
        .collect();
    pids.sort();
    pids.first().copied()
}

async fn until_async<F: std::future::Future<Output = bool>>(check: impl Fn() -> F) {
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    while !check().await {
        assert!(std::time::Instant::now() < deadline, "never happened");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn claim(name: &str) -> pb::SandboxSpec {
    pb::SandboxSpec { pool: name.into(), ..Default::default() }
}

/// Member containers (idle, starting or claimed) under the edge's container directory.
fn member_dirs(f: &Fixture) -> usize {
    std::fs::read_dir(&f.containers)
        .map(|rd| rd.flatten().filter(|e| e.file_name().to_string_lossy().contains(".pm-")).count())
        .unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claimed_member_is_the_sandbox_with_its_own_identity() {
    let f = fixture_with(pools_config).await;
    let admin = f.admin.clone();
    admin.create_pool(pb::CreatePoolRequest { pool: Some(pool("warm", 2, &[("A", "1"), ("B", "1")])) }).await.unwrap();
    wait_pool(&admin, "warm", "two idle members", |s| s.idle == 2).await;
    assert_eq!(member_dirs(&f), 2);

    let mut spec = claim("warm");
    spec.env = [("B".to_string(), "2".to_string())].into();
    spec.labels = [("job".to_string(), "rl".to_string())].into();
    spec.ttl_max_s = 600;
    let sb = admin.create_sandbox(spec).await.unwrap();
    let sp = sb.spec.clone().unwrap();
    assert_eq!((sp.image.as_str(), sp.backend.as_str(), sp.pool.as_str()), ("busybox:latest", "fncall", "warm"));
    assert_eq!(sp.labels["job"], "rl");
    assert_eq!(sp.resources.unwrap().memory_mb, 96);
    // (The pool's state comes with the cluster snapshot: a moment late.)
    wait_pool(&admin, "warm", "the claim counted", |s| s.claims == 1).await;
    assert_eq!(on_edge(&admin, "warm").await.misses, 0, "taken from the pool");

    // Inside: its own id (env and file), hostname, the template's env under the spec's.
    let mut rt = runtime(&f.ca, &f.addr, &f.cluster.admin_token);
    let r =
        exec_in(&mut rt, &sb.id, "s", "echo $OPENDSEC_SANDBOX_ID $A $B; cat /run/opendsec/sandbox-id; hostname").await;
    let lease = sb.id.split_once('.').unwrap().1;
    assert_eq!(out(&r), format!("{} 1 2\n{}\n{lease}", sb.id, sb.id), "{r:?}");
    // A process started through the process API sees it too.
    let m = admin.get_sandbox_metrics(&sb.id).await.unwrap();
    assert_eq!(m.memory_limit_bytes, 96 << 20, "the sandbox's limits");

    // The pool refills; the claimed member is the sandbox's now, not the pool's.
    wait_pool(&admin, "warm", "refilled", |s| s.idle == 2).await;
    assert_eq!(member_dirs(&f), 3);
    // The sandbox lives and stops like any other; stopping it removes its container.
    admin.stop_sandbox(&sb.id).await.unwrap();
    until("the claimed member's container is gone", Duration::from_secs(30), || member_dirs(&f) == 2).await;

    // A cold sandbox is told its id too.
    let cold = admin.create_sandbox(container_spec("busybox", 64, 64)).await.unwrap();
    let r = exec_in(&mut rt, &cold.id, "s", "echo $OPENDSEC_SANDBOX_ID; cat /run/opendsec/sandbox-id").await;
    assert_eq!(out(&r), format!("{}\n{}", cold.id, cold.id));

    // A batch naming the pool takes members too (and goes cold for the rest).
    let mut batch = admin.create_sandboxes(claim("warm"), 3).await.unwrap();
    let mut ids = Vec::new();
    while let Some(item) = batch.message().await.unwrap() {
        ids.push(item.sandbox.expect("every item made").id);
    }
    assert_eq!(ids.len(), 3);
    for id in &ids {
        let r = exec_in(&mut rt, id, "s", "echo $OPENDSEC_SANDBOX_ID").await;
        assert_eq!(out(&r), *id);
    }
    wait_pool(&admin, "warm", "the batch counted", |s| s.claims + s.misses == 4).await;
    let s = on_edge(&admin, "warm").await;
    assert!(s.claims >= 2, "the two idle members were taken: {s:?}");
    let claimed_in_batch = (s.claims - 1) as usize;

    // Deleting the pool stops its idle members; claimed ones run on.
    admin.delete_pool(pb::DeletePoolRequest { project: "root".into(), name: "warm".into() }).await.unwrap();
    until("idle members are gone", Duration::from_secs(30), || member_dirs(&f) == claimed_in_batch).await;
    for id in &ids {
        assert_eq!(state(&admin.get_sandbox(id).await.unwrap()), pb::SandboxState::Running);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rollout_never_hands_out_a_stale_member_and_busy_ones_run_on() {
    let f = fixture_with(pools_config).await;
    let admin = f.admin.clone();
    let mut rt = runtime(&f.ca, &f.addr, &f.cluster.admin_token);
    admin.create_pool(pb::CreatePoolRequest { pool: Some(pool("roll", 2, &[("REV", "1")])) }).await.unwrap();
    wait_pool(&admin, "roll", "two idle members", |s| s.idle == 2).await;
    let busy = admin.create_sandbox(claim("roll")).await.unwrap();
    assert_eq!(out(&exec_in(&mut rt, &busy.id, "s", "echo $REV").await), "1");
    wait_pool(&admin, "roll", "the claim counted", |s| s.claims == 1).await;
    wait_pool(&admin, "roll", "refilled", |s| s.idle == 2).await;
    let old_revision = on_edge(&admin, "roll").await.revision;

    // A new template: from the very next creation on, nobody gets a member of the old one,
    // whether or not the edge has heard of the change yet (the apiserver names the revision
    // IAM gave it; the edge hands out only that one).
    let updated =
        admin.update_pool(pb::UpdatePoolRequest { pool: Some(pool("roll", 2, &[("REV", "2")])) }).await.unwrap();
    assert_ne!(updated.revision, old_revision);
    for _ in 0..6 {
        let sb = admin.create_sandbox(claim("roll")).await.unwrap();
        assert_eq!(out(&exec_in(&mut rt, &sb.id, "s", "echo $REV").await), "2", "a stale member was handed out");
        admin.stop_sandbox(&sb.id).await.unwrap();
    }
    // Idle members of the old revision are replaced; the busy one runs on untouched.
    wait_pool(&admin, "roll", "rolled out", |s| s.revision == updated.revision && s.stale == 0 && s.idle == 2).await;
    assert_eq!(out(&exec_in(&mut rt, &busy.id, "s", "echo $REV").await), "1");
    assert_eq!(state(&admin.get_sandbox(&busy.id).await.unwrap()), pb::SandboxState::Running);
    // Every creation so far counted (the pool's state comes with the snapshot, a moment late).
    wait_pool(&admin, "roll", "seven creations counted", |s| s.claims + s.misses == 7).await;
    let before = on_edge(&admin, "roll").await.claims;
    let sb = admin.create_sandbox(claim("roll")).await.unwrap();
    assert_eq!(out(&exec_in(&mut rt, &sb.id, "s", "echo $REV").await), "2");
    wait_pool(&admin, "roll", "a member of the new revision claimed", |s| s.claims == before + 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_edge_keeps_its_members_and_a_miss_goes_cold() {
    let mut f = fixture_with(pools_config).await;
    let admin = f.admin.clone();
    admin.create_pool(pb::CreatePoolRequest { pool: Some(pool("keep", 2, &[])) }).await.unwrap();
    wait_pool(&admin, "keep", "two idle members", |s| s.idle == 2).await;
    let claimed = admin.create_sandbox(claim("keep")).await.unwrap();
    // (The pool's state comes with the cluster snapshot, a moment late: the claim first.)
    wait_pool(&admin, "keep", "the claim counted", |s| s.claims == 1).await;
    wait_pool(&admin, "keep", "refilled", |s| s.idle == 2).await;
    let dirs: Vec<String> = std::fs::read_dir(&f.containers)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".pm-"))
        .collect();
    assert_eq!(dirs.len(), 3);

    f.cluster.stop_edge(EDGE).await.unwrap();
    f.cluster.start_edge(EDGE).await.unwrap();
    f.cluster.wait_ready(Duration::from_secs(30)).await.unwrap();
    // The same containers: the idle members were adopted, not started again, and the
    // claimed one is still its sandbox's.
    wait_pool(&admin, "keep", "idle again after the restart", |s| s.idle == 2).await;
    let after: Vec<String> = std::fs::read_dir(&f.containers)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".pm-"))
        .collect();
    let (mut a, mut b) = (dirs.clone(), after.clone());
    a.sort();
    b.sort();
    assert_eq!(a, b, "the members survived the restart");
    let mut rt = runtime(&f.ca, &f.addr, &f.cluster.admin_token);
    assert_eq!(out(&exec_in(&mut rt, &claimed.id, "s", "echo $OPENDSEC_SANDBOX_ID").await), claimed.id);
    // A `fncall` creation naming no pool but exactly a pool's template takes its member.
    let t = pool("keep", 2, &[]).template.unwrap();
    let matching = pb::SandboxSpec {
        image: t.image.clone(),
        backend: "fncall".into(),
        resources: t.resources,
        ..Default::default()
    };
    let m = admin.create_sandbox(matching.clone()).await.unwrap();
    wait_pool(&admin, "keep", "the matching creation claimed", |s| s.claims == 1).await;
    assert_eq!(out(&exec_in(&mut rt, &m.id, "s", "echo $OPENDSEC_SANDBOX_ID").await), m.id);
    // Another template (more memory) is no match: made cold.
    let other =
        pb::SandboxSpec { resources: Some(pb::Resources { memory_mb: 128, ..t.resources.unwrap() }), ..matching };
    admin.create_sandbox(other).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(on_edge(&admin, "keep").await.claims, 1);

    // An idle member whose PID 1 dies is replaced, never handed out.
    // (An idle member still carries its own member id; a claimed one its sandbox's.)
    let (victim, pid) = std::fs::read_dir(&f.containers)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".pm-"))
        .filter_map(|d| Some((d.clone(), pid1_of(&d)?)))
        .find(|(_, pid)| {
            let id = std::fs::read_to_string(format!("/proc/{pid}/root/run/opendsec/sandbox-id")).unwrap_or_default();
            id.contains(".pm-")
        })
        .expect("an idle member");
    rustix::process::kill_process(rustix::process::Pid::from_raw(pid).unwrap(), rustix::process::Signal::KILL).unwrap();
    until("the dead member is gone", Duration::from_secs(60), || !f.containers.join(&victim).exists()).await;
    wait_pool(&admin, "keep", "replaced", |s| s.idle == 2).await;
    let again = admin.create_sandbox(claim("keep")).await.unwrap();
    assert_eq!(out(&exec_in(&mut rt, &again.id, "s", "echo $OPENDSEC_SANDBOX_ID").await), again.id);

    // A pool with no idle member: the creation falls back to a cold one, counted as a miss.
    admin.create_pool(pb::CreatePoolRequest { pool: Some(pool("empty", 0, &[("E", "1")])) }).await.unwrap();
    wait_pool(&admin, "empty", "known on the edge", |s| s.target == 0 && !s.revision.is_empty()).await;
    let cold = admin.create_sandbox(claim("empty")).await.unwrap();
    assert_eq!(out(&exec_in(&mut rt, &cold.id, "s", "echo $E $OPENDSEC_SANDBOX_ID").await), format!("1 {}", cold.id));
    wait_pool(&admin, "empty", "the miss counted", |s| s.misses == 1).await;
    assert_eq!(on_edge(&admin, "empty").await.claims, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_refuse_other_tenants_contradicting_specs_and_pools_over_quota() {
    let f = fixture_with(pools_config).await;
    let admin = f.admin.clone();
    admin.create_pool(pb::CreatePoolRequest { pool: Some(pool("mine", 0, &[])) }).await.unwrap();

    // Another tenant may create sandboxes in its own project only: root's pool is not for it,
    // and it learns nothing about whether the pool exists.
    admin.create_project(pb::CreateProjectRequest { path: "root/other".into(), quota: None }).await.unwrap();
    let token = principal(&admin, "other", "root/other", &["sandbox.create", "sandbox.view"]).await;
    let other =
        opendsec_client::Client::new(std::slice::from_ref(&f.addr), Some(&token), &f.cluster.client_tls()).unwrap();
    for name in ["mine", "no-such-pool"] {
        let mut spec = claim(name);
        spec.project = "root".into();
        let e = other.create_sandbox(spec).await.unwrap_err();
        assert_eq!(e.reason, Reason::PermissionDenied, "{name}: {e}");
    }
    // In its own project the pool does not exist.
    let e = other.create_sandbox(claim("mine")).await.unwrap_err();
    assert_eq!(e.reason, Reason::NotFound, "{e}");

    // A spec contradicting the template names the field.
    let mut spec = claim("mine");
    spec.image = "debian:bookworm".into();
    let e = admin.create_sandbox(spec).await.unwrap_err();
    assert_eq!((e.reason, e.metadata.get("field").map(String::as_str)), (Reason::InvalidArgument, Some("spec.image")));

    // A pool whose idle members would not fit in its project's quota.
    admin
        .create_project(pb::CreateProjectRequest {
            path: "root/small".into(),
            quota: Some(pb::Quota { memory_mb: Some(128), ..Default::default() }),
        })
        .await
        .unwrap();
    let mut big = pool("big", 2, &[]);
    big.project = "root/small".into();
    let e = admin.create_pool(pb::CreatePoolRequest { pool: Some(big.clone()) }).await.unwrap_err();
    assert_eq!(e.reason, Reason::QuotaExceeded, "{e}");
    big.size_per_edge = 1;
    admin.create_pool(pb::CreatePoolRequest { pool: Some(big.clone()) }).await.unwrap();
    big.size_per_edge = 3;
    let e = admin.update_pool(pb::UpdatePoolRequest { pool: Some(big.clone()) }).await.unwrap_err();
    assert_eq!(e.reason, Reason::QuotaExceeded, "{e}");
    // The project's pools count together: a second one that fits alone does not fit beside.
    let mut second = big.clone();
    second.name = "second".into();
    second.size_per_edge = 1;
    let e = admin.create_pool(pb::CreatePoolRequest { pool: Some(second) }).await.unwrap_err();
    assert_eq!(e.reason, Reason::QuotaExceeded, "{e}");

    // A subproject's pool is not its parent's: a parent's fncall creation with exactly its
    // template is made cold, never in the subproject's member (its images may differ).
    admin.create_project(pb::CreateProjectRequest { path: "root/other/child".into(), quota: None }).await.unwrap();
    let mut child = pool("kid", 1, &[]);
    child.project = "root/other/child".into();
    admin.create_pool(pb::CreatePoolRequest { pool: Some(child.clone()) }).await.unwrap();
    let kid_idle = || async {
        let p = admin.get_pool(pb::GetPoolRequest { project: "root/other/child".into(), name: "kid".into() }).await;
        p.unwrap().edges.first().cloned().unwrap_or_default()
    };
    until_async(|| async { kid_idle().await.idle == 1 }).await;
    let t = child.template.clone().unwrap();
    let parent_spec = pb::SandboxSpec {
        project: "root/other".into(),
        image: t.image.clone(),
        backend: "fncall".into(),
        resources: t.resources,
        ..Default::default()
    };
    admin.create_sandbox(parent_spec).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(kid_idle().await.claims, 0, "the parent took the subproject's member");

    // Egress rules that do not parse are refused, not dropped.
    let mut bad = pool("bad-egress", 0, &[]);
    bad.template.as_mut().unwrap().egress = vec!["not a rule!".into()];
    let e = admin.create_pool(pb::CreatePoolRequest { pool: Some(bad) }).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument, "{e}");
}

/// The edge's pool share (`edge.pool_share_percent`) is split between tenants: one tenant's
/// huge pool no longer takes it all, a modest tenant's pool gets what it asks. Before, pools
/// filled the share first come first served, and the second tenant's pool stayed empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_pool_does_not_take_the_edges_pool_share() {
    let f = fixture_with(|c| {
        pools_config(c);
        // The share: 2,000 millicores, four members of 500.
        c.edge.capacity.cpu_millis = 4000;
        c.edge.pool_share_percent = 50;
    })
    .await;
    let admin = f.admin.clone();
    for project in ["root/a", "root/b"] {
        admin.create_project(pb::CreateProjectRequest { path: project.into(), quota: None }).await.unwrap();
    }
    let in_project =
        |project: &str, name: &str, size: u32| pb::Pool { project: project.into(), ..pool(name, size, &[]) };
    admin.create_pool(pb::CreatePoolRequest { pool: Some(in_project("root/a", "greedy", 1000)) }).await.unwrap();
    admin.create_pool(pb::CreatePoolRequest { pool: Some(in_project("root/b", "modest", 1)) }).await.unwrap();
    let status = |project: &'static str, name: &'static str| {
        let admin = admin.clone();
        async move {
            let p = admin.get_pool(pb::GetPoolRequest { project: project.into(), name: name.into() }).await.unwrap();
            p.edges.into_iter().find(|e| e.edge == EDGE).unwrap_or_default()
        }
    };
    // b asks for one: it gets it; a gets the rest of the share, not its thousand.
    let deadline = std::time::Instant::now() + Duration::from_secs(90);
    loop {
        let (a, b) = (status("root/a", "greedy").await, status("root/b", "modest").await);
        if b.idle == 1 && a.idle == 3 {
            assert_eq!((a.target, b.target), (3, 1));
            break;
        }
        assert!(std::time::Instant::now() < deadline, "a: {a:?}\nb: {b:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for (project, name) in [("root/a", "greedy"), ("root/b", "modest")] {
        admin.delete_pool(pb::DeletePoolRequest { project: project.into(), name: name.into() }).await.unwrap();
    }
}

/// Two edges offering `fncall`, a project `root/q` allowed 3 sandboxes and its pool `warm`
/// of 2 members per edge, the watcher reconciling every 300 ms leases older than `min_age`.
async fn quota_pool(min_age: Duration, tweak: impl FnOnce(&mut opendsec_common::config::Config)) -> Fixture {
    let f = fixture_edges(2, |c| {
        pools_config(c);
        c.iam.reconcile_min_age = min_age;
        c.watcher.reconcile_interval = Duration::from_millis(300);
        tweak(c);
    })
    .await;
    let quota = pb::Quota { sandboxes: Some(3), ..Default::default() };
    f.admin.create_project(pb::CreateProjectRequest { path: "root/q".into(), quota: Some(quota) }).await.unwrap();
    f.admin.create_pool(pb::CreatePoolRequest { pool: Some(quota_pool_spec()) }).await.unwrap();
    f
}

fn quota_pool_spec() -> pb::Pool {
    pb::Pool { project: "root/q".into(), ..pool("warm", 2, &[]) }
}

/// Idle members of `root/q`'s pool on `edge` (every edge: `None`), as GetPool shows them.
async fn q_idle(admin: &opendsec_client::Client, edge: Option<&str>) -> u32 {
    let p = admin.get_pool(pb::GetPoolRequest { project: "root/q".into(), name: "warm".into() }).await.unwrap();
    p.edges.iter().filter(|e| edge.is_none_or(|n| e.edge == n)).map(|e| e.idle).sum()
}

/// The sandboxes (members included) `root/q` is charged for.
async fn q_used(admin: &opendsec_client::Client) -> u64 {
    let u = admin.get_usage(pb::GetUsageRequest { project: "root/q".into() }).await.unwrap();
    u.projects.iter().find(|p| p.path == "root/q").and_then(|p| p.usage).unwrap_or_default().sandboxes
}

/// Idle members are charged to their pool's project like sandboxes (issue 39): a pool of two
/// per edge on two edges in a project whose quota is three sandboxes holds three members in
/// all, never four; a plain creation finds the quota full, a claim takes a member's charge
/// over; members that go give their charge back. Before, members held no lease and the
/// project's usage stayed at nothing while four ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_members_are_charged_to_their_project_over_every_edge() {
    // The watcher reconciles often, with little age: what the edges report live (their
    // members' leases) must agree with what IAM charges, round after round.
    let f = quota_pool(Duration::from_millis(500), |_| {}).await;
    let admin = f.admin.clone();
    let idle = || q_idle(&admin, None);
    let used = || q_used(&admin);
    until_async(|| async { idle().await == 3 }).await;
    assert_eq!(used().await, 3, "three idle members, three charged");
    // The fourth member never starts: its charge is refused round after round.
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!((idle().await, used().await), (3, 3));

    // A plain creation in the project finds its quota held by the members.
    let mut spec = container_spec("busybox:latest", 64, 64);
    spec.project = "root/q".into();
    let e = admin.create_sandbox(spec).await.unwrap_err();
    assert_eq!(e.reason, Reason::QuotaExceeded, "{e}");
    // A claim takes one member's charge over: the quota still holds three in all.
    let sb = admin.create_sandbox(pb::SandboxSpec { project: "root/q".into(), ..claim("warm") }).await.unwrap();
    until_async(|| async { idle().await == 2 }).await;
    // Through several reconciliations: the claimed member's lease is not reported (nor adopted
    // back), the moved charge is not charged twice.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!((idle().await, used().await), (2, 3), "no refill past the quota");
    // The sandbox stops: its charge goes, and a member takes it.
    admin.stop_sandbox(&sb.id).await.unwrap();
    until_async(|| async { idle().await == 3 }).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!((idle().await, used().await), (3, 3));
    // Claims one after another, each stopped once the members are back: the quota is never
    // passed, and nothing is left charged. (A claim at a full quota is admitted when the edge
    // it is placed on has a member whose charge it takes over: not in the moment after a stop,
    // before the edge has given the sandbox's lease back and refilled.)
    for _ in 0..4 {
        until_async(|| async { idle().await == 3 }).await;
        let sb = admin.create_sandbox(pb::SandboxSpec { project: "root/q".into(), ..claim("warm") }).await.unwrap();
        admin.stop_sandbox(&sb.id).await.unwrap();
        assert!(used().await <= 3, "past the quota");
    }
    until_async(|| async { idle().await == 3 }).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!((idle().await, used().await), (3, 3));
    // The pool goes: its members' charges go with them.
    admin.delete_pool(pb::DeletePoolRequest { project: "root/q".into(), name: "warm".into() }).await.unwrap();
    until_async(|| async { used().await == 0 }).await;
}

/// Members an edge finds at its restart are charged again, not trusted: the watcher released
/// a lost edge's leases (members' too) and another edge's members and a sandbox took the quota
/// meanwhile; the restarted edge's members are refused their charge and stopped. Before, the
/// edge reported them live, the reconciliation adopted them, and the project held more than
/// its quota (the same holds for members of a release that charged none).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_found_at_a_restart_are_charged_again_or_stopped() {
    let mut f = quota_pool(Duration::from_millis(500), |c| c.watcher.lost_edge_grace = Duration::from_secs(1)).await;
    let admin = f.admin.clone();
    let idle_on = |edge: &'static str| q_idle(&admin, Some(edge));
    let used = || q_used(&admin);
    until_async(|| async { idle_on(EDGE).await + idle_on("edge-001").await == 3 }).await;
    until_async(|| async { idle_on(EDGE).await > 0 }).await;
    let kept = idle_on(EDGE).await;

    // The edge goes away with its members running; the watcher gives its leases back.
    f.cluster.stop_edge(EDGE).await.unwrap();
    assert_eq!(member_dirs(&f), kept as usize, "the members outlive their edge");
    until_async(|| async { idle_on("edge-001").await == 2 && used().await == 2 }).await;
    let mut spec = container_spec("busybox:latest", 64, 64);
    spec.project = "root/q".into();
    admin.create_sandbox(spec).await.unwrap();
    assert_eq!(used().await, 3);

    // Back: its members are refused their charge (the quota is full) and stopped.
    f.cluster.start_edge(EDGE).await.unwrap();
    f.cluster.wait_ready(Duration::from_secs(30)).await.unwrap();
    until("the restarted edge's members are stopped", Duration::from_secs(60), || member_dirs(&f) == 0).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!((used().await, idle_on(EDGE).await, member_dirs(&f)), (3, 0, 0));
}

/// A claim whose Admit moved a member's charge but never reached the member's edge (the
/// apiserver died, or the edge refused and the sandbox went elsewhere): the edge finds IAM no
/// longer holds its member's lease and charges it again, quota checked; at a full quota the
/// member is retired. Before, the member ran on uncharged (or, adopted back by a
/// reconciliation, past the quota).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_charge_a_lost_claim_took_is_charged_again_or_retired() {
    // The lost claim's lease is released by a reconciliation only after this age: the member
    // is charged again (and refused) before.
    let f = quota_pool(Duration::from_secs(10), |_| {}).await;
    let admin = f.admin.clone();
    let template = quota_pool_spec().template.unwrap();
    let idle_on = |edge: &'static str| q_idle(&admin, Some(edge));
    let used = || q_used(&admin);
    until_async(|| async { idle_on(EDGE).await + idle_on("edge-001").await == 3 }).await;
    until_async(|| async { idle_on(EDGE).await > 0 }).await;
    let kept = idle_on(EDGE).await as usize;
    assert_eq!(used().await, 3);

    // As the apiserver would: a claim's Admit on this edge, and then nothing reaches the edge.
    let links = f.cluster.apiserver_links().unwrap();
    let ch = links.channel(&f.cluster.config.iam.addrs[0], opendsec_common::pki::Role::Iam, None).unwrap();
    let mut iam = pb::iam_client::IamClient::new(ch);
    let a = iam
        .admit(pb::AdmitRequest {
            token: f.cluster.admin_token.clone(),
            lease_id: "lost-claim".into(),
            project: "root/q".into(),
            resources: template.resources,
            edge: EDGE.into(),
            keep_existing: false,
            egress: Vec::new(),
            pool: "root/q//warm".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert!(!a.member_lease.is_empty(), "a member's charge moved: {a:?}");
    // The edge charges that member again: refused (the lost claim holds the quota), retired.
    until("the member is retired", Duration::from_secs(60), || member_dirs(&f) == kept - 1).await;
    assert_eq!(used().await, 3);
    // The claim's lease given back: the pool refills to the quota, every member charged.
    let r = pb::ReleaseLeasesRequest { lease_ids: vec!["lost-claim".into()], edge: String::new() };
    iam.release_leases(r).await.unwrap();
    until_async(|| async { idle_on(EDGE).await + idle_on("edge-001").await == 3 }).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!((used().await, idle_on(EDGE).await + idle_on("edge-001").await), (3, 3));
}
