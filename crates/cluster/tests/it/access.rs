//! End-to-end: tokens, nested projects, quotas, delegation and bad input, through the public
//! API of a real cluster.

use std::time::Duration;

use crate::common::*;
use opendsec_common::Reason;
use opendsec_proto::v1 as pb;
use proptest::prelude::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_token_is_refused_within_two_seconds() {
    let t = start(1, |_| {}).await;
    let tok = principal(&t.admin, "alice", "root", &["sandbox.create", "sandbox.view", "layer.use"]).await;
    let alice = client(&t.cluster, &tok);
    // Warm the apiserver's caches: the revocation must beat them.
    let s = alice.create_sandbox(spec("", 10, 16)).await.unwrap();
    alice.get_sandbox(&s.id).await.unwrap();
    let id = alice.who_am_i(pb::WhoAmIRequest {}).await.unwrap().token_id;
    t.admin.revoke_token(pb::RevokeTokenRequest { id }).await.unwrap();
    eventually("revoked token refused", Duration::from_secs(2), || async {
        matches!(alice.get_sandbox(&s.id).await, Err(e) if e.reason == Reason::Unauthenticated)
    })
    .await;
    assert_eq!(alice.create_sandbox(spec("", 10, 16)).await.unwrap_err().reason, Reason::Unauthenticated);
    t.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_tokens_are_refused() {
    let t = start(1, |_| {}).await;
    let expiring = t
        .admin
        .create_token(pb::CreateTokenRequest { principal: String::new(), ttl_s: 1, description: "short".into() })
        .await
        .unwrap()
        .token;
    let no_token =
        opendsec_client::Client::new(&[t.cluster.apiserver_addr.to_string()], None, &t.cluster.client_tls()).unwrap();
    assert_eq!(no_token.get_sandbox("edge-000.abc").await.unwrap_err().reason, Reason::Unauthenticated);
    for bad in ["garbage", "dsk.", "dsk.nope.0123456789abcdef0123", "dsk.x.y.z"] {
        let c = client(&t.cluster, bad);
        let e = c.list_sandboxes(Default::default()).await.unwrap_err();
        assert_eq!(e.reason, Reason::Unauthenticated, "{bad}: {e}");
        assert!(!e.message.contains("0123456789abcdef0123"), "never echo a secret: {}", e.message);
    }
    let wrong_secret = format!("{}x", &t.cluster.admin_token[..t.cluster.admin_token.len() - 1]);
    assert_eq!(
        client(&t.cluster, &wrong_secret).who_am_i(pb::WhoAmIRequest {}).await.unwrap_err().reason,
        Reason::Unauthenticated
    );
    // The token lives one second: refused once that has passed (asked again until then).
    eventually("the expired token is refused", Duration::from_secs(10), || async {
        match client(&t.cluster, &expiring).who_am_i(pb::WhoAmIRequest {}).await {
            Ok(_) => false,
            Err(e) => {
                assert_eq!(e.reason, Reason::Unauthenticated, "{e}");
                true
            }
        }
    })
    .await;
    t.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delegation_cannot_escalate_and_projects_stay_private() {
    let t = start(1, |_| {}).await;
    project(&t.admin, "root/team-a", pb::Quota { sandboxes: Some(10), ..Default::default() }).await;
    project(&t.admin, "root/team-b", pb::Quota::default()).await;
    let lead = principal(
        &t.admin,
        "lead",
        "root/team-a",
        &["grant.manage", "sandbox.create", "principal.manage", "project.manage"],
    )
    .await;
    // The shared images of root (scratch) are the lead's to use, not to pass on.
    t.admin
        .grant(pb::GrantRequest {
            grant: Some(pb::Grant { principal: "lead".into(), project: "root".into(), permission: "layer.use".into() }),
        })
        .await
        .unwrap();
    let lead_c = client(&t.cluster, &lead);
    lead_c
        .create_principal(pb::CreatePrincipalRequest { name: "intern".into(), project: "root/team-a".into() })
        .await
        .unwrap();

    let grant = |principal: &str, project: &str, permission: &str| pb::GrantRequest {
        grant: Some(pb::Grant { principal: principal.into(), project: project.into(), permission: permission.into() }),
    };
    // What the lead holds, it may pass on; nothing more.
    lead_c.grant(grant("intern", "root/team-a", "sandbox.create")).await.unwrap();
    for (project, perm) in [
        ("root/team-a", "sandbox.view"),
        ("root/team-a", "*"),
        ("root/team-a", "iam.admin"),
        ("root", "sandbox.create"),
        ("root", "layer.use"),
        ("root/team-b", "sandbox.create"),
    ] {
        let e = lead_c.grant(grant("intern", project, perm)).await.unwrap_err();
        assert_eq!(e.reason, Reason::PermissionDenied, "{perm} on {project}: {e}");
    }
    // Nor may the lead raise its own project's quota or touch a sibling.
    let e = lead_c
        .set_quota(pb::SetQuotaRequest { path: "root/team-a".into(), quota: Some(pb::Quota::default()) })
        .await
        .unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied, "{e}");
    lead_c
        .create_project(pb::CreateProjectRequest {
            path: "root/team-a/rl".into(),
            quota: Some(pb::Quota { sandboxes: Some(3), ..Default::default() }),
        })
        .await
        .unwrap();
    for path in ["root/team-b", "root/team-b/x", "root/nope"] {
        let e = lead_c.get_project(pb::GetProjectRequest { path: path.into() }).await.unwrap_err();
        assert_eq!(e.reason, Reason::PermissionDenied, "{path}: {e}");
    }
    let e = lead_c.create_sandbox(spec("root/team-b", 10, 16)).await.unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied);
    // The lead's sandboxes are invisible to a principal of team-b.
    let s = lead_c.create_sandbox(spec("root/team-a/rl", 10, 16)).await.unwrap();
    let bob = principal(&t.admin, "bob", "root/team-b", &["sandbox.create", "sandbox.view", "sandbox.operate"]).await;
    let bob_c = client(&t.cluster, &bob);
    assert_eq!(bob_c.get_sandbox(&s.id).await.unwrap_err().reason, Reason::PermissionDenied);
    assert_eq!(bob_c.stop_sandbox(&s.id).await.unwrap_err().reason, Reason::PermissionDenied);
    let e = bob_c
        .list_sandboxes(pb::ListSandboxesRequest { project: "root/team-a".into(), ..Default::default() })
        .await
        .unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied);
    assert_eq!(bob_c.backup(pb::BackupRequest {}).await.unwrap_err().reason, Reason::PermissionDenied);
    t.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_the_right_reason_and_change_nothing() {
    let t = start(2, |_| {}).await;
    let ok = spec("", 100, 64);
    let mut cases: Vec<(&str, pb::SandboxSpec, Reason)> = Vec::new();
    let mut s = ok.clone();
    s.backend = "kvm".into();
    cases.push(("unknown backend", s, Reason::InvalidArgument));
    let mut s = ok.clone();
    s.backend = String::new();
    cases.push(("empty backend", s, Reason::InvalidArgument));
    let mut s = ok.clone();
    s.image = String::new();
    cases.push(("empty image", s, Reason::InvalidArgument));
    let mut s = ok.clone();
    s.image = "x".repeat(10_000);
    cases.push(("oversized image", s, Reason::InvalidArgument));
    let mut s = ok.clone();
    s.resources = Some(pb::Resources { cpu_millis: 0, memory_mb: 64, disk_mb: 0, gpus: 0 });
    cases.push(("zero cpu", s, Reason::InvalidArgument));
    let mut s = ok.clone();
    s.resources = Some(pb::Resources { cpu_millis: u32::MAX, memory_mb: u64::MAX, disk_mb: u64::MAX, gpus: u32::MAX });
    cases.push(("absurd resources (negative numbers wrap to these)", s, Reason::InvalidArgument));
    let mut s = ok.clone();
    s.resources = None;
    cases.push(("no resources", s, Reason::InvalidArgument));
    let mut s = ok.clone();
    s.project = "root/../etc".into();
    cases.push(("malformed project", s, Reason::InvalidArgument));
    let mut s = ok.clone();
    s.project = "root/missing".into();
    cases.push(("missing project", s, Reason::NotFound));
    let mut s = ok.clone();
    s.labels.insert("k".repeat(1000), "v".into());
    cases.push(("oversized label", s, Reason::InvalidArgument));
    let mut s = ok.clone();
    s.resources = Some(pb::Resources { cpu_millis: 1000, memory_mb: 1 << 20, disk_mb: 0, gpus: 0 });
    cases.push(("bigger than any edge", s, Reason::NoCapacity));
    for (what, s, want) in cases {
        let e = t.admin.create_sandbox(s).await.unwrap_err();
        assert_eq!(e.reason, want, "{what}: {e}");
    }
    let e = t
        .admin
        .create_sandbox_with(pb::CreateSandboxRequest { spec: Some(ok.clone()), lease_id: "Bad Lease!".into() })
        .await
        .unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument);
    let e = t
        .admin
        .create_sandbox_with(pb::CreateSandboxRequest { spec: None, lease_id: String::new() })
        .await
        .unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument);
    // A batch one over the limit is refused before anything happens.
    let e = t.admin.create_sandboxes(ok.clone(), 32_769).await;
    let e = match e {
        Err(e) => e,
        Ok(mut stream) => opendsec_common::ApiError::from_status(&stream.message().await.unwrap_err()),
    };
    assert_eq!(e.reason, Reason::InvalidArgument);
    let e = match t.admin.create_sandboxes(ok.clone(), 0).await {
        Err(e) => e,
        Ok(mut stream) => opendsec_common::ApiError::from_status(&stream.message().await.unwrap_err()),
    };
    assert_eq!(e.reason, Reason::InvalidArgument);
    // Ids: malformed, or naming edges nobody knows.
    for (id, want) in [
        ("", Reason::InvalidArgument),
        ("no-dot", Reason::InvalidArgument),
        ("a.b.c", Reason::InvalidArgument),
        ("ghost-edge.0123abcd", Reason::NotFound),
    ] {
        assert_eq!(t.admin.get_sandbox(id).await.unwrap_err().reason, want, "{id:?}");
        assert_eq!(t.admin.stop_sandbox(id).await.unwrap_err().reason, want, "{id:?}");
    }
    let known_edge = t.cluster.edge_names()[0].clone();
    assert_eq!(t.admin.get_sandbox(&format!("{known_edge}.0123abcd")).await.unwrap_err().reason, Reason::NotFound);
    // IAM administration.
    for (path, want) in [
        ("", Reason::InvalidArgument),
        ("root", Reason::AlreadyExists),
        ("root/a/b", Reason::NotFound),
        ("ROOT/x", Reason::InvalidArgument),
    ] {
        let e = t.admin.create_project(pb::CreateProjectRequest { path: path.into(), quota: None }).await.unwrap_err();
        assert_eq!(e.reason, want, "{path:?}: {e}");
    }
    let e = t
        .admin
        .grant(pb::GrantRequest {
            grant: Some(pb::Grant {
                principal: "admin".into(),
                project: "root".into(),
                permission: "sandbox.fly".into(),
            }),
        })
        .await
        .unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument);
    let e = t.admin.restore(pb::RestoreRequest { data: b"not a backup".to_vec() }).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument);
    // Nothing above changed anything.
    assert_eq!(usage(&t.admin, "root").await, pb::Usage::default());
    let projects = t.admin.list_projects(pb::ListProjectsRequest { path: "root".into() }).await.unwrap().projects;
    assert_eq!(projects.len(), 1);
    assert!(t.admin.list_all_sandboxes(Default::default()).await.unwrap().is_empty());
    t.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn backup_and_restore_round_trip() {
    let t = start(1, |_| {}).await;
    project(&t.admin, "root/keep", pb::Quota { cpu_millis: Some(5000), ..Default::default() }).await;
    let tok = principal(&t.admin, "carol", "root/keep", &["sandbox.create"]).await;
    let backup = t.admin.backup(pb::BackupRequest {}).await.unwrap().data;
    t.admin.delete_principal(pb::DeletePrincipalRequest { name: "carol".into() }).await.unwrap();
    t.admin.delete_project(pb::DeleteProjectRequest { path: "root/keep".into() }).await.unwrap();
    t.admin.restore(pb::RestoreRequest { data: backup }).await.unwrap();
    let p = t.admin.get_project(pb::GetProjectRequest { path: "root/keep".into() }).await.unwrap();
    assert_eq!(p.quota.unwrap().cpu_millis, Some(5000));
    let carol = client(&t.cluster, &tok);
    eventually("restored token works", Duration::from_secs(3), || async {
        carol.who_am_i(pb::WhoAmIRequest {}).await.is_ok()
    })
    .await;
    t.cluster.shutdown().await;
}

/// Concurrent creations across three project levels never over-commit any level.
#[test]
fn quota_is_never_over_committed_under_concurrent_creations() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let t = rt.block_on(start(4, |c| {
        c.apiserver.rate_per_principal = 1e6;
        c.apiserver.burst_per_principal = 1e6;
    }));
    let case = std::sync::atomic::AtomicU32::new(0);
    let mut runner = proptest::test_runner::TestRunner::new(ProptestConfig { cases: 6, ..ProptestConfig::default() });
    let strategy = (
        (1u64..12, 1u64..8, 1u64..6),                            // sandbox quotas: level 1, 2, 3
        (500u64..4000, 300u64..3000),                            // cpu quotas of level 1 and 3
        prop::collection::vec((0usize..3, 100u32..900), 10..40), // (level, cpu) per creation
    );
    runner
        .run(&strategy, |((q1, q2, q3), (cpu1, cpu3), creations)| {
            let n = case.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let levels = [format!("root/p{n}"), format!("root/p{n}/q"), format!("root/p{n}/q/r")];
            rt.block_on(async {
                project(
                    &t.admin,
                    &levels[0],
                    pb::Quota { sandboxes: Some(q1), cpu_millis: Some(cpu1), ..Default::default() },
                )
                .await;
                project(&t.admin, &levels[1], pb::Quota { sandboxes: Some(q2), ..Default::default() }).await;
                project(
                    &t.admin,
                    &levels[2],
                    pb::Quota { sandboxes: Some(q3), cpu_millis: Some(cpu3), ..Default::default() },
                )
                .await;
                let results = futures::future::join_all(creations.iter().map(|(lvl, cpu)| {
                    let admin = t.admin.clone();
                    let p = levels[*lvl].clone();
                    let cpu = *cpu;
                    async move { (lvl, cpu, admin.create_sandbox(spec(&p, cpu, 16)).await) }
                }))
                .await;
                for (_, _, r) in &results {
                    if let Err(e) = r {
                        prop_assert_eq!(e.reason, Reason::QuotaExceeded, "{}", e);
                    }
                }
                let quotas = [(q1, Some(cpu1)), (q2, None), (q3, Some(cpu3))];
                for (i, path) in levels.iter().enumerate() {
                    let u = usage(&t.admin, path).await;
                    // Usage of a level = the successes at it and below.
                    let (count, cpu) = results
                        .iter()
                        .filter(|(l, _, r)| **l >= i && r.is_ok())
                        .fold((0u64, 0u64), |(c, s), (_, cpu, _)| (c + 1, s + u64::from(*cpu)));
                    prop_assert_eq!(u.sandboxes, count, "{}", path);
                    prop_assert_eq!(u.cpu_millis, cpu, "{}", path);
                    let (qs, qc) = quotas[i];
                    prop_assert!(u.sandboxes <= qs, "{}: {} sandboxes > quota {}", path, u.sandboxes, qs);
                    if let Some(qc) = qc {
                        prop_assert!(u.cpu_millis <= qc, "{}: cpu {} > quota {}", path, u.cpu_millis, qc);
                    }
                }
                // Something was admitted whenever the first creation fits every level.
                let chain_cpu = |level: usize| if level == 2 { cpu3.min(cpu1) } else { cpu1 };
                let any_fits = creations.iter().any(|(l, c)| u64::from(*c) <= chain_cpu(*l));
                prop_assert_eq!(results.iter().any(|(_, _, r)| r.is_ok()), any_fits, "not vacuous");
                Ok(())
            })
        })
        .unwrap();
    rt.block_on(t.cluster.shutdown());
}

/// The caller address the E2B gateway names (`x-opendsec-client-addr`) is believed only from
/// a connection with a gateway's certificate: anyone else naming one is counted, and paused,
/// by its own address.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forwarded_client_address_is_believed_only_from_a_gateway() {
    let tc = start(1, |c| c.apiserver.auth_failures.max = 5).await;
    let addr = tc.cluster.apiserver_addr.to_string();
    let ca = std::fs::read(&tc.cluster.ca_path).unwrap();
    let pki_dir = tc.cluster.config.pki_dir();
    let gateway_id = opendsec_common::pki::Identity::new(opendsec_common::pki::Role::Gateway, "0").unwrap();
    let gateway_creds = opendsec_common::tls::Credentials::in_dir(&pki_dir, &gateway_id).unwrap();
    let as_gateway = opendsec_common::grpc::PublicTls::with_ca_as(&ca, None, Some(&gateway_creds)).unwrap();
    let plain = opendsec_common::grpc::PublicTls::with_ca(&ca, None).unwrap();
    let junk = "dsk.junk.0123456789abcdefghijklmnop";
    let whoami = |c: opendsec_client::Client| async move { c.who_am_i(Default::default()).await };
    let client = |tls: &opendsec_common::grpc::PublicTls, token: &str, from: &str| {
        opendsec_client::Client::new(std::slice::from_ref(&addr), None, tls)
            .unwrap()
            .with_token_for(token, Some(from.parse().unwrap()))
            .unwrap()
            .with_retry_timeout(Duration::ZERO)
    };

    // As the gateway, failures named for 192.0.2.7 pause 192.0.2.7 only.
    for _ in 0..5 {
        assert_eq!(whoami(client(&as_gateway, junk, "192.0.2.7")).await.unwrap_err().reason, Reason::Unauthenticated);
    }
    let fresh = principal(&tc.admin, "bob", "root", &["sandbox.view"]).await;
    let e = whoami(client(&as_gateway, &fresh, "192.0.2.7")).await.unwrap_err();
    assert!(e.message.contains("too many failed authentications from 192.0.2.7"), "{e}");
    whoami(client(&as_gateway, &fresh, "192.0.2.8")).await.expect("another client of the gateway");

    // Without a gateway's certificate the header is ignored: the failures count against the
    // caller's own address (loopback), whatever address it names.
    for _ in 0..5 {
        assert_eq!(whoami(client(&plain, junk, "192.0.2.9")).await.unwrap_err().reason, Reason::Unauthenticated);
    }
    let carol = principal(&tc.admin, "carol", "root", &["sandbox.view"]).await;
    let e = whoami(client(&plain, &carol, "192.0.2.10")).await.unwrap_err();
    assert!(e.message.contains("too many failed authentications from 127.0.0.1"), "{e}");
}

/// Tokens minted for one sandbox (`CreateSandboxTokens`, E2B's envd and traffic tokens): the
/// runtime token reaches that sandbox's Runtime calls and reads it, the traffic token its
/// ports only; neither lists, creates, stops or administers anything, another sandbox looks
/// missing to both, and both stop working when the sandbox ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_tokens_reach_their_sandbox_only_and_end_with_it() {
    let tc = start(1, |_| {}).await;
    let key =
        principal(&tc.admin, "alice", "root", &["sandbox.create", "sandbox.view", "sandbox.operate", "layer.use"])
            .await;
    let alice = client(&tc.cluster, &key).with_retry_timeout(Duration::ZERO);
    let a = alice.create_sandbox(spec("root", 100, 64)).await.unwrap();
    let b = alice.create_sandbox(spec("root", 100, 64)).await.unwrap();
    let tokens = alice.create_sandbox_tokens(&a.id).await.unwrap();
    assert_ne!(tokens.runtime_token, key);
    assert_ne!(tokens.runtime_token, tokens.traffic_token);
    // The same tokens every time (E2B's connect answers what its create did).
    assert_eq!(alice.create_sandbox_tokens(&a.id).await.unwrap(), tokens);
    let runtime = client(&tc.cluster, &tokens.runtime_token).with_retry_timeout(Duration::ZERO);
    let traffic = client(&tc.cluster, &tokens.traffic_token).with_retry_timeout(Duration::ZERO);
    let exec = |id: &str| pb::ExecRequest { sandbox_id: id.into(), command: "true".into(), ..Default::default() };
    fn denied<T: std::fmt::Debug>(r: Result<T, opendsec_common::ApiError>) {
        assert_eq!(r.unwrap_err().reason, Reason::PermissionDenied);
    }

    // Neither lists, creates, stops, mints or administers.
    for c in [&runtime, &traffic] {
        denied(c.list_sandboxes(pb::ListSandboxesRequest::default()).await);
        denied(c.create_sandbox(spec("root", 100, 64)).await);
        denied(c.stop_sandbox(&a.id).await);
        denied(c.create_sandbox_tokens(&a.id).await);
        denied(c.who_am_i(Default::default()).await);
        denied(c.create_token(pb::CreateTokenRequest::default()).await);
    }
    // The traffic token does not run commands; the runtime token does, on its sandbox.
    denied(traffic.exec(exec(&a.id)).await);
    let e = runtime.exec(exec(&a.id)).await.expect_err("the sim backend runs no commands");
    assert!(!matches!(e.reason, Reason::PermissionDenied | Reason::NotFound | Reason::Unauthenticated), "{e}");
    assert_eq!(runtime.get_sandbox(&a.id).await.unwrap().id, a.id);
    assert_eq!(traffic.get_sandbox(&a.id).await.unwrap().id, a.id);
    // Another sandbox, even the same caller's, does not exist for them.
    assert_eq!(runtime.exec(exec(&b.id)).await.unwrap_err().reason, Reason::NotFound);
    assert_eq!(runtime.get_sandbox(&b.id).await.unwrap_err().reason, Reason::NotFound);
    assert_eq!(traffic.get_sandbox(&b.id).await.unwrap_err().reason, Reason::NotFound);
    // Someone who may not operate the sandbox gets no tokens for it.
    let viewer = principal(&tc.admin, "vic", "root", &["sandbox.view"]).await;
    let e = client(&tc.cluster, &viewer).create_sandbox_tokens(&a.id).await.unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied, "{e}");

    // The sandbox ends: its tokens stop working (within the epoch poll), and say so as the
    // sandbox being gone; they still count as failed authentications.
    alice.stop_sandbox(&a.id).await.unwrap();
    eventually("the runtime token refused", Duration::from_secs(10), || async {
        runtime.get_sandbox(&a.id).await.is_err_and(|e| e.metadata.contains_key("token_refused"))
    })
    .await;
    let e = traffic.get_sandbox(&a.id).await.unwrap_err();
    assert_eq!((e.reason, e.message.as_str()), (Reason::NotFound, "the sandbox of this token has ended"));
    assert!(tokens.runtime_token.split('.').nth(1).is_some_and(|id| id.len() == 20), "a sandbox token's shape");
}

/// A call for nobody ([`opendsec_common::grpc::PUBLIC_TRAFFIC_HEADER`], E2B's public ports):
/// taken only from a gateway's certificate, only for `HttpRequest` without a token, and only
/// into a sandbox whose spec has `public_traffic`; refused from anyone else, on any other
/// method, and with a token.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_a_gateway_reaches_only_public_sandboxes_for_nobody() {
    let tc = start(1, |c| c.apiserver.auth_failures.max = 8).await;
    let addr = tc.cluster.apiserver_addr.to_string();
    let ca = std::fs::read(&tc.cluster.ca_path).unwrap();
    let gateway_id = opendsec_common::pki::Identity::new(opendsec_common::pki::Role::Gateway, "0").unwrap();
    let gateway_creds = opendsec_common::tls::Credentials::in_dir(&tc.cluster.config.pki_dir(), &gateway_id).unwrap();
    let as_gateway = opendsec_common::grpc::PublicTls::with_ca_as(&ca, None, Some(&gateway_creds)).unwrap();
    let plain = opendsec_common::grpc::PublicTls::with_ca(&ca, None).unwrap();
    let base = |tls: &opendsec_common::grpc::PublicTls| {
        opendsec_client::Client::new(std::slice::from_ref(&addr), None, tls).unwrap().with_retry_timeout(Duration::ZERO)
    };
    let admin = client(&tc.cluster, &tc.cluster.admin_token).with_retry_timeout(Duration::ZERO);
    let public = admin.create_sandbox(pb::SandboxSpec { public_traffic: true, ..spec("root", 100, 64) }).await.unwrap();
    let private = admin.create_sandbox(spec("root", 100, 64)).await.unwrap();
    let http = |id: &str| pb::HttpRequestRequest { sandbox_id: id.into(), port: 8080, ..Default::default() };
    let nobody = base(&as_gateway).public_for(Some("192.0.2.7".parse().unwrap()));

    // The gateway, for nobody: a private sandbox is refused before anything is sent to it; a
    // public one gets through authorization to its edge (a sim sandbox has no port to answer:
    // whatever the edge says, it is not a refusal of the caller).
    let e = nobody.http_request(http(&private.id)).await.unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied, "{e}");
    if let Err(e) = nobody.http_request(http(&public.id)).await {
        assert!(!matches!(e.reason, Reason::PermissionDenied | Reason::Unauthenticated), "{e}");
    }
    assert_eq!(nobody.http_request(http("edge-000.nosuch")).await.unwrap_err().reason, Reason::NotFound);
    // Nothing else is served for nobody.
    let e = nobody.get_sandbox(&public.id).await.unwrap_err();
    assert_eq!(e.reason, Reason::Unauthenticated, "{e}");
    let exec = pb::ExecRequest { sandbox_id: public.id.clone(), command: "true".into(), ..Default::default() };
    assert_eq!(nobody.exec(exec).await.unwrap_err().reason, Reason::Unauthenticated);
    assert_eq!(nobody.list_sandboxes(Default::default()).await.unwrap_err().reason, Reason::Unauthenticated);
    // From anyone but a gateway, the header opens nothing, not even a public sandbox.
    let e = base(&plain).public_for(None).http_request(http(&public.id)).await.unwrap_err();
    assert_eq!(e.reason, Reason::Unauthenticated, "{e}");

    // Probing ids for nobody is paid for: sandboxes that are not public, or not there, count
    // as failed authentications of the client the gateway names, which is then paused (and
    // no one else is).
    let prober = base(&as_gateway).public_for(Some("192.0.2.9".parse().unwrap()));
    for i in 0..8 {
        let id = if i % 2 == 0 { private.id.clone() } else { format!("edge-000.nosuch{i}") };
        assert!(prober.http_request(http(&id)).await.is_err());
    }
    let e = prober.http_request(http(&public.id)).await.unwrap_err();
    assert_eq!(e.reason, Reason::Unauthenticated, "{e}");
    if let Err(e) = nobody.http_request(http(&public.id)).await {
        assert!(!matches!(e.reason, Reason::PermissionDenied | Reason::Unauthenticated), "{e}");
    }
}
