//! Users from the image's own passwd file (never the host's name service): a session's user is
//! a name or a numeric uid resolved here, so what runs inside matches the image.

use crate::error::AgentError;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
    pub home: String,
    /// Supplementary groups from the image's group file (the primary gid first).
    pub groups: Vec<u32>,
}

/// Largest supplementary group list kept (the kernel's NGROUPS_MAX).
const MAX_GROUPS: usize = 65536;

/// `user`'s supplementary groups from the text of a group file: the primary gid, then every
/// group listing the user's name as a member.
pub fn groups(group: &str, name: &str, gid: u32) -> Vec<u32> {
    let mut out = vec![gid];
    for line in group.lines() {
        let f: Vec<&str> = line.split(':').collect();
        if f.len() < 4 {
            continue;
        }
        let Ok(g) = f[2].parse::<u32>() else { continue };
        if f[3].split(',').any(|m| m.trim() == name) && !out.contains(&g) && out.len() < MAX_GROUPS {
            out.push(g);
        }
    }
    out
}

/// Has the command run as `u` (groups, gid, uid in that order, after everything else std does
/// before exec), then enter `cwd` as that user. std's own `uid()` would drop supplementary
/// groups, and its `current_dir` would enter the directory before the switch.
/// A process's environment as the agent gives it: nothing inherited, the default PATH, then
/// the sandbox's variables, then the user's HOME, USER and LOGNAME (the caller adds its own).
pub fn user_env(c: &mut std::process::Command, u: &User, sandbox_env: &[(String, String)]) {
    c.env_clear()
        .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
        .envs(sandbox_env.iter().map(|(k, v)| (k, v)))
        .env("HOME", &u.home)
        .env("USER", &u.name)
        .env("LOGNAME", &u.name);
}

pub fn run_as(c: &mut std::process::Command, u: &User, cwd: Option<std::path::PathBuf>) {
    use std::os::unix::process::CommandExt;
    let switch = rustix::process::geteuid().as_raw() != u.uid || rustix::process::getegid().as_raw() != u.gid;
    use rustix::process::{Gid, Uid};
    let (uid, gid) = (Uid::from_raw(u.uid), Gid::from_raw(u.gid));
    let groups: Vec<Gid> = u.groups.iter().map(|g| Gid::from_raw(*g)).collect();
    let cwd = cwd.and_then(|p| std::ffi::CString::new(p.into_os_string().into_encoded_bytes()).ok());
    if !switch && cwd.is_none() {
        // Nothing to do: no hook, so std can spawn without forking.
        return;
    }
    // SAFETY: between fork and exec only raw syscalls run (rustix's setgroups, setgid,
    // setuid and chdir, none allocating: `groups` and `cwd` were made before the fork and are
    // only read). The child has one thread, so the per-thread id calls change the process.
    unsafe {
        c.pre_exec(move || {
            if switch {
                rustix::thread::set_thread_groups(&groups)?;
                rustix::thread::set_thread_gid(gid)?;
                rustix::thread::set_thread_uid(uid)?;
            }
            if let Some(d) = &cwd {
                rustix::process::chdir(d.as_c_str())?;
            }
            Ok(())
        });
    }
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
            return Ok(User { name: f[0].to_string(), uid, gid, home: f[5].to_string(), groups: vec![gid] });
        }
    }
    match (numeric, user) {
        (Some(uid), _) => Ok(User { name: uid.to_string(), uid, gid: uid, home: "/".into(), groups: vec![uid] }),
        (None, "root") => Ok(User { name: "root".into(), uid: 0, gid: 0, home: "/root".into(), groups: vec![0] }),
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

    #[test]
    fn supplementary_groups_from_the_group_file() {
        let g = "root:x:0:\nadm:x:4:syslog,alice\nbad\nstaff:x:50:bob, alice\nusers:x:100:\nalice:x:1000:\n";
        assert_eq!(groups(g, "alice", 1000), vec![1000, 4, 50]);
        assert_eq!(groups(g, "bob", 1001), vec![1001, 50]);
        assert_eq!(groups("", "x", 7), vec![7]);
    }
}
