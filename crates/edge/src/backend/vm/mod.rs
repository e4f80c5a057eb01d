//! The VM backends on QEMU ([C 7], [C 8]): `microvm` (`-M microvm`, virtio-mmio) and `fullvm`
//! (`q35`, virtio-pci). One QEMU process per sandbox, controlled over QMP ([`qmp`]), booting
//! the shared guest kernel (scripts/vm-kernel.sh) with an initramfs whose `/init` is the agent
//! (`vm-init`: it loads the modules, assembles the root from the disks of [`disks`], and
//! serves the Runtime API). The edge reaches the agent over a virtio-serial port: HTTP/2 over a
//! unix socket QEMU listens on, begun with the handshake of `opendsec_proto::serial`.
//!
//! Why virtio-serial and not vsock: the host has no kernel vhost-vsock, and QEMU (7.2 and
//! 10.0 alike) refuses to migrate a VM with a `vhost-user-vsock` device, which would rule out
//! pause-by-snapshot and fork. A serial port is QEMU's own device, migrates, and carries one
//! HTTP/2 connection, which multiplexes every call. The guest has no vsock device at all, so it
//! reaches no host or VM vsock port.
//!
//! A VM outlives the edge (its own process group): an edge restart adopts it from the pid
//! file in its directory. Pause stops the vCPUs (QMP `stop`), the memory kept.

pub mod disks;
pub mod qmp;

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use opendsec_images::Store;
use tonic::transport::Endpoint;

use super::container::{AgentConn, blocking, identify, remove_inuse, watch_agent_within, write_inuse};
use super::{AgentAccess, Backend, BackendError, Usage, Versioned};
use crate::record::SandboxRecord;

/// The QEMU machine a backend runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Machine {
    /// `-M microvm`: virtio-mmio devices, no PCI (backend `microvm`).
    Microvm,
    /// `-M q35`: virtio-pci devices (backend `fullvm`).
    Q35,
}

impl Machine {
    fn backend(self) -> &'static str {
        match self {
            Machine::Microvm => "microvm",
            Machine::Q35 => "fullvm",
        }
    }
}

/// How guests are run: KVM where the host's /dev/kvm boots a guest, else TCG (emulation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accel {
    Kvm,
    Tcg,
    /// KVM if a short boot under it succeeds ([`probe_kvm`]), else TCG.
    Auto,
}

/// What a probe boot prints when the guest's init runs (the agent's `PROBE_OK`).
const PROBE_OK: &str = "OPENDSEC-PROBE-OK";
/// How long a probe boot may take under KVM (seconds there; a host whose KVM cannot boot a
/// guest hangs or fails).
const PROBE_WAIT: Duration = Duration::from_secs(15);

/// Whether a guest boots under KVM here: the kernel and initramfs booted with
/// `opendsec.probe`, whose init prints [`PROBE_OK`] and powers off. The answer is kept in
/// `cache` per host kernel, QEMU and guest kernel, so only the first edge start pays for it.
pub fn probe_kvm(qemu: &Path, kernel_dir: &Path, initramfs: &Path, cache: &Path) -> bool {
    let host = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let release = std::fs::read_to_string(kernel_dir.join("release")).unwrap_or_default();
    let key: String = {
        use sha2::Digest;
        let mut h = sha2::Sha256::new();
        h.update(format!("{}|{}|{}|{}", host.trim(), qemu.display(), release.trim(), initramfs.display()));
        h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect()
    };
    let kept = cache.join(format!("kvm-probe-{key}"));
    if let Ok(v) = std::fs::read_to_string(&kept) {
        return v.trim() == "kvm";
    }
    let ok = std::fs::OpenOptions::new().read(true).write(true).open("/dev/kvm").is_ok() && {
        let child = std::process::Command::new(qemu)
            .args(["-accel", "kvm", "-cpu", "host", "-m", "128M", "-M", "microvm", "-nodefaults", "-no-user-config"])
            .args(["-nographic", "-no-reboot", "-serial", "stdio", "-kernel"])
            .arg(kernel_dir.join("vmlinux"))
            .arg("-initrd")
            .arg(initramfs)
            .args(["-append", "console=ttyS0 quiet panic=-1 rdinit=/init opendsec.bus=mmio opendsec.probe -- vm-init"])
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn();
        match child {
            Ok(mut child) => {
                let out = child.stdout.take();
                let (tx, rx) = std::sync::mpsc::channel();
                std::thread::spawn(move || {
                    use std::io::BufRead;
                    let found = out.is_some_and(|o| {
                        std::io::BufReader::new(o).lines().map_while(Result::ok).any(|l| l.contains(PROBE_OK))
                    });
                    let _ = tx.send(found);
                });
                let found = rx.recv_timeout(PROBE_WAIT).unwrap_or(false);
                let _ = child.kill();
                let _ = child.wait();
                found
            }
            Err(_) => false,
        }
    };
    let _ = std::fs::write(&kept, if ok { "kvm" } else { "tcg" });
    ok
}

#[derive(Clone, Debug)]
pub struct VmOptions {
    pub machine: Machine,
    pub store_dir: PathBuf,
    /// Where each VM's directory lives (`<edge state>/vms`).
    pub state_dir: PathBuf,
    /// The static agent (`/init` of the initramfs).
    pub agent: PathBuf,
    /// scripts/vm-kernel.sh's output: vmlinux, modules, their load order.
    pub kernel_dir: PathBuf,
    pub qemu: PathBuf,
    pub accel: Accel,
    /// How long a VM may take from launch to its agent answering.
    pub boot_timeout: Duration,
}

/// Smallest guest memory: the kernel and the agent need this much.
pub const MIN_MEMORY_MB: u64 = 128;
/// Writable disk of a sandbox whose spec asks for none.
const DEFAULT_DISK_MB: u64 = 1024;
/// The guest's console, kept by QEMU in memory (the guest writes it: bounded).
const CONSOLE_BYTES: u64 = 64 << 10;

use disks::tail;

#[derive(Debug)]
struct Vm {
    dir: PathBuf,
    pid: i32,
    agent: AgentConn,
}

#[derive(Debug)]
pub struct VmBackend {
    opts: VmOptions,
    store: Arc<Store>,
    initramfs: PathBuf,
    tsc_khz: Option<u64>,
    version: String,
    vms: Mutex<HashMap<String, Arc<Vm>>>,
    /// The last words of each VMM this edge started, by VM directory.
    logs: Mutex<HashMap<PathBuf, Arc<Mutex<std::collections::VecDeque<u8>>>>>,
}

/// How much of a VMM's output the edge keeps (its last bytes).
const VMM_LOG_BYTES: usize = 16 << 10;

fn internal(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> BackendError {
    move |e| BackendError::internal(format!("{what}: {e}"))
}

/// The host TSC's frequency in kHz: a microvm guest under TCG reads the host's TSC and cannot
/// calibrate it (no PIT), so it is told (`tsc_early_khz`).
fn host_tsc_khz() -> Option<u64> {
    if let Ok(s) = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/tsc_freq_khz")
        && let Ok(k) = s.trim().parse()
    {
        return Some(k);
    }
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = info.lines().find(|l| l.starts_with("cpu MHz"))?.split(':').nth(1)?.trim().parse().ok()?;
    Some((mhz * 1000.0).round() as u64)
}

impl VmBackend {
    pub fn new(opts: VmOptions) -> Result<VmBackend, BackendError> {
        let out = std::process::Command::new(&opts.qemu)
            .arg("--version")
            .output()
            .map_err(internal(format!("cannot run {}", opts.qemu.display())))?;
        let version = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .and_then(|l| l.split("version ").nth(1))
            .map(|v| v.split_whitespace().next().unwrap_or("").to_string())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| BackendError::internal(format!("{} printed no version", opts.qemu.display())))?;
        if !opts.kernel_dir.join("vmlinux").exists() {
            return Err(BackendError::invalid_argument(format!(
                "no guest kernel in {} (run scripts/vm-kernel.sh)",
                opts.kernel_dir.display()
            )));
        }
        std::fs::create_dir_all(&opts.state_dir).map_err(internal("creating the VM directory"))?;
        std::fs::set_permissions(&opts.state_dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(internal("closing the VM directory"))?;
        let initramfs = disks::initramfs(&opts.state_dir.join(".boot"), &opts.agent, &opts.kernel_dir)?;
        let store =
            Arc::new(Store::open(&opts.store_dir).map_err(|e| BackendError::internal(format!("image store: {e}")))?);
        let mut opts = opts;
        if opts.accel == Accel::Auto {
            let boot = opts.state_dir.join(".boot");
            opts.accel =
                if probe_kvm(&opts.qemu, &opts.kernel_dir, &initramfs, &boot) { Accel::Kvm } else { Accel::Tcg };
        }
        if opts.accel == Accel::Tcg {
            tracing::warn!(
                backend = opts.machine.backend(),
                "VMs run under TCG (software emulation; KVM off or unable to boot a guest here): expect seconds to boot, not milliseconds"
            );
        }
        Ok(VmBackend {
            tsc_khz: host_tsc_khz(),
            store,
            initramfs,
            version,
            vms: Mutex::new(HashMap::new()),
            logs: Mutex::new(HashMap::new()),
            opts,
        })
    }

    /// The accelerator VMs run under (never `auto` once the backend exists).
    pub fn accel_name(&self) -> &'static str {
        match self.opts.accel {
            Accel::Kvm => "kvm",
            Accel::Tcg | Accel::Auto => "tcg",
        }
    }

    /// The directory of sandbox `id`'s VM.
    pub fn name(&self, id: &str) -> String {
        format!("{}.{}", self.opts.machine.backend(), id)
    }

    fn dir_of(&self, id: &str) -> PathBuf {
        self.opts.state_dir.join(self.name(id))
    }

    fn inuse_path(&self, id: &str) -> PathBuf {
        self.opts.store_dir.join("inuse").join(self.name(id))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Vm>>> {
        self.vms.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// QEMU's command line for the VM in `dir`.
    fn argv(&self, dir: &Path, image: &Path, memory_mb: u64, cpus: u64) -> Vec<String> {
        let d = |f: &str| dir.join(f).display().to_string();
        let (machine, bus, suffix) = match self.opts.machine {
            // microvm: ACPI stays on (Debian's kernel finds virtio-mmio devices only through it),
            // so does the RTC (without it the guest spends seconds probing).
            Machine::Microvm => ("microvm,x-option-roms=off,pit=off,pic=off,memory-backend=mem", "mmio", "device"),
            Machine::Q35 => ("q35,memory-backend=mem", "pci", "pci"),
        };
        // Under TCG a smaller translation cache than QEMU's 1 GiB default: host memory that
        // no quota counts.
        let accel = match self.opts.accel {
            Accel::Kvm => "kvm".to_string(),
            Accel::Tcg | Accel::Auto => "tcg,tb-size=64".to_string(),
        };
        let mut append =
            format!("console=ttyS0 quiet panic=-1 cryptomgr.notests mitigations=off rdinit=/init opendsec.bus={bus}");
        if self.opts.machine == Machine::Microvm
            && let Some(k) = self.tsc_khz
        {
            append.push_str(&format!(" tsc_early_khz={k}"));
        }
        append.push_str(" -- vm-init");
        let mut a: Vec<String> = [
            "-name",
            &self.name(dir.file_name().and_then(|n| n.to_str()).unwrap_or("")),
            "-accel",
            &accel,
            // QEMU's seccomp filter: no obsolete calls, no privilege changes, no scheduler or
            // resource controls. Spawning stays allowed: the state of a pause is saved through
            // `exec:` (moving that to `fd:` is on the list in docs/vms.md).
            "-sandbox",
            "on,obsolete=deny,elevateprivileges=deny,resourcecontrol=deny",
            "-cpu",
            "max",
            "-smp",
            &cpus.to_string(),
            "-m",
            &format!("{memory_mb}M"),
            "-M",
            machine,
            "-object",
            &format!("memory-backend-file,id=mem,size={memory_mb}M,mem-path={},share=on", d("mem")),
            "-nodefaults",
            "-no-user-config",
            "-nographic",
            "-no-reboot",
            "-kernel",
            &self.opts.kernel_dir.join("vmlinux").display().to_string(),
            "-initrd",
            &self.initramfs.display().to_string(),
            "-append",
            &append,
            "-chardev",
            &format!("ringbuf,id=console,size={CONSOLE_BYTES}"),
            "-serial",
            "chardev:console",
            "-qmp",
            &format!("unix:{},server=on,wait=off", d("qmp.sock")),
            "-device",
            &format!("virtio-serial-{suffix}"),
            "-chardev",
            &format!("socket,id=agent,path={},server=on,wait=off", d("agent.sock")),
            "-device",
            &format!("virtserialport,chardev=agent,name={}", opendsec_proto::serial::AGENT_PORT),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        for (id, file, ro) in [
            ("config", d("config.img"), true),
            ("image", image.display().to_string(), true),
            ("disk", d("disk.img"), false),
        ] {
            let ro = if ro { ",readonly=on" } else { "" };
            a.push("-drive".into());
            a.push(format!("file={file},if=none,id={id},format=raw{ro},cache=none,aio=threads"));
            a.push("-device".into());
            a.push(format!("virtio-blk-{suffix},drive={id},serial={id}"));
        }
        a
    }

    /// A lazily connecting channel to the agent in `dir`: each connection is the serial port's
    /// socket, begun with the handshake; it waits for a booting guest.
    fn agent_channel(&self, dir: &Path) -> tonic::transport::Channel {
        let sock = dir.join("agent.sock");
        let wait = self.opts.boot_timeout;
        Endpoint::from_static("http://agent.invalid").connect_with_connector_lazy(tower::service_fn(move |_| {
            let sock = sock.clone();
            async move {
                let connect = async {
                    // QEMU makes the socket shortly after it starts.
                    let s = loop {
                        match tokio::net::UnixStream::connect(&sock).await {
                            Ok(s) => break s,
                            Err(e)
                                if matches!(
                                    e.kind(),
                                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                                ) && sock.parent().is_some_and(|d| d.join("pid").exists()) =>
                            {
                                tokio::time::sleep(Duration::from_millis(10)).await
                            }
                            Err(e) => return Err(e),
                        }
                    };
                    opendsec_proto::serial::host_handshake(s, rand::random()).await
                };
                let io = tokio::time::timeout(wait, connect)
                    .await
                    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "the guest did not answer"))??;
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(io))
            }
        }))
    }

    async fn qmp(&self, dir: &Path) -> Result<qmp::Qmp, BackendError> {
        qmp::Qmp::connect(&dir.join("qmp.sock"))
            .await
            .map_err(|e| BackendError::unavailable(format!("the VMM of {} does not answer: {e}", dir.display())))
    }

    /// The guest's console so far (for errors), if QEMU answers.
    async fn console(&self, dir: &Path) -> String {
        match self.qmp(dir).await {
            Ok(mut q) => q.ringbuf_read("console", CONSOLE_BYTES).await.map(|s| tail(s.as_bytes())).unwrap_or_default(),
            Err(_) => String::new(),
        }
    }

    async fn launch(&self, sb: &SandboxRecord) -> Result<Arc<Vm>, BackendError> {
        let dir = self.dir_of(&sb.id);
        let store = self.store.clone();
        let (project, image) = (sb.spec.project.clone(), sb.spec.image.clone());
        let res = sb.resources();
        let memory_mb = res.memory_mb.max(MIN_MEMORY_MB);
        let cpus = u64::from(res.cpu_millis).div_ceil(1000).max(1);
        let disk_mb = if res.disk_mb == 0 { DEFAULT_DISK_MB } else { res.disk_mb };
        let config = serde_json::json!({
            "sandbox_id": sb.id,
            "hostname": sb.lease_id,
            "env": Vec::<(String, String)>::new(),
            "user": sb.spec.user,
            "workdir": sb.spec.workdir,
        });
        let spec_env = sb.spec.env.clone();
        let inuse = self.inuse_path(&sb.id);
        let d = dir.clone();
        let image_disk = blocking(move || {
            let (_, manifest) = store
                .resolve(&project, &image)
                .map_err(|e| BackendError::invalid_argument(format!("image {image}: {e}")))?;
            write_inuse(&inuse, &manifest.layers)?;
            let disk = disks::image_disk(&store, &manifest.layers)?;
            // Root's alone: its sockets control the VM.
            std::fs::create_dir_all(&d).map_err(internal("creating the VM's directory"))?;
            std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .map_err(internal("closing the VM's directory"))?;
            let mut config = config;
            config["env"] = serde_json::json!(
                super::container::merge_env(&manifest.config.env, &spec_env)
                    .iter()
                    .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
                    .collect::<Vec<_>>()
            );
            disks::config_disk(&d.join("config.img"), config.to_string().as_bytes())?;
            disks::writable_disk(&d.join("disk.img"), disk_mb)?;
            Ok(disk)
        })
        .await?;
        let argv = self.argv(&dir, &image_disk, memory_mb, cpus);
        let kept = serde_json::to_vec(&argv).map_err(|e| BackendError::internal(e.to_string()))?;
        std::fs::write(dir.join("argv.json"), kept).map_err(internal("writing the VMM's command line"))?;
        let pid = self.spawn_vmm(&dir, &argv, false)?;
        let agent = watch_agent_within(&sb.id, self.agent_channel(&dir), true, self.opts.boot_timeout).await;
        let agent = match agent {
            Ok(a) => a,
            Err(e) => {
                let console = self.console(&dir).await;
                let qemu_log = self.vmm_log(&dir);
                let _ = self.teardown(&sb.id).await;
                return Err(BackendError::new(
                    e.kind(),
                    format!("the VM of {} did not come up (console: {console:?}; vmm: {qemu_log:?})", sb.id),
                )
                .caused_by(e));
            }
        };
        identify(&agent.channel, sb, &sb.lease_id).await?;
        Ok(Arc::new(Vm { dir, pid, agent }))
    }

    /// Starts the VMM of `dir` with `argv` (waiting for an incoming migration with
    /// `incoming`); returns its pid, also written to `dir/pid`.
    fn spawn_vmm(&self, dir: &Path, argv: &[String], incoming: bool) -> Result<i32, BackendError> {
        // Sockets an earlier VMM of this directory left would answer "refused" until this one
        // binds its own.
        for sock in ["qmp.sock", "agent.sock"] {
            let _ = std::fs::remove_file(dir.join(sock));
        }
        let mut cmd = tokio::process::Command::new(&self.opts.qemu);
        // QEMU's own messages (some a guest can provoke, unthrottled) go to a pipe the edge
        // keeps the last VMM_LOG_BYTES of, never to a file that could fill the host's disk.
        cmd.args(argv)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            // Outlives the edge: adopted after a restart.
            .process_group(0)
            .kill_on_drop(false);
        if incoming {
            cmd.args(["-incoming", "defer"]);
        }
        let mut child = cmd.spawn().map_err(internal(format!("starting {}", self.opts.qemu.display())))?;
        let pid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
        if let Err(e) = std::fs::write(dir.join("pid"), pid.to_string()) {
            // Unrecorded, it would run on out of every account.
            let _ = child.start_kill();
            return Err(BackendError::internal(format!("writing the VMM's pid: {e}")));
        }
        let log = Arc::new(Mutex::new(std::collections::VecDeque::<u8>::new()));
        self.logs.lock().unwrap_or_else(|p| p.into_inner()).insert(dir.to_path_buf(), log.clone());
        for out in [
            child.stdout.take().map(|o| Box::new(o) as Box<dyn tokio::io::AsyncRead + Send + Unpin>),
            child.stderr.take().map(|e| Box::new(e) as _),
        ]
        .into_iter()
        .flatten()
        {
            let log = log.clone();
            tokio::spawn(async move {
                use tokio::io::AsyncReadExt;
                let mut out = out;
                let mut buf = [0u8; 4096];
                while let Ok(n) = out.read(&mut buf).await {
                    if n == 0 {
                        break;
                    }
                    let mut l = log.lock().unwrap_or_else(|p| p.into_inner());
                    l.extend(&buf[..n]);
                    let over = l.len().saturating_sub(VMM_LOG_BYTES);
                    l.drain(..over);
                }
            });
        }
        // Reaped here while the edge runs; an adopted VM is reaped by whoever inherits it.
        tokio::spawn(async move {
            let _ = child.wait().await;
        });
        Ok(pid)
    }

    /// The end of what the VMM of `dir` printed.
    fn vmm_log(&self, dir: &Path) -> String {
        let logs = self.logs.lock().unwrap_or_else(|p| p.into_inner());
        logs.get(dir)
            .map(|l| tail(&l.lock().unwrap_or_else(|p| p.into_inner()).iter().copied().collect::<Vec<u8>>()))
            .unwrap_or_default()
    }

    /// A microvm's pause: the vCPUs stopped, the device state saved to `dir/state` (the
    /// memory is the VM's file already: `x-ignore-shared` leaves it out of the stream), and
    /// the VMM ended, so the host gets its memory back (the file's pages are page cache, on
    /// disk once written back).
    async fn snapshot_and_exit(&self, vm: &Vm) -> Result<(), BackendError> {
        let fail = |what: &str| {
            let what = what.to_string();
            move |e: qmp::QmpError| BackendError::internal(format!("{what}: {e}"))
        };
        let mut q = self.qmp(&vm.dir).await?;
        q.stop().await.map_err(fail("stopping the vCPUs"))?;
        let tmp = vm.dir.join("state.tmp");
        let saved = async {
            q.execute(
                "migrate-set-capabilities",
                Some(serde_json::json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]})),
            )
            .await
            .map_err(fail("setting x-ignore-shared"))?;
            q.execute("migrate", Some(serde_json::json!({ "uri": format!("exec:cat > {}", tmp.display()) })))
                .await
                .map_err(fail("saving the device state"))?;
            wait_migration(&mut q).await
        };
        if let Err(e) = saved.await {
            let _ = q.cont().await;
            return Err(e);
        }
        std::fs::rename(&tmp, vm.dir.join("state")).map_err(internal("placing the saved state"))?;
        q.quit().await.map_err(fail("ending the VMM"))?;
        vm.agent.watch.abort();
        let dir = vm.dir.clone();
        blocking(move || {
            kill_vmm(&dir);
            Ok(())
        })
        .await
    }

    /// A paused microvm's resume: a new VMM restores the saved state over the same memory
    /// file and runs on; the agent's connection is made anew over its port.
    async fn restore(&self, sb: &SandboxRecord, dir: &Path) -> Result<Arc<Vm>, BackendError> {
        let argv: Vec<String> = std::fs::read(dir.join("argv.json"))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| BackendError::internal(format!("the paused VM of {} has no command line", sb.id)))?;
        let pid = self.spawn_vmm(dir, &argv, true)?;
        let fail = |what: &'static str| move |e: qmp::QmpError| BackendError::internal(format!("{what}: {e}"));
        let restored = async {
            let mut q = loop {
                match qmp::Qmp::connect(&dir.join("qmp.sock")).await {
                    Ok(q) => break q,
                    // Not listening yet (the sockets of the VMM before it were removed).
                    Err(_) if Path::new(&format!("/proc/{pid}")).exists() => {
                        tokio::time::sleep(Duration::from_millis(5)).await
                    }
                    Err(e) => return Err(BackendError::internal(format!("the restoring VMM ended: {e}"))),
                }
            };
            q.execute(
                "migrate-set-capabilities",
                Some(serde_json::json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]})),
            )
            .await
            .map_err(fail("setting x-ignore-shared"))?;
            q.execute(
                "migrate-incoming",
                Some(serde_json::json!({ "uri": format!("exec:cat {}", dir.join("state").display()) })),
            )
            .await
            .map_err(fail("restoring the device state"))?;
            wait_migration(&mut q).await?;
            q.cont().await.map_err(fail("running the restored VM"))
        };
        if let Err(e) = tokio::time::timeout(self.opts.boot_timeout, restored)
            .await
            .unwrap_or_else(|_| Err(BackendError::unavailable(format!("the VM of {} was not restored in time", sb.id))))
        {
            let d = dir.to_path_buf();
            let _ = blocking(move || {
                kill_vmm(&d);
                Ok(())
            })
            .await;
            return Err(e);
        }
        let agent = watch_agent_within(&sb.id, self.agent_channel(dir), true, self.opts.boot_timeout).await?;
        let _ = std::fs::remove_file(dir.join("state"));
        Ok(Arc::new(Vm { dir: dir.to_path_buf(), pid, agent }))
    }

    /// Ends the VM of `id` (if any) and removes its directory and its hold on layers.
    async fn teardown(&self, id: &str) -> Result<(), BackendError> {
        let vm = self.lock().remove(id);
        if let Some(vm) = &vm {
            vm.agent.watch.abort();
        }
        let dir = self.dir_of(id);
        self.logs.lock().unwrap_or_else(|p| p.into_inner()).remove(&dir);
        let inuse = self.inuse_path(id);
        blocking(move || {
            kill_vmm(&dir);
            if dir.exists() {
                std::fs::remove_dir_all(&dir).map_err(internal(format!("removing {}", dir.display())))?;
            }
            remove_inuse(&inuse)
        })
        .await
    }
}

/// The agent connection of a VM paused by snapshot: no VMM, so no stream; marked paused.
fn paused_conn(vm: &Vm) -> AgentConn {
    vm.agent.paused.store(true, Ordering::SeqCst);
    AgentConn::detached(vm.agent.channel.clone())
}

/// Waits for the migration on `q` (either side) to end.
async fn wait_migration(q: &mut qmp::Qmp) -> Result<(), BackendError> {
    loop {
        let m = q.execute("query-migrate", None).await.map_err(|e| BackendError::internal(e.to_string()))?;
        match m["status"].as_str().unwrap_or("") {
            "completed" => return Ok(()),
            "failed" | "cancelled" => {
                return Err(BackendError::internal(format!(
                    "the migration failed: {}",
                    m["error-desc"].as_str().unwrap_or("no reason given")
                )));
            }
            // An incoming side reports nothing until it starts, and `completed` only briefly:
            // its run state says it is done.
            "" => {
                let st = q.status().await.map_err(|e| BackendError::internal(e.to_string()))?;
                if matches!(st.as_str(), "paused" | "running" | "postmigrate") {
                    return Ok(());
                }
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

/// The pid in `dir/pid`, if that process is the VMM of `dir` (its command line names it).
fn vmm_pid(dir: &Path) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(dir.join("pid")).ok()?.trim().parse().ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let needle = dir.join("qmp.sock").display().to_string();
    String::from_utf8_lossy(&cmdline).contains(&needle).then_some(pid)
}

/// Kills the VMM of `dir` and waits for it to be gone.
fn kill_vmm(dir: &Path) {
    let Some(pid) = vmm_pid(dir) else { return };
    if let Some(p) = rustix::process::Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
    }
    for _ in 0..500 {
        if vmm_pid(dir).is_none() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    tracing::warn!(dir = %dir.display(), pid, "the VMM did not end after SIGKILL");
}

#[async_trait]
impl Backend for VmBackend {
    fn name(&self) -> &'static str {
        self.opts.machine.backend()
    }

    async fn create(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        if self.lock().contains_key(&sb.id) {
            return Ok(());
        }
        // Leftovers of an interrupted creation go first.
        self.teardown(&sb.id).await?;
        let vm = self.launch(sb).await?;
        self.lock().insert(sb.id.clone(), vm);
        Ok(())
    }

    async fn stop(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.teardown(&sb.id).await
    }

    async fn pause(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        let vm = self.lock().get(&sb.id).cloned().ok_or_else(|| BackendError::not_found(format!("no VM {}", sb.id)))?;
        if vm.pid == 0 || vm.agent.paused.load(Ordering::SeqCst) {
            return Ok(()); // paused already
        }
        vm.agent.paused.store(true, Ordering::SeqCst);
        let r = match self.opts.machine {
            Machine::Microvm => self.snapshot_and_exit(&vm).await,
            Machine::Q35 => {
                async { self.qmp(&vm.dir).await?.stop().await.map_err(|e| BackendError::internal(e.to_string())) }.await
            }
        };
        match r {
            Ok(()) if self.opts.machine == Machine::Microvm => {
                self.lock()
                    .insert(sb.id.clone(), Arc::new(Vm { dir: vm.dir.clone(), pid: 0, agent: paused_conn(&vm) }));
                Ok(())
            }
            Ok(()) => Ok(()),
            Err(e) => {
                vm.agent.paused.store(false, Ordering::SeqCst);
                Err(e)
            }
        }
    }

    async fn resume(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        let vm = self.lock().get(&sb.id).cloned().ok_or_else(|| BackendError::not_found(format!("no VM {}", sb.id)))?;
        if vm.pid == 0 {
            let restored = self.restore(sb, &vm.dir).await?;
            self.lock().insert(sb.id.clone(), restored);
            return Ok(());
        }
        if !vm.agent.paused.load(Ordering::SeqCst) {
            return Ok(());
        }
        self.qmp(&vm.dir).await?.cont().await.map_err(|e| BackendError::internal(e.to_string()))?;
        vm.agent.paused.store(false, Ordering::SeqCst);
        vm.agent.beat_now();
        Ok(())
    }

    async fn probe(&self, id: &str) -> Result<bool, BackendError> {
        let vm = self.lock().get(id).cloned();
        let Some(vm) = vm else { return Ok(false) };
        let dir = vm.dir.clone();
        if vm.pid == 0 {
            // Paused by snapshot: no VMM, its state on disk.
            return Ok(dir.join("state").exists() && dir.join("mem").exists());
        }
        let vmm = blocking(move || Ok(vmm_pid(&dir))).await?;
        // A paused VM's agent is silent by design; its VMM must still be there.
        Ok(vmm == Some(vm.pid) && (vm.agent.paused.load(Ordering::SeqCst) || vm.agent.alive.load(Ordering::SeqCst)))
    }

    async fn adopt(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        let dir = self.dir_of(&sb.id);
        let d = dir.clone();
        let pid = blocking(move || Ok(vmm_pid(&d))).await?;
        let Some(pid) = pid else {
            if self.opts.machine == Machine::Microvm && dir.join("state").exists() && dir.join("mem").exists() {
                // Paused by snapshot: resumed on demand.
                let agent = AgentConn::detached(self.agent_channel(&dir));
                self.lock().insert(sb.id.clone(), Arc::new(Vm { dir, pid: 0, agent }));
                return Ok(());
            }
            return Err(BackendError::not_found(format!("the VM of {} is gone", sb.id)));
        };
        let status = self.qmp(&dir).await?.status().await.map_err(|e| BackendError::internal(e.to_string()))?;
        let agent = watch_agent_within(&sb.id, self.agent_channel(&dir), false, self.opts.boot_timeout).await?;
        if status == "paused" {
            agent.paused.store(true, Ordering::SeqCst);
        }
        self.lock().insert(sb.id.clone(), Arc::new(Vm { dir, pid, agent }));
        Ok(())
    }

    async fn cleanup(&self, keep: &HashSet<String>) -> Result<usize, BackendError> {
        let prefix = format!("{}.", self.opts.machine.backend());
        let mut gone = Vec::new();
        if let Ok(rd) = std::fs::read_dir(&self.opts.state_dir) {
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().to_string();
                if let Some(id) = name.strip_prefix(&prefix)
                    && !keep.contains(id)
                {
                    gone.push(id.to_string());
                }
            }
        }
        for id in &gone {
            self.teardown(id).await?;
        }
        Ok(gone.len())
    }

    fn usage(&self) -> Option<Usage> {
        None
    }

    fn versioned(&self) -> Option<&dyn Versioned> {
        Some(self)
    }

    fn agent_access(&self) -> Option<&dyn AgentAccess> {
        Some(self)
    }
}

impl Versioned for VmBackend {
    fn runtime_versions(&self) -> Vec<String> {
        let accel = self.accel_name();
        let release = std::fs::read_to_string(self.opts.kernel_dir.join("release")).unwrap_or_default();
        vec![format!("qemu {} ({accel})", self.version), format!("guest linux {}", release.trim())]
    }
}

impl AgentAccess for VmBackend {
    fn agent(&self, id: &str) -> Result<tonic::transport::Channel, BackendError> {
        match self.lock().get(id) {
            Some(vm) if vm.agent.alive.load(Ordering::SeqCst) => Ok(vm.agent.channel.clone()),
            Some(_) => Err(BackendError::unavailable(format!("the agent of {id} is not connected"))),
            None => Err(BackendError::not_found(format!("no VM {id}"))),
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_host_tsc_is_known() {
        assert!(super::host_tsc_khz().is_some_and(|k| k > 100_000));
    }
}
