//! The `Runtime` API on the command line: `exec`, `run`, `cp`, `ps` and `kill`.
//!
//! `exec` and `run` stream a command's output to the local stdout/stderr as it comes and exit
//! with the command's own exit code (errors of the call itself keep the per-reason codes).
//! When the output stream breaks with `unavailable`, they re-attach from the offsets already
//! written (the exec by its request id, the process by its pid), so no byte is written twice
//! and none is lost. Uploads are streamed in 1 MiB messages; a local read error fails the
//! upload mid-stream (`Upload::Abort`), so the sandbox never holds a short file reported
//! complete. Downloads go
//! to a temporary file renamed into place only when the whole file arrived.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;

use clap::Args;
use opendsec_client::{Client, Upload};
use opendsec_common::{ApiError, Reason, ids};
use opendsec_proto::v1 as pb;
use serde_json::json;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::error::CtlError;
use crate::output::Out;
use crate::support::kv;
use crate::term::TermFilter;

/// Size of one upload message.
pub const UPLOAD_CHUNK: usize = 1 << 20;

/// Re-attachments after a broken output stream before giving up.
const MAX_REATTACH: u32 = 10;

/// The exit code of `opendsecctl` when Ctrl-C or SIGTERM interrupted it (as a shell reports).
const INTERRUPTED: i32 = 130;

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
opendsecctl exec ID -- 'echo hello; uname -a'\n  \
opendsecctl exec ID -- \"python3 -c 'print(6*7)'\"\n  \
opendsecctl exec ID --session s1 -- cd /tmp        # the session keeps cd, exports, functions\n  \
opendsecctl exec ID --session s1 -- pwd            # /tmp\n  \
opendsecctl exec ID --json -- ls /                 # exit code, stdout, stderr as JSON")]
pub struct ExecArgs {
    pub sandbox: String,
    /// A named session: its shell persists between calls (cd, exports). Default: a fresh
    /// session, closed afterwards.
    #[arg(long)]
    pub session: Option<String>,
    /// User of a new session (name or uid; default root).
    #[arg(long)]
    pub user: Option<String>,
    /// `cd` here before the command.
    #[arg(long)]
    pub cwd: Option<String>,
    /// KEY=VALUE exported before the command, repeatable.
    #[arg(long = "env")]
    pub env: Vec<String>,
    /// Seconds (0: no timeout).
    #[arg(long, default_value_t = 0)]
    pub timeout: u64,
    /// Shell text (the words are joined with spaces), after `--`.
    #[arg(required = true, trailing_var_arg = true)]
    pub command: Vec<String>,
}

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
opendsecctl run ID -- python3 train.py             # follow its output, exit with its code\n  \
opendsecctl run ID --tag web --detach -- python3 -m http.server 8000\n  \
opendsecctl ps ID\n  \
opendsecctl kill ID web --signal 15")]
pub struct RunArgs {
    pub sandbox: String,
    /// A name for the process, unique among running ones (usable by `kill`).
    #[arg(long)]
    pub tag: Option<String>,
    #[arg(long)]
    pub user: Option<String>,
    #[arg(long)]
    pub cwd: Option<String>,
    /// KEY=VALUE, repeatable.
    #[arg(long = "env")]
    pub env: Vec<String>,
    /// Print the pid and return instead of following the output.
    #[arg(long)]
    pub detach: bool,
    /// argv (argv[0] looked up in PATH), after `--`.
    #[arg(required = true, trailing_var_arg = true)]
    pub command: Vec<String>,
}

#[derive(Args, Debug)]
#[command(after_help = "Examples:\n  \
opendsecctl cp ./data.csv ID:/work/data.csv        # upload\n  \
opendsecctl cp ID:/work/out.json ./out.json        # download\n  \
tar cz src | opendsecctl cp - ID:/tmp/src.tgz      # from stdin\n  \
opendsecctl cp ID:/etc/os-release -                # to stdout")]
pub struct CpArgs {
    /// `SANDBOX_ID:/path`, a local path, or `-` (stdin).
    pub src: String,
    /// `SANDBOX_ID:/path`, a local path, or `-` (stdout).
    pub dst: String,
    /// Session whose user and directory resolve the path (default: the default session).
    #[arg(long)]
    pub session: Option<String>,
    #[arg(long)]
    pub user: Option<String>,
}

#[derive(Args, Debug)]
pub struct KillArgs {
    pub sandbox: String,
    /// A pid (numeric) or a tag.
    pub process: String,
    #[arg(long, default_value_t = 15)]
    pub signal: i32,
}

/// One side of a `cp`.
#[derive(Debug, PartialEq, Eq)]
pub enum Place {
    Remote {
        sandbox: String,
        path: String,
    },
    Local(PathBuf),
    /// `-`: stdin as a source, stdout as a destination.
    Std,
}

/// `SANDBOX_ID:path` when the text before the first `:` is a valid sandbox id; `-`; else a
/// local path (write `./name` for a local file whose name looks like `edge.lease:x`).
pub fn parse_place(s: &str) -> Result<Place, CtlError> {
    if s == "-" {
        return Ok(Place::Std);
    }
    if let Some((id, path)) = s.split_once(':')
        && !id.contains('/')
        && ids::split_sandbox_id(id).is_ok()
    {
        if path.is_empty() {
            return Err(CtlError::Api(ApiError::invalid(format!("{s:?}: no path after the sandbox id"))));
        }
        return Ok(Place::Remote { sandbox: id.to_string(), path: path.to_string() });
    }
    Ok(Place::Local(PathBuf::from(s)))
}

/// Which pid or tag a `kill` names: digits are a pid.
pub fn selector(s: &str) -> pb::ProcessSelector {
    let by = match s.parse::<u32>() {
        Ok(pid) => pb::process_selector::By::Pid(pid),
        Err(_) => pb::process_selector::By::Tag(s.to_string()),
    };
    pb::ProcessSelector { by: Some(by) }
}

/// The part of `data` (starting at `offset` in its stream) past the `seen` bytes already
/// written: a re-attached stream may repeat what came before the break.
pub fn fresh_part(seen: u64, offset: u64, data: &[u8]) -> &[u8] {
    if offset >= seen {
        return data;
    }
    let skip = usize::try_from(seen - offset).unwrap_or(usize::MAX).min(data.len());
    &data[skip..]
}

/// `opendsecctl`'s exit code for a remote exit code (and signal, for processes): codes a shell
/// can report as they are, a signal as 128 + signal, anything else 255.
pub fn local_exit_code(code: i32, signal: i32) -> i32 {
    match code {
        0..=255 => code,
        _ if (1..128).contains(&signal) => 128 + signal,
        _ => 255,
    }
}

fn opt(s: &Option<String>) -> String {
    s.clone().unwrap_or_default()
}

/// Where a command's output goes: the local stdout/stderr as it comes, or buffers for `--json`.
/// Output shown on a terminal goes through a [`TermFilter`] per stream (the workload's escape
/// sequences must not make the operator's terminal answer or remember anything).
struct Sink {
    json: bool,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    seen_out: u64,
    seen_err: u64,
    term_out: Option<TermFilter>,
    term_err: Option<TermFilter>,
}

impl Sink {
    fn new(json: bool) -> Sink {
        use std::io::IsTerminal;
        let term = |t: bool| (!json && t).then(TermFilter::new);
        Sink {
            json,
            stdout: Vec::new(),
            stderr: Vec::new(),
            seen_out: 0,
            seen_err: 0,
            term_out: term(std::io::stdout().is_terminal()),
            term_err: term(std::io::stderr().is_terminal()),
        }
    }

    async fn output(&mut self, o: &pb::OutputData) -> Result<(), CtlError> {
        let is_err = match pb::OutputStream::try_from(o.stream) {
            Ok(pb::OutputStream::Stdout) => false,
            Ok(pb::OutputStream::Stderr) => true,
            _ => return Ok(()),
        };
        let seen = if is_err { &mut self.seen_err } else { &mut self.seen_out };
        let fresh = fresh_part(*seen, o.offset, &o.data);
        *seen = (*seen).max(o.offset.saturating_add(o.data.len() as u64));
        if fresh.is_empty() {
            return Ok(());
        }
        let failed = |e: std::io::Error| CtlError::Local(format!("writing the command's output failed: {e}"));
        match (self.json, is_err) {
            (true, false) => self.stdout.extend_from_slice(fresh),
            (true, true) => self.stderr.extend_from_slice(fresh),
            (false, false) => {
                let shown = self.term_out.as_mut().map(|f| f.filter(fresh));
                write_now(&mut tokio::io::stdout(), shown.as_deref().unwrap_or(fresh)).await.map_err(failed)?
            }
            (false, true) => {
                let shown = self.term_err.as_mut().map(|f| f.filter(fresh));
                write_now(&mut tokio::io::stderr(), shown.as_deref().unwrap_or(fresh)).await.map_err(failed)?
            }
        }
        Ok(())
    }
}

async fn write_now(w: &mut (impl AsyncWrite + Unpin), data: &[u8]) -> std::io::Result<()> {
    w.write_all(data).await?;
    w.flush().await
}

/// One message of an output stream, as the follower sees it.
enum Event<E> {
    Output(pb::OutputData),
    Exit(E),
    Nothing,
}

fn exec_event(c: pb::ExecChunk) -> Event<pb::ExecExit> {
    match c.kind {
        Some(pb::exec_chunk::Kind::Output(o)) => Event::Output(o),
        Some(pb::exec_chunk::Kind::Exit(x)) => Event::Exit(x),
        None => Event::Nothing,
    }
}

fn process_event(e: pb::ProcessEvent) -> Event<pb::ProcessExit> {
    match e.kind {
        Some(pb::process_event::Kind::Output(o)) => Event::Output(o),
        Some(pb::process_event::Kind::Exit(x)) => Event::Exit(x),
        None => Event::Nothing,
    }
}

/// Writes an output stream to `sink` until its exit; `open(stdout_offset, stderr_offset)`
/// (re-)opens it. A stream broken by `unavailable` is re-opened from what was written.
async fn follow<T, E, Open, Fut>(sink: &mut Sink, open: Open, split: fn(T) -> Event<E>) -> Result<E, CtlError>
where
    Open: Fn(u64, u64) -> Fut,
    Fut: Future<Output = Result<tonic::Streaming<T>, ApiError>>,
{
    let mut reattached = 0;
    loop {
        let mut stream = open(sink.seen_out, sink.seen_err).await?;
        let broken = loop {
            match stream.message().await {
                Ok(Some(m)) => match split(m) {
                    Event::Output(o) => sink.output(&o).await?,
                    Event::Exit(x) => return Ok(x),
                    Event::Nothing => {}
                },
                Ok(None) => break ApiError::unavailable("the output stream ended before the exit"),
                Err(st) => {
                    let e = ApiError::from_status(&st);
                    if e.reason != Reason::Unavailable {
                        return Err(e.into());
                    }
                    break e;
                }
            }
        };
        reattached += 1;
        if reattached > MAX_REATTACH {
            return Err(broken.into());
        }
        tracing::debug!(reason = %broken.reason, message = %broken.message, "output stream broken; re-attaching");
        tokio::time::sleep(Duration::from_millis(100 * u64::from(reattached))).await;
    }
}

/// `opendsecctl exec`: the command's exit code.
pub async fn exec(client: &Client, out: &Out, a: ExecArgs) -> Result<i32, CtlError> {
    let one_shot = a.session.is_none();
    let session = a.session.clone().unwrap_or_else(|| format!("exec-{}", opendsec_common::grpc::random_secret(12)));
    let req = pb::ExecRequest {
        sandbox_id: a.sandbox.clone(),
        session_id: session.clone(),
        command: a.command.join(" "),
        // Ours, not the client's: re-attaching needs it.
        request_id: opendsec_client::new_request_id(),
        timeout_ms: a.timeout.saturating_mul(1000),
        env: kv(&a.env, "env")?,
        cwd: opt(&a.cwd),
        user: opt(&a.user),
        limits: None,
        stdout_offset: 0,
        stderr_offset: 0,
    };
    let mut sink = Sink::new(out.json);
    // Whether the command may have started: only then is there a session to close.
    let started = std::sync::atomic::AtomicBool::new(false);
    let open = |o, e| {
        let call = client.exec_stream(pb::ExecRequest { stdout_offset: o, stderr_offset: e, ..req.clone() });
        let started = &started;
        async move {
            let r = call.await;
            // Refusals and an unreachable cluster start nothing; an answer that did not come
            // in time may have.
            let maybe = match &r {
                Ok(_) => true,
                Err(e) => matches!(e.reason, Reason::DeadlineExceeded | Reason::Internal),
            };
            if maybe {
                started.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            r
        }
    };
    let outcome = tokio::select! {
        r = follow(&mut sink, open, exec_event) => r.map(Some),
        _ = crate::support::wait_for_signal() => Ok(None),
    };
    if one_shot && started.load(std::sync::atomic::Ordering::Relaxed) {
        // Closing the one-shot session also ends what the command left running (or, after
        // Ctrl-C, the command itself).
        let close = pb::CloseSessionRequest { sandbox_id: a.sandbox.clone(), session_id: session.clone() };
        if let Err(e) = client.close_session(close).await {
            eprintln!("warning: closing session {session} failed: {}: {}", e.reason, e.message);
        }
    }
    let Some(exit) = outcome? else { return Ok(INTERRUPTED) };
    if out.json {
        let v = json!({
            "sandbox_id": a.sandbox,
            "session_id": session,
            "request_id": req.request_id,
            "exit_code": exit.exit_code,
            "timed_out": exit.timed_out,
            "cwd": exit.cwd,
            "stdout": String::from_utf8_lossy(&sink.stdout),
            "stderr": String::from_utf8_lossy(&sink.stderr),
            "stdout_dropped_bytes": exit.stdout_dropped_bytes,
            "stderr_dropped_bytes": exit.stderr_dropped_bytes,
        });
        out.print(v, String::new);
    } else if exit.timed_out {
        eprintln!("opendsecctl: the command timed out");
    }
    Ok(local_exit_code(exit.exit_code, 0))
}

/// `opendsecctl run`: starts a process and follows it; its exit code (or 0 with `--detach`).
pub async fn run(client: &Client, out: &Out, a: RunArgs) -> Result<i32, CtlError> {
    let start = pb::StartProcessRequest {
        sandbox_id: a.sandbox.clone(),
        cmd: a.command.clone(),
        env: kv(&a.env, "env")?,
        cwd: opt(&a.cwd),
        user: opt(&a.user),
        tag: opt(&a.tag),
        pty: None,
        ..Default::default()
    };
    let pid = client.start_process(start).await?.pid;
    if a.detach {
        out.print(json!({"sandbox_id": a.sandbox, "pid": pid, "tag": opt(&a.tag)}), || pid.to_string());
        return Ok(0);
    }
    let mut sink = Sink::new(out.json);
    let open = |o, e| {
        client.connect_process(pb::ConnectProcessRequest {
            sandbox_id: a.sandbox.clone(),
            process: Some(selector(&pid.to_string())),
            stdout_offset: o,
            stderr_offset: e,
        })
    };
    // Interrupted: the process keeps running (`kill` ends it).
    let exit = tokio::select! {
        r = follow(&mut sink, open, process_event) => r?,
        _ = crate::support::wait_for_signal() => return Ok(INTERRUPTED),
    };
    if out.json {
        let v = json!({
            "sandbox_id": a.sandbox,
            "pid": pid,
            "exit_code": exit.exit_code,
            "signal": exit.signal,
            "stdout": String::from_utf8_lossy(&sink.stdout),
            "stderr": String::from_utf8_lossy(&sink.stderr),
        });
        out.print(v, String::new);
    }
    Ok(local_exit_code(exit.exit_code, exit.signal))
}

pub async fn ps(client: &Client, out: &Out, sandbox: String) -> Result<(), CtlError> {
    let r = client.list_processes(pb::ListProcessesRequest { sandbox_id: sandbox }).await?;
    let state = |p: &pb::ProcessInfo| match (p.running, p.exit) {
        (true, _) => "running".to_string(),
        (false, Some(x)) if x.signal != 0 => format!("killed ({})", x.signal),
        (false, Some(x)) => format!("exited {}", x.exit_code),
        (false, None) => "exited".to_string(),
    };
    out.print(crate::json::of(&r.processes), || {
        let mut t = crate::table::Table::new(&["PID", "TAG", "STATE", "CMD"]);
        for p in &r.processes {
            t.row(vec![p.pid.to_string(), p.tag.clone(), state(p), p.cmd.join(" ")]);
        }
        t.render("no processes")
    });
    Ok(())
}

pub async fn kill(client: &Client, out: &Out, a: KillArgs) -> Result<(), CtlError> {
    let req = pb::SignalProcessRequest {
        sandbox_id: a.sandbox.clone(),
        process: Some(selector(&a.process)),
        signal: a.signal,
    };
    client.signal_process(req).await?;
    out.print(json!({"sandbox_id": a.sandbox, "process": a.process, "signal": a.signal}), || {
        format!("sent signal {} to {}", a.signal, a.process)
    });
    Ok(())
}

pub async fn cp(client: &Client, out: &Out, a: CpArgs) -> Result<(), CtlError> {
    let (src, dst) = (parse_place(&a.src)?, parse_place(&a.dst)?);
    let session = opt(&a.session);
    let user = opt(&a.user);
    let (bytes, to_stdout) = match (src, dst) {
        (Place::Remote { .. }, Place::Remote { .. }) => {
            return Err(CtlError::Api(ApiError::invalid(
                "cp copies between a sandbox and here, not between sandboxes",
            )));
        }
        (Place::Remote { sandbox, path }, local) => {
            let req =
                pb::ReadFileRequest { sandbox_id: sandbox, session_id: session, path, offset: 0, length: 0, user };
            let to_stdout = local == Place::Std;
            (download(client, req, local).await?, to_stdout)
        }
        (local, Place::Remote { sandbox, path }) => {
            let first = pb::WriteFileRequest {
                sandbox_id: sandbox,
                session_id: session,
                path,
                append: false,
                mode: 0,
                data: Vec::new(),
                user,
                make_parents: true,
                finish: false,
                ..Default::default()
            };
            (upload(client, local, first).await?, false)
        }
        _ => return Err(CtlError::Api(ApiError::invalid("cp needs one side as SANDBOX_ID:/path"))),
    };
    if !to_stdout && out.json {
        out.print(json!({"from": a.src, "to": a.dst, "bytes": bytes}), String::new);
    }
    Ok(())
}

fn local_err(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> CtlError {
    move |e| CtlError::Local(format!("{what}: {e}"))
}

/// Reads up to `buf.len()` bytes, fewer only at the end of the input.
async fn read_full(r: &mut (impl AsyncRead + Unpin), buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match r.read(&mut buf[n..]).await? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

async fn upload(client: &Client, src: Place, mut first: pb::WriteFileRequest) -> Result<u64, CtlError> {
    let (mut reader, name): (Box<dyn AsyncRead + Unpin + Send>, Option<String>) = match &src {
        Place::Std => (Box::new(tokio::io::stdin()), None),
        Place::Local(p) => {
            let f = tokio::fs::File::open(p).await.map_err(local_err(format!("cannot open {}", p.display())))?;
            let meta = f.metadata().await.map_err(local_err(format!("cannot stat {}", p.display())))?;
            if meta.is_dir() {
                return Err(CtlError::Local(format!("{} is a directory (cp copies one file)", p.display())));
            }
            {
                use std::os::unix::fs::PermissionsExt;
                first.mode = meta.permissions().mode() & 0o777;
            }
            (Box::new(f), p.file_name().map(|n| n.to_string_lossy().into_owned()))
        }
        Place::Remote { .. } => unreachable!("cp checked that the source is local"),
    };
    if first.path.ends_with('/') {
        match name {
            Some(n) => first.path.push_str(&n),
            None => return Err(CtlError::Api(ApiError::invalid("copying stdin needs a file path, not a directory"))),
        }
    }
    let sandbox = first.sandbox_id.clone();
    let (tx, rx) = mpsc::channel::<Upload<pb::WriteFileRequest>>(4);
    let feed = async {
        let mut first = Some(first);
        let mut buf = vec![0u8; UPLOAD_CHUNK];
        loop {
            let n = read_full(&mut reader, &mut buf).await.map_err(local_err("reading the source failed"))?;
            let data = buf[..n].to_vec();
            // A short read is the end of the source: that message completes the upload.
            let finish = n < UPLOAD_CHUNK;
            let msg = match first.take() {
                Some(f) => pb::WriteFileRequest { data, finish, ..f },
                None => pb::WriteFileRequest { sandbox_id: sandbox.clone(), data, finish, ..Default::default() },
            };
            if tx.send(Upload::Message(msg)).await.is_err() {
                // The call ended early; its answer says why.
                break;
            }
            if finish {
                break;
            }
        }
        Ok::<(), CtlError>(())
    };
    let call = client.write_file(ReceiverStream::new(rx));
    tokio::pin!(call);
    let fed = tokio::select! {
        r = &mut call => return Ok(r?.bytes_written),
        fed = feed => fed,
    };
    match fed {
        Ok(()) => {
            drop(tx);
            Ok(call.await?.bytes_written)
        }
        Err(e) => {
            // Fail the upload (a dropped call would read as a clean end: a short file), and
            // let the reset go out before returning.
            let _ = tx.send(Upload::Abort(e.to_string())).await;
            drop(tx);
            let _ = tokio::time::timeout(Duration::from_secs(10), call).await;
            Err(e)
        }
    }
}

/// Where a download lands: into a directory under the remote file's name.
fn download_target(local: &Path, remote: &str) -> PathBuf {
    if local.is_dir() {
        let name = Path::new(remote).file_name().map(|n| n.to_os_string()).unwrap_or_else(|| "download".into());
        local.join(name)
    } else {
        local.to_path_buf()
    }
}

async fn download(client: &Client, req: pb::ReadFileRequest, dst: Place) -> Result<u64, CtlError> {
    let remote = req.path.clone();
    let mut stream = client.read_file(req).await?;
    let (mut w, paths): (Box<dyn AsyncWrite + Unpin + Send>, Option<(PathBuf, PathBuf)>) = match dst {
        Place::Std => (Box::new(tokio::io::stdout()), None),
        Place::Local(p) => {
            let target = download_target(&p, &remote);
            let name = target.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
            let tmp = target.with_file_name(format!(".{name}.opendsec-part"));
            let f =
                tokio::fs::File::create(&tmp).await.map_err(local_err(format!("cannot create {}", tmp.display())))?;
            (Box::new(f), Some((tmp, target)))
        }
        Place::Remote { .. } => unreachable!("cp checked that the destination is local"),
    };
    let copied = async {
        let mut written = 0u64;
        while let Some(c) = stream.message().await.map_err(|s| CtlError::Api(ApiError::from_status(&s)))? {
            // The agent's answers are data: a gap or overlap would corrupt the copy.
            if c.offset != written {
                return Err(CtlError::Api(ApiError::internal(format!(
                    "file chunk at offset {}, expected {written}",
                    c.offset
                ))));
            }
            w.write_all(&c.data).await.map_err(local_err("writing the copy failed"))?;
            written += c.data.len() as u64;
        }
        w.flush().await.map_err(local_err("writing the copy failed"))?;
        Ok(written)
    }
    .await;
    drop(w);
    match (copied, paths) {
        (Ok(n), Some((tmp, target))) => {
            tokio::fs::rename(&tmp, &target)
                .await
                .map_err(local_err(format!("cannot rename to {}", target.display())))?;
            Ok(n)
        }
        (Ok(n), None) => Ok(n),
        (Err(e), paths) => {
            if let Some((tmp, _)) = paths {
                let _ = tokio::fs::remove_file(&tmp).await;
            }
            Err(e)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ctl::{Cli, Command};
    use clap::Parser;

    fn parse(args: &[&str]) -> Cli {
        Cli::try_parse_from(std::iter::once("opendsecctl").chain(args.iter().copied())).unwrap()
    }

    #[test]
    fn a_place_is_remote_only_with_a_valid_sandbox_id_before_the_colon() {
        assert_eq!(
            parse_place("e1.abc123:/etc/hosts").unwrap(),
            Place::Remote { sandbox: "e1.abc123".into(), path: "/etc/hosts".into() }
        );
        assert_eq!(
            parse_place("e1.abc123:rel/x").unwrap(),
            Place::Remote { sandbox: "e1.abc123".into(), path: "rel/x".into() }
        );
        assert_eq!(parse_place("-").unwrap(), Place::Std);
        assert_eq!(parse_place("./e1.abc:x").unwrap(), Place::Local("./e1.abc:x".into()));
        assert_eq!(parse_place("/tmp/a:b").unwrap(), Place::Local("/tmp/a:b".into()));
        assert_eq!(parse_place("notes.txt").unwrap(), Place::Local("notes.txt".into()));
        assert_eq!(parse_place("C:/x").unwrap(), Place::Local("C:/x".into()), "no dot: not a sandbox id");
        let e = parse_place("e1.abc123:").unwrap_err();
        assert_eq!(crate::ctl::reason_of(&e), Some(Reason::InvalidArgument));
    }

    #[test]
    fn digits_select_a_pid_and_anything_else_a_tag() {
        assert_eq!(selector("42").by, Some(pb::process_selector::By::Pid(42)));
        assert_eq!(selector("web").by, Some(pb::process_selector::By::Tag("web".into())));
        assert_eq!(selector("-1").by, Some(pb::process_selector::By::Tag("-1".into())));
    }

    #[test]
    fn env_pairs_split_at_the_first_equals_sign() {
        let m = kv(&["A=1".into(), "B=x=y".into(), "C=".into()], "env").unwrap();
        assert_eq!(m.get("A").map(String::as_str), Some("1"));
        assert_eq!(m.get("B").map(String::as_str), Some("x=y"));
        assert_eq!(m.get("C").map(String::as_str), Some(""));
        let e = kv(&["NOVALUE".into()], "env").unwrap_err();
        assert_eq!(crate::ctl::reason_of(&e), Some(Reason::InvalidArgument));
    }

    #[test]
    fn a_reattached_stream_writes_only_what_is_new() {
        assert_eq!(fresh_part(0, 0, b"abc"), b"abc");
        assert_eq!(fresh_part(2, 0, b"abc"), b"c");
        assert_eq!(fresh_part(5, 0, b"abc"), b"");
        assert_eq!(fresh_part(3, 3, b"def"), b"def");
        assert_eq!(fresh_part(3, 7, b"xyz"), b"xyz", "a gap (dropped bytes) is written as it is");
    }

    #[test]
    fn remote_exit_codes_map_like_a_shell() {
        assert_eq!(local_exit_code(0, 0), 0);
        assert_eq!(local_exit_code(3, 0), 3);
        assert_eq!(local_exit_code(-1, 9), 137);
        assert_eq!(local_exit_code(-1, 0), 255);
        assert_eq!(local_exit_code(300, 0), 255);
    }

    #[test]
    fn exec_takes_options_then_the_command_after_the_separator() {
        let cli = parse(&[
            "exec",
            "e1.abc",
            "--session",
            "s1",
            "--env",
            "A=1",
            "--env",
            "B=2",
            "--cwd",
            "/tmp",
            "--timeout",
            "5",
            "--",
            "ls",
            "-la",
            "--color",
        ]);
        let Command::Exec(a) = cli.command else { panic!("not exec: {:?}", cli.command) };
        assert_eq!(a.sandbox, "e1.abc");
        assert_eq!(a.session.as_deref(), Some("s1"));
        assert_eq!(a.env, vec!["A=1", "B=2"]);
        assert_eq!(a.cwd.as_deref(), Some("/tmp"));
        assert_eq!(a.timeout, 5);
        assert_eq!(a.command, vec!["ls", "-la", "--color"]);
        assert_eq!(a.command.join(" "), "ls -la --color");

        // Without `--`, everything from the first word of the command on is the command.
        let cli = parse(&["exec", "e1.abc", "echo", "-n", "hi"]);
        let Command::Exec(a) = cli.command else { panic!() };
        assert_eq!(a.command, vec!["echo", "-n", "hi"]);
        assert!(a.session.is_none());

        assert!(Cli::try_parse_from(["opendsecctl", "exec", "e1.abc"]).is_err(), "a command is required");
    }

    #[test]
    fn run_cp_ps_and_kill_parse() {
        let Command::Run(a) = parse(&["run", "e1.abc", "--tag", "web", "--", "python3", "-m", "http.server"]).command
        else {
            panic!()
        };
        assert_eq!((a.tag.as_deref(), a.command.len()), (Some("web"), 3));
        let Command::Cp(a) = parse(&["cp", "./x", "e1.abc:/tmp/x"]).command else { panic!() };
        assert_eq!((a.src.as_str(), a.dst.as_str()), ("./x", "e1.abc:/tmp/x"));
        let Command::Ps { sandbox } = parse(&["ps", "e1.abc", "--json"]).command else { panic!() };
        assert_eq!(sandbox, "e1.abc");
        let Command::Kill(a) = parse(&["kill", "e1.abc", "web", "--signal", "9"]).command else { panic!() };
        assert_eq!((a.process.as_str(), a.signal), ("web", 9));
        let Command::Kill(a) = parse(&["kill", "e1.abc", "42"]).command else { panic!() };
        assert_eq!(a.signal, 15);
    }

    #[test]
    fn sandbox_create_takes_a_backend_and_an_image() {
        let cli = parse(&["sandbox", "create", "--backend", "container", "--image", "library/busybox:1.36"]);
        let Command::Sandbox(crate::ctl::SandboxCmd::Create { spec, .. }) = cli.command else { panic!() };
        let spec = spec.to_spec(Some("root/a")).unwrap();
        assert_eq!((spec.backend.as_str(), spec.image.as_str()), ("container", "library/busybox:1.36"));
    }

    #[test]
    fn sandbox_create_from_a_pool_leaves_the_template_to_the_pool() {
        let cli = parse(&["sandbox", "create", "--pool", "py", "--env", "A=1", "--label", "k=v"]);
        let Command::Sandbox(crate::ctl::SandboxCmd::Create { spec, .. }) = cli.command else { panic!() };
        let spec = spec.to_spec(None).unwrap();
        assert_eq!((spec.pool.as_str(), spec.image.as_str(), spec.backend.as_str()), ("py", "", ""));
        assert!(spec.resources.is_none() && spec.network.is_none());
        assert_eq!((spec.env["A"].as_str(), spec.labels["k"].as_str()), ("1", "v"));
        // What the template fixes cannot be given beside it; without a pool a backend is needed.
        for args in [&["--pool", "py", "--image", "x"][..], &["--pool", "py", "--memory", "64"], &[]] {
            let argv = std::iter::once("opendsecctl").chain(["sandbox", "create"]).chain(args.iter().copied());
            assert!(Cli::try_parse_from(argv).is_err(), "{args:?}");
        }
    }

    #[test]
    fn downloads_into_a_directory_keep_the_remote_name() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(download_target(dir.path(), "/var/log/syslog"), dir.path().join("syslog"));
        let file = dir.path().join("copy");
        assert_eq!(download_target(&file, "/var/log/syslog"), file);
    }

    #[tokio::test]
    async fn read_full_fills_chunks_until_the_end() {
        let data = vec![7u8; 10];
        let mut r: &[u8] = &data;
        let mut buf = [0u8; 4];
        assert_eq!(read_full(&mut r, &mut buf).await.unwrap(), 4);
        assert_eq!(read_full(&mut r, &mut buf).await.unwrap(), 4);
        assert_eq!(read_full(&mut r, &mut buf).await.unwrap(), 2);
        assert_eq!(read_full(&mut r, &mut buf).await.unwrap(), 0);
    }
}
