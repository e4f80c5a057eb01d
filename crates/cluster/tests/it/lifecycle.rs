//! End-to-end: sandbox lifecycles, TTLs, restarts of edges and apiservers, lost edges and
//! reconciliation, placement spread and penalties, all through real gRPC between real servers.

use crate::common;

use std::collections::HashMap;
use std::time::Duration;

use crate::common::*;
use opendsec_common::Reason;
use opendsec_common::time::Clock;
use opendsec_proto::v1 as pb;

fn state(s: &pb::Sandbox) -> pb::SandboxState {
    pb::SandboxState::try_from(s.state).unwrap_or(pb::SandboxState::Unspecified)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn create_pause_resume_stop_and_list() {
    let t = start(2, |_| {}).await;
    let s = t.admin.create_sandbox(spec("", 500, 256)).await.unwrap();
    assert_eq!(state(&s), pb::SandboxState::Running);
    assert_eq!(s.spec.as_ref().unwrap().project, "root");
    assert!(s.id.starts_with(&format!("{}.", s.edge)));

    let p = t.admin.pause_sandbox(&s.id).await.unwrap();
    assert_eq!(state(&p), pb::SandboxState::Paused);
    // Pausing again is idempotent (an SDK may retry it).
    assert_eq!(state(&t.admin.pause_sandbox(&s.id).await.unwrap()), pb::SandboxState::Paused);
    let r = t.admin.resume_sandbox(&s.id).await.unwrap();
    assert_eq!(state(&r), pb::SandboxState::Running);

    let listed = t.admin.list_all_sandboxes(pb::ListSandboxesRequest::default()).await.unwrap();
    assert_eq!(listed.iter().map(|s| s.id.as_str()).collect::<Vec<_>>(), [s.id.as_str()]);
    assert_eq!(usage(&t.admin, "root").await.sandboxes, 1);

    let st = t.admin.stop_sandbox(&s.id).await.unwrap();
    assert_eq!(state(&st), pb::SandboxState::Stopped);
    let e = t.admin.resume_sandbox(&s.id).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidState);
    assert!(e.message.to_lowercase().contains("stopped"), "names the state it found: {}", e.message);
    // Stopped sandboxes leave the default listing, and their lease is released (batched).
    let listed = t.admin.list_all_sandboxes(pb::ListSandboxesRequest::default()).await.unwrap();
    assert!(listed.is_empty());
    eventually("lease released", Duration::from_secs(5), || async { usage(&t.admin, "root").await.sandboxes == 0 })
        .await;
    t.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_pages_and_filters() {
    let t = start(3, |_| {}).await;
    let mut mine = Vec::new();
    for i in 0..25 {
        let mut sp = spec("", 10, 16);
        sp.labels.insert("group".into(), if i % 5 == 0 { "a".into() } else { "b".into() });
        mine.push(t.admin.create_sandbox(sp).await.unwrap().id);
    }
    mine.sort();
    let mut seen = Vec::new();
    let mut token = String::new();
    loop {
        let page = t
            .admin
            .list_sandboxes(pb::ListSandboxesRequest { page_size: 7, page_token: token.clone(), ..Default::default() })
            .await
            .unwrap();
        assert!(page.sandboxes.len() <= 7);
        seen.extend(page.sandboxes.into_iter().map(|s| s.id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(seen, mine, "pages cover every sandbox once, in id order");
    let a = t
        .admin
        .list_all_sandboxes(pb::ListSandboxesRequest {
            labels: [("group".to_string(), "a".to_string())].into_iter().collect(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(a.len(), 5);
    let paused = t
        .admin
        .list_all_sandboxes(pb::ListSandboxesRequest {
            states: vec![pb::SandboxState::Paused as i32],
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(paused.is_empty());
    let big = t
        .admin
        .list_sandboxes(pb::ListSandboxesRequest { page_size: 100_000, ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(big.reason, Reason::InvalidArgument);
    t.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ttl_expiry_stops_sandboxes_and_releases_quota() {
    // The edges' clock is a manual one: the TTLs below pass when the test says, not in real
    // seconds; the edges' sweep loop (every 100 ms) sees the moved clock.
    let clock = Clock::manual(opendsec_common::time::now_ms());
    let t = start_with_clock(1, clock.clone(), |_| {}).await;
    let mut sp = spec("", 100, 64);
    sp.ttl_running_stop_s = 60;
    let idle = t.admin.create_sandbox(sp).await.unwrap();
    let mut sp = spec("", 100, 64);
    sp.ttl_max_s = 120;
    let life = t.admin.create_sandbox(sp).await.unwrap();
    let keep = t.admin.create_sandbox(spec("", 100, 64)).await.unwrap();
    assert_eq!(idle.expires_at_ms, idle.created_at_ms + 60_000);

    clock.advance(60_000);
    eventually("the idle sandbox stopped", Duration::from_secs(10), || async {
        state(&t.admin.get_sandbox(&idle.id).await.unwrap()) == pb::SandboxState::Stopped
    })
    .await;
    assert_eq!(state(&t.admin.get_sandbox(&life.id).await.unwrap()), pb::SandboxState::Running);
    clock.advance(60_000);
    eventually("the sandbox at its lifetime stopped", Duration::from_secs(10), || async {
        state(&t.admin.get_sandbox(&life.id).await.unwrap()) == pb::SandboxState::Stopped
    })
    .await;
    assert_eq!(t.admin.get_sandbox(&idle.id).await.unwrap().end_reason, "ttl_running_stop");
    assert_eq!(t.admin.get_sandbox(&life.id).await.unwrap().end_reason, "ttl_max");
    assert_eq!(state(&t.admin.get_sandbox(&keep.id).await.unwrap()), pb::SandboxState::Running);
    eventually("leases released", Duration::from_secs(5), || async { usage(&t.admin, "root").await.sandboxes == 1 })
        .await;

    // A TTL above the cluster's cap is refused, naming the field.
    let mut sp = spec("", 100, 64);
    sp.ttl_max_s = 365 * 24 * 3600;
    let err = t.admin.create_sandbox(sp).await.unwrap_err();
    assert_eq!(err.reason, Reason::InvalidArgument);
    assert!(err.message.contains("ttl_max"), "{}", err.message);
    t.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_edge_restarted_while_sandboxes_run_loses_none() {
    let mut t = start(1, |_| {}).await;
    let mut ids = Vec::new();
    for i in 0..20 {
        let s = t.admin.create_sandbox(spec("", 10, 16)).await.unwrap();
        if i % 4 == 0 {
            t.admin.pause_sandbox(&s.id).await.unwrap();
        }
        ids.push(s.id);
    }
    let before: HashMap<String, i32> =
        t.admin.list_all_sandboxes(Default::default()).await.unwrap().into_iter().map(|s| (s.id, s.state)).collect();
    let edge = t.cluster.edge_names()[0].clone();
    t.cluster.stop_edge(&edge).await.unwrap();
    let quick = common::client(&t.cluster, &t.cluster.admin_token).with_retry_timeout(Duration::ZERO);
    let err = quick.get_sandbox(&ids[0]).await.unwrap_err();
    assert_eq!(err.reason, Reason::Unavailable, "{err}");
    t.cluster.start_edge(&edge).await.unwrap();
    t.cluster.wait_ready(Duration::from_secs(10)).await.unwrap();
    let after: HashMap<String, i32> =
        t.admin.list_all_sandboxes(Default::default()).await.unwrap().into_iter().map(|s| (s.id, s.state)).collect();
    assert_eq!(after, before, "every sandbox back in the state it had");
    assert_eq!(usage(&t.admin, "root").await.sandboxes, 20);
    t.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apiserver_restarted_loses_nothing() {
    let mut t = start(2, |_| {}).await;
    let a = t.admin.create_sandbox(spec("", 10, 16)).await.unwrap();
    t.cluster.stop_apiserver().await;
    let quick = common::client(&t.cluster, &t.cluster.admin_token).with_retry_timeout(Duration::ZERO);
    assert_eq!(quick.get_sandbox(&a.id).await.unwrap_err().reason, Reason::Unavailable);
    t.cluster.start_apiserver().await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The client retries `unavailable` until the new apiserver has its snapshot.
    let got = t.admin.get_sandbox(&a.id).await.unwrap();
    assert_eq!(got.id, a.id);
    assert_eq!(state(&got), pb::SandboxState::Running);
    let b = t.admin.create_sandbox(spec("", 10, 16)).await.unwrap();
    assert_ne!(a.id, b.id);
    assert_eq!(usage(&t.admin, "root").await.sandboxes, 2);
    t.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_edge_has_its_quota_released_and_adopted_back() {
    let mut t = start(2, |c| {
        c.watcher.reconcile_interval = Duration::from_millis(300);
        c.watcher.lost_edge_grace = Duration::from_secs(1);
        c.iam.reconcile_min_age = Duration::from_millis(200);
    })
    .await;
    let mut on_edge: HashMap<String, u64> = HashMap::new();
    for _ in 0..12 {
        let s = t.admin.create_sandbox(spec("", 10, 16)).await.unwrap();
        *on_edge.entry(s.edge).or_default() += 1;
    }
    let (lost, n_lost) = on_edge.iter().max_by_key(|(_, n)| **n).map(|(e, n)| (e.clone(), *n)).unwrap();
    assert!(n_lost > 0);
    t.cluster.stop_edge(&lost).await.unwrap();
    eventually("the lost edge's leases released", Duration::from_secs(15), || async {
        usage(&t.admin, "root").await.sandboxes == 12 - n_lost
    })
    .await;
    t.cluster.start_edge(&lost).await.unwrap();
    eventually("leases adopted back", Duration::from_secs(15), || async {
        usage(&t.admin, "root").await.sandboxes == 12
    })
    .await;
    t.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn placement_spreads_load_and_honours_penalties() {
    let t = start(4, |_| {}).await;
    let mut per_edge: HashMap<String, u32> = HashMap::new();
    let mut stream = t.admin.create_sandboxes(spec("", 100, 64), 400).await.unwrap();
    while let Some(item) = stream.message().await.unwrap() {
        let s = item.sandbox.expect("every batch item succeeds");
        *per_edge.entry(s.edge).or_default() += 1;
    }
    assert_eq!(per_edge.values().sum::<u32>(), 400);
    assert_eq!(per_edge.len(), 4, "{per_edge:?}");
    let (min, max) = (per_edge.values().min().copied().unwrap(), per_edge.values().max().copied().unwrap());
    assert!(max <= 2 * min, "power-of-two choices keeps edges within 2x: {per_edge:?}");

    // One edge refuses every creation: creations still land, elsewhere.
    let bad = t.cluster.edge_names()[0].clone();
    t.cluster.sim_backend(&bad).unwrap().fail_creates(Some(Reason::NoCapacity));
    for _ in 0..30 {
        let s = t.admin.create_sandbox(spec("", 100, 64)).await.unwrap();
        assert_ne!(s.edge, bad);
    }
    // All edges refusing: the creation fails with no_capacity and holds no quota.
    for e in t.cluster.edge_names() {
        t.cluster.sim_backend(&e).unwrap().fail_creates(Some(Reason::NoCapacity));
    }
    let before = usage(&t.admin, "root").await.sandboxes;
    let err = t.admin.create_sandbox(spec("", 100, 64)).await.unwrap_err();
    assert_eq!(err.reason, Reason::NoCapacity, "{err}");
    eventually("failed creation's lease released", Duration::from_secs(5), || async {
        usage(&t.admin, "root").await.sandboxes == before
    })
    .await;
    t.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retried_creation_with_the_same_lease_returns_the_same_sandbox() {
    let t = start(2, |_| {}).await;
    let req = pb::CreateSandboxRequest { spec: Some(spec("", 10, 16)), lease_id: "retry-me-1".into() };
    let a = t.admin.create_sandbox_with(req.clone()).await.unwrap();
    let b = t.admin.create_sandbox_with(req).await.unwrap();
    assert_eq!(a.id, b.id);
    assert_eq!(usage(&t.admin, "root").await.sandboxes, 1);
    // Keys are scoped by project: another project using the same key neither squats this
    // project's key nor finds its sandbox.
    project(&t.admin, "root/other", pb::Quota::default()).await;
    let outsider =
        client(&t.cluster, &principal(&t.admin, "outsider", "root/other", &["sandbox.create", "sandbox.view"]).await);
    let scratch = pb::Grant { principal: "outsider".into(), project: "root".into(), permission: "layer.use".into() };
    t.admin.grant(pb::GrantRequest { grant: Some(scratch) }).await.unwrap();
    let req = pb::CreateSandboxRequest { spec: Some(spec("root/other", 10, 16)), lease_id: "retry-me-1".into() };
    let c = outsider.create_sandbox_with(req.clone()).await.unwrap();
    assert_ne!(c.id, a.id);
    assert_eq!(outsider.create_sandbox_with(req).await.unwrap().id, c.id, "idempotent in its own project");
    assert_eq!(usage(&t.admin, "root/other").await.sandboxes, 1);
    t.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_this_build_cannot_run_is_refused_at_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = fast_config(dir.path());
    cfg.edge.backends = vec!["sim".into(), "microvm".into()];
    let err = opendsec_cluster::Cluster::up(cfg, Default::default()).await.expect_err("refused");
    assert!(err.to_string().contains("microvm"), "{err}");
}

/// Paging through `ListSandboxes` while other sandboxes are created and stopped on every edge:
/// each sandbox that exists throughout is listed exactly once, and no id twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listing_pages_stay_stable_under_concurrent_creations() {
    let t = start(3, |_| {}).await;
    let mut steady = Vec::new();
    for _ in 0..120 {
        steady.push(t.admin.create_sandbox(spec("", 10, 16)).await.unwrap().id);
    }
    steady.sort();
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let (admin, stop) = (t.admin.clone(), stop.clone());
        tokio::spawn(async move {
            let mut made = 0u32;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let id = admin.create_sandbox(spec("", 10, 16)).await.unwrap().id;
                if made.is_multiple_of(2) {
                    admin.stop_sandbox(&id).await.unwrap();
                }
                made += 1;
            }
            made
        })
    };
    for round in 0..5 {
        let mut seen: Vec<String> = Vec::new();
        let mut token = String::new();
        loop {
            let page = t
                .admin
                .list_sandboxes(pb::ListSandboxesRequest {
                    page_size: 9,
                    page_token: token.clone(),
                    ..Default::default()
                })
                .await
                .unwrap();
            seen.extend(page.sandboxes.into_iter().map(|s| s.id));
            if page.next_page_token.is_empty() {
                break;
            }
            token = page.next_page_token;
        }
        let mut unique = seen.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), seen.len(), "round {round}: an id listed twice");
        let missing: Vec<&String> = steady.iter().filter(|id| unique.binary_search(id).is_err()).collect();
        assert!(missing.is_empty(), "round {round}: steady sandboxes skipped: {missing:?}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(churn.await.unwrap() > 0, "nothing was created while listing");
    t.cluster.shutdown().await;
}
