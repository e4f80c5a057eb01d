//! Snapshots of a container's writable layer: its overlay upper directory written as a layer
//! tar (OCI format: `.wh.` whiteouts, `.wh..wh..opq` for opaque directories) and imported
//! through the ordinary layer import ([`crate::layer::import_layer`]), so a snapshot layer is
//! checked, bounded, stored and content-addressed exactly like an image's.
//!
//! Invariants:
//! - the upper directory is walked with `*at()` calls from directory fds opened with
//!   `O_NOFOLLOW`: a symlink is stored as a symlink and never followed, whatever the sandbox
//!   put there;
//! - the tar is deterministic: entries in byte order of their names, the files' own modes,
//!   owners and mtimes, no user or group names; the same upper gives the same layer id;
//! - owners are written as the sandbox sees them: host ids of the sandbox's range become
//!   `0..65536` again ([`SnapshotOptions::id_base`]); an id outside the range (overlay's own
//!   whiteouts, owned by host root) becomes 65534;
//! - overlay's bookkeeping is translated, never copied: a 0:0 character device is a whiteout,
//!   `trusted.overlay.opaque = y` an opaque directory; other `trusted.*` and `security.*`
//!   xattrs are dropped (only `user.*` is kept), and an upper using redirects or metacopy (whose
//!   meaning lives in the lower layers) is refused rather than copied wrong;
//! - `pack_diff` leaves out what a copy does not need ([`packed_out`]): the contents of /tmp,
//!   /var/tmp and /var/cache, `.cache` directories of homes, and shell and REPL histories.

use std::ffi::{CStr, CString};
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags};
use rustix::io::Errno;

use crate::layer::{Compression, LayerError, Limits, import_layer};
use crate::store::{LayerId, LayerMeta, Store};

/// Ids per sandbox range (a user namespace maps `0..RANGE`).
const RANGE: u32 = 65536;
/// The id an owner outside the sandbox's range gets.
const OVERFLOW_ID: u64 = 65534;
/// Most bytes of one xattr value copied.
const XATTR_MAX: usize = 64 << 10;

/// How a snapshot is taken.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SnapshotOptions {
    /// The first host id of the sandbox's user namespace range (`None`: no user namespace, ids
    /// are kept as they are).
    pub id_base: Option<u32>,
    /// Leave out temporary files, caches and histories ([`packed_out`]).
    pub pack_diff: bool,
    /// Only these paths (relative to the root, no leading `/`) with everything below them,
    /// and the directories above them (without their opaque marks, which would hide what lies
    /// beside the paths); empty: everything. Session sync saves named paths so.
    pub only: Vec<Vec<u8>>,
}

/// Where `path` stands to the paths a snapshot keeps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kept {
    /// One of them or below one.
    Yes,
    /// A directory above one of them.
    Above,
    No,
}

fn kept(only: &[Vec<u8>], path: &[u8]) -> Kept {
    if only.is_empty() {
        return Kept::Yes;
    }
    let below = |a: &[u8], b: &[u8]| a.len() > b.len() && a.starts_with(b) && a[b.len()] == b'/';
    if only.iter().any(|p| path == p.as_slice() || below(path, p)) {
        Kept::Yes
    } else if only.iter().any(|p| below(p, path)) {
        Kept::Above
    } else {
        Kept::No
    }
}

/// Shell and REPL histories `pack_diff` leaves out, wherever they are.
const HISTORIES: &[&[u8]] = &[
    b".bash_history",
    b".ash_history",
    b".zsh_history",
    b".python_history",
    b".node_repl_history",
    b".lesshst",
    b".viminfo",
    b".wget-hsts",
    b".sqlite_history",
    b".psql_history",
    b".mysql_history",
];

/// Directories whose contents `pack_diff` leaves out (the directories themselves stay).
const EMPTIED: &[&[u8]] = &[b"tmp", b"var/tmp", b"var/cache"];

/// Whether `path` (relative to the root, no leading slash) is left out of a packed snapshot:
/// anything under /tmp, /var/tmp or /var/cache, a home's `.cache` (`/root/.cache`,
/// `/home/<user>/.cache`) and what is in it, and shell and REPL histories.
pub fn packed_out(path: &[u8]) -> bool {
    let name = path.rsplit(|b| *b == b'/').next().unwrap_or(path);
    if HISTORIES.contains(&name) {
        return true;
    }
    if EMPTIED.iter().any(|d| path.len() > d.len() && path.starts_with(d) && path[d.len()] == b'/') {
        return true;
    }
    let parts: Vec<&[u8]> = path.split(|b| *b == b'/').collect();
    matches!(parts.as_slice(), [b"root", b".cache", ..] | [b"home", _, b".cache", ..])
}

/// What the tar writer saw.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TarStats {
    pub entries: u64,
    /// Entries `pack_diff` left out (subtrees count once).
    pub left_out: u64,
    /// Sockets and device nodes other than whiteouts: nothing a layer may hold.
    pub skipped: u64,
}

fn err(path: &[u8], why: impl std::fmt::Display) -> LayerError {
    LayerError::InvalidLayer { path: String::from_utf8_lossy(path).into_owned(), why: why.to_string() }
}

fn io_err(path: &[u8], e: impl Into<io::Error>) -> LayerError {
    LayerError::Io { path: PathBuf::from(String::from_utf8_lossy(path).into_owned()), source: e.into() }
}

fn shift(id: u32, base: Option<u32>) -> u64 {
    match base {
        None => u64::from(id),
        Some(b) if id >= b && id - b < RANGE => u64::from(id - b),
        Some(_) => OVERFLOW_ID,
    }
}

fn xattr_names(fd: BorrowedFd<'_>, path: &[u8]) -> Result<Vec<CString>, LayerError> {
    let mut buf = vec![0u8; 4096];
    loop {
        match rfs::flistxattr(fd, &mut buf[..]) {
            Ok(n) => {
                return Ok(buf[..n]
                    .split(|b| *b == 0)
                    .filter(|n| !n.is_empty())
                    .filter_map(|n| CString::new(n).ok())
                    .collect());
            }
            Err(Errno::RANGE) if buf.len() < (1 << 20) => buf.resize(buf.len() * 4, 0),
            Err(Errno::NOTSUP) => return Ok(Vec::new()),
            Err(e) => return Err(io_err(path, e)),
        }
    }
}

fn xattr(fd: BorrowedFd<'_>, name: &CStr, path: &[u8]) -> Result<Option<Vec<u8>>, LayerError> {
    let mut buf = vec![0u8; XATTR_MAX];
    match rfs::fgetxattr(fd, name, &mut buf[..]) {
        Ok(n) => {
            buf.truncate(n);
            Ok(Some(buf))
        }
        Err(Errno::NODATA) | Err(Errno::NOTSUP) => Ok(None),
        Err(Errno::RANGE) => Err(err(path, format!("xattr {name:?} is larger than {XATTR_MAX} bytes"))),
        Err(e) => Err(io_err(path, e)),
    }
}

/// Xattrs copied into a layer: (name, value).
type Xattrs = Vec<(Vec<u8>, Vec<u8>)>;

/// Overlay's view of one upper inode's xattrs: whether it is an opaque directory, and the
/// `user.*` xattrs to copy.
fn overlay_attrs(fd: BorrowedFd<'_>, path: &[u8]) -> Result<(bool, Xattrs), LayerError> {
    let mut opaque = false;
    let mut keep = Vec::new();
    for name in xattr_names(fd, path)? {
        let n = name.as_bytes();
        if n == b"trusted.overlay.opaque" {
            opaque = xattr(fd, &name, path)?.is_some_and(|v| v == b"y");
        } else if n == b"trusted.overlay.redirect" || n == b"trusted.overlay.metacopy" {
            return Err(err(path, "the upper layer uses overlay redirects or metacopy, which a layer cannot carry"));
        } else if n.starts_with(b"user.")
            && !n.starts_with(b"user.overlay.")
            // A PAX key is UTF-8 without '=': other names cannot be carried.
            && std::str::from_utf8(n).is_ok_and(|t| !t.contains('='))
            && let Some(v) = xattr(fd, &name, path)?
        {
            keep.push((n.to_vec(), v));
        }
    }
    Ok((opaque, keep))
}

struct Walker<'a, W: Write> {
    tar: tar::Builder<W>,
    opts: &'a SnapshotOptions,
    limits: &'a Limits,
    /// Names read from directories so far (bounds the memory a walk may take: a directory's
    /// names are held while its children are walked).
    listed: u64,
    stats: TarStats,
    /// (dev, ino) of regular files with more than one link → the first path written.
    links: std::collections::HashMap<(u64, u64), Vec<u8>>,
}

impl<W: Write> Walker<'_, W> {
    fn header(&self, st: &rfs::Stat, kind: tar::EntryType) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(st.st_mode & 0o7777);
        h.set_uid(shift(st.st_uid, self.opts.id_base));
        h.set_gid(shift(st.st_gid, self.opts.id_base));
        h.set_mtime(st.st_mtime.max(0) as u64);
        h.set_size(0);
        h
    }

    fn pax(&mut self, xattrs: &[(Vec<u8>, Vec<u8>)]) -> Result<(), LayerError> {
        if xattrs.is_empty() {
            return Ok(());
        }
        let recs: Vec<(String, &[u8])> = xattrs
            .iter()
            .map(|(n, v)| (format!("SCHILY.xattr.{}", String::from_utf8_lossy(n)), v.as_slice()))
            .collect();
        self.tar.append_pax_extensions(recs.iter().map(|(k, v)| (k.as_str(), *v))).map_err(|e| io_err(b"pax", e))
    }

    fn whiteout(&mut self, path: &[u8]) -> Result<(), LayerError> {
        let (dir, name) = match path.iter().rposition(|b| *b == b'/') {
            Some(i) => (&path[..=i], &path[i + 1..]),
            None => (&b""[..], path),
        };
        let mut wh = dir.to_vec();
        wh.extend_from_slice(b".wh.");
        wh.extend_from_slice(name);
        self.empty_file(&wh)
    }

    fn empty_file(&mut self, path: &[u8]) -> Result<(), LayerError> {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(0);
        h.set_mtime(0);
        self.tar.append_data(&mut h, os(path), io::empty()).map_err(|e| io_err(path, e))?;
        self.stats.entries += 1;
        Ok(())
    }

    /// Writes the children of directory `fd` (at `path`, "" for the root) in name order.
    fn dir(&mut self, fd: BorrowedFd<'_>, path: &[u8], depth: usize) -> Result<(), LayerError> {
        if depth > self.limits.max_depth {
            return Err(LayerError::TooLarge {
                path: String::from_utf8_lossy(path).into_owned(),
                what: "path components",
                limit: self.limits.max_depth as u64,
            });
        }
        let mut names: Vec<Vec<u8>> = Vec::new();
        let dup = rfs::openat(fd, c".", OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty())
            .map_err(|e| io_err(path, e))?;
        for ent in rfs::Dir::read_from(&dup).map_err(|e| io_err(path, e))? {
            let ent = ent.map_err(|e| io_err(path, e))?;
            let n = ent.file_name().to_bytes();
            if n != b"." && n != b".." {
                self.listed += 1;
                if self.listed > self.limits.max_entries {
                    return Err(LayerError::TooLarge {
                        path: String::from_utf8_lossy(path).into_owned(),
                        what: "entries",
                        limit: self.limits.max_entries,
                    });
                }
                names.push(n.to_vec());
            }
        }
        names.sort();
        for name in names {
            let mut child = path.to_vec();
            if !child.is_empty() {
                child.push(b'/');
            }
            child.extend_from_slice(&name);
            self.entry(fd, &name, &child, depth + 1)?;
        }
        Ok(())
    }

    fn entry(&mut self, parent: BorrowedFd<'_>, name: &[u8], path: &[u8], depth: usize) -> Result<(), LayerError> {
        let place = kept(&self.opts.only, path);
        if place == Kept::No || (self.opts.pack_diff && packed_out(path)) {
            self.stats.left_out += 1;
            return Ok(());
        }
        // In a layer these names are whiteouts: a file of that name would delete something in
        // every copy instead of being there.
        if name.starts_with(b".wh.") {
            return Err(err(path, "names beginning with .wh. mean whiteouts in a layer and cannot be carried"));
        }
        let cname = CString::new(name).map_err(|_| err(path, "a NUL byte in a name"))?;
        let st = rfs::statat(parent, &cname, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| io_err(path, e))?;
        // Above a kept path only directories lead on; anything else there is left out.
        if place == Kept::Above && FileType::from_raw_mode(st.st_mode) != FileType::Directory {
            self.stats.left_out += 1;
            return Ok(());
        }
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory => {
                let fd = rfs::openat(
                    parent,
                    &cname,
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| io_err(path, e))?;
                let (opaque, xattrs) = overlay_attrs(fd.as_fd(), path)?;
                self.pax(&xattrs)?;
                let mut h = self.header(&st, tar::EntryType::Directory);
                self.tar.append_data(&mut h, os(path), io::empty()).map_err(|e| io_err(path, e))?;
                self.stats.entries += 1;
                if opaque && place == Kept::Yes {
                    let mut marker = path.to_vec();
                    marker.extend_from_slice(b"/.wh..wh..opq");
                    self.empty_file(&marker)?;
                }
                self.dir(fd.as_fd(), path, depth)
            }
            FileType::RegularFile => {
                let key = (st.st_dev, st.st_ino);
                if st.st_nlink > 1 {
                    if let Some(first) = self.links.get(&key).cloned() {
                        let mut h = self.header(&st, tar::EntryType::Link);
                        self.tar.append_link(&mut h, os(path), os(&first)).map_err(|e| io_err(path, e))?;
                        self.stats.entries += 1;
                        return Ok(());
                    }
                    self.links.insert(key, path.to_vec());
                }
                let fd =
                    rfs::openat(parent, &cname, OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())
                        .map_err(|e| io_err(path, e))?;
                let (_, xattrs) = overlay_attrs(fd.as_fd(), path)?;
                self.pax(&xattrs)?;
                let mut h = self.header(&st, tar::EntryType::Regular);
                h.set_size(st.st_size as u64);
                // A file that shrinks under us (it cannot while the sandbox is frozen) fails
                // the walk rather than shifting the stream.
                let f = Exact { inner: File::from(fd).take(st.st_size as u64), left: st.st_size as u64 };
                self.tar.append_data(&mut h, os(path), f).map_err(|e| io_err(path, e))?;
                self.stats.entries += 1;
                Ok(())
            }
            FileType::Symlink => {
                let target = rfs::readlinkat(parent, &cname, Vec::new()).map_err(|e| io_err(path, e))?;
                let mut h = self.header(&st, tar::EntryType::Symlink);
                self.tar.append_link(&mut h, os(path), os(target.as_bytes())).map_err(|e| io_err(path, e))?;
                self.stats.entries += 1;
                Ok(())
            }
            FileType::CharacterDevice if st.st_rdev == 0 => self.whiteout(path),
            FileType::Fifo => {
                let mut h = self.header(&st, tar::EntryType::Fifo);
                self.tar.append_data(&mut h, os(path), io::empty()).map_err(|e| io_err(path, e))?;
                self.stats.entries += 1;
                Ok(())
            }
            _ => {
                // Sockets (a server's, left behind) and device nodes: a layer holds neither.
                self.stats.skipped += 1;
                Ok(())
            }
        }
    }
}

/// A file's content, failing if it ends before the size written in its header.
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && self.left > 0 && !buf.is_empty() {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the file shrank while it was copied"));
        }
        self.left = self.left.saturating_sub(n as u64);
        Ok(n)
    }
}

/// The import's side of the pipe: an end of stream after the walk failed is an error, so a
/// layer is never committed from a tar the walk did not finish (the tar writer still writes
/// its end-of-archive marker when it is dropped).
struct Guarded<'a> {
    inner: io::PipeReader,
    failed: &'a std::sync::atomic::AtomicBool,
}

impl Read for Guarded<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() && self.failed.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(io::Error::other("the snapshot's walk failed"));
        }
        Ok(n)
    }
}

fn os(b: &[u8]) -> &Path {
    use std::os::unix::ffi::OsStrExt;
    Path::new(std::ffi::OsStr::from_bytes(b))
}

/// Writes the upper directory `upper` as a layer tar to `out`, within `limits` (entries,
/// depth).
pub fn write_upper_tar(
    upper: BorrowedFd<'_>,
    opts: &SnapshotOptions,
    limits: &Limits,
    out: impl Write,
) -> Result<TarStats, LayerError> {
    let mut tar = tar::Builder::new(out);
    tar.mode(tar::HeaderMode::Complete);
    tar.follow_symlinks(false);
    let mut w = Walker { tar, opts, limits, listed: 0, stats: TarStats::default(), links: Default::default() };
    w.dir(upper, b"", 0)?;
    w.tar.finish().map_err(|e| io_err(b"", e))?;
    Ok(w.stats)
}

/// A snapshot layer made and stored.
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub meta: LayerMeta,
    pub tar: TarStats,
}

/// Makes a layer of the upper directory `upper` on top of `lowers` (the layers it was stacked
/// on, bottom first, all in the store) and stores it; an identical layer already stored is
/// reused. The tar streams through a pipe into the import: nothing is staged.
pub fn snapshot_layer(
    store: &Store,
    upper: BorrowedFd<'_>,
    lowers: &[LayerId],
    opts: &SnapshotOptions,
    limits: &Limits,
    source: &str,
) -> Result<Snapshot, LayerError> {
    let (reader, writer) = io::pipe().map_err(|e| io_err(b"pipe", e))?;
    let upper: OwnedFd = upper.try_clone_to_owned().map_err(|e| io_err(b"", e))?;
    let failed = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        let opts = opts.clone();
        let failed_w = &failed;
        let tar = scope.spawn(move || {
            let out = io::BufWriter::with_capacity(1 << 20, writer);
            let r = write_upper_tar(upper.as_fd(), &opts, limits, out);
            // Set before the writer (and with it the pipe) is dropped: the importer sees the
            // failure before it sees the end of the stream.
            if r.is_err() {
                failed_w.store(true, std::sync::atomic::Ordering::SeqCst);
            }
            r
        });
        let mut reader = Guarded { inner: reader, failed: &failed };
        let imported = import_layer(store, &mut reader, Compression::None, None, lowers, limits, source);
        // An import that stopped early (a limit) closes the pipe: the writer then fails with
        // a broken pipe, which is not the cause.
        drop(reader);
        let written = tar.join().unwrap_or_else(|p| std::panic::resume_unwind(p));
        match (imported, written) {
            (Ok(meta), Ok(tar)) => Ok(Snapshot { meta, tar }),
            // The walk's own error is the cause when it failed (the import then only saw
            // the stream end early).
            (_, Err(e)) if !matches!(&e, LayerError::Io { source, .. } if source.kind() == io::ErrorKind::BrokenPipe) => {
                Err(e)
            }
            (Err(e), _) => Err(e),
            (Ok(_), Err(e)) => Err(e),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pack_diff_leaves_out_temporary_files_caches_and_histories() {
        for p in [
            "tmp/x",
            "tmp/a/b",
            "var/tmp/y",
            "var/cache/apt/pkgcache.bin",
            "root/.cache",
            "root/.cache/pip/x",
            "home/user/.cache/x",
            "root/.bash_history",
            "home/user/.python_history",
            "srv/app/.lesshst",
        ] {
            assert!(packed_out(p.as_bytes()), "{p}");
        }
        for p in [
            "tmp",
            "var/tmp",
            "var/cache",
            "tmpfile",
            "var/cachex/y",
            "home/user/.cachex",
            "home/user/work/.cache/x",
            "etc/passwd",
            "root",
        ] {
            assert!(!packed_out(p.as_bytes()), "{p}");
        }
    }

    #[test]
    fn ids_of_the_range_come_back_to_the_sandboxs_view() {
        let base = Some(4096 * RANGE);
        assert_eq!(shift(4096 * RANGE, base), 0);
        assert_eq!(shift(4096 * RANGE + 1000, base), 1000);
        assert_eq!(shift(4097 * RANGE, base), OVERFLOW_ID);
        assert_eq!(shift(0, base), OVERFLOW_ID);
        assert_eq!(shift(1000, None), 1000);
    }
}
