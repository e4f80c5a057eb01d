//! `opendsecctl pki`: the cluster's CA and the components' certificates
//! (`opendsec_common::pki`). Local tools: they touch files only, never a cluster.
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Subcommand;
use opendsec_common::pki::{self, Identity, Names};
use serde_json::json;

use crate::error::CtlError;
use crate::output::Out;

#[derive(Subcommand, Debug)]
pub enum PkiCmd {
    /// Make the cluster CA in DIR (ca.pem, ca.key 0600). Keep ca.key offline once the
    /// certificates are issued. The CA may certify only the cluster's own names
    /// (opendsec.internal, localhost, loopback addresses) and those listed here: clients that
    /// trust it (E2B's SDKs, through the trust bundle) trust it for nothing else.
    #[command(after_help = "Example:\n  opendsecctl pki init /etc/opendsec/pki --dns example.com --ip 10.0.0.0/16")]
    Init {
        dir: PathBuf,
        /// Replace an existing CA (every certificate it issued stops being trusted).
        #[arg(long)]
        force: bool,
        /// DNS domains (each with its subdomains) the CA may certify besides the cluster's
        /// own: the names the apiservers and gateways are reached by.
        #[arg(long)]
        dns: Vec<String>,
        /// Addresses or networks (ADDR[/PREFIX]) the CA may certify besides loopback.
        #[arg(long, value_parser = parse_net)]
        ip: Vec<(IpAddr, u8)>,
    },
    /// Issue a certificate + key bundle for one component, with its identity
    /// opendsec://<role>/<name> in the URI SAN.
    #[command(
        after_help = "Examples:\n  opendsecctl pki issue --ca-dir /etc/opendsec/pki --id edge/node-1 --out /etc/opendsec/pki/edge-node-1.pem\n  opendsecctl pki issue --ca-dir /etc/opendsec/pki --id apiserver/0 --dns api.example.com --out apiserver-0.pem"
    )]
    Issue {
        /// The directory holding ca.pem and ca.key.
        #[arg(long)]
        ca_dir: PathBuf,
        /// <role>/<name>: role one of apiserver, iam, watcher, edge, gateway (the E2B
        /// gateway: a public server that may call nothing inside the cluster).
        #[arg(long)]
        id: String,
        /// The bundle to write (default <ca-dir>/<role>-<name>.pem).
        #[arg(long)]
        out: Option<PathBuf>,
        /// Extra DNS names (an apiserver always gets api.opendsec.internal; an apiserver or a
        /// gateway, localhost). Each must lie in a domain the CA was made for.
        #[arg(long)]
        dns: Vec<String>,
        /// Extra IP addresses (a gateway always gets the loopback addresses). Each must lie in
        /// a network the CA was made for; an apiserver's certificate carries none (its clients
        /// check its name, whatever address they dial).
        #[arg(long)]
        ip: Vec<IpAddr>,
        /// How long the certificate is valid (short: rotation is cheap).
        #[arg(long, default_value = "7d", value_parser = humantime::parse_duration)]
        lifetime: Duration,
    },
    /// Issue bundles again with fresh keys (same identity, names and lifetime). Servers and
    /// clients pick the new files up within a second, without a restart.
    #[command(
        after_help = "Example:\n  opendsecctl pki rotate --ca-dir /etc/opendsec/pki /etc/opendsec/pki/edge-*.pem"
    )]
    Rotate {
        #[arg(long)]
        ca_dir: PathBuf,
        #[arg(required = true)]
        bundles: Vec<PathBuf>,
    },
    /// Show what a bundle certifies.
    Show { bundle: PathBuf },
}

fn parse_net(s: &str) -> Result<(IpAddr, u8), String> {
    pki::parse_net(s).ok_or_else(|| format!("{s:?} is not ADDR or ADDR/PREFIX"))
}

fn local<E: std::fmt::Display>(e: E) -> CtlError {
    CtlError::Local(e.to_string())
}

fn info_json(path: &std::path::Path, i: &pki::LeafInfo) -> serde_json::Value {
    json!({
        "bundle": path.display().to_string(),
        "identity": i.identity.uri(),
        "dns": i.names.dns,
        "ips": i.names.ips.iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        "not_after_s": i.not_after_s,
    })
}

fn info_text(path: &std::path::Path, i: &pki::LeafInfo) -> String {
    let until = std::time::UNIX_EPOCH + Duration::from_secs(i.not_after_s.max(0) as u64);
    format!("{}: {} (valid until {})", path.display(), i.identity.uri(), humantime::format_rfc3339_seconds(until))
}

pub fn run(out: &Out, cmd: PkiCmd) -> Result<(), CtlError> {
    match cmd {
        PkiCmd::Init { dir, force, dns, ip } => {
            pki::init_ca(&dir, force, &pki::CaScope { dns, nets: ip }).map_err(local)?;
            let ca = dir.join(pki::CA_CERT);
            out.print(
                json!({ "ca": ca.display().to_string(), "key": dir.join(pki::CA_KEY).display().to_string() }),
                || format!("made the cluster CA: {} (key {}, 0600)", ca.display(), dir.join(pki::CA_KEY).display()),
            );
        }
        PkiCmd::Issue { ca_dir, id, out: path, dns, ip, lifetime } => {
            let id = Identity::parse(&id).map_err(local)?;
            let extra = Names { dns, ips: ip };
            let names = pki::default_names(id.role, &extra);
            let path = path.unwrap_or_else(|| pki::bundle_path(&ca_dir, &id));
            pki::issue(&ca_dir, &path, &id, &names, lifetime).map_err(local)?;
            let i = pki::inspect(&path).map_err(local)?;
            out.print(info_json(&path, &i), || format!("issued {}", info_text(&path, &i)));
        }
        PkiCmd::Rotate { ca_dir, bundles } => {
            let mut done = Vec::new();
            for b in &bundles {
                let i = pki::rotate(&ca_dir, b).map_err(local)?;
                done.push((b.clone(), i));
            }
            out.print(json!(done.iter().map(|(p, i)| info_json(p, i)).collect::<Vec<_>>()), || {
                done.iter().map(|(p, i)| format!("rotated {}", info_text(p, i))).collect::<Vec<_>>().join("\n")
            });
        }
        PkiCmd::Show { bundle } => {
            let i = pki::inspect(&bundle).map_err(local)?;
            out.print(info_json(&bundle, &i), || info_text(&bundle, &i));
        }
    }
    Ok(())
}
