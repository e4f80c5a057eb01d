//! The apiserver's Prometheus metrics (reference section 15): calls by method and reason,
//! creation latency, placement retries, cache hits and misses.

use std::sync::{Arc, Mutex};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CallLabels {
    pub method: &'static str,
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct CacheLabels {
    pub cache: &'static str,
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PoolLabels {
    pub project: String,
    pub pool: String,
    pub edge: String,
}

/// The warm pools on every edge, from the cluster snapshot (every apiserver exports the same
/// series: aggregate with `max by (project, pool, edge)`).
#[derive(Debug, Default)]
pub struct PoolGauges {
    pub target: Family<PoolLabels, Gauge>,
    pub idle: Family<PoolLabels, Gauge>,
    pub starting: Family<PoolLabels, Gauge>,
    pub stale: Family<PoolLabels, Gauge>,
    pub claims: Family<PoolLabels, Gauge>,
    pub misses: Family<PoolLabels, Gauge>,
    pub refill_p50_ms: Family<PoolLabels, Gauge>,
    pub oldest_stale_seconds: Family<PoolLabels, Gauge>,
}

impl PoolGauges {
    fn register(&self, reg: &mut Registry) {
        let fams = [
            ("pool_target", "Members each edge keeps idle (the pool's size per edge)", &self.target),
            ("pool_idle", "Idle members of the current revision", &self.idle),
            ("pool_starting", "Members being started", &self.starting),
            ("pool_stale", "Members of older revisions not yet stopped (never handed out)", &self.stale),
            ("pool_claims", "Claims that took a member, since the edge started", &self.claims),
            ("pool_misses", "Claims that found no idle member and went cold, since the edge started", &self.misses),
            ("pool_refill_p50_ms", "Median start-to-idle time of recent members", &self.refill_p50_ms),
            (
                "pool_oldest_stale_seconds",
                "How long members of an older revision have been around since the last template change",
                &self.oldest_stale_seconds,
            ),
        ];
        for (name, help, fam) in fams {
            reg.register(name, help, fam.clone());
        }
    }

    /// The snapshot's pools, replacing every series (pools and edges that are gone vanish).
    pub fn update(&self, edges: &[crate::placement::EdgeView]) {
        let all = [
            &self.target,
            &self.idle,
            &self.starting,
            &self.stale,
            &self.claims,
            &self.misses,
            &self.refill_p50_ms,
            &self.oldest_stale_seconds,
        ];
        for f in all {
            f.clear();
        }
        let g = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
        for e in edges {
            for p in &e.pools {
                let l = PoolLabels { project: p.project.clone(), pool: p.name.clone(), edge: e.name.clone() };
                self.target.get_or_create(&l).set(g(p.target.into()));
                self.idle.get_or_create(&l).set(g(p.idle.into()));
                self.starting.get_or_create(&l).set(g(p.starting.into()));
                self.stale.get_or_create(&l).set(g(p.stale.into()));
                self.claims.get_or_create(&l).set(g(p.claims));
                self.misses.get_or_create(&l).set(g(p.misses));
                self.refill_p50_ms.get_or_create(&l).set(g(p.refill_p50_ms));
                self.oldest_stale_seconds.get_or_create(&l).set(g(p.oldest_stale_ms / 1000));
            }
        }
    }
}

#[derive(Debug)]
pub struct Metrics {
    pub registry: Arc<Mutex<Registry>>,
    pub calls: Family<CallLabels, Counter>,
    /// Seconds from the start of a creation to the edge's answer, successful creations only.
    pub creation_seconds: Histogram,
    /// Of a creation: IAM's answer to its admission (gathered or alone), admitted ones only.
    pub admit_seconds: Histogram,
    /// Of a creation: the edge's answer (gathered or alone), created ones only.
    pub edge_create_seconds: Histogram,
    pub placement_retries: Counter,
    pub cache: Family<CacheLabels, Counter>,
    pub inflight_creations: Gauge,
    pub epoch_changes: Counter,
    pub pools: PoolGauges,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut reg = Registry::with_prefix("opendsec_apiserver");
        let calls = Family::<CallLabels, Counter>::default();
        reg.register("calls", "Public calls by method and outcome reason", calls.clone());
        // From 100 µs: a creation on sim edges takes about a millisecond in all.
        let buckets = || exponential_buckets(0.0001, 2.0, 20);
        let creation_seconds = Histogram::new(buckets());
        reg.register("creation_seconds", "Latency of successful sandbox creations", creation_seconds.clone());
        let admit_seconds = Histogram::new(buckets());
        reg.register("admit_seconds", "IAM admission latency within successful admissions", admit_seconds.clone());
        let edge_create_seconds = Histogram::new(buckets());
        reg.register(
            "edge_create_seconds",
            "Edge latency of sandboxes it created, as the apiserver waited for it",
            edge_create_seconds.clone(),
        );
        let placement_retries = Counter::default();
        reg.register("placement_retries", "Creations placed again after an edge refused", placement_retries.clone());
        let cache = Family::<CacheLabels, Counter>::default();
        reg.register("auth_cache", "Authentication and authorization cache lookups", cache.clone());
        let inflight_creations = Gauge::default();
        reg.register("inflight_creations", "Creations in flight on this apiserver", inflight_creations.clone());
        let epoch_changes = Counter::default();
        reg.register(
            "security_epoch_changes",
            "IAM security epoch changes seen (caches cleared)",
            epoch_changes.clone(),
        );
        let pools = PoolGauges::default();
        pools.register(&mut reg);
        Metrics {
            pools,
            registry: Arc::new(Mutex::new(reg)),
            calls,
            creation_seconds,
            admit_seconds,
            edge_create_seconds,
            placement_retries,
            cache,
            inflight_creations,
            epoch_changes,
        }
    }

    pub fn call(&self, method: &'static str, reason: &'static str) {
        self.calls.get_or_create(&CallLabels { method, reason }).inc();
    }

    pub fn cache(&self, cache: &'static str, hit: bool) {
        self.cache.get_or_create(&CacheLabels { cache, result: if hit { "hit" } else { "miss" } }).inc();
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opendsec_proto::v1 as pb;

    fn text(m: &Metrics) -> String {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, &m.registry.lock().unwrap()).unwrap();
        s
    }

    #[test]
    fn pool_series_follow_the_snapshot() {
        let m = Metrics::new();
        let pool = pb::PoolStatus {
            project: "root".into(),
            name: "py".into(),
            idle: 3,
            misses: 2,
            oldest_stale_ms: 90_500,
            ..Default::default()
        };
        let edge = crate::placement::EdgeView { name: "e1".into(), pools: vec![pool], ..Default::default() };
        m.pools.update(std::slice::from_ref(&edge));
        let t = text(&m);
        assert!(t.contains(r#"opendsec_apiserver_pool_idle{project="root",pool="py",edge="e1"} 3"#), "{t}");
        assert!(t.contains(r#"opendsec_apiserver_pool_misses{project="root",pool="py",edge="e1"} 2"#), "{t}");
        assert!(t.contains(r#"opendsec_apiserver_pool_oldest_stale_seconds{project="root",pool="py",edge="e1"} 90"#));
        // A pool gone from the snapshot leaves no series behind.
        m.pools.update(&[crate::placement::EdgeView { name: "e1".into(), ..Default::default() }]);
        assert!(!text(&m).contains("pool=\"py\""));
    }
}
