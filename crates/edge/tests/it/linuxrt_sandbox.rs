//! Root tests of whole container sandboxes: a busybox image from the store, a shell script as
//! PID 1 that probes its confinement and writes its findings to a bound host directory.
//! Skipped when not root. Every test removes what it made, also on failure (a guard).
use crate::support;
use std::path::{Path, PathBuf};
use std::time::Duration;

use opendsec_edge::linuxrt::cgroup::{self, IoLimits, Limits};
use opendsec_edge::linuxrt::idmap::{self, IdPool};
use opendsec_edge::linuxrt::init::Bind;
use opendsec_edge::linuxrt::rootfs::{self, LayerCache};
use opendsec_edge::linuxrt::sandbox::{self, Sandbox, SandboxSpec};
use opendsec_images::Store;
use opendsec_testkit::{is_root, wait_for};

struct Guard {
    state: PathBuf,
    prefix: &'static str,
}
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = sandbox::cleanup_leftovers(&self.state, self.prefix, &[]);
    }
}

/// A busybox root file system with every applet linked, imported as one layer and cached.
async fn busybox_lower(tmp: &Path) -> PathBuf {
    let root = support::busybox_rootfs(tmp, &["mnt", "out"]);
    let store = Store::open(tmp.join("store")).unwrap();
    let imported = opendsec_images::offline::import_rootfs(&store, &root, &Default::default()).await.unwrap();
    let lowers = rootfs::lower_dirs(&LayerCache::new(tmp.join("cache")), &store, &imported.layers).unwrap();
    assert_eq!(lowers.len(), 1);
    lowers[0].clone()
}

/// A sandbox running `script` as PID 1 in a user namespace; `out` (made writable for the
/// sandbox's root, an unprivileged host id) is bound at `/out`.
fn spec(tmp: &Path, name: &str, lower: PathBuf, out: &Path, script: &str, limits: Limits) -> SandboxSpec {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(out, std::fs::Permissions::from_mode(0o777)).unwrap();
    SandboxSpec {
        name: name.into(),
        state_dir: tmp.join("state"),
        hostname: "sbx-test".into(),
        lower_dirs: vec![lower],
        disk_mb: 16,
        limits,
        binds: vec![Bind { src: out.to_path_buf(), dst: "/out".into(), readonly: false, replace_link: false }],
        masked_paths: vec![],
        readonly_paths: vec![],
        oom_score_adj: -500,
        argv: vec!["/bin/sh".into(), "-c".into(), script.into()],
        env: vec!["PATH=/bin".into()],
        init_exe: PathBuf::from(env!("CARGO_BIN_EXE_opendsec-sandbox-init")),
        agent_socket: false,
        core_sched: false,
        userns: Some(IdPool::new(idmap::DEFAULT_FIRST_ID, idmap::DEFAULT_RANGES).unwrap()),
        io: IoLimits { read_bps: 32 << 20, write_bps: 16 << 20, read_iops: 1000, write_iops: 500 },
    }
}

const PROBE: &str = r#"
R=/out/result
echo "pid=$$" > $R
echo "uid=$(id -u)" >> $R
echo "uid_map=$(cat /proc/self/uid_map | tr -s ' ' | sed 's/^ //')" >> $R
cat /dev/tty 2>/tmp/e; echo "tty=$(cat /tmp/e)" >> $R
echo "ttynr=$(cut -d' ' -f7 /proc/self/stat)" >> $R
echo "devnull=$(stat -c '%t:%T %a' /dev/null)" >> $R
echo hi > /dev/null && echo "devnull_write=ok" >> $R
echo "root_owner=$(stat -c %u /)" >> $R
echo "img_owner=$(stat -c %u /bin/busybox)" >> $R
mkdir /made && echo "mkdir_root=ok" >> $R
echo "blk=$(ls /sys/block 2>&1 | wc -l)/$(ls /sys/devices/virtual/block 2>&1 | wc -l)/$(cat /proc/slabinfo 2>&1 | wc -c)" >> $R
echo "hostname=$(hostname)" >> $R
echo "procs=$(ls -d /proc/[0-9]* | wc -l)" >> $R
mount -t tmpfs none /mnt 2>/dev/null && echo mount=allowed >> $R || echo mount=denied >> $R
echo x > /tmp/x.ko; insmod /tmp/x.ko 2>/tmp/e; echo "insmod=$(cat /tmp/e)" >> $R
(echo x > /proc/sys/kernel/domainname) 2>/dev/null && echo procsys=writable >> $R || echo procsys=readonly >> $R
(echo x > /sys/kernel/uevent_helper) 2>/dev/null && echo sys=writable >> $R || echo sys=readonly >> $R
unshare -m true 2>/dev/null && echo unshare=allowed >> $R || echo unshare=denied >> $R
echo "masked=$(cat /proc/timer_list | wc -c)/$(ls /sys/firmware | wc -l)" >> $R
echo "pidsmax=$(cat /sys/fs/cgroup/pids/pids.max 2>/dev/null || cat /sys/fs/cgroup/pids.max)" >> $R
dd if=/dev/zero of=/big bs=1M count=64 2>/tmp/e; echo "dd=$(grep -o 'No space left on device' /tmp/e | head -n 1)" >> $R
rm -f /big
head -c 400000000 /dev/zero | tail -n 1 >/dev/null; echo "hog=$?" >> $R
echo ok > /out/done
while [ ! -e /out/bomb ]; do sleep 0.05; done
b() { while :; do b & done; }
b &
while :; do sleep 1; done
"#;

#[tokio::test(flavor = "multi_thread")]
async fn hostile_busybox_sandbox_is_confined_and_cleaned_up() {
    if !is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _g = Guard { state: state.clone(), prefix: "test-sbx-probe" };
    let lower = busybox_lower(tmp.path()).await;
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let limits = Limits { cpu_millis: 1000, best_effort: false, memory_bytes: 64 << 20, pids: 48 };
    let sp = spec(tmp.path(), "test-sbx-probe", lower, &out, PROBE, limits);
    let sbx = tokio::task::spawn_blocking(move || Sandbox::start(&sp)).await.unwrap().unwrap();

    wait_for("probe script", Duration::from_secs(60), || out.join("done").exists() || sbx.exited().is_some());
    let result = std::fs::read_to_string(out.join("result")).unwrap_or_default();
    let log = std::fs::read_to_string(sbx.dir.join("console.log")).unwrap_or_default();
    let get = |k: &str| {
        result
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{k}=")).map(str::to_owned))
            .unwrap_or_else(|| panic!("no {k} in result:\n{result}\nlog:\n{log}"))
    };
    assert_eq!(get("pid"), "1");
    assert_eq!(get("hostname"), "sbx-test");
    // Root inside is an unprivileged host id outside; the image's files are root's inside.
    let range = sbx.id_map.expect("a user namespace");
    assert!(range.host_first >= idmap::DEFAULT_FIRST_ID);
    assert_eq!(get("uid"), "0");
    assert_eq!(get("uid_map"), format!("0 {} 65536", range.host_first));
    assert_eq!(host_ids(sbx.pid), (range.host_first, range.host_first), "PID 1 seen from the host");
    assert_eq!(get("root_owner"), "0");
    assert_eq!(get("img_owner"), "0");
    assert_eq!(get("mkdir_root"), "ok");
    {
        use std::os::unix::fs::MetadataExt;
        let m = std::fs::metadata(out.join("result")).unwrap();
        assert_eq!((m.uid(), m.gid()), (range.host_first, range.host_first), "a file sandbox root made, on the host");
    }
    // No controlling terminal; its own device nodes; block devices and slabs masked.
    assert_eq!(get("tty"), "cat: can't open '/dev/tty': No such device or address");
    assert_eq!(get("ttynr"), "0");
    assert_eq!(get("devnull"), "1:3 666");
    assert_eq!(get("devnull_write"), "ok");
    assert_eq!(get("blk"), "0/0/0");
    // The disk I/O limits are on the sandbox's own disk device.
    let dev = std::fs::read_to_string(sbx.dir.join("loop")).unwrap();
    let (major, minor) = rootfs::device_number(Path::new(&dev)).unwrap();
    let blkio = sbx.cgroup.controller_dir("blkio");
    if sbx.cgroup.layout() == cgroup::Layout::V1 {
        let wbps = std::fs::read_to_string(blkio.join("blkio.throttle.write_bps_device")).unwrap();
        assert_eq!(wbps.trim(), format!("{major}:{minor} {}", 16 << 20));
        let devices = std::fs::read_to_string(sbx.cgroup.controller_dir("devices").join("devices.list")).unwrap();
        let mut listed: Vec<&str> = devices.lines().collect();
        listed.sort();
        let mut want = cgroup::device_allow_list();
        want.sort();
        assert_eq!(listed, want, "the device cgroup allows the minimal set only");
    }
    let procs: u32 = get("procs").trim().parse().unwrap();
    assert!(procs <= 4, "host processes visible: {procs}");
    assert_eq!(get("mount"), "denied");
    assert!(get("insmod").contains("not permitted"), "{result}");
    assert_eq!(get("procsys"), "readonly");
    assert_eq!(get("sys"), "readonly");
    assert_eq!(get("unshare"), "denied");
    assert_eq!(get("masked"), "0/0");
    assert_eq!(get("pidsmax"), "48");
    assert_eq!(get("dd"), "No space left on device");
    assert_ne!(get("hog"), "0");
    assert!(sbx.stats().unwrap().oom_kills > 0);
    assert!(sbx.exited().is_none(), "PID 1 died:\n{log}");

    // Freeze: PID 1 stops running its loop; thaw: it goes on.
    sbx.freeze().unwrap();
    let state_of = |pid: i32| {
        std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok();
        std::fs::read_to_string(cgroup_freezer_state(&sbx)).unwrap_or_default()
    };
    wait_for("frozen", Duration::from_secs(10), || state_of(sbx.pid).trim() == "FROZEN");
    sbx.thaw().unwrap();
    wait_for("thawed", Duration::from_secs(10), || state_of(sbx.pid).trim() == "THAWED");

    // Fork bomb: held at the pids limit.
    std::fs::write(out.join("bomb"), "go").unwrap();
    // The bomb's population churns (failed forks end shells), so watch its peak.
    let mut peak = 0;
    // The controller refusing forks shows it ran into the limit (on a loaded machine the
    // population churns below it: failed forks end shells).
    wait_for("forks refused at the pids limit", Duration::from_secs(120), || {
        let n = sbx.stats().map(|s| s.pids_current).unwrap_or(0);
        peak = peak.max(n);
        pids_refused(&sbx) > 0
    });
    assert!(peak <= 48, "peak {peak}");
    assert!(sbx.exited().is_none());

    let dir = sbx.dir.clone();
    let pid = sbx.pid;
    tokio::task::spawn_blocking(move || sbx.stop()).await.unwrap().unwrap();
    assert!(!dir.exists());
    assert!(rootfs::loops_under(&state).is_empty());
    assert!(cgroup::list("test-sbx-probe").unwrap().is_empty());
    assert!(!Path::new(&format!("/proc/{pid}")).exists());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    assert!(!mounts.contains(tmp.path().to_str().unwrap()));
}

/// The real uid and gid of host process `pid`.
fn host_ids(pid: i32) -> (u32, u32) {
    let st = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let field = |k: &str| {
        st.lines().find_map(|l| l.strip_prefix(k)).and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap()
    };
    (field("Uid:"), field("Gid:"))
}

/// Forks the pids controller refused (`max` in pids.events).
fn pids_refused(sbx: &Sandbox) -> u64 {
    let rel = sbx.cgroup.rel_path().strip_prefix("/").unwrap().to_path_buf();
    let p = match sbx.cgroup.layout() {
        cgroup::Layout::V1 => Path::new("/sys/fs/cgroup/pids").join(rel).join("pids.events"),
        cgroup::Layout::V2 => Path::new("/sys/fs/cgroup").join(rel).join("pids.events"),
    };
    std::fs::read_to_string(p)
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("max ").and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0)
}

fn cgroup_freezer_state(sbx: &Sandbox) -> PathBuf {
    let rel = sbx.cgroup.rel_path().strip_prefix("/").unwrap().to_path_buf();
    match sbx.cgroup.layout() {
        cgroup::Layout::V1 => Path::new("/sys/fs/cgroup/freezer").join(rel).join("freezer.state"),
        cgroup::Layout::V2 => Path::new("/sys/fs/cgroup").join(rel).join("cgroup.freeze"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn setup_errors_are_reported_and_cleaned_up() {
    if !is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _g = Guard { state: state.clone(), prefix: "test-sbx-bad" };
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let limits = Limits { cpu_millis: 0, best_effort: true, memory_bytes: 0, pids: 0 };
    let sp = spec(tmp.path(), "test-sbx-bad", tmp.path().join("no-such-layer"), &out, "true", limits);
    let err = tokio::task::spawn_blocking(move || Sandbox::start(&sp)).await.unwrap().unwrap_err();
    assert!(err.to_string().contains("sandbox setup failed: idmapped layers: open_tree"), "{err}");
    assert!(rootfs::loops_under(&state).is_empty());
    assert!(cgroup::list("test-sbx-bad").unwrap().is_empty());
    assert!(!state.join("test-sbx-bad").exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn leftovers_are_adopted_or_cleaned_up_by_prefix() {
    if !is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _g = Guard { state: state.clone(), prefix: "test-sbx-left" };
    let lower = busybox_lower(tmp.path()).await;
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let limits = Limits { cpu_millis: 0, best_effort: true, memory_bytes: 32 << 20, pids: 16 };
    let mut pids = Vec::new();
    for name in ["test-sbx-left-a", "test-sbx-left-b"] {
        let sp = spec(tmp.path(), name, lower.clone(), &out, "sleep 1000 & sleep 1000", limits.clone());
        let sbx = tokio::task::spawn_blocking(move || Sandbox::start(&sp)).await.unwrap().unwrap();
        pids.push(sbx.pid);
        // Forget the handle, as an edge that restarts does.
        drop(sbx);
    }
    // A record kept "a": it is adopted and survives the cleanup; "b" matches no record.
    let a = Sandbox::adopt(&state, "test-sbx-left-a").unwrap();
    assert_eq!(a.pid, pids[0]);
    assert!(a.exited().is_none());
    assert!(Sandbox::adopt(&state, "test-sbx-left-none").is_err());
    let keep = vec!["test-sbx-left-a".to_string()];
    let st = state.clone();
    let removed = tokio::task::spawn_blocking(move || sandbox::cleanup_leftovers(&st, "test-sbx-left", &keep))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(removed, vec!["test-sbx-left-b".to_string()]);
    assert!(!state.join("test-sbx-left-b").exists());
    assert!(a.exited().is_none());
    assert_eq!(cgroup::list("test-sbx-left").unwrap(), vec!["test-sbx-left-a".to_string()]);
    tokio::task::spawn_blocking(move || a.stop()).await.unwrap().unwrap();
    assert!(rootfs::loops_under(&state).is_empty());
    assert!(cgroup::list("test-sbx-left").unwrap().is_empty());
    for pid in pids {
        // Reaped by us (subreaper) or gone.
        reap(pid);
        assert!(!Path::new(&format!("/proc/{pid}")).exists() || is_zombie(pid), "pid {pid} alive");
    }
}

fn is_zombie(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.rsplit(')').next().map(|r| r.trim_start().starts_with('Z')).unwrap_or(false))
        .unwrap_or(true)
}

/// Reaps `pid` if it is a finished child of ours (nix's safe waitpid).
fn reap(pid: i32) {
    let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), Some(nix::sys::wait::WaitPidFlag::WNOHANG));
}

#[tokio::test(flavor = "multi_thread")]
async fn overwriting_the_image_in_one_sandbox_changes_nothing_in_another() {
    if !is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _g = Guard { state: state.clone(), prefix: "test-sbx-iso" };
    let lower = busybox_lower(tmp.path()).await;
    let before = std::fs::read(lower.join("bin/busybox")).unwrap();
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let limits = Limits { cpu_millis: 0, best_effort: true, memory_bytes: 64 << 20, pids: 16 };
    // A clobbers its /bin/busybox (copied up into its own disk) and removes /bin/ls.
    let script_a = "rm /bin/ls; /bin/busybox cp /bin/busybox /tmp/bb; echo hacked > /bin/busybox; /tmp/bb echo a > /out/a; /tmp/bb sleep 1000";
    let sp = spec(tmp.path(), "test-sbx-iso-a", lower.clone(), &out, script_a, limits.clone());
    let a = tokio::task::spawn_blocking(move || Sandbox::start(&sp)).await.unwrap().unwrap();
    wait_for("sandbox a", Duration::from_secs(30), || out.join("a").exists() || a.exited().is_some());
    assert!(out.join("a").exists(), "{}", std::fs::read_to_string(a.dir.join("console.log")).unwrap_or_default());
    let script_b = "ls /bin/ls > /out/b 2>&1; /bin/busybox true && echo busybox-ok >> /out/b";
    let sp = spec(tmp.path(), "test-sbx-iso-b", lower.clone(), &out, script_b, limits);
    let b = tokio::task::spawn_blocking(move || Sandbox::start(&sp)).await.unwrap().unwrap();
    wait_for("sandbox b", Duration::from_secs(30), || b.exited().is_some());
    assert_eq!(std::fs::read_to_string(out.join("b")).unwrap(), "/bin/ls\nbusybox-ok\n");
    assert_eq!(std::fs::read(lower.join("bin/busybox")).unwrap(), before);
    for s in [a, b] {
        tokio::task::spawn_blocking(move || s.stop()).await.unwrap().unwrap();
    }
    assert!(rootfs::loops_under(&state).is_empty());
    assert!(cgroup::list("test-sbx-iso").unwrap().is_empty());
}

#[tokio::test(flavor = "multi_thread")]
async fn hostile_image_mount_points_are_refused_without_touching_the_host() {
    if !is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _g = Guard { state: state.clone(), prefix: "test-sbx-evil" };
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    // The host directory a hostile image aims its mount points at.
    let victim = tmp.path().join("victim");
    std::fs::create_dir_all(&victim).unwrap();
    let limits = Limits { cpu_millis: 0, best_effort: true, memory_bytes: 0, pids: 0 };
    // (entry of the image, what it is instead of a directory, the refusal expected).
    let up = PathBuf::from("../../../..");
    let cases = [
        ("dev", Some(victim.clone()), "dev: /dev is a symlink"),
        ("proc", Some(up), "proc: /proc is a symlink"),
        ("proc", None, "proc: /proc is of the wrong type"),
        ("out", Some(victim.clone()), "binds: /out is a symlink"),
    ];
    for (i, (entry, link, want)) in cases.iter().enumerate() {
        let lower = tmp.path().join(format!("lower-{i}"));
        for d in ["proc", "dev", "sys", "out"].iter().filter(|d| *d != entry) {
            std::fs::create_dir_all(lower.join(d)).unwrap();
        }
        match link {
            Some(to) => std::os::unix::fs::symlink(to, lower.join(entry)).unwrap(),
            None => std::fs::write(lower.join(entry), b"").unwrap(),
        }
        let name = format!("test-sbx-evil-{i}");
        let sp = spec(tmp.path(), &name, lower, &out, "true", limits.clone());
        let err = tokio::task::spawn_blocking(move || Sandbox::start(&sp)).await.unwrap().unwrap_err();
        assert!(err.to_string().contains(want), "{want}: {err}");
        assert_eq!(std::fs::read_dir(&victim).unwrap().count(), 0, "{want}: the host directory was written to");
        assert!(!state.join(&name).exists());
    }
    assert!(rootfs::loops_under(&state).is_empty());
    assert!(cgroup::list("test-sbx-evil").unwrap().is_empty());
}

/// The edge spawns other programs while it starts sandboxes (a QEMU, `nft`, `mkfs`, other
/// sandboxes' setup processes). None of them may inherit a sandbox's agent socket: the
/// listening socket reaches the setup process as its stdin, never as an inheritable fd of the
/// edge. Before, a copy without close-on-exec lived in the edge for the whole spawn, and a
/// child spawned in that window held another tenant's agent socket.
#[tokio::test(flavor = "multi_thread")]
async fn no_child_spawned_meanwhile_inherits_a_sandbox_agent_socket() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    if !is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let state = tmp.path().join("state");
    let _g = Guard { state: state.clone(), prefix: "test-sbx-fds" };
    let lower = busybox_lower(tmp.path()).await;
    let out = tmp.path().join("out");
    std::fs::create_dir_all(&out).unwrap();
    let limits = Limits { cpu_millis: 0, best_effort: true, memory_bytes: 32 << 20, pids: 16 };

    // Arrange: two threads spawn children that list their own fds, as fast as they can.
    let done = Arc::new(AtomicBool::new(false));
    let (spawned, leaked) = (Arc::new(AtomicUsize::new(0)), Arc::new(std::sync::Mutex::new(Vec::new())));
    let spawners: Vec<_> = (0..2)
        .map(|_| {
            let (done, spawned, leaked) = (done.clone(), spawned.clone(), leaked.clone());
            std::thread::spawn(move || {
                while !done.load(Ordering::Relaxed) {
                    let o = std::process::Command::new("ls").args(["-l", "/proc/self/fd/"]).output().unwrap();
                    spawned.fetch_add(1, Ordering::Relaxed);
                    let text = String::from_utf8_lossy(&o.stdout);
                    if text.contains("socket:") {
                        leaked.lock().unwrap().push(text.into_owned());
                    }
                }
            })
        })
        .collect();

    // Act: start sandboxes with agent sockets meanwhile; each PID 1 says what its fd 3 is.
    let mut sandboxes = Vec::new();
    for i in 0..16 {
        let name = format!("test-sbx-fds-{i}");
        let script = format!("readlink /proc/1/fd/3 > /out/{i}.fd3; sleep 1000");
        let mut sp = spec(tmp.path(), &name, lower.clone(), &out, &script, limits.clone());
        sp.agent_socket = true;
        sandboxes.push(tokio::task::spawn_blocking(move || Sandbox::start(&sp)).await.unwrap().unwrap());
    }
    done.store(true, Ordering::Relaxed);
    for s in spawners {
        s.join().unwrap();
    }

    // Assert: every PID 1 got its socket at fd 3, and no other child ever held one.
    for (i, s) in sandboxes.iter().enumerate() {
        let fd3 = out.join(format!("{i}.fd3"));
        wait_for("PID 1 reads its fd 3", Duration::from_secs(30), || fd3.exists() || s.exited().is_some());
        let got = std::fs::read_to_string(&fd3).unwrap_or_default();
        assert!(got.starts_with("socket:"), "sandbox {i}: fd 3 is {got:?}");
    }
    assert!(spawned.load(Ordering::Relaxed) > 16, "the spawners ran");
    let leaked = std::mem::take(&mut *leaked.lock().unwrap());
    assert!(leaked.is_empty(), "{} children held a socket, e.g.:\n{}", leaked.len(), leaked[0]);
    for s in sandboxes {
        tokio::task::spawn_blocking(move || s.stop()).await.unwrap().unwrap();
    }
    assert!(cgroup::list("test-sbx-fds").unwrap().is_empty());
}
