//! The cluster's PKI (reference section 13, `opendsecctl pki`): one CA, and a certificate per
//! component instance whose identity is the URI SAN `opendsec://<role>/<name>`.
//!
//! Files:
//! - `<ca dir>/ca.pem` (the CA certificate, readable by whoever verifies) and `<ca dir>/ca.key`
//!   (its key, 0600; kept offline, or in the state directory for `cluster up`);
//! - a *bundle* per identity: the leaf certificate followed by its private key in one PEM
//!   file (0600), written whole (temp file, rename) so a reader never sees a new key beside an
//!   old certificate. Servers and clients reload a bundle when its file changes
//!   ([`crate::tls`]), so `pki rotate` needs no restart.
//!
//! Leaves carry both the server and client usages: every component serves some calls and makes
//! others. The apiserver's leaf also carries the DNS name [`PUBLIC_NAME`] (and any names and
//! addresses asked for), which public clients verify; no other role's leaf may carry it, so a
//! gateway's key (on a host of lower trust) cannot answer as an apiserver to clients that
//! check only the name (the Python SDK), and clients that can check the URI SAN (ours) check
//! the role too ([`crate::tls::public_client_config`]).
//!
//! The CA is name-constrained ([`init_ca`]): it can certify only the cluster's own names
//! ([`CLUSTER_DOMAIN`], `localhost`, loopback addresses) and those the operator listed when
//! making it. Its certificate is handed to E2B's SDKs as a trust anchor (the trust bundle);
//! the constraints keep a leaf it signs for another name (`example.com`) from being trusted by
//! them, should its key ever sign one.
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, CidrSubnet, DistinguishedName, DnType, ExtendedKeyUsagePurpose,
    GeneralSubtree, IsCa, Issuer, KeyPair, KeyUsagePurpose, NameConstraints, SanType,
};

/// The DNS name public clients check on an apiserver's certificate (whatever address they
/// dial), so one certificate serves every address of an apiserver.
pub const PUBLIC_NAME: &str = "api.opendsec.internal";
/// The DNS domain of the cluster's own names: a CA made by [`init_ca`] certifies names in it.
pub const CLUSTER_DOMAIN: &str = "opendsec.internal";
/// The scheme of identity URIs.
pub const SCHEME: &str = "opendsec://";
pub const CA_CERT: &str = "ca.pem";
pub const CA_KEY: &str = "ca.key";
/// How long a CA made by [`init_ca`] is valid.
pub const CA_LIFETIME: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// How long a leaf is valid unless asked otherwise: short, as rotation is cheap.
pub const LEAF_LIFETIME: Duration = Duration::from_secs(7 * 24 * 3600);

/// Errors of the PKI tools.
#[derive(Debug, thiserror::Error)]
pub enum PkiError {
    #[error("{what} {path}: {source}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Bad { path: PathBuf, message: String },
    #[error("certificate: {0}")]
    Generate(#[from] rcgen::Error),
    #[error("invalid identity {0:?}: want <role>/<name> with role one of {roles} and a name of [a-z0-9-]", roles = Role::NAMES.join(", "))]
    Identity(String),
    #[error("a CA already exists in {0}; pass --force to replace it (every certificate it issued stops working)")]
    CaExists(PathBuf),
    #[error(
        "{name} is not a name the CA may certify (it certifies {allowed}); list it when making the CA (pki init --dns/--ip)"
    )]
    OutsideCa { name: String, allowed: String },
    #[error("only an apiserver's certificate may carry {PUBLIC_NAME}: public clients trust that name as an apiserver")]
    ReservedName,
    #[error(
        "an apiserver's certificate carries no addresses under a name-constrained CA: gRPC's TLS (the Python SDK's) refuses such a certificate; clients check {PUBLIC_NAME} (or --dns names) whatever address they dial"
    )]
    ApiserverAddress,
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> PkiError + 'a {
    move |source| PkiError::Io { what, path: path.to_path_buf(), source }
}

/// What a component is, as its certificate says.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Role {
    Apiserver,
    Iam,
    Watcher,
    Edge,
    /// The E2B gateway: a public server only. No internal method allows it ([`crate::acl`]),
    /// so its certificate, on a host of its own, opens nothing inside the cluster.
    Gateway,
}

impl Role {
    pub const ALL: [Role; 5] = [Role::Apiserver, Role::Iam, Role::Watcher, Role::Edge, Role::Gateway];
    pub const NAMES: [&'static str; 5] = ["apiserver", "iam", "watcher", "edge", "gateway"];

    pub fn as_str(self) -> &'static str {
        match self {
            Role::Apiserver => "apiserver",
            Role::Iam => "iam",
            Role::Watcher => "watcher",
            Role::Edge => "edge",
            Role::Gateway => "gateway",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        Role::ALL.into_iter().find(|r| r.as_str() == s)
    }

    /// Whether the role serves public clients (its leaf carries [`default_names`]).
    pub fn is_public(self) -> bool {
        matches!(self, Role::Apiserver | Role::Gateway)
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A component instance: `opendsec://<role>/<name>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Identity {
    pub role: Role,
    pub name: String,
}

impl Identity {
    pub fn new(role: Role, name: &str) -> Result<Identity, PkiError> {
        let ok = !name.is_empty()
            && name.len() <= 63
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if ok { Ok(Identity { role, name: name.into() }) } else { Err(PkiError::Identity(format!("{role}/{name}"))) }
    }

    /// Parses `<role>/<name>`.
    pub fn parse(s: &str) -> Result<Identity, PkiError> {
        let (role, name) = s.split_once('/').ok_or_else(|| PkiError::Identity(s.into()))?;
        Identity::new(Role::parse(role).ok_or_else(|| PkiError::Identity(s.into()))?, name)
    }

    pub fn uri(&self) -> String {
        format!("{SCHEME}{}/{}", self.role, self.name)
    }

    /// Parses `opendsec://<role>/<name>`.
    pub fn from_uri(uri: &str) -> Option<Identity> {
        Identity::parse(uri.strip_prefix(SCHEME)?).ok()
    }

    /// The identity in a certificate's URI SANs (exactly one opendsec URI), if any.
    pub fn of_cert(der: &[u8]) -> Option<Identity> {
        let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
        let san = cert.subject_alternative_name().ok()??;
        let mut found = san.value.general_names.iter().filter_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) => Identity::from_uri(u),
            _ => None,
        });
        let first = found.next()?;
        if found.next().is_some() {
            return None;
        }
        Some(first)
    }
}

impl std::fmt::Display for Identity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.role, self.name)
    }
}

/// Writes `bytes` to `path` whole: a temp file beside it (with `mode`), fsync, rename.
fn write_whole(path: &Path, bytes: &[u8], mode: u32) -> Result<(), PkiError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    crate::fsperm::parent_dir(dir).map_err(io("create", dir))?;
    let tmp = dir.join(format!(
        ".{}.tmp{:08x}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("pem"),
        rand::random::<u32>()
    ));
    let written = (|| {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).mode(mode).open(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written.map_err(io("write", path))
}

/// The file name of the trust bundle (the system's CAs and the cluster's) in a PKI directory.
pub const TRUST_BUNDLE: &str = "trust-bundle.pem";
/// Where Debian (and most Linux systems) keep the system's CA certificates.
pub const SYSTEM_CAS: &str = "/etc/ssl/certs/ca-certificates.crt";

/// Writes `out`: the CA certificates in `system` (none if it is missing) followed by those in
/// `ca`, for clients that take a single trust file (`SSL_CERT_FILE`) and must keep trusting
/// the web as well as the cluster.
pub fn write_trust_bundle(ca: &Path, system: &Path, out: &Path) -> Result<(), PkiError> {
    let mut pem = std::fs::read(system).unwrap_or_default();
    if !pem.is_empty() && !pem.ends_with(b"\n") {
        pem.push(b'\n');
    }
    pem.extend(read(ca)?.into_bytes());
    write_whole(out, &pem, 0o644)
}

fn read(path: &Path) -> Result<String, PkiError> {
    std::fs::read_to_string(path).map_err(io("read", path))
}

fn validity(params: &mut CertificateParams, lifetime: Duration) {
    let now = time::OffsetDateTime::now_utc();
    // A little slack for clocks that differ between machines.
    params.not_before = now - time::Duration::minutes(5);
    params.not_after = now + time::Duration::seconds(lifetime.as_secs().min(i64::MAX as u64) as i64);
}

/// What a CA may certify beyond the cluster's own names: DNS domains (each with its
/// subdomains) and IP networks, as the operator lists them when making it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CaScope {
    pub dns: Vec<String>,
    pub nets: Vec<(IpAddr, u8)>,
}

impl CaScope {
    /// The cluster's own names ([`CLUSTER_DOMAIN`], `localhost`, loopback) and these.
    fn with_cluster_names(&self) -> CaScope {
        let mut all = CaScope {
            dns: vec![CLUSTER_DOMAIN.into(), "localhost".into()],
            nets: vec![(IpAddr::from([127, 0, 0, 0]), 8), (IpAddr::from(std::net::Ipv6Addr::LOCALHOST), 128)],
        };
        for d in &self.dns {
            let d = d.trim_start_matches('.').to_ascii_lowercase();
            if !all.dns.contains(&d) {
                all.dns.push(d);
            }
        }
        for n in &self.nets {
            if !all.nets.contains(n) {
                all.nets.push(*n);
            }
        }
        all
    }

    /// Whether `name` lies in one of the domains.
    fn allows_dns(&self, name: &str) -> bool {
        let name = name.trim_end_matches('.').to_ascii_lowercase();
        self.dns.iter().any(|d| name == *d || name.ends_with(&format!(".{d}")))
    }

    fn allows_ip(&self, ip: IpAddr) -> bool {
        self.nets.iter().any(|(net, prefix)| in_net(ip, *net, *prefix))
    }

    fn describe(&self) -> String {
        let nets = self.nets.iter().map(|(a, p)| format!("{a}/{p}"));
        self.dns.iter().cloned().chain(nets).collect::<Vec<_>>().join(", ")
    }
}

/// Parses `addr/prefix` (or a bare address: itself alone).
pub fn parse_net(s: &str) -> Option<(IpAddr, u8)> {
    let (addr, prefix) = match s.split_once('/') {
        Some((a, p)) => (a.parse::<IpAddr>().ok()?, p.parse::<u8>().ok()?),
        None => {
            let a = s.parse::<IpAddr>().ok()?;
            (a, if a.is_ipv4() { 32 } else { 128 })
        }
    };
    let max = if addr.is_ipv4() { 32 } else { 128 };
    (prefix <= max).then_some((addr, prefix))
}

fn in_net(ip: IpAddr, net: IpAddr, prefix: u8) -> bool {
    match (ip, net) {
        (IpAddr::V4(a), IpAddr::V4(n)) => {
            let mask = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(a), IpAddr::V6(n)) => {
            let mask = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

/// Makes a CA in `dir` (`ca.pem`, `ca.key`). Refuses to replace one unless `force`. The CA is
/// name-constrained to the cluster's own names and `scope`: a leaf it signs for any other
/// DNS name or address is refused by every client that checks name constraints (rustls,
/// OpenSSL, Go, browsers).
pub fn init_ca(dir: &Path, force: bool, scope: &CaScope) -> Result<(), PkiError> {
    if dir.join(CA_KEY).exists() && !force {
        return Err(PkiError::CaExists(dir.to_path_buf()));
    }
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, "opendsec cluster CA");
    dn.push(DnType::OrganizationName, "opendsec");
    params.distinguished_name = dn;
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let scope = scope.with_cluster_names();
    let mut permitted: Vec<GeneralSubtree> = scope.dns.iter().map(|d| GeneralSubtree::DnsName(d.clone())).collect();
    permitted.extend(scope.nets.iter().map(|(a, p)| GeneralSubtree::IpAddress(CidrSubnet::from_addr_prefix(*a, *p))));
    params.name_constraints = Some(NameConstraints { permitted_subtrees: permitted, excluded_subtrees: Vec::new() });
    validity(&mut params, CA_LIFETIME);
    let cert = params.self_signed(&key)?;
    write_whole(&dir.join(CA_KEY), key.serialize_pem().as_bytes(), 0o600)?;
    write_whole(&dir.join(CA_CERT), cert.pem().as_bytes(), 0o644)
}

/// The names a CA certificate's name constraints permit (`None`: it has none, so it may
/// certify anything: a CA made before constraints, or the operator's own).
fn ca_scope(der: &[u8]) -> Option<CaScope> {
    use x509_parser::extensions::{GeneralName, ParsedExtension};
    let (_, cert) = x509_parser::parse_x509_certificate(der).ok()?;
    let nc = cert.extensions().iter().find_map(|e| match e.parsed_extension() {
        ParsedExtension::NameConstraints(nc) => Some(nc),
        _ => None,
    })?;
    let mut scope = CaScope::default();
    for sub in nc.permitted_subtrees.iter().flatten() {
        match &sub.base {
            GeneralName::DNSName(d) => scope.dns.push(d.to_ascii_lowercase()),
            GeneralName::IPAddress(b) => match b.len() {
                8 => {
                    let (a, m) = (<[u8; 4]>::try_from(&b[..4]).ok()?, <[u8; 4]>::try_from(&b[4..]).ok()?);
                    scope.nets.push((IpAddr::from(a), u32::from_be_bytes(m).count_ones() as u8));
                }
                32 => {
                    let (a, m) = (<[u8; 16]>::try_from(&b[..16]).ok()?, <[u8; 16]>::try_from(&b[16..]).ok()?);
                    scope.nets.push((IpAddr::from(a), u128::from_be_bytes(m).count_ones() as u8));
                }
                _ => {}
            },
            _ => {}
        }
    }
    Some(scope)
}

/// What a leaf certifies besides its identity.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Names {
    pub dns: Vec<String>,
    pub ips: Vec<IpAddr>,
}

/// The names of the sandbox hosts under a gateway's default domain (E2B's `get_host`).
pub const GATEWAY_SANDBOX_HOSTS: &str = "*.sandbox.localhost";

/// The names a leaf of `role` carries besides `extra`: an apiserver's [`PUBLIC_NAME`] and
/// `localhost`; a gateway's `localhost`, [`GATEWAY_SANDBOX_HOSTS`] and the loopback addresses
/// (E2B's SDKs dial it by address). An apiserver's carries no address: its clients check [`PUBLIC_NAME`] whatever
/// address they dial, and gRPC's TLS in the Python SDK (BoringSSL) refuses a leaf with an
/// address under a CA with name constraints ("unsupported name constraint type").
pub fn default_names(role: Role, extra: &Names) -> Names {
    let mut n = Names::default();
    if role == Role::Apiserver {
        n.dns.push(PUBLIC_NAME.into());
    }
    if role.is_public() {
        n.dns.push("localhost".into());
    }
    if role == Role::Gateway {
        n.ips = vec![IpAddr::from([127, 0, 0, 1]), IpAddr::from(std::net::Ipv6Addr::LOCALHOST)];
        // Sandbox hosts under the gateway's default domain (`<port>-<id>.sandbox.localhost`).
        n.dns.push(GATEWAY_SANDBOX_HOSTS.into());
    }
    for d in &extra.dns {
        if !n.dns.contains(d) {
            n.dns.push(d.clone());
        }
    }
    for i in &extra.ips {
        if !n.ips.contains(i) {
            n.ips.push(*i);
        }
    }
    n
}

/// Refuses names `id` may not carry: [`PUBLIC_NAME`] on anything but an apiserver, and names
/// outside a name-constrained CA's scope (a leaf with them would be refused by clients).
fn check_names(ca_der: &[u8], id: &Identity, names: &Names) -> Result<(), PkiError> {
    if id.role != Role::Apiserver && names.dns.iter().any(|d| d.trim_end_matches('.').eq_ignore_ascii_case(PUBLIC_NAME))
    {
        return Err(PkiError::ReservedName);
    }
    let Some(scope) = ca_scope(ca_der) else { return Ok(()) };
    if id.role == Role::Apiserver && !names.ips.is_empty() {
        return Err(PkiError::ApiserverAddress);
    }
    let outside = |name: String| PkiError::OutsideCa { name, allowed: scope.describe() };
    if let Some(d) = names.dns.iter().find(|d| !scope.allows_dns(d)) {
        return Err(outside(d.clone()));
    }
    if let Some(i) = names.ips.iter().find(|i| !scope.allows_ip(**i)) {
        return Err(outside(i.to_string()));
    }
    Ok(())
}

/// Issues a leaf for `id` signed by the CA in `ca_dir`, written as the bundle `out`.
pub fn issue(ca_dir: &Path, out: &Path, id: &Identity, names: &Names, lifetime: Duration) -> Result<(), PkiError> {
    let ca_key_path = ca_dir.join(CA_KEY);
    let ca_key = KeyPair::from_pem(&read(&ca_key_path)?)
        .map_err(|e| PkiError::Bad { path: ca_key_path.clone(), message: e.to_string() })?;
    let ca_cert_path = ca_dir.join(CA_CERT);
    let ca_pem = read(&ca_cert_path)?;
    let ca_der = first_cert(&ca_pem)
        .ok_or_else(|| PkiError::Bad { path: ca_cert_path.clone(), message: "no certificate in the file".into() })?;
    check_names(&ca_der, id, names)?;
    let issuer = Issuer::from_ca_cert_pem(&ca_pem, ca_key)
        .map_err(|e| PkiError::Bad { path: ca_cert_path, message: e.to_string() })?;
    let key = KeyPair::generate()?;
    let mut params = CertificateParams::default();
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, id.to_string());
    params.distinguished_name = dn;
    let uri = id.uri().try_into().map_err(|_| PkiError::Identity(id.to_string()))?;
    params.subject_alt_names = vec![SanType::URI(uri)];
    for d in &names.dns {
        params.subject_alt_names.push(SanType::DnsName(
            d.clone().try_into().map_err(|e: rcgen::Error| PkiError::Bad {
                path: out.into(),
                message: format!("dns name {d:?}: {e}"),
            })?,
        ));
    }
    params.subject_alt_names.extend(names.ips.iter().map(|i| SanType::IpAddress(*i)));
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    params.use_authority_key_identifier_extension = true;
    validity(&mut params, lifetime);
    let cert = params.signed_by(&key, &issuer)?;
    let bundle = format!("{}{}", cert.pem(), key.serialize_pem());
    write_whole(out, bundle.as_bytes(), 0o600)
}

/// What a bundle's certificate says (for `pki rotate` and for humans).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeafInfo {
    pub identity: Identity,
    pub names: Names,
    pub not_after_s: i64,
    pub lifetime: Duration,
}

/// Reads the identity, names and validity of the certificate in bundle `path`.
pub fn inspect(path: &Path) -> Result<LeafInfo, PkiError> {
    let bad = |message: String| PkiError::Bad { path: path.to_path_buf(), message };
    let text = read(path)?;
    let der = first_cert(&text).ok_or_else(|| bad("no certificate in the file".into()))?;
    let (_, cert) = x509_parser::parse_x509_certificate(&der).map_err(|e| bad(e.to_string()))?;
    let identity = Identity::of_cert(&der).ok_or_else(|| bad("no opendsec:// identity in the certificate".into()))?;
    let mut names = Names::default();
    if let Ok(Some(san)) = cert.subject_alternative_name() {
        for n in &san.value.general_names {
            match n {
                x509_parser::extensions::GeneralName::DNSName(d) => names.dns.push((*d).to_string()),
                x509_parser::extensions::GeneralName::IPAddress(b) => {
                    if let Ok(a) = <[u8; 4]>::try_from(*b) {
                        names.ips.push(IpAddr::from(a));
                    } else if let Ok(a) = <[u8; 16]>::try_from(*b) {
                        names.ips.push(IpAddr::from(a));
                    }
                }
                _ => {}
            }
        }
    }
    let v = cert.validity();
    let (nb, na) = (v.not_before.timestamp(), v.not_after.timestamp());
    Ok(LeafInfo { identity, names, not_after_s: na, lifetime: Duration::from_secs((na - nb).max(0) as u64) })
}

/// Issues bundle `path` again with a fresh key: the same identity, names and lifetime (minus
/// the clock slack [`issue`] adds).
pub fn rotate(ca_dir: &Path, path: &Path) -> Result<LeafInfo, PkiError> {
    let info = inspect(path)?;
    let lifetime = info.lifetime.saturating_sub(Duration::from_secs(300)).max(Duration::from_secs(60));
    issue(ca_dir, path, &info.identity, &info.names, lifetime)?;
    inspect(path)
}

/// The DER of the first certificate in PEM `text`.
pub fn first_cert(text: &str) -> Option<Vec<u8>> {
    use rustls_pki_types::pem::PemObject;
    rustls_pki_types::CertificateDer::pem_slice_iter(text.as_bytes()).next()?.ok().map(|c| c.to_vec())
}

/// The bundle file of `id` in a PKI directory laid out as `cluster up` lays it out:
/// `<dir>/<role>-<name>.pem`.
pub fn bundle_path(dir: &Path, id: &Identity) -> PathBuf {
    dir.join(format!("{}-{}.pem", id.role, id.name))
}

/// A PKI for one in-process cluster or a test: a CA in `dir` (made if missing, constrained to
/// the cluster's own names) and a bundle for each identity (issued afresh, with
/// [`default_names`]).
pub fn local_pki(dir: &Path, ids: &[Identity], lifetime: Duration) -> Result<(), PkiError> {
    if !dir.join(CA_KEY).exists() || !dir.join(CA_CERT).exists() {
        init_ca(dir, true, &CaScope::default())?;
    }
    for id in ids {
        issue(dir, &bundle_path(dir, id), id, &default_names(id.role, &Names::default()), lifetime)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identities_parse_and_refuse_junk() {
        let id = Identity::parse("edge/node-1").unwrap();
        assert_eq!((id.role, id.name.as_str()), (Role::Edge, "node-1"));
        assert_eq!(id.uri(), "opendsec://edge/node-1");
        assert_eq!(Identity::from_uri("opendsec://edge/node-1"), Some(id));
        for bad in ["", "edge", "edge/", "king/x", "edge/Node", "edge/a/b", "edge/a.b", "apiserver/../x"] {
            assert!(Identity::parse(bad).is_err(), "{bad}");
        }
        assert_eq!(Identity::from_uri("https://edge/x"), None);
    }

    #[test]
    fn a_ca_issues_leaves_that_carry_their_identity_and_rotate() {
        use std::os::unix::fs::PermissionsExt;
        let t = tempfile::tempdir().unwrap();
        init_ca(t.path(), false, &CaScope { dns: vec!["example.com".into()], nets: vec![] }).unwrap();
        assert!(matches!(init_ca(t.path(), false, &CaScope::default()), Err(PkiError::CaExists(_))));
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&t.path().join(CA_KEY)), 0o600);
        let id = Identity::new(Role::Apiserver, "api-1").unwrap();
        let out = t.path().join("api.pem");
        let names = default_names(Role::Apiserver, &Names { dns: vec!["api.example.com".into()], ips: vec![] });
        issue(t.path(), &out, &id, &names, Duration::from_secs(3600)).unwrap();
        assert_eq!(mode(&out), 0o600);
        let info = inspect(&out).unwrap();
        assert_eq!(info.identity, id);
        assert!(
            info.names.dns.contains(&PUBLIC_NAME.to_string()) && info.names.dns.contains(&"api.example.com".into())
        );
        assert!(info.names.dns.contains(&"localhost".to_string()) && info.names.ips.is_empty());
        // The hour asked for, plus the five minutes it starts early (clock slack).
        assert!((3890..=3910).contains(&info.lifetime.as_secs()), "{:?}", info.lifetime);
        let before = std::fs::read(&out).unwrap();
        let again = rotate(t.path(), &out).unwrap();
        assert_eq!((again.identity, again.names), (info.identity, info.names));
        assert_ne!(std::fs::read(&out).unwrap(), before, "a new key and certificate");
        // A bundle holds the certificate and its key.
        let text = std::fs::read_to_string(&out).unwrap();
        assert!(text.contains("BEGIN CERTIFICATE") && text.contains("PRIVATE KEY"));
    }

    #[test]
    fn only_an_apiserver_carries_the_public_name_and_names_stay_in_the_ca_scope() {
        let t = tempfile::tempdir().unwrap();
        let scope = CaScope { dns: vec!["corp.example".into()], nets: vec![parse_net("10.1.0.0/16").unwrap()] };
        init_ca(t.path(), false, &scope).unwrap();
        let issue_as = |role: Role, names: Names| {
            let id = Identity::new(role, "x").unwrap();
            issue(t.path(), &t.path().join("x.pem"), &id, &names, Duration::from_secs(60))
        };
        // Defaults: the gateway gets loopback names, never the apiserver's.
        let gw = default_names(Role::Gateway, &Names::default());
        assert!(!gw.dns.contains(&PUBLIC_NAME.to_string()) && gw.dns.contains(&"localhost".to_string()));
        assert!(default_names(Role::Edge, &Names::default()).dns.is_empty());
        issue_as(Role::Gateway, gw).unwrap();
        // Asked for, the public name is refused to every role but the apiserver.
        for role in [Role::Gateway, Role::Edge, Role::Iam, Role::Watcher] {
            let names = Names { dns: vec!["API.opendsec.internal".into()], ips: vec![] };
            assert!(matches!(issue_as(role, names), Err(PkiError::ReservedName)), "{role}");
        }
        // Inside the scope: the cluster's domain, the listed one and its subdomains, the listed network.
        let ok = Names {
            dns: vec!["e2b.corp.example".into(), "corp.example".into()],
            ips: vec!["10.1.2.3".parse().unwrap()],
        };
        issue_as(Role::Gateway, ok).unwrap();
        issue_as(Role::Apiserver, default_names(Role::Apiserver, &Names::default())).unwrap();
        // An apiserver's certificate carries names only (gRPC's BoringSSL refuses an address
        // under a constrained CA).
        assert!(default_names(Role::Apiserver, &Names::default()).ips.is_empty());
        let addr = Names { dns: vec![], ips: vec!["10.1.2.3".parse().unwrap()] };
        assert!(matches!(issue_as(Role::Apiserver, addr), Err(PkiError::ApiserverAddress)));
        // Outside: refused before anything is signed.
        for names in [
            Names { dns: vec!["example.com".into()], ips: vec![] },
            Names { dns: vec!["evilcorp.example".into()], ips: vec![] },
            Names { dns: vec![], ips: vec!["10.2.0.1".parse().unwrap()] },
        ] {
            assert!(matches!(issue_as(Role::Gateway, names), Err(PkiError::OutsideCa { .. })));
        }
        // The constraints are in the CA certificate itself.
        let der = first_cert(&std::fs::read_to_string(t.path().join(CA_CERT)).unwrap()).unwrap();
        let got = ca_scope(&der).unwrap();
        assert!(got.dns.contains(&"corp.example".to_string()) && got.dns.contains(&CLUSTER_DOMAIN.to_string()));
        assert!(
            got.nets.contains(&(IpAddr::from([10, 1, 0, 0]), 16))
                && got.nets.contains(&(IpAddr::from([127, 0, 0, 0]), 8))
        );
    }

    #[test]
    fn networks_parse_and_contain() {
        assert_eq!(parse_net("10.0.0.0/8"), Some((IpAddr::from([10, 0, 0, 0]), 8)));
        assert_eq!(parse_net("192.0.2.7"), Some((IpAddr::from([192, 0, 2, 7]), 32)));
        assert_eq!(parse_net("10.0.0.0/33"), None);
        assert_eq!(parse_net("nope"), None);
        assert!(in_net("10.9.8.7".parse().unwrap(), IpAddr::from([10, 0, 0, 0]), 8));
        assert!(!in_net("11.0.0.1".parse().unwrap(), IpAddr::from([10, 0, 0, 0]), 8));
        assert!(in_net("::1".parse().unwrap(), "::1".parse().unwrap(), 128));
        assert!(in_net("1.2.3.4".parse().unwrap(), IpAddr::from([0, 0, 0, 0]), 0));
    }
}
