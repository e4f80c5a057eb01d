//! Leases and quotas: admitting a sandbox's lease (authorize, check the quota of the project
//! and every ancestor, bind it to an edge), releasing leases, reconciling an edge's live
//! leases with what IAM holds, and sweeping leases bound to no edge. Usage per project is
//! kept in step by the two helpers every change goes through (`insert_lease`,
//! `release_lease`).

use super::*;

impl State {
    // Lease helpers (mutating; callers have checked everything).

    pub(super) fn insert_lease(&mut self, l: LeaseRecord, w: &mut Vec<Write>) {
        let u = Usage::of(&l.resources);
        for q in project_chain(&l.project) {
            if let Some(x) = self.usage.get_mut(q) {
                x.add(&u);
            }
        }
        self.leases_by_edge.entry(l.edge.clone()).or_default().insert(l.id.clone());
        if !l.pool.is_empty() {
            self.members.entry((l.edge.clone(), l.pool.clone())).or_default().insert((l.bound_at_ms, l.id.clone()));
        }
        w.push(Write::Put(Row::Lease(l.clone())));
        self.leases.insert(l.id.clone(), l);
    }

    pub(super) fn release_lease(&mut self, id: &str, w: &mut Vec<Write>) -> bool {
        let Some(l) = self.leases.remove(id) else { return false };
        let u = Usage::of(&l.resources);
        for q in project_chain(&l.project) {
            if let Some(x) = self.usage.get_mut(q) {
                x.sub(&u);
            }
        }
        self.unindex_edge(&l.edge, id);
        if !l.pool.is_empty() {
            let k = (l.edge.clone(), l.pool.clone());
            if let Some(m) = self.members.get_mut(&k) {
                m.remove(&(l.bound_at_ms, id.to_string()));
                if m.is_empty() {
                    self.members.remove(&k);
                }
            }
        }
        w.push(Write::Delete { table: Table::Leases, key: id.to_string() });
        // The sandbox's tokens end with it ([`apply`] moves the epoch for them).
        for t in self.tokens_by_lease.remove(id).unwrap_or_default() {
            if let Some(rec) = self.tokens.remove(&t)
                && let Some(set) = self.tokens_by_principal.get_mut(&rec.principal)
            {
                set.remove(&t);
                if set.is_empty() {
                    self.tokens_by_principal.remove(&rec.principal);
                }
            }
            w.push(Write::Delete { table: Table::Tokens, key: t.clone() });
            self.ended_tokens.push(t);
        }
        true
    }

    pub(super) fn unindex_edge(&mut self, edge: &str, id: &str) {
        if let Some(set) = self.leases_by_edge.get_mut(edge) {
            set.remove(id);
            if set.is_empty() {
                self.leases_by_edge.remove(edge);
            }
        }
    }

    /// Whether `demand` fits under every limit set on the project and its ancestors. Keys the
    /// demand does not use are not checked, so a lowered limit on one key does not block
    /// sandboxes that do not ask for it.
    pub fn check_quota(&self, project: &str, demand: &Usage) -> Result<(), IamError> {
        for q in project_chain(project) {
            let Some(rec) = self.projects.get(q) else { continue };
            let used = self.usage.get(q).copied().unwrap_or_default();
            for (i, limit) in rec.quota.values().into_iter().enumerate() {
                let (u, d) = (used.values()[i], demand.values()[i]);
                if let Some(limit) = limit
                    && d > 0
                    && u.saturating_add(d) > limit
                {
                    return Err(IamError::QuotaExceeded {
                        project: q.to_string(),
                        key: QUOTA_KEYS[i],
                        limit,
                        used: u,
                        requested: d,
                    });
                }
            }
        }
        Ok(())
    }
}

/// Validation an Admit needs before anything is looked up (shared with the proposer, which
/// checks first to fail fast without a commit).
pub fn validate_admit(lease_id: &str, project: &str, resources: &Resources, edge: &str) -> Result<(), IamError> {
    ids::validate_lease(lease_id).map_err(IamError::invalid)?;
    ids::validate_project(project).map_err(IamError::invalid)?;
    ids::validate_edge(edge).map_err(IamError::invalid)?;
    resources.validate()
}

impl State {
    /// The part of an Admit that only reads: `sandbox.create` on the project, the project,
    /// and an existing lease of the same id. Answers `Some` when the Admit is complete without
    /// a change (the lease exists and `keep_existing` leaves it alone), `None` when it must be
    /// applied. Shared by the proposer (which answers from it without a commit) and `apply`.
    ///
    /// An existing lease must have the same project and resources (`invalid_argument`); with
    /// `keep_existing` it must also belong to the caller (`already_exists` otherwise, checked
    /// first so another principal learns nothing about it).
    pub fn admit_precheck(
        &self,
        principal: &str,
        lease_id: &str,
        project: &str,
        resources: &Resources,
        keep_existing: bool,
    ) -> Result<Option<Admission>, IamError> {
        self.require(principal, "sandbox.create", project, || format!("project {project}"))?;
        if !self.projects.contains_key(project) {
            return Err(IamError::NotFound { kind: "project", name: project.into() });
        }
        let Some(existing) = self.leases.get(lease_id) else { return Ok(None) };
        // A pool member's lease is its edge's: no creation takes it over by its id.
        if !existing.pool.is_empty() {
            return Err(IamError::AlreadyExists { kind: "lease", name: lease_id.into() });
        }
        if keep_existing && existing.principal != principal {
            return Err(IamError::AlreadyExists { kind: "lease", name: lease_id.into() });
        }
        if existing.project != project || existing.resources != *resources {
            return Err(IamError::InvalidArgument(format!(
                "lease {lease_id} already exists with a different project or resources"
            )));
        }
        if !keep_existing {
            return Ok(None);
        }
        Ok(Some(Admission {
            principal: existing.principal.clone(),
            rebound: false,
            existing: true,
            edge: existing.edge.clone(),
            bound_at_ms: existing.bound_at_ms,
            member_lease: String::new(),
        }))
    }
}

#[allow(clippy::too_many_arguments)]
pub(super) fn admit(
    st: &mut State,
    w: &mut Vec<Write>,
    actor: &Actor,
    now_ms: i64,
    lease_id: &str,
    project: &str,
    resources: &Resources,
    edge: &str,
    keep_existing: bool,
    egress: &[String],
    pool: &str,
) -> Result<Output, IamError> {
    validate_admit(lease_id, project, resources, edge)?;
    st.check_actor(actor, now_ms)?;
    st.check_egress(project, egress)?;
    if let Some(kept) = st.admit_precheck(&actor.principal, lease_id, project, resources, keep_existing)? {
        return Ok(Output::Admitted(kept));
    }
    if let Some(existing) = st.leases.get(lease_id) {
        // Same lease again: only rebind (a retry on another edge); quota is already held.
        let old_edge = existing.edge.clone();
        let principal = existing.principal.clone();
        st.unindex_edge(&old_edge, lease_id);
        st.leases_by_edge.entry(edge.into()).or_default().insert(lease_id.into());
        let l = st.leases.get_mut(lease_id).expect("lease looked up above");
        l.edge = edge.into();
        l.bound_at_ms = now_ms;
        w.push(Write::Put(Row::Lease(l.clone())));
        return Ok(Output::Admitted(Admission {
            principal,
            rebound: true,
            existing: false,
            edge: edge.into(),
            bound_at_ms: now_ms,
            member_lease: String::new(),
        }));
    }
    // A claim of a pool member: the sandbox's lease takes over the charge of one idle
    // member's lease of that pool on that edge (the oldest of the same project and
    // resources), so that a pool sized to the whole quota can still be claimed. The swap
    // changes no usage, so it is not checked against the quota: a project over it (a quota
    // lowered) still claims, and drains as its members go.
    let member = st.members.get(&(edge.to_string(), pool.to_string())).and_then(|m| {
        m.iter()
            .map(|(_, id)| id)
            .find(|id| st.leases.get(*id).is_some_and(|l| l.project == project && l.resources == *resources))
            .cloned()
    });
    match &member {
        Some(id) => {
            st.release_lease(id, w);
        }
        None => st.check_quota(project, &Usage::of(resources))?,
    }
    st.insert_lease(
        LeaseRecord {
            id: lease_id.into(),
            project: project.into(),
            principal: actor.principal.clone(),
            edge: edge.into(),
            resources: *resources,
            created_at_ms: now_ms,
            bound_at_ms: now_ms,
            pool: String::new(),
        },
        w,
    );
    Ok(Output::Admitted(Admission {
        principal: actor.principal.clone(),
        rebound: false,
        existing: false,
        edge: edge.into(),
        bound_at_ms: now_ms,
        member_lease: member.unwrap_or_default(),
    }))
}

/// An edge starting an idle member of pool `pool` (`<project>//<name>`): its lease, charged
/// to the pool's project like a sandbox's (quota_exceeded past a limit), bound to the edge.
/// Admitting the same member again on the same edge changes nothing.
#[allow(clippy::too_many_arguments)]
pub(super) fn admit_member(
    st: &mut State,
    w: &mut Vec<Write>,
    now_ms: i64,
    edge: &str,
    lease_id: &str,
    project: &str,
    pool: &str,
    resources: &Resources,
) -> Result<Output, IamError> {
    ids::validate_lease(lease_id).map_err(IamError::invalid)?;
    ids::validate_edge(edge).map_err(IamError::invalid)?;
    resources.validate()?;
    let key = crate::model::pool_key(project, pool);
    let Some(p) = st.pool(project, pool) else {
        return Err(IamError::NotFound { kind: "pool", name: key });
    };
    // A member is started from the template: other resources are not a member's (an edge
    // cannot charge a project for what its pool would never start).
    let t = &p.template;
    let want = Resources { cpu_millis: t.cpu_millis.into(), memory_mb: t.memory_mb, disk_mb: t.disk_mb, gpus: 0 };
    if *resources != want {
        return Err(IamError::InvalidArgument(format!(
            "a member of pool {key} has its template's resources ({want:?}), not {resources:?}"
        )));
    }
    if let Some(l) = st.leases.get(lease_id) {
        return if l.edge == edge && l.pool == key {
            Ok(Output::Done)
        } else {
            Err(IamError::AlreadyExists { kind: "lease", name: lease_id.into() })
        };
    }
    st.check_quota(project, &Usage::of(resources))?;
    st.insert_lease(
        LeaseRecord {
            id: lease_id.into(),
            project: project.into(),
            principal: String::new(),
            edge: edge.into(),
            resources: *resources,
            created_at_ms: now_ms,
            bound_at_ms: now_ms,
            pool: key,
        },
        w,
    );
    Ok(Output::Done)
}

/// Releases the leases named (unknown ones are skipped); with an edge, only those bound to it.
pub(super) fn release_leases(
    st: &mut State,
    w: &mut Vec<Write>,
    lease_ids: &[String],
    edge: &str,
) -> Result<Output, IamError> {
    if !edge.is_empty() {
        ids::validate_edge(edge).map_err(IamError::invalid)?;
    }
    let mut released = 0u32;
    for id in lease_ids {
        let bound_there = edge.is_empty() || st.leases.get(id).is_some_and(|l| l.edge == edge);
        if bound_there && st.release_lease(id, w) {
            released += 1;
        }
    }
    Ok(Output::Released { released })
}

/// Whether a reported lease can be adopted: valid ids, an existing project, sane resources.
pub(super) fn adoptable(st: &State, l: &LiveLease) -> bool {
    ids::validate_lease(&l.lease_id).is_ok()
        && st.projects.contains_key(&l.project)
        && (l.principal.is_empty() || ids::validate_principal(&l.principal).is_ok())
        && l.resources.validate_bounds().is_ok()
}

/// `at` is (the apply time, when the edge's list was read). Ages are measured at the read: a
/// lease bound after it is not in the list and is never released by it, however late the
/// call is applied. Adopted leases are stamped with the apply time (a read time is the
/// caller's word; it must not make a lease look older than it is).
pub(super) fn reconcile(
    st: &mut State,
    w: &mut Vec<Write>,
    (now_ms, read_at_ms): (i64, i64),
    edge: &str,
    live: &[LiveLease],
    min_age_ms: i64,
) -> Result<Output, IamError> {
    ids::validate_edge(edge).map_err(IamError::invalid)?;
    if min_age_ms < 0 {
        return Err(IamError::InvalidArgument("reconcile min age is negative".into()));
    }
    let mut adopted = 0u32;
    for l in live {
        if st.leases.contains_key(&l.lease_id) || !adoptable(st, l) {
            // Known leases stay as they are, even when bound elsewhere: the apiserver may have
            // rebound them, and the other edge's reconciliation decides.
            continue;
        }
        // A pool member's lease is reported (so it is not released) but never adopted: a
        // member is optional, and adopting one skips the quota. The edge finds IAM does not
        // hold it and charges it again, quota checked (`AdmitMember`), or retires it.
        if !l.pool.is_empty() {
            continue;
        }
        // Adoption never fails on quota: the sandbox exists whether or not it fits.
        st.insert_lease(
            LeaseRecord {
                id: l.lease_id.clone(),
                project: l.project.clone(),
                principal: l.principal.clone(),
                edge: edge.into(),
                resources: l.resources,
                created_at_ms: now_ms,
                bound_at_ms: now_ms,
                pool: String::new(),
            },
            w,
        );
        adopted += 1;
    }
    let reported: HashSet<&str> = live.iter().map(|l| l.lease_id.as_str()).collect();
    let gone: Vec<String> = st
        .leases_by_edge
        .get(edge)
        .map(|ids| {
            ids.iter()
                .filter(|id| !reported.contains(id.as_str()))
                .filter(|id| st.leases.get(*id).is_some_and(|l| read_at_ms.saturating_sub(l.bound_at_ms) >= min_age_ms))
                .cloned()
                .collect()
        })
        .unwrap_or_default();
    let mut released = 0u32;
    for id in gone {
        if st.release_lease(&id, w) {
            released += 1;
        }
    }
    Ok(Output::Reconciled { adopted, released })
}

pub(super) fn sweep_unbound(
    st: &mut State,
    w: &mut Vec<Write>,
    now_ms: i64,
    known_edges: &[String],
    older_than_ms: i64,
) -> Result<Output, IamError> {
    if older_than_ms < 0 {
        return Err(IamError::InvalidArgument("older_than is negative".into()));
    }
    let known: HashSet<&str> = known_edges.iter().map(String::as_str).collect();
    let mut gone: Vec<String> = st
        .leases_by_edge
        .iter()
        .filter(|(edge, _)| !known.contains(edge.as_str()))
        .flat_map(|(_, ids)| ids.iter())
        .filter(|id| st.leases.get(*id).is_some_and(|l| now_ms.saturating_sub(l.bound_at_ms) >= older_than_ms))
        .cloned()
        .collect();
    // Sorted so the writes come out in the same order on every node.
    gone.sort();
    let mut released = 0u32;
    for id in gone {
        if st.release_lease(&id, w) {
            released += 1;
        }
    }
    Ok(Output::Released { released })
}
