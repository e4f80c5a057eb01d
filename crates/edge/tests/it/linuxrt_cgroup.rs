//! Root tests of sandbox cgroups on the host's real layout (v1 here). Skipped when not root.
use std::io::Write;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use opendsec_edge::linuxrt::cgroup::{self, CoreSched, Limits, SandboxCgroup};
use opendsec_testkit::{WAIT, is_root, wait_for};

/// Removes the test's cgroup (and kills its processes) even when an assertion fails.
struct Guard(&'static str);
impl Drop for Guard {
    fn drop(&mut self) {
        let _ = cgroup::cleanup(self.0, &[]);
    }
}

/// A shell that waits for one line on stdin before running `script`, so it can be put into the
/// cgroup first.
fn gated(script: &str) -> Child {
    Command::new("/bin/sh")
        .arg("-c")
        .arg(format!("read x; {script}"))
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

fn release(child: &mut Child) {
    child.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
}

fn proc_state(pid: u32) -> char {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    s.rsplit(')').next().and_then(|r| r.trim().chars().next()).unwrap_or('?')
}

#[test]
fn lifecycle_limits_freeze_remove() {
    if !is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let name = "test-cg-life";
    let _g = Guard("test-cg-life");
    let cg =
        SandboxCgroup::create(name, &Limits { cpu_millis: 500, best_effort: false, memory_bytes: 64 << 20, pids: 8 })
            .unwrap();
    // Below our own cgroup.
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap();
    let base = cgroup::base_path(cg.layout(), &own).unwrap();
    assert!(cg.rel_path().starts_with(&base));
    assert_ne!(cg.rel_path(), base);
    assert_eq!(cgroup::list("test-cg-life").unwrap(), vec![name.to_string()]);

    let mut child = gated("while :; do :; done");
    cg.add_pid(child.id() as i32).unwrap();
    release(&mut child);
    let st = cg.stats().unwrap();
    assert_eq!(st.pids_current, 1);
    assert_eq!(st.memory_limit_bytes, 64 << 20);

    cg.freeze().unwrap();
    let pid = child.id();
    // A frozen task sleeps in the freezer (D or S), never runs.
    wait_for("frozen", WAIT, || matches!(proc_state(pid), 'D' | 'S'));
    cg.thaw().unwrap();
    wait_for("thawed", WAIT, || proc_state(pid) == 'R');

    cg.remove().unwrap();
    wait_for("child reaped", WAIT, || child.try_wait().unwrap().is_some());
    assert!(cgroup::list("test-cg-life").unwrap().is_empty());
}

#[test]
fn pids_limit_stops_forks() {
    if !is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let _g = Guard("test-cg-pids");
    let cg =
        SandboxCgroup::create("test-cg-pids", &Limits { cpu_millis: 0, best_effort: true, memory_bytes: 0, pids: 5 })
            .unwrap();
    let mut child = gated("i=0; while [ $i -lt 50 ]; do sleep 30 & i=$((i+1)); done; sleep 30");
    cg.add_pid(child.id() as i32).unwrap();
    release(&mut child);
    std::thread::sleep(Duration::from_millis(500));
    let n = cg.stats().unwrap().pids_current;
    assert!((2..=5).contains(&n), "pids {n}");
    cg.remove().unwrap();
    let _ = child.wait();
}

#[test]
fn memory_hog_is_oom_killed_in_its_cgroup() {
    if !is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let _g = Guard("test-cg-oom");
    let cg = SandboxCgroup::create(
        "test-cg-oom",
        &Limits { cpu_millis: 0, best_effort: false, memory_bytes: 32 << 20, pids: 16 },
    )
    .unwrap();
    // tail keeps the whole newline-free line in memory. As in a sandbox, what the shell
    // standing for the agent starts has its oom_score_adj raised (500, as the agent's
    // workloads): otherwise the kernel may pick the shell. (Lowering the shell's own, as for
    // PID 1, needs CAP_SYS_RESOURCE, which root lacks on some hosts, this one included.)
    let mut child =
        gated("(echo 500 >/proc/self/oom_score_adj; head -c 1000000000 /dev/zero | tail -n 1 >/dev/null); sleep 30");
    cg.add_pid(child.id() as i32).unwrap();
    release(&mut child);
    wait_for("oom kill", WAIT, || cg.stats().map(|s| s.oom_kills > 0).unwrap_or(false));
    // The shell itself (the "agent") survives.
    assert!(child.try_wait().unwrap().is_none());
    cg.remove().unwrap();
    let _ = child.wait();
}

/// What the machine says about core scheduling without asking prctl: the kernel refuses
/// cookies without SMT, and without CONFIG_SCHED_CORE. None: it cannot be told.
fn core_sched_expected() -> Option<CoreSched> {
    let smt = std::fs::read_to_string("/sys/devices/system/cpu/smt/active").ok()?;
    if smt.trim() == "0" {
        return Some(CoreSched::Unsupported);
    }
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").ok()?;
    let config = std::fs::read_to_string(format!("/boot/config-{}", release.trim())).ok()?;
    Some(if config.lines().any(|l| l == "CONFIG_SCHED_CORE=y") { CoreSched::Supported } else { CoreSched::Unsupported })
}

#[test]
fn core_sched_detection_matches_the_machine() {
    let expected = core_sched_expected().expect(
        "neither /sys/devices/system/cpu/smt/active nor the kernel's config says whether core scheduling works",
    );
    assert_eq!(cgroup::detect_core_sched(), expected);
}
