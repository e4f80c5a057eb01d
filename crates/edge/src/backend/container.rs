//! The `container` backend: sandboxes as Linux containers through the runtime in
//! [`crate::linuxrt`] (issue 4, item 2). The image is resolved in the store from the sandbox's
//! project upward, its layers are copied into the node-local layer cache and stacked as overlay
//! lower layers; the sandbox gets its own cgroup, upper disk and namespaces.
//!
//! Names: a sandbox `<edge>.<lease>` is the cgroup and state directory
//! `sbx-<tag>-<edge>.<lease>`, the tag a hash of the backend's state directory, so one edge's
//! clean-up (prefix `sbx-<tag>-<edge>.`) never touches another edge's sandboxes on the same
//! host, even one of the same name (another cluster, a test).
//!
//! Invariants:
//! - `<store>/inuse/<sandbox id>` (a JSON array of layer ids, see `opendsec_images::gc`) is
//!   written before the layers are used and removed once the sandbox is stopped, so image GC
//!   keeps the layers of every sandbox that may still run;
//! - all blocking work (cgroups, copies, setup, teardown) runs on blocking threads;
//! - a creation that fails leaves nothing behind (the runtime tears down what it made; the
//!   inuse file is removed here).
//!
//! PID 1 inside is the static agent (aether), bound read-only at [`AGENT_DIR`] from a
//! content-keyed copy under `<state>/.agent/`, serving the `Runtime` service on a listening
//! socket the edge bound in the sandbox's host directory (which the sandbox cannot see) and
//! handed over as fd 3. A creation returns once aether answers a Watch call; the Watch stream
//! stays open for the sandbox's life and its end marks the sandbox gone for `probe` (the edge
//! then fails it as lost). Adoption after an edge restart reconnects to the same socket.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use opendsec_proto::v1::WatchRequest;
use tonic::transport::Endpoint;

use opendsec_images::{LayerId, Store, StoreError};

use super::{AgentAccess, Backend, BackendError, BackendErrorKind, Usage, Versioned, agent_client};
use crate::linuxrt::cgroup::{self, CoreSched, IoLimits, Limits};
use crate::linuxrt::idmap::IdPool;
use crate::linuxrt::init::{Bind, PID1_LISTEN_FD};
use crate::linuxrt::reclaim;
use crate::linuxrt::rootfs::{self, LayerCache};
use crate::linuxrt::sandbox::{self, Sandbox, SandboxError, SandboxSpec};
use crate::netpol::{Network, NetworkError, Slot};
use crate::record::{PriorityRecord, SandboxRecord};

/// Cached layers unused for this long are removed by `cleanup`.
pub const LAYER_CACHE_TTL: Duration = Duration::from_secs(6 * 3600);
/// PATH given to PID 1 when neither the image nor the spec sets one.
const DEFAULT_PATH: &str = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";
/// oom_score_adj of PID 1: lowered so the sandbox's other processes are OOM-killed first.
const PID1_OOM_SCORE_ADJ: i32 = -500;
/// Where the agent's directory is bound inside a sandbox (read-only).
pub const AGENT_DIR: &str = "/.opendsec";
/// The agent binary's name, in [`AGENT_DIR`] and in the installed copy.
pub const AGENT_NAME: &str = "opendsec-agent";
/// How long a new sandbox's agent has to answer before the creation fails.
const AGENT_READY_TIMEOUT: Duration = Duration::from_secs(15);

/// How the container backend is set up.
#[derive(Clone, Debug)]
pub struct ContainerOptions {
    /// The edge's name; sandbox ids are `<edge>.<lease>`.
    pub edge: String,
    /// The image store (`config.image_store_dir()`).
    pub store_dir: PathBuf,
    /// Per-sandbox directories (`<edge state>/containers`).
    pub state_dir: PathBuf,
    /// The node-local layer cache (`<edge state>/layers`).
    pub cache_dir: PathBuf,
    /// The binary re-executed as setup process: the edge's own executable in production (it
    /// calls `linuxrt::init::run_if_init()` first thing in `main`).
    pub init_exe: PathBuf,
    /// The static agent binary (`edge.agent_path`), installed into `<state_dir>/.agent/`.
    pub agent: PathBuf,
    /// Maximum number of tasks per sandbox; 0 = none.
    pub pids_limit: u64,
    /// Page a paused sandbox's memory out, and read it back ahead on resume.
    pub pause_reclaim: bool,
    /// A running sandbox whose agent sent no heartbeat for this long is reported gone by
    /// `probe` (the edge then fails it as lost): a hung agent, not only a dead one.
    pub agent_silence: Duration,
    /// Host id ranges for the sandboxes' user namespaces; None: no user namespace (sandbox
    /// root is host root; `edge.user_namespaces: false`, for measurements only).
    pub userns: Option<IdPool>,
    /// Disk I/O limits of every sandbox on its own disk.
    pub io: IoLimits,
    /// The edge's sandbox network; `None`: sandboxes have loopback only.
    pub network: Option<Arc<Network>>,
    /// A snapshot's image stacks at most this many layers (`edge.snapshot_max_layers`).
    pub snapshot_max_layers: u32,
    /// Session sync's object storage (`edge.session_store`), if configured.
    pub sessions: Option<Arc<crate::sessions::SessionStore>>,
}

struct Held {
    sandbox: Arc<Sandbox>,
    layers: Vec<LayerId>,
    agent: AgentConn,
}

/// The edge's connection to one sandbox's agent.
#[derive(Debug)]
pub(super) struct AgentConn {
    pub(super) channel: tonic::transport::Channel,
    /// False once the Watch stream ended: the agent (PID 1) is gone or cut off.
    pub(super) alive: Arc<AtomicBool>,
    /// The last heartbeat (or resume, or adoption), for [`ContainerOptions::agent_silence`].
    last_beat: Arc<std::sync::atomic::AtomicU64>,
    /// The sandbox is frozen on purpose: its agent's silence means nothing.
    pub(super) paused: Arc<AtomicBool>,
    pub(super) watch: tokio::task::JoinHandle<()>,
}

impl AgentConn {
    /// A connection with no Watch stream, marked paused (a VM without a VMM while paused).
    pub(super) fn detached(channel: tonic::transport::Channel) -> AgentConn {
        AgentConn {
            channel,
            alive: Arc::new(AtomicBool::new(false)),
            last_beat: Arc::new(std::sync::atomic::AtomicU64::new(mono_ms())),
            paused: Arc::new(AtomicBool::new(true)),
            watch: tokio::spawn(async {}),
        }
    }

    pub(super) fn beat_now(&self) {
        self.last_beat.store(mono_ms(), Ordering::SeqCst);
    }

    /// Alive: the Watch stream is open and, unless paused, a heartbeat came within `silence`.
    pub(super) fn healthy(&self, silence: Duration) -> bool {
        if !self.alive.load(Ordering::SeqCst) {
            return false;
        }
        let quiet = mono_ms().saturating_sub(self.last_beat.load(Ordering::SeqCst));
        self.paused.load(Ordering::SeqCst) || u128::from(quiet) <= silence.as_millis()
    }
}

/// Milliseconds on a monotonic clock (heartbeat bookkeeping).
fn mono_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START.get_or_init(std::time::Instant::now).elapsed().as_millis() as u64
}

impl Drop for AgentConn {
    fn drop(&mut self) {
        self.watch.abort();
    }
}

/// The container backend. Cheap to share: `Arc<ContainerBackend>` is what the edge holds.
pub struct ContainerBackend {
    opts: ContainerOptions,
    store: Arc<Store>,
    cache: LayerCache,
    /// The installed agent's directory (bound at [`AGENT_DIR`]).
    agent_dir: PathBuf,
    /// Detected once at start: every sandbox gets its own cookie when supported.
    core_sched: CoreSched,
    cgroup_layout: String,
    /// [`name_tag`] of the state directory, computed once.
    tag: String,
    /// `/etc/resolv.conf` of networked sandboxes (the edge's DNS proxy), bound read-only.
    resolv_conf: Option<PathBuf>,
    held: Mutex<HashMap<String, Held>>,
}

impl std::fmt::Debug for ContainerBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ContainerBackend").field("opts", &self.opts).finish_non_exhaustive()
    }
}

/// The cgroup and directory name of sandbox `id` for the backend whose state directory is
/// `state_dir`: `sbx-<tag>-<id>`, the tag a hash of the state directory. Cgroup names are
/// host-wide: the tag keeps two edges of the same name on one host (two clusters, or tests)
/// from taking each other's sandboxes for leftovers.
pub fn sandbox_name(state_dir: &Path, id: &str) -> String {
    format!("{}{id}", name_tag(state_dir))
}

/// `sbx-<tag>-`: what every sandbox name of the backend at `state_dir` starts with.
pub fn name_tag(state_dir: &Path) -> String {
    format!("sbx-{}-", super::state_tag(state_dir))
}

/// Layer limits with a file and the whole no larger than a disk of `disk_mb`.
fn bounded_by_disk(disk_mb: u64) -> opendsec_images::layer::Limits {
    let disk_bytes = disk_mb.saturating_mul(1 << 20).max(1);
    let defaults = opendsec_images::layer::Limits::default();
    opendsec_images::layer::Limits {
        max_file_bytes: defaults.max_file_bytes.min(disk_bytes),
        max_layer_bytes: defaults.max_layer_bytes.min(disk_bytes),
        ..defaults
    }
}

/// The file in a sandbox's directory naming the session layer it was started with.
const SESSION_LAYER_FILE: &str = "session-layer";

/// Writes the session of sandbox `s` (stacked on `lowers`, frozen by the caller) under `paths`
/// as a zstd layer tar to `out`. A sandbox that started
/// from a saved session saves that session's layer and what it wrote since, merged: the
/// session carries its files on, not only the last run's changes.
fn write_session(
    s: &Sandbox,
    store: &Store,
    lowers: &[LayerId],
    paths: &[Vec<u8>],
    limits: &opendsec_images::layer::Limits,
    out: &Path,
) -> Result<(), BackendError> {
    use opendsec_images::snapshot::{SnapshotOptions, snapshot_layer, write_upper_tar};
    let saving = |e| BackendError::invalid_argument("the session cannot be saved").caused_by(e);
    let upper = s.open_upper().map_err(sandbox_err)?;
    let opts =
        SnapshotOptions { id_base: s.id_map.as_ref().map(|r| r.host_first), pack_diff: false, only: paths.to_vec() };
    let restored = std::fs::read_to_string(s.dir.join(SESSION_LAYER_FILE))
        .ok()
        .and_then(|t| LayerId::parse(t.trim()).ok())
        .filter(|l| lowers.last() == Some(l));
    let file = std::fs::File::create(out).map_err(|e| BackendError::internal("stage the session").caused_by(e))?;
    let mut z = zstd::Encoder::new(std::io::BufWriter::new(file), 3)
        .map_err(|e| BackendError::internal("compress the session").caused_by(e))?;
    match restored {
        None => {
            write_upper_tar(upper.as_fd(), &opts, limits, &mut z).map_err(saving)?;
        }
        Some(session) => {
            let written =
                snapshot_layer(store, upper.as_fd(), lowers, &opts, limits, "session save").map_err(saving)?;
            let image = &lowers[..lowers.len() - 1];
            let merged =
                opendsec_images::merge::merge_layers(store, &[session, written.meta.id], image).map_err(saving)?;
            let dir = std::fs::File::open(store.layer_rootfs(&merged.id))
                .map_err(|e| BackendError::internal("open the merged session").caused_by(e))?;
            // The stored layer holds the owners as the sandbox sees them already.
            let as_stored = SnapshotOptions { id_base: None, ..opts };
            write_upper_tar(dir.as_fd(), &as_stored, limits, &mut z).map_err(saving)?;
        }
    }
    let mut w = z.finish().map_err(|e| BackendError::internal("compress the session").caused_by(e))?;
    std::io::Write::flush(&mut w).map_err(|e| BackendError::internal("stage the session").caused_by(e))?;
    Ok(())
}

/// Layers (bottom first) and PID 1's image environment.
type Pinned = (Vec<LayerId>, Vec<String>);

/// The layers and image environment a moved-in sandbox was moved with; `None` for any other.
fn pinned_image(sb: &SandboxRecord) -> Result<Option<Pinned>, BackendError> {
    if sb.moved.layers.is_empty() {
        return Ok(None);
    }
    let layers = sb
        .moved
        .layers
        .iter()
        .map(|l| LayerId::parse(l).map_err(|e| BackendError::invalid_argument("moved layers").caused_by(e)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(Some((layers, sb.moved.image_env.clone())))
}

/// PID 1's environment: the image's, then the spec's (a spec variable replaces the image's of
/// the same name), and a default PATH when neither sets one. Image entries without `=` are
/// kept as names with empty values.
pub fn merge_env(image: &[String], spec: &BTreeMap<String, String>) -> Vec<String> {
    let mut order: Vec<String> = Vec::new();
    let mut values: HashMap<String, String> = HashMap::new();
    let mut set = |k: &str, v: &str| {
        if values.insert(k.to_owned(), v.to_owned()).is_none() {
            order.push(k.to_owned());
        }
    };
    for e in image {
        let (k, v) = e.split_once('=').unwrap_or((e.as_str(), ""));
        set(k, v);
    }
    for (k, v) in spec {
        set(k, v);
    }
    let mut out: Vec<String> = order.iter().map(|k| format!("{k}={}", values[k])).collect();
    if !values.contains_key("PATH") {
        out.push(DEFAULT_PATH.to_owned());
    }
    out
}

/// PID 1's command line: aether on the inherited socket, with the spec's default user and
/// working directory for sessions and processes.
pub fn agent_argv(user: &str, workdir: &str) -> Vec<String> {
    let mut argv =
        vec![format!("{AGENT_DIR}/{AGENT_NAME}"), "aether".into(), "--listen-fd".into(), PID1_LISTEN_FD.to_string()];
    for (flag, v) in [("--user", user), ("--workdir", workdir)] {
        if !v.is_empty() {
            argv.extend([flag.to_string(), v.to_string()]);
        }
    }
    argv
}

/// Cgroup limits of a sandbox from its record.
pub fn limits_of(sb: &SandboxRecord, pids_limit: u64) -> Limits {
    let r = sb.resources();
    Limits {
        cpu_millis: u64::from(r.cpu_millis),
        best_effort: sb.spec.priority == PriorityRecord::BestEffort,
        memory_bytes: r.memory_mb.saturating_mul(1 << 20),
        pids: pids_limit,
    }
}

fn store_err(e: StoreError) -> BackendError {
    let kind = match e {
        StoreError::ImageNotFound(_) | StoreError::LayerNotFound(_) => BackendErrorKind::NotFound,
        StoreError::InvalidName { .. } => BackendErrorKind::InvalidArgument,
        _ => BackendErrorKind::Unavailable,
    };
    BackendError::new(kind, "image store").caused_by(e)
}

fn rootfs_err(e: rootfs::RootfsError) -> BackendError {
    BackendError::internal("layer cache").caused_by(e)
}

pub(super) fn net_err(e: NetworkError) -> BackendError {
    let kind = match &e {
        NetworkError::Rule(_) => BackendErrorKind::InvalidArgument,
        NetworkError::Exhausted(_) => BackendErrorKind::NoCapacity,
        _ => BackendErrorKind::Unavailable,
    };
    BackendError::new(kind, "network").caused_by(e)
}

fn sandbox_err(e: SandboxError) -> BackendError {
    let kind = if matches!(e, SandboxError::Gone(_)) { BackendErrorKind::NotFound } else { BackendErrorKind::Internal };
    BackendError::new(kind, "sandbox").caused_by(e)
}

/// Whether `bytes` is an ELF executable without a program interpreter (statically linked, so
/// it runs in any image). Errors say what is wrong.
pub fn check_static_elf(bytes: &[u8]) -> Result<(), String> {
    let u16_at = |o: usize| bytes.get(o..o + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
    let u32_at = |o: usize| bytes.get(o..o + 4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]));
    let u64_at = |o: usize| bytes.get(o..o + 8).and_then(|b| b.try_into().ok()).map(u64::from_le_bytes);
    if bytes.get(..4) != Some(b"\x7fELF".as_slice()) || bytes.get(4) != Some(&2) || bytes.get(5) != Some(&1) {
        return Err("not a 64-bit little-endian ELF file".into());
    }
    let (Some(phoff), Some(phentsize), Some(phnum)) = (u64_at(0x20), u16_at(0x36), u16_at(0x38)) else {
        return Err("truncated ELF header".into());
    };
    for i in 0..usize::from(phnum) {
        let off = usize::try_from(phoff).unwrap_or(usize::MAX).saturating_add(i * usize::from(phentsize));
        match u32_at(off) {
            None => return Err("truncated program headers".into()),
            Some(3) => return Err("dynamically linked (has a program interpreter); build it with `make agent`".into()),
            Some(_) => {}
        }
    }
    Ok(())
}

/// Copies the agent into `<dir>/<content hash>/opendsec-agent` (once per content) and returns
/// that directory. Keyed by content so an upgrade never changes the binary under running
/// sandboxes (their bind mounts keep the directory they started with).
fn install_agent(src: &Path, dir: &Path) -> Result<PathBuf, BackendError> {
    use sha2::Digest;
    use std::os::unix::fs::PermissionsExt;
    let bytes = std::fs::read(src).map_err(|e| {
        BackendError::invalid_argument(format!(
            "edge.agent_path {}: {e} (build the agent with `make agent`)",
            src.display()
        ))
    })?;
    check_static_elf(&bytes)
        .map_err(|why| BackendError::invalid_argument(format!("edge.agent_path {}: {why}", src.display())))?;
    let hash = sha2::Sha256::digest(&bytes);
    let key: String = hash.iter().take(8).map(|b| format!("{b:02x}")).collect();
    let target = dir.join(key);
    let bin = target.join(AGENT_NAME);
    if std::fs::read(&bin).is_ok_and(|b| b == bytes) {
        return Ok(target);
    }
    let fail =
        |e: std::io::Error| BackendError::internal(format!("cannot install the agent in {}: {e}", target.display()));
    std::fs::create_dir_all(&target).map_err(fail)?;
    std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o755)).map_err(fail)?;
    let tmp = target.join(format!(".{AGENT_NAME}.tmp{}", rand::random::<u32>()));
    std::fs::write(&tmp, &bytes).map_err(fail)?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).map_err(fail)?;
    std::fs::rename(&tmp, &bin).map_err(fail)?;
    Ok(target)
}

/// A lazily connecting channel to the agent socket in `dir` (reconnects by itself).
fn agent_channel(dir: PathBuf) -> tonic::transport::Channel {
    let ep = Endpoint::from_static("http://agent.invalid");
    ep.connect_with_connector_lazy(tower::service_fn(move |_| {
        let dir = dir.clone();
        async move { Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(sandbox::connect_agent_socket(&dir).await?)) }
    }))
}

/// Opens the agent's Watch stream. With `ready`, waits for its first heartbeat (a new
/// sandbox: the creation succeeds only once the agent answers); without, the stream is opened
/// in the background (an adopted sandbox may be frozen and answer only after a resume).
/// The returned connection's `alive` turns false when the stream ends.
async fn watch_agent(id: &str, channel: tonic::transport::Channel, ready: bool) -> Result<AgentConn, BackendError> {
    watch_agent_within(id, channel, ready, AGENT_READY_TIMEOUT).await
}

/// [`watch_agent`], waiting up to `wait` for the first heartbeat (a VM boots first).
pub(super) async fn watch_agent_within(
    id: &str,
    channel: tonic::transport::Channel,
    ready: bool,
    wait: Duration,
) -> Result<AgentConn, BackendError> {
    let alive = Arc::new(AtomicBool::new(true));
    let last_beat = Arc::new(std::sync::atomic::AtomicU64::new(mono_ms()));
    let beat = last_beat.clone();
    let req = WatchRequest { sandbox_id: id.to_string() };
    let flag = alive.clone();
    let sid = id.to_string();
    let mut c = agent_client(channel.clone());
    let watch = if ready {
        let first = async {
            let mut s = c.watch(req).await?.into_inner();
            let hb = s.message().await?;
            Ok::<_, tonic::Status>((s, hb))
        };
        let stream = match tokio::time::timeout(wait, first).await {
            Ok(Ok((s, Some(_)))) => s,
            Ok(Ok((_, None))) => return Err(BackendError::internal(format!("agent of {id} ended its Watch stream"))),
            Ok(Err(st)) => {
                return Err(BackendError::internal(format!(
                    "agent of {id} did not answer: {}",
                    super::untrusted_text(st.message(), 300)
                )));
            }
            Err(_) => {
                return Err(BackendError::unavailable(format!(
                    "agent of {id} did not answer within {}s",
                    wait.as_secs()
                )));
            }
        };
        tokio::spawn(async move { follow(Some(stream), beat, flag, sid).await })
    } else {
        tokio::spawn(async move {
            let stream = c.watch(req).await.ok().map(|r| r.into_inner());
            follow(stream, beat, flag, sid).await
        })
    };
    // An adopted sandbox may be frozen: the caller marks it paused before anyone probes.
    Ok(AgentConn { channel, alive, last_beat, paused: Arc::new(AtomicBool::new(false)), watch })
}

/// Records each heartbeat of an open Watch stream; when it ends (or never opened), the agent is
/// gone.
async fn follow(
    stream: Option<tonic::Streaming<opendsec_proto::v1::Heartbeat>>,
    beat: Arc<std::sync::atomic::AtomicU64>,
    alive: Arc<AtomicBool>,
    sid: String,
) {
    if let Some(mut stream) = stream {
        while let Ok(Some(_)) = stream.message().await {
            beat.store(mono_ms(), Ordering::SeqCst);
        }
    }
    alive.store(false, Ordering::SeqCst);
    tracing::warn!(sandbox_id = %sid, "agent's Watch stream ended");
}

fn join_err(e: tokio::task::JoinError) -> BackendError {
    BackendError::internal(format!("blocking task failed: {e}"))
}

/// Runs blocking work on a blocking thread.
pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, BackendError> + Send + 'static,
) -> Result<T, BackendError> {
    tokio::task::spawn_blocking(f).await.map_err(join_err)?
}

impl ContainerBackend {
    /// Opens the image store and creates the state and cache directories.
    pub fn new(opts: ContainerOptions) -> Result<ContainerBackend, BackendError> {
        let store = Store::open(&opts.store_dir).map_err(store_err)?;
        // Private to the edge: layer copies hold untrusted images' setuid files, sandbox
        // directories their disks and logs.
        for d in [&opts.state_dir, &opts.cache_dir] {
            opendsec_common::fsperm::private_dir(d)
                .map_err(|e| BackendError::internal(format!("cannot create {}: {e}", d.display())))?;
        }
        let cache = LayerCache::new(&opts.cache_dir);
        let agent_dir = install_agent(&opts.agent, &opts.state_dir.join(".agent"))?;
        let opts_state_dir = opts.state_dir.clone();
        let core_sched = cgroup::detect_core_sched();
        let cgroup_layout = match cgroup::detect_layout() {
            Ok(cgroup::Layout::V1) => "linuxrt cgroup v1".to_string(),
            Ok(cgroup::Layout::V2) => "linuxrt cgroup v2".to_string(),
            Err(e) => format!("linuxrt cgroup unknown ({})", opendsec_common::reason::error_chain(&e)),
        };
        tracing::info!(core_sched = ?core_sched, cgroups = %cgroup_layout, "container backend ready");
        let resolv_conf = match &opts.network {
            Some(net) => {
                let path = opts.state_dir.join(".resolv.conf");
                let text = format!("nameserver {}\noptions edns0\n", net.dns_addr());
                std::fs::write(&path, text)
                    .map_err(|e| BackendError::internal(format!("cannot write {}: {e}", path.display())))?;
                Some(path)
            }
            None => None,
        };
        Ok(ContainerBackend {
            resolv_conf,
            opts,
            store: Arc::new(store),
            cache,
            agent_dir,
            core_sched,
            cgroup_layout,
            tag: name_tag(&opts_state_dir),
            held: Mutex::new(HashMap::new()),
        })
    }

    fn binds(&self) -> Vec<Bind> {
        let mut b =
            vec![Bind { src: self.agent_dir.clone(), dst: AGENT_DIR.into(), readonly: true, replace_link: false }];
        if let Some(r) = &self.resolv_conf {
            b.push(Bind { src: r.clone(), dst: "/etc/resolv.conf".into(), readonly: true, replace_link: true });
        }
        b
    }

    /// Connects a new sandbox (PID 1 `pid`) to the network, on a blocking thread.
    async fn attach(&self, sb: &SandboxRecord, pid: i32) -> Result<(), BackendError> {
        let Some(net) = self.opts.network.clone().filter(|_| sb.net_slot != 0) else { return Ok(()) };
        let (id, slot, rules) = (sb.id.clone(), Slot(sb.net_slot), sb.spec.egress_rules());
        let project = sb.spec.project.clone();
        blocking(move || {
            net.attach(&id, slot, &project, &rules, Path::new(&format!("/proc/{pid}/ns/net"))).map_err(net_err)
        })
        .await
    }

    /// Disconnects a sandbox (idempotent), on a blocking thread.
    async fn detach(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        let Some(net) = self.opts.network.clone().filter(|_| sb.net_slot != 0) else { return Ok(()) };
        let (id, slot) = (sb.id.clone(), Slot(sb.net_slot));
        blocking(move || net.detach(&id, slot).map_err(net_err)).await
    }

    /// The host pid of the sandbox's PID 1, when held.
    pub fn pid(&self, id: &str) -> Option<i32> {
        self.lock().get(id).map(|h| h.sandbox.pid)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Held>> {
        // Every update is one insert/remove, so the map stays consistent after a panic.
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn handle(&self, id: &str) -> Option<Arc<Sandbox>> {
        self.lock().get(id).map(|h| h.sandbox.clone())
    }

    /// Saves the session of sandbox `sb` (held as `s`, stacked on `lowers`), frozen while its
    /// files are read; `thaw`: let it run again after (unless it was paused). Returns the
    /// object's size.
    async fn save_session_of(
        &self,
        sb: &SandboxRecord,
        store: &Arc<crate::sessions::SessionStore>,
        session: &crate::record::SessionRecord,
        s: Arc<Sandbox>,
        lowers: Vec<LayerId>,
        thaw: bool,
    ) -> Result<u64, BackendError> {
        let layers = self.store.clone();
        let staged = store.staging.join(format!("{}.save", self.name(sb.container_id())));
        let paths: Vec<Vec<u8>> = session.paths.iter().map(|p| p.trim_matches('/').as_bytes().to_vec()).collect();
        let limits = bounded_by_disk(sb.resources().disk_mb);
        let out = staged.clone();
        let paused = self.lock().get(&sb.id).is_some_and(|h| h.agent.paused.load(Ordering::SeqCst));
        let refreeze = thaw && !paused;
        if refreeze {
            self.set_paused(&sb.id, true);
        }
        let written = blocking(move || {
            // Thawed after (and on any way out) only when this froze it to read it; a paused
            // sandbox stays paused, a stopping one frozen, whatever happens.
            let frozen = Frozen::new(&s, refreeze)?;
            if !refreeze {
                s.freeze().map_err(sandbox_err)?;
            }
            write_session(&s, &layers, &lowers, &paths, &limits, &out)?;
            if refreeze { frozen.thaw() } else { Ok(()) }
        })
        .await;
        if refreeze {
            self.set_paused(&sb.id, false);
        }
        let saved = match written {
            Ok(()) => store.save(&sb.spec.project, &session.name, &staged).await,
            Err(e) => Err(e),
        };
        let _ = tokio::fs::remove_file(&staged).await;
        saved
    }

    /// A sandbox naming a session (not one that moved in, which brings its files) gets it
    /// fetched to a staged file, if one was saved.
    async fn fetch_session(&self, sb: &SandboxRecord, name: &str) -> Result<Option<PathBuf>, BackendError> {
        let Some(session) = sb.spec.session.as_ref().filter(|_| sb.moved.layers.is_empty()) else { return Ok(None) };
        let store = self.opts.sessions.clone().ok_or_else(|| {
            BackendError::invalid_argument("this edge has no session store (edge.session_store): session sync is off")
        })?;
        let staged = store.staging.join(format!("{name}.restore"));
        let max = sb.resources().disk_mb.saturating_mul(1 << 20);
        match store.fetch(&sb.spec.project, &session.name, &staged, max).await {
            Ok(true) => Ok(Some(staged)),
            Ok(false) => Ok(None),
            Err(e) => {
                let _ = tokio::fs::remove_file(&staged).await;
                Err(e)
            }
        }
    }

    fn inuse_path(&self, id: &str) -> PathBuf {
        self.opts.store_dir.join("inuse").join(id)
    }

    /// Marks a sandbox frozen on purpose (its agent's silence is expected) or not; leaving the
    /// freeze restarts the silence clock.
    fn set_paused(&self, id: &str, paused: bool) {
        if let Some(h) = self.lock().get(id) {
            h.agent.paused.store(paused, Ordering::SeqCst);
            if !paused {
                h.agent.beat_now();
            }
        }
    }

    /// The cgroup and directory name of sandbox `id` (see [`sandbox_name`]).
    pub fn name(&self, id: &str) -> String {
        format!("{}{id}", self.tag)
    }

    fn prefix(&self) -> String {
        format!("{}{}.", self.tag, self.opts.edge)
    }
}

/// Writes `<store>/inuse/<id>` whole (temp file + rename).
pub(super) fn write_inuse(path: &Path, layers: &[LayerId]) -> Result<(), BackendError> {
    let ids: Vec<&str> = layers.iter().map(|l| l.as_str()).collect();
    let bytes = serde_json::to_vec(&ids).map_err(|e| BackendError::internal(format!("inuse encoding: {e}")))?;
    let tmp = path.with_extension(format!("tmp{}", rand::random::<u32>()));
    let fail = |e: std::io::Error| BackendError::unavailable(format!("cannot write {}: {e}", path.display()));
    std::fs::write(&tmp, bytes).map_err(fail)?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        fail(e)
    })
}

/// The layers an inuse file names (every parseable id; an unreadable file names none).
fn read_inuse(path: &Path) -> Vec<LayerId> {
    let Ok(bytes) = std::fs::read(path) else { return Vec::new() };
    let ids: Vec<String> = serde_json::from_slice(&bytes).unwrap_or_default();
    ids.iter().filter_map(|s| LayerId::parse(s).ok()).collect()
}

pub(super) fn remove_inuse(path: &Path) -> Result<(), BackendError> {
    match std::fs::remove_file(path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(BackendError::unavailable(format!("cannot remove {}: {e}", path.display()))),
    }
}

#[async_trait]
impl Backend for ContainerBackend {
    fn name(&self) -> &'static str {
        "container"
    }

    async fn create(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        // Not applied yet: refuse rather than hand out a sandbox without what was asked for.
        if sb.spec.resources.gpus > 0 {
            return Err(BackendError::invalid_argument("gpus are not supported by the container backend yet"));
        }
        if self.lock().contains_key(&sb.id) {
            return Err(BackendError::invalid_state(format!("container sandbox {} already exists", sb.id)));
        }
        let (store, cache) = (self.store.clone(), self.cache.clone());
        let (project, image) = (sb.spec.project.clone(), sb.spec.image.clone());
        let inuse = self.inuse_path(sb.container_id());
        let name = self.name(sb.container_id());
        // What the lease is charged for is what the disk gets: no hidden default.
        let disk_mb = sb.resources().disk_mb;
        if disk_mb == 0 {
            return Err(BackendError::invalid_argument("a container sandbox needs disk_mb of at least 1"));
        }
        let mut spec = SandboxSpec {
            name: name.clone(),
            state_dir: self.opts.state_dir.clone(),
            hostname: sb.lease_id.clone(),
            lower_dirs: Vec::new(),
            disk_mb,
            limits: limits_of(sb, self.opts.pids_limit),
            binds: self.binds(),
            masked_paths: sb.spec.masked_paths.clone(),
            readonly_paths: sb.spec.readonly_paths.clone(),
            oom_score_adj: PID1_OOM_SCORE_ADJ,
            argv: agent_argv(&sb.spec.user, &sb.spec.workdir),
            env: Vec::new(),
            init_exe: self.opts.init_exe.clone(),
            agent_socket: true,
            core_sched: self.core_sched == CoreSched::Supported,
            userns: self.opts.userns.clone(),
            io: self.opts.io,
        };
        let spec_env = sb.spec.env.clone();
        let pinned = pinned_image(sb)?;
        let restore = self.fetch_session(sb, &name).await?;
        let session_limits = bounded_by_disk(disk_mb);
        let started = blocking(move || {
            // A sandbox that moved in runs the layers it was moved with; any other, its image.
            let (layers, image_env) = match pinned {
                Some(p) => p,
                None => {
                    let (_, manifest) = store.resolve(&project, &image).map_err(store_err)?;
                    // Its layers are only what the VM booted from: the snapshot's memory and
                    // disk would be lost without a word.
                    if !manifest.vm_snapshot.is_empty() {
                        return Err(BackendError::invalid_argument(format!(
                            "image {image} is a microvm's memory snapshot: only backend microvm restores it"
                        )));
                    }
                    (manifest.layers, manifest.config.env)
                }
            };
            // A saved session goes on top, imported like any layer (it is untrusted).
            let mut layers = layers;
            let mut session_layer = None;
            if let Some(staged) = restore {
                let imported = std::fs::File::open(&staged)
                    .map_err(|e| BackendError::internal("the staged session").caused_by(e))
                    .and_then(|mut f| {
                        opendsec_images::layer::import_layer(
                            &store,
                            &mut f,
                            opendsec_images::decompress::Compression::Zstd,
                            None,
                            &layers,
                            &session_limits,
                            "session restore",
                        )
                        .map_err(|e| {
                            BackendError::invalid_argument("the saved session cannot be restored").caused_by(e)
                        })
                    });
                let _ = std::fs::remove_file(&staged);
                session_layer = Some(imported?.id);
                layers.extend(session_layer.clone());
            }
            // Write the holder file first, then use the layers (lower_dirs fails if GC took one).
            write_inuse(&inuse, &layers)?;
            let mut run = || -> Result<Sandbox, BackendError> {
                spec.lower_dirs = rootfs::lower_dirs(&cache, &store, &layers).map_err(rootfs_err)?;
                spec.env = merge_env(&image_env, &spec_env);
                Sandbox::start(&spec).map_err(sandbox_err)
            };
            match run() {
                Ok(s) => {
                    // Which layer is the session's: its next save merges onto it.
                    if let Some(l) = &session_layer
                        && let Err(e) = std::fs::write(s.dir.join(SESSION_LAYER_FILE), l.as_str())
                    {
                        tracing::warn!(sandbox = %s.name, error = %e, "recording the session layer failed");
                    }
                    Ok((s, layers))
                }
                Err(e) => match remove_inuse(&inuse) {
                    Ok(()) => Err(e),
                    Err(cleanup) => Err(e.with_cleanup(cleanup)),
                },
            }
        })
        .await?;
        let (sandbox, layers) = started;
        // The network is set up while the agent starts: creation waits for both.
        let (conn, attached) =
            tokio::join!(watch_agent(&sb.id, agent_channel(sandbox.dir.clone()), true), self.attach(sb, sandbox.pid));
        let conn = match (conn, attached) {
            (Ok(c), Ok(())) => identify(&c.channel, sb, "").await.map(|()| c),
            (Err(e), _) | (Ok(_), Err(e)) => Err(e),
        };
        let agent = match conn {
            Ok(a) => a,
            Err(e) => {
                let inuse = self.inuse_path(sb.container_id());
                let log = sandbox.dir.join("console.log");
                let tail = std::fs::read(&log).map(|b| tail_text(&b, 512)).unwrap_or_default();
                let cleanup = blocking(move || {
                    sandbox.stop().map_err(sandbox_err)?;
                    remove_inuse(&inuse)
                })
                .await
                .and(self.detach(sb).await);
                let context = if tail.is_empty() {
                    format!("the agent of {} did not come up", sb.id)
                } else {
                    format!("the agent of {} did not come up (its output: {tail})", sb.id)
                };
                // Unavailable stays unavailable (a slow start); anything else is ours.
                let kind =
                    if e.kind() == BackendErrorKind::Unavailable { e.kind() } else { BackendErrorKind::Internal };
                let err = BackendError::new(kind, context).caused_by(e);
                return Err(match cleanup {
                    Ok(()) => err,
                    Err(c) => err.with_cleanup(c),
                });
            }
        };
        self.lock().insert(sb.id.clone(), Held { sandbox: Arc::new(sandbox), layers, agent });
        Ok(())
    }

    async fn stop(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        let held = self.lock().remove(&sb.id);
        let state_dir = self.opts.state_dir.clone();
        let name = self.name(sb.container_id());
        let inuse = self.inuse_path(sb.container_id());
        // A sandbox that ends (not one that moved, nor a creation undone) saves its session.
        let save = match (&self.opts.sessions, &sb.spec.session, &held) {
            (Some(store), Some(session), Some(h))
                if sb.state == crate::state::SandboxStatus::Stopping
                    && sb.end_reason != crate::state::end_reason::MOVED =>
            {
                Some((store.clone(), session.clone(), h.sandbox.clone(), h.layers.clone()))
            }
            _ => None,
        };
        if let Some((store, session, s, lowers)) = save {
            // Frozen for good: it is about to stop.
            match self.save_session_of(sb, &store, &session, s, lowers, false).await {
                Ok(_) => tracing::info!(sandbox_id = %sb.id, session = %session.name, "session saved"),
                // The stop goes on: a sandbox must end even when the store is down.
                Err(e) => {
                    tracing::error!(sandbox_id = %sb.id, session = %session.name, error = %e.report(), "saving the session failed")
                }
            }
        }
        blocking(move || {
            let mut handle = held.map(|h| h.sandbox);
            // A probe may hold a clone for an instant; wait for it rather than leak the handle.
            for _ in 0..500 {
                match handle.take().map(Arc::try_unwrap) {
                    Some(Ok(s)) => {
                        s.stop().map_err(sandbox_err)?;
                        break;
                    }
                    Some(Err(again)) => {
                        handle = Some(again);
                        std::thread::sleep(Duration::from_millis(10));
                    }
                    None => break,
                }
            }
            if handle.is_some() {
                return Err(BackendError::unavailable(format!("sandbox {name} is busy; stop again")));
            }
            // Not held (or just stopped): remove whatever is left under its name.
            sandbox::remove_named(&state_dir, &name).map_err(sandbox_err)?;
            remove_inuse(&inuse)
        })
        .await?;
        self.detach(sb).await
    }

    async fn pause(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        let s =
            self.handle(&sb.id).ok_or_else(|| BackendError::not_found(format!("no container sandbox {}", sb.id)))?;
        self.set_paused(&sb.id, true);
        let reclaim = self.opts.pause_reclaim;
        let id = sb.id.clone();
        let r = blocking(move || {
            s.freeze().map_err(sandbox_err)?;
            if reclaim {
                let pids = s.cgroup.pids().unwrap_or_default();
                let a = reclaim::page_out(&pids);
                tracing::debug!(sandbox_id = %id, processes = a.processes, bytes = a.bytes, "paged out");
            }
            Ok(())
        })
        .await;
        if r.is_err() {
            self.set_paused(&sb.id, false);
        }
        r
    }

    async fn resume(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        let s =
            self.handle(&sb.id).ok_or_else(|| BackendError::not_found(format!("no container sandbox {}", sb.id)))?;
        let reclaim = self.opts.pause_reclaim;
        blocking(move || {
            if reclaim {
                reclaim::read_ahead(&s.cgroup.pids().unwrap_or_default());
            }
            s.thaw().map_err(sandbox_err)
        })
        .await?;
        self.set_paused(&sb.id, false);
        Ok(())
    }

    async fn probe(&self, id: &str) -> Result<bool, BackendError> {
        let silence = self.opts.agent_silence;
        let Some((s, healthy)) = self.lock().get(id).map(|h| (h.sandbox.clone(), h.agent.healthy(silence))) else {
            return Ok(false);
        };
        if !healthy {
            return Ok(false);
        }
        blocking(move || Ok(s.exited().is_none())).await
    }

    async fn adopt(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        let state_dir = self.opts.state_dir.clone();
        let name = self.name(sb.container_id());
        let inuse = self.inuse_path(sb.container_id());
        let running = sb.state == crate::state::SandboxStatus::Running;
        let (sandbox, layers) = blocking(move || {
            let s = Sandbox::adopt(&state_dir, &name).map_err(|e| match e {
                SandboxError::Cgroup(c) => BackendError::not_found(format!("sandbox {name}")).caused_by(c),
                other => sandbox_err(other),
            })?;
            // A RUNNING sandbox is never frozen: an edge that died mid-snapshot left it so.
            if running {
                s.thaw().map_err(sandbox_err)?;
            }
            Ok((s, read_inuse(&inuse)))
        })
        .await?;
        let agent = watch_agent(&sb.id, agent_channel(sandbox.dir.clone()), false).await?;
        agent.paused.store(sb.state == crate::state::SandboxStatus::Paused, Ordering::SeqCst);
        self.lock().insert(sb.id.clone(), Held { sandbox: Arc::new(sandbox), layers, agent });
        Ok(())
    }

    async fn cleanup(&self, keep: &HashSet<String>) -> Result<usize, BackendError> {
        // Called by the edge's recovery before it serves (no creation runs concurrently): a
        // sandbox created meanwhile would be judged a leftover, holder file included.
        // Held sandboxes nobody keeps go too: stopped through their handle (which reaps PID 1).
        let dropped: Vec<Arc<Sandbox>> = {
            let mut map = self.lock();
            let gone: Vec<String> = map.keys().filter(|id| !keep.contains(*id)).cloned().collect();
            gone.iter().filter_map(|id| map.remove(id)).map(|h| h.sandbox).collect()
        };
        let in_use: Vec<LayerId> = self.lock().values().flat_map(|h| h.layers.clone()).collect();
        let keep_names: Vec<String> = keep.iter().map(|id| self.name(id)).collect();
        let keep_ids = keep.clone();
        let (state_dir, cache, prefix) = (self.opts.state_dir.clone(), self.cache.clone(), self.prefix());
        let inuse_dir = self.opts.store_dir.join("inuse");
        let edge_prefix = format!("{}.", self.opts.edge);
        blocking(move || {
            let mut count = 0;
            for s in dropped {
                // A probe may still hold a clone: then the name-based clean-up below removes it.
                if let Ok(s) = Arc::try_unwrap(s) {
                    s.stop().map_err(sandbox_err)?;
                    count += 1;
                }
            }
            count += sandbox::cleanup_leftovers(&state_dir, &prefix, &keep_names).map_err(sandbox_err)?.len();
            // Holder files of this edge's sandboxes that no longer exist.
            if let Ok(rd) = std::fs::read_dir(&inuse_dir) {
                for e in rd.flatten() {
                    if let Some(n) = e.file_name().to_str()
                        && n.starts_with(&edge_prefix)
                        && !keep_ids.contains(n)
                    {
                        remove_inuse(&e.path())?;
                    }
                }
            }
            if let Err(e) = cache.prune(LAYER_CACHE_TTL, &in_use) {
                tracing::warn!(error = %opendsec_common::reason::error_chain(&e), "layer cache prune failed");
            }
            Ok(count)
        })
        .await
    }

    fn usage(&self) -> Option<Usage> {
        None
    }

    async fn metrics(&self, sb: &SandboxRecord) -> Result<super::Readings, BackendError> {
        let s = self
            .lock()
            .get(&sb.id)
            .map(|h| h.sandbox.clone())
            .ok_or_else(|| BackendError::not_found(format!("sandbox {} is not running here", sb.id)))?;
        blocking(move || {
            let st = s.stats().map_err(sandbox_err)?;
            // The sandbox's root as its processes see it: the overlay, whose statistics are
            // its upper file system's (the sandbox's own disk).
            let root = PathBuf::from(format!("/proc/{}/root/", s.pid));
            let fs = rustix::fs::statvfs(&root)
                .map_err(|e| BackendError::internal(format!("statvfs {}: {e}", root.display())))?;
            let total = fs.f_blocks.saturating_mul(fs.f_frsize);
            let free = fs.f_bfree.saturating_mul(fs.f_frsize);
            Ok(super::Readings {
                cpu_ns: st.cpu_usage_ns,
                memory_used_bytes: st.memory_usage_bytes,
                memory_limit_bytes: st.memory_limit_bytes,
                memory_cache_bytes: st.memory_cache_bytes,
                disk_used_bytes: total.saturating_sub(free),
                disk_total_bytes: total,
            })
        })
        .await
    }

    fn networked(&self) -> bool {
        self.opts.network.is_some()
    }

    fn snapshotter(&self) -> Option<&dyn super::Snapshotter> {
        Some(self)
    }

    fn warm(&self) -> Option<&dyn super::Warm> {
        Some(self)
    }

    fn agent_access(&self) -> Option<&dyn AgentAccess> {
        Some(self)
    }

    fn versioned(&self) -> Option<&dyn Versioned> {
        Some(self)
    }
}

impl Versioned for ContainerBackend {
    fn runtime_versions(&self) -> Vec<String> {
        let cs = match self.core_sched {
            CoreSched::Supported => "core scheduling: a cookie per sandbox",
            CoreSched::Unsupported => "core scheduling: not available on this kernel",
        };
        vec![self.cgroup_layout.clone(), cs.to_string()]
    }
}

impl AgentAccess for ContainerBackend {
    fn agent(&self, id: &str) -> Result<tonic::transport::Channel, BackendError> {
        match self.lock().get(id) {
            Some(h) if h.agent.healthy(self.opts.agent_silence) => Ok(h.agent.channel.clone()),
            Some(_) => Err(BackendError::unavailable(format!("the agent of {id} is gone"))),
            None => Err(BackendError::not_found(format!("no container sandbox {id} on this edge"))),
        }
    }
}

/// The `fncall` backend: container sandboxes, claimed from warm pools when they can be (the
/// edge's pools start members of this backend ahead of time), started cold otherwise. One
/// container runtime serves both names; its clean-up covers both.
#[derive(Debug)]
pub struct Fncall(pub Arc<ContainerBackend>);

#[async_trait]
impl Backend for Fncall {
    fn name(&self) -> &'static str {
        "fncall"
    }
    async fn create(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.0.create(sb).await
    }
    async fn stop(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.0.stop(sb).await
    }
    async fn pause(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.0.pause(sb).await
    }
    async fn resume(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.0.resume(sb).await
    }
    async fn probe(&self, id: &str) -> Result<bool, BackendError> {
        self.0.probe(id).await
    }
    async fn adopt(&self, sb: &SandboxRecord) -> Result<(), BackendError> {
        self.0.adopt(sb).await
    }
    async fn cleanup(&self, keep: &HashSet<String>) -> Result<usize, BackendError> {
        self.0.cleanup(keep).await
    }
    fn usage(&self) -> Option<Usage> {
        self.0.usage()
    }
    async fn metrics(&self, sb: &SandboxRecord) -> Result<super::Readings, BackendError> {
        self.0.metrics(sb).await
    }
    fn networked(&self) -> bool {
        self.0.networked()
    }
    fn versioned(&self) -> Option<&dyn Versioned> {
        None
    }
    fn agent_access(&self) -> Option<&dyn AgentAccess> {
        self.0.agent_access()
    }
    fn snapshotter(&self) -> Option<&dyn super::Snapshotter> {
        self.0.snapshotter()
    }
    fn warm(&self) -> Option<&dyn super::Warm> {
        self.0.warm()
    }
}

/// Sets the hostname of `sandbox`, from a thread that joins its UTS namespace and ends (the
/// edge's other threads keep the host's). The namespace is opened through PID 1's pid, checked
/// to still be in the sandbox's cgroup once opened (a pid reused by another process would name
/// another namespace), and never the edge's own.
fn set_hostname(sandbox: &Sandbox, name: &str) -> Result<(), BackendError> {
    use std::os::unix::fs::MetadataExt;
    let fail = |e: String| BackendError::internal(format!("cannot set the hostname: {e}"));
    let path = format!("/proc/{}/ns/uts", sandbox.pid);
    let ns = std::fs::File::open(&path).map_err(|e| fail(format!("{path}: {e}")))?;
    if !sandbox.cgroup.pids().unwrap_or_default().contains(&sandbox.pid) {
        return Err(fail(format!("pid {} is no longer the sandbox's", sandbox.pid)));
    }
    match (ns.metadata(), std::fs::metadata("/proc/self/ns/uts")) {
        (Ok(t), Ok(o)) if (t.dev(), t.ino()) != (o.dev(), o.ino()) => {}
        _ => return Err(fail(format!("{path} is not a sandbox's own UTS namespace"))),
    }
    std::thread::scope(|scope| {
        scope
            .spawn(|| -> Result<(), String> {
                rustix::thread::move_into_link_name_space(
                    std::os::fd::AsFd::as_fd(&ns),
                    Some(rustix::thread::LinkNameSpaceType::HostNameAndNISDomainName),
                )
                .map_err(|e| format!("setns {path}: {e}"))?;
                rustix::system::sethostname(name.as_bytes()).map_err(|e| format!("sethostname: {e}"))
            })
            .join()
            .map_err(|_| fail("the hostname thread panicked".into()))?
            .map_err(fail)
    })
}

/// Tells a sandbox's agent who it is: its id and the spec's env, for every session and
/// process started from now on, and its new hostname for /etc/hosts (a claimed member; empty:
/// unchanged).
pub(super) async fn identify(
    channel: &tonic::transport::Channel,
    sb: &SandboxRecord,
    hostname: &str,
) -> Result<(), BackendError> {
    let mut c = opendsec_proto::v1::agent_control_client::AgentControlClient::new(channel.clone());
    let req = opendsec_proto::v1::SetIdentityRequest {
        sandbox_id: sb.id.clone(),
        env: sb.spec.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
        hostname: hostname.to_string(),
    };
    match tokio::time::timeout(AGENT_READY_TIMEOUT, c.set_identity(req)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(st)) => Err(BackendError::internal(format!(
            "agent of {} refused its identity: {}",
            sb.id,
            super::untrusted_text(st.message(), 300)
        ))),
        Err(_) => Err(BackendError::unavailable(format!("agent of {} did not take its identity in time", sb.id))),
    }
}

#[async_trait]
impl super::Warm for ContainerBackend {
    async fn claim(&self, member: &SandboxRecord, sb: &SandboxRecord) -> Result<(), BackendError> {
        if sb.member != member.id {
            return Err(BackendError::internal(format!("sandbox {} does not name member {}", sb.id, member.id)));
        }
        // Under the sandbox's id from here on: whatever fails below, stopping the sandbox
        // stops the member's container.
        let (sandbox, channel, healthy) = {
            let mut g = self.lock();
            if g.contains_key(&sb.id) {
                return Err(BackendError::invalid_state(format!("container sandbox {} already exists", sb.id)));
            }
            let h =
                g.remove(&member.id).ok_or_else(|| BackendError::not_found(format!("no pool member {}", member.id)))?;
            let out = (h.sandbox.clone(), h.agent.channel.clone(), h.agent.healthy(self.opts.agent_silence));
            g.insert(sb.id.clone(), h);
            out
        };
        // The network's entry follows at once (it cannot fail for an attached member): a stop
        // of the sandbox after any failure below detaches it by the sandbox's id.
        if let Some(net) = self.opts.network.as_ref().filter(|_| sb.net_slot != 0) {
            net.rename(&member.id, &sb.id).map_err(net_err)?;
        }
        if !healthy {
            return Err(BackendError::unavailable(format!("the agent of pool member {} is gone", member.id)));
        }
        // Always: a member taken back after a claim cut short by a crash may hold another's.
        let limits = limits_of(sb, self.opts.pids_limit);
        let net = self.opts.network.clone().filter(|_| sb.net_slot != 0);
        let (sid, rules) = (sb.id.clone(), sb.spec.egress_rules());
        let same_rules = rules == member.spec.egress_rules();
        let hostname = sb.lease_id.clone();
        let setup = blocking(move || {
            set_hostname(&sandbox, &hostname)?;
            sandbox.cgroup.set_limits(&limits).map_err(|e| BackendError::internal("limits").caused_by(e))?;
            if let Some(net) = net.filter(|_| !same_rules) {
                net.update(&sid, &rules).map_err(net_err)?;
            }
            Ok(())
        });
        let (setup, identity) = tokio::join!(setup, identify(&channel, sb, &sb.lease_id));
        setup.and(identity)
    }
}

#[async_trait]
impl super::Snapshotter for ContainerBackend {
    async fn save_session(&self, sb: &SandboxRecord) -> Result<u64, BackendError> {
        let store = self.opts.sessions.clone().ok_or_else(|| {
            BackendError::invalid_argument("this edge has no session store (edge.session_store): session sync is off")
        })?;
        let session =
            sb.spec.session.clone().ok_or_else(|| BackendError::invalid_argument("the sandbox names no session"))?;
        let (s, lowers) = {
            let g = self.lock();
            let h = g.get(&sb.id).ok_or_else(|| BackendError::not_found(format!("no container sandbox {}", sb.id)))?;
            (h.sandbox.clone(), h.layers.clone())
        };
        self.save_session_of(sb, &store, &session, s, lowers, true).await
    }

    async fn snapshot(&self, sb: &SandboxRecord, pack_diff: bool) -> Result<super::SnapshotTaken, BackendError> {
        let (s, lowers, paused) = {
            let g = self.lock();
            let h = g.get(&sb.id).ok_or_else(|| BackendError::not_found(format!("no container sandbox {}", sb.id)))?;
            (h.sandbox.clone(), h.layers.clone(), h.agent.paused.load(Ordering::SeqCst))
        };
        // Its agent falls silent while frozen: expected, not a hang.
        if !paused {
            self.set_paused(&sb.id, true);
        }
        let store = self.store.clone();
        let max_layers = self.opts.snapshot_max_layers.max(2) as usize;
        let source = format!("snapshot of sandbox {}", sb.id);
        // PID 1's environment from the image, for a copy that moves with these layers (a
        // sandbox that moved here already has it; an image gone since gives none).
        let moved_env = (!sb.moved.layers.is_empty()).then(|| sb.moved.image_env.clone());
        let (project, image) = (sb.spec.project.clone(), sb.spec.image.clone());
        // What the sandbox wrote cannot be more than its disk holds: a sparse file claiming
        // more (written out whole by the import) is refused rather than filling the store.
        let limits = bounded_by_disk(sb.resources().disk_mb);
        let taken = blocking(move || {
            let image_env = match moved_env {
                Some(env) => env,
                None => store.resolve(&project, &image).map(|(_, m)| m.config.env).unwrap_or_default(),
            };
            let started = std::time::Instant::now();
            // Thawed on every way out, a panic included (unless it was paused before).
            let frozen = Frozen::new(&s, !paused);
            let copied = frozen.and_then(|frozen| {
                let upper = s.open_upper().map_err(sandbox_err)?;
                let opts = opendsec_images::snapshot::SnapshotOptions {
                    id_base: s.id_map.as_ref().map(|r| r.host_first),
                    pack_diff,
                    ..Default::default()
                };
                let snap =
                    opendsec_images::snapshot::snapshot_layer(&store, upper.as_fd(), &lowers, &opts, &limits, &source)
                        .map_err(snapshot_err);
                frozen.thaw().map(|()| snap)
            });
            let frozen_for = started.elapsed();
            let snap = match copied {
                Ok(Ok(snap)) => snap,
                Ok(Err(e)) | Err(e) => return Err(e),
            };
            let layers = chain(&store, &lowers, &snap.meta.id, max_layers)?;
            Ok(super::SnapshotTaken { layers, layer: snap.meta, frozen: frozen_for, image_env })
        })
        .await;
        if !paused {
            self.set_paused(&sb.id, false);
        }
        taken
    }
}

/// A sandbox frozen for a snapshot: thawed by `thaw`, or on drop (an error or a panic on the
/// way) so that a failed snapshot never leaves it frozen. A freeze that fails is undone too:
/// the cgroup may be left half frozen.
struct Frozen<'a> {
    s: &'a Sandbox,
    thaw: bool,
}

impl<'a> Frozen<'a> {
    fn new(s: &'a Sandbox, freeze: bool) -> Result<Frozen<'a>, BackendError> {
        if freeze && let Err(e) = s.freeze() {
            let e = sandbox_err(e);
            return Err(match s.thaw() {
                Ok(()) => e,
                Err(t) => e.with_cleanup(sandbox_err(t)),
            });
        }
        Ok(Frozen { s, thaw: freeze })
    }

    /// Lets it run again, unless it was frozen before (paused, or moving away): that stays.
    fn thaw(mut self) -> Result<(), BackendError> {
        if !std::mem::take(&mut self.thaw) {
            return Ok(());
        }
        self.s.thaw().map_err(sandbox_err)
    }
}

impl Drop for Frozen<'_> {
    fn drop(&mut self) {
        if self.thaw
            && let Err(e) = self.s.thaw()
        {
            tracing::error!(sandbox = %self.s.name, error = %e, "could not thaw a sandbox after a failed snapshot");
        }
    }
}

/// The layers of a snapshot's image: `lowers` plus `top`; a chain longer than `max` has its
/// upper part (everything above the bottom `max / 2` layers) merged into one layer, which
/// stacks the same ([`opendsec_images::merge`]).
fn chain(store: &Store, lowers: &[LayerId], top: &LayerId, max: usize) -> Result<Vec<LayerId>, BackendError> {
    let mut layers = lowers.to_vec();
    // An upper identical to a layer below adds nothing (and overlay cannot stack a layer twice).
    if !layers.contains(top) {
        layers.push(top.clone());
    }
    if layers.len() <= max {
        return Ok(layers);
    }
    let keep = max / 2;
    let merged = opendsec_images::merge::merge_layers(store, &layers[keep..], &layers[..keep]).map_err(snapshot_err)?;
    layers.truncate(keep);
    layers.push(merged.id);
    Ok(layers)
}

/// What a snapshot's layer could not be made of is the sandbox's content (invalid_argument:
/// a limit, an overlay feature); the rest is the node's.
fn snapshot_err(e: opendsec_images::layer::LayerError) -> BackendError {
    use opendsec_images::layer::LayerError as L;
    match e {
        L::InvalidLayer { .. } | L::TooLarge { .. } => BackendError::invalid_argument(format!("snapshot: {e}")),
        other => BackendError::internal(format!("snapshot: {other}")),
    }
}

/// The last `max` bytes of `b` as text on one line (for error messages).
fn tail_text(b: &[u8], max: usize) -> String {
    let start = b.len().saturating_sub(max);
    String::from_utf8_lossy(&b[start..]).trim().replace('\n', " | ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_merges_image_then_spec_with_default_path() {
        let spec: BTreeMap<String, String> = [("A".to_string(), "2".to_string())].into();
        let env = merge_env(&["A=1".into(), "B=x=y".into(), "C".into()], &spec);
        assert_eq!(env, vec!["A=2".to_string(), "B=x=y".into(), "C=".into(), DEFAULT_PATH.into()]);
        let env = merge_env(&["PATH=/bin".into()], &BTreeMap::new());
        assert_eq!(env, vec!["PATH=/bin".to_string()]);
    }

    #[test]
    fn the_agent_gets_the_specs_user_and_workdir() {
        assert_eq!(agent_argv("", ""), vec!["/.opendsec/opendsec-agent", "aether", "--listen-fd", "3"]);
        assert_eq!(
            agent_argv("nobody", "/work")[4..].to_vec(),
            vec!["--user".to_string(), "nobody".into(), "--workdir".into(), "/work".into()]
        );
    }

    #[test]
    fn names_carry_the_edge_so_prefixes_do_not_cross_edges() {
        let d = Path::new("/nonexistent/state");
        assert!(sandbox_name(d, "e1.l1").starts_with("sbx-") && sandbox_name(d, "e1.l1").ends_with("-e1.l1"));
        assert!(!sandbox_name(d, "e10.l1").starts_with(&sandbox_name(d, "e1.")));
        // Another state directory, another tag: same edge names do not collide.
        assert_ne!(name_tag(d), name_tag(Path::new("/nonexistent/other")));
    }

    #[test]
    fn only_static_elf_agents_are_accepted() {
        assert!(check_static_elf(b"#!/bin/sh\n").unwrap_err().contains("not a 64-bit"));
        assert!(check_static_elf(b"\x7fELF\x02\x01").unwrap_err().contains("truncated"));
        // The test binary itself is dynamically linked.
        let me = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        assert!(check_static_elf(&me).unwrap_err().contains("dynamically linked"));
        // A minimal ELF header with no program headers has no interpreter.
        let mut h = vec![0u8; 64];
        h[..6].copy_from_slice(b"\x7fELF\x02\x01");
        assert_eq!(check_static_elf(&h), Ok(()));
    }

    #[tokio::test]
    async fn a_dynamic_agent_is_refused_and_unknown_sandboxes_stop() {
        let tmp = tempfile::tempdir().unwrap();
        let opts = ContainerOptions {
            edge: "e1".into(),
            store_dir: tmp.path().join("store"),
            state_dir: tmp.path().join("containers"),
            cache_dir: tmp.path().join("layers"),
            init_exe: "/nonexistent".into(),
            agent: std::env::current_exe().unwrap(),
            pids_limit: 1024,
            pause_reclaim: false,
            agent_silence: Duration::from_secs(60),
            userns: None,
            io: IoLimits::default(),
            network: None,
            snapshot_max_layers: 32,
            sessions: None,
        };
        let e = ContainerBackend::new(opts.clone()).unwrap_err();
        assert!(
            matches!(e.kind(), BackendErrorKind::InvalidArgument) && (e.report().contains("dynamically linked")),
            "{e}"
        );
        let mut h = vec![0u8; 64];
        h[..6].copy_from_slice(b"\x7fELF\x02\x01");
        std::fs::write(tmp.path().join("agent"), &h).unwrap();
        let b = ContainerBackend::new(ContainerOptions { agent: tmp.path().join("agent"), ..opts }).unwrap();
        let rec = SandboxRecord {
            version: 1,
            id: "e1.l1".into(),
            edge: "e1".into(),
            lease_id: "l1".into(),
            principal: String::new(),
            spec: Default::default(),
            state: crate::state::SandboxStatus::Creating,
            created_at_ms: 0,
            updated_at_ms: 0,
            last_active_ms: 0,
            paused_since_ms: 0,
            end_reason: String::new(),
            ended_at_ms: 0,
            lease_released: false,
            net_slot: 0,
            member: String::new(),
            pool: String::new(),
            pool_revision: String::new(),
            moved: Default::default(),
        };
        // Stopping an unknown sandbox succeeds.
        b.stop(&rec).await.unwrap();
        assert!(!b.probe("e1.l1").await.unwrap());
    }
}
