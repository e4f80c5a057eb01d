//! The merged view of a stack of layer rootfs directories, computed the way overlayfs shows it
//! (without mounting anything): used to expand opaque directories at import, to merge layers,
//! and by tests and the store check to compare with a real overlay mount.
//!
//! Rules (overlayfs, with whiteouts as 0:0 character devices and no `trusted.overlay.*`
//! xattrs, which our layers never carry): a directory's content is the union of that
//! directory in every layer from the top-most one that has it down to the first layer where
//! the name is a whiteout or not a directory (which hides it and everything below); among
//! names, the top-most layer decides; a whiteout hides the name in the layers below it and is
//! itself invisible.
//!
//! Every path inside a layer is looked up without following symlinks: a directory is only
//! descended into in a layer where each of its components is a real directory.

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use crate::limits::LayerError;
use crate::store::{LayerId, Store, StoreError};
use crate::unpack::{is_whiteout, make_whiteout, open_dir};

/// What a name is in the layer that decides it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Dir,
    File,
    Symlink,
    Whiteout,
    /// Fifos, sockets, devices other than whiteouts.
    Other,
}

/// The layer (index in the stack, bottom = 0) that decides a name, and what it is there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Found {
    pub layer: usize,
    pub kind: Kind,
}

/// Layer rootfs directories, bottom first, opened once.
#[derive(Debug)]
pub struct LayerStack {
    roots: Vec<OwnedFd>,
    paths: Vec<PathBuf>,
}

fn join(dir: &[u8], name: &[u8]) -> Vec<u8> {
    let mut p = dir.to_vec();
    if !p.is_empty() {
        p.push(b'/');
    }
    p.extend_from_slice(name);
    p
}

impl LayerStack {
    /// Opens rootfs directories given bottom first.
    pub fn open(dirs: &[PathBuf]) -> Result<LayerStack, LayerError> {
        let mut roots = Vec::with_capacity(dirs.len());
        for d in dirs {
            let fd = rfs::open(d, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
                .map_err(|e| LayerError::Io { path: d.clone(), source: e.into() })?;
            roots.push(fd);
        }
        Ok(LayerStack { roots, paths: dirs.to_vec() })
    }

    /// The stored layers `ids`, bottom first; each must be in the store.
    pub fn from_store(store: &Store, ids: &[LayerId]) -> Result<LayerStack, LayerError> {
        let mut dirs = Vec::with_capacity(ids.len());
        for id in ids {
            if !store.has_layer(id) {
                return Err(StoreError::LayerNotFound(id.to_string()).into());
            }
            dirs.push(store.layer_rootfs(id));
        }
        LayerStack::open(&dirs)
    }

    pub fn len(&self) -> usize {
        self.roots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.roots.is_empty()
    }

    /// The rootfs directory of layer `i` (bottom = 0).
    pub fn layer_root(&self, i: usize) -> BorrowedFd<'_> {
        self.roots[i].as_fd()
    }

    pub fn layer_path(&self, i: usize) -> &Path {
        &self.paths[i]
    }

    fn io(&self, i: usize, path: &[u8], e: Errno) -> LayerError {
        LayerError::Io { path: self.paths[i].join(OsStr::from_bytes(path)), source: e.into() }
    }

    /// The root directory of the merged view.
    pub fn root(&self) -> DirView<'_> {
        DirView { stack: self, path: Vec::new(), layers: (0..self.roots.len()).rev().collect(), open_below: true }
    }

    /// The merged directory at `path` (`/`-joined, relative), or `None` if the merged view
    /// has no directory there.
    pub fn dir(&self, path: &[u8]) -> Result<Option<DirView<'_>>, LayerError> {
        let mut view = self.root();
        for c in path.split(|b| *b == b'/').filter(|c| !c.is_empty() && *c != b".") {
            match view.child(c)? {
                Some(v) => view = v,
                None => return Ok(None),
            }
        }
        Ok(Some(view))
    }

    /// Every visible path of the merged view (`/`-joined, relative; the root itself not
    /// included), with the layer that shows it.
    pub fn tree(&self) -> Result<BTreeMap<Vec<u8>, Found>, LayerError> {
        fn walk(view: &DirView<'_>, out: &mut BTreeMap<Vec<u8>, Found>) -> Result<(), LayerError> {
            for (name, found) in view.visible()? {
                out.insert(join(&view.path, &name), found);
                if found.kind == Kind::Dir
                    && let Some(child) = view.child(&name)?
                {
                    walk(&child, out)?;
                }
            }
            Ok(())
        }
        let mut out = BTreeMap::new();
        walk(&self.root(), &mut out)?;
        Ok(out)
    }
}

/// One directory of the merged view: the layers that contribute to it.
#[derive(Debug)]
pub struct DirView<'a> {
    stack: &'a LayerStack,
    path: Vec<u8>,
    /// Layers where `path` is a contributing directory, top first.
    layers: Vec<usize>,
    open_below: bool,
}

impl<'a> DirView<'a> {
    /// `/`-joined and relative ("" for the root).
    pub fn path(&self) -> &[u8] {
        &self.path
    }

    /// The contributing layers, top first.
    pub fn layers(&self) -> &[usize] {
        &self.layers
    }

    /// True when nothing in the stack cut this directory off (no whiteout or non-directory
    /// below its top-most occurrence, and the same for its parents): layers stacked below
    /// this stack would contribute to it too.
    pub fn open_below(&self) -> bool {
        self.open_below
    }

    /// Every name decided in this directory, whiteouts included, with the deciding layer.
    pub fn entries(&self) -> Result<BTreeMap<Vec<u8>, Found>, LayerError> {
        let mut out = BTreeMap::new();
        for &i in &self.layers {
            let root = self.stack.layer_root(i);
            let fd = open_dir(root, &self.path).map_err(|e| self.stack.io(i, &self.path, e))?;
            let dir = rfs::Dir::read_from(&fd).map_err(|e| self.stack.io(i, &self.path, e))?;
            for e in dir {
                let e = e.map_err(|e| self.stack.io(i, &self.path, e))?;
                let name = e.file_name().to_bytes();
                if name == b"." || name == b".." || out.contains_key(name) {
                    continue;
                }
                let kind = match e.file_type() {
                    FileType::Directory => Kind::Dir,
                    FileType::RegularFile => Kind::File,
                    FileType::Symlink => Kind::Symlink,
                    FileType::CharacterDevice | FileType::Unknown => {
                        let st = rfs::statat(&fd, name, AtFlags::SYMLINK_NOFOLLOW)
                            .map_err(|e| self.stack.io(i, &join(&self.path, name), e))?;
                        kind_of(&st)
                    }
                    _ => Kind::Other,
                };
                out.insert(name.to_vec(), Found { layer: i, kind });
            }
        }
        Ok(out)
    }

    /// The names shown in this directory (whiteouts removed).
    pub fn visible(&self) -> Result<BTreeMap<Vec<u8>, Found>, LayerError> {
        let mut e = self.entries()?;
        e.retain(|_, f| f.kind != Kind::Whiteout);
        Ok(e)
    }

    /// The merged directory `name` inside this one, or `None` when the merged view has no
    /// directory by that name.
    pub fn child(&self, name: &[u8]) -> Result<Option<DirView<'a>>, LayerError> {
        let path = join(&self.path, name);
        let mut layers = Vec::new();
        let mut open_below = self.open_below;
        for &i in &self.layers {
            // Each component before `name` is a real directory in layer i (it is in
            // `self.layers`), so this lookup follows no symlink.
            let st = match rfs::statat(self.stack.layer_root(i), path.as_slice(), AtFlags::SYMLINK_NOFOLLOW) {
                Ok(st) => st,
                Err(Errno::NOENT) => continue,
                Err(e) => return Err(self.stack.io(i, &path, e)),
            };
            if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
                layers.push(i);
                continue;
            }
            // A whiteout or a non-directory hides this name in every layer below.
            if layers.is_empty() {
                return Ok(None);
            }
            open_below = false;
            break;
        }
        if layers.is_empty() {
            return Ok(None);
        }
        Ok(Some(DirView { stack: self.stack, path, layers, open_below }))
    }
}

pub(crate) fn kind_of(st: &rfs::Stat) -> Kind {
    match FileType::from_raw_mode(st.st_mode) {
        FileType::Directory => Kind::Dir,
        FileType::RegularFile => Kind::File,
        FileType::Symlink => Kind::Symlink,
        _ if is_whiteout(st) => Kind::Whiteout,
        _ => Kind::Other,
    }
}

/// Expands the opaque directory `dir` of a layer being written (rootfs `root`, at
/// `root_path`) against the layers `below` it: a whiteout for every name the merged view of
/// `below` shows in `dir` that the layer does not have, recursively into directories both
/// have (overlay would merge those). Idempotent. Returns the number of whiteouts written.
pub(crate) fn expand_opaque(
    root: BorrowedFd<'_>,
    root_path: &Path,
    dir: &[u8],
    below: &LayerStack,
) -> Result<u64, LayerError> {
    let Some(view) = below.dir(dir)? else {
        return Ok(0);
    };
    let io = |path: &[u8], e: Errno| LayerError::Io { path: root_path.join(OsStr::from_bytes(path)), source: e.into() };
    let fd = open_dir(root, dir).map_err(|e| io(dir, e))?;
    hide_below(fd.as_fd(), &view, &io)
}

/// Whiteouts in `fd` (the layer's directory at `below.path()`) for what `below` shows there.
pub(crate) fn hide_below(
    fd: BorrowedFd<'_>,
    below: &DirView<'_>,
    io: &dyn Fn(&[u8], Errno) -> LayerError,
) -> Result<u64, LayerError> {
    let mut added = 0;
    for (name, found) in below.visible()? {
        match rfs::statat(fd, name.as_slice(), AtFlags::SYMLINK_NOFOLLOW) {
            Err(Errno::NOENT) => {
                make_whiteout(fd, name.as_slice()).map_err(|e| io(&join(below.path(), &name), e))?;
                added += 1;
            }
            Ok(st) if FileType::from_raw_mode(st.st_mode) == FileType::Directory && found.kind == Kind::Dir => {
                if let Some(child) = below.child(&name)? {
                    let cfd = open_dir(fd, &name).map_err(|e| io(&join(below.path(), &name), e))?;
                    added += hide_below(cfd.as_fd(), &child, io)?;
                }
            }
            // Present in the layer as something that hides the lower name anyway.
            Ok(_) => {}
            Err(e) => return Err(io(&join(below.path(), &name), e)),
        }
    }
    Ok(added)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    fn whiteout(p: &Path) {
        let (dir, name) = (p.parent().unwrap(), p.file_name().unwrap());
        let d = rfs::open(dir, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).unwrap();
        rfs::mknodat(&d, name, FileType::CharacterDevice, Mode::empty(), rfs::makedev(0, 0)).unwrap();
    }

    /// l0: a/{x,y}, b/z, f      l1: a/ (whiteout y), b (whiteout)      l2: b/ (new), f/ (dir over file)
    fn layers() -> (tempfile::TempDir, LayerStack) {
        let t = tempfile::tempdir().unwrap();
        let l: Vec<PathBuf> = (0..3).map(|i| t.path().join(format!("l{i}"))).collect();
        for p in &l {
            fs::create_dir(p).unwrap();
        }
        fs::create_dir_all(l[0].join("a")).unwrap();
        fs::write(l[0].join("a/x"), "x").unwrap();
        fs::write(l[0].join("a/y"), "y").unwrap();
        fs::create_dir_all(l[0].join("b")).unwrap();
        fs::write(l[0].join("b/z"), "z").unwrap();
        fs::write(l[0].join("f"), "f").unwrap();
        fs::create_dir(l[1].join("a")).unwrap();
        whiteout(&l[1].join("a/y"));
        whiteout(&l[1].join("b"));
        fs::create_dir(l[2].join("b")).unwrap();
        fs::write(l[2].join("b/new"), "n").unwrap();
        fs::create_dir(l[2].join("f")).unwrap();
        let stack = LayerStack::open(&l).unwrap();
        (t, stack)
    }

    #[test]
    fn merged_view_follows_overlay_rules() {
        let (_t, stack) = layers();
        let tree: Vec<(String, usize, Kind)> =
            stack.tree().unwrap().into_iter().map(|(p, f)| (String::from_utf8(p).unwrap(), f.layer, f.kind)).collect();
        assert_eq!(
            tree,
            vec![
                ("a".into(), 1, Kind::Dir),
                ("a/x".into(), 0, Kind::File),
                ("b".into(), 2, Kind::Dir),
                ("b/new".into(), 2, Kind::File),
                ("f".into(), 2, Kind::Dir),
            ]
        );
        let a = stack.dir(b"a").unwrap().unwrap();
        assert_eq!((a.layers(), a.open_below()), (&[1, 0][..], true));
        assert_eq!(a.entries().unwrap()[&b"y".to_vec()].kind, Kind::Whiteout);
        // Cut off by l1's whiteout; f's directory hides l0's file.
        let b = stack.dir(b"b").unwrap().unwrap();
        assert_eq!((b.layers(), b.open_below()), (&[2][..], false));
        assert!(!stack.dir(b"f").unwrap().unwrap().open_below());
        assert!(stack.dir(b"a/x").unwrap().is_none());
        assert!(stack.dir(b"nothing").unwrap().is_none());
    }

    #[test]
    fn expansion_hides_everything_below_once() {
        let (t, stack) = layers();
        let up = t.path().join("up");
        fs::create_dir_all(up.join("a")).unwrap();
        fs::write(up.join("a/mine"), "m").unwrap();
        let root = rfs::open(&up, OFlags::RDONLY | OFlags::DIRECTORY, Mode::empty()).unwrap();
        // Opaque root: a (dir in both: recurse), b and f whited out.
        assert_eq!(expand_opaque(root.as_fd(), &up, b"", &stack).unwrap(), 3);
        assert_eq!(expand_opaque(root.as_fd(), &up, b"", &stack).unwrap(), 0, "idempotent");
        let st = |p: &str| rfs::statat(&root, p, AtFlags::SYMLINK_NOFOLLOW).unwrap();
        for w in ["a/x", "b", "f"] {
            assert!(is_whiteout(&st(w)), "{w}");
        }
        assert_eq!(FileType::from_raw_mode(st("a/mine").st_mode), FileType::RegularFile);
        assert!(rfs::statat(&root, "a/y", AtFlags::SYMLINK_NOFOLLOW).is_err(), "y is hidden below already");
        assert_eq!(expand_opaque(root.as_fd(), &up, b"nothing-below", &stack).unwrap(), 0);
    }
}
