//! chronus: one shell session. It runs as the session's user (aether dropped privileges before
//! exec), is a subreaper (background processes stay in its tree, so closing the session kills
//! them), and keeps one long-lived shell so `cd`, exports and functions carry over.
//!
//! Framing: each command's text is written to `<dir>/<rid>.sh` and the shell is sent one line
//! `{ command . SCRIPT; } >OUT_FIFO 2>ERR_FIFO </dev/null; printf 'NONCE %d %s\n' "$?" "$PWD"`.
//! Sourcing (`command .`: a syntax error does not end the shell) keeps state in the shell and
//! makes any command text safe to frame; the shell's own stdout carries only status lines,
//! which commands cannot reach (their stdout is the fifo) and cannot forge (random nonce).
//! Two pump threads copy each fifo into `<dir>/<rid>.{out,err}` up to the limit and read and
//! count the rest as dropped. A record's sizes only grow and are published after the bytes are
//! in the file, so readers at any offset see exactly the file's bytes: streams resume byte-exact.
//! Commands run one at a time per session, in arrival order.

use std::collections::{HashMap, VecDeque};
use std::io::{Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opendsec_proto::v1::runtime_server::Runtime;
use opendsec_proto::v1::*;
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};

use crate::error::{AgentError, check_id};
use crate::reaper::{Reaper, kill_tree};
use crate::{BoxStream, files, sh_quote};

pub const DEFAULT_STREAM_LIMIT: u64 = 16 << 20;
/// Environment variable through which aether gives chronus the sandbox's working directory.
pub const WORKDIR_ENV: &str = "OPENDSEC_WORKDIR";
/// Most bytes per stream one Exec result or GetOutput answer carries (two streams stay below
/// the 80 MiB message limit, and a caller's limit cannot make the agent allocate more).
pub const RESULT_MAX: u64 = 32 << 20;
/// Capacity asked for the output fifos, and the pump's read size.
const PIPE_BYTES: usize = 1 << 20;
/// Output bytes per ExecStream message (fewer, larger messages through every hop).
const STREAM_CHUNK: u64 = 256 << 10;
pub const DEFAULT_SESSION_BUDGET: u64 = 256 << 20;
/// How long output may still arrive after a command's status (background processes holding
/// the fifo keep it open; their later output is not part of the command's record).
const OUTPUT_GRACE: Duration = Duration::from_millis(300);

#[derive(Debug, Clone, Default)]
pub struct CmdState {
    pub out: u64,
    pub err: u64,
    pub out_dropped: u64,
    pub err_dropped: u64,
    pub exit: Option<ExecExit>,
    pub evicted: bool,
}

#[derive(Debug)]
pub struct Cmd {
    pub rid: String,
    state: watch::Sender<CmdState>,
    /// Set once the command's record is final: pumps stop recording.
    sealed: AtomicBool,
}

impl Cmd {
    fn update(&self, f: impl FnOnce(&mut CmdState)) {
        if !self.sealed.load(Ordering::SeqCst) {
            self.state.send_modify(f);
        }
    }
}

struct Shell {
    pid: u32,
    exit: tokio::sync::oneshot::Receiver<crate::reaper::Exit>,
    stdin: tokio::net::unix::pipe::Sender,
    status: BufReader<tokio::net::unix::pipe::Receiver>,
}

#[derive(Default)]
struct Records {
    cmds: HashMap<String, Arc<Cmd>>,
    order: VecDeque<String>,
}

pub struct Chronus {
    dir: PathBuf,
    nonce: String,
    budget: u64,
    reaper: Reaper,
    shell: tokio::sync::Mutex<Option<Shell>>,
    records: Mutex<Records>,
    cwd: Mutex<PathBuf>,
    watchers: crate::watch::Watchers,
}
impl std::fmt::Debug for Chronus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Chronus").finish_non_exhaustive()
    }
}

fn shell_path() -> &'static str {
    if Path::new("/bin/bash").exists() { "/bin/bash" } else { "/bin/sh" }
}

impl Chronus {
    pub fn new(dir: PathBuf, budget: u64, reaper: Reaper) -> Arc<Self> {
        // The sandbox's working directory (aether passes spec.workdir), else the user's home.
        let home = std::env::var("HOME").unwrap_or_else(|_| "/".into());
        let start = std::env::var(WORKDIR_ENV).ok().filter(|w| Path::new(w).is_dir());
        let cwd = match start {
            Some(w) => PathBuf::from(w),
            None if Path::new(&home).is_dir() => PathBuf::from(home),
            None => PathBuf::from("/"),
        };
        Arc::new(Chronus {
            dir,
            nonce: format!("{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>()),
            budget,
            reaper,
            shell: tokio::sync::Mutex::new(None),
            records: Mutex::new(Records::default()),
            cwd: Mutex::new(cwd),
            watchers: crate::watch::Watchers::default(),
        })
    }

    fn records(&self) -> std::sync::MutexGuard<'_, Records> {
        self.records.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn cwd(&self) -> PathBuf {
        self.cwd.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn spawn_shell(&self) -> Result<Shell, AgentError> {
        let mut c = std::process::Command::new(shell_path());
        c.current_dir(self.cwd())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null());
        let mut child = self.reaper.spawn(&mut c).map_err(AgentError::Shell)?;
        let pid = child.id();
        let (Some(i), Some(o)) = (child.stdin.take(), child.stdout.take()) else {
            return Err(AgentError::Shell(std::io::Error::other("no shell pipes")));
        };
        let stdin = tokio::net::unix::pipe::Sender::from_owned_fd(i.into()).map_err(AgentError::Shell)?;
        let status = tokio::net::unix::pipe::Receiver::from_owned_fd(o.into()).map_err(AgentError::Shell)?;
        let exit = self.reaper.wait_for(pid);
        Ok(Shell { pid, exit, stdin, status: BufReader::new(status) })
    }

    /// Finds or starts the command `req.request_id` (empty = a fresh id).
    pub fn start(self: &Arc<Self>, req: ExecRequest) -> Result<Arc<Cmd>, AgentError> {
        let rid = if req.request_id.is_empty() {
            format!("r{:016x}", rand::random::<u64>())
        } else {
            check_id("request id", &req.request_id)?;
            req.request_id.clone()
        };
        let mut recs = self.records();
        if let Some(c) = recs.cmds.get(&rid) {
            return Ok(c.clone());
        }
        let cmd = Arc::new(Cmd {
            rid: rid.clone(),
            state: watch::channel(CmdState::default()).0,
            sealed: AtomicBool::new(false),
        });
        recs.cmds.insert(rid.clone(), cmd.clone());
        recs.order.push_back(rid);
        drop(recs);
        let me = self.clone();
        let c = cmd.clone();
        // Detached: the command runs to its end whether or not the caller stays.
        tokio::spawn(async move { me.execute(c, req).await });
        Ok(cmd)
    }

    fn path(&self, rid: &str, ext: &str) -> PathBuf {
        self.dir.join(format!("{rid}.{ext}"))
    }

    async fn execute(self: Arc<Self>, cmd: Arc<Cmd>, req: ExecRequest) {
        let mut guard = self.shell.lock().await;
        let result = self.run_in_shell(&mut guard, &cmd, &req).await;
        let exit = match result {
            Ok(e) => e,
            Err(e) => {
                let _ = std::fs::write(self.path(&cmd.rid, "err"), e.to_string());
                ExecExit { exit_code: -1, cwd: self.cwd().display().to_string(), ..Default::default() }
            }
        };
        drop(guard);
        cmd.state.send_modify(|s| {
            let mut exit = exit;
            exit.stdout_dropped_bytes = s.out_dropped;
            exit.stderr_dropped_bytes = s.err_dropped;
            if s.err == 0 && exit.exit_code == -1 {
                s.err = std::fs::metadata(self.path(&cmd.rid, "err")).map(|m| m.len()).unwrap_or(0);
            }
            s.exit = Some(exit);
        });
        cmd.sealed.store(true, Ordering::SeqCst);
        for ext in ["sh", "out.fifo", "err.fifo"] {
            let _ = std::fs::remove_file(self.path(&cmd.rid, ext));
        }
        self.evict(&cmd.rid);
    }

    /// Drops the records of the earliest finished commands while the session holds more than
    /// its budget. Running commands' records are never dropped, nor the one of `just_finished`
    /// (its caller may still be streaming it): it goes when a later command finishes.
    fn evict(&self, just_finished: &str) {
        let recs = self.records();
        let mut total: u64 = recs
            .cmds
            .values()
            .map(|c| {
                let s = c.state.borrow();
                if s.evicted { 0 } else { s.out + s.err }
            })
            .sum();
        for rid in &recs.order {
            if total <= self.budget {
                break;
            }
            if rid == just_finished {
                continue;
            }
            let Some(c) = recs.cmds.get(rid) else { continue };
            let (done, size) = {
                let s = c.state.borrow();
                (s.exit.is_some() && !s.evicted, s.out + s.err)
            };
            if done {
                let _ = std::fs::remove_file(self.path(rid, "out"));
                let _ = std::fs::remove_file(self.path(rid, "err"));
                c.state.send_modify(|s| s.evicted = true);
                total -= size;
            }
        }
    }

    async fn run_in_shell(
        &self,
        shell: &mut Option<Shell>,
        cmd: &Arc<Cmd>,
        req: &ExecRequest,
    ) -> Result<ExecExit, AgentError> {
        if shell.is_none() {
            *shell = Some(self.spawn_shell()?);
        }
        let rid = &cmd.rid;
        let limits = req.limits.unwrap_or_default();
        let lim = |v: u64| if v == 0 { DEFAULT_STREAM_LIMIT } else { v };
        let (out_fifo, err_fifo) = (self.path(rid, "out.fifo"), self.path(rid, "err.fifo"));
        for f in [&out_fifo, &err_fifo] {
            let _ = std::fs::remove_file(f);
            rustix::fs::mkfifoat(rustix::fs::CWD, f, rustix::fs::Mode::from_raw_mode(0o600))
                .map_err(|e| AgentError::fs("mkfifo", f, e.into()))?;
        }
        let mut script = String::new();
        let mut env: Vec<_> = req.env.iter().collect();
        env.sort();
        for (k, v) in env {
            if k.is_empty() || !k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(AgentError::Invalid(format!("bad env name {k:?}")));
            }
            script.push_str(&format!("export {k}={}\n", sh_quote(v)));
        }
        if !req.cwd.is_empty() {
            script.push_str(&format!("cd -- {} || return 1\n", sh_quote(&req.cwd)));
        }
        script.push_str(&req.command);
        script.push('\n');
        let script_path = self.path(rid, "sh");
        std::fs::write(&script_path, script).map_err(|e| AgentError::fs("write", &script_path, e))?;

        let pumps = [
            spawn_pump(out_fifo.clone(), self.path(rid, "out"), lim(limits.stdout_max_bytes), cmd.clone(), false),
            spawn_pump(err_fifo.clone(), self.path(rid, "err"), lim(limits.stderr_max_bytes), cmd.clone(), true),
        ];
        let line = format!(
            "{{ command . {}; }} >{} 2>{} </dev/null; printf '{} %d %s\\n' \"$?\" \"$PWD\"\n",
            sh_quote(&script_path.display().to_string()),
            sh_quote(&out_fifo.display().to_string()),
            sh_quote(&err_fifo.display().to_string()),
            self.nonce,
        );
        let Some(sh) = shell.as_mut() else {
            return Err(AgentError::Shell(std::io::Error::other("no shell")));
        };
        let pid = sh.pid;
        let status = async {
            sh.stdin.write_all(line.as_bytes()).await?;
            read_status(&mut sh.status, &self.nonce).await
        };
        let timeout = (req.timeout_ms > 0).then(|| Duration::from_millis(req.timeout_ms));
        let mut timed_out = false;
        let res = match timeout {
            None => status.await,
            Some(t) => {
                tokio::pin!(status);
                match tokio::time::timeout(t, &mut status).await {
                    Ok(r) => r,
                    Err(_) => {
                        timed_out = true;
                        // Kill what the command started; the shell itself then reports.
                        let _ = kill_tree(pid as i32, false);
                        match tokio::time::timeout(Duration::from_secs(2), &mut status).await {
                            Ok(r) => r,
                            // A builtin loop: only killing the shell stops it.
                            Err(_) => Ok(None),
                        }
                    }
                }
            }
        };
        let (code, cwd) = match res {
            Ok(Some((code, cwd))) => (code, Some(cwd)),
            // The shell ended (e.g. `exit`), or is stuck: it is replaced on the next command.
            Ok(None) | Err(_) => {
                let _ = kill_tree(pid as i32, true);
                let code = match shell.take() {
                    Some(sh) => match tokio::time::timeout(Duration::from_secs(2), sh.exit).await {
                        Ok(Ok(e)) if e.signal == 0 => e.code,
                        Ok(Ok(e)) => 128 + e.signal,
                        _ => -1,
                    },
                    None => -1,
                };
                (code, None)
            }
        };
        if let Some(cwd) = cwd {
            *self.cwd.lock().unwrap_or_else(|p| p.into_inner()) = PathBuf::from(cwd);
        }
        // Unblock a pump whose fifo the shell never opened (e.g. it failed the redirection).
        for f in [&out_fifo, &err_fifo] {
            let _ = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
                .open(f);
        }
        for p in pumps {
            let _ = tokio::time::timeout(OUTPUT_GRACE, p).await;
        }
        Ok(ExecExit { exit_code: code, timed_out, cwd: self.cwd().display().to_string(), ..Default::default() })
    }

    fn find(&self, rid: &str) -> Result<Arc<Cmd>, AgentError> {
        self.records().cmds.get(rid).cloned().ok_or_else(|| AgentError::UnknownRequest(rid.to_string()))
    }

    /// Up to `max` recorded bytes of one stream from `offset`.
    fn read_record(&self, rid: &str, err: bool, offset: u64, size: u64, max: u64) -> Vec<u8> {
        let f = std::fs::File::open(self.path(rid, if err { "err" } else { "out" })).ok();
        read_at(f.as_ref(), offset, size, max)
    }
}

/// Up to `max` bytes of an open record file from `offset` (below `size`).
fn read_at(f: Option<&std::fs::File>, offset: u64, size: u64, max: u64) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let end = size.min(offset.saturating_add(max));
    let Some(f) = f else { return vec![] };
    if end <= offset {
        return vec![];
    }
    let mut buf = vec![0u8; (end - offset) as usize];
    let n = f.read_at(&mut buf, offset).unwrap_or(0);
    buf.truncate(n);
    buf
}

/// Reads status lines until ours: `Some((code, cwd))`, `None` when the shell ended.
async fn read_status(
    r: &mut BufReader<tokio::net::unix::pipe::Receiver>,
    nonce: &str,
) -> std::io::Result<Option<(i32, String)>> {
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            return Ok(None);
        }
        if let Some(parsed) = parse_status(&line, nonce) {
            return Ok(Some(parsed));
        }
    }
}

/// `NONCE CODE CWD\n` → (code, cwd).
pub fn parse_status(line: &str, nonce: &str) -> Option<(i32, String)> {
    let rest = line.strip_prefix(nonce)?.strip_prefix(' ')?;
    let (code, cwd) = rest.split_once(' ')?;
    Some((code.parse().ok()?, cwd.strip_suffix('\n').unwrap_or(cwd).to_string()))
}

/// Copies a fifo into a record file, at most `limit` bytes; the rest is read and counted as
/// dropped so the writer never blocks.
fn spawn_pump(fifo: PathBuf, record: PathBuf, limit: u64, cmd: Arc<Cmd>, err: bool) -> tokio::task::JoinHandle<()> {
    tokio::task::spawn_blocking(move || {
        let Ok(mut file) = std::fs::File::create(&record) else {
            return;
        };
        // Blocks until the shell opens the fifo for writing.
        let Ok(mut src) = std::fs::File::open(&fifo) else {
            return;
        };
        // A deeper pipe: a fast writer's output comes in fewer, larger reads (best effort).
        let granted = rustix::pipe::fcntl_setpipe_size(&src, PIPE_BYTES).unwrap_or(0);
        // One read takes at most what the pipe holds.
        let mut buf = vec![0u8; granted.max(64 << 10)];
        let mut kept = 0u64;
        loop {
            let n = match src.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let keep = (limit - kept).min(n as u64) as usize;
            if keep > 0 && file.write_all(&buf[..keep]).is_err() {
                break;
            }
            kept += keep as u64;
            let dropped = (n - keep) as u64;
            cmd.update(|s| {
                if err {
                    s.err += keep as u64;
                    s.err_dropped += dropped;
                } else {
                    s.out += keep as u64;
                    s.out_dropped += dropped;
                }
            });
        }
    })
}

fn chunk(stream: OutputStream, offset: u64, data: Vec<u8>) -> ExecChunk {
    ExecChunk {
        kind: Some(exec_chunk::Kind::Output(OutputData { stream: stream as i32, offset, data })),
        request_id: String::new(),
    }
}

/// The `Runtime` service of one session (aether forwards session calls here).
#[derive(Debug, Clone)]
pub struct ChronusService(pub Arc<Chronus>);

#[tonic::async_trait]
impl Runtime for ChronusService {
    async fn exec(&self, r: Request<ExecRequest>) -> Result<Response<ExecResult>, Status> {
        // The whole output comes back in one message: each stream records at most
        // RESULT_MAX here (the rest is dropped and counted); ExecStream has no such cap.
        let mut req = r.into_inner();
        let limits = req.limits.get_or_insert_with(Default::default);
        for v in [&mut limits.stdout_max_bytes, &mut limits.stderr_max_bytes] {
            *v = (*v).min(RESULT_MAX);
        }
        let cmd = self.0.start(req)?;
        let mut rx = cmd.state.subscribe();
        let st = rx.wait_for(|s| s.exit.is_some()).await.map_err(|_| Status::internal("command record gone"))?.clone();
        if st.evicted {
            return Err(AgentError::Evicted(cmd.rid.clone()).into());
        }
        let exit = st.exit.unwrap_or_default();
        Ok(Response::new(ExecResult {
            exit_code: exit.exit_code,
            // A repeated request id may name a streamed command with a longer record.
            stdout: self.0.read_record(&cmd.rid, false, 0, st.out, RESULT_MAX),
            stderr: self.0.read_record(&cmd.rid, true, 0, st.err, RESULT_MAX),
            stdout_dropped_bytes: exit.stdout_dropped_bytes,
            stderr_dropped_bytes: exit.stderr_dropped_bytes,
            timed_out: exit.timed_out,
            request_id: cmd.rid.clone(),
            cwd: exit.cwd,
        }))
    }

    type ExecStreamStream = BoxStream<ExecChunk>;
    async fn exec_stream(&self, r: Request<ExecRequest>) -> Result<Response<Self::ExecStreamStream>, Status> {
        let req = r.into_inner();
        let (mut o, mut e) = (req.stdout_offset, req.stderr_offset);
        let cmd = self.0.start(req)?;
        let me = self.0.clone();
        let (tx, rx) = mpsc::channel(8);
        tokio::spawn(async move {
            let mut st = cmd.state.subscribe();
            let mut first = true;
            // The record files, opened once for the stream's life.
            let mut files: [Option<std::fs::File>; 2] = [None, None];
            loop {
                let s = st.borrow_and_update().clone();
                if s.evicted {
                    let _ = tx.send(Err(AgentError::Evicted(cmd.rid.clone()).into())).await;
                    return;
                }
                let mut sent = false;
                for (err, off, size) in [(false, &mut o, s.out), (true, &mut e, s.err)] {
                    while *off < size {
                        let f = &mut files[usize::from(err)];
                        if f.is_none() {
                            *f = std::fs::File::open(me.path(&cmd.rid, if err { "err" } else { "out" })).ok();
                        }
                        let data = read_at(f.as_ref(), *off, size, STREAM_CHUNK);
                        if data.is_empty() {
                            break;
                        }
                        let n = data.len() as u64;
                        let stream = if err { OutputStream::Stderr } else { OutputStream::Stdout };
                        let mut c = chunk(stream, *off, data);
                        if first {
                            c.request_id = cmd.rid.clone();
                            first = false;
                        }
                        if tx.send(Ok(c)).await.is_err() {
                            return;
                        }
                        *off += n;
                        sent = true;
                    }
                }
                if sent {
                    continue;
                }
                if let Some(exit) = s.exit {
                    let _ = tx
                        .send(Ok(ExecChunk {
                            kind: Some(exec_chunk::Kind::Exit(exit)),
                            request_id: if first { cmd.rid.clone() } else { String::new() },
                        }))
                        .await;
                    return;
                }
                if st.changed().await.is_err() {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn get_output(&self, r: Request<GetOutputRequest>) -> Result<Response<GetOutputResponse>, Status> {
        let r = r.into_inner();
        let cmd = self.0.find(&r.request_id)?;
        let s = cmd.state.borrow().clone();
        if s.evicted {
            return Err(AgentError::Evicted(cmd.rid.clone()).into());
        }
        let max = if r.max_bytes == 0 { 4 << 20 } else { r.max_bytes.min(RESULT_MAX) };
        Ok(Response::new(GetOutputResponse {
            stdout: self.0.read_record(&cmd.rid, false, r.stdout_offset, s.out, max),
            stderr: self.0.read_record(&cmd.rid, true, r.stderr_offset, s.err, max),
            stdout_size: s.out,
            stderr_size: s.err,
            finished: s.exit.is_some(),
            exit: s.exit,
        }))
    }

    async fn close_session(&self, _r: Request<CloseSessionRequest>) -> Result<Response<CloseSessionResponse>, Status> {
        // aether kills chronus's whole tree; nothing to do here.
        Ok(Response::new(CloseSessionResponse { existed: true }))
    }

    type ReadFileStream = BoxStream<FileChunk>;
    async fn read_file(&self, r: Request<ReadFileRequest>) -> Result<Response<Self::ReadFileStream>, Status> {
        let r = r.into_inner();
        let s = files::read(&self.0.cwd(), &r.path, r.offset, r.length).await?;
        Ok(Response::new(s))
    }

    async fn write_file(&self, r: Request<Streaming<WriteFileRequest>>) -> Result<Response<WriteFileResponse>, Status> {
        let n = files::write(&self.0.cwd(), &self.0.dir, r.into_inner()).await?;
        Ok(Response::new(WriteFileResponse { bytes_written: n }))
    }

    async fn list_dir(&self, r: Request<ListDirRequest>) -> Result<Response<ListDirResponse>, Status> {
        let r = r.into_inner();
        let entries = files::list(&self.0.cwd(), &r.path, r.xattrs).await?;
        Ok(Response::new(ListDirResponse { entries }))
    }

    async fn stat(&self, r: Request<StatRequest>) -> Result<Response<FileInfo>, Status> {
        let r = r.into_inner();
        Ok(Response::new(files::stat(&self.0.cwd(), &r.path, r.xattrs).await?))
    }

    async fn make_dir(&self, r: Request<MakeDirRequest>) -> Result<Response<MakeDirResponse>, Status> {
        let r = r.into_inner();
        files::mkdir(&self.0.cwd(), &r.path, r.parents, r.mode).await?;
        Ok(Response::new(MakeDirResponse {}))
    }

    async fn remove(&self, r: Request<RemoveRequest>) -> Result<Response<RemoveResponse>, Status> {
        let r = r.into_inner();
        files::remove(&self.0.cwd(), &r.path, r.recursive).await?;
        Ok(Response::new(RemoveResponse {}))
    }

    async fn r#move(&self, r: Request<MoveRequest>) -> Result<Response<MoveResponse>, Status> {
        let r = r.into_inner();
        files::rename(&self.0.cwd(), &r.from, &r.to).await?;
        Ok(Response::new(MoveResponse {}))
    }

    type WatchDirStream = BoxStream<WatchDirEvent>;
    async fn watch_dir(&self, r: Request<WatchDirRequest>) -> Result<Response<Self::WatchDirStream>, Status> {
        let r = r.into_inner();
        let root = files::resolve(&self.0.cwd(), &r.path)?;
        let mut w = crate::watch::Watch::new(&root, r.recursive)?;
        let (tx, rx) = tokio::sync::mpsc::channel(16);
        tokio::spawn(async move {
            if tx.send(Ok(WatchDirEvent { started: true, ..Default::default() })).await.is_err() {
                return;
            }
            loop {
                let b = tokio::select! {
                    b = w.next() => b,
                    () = tx.closed() => return,
                };
                let msg = match b {
                    Ok(b) => Ok(WatchDirEvent { started: false, events: b.events, overflowed: b.overflowed }),
                    Err(e) => Err(AgentError::fs("watch", &root, e).into()),
                };
                let end = msg.is_err();
                if tx.send(msg).await.is_err() || end {
                    return;
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn create_watcher(&self, r: Request<WatchDirRequest>) -> Result<Response<CreateWatcherResponse>, Status> {
        let r = r.into_inner();
        let root = files::resolve(&self.0.cwd(), &r.path)?;
        let watcher_id = self.0.watchers.create(crate::watch::Watch::new(&root, r.recursive)?)?;
        Ok(Response::new(CreateWatcherResponse { watcher_id }))
    }

    async fn get_watcher_events(
        &self,
        r: Request<GetWatcherEventsRequest>,
    ) -> Result<Response<GetWatcherEventsResponse>, Status> {
        let (events, dropped) = self.0.watchers.poll(&r.into_inner().watcher_id)?;
        Ok(Response::new(GetWatcherEventsResponse { events, dropped }))
    }

    async fn remove_watcher(
        &self,
        r: Request<RemoveWatcherRequest>,
    ) -> Result<Response<RemoveWatcherResponse>, Status> {
        self.0.watchers.remove(&r.into_inner().watcher_id);
        Ok(Response::new(RemoveWatcherResponse {}))
    }

    async fn http_request(&self, r: Request<HttpRequestRequest>) -> Result<Response<HttpRequestResponse>, Status> {
        Ok(Response::new(crate::http::request(r.into_inner()).await?))
    }

    async fn start_process(&self, _r: Request<StartProcessRequest>) -> Result<Response<StartProcessResponse>, Status> {
        Err(AgentError::Unsupported("process API in a session").into())
    }

    type ConnectProcessStream = BoxStream<ProcessEvent>;
    async fn connect_process(
        &self,
        _r: Request<ConnectProcessRequest>,
    ) -> Result<Response<Self::ConnectProcessStream>, Status> {
        Err(AgentError::Unsupported("process API in a session").into())
    }

    async fn send_input(&self, _r: Request<SendInputRequest>) -> Result<Response<SendInputResponse>, Status> {
        Err(AgentError::Unsupported("process API in a session").into())
    }

    async fn signal_process(
        &self,
        _r: Request<SignalProcessRequest>,
    ) -> Result<Response<SignalProcessResponse>, Status> {
        Err(AgentError::Unsupported("process API in a session").into())
    }

    async fn list_processes(
        &self,
        _r: Request<ListProcessesRequest>,
    ) -> Result<Response<ListProcessesResponse>, Status> {
        Err(AgentError::Unsupported("process API in a session").into())
    }

    type RunCodeStream = BoxStream<CodeEvent>;
    async fn run_code(&self, _r: Request<RunCodeRequest>) -> Result<Response<Self::RunCodeStream>, Status> {
        Err(AgentError::Unsupported("code contexts in a session").into())
    }

    async fn create_code_context(
        &self,
        _r: Request<CreateCodeContextRequest>,
    ) -> Result<Response<CodeContext>, Status> {
        Err(AgentError::Unsupported("code contexts in a session").into())
    }

    async fn list_code_contexts(
        &self,
        _r: Request<ListCodeContextsRequest>,
    ) -> Result<Response<ListCodeContextsResponse>, Status> {
        Err(AgentError::Unsupported("code contexts in a session").into())
    }

    async fn restart_code_context(&self, _r: Request<CodeContextRequest>) -> Result<Response<CodeContext>, Status> {
        Err(AgentError::Unsupported("code contexts in a session").into())
    }

    async fn remove_code_context(
        &self,
        _r: Request<CodeContextRequest>,
    ) -> Result<Response<RemoveCodeContextResponse>, Status> {
        Err(AgentError::Unsupported("code contexts in a session").into())
    }

    async fn resize_process(
        &self,
        _r: Request<ResizeProcessRequest>,
    ) -> Result<Response<ResizeProcessResponse>, Status> {
        Err(AgentError::Unsupported("process API in a session").into())
    }

    type WatchStream = BoxStream<Heartbeat>;
    async fn watch(&self, _r: Request<WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        Err(AgentError::Unsupported("watch a session").into())
    }
}

/// `opendsec-agent chronus --socket PATH --dir DIR [--session-bytes N]`: prints `ready` on
/// stdout once it serves.
pub async fn main(socket: PathBuf, dir: PathBuf, budget: u64) -> std::io::Result<()> {
    // chronus lives only as long as its aether.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    // The session's work is killed before aether when the sandbox runs out of memory.
    crate::raise_oom_score();
    let reaper = Reaper::start();
    let chronus = Chronus::new(dir, budget, reaper);
    let listener = crate::bind_unix(&socket)?;
    println!("ready");
    crate::serve_unix(listener, ChronusService(chronus)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_lines() {
        assert_eq!(parse_status("abc 3 /a b\n", "abc"), Some((3, "/a b".into())));
        assert_eq!(parse_status("abd 3 /\n", "abc"), None);
        assert_eq!(parse_status("abc x /\n", "abc"), None);
    }
}
