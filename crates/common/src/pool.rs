//! Warm pools' templates and their revisions, shared by IAM (which stores pools) and the
//! edges (which keep their members): a revision names one exact template, so that an edge
//! hands out only members started from the template in force.
//!
//! Invariant: the revision is the sha256 of the template's canonical form, the JSON of
//! [`PoolTemplate`] with its fields in declaration order and its maps and lists sorted. Two
//! templates that mean the same have one revision, whatever order a client sent them in;
//! any change to what a member is started with gives another.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What every member of a pool is started with (the claim sets the rest: id, labels, TTLs).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolTemplate {
    pub image: String,
    pub backend: String,
    pub cpu_millis: u32,
    pub memory_mb: u64,
    pub disk_mb: u64,
    pub env: BTreeMap<String, String>,
    /// Egress rules in their text form, sorted.
    pub egress: Vec<String>,
    pub user: String,
    pub workdir: String,
}

impl PoolTemplate {
    /// The template of a pool message (egress rules as sent, in text form).
    pub fn from_pb(t: &opendsec_proto::v1::PoolTemplate) -> PoolTemplate {
        let r = t.resources.unwrap_or_default();
        PoolTemplate {
            image: t.image.clone(),
            backend: t.backend.clone(),
            cpu_millis: r.cpu_millis,
            memory_mb: r.memory_mb,
            disk_mb: r.disk_mb,
            env: t.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            egress: t.egress.clone(),
            user: t.user.clone(),
            workdir: t.workdir.clone(),
        }
    }

    /// The template as it is hashed: egress rules sorted and deduplicated.
    pub fn canonical(&self) -> PoolTemplate {
        let mut t = self.clone();
        t.egress.sort();
        t.egress.dedup();
        t
    }

    /// The template's revision: the hex sha256 of its canonical JSON.
    pub fn revision(&self) -> String {
        let json = serde_json::to_vec(&self.canonical()).expect("a template always encodes");
        crate::hex::to_hex(&Sha256::digest(&json))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template() -> PoolTemplate {
        PoolTemplate {
            image: "python:3.12".into(),
            backend: "fncall".into(),
            cpu_millis: 1000,
            memory_mb: 512,
            disk_mb: 1024,
            env: [("A".to_string(), "1".to_string()), ("B".to_string(), "2".to_string())].into(),
            egress: vec!["pypi.org:tcp/443".into(), "198.51.100.0/24".into()],
            user: "user".into(),
            workdir: "/work".into(),
        }
    }

    #[test]
    fn the_same_template_in_any_order_has_one_revision_and_any_change_another() {
        let a = template();
        let mut b = template();
        b.egress.reverse();
        b.egress.push("pypi.org:tcp/443".into());
        assert_eq!(a.revision(), b.revision());
        type Change = Box<dyn Fn(&mut PoolTemplate)>;
        let changes: Vec<Change> = vec![
            Box::new(|t| t.image = "python:3.13".into()),
            Box::new(|t| t.cpu_millis += 1),
            Box::new(|t| t.memory_mb += 1),
            Box::new(|t| t.disk_mb += 1),
            Box::new(|t| {
                t.env.insert("C".into(), "3".into());
            }),
            Box::new(|t| t.egress.push("*".into())),
            Box::new(|t| t.user = "root".into()),
            Box::new(|t| t.workdir = "/".into()),
            Box::new(|t| t.backend = "container".into()),
        ];
        for change in changes {
            let mut c = template();
            change(&mut c);
            assert_ne!(c.revision(), a.revision(), "{c:?}");
        }
    }

    #[test]
    fn the_revision_of_a_template_is_stable() {
        // Golden: the revision is part of what edges and IAM agree on across versions.
        let t = PoolTemplate { image: "busybox:latest".into(), backend: "fncall".into(), ..Default::default() };
        let json = r#"{"image":"busybox:latest","backend":"fncall","cpu_millis":0,"memory_mb":0,"disk_mb":0,"env":{},"egress":[],"user":"","workdir":""}"#;
        let want = crate::hex::to_hex(&Sha256::digest(json.as_bytes()));
        assert_eq!(t.revision(), want);
    }
}
