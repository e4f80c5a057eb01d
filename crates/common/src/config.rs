//! The cluster config: one JSON file, every section with defaults, unknown fields rejected, and
//! validation whose messages name the bad field (`apiserver.placement.k: ...`).
//!
//! One file describes the whole cluster; each daemon reads its own section, and
//! `opendsecctl cluster up` reads them all. Durations are humantime strings ("1s", "250ms").

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// Placeholders a config may still hold from an example; a token containing one is refused.
pub const PLACEHOLDERS: [&str; 3] = ["change-me", "changeme", "replace-me"];

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("failed to read config {path}: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("config {path}: {field}: {message}")]
    Parse { path: String, field: String, message: String },
    #[error("config: {field}: {message}")]
    Invalid { field: String, message: String },
}

fn invalid(field: &str, message: impl Into<String>) -> ConfigError {
    ConfigError::Invalid { field: field.to_string(), message: message.into() }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where every component keeps its state (IAM store, edge records, audit log, tokens).
    pub state_dir: PathBuf,
    /// Certificates of every link (mTLS between components, TLS on the public port).
    pub tls: TlsConfig,
    pub iam: IamConfig,
    pub apiserver: ApiserverConfig,
    pub watcher: WatcherConfig,
    /// Settings shared by every edge.
    pub edge: EdgeConfig,
    /// Edges the watcher knows from the start (besides those that register themselves).
    pub edges: Vec<EdgeEndpoint>,
    /// How many sim edges `cluster up` starts (overridden by `--sim-edges`).
    pub sim_edges: u32,
    /// How many IAM members `cluster up` runs in its process (1: standalone; 3 or 5: Raft,
    /// each its own store and port, overridden by `--iam-replicas`). Fixed at the first start
    /// of a state directory.
    pub iam_replicas: u32,
    /// The image store every apiserver and edge mounts.
    pub images: ImagesConfig,
    /// Sandbox networking (docs/network.md).
    pub network: NetworkConfig,
    /// The E2B-compatible gateway (docs/e2b.md).
    pub e2b: E2bConfig,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            state_dir: PathBuf::from("opendsec-state"),
            tls: TlsConfig::default(),
            iam: IamConfig::default(),
            apiserver: ApiserverConfig::default(),
            watcher: WatcherConfig::default(),
            edge: EdgeConfig::default(),
            edges: Vec::new(),
            sim_edges: 4,
            iam_replicas: 1,
            images: ImagesConfig::default(),
            network: NetworkConfig::default(),
            e2b: E2bConfig::default(),
        }
    }
}

/// The E2B gateway (`opendsec e2b`, started by `cluster up`): E2B's REST and in-sandbox APIs
/// on one port, served with each caller's own token through the public API.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct E2bConfig {
    /// Where it listens (E2B's SDKs reach it with `E2B_API_URL` and `E2B_SANDBOX_URL`):
    /// HTTPS/1.1 when the cluster has TLS, else plain HTTP/1.1 on a loopback address only
    /// (API keys would cross it in the clear). Empty: `cluster up` starts no gateway.
    pub listen: String,
    /// The certificate and key (one PEM file) the gateway presents. Default the gateway's
    /// bundle, `<pki dir>/gateway-0.pem` (`cluster up` issues it; `opendsecctl pki issue --id
    /// gateway/NAME`): it carries the names public clients check and opens nothing inside the
    /// cluster. A certificate from a public CA works too (then E2B's SDKs need no extra trust).
    pub tls_bundle: Option<PathBuf>,
    /// The apiservers the gateway calls (`host:port`); `cluster up` fills in its own.
    pub apiserver_addrs: Vec<String>,
    /// E2B template names and the images they stand for (in the caller's project). A
    /// template not listed is an image name itself.
    pub templates: std::collections::BTreeMap<String, String>,
    /// The backend E2B sandboxes run on.
    pub backend: String,
    /// What each E2B sandbox gets (E2B's SDK names none): millicores, MiB of memory, MiB of
    /// writable disk.
    pub cpu_millis: u32,
    pub memory_mb: u64,
    pub disk_mb: u64,
    /// The user commands and files use when a call names none (E2B's templates use `user`).
    pub default_user: String,
    /// Connections one source address may hold open to the gateway (0: no cap; behind a load
    /// balancer every client shares its address).
    pub max_connections_per_source: u32,
    /// A connection waiting for a request's headers (idle between requests, or sending them
    /// slowly) is closed after this.
    #[serde(with = "humantime_serde")]
    pub idle_timeout: Duration,
    /// Failed authentications from one of the gateway's callers (a source address) that
    /// pause it at the gateway; the apiserver counts them per caller too, from the address the
    /// gateway passes on.
    pub auth_failures: AuthFailureConfig,
    /// The domain sandbox hosts are under, as E2B's SDKs reach it (`<port>-<id>.<domain>`:
    /// `get_host(port)`, and envd's URL when `E2B_SANDBOX_URL` is not set), with `:port`
    /// unless it is 443. Every name under it must reach the gateway (a wildcard DNS record)
    /// and be on its certificate. Empty: `sandbox.localhost:<the gateway's port>` (every
    /// `*.localhost` name is the loopback address where `libnss-myhostname` is installed, as
    /// `make setup` does).
    pub domain: String,
    /// An auto-pausing sandbox's (E2B's `autoPause`) lifetime, and how long it is kept
    /// paused: its timeout pauses it, and these end it. Within the apiserver's TTL maximum.
    #[serde(with = "humantime_serde")]
    pub auto_pause_lifetime: Duration,
}

impl Default for E2bConfig {
    fn default() -> Self {
        E2bConfig {
            listen: "127.0.0.1:0".into(),
            tls_bundle: None,
            apiserver_addrs: Vec::new(),
            templates: [("base", "e2b-base:latest"), ("code-interpreter-v1", "code-interpreter-v1:latest")]
                .into_iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            backend: "container".into(),
            cpu_millis: 2000,
            memory_mb: 512,
            disk_mb: 2048,
            default_user: "user".into(),
            max_connections_per_source: 1024,
            idle_timeout: Duration::from_secs(60),
            auth_failures: AuthFailureConfig::default(),
            domain: String::new(),
            auto_pause_lifetime: Duration::from_secs(24 * 3600),
        }
    }
}

/// Where a component finds its certificates (`opendsecctl pki` makes them; `cluster up` makes
/// its own in `<state_dir>/pki`).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TlsConfig {
    /// The PKI directory: `ca.pem` and one bundle (certificate + key) per component,
    /// `<role>-<name>.pem`. Default `<state_dir>/pki`.
    pub dir: Option<PathBuf>,
    /// The CA certificates this process trusts. Default `<dir>/ca.pem`.
    pub ca: Option<PathBuf>,
    /// This daemon's bundle. Default `<dir>/<role>-<name>.pem` (names: `0` for IAM, the
    /// watcher and the apiserver, `edge.name` for an edge).
    pub bundle: Option<PathBuf>,
    /// How long the certificates `cluster up` issues are valid; it issues them afresh at every
    /// start and again each third of this while it runs.
    #[serde(with = "humantime_serde")]
    pub leaf_lifetime: Duration,
}

impl Default for TlsConfig {
    fn default() -> Self {
        TlsConfig { dir: None, ca: None, bundle: None, leaf_lifetime: Duration::from_secs(24 * 3600) }
    }
}

#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EdgeEndpoint {
    pub name: String,
    pub address: String,
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct IamConfig {
    pub listen: String,
    /// Addresses other components use to reach IAM (filled by `cluster up`).
    pub addrs: Vec<String>,
    /// The administrator's token, `dsk.<id>.<secret>`. Empty: `cluster up` generates one and
    /// writes it to `<state_dir>/admin.token`.
    pub admin_token: String,
    pub admin_principal: String,
    /// Default `<state_dir>/iam`.
    pub data_dir: Option<PathBuf>,
    /// Reconciliation never releases a lease younger than this.
    #[serde(with = "humantime_serde")]
    pub reconcile_min_age: Duration,
    /// Most commands applied in one durable store transaction (group commit).
    pub commit_batch_max: usize,
    /// Replicated IAM (Raft, docs/iam-raft.md). Absent: standalone, a log of one.
    pub raft: Option<IamRaftConfig>,
}

/// One member of a replicated IAM.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct IamRaftConfig {
    /// This member's id: at least 1, unique in the cluster, never reused for another disk.
    pub id: u64,
    /// The cluster's first members, id → host:port, this one included. Used once, on a member
    /// with an empty log: the one with the lowest id initializes the cluster with them. Empty
    /// on a member that joins later (`opendsecctl iam add`), which waits to be added.
    pub initial_members: std::collections::BTreeMap<u64, String>,
    #[serde(with = "humantime_serde")]
    pub heartbeat_interval: Duration,
    /// A follower that hears no leader for this long (up to half as long again, at random)
    /// calls an election.
    #[serde(with = "humantime_serde")]
    pub election_timeout: Duration,
    /// A snapshot of the state is taken every this many log entries; the log before it is
    /// then dropped, and a member that fell further behind installs the snapshot.
    pub snapshot_every: u64,
}

impl Default for IamRaftConfig {
    fn default() -> Self {
        IamRaftConfig {
            id: 0,
            initial_members: Default::default(),
            heartbeat_interval: Duration::from_millis(150),
            election_timeout: Duration::from_millis(600),
            snapshot_every: 20_000,
        }
    }
}

impl Default for IamConfig {
    fn default() -> Self {
        IamConfig {
            listen: "127.0.0.1:0".into(),
            addrs: Vec::new(),
            admin_token: String::new(),
            admin_principal: "admin".into(),
            data_dir: None,
            reconcile_min_age: Duration::from_secs(60),
            commit_batch_max: 4096,
            raft: None,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ApiserverConfig {
    pub listen: String,
    /// `/metrics`, `/healthz`, `/readyz`; empty: not served.
    pub metrics_listen: String,
    /// Authentication and authorization results are cached this long (never past a token's expiry).
    #[serde(with = "humantime_serde")]
    pub auth_cache_ttl: Duration,
    /// How often IAM's security epoch is polled; a change clears the caches.
    #[serde(with = "humantime_serde")]
    pub epoch_poll_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub snapshot_refresh: Duration,
    /// /readyz fails after this long without an IAM answer or a watcher snapshot.
    #[serde(with = "humantime_serde")]
    pub readiness_grace: Duration,
    pub ttl: TtlConfig,
    /// Token bucket per principal: creations per second and burst.
    pub rate_per_principal: f64,
    pub burst_per_principal: f64,
    /// Creations in flight on this apiserver. The slots go round-robin between the principals
    /// waiting; a single creation waits up to `creation_slot_wait` (then `rate_limited`),
    /// batch items wait.
    pub max_inflight_creations: usize,
    /// Creations of one `CreateSandboxes` call run this many at a time.
    pub batch_concurrency: usize,
    pub placement: PlacementConfig,
    pub audit: AuditConfig,
    /// Timeout of one call to an edge.
    #[serde(with = "humantime_serde")]
    pub edge_call_timeout: Duration,
    /// Serve the public API in plain text instead of TLS: local development only, refused
    /// unless `listen` is a loopback address.
    pub insecure_plaintext: bool,
    /// Failed authentications from one source address that pause it.
    pub auth_failures: AuthFailureConfig,
    /// Public calls of any kind one principal may have in flight (each holds its decoded
    /// request until it answers); beyond, `rate_limited`.
    pub max_calls_per_principal: u32,
    /// Connections one source address may hold open to the public port (0: no cap; behind a
    /// proxy every client shares its address).
    pub max_connections_per_source: u32,
    /// Runtime calls (exec, files, HTTP, processes) one principal may have in flight.
    pub max_runtime_calls_per_principal: u32,
    /// Bytes the answers of unary Runtime calls in flight (exec results, output, HTTP
    /// bodies) may hold at once, summed over every caller; an answer that does not fit waits.
    pub runtime_result_budget_mb: u64,
    /// The most of that budget one tenant's answers hold at once (percent; a tenant is a
    /// top-level project with everything below it).
    pub runtime_result_share_percent: u32,
    /// How long a single creation waits for a creation slot (slots go round-robin between
    /// the principals waiting) before it gets `rate_limited`.
    #[serde(with = "humantime_serde")]
    pub creation_slot_wait: Duration,
}

/// The auth-failure pause (reference section 1): `max` failed authentications from one source
/// address within `window` make every call from it `unauthenticated` for `pause`, without
/// asking IAM. Tokens IAM refused are refused again without asking for `negative_ttl`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AuthFailureConfig {
    /// 0: never pause.
    pub max: u32,
    #[serde(with = "humantime_serde")]
    pub window: Duration,
    #[serde(with = "humantime_serde")]
    pub pause: Duration,
    #[serde(with = "humantime_serde")]
    pub negative_ttl: Duration,
}

impl Default for AuthFailureConfig {
    fn default() -> Self {
        AuthFailureConfig {
            max: 50,
            window: Duration::from_secs(10),
            pause: Duration::from_secs(30),
            negative_ttl: Duration::from_secs(10),
        }
    }
}

impl Default for ApiserverConfig {
    fn default() -> Self {
        ApiserverConfig {
            listen: "127.0.0.1:7000".into(),
            metrics_listen: "127.0.0.1:0".into(),
            auth_cache_ttl: Duration::from_secs(30),
            epoch_poll_interval: Duration::from_secs(1),
            snapshot_refresh: Duration::from_secs(1),
            readiness_grace: Duration::from_secs(15),
            ttl: TtlConfig::default(),
            rate_per_principal: 10_000.0,
            burst_per_principal: 40_000.0,
            max_inflight_creations: 2048,
            batch_concurrency: 128,
            placement: PlacementConfig::default(),
            audit: AuditConfig::default(),
            edge_call_timeout: Duration::from_secs(30),
            insecure_plaintext: false,
            auth_failures: AuthFailureConfig::default(),
            max_calls_per_principal: 512,
            max_connections_per_source: 1024,
            max_runtime_calls_per_principal: 256,
            runtime_result_budget_mb: 2048,
            runtime_result_share_percent: 25,
            creation_slot_wait: Duration::from_secs(5),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct TtlConfig {
    #[serde(with = "humantime_serde")]
    pub default_running_stop: Duration,
    #[serde(with = "humantime_serde")]
    pub default_max: Duration,
    #[serde(with = "humantime_serde")]
    pub default_paused: Duration,
    /// No TTL may be longer than this.
    #[serde(with = "humantime_serde")]
    pub max: Duration,
}

impl Default for TtlConfig {
    fn default() -> Self {
        TtlConfig {
            default_running_stop: Duration::from_secs(600),
            default_max: Duration::from_secs(3600),
            default_paused: Duration::from_secs(3600),
            max: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct PlacementConfig {
    /// Candidates drawn for power-of-k.
    pub k: usize,
    /// Actual use below this share does not count towards load.
    pub usage_floor: f64,
    /// Edges tried for one creation.
    pub max_attempts: usize,
    /// How long an edge that refused stays a last choice.
    #[serde(with = "humantime_serde")]
    pub penalty: Duration,
    /// Creations are placed in runs of this many on one edge: a `CreateSandboxes` call's
    /// items (each run's edge chosen as one creation of the whole run would be), and single
    /// creations of one backend and size made while another of their run is under way (the
    /// run's edge is where its first went). One that does not fit there is placed alone.
    /// The edge makes concurrent ones in one call and one record write; 1 places every
    /// creation on its own.
    pub batch_run: u32,
}

impl Default for PlacementConfig {
    fn default() -> Self {
        PlacementConfig { k: 2, usage_floor: 0.2, max_attempts: 3, penalty: Duration::from_secs(10), batch_run: 16 }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct AuditConfig {
    pub enabled: bool,
    /// Default `<state_dir>/audit/apiserver.log`.
    pub path: Option<PathBuf>,
    /// Rotated past this size.
    pub max_bytes: u64,
    /// Rotated files kept (`.1` newest).
    pub keep: u32,
}

impl Default for AuditConfig {
    fn default() -> Self {
        AuditConfig { enabled: true, path: None, max_bytes: 64 << 20, keep: 5 }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct WatcherConfig {
    pub listen: String,
    /// Addresses other components use to reach the watchers (filled by `cluster up`).
    pub addrs: Vec<String>,
    #[serde(with = "humantime_serde")]
    pub probe_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub probe_timeout: Duration,
    /// Consecutive failed probes that make an edge unhealthy.
    pub failure_threshold: u32,
    #[serde(with = "humantime_serde")]
    pub reconcile_interval: Duration,
    /// An edge unhealthy this long is reconciled as empty (its quota released).
    #[serde(with = "humantime_serde")]
    pub lost_edge_grace: Duration,
    /// Leases bound to edges no watcher knows are released after this long.
    #[serde(with = "humantime_serde")]
    pub sweep_unbound_after: Duration,
    /// TTL of the IAM lock that elects the reconciling watcher.
    #[serde(with = "humantime_serde")]
    pub lock_ttl: Duration,
}

impl Default for WatcherConfig {
    fn default() -> Self {
        WatcherConfig {
            listen: "127.0.0.1:0".into(),
            addrs: Vec::new(),
            probe_interval: Duration::from_secs(1),
            probe_timeout: Duration::from_secs(2),
            failure_threshold: 3,
            reconcile_interval: Duration::from_secs(30),
            lost_edge_grace: Duration::from_secs(120),
            sweep_unbound_after: Duration::from_secs(600),
            lock_ttl: Duration::from_secs(15),
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct EdgeConfig {
    /// This edge's name (`opendsec edge`); sim edges of `cluster up` are named `sim-NNN`.
    pub name: String,
    pub listen: String,
    /// The address others reach this edge at (default: the bound listen address).
    pub advertise: String,
    /// Default `<state_dir>/edges/<name>`.
    pub state_dir: Option<PathBuf>,
    pub backends: Vec<String>,
    pub capacity: CapacityConfig,
    pub max_sandboxes: u32,
    /// How often TTLs are checked.
    #[serde(with = "humantime_serde")]
    pub ttl_check_interval: Duration,
    /// Ended leases are released in batches of this many, or after `release_interval`.
    pub release_batch: usize,
    #[serde(with = "humantime_serde")]
    pub release_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub register_interval: Duration,
    /// Refuse creations when MemAvailable is below this share of RAM (at least 128 MiB).
    pub memory_reserve_fraction: f64,
    /// Refuse creations when the file system holding the state has less free space than this.
    pub disk_reserve_mb: u64,
    /// Leave sandboxes running when the edge exits, and adopt them again on start.
    pub keep_sandboxes_on_exit: bool,
    /// Stopped and failed records are kept this long for `get`, then removed.
    #[serde(with = "humantime_serde")]
    pub ended_retention: Duration,
    /// The static `opendsec-agent` binary run as PID 1 of every container sandbox (`make
    /// agent` builds it). Default: `opendsec-agent` beside the running executable, else
    /// `../x86_64-unknown-linux-gnu/release/opendsec-agent` from its directory (the cargo
    /// layout). A dynamically linked binary is refused at start.
    pub agent_path: Option<PathBuf>,
    /// Maximum number of tasks per container sandbox; 0 = none.
    pub container_pids_limit: u64,
    /// Push a paused container sandbox's memory out (`process_madvise(MADV_PAGEOUT)`: to swap
    /// when the host has it, clean file pages dropped) and read it back ahead on resume.
    pub pause_reclaim: bool,
    /// A running container sandbox whose agent sends no heartbeat for this long is lost: it is
    /// torn down and its lease released (a paused sandbox's silence is expected).
    #[serde(with = "humantime_serde")]
    pub agent_silence: Duration,
    /// A snapshot's image stacks at most this many layers: past it, the layers above the
    /// bottom half are merged into one (long fork chains), which stacks the same.
    pub snapshot_max_layers: u32,
    /// The binary re-executed as a container's setup process; default: the running executable
    /// (which calls `linuxrt::init::run_if_init()` first in `main`). Tests point it elsewhere.
    pub container_setup_exe: Option<PathBuf>,
    /// Run every container sandbox in a user namespace of its own (its root is an
    /// unprivileged host id). Off only to measure what it costs.
    pub user_namespaces: bool,
    /// The first host id of the sandboxes' id ranges (a multiple of 65536); each sandbox
    /// holds 65536 ids, claimed host-wide (under `/run/opendsec/userns`) so that edges sharing
    /// a host never hand out the same range.
    pub userns_first_id: u32,
    /// How many ranges of 65536 ids from `userns_first_id` this edge may hand out.
    pub userns_ranges: u32,
    /// Disk I/O limits of each container sandbox on its own disk.
    pub disk_io: DiskIoConfig,
    /// Runtime calls one sandbox may have in flight through this edge.
    pub max_runtime_calls_per_sandbox: u32,
    /// Bytes the answers of unary Runtime calls in flight through this edge may hold at once;
    /// an answer that does not fit waits.
    pub runtime_result_budget_mb: u64,
    /// The most of that budget one tenant's sandboxes' answers hold at once (percent).
    pub runtime_result_share_percent: u32,
    /// How often the edge reads the warm pools from IAM (and at least how often it tops them
    /// up; a claim tops up at once).
    #[serde(with = "humantime_serde")]
    pub pool_refresh: Duration,
    /// Warm pool members started at once on this edge.
    pub pool_starts: u32,
    /// The most of this edge's capacity (each of CPU, memory, disk and sandboxes) idle pool
    /// members may hold, in percent: the rest is always left to creations.
    pub pool_share_percent: u32,
    /// S3-compatible object storage for session sync (docs/sessions.md); none: sandboxes that
    /// name a session are refused.
    pub session_store: Option<SessionStoreConfig>,
    /// A move between edges left unfinished this long (its apiserver died) is settled by the
    /// source edge from where IAM binds the lease (docs/move.md). Must outlast IAM's
    /// reconciliation twice over (`iam.reconcile_min_age` + `watcher.reconcile_interval`):
    /// a lease still bound to the target after that is held there.
    #[serde(with = "humantime_serde")]
    pub move_stale: Duration,
    /// The VM backends (`microvm`, `fullvm`; docs/vms.md).
    pub vm: VmConfig,
}

/// The VM backends' settings.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct VmConfig {
    /// The guest kernel and its modules, as scripts/vm-kernel.sh makes them (it prints the
    /// directory); needed when `edge.backends` names a VM backend.
    pub kernel_dir: Option<PathBuf>,
    /// The QEMU binary.
    pub qemu: String,
    /// `kvm`, `tcg` (software emulation), or `auto`: KVM when a short boot under it succeeds
    /// at edge start (the answer is kept per host kernel, QEMU and guest kernel), else TCG.
    pub accel: String,
    /// How long a VM may take from launch to its agent answering.
    #[serde(with = "humantime_serde")]
    pub boot_timeout: Duration,
    /// PCI addresses (`0000:01:00.0`) of the host's GPUs that full VMs may have passed through
    /// (VFIO): bound to `vfio-pci` by the operator, one sandbox each. `edge.capacity.gpus`
    /// should count them. Empty: a fullvm asking for GPUs is `no_capacity`.
    pub gpu_devices: Vec<String>,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig {
            kernel_dir: None,
            qemu: "qemu-system-x86_64".into(),
            accel: "auto".into(),
            boot_timeout: Duration::from_secs(60),
            gpu_devices: Vec::new(),
        }
    }
}

/// Where session sync keeps sessions: `<prefix><project>/<session>.tar.zst` in `bucket`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Default)]
#[serde(deny_unknown_fields, default)]
pub struct SessionStoreConfig {
    /// e.g. `https://s3.eu-west-1.amazonaws.com` or `http://127.0.0.1:9000`.
    pub endpoint: String,
    pub bucket: String,
    pub region: String,
    pub access_key_id: String,
    /// A secret (keep the config file private).
    pub secret_access_key: String,
    /// Allow a plain-HTTP endpoint (a store on the same host or network only).
    pub allow_http: bool,
    /// Prefix of every key, e.g. `sessions/`.
    pub prefix: String,
}

/// Disk I/O limits per sandbox (0 = no limit of that kind). On cgroup v1 only direct and
/// synchronous I/O is throttled; on v2 buffered writeback too.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct DiskIoConfig {
    pub read_bytes_per_s: u64,
    pub write_bytes_per_s: u64,
    pub read_iops: u64,
    pub write_iops: u64,
}

impl Default for DiskIoConfig {
    fn default() -> Self {
        DiskIoConfig {
            read_bytes_per_s: 256 << 20,
            write_bytes_per_s: 256 << 20,
            read_iops: 10_000,
            write_iops: 10_000,
        }
    }
}

impl EdgeConfig {
    /// The edge section's own rules: checked by [`Config::validate`] for a whole config and by
    /// the edge itself for the options it was started with (one place for both).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let e = self;
        if !e.name.is_empty() {
            crate::ids::validate_edge(&e.name).map_err(|err| invalid("edge.name", err.message))?;
        }
        if e.backends.is_empty() {
            return Err(invalid("edge.backends", "must name at least one backend"));
        }
        // What watchers and apiservers dial must be an address they can dial.
        let unspecified = |a: &str| a.parse::<std::net::SocketAddr>().is_ok_and(|a| a.ip().is_unspecified());
        if unspecified(&e.advertise) {
            return Err(invalid("edge.advertise", "must be an address others can dial, not every address"));
        }
        if e.advertise.is_empty() && unspecified(&e.listen) {
            return Err(invalid(
                "edge.advertise",
                "must be set when edge.listen is every address (the address others reach this edge at)",
            ));
        }
        if e.userns_first_id == 0 || !e.userns_first_id.is_multiple_of(65536) {
            return Err(invalid("edge.userns_first_id", "must be a positive multiple of 65536"));
        }
        if e.userns_ranges == 0
            || u64::from(e.userns_first_id) + u64::from(e.userns_ranges) * 65536 > u64::from(u32::MAX)
        {
            return Err(invalid("edge.userns_ranges", "must be at least 1 and end below host id 2^32 - 1"));
        }
        for (i, b) in e.backends.iter().enumerate() {
            if !KNOWN_BACKENDS.contains(&b.as_str()) {
                return Err(invalid(
                    &format!("edge.backends[{i}]"),
                    format!("unknown backend {b:?}; known: {}", KNOWN_BACKENDS.join(", ")),
                ));
            }
        }
        if e.max_sandboxes == 0 {
            return Err(invalid("edge.max_sandboxes", "must be at least 1"));
        }
        positive("edge.ttl_check_interval", e.ttl_check_interval)?;
        positive("edge.agent_silence", e.agent_silence)?;
        positive("edge.pool_refresh", e.pool_refresh)?;
        if e.pool_starts == 0 {
            return Err(invalid("edge.pool_starts", "must be at least 1"));
        }
        if e.pool_share_percent > 100 {
            return Err(invalid("edge.pool_share_percent", "must be in 0..=100"));
        }
        if let Some(s) = &e.session_store {
            if s.endpoint.is_empty() || s.bucket.is_empty() {
                return Err(invalid("edge.session_store", "needs an endpoint and a bucket"));
            }
            if s.endpoint.starts_with("http://") && !s.allow_http {
                return Err(invalid("edge.session_store.endpoint", "is plain HTTP: set allow_http to use it"));
            }
        }
        if !matches!(e.vm.accel.as_str(), "auto" | "kvm" | "tcg") {
            return Err(invalid("edge.vm.accel", "must be auto, kvm or tcg"));
        }
        positive("edge.vm.boot_timeout", e.vm.boot_timeout)?;
        for d in &e.vm.gpu_devices {
            if !pci_address(d) {
                return Err(invalid("edge.vm.gpu_devices", "each must be a PCI address like 0000:01:00.0"));
            }
        }
        if e.backends.iter().any(|b| b == "microvm" || b == "fullvm") && e.vm.kernel_dir.is_none() {
            return Err(invalid("edge.vm.kernel_dir", "is needed by the VM backends (scripts/vm-kernel.sh prints it)"));
        }
        if e.snapshot_max_layers < 2 {
            return Err(invalid("edge.snapshot_max_layers", "must be at least 2"));
        }
        positive("edge.release_interval", e.release_interval)?;
        positive("edge.register_interval", e.register_interval)?;
        if e.release_batch == 0 {
            return Err(invalid("edge.release_batch", "must be at least 1"));
        }
        if !(0.0..0.9).contains(&e.memory_reserve_fraction) {
            return Err(invalid("edge.memory_reserve_fraction", "must be in [0, 0.9)"));
        }
        Ok(())
    }
}

impl Default for EdgeConfig {
    fn default() -> Self {
        EdgeConfig {
            name: String::new(),
            listen: "127.0.0.1:0".into(),
            advertise: String::new(),
            state_dir: None,
            backends: vec!["sim".into()],
            capacity: CapacityConfig::default(),
            max_sandboxes: 3200,
            ttl_check_interval: Duration::from_secs(1),
            release_batch: 1000,
            release_interval: Duration::from_millis(50),
            register_interval: Duration::from_secs(10),
            memory_reserve_fraction: 0.1,
            disk_reserve_mb: 1024,
            keep_sandboxes_on_exit: true,
            ended_retention: Duration::from_secs(600),
            agent_path: None,
            container_pids_limit: 1024,
            pause_reclaim: false,
            agent_silence: Duration::from_secs(60),
            snapshot_max_layers: 32,
            container_setup_exe: None,
            user_namespaces: true,
            userns_first_id: 4096 * 65536,
            userns_ranges: 28672,
            disk_io: DiskIoConfig::default(),
            max_runtime_calls_per_sandbox: 256,
            runtime_result_budget_mb: 2048,
            runtime_result_share_percent: 25,
            pool_refresh: Duration::from_secs(2),
            pool_starts: 2,
            pool_share_percent: 50,
            session_store: None,
            move_stale: Duration::from_secs(600),
            vm: VmConfig::default(),
        }
    }
}

/// What an edge offers. For real backends, zero means "measure the host".
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct CapacityConfig {
    pub cpu_millis: u32,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub gpus: u32,
}

impl Default for CapacityConfig {
    fn default() -> Self {
        // A typical sim node: 64 cores, 512 GiB, 4 TiB.
        CapacityConfig { cpu_millis: 64_000, memory_mb: 512 * 1024, disk_mb: 4 * 1024 * 1024, gpus: 0 }
    }
}

/// The image store (reference section 10): where it is, how long GC leaves unreferenced data,
/// and the bounds every imported layer is unpacked within (hostile images).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ImagesConfig {
    /// The shared store directory (NFS, CephFS, JuiceFS, or a local folder). Default
    /// `<state_dir>/images`.
    pub store_dir: Option<PathBuf>,
    /// GC removes unreferenced layers and interrupted writes only once they are this old.
    #[serde(with = "humantime_serde")]
    pub gc_grace: Duration,
    /// Largest single file in a layer.
    pub max_file_bytes: u64,
    /// Largest layer (sum of its file contents).
    pub max_layer_bytes: u64,
    /// Most entries (files, directories, links, whiteouts) in a layer.
    pub max_entries: u64,
    /// Deepest path in a layer, in components.
    pub max_depth: usize,
    /// Largest image: the blobs its manifest lists, and the content of all its layers.
    pub max_image_bytes: u64,
}

impl Default for ImagesConfig {
    fn default() -> Self {
        ImagesConfig {
            store_dir: None,
            gc_grace: Duration::from_secs(3600),
            max_file_bytes: 8 << 30,
            max_layer_bytes: 64 << 30,
            max_entries: 2_000_000,
            max_depth: 128,
            max_image_bytes: 128 << 30,
        }
    }
}

/// Shortest `images.gc_grace` accepted: a layer being imported or a manifest being
/// registered must never look abandoned to GC.
pub const MIN_GC_GRACE: Duration = Duration::from_secs(60);

/// Sandbox networking: the edge's subnet, the uplink, the DNS proxy, rule sets and defaults.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct NetworkConfig {
    /// Give container sandboxes a network (a veth each, default deny). Off: loopback only.
    pub enabled: bool,
    /// The edge's sandbox subnet (a /31 per sandbox, the first address for the DNS proxy).
    /// Edges sharing a host need subnets of their own; an edge refuses to start on a subnet
    /// the host uses already.
    pub subnet: String,
    /// The link egress is masqueraded through; empty: the default route's.
    pub uplink: String,
    /// Resolvers the DNS proxy forwards allowed names to (`ip` or `ip:port`); empty: the
    /// host's, from /etc/resolv.conf.
    pub upstream_dns: Vec<String>,
    /// Rules a sandbox gets when its spec has no network part (text form, e.g. "@pypi").
    pub default_egress: Vec<String>,
    /// Rule sets sandboxes name as `@name`.
    pub rule_sets: std::collections::BTreeMap<String, Vec<String>>,
    /// Networks inside the always-closed ranges (private, link-local, ...) that rules may
    /// open, e.g. an internal package mirror's: only rules whose network lies within one
    /// reach it (never `*` or a wider network), and a name resolving into one opens it only
    /// when listed for it in `open_private_domains`.
    pub open_private: Vec<String>,
    /// Per network of `open_private`: the domains whose DNS answers may open addresses in it
    /// (for sandboxes whose rules allow the domain).
    pub open_private_domains: std::collections::BTreeMap<String, Vec<String>>,
    /// DNS queries per second one sandbox may make, and the burst.
    pub dns_rate: f64,
    pub dns_burst: f64,
    /// Queries the edge's DNS proxy holds in flight, and TCP connections it holds open, all
    /// sandboxes together; one tenant (top-level project) holds at most
    /// `dns_tenant_share_percent` of each.
    pub dns_in_flight: u32,
    pub dns_tcp_connections: u32,
    pub dns_tenant_share_percent: u32,
    /// Connections one tenant's sandboxes on an edge may have open together (conntrack
    /// entries), and new ones a second (each sandbox: 4,096 and 200).
    pub max_conns_per_tenant: u32,
    pub new_conns_per_tenant: u32,
    /// New connections of sandboxes are refused while the host's conntrack table is fuller
    /// than this percentage of `nf_conntrack_max` (0: never), so that sandboxes never take
    /// the host's own connections from it.
    pub conntrack_shed_percent: u32,
    /// Addresses learned from an answer stay open for its TTL, bounded by these.
    #[serde(with = "humantime_serde")]
    pub dns_ttl_min: Duration,
    #[serde(with = "humantime_serde")]
    pub dns_ttl_max: Duration,
}

impl Default for NetworkConfig {
    fn default() -> Self {
        let set = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        NetworkConfig {
            enabled: true,
            subnet: "10.88.0.0/16".into(),
            uplink: String::new(),
            upstream_dns: Vec::new(),
            default_egress: Vec::new(),
            rule_sets: [
                ("pypi".to_string(), set(&["pypi.org:tcp/443", "files.pythonhosted.org:tcp/443"])),
                ("npm".to_string(), set(&["registry.npmjs.org:tcp/443"])),
                (
                    "crates".to_string(),
                    set(&["crates.io:tcp/443", "static.crates.io:tcp/443", "index.crates.io:tcp/443"]),
                ),
                ("github".to_string(), set(&["github.com:tcp/443", "githubusercontent.com:tcp/443"])),
            ]
            .into(),
            open_private: Vec::new(),
            open_private_domains: Default::default(),
            dns_rate: 100.0,
            dns_burst: 200.0,
            dns_in_flight: 1024,
            dns_tcp_connections: 256,
            dns_tenant_share_percent: 25,
            max_conns_per_tenant: 16384,
            new_conns_per_tenant: 1000,
            conntrack_shed_percent: 50,
            dns_ttl_min: Duration::from_secs(300),
            dns_ttl_max: Duration::from_secs(3600),
        }
    }
}

impl NetworkConfig {
    /// The section's own rules (rules parse, sets exist, ranges make sense).
    pub fn validate(&self) -> Result<(), ConfigError> {
        use crate::egress::{Ipv4Net, Rule, Target};
        let subnet = Ipv4Net::parse(&self.subnet).map_err(|e| invalid("network.subnet", e))?;
        if !(8..=28).contains(&subnet.prefix) {
            return Err(invalid("network.subnet", "must be a /8 to a /28"));
        }
        let check = |field: String, rules: &[String], named_ok: bool| -> Result<(), ConfigError> {
            if rules.len() > crate::egress::MAX_RULES {
                return Err(invalid(&field, format!("at most {} rules", crate::egress::MAX_RULES)));
            }
            for (i, t) in rules.iter().enumerate() {
                let r = Rule::parse(t).map_err(|e| invalid(&format!("{field}[{i}]"), e.to_string()))?;
                if let Target::Named(n) = &r.target {
                    if !named_ok {
                        return Err(invalid(&format!("{field}[{i}]"), "a rule set cannot name another"));
                    }
                    if !self.rule_sets.contains_key(n) {
                        return Err(invalid(&format!("{field}[{i}]"), format!("no rule set {n:?}")));
                    }
                }
            }
            Ok(())
        };
        check("network.default_egress".into(), &self.default_egress, true)?;
        for (name, rules) in &self.rule_sets {
            Rule::parse(&format!("@{name}")).map_err(|e| invalid(&format!("network.rule_sets.{name}"), e.why))?;
            check(format!("network.rule_sets.{name}"), rules, false)?;
        }
        let closed = crate::egress::always_closed();
        for (i, n) in self.open_private.iter().enumerate() {
            let field = format!("network.open_private[{i}]");
            let net = Ipv4Net::parse(n).map_err(|e| invalid(&field, e))?;
            if !closed.iter().any(|c| c.first() <= net.first() && net.last() <= c.last()) {
                return Err(invalid(&field, "must lie inside one always-closed range (docs/network.md)"));
            }
        }
        for (net, domains) in &self.open_private_domains {
            let field = format!("network.open_private_domains.{net}");
            if !self.open_private.contains(net) {
                return Err(invalid(&field, "must name an entry of network.open_private"));
            }
            for (i, d) in domains.iter().enumerate() {
                crate::egress::parse_domain(d).map_err(|e| invalid(&format!("{field}[{i}]"), e))?;
            }
        }
        for (i, u) in self.upstream_dns.iter().enumerate() {
            let ok = u.parse::<std::net::SocketAddr>().is_ok() || u.parse::<std::net::IpAddr>().is_ok();
            if !ok {
                return Err(invalid(&format!("network.upstream_dns[{i}]"), "must be an address or address:port"));
            }
        }
        if self.dns_in_flight == 0 || self.dns_tcp_connections == 0 {
            return Err(invalid("network.dns_in_flight", "the DNS proxy needs at least one slot of each kind"));
        }
        if !(1..=100).contains(&self.dns_tenant_share_percent) {
            return Err(invalid("network.dns_tenant_share_percent", "must be 1 to 100"));
        }
        if self.max_conns_per_tenant == 0 || self.new_conns_per_tenant == 0 {
            return Err(invalid("network.max_conns_per_tenant", "conntrack bounds must be positive"));
        }
        if self.conntrack_shed_percent > 100 {
            return Err(invalid("network.conntrack_shed_percent", "must be 0 to 100"));
        }
        if !(self.dns_rate > 0.0 && self.dns_burst >= 1.0) {
            return Err(invalid("network.dns_rate", "rate must be positive and burst at least 1"));
        }
        if self.dns_ttl_min > self.dns_ttl_max {
            return Err(invalid("network.dns_ttl_min", "must not exceed dns_ttl_max"));
        }
        Ok(())
    }
}

pub const KNOWN_BACKENDS: [&str; 5] = ["sim", "container", "fncall", "microvm", "fullvm"];

impl Config {
    /// Reads, parses and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text =
            std::fs::read_to_string(path).map_err(|source| ConfigError::Read { path: path.to_path_buf(), source })?;
        Config::parse(&text, &path.display().to_string())
    }

    /// Parses and validates config text; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str) -> Result<Config, ConfigError> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let cfg: Config = serde_path_to_error::deserialize(de).map_err(|e| {
            let field = e.path().to_string();
            ConfigError::Parse {
                path: origin.to_string(),
                field: if field == "." { "(top level)".into() } else { field },
                message: e.into_inner().to_string(),
            }
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// The PKI directory (`tls.dir`, default `<state_dir>/pki`).
    pub fn pki_dir(&self) -> PathBuf {
        self.tls.dir.clone().unwrap_or_else(|| self.state_dir.join("pki"))
    }

    /// The CA file this process trusts (`tls.ca`, default `<pki dir>/ca.pem`).
    pub fn tls_ca(&self) -> PathBuf {
        self.tls.ca.clone().unwrap_or_else(|| self.pki_dir().join("ca.pem"))
    }

    /// The bundle of component `role`/`name` in the PKI directory (`<role>-<name>.pem`).
    pub fn tls_bundle_of(&self, role: &str, name: &str) -> PathBuf {
        self.pki_dir().join(format!("{role}-{name}.pem"))
    }

    pub fn iam_data_dir(&self) -> PathBuf {
        self.iam.data_dir.clone().unwrap_or_else(|| self.state_dir.join("iam"))
    }

    pub fn edge_state_dir(&self, name: &str) -> PathBuf {
        self.edge.state_dir.clone().unwrap_or_else(|| self.state_dir.join("edges")).join(name)
    }

    /// The image store directory (`images.store_dir`, default `<state_dir>/images`).
    pub fn image_store_dir(&self) -> PathBuf {
        self.images.store_dir.clone().unwrap_or_else(|| self.state_dir.join("images"))
    }

    pub fn audit_path(&self) -> PathBuf {
        self.apiserver.audit.path.clone().unwrap_or_else(|| self.state_dir.join("audit/apiserver.log"))
    }

    /// Checks every value a component would otherwise trip over later.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.state_dir.as_os_str().is_empty() {
            return Err(invalid("state_dir", "must not be empty"));
        }
        self.network.validate()?;
        if !self.e2b.listen.is_empty() {
            let addr = self.e2b.listen.parse::<std::net::SocketAddr>();
            if addr.is_err() {
                return Err(invalid("e2b.listen", "must be ip:port"));
            }
            if self.apiserver.insecure_plaintext && !addr.is_ok_and(|a| a.ip().is_loopback()) {
                return Err(invalid(
                    "e2b.listen",
                    "must be a loopback address without TLS (apiserver.insecure_plaintext): plain HTTP carries API \
                     keys in the clear",
                ));
            }
        }
        positive("tls.leaf_lifetime", self.tls.leaf_lifetime)?;
        positive("e2b.idle_timeout", self.e2b.idle_timeout)?;
        check_secret("iam.admin_token", &self.iam.admin_token)?;
        if !self.iam.admin_token.is_empty() && parse_token_shape(&self.iam.admin_token).is_none() {
            return Err(invalid(
                "iam.admin_token",
                "must look like dsk.<id>.<secret> (id [a-z0-9], secret at least 16 characters)",
            ));
        }
        crate::ids::validate_principal(&self.iam.admin_principal)
            .map_err(|e| invalid("iam.admin_principal", e.message))?;
        if self.iam.commit_batch_max == 0 {
            return Err(invalid("iam.commit_batch_max", "must be at least 1"));
        }
        if let Some(r) = &self.iam.raft {
            if r.id == 0 {
                return Err(invalid("iam.raft.id", "must be at least 1"));
            }
            if !r.initial_members.is_empty() && !r.initial_members.contains_key(&r.id) {
                return Err(invalid("iam.raft.initial_members", "must include this member's own id"));
            }
            if r.initial_members.contains_key(&0) {
                return Err(invalid("iam.raft.initial_members", "ids start at 1"));
            }
            positive("iam.raft.heartbeat_interval", r.heartbeat_interval)?;
            if r.election_timeout < r.heartbeat_interval * 3 {
                return Err(invalid("iam.raft.election_timeout", "must be at least three heartbeat intervals"));
            }
            if r.snapshot_every == 0 {
                return Err(invalid("iam.raft.snapshot_every", "must be at least 1"));
            }
        }
        let a = &self.apiserver;
        positive("apiserver.auth_cache_ttl", a.auth_cache_ttl)?;
        positive("apiserver.epoch_poll_interval", a.epoch_poll_interval)?;
        positive("apiserver.snapshot_refresh", a.snapshot_refresh)?;
        positive("apiserver.edge_call_timeout", a.edge_call_timeout)?;
        if a.ttl.max.is_zero() {
            return Err(invalid("apiserver.ttl.max", "must be positive"));
        }
        for (f, d) in [
            ("apiserver.ttl.default_running_stop", a.ttl.default_running_stop),
            ("apiserver.ttl.default_max", a.ttl.default_max),
            ("apiserver.ttl.default_paused", a.ttl.default_paused),
        ] {
            positive(f, d)?;
            if d > a.ttl.max {
                return Err(invalid(
                    f,
                    format!(
                        "{} is above apiserver.ttl.max ({})",
                        humantime::format_duration(d),
                        humantime::format_duration(a.ttl.max)
                    ),
                ));
            }
        }
        if !(a.rate_per_principal > 0.0 && a.rate_per_principal.is_finite()) {
            return Err(invalid("apiserver.rate_per_principal", "must be a positive number"));
        }
        if !(a.burst_per_principal >= 1.0 && a.burst_per_principal.is_finite()) {
            return Err(invalid("apiserver.burst_per_principal", "must be at least 1"));
        }
        if a.max_inflight_creations == 0 {
            return Err(invalid("apiserver.max_inflight_creations", "must be at least 1"));
        }
        if a.batch_concurrency == 0 {
            return Err(invalid("apiserver.batch_concurrency", "must be at least 1"));
        }
        if a.placement.k == 0 {
            return Err(invalid("apiserver.placement.k", "must be at least 1"));
        }
        if !(0.0..1.0).contains(&a.placement.usage_floor) {
            return Err(invalid("apiserver.placement.usage_floor", "must be in [0, 1)"));
        }
        if a.placement.max_attempts == 0 {
            return Err(invalid("apiserver.placement.max_attempts", "must be at least 1"));
        }
        if !(1..=1024).contains(&a.placement.batch_run) {
            return Err(invalid("apiserver.placement.batch_run", "must be in 1..=1024"));
        }
        if a.audit.enabled && a.audit.max_bytes < 4096 {
            return Err(invalid("apiserver.audit.max_bytes", "must be at least 4096"));
        }
        let w = &self.watcher;
        positive("watcher.probe_interval", w.probe_interval)?;
        positive("watcher.probe_timeout", w.probe_timeout)?;
        positive("watcher.reconcile_interval", w.reconcile_interval)?;
        positive("watcher.lock_ttl", w.lock_ttl)?;
        if w.failure_threshold == 0 {
            return Err(invalid("watcher.failure_threshold", "must be at least 1"));
        }
        self.edge.validate()?;
        let settled = (self.iam.reconcile_min_age + w.reconcile_interval) * 2;
        if self.edge.move_stale < settled {
            return Err(invalid(
                "edge.move_stale",
                format!(
                    "must be at least twice iam.reconcile_min_age + watcher.reconcile_interval ({})",
                    humantime::format_duration(settled)
                ),
            ));
        }
        for (i, ep) in self.edges.iter().enumerate() {
            crate::ids::validate_edge(&ep.name).map_err(|err| invalid(&format!("edges[{i}].name"), err.message))?;
            if ep.address.is_empty() {
                return Err(invalid(&format!("edges[{i}].address"), "must not be empty"));
            }
        }
        if !(1..=7).contains(&self.iam_replicas) {
            return Err(invalid("iam_replicas", "between 1 and 7"));
        }
        if self.sim_edges > 1000 {
            return Err(invalid("sim_edges", "at most 1000"));
        }
        let im = &self.images;
        if im.store_dir.as_ref().is_some_and(|d| d.as_os_str().is_empty()) {
            return Err(invalid("images.store_dir", "must not be empty (leave it out for <state_dir>/images)"));
        }
        if im.gc_grace < MIN_GC_GRACE {
            return Err(invalid(
                "images.gc_grace",
                format!("must be at least {}", humantime::format_duration(MIN_GC_GRACE)),
            ));
        }
        if im.max_file_bytes == 0 {
            return Err(invalid("images.max_file_bytes", "must be at least 1"));
        }
        if im.max_layer_bytes < im.max_file_bytes {
            return Err(invalid("images.max_layer_bytes", "must be at least images.max_file_bytes"));
        }
        if im.max_entries == 0 {
            return Err(invalid("images.max_entries", "must be at least 1"));
        }
        if !(1..=4096).contains(&im.max_depth) {
            return Err(invalid("images.max_depth", "must be in 1..=4096"));
        }
        Ok(())
    }
}

fn positive(field: &str, d: Duration) -> Result<(), ConfigError> {
    if d.is_zero() { Err(invalid(field, "must be positive")) } else { Ok(()) }
}

fn check_secret(field: &str, value: &str) -> Result<(), ConfigError> {
    let lower = value.to_ascii_lowercase();
    if let Some(p) = PLACEHOLDERS.iter().find(|p| lower.contains(*p)) {
        return Err(invalid(
            field,
            format!("still holds the placeholder {p:?}: set a real secret, or leave it empty to have one generated"),
        ));
    }
    Ok(())
}

/// Splits `dsk.<id>.<secret>` (id `[a-z0-9]{1,32}`, secret `[A-Za-z0-9_-]{16,128}`).
pub fn parse_token_shape(token: &str) -> Option<(&str, &str)> {
    let rest = token.strip_prefix("dsk.")?;
    let (id, secret) = rest.split_once('.')?;
    let id_ok = !id.is_empty() && id.len() <= 32 && id.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let secret_ok = (16..=128).contains(&secret.len())
        && secret.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'-');
    (id_ok && secret_ok).then_some((id, secret))
}

/// A token in the shape E2B's SDKs check their API key against (`e2b_` and lowercase hex:
/// SDKs up to 2.45 refuse anything else before sending it): `e2b_` and the hex of the token's
/// bytes. Only an encoding: it is as secret as the token, and works wherever the token does
/// through the E2B gateway.
pub fn e2b_key(token: &str) -> String {
    format!("{E2B_KEY_PREFIX}{}", crate::hex::to_hex(token.as_bytes()))
}

pub const E2B_KEY_PREFIX: &str = "e2b_";

/// The token an E2B-shaped key ([`e2b_key`]) stands for, or `None` when `key` is not one
/// (then it is used as it is: an opendsec token given to E2B's SDK verbatim).
pub fn token_of_e2b_key(key: &str) -> Option<String> {
    let hex = key.strip_prefix(E2B_KEY_PREFIX)?;
    if hex.len() > 1024 {
        return None;
    }
    let token = String::from_utf8(crate::hex::from_hex(hex)?).ok()?;
    parse_token_shape(&token).is_some().then_some(token)
}

/// The length of the ids IAM gives the tokens it mints for one sandbox
/// (`CreateSandboxTokens`); other generated ids are 16 characters.
pub const SANDBOX_TOKEN_ID_LEN: usize = 20;

/// Whether `token` has the shape of a sandbox's token (its id's length): one whose id is not
/// known any more is for a sandbox that ended, which callers answer as the sandbox being gone
/// (`not_found`, E2B's 502) rather than as a bad token.
pub fn is_sandbox_token_shape(token: &str) -> bool {
    parse_token_shape(token).is_some_and(|(id, _)| id.len() == SANDBOX_TOKEN_ID_LEN)
}

/// Whether `s` is a full PCI address, `dddd:bb:dd.f` in hex.
pub fn pci_address(s: &str) -> bool {
    let b = s.as_bytes();
    let hex = |r: std::ops::Range<usize>| b.get(r).is_some_and(|x| x.iter().all(u8::is_ascii_hexdigit));
    b.len() == 12
        && hex(0..4)
        && b[4] == b':'
        && hex(5..7)
        && b[7] == b':'
        && hex(8..10)
        && b[10] == b'.'
        && hex(11..12)
}

#[cfg(test)]
mod tests {
    #[test]
    fn pci_addresses_are_whole() {
        assert!(super::pci_address("0000:01:00.0"));
        for bad in ["", "01:00.0", "0000:01:00", "0000:01:00.0 ", "0000:0g:00.0", "../../00:00.0"] {
            assert!(!super::pci_address(bad), "{bad:?}");
        }
    }

    use super::*;

    #[test]
    fn empty_object_gives_defaults() {
        let c = Config::parse("{}", "test").unwrap();
        assert_eq!(c, Config::default());
    }

    #[test]
    fn unknown_fields_are_rejected_with_their_path() {
        let err = Config::parse(r#"{"apiserver": {"placement": {"kk": 3}}}"#, "test").unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("apiserver.placement"), "{msg}");
        assert!(msg.contains("kk"), "{msg}");
    }

    #[test]
    fn bad_values_name_their_field() {
        for (text, field) in [
            (r#"{"apiserver": {"placement": {"k": 0}}}"#, "apiserver.placement.k"),
            (r#"{"watcher": {"probe_interval": "0s"}}"#, "watcher.probe_interval"),
            (r#"{"edge": {"backends": ["kvm"]}}"#, "edge.backends[0]"),
            (r#"{"iam": {"admin_token": "dsk.admin.change-me-please-now"}}"#, "iam.admin_token"),
            (r#"{"iam": {"admin_token": "not-a-token"}}"#, "iam.admin_token"),
            (r#"{"apiserver": {"ttl": {"default_max": "30d"}}}"#, "apiserver.ttl.default_max"),
            (r#"{"watcher": {"probe_interval": "soon"}}"#, "watcher.probe_interval"),
            (r#"{"sim_edges": -1}"#, "sim_edges"),
            (r#"{"images": {"gc_grace": "10s"}}"#, "images.gc_grace"),
            (r#"{"images": {"store_dir": ""}}"#, "images.store_dir"),
            (r#"{"images": {"max_file_bytes": 10, "max_layer_bytes": 5}}"#, "images.max_layer_bytes"),
            (r#"{"images": {"max_entries": 0}}"#, "images.max_entries"),
            (r#"{"images": {"max_depth": 0}}"#, "images.max_depth"),
            (r#"{"images": {"size": 1}}"#, "images"),
            (r#"{"e2b": {"listen": "localhost"}}"#, "e2b.listen"),
            (r#"{"network": {"open_private": ["0.0.0.0/0"]}}"#, "network.open_private[0]"),
            (r#"{"network": {"open_private": ["198.51.100.0/24"]}}"#, "network.open_private[0]"),
            (
                r#"{"network": {"open_private": ["10.0.0.0/24"], "open_private_domains": {"10.1.0.0/24": ["m.test"]}}}"#,
                "network.open_private_domains.10.1.0.0/24",
            ),
            // A move settled before IAM's reconciliation could release a lease bound to a
            // copy that never started would stop the only instance.
            (r#"{"edge": {"move_stale": "2m"}}"#, "edge.move_stale"),
            (r#"{"edge": {"move_stale": "10m"}, "iam": {"reconcile_min_age": "5m"}}"#, "edge.move_stale"),
            (r#"{"apiserver": {"insecure_plaintext": true}, "e2b": {"listen": "0.0.0.0:7080"}}"#, "e2b.listen"),
        ] {
            let msg = Config::parse(text, "test").unwrap_err().to_string();
            assert!(msg.contains(field), "{text}: {msg}");
        }
    }

    #[test]
    fn the_e2b_gateway_leaves_loopback_only_with_tls() {
        assert!(Config::parse(r#"{"e2b": {"listen": "0.0.0.0:7080"}}"#, "test").is_ok());
        assert!(
            Config::parse(
                r#"{"apiserver": {"insecure_plaintext": true}, "e2b": {"listen": "127.0.0.1:7080"}}"#,
                "test"
            )
            .is_ok()
        );
    }

    #[test]
    fn the_image_store_defaults_to_the_state_dir() {
        let c = Config::parse(r#"{"state_dir": "/var/lib/opendsec"}"#, "test").unwrap();
        assert_eq!(c.image_store_dir(), PathBuf::from("/var/lib/opendsec/images"));
        let c = Config::parse(r#"{"images": {"store_dir": "/mnt/store"}}"#, "test").unwrap();
        assert_eq!(c.image_store_dir(), PathBuf::from("/mnt/store"));
    }

    #[test]
    fn token_shape() {
        assert!(parse_token_shape("dsk.abc123.0123456789abcdefXYZ").is_some());
        for bad in
            ["", "dsk.", "dsk.a.short", "xsk.a.0123456789abcdef", "dsk.A.0123456789abcdef", "dsk.a.0123456789abcdef!"]
        {
            assert!(parse_token_shape(bad).is_none(), "{bad}");
        }
    }

    #[test]
    fn e2b_keys_are_tokens_in_the_shape_e2b_sdks_check() {
        let token = "dsk.abc123.0123456789abcdef_XYZ-";
        let key = e2b_key(token);
        // E2B's SDKs (up to 2.45) accept only `^e2b_[0-9a-f]+$`.
        assert!(key.starts_with("e2b_") && key[4..].bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)));
        assert_eq!(token_of_e2b_key(&key).as_deref(), Some(token));
        // Not keys of ours: E2B's own, odd or upper-case hex, hex of something not a token.
        for other in [token, "e2b_", "e2b_0", "e2b_ZZ", "e2b_4142", &key.to_uppercase(), &e2b_key("not a token")] {
            assert_eq!(token_of_e2b_key(other), None, "{other}");
        }
    }
}

#[cfg(test)]
mod doc {
    use super::Config;

    /// docs/configuration.md shows the defaults; this keeps it true.
    #[test]
    fn the_configuration_doc_shows_the_defaults() {
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/configuration.md")).unwrap();
        let start = doc.find("```json\n").expect("a json block") + 8;
        let end = start + doc[start..].find("```").expect("end of the json block");
        let shown: serde_json::Value = serde_json::from_str(&doc[start..end]).expect("the block parses");
        let defaults = serde_json::to_value(Config::default()).unwrap();
        assert_eq!(
            shown,
            defaults,
            "update docs/configuration.md:\n{}",
            serde_json::to_string_pretty(&defaults).unwrap()
        );
        assert_eq!(Config::parse(&doc[start..end], "doc").unwrap(), Config::default());
    }
}
