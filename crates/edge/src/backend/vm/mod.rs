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
//! file in its directory. A microvm's pause saves it and ends its VMM; a fullvm's stops the
//! vCPUs (QMP `stop`), the memory kept. A microvm's memory snapshots and the copies restored
//! from them are in [`snapshot`].
//!
//! The VMM itself is behind a small trait ([`vmm::Vmm`]: the command that starts a VM, stop
//! and run its vCPUs, save and load its state, end it, read its console), implemented for QEMU
//! ([`qemu`]), so that Firecracker can stand beside it where it can be installed and tested;
//! everything around the VMM (files, cgroup, uid, network, confinement, snapshots, adoption)
//! is this module's.
//!
//! Cycles on purpose: `snapshot` holds [`VmBackend`]'s snapshot and restore verbs, split out
//! for length; `qemu` and `vmm` share this module's types of a VM (its shape, its disks).
//! They use this module's private helpers, and this module calls them.

pub mod disks;
mod net;
mod qemu;
pub mod qmp;
mod snapshot;
mod vmm;

use qemu::CONSOLE_BYTES;
pub use qemu::{host_tsc_khz, probe_kvm};
use vmm::{Launch, VmSpec, Vmm};

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use opendsec_images::Store;
use tonic::transport::Endpoint;

use crate::linuxrt::cgroup::{self, Limits, SandboxCgroup};
use crate::linuxrt::idmap::{IdPool, IdRange};
use opendsec_images::vmsnap;

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
    /// A running VM whose agent sent no heartbeat for this long is reported gone by `probe`.
    pub agent_silence: Duration,
    /// Where each VMM's own host uid comes from: one block of the edge's user-namespace id
    /// ranges per VM (its first id), so that a VMM shares its uid with no other process.
    pub ids: IdPool,
    /// The edge's sandbox network, when it has one: VMs then get a NIC in a namespace of
    /// their own ([`net`]).
    pub network: Option<Arc<crate::netpol::Network>>,
    /// PCI addresses of the host's GPUs that full VMs may have passed through (VFIO), one
    /// sandbox each (`edge.vm.gpu_devices`).
    pub gpu_devices: Vec<String>,
}

/// The name of sandbox `id`'s VM on the backend of `machine` whose state is `state_dir`:
/// `<backend>-<tag>.<id>`, the tag a hash of the state directory, so that the VMs of edges
/// sharing a host (their cgroups side by side) never take each other's for leftovers.
pub fn name_of(machine: Machine, state_dir: &Path, id: &str) -> String {
    format!("{}-{}.{id}", machine.backend(), super::state_tag(state_dir))
}

/// Smallest guest memory: the kernel and the agent need this much.
pub const MIN_MEMORY_MB: u64 = 128;
/// What a VMM may use beyond its guest's memory (QEMU itself, the TCG translation cache of
/// `tb-size`, device buffers), in its cgroup's memory limit.
const VMM_OVERHEAD_MB: u64 = 256;
/// Tasks per VMM (vCPU threads, QEMU's I/O workers): bounded so that no VM can take the
/// host's pids.
const VMM_PIDS: u64 = 256;
/// The file in a VM's directory that holds its VMM's host uid (the first id of its block).
const IDS_FILE: &str = "ids";
/// Writable disk of a sandbox whose spec asks for none.
const DEFAULT_DISK_MB: u64 = 1024;

/// What a VM is made of: a copy restored from its snapshot must be the same.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(super) struct Shape {
    memory_mb: u64,
    cpus: u64,
    disk_mb: u64,
    /// The image's layers (its image disk), bottom first.
    layers: Vec<opendsec_images::LayerId>,
    /// It has a NIC ([`net`]).
    #[serde(default)]
    net: bool,
    /// The host's GPUs passed through to it (PCI addresses; full VMs only).
    #[serde(default)]
    gpus: Vec<String>,
}

/// A disk handed to QEMU open, as fd set `set`.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(super) struct Drive {
    pub set: u32,
    pub path: PathBuf,
    pub writable: bool,
}

/// The file of a VM's [`Vmm`].
const VMM_FILE: &str = "vmm.json";

/// The empty, root-owned directory (in the VM state directory) every VMM chroots into.
const JAIL: &str = ".jail";

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
    /// The VMM that runs the VMs (QEMU).
    vmm: Box<dyn Vmm>,
    /// What the names of this backend's VMs start with ([`name_of`]).
    prefix: String,
    vms: Mutex<HashMap<String, Arc<Vm>>>,
    /// Held while GPUs are claimed (the claims are the VMs' `gpus` files).
    gpu_lock: Arc<Mutex<()>>,
    /// The last words of each VMM this edge started, by VM directory.
    logs: Mutex<HashMap<PathBuf, Arc<Mutex<std::collections::VecDeque<u8>>>>>,
    /// What was read of each VM's console while it started, by VM directory.
    consoles: Mutex<HashMap<PathBuf, String>>,
}

/// How much of a VMM's output the edge keeps (its last bytes).
const VMM_LOG_BYTES: usize = 16 << 10;

fn internal(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> BackendError {
    move |e| BackendError::internal(format!("{what}: {e}"))
}

impl VmBackend {
    pub fn new(opts: VmOptions) -> Result<VmBackend, BackendError> {
        if !opts.kernel_dir.join("vmlinux").exists() {
            return Err(BackendError::invalid_argument(format!(
                "no guest kernel in {} (run scripts/vm-kernel.sh)",
                opts.kernel_dir.display()
            )));
        }
        std::fs::create_dir_all(&opts.state_dir).map_err(internal("creating the VM directory"))?;
        std::fs::set_permissions(&opts.state_dir, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(internal("closing the VM directory"))?;
        let jail = opts.state_dir.join(JAIL);
        std::fs::create_dir_all(&jail).map_err(internal("creating the VMMs' empty root"))?;
        std::fs::set_permissions(&jail, std::os::unix::fs::PermissionsExt::from_mode(0o555))
            .map_err(internal("closing the VMMs' empty root"))?;
        if std::fs::read_dir(&jail).map_err(internal("reading the VMMs' empty root"))?.next().is_some() {
            return Err(BackendError::internal(format!("{} must be empty", jail.display())));
        }
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
        let vmm = qemu::Qemu::new(&opts.qemu, opts.machine, opts.accel, jail, opts.kernel_dir.clone(), initramfs)?;
        Ok(VmBackend {
            store,
            vmm: Box::new(vmm),
            prefix: name_of(opts.machine, &opts.state_dir, ""),
            vms: Mutex::new(HashMap::new()),
            gpu_lock: Arc::new(Mutex::new(())),
            logs: Mutex::new(HashMap::new()),
            consoles: Mutex::new(HashMap::new()),
            opts,
        })
    }

    /// What a VMM restoring a snapshot must match ([`Vmm::restore_key`]).
    fn vmm_key(&self) -> String {
        self.vmm.restore_key()
    }

    /// This node's copies of VM snapshots (`<vm state>/.snapshots`).
    fn snapshot_cache(&self) -> PathBuf {
        self.opts.state_dir.join(snapshot::CACHE)
    }

    /// The name of sandbox `id`'s VM: its directory, cgroup, uid claim and layer holder
    /// ([`name_of`]).
    pub fn name(&self, id: &str) -> String {
        format!("{}{id}", self.prefix)
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

    /// A lazily connecting channel to the agent in `dir` ([`serial_channel`]).
    fn agent_channel(&self, dir: &Path) -> tonic::transport::Channel {
        serial_channel(sockets_of(dir).join("agent.sock"), dir.join("pid"), self.opts.boot_timeout)
    }

    /// Resolves when the guest's console shows its init's failure line
    /// (`opendsec_proto::vmnet::INIT_FAILED`), with the reason (printable characters only: it
    /// comes from the guest); pending otherwise.
    async fn init_failure(&self, dir: &Path) -> String {
        let marker = opendsec_proto::vmnet::INIT_FAILED;
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let console = self.read_console(dir).await;
            if let Some(at) = console.rfind(marker) {
                let line = console[at + marker.len()..].lines().next().unwrap_or("").trim();
                return super::untrusted_text(line, 300);
            }
        }
    }

    /// The console's new text added to what was read of it before (reading QEMU's ring buffer
    /// empties it); its last [`CONSOLE_BYTES`].
    async fn read_console(&self, dir: &Path) -> String {
        let new = self.vmm.console(dir).await;
        let mut all = self.consoles.lock().unwrap_or_else(|p| p.into_inner());
        let kept = all.entry(dir.to_path_buf()).or_default();
        kept.push_str(&new);
        let over = kept.len().saturating_sub(CONSOLE_BYTES as usize);
        if over > 0 {
            let cut = (over..=kept.len()).find(|&i| kept.is_char_boundary(i)).unwrap_or(kept.len());
            kept.drain(..cut);
        }
        kept.clone()
    }

    /// The guest's console so far (for errors), if QEMU answers.
    async fn console(&self, dir: &Path) -> String {
        tail(self.read_console(dir).await.as_bytes())
    }

    /// Boots a new VM for `sb`, or restores one from the memory snapshot its image is (a
    /// copy: it runs on from where the snapshot's VM was, then takes an identity of its own).
    async fn launch(&self, sb: &SandboxRecord) -> Result<Arc<Vm>, BackendError> {
        let dir = self.dir_of(&sb.id);
        let store = self.store.clone();
        let (project, image) = (sb.spec.project.clone(), sb.spec.image.clone());
        let res = sb.resources();
        let wanted = Shape {
            memory_mb: res.memory_mb.max(MIN_MEMORY_MB),
            cpus: u64::from(res.cpu_millis).div_ceil(1000).max(1),
            disk_mb: if res.disk_mb == 0 { DEFAULT_DISK_MB } else { res.disk_mb },
            layers: Vec::new(),
            net: false,
            gpus: Vec::new(),
        };
        let gpus = res.gpus as usize;
        if gpus > 0 && self.opts.machine == Machine::Microvm {
            return Err(BackendError::invalid_argument(
                "a microvm has no PCI bus to pass GPUs through to: ask for backend fullvm",
            ));
        }
        // Its network, when the edge has one and gave it a slot: the namespace is set up here,
        // the veth and its rules by netpol.
        let network = self.opts.network.clone().filter(|_| sb.net_slot != 0);
        let (sid, slot, rules) = (sb.id.clone(), crate::netpol::Slot(sb.net_slot), sb.spec.egress_rules());
        let holder_exe = self.opts.agent.clone();
        if sb.spec.full_init && self.opts.machine == Machine::Microvm {
            return Err(BackendError::invalid_argument(
                "a microvm boots the agent as its init: full_init is for backend fullvm",
            ));
        }
        let config = serde_json::json!({
            "sandbox_id": sb.id,
            "hostname": sb.lease_id,
            "env": Vec::<(String, String)>::new(),
            "user": sb.spec.user,
            "workdir": sb.spec.workdir,
            "full_init": sb.spec.full_init,
            "image_pmem": self.opts.machine == Machine::Q35,
        });
        let spec_env = sb.spec.env.clone();
        let inuse = self.inuse_path(&sb.id);
        let d = dir.clone();
        let name = self.name(&sb.id);
        let pool = self.opts.ids.clone();
        let limits = Limits {
            cpu_millis: wanted.cpus * 1000,
            best_effort: sb.spec.priority == crate::record::PriorityRecord::BestEffort,
            memory_bytes: (wanted.memory_mb + VMM_OVERHEAD_MB) << 20,
            pids: VMM_PIDS,
        };
        let (vmm_key, snapshots) = (self.vmm_key(), self.snapshot_cache());
        // A full VM's image disk is mapped with DAX: shared within the project only.
        let dax_scope = (self.opts.machine == Machine::Q35).then(|| sb.spec.project.clone());
        let gpu_pool = (self.opts.gpu_devices.clone(), PathBuf::from(GPU_CLAIMS_DIR), self.gpu_lock.clone());
        let prepared = blocking(move || {
            let (_, manifest) = store
                .resolve(&project, &image)
                .map_err(|e| BackendError::invalid_argument(format!("image {image}: {e}")))?;
            // A memory snapshot: restored with exactly the shape it was taken with.
            let from = match manifest.vm_snapshot.as_str() {
                "" => None,
                id => Some(snapshot::restorable(&store, id, &image, &vmm_key, &wanted)?),
            };
            // A copy has a NIC when its snapshot's VM had one (its devices are restored as they
            // were), whether or not the network reaches it here.
            let mut shape = Shape {
                layers: from.as_ref().map(|r| r.layers.clone()).unwrap_or(manifest.layers.clone()),
                net: from.as_ref().map(|r| r.net).unwrap_or(network.is_some()),
                ..wanted
            };
            write_inuse(&inuse, &shape.layers)?;
            let disk = disks::image_disk(&store, &shape.layers, dax_scope.as_deref())?;
            // Root's alone: its sockets control the VM.
            std::fs::create_dir_all(&d).map_err(internal("creating the VM's directory"))?;
            std::fs::set_permissions(&d, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .map_err(internal("closing the VM's directory"))?;
            // The VMM's cgroup (its limits in place before it starts) and its own uid, held
            // while the cgroup exists (paused VMs included).
            let cg = SandboxCgroup::create(&name, &limits).map_err(cgroup_err)?;
            let at = cg.rel_path().to_string_lossy().into_owned();
            let ids = pool
                .claim(&name, &at, |holder| cgroup::exists_at(Path::new(holder)))
                .map_err(|e| BackendError::no_capacity(format!("no host uid for the VMM: {e}")))?;
            std::fs::write(d.join(IDS_FILE), ids.host_first.to_string())
                .map_err(internal("recording the VMM's uid"))?;
            if gpus > 0 {
                shape.gpus = claim_gpus(&gpu_pool.0, &gpu_pool.1, &d, gpus, &gpu_pool.2)?;
            }
            if shape.net {
                let procs = procs_paths(&cg)?;
                // The next id of the VM's block, not the VMM's own: a VMM taken over by its
                // guest cannot ptrace a process of another uid.
                net::start_holder(&holder_exe, &d, &procs, ids.host_first + 1)?;
                let ns = net::netns_of(&d)?;
                let out = match &network {
                    Some(n) => {
                        n.attach(&sid, slot, &project, &rules, &net::path_of(&ns))
                            .map_err(super::container::net_err)?;
                        Some((n.addrs(slot).1, n.dns_addr()))
                    }
                    None => None,
                };
                net::set_up(&ns, out)?;
            }
            let mut config = config;
            config["network"] = serde_json::json!(shape.net);
            config["env"] = serde_json::json!(
                super::container::merge_env(&manifest.config.env, &spec_env)
                    .iter()
                    .filter_map(|kv| kv.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
                    .collect::<Vec<_>>()
            );
            disks::config_disk(&d.join("config.img"), config.to_string().as_bytes())?;
            let state = match &from {
                None => {
                    disks::writable_disk(&d.join("disk.img"), shape.disk_mb)?;
                    None
                }
                Some(rec) => {
                    // The snapshot's files on this node (fetched once, shared by every copy
                    // here); the copy's disk is its own, reserved like any VM's.
                    let cached = snapshot::cached(&snapshots, &store, rec)?;
                    disks::copy_sparse(&cached.join(vmsnap::DISK), &d.join("disk.img"), shape.disk_mb << 20)?;
                    disks::reserve_existing(&d.join("disk.img"), shape.disk_mb)?;
                    disks::copy_sparse(&cached.join(vmsnap::MEM), &d.join("mem"), shape.memory_mb << 20)?;
                    Some(cached.join(vmsnap::STATE))
                }
            };
            // The guest's memory, reserved on disk (its pages are written back there, and
            // kept there while paused): a full host disk is found now, not by a running VM.
            // A copy's holds the snapshot's pages already.
            if state.is_some() {
                disks::reserve_existing(&d.join("mem"), shape.memory_mb)?;
            } else {
                disks::reserve(&d.join("mem"), shape.memory_mb)?;
            }
            Ok((disk, ids.host_first, shape, state))
        })
        .await;
        let (image_disk, uid, shape, state) = match prepared {
            Ok(v) => v,
            Err(e) => {
                let _ = self.teardown(&sb.id).await;
                return Err(e);
            }
        };
        let vmm = self.vmm.command(VmSpec { dir: &dir, image: &image_disk, shape, uid });
        let kept = serde_json::to_vec(&vmm).map_err(|e| BackendError::internal(e.to_string()))?;
        let started = async {
            std::fs::write(dir.join(VMM_FILE), kept).map_err(internal("writing the VMM's command line"))?;
            match &state {
                None => self.spawn_vmm(&dir, &vmm, false),
                // Its devices from the snapshot's stream over its copy of the snapshot's
                // memory, as a resume does, then running from where the snapshot's VM stopped.
                Some(state) => {
                    let pid = self.incoming(&dir, &vmm, state).await?;
                    self.vmm.run_vcpus(&dir).await?;
                    Ok(pid)
                }
            }
        };
        let pid = match started.await {
            Ok(pid) => pid,
            Err(e) => {
                let _ = self.teardown(&sb.id).await;
                return Err(e);
            }
        };
        // A guest whose init cannot start the agent says so on its console: no need to wait
        // out the boot timeout.
        let agent = tokio::select! {
            a = watch_agent_within(&sb.id, self.agent_channel(&dir), true, self.opts.boot_timeout) => a,
            reason = self.init_failure(&dir) => Err(BackendError::invalid_argument(format!("the guest's init failed: {reason}"))),
        };
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
        let identified = async {
            if state.is_some() {
                snapshot::post_restore(&agent.channel, sb).await?;
            }
            identify(&agent.channel, sb, &sb.lease_id).await
        };
        if let Err(e) = identified.await {
            agent.watch.abort();
            let _ = self.teardown(&sb.id).await;
            return Err(e);
        }
        self.consoles.lock().unwrap_or_else(|p| p.into_inner()).remove(&dir);
        Ok(Arc::new(Vm { dir, pid, agent }))
    }

    /// Starts the VMM of `dir` with `argv` (waiting for an incoming migration with
    /// `incoming`); returns its pid, also written to `dir/pid`.
    fn spawn_vmm(&self, dir: &Path, vmm: &Launch, incoming: bool) -> Result<i32, BackendError> {
        // Sockets an earlier VMM of this directory left would answer "refused" until this one
        // binds its own. Root's alone: they control the VM.
        let socks = sockets_of(dir);
        std::fs::create_dir_all(&socks).map_err(internal("creating the VM's socket directory"))?;
        std::fs::set_permissions(&socks, std::os::unix::fs::PermissionsExt::from_mode(0o700))
            .map_err(internal("closing the VM's socket directory"))?;
        for sock in ["qmp.sock", "agent.sock"] {
            let _ = std::fs::remove_file(socks.join(sock));
        }
        let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        let cg = SandboxCgroup::open(name).map_err(cgroup_err)?;
        let procs = procs_paths(&cg)?;
        // The disks, open here (close-on-exec in the edge, so no other child gets them; the
        // VMM's copies are made inheritable between fork and exec).
        let mut files = Vec::new();
        let mut fdsets = Vec::new();
        for d in &vmm.drives {
            let modes: &[bool] = if d.writable { &[true, false] } else { &[false] };
            for &rw in modes {
                let f = std::fs::OpenOptions::new()
                    .read(true)
                    .write(rw)
                    .open(&d.path)
                    .map_err(internal(format!("opening {}", d.path.display())))?;
                fdsets.push("-add-fd".to_string());
                fdsets.push(format!("fd={},set={}", std::os::fd::AsRawFd::as_raw_fd(&f), d.set));
                files.push(f);
            }
        }
        // The tap, opened in the VM's network namespace (the VMM lives in an empty one).
        let mut tap = None;
        if vmm.shape.net {
            let fd = net::open_tap(&net::netns_of(dir)?)?;
            fdsets.push("-netdev".to_string());
            fdsets.push(format!("tap,id=net0,fd={}", std::os::fd::AsRawFd::as_raw_fd(&fd)));
            tap = Some(fd);
        }
        let mut cmd = tokio::process::Command::new(&self.opts.qemu);
        cmd.args(&fdsets);
        // QEMU's own messages (some a guest can provoke, unthrottled) go to a pipe the edge
        // keeps the last VMM_LOG_BYTES of, never to a file that could fill the host's disk.
        cmd.args(&vmm.argv)
            .env_clear()
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .kill_on_drop(false);
        #[allow(unsafe_code)]
        // SAFETY: between fork and exec the closure makes raw system calls only (open,
        // write, unshare, setsid) on memory prepared before the fork; it allocates nothing.
        unsafe {
            let fds: Vec<std::os::fd::RawFd> = files
                .iter()
                .map(std::os::fd::AsRawFd::as_raw_fd)
                .chain(tap.as_ref().map(std::os::fd::AsRawFd::as_raw_fd))
                .collect();
            cmd.pre_exec(move || {
                for &fd in &fds {
                    rustix::io::fcntl_setfd(std::os::fd::BorrowedFd::borrow_raw(fd), rustix::io::FdFlags::empty())?;
                }
                // In its cgroup before it runs a single instruction of QEMU: every page and
                // task it makes is counted there.
                for p in &procs {
                    let fd = rustix::fs::open(p.as_c_str(), rustix::fs::OFlags::WRONLY, rustix::fs::Mode::empty())?;
                    rustix::io::write(&fd, b"0")?;
                }
                // Its own network (none: the VM has no NIC on the host), IPC and host name:
                // a VMM taken over by its guest reaches no host socket, abstract or TCP.
                rustix::thread::unshare_unsafe(
                    rustix::thread::UnshareFlags::NEWNET
                        | rustix::thread::UnshareFlags::NEWIPC
                        | rustix::thread::UnshareFlags::NEWUTS,
                )?;
                // A session of its own (no terminal), outliving the edge: adopted after a
                // restart.
                rustix::process::setsid()?;
                Ok(())
            });
        }
        if incoming {
            cmd.args(self.vmm.incoming_args());
        }
        let mut child = cmd.spawn().map_err(internal(format!("starting {}", self.opts.qemu.display())))?;
        let pid = child.id().and_then(|p| i32::try_from(p).ok()).unwrap_or(0);
        let pid_tmp = dir.join("pid.tmp");
        if let Err(e) =
            std::fs::write(&pid_tmp, pid.to_string()).and_then(|()| std::fs::rename(&pid_tmp, dir.join("pid")))
        {
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
    /// memory is the VM's file already: left out of the stream), and the VMM ended, so the host
    /// gets its memory back (the file's pages are page cache, on disk once written back).
    async fn snapshot_and_exit(&self, vm: &Vm) -> Result<(), BackendError> {
        self.vmm.stop_vcpus(&vm.dir).await?;
        let tmp = vm.dir.join("state.tmp");
        let saved = async {
            self.vmm.save(&vm.dir, &tmp).await?;
            std::fs::rename(&tmp, vm.dir.join("state")).map_err(internal("placing the saved state"))
        };
        let saved = tokio::time::timeout(self.opts.boot_timeout, saved).await.unwrap_or_else(|_| {
            Err(BackendError::unavailable(format!("the state of {} was not saved in time", vm.dir.display())))
        });
        if let Err(e) = saved {
            // Running again as before: the pause did not happen.
            let _ = self.vmm.run_vcpus(&vm.dir).await;
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        // Saved: the pause has happened whatever the VMM says to its end (it is killed next).
        let _ = self.vmm.quit(&vm.dir).await;
        vm.agent.watch.abort();
        let dir = vm.dir.clone();
        blocking(move || {
            kill_vmm(&dir);
            Ok(())
        })
        .await
    }

    /// Starts a VMM for `dir` that loads the state saved in `state` and leaves the VM
    /// stopped; returns its pid. The state leaves out the memory, which is the VM's own file
    /// already (a pause's, a snapshot's).
    async fn incoming(&self, dir: &Path, launch: &Launch, state: &Path) -> Result<i32, BackendError> {
        let pid = self.spawn_vmm(dir, launch, true)?;
        let loaded =
            tokio::time::timeout(self.opts.boot_timeout, self.vmm.load(dir, pid, state)).await.unwrap_or_else(|_| {
                Err(BackendError::unavailable(format!("the VM of {} was not restored in time", dir.display())))
            });
        match loaded {
            Ok(()) => Ok(pid),
            Err(e) => {
                let log = self.vmm_log(dir);
                let d = dir.to_path_buf();
                let _ = blocking(move || {
                    kill_vmm(&d);
                    Ok(())
                })
                .await;
                Err(BackendError::new(e.kind(), format!("{e} (vmm: {log:?})")))
            }
        }
    }

    /// The kept command line of the VM in `dir`.
    fn kept_vmm(dir: &Path) -> Result<Launch, BackendError> {
        std::fs::read(dir.join(VMM_FILE))
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .ok_or_else(|| BackendError::internal(format!("the VM in {} has no command line", dir.display())))
    }

    /// A paused microvm's resume: a new VMM restores the saved state over the same memory
    /// file and runs on; the agent's connection is made anew over its port.
    async fn restore(&self, sb: &SandboxRecord, dir: &Path) -> Result<Arc<Vm>, BackendError> {
        let launch = Self::kept_vmm(dir)?;
        let pid = self.incoming(dir, &launch, &dir.join("state")).await?;
        let run = self.vmm.run_vcpus(dir).await;
        let ran = run.is_ok();
        let agent = match run {
            Ok(()) => watch_agent_within(&sb.id, self.agent_channel(dir), true, self.opts.boot_timeout).await,
            Err(e) => Err(e),
        };
        match agent {
            Ok(agent) => {
                let _ = std::fs::remove_file(dir.join("state"));
                Ok(Arc::new(Vm { dir: dir.to_path_buf(), pid, agent }))
            }
            Err(e) => {
                // No VMM is left behind (the VM stays recorded as paused: a second restore must
                // not run beside this one on the same memory file). Once its vCPUs ran, the
                // memory is ahead of the saved state: the state goes too, so that nothing
                // restores it over that memory.
                let d = dir.to_path_buf();
                let _ = blocking(move || {
                    kill_vmm(&d);
                    if ran {
                        let _ = std::fs::remove_file(d.join("state"));
                    }
                    Ok(())
                })
                .await;
                Err(e)
            }
        }
    }

    /// Takes the sandbox's rules and addresses out of the edge's network (idempotent).
    async fn detach(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        let Some(net) = self.opts.network.clone().filter(|_| sb.net_slot != 0) else { return Ok(()) };
        let (id, slot) = (sb.id.clone(), crate::netpol::Slot(sb.net_slot));
        blocking(move || net.detach(&id, slot).map_err(super::container::net_err)).await
    }

    /// Ends the VM of `id` (if any) and removes its directory and its hold on layers.
    async fn teardown(&self, id: &str) -> Result<(), BackendError> {
        let vm = self.lock().remove(id);
        if let Some(vm) = &vm {
            vm.agent.watch.abort();
        }
        self.remove_named(self.name(id)).await
    }

    /// Ends the VM named `name` (its directory, cgroup, uid claim and holder file bear the
    /// name) and removes all it holds.
    async fn remove_named(&self, name: String) -> Result<(), BackendError> {
        let dir = self.opts.state_dir.join(&name);
        self.logs.lock().unwrap_or_else(|p| p.into_inner()).remove(&dir);
        self.consoles.lock().unwrap_or_else(|p| p.into_inner()).remove(&dir);
        let inuse = self.opts.store_dir.join("inuse").join(&name);
        let pool = self.opts.ids.clone();
        blocking(move || {
            kill_vmm(&dir);
            // Its network namespace with it (the tap and the veth go with the namespace).
            net::stop_holder(&dir);
            release_gpus(Path::new(GPU_CLAIMS_DIR), &dir);
            // Whatever is left in its cgroup goes with it (a VMM whose pid was never kept).
            if cgroup::exists_at(&cgroup::parent_rel().map_err(cgroup_err)?.1.join(&name)) {
                SandboxCgroup::open(&name).and_then(SandboxCgroup::remove).map_err(cgroup_err)?;
            }
            if let Some(first) =
                std::fs::read_to_string(dir.join(IDS_FILE)).ok().and_then(|t| t.trim().parse::<u32>().ok())
            {
                pool.release(IdRange { host_first: first, count: crate::linuxrt::idmap::RANGE }, &name)
                    .map_err(|e| BackendError::internal(format!("releasing the VMM's uid: {e}")))?;
            }
            let _ = std::fs::remove_dir_all(sockets_of(&dir));
            if dir.exists() {
                std::fs::remove_dir_all(&dir).map_err(internal(format!("removing {}", dir.display())))?;
            }
            remove_inuse(&inuse)
        })
        .await
    }
}

/// Where the sockets of the VM in `dir` are (QMP and the agent's port): a directory of its own
/// under [`SOCKETS_DIR`], named by a hash of `dir`, so that their paths stay within what a
/// unix socket's address holds (108 bytes) however deep the edge's state directory is.
pub fn sockets_of(dir: &Path) -> PathBuf {
    use sha2::Digest;
    let hash = sha2::Sha256::digest(dir.as_os_str().as_encoded_bytes());
    let key: String = hash.iter().take(10).map(|b| format!("{b:02x}")).collect();
    Path::new(SOCKETS_DIR).join(key)
}

/// The VMs' socket directories ([`sockets_of`]).
pub const SOCKETS_DIR: &str = "/run/opendsec/vm";

/// A lazily connecting channel to the agent behind the VM's serial-port socket `sock`: each
/// connection is a new connection to the socket (QEMU's), begun with the handshake of
/// `opendsec_proto::serial` (the host reads at most 16 MiB looking for the guest's answer),
/// then one HTTP/2 connection carrying every call, with the message limits of every hop
/// ([`crate::backend::agent_client`]). It waits up to `wait` for a booting guest to answer.
/// Everything the guest sends is data: what it says cannot make the edge read or hold more
/// than those bounds.
pub fn serial_channel(sock: PathBuf, pid_file: PathBuf, wait: Duration) -> tonic::transport::Channel {
    // The guest's headers are bounded well below HTTP/2's 16 MiB default: the agent sends a
    // handful of short ones.
    Endpoint::from_static("http://agent.invalid")
        .http2_max_header_list_size(GUEST_HEADER_BYTES)
        .connect_with_connector_lazy(tower::service_fn(move |_| {
            let (sock, pid_file) = (sock.clone(), pid_file.clone());
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
                                ) && pid_file.exists() =>
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

/// Most header bytes the edge takes from a guest in one answer.
const GUEST_HEADER_BYTES: u32 = 64 << 10;

/// The file in a VM's directory naming the GPUs passed through to it, one PCI address a line.
const GPUS_FILE: &str = "gpus";

/// Where GPU claims are kept, host-wide: one file per claimed device (its PCI address), naming
/// the VM directory that holds it, so that two edges on one host never pass one GPU to two
/// VMs.
pub const GPU_CLAIMS_DIR: &str = "/run/opendsec/gpus";

/// Claims `n` of `devices` for the VM in `dir` (claim files in `claims`, and the VM's `gpus`
/// file): devices whose claim names no existing VM directory. Too few free: `no_capacity`.
fn claim_gpus(
    devices: &[String],
    claims: &Path,
    dir: &Path,
    n: usize,
    lock: &Mutex<()>,
) -> Result<Vec<String>, BackendError> {
    let _held = lock.lock().unwrap_or_else(|p| p.into_inner());
    std::fs::create_dir_all(claims).map_err(internal("creating the GPU claims"))?;
    let owner = dir.display().to_string();
    let mut got = Vec::new();
    for d in devices {
        if got.len() == n {
            break;
        }
        let path = claims.join(d);
        // A claim whose VM directory is gone is stale (a VM ended without its teardown).
        if let Ok(holder) = std::fs::read_to_string(&path)
            && !Path::new(holder.trim()).is_dir()
        {
            let _ = std::fs::remove_file(&path);
        }
        let created = std::fs::OpenOptions::new().write(true).create_new(true).open(&path);
        match created {
            Ok(mut f) => {
                std::io::Write::write_all(&mut f, owner.as_bytes()).map_err(internal("writing a GPU claim"))?;
                got.push(d.clone());
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(BackendError::internal(format!("claiming GPU {d}: {e}"))),
        }
    }
    let recorded = std::fs::write(dir.join(GPUS_FILE), got.join("\n")).map_err(internal("recording the VM's GPUs"));
    if got.len() < n || recorded.is_err() {
        release_gpus(claims, dir);
        recorded?;
        return Err(BackendError::no_capacity(format!(
            "{n} GPUs asked for, {} of this edge's {} free for passthrough",
            got.len(),
            devices.len()
        )));
    }
    Ok(got)
}

/// Releases the GPU claims the VM in `dir` holds.
fn release_gpus(claims: &Path, dir: &Path) {
    let owner = dir.display().to_string();
    for d in std::fs::read_to_string(dir.join(GPUS_FILE)).unwrap_or_default().lines() {
        let path = claims.join(d.trim());
        if std::fs::read_to_string(&path).is_ok_and(|h| h.trim() == owner) {
            let _ = std::fs::remove_file(&path);
        }
    }
    let _ = std::fs::remove_file(dir.join(GPUS_FILE));
}

fn cgroup_err(e: cgroup::CgroupError) -> BackendError {
    BackendError::internal(format!("the VMM's cgroup: {e}"))
}

/// The agent connection of a VM paused by snapshot: no VMM, so no stream; marked paused.
fn paused_conn(vm: &Vm) -> AgentConn {
    vm.agent.paused.store(true, Ordering::SeqCst);
    AgentConn::detached(vm.agent.channel.clone())
}

/// The pid written in `dir/<file>`, if that process is alive and `is_it` says its arguments
/// are the expected ones (a pid file outlives its process, whose pid may be reused).
pub(super) fn pid_in(dir: &Path, file: &str, is_it: impl Fn(&[&[u8]]) -> bool) -> Option<i32> {
    let pid: i32 = std::fs::read_to_string(dir.join(file)).ok()?.trim().parse().ok()?;
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
    is_it(&args).then_some(pid)
}

/// The pid in `dir/pid`, if that process is the VMM of `dir` (an argument names its QMP
/// socket, in a directory named by a fixed-length hash of `dir`).
fn vmm_pid(dir: &Path) -> Option<i32> {
    let needle = sockets_of(dir).join("qmp.sock").display().to_string();
    pid_in(dir, "pid", |args| args.iter().any(|a| a.windows(needle.len()).any(|w| w == needle.as_bytes())))
}

/// Kills the VMM of `dir` and waits for it to be gone.
fn kill_vmm(dir: &Path) {
    kill_and_wait(dir, "the VMM", || vmm_pid(dir));
}

/// SIGKILLs the process `find` names (if any) and waits up to 5 s until `find` names none;
/// `what` and `dir` name it in the warning when it does not end.
pub(super) fn kill_and_wait(dir: &Path, what: &str, find: impl Fn() -> Option<i32>) {
    let Some(pid) = find() else { return };
    if let Some(p) = rustix::process::Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(p, rustix::process::Signal::KILL);
    }
    for _ in 0..500 {
        if find().is_none() {
            return;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    tracing::warn!(dir = %dir.display(), pid, "{what} did not end after SIGKILL");
}

/// The paths of a cgroup's `cgroup.procs` files, as the VMM's spawner writes its pid into them.
fn procs_paths(cg: &SandboxCgroup) -> Result<Vec<std::ffi::CString>, BackendError> {
    cg.procs_files()
        .into_iter()
        .map(|p| std::ffi::CString::new(p.into_os_string().into_encoded_bytes()))
        .collect::<Result<_, _>>()
        .map_err(|e| BackendError::internal(format!("a cgroup path: {e}")))
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
        match self.launch(sb).await {
            Ok(vm) => {
                self.lock().insert(sb.id.clone(), vm);
                Ok(())
            }
            Err(e) => Err(match self.detach(sb).await {
                Ok(()) => e,
                Err(de) => e.with_cleanup(de),
            }),
        }
    }

    async fn stop(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.teardown(&sb.id).await?;
        self.detach(sb).await?;
        // This node's copies of snapshots deleted from the store go with the next stop (copies
        // restored from them hold their own memory and disks), not only with the next fetch.
        if self.opts.machine == Machine::Microvm {
            let (cache, store) = (self.snapshot_cache(), self.store.clone());
            blocking(move || Ok(snapshot::prune(&cache, &store, false))).await?;
        }
        Ok(())
    }

    async fn pause(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        let vm = self.lock().get(&sb.id).cloned().ok_or_else(|| BackendError::not_found(format!("no VM {}", sb.id)))?;
        if vm.pid == 0 || vm.agent.paused.load(Ordering::SeqCst) {
            return Ok(()); // paused already
        }
        vm.agent.paused.store(true, Ordering::SeqCst);
        let r = match self.opts.machine {
            Machine::Microvm => self.snapshot_and_exit(&vm).await,
            Machine::Q35 => self.vmm.stop_vcpus(&vm.dir).await,
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
        self.vmm.run_vcpus(&vm.dir).await?;
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
        Ok(vmm == Some(vm.pid) && vm.agent.healthy(self.opts.agent_silence))
    }

    async fn adopt(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        let dir = self.dir_of(&sb.id);
        let d = dir.clone();
        let (name, pool) = (self.name(&sb.id), self.opts.ids.clone());
        let pid = blocking(move || {
            let pid = vmm_pid(&d);
            let paused = d.join("state").exists() && d.join("mem").exists();
            // Its uid is held again under its name (the claim may predate a host reboot
            // of /run, or name an earlier edge's view of the cgroup), if there is a VM.
            if (pid.is_some() || paused)
                && let Some(first) = std::fs::read_to_string(d.join(IDS_FILE)).ok().and_then(|t| t.trim().parse().ok())
            {
                let cg = SandboxCgroup::open(&name).map_err(cgroup_err)?;
                let range = IdRange { host_first: first, count: crate::linuxrt::idmap::RANGE };
                IdPool::in_dir(&pool.dir, first, 1)
                    .and_then(|p| p.confirm(range, &name, &cg.rel_path().to_string_lossy()))
                    .map_err(|e| BackendError::internal(format!("the VMM's uid: {e}")))?;
            }
            Ok(pid)
        })
        .await?;
        let Some(pid) = pid else {
            if self.opts.machine == Machine::Microvm && dir.join("state").exists() && dir.join("mem").exists() {
                // Paused by snapshot: resumed on demand.
                let agent = AgentConn::detached(self.agent_channel(&dir));
                self.lock().insert(sb.id.clone(), Arc::new(Vm { dir, pid: 0, agent }));
                return Ok(());
            }
            return Err(BackendError::not_found(format!("the VM of {} is gone", sb.id)));
        };
        let stopped = self.vmm.stopped(&dir).await?;
        let agent = watch_agent_within(&sb.id, self.agent_channel(&dir), false, self.opts.boot_timeout).await?;
        if stopped {
            agent.paused.store(true, Ordering::SeqCst);
        }
        self.lock().insert(sb.id.clone(), Arc::new(Vm { dir, pid, agent }));
        Ok(())
    }

    async fn cleanup(&self, keep: &HashSet<String>) -> Result<usize, BackendError> {
        let prefix = self.prefix.clone();
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
        // A cgroup whose directory is gone (a teardown cut short) goes too, with any VMM in it.
        for name in cgroup::list(&prefix).unwrap_or_default() {
            if let Some(id) = name.strip_prefix(&prefix)
                && !keep.contains(id)
                && !gone.iter().any(|g| g == id)
            {
                gone.push(id.to_string());
            }
        }
        for id in &gone {
            self.teardown(id).await?;
        }
        // VMs an edge started before names carried its tag (`<backend>.<id>`): none is adopted
        // across that change; each goes with what it holds.
        let old = format!("{}.", self.opts.machine.backend());
        let named_before: Vec<String> = std::fs::read_dir(&self.opts.state_dir)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with(&old))
            .collect();
        for name in named_before {
            tracing::warn!(vm = %name, "removing a VM named before names carried the edge's tag");
            self.remove_named(name).await?;
        }
        let (cache, store) = (self.snapshot_cache(), self.store.clone());
        blocking(move || Ok(snapshot::prune(&cache, &store, true))).await?;
        Ok(gone.len())
    }

    fn usage(&self) -> Option<Usage> {
        None
    }

    /// CPU and memory as the VMM's cgroup counts them (the guest's memory and QEMU's own);
    /// the disk's size, not its use: the guest's file system is the guest's, and its file on
    /// the host is allocated whole.
    async fn metrics(&self, sb: &SandboxRecord) -> Result<super::Readings, BackendError> {
        if !self.lock().contains_key(&sb.id) {
            return Err(BackendError::not_found(format!("no VM {}", sb.id)));
        }
        let name = self.name(&sb.id);
        let disk = std::fs::metadata(self.dir_of(&sb.id).join("disk.img")).map(|m| m.len()).unwrap_or(0);
        blocking(move || {
            let st = SandboxCgroup::open(&name).and_then(|c| c.stats()).map_err(cgroup_err)?;
            Ok(super::Readings {
                cpu_ns: st.cpu_usage_ns,
                memory_used_bytes: st.memory_usage_bytes,
                memory_limit_bytes: st.memory_limit_bytes,
                memory_cache_bytes: st.memory_cache_bytes,
                disk_used_bytes: 0,
                disk_total_bytes: disk,
            })
        })
        .await
    }

    fn networked(&self) -> bool {
        self.opts.network.is_some()
    }

    fn versioned(&self) -> Option<&dyn Versioned> {
        Some(self)
    }

    fn agent_access(&self) -> Option<&dyn AgentAccess> {
        Some(self)
    }

    fn vm_snapshotter(&self) -> Option<&dyn super::VmSnapshotter> {
        (self.opts.machine == Machine::Microvm).then_some(self as &dyn super::VmSnapshotter)
    }
}

impl Versioned for VmBackend {
    fn runtime_versions(&self) -> Vec<String> {
        let release = std::fs::read_to_string(self.opts.kernel_dir.join("release")).unwrap_or_default();
        vec![self.vmm.version(), format!("guest linux {}", release.trim())]
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
    fn gpus_go_to_one_vm_each_across_edges() {
        let (state, claims) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let devices = vec!["0000:01:00.0".to_string(), "0000:02:00.0".to_string()];
        let lock = std::sync::Mutex::new(());
        let dir = |n: &str| {
            let d = state.path().join(n);
            std::fs::create_dir_all(&d).unwrap();
            d
        };
        let claim = |n: &str, k| super::claim_gpus(&devices, claims.path(), &dir(n), k, &lock);
        let a = claim("edge-1/a", 1).unwrap();
        // Another edge's VM on the same host: the claims are the host's.
        let b = claim("edge-2/b", 1).unwrap();
        assert_eq!((a.as_slice(), b.as_slice()), (&devices[..1], &devices[1..]));
        let e = claim("edge-1/c", 1).unwrap_err();
        assert_eq!(e.kind(), crate::backend::BackendErrorKind::NoCapacity, "{e}");
        // Two asked for, one free: nothing is kept.
        super::release_gpus(claims.path(), &state.path().join("edge-2/b"));
        assert!(claim("edge-1/c", 2).is_err());
        assert_eq!(claim("edge-1/d", 1).unwrap(), b);
        // A VM gone without its teardown (its directory removed) gives its GPU back.
        std::fs::remove_dir_all(state.path().join("edge-1/a")).unwrap();
        assert_eq!(claim("edge-1/e", 1).unwrap(), a);
    }
}
