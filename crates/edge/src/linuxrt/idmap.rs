//! Host uid/gid ranges for sandbox user namespaces: each sandbox maps its ids `0..65536` onto a
//! block of host ids that no other sandbox on the host holds.
//!
//! Blocks are claimed host-wide, not per edge: several edges (clusters, tests) can run on one
//! host, and two sandboxes sharing host ids could signal each other's processes, read each
//! other's files and share per-uid kernel limits. A claim is a file `<claims dir>/<block>`
//! created with `O_EXCL`, holding the owner's name (the sandbox's cgroup and directory name,
//! unique per host); the file is the truth, so nothing is lost when an edge dies.
//!
//! Invariants:
//! - block `b` is host ids `b * 65536 .. (b + 1) * 65536`; block 0 (host root and the system's
//!   users) and the block holding id `u32::MAX` (the kernel's "invalid id") are never handed
//!   out;
//! - a block is held while its claim file exists; only its owner releases it, and a claim is
//!   taken over only when its owner has no cgroup any more and the claim is older than
//!   [`STALE_AFTER`] (a creation claims after it made its cgroup, a stop releases after it
//!   removed the cgroup);
//! - every change happens under an exclusive `flock` of `<claims dir>/.lock`, so a take-over
//!   never races a release or another take-over.
//!
//! The claims directory is on a tmpfs (`/run`): a reboot ends every sandbox and every claim.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

/// Ids per sandbox: the 16-bit range images are built for.
pub const RANGE: u32 = 65536;
/// Where the host's claims live (shared by every edge on the host).
pub const CLAIMS_DIR: &str = "/run/opendsec/userns";
/// The default first host id handed out (`edge.userns_first_id`): block 4096, far above the
/// ids of the host's users and of `/etc/subuid` ranges, below 2^31 to the end.
pub const DEFAULT_FIRST_ID: u32 = 4096 * RANGE;
/// The default number of ranges (`edge.userns_ranges`): up to id 2^31 - 1.
pub const DEFAULT_RANGES: u32 = 28672;
/// A claim whose owner has no cgroup is taken over only once it is this old.
pub const STALE_AFTER: Duration = Duration::from_secs(30);

/// Errors of id range allocation.
#[derive(Debug, thiserror::Error)]
pub enum IdmapError {
    #[error("user namespace ids: {0}")]
    Config(String),
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("no free user namespace id range: all {0} ranges are held by sandboxes on this host")]
    Exhausted(u32),
    #[error("user namespace id range {first} is held by {holder}, not {owner}")]
    HeldByOther { first: u32, holder: String, owner: String },
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> IdmapError + 'a {
    move |source| IdmapError::Io { what, path: path.to_path_buf(), source }
}

/// One sandbox's ids: container id `i` (for `i < count`) is host id `host_first + i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdRange {
    pub host_first: u32,
    pub count: u32,
}

impl IdRange {
    fn block(&self) -> u32 {
        self.host_first / RANGE
    }

    /// The text of `/proc/<pid>/uid_map` (and gid_map) for this range.
    pub fn map_line(&self) -> String {
        format!("0 {} {}\n", self.host_first, self.count)
    }

    /// Parses the single line of a `/proc/<pid>/uid_map` written from [`IdRange::map_line`].
    pub fn from_map(text: &str) -> Option<IdRange> {
        let mut lines = text.lines().filter(|l| !l.trim().is_empty());
        let f: Vec<u32> = lines.next()?.split_whitespace().map(|v| v.parse().ok()).collect::<Option<_>>()?;
        if lines.next().is_some() || f.len() != 3 || f[0] != 0 {
            return None;
        }
        Some(IdRange { host_first: f[1], count: f[2] })
    }
}

/// Which host ids an edge hands out: `ranges` blocks from `first_id` (a multiple of
/// [`RANGE`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdPool {
    pub dir: PathBuf,
    pub first_block: u32,
    pub blocks: u32,
}

/// Where the next search starts (shared by every pool of the process: claims are host-wide).
static NEXT: AtomicU32 = AtomicU32::new(0);

impl IdPool {
    /// A pool of `ranges` blocks from host id `first_id`, claimed in [`CLAIMS_DIR`].
    pub fn new(first_id: u32, ranges: u32) -> Result<IdPool, IdmapError> {
        IdPool::in_dir(CLAIMS_DIR, first_id, ranges)
    }

    /// As [`IdPool::new`] with another claims directory (unit tests).
    pub fn in_dir(dir: impl Into<PathBuf>, first_id: u32, ranges: u32) -> Result<IdPool, IdmapError> {
        if first_id == 0 || !first_id.is_multiple_of(RANGE) {
            return Err(IdmapError::Config(format!(
                "the first host id must be a positive multiple of {RANGE}, not {first_id}"
            )));
        }
        let first_block = first_id / RANGE;
        // The last block holds u32::MAX, which is no id.
        let room = (u32::MAX / RANGE).saturating_sub(first_block);
        if ranges == 0 || ranges > room {
            return Err(IdmapError::Config(format!(
                "{ranges} ranges from host id {first_id}: between 1 and {room} fit below 2^32 - 1"
            )));
        }
        Ok(IdPool { dir: dir.into(), first_block, blocks: ranges })
    }

    fn claim_path(&self, block: u32) -> PathBuf {
        self.dir.join(block.to_string())
    }

    fn range(block: u32) -> IdRange {
        IdRange { host_first: block * RANGE, count: RANGE }
    }

    /// Claims a free range for `owner`, found at `locator` (its cgroup's path from the
    /// hierarchy roots, the same for every edge of the host); `alive(locator)` says whether a
    /// claim's holder still exists there, for taking over the claims of sandboxes that died
    /// with their edge. A claim without a locator is never taken over.
    pub fn claim(&self, owner: &str, locator: &str, alive: impl Fn(&str) -> bool) -> Result<IdRange, IdmapError> {
        let _lock = self.lock()?;
        let start = NEXT.load(Ordering::Relaxed);
        for i in 0..self.blocks {
            let block = self.first_block + (start.wrapping_add(i) % self.blocks);
            if self.create(block, owner, locator)? {
                NEXT.store(block - self.first_block + 1, Ordering::Relaxed);
                return Ok(IdPool::range(block));
            }
        }
        // Full: take over one claim whose owner is gone.
        for i in 0..self.blocks {
            let block = self.first_block + i;
            let path = self.claim_path(block);
            let Some((holder, Some(at))) = read_claim(&path) else { continue };
            if !alive(&at) && older_than(&path, STALE_AFTER) {
                tracing::warn!(holder = %holder, block, "taking over a stale user namespace id claim");
                std::fs::remove_file(&path).map_err(io("remove", &path))?;
                if self.create(block, owner, locator)? {
                    return Ok(IdPool::range(block));
                }
            }
        }
        Err(IdmapError::Exhausted(self.blocks))
    }

    /// Confirms that `range` is `owner`'s (an adopted sandbox), claiming it again if the claim
    /// is missing; fails when another sandbox holds it.
    pub fn confirm(&self, range: IdRange, owner: &str, locator: &str) -> Result<(), IdmapError> {
        let _lock = self.lock()?;
        let path = self.claim_path(range.block());
        if self.create(range.block(), owner, locator)? {
            return Ok(());
        }
        match read_claim(&path) {
            Some((h, at)) if h == owner => {
                if at.as_deref() != Some(locator) {
                    // Written by an older edge, or the sandbox's cgroup moved: say where it is
                    // now, so the claim can be judged (and taken over once it is gone).
                    let tmp = self.dir.join(format!(".{}.tmp", range.block()));
                    std::fs::write(&tmp, format!("{owner}\n{locator}\n")).map_err(io("write", &tmp))?;
                    std::fs::rename(&tmp, &path).map_err(io("rename", &path))?;
                }
                Ok(())
            }
            holder => Err(IdmapError::HeldByOther {
                first: range.host_first,
                holder: holder.map(|(h, _)| h).unwrap_or_default(),
                owner: owner.into(),
            }),
        }
    }

    /// Releases `range` if `owner` holds it (see [`release`]).
    pub fn release(&self, range: IdRange, owner: &str) -> Result<(), IdmapError> {
        release(&self.dir, range, owner)
    }

    /// Creates the claim file of `block` for `owner` at `locator`; false when it exists.
    fn create(&self, block: u32, owner: &str, locator: &str) -> Result<bool, IdmapError> {
        let path = self.claim_path(block);
        let f = std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path);
        match f {
            Ok(mut f) => {
                f.write_all(format!("{owner}\n{locator}\n").as_bytes()).map_err(io("write", &path))?;
                Ok(true)
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(false),
            Err(e) => Err(io("create", &path)(e)),
        }
    }

    fn lock(&self) -> Result<File, IdmapError> {
        lock(&self.dir)
    }
}

/// Releases the claim of `range` in claims directory `dir` if `owner` holds it (anything
/// else is left alone).
pub fn release(dir: &Path, range: IdRange, owner: &str) -> Result<(), IdmapError> {
    let _lock = lock(dir)?;
    let path = dir.join(range.block().to_string());
    if read_owner(&path).as_deref() == Some(owner) {
        std::fs::remove_file(&path).map_err(io("remove", &path))?;
    }
    Ok(())
}

/// Releases every claim in `dir` whose owner starts with `prefix` and is not in `keep` (an
/// edge's leftovers); returns how many.
pub fn release_leftovers(dir: &Path, prefix: &str, keep: &[String]) -> Result<usize, IdmapError> {
    if !dir.is_dir() {
        return Ok(0);
    }
    let _lock = lock(dir)?;
    let mut n = 0;
    let Ok(rd) = std::fs::read_dir(dir) else { return Ok(0) };
    for e in rd.flatten() {
        if e.file_name().to_str().is_none_or(|s| s.parse::<u32>().is_err()) {
            continue;
        }
        if let Some(h) = read_owner(&e.path())
            && h.starts_with(prefix)
            && !keep.contains(&h)
        {
            std::fs::remove_file(e.path()).map_err(io("remove", &e.path()))?;
            n += 1;
        }
    }
    Ok(n)
}

/// The exclusive lock over claims directory `dir` (created 0700 when missing).
fn lock(dir: &Path) -> Result<File, IdmapError> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new().recursive(true).mode(0o700).create(dir).map_err(io("create", dir))?;
    let path = dir.join(".lock");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(&path)
        .map_err(io("open", &path))?;
    rustix::fs::flock(&f, rustix::fs::FlockOperation::LockExclusive).map_err(|e| io("lock", &path)(e.into()))?;
    Ok(f)
}

/// A claim file: its owner's name, and where the owner lives (claims written before
/// locators were recorded have none).
fn read_claim(path: &Path) -> Option<(String, Option<String>)> {
    let t = std::fs::read_to_string(path).ok()?;
    let mut lines = t.lines();
    let owner = lines.next()?.to_owned();
    Some((owner, lines.next().filter(|l| !l.is_empty()).map(str::to_owned)))
}

fn read_owner(path: &Path) -> Option<String> {
    read_claim(path).map(|(o, _)| o)
}

fn older_than(path: &Path, age: Duration) -> bool {
    std::fs::metadata(path)
        .and_then(|m| m.modified())
        .map(|t| SystemTime::now().duration_since(t).unwrap_or_default() > age)
        .unwrap_or(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(dir: &Path, blocks: u32) -> IdPool {
        IdPool::in_dir(dir, 4 * RANGE, blocks).unwrap()
    }

    #[test]
    fn ranges_are_aligned_and_bounded() {
        assert!(IdPool::in_dir("/x", 0, 1).is_err());
        assert!(IdPool::in_dir("/x", RANGE + 1, 1).is_err());
        assert!(IdPool::in_dir("/x", RANGE, 0).is_err());
        // The last whole block below u32::MAX is usable, the one holding it is not.
        let last = (u32::MAX / RANGE - 1) * RANGE;
        assert!(IdPool::in_dir("/x", last, 1).is_ok());
        assert!(IdPool::in_dir("/x", last, 2).is_err());
    }

    #[test]
    fn claims_are_exclusive_and_released_only_by_their_owner() {
        let tmp = tempfile::tempdir().unwrap();
        let p = pool(tmp.path(), 3);
        let a = p.claim("sbx-a", "/c/sbx-a", |_| true).unwrap();
        let b = p.claim("sbx-b", "/c/sbx-b", |_| true).unwrap();
        let c = p.claim("sbx-c", "/c/sbx-c", |_| true).unwrap();
        let mut firsts = vec![a.host_first, b.host_first, c.host_first];
        firsts.sort();
        assert_eq!(firsts, vec![4 * RANGE, 5 * RANGE, 6 * RANGE]);
        assert!(matches!(p.claim("sbx-d", "/c/sbx-d", |_| true), Err(IdmapError::Exhausted(3))));
        // Someone else's release changes nothing.
        p.release(a, "sbx-b").unwrap();
        assert!(p.claim("sbx-d", "/c/sbx-d", |_| true).is_err());
        p.release(a, "sbx-a").unwrap();
        assert_eq!(p.claim("sbx-d", "/c/sbx-d", |_| true).unwrap(), a);
    }

    #[test]
    fn a_stale_claim_is_taken_over_only_when_its_owner_is_gone_and_old() {
        let tmp = tempfile::tempdir().unwrap();
        let p = pool(tmp.path(), 1);
        let a = p.claim("sbx-dead", "/other-edge/sbx-dead", |_| true).unwrap();
        // Young claim of a dead owner: kept (its creation may still be under way).
        assert!(p.claim("sbx-new", "/c/sbx-new", |_| false).is_err());
        let old = SystemTime::now() - STALE_AFTER * 2;
        File::options().write(true).open(tmp.path().join(a.block().to_string())).unwrap().set_modified(old).unwrap();
        assert!(p.claim("sbx-new", "/c/sbx-new", |_| true).is_err(), "a live owner keeps its claim");
        assert_eq!(p.claim("sbx-new", "/c/sbx-new", |at| at != "/other-edge/sbx-dead").unwrap(), a);
        assert!(p.confirm(a, "sbx-dead", "/x").is_err());
        p.confirm(a, "sbx-new", "/c/sbx-new").unwrap();
        // The liveness question names where the holder lives, not who asks: an edge in
        // another cgroup sees the holder alive at its own path.
        let seen = std::cell::RefCell::new(Vec::new());
        assert!(
            p.claim("sbx-third", "/c/sbx-third", |at| {
                seen.borrow_mut().push(at.to_string());
                true
            })
            .is_err()
        );
        assert_eq!(*seen.borrow(), vec!["/c/sbx-new".to_string()]);
        // A claim without a locator (written by an older edge) is never taken over, until its
        // owner, adopted again, says where it lives.
        p.release(a, "sbx-new").unwrap();
        let f = tmp.path().join(a.block().to_string());
        std::fs::write(&f, "sbx-old\n").unwrap();
        File::options().write(true).open(&f).unwrap().set_modified(old).unwrap();
        assert!(p.claim("sbx-third", "/c/sbx-third", |_| false).is_err());
        p.confirm(a, "sbx-old", "/c/sbx-old").unwrap();
        assert_eq!(std::fs::read_to_string(&f).unwrap(), "sbx-old\n/c/sbx-old\n");
    }

    #[test]
    fn confirm_reclaims_a_missing_claim_and_leftovers_go_by_prefix() {
        let tmp = tempfile::tempdir().unwrap();
        let p = pool(tmp.path(), 4);
        let r = IdRange { host_first: 6 * RANGE, count: RANGE };
        p.confirm(r, "sbx-t-e1.a", "/c/a").unwrap();
        p.confirm(r, "sbx-t-e1.a", "/c/a").unwrap();
        p.claim("sbx-t-e1.b", "/c/b", |_| true).unwrap();
        p.claim("sbx-t-e10.c", "/c/c", |_| true).unwrap();
        let n = release_leftovers(tmp.path(), "sbx-t-e1.", &["sbx-t-e1.a".into()]).unwrap();
        assert_eq!(n, 1);
        let left: Vec<String> = std::fs::read_dir(tmp.path())
            .unwrap()
            .flatten()
            .filter_map(|e| read_owner(&e.path()))
            .filter(|o| o.starts_with("sbx"))
            .collect();
        assert_eq!(left.len(), 2, "{left:?}");
    }

    #[test]
    fn the_config_defaults_are_these() {
        let e = opendsec_common::config::EdgeConfig::default();
        assert_eq!((e.userns_first_id, e.userns_ranges), (DEFAULT_FIRST_ID, DEFAULT_RANGES));
        let p = IdPool::new(DEFAULT_FIRST_ID, DEFAULT_RANGES).unwrap();
        assert!(u64::from(p.first_block + p.blocks) * u64::from(RANGE) <= 1 << 31);
    }

    #[test]
    fn map_lines_round_trip() {
        let r = IdRange { host_first: 7 * RANGE, count: RANGE };
        assert_eq!(IdRange::from_map(&format!("         {}", r.map_line())), Some(r));
        assert_eq!(IdRange::from_map("0 0 4294967295\n"), Some(IdRange { host_first: 0, count: u32::MAX }));
        assert_eq!(IdRange::from_map("1 2 3\n"), None);
        assert_eq!(IdRange::from_map("0 1 2\n5 6 7\n"), None);
    }
}
