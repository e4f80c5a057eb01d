//! A microvm's network end to end, through the public API (root; CI runs as root; TCG): the
//! guest reaches what its rules allow, by name through the edge's DNS proxy and by address,
//! and nothing else; rules change live; the network survives a pause; a fork's copies reach
//! out from their own sandbox addresses with their guests unchanged (every guest has the same
//! address behind a tap in its own namespace); and a stop leaves nothing of the network.
//!
//! Hermetic: the whole cluster runs in a network namespace of the test's own whose only way
//! out is the test world (`opendsec_testkit::netns`), whose DNS server logs every query.

use std::time::Duration;

use crate::common::*;
use opendsec_proto::v1 as pb;
use opendsec_testkit::netns::{self, DNS, METADATA, PRIVATE, World};

/// An HTTP GET of `/` on `host` port 80 with busybox's nc (3 s), printing the body's one line
/// or `ERR`. (Not busybox's wget: Debian's static build crashes in it.)
fn get(host: &str) -> String {
    format!(
        "r=$(printf 'GET / HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n' | nc -w 3 {host} 80 2>/dev/null | tail -n 1); \
         [ -n \"$r\" ] && echo \"$r\" || echo ERR"
    )
}

fn rules(texts: &[&str]) -> Vec<pb::EgressRule> {
    texts.iter().map(|t| opendsec_common::egress::Rule::parse(t).unwrap().to_pb()).collect()
}

/// The edge's veths in the test's namespace (`od<tag>-<slot>`; not the test's uplink).
fn veths() -> usize {
    let uplink = format!(": {}", netns::UPLINK);
    netns::sh(&["ip", "-o", "link", "show"]).lines().filter(|l| l.contains(": od") && !l.contains(&uplink)).count()
}

#[test]
fn a_microvm_reaches_what_its_rules_allow_and_its_copies_too() {
    assert!(is_root(), "this test needs root (CI runs as root)");
    netns::enter_private_namespace();
    let world = World::start();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    rt.block_on(async move {
        let mut f = fixture_with(|cfg| {
            cfg.network.enabled = true;
            cfg.network.upstream_dns = vec![DNS.to_string()];
            cfg.edge.backends.extend(["microvm".into(), "fullvm".into()]);
            cfg.edge.vm.kernel_dir = Some(vm_kernel());
            cfg.edge.vm.accel = "tcg".into();
        })
        .await;
        let mut spec = pb::SandboxSpec { backend: "microvm".into(), ..container_spec("busybox", 192, 64) };
        spec.network = Some(pb::NetworkSpec { egress: rules(&["allowed.test", "203.0.113.0/24:tcp/80"]) });
        let sb = f.admin.create_sandbox(spec).await.unwrap();
        assert!(sb.address.starts_with("10.88."), "{}", sb.address);
        let r = runtime(&f.ca, &f.addr, &f.cluster.admin_token);
        let sh = |id: String, cmd: String| {
            let mut r = r.clone();
            async move { out(&exec_in(&mut r, &id, "s", &cmd).await) }
        };

        // The host's side: the namespace's placeholder is no root process, holds no capability
        // and sits in the VM's cgroup.
        let holders: Vec<String> = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter(|p| {
                String::from_utf8_lossy(&std::fs::read(p.path().join("cmdline")).unwrap_or_default())
                    .contains("hold-netns")
            })
            .map(|p| std::fs::read_to_string(p.path().join("status")).unwrap())
            .collect();
        assert_eq!(holders.len(), 1);
        let field =
            |k: &str| holders[0].lines().find_map(|l| l.strip_prefix(&format!("{k}:"))).unwrap().trim().to_string();
        assert!(field("Uid").split_whitespace().all(|u| u.parse::<u32>().unwrap() >= 65536), "{}", field("Uid"));
        assert_eq!(u64::from_str_radix(&field("CapEff"), 16).unwrap(), 0);
        assert_eq!(u64::from_str_radix(&field("CapPrm"), 16).unwrap(), 0);
        assert_eq!(field("NoNewPrivs"), "1");
        // Not the VMM's uid (which could otherwise ptrace it).
        let vmm_uids: Vec<String> = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter(|p| {
                String::from_utf8_lossy(&std::fs::read(p.path().join("cmdline")).unwrap_or_default())
                    .starts_with("qemu-system")
            })
            .filter_map(|p| std::fs::read_to_string(p.path().join("status")).ok())
            .filter_map(|st| {
                st.lines()
                    .find_map(|l| l.strip_prefix("Uid:"))
                    .map(|u| u.split_whitespace().next().unwrap_or("").to_string())
            })
            .collect();
        assert!(
            !vmm_uids.is_empty() && !vmm_uids.contains(&field("Uid").split_whitespace().next().unwrap().to_string()),
            "{vmm_uids:?}"
        );
        // The guest's side: the fixed address behind the gateway, the gateway as name server.
        let guest =
            sh(sb.id.clone(), "ip -4 -o addr show | grep -v ' lo '; ip route; cat /etc/resolv.conf".into()).await;
        assert!(guest.contains("172.16.0.2/30") && guest.contains("default via 172.16.0.1"), "{guest}");
        assert!(guest.contains("nameserver 172.16.0.1"), "{guest}");
        // An address outside the rules is not reached (before a name the rules allow has
        // resolved to it).
        assert_eq!(sh(sb.id.clone(), get("198.51.100.10")).await, "ERR");
        // An allowed domain and an allowed network answer; the loopback works too.
        assert_eq!(sh(sb.id.clone(), get("allowed.test")).await, "hello 198.51.100.10:80");
        assert_eq!(sh(sb.id.clone(), get("203.0.113.10")).await, "hello 203.0.113.10:80");
        assert_eq!(sh(sb.id.clone(), "ping -c 1 -W 2 127.0.0.1 >/dev/null && echo lo".into()).await, "lo");
        // Outside the rules: a name is not found (and never left the edge), an address and the
        // metadata service are not reached, nor is the namespace around the guest.
        assert_eq!(sh(sb.id.clone(), "nslookup secret.exfil.test >/dev/null 2>&1 || echo ERR".into()).await, "ERR");
        assert!(!world.dns_saw("secret.exfil.test"), "a refused name left the edge");
        assert_eq!(sh(sb.id.clone(), get(&PRIVATE.to_string())).await, "ERR");
        assert_eq!(sh(sb.id.clone(), get(&METADATA.to_string())).await, "ERR");
        assert_eq!(sh(sb.id.clone(), get("172.16.0.1")).await, "ERR");

        // Rules change live; a pause keeps the network.
        f.admin.update_network(&sb.id, vec![]).await.unwrap();
        assert_eq!(sh(sb.id.clone(), get("203.0.113.10")).await, "ERR");
        f.admin.update_network(&sb.id, rules(&["*"])).await.unwrap();
        assert_eq!(sh(sb.id.clone(), get("203.0.113.10")).await, "hello 203.0.113.10:80");
        f.admin.pause_sandbox(&sb.id).await.unwrap();
        f.admin.resume_sandbox(&sb.id).await.unwrap();
        assert_eq!(sh(sb.id.clone(), get("198.51.100.10")).await, "hello 198.51.100.10:80");
        // An edge restart adopts the VM with its namespace (held by its placeholder).
        f.cluster.stop_edge(EDGE).await.unwrap();
        f.cluster.start_edge(EDGE).await.unwrap();
        f.cluster.wait_ready(Duration::from_secs(30)).await.unwrap();
        let r = runtime(&f.ca, &f.addr, &f.cluster.admin_token);
        let sh = |id: String, cmd: String| {
            let mut r = r.clone();
            async move { out(&exec_in(&mut r, &id, "s", &cmd).await) }
        };
        assert_eq!(sh(sb.id.clone(), get("198.51.100.10")).await, "hello 198.51.100.10:80");
        // A full VM's NIC is on PCI; the rest is the same.
        let mut full = pb::SandboxSpec { backend: "fullvm".into(), ..container_spec("busybox", 192, 64) };
        full.network = Some(pb::NetworkSpec { egress: rules(&["203.0.113.0/24:tcp/80"]) });
        let full = f.admin.create_sandbox(full).await.unwrap();
        assert_eq!(sh(full.id.clone(), get("203.0.113.10")).await, "hello 203.0.113.10:80");
        assert_eq!(sh(full.id.clone(), get("198.51.100.10")).await, "ERR");
        f.admin.stop_sandbox(&full.id).await.unwrap();

        // A fork: each copy has its own sandbox address and the source's rules (`*` by now),
        // and reaches out with its guest's network as it was.
        let req = pb::ForkSandboxRequest { id: sb.id.clone(), count: 2, ..Default::default() };
        let mut stream = f.admin.fork_sandbox(req).await.unwrap();
        let mut copies = Vec::new();
        while let Some(item) = stream.message().await.unwrap() {
            copies.push(item.sandbox.unwrap_or_else(|| panic!("{:?}", item.error)));
        }
        let mut addresses = vec![sb.address.clone()];
        for c in &copies {
            assert!(c.address.starts_with("10.88."), "{}", c.address);
            addresses.push(c.address.clone());
            assert_eq!(sh(c.id.clone(), get("203.0.113.10")).await, "hello 203.0.113.10:80");
            // Names through its own namespace's translation to the edge's DNS proxy, by rules
            // of its own.
            f.admin.update_network(&c.id, rules(&["allowed.test"])).await.unwrap();
            assert_eq!(sh(c.id.clone(), get("allowed.test")).await, "hello 198.51.100.10:80");
            assert_eq!(sh(c.id.clone(), get("203.0.113.10")).await, "ERR");
        }
        addresses.sort();
        addresses.dedup();
        assert_eq!(addresses.len(), 3, "{addresses:?}");

        // Stops leave nothing of the network.
        assert_eq!(veths(), 3);
        for id in copies.iter().map(|c| &c.id).chain([&sb.id]) {
            f.admin.stop_sandbox(id).await.unwrap();
        }
        until("the VMs' network is gone", Duration::from_secs(30), || veths() == 0).await;
    });
}
