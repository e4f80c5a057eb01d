//! QEMU as the VMM of the VM backends ([`Vmm`]): `-M microvm` for microvm, `q35` for fullvm,
//! started by the command [`Qemu::command`] builds and controlled over QMP ([`qmp`]). Its
//! saves and loads are migrations to and from descriptors the edge hands over: a pipe the
//! edge copies (at most [`MAX_STATE_BYTES`]) for a save, a read-only file for a load, so the
//! VMM never holds a writable descriptor of a saved state. Whether KVM can boot a guest here
//! is found by a probe boot ([`probe_kvm`]).

use std::path::{Path, PathBuf};
use std::time::Duration;

use async_trait::async_trait;

use super::vmm::{Launch, VmSpec, Vmm};
use super::{Accel, Drive, Machine, internal, qmp, sockets_of};
use crate::backend::BackendError;

/// The guest's console, kept by QEMU in memory (the guest writes it: bounded).
pub(super) const CONSOLE_BYTES: u64 = 64 << 10;

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

/// The host TSC's frequency in kHz: a microvm guest under TCG reads the host's TSC and cannot
/// calibrate it (no PIT), so it is told (`tsc_early_khz`).
pub fn host_tsc_khz() -> Option<u64> {
    if let Ok(s) = std::fs::read_to_string("/sys/devices/system/cpu/cpu0/tsc_freq_khz")
        && let Ok(k) = s.trim().parse()
    {
        return Some(k);
    }
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let mhz: f64 = info.lines().find(|l| l.starts_with("cpu MHz"))?.split(':').nth(1)?.trim().parse().ok()?;
    Some((mhz * 1000.0).round() as u64)
}

/// QEMU, as this edge runs it.
#[derive(Debug)]
pub(super) struct Qemu {
    /// QEMU's version (`7.2.22`).
    version: String,
    machine: Machine,
    /// Never `Auto` ([`probe_kvm`] decided).
    accel: Accel,
    /// The empty directory every VMM chroots into.
    jail: PathBuf,
    kernel_dir: PathBuf,
    initramfs: PathBuf,
    tsc_khz: Option<u64>,
}

impl Qemu {
    /// Asks `binary` its version; `accel` decided already.
    pub(super) fn new(
        binary: &Path,
        machine: Machine,
        accel: Accel,
        jail: PathBuf,
        kernel_dir: PathBuf,
        initramfs: PathBuf,
    ) -> Result<Qemu, BackendError> {
        let out = std::process::Command::new(binary)
            .arg("--version")
            .output()
            .map_err(internal(format!("cannot run {}", binary.display())))?;
        let version = String::from_utf8_lossy(&out.stdout)
            .lines()
            .next()
            .and_then(|l| l.split("version ").nth(1))
            .map(|v| v.split_whitespace().next().unwrap_or("").to_string())
            .filter(|v| !v.is_empty())
            .ok_or_else(|| BackendError::internal(format!("{} printed no version", binary.display())))?;
        Ok(Qemu { version, machine, accel, jail, kernel_dir, initramfs, tsc_khz: host_tsc_khz() })
    }

    fn accel_name(&self) -> &'static str {
        match self.accel {
            Accel::Kvm => "kvm",
            Accel::Tcg | Accel::Auto => "tcg",
        }
    }

    async fn qmp(&self, dir: &Path) -> Result<qmp::Qmp, BackendError> {
        qmp::Qmp::connect(&sockets_of(dir).join("qmp.sock")).await.map_err(|e| {
            let e = crate::backend::untrusted_text(&e.to_string(), 300);
            BackendError::unavailable(format!("the VMM of {} does not answer: {e}", dir.display()))
        })
    }
}

#[async_trait]
impl Vmm for Qemu {
    fn version(&self) -> String {
        format!("qemu {} ({})", self.version, self.accel_name())
    }

    /// QEMU's version, the accelerator, the machine and the layout of its devices (a change
    /// to [`Qemu::command`]'s devices is a new `devices-N`).
    fn restore_key(&self) -> String {
        format!("qemu {} {} {} devices-2", self.version, self.accel_name(), self.machine.backend())
    }

    fn command(&self, spec: VmSpec<'_>) -> Launch {
        let VmSpec { dir, image, shape, uid } = spec;
        let (memory_mb, cpus) = (shape.memory_mb, shape.cpus);
        let socks = sockets_of(dir);
        // q35: the image disk is virtio-pmem (below), device memory beyond the guest's own.
        let pmem = self.machine == Machine::Q35;
        let image_mb = std::fs::metadata(image).map(|m| m.len().div_ceil(1 << 20)).unwrap_or(0);
        let memory_arg = if pmem {
            format!("{memory_mb}M,slots=1,maxmem={}M", memory_mb + image_mb.next_multiple_of(2) + 2)
        } else {
            format!("{memory_mb}M")
        };
        let d = |f: &str| dir.join(f).display().to_string();
        let (machine, bus, suffix) = match self.machine {
            // microvm: ACPI stays on (Debian's kernel finds virtio-mmio devices only through it),
            // so does the RTC (without it the guest spends seconds probing).
            Machine::Microvm => ("microvm,x-option-roms=off,pit=off,pic=off,memory-backend=mem", "mmio", "device"),
            Machine::Q35 => ("q35,memory-backend=mem", "pci", "pci"),
        };
        // Under TCG a smaller translation cache than QEMU's 1 GiB default: host memory that
        // no quota counts.
        let accel = match self.accel {
            Accel::Kvm => "kvm".to_string(),
            Accel::Tcg | Accel::Auto => "tcg,tb-size=64".to_string(),
        };
        let mut append =
            format!("console=ttyS0 quiet panic=-1 cryptomgr.notests mitigations=off rdinit=/init opendsec.bus={bus}");
        if self.machine == Machine::Microvm
            && let Some(k) = self.tsc_khz
        {
            append.push_str(&format!(" tsc_early_khz={k}"));
        }
        append.push_str(" -- vm-init");
        let mut a: Vec<String> = [
            "-name",
            dir.file_name().and_then(|n| n.to_str()).unwrap_or(""),
            "-accel",
            &accel,
            // QEMU's seccomp filter: no obsolete calls, no spawning, no scheduler or resource
            // controls. Privilege changes stay allowed because QEMU makes one itself: once
            // every file and device is open it chroots into an empty directory and becomes
            // the VM's own uid (-runas, -chroot), with no capability left and no_new_privs
            // set, so nothing can be raised again (`elevateprivileges=deny` would refuse
            // that very drop).
            "-sandbox",
            "on,obsolete=deny,elevateprivileges=allow,spawn=deny,resourcecontrol=deny",
            "-runas",
            &format!("{uid}:{uid}"),
            "-chroot",
            &self.jail.display().to_string(),
            "-cpu",
            "max",
            "-smp",
            &cpus.to_string(),
            "-m",
            &memory_arg,
            "-M",
            machine,
            "-object",
            &format!("memory-backend-file,id=mem,size={memory_mb}M,mem-path={},share=on", d("mem")),
            "-nodefaults",
            "-no-user-config",
            "-nographic",
            "-no-reboot",
            "-kernel",
            &self.kernel_dir.join("vmlinux").display().to_string(),
            "-initrd",
            &self.initramfs.display().to_string(),
            "-append",
            &append,
            "-chardev",
            &format!("ringbuf,id=console,size={CONSOLE_BYTES}"),
            "-serial",
            "chardev:console",
            "-qmp",
            &format!("unix:{},server=on,wait=off", socks.join("qmp.sock").display()),
            "-device",
            &format!("virtio-serial-{suffix}"),
            "-chardev",
            &format!("socket,id=agent,path={},server=on,wait=off", socks.join("agent.sock").display()),
            "-device",
            &format!("virtserialport,chardev=agent,name={}", opendsec_proto::serial::AGENT_PORT),
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        // Disks are handed over open (fd sets), never named: the chrooted VMM opens no path.
        // A writable disk's set holds it read-write and read-only, for QEMU's reopen when a
        // migration inactivates the disk and when it runs again.
        let mut drives = Vec::new();
        let mut files = vec![("config", dir.join("config.img"), false), ("disk", dir.join("disk.img"), true)];
        if pmem {
            // virtio-pmem, mapped private and read-only (QEMU opens the file read-only): the
            // guest mounts it with DAX and reads the host's page cache of the one image file
            // every VM of the image shares, instead of a copy of its own. A guest that writes
            // to it faults its own VMM.
            a.push("-object".into());
            a.push(format!(
                "memory-backend-file,id=image,mem-path={},size={}M,share=off,readonly=on",
                image.display(),
                image_mb
            ));
            a.push("-device".into());
            a.push("virtio-pmem-pci,memdev=image,id=image".into());
        } else {
            files.insert(1, ("image", image.to_path_buf(), false));
        }
        for (set, (id, file, writable)) in files.into_iter().enumerate() {
            let set = set as u32 + 1;
            // A writable disk's two descriptors are two open files to QEMU's image locking,
            // which then refuses itself the write lock when a snapshot's migration has
            // inactivated the disk and `cont` takes it back. Nothing else opens the file (the
            // VM's directory is root's): the lock guards nothing here.
            let ro = if writable { ",file.locking=off" } else { ",readonly=on" };
            a.push("-drive".into());
            a.push(format!("file=/dev/fdset/{set},if=none,id={id},format=raw{ro},cache=none,aio=threads"));
            a.push("-device".into());
            // No discard and no write-zeroes requests from the guest: they would punch holes
            // into the space its disk holds on the host.
            a.push(format!("virtio-blk-{suffix},drive={id},serial={id},discard=off,write-zeroes=off"));
            drives.push(Drive { set, path: file, writable });
        }
        // GPUs passed through (VFIO): QEMU opens their groups before it drops privileges.
        for g in &shape.gpus {
            a.push("-device".into());
            a.push(format!("vfio-pci,host={g}"));
        }
        // The NIC, on the tap the edge hands over at each start (`-netdev`, in spawn_vmm).
        if shape.net {
            a.push("-device".into());
            let rom = if suffix == "pci" { ",romfile=" } else { "" };
            a.push(format!(
                "virtio-net-{suffix},netdev=net0,mac={}{rom}",
                opendsec_proto::vmnet::mac_text(opendsec_proto::vmnet::GUEST_MAC)
            ));
        }
        Launch { argv: a, drives, shape }
    }

    fn incoming_args(&self) -> Vec<String> {
        vec!["-incoming".into(), "defer".into()]
    }

    async fn stop_vcpus(&self, dir: &Path) -> Result<(), BackendError> {
        self.qmp(dir).await?.stop().await.map_err(qmp_fail("stopping the vCPUs"))
    }

    async fn run_vcpus(&self, dir: &Path) -> Result<(), BackendError> {
        self.qmp(dir).await?.cont().await.map_err(qmp_fail("running the vCPUs"))
    }

    async fn stopped(&self, dir: &Path) -> Result<bool, BackendError> {
        let st = self.qmp(dir).await?.status().await.map_err(qmp_fail("the VM's run state"))?;
        Ok(st == "paused")
    }

    async fn save(&self, dir: &Path, state: &Path) -> Result<(), BackendError> {
        let mut q = self.qmp(dir).await?;
        let saved = save_stream(&mut q, state).await;
        if saved.is_err() {
            // Abandoned: the VM is as it was (stopped).
            let _ = q.execute("migrate_cancel", None).await;
            let _ = std::fs::remove_file(state);
        }
        saved
    }

    async fn load(&self, dir: &Path, pid: i32, state: &Path) -> Result<(), BackendError> {
        let mut q = loop {
            match qmp::Qmp::connect(&sockets_of(dir).join("qmp.sock")).await {
                Ok(q) => break q,
                // Not listening yet (the sockets of the VMM before it were removed).
                Err(_) if Path::new(&format!("/proc/{pid}")).exists() => {
                    tokio::time::sleep(Duration::from_millis(5)).await
                }
                Err(e) => return Err(BackendError::internal(format!("the restoring VMM ended: {e}"))),
            }
        };
        q.ignore_shared().await.map_err(qmp_fail("setting x-ignore-shared"))?;
        // Handed over open, read-only: the VMM opens no file itself.
        let file = std::fs::File::open(state).map_err(internal("opening the saved state"))?;
        q.getfd("state", std::os::fd::AsFd::as_fd(&file)).await.map_err(qmp_fail("handing over the saved state"))?;
        drop(file);
        q.execute("migrate-incoming", Some(serde_json::json!({ "uri": "fd:state" })))
            .await
            .map_err(qmp_fail("restoring the device state"))?;
        wait_migration(&mut q).await
    }

    async fn quit(&self, dir: &Path) -> Result<(), BackendError> {
        self.qmp(dir).await?.quit().await.map_err(qmp_fail("ending the VMM"))
    }

    async fn console(&self, dir: &Path) -> String {
        match self.qmp(dir).await {
            Ok(mut q) => q.ringbuf_read("console", CONSOLE_BYTES).await.unwrap_or_default(),
            Err(_) => String::new(),
        }
    }
}

/// The bandwidth a migration of a stopped VM to a file may use (bytes/s): no throttle.
const MIGRATION_BYTES_PER_S: u64 = 1 << 40;

pub(super) fn qmp_fail(what: &'static str) -> impl FnOnce(qmp::QmpError) -> BackendError {
    // QEMU's words: a VMM taken over by its guest says what it likes.
    move |e| BackendError::internal(format!("{what}: {}", crate::backend::untrusted_text(&e.to_string(), 300)))
}

/// Most bytes a saved device state may take (the memory is never in it: it is the VM's own
/// file): what the VMM sends beyond is refused.
const MAX_STATE_BYTES: u64 = 256 << 20;
/// How long the VMM may keep the stream open once it says the save is complete.
const STATE_CLOSE_WAIT: Duration = Duration::from_secs(5);

/// Saves the stopped VM of `q` as a migration stream into a new file at `path`, synced; its
/// memory (the VM's own file) is left out. The VMM gets the write end of a
/// pipe, never the file: the edge writes the file, at most [`MAX_STATE_BYTES`], and once the
/// save is complete no descriptor the VMM may have kept reaches it.
async fn save_stream(q: &mut qmp::Qmp, path: &Path) -> Result<(), BackendError> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| BackendError::internal(format!("a pipe for the saved state: {e}")))?;
    let mut rx = tokio::net::unix::pipe::Receiver::from_owned_fd(r).map_err(internal("reading the saved state"))?;
    let mut file = tokio::fs::File::create(path).await.map_err(internal("creating the state file"))?;
    let copier = tokio::spawn(async move {
        let mut buf = vec![0u8; 1 << 16];
        let mut total = 0u64;
        loop {
            let n = rx.read(&mut buf).await.map_err(internal("reading the saved state"))?;
            if n == 0 {
                break;
            }
            total += n as u64;
            if total > MAX_STATE_BYTES {
                return Err(BackendError::internal(format!(
                    "the VMM's saved state is larger than {MAX_STATE_BYTES} bytes"
                )));
            }
            file.write_all(&buf[..n]).await.map_err(internal("writing the saved state"))?;
        }
        file.sync_all().await.map_err(internal("syncing the saved state"))
    });
    let saved = async {
        q.getfd("state", std::os::fd::AsFd::as_fd(&w)).await.map_err(qmp_fail("handing over the state pipe"))?;
        drop(w);
        q.ignore_shared().await.map_err(qmp_fail("setting x-ignore-shared"))?;
        // The vCPUs are stopped: nothing to spare them from (QEMU throttles a migration to
        // 128 MiB/s by default).
        q.execute("migrate-set-parameters", Some(serde_json::json!({ "max-bandwidth": MIGRATION_BYTES_PER_S })))
            .await
            .map_err(qmp_fail("lifting the migration's throttle"))?;
        q.execute("migrate", Some(serde_json::json!({ "uri": "fd:state" })))
            .await
            .map_err(qmp_fail("saving the device state"))?;
        wait_migration(q).await
    };
    let abort = copier.abort_handle();
    if let Err(e) = saved.await {
        abort.abort();
        return Err(e);
    }
    // QEMU closes its end once done: a VMM that holds it open still is not the VMM we started.
    match tokio::time::timeout(STATE_CLOSE_WAIT, copier).await {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Err(BackendError::internal(format!("copying the saved state: {e}"))),
        Err(_) => {
            abort.abort();
            Err(BackendError::internal("the VMM kept the saved state's stream open after the save"))
        }
    }
}

/// Waits for the migration on `q` (either side) to end.
async fn wait_migration(q: &mut qmp::Qmp) -> Result<(), BackendError> {
    loop {
        let m = q.execute("query-migrate", None).await.map_err(qmp_fail("the migration's progress"))?;
        match m["status"].as_str().unwrap_or("") {
            "completed" => return Ok(()),
            "failed" | "cancelled" => {
                return Err(BackendError::internal(format!(
                    "the migration failed: {}",
                    crate::backend::untrusted_text(m["error-desc"].as_str().unwrap_or("no reason given"), 300)
                )));
            }
            // An incoming side reports nothing until it starts, and `completed` only briefly:
            // its run state says it is done.
            "" => {
                let st = q.status().await.map_err(qmp_fail("the VM's run state"))?;
                if matches!(st.as_str(), "paused" | "running" | "postmigrate") {
                    return Ok(());
                }
            }
            _ => {}
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_host_tsc_is_known() {
        assert!(super::host_tsc_khz().is_some_and(|k| k > 100_000));
    }
}
