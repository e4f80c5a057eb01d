//! Issue 16's soak: a cluster of four sim edges (real records, TTL sweeps, watcher probes and
//! reconciliation) driven at a steady rate for ten minutes (`OPENDSEC_SOAK_SECS` changes it):
//! each second 40 sandboxes come, in four kinds of ten: one ends by its lifetime TTL, one by
//! its idle TTL, one is paused (and half of those resumed) and ends by its paused or idle TTL,
//! one is stopped by the caller after a while. At the end:
//!
//! - IAM's usage equals the live sandboxes (count and memory), and every sandbox past its
//!   lifetime is gone (the TTLs fired, none was missed);
//! - the test process (every component is in it) grew by less than `GROWTH_BOUND_MIB` from a
//!   third of the run to its end, at the same load: nothing grows per sandbox ever made;
//! - after stopping what is left and one retention period: usage 0, the sim backends hold
//!   nothing, and the edges' record logs hold no record at all (ended ones were deleted).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use crate::common::*;
use futures::StreamExt;
use opendsec_proto::v1 as pb;
use opendsec_testkit::eventually;

const EDGES: u32 = 4;
const PER_KIND: u32 = 10;
const MEMORY_MB: u64 = 16;
const GROWTH_BOUND_MIB: u64 = 64;
const RETENTION: Duration = Duration::from_secs(20);

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Kind {
    /// `ttl_max_s` 5..=20.
    Lifetime,
    /// `ttl_running_stop_s` 3..=10, no call ever made to it.
    Idle,
    /// Paused at once with `ttl_paused_s` 5; every other one resumed two seconds later (then
    /// its idle TTL of 5 s ends it).
    Paused,
    /// Stopped by the caller 5 s after it came.
    Stopped,
}

fn spec(kind: Kind, n: u64) -> pb::SandboxSpec {
    let mut s = pb::SandboxSpec {
        image: "scratch".into(),
        backend: "sim".into(),
        resources: Some(pb::Resources { cpu_millis: 10, memory_mb: MEMORY_MB, disk_mb: 0, gpus: 0 }),
        ttl_max_s: 3600,
        ..Default::default()
    };
    match kind {
        Kind::Lifetime => s.ttl_max_s = 5 + n % 16,
        Kind::Idle => s.ttl_running_stop_s = 3 + n % 8,
        Kind::Paused => (s.ttl_paused_s, s.ttl_running_stop_s) = (5, 5),
        Kind::Stopped => {}
    }
    s
}

/// What root's sandboxes hold (its leases: the store's bytes, which the test's images take,
/// are not the sandboxes').
async fn root_usage(admin: &opendsec_client::Client) -> pb::Usage {
    let u = admin.get_usage(pb::GetUsageRequest { project: "root".into() }).await.unwrap();
    u.projects
        .iter()
        .find(|p| p.path == "root")
        .and_then(|p| p.usage)
        .map(|u| pb::Usage { store_bytes: 0, ..u })
        .unwrap_or_default()
}

async fn live_ids(admin: &opendsec_client::Client) -> Vec<String> {
    let req = pb::ListSandboxesRequest { project: "root".into(), page_size: 1000, ..Default::default() };
    admin.list_all_sandboxes(req).await.unwrap().into_iter().map(|s| s.id).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ten_minute_soak_of_creations_expiries_pauses_and_stops_leaks_nothing() {
    let secs: u64 = std::env::var("OPENDSEC_SOAK_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(600);
    let f = fixture_edges(EDGES, |c| {
        room_for_thousands(c);
        c.edge.ended_retention = RETENTION;
        c.edge.ttl_check_interval = Duration::from_millis(500);
        c.iam.reconcile_min_age = Duration::from_secs(10);
        c.watcher.reconcile_interval = Duration::from_secs(5);
    })
    .await;
    let admin = f.admin.clone().with_retry_timeout(Duration::from_secs(30));
    let started = Instant::now();
    // (kind, created at) of every sandbox answered RUNNING.
    let mut made: BTreeMap<String, (Kind, Instant)> = BTreeMap::new();
    let mut to_resume: Vec<(Instant, String)> = Vec::new();
    let mut to_stop: Vec<(Instant, String)> = Vec::new();
    let (mut paused, mut resumed, mut stopped, mut refused) = (0u64, 0u64, 0u64, BTreeMap::<String, u64>::new());
    let mut warm_rss = None;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    let mut n = 0u64;
    while started.elapsed() < Duration::from_secs(secs) {
        tick.tick().await;
        if warm_rss.is_none() && started.elapsed() >= Duration::from_secs(secs / 3) {
            warm_rss = Some((opendsec_testkit::rss_mib(), made.len()));
        }
        for kind in [Kind::Lifetime, Kind::Idle, Kind::Paused, Kind::Stopped] {
            n += 1;
            let mut stream = admin.create_sandboxes(spec(kind, n), PER_KIND).await.unwrap();
            while let Some(item) = stream.next().await {
                let item = item.unwrap();
                match (item.sandbox, item.error) {
                    (Some(sb), None) => {
                        let now = Instant::now();
                        match kind {
                            Kind::Paused => {
                                let p = admin.pause_sandbox(&sb.id).await.unwrap();
                                assert_eq!(state(&p), pb::SandboxState::Paused, "{p:?}");
                                paused += 1;
                                if paused % 2 == 0 {
                                    to_resume.push((now + Duration::from_secs(2), sb.id.clone()));
                                }
                            }
                            Kind::Stopped => to_stop.push((now + Duration::from_secs(5), sb.id.clone())),
                            _ => {}
                        }
                        made.insert(sb.id, (kind, now));
                    }
                    (_, e) => *refused.entry(format!("{e:?}")).or_default() += 1,
                }
            }
        }
        let now = Instant::now();
        for (_, id) in to_resume.extract_if(.., |(at, _)| *at <= now) {
            // It may have expired meanwhile (paused TTL): then it is gone, which is fine.
            if admin.resume_sandbox(&id).await.is_ok() {
                resumed += 1;
            }
        }
        for (_, id) in to_stop.extract_if(.., |(at, _)| *at <= now) {
            let st = admin.stop_sandbox(&id).await.unwrap_or_else(|e| panic!("stop {id}: {e}"));
            assert_eq!(state(&st), pb::SandboxState::Stopped);
            stopped += 1;
        }
    }
    let end_rss = opendsec_testkit::rss_mib();
    // Those the caller meant to stop and had not yet: stopped now (they have no short TTL).
    for (_, id) in to_stop.drain(..) {
        let st = admin.stop_sandbox(&id).await.unwrap_or_else(|e| panic!("stop {id}: {e}"));
        assert_eq!(state(&st), pb::SandboxState::Stopped);
        stopped += 1;
    }
    let (warm, made_at_warm) = warm_rss.unwrap();
    println!(
        "soak: {secs} s, {} sandboxes made ({made_at_warm} at a third), {paused} paused, {resumed} resumed, \
         {stopped} stopped by the caller, refused {refused:?}; RSS {warm} MiB at a third, {end_rss} MiB at the end",
        made.len()
    );
    assert!(refused.is_empty(), "creations refused: {refused:?}");

    // Usage equals what lives, once the in-flight calls and reconciliation settle.
    let mut last = String::new();
    let mut settled = None;
    for _ in 0..120 {
        let ids = live_ids(&admin).await;
        let usage = root_usage(&admin).await;
        if usage.sandboxes == ids.len() as u64 && usage.memory_mb == MEMORY_MB * ids.len() as u64 {
            settled = Some(ids);
            break;
        }
        last = format!("{} live, usage {usage:?}", ids.len());
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let live = settled.unwrap_or_else(|| panic!("usage never equalled the live sandboxes: {last}"));
    // Every sandbox past its lifetime (or idle, or paused) TTL is gone; one the caller stopped
    // too.
    let now = Instant::now();
    let overdue: Vec<(&String, &(Kind, Instant))> = made
        .iter()
        .filter(|(id, (kind, at))| {
            let limit = match kind {
                Kind::Lifetime => 20,
                Kind::Idle => 10,
                Kind::Paused => 7 + 5,
                Kind::Stopped => 5,
            };
            // The margin: a sweep every 0.5 s, the caller's stops once a tick, a loaded machine.
            now.duration_since(*at) > Duration::from_secs(limit + 10) && live.contains(id)
        })
        .collect();
    assert!(overdue.is_empty(), "live past every TTL: {:?}", &overdue[..overdue.len().min(10)]);
    assert!(
        end_rss <= warm + GROWTH_BOUND_MIB,
        "memory grew from {warm} MiB at a third of the run to {end_rss} MiB at its end"
    );

    // Stop what is left; after a retention period nothing remains anywhere.
    for id in &live {
        let st = admin.stop_sandbox(id).await.unwrap_or_else(|e| panic!("stop {id}: {e}"));
        assert_eq!(state(&st), pb::SandboxState::Stopped);
    }
    eventually("usage 0 and the sim backends empty", Duration::from_secs(60), || async {
        root_usage(&admin).await == pb::Usage::default()
            && f.cluster.edge_names().iter().all(|e| f.cluster.sim_backend(e).is_none_or(|b| b.is_empty()))
    })
    .await;
    tokio::time::sleep(RETENTION + Duration::from_secs(3)).await;
    let cfg = f.cluster.config.clone();
    let names = f.cluster.edge_names();
    f.cluster.shutdown().await;
    for e in &names {
        let store = opendsec_edge::record::RecordStore::open(&cfg.edge_state_dir(e)).unwrap();
        let (records, bad) = store.load_all().unwrap();
        assert!(bad.is_empty(), "{e}: records the log could not read: {bad:?}");
        let ids: Vec<&String> = records.iter().map(|r| &r.id).take(10).collect();
        assert!(records.is_empty(), "{e}: {} records past their retention, e.g. {ids:?}", records.len());
    }
}
