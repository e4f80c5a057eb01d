//! aether's process API, outside sessions: each process started directly (no shell), with
//! piped stdin and its stdout/stderr kept in memory (up to a limit per stream; the rest is read
//! and counted as dropped), addressed by pid or tag. Output lives in the agent, not in the
//! caller's stream, so a broken stream loses nothing and `ConnectProcess` re-attaches from
//! offsets. The exit is published only after both outputs ended (or a short grace).
//!
//! With a PTY the process gets a new session with the terminal's slave side as its controlling
//! terminal and stdin/stdout/stderr; everything it writes comes back as stdout, and input goes
//! to the terminal (so it is echoed as a terminal would).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opendsec_proto::v1::*;
use std::os::unix::process::CommandExt;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::error::AgentError;
use crate::passwd::User;
use crate::reaper::{Exit, Reaper};
use crate::{BoxStream, CHUNK};

const STREAM_LIMIT: usize = 16 << 20;
/// Bytes of process variables one ListProcesses answer carries at most.
const LIST_ENV_BUDGET: usize = 1 << 20;
/// Exited processes kept for ListProcesses/ConnectProcess.
const KEEP_EXITED: usize = 256;

#[derive(Debug, Default)]
pub struct ProcState {
    pub out: Vec<u8>,
    pub err: Vec<u8>,
    pub out_dropped: u64,
    pub err_dropped: u64,
    pub exit: Option<Exit>,
}

pub struct Proc {
    pub pid: u32,
    pub tag: String,
    pub cmd: Vec<String>,
    env: std::collections::HashMap<String, String>,
    cwd: String,
    /// The terminal's master side, for resizing (a PTY process only).
    pty: Option<std::os::fd::OwnedFd>,
    /// Set when the process is reaped, before its output has drained: from then on its pid
    /// may be another process's, and nothing may signal it.
    reaped: std::sync::atomic::AtomicBool,
    stdin: tokio::sync::Mutex<Option<Box<dyn tokio::io::AsyncWrite + Send + Unpin>>>,
    state: watch::Sender<ProcState>,
}
impl std::fmt::Debug for Proc {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proc").finish_non_exhaustive()
    }
}

#[derive(Debug, Clone, Default)]
pub struct Procs {
    inner: Arc<Mutex<Vec<Arc<Proc>>>>,
}

impl Procs {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Arc<Proc>>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn running(&self) -> usize {
        self.lock().iter().filter(|p| p.state.borrow().exit.is_none()).count()
    }

    /// Starts `req` as `user`, its environment the default PATH, then the sandbox's `env`, then
    /// the user's HOME, USER and LOGNAME, then the request's variables.
    pub fn start(
        &self,
        reaper: &Reaper,
        req: StartProcessRequest,
        user: &User,
        env: &[(String, String)],
    ) -> Result<u32, AgentError> {
        let Some(argv0) = req.cmd.first() else {
            return Err(AgentError::Invalid("empty cmd".into()));
        };
        if !req.tag.is_empty() && self.find_tag(&req.tag).is_some() {
            return Err(AgentError::TagInUse(req.tag));
        }
        let mut c = std::process::Command::new(argv0);
        c.args(&req.cmd[1..]);
        crate::passwd::user_env(&mut c, user, env);
        c.envs(&req.env);
        let pty = match &req.pty {
            Some(size) => {
                let (master, slave) = pty::open(size, user.uid, user.gid)
                    .map_err(|e| AgentError::Spawn { what: "a pty".into(), source: e })?;
                let dup = |f: &std::fs::File| {
                    f.try_clone().map_err(|e| AgentError::Spawn { what: "a pty".into(), source: e })
                };
                c.stdin(dup(&slave)?).stdout(dup(&slave)?).stderr(slave);
                // SAFETY: only raw syscalls after fork, none allocating: setsid, TIOCSCTTY on
                // stdin (the pty's slave), and the OOM score write on a static path.
                unsafe {
                    c.pre_exec(|| {
                        crate::raise_oom_score_raw();
                        rustix::process::setsid()?;
                        rustix::process::ioctl_tiocsctty(rustix::stdio::stdin())?;
                        Ok(())
                    });
                }
                Some(master)
            }
            None => {
                let stdin = if req.no_stdin { std::process::Stdio::null() } else { std::process::Stdio::piped() };
                c.stdin(stdin)
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .process_group(0);
                // SAFETY: only async-signal-safe calls (open/write/close on a static path).
                unsafe {
                    c.pre_exec(|| {
                        crate::raise_oom_score_raw();
                        Ok(())
                    });
                }
                None
            }
        };
        let cwd = if let Some(rest) = req.cwd.strip_prefix("~") {
            format!("{}{rest}", user.home)
        } else if !req.cwd.is_empty() && !req.cwd.starts_with('/') {
            // Relative to the user's home, as a shell started there would take it.
            format!("{}/{}", user.home.trim_end_matches('/'), req.cwd)
        } else if !req.cwd.is_empty() {
            req.cwd.clone()
        } else if std::path::Path::new(&user.home).is_dir() {
            user.home.clone()
        } else {
            "/".into()
        };
        // Entered as the user (after the switch), so a directory they cannot enter fails.
        crate::passwd::run_as(&mut c, user, Some(cwd.clone().into()));
        let mut child = reaper.spawn(&mut c).map_err(|e| AgentError::Spawn { what: argv0.clone(), source: e })?;
        let pid = child.id();
        // The parent's copies of the slave side went with `c`'s stdio when spawn returned.
        drop(c);
        let exit_rx = reaper.wait_for(pid);
        let pipe_err = |e| AgentError::Spawn { what: argv0.clone(), source: e };
        type Reader = Box<dyn tokio::io::AsyncRead + Send + Unpin>;
        type Writer = Box<dyn tokio::io::AsyncWrite + Send + Unpin>;
        let mut resize = None;
        let (stdin, readers): (Option<Writer>, Vec<(Reader, bool)>) = match pty {
            Some(master) => {
                resize = Some(master.try_clone().map_err(pipe_err)?);
                let (r, w) = tokio::io::split(pty::Master::new(master).map_err(pipe_err)?);
                (Some(Box::new(w)), vec![(Box::new(r), false)])
            }
            None => {
                let (Some(o), Some(e)) = (child.stdout.take(), child.stderr.take()) else {
                    return Err(pipe_err(std::io::Error::other("no pipes")));
                };
                let stdin: Option<Writer> = match child.stdin.take() {
                    Some(i) => {
                        Some(Box::new(tokio::net::unix::pipe::Sender::from_owned_fd(i.into()).map_err(pipe_err)?))
                    }
                    None => None,
                };
                let out = tokio::net::unix::pipe::Receiver::from_owned_fd(o.into()).map_err(pipe_err)?;
                let err = tokio::net::unix::pipe::Receiver::from_owned_fd(e.into()).map_err(pipe_err)?;
                (stdin, vec![(Box::new(out), false), (Box::new(err), true)])
            }
        };
        let p = Arc::new(Proc {
            pid,
            tag: req.tag,
            cmd: req.cmd,
            env: req.env,
            cwd,
            pty: resize,
            reaped: Default::default(),
            stdin: tokio::sync::Mutex::new(stdin),
            state: watch::channel(ProcState::default()).0,
        });
        if req.timeout_ms > 0 {
            let (pp, limit) = (p.clone(), Duration::from_millis(req.timeout_ms));
            tokio::spawn(async move {
                let mut st = pp.state.subscribe();
                let exited = st.wait_for(|s| s.exit.is_some());
                if tokio::time::timeout(limit, exited).await.is_err()
                    && !pp.reaped.load(std::sync::atomic::Ordering::SeqCst)
                {
                    let pid = pid as i32;
                    let _ = tokio::task::spawn_blocking(move || crate::reaper::kill_tree(pid, true)).await;
                }
            });
        }
        let pumps: Vec<_> = readers.into_iter().map(|(r, err)| pump(r, p.clone(), err)).collect();
        let pp = p.clone();
        tokio::spawn(async move {
            let exit = exit_rx.await.unwrap_or(Exit { code: -1, signal: 0 });
            pp.reaped.store(true, std::sync::atomic::Ordering::SeqCst);
            for h in pumps {
                let _ = tokio::time::timeout(Duration::from_millis(300), h).await;
            }
            pp.state.send_modify(|s| s.exit = Some(exit));
        });
        let mut all = self.lock();
        all.push(p);
        // Forget the oldest exited processes beyond the bound.
        let exited = all.iter().filter(|p| p.state.borrow().exit.is_some()).count();
        if exited > KEEP_EXITED {
            let mut excess = exited - KEEP_EXITED;
            all.retain(|p| {
                if excess > 0 && p.state.borrow().exit.is_some() {
                    excess -= 1;
                    false
                } else {
                    true
                }
            });
        }
        Ok(pid)
    }

    fn find_tag(&self, tag: &str) -> Option<Arc<Proc>> {
        self.lock().iter().find(|p| p.tag == tag && p.state.borrow().exit.is_none()).cloned()
    }

    pub fn find(&self, sel: Option<ProcessSelector>) -> Result<Arc<Proc>, AgentError> {
        let by = sel.and_then(|s| s.by);
        let found = match &by {
            Some(process_selector::By::Pid(pid)) => self.lock().iter().rev().find(|p| p.pid == *pid).cloned(),
            Some(process_selector::By::Tag(t)) => {
                self.find_tag(t).or_else(|| self.lock().iter().rev().find(|p| &p.tag == t).cloned())
            }
            None => return Err(AgentError::Invalid("no process selector".into())),
        };
        found.ok_or_else(|| AgentError::UnknownProcess(format!("{by:?}")))
    }

    /// Every process kept; their variables only while the answer stays within
    /// [`LIST_ENV_BUDGET`] (the edge caps the answer's size).
    pub fn list(&self) -> Vec<ProcessInfo> {
        let mut budget = LIST_ENV_BUDGET;
        self.lock()
            .iter()
            .map(|p| {
                let s = p.state.borrow();
                let size: usize = p.env.iter().map(|(k, v)| k.len() + v.len() + 8).sum();
                let env = if size <= budget {
                    budget -= size;
                    p.env.clone()
                } else {
                    Default::default()
                };
                ProcessInfo {
                    pid: p.pid,
                    tag: p.tag.clone(),
                    cmd: p.cmd.clone(),
                    running: s.exit.is_none(),
                    exit: s.exit.map(|e| ProcessExit { exit_code: e.code, signal: e.signal }),
                    env,
                    cwd: p.cwd.clone(),
                    pty: p.pty.is_some(),
                }
            })
            .collect()
    }
}

impl Proc {
    pub async fn send_input(&self, data: &[u8], eof: bool) -> Result<(), AgentError> {
        let mut g = self.stdin.lock().await;
        let io = |e| AgentError::Spawn { what: format!("stdin of {}", self.pid), source: e };
        match g.as_mut() {
            Some(s) => {
                s.write_all(data).await.map_err(io)?;
                s.flush().await.map_err(io)?;
            }
            None if data.is_empty() => {}
            None => return Err(AgentError::Invalid(format!("stdin of process {} is closed", self.pid))),
        }
        if eof {
            *g = None;
        }
        Ok(())
    }

    pub fn signal(&self, sig: i32) -> Result<(), AgentError> {
        if self.state.borrow().exit.is_some() || self.reaped.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(AgentError::UnknownProcess(format!("{} (exited)", self.pid)));
        }
        let s = rustix::process::Signal::from_named_raw(sig)
            .ok_or_else(|| AgentError::Invalid(format!("bad signal {sig}")))?;
        let pid = rustix::process::Pid::from_raw(self.pid as i32).ok_or_else(|| AgentError::Invalid("pid 0".into()))?;
        rustix::process::kill_process(pid, s)
            .map_err(|e| AgentError::Spawn { what: format!("signal {sig} to {}", self.pid), source: e.into() })
    }

    pub fn resize(&self, size: &PtySize) -> Result<(), AgentError> {
        let Some(fd) = &self.pty else {
            return Err(AgentError::Invalid(format!("process {} has no terminal", self.pid)));
        };
        pty::resize(fd, size)
            .map_err(|e| AgentError::Spawn { what: format!("resizing the terminal of {}", self.pid), source: e })
    }

    /// Output from offsets, then the exit.
    pub fn connect(self: Arc<Self>, mut o: u64, mut e: u64) -> BoxStream<ProcessEvent> {
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            let mut st = self.state.subscribe();
            loop {
                let mut msgs = vec![];
                let exit = {
                    let s = st.borrow_and_update();
                    for (err, off, buf) in [(false, &mut o, &s.out), (true, &mut e, &s.err)] {
                        while (*off as usize) < buf.len() {
                            let start = *off as usize;
                            let end = buf.len().min(start + CHUNK);
                            msgs.push(ProcessEvent {
                                kind: Some(process_event::Kind::Output(OutputData {
                                    stream: if err { OutputStream::Stderr } else { OutputStream::Stdout } as i32,
                                    offset: *off,
                                    data: buf[start..end].to_vec(),
                                })),
                            });
                            *off = end as u64;
                        }
                    }
                    s.exit
                };
                for m in msgs {
                    if tx.send(Ok(m)).await.is_err() {
                        return;
                    }
                }
                if let Some(x) = exit {
                    let _ = tx
                        .send(Ok(ProcessEvent {
                            kind: Some(process_event::Kind::Exit(ProcessExit { exit_code: x.code, signal: x.signal })),
                        }))
                        .await;
                    return;
                }
                if st.changed().await.is_err() {
                    return;
                }
            }
        });
        Box::pin(ReceiverStream::new(rx))
    }
}

fn pump(mut r: Box<dyn tokio::io::AsyncRead + Send + Unpin>, p: Arc<Proc>, err: bool) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match r.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => n,
            };
            p.state.send_modify(|s| {
                let (v, d) = if err { (&mut s.err, &mut s.err_dropped) } else { (&mut s.out, &mut s.out_dropped) };
                let keep = STREAM_LIMIT.saturating_sub(v.len()).min(n);
                v.extend_from_slice(&buf[..keep]);
                *d += (n - keep) as u64;
            });
        }
    })
}

/// Pseudo-terminals for the process API.
mod pty {
    use std::os::fd::OwnedFd;
    use std::pin::Pin;
    use std::task::{Context, Poll, ready};

    use opendsec_proto::v1::PtySize;
    use tokio::io::unix::AsyncFd;
    use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

    /// A new terminal of `size` (rows and columns default to 24x80), its slave side owned by
    /// `uid`/`gid`: (master, slave). Both ends are close-on-exec from the start: aether spawns
    /// processes for other users concurrently, and none of them may inherit this terminal.
    fn winsize(size: &PtySize) -> rustix::termios::Winsize {
        rustix::termios::Winsize {
            ws_row: if size.rows == 0 { 24 } else { size.rows.min(u16::MAX.into()) as u16 },
            ws_col: if size.cols == 0 { 80 } else { size.cols.min(u16::MAX.into()) as u16 },
            ws_xpixel: 0,
            ws_ypixel: 0,
        }
    }

    /// A new size for the terminal whose master is `fd` (its process gets SIGWINCH).
    pub fn resize(fd: &OwnedFd, size: &PtySize) -> std::io::Result<()> {
        Ok(rustix::termios::tcsetwinsize(fd, winsize(size))?)
    }

    pub fn open(size: &PtySize, uid: u32, gid: u32) -> std::io::Result<(OwnedFd, std::fs::File)> {
        use rustix::pty::OpenptFlags;
        let flags = OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC;
        let master = rustix::pty::openpt(flags)?;
        rustix::pty::grantpt(&master)?;
        rustix::pty::unlockpt(&master)?;
        rustix::termios::tcsetwinsize(&master, winsize(size))?;
        let slave = std::fs::File::from(rustix::pty::ioctl_tiocgptpeer(&master, flags)?);
        std::os::unix::fs::fchown(&slave, Some(uid), Some(gid))?;
        Ok((master, slave))
    }

    /// The master side, non-blocking. Reading after the last slave fd closed gives EIO, which
    /// is end of output here.
    pub struct Master(AsyncFd<OwnedFd>);

    impl Master {
        pub fn new(fd: OwnedFd) -> std::io::Result<Master> {
            let flags = rustix::fs::fcntl_getfl(&fd)?;
            rustix::fs::fcntl_setfl(&fd, flags | rustix::fs::OFlags::NONBLOCK)?;
            // SAFETY: an OwnedFd keeps its one fd open and unchanged until it is dropped with
            // the AsyncFd.
            Ok(Master(unsafe { AsyncFd::register(fd) }?))
        }
    }

    impl AsyncRead for Master {
        fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
            loop {
                let mut g = ready!(self.0.poll_read_ready(cx))?;
                let unfilled = buf.initialize_unfilled();
                match g.try_io(|fd| rustix::io::read(fd.get_ref(), &mut *unfilled).map_err(Into::into)) {
                    Ok(Ok(n)) => {
                        buf.advance(n);
                        return Poll::Ready(Ok(()));
                    }
                    Ok(Err(e)) if e.raw_os_error() == Some(rustix::io::Errno::IO.raw_os_error()) => {
                        return Poll::Ready(Ok(()));
                    }
                    Ok(Err(e)) => return Poll::Ready(Err(e)),
                    Err(_would_block) => continue,
                }
            }
        }
    }

    impl AsyncWrite for Master {
        fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
            loop {
                let mut g = ready!(self.0.poll_write_ready(cx))?;
                match g.try_io(|fd| rustix::io::write(fd.get_ref(), data).map_err(Into::into)) {
                    Ok(r) => return Poll::Ready(r),
                    Err(_would_block) => continue,
                }
            }
        }

        fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }
}
