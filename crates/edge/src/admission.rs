//! Final admission of a creation, as pure functions: the request's validity, the node's
//! capacity (sum of live sandboxes plus the new one within capacity on every dimension, and the
//! sandbox count within `max_sandboxes`), and host pressure from a host reading.
//!
//! The edge has the last word on admission: the apiserver placed from a snapshot that may be
//! stale, so everything here is checked again on the edge.

use opendsec_common::config::KNOWN_BACKENDS;
use opendsec_common::{ids, spec};
use opendsec_proto::v1::{EdgeCreateRequest, Pressure};

use crate::record::{PriorityRecord, ResourcesRecord};

/// Sanity bounds: a request above these is a mistake, not a big sandbox.
pub const MAX_CPU_MILLIS: u32 = 1024 * 1000;
pub const MAX_MEMORY_MB: u64 = 64 << 20;
pub const MAX_DISK_MB: u64 = 1 << 30;
pub const MAX_GPUS: u32 = 64;
pub const MAX_IMAGE: usize = 1024;
pub const MAX_USER: usize = 256;
pub const MAX_WORKDIR: usize = 4096;

/// Memory pressure never uses a reserve below this (128 MiB).
pub const MIN_MEMORY_RESERVE_MB: u64 = 128;
/// CPU pressure: PSI `some avg10` above this percentage.
pub const CPU_PRESSURE_AVG10: f64 = 90.0;

/// Checks a creation request; the message says what is wrong.
pub fn validate_create(req: &EdgeCreateRequest) -> Result<(), String> {
    ids::validate_lease(&req.lease_id).map_err(|e| e.message)?;
    ids::validate_principal(&req.principal).map_err(|e| e.message)?;
    let spec = req.spec.as_ref().ok_or("spec is required")?;
    ids::validate_project(&spec.project).map_err(|e| format!("spec.project: {}", e.message))?;
    if spec.backend.is_empty() {
        return Err("spec.backend is empty".into());
    }
    if !KNOWN_BACKENDS.contains(&spec.backend.as_str()) {
        let shown: String = spec.backend.chars().take(40).collect();
        return Err(format!("spec.backend {shown:?} is not a backend; known: {}", KNOWN_BACKENDS.join(", ")));
    }
    let r = ResourcesRecord::from_proto(spec.resources.as_ref());
    for (field, value, max) in [
        ("cpu_millis", u64::from(r.cpu_millis), u64::from(MAX_CPU_MILLIS)),
        ("memory_mb", r.memory_mb, MAX_MEMORY_MB),
        ("disk_mb", r.disk_mb, MAX_DISK_MB),
        ("gpus", u64::from(r.gpus), u64::from(MAX_GPUS)),
    ] {
        if value > max {
            return Err(format!("spec.resources.{field} {value} is above the limit {max}"));
        }
    }
    if PriorityRecord::from_proto(spec.priority).is_none() {
        return Err(format!("spec.priority {} is not a priority", spec.priority));
    }
    spec::check_labels(&spec.labels).map_err(|e| format!("spec.labels: {e}"))?;
    spec::check_env(&spec.env).map_err(|e| format!("spec.env: {e}"))?;
    if spec.pool.len() > 63 || !spec.pool.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-') {
        return Err("spec.pool: [a-z0-9-], at most 63 bytes".into());
    }
    if req.pool_revision.len() > 64 || !req.pool_revision.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("pool_revision: a hex sha256".into());
    }
    for (field, value, max) in
        [("image", &spec.image, MAX_IMAGE), ("user", &spec.user, MAX_USER), ("workdir", &spec.workdir, MAX_WORKDIR)]
    {
        if value.len() > max {
            return Err(format!("spec.{field} is longer than {max} bytes"));
        }
    }
    if let Some(n) = &spec.network {
        opendsec_common::egress::from_pb_list(&n.egress).map_err(|e| format!("spec.network: {e}"))?;
    }
    Ok(())
}

/// What the edge offers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Capacity {
    pub cpu_millis: u64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub gpus: u64,
    pub max_sandboxes: u32,
}

/// What live sandboxes hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    pub cpu_millis: u64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub gpus: u64,
    pub sandboxes: u32,
}

impl Totals {
    pub fn add(&mut self, r: ResourcesRecord) {
        self.cpu_millis += u64::from(r.cpu_millis);
        self.memory_mb += r.memory_mb;
        self.disk_mb += r.disk_mb;
        self.gpus += u64::from(r.gpus);
        self.sandboxes += 1;
    }

    /// Both together (sandboxes and warm pool members).
    pub fn plus(self, o: Totals) -> Totals {
        Totals {
            cpu_millis: self.cpu_millis.saturating_add(o.cpu_millis),
            memory_mb: self.memory_mb.saturating_add(o.memory_mb),
            disk_mb: self.disk_mb.saturating_add(o.disk_mb),
            gpus: self.gpus.saturating_add(o.gpus),
            sandboxes: self.sandboxes.saturating_add(o.sandboxes),
        }
    }

    pub fn sub(&mut self, r: ResourcesRecord) {
        // Every sub follows the add of the same record; saturation only guards the invariant.
        self.cpu_millis = self.cpu_millis.saturating_sub(u64::from(r.cpu_millis));
        self.memory_mb = self.memory_mb.saturating_sub(r.memory_mb);
        self.disk_mb = self.disk_mb.saturating_sub(r.disk_mb);
        self.gpus = self.gpus.saturating_sub(u64::from(r.gpus));
        self.sandboxes = self.sandboxes.saturating_sub(1);
    }
}

/// Why a sandbox does not fit: the dimension, what was asked and what is left.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapacityRefusal {
    pub dimension: &'static str,
    pub requested: u64,
    pub available: u64,
}

impl std::fmt::Display for CapacityRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "not enough {}: requested {}, available {}", self.dimension, self.requested, self.available)
    }
}

/// Whether a sandbox with `want` fits next to what live sandboxes hold.
pub fn check_capacity(cap: &Capacity, used: &Totals, want: ResourcesRecord) -> Result<(), CapacityRefusal> {
    if used.sandboxes >= cap.max_sandboxes {
        return Err(CapacityRefusal {
            dimension: "sandboxes",
            requested: 1,
            available: u64::from(cap.max_sandboxes.saturating_sub(used.sandboxes)),
        });
    }
    for (dimension, want, used, cap) in [
        ("cpu", u64::from(want.cpu_millis), used.cpu_millis, cap.cpu_millis),
        ("memory", want.memory_mb, used.memory_mb, cap.memory_mb),
        ("disk", want.disk_mb, used.disk_mb, cap.disk_mb),
        ("gpus", u64::from(want.gpus), used.gpus, cap.gpus),
    ] {
        if want > 0 && used.saturating_add(want) > cap {
            return Err(CapacityRefusal { dimension, requested: want, available: cap.saturating_sub(used) });
        }
    }
    Ok(())
}

/// One look at the host (each part `None` when it cannot be read).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct HostReading {
    pub mem_total_mb: Option<u64>,
    pub mem_available_mb: Option<u64>,
    pub disk_free_mb: Option<u64>,
    /// PSI `some avg10` of /proc/pressure/cpu, in percent.
    pub cpu_some_avg10: Option<f64>,
}

/// Host pressure: memory below the reserve (`fraction` of RAM, at least 128 MiB), free disk of
/// the state's file system below `disk_reserve_mb`, CPU PSI above 90 %. What cannot be read
/// is not pressure.
pub fn pressure(r: &HostReading, memory_reserve_fraction: f64, disk_reserve_mb: u64) -> Pressure {
    let memory = match (r.mem_total_mb, r.mem_available_mb) {
        (Some(total), Some(avail)) => {
            let reserve = ((total as f64) * memory_reserve_fraction) as u64;
            avail < reserve.max(MIN_MEMORY_RESERVE_MB)
        }
        _ => false,
    };
    let disk = r.disk_free_mb.is_some_and(|free| free < disk_reserve_mb);
    let cpu = r.cpu_some_avg10.is_some_and(|p| p > CPU_PRESSURE_AVG10);
    Pressure { memory, disk, cpu }
}

/// The first dimension under pressure, for the refusal message.
pub fn pressure_refusal(p: &Pressure) -> Option<&'static str> {
    if p.memory {
        Some("memory")
    } else if p.disk {
        Some("disk")
    } else if p.cpu {
        Some("cpu")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opendsec_proto::v1::{Resources, SandboxSpec};

    fn req() -> EdgeCreateRequest {
        EdgeCreateRequest {
            lease_id: "abc123".into(),
            principal: "alice".into(),
            pool_revision: String::new(),
            moved_in: None,
            member_lease: String::new(),
            spec: Some(SandboxSpec {
                project: "root/a".into(),
                backend: "sim".into(),
                resources: Some(Resources { cpu_millis: 1000, memory_mb: 512, disk_mb: 0, gpus: 0 }),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn a_good_request_passes() {
        validate_create(&req()).unwrap();
    }

    #[test]
    fn bad_requests_say_what_is_wrong() {
        type Mutation = Box<dyn Fn(&mut EdgeCreateRequest)>;
        let cases: Vec<(Mutation, &str)> = vec![
            (Box::new(|r| r.lease_id = "Bad/Lease".into()), "lease id"),
            (Box::new(|r| r.lease_id = String::new()), "lease id"),
            (Box::new(|r| r.principal = String::new()), "principal"),
            (Box::new(|r| r.spec = None), "spec"),
            (Box::new(|r| r.spec.as_mut().unwrap().project = "team".into()), "spec.project"),
            (Box::new(|r| r.spec.as_mut().unwrap().backend = "kvm".into()), "spec.backend"),
            (Box::new(|r| r.spec.as_mut().unwrap().backend = String::new()), "spec.backend"),
            (Box::new(|r| r.spec.as_mut().unwrap().resources.as_mut().unwrap().cpu_millis = u32::MAX), "cpu_millis"),
            (Box::new(|r| r.spec.as_mut().unwrap().resources.as_mut().unwrap().memory_mb = u64::MAX), "memory_mb"),
            (Box::new(|r| r.spec.as_mut().unwrap().priority = 7), "priority"),
            (
                Box::new(|r| {
                    r.spec.as_mut().unwrap().network = Some(opendsec_proto::v1::NetworkSpec {
                        egress: vec![opendsec_proto::v1::EgressRule {
                            target: "192.0.2.1/24".into(),
                            ..Default::default()
                        }],
                    })
                }),
                "spec.network",
            ),
            (
                Box::new(|r| {
                    r.spec.as_mut().unwrap().env.insert("A=B".into(), "x".into());
                }),
                "spec.env",
            ),
            (
                Box::new(|r| {
                    r.spec.as_mut().unwrap().labels.insert(String::new(), "x".into());
                }),
                "spec.labels",
            ),
            (Box::new(|r| r.spec.as_mut().unwrap().image = "x".repeat(5000)), "spec.image"),
        ];
        for (mutate, needle) in cases {
            let mut r = req();
            mutate(&mut r);
            let msg = validate_create(&r).unwrap_err();
            assert!(msg.contains(needle), "{needle}: {msg}");
        }
    }

    fn cap() -> Capacity {
        Capacity { cpu_millis: 4000, memory_mb: 4096, disk_mb: 10_000, gpus: 1, max_sandboxes: 3 }
    }

    fn res(cpu: u32, mem: u64, gpus: u32) -> ResourcesRecord {
        ResourcesRecord { cpu_millis: cpu, memory_mb: mem, disk_mb: 0, gpus }
    }

    #[test]
    fn capacity_is_checked_on_every_dimension() {
        let mut used = Totals::default();
        used.add(res(3000, 1024, 0));
        assert!(check_capacity(&cap(), &used, res(1000, 3072, 1)).is_ok());
        let refusal = check_capacity(&cap(), &used, res(1001, 1, 0)).unwrap_err();
        assert_eq!(refusal, CapacityRefusal { dimension: "cpu", requested: 1001, available: 1000 });
        assert_eq!(check_capacity(&cap(), &used, res(1, 3073, 0)).unwrap_err().dimension, "memory");
        assert_eq!(check_capacity(&cap(), &used, res(1, 1, 2)).unwrap_err().dimension, "gpus");
        used.add(res(0, 0, 0));
        used.add(res(0, 0, 0));
        assert_eq!(check_capacity(&cap(), &used, res(0, 0, 0)).unwrap_err().dimension, "sandboxes");
        used.sub(res(0, 0, 0));
        assert!(check_capacity(&cap(), &used, res(0, 0, 0)).is_ok());
    }

    #[test]
    fn pressure_from_a_reading() {
        let mut r = HostReading {
            mem_total_mb: Some(10_000),
            mem_available_mb: Some(5_000),
            disk_free_mb: Some(2_000),
            cpu_some_avg10: Some(10.0),
        };
        assert_eq!(pressure(&r, 0.1, 1024), Pressure::default());
        r.mem_available_mb = Some(999);
        assert!(pressure(&r, 0.1, 1024).memory);
        // The reserve is at least 128 MiB even when the fraction gives less.
        r.mem_available_mb = Some(127);
        assert!(pressure(&r, 0.0, 1024).memory);
        r.mem_available_mb = Some(5_000);
        r.disk_free_mb = Some(1000);
        assert_eq!(pressure_refusal(&pressure(&r, 0.1, 1024)), Some("disk"));
        r.disk_free_mb = None;
        r.cpu_some_avg10 = Some(95.0);
        assert_eq!(pressure_refusal(&pressure(&r, 0.1, 1024)), Some("cpu"));
        assert_eq!(pressure(&HostReading::default(), 0.1, 1024), Pressure::default());
    }
}
