//! Which component may call which internal method: one table ([`TABLE`]), checked by one
//! tower layer ([`AclLayer`]) in front of every internal server, before the request is
//! decoded. The caller's role is the one in its client certificate (mTLS, [`crate::tls`]);
//! the layer hands the identity to the handlers as a [`Peer`] request extension, for the
//! checks that depend on the name too (an edge registers and releases leases only as itself).
//!
//! Anything not in the table is refused: a method added to a proto without a row here cannot
//! be called by anyone.
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls_pki_types::CertificateDer;
use tonic::transport::server::{TcpConnectInfo, TlsConnectInfo};

use crate::pki::{Identity, Role};
use crate::reason::{ApiError, Reason};

use Role::{Apiserver, Edge, Iam, Watcher};

/// `(gRPC path or service prefix ending in '/', roles allowed)`. Exact paths first, then
/// prefixes.
pub const TABLE: &[(&str, &[Role])] = &[
    // IAM's internal API.
    ("/opendsec.v1.Iam/Authenticate", &[Apiserver]),
    ("/opendsec.v1.Iam/Authorize", &[Apiserver]),
    ("/opendsec.v1.Iam/Admit", &[Apiserver]),
    ("/opendsec.v1.Iam/AdmitMany", &[Apiserver]),
    ("/opendsec.v1.Iam/CheckEgress", &[Apiserver]),
    ("/opendsec.v1.Iam/GetEpoch", &[Apiserver]),
    ("/opendsec.v1.Iam/MintSandboxTokens", &[Apiserver]),
    ("/opendsec.v1.Iam/ChargeImage", &[Apiserver]),
    ("/opendsec.v1.Iam/UnchargeImage", &[Apiserver]),
    ("/opendsec.v1.Iam/StoreRoom", &[Apiserver]),
    // Edges charge pool members on themselves only (checked by the handler).
    ("/opendsec.v1.Iam/AdmitMember", &[Edge]),
    // Edges release only leases bound to themselves (checked by the handler with `Peer`).
    ("/opendsec.v1.Iam/ReleaseLeases", &[Apiserver, Edge]),
    ("/opendsec.v1.Iam/GetLease", &[Apiserver]),
    // Edges learn only where leases are bound (the handler strips the rest for them).
    ("/opendsec.v1.Iam/GetLeases", &[Apiserver, Edge]),
    ("/opendsec.v1.Iam/Reconcile", &[Watcher]),
    ("/opendsec.v1.Iam/SweepUnbound", &[Watcher]),
    ("/opendsec.v1.Iam/AcquireLock", &[Watcher]),
    ("/opendsec.v1.Iam/ResolvePool", &[Apiserver]),
    ("/opendsec.v1.Iam/ListAllPools", &[Edge]),
    // IAM's Admin API, which apiservers proxy with the caller's own token.
    ("/opendsec.v1.Admin/", &[Apiserver]),
    // Between the members of a replicated IAM.
    ("/opendsec.v1.IamRaft/", &[Iam]),
    // The watcher.
    ("/opendsec.v1.Watcher/GetSnapshot", &[Apiserver]),
    // Only as the edge of the certificate (checked by the handler with `Peer`).
    ("/opendsec.v1.Watcher/RegisterEdge", &[Edge]),
    // An edge.
    ("/opendsec.v1.Edge/Status", &[Watcher]),
    ("/opendsec.v1.Edge/SetDraining", &[Apiserver]),
    ("/opendsec.v1.Edge/CreateSandbox", &[Apiserver]),
    ("/opendsec.v1.Edge/CreateMany", &[Apiserver]),
    ("/opendsec.v1.Edge/GetSandbox", &[Apiserver]),
    ("/opendsec.v1.Edge/GetSandboxMetrics", &[Apiserver]),
    ("/opendsec.v1.Edge/ListSandboxes", &[Apiserver]),
    ("/opendsec.v1.Edge/StopSandbox", &[Apiserver]),
    ("/opendsec.v1.Edge/PauseSandbox", &[Apiserver]),
    ("/opendsec.v1.Edge/ResumeSandbox", &[Apiserver]),
    ("/opendsec.v1.Edge/SetSandboxTimeout", &[Apiserver]),
    ("/opendsec.v1.Edge/UpdateNetwork", &[Apiserver]),
    ("/opendsec.v1.Edge/CreateSnapshot", &[Apiserver]),
    ("/opendsec.v1.Edge/MoveOut", &[Apiserver]),
    ("/opendsec.v1.Edge/FinishMove", &[Apiserver]),
    ("/opendsec.v1.Edge/SaveSession", &[Apiserver]),
    // Runtime calls an apiserver forwards to an edge (which passes them to the agent).
    ("/opendsec.v1.Runtime/", &[Apiserver]),
];

/// The roles that may call `path` (`/package.Service/Method`); empty: nobody.
pub fn allowed(path: &str) -> &'static [Role] {
    if let Some((_, roles)) = TABLE.iter().find(|(p, _)| !p.ends_with('/') && *p == path) {
        return roles;
    }
    TABLE
        .iter()
        .filter(|(p, _)| p.ends_with('/'))
        .find(|(p, _)| path.strip_prefix(p).is_some_and(|m| !m.is_empty() && !m.contains('/')))
        .map_or(&[], |(_, r)| r)
}

/// The authenticated caller of an internal call, put into the request's extensions by
/// [`AclLayer`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer(pub Identity);

/// The caller's identity in a tonic request (set by [`AclLayer`]).
pub fn peer<T>(req: &tonic::Request<T>) -> Option<&Identity> {
    req.extensions().get::<Peer>().map(|p| &p.0)
}

/// Refuses a call unless the caller is `role` named `name` (for calls an edge may make only
/// as itself) or of one of the roles in `for_others`, which may make it for anyone.
pub fn require_self<T>(req: &tonic::Request<T>, role: Role, name: &str, for_others: &[Role]) -> Result<(), ApiError> {
    match peer(req) {
        Some(id) if id.role == role && id.name == name => Ok(()),
        Some(id) if for_others.contains(&id.role) => Ok(()),
        Some(id) if id.role != role => {
            Err(ApiError::new(Reason::PermissionDenied, format!("{id} may not make this call for {role}/{name}")))
        }
        Some(id) => {
            Err(ApiError::new(Reason::PermissionDenied, format!("{id} may act only as itself, not as {role}/{name}")))
        }
        None => Err(ApiError::new(Reason::Unauthenticated, "no client certificate")),
    }
}

/// The header a member of a replicated IAM sets when it forwards a call to its leader: the
/// identity of the caller it took the call from, so that the leader checks and answers that
/// caller, not the member. Believed only by IAM's own server ([`AclLayer::iam`]), only on
/// `Iam` and `Admin` calls, only from a caller whose certificate says `iam`, and only for
/// the roles that call those services; ignored everywhere else.
pub const ON_BEHALF_OF: &str = "x-opendsec-on-behalf-of";

/// Put into a request's extensions beside its [`Peer`] when the peer is the caller an IAM
/// member forwarded the call for (the member itself is in `.0`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Forwarded(pub Identity);

/// The identity in the client certificate of an HTTP request's TLS connection.
pub fn identity_of<B>(req: &http::Request<B>) -> Option<Identity> {
    let info = req.extensions().get::<TlsConnectInfo<TcpConnectInfo>>()?;
    let certs: Arc<Vec<CertificateDer<'static>>> = info.peer_certs()?;
    PEERS.identity(&certs)
}

/// Peer chains cached at most (dead ones are dropped first; all of them past that): above
/// the live connections one process holds (a server takes up to 16,384, and every server of
/// the process shares the cache), so that it does not empty itself over and over.
const PEERS_CACHED: usize = 65_536;

/// The identities of connections' peer certificates, parsed once per connection rather than
/// once per call (the parse was over 1 % of a creation's CPU). A connection's chain is one
/// `Arc` that every request on it shares, so the cache is keyed by its address; the `Weak`
/// kept with each entry holds that allocation, so the address is never reused by another
/// chain while the entry lives. Entries of closed connections are dropped as the cache fills.
static PEERS: std::sync::LazyLock<Peers> = std::sync::LazyLock::new(Peers::default);

type Chain = Vec<CertificateDer<'static>>;

/// A chain's identity (`None`: it names none), and the chain's allocation held.
type Known = (std::sync::Weak<Chain>, Option<Identity>);

#[derive(Default)]
struct Peers(std::sync::Mutex<std::collections::HashMap<usize, Known>>);

impl Peers {
    fn identity(&self, certs: &Arc<Chain>) -> Option<Identity> {
        let at = Arc::as_ptr(certs) as usize;
        if let Some((_, id)) = self.0.lock().unwrap_or_else(|p| p.into_inner()).get(&at) {
            return id.clone();
        }
        // Parsed without the lock: other connections' calls do not wait on it.
        let id = Identity::of_cert(certs.first()?);
        let mut cached = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if cached.len() >= PEERS_CACHED {
            cached.retain(|_, (w, _)| w.strong_count() > 0);
            if cached.len() >= PEERS_CACHED {
                cached.clear();
            }
        }
        cached.insert(at, (Arc::downgrade(certs), id.clone()));
        id
    }
}

/// The caller an IAM member forwards `path` for, if this is such a call: `Some(None)` when the
/// header is there but not believable (garbled, or naming a role that does not call IAM).
fn forwarded_for<B>(req: &http::Request<B>, path: &str, cert: &Identity) -> Option<Option<Identity>> {
    let v = req.headers().get(ON_BEHALF_OF)?;
    if cert.role != Iam || !(path.starts_with("/opendsec.v1.Iam/") || path.starts_with("/opendsec.v1.Admin/")) {
        return None;
    }
    let id = v.to_str().ok().and_then(|v| Identity::parse(v).ok());
    Some(id.filter(|id| matches!(id.role, Apiserver | Edge | Watcher)))
}

/// The layer checking [`TABLE`] in front of an internal server.
#[derive(Clone, Copy, Debug, Default)]
pub struct AclLayer {
    /// IAM's server: calls its members forward are checked as their original callers'.
    trust_forwarded: bool,
}

impl AclLayer {
    /// The layer of a replicated IAM's server (see [`ON_BEHALF_OF`]).
    pub fn iam() -> AclLayer {
        AclLayer { trust_forwarded: true }
    }
}

impl<S> tower::Layer<S> for AclLayer {
    type Service = Acl<S>;

    fn layer(&self, inner: S) -> Acl<S> {
        Acl { inner, trust_forwarded: self.trust_forwarded }
    }
}

#[derive(Clone, Debug)]
pub struct Acl<S> {
    inner: S,
    trust_forwarded: bool,
}

impl<S, B, R> tower::Service<http::Request<B>> for Acl<S>
where
    S: tower::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
    R: Default + Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<R>;
    type Error = S::Error;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Self::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: http::Request<B>) -> Self::Future {
        let path = req.uri().path().to_string();
        let mut member = None;
        let id = match identity_of(&req) {
            Some(cert) if self.trust_forwarded => match forwarded_for(&req, &path, &cert) {
                None => Some(cert),
                Some(caller) => {
                    member = Some(cert);
                    caller
                }
            },
            id => id,
        };
        let refused = match id {
            None => Some(ApiError::new(Reason::Unauthenticated, "no client certificate with an opendsec identity")),
            Some(id) if allowed(&path).contains(&id.role) => {
                req.extensions_mut().insert(Peer(id));
                if let Some(m) = member {
                    req.extensions_mut().insert(Forwarded(m));
                }
                None
            }
            Some(id) => Some(ApiError::new(Reason::PermissionDenied, format!("{id} may not call {path}"))),
        };
        match refused {
            None => Box::pin(self.inner.call(req)),
            Some(e) => {
                tracing::warn!(path = %path, reason = %e.reason, error = %e.message, "internal call refused");
                let resp = e.to_status().into_http();
                Box::pin(async move { Ok(resp) })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection's chain is parsed once and its identity answered from then on; another
    /// chain (another connection) gets its own; a full cache drops the chains no connection
    /// holds any more and keeps answering right.
    #[test]
    fn peer_identities_are_parsed_once_per_connection() {
        use crate::pki;
        let t = tempfile::tempdir().unwrap();
        pki::init_ca(t.path(), false, &pki::CaScope::default()).unwrap();
        let chain = |role: Role, name: &str| {
            let id = Identity::new(role, name).unwrap();
            let out = t.path().join(format!("{name}.pem"));
            pki::issue(t.path(), &out, &id, &pki::Names::default(), std::time::Duration::from_secs(3600)).unwrap();
            let der = pki::first_cert(&std::fs::read_to_string(&out).unwrap()).unwrap();
            (id, Arc::new(vec![CertificateDer::from(der)]))
        };
        let peers = Peers::default();
        let (a, chain_a) = chain(Edge, "e1");
        let (b, chain_b) = chain(Apiserver, "api-1");
        assert_eq!(peers.identity(&chain_a), Some(a.clone()));
        assert_eq!(peers.identity(&chain_b), Some(b.clone()));
        // Answered from the cache: the same answer, no second entry.
        assert_eq!(peers.identity(&chain_a.clone()), Some(a.clone()));
        assert_eq!(peers.0.lock().unwrap().len(), 2);
        // A chain without an identity is remembered as such.
        let none = Arc::new(vec![CertificateDer::from(vec![1u8, 2, 3])]);
        assert_eq!(peers.identity(&none), None);
        assert_eq!(peers.identity(&none), None);
        // Filled with chains whose connections are gone: they are dropped, the live stay.
        drop(none);
        for _ in 0..PEERS_CACHED {
            let gone = Arc::new(chain_b.as_ref().clone());
            assert_eq!(peers.identity(&gone), Some(b.clone()));
        }
        {
            let cached = peers.0.lock().unwrap();
            assert!(cached.len() <= PEERS_CACHED, "{}", cached.len());
            assert!(cached.contains_key(&(Arc::as_ptr(&chain_a) as usize)), "a live connection's entry was dropped");
        }
        assert_eq!(peers.identity(&chain_a), Some(a));
        assert_eq!(peers.identity(&chain_b), Some(b));
    }

    /// An edge acts only as itself; the roles named may act for anyone; any other role, and a
    /// caller without a certificate, may not.
    #[test]
    fn acting_as_oneself() {
        let call = |role: Role, name: &str| {
            let mut r = tonic::Request::new(());
            r.extensions_mut().insert(Peer(Identity::new(role, name).unwrap()));
            r
        };
        let check = |r: &tonic::Request<()>| require_self(r, Edge, "e1", &[Apiserver]).map_err(|e| e.reason);
        assert_eq!(check(&call(Edge, "e1")), Ok(()));
        assert_eq!(check(&call(Edge, "e2")), Err(Reason::PermissionDenied));
        assert_eq!(check(&call(Apiserver, "0")), Ok(()));
        assert_eq!(check(&call(Watcher, "0")), Err(Reason::PermissionDenied));
        assert_eq!(check(&tonic::Request::new(())), Err(Reason::Unauthenticated));
    }

    #[test]
    fn the_gateway_role_calls_nothing_inside() {
        assert!(TABLE.iter().all(|(_, roles)| !roles.contains(&Role::Gateway)));
    }

    #[test]
    fn the_table_says_who_calls_what() {
        assert_eq!(allowed("/opendsec.v1.Iam/Admit"), &[Apiserver]);
        assert!(allowed("/opendsec.v1.Iam/ReleaseLeases").contains(&Edge));
        assert_eq!(allowed("/opendsec.v1.Edge/Status"), &[Watcher]);
        assert_eq!(allowed("/opendsec.v1.Runtime/Exec"), &[Apiserver]);
        assert_eq!(allowed("/opendsec.v1.Admin/CreateToken"), &[Apiserver]);
        assert_eq!(allowed("/opendsec.v1.Watcher/RegisterEdge"), &[Edge]);
        // Unknown methods, and prefix tricks, are nobody's.
        for p in [
            "/opendsec.v1.Iam/NewThing",
            "/opendsec.v1.Runtime/",
            "/opendsec.v1.Runtime/Exec/x",
            "/opendsec.v1.RuntimeX/Exec",
            "/opendsec.v1.Edge/Status/",
            "",
        ] {
            assert!(allowed(p).is_empty(), "{p}");
        }
        // Edges never reach IAM's decisions, the admin API, or another edge.
        for p in [
            "/opendsec.v1.Iam/Admit",
            "/opendsec.v1.Iam/AdmitMany",
            "/opendsec.v1.Iam/Authenticate",
            "/opendsec.v1.Admin/Grant",
            "/opendsec.v1.Edge/CreateSandbox",
            "/opendsec.v1.Edge/CreateMany",
            "/opendsec.v1.Runtime/Exec",
        ] {
            assert!(!allowed(p).contains(&Edge), "{p}");
        }
    }

    /// The forwarding header is believed only from an IAM member, only on IAM's services, and
    /// only for the roles that call them.
    #[test]
    fn a_forwarded_caller_is_believed_only_from_a_member_and_only_on_iam() {
        let req = |v: &str| http::Request::builder().header(ON_BEHALF_OF, v).body(()).unwrap();
        let member = Identity::new(Iam, "2").unwrap();
        let edge = Identity::new(Edge, "e1").unwrap();
        let admit = "/opendsec.v1.Iam/Admit";
        assert_eq!(forwarded_for(&req("edge/e9"), admit, &member), Some(Some(Identity::new(Edge, "e9").unwrap())));
        assert_eq!(
            forwarded_for(&req("apiserver/0"), "/opendsec.v1.Admin/Grant", &member).map(|i| i.is_some()),
            Some(true)
        );
        // From an edge: ignored (the edge stays itself).
        assert_eq!(forwarded_for(&req("apiserver/0"), admit, &edge), None);
        // On another service: ignored.
        assert_eq!(forwarded_for(&req("apiserver/0"), "/opendsec.v1.Edge/CreateSandbox", &member), None);
        assert_eq!(forwarded_for(&req("edge/e2"), "/opendsec.v1.Watcher/RegisterEdge", &member), None);
        assert_eq!(forwarded_for(&req("iam/1"), "/opendsec.v1.IamRaft/AppendEntries", &member), None);
        // Naming a member, a gateway or nothing readable: nobody.
        for v in ["iam/1", "gateway/0", "garbage", ""] {
            assert_eq!(forwarded_for(&req(v), admit, &member), Some(None), "{v}");
        }
        // No header: not forwarded.
        let plain = http::Request::builder().body(()).unwrap();
        assert_eq!(forwarded_for(&plain, admit, &member), None);
    }

    #[test]
    fn the_agents_control_service_is_nobodys_over_the_network() {
        // The edge calls it on a sandbox's own socket; no internal server may take it.
        assert!(allowed("/opendsec.v1.AgentControl/SetIdentity").is_empty());
        assert_eq!(allowed("/opendsec.v1.Iam/ListAllPools"), &[Edge]);
        assert_eq!(allowed("/opendsec.v1.Iam/ResolvePool"), &[Apiserver]);
    }

    #[test]
    fn every_method_of_the_internal_services_has_a_row() {
        let protos = [
            (include_str!("../../../proto/opendsec/v1/iam.proto"), "Iam"),
            (include_str!("../../../proto/opendsec/v1/iam.proto"), "IamRaft"),
            (include_str!("../../../proto/opendsec/v1/cluster.proto"), "Edge"),
            (include_str!("../../../proto/opendsec/v1/cluster.proto"), "Watcher"),
            (include_str!("../../../proto/opendsec/v1/runtime.proto"), "Runtime"),
            (include_str!("../../../proto/opendsec/v1/opendsec.proto"), "Admin"),
        ];
        for (text, service) in protos {
            let body =
                text.split(&format!("service {service} {{")).nth(1).unwrap_or_else(|| panic!("service {service}"));
            let body = &body[..body.find('}').unwrap()];
            let methods: Vec<&str> = body
                .lines()
                .filter_map(|l| l.trim().strip_prefix("rpc "))
                .map(|l| &l[..l.find('(').unwrap()])
                .collect();
            assert!(!methods.is_empty(), "{service}");
            for m in methods {
                let path = format!("/opendsec.v1.{service}/{m}");
                assert!(!allowed(&path).is_empty(), "{path} has no row in the ACL table");
            }
        }
    }
}
