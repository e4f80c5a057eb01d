//! aether as PID 1 of a microVM or full VM (`opendsec-agent vm-init`, run by the kernel as
//! the initramfs's `/init`): loads the kernel modules the guest needs, reads the sandbox's
//! configuration from the config disk, assembles the root file system (the image disk, read
//! only, under an overlay whose upper layer is on the writable disk), moves into it, and then
//! serves the same Runtime API as in a container, over a virtio-serial port ([`serial`]).
//!
//! The disks are told apart by their virtio-blk serial numbers, never by their order:
//! `config` (raw: a little-endian u32 length, then the JSON of [`VmConfig`]), `image` (EROFS)
//! and `disk` (ext4). The kernel command line names the bus the modules are for
//! (`opendsec.bus=mmio|pci`).

use std::ffi::CString;
use std::io::{Read, Seek};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::mount::{MountFlags, mount, mount_move};
use serde::{Deserialize, Serialize};

/// The serial port the agent is served on.
pub const PORT_NAME: &str = opendsec_proto::serial::AGENT_PORT;
/// What a probe boot prints once the guest runs its init (`opendsec.probe` on the command line).
pub const PROBE_OK: &str = "OPENDSEC-PROBE-OK";
/// Largest configuration the config disk may hold.
const MAX_CONFIG_BYTES: u32 = 1 << 20;
/// How long the disks may take to appear after the modules are loaded.
const DISK_WAIT: Duration = Duration::from_secs(30);

/// What the edge tells the guest through the config disk.
#[derive(Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct VmConfig {
    pub sandbox_id: String,
    pub hostname: String,
    /// The image's variables, then the spec's.
    pub env: Vec<(String, String)>,
    pub user: String,
    pub workdir: String,
    pub session_bytes: u64,
    /// The VM has a NIC (`opendsec_proto::vmnet`): configure it.
    pub network: bool,
    /// The image's own init is PID 1 (systemd), the agent a service of it ([`boot_image_init`]).
    pub full_init: bool,
    /// The image disk is the VM's virtio-pmem device (a full VM), mounted with DAX: the guest
    /// reads the host's page cache instead of keeping a copy.
    pub image_pmem: bool,
}

impl VmConfig {
    /// Parses the config disk's contents: a little-endian u32 length, then that much JSON.
    pub fn parse(raw: &[u8]) -> Result<VmConfig, String> {
        let len = raw.get(..4).ok_or("the config disk is shorter than its header")?;
        let len = u32::from_le_bytes([len[0], len[1], len[2], len[3]]);
        if len > MAX_CONFIG_BYTES {
            return Err(format!("the config is {len} bytes, more than {MAX_CONFIG_BYTES}"));
        }
        let body = raw.get(4..4 + len as usize).ok_or("the config disk is shorter than its config")?;
        serde_json::from_slice(body).map_err(|e| format!("the config is not valid: {e}"))
    }
}

fn err(what: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::other(what.to_string())
}

fn ctx<T>(r: rustix::io::Result<T>, what: &str) -> std::io::Result<T> {
    r.map_err(|e| err(format!("{what}: {e}")))
}

/// Where the agent runs from in a VM: a tmpfs of the guest's own (the initramfs it came from
/// is out of reach once the root moved).
pub const EXE: &str = "/run/opendsec-agent/bin/opendsec-agent";
/// aether's state directory in a VM.
pub const STATE_DIR: &str = "/run/opendsec-agent";

/// `vm-init`: assembles the root, then becomes aether (same PID 1) serving on the port, or
/// with `full_init` the image's own init.
pub fn main() -> std::io::Error {
    let config = match assemble(Path::new(EXE)) {
        Ok(c) => c,
        Err(e) => return e,
    };
    if !config.sandbox_id.is_empty() {
        let id_file = Path::new(crate::aether::IDENTITY_FILE);
        if let Some(dir) = id_file.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        if let Err(e) = std::fs::write(id_file, &config.sandbox_id) {
            return e;
        }
    }
    if config.full_init {
        return boot_image_init(&config);
    }
    exec_aether(&config)
}

/// Where a full-init guest's agent service finds its configuration (root's alone).
const SERVICE_CONFIG: &str = "/run/opendsec-agent/vm.json";
/// The agent's systemd unit, in /run (the guest's own tmpfs, kept by systemd).
const UNIT: &str = "/run/systemd/system/opendsec-agent.service";
const UNIT_TEXT: &str = "[Unit]
Description=opendsec agent (the sandbox's Runtime API on its serial port)
DefaultDependencies=no
[Service]
ExecStart=/run/opendsec-agent/bin/opendsec-agent vm-agent
Restart=always
RestartSec=1
";

/// `full_init`: the agent becomes a systemd service (its unit in /run, wanted by sysinit so it
/// answers early in the boot; restarted if it dies), and the image's own `/sbin/init` becomes
/// PID 1. Only systemd is supported: an image whose init is anything else fails here, with the
/// reason on the console.
fn boot_image_init(config: &VmConfig) -> std::io::Error {
    let init = Path::new("/sbin/init");
    let systemd = std::fs::canonicalize(init).ok().is_some_and(|p| p.ends_with("systemd"));
    if !systemd {
        return err("full_init: the image's /sbin/init is not systemd (the only init the agent can be a service of)");
    }
    let written = (|| -> std::io::Result<()> {
        let json = serde_json::to_vec(config).map_err(err)?;
        std::fs::write(SERVICE_CONFIG, json)?;
        std::fs::set_permissions(SERVICE_CONFIG, std::os::unix::fs::PermissionsExt::from_mode(0o600))?;
        let wants = Path::new("/run/systemd/system/sysinit.target.wants");
        std::fs::create_dir_all(wants)?;
        std::fs::write(UNIT, UNIT_TEXT)?;
        std::os::unix::fs::symlink(UNIT, wants.join("opendsec-agent.service"))?;
        // systemd names the machine from /etc/hostname: the sandbox's. Replaced, never written
        // through.
        if !config.hostname.is_empty() && Path::new("/etc").is_dir() {
            let _ = std::fs::remove_file("/etc/hostname");
            std::fs::write("/etc/hostname", format!("{}\n", config.hostname))?;
        }
        Ok(())
    })();
    if let Err(e) = written {
        return e;
    }
    use std::os::unix::process::CommandExt;
    std::process::Command::new(init).env_clear().exec()
}

/// `vm-agent`: the agent as a full-init guest's service: aether, configured as vm-init would.
pub fn service() -> std::io::Error {
    let config = match std::fs::read(SERVICE_CONFIG).map_err(err).and_then(|b| serde_json::from_slice(&b).map_err(err))
    {
        Ok(c) => c,
        Err(e) => return e,
    };
    exec_aether(&config)
}

/// Execs aether, serving on the port, with the sandbox's configuration.
fn exec_aether(config: &VmConfig) -> std::io::Error {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(EXE);
    cmd.arg("aether")
        .args(["--serial", &format!("/dev/virtio-ports/{PORT_NAME}")])
        .args(["--state-dir", STATE_DIR])
        .args(["--user", &config.user])
        .args(["--workdir", &config.workdir])
        .env_clear()
        .envs(config.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    if config.session_bytes > 0 {
        cmd.args(["--session-bytes", &config.session_bytes.to_string()]);
    }
    cmd.exec()
}

/// Everything before the agent serves: returns its configuration, with the process moved
/// into the sandbox's root file system and the agent binary copied to `exe` there.
pub fn assemble(exe: &Path) -> std::io::Result<VmConfig> {
    let started = Instant::now();
    for (src, dst, fs) in [("devtmpfs", "/dev", "devtmpfs"), ("proc", "/proc", "proc"), ("sysfs", "/sys", "sysfs")] {
        std::fs::create_dir_all(dst)?;
        ctx(mount(src, dst, fs, MountFlags::NOSUID, None), &format!("mounting {dst}"))?;
    }
    let cmdline = std::fs::read_to_string("/proc/cmdline")?;
    if cmdline.split_whitespace().any(|w| w == "opendsec.probe") {
        // The edge's check that this host's accelerator boots a guest: it got this far.
        println!("{PROBE_OK}");
        let _ = rustix::system::reboot(rustix::system::RebootCommand::PowerOff);
    }
    let bus = cmdline
        .split_whitespace()
        .find_map(|w| w.strip_prefix("opendsec.bus="))
        .filter(|b| matches!(*b, "mmio" | "pci"))
        .ok_or_else(|| err("the kernel command line names no opendsec.bus=mmio|pci"))?;
    load_modules(Path::new("/modules"), &format!("{bus}.order"))?;

    let config = read_config(&wait_for_disk("config")?)?;
    let image = if config.image_pmem { wait_for_pmem()? } else { wait_for_disk("image")? };
    let disk = wait_for_disk("disk")?;
    for d in ["/mnt/image", "/mnt/disk", "/newroot"] {
        std::fs::create_dir_all(d)?;
    }
    let dax = config.image_pmem.then_some(c"dax");
    ctx(mount(&image, "/mnt/image", "erofs", MountFlags::RDONLY, dax), "mounting the image disk")?;
    ctx(mount(&disk, "/mnt/disk", "ext4", MountFlags::empty(), None), "mounting the writable disk")?;
    for d in ["/mnt/disk/upper", "/mnt/disk/work"] {
        std::fs::create_dir_all(d)?;
    }
    let opts = CString::new("lowerdir=/mnt/image,upperdir=/mnt/disk/upper,workdir=/mnt/disk/work").map_err(err)?;
    ctx(mount("overlay", "/newroot", "overlay", MountFlags::empty(), opts.as_c_str()), "mounting the root")?;
    for (src, dst, fs, flags) in [
        ("proc", "/newroot/proc", "proc", MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC),
        ("sysfs", "/newroot/sys", "sysfs", MountFlags::NOSUID | MountFlags::NODEV | MountFlags::NOEXEC),
        ("devtmpfs", "/newroot/dev", "devtmpfs", MountFlags::NOSUID),
        ("tmpfs", "/newroot/run", "tmpfs", MountFlags::NOSUID | MountFlags::NODEV),
    ] {
        std::fs::create_dir_all(dst)?;
        ctx(mount(src, dst, fs, flags, None), &format!("mounting {dst}"))?;
    }
    // No udev here: the port's name is given its usual link by hand.
    let port = wait_for_port(PORT_NAME)?;
    std::fs::create_dir_all("/newroot/dev/virtio-ports")?;
    std::os::unix::fs::symlink(Path::new("..").join(&port), format!("/newroot/dev/virtio-ports/{PORT_NAME}"))?;
    std::fs::create_dir_all("/newroot/dev/pts")?;
    ctx(
        mount("devpts", "/newroot/dev/pts", "devpts", MountFlags::NOSUID | MountFlags::NOEXEC, None),
        "mounting /dev/pts",
    )?;
    let inside = Path::new("/newroot").join(exe.strip_prefix("/").unwrap_or(exe));
    if let Some(dir) = inside.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::copy("/init", &inside)?;

    // The switch: the new root over the initramfs (which stays, unreachable, in memory).
    std::env::set_current_dir("/newroot")?;
    ctx(mount_move(".", "/"), "moving the root")?;
    ctx(rustix::process::chroot("."), "chroot")?;
    std::env::set_current_dir("/")?;
    if !config.hostname.is_empty() {
        ctx(rustix::system::sethostname(config.hostname.as_bytes()), "sethostname")?;
    }
    ctx(
        mount("tmpfs", "/tmp", "tmpfs", MountFlags::NOSUID | MountFlags::NODEV, None).or_else(|e| {
            // An image without /tmp gets one on its disk.
            if e == rustix::io::Errno::NOENT {
                std::fs::create_dir_all("/tmp").map_err(|_| e)?;
                mount("tmpfs", "/tmp", "tmpfs", MountFlags::NOSUID | MountFlags::NODEV, None)
            } else {
                Err(e)
            }
        }),
        "mounting /tmp",
    )?;
    crate::vmnet::loopback()?;
    if config.network {
        crate::vmnet::nic()?;
        // The gateway answers names (the edge's DNS proxy behind it). Replaced, never written
        // through: it may be a symlink in the image.
        if Path::new("/etc").is_dir() {
            let _ = std::fs::remove_file("/etc/resolv.conf");
            std::fs::write(
                "/etc/resolv.conf",
                format!("nameserver {}\noptions edns0\n", opendsec_proto::vmnet::GATEWAY_ADDR),
            )?;
        }
    }
    eprintln!("opendsec-agent vm-init: root assembled in {} ms", started.elapsed().as_millis());
    Ok(config)
}

/// Loads the modules `order` lists (file names under `dir`, one per line), in order. A module
/// the kernel has already, or that finds no device (crc32c-intel on a CPU without SSE4.2), is
/// no failure.
fn load_modules(dir: &Path, order: &str) -> std::io::Result<()> {
    let list = std::fs::read_to_string(dir.join(order))?;
    for name in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let f = std::fs::File::open(dir.join(name))?;
        match rustix::system::finit_module(&f, c"", 0) {
            Ok(()) | Err(rustix::io::Errno::EXIST) | Err(rustix::io::Errno::NODEV) => {}
            Err(e) => return Err(err(format!("loading module {name}: {e}"))),
        }
    }
    Ok(())
}

/// The block device whose virtio serial number is `serial`, once it appears.
fn wait_for_disk(serial: &str) -> std::io::Result<PathBuf> {
    let deadline = Instant::now() + DISK_WAIT;
    loop {
        if let Ok(dir) = std::fs::read_dir("/sys/block") {
            for e in dir.flatten() {
                let s = std::fs::read_to_string(e.path().join("serial")).unwrap_or_default();
                if s.trim() == serial {
                    return Ok(Path::new("/dev").join(e.file_name()));
                }
            }
        }
        if Instant::now() > deadline {
            return Err(err(format!("no disk with serial {serial:?} appeared")));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The VM's one persistent-memory device (its image disk on a full VM), once it appears.
fn wait_for_pmem() -> std::io::Result<PathBuf> {
    let deadline = Instant::now() + DISK_WAIT;
    loop {
        if Path::new("/sys/block/pmem0").exists() {
            return Ok(PathBuf::from("/dev/pmem0"));
        }
        if Instant::now() > deadline {
            return Err(err("no pmem device appeared for the image disk"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The device of the virtio-serial port named `name` (e.g. `vport0p1`), once it appears.
fn wait_for_port(name: &str) -> std::io::Result<String> {
    let deadline = Instant::now() + DISK_WAIT;
    loop {
        if let Ok(dir) = std::fs::read_dir("/sys/class/virtio-ports") {
            for e in dir.flatten() {
                if std::fs::read_to_string(e.path().join("name")).unwrap_or_default().trim() == name {
                    return Ok(e.file_name().to_string_lossy().into_owned());
                }
            }
        }
        if Instant::now() > deadline {
            return Err(err(format!("no virtio-serial port {name:?} appeared")));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn read_config(dev: &Path) -> std::io::Result<VmConfig> {
    let mut f = std::fs::File::open(dev)?;
    let size = f.seek(std::io::SeekFrom::End(0))?;
    f.rewind()?;
    let mut raw = Vec::new();
    f.take(size.min(u64::from(MAX_CONFIG_BYTES) + 4)).read_to_end(&mut raw)?;
    VmConfig::parse(&raw).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_disk_is_read_exactly() {
        let json = br#"{"sandbox_id":"e.1","hostname":"h","env":[["A","1"]],"user":"","workdir":"","session_bytes":9}"#;
        let mut raw = (json.len() as u32).to_le_bytes().to_vec();
        raw.extend_from_slice(json);
        raw.resize(4096, 0);
        let c = VmConfig::parse(&raw).unwrap();
        assert_eq!((c.sandbox_id.as_str(), c.env.len(), c.session_bytes), ("e.1", 1, 9));
        assert!(VmConfig::parse(&raw[..2]).is_err());
        assert!(VmConfig::parse(&[0xff, 0xff, 0xff, 0x7f]).unwrap_err().contains("more than"));
        let mut short = raw.clone();
        short.truncate(10);
        assert!(VmConfig::parse(&short).is_err());
        let bad = br#"{"nope":1}"#;
        let mut raw = (bad.len() as u32).to_le_bytes().to_vec();
        raw.extend_from_slice(bad);
        assert!(VmConfig::parse(&raw).is_err());
    }
}
