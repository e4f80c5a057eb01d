//! The background sweeps, together: TTL expiry (by the idle clock of runtime activity), liveness
//! probes of running sandboxes, deletion of ended records past retention, and marking released
//! leases.

use std::collections::HashMap;

use super::*;

impl Inner {
    /// The sandbox's last runtime activity: `now` while a call runs.
    pub(super) fn active_ms(&self, lease: &str, now: i64) -> i64 {
        match self.activity.of(lease) {
            (0, last) => last,
            _ => now,
        }
    }

    /// One round of the TTL loop: expire, probe liveness, delete ended records past retention.
    /// It looks only at the records due (the table keeps them in due order), and asks about
    /// every live sandbox only the backends that do not hear of their losses by themselves.
    pub(crate) async fn ttl_round(&self) {
        let now = self.clock.now_ms();
        let retention = i64::try_from(self.cfg.ended_retention.as_millis()).unwrap_or(i64::MAX);
        let mut expired = Vec::new();
        let mut delete = Vec::new();
        let mut moves = Vec::new();
        let stale = i64::try_from(self.cfg.move_stale.as_millis()).unwrap_or(i64::MAX);
        let mut probe: Vec<Arc<SandboxRecord>> = Vec::new();
        // What the backends that hear of their losses lost; the others are asked below.
        let heard: Vec<Option<Vec<String>>> = self.backends.iter().map(|b| b.losses()).collect();
        let probed: Vec<&str> =
            self.backends.iter().zip(&heard).filter(|(_, h)| h.is_none()).map(|(b, _)| b.name()).collect();
        // One look at the table and the activity map for the whole round (in that order, as
        // every caller that holds both takes them).
        {
            let mut table = self.table();
            let activity = self.activity.lock();
            let active_ms = |lease: &str| match activity.get(lease) {
                Some((0, last)) => *last,
                Some(_) => now,
                None => 0,
            };
            for rec in table.due(now) {
                let lease = &rec.lease_id;
                if rec.moved.is_moving() || (!rec.moved.moved_to.is_empty() && rec.state.is_live()) {
                    // A move holds the sandbox (no expiry, no probes of a frozen sandbox) until it
                    // is finished, by its caller or, past its time, here.
                    let past = rec.moved.moving_since_ms.saturating_add(stale);
                    if !rec.moved.is_moving() || past <= now {
                        moves.push(lease.clone());
                    } else {
                        table.put_off(lease, Some(past));
                    }
                } else if rec.state.is_live() {
                    let active = active_ms(lease);
                    if ttl::expired_active(&rec, now, active).is_some() {
                        expired.push(lease.clone());
                    } else if rec.state.is_adoptable() {
                        // Not expired: activity put the idle deadline off (an unsettled
                        // sandbox stays due, and is looked at again next round).
                        table.put_off(lease, Some(ttl::expires_at_ms_active(&rec, active)).filter(|&at| at > 0));
                    }
                } else if rec.lease_released {
                    let past = rec.ended_at_ms.saturating_add(retention);
                    if past <= now {
                        delete.push(lease.clone());
                    } else {
                        table.put_off(lease, Some(past));
                    }
                } else {
                    table.put_off(lease, None);
                }
            }
            if !probed.is_empty() {
                let held = |r: &SandboxRecord| probed.contains(&r.spec.backend.as_str());
                let moving = |r: &SandboxRecord| r.moved.is_moving() || !r.moved.moved_to.is_empty();
                probe.extend(table.records().filter(|r| r.state.is_adoptable() && !moving(r) && held(r)).cloned());
            }
        }
        futures::stream::iter(expired)
            .for_each_concurrent(LOOP_CONCURRENCY, |lease| async move { self.expire(&lease).await })
            .await;
        // Liveness: a backend that hears of its losses names them; each other one is asked
        // about all of its sandboxes at once. What is answered gone is looked at again, one by
        // one, under the sandbox's lock.
        let mut lost = Vec::new();
        for (b, heard) in self.backends.iter().zip(heard) {
            if let Some(gone) = heard {
                // Only settled sandboxes are looked at (one in an operation is named again
                // next round), so that a round never waits for an operation's lock.
                let table = self.table();
                lost.extend(gone.iter().filter_map(|id| {
                    let (_, lease) = ids::split_sandbox_id(id).ok()?;
                    let e = table.get(lease).filter(|e| e.rec.id == *id && e.rec.state.is_adoptable())?;
                    Some(e.rec.lease_id.clone())
                }));
                continue;
            }
            let recs: Vec<&Arc<SandboxRecord>> = probe.iter().filter(|r| r.spec.backend == b.name()).collect();
            if recs.is_empty() {
                continue;
            }
            let ids: Vec<&str> = recs.iter().map(|r| r.id.as_str()).collect();
            lost.extend(b.gone(&ids).await.into_iter().filter_map(|i| recs.get(i)).map(|r| r.lease_id.clone()));
        }
        futures::stream::iter(lost)
            .for_each_concurrent(LOOP_CONCURRENCY, |lease| async move { self.check_lost(&lease).await })
            .await;
        if !delete.is_empty() {
            self.delete_ended(delete).await;
        }
        for lease in moves {
            self.settle_stale_move(&lease).await;
        }
        if !self.sim_only {
            // Keeps the CPU window fed and the pressure cache fresh between creations.
            let _ = self.host.cpu_use();
            let _ = self.pressure();
        }
    }

    pub(super) async fn expire(&self, lease: &str) {
        let Some(op) = self.op_lock(lease) else { return };
        let _g = op.lock_owned().await;
        let Some(rec) = self.table().rec(lease) else { return };
        // Looked at again under the lock: a call may have reset the clock meanwhile.
        let now = self.clock.now_ms();
        let Some(reason) = ttl::expired_active(&rec, now, self.active_ms(&rec.lease_id, now)) else { return };
        // A move began since the sweep looked: it holds the sandbox.
        if rec.moved.is_moving() || !rec.moved.moved_to.is_empty() {
            return;
        }
        // Idle, and asked to pause rather than stop then (E2B's autoPause).
        let mut rec = rec;
        if reason == end_reason::TTL_RUNNING_STOP && rec.spec.pause_on_timeout && rec.state.can_pause() {
            tracing::debug!(sandbox_id = %rec.id, "idle sandbox paused");
            let Err(e) = self.pause_locked(&rec).await else { return };
            // Its time is up either way: one that cannot be paused is stopped, not left
            // running until its lifetime.
            tracing::warn!(lease_id = %lease, error = %e, "pausing a sandbox at its timeout failed; stopping it");
            match self.table().rec(lease) {
                Some(r) if r.state.can_pause() => rec = r,
                _ => return,
            }
        }
        tracing::debug!(sandbox_id = %rec.id, reason, "sandbox expired");
        if let Err(e) = self.stop_locked(rec, reason, Release::Yes).await {
            tracing::warn!(lease_id = %lease, error = %e, "stopping an expired sandbox failed; will retry");
        }
    }

    pub(super) async fn check_lost(&self, lease: &str) {
        let Some(op) = self.op_lock(lease) else { return };
        let _g = op.lock_owned().await;
        let Some(rec) = self.table().rec(lease) else { return };
        if !rec.state.is_adoptable() {
            return;
        }
        let Some(b) = self.backend(&rec.spec.backend) else { return };
        if let Ok(false) = b.probe(&rec.id).await {
            tracing::warn!(sandbox_id = %rec.id, "sandbox lost");
            let b = b.clone();
            self.lose_locked(&b, &rec).await;
        }
    }

    /// A sandbox found lost (its agent dead, or silent past `agent_silence`): what is left of
    /// it is torn down first (a silent agent's workload may still run, and must not go on
    /// using what its released quota no longer covers), then it is FAILED and its lease
    /// released. A teardown that fails is logged; the leftovers go at the edge's next start.
    pub(super) async fn lose_locked(&self, backend: &Arc<dyn Backend>, rec: &SandboxRecord) {
        if let Err(e) = backend.stop(rec).await {
            tracing::warn!(sandbox_id = %rec.id, error = %e, "tearing down a lost sandbox failed");
        }
        self.fail_locked(rec, end_reason::LOST, Release::Yes).await;
    }

    /// Removes ended, released records past their retention: files first, then the table
    /// entries, each under its operation lock so a creation reusing the lease cannot have its
    /// new record removed.
    pub(super) async fn delete_ended(&self, leases: Vec<String>) {
        let mut guards = Vec::new();
        let mut chosen = Vec::new();
        for lease in leases {
            let Some(op) = self.op_lock(&lease) else { continue };
            if let Ok(g) = op.try_lock_owned() {
                guards.push(g);
                chosen.push(lease);
            }
        }
        let store = self.store.clone();
        let files = chosen.clone();
        let removed = tokio::task::spawn_blocking(move || {
            files
                .into_iter()
                .filter(|l| match store.remove(l) {
                    Ok(()) => true,
                    Err(e) => {
                        tracing::warn!(error = %e, "removing an ended record failed");
                        false
                    }
                })
                .collect::<Vec<_>>()
        })
        .await
        .unwrap_or_default();
        let mut t = self.table();
        for lease in removed {
            if t.rec(&lease).is_some_and(|r| r.state.is_ended() && r.lease_released) {
                t.remove(&lease);
                self.activity.forget(&lease);
            }
        }
        drop(t);
        drop(guards);
    }

    /// Marks confirmed releases in the records (non-durable: losing the mark in a crash only
    /// repeats an idempotent release), then in memory.
    pub(crate) async fn mark_released(&self, leases: &[String]) {
        let recs: Vec<SandboxRecord> = {
            let t = self.table();
            leases
                .iter()
                .filter_map(|l| t.rec(l))
                .filter(|r| r.state.is_ended() && !r.lease_released)
                .map(|r| {
                    let mut r = (*r).clone();
                    r.lease_released = true;
                    r
                })
                .collect()
        };
        if recs.is_empty() {
            return;
        }
        let writes: Vec<(String, Vec<u8>)> =
            recs.iter().filter_map(|r| r.encode().ok().map(|b| (r.lease_id.clone(), b))).collect();
        let store = self.store.clone();
        let _ = tokio::task::spawn_blocking(move || {
            for (lease, bytes) in writes {
                if let Err(e) = store.write(&lease, &bytes, WriteMode::Lazy) {
                    tracing::warn!(error = %e, "marking a released lease failed");
                }
            }
        })
        .await;
        let mut t = self.table();
        for r in recs {
            if t.rec(&r.lease_id).is_some_and(|cur| cur.state.is_ended() && !cur.lease_released) {
                t.publish(Arc::new(r));
            }
        }
    }
}

/// Calls in flight and the last activity per sandbox (by lease).
pub(crate) struct Activity {
    map: std::sync::Mutex<HashMap<String, (u32, i64)>>,
    clock: Clock,
}

impl Activity {
    pub(crate) fn new(clock: Clock) -> Activity {
        Activity { map: Default::default(), clock }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, (u32, i64)>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn begin(&self, lease: &str) {
        let now = self.clock.now_ms();
        let mut m = self.lock();
        let e = m.entry(lease.to_string()).or_insert((0, now));
        e.0 += 1;
        e.1 = now;
    }

    pub(crate) fn end(&self, lease: &str) {
        let now = self.clock.now_ms();
        if let Some(e) = self.lock().get_mut(lease) {
            e.0 = e.0.saturating_sub(1);
            e.1 = now;
        }
    }

    /// Marks activity now, without a call in flight.
    pub(crate) fn touch(&self, lease: &str) {
        let now = self.clock.now_ms();
        self.lock().entry(lease.to_string()).or_insert((0, now)).1 = now;
    }

    /// (calls in flight, last activity in ms) of a sandbox; (0, 0) when it never had a call.
    pub(crate) fn of(&self, lease: &str) -> (u32, i64) {
        self.lock().get(lease).copied().unwrap_or((0, 0))
    }

    /// Forgets an ended sandbox.
    pub(crate) fn forget(&self, lease: &str) {
        self.lock().remove(lease);
    }
}
