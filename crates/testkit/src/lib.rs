//! What the tests of several crates share (a dev-dependency only, never linked into a
//! binary): waits bounded by a deadline instead of fixed sleeps, the root check, free
//! loopback ports, busybox root file systems, certificates of a test PKI, layers put in an
//! image store as an import leaves them, a fake watcher, and a linearizability checker.
//!
//! A wait that runs out fails the test with what it was waiting for; none asserts on how
//! long anything took.
#![forbid(unsafe_code)]

pub mod lan;
pub mod linear;
pub mod netns;
pub mod s3;

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
/// Runs test `name` of the current test binary (an `#[ignore]`d writer) as a child process
/// with `env`, kills it (`SIGKILL`) after `after`, and answers the lines it printed (the last
/// one may be cut by the kill). For the crash tests.
pub fn run_and_kill(name: &str, env: &[(&str, String)], after: Duration) -> Vec<String> {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe().expect("the test binary"))
        .args(["--exact", name, "--ignored", "--nocapture", "--test-threads", "1"])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("start the writer");
    let out = child.stdout.take().expect("piped");
    let reader =
        std::thread::spawn(move || std::io::BufReader::new(out).lines().map_while(Result::ok).collect::<Vec<_>>());
    std::thread::sleep(after);
    child.kill().expect("kill the writer");
    child.wait().expect("reap the writer");
    reader.join().expect("the reader")
}

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

/// The resident memory of process `pid` in bytes (`VmRSS`); 0 when it cannot be read (gone).
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let kb = status.lines().find_map(|l| l.strip_prefix("VmRSS:")).map(|v| v.trim().trim_end_matches("kB").trim());
    kb.and_then(|v| v.parse::<u64>().ok()).unwrap_or(0) * 1024
}

/// This process's resident memory, in MiB.
pub fn rss_mib() -> u64 {
    rss_bytes(std::process::id()) >> 20
}

/// Puts a one-file layer (id: the byte `n` repeated) in `store` as an import for `project`
/// leaves it; returns its id. What is in it does not matter to the API.
pub fn put_layer(store: &opendsec_images::Store, n: u8, project: &str) -> String {
    put_layer_sized(store, n, project, 1)
}

/// [`put_layer`] whose metadata says it holds `size_bytes` (what the store quota counts).
pub fn put_layer_sized(store: &opendsec_images::Store, n: u8, project: &str, size_bytes: u64) -> String {
    use opendsec_images::{LayerId, LayerMeta};
    let id = LayerId::from_digest(&[n; 32]);
    let pending = store.begin_layer().expect("begin a layer");
    std::fs::write(pending.rootfs().join("file"), [n]).expect("write the layer's file");
    let meta = LayerMeta {
        v: 1,
        id: id.clone(),
        size_bytes,
        entries: 1,
        created_at_ms: 1,
        source: "test".into(),
        diff_id: id.diff_id(),
        lowers: vec![],
    };
    store.commit_layer(pending, &meta).expect("commit the layer");
    store.add_layer_user(&id, project).expect("record the layer's project");
    id.to_string()
}

/// A watcher that serves the snapshot a test sets (its version counts the calls) and
/// records the edges' registrations.
#[derive(Clone, Debug, Default)]
pub struct FakeWatcher {
    pub edges: Arc<std::sync::Mutex<Vec<opendsec_proto::v1::EdgeInfo>>>,
    pub registrations: Arc<std::sync::Mutex<Vec<opendsec_proto::v1::RegisterEdgeRequest>>>,
    version: Arc<std::sync::atomic::AtomicU64>,
}

#[tonic::async_trait]
impl opendsec_proto::v1::watcher_server::Watcher for FakeWatcher {
    async fn get_snapshot(
        &self,
        _: tonic::Request<opendsec_proto::v1::GetSnapshotRequest>,
    ) -> Result<tonic::Response<opendsec_proto::v1::ClusterSnapshot>, tonic::Status> {
        let version = self.version.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        Ok(tonic::Response::new(opendsec_proto::v1::ClusterSnapshot {
            version,
            taken_at_ms: opendsec_common::time::now_ms(),
            edges: self.edges.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        }))
    }

    async fn register_edge(
        &self,
        req: tonic::Request<opendsec_proto::v1::RegisterEdgeRequest>,
    ) -> Result<tonic::Response<opendsec_proto::v1::RegisterEdgeResponse>, tonic::Status> {
        self.registrations.lock().unwrap_or_else(|p| p.into_inner()).push(req.into_inner());
        Ok(tonic::Response::new(opendsec_proto::v1::RegisterEdgeResponse {}))
    }
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
