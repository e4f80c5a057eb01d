//! A small driver over the pieces: start a container sandbox (cgroup, upper disk, loop device,
//! setup process), freeze/thaw it, read its cgroup, stop it, and clean up leftovers.
//!
//! Layout on disk: `<state_dir>/<name>/{disk.img, run/, console.log, loop, idmap}`; the cgroup
//! is named `<name>` too, so leftovers are found by one name prefix in both places. `idmap`
//! names the sandbox's host id range, claimed host-wide under the same name
//! ([`super::idmap`]) after the cgroup exists and released after the cgroup is gone.
//!
//! Invariants:
//! - everything a failed `start` created is torn down before it returns the error;
//! - the edge process is a child subreaper, so each sandbox's PID 1 (orphaned when its setup
//!   process exits) becomes the edge's child and is reaped by `stop`/`exited`;
//! - the loop device is only held by the sandbox's mount namespace once `start` returns
//!   (autoclear), so it goes away with the sandbox's last process.

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::cgroup::{self, CgroupError, CgroupStats, IoLimits, Layout, Limits, SandboxCgroup};
use super::idmap::{self, IdPool, IdRange, IdmapError};
use super::init::{self, Bind, InitConfig};
use super::rootfs::{self, RootfsError};

/// Errors of the sandbox driver.
#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
    #[error(transparent)]
    Rootfs(#[from] RootfsError),
    #[error(transparent)]
    Idmap(#[from] IdmapError),
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The setup process's own report (`<stage>: <message>`), stable for callers to show.
    #[error("sandbox setup failed: {0}")]
    Setup(String),
    #[error("sandbox {0} is not running any more")]
    Gone(String),
    #[error("sandbox {0} did not go away: {1}")]
    Leftover(String, String),
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SandboxError + 'a {
    move |source| SandboxError::Io { what, path: path.to_path_buf(), source }
}

/// What to start.
#[derive(Clone, Debug)]
pub struct SandboxSpec {
    /// Cgroup and directory name; also the cleanup prefix's subject (e.g. `sbx-<edge>.<lease>`).
    pub name: String,
    pub state_dir: PathBuf,
    pub hostname: String,
    /// Cached layer directories, top layer first.
    pub lower_dirs: Vec<PathBuf>,
    pub disk_mb: u64,
    pub limits: Limits,
    pub binds: Vec<Bind>,
    pub masked_paths: Vec<String>,
    pub readonly_paths: Vec<String>,
    pub oom_score_adj: i32,
    pub argv: Vec<String>,
    pub env: Vec<String>,
    /// The binary re-executed as setup process (`/proc/self/exe` in the edge).
    pub init_exe: PathBuf,
    /// Bind a listening unix socket at `<dir>/`[`AGENT_SOCKET`] and hand it to PID 1 as fd
    /// [`init::PID1_LISTEN_FD`]. The path is in the host's sandbox directory, which the sandbox
    /// cannot see: only the edge can connect, and nothing inside can replace it.
    pub agent_socket: bool,
    /// Give the sandbox its own core scheduling cookie (where the kernel has core scheduling).
    pub core_sched: bool,
    /// Run the sandbox in a user namespace with a host id range from this pool. None: no
    /// user namespace (sandbox root is host root; for measurements only).
    pub userns: Option<IdPool>,
    /// Disk I/O limits on the sandbox's own disk.
    pub io: IoLimits,
}

/// The file name of the agent's socket in a sandbox's directory.
pub const AGENT_SOCKET: &str = "aether.sock";

/// A running sandbox.
#[derive(Debug)]
pub struct Sandbox {
    pub name: String,
    /// Host pid of the sandbox's PID 1.
    pub pid: i32,
    pub dir: PathBuf,
    pub cgroup: SandboxCgroup,
    /// The sandbox's host ids (None: no user namespace).
    pub id_map: Option<IdRange>,
}

fn set_subreaper() {
    let _ = rustix::process::set_child_subreaper(Some(rustix::process::getpid()));
}

impl Sandbox {
    /// Starts a sandbox (blocking; call from a blocking thread).
    pub fn start(spec: &SandboxSpec) -> Result<Sandbox, SandboxError> {
        set_subreaper();
        let dir = spec.state_dir.join(&spec.name);
        let cg = SandboxCgroup::create(&spec.name, &spec.limits)?;
        match start_in(spec, &dir, &cg) {
            Ok((pid, id_map)) => Ok(Sandbox { name: spec.name.clone(), pid, dir, cgroup: cg, id_map }),
            Err(e) => {
                let _ = teardown(&spec.name, &dir, Some(cg));
                Err(e)
            }
        }
    }

    /// Takes a sandbox started by an earlier edge process back by name (records need not keep
    /// the pid): its PID 1 is the process of its cgroup that is pid 1 in its own pid namespace.
    pub fn adopt(state_dir: &Path, name: &str) -> Result<Sandbox, SandboxError> {
        let cg = SandboxCgroup::open(name)?;
        let pid = cg.pids()?.into_iter().find(|p| is_ns_pid1(*p)).ok_or_else(|| SandboxError::Gone(name.into()))?;
        // Its ids: what the kernel says PID 1 maps (the identity map: no user namespace),
        // held again under its name.
        let path = PathBuf::from(format!("/proc/{pid}/uid_map"));
        let map = std::fs::read_to_string(&path).map_err(io("read", &path))?;
        let id_map = IdRange::from_map(&map).filter(|r| r.host_first != 0);
        if let Some(r) = id_map {
            IdPool::in_dir(idmap::CLAIMS_DIR, r.host_first, 1)?.confirm(r, name, &cg.rel_path().to_string_lossy())?;
        }
        Ok(Sandbox { name: name.into(), pid, dir: state_dir.join(name), cgroup: cg, id_map })
    }

    pub fn freeze(&self) -> Result<(), SandboxError> {
        Ok(self.cgroup.freeze()?)
    }

    pub fn thaw(&self) -> Result<(), SandboxError> {
        Ok(self.cgroup.thaw()?)
    }

    pub fn stats(&self) -> Result<CgroupStats, SandboxError> {
        Ok(self.cgroup.stats()?)
    }

    /// A read-only view of the sandbox's upper directory (what it wrote), as a directory fd.
    /// The sandbox's disk is mounted only in its own mount namespace; this mounts it once more
    /// (the kernel shares the one ext4 superblock: no second file system over the device) in
    /// a mount namespace of a short-lived thread, marks that mount read-only, opens `upper`
    /// and detaches the mount again. The fd keeps the view alive; the host's mount table never
    /// shows it. The loop device is checked to be backed by this sandbox's own disk first.
    pub fn open_upper(&self) -> Result<std::os::fd::OwnedFd, SandboxError> {
        let loop_file = self.dir.join(LOOP_FILE);
        let dev = std::fs::read(&loop_file).map_err(io("read", &loop_file))?;
        let dev = PathBuf::from(std::ffi::OsStr::from_bytes(&dev));
        let disk = self.dir.join("disk.img");
        let disk = std::fs::canonicalize(&disk).unwrap_or(disk);
        if rootfs::loop_backing(&dev).as_deref() != Some(disk.as_path()) {
            return Err(SandboxError::Gone(self.name.clone()));
        }
        let at = self.dir.join(format!(".upper-{:016x}", rand::random::<u64>()));
        std::fs::create_dir(&at).map_err(io("create", &at))?;
        let (dev2, at2) = (dev.clone(), at.clone());
        let opened = std::thread::spawn(move || -> Result<std::os::fd::OwnedFd, String> {
            use nix::mount::{MntFlags, MsFlags, mount, umount2};
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).map_err(|e| format!("unshare: {e}"))?;
            mount(None::<&str>, "/", None::<&str>, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None::<&str>)
                .map_err(|e| format!("private mounts: {e}"))?;
            let flags = MsFlags::MS_NODEV | MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC;
            mount(Some(&dev2), &at2, Some("ext4"), flags, None::<&str>).map_err(|e| format!("mount: {e}"))?;
            let ro = mount(
                None::<&str>,
                &at2,
                None::<&str>,
                flags | MsFlags::MS_REMOUNT | MsFlags::MS_BIND | MsFlags::MS_RDONLY,
                None::<&str>,
            )
            .map_err(|e| format!("read-only: {e}"));
            let fd = ro.and_then(|()| {
                rustix::fs::open(
                    at2.join("upper"),
                    rustix::fs::OFlags::RDONLY
                        | rustix::fs::OFlags::DIRECTORY
                        | rustix::fs::OFlags::NOFOLLOW
                        | rustix::fs::OFlags::CLOEXEC,
                    rustix::fs::Mode::empty(),
                )
                .map_err(|e| format!("open upper: {e}"))
            });
            let _ = umount2(&at2, MntFlags::MNT_DETACH);
            fd
        })
        .join();
        let _ = std::fs::remove_dir(&at);
        match opened {
            Ok(Ok(fd)) => Ok(fd),
            Ok(Err(e)) => {
                Err(SandboxError::Io { what: "view the upper disk", path: dev, source: std::io::Error::other(e) })
            }
            Err(_) => Err(SandboxError::Io {
                what: "view the upper disk",
                path: dev,
                source: std::io::Error::other("the thread panicked"),
            }),
        }
    }

    /// The exit status of PID 1 once it has ended (reaps it), `None` while it runs.
    pub fn exited(&self) -> Option<i32> {
        let pid = rustix::process::Pid::from_raw(self.pid)?;
        match rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::NOHANG) {
            Ok(Some((_, st))) => Some(st.exit_status().unwrap_or_else(|| 128 + st.terminating_signal().unwrap_or(0))),
            Ok(None) => None,
            Err(_) => {
                // Not our child (adopted after an edge restart): alive while it is in the cgroup.
                let alive = self.cgroup.pids().map(|p| p.contains(&self.pid)).unwrap_or(false);
                if alive { None } else { Some(-1) }
            }
        }
    }

    /// Kills every process, waits for the mounts and loop device to go, removes the cgroup and
    /// the sandbox directory.
    pub fn stop(self) -> Result<(), SandboxError> {
        let pid = self.pid;
        let r = teardown(&self.name, &self.dir, Some(self.cgroup));
        reap(pid);
        r
    }
}

/// Reaps the sandbox's PID 1, our child once the setup process exited. A task leaves its cgroup
/// before it becomes a zombie, so an empty cgroup does not mean the zombie is there yet: retry
/// for up to a second. A pid that is not our child answers ECHILD at once.
fn reap(pid: i32) {
    for _ in 0..100 {
        let Some(p) = rustix::process::Pid::from_raw(pid) else { return };
        if !matches!(rustix::process::waitpid(Some(p), rustix::process::WaitOptions::NOHANG), Ok(None)) {
            return; // reaped, or not our child
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// Whether host pid `pid` is PID 1 of a nested pid namespace (`NSpid:` ends in 1).
fn is_ns_pid1(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|t| {
            t.lines().find_map(|l| {
                l.strip_prefix("NSpid:").map(|v| {
                    let ids: Vec<&str> = v.split_whitespace().collect();
                    ids.len() > 1 && ids.last() == Some(&"1")
                })
            })
        })
        .unwrap_or(false)
}

fn start_in(spec: &SandboxSpec, dir: &Path, cg: &SandboxCgroup) -> Result<(i32, Option<IdRange>), SandboxError> {
    let run = dir.join("run");
    std::fs::create_dir_all(&run).map_err(io("create", &run))?;
    let id_map = match &spec.userns {
        Some(pool) => {
            let at = cg.rel_path().to_string_lossy().into_owned();
            let r = pool.claim(&spec.name, &at, |holder| cgroup::exists_at(Path::new(holder)))?;
            let f = dir.join(IDMAP_FILE);
            std::fs::write(&f, format!("{} {}\n", r.host_first, r.count)).map_err(io("write", &f))?;
            Some(r)
        }
        None => None,
    };
    let disk = dir.join("disk.img");
    rootfs::create_disk(&disk, spec.disk_mb)?;
    let dev = rootfs::attach_loop(&disk)?;
    // Teardown checks this one device rather than scanning every loop device of the host
    // (thousands on a busy node, several scans per stop).
    let loop_file = dir.join(LOOP_FILE);
    std::fs::write(&loop_file, dev.path.as_os_str().as_encoded_bytes()).map_err(io("write", &loop_file))?;
    let (major, minor) = rootfs::device_number(&dev.path).map_err(io("stat", &dev.path))?;
    cg.limit_io(major, minor, &spec.io)?;
    cg.restrict_devices((major, minor))?;
    let log_path = dir.join("console.log");
    let log = std::fs::File::create(&log_path).map_err(io("create", &log_path))?;
    let cfg = InitConfig {
        hostname: spec.hostname.clone(),
        run_dir: run,
        disk_dev: dev.path.clone(),
        lower_dirs: spec.lower_dirs.clone(),
        cgroup_v2: cg.layout() == Layout::V2,
        binds: spec.binds.clone(),
        masked_paths: spec.masked_paths.clone(),
        readonly_paths: spec.readonly_paths.clone(),
        oom_score_adj: spec.oom_score_adj,
        argv: spec.argv.clone(),
        env: spec.env.clone(),
        listen_fd: None,
        core_sched: spec.core_sched,
        id_map,
    };
    let listener = if spec.agent_socket { Some(bind_agent_socket(dir)?) } else { None };
    // The setup process gets the listening socket as its stdin, and its config and status
    // over one socket pair as its stdout. A spawn's dup2 clears close-on-exec in the child
    // alone, so no fd of the edge is ever inheritable: a process the edge spawns meanwhile (a
    // QEMU, nft, mkfs, another sandbox's setup) never holds this sandbox's socket. std still
    // spawns with posix_spawn (no pre_exec hook), which does not copy the edge's page tables
    // as fork would.
    let stdin = match &listener {
        Some(l) => Stdio::from(std::os::fd::OwnedFd::from(l.try_clone().map_err(io("dup", &dir.join(AGENT_SOCKET)))?)),
        None => Stdio::null(),
    };
    let mut cfg = cfg;
    cfg.listen_fd = listener.as_ref().map(|_| init::LISTEN_ON_STDIN);
    let json = serde_json::to_vec(&cfg).map_err(|e| SandboxError::Setup(format!("config: {e}")))?;
    let (mut ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(io("socketpair for", &spec.init_exe))?;
    let mut child = {
        // Dropped at the end of the block: the parent keeps no copy of the child's ends.
        let mut cmd = Command::new(&spec.init_exe);
        cmd.arg(init::MARKER)
            .stdin(stdin)
            .stdout(Stdio::from(std::os::fd::OwnedFd::from(theirs)))
            .stderr(Stdio::from(log))
            .spawn()
            .map_err(io("spawn", &spec.init_exe))?
    };
    // Into the cgroup before it unshares its cgroup namespace (it blocks reading the config).
    let joined = cg.add_pid(child.id() as i32);
    let wrote = match &joined {
        Ok(()) => ours.write_all(&json).map_err(io("send config to", &spec.init_exe)),
        Err(_) => Ok(()),
    };
    // The end of the config (the setup process reads to it), sent or not.
    let _ = ours.shutdown(std::net::Shutdown::Write);
    let status = init::read_status(&mut ours);
    let _ = child.wait();
    joined?;
    wrote?;
    // The mount inside the namespace now holds the device; our fd can go (autoclear). PID 1
    // holds the listening socket now.
    drop(dev);
    drop(listener);
    let started = status.map_err(SandboxError::Setup)?;
    // The disk is mounted: nothing in the sandbox opens its device again.
    cg.deny_block((major, minor))?;
    for w in &started.warnings {
        tracing::warn!(sandbox = %spec.name, "sandbox setup: {w}");
    }
    Ok((started.pid, id_map))
}

/// Binds the agent's listening socket in `dir` (through a directory fd: unix socket paths are
/// limited to 108 bytes, state directories need not be).
fn bind_agent_socket(dir: &Path) -> Result<std::os::unix::net::UnixListener, SandboxError> {
    use std::os::unix::fs::PermissionsExt;
    let d = std::fs::File::open(dir).map_err(io("open", dir))?;
    let path = PathBuf::from(format!("/proc/self/fd/{}/{AGENT_SOCKET}", d.as_raw_fd()));
    let sock = dir.join(AGENT_SOCKET);
    let _ = std::fs::remove_file(&sock);
    let l = std::os::unix::net::UnixListener::bind(&path).map_err(io("bind", &sock))?;
    std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600)).map_err(io("chmod", &sock))?;
    Ok(l)
}

/// Connects to the agent socket in `dir` (through a directory fd, see [`bind_agent_socket`]);
/// tokio's connect, so a full backlog (a frozen agent) waits without blocking a worker.
pub async fn connect_agent_socket(dir: &Path) -> std::io::Result<tokio::net::UnixStream> {
    let d = std::fs::File::open(dir)?;
    let s = tokio::net::UnixStream::connect(format!("/proc/self/fd/{}/{AGENT_SOCKET}", d.as_raw_fd())).await;
    drop(d);
    s
}

/// Kills the cgroup's processes, waits for the loop devices under `dir` to be released
/// (detaching leftovers), removes the cgroup and `dir`.
fn teardown(name: &str, dir: &Path, cg: Option<SandboxCgroup>) -> Result<(), SandboxError> {
    let cg = match cg {
        Some(c) => Some(c),
        None => SandboxCgroup::open(name).ok(),
    };
    if let Some(cg) = cg {
        cg.remove()?;
    }
    // No directory, no disk: its loop device (backed by a file in it) went before it did.
    if dir.exists() {
        // The namespace dies with its last process; the kernel then unmounts and autoclears.
        let attached = || loops_of(dir);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut pause = Duration::from_millis(1);
        while !attached().is_empty() && Instant::now() < deadline {
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(10));
        }
        for dev in attached() {
            rootfs::detach(&dev);
        }
        if !attached().is_empty() {
            return Err(SandboxError::Leftover(name.into(), "loop device still attached".into()));
        }
    }
    // Its ids go back once nothing of it runs.
    if let Some(r) = read_idmap(dir) {
        idmap::release(Path::new(idmap::CLAIMS_DIR), r, name)?;
    }
    if dir.exists() {
        std::fs::remove_dir_all(dir).map_err(io("remove", dir))?;
    }
    Ok(())
}

/// The name of the file in a sandbox's directory that names its loop device.
const LOOP_FILE: &str = "loop";
/// The name of the file in a sandbox's directory that names its host id range.
const IDMAP_FILE: &str = "idmap";

fn read_idmap(dir: &Path) -> Option<IdRange> {
    let t = std::fs::read_to_string(dir.join(IDMAP_FILE)).ok()?;
    let mut it = t.split_whitespace().map(|v| v.parse::<u32>().ok());
    Some(IdRange { host_first: it.next()??, count: it.next()?? })
}

/// The loop devices still backed by a file in `dir`: the one its `loop` file names, else (a
/// creation interrupted before it wrote the file) whatever a scan of every loop device finds.
fn loops_of(dir: &Path) -> Vec<PathBuf> {
    match std::fs::read(dir.join(LOOP_FILE)) {
        Ok(dev) => {
            let dev = PathBuf::from(std::ffi::OsStr::from_bytes(&dev));
            match rootfs::loop_backing(&dev) {
                Some(back) if back.starts_with(dir) => vec![dev],
                _ => vec![],
            }
        }
        Err(_) => rootfs::loops_under(dir).into_iter().map(|(dev, _)| dev).collect(),
    }
}

/// Removes whatever is left of the sandbox named exactly `name` (its processes through its
/// cgroup, loop devices under its directory, the cgroup and the directory); nothing left is Ok.
/// For sandboxes this process holds no handle of (a creation interrupted by an edge restart).
pub fn remove_named(state_dir: &Path, name: &str) -> Result<(), SandboxError> {
    teardown(name, &state_dir.join(name), None)
}

/// Removes every sandbox named `<prefix>...` not in `keep`: its processes (through its cgroup),
/// loop devices backed under its directory, the cgroup and the directory. Returns the names.
pub fn cleanup_leftovers(state_dir: &Path, prefix: &str, keep: &[String]) -> Result<Vec<String>, SandboxError> {
    let mut names: std::collections::BTreeSet<String> = cgroup::list(prefix)?.into_iter().collect();
    if let Ok(rd) = std::fs::read_dir(state_dir) {
        for e in rd.flatten() {
            if let Some(n) = e.file_name().to_str()
                && n.starts_with(prefix)
            {
                names.insert(n.to_owned());
            }
        }
    }
    let mut removed = Vec::new();
    for n in names {
        if keep.contains(&n) {
            continue;
        }
        teardown(&n, &state_dir.join(&n), None)?;
        removed.push(n);
    }
    // Claims of sandboxes whose directory went before their claim did.
    idmap::release_leftovers(Path::new(idmap::CLAIMS_DIR), prefix, keep)?;
    Ok(removed)
}
