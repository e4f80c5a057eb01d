//! `opendsecctl`: the public API on the command line, plus `cluster up`, `bench` and the image
//! store tools (`image import|gc|store-check|merge`); commands inside a sandbox (`exec`, `run`,
//! `cp`, `ps`, `kill`) are in [`crate::runtime`].
//!
//! Exit codes: 0 success; 1 a local failure (file, config); 2 usage; 10.. one per error
//! reason (docs/errors.md, `Reason::exit_code`). `exec` and `run` exit with the remote
//! command's own code once the call succeeded.

use std::collections::HashMap;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use opendsec_client::Client;
use opendsec_common::config::Config;
use opendsec_common::{ApiError, Reason};
use opendsec_proto::v1 as pb;
use serde_json::{Value, json};

use crate::json as j;
use crate::table::{Table, age};

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
    /// Projects (nested: root/team-a/rl).
    #[command(subcommand)]
    Project(ProjectCmd),
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
    /// Benchmarks.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// The cluster's certificates: a CA, and one certificate per component (mTLS).
    #[command(subcommand)]
    Pki(crate::pki::PkiCmd),
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

/// What `sandbox create` gives a sandbox unless told (the SDK's defaults too).
pub const DEFAULT_CPU_MILLIS: u32 = 1000;
pub const DEFAULT_MEMORY_MB: u64 = 1024;
pub const DEFAULT_DISK_MB: u64 = 10240;

#[derive(Args, Debug, Default)]
pub struct SpecArgs {
    /// Isolation backend: `container` (namespaces, cgroups, seccomp; what `make up` runs) or
    /// `sim` (lifecycles without isolation, for scheduling tests).
    #[arg(long)]
    pub backend: String,
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
    #[arg(long, default_value_t = 0)]
    pub gpus: u32,
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
}

#[derive(Subcommand, Debug)]
pub enum SandboxCmd {
    /// Create sandboxes (--count > 1 uses one batch call); prints their ids.
    #[command(after_help = "Examples:\n  \
    opendsecctl sandbox create --backend container --image debian:bookworm\n  \
    opendsecctl sandbox create --backend container --image debian:bookworm --cpu 500 --memory 512 \\\n      \
    --ttl-idle 600 --label job=eval --env SEED=1\n  \
    opendsecctl sandbox create --backend container --image debian:bookworm --count 200   # one batch call\n  \
    opendsecctl sandbox create --backend sim --count 10000 --json")]
    Create {
        #[command(flatten)]
        spec: SpecArgs,
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
}

impl QuotaArgs {
    fn to_pb(&self) -> pb::Quota {
        pb::Quota {
            cpu_millis: self.cpu,
            memory_mb: self.memory,
            disk_mb: self.disk,
            gpus: self.gpus,
            sandboxes: self.sandboxes,
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
pub enum BenchCmd {
    /// Create sandboxes as fast as the cluster takes them, then stop them; print figures.
    Create(crate::bench::BenchArgs),
    /// Shell round trips (Exec) in an existing sandbox; print latency figures.
    Exec(crate::bench::ExecBenchArgs),
}

/// What a command failed with: an API error (exit code by reason) or a local one.
#[derive(Debug)]
pub enum CtlError {
    Api(ApiError),
    Local(String),
}

impl From<ApiError> for CtlError {
    fn from(e: ApiError) -> Self {
        CtlError::Api(e)
    }
}

impl CtlError {
    pub fn exit_code(&self) -> i32 {
        match self {
            CtlError::Api(e) => e.reason.exit_code(),
            CtlError::Local(_) => 1,
        }
    }
}

impl std::fmt::Display for CtlError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CtlError::Api(e) => write!(f, "{}: {}", e.reason, e.message),
            CtlError::Local(m) => f.write_str(m),
        }
    }
}

pub(crate) fn kv(items: &[String], what: &str) -> Result<HashMap<String, String>, CtlError> {
    items
        .iter()
        .map(|s| {
            s.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .ok_or_else(|| CtlError::Api(ApiError::invalid(format!("{what} {s:?} is not KEY=VALUE"))))
        })
        .collect()
}

impl SpecArgs {
    pub fn to_spec(&self, project: Option<&str>) -> Result<pb::SandboxSpec, CtlError> {
        Ok(pb::SandboxSpec {
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
        })
    }
}

pub struct Out {
    pub json: bool,
}

impl Out {
    pub fn print(&self, value: Value, text: impl FnOnce() -> String) {
        if self.json {
            println!("{}", serde_json::to_string_pretty(&value).unwrap_or_default());
        } else {
            println!("{}", text());
        }
    }
}

fn now_ms() -> i64 {
    opendsec_common::time::now_ms() as i64
}

/// Seconds from `from_ms` to `to_ms` for people (`-` when either is unset).
fn span(from_ms: i64, to_ms: i64) -> String {
    if from_ms <= 0 || to_ms <= 0 {
        return "-".into();
    }
    age((to_ms - from_ms).max(0) as u64 / 1000)
}

fn labels_text(l: &HashMap<String, String>) -> String {
    let mut v: Vec<String> = l.iter().map(|(k, v)| format!("{k}={v}")).collect();
    v.sort();
    v.join(",")
}

fn sandbox_table(items: &[pb::Sandbox]) -> Table {
    let now = now_ms();
    let mut t = Table::new(&["ID", "STATE", "BACKEND", "IMAGE", "PROJECT", "AGE", "EXPIRES IN", "LABELS"]);
    for s in items {
        let spec = s.spec.clone().unwrap_or_default();
        let mut state = j::state_name(s.state).to_ascii_lowercase();
        if !s.end_reason.is_empty() {
            state = format!("{state} ({})", s.end_reason);
        }
        let expires =
            if s.expires_at_ms > 0 && s.expires_at_ms > now { span(now, s.expires_at_ms) } else { "-".into() };
        t.row(vec![
            s.id.clone(),
            state,
            spec.backend,
            spec.image,
            spec.project,
            span(s.created_at_ms, now),
            expires,
            labels_text(&spec.labels),
        ]);
    }
    t
}

fn sandbox_text(s: &pb::Sandbox) -> String {
    let spec = s.spec.clone().unwrap_or_default();
    let r = spec.resources.unwrap_or_default();
    let now = now_ms();
    let mut lines = vec![
        format!("id:          {}", s.id),
        format!("state:       {}", j::state_name(s.state).to_ascii_lowercase()),
        format!("backend:     {}", spec.backend),
        format!("image:       {}", spec.image),
        format!("project:     {}", spec.project),
        format!(
            "resources:   {} millicores, {} MiB memory, {} MiB disk{}",
            r.cpu_millis,
            r.memory_mb,
            r.disk_mb,
            if r.gpus > 0 { format!(", {} GPUs", r.gpus) } else { String::new() }
        ),
        format!("created:     {} ago by {}", span(s.created_at_ms, now), s.principal),
        format!("last active: {} ago", span(s.last_active_ms, now)),
    ];
    if s.expires_at_ms > now {
        lines.push(format!("expires in:  {} (unless active)", span(now, s.expires_at_ms)));
    }
    if !spec.labels.is_empty() {
        lines.push(format!("labels:      {}", labels_text(&spec.labels)));
    }
    if !s.end_reason.is_empty() {
        lines.push(format!("ended:       {}", s.end_reason));
    }
    lines.join("\n")
}

fn sandbox_line(s: &pb::Sandbox) -> String {
    let spec = s.spec.clone().unwrap_or_default();
    let end = if s.end_reason.is_empty() { String::new() } else { format!("  ({})", s.end_reason) };
    format!("{}  {:<8}  {}  {}  {}{end}", s.id, j::state_name(s.state), spec.backend, spec.project, spec.image)
}

/// Projects with `used/limit` per quota key (`-`: no limit on the chain).
fn usage_table(projects: &[pb::Project]) -> Table {
    let mut t = Table::new(&["PROJECT", "SANDBOXES", "CPU (millicores)", "MEMORY (MiB)", "DISK (MiB)", "GPUS"]);
    for p in projects {
        let q = p.effective.unwrap_or_default();
        let u = p.usage.unwrap_or_default();
        let c = |used: u64, lim: Option<u64>| {
            format!("{used}/{}", lim.map(|v| v.to_string()).unwrap_or_else(|| "-".into()))
        };
        t.row(vec![
            p.path.clone(),
            c(u.sandboxes, q.sandboxes),
            c(u.cpu_millis, q.cpu_millis),
            c(u.memory_mb, q.memory_mb),
            c(u.disk_mb, q.disk_mb),
            c(u.gpus, q.gpus),
        ]);
    }
    t
}

fn project_text(p: &pb::Project) -> String {
    let q = p.effective.unwrap_or_default();
    let u = p.usage.unwrap_or_default();
    let lim = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
    format!(
        "{}\n  cpu_millis {} / {}\n  memory_mb  {} / {}\n  disk_mb    {} / {}\n  gpus       {} / {}\n  sandboxes  {} / {}",
        p.path,
        u.cpu_millis,
        lim(q.cpu_millis),
        u.memory_mb,
        lim(q.memory_mb),
        u.disk_mb,
        lim(q.disk_mb),
        u.gpus,
        lim(q.gpus),
        u.sandboxes,
        lim(q.sandboxes)
    )
}

/// Runs one parsed command line; `Ok` holds the exit code (the remote command's for `exec` and
/// `run`, else 0).
pub async fn run(cli: Cli) -> Result<i32, CtlError> {
    let out = Out { json: cli.json };
    if let Command::Cluster(ClusterCmd::Up { config, state_dir, sim_edges, insecure_plaintext, keep_sandboxes }) =
        &cli.command
    {
        return cluster_up(config.clone(), state_dir.clone(), *sim_edges, *insecure_plaintext, *keep_sandboxes)
            .await
            .map(|()| 0);
    }
    if let Command::Pki(cmd) = cli.command {
        return crate::pki::run(&out, cmd).map(|()| 0);
    }
    let addrs: Vec<String> = cli.addr.split(',').map(str::to_string).collect();
    let tls =
        opendsec_common::grpc::PublicTls::choose(cli.ca.as_deref(), cli.insecure_plaintext, cli.tls_name.as_deref())?;
    let client = Client::new(&addrs, cli.token.as_deref(), &tls)?;
    let project = cli.project.clone();
    match cli.command {
        Command::Exec(a) => crate::runtime::exec(&client, &out, a).await,
        Command::Run(a) => crate::runtime::run(&client, &out, a).await,
        Command::Cp(a) => crate::runtime::cp(&client, &out, a).await.map(|()| 0),
        Command::Ps { sandbox } => crate::runtime::ps(&client, &out, sandbox).await.map(|()| 0),
        Command::Kill(a) => crate::runtime::kill(&client, &out, a).await.map(|()| 0),
        other => api(&client, &out, project, other).await.map(|()| 0),
    }
}

/// The commands that map one-to-one onto public calls.
async fn api(client: &Client, out: &Out, project: Option<String>, command: Command) -> Result<(), CtlError> {
    match command {
        Command::Cluster(_)
        | Command::Pki(_)
        | Command::Exec(_)
        | Command::Run(_)
        | Command::Cp(_)
        | Command::Ps { .. }
        | Command::Kill(_) => {
            unreachable!("handled in run")
        }
        Command::Sandbox(cmd) => sandbox(client, out, project.as_deref(), cmd).await,
        Command::Project(cmd) => match cmd {
            ProjectCmd::Create { path, quota } => {
                let p = client.create_project(pb::CreateProjectRequest { path, quota: Some(quota.to_pb()) }).await?;
                out.print(j::project(&p), || format!("created {}", p.path));
                Ok(())
            }
            ProjectCmd::Get { path } => {
                let p = client.get_project(pb::GetProjectRequest { path }).await?;
                out.print(j::project(&p), || project_text(&p));
                Ok(())
            }
            ProjectCmd::List { path } => {
                let path = path.or(project).unwrap_or_else(|| "root".into());
                let r = client.list_projects(pb::ListProjectsRequest { path }).await?;
                out.print(Value::Array(r.projects.iter().map(j::project).collect()), || {
                    usage_table(&r.projects).render("no projects")
                });
                Ok(())
            }
            ProjectCmd::Delete { path } => {
                client.delete_project(pb::DeleteProjectRequest { path: path.clone() }).await?;
                out.print(json!({"deleted": path}), || format!("deleted {path}"));
                Ok(())
            }
        },
        Command::Quota(cmd) => match cmd {
            QuotaCmd::Set { path, quota } => {
                let p = client.set_quota(pb::SetQuotaRequest { path, quota: Some(quota.to_pb()) }).await?;
                out.print(j::project(&p), || project_text(&p));
                Ok(())
            }
            QuotaCmd::Get { path } => {
                let p = client.get_project(pb::GetProjectRequest { path }).await?;
                out.print(
                    json!({"path": p.path, "quota": j::quota(&p.quota), "effective": j::quota(&p.effective)}),
                    || project_text(&p),
                );
                Ok(())
            }
        },
        Command::Principal(cmd) => match cmd {
            PrincipalCmd::Create { name } => {
                let project =
                    project.ok_or_else(|| CtlError::Api(ApiError::invalid("principal create needs --project")))?;
                let p = client.create_principal(pb::CreatePrincipalRequest { name, project }).await?;
                out.print(j::principal(&p), || format!("created principal {} in {}", p.name, p.project));
                Ok(())
            }
            PrincipalCmd::List => {
                let project = project.unwrap_or_else(|| "root".into());
                let r = client.list_principals(pb::ListPrincipalsRequest { project }).await?;
                out.print(Value::Array(r.principals.iter().map(j::principal).collect()), || {
                    let mut t = Table::new(&["NAME", "PROJECT"]);
                    for p in &r.principals {
                        t.row(vec![p.name.clone(), p.project.clone()]);
                    }
                    t.render("no principals")
                });
                Ok(())
            }
            PrincipalCmd::Delete { name } => {
                client.delete_principal(pb::DeletePrincipalRequest { name: name.clone() }).await?;
                out.print(json!({"deleted": name}), || format!("deleted principal {name}"));
                Ok(())
            }
        },
        Command::Token(cmd) => match cmd {
            TokenCmd::Create { principal, ttl, description } => {
                let r = client
                    .create_token(pb::CreateTokenRequest {
                        principal: principal.unwrap_or_default(),
                        ttl_s: ttl,
                        description,
                    })
                    .await?;
                let info = r.info.clone().unwrap_or_default();
                out.print(json!({"token": r.token, "info": j::token_info(&info)}), || r.token.clone());
                Ok(())
            }
            TokenCmd::List { principal } => {
                let r = client.list_tokens(pb::ListTokensRequest { principal: principal.unwrap_or_default() }).await?;
                out.print(Value::Array(r.tokens.iter().map(j::token_info).collect()), || {
                    let now = now_ms();
                    let mut tb = Table::new(&["ID", "PRINCIPAL", "STATUS", "DESCRIPTION"]);
                    for t in &r.tokens {
                        let status = match (t.revoked, t.expires_at_ms) {
                            (true, _) => "revoked".to_string(),
                            (false, 0) => "valid, no expiry".to_string(),
                            (false, e) if e <= now => "expired".to_string(),
                            (false, e) => format!("expires in {}", span(now, e)),
                        };
                        tb.row(vec![t.id.clone(), t.principal.clone(), status, t.description.clone()]);
                    }
                    tb.render("no tokens")
                });
                Ok(())
            }
            TokenCmd::Revoke { id } => {
                client.revoke_token(pb::RevokeTokenRequest { id: id.clone() }).await?;
                out.print(json!({"revoked": id}), || format!("revoked {id}"));
                Ok(())
            }
        },
        Command::Grant(cmd) => match cmd {
            GrantCmd::Add { principal, project, permission } => {
                let g = pb::Grant { principal, project, permission };
                client.grant(pb::GrantRequest { grant: Some(g.clone()) }).await?;
                out.print(j::grant(&g), || format!("granted {} on {} to {}", g.permission, g.project, g.principal));
                Ok(())
            }
            GrantCmd::Remove { principal, project, permission } => {
                let g = pb::Grant { principal, project, permission };
                client.revoke_grant(pb::RevokeGrantRequest { grant: Some(g.clone()) }).await?;
                out.print(j::grant(&g), || format!("revoked {} on {} from {}", g.permission, g.project, g.principal));
                Ok(())
            }
            GrantCmd::List { principal, on_project } => {
                let r = client
                    .list_grants(pb::ListGrantsRequest {
                        principal: principal.unwrap_or_default(),
                        project: on_project.unwrap_or_default(),
                    })
                    .await?;
                out.print(Value::Array(r.grants.iter().map(j::grant).collect()), || {
                    let mut t = Table::new(&["PRINCIPAL", "PROJECT", "PERMISSION"]);
                    for g in &r.grants {
                        t.row(vec![g.principal.clone(), g.project.clone(), g.permission.clone()]);
                    }
                    t.render("no grants")
                });
                Ok(())
            }
        },
        Command::Usage { project: p } => {
            let path = p.or(project).unwrap_or_else(|| "root".into());
            let r = client.get_usage(pb::GetUsageRequest { project: path }).await?;
            out.print(Value::Array(r.projects.iter().map(j::project).collect()), || {
                usage_table(&r.projects).render("no projects")
            });
            Ok(())
        }
        Command::Whoami => {
            let r = client.who_am_i(pb::WhoAmIRequest {}).await?;
            out.print(
                json!({"principal": r.principal, "project": r.project, "token_id": r.token_id, "token_expires_at_ms": r.token_expires_at_ms, "grants": r.grants.iter().map(j::grant).collect::<Vec<_>>()}),
                || format!("{} ({})", r.principal, r.project),
            );
            Ok(())
        }
        Command::Backup { file } => {
            let r = client.backup(pb::BackupRequest {}).await?;
            write_file_atomic(&file, &r.data)?;
            out.print(json!({"file": file, "bytes": r.data.len()}), || {
                format!("wrote {} bytes to {}", r.data.len(), file.display())
            });
            Ok(())
        }
        Command::Restore { file } => {
            let data =
                std::fs::read(&file).map_err(|e| CtlError::Local(format!("failed to read {}: {e}", file.display())))?;
            client.restore(pb::RestoreRequest { data }).await?;
            out.print(json!({"restored": file}), || format!("restored from {}", file.display()));
            Ok(())
        }
        Command::Image(cmd) => crate::image::run(client, out, project.as_deref(), cmd).await,
        Command::Bench(BenchCmd::Create(args)) => {
            let report = crate::bench::create(client, project.as_deref(), &args).await?;
            out.print(report.to_json(), || report.to_text());
            Ok(())
        }
        Command::Bench(BenchCmd::Exec(args)) => {
            let phase = crate::bench::exec(client, &args).await?;
            out.print(phase.json(), || phase.exec_text());
            Ok(())
        }
    }
}

fn write_file_atomic(path: &std::path::Path, data: &[u8]) -> Result<(), CtlError> {
    let err = |e: std::io::Error| CtlError::Local(format!("failed to write {}: {e}", path.display()));
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, data).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

async fn sandbox(client: &Client, out: &Out, project: Option<&str>, cmd: SandboxCmd) -> Result<(), CtlError> {
    match cmd {
        SandboxCmd::Create { spec, count } => {
            let spec = spec.to_spec(project)?;
            if count <= 1 {
                let s = client.create_sandbox(spec).await?;
                out.print(j::sandbox(&s), || s.id.clone());
                return Ok(());
            }
            let mut stream = client.create_sandboxes(spec, count).await?;
            let mut results = Vec::new();
            let mut failed = 0u32;
            // Ids go to stdout as they come (for scripts); the bar to stderr, on a terminal only.
            let bar = batch_bar(count, out.json);
            while let Some(item) = stream.message().await.map_err(|s| CtlError::Api(ApiError::from_status(&s)))? {
                match (&item.sandbox, &item.error) {
                    (Some(s), _) => {
                        if !out.json {
                            bar.suspend(|| println!("{}", s.id));
                        }
                        results.push(json!({"index": item.index, "sandbox": j::sandbox(s)}));
                    }
                    (None, Some(e)) => {
                        failed += 1;
                        if !out.json {
                            bar.suspend(|| eprintln!("#{}: {}: {}", item.index, e.reason, e.message));
                        }
                        results.push(json!({"index": item.index, "error": {"reason": e.reason, "message": e.message}}));
                    }
                    (None, None) => {}
                }
                bar.inc(1);
                if failed > 0 {
                    bar.set_message(format!("{failed} failed"));
                }
            }
            bar.finish_and_clear();
            if out.json {
                println!("{}", serde_json::to_string_pretty(&Value::Array(results)).unwrap_or_default());
            }
            if failed > 0 {
                return Err(CtlError::Local(format!("{failed} of {count} creations failed")));
            }
            Ok(())
        }
        SandboxCmd::List { states, labels, page_size, page_token, all } => {
            let mut st = Vec::new();
            for s in &states {
                let v = j::parse_state(s)
                    .ok_or_else(|| CtlError::Api(ApiError::invalid(format!("unknown state {s:?}"))))?;
                st.push(v as i32);
            }
            let req = pb::ListSandboxesRequest {
                project: project.unwrap_or_default().to_string(),
                states: st,
                labels: kv(&labels, "label")?,
                page_size,
                page_token,
            };
            let (items, next) = if all {
                (client.list_all_sandboxes(req).await?, String::new())
            } else {
                let r = client.list_sandboxes(req).await?;
                (r.sandboxes, r.next_page_token)
            };
            out.print(
                json!({"sandboxes": items.iter().map(j::sandbox).collect::<Vec<_>>(), "next_page_token": next}),
                || {
                    let mut s = sandbox_table(&items).render("no sandboxes");
                    if !next.is_empty() {
                        s.push_str(&format!("\n(more: --page-token {next})"));
                    }
                    s
                },
            );
            Ok(())
        }
        SandboxCmd::Get { id } => {
            let s = client.get_sandbox(&id).await?;
            out.print(j::sandbox(&s), || sandbox_text(&s));
            Ok(())
        }
        SandboxCmd::Stop { id } => {
            let s = client.stop_sandbox(&id).await?;
            out.print(j::sandbox(&s), || sandbox_line(&s));
            Ok(())
        }
        SandboxCmd::Pause { id } => {
            let s = client.pause_sandbox(&id).await?;
            out.print(j::sandbox(&s), || sandbox_line(&s));
            Ok(())
        }
        SandboxCmd::Resume { id } => {
            let s = client.resume_sandbox(&id).await?;
            out.print(j::sandbox(&s), || sandbox_line(&s));
            Ok(())
        }
        SandboxCmd::SetTimeout { id, idle, max, paused } => {
            let s = client
                .set_sandbox_timeout(pb::SetSandboxTimeoutRequest {
                    id,
                    ttl_running_stop_s: idle,
                    ttl_max_s: max,
                    ttl_paused_s: paused,
                })
                .await?;
            out.print(j::sandbox(&s), || sandbox_line(&s));
            Ok(())
        }
    }
}

/// The progress bar of a batch creation: on stderr when it is a terminal and the output is
/// text; hidden (every call a no-op) otherwise.
fn batch_bar(count: u32, json: bool) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if json || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let style = indicatif::ProgressStyle::with_template("creating [{bar:30}] {pos}/{len} {elapsed} {msg}")
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> ");
    let bar = indicatif::ProgressBar::with_draw_target(Some(count as u64), indicatif::ProgressDrawTarget::stderr());
    bar.set_style(style);
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}

async fn cluster_up(
    config: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    sim_edges: Option<u32>,
    insecure_plaintext: bool,
    keep_sandboxes: bool,
) -> Result<(), CtlError> {
    let mut cfg = match &config {
        Some(p) => Config::load(p).map_err(|e| CtlError::Local(e.to_string()))?,
        None => Config::default(),
    };
    cfg.apiserver.insecure_plaintext |= insecure_plaintext;
    // A one-process development cluster: "down" means down unless asked otherwise. (A node's
    // `opendsec edge` daemon keeps its sandboxes across restarts: edge.keep_sandboxes_on_exit.)
    cfg.edge.keep_sandboxes_on_exit = keep_sandboxes;
    let cluster = opendsec_cluster::Cluster::up(cfg, opendsec_cluster::UpOptions { state_dir, sim_edges })
        .await
        .map_err(|e| CtlError::Local(e.to_string()))?;
    if let Err(e) = cluster.wait_ready(std::time::Duration::from_secs(60)).await {
        tracing::warn!(error = %e, "cluster not fully ready yet");
    }
    println!("opendsec cluster is up");
    println!("  apiserver:   {}", cluster.apiserver_addr);
    if let Some(m) = cluster.metrics_addr {
        println!("  metrics:     http://{m}/metrics");
    }
    println!("  edges:       {} ({})", cluster.edge_names().len(), cluster.config.edge.backends.join(", "));
    println!("  state:       {}", cluster.config.state_dir.display());
    println!("  admin token: written to {}", cluster.admin_token_path.display());
    let tls_env = if cluster.config.apiserver.insecure_plaintext {
        println!("  public API:  plain text (--insecure-plaintext)");
        "OPENDSEC_INSECURE_PLAINTEXT=1".to_string()
    } else {
        println!("  CA:          {}", cluster.ca_path.display());
        format!("OPENDSEC_CA={}", cluster.ca_path.display())
    };
    println!();
    println!(
        "  export OPENDSEC_ADDR={} OPENDSEC_TOKEN=$(cat {}) {tls_env}",
        cluster.apiserver_addr,
        cluster.admin_token_path.display()
    );
    if keep_sandboxes {
        println!("Ctrl-C stops the cluster; its sandboxes keep running (--keep-sandboxes).");
    } else {
        println!("Ctrl-C stops the cluster and its sandboxes (--keep-sandboxes leaves them running).");
    }
    wait_for_signal().await;
    let live = if keep_sandboxes { None } else { live_sandboxes(&cluster).await };
    println!("stopping");
    cluster.shutdown().await;
    match (keep_sandboxes, live) {
        (true, _) => println!("stopped the cluster; its sandboxes are left running for the next `cluster up` to adopt"),
        (false, Some(n)) => println!("stopped the cluster and {n} live sandbox{}", if n == 1 { "" } else { "es" }),
        (false, None) => println!("stopped the cluster and its live sandboxes"),
    }
    Ok(())
}

/// How many live sandboxes the cluster holds (None: it could not say).
async fn live_sandboxes(cluster: &opendsec_cluster::Cluster) -> Option<usize> {
    let addr = [cluster.apiserver_addr.to_string()];
    let client = Client::new(&addr, Some(&cluster.admin_token), &cluster.client_tls())
        .ok()?
        .with_retry_timeout(std::time::Duration::ZERO);
    let req = pb::ListSandboxesRequest { project: "root".into(), page_size: 1000, ..Default::default() };
    let all = tokio::time::timeout(std::time::Duration::from_secs(5), client.list_all_sandboxes(req)).await.ok()?;
    all.ok().map(|v| v.len())
}

/// Resolves on SIGINT or SIGTERM.
pub async fn wait_for_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = match signal(SignalKind::terminate()) {
        Ok(s) => s,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// What the caller had when a command failed, for [`hint`].
pub struct HintContext {
    /// The apiserver addresses tried.
    pub addr: String,
    /// Whether a token was given (flag or OPENDSEC_TOKEN).
    pub has_token: bool,
}

/// What to do next about a failure, for people (printed under the error; scripts use the exit
/// code, one per reason). None where the error says it all.
pub fn hint(e: &CtlError, cx: &HintContext) -> Option<String> {
    let CtlError::Api(e) = e else {
        return None;
    };
    let meta = |k: &str| e.metadata.get(k).map(String::as_str);
    let h = match e.reason {
        // A connection that failed (the client's own error: no server said anything).
        Reason::Unavailable if ["connect", "transport", "dns", "connection"].iter().any(|w| e.message.contains(w)) => {
            format!(
                "is a cluster running at {}? `make up` starts a local one (as root); `opendsecctl cluster up` \
             a sim-only one. Point OPENDSEC_ADDR (or --addr) at its apiserver.",
                cx.addr
            )
        }
        Reason::Unavailable => "the node or sandbox cannot serve right now; retry in a moment".into(),
        Reason::Unauthenticated if !cx.has_token => "set OPENDSEC_TOKEN (a local cluster writes its admin token to \
             opendsec-state/admin.token: export OPENDSEC_TOKEN=$(cat opendsec-state/admin.token))"
            .into(),
        Reason::Unauthenticated => {
            "the token is unknown, expired or revoked: ask for a new one (`opendsecctl token create`)".into()
        }
        Reason::PermissionDenied => "`opendsecctl whoami` shows your grants; someone who administers the project \
             adds one with `opendsecctl grant add PRINCIPAL PROJECT PERMISSION`"
            .into(),
        Reason::NotFound if meta("backend").is_some() => format!(
            "no edge of this cluster runs backend {:?}: `make up` starts a container edge, \
             `opendsecctl cluster up --sim-edges N` sim edges",
            meta("backend").unwrap_or_default()
        ),
        Reason::NotFound if meta("image").is_some() => "`opendsecctl image list` shows the images the project \
             sees; `opendsecctl image import` adds one (docs/images.md)"
            .into(),
        Reason::NotFound if e.message.contains("sandbox") => {
            "`opendsecctl sandbox list` shows the sandboxes you can see (a stopped one stays listed a while)".into()
        }
        Reason::QuotaExceeded => "`opendsecctl usage PROJECT` shows quota and usage: stop sandboxes, ask for less \
             (--cpu, --memory, --disk), or raise the quota with `opendsecctl quota set`"
            .into(),
        Reason::NoCapacity => "every edge that could run it is full or under pressure: retry later, ask for \
             less CPU or memory, or add edges"
            .into(),
        Reason::RateLimited => "too many creations at once: retry after the wait the message gives, or use \
             one batch call (`sandbox create --count N`)"
            .into(),
        Reason::InvalidState if e.message.contains("sandbox") || meta("state").is_some() => {
            "`opendsecctl sandbox get ID` shows its state".into()
        }
        Reason::DeadlineExceeded => "the call may still have taken effect: check (`sandbox get`, `sandbox list`) \
             before you repeat it"
            .into(),
        Reason::Internal => "this is a bug: please report it with the message above".into(),
        Reason::InvalidArgument
        | Reason::AlreadyExists
        | Reason::InvalidState
        | Reason::NotFound
        | Reason::NotLeader => return None,
    };
    Some(h)
}

/// Reason of a failure, for callers that want it.
pub fn reason_of(e: &CtlError) -> Option<Reason> {
    match e {
        CtlError::Api(a) => Some(a.reason),
        CtlError::Local(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_say_what_to_do_next() {
        let cx = HintContext { addr: "127.0.0.1:7000".into(), has_token: false };
        let h = |e: ApiError| hint(&CtlError::Api(e), &cx).unwrap_or_default();
        assert!(h(ApiError::new(Reason::Unavailable, "tcp connect error")).contains("make up"));
        // A running cluster that cannot serve this now is not told to start one.
        let busy = h(ApiError::new(Reason::Unavailable, "a creation with lease id x is in progress"));
        assert!(!busy.contains("make up") && busy.contains("retry"), "{busy}");
        assert!(h(ApiError::new(Reason::Unauthenticated, "no token")).contains("admin.token"));
        let with_token = HintContext { has_token: true, ..cx };
        let e = CtlError::Api(ApiError::new(Reason::Unauthenticated, "unknown token"));
        assert!(hint(&e, &with_token).unwrap_or_default().contains("token create"));
        let cx = HintContext { addr: String::new(), has_token: true };
        let h = |e: ApiError| hint(&CtlError::Api(e), &cx).unwrap_or_default();
        assert!(
            h(ApiError::new(Reason::NotFound, "no edge offers backend").with("backend", "microvm")).contains("microvm")
        );
        assert!(h(ApiError::new(Reason::NotFound, "image x").with("image", "x")).contains("image import"));
        assert!(h(ApiError::new(Reason::QuotaExceeded, "over")).contains("quota set"));
        assert_eq!(hint(&CtlError::Local("disk".into()), &cx), None);
    }

    #[test]
    fn only_cluster_up_serves() {
        let p = |a: &[&str]| <Cli as clap::Parser>::try_parse_from(a).unwrap();
        assert!(p(&["opendsecctl", "cluster", "up"]).serves());
        assert!(!p(&["opendsecctl", "sandbox", "list"]).serves());
    }
}
