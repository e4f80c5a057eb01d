//! The authentication and authorization caches (reference section 1, "Authentication cache").
//!
//! Token-to-identity and (principal, permission, project)-to-decision results are kept for the
//! configured TTL, an identity never past its token's own expiry. Tokens are never stored: the
//! key is the SHA-256 of the token. IAM's security epoch is polled by the caller, with what
//! changed since the epoch last seen: a revoked token, a principal, a project; the caches drop
//! just the entries that name it (a tenant revoking its own tokens costs nobody else a cache
//! entry), and clear everything when IAM no longer knows what changed. A revocation reaches
//! every apiserver within about one poll interval.
//!
//! A lookup that raced with a clear must not put a pre-revocation answer back: callers take the
//! generation before asking IAM and insert with it, and inserts from an older generation are
//! dropped.
//!
//! Tokens IAM refused are remembered too, for a shorter time (a negative cache): a client
//! retrying a bad token costs one IAM call per `negative_ttl`, not one per attempt. A refused
//! token never turns good (secrets are IAM's random choice), so the epoch does not clear it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opendsec_common::ApiError;
use sha2::{Digest, Sha256};

/// Who a token belongs to (IAM's Authenticate answer).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity {
    pub principal: String,
    pub project: String,
    pub token_id: String,
    /// Unix ms; 0 = never.
    pub expires_at_ms: i64,
    /// A token IAM minted for one sandbox (`CreateSandboxTokens`) reaches only that one.
    pub scope: Option<Scope>,
}

/// The sandbox a token is limited to, and what it may do there.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    pub lease: String,
    pub kind: ScopeKind,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScopeKind {
    /// Every Runtime call, and reading the sandbox.
    Runtime,
    /// The sandbox's ports: HTTP into it and its code contexts' management.
    Traffic,
}

/// The methods a sandbox token may call, by kind (all on its own sandbox).
const RUNTIME_SCOPED_SERVICES: &[&str] = &["/opendsec.v1.Runtime/"];
const SCOPED_SANDBOX_READS: &[&str] =
    &["/opendsec.v1.Sandboxes/GetSandbox", "/opendsec.v1.Sandboxes/GetSandboxMetrics"];
const TRAFFIC_METHODS: &[&str] = &[
    "/opendsec.v1.Runtime/HttpRequest",
    "/opendsec.v1.Runtime/CreateCodeContext",
    "/opendsec.v1.Runtime/ListCodeContexts",
    "/opendsec.v1.Runtime/RestartCodeContext",
    "/opendsec.v1.Runtime/RemoveCodeContext",
    "/opendsec.v1.Sandboxes/GetSandbox",
];

impl Identity {
    /// Whether the token may call the method at `path` at all (a sandbox token: only the calls
    /// of its kind; checked before the request is decoded).
    pub fn may_call(&self, path: &str) -> Result<(), ApiError> {
        let Some(scope) = &self.scope else { return Ok(()) };
        let allowed = match scope.kind {
            ScopeKind::Runtime => {
                RUNTIME_SCOPED_SERVICES.iter().any(|p| path.starts_with(p)) || SCOPED_SANDBOX_READS.contains(&path)
            }
            ScopeKind::Traffic => TRAFFIC_METHODS.contains(&path),
        };
        if allowed {
            Ok(())
        } else {
            let kind = match scope.kind {
                ScopeKind::Runtime => "runtime",
                ScopeKind::Traffic => "traffic",
            };
            Err(ApiError::denied(format!(
                "token {} is a sandbox's {kind} token: it may not call {}",
                self.token_id,
                path.rsplit('/').next().unwrap_or(path)
            )))
        }
    }

    /// What the per-caller bounds (calls in flight, Runtime calls) count this caller as: its
    /// principal, or for a sandbox's token that token's sandbox, so that whoever holds one
    /// sandbox's token cannot use up the principal's slots for all its other calls.
    pub fn bounds_key(&self) -> String {
        match &self.scope {
            Some(s) => format!("{}@{}", self.principal, s.lease),
            None => self.principal.clone(),
        }
    }

    /// Whether the token reaches sandbox `id` (a sandbox token: its own sandbox only; any
    /// other answers as one that does not exist).
    pub fn may_reach(&self, id: &str) -> Result<(), ApiError> {
        let Some(scope) = &self.scope else { return Ok(()) };
        match id.split_once('.') {
            Some((_, lease)) if lease == scope.lease => Ok(()),
            _ => Err(ApiError::new(opendsec_common::Reason::NotFound, format!("sandbox {id} not found"))),
        }
    }
}

/// The cache key of a token: its SHA-256, so no token is kept in memory longer than a call.
pub type TokenKey = [u8; 32];

pub fn token_key(token: &str) -> TokenKey {
    Sha256::digest(token.as_bytes()).into()
}

type AuthzKey = (String, String, String);

/// Entries kept before expired ones are swept (and, if that is not enough, all are dropped).
const MAX_ENTRIES: usize = 100_000;

#[derive(Debug)]
pub struct AuthCache {
    ttl: Duration,
    negative_ttl: Duration,
    inner: Mutex<Inner>,
}

/// What a change took away, as IAM names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Revocation {
    Token(String),
    Principal(String),
    Project(String),
}

#[derive(Debug, Default)]
struct Inner {
    generation: u64,
    epoch: Option<u64>,
    authn: HashMap<TokenKey, (Arc<Identity>, Instant)>,
    authz: HashMap<AuthzKey, (bool, Instant)>,
    /// Tokens IAM refused, until when they are refused without asking.
    refused: HashMap<TokenKey, Instant>,
}

/// More revocations than this in one poll clear the caches rather than walk them.
const MAX_TARGETED: usize = 256;

impl Inner {
    /// Drops the cached answers `revoked` makes stale: one pass over each cache for all of
    /// them (a burst of revocations costs two walks, not one per revocation).
    fn drop_revoked(&mut self, revoked: &[Revocation]) {
        use opendsec_common::ids::project_within;
        use std::collections::HashSet;
        let mut tokens = HashSet::new();
        let mut principals = HashSet::new();
        let mut projects = Vec::new();
        for r in revoked {
            match r {
                Revocation::Token(id) => {
                    tokens.insert(id.as_str());
                }
                Revocation::Principal(p) => {
                    principals.insert(p.as_str());
                }
                Revocation::Project(p) => projects.push(p.as_str()),
            }
        }
        let in_projects = |p: &str| projects.iter().any(|root| project_within(p, root));
        self.authn.retain(|_, (i, _)| {
            !tokens.contains(i.token_id.as_str())
                && !principals.contains(i.principal.as_str())
                && !in_projects(&i.project)
        });
        if !principals.is_empty() || !projects.is_empty() {
            self.authz
                .retain(|(principal, _, project), _| !principals.contains(principal.as_str()) && !in_projects(project));
        }
    }
}

impl AuthCache {
    pub fn new(ttl: Duration, negative_ttl: Duration) -> AuthCache {
        AuthCache { ttl, negative_ttl, inner: Mutex::new(Inner::default()) }
    }

    /// Whether IAM refused this token within the negative TTL.
    pub fn refused(&self, key: &TokenKey, now: Instant) -> bool {
        let mut g = self.lock();
        match g.refused.get(key) {
            Some(until) if *until > now => true,
            Some(_) => {
                g.refused.remove(key);
                false
            }
            None => false,
        }
    }

    /// Remembers that IAM refused this token.
    pub fn put_refused(&self, key: TokenKey, now: Instant) {
        if self.negative_ttl.is_zero() {
            return;
        }
        let mut g = self.lock();
        if g.refused.len() >= MAX_ENTRIES {
            g.refused.retain(|_, until| *until > now);
            if g.refused.len() >= MAX_ENTRIES {
                g.refused.clear();
            }
        }
        g.refused.insert(key, now + self.negative_ttl);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Take this before asking IAM; pass it to the matching `put_*`.
    pub fn generation(&self) -> u64 {
        self.lock().generation
    }

    pub fn get_identity(&self, key: &TokenKey, now: Instant, now_ms: i64) -> Option<Arc<Identity>> {
        let mut g = self.lock();
        match g.authn.get(key) {
            Some((id, until)) if *until > now && (id.expires_at_ms == 0 || id.expires_at_ms > now_ms) => {
                Some(id.clone())
            }
            Some(_) => {
                g.authn.remove(key);
                None
            }
            None => None,
        }
    }

    pub fn put_identity(&self, generation: u64, key: TokenKey, id: Arc<Identity>, now: Instant) {
        let mut g = self.lock();
        if g.generation != generation {
            return;
        }
        if g.authn.len() >= MAX_ENTRIES {
            g.authn.retain(|_, (_, until)| *until > now);
            if g.authn.len() >= MAX_ENTRIES {
                g.authn.clear();
            }
        }
        g.authn.insert(key, (id, now + self.ttl));
    }

    pub fn get_authz(&self, principal: &str, permission: &str, project: &str, now: Instant) -> Option<bool> {
        let g = self.lock();
        // Borrowed lookup would need a custom key type; the allocation is cheap next to a lock.
        let key = (principal.to_string(), permission.to_string(), project.to_string());
        match g.authz.get(&key) {
            Some((allowed, until)) if *until > now => Some(*allowed),
            _ => None,
        }
    }

    pub fn put_authz(
        &self,
        generation: u64,
        principal: &str,
        permission: &str,
        project: &str,
        allowed: bool,
        now: Instant,
    ) {
        let mut g = self.lock();
        if g.generation != generation {
            return;
        }
        if g.authz.len() >= MAX_ENTRIES {
            g.authz.retain(|_, (_, until)| *until > now);
            if g.authz.len() >= MAX_ENTRIES {
                g.authz.clear();
            }
        }
        g.authz.insert((principal.to_string(), permission.to_string(), project.to_string()), (allowed, now + self.ttl));
    }

    /// Records IAM's security epoch and what was taken away since the last one seen
    /// (`None`: not known, clear everything); returns true when the epoch changed. Any change
    /// also starts a new generation, so an answer IAM gave before it is not cached after it.
    pub fn observe_epoch(&self, epoch: u64, revoked: Option<&[Revocation]>) -> bool {
        let mut g = self.lock();
        let changed = match g.epoch {
            Some(e) if e == epoch => return false,
            Some(_) => true,
            // The first epoch seen: anything cached before it came from the same IAM state
            // or older, so clear as for a change.
            None => false,
        };
        let first = g.epoch.is_none();
        g.epoch = Some(epoch);
        g.generation += 1;
        match revoked {
            Some(list) if !first && list.len() <= MAX_TARGETED => g.drop_revoked(list),
            _ => {
                g.authn.clear();
                g.authz.clear();
            }
        }
        changed
    }

    /// The last epoch observed.
    pub fn epoch(&self) -> Option<u64> {
        self.lock().epoch
    }

    /// The principal of a cached token, if any (for audit lines of proxied calls).
    pub fn cached_principal(&self, key: &TokenKey) -> Option<String> {
        self.lock().authn.get(key).map(|(id, _)| id.principal.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ident(exp: i64) -> Arc<Identity> {
        who("alice", "root/a", "t1", exp)
    }

    fn who(principal: &str, project: &str, token_id: &str, exp: i64) -> Arc<Identity> {
        Arc::new(Identity {
            principal: principal.into(),
            project: project.into(),
            token_id: token_id.into(),
            expires_at_ms: exp,
            scope: None,
        })
    }

    #[test]
    fn a_sandbox_token_calls_only_its_kind_on_its_sandbox() {
        let scoped = |kind| Identity { scope: Some(Scope { lease: "l1".into(), kind }), ..(*ident(0)).clone() };
        let (rt, tr) = (scoped(ScopeKind::Runtime), scoped(ScopeKind::Traffic));
        for path in ["/opendsec.v1.Runtime/Exec", "/opendsec.v1.Runtime/WriteFile", "/opendsec.v1.Sandboxes/GetSandbox"]
        {
            assert!(rt.may_call(path).is_ok(), "{path}");
        }
        for path in [
            "/opendsec.v1.Sandboxes/ListSandboxes",
            "/opendsec.v1.Sandboxes/CreateSandbox",
            "/opendsec.v1.Sandboxes/StopSandbox",
            "/opendsec.v1.Sandboxes/CreateSandboxTokens",
            "/opendsec.v1.Admin/CreateToken",
            "/opendsec.v1.Images/ListImages",
        ] {
            assert!(rt.may_call(path).is_err() && tr.may_call(path).is_err(), "{path}");
        }
        assert!(tr.may_call("/opendsec.v1.Runtime/HttpRequest").is_ok());
        assert!(tr.may_call("/opendsec.v1.Runtime/CreateCodeContext").is_ok());
        for path in ["/opendsec.v1.Runtime/Exec", "/opendsec.v1.Runtime/RunCode", "/opendsec.v1.Runtime/StartProcess"] {
            assert!(tr.may_call(path).is_err(), "{path}");
        }
        assert!(rt.may_reach("edge-1.l1").is_ok() && rt.may_reach("edge-9.l1").is_ok());
        assert_eq!(rt.may_reach("edge-1.l2").unwrap_err().reason, opendsec_common::Reason::NotFound);
        assert!(ident(0).may_call("/opendsec.v1.Admin/CreateToken").is_ok() && ident(0).may_reach("e.x").is_ok());
    }

    #[test]
    fn refused_tokens_are_remembered_for_the_negative_ttl() {
        let c = AuthCache::new(Duration::from_secs(30), Duration::from_secs(10));
        let t0 = Instant::now();
        let k = token_key("dsk.bad.secretsecretsecret");
        assert!(!c.refused(&k, t0));
        c.put_refused(k, t0);
        assert!(c.refused(&k, t0 + Duration::from_secs(9)));
        assert!(!c.observe_epoch(5, None) && c.refused(&k, t0), "an epoch change does not make it good");
        assert!(!c.refused(&k, t0 + Duration::from_secs(11)));
        let off = AuthCache::new(Duration::from_secs(30), Duration::ZERO);
        off.put_refused(k, t0);
        assert!(!off.refused(&k, t0));
    }

    #[test]
    fn identities_expire_with_the_ttl_and_the_token() {
        let c = AuthCache::new(Duration::from_secs(30), Duration::from_secs(10));
        let t0 = Instant::now();
        let k = token_key("dsk.t1.secretsecretsecret");
        c.put_identity(c.generation(), k, ident(0), t0);
        assert!(c.get_identity(&k, t0 + Duration::from_secs(29), 0).is_some());
        assert!(c.get_identity(&k, t0 + Duration::from_secs(31), 0).is_none());

        c.put_identity(c.generation(), k, ident(10_000), t0);
        assert!(c.get_identity(&k, t0, 9_999).is_some());
        assert!(c.get_identity(&k, t0, 10_000).is_none(), "never past the token's expiry");
    }

    #[test]
    fn an_epoch_change_clears_and_stale_inserts_are_dropped() {
        let c = AuthCache::new(Duration::from_secs(30), Duration::from_secs(10));
        let t0 = Instant::now();
        assert!(!c.observe_epoch(1, None));
        let k = token_key("tok");
        let g = c.generation();
        c.put_identity(g, k, ident(0), t0);
        c.put_authz(g, "alice", "sandbox.view", "root/a", true, t0);
        assert_eq!(c.get_authz("alice", "sandbox.view", "root/a", t0), Some(true));
        assert!(!c.observe_epoch(1, None));
        assert!(c.get_identity(&k, t0, 0).is_some());

        assert!(c.observe_epoch(2, None));
        assert!(c.get_identity(&k, t0, 0).is_none());
        assert_eq!(c.get_authz("alice", "sandbox.view", "root/a", t0), None);
        // An answer asked for before the change arrives after it: not cached.
        c.put_identity(g, k, ident(0), t0);
        assert!(c.get_identity(&k, t0, 0).is_none());
        c.put_identity(c.generation(), k, ident(0), t0);
        assert!(c.get_identity(&k, t0, 0).is_some());
    }

    #[test]
    fn keys_do_not_hold_the_token() {
        let k = token_key("dsk.abc.0123456789abcdef");
        assert_ne!(&k[..], b"dsk.abc.0123456789abcdef".get(..32).unwrap_or_default());
        assert_eq!(k, token_key("dsk.abc.0123456789abcdef"));
        assert_ne!(k, token_key("dsk.abc.0123456789abcdeg"));
    }

    #[test]
    fn a_revocation_drops_only_what_it_names() {
        let c = AuthCache::new(Duration::from_secs(30), Duration::from_secs(10));
        let t0 = Instant::now();
        assert!(!c.observe_epoch(1, Some(&[])));
        let entries = [
            ("k1", who("alice", "root/a", "t1", 0)),
            ("k2", who("alice", "root/a", "t2", 0)),
            ("k3", who("bob", "root/b", "t3", 0)),
            ("k4", who("carol", "root/b/x", "t4", 0)),
        ];
        let g = c.generation();
        for (k, id) in &entries {
            c.put_identity(g, token_key(k), id.clone(), t0);
        }
        c.put_authz(g, "alice", "sandbox.view", "root/a", true, t0);
        c.put_authz(g, "bob", "sandbox.view", "root/b/x", true, t0);
        c.put_authz(g, "bob", "sandbox.view", "root/c", true, t0);
        let cached = |k: &str| c.get_identity(&token_key(k), t0, 0).is_some();

        // A revoked token: that token only.
        assert!(c.observe_epoch(2, Some(&[Revocation::Token("t1".into())])));
        assert!(!cached("k1") && cached("k2") && cached("k3") && cached("k4"));
        assert_eq!(c.get_authz("alice", "sandbox.view", "root/a", t0), Some(true));
        // A deleted project: the identities and decisions within it.
        assert!(c.observe_epoch(3, Some(&[Revocation::Project("root/b/x".into())])));
        assert!(cached("k2") && cached("k3") && !cached("k4"));
        assert_eq!(c.get_authz("bob", "sandbox.view", "root/b/x", t0), None);
        assert_eq!(c.get_authz("bob", "sandbox.view", "root/c", t0), Some(true));
        // A principal (a grant revoked): its identities and decisions.
        assert!(c.observe_epoch(4, Some(&[Revocation::Principal("bob".into())])));
        assert!(cached("k2") && !cached("k3"));
        assert_eq!(c.get_authz("bob", "sandbox.view", "root/c", t0), None);
        assert_eq!(c.get_authz("alice", "sandbox.view", "root/a", t0), Some(true));
        // IAM no longer knows what changed: everything goes.
        assert!(c.observe_epoch(9, None));
        assert!(!cached("k2"));
        assert_eq!(c.get_authz("alice", "sandbox.view", "root/a", t0), None);
    }
}
