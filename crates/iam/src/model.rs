//! The records IAM keeps, as plain data: projects, principals, tokens, grants, leases, locks
//! and the meta row, plus the quota and usage arithmetic and the permission catalogue.
//!
//! These structs are what the store writes (as versioned JSON rows, see `store`) and what
//! commands carry, so their serde shape is a persisted format: fields are only ever added
//! (with `#[serde(default)]`), never renamed or removed.

use serde::{Deserialize, Serialize};

use crate::error::IamError;

/// Every permission a grant may name. `*` holds every permission.
pub const PERMISSIONS: [&str; 13] = [
    "*",
    "sandbox.create",
    "sandbox.view",
    "sandbox.operate",
    "project.view",
    "project.manage",
    "principal.manage",
    "grant.manage",
    "iam.admin",
    "layer.publish",
    "layer.use",
    "pool.manage",
    "edge.manage",
];

/// Checks that `permission` is in the catalogue.
pub fn validate_permission(permission: &str) -> Result<(), IamError> {
    if PERMISSIONS.contains(&permission) {
        Ok(())
    } else {
        let shown: String = permission.chars().take(64).collect();
        Err(IamError::InvalidArgument(format!("unknown permission {shown:?}; known: {}", PERMISSIONS.join(", "))))
    }
}

/// Largest value a quota key may be set to: far above any real cluster, low enough that sums
/// of usage and demand never come near overflowing.
pub const MAX_QUOTA_VALUE: u64 = 1 << 62;

/// Limits on what one lease may ask for; anything above is a mistake, not a sandbox.
pub const MAX_CPU_MILLIS: u64 = 1_024_000;
pub const MAX_MEMORY_MB: u64 = 16 * 1024 * 1024;
pub const MAX_DISK_MB: u64 = 64 * 1024 * 1024;
pub const MAX_GPUS: u64 = 64;

/// The quota keys, in the order they are checked and reported. `store_bytes` counts the
/// image store (layers of the images a project published, each once), not leases.
pub const QUOTA_KEYS: [&str; 6] = ["cpu_millis", "memory_mb", "disk_mb", "gpus", "sandboxes", "store_bytes"];

/// What a project sets for itself; `None` inherits the parent's value (unlimited at the root).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quota {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpu_millis: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub memory_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub disk_mb: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gpus: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sandboxes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_bytes: Option<u64>,
}

impl Quota {
    /// The keys in [`QUOTA_KEYS`] order.
    pub fn values(&self) -> [Option<u64>; 6] {
        [self.cpu_millis, self.memory_mb, self.disk_mb, self.gpus, self.sandboxes, self.store_bytes]
    }

    pub fn from_values(v: [Option<u64>; 6]) -> Quota {
        Quota { cpu_millis: v[0], memory_mb: v[1], disk_mb: v[2], gpus: v[3], sandboxes: v[4], store_bytes: v[5] }
    }

    pub fn validate(&self) -> Result<(), IamError> {
        for (key, value) in QUOTA_KEYS.iter().zip(self.values()) {
            if let Some(v) = value
                && v > MAX_QUOTA_VALUE
            {
                return Err(IamError::InvalidArgument(format!(
                    "quota {key} = {v} is absurd (at most {MAX_QUOTA_VALUE})"
                )));
            }
        }
        Ok(())
    }
}

/// What a project and its subprojects hold (derived from leases, never persisted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub cpu_millis: u64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub gpus: u64,
    pub sandboxes: u64,
    /// Bytes of the store's layers the project's and its subprojects' images name, each
    /// distinct layer once (derived from image charges, not leases).
    #[serde(default)]
    pub store_bytes: u64,
}

impl Usage {
    pub fn values(&self) -> [u64; 6] {
        [self.cpu_millis, self.memory_mb, self.disk_mb, self.gpus, self.sandboxes, self.store_bytes]
    }

    /// What one lease counts: its resources and one sandbox.
    pub fn of(r: &Resources) -> Usage {
        Usage {
            cpu_millis: r.cpu_millis,
            memory_mb: r.memory_mb,
            disk_mb: r.disk_mb,
            gpus: r.gpus,
            sandboxes: 1,
            store_bytes: 0,
        }
    }

    pub fn add(&mut self, o: &Usage) {
        // Saturating: values are bounded far below overflow (MAX_* per lease), so saturation
        // only guards against a broken invariant turning into a panic.
        self.cpu_millis = self.cpu_millis.saturating_add(o.cpu_millis);
        self.memory_mb = self.memory_mb.saturating_add(o.memory_mb);
        self.disk_mb = self.disk_mb.saturating_add(o.disk_mb);
        self.gpus = self.gpus.saturating_add(o.gpus);
        self.sandboxes = self.sandboxes.saturating_add(o.sandboxes);
        self.store_bytes = self.store_bytes.saturating_add(o.store_bytes);
    }

    pub fn sub(&mut self, o: &Usage) {
        self.cpu_millis = self.cpu_millis.saturating_sub(o.cpu_millis);
        self.memory_mb = self.memory_mb.saturating_sub(o.memory_mb);
        self.disk_mb = self.disk_mb.saturating_sub(o.disk_mb);
        self.gpus = self.gpus.saturating_sub(o.gpus);
        self.sandboxes = self.sandboxes.saturating_sub(o.sandboxes);
        self.store_bytes = self.store_bytes.saturating_sub(o.store_bytes);
    }

    pub fn is_zero(&self) -> bool {
        self.values().iter().all(|v| *v == 0)
    }
}

/// What a lease reserves.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resources {
    pub cpu_millis: u64,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub gpus: u64,
}

impl Resources {
    /// Rejects what no sandbox can ask for (Admit): zero CPU or memory, or absurd amounts.
    pub fn validate(&self) -> Result<(), IamError> {
        if self.cpu_millis == 0 || self.cpu_millis > MAX_CPU_MILLIS {
            return Err(IamError::InvalidArgument(format!(
                "resources.cpu_millis = {} is out of range 1..={MAX_CPU_MILLIS}",
                self.cpu_millis
            )));
        }
        if self.memory_mb == 0 || self.memory_mb > MAX_MEMORY_MB {
            return Err(IamError::InvalidArgument(format!(
                "resources.memory_mb = {} is out of range 1..={MAX_MEMORY_MB}",
                self.memory_mb
            )));
        }
        self.validate_bounds()
    }

    /// Only the upper bounds: what reconciliation checks before adopting a sandbox that exists.
    pub fn validate_bounds(&self) -> Result<(), IamError> {
        for (name, v, max) in [
            ("cpu_millis", self.cpu_millis, MAX_CPU_MILLIS),
            ("memory_mb", self.memory_mb, MAX_MEMORY_MB),
            ("disk_mb", self.disk_mb, MAX_DISK_MB),
            ("gpus", self.gpus, MAX_GPUS),
        ] {
            if v > max {
                return Err(IamError::InvalidArgument(format!("resources.{name} = {v} is above {max}")));
            }
        }
        Ok(())
    }
}

/// What one image of the store costs its project: the layers (and a microVM snapshot's
/// files) it names, by id, with their sizes. A project's `store_bytes` is the sum over the
/// distinct ids its and its subprojects' images name: a layer named by many images (forks of
/// one base, re-tags) counts once.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageCharge {
    pub project: String,
    /// `repo:tag`.
    pub name: String,
    pub parts: Vec<StoredPart>,
}

/// One layer or snapshot file set of the store, as an image names it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredPart {
    pub id: String,
    pub bytes: u64,
}

impl ImageCharge {
    pub fn key(&self) -> String {
        image_key(&self.project, &self.name)
    }
}

/// The store row key of image `name` of `project`.
pub fn image_key(project: &str, name: &str) -> String {
    format!("{project}//{name}")
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProjectRecord {
    pub path: String,
    #[serde(default)]
    pub quota: Quota,
    pub created_at_ms: i64,
    /// The most egress a sandbox of this project (or a subproject) may ask for, as egress
    /// rules in text form; `None`: no ceiling of its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress_ceiling: Option<Vec<String>>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrincipalRecord {
    pub name: String,
    pub project: String,
    pub created_at_ms: i64,
}

/// A token: only the HMAC of its secret is kept.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenRecord {
    pub id: String,
    pub principal: String,
    /// HMAC-SHA256(hash_key, secret), lowercase hex.
    pub secret_hash: String,
    #[serde(default)]
    pub description: String,
    pub created_at_ms: i64,
    /// 0 = never.
    #[serde(default)]
    pub expires_at_ms: i64,
    #[serde(default)]
    pub revoked: bool,
    /// A token IAM minted for one sandbox (`MintSandboxTokens`): it acts as its principal on
    /// that sandbox only, and goes with the sandbox's lease. Not written when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scope: Option<TokenScope>,
}

/// What a sandbox's token may reach.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenScope {
    /// The sandbox's lease (a sandbox id is `<edge>.<lease>`).
    pub lease: String,
    pub kind: ScopeKind,
    /// The token it was minted with: it works only while that one does (revoked, expired or
    /// gone, the sandbox's token is too).
    #[serde(default)]
    pub parent: String,
}

/// The two tokens E2B hands out for a sandbox.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScopeKind {
    /// Every Runtime call on the sandbox, and reading the sandbox (E2B's `envdAccessToken`).
    Runtime,
    /// The sandbox's ports only: HTTP into it and its code contexts' management, not running
    /// code (E2B's `trafficAccessToken`).
    Traffic,
}

impl ScopeKind {
    pub const ALL: [ScopeKind; 2] = [ScopeKind::Runtime, ScopeKind::Traffic];

    pub fn name(self) -> &'static str {
        match self {
            ScopeKind::Runtime => "runtime",
            ScopeKind::Traffic => "traffic",
        }
    }
}

impl TokenRecord {
    pub fn expired_at(&self, now_ms: i64) -> bool {
        self.expires_at_ms != 0 && now_ms >= self.expires_at_ms
    }
}

#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct GrantRecord {
    pub principal: String,
    pub project: String,
    pub permission: String,
}

impl GrantRecord {
    /// The store key: the three parts joined by spaces (none of them may contain one).
    pub fn key(&self) -> String {
        format!("{} {} {}", self.principal, self.project, self.permission)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaseRecord {
    pub id: String,
    pub project: String,
    /// Who admitted it (may be empty or name a deleted principal for adopted leases).
    #[serde(default)]
    pub principal: String,
    pub edge: String,
    pub resources: Resources,
    pub created_at_ms: i64,
    pub bound_at_ms: i64,
    /// An idle member of a warm pool (`<project>//<name>`): charged to the project like a
    /// sandbox while it waits, its lease the edge's (it releases it when the member goes).
    /// Not written when empty.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub pool: String,
}

/// A warm pool: members started ahead of time from `template` on every edge that offers its
/// backend, `size_per_edge` of them, which creations naming the pool claim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolRecord {
    pub project: String,
    pub name: String,
    /// Kept in canonical form; its revision is `template.revision()`.
    pub template: opendsec_common::pool::PoolTemplate,
    pub size_per_edge: u32,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

impl PoolRecord {
    /// The store key: `<project>//<name>`.
    pub fn key(&self) -> String {
        pool_key(&self.project, &self.name)
    }
}

pub fn pool_key(project: &str, name: &str) -> String {
    format!("{project}//{name}")
}

/// Most members of one pool on one edge.
pub const MAX_POOL_SIZE: u32 = 1000;

/// Checks a pool's name and template (`[a-z0-9][a-z0-9-]{0,62}`; an image, the `fncall`
/// backend, resources, a size).
pub fn validate_pool(r: &PoolRecord) -> Result<(), IamError> {
    let bad = |m: String| IamError::InvalidArgument(m);
    let n = r.name.as_bytes();
    let name_ok = !n.is_empty()
        && n.len() <= 63
        && (n[0].is_ascii_lowercase() || n[0].is_ascii_digit())
        && n.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-');
    if !name_ok {
        return Err(bad(format!(
            "pool name {:?}: [a-z0-9][a-z0-9-]{{0,62}}",
            r.name.chars().take(80).collect::<String>()
        )));
    }
    let t = &r.template;
    if t.image.is_empty() || t.image.len() > 512 {
        return Err(bad("pool template: an image of 1..=512 bytes".into()));
    }
    if t.backend != "fncall" {
        return Err(bad(format!("pool template: backend {:?}; pools are of the fncall backend", t.backend)));
    }
    if t.cpu_millis == 0 || t.memory_mb == 0 || t.disk_mb == 0 {
        return Err(bad("pool template: cpu_millis, memory_mb and disk_mb must be at least 1".into()));
    }
    if r.size_per_edge > MAX_POOL_SIZE {
        return Err(bad(format!("pool size {} is more than {MAX_POOL_SIZE} per edge", r.size_per_edge)));
    }
    let env: std::collections::HashMap<String, String> = t.env.clone().into_iter().collect();
    opendsec_common::spec::check_env(&env).map_err(|m| bad(format!("pool template env: {m}")))?;
    if t.egress.len() > 256 || t.egress.iter().any(|e| e.is_empty() || e.len() > 512) {
        return Err(bad("pool template egress: at most 256 rules of 1..=512 bytes".into()));
    }
    // Rules that do not parse would be dropped by whoever reads them: refused here instead.
    for e in &t.egress {
        opendsec_common::egress::Rule::parse(e).map_err(|why| bad(format!("pool template egress {e:?}: {why}")))?;
    }
    Ok(())
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockRecord {
    pub name: String,
    pub holder: String,
    pub expires_at_ms: i64,
}

/// The singleton meta row.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Meta {
    /// Whether the bootstrap command has been applied.
    #[serde(default)]
    pub bootstrapped: bool,
    /// Bumped by every change that can take access away; apiservers poll it.
    #[serde(default)]
    pub epoch: u64,
    /// The HMAC key for token secrets, lowercase hex of 32 bytes (empty before bootstrap).
    #[serde(default)]
    pub hash_key: String,
    /// Commands applied so far (standalone: persisted with every batch that changed state).
    #[serde(default)]
    pub applied_index: u64,
    /// The IAM cluster's id, made at its bootstrap: members of two clusters refuse each
    /// other's Raft messages. Kept by a restore.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub cluster: String,
    /// Replicated: each member's data directory id, as the leader first saw it (member id →
    /// id). A member whose directory is not the one recorded (wiped, replaced) is refused.
    #[serde(default, skip_serializing_if = "std::collections::BTreeMap::is_empty", with = "id_pairs")]
    pub members: std::collections::BTreeMap<u64, String>,
}

/// A cluster or data directory id as members make them: 32 hex digits (16 random bytes).
/// Nothing else is believed, recorded or repeated in a Raft message.
pub fn well_formed_id(id: &str) -> bool {
    id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())
}

/// A map by member id as a list of `[id, value]` pairs: rows are read through a flattened
/// envelope, where a JSON object's keys could only be strings.
mod id_pairs {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(m: &BTreeMap<u64, String>, s: S) -> Result<S::Ok, S::Error> {
        s.collect_seq(m.iter())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<u64, String>, D::Error> {
        Ok(Vec::<(u64, String)>::deserialize(d)?.into_iter().collect())
    }
}

/// A project as the Admin API shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProjectView {
    pub path: String,
    pub quota: Quota,
    pub effective: Quota,
    pub usage: Usage,
    pub created_at_ms: i64,
    pub egress_ceiling: Option<Vec<String>>,
}
