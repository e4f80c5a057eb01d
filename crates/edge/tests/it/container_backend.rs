//! Root test of the `container` backend through the `Backend` trait: a busybox image in a store,
//! a sandbox created with the static agent as PID 1, a shell session used through the agent,
//! paused, resumed, adopted by a second backend instance (as after an edge restart) with the
//! session's state intact, stopped; nothing left behind; an agent killed is reported gone by
//! `probe`. A guard cleans up on failure. Needs `make agent` (the static agent) first.
use std::collections::HashSet;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::*;

use opendsec_edge::backend::container::{ContainerBackend, sandbox_name};
use opendsec_edge::backend::{Backend, BackendErrorKind};
use opendsec_edge::linuxrt::cgroup;
use opendsec_edge::linuxrt::rootfs;
use opendsec_edge::linuxrt::sandbox::Sandbox;

#[tokio::test(flavor = "multi_thread")]
async fn container_backend_lifecycle_adoption_and_cleanup() {
    if !rustix::process::geteuid().is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let _g = Guard { state: tmp.path().join("containers") };
    busybox_image(&tmp.path().join("store"), tmp.path()).await;
    let b = ContainerBackend::new(options(tmp.path())).unwrap();
    let versions = b.versioned().unwrap().runtime_versions();
    assert!(versions[0].starts_with("linuxrt cgroup v"), "{versions:?}");
    assert!(versions[1].starts_with("core scheduling: "), "{versions:?}");

    // An image nobody has: not found, nothing left.
    let missing = record("l0", "nosuch");
    assert!(matches!(b.create(&missing).await, Err(ref e) if e.kind() == BackendErrorKind::NotFound));
    assert!(!tmp.path().join("store/inuse").join(&missing.id).exists());

    let rec = record("l1", "busybox");
    b.create(&rec).await.unwrap();
    assert!(b.probe(&rec.id).await.unwrap());
    let pid = b.pid(&rec.id).unwrap();
    assert!(Path::new(&format!("/proc/{pid}")).exists());
    let inuse = tmp.path().join("store/inuse").join(&rec.id);
    let layers: Vec<String> = serde_json::from_slice(&std::fs::read(&inuse).unwrap()).unwrap();
    assert_eq!(layers.len(), 1);

    // PID 1 is the agent; a session keeps its directory between commands.
    let r = exec(&b, &rec.id, "s1", "cd /tmp && echo $$ > pid && cat /proc/1/cmdline | tr '\\0' ' '").await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    assert!(String::from_utf8_lossy(&r.stdout).contains("opendsec-agent aether"), "{r:?}");
    let r = exec(&b, &rec.id, "s1", "pwd").await;
    assert_eq!(String::from_utf8_lossy(&r.stdout).trim(), "/tmp");

    b.pause(&rec).await.unwrap();
    let adopted =
        Sandbox::adopt(&tmp.path().join("containers"), &sandbox_name(&tmp.path().join("containers"), &rec.id)).unwrap();
    assert_eq!(adopted.pid, pid);
    wait_for("frozen", Duration::from_secs(10), || {
        freezer_state(&adopted) == "FROZEN" || freezer_state(&adopted) == "1"
    });
    b.resume(&rec).await.unwrap();
    wait_for("thawed", Duration::from_secs(10), || {
        freezer_state(&adopted) == "THAWED" || freezer_state(&adopted) == "0"
    });

    // "Edge restart": a new backend instance adopts the sandbox; cleanup keeps it.
    drop(b);
    let b = ContainerBackend::new(options(tmp.path())).unwrap();
    assert!(!b.probe(&rec.id).await.unwrap());
    b.adopt(&rec).await.unwrap();
    assert!(b.probe(&rec.id).await.unwrap());
    assert_eq!(b.pid(&rec.id), Some(pid));
    // The same agent, the same session: its shell kept its directory.
    let r = exec(&b, &rec.id, "s1", "pwd; cat pid").await;
    assert!(String::from_utf8_lossy(&r.stdout).starts_with("/tmp\n"), "{r:?}");
    let keep: HashSet<String> = [rec.id.clone()].into();
    assert_eq!(b.cleanup(&keep).await.unwrap(), 0);
    assert!(b.probe(&rec.id).await.unwrap());
    assert!(inuse.exists());

    b.stop(&rec).await.unwrap();
    assert!(!b.probe(&rec.id).await.unwrap());
    assert!(!inuse.exists());
    wait_for("PID 1 gone", Duration::from_secs(10), || !Path::new(&format!("/proc/{pid}")).exists());
    assert!(cgroup::list(&sandbox_name(&tmp.path().join("containers"), &format!("{EDGE}."))).unwrap().is_empty());
    assert!(rootfs::loops_under(&tmp.path().join("containers")).is_empty());
    assert!(!tmp.path().join("containers").join(sandbox_name(&tmp.path().join("containers"), &rec.id)).exists());
    // Stopping again (nothing there) succeeds.
    b.stop(&rec).await.unwrap();

    // A sandbox no record keeps is removed by cleanup, holder file included.
    let rec2 = record("l2", "busybox");
    b.create(&rec2).await.unwrap();
    // An agent that dies is noticed through its Watch stream.
    let pid2 = b.pid(&rec2.id).unwrap();
    rustix::process::kill_process(rustix::process::Pid::from_raw(pid2).unwrap(), rustix::process::Signal::KILL)
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    while b.probe(&rec2.id).await.unwrap() {
        assert!(Instant::now() < deadline, "a killed agent still probes alive");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rec3 = record("l3", "busybox");
    b.create(&rec3).await.unwrap();
    // A paused sandbox's silent agent is fine; a running sandbox whose agent stops answering
    // (stopped by a signal here, as a hung agent would be) is reported gone.
    b.pause(&rec3).await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert!(b.probe(&rec3.id).await.unwrap(), "a paused sandbox's agent is expected to be silent");
    b.resume(&rec3).await.unwrap();
    assert!(b.probe(&rec3.id).await.unwrap());
    let pid3 = b.pid(&rec3.id).unwrap();
    let p3 = rustix::process::Pid::from_raw(pid3).unwrap();
    rustix::process::kill_process(p3, rustix::process::Signal::STOP).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while b.probe(&rec3.id).await.unwrap() {
        assert!(Instant::now() < deadline, "a hung agent still probes alive");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    rustix::process::kill_process(p3, rustix::process::Signal::CONT).unwrap();
    assert_eq!(b.cleanup(&HashSet::new()).await.unwrap(), 2);
    assert!(!b.probe(&rec2.id).await.unwrap());
    assert!(!tmp.path().join("store/inuse").join(&rec2.id).exists());
    assert!(cgroup::list(&sandbox_name(&tmp.path().join("containers"), &format!("{EDGE}."))).unwrap().is_empty());
}
