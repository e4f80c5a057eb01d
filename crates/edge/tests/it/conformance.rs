//! The backend conformance suite: what every isolation backend must do through the `Backend`
//! trait, the same for all, so that the edge above can treat them alike. It runs on `sim` in
//! every test run and on `container` as root (CI runs as root); a backend added later gets a
//! harness here and must pass it too.
//!
//! The suite: create -> probe -> pause -> pause again (a no-op) -> resume -> resume again -> stop
//! -> stop again, and stop
//! of a sandbox the backend never had; adoption by a new instance of the backend (an edge
//! restart) with the sandbox alive; cleanup of what no record claims, keeping what one does; a
//! failed creation leaves nothing behind (the backend's own cleanup finds nothing, and the
//! harness looks at what the backend holds on the node: files, mounts, cgroups, loop devices);
//! runtime versions reported.
use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use opendsec_edge::backend::sim::SimBackend;
use opendsec_edge::backend::{Backend, BackendErrorKind};
use opendsec_edge::record::SandboxRecord;
use opendsec_edge::state::SandboxStatus;

use crate::support;

/// What a backend holds on the node for a sandbox id.
type Held = dyn Fn(&str) -> Vec<String>;

/// How to run the suite on one backend.
struct Harness {
    /// A new instance of the backend on the same node (the first, or the one after a restart).
    make: Box<dyn Fn() -> Arc<dyn Backend>>,
    /// A record the backend can create (state CREATING).
    record: Box<dyn Fn(&str) -> SandboxRecord>,
    /// A backend instance and a record whose creation fails.
    failing: Box<dyn Fn() -> (Arc<dyn Backend>, SandboxRecord)>,
    /// What the backend holds on the node for sandbox `id` (files, mounts, cgroups, loop
    /// devices), by name; empty when nothing.
    held: Box<Held>,
}

fn with_state(rec: &SandboxRecord, state: SandboxStatus) -> SandboxRecord {
    SandboxRecord { state, ..rec.clone() }
}

async fn conformance(h: &Harness) {
    let b = (h.make)();
    let versions = b.versioned().map(|v| v.runtime_versions()).unwrap_or_default();
    assert!(!versions.is_empty() && versions.iter().all(|v| !v.trim().is_empty()), "runtime versions: {versions:?}");

    // The lifecycle.
    let rec = (h.record)("conf-a");
    assert!(!b.probe(&rec.id).await.unwrap(), "probe before create");
    b.create(&rec).await.unwrap();
    assert!(b.probe(&rec.id).await.unwrap(), "probe after create");
    assert!(!(h.held)(&rec.id).is_empty(), "a running sandbox holds something on the node");
    let running = with_state(&rec, SandboxStatus::Running);
    b.pause(&running).await.unwrap();
    assert!(b.probe(&rec.id).await.unwrap(), "a paused sandbox is alive");
    // Pausing again is a no-op (a recovery may repeat an interrupted pause): still paused, alive.
    let paused = with_state(&rec, SandboxStatus::Paused);
    b.pause(&paused).await.unwrap();
    assert!(b.probe(&rec.id).await.unwrap());
    b.resume(&paused).await.unwrap();
    assert!(b.probe(&rec.id).await.unwrap(), "alive after resume");
    b.resume(&running).await.unwrap();
    assert!(b.probe(&rec.id).await.unwrap(), "resuming again changes nothing");
    b.stop(&running).await.unwrap();
    assert!(!b.probe(&rec.id).await.unwrap(), "probe after stop");
    assert_eq!((h.held)(&rec.id), Vec::<String>::new(), "a stopped sandbox leaves nothing");
    b.stop(&running).await.unwrap();
    // Stop of a sandbox this backend never had succeeds (the edge uses it to clear leftovers).
    b.stop(&(h.record)("conf-never")).await.unwrap();
    let err = b.pause(&with_state(&(h.record)("conf-never"), SandboxStatus::Running)).await;
    assert!(matches!(err, Err(ref e) if e.kind() == BackendErrorKind::NotFound), "pause of nothing: {err:?}");

    // An edge restart: a new instance does not hold the sandbox until it adopts it; cleanup
    // keeps what a record claims and removes the rest.
    let kept = (h.record)("conf-kept");
    let lost = (h.record)("conf-lost");
    b.create(&kept).await.unwrap();
    b.create(&lost).await.unwrap();
    drop(b);
    let b = (h.make)();
    let kept = with_state(&kept, SandboxStatus::Running);
    b.adopt(&kept).await.unwrap();
    assert!(b.probe(&kept.id).await.unwrap(), "adopted");
    let keep: HashSet<String> = [kept.id.clone()].into();
    assert_eq!(b.cleanup(&keep).await.unwrap(), 1, "the sandbox no record claims is removed");
    assert_eq!((h.held)(&lost.id), Vec::<String>::new(), "cleanup left something of {}", lost.id);
    assert!(b.probe(&kept.id).await.unwrap(), "cleanup kept the claimed sandbox");
    b.pause(&kept).await.unwrap();
    b.resume(&with_state(&kept, SandboxStatus::Paused)).await.unwrap();
    b.stop(&kept).await.unwrap();
    assert_eq!(b.cleanup(&HashSet::new()).await.unwrap(), 0);
    drop(b);

    // A failed creation leaves nothing behind.
    let (b, bad) = (h.failing)();
    assert!(b.create(&bad).await.is_err());
    assert!(!b.probe(&bad.id).await.unwrap());
    assert_eq!((h.held)(&bad.id), Vec::<String>::new(), "a failed creation left something");
    assert_eq!(b.cleanup(&HashSet::new()).await.unwrap(), 0, "a failed creation left something to clean up");
}

#[tokio::test]
async fn sim_conforms() {
    // sim's "node" is the backend's memory: an edge restart finds the same sandboxes there, as
    // the processes of a real node outlive the edge.
    let node = Arc::new(SimBackend::new());
    let held_node = node.clone();
    let h =
        Harness {
            make: Box::new(move || -> Arc<dyn Backend> { node.clone() }),
            record: Box::new(sim_record),
            failing: Box::new(|| {
                let b = Arc::new(SimBackend::new());
                b.fail_creates(Some(opendsec_common::Reason::Internal));
                (b as Arc<dyn Backend>, sim_record("conf-bad"))
            }),
            held: Box::new(move |id| {
                if held_node.is_paused(id).is_some() { vec![format!("sim sandbox {id}")] } else { Vec::new() }
            }),
        };
    conformance(&h).await;
}

fn sim_record(lease: &str) -> SandboxRecord {
    let mut r = support::record(lease, "scratch");
    r.spec.backend = "sim".into();
    r
}

/// What a container sandbox holds on the node, by name.
fn container_held(state: &Path, store: &Path, id: &str) -> Vec<String> {
    use opendsec_edge::backend::container::sandbox_name;
    use opendsec_edge::linuxrt::{cgroup, rootfs};
    let name = sandbox_name(state, id);
    let mut held = Vec::new();
    if state.join(&name).exists() {
        held.push(format!("directory {}", state.join(&name).display()));
    }
    if store.join("inuse").join(id).exists() {
        held.push(format!("holder file of {id}"));
    }
    held.extend(cgroup::list(&name).unwrap_or_default().into_iter().map(|c| format!("cgroup {c}")));
    let dir = state.join(&name);
    held.extend(
        rootfs::loops_under(state)
            .into_iter()
            .filter(|(_, backing)| backing.starts_with(&dir))
            .map(|(dev, f)| format!("loop device {} on {}", dev.display(), f.display())),
    );
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    held.extend(mounts.lines().filter(|l| l.contains(dir.to_str().unwrap_or("-"))).map(|l| format!("mount {l}")));
    held
}

#[tokio::test(flavor = "multi_thread")]
async fn container_conforms() {
    if !rustix::process::geteuid().is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let root: PathBuf = tmp.path().to_path_buf();
    let _g = support::Guard { state: root.join("containers") };
    support::busybox_image(&root.join("store"), &root).await;
    // A hostile image: its /proc is a symlink out of the root. Setup refuses it after the
    // sandbox's cgroup, disk and loop device exist, so the backend must undo all of them.
    let hostile = root.join("hostile");
    let bad_root = support::busybox_rootfs(&hostile, &[]);
    std::fs::remove_dir(bad_root.join("proc")).unwrap();
    std::os::unix::fs::symlink("/tmp", bad_root.join("proc")).unwrap();
    support::image_from(&root.join("store"), &bad_root, "hostile").await;
    let opts = support::options(&root);
    let make_opts = opts.clone();
    let (state, store) = (root.join("containers"), root.join("store"));
    let h = Harness {
        make: Box::new(move || -> Arc<dyn Backend> {
            Arc::new(opendsec_edge::backend::container::ContainerBackend::new(make_opts.clone()).unwrap())
        }),
        record: Box::new(|lease| support::record(lease, "busybox")),
        failing: Box::new(move || -> (Arc<dyn Backend>, SandboxRecord) {
            let b = opendsec_edge::backend::container::ContainerBackend::new(opts.clone()).unwrap();
            (Arc::new(b), support::record("conf-bad", "hostile"))
        }),
        held: Box::new(move |id| container_held(&state, &store, id)),
    };
    conformance(&h).await;
}
