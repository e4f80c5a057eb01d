//! Creating a sandbox: final admission, the record first, then the backend; a retry with the same
//! lease finds the first attempt's sandbox; a sandbox whose lease IAM bound elsewhere is stopped.

use super::*;

/// What the container of a sandbox that moved in is named after: `<edge>.mv-<lease>`.
pub(crate) const MOVED_IN_PREFIX: &str = "mv-";

impl Inner {
    /// Several creations, each made as [`Inner::create`] makes it, in a task of its own as
    /// its own call would be: they run (and their records are written) together, and a
    /// caller that goes away cuts none of them in half. `done` gets each item's index and
    /// answer as it finishes.
    pub(crate) fn create_many<F>(self: &Arc<Self>, items: Vec<EdgeCreateRequest>, done: F)
    where
        F: Fn(u32, Result<Sandbox, EdgeError>) + Send + Sync + 'static,
    {
        use futures::FutureExt;
        let done = Arc::new(done);
        for (index, item) in (0u32..).zip(items) {
            let (me, done) = (self.clone(), done.clone());
            tokio::spawn(async move {
                // A creation that panics is answered as its own call's task would be.
                let r = std::panic::AssertUnwindSafe(me.create(item)).catch_unwind().await.unwrap_or_else(|p| {
                    let message = p
                        .downcast_ref::<&str>()
                        .map(|s| s.to_string())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "panicked".into());
                    Err(EdgeError::TaskFailed { op: "create", message })
                });
                done(index, r)
            });
        }
    }

    pub(crate) async fn create(&self, req: EdgeCreateRequest) -> Result<Sandbox, EdgeError> {
        // IAM moved this member's charge to the creation's lease: it is not charged any more,
        // whatever becomes of this creation (charged again unless it is the one taken).
        if !req.member_lease.is_empty() {
            self.uncharge_named(&req.member_lease);
        }
        if self.closing.load(Ordering::Relaxed) {
            return Err(EdgeError::ShuttingDown { edge: self.name.clone() });
        }
        admission::validate_create(&req).map_err(EdgeError::InvalidArgument)?;
        let Some(spec) = req.spec.as_ref() else {
            return Err(EdgeError::InvalidArgument("spec is required".into()));
        };
        let lease = req.lease_id.as_str();
        if let Some(mv) = &req.moved_in {
            self.check_moved_in(mv, lease)?;
            if self.draining() {
                // Before the tombstone of an earlier move away is forgotten.
                return Err(EdgeError::NoCapacity { edge: self.name.clone(), detail: "the edge is draining".into() });
            }
            self.forget_tombstone(lease).await?;
        }

        // Idempotent per lease: a retry gets what the first attempt made (once it finished).
        if let Some(op) = self.op_lock(lease) {
            return self.existing(op, lease).await;
        }
        if self.draining() {
            // Not an error of the caller's: the apiserver places it elsewhere.
            return Err(EdgeError::NoCapacity { edge: self.name.clone(), detail: "the edge is draining".into() });
        }

        let backend = self.backend(&spec.backend).ok_or_else(|| EdgeError::NoCapacity {
            edge: self.name.clone(),
            detail: format!(
                "backend {} is not offered here (offered: {})",
                spec.backend,
                self.backend_names().join(", ")
            ),
        })?;
        // A creation naming a pool takes an idle member of the revision it names, if this
        // edge has one (it adds no load: no pressure check); else it is made cold (a miss).
        let take = || match (spec.pool.is_empty(), backend.warm()) {
            (_, None) => None,
            // A sandbox moving in brings its own file system; one restoring a session needs its
            // files under it before it starts.
            _ if req.moved_in.is_some() || spec.session.is_some() => None,
            (false, Some(_)) => self.claim_member(&spec.project, &spec.pool, &req.pool_revision, &req.member_lease),
            // `fncall` without a pool: a member of a pool with exactly this template, if any.
            (true, Some(_)) => self.claim_matching(spec),
        };
        let mut member = take();
        // A member whose agent went quiet is not handed out: it is stopped, the next one taken.
        while let Some(m) = member.as_ref().filter(|m| !self.member_alive(backend, m)) {
            tracing::warn!(member = %m.id, "a pool member's agent is gone; stopping it");
            self.discard_member_later(m.clone());
            member = take();
        }
        if let Some(m) = member {
            let r = self.create_claimed(req.clone(), backend.clone(), m).await;
            // Top the pool up now that the claim is answered.
            self.pool_wake.notify_one();
            return r;
        }
        if let Some(dim) = admission::pressure_refusal(&self.pressure()) {
            return Err(EdgeError::NoCapacity { edge: self.name.clone(), detail: format!("{dim} pressure") });
        }

        // The network slot is chosen here and recorded with the sandbox, before anything exists.
        let net = self.network.as_ref().filter(|_| backend.networked());
        let slot = match net {
            Some(n) => {
                n.reserve().map_err(|source| EdgeError::Network { id: ids::sandbox_id(&self.name, lease), source })?.0
            }
            None => 0,
        };
        let unreserve = || {
            if let Some(n) = net {
                n.unreserve(crate::netpol::Slot(slot));
            }
        };
        let mut rec = self.new_record(lease, &req.principal, SpecRecord::from_proto(spec), slot);
        if let Some(mv) = &req.moved_in {
            rec.id = mv.id.clone();
            rec.created_at_ms = mv.created_at_ms;
            rec.last_active_ms = rec.last_active_ms.max(mv.last_active_ms);
            rec.member = format!("{}.{MOVED_IN_PREFIX}{lease}", self.name);
            rec.moved.moved_from = mv.from_edge.clone();
            rec.moved.layers = mv.layers.clone();
            rec.moved.image_env = mv.image_env.clone();
        }
        let rec = Arc::new(rec);
        let op = OpLock::default();
        // Held until the creation is settled: a concurrent retry or stop waits for it.
        let guard = op.clone().lock_owned().await;
        let raced = {
            let mut t = self.table();
            match t.get(lease) {
                Some(e) => Some(e.op.clone()),
                None => {
                    // Capacity is checked and reserved in one critical section.
                    if let Err(r) =
                        admission::check_capacity(&self.capacity, &t.used().plus(self.pool_used()), rec.resources())
                    {
                        drop(t);
                        unreserve();
                        return Err(EdgeError::NoCapacity { edge: self.name.clone(), detail: r.to_string() });
                    }
                    t.insert(rec.clone(), op);
                    None
                }
            }
        };
        if let Some(op) = raced {
            drop(guard);
            unreserve();
            return self.existing(op, lease).await;
        }

        // The lease has no record here (a table entry would have been found above). The
        // intent of a plain creation is not synced on its own: the RUNNING record's sync below
        // makes it durable with it, and a crash before that leaves nothing the restart misses
        // (the backends and the network remove what no record claims, reconciliation frees the
        // lease, and the caller, never answered, retries). A sandbox moving in keeps the synced
        // intent: moves are rare and slow, and a restart must find one cut short.
        let mode = if rec.moved.moved_from.is_empty() { WriteMode::Lazy } else { WriteMode::DurableNew };
        if let Err(e) = self.persist(&rec, mode).await {
            self.table().remove(lease);
            self.activity.forget(lease);
            unreserve();
            return Err(e.into());
        }

        if let Err(source) = backend.create(&rec).await {
            tracing::debug!(sandbox_id = %rec.id, error = %source.report(), "creation failed");
            return Err(self.start_failed(&rec, backend, source, "create").await);
        }
        let running = self.settle_running(&rec, backend).await?;
        drop(guard);

        // Where IAM binds the lease is looked up in batches (see `release`).
        if self.remote.has_iam() {
            self.releases.push_check(lease.to_string());
        }
        Ok(self.to_proto(&running))
    }

    /// A creation that took pool member `member`: the sandbox's record (naming the member)
    /// first, then the backend makes the member the sandbox. A member that cannot become the
    /// sandbox is stopped, never returned to the pool (it may be half changed).
    async fn create_claimed(
        &self,
        req: EdgeCreateRequest,
        backend: Arc<dyn Backend>,
        member: Arc<SandboxRecord>,
    ) -> Result<Sandbox, EdgeError> {
        let spec = req.spec.as_ref().expect("checked by create");
        let lease = req.lease_id.as_str();
        let rec = Arc::new(SandboxRecord {
            member: member.id.clone(),
            pool: member.pool.clone(),
            pool_revision: member.pool_revision.clone(),
            ..self.new_record(lease, &req.principal, SpecRecord::from_proto(spec), member.net_slot)
        });
        let op = OpLock::default();
        let guard = op.clone().lock_owned().await;
        // The member's room becomes the sandbox's in one step: no capacity check (the room is
        // already held), nothing else can take it in between.
        let raced = {
            let mut t = self.table();
            match t.get(lease) {
                Some(e) => Some(e.op.clone()),
                None => {
                    t.insert(rec.clone(), op);
                    self.take_room(&member);
                    None
                }
            }
        };
        if let Some(op) = raced {
            drop(guard);
            self.discard_member(&member).await;
            return self.existing(op, lease).await;
        }
        // The intent need not survive a crash: without it the member is the pool's again after
        // a restart, and a claim sets everything of a member anew (id, env, limits, rules).
        if let Err(e) = self.persist(&rec, WriteMode::Lazy).await {
            // The sandbox's room goes with its entry; the member's stop gives nothing back twice.
            self.table().remove(lease);
            self.activity.forget(lease);
            if let Err(se) = backend.stop(&member).await {
                tracing::warn!(member = %member.id, error = %se, "stopping a pool member failed");
            }
            self.forget_member(&member).await;
            return Err(e.into());
        }
        let warm = backend.warm().expect("claimed only for warm backends");
        // From here on the member is the sandbox's: a failure stops it through the sandbox.
        let settled = match warm.claim(&member, &rec).await {
            Err(source) => {
                tracing::warn!(sandbox_id = %rec.id, member = %member.id, error = %source.report(), "claiming a pool member failed");
                Err(self.start_failed(&rec, &backend, source, "claim").await)
            }
            Ok(()) => self.settle_running(&rec, &backend).await,
        };
        let running = match settled {
            Ok(r) => r,
            Err(e) => {
                self.forget_member(&member).await;
                return Err(e);
            }
        };
        drop(guard);
        // Gone for good before the answer: after a crash, recovery must never take a member a
        // sandbox ran in back into the pool, even if that sandbox's record became unreadable.
        let store = self.member_store.clone();
        let member_lease = member.lease_id.clone();
        let removed = tokio::task::spawn_blocking(move || store.remove_durable(&member_lease)).await;
        if !matches!(removed, Ok(Ok(()))) {
            tracing::warn!(member = %member.id, result = ?removed, "removing a claimed member's record failed");
        }
        if self.remote.has_iam() {
            self.releases.push_check(lease.to_string());
        }
        Ok(self.to_proto(&running))
    }

    /// A start (`op`: create, claim) that failed: the sandbox is stopped (the backend cleans
    /// up after itself; this catches leftovers, and says so beside the start's own failure)
    /// and FAILED, its lease released.
    async fn start_failed(
        &self,
        rec: &SandboxRecord,
        backend: &Arc<dyn Backend>,
        mut source: BackendError,
        op: &'static str,
    ) -> EdgeError {
        if let Err(e) = backend.stop(rec).await {
            tracing::warn!(sandbox_id = %rec.id, error = %e.report(), "cleanup after a failed start failed");
            if source.cleanup().is_none() {
                source = source.with_cleanup(e);
            }
        }
        self.fail_locked(rec, end_reason::CREATE_FAILED, Self::start_release(rec)).await;
        EdgeError::Backend { backend: backend.name(), op, id: rec.id.clone(), source }
    }

    /// What a failed start does with the lease: releases it, unless the sandbox was moving in
    /// (the original still runs, and the apiserver binds the lease back to it).
    fn start_release(rec: &SandboxRecord) -> Release {
        if rec.moved.moved_from.is_empty() { Release::Yes } else { Release::No }
    }

    /// The RUNNING record of a sandbox that started, on disk first; without it the sandbox
    /// would not survive a restart, so a failed write undoes the sandbox.
    async fn settle_running(
        &self,
        rec: &Arc<SandboxRecord>,
        backend: &Arc<dyn Backend>,
    ) -> Result<Arc<SandboxRecord>, EdgeError> {
        let mut running = (**rec).clone();
        running.state = SandboxStatus::Running;
        running.updated_at_ms = self.clock.now_ms();
        match self.persist_then_publish(running).await {
            Ok(r) => Ok(r),
            Err(e) => {
                if let Err(se) = backend.stop(rec).await {
                    tracing::error!(sandbox_id = %rec.id, error = %se, "stop after a failed record write failed");
                }
                self.fail_locked(rec, end_reason::CREATE_FAILED, Self::start_release(rec)).await;
                Err(e)
            }
        }
    }

    /// The first record of a sandbox of this edge: CREATING, now.
    pub(super) fn new_record(&self, lease: &str, principal: &str, spec: SpecRecord, net_slot: u32) -> SandboxRecord {
        let now = self.clock.now_ms();
        SandboxRecord {
            version: RECORD_VERSION,
            id: ids::sandbox_id(&self.name, lease),
            edge: self.name.clone(),
            lease_id: lease.to_string(),
            principal: principal.to_string(),
            spec,
            state: SandboxStatus::Creating,
            created_at_ms: now,
            updated_at_ms: now,
            last_active_ms: now,
            paused_since_ms: 0,
            end_reason: String::new(),
            ended_at_ms: 0,
            lease_released: false,
            net_slot,
            member: String::new(),
            pool: String::new(),
            pool_revision: String::new(),
            moved: Default::default(),
        }
    }

    /// What a creation moving a sandbox in must carry: its id, of this lease, from another edge.
    fn check_moved_in(&self, mv: &opendsec_proto::v1::MovedIn, lease: &str) -> Result<(), EdgeError> {
        let (_, id_lease) = ids::split_sandbox_id(&mv.id).map_err(|e| EdgeError::InvalidArgument(e.message))?;
        if id_lease != lease {
            return Err(EdgeError::InvalidArgument(format!("moved_in.id {} is not of lease {lease}", mv.id)));
        }
        ids::validate_edge(&mv.from_edge)
            .map_err(|e| EdgeError::InvalidArgument(format!("moved_in.from_edge: {}", e.message)))?;
        if mv.from_edge == self.name {
            return Err(EdgeError::InvalidArgument(format!("sandbox {} already runs on edge {}", mv.id, self.name)));
        }
        if mv.layers.is_empty() {
            return Err(EdgeError::InvalidArgument("moved_in.layers is empty".into()));
        }
        Ok(())
    }

    /// A sandbox moving in finds no record of its lease here but an ended one (it left this
    /// edge before, or an earlier copy failed), which goes: the lease is the new copy's now. A
    /// live one is refused: it is not this move's copy to hand out.
    async fn forget_tombstone(&self, lease: &str) -> Result<(), EdgeError> {
        let Some(op) = self.op_lock(lease) else { return Ok(()) };
        let _g = op.lock_owned().await;
        let Some(rec) = self.table().rec(lease) else { return Ok(()) };
        if rec.state.is_live() {
            return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "move in over it" });
        }
        let store = self.store.clone();
        let l = lease.to_string();
        tokio::task::spawn_blocking(move || store.remove_durable(&l))
            .await
            .map_err(|e| RecordError::Join { lease: lease.to_string(), message: e.to_string() })??;
        self.table().remove(lease);
        self.activity.forget(lease);
        Ok(())
    }

    pub(super) async fn existing(&self, op: OpLock, lease: &str) -> Result<Sandbox, EdgeError> {
        let _g = op.lock_owned().await;
        let rec = self.table().rec(lease).ok_or_else(|| self.not_found(&self.id_of(lease)))?;
        Ok(self.to_proto(&rec))
    }

    /// The post-creation check found the lease bound elsewhere or gone: the caller moved on
    /// (retried elsewhere, or gave up and released it). Stops the sandbox without releasing
    /// the lease, which is not ours.
    pub(crate) async fn stop_moved(&self, lease: &str, binding: &LeaseBinding) {
        let id = self.id_of(lease);
        let Ok((_g, rec)) = self.lock_op(&id).await else { return };
        if !rec.state.can_stop() {
            return;
        }
        tracing::info!(sandbox_id = %id, binding = ?binding, "lease moved; stopping the sandbox");
        if let Err(e) = self.stop_locked(rec, end_reason::LEASE_MOVED, Release::No).await {
            tracing::warn!(sandbox_id = %id, error = %e, "stop after lease move failed");
        }
    }
}
