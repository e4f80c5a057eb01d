//! Snapshot layers (`snapshot::snapshot_layer`) against the kernel's overlayfs: changes made
//! through a real writable overlay mount (files written, modes and owners changed, lower
//! files and directories deleted, a directory deleted and made again, hard links, symlinks,
//! fifos, xattrs, a large file) end up in the upper directory in overlay's own format; the
//! snapshot of that upper, stacked read-only on the same lowers, must show exactly what the
//! writable mount showed. Runs as root (overlay mounts, whiteouts), as CI does.

use std::os::fd::AsFd;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

use crate::support::*;
use opendsec_images::layer::{LayerError, Limits};
use opendsec_images::snapshot::{SnapshotOptions, snapshot_layer};
use opendsec_images::{LayerId, Store};

fn base() -> Vec<(Vec<E>, u64)> {
    use E::*;
    let l0 = vec![
        Dir("etc", 0o755, 0, 0),
        File("etc/passwd", b"root", 0o644, 0, 0),
        File("etc/shadow", b"s", 0o600, 0, 0),
        Dir("opt", 0o755, 0, 0),
        Dir("opt/app", 0o755, 0, 0),
        File("opt/app/a", b"a", 0o644, 0, 0),
        Dir("opt/app/sub", 0o755, 0, 0),
        File("opt/app/sub/deep", b"d", 0o644, 0, 0),
        Dir("var", 0o755, 0, 0),
        Dir("var/lib", 0o755, 0, 0),
        File("var/lib/x", b"x", 0o644, 0, 0),
        Dir("tmp", 0o1777, 0, 0),
        File("tmp/old", b"o", 0o644, 0, 0),
        Dir("home", 0o755, 0, 0),
        Dir("home/user", 0o755, 1000, 1000),
    ];
    let l1 = vec![Dir("usr", 0o755, 0, 0), File("usr/tool", b"tool", 0o4755, 0, 0), Symlink("bin", "usr")];
    vec![(l0, 1_700_000_000), (l1, 1_700_100_000)]
}

/// A writable overlay of `lowers` with its upper and work dirs; unmounted on drop.
struct Writable {
    dir: tempfile::TempDir,
}

impl Writable {
    fn mount(store: &Store, lowers: &[LayerId]) -> Writable {
        let dir = tempfile::tempdir().unwrap();
        for d in ["upper", "work", "root"] {
            std::fs::create_dir(dir.path().join(d)).unwrap();
        }
        let l: Vec<String> = lowers.iter().rev().map(|i| store.layer_rootfs(i).display().to_string()).collect();
        let opts = format!(
            "lowerdir={},upperdir={},workdir={},redirect_dir=off,metacopy=off",
            l.join(":"),
            dir.path().join("upper").display(),
            dir.path().join("work").display()
        );
        let st =
            Command::new("mount").args(["-t", "overlay", "overlay", "-o", &opts]).arg(dir.path().join("root")).status();
        assert!(st.unwrap().success(), "mount -t overlay failed");
        Writable { dir }
    }

    fn root(&self) -> std::path::PathBuf {
        self.dir.path().join("root")
    }

    fn upper(&self) -> std::fs::File {
        std::fs::File::open(self.dir.path().join("upper")).unwrap()
    }
}

impl Drop for Writable {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.root()).status();
    }
}

fn sh(root: &Path, script: &str) {
    let st = Command::new("sh").arg("-ec").arg(script).current_dir(root).status().unwrap();
    assert!(st.success(), "{script}");
}

fn setup() -> (tempfile::TempDir, Store, Vec<LayerId>) {
    stored_stack(&base())
}

#[test]
fn a_snapshot_stacks_to_exactly_what_the_sandbox_saw() {
    let (_d, store, lowers) = setup();
    let w = Writable::mount(&store, &lowers);
    let root = w.root();
    sh(
        &root,
        "echo new > etc/new; echo changed >> etc/passwd; rm etc/shadow; chmod 4750 usr/tool; \
         chown 1000:1000 var/lib/x; rm -r opt/app; mkdir -p opt/app/fresh; echo f > opt/app/fresh/f; \
         rm -r var/lib; ln -s ../etc/passwd home/user/pw; echo h > home/user/h; ln home/user/h home/user/h2; \
         mkfifo home/user/fifo; mkdir -m 0700 home/user/priv; chown 1000:1000 home/user/priv home/user/h; \
         rm bin; ln -s opt bin; echo t > tmp/t; rm tmp/old; echo hist > home/user/.bash_history; \
         mkdir -p home/user/.cache/pip; echo c > home/user/.cache/pip/c; \
         dd if=/dev/urandom of=opt/big bs=1M count=100 status=none",
    );
    rustix::fs::setxattr(root.join("etc/new"), "user.origin", b"test", rustix::fs::XattrFlags::empty()).unwrap();
    let want = snapshot(&root);

    let snap =
        snapshot_layer(&store, w.upper().as_fd(), &lowers, &SnapshotOptions::default(), &Limits::default(), "test")
            .unwrap();
    assert!(snap.tar.entries > 10, "{:?}", snap.tar);
    let mut layers = lowers.clone();
    layers.push(snap.meta.id.clone());
    let got = snapshot(Overlay::of(&store, &layers).path());
    assert_same("the snapshot stacked on its lowers vs the writable mount", &got, &want);
    // Hard links stay links; the xattr came along; deletions are whiteouts, the recreated
    // directory opaque (expanded into whiteouts of what was below).
    let top = store.layer_rootfs(&snap.meta.id);
    assert_eq!(
        std::fs::metadata(top.join("home/user/h")).unwrap().ino(),
        std::fs::metadata(top.join("home/user/h2")).unwrap().ino()
    );
    let mut v = [0u8; 16];
    let n = rustix::fs::getxattr(top.join("etc/new"), "user.origin", &mut v[..]).unwrap();
    assert_eq!(&v[..n], b"test");
    let wh = |p: &str| std::fs::symlink_metadata(top.join(p)).map(|m| m.file_type().is_char_device() && m.rdev() == 0);
    use std::os::unix::fs::FileTypeExt;
    assert!(wh("etc/shadow").unwrap() && wh("var/lib").unwrap() && wh("opt/app/a").unwrap() && wh("tmp/old").unwrap());
    assert_eq!(std::fs::metadata(top.join("opt/big")).unwrap().len(), 100 << 20);
    assert_eq!(std::fs::metadata(top.join("usr/tool")).unwrap().permissions().mode() & 0o7777, 0o4750);

    // The same upper again is the same layer (content-addressed, deterministic tar).
    let again =
        snapshot_layer(&store, w.upper().as_fd(), &lowers, &SnapshotOptions::default(), &Limits::default(), "t")
            .unwrap();
    assert_eq!(again.meta.id, snap.meta.id);

    // pack_diff leaves out /tmp's contents, the cache and the history; the rest is the same.
    let packed = SnapshotOptions { pack_diff: true, ..Default::default() };
    let p = snapshot_layer(&store, w.upper().as_fd(), &lowers, &packed, &Limits::default(), "t").unwrap();
    assert_ne!(p.meta.id, snap.meta.id);
    let mut layers = lowers.clone();
    layers.push(p.meta.id.clone());
    let got = snapshot(Overlay::of(&store, &layers).path());
    for gone in ["tmp/t", "home/user/.bash_history", "home/user/.cache"] {
        assert!(!got.contains_key(gone), "{gone} was packed out");
    }
    // A packed-out whiteout is gone too: the lower's /tmp/old shows again.
    assert!(got.contains_key("tmp/old"));
    assert_eq!(got.get("etc/new"), want.get("etc/new"));
    assert_eq!(got.get("opt/app/fresh/f"), want.get("opt/app/fresh/f"));

    // Only named paths (session sync): they come as written, deletions included; beside them
    // the lowers show through, even under a directory above them.
    let only = SnapshotOptions { only: vec![b"opt/app".to_vec(), b"home/user".to_vec()], ..Default::default() };
    let o = snapshot_layer(&store, w.upper().as_fd(), &lowers, &only, &Limits::default(), "t").unwrap();
    let mut layers = lowers.clone();
    layers.push(o.meta.id.clone());
    let got = snapshot(Overlay::of(&store, &layers).path());
    for kept in ["opt/app/fresh/f", "home/user/h", "home/user/pw", "home/user/priv", "home/user/.bash_history"] {
        assert_eq!(got.get(kept), want.get(kept), "{kept}");
    }
    assert!(!got.contains_key("opt/app/a"), "a deletion under a named path is carried");
    for beside in ["etc/new", "tmp/t", "opt/big"] {
        assert!(!got.contains_key(beside), "{beside} is not under a named path");
    }
    assert!(got.contains_key("etc/shadow") && got.contains_key("tmp/old"), "deletions beside are not carried");
}

#[test]
fn owners_of_the_sandboxs_range_come_back_as_the_sandbox_saw_them() {
    let (_d, store, lowers) = setup();
    let w = Writable::mount(&store, &lowers);
    let base = 4096 * 65536u32;
    let root = w.root();
    std::fs::write(root.join("etc/mine"), b"m").unwrap();
    std::os::unix::fs::chown(root.join("etc/mine"), Some(base + 1000), Some(base + 1001)).unwrap();
    std::fs::write(root.join("etc/foreign"), b"f").unwrap();
    std::os::unix::fs::chown(root.join("etc/foreign"), Some(12), Some(12)).unwrap();
    let opts = SnapshotOptions { id_base: Some(base), pack_diff: false, ..Default::default() };
    let snap = snapshot_layer(&store, w.upper().as_fd(), &lowers, &opts, &Limits::default(), "t").unwrap();
    let top = store.layer_rootfs(&snap.meta.id);
    let m = std::fs::metadata(top.join("etc/mine")).unwrap();
    assert_eq!((m.uid(), m.gid()), (1000, 1001));
    let f = std::fs::metadata(top.join("etc/foreign")).unwrap();
    assert_eq!((f.uid(), f.gid()), (65534, 65534));
}

#[test]
fn an_upper_over_the_limits_or_with_redirects_is_refused_and_leaves_nothing() {
    let (_d, store, lowers) = setup();
    let w = Writable::mount(&store, &lowers);
    let layers = || {
        std::fs::read_dir(store.root().join("layers"))
            .unwrap()
            .filter(|e| !e.as_ref().unwrap().file_name().to_string_lossy().starts_with('.'))
            .count()
    };
    let before = layers();
    sh(&w.root(), "dd if=/dev/zero of=opt/big bs=1M count=8 status=none");
    let small = Limits { max_file_bytes: 1 << 20, ..Limits::default() };
    let e = snapshot_layer(&store, w.upper().as_fd(), &lowers, &SnapshotOptions::default(), &small, "t").unwrap_err();
    assert!(matches!(e, LayerError::TooLarge { .. }), "{e}");
    let upper = w.dir.path().join("upper");
    std::fs::remove_file(upper.join("opt/big")).unwrap();
    // A directory renamed with redirect_dir on would carry this xattr: its meaning lives in
    // the lowers, so such an upper is refused rather than copied wrong.
    std::fs::create_dir(upper.join("moved")).unwrap();
    rustix::fs::setxattr(upper.join("moved"), "trusted.overlay.redirect", b"/opt", rustix::fs::XattrFlags::empty())
        .unwrap();
    let e = snapshot_layer(&store, w.upper().as_fd(), &lowers, &SnapshotOptions::default(), &Limits::default(), "t")
        .unwrap_err();
    assert!(matches!(e, LayerError::InvalidLayer { .. }) && e.to_string().contains("redirect"), "{e}");
    std::fs::remove_dir(upper.join("moved")).unwrap();
    // A file the sandbox named like a whiteout would delete something in every copy.
    std::fs::write(w.root().join("etc/.wh.passwd"), b"x").unwrap();
    let e = snapshot_layer(&store, w.upper().as_fd(), &lowers, &SnapshotOptions::default(), &Limits::default(), "t")
        .unwrap_err();
    assert!(matches!(e, LayerError::InvalidLayer { .. }) && e.to_string().contains(".wh."), "{e}");
    std::fs::remove_file(w.root().join("etc/.wh.passwd")).unwrap();
    // More names than the layer may hold: refused while they are listed (a directory's names
    // are held in memory while the walk goes below it).
    sh(&w.root(), "mkdir many && cd many && i=0; while [ $i -lt 300 ]; do : > f$i; i=$((i+1)); done");
    let few = Limits { max_entries: 100, ..Limits::default() };
    let e = snapshot_layer(&store, w.upper().as_fd(), &lowers, &SnapshotOptions::default(), &few, "t").unwrap_err();
    assert!(matches!(e, LayerError::TooLarge { what: "entries", .. }), "{e}");
    // None of the refused snapshots left a layer, whole or partial, or a temporary one.
    assert_eq!(layers(), before);
    let left: Vec<_> = std::fs::read_dir(store.tmp_dir()).map(|d| d.collect()).unwrap_or_default();
    assert!(left.is_empty(), "temporary layers left: {left:?}");
}
