//! `opendsecctl cluster up`: the one-process development cluster, until Ctrl-C or SIGTERM.

use super::*;

pub(crate) async fn cluster_up(
    config: Option<PathBuf>,
    state_dir: Option<PathBuf>,
    sim_edges: Option<u32>,
    iam_replicas: Option<u32>,
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
    let cluster = opendsec_cluster::Cluster::up(
        cfg,
        opendsec_cluster::UpOptions { state_dir, sim_edges, iam_replicas, ..Default::default() },
    )
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
    let iam = cluster.iam_members();
    if iam.len() > 1 {
        println!("  iam:         {} members (Raft): {}", iam.len(), cluster.config.iam.addrs.join(", "));
    }
    println!("  edges:       {} ({})", cluster.edge_names().len(), cluster.config.edge.backends.join(", "));
    println!("  state:       {}", cluster.config.state_dir.display());
    println!("  admin token: written to {}", cluster.admin_token_path.display());
    let e2b_url = cluster.e2b_addr.map(|a| {
        let scheme = if cluster.trust_bundle_path.is_some() { "https" } else { "http" };
        format!("{scheme}://{a}")
    });
    if let Some(u) = &e2b_url {
        println!("  e2b gateway: {u}");
    }
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
    if let Some(u) = &e2b_url {
        // E2B's SDKs trust the system's store: Python's reads SSL_CERT_FILE (the system's CAs
        // and the cluster's), Node adds NODE_EXTRA_CA_CERTS to its own.
        let trust = match &cluster.trust_bundle_path {
            Some(b) => format!(" SSL_CERT_FILE={} NODE_EXTRA_CA_CERTS={}", b.display(), cluster.ca_path.display()),
            None => String::new(),
        };
        println!(
            "  export E2B_API_URL={u} E2B_SANDBOX_URL={u} E2B_API_KEY=$(cat {}){trust}",
            cluster.admin_e2b_key_path.display()
        );
    }
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
pub(crate) async fn live_sandboxes(cluster: &opendsec_cluster::Cluster) -> Option<usize> {
    let addr = [cluster.apiserver_addr.to_string()];
    let client = Client::new(&addr, Some(&cluster.admin_token), &cluster.client_tls())
        .ok()?
        .with_retry_timeout(std::time::Duration::ZERO);
    let req = pb::ListSandboxesRequest { project: "root".into(), page_size: 1000, ..Default::default() };
    let all = tokio::time::timeout(std::time::Duration::from_secs(5), client.list_all_sandboxes(req)).await.ok()?;
    all.ok().map(|v| v.len())
}
