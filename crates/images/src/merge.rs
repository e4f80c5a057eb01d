//! Layer merge: squashes a contiguous run of layers into one new layer, still in overlay
//! format, that stacks on top of the same lower layers exactly as the run did (needed for
//! long fork chains, where a sandbox would otherwise stack hundreds of layers).
//!
//! How the merged layer M is built from the run R (bottom first) and the layers below it:
//! - M holds what the merged view of R alone shows: for every name, the entry of the top-most
//!   layer of R that decides it; files hidden by an upper whiteout are gone.
//! - A whiteout in R is kept only if the name is visible below the run (it still has
//!   something to hide); whiteouts of names nowhere below are dropped.
//! - A directory that R cuts off from what is below (a whiteout or non-directory under its
//!   top-most occurrence in R, or a cut parent) must keep hiding the lower layers' content:
//!   it gets a whiteout for every name visible below that M's directory does not have, as at
//!   opaque expansion.
//! - Hard links: kept as links in M when both ends survive the merge (same source inode, so
//!   necessarily from the same layer); when only one end survives it gets the content. Each
//!   source inode is copied once.
//! - Attributes (mode incl. setuid/sticky, owner, times, xattrs except overlay's own) are
//!   copied; file content with `copy_file_range` (reflinks where the file system can).
//!
//! The merged id is the sha256 of `"merge\n" + <run ids, bottom first, joined by "\n"> +
//! "\n--\n" + <lower ids joined by "\n">`: a merge of the same run on the same lowers is
//! done once. Durability as for imports: one `syncfs` before the commit.

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use rustix::fs::{self as rfs, AtFlags, FileType, Gid, Mode, OFlags, Timespec, Timestamps, Uid, XattrFlags};
use rustix::io::Errno;
use sha2::{Digest, Sha256};

use crate::layer::LayerError;
use crate::overlay::{DirView, Found, Kind, LayerStack};
use crate::store::{LayerId, LayerMeta, Store};
use crate::unpack::{make_whiteout, open_dir};

/// The id of the layer merged from `run` (bottom first) on top of `lowers`.
pub fn merged_layer_id(run: &[LayerId], lowers: &[LayerId]) -> LayerId {
    let ids = |l: &[LayerId]| l.iter().map(LayerId::as_str).collect::<Vec<_>>().join("\n");
    let mut h = Sha256::new();
    h.update(b"merge\n");
    h.update(ids(run).as_bytes());
    h.update(b"\n--\n");
    h.update(ids(lowers).as_bytes());
    LayerId::from_digest(&h.finalize().into())
}

/// Squashes `layers` (bottom first, a contiguous run of an image's layers) into one new layer
/// that stacks on `lowers` (what is below the run, bottom first) the same as the run did.
/// Returns the merged layer's meta; an existing merge of the same run is returned as is.
pub fn merge_layers(store: &Store, layers: &[LayerId], lowers: &[LayerId]) -> Result<LayerMeta, LayerError> {
    if layers.is_empty() {
        return Err(LayerError::EmptyMerge);
    }
    let id = merged_layer_id(layers, lowers);
    if store.has_layer(&id) {
        return Ok(store.layer_meta(&id)?);
    }
    let run = LayerStack::from_store(store, layers)?;
    let below = LayerStack::from_store(store, lowers)?;
    let pending = store.begin_layer()?;
    let out_path = pending.rootfs();
    let out =
        rfs::open(&out_path, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW, Mode::empty())
            .map_err(|e| LayerError::Io { path: out_path.clone(), source: e.into() })?;
    let mut m = Merger {
        run: &run,
        out: out.as_fd(),
        out_path: out_path.clone(),
        links: HashMap::new(),
        size_bytes: 0,
        entries: 0,
    };
    let below_root = below.root();
    m.dir(out.as_fd(), &run.root(), Some(&below_root), false)?;
    // The root's attributes: the top-most layer's.
    m.copy_dir_attrs(run.len() - 1, b"", out.as_fd())?;
    rfs::syncfs(&out).map_err(|e| LayerError::Io { path: out_path.clone(), source: e.into() })?;
    let meta = LayerMeta {
        v: 1,
        id,
        size_bytes: m.size_bytes,
        entries: m.entries,
        created_at_ms: opendsec_common::time::now_ms(),
        source: format!("merge of {} layers ({}..{})", layers.len(), layers[0], layers[layers.len() - 1]),
        diff_id: String::new(),
        lowers: lowers.to_vec(),
    };
    store.commit_layer(pending, &meta)?;
    tracing::debug!(layer = %meta.id, merged = layers.len(), entries = meta.entries, "layers merged");
    Ok(meta)
}

struct Merger<'a> {
    run: &'a LayerStack,
    out: BorrowedFd<'a>,
    out_path: PathBuf,
    /// Source inode (dev, ino) of multiply-linked files → where its first copy went in M.
    links: HashMap<(u64, u64), Vec<u8>>,
    size_bytes: u64,
    entries: u64,
}

fn join(dir: &[u8], name: &[u8]) -> Vec<u8> {
    let mut p = dir.to_vec();
    if !p.is_empty() {
        p.push(b'/');
    }
    p.extend_from_slice(name);
    p
}

fn times(st: &rfs::Stat) -> Timestamps {
    Timestamps {
        last_access: Timespec { tv_sec: st.st_atime, tv_nsec: st.st_atime_nsec as _ },
        last_modification: Timespec { tv_sec: st.st_mtime, tv_nsec: st.st_mtime_nsec as _ },
    }
}

/// Copies xattrs (but overlay's own) from `src` to `dst`; unsupported ones are skipped.
fn copy_xattrs(src: BorrowedFd<'_>, dst: BorrowedFd<'_>) -> rustix::io::Result<()> {
    let mut names = vec![0u8; 64 << 10];
    let n = match rfs::flistxattr(src, &mut names[..]) {
        Ok(n) => n,
        Err(Errno::OPNOTSUPP) => return Ok(()),
        Err(e) => return Err(e),
    };
    let mut value = vec![0u8; 64 << 10];
    for name in names[..n].split(|b| *b == 0).filter(|n| !n.is_empty()) {
        if name.starts_with(b"trusted.overlay.") || name.starts_with(b"user.overlay.") {
            continue;
        }
        let len = match rfs::fgetxattr(src, name, &mut value[..]) {
            Ok(len) => len,
            Err(Errno::NODATA) => continue,
            Err(e) => return Err(e),
        };
        match rfs::fsetxattr(dst, name, &value[..len], XattrFlags::empty()) {
            Ok(()) | Err(Errno::OPNOTSUPP) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

impl Merger<'_> {
    fn out_io(&self, path: &[u8], e: Errno) -> LayerError {
        LayerError::Io { path: self.out_path.join(OsStr::from_bytes(path)), source: e.into() }
    }

    fn src_io(&self, layer: usize, path: &[u8], e: Errno) -> LayerError {
        LayerError::Io { path: self.run.layer_path(layer).join(OsStr::from_bytes(path)), source: e.into() }
    }

    /// Writes M's directory `run.path()` into `out`. `below` is the lower layers' merged
    /// directory at the same path, if any; `cut` says whether R hides it (then every lower
    /// name M does not have gets a whiteout).
    fn dir(
        &mut self,
        out: BorrowedFd<'_>,
        run: &DirView<'_>,
        below: Option<&DirView<'_>>,
        cut: bool,
    ) -> Result<(), LayerError> {
        let entries = run.entries()?;
        let below_names: BTreeMap<Vec<u8>, Found> = match below {
            Some(b) => b.visible()?,
            None => BTreeMap::new(),
        };
        for (name, found) in &entries {
            let path = join(run.path(), name);
            match found.kind {
                Kind::Whiteout => {
                    if below_names.contains_key(name) {
                        make_whiteout(out, name).map_err(|e| self.out_io(&path, e))?;
                        self.entries += 1;
                    }
                }
                Kind::Dir => {
                    let Some(child) = run.child(name)? else {
                        continue;
                    };
                    rfs::mkdirat(out, name.as_slice(), Mode::from_raw_mode(0o700))
                        .map_err(|e| self.out_io(&path, e))?;
                    self.entries += 1;
                    let cfd = open_dir(out, name).map_err(|e| self.out_io(&path, e))?;
                    let child_below = match (below, below_names.get(name)) {
                        (Some(b), Some(f)) if f.kind == Kind::Dir => b.child(name)?,
                        _ => None,
                    };
                    let child_cut = cut || !child.open_below();
                    self.dir(cfd.as_fd(), &child, child_below.as_ref(), child_cut)?;
                    self.copy_dir_attrs(child.layers()[0], &path, cfd.as_fd())?;
                }
                _ => self.copy_entry(found.layer, &path, out, name)?,
            }
        }
        if cut {
            for name in below_names.keys().filter(|n| !entries.contains_key(*n)) {
                make_whiteout(out, name).map_err(|e| self.out_io(&join(run.path(), name), e))?;
                self.entries += 1;
            }
        }
        Ok(())
    }

    fn copy_dir_attrs(&self, layer: usize, path: &[u8], dst: BorrowedFd<'_>) -> Result<(), LayerError> {
        let src = open_dir(self.run.layer_root(layer), path).map_err(|e| self.src_io(layer, path, e))?;
        let st = rfs::fstat(&src).map_err(|e| self.src_io(layer, path, e))?;
        self.copy_attrs(src.as_fd(), &st, dst, path)
    }

    fn copy_attrs(
        &self,
        src: BorrowedFd<'_>,
        st: &rfs::Stat,
        dst: BorrowedFd<'_>,
        path: &[u8],
    ) -> Result<(), LayerError> {
        let e = |e| self.out_io(path, e);
        rfs::fchown(dst, Some(Uid::from_raw(st.st_uid)), Some(Gid::from_raw(st.st_gid))).map_err(e)?;
        rfs::fchmod(dst, Mode::from_raw_mode(st.st_mode & 0o7777)).map_err(e)?;
        copy_xattrs(src, dst).map_err(e)?;
        rfs::futimens(dst, &times(st)).map_err(e)
    }

    /// Copies a non-directory from layer `layer` at `path` to `name` in `out`.
    fn copy_entry(&mut self, layer: usize, path: &[u8], out: BorrowedFd<'_>, name: &[u8]) -> Result<(), LayerError> {
        let src_root = self.run.layer_root(layer);
        let st = rfs::statat(src_root, path, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| self.src_io(layer, path, e))?;
        let key = (st.st_dev as u64, st.st_ino as u64);
        if st.st_nlink > 1
            && let Some(first) = self.links.get(&key)
        {
            rfs::linkat(self.out, first.as_slice(), out, name, AtFlags::empty()).map_err(|e| self.out_io(path, e))?;
            self.entries += 1;
            return Ok(());
        }
        let nofollow = AtFlags::SYMLINK_NOFOLLOW;
        match FileType::from_raw_mode(st.st_mode) {
            FileType::RegularFile => {
                let src: OwnedFd =
                    rfs::openat(src_root, path, OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())
                        .map_err(|e| self.src_io(layer, path, e))?;
                let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
                let dst =
                    rfs::openat(out, name, flags, Mode::from_raw_mode(0o600)).map_err(|e| self.out_io(path, e))?;
                let (mut s, mut d) = (File::from(src), File::from(dst));
                // copy_file_range underneath: no user-space copy, reflinks where supported.
                let n = std::io::copy(&mut s, &mut d)
                    .map_err(|e| LayerError::Io { path: self.out_path.join(OsStr::from_bytes(path)), source: e })?;
                self.size_bytes += n;
                self.copy_attrs(s.as_fd(), &st, d.as_fd(), path)?;
            }
            FileType::Symlink => {
                let target = rfs::readlinkat(src_root, path, Vec::new()).map_err(|e| self.src_io(layer, path, e))?;
                rfs::symlinkat(target.as_c_str(), out, name).map_err(|e| self.out_io(path, e))?;
                rfs::chownat(out, name, Some(Uid::from_raw(st.st_uid)), Some(Gid::from_raw(st.st_gid)), nofollow)
                    .map_err(|e| self.out_io(path, e))?;
                rfs::utimensat(out, name, &times(&st), nofollow).map_err(|e| self.out_io(path, e))?;
            }
            ft => {
                // Fifos, sockets and (from snapshots, later) devices: recreated as they are.
                rfs::mknodat(out, name, ft, Mode::from_raw_mode(0o600), st.st_rdev as _)
                    .map_err(|e| self.out_io(path, e))?;
                rfs::chownat(out, name, Some(Uid::from_raw(st.st_uid)), Some(Gid::from_raw(st.st_gid)), nofollow)
                    .map_err(|e| self.out_io(path, e))?;
                rfs::chmodat(out, name, Mode::from_raw_mode(st.st_mode & 0o7777), AtFlags::empty())
                    .map_err(|e| self.out_io(path, e))?;
                rfs::utimensat(out, name, &times(&st), nofollow).map_err(|e| self.out_io(path, e))?;
            }
        }
        self.entries += 1;
        if st.st_nlink > 1 {
            self.links.insert(key, path.to_vec());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merged_ids_name_the_run_and_its_lowers() {
        let l = |n: u8| LayerId::from_digest(&[n; 32]);
        let a = merged_layer_id(&[l(1), l(2)], &[l(0)]);
        assert_ne!(a, merged_layer_id(&[l(1), l(2)], &[]));
        assert_ne!(a, merged_layer_id(&[l(2), l(1)], &[l(0)]));
        assert_ne!(a, merged_layer_id(&[l(1)], &[l(0), l(2)]));
        assert_eq!(a, merged_layer_id(&[l(1), l(2)], &[l(0)]));
    }
}
