//! Sandbox cgroups through youki's `libcgroups`, on v1 (legacy/hybrid, this machine) and v2.
//!
//! Invariants:
//! - a sandbox cgroup is always created BELOW the cgroup the edge process itself is in, never
//!   beside it: on v1 the base is the deepest of the edge's per-controller paths, and every other
//!   controller's path must be a prefix of it (otherwise creation is refused), so the sandbox is
//!   a descendant in every hierarchy;
//! - all sandbox cgroups live under one directory, `<base>/<PARENT_DIR>/<name>`, so leftovers can
//!   be found by listing that directory and matching a name prefix;
//! - removal kills every remaining process first (freeze, SIGKILL, thaw) and only then removes
//!   the directories, so nothing can escape by forking during the kill.
//!
//! Core scheduling (`PR_SCHED_CORE`) is only detected and reported here; on kernels without it
//! (EINVAL, as on our machines) the sandbox runs without a cookie.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use libcgroups::common::{AnyCgroupManager, CgroupConfig, CgroupManager, CgroupSetup, ControllerOpt, FreezerState};
use nix::unistd::Pid;
use oci_spec::runtime::{LinuxCpuBuilder, LinuxMemoryBuilder, LinuxPidsBuilder, LinuxResources, LinuxResourcesBuilder};

/// The directory, below the edge's own cgroup, holding every sandbox cgroup.
pub const PARENT_DIR: &str = "opendsec";

/// Mount directories under `/sys/fs/cgroup` that are not v1 controller hierarchies.
const NOT_V1_CONTROLLERS: [&str; 2] = ["unified", "systemd"];

/// CFS period used for CPU quotas (100 ms, the kernel default).
const CPU_PERIOD_US: u64 = 100_000;

/// The cgroup manager's own errors (libcgroups), kept as the cause.
type ManagerCause = Box<dyn std::error::Error + Send + Sync>;

/// Errors of sandbox cgroup handling: what was being done, on which cgroup or file, and the
/// cause as a `source` (never flattened into a string).
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cannot read the edge's own cgroup")]
    OwnCgroup(#[source] std::io::Error),
    #[error("the edge's v1 cgroup paths do not nest ({0}); cannot create below all of them")]
    NotNested(String),
    #[error("invalid sandbox cgroup name {0:?}")]
    BadName(String),
    #[error("cgroup setup detection failed")]
    Setup(#[source] ManagerCause),
    /// The cgroup manager failed to `op` (create, apply limits, add a process, ...) cgroup `cgroup`.
    #[error("cgroup {}: {op} failed", cgroup.display())]
    Manager {
        op: &'static str,
        cgroup: PathBuf,
        #[source]
        source: ManagerCause,
    },
    #[error("building cgroup resources")]
    Resources(#[source] oci_spec::OciSpecError),
    #[error("processes remain in cgroup {} after kill", .0.display())]
    Busy(PathBuf),
    #[error("{op} {path}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Which cgroup layout the host has, as far as sandboxes are concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Controllers on v1 hierarchies (legacy or hybrid).
    V1,
    /// Pure v2 (unified).
    V2,
}

/// Resource limits of one sandbox cgroup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// CPU in thousandths of a core; 0 means no quota.
    pub cpu_millis: u64,
    /// Best-effort sandboxes get the lowest CPU weight (v1 shares 2, v2 weight 1).
    pub best_effort: bool,
    /// Memory limit in bytes (swap limited to the same: memory+swap = memory); 0 = none.
    pub memory_bytes: u64,
    /// Maximum number of tasks; 0 = none.
    pub pids: u64,
}

/// Disk I/O limits of one sandbox on its own disk device; 0 = no limit of that kind. On v1
/// (blkio) the kernel throttles direct and synchronous I/O only (buffered writes reach the
/// device through the host's writeback, which v1 does not attribute); v2 (io.max) throttles
/// writeback too.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IoLimits {
    pub read_bps: u64,
    pub write_bps: u64,
    pub read_iops: u64,
    pub write_iops: u64,
}

/// The device nodes of a sandbox's `/dev` (name, major, minor), made on its own tmpfs by the
/// setup process; the device cgroup allows exactly these, the pseudo-terminals and
/// `/dev/pts/ptmx`.
pub const DEVICES: &[(&str, u32, u32)] =
    &[("null", 1, 3), ("zero", 1, 5), ("full", 1, 7), ("random", 1, 8), ("urandom", 1, 9), ("tty", 5, 0)];

/// What the device cgroup allows, as v1 `devices.allow` lines: the sandbox's own nodes
/// ([`DEVICES`]), `/dev/pts/ptmx` and the pseudo-terminals. Everything else is
/// denied, mknod included.
pub fn device_allow_list() -> Vec<String> {
    let mut l: Vec<String> = DEVICES.iter().map(|(_, ma, mi)| format!("c {ma}:{mi} rwm")).collect();
    l.push("c 5:2 rwm".into());
    l.push("c 136:* rwm".into());
    l
}

/// Readings of one sandbox cgroup.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CgroupStats {
    pub memory_usage_bytes: u64,
    pub memory_limit_bytes: u64,
    pub pids_current: u64,
    /// OOM kills inside the cgroup, when the kernel reports them.
    pub oom_kills: u64,
    /// CPU time of every task in the cgroup so far.
    pub cpu_usage_ns: u64,
    /// Page cache charged to the cgroup.
    pub memory_cache_bytes: u64,
}

/// Result of probing core scheduling support.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CoreSched {
    Supported,
    /// The kernel answered EINVAL (no CONFIG_SCHED_CORE or no SMT): run without cookies.
    Unsupported,
}

/// One sandbox cgroup (in all its v1 hierarchies, or its v2 directory).
pub struct SandboxCgroup {
    name: String,
    /// Path relative to the hierarchy roots, e.g. `/process_api/x/opendsec/<name>`.
    rel: PathBuf,
    layout: Layout,
    manager: AnyCgroupManager,
}

impl std::fmt::Debug for SandboxCgroup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SandboxCgroup")
            .field("name", &self.name)
            .field("rel", &self.rel)
            .field("layout", &self.layout)
            .finish()
    }
}

/// Parses `/proc/<pid>/cgroup` text into `(controllers, path)` pairs.
pub fn parse_proc_cgroup(text: &str) -> Vec<(Vec<String>, String)> {
    text.lines()
        .filter_map(|line| {
            let mut parts = line.splitn(3, ':');
            let _id = parts.next()?;
            let ctrls = parts.next()?;
            let path = parts.next()?;
            let ctrls = if ctrls.is_empty() { Vec::new() } else { ctrls.split(',').map(str::to_owned).collect() };
            Some((ctrls, path.to_owned()))
        })
        .collect()
}

/// The base path below which sandbox cgroups go, from the edge's own `/proc/self/cgroup`.
///
/// v2: the `0::` path. v1: the deepest path among the used controllers, provided the others
/// are prefixes of it (then creating there is below the edge's cgroup in every hierarchy).
pub fn base_path(layout: Layout, proc_cgroup: &str) -> Result<PathBuf, CgroupError> {
    let entries = parse_proc_cgroup(proc_cgroup);
    match layout {
        Layout::V2 => entries
            .iter()
            .find(|(c, _)| c.is_empty())
            .map(|(_, p)| PathBuf::from(p))
            .ok_or_else(|| CgroupError::NotNested("no v2 entry".into())),
        Layout::V1 => {
            // Every real controller counts (libcgroups joins the pid to all of them); named
            // hierarchies such as name=systemd are not touched.
            let paths: Vec<PathBuf> = entries
                .iter()
                .filter(|(c, _)| !c.is_empty() && !c.iter().all(|x| x.starts_with("name=")))
                .map(|(_, p)| PathBuf::from(p))
                .collect();
            let deepest =
                paths.iter().max_by_key(|p| p.components().count()).cloned().unwrap_or_else(|| PathBuf::from("/"));
            for p in &paths {
                if !deepest.starts_with(p) {
                    return Err(CgroupError::NotNested(format!("{} vs {}", p.display(), deepest.display())));
                }
            }
            Ok(deepest)
        }
    }
}

/// OCI resources for the limits (libcgroups maps shares to a v2 weight itself). `swap`: whether
/// the host accounts swap (else only the memory limit is set).
pub fn resources(limits: &Limits, swap: bool) -> Result<LinuxResources, CgroupError> {
    let bad = CgroupError::Resources;
    let mut cpu = LinuxCpuBuilder::default();
    if limits.cpu_millis > 0 {
        let quota = (limits.cpu_millis * CPU_PERIOD_US / 1000).max(1000);
        cpu = cpu.quota(quota as i64).period(CPU_PERIOD_US);
    }
    let shares = if limits.best_effort {
        2
    } else if limits.cpu_millis > 0 {
        (limits.cpu_millis * 1024 / 1000).max(2)
    } else {
        1024
    };
    cpu = cpu.shares(shares);
    let mut b = LinuxResourcesBuilder::default().cpu(cpu.build().map_err(bad)?);
    if limits.memory_bytes > 0 {
        let m = limits.memory_bytes as i64;
        let mut mem = LinuxMemoryBuilder::default().limit(m);
        if swap {
            mem = mem.swap(m);
        }
        b = b.memory(mem.build().map_err(bad)?);
    }
    if limits.pids > 0 {
        b = b.pids(LinuxPidsBuilder::default().limit(limits.pids as i64).build().map_err(bad)?);
    }
    b.build().map_err(bad)
}

/// Whether memory+swap can be limited: v1 needs swap accounting (`memory.memsw.*`, absent when
/// the kernel runs without it); v2 has `memory.swap.max` in non-root cgroups whenever swap
/// support is built in, which libcgroups handles.
fn swap_accounted(layout: Layout) -> bool {
    match layout {
        Layout::V1 => {
            Path::new(libcgroups::common::DEFAULT_CGROUP_ROOT).join("memory/memory.memsw.limit_in_bytes").exists()
        }
        Layout::V2 => true,
    }
}

/// Sandbox cgroup names: the sandbox-id alphabet, no path separators.
fn check_name(name: &str) -> Result<(), CgroupError> {
    let ok = !name.is_empty()
        && name.len() <= 200
        && name != "."
        && name != ".."
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok { Ok(()) } else { Err(CgroupError::BadName(name.into())) }
}

/// The host's layout.
pub fn detect_layout() -> Result<Layout, CgroupError> {
    match libcgroups::common::get_cgroup_setup() {
        Ok(CgroupSetup::Unified) => Ok(Layout::V2),
        Ok(CgroupSetup::Legacy | CgroupSetup::Hybrid) => Ok(Layout::V1),
        Err(e) => Err(CgroupError::Setup(Box::new(e))),
    }
}

/// The directory holding all sandbox cgroups, relative to the hierarchy roots.
pub fn parent_rel() -> Result<(Layout, PathBuf), CgroupError> {
    let layout = detect_layout()?;
    let own = std::fs::read_to_string("/proc/self/cgroup").map_err(CgroupError::OwnCgroup)?;
    Ok((layout, base_path(layout, &own)?.join(PARENT_DIR)))
}

/// Directories (absolute) where a sandbox cgroup `rel` lives, one per used hierarchy.
fn dirs_of(layout: Layout, rel: &Path) -> Vec<PathBuf> {
    let root = Path::new(libcgroups::common::DEFAULT_CGROUP_ROOT);
    let rel = rel.strip_prefix("/").unwrap_or(rel);
    match layout {
        Layout::V2 => vec![root.join(rel)],
        Layout::V1 => {
            // One directory per mounted hierarchy (co-mounted ones such as cpu,cpuacct appear
            // under several names: keep one path per real directory).
            let mut seen = std::collections::BTreeSet::new();
            let mut out = Vec::new();
            let Ok(rd) = std::fs::read_dir(root) else { return out };
            let mut names: Vec<String> =
                rd.flatten().filter_map(|e| e.file_name().to_str().map(str::to_owned)).collect();
            names.sort();
            for n in names {
                if NOT_V1_CONTROLLERS.contains(&n.as_str()) {
                    continue;
                }
                let mount = root.join(&n);
                let Ok(real) = std::fs::canonicalize(&mount) else { continue };
                if real.is_dir() && seen.insert(real.clone()) {
                    out.push(real.join(rel));
                }
            }
            out
        }
    }
}

fn write_file(path: &Path, text: &str) -> Result<(), CgroupError> {
    std::fs::write(path, text).map_err(|source| CgroupError::Io { op: "write", path: path.to_path_buf(), source })
}

/// Whether a cgroup may exist at `rel` (a path from the hierarchy roots, as
/// [`SandboxCgroup::rel_path`] gives, whichever edge made it) in any hierarchy: true when the
/// hierarchies cannot be read (a holder is taken for gone only when it surely is).
pub fn exists_at(rel: &Path) -> bool {
    let Ok(layout) = detect_layout() else { return true };
    let dirs = dirs_of(layout, rel);
    dirs.is_empty() || dirs.iter().any(|d| d.is_dir())
}

/// Maps a manager error of `op` on the cgroup at `rel` to a [`CgroupError::Manager`].
fn mgr_err<E: std::error::Error + Send + Sync + 'static>(
    op: &'static str,
    rel: &Path,
) -> impl FnOnce(E) -> CgroupError {
    let cgroup = rel.to_path_buf();
    move |e| CgroupError::Manager { op, cgroup, source: Box::new(e) }
}

impl SandboxCgroup {
    /// Creates (or opens) the cgroup `name` below the edge's own cgroup and applies `limits`.
    pub fn create(name: &str, limits: &Limits) -> Result<SandboxCgroup, CgroupError> {
        let cg = SandboxCgroup::open(name)?;
        // libcgroups v1 only creates directories in add_task; limits must be in place before
        // the first process joins, so create them here.
        for d in dirs_of(cg.layout, &cg.rel) {
            std::fs::create_dir_all(&d).map_err(|source| CgroupError::Io { op: "mkdir", path: d.clone(), source })?;
            fill_cpuset(&d)?;
        }
        let res = resources(limits, swap_accounted(cg.layout))?;
        cg.manager
            .apply(&ControllerOpt {
                resources: &res,
                disable_oom_killer: false,
                oom_score_adj: None,
                freezer_state: None,
            })
            .map_err(mgr_err("apply limits", &cg.rel))?;
        Ok(cg)
    }

    /// Applies `limits` to a cgroup in use (a warm pool member claimed with other limits).
    pub fn set_limits(&self, limits: &Limits) -> Result<(), CgroupError> {
        let res = resources(limits, swap_accounted(self.layout))?;
        self.manager
            .apply(&ControllerOpt {
                resources: &res,
                disable_oom_killer: false,
                oom_score_adj: None,
                freezer_state: None,
            })
            .map_err(mgr_err("apply limits", &self.rel))
    }

    /// v1: denies every device, then allows [`device_allow_list`] (libcgroups' own defaults
    /// allow mknod of any device and more nodes than a sandbox has) and, for the setup
    /// process, block device `setup_disk` (it mounts the sandbox's disk; [`Self::deny_block`]
    /// takes that back once setup is done). v2 has no device file (a BPF program would do
    /// it); mknod is refused there by the missing capability and the user namespace, and the
    /// only nodes a sandbox can open are those of its `/dev`.
    pub fn restrict_devices(&self, setup_disk: (u32, u32)) -> Result<(), CgroupError> {
        if self.layout != Layout::V1 {
            return Ok(());
        }
        let dir = self.controller_dir("devices");
        write_file(&dir.join("devices.deny"), "a")?;
        for rule in device_allow_list() {
            write_file(&dir.join("devices.allow"), &rule)?;
        }
        write_file(&dir.join("devices.allow"), &format!("b {}:{} rw", setup_disk.0, setup_disk.1))
    }

    /// v1: denies block device `dev` again (see [`Self::restrict_devices`]).
    pub fn deny_block(&self, dev: (u32, u32)) -> Result<(), CgroupError> {
        if self.layout != Layout::V1 {
            return Ok(());
        }
        write_file(&self.controller_dir("devices").join("devices.deny"), &format!("b {}:{} rwm", dev.0, dev.1))
    }

    /// Limits I/O to block device `major:minor` (the sandbox's disk).
    pub fn limit_io(&self, major: u32, minor: u32, io: &IoLimits) -> Result<(), CgroupError> {
        let dev = format!("{major}:{minor}");
        match self.layout {
            Layout::V1 => {
                let dir = self.controller_dir("blkio");
                for (file, v) in [
                    ("blkio.throttle.read_bps_device", io.read_bps),
                    ("blkio.throttle.write_bps_device", io.write_bps),
                    ("blkio.throttle.read_iops_device", io.read_iops),
                    ("blkio.throttle.write_iops_device", io.write_iops),
                ] {
                    if v > 0 {
                        write_file(&dir.join(file), &format!("{dev} {v}"))?;
                    }
                }
                Ok(())
            }
            Layout::V2 => {
                let v = |n: u64| if n == 0 { "max".to_string() } else { n.to_string() };
                let line = format!(
                    "{dev} rbps={} wbps={} riops={} wiops={}",
                    v(io.read_bps),
                    v(io.write_bps),
                    v(io.read_iops),
                    v(io.write_iops)
                );
                write_file(&self.memory_dir().join("io.max"), &line)
            }
        }
    }

    /// The directory of v1 controller `ctrl` for this cgroup (the unified one on v2).
    pub fn controller_dir(&self, ctrl: &str) -> PathBuf {
        let root = Path::new(libcgroups::common::DEFAULT_CGROUP_ROOT);
        let rel = self.rel.strip_prefix("/").unwrap_or(&self.rel);
        match self.layout {
            Layout::V2 => root.join(rel),
            Layout::V1 => root.join(ctrl).join(rel),
        }
    }

    /// Opens the cgroup `name` without changing its limits (re-adoption, cleanup).
    pub fn open(name: &str) -> Result<SandboxCgroup, CgroupError> {
        check_name(name)?;
        let (layout, parent) = parent_rel()?;
        let rel = parent.join(name);
        let manager = libcgroups::common::create_cgroup_manager(CgroupConfig {
            cgroup_path: rel.clone(),
            systemd_cgroup: false,
            container_name: name.to_owned(),
        })
        .map_err(mgr_err("open", &rel))?;
        Ok(SandboxCgroup { name: name.to_owned(), rel, layout, manager })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn layout(&self) -> Layout {
        self.layout
    }

    /// Path relative to the hierarchy roots (what the sandbox sees as `/` in its cgroup ns).
    pub fn rel_path(&self) -> &Path {
        &self.rel
    }

    /// The directory of the memory controller (v1) or the unified directory (v2): the one the
    /// setup process bind-mounts as the sandbox's own `/sys/fs/cgroup`.
    pub fn memory_dir(&self) -> PathBuf {
        self.controller_dir("memory")
    }

    /// The `cgroup.procs` files a process writes `0` into to join this cgroup (one per v1
    /// hierarchy; one on v2), for a child joining before it runs anything (`pre_exec`).
    pub fn procs_files(&self) -> Vec<PathBuf> {
        dirs_of(self.layout, &self.rel).into_iter().map(|d| d.join("cgroup.procs")).collect()
    }

    pub fn add_pid(&self, pid: i32) -> Result<(), CgroupError> {
        self.manager.add_task(Pid::from_raw(pid)).map_err(mgr_err("add a process", &self.rel))
    }

    pub fn pids(&self) -> Result<Vec<i32>, CgroupError> {
        Ok(self
            .manager
            .get_all_pids()
            .map_err(mgr_err("list processes", &self.rel))?
            .into_iter()
            .map(Pid::as_raw)
            .collect())
    }

    pub fn freeze(&self) -> Result<(), CgroupError> {
        self.manager.freeze(FreezerState::Frozen).map_err(mgr_err("freeze", &self.rel))
    }

    pub fn thaw(&self) -> Result<(), CgroupError> {
        self.manager.freeze(FreezerState::Thawed).map_err(mgr_err("thaw", &self.rel))
    }

    pub fn stats(&self) -> Result<CgroupStats, CgroupError> {
        let s = self.manager.stats().map_err(mgr_err("read statistics", &self.rel))?;
        Ok(CgroupStats {
            memory_usage_bytes: s.memory.memory.usage,
            memory_limit_bytes: s.memory.memory.limit,
            pids_current: s.pids.current,
            oom_kills: self.oom_kills(),
            // v1's cpuacct counts nanoseconds, v2's cpu.stat microseconds.
            cpu_usage_ns: match self.layout {
                Layout::V1 => s.cpu.usage.usage_total,
                Layout::V2 => s.cpu.usage.usage_total.saturating_mul(1000),
            },
            memory_cache_bytes: s.memory.cache,
        })
    }

    /// OOM kills: v1 `memory.oom_control` (`oom_kill N`), v2 `memory.events` (`oom_kill N`).
    fn oom_kills(&self) -> u64 {
        let file = match self.layout {
            Layout::V1 => "memory.oom_control",
            Layout::V2 => "memory.events",
        };
        std::fs::read_to_string(self.memory_dir().join(file))
            .ok()
            .and_then(|t| t.lines().find_map(|l| l.strip_prefix("oom_kill ").and_then(|v| v.trim().parse().ok())))
            .unwrap_or(0)
    }

    /// Kills every process (frozen first, so none can fork away), then removes the cgroup.
    pub fn remove(self) -> Result<(), CgroupError> {
        kill_all(&self)?;
        self.manager.remove().map_err(mgr_err("remove", &self.rel))?;
        // libcgroups v1 only removes the hierarchies it manages; make sure none is left.
        for d in dirs_of(self.layout, &self.rel) {
            if d.exists() {
                let _ = std::fs::remove_dir(&d);
            }
        }
        Ok(())
    }
}

fn kill_all(cg: &SandboxCgroup) -> Result<(), CgroupError> {
    // Freezing may fail when the cgroup is already empty or half gone; killing still helps.
    let _ = cg.freeze();
    for pid in cg.pids().unwrap_or_default() {
        let _ = nix::sys::signal::kill(Pid::from_raw(pid), nix::sys::signal::SIGKILL);
    }
    let _ = cg.thaw();
    let deadline = Instant::now() + Duration::from_secs(10);
    // Killed processes are usually gone within a millisecond or two: look again soon, then
    // less often.
    let mut pause = Duration::from_millis(1);
    loop {
        let left = cg.pids().unwrap_or_default();
        if left.is_empty() {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(CgroupError::Busy(cg.rel.clone()));
        }
        for pid in left {
            let _ = nix::sys::signal::kill(Pid::from_raw(pid), nix::sys::signal::SIGKILL);
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(10));
    }
}

/// A new v1 cpuset cgroup starts with no CPUs and no memory nodes, and no task can join it
/// (`ENOSPC`) until they are set: they are copied from the parent, the way the kernel does for
/// v2 and libcgroups does in `add_task`, so that a process can also join by writing its own
/// `cgroup.procs` ([`SandboxCgroup::procs_files`]).
fn fill_cpuset(dir: &Path) -> Result<(), CgroupError> {
    for f in ["cpuset.cpus", "cpuset.mems"] {
        let own = dir.join(f);
        let Ok(v) = std::fs::read_to_string(&own) else { continue };
        if !v.trim().is_empty() {
            continue;
        }
        let Some(parent) = dir.parent() else { continue };
        // The parents may be as new (the edge's own `opendsec` cgroup): filled first.
        fill_cpuset(parent)?;
        let from = parent.join(f);
        let v = std::fs::read_to_string(&from).map_err(|source| CgroupError::Io { op: "read", path: from, source })?;
        std::fs::write(&own, v.trim()).map_err(|source| CgroupError::Io { op: "write", path: own.clone(), source })?;
    }
    Ok(())
}

/// Names of existing sandbox cgroups starting with `prefix` (for leftover cleanup).
pub fn list(prefix: &str) -> Result<Vec<String>, CgroupError> {
    let (layout, parent) = parent_rel()?;
    let mut names = std::collections::BTreeSet::new();
    for d in dirs_of(layout, &parent) {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            if let Some(n) = e.file_name().to_str()
                && e.path().is_dir()
                && n.starts_with(prefix)
            {
                names.insert(n.to_owned());
            }
        }
    }
    Ok(names.into_iter().collect())
}

/// Kills and removes every sandbox cgroup whose name starts with `prefix` and is not in `keep`.
pub fn cleanup(prefix: &str, keep: &[String]) -> Result<Vec<String>, CgroupError> {
    let mut removed = Vec::new();
    for name in list(prefix)? {
        if keep.contains(&name) {
            continue;
        }
        SandboxCgroup::open(&name)?.remove()?;
        removed.push(name);
    }
    Ok(removed)
}

/// Gives this process (all its threads; children inherit it) a new core scheduling cookie, so
/// no task of another sandbox shares a physical core's hardware threads with it at once.
pub fn core_sched_cookie() -> std::io::Result<()> {
    use rustix::thread::{CoreSchedulingScope, create_core_scheduling_cookie};
    Ok(create_core_scheduling_cookie(rustix::process::getpid(), CoreSchedulingScope::ThreadGroup)?)
}

/// Probes `PR_SCHED_CORE` by reading this process's cookie (harmless, changes nothing).
pub fn detect_core_sched() -> CoreSched {
    use rustix::thread::{CoreSchedulingScope, core_scheduling_cookie};
    match core_scheduling_cookie(rustix::process::getpid(), CoreSchedulingScope::Thread) {
        Ok(_) => CoreSched::Supported,
        Err(_) => CoreSched::Unsupported,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A manager failure says what was done to which cgroup, and keeps its cause as a source.
    #[test]
    fn errors_keep_their_cause() {
        let e = mgr_err("freeze", Path::new("opendsec/sb-1"))(std::io::Error::other("device busy"));
        assert_eq!(e.to_string(), "cgroup opendsec/sb-1: freeze failed");
        assert_eq!(opendsec_common::reason::error_chain(&e), "cgroup opendsec/sb-1: freeze failed: device busy");
        let e = CgroupError::Io { op: "mkdir", path: "/sys/fs/cgroup/x".into(), source: std::io::Error::other("no") };
        assert!(std::error::Error::source(&e).is_some());
    }

    const HYBRID: &str = "9:name=systemd:/\n8:pids:/\n6:freezer:/\n4:memory:/process_api/abc\n1:cpu,cpuacct:/\n0::/\n";

    #[test]
    fn v1_base_is_deepest_nested_path() {
        assert_eq!(base_path(Layout::V1, HYBRID).unwrap(), PathBuf::from("/process_api/abc"));
        let named = "9:name=systemd:/x/y/z\n4:memory:/m\n";
        assert_eq!(base_path(Layout::V1, named).unwrap(), PathBuf::from("/m"));
        assert_eq!(base_path(Layout::V2, HYBRID).unwrap(), PathBuf::from("/"));
    }

    #[test]
    fn v1_base_refuses_diverging_paths() {
        let t = "4:memory:/a/b\n8:pids:/c\n";
        assert!(matches!(base_path(Layout::V1, t), Err(CgroupError::NotNested(_))));
    }

    #[test]
    fn resources_follow_limits() {
        let r =
            resources(&Limits { cpu_millis: 500, best_effort: false, memory_bytes: 1 << 20, pids: 64 }, true).unwrap();
        let cpu = r.cpu().as_ref().unwrap();
        assert_eq!(cpu.quota(), Some(50_000));
        assert_eq!(cpu.period(), Some(100_000));
        assert_eq!(cpu.shares(), Some(512));
        assert_eq!(r.memory().as_ref().unwrap().swap(), Some(1 << 20));
        assert_eq!(r.pids().as_ref().unwrap().limit(), 64);
        let be = resources(&Limits { cpu_millis: 0, best_effort: true, memory_bytes: 0, pids: 0 }, true).unwrap();
        assert_eq!(be.cpu().as_ref().unwrap().shares(), Some(2));
        assert!(be.cpu().as_ref().unwrap().quota().is_none());
        assert!(be.memory().is_none());
        let noswap =
            resources(&Limits { cpu_millis: 0, best_effort: false, memory_bytes: 4096, pids: 0 }, false).unwrap();
        assert_eq!(noswap.memory().as_ref().unwrap().swap(), None);
    }

    #[test]
    fn names_are_checked() {
        assert!(check_name("edge1.lease-2").is_ok());
        for bad in ["", "..", "a/b", "a b"] {
            assert!(check_name(bad).is_err(), "{bad}");
        }
    }
}
