//! The command tree of `opendsecctl` (clap): every command, its arguments and their defaults.

use super::*;

#[derive(Parser, Debug)]
#[command(
    name = "opendsecctl",
    version,
    about = "opendsec on the command line",
    after_help = "Examples:\n  \
    make up                                  # a local cluster with container sandboxes (as root)\n  \
    opendsecctl sandbox create --backend container --image debian:bookworm\n  \
    opendsecctl exec ID -- \"python3 -c 'print(6*7)'\"\n  \
    opendsecctl exec ID --session s1 -- cd /tmp      # a named session keeps its state\n  \
    opendsecctl cp ./data.csv ID:/work/data.csv\n  \
    opendsecctl sandbox list --label job=eval --json\n\n\
    Connect with OPENDSEC_ADDR and OPENDSEC_TOKEN (cluster up prints both). More: docs/cli.md"
)]
pub struct Cli {
    /// Apiserver addresses, comma-separated.
    #[arg(long, global = true, env = "OPENDSEC_ADDR", default_value = "127.0.0.1:7000")]
    pub addr: String,
    /// Bearer token (dsk.<id>.<secret>).
    #[arg(long, global = true, env = "OPENDSEC_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// Default project for commands that take one.
    #[arg(long, global = true, env = "OPENDSEC_PROJECT")]
    pub project: Option<String>,
    /// Print JSON instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    /// The cluster's CA certificate (PEM), to check the apiserver's TLS certificate with
    /// (`cluster up` prints its path).
    #[arg(long, global = true, env = "OPENDSEC_CA")]
    pub ca: Option<PathBuf>,
    /// The name the apiserver's certificate must carry (default api.opendsec.internal).
    #[arg(long, global = true, env = "OPENDSEC_TLS_NAME")]
    pub tls_name: Option<String>,
    /// Speak plain text to a cluster started with --insecure-plaintext (the token then
    /// crosses the network unencrypted).
    #[arg(long, global = true, env = "OPENDSEC_INSECURE_PLAINTEXT", value_parser = clap::builder::FalseyValueParser::new())]
    pub insecure_plaintext: bool,
    #[command(subcommand)]
    pub command: Command,
}

impl Cli {
    /// Whether the command serves (runs servers until stopped) rather than prints.
    pub fn serves(&self) -> bool {
        matches!(self.command, Command::Cluster(ClusterCmd::Up { .. }))
    }
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Local cluster tools.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Sandboxes: create, list, get, pause, resume, set-timeout, stop.
    #[command(subcommand)]
    Sandbox(SandboxCmd),
    /// A sandbox's egress rules: set (replace) or get.
    #[command(subcommand)]
    Network(NetworkCmd),
    /// Projects (nested: root/team-a/rl).
    #[command(subcommand)]
    Project(ProjectCmd),
    /// Warm pools (fncall): members started ahead of time from a template.
    #[command(subcommand)]
    Pool(PoolCmd),
    /// Project quotas.
    #[command(subcommand)]
    Quota(QuotaCmd),
    /// Principals (users and service accounts).
    #[command(subcommand)]
    Principal(PrincipalCmd),
    /// Bearer tokens.
    #[command(subcommand)]
    Token(TokenCmd),
    /// Permissions granted on projects.
    #[command(subcommand)]
    Grant(GrantCmd),
    /// Quota and usage of a project and its subprojects.
    Usage { project: Option<String> },
    /// Who the token belongs to and what it may do.
    Whoami,
    /// Write IAM's backup (gzipped JSON) to a file.
    Backup { file: PathBuf },
    /// Restore IAM from a backup file.
    Restore { file: PathBuf },
    /// IAM's members when it runs replicated (Raft).
    #[command(subcommand)]
    Iam(IamCmd),
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// The cluster's certificates: a CA, and one certificate per component (mTLS).
    #[command(subcommand)]
    Pki(crate::pki::PkiCmd),
    /// The release tarball: binaries, static agent, systemd units, example configs, checksums.
    #[command(subcommand)]
    Release(crate::release::ReleaseCmd),
    /// Images: the Images API, and local tools on the store (import, gc, store-check, merge).
    #[command(subcommand)]
    Image(crate::image::ImageCmd),
    /// Run shell text in a sandbox, output streamed; exits with the command's exit code.
    Exec(crate::runtime::ExecArgs),
    /// Start a process in a sandbox (argv, outside sessions) and follow its output.
    Run(crate::runtime::RunArgs),
    /// Copy a file between a sandbox (SANDBOX_ID:/path) and here (a path, or - for stdin/stdout).
    Cp(crate::runtime::CpArgs),
    /// Processes started with `run` (or the process API) in a sandbox.
    Ps { sandbox: String },
    /// Snapshot a sandbox's file system into an image of its project (it keeps running);
    /// `sandbox create --image NAME` starts from it. Processes are not kept.
    #[command(after_help = "Examples:\n  \
    opendsecctl snapshot root-edge.0123abcd episode:step-40\n  \
    opendsecctl snapshot root-edge.0123abcd episode:packed --pack-diff\n  \
    opendsecctl sandbox create --backend container --image episode:step-40 --count 8")]
    Snapshot {
        id: String,
        /// "repo[:tag]" of the new image (a name taken is refused).
        name: String,
        /// Leave out /tmp, /var/tmp, /var/cache, home caches and shell histories.
        #[arg(long)]
        pack_diff: bool,
    },
    /// Fork a sandbox: one snapshot, then COUNT copies of its file system with its spec, on
    /// its edge while it has room; prints the copies' ids as they come. Processes are not
    /// copied.
    #[command(after_help = "Examples:\n  \
    opendsecctl fork root-edge.0123abcd --count 8\n  \
    opendsecctl fork root-edge.0123abcd --count 64 --snapshot-name episode:branch --json")]
    Fork {
        id: String,
        /// How many copies, 1..=256.
        #[arg(long, default_value_t = 1)]
        count: u32,
        /// The image the snapshot is kept as (default forks/<lease>:<ms>).
        #[arg(long, default_value = "")]
        snapshot_name: String,
        #[arg(long)]
        pack_diff: bool,
    },
    /// Move a sandbox to another edge under the same id: frozen, its file system copied, the
    /// copy started there, the original stopped once the copy runs. Calls made meanwhile wait
    /// and go to the copy. Processes are not carried (containers). Needs edge.manage on root.
    #[command(after_help = "Examples:\n  \
    opendsecctl move root-edge.0123abcd --to edge-2")]
    Move {
        id: String,
        /// The edge the sandbox runs on afterwards.
        #[arg(long)]
        to: String,
    },
    /// Edges, for operators (edge.manage on root).
    #[command(subcommand)]
    Edge(EdgeCmd),
    /// Save a sandbox's session (created with --session/--sync) now, as its stop would; it
    /// runs on.
    SaveSession { id: String },
    /// Signal a process in a sandbox, by pid or tag.
    Kill(crate::runtime::KillArgs),
}

#[derive(Subcommand, Debug)]
pub enum ClusterCmd {
    /// Start IAM, a watcher, an apiserver and sim edges in this process (until Ctrl-C).
    Up {
        #[arg(long)]
        config: Option<PathBuf>,
        #[arg(long)]
        state_dir: Option<PathBuf>,
        #[arg(long)]
        sim_edges: Option<u32>,
        /// IAM members to run in this process: 1 (standalone) or 3 or 5 (Raft, each its own
        /// store and port). Fixed at the first start of a state directory.
        #[arg(long)]
        iam_replicas: Option<u32>,
        /// Serve the public API in plain text (local development; refused unless it listens
        /// on a loopback address).
        #[arg(long)]
        insecure_plaintext: bool,
        /// Leave the sandboxes running when the cluster stops (the next `cluster up` with the
        /// same state directory adopts them). Without it, stopping the cluster stops them.
        #[arg(long)]
        keep_sandboxes: bool,
    },
}

#[derive(Args, Debug, Default)]
pub struct SpecArgs {
    /// Isolation backend: `container` (namespaces, cgroups, seccomp; what `make up` runs),
    /// `fncall` (containers, from a warm pool when one matches) or `sim` (lifecycles without
    /// isolation, for scheduling tests).
    #[arg(long, required_unless_present = "pool", default_value = "")]
    pub backend: String,
    /// Claim an idle member of this warm pool (`opendsecctl pool create`): its template gives
    /// the image, backend, resources, network, user and workdir.
    #[arg(long, conflicts_with_all = ["backend", "image", "cpu", "memory", "disk", "gpus", "user", "workdir",
        "masked_paths", "readonly_paths", "allow", "no_egress"])]
    pub pool: Option<String>,
    /// `repo[:tag]`, found in the project or above (`scratch` is in root on a new cluster).
    #[arg(long, default_value = "scratch")]
    pub image: String,
    /// CPU in millicores.
    #[arg(long, default_value_t = DEFAULT_CPU_MILLIS)]
    pub cpu: u32,
    /// Memory in MiB.
    #[arg(long, default_value_t = DEFAULT_MEMORY_MB)]
    pub memory: u64,
    /// Disk in MiB.
    #[arg(long, default_value_t = DEFAULT_DISK_MB)]
    pub disk: u64,
    /// GPUs passed through (backend fullvm only).
    #[arg(long, default_value_t = 0)]
    pub gpus: u32,
    /// Backend fullvm: boot the image's own init (systemd), the agent as its service.
    #[arg(long)]
    pub full_init: bool,
    /// Idle timeout in seconds (0: cluster default).
    #[arg(long, default_value_t = 0)]
    pub ttl_idle: u64,
    /// Lifetime in seconds (0: cluster default).
    #[arg(long, default_value_t = 0)]
    pub ttl_max: u64,
    /// Paused timeout in seconds (0: cluster default).
    #[arg(long, default_value_t = 0)]
    pub ttl_paused: u64,
    /// KEY=VALUE, repeatable.
    #[arg(long = "label")]
    pub labels: Vec<String>,
    /// KEY=VALUE, repeatable.
    #[arg(long = "env")]
    pub env: Vec<String>,
    #[arg(long)]
    pub best_effort: bool,
    /// User of sessions and processes that name none (from the image's /etc/passwd).
    #[arg(long, default_value = "")]
    pub user: String,
    /// Working directory of sessions and processes that name none (absolute).
    #[arg(long, default_value = "")]
    pub workdir: String,
    /// A path inside the sandbox to hide (container backend), repeatable.
    #[arg(long = "mask")]
    pub masked_paths: Vec<String>,
    /// A path inside the sandbox to make read-only (container backend), repeatable.
    #[arg(long = "readonly")]
    pub readonly_paths: Vec<String>,
    /// Session sync: save the --sync paths under this name in the project's session store
    /// when the sandbox stops, and restore them from there when it starts (docs/sessions.md).
    #[arg(long, requires = "sync", conflicts_with = "pool")]
    pub session: Option<String>,
    /// An absolute path the session saves and restores, repeatable.
    #[arg(long, requires = "session")]
    pub sync: Vec<String>,
    /// An egress rule (`*`, a domain, an IPv4 network or `@set`, optionally
    /// `:tcp|udp|icmp[/PORT[-PORT]]`), repeatable. None given: the cluster's default.
    #[arg(long)]
    pub allow: Vec<String>,
    /// No egress at all, whatever the cluster's default.
    #[arg(long, conflicts_with = "allow")]
    pub no_egress: bool,
}

#[derive(Subcommand, Debug)]
pub enum SandboxCmd {
    /// Create sandboxes (--count > 1 uses one batch call); prints their ids.
    #[command(after_help = "Examples:\n  \
    opendsecctl sandbox create --backend container --image debian:bookworm\n  \
    opendsecctl sandbox create --backend container --image debian:bookworm --cpu 500 --memory 512 \\\n      \
    --ttl-idle 600 --label job=eval --env SEED=1\n  \
    opendsecctl sandbox create --backend container --image debian:bookworm --count 200   # one batch call\n  \
    opendsecctl sandbox create --backend sim --count 10000 --json\n  \
    opendsecctl sandbox create --pool py --env TASK=7   # an idle member of a warm pool")]
    Create {
        #[command(flatten)]
        spec: Box<SpecArgs>,
        /// How many (more than one: a single batch call, with a progress bar on a terminal).
        #[arg(long, default_value_t = 1)]
        count: u32,
    },
    /// List sandboxes of a project and its subprojects (filters: --state, --label).
    #[command(after_help = "Examples:\n  \
    opendsecctl sandbox list\n  \
    opendsecctl sandbox list --state running --label job=eval\n  \
    opendsecctl sandbox list --all --json | jq -r '.sandboxes[].id'")]
    List {
        /// Only these states (repeatable): running, paused, stopped, ...
        #[arg(long = "state")]
        states: Vec<String>,
        #[arg(long = "label")]
        labels: Vec<String>,
        #[arg(long, default_value_t = 0)]
        page_size: u32,
        #[arg(long, default_value = "")]
        page_token: String,
        /// Follow every page.
        #[arg(long)]
        all: bool,
    },
    /// Show one sandbox (state, spec, TTL deadline, last activity).
    Get { id: String },
    /// Stop a sandbox: its processes end and its quota is released.
    Stop { id: String },
    /// Pause a sandbox (frozen; any call on it resumes it).
    Pause { id: String },
    /// Resume a paused sandbox.
    Resume { id: String },
    /// Replace TTLs (seconds).
    SetTimeout {
        id: String,
        #[arg(long)]
        idle: Option<u64>,
        #[arg(long)]
        max: Option<u64>,
        #[arg(long)]
        paused: Option<u64>,
    },
}

#[derive(Subcommand, Debug)]
pub enum NetworkCmd {
    /// Replace a running sandbox's egress rules (no --allow: no egress at all).
    Set {
        id: String,
        /// A rule: `*`, a domain (subdomains included), an IPv4 network, or `@set`, with an
        /// optional `:tcp|udp|icmp[/PORT[-PORT]]`. Repeat for more.
        #[arg(long)]
        allow: Vec<String>,
    },
    /// Print a sandbox's egress rules and address.
    Get { id: String },
}

#[derive(Subcommand, Debug)]
pub enum PoolCmd {
    /// Create a pool in the project (--project, default the token's).
    #[command(
        after_help = "Example:\n  opendsecctl pool create py --image python:3.12 --size 8 --cpu 1000 --memory 512 --env MODE=warm"
    )]
    Create(PoolArgs),
    /// Replace a pool's template and size (members of the old template are replaced).
    Update(PoolArgs),
    /// Show a pool (template, size, revision).
    Get {
        name: String,
    },
    /// The pools of the project and its subprojects.
    List,
    Delete {
        name: String,
    },
}

#[derive(Args, Debug, Clone)]
pub struct PoolArgs {
    pub name: String,
    #[arg(long)]
    pub image: String,
    /// Members kept idle on each edge offering the backend.
    #[arg(long)]
    pub size: u32,
    #[arg(long, default_value_t = 1000)]
    pub cpu: u32,
    /// MiB.
    #[arg(long, default_value_t = 1024)]
    pub memory: u64,
    /// MiB.
    #[arg(long, default_value_t = 10240)]
    pub disk: u64,
    /// KEY=VALUE (repeatable).
    #[arg(long)]
    pub env: Vec<String>,
    /// Egress rules (repeatable): a domain, a network, a named set or *.
    #[arg(long)]
    pub allow: Vec<String>,
    #[arg(long, default_value = "")]
    pub user: String,
    #[arg(long, default_value = "")]
    pub workdir: String,
}

impl PoolArgs {
    pub(crate) fn to_pb(&self, project: Option<&str>) -> Result<pb::Pool, CtlError> {
        Ok(pb::Pool {
            project: project.unwrap_or_default().to_string(),
            name: self.name.clone(),
            template: Some(pb::PoolTemplate {
                image: self.image.clone(),
                backend: "fncall".into(),
                resources: Some(pb::Resources {
                    cpu_millis: self.cpu,
                    memory_mb: self.memory,
                    disk_mb: self.disk,
                    gpus: 0,
                }),
                env: crate::support::kv(&self.env, "env")?,
                egress: self.allow.clone(),
                user: self.user.clone(),
                workdir: self.workdir.clone(),
            }),
            size_per_edge: self.size,
            ..Default::default()
        })
    }
}

#[derive(Args, Debug, Default, Clone)]
pub struct QuotaArgs {
    #[arg(long)]
    pub cpu: Option<u64>,
    #[arg(long)]
    pub memory: Option<u64>,
    #[arg(long)]
    pub disk: Option<u64>,
    #[arg(long)]
    pub gpus: Option<u64>,
    #[arg(long)]
    pub sandboxes: Option<u64>,
    /// Bytes of the image store the project's images may take (each distinct layer once).
    #[arg(long)]
    pub store_bytes: Option<u64>,
}

impl QuotaArgs {
    pub(crate) fn to_pb(&self) -> pb::Quota {
        pb::Quota {
            cpu_millis: self.cpu,
            memory_mb: self.memory,
            disk_mb: self.disk,
            gpus: self.gpus,
            sandboxes: self.sandboxes,
            store_bytes: self.store_bytes,
        }
    }
}

#[derive(Subcommand, Debug)]
pub enum ProjectCmd {
    Create {
        path: String,
        #[command(flatten)]
        quota: QuotaArgs,
    },
    Get {
        path: String,
    },
    /// The project and everything below it (default: root).
    List {
        path: Option<String>,
    },
    Delete {
        path: String,
    },
    /// Set the most egress the project's sandboxes may ask for (rules as `sandbox create
    /// --allow`), or remove the project's own ceiling with --clear.
    Ceiling {
        path: String,
        #[arg(long)]
        allow: Vec<String>,
        #[arg(long, conflicts_with = "allow")]
        clear: bool,
    },
}

#[derive(Subcommand, Debug)]
pub enum QuotaCmd {
    /// Replace a project's quota (keys left out inherit the parent's).
    Set {
        path: String,
        #[command(flatten)]
        quota: QuotaArgs,
    },
    Get {
        path: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum PrincipalCmd {
    Create { name: String },
    List,
    Delete { name: String },
}

#[derive(Subcommand, Debug)]
pub enum TokenCmd {
    Create {
        /// Default: the caller.
        #[arg(long)]
        principal: Option<String>,
        /// Seconds; 0: never expires.
        #[arg(long, default_value_t = 0)]
        ttl: u64,
        #[arg(long, default_value = "")]
        description: String,
        /// Print the token as an E2B API key (`e2b_` + hex), the shape E2B's SDKs up to 2.45
        /// check before sending it; the E2B gateway takes it as the token.
        #[arg(long)]
        e2b: bool,
    },
    List {
        #[arg(long)]
        principal: Option<String>,
    },
    Revoke {
        id: String,
    },
}

#[derive(Subcommand, Debug)]
pub enum GrantCmd {
    Add {
        principal: String,
        project: String,
        permission: String,
    },
    Remove {
        principal: String,
        project: String,
        permission: String,
    },
    List {
        #[arg(long = "of")]
        principal: Option<String>,
        #[arg(long = "on")]
        on_project: Option<String>,
    },
}

#[derive(Subcommand, Debug)]
pub enum EdgeCmd {
    /// Drain an edge for maintenance: it takes no new sandbox and lets its idle warm pool
    /// members go. With --move-to, the sandboxes that can move (container, fncall) are moved
    /// there; then it waits until nothing runs on the edge (the rest end by themselves or are
    /// stopped). The edge keeps the mark across restarts; --undrain ends it. Needs edge.manage
    /// and (to wait) sandbox.view on root.
    #[command(after_help = "Examples:\n  \
    opendsecctl edge drain node-1 --move-to node-2\n  \
    opendsecctl edge drain node-1 --no-wait\n  \
    opendsecctl edge drain node-1 --undrain")]
    Drain {
        name: String,
        /// The edge the movable sandboxes go to.
        #[arg(long)]
        move_to: Option<String>,
        /// Set the mark and return.
        #[arg(long)]
        no_wait: bool,
        /// End the drain: the edge takes sandboxes again.
        #[arg(long, conflicts_with_all = ["move_to", "no_wait"])]
        undrain: bool,
        /// How long to wait for the edge to empty.
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        timeout: std::time::Duration,
    },
}

#[derive(Subcommand, Debug)]
pub enum IamCmd {
    /// The members: id, address, voter or learner, leader, how far each has the log.
    Members,
    /// Add a member: it catches up as a learner, then becomes a voter (unless --learner).
    Add {
        id: u64,
        /// host:port where the other members reach it.
        address: String,
        #[arg(long)]
        learner: bool,
    },
    /// Remove a member.
    Remove { id: u64 },
    /// Hand the leadership to a voter.
    TransferLeader { to: u64 },
}

#[derive(Subcommand, Debug)]
pub enum BenchCmd {
    /// Create sandboxes as fast as the cluster takes them, then stop them; print figures.
    Create(crate::bench::BenchArgs),
    /// Shell round trips (Exec) in an existing sandbox; print latency figures.
    Exec(crate::bench::ExecBenchArgs),
}

/// The network part of a spec from `--allow` rules (`--no-egress`: none at all; neither: the
/// cluster's default).
pub fn network_of(allow: &[String], none: bool) -> Result<Option<pb::NetworkSpec>, CtlError> {
    if allow.is_empty() && !none {
        return Ok(None);
    }
    Ok(Some(pb::NetworkSpec { egress: egress_rules(allow)? }))
}

/// Rules in text form (`TARGET[:PROTOCOL[/PORT[-PORT]]]`), checked here for a clear message.
pub fn egress_rules(allow: &[String]) -> Result<Vec<pb::EgressRule>, CtlError> {
    allow
        .iter()
        .map(|t| {
            opendsec_common::egress::Rule::parse(t)
                .map(|r| r.to_pb())
                .map_err(|e| CtlError::Local(format!("--allow: {e}")))
        })
        .collect()
}

impl SpecArgs {
    pub fn to_spec(&self, project: Option<&str>) -> Result<pb::SandboxSpec, CtlError> {
        if let Some(pool) = &self.pool {
            // The pool's template fills the rest (the apiserver refuses a spec contradicting it).
            return Ok(pb::SandboxSpec {
                project: project.unwrap_or_default().to_string(),
                pool: pool.clone(),
                ttl_running_stop_s: self.ttl_idle,
                ttl_max_s: self.ttl_max,
                ttl_paused_s: self.ttl_paused,
                env: kv(&self.env, "env")?,
                labels: kv(&self.labels, "label")?,
                priority: if self.best_effort {
                    pb::Priority::BestEffort as i32
                } else {
                    pb::Priority::Guaranteed as i32
                },
                ..Default::default()
            });
        }
        Ok(pb::SandboxSpec {
            pool: String::new(),
            project: project.unwrap_or_default().to_string(),
            image: self.image.clone(),
            backend: self.backend.clone(),
            resources: Some(pb::Resources {
                cpu_millis: self.cpu,
                memory_mb: self.memory,
                disk_mb: self.disk,
                gpus: self.gpus,
            }),
            ttl_running_stop_s: self.ttl_idle,
            ttl_max_s: self.ttl_max,
            ttl_paused_s: self.ttl_paused,
            env: kv(&self.env, "env")?,
            labels: kv(&self.labels, "label")?,
            user: self.user.clone(),
            workdir: self.workdir.clone(),
            priority: if self.best_effort { pb::Priority::BestEffort as i32 } else { pb::Priority::Guaranteed as i32 },
            masked_paths: self.masked_paths.clone(),
            readonly_paths: self.readonly_paths.clone(),
            network: network_of(&self.allow, self.no_egress)?,
            session: self.session.as_ref().map(|name| pb::SessionSync { name: name.clone(), paths: self.sync.clone() }),
            full_init: self.full_init,
            // Made through the E2B gateway (its traffic and pause options).
            ..Default::default()
        })
    }
}
