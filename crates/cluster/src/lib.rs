//! Assembles opendsec components from one config: `opendsecctl cluster up` (IAM, a watcher, an
//! apiserver and N sim edges in one process, all talking real gRPC over loopback, and an image
//! store seeded with `scratch:latest`) and the single-component daemons of the `opendsec`
//! binary.
//!
//! Each component runs on its own listener with its own shutdown trigger, so tests can stop
//! and restart one edge or the apiserver while the rest keeps running.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use opendsec_common::config::{Config, EdgeEndpoint};
use opendsec_common::egress::Ipv4Net;
use opendsec_common::grpc;
use opendsec_common::pki::{self, Identity};
use opendsec_common::tls::{Credentials, TlsFiles};
use opendsec_edge::backend::container::{ContainerBackend, ContainerOptions};
use opendsec_edge::backend::sim::SimBackend;
use opendsec_edge::backend::{Backend, BackendError};
use opendsec_edge::linuxrt::cgroup::IoLimits;
use opendsec_edge::linuxrt::idmap::IdPool;
use opendsec_edge::netpol::{self, Network};
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub mod tokens;

#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("failed to bind {what} on {addr}: {source}")]
    Bind { what: String, addr: String, source: std::io::Error },
    #[error("failed to prepare state directory {path}: {source}")]
    StateDir { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    Tokens(#[from] tokens::TokenError),
    #[error("iam: {0}")]
    Iam(#[from] opendsec_iam::IamError),
    #[error("edge {name}: {source}")]
    Edge { name: String, source: opendsec_edge::EdgeError },
    #[error("watcher: {0}")]
    Watcher(#[from] opendsec_watcher::WatcherError),
    #[error("no such component: {0}")]
    NoSuchComponent(String),
    #[error("component {0} is already running")]
    AlreadyRunning(String),
    #[error("edge.backends: {0:?} is not available in this build yet (only \"sim\" and \"container\" are)")]
    BackendUnavailable(String),
    #[error("edge {edge}: network: {source}")]
    Network { edge: String, source: opendsec_edge::netpol::NetworkError },
    #[error("edge {edge}: backend {backend}: {source}")]
    Backend { edge: String, backend: String, source: opendsec_edge::backend::BackendError },
    #[error("cluster did not become ready within {0:?}: {1}")]
    NotReady(Duration, String),
    #[error("image store {path}: {source}")]
    ImageStore { path: PathBuf, source: opendsec_images::StoreError },
    #[error("image store {path}: writing the empty layer: {source}")]
    SeedLayer { path: PathBuf, source: opendsec_images::layer::LayerError },
    #[error("pki: {0}")]
    Pki(#[from] pki::PkiError),
    #[error("tls: {0} (make the certificates with `opendsecctl pki init` and `opendsecctl pki issue`)")]
    Tls(#[from] opendsec_common::tls::TlsError),
}

/// One running component: its address, its shutdown trigger and its task.
struct Running {
    stop: oneshot::Sender<()>,
    task: JoinHandle<Result<(), String>>,
}

impl Running {
    async fn stop(self) -> Result<(), String> {
        let _ = self.stop.send(());
        match self.task.await {
            Ok(r) => r,
            Err(e) => Err(format!("task failed: {e}")),
        }
    }
}

fn spawn<F>(f: impl FnOnce(oneshot::Receiver<()>) -> F) -> Running
where
    F: std::future::Future<Output = Result<(), String>> + Send + 'static,
{
    let (stop, rx) = oneshot::channel();
    Running { stop, task: tokio::spawn(f(rx)) }
}

async fn bind(what: &str, addr: &str) -> Result<TcpListener, ClusterError> {
    TcpListener::bind(addr).await.map_err(|source| ClusterError::Bind { what: what.into(), addr: addr.into(), source })
}

/// This host's name as the kernel has it (`host` when unreadable), cut to 64 bytes of
/// `[A-Za-z0-9.-]`.
fn host_name() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    let name: String =
        raw.trim().chars().filter(|c| c.is_ascii_alphanumeric() || *c == '.' || *c == '-').take(64).collect();
    if name.is_empty() { "host".into() } else { name }
}

fn local(l: &TcpListener) -> SocketAddr {
    l.local_addr().unwrap_or_else(|_| SocketAddr::from(([127, 0, 0, 1], 0)))
}

struct EdgeSlot {
    addr: SocketAddr,
    backend: Arc<SimBackend>,
    running: Option<Running>,
}

/// An in-process cluster.
pub struct Cluster {
    /// The config with every address and token filled in.
    pub config: Config,
    pub apiserver_addr: SocketAddr,
    pub metrics_addr: Option<SocketAddr>,
    /// The E2B gateway's address (`E2B_API_URL` and `E2B_SANDBOX_URL`), unless `e2b.listen`
    /// is empty.
    pub e2b_addr: Option<SocketAddr>,
    pub admin_token: String,
    pub admin_token_path: PathBuf,
    /// The admin token as an E2B API key (`E2B_API_KEY`).
    pub admin_e2b_key_path: PathBuf,
    /// The CA file clients of the public API trust (`OPENDSEC_CA`).
    pub ca_path: PathBuf,
    /// The system's CAs and the cluster's in one file, for clients that take only one trust
    /// store (`SSL_CERT_FILE` for E2B's Python SDK); written when the gateway serves HTTPS.
    pub trust_bundle_path: Option<PathBuf>,
    /// Renews the components' certificates while the cluster runs.
    renewer: Option<JoinHandle<()>>,
    /// IAM's members by id (one, id 1, when standalone).
    iam: BTreeMap<u64, IamSlot>,
    watcher: Option<Running>,
    apiserver: Option<Running>,
    e2b: Option<Running>,
    edges: BTreeMap<String, EdgeSlot>,
    clock: opendsec_common::time::Clock,
}
impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster").finish_non_exhaustive()
    }
}

/// One IAM member of a `cluster up` cluster: its own config (data dir, Raft id), address and
/// task.
struct IamSlot {
    config: Config,
    addr: SocketAddr,
    running: Option<Running>,
    /// A replicated member's handle on its log, while it runs.
    replica: Option<opendsec_iam::raft::Replica>,
}

/// Overrides `cluster up` takes from the command line.
#[derive(Clone, Debug, Default)]
pub struct UpOptions {
    pub state_dir: Option<PathBuf>,
    pub sim_edges: Option<u32>,
    /// IAM members to run (`--iam-replicas`; 1: standalone).
    pub iam_replicas: Option<u32>,
    /// The edges' wall clock for TTLs and retention (the system's; tests move a manual one).
    pub clock: opendsec_common::time::Clock,
}

/// The name of the `i`th edge `cluster up` starts (each offers `edge.backends`, not only sim).
pub fn edge_name(i: u32) -> String {
    format!("edge-{i:03}")
}

/// The name of the `i`th edge of a cluster with this config's state: `edge-NNN`, or the
/// `sim-NNN` of a state made before edges were renamed (its sandboxes, records and leases
/// carry that name; a new name would orphan them).
pub fn edge_name_in(config: &Config, i: u32) -> String {
    let old = format!("sim-{i:03}");
    if config.edge_state_dir(&old).is_dir() { old } else { edge_name(i) }
}

impl Cluster {
    /// Starts IAM, a watcher, `sim_edges` sim edges and an apiserver.
    pub async fn up(mut config: Config, opts: UpOptions) -> Result<Cluster, ClusterError> {
        if let Some(d) = opts.state_dir {
            config.state_dir = d;
        }
        if let Some(n) = opts.sim_edges {
            config.sim_edges = n;
        }
        if let Some(n) = opts.iam_replicas {
            config.iam_replicas = n;
        }
        check_backends(&config)?;
        opendsec_common::fsperm::private_dir(&config.state_dir)
            .map_err(|source| ClusterError::StateDir { path: config.state_dir.clone(), source })?;
        seed_images(&config.image_store_dir())?;
        let toks = tokens::resolve(&config)?;
        config.iam.admin_token = toks.admin_token.clone();

        // Bind every listener first so each component knows the others' addresses.
        let iam_ls = bind_iam_members(&config).await?;
        let watcher_l = bind("watcher", &config.watcher.listen).await?;
        let api_l = bind("apiserver", &config.apiserver.listen).await?;
        let metrics_l = if config.apiserver.metrics_listen.is_empty() {
            None
        } else {
            Some(bind("apiserver metrics", &config.apiserver.metrics_listen).await?)
        };
        let e2b_l =
            if config.e2b.listen.is_empty() { None } else { Some(bind("e2b gateway", &config.e2b.listen).await?) };
        config.iam.addrs = iam_ls.iter().map(|l| local(l).to_string()).collect();
        config.watcher.addrs = vec![local(&watcher_l).to_string()];
        let mut edge_ls = Vec::new();
        for i in 0..config.sim_edges {
            let name = edge_name_in(&config, i);
            let l = bind(&format!("edge {name}"), &config.edge.listen).await?;
            config.edges.push(EdgeEndpoint { name: name.clone(), address: local(&l).to_string() });
            edge_ls.push((name, l));
        }

        // One CA in the state directory, fresh certificates for every component at each start,
        // renewed while the cluster runs.
        let ids = cluster_identities(&config);
        pki::local_pki(&config.pki_dir(), &ids, config.tls.leaf_lifetime)?;
        let renewer = Some(tokio::spawn(renew_loop(config.pki_dir(), ids, config.tls.leaf_lifetime)));

        let mut cluster = Cluster {
            apiserver_addr: local(&api_l),
            metrics_addr: metrics_l.as_ref().map(local),
            e2b_addr: e2b_l.as_ref().map(local),
            admin_token: toks.admin_token,
            admin_token_path: toks.admin_token_path,
            admin_e2b_key_path: toks.admin_e2b_key_path,
            ca_path: config.tls_ca(),
            trust_bundle_path: None,
            renewer,
            iam: BTreeMap::new(),
            watcher: None,
            apiserver: None,
            e2b: None,
            edges: BTreeMap::new(),
            config,
            clock: opts.clock,
        };
        for (i, l) in iam_ls.into_iter().enumerate() {
            let id = i as u64 + 1;
            let member = iam_member_config(&cluster.config, id);
            let addr = local(&l);
            let (running, replica) = start_iam(&member, l, &iam_identity(&member, id)).await?;
            cluster.iam.insert(id, IamSlot { config: member, addr, running: Some(running), replica });
        }
        cluster.watcher = Some(start_watcher(&cluster.config, watcher_l)?);
        for (name, l) in edge_ls {
            let backend = Arc::new(SimBackend::new());
            let addr = local(&l);
            let running =
                start_edge(&cluster.config, &name, addr.to_string(), backend.clone(), l, &cluster.clock).await?;
            cluster.edges.insert(name, EdgeSlot { addr, backend, running: Some(running) });
        }
        cluster.apiserver = Some(start_apiserver(&cluster.config, api_l, metrics_l)?);
        if let Some(l) = e2b_l {
            let addrs = vec![cluster.apiserver_addr.to_string()];
            let serve_tls = gateway_tls(&cluster.config)?;
            if serve_tls.is_some() {
                let path = cluster.config.pki_dir().join(pki::TRUST_BUNDLE);
                pki::write_trust_bundle(&cluster.ca_path, Path::new(pki::SYSTEM_CAS), &path)?;
                cluster.trust_bundle_path = Some(path);
            }
            let tls = gateway_client_tls(&cluster.config)?;
            cluster.e2b = Some(start_e2b(&cluster.config, addrs, tls, serve_tls, l));
        }
        Ok(cluster)
    }

    /// How clients reach this cluster's public API: TLS trusting its CA, or plain text when it
    /// was started with `apiserver.insecure_plaintext`.
    pub fn client_tls(&self) -> grpc::PublicTls {
        if self.config.apiserver.insecure_plaintext {
            return grpc::PublicTls::Plaintext;
        }
        // The CA was written at start; a cluster without it could not have started.
        let pem = std::fs::read(&self.ca_path).unwrap_or_default();
        grpc::PublicTls::with_ca(&pem, None).unwrap_or(grpc::PublicTls::Plaintext)
    }

    pub fn edge_names(&self) -> Vec<String> {
        self.edges.keys().cloned().collect()
    }

    /// The address edge `name` serves on.
    pub fn edge_addr(&self, name: &str) -> Option<SocketAddr> {
        self.edges.get(name).map(|e| e.addr)
    }

    /// Links to the components under the apiserver's identity: for tools and tests that
    /// drive the edges' and IAM's internal calls as the apiserver does (a move cut short).
    pub fn apiserver_links(&self) -> Result<Arc<grpc::Links>, ClusterError> {
        Ok(grpc::Links::new(credentials(&self.config, &apiserver_identity())?))
    }

    /// The sim backend of an edge (tests use it to inject faults).
    pub fn sim_backend(&self, name: &str) -> Option<Arc<SimBackend>> {
        self.edges.get(name).map(|e| e.backend.clone())
    }

    /// Waits until the watcher sees every edge healthy and the apiserver had time to fetch
    /// that snapshot.
    pub async fn wait_ready(&self, timeout: Duration) -> Result<(), ClusterError> {
        let deadline = tokio::time::Instant::now() + timeout;
        // As the apiserver would ask (the watcher serves snapshots to apiservers only).
        let links = grpc::Links::new(credentials(&self.config, &apiserver_identity())?);
        let ch = links
            .channel(&self.config.watcher.addrs[0], pki::Role::Watcher, None)
            .map_err(|e| ClusterError::NotReady(timeout, e.message))?;
        let mut client = opendsec_proto::v1::watcher_client::WatcherClient::new(ch);
        let running: Vec<&String> = self.edges.iter().filter(|(_, e)| e.running.is_some()).map(|(n, _)| n).collect();
        let mut last = String::from("no snapshot yet");
        loop {
            if let Ok(snap) = client.get_snapshot(opendsec_proto::v1::GetSnapshotRequest {}).await {
                let snap = snap.into_inner();
                let healthy = running.iter().filter(|n| snap.edges.iter().any(|e| &&e.name == *n && e.healthy)).count();
                if healthy == running.len() {
                    tokio::time::sleep(self.config.apiserver.snapshot_refresh + Duration::from_millis(300)).await;
                    return Ok(());
                }
                last = format!("{healthy} of {} edges healthy", running.len());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(ClusterError::NotReady(timeout, last));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Stops one edge (its sandboxes stay, as with `keep_sandboxes_on_exit`).
    pub async fn stop_edge(&mut self, name: &str) -> Result<(), ClusterError> {
        let slot = self.edges.get_mut(name).ok_or_else(|| ClusterError::NoSuchComponent(name.into()))?;
        if let Some(r) = slot.running.take()
            && let Err(e) = r.stop().await
        {
            tracing::warn!(edge = %name, error = %e, "edge stopped with an error");
        }
        Ok(())
    }

    /// IAM's members: id → address (one, id 1, when standalone).
    pub fn iam_members(&self) -> BTreeMap<u64, SocketAddr> {
        self.iam.iter().map(|(id, s)| (*id, s.addr)).collect()
    }

    /// Stops IAM member `id` (its Raft too); its data directory stays.
    pub async fn stop_iam_member(&mut self, id: u64) -> Result<(), ClusterError> {
        let slot = self.iam.get_mut(&id).ok_or_else(|| ClusterError::NoSuchComponent(format!("iam member {id}")))?;
        slot.replica = None;
        if let Some(r) = slot.running.take()
            && let Err(e) = r.stop().await
        {
            tracing::warn!(member = id, error = %e, "iam member stopped with an error");
        }
        Ok(())
    }

    /// Starts a stopped IAM member again on its address, from its data directory.
    pub async fn start_iam_member(&mut self, id: u64) -> Result<(), ClusterError> {
        let slot = self.iam.get_mut(&id).ok_or_else(|| ClusterError::NoSuchComponent(format!("iam member {id}")))?;
        if slot.running.is_some() {
            return Err(ClusterError::AlreadyRunning(format!("iam member {id}")));
        }
        let l = bind(&format!("iam member {id}"), &slot.addr.to_string()).await?;
        let (running, replica) = start_iam(&slot.config, l, &iam_identity(&slot.config, id)).await?;
        (slot.running, slot.replica) = (Some(running), replica);
        Ok(())
    }

    /// A running replicated IAM member's handle on its log (its Raft's state, for tests and
    /// diagnostics).
    pub fn iam_replica(&self, id: u64) -> Option<opendsec_iam::raft::Replica> {
        self.iam.get(&id).and_then(|s| s.replica.clone())
    }

    /// Starts a stopped edge again on its old address, with the same state directory.
    pub async fn start_edge(&mut self, name: &str) -> Result<(), ClusterError> {
        let slot = self.edges.get_mut(name).ok_or_else(|| ClusterError::NoSuchComponent(name.into()))?;
        if slot.running.is_some() {
            return Err(ClusterError::AlreadyRunning(name.into()));
        }
        let l = bind(&format!("edge {name}"), &slot.addr.to_string()).await?;
        let running =
            start_edge(&self.config, name, slot.addr.to_string(), slot.backend.clone(), l, &self.clock).await?;
        slot.running = Some(running);
        Ok(())
    }

    pub async fn stop_apiserver(&mut self) {
        if let Some(r) = self.apiserver.take()
            && let Err(e) = r.stop().await
        {
            tracing::warn!(error = %e, "apiserver stopped with an error");
        }
    }

    pub async fn start_apiserver(&mut self) -> Result<(), ClusterError> {
        if self.apiserver.is_some() {
            return Err(ClusterError::AlreadyRunning("apiserver".into()));
        }
        let l = bind("apiserver", &self.apiserver_addr.to_string()).await?;
        self.apiserver = Some(start_apiserver(&self.config, l, None)?);
        Ok(())
    }

    /// Stops everything: the gateway, apiserver, edges, watcher, IAM.
    pub async fn shutdown(mut self) {
        if let Some(r) = self.e2b.take()
            && let Err(e) = r.stop().await
        {
            tracing::warn!(error = %e, "the e2b gateway stopped with an error");
        }
        self.stop_apiserver().await;
        let names = self.edge_names();
        for n in names {
            let _ = self.stop_edge(&n).await;
        }
        let iams: Vec<Running> = self.iam.values_mut().filter_map(|s| s.running.take()).collect();
        for r in self.watcher.take().into_iter().chain(iams) {
            if let Err(e) = r.stop().await {
                tracing::warn!(error = %e, "component stopped with an error");
            }
        }
        if let Some(r) = self.renewer.take() {
            r.abort();
        }
    }
}

/// The identity of IAM, the watcher and the apiserver: one instance each, named `0`.
fn single(role: pki::Role) -> Identity {
    Identity { role, name: "0".into() }
}

fn apiserver_identity() -> Identity {
    single(pki::Role::Apiserver)
}

/// IAM's identity: `iam/0` standalone; a member of a replicated IAM `iam/<id>` (the other
/// members check that a Raft message comes from the member it names).
fn iam_identity(config: &Config, id: u64) -> Identity {
    let name = if config.iam.raft.is_some() || config.iam_replicas > 1 { id.to_string() } else { "0".into() };
    Identity { role: pki::Role::Iam, name }
}

/// Every identity of a `cluster up` cluster: IAM's members, the watcher, the apiserver, each
/// edge.
fn cluster_identities(config: &Config) -> Vec<Identity> {
    let mut ids: Vec<Identity> =
        (1..=u64::from(config.iam_replicas.max(1))).map(|id| iam_identity(config, id)).collect();
    ids.extend([single(pki::Role::Watcher), apiserver_identity()]);
    if !config.e2b.listen.is_empty() {
        ids.push(single(pki::Role::Gateway));
    }
    ids.extend(config.edges.iter().map(|e| Identity { role: pki::Role::Edge, name: e.name.clone() }));
    ids
}

/// The credentials of component `id`: the config's CA and, for a daemon, `tls.bundle`, else
/// `<pki dir>/<role>-<name>.pem`.
fn credentials(config: &Config, id: &Identity) -> Result<Arc<Credentials>, ClusterError> {
    let bundle = config.tls.bundle.clone().unwrap_or_else(|| config.tls_bundle_of(id.role.as_str(), &id.name));
    let creds = Credentials::load(TlsFiles { ca: config.tls_ca(), bundle })?;
    match creds.identity() {
        Some(got) if got == *id => Ok(creds),
        got => Err(ClusterError::Tls(opendsec_common::tls::TlsError::Bad {
            path: creds.files().bundle.clone(),
            message: format!(
                "the certificate is for {}, not {id}",
                got.map_or_else(|| "no opendsec identity".to_string(), |g| g.to_string())
            ),
        })),
    }
}

/// Issues every component's certificate again each third of their lifetime (servers and
/// clients pick the new files up by themselves).
async fn renew_loop(dir: PathBuf, ids: Vec<Identity>, lifetime: Duration) {
    use opendsec_common::periodic::{Cancel, Start, every};
    let period = (lifetime / 3).max(Duration::from_secs(1));
    // Stopped by aborting the task (Cluster::shutdown).
    every(period, Start::AfterOnePeriod, Cancel::Anytime, std::future::pending(), || async {
        let (d, i) = (dir.clone(), ids.clone());
        match tokio::task::spawn_blocking(move || pki::local_pki(&d, &i, lifetime)).await {
            Ok(Ok(())) => tracing::info!(certificates = ids.len(), "renewed the components' certificates"),
            Ok(Err(e)) => tracing::warn!(error = %e, "renewing certificates failed"),
            Err(e) => tracing::warn!(error = %e, "renewing certificates failed"),
        }
    })
    .await
}

/// Where `cluster up` keeps its IAM members' addresses: Raft remembers members by address, so
/// a restart binds the same ones.
const IAM_MEMBERS_FILE: &str = "members.json";

/// Binds IAM's listeners: one for a standalone IAM; for `iam_replicas` members, the addresses
/// of the first start again (or, the first time, `iam.listen` and the ports after it, or free
/// ports when its port is 0, written down for the next start).
async fn bind_iam_members(config: &Config) -> Result<Vec<TcpListener>, ClusterError> {
    let n = config.iam_replicas.max(1);
    let dir = config.iam_data_dir();
    let file = dir.join(IAM_MEMBERS_FILE);
    let standalone_store = dir.join(opendsec_iam::store::DB_FILE);
    if n == 1 {
        if file.exists() {
            return Err(ClusterError::NoSuchComponent(format!(
                "{} holds a replicated IAM: start it with --iam-replicas as at its first start",
                dir.display()
            )));
        }
        return Ok(vec![bind("iam", &config.iam.listen).await?]);
    }
    if standalone_store.exists() {
        return Err(ClusterError::NoSuchComponent(format!(
            "{} holds a standalone IAM: it cannot become replicated in place (back it up, and restore the backup \
             into a new replicated cluster)",
            dir.display()
        )));
    }
    let state_err = |source| ClusterError::StateDir { path: file.clone(), source };
    let known: Option<Vec<String>> = match std::fs::read(&file) {
        Ok(b) => Some(serde_json::from_slice(&b).map_err(|e| state_err(std::io::Error::other(e)))?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(e) => return Err(state_err(e)),
    };
    let mut ls = Vec::new();
    match known {
        Some(addrs) if addrs.len() == n as usize => {
            for (i, a) in addrs.iter().enumerate() {
                ls.push(bind(&format!("iam member {}", i + 1), a).await?);
            }
        }
        Some(addrs) => {
            return Err(ClusterError::NoSuchComponent(format!(
                "{} has {} IAM members; --iam-replicas {n} asks for another number (change members with \
                 `opendsecctl iam add|remove`)",
                dir.display(),
                addrs.len()
            )));
        }
        None => {
            let first: SocketAddr = config.iam.listen.parse().map_err(|_| {
                ClusterError::NoSuchComponent(format!("iam.listen {:?} is not ip:port", config.iam.listen))
            })?;
            for i in 0..n {
                let port = if first.port() == 0 { 0 } else { first.port() + i as u16 };
                ls.push(bind(&format!("iam member {}", i + 1), &SocketAddr::new(first.ip(), port).to_string()).await?);
            }
            let addrs: Vec<String> = ls.iter().map(|l| local(l).to_string()).collect();
            opendsec_common::fsperm::private_dir(&dir)
                .map_err(|source| ClusterError::StateDir { path: dir.clone(), source })?;
            // Whole or not at all: a torn file would lose the members' addresses.
            let tmp = dir.join(format!(".{IAM_MEMBERS_FILE}.tmp"));
            std::fs::write(&tmp, serde_json::to_vec(&addrs).unwrap_or_default()).map_err(state_err)?;
            std::fs::rename(&tmp, &file).map_err(state_err)?;
        }
    }
    Ok(ls)
}

/// Member `id`'s config: with several members, its own data directory and Raft settings (the
/// cluster's first members are all of them).
fn iam_member_config(config: &Config, id: u64) -> Config {
    let mut c = config.clone();
    if config.iam_replicas > 1 {
        c.iam.data_dir = Some(config.iam_data_dir().join(format!("member-{id}")));
        let base = config.iam.raft.clone().unwrap_or_default();
        c.iam.raft = Some(opendsec_common::config::IamRaftConfig {
            id,
            initial_members: config.iam.addrs.iter().enumerate().map(|(i, a)| (i as u64 + 1, a.clone())).collect(),
            ..base
        });
    }
    c
}

/// Starts an IAM: standalone, or the member `config.iam.raft` describes.
async fn start_iam(
    config: &Config,
    l: TcpListener,
    id: &Identity,
) -> Result<(Running, Option<opendsec_iam::raft::Replica>), ClusterError> {
    let tls = credentials(config, id)?;
    let opts = opendsec_iam::IamOptions::from_config(config);
    let iam = match &config.iam.raft {
        Some(r) => opendsec_iam::Iam::open_replicated(opts, r, tls.clone()).await?,
        None => opendsec_iam::Iam::open(opts)?,
    };
    let replica = iam.replica().cloned();
    let running = spawn(move |rx| async move {
        let keep = iam.clone();
        let r = opendsec_iam::serve(iam, l, &tls, async move {
            let _ = rx.await;
        })
        .await
        .map_err(|e| e.to_string());
        keep.shutdown().await;
        r
    });
    Ok((running, replica))
}

fn start_watcher(config: &Config, l: TcpListener) -> Result<Running, ClusterError> {
    let opts = opendsec_watcher::WatcherOptions {
        // The reconcile lock's holder: unique across hosts (two watchers on different hosts
        // both listening on 0.0.0.0:7002 must not both hold it), stable across restarts.
        id: format!("watcher-{}-{}", host_name(), local(&l)),
        config: config.watcher.clone(),
        edges: config.edges.clone(),
        iam_addrs: config.iam.addrs.clone(),
        tls: credentials(config, &single(pki::Role::Watcher))?,
    };
    Ok(spawn(move |rx| async move {
        opendsec_watcher::serve(opts, l, async move {
            let _ = rx.await;
        })
        .await
        .map_err(|e| e.to_string())
    }))
}

async fn start_edge(
    config: &Config,
    name: &str,
    advertise: String,
    backend: Arc<SimBackend>,
    l: TcpListener,
    clock: &opendsec_common::time::Clock,
) -> Result<Running, ClusterError> {
    let mut ecfg = config.edge.clone();
    ecfg.name = name.to_string();
    // A VM backend without its guest kernel cannot run: refused before the host's network is
    // touched.
    if let Some(b) = config.edge.backends.iter().find(|b| *b == "microvm" || *b == "fullvm")
        && config.edge.vm.kernel_dir.is_none()
    {
        return Err(ClusterError::Backend {
            edge: name.into(),
            backend: b.clone(),
            source: opendsec_edge::backend::BackendError::invalid_argument(
                "edge.vm.kernel_dir is not set (scripts/vm-kernel.sh)",
            ),
        });
    }
    let network = build_network(config, name).await?;
    let opts = opendsec_edge::EdgeOptions {
        name: name.to_string(),
        state_dir: config.edge_state_dir(name),
        config: ecfg,
        iam_addrs: config.iam.addrs.clone(),
        watcher_addrs: config.watcher.addrs.clone(),
        tls: credentials(config, &Identity { role: pki::Role::Edge, name: name.to_string() })?,
        advertise,
        clock: clock.clone(),
        network: network.clone(),
    };
    let backends = build_backends(config, name, backend, network)?;
    let edge = opendsec_edge::Edge::start(opts, backends)
        .await
        .map_err(|source| ClusterError::Edge { name: name.to_string(), source })?;
    Ok(spawn(move |rx| async move {
        edge.serve(l, async move {
            let _ = rx.await;
        })
        .await
        .map_err(|e| e.to_string())
    }))
}

/// The backends `config.edge.backends` names. The sim one is the slot's (tests reach it through
/// [`Cluster::sim_backend`]); a container backend is made afresh on every start, so an edge
/// restart adopts its sandboxes as a new process would.
/// The sandbox network of edge `name`, when `network.enabled` and the edge offers containers
/// or VMs.
/// Edges of one cluster share a host: with several, each gets an equal part of
/// `network.subnet`, by the number its name ends in.
async fn build_network(config: &Config, name: &str) -> Result<Option<Arc<Network>>, ClusterError> {
    let networked = ["container", "fncall", "microvm", "fullvm"];
    if !config.network.enabled || !config.edge.backends.iter().any(|b| networked.contains(&b.as_str())) {
        return Ok(None);
    }
    let err = |source| ClusterError::Network { edge: name.to_string(), source };
    let subnet = edge_subnet(config, name);
    let opts = netpol::options_from(&config.network, subnet, &config.edge_state_dir(name)).map_err(err)?;
    let net = tokio::task::spawn_blocking(move || Network::new(opts))
        .await
        .map_err(|e| {
            err(netpol::NetworkError::Io { what: "network setup".into(), source: std::io::Error::other(e.to_string()) })
        })?
        .map_err(err)?;
    Ok(Some(Arc::new(net)))
}

/// Edge `name`'s part of `network.subnet` (the whole of it for a single edge).
pub fn edge_subnet(config: &Config, name: &str) -> Ipv4Net {
    let whole = Ipv4Net::parse(&config.network.subnet)
        .unwrap_or(Ipv4Net { addr: std::net::Ipv4Addr::new(10, 88, 0, 0), prefix: 16 });
    let n = config.sim_edges.max(1).next_power_of_two();
    let bits = n.trailing_zeros() as u8;
    if bits == 0 || whole.prefix + bits > 28 {
        return whole;
    }
    let i = name.rsplit('-').next().and_then(|d| d.parse::<u32>().ok()).unwrap_or(0) % n;
    let prefix = whole.prefix + bits;
    let size = 1u32 << (32 - u32::from(prefix));
    Ipv4Net { addr: std::net::Ipv4Addr::from(whole.first() + i * size), prefix }
}

fn build_backends(
    config: &Config,
    name: &str,
    sim: Arc<SimBackend>,
    network: Option<Arc<Network>>,
) -> Result<Vec<Arc<dyn Backend>>, ClusterError> {
    let mut out: Vec<Arc<dyn Backend>> = Vec::new();
    // One container runtime serves `container` and `fncall` (its warm pools).
    let mut containers: Option<Arc<ContainerBackend>> = None;
    for b in &config.edge.backends {
        match b.as_str() {
            "sim" => out.push(sim.clone()),
            "container" | "fncall" if containers.is_some() => {
                let c = containers.clone().expect("checked");
                out.push(if b == "container" { c } else { Arc::new(opendsec_edge::backend::container::Fncall(c)) });
            }
            "container" | "fncall" => {
                let err = |source| ClusterError::Backend { edge: name.into(), backend: b.clone(), source };
                let init_exe = match &config.edge.container_setup_exe {
                    Some(p) => p.clone(),
                    None => std::env::current_exe()
                        .map_err(|e| err(BackendError::internal(format!("cannot find the running executable: {e}"))))?,
                };
                let state = config.edge_state_dir(name);
                let opts = ContainerOptions {
                    edge: name.into(),
                    store_dir: config.image_store_dir(),
                    state_dir: state.join("containers"),
                    cache_dir: state.join("layers"),
                    init_exe,
                    agent: agent_path(config).map_err(err)?,
                    pids_limit: config.edge.container_pids_limit,
                    pause_reclaim: config.edge.pause_reclaim,
                    agent_silence: config.edge.agent_silence,
                    userns: match config.edge.user_namespaces {
                        true => Some(
                            IdPool::new(config.edge.userns_first_id, config.edge.userns_ranges)
                                .map_err(|e| err(BackendError::invalid_argument(e.to_string())))?,
                        ),
                        false => None,
                    },
                    io: IoLimits {
                        read_bps: config.edge.disk_io.read_bytes_per_s,
                        write_bps: config.edge.disk_io.write_bytes_per_s,
                        read_iops: config.edge.disk_io.read_iops,
                        write_iops: config.edge.disk_io.write_iops,
                    },
                    network: network.clone(),
                    snapshot_max_layers: config.edge.snapshot_max_layers,
                    sessions: match &config.edge.session_store {
                        Some(s) => Some(Arc::new(
                            opendsec_edge::sessions::SessionStore::new(s, state.join("sessions"))
                                .map_err(|e| err(BackendError::invalid_argument(e)))?,
                        )),
                        None => None,
                    },
                };
                let c = Arc::new(ContainerBackend::new(opts).map_err(err)?);
                containers = Some(c.clone());
                out.push(if b == "container" { c } else { Arc::new(opendsec_edge::backend::container::Fncall(c)) });
            }
            "microvm" | "fullvm" => {
                use opendsec_edge::backend::vm::{Accel, Machine, VmBackend, VmOptions};
                let err = |source| ClusterError::Backend { edge: name.into(), backend: b.clone(), source };
                let vm = &config.edge.vm;
                let kernel_dir = vm.kernel_dir.clone().ok_or_else(|| {
                    err(BackendError::invalid_argument("edge.vm.kernel_dir is not set (scripts/vm-kernel.sh)"))
                })?;
                let opts = VmOptions {
                    machine: if b == "microvm" { Machine::Microvm } else { Machine::Q35 },
                    store_dir: config.image_store_dir(),
                    state_dir: config.edge_state_dir(name).join("vms"),
                    agent: agent_path(config).map_err(err)?,
                    kernel_dir,
                    qemu: vm.qemu.clone().into(),
                    accel: match vm.accel.as_str() {
                        "kvm" => Accel::Kvm,
                        "tcg" => Accel::Tcg,
                        _ => Accel::Auto,
                    },
                    boot_timeout: vm.boot_timeout,
                    agent_silence: config.edge.agent_silence,
                    // Always: a VMM runs under a uid of its own whether or not containers use
                    // user namespaces.
                    ids: IdPool::new(config.edge.userns_first_id, config.edge.userns_ranges)
                        .map_err(|e| err(BackendError::invalid_argument(e.to_string())))?,
                    network: network.clone(),
                    gpu_devices: vm.gpu_devices.clone(),
                };
                out.push(Arc::new(VmBackend::new(opts).map_err(err)?));
            }
            other => return Err(ClusterError::BackendUnavailable(other.into())),
        }
    }
    Ok(out)
}

/// The static agent: `edge.agent_path`, else the first statically linked `opendsec-agent`
/// beside the running executable or in cargo's static target directory relative to it.
pub fn agent_path(config: &Config) -> Result<PathBuf, BackendError> {
    if let Some(p) = &config.edge.agent_path {
        return Ok(p.clone());
    }
    let exe = std::env::current_exe()
        .map_err(|e| BackendError::internal(format!("cannot find the running executable: {e}")))?;
    let dir = exe.parent().unwrap_or(Path::new("/"));
    let static_dir = Path::new("x86_64-unknown-linux-gnu/release/opendsec-agent");
    let tried = [dir.join("opendsec-agent"), dir.join("..").join(static_dir), dir.join("../..").join(static_dir)];
    for c in &tried {
        let is_static =
            std::fs::read(c).ok().is_some_and(|b| opendsec_edge::backend::container::check_static_elf(&b).is_ok());
        if is_static {
            return Ok(c.clone());
        }
    }
    let shown: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
    Err(BackendError::invalid_argument(format!(
        "no statically linked opendsec-agent found (tried {}); build it with `make agent` or set edge.agent_path",
        shown.join(", ")
    )))
}

fn start_apiserver(config: &Config, l: TcpListener, metrics: Option<TcpListener>) -> Result<Running, ClusterError> {
    let opts = opendsec_apiserver::ApiserverOptions {
        config: config.apiserver.clone(),
        iam_addrs: config.iam.addrs.clone(),
        watcher_addrs: config.watcher.addrs.clone(),
        tls: credentials(config, &apiserver_identity())?,
        audit_path: config.audit_path(),
        image_store: config.image_store_dir(),
        default_egress: config.network.default_egress.clone(),
    };
    Ok(spawn(move |rx| async move {
        opendsec_apiserver::serve(opts, l, metrics, async move {
            let _ = rx.await;
        })
        .await
        .map_err(|e| e.to_string())
    }))
}

/// The certificate the E2B gateway presents: none without TLS (plain HTTP on loopback), else
/// `e2b.tls_bundle` or the gateway's bundle (`<pki dir>/gateway-0.pem`).
fn gateway_tls(config: &Config) -> Result<Option<Arc<Credentials>>, ClusterError> {
    if config.apiserver.insecure_plaintext {
        return Ok(None);
    }
    let id = single(pki::Role::Gateway);
    let bundle = config.e2b.tls_bundle.clone().unwrap_or_else(|| config.tls_bundle_of(id.role.as_str(), &id.name));
    Ok(Some(Credentials::load(TlsFiles { ca: config.tls_ca(), bundle })?))
}

/// How the E2B gateway reaches the apiservers: TLS checking an apiserver's certificate, and
/// presenting the gateway's own cluster identity (`tls.bundle`, default
/// `<pki dir>/gateway-0.pem`), so that the apiserver believes the caller addresses it names.
/// Without that bundle (a gateway given only a public certificate to serve) it calls without
/// one, and the apiserver counts every E2B caller as the gateway's address.
fn gateway_client_tls(config: &Config) -> Result<grpc::PublicTls, ClusterError> {
    if config.apiserver.insecure_plaintext {
        return Ok(grpc::PublicTls::Plaintext);
    }
    let ca = config.tls_ca();
    let pem = std::fs::read(&ca).map_err(|source| ClusterError::StateDir { path: ca.clone(), source })?;
    let id = single(pki::Role::Gateway);
    let bundle = config.tls.bundle.clone().unwrap_or_else(|| config.tls_bundle_of(id.role.as_str(), &id.name));
    let creds = match Credentials::load(TlsFiles { ca: ca.clone(), bundle: bundle.clone() }) {
        Ok(c) if c.identity().is_some_and(|i| i.role == pki::Role::Gateway) => Some(c),
        Ok(_) => {
            tracing::warn!(bundle = %bundle.display(), "not a gateway's certificate: calling the apiserver without one");
            None
        }
        Err(e) => {
            tracing::warn!(bundle = %bundle.display(), error = %e, "no gateway certificate: calling the apiserver without one");
            None
        }
    };
    grpc::PublicTls::with_ca_as(&pem, None, creds.as_ref())
        .map_err(|e| ClusterError::NoSuchComponent(format!("the CA {}: {e}", ca.display())))
}

fn start_e2b(
    config: &Config,
    apiserver_addrs: Vec<String>,
    tls: grpc::PublicTls,
    serve_tls: Option<Arc<Credentials>>,
    l: TcpListener,
) -> Running {
    let opts = opendsec_e2b::GatewayOptions { config: config.e2b.clone(), apiserver_addrs, tls, serve_tls };
    spawn(move |rx| async move {
        opendsec_e2b::serve(opts, l, async move {
            let _ = rx.await;
        })
        .await
        .map_err(|e| e.to_string())
    })
}

/// The image every fresh cluster has: `scratch:latest` in `root`, one empty layer. Sandboxes
/// of the sim backend need an image to name; real images are imported (`opendsecctl image
/// import`).
pub const SCRATCH_IMAGE: &str = "scratch:latest";

/// The id of the empty layer: the sha256 of an empty tar (1024 zero bytes), Docker's well-known
/// empty layer.
pub const EMPTY_LAYER_ID: &str = "5f70bf18a086007016e948b04aed3b82103a36bea41755b6cddfaf10ace3c6ef";

/// Opens (creating) the image store and puts `scratch:latest` in `root` unless it is there.
pub fn seed_images(dir: &Path) -> Result<(), ClusterError> {
    use opendsec_images::{ImageConfig, ImageRef, LayerId, Manifest, Store, layer};
    let err = |source| ClusterError::ImageStore { path: dir.to_path_buf(), source };
    let store = Store::open(dir).map_err(err)?;
    let scratch = ImageRef::parse(opendsec_common::ids::ROOT_PROJECT, SCRATCH_IMAGE).map_err(err)?;
    if store.has_image(&scratch) {
        return Ok(());
    }
    let id = LayerId::parse(EMPTY_LAYER_ID).map_err(err)?;
    // The empty tar (two zero blocks) through the ordinary import: its hash is checked against
    // the id, and a layer already there is reused.
    let empty_tar = [0u8; 1024];
    layer::import_layer(
        &store,
        &mut &empty_tar[..],
        layer::Compression::None,
        Some(&id.diff_id()),
        &[],
        &layer::Limits::default(),
        "opendsec: the empty layer",
    )
    .map_err(|source| ClusterError::SeedLayer { path: dir.to_path_buf(), source })?;
    let manifest = Manifest {
        v: 1,
        project: scratch.project.clone(),
        repo: scratch.repo.clone(),
        tag: scratch.tag.clone(),
        layers: vec![id],
        config: ImageConfig::default(),
        created_at_ms: opendsec_common::time::now_ms(),
        source: "opendsec cluster up: the empty image".into(),
        vm_snapshot: String::new(),
    };
    opendsec_images::gc::publish_manifest(&store, &manifest).map_err(err)?;
    tracing::info!(store = %dir.display(), image = SCRATCH_IMAGE, "seeded the image store");
    Ok(())
}

/// Runs one component of `config` as a daemon until `shutdown` (the `opendsec` binary).
pub async fn run_daemon(
    role: Role,
    config: Config,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> Result<(), ClusterError> {
    let (tx, rx) = oneshot::channel::<()>();
    let running = match role {
        Role::Iam => {
            // Needed by a first start that may bootstrap IAM (a member being added takes the
            // state from the others).
            let may_bootstrap = config.iam.raft.as_ref().is_none_or(|r| !r.initial_members.is_empty());
            if config.iam.admin_token.is_empty()
                && may_bootstrap
                && !opendsec_iam::store::holds_state(&config.iam_data_dir())
            {
                return Err(tokens::TokenError::Missing(
                    "iam.admin_token: the first start of IAM needs the administrator's token".into(),
                )
                .into());
            }
            let id = iam_identity(&config, config.iam.raft.as_ref().map_or(1, |r| r.id));
            start_iam(&config, bind("iam", &config.iam.listen).await?, &id).await?.0
        }
        Role::Watcher => start_watcher(&config, bind("watcher", &config.watcher.listen).await?)?,
        Role::Apiserver => {
            let l = bind("apiserver", &config.apiserver.listen).await?;
            let m = if config.apiserver.metrics_listen.is_empty() {
                None
            } else {
                Some(bind("apiserver metrics", &config.apiserver.metrics_listen).await?)
            };
            start_apiserver(&config, l, m)?
        }
        Role::E2b => {
            if config.e2b.apiserver_addrs.is_empty() {
                return Err(ClusterError::NoSuchComponent(
                    "e2b.apiserver_addrs is empty: the gateway needs an apiserver".into(),
                ));
            }
            let tls = gateway_client_tls(&config)?;
            let listen =
                if config.e2b.listen.is_empty() { "127.0.0.1:0".to_string() } else { config.e2b.listen.clone() };
            let l = bind("e2b gateway", &listen).await?;
            let serve_tls = gateway_tls(&config)?;
            let scheme = if serve_tls.is_some() { "https" } else { "http" };
            tracing::info!(url = %format!("{scheme}://{}", local(&l)), "the e2b gateway listens");
            start_e2b(&config, config.e2b.apiserver_addrs.clone(), tls, serve_tls, l)
        }
        Role::Edge => {
            check_backends(&config)?;
            let name = config.edge.name.clone();
            if name.is_empty() {
                return Err(ClusterError::NoSuchComponent("edge.name is empty: every edge needs a name".into()));
            }
            let l = bind("edge", &config.edge.listen).await?;
            let addr = local(&l);
            let mut cfg = config.clone();
            if !cfg.edge.advertise.is_empty() {
                // The advertised address is what others dial; the bound one is only ours.
                cfg.edges.push(EdgeEndpoint { name: name.clone(), address: cfg.edge.advertise.clone() });
            }
            // What the watchers and apiservers dial: `edge.advertise` when set, else the bound
            // address.
            let advertise = if cfg.edge.advertise.is_empty() { addr.to_string() } else { cfg.edge.advertise.clone() };
            start_edge(&cfg, &name, advertise, Arc::new(SimBackend::new()), l, &Default::default()).await?
        }
    };
    tokio::spawn(async move {
        shutdown.await;
        let _ = tx.send(());
    });
    let _ = rx.await;
    running.stop().await.map_err(|e| ClusterError::NoSuchComponent(format!("{role:?} stopped with an error: {e}")))
}

/// Sim edges in this process, beside an IAM, watcher and apiserver that run elsewhere (the
/// scale benchmark measures each component's memory in a process of its own). Each listens on
/// its own port of `edge.listen`'s host, advertises it, and registers with `watcher.addrs`.
pub struct SimEdges {
    running: Vec<Running>,
}

impl std::fmt::Debug for SimEdges {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimEdges").field("edges", &self.running.len()).finish()
    }
}

impl SimEdges {
    pub async fn start(config: &Config, names: &[String]) -> Result<SimEdges, ClusterError> {
        check_backends(config)?;
        let mut running = Vec::with_capacity(names.len());
        for name in names {
            let l = bind(&format!("edge {name}"), &config.edge.listen).await?;
            let advertise = local(&l).to_string();
            running
                .push(start_edge(config, name, advertise, Arc::new(SimBackend::new()), l, &Default::default()).await?);
        }
        Ok(SimEdges { running })
    }

    /// Stops them all (their sandboxes stay recorded, as with `keep_sandboxes_on_exit`).
    pub async fn stop(self) {
        for r in self.running {
            if let Err(e) = r.stop().await {
                tracing::warn!(error = %e, "a sim edge stopped with an error");
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Iam,
    Watcher,
    Apiserver,
    Edge,
    E2b,
}

/// Edges offer only what they can run: a config asking for a backend this build cannot start is
/// refused instead of silently running sim sandboxes in its place.
fn check_backends(config: &Config) -> Result<(), ClusterError> {
    match config
        .edge
        .backends
        .iter()
        .find(|b| !matches!(b.as_str(), "sim" | "container" | "fncall" | "microvm" | "fullvm"))
    {
        Some(b) => Err(ClusterError::BackendUnavailable(b.clone())),
        None => Ok(()),
    }
}

/// The admin token file of a state directory.
pub fn admin_token_path(state_dir: &Path) -> PathBuf {
    state_dir.join("admin.token")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_state_from_before_the_rename_keeps_its_edge_names() {
        let tmp = tempfile::tempdir().unwrap();
        let config = Config { state_dir: tmp.path().to_path_buf(), ..Config::default() };
        assert_eq!(edge_name_in(&config, 0), "edge-000");
        std::fs::create_dir_all(config.edge_state_dir("sim-001")).unwrap();
        assert_eq!(edge_name_in(&config, 1), "sim-001");
        assert_eq!(edge_name_in(&config, 2), "edge-002");
    }
}
