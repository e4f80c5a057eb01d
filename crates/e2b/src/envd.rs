//! envd, E2B's in-sandbox daemon (reference/e2b-protocol.md section 3), on the `Runtime` API:
//! the process service on aether's process API (outside sessions), the filesystem service on
//! the file calls (through a session per user, so files are made as that user), `/files` and
//! `/health`.
//!
//! - The token of every call is `X-Access-Token`: the caller's key, which the create and
//!   connect answers handed to the SDK as `envdAccessToken`.
//! - The user is the one `Authorization: Basic` names, else the sandbox's default user.
//! - A process outlives its caller's stream (the output lives in the agent); `Connect` re-
//!   attaches and replays the output from the start. `Connect-Timeout-Ms` on `Start` is the
//!   process's lifetime, as envd makes it: the agent kills it then, connected or not.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{HeaderMap, Request};
use axum::response::Response;
use base64::Engine;
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::BodyExt;
use opendsec_common::{ApiError, Reason};
use opendsec_proto::v1 as pb;
use pb::process_selector::By;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::connect::{self, Code, ConnectError, Decoder};
use crate::model::{self, Data, End, EntryInfo, Event, EventMessage, FileKind};
use crate::sandbox::{Ctx, Failure, stat_of, user_path};
use crate::{Gateway, error, files, header};

/// envd's keepalive interval when the caller asks for none.
const DEFAULT_KEEPALIVE: Duration = Duration::from_secs(90);
/// Entries one ListDir answers at most (a deep listing of a huge tree stops there).
const MAX_LIST_ENTRIES: usize = 100_000;
/// Deepest listing.
const MAX_LIST_DEPTH: u32 = 64;

/// The user of `Authorization: Basic base64("<user>:")`.
fn basic_user(h: &HeaderMap) -> Result<String, ConnectError> {
    let Some(v) = header(h, "authorization") else { return Ok(String::new()) };
    let bad = || ConnectError::new(Code::Unauthenticated, "authorization must be Basic base64(\"<user>:\")");
    let b64 = v.strip_prefix("Basic ").or_else(|| v.strip_prefix("basic ")).ok_or_else(bad)?;
    let raw = base64::engine::general_purpose::STANDARD.decode(b64.trim()).map_err(|_| bad())?;
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    let user = text.split(':').next().unwrap_or_default();
    if !crate::sandbox::valid_user(user) {
        return Err(ConnectError::new(Code::Unauthenticated, format!("invalid username: '{user}'")));
    }
    Ok(user.to_string())
}

pub async fn handle(gw: Arc<Gateway>, caller: crate::Caller, id: String, req: Request<Body>) -> Response {
    let h = req.headers();
    let Some(token) = header(h, "x-access-token").map(str::to_string) else {
        return ConnectError::new(
            Code::Unauthenticated,
            "no access token: connect to the sandbox through Sandbox.create or Sandbox.connect",
        )
        .unary_response();
    };
    let user = match basic_user(h) {
        Ok(u) => u,
        Err(e) => return e.unary_response(),
    };
    let client = match gw.client(&token, caller) {
        Ok(c) => c,
        Err(e) => return error::to_connect(&e).unary_response(),
    };
    let ctx = Ctx { gw, client, id, user };
    let path = req.uri().path().to_string();
    match path.as_str() {
        "/health" => files::health(&ctx).await,
        "/files" => files::handle(&ctx, req).await,
        _ => rpc(&ctx, &path, req).await,
    }
}

async fn rpc(ctx: &Ctx, path: &str, req: Request<Body>) -> Response {
    let Some(method) = path.strip_prefix('/') else { return unknown(path) };
    let timeout = header(req.headers(), "connect-timeout-ms").and_then(|v| v.parse::<u64>().ok());
    let keepalive = header(req.headers(), "keepalive-ping-interval")
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(DEFAULT_KEEPALIVE, |s| Duration::from_secs(s.clamp(1, 300)));
    let opts = StreamOpts { timeout: timeout.filter(|t| *t > 0).map(Duration::from_millis), keepalive };
    if method == "process.Process/StreamInput" {
        return stream_input(ctx, req.into_body()).await;
    }
    let body = match read_all(req.into_body()).await {
        Ok(b) => b,
        Err(e) => return e.unary_response(),
    };
    let streaming =
        matches!(method, "process.Process/Start" | "process.Process/Connect" | "filesystem.Filesystem/WatchDir");
    let msg = if streaming {
        // One envelope.
        let mut d = Decoder::default();
        d.push(&body);
        match d.next_frame() {
            Ok(Some(f)) => f.data,
            Ok(None) => return ConnectError::invalid("the request has no message").unary_response(),
            Err(e) => return e.unary_response(),
        }
    } else {
        body
    };
    let r: Result<Response, Failure> = match method {
        "process.Process/Start" => start(ctx, &msg, opts).await,
        "process.Process/Connect" => connect_process(ctx, &msg, opts).await,
        "process.Process/List" => list(ctx).await,
        "process.Process/SendSignal" => send_signal(ctx, &msg).await,
        "process.Process/SendInput" => send_input(ctx, &msg).await,
        "process.Process/CloseStdin" => close_stdin(ctx, &msg).await,
        "process.Process/Update" => update(ctx, &msg).await,
        "filesystem.Filesystem/Stat" => stat(ctx, &msg).await,
        "filesystem.Filesystem/ListDir" => list_dir(ctx, &msg).await,
        "filesystem.Filesystem/MakeDir" => make_dir(ctx, &msg).await,
        "filesystem.Filesystem/Move" => move_entry(ctx, &msg).await,
        "filesystem.Filesystem/Remove" => remove(ctx, &msg).await,
        "filesystem.Filesystem/WatchDir" => watch_dir(ctx, &msg, opts).await,
        "filesystem.Filesystem/CreateWatcher" => create_watcher(ctx, &msg).await,
        "filesystem.Filesystem/GetWatcherEvents" => watcher_events(ctx, &msg).await,
        "filesystem.Filesystem/RemoveWatcher" => remove_watcher(ctx, &msg).await,
        _ => return unknown(path),
    };
    match r {
        Ok(resp) => resp,
        Err(Failure::Connect(e)) => e.unary_response(),
        Err(Failure::Api(e)) => ctx.fail(&e).await,
    }
}

fn unknown(path: &str) -> Response {
    ConnectError::new(Code::Unimplemented, format!("no such method: {path}")).unary_response()
}

type R = Result<Response, Failure>;

async fn read_all(body: Body) -> Result<Bytes, ConnectError> {
    match http_body_util::Limited::new(body, connect::MAX_MESSAGE + 5).collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => Err(ConnectError::new(Code::ResourceExhausted, format!("request body: {e}"))),
    }
}

fn selector(s: Option<model::Selector>) -> Result<pb::ProcessSelector, ConnectError> {
    let s = s.unwrap_or_default();
    let by = match (s.pid, s.tag) {
        (Some(pid), _) => By::Pid(pid),
        (None, Some(tag)) => By::Tag(tag),
        (None, None) => return Err(ConnectError::invalid("process selector (pid or tag) is required")),
    };
    Ok(pb::ProcessSelector { by: Some(by) })
}

/// How close to a stream's timeout a killed process's exit counts as the timeout's.
const TIMEOUT_SLACK: Duration = Duration::from_millis(250);

/// SIGKILL, the signal the agent ends a process past its timeout with.
const SIGKILL: i32 = 9;

#[derive(Clone, Copy)]
struct StreamOpts {
    timeout: Option<Duration>,
    keepalive: Duration,
}

impl StreamOpts {
    /// Resolves when the stream's timeout (counted from now) runs out; never without one.
    fn expiry(&self) -> impl std::future::Future<Output = ()> + use<> {
        let deadline = self.timeout.map(|t| tokio::time::Instant::now() + t);
        async move {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        }
    }
}

async fn start(ctx: &Ctx, msg: &[u8], opts: StreamOpts) -> R {
    let req: model::StartRequest = connect::decode(msg)?;
    let p = req.process.ok_or_else(|| ConnectError::invalid("process is required"))?;
    if p.cmd.is_empty() {
        return Err(ConnectError::invalid("process.cmd is required").into());
    }
    let pty = req.pty.map(|t| {
        let s = t.size.unwrap_or_default();
        pb::PtySize { rows: s.rows, cols: s.cols }
    });
    let is_pty = pty.is_some();
    let start = pb::StartProcessRequest {
        sandbox_id: ctx.id.clone(),
        cmd: std::iter::once(p.cmd).chain(p.args).collect(),
        env: p.envs,
        cwd: p.cwd.unwrap_or_default(),
        user: ctx.user.clone(),
        tag: req.tag.unwrap_or_default(),
        // envd: an absent `stdin` means a pipe (the older SDKs' behaviour).
        no_stdin: !is_pty && req.stdin == Some(false),
        timeout_ms: opts.timeout.map_or(0, |t| t.as_millis() as u64),
        pty,
    };
    let pid = ctx.client.start_process(start).await?.pid;
    let events = ctx
        .client
        .connect_process(pb::ConnectProcessRequest {
            sandbox_id: ctx.id.clone(),
            process: Some(pb::ProcessSelector { by: Some(By::Pid(pid)) }),
            ..Default::default()
        })
        .await?;
    Ok(process_stream(ctx, pid, events, is_pty, opts))
}

async fn connect_process(ctx: &Ctx, msg: &[u8], opts: StreamOpts) -> R {
    let req: model::SelectorRequest = connect::decode(msg)?;
    let sel = selector(req.process)?;
    let info = find(ctx, &sel).await?;
    let events = ctx
        .client
        .connect_process(pb::ConnectProcessRequest {
            sandbox_id: ctx.id.clone(),
            process: Some(pb::ProcessSelector { by: Some(By::Pid(info.pid)) }),
            ..Default::default()
        })
        .await?;
    // A terminal's output comes back as `pty` data, as it went out.
    Ok(process_stream(ctx, info.pid, events, info.pty, StreamOpts { timeout: None, ..opts }))
}

/// The process a selector names (running or kept after its exit), or not_found.
async fn find(ctx: &Ctx, sel: &pb::ProcessSelector) -> Result<pb::ProcessInfo, Failure> {
    let all = ctx.client.list_processes(pb::ListProcessesRequest { sandbox_id: ctx.id.clone() }).await?;
    let hit = all.processes.into_iter().rev().find(|p| match &sel.by {
        Some(By::Pid(pid)) => p.pid == *pid,
        Some(By::Tag(t)) => &p.tag == t,
        None => false,
    });
    hit.ok_or_else(|| {
        let what = match &sel.by {
            Some(By::Pid(pid)) => format!("pid {pid}"),
            Some(By::Tag(t)) => format!("tag {t:?}"),
            None => "no selector".into(),
        };
        Failure::Connect(ConnectError::new(Code::NotFound, format!("process with {what} not found")))
    })
}

/// Start's and Connect's answer: `start`, then data and keepalives, then `end`, then the end
/// of the stream. The caller's disconnect drops the upstream stream only; the process runs on.
///
/// When the sandbox itself ends under the stream (killed, or its time ran out), the
/// connection is broken off, as E2B's is when its sandbox goes: the SDK then finds the
/// sandbox gone and raises its "killed or reached its end of life" timeout.
fn process_stream(
    ctx: &Ctx,
    pid: u32,
    mut events: tonic::Streaming<pb::ProcessEvent>,
    pty: bool,
    opts: StreamOpts,
) -> Response {
    let (client, id) = (ctx.client.clone(), ctx.id.clone());
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(16);
    tokio::spawn(async move {
        let send = |ev: Event| Ok(connect::message(&EventMessage { event: ev }));
        // The sandbox ended under the stream: break the connection off.
        let cut_if_gone = || async {
            if crate::sandbox::sandbox_gone(&client, &id).await {
                let _ =
                    tx.send(Err(std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "the sandbox ended"))).await;
                true
            } else {
                false
            }
        };
        if tx.send(send(Event::Start { pid })).await.is_err() {
            return;
        }
        let deadline = opts.timeout.map(|t| tokio::time::Instant::now() + t);
        let expired = opts.expiry();
        tokio::pin!(expired);
        loop {
            let tick = tokio::time::sleep(opts.keepalive);
            let frame = tokio::select! {
                ev = events.next() => match ev {
                    Some(Ok(pb::ProcessEvent { kind: Some(pb::process_event::Kind::Output(o)) })) => {
                        let data = if pty {
                            Data::Pty(o.data)
                        } else if o.stream == pb::OutputStream::Stderr as i32 {
                            Data::Stderr(o.data)
                        } else {
                            Data::Stdout(o.data)
                        };
                        send(Event::Data(data))
                    }
                    Some(Ok(pb::ProcessEvent { kind: Some(pb::process_event::Kind::Exit(x)) })) => {
                        // Killed by the agent at the stream's timeout (the same instant as
                        // ours, give or take): the caller's timeout, as envd reports it.
                        let at_deadline = deadline.is_some_and(|d| tokio::time::Instant::now() + TIMEOUT_SLACK >= d);
                        if x.signal == SIGKILL && at_deadline {
                            let e = ConnectError::new(Code::DeadlineExceeded, "the process ran past its timeout and was killed");
                            let _ = tx.send(Ok(connect::end_stream(Some(&e)))).await;
                            return;
                        }
                        if x.signal == SIGKILL && cut_if_gone().await {
                            return;
                        }
                        let _ = tx.send(send(Event::End(End::of(x.exit_code, x.signal)))).await;
                        let _ = tx.send(Ok(connect::end_stream(None))).await;
                        return;
                    }
                    Some(Ok(_)) => continue,
                    Some(Err(status)) => {
                        if cut_if_gone().await {
                            return;
                        }
                        let e = error::to_connect(&ApiError::from_status(&status));
                        let _ = tx.send(Ok(connect::end_stream(Some(&e)))).await;
                        return;
                    }
                    None => {
                        if cut_if_gone().await {
                            return;
                        }
                        let e = ConnectError::new(Code::Unavailable, "the process's output ended without its exit");
                        let _ = tx.send(Ok(connect::end_stream(Some(&e)))).await;
                        return;
                    }
                },
                () = &mut expired => {
                    let e = ConnectError::new(Code::DeadlineExceeded, "the process ran past its timeout and was killed");
                    let _ = tx.send(Ok(connect::end_stream(Some(&e)))).await;
                    return;
                }
                () = tick => send(Event::Keepalive {}),
                // The caller left: let go of the upstream stream (the process runs on).
                () = tx.closed() => return,
            };
            if tx.send(frame).await.is_err() {
                return;
            }
        }
    });
    connect::stream_response_fallible(ReceiverStream::new(rx))
}

async fn list(ctx: &Ctx) -> R {
    let all = ctx.client.list_processes(pb::ListProcessesRequest { sandbox_id: ctx.id.clone() }).await?;
    let procs: Vec<_> = all
        .processes
        .into_iter()
        .filter(|p| p.running)
        .map(|p| {
            let mut cmd = p.cmd.into_iter();
            let mut config = json!({
                "cmd": cmd.next().unwrap_or_default(),
                "args": cmd.collect::<Vec<_>>(),
                "envs": p.env,
            });
            if !p.cwd.is_empty() {
                config["cwd"] = json!(p.cwd);
            }
            let mut info = json!({"config": config, "pid": p.pid});
            if !p.tag.is_empty() {
                info["tag"] = json!(p.tag);
            }
            info
        })
        .collect();
    Ok(connect::unary_ok(&json!({"processes": procs})))
}

async fn send_signal(ctx: &Ctx, msg: &[u8]) -> R {
    let req: model::SendSignalRequest = connect::decode(msg)?;
    let signal = match &req.signal {
        Some(serde_json::Value::String(s)) if s == "SIGNAL_SIGKILL" => 9,
        Some(serde_json::Value::String(s)) if s == "SIGNAL_SIGTERM" => 15,
        Some(serde_json::Value::Number(n)) if matches!(n.as_i64(), Some(9 | 15)) => n.as_i64().unwrap_or(9) as i32,
        other => {
            return Err(
                ConnectError::invalid(format!("signal {other:?}: expected SIGNAL_SIGKILL or SIGNAL_SIGTERM")).into()
            );
        }
    };
    let process = Some(selector(req.process)?);
    let req = pb::SignalProcessRequest { sandbox_id: ctx.id.clone(), process, signal };
    if let Err(e) = ctx.client.signal_process(req).await {
        return Err(ctx.not_found_or_gone(e).await);
    }
    Ok(connect::unary_ok(&json!({})))
}

async fn input(ctx: &Ctx, process: Option<model::Selector>, data: Vec<u8>, eof: bool) -> Result<(), Failure> {
    let process = Some(selector(process)?);
    let req = pb::SendInputRequest { sandbox_id: ctx.id.clone(), process, data, eof };
    match ctx.client.send_input(req).await {
        Ok(_) => Ok(()),
        Err(e) => Err(ctx.not_found_or_gone(e).await),
    }
}

async fn send_input(ctx: &Ctx, msg: &[u8]) -> R {
    let req: model::SendInputRequest = connect::decode(msg)?;
    input(ctx, req.process, req.input.unwrap_or_default().bytes(), false).await?;
    Ok(connect::unary_ok(&json!({})))
}

async fn close_stdin(ctx: &Ctx, msg: &[u8]) -> R {
    let req: model::SelectorRequest = connect::decode(msg)?;
    input(ctx, req.process, Vec::new(), true).await?;
    Ok(connect::unary_ok(&json!({})))
}

async fn update(ctx: &Ctx, msg: &[u8]) -> R {
    let req: model::UpdateRequest = connect::decode(msg)?;
    let process = Some(selector(req.process)?);
    let Some(size) = req.pty.and_then(|p| p.size) else {
        return Ok(connect::unary_ok(&json!({})));
    };
    let size = Some(pb::PtySize { rows: size.rows, cols: size.cols });
    ctx.client.resize_process(pb::ResizeProcessRequest { sandbox_id: ctx.id.clone(), process, size }).await?;
    Ok(connect::unary_ok(&json!({})))
}

/// StreamInput: `start` names the process, each `data` is written to its stdin in order; the
/// answer is one empty message and the end of the stream.
async fn stream_input(ctx: &Ctx, body: Body) -> Response {
    let mut body = body.into_data_stream();
    let mut d = Decoder::default();
    let mut process: Option<model::Selector> = None;
    let result: Result<(), Failure> = async {
        loop {
            while let Some(f) = d.next_frame()? {
                if f.flags & connect::END_STREAM != 0 {
                    return Ok(());
                }
                let m: model::StreamInputRequest = connect::decode(&f.data)?;
                if let Some(s) = m.start {
                    process = s.process;
                } else if let Some(data) = m.data {
                    let Some(p) = &process else {
                        return Err(ConnectError::invalid("data before the start message").into());
                    };
                    let sel = model::Selector { pid: p.pid, tag: p.tag.clone() };
                    input(ctx, Some(sel), data.input.unwrap_or_default().bytes(), false).await?;
                }
            }
            match body.next().await {
                Some(Ok(chunk)) => d.push(&chunk),
                Some(Err(e)) => return Err(ConnectError::new(Code::Canceled, format!("request body: {e}")).into()),
                None if d.has_partial() => {
                    return Err(ConnectError::invalid("the request ends inside a message").into());
                }
                None => return Ok(()),
            }
        }
    }
    .await;
    let frames = match result {
        Ok(()) => vec![connect::message(&json!({})), connect::end_stream(None)],
        Err(Failure::Connect(e)) => vec![connect::end_stream(Some(&e))],
        Err(Failure::Api(e)) => {
            if ctx.may_be_gone(&e) && ctx.gone().await {
                return error::sandbox_not_found(&ctx.id);
            }
            vec![connect::end_stream(Some(&error::to_connect(&e)))]
        }
    };
    connect::stream_response(tokio_stream::iter(frames))
}

// ---- filesystem

pub(crate) async fn entry(ctx: &Ctx, info: &pb::FileInfo) -> EntryInfo {
    let names = ctx.gw.names.get(&ctx.client, &ctx.id, &ctx.session()).await;
    entry_with(info, &names)
}

fn entry_with(info: &pb::FileInfo, names: &crate::names::Names) -> EntryInfo {
    let kind = match pb::FileType::try_from(info.r#type).unwrap_or(pb::FileType::Unspecified) {
        pb::FileType::File => FileKind::File,
        pb::FileType::Dir => FileKind::Dir,
        pb::FileType::Symlink => FileKind::Symlink,
        pb::FileType::Other | pb::FileType::Unspecified => FileKind::Other,
    };
    EntryInfo {
        name: info.name.clone(),
        kind: kind.proto_name(),
        path: info.path.clone(),
        size: info.size.to_string(),
        mode: model::go_mode(kind, info.mode),
        permissions: model::go_permissions(kind, info.mode),
        owner: names.user(info.uid),
        group: names.group(info.gid),
        modified_time: model::rfc3339(info.modified_ms),
        symlink_target: (!info.symlink_target.is_empty()).then(|| info.symlink_target.clone()),
        is_symlink: kind == FileKind::Symlink,
        metadata: info
            .xattrs
            .iter()
            .filter_map(|(k, v)| Some((k.strip_prefix(files::METADATA_XATTRS)?.to_string(), v.clone())))
            .collect(),
    }
}

async fn stat(ctx: &Ctx, msg: &[u8]) -> R {
    let req: model::PathRequest = connect::decode(msg)?;
    let info = followed(ctx, stat_of(ctx, &req.path).await?).await;
    Ok(connect::unary_ok(&json!({"entry": entry(ctx, &info).await})))
}

/// A symlink as envd describes it: the type of what it points to and that target's absolute
/// path (a link that points nowhere, or too far, stays a symlink with its own target).
async fn followed(ctx: &Ctx, info: pb::FileInfo) -> pb::FileInfo {
    if info.r#type != pb::FileType::Symlink as i32 || info.symlink_target.is_empty() {
        return info;
    }
    let dir = info.path.rsplit_once('/').map_or("/", |(d, _)| if d.is_empty() { "/" } else { d });
    let target = absolute(dir, &info.symlink_target);
    match stat_of(ctx, &target).await {
        Ok(t) if t.r#type != pb::FileType::Symlink as i32 => {
            pb::FileInfo { r#type: t.r#type, symlink_target: t.path, ..info }
        }
        // A chain of links: envd resolves it whole; one more step is as far as this goes.
        Ok(_) | Err(_) => pb::FileInfo { symlink_target: target, ..info },
    }
}

/// `target` (absolute, or relative to `dir`) with `.` and `..` taken out.
fn absolute(dir: &str, target: &str) -> String {
    let joined = if target.starts_with('/') { target.to_string() } else { format!("{dir}/{target}") };
    let mut parts: Vec<&str> = Vec::new();
    for p in joined.split('/') {
        match p {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            p => parts.push(p),
        }
    }
    format!("/{}", parts.join("/"))
}

async fn list_dir(ctx: &Ctx, msg: &[u8]) -> R {
    let req: model::ListDirRequest = connect::decode(msg)?;
    let depth = req.depth.clamp(1, MAX_LIST_DEPTH);
    let root = stat_of(ctx, &req.path).await?;
    if root.r#type != pb::FileType::Dir as i32 {
        return Err(ConnectError::invalid(format!("path '{}' is not a directory", root.path)).into());
    }
    let names = ctx.gw.names.get(&ctx.client, &ctx.id, &ctx.session()).await;
    let mut out = Vec::new();
    let mut level = vec![root.path.clone()];
    for _ in 0..depth {
        let mut next = Vec::new();
        for dir in level {
            let req = pb::ListDirRequest {
                sandbox_id: ctx.id.clone(),
                session_id: ctx.session(),
                path: dir,
                user: ctx.user.clone(),
                xattrs: true,
            };
            let entries = match ctx.client.list_dir(req).await {
                Ok(r) => r.entries,
                // A subdirectory it may not read: listed, not descended into (as envd).
                Err(e) if e.reason == Reason::PermissionDenied && !out.is_empty() => continue,
                Err(e) => return Err(e.into()),
            };
            for e in entries {
                if e.r#type == pb::FileType::Dir as i32 {
                    next.push(e.path.clone());
                }
                out.push(entry_with(&e, &names));
                if out.len() >= MAX_LIST_ENTRIES {
                    return Ok(listed(out));
                }
            }
        }
        if next.is_empty() {
            break;
        }
        level = next;
    }
    Ok(listed(out))
}

/// A listing in envd's order: a walk of the tree, each directory's entries by name, each
/// directory followed by what is in it.
fn listed(mut out: Vec<EntryInfo>) -> Response {
    walk_order(&mut out);
    connect::unary_ok(&json!({"entries": out}))
}

fn walk_order(entries: &mut [EntryInfo]) {
    entries.sort_by(|a, b| a.path.split('/').cmp(b.path.split('/')));
}

async fn make_dir(ctx: &Ctx, msg: &[u8]) -> R {
    let req: model::PathRequest = connect::decode(msg)?;
    match stat_of(ctx, &req.path).await {
        Ok(i) if i.r#type == pb::FileType::Dir as i32 => {
            return Err(ConnectError::new(Code::AlreadyExists, format!("directory '{}' already exists", i.path)).into());
        }
        Ok(i) => {
            return Err(
                ConnectError::invalid(format!("path '{}' already exists and is not a directory", i.path)).into()
            );
        }
        Err(e) if e.reason == Reason::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    let mk = pb::MakeDirRequest {
        sandbox_id: ctx.id.clone(),
        session_id: ctx.session(),
        path: user_path(&req.path),
        parents: true,
        mode: 0o755,
        user: ctx.user.clone(),
    };
    ctx.client.make_dir(mk).await?;
    let info = stat_of(ctx, &req.path).await?;
    Ok(connect::unary_ok(&json!({"entry": entry(ctx, &info).await})))
}

async fn move_entry(ctx: &Ctx, msg: &[u8]) -> R {
    let req: model::MoveRequest = connect::decode(msg)?;
    let mv = pb::MoveRequest {
        sandbox_id: ctx.id.clone(),
        session_id: ctx.session(),
        from: user_path(&req.source),
        to: user_path(&req.destination),
        user: ctx.user.clone(),
    };
    ctx.client.r#move(mv).await?;
    let info = stat_of(ctx, &req.destination).await?;
    Ok(connect::unary_ok(&json!({"entry": entry(ctx, &info).await})))
}

async fn remove(ctx: &Ctx, msg: &[u8]) -> R {
    let req: model::PathRequest = connect::decode(msg)?;
    let rm = pb::RemoveRequest {
        sandbox_id: ctx.id.clone(),
        session_id: ctx.session(),
        path: user_path(&req.path),
        recursive: true,
        user: ctx.user.clone(),
    };
    match ctx.client.remove(rm).await {
        Ok(_) => {}
        // Removing what is not there succeeds (os.RemoveAll), in a sandbox that is there.
        Err(e) if e.reason == Reason::NotFound && !ctx.gone().await => {}
        Err(e) => return Err(e.into()),
    }
    Ok(connect::unary_ok(&json!({})))
}

// ---- watching

fn event_name(t: i32) -> Option<&'static str> {
    use pb::FileEventType as T;
    Some(match T::try_from(t).ok()? {
        T::Create => "EVENT_TYPE_CREATE",
        T::Write => "EVENT_TYPE_WRITE",
        T::Remove => "EVENT_TYPE_REMOVE",
        T::Rename => "EVENT_TYPE_RENAME",
        T::Chmod => "EVENT_TYPE_CHMOD",
        T::Unspecified => return None,
    })
}

/// An event as envd writes it; with `root`, the entry of what it names (when it still exists).
async fn fs_event(ctx: &Ctx, e: &pb::FileEvent, root: Option<&str>) -> Option<serde_json::Value> {
    let mut v = json!({"name": e.name, "type": event_name(e.r#type)?});
    if let Some(root) = root
        && let Ok(info) = stat_of(ctx, &format!("{}/{}", root.trim_end_matches('/'), e.name)).await
    {
        v["entry"] = serde_json::to_value(entry(ctx, &info).await).unwrap_or_default();
    }
    Some(v)
}

fn watch_request(ctx: &Ctx, m: &model::WatchRequest, path: String) -> pb::WatchDirRequest {
    pb::WatchDirRequest {
        sandbox_id: ctx.id.clone(),
        session_id: ctx.session(),
        path,
        recursive: m.recursive,
        user: ctx.user.clone(),
    }
}

async fn watch_dir(ctx: &Ctx, msg: &[u8], opts: StreamOpts) -> R {
    let m: model::WatchRequest = connect::decode(msg)?;
    // The absolute root (and a clear not_found before the stream starts).
    let root = stat_of(ctx, &m.path).await?;
    if root.r#type != pb::FileType::Dir as i32 {
        return Err(ConnectError::invalid(format!("path '{}' is not a directory", root.path)).into());
    }
    let mut events = ctx.client.watch_dir(watch_request(ctx, &m, root.path.clone())).await?;
    let (tx, rx) = mpsc::channel::<Bytes>(16);
    let ctx = Ctx { gw: ctx.gw.clone(), client: ctx.client.clone(), id: ctx.id.clone(), user: ctx.user.clone() };
    let include = m.include_entry.then_some(root.path);
    tokio::spawn(async move {
        let expired = opts.expiry();
        tokio::pin!(expired);
        loop {
            let tick = tokio::time::sleep(opts.keepalive);
            let frames: Vec<Bytes> = tokio::select! {
                ev = events.next() => match ev {
                    Some(Ok(b)) if b.started => vec![connect::message(&json!({"start": {}}))],
                    Some(Ok(b)) => {
                        let mut out = Vec::with_capacity(b.events.len());
                        for e in &b.events {
                            if let Some(v) = fs_event(&ctx, e, include.as_deref()).await {
                                out.push(connect::message(&json!({"filesystem": v})));
                            }
                        }
                        out
                    }
                    Some(Err(status)) => {
                        let e = error::to_connect(&ApiError::from_status(&status));
                        let _ = tx.send(connect::end_stream(Some(&e))).await;
                        return;
                    }
                    None => {
                        let _ = tx.send(connect::end_stream(None)).await;
                        return;
                    }
                },
                () = &mut expired => {
                    let e = ConnectError::new(Code::DeadlineExceeded, "the watch reached its timeout");
                    let _ = tx.send(connect::end_stream(Some(&e))).await;
                    return;
                }
                () = tick => vec![connect::message(&json!({"keepalive": {}}))],
                () = tx.closed() => return,
            };
            for f in frames {
                if tx.send(f).await.is_err() {
                    return;
                }
            }
        }
    });
    Ok(connect::stream_response(ReceiverStream::new(rx)))
}

/// A polled watcher's id names the directory too (`<agent id>:<root>`), so events can carry
/// entries without the gateway keeping anything.
async fn create_watcher(ctx: &Ctx, msg: &[u8]) -> R {
    let m: model::WatchRequest = connect::decode(msg)?;
    let root = stat_of(ctx, &m.path).await?;
    if root.r#type != pb::FileType::Dir as i32 {
        return Err(ConnectError::invalid(format!("path '{}' is not a directory", root.path)).into());
    }
    let id = ctx.client.create_watcher(watch_request(ctx, &m, root.path.clone())).await?.watcher_id;
    let full = if m.include_entry { format!("{id}:{}", root.path) } else { id };
    Ok(connect::unary_ok(&json!({"watcherId": full})))
}

fn split_watcher(id: &str) -> (&str, Option<&str>) {
    match id.split_once(':') {
        Some((w, root)) => (w, Some(root)),
        None => (id, None),
    }
}

async fn watcher_events(ctx: &Ctx, msg: &[u8]) -> R {
    let m: model::WatcherRequest = connect::decode(msg)?;
    let (id, root) = split_watcher(&m.watcher_id);
    let req = pb::GetWatcherEventsRequest {
        sandbox_id: ctx.id.clone(),
        session_id: ctx.session(),
        watcher_id: id.to_string(),
        user: ctx.user.clone(),
    };
    let got = ctx.client.get_watcher_events(req).await?;
    let mut events = Vec::with_capacity(got.events.len());
    for e in &got.events {
        if let Some(v) = fs_event(ctx, e, root).await {
            events.push(v);
        }
    }
    Ok(connect::unary_ok(&json!({"events": events})))
}

async fn remove_watcher(ctx: &Ctx, msg: &[u8]) -> R {
    let m: model::WatcherRequest = connect::decode(msg)?;
    let (id, _) = split_watcher(&m.watcher_id);
    let req = pb::RemoveWatcherRequest {
        sandbox_id: ctx.id.clone(),
        session_id: ctx.session(),
        watcher_id: id.to_string(),
        user: ctx.user.clone(),
    };
    ctx.client.remove_watcher(req).await?;
    Ok(connect::unary_ok(&json!({})))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn basic_auth_names_the_user() {
        let mut h = HeaderMap::new();
        assert_eq!(basic_user(&h).unwrap(), "");
        h.insert("authorization", "Basic cm9vdDo=".parse().unwrap());
        assert_eq!(basic_user(&h).unwrap(), "root");
        h.insert("authorization", "Basic Li4vZXRjOg==".parse().unwrap()); // "../etc:"
        assert_eq!(basic_user(&h).unwrap_err().code, Code::Unauthenticated);
        h.insert("authorization", "Bearer x".parse().unwrap());
        assert!(basic_user(&h).is_err());
    }

    #[test]
    fn link_targets_are_made_absolute() {
        assert_eq!(absolute("/home/user/d", "test.txt"), "/home/user/d/test.txt");
        assert_eq!(absolute("/home/user/d", "../x/./y"), "/home/user/x/y");
        assert_eq!(absolute("/a", "/etc/passwd"), "/etc/passwd");
        assert_eq!(absolute("/", "../../.."), "/");
    }

    #[test]
    fn listings_walk_the_tree_in_name_order() {
        let e = |p: &str| EntryInfo {
            name: p.rsplit('/').next().unwrap().into(),
            kind: "file",
            path: p.into(),
            size: "0".into(),
            mode: 0,
            permissions: String::new(),
            owner: String::new(),
            group: String::new(),
            modified_time: String::new(),
            symlink_target: None,
            is_symlink: false,
            metadata: Default::default(),
        };
        let mut v = [e("/d/subdir2"), e("/d/a-b"), e("/d/subdir1/x"), e("/d/a"), e("/d/a/z"), e("/d/subdir1")];
        walk_order(&mut v);
        let order: Vec<&str> = v.iter().map(|x| x.path.as_str()).collect();
        assert_eq!(order, ["/d/a", "/d/a/z", "/d/a-b", "/d/subdir1", "/d/subdir1/x", "/d/subdir2"]);
    }
}
