//! Safe unpacking of one layer tar into a pending layer's `rootfs/`, in overlay format.
//!
//! Invariants (nothing in a layer is trusted):
//! - No entry can land outside the rootfs. Every parent directory is opened with
//!   `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS | RESOLVE_NO_SYMLINKS)` relative to the
//!   rootfs, and entries are created with `*at()` calls relative to that parent (`openat` with
//!   `O_CREAT | O_EXCL | O_NOFOLLOW`, `mkdirat`, `symlinkat`, `linkat`, `mknodat`). Symlinks
//!   are stored, never followed.
//! - Refused with [`LayerError::InvalidLayer`], never rewritten: absolute paths, `..`
//!   components, NUL bytes, an entry whose parent path goes through a symlink (a layer made by
//!   any real tool never writes through a symlink; such entries only exist to escape), a
//!   parent that is not a directory, hard links whose target is absent, outside, a directory
//!   or a whiteout, character and block devices (whiteouts come only from `.wh.` names),
//!   unknown entry types, a corrupt or truncated stream.
//! - Bounded ([`LayerError::TooLarge`]): file size, total content and uncompressed stream
//!   size, entries, path depth and length; the metadata tar reads between two entries (PAX
//!   headers, long names) is capped at [`META_BUDGET`] so a hostile header cannot make us
//!   allocate without limit.
//! - The uncompressed stream is hashed whole (including what follows the end-of-archive
//!   marker), so the diff id is checked against exactly what was read.
//!
//! Format: `.wh.<name>` becomes a 0:0 character device `<name>`; `.wh..wh..opq` marks its
//! directory opaque, to be expanded against the lower layers by the caller (NFS carries no
//! `trusted.*` xattrs); other `.wh..wh.*` names and what is inside them (AUFS bookkeeping)
//! are skipped. As the OCI spec
//! says, a whiteout only hides lower layers: a name present in the same layer stays, and a
//! directory both present and whited out in one layer is treated as opaque. A later entry for
//! the same path replaces the earlier one (a directory over a directory merges). Fifos are
//! allowed (they give access to nothing). Modes (incl. setuid/setgid/sticky), owners, mtimes
//! and PAX `SCHILY.xattr.*` xattrs are restored (xattrs where the file system supports them;
//! `trusted.overlay.*` and `user.overlay.*` are never taken from a layer); directory
//! attributes are applied at the end, after their children exist.

use std::cell::{Cell, RefCell};
use std::collections::{BTreeSet, HashMap};
use std::ffi::{CString, OsStr};
use std::fs::File;
use std::io::{self, BufReader, Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use rustix::fs::{
    self as rfs, AtFlags, FileType, Gid, Mode, OFlags, ResolveFlags, Timespec, Timestamps, Uid, XattrFlags,
};
use rustix::io::Errno;
use sha2::{Digest, Sha256};
use tar::EntryType;

use crate::decompress::{self, Compression};
use crate::limits::{LayerError, Limits};
use crate::store::LayerId;

/// How much tar may read between two entries (PAX headers, GNU long names, padding).
pub const META_BUDGET: u64 = 16 << 20;
/// Buffer for reading the blob and for copying file content.
const IO_BUF: usize = 1 << 20;
/// Buffer between the decompressor and the tar parser (headers are read 512 bytes at a time).
const TAR_BUF: usize = 256 << 10;

/// How every path inside a layer is resolved: inside the root, through no symlink.
pub(crate) const RESOLVE: ResolveFlags =
    ResolveFlags::IN_ROOT.union(ResolveFlags::NO_MAGICLINKS).union(ResolveFlags::NO_SYMLINKS);

/// `openat2` of a directory with [`RESOLVE`], retried on EAGAIN (the kernel asks for a retry
/// when a rename raced with the lookup).
pub(crate) fn open_dir(dirfd: BorrowedFd<'_>, path: &[u8]) -> rustix::io::Result<OwnedFd> {
    let path: &[u8] = if path.is_empty() { b"." } else { path };
    let mut tries = 0;
    loop {
        match rfs::openat2(dirfd, path, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC, Mode::empty(), RESOLVE) {
            Err(Errno::AGAIN | Errno::INTR) if tries < 64 => tries += 1,
            r => return r,
        }
    }
}

/// A path for messages: lossy, and cut short.
pub(crate) fn shown(raw: &[u8]) -> String {
    let s = String::from_utf8_lossy(raw);
    if s.chars().count() > 200 { format!("{}...", s.chars().take(200).collect::<String>()) } else { s.into_owned() }
}

fn invalid(path: &[u8], why: impl Into<String>) -> LayerError {
    LayerError::InvalidLayer { path: shown(path), why: why.into() }
}

/// Splits an entry path into components: `.` and empty components are dropped; absolute
/// paths, `..`, NUL bytes and names over 255 bytes are refused (with why).
pub(crate) fn normalize(raw: &[u8]) -> Result<Vec<&[u8]>, &'static str> {
    if raw.contains(&0) {
        return Err("path contains a NUL byte");
    }
    if raw.first() == Some(&b'/') {
        return Err("absolute path (entries must be relative to the layer root)");
    }
    let mut out = Vec::new();
    for c in raw.split(|b| *b == b'/') {
        match c {
            b"" | b"." => {}
            b".." => return Err("path has a '..' component"),
            c if c.len() > 255 => return Err("a path component is longer than 255 bytes"),
            c => out.push(c),
        }
    }
    Ok(out)
}

/// Why the stream stopped, recorded by the readers below so that an `io::Error` coming back
/// through the decompressor and the tar parser can be classified.
enum Stop {
    Source(io::Error),
    StreamTooLarge(u64),
    MetadataTooLarge,
}

#[derive(Default)]
struct StreamState {
    /// Uncompressed bytes read so far.
    pos: Cell<u64>,
    /// Reading past this position is refused (set around tar's reads between entries).
    budget_end: Cell<u64>,
    stop: RefCell<Option<Stop>>,
}

impl StreamState {
    fn classify(&self, e: io::Error, path: &[u8]) -> LayerError {
        match self.stop.borrow_mut().take() {
            Some(Stop::Source(source)) => LayerError::Read { source },
            Some(Stop::StreamTooLarge(limit)) => {
                LayerError::TooLarge { path: shown(path), what: "bytes of uncompressed layer stream", limit }
            }
            Some(Stop::MetadataTooLarge) => {
                invalid(path, format!("more than {META_BUDGET} bytes of tar headers before the next entry"))
            }
            None => invalid(path, format!("malformed layer stream (corrupt or truncated compression or tar): {e}")),
        }
    }
}

/// The caller's blob; marks its errors as the source's.
struct SourceReader<'a> {
    inner: &'a mut dyn Read,
    state: Rc<StreamState>,
}

impl Read for SourceReader<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.inner.read(buf) {
            Ok(n) => Ok(n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => Err(e),
            Err(e) => {
                let copy = io::Error::new(e.kind(), e.to_string());
                *self.state.stop.borrow_mut() = Some(Stop::Source(e));
                Err(copy)
            }
        }
    }
}

/// The uncompressed stream: counted, bounded and hashed.
struct Meter<R> {
    inner: R,
    hasher: Sha256,
    state: Rc<StreamState>,
    max: u64,
}

impl<R: Read> Read for Meter<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        let pos = self.state.pos.get() + n as u64;
        self.state.pos.set(pos);
        if pos > self.max {
            *self.state.stop.borrow_mut() = Some(Stop::StreamTooLarge(self.max));
            return Err(io::Error::other("layer stream too large"));
        }
        if pos > self.state.budget_end.get() {
            *self.state.stop.borrow_mut() = Some(Stop::MetadataTooLarge);
            return Err(io::Error::other("too much tar metadata"));
        }
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

/// Attributes of a directory, applied once its children are in place.
struct DirAttrs {
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: Timespec,
    xattrs: Vec<(CString, Vec<u8>)>,
}

/// The last parent directory opened, reused by the next entries in the same directory (tars
/// list directories together). Dropped whenever a directory is removed, so a cached fd never
/// points into a removed tree.
struct DirCache {
    key: Vec<u8>,
    fd: Option<OwnedFd>,
}

/// A tar unpacked into a pending rootfs, before its directories got their attributes.
pub(crate) struct Unpacked {
    root: OwnedFd,
    root_path: PathBuf,
    pub diff_id: LayerId,
    /// Bytes of regular file content.
    pub size_bytes: u64,
    /// Tar entries (whiteouts included).
    pub entries: u64,
    /// Directories (paths relative to the rootfs, `/`-joined, "" for the root) to expand
    /// against the lower layers: opaque ones, and ones also whited out in the same layer.
    pub expand: BTreeSet<Vec<u8>>,
    dirs: HashMap<Vec<u8>, DirAttrs>,
}

impl Unpacked {
    /// The rootfs directory.
    pub fn root(&self) -> BorrowedFd<'_> {
        self.root.as_fd()
    }

    /// Applies directory attributes (after anything else is written into them: opaque
    /// expansion adds whiteouts) and flushes the file system holding the layer.
    pub fn finish(&self) -> Result<(), LayerError> {
        let mut dirs: Vec<_> = self.dirs.iter().collect();
        // Deepest first; attributes of a child never change its parent, but a predictable
        // order makes failures reproducible.
        dirs.sort_by(|a, b| b.0.cmp(a.0));
        for (path, a) in dirs {
            let fd = match open_dir(self.root.as_fd(), path) {
                Ok(fd) => fd,
                // Replaced by a later entry of another type.
                Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP) => continue,
                Err(e) => return Err(self.io(path, e)),
            };
            set_attrs(fd.as_fd(), a.uid, a.gid, a.mode, a.mtime, &a.xattrs).map_err(|e| self.attr_err(path, e))?;
        }
        rfs::syncfs(&self.root).map_err(|e| self.io(b"", e))
    }

    fn io(&self, path: &[u8], e: Errno) -> LayerError {
        LayerError::Io { path: self.root_path.join(OsStr::from_bytes(path)), source: e.into() }
    }

    fn attr_err(&self, path: &[u8], e: AttrError) -> LayerError {
        match e {
            AttrError::Xattr(name, why) => invalid(path, format!("xattr {}: {why}", shown(name.as_bytes()))),
            AttrError::Io(e) => self.io(path, e),
        }
    }
}

enum AttrError {
    Xattr(CString, Errno),
    Io(Errno),
}

impl From<Errno> for AttrError {
    fn from(e: Errno) -> AttrError {
        AttrError::Io(e)
    }
}

fn set_xattrs(fd: BorrowedFd<'_>, xattrs: &[(CString, Vec<u8>)]) -> Result<(), AttrError> {
    for (name, value) in xattrs {
        match rfs::fsetxattr(fd, name.as_c_str(), value, XattrFlags::empty()) {
            Ok(()) => {}
            // Not supported by this file system (NFS, for most namespaces), or an unknown
            // namespace: skipped, as the issue asks.
            Err(Errno::OPNOTSUPP) => {}
            Err(e @ (Errno::TOOBIG | Errno::RANGE | Errno::INVAL)) => return Err(AttrError::Xattr(name.clone(), e)),
            Err(e) => return Err(AttrError::Io(e)),
        }
    }
    Ok(())
}

/// Owner before mode (chown clears setuid bits and file capabilities), xattrs after both
/// (`security.capability` must survive), times last.
fn set_attrs(
    fd: BorrowedFd<'_>,
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: Timespec,
    xattrs: &[(CString, Vec<u8>)],
) -> Result<(), AttrError> {
    rfs::fchown(fd, Some(Uid::from_raw(uid)), Some(Gid::from_raw(gid)))?;
    rfs::fchmod(fd, Mode::from_raw_mode(mode))?;
    set_xattrs(fd, xattrs)?;
    rfs::futimens(fd, &Timestamps { last_access: mtime, last_modification: mtime })?;
    Ok(())
}

/// Metadata of one entry, read from its header and PAX records.
struct Meta {
    uid: u32,
    gid: u32,
    mode: u32,
    mtime: Timespec,
    xattrs: Vec<(CString, Vec<u8>)>,
}

fn read_meta<R: Read>(entry: &mut tar::Entry<'_, R>, path: &[u8]) -> Result<Meta, LayerError> {
    let h = entry.header();
    let bad = |what: &str, e: io::Error| invalid(path, format!("bad {what} in header: {e}"));
    let mode = h.mode().map_err(|e| bad("mode", e))? & 0o7777;
    let id = |v: u64, what: &str| {
        u32::try_from(v)
            .ok()
            .filter(|v| *v != u32::MAX)
            .ok_or_else(|| invalid(path, format!("{what} {v} is out of range")))
    };
    let uid = id(h.uid().map_err(|e| bad("uid", e))?, "uid")?;
    let gid = id(h.gid().map_err(|e| bad("gid", e))?, "gid")?;
    let header_mtime = h.mtime().map_err(|e| bad("mtime", e))?;
    let mut mtime = Timespec { tv_sec: i64::try_from(header_mtime).unwrap_or(i64::MAX), tv_nsec: 0 };
    let mut xattrs = Vec::new();
    let mut xattr_bytes = 0usize;
    if let Some(exts) = entry.pax_extensions().map_err(|e| bad("pax records", e))? {
        for ext in exts {
            let ext = ext.map_err(|e| bad("pax record", e))?;
            let key = ext.key_bytes();
            if key == b"mtime" {
                if let Some(t) = parse_pax_time(ext.value_bytes()) {
                    mtime = t;
                }
            } else if let Some(name) = key.strip_prefix(b"SCHILY.xattr.") {
                // Overlay's own attributes would change how the layer stacks: never taken
                // from an image.
                if name.starts_with(b"trusted.overlay.") || name.starts_with(b"user.overlay.") {
                    continue;
                }
                // The kernel takes at most 64 KiB per value and per entry's list: anything
                // bigger is refused here, before directories keep it until the layer's end.
                let value = ext.value_bytes();
                xattr_bytes += name.len() + value.len();
                if value.len() > XATTR_MAX || xattr_bytes > XATTR_MAX {
                    return Err(invalid(path, format!("extended attributes above {XATTR_MAX} bytes")));
                }
                let name = CString::new(name).map_err(|_| invalid(path, "xattr name contains a NUL byte"))?;
                xattrs.push((name, value.to_vec()));
            }
        }
    }
    Ok(Meta { uid, gid, mode, mtime, xattrs })
}

/// Linux's XATTR_SIZE_MAX (and XATTR_LIST_MAX): the most one entry's attributes may hold.
const XATTR_MAX: usize = 64 << 10;
/// Most bytes of directory xattrs one layer may carry (they are held until the layer's
/// directories get their attributes, after their contents).
pub const DIR_XATTRS_MAX: usize = 16 << 20;

/// `secs[.frac]` as PAX writes times.
fn parse_pax_time(v: &[u8]) -> Option<Timespec> {
    let s = std::str::from_utf8(v).ok()?;
    let (secs, frac) = s.split_once('.').unwrap_or((s, ""));
    let tv_sec: i64 = secs.parse().ok()?;
    if frac.is_empty() || tv_sec < 0 {
        return Some(Timespec { tv_sec, tv_nsec: 0 });
    }
    let digits: String = frac.chars().take(9).collect();
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let tv_nsec: i64 = format!("{digits:0<9}").parse().ok()?;
    Some(Timespec { tv_sec, tv_nsec })
}

/// Unpacks `blob` into `rootfs` (an empty directory). `compression` is what the image
/// declares; the blob's magic bytes decide. See the module docs.
pub(crate) fn unpack(
    rootfs: &Path,
    blob: &mut dyn Read,
    compression: Compression,
    limits: &Limits,
) -> Result<Unpacked, LayerError> {
    let root =
        rfs::open(rootfs, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC | OFlags::NOFOLLOW, Mode::empty())
            .map_err(|e| LayerError::Io { path: rootfs.to_path_buf(), source: e.into() })?;
    let state = Rc::new(StreamState { budget_end: Cell::new(u64::MAX), ..Default::default() });
    let mut src = SourceReader { inner: blob, state: state.clone() };
    // The blob's magic bytes win over the declared compression: some registries label
    // uncompressed layers as gzip (containerd sniffs too); the diff id check makes it safe.
    let mut head = [0u8; 4];
    let mut got = 0;
    while got < head.len() {
        match src.read(&mut head[got..]) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(state.classify(e, b"(start of layer)")),
        }
    }
    let sniffed = Compression::sniff(&head[..got]);
    if sniffed != compression {
        tracing::debug!(declared = ?compression, found = ?sniffed, "layer blob compression differs from its media type");
    }
    let source = BufReader::with_capacity(IO_BUF, (&head[..got]).chain(src));
    let decoded = decompress::decoder(source, sniffed).map_err(|e| state.classify(e, b""))?;
    let meter = Meter { inner: decoded, hasher: Sha256::new(), state: state.clone(), max: limits.max_layer_bytes };
    let mut archive = tar::Archive::new(BufReader::with_capacity(TAR_BUF, meter));
    let mut w = Writer {
        root,
        root_path: rootfs.to_path_buf(),
        cache: DirCache { key: Vec::new(), fd: None },
        buf: vec![0; IO_BUF],
        dirs: HashMap::new(),
        dir_xattr_bytes: 0,
        opaque: BTreeSet::new(),
        whited: BTreeSet::new(),
        size_bytes: 0,
        entries: 0,
        last: Vec::new(),
    };
    {
        let mut entries = archive.entries().map_err(|e| state.classify(e, b""))?;
        loop {
            state.budget_end.set(state.pos.get().saturating_add(META_BUDGET));
            let next = entries.next();
            state.budget_end.set(u64::MAX);
            let mut entry = match next {
                None => break,
                Some(Ok(entry)) => entry,
                Some(Err(e)) => {
                    let after = if w.last.is_empty() { b"(start of layer)".to_vec() } else { w.last.clone() };
                    return Err(state.classify(e, &after));
                }
            };
            w.entry(&mut entry, limits, &state)?;
        }
    }
    // The diff id covers the whole stream, including the zero blocks after the end marker.
    let mut rest = archive.into_inner();
    io::copy(&mut rest, &mut io::sink()).map_err(|e| state.classify(e, b"(end of layer)"))?;
    let meter = rest.into_inner();
    if state.pos.get() == 0 {
        return Err(invalid(
            b"(start of layer)",
            "the layer stream is empty (a tar has at least its end-of-archive blocks)",
        ));
    }
    let diff_id = LayerId::from_digest(&meter.hasher.finalize().into());

    // Whited-out names that are directories of this layer hide the lower ones: opaque.
    let mut expand = w.opaque;
    for path in w.whited {
        let (parent, name) = split_parent(&path);
        let is_dir = open_dir(w.root.as_fd(), parent)
            .ok()
            .and_then(|p| rfs::statat(&p, name, AtFlags::SYMLINK_NOFOLLOW).ok())
            .is_some_and(|st| FileType::from_raw_mode(st.st_mode) == FileType::Directory);
        if is_dir {
            expand.insert(path);
        }
    }
    Ok(Unpacked {
        root: w.root,
        root_path: w.root_path,
        diff_id,
        size_bytes: w.size_bytes,
        entries: w.entries,
        expand,
        dirs: w.dirs,
    })
}

/// `(parent, name)` of a `/`-joined relative path ("" parent for a top-level name).
fn split_parent(path: &[u8]) -> (&[u8], &[u8]) {
    match path.iter().rposition(|b| *b == b'/') {
        Some(i) => (&path[..i], &path[i + 1..]),
        None => (&[][..], path),
    }
}

struct Writer {
    root: OwnedFd,
    root_path: PathBuf,
    cache: DirCache,
    buf: Vec<u8>,
    dirs: HashMap<Vec<u8>, DirAttrs>,
    /// Bytes of directory xattrs held in `dirs` until `finish` ([`DIR_XATTRS_MAX`]).
    dir_xattr_bytes: usize,
    opaque: BTreeSet<Vec<u8>>,
    whited: BTreeSet<Vec<u8>>,
    size_bytes: u64,
    entries: u64,
    /// The last entry's path, for messages about what follows it.
    last: Vec<u8>,
}

/// What happened to an existing name that had to make room.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Removed {
    Nothing,
    NonDir,
    Dir,
}

impl Writer {
    /// Keeps a directory's attributes for `finish`; its xattrs count against
    /// [`DIR_XATTRS_MAX`] (each directory may carry 64 KiB, and a layer millions of them).
    fn keep_dir_attrs(&mut self, key: Vec<u8>, meta: Meta, raw: &[u8]) -> Result<(), LayerError> {
        let bytes: usize = meta.xattrs.iter().map(|(n, v)| n.as_bytes().len() + v.len()).sum();
        let before =
            self.dirs.get(&key).map_or(0, |d| d.xattrs.iter().map(|(n, v)| n.as_bytes().len() + v.len()).sum());
        self.dir_xattr_bytes = self.dir_xattr_bytes.saturating_sub(before).saturating_add(bytes);
        if self.dir_xattr_bytes > DIR_XATTRS_MAX {
            return Err(LayerError::TooLarge {
                path: shown(raw),
                what: "bytes of directory extended attributes in the layer",
                limit: DIR_XATTRS_MAX as u64,
            });
        }
        self.dirs.insert(
            key,
            DirAttrs { uid: meta.uid, gid: meta.gid, mode: meta.mode, mtime: meta.mtime, xattrs: meta.xattrs },
        );
        Ok(())
    }

    fn io(&self, path: &[u8], e: impl Into<io::Error>) -> LayerError {
        LayerError::Io { path: self.root_path.join(OsStr::from_bytes(path)), source: e.into() }
    }

    fn attr_err(&self, path: &[u8], e: AttrError) -> LayerError {
        match e {
            AttrError::Xattr(name, why) => invalid(path, format!("xattr {}: {why}", shown(name.as_bytes()))),
            AttrError::Io(e) => self.io(path, e),
        }
    }

    fn entry<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        limits: &Limits,
        state: &StreamState,
    ) -> Result<(), LayerError> {
        let kind = entry.header().entry_type();
        let raw = entry.path_bytes().into_owned();
        self.last.clone_from(&raw);
        if kind.is_pax_global_extensions() {
            // Defaults for later entries that only archivers care about (no OCI tool writes
            // path or owner defaults there).
            return self.drain(entry, &raw, state);
        }
        self.entries += 1;
        if self.entries > limits.max_entries {
            return Err(LayerError::TooLarge { path: shown(&raw), what: "entries", limit: limits.max_entries });
        }
        if raw.len() > limits.max_path_bytes {
            return Err(LayerError::TooLarge {
                path: shown(&raw),
                what: "bytes of path",
                limit: limits.max_path_bytes as u64,
            });
        }
        let comps = normalize(&raw).map_err(|why| invalid(&raw, why))?;
        if comps.len() > limits.max_depth {
            return Err(LayerError::TooLarge {
                path: shown(&raw),
                what: "path components",
                limit: limits.max_depth as u64,
            });
        }
        if matches!(kind, EntryType::Char | EntryType::Block) {
            return Err(invalid(&raw, "device files are not allowed in layers (whiteouts are written as .wh. names)"));
        }
        if comps.split_last().is_some_and(|(_, parent)| parent.iter().any(|c| c.starts_with(b".wh..wh."))) {
            // Inside AUFS bookkeeping directories (.wh..wh.plnk/...): not content.
            return self.drain(entry, &raw, state);
        }
        let meta = read_meta(entry, &raw)?;
        let key = comps.join(&b'/');
        let Some((name, parent)) = comps.split_last() else {
            // The layer root itself ("./"): its attributes become the rootfs's.
            if kind != EntryType::Directory {
                return Err(invalid(&raw, format!("the layer root must be a directory, not {kind:?}")));
            }
            self.keep_dir_attrs(Vec::new(), meta, &raw)?;
            return self.drain(entry, &raw, state);
        };
        let parent_key = parent.join(&b'/');

        if let Some(hidden) = name.strip_prefix(b".wh.") {
            self.whiteout(hidden, parent, &parent_key, &key, &raw)?;
            return self.drain(entry, &raw, state);
        }

        let removed = match kind {
            EntryType::Regular | EntryType::Continuous | EntryType::GNUSparse => {
                self.file(entry, name, parent, &key, &raw, &meta, limits, state)?
            }
            EntryType::Directory => {
                let r = self.dir(name, parent, &key, &raw)?;
                self.keep_dir_attrs(key, meta, &raw)?;
                r
            }
            EntryType::Symlink => self.symlink(entry, name, parent, &key, &raw, &meta)?,
            EntryType::Link => self.hardlink(entry, name, parent, &comps, &key, &raw, limits)?,
            EntryType::Fifo => self.fifo(name, parent, &key, &raw, &meta)?,
            other => return Err(invalid(&raw, format!("unsupported tar entry type {:?}", other.as_byte() as char))),
        };
        if removed == Removed::Dir {
            self.cache.fd = None;
        }
        self.drain(entry, &raw, state)
    }

    /// Reads what is left of an entry's data (non-file entries may carry some), so tar itself
    /// only ever skips padding between entries.
    fn drain<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        raw: &[u8],
        state: &StreamState,
    ) -> Result<(), LayerError> {
        loop {
            match entry.read(&mut self.buf) {
                Ok(0) => return Ok(()),
                Ok(_) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(state.classify(e, raw)),
            }
        }
    }

    /// The parent directory of an entry, created (0755, root) when the tar did not list it.
    fn parent(&mut self, parent: &[&[u8]], parent_key: &[u8], raw: &[u8]) -> Result<BorrowedFd<'_>, LayerError> {
        if parent.is_empty() {
            return Ok(self.root.as_fd());
        }
        if self.cache.fd.is_none() || self.cache.key != parent_key {
            self.cache.fd = None;
            let fd = match open_dir(self.root.as_fd(), parent_key) {
                Ok(fd) => fd,
                Err(Errno::NOENT | Errno::NOTDIR | Errno::LOOP) => self.walk_creating(parent, raw)?,
                Err(e) => return Err(self.io(parent_key, e)),
            };
            self.cache.key = parent_key.to_vec();
            self.cache.fd = Some(fd);
        }
        match &self.cache.fd {
            Some(fd) => Ok(fd.as_fd()),
            None => unreachable!("the parent cache was just filled"),
        }
    }

    /// Opens `parent` one component at a time, creating missing directories, and says
    /// precisely which component is a symlink or not a directory.
    fn walk_creating(&self, parent: &[&[u8]], raw: &[u8]) -> Result<OwnedFd, LayerError> {
        let mut cur: Option<OwnedFd> = None;
        for (i, c) in parent.iter().enumerate() {
            let at = cur.as_ref().map_or(self.root.as_fd(), |f| f.as_fd());
            let prefix = || parent[..=i].join(&b'/');
            let fd = match open_dir(at, c) {
                Ok(fd) => fd,
                Err(Errno::NOENT) => {
                    match rfs::mkdirat(at, *c, Mode::from_raw_mode(0o755)) {
                        Ok(()) | Err(Errno::EXIST) => {}
                        Err(e) => return Err(self.io(&prefix(), e)),
                    }
                    let fd = open_dir(at, c).map_err(|e| self.io(&prefix(), e))?;
                    // The process umask must not decide implicit directories' modes.
                    rfs::fchmod(&fd, Mode::from_raw_mode(0o755)).map_err(|e| self.io(&prefix(), e))?;
                    fd
                }
                Err(Errno::LOOP) => {
                    return Err(invalid(
                        raw,
                        format!("parent {} is a symlink: entries are never written through symlinks", shown(&prefix())),
                    ));
                }
                Err(Errno::NOTDIR) => {
                    return Err(invalid(raw, format!("parent {} is not a directory", shown(&prefix()))));
                }
                Err(e) => return Err(self.io(&prefix(), e)),
            };
            cur = Some(fd);
        }
        match cur {
            Some(fd) => Ok(fd),
            None => unreachable!("walk_creating is only called with a non-empty parent"),
        }
    }

    /// Makes room for a new entry named `name` in `dir`: removes what is there (a whole tree
    /// for a directory).
    fn remove(&self, dir: BorrowedFd<'_>, name: &[u8], key: &[u8]) -> Result<Removed, LayerError> {
        let st = match rfs::statat(dir, name, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Ok(Removed::Nothing),
            Err(e) => return Err(self.io(key, e)),
        };
        if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
            remove_tree(dir, name).map_err(|e| self.io(key, e))?;
            Ok(Removed::Dir)
        } else {
            rfs::unlinkat(dir, name, AtFlags::empty()).map_err(|e| self.io(key, e))?;
            Ok(Removed::NonDir)
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn file<R: Read>(
        &mut self,
        entry: &mut tar::Entry<'_, R>,
        name: &[u8],
        parent: &[&[u8]],
        key: &[u8],
        raw: &[u8],
        meta: &Meta,
        limits: &Limits,
        state: &StreamState,
    ) -> Result<Removed, LayerError> {
        let size = entry.size();
        if size > limits.max_file_bytes {
            return Err(LayerError::TooLarge {
                path: shown(raw),
                what: "bytes in one file",
                limit: limits.max_file_bytes,
            });
        }
        if self.size_bytes.saturating_add(size) > limits.max_layer_bytes {
            return Err(LayerError::TooLarge {
                path: shown(raw),
                what: "bytes of file content in the layer",
                limit: limits.max_layer_bytes,
            });
        }
        let parent_key = parent.join(&b'/');
        let mut removed = Removed::Nothing;
        let flags = OFlags::WRONLY | OFlags::CREATE | OFlags::EXCL | OFlags::NOFOLLOW | OFlags::CLOEXEC;
        let fd = {
            let dir = self.parent(parent, &parent_key, raw)?;
            match rfs::openat(dir, name, flags, Mode::from_raw_mode(0o600)) {
                Ok(fd) => fd,
                Err(Errno::EXIST) => {
                    let dir = dir.try_clone_to_owned().map_err(|e| self.io(key, e))?;
                    removed = self.remove(dir.as_fd(), name, key)?;
                    rfs::openat(&dir, name, flags, Mode::from_raw_mode(0o600)).map_err(|e| self.io(key, e))?
                }
                Err(e) => return Err(self.io(key, e)),
            }
        };
        let mut file = File::from(fd);
        let mut written = 0u64;
        if size > 0 {
            loop {
                let n = match entry.read(&mut self.buf) {
                    Ok(0) => break,
                    Ok(n) => n,
                    Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(state.classify(e, raw)),
                };
                written += n as u64;
                file.write_all(&self.buf[..n]).map_err(|e| self.io(key, e))?;
            }
        }
        if written != size {
            return Err(invalid(raw, format!("truncated: {written} of {size} bytes")));
        }
        self.size_bytes += written;
        set_attrs(file.as_fd(), meta.uid, meta.gid, meta.mode, meta.mtime, &meta.xattrs)
            .map_err(|e| self.attr_err(raw, e))?;
        Ok(removed)
    }

    fn dir(&mut self, name: &[u8], parent: &[&[u8]], key: &[u8], raw: &[u8]) -> Result<Removed, LayerError> {
        let parent_key = parent.join(&b'/');
        let dir = self.parent(parent, &parent_key, raw)?.try_clone_to_owned().map_err(|e| self.io(key, e))?;
        match rfs::mkdirat(&dir, name, Mode::from_raw_mode(0o755)) {
            Ok(()) => Ok(Removed::Nothing),
            Err(Errno::EXIST) => {
                let st = rfs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| self.io(key, e))?;
                if FileType::from_raw_mode(st.st_mode) == FileType::Directory {
                    // A directory again: its content stays, its attributes are replaced.
                    return Ok(Removed::Nothing);
                }
                if is_whiteout(&st) {
                    // Whited out and present in the same layer: hides the lower directory.
                    self.whited.insert(key.to_vec());
                }
                let removed = self.remove(dir.as_fd(), name, key)?;
                rfs::mkdirat(&dir, name, Mode::from_raw_mode(0o755)).map_err(|e| self.io(key, e))?;
                Ok(removed)
            }
            Err(e) => Err(self.io(key, e)),
        }
    }

    /// Creates `name` in `parent` with `make`, replacing what is there.
    fn create_replacing(
        &mut self,
        name: &[u8],
        parent: &[&[u8]],
        key: &[u8],
        raw: &[u8],
        make: impl Fn(BorrowedFd<'_>) -> rustix::io::Result<()>,
    ) -> Result<(OwnedFd, Removed), LayerError> {
        let parent_key = parent.join(&b'/');
        let dir = self.parent(parent, &parent_key, raw)?.try_clone_to_owned().map_err(|e| self.io(key, e))?;
        match make(dir.as_fd()) {
            Ok(()) => Ok((dir, Removed::Nothing)),
            Err(Errno::EXIST) => {
                let removed = self.remove(dir.as_fd(), name, key)?;
                make(dir.as_fd()).map_err(|e| self.io(key, e))?;
                Ok((dir, removed))
            }
            Err(e) => Err(self.io(key, e)),
        }
    }

    fn symlink<R: Read>(
        &mut self,
        entry: &tar::Entry<'_, R>,
        name: &[u8],
        parent: &[&[u8]],
        key: &[u8],
        raw: &[u8],
        meta: &Meta,
    ) -> Result<Removed, LayerError> {
        let target = entry.link_name_bytes().map(|t| t.into_owned()).unwrap_or_default();
        if target.is_empty() {
            return Err(invalid(raw, "symlink without a target"));
        }
        if target.contains(&0) || target.len() >= 4096 {
            return Err(invalid(raw, "symlink target has a NUL byte or is longer than 4095 bytes"));
        }
        // The target is stored as data; it is never followed while unpacking.
        let (dir, removed) =
            self.create_replacing(name, parent, key, raw, |d| rfs::symlinkat(target.as_slice(), d, name))?;
        rfs::chownat(
            &dir,
            name,
            Some(Uid::from_raw(meta.uid)),
            Some(Gid::from_raw(meta.gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| self.io(key, e))?;
        // No xattrs on symlinks: Linux allows only trusted/security ones there, and setting
        // them needs a path-based call that could follow the link.
        rfs::utimensat(
            &dir,
            name,
            &Timestamps { last_access: meta.mtime, last_modification: meta.mtime },
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|e| self.io(key, e))?;
        Ok(removed)
    }

    fn fifo(
        &mut self,
        name: &[u8],
        parent: &[&[u8]],
        key: &[u8],
        raw: &[u8],
        meta: &Meta,
    ) -> Result<Removed, LayerError> {
        let (dir, removed) = self.create_replacing(name, parent, key, raw, |d| {
            rfs::mknodat(d, name, FileType::Fifo, Mode::from_raw_mode(0o600), 0)
        })?;
        // Path-based calls on a name just created in a directory only we write to (a fifo
        // cannot be opened for its attributes without blocking).
        let nofollow = AtFlags::SYMLINK_NOFOLLOW;
        rfs::chownat(&dir, name, Some(Uid::from_raw(meta.uid)), Some(Gid::from_raw(meta.gid)), nofollow)
            .map_err(|e| self.io(key, e))?;
        rfs::chmodat(&dir, name, Mode::from_raw_mode(meta.mode), AtFlags::empty()).map_err(|e| self.io(key, e))?;
        rfs::utimensat(&dir, name, &Timestamps { last_access: meta.mtime, last_modification: meta.mtime }, nofollow)
            .map_err(|e| self.io(key, e))?;
        Ok(removed)
    }

    #[allow(clippy::too_many_arguments)]
    fn hardlink<R: Read>(
        &mut self,
        entry: &tar::Entry<'_, R>,
        name: &[u8],
        parent: &[&[u8]],
        comps: &[&[u8]],
        key: &[u8],
        raw: &[u8],
        limits: &Limits,
    ) -> Result<Removed, LayerError> {
        let target_raw = entry.link_name_bytes().map(|t| t.into_owned()).unwrap_or_default();
        if target_raw.len() > limits.max_path_bytes {
            return Err(LayerError::TooLarge {
                path: shown(raw),
                what: "bytes of hard link target",
                limit: limits.max_path_bytes as u64,
            });
        }
        let target = normalize(&target_raw)
            .map_err(|why| invalid(raw, format!("hard link target {}: {why}", shown(&target_raw))))?;
        if target.len() > limits.max_depth {
            return Err(LayerError::TooLarge {
                path: shown(raw),
                what: "components in hard link target",
                limit: limits.max_depth as u64,
            });
        }
        let Some((tname, tparent)) = target.split_last() else {
            return Err(invalid(raw, "hard link to the layer root"));
        };
        if target == comps {
            // A link to itself (some archivers write these): nothing to do.
            return Ok(Removed::Nothing);
        }
        let tkey = target.join(&b'/');
        let absent = || {
            invalid(
                raw,
                format!(
                    "hard link target {} is not in the layer (links only point to earlier entries of the same layer)",
                    shown(&tkey)
                ),
            )
        };
        let tdir = match open_dir(self.root.as_fd(), &tparent.join(&b'/')) {
            Ok(fd) => fd,
            Err(Errno::NOENT | Errno::NOTDIR) => return Err(absent()),
            Err(Errno::LOOP) => {
                return Err(invalid(raw, format!("hard link target {} is reached through a symlink", shown(&tkey))));
            }
            Err(e) => return Err(self.io(&tkey, e)),
        };
        let st = match rfs::statat(&tdir, *tname, AtFlags::SYMLINK_NOFOLLOW) {
            Ok(st) => st,
            Err(Errno::NOENT) => return Err(absent()),
            Err(e) => return Err(self.io(&tkey, e)),
        };
        match FileType::from_raw_mode(st.st_mode) {
            FileType::Directory => {
                return Err(invalid(raw, format!("hard link target {} is a directory", shown(&tkey))));
            }
            FileType::CharacterDevice | FileType::BlockDevice => {
                return Err(invalid(raw, format!("hard link target {} is a whiteout", shown(&tkey))));
            }
            _ => {}
        }
        let parent_key = parent.join(&b'/');
        let dir = self.parent(parent, &parent_key, raw)?.try_clone_to_owned().map_err(|e| self.io(key, e))?;
        match rfs::linkat(&tdir, *tname, &dir, name, AtFlags::empty()) {
            Ok(()) => Ok(Removed::Nothing),
            Err(Errno::EXIST) => {
                let cur = rfs::statat(&dir, name, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| self.io(key, e))?;
                if cur.st_ino == st.st_ino && cur.st_dev == st.st_dev {
                    return Ok(Removed::Nothing);
                }
                let removed = self.remove(dir.as_fd(), name, key)?;
                rfs::linkat(&tdir, *tname, &dir, name, AtFlags::empty()).map_err(|e| self.io(key, e))?;
                Ok(removed)
            }
            Err(e) => Err(self.io(key, e)),
        }
    }

    /// `.wh.<hidden>` in `parent`.
    fn whiteout(
        &mut self,
        hidden: &[u8],
        parent: &[&[u8]],
        parent_key: &[u8],
        key: &[u8],
        raw: &[u8],
    ) -> Result<(), LayerError> {
        if hidden == b".wh..opq" {
            // Opens (and so creates) the directory; its expansion comes after the stream.
            self.parent(parent, parent_key, raw)?;
            self.opaque.insert(parent_key.to_vec());
            return Ok(());
        }
        if hidden.starts_with(b".wh.") {
            // AUFS bookkeeping (.wh..wh.plnk, .wh..wh.aufs): meaningless here.
            return Ok(());
        }
        if hidden.is_empty() || hidden == b"." || hidden == b".." {
            return Err(invalid(raw, "whiteout of an empty, '.' or '..' name"));
        }
        let mut path = parent_key.to_vec();
        if !path.is_empty() {
            path.push(b'/');
        }
        path.extend_from_slice(hidden);
        let dir = self.parent(parent, parent_key, raw)?.try_clone_to_owned().map_err(|e| self.io(key, e))?;
        match make_whiteout(dir.as_fd(), hidden) {
            Ok(()) => {}
            Err(Errno::EXIST) => {
                // The same layer has this name: it stays (a whiteout hides lower layers only);
                // if it is a directory, it must hide the lower one's content (see `expand`).
                self.whited.insert(path);
            }
            Err(e) => return Err(self.io(&path, e)),
        }
        Ok(())
    }
}

/// Makes `name` in `dir` a whiteout. Its times are the epoch, not the moment of unpacking, so
/// that a layer unpacked twice is the same tree to the byte.
pub(crate) fn make_whiteout(dir: BorrowedFd<'_>, name: &[u8]) -> rustix::io::Result<()> {
    rfs::mknodat(dir, name, FileType::CharacterDevice, Mode::empty(), rfs::makedev(0, 0))?;
    let epoch = Timespec { tv_sec: 0, tv_nsec: 0 };
    rfs::utimensat(dir, name, &Timestamps { last_access: epoch, last_modification: epoch }, AtFlags::SYMLINK_NOFOLLOW)
}

/// A 0:0 character device: overlay's whiteout.
pub(crate) fn is_whiteout(st: &rfs::Stat) -> bool {
    FileType::from_raw_mode(st.st_mode) == FileType::CharacterDevice && st.st_rdev == 0
}

/// Removes `name` (a directory) in `dir` and everything below it, without following symlinks.
pub(crate) fn remove_tree(dir: BorrowedFd<'_>, name: &[u8]) -> rustix::io::Result<()> {
    let fd =
        rfs::openat(dir, name, OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC, Mode::empty())?;
    let mut children = Vec::new();
    for e in rfs::Dir::read_from(&fd)? {
        let e = e?;
        let n = e.file_name().to_bytes();
        if n != b"." && n != b".." {
            children.push((n.to_vec(), e.file_type()));
        }
    }
    for (n, t) in children {
        let is_dir = match t {
            FileType::Directory => true,
            FileType::Unknown => {
                FileType::from_raw_mode(rfs::statat(&fd, n.as_slice(), AtFlags::SYMLINK_NOFOLLOW)?.st_mode)
                    == FileType::Directory
            }
            _ => false,
        };
        if is_dir {
            remove_tree(fd.as_fd(), &n)?;
        } else {
            rfs::unlinkat(&fd, n.as_slice(), AtFlags::empty())?;
        }
    }
    rfs::unlinkat(dir, name, AtFlags::REMOVEDIR)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalizes_and_refuses_paths() {
        assert_eq!(normalize(b"./a//b/./c/").unwrap(), vec![&b"a"[..], b"b", b"c"]);
        assert_eq!(normalize(b"./").unwrap(), Vec::<&[u8]>::new());
        assert!(normalize(b"/etc/passwd").is_err());
        assert!(normalize(b"a/../../b").is_err());
        assert!(normalize(b"..").is_err());
        assert!(normalize(b"a/\0b").is_err());
        assert!(normalize(&[b'x'; 256]).is_err());
        assert!(normalize(&[b'x'; 255]).is_ok());
        // Names that merely contain dots are fine.
        assert_eq!(normalize(b"a/..b/.c").unwrap(), vec![&b"a"[..], b"..b", b".c"]);
    }

    #[test]
    fn pax_times() {
        let t = parse_pax_time(b"1700000000.5").unwrap();
        assert_eq!((t.tv_sec, t.tv_nsec), (1_700_000_000, 500_000_000));
        let t = parse_pax_time(b"1700000000").unwrap();
        assert_eq!((t.tv_sec, t.tv_nsec), (1_700_000_000, 0));
        let t = parse_pax_time(b"1.1234567891").unwrap();
        assert_eq!(t.tv_nsec, 123_456_789);
        assert!(parse_pax_time(b"x").is_none());
        assert!(parse_pax_time(b"1.x").is_none());
    }

    #[test]
    fn splits_paths() {
        assert_eq!(split_parent(b"a/b/c"), (&b"a/b"[..], &b"c"[..]));
        assert_eq!(split_parent(b"c"), (&b""[..], &b"c"[..]));
    }
}
