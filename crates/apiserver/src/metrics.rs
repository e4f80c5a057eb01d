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

#[derive(Debug)]
pub struct Metrics {
    pub registry: Arc<Mutex<Registry>>,
    pub calls: Family<CallLabels, Counter>,
    /// Seconds from the start of a creation to the edge's answer, successful creations only.
    pub creation_seconds: Histogram,
    pub placement_retries: Counter,
    pub cache: Family<CacheLabels, Counter>,
    pub inflight_creations: Gauge,
    pub epoch_changes: Counter,
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut reg = Registry::with_prefix("opendsec_apiserver");
        let calls = Family::<CallLabels, Counter>::default();
        reg.register("calls", "Public calls by method and outcome reason", calls.clone());
        let creation_seconds = Histogram::new(exponential_buckets(0.001, 2.0, 16));
        reg.register("creation_seconds", "Latency of successful sandbox creations", creation_seconds.clone());
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
        Metrics {
            registry: Arc::new(Mutex::new(reg)),
            calls,
            creation_seconds,
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
