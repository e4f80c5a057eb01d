//! `opendsecctl image store-check DIR`: tries in DIR each capability the image store needs and
//! says, for each, whether it works and what to fix when it does not (reference section 10,
//! "Self-check").
//!
//! The checks: root is not mapped to another user (NFS `root_squash`), chown to any uid/gid
//! (layers hold files of many owners), exclusive create (`O_EXCL`), rename over an existing
//! file (layers and manifests appear whole by renaming), hard links, 0:0 character devices
//! (overlay whiteouts), and overlay stacking of two layers stored there, a whiteout hiding the
//! lower file. Each check works in its own scratch directory under `DIR/.store-check-<random>/`
//! and removes what it made, mounts included; nothing else in DIR is touched. It must run as
//! root, as edges do.
//!
//! Two more are advisory (a failure is a warning, the store still works): DIR is private (no
//! permission bits for others: layers hold untrusted images' setuid binaries and file
//! capabilities), and its file system is mounted `nosuid,nodev` (so that even a host user who
//! reached such a file could not gain from it).

use std::ffi::CString;
use std::fs;
use std::io;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use serde::Serialize;

/// One capability: whether it works, what was seen, and what to fix when it does not.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    pub detail: String,
    /// Empty when `ok`.
    pub fix: String,
    /// A failed required check means the store does not work; an advisory one is hardening.
    pub required: bool,
}

/// Owner the chown check gives its file (not 0, not a usual system id).
const PROBE_UID: u32 = 54321;
const PROBE_GID: u32 = 54322;

type Probe = fn(&Path) -> Result<String, String>;

const CHECKS: [(&str, Probe, &str); 7] = [
    (
        "root_not_mapped",
        root_not_mapped,
        "run as root, and export the file system without mapping root to another user (NFS: no_root_squash)",
    ),
    (
        "chown",
        chown,
        "let root chown files to any uid/gid (NFS: no_root_squash, no all_squash; a FUSE file system must store ownership)",
    ),
    (
        "exclusive_create",
        exclusive_create,
        "use a file system whose exclusive create (O_EXCL) is atomic (NFSv3 or later, CephFS, JuiceFS)",
    ),
    (
        "rename",
        rename,
        "use a file system with atomic rename over an existing file (object-store FUSE mounts often lack it)",
    ),
    ("hard_links", hard_links, "use a file system with hard links (NFS, CephFS and JuiceFS have them)"),
    (
        "whiteout_device",
        whiteout_device,
        "let root create 0:0 character devices (overlay whiteouts): NFS with no_root_squash; not inside a user namespace",
    ),
    (
        "overlay",
        overlay,
        "overlayfs must take directories of this file system as lower layers: load the overlay module, run as root, \
         use NFSv4/CephFS/JuiceFS or a local file system, and keep ':' and ',' out of the store path",
    ),
];

/// Runs every check in `dir` (which must exist). One entry per check, in a fixed order.
pub fn store_check(dir: &Path) -> Vec<Check> {
    let scratch = dir.join(format!(".store-check-{:016x}", rand::random::<u64>()));
    if let Err(e) = fs::create_dir(&scratch) {
        let detail = format!("cannot create {}: {e}", scratch.display());
        return CHECKS
            .iter()
            .map(|(name, _, fix)| Check {
                name,
                ok: false,
                detail: detail.clone(),
                fix: format!("make {} an existing directory root can write; then: {fix}", dir.display()),
                required: true,
            })
            .collect();
    }
    let out = CHECKS
        .iter()
        .map(|(name, probe, fix)| {
            let work = scratch.join(name);
            let result = fs::create_dir(&work)
                .map_err(|e| format!("cannot create {}: {e}", work.display()))
                .and_then(|()| probe(&work));
            // A check that could not unmount leaves its directory (removing it would reach into
            // the mount) and says so in its detail.
            let _ = fs::remove_dir_all(&work);
            match result {
                Ok(detail) => Check { name, ok: true, detail, fix: String::new(), required: true },
                Err(detail) => Check { name, ok: false, detail, fix: (*fix).to_string(), required: true },
            }
        })
        .collect::<Vec<_>>();
    let _ = fs::remove_dir(&scratch);
    let mut out = out;
    out.push(advisory("private", private(dir), &format!("chmod o-rwx {}", dir.display())));
    out.push(advisory(
        "nosuid_nodev",
        nosuid_nodev(dir),
        &format!(
            "mount the store's file system with nosuid,nodev (or bind-mount {} onto itself with them)",
            dir.display()
        ),
    ));
    out
}

fn advisory(name: &'static str, r: Result<String, String>, fix: &str) -> Check {
    match r {
        Ok(detail) => Check { name, ok: true, detail, fix: String::new(), required: false },
        Err(detail) => Check { name, ok: false, detail, fix: fix.to_string(), required: false },
    }
}

fn private(dir: &Path) -> Result<String, String> {
    use std::os::unix::fs::PermissionsExt;
    let mode = fs::metadata(dir).map_err(err("cannot stat", dir))?.permissions().mode() & 0o7777;
    if mode & 0o007 == 0 {
        Ok(format!("mode {mode:04o}: no access for others"))
    } else {
        Err(format!("mode {mode:04o}: others may reach the layers' files"))
    }
}

/// The mount options of the file system holding `dir` (the mount whose point is the longest
/// prefix of its canonical path), from `/proc/self/mountinfo`.
fn mount_options(dir: &Path) -> Result<(String, Vec<String>), String> {
    let real = fs::canonicalize(dir).map_err(err("cannot resolve", dir))?;
    let info =
        fs::read_to_string("/proc/self/mountinfo").map_err(err("cannot read", Path::new("/proc/self/mountinfo")))?;
    mount_options_in(&info, &real)
}

/// [`mount_options`] over the text of a mountinfo file.
fn mount_options_in(info: &str, real: &Path) -> Result<(String, Vec<String>), String> {
    let mut best: Option<(String, Vec<String>)> = None;
    for line in info.lines() {
        let f: Vec<&str> = line.split(' ').collect();
        let (Some(point), Some(opts)) = (f.get(4), f.get(5)) else { continue };
        let point = point.replace("\\040", " ");
        if real.starts_with(&point) && best.as_ref().is_none_or(|(b, _)| point.len() >= b.len()) {
            best = Some((point, opts.split(',').map(str::to_owned).collect()));
        }
    }
    best.ok_or_else(|| format!("no mount holds {}", real.display()))
}

fn nosuid_nodev(dir: &Path) -> Result<String, String> {
    let (point, opts) = mount_options(dir)?;
    let missing: Vec<&str> = ["nosuid", "nodev"].into_iter().filter(|o| !opts.iter().any(|x| x == o)).collect();
    if missing.is_empty() {
        Ok(format!("{point} is mounted nosuid,nodev"))
    } else {
        Err(format!("{point} is mounted without {}", missing.join(",")))
    }
}

fn err(what: &str, path: &Path) -> impl FnOnce(io::Error) -> String {
    let p = path.display().to_string();
    let what = what.to_string();
    move |e| format!("{what} {p}: {e}")
}

fn euid() -> u32 {
    rustix::process::geteuid().as_raw()
}

fn root_not_mapped(work: &Path) -> Result<String, String> {
    if euid() != 0 {
        return Err(format!("running as uid {}, not root", euid()));
    }
    let f = work.join("owned-by-root");
    fs::write(&f, b"x").map_err(err("cannot create", &f))?;
    let m = fs::metadata(&f).map_err(err("cannot stat", &f))?;
    if (m.uid(), m.gid()) == (0, 0) {
        Ok("a file root creates is owned by 0:0".into())
    } else {
        Err(format!("a file root creates is owned by {}:{} (root is mapped to another user)", m.uid(), m.gid()))
    }
}

fn chown(work: &Path) -> Result<String, String> {
    let f = work.join("chowned");
    fs::write(&f, b"x").map_err(err("cannot create", &f))?;
    std::os::unix::fs::chown(&f, Some(PROBE_UID), Some(PROBE_GID)).map_err(err("cannot chown", &f))?;
    let m = fs::metadata(&f).map_err(err("cannot stat", &f))?;
    if (m.uid(), m.gid()) == (PROBE_UID, PROBE_GID) {
        Ok(format!("chown to {PROBE_UID}:{PROBE_GID} kept"))
    } else {
        Err(format!("chown to {PROBE_UID}:{PROBE_GID} shows {}:{}", m.uid(), m.gid()))
    }
}

fn exclusive_create(work: &Path) -> Result<String, String> {
    let f = work.join("exclusive");
    let open = || fs::OpenOptions::new().write(true).create_new(true).open(&f);
    open().map_err(err("cannot create", &f))?;
    match open() {
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok("a second exclusive create fails".into()),
        Err(e) => Err(format!("a second exclusive create failed with {e}, not \"file exists\"")),
        Ok(_) => Err("a second exclusive create of the same name succeeded".into()),
    }
}

fn rename(work: &Path) -> Result<String, String> {
    let (new, old) = (work.join("new"), work.join("old"));
    fs::write(&new, b"new").map_err(err("cannot write", &new))?;
    fs::write(&old, b"old").map_err(err("cannot write", &old))?;
    fs::rename(&new, &old).map_err(err("cannot rename over", &old))?;
    let got = fs::read(&old).map_err(err("cannot read", &old))?;
    if got != b"new" || new.exists() {
        return Err("after renaming over an existing file, the old content or name is still there".into());
    }
    let (d1, d2) = (work.join("dir-tmp"), work.join("dir"));
    fs::create_dir_all(d1.join("rootfs")).map_err(err("cannot create", &d1))?;
    fs::rename(&d1, &d2).map_err(err("cannot rename directory to", &d2))?;
    if !d2.join("rootfs").is_dir() {
        return Err("a renamed directory lost its content".into());
    }
    Ok("rename replaces a file whole and moves a directory".into())
}

fn hard_links(work: &Path) -> Result<String, String> {
    let (a, b) = (work.join("a"), work.join("b"));
    fs::write(&a, b"x").map_err(err("cannot write", &a))?;
    fs::hard_link(&a, &b).map_err(err("cannot hard-link", &b))?;
    let (ma, mb) =
        (fs::metadata(&a).map_err(err("cannot stat", &a))?, fs::metadata(&b).map_err(err("cannot stat", &b))?);
    if ma.ino() == mb.ino() && mb.nlink() == 2 {
        Ok("a hard link shares the inode (2 links)".into())
    } else {
        Err(format!("a hard link shows inode {} vs {}, {} links", ma.ino(), mb.ino(), mb.nlink()))
    }
}

/// Creates an overlay whiteout: a 0:0 character device.
fn mknod_whiteout(p: &Path) -> Result<(), String> {
    use rustix::fs::{CWD, FileType, Mode, makedev, mknodat};
    mknodat(CWD, p, FileType::CharacterDevice, Mode::empty(), makedev(0, 0))
        .map_err(|e| format!("cannot mknod {}: {e}", p.display()))
}

fn whiteout_device(work: &Path) -> Result<String, String> {
    let w = work.join("whiteout");
    mknod_whiteout(&w)?;
    let m = fs::symlink_metadata(&w).map_err(err("cannot stat", &w))?;
    let ok = m.file_type().is_char_device() && m.rdev() == 0;
    fs::remove_file(&w).map_err(err("cannot remove", &w))?;
    if ok {
        Ok("root can create a 0:0 character device".into())
    } else {
        Err(format!("a 0:0 character device reads back as {:?} with rdev {:#x}", m.file_type(), m.rdev()))
    }
}

fn overlay(work: &Path) -> Result<String, String> {
    let shown = work.display().to_string();
    if shown.contains([':', ',']) {
        return Err(format!("the path {shown} contains ':' or ',', which overlay mount options cannot carry"));
    }
    // Two layers in store form: `lower` has a, b and d/x; `upper` (stacked on top) whites out a
    // and adds c and d/y.
    let (lower, upper, merged) = (work.join("lower/rootfs"), work.join("upper/rootfs"), work.join("merged"));
    for d in [lower.join("d"), upper.join("d"), merged.clone()] {
        fs::create_dir_all(&d).map_err(err("cannot create", &d))?;
    }
    for (f, body) in [
        (lower.join("a"), "a"),
        (lower.join("b"), "b"),
        (lower.join("d/x"), "x"),
        (upper.join("c"), "c"),
        (upper.join("d/y"), "y"),
    ] {
        fs::write(&f, body).map_err(err("cannot write", &f))?;
    }
    mknod_whiteout(&upper.join("a"))?;

    use rustix::mount::{MountFlags, UnmountFlags, mount, unmount};
    let opts = CString::new(format!("lowerdir={}:{}", upper.display(), lower.display())).map_err(|e| e.to_string())?;
    mount("overlay", &merged, "overlay", MountFlags::RDONLY, Some(opts.as_c_str()))
        .map_err(|e| format!("mount -t overlay of two layers here failed: {e}"))?;
    let seen = (
        merged.join("a").symlink_metadata().is_ok(),
        merged.join("b").is_file(),
        merged.join("c").is_file(),
        merged.join("d/x").is_file() && merged.join("d/y").is_file(),
    );
    if let Err(first) = unmount(&merged, UnmountFlags::empty())
        && unmount(&merged, UnmountFlags::DETACH).is_err()
    {
        return Err(format!("cannot unmount the test overlay at {}: {first}", merged.display()));
    }
    match seen {
        (false, true, true, true) => Ok("two layers stack; the whiteout hides the lower file".into()),
        (true, _, _, _) => Err("the whiteout in the upper layer does not hide the lower file".into()),
        _ => Err(format!(
            "the stacked layers do not show every file (b, c, d/x+d/y: {}, {}, {})",
            seen.1, seen.2, seen.3
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_advisory_checks_see_modes_and_mount_flags() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o755)).unwrap();
        assert!(private(dir.path()).unwrap_err().contains("0755"));
        fs::set_permissions(dir.path(), fs::Permissions::from_mode(0o750)).unwrap();
        assert!(private(dir.path()).is_ok());
        // The deepest mount holding the path decides; its per-mount options are field 6.
        let info = "22 1 0:21 / / rw,relatime - ext4 /dev/vda rw\n\
                    30 22 0:30 / /srv/store rw,nosuid,nodev,relatime - nfs4 h:/s rw\n\
                    31 22 0:31 / /srv/store2 rw,nosuid - tmpfs t rw\n";
        let opts = |p: &str| mount_options_in(info, Path::new(p)).unwrap();
        assert_eq!(opts("/srv/store/layers").0, "/srv/store");
        assert!(opts("/srv/store/layers").1.contains(&"nodev".to_string()));
        assert_eq!(opts("/srv/store2").0, "/srv/store2");
        assert_eq!(opts("/var/lib").0, "/");
        let (point, _) = mount_options(dir.path()).unwrap();
        assert!(dir.path().starts_with(&point));
    }

    #[test]
    fn every_check_passes_in_a_local_directory_as_root_and_cleans_up() {
        let dir = tempfile::tempdir().unwrap();
        let checks = store_check(dir.path());
        assert_eq!(
            checks.iter().map(|c| c.name).collect::<Vec<_>>(),
            [
                "root_not_mapped",
                "chown",
                "exclusive_create",
                "rename",
                "hard_links",
                "whiteout_device",
                "overlay",
                "private",
                "nosuid_nodev"
            ]
        );
        if euid() == 0 {
            for c in checks.iter().filter(|c| c.required) {
                assert!(c.ok, "{}: {} ({})", c.name, c.detail, c.fix);
                assert!(c.fix.is_empty());
            }
        } else {
            let c = &checks[0];
            assert!(!c.ok && c.detail.contains("not root") && !c.fix.is_empty(), "{c:?}");
        }
        assert_eq!(fs::read_dir(dir.path()).unwrap().count(), 0, "the checks left nothing behind");
    }

    #[test]
    fn a_missing_directory_fails_every_check_with_a_fix() {
        let dir = tempfile::tempdir().unwrap();
        let checks = store_check(&dir.path().join("absent"));
        assert_eq!(checks.len(), CHECKS.len());
        assert!(checks.iter().all(|c| !c.ok && c.detail.contains("cannot create") && c.fix.contains("absent")));
        assert!(checks.iter().all(|c| c.required));
        assert!(!dir.path().join("absent").exists());
    }
}
