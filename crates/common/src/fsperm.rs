//! Permissions of the control plane's files on the host. What the daemons keep is private to
//! their owner: records hold each sandbox spec's `env` (often secrets), IAM's store holds token
//! hashes and the hashing key, the audit log names every caller, and the image store and layer
//! caches hold untrusted images' files, setuid binaries and file capabilities included.
//!
//! Directories are made 0700. One that exists already keeps its owner and group bits (an
//! operator may share a store with a group on purpose) but loses every bit for others, so a
//! directory made by an older version or under a loose umask is closed on the next start.
use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

/// Creates `dir` (and missing parents, 0700) or, when it exists, takes away the permission
/// bits of others.
pub fn private_dir(dir: &Path) -> io::Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {
            let mode = m.permissions().mode() & 0o7777;
            if mode & 0o007 != 0 {
                std::fs::set_permissions(dir, std::fs::Permissions::from_mode(mode & !0o007))?;
            }
            Ok(())
        }
        Ok(_) => Err(io::Error::new(io::ErrorKind::AlreadyExists, format!("{} is not a directory", dir.display()))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir)?;
            // The umask may have narrowed it further; never widen past 0700.
            std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        }
        Err(e) => Err(e),
    }
}

/// Creates `dir` (and its parents) 0700 when it is missing, and leaves a directory that exists
/// alone: for the directory of a file the operator named (a certificate's `--out`, the audit
/// log's path), which may be `/tmp` or `/var/log` and is not ours to narrow. The file itself
/// is made private.
pub fn parent_dir(dir: &Path) -> io::Result<()> {
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(io::Error::new(io::ErrorKind::AlreadyExists, format!("{} is not a directory", dir.display()))),
        Err(e) if e.kind() == io::ErrorKind::NotFound => private_dir(dir),
        Err(e) => Err(e),
    }
}

/// Options that create a file readable and writable by its owner only (0600).
pub fn private_file() -> OpenOptions {
    let mut o = OpenOptions::new();
    o.mode(0o600);
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mode(p: &Path) -> u32 {
        std::fs::metadata(p).unwrap().permissions().mode() & 0o7777
    }

    #[test]
    fn new_dirs_are_0700_and_old_ones_lose_others_bits() {
        let t = tempfile::tempdir().unwrap();
        let d = t.path().join("a/b");
        private_dir(&d).unwrap();
        assert_eq!(mode(&d), 0o700);
        let shared = t.path().join("shared");
        std::fs::create_dir(&shared).unwrap();
        std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o2775)).unwrap();
        private_dir(&shared).unwrap();
        assert_eq!(mode(&shared), 0o2770, "the group's access is the operator's choice");
        let f = t.path().join("f");
        std::fs::write(&f, b"").unwrap();
        assert!(private_dir(&f).is_err());
        let secret = t.path().join("secret");
        private_file().write(true).create_new(true).open(&secret).unwrap();
        assert_eq!(mode(&secret), 0o600);
    }

    /// The directory of a file the operator named is made only when missing: an existing one
    /// (/tmp, /var/log) keeps its mode.
    #[test]
    fn a_files_existing_directory_is_left_alone() {
        let t = tempfile::tempdir().unwrap();
        let tmp = t.path().join("tmp");
        std::fs::create_dir(&tmp).unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
        parent_dir(&tmp).unwrap();
        assert_eq!(mode(&tmp), 0o1777);
        let fresh = t.path().join("x/y");
        parent_dir(&fresh).unwrap();
        assert_eq!(mode(&fresh), 0o700);
    }
}
