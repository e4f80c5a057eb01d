//! Directory watches on inotify, run inside a session's chronus (so as its user: a directory
//! the user may not read cannot be watched). A recursive watch adds every subdirectory, and
//! those made later as their creation is seen, up to [`MAX_DIRS`].
//!
//! Events map as envd's (fsnotify's) do: create and moved-to are CREATE, modify is WRITE,
//! attrib is CHMOD, delete is REMOVE, moved-from is RENAME; names are relative to the watched
//! directory.

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opendsec_proto::v1::{FileEvent, FileEventType};
use rustix::fs::inotify::{self, ReadFlags, WatchFlags};
use tokio::io::unix::AsyncFd;

use crate::error::AgentError;

/// Directories one recursive watch covers at most.
pub const MAX_DIRS: usize = 8192;
/// Polled watchers per session.
pub const MAX_WATCHERS: usize = 64;
/// Events a polled watcher keeps between polls (older ones are dropped first).
pub const MAX_KEPT: usize = 10_000;
/// A polled watcher nobody polled for this long is removed.
pub const IDLE: Duration = Duration::from_secs(600);

pub struct Watch {
    fd: AsyncFd<OwnedFd>,
    recursive: bool,
    /// Watch descriptor -> the directory, relative to the root ("" = the root).
    dirs: HashMap<i32, PathBuf>,
    root: PathBuf,
}
impl std::fmt::Debug for Watch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watch").field("root", &self.root).field("dirs", &self.dirs.len()).finish()
    }
}

fn flags() -> WatchFlags {
    WatchFlags::CREATE
        | WatchFlags::MODIFY
        | WatchFlags::ATTRIB
        | WatchFlags::DELETE
        | WatchFlags::MOVED_FROM
        | WatchFlags::MOVED_TO
        | WatchFlags::ONLYDIR
}

/// One batch of events (and whether the kernel dropped some).
#[derive(Debug, Default)]
pub struct Batch {
    pub events: Vec<FileEvent>,
    pub overflowed: bool,
}

impl Watch {
    pub fn new(root: &Path, recursive: bool) -> Result<Watch, AgentError> {
        let md = std::fs::metadata(root).map_err(|e| AgentError::fs("watch", root, e))?;
        if !md.is_dir() {
            return Err(AgentError::fs(
                "watch",
                root,
                std::io::Error::new(std::io::ErrorKind::NotADirectory, "not a directory"),
            ));
        }
        let raw = inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)
            .map_err(|e| AgentError::fs("inotify", root, e.into()))?;
        // SAFETY: an OwnedFd keeps its one fd open and unchanged until it is dropped with the
        // AsyncFd.
        let fd = unsafe { AsyncFd::register(raw) }.map_err(|e| AgentError::fs("inotify", root, e.into()))?;
        let mut w = Watch { fd, recursive, dirs: HashMap::new(), root: root.to_path_buf() };
        w.add(PathBuf::new()).map_err(|e| AgentError::fs("watch", root, e))?;
        if recursive {
            w.add_tree(Path::new(""), None);
        }
        Ok(w)
    }

    fn add(&mut self, rel: PathBuf) -> std::io::Result<()> {
        if self.dirs.len() >= MAX_DIRS {
            return Ok(());
        }
        let wd = inotify::add_watch(self.fd.get_ref(), self.root.join(&rel), flags())?;
        self.dirs.insert(wd, rel);
        Ok(())
    }

    /// Every directory below `rel` (not following symlinks), as far as the bound allows;
    /// unreadable ones are left out. With `found`, every entry met is told there as created:
    /// in a directory that just appeared, what was made before its watch was added has no
    /// event of its own (`mkdir -p a && touch a/f` races the watch on `a`). A batch holds
    /// at most [`MAX_KEPT`] events: past that a tree moved in whole is told as an overflow,
    /// as the kernel tells a full queue.
    fn add_tree(&mut self, rel: &Path, mut found: Option<&mut Batch>) {
        let mut stack = vec![rel.to_path_buf()];
        while let Some(d) = stack.pop() {
            let Ok(rd) = std::fs::read_dir(self.root.join(&d)) else { continue };
            for e in rd.flatten() {
                if self.dirs.len() >= MAX_DIRS {
                    return;
                }
                if let Some(found) = found.as_deref_mut() {
                    if found.events.len() < MAX_KEPT {
                        let name = d.join(e.file_name()).to_string_lossy().into_owned();
                        found.events.push(FileEvent { name, r#type: FileEventType::Create as i32 });
                    } else {
                        found.overflowed = true;
                    }
                }
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    let child = d.join(e.file_name());
                    if self.add(child.clone()).is_ok() {
                        stack.push(child);
                    }
                }
            }
        }
    }

    /// The next events (waits for at least one read).
    pub async fn next(&mut self) -> std::io::Result<Batch> {
        let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 16 << 10];
        loop {
            let mut guard = self.fd.readable().await?;
            let mut batch = Batch::default();
            let mut new_dirs = Vec::new();
            let mut gone = Vec::new();
            let res = guard.try_io(|fd| {
                let mut r = inotify::Reader::new(fd.get_ref(), &mut buf);
                loop {
                    match r.next() {
                        Ok(ev) => {
                            let flags = ev.events();
                            if flags.contains(ReadFlags::QUEUE_OVERFLOW) {
                                batch.overflowed = true;
                                continue;
                            }
                            if flags.contains(ReadFlags::IGNORED) {
                                // Its directory went away: the slot is free again.
                                gone.push(ev.wd());
                                continue;
                            }
                            let Some(dir) = self.dirs.get(&ev.wd()) else { continue };
                            let Some(name) = ev.file_name() else { continue };
                            let rel = dir.join(std::ffi::OsStr::from_bytes(name.to_bytes()));
                            let kind = kind_of(flags);
                            if kind == FileEventType::Unspecified {
                                continue;
                            }
                            let is_dir = flags.contains(ReadFlags::ISDIR);
                            if self.recursive && is_dir && flags.intersects(ReadFlags::CREATE | ReadFlags::MOVED_TO) {
                                new_dirs.push(rel.clone());
                            }
                            batch
                                .events
                                .push(FileEvent { name: rel.to_string_lossy().into_owned(), r#type: kind as i32 });
                            if r.is_buffer_empty() {
                                return Ok(());
                            }
                        }
                        // Drained: WouldBlock clears the readiness, so the next wait waits.
                        Err(rustix::io::Errno::AGAIN) => return Err(std::io::ErrorKind::WouldBlock.into()),
                        Err(e) => return Err(std::io::Error::from(e)),
                    }
                }
            });
            for wd in gone {
                self.dirs.remove(&wd);
            }
            for d in new_dirs {
                if self.add(d.clone()).is_ok() {
                    self.add_tree(&d, Some(&mut batch));
                }
            }
            match res {
                Ok(Ok(())) if batch.events.is_empty() && !batch.overflowed => continue,
                Ok(Ok(())) => return Ok(batch),
                Ok(Err(e)) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if !batch.events.is_empty() || batch.overflowed {
                        return Ok(batch);
                    }
                    continue;
                }
                Ok(Err(e)) => return Err(e),
                Err(_would_block) => {
                    if !batch.events.is_empty() || batch.overflowed {
                        return Ok(batch);
                    }
                    continue;
                }
            }
        }
    }
}

fn kind_of(f: ReadFlags) -> FileEventType {
    if f.intersects(ReadFlags::CREATE | ReadFlags::MOVED_TO) {
        FileEventType::Create
    } else if f.contains(ReadFlags::MODIFY) {
        FileEventType::Write
    } else if f.contains(ReadFlags::ATTRIB) {
        FileEventType::Chmod
    } else if f.contains(ReadFlags::DELETE) {
        FileEventType::Remove
    } else if f.contains(ReadFlags::MOVED_FROM) {
        FileEventType::Rename
    } else {
        FileEventType::Unspecified
    }
}

struct Polled {
    events: VecDeque<FileEvent>,
    dropped: u64,
    polled: Instant,
    task: tokio::task::JoinHandle<()>,
}

/// The polled watchers of a session.
#[derive(Default, Clone)]
pub struct Watchers {
    inner: Arc<Mutex<HashMap<String, Polled>>>,
}

impl std::fmt::Debug for Watchers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watchers").finish_non_exhaustive()
    }
}

impl Watchers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Polled>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops watchers nobody polled for [`IDLE`].
    fn expire(&self) {
        self.lock().retain(|_, w| {
            let keep = w.polled.elapsed() < IDLE;
            if !keep {
                w.task.abort();
            }
            keep
        });
    }

    pub fn create(&self, mut watch: Watch) -> Result<String, AgentError> {
        self.expire();
        if self.lock().len() >= MAX_WATCHERS {
            return Err(AgentError::Invalid(format!("at most {MAX_WATCHERS} watchers per session")));
        }
        let id = format!("w{:016x}", rand::random::<u64>());
        let (me, key) = (self.clone(), id.clone());
        // Registered before its task runs, so no early event finds it missing.
        let mut g = self.lock();
        let task = tokio::spawn(async move {
            while let Ok(batch) = watch.next().await {
                let mut g = me.lock();
                let Some(w) = g.get_mut(&key) else { return };
                for e in batch.events {
                    if w.events.len() >= MAX_KEPT {
                        w.events.pop_front();
                        w.dropped += 1;
                    }
                    w.events.push_back(e);
                }
            }
        });
        g.insert(id.clone(), Polled { events: VecDeque::new(), dropped: 0, polled: Instant::now(), task });
        Ok(id)
    }

    /// The events since the last poll.
    pub fn poll(&self, id: &str) -> Result<(Vec<FileEvent>, u64), AgentError> {
        let mut g = self.lock();
        let w = g.get_mut(id).ok_or_else(|| AgentError::UnknownWatcher(id.chars().take(64).collect()))?;
        w.polled = Instant::now();
        let events = w.events.drain(..).collect();
        Ok((events, std::mem::take(&mut w.dropped)))
    }

    pub fn remove(&self, id: &str) -> bool {
        match self.lock().remove(id) {
            Some(w) => {
                w.task.abort();
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn until(w: &mut Watch, what: impl Fn(&FileEvent) -> bool) -> FileEvent {
        loop {
            let b = tokio::time::timeout(Duration::from_secs(5), w.next()).await.expect("an event in time").unwrap();
            if let Some(e) = b.events.into_iter().find(|e| what(e)) {
                return e;
            }
        }
    }

    #[tokio::test]
    async fn events_name_paths_below_the_watched_directory() {
        let d = tempfile::tempdir().unwrap();
        let mut w = Watch::new(d.path(), true).unwrap();
        std::fs::write(d.path().join("a.txt"), "x").unwrap();
        let e = until(&mut w, |e| e.name == "a.txt").await;
        assert_eq!(e.r#type, FileEventType::Create as i32);
        std::fs::create_dir(d.path().join("sub")).unwrap();
        until(&mut w, |e| e.name == "sub").await;
        // The new directory is watched too (recursive).
        std::fs::write(d.path().join("sub/b.txt"), "y").unwrap();
        until(&mut w, |e| e.name == "sub/b.txt" && e.r#type == FileEventType::Create as i32).await;
        std::fs::remove_file(d.path().join("a.txt")).unwrap();
        until(&mut w, |e| e.name == "a.txt" && e.r#type == FileEventType::Remove as i32).await;
    }

    /// What a new directory held before its own watch was added is told too: a directory
    /// moved in whole, with a file and a subdirectory already in it, never gets events of
    /// its own for them.
    #[tokio::test]
    async fn a_directory_that_appears_full_is_told_whole() {
        let d = tempfile::tempdir().unwrap();
        let watched = d.path().join("w");
        std::fs::create_dir(&watched).unwrap();
        let mut w = Watch::new(&watched, true).unwrap();
        let made = d.path().join("made");
        std::fs::create_dir_all(made.join("deep")).unwrap();
        std::fs::write(made.join("f.txt"), "x").unwrap();
        std::fs::write(made.join("deep/g.txt"), "y").unwrap();
        std::fs::rename(&made, watched.join("sub")).unwrap();
        let mut created = std::collections::HashSet::new();
        while !["sub", "sub/f.txt", "sub/deep", "sub/deep/g.txt"].iter().all(|n| created.contains(*n)) {
            let b = tokio::time::timeout(Duration::from_secs(5), w.next()).await.expect("events in time").unwrap();
            created.extend(b.events.into_iter().filter(|e| e.r#type == FileEventType::Create as i32).map(|e| e.name));
        }
        // And the subdirectory found is watched from then on.
        std::fs::write(watched.join("sub/deep/h.txt"), "z").unwrap();
        until(&mut w, |e| e.name == "sub/deep/h.txt").await;

        // A tree larger than a batch holds is told up to the bound, then as an overflow.
        let big = d.path().join("big");
        std::fs::create_dir(&big).unwrap();
        for i in 0..MAX_KEPT + 10 {
            std::fs::write(big.join(i.to_string()), "").unwrap();
        }
        std::fs::rename(&big, watched.join("big")).unwrap();
        loop {
            let b = tokio::time::timeout(Duration::from_secs(5), w.next()).await.expect("events in time").unwrap();
            assert!(b.events.len() <= MAX_KEPT + 1, "{} events in one batch", b.events.len());
            if b.overflowed {
                break;
            }
        }
    }

    #[tokio::test]
    async fn a_flat_watch_ignores_subdirectories() {
        let d = tempfile::tempdir().unwrap();
        std::fs::create_dir(d.path().join("sub")).unwrap();
        let mut w = Watch::new(d.path(), false).unwrap();
        std::fs::write(d.path().join("sub/inner.txt"), "x").unwrap();
        std::fs::write(d.path().join("top.txt"), "x").unwrap();
        let e = until(&mut w, |_| true).await;
        assert_eq!(e.name, "top.txt");
    }

    #[test]
    fn a_file_or_a_missing_path_cannot_be_watched() {
        let d = tempfile::tempdir().unwrap();
        std::fs::write(d.path().join("f"), "x").unwrap();
        assert!(Watch::new(&d.path().join("f"), false).is_err());
        assert!(Watch::new(&d.path().join("nope"), false).is_err());
    }

    #[tokio::test]
    async fn polled_watchers_keep_events_until_polled_and_bound_them() {
        let d = tempfile::tempdir().unwrap();
        let ws = Watchers::default();
        let id = ws.create(Watch::new(d.path(), false).unwrap()).unwrap();
        std::fs::write(d.path().join("one"), "x").unwrap();
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut got = vec![];
        while got.is_empty() && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(50)).await;
            got = ws.poll(&id).unwrap().0;
        }
        assert!(got.iter().any(|e| e.name == "one"));
        assert!(ws.poll(&id).unwrap().0.is_empty());
        assert!(ws.remove(&id));
        assert!(ws.poll(&id).is_err());
    }
}
