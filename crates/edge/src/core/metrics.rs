//! A sandbox's metrics: the backend's readings, CPU as a percentage of the sandbox's CPUs
//! since the previous reading (kept in memory per sandbox; a first reading samples twice, 100
//! ms apart).

use std::time::{Duration, Instant};

use opendsec_proto::v1::SandboxMetrics;

use crate::core::Inner;
use crate::error::EdgeError;
use crate::state::SandboxStatus;

/// How long a first reading samples the CPU for.
const FIRST_SAMPLE: Duration = Duration::from_millis(100);
/// Readings kept at most (one per sandbox; the oldest go first).
const MAX_KEPT: usize = 100_000;

impl Inner {
    pub(crate) async fn metrics(&self, id: &str) -> Result<SandboxMetrics, EdgeError> {
        let lease = self.lease_of(id)?.to_string();
        let rec = self.table().rec(&lease).ok_or_else(|| self.not_found(id))?;
        if rec.state != SandboxStatus::Running && rec.state != SandboxStatus::Paused {
            return Err(EdgeError::InvalidState { id: rec.id.clone(), state: rec.state, op: "measure" });
        }
        let backend = self.backend_of(&rec)?.clone();
        let read = || async {
            backend.metrics(&rec).await.map_err(|source| EdgeError::Backend {
                backend: backend.name(),
                op: "measure",
                id: rec.id.clone(),
                source,
            })
        };
        let mut now = read().await?;
        let mut at = Instant::now();
        let prev = self.cpu_readings.lock().unwrap_or_else(|p| p.into_inner()).get(&lease).copied();
        let (then_ns, then) = match prev {
            Some((ns, t)) if at.duration_since(t) >= FIRST_SAMPLE && ns <= now.cpu_ns => (ns, t),
            _ => {
                let first = (now.cpu_ns, at);
                tokio::time::sleep(FIRST_SAMPLE).await;
                now = read().await?;
                at = Instant::now();
                first
            }
        };
        {
            let mut g = self.cpu_readings.lock().unwrap_or_else(|p| p.into_inner());
            if g.len() >= MAX_KEPT && !g.contains_key(&lease) {
                let oldest = g.iter().min_by_key(|(_, (_, t))| *t).map(|(k, _)| k.clone());
                if let Some(k) = oldest {
                    g.remove(&k);
                }
            }
            g.insert(lease.clone(), (now.cpu_ns, at));
        }
        let res = rec.spec.resources;
        let cpus = res.cpu_millis.div_ceil(1000).max(1);
        let wall_ns = at.duration_since(then).as_nanos().max(1) as f64;
        let used = now.cpu_ns.saturating_sub(then_ns) as f64;
        // Of the CPUs the sandbox may use, as E2B counts it.
        let pct = (used / wall_ns / (res.cpu_millis.max(1) as f64 / 1000.0) * 100.0).clamp(0.0, 100.0);
        Ok(SandboxMetrics {
            at_ms: opendsec_common::time::now_ms() as i64,
            cpu_count: cpus,
            cpu_used_pct: pct,
            memory_used_bytes: now.memory_used_bytes,
            memory_limit_bytes: now.memory_limit_bytes,
            memory_cache_bytes: now.memory_cache_bytes,
            disk_used_bytes: now.disk_used_bytes,
            disk_total_bytes: now.disk_total_bytes,
        })
    }
}
