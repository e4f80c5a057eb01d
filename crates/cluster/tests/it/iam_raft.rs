//! IAM on Raft ×3 inside one `cluster up` process: three members with their own stores and
//! ports, real gRPC (mTLS) between them. Admissions go on while the leader is stopped and while
//! a follower that fell behind the log catches up from a snapshot; every call reaches the
//! leader from any member (the apiserver and the edges talk to member 1, which leads only at
//! the start); membership changes and leader transfers are made through the Admin API.

use std::time::{Duration, Instant};

use crate::common::*;
use opendsec_client::Client;
use opendsec_cluster::{Cluster, UpOptions};
use opendsec_common::time::Clock;
use opendsec_proto::v1 as pb;

async fn start3(tweak: impl FnOnce(&mut opendsec_common::config::Config)) -> TestCluster {
    start3_in(tempfile::tempdir().expect("tempdir"), tweak).await
}

async fn start3_in(dir: tempfile::TempDir, tweak: impl FnOnce(&mut opendsec_common::config::Config)) -> TestCluster {
    let mut cfg = fast_config(dir.path());
    cfg.iam.raft = Some(opendsec_common::config::IamRaftConfig {
        heartbeat_interval: Duration::from_millis(100),
        election_timeout: Duration::from_millis(600),
        // Small: a snapshot every 20 entries, and at most 20 entries of log kept behind it.
        snapshot_every: 20,
        ..Default::default()
    });
    tweak(&mut cfg);
    let opts = UpOptions { sim_edges: Some(1), iam_replicas: Some(3), clock: Clock::system(), ..Default::default() };
    let cluster = Cluster::up(cfg, opts).await.expect("cluster up");
    cluster.wait_ready(Duration::from_secs(30)).await.expect("cluster ready");
    let admin = client(&cluster, &cluster.admin_token);
    // The first leader commits the bootstrap (the administrator and their token) after its
    // election.
    eventually("IAM bootstrapped", Duration::from_secs(30), || async {
        admin.iam_members(pb::IamMembersRequest {}).await.is_ok()
    })
    .await;
    TestCluster { cluster, admin, dir }
}

async fn members(admin: &Client) -> pb::IamMembersResponse {
    admin.iam_members(pb::IamMembersRequest {}).await.expect("iam members")
}

async fn leader(admin: &Client) -> u64 {
    let m = members(admin).await;
    m.members.iter().find(|m| m.leader).map(|m| m.id).unwrap_or_else(|| panic!("no leader: {m:?}"))
}

async fn live(admin: &Client, project: &str) -> u64 {
    let u = admin.get_usage(pb::GetUsageRequest { project: project.into() }).await.expect("usage");
    u.projects.iter().find(|p| p.path == project).and_then(|p| p.usage).map(|u| u.sandboxes).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_members_replicate_fail_over_and_catch_up() {
    let mut t = start3(|_| {}).await;
    let admin = t.admin.clone();

    // Three voters, one leader, the log committed.
    let m = members(&admin).await;
    assert!(m.replicated, "{m:?}");
    assert_eq!(m.members.len(), 3, "{m:?}");
    assert!(m.members.iter().all(|m| m.voter), "{m:?}");
    assert_eq!(m.members.iter().filter(|m| m.leader).count(), 1, "{m:?}");

    // Member 3 leads: everything the apiserver and the edge send to member 1 is forwarded,
    // the edge's lease releases included (checked there as the edge's own).
    let m = admin.transfer_iam_leader(pb::TransferIamLeaderRequest { to: 3 }).await.expect("transfer");
    assert_eq!(m.members.iter().find(|m| m.leader).map(|m| m.id), Some(3), "{m:?}");
    admin
        .create_project(pb::CreateProjectRequest { path: "root/rl".into(), ..Default::default() })
        .await
        .expect("project");
    let mut ids = Vec::new();
    for _ in 0..20 {
        ids.push(admin.create_sandbox(spec("root/rl", 100, 64)).await.expect("create").id);
    }
    assert_eq!(live(&admin, "root/rl").await, 20);
    for id in ids.drain(..10) {
        admin.stop_sandbox(&id).await.expect("stop");
    }
    eventually("the edge's releases reach the leader through member 1", Duration::from_secs(10), || async {
        live(&admin, "root/rl").await == 10
    })
    .await;

    // The leader stops: creations fail for a moment, then go on under a new leader. Nothing
    // committed is lost: usage is what succeeded.
    let old = leader(&admin).await;
    t.cluster.stop_iam_member(old).await.expect("stop leader");
    let stopped_at = Instant::now();
    let mut back_after = None;
    let mut created = 10u64;
    while created < 110 {
        match admin.create_sandbox(spec("root/rl", 100, 64)).await {
            Ok(sb) => {
                back_after.get_or_insert(stopped_at.elapsed());
                ids.push(sb.id);
                created += 1;
            }
            Err(e) => {
                assert!(stopped_at.elapsed() < Duration::from_secs(30), "no new leader: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    eprintln!("leader {old} stopped: first admission after {:?}", back_after.unwrap());
    let now = leader(&admin).await;
    assert_ne!(now, old);
    assert_eq!(live(&admin, "root/rl").await, created);

    // The stopped member comes back with its disk. It missed 100 admissions (100 entries and
    // more), while the leader keeps fewer than 60 entries of log (20 behind its last snapshot,
    // purged 20 at a time, fewer than 20 since): it can only catch up by installing the
    // leader's snapshot. Led by it, the cluster answers with everything.
    t.cluster.start_iam_member(old).await.expect("restart");
    eventually("the restarted member catches up", Duration::from_secs(20), || async {
        let m = members(&admin).await;
        let top = m.members.iter().map(|m| m.matched_index).max().unwrap_or(0);
        m.members.iter().find(|x| x.id == old).is_some_and(|x| x.matched_index >= top && top > 0)
    })
    .await;
    admin.transfer_iam_leader(pb::TransferIamLeaderRequest { to: old }).await.expect("transfer back");
    assert_eq!(leader(&admin).await, old);
    assert_eq!(live(&admin, "root/rl").await, created);
    for id in ids.drain(..) {
        admin.stop_sandbox(&id).await.expect("stop");
    }
    eventually("every lease released", Duration::from_secs(10), || async { live(&admin, "root/rl").await == 0 }).await;

    // Membership: a voter removed (not the leader) leaves two; the last voter cannot go.
    let gone = members(&admin).await.members.iter().find(|m| !m.leader).map(|m| m.id).unwrap();
    let m = admin.remove_iam_member(pb::RemoveIamMemberRequest { id: gone }).await.expect("remove");
    assert_eq!(m.members.len(), 2, "{m:?}");
    let e = admin.remove_iam_member(pb::RemoveIamMemberRequest { id: 99 }).await.unwrap_err();
    assert_eq!(e.reason, opendsec_common::Reason::NotFound, "{e}");
    // Still serving with two.
    admin.create_sandbox(spec("root/rl", 100, 64)).await.expect("create with two members");
    // Bad additions are refused before anything is proposed: id 0, an address that is none,
    // another member's address under a new id.
    let taken = members(&admin).await.members[0].address.clone();
    for (id, address, want) in [
        (0, "127.0.0.1:7", opendsec_common::Reason::InvalidArgument),
        (5, "not an address", opendsec_common::Reason::InvalidArgument),
        (5, taken.as_str(), opendsec_common::Reason::AlreadyExists),
    ] {
        let req = pb::AddIamMemberRequest { id, address: address.into(), learner_only: false };
        let e = admin.add_iam_member(req).await.unwrap_err();
        assert_eq!(e.reason, want, "{id} {address}: {e}");
    }
    assert_eq!(members(&admin).await.members.len(), 2);
    t.cluster.shutdown().await;
}

/// A standalone IAM answers the member list with itself and refuses changes; the Admin calls
/// need iam.admin.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standalone_iam_has_no_members_to_change() {
    let t = start(1, |_| {}).await;
    let m = members(&t.admin).await;
    assert!(!m.replicated && m.members.len() == 1, "{m:?}");
    let e =
        t.admin.add_iam_member(pb::AddIamMemberRequest { id: 2, address: "127.0.0.1:1".into(), learner_only: false });
    assert_eq!(e.await.unwrap_err().reason, opendsec_common::Reason::InvalidState);
    let token = principal(&t.admin, "someone", "root", &["sandbox.create"]).await;
    let them = client(&t.cluster, &token);
    let e = them.iam_members(pb::IamMembersRequest {}).await.unwrap_err();
    assert_eq!(e.reason, opendsec_common::Reason::PermissionDenied, "{e}");
    t.cluster.shutdown().await;
}

/// A small ext4 file system on a loop device, mounted at `at` (root only), unmounted when
/// dropped.
struct SmallDisk {
    at: std::path::PathBuf,
    _image: tempfile::TempDir,
}

impl SmallDisk {
    fn mount(at: &std::path::Path, mib: u64) -> SmallDisk {
        let image = tempfile::tempdir().expect("tempdir");
        let file = image.path().join("disk.img");
        std::fs::File::create(&file).and_then(|f| f.set_len(mib << 20)).expect("disk image");
        let run = |cmd: &mut std::process::Command| {
            let out = cmd.output().expect("run");
            assert!(out.status.success(), "{cmd:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        // No blocks reserved for root: IAM runs as root here, and full must mean full.
        run(std::process::Command::new("mkfs.ext4").args(["-q", "-F", "-m", "0"]).arg(&file));
        std::fs::create_dir_all(at).expect("mount point");
        run(std::process::Command::new("mount").args(["-o", "loop"]).arg(&file).arg(at));
        SmallDisk { at: at.to_path_buf(), _image: image }
    }

    /// Writes a file until the file system has no room left; answers its path.
    fn fill(&self) -> std::path::PathBuf {
        use std::io::Write;
        let path = self.at.join("filler");
        let mut f = std::fs::File::create(&path).expect("filler");
        let chunk = vec![0x5a_u8; 64 << 10];
        loop {
            match f.write(&chunk) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.kind() == std::io::ErrorKind::StorageFull => break,
                Err(e) => panic!("filling {}: {e}", self.at.display()),
            }
        }
        // What delayed allocation still held back fails here or is written.
        let _ = f.sync_all();
        path
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.at).status();
    }
}

/// Creates sandboxes in `project` until `done` holds, retrying through IAM's elections;
/// answers how many were created.
async fn create_until<F: std::future::Future<Output = bool>>(
    admin: &Client,
    project: &str,
    what: &str,
    mut done: impl FnMut() -> F,
) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut created = 0;
    while !done().await {
        match admin.create_sandbox(spec(project, 10, 16)).await {
            Ok(_) => created += 1,
            Err(e) => {
                assert!(Instant::now() < deadline, "{what}: {e}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        assert!(Instant::now() < deadline, "{what}: not within 90 s");
    }
    created
}

/// Member 3 keeps its store on a small file system of its own. When that fills (as a follower,
/// then as the leader), its Raft stops on the failed write: it answers nothing and grants no
/// vote, and the two others go on admitting. Once space returns it reopens its store, rejoins
/// and catches up; led by it, the cluster answers with every admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_whose_disk_fills_stops_and_rejoins_when_space_returns() {
    let dir = tempfile::tempdir().expect("tempdir");
    let disk = SmallDisk::mount(&dir.path().join("iam").join("member-3"), 48);
    // A creation whose admission was committed as its leader's disk filled may have been
    // answered with an error: reconciliation releases such a lease, soon here.
    let t = start3_in(dir, |c| {
        c.iam.reconcile_min_age = Duration::from_millis(500);
        c.watcher.reconcile_interval = Duration::from_millis(500);
    })
    .await;
    let admin = t.admin.clone();
    admin
        .create_project(pb::CreateProjectRequest { path: "root/full".into(), ..Default::default() })
        .await
        .expect("project");
    let three = t.cluster.iam_replica(3).expect("member 3");
    let mut created = 0;

    for (round, leader_first) in [(1, 1), (2, 3)] {
        admin.transfer_iam_leader(pb::TransferIamLeaderRequest { to: leader_first }).await.expect("transfer");
        let filler = disk.fill();
        created += create_until(&admin, "root/full", "member 3 stopped on its full disk", || {
            let stopped = three.stopped_on();
            async move { stopped.is_some() }
        })
        .await;
        let why = three.stopped_on().unwrap();
        assert!(why.to_lowercase().contains("space") || why.contains("28"), "round {round}: stopped on {why}");
        eprintln!("round {round} (member {leader_first} led): member 3 stopped on: {why}");

        // The others go on without it (a new leader first, when it led); it takes nothing.
        let stopped_at = members(&admin).await;
        let behind = stopped_at.members.iter().find(|m| m.id == 3).map(|m| m.matched_index);
        let more = create_until(&admin, "root/full", "admissions without member 3", {
            let n = std::sync::atomic::AtomicU64::new(0);
            move || {
                let n = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                async move { n >= 30 }
            }
        })
        .await;
        created += more;
        assert_eq!(more, 30);
        assert_ne!(leader(&admin).await, 3, "round {round}");
        let m = members(&admin).await;
        let now = m.members.iter().find(|m| m.id == 3).map(|m| m.matched_index);
        assert!(now <= behind.max(Some(stopped_at.committed_index)), "round {round}: member 3 took entries: {m:?}");
        assert!(m.committed_index > stopped_at.committed_index, "{m:?}");
        assert!(three.stopped_on().is_some(), "round {round}: member 3 started again on a full disk");

        // Space returns: member 3 starts again by itself and catches up.
        std::fs::remove_file(&filler).expect("free the disk");
        eventually("member 3 started again and caught up", Duration::from_secs(30), || async {
            let m = members(&admin).await;
            let top = m.members.iter().map(|m| m.matched_index).max().unwrap_or(0);
            three.stopped_on().is_none()
                && three.raft.restarts() == round
                && m.members.iter().find(|x| x.id == 3).is_some_and(|x| x.matched_index >= top && top > 0)
        })
        .await;
    }

    // Led by member 3, whose state was reloaded from its store twice, the cluster answers
    // with every admission: usage is every sandbox that exists (all that were answered
    // created, and any whose answer was lost), once reconciliation has run.
    admin.transfer_iam_leader(pb::TransferIamLeaderRequest { to: 3 }).await.expect("transfer to 3");
    assert_eq!(leader(&admin).await, 3);
    let listed = admin
        .list_all_sandboxes(pb::ListSandboxesRequest { project: "root/full".into(), ..Default::default() })
        .await
        .expect("list")
        .len() as u64;
    assert!(listed >= created, "{listed} sandboxes, {created} answered created");
    eventually("usage equals the sandboxes there are", Duration::from_secs(20), || async {
        live(&admin, "root/full").await == listed
    })
    .await;
    let TestCluster { cluster, dir, .. } = t;
    cluster.shutdown().await;
    drop(disk);
    drop(dir);
}

/// A member whose data directory was wiped comes back blank: its cluster has recorded its old
/// directory, so it refuses every message that names that one as its own (and the others
/// refuse it). It takes nothing, the others go on, and the id it ran under cannot be added
/// again: a replacement takes a new id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wiped_member_is_refused_and_its_id_is_not_reused() {
    let mut t = start3(|_| {}).await;
    let admin = t.admin.clone();
    eventually("every member's data directory recorded", Duration::from_secs(20), || async {
        members(&admin).await.members.iter().all(|m| !m.data_dir.is_empty())
    })
    .await;
    let before = members(&admin).await;
    let recorded = before.members.iter().find(|m| m.id == 3).map(|m| m.data_dir.clone()).unwrap();
    let address = before.members.iter().find(|m| m.id == 3).map(|m| m.address.clone()).unwrap();
    admin.transfer_iam_leader(pb::TransferIamLeaderRequest { to: 1 }).await.expect("transfer");
    admin
        .create_project(pb::CreateProjectRequest { path: "root/w".into(), ..Default::default() })
        .await
        .expect("project");
    for _ in 0..10 {
        admin.create_sandbox(spec("root/w", 10, 16)).await.expect("create");
    }

    t.cluster.stop_iam_member(3).await.expect("stop member 3");
    std::fs::remove_dir_all(t.dir.path().join("iam").join("member-3")).expect("wipe member 3");
    t.cluster.start_iam_member(3).await.expect("start member 3 on an empty directory");
    let three = t.cluster.iam_replica(3).expect("member 3");
    eventually("member 3 refuses its cluster's messages", Duration::from_secs(20), || {
        let refused = three.raft.refused();
        async move { refused.is_some_and(|r| r.contains("wiped or replaced")) }
    })
    .await;
    eprintln!("member 3 refused: {}", three.raft.refused().unwrap());

    // The others go on; member 3 holds no log; its old directory stays recorded.
    for _ in 0..10 {
        admin.create_sandbox(spec("root/w", 10, 16)).await.expect("create without member 3");
    }
    assert_eq!(three.last_log_index(), None, "the wiped member took entries");
    let m = members(&admin).await;
    assert_eq!(m.members.iter().find(|m| m.id == 3).map(|m| m.data_dir.as_str()), Some(recorded.as_str()));

    // Replaced under the same id: refused before anything is proposed.
    admin.remove_iam_member(pb::RemoveIamMemberRequest { id: 3 }).await.expect("remove member 3");
    let e = admin.add_iam_member(pb::AddIamMemberRequest { id: 3, address, learner_only: false }).await.unwrap_err();
    assert_eq!(e.reason, opendsec_common::Reason::AlreadyExists, "{e}");
    assert!(e.to_string().contains("never used"), "{e}");
    assert_eq!(live(&admin, "root/w").await, 20);
    t.cluster.shutdown().await;
}

/// A leader logs a fenced reconciliation (its lock holder and read time, which a member on the
/// release before would ignore) only once every member has answered as a release that reads
/// one. A member that says nothing of its log format, as that release does, holds them back
/// with INVALID_STATE; other commands go on; once it answers with the current format, they
/// go through again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fenced_reconciliations_wait_until_every_member_reads_them() {
    use opendsec_iam::command::{Command, Output};
    use opendsec_iam::raft::net::LOG_FORMAT;
    let t = start3(|_| {}).await;
    let lead = leader(&t.admin).await;
    let replica = t.cluster.iam_replica(lead).expect("the leader");
    let other = (1..=3).find(|id| *id != lead).unwrap();
    let now = opendsec_common::time::now_ms;
    // The reconcile lock: this test's, or the watcher's if it holds it.
    let lock = Command::AcquireLock {
        now_ms: now(),
        name: opendsec_common::RECONCILE_LOCK.into(),
        holder: "format-test".into(),
        ttl_ms: 120_000,
    };
    let Ok(Output::Lock { holder, .. }) = replica.execute(lock.clone()).await else { panic!("the lock") };
    let reconcile = || Command::FencedReconcile {
        now_ms: now(),
        edge: "edge-none".into(),
        live: Vec::new(),
        min_age_ms: 0,
        holder: holder.clone(),
        read_at_ms: now(),
    };
    let sweep = || Command::FencedSweep {
        now_ms: now(),
        known_edges: vec!["edge-001".into()],
        older_than_ms: 3_600_000,
        holder: holder.clone(),
    };
    let heard = |format: u32| {
        let replica = replica.clone();
        move || {
            let f = replica.who.format_of(other);
            async move { f == Some(format) }
        }
    };
    eventually("the member's log format", Duration::from_secs(10), heard(LOG_FORMAT)).await;
    assert!(matches!(replica.execute(reconcile()).await, Ok(Output::Reconciled { .. })));

    // Member `other` plays the release before.
    let old = t.cluster.iam_replica(other).expect("the other member");
    old.who.announce_format(1);
    eventually("the older member's answers", Duration::from_secs(10), heard(1)).await;
    for cmd in [reconcile(), sweep()] {
        let kind = cmd.kind();
        match replica.execute(cmd).await {
            Err(opendsec_iam::IamError::InvalidState(m)) => assert!(m.contains(&format!("[{other}]")), "{m}"),
            r => panic!("{kind} proposed while member {other} reads an older log: {r:?}"),
        }
    }
    // An edge's charge of a pool member waits too; a claim's Admit goes as a plain one (its
    // own charge, no member's moved).
    let res = opendsec_iam::Resources { cpu_millis: 1, memory_mb: 1, disk_mb: 1, gpus: 0 };
    let member = Command::AdmitMember {
        now_ms: now(),
        edge: "edge-none".into(),
        lease_id: "format-member".into(),
        project: "root".into(),
        pool: "warm".into(),
        resources: res,
    };
    assert!(matches!(replica.execute(member).await, Err(opendsec_iam::IamError::InvalidState(_))));
    let (token_id, _) = opendsec_common::config::parse_token_shape(&t.cluster.admin_token).unwrap();
    let claim = Command::AdmitClaim {
        actor: opendsec_iam::Actor { principal: "admin".into(), token_id: token_id.into() },
        now_ms: now(),
        lease_id: "format-claim".into(),
        project: "root".into(),
        resources: res,
        edge: "edge-none".into(),
        keep_existing: false,
        egress: Vec::new(),
        pool: "root//warm".into(),
    };
    match replica.execute(claim).await {
        Ok(Output::Admitted(a)) => assert_eq!(a.member_lease, ""),
        r => panic!("a claim's admit while member {other} reads an older log: {r:?}"),
    }
    // A reconciliation reporting a member's lease, while a member reads format 2 (fenced
    // reconciliations, not pools): it goes without the member's lease (an older member would
    // adopt it), and the plain leases in it are adopted.
    old.who.announce_format(2);
    eventually("the older member's answers", Duration::from_secs(10), heard(2)).await;
    let with_member = Command::FencedReconcile {
        now_ms: now(),
        edge: "edge-none".into(),
        live: vec![
            opendsec_iam::LiveLease {
                lease_id: "format-member".into(),
                project: "root".into(),
                principal: String::new(),
                resources: res,
                pool: "root//warm".into(),
            },
            opendsec_iam::LiveLease {
                lease_id: "format-plain".into(),
                project: "root".into(),
                principal: String::new(),
                resources: res,
                pool: String::new(),
            },
        ],
        min_age_ms: 0,
        holder: holder.clone(),
        read_at_ms: now(),
    };
    match replica.execute(with_member).await {
        Ok(Output::Reconciled { adopted, .. }) => assert_eq!(adopted, 1),
        r => panic!("a reconciliation naming a member while member {other} reads format 2: {r:?}"),
    }
    old.who.announce_format(1);
    eventually("the older member's answers", Duration::from_secs(10), heard(1)).await;
    // A member that does not lead refuses as Raft would (its caller goes to the leader).
    assert!(matches!(old.execute(reconcile()).await, Err(opendsec_iam::IamError::NotLeader(_))));
    // What every release reads goes on.
    assert!(matches!(replica.execute(lock).await, Ok(Output::Lock { .. })));

    old.who.announce_format(LOG_FORMAT);
    eventually("the upgraded member's answers", Duration::from_secs(10), heard(LOG_FORMAT)).await;
    assert!(matches!(replica.execute(reconcile()).await, Ok(Output::Reconciled { .. })));
    assert!(matches!(replica.execute(sweep()).await, Ok(Output::Released { .. })));
    t.cluster.shutdown().await;
}
