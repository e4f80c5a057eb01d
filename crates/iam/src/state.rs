//! The IAM state machine: [`State`] and [`apply`], the only code that changes it.
//!
//! `apply` is pure: no clock, no randomness, no I/O. It reads the time and every generated
//! value from the command, so standalone mode (apply, then persist the writes to redb) and a
//! replicated log (commit, then apply on every replica) reach the same state through the same
//! code.
//!
//! Invariants kept here:
//! - a command that fails changes nothing and produces no writes;
//! - every lease's project exists, and for every project, `usage` equals the sum of the leases
//!   in it and its subprojects (each lease counting one sandbox);
//! - an admit never takes any project's usage above a limit it sets (all or nothing across the
//!   project and its ancestors);
//! - nobody grants or revokes a permission they do not hold themselves;
//! - every change that can take access away bumps the security epoch.

mod images;
mod leases;

pub use leases::validate_admit;
use leases::{admit, reconcile, release_leases, sweep_unbound};

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use opendsec_common::ids::{self, ROOT_PROJECT, parent_project, project_chain, project_within};

use crate::backup::Snapshot;
use crate::command::{Actor, Admission, Command, LiveLease, MintedToken, Output, Row, Table, Write};
use crate::error::IamError;
use crate::model::{
    GrantRecord, LeaseRecord, LockRecord, Meta, PoolRecord, PrincipalRecord, ProjectRecord, ProjectView, QUOTA_KEYS,
    Quota, Resources, ScopeKind, TokenRecord, TokenScope, Usage, validate_permission,
};
use crate::token;

/// Most live (unrevoked) tokens one principal may hold.
pub const MAX_TOKENS_PER_PRINCIPAL: usize = 1000;
/// Longest token description.
pub const MAX_DESCRIPTION_LEN: usize = 256;
/// Longest lock name or holder.
pub const MAX_LOCK_NAME_LEN: usize = 128;
/// Longest lock TTL: a day.
pub const MAX_LOCK_TTL_MS: i64 = 24 * 3600 * 1000;

/// IAM's whole state in memory. Persistent parts mirror the store's tables; `usage`,
/// `leases_by_edge` and `tokens_by_principal` are derived and rebuilt on load.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct State {
    pub(crate) meta: Meta,
    /// `meta.hash_key` decoded.
    pub(crate) hash_key: Vec<u8>,
    pub(crate) projects: BTreeMap<String, ProjectRecord>,
    pub(crate) principals: BTreeMap<String, PrincipalRecord>,
    pub(crate) tokens: HashMap<String, TokenRecord>,
    /// principal -> {(project, permission)}.
    pub(crate) grants: BTreeMap<String, BTreeSet<(String, String)>>,
    pub(crate) leases: HashMap<String, LeaseRecord>,
    pub(crate) locks: BTreeMap<String, LockRecord>,
    /// `<project>//<name>` -> pool.
    pub(crate) pools: BTreeMap<String, PoolRecord>,
    /// `<project>//<repo:tag>` -> what the image costs the store.
    pub(crate) images: BTreeMap<String, crate::model::ImageCharge>,
    // Derived.
    pub(crate) usage: HashMap<String, Usage>,
    pub(crate) leases_by_edge: HashMap<String, BTreeSet<String>>,
    pub(crate) tokens_by_principal: BTreeMap<String, BTreeSet<String>>,
    /// Lease -> the tokens scoped to it.
    pub(crate) tokens_by_lease: HashMap<String, BTreeSet<String>>,
    /// (edge, pool key) -> its idle members' leases, oldest first.
    pub(crate) members: HashMap<(String, String), BTreeSet<(i64, String)>>,
    /// Project -> store part id -> (images of its subtree naming it, its bytes).
    pub(crate) stored: HashMap<String, HashMap<String, (u32, u64)>>,
    /// What each epoch bump since this state was loaded took away (not part of its value).
    pub(crate) revocations: Revocations,
    /// Tokens of leases released by the command being applied: [`apply`] moves the epoch
    /// once for them when the command succeeds.
    pub(crate) ended_tokens: Vec<String>,
}

/// What a change that moved the security epoch took away, so that a cache drops just that
/// rather than everything (a tenant revoking its own tokens must not empty every apiserver's
/// caches).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Revoked {
    /// A token (revoked, or scoped to a sandbox that ended).
    Token(String),
    /// A principal's identity or grants (deleted, or a grant revoked).
    Principal(String),
    /// A project and its subprojects (deleted, with its grants).
    Project(String),
}

/// Revocations kept for apiservers to catch up on; an apiserver further behind clears all.
const REVOCATIONS_KEPT: usize = 65_536;

/// The revocations applied since the state was loaded, by epoch. Not part of the state's
/// value: it is what this replica saw applied (a state rebuilt from rows starts it anew), so
/// equality ignores it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Revocations {
    /// Epochs up to this one are not covered.
    floor: u64,
    events: std::collections::VecDeque<(u64, Revoked)>,
}

impl PartialEq for Revocations {
    fn eq(&self, _: &Revocations) -> bool {
        true
    }
}
impl Eq for Revocations {}

impl Revocations {
    fn reset(&mut self, epoch: u64) {
        self.floor = epoch;
        self.events.clear();
    }

    fn push(&mut self, epoch: u64, r: Revoked) {
        if self.events.len() >= REVOCATIONS_KEPT
            && let Some((e, _)) = self.events.pop_front()
        {
            self.floor = self.floor.max(e);
        }
        self.events.push_back((epoch, r));
    }

    /// Everything taken away after epoch `since` up to `now`, or `None` when that is not known
    /// (older than what is kept, or before this state was loaded).
    fn since(&self, since: u64, now: u64) -> Option<Vec<Revoked>> {
        if since >= now {
            return Some(Vec::new());
        }
        if since < self.floor {
            return None;
        }
        Some(self.events.iter().filter(|(e, _)| *e > since).map(|(_, r)| r.clone()).collect())
    }
}

impl State {
    /// Builds a state from stored rows (any order), recomputing everything derived.
    pub fn from_rows(rows: impl IntoIterator<Item = Row>) -> State {
        let mut st = State::default();
        for row in rows {
            match row {
                Row::Project(r) => {
                    st.projects.insert(r.path.clone(), r);
                }
                Row::Principal(r) => {
                    st.principals.insert(r.name.clone(), r);
                }
                Row::Token(r) => {
                    st.tokens.insert(r.id.clone(), r);
                }
                Row::Grant(g) => {
                    st.grants.entry(g.principal).or_default().insert((g.project, g.permission));
                }
                Row::Lease(r) => {
                    st.leases.insert(r.id.clone(), r);
                }
                Row::Lock(r) => {
                    st.locks.insert(r.name.clone(), r);
                }
                Row::Pool(r) => {
                    st.pools.insert(r.key(), *r);
                }
                Row::Image(r) => {
                    st.images.insert(r.key(), r);
                }
                Row::Meta(m) => st.meta = m,
            }
        }
        st.rebuild_derived();
        st
    }

    /// Recomputes usage and the indexes from the persistent parts.
    pub(crate) fn rebuild_derived(&mut self) {
        self.revocations.reset(self.meta.epoch);
        self.hash_key = token::from_hex(&self.meta.hash_key).unwrap_or_default();
        self.usage = self.projects.keys().map(|p| (p.clone(), Usage::default())).collect();
        self.leases_by_edge.clear();
        self.members.clear();
        for l in self.leases.values() {
            if !l.pool.is_empty() {
                self.members.entry((l.edge.clone(), l.pool.clone())).or_default().insert((l.bound_at_ms, l.id.clone()));
            }
            let u = Usage::of(&l.resources);
            for q in project_chain(&l.project) {
                if let Some(x) = self.usage.get_mut(q) {
                    x.add(&u);
                }
            }
            self.leases_by_edge.entry(l.edge.clone()).or_default().insert(l.id.clone());
        }
        self.stored.clear();
        let images: Vec<crate::model::ImageCharge> = self.images.values().cloned().collect();
        for c in &images {
            self.count_image(c, true);
        }
        self.tokens_by_principal.clear();
        self.tokens_by_lease.clear();
        for t in self.tokens.values() {
            self.tokens_by_principal.entry(t.principal.clone()).or_default().insert(t.id.clone());
            if let Some(scope) = &t.scope {
                self.tokens_by_lease.entry(scope.lease.clone()).or_default().insert(t.id.clone());
            }
        }
    }

    /// Every persistent row (what a fresh store would hold for this state).
    pub fn rows(&self) -> Vec<Row> {
        let mut rows = vec![Row::Meta(self.meta.clone())];
        rows.extend(self.projects.values().cloned().map(Row::Project));
        rows.extend(self.principals.values().cloned().map(Row::Principal));
        rows.extend(self.tokens.values().cloned().map(Row::Token));
        rows.extend(self.grant_records().map(Row::Grant));
        rows.extend(self.leases.values().cloned().map(Row::Lease));
        rows.extend(self.locks.values().cloned().map(Row::Lock));
        rows.extend(self.pools.values().cloned().map(|p| Row::Pool(Box::new(p))));
        rows.extend(self.images.values().cloned().map(Row::Image));
        rows
    }

    /// The pool `name` of `project`.
    pub fn pool(&self, project: &str, name: &str) -> Option<&PoolRecord> {
        self.pools.get(&crate::model::pool_key(project, name))
    }

    /// The pools of `project` and its subprojects, by key.
    /// The pool `name` of `project`, or `not_found` naming it.
    pub fn pool_named(&self, project: &str, name: &str) -> Result<PoolRecord, IamError> {
        self.pool(project, name)
            .cloned()
            .ok_or_else(|| IamError::NotFound { kind: "pool", name: crate::model::pool_key(project, name) })
    }

    pub fn pools_within(&self, project: &str) -> impl Iterator<Item = &PoolRecord> {
        self.pools.values().filter(move |p| project_within(&p.project, project))
    }

    // ----- read accessors -----

    pub fn meta(&self) -> &Meta {
        &self.meta
    }
    pub fn epoch(&self) -> u64 {
        self.meta.epoch
    }
    /// What was taken away after epoch `since` (see [`Revocations::since`]).
    pub fn revoked_since(&self, since: u64) -> Option<Vec<Revoked>> {
        self.revocations.since(since, self.meta.epoch)
    }
    pub fn bootstrapped(&self) -> bool {
        self.meta.bootstrapped
    }
    pub fn hash_key(&self) -> &[u8] {
        &self.hash_key
    }
    pub fn project(&self, path: &str) -> Option<&ProjectRecord> {
        self.projects.get(path)
    }
    pub fn projects(&self) -> impl Iterator<Item = &ProjectRecord> {
        self.projects.values()
    }
    pub fn principal(&self, name: &str) -> Option<&PrincipalRecord> {
        self.principals.get(name)
    }
    pub fn token_record(&self, id: &str) -> Option<&TokenRecord> {
        self.tokens.get(id)
    }
    pub fn lease(&self, id: &str) -> Option<&LeaseRecord> {
        self.leases.get(id)
    }
    pub fn leases(&self) -> impl Iterator<Item = &LeaseRecord> {
        self.leases.values()
    }
    pub fn lock(&self, name: &str) -> Option<&LockRecord> {
        self.locks.get(name)
    }
    /// Usage of the project and its subprojects (`None` for an unknown project).
    pub fn usage(&self, path: &str) -> Option<Usage> {
        self.usage.get(path).copied()
    }
    pub fn grant_records(&self) -> impl Iterator<Item = GrantRecord> + '_ {
        self.grants.iter().flat_map(|(p, set)| {
            set.iter().map(move |(proj, perm)| GrantRecord {
                principal: p.clone(),
                project: proj.clone(),
                permission: perm.clone(),
            })
        })
    }
    pub fn has_grant(&self, g: &GrantRecord) -> bool {
        self.grants.get(&g.principal).is_some_and(|s| s.contains(&(g.project.clone(), g.permission.clone())))
    }

    /// The limits in force: own values, else the nearest ancestor's.
    pub fn effective_quota(&self, path: &str) -> Quota {
        let mut vals = [None; 6];
        for q in project_chain(path) {
            if let Some(rec) = self.projects.get(q) {
                for (v, own) in vals.iter_mut().zip(rec.quota.values()) {
                    if v.is_none() {
                        *v = own;
                    }
                }
            }
        }
        Quota::from_values(vals)
    }

    pub fn view(&self, path: &str) -> Option<ProjectView> {
        let rec = self.projects.get(path)?;
        Some(ProjectView {
            path: rec.path.clone(),
            quota: rec.quota,
            effective: self.effective_quota(path),
            usage: self.usage.get(path).copied().unwrap_or_default(),
            created_at_ms: rec.created_at_ms,
            egress_ceiling: rec.egress_ceiling.clone(),
        })
    }

    // ----- authorization -----

    /// Whether `principal` holds `permission` on `project`: a grant of it (or of `*`) on the
    /// project or an ancestor.
    pub fn holds(&self, principal: &str, permission: &str, project: &str) -> bool {
        self.grants.get(principal).is_some_and(|set| {
            set.iter().any(|(gp, gperm)| (gperm == "*" || gperm == permission) && project_within(project, gp))
        })
    }

    pub(crate) fn require(
        &self,
        principal: &str,
        permission: &str,
        project: &str,
        target: impl FnOnce() -> String,
    ) -> Result<(), IamError> {
        if self.holds(principal, permission, project) {
            Ok(())
        } else {
            Err(IamError::PermissionDenied {
                principal: principal.to_string(),
                permission: permission.to_string(),
                target: target(),
            })
        }
    }

    /// Checks `permission` over a principal named by the caller: on its project when it
    /// exists, else on the root, so a denial looks the same whether or not it exists.
    pub(crate) fn require_over_principal(
        &self,
        caller: &str,
        permission: &str,
        name: &str,
    ) -> Result<Option<&PrincipalRecord>, IamError> {
        let target = self.principals.get(name);
        let on = target.map_or(ROOT_PROJECT, |p| p.project.as_str());
        self.require(caller, permission, on, || format!("principal {name}"))?;
        Ok(target)
    }

    /// Checks `principal.manage` over another principal's identity, for minting its tokens or
    /// deleting it: on its home project and on every project where it holds a grant. Whoever
    /// holds a principal's token holds all its grants, so taking over an identity needs
    /// authority everywhere that identity reaches (the admin of `root/a` cannot become a
    /// principal of `root/a` that `root/b` granted rights to). An unknown name is checked on
    /// the root, so a denial looks the same whether or not it exists.
    pub(crate) fn require_identity(&self, caller: &str, name: &str) -> Result<Option<&PrincipalRecord>, IamError> {
        let target = self.require_over_principal(caller, "principal.manage", name)?;
        if let Some(set) = self.grants.get(name) {
            for (project, _) in set {
                self.require(caller, "principal.manage", project, || {
                    format!("principal {name} (granted on {project})")
                })?;
            }
        }
        Ok(target)
    }

    /// The permission that governs creating, deleting and setting the quota of `path`, and the
    /// project it is checked on: `project.manage` on the parent (so nobody raises their own
    /// project's quota), `iam.admin` on the root for the root itself.
    pub(crate) fn manage_rule(path: &str) -> (&'static str, &str) {
        match parent_project(path) {
            Some(parent) => ("project.manage", parent),
            None => ("iam.admin", ROOT_PROJECT),
        }
    }

    /// The actor's token still stands and it may manage `path` (create, delete, set its quota):
    /// `project.manage` on the parent, so nobody raises their own project's limits.
    fn require_manage(&self, actor: &Actor, now_ms: i64, path: &str) -> Result<(), IamError> {
        self.check_actor(actor, now_ms)?;
        let (perm, on) = State::manage_rule(path);
        self.require(&actor.principal, perm, on, || format!("project {on}"))
    }

    /// Checks that the actor's token still stands at `now_ms` (not revoked, not expired, its
    /// principal still there).
    pub(crate) fn check_actor(&self, actor: &Actor, now_ms: i64) -> Result<(), IamError> {
        let id = &actor.token_id;
        let t = self
            .tokens
            .get(id)
            .filter(|t| t.principal == actor.principal)
            .ok_or_else(|| IamError::Unauthenticated(format!("token {id} is no longer valid")))?;
        if t.revoked {
            return Err(IamError::Unauthenticated(format!("token {id} has been revoked")));
        }
        if t.expired_at(now_ms) {
            return Err(IamError::Unauthenticated(format!("token {id} has expired")));
        }
        if t.scope.is_some() {
            return Err(IamError::SandboxToken(id.clone()));
        }
        if !self.principals.contains_key(&actor.principal) {
            return Err(IamError::Unauthenticated(format!("principal {} no longer exists", actor.principal)));
        }
        Ok(())
    }

    /// The live tokens `actor` (its principal, with the token it calls with) was minted for
    /// lease `lease_id`, by kind, if it has both.
    pub fn sandbox_tokens(&self, lease_id: &str, actor: &Actor) -> Option<BTreeMap<ScopeKind, String>> {
        let mut found = BTreeMap::new();
        for id in self.tokens_by_lease.get(lease_id)? {
            let Some(t) = self.tokens.get(id) else { continue };
            let mine = |s: &&TokenScope| t.principal == actor.principal && s.parent == actor.token_id && !t.revoked;
            if let Some(scope) = t.scope.as_ref().filter(mine) {
                found.insert(scope.kind, t.id.clone());
            }
        }
        (found.len() == ScopeKind::ALL.len()).then_some(found)
    }

    /// Moves the security epoch for what `revoked` names.
    fn bump_epoch(&mut self, w: &mut Vec<Write>, revoked: impl IntoIterator<Item = Revoked>) {
        self.meta.epoch += 1;
        for r in revoked {
            self.revocations.push(self.meta.epoch, r);
        }
        w.push(Write::Put(Row::Meta(self.meta.clone())));
    }
}

/// Applies one command: the result and the writes that persist its effect. On error, nothing
/// changed and there are no writes.
pub fn apply(st: &mut State, cmd: &Command) -> (Result<Output, IamError>, Vec<Write>) {
    let mut w = Vec::new();
    let r = apply_inner(st, cmd, &mut w);
    if r.is_err() {
        debug_assert!(w.is_empty(), "a failed {} command produced writes", cmd.kind());
        debug_assert!(st.ended_tokens.is_empty(), "a failed {} command ended tokens", cmd.kind());
        w.clear();
        st.ended_tokens.clear();
    } else if !st.ended_tokens.is_empty() {
        // The tokens of sandboxes that ended: one epoch for all, naming each.
        let ended = std::mem::take(&mut st.ended_tokens);
        st.bump_epoch(&mut w, ended.into_iter().map(Revoked::Token));
    }
    (r, w)
}

fn apply_inner(st: &mut State, cmd: &Command, w: &mut Vec<Write>) -> Result<Output, IamError> {
    if !st.meta.bootstrapped && !matches!(cmd, Command::Bootstrap { .. }) {
        return Err(IamError::NotBootstrapped);
    }
    match cmd {
        Command::Bootstrap { now_ms, hash_key, admin_principal, admin_token_id, admin_token_hash, cluster } => {
            bootstrap(st, w, *now_ms, hash_key, admin_principal, admin_token_id, admin_token_hash, cluster)
        }
        Command::MemberSeen { id, data_dir } => member_seen(st, w, *id, data_dir),
        Command::SetCluster { cluster } => set_cluster(st, w, cluster),
        Command::CreateProject { actor, now_ms, path, quota } => create_project(st, w, actor, *now_ms, path, quota),
        Command::SetQuota { actor, now_ms, path, quota } => set_quota(st, w, actor, *now_ms, path, quota),
        Command::DeleteProject { actor, now_ms, path } => delete_project(st, w, actor, *now_ms, path),
        Command::CreatePrincipal { actor, now_ms, name, project } => {
            create_principal(st, w, actor, *now_ms, name, project)
        }
        Command::DeletePrincipal { actor, now_ms, name } => delete_principal(st, w, actor, *now_ms, name),
        Command::CreateToken { actor, now_ms, principal, token_id, secret_hash, expires_at_ms, description } => {
            create_token(st, w, actor, *now_ms, principal, token_id, secret_hash, *expires_at_ms, description)
        }
        Command::RevokeToken { actor, now_ms, token_id } => revoke_token(st, w, actor, *now_ms, token_id),
        Command::Grant { actor, now_ms, grant } => add_grant(st, w, actor, *now_ms, grant),
        Command::RevokeGrant { actor, now_ms, grant } => revoke_grant(st, w, actor, *now_ms, grant),
        Command::Restore { actor, now_ms, snapshot } => restore(st, w, actor, *now_ms, snapshot),
        Command::Admit { actor, now_ms, lease_id, project, resources, edge, keep_existing, egress } => {
            admit(st, w, actor, *now_ms, lease_id, project, resources, edge, *keep_existing, egress, "")
        }
        Command::AdmitClaim { actor, now_ms, lease_id, project, resources, edge, keep_existing, egress, pool } => {
            admit(st, w, actor, *now_ms, lease_id, project, resources, edge, *keep_existing, egress, pool)
        }
        Command::AdmitMember { now_ms, edge, lease_id, project, pool, resources } => {
            leases::admit_member(st, w, *now_ms, edge, lease_id, project, pool, resources)
        }
        Command::SetEgressCeiling { actor, now_ms, path, ceiling } => {
            set_egress_ceiling(st, w, actor, *now_ms, path, ceiling.as_deref())
        }
        Command::ReleaseLeases { now_ms: _, lease_ids, edge } => release_leases(st, w, lease_ids, edge),
        // Only a legacy entry may go without a holder: a fenced one without is no fence.
        Command::FencedReconcile { holder, .. } | Command::FencedSweep { holder, .. } if holder.is_empty() => {
            Err(IamError::InvalidArgument("a fenced reconciliation names the reconcile lock's holder".into()))
        }
        Command::Reconcile { now_ms, edge, live, min_age_ms, holder, read_at_ms }
        | Command::FencedReconcile { now_ms, edge, live, min_age_ms, holder, read_at_ms } => {
            reconcile_lock_held(st, holder, *now_ms)?;
            // A list is never read later than it is applied.
            let read_at = if *read_at_ms == 0 { *now_ms } else { (*read_at_ms).min(*now_ms) };
            reconcile(st, w, (*now_ms, read_at), edge, live, *min_age_ms)
        }
        Command::PutPool { actor, now_ms, pool, create } => put_pool(st, w, actor, *now_ms, pool, *create),
        Command::DeletePool { actor, now_ms, project, name } => delete_pool(st, w, actor, *now_ms, project, name),
        Command::SweepUnbound { now_ms, known_edges, older_than_ms, holder }
        | Command::FencedSweep { now_ms, known_edges, older_than_ms, holder } => {
            reconcile_lock_held(st, holder, *now_ms)?;
            sweep_unbound(st, w, *now_ms, known_edges, *older_than_ms)
        }
        Command::AcquireLock { now_ms, name, holder, ttl_ms } => acquire_lock(st, w, *now_ms, name, holder, *ttl_ms),
        Command::MintSandboxTokens { actor, now_ms, lease_id, tokens } => {
            mint_sandbox_tokens(st, w, actor, *now_ms, lease_id, tokens)
        }
        Command::ChargeImage { now_ms: _, charge } => images::charge_image(st, w, charge),
        Command::UnchargeImage { now_ms: _, project, name } => images::uncharge_image(st, w, project, name),
    }
}

/// A cluster bootstrapped before cluster ids gets one; one that has one keeps it.
fn set_cluster(st: &mut State, w: &mut Vec<Write>, cluster: &str) -> Result<Output, IamError> {
    if !crate::model::well_formed_id(cluster) {
        return Err(IamError::InvalidArgument("a cluster id is 32 hex digits".into()));
    }
    if st.meta.cluster.is_empty() {
        st.meta.cluster = cluster.to_string();
        w.push(Write::Put(Row::Meta(st.meta.clone())));
    }
    Ok(Output::Done)
}

/// The first data directory id member `id` answered with is its own for good.
fn member_seen(st: &mut State, w: &mut Vec<Write>, id: u64, data_dir: &str) -> Result<Output, IamError> {
    if id == 0 || !crate::model::well_formed_id(data_dir) {
        return Err(IamError::InvalidArgument(format!("member {id}: a data directory id is 32 hex digits")));
    }
    if st.meta.members.contains_key(&id) {
        return Ok(Output::Done);
    }
    st.meta.members.insert(id, data_dir.to_string());
    w.push(Write::Put(Row::Meta(st.meta.clone())));
    Ok(Output::Done)
}

#[allow(clippy::too_many_arguments)]
fn bootstrap(
    st: &mut State,
    w: &mut Vec<Write>,
    now_ms: i64,
    hash_key: &str,
    admin: &str,
    token_id: &str,
    token_hash: &str,
    cluster: &str,
) -> Result<Output, IamError> {
    if st.meta.bootstrapped {
        return Err(IamError::InvalidState("iam is already bootstrapped".into()));
    }
    ids::validate_principal(admin).map_err(IamError::invalid)?;
    if !token::valid_id(token_id) {
        return Err(IamError::AdminToken("its id is not [a-z0-9]{1,32}"));
    }
    if !token::is_hex32(hash_key) || !token::is_hex32(token_hash) {
        return Err(IamError::InvalidArgument("bootstrap needs 32-byte hex hash key and token hash".into()));
    }
    if !cluster.is_empty() && !crate::model::well_formed_id(cluster) {
        return Err(IamError::InvalidArgument("a cluster id is 32 hex digits".into()));
    }
    st.meta = Meta {
        bootstrapped: true,
        epoch: 1,
        hash_key: hash_key.to_string(),
        applied_index: st.meta.applied_index,
        cluster: cluster.to_string(),
        members: std::mem::take(&mut st.meta.members),
    };
    st.hash_key = token::from_hex(hash_key).unwrap_or_default();
    let root = ProjectRecord {
        path: ROOT_PROJECT.into(),
        quota: Quota::default(),
        created_at_ms: now_ms,
        egress_ceiling: None,
    };
    let principal = PrincipalRecord { name: admin.into(), project: ROOT_PROJECT.into(), created_at_ms: now_ms };
    let g = GrantRecord { principal: admin.into(), project: ROOT_PROJECT.into(), permission: "*".into() };
    let t = TokenRecord {
        id: token_id.into(),
        principal: admin.into(),
        secret_hash: token_hash.into(),
        description: "admin token from the config".into(),
        created_at_ms: now_ms,
        expires_at_ms: 0,
        revoked: false,
        scope: None,
    };
    st.projects.insert(root.path.clone(), root.clone());
    st.usage.insert(root.path.clone(), Usage::default());
    st.principals.insert(admin.into(), principal.clone());
    st.grants.entry(admin.into()).or_default().insert((g.project.clone(), g.permission.clone()));
    st.tokens.insert(t.id.clone(), t.clone());
    st.tokens_by_principal.entry(admin.into()).or_default().insert(t.id.clone());
    w.extend([
        Write::Put(Row::Meta(st.meta.clone())),
        Write::Put(Row::Project(root)),
        Write::Put(Row::Principal(principal)),
        Write::Put(Row::Grant(g)),
        Write::Put(Row::Token(t)),
    ]);
    Ok(Output::Done)
}

fn create_project(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    path: &str,
    quota: &Quota,
) -> Result<Output, IamError> {
    ids::validate_project(path).map_err(IamError::invalid)?;
    quota.validate()?;
    st.require_manage(actor, now_ms, path)?;
    if st.projects.contains_key(path) {
        return Err(IamError::AlreadyExists { kind: "project", name: path.into() });
    }
    let (_, parent) = State::manage_rule(path);
    if !st.projects.contains_key(parent) {
        return Err(IamError::NotFound { kind: "parent project", name: parent.into() });
    }
    let rec = ProjectRecord { path: path.into(), quota: *quota, created_at_ms: now_ms, egress_ceiling: None };
    st.projects.insert(path.into(), rec.clone());
    st.usage.insert(path.into(), Usage::default());
    w.push(Write::Put(Row::Project(rec)));
    Ok(Output::Project(st.view(path).expect("project just inserted")))
}

fn set_quota(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    path: &str,
    quota: &Quota,
) -> Result<Output, IamError> {
    ids::validate_project(path).map_err(IamError::invalid)?;
    quota.validate()?;
    st.require_manage(actor, now_ms, path)?;
    let Some(rec) = st.projects.get_mut(path) else {
        return Err(IamError::NotFound { kind: "project", name: path.into() });
    };
    rec.quota = *quota;
    w.push(Write::Put(Row::Project(rec.clone())));
    Ok(Output::Project(st.view(path).expect("project exists")))
}

fn set_egress_ceiling(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    path: &str,
    ceiling: Option<&[String]>,
) -> Result<Output, IamError> {
    ids::validate_project(path).map_err(IamError::invalid)?;
    let ceiling = match ceiling {
        Some(rules) => Some(egress_rules(rules)?.iter().map(|r| r.to_string()).collect::<Vec<_>>()),
        None => None,
    };
    st.require_manage(actor, now_ms, path)?;
    let Some(rec) = st.projects.get_mut(path) else {
        return Err(IamError::NotFound { kind: "project", name: path.into() });
    };
    rec.egress_ceiling = ceiling;
    w.push(Write::Put(Row::Project(rec.clone())));
    Ok(Output::Project(st.view(path).expect("project exists")))
}

/// Parses egress rules in text form (commands carry them checked; a bad one is refused).
pub(crate) fn egress_rules(rules: &[String]) -> Result<Vec<opendsec_common::egress::Rule>, IamError> {
    if rules.len() > opendsec_common::egress::MAX_RULES {
        return Err(IamError::InvalidArgument(format!("at most {} egress rules", opendsec_common::egress::MAX_RULES)));
    }
    rules
        .iter()
        .map(|t| opendsec_common::egress::Rule::parse(t).map_err(|e| IamError::InvalidArgument(e.to_string())))
        .collect()
}

impl State {
    /// Checks `rules` against the egress ceiling of `project` and of every ancestor that has
    /// one: each rule must lie within one rule of each ceiling.
    pub fn check_egress(&self, project: &str, rules: &[String]) -> Result<(), IamError> {
        if rules.is_empty() {
            return Ok(());
        }
        let asked = egress_rules(rules)?;
        let mut path = String::new();
        for seg in project.split('/') {
            if !path.is_empty() {
                path.push('/');
            }
            path.push_str(seg);
            let Some(ceiling) = self.projects.get(&path).and_then(|p| p.egress_ceiling.as_ref()) else { continue };
            let ceiling = egress_rules(ceiling)?;
            if let Some(r) = opendsec_common::egress::first_outside(&asked, &ceiling) {
                return Err(IamError::EgressCeiling { project: path, rule: r.to_string() });
            }
        }
        Ok(())
    }
}

fn delete_project(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    path: &str,
) -> Result<Output, IamError> {
    ids::validate_project(path).map_err(IamError::invalid)?;
    if path == ROOT_PROJECT {
        return Err(IamError::InvalidArgument("the root project cannot be deleted".into()));
    }
    st.require_manage(actor, now_ms, path)?;
    if !st.projects.contains_key(path) {
        return Err(IamError::NotFound { kind: "project", name: path.into() });
    }
    let prefix = format!("{path}/");
    if let Some((child, _)) = st.projects.range(prefix.clone()..).next()
        && child.starts_with(&prefix)
    {
        return Err(IamError::InvalidState(format!("project {path} still has subproject {child}")));
    }
    if let Some(p) = st.principals.values().find(|p| p.project == path) {
        return Err(IamError::InvalidState(format!("project {path} still has principal {}", p.name)));
    }
    let held = st.usage.get(path).map_or(0, |u| u.sandboxes);
    if held > 0 {
        return Err(IamError::InvalidState(format!("project {path} still holds {held} leases")));
    }
    if let Some(p) = st.pools.values().find(|p| p.project == path) {
        return Err(IamError::InvalidState(format!("project {path} still has pool {}", p.name)));
    }
    if st.has_images(path) {
        return Err(IamError::InvalidState(format!("project {path} still has images in the store")));
    }
    st.projects.remove(path);
    st.usage.remove(path);
    w.push(Write::Delete { table: Table::Projects, key: path.into() });
    // Grants on the project go with it, so a project later created under the same name does
    // not inherit them; that takes access away, hence the epoch.
    let mut removed = Vec::new();
    for (principal, set) in st.grants.iter_mut() {
        set.retain(|(gp, perm)| {
            let keep = gp != path;
            if !keep {
                removed.push(GrantRecord {
                    principal: principal.clone(),
                    project: gp.clone(),
                    permission: perm.clone(),
                });
            }
            keep
        });
    }
    st.grants.retain(|_, set| !set.is_empty());
    for g in removed {
        w.push(Write::Delete { table: Table::Grants, key: g.key() });
    }
    st.bump_epoch(w, [Revoked::Project(path.into())]);
    Ok(Output::Done)
}

fn create_principal(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    name: &str,
    project: &str,
) -> Result<Output, IamError> {
    ids::validate_principal(name).map_err(IamError::invalid)?;
    ids::validate_project(project).map_err(IamError::invalid)?;
    st.check_actor(actor, now_ms)?;
    st.require(&actor.principal, "principal.manage", project, || format!("project {project}"))?;
    if !st.projects.contains_key(project) {
        return Err(IamError::NotFound { kind: "project", name: project.into() });
    }
    if st.principals.contains_key(name) {
        return Err(IamError::AlreadyExists { kind: "principal", name: name.into() });
    }
    let rec = PrincipalRecord { name: name.into(), project: project.into(), created_at_ms: now_ms };
    st.principals.insert(name.into(), rec.clone());
    w.push(Write::Put(Row::Principal(rec.clone())));
    Ok(Output::Principal(rec))
}

fn delete_principal(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    name: &str,
) -> Result<Output, IamError> {
    ids::validate_principal(name).map_err(IamError::invalid)?;
    st.check_actor(actor, now_ms)?;
    if st.require_identity(&actor.principal, name)?.is_none() {
        return Err(IamError::NotFound { kind: "principal", name: name.into() });
    }
    st.principals.remove(name);
    w.push(Write::Delete { table: Table::Principals, key: name.into() });
    for id in st.tokens_by_principal.remove(name).unwrap_or_default() {
        st.tokens.remove(&id);
        w.push(Write::Delete { table: Table::Tokens, key: id });
    }
    for (project, permission) in st.grants.remove(name).unwrap_or_default() {
        let g = GrantRecord { principal: name.into(), project, permission };
        w.push(Write::Delete { table: Table::Grants, key: g.key() });
    }
    st.bump_epoch(w, [Revoked::Principal(name.into())]);
    Ok(Output::Done)
}

#[allow(clippy::too_many_arguments)]
fn create_token(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    principal: &str,
    token_id: &str,
    secret_hash: &str,
    expires_at_ms: i64,
    description: &str,
) -> Result<Output, IamError> {
    ids::validate_principal(principal).map_err(IamError::invalid)?;
    if !token::valid_id(token_id) || !token::is_hex32(secret_hash) {
        return Err(IamError::InvalidArgument("malformed token id or secret hash".into()));
    }
    if expires_at_ms != 0 && expires_at_ms <= now_ms {
        return Err(IamError::InvalidArgument("token would expire before it is created".into()));
    }
    if description.len() > MAX_DESCRIPTION_LEN || description.chars().any(char::is_control) {
        return Err(IamError::InvalidArgument(format!(
            "description must be at most {MAX_DESCRIPTION_LEN} bytes without control characters"
        )));
    }
    st.check_actor(actor, now_ms)?;
    if principal != actor.principal && st.require_identity(&actor.principal, principal)?.is_none() {
        return Err(IamError::NotFound { kind: "principal", name: principal.into() });
    }
    if st.tokens.contains_key(token_id) {
        return Err(IamError::AlreadyExists { kind: "token", name: token_id.into() });
    }
    let live = st.tokens_by_principal.get(principal).map_or(0, |ids| {
        ids.iter().filter(|id| st.tokens.get(*id).is_some_and(|t| !t.revoked && t.scope.is_none())).count()
    });
    if live >= MAX_TOKENS_PER_PRINCIPAL {
        return Err(IamError::InvalidState(format!(
            "principal {principal} already holds {live} tokens; revoke some first"
        )));
    }
    let t = TokenRecord {
        id: token_id.into(),
        principal: principal.into(),
        secret_hash: secret_hash.into(),
        description: description.into(),
        created_at_ms: now_ms,
        expires_at_ms,
        revoked: false,
        scope: None,
    };
    st.tokens.insert(t.id.clone(), t.clone());
    st.tokens_by_principal.entry(principal.into()).or_default().insert(t.id.clone());
    w.push(Write::Put(Row::Token(t.clone())));
    Ok(Output::Token(t))
}

/// Mints the tokens of one sandbox for the actor's principal (`tokens`: kind, id and secret
/// hash of each, made by the proposer), or finds the ones it minted before: the actor needs
/// `sandbox.operate` on the lease's project. Each token acts as the principal on that sandbox
/// only, and ends with its lease ([`State::release_lease`]).
fn mint_sandbox_tokens(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    lease_id: &str,
    tokens: &[MintedToken],
) -> Result<Output, IamError> {
    ids::validate_lease(lease_id).map_err(IamError::invalid)?;
    st.check_actor(actor, now_ms)?;
    let lease = st.leases.get(lease_id).ok_or_else(|| IamError::NotFound { kind: "sandbox", name: lease_id.into() })?;
    let project = lease.project.clone();
    // A caller who may not operate sandboxes there learns nothing of the lease either.
    if !st.holds(&actor.principal, "sandbox.operate", &project) {
        return Err(IamError::NotFound { kind: "sandbox", name: lease_id.into() });
    }
    if let Some(found) = st.sandbox_tokens(lease_id, actor) {
        return Ok(Output::SandboxTokens(found));
    }
    // They live no longer than the token they are minted with.
    let expires_at_ms = st.tokens.get(&actor.token_id).map_or(0, |t| t.expires_at_ms);
    let mut minted = Vec::new();
    for kind in ScopeKind::ALL {
        let m = tokens
            .iter()
            .find(|m| m.kind == kind)
            .ok_or_else(|| IamError::InvalidArgument(format!("a {kind:?} token is missing from the command")))?;
        if !token::valid_id(&m.token_id) || !token::is_hex32(&m.secret_hash) {
            return Err(IamError::InvalidArgument("malformed token id or hash".into()));
        }
        if st.tokens.contains_key(&m.token_id) {
            return Err(IamError::AlreadyExists { kind: "token", name: m.token_id.clone() });
        }
        minted.push(m);
    }
    let mut found = BTreeMap::new();
    for m in minted {
        let t = TokenRecord {
            id: m.token_id.clone(),
            principal: actor.principal.clone(),
            secret_hash: m.secret_hash.clone(),
            description: format!("sandbox {lease_id} ({})", m.kind.name()),
            created_at_ms: now_ms,
            expires_at_ms,
            revoked: false,
            scope: Some(TokenScope { lease: lease_id.into(), kind: m.kind, parent: actor.token_id.clone() }),
        };
        st.tokens.insert(t.id.clone(), t.clone());
        st.tokens_by_principal.entry(t.principal.clone()).or_default().insert(t.id.clone());
        st.tokens_by_lease.entry(lease_id.into()).or_default().insert(t.id.clone());
        w.push(Write::Put(Row::Token(t.clone())));
        found.insert(m.kind, t.id);
    }
    Ok(Output::SandboxTokens(found))
}

fn revoke_token(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    token_id: &str,
) -> Result<Output, IamError> {
    if !token::valid_id(token_id) {
        return Err(IamError::InvalidArgument("malformed token id".into()));
    }
    st.check_actor(actor, now_ms)?;
    let owner = st.tokens.get(token_id).map(|t| t.principal.clone());
    match &owner {
        Some(p) if *p == actor.principal => {}
        Some(p) => {
            let on = st.principals.get(p).map_or(ROOT_PROJECT, |r| r.project.as_str());
            st.require(&actor.principal, "principal.manage", on, || format!("token {token_id}"))?;
        }
        None => {
            st.require(&actor.principal, "principal.manage", ROOT_PROJECT, || format!("token {token_id}"))?;
            return Err(IamError::NotFound { kind: "token", name: token_id.into() });
        }
    }
    let t = st.tokens.get_mut(token_id).expect("token looked up above");
    if t.revoked {
        return Ok(Output::Done);
    }
    t.revoked = true;
    w.push(Write::Put(Row::Token(t.clone())));
    // The sandbox tokens minted with it stop with it (authentication checks the parent).
    let owner = t.principal.clone();
    let children: Vec<Revoked> = st
        .tokens_by_principal
        .get(&owner)
        .into_iter()
        .flatten()
        .filter(|id| st.tokens.get(*id).and_then(|c| c.scope.as_ref()).is_some_and(|s| s.parent == token_id))
        .map(|id| Revoked::Token(id.clone()))
        .collect();
    st.bump_epoch(w, std::iter::once(Revoked::Token(token_id.into())).chain(children));
    Ok(Output::Done)
}

/// Checks shared by Grant and RevokeGrant: valid names, a known permission, `grant.manage` on
/// the project, and the caller holding the permission itself (bounded delegation).
fn check_grant_change(st: &State, actor: &Actor, now_ms: i64, g: &GrantRecord) -> Result<(), IamError> {
    ids::validate_principal(&g.principal).map_err(IamError::invalid)?;
    ids::validate_project(&g.project).map_err(IamError::invalid)?;
    validate_permission(&g.permission)?;
    st.check_actor(actor, now_ms)?;
    st.require(&actor.principal, "grant.manage", &g.project, || format!("project {}", g.project))?;
    st.require(&actor.principal, &g.permission, &g.project, || format!("project {}", g.project))?;
    Ok(())
}

fn add_grant(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    g: &GrantRecord,
) -> Result<Output, IamError> {
    check_grant_change(st, actor, now_ms, g)?;
    if !st.projects.contains_key(&g.project) {
        return Err(IamError::NotFound { kind: "project", name: g.project.clone() });
    }
    if !st.principals.contains_key(&g.principal) {
        return Err(IamError::NotFound { kind: "principal", name: g.principal.clone() });
    }
    // Granting what is already granted is a no-op, so retries are harmless.
    if st.grants.entry(g.principal.clone()).or_default().insert((g.project.clone(), g.permission.clone())) {
        w.push(Write::Put(Row::Grant(g.clone())));
    }
    Ok(Output::Done)
}

fn revoke_grant(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    g: &GrantRecord,
) -> Result<Output, IamError> {
    check_grant_change(st, actor, now_ms, g)?;
    if !st.has_grant(g) {
        return Err(IamError::NotFound { kind: "grant", name: g.key() });
    }
    if let Some(set) = st.grants.get_mut(&g.principal) {
        set.remove(&(g.project.clone(), g.permission.clone()));
        if set.is_empty() {
            st.grants.remove(&g.principal);
        }
    }
    w.push(Write::Delete { table: Table::Grants, key: g.key() });
    st.bump_epoch(w, [Revoked::Principal(g.principal.clone())]);
    Ok(Output::Done)
}

/// Creates or replaces a pool: `pool.manage` on its project, which must exist; its template is
/// kept in canonical form (its revision is derived from it).
fn put_pool(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    pool: &PoolRecord,
    create: bool,
) -> Result<Output, IamError> {
    ids::validate_project(&pool.project).map_err(IamError::invalid)?;
    st.check_actor(actor, now_ms)?;
    st.require(&actor.principal, "pool.manage", &pool.project, || format!("project {}", pool.project))?;
    crate::model::validate_pool(pool)?;
    if !st.projects.contains_key(&pool.project) {
        return Err(IamError::NotFound { kind: "project", name: pool.project.clone() });
    }
    check_pool_quota(st, pool)?;
    let key = pool.key();
    let mut rec = pool.clone();
    rec.template = pool.template.canonical();
    match (st.pools.get(&key), create) {
        (Some(_), true) => return Err(IamError::AlreadyExists { kind: "pool", name: key }),
        (None, false) => return Err(IamError::NotFound { kind: "pool", name: key }),
        (Some(old), false) => {
            rec.created_at_ms = old.created_at_ms;
            rec.updated_at_ms = now_ms;
        }
        (None, true) => {
            rec.created_at_ms = now_ms;
            rec.updated_at_ms = now_ms;
        }
    }
    st.pools.insert(key, rec.clone());
    w.push(Write::Put(Row::Pool(Box::new(rec.clone()))));
    Ok(Output::Pool(rec))
}

/// The pool quota: what a project's pools keep idle on one edge (each one's size times its
/// template, summed over the project's pools and its subprojects') must fit in the quota of
/// the project and of every ancestor that sets one. Idle members are the
/// operator's cost, not charged as leases; a claimed member is charged like any sandbox.
fn check_pool_quota(st: &State, pool: &PoolRecord) -> Result<(), IamError> {
    let held = |p: &PoolRecord| {
        let (t, n) = (&p.template, u64::from(p.size_per_edge));
        [u64::from(t.cpu_millis).saturating_mul(n), t.memory_mb.saturating_mul(n), t.disk_mb.saturating_mul(n), 0, n]
    };
    let want = held(pool);
    let key = pool.key();
    for project in ids::project_chain(&pool.project) {
        let Some(p) = st.projects.get(project) else { continue };
        if p.quota.values().iter().all(Option::is_none) {
            continue;
        }
        // Every other pool of this project and its subprojects counts too: one tenant's pools
        // together never hold more per edge than its quota.
        let mut others = [0u64; 5];
        for o in st.pools_within(project).filter(|o| o.key() != key) {
            for (sum, v) in others.iter_mut().zip(held(o)) {
                *sum = sum.saturating_add(v);
            }
        }
        let keys = crate::model::QUOTA_KEYS.iter().zip(p.quota.values()).zip(want).zip(others);
        for (((k, limit), want), used) in keys {
            if let Some(limit) = limit
                && used.saturating_add(want) > limit
            {
                return Err(IamError::QuotaExceeded {
                    project: project.to_string(),
                    key: k,
                    limit,
                    used,
                    requested: want,
                });
            }
        }
    }
    Ok(())
}

fn delete_pool(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    project: &str,
    name: &str,
) -> Result<Output, IamError> {
    ids::validate_project(project).map_err(IamError::invalid)?;
    st.check_actor(actor, now_ms)?;
    st.require(&actor.principal, "pool.manage", project, || format!("project {project}"))?;
    let key = crate::model::pool_key(project, name);
    if st.pools.remove(&key).is_none() {
        return Err(IamError::NotFound { kind: "pool", name: key });
    }
    w.push(Write::Delete { table: Table::Pools, key });
    Ok(Output::Done)
}

fn restore(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    snap: &Snapshot,
) -> Result<Output, IamError> {
    st.check_actor(actor, now_ms)?;
    st.require(&actor.principal, "iam.admin", ROOT_PROJECT, || format!("project {ROOT_PROJECT}"))?;
    snap.validate()?;
    // Everything the backup covers is replaced: delete the old rows, put the new ones (the
    // store applies writes in order, so a row in both ends up put).
    for p in st.projects.keys() {
        w.push(Write::Delete { table: Table::Projects, key: p.clone() });
    }
    for p in st.principals.keys() {
        w.push(Write::Delete { table: Table::Principals, key: p.clone() });
    }
    for t in st.tokens.keys() {
        w.push(Write::Delete { table: Table::Tokens, key: t.clone() });
    }
    for g in st.grant_records() {
        w.push(Write::Delete { table: Table::Grants, key: g.key() });
    }
    st.projects = snap.projects.iter().map(|p| (p.path.clone(), p.clone())).collect();
    st.principals = snap.principals.iter().map(|p| (p.name.clone(), p.clone())).collect();
    // A backup holds no leases, so no sandbox's tokens either (one made by a release that
    // had them is cut here).
    let tokens: Vec<&TokenRecord> = snap.tokens.iter().filter(|t| t.scope.is_none()).collect();
    st.tokens = tokens.iter().map(|t| (t.id.clone(), (*t).clone())).collect();
    st.grants.clear();
    for g in &snap.grants {
        st.grants.entry(g.principal.clone()).or_default().insert((g.project.clone(), g.permission.clone()));
    }
    w.extend(snap.projects.iter().cloned().map(|r| Write::Put(Row::Project(r))));
    w.extend(snap.principals.iter().cloned().map(|r| Write::Put(Row::Principal(r))));
    w.extend(tokens.into_iter().cloned().map(|r| Write::Put(Row::Token(r))));
    w.extend(snap.grants.iter().cloned().map(|r| Write::Put(Row::Grant(r))));
    // Leases are kept (reconciliation owns them) except those whose project the backup does
    // not have: every lease's project must exist.
    let mut orphans: Vec<String> =
        st.leases.values().filter(|l| !st.projects.contains_key(&l.project)).map(|l| l.id.clone()).collect();
    orphans.sort();
    for id in orphans {
        st.leases.remove(&id);
        w.push(Write::Delete { table: Table::Leases, key: id });
    }
    // Image charges follow the store, not the backup: kept, except those whose project the
    // backup does not have.
    let orphans: Vec<String> =
        st.images.values().filter(|c| !st.projects.contains_key(&c.project)).map(|c| c.key()).collect();
    for key in orphans {
        st.images.remove(&key);
        w.push(Write::Delete { table: Table::Images, key });
    }
    // Pools: replaced by the backup's; a backup from before pools keeps those there are,
    // except those whose project it does not have. Templates are kept canonical.
    let gone: Vec<String> = match &snap.pools {
        Some(_) => st.pools.keys().cloned().collect(),
        None => st.pools.values().filter(|p| !st.projects.contains_key(&p.project)).map(|p| p.key()).collect(),
    };
    for key in gone {
        st.pools.remove(&key);
        w.push(Write::Delete { table: Table::Pools, key });
    }
    for p in snap.pools.iter().flatten() {
        let mut rec = p.clone();
        rec.template = p.template.canonical();
        st.pools.insert(rec.key(), rec.clone());
        w.push(Write::Put(Row::Pool(Box::new(rec))));
    }
    st.meta.hash_key = snap.hash_key.clone();
    st.meta.epoch = st.meta.epoch.max(snap.epoch) + 1;
    st.rebuild_derived();
    w.push(Write::Put(Row::Meta(st.meta.clone())));
    Ok(Output::Done)
}

pub(crate) fn validate_lock_part(what: &str, v: &str) -> Result<(), IamError> {
    if v.is_empty() || v.len() > MAX_LOCK_NAME_LEN || v.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(IamError::InvalidArgument(format!(
            "lock {what} must be 1..={MAX_LOCK_NAME_LEN} bytes without spaces or control characters"
        )));
    }
    Ok(())
}

/// Refuses a reconciliation unless `holder` holds the reconcile lock at `now_ms`: a watcher
/// that lost it (another took it over while this one's call was on its way) changes nothing.
/// An empty holder is a command logged before the check, applied as it was then (the server
/// refuses calls without one).
fn reconcile_lock_held(st: &State, holder: &str, now_ms: i64) -> Result<(), IamError> {
    if holder.is_empty() {
        return Ok(());
    }
    match st.locks.get(opendsec_common::RECONCILE_LOCK) {
        Some(l) if l.holder == holder && l.expires_at_ms > now_ms => Ok(()),
        _ => Err(IamError::InvalidState(format!(
            "{holder} does not hold the {} lock: reconciliation refused",
            opendsec_common::RECONCILE_LOCK
        ))),
    }
}

fn acquire_lock(
    st: &mut State,
    w: &mut Vec<Write>,
    now_ms: i64,
    name: &str,
    holder: &str,
    ttl_ms: i64,
) -> Result<Output, IamError> {
    validate_lock_part("name", name)?;
    validate_lock_part("holder", holder)?;
    if !(1..=MAX_LOCK_TTL_MS).contains(&ttl_ms) {
        return Err(IamError::InvalidArgument(format!("lock ttl_ms must be in 1..={MAX_LOCK_TTL_MS}")));
    }
    if let Some(cur) = st.locks.get(name)
        && cur.holder != holder
        && cur.expires_at_ms > now_ms
    {
        return Ok(Output::Lock { acquired: false, holder: cur.holder.clone(), expires_at_ms: cur.expires_at_ms });
    }
    let rec = LockRecord { name: name.into(), holder: holder.into(), expires_at_ms: now_ms.saturating_add(ttl_ms) };
    st.locks.insert(name.into(), rec.clone());
    w.push(Write::Put(Row::Lock(rec.clone())));
    Ok(Output::Lock { acquired: true, holder: rec.holder, expires_at_ms: rec.expires_at_ms })
}
