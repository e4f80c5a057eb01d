//! Limits on the free-form parts of a sandbox spec (labels, env), checked by the apiserver
//! before anything is reserved and again by the edge, from this one definition: an apiserver
//! accepting what an edge refuses would reserve quota only to give it back.

use std::collections::HashMap;

pub const MAX_LABELS: usize = 64;
pub const MAX_LABEL_KEY: usize = 63;
pub const MAX_LABEL_VALUE: usize = 255;
pub const MAX_ENV: usize = 1024;
pub const MAX_ENV_BYTES: usize = 256 << 10;

pub fn check_labels(labels: &HashMap<String, String>) -> Result<(), String> {
    if labels.len() > MAX_LABELS {
        return Err(format!("more than {MAX_LABELS} labels"));
    }
    for (k, v) in labels {
        if k.is_empty() || k.len() > MAX_LABEL_KEY || v.len() > MAX_LABEL_VALUE {
            return Err(format!("keys must have 1..={MAX_LABEL_KEY} bytes and values at most {MAX_LABEL_VALUE}"));
        }
    }
    Ok(())
}

pub fn check_env(env: &HashMap<String, String>) -> Result<(), String> {
    if env.len() > MAX_ENV {
        return Err(format!("more than {MAX_ENV} variables"));
    }
    let mut total = 0usize;
    for (k, v) in env {
        if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
            return Err("names must be non-empty without '=' or NUL, values without NUL".into());
        }
        total += k.len() + v.len();
    }
    if total > MAX_ENV_BYTES {
        return Err(format!("more than {MAX_ENV_BYTES} bytes"));
    }
    Ok(())
}

/// Extra masked or read-only paths a sandbox may ask for, at most.
pub const MAX_EXTRA_PATHS: usize = 32;
/// Longest such path.
pub const MAX_EXTRA_PATH_BYTES: usize = 256;

/// Checks `spec.masked_paths` / `spec.readonly_paths`: at most [`MAX_EXTRA_PATHS`] absolute
/// paths of at most [`MAX_EXTRA_PATH_BYTES`], without `.`/`..` components or control characters.
pub fn check_extra_paths(paths: &[String]) -> Result<(), String> {
    if paths.len() > MAX_EXTRA_PATHS {
        return Err(format!("{} paths; at most {MAX_EXTRA_PATHS}", paths.len()));
    }
    for p in paths {
        if !p.starts_with('/') || p.len() > MAX_EXTRA_PATH_BYTES {
            return Err(format!("{p:?} must be an absolute path of at most {MAX_EXTRA_PATH_BYTES} bytes"));
        }
        if p.chars().any(char::is_control) || p.split('/').any(|c| c == "." || c == "..") {
            return Err(format!("{p:?} must not contain control characters, `.` or `..`"));
        }
    }
    Ok(())
}

/// Most paths one session saves.
pub const MAX_SESSION_PATHS: usize = 16;
/// Longest session name.
pub const MAX_SESSION_NAME: usize = 128;

/// Checks a session sync's name and paths: a name of `[a-z0-9._-]` (not only dots), and 1 to
/// 16 plain absolute paths other than `/`.
pub fn check_session(name: &str, paths: &[String]) -> Result<(), String> {
    let ok = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '_' | '-');
    if name.is_empty() || name.len() > MAX_SESSION_NAME || !name.chars().all(ok) || name.chars().all(|c| c == '.') {
        let shown: String = name.chars().take(40).collect();
        return Err(format!("name {shown:?} must be 1..={MAX_SESSION_NAME} characters of [a-z0-9._-]"));
    }
    if paths.is_empty() || paths.len() > MAX_SESSION_PATHS {
        return Err(format!("{} paths; 1..={MAX_SESSION_PATHS}", paths.len()));
    }
    check_extra_paths(paths)?;
    if let Some(p) = paths.iter().find(|p| p.trim_end_matches('/').is_empty()) {
        return Err(format!("{p:?}: the whole file system is not a session path"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_names_and_paths_are_plain_and_bounded() {
        assert!(check_session("ep-1.v2_x", &["/data".into(), "/root/.config".into()]).is_ok());
        for bad in ["", "..", "A", "a/b", "a b", &"a".repeat(129)] {
            assert!(check_session(bad, &["/data".into()]).is_err(), "{bad:?}");
        }
        for bad in [vec![], vec!["/".to_string()], vec!["data".into()], vec!["/a/../b".into()], vec!["/x".into(); 17]] {
            assert!(check_session("s", &bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn extra_paths_are_absolute_plain_and_bounded() {
        assert!(check_extra_paths(&["/etc/shadow".into(), "/usr".into()]).is_ok());
        for bad in ["etc", "/a/../b", "/a/./b", "/a\nb"] {
            assert!(check_extra_paths(&[bad.to_string()]).is_err(), "{bad}");
        }
        assert!(check_extra_paths(&vec!["/x".to_string(); 33]).is_err());
        assert!(check_extra_paths(&[format!("/{}", "a".repeat(300))]).is_err());
    }

    fn map(k: &str, v: &str) -> HashMap<String, String> {
        [(k.to_string(), v.to_string())].into_iter().collect()
    }

    #[test]
    fn limits() {
        assert!(check_labels(&map("job", "rl")).is_ok());
        assert!(check_labels(&map(&"k".repeat(64), "v")).is_err());
        assert!(check_labels(&map("k", &"v".repeat(256))).is_err());
        assert!(check_labels(&map("", "v")).is_err());
        assert!(check_env(&map("PATH", "/bin")).is_ok());
        assert!(check_env(&map("A=B", "x")).is_err());
        assert!(check_env(&map("A", "x\0y")).is_err());
        assert!(check_env(&map("A", &"x".repeat(MAX_ENV_BYTES))).is_err());
    }
}
