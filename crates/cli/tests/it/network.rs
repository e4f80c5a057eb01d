//! Sandbox networking end to end, through the public API, in a Debian container sandbox (root;
//! CI runs as root): DNS through the edge's proxy, allow-lists by domain and network, live
//! updates, a project's ceiling, an edge restart, a warm pool member claimed with its
//! template's rules, and a stop that leaves nothing.
//!
//! Hermetic: the whole cluster runs in a network namespace of the test's own whose only way
//! out is the test world (`opendsec_testkit::netns`); the edge's upstream resolver is the
//! world's DNS server, which logs every query it gets.

use std::time::Duration;

use crate::common::*;
use opendsec_proto::v1 as pb;
use opendsec_testkit::netns::{self, DNS, METADATA, World};

/// A Python one-liner run in the sandbox: an HTTP GET by name or address (3 s timeout),
/// printing the body or `ERR <exception>`.
fn get(url: &str) -> String {
    format!(
        "python3 -c \"import urllib.request,sys\ntry: print(urllib.request.urlopen('{url}', timeout=3).read().decode().strip())\nexcept Exception as e: print('ERR', type(e).__name__)\""
    )
}

fn resolve(name: &str) -> String {
    format!(
        "python3 -c \"import socket\ntry: print(socket.gethostbyname('{name}'))\nexcept Exception as e: print('ERR', type(e).__name__)\""
    )
}

fn rules(texts: &[&str]) -> Vec<pb::EgressRule> {
    texts.iter().map(|t| opendsec_common::egress::Rule::parse(t).unwrap().to_pb()).collect()
}

/// What the kernel holds for the cluster's edge: its veths and the elements of its sets.
fn leftovers() -> (usize, usize) {
    let tables = netns::sh(&["nft", "list", "tables"]);
    let table = tables.lines().find_map(|l| l.strip_prefix("table inet ")).expect("the edge's table").to_string();
    // The edge's veths are od<tag>-<slot>, its table opendsec-<tag>.
    let prefix = format!(": od{}-", table.trim_start_matches("opendsec-"));
    let links = netns::sh(&["ip", "-o", "link", "show"]).lines().filter(|l| l.contains(&prefix)).count();
    let text = netns::sh(&["nft", "list", "table", "inet", &table]);
    // Per-sandbox chains, and the two maps every sandbox has an element in.
    let chains = text.lines().filter(|l| l.trim().starts_with("chain s_") || l.trim().starts_with("chain i_")).count();
    let in_maps: usize = ["sandboxes", "jumps", "replies"]
        .iter()
        .map(|m| netns::sh(&["nft", "list", "map", "inet", &table, m]).matches("elements = {").count())
        .sum();
    let elems = chains + in_maps;
    (links, elems)
}

#[test]
fn egress_rules_through_the_public_api() {
    assert!(is_root(), "this test needs root (CI runs as root)");
    netns::enter_private_namespace();
    let world = World::start();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async move {
        let mut f = fixture_with(|cfg| {
            cfg.network.enabled = true;
            cfg.network.upstream_dns = vec![DNS.to_string()];
            cfg.edge.backends.push("fncall".into());
            cfg.edge.pool_refresh = Duration::from_millis(200);
        })
        .await;
        import(&f.ca, &f.addr, &f.cluster.admin_token, &debian_rootfs(), &f.store, "debian:bookworm").await;
        let mut spec = container_spec("debian:bookworm", 256, 256);
        spec.network = Some(pb::NetworkSpec { egress: rules(&["allowed.test", "203.0.113.0/24:tcp/80"]) });
        let sb = f.admin.create_sandbox(spec).await.unwrap();
        assert!(sb.address.starts_with("10.88."), "{}", sb.address);
        let mut r = runtime(&f.ca, &f.addr, &f.cluster.admin_token);
        let sh = |cmd: String| {
            let mut r = r.clone();
            let id = sb.id.clone();
            async move { out(&exec_in(&mut r, &id, "s", &cmd).await) }
        };

        // An allowed domain and its subdomain resolve and answer.
        assert_eq!(sh(get("http://allowed.test/")).await, "hello 198.51.100.10:80");
        assert_eq!(sh(get("http://www.allowed.test/")).await, "hello 198.51.100.10:80");
        // An allowed network, by address.
        assert_eq!(sh(get("http://203.0.113.10/")).await, "hello 203.0.113.10:80");
        // A name outside the rules: not found, and the world's DNS never saw it.
        assert_eq!(sh(resolve("secret.exfil.test")).await, "ERR gaierror");
        assert!(!world.dns_saw("secret.exfil.test"), "a refused name left the edge");
        // The metadata address, even by a name that is allowed.
        assert!(sh(get(&format!("http://{METADATA}/"))).await.starts_with("ERR"));

        // UpdateNetwork: taking the rules back closes, giving `*` opens public addresses.
        let u = f.admin.update_network(&sb.id, vec![]).await.unwrap();
        assert!(u.spec.unwrap().network.unwrap().egress.is_empty());
        assert!(sh(get("http://203.0.113.10/")).await.starts_with("ERR"));
        assert_eq!(sh(resolve("allowed.test")).await, "ERR gaierror");
        f.admin.update_network(&sb.id, rules(&["*"])).await.unwrap();
        assert_eq!(sh(get("http://203.0.113.10/")).await, "hello 203.0.113.10:80");
        let bad = f
            .admin
            .update_network(
                &sb.id,
                rules(&["*"])
                    .into_iter()
                    .chain([pb::EgressRule { target: "192.0.2.1/24".into(), ..Default::default() }])
                    .collect(),
            )
            .await;
        assert_eq!(bad.unwrap_err().reason.as_str(), "invalid_argument");

        // Pause keeps the network: a call resumes the sandbox, which still reaches out.
        f.admin.pause_sandbox(&sb.id).await.unwrap();
        assert_eq!(sh(get("http://203.0.113.10/")).await, "hello 203.0.113.10:80");

        // An edge restart keeps the rules: the sandbox is adopted and still reaches out.
        f.cluster.stop_edge(EDGE).await.unwrap();
        f.cluster.start_edge(EDGE).await.unwrap();
        f.cluster.wait_ready(Duration::from_secs(30)).await.unwrap();
        r = runtime(&f.ca, &f.addr, &f.cluster.admin_token);
        let again = out(&exec_in(&mut r, &sb.id, "s2", &get("http://203.0.113.10/")).await);
        assert_eq!(again, "hello 203.0.113.10:80");

        // A project's ceiling refuses more.
        f.admin.create_project(pb::CreateProjectRequest { path: "root/net".into(), quota: None }).await.unwrap();
        let ceiling = pb::EgressCeiling { allow: rules(&["allowed.test"]) };
        f.admin
            .set_egress_ceiling(pb::SetEgressCeilingRequest { path: "root/net".into(), ceiling: Some(ceiling) })
            .await
            .unwrap();
        let mut wide = container_spec("debian:bookworm", 256, 256);
        wide.project = "root/net".into();
        wide.network = Some(pb::NetworkSpec { egress: rules(&["*"]) });
        let e = f.admin.create_sandbox(wide).await.unwrap_err();
        assert_eq!(e.reason.as_str(), "permission_denied");
        assert!(e.message.contains("\"*\""), "{}", e.message);

        // A warm pool's member, claimed, has the template's rules and its own address; idle
        // members are attached already (their veth is up before the claim).
        let template = pb::PoolTemplate {
            image: "debian:bookworm".into(),
            backend: "fncall".into(),
            resources: Some(pb::Resources { cpu_millis: 1000, memory_mb: 256, disk_mb: 256, gpus: 0 }),
            egress: vec!["203.0.113.0/24:tcp/80".into()],
            ..Default::default()
        };
        let pool = pb::Pool { name: "net".into(), template: Some(template), size_per_edge: 1, ..Default::default() };
        f.admin.create_pool(pb::CreatePoolRequest { pool: Some(pool) }).await.unwrap();
        let idle = || async {
            let p = f.admin.get_pool(pb::GetPoolRequest { project: "root".into(), name: "net".into() }).await.unwrap();
            p.edges.first().map_or(0, |e| e.idle)
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        while idle().await < 1 {
            assert!(std::time::Instant::now() < deadline, "the pool never filled");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let links_before = leftovers().0;
        let m = f.admin.create_sandbox(pb::SandboxSpec { pool: "net".into(), ..Default::default() }).await.unwrap();
        assert!(m.address.starts_with("10.88.") && m.address != sb.address, "{}", m.address);
        let in_member = |cmd: String| {
            let mut r = r.clone();
            let id = m.id.clone();
            async move { out(&exec_in(&mut r, &id, "s", &cmd).await) }
        };
        assert_eq!(in_member(get("http://203.0.113.10/")).await, "hello 203.0.113.10:80");
        assert_eq!(in_member(resolve("allowed.test")).await, "ERR gaierror", "only the template's rules");
        assert!(in_member(get("http://198.51.100.10/")).await.starts_with("ERR"));
        // The claim's veth is the member's: no new link for the claim itself (the refill
        // adds one).
        assert!(leftovers().0 <= links_before + 1);

        // A stop leaves nothing: no veth, no element (the pool's members go with the pool).
        assert!(leftovers().0 >= 1);
        f.admin.stop_sandbox(&sb.id).await.unwrap();
        f.admin.stop_sandbox(&m.id).await.unwrap();
        f.admin.delete_pool(pb::DeletePoolRequest { project: "root".into(), name: "net".into() }).await.unwrap();
        until("the sandboxes' network is gone", Duration::from_secs(30), || leftovers() == (0, 0)).await;
    });
}
