//! TLS on every link: mTLS between components (each side proves an `opendsec://<role>/<name>`
//! identity signed by the cluster CA, [`crate::pki`]) and TLS with a server certificate on the
//! public port. rustls with the aws-lc-rs provider; the acceptor and the connector are ours
//! (tokio-rustls under tonic), so that:
//! - certificates reload when their files change, without a restart: a [`Credentials`] looks
//!   at its files' modification times at most once a second, on use, and keeps the old
//!   material (with a warning) if a new file does not load;
//! - a client checks the identity of the server it meant to reach (the role, and for an edge
//!   its name) rather than a DNS name: internal leaves need no DNS names, and an edge cannot
//!   answer for another;
//! - handshakes run off the accept loop with a deadline, and the number of open connections
//!   is bounded, so slow or piling clients cannot stall or exhaust a server.
//!
//! What the server learns of its caller is the certificate tonic exposes
//! (`TlsConnectInfo::peer_certs`), turned into an [`Identity`] by [`crate::acl`].
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, DigitallySignedStruct, DistinguishedName, RootCertStore, ServerConfig, SignatureScheme};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use tokio::net::{TcpListener, TcpStream};

use crate::pki::{Identity, Role};

/// How often a [`Credentials`] looks at its files.
const RELOAD_CHECK: Duration = Duration::from_secs(1);
/// A TLS handshake must complete within this, and so must a connection's opening bytes after
/// it.
pub const HANDSHAKE_TIMEOUT: Duration = crate::conn::OPENING_TIMEOUT;
/// What an HTTP/2 client sends first: the 24-byte preface and its SETTINGS frame's 9-byte
/// header.
pub const HTTP2_OPENING: usize = 24 + 9;
/// The shortest opening of an HTTP/1.1 request: `GET / HTTP/1.1\r\n`.
pub const HTTP1_OPENING: usize = 16;
/// The suffix of the server names that encode an expected identity ([`expect`]).
const EXPECT_SUFFIX: &str = "opendsec";

/// Errors of loading TLS material.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("read {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Bad { path: PathBuf, message: String },
    #[error("tls: {0}")]
    Rustls(#[from] rustls::Error),
}

/// The files one component's TLS uses: the CA bundle it trusts and its own certificate +
/// key bundle.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    pub bundle: PathBuf,
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn bad(path: &Path, message: impl std::fmt::Display) -> TlsError {
    TlsError::Bad { path: path.to_path_buf(), message: message.to_string() }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read { path: path.to_path_buf(), source })
}

/// The CA certificates in PEM file `path`, as trust roots.
pub fn load_roots(path: &Path) -> Result<RootCertStore, TlsError> {
    let pem = read(path)?;
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(&pem) {
        roots.add(c.map_err(|e| bad(path, e))?).map_err(|e| bad(path, e))?;
    }
    if roots.is_empty() {
        return Err(bad(path, "no certificate in the file"));
    }
    Ok(roots)
}

/// What is loaded from the files at one time.
struct Loaded {
    stamps: (Option<SystemTime>, Option<SystemTime>),
    key: Arc<CertifiedKey>,
    identity: Option<Identity>,
    roots: Arc<RootCertStore>,
    client_verifier: Arc<dyn ClientCertVerifier>,
}

fn mtime(p: &Path) -> Option<SystemTime> {
    std::fs::metadata(p).and_then(|m| m.modified()).ok()
}

fn load(files: &TlsFiles, provider: &Arc<CryptoProvider>) -> Result<Loaded, TlsError> {
    let stamps = (mtime(&files.ca), mtime(&files.bundle));
    let roots = Arc::new(load_roots(&files.ca)?);
    let pem = read(&files.bundle)?;
    let chain: Vec<CertificateDer<'static>> =
        CertificateDer::pem_slice_iter(&pem).collect::<Result<_, _>>().map_err(|e| bad(&files.bundle, e))?;
    if chain.is_empty() {
        return Err(bad(&files.bundle, "no certificate in the bundle"));
    }
    let der = PrivateKeyDer::from_pem_slice(&pem).map_err(|e| bad(&files.bundle, format!("private key: {e}")))?;
    let signing = provider.key_provider.load_private_key(der)?;
    let identity = Identity::of_cert(&chain[0]);
    let key = Arc::new(CertifiedKey::new(chain, signing));
    key.keys_match().map_err(|e| bad(&files.bundle, format!("the key does not match the certificate: {e}")))?;
    let client_verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
        .build()
        .map_err(|e| bad(&files.ca, e))?;
    Ok(Loaded { stamps, key, identity, roots, client_verifier })
}

/// One component's certificate, key and trusted CAs, reloaded when their files change.
pub struct Credentials {
    files: TlsFiles,
    provider: Arc<CryptoProvider>,
    state: Mutex<(Instant, Arc<Loaded>)>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials").field("files", &self.files).finish_non_exhaustive()
    }
}

impl Credentials {
    /// Loads `files`; fails when they do not hold a usable certificate, key and CA.
    pub fn load(files: TlsFiles) -> Result<Arc<Credentials>, TlsError> {
        let provider = provider();
        let loaded = load(&files, &provider)?;
        Ok(Arc::new(Credentials { files, provider, state: Mutex::new((Instant::now(), Arc::new(loaded))) }))
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// The credentials of `id` in a PKI directory laid out by [`crate::pki::local_pki`]
    /// (`ca.pem`, `<role>-<name>.pem`).
    pub fn in_dir(dir: &Path, id: &Identity) -> Result<Arc<Credentials>, TlsError> {
        Credentials::load(TlsFiles { ca: dir.join(crate::pki::CA_CERT), bundle: crate::pki::bundle_path(dir, id) })
    }

    /// For tests and benchmarks: a CA in `dir` (made if missing), a fresh bundle for `id` and
    /// its credentials.
    pub fn issue_local(dir: &Path, id: &Identity) -> Result<Arc<Credentials>, TlsError> {
        crate::pki::local_pki(dir, std::slice::from_ref(id), crate::pki::LEAF_LIFETIME).map_err(|e| bad(dir, e))?;
        Credentials::in_dir(dir, id)
    }

    /// The material in force: reloaded first when a file changed (looked at once a second).
    fn current(&self) -> Arc<Loaded> {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.0.elapsed() >= RELOAD_CHECK {
            st.0 = Instant::now();
            let stamps = (mtime(&self.files.ca), mtime(&self.files.bundle));
            if stamps != st.1.stamps {
                match load(&self.files, &self.provider) {
                    Ok(l) => {
                        tracing::info!(bundle = %self.files.bundle.display(), "reloaded TLS certificates");
                        st.1 = Arc::new(l);
                    }
                    Err(e) => tracing::warn!(error = %e, "new TLS files do not load; keeping the current ones"),
                }
            }
        }
        st.1.clone()
    }

    /// The identity in this component's own certificate.
    pub fn identity(&self) -> Option<Identity> {
        self.current().identity.clone()
    }

    /// A server config for gRPC (HTTP/2): mutual TLS (the client must present a certificate
    /// the CA signed, with an opendsec identity) when `mtls`, else a server certificate only
    /// with the client's certificate optional (the public port: callers authenticate with
    /// tokens; a certificate, when one is presented, must be the CA's and name an identity,
    /// which is how the apiserver knows the E2B gateway).
    pub fn server_config(self: &Arc<Self>, mtls: bool) -> Arc<ServerConfig> {
        self.server_config_for(Some(mtls), b"h2")
    }

    /// A server config for HTTP/1.1 (the E2B gateway): a server certificate only.
    pub fn https_server_config(self: &Arc<Self>) -> Arc<ServerConfig> {
        self.server_config_for(None, b"http/1.1")
    }

    /// `client_certs`: None, none asked for; Some(true), required; Some(false), optional.
    fn server_config_for(self: &Arc<Self>, client_certs: Option<bool>, alpn: &[u8]) -> Arc<ServerConfig> {
        let builder = ServerConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .expect("the aws-lc-rs provider supports the default protocol versions");
        let builder = match client_certs {
            Some(mandatory) => {
                builder.with_client_cert_verifier(Arc::new(ReloadingClientVerifier { creds: self.clone(), mandatory }))
            }
            None => builder.with_no_client_auth(),
        };
        let mut cfg = builder.with_cert_resolver(Arc::new(Resolver(self.clone())));
        cfg.alpn_protocols = vec![alpn.to_vec()];
        Arc::new(cfg)
    }

    /// A client config for internal links: presents this component's certificate and checks
    /// that the server's was signed by the CA and names the identity [`expect`] encoded in the
    /// server name.
    pub fn client_config(self: &Arc<Self>) -> Arc<ClientConfig> {
        let mut cfg = ClientConfig::builder_with_provider(self.provider.clone())
            .with_safe_default_protocol_versions()
            .expect("the aws-lc-rs provider supports the default protocol versions")
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(IdentityVerifier(self.clone())))
            .with_client_cert_resolver(Arc::new(Resolver(self.clone())));
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Arc::new(cfg)
    }
}

/// A client config for the public API: the server's certificate must chain to the CAs in
/// `ca_pem`, carry the server name the client asks for ([`crate::pki::PUBLIC_NAME`] by
/// default) and name an apiserver in its URI SAN (`opendsec://apiserver/<name>`): a gateway's
/// certificate, which may carry the same addresses, never receives a client's token. No
/// client certificate (callers authenticate with bearer tokens).
pub fn public_client_config(ca_pem: &[u8]) -> Result<Arc<ClientConfig>, TlsError> {
    public_client_config_as(ca_pem, None)
}

/// [`public_client_config`], presenting `creds`' certificate: the E2B gateway's, so that the
/// apiserver believes the caller address it passes on (`crate::grpc::CLIENT_ADDR_HEADER`).
pub fn public_client_config_as(ca_pem: &[u8], creds: Option<&Arc<Credentials>>) -> Result<Arc<ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(ca_pem) {
        roots.add(c.map_err(|e| bad(Path::new("the CA"), e))?).map_err(|e| bad(Path::new("the CA"), e))?;
    }
    if roots.is_empty() {
        return Err(bad(Path::new("the CA"), "no certificate in it"));
    }
    let provider = provider();
    let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
        .build()
        .map_err(|e| bad(Path::new("the CA"), e))?;
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(ApiserverVerifier(webpki)));
    let mut cfg = match creds {
        Some(c) => builder.with_client_cert_resolver(Arc::new(Resolver(c.clone()))),
        None => builder.with_no_client_auth(),
    };
    cfg.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(cfg))
}

/// The usual web PKI checks (chain, validity, the server name asked for), and then the role:
/// the certificate's identity must be an apiserver's.
#[derive(Debug)]
struct ApiserverVerifier(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for ApiserverVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let ok = self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp, now)?;
        match Identity::of_cert(end_entity) {
            Some(id) if id.role == Role::Apiserver => Ok(ok),
            Some(id) => Err(rustls::Error::General(format!("the server is {id}, not an apiserver"))),
            None => Err(rustls::Error::General("the server certificate names no opendsec apiserver".into())),
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// The server name under which a client asks for identity `role` (any name) or `role/name`.
/// Internal certificates carry no DNS names; [`IdentityVerifier`] reads this back.
pub fn expect(role: Role, name: Option<&str>) -> ServerName<'static> {
    let s = match name {
        Some(n) => format!("{n}.{role}.{EXPECT_SUFFIX}"),
        None => format!("{role}.{EXPECT_SUFFIX}"),
    };
    // Names and roles are [a-z0-9-]: always a valid DNS name; a bad one expects nothing.
    ServerName::try_from(s).unwrap_or_else(|_| ServerName::try_from("invalid.invalid").expect("a valid DNS name"))
}

/// The identity a server name from [`expect`] asks for: (role, name if any).
fn expected(server_name: &ServerName<'_>) -> Option<(Role, Option<String>)> {
    let ServerName::DnsName(d) = server_name else { return None };
    let rest = d.as_ref().strip_suffix(EXPECT_SUFFIX)?.strip_suffix('.')?;
    match rest.rsplit_once('.') {
        Some((name, role)) => Some((Role::parse(role)?, Some(name.to_string()))),
        None => Some((Role::parse(rest)?, None)),
    }
}

#[derive(Debug)]
struct Resolver(Arc<Credentials>);

impl ResolvesServerCert for Resolver {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current().key.clone())
    }
}

impl rustls::client::ResolvesClientCert for Resolver {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(self.0.current().key.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// The CA's client verifier as last loaded, and an opendsec identity in the certificate;
/// a client may present none unless `mandatory`.
#[derive(Debug)]
struct ReloadingClientVerifier {
    creds: Arc<Credentials>,
    mandatory: bool,
}

impl ClientCertVerifier for ReloadingClientVerifier {
    fn client_auth_mandatory(&self) -> bool {
        self.mandatory
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        // The hints are only advice to the client; ours present their one certificate anyway.
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let v = self.creds.current().client_verifier.clone();
        let ok = v.verify_client_cert(end_entity, intermediates, now)?;
        if Identity::of_cert(end_entity).is_none() {
            return Err(rustls::Error::General("the client certificate names no opendsec identity".into()));
        }
        Ok(ok)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.creds.current().client_verifier.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.creds.current().client_verifier.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.creds.current().client_verifier.supported_verify_schemes()
    }
}

/// Checks a server's certificate chain against the CA and its identity against the one the
/// client asked for ([`expect`]).
#[derive(Debug)]
struct IdentityVerifier(Arc<Credentials>);

impl ServerCertVerifier for IdentityVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let cur = self.0.current();
        let parsed = rustls::server::ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &cur.roots,
            intermediates,
            now,
            self.0.provider.signature_verification_algorithms.all,
        )?;
        let (role, name) = expected(server_name)
            .ok_or_else(|| rustls::Error::General(format!("no expected identity in {server_name:?}")))?;
        let got = Identity::of_cert(end_entity)
            .ok_or_else(|| rustls::Error::General("the server certificate names no opendsec identity".into()))?;
        if got.role != role || name.as_ref().is_some_and(|n| *n != got.name) {
            let want = match &name {
                Some(n) => format!("{role}/{n}"),
                None => format!("a {role}"),
            };
            return Err(rustls::Error::General(format!("the server is {got}, not {want}")));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.provider.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.provider.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.provider.signature_verification_algorithms.supported_schemes()
    }
}

/// Connects to `addr` and runs the TLS handshake for `server_name` (blocking the caller only;
/// bounded by [`HANDSHAKE_TIMEOUT`]).
pub async fn connect(
    addr: &str,
    cfg: Arc<ClientConfig>,
    server_name: ServerName<'static>,
) -> std::io::Result<tokio_rustls::client::TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    tcp.set_nodelay(true)?;
    let tls = tokio_rustls::TlsConnector::from(cfg);
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, tls.connect(server_name, tcp)).await {
        Ok(r) => r,
        Err(_) => {
            Err(std::io::Error::new(std::io::ErrorKind::TimedOut, format!("TLS handshake with {addr} timed out")))
        }
    }
}

/// Accepted, handshaken connections of `listener`: each handshake runs in its own task with
/// a deadline (a client that never finishes one holds no accept slot), bounded as
/// [`crate::conn::incoming`] bounds connections: at most `max_conns` open at once, at most
/// `per_source` from one source (0: no such cap), the first `opening` bytes
/// ([`HTTP2_OPENING`], [`HTTP1_OPENING`]) within [`HANDSHAKE_TIMEOUT`] of the handshake.
pub fn incoming(
    listener: TcpListener,
    cfg: Arc<ServerConfig>,
    max_conns: usize,
    per_source: usize,
    opening: usize,
) -> tokio_stream::wrappers::ReceiverStream<
    std::io::Result<crate::conn::Conn<tokio_rustls::server::TlsStream<TcpStream>>>,
> {
    let acceptor = tokio_rustls::TlsAcceptor::from(cfg);
    crate::conn::incoming(listener, max_conns, per_source, opening, move |tcp| {
        let acceptor = acceptor.clone();
        async move {
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(r) => r,
                Err(_) => Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "TLS handshake timed out")),
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ipv6_sources_count_by_their_64() {
        let of = |s: &str| crate::conn::Sources::source_of(s.parse().unwrap()).to_string();
        assert_eq!(of("2001:db8:1:2:aaaa::1"), of("2001:db8:1:2:bbbb::2"));
        assert_eq!(of("2001:db8:1:2::1"), "2001:db8:1:2::");
        assert_ne!(of("2001:db8:1:3::1"), of("2001:db8:1:2::1"));
        assert_eq!(of("192.0.2.7"), "192.0.2.7");
        assert_eq!(of("::ffff:192.0.2.7"), "192.0.2.7");
    }

    #[test]
    fn expected_identities_round_trip_through_server_names() {
        assert_eq!(expected(&expect(Role::Edge, Some("edge-001"))), Some((Role::Edge, Some("edge-001".into()))));
        assert_eq!(expected(&expect(Role::Iam, None)), Some((Role::Iam, None)));
        assert_eq!(expected(&ServerName::try_from("api.opendsec.internal").unwrap()), None);
        assert_eq!(expected(&ServerName::try_from("x.king.opendsec").unwrap()), None);
    }
}
