//! Backups: gzipped JSON `{"version":1, hash_key, epoch, projects, principals, tokens, grants,
//! pools}`.
//!
//! No leases and no locks: after a restore, reconciliation rebuilds the leases from what the
//! edges report. [`Snapshot::validate`] checks a snapshot is whole and self-consistent (root
//! present, every parent, principal and project referenced exists) before the state machine
//! replaces anything, so a bad backup changes nothing.

use std::collections::BTreeSet;
use std::io::{Read, Write as _};

use serde::{Deserialize, Serialize};

use crate::error::IamError;
use crate::model::{GrantRecord, PrincipalRecord, ProjectRecord, TokenRecord, validate_permission};
use crate::token;
use opendsec_common::ids;

pub const BACKUP_VERSION: u32 = 1;
/// Largest decompressed backup accepted (guards against a gzip bomb).
pub const MAX_BACKUP_BYTES: u64 = 1 << 30;

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    pub version: u32,
    pub hash_key: String,
    pub epoch: u64,
    pub projects: Vec<ProjectRecord>,
    pub principals: Vec<PrincipalRecord>,
    pub tokens: Vec<TokenRecord>,
    pub grants: Vec<GrantRecord>,
    /// Absent in backups made before pools: a restore of one keeps the pools there are.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pools: Option<Vec<crate::model::PoolRecord>>,
}

fn bad(msg: impl Into<String>) -> IamError {
    IamError::BadBackup(msg.into())
}

impl Snapshot {
    /// gzip(JSON).
    pub fn encode(&self) -> Result<Vec<u8>, IamError> {
        let json = serde_json::to_vec(self).map_err(|source| IamError::Encode { table: "backup", source })?;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        // Writing into a Vec cannot fail; map anyway rather than unwrap.
        gz.write_all(&json).map_err(|e| bad(format!("compressing: {e}")))?;
        gz.finish().map_err(|e| bad(format!("compressing: {e}")))
    }

    /// Decompresses and parses a backup, then validates it.
    pub fn decode(data: &[u8]) -> Result<Snapshot, IamError> {
        if data.is_empty() {
            return Err(bad("empty"));
        }
        let mut json = Vec::new();
        flate2::read::GzDecoder::new(data)
            .take(MAX_BACKUP_BYTES + 1)
            .read_to_end(&mut json)
            .map_err(|e| bad(format!("not gzip data or truncated: {e}")))?;
        if json.len() as u64 > MAX_BACKUP_BYTES {
            return Err(bad(format!("larger than {MAX_BACKUP_BYTES} bytes uncompressed")));
        }
        let snap: Snapshot = serde_json::from_slice(&json).map_err(|e| bad(format!("not a backup: {e}")))?;
        snap.validate()?;
        Ok(snap)
    }

    /// Checks the snapshot is a whole, consistent IAM state.
    pub fn validate(&self) -> Result<(), IamError> {
        if self.version != BACKUP_VERSION {
            return Err(bad(format!("unsupported version {} (expected {BACKUP_VERSION})", self.version)));
        }
        if !token::is_hex32(&self.hash_key) {
            return Err(bad("hash_key is not 32 bytes of lowercase hex"));
        }
        let mut projects = BTreeSet::new();
        for p in &self.projects {
            ids::validate_project(&p.path).map_err(|e| bad(e.message))?;
            p.quota.validate().map_err(|e| bad(format!("project {}: {e}", p.path)))?;
            if !projects.insert(p.path.as_str()) {
                return Err(bad(format!("project {} appears twice", p.path)));
            }
        }
        if !projects.contains(ids::ROOT_PROJECT) {
            return Err(bad("the root project is missing"));
        }
        for p in &projects {
            if let Some(parent) = ids::parent_project(p)
                && !projects.contains(parent)
            {
                return Err(bad(format!("project {p} has no parent {parent}")));
            }
        }
        let mut principals = BTreeSet::new();
        for p in &self.principals {
            ids::validate_principal(&p.name).map_err(|e| bad(e.message))?;
            if !projects.contains(p.project.as_str()) {
                return Err(bad(format!("principal {} is in unknown project {}", p.name, p.project)));
            }
            if !principals.insert(p.name.as_str()) {
                return Err(bad(format!("principal {} appears twice", p.name)));
            }
        }
        let mut tokens = BTreeSet::new();
        for t in &self.tokens {
            if !token::valid_id(&t.id) {
                return Err(bad(format!("token id {:?} is not valid", t.id.chars().take(40).collect::<String>())));
            }
            if !principals.contains(t.principal.as_str()) {
                return Err(bad(format!("token {} belongs to unknown principal {}", t.id, t.principal)));
            }
            if !token::is_hex32(&t.secret_hash) {
                return Err(bad(format!("token {} has a malformed hash", t.id)));
            }
            if !tokens.insert(t.id.as_str()) {
                return Err(bad(format!("token {} appears twice", t.id)));
            }
        }
        let mut grants = BTreeSet::new();
        for g in &self.grants {
            validate_permission(&g.permission).map_err(|e| bad(e.to_string()))?;
            if !principals.contains(g.principal.as_str()) {
                return Err(bad(format!("grant to unknown principal {}", g.principal)));
            }
            if !projects.contains(g.project.as_str()) {
                return Err(bad(format!("grant on unknown project {}", g.project)));
            }
            if !grants.insert(g) {
                return Err(bad(format!("grant {} appears twice", g.key())));
            }
        }
        let mut pools = BTreeSet::new();
        for p in self.pools.iter().flatten() {
            crate::model::validate_pool(p).map_err(|e| bad(format!("pool {}: {e}", p.key())))?;
            if !projects.contains(p.project.as_str()) {
                return Err(bad(format!("pool {} is in unknown project {}", p.name, p.project)));
            }
            if !pools.insert(p.key()) {
                return Err(bad(format!("pool {} appears twice", p.key())));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snap() -> Snapshot {
        Snapshot {
            version: 1,
            hash_key: "00".repeat(32),
            epoch: 3,
            projects: vec![ProjectRecord {
                path: "root".into(),
                quota: Default::default(),
                created_at_ms: 1,
                egress_ceiling: None,
            }],
            principals: vec![PrincipalRecord { name: "admin".into(), project: "root".into(), created_at_ms: 1 }],
            tokens: vec![],
            grants: vec![GrantRecord { principal: "admin".into(), project: "root".into(), permission: "*".into() }],
            pools: None,
        }
    }

    #[test]
    fn round_trip() {
        let s = snap();
        assert_eq!(Snapshot::decode(&s.encode().unwrap()).unwrap(), s);
    }

    #[test]
    fn garbage_and_truncation_are_rejected() {
        let data = snap().encode().unwrap();
        for bad in [&b""[..], b"hello", &data[..data.len() / 2], &data[..10]] {
            assert!(matches!(Snapshot::decode(bad), Err(IamError::BadBackup(_))));
        }
    }

    #[test]
    fn inconsistent_snapshots_are_rejected() {
        let mut s = snap();
        s.projects.push(ProjectRecord {
            path: "root/a/b".into(),
            quota: Default::default(),
            created_at_ms: 1,
            egress_ceiling: None,
        });
        assert!(s.validate().is_err());
        let mut s = snap();
        s.grants[0].permission = "everything".into();
        assert!(s.validate().is_err());
        let mut s = snap();
        s.projects.clear();
        assert!(s.validate().is_err());
    }
}
