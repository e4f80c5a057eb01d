//! What `deploy/` ships is usable as shipped: every example config loads and names what its
//! role needs, every systemd unit passes `systemd-analyze verify` (pointed at the binary this
//! build made), and `opendsecctl release pack` makes a tarball whose checksums hold, that holds
//! every file, and that is the same bytes when packed twice. A dynamically linked agent is
//! refused and leaves no tarball. Needs `make agent` (the test target builds it).

use std::path::{Path, PathBuf};
use std::process::Command;

use opendsec_common::config::Config;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

#[test]
fn example_configs_load_and_name_what_their_role_needs() {
    let load = |role: &str| {
        Config::load(&deploy().join(format!("config/{role}.json"))).unwrap_or_else(|e| panic!("{role}.json: {e}"))
    };
    let iam = load("iam");
    let raft = iam.iam.raft.as_ref().expect("iam.json: a Raft member");
    assert_eq!(raft.id, 1);
    assert_eq!(raft.initial_members.len(), 3);
    assert!(iam.iam.admin_token.is_empty(), "no token ships in an example");
    for role in ["apiserver", "watcher", "edge"] {
        assert_eq!(load(role).iam.addrs.len(), 3, "{role}.json lists every IAM member");
    }
    let api = load("apiserver");
    assert_eq!(api.watcher.addrs.len(), 2);
    assert!(api.images.store_dir.is_some(), "the shared image store");
    let edge = load("edge");
    assert!(!edge.edge.name.is_empty() && !edge.edge.advertise.is_empty(), "edge.json: a name and an address to dial");
    assert_eq!(edge.images.store_dir, api.images.store_dir, "apiservers and edges share one store");
    assert!(edge.edge.agent_path.is_some());
    assert!(!load("e2b").e2b.apiserver_addrs.is_empty());
    assert!(!load("watcher").watcher.listen.is_empty());
    // No two roles share a state directory (the edge's is root's; the others' are their users').
    let mut dirs: Vec<PathBuf> =
        ["iam", "apiserver", "watcher", "edge", "e2b"].iter().map(|r| load(r).state_dir).collect();
    dirs.sort();
    dirs.dedup();
    assert_eq!(dirs.len(), 5, "{dirs:?}");
}

#[test]
fn systemd_units_verify_and_harden_what_they_can() {
    let dir = tempfile::tempdir().unwrap();
    let units = std::fs::read_dir(deploy().join("systemd")).unwrap();
    let mut seen = Vec::new();
    for u in units {
        let u = u.unwrap().path();
        let name = u.file_name().unwrap().to_str().unwrap().to_string();
        let text = std::fs::read_to_string(&u).unwrap();
        let role =
            name.strip_prefix("opendsec-").and_then(|n| n.strip_suffix(".service")).expect("opendsec-ROLE.service");
        assert!(
            text.contains(&format!("ExecStart=/usr/local/bin/opendsec {role} --config /etc/opendsec/{role}.json\n")),
            "{name}"
        );
        assert!(text.contains("LimitNOFILE="), "{name}: a file limit");
        if role == "edge" {
            // Its sandboxes outlive a restart; nothing it forbids is inherited by them.
            for opt in ["KillMode=process", "Delegate=yes"] {
                assert!(text.contains(opt), "{name}: {opt}");
            }
            for opt in ["NoNewPrivileges", "SystemCallFilter", "ProtectClock", "PrivateDevices", "LockPersonality"] {
                assert!(!text.contains(&format!("{opt}=")), "{name}: {opt}");
            }
        } else {
            for opt in [
                "NoNewPrivileges=yes",
                "ProtectSystem=strict",
                &format!("User=opendsec-{role}\n"),
                "CapabilityBoundingSet=\n",
            ] {
                assert!(text.contains(opt), "{name}: {opt}");
            }
        }
        // Verified as installed, but running the binary this build made.
        let local = dir.path().join(&name);
        std::fs::write(&local, text.replace("/usr/local/bin/opendsec", env!("CARGO_BIN_EXE_opendsec"))).unwrap();
        let out = Command::new("systemd-analyze")
            .args(["verify", local.to_str().unwrap()])
            .output()
            .expect("systemd-analyze (Debian's systemd package)");
        let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
        assert!(out.status.success() && said.trim().is_empty(), "{name}: {said}");
        seen.push(role.to_string());
    }
    seen.sort();
    assert_eq!(seen, ["apiserver", "e2b", "edge", "iam", "watcher"]);
    // The check itself can fail: a misspelt option is reported.
    let bad = dir.path().join("opendsec-bad.service");
    std::fs::write(&bad, format!("[Service]\nExecStart={} iam\nProtectSystm=strict\n", env!("CARGO_BIN_EXE_opendsec")))
        .unwrap();
    let out = Command::new("systemd-analyze").args(["verify", bad.to_str().unwrap()]).output().unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("ProtectSystm"), "{out:?}");
}

fn pack(out: &Path, extra: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_opendsecctl"))
        .args(["release", "pack", "--out", out.to_str().unwrap()])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn a_release_tarball_holds_everything_checks_out_and_is_reproducible() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.tar.gz");
    let out = pack(&a, &[]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));

    let x = dir.path().join("x");
    std::fs::create_dir(&x).unwrap();
    let st = Command::new("tar").args(["xzf", a.to_str().unwrap(), "-C", x.to_str().unwrap()]).status().unwrap();
    assert!(st.success());
    let top = std::fs::read_dir(&x).unwrap().next().unwrap().unwrap().path();
    assert_eq!(top.file_name().unwrap().to_str().unwrap(), format!("opendsec-{}", env!("CARGO_PKG_VERSION")));
    let sums = Command::new("sha256sum").args(["-c", "--strict", "SHA256SUMS"]).current_dir(&top).output().unwrap();
    assert!(sums.status.success(), "{}", String::from_utf8_lossy(&sums.stdout));
    let listed = std::fs::read_to_string(top.join("SHA256SUMS")).unwrap();
    for f in [
        "bin/opendsec",
        "bin/opendsecctl",
        "lib/opendsec-agent",
        "systemd/opendsec-iam.service",
        "systemd/opendsec-edge.service",
        "config/iam.json",
        "config/edge.json",
        "README.md",
        "operations.md",
    ] {
        assert!(listed.contains(&format!("  {f}\n")), "{f} in SHA256SUMS:\n{listed}");
    }
    // The files are the ones of this build and this tree.
    assert_eq!(
        std::fs::read(top.join("bin/opendsec")).unwrap(),
        std::fs::read(env!("CARGO_BIN_EXE_opendsec")).unwrap()
    );
    assert_eq!(
        std::fs::read(top.join("systemd/opendsec-iam.service")).unwrap(),
        std::fs::read(deploy().join("systemd/opendsec-iam.service")).unwrap()
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(std::fs::metadata(top.join("bin/opendsec")).unwrap().permissions().mode() & 0o777, 0o755);
    let agent = std::fs::read(top.join("lib/opendsec-agent")).unwrap();
    assert!(opendsec_edge::backend::container::check_static_elf(&agent).is_ok());
    let help = Command::new(top.join("bin/opendsec")).arg("--help").output().unwrap();
    assert!(help.status.success());

    // Packed again: the same bytes.
    let b = dir.path().join("b.tar.gz");
    assert!(pack(&b, &[]).status.success());
    assert_eq!(std::fs::read(&a).unwrap(), std::fs::read(&b).unwrap(), "packing is reproducible");

    // A dynamically linked agent is refused, and nothing is left behind.
    let c = dir.path().join("c.tar.gz");
    let out = pack(&c, &["--agent", env!("CARGO_BIN_EXE_opendsecctl")]);
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("the agent must be static"), "{out:?}");
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(!left.iter().any(|n| n.to_str().unwrap().starts_with('c')), "{left:?}");
}

#[test]
fn an_edge_listening_on_every_address_must_say_where_it_is_dialed() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("edge.json");
    // What `opendsec edge` says, refusing to start with this `edge.advertise`.
    let refusal = |advertise: &str| {
        let c = serde_json::json!({
            "state_dir": dir.path().join("state"),
            "edge": {"name": "node-1", "listen": "0.0.0.0:0", "advertise": advertise, "backends": ["sim"]},
        });
        std::fs::write(&cfg, c.to_string()).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_opendsec"))
            .args(["edge", "--config", cfg.to_str().unwrap()])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{out:?}");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let said = refusal("");
    assert!(said.contains("edge.advertise: must be set when edge.listen is every address"), "{said}");
    let said = refusal("0.0.0.0:7300");
    assert!(said.contains("edge.advertise: must be an address others can dial"), "{said}");
}
