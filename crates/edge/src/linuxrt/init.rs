//! The sandbox setup process: the edge binary re-executed (`/proc/self/exe` with argv[1] =
//! [`MARKER`]), reading an [`InitConfig`] as JSON and reporting on stdout, a unix socket (the
//! edge writes the config and shuts its sending side), with the agent's listening socket, if
//! any, as stdin.
//!
//! Protocol on stdout after the config (the status socket), one line each: `PID <host pid>` once the sandbox's
//! PID 1 exists, `ERR <stage>: <message>` when a stage fails. The status fd is close-on-exec
//! in PID 1, so EOF after a `PID` line and no `ERR` means the init command was executed.
//!
//! Order (each step needs the previous one's privileges): the parent has already put this
//! process into the sandbox cgroup; a session of its own (`setsid`: no controlling terminal,
//! whatever terminal the edge was started from); the sandbox's user namespace, made by a
//! short-lived helper that drops to the range's first host id and unshares, so the namespace
//! is owned by that id and per-user kernel limits (inotify instances, mqueues, processes) are
//! charged to the sandbox, not to host root; unshare mount, uts, ipc, net, cgroup and pid
//! namespaces (owned by the initial user namespace: sandbox root holds no capability over
//! them, so it can never mount, unmount or reconfigure them); fork (the child is PID 1 of the
//! new pid namespace; this process reports its pid and exits); in the child, still host root:
//! private mounts, a private tmpfs over the run dir (so nothing of the sandbox appears in the
//! host's mount table), the upper disk, the image layers as idmapped mounts (ids 0..65536 on
//! disk appear as the sandbox's range), the overlay, proc, /dev (its own device nodes, never
//! the host's), read-only sys, the sandbox's own cgroup (read-only), caller bind mounts,
//! pivot_root, network sysctls, masked and read-only paths, hostname, loopback, rlimits,
//! oom_score_adj; then into the user namespace (setns, ids 0), `/etc/hosts`, stdio,
//! seccomp (after the last mount, which it forbids; before the capabilities go, so that it
//! needs no `no_new_privs`), capabilities, exec.
//!
//! Invariant: this code runs single-threaded (it is entered first thing in `main`, before any
//! runtime starts), which is what makes `fork` and `setns` into a user namespace sound.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, unshare};
use nix::unistd::{ForkResult, chdir, fork, pivot_root, sethostname};
use rustix::fs::{self as rfs, Mode, OFlags, ResolveFlags};
use rustix::io::Errno;
use serde::{Deserialize, Serialize};
use std::os::fd::OwnedFd;

use super::idmap::IdRange;

/// argv[1] of a setup process.
pub const MARKER: &str = "__opendsec-sandbox-init";

/// Docker's default masked paths, plus the block device trees (the loop devices' backing
/// files name every sandbox on the node), what counts and meters the node's disks (every
/// sandbox has one: how many there are and their I/O is a channel between sandboxes) and the
/// slab allocator's statistics.
pub const DEFAULT_MASKED: &[&str] = &[
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
    "/proc/slabinfo",
    "/sys/block",
    "/sys/class/block",
    "/sys/dev/block",
    "/sys/devices/virtual/block",
    "/proc/diskstats",
    "/proc/partitions",
    "/sys/fs/ext4",
    "/sys/class/bdi",
    "/sys/devices/virtual/bdi",
];

/// Docker's default read-only paths.
pub const DEFAULT_READONLY: &[&str] = &["/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"];

/// Docker's default capabilities minus CAP_MKNOD, CAP_NET_RAW (ping works through ICMP
/// sockets, see [`NET_SYSCTLS`]), CAP_SETFCAP, CAP_SETPCAP and CAP_AUDIT_WRITE. In a user
/// namespace they hold only over the sandbox's own ids and files.
pub const CAPS: &[caps::Capability] = &[
    caps::Capability::CAP_CHOWN,
    caps::Capability::CAP_DAC_OVERRIDE,
    caps::Capability::CAP_FSETID,
    caps::Capability::CAP_FOWNER,
    caps::Capability::CAP_SETGID,
    caps::Capability::CAP_SETUID,
    caps::Capability::CAP_NET_BIND_SERVICE,
    caps::Capability::CAP_SYS_CHROOT,
    caps::Capability::CAP_KILL,
];

/// Per-network-namespace sysctls set for every sandbox: any user may bind ports below 1024
/// (sandbox root holds no capability over its network namespace, which belongs to the initial
/// user namespace) and open ICMP echo sockets (ping without CAP_NET_RAW), as Docker does.
pub const NET_SYSCTLS: &[(&str, &str)] =
    &[("net/ipv4/ip_unprivileged_port_start", "0"), ("net/ipv4/ping_group_range", "0 2147483647")];

/// A host path bound into the sandbox.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bind {
    pub src: PathBuf,
    /// Absolute path inside the sandbox.
    pub dst: PathBuf,
    pub readonly: bool,
    /// A symlink the image has at `dst` is removed first (in the sandbox's own upper layer),
    /// instead of refusing the bind: for files the platform provides, like /etc/resolv.conf.
    #[serde(default)]
    pub replace_link: bool,
}

/// What the setup process is told.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InitConfig {
    pub hostname: String,
    /// Host directory private to this sandbox; covered by a tmpfs inside the mount namespace.
    pub run_dir: PathBuf,
    /// The attached loop device holding the ext4 upper disk.
    pub disk_dev: PathBuf,
    /// Cached layer directories, top layer first.
    pub lower_dirs: Vec<PathBuf>,
    /// Whether the host is pure cgroup v2 (else the v1 hierarchies are mounted).
    pub cgroup_v2: bool,
    pub binds: Vec<Bind>,
    pub masked_paths: Vec<String>,
    pub readonly_paths: Vec<String>,
    /// oom_score_adj of PID 1 (lowered so the sandbox's other processes are killed first; its
    /// children inherit it, so the agent raises theirs).
    pub oom_score_adj: i32,
    pub argv: Vec<String>,
    pub env: Vec<String>,
    /// An inherited fd (the agent's listening socket) handed to PID 1 as fd [`PID1_LISTEN_FD`]:
    /// [`LISTEN_ON_STDIN`] as the edge hands it over.
    #[serde(default)]
    pub listen_fd: Option<i32>,
    /// Give PID 1 (and so every process of the sandbox) its own core scheduling cookie.
    #[serde(default)]
    pub core_sched: bool,
    /// The sandbox's host ids: it runs in a user namespace mapping its ids 0..count onto
    /// them. None: no user namespace (sandbox root is host root; for measurements only).
    #[serde(default)]
    pub id_map: Option<IdRange>,
}

/// The fd number PID 1 finds its inherited listening socket at.
pub const PID1_LISTEN_FD: i32 = 3;
/// [`InitConfig::listen_fd`] when the listening socket is the setup process's stdin (as the
/// edge hands it over: never as an inheritable fd of its own, see `sandbox::start`).
pub const LISTEN_ON_STDIN: i32 = 0;

/// Enters the setup process when argv says so; never returns then. Call it first in `main`.
pub fn run_if_init() {
    let mut args = std::env::args_os();
    let _ = args.next();
    if args.next().as_deref() != Some(std::ffi::OsStr::new(MARKER)) {
        return;
    }
    // Before anything else: leave the edge's session, so no terminal the edge was started
    // from is this sandbox's controlling terminal (TIOCSTI through /dev/tty could otherwise
    // type into the operator's shell), and no signal sent to the edge's process group (a
    // Ctrl-C in that terminal) reaches the sandbox.
    if rustix::process::setsid().is_err() {
        std::process::exit(112);
    }
    // Keep the status socket (stdout: the config comes in on it, the status goes out) away
    // from stdout (which PID 1 points elsewhere) and from fd 3 (PID 1's listening socket),
    // close-on-exec.
    let status = match rustix::io::fcntl_dupfd_cloexec(std::io::stdout(), PID1_LISTEN_FD + 1) {
        Ok(fd) => std::fs::File::from(fd),
        Err(_) => std::process::exit(111),
    };
    let code = match setup(status) {
        Ok(code) => code,
        Err((stage, msg, mut status)) => {
            report(&mut status, format!("ERR {stage}: {msg}"));
            1
        }
    };
    std::process::exit(code);
}

type Fail = (&'static str, String, std::fs::File);

fn setup(mut status: std::fs::File) -> Result<i32, Fail> {
    let mut text = String::new();
    if let Err(e) = (&status).read_to_string(&mut text) {
        return Err(("config", e.to_string(), status));
    }
    let mut cfg: InitConfig = match serde_json::from_str(&text) {
        Ok(c) => c,
        Err(e) => return Err(("config", e.to_string(), status)),
    };
    // A listening socket on stdin moves off it (close-on-exec) before stdin becomes /dev/null.
    if cfg.listen_fd == Some(LISTEN_ON_STDIN) {
        match rustix::io::fcntl_dupfd_cloexec(std::io::stdin(), PID1_LISTEN_FD + 1) {
            // Kept open until PID 1 execs (pass_fds moves it to PID1_LISTEN_FD).
            Ok(fd) => cfg.listen_fd = Some(std::os::fd::IntoRawFd::into_raw_fd(fd)),
            Err(e) => return Err(("fds", format!("listening socket on stdin: {e}"), status)),
        }
    }
    let progs = match super::seccomp::compile() {
        Ok(p) => p,
        Err(e) => return Err(("seccomp", e.to_string(), status)),
    };
    let userns = match cfg.id_map.map(make_userns).transpose() {
        Ok(u) => u,
        Err(e) => return Err(("user namespace", e, status)),
    };
    let flags = CloneFlags::CLONE_NEWNS
        | CloneFlags::CLONE_NEWUTS
        | CloneFlags::CLONE_NEWIPC
        | CloneFlags::CLONE_NEWNET
        | CloneFlags::CLONE_NEWCGROUP
        | CloneFlags::CLONE_NEWPID;
    if let Err(e) = unshare(flags) {
        return Err(("unshare", e.to_string(), status));
    }
    // SAFETY: single-threaded process (see module docs); the child only runs this crate's
    // code and then execs or exits.
    match unsafe { fork() } {
        Err(e) => Err(("fork", e.to_string(), status)),
        Ok(ForkResult::Parent { child }) => {
            report(&mut status, format!("PID {child}"));
            Ok(0)
        }
        Ok(ForkResult::Child) => {
            let (stage, msg) = pid1(&cfg, userns.as_ref(), &progs, &mut status);
            report(&mut status, format!("ERR {stage}: {msg}"));
            // SAFETY: plain process exit, no destructors needed in the forked child.
            unsafe { libc::_exit(1) }
        }
    }
}

/// Writes one status line with a single write: PID 1 and the setup process share the status
/// socket, and a line written in pieces could interleave with the other's (a unix stream
/// socket queues a write this small whole).
fn report(status: &mut std::fs::File, line: String) {
    let mut line = line;
    let mut cut = line.len().min(3000);
    while !line.is_char_boundary(cut) {
        cut -= 1;
    }
    line.truncate(cut);
    line.push('\n');
    let _ = status.write_all(line.as_bytes());
}

fn p(path: &Path) -> String {
    path.display().to_string()
}

fn mnt(
    src: Option<&str>,
    target: &Path,
    fstype: Option<&str>,
    flags: MsFlags,
    data: Option<&str>,
) -> Result<(), String> {
    mount(src, target, fstype, flags, data).map_err(|e| format!("mount {}: {e}", p(target)))
}

fn mkdirs(path: &Path) -> Result<(), String> {
    std::fs::create_dir_all(path).map_err(|e| format!("mkdir {}: {e}", p(path)))
}

/// PID 1's work; returns only on failure.
fn pid1(
    cfg: &InitConfig,
    userns: Option<&OwnedFd>,
    progs: &[seccompiler::BpfProgram],
    status: &mut std::fs::File,
) -> (&'static str, String) {
    macro_rules! step {
        ($stage:literal, $e:expr) => {
            if let Err(e) = $e {
                return ($stage, e.to_string());
            }
        };
    }
    step!("mounts", mnt(None, Path::new("/"), None, MsFlags::MS_REC | MsFlags::MS_PRIVATE, None));
    let run = &cfg.run_dir;
    step!("mounts", mnt(Some("tmpfs"), run, Some("tmpfs"), MsFlags::MS_NOSUID, Some("mode=700,size=64k")));
    let disk = run.join("disk");
    step!("disk", mkdirs(&disk));
    step!("disk", mnt(Some(&p(&cfg.disk_dev)), &disk, Some("ext4"), MsFlags::MS_NODEV, None));
    let (upper, work, root) = (disk.join("upper"), disk.join("work"), run.join("root"));
    for d in [&upper, &work, &root] {
        step!("overlay", mkdirs(d));
    }
    // The upper directory is the sandbox's `/`: its root owns it.
    let owner = cfg.id_map.map_or(0, |r| r.host_first);
    step!("overlay", chown(&upper, owner));
    let lowers: Vec<String> = match userns {
        Some(ns) => match idmapped_lowers(&cfg.lower_dirs, ns, &run.join("l")) {
            Ok(l) => l,
            Err(e) => return ("idmapped layers", e),
        },
        None => cfg.lower_dirs.iter().map(|d| p(d)).collect(),
    };
    // No redirects or metacopy, whatever the kernel's defaults: the upper directory must hold
    // its changes in plain overlay format, which a snapshot copies into a layer.
    let opts = format!(
        "lowerdir={},upperdir={},workdir={},redirect_dir=off,metacopy=off",
        lowers.join(":"),
        p(&upper),
        p(&work)
    );
    step!("overlay", mnt(Some("overlay"), &root, Some("overlay"), MsFlags::MS_NODEV, Some(&opts)));
    // Mount points come from the image: resolve each inside the new root, through no
    // symlink, so a hostile image cannot point a mount (or a created file) at the host.
    let rootfd = match open_root(&root) {
        Ok(fd) => fd,
        Err(e) => return ("overlay", e),
    };
    step!("proc", mount_proc(&rootfd));
    step!("dev", mount_dev(&rootfd, owner));
    step!("sys", mount_sys(&rootfd, cfg.cgroup_v2));
    for b in &cfg.binds {
        step!("binds", bind(&rootfd, b));
    }
    drop(rootfd);
    step!("pivot_root", enter_root(&root));
    step!("sysctls", net_sysctls());
    for m in DEFAULT_MASKED.iter().copied().chain(cfg.masked_paths.iter().map(String::as_str)) {
        step!("masked paths", mask(Path::new(m)));
    }
    for r in DEFAULT_READONLY {
        step!("readonly paths", readonly(Path::new(r), KERNEL_RO));
    }
    // The caller's: read-only, nothing else (programs there still run).
    for r in &cfg.readonly_paths {
        step!("readonly paths", readonly(Path::new(r), MsFlags::empty()));
    }
    step!("hostname", sethostname(&cfg.hostname));
    step!("loopback", loopback_up());
    step!("rlimits", rlimits());
    if cfg.core_sched {
        step!("core scheduling", super::cgroup::core_sched_cookie());
    }
    // Lowering needs CAP_SYS_RESOURCE, which some hosts (our CI's container) withhold from
    // root: then PID 1 keeps the edge's score, a warning goes to the edge, and the agent's
    // raising of its children's scores (always allowed) still ranks them first.
    if let Err(e) = std::fs::write("/proc/self/oom_score_adj", cfg.oom_score_adj.to_string()) {
        if e.kind() == std::io::ErrorKind::PermissionDenied {
            report(status, format!("WARN oom_score_adj: {e}"));
        } else {
            return ("oom_score_adj", e.to_string());
        }
    }
    // Last of the host root's work: from here on this process is the sandbox's root.
    if let Some(ns) = userns {
        step!("user namespace", enter_userns(ns));
    }
    step!("hosts", write_hosts(&cfg.hostname));
    step!("stdio", stdio());
    step!("fds", pass_fds(cfg.listen_fd));
    let argv: Result<Vec<CString>, _> = cfg.argv.iter().map(|a| CString::new(a.as_str())).collect();
    let env: Result<Vec<CString>, _> = cfg.env.iter().map(|a| CString::new(a.as_str())).collect();
    let (argv, env) = match (argv, env) {
        (Ok(a), Ok(e)) if !a.is_empty() => (a, e),
        _ => return ("exec", "argv empty or with NUL bytes".into()),
    };
    // While CAP_SYS_ADMIN is still held (in the sandbox's user namespace): a filter installed
    // so needs no `no_new_privs`, and setuid programs inside keep working (Docker's way).
    // Without a user namespace a setuid program would be the host's root: then
    // `no_new_privs` is set and setuid programs gain nothing.
    if userns.is_none() {
        step!("no_new_privs", rustix::thread::set_no_new_privs(true).map_err(std::io::Error::from));
    }
    step!("seccomp", super::seccomp::install(progs));
    step!("capabilities", drop_caps());
    match nix::unistd::execve(&argv[0], &argv, &env) {
        Err(e) => ("exec", format!("{}: {e}", cfg.argv[0])),
        Ok(never) => match never {},
    }
}

fn mount_proc(root: &OwnedFd) -> Result<(), String> {
    let t = in_root(root, Path::new("proc"), Kind::Dir)?;
    let f = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mnt(Some("proc"), &fd_path(&t), Some("proc"), f, None)
}

/// The sandbox's `/dev`: a tmpfs owned by its root (host id `owner`) holding device nodes of
/// its own. No host node is bound in: a bind would share the host's inode (its owner and
/// mode), and the host's `/dev/tty` is whatever terminal the edge runs on. The nodes are made
/// by host root on a tmpfs of the initial user namespace (so they open); the device cgroup
/// allows only these.
fn mount_dev(root: &OwnedFd, owner: u32) -> Result<(), String> {
    let mp = in_root(root, Path::new("dev"), Kind::Dir)?;
    mnt(
        Some("tmpfs"),
        &fd_path(&mp),
        Some("tmpfs"),
        MsFlags::MS_NOSUID,
        Some(&format!("mode=755,size=64k,uid={owner},gid={owner}")),
    )?;
    // The fresh tmpfs holds nothing of the image: plain paths below it are safe.
    let dev = reopen(root, "dev")?;
    for (n, major, minor) in super::cgroup::DEVICES {
        let t = dev.join(n);
        rfs::mknodat(
            rfs::CWD,
            &t,
            rfs::FileType::CharacterDevice,
            Mode::from_raw_mode(0o666),
            rfs::makedev(*major, *minor),
        )
        .map_err(|e| format!("mknod {}: {e}", p(&t)))?;
        // mknod's mode went through the umask.
        rfs::chmod(&t, Mode::from_raw_mode(0o666)).map_err(|e| format!("chmod {}: {e}", p(&t)))?;
        chown(&t, owner)?;
    }
    let pts = dev.join("pts");
    mkdirs(&pts)?;
    mnt(
        Some("devpts"),
        &pts,
        Some("devpts"),
        MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC,
        Some("newinstance,ptmxmode=0666,mode=0620"),
    )?;
    let shm = dev.join("shm");
    mkdirs(&shm)?;
    mnt(
        Some("shm"),
        &shm,
        Some("tmpfs"),
        MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some(&format!("mode=1777,size=65536k,uid={owner},gid={owner}")),
    )?;
    for (link, to) in [
        ("ptmx", "pts/ptmx"),
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ] {
        std::os::unix::fs::symlink(to, dev.join(link)).map_err(|e| format!("symlink {link}: {e}"))?;
    }
    Ok(())
}

fn mount_sys(root: &OwnedFd, v2: bool) -> Result<(), String> {
    let mp = in_root(root, Path::new("sys"), Kind::Dir)?;
    let ro = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC | MsFlags::MS_RDONLY;
    mnt(Some("sysfs"), &fd_path(&mp), Some("sysfs"), ro, None)?;
    // sysfs is the kernel's: plain paths below it are safe.
    let sys = reopen(root, "sys")?;
    let cg = sys.join("fs/cgroup");
    if v2 {
        return mnt(Some("cgroup2"), &cg, Some("cgroup2"), ro, None);
    }
    // v1: a tmpfs holding one read-only mount per hierarchy, each showing only this sandbox's
    // cgroup (the cgroup namespace roots them there).
    mnt(Some("tmpfs"), &cg, Some("tmpfs"), MsFlags::MS_NOSUID | MsFlags::MS_NODEV, Some("mode=755,size=64k"))?;
    let own = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| format!("read /proc/self/cgroup: {e}"))?;
    for (ctrls, _) in super::cgroup::parse_proc_cgroup(&own) {
        if ctrls.is_empty() || ctrls.iter().all(|c| c.starts_with("name=")) {
            continue;
        }
        let joined = ctrls.join(",");
        let t = cg.join(&joined);
        mkdirs(&t)?;
        mnt(Some("cgroup"), &t, Some("cgroup"), ro, Some(&joined))?;
    }
    mnt(
        None,
        &cg,
        None,
        MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
        Some("mode=755"),
    )
}

fn bind(root: &OwnedFd, b: &Bind) -> Result<(), String> {
    let rel = b.dst.strip_prefix("/").map_err(|_| format!("bind target {} is not absolute", p(&b.dst)))?;
    let kind = if b.src.is_dir() { Kind::Dir } else { Kind::File };
    if b.replace_link
        && let (Some(parent), Some(name)) = (rel.parent(), rel.file_name())
    {
        let dir = in_root(root, parent, Kind::Dir)?;
        if let Ok(st) = rfs::statat(&dir, name, rfs::AtFlags::SYMLINK_NOFOLLOW)
            && rfs::FileType::from_raw_mode(st.st_mode) == rfs::FileType::Symlink
        {
            rfs::unlinkat(&dir, name, rfs::AtFlags::empty()).map_err(|e| format!("unlink {}: {e}", p(&b.dst)))?;
        }
    }
    let t = in_root(root, rel, kind)?;
    mnt(Some(&p(&b.src)), &fd_path(&t), None, MsFlags::MS_BIND | MsFlags::MS_REC, None)?;
    if b.readonly {
        // The fd still names the covered mount point: open the new mount's root to remount it.
        let top = in_root(root, rel, kind)?;
        mnt(
            None,
            &fd_path(&top),
            None,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV,
            None,
        )?;
    }
    Ok(())
}

/// What a mount point must be.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Dir,
    File,
}

/// Resolution of every image path here: one component at a time, never through a symlink.
const NO_LINKS: ResolveFlags =
    ResolveFlags::BENEATH.union(ResolveFlags::NO_SYMLINKS).union(ResolveFlags::NO_MAGICLINKS);

fn open_root(root: &Path) -> Result<OwnedFd, String> {
    rfs::open(root, OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
        .map_err(|e| format!("open {}: {e}", p(root)))
}

fn reopen(root: &OwnedFd, name: &str) -> Result<PathBuf, String> {
    // Only for kernel file systems just mounted there: resolve the mount point once more.
    let fd = in_root(root, Path::new(name), Kind::Dir)?;
    let real = std::fs::read_link(fd_path(&fd)).map_err(|e| format!("readlink {name}: {e}"))?;
    Ok(real)
}

fn fd_path(fd: &OwnedFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// Opens `rel` below `root` as an `O_PATH` fd, creating missing directories (and the final
/// file for [`Kind::File`]); refuses symlinks, `..` and a final entry of the wrong type.
fn in_root(root: &OwnedFd, rel: &Path, kind: Kind) -> Result<OwnedFd, String> {
    let comps: Vec<&std::ffi::OsStr> = rel
        .components()
        .map(|c| match c {
            std::path::Component::Normal(n) => Ok(n),
            _ => Err(format!("mount point {} must be a plain path", p(rel))),
        })
        .collect::<Result<_, _>>()?;
    let shown = || format!("/{}", p(rel));
    let mut cur = rustix::io::dup(root).map_err(|e| format!("dup: {e}"))?;
    for (i, c) in comps.iter().enumerate() {
        let last = i + 1 == comps.len();
        let want_dir = !last || kind == Kind::Dir;
        let open = |dir: &OwnedFd| rfs::openat2(dir, *c, OFlags::PATH | OFlags::CLOEXEC, Mode::empty(), NO_LINKS);
        let fd = match open(&cur) {
            Ok(fd) => fd,
            Err(Errno::NOENT) => {
                if want_dir {
                    rfs::mkdirat(&cur, *c, Mode::from_raw_mode(0o755))
                        .map_err(|e| format!("mkdir {}: {e}", shown()))?;
                } else {
                    let flags = OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                    drop(
                        rfs::openat(&cur, *c, flags, Mode::from_raw_mode(0o644))
                            .map_err(|e| format!("create {}: {e}", shown()))?,
                    );
                }
                open(&cur).map_err(|e| format!("open {}: {e}", shown()))?
            }
            Err(Errno::LOOP | Errno::XDEV) => return Err(format!("{} is a symlink in the image; refused", shown())),
            Err(e) => return Err(format!("open {}: {e}", shown())),
        };
        let st = rfs::fstat(&fd).map_err(|e| format!("stat {}: {e}", shown()))?;
        let ft = rfs::FileType::from_raw_mode(st.st_mode);
        let ok = if want_dir { ft == rfs::FileType::Directory } else { ft == rfs::FileType::RegularFile };
        if !ok {
            let what = if ft == rfs::FileType::Symlink { "a symlink" } else { "of the wrong type" };
            return Err(format!("{} is {what} in the image; refused", shown()));
        }
        cur = fd;
    }
    Ok(cur)
}

fn enter_root(root: &Path) -> Result<(), String> {
    chdir(root).map_err(|e| format!("chdir {}: {e}", p(root)))?;
    // pivot_root(".", "."): the old root ends up stacked under the new one, then is detached.
    pivot_root(".", ".").map_err(|e| format!("pivot_root: {e}"))?;
    umount2(".", MntFlags::MNT_DETACH).map_err(|e| format!("detach old root: {e}"))?;
    chdir("/").map_err(|e| format!("chdir /: {e}"))
}

fn mask(path: &Path) -> Result<(), String> {
    match std::fs::metadata(path) {
        Err(_) => Ok(()), // absent on this kernel: nothing to hide
        Ok(m) if m.is_dir() => mnt(Some("tmpfs"), path, Some("tmpfs"), MsFlags::MS_RDONLY, Some("size=0")),
        Ok(_) => mnt(Some("/dev/null"), path, None, MsFlags::MS_BIND, None),
    }
}

/// Extra flags of Docker's read-only kernel paths.
const KERNEL_RO: MsFlags = MsFlags::MS_NOSUID.union(MsFlags::MS_NODEV).union(MsFlags::MS_NOEXEC);

fn readonly(path: &Path, extra: MsFlags) -> Result<(), String> {
    if std::fs::symlink_metadata(path).is_err() {
        return Ok(());
    }
    mnt(Some(&p(path)), path, None, MsFlags::MS_BIND | MsFlags::MS_REC, None)?;
    mnt(None, path, None, MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | extra, None)
}

/// Brings `lo` up in the sandbox's new network namespace (it starts down), so programs inside
/// reach their own servers on 127.0.0.1 (the agent's HTTP calls do).
fn loopback_up() -> Result<(), String> {
    // SAFETY: a datagram socket for interface ioctls; ifreq is plain data sized by libc, its
    // name NUL-terminated within IFNAMSIZ.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(format!("socket: {}", std::io::Error::last_os_error()));
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        for (i, b) in b"lo\0".iter().enumerate() {
            req.ifr_name[i] = *b as libc::c_char;
        }
        let mut r = libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req);
        if r == 0 {
            req.ifr_ifru.ifru_flags |= (libc::IFF_UP | libc::IFF_RUNNING) as libc::c_short;
            r = libc::ioctl(fd, libc::SIOCSIFFLAGS, &req);
        }
        let err = std::io::Error::last_os_error();
        libc::close(fd);
        if r < 0 {
            return Err(format!("lo up: {err}"));
        }
    }
    Ok(())
}

/// `/etc/hosts` naming localhost and the sandbox's hostname (as Docker writes it), when the
/// image has an `/etc`. Runs after pivot_root: every path is the sandbox's own.
fn write_hosts(hostname: &str) -> Result<(), String> {
    if !Path::new("/etc").is_dir() {
        return Ok(());
    }
    let text = format!("127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{hostname}\n");
    // Replace, never write through: the image's /etc/hosts may be a symlink or special file.
    let _ = std::fs::remove_file("/etc/hosts");
    std::fs::write("/etc/hosts", text).map_err(|e| format!("/etc/hosts: {e}"))
}

/// Open files: Docker's default (1,048,576), within the kernel's `nr_open`. Raising the hard
/// limit needs CAP_SYS_RESOURCE, which some hosts withhold from root: then the soft limit rises
/// to the hard one.
fn rlimits() -> Result<(), String> {
    let cap = std::fs::read_to_string("/proc/sys/fs/nr_open")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok())
        .unwrap_or(1 << 20)
        .min(1 << 20);
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    if setrlimit(Resource::Nofile, Rlimit { current: Some(cap), maximum: Some(cap) }).is_ok() {
        return Ok(());
    }
    let cur = getrlimit(Resource::Nofile);
    setrlimit(Resource::Nofile, Rlimit { current: cur.maximum, ..cur }).map_err(|e| format!("RLIMIT_NOFILE: {e}"))
}

/// stdin from /dev/null; stdout joins stderr (which the parent pointed at the sandbox log).
fn stdio() -> Result<(), String> {
    let null = std::fs::File::open("/dev/null").map_err(|e| format!("open /dev/null: {e}"))?;
    rustix::stdio::dup2_stdin(&null).map_err(|e| format!("dup2: {e}"))?;
    rustix::stdio::dup2_stdout(rustix::stdio::stderr()).map_err(|e| format!("dup2: {e}"))
}

/// Moves the inherited listening socket to [`PID1_LISTEN_FD`] (kept across exec) and marks
/// every other fd above stderr close-on-exec, so nothing of the edge leaks into the sandbox.
fn pass_fds(listen: Option<i32>) -> Result<(), String> {
    let first_other = match listen {
        Some(fd) => {
            // SAFETY: dup2/fcntl on fd numbers this process owns.
            unsafe {
                if fd != PID1_LISTEN_FD && libc::dup2(fd, PID1_LISTEN_FD) < 0 {
                    return Err(format!("dup2 listen fd: {}", std::io::Error::last_os_error()));
                }
                if libc::fcntl(PID1_LISTEN_FD, libc::F_SETFD, 0) < 0 {
                    return Err(format!("fcntl listen fd: {}", std::io::Error::last_os_error()));
                }
            }
            PID1_LISTEN_FD as u32 + 1
        }
        None => 3,
    };
    // SAFETY: close_range with CLOSE_RANGE_CLOEXEC only sets flags on fds of this process.
    let r = unsafe { libc::syscall(libc::SYS_close_range, first_other, u32::MAX, libc::CLOSE_RANGE_CLOEXEC) };
    if r < 0 {
        return Err(format!("close_range: {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

fn chown(path: &Path, id: u32) -> Result<(), String> {
    let (u, g) = (Some(rustix::process::Uid::from_raw(id)), Some(rustix::process::Gid::from_raw(id)));
    rfs::chown(path, u, g).map_err(|e| format!("chown {}: {e}", p(path)))
}

fn errno_str() -> String {
    std::io::Error::last_os_error().to_string()
}

/// Makes the sandbox's user namespace, mapping ids 0..count onto `range`, and returns an fd
/// naming it. A forked helper takes the range's first host id as its own (so the namespace
/// is owned by it: per-user limits of everything inside are charged to that id at the host
/// level), unshares, and waits until this process has written its maps and opened the
/// namespace; then it exits and the fd keeps the namespace.
fn make_userns(range: IdRange) -> Result<OwnedFd, String> {
    let (ready_r, ready_w) = nix::unistd::pipe().map_err(|e| format!("pipe: {e}"))?;
    let (done_r, done_w) = nix::unistd::pipe().map_err(|e| format!("pipe: {e}"))?;
    // SAFETY: single-threaded process (module invariant); the child only makes plain
    // syscalls and exits.
    match unsafe { fork() } {
        Err(e) => Err(format!("fork: {e}")),
        Ok(ForkResult::Child) => {
            drop((ready_r, done_w));
            let id = range.host_first;
            let (uid, gid) = (rustix::process::Uid::from_raw(id), rustix::process::Gid::from_raw(id));
            let ok = rustix::thread::set_thread_groups(&[]).is_ok()
                && rustix::thread::set_thread_res_gid(gid, gid, gid).is_ok()
                && rustix::thread::set_thread_res_uid(uid, uid, uid).is_ok()
                // SAFETY: only a new user namespace: the fd table is not unshared.
                && unsafe { rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWUSER) }.is_ok();
            let _ = rustix::io::write(&ready_w, if ok { b"1" } else { b"0" });
            let mut b = [0u8; 1];
            let _ = rustix::io::read(&done_r, &mut b);
            // SAFETY: plain exit of the forked helper.
            unsafe { libc::_exit(0) }
        }
        Ok(ForkResult::Parent { child }) => {
            drop((ready_w, done_r));
            let mut b = [0u8; 1];
            let got = rustix::io::read(&ready_r, &mut b).map_err(|e| format!("helper: {e}"));
            let made = match got {
                Ok(1) if b[0] == b'1' => map_and_open(child.as_raw(), range),
                Ok(_) => Err("the helper could not take the range's ids or unshare".into()),
                Err(e) => Err(e),
            };
            drop(done_w);
            let _ = nix::sys::wait::waitpid(child, None);
            made
        }
    }
}

fn map_and_open(pid: i32, range: IdRange) -> Result<OwnedFd, String> {
    for f in ["uid_map", "gid_map"] {
        let path = format!("/proc/{pid}/{f}");
        std::fs::write(&path, range.map_line()).map_err(|e| format!("write {path}: {e}"))?;
    }
    let ns = format!("/proc/{pid}/ns/user");
    rfs::open(&ns, OFlags::RDONLY | OFlags::CLOEXEC, Mode::empty()).map_err(|e| format!("open {ns}: {e}"))
}

/// `struct mount_attr` of `<linux/mount.h>`.
#[repr(C)]
struct MountAttr {
    attr_set: u64,
    attr_clr: u64,
    propagation: u64,
    userns_fd: u64,
}

const MOUNT_ATTR_RDONLY: u64 = 0x1;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_IDMAP: u64 = 0x0010_0000;

/// Each lower directory as a read-only mount idmapped through `userns`, attached at
/// `<dir>/<i>` (inside the private run tmpfs, so never in the host's mount table); returns
/// the mount points, in the order given. The layer cache stays as it was imported (ids as in
/// the image) and is shared by every sandbox, whatever its range.
fn idmapped_lowers(lowers: &[PathBuf], userns: &OwnedFd, dir: &Path) -> Result<Vec<String>, String> {
    use rustix::mount::{MoveMountFlags, OpenTreeFlags, move_mount, open_tree};
    mkdirs(dir)?;
    let mut out = Vec::with_capacity(lowers.len());
    for (i, l) in lowers.iter().enumerate() {
        let tree = open_tree(rfs::CWD, l, OpenTreeFlags::OPEN_TREE_CLONE | OpenTreeFlags::OPEN_TREE_CLOEXEC)
            .map_err(|e| format!("open_tree {}: {e}", p(l)))?;
        let attr = MountAttr {
            attr_set: MOUNT_ATTR_IDMAP | MOUNT_ATTR_RDONLY | MOUNT_ATTR_NODEV,
            attr_clr: 0,
            propagation: 0,
            userns_fd: userns.as_raw_fd() as u64,
        };
        // SAFETY: mount_setattr reads one `struct mount_attr` of the size given, which `attr`
        // is (repr(C), the kernel's layout), alive for the call; the path is a NUL-terminated
        // empty string with AT_EMPTY_PATH, so the fd itself is changed.
        let r = unsafe {
            libc::syscall(
                libc::SYS_mount_setattr,
                tree.as_raw_fd(),
                c"".as_ptr(),
                libc::AT_EMPTY_PATH,
                &attr as *const MountAttr,
                std::mem::size_of::<MountAttr>(),
            )
        };
        if r != 0 {
            return Err(format!("mount_setattr {}: {}", p(l), errno_str()));
        }
        let at = dir.join(i.to_string());
        mkdirs(&at)?;
        move_mount(&tree, "", rfs::CWD, &at, MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH)
            .map_err(|e| format!("move_mount {}: {e}", p(&at)))?;
        out.push(p(&at));
    }
    Ok(out)
}

/// The sandbox's own network sysctls ([`NET_SYSCTLS`]); a kernel without one skips it.
fn net_sysctls() -> Result<(), String> {
    for (k, v) in NET_SYSCTLS {
        let path = Path::new("/proc/sys").join(k);
        match std::fs::write(&path, v) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("{}: {e}", p(&path))),
        }
    }
    Ok(())
}

/// Joins the sandbox's user namespace and becomes its root (ids 0, no supplementary groups).
/// The capabilities that setns grants in the namespace are cut down by [`drop_caps`] next.
fn enter_userns(ns: &OwnedFd) -> Result<(), String> {
    // The process is single-threaded and shares no fs_struct, as setns into a user namespace
    // requires; the id calls then change the one thread, the whole process.
    use std::os::fd::AsFd;
    rustix::thread::move_into_link_name_space(ns.as_fd(), Some(rustix::thread::LinkNameSpaceType::User))
        .map_err(|e| format!("setns: {e}"))?;
    rustix::thread::set_thread_groups(&[]).map_err(|e| format!("setgroups: {e}"))?;
    let (uid, gid) = (rustix::process::Uid::ROOT, rustix::process::Gid::ROOT);
    rustix::thread::set_thread_res_gid(gid, gid, gid).map_err(|e| format!("setresgid: {e}"))?;
    rustix::thread::set_thread_res_uid(uid, uid, uid).map_err(|e| format!("setresuid: {e}"))
}

fn drop_caps() -> Result<(), String> {
    let keep: caps::CapsHashSet = CAPS.iter().copied().collect();
    let e = |e: caps::errors::CapsError| e.to_string();
    for c in caps::all() {
        if !keep.contains(&c) {
            caps::drop(None, caps::CapSet::Bounding, c).map_err(e)?;
        }
    }
    caps::clear(None, caps::CapSet::Ambient).map_err(e)?;
    caps::clear(None, caps::CapSet::Inheritable).map_err(e)?;
    caps::set(None, caps::CapSet::Effective, &keep).map_err(e)?;
    caps::set(None, caps::CapSet::Permitted, &keep).map_err(e)?;
    Ok(())
}

/// What the setup process reported on success.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Started {
    /// Host pid of the sandbox's PID 1.
    pub pid: i32,
    /// Steps skipped because the host does not allow them (e.g. lowering oom_score_adj).
    pub warnings: Vec<String>,
}

/// Reads the status pipe to EOF and interprets it: the sandbox PID 1's host pid, or the
/// setup error.
pub fn read_status(mut pipe: impl Read) -> Result<Started, String> {
    let mut text = String::new();
    pipe.read_to_string(&mut text).map_err(|e| format!("status pipe: {e}"))?;
    parse_status(&text)
}

/// Pure part of [`read_status`].
pub fn parse_status(text: &str) -> Result<Started, String> {
    let mut pid = None;
    let mut warnings = Vec::new();
    for line in text.lines() {
        if let Some(w) = line.strip_prefix("WARN ") {
            warnings.push(w.to_owned());
        }
        if let Some(err) = line.strip_prefix("ERR ") {
            return Err(err.to_owned());
        }
        if let Some(n) = line.strip_prefix("PID ") {
            pid = n.trim().parse::<i32>().ok();
        }
    }
    match pid {
        Some(pid) => Ok(Started { pid, warnings }),
        None => Err(format!("setup process ended without reporting: {text:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines() {
        assert_eq!(parse_status("PID 42\n"), Ok(Started { pid: 42, warnings: vec![] }));
        assert_eq!(
            parse_status("PID 7\nWARN oom_score_adj: EACCES\n").map(|s| s.warnings),
            Ok(vec!["oom_score_adj: EACCES".to_string()])
        );
        assert_eq!(parse_status("PID 42\nERR disk: mount: EINVAL\n"), Err("disk: mount: EINVAL".into()));
        assert!(parse_status("").is_err());
    }
}
