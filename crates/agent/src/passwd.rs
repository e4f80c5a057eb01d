//! Users from the image's own passwd file (never the host's name service): a session's user is
//! a name or a numeric uid resolved here, so what runs inside matches the image.

use crate::error::AgentError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
}

/// Resolves `user` (name or numeric uid; empty = root) against the text of a passwd file.
/// A numeric uid absent from the file is allowed, with gid = uid and home `/`.
pub fn resolve(passwd: &str, user: &str) -> Result<User, AgentError> {
    let user = if user.is_empty() { "root" } else { user };
    let numeric = user.parse::<u32>().ok();
    for line in passwd.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 7 {
            continue;
        }
        let (Ok(uid), Ok(gid)) = (f[2].parse::<u32>(), f[3].parse::<u32>()) else {
            continue;
        };
        if f[0] == user || numeric == Some(uid) {
            return Ok(User { name: f[0].to_string(), uid, gid, home: f[5].to_string() });
        }
    }
    match (numeric, user) {
        (Some(uid), _) => Ok(User { name: uid.to_string(), uid, gid: uid, home: "/".into() }),
        (None, "root") => Ok(User { name: "root".into(), uid: 0, gid: 0, home: "/root".into() }),
        _ => Err(AgentError::UnknownUser(user.to_string())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const P: &str = "root:x:0:0:root:/root:/bin/bash\n# junk\nbad line\nnobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n";

    #[test]
    fn names_and_uids() {
        assert_eq!(resolve(P, "").unwrap().uid, 0);
        let n = resolve(P, "nobody").unwrap();
        assert_eq!((n.uid, n.gid, n.home.as_str()), (65534, 65534, "/nonexistent"));
        assert_eq!(resolve(P, "65534").unwrap().name, "nobody");
        assert_eq!(resolve(P, "1234").unwrap().gid, 1234);
        assert!(resolve(P, "alice").is_err());
        assert_eq!(resolve("", "root").unwrap().uid, 0);
    }
}
