//! The cluster across three hosts, as an operator deploys it (docs/operations.md): each host a
//! network namespace on a test LAN (nothing leaves the machine), each daemon the real
//! `opendsec <role> --config F` process, its config made from `deploy/config/<role>.json`
//! with this LAN's addresses and this test's directories, its certificate from `opendsecctl
//! pki`. Nothing is shared between the hosts but the image store directory.
//!
//! | host | daemons |
//! |---|---|
//! | 1 | IAM member 1, apiserver, watcher, edge `sim-1` (sim) |
//! | 2 | IAM member 2, apiserver, watcher, edge `sim-2` (sim) |
//! | 3 | IAM member 3, edge `node-c` (containers) |
//!
//! Through the Python SDK (`multihost_sdk.py`, over both apiservers): an image import,
//! a project with a quota, sandboxes on both sim edges and on the container edge, a shell
//! session, pause and resume, the quota's refusal. Then IAM's leader and one apiserver are
//! killed (SIGKILL) and the SDK does it again: the container sandbox and its session are
//! still there, creations and the quota work. Root only (namespaces, containers); CI runs as
//! root. Needs `make agent` and the SDK's venv (`make sdk-venv`; `make test` makes both).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use opendsec_testkit::lan::Lan;
use serde_json::{Value, json};

const ADMIN: &str = "dsk.admin.MultiHostAdminSecret0123456789abcd";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..").canonicalize().unwrap()
}

fn ctl(args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_opendsecctl")).args(args).output().unwrap();
    assert!(out.status.success(), "opendsecctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// `deploy/config/<role>.json` with this test's addresses and directories.
fn config(role: &str, lan: &Lan, dir: &Path, host: usize, tweak: impl FnOnce(&mut Value)) -> PathBuf {
    let mut text = std::fs::read_to_string(repo().join(format!("deploy/config/{role}.json"))).unwrap();
    for (i, h) in lan.hosts.iter().enumerate() {
        let n = i + 1;
        for name in [format!("iam-{n}"), format!("watcher-{n}"), format!("node-{n}")] {
            text = text.replace(&format!("{name}.opendsec.internal"), &h.addr.to_string());
        }
    }
    text = text
        .replace("/var/lib/opendsec", dir.join(format!("host-{host}")).to_str().unwrap())
        .replace("/etc/opendsec/pki", dir.join("pki").to_str().unwrap())
        .replace("/srv/opendsec/images", dir.join("images").to_str().unwrap());
    let mut v: Value = serde_json::from_str(&text).unwrap();
    tweak(&mut v);
    let path = dir.join(format!("{role}-host{host}.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    path
}

struct Daemons {
    dir: PathBuf,
    running: BTreeMap<String, Child>,
}

impl Daemons {
    fn start(&mut self, lan: &Lan, host: usize, role: &str, config: &Path) {
        let name = format!("{role}-{host}");
        let log = std::fs::File::create(self.dir.join(format!("{name}.log"))).unwrap();
        let child = lan.hosts[host - 1]
            .command(env!("CARGO_BIN_EXE_opendsec"))
            .args([role, "--config", config.to_str().unwrap()])
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(Stdio::from(log.try_clone().unwrap()))
            .stderr(Stdio::from(log))
            .spawn()
            .unwrap();
        self.running.insert(name, child);
    }

    fn kill(&mut self, name: &str) {
        let mut c = self.running.remove(name).unwrap_or_else(|| panic!("{name} is not running"));
        c.kill().unwrap();
        c.wait().unwrap();
    }

    /// SIGTERM, then the exit (the edges stop their sandboxes).
    fn stop(&mut self, name: &str) {
        let c = self.running.remove(name).unwrap();
        if !terminate(c) {
            panic!("{name} did not stop on SIGTERM within a minute\n{}", self.logs());
        }
    }

    fn logs(&self) -> String {
        let mut names: Vec<_> = std::fs::read_dir(&self.dir)
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".log"))
            .collect();
        names.sort();
        names
            .iter()
            .map(|n| {
                let t = std::fs::read_to_string(self.dir.join(n)).unwrap_or_default();
                let tail: Vec<&str> = t.lines().rev().take(25).collect();
                format!("--- {n}:\n{}\n", tail.into_iter().rev().collect::<Vec<_>>().join("\n"))
            })
            .collect()
    }
}

/// SIGTERM to `c`, and its exit awaited for up to a minute (then SIGKILL); whether it exited
/// by itself.
fn terminate(mut c: Child) -> bool {
    // SAFETY: kill(2) on our own child's pid.
    unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(60);
    while matches!(c.try_wait(), Ok(None)) {
        if Instant::now() > deadline {
            let _ = c.kill();
            let _ = c.wait();
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    true
}

impl Drop for Daemons {
    fn drop(&mut self) {
        // Edges first, gently: their sandboxes go with them.
        let edges: Vec<String> = self.running.keys().filter(|k| k.starts_with("edge")).cloned().collect();
        for e in edges {
            if let Some(c) = self.running.remove(&e) {
                terminate(c);
            }
        }
        for c in self.running.values_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `opendsecctl --json ARGS` against apiserver 2, as the administrator.
fn ctl_json(lan: &Lan, dir: &Path, args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_opendsecctl"))
        .arg("--json")
        .args(args)
        .env("OPENDSEC_ADDR", format!("{}:7000", lan.hosts[1].addr))
        .env("OPENDSEC_CA", dir.join("pki/ca.pem"))
        .env("OPENDSEC_TOKEN", ADMIN)
        .output()
        .unwrap();
    assert!(out.status.success(), "opendsecctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).unwrap()
}

fn sdk(lan: &Lan, dir: &Path, phase: &str, api_hosts: &[usize], d: &Daemons) -> Value {
    let python = repo().join("target/sdk-venv/bin/python");
    assert!(python.exists(), "{} is missing: `make sdk-venv` (make test makes it)", python.display());
    let addrs: Vec<String> = api_hosts.iter().map(|h| format!("{}:7000", lan.hosts[h - 1].addr)).collect();
    let out = Command::new(python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/multihost_sdk.py"))
        .arg(phase)
        .env("OPENDSEC_ADDR", addrs.join(","))
        .env("OPENDSEC_CA", dir.join("pki/ca.pem"))
        .env("OPENDSEC_TOKEN", ADMIN)
        .env("OPENDSEC_IMAGE_STORE", dir.join("images"))
        .env("OPENDSECCTL", env!("CARGO_BIN_EXE_opendsecctl"))
        .env("MH_BUSYBOX", dir.join("bbroot"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the SDK ({phase}) failed:\n{stdout}\n{}\n{}",
        String::from_utf8_lossy(&out.stderr),
        d.logs()
    );
    serde_json::from_str(stdout.lines().last().unwrap_or_default())
        .unwrap_or_else(|e| panic!("the SDK's answer: {e}: {stdout}"))
}

#[test]
fn a_cluster_across_three_hosts_serves_the_sdk_and_survives_losing_iams_leader_and_an_apiserver() {
    assert!(opendsec_testkit::is_root(), "this test needs root (namespaces, containers); CI runs as root");
    opendsec_testkit::netns::enter_private_namespace();
    let lan = Lan::start(3);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();

    // Certificates as docs/operations.md issues them.
    let pki = dir.join("pki");
    let p = pki.to_str().unwrap();
    ctl(&["pki", "init", p]);
    for id in ["iam/1", "iam/2", "iam/3", "apiserver/0", "watcher/0", "edge/sim-1", "edge/sim-2", "edge/node-c"] {
        ctl(&["pki", "issue", "--ca-dir", p, "--id", id]);
    }
    let root = opendsec_testkit::busybox_rootfs(dir, &[]);
    std::fs::write(root.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();

    let mut d = Daemons { dir: dir.to_path_buf(), running: BTreeMap::new() };
    // IAM ×3: member `h` on host `h`, the token for the first start.
    for h in 1..=3 {
        let c = config("iam", &lan, dir, h, |v| {
            v["iam"]["raft"]["id"] = json!(h);
            v["iam"]["admin_token"] = json!(ADMIN);
        });
        d.start(&lan, h, "iam", &c);
    }
    for h in 1..=2 {
        let c = config("watcher", &lan, dir, h, |_| {});
        d.start(&lan, h, "watcher", &c);
        let c = config("apiserver", &lan, dir, h, |_| {});
        d.start(&lan, h, "apiserver", &c);
    }
    for (h, name, backends) in
        [(1, "sim-1", json!(["sim"])), (2, "sim-2", json!(["sim"])), (3, "node-c", json!(["container"]))]
    {
        let c = config("edge", &lan, dir, h, |v| {
            v["edge"]["name"] = json!(name);
            v["edge"]["advertise"] = json!(format!("{}:7300", lan.hosts[h - 1].addr));
            v["edge"]["backends"] = backends;
            v["edge"]["keep_sandboxes_on_exit"] = json!(false);
            v["edge"]["agent_path"] = json!(repo().join("target/x86_64-unknown-linux-gnu/release/opendsec-agent"));
        });
        d.start(&lan, h, "edge", &c);
    }

    // Both watchers see the three edges healthy, at the addresses they advertise.
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let links = opendsec_common::grpc::Links::new(
        opendsec_common::tls::Credentials::load(opendsec_common::tls::TlsFiles {
            ca: pki.join("ca.pem"),
            bundle: pki.join("apiserver-0.pem"),
        })
        .unwrap(),
    );
    for h in [1, 2] {
        let addr = format!("{}:7200", lan.hosts[h - 1].addr);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let snap = rt.block_on(async {
                let ch = links.channel(&addr, opendsec_common::pki::Role::Watcher, None).ok()?;
                let mut w = opendsec_proto::v1::watcher_client::WatcherClient::new(ch);
                w.get_snapshot(opendsec_proto::v1::GetSnapshotRequest {}).await.ok().map(|r| r.into_inner())
            });
            let healthy: Vec<(String, String)> = snap
                .iter()
                .flat_map(|s| &s.edges)
                .filter(|e| e.healthy)
                .map(|e| (e.name.clone(), e.address.clone()))
                .collect();
            if healthy.len() == 3 {
                for (name, address) in &healthy {
                    let h = match name.as_str() {
                        "sim-1" => 0,
                        "sim-2" => 1,
                        _ => 2,
                    };
                    assert_eq!(address, &format!("{}:7300", lan.hosts[h].addr), "{name}'s address");
                }
                break;
            }
            assert!(Instant::now() < deadline, "watcher {h} sees {healthy:?}\n{}", d.logs());
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    let first = sdk(&lan, dir, "first", &[1, 2], &d);
    eprintln!("first: {first}");
    let edges = first["edges"].as_array().unwrap();
    assert_eq!(edges.len(), 2, "sim sandboxes on both sim edges: {first}");

    // IAM's leader and apiserver 1 killed.
    let members = ctl_json(&lan, dir, &["iam", "members"]);
    let leader = members["members"]
        .as_array()
        .and_then(|m| m.iter().find(|m| m["leader"] == json!(true)))
        .and_then(|m| m["id"].as_u64().or_else(|| m["id"].as_str()?.parse().ok()))
        .unwrap_or_else(|| panic!("no leader in {members}"));
    d.kill(&format!("iam-{leader}"));
    d.kill("apiserver-1");
    let after = sdk(&lan, dir, "after", &[1, 2], &d);
    eprintln!("after killing IAM member {leader} and apiserver 1: {after}");
    assert_eq!(after["created"], json!(4));

    d.stop("edge-3");
}
