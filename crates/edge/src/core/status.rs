//! What the edge reports to the watcher: capacity, allocation, use, pressure, live leases.

use super::*;

impl Inner {
    /// Host pressure (never for sim-only edges), read at most every [`PRESSURE_CACHE`].
    pub(crate) fn pressure(&self) -> Pressure {
        if self.sim_only {
            return Pressure::default();
        }
        let cache =
            |c: &mut Option<(Instant, Pressure)>| c.filter(|(at, _)| at.elapsed() < PRESSURE_CACHE).map(|(_, p)| p);
        if let Some(p) = cache(&mut self.pressure_cache.lock().unwrap_or_else(|p| p.into_inner())) {
            return p;
        }
        let reading = self.host.reading(&self.state_dir);
        let p = admission::pressure(&reading, self.cfg.memory_reserve_fraction, self.cfg.disk_reserve_mb);
        *self.pressure_cache.lock().unwrap_or_else(|p| p.into_inner()) = Some((Instant::now(), p));
        p
    }

    pub(crate) fn status(&self, include_leases: bool) -> EdgeStatus {
        let (used, live, moved_in) = {
            // Only pointers are copied under the lock; the messages are built after it.
            let t = self.table();
            let live: Vec<Arc<SandboxRecord>> =
                if include_leases { t.records().filter(|r| r.state.is_live()).cloned().collect() } else { Vec::new() };
            (t.used().plus(self.pool_used()), live, t.moved_in())
        };
        let mut leases: Vec<LiveLease> = live
            .iter()
            .map(|r| LiveLease {
                lease_id: r.lease_id.clone(),
                project: r.spec.project.clone(),
                principal: r.principal.clone(),
                resources: Some(r.resources().to_proto()),
                pool: String::new(),
            })
            .collect();
        // Idle pool members hold leases too (charged to their pools' projects).
        if include_leases {
            leases.extend(self.pools().charged.values().cloned());
        }
        let share = |used: u64, cap: u64| if cap == 0 { 0.0 } else { (used as f64 / cap as f64).min(1.0) };
        let reports: Option<Vec<_>> = self.backends.iter().map(|b| b.usage()).collect();
        let (cpu_use, memory_use) = match reports {
            Some(reports) => {
                let cpu = reports.iter().map(|u| u.cpu_millis).sum();
                let mem = reports.iter().map(|u| u.memory_mb).sum();
                (share(cpu, self.capacity.cpu_millis), share(mem, self.capacity.memory_mb))
            }
            None => {
                let r = self.host.reading(&self.state_dir);
                let mem = match (r.mem_total_mb, r.mem_available_mb) {
                    (Some(t), Some(a)) => share(t.saturating_sub(a), t),
                    _ => 0.0,
                };
                (self.host.cpu_use().unwrap_or(0.0), mem)
            }
        };
        let c = &self.capacity;
        EdgeStatus {
            edge: self.name.clone(),
            boot_id: self.boot_id.clone(),
            backends: self.backend_names(),
            runtime_versions: self
                .backends
                .iter()
                .filter_map(|b| b.versioned())
                .flat_map(|v| v.runtime_versions())
                .collect(),
            capacity: Some(Resources {
                cpu_millis: u32::try_from(c.cpu_millis).unwrap_or(u32::MAX),
                memory_mb: c.memory_mb,
                disk_mb: c.disk_mb,
                gpus: u32::try_from(c.gpus).unwrap_or(u32::MAX),
            }),
            allocated: Some(Resources {
                cpu_millis: u32::try_from(used.cpu_millis).unwrap_or(u32::MAX),
                memory_mb: used.memory_mb,
                disk_mb: used.disk_mb,
                gpus: u32::try_from(used.gpus).unwrap_or(u32::MAX),
            }),
            sandboxes: used.sandboxes,
            max_sandboxes: c.max_sandboxes,
            cpu_use,
            memory_use,
            pressure: Some(self.pressure()),
            draining: self.draining(),
            leases,
            pools: self.pool_status(),
            moved_in,
        }
    }
}
