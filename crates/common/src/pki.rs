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
//! addresses asked for), which public clients verify.
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose, SanType,
};

/// The DNS name public clients check on an apiserver's certificate (whatever address they
/// dial), so one certificate serves every address of an apiserver.
pub const PUBLIC_NAME: &str = "api.opendsec.internal";
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

    /// Whether the role serves public clients (its leaf carries [`public_names`]).
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

/// Makes a CA in `dir` (`ca.pem`, `ca.key`). Refuses to replace one unless `force`.
pub fn init_ca(dir: &Path, force: bool) -> Result<(), PkiError> {
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
    validity(&mut params, CA_LIFETIME);
    let cert = params.self_signed(&key)?;
    write_whole(&dir.join(CA_KEY), key.serialize_pem().as_bytes(), 0o600)?;
    write_whole(&dir.join(CA_CERT), cert.pem().as_bytes(), 0o644)
}

/// What a leaf certifies besides its identity.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Names {
    pub dns: Vec<String>,
    pub ips: Vec<IpAddr>,
}

/// The names an apiserver's leaf carries: [`PUBLIC_NAME`], `localhost`, the loopback
/// addresses, and `extra`.
pub fn public_names(extra: &Names) -> Names {
    let mut n = Names {
        dns: vec![PUBLIC_NAME.into(), "localhost".into()],
        ips: vec![IpAddr::from([127, 0, 0, 1]), IpAddr::from(std::net::Ipv6Addr::LOCALHOST)],
    };
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

/// Issues a leaf for `id` signed by the CA in `ca_dir`, written as the bundle `out`.
pub fn issue(ca_dir: &Path, out: &Path, id: &Identity, names: &Names, lifetime: Duration) -> Result<(), PkiError> {
    let ca_key_path = ca_dir.join(CA_KEY);
    let ca_key = KeyPair::from_pem(&read(&ca_key_path)?)
        .map_err(|e| PkiError::Bad { path: ca_key_path.clone(), message: e.to_string() })?;
    let ca_cert_path = ca_dir.join(CA_CERT);
    let issuer = Issuer::from_ca_cert_pem(&read(&ca_cert_path)?, ca_key)
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

/// A PKI for one in-process cluster or a test: a CA in `dir` (made if missing) and a bundle
/// for each identity (issued afresh). The public servers' bundles carry [`public_names`].
pub fn local_pki(dir: &Path, ids: &[Identity], lifetime: Duration) -> Result<(), PkiError> {
    if !dir.join(CA_KEY).exists() || !dir.join(CA_CERT).exists() {
        init_ca(dir, true)?;
    }
    for id in ids {
        let names = if id.role.is_public() { public_names(&Names::default()) } else { Names::default() };
        issue(dir, &bundle_path(dir, id), id, &names, lifetime)?;
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
        init_ca(t.path(), false).unwrap();
        assert!(matches!(init_ca(t.path(), false), Err(PkiError::CaExists(_))));
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&t.path().join(CA_KEY)), 0o600);
        let id = Identity::new(Role::Apiserver, "api-1").unwrap();
        let out = t.path().join("api.pem");
        let names = public_names(&Names { dns: vec!["api.example.com".into()], ips: vec![] });
        issue(t.path(), &out, &id, &names, Duration::from_secs(3600)).unwrap();
        assert_eq!(mode(&out), 0o600);
        let info = inspect(&out).unwrap();
        assert_eq!(info.identity, id);
        assert!(
            info.names.dns.contains(&PUBLIC_NAME.to_string()) && info.names.dns.contains(&"api.example.com".into())
        );
        assert!(info.names.ips.contains(&IpAddr::from([127, 0, 0, 1])));
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
}
