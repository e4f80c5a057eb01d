//! The VM backends (`microvm` on `-M microvm`, `fullvm` on q35) on real QEMU, as root: the
//! backend conformance suite, and a sandbox's calls end to end through the agent in the guest
//! (over the virtio-serial port and its handshake). Under TCG here (no usable /dev/kvm):
//! each boot takes seconds, so the number of VMs is kept small.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use opendsec_edge::backend::vm::{Accel, Machine, VmBackend, VmOptions};
use opendsec_edge::backend::{Backend, BackendErrorKind};
use opendsec_edge::linuxrt::idmap::{self, IdPool};
use opendsec_edge::record::SandboxRecord;
use opendsec_edge::state::SandboxStatus;
use opendsec_proto::v1 as pb;

use crate::support;

/// scripts/vm-kernel.sh's output (`OPENDSEC_VM_KERNEL` overrides).
fn kernel_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("OPENDSEC_VM_KERNEL") {
        return d.into();
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/vm-kernel.sh");
    let out = std::process::Command::new(script).arg("--path").output().unwrap();
    let dir = PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    assert!(dir.join("complete").exists(), "no guest kernel in {}: run `make vm-kernel`", dir.display());
    dir
}

fn options(root: &Path, machine: Machine) -> VmOptions {
    VmOptions {
        machine,
        store_dir: root.join("store"),
        state_dir: root.join("vms"),
        agent: support::static_agent(),
        kernel_dir: kernel_dir(),
        qemu: "qemu-system-x86_64".into(),
        accel: Accel::Tcg,
        boot_timeout: Duration::from_secs(90),
        agent_silence: Duration::from_secs(60),
        ids: IdPool::new(idmap::DEFAULT_FIRST_ID, idmap::DEFAULT_RANGES).unwrap(),
        network: None,
        gpu_devices: Vec::new(),
    }
}

fn record(lease: &str, backend: &str) -> SandboxRecord {
    let mut r = support::record(lease, "busybox");
    r.spec.backend = backend.into();
    r.spec.resources.memory_mb = 192;
    r.spec.resources.disk_mb = 64;
    r
}

/// The name of sandbox `id`'s VM on the `machine` backend of the edge state under `root`.
fn vm_name(root: &Path, machine: &str, id: &str) -> String {
    let m = if machine == "microvm" { Machine::Microvm } else { Machine::Q35 };
    opendsec_edge::backend::vm::name_of(m, &root.join("vms"), id)
}

/// What a VM holds on the node: its directory, its layer holder file, its VMM process.
fn held(root: &Path, machine: &str, id: &str) -> Vec<String> {
    let name = vm_name(root, machine, id);
    let dir = root.join("vms").join(&name);
    let mut held = Vec::new();
    if dir.exists() {
        held.push(format!("directory {}", dir.display()));
    }
    if opendsec_edge::backend::vm::sockets_of(&dir).exists() {
        held.push(format!("socket directory of {id}"));
    }
    if root.join("store/inuse").join(&name).exists() {
        held.push(format!("holder file of {id}"));
    }
    if !opendsec_edge::linuxrt::cgroup::list(&name).unwrap().is_empty() {
        held.push(format!("cgroup {name}"));
    }
    for c in std::fs::read_dir(idmap::CLAIMS_DIR).into_iter().flatten().flatten() {
        if std::fs::read_to_string(c.path()).unwrap_or_default().lines().next() == Some(name.as_str()) {
            held.push(format!("uid claim {}", c.path().display()));
        }
    }
    for p in std::fs::read_dir("/proc").unwrap().flatten() {
        let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
        if String::from_utf8_lossy(&cmdline).contains(dir.to_str().unwrap()) {
            held.push(format!("process {}", p.file_name().to_string_lossy()));
        }
    }
    held
}

/// What the host sees of the VMM of `dir`: not root, no capability, no way to gain one, in
/// the empty jail, in a network namespace of its own, in its own cgroup with limits, under
/// QEMU's seccomp filter, its guest's memory and disk reserved on the host's disk.
fn assert_confined(dir: &Path, name: &str) {
    let pid: i32 = std::fs::read_to_string(dir.join("pid")).unwrap().trim().parse().unwrap();
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field =
        |k: &str| status.lines().find_map(|l| l.strip_prefix(&format!("{k}:"))).map(|v| v.trim().to_string()).unwrap();
    let uid = field("Uid");
    let uids: Vec<u32> = uid.split_whitespace().map(|v| v.parse().unwrap()).collect();
    assert!(uids.iter().all(|&u| u >= idmap::DEFAULT_FIRST_ID && u == uids[0]), "{uid}");
    let kept: u32 = std::fs::read_to_string(dir.join("ids")).unwrap().trim().parse().unwrap();
    assert_eq!(uids[0], kept);
    assert!(field("Gid").split_whitespace().all(|g| g == kept.to_string()), "{status}");
    for cap in ["CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"] {
        if cap != "CapBnd" {
            assert_eq!(u64::from_str_radix(&field(cap), 16).unwrap(), 0, "{cap}");
        }
    }
    assert_eq!(field("NoNewPrivs"), "1");
    assert_eq!(field("Seccomp"), "2");
    let root = std::fs::read_link(format!("/proc/{pid}/root")).unwrap();
    assert_eq!(root, dir.parent().unwrap().join(".jail"));
    assert_eq!(std::fs::read_dir(&root).unwrap().count(), 0, "the jail is empty");
    for ns in ["net", "ipc", "uts"] {
        let host = std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
        assert_ne!(std::fs::read_link(format!("/proc/{pid}/ns/{ns}")).unwrap(), host, "{ns}");
    }
    // Its session of its own: no terminal of the edge's.
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    let after: Vec<&str> = stat.rsplit_once(')').unwrap().1.split_whitespace().collect();
    assert_eq!(after[3], pid.to_string(), "session leader");
    assert_eq!(after[4], "0", "no controlling terminal");
    // Its cgroup (v1: per controller; v2: the one line), with a memory and a pids limit.
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
    let dir_of = |ctrl: &str| {
        let line = cg
            .lines()
            .find(|l| l.split(':').nth(1).is_some_and(|c| c.split(',').any(|c| c == ctrl)))
            .or_else(|| cg.lines().find(|l| l.starts_with("0::")))
            .unwrap_or_else(|| panic!("{cg}"));
        let rel = line.splitn(3, ':').nth(2).unwrap();
        assert!(rel.ends_with(&format!("/{name}")), "{ctrl}: {line}");
        let v1 = Path::new("/sys/fs/cgroup").join(ctrl).join(rel.trim_start_matches('/'));
        if v1.is_dir() { v1 } else { Path::new("/sys/fs/cgroup").join(rel.trim_start_matches('/')) }
    };
    let read = |d: PathBuf, files: [&str; 2]| {
        files.iter().find_map(|f| std::fs::read_to_string(d.join(f)).ok()).unwrap().trim().to_string()
    };
    let limit = read(dir_of("memory"), ["memory.limit_in_bytes", "memory.max"]);
    assert!(limit.parse::<u64>().is_ok_and(|l| l < 1 << 40), "a memory limit: {limit}");
    assert_ne!(read(dir_of("pids"), ["pids.max", "pids.max"]), "max");
    let _ = dir_of("cpu");
    // The guest's memory and disk hold their space on the host's disk.
    use std::os::unix::fs::MetadataExt;
    for f in ["mem", "disk.img"] {
        let m = std::fs::metadata(dir.join(f)).unwrap();
        assert!(m.blocks() * 512 >= m.len(), "{f}: {} of {} bytes allocated", m.blocks() * 512, m.len());
    }
    // No file of the host is open in it but its own VM's and the shared read-only ones.
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap().flatten() {
        let Ok(target) = std::fs::read_link(fd.path()) else { continue };
        if target.is_absolute() && target.exists() && !target.starts_with("/dev") {
            assert!(
                target.starts_with(dir)
                    || target.to_string_lossy().contains("/vmdisks/")
                    || target.starts_with(dir.parent().unwrap().join(".boot")),
                "the VMM holds {}",
                target.display()
            );
        }
    }
}

/// Stops what a failing test leaves running (VMMs outlive the test in sessions of their own):
/// on a panic, every VMM of the test's directory is killed and the cgroups and uid claims of
/// the test's sandboxes are released.
struct Leftovers {
    root: PathBuf,
    names: Vec<String>,
}

impl Drop for Leftovers {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        for p in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
            let cmdline = std::fs::read(p.path().join("cmdline")).unwrap_or_default();
            if String::from_utf8_lossy(&cmdline).contains(self.root.to_str().unwrap_or("-"))
                && let Some(pid) = p.file_name().to_str().and_then(|n| n.parse().ok())
                && let Some(pid) = rustix::process::Pid::from_raw(pid)
            {
                let _ = rustix::process::kill_process(pid, rustix::process::Signal::KILL);
            }
        }
        std::thread::sleep(Duration::from_millis(300));
        for name in &self.names {
            if let Ok(cg) = opendsec_edge::linuxrt::cgroup::SandboxCgroup::open(name) {
                let _ = cg.remove();
            }
            for c in std::fs::read_dir(idmap::CLAIMS_DIR).into_iter().flatten().flatten() {
                if std::fs::read_to_string(c.path()).unwrap_or_default().lines().next() == Some(name.as_str()) {
                    let _ = std::fs::remove_file(c.path());
                }
            }
        }
    }
}

fn with_state(rec: &SandboxRecord, state: SandboxStatus) -> SandboxRecord {
    SandboxRecord { state, ..rec.clone() }
}

async fn exec(b: &VmBackend, id: &str, cmd: &str) -> pb::ExecResult {
    use opendsec_edge::backend::Backend;
    let mut c = opendsec_edge::backend::agent_client(b.agent_access().unwrap().agent(id).unwrap());
    let req =
        pb::ExecRequest { sandbox_id: id.into(), session_id: "main".into(), command: cmd.into(), ..Default::default() };
    c.exec(req).await.unwrap().into_inner()
}

async fn suite(machine: Machine) {
    if !rustix::process::geteuid().is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let name = match machine {
        Machine::Microvm => "microvm",
        Machine::Q35 => "fullvm",
    };
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let leases = ["vm-a", "vm-kept", "vm-lost", "vm-orphan", "vm-killed", "vm-bad"];
    let _leftovers = Leftovers {
        root: root.clone(),
        names: leases.iter().map(|l| vm_name(&root, name, &record(l, name).id)).collect(),
    };
    support::busybox_image(&root.join("store"), &root).await;
    let make = || Arc::new(VmBackend::new(options(&root, machine)).unwrap());
    let b = make();
    let versions = b.versioned().unwrap().runtime_versions();
    assert!(versions[0].starts_with("qemu ") && versions[0].ends_with("(tcg)"), "{versions:?}");

    // The lifecycle, and the agent's calls in the guest.
    let rec = record("vm-a", name);
    assert!(!b.probe(&rec.id).await.unwrap());
    let started = std::time::Instant::now();
    b.create(&rec).await.unwrap();
    eprintln!("{name}: create -> agent answering: {} ms (TCG)", started.elapsed().as_millis());
    assert!(b.probe(&rec.id).await.unwrap());
    assert!(!held(&root, name, &rec.id).is_empty());
    // Its sockets control it: its directory is root's alone.
    use std::os::unix::fs::PermissionsExt;
    let dir = root.join("vms").join(vm_name(&root, name, &rec.id));
    assert_eq!(std::fs::metadata(&dir).unwrap().permissions().mode() & 0o777, 0o700);
    assert_confined(&dir, &vm_name(&root, name, &rec.id));
    let r = exec(
        &b,
        &rec.id,
        "cat /run/opendsec/sandbox-id; hostname; echo $OPENDSEC_SANDBOX_ID; cat /etc/passwd | head -1",
    )
    .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    assert_eq!(out.lines().take(3).collect::<Vec<_>>(), [rec.id.as_str(), "vm-a", rec.id.as_str()], "{out}");
    // A real kernel of its own, the image as its root, its writable disk under it, and no
    // vsock device: the only way out is its own serial port.
    let r = exec(
        &b,
        &rec.id,
        "uname -r; echo x > /written && cat /written; ls /dev/vsock 2>&1; ls /dev/virtio-ports; df -k / | tail -1",
    )
    .await;
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines[0].ends_with("-amd64"), "{out}");
    assert_eq!(lines[1], "x");
    assert!(lines[2].contains("No such file"), "{out}");
    assert_eq!(lines[3], "opendsec.agent", "{out}");
    // A full VM's image disk is persistent memory read with DAX (the host's page cache, not a
    // copy in the guest); a microvm's is a block device.
    // (The mount itself lies outside the guest's root: its kernel log says where it came from.)
    let log = String::from_utf8_lossy(&exec(&b, &rec.id, "dmesg | grep erofs").await.stdout).to_string();
    if machine == Machine::Q35 {
        assert!(log.contains("(device pmem0): mounted") && log.contains("DAX enabled"), "{log}");
    } else {
        assert!(log.contains("(device vd"), "{log}");
    }

    // A background process and the session's state survive a pause. A microvm's pause
    // saves its state and ends its VMM (the memory goes back to the host); its resume restores
    // it in a new VMM, and the guest takes the host's clock again.
    let r = exec(&b, &rec.id, "cd /tmp && KEPT=yes && (sleep 1000 &) && echo started").await;
    assert_eq!(String::from_utf8_lossy(&r.stdout), "started\n");
    let running = with_state(&rec, SandboxStatus::Running);
    let t = std::time::Instant::now();
    b.pause(&running).await.unwrap();
    eprintln!("{name}: pause {} ms", t.elapsed().as_millis());
    assert!(b.probe(&rec.id).await.unwrap(), "a paused VM is alive");
    let vmm = held(&root, name, &rec.id).iter().filter(|h| h.starts_with("process")).count();
    assert_eq!(vmm, usize::from(machine == Machine::Q35), "a paused microvm has no VMM, a paused full VM keeps it");
    let paused = with_state(&rec, SandboxStatus::Paused);
    b.pause(&paused).await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let t = std::time::Instant::now();
    b.resume(&paused).await.unwrap();
    eprintln!("{name}: resume {} ms", t.elapsed().as_millis());
    b.resume(&running).await.unwrap();
    let r = exec(&b, &rec.id, "cat /written; echo $(pwd) $KEPT; ps -o args | grep -c '[s]leep 1000'; date +%s").await;
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines[..3], ["x", "/tmp yes", "1"], "{out}");
    // The VMM that restored it is as confined as the first.
    assert_confined(&dir, &vm_name(&root, name, &rec.id));
    if machine == Machine::Microvm {
        let host = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs() as i64;
        let guest: i64 = lines[3].parse().unwrap();
        assert!((host - guest).abs() <= 1, "the restored guest's clock: {guest}, the host's: {host}");
    }
    b.stop(&running).await.unwrap();
    assert!(!b.probe(&rec.id).await.unwrap());
    assert_eq!(held(&root, name, &rec.id), Vec::<String>::new(), "a stopped VM leaves nothing");
    b.stop(&running).await.unwrap();
    b.stop(&record("vm-never", name)).await.unwrap();
    let err = b.pause(&with_state(&record("vm-never", name), SandboxStatus::Running)).await;
    assert!(matches!(err, Err(ref e) if e.kind() == BackendErrorKind::NotFound), "{err:?}");

    // An edge restart: VMs outlive the edge and are adopted; cleanup removes what no record
    // claims.
    let kept = record("vm-kept", name);
    let lost = record("vm-lost", name);
    let (k, l) = tokio::join!(b.create(&kept), b.create(&lost));
    k.unwrap();
    l.unwrap();
    drop(b);
    let b = make();
    let kept = with_state(&kept, SandboxStatus::Running);
    b.adopt(&kept).await.unwrap();
    assert!(b.probe(&kept.id).await.unwrap(), "adopted");
    // A cgroup left without its VM's directory (a teardown cut short) goes too.
    let orphan = record("vm-orphan", name);
    let limits = opendsec_edge::linuxrt::cgroup::Limits { cpu_millis: 0, best_effort: false, memory_bytes: 0, pids: 0 };
    opendsec_edge::linuxrt::cgroup::SandboxCgroup::create(&vm_name(&root, name, &orphan.id), &limits).unwrap();
    let keep: HashSet<String> = [kept.id.clone()].into();
    assert_eq!(b.cleanup(&keep).await.unwrap(), 2);
    assert_eq!(held(&root, name, &lost.id), Vec::<String>::new());
    assert_eq!(held(&root, name, &orphan.id), Vec::<String>::new());
    let r = exec(&b, &kept.id, "echo adopted").await;
    assert_eq!(String::from_utf8_lossy(&r.stdout), "adopted\n");
    b.stop(&kept).await.unwrap();
    assert_eq!(b.cleanup(&HashSet::new()).await.unwrap(), 0);

    // A VMM killed from outside: the sandbox is found gone (the edge then marks it lost), and
    // stopping it removes what is left.
    let killed = record("vm-killed", name);
    b.create(&killed).await.unwrap();
    let dir = root.join("vms").join(vm_name(&root, name, &killed.id));
    let pid: i32 = std::fs::read_to_string(dir.join("pid")).unwrap().trim().parse().unwrap();
    rustix::process::kill_process(rustix::process::Pid::from_raw(pid).unwrap(), rustix::process::Signal::KILL).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while b.probe(&killed.id).await.unwrap() {
        assert!(std::time::Instant::now() < deadline, "a killed VMM still reads as alive");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    b.stop(&with_state(&killed, SandboxStatus::Running)).await.unwrap();
    assert_eq!(held(&root, name, &killed.id), Vec::<String>::new());

    // A guest whose agent cannot start (its default user is not in the image) fails the
    // creation, and leaves nothing.
    let mut bad = record("vm-bad", name);
    bad.spec.user = "nobody-such".into();
    let e = b.create(&bad).await.unwrap_err();
    eprintln!("{name}: a failed creation: {e}");
    assert!(!b.probe(&bad.id).await.unwrap());
    assert_eq!(held(&root, name, &bad.id), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn microvm_conforms() {
    suite(Machine::Microvm).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn fullvm_conforms() {
    suite(Machine::Q35).await;
}

#[test]
fn kvm_is_probed_by_a_boot_and_the_answer_kept() {
    if !rustix::process::geteuid().is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let kernel = kernel_dir();
    let initramfs =
        opendsec_edge::backend::vm::disks::initramfs(&tmp.path().join("boot"), &support::static_agent(), &kernel)
            .unwrap();
    let qemu = Path::new("qemu-system-x86_64");
    let first = opendsec_edge::backend::vm::probe_kvm(qemu, &kernel, &initramfs, tmp.path());
    // Printed, not asserted: whether this host's KVM boots a guest is the host's business
    // (ours, a nested PVM device, does not).
    eprintln!("KVM boots a guest here: {first}");
    let kept: Vec<_> = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("kvm-probe-"))
        .map(|e| std::fs::read_to_string(e.path()).unwrap())
        .collect();
    assert_eq!(kept, [if first { "kvm" } else { "tcg" }]);
    // Asked again, the kept answer is the answer, even when it says otherwise now.
    let e = std::fs::read_dir(tmp.path())
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("kvm-probe-"))
        .unwrap();
    std::fs::write(e.path(), if first { "tcg" } else { "kvm" }).unwrap();
    assert_eq!(opendsec_edge::backend::vm::probe_kvm(qemu, &kernel, &initramfs, tmp.path()), !first);
}

/// What `cmd` prints in session `session` of VM `id` (it must succeed).
async fn out(b: &VmBackend, id: &str, session: &str, cmd: &str) -> String {
    let mut c = opendsec_edge::backend::agent_client(b.agent_access().unwrap().agent(id).unwrap());
    let req = pb::ExecRequest {
        sandbox_id: id.into(),
        session_id: session.into(),
        command: cmd.into(),
        ..Default::default()
    };
    let r = c.exec(req).await.unwrap().into_inner();
    assert_eq!(r.exit_code, 0, "{cmd}: {r:?}");
    String::from_utf8_lossy(&r.stdout).trim().to_string()
}

/// `(id, count)` from the counter file a copy's background process keeps writing.
async fn counter(b: &VmBackend, id: &str) -> (String, u64) {
    let line = out(b, id, "probe", "cat /tmp/counter").await;
    let (who, n) = line.split_once(' ').unwrap_or_else(|| panic!("{line:?}"));
    (who.to_string(), n.parse().unwrap())
}

/// A microvm's memory snapshot and the copies restored from it: a background process and a
/// session's shell variables are carried, each copy runs on and diverges on its own, and
/// takes its own hostname, machine-id and random seed; the source runs on; a paused VM is
/// snapshotted without running; a copy must have the snapshot's shape; nothing is left.
#[tokio::test(flavor = "multi_thread")]
async fn microvm_snapshots_carry_memory_into_independent_copies() {
    if !rustix::process::geteuid().is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    // Sandboxes of an edge of its own (ids apart from the conformance suite's beside it).
    let record = |lease: &str, backend: &str| {
        let mut r = record(lease, backend);
        r.edge = "cbsnap".into();
        r.id = format!("cbsnap.{lease}");
        r
    };
    let leases = ["vm-src", "vm-c1", "vm-c2", "vm-c3", "vm-wrong"];
    let _leftovers = Leftovers {
        root: root.clone(),
        names: leases.iter().map(|l| vm_name(&root, "microvm", &record(l, "microvm").id)).collect(),
    };
    support::busybox_image(&root.join("store"), &root).await;
    let b = Arc::new(VmBackend::new(options(&root, Machine::Microvm)).unwrap());
    let store = opendsec_images::Store::open(root.join("store")).unwrap();

    // A source whose memory holds a value only it knows (a random id drawn once), counting in
    // a background process, with state in a session's shell and a file on its disk.
    let src = with_state(&record("vm-src", "microvm"), SandboxStatus::Running);
    b.create(&src).await.unwrap();
    out(
        &b,
        &src.id,
        "main",
        "(s=$(cat /proc/sys/kernel/random/uuid); i=0; while true; do i=$((i+1)); echo $s $i > /tmp/counter; \
         sleep 0.1; done) >/dev/null 2>&1 & HELD=from-the-source; echo on-disk > /kept",
    )
    .await;
    let until = |b: Arc<VmBackend>, id: String, past: u64| async move {
        let deadline = std::time::Instant::now() + Duration::from_secs(60);
        loop {
            let c = counter(&b, &id).await;
            if c.1 > past {
                return c;
            }
            assert!(std::time::Instant::now() < deadline, "{id}'s counter stopped at {}", c.1);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let (secret, _) = until(b.clone(), src.id.clone(), 2).await;

    let snapper = b.vm_snapshotter().expect("microvm takes memory snapshots");
    let t = std::time::Instant::now();
    let taken = snapper.snapshot_vm(&src).await.unwrap();
    eprintln!(
        "microvm: snapshot of a running VM: {} ms ({} ms frozen), {} MiB in the store",
        t.elapsed().as_millis(),
        taken.frozen.as_millis(),
        taken.bytes >> 20
    );
    let (_, at_snapshot) = counter(&b, &src.id).await;
    let rec = store.vm_snapshot(&taken.id).unwrap();
    assert_eq!((rec.memory_mb, rec.cpus, rec.disk_mb, rec.source.as_str()), (192, 1, 64, src.id.as_str()));
    // The source runs on.
    until(b.clone(), src.id.clone(), at_snapshot + 3).await;
    // Published as an image, as the apiserver does.
    let base = store.resolve("root", "busybox").unwrap().1;
    let mut m = base.clone();
    m.repo = "snap".into();
    m.layers = taken.layers.clone();
    m.vm_snapshot = taken.id.clone();
    store.write_manifest(&m).unwrap();

    // Two copies, restored at once.
    let copy = |lease: &str| {
        let mut r = record(lease, "microvm");
        r.spec.image = "snap".into();
        with_state(&r, SandboxStatus::Running)
    };
    let (c1, c2) = (copy("vm-c1"), copy("vm-c2"));
    let t = std::time::Instant::now();
    let (r1, r2) = tokio::join!(b.create(&c1), b.create(&c2));
    r1.unwrap();
    r2.unwrap();
    eprintln!("microvm: two copies restored and answering: {} ms", t.elapsed().as_millis());
    for c in [&c1, &c2] {
        // The process and its memory came along: the same secret, counting on from the
        // snapshot, not from zero; so did the session's shell and the disk.
        let (who, n) = counter(&b, &c.id).await;
        assert_eq!(who, secret, "{}", c.id);
        assert!(n >= at_snapshot.saturating_sub(1), "{}: {n} after {at_snapshot}", c.id);
        until(b.clone(), c.id.clone(), n + 2).await;
        assert_eq!(out(&b, &c.id, "main", "echo $HELD; cat /kept").await, "from-the-source\non-disk");
        assert_eq!(
            out(&b, &c.id, "x", "cat /run/opendsec/sandbox-id; echo $OPENDSEC_SANDBOX_ID")
                .await
                .lines()
                .collect::<Vec<_>>(),
            [c.id.as_str(); 2]
        );
        assert_confined(&root.join("vms").join(vm_name(&root, "microvm", &c.id)), &vm_name(&root, "microvm", &c.id));
    }
    // Each its own machine: hostname, machine-id, and what its random generator draws.
    let ident = "hostname; cat /etc/machine-id; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \\n'";
    let i1 = out(&b, &c1.id, "x", ident).await;
    let i2 = out(&b, &c2.id, "x", ident).await;
    let (l1, l2): (Vec<&str>, Vec<&str>) = (i1.lines().collect(), i2.lines().collect());
    assert_eq!((l1[0], l2[0]), ("vm-c1", "vm-c2"));
    assert_eq!(l1[1].len(), 32);
    assert_ne!(l1[1], l2[1], "machine-ids");
    assert_ne!(l1[2], l2[2], "random bytes");
    assert_eq!(out(&b, &src.id, "x", "hostname").await, "vm-src");
    // They diverge independently.
    out(&b, &c1.id, "main", "echo one > /mine; HELD=changed-in-c1").await;
    assert_eq!(
        out(&b, &c2.id, "main", "cat /mine 2>/dev/null || echo none; echo $HELD").await,
        "none\nfrom-the-source"
    );
    assert_eq!(out(&b, &src.id, "main", "cat /mine 2>/dev/null || echo none").await, "none");
    assert_eq!(out(&b, &c1.id, "main", "cat /mine; echo $HELD").await, "one\nchanged-in-c1");

    // A copy pauses and resumes like any microvm, its process still counting.
    let paused = with_state(&c1, SandboxStatus::Paused);
    b.pause(&c1).await.unwrap();
    b.resume(&paused).await.unwrap();
    let (_, n) = counter(&b, &c1.id).await;
    until(b.clone(), c1.id.clone(), n + 2).await;

    // A paused VM's snapshot: taken without running it (no VMM before or after), and a copy
    // of it runs on from there.
    b.pause(&src).await.unwrap();
    let vmm_of = |id: &str| held(&root, "microvm", id).iter().filter(|h| h.starts_with("process")).count();
    assert_eq!(vmm_of(&src.id), 0);
    let taken2 = snapper.snapshot_vm(&with_state(&src, SandboxStatus::Paused)).await.unwrap();
    assert_eq!(vmm_of(&src.id), 0, "the paused VM stays without a VMM");
    let mut m2 = m.clone();
    m2.repo = "snap2".into();
    m2.vm_snapshot = taken2.id.clone();
    store.write_manifest(&m2).unwrap();
    let mut c3 = copy("vm-c3");
    c3.spec.image = "snap2".into();
    b.create(&c3).await.unwrap();
    let (who, n3) = counter(&b, &c3.id).await;
    assert_eq!(who, secret);
    until(b.clone(), c3.id.clone(), n3 + 2).await;
    b.resume(&with_state(&src, SandboxStatus::Paused)).await.unwrap();
    until(b.clone(), src.id.clone(), n3).await;

    // A copy must be the snapshot's shape; nothing is left of one that is not.
    let mut wrong = copy("vm-wrong");
    wrong.spec.resources.memory_mb = 256;
    let e = b.create(&wrong).await.unwrap_err();
    assert_eq!(e.kind(), BackendErrorKind::InvalidArgument, "{e}");
    assert!(e.to_string().contains("192 MiB"), "{e}");
    assert_eq!(held(&root, "microvm", &wrong.id), Vec::<String>::new());

    // Everything stops clean; this node's copy of a snapshot goes once the store's does.
    for s in [&src, &c1, &c2, &c3] {
        b.stop(s).await.unwrap();
        assert_eq!(held(&root, "microvm", &s.id), Vec::<String>::new());
    }
    let cache = root.join("vms/.snapshots");
    assert!(cache.join(&taken.id).exists());
    store.delete_vm_snapshot(&taken.id).unwrap();
    store.delete_vm_snapshot(&taken2.id).unwrap();
    b.cleanup(&HashSet::new()).await.unwrap();
    let left: Vec<_> = std::fs::read_dir(&cache).unwrap().flatten().map(|e| e.file_name()).collect();
    assert!(left.is_empty(), "{left:?}");
}

/// How a fake guest behaves on the socket QEMU would listen on.
#[derive(Clone, Copy, Debug)]
enum Hostile {
    /// Never answers the hello.
    Silent,
    /// Talks without end, never answering the hello.
    Chatter,
    /// Answers the hello, then sends 64 MiB of garbage.
    Flood,
    /// Answers the hello and the HTTP/2 handshake, then answers a call with a message that
    /// claims 2 GiB and keeps sending it.
    Oversized,
}

/// Plays `mode` on every connection to `sock`.
fn fake_guest(sock: &Path, mode: Hostile) -> tokio::task::JoinHandle<()> {
    let _ = std::fs::remove_file(sock);
    let listener = tokio::net::UnixListener::bind(sock).unwrap();
    tokio::spawn(async move {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        loop {
            let Ok((s, _)) = listener.accept().await else { return };
            tokio::spawn(async move {
                match mode {
                    Hostile::Silent => {
                        let mut s = s;
                        let mut buf = vec![0u8; 1 << 16];
                        while matches!(s.read(&mut buf).await, Ok(n) if n > 0) {}
                    }
                    Hostile::Chatter => {
                        let (mut r, mut w) = s.into_split();
                        tokio::spawn(async move {
                            let mut buf = vec![0u8; 1 << 16];
                            while matches!(r.read(&mut buf).await, Ok(n) if n > 0) {}
                        });
                        let junk = vec![b'x'; 1 << 16];
                        while w.write_all(&junk).await.is_ok() {}
                    }
                    Hostile::Flood => {
                        let Ok((mut s, _)) = opendsec_proto::serial::guest_handshake(s).await else { return };
                        let junk: Vec<u8> = (0..1 << 20).map(|_| rand::random::<u8>()).collect();
                        for _ in 0..64 {
                            if s.write_all(&junk).await.is_err() {
                                return;
                            }
                        }
                    }
                    Hostile::Oversized => {
                        let Ok((s, _)) = opendsec_proto::serial::guest_handshake(s).await else { return };
                        let Ok(mut conn) = h2::server::handshake(s).await else { return };
                        while let Some(Ok((_req, mut respond))) = conn.accept().await {
                            tokio::spawn(async move {
                                let head = http::Response::builder()
                                    .status(200)
                                    .header("content-type", "application/grpc")
                                    .body(())
                                    .unwrap();
                                let Ok(mut body) = respond.send_response(head, false) else { return };
                                let mut first = vec![0u8, 0x7f, 0xff, 0xff, 0xff];
                                first.extend(vec![b'a'; 1 << 14]);
                                let _ = body.send_data(bytes::Bytes::from(first), false);
                                for _ in 0..4096 {
                                    body.reserve_capacity(1 << 14);
                                    if body.send_data(bytes::Bytes::from(vec![b'a'; 1 << 14]), false).is_err() {
                                        return;
                                    }
                                    tokio::task::yield_now().await;
                                }
                            });
                        }
                    }
                }
            });
        }
    })
}

/// The agent's answers are data: a guest that is silent, talks without answering, floods the
/// connection with garbage after a good handshake, or answers a call with a message claiming
/// 2 GiB, gets the edge's call an error within bounded time, and costs it no memory beyond
/// the handshake's and HTTP/2's bounds. (The guest is played by the test on the socket QEMU
/// would listen on: this is the edge's side of the port, as a guest kernel under an
/// attacker's control would see it.)
#[tokio::test(flavor = "multi_thread")]
async fn a_hostile_guest_costs_the_edge_an_error_and_nothing_more() {
    let tmp = tempfile::tempdir().unwrap();
    let sock = tmp.path().join("agent.sock");
    let before = opendsec_testkit::rss_mib();
    for mode in [Hostile::Silent, Hostile::Chatter, Hostile::Flood, Hostile::Oversized] {
        let guest = fake_guest(&sock, mode);
        let channel =
            opendsec_edge::backend::vm::serial_channel(sock.clone(), tmp.path().join("pid"), Duration::from_secs(3));
        let mut c = opendsec_edge::backend::agent_client(channel);
        let req = pb::ExecRequest { sandbox_id: "cbtest.x".into(), command: "true".into(), ..Default::default() };
        let t = std::time::Instant::now();
        let r = tokio::time::timeout(Duration::from_secs(30), c.exec(req)).await;
        let e =
            r.unwrap_or_else(|_| panic!("{mode:?}: the call hung")).expect_err("a hostile guest's answer is no answer");
        eprintln!("{mode:?}: {:?} after {} ms: {}", e.code(), t.elapsed().as_millis(), e.message());
        guest.abort();
        let grown = opendsec_testkit::rss_mib().saturating_sub(before);
        assert!(grown < 48, "{mode:?}: the edge's side grew by {grown} MiB");
    }
}

/// A hundred creations and stops, two at a time (restores of a memory snapshot, every tenth a
/// cold boot), leave nothing behind: no directory, cgroup, uid claim, holder file or process
/// of theirs, no descriptor open in the edge, no growth of its memory beyond a bound.
#[tokio::test(flavor = "multi_thread")]
async fn a_hundred_creations_and_stops_leave_nothing() {
    if !rustix::process::geteuid().is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    const EDGE: &str = "cbcycle";
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_path_buf();
    let record = |lease: &str| {
        let mut r = with_state(&record(lease, "microvm"), SandboxStatus::Running);
        r.edge = EDGE.into();
        r.id = format!("{EDGE}.{lease}");
        r
    };
    let _leftovers = Leftovers {
        root: root.clone(),
        names: std::iter::once("vm-src".to_string())
            .chain((0..100).map(|i| format!("vm-{i}")))
            .map(|l| vm_name(&root, "microvm", &record(&l).id))
            .collect(),
    };
    support::busybox_image(&root.join("store"), &root).await;
    let b = Arc::new(VmBackend::new(options(&root, Machine::Microvm)).unwrap());
    let store = opendsec_images::Store::open(root.join("store")).unwrap();
    let src = record("vm-src");
    b.create(&src).await.unwrap();
    let taken = b.vm_snapshotter().unwrap().snapshot_vm(&src).await.unwrap();
    let mut m = store.resolve("root", "busybox").unwrap().1;
    m.repo = "snap".into();
    m.vm_snapshot = taken.id.clone();
    store.write_manifest(&m).unwrap();
    // Warmed up: the snapshot cached, one restore and one boot made and gone.
    for (lease, image) in [("vm-warm-a", "snap"), ("vm-warm-b", "busybox")] {
        let mut r = record(lease);
        r.spec.image = image.into();
        b.create(&r).await.unwrap();
        b.stop(&r).await.unwrap();
    }
    let fds = || std::fs::read_dir("/proc/self/fd").unwrap().count();
    let (fds_before, rss_before) = (fds(), opendsec_testkit::rss_mib());

    let t = std::time::Instant::now();
    for round in 0..50 {
        let lanes = (0..2).map(|lane| {
            let i = round * 2 + lane;
            let mut r = record(&format!("vm-{i}"));
            r.spec.image = if i % 10 == 0 { "busybox".into() } else { "snap".into() };
            let (b, root) = (b.clone(), root.clone());
            async move {
                b.create(&r).await.unwrap_or_else(|e| panic!("creation {i}: {e}; {e:?}"));
                assert_eq!(exec(&b, &r.id, "echo up").await.exit_code, 0);
                b.stop(&r).await.unwrap();
                assert_eq!(held(&root, "microvm", &r.id), Vec::<String>::new(), "cycle {i}");
            }
        });
        futures::future::join_all(lanes).await;
    }
    eprintln!("100 creations and stops (90 restores, 10 boots, two at a time): {} s", t.elapsed().as_secs());

    let (fds_after, rss_after) = (fds(), opendsec_testkit::rss_mib());
    assert!(fds_after <= fds_before + 4, "descriptors: {fds_before} before, {fds_after} after");
    assert!(rss_after < rss_before + 64, "resident memory: {rss_before} MiB before, {rss_after} MiB after");
    let mut left: Vec<String> = std::fs::read_dir(root.join("vms"))
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    left.sort();
    assert_eq!(left, [".boot", ".jail", ".snapshots", &vm_name(&root, "microvm", &src.id)]);
    let holders: Vec<_> =
        std::fs::read_dir(root.join("store/inuse")).unwrap().flatten().map(|e| e.file_name()).collect();
    assert_eq!(holders.len(), 1, "{holders:?}");
    let cgroups = opendsec_edge::linuxrt::cgroup::list(&vm_name(&root, "microvm", "")).unwrap();
    assert_eq!(cgroups, [vm_name(&root, "microvm", &src.id)]);
    b.stop(&src).await.unwrap();
    assert_eq!(held(&root, "microvm", &src.id), Vec::<String>::new());
}
