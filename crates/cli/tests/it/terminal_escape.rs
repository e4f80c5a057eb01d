//! The escape through the operator's terminal, replayed as a user would meet it: a shell on a
//! pseudo-terminal (made here, standing for a tmux pane) runs `opendsecctl cluster up`, then
//! goes on reading commands once the cluster exits. A process in a Debian sandbox tries to type
//! `touch <marker>` into that terminal with TIOCSTI through `/dev/tty`. Before the fix it could
//! (the sandbox shared the cluster's session and controlling terminal, and `/dev/tty` was the
//! host's node), and the pane's shell ran the command as root on the host.
//!
//! Besides the marker, the test looks from the host at every process of the sandbox: none has
//! a controlling terminal, none is in the terminal's session, none holds an fd of it. And the
//! sandbox's output, shown on a terminal by `opendsecctl exec`, carries no sequence that makes
//! the terminal answer or remember.
//! Root only (CI runs as root); needs `make agent` and the Debian test image.
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::*;

use opendsec_edge::linuxrt::cgroup::SandboxCgroup;

/// A pseudo-terminal pair (master, slave).
fn openpty() -> (OwnedFd, OwnedFd) {
    let (mut m, mut s) = (-1, -1);
    // SAFETY: openpty writes two fds through valid pointers; name, termios and winsize are
    // optional (null).
    let r = unsafe { libc::openpty(&mut m, &mut s, std::ptr::null_mut(), std::ptr::null(), std::ptr::null()) };
    assert_eq!(r, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: both fds were just returned by openpty and belong to nobody else.
    unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(s)) }
}

/// Field `n` (1-based, as in proc(5)) of `/proc/<pid>/stat`.
fn stat_field(pid: i32, n: usize) -> Option<i64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which ends at the last ')'; field 3 is the first.
    s.rsplit_once(')')?.1.split_whitespace().nth(n - 3)?.parse().ok()
}

/// The children of `pid`.
fn children(pid: u32) -> Vec<i32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sandbox_cannot_type_into_the_terminal_the_cluster_runs_in() {
    if !is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let marker = dir.path().join("escaped");
    let addr = format!("127.0.0.1:{}", free_port());
    let config = dir.path().join("config.json");
    let cfg = serde_json::json!({
        "sim_edges": 1,
        "apiserver": { "listen": addr, "metrics_listen": "" },
        "edge": {
            "backends": ["container"],
            "keep_sandboxes_on_exit": false,
            "container_setup_exe": env!("CARGO_BIN_EXE_opendsec"),
        },
        // This test runs in the machine's own namespace: leave its network alone.
        "network": { "enabled": false },
    });
    std::fs::write(&config, cfg.to_string()).unwrap();
    let containers = state.join("edges").join(EDGE).join("containers");
    let _guard = Guard { containers: containers.clone() };

    // The operator's pane: a shell on the terminal runs the cluster and, once it exits, reads
    // the next commands from the terminal.
    let (master, slave) = openpty();
    let script = format!(
        "{} cluster up --config {} --state-dir {}; exec sh",
        env!("CARGO_BIN_EXE_opendsecctl"),
        config.display(),
        state.display()
    );
    let mut cmd = Command::new("/bin/sh");
    cmd.arg("-c")
        .arg(&script)
        .env("PS1", "$ ")
        .current_dir(dir.path())
        .stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave.try_clone().unwrap()))
        .stderr(Stdio::from(slave));
    // SAFETY: between fork and exec only async-signal-safe calls: setsid and the ioctl that
    // makes the pty (fd 0 by now) the new session's controlling terminal.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 || libc::ioctl(0, libc::TIOCSCTTY, 0) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let mut shell = cmd.spawn().unwrap();
    let terminal_sid = shell.id() as i64;
    // What the terminal shows, drained all along so that the cluster never blocks writing it.
    let shown = Arc::new(Mutex::new(Vec::<u8>::new()));
    let mut reader = std::fs::File::from(master.try_clone().unwrap());
    let sink = shown.clone();
    std::thread::spawn(move || {
        let mut buf = [0u8; 4096];
        while let Ok(n) = reader.read(&mut buf) {
            if n == 0 {
                break;
            }
            sink.lock().unwrap().extend_from_slice(&buf[..n]);
        }
    });
    let text = || String::from_utf8_lossy(&shown.lock().unwrap()).to_string();
    wait_for("the cluster to start", Duration::from_secs(120), || text().contains("export OPENDSEC_ADDR"));
    let token = std::fs::read_to_string(state.join("admin.token")).unwrap().trim().to_string();
    // The one-command start made the PKI and says where clients find the CA.
    let ca = state.join("pki/ca.pem");
    assert!(text().contains(&format!("OPENDSEC_CA={}", ca.display())), "{}", text());

    // A Debian sandbox (python3), as in the report.
    import(&ca, &addr, &token, &debian_rootfs(), &state.join("images"), "debian:bookworm").await;
    let tls = opendsec_common::grpc::PublicTls::with_ca(&std::fs::read(&ca).unwrap(), None).unwrap();
    let admin = opendsec_client::Client::new(std::slice::from_ref(&addr), Some(&token), &tls).unwrap();
    let sb = admin.create_sandbox(container_spec("debian:bookworm", 256, 256)).await.unwrap();
    let mut rt = runtime(&ca, &addr, &token);
    let attack = format!(
        "python3 -c \"import fcntl,termios; fd=open('/dev/tty','w'); \
         [fcntl.ioctl(fd, termios.TIOCSTI, c) for c in 'touch {}\\n']\"; echo rc=$?",
        marker.display()
    );
    let r = exec_in(&mut rt, &sb.id, "attack", &attack).await;
    let err = String::from_utf8_lossy(&r.stderr).to_string();
    assert_eq!(out(&r), "rc=1", "the attack ran: {r:?}");
    assert!(err.contains("No such device or address"), "/dev/tty opened: {err}");

    // Its output shown on a terminal by `opendsecctl exec` keeps its text and colours but
    // loses what would make the terminal answer (a device status report, typed back as input)
    // or remember (the clipboard, the title). Through a pipe it stays as it is.
    let hostile = r"printf 'A\033]52;c;dG91Y2ggL3RtcC94Cg==\007B\033[6nC\033]0;t\033\\D\033[31mE\033[0m\n'";
    let (m2, s2) = openpty();
    let status = Command::new(env!("CARGO_BIN_EXE_opendsecctl"))
        .args(["exec", &sb.id, "--", hostile])
        .env("OPENDSEC_ADDR", &addr)
        .env("OPENDSEC_TOKEN", &token)
        .env("OPENDSEC_CA", &ca)
        .stdin(Stdio::null())
        .stdout(Stdio::from(s2.try_clone().unwrap()))
        .stderr(Stdio::from(s2))
        .status()
        .unwrap();
    assert!(status.success());
    let mut shown_exec = Vec::new();
    let mut m2 = std::fs::File::from(m2);
    let mut buf = [0u8; 4096];
    // SAFETY: fcntl on an fd this test owns, to read what is there without blocking.
    unsafe { libc::fcntl(m2.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
    while let Ok(n) = m2.read(&mut buf) {
        if n == 0 {
            break;
        }
        shown_exec.extend_from_slice(&buf[..n]);
    }
    let shown_exec = String::from_utf8_lossy(&shown_exec).to_string();
    assert!(shown_exec.contains("AB"), "{shown_exec:?}");
    assert!(shown_exec.contains("CD\x1b[31mE\x1b[0m"), "{shown_exec:?}");
    assert!(!shown_exec.contains("\x1b]") && !shown_exec.contains("\x1b[6n"), "{shown_exec:?}");
    let piped = Command::new(env!("CARGO_BIN_EXE_opendsecctl"))
        .args(["exec", &sb.id, "--", hostile])
        .env("OPENDSEC_ADDR", &addr)
        .env("OPENDSEC_TOKEN", &token)
        .env("OPENDSEC_CA", &ca)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&piped.stdout).contains("\x1b]52;c;"), "{piped:?}");

    // From the host: no process of the sandbox has a controlling terminal, is in the
    // terminal's session, or holds an fd of the terminal.
    let r = exec_in(&mut rt, &sb.id, "bg", "sleep 600 & echo started").await;
    assert_eq!(out(&r), "started");
    let name = opendsec_edge::backend::container::sandbox_name(&containers, &sb.id);
    let pids = SandboxCgroup::open(&name).unwrap().pids().unwrap();
    assert!(pids.len() >= 3, "agent, session, shell, sleep: {pids:?}");
    let pty = std::fs::read_link(format!("/proc/self/fd/{}", master.as_raw_fd())).unwrap();
    for pid in &pids {
        assert_eq!(stat_field(*pid, 7), Some(0), "process {pid} of the sandbox has a controlling terminal");
        assert_ne!(stat_field(*pid, 6), Some(terminal_sid), "process {pid} is in the terminal's session");
        for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
            let to = std::fs::read_link(fd.path()).unwrap_or_default();
            assert!(!to.starts_with("/dev/pts") && to != pty, "process {pid} holds {}", to.display());
        }
    }

    // The operator stops the cluster; the pane's shell takes the terminal again, reads
    // whatever was typed into it, and is told to exit.
    let cluster = children(shell.id());
    assert_eq!(cluster.len(), 1, "the shell runs the cluster: {cluster:?}");
    // SAFETY: kill with a pid of our own child's child and a signal number.
    unsafe { libc::kill(cluster[0], libc::SIGTERM) };
    wait_for("the cluster to exit", Duration::from_secs(60), || !Path::new(&format!("/proc/{}", cluster[0])).exists());
    let mut writer = std::fs::File::from(master);
    std::thread::sleep(Duration::from_millis(300));
    writer.write_all(b"exit\n").unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while shell.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the pane's shell did not exit: {}", text());
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!marker.exists(), "the sandbox typed a command into the operator's terminal:\n{}", text());
}
