//! Names and ids: what each may contain, checked once at the edge of every service.
//!
//! - project paths: `root` or `root/<seg>/...`, segments `[a-z0-9][a-z0-9_-]{0,62}`, depth <= 16;
//! - principal names: `[a-z0-9][a-z0-9_.-]{0,62}`;
//! - edge names: `[a-z0-9][a-z0-9_-]{0,62}` (no dot: the sandbox id splits on the first dot);
//! - lease ids: `[a-z0-9][a-z0-9-]{0,39}`;
//! - sandbox ids: `<edge>.<lease>`.

use crate::reason::ApiError;

pub const ROOT_PROJECT: &str = "root";
pub const MAX_PROJECT_DEPTH: usize = 16;

fn check(kind: &str, value: &str, max: usize, extra: &[u8]) -> Result<(), ApiError> {
    let b = value.as_bytes();
    let ok_first = b.first().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
    let ok_rest = b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || extra.contains(c));
    if value.is_empty() {
        return Err(ApiError::invalid(format!("{kind} is empty")));
    }
    if b.len() > max || !ok_first || !ok_rest {
        let shown: String = value.chars().take(80).collect();
        return Err(ApiError::invalid(format!(
            "{kind} {shown:?} is not valid: at most {max} characters of [a-z0-9{}], starting with a letter or digit",
            String::from_utf8_lossy(extra)
        )));
    }
    Ok(())
}

pub fn validate_project(path: &str) -> Result<(), ApiError> {
    let mut segs = path.split('/');
    if segs.next() != Some(ROOT_PROJECT) {
        return Err(ApiError::invalid(format!("project {path:?} must start with \"root\"")));
    }
    let mut depth = 1;
    for s in segs {
        check("project segment", s, 63, b"_-")?;
        depth += 1;
    }
    if depth > MAX_PROJECT_DEPTH {
        return Err(ApiError::invalid(format!("project {path:?} is deeper than {MAX_PROJECT_DEPTH} levels")));
    }
    Ok(())
}

/// The parent of a project path (`None` for the root).
pub fn parent_project(path: &str) -> Option<&str> {
    path.rsplit_once('/').map(|(p, _)| p)
}

/// Whether `path` is `ancestor` or below it.
/// The tenant a project belongs to: its top-level project (`root/a` for `root/a/b/c`), or
/// `root` itself. Bounds shared fairly between tenants are keyed by it, so a tenant does not
/// get more by making more principals or subprojects.
pub fn tenant_of(path: &str) -> &str {
    match path.match_indices('/').nth(1) {
        Some((i, _)) => &path[..i],
        None => path,
    }
}

pub fn project_within(path: &str, ancestor: &str) -> bool {
    path == ancestor || (path.starts_with(ancestor) && path.as_bytes().get(ancestor.len()) == Some(&b'/'))
}

/// The project and its ancestors, the project first.
pub fn project_chain(path: &str) -> impl Iterator<Item = &str> {
    std::iter::successors(Some(path), |p| parent_project(p))
}

pub fn validate_principal(name: &str) -> Result<(), ApiError> {
    check("principal", name, 63, b"_.-")
}

pub fn validate_edge(name: &str) -> Result<(), ApiError> {
    check("edge", name, 63, b"_-")
}

pub fn validate_lease(id: &str) -> Result<(), ApiError> {
    check("lease id", id, 40, b"-")
}

/// Splits a sandbox id into (edge, lease), validating both.
pub fn split_sandbox_id(id: &str) -> Result<(&str, &str), ApiError> {
    let (edge, lease) = id.split_once('.').ok_or_else(|| {
        ApiError::invalid(format!("sandbox id {:?} is not <edge>.<lease>", id.chars().take(80).collect::<String>()))
    })?;
    validate_edge(edge)?;
    validate_lease(lease)?;
    Ok((edge, lease))
}

pub fn sandbox_id(edge: &str, lease: &str) -> String {
    format!("{edge}.{lease}")
}

/// A new lease id: 24 lowercase hex digits, time-ordered (48-bit ms clock + 48 random bits), so
/// sandbox ids sort roughly by creation.
pub fn new_lease_id() -> String {
    let ms = crate::time::now_ms() as u64 & 0xffff_ffff_ffff;
    let r: u64 = rand::random::<u64>() & 0xffff_ffff_ffff;
    format!("{ms:012x}{r:012x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_are_top_level_projects() {
        assert_eq!(tenant_of("root/a/b/c"), "root/a");
        assert_eq!(tenant_of("root/a"), "root/a");
        assert_eq!(tenant_of("root"), "root");
    }

    #[test]
    fn project_paths() {
        assert!(validate_project("root").is_ok());
        assert!(validate_project("root/team-a/rl").is_ok());
        for bad in ["", "team", "root/", "root//a", "root/A", "root/../x", "/root", "root/a b"] {
            assert!(validate_project(bad).is_err(), "{bad}");
        }
        let deep = format!("root{}", "/a".repeat(MAX_PROJECT_DEPTH));
        assert!(validate_project(&deep).is_err());
        assert_eq!(project_chain("root/a/b").collect::<Vec<_>>(), ["root/a/b", "root/a", "root"]);
        assert!(project_within("root/a/b", "root/a"));
        assert!(!project_within("root/ab", "root/a"));
        assert!(project_within("root", "root"));
    }

    #[test]
    fn sandbox_ids() {
        let lease = new_lease_id();
        assert_eq!(lease.len(), 24);
        let id = sandbox_id("edge-1", &lease);
        assert_eq!(split_sandbox_id(&id).unwrap(), ("edge-1", lease.as_str()));
        for bad in ["", "nodot", ".x", "e.", "E.x", "e.x.y", "e.x/y"] {
            assert!(split_sandbox_id(bad).is_err(), "{bad}");
        }
    }
}
