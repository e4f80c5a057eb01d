//! aether's process API, outside sessions: each process started directly (no shell), with
//! piped stdin and its stdout/stderr kept in memory (up to a limit per stream; the rest is read
//! and counted as dropped), addressed by pid or tag. Output lives in the agent, not in the
//! caller's stream, so a broken stream loses nothing and `ConnectProcess` re-attaches from
//! offsets. The exit is published only after both outputs ended (or a short grace).

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
/// Exited processes kept for ListProcesses/ConnectProcess.
const KEEP_EXITED: usize = 256;

#[derive(Default)]
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
    stdin: tokio::sync::Mutex<Option<tokio::net::unix::pipe::Sender>>,
    state: watch::Sender<ProcState>,
}

#[derive(Clone, Default)]
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

    pub fn start(&self, reaper: &Reaper, req: StartProcessRequest, user: &User) -> Result<u32, AgentError> {
        if req.pty.is_some() {
            return Err(AgentError::Unsupported("pty"));
        }
        let Some(argv0) = req.cmd.first() else {
            return Err(AgentError::Invalid("empty cmd".into()));
        };
        if !req.tag.is_empty() && self.find_tag(&req.tag).is_some() {
            return Err(AgentError::TagInUse(req.tag));
        }
        let mut c = std::process::Command::new(argv0);
        c.args(&req.cmd[1..])
            .env_clear()
            .env("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
            .env("HOME", &user.home)
            .env("USER", &user.name)
            .env("LOGNAME", &user.name)
            .envs(&req.env)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .process_group(0);
        let cwd = if !req.cwd.is_empty() {
            req.cwd.clone()
        } else if std::path::Path::new(&user.home).is_dir() {
            user.home.clone()
        } else {
            "/".into()
        };
        c.current_dir(cwd);
        if rustix::process::geteuid().as_raw() != user.uid || rustix::process::getegid().as_raw() != user.gid {
            // std drops supplementary groups (setgroups(0)) before setgid/setuid as root.
            c.uid(user.uid).gid(user.gid);
        }
        let mut child = c.spawn().map_err(|e| AgentError::Spawn { what: argv0.clone(), source: e })?;
        let pid = child.id();
        let exit_rx = reaper.wait_for(pid);
        let (Some(i), Some(o), Some(e)) = (child.stdin.take(), child.stdout.take(), child.stderr.take()) else {
            return Err(AgentError::Spawn { what: argv0.clone(), source: std::io::Error::other("no pipes") });
        };
        let pipe_err = |e| AgentError::Spawn { what: argv0.clone(), source: e };
        let stdin = tokio::net::unix::pipe::Sender::from_owned_fd(i.into()).map_err(pipe_err)?;
        let out = tokio::net::unix::pipe::Receiver::from_owned_fd(o.into()).map_err(pipe_err)?;
        let err = tokio::net::unix::pipe::Receiver::from_owned_fd(e.into()).map_err(pipe_err)?;
        let p = Arc::new(Proc {
            pid,
            tag: req.tag,
            cmd: req.cmd,
            stdin: tokio::sync::Mutex::new(Some(stdin)),
            state: watch::channel(ProcState::default()).0,
        });
        let pumps = [pump(out, p.clone(), false), pump(err, p.clone(), true)];
        let pp = p.clone();
        tokio::spawn(async move {
            let exit = exit_rx.await.unwrap_or(Exit { code: -1, signal: 0 });
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

    pub fn list(&self) -> Vec<ProcessInfo> {
        self.lock()
            .iter()
            .map(|p| {
                let s = p.state.borrow();
                ProcessInfo {
                    pid: p.pid,
                    tag: p.tag.clone(),
                    cmd: p.cmd.clone(),
                    running: s.exit.is_none(),
                    exit: s.exit.map(|e| ProcessExit { exit_code: e.code, signal: e.signal }),
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
            Some(s) => s.write_all(data).await.map_err(io)?,
            None if data.is_empty() => {}
            None => return Err(AgentError::Invalid("stdin is closed".into())),
        }
        if eof {
            *g = None;
        }
        Ok(())
    }

    pub fn signal(&self, sig: i32) -> Result<(), AgentError> {
        if self.state.borrow().exit.is_some() {
            return Err(AgentError::UnknownProcess(format!("{} (exited)", self.pid)));
        }
        let s = rustix::process::Signal::from_named_raw(sig)
            .ok_or_else(|| AgentError::Invalid(format!("bad signal {sig}")))?;
        let pid = rustix::process::Pid::from_raw(self.pid as i32).ok_or_else(|| AgentError::Invalid("pid 0".into()))?;
        rustix::process::kill_process(pid, s)
            .map_err(|e| AgentError::Spawn { what: format!("signal {sig} to {}", self.pid), source: e.into() })
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

fn pump(mut r: tokio::net::unix::pipe::Receiver, p: Arc<Proc>, err: bool) -> tokio::task::JoinHandle<()> {
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
