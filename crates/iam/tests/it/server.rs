//! IAM through its real store and its real gRPC server: state survives a reopen (leases and
//! usage included), group commit under concurrency, backup and restore, and the services over
//! mTLS behind the role table (apiservers decide, edges release their own leases, watchers
//! reconcile and lock).

use std::time::Duration;

use opendsec_common::grpc;
use opendsec_common::pki::Role;
use opendsec_common::{ApiError, Reason};
use opendsec_iam::{Authenticated, GrantRecord, Iam, IamError, IamOptions, LiveLease, Quota, Resources, State, to_api};
use opendsec_proto::v1 as pb;
use opendsec_testkit::creds;
use tonic::Request;

const ADMIN_TOKEN: &str = "dsk.admin01.AdminSecretAdminSecret0123456789";

fn options(dir: &std::path::Path, admin_token: &str) -> IamOptions {
    IamOptions {
        data_dir: dir.join("iam"),
        admin_principal: "admin".into(),
        admin_token: admin_token.into(),
        reconcile_min_age: Duration::from_secs(60),
        commit_batch_max: 256,
    }
}

fn res(cpu: u64) -> Resources {
    Resources { cpu_millis: cpu, memory_mb: 64, disk_mb: 0, gpus: 0 }
}

fn reason(e: &IamError) -> Reason {
    to_api(e).reason
}

async fn user_with_token(iam: &Iam, admin: &Authenticated, name: &str, project: &str) -> String {
    iam.create_principal(admin, name, project).await.unwrap();
    let g = GrantRecord { principal: name.into(), project: project.into(), permission: "sandbox.create".into() };
    iam.grant(admin, g).await.unwrap();
    iam.create_token(admin, name, 0, "test").await.unwrap().0
}

fn snapshot(iam: &Iam) -> State {
    iam.read(|s| s.clone())
}

#[test]
fn first_start_needs_a_usable_admin_token() {
    let dir = tempfile::tempdir().unwrap();
    for bad in ["", "not-a-token", "dsk.admin.change-me-please-0123"] {
        let r = Iam::open(options(dir.path(), bad));
        assert!(matches!(r, Err(IamError::AdminToken(_))), "{bad}");
    }
    let iam = Iam::open(options(dir.path(), ADMIN_TOKEN)).unwrap();
    let who = iam.authenticate(ADMIN_TOKEN).unwrap();
    assert_eq!((who.principal.as_str(), who.project.as_str()), ("admin", "root"));
    drop(iam);
    // Later starts ignore the option, even an empty one.
    let iam = Iam::open(options(dir.path(), "")).unwrap();
    assert!(iam.authenticate(ADMIN_TOKEN).is_ok());
}

#[tokio::test]
async fn state_survives_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let iam = Iam::open(options(dir.path(), ADMIN_TOKEN)).unwrap();
    let admin = iam.authenticate(ADMIN_TOKEN).unwrap();
    iam.create_project(&admin, "root/a", Quota { cpu_millis: Some(10_000), ..Quota::default() }).await.unwrap();
    iam.create_project(&admin, "root/a/b", Quota::default()).await.unwrap();
    let token = user_with_token(&iam, &admin, "worker", "root/a").await;
    iam.admit(&token, "lease-1", "root/a/b", res(1000), "e1", false, Vec::new(), "").await.unwrap();
    iam.admit(&token, "lease-2", "root/a", res(2000), "e2", false, Vec::new(), "").await.unwrap();
    iam.admit(&token, "lease-3", "root/a", res(500), "e2", false, Vec::new(), "").await.unwrap();
    assert_eq!(iam.release_leases(vec!["lease-3".into()], "").await.unwrap(), 1);
    iam.acquire_lock("leader", "w1", 10_000).await.unwrap();
    let before = snapshot(&iam);
    assert_eq!(before.usage("root/a").unwrap().cpu_millis, 3000);
    drop(iam);

    let iam = Iam::open(options(dir.path(), "dsk.other.AnotherSecret0123456789")).unwrap();
    let after = snapshot(&iam);
    assert_eq!(after, before);
    assert_eq!(after.usage("root").unwrap().sandboxes, 2);
    assert_eq!(iam.get_lease("lease-2").unwrap().unwrap().edge, "e2");
    assert!(iam.authenticate(&token).is_ok());
    assert!(iam.authenticate("dsk.other.AnotherSecret0123456789").is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lone_command_is_committed_by_its_caller_and_a_crowd_by_the_commit_thread() {
    let dir = tempfile::tempdir().unwrap();
    let iam = std::sync::Arc::new(Iam::open(options(dir.path(), ADMIN_TOKEN)).unwrap());
    let admin = iam.authenticate(ADMIN_TOKEN).unwrap();
    iam.create_project(&admin, "root/p", Quota::default()).await.unwrap();
    let token = user_with_token(&iam, &admin, "worker", "root/p").await;
    // One at a time (after the setup's few): each command is alone in the queue, so its caller
    // commits it on its own thread.
    let (callers, thread) = iam.commits_made();
    for i in 0..50 {
        iam.admit(&token, &format!("one-{i}"), "root/p", res(10), "e1", false, Vec::new(), "").await.unwrap();
    }
    let (callers_after, thread_after) = iam.commits_made();
    assert_eq!((callers_after - callers, thread_after - thread), (50, 0));
    // Many at once: the first caller leads, the commit thread commits the crowd in batches.
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..400 {
        let (iam, token) = (iam.clone(), token.clone());
        tasks.spawn(async move {
            iam.admit(&token, &format!("many-{i}"), "root/p", res(10), "e1", false, Vec::new(), "").await.unwrap();
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    let (callers_end, thread_end) = iam.commits_made();
    assert!(thread_end > thread_after, "the crowd went to the commit thread");
    assert!(callers_end - callers_after + thread_end - thread_after < 400, "and was committed in batches");
    // A leader that goes away before it commits (its caller's future dropped right after it
    // queued): the commit thread commits for it, and the next command is not left waiting.
    let gone =
        futures::FutureExt::now_or_never(iam.admit(&token, "gone", "root/p", res(10), "e1", false, Vec::new(), ""));
    assert!(gone.is_none(), "the leader waits for what is made ready with it");
    tokio::time::timeout(
        Duration::from_secs(10),
        iam.admit(&token, "next", "root/p", res(10), "e1", false, Vec::new(), ""),
    )
    .await
    .expect("the next command was left waiting")
    .unwrap();
    assert!(iam.get_lease("gone").unwrap().is_some(), "a queued command is committed");
    let before = snapshot(&iam);
    assert_eq!(before.usage("root/p").unwrap().sandboxes, 452);
    drop(iam);
    let iam = Iam::open(options(dir.path(), ADMIN_TOKEN)).unwrap();
    assert_eq!(snapshot(&iam), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_admits_are_group_committed() {
    let dir = tempfile::tempdir().unwrap();
    let iam = Iam::open(options(dir.path(), ADMIN_TOKEN)).unwrap();
    let admin = iam.authenticate(ADMIN_TOKEN).unwrap();
    iam.create_project(&admin, "root/load", Quota { sandboxes: Some(1500), ..Quota::default() }).await.unwrap();
    let token = user_with_token(&iam, &admin, "loader", "root/load").await;
    let tasks: Vec<_> = (0..2000)
        .map(|i| {
            let (iam, token) = (iam.clone(), token.clone());
            tokio::spawn(async move {
                iam.admit(&token, &format!("l{i}"), "root/load", res(10), "e1", false, Vec::new(), "").await
            })
        })
        .collect();
    let (mut ok, mut over) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => ok += 1,
            Err(e) => {
                assert_eq!(reason(&e), Reason::QuotaExceeded, "{e}");
                over += 1;
            }
        }
    }
    assert_eq!((ok, over), (1500, 500));
    let before = snapshot(&iam);
    assert_eq!(before.usage("root/load").unwrap().sandboxes, 1500);
    // Every successful admit was durable before it was answered.
    drop(iam);
    let iam = Iam::open(options(dir.path(), "")).unwrap();
    assert_eq!(snapshot(&iam).usage("root/load").unwrap().sandboxes, 1500);
    assert_eq!(snapshot(&iam).leases().count(), 1500);
}

#[tokio::test]
async fn a_kept_lease_is_answered_without_a_command() {
    let dir = tempfile::tempdir().unwrap();
    let iam = Iam::open(options(dir.path(), ADMIN_TOKEN)).unwrap();
    let admin = iam.authenticate(ADMIN_TOKEN).unwrap();
    iam.create_project(&admin, "root/a", Quota::default()).await.unwrap();
    let token = user_with_token(&iam, &admin, "worker", "root/a").await;
    let other = user_with_token(&iam, &admin, "other", "root/a").await;
    let first = iam.admit(&token, "lease-1", "root/a", res(100), "e1", true, Vec::new(), "").await.unwrap();
    assert_eq!((first.existing, first.edge.as_str()), (false, "e1"));
    let applied = snapshot(&iam).meta().applied_index;
    let again = iam.admit(&token, "lease-1", "root/a", res(100), "e2", true, Vec::new(), "").await.unwrap();
    assert_eq!((again.existing, again.edge.as_str(), again.bound_at_ms), (true, "e1", first.bound_at_ms));
    let e = iam.admit(&other, "lease-1", "root/a", res(100), "e2", true, Vec::new(), "").await.unwrap_err();
    assert_eq!(reason(&e), Reason::AlreadyExists);
    assert_eq!(snapshot(&iam).meta().applied_index, applied, "no command was committed");
    assert_eq!(iam.get_lease("lease-1").unwrap().unwrap().edge, "e1");
    // GetLeases, in request order, unknown ids left out; too many ids at once are refused.
    iam.admit(&token, "lease-2", "root/a", res(100), "e2", false, Vec::new(), "").await.unwrap();
    let ids = ["lease-2", "x", "lease-1"].map(String::from);
    let got: Vec<String> = iam.get_leases(&ids).unwrap().into_iter().map(|l| l.id).collect();
    assert_eq!(got, ["lease-2", "lease-1"]);
    let many = vec!["x".to_string(); opendsec_iam::MAX_GET_LEASES + 1];
    assert_eq!(reason(&iam.get_leases(&many).unwrap_err()), Reason::InvalidArgument);
    // Releasing with the edge: only what is bound there.
    assert_eq!(iam.release_leases(ids.to_vec(), "e1").await.unwrap(), 1);
    assert!(iam.get_lease("lease-2").unwrap().is_some());
}

#[tokio::test]
async fn reconcile_and_sweep_go_through_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let mut opts = options(dir.path(), ADMIN_TOKEN);
    opts.reconcile_min_age = Duration::ZERO;
    let iam = Iam::open(opts).unwrap();
    let live = vec![LiveLease {
        lease_id: "found".into(),
        project: "root".into(),
        principal: String::new(),
        resources: res(5),
        pool: String::new(),
    }];
    // Only for the reconcile lock's holder; without a holder, not at all.
    let e = iam.reconcile("e9", "w1", 0, live.clone()).await.unwrap_err();
    assert_eq!(reason(&e), Reason::InvalidState, "{e}");
    assert_eq!(reason(&iam.reconcile("e9", "", 0, live.clone()).await.unwrap_err()), Reason::InvalidArgument);
    assert_eq!(reason(&iam.reconcile("e9", "w1", -1, live.clone()).await.unwrap_err()), Reason::InvalidArgument);
    assert!(iam.acquire_lock(opendsec_common::RECONCILE_LOCK, "w1", 60_000).await.unwrap().0);
    assert_eq!(iam.reconcile("e9", "w1", 0, live).await.unwrap(), (1, 0));
    assert_eq!(iam.reconcile("e9", "w1", 0, vec![]).await.unwrap(), (0, 1));
    let a = iam.admit(ADMIN_TOKEN, "x1", "root", res(5), "gone", false, Vec::new(), "").await.unwrap();
    assert_eq!((a.principal.as_str(), a.rebound, a.existing, a.edge.as_str()), ("admin", false, false, "gone"));
    assert_eq!(reason(&iam.sweep_unbound(vec!["e9".into()], 0, "w2").await.unwrap_err()), Reason::InvalidState);
    assert_eq!(reason(&iam.sweep_unbound(vec!["e9".into()], 0, "").await.unwrap_err()), Reason::InvalidArgument);
    assert_eq!(iam.sweep_unbound(vec!["e9".into()], 0, "w1").await.unwrap(), 1);
    assert_eq!(snapshot(&iam).leases().count(), 0);
}

#[tokio::test]
async fn restore_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let iam = Iam::open(options(dir.path(), ADMIN_TOKEN)).unwrap();
    let admin = iam.authenticate(ADMIN_TOKEN).unwrap();
    iam.create_project(&admin, "root/a", Quota::default()).await.unwrap();
    let token = user_with_token(&iam, &admin, "worker", "root/a").await;
    iam.admit(&token, "lease-1", "root/a", res(100), "e1", false, Vec::new(), "").await.unwrap();
    let backup = iam.backup(&admin).unwrap();

    iam.create_project(&admin, "root/later", Quota::default()).await.unwrap();
    let later = user_with_token(&iam, &admin, "later", "root/a").await;
    let epoch = iam.epoch();

    // Garbage and truncated backups change nothing.
    for bad in [b"garbage".to_vec(), backup[..backup.len() / 2].to_vec(), Vec::new()] {
        let e = iam.restore(&admin, &bad).await.unwrap_err();
        assert_eq!(reason(&e), Reason::InvalidArgument, "{e}");
    }
    assert_eq!(iam.epoch(), epoch);
    assert!(iam.get_project(&admin, "root/later").is_ok());
    // Only iam.admin on root may restore.
    let worker = iam.authenticate(&token).unwrap();
    assert_eq!(reason(&iam.restore(&worker, &backup).await.unwrap_err()), Reason::PermissionDenied);

    iam.restore(&admin, &backup).await.unwrap();
    assert!(iam.epoch() > epoch);
    assert_eq!(reason(&iam.get_project(&admin, "root/later").unwrap_err()), Reason::NotFound);
    assert!(iam.authenticate(&later).is_err(), "tokens made after the backup are gone");
    assert!(iam.authenticate(&token).is_ok(), "tokens in the backup still work");
    assert!(iam.get_lease("lease-1").unwrap().is_some(), "leases are kept");
    let restored = snapshot(&iam);
    drop(iam);
    let iam = Iam::open(options(dir.path(), "")).unwrap();
    assert_eq!(snapshot(&iam), restored);
}

// ----- gRPC -----

struct Server {
    addr: String,
    pki: std::path::PathBuf,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<Result<(), IamError>>,
    _dir: tempfile::TempDir,
}

async fn start() -> Server {
    let dir = tempfile::tempdir().unwrap();
    let iam = Iam::open(options(dir.path(), ADMIN_TOKEN)).unwrap();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let pki = dir.path().join("pki");
    let tls = creds(&pki, Role::Iam, "0");
    let task = tokio::spawn(async move {
        opendsec_iam::serve(iam, listener, &tls, async {
            let _ = rx.await;
        })
        .await
    });
    Server { addr, pki, stop: Some(tx), task, _dir: dir }
}

/// A channel to the server as component `role`/`name`.
fn channel(server: &Server, role: Role, name: &str) -> tonic::transport::Channel {
    grpc::Links::new(creds(&server.pki, role, name)).channel(&server.addr, Role::Iam, None).unwrap()
}

fn iam_client(server: &Server, role: Role, name: &str) -> pb::iam_client::IamClient<tonic::transport::Channel> {
    pb::iam_client::IamClient::new(channel(server, role, name))
}

fn admin_client(server: &Server) -> pb::admin_client::AdminClient<tonic::transport::Channel> {
    pb::admin_client::AdminClient::new(channel(server, Role::Apiserver, "0"))
}

fn as_caller<T>(token: &str, msg: T) -> Request<T> {
    let mut req = Request::new(msg);
    grpc::set_bearer(&mut req, token).unwrap();
    req
}

fn api(s: tonic::Status) -> ApiError {
    ApiError::from_status(&s)
}

/// AdmitMany answers every item as Admit would, in item order, each on its own: a refusal
/// (over quota, with its metadata; a bad token; a malformed lease id) touches no other item.
/// Too many items, or a caller that may not admit, are refused as a whole.
#[tokio::test]
async fn grpc_admit_many_answers_each_item_on_its_own() {
    let server = start().await;
    let mut iam = iam_client(&server, Role::Apiserver, "0");
    let mut admin = admin_client(&server);
    let quota = pb::Quota { sandboxes: Some(2), ..Default::default() };
    let create = pb::CreateProjectRequest { path: "root/many".into(), quota: Some(quota) };
    admin.create_project(as_caller(ADMIN_TOKEN, create)).await.unwrap();
    let item = |token: &str, lease: &str| pb::AdmitRequest {
        token: token.into(),
        lease_id: lease.into(),
        project: "root/many".into(),
        resources: Some(pb::Resources { cpu_millis: 100, memory_mb: 64, disk_mb: 64, gpus: 0 }),
        edge: "e1".into(),
        keep_existing: false,
        egress: Vec::new(),
        pool: String::new(),
    };
    let items = vec![
        item(ADMIN_TOKEN, "many-1"),
        item("dsk.admin.NotTheAdminSecret0123456789abcdefgh", "many-2"),
        item(ADMIN_TOKEN, "Not A Lease!"),
        item(ADMIN_TOKEN, "many-3"),
        item(ADMIN_TOKEN, "many-4"),
    ];
    let results = iam.admit_many(pb::AdmitManyRequest { items }).await.unwrap().into_inner().results;
    let outcome: Vec<String> = results
        .iter()
        .map(|r| match (&r.admitted, &r.error) {
            (Some(a), None) => format!("admitted on {}", a.edge),
            (None, Some(e)) => e.reason.clone(),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        outcome,
        ["admitted on e1", "unauthenticated", "invalid_argument", "admitted on e1", "quota_exceeded"],
        "{results:?}"
    );
    let over = ApiError::from_detail(results[4].error.as_ref().unwrap());
    assert_eq!(over.metadata.get("project").map(String::as_str), Some("root/many"), "{over:?}");
    let usage = admin
        .get_usage(as_caller(ADMIN_TOKEN, pb::GetUsageRequest { project: "root/many".into() }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(usage.projects[0].usage.unwrap().sandboxes, 2);

    let too_many = (0..=opendsec_iam::MAX_ADMIT_MANY).map(|i| item(ADMIN_TOKEN, &format!("x-{i}"))).collect();
    let e = api(iam.admit_many(pb::AdmitManyRequest { items: too_many }).await.unwrap_err());
    assert_eq!(e.reason, Reason::InvalidArgument, "{e:?}");
    let mut edge = iam_client(&server, Role::Edge, "e1");
    let e = api(edge.admit_many(pb::AdmitManyRequest { items: vec![item(ADMIN_TOKEN, "many-9")] }).await.unwrap_err());
    assert_eq!(e.reason, Reason::PermissionDenied);
}

#[tokio::test]
async fn grpc_admit_authenticate_and_revoke() {
    let server = start().await;
    let mut iam = iam_client(&server, Role::Apiserver, "0");
    let mut admin = admin_client(&server);

    // Set up a project with room for one sandbox and a worker allowed to create there.
    let quota = pb::Quota { sandboxes: Some(1), ..Default::default() };
    let p = admin
        .create_project(as_caller(ADMIN_TOKEN, pb::CreateProjectRequest { path: "root/rl".into(), quota: Some(quota) }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.effective.unwrap().sandboxes, Some(1));
    admin
        .create_principal(as_caller(
            ADMIN_TOKEN,
            pb::CreatePrincipalRequest { name: "worker".into(), project: "root/rl".into() },
        ))
        .await
        .unwrap();
    let grant =
        pb::Grant { principal: "worker".into(), project: "root/rl".into(), permission: "sandbox.create".into() };
    admin.grant(as_caller(ADMIN_TOKEN, pb::GrantRequest { grant: Some(grant) })).await.unwrap();
    let created = admin
        .create_token(as_caller(
            ADMIN_TOKEN,
            pb::CreateTokenRequest { principal: "worker".into(), ttl_s: 3600, description: "ci".into() },
        ))
        .await
        .unwrap()
        .into_inner();
    let token = created.token.clone();
    let info = created.info.unwrap();
    assert!(info.expires_at_ms > 0 && !info.revoked);

    // Admit, then the same lease again on another edge (rebound), then a second lease: over quota.
    let admit = |lease: &str, edge: &str| pb::AdmitRequest {
        token: token.clone(),
        lease_id: lease.into(),
        project: "root/rl".into(),
        resources: Some(pb::Resources { cpu_millis: 1000, memory_mb: 512, disk_mb: 1024, gpus: 0 }),
        edge: edge.into(),
        keep_existing: false,
        egress: Vec::new(),
        pool: String::new(),
    };
    let a = iam.admit(admit("lease-1", "e1")).await.unwrap().into_inner();
    assert_eq!((a.principal.as_str(), a.rebound, a.existing, a.edge.as_str()), ("worker", false, false, "e1"));
    assert!(a.bound_at_ms > 0);
    let b = iam.admit(admit("lease-1", "e2")).await.unwrap().into_inner();
    assert_eq!((b.rebound, b.existing, b.edge.as_str()), (true, false, "e2"));
    // keep_existing: the lease stays on e2 and the answer says so (even with the quota full).
    let keep = pb::AdmitRequest { keep_existing: true, ..admit("lease-1", "e3") };
    let k = iam.admit(keep.clone()).await.unwrap().into_inner();
    assert_eq!((k.rebound, k.existing, k.edge.as_str(), k.bound_at_ms), (false, true, "e2", b.bound_at_ms));
    let e = api(iam.admit(admit("lease-2", "e1")).await.unwrap_err());
    assert_eq!(e.reason, Reason::QuotaExceeded);
    assert_eq!(e.metadata.get("project").map(String::as_str), Some("root/rl"));
    let lease = iam.get_lease(pb::GetLeaseRequest { lease_id: "lease-1".into() }).await.unwrap().into_inner();
    assert!(lease.found);
    assert_eq!(lease.lease.unwrap().edge, "e2");
    // The batch lookup answers the known leases only.
    let ids = vec!["lease-1".to_string(), "nope".to_string(), "Not A Lease!".to_string()];
    let found = iam.get_leases(pb::GetLeasesRequest { lease_ids: ids }).await.unwrap().into_inner().leases;
    assert_eq!(found.iter().map(|l| (l.id.as_str(), l.edge.as_str())).collect::<Vec<_>>(), [("lease-1", "e2")]);
    assert_eq!(found[0].principal, "worker");
    // An edge releasing a lease rebound elsewhere frees nothing.
    let from_e1 = pb::ReleaseLeasesRequest { lease_ids: vec!["lease-1".into()], edge: "e1".into() };
    assert_eq!(iam.release_leases(from_e1).await.unwrap().into_inner().released, 0);
    let bad_edge = pb::ReleaseLeasesRequest { lease_ids: vec!["lease-1".into()], edge: "E 1".into() };
    assert_eq!(api(iam.release_leases(bad_edge).await.unwrap_err()).reason, Reason::InvalidArgument);
    let usage = admin
        .get_usage(as_caller(ADMIN_TOKEN, pb::GetUsageRequest { project: "root/rl".into() }))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(usage.projects[0].usage.unwrap().cpu_millis, 1000);

    // Authenticate, then revoke: the epoch moves and the token stops working.
    let who = iam.authenticate(pb::AuthenticateRequest { token: token.clone() }).await.unwrap().into_inner();
    assert_eq!((who.principal.as_str(), who.project.as_str()), ("worker", "root/rl"));
    let me = admin.who_am_i(as_caller(&token, pb::WhoAmIRequest {})).await.unwrap().into_inner();
    assert_eq!(me.grants.len(), 1);
    let e0 = iam.get_epoch(pb::GetEpochRequest::default()).await.unwrap().into_inner().epoch;
    admin.revoke_token(as_caller(ADMIN_TOKEN, pb::RevokeTokenRequest { id: who.token_id.clone() })).await.unwrap();
    let e1 = iam.get_epoch(pb::GetEpochRequest::default()).await.unwrap().into_inner().epoch;
    assert!(e1 > e0, "revocation bumps the epoch ({e0} -> {e1})");
    let e = api(iam.authenticate(pb::AuthenticateRequest { token: token.clone() }).await.unwrap_err());
    assert_eq!(e.reason, Reason::Unauthenticated);
    assert!(!e.message.contains(&token[token.len() - 20..]), "the secret is never echoed");
    assert_eq!(api(iam.admit(admit("lease-1", "e3")).await.unwrap_err()).reason, Reason::Unauthenticated);
    assert_eq!(api(iam.admit(keep).await.unwrap_err()).reason, Reason::Unauthenticated);

    // An edge releases only leases bound to itself: e1 may not speak for e2, e2 may.
    let released = pb::ReleaseLeasesRequest { lease_ids: vec!["lease-1".into(), "nope".into()], edge: "e2".into() };
    let mut e1 = iam_client(&server, Role::Edge, "e1");
    assert_eq!(api(e1.release_leases(released.clone()).await.unwrap_err()).reason, Reason::PermissionDenied);
    let anywhere = pb::ReleaseLeasesRequest { edge: String::new(), ..released.clone() };
    assert_eq!(api(e1.release_leases(anywhere).await.unwrap_err()).reason, Reason::PermissionDenied);
    // Nor may an edge admit, authenticate or reach the admin API.
    assert_eq!(api(e1.admit(admit("lease-7", "e1")).await.unwrap_err()).reason, Reason::PermissionDenied);
    let mut e1_admin = pb::admin_client::AdminClient::new(channel(&server, Role::Edge, "e1"));
    let e = api(e1_admin.who_am_i(as_caller(ADMIN_TOKEN, pb::WhoAmIRequest {})).await.unwrap_err());
    assert_eq!(e.reason, Reason::PermissionDenied);
    let mut e2 = iam_client(&server, Role::Edge, "e2");
    // An edge asking where leases are bound learns that and nothing else (not whose they
    // are or how large), and may not look one up alone.
    let seen = e1.get_leases(pb::GetLeasesRequest { lease_ids: vec!["lease-1".into()] }).await.unwrap().into_inner();
    assert_eq!(seen.leases, vec![pb::Lease { id: "lease-1".into(), edge: "e2".into(), ..Default::default() }]);
    let full = iam.get_leases(pb::GetLeasesRequest { lease_ids: vec!["lease-1".into()] }).await.unwrap().into_inner();
    assert_eq!(full.leases[0].project, "root/rl", "the apiserver sees the whole lease");
    let one = e1.get_lease(pb::GetLeaseRequest { lease_id: "lease-1".into() }).await.unwrap_err();
    assert_eq!(api(one).reason, Reason::PermissionDenied);
    assert_eq!(e2.release_leases(released).await.unwrap().into_inner().released, 1);
    let after = iam.get_leases(pb::GetLeasesRequest { lease_ids: vec!["lease-1".into()] }).await.unwrap();
    assert!(after.into_inner().leases.is_empty());

    // Locks over the wire, for watchers only.
    let lock = |holder: &str| pb::AcquireLockRequest { name: "watcher".into(), holder: holder.into(), ttl_ms: 60_000 };
    assert_eq!(api(iam.acquire_lock(lock("w1")).await.unwrap_err()).reason, Reason::PermissionDenied);
    let mut watcher = iam_client(&server, Role::Watcher, "0");
    assert!(watcher.acquire_lock(lock("w1")).await.unwrap().into_inner().acquired);
    let other = watcher.acquire_lock(lock("w2")).await.unwrap().into_inner();
    assert_eq!((other.acquired, other.holder.as_str()), (false, "w1"));

    // Without a certificate of the cluster CA nothing gets through: plain text, or a
    // certificate of another CA.
    let ch = grpc::channel(&server.addr).unwrap();
    let mut bare = pb::iam_client::IamClient::new(ch.clone());
    assert!(bare.get_epoch(pb::GetEpochRequest::default()).await.is_err());
    let mut bare_admin = pb::admin_client::AdminClient::new(ch);
    assert!(bare_admin.who_am_i(as_caller(ADMIN_TOKEN, pb::WhoAmIRequest {})).await.is_err());
    let other = tempfile::tempdir().unwrap();
    let foreign = grpc::Links::new(creds(other.path(), Role::Apiserver, "0"));
    let mut c = pb::iam_client::IamClient::new(foreign.channel(&server.addr, Role::Iam, None).unwrap());
    assert!(c.get_epoch(pb::GetEpochRequest::default()).await.is_err());
    // A client checks the server too: IAM is not a watcher.
    let confused = grpc::Links::new(creds(&server.pki, Role::Apiserver, "0"));
    let mut c = pb::iam_client::IamClient::new(confused.channel(&server.addr, Role::Watcher, None).unwrap());
    assert!(c.get_epoch(pb::GetEpochRequest::default()).await.is_err());
    // With a certificate but without a bearer token on Admin: unauthenticated.
    let e = api(admin.who_am_i(pb::WhoAmIRequest {}).await.unwrap_err());
    assert_eq!(e.reason, Reason::Unauthenticated);
    // Bad input over the wire: the right reasons.
    let e = api(admin
        .grant(as_caller(
            ADMIN_TOKEN,
            pb::GrantRequest {
                grant: Some(pb::Grant {
                    principal: "worker".into(),
                    project: "root".into(),
                    permission: "root.everything".into(),
                }),
            },
        ))
        .await
        .unwrap_err());
    assert_eq!(e.reason, Reason::InvalidArgument);
    let e = api(iam.admit(pb::AdmitRequest { resources: None, ..admit("lease-9", "e1") }).await.unwrap_err());
    assert_eq!(e.reason, Reason::InvalidArgument);

    let mut server = server;
    let _ = server.stop.take().unwrap().send(());
    server.task.await.unwrap().unwrap();
}
