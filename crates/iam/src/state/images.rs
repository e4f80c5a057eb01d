//! The image store's quota (`store_bytes`): each image a project publishes is charged with
//! the parts of the store it names (layers, a microVM snapshot's files) and their sizes, as
//! the apiserver read them before writing the manifest. A project's `store_bytes` usage is
//! the sum over the distinct parts its and its subprojects' images name, so that a layer
//! named by many images (a hundred forks of one base, re-tags, composed images) counts once,
//! and a snapshot that copies nothing new costs nothing. A charge that would take the project
//! or an ancestor above its limit changes nothing (all or nothing).
//!
//! Derived state: per project, each part's number of images in the project's subtree that
//! name it (and its size); usage moves when a count goes between 0 and 1.

use super::*;
use crate::model::{ImageCharge, image_key};

/// Most parts one image may name (a manifest's layers are bounded far below this).
pub const MAX_IMAGE_PARTS: usize = 4096;

impl State {
    /// Counts `c`'s parts in (`add`) or out of the project chain of its project.
    pub(crate) fn count_image(&mut self, c: &ImageCharge, add: bool) {
        let mut parts: Vec<(&str, u64)> = c.parts.iter().map(|p| (p.id.as_str(), p.bytes)).collect();
        parts.sort_unstable();
        parts.dedup_by(|a, b| a.0 == b.0);
        for q in project_chain(&c.project) {
            let refs = self.stored.entry(q.to_string()).or_default();
            let mut moved = 0u64;
            for (id, bytes) in &parts {
                if add {
                    let e = refs.entry((*id).to_string()).or_insert((0, *bytes));
                    if e.0 == 0 {
                        moved = moved.saturating_add(e.1);
                    }
                    e.0 += 1;
                } else if let Some(e) = refs.get_mut(*id) {
                    e.0 = e.0.saturating_sub(1);
                    if e.0 == 0 {
                        moved = moved.saturating_add(e.1);
                        refs.remove(*id);
                    }
                }
            }
            if refs.is_empty() {
                self.stored.remove(q);
            }
            if let Some(u) = self.usage.get_mut(q) {
                u.store_bytes =
                    if add { u.store_bytes.saturating_add(moved) } else { u.store_bytes.saturating_sub(moved) };
            }
        }
    }

    /// The bytes `c` would add to project `q`'s usage: its parts `q` does not count yet.
    fn new_bytes(&self, q: &str, c: &ImageCharge) -> u64 {
        let refs = self.stored.get(q);
        let mut seen = HashSet::new();
        c.parts
            .iter()
            .filter(|p| seen.insert(p.id.as_str()) && refs.is_none_or(|r| !r.contains_key(&p.id)))
            .map(|p| p.bytes)
            .fold(0u64, u64::saturating_add)
    }

    /// `quota_exceeded` unless `bytes` more fit in `project`'s `store_bytes` and every
    /// ancestor's.
    pub fn store_room(&self, project: &str, bytes: u64) -> Result<(), IamError> {
        ids::validate_project(project).map_err(IamError::invalid)?;
        for q in project_chain(project) {
            let Some(limit) = self.projects.get(q).and_then(|p| p.quota.store_bytes) else { continue };
            let used = self.usage.get(q).map_or(0, |u| u.store_bytes);
            if bytes > 0 && used.saturating_add(bytes) > limit {
                return Err(IamError::QuotaExceeded {
                    project: q.to_string(),
                    key: "store_bytes",
                    limit,
                    used,
                    requested: bytes,
                });
            }
        }
        Ok(())
    }

    /// Whether the project still has images charged to it.
    pub(crate) fn has_images(&self, project: &str) -> bool {
        let prefix = image_key(project, "");
        self.images.range(prefix.clone()..).next().is_some_and(|(k, _)| k.starts_with(&prefix))
    }
}

pub(super) fn charge_image(st: &mut State, w: &mut Vec<Write>, c: &ImageCharge) -> Result<Output, IamError> {
    ids::validate_project(&c.project).map_err(IamError::invalid)?;
    if c.name.is_empty() || c.name.len() > 512 || c.name.contains("//") {
        return Err(IamError::InvalidArgument(format!("image name {:?} is not repo:tag", c.name)));
    }
    if c.parts.len() > MAX_IMAGE_PARTS || c.parts.iter().any(|p| p.id.is_empty() || p.id.len() > 128) {
        return Err(IamError::InvalidArgument(format!("image {} names malformed or too many parts", c.name)));
    }
    if !st.projects.contains_key(&c.project) {
        return Err(IamError::NotFound { kind: "project", name: c.project.clone() });
    }
    let key = c.key();
    let old = st.images.get(&key).cloned();
    if let Some(o) = &old {
        st.count_image(o, false);
    }
    for q in project_chain(&c.project) {
        let Some(limit) = st.projects.get(q).and_then(|p| p.quota.store_bytes) else { continue };
        let used = st.usage.get(q).map_or(0, |u| u.store_bytes);
        let more = st.new_bytes(q, c);
        if more > 0 && used.saturating_add(more) > limit {
            if let Some(o) = &old {
                st.count_image(o, true);
            }
            return Err(IamError::QuotaExceeded {
                project: q.to_string(),
                key: "store_bytes",
                limit,
                used,
                requested: more,
            });
        }
    }
    st.count_image(c, true);
    st.images.insert(key, c.clone());
    w.push(Write::Put(Row::Image(c.clone())));
    Ok(Output::Done)
}

pub(super) fn uncharge_image(
    st: &mut State,
    w: &mut Vec<Write>,
    project: &str,
    name: &str,
) -> Result<Output, IamError> {
    ids::validate_project(project).map_err(IamError::invalid)?;
    let key = image_key(project, name);
    if let Some(c) = st.images.remove(&key) {
        st.count_image(&c, false);
        w.push(Write::Delete { table: Table::Images, key });
    }
    Ok(Output::Done)
}
