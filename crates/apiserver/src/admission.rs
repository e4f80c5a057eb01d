//! Admission: what a request must look like before anything is reserved, and how fast one
//! principal may create (reference section 1, "Admission").
//!
//! Pure functions and data: spec validation with TTL filling, list paging bounds, and the
//! per-principal token buckets with the clock passed in. Every rejection names the field and the
//! bound it broke; all of them are `invalid_argument` at the RPC boundary.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use opendsec_common::config::{ApiserverConfig, KNOWN_BACKENDS, TtlConfig};
use opendsec_common::{ApiError, Reason, ids};
use opendsec_proto::v1 as pb;

/// Most sandboxes one `CreateSandboxes` call may ask for.
pub const MAX_BATCH: u32 = 32_768;
pub const MAX_CPU_MILLIS: u64 = 1_024_000;
/// 16 TiB in MiB.
pub const MAX_MEMORY_MB: u64 = 16 << 20;
/// 64 TiB in MiB.
pub const MAX_DISK_MB: u64 = 64 << 20;
pub const MAX_GPUS: u64 = 64;
pub const MAX_IMAGE_BYTES: usize = 512;
pub const MAX_USER_BYTES: usize = 256;
pub const MAX_WORKDIR_BYTES: usize = 4096;
pub const DEFAULT_PAGE_SIZE: u32 = 100;
pub const MAX_PAGE_SIZE: u32 = 1000;
pub const MAX_PAGE_TOKEN_BYTES: usize = 256;

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdmissionError {
    #[error("spec is required")]
    MissingSpec,
    #[error("spec.backend {backend:?} is not known; known: {known}")]
    UnknownBackend { backend: String, known: String },
    #[error("spec.resources is required")]
    MissingResources,
    #[error("{field} is {value}, must be in {min}..={max}")]
    OutOfRange { field: &'static str, value: u64, min: u64, max: u64 },
    #[error("{field} must not be empty")]
    Empty { field: &'static str },
    #[error("{field} is {len} bytes, at most {max}")]
    TooLong { field: String, len: usize, max: usize },
    #[error("{field} has {count} entries, at most {max}")]
    TooManyEntries { field: &'static str, count: usize, max: usize },
    #[error("{field} is {value} s, above the cluster maximum of {max} s")]
    TtlAboveMax { field: &'static str, value: u64, max: u64 },
    #[error("{field} must be at least 1 s")]
    TtlZero { field: &'static str },
    #[error("spec.priority {0} is not a known priority")]
    UnknownPriority(i32),
    #[error("{field}: {message}")]
    InvalidId { field: &'static str, message: String },
    #[error("{field}: {message}")]
    Invalid { field: &'static str, message: String },
    #[error("count is {count}, must be in 1..={max}")]
    BatchCount { count: u32, max: u32 },
    #[error("page_size is {0}, at most {MAX_PAGE_SIZE}")]
    PageSize(u32),
}

impl AdmissionError {
    /// The request field the error is about (ErrorInfo metadata `field`).
    pub fn field(&self) -> String {
        match self {
            AdmissionError::MissingSpec => "spec".into(),
            AdmissionError::UnknownBackend { .. } => "spec.backend".into(),
            AdmissionError::MissingResources => "spec.resources".into(),
            AdmissionError::OutOfRange { field, .. }
            | AdmissionError::Empty { field }
            | AdmissionError::TooManyEntries { field, .. }
            | AdmissionError::TtlAboveMax { field, .. }
            | AdmissionError::TtlZero { field }
            | AdmissionError::InvalidId { field, .. }
            | AdmissionError::Invalid { field, .. } => (*field).into(),
            AdmissionError::TooLong { field, .. } => field.clone(),
            AdmissionError::UnknownPriority(_) => "spec.priority".into(),
            AdmissionError::BatchCount { .. } => "count".into(),
            AdmissionError::PageSize(_) => "page_size".into(),
        }
    }
}

impl From<AdmissionError> for ApiError {
    fn from(e: AdmissionError) -> ApiError {
        // Every admission error is the caller's to fix; the match keeps that a decision per
        // variant when a new one is added.
        let reason = match &e {
            AdmissionError::MissingSpec
            | AdmissionError::UnknownBackend { .. }
            | AdmissionError::MissingResources
            | AdmissionError::OutOfRange { .. }
            | AdmissionError::Empty { .. }
            | AdmissionError::TooLong { .. }
            | AdmissionError::TooManyEntries { .. }
            | AdmissionError::TtlAboveMax { .. }
            | AdmissionError::TtlZero { .. }
            | AdmissionError::UnknownPriority(_)
            | AdmissionError::InvalidId { .. }
            | AdmissionError::Invalid { .. }
            | AdmissionError::BatchCount { .. }
            | AdmissionError::PageSize(_) => Reason::InvalidArgument,
        };
        ApiError::new(reason, e.to_string()).with("field", e.field())
    }
}

fn range(field: &'static str, value: u64, min: u64, max: u64) -> Result<(), AdmissionError> {
    if (min..=max).contains(&value) { Ok(()) } else { Err(AdmissionError::OutOfRange { field, value, min, max }) }
}

fn bytes(field: &str, value: &str, max: usize) -> Result<(), AdmissionError> {
    if value.len() > max {
        return Err(AdmissionError::TooLong { field: field.to_string(), len: value.len(), max });
    }
    Ok(())
}

fn check_labels(field: &'static str, labels: &HashMap<String, String>) -> Result<(), AdmissionError> {
    opendsec_common::spec::check_labels(labels).map_err(|message| AdmissionError::Invalid { field, message })
}

fn ttl(field: &'static str, value: u64, default: Duration, max: Duration) -> Result<u64, AdmissionError> {
    if value == 0 {
        return Ok(default.as_secs().max(1));
    }
    if value > max.as_secs() {
        return Err(AdmissionError::TtlAboveMax { field, value, max: max.as_secs() });
    }
    Ok(value)
}

/// Smallest memory of a VM sandbox: its kernel and agent need this much.
pub const VM_MIN_MEMORY_MB: u64 = 128;

/// Validates a creation spec and returns it filled: project (the caller's own when empty),
/// TTLs (cluster defaults for zeros) and priority (guaranteed when unspecified).
pub fn check_spec(
    spec: Option<&pb::SandboxSpec>,
    caller_project: &str,
    cfg: &ApiserverConfig,
) -> Result<pb::SandboxSpec, AdmissionError> {
    let mut s = spec.cloned().ok_or(AdmissionError::MissingSpec)?;
    if !KNOWN_BACKENDS.contains(&s.backend.as_str()) {
        let shown: String = s.backend.chars().take(32).collect();
        return Err(AdmissionError::UnknownBackend { backend: shown, known: KNOWN_BACKENDS.join(", ") });
    }
    let r = s.resources.as_ref().ok_or(AdmissionError::MissingResources)?;
    range("spec.resources.cpu_millis", u64::from(r.cpu_millis), 1, MAX_CPU_MILLIS)?;
    range("spec.resources.memory_mb", r.memory_mb, 1, MAX_MEMORY_MB)?;
    range("spec.resources.disk_mb", r.disk_mb, 0, MAX_DISK_MB)?;
    // Every backend but sim gives the sandbox a disk of this size: a 0 would be charged as
    // nothing while a disk is still allocated.
    if r.disk_mb == 0 && s.backend != "sim" {
        return Err(AdmissionError::Invalid {
            field: "spec.resources.disk_mb",
            message: format!(
                "must be at least 1 (MiB): the {} backend gives the sandbox a disk of this size",
                s.backend
            ),
        });
    }
    range("spec.resources.gpus", u64::from(r.gpus), 0, MAX_GPUS)?;
    if s.full_init && s.backend != "fullvm" {
        return Err(AdmissionError::Invalid {
            field: "spec.full_init",
            message: format!("only a full VM boots its image's own init (backend fullvm, not {})", s.backend),
        });
    }
    // GPUs are passed through to full VMs (VFIO); sim only counts them.
    if r.gpus > 0 && !matches!(s.backend.as_str(), "fullvm" | "sim") {
        return Err(AdmissionError::Invalid {
            field: "spec.resources.gpus",
            message: format!("backend {} has no GPUs; they are passed through to full VMs (backend fullvm)", s.backend),
        });
    }
    // A VM gets whole vCPUs and at least the memory its kernel needs: charged as it gets them
    // (docs/vms.md), not as asked.
    if matches!(s.backend.as_str(), "microvm" | "fullvm")
        && let Some(r) = s.resources.as_mut()
    {
        r.cpu_millis = r.cpu_millis.div_ceil(1000).saturating_mul(1000).min(MAX_CPU_MILLIS as u32);
        r.memory_mb = r.memory_mb.max(VM_MIN_MEMORY_MB);
    }
    // The sim backend accepts any image name until the image store lands; the name is bounded.
    if s.image.is_empty() {
        return Err(AdmissionError::Empty { field: "spec.image" });
    }
    bytes("spec.image", &s.image, MAX_IMAGE_BYTES)?;
    check_labels("spec.labels", &s.labels)?;
    opendsec_common::spec::check_env(&s.env)
        .map_err(|message| AdmissionError::Invalid { field: "spec.env", message })?;
    bytes("spec.user", &s.user, MAX_USER_BYTES)?;
    bytes("spec.workdir", &s.workdir, MAX_WORKDIR_BYTES)?;
    // Both become PID 1's arguments: no control characters (NUL included); the user is a name
    // or a uid from the image's passwd, the directory an absolute path.
    for (field, v) in [("spec.user", &s.user), ("spec.workdir", &s.workdir)] {
        if v.chars().any(char::is_control) {
            return Err(AdmissionError::Invalid { field, message: "contains control characters".into() });
        }
    }
    for (field, paths) in [("spec.masked_paths", &s.masked_paths), ("spec.readonly_paths", &s.readonly_paths)] {
        opendsec_common::spec::check_extra_paths(paths)
            .map_err(|message| AdmissionError::Invalid { field, message })?;
    }
    if let Some(ss) = &s.session {
        opendsec_common::spec::check_session(&ss.name, &ss.paths)
            .map_err(|message| AdmissionError::Invalid { field: "spec.session", message })?;
    }
    if s.user.starts_with('-') {
        return Err(AdmissionError::Invalid { field: "spec.user", message: "must not start with '-'".into() });
    }
    if !s.workdir.is_empty() && !s.workdir.starts_with('/') {
        return Err(AdmissionError::Invalid { field: "spec.workdir", message: "must be an absolute path".into() });
    }
    s.priority = match pb::Priority::try_from(s.priority) {
        Ok(pb::Priority::Unspecified) | Ok(pb::Priority::Guaranteed) => pb::Priority::Guaranteed as i32,
        Ok(pb::Priority::BestEffort) => pb::Priority::BestEffort as i32,
        Err(_) => return Err(AdmissionError::UnknownPriority(s.priority)),
    };
    if s.project.is_empty() {
        s.project = caller_project.to_string();
    } else {
        ids::validate_project(&s.project)
            .map_err(|e| AdmissionError::InvalidId { field: "spec.project", message: e.message })?;
    }
    let t = &cfg.ttl;
    s.ttl_running_stop_s = ttl("spec.ttl_running_stop_s", s.ttl_running_stop_s, t.default_running_stop, t.max)?;
    s.ttl_max_s = ttl("spec.ttl_max_s", s.ttl_max_s, t.default_max, t.max)?;
    s.ttl_paused_s = ttl("spec.ttl_paused_s", s.ttl_paused_s, t.default_paused, t.max)?;
    Ok(s)
}

/// Fills the network part of a creation spec (the cluster's `network.default_egress` when
/// absent) and checks its rules, written back in their canonical form.
pub fn check_network(s: &mut pb::SandboxSpec, default_egress: &[pb::EgressRule]) -> Result<(), AdmissionError> {
    let net = s.network.get_or_insert_with(|| pb::NetworkSpec { egress: default_egress.to_vec() });
    let rules = opendsec_common::egress::from_pb_list(&net.egress)
        .map_err(|e| AdmissionError::Invalid { field: "spec.network.egress", message: e.to_string() })?;
    net.egress = rules.iter().map(|r| r.to_pb()).collect();
    Ok(())
}

/// Checks the rules of an UpdateNetwork call, returned in their canonical form.
pub fn check_network_update(req: &pb::UpdateNetworkRequest) -> Result<pb::NetworkSpec, AdmissionError> {
    let given = req.network.as_ref().map(|n| n.egress.as_slice()).unwrap_or(&[]);
    let rules = opendsec_common::egress::from_pb_list(given)
        .map_err(|e| AdmissionError::Invalid { field: "network.egress", message: e.to_string() })?;
    Ok(pb::NetworkSpec { egress: rules.iter().map(|r| r.to_pb()).collect() })
}

/// The idempotency key of a creation, if the request carries one.
pub fn check_lease_id(lease_id: &str) -> Result<Option<String>, AdmissionError> {
    if lease_id.is_empty() {
        return Ok(None);
    }
    ids::validate_lease(lease_id).map_err(|e| AdmissionError::InvalidId { field: "lease_id", message: e.message })?;
    Ok(Some(lease_id.to_string()))
}

/// The lease id a creation in `project` with idempotency key `key` gets: 24 hex digits of
/// SHA-256 over the project and the key. Keys are the caller's choice and often predictable
/// (`job-42-0`); scoped by project, another project holding the same key can neither squat
/// it (make this project's creations fail) nor find this project's sandbox through it.
pub fn scoped_lease_id(project: &str, key: &str) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(b"opendsec lease\0");
    h.update((project.len() as u64).to_le_bytes());
    h.update(project.as_bytes());
    h.update(key.as_bytes());
    opendsec_common::hex::to_hex(&h.finalize()[..12])
}

/// The spec of each patched item of a batch (the shared spec with the patch's env and labels
/// added), each checked as a whole; items without a patch take the shared spec.
pub fn patched_specs(
    spec: &pb::SandboxSpec,
    patches: &[pb::ItemPatch],
    count: u32,
    cfg: &ApiserverConfig,
) -> Result<Vec<pb::SandboxSpec>, AdmissionError> {
    if patches.len() > count as usize {
        return Err(AdmissionError::Invalid {
            field: "patches",
            message: format!("{} patches for {count} items", patches.len()),
        });
    }
    patches
        .iter()
        .map(|p| {
            let mut s = spec.clone();
            s.env.extend(p.env.iter().map(|(k, v)| (k.clone(), v.clone())));
            s.labels.extend(p.labels.iter().map(|(k, v)| (k.clone(), v.clone())));
            check_spec(Some(&s), &s.project.clone(), cfg)
        })
        .collect()
}

pub fn check_batch_count(count: u32) -> Result<(), AdmissionError> {
    if (1..=MAX_BATCH).contains(&count) { Ok(()) } else { Err(AdmissionError::BatchCount { count, max: MAX_BATCH }) }
}

/// A TTL update: each field given must be 1 s ..= the cluster maximum (a zero would be
/// ambiguous: "now" or "the default").
pub fn check_timeout_update(req: &pb::SetSandboxTimeoutRequest, t: &TtlConfig) -> Result<(), AdmissionError> {
    for (field, v) in [
        ("ttl_running_stop_s", req.ttl_running_stop_s),
        ("ttl_max_s", req.ttl_max_s),
        ("ttl_paused_s", req.ttl_paused_s),
    ] {
        match v {
            None => {}
            Some(0) => return Err(AdmissionError::TtlZero { field }),
            Some(v) if v > t.max.as_secs() => {
                return Err(AdmissionError::TtlAboveMax { field, value: v, max: t.max.as_secs() });
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// The page size of a list: 0 means the default, above the maximum is refused.
pub fn page_size(requested: u32) -> Result<u32, AdmissionError> {
    match requested {
        0 => Ok(DEFAULT_PAGE_SIZE),
        n if n > MAX_PAGE_SIZE => Err(AdmissionError::PageSize(n)),
        n => Ok(n),
    }
}

pub fn check_list(req: &pb::ListSandboxesRequest) -> Result<u32, AdmissionError> {
    check_labels("labels", &req.labels)?;
    bytes("page_token", &req.page_token, MAX_PAGE_TOKEN_BYTES)?;
    if req.states.len() > 16 {
        return Err(AdmissionError::TooManyEntries { field: "states", count: req.states.len(), max: 16 });
    }
    page_size(req.page_size)
}

/// A token bucket: `rate` tokens a second up to `burst`; time comes from the caller.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    rate: f64,
    burst: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    /// A full bucket.
    pub fn new(rate: f64, burst: f64, now: Instant) -> TokenBucket {
        TokenBucket { rate, burst, tokens: burst, last: now }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.last).as_secs_f64();
        self.tokens = (self.tokens + dt * self.rate).min(self.burst);
        self.last = self.last.max(now);
    }

    /// Takes one token, or says how long until one is there.
    pub fn try_take(&mut self, now: Instant) -> Result<(), Duration> {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            Ok(())
        } else {
            Err(Duration::from_secs_f64(((1.0 - self.tokens) / self.rate).max(0.0)))
        }
    }

    pub fn is_full(&mut self, now: Instant) -> bool {
        self.refill(now);
        self.tokens >= self.burst
    }
}

/// Token buckets per principal. Buckets that are full again carry no state worth keeping and
/// are dropped when the map grows, so the map stays as large as the set of busy principals.
#[derive(Debug)]
pub struct RateLimiter {
    rate: f64,
    burst: f64,
    buckets: HashMap<String, TokenBucket>,
    /// Full buckets are pruned once the map grows past this; it doubles with what stays, so a
    /// map of many busy principals is not rescanned on every call.
    prune_at: usize,
}

const PRUNE_ABOVE: usize = 10_000;

impl RateLimiter {
    pub fn new(rate: f64, burst: f64) -> RateLimiter {
        RateLimiter { rate, burst, buckets: HashMap::new(), prune_at: PRUNE_ABOVE }
    }

    pub fn try_take(&mut self, principal: &str, now: Instant) -> Result<(), Duration> {
        if self.buckets.len() > self.prune_at {
            self.buckets.retain(|_, b| !b.is_full(now));
            self.prune_at = PRUNE_ABOVE.max(2 * self.buckets.len());
        }
        if let Some(b) = self.buckets.get_mut(principal) {
            return b.try_take(now);
        }
        let mut b = TokenBucket::new(self.rate, self.burst, now);
        let r = b.try_take(now);
        self.buckets.insert(principal.to_string(), b);
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ApiserverConfig {
        ApiserverConfig::default()
    }

    fn good() -> pb::SandboxSpec {
        pb::SandboxSpec {
            image: "debian:12".into(),
            backend: "sim".into(),
            resources: Some(pb::Resources { cpu_millis: 1000, memory_mb: 512, disk_mb: 1024, gpus: 0 }),
            ..Default::default()
        }
    }

    fn err_of(f: impl FnOnce(&mut pb::SandboxSpec)) -> AdmissionError {
        let mut s = good();
        f(&mut s);
        check_spec(Some(&s), "root/me", &cfg()).unwrap_err()
    }

    #[test]
    fn defaults_are_filled() {
        let s = check_spec(Some(&good()), "root/me", &cfg()).unwrap();
        assert_eq!(s.project, "root/me");
        assert_eq!(s.ttl_running_stop_s, 600);
        assert_eq!(s.ttl_max_s, 3600);
        assert_eq!(s.ttl_paused_s, 3600);
        assert_eq!(s.priority, pb::Priority::Guaranteed as i32);
        let mut given = good();
        given.project = "root/other".into();
        given.ttl_max_s = 7200;
        let s = check_spec(Some(&given), "root/me", &cfg()).unwrap();
        assert_eq!((s.project.as_str(), s.ttl_max_s), ("root/other", 7200));
    }

    #[test]
    fn a_vm_is_charged_what_it_gets() {
        for (backend, cpu, mem, want) in
            [("microvm", 1, 1, (1000, 128)), ("fullvm", 1500, 512, (2000, 512)), ("container", 1, 1, (1, 1))]
        {
            let mut given = good();
            given.backend = backend.into();
            given.resources = Some(pb::Resources { cpu_millis: cpu, memory_mb: mem, disk_mb: 64, gpus: 0 });
            let r = check_spec(Some(&given), "root/me", &cfg()).unwrap().resources.unwrap();
            assert_eq!((r.cpu_millis, r.memory_mb), want, "{backend}");
        }
    }

    #[test]
    fn ttl_above_the_cap_names_field_and_max() {
        let e = err_of(|s| s.ttl_max_s = 7 * 24 * 3600 + 1);
        assert_eq!(e, AdmissionError::TtlAboveMax { field: "spec.ttl_max_s", value: 604_801, max: 604_800 });
        let api = ApiError::from(e);
        assert_eq!(api.reason, Reason::InvalidArgument);
        assert!(api.message.contains("spec.ttl_max_s") && api.message.contains("604800"), "{}", api.message);
        assert!(matches!(
            err_of(|s| s.ttl_paused_s = u64::MAX),
            AdmissionError::TtlAboveMax { field: "spec.ttl_paused_s", .. }
        ));
        assert!(matches!(
            err_of(|s| s.ttl_running_stop_s = 1 << 40),
            AdmissionError::TtlAboveMax { field: "spec.ttl_running_stop_s", .. }
        ));
    }

    type Mutation = Box<dyn Fn(&mut pb::SandboxSpec)>;

    #[test]
    fn every_bad_field_is_refused() {
        let cases: Vec<(Mutation, &str)> = vec![
            (Box::new(|s| s.backend = "kvm".into()), "spec.backend"),
            (Box::new(|s| s.backend = String::new()), "spec.backend"),
            (Box::new(|s| s.resources = None), "spec.resources"),
            (Box::new(|s| s.resources.as_mut().unwrap().cpu_millis = 0), "spec.resources.cpu_millis"),
            // A client's -1 arrives as the largest unsigned value.
            (Box::new(|s| s.resources.as_mut().unwrap().cpu_millis = u32::MAX), "spec.resources.cpu_millis"),
            (Box::new(|s| s.resources.as_mut().unwrap().memory_mb = 0), "spec.resources.memory_mb"),
            (Box::new(|s| s.resources.as_mut().unwrap().memory_mb = u64::MAX), "spec.resources.memory_mb"),
            (Box::new(|s| s.resources.as_mut().unwrap().memory_mb = (16 << 20) + 1), "spec.resources.memory_mb"),
            (Box::new(|s| s.resources.as_mut().unwrap().disk_mb = u64::MAX), "spec.resources.disk_mb"),
            (
                Box::new(|s| {
                    s.backend = "container".into();
                    s.resources.as_mut().unwrap().disk_mb = 0;
                }),
                "spec.resources.disk_mb",
            ),
            (Box::new(|s| s.resources.as_mut().unwrap().gpus = 65), "spec.resources.gpus"),
            (Box::new(|s| s.image = String::new()), "spec.image"),
            (Box::new(|s| s.image = "x".repeat(513)), "spec.image"),
            (Box::new(|s| s.labels = (0..65).map(|i| (format!("k{i}"), "v".into())).collect()), "spec.labels"),
            // The edge's limits (opendsec_common::spec), so nothing it refuses is reserved first.
            (Box::new(|s| s.labels = [("k".repeat(64), "v".into())].into()), "spec.labels"),
            (Box::new(|s| s.labels = [("k".into(), "v".repeat(256))].into()), "spec.labels"),
            (Box::new(|s| s.env = [("K".into(), "v".repeat(300 << 10))].into()), "spec.env"),
            (Box::new(|s| s.env = [("A=B".into(), "v".into())].into()), "spec.env"),
            (Box::new(|s| s.env = [("K".into(), "a\0b".into())].into()), "spec.env"),
            (Box::new(|s| s.env = [(String::new(), "v".into())].into()), "spec.env"),
            (Box::new(|s| s.project = "team-a".into()), "spec.project"),
            (Box::new(|s| s.project = "root/../x".into()), "spec.project"),
            (Box::new(|s| s.priority = 99), "spec.priority"),
            (Box::new(|s| s.user = "u".repeat(300)), "spec.user"),
            (Box::new(|s| s.user = "a\0b".into()), "spec.user"),
            (Box::new(|s| s.user = "--help".into()), "spec.user"),
            (Box::new(|s| s.workdir = "relative/dir".into()), "spec.workdir"),
            (Box::new(|s| s.masked_paths = vec!["/ok".into(), "/a/../etc".into()]), "spec.masked_paths"),
            (Box::new(|s| s.readonly_paths = vec!["relative".into()]), "spec.readonly_paths"),
            (Box::new(|s| s.readonly_paths = vec!["/x".into(); 33]), "spec.readonly_paths"),
            (Box::new(|s| s.workdir = "/a\nb".into()), "spec.workdir"),
        ];
        for (mutate, field) in cases {
            let mut s = good();
            mutate(&mut s);
            let e = check_spec(Some(&s), "root/me", &cfg()).expect_err(field);
            assert!(e.field().starts_with(field), "{field}: got {e} ({})", e.field());
            assert_eq!(ApiError::from(e).reason, Reason::InvalidArgument);
        }
        assert_eq!(check_spec(None, "root/me", &cfg()).unwrap_err(), AdmissionError::MissingSpec);
        let mut huge_but_ok = good();
        huge_but_ok.resources =
            Some(pb::Resources { cpu_millis: 1_024_000, memory_mb: 16 << 20, disk_mb: 64 << 20, gpus: 64 });
        assert!(check_spec(Some(&huge_but_ok), "root/me", &cfg()).is_ok());
        // GPUs: passed through to full VMs (sim counts them); other backends have none.
        for backend in ["container", "fncall", "microvm"] {
            let e = err_of(|s| {
                s.backend = backend.into();
                s.resources.as_mut().unwrap().gpus = 1;
            });
            assert_eq!(e.field(), "spec.resources.gpus", "{backend}: {e}");
        }
        let e = err_of(|s| {
            s.backend = "microvm".into();
            s.full_init = true;
        });
        assert_eq!(e.field(), "spec.full_init", "{e}");
        let mut full_gpu = good();
        full_gpu.backend = "fullvm".into();
        full_gpu.resources.as_mut().unwrap().gpus = 1;
        full_gpu.full_init = true;
        assert!(check_spec(Some(&full_gpu), "root/me", &cfg()).is_ok());
        // A sim sandbox allocates no disk: 0 is fine there.
        let mut sim_no_disk = good();
        sim_no_disk.resources.as_mut().unwrap().disk_mb = 0;
        assert!(check_spec(Some(&sim_no_disk), "root/me", &cfg()).is_ok());
    }

    #[test]
    fn idempotency_keys_are_scoped_by_project() {
        let a = scoped_lease_id("root/a", "job-1");
        assert_eq!(a, scoped_lease_id("root/a", "job-1"), "the same key finds the same lease");
        assert_ne!(a, scoped_lease_id("root/b", "job-1"));
        assert_ne!(scoped_lease_id("root/a", "b\0job-1"), scoped_lease_id("root/a\0b", "job-1"));
        assert_eq!(a.len(), 24);
        assert!(ids::validate_lease(&a).is_ok());
    }

    #[test]
    fn batch_counts_and_lease_ids() {
        assert!(check_batch_count(1).is_ok());
        assert!(check_batch_count(32_768).is_ok());
        for bad in [0, 32_769, u32::MAX] {
            let e = check_batch_count(bad).unwrap_err();
            assert_eq!(ApiError::from(e).reason, Reason::InvalidArgument);
        }
        assert_eq!(check_lease_id("").unwrap(), None);
        assert_eq!(check_lease_id("job-1").unwrap().as_deref(), Some("job-1"));
        assert!(check_lease_id("Job_1").is_err());
        assert!(check_lease_id(&"a".repeat(41)).is_err());
    }

    #[test]
    fn timeout_updates_and_page_sizes() {
        let t = TtlConfig::default();
        let mut req = pb::SetSandboxTimeoutRequest { id: "e.l".into(), ttl_max_s: Some(60), ..Default::default() };
        assert!(check_timeout_update(&req, &t).is_ok());
        req.ttl_paused_s = Some(0);
        assert_eq!(check_timeout_update(&req, &t).unwrap_err(), AdmissionError::TtlZero { field: "ttl_paused_s" });
        req.ttl_paused_s = Some(u64::MAX);
        assert!(matches!(check_timeout_update(&req, &t).unwrap_err(), AdmissionError::TtlAboveMax { .. }));
        assert_eq!(page_size(0).unwrap(), 100);
        assert_eq!(page_size(1000).unwrap(), 1000);
        assert!(page_size(1001).is_err());
    }

    #[test]
    fn token_bucket_with_an_injected_clock() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10.0, 3.0, t0);
        for _ in 0..3 {
            assert!(b.try_take(t0).is_ok());
        }
        let wait = b.try_take(t0).unwrap_err();
        assert!((wait.as_secs_f64() - 0.1).abs() < 1e-6, "{wait:?}");
        // 50 ms later half a token is there: still refused, with half the wait.
        let wait = b.try_take(t0 + Duration::from_millis(50)).unwrap_err();
        assert!((wait.as_secs_f64() - 0.05).abs() < 1e-6, "{wait:?}");
        assert!(b.try_take(t0 + Duration::from_millis(100)).is_ok());
        // A long pause refills up to the burst, not beyond.
        let later = t0 + Duration::from_secs(60);
        for _ in 0..3 {
            assert!(b.try_take(later).is_ok());
        }
        assert!(b.try_take(later).is_err());

        let mut rl = RateLimiter::new(1.0, 1.0);
        assert!(rl.try_take("alice", t0).is_ok());
        assert!(rl.try_take("alice", t0).is_err());
        assert!(rl.try_take("bob", t0).is_ok(), "buckets are per principal");
    }
}
