//! Child reaping for a process that is PID 1 or a subreaper: every exited child (our own or an
//! orphan re-parented to us) is reaped with `waitpid(-1)`, so no zombies accumulate. Children
//! we started register for their exit status; statuses of children that exit before they are
//! registered are kept until claimed. Only this module waits for children (no tokio::process).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use rustix::process::{Pid, WaitOptions, wait};
use tokio::sync::oneshot;

/// How a child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    /// Exit code, or -1 when killed by a signal.
    pub code: i32,
    /// Terminating signal, 0 when it exited.
    pub signal: i32,
}

#[derive(Default)]
struct Inner {
    waiting: HashMap<i32, oneshot::Sender<Exit>>,
    unclaimed: HashMap<i32, Exit>,
}

#[derive(Clone, Default)]
pub struct Reaper {
    inner: Arc<Mutex<Inner>>,
    /// Held while a child is spawned and while reaping: std waits for a child whose exec
    /// failed by its pid, and must find it there, not already reaped by `waitpid(-1)`.
    spawning: Arc<Mutex<()>>,
}
impl std::fmt::Debug for Reaper {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reaper").finish_non_exhaustive()
    }
}

impl Reaper {
    /// Makes this process a subreaper and starts reaping (on SIGCHLD and once a second).
    pub fn start() -> Self {
        if let Err(e) = rustix::process::set_child_subreaper(Some(rustix::process::getpid())) {
            eprintln!("opendsec-agent: PR_SET_CHILD_SUBREAPER: {e}");
        }
        let r = Reaper::default();
        let me = r.clone();
        tokio::spawn(async move {
            let mut sig = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::child()).ok();
            loop {
                me.reap_all();
                match sig.as_mut() {
                    Some(s) => {
                        let _ = tokio::time::timeout(Duration::from_secs(1), s.recv()).await;
                    }
                    None => tokio::time::sleep(Duration::from_millis(100)).await,
                }
            }
        });
        r
    }

    fn reap_all(&self) {
        let _not_spawning = self.spawning.lock().unwrap_or_else(|p| p.into_inner());
        // `wait` is waitpid(-1); rustix's `waitpid(None)` would be waitpid(0), our group only.
        while let Ok(Some((pid, st))) = wait(WaitOptions::NOHANG) {
            let exit = match (st.exit_status(), st.terminating_signal()) {
                (Some(c), _) => Exit { code: c, signal: 0 },
                (None, Some(s)) => Exit { code: -1, signal: s },
                (None, None) => continue,
            };
            let mut g = self.lock();
            match g.waiting.remove(&pid.as_raw_nonzero().get()) {
                Some(tx) => {
                    let _ = tx.send(exit);
                }
                None => {
                    // Orphans are never claimed; keep the map bounded.
                    if g.unclaimed.len() > 4096 {
                        g.unclaimed.clear();
                    }
                    g.unclaimed.insert(pid.as_raw_nonzero().get(), exit);
                }
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Spawns `c` with reaping held off, so that std's own wait for a child whose exec failed
    /// finds it (every spawn of a process that reaps with this must go through here).
    pub fn spawn(&self, c: &mut std::process::Command) -> std::io::Result<std::process::Child> {
        let _g = self.spawning.lock().unwrap_or_else(|p| p.into_inner());
        c.spawn()
    }

    /// The exit of child `pid` (call right after spawning it).
    pub fn wait_for(&self, pid: u32) -> oneshot::Receiver<Exit> {
        let (tx, rx) = oneshot::channel();
        let mut g = self.lock();
        let pid = pid as i32;
        match g.unclaimed.remove(&pid) {
            Some(e) => {
                let _ = tx.send(e);
            }
            None => {
                g.waiting.insert(pid, tx);
            }
        }
        rx
    }
}

/// Parent pid of every process, from /proc.
fn parents() -> HashMap<i32, i32> {
    let mut out = HashMap::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            && let Some(ppid) = parse_ppid(&stat)
        {
            out.insert(pid, ppid);
        }
    }
    out
}

/// The ppid field of /proc/PID/stat (after the parenthesised command, which may hold spaces).
pub fn parse_ppid(stat: &str) -> Option<i32> {
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(1)?.parse().ok()
}

/// Every descendant of `root` (not `root` itself).
pub fn descendants(root: i32) -> Vec<i32> {
    let par = parents();
    let mut out = vec![];
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for (&c, &pp) in &par {
            if pp == p && !out.contains(&c) {
                out.push(c);
                frontier.push(c);
            }
        }
    }
    out
}

fn signal(pid: i32, sig: rustix::process::Signal) {
    if let Some(p) = Pid::from_raw(pid) {
        let _ = rustix::process::kill_process(p, sig);
    }
}

/// Kills `root` and its whole tree: first everything is stopped (so nothing forks or escapes
/// while we look; re-parented orphans stay under a subreaper `root`), until no new process
/// appears, then everything is killed, and `root`'s process group too. Returns the processes
/// it signalled (with `root` when included), for [`wait_gone`].
pub fn kill_tree(root: i32, include_root: bool) -> Vec<i32> {
    use rustix::process::Signal;
    let mut all: Vec<i32> = vec![];
    if include_root {
        signal(root, Signal::STOP);
    }
    for _ in 0..50 {
        let d = descendants(root);
        let new: Vec<i32> = d.into_iter().filter(|p| !all.contains(p)).collect();
        if new.is_empty() {
            break;
        }
        for &p in &new {
            signal(p, Signal::STOP);
        }
        all.extend(new);
    }
    for &p in &all {
        signal(p, Signal::KILL);
    }
    if include_root {
        signal(root, Signal::KILL);
        if let Some(p) = Pid::from_raw(root) {
            let _ = rustix::process::kill_process_group(p, Signal::KILL);
        }
        all.push(root);
    }
    all
}

/// Waits until none of `pids` exists any more (a zombie still exists: it holds its pid, and
/// counts against the sandbox's pids limit, until its reaper collects it), at most `limit`.
/// True when all are gone.
pub fn wait_gone(pids: &[i32], limit: std::time::Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    let mut left: Vec<i32> = pids.to_vec();
    loop {
        left.retain(|&p| Pid::from_raw(p).is_some_and(|p| rustix::process::test_kill_process(p).is_ok()));
        if left.is_empty() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ppid() {
        assert_eq!(parse_ppid("12 (a b) c) S 7 12 12 0"), Some(7));
        assert_eq!(parse_ppid("garbage"), None);
    }
}
