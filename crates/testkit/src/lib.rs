//! What the tests of several crates share (a dev-dependency only, never linked into a
//! binary): waits bounded by a deadline instead of fixed sleeps, the root check, free
//! loopback ports, busybox root file systems, and certificates of a test PKI.
//!
//! A wait that runs out fails the test with what it was waiting for; none asserts on how
//! long anything took.
#![forbid(unsafe_code)]

use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use opendsec_common::pki::{Identity, Role};
use opendsec_common::tls::Credentials;

/// How long the waits here give a condition unless told otherwise: long enough for a loaded
/// 2-core CI machine, short enough that a hang fails the test rather than CI.
pub const WAIT: Duration = Duration::from_secs(30);

/// The pause between two looks: short at first (most conditions hold within milliseconds),
/// then at most 50 ms.
fn next_pause(p: Duration) -> Duration {
    (p * 2).min(Duration::from_millis(50))
}

/// Waits (async) until `check` answers true; fails the test naming `what` after `within`.
pub async fn eventually<F, Fut>(what: &str, within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    let mut pause = Duration::from_millis(2);
    while !check().await {
        assert!(Instant::now() < deadline, "timed out after {within:?} waiting for: {what}");
        tokio::time::sleep(pause).await;
        pause = next_pause(pause);
    }
}

/// [`eventually`] for a condition that needs no await.
pub async fn until(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    eventually(what, within, || std::future::ready(check())).await
}

/// [`until`] for blocking tests: sleeps the thread between looks.
pub fn wait_for(what: &str, within: Duration, mut check: impl FnMut() -> bool) {
    let deadline = Instant::now() + within;
    let mut pause = Duration::from_millis(2);
    while !check() {
        assert!(Instant::now() < deadline, "timed out after {within:?} waiting for: {what}");
        std::thread::sleep(pause);
        pause = next_pause(pause);
    }
}

/// Whether the test runs as root (CI does; tests that need root say so when it does not).
pub fn is_root() -> bool {
    rustix::process::geteuid().is_root()
}

/// A loopback TCP port free a moment ago (the listener is closed before returning).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a loopback port");
    l.local_addr().expect("a bound address").port()
}

/// A root file system at `<dir>/bbroot`: Debian's static busybox with every applet linked,
/// the usual mount points and the `extra` directories (relative paths).
pub fn busybox_rootfs(dir: &Path, extra: &[&str]) -> PathBuf {
    let root = dir.join("bbroot");
    for d in ["bin", "proc", "sys", "dev", "tmp", "etc"].iter().chain(extra) {
        std::fs::create_dir_all(root.join(d)).expect("make a rootfs directory");
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).expect("copy /bin/busybox (apt install busybox-static)");
    let list = std::process::Command::new("/bin/busybox").arg("--list").output().expect("run busybox --list");
    for applet in String::from_utf8_lossy(&list.stdout).lines().filter(|a| *a != "busybox") {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).expect("link an applet");
    }
    root
}

/// The certificate of `role`/`name` from the test PKI in `pki` (made on first use).
pub fn creds(pki: &Path, role: Role, name: &str) -> Arc<Credentials> {
    Credentials::issue_local(pki, &Identity::new(role, name).expect("a valid test identity"))
        .expect("issue a test certificate")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn waits_end_when_the_condition_holds() {
        let mut n = 0;
        until("three looks", WAIT, || {
            n += 1;
            n == 3
        })
        .await;
        assert_eq!(n, 3);
    }

    #[tokio::test]
    #[should_panic(expected = "waiting for: never")]
    async fn a_wait_that_runs_out_fails_naming_its_condition() {
        until("never", Duration::from_millis(20), || false).await;
    }
}
