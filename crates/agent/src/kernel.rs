//! Code contexts: python runs in a Jupyter kernel (the image's `ipykernel`, one process per
//! context, spoken to over ZeroMQ with Jupyter's messaging protocol, v5), bash in a shell
//! session of its own (see aether).
//!
//! A kernel listens on loopback ports of the sandbox, its messages signed with a key only
//! the agent and the kernel know (its connection file is the kernel user's, mode 0600). One
//! run at a time per kernel; a run past its timeout is interrupted (SIGINT), as Jupyter's
//! interrupt does.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use bytes::Bytes;
use hmac::{KeyInit, Mac};
use opendsec_proto::v1::{CodeError, CodeEvent, CodeOutput, CodeResult, code_event};
use serde_json::{Value, json};
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::error::AgentError;
use crate::passwd::User;
use crate::reaper::Reaper;

const DELIM: &[u8] = b"<IDS|MSG>";
/// How long a kernel may take to answer its first request.
const START_TIMEOUT: Duration = Duration::from_secs(60);
/// After an interrupt, how long the kernel has to go idle before it is restarted.
const INTERRUPT_GRACE: Duration = Duration::from_secs(5);

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

fn kernel_err(msg: impl Into<String>) -> AgentError {
    AgentError::Kernel(msg.into())
}

fn new_id() -> String {
    format!("{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>())
}

/// One Jupyter kernel process and the agent's sockets to it.
pub struct Kernel {
    pub pid: u32,
    /// True until the kernel process is reaped (its pid may be another's afterwards).
    alive: tokio::sync::watch::Receiver<bool>,
    key: Vec<u8>,
    session: String,
    shell: zeromq::DealerSocket,
    iopub: zeromq::SubSocket,
    control: zeromq::DealerSocket,
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Kernel").field("pid", &self.pid).finish_non_exhaustive()
    }
}

/// A kernel's pid and whether it still lives.
#[derive(Debug, Clone)]
pub struct KernelHandle {
    pid: u32,
    alive: tokio::sync::watch::Receiver<bool>,
}

impl KernelHandle {
    /// Kills the kernel's whole tree, unless it is already gone (its pid may be another
    /// process's by now).
    pub async fn kill(&self) {
        if !*self.alive.borrow() {
            return;
        }
        let pid = self.pid as i32;
        let _ = tokio::task::spawn_blocking(move || crate::reaper::kill_tree(pid, true)).await;
    }
}

/// A message read off a socket: its header, parent header and content.
#[derive(Debug)]
struct Msg {
    msg_type: String,
    parent_id: String,
    content: Value,
}

fn free_ports(n: usize) -> std::io::Result<Vec<u16>> {
    // Held together so they differ, released just before the kernel binds them.
    let ls: Vec<std::net::TcpListener> =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0")).collect::<Result<_, _>>()?;
    ls.iter().map(|l| l.local_addr().map(|a| a.port())).collect()
}

impl Kernel {
    /// Starts `python3 -m ipykernel_launcher` as `user` in `cwd` and waits until it answers.
    pub async fn start(
        reaper: &Reaper,
        dir: &Path,
        user: &User,
        cwd: &Path,
        env: &[(String, String)],
    ) -> Result<Kernel, AgentError> {
        // A fresh directory each start: the last kernel's user may have left anything in the
        // old one (a symlink where a file goes). Made and filled by root, given to the user
        // last; files are created new, never opened through a link.
        match std::fs::remove_dir_all(dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(AgentError::fs("remove", dir, e)),
        }
        if let Some(parent) = dir.parent() {
            std::fs::create_dir_all(parent).map_err(|e| AgentError::fs("mkdir", parent, e))?;
        }
        {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new().mode(0o700).create(dir).map_err(|e| AgentError::fs("mkdir", dir, e))?;
        }
        let ports = free_ports(5).map_err(|e| kernel_err(format!("no free loopback port: {e}")))?;
        let key = new_id();
        let conn = json!({
            "shell_port": ports[0], "iopub_port": ports[1], "stdin_port": ports[2],
            "control_port": ports[3], "hb_port": ports[4], "ip": "127.0.0.1", "key": key,
            "transport": "tcp", "signature_scheme": "hmac-sha256", "kernel_name": "python3",
        });
        let file = dir.join("kernel.json");
        {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc_o_nofollow())
                .open(&file)
                .map_err(|e| AgentError::fs("write", &file, e))?;
            f.write_all(conn.to_string().as_bytes()).map_err(|e| AgentError::fs("write", &file, e))?;
            std::os::unix::fs::fchown(&f, Some(user.uid), Some(user.gid))
                .map_err(|e| AgentError::fs("chown", &file, e))?;
        }
        let log_path = dir.join("kernel.log");
        let log = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc_o_nofollow())
                .open(&log_path)
                .map_err(|e| AgentError::fs("create", &log_path, e))?
        };
        std::os::unix::fs::fchown(&log, Some(user.uid), Some(user.gid))
            .map_err(|e| AgentError::fs("chown", &log_path, e))?;
        std::os::unix::fs::chown(dir, Some(user.uid), Some(user.gid)).map_err(|e| AgentError::fs("chown", dir, e))?;
        let mut c = std::process::Command::new("python3");
        c.args(["-m", "ipykernel_launcher", "-f"]).arg(&file);
        crate::passwd::user_env(&mut c, user, env);
        // Figures come back as PNG results, as E2B's do.
        c.env("MPLBACKEND", "module://matplotlib_inline.backend_inline")
            .stdin(std::process::Stdio::null())
            .stdout(log.try_clone().map_err(|e| AgentError::fs("dup", &log_path, e))?)
            .stderr(log);
        {
            use std::os::unix::process::CommandExt;
            c.process_group(0);
        }
        crate::passwd::run_as(&mut c, user, Some(cwd.to_path_buf()));
        let child = reaper
            .spawn(&mut c)
            .map_err(|e| AgentError::Spawn { what: "python3 -m ipykernel_launcher".into(), source: e })?;
        let pid = child.id();
        let exited = reaper.wait_for(pid);
        let (alive_tx, alive) = tokio::sync::watch::channel(true);
        tokio::spawn(async move {
            let _ = exited.await;
            let _ = alive_tx.send(false);
        });
        let mut gone = alive.clone();
        let endpoint = |p: u16| format!("tcp://127.0.0.1:{p}");
        let mut k = Kernel {
            pid,
            alive,
            key: key.into_bytes(),
            session: new_id(),
            shell: zeromq::DealerSocket::new(),
            iopub: zeromq::SubSocket::new(),
            control: zeromq::DealerSocket::new(),
        };
        let ready = async {
            // The kernel binds its ports some time after it starts: connect until it has.
            loop {
                if k.shell.connect(&endpoint(ports[0])).await.is_ok() {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            k.iopub.connect(&endpoint(ports[1])).await.map_err(|e| kernel_err(format!("iopub: {e}")))?;
            k.iopub.subscribe("").await.map_err(|e| kernel_err(format!("iopub: {e}")))?;
            k.control.connect(&endpoint(ports[3])).await.map_err(|e| kernel_err(format!("control: {e}")))?;
            // Until a status message of ours arrives on iopub, the subscription may not be in
            // place yet (a late subscriber misses what was published before).
            loop {
                let id = k.send_shell("kernel_info_request", json!({})).await?;
                let until = Instant::now() + Duration::from_millis(500);
                while let Some(m) = k.recv_iopub_until(until).await? {
                    if m.parent_id == id {
                        return Ok::<(), AgentError>(());
                    }
                }
            }
        };
        let started = tokio::select! {
            r = tokio::time::timeout(START_TIMEOUT, ready) => r.unwrap_or_else(|_| Err(kernel_err("the kernel did not answer within 60 s"))),
            _ = gone.wait_for(|a| !*a) => Err(kernel_err("the kernel exited")),
        };
        if let Err(e) = started {
            k.kill().await;
            let tail = std::fs::read(&log_path).map(|b| crate::tail_text(&b, 800)).unwrap_or_default();
            return Err(kernel_err(format!("{e}: is ipykernel installed in the image? {tail}")));
        }
        // Drain the shell replies of the readiness probes.
        for _ in 0..1000 {
            if !matches!(tokio::time::timeout(Duration::from_millis(20), k.shell.recv()).await, Ok(Ok(_))) {
                break;
            }
        }
        Ok(k)
    }

    pub fn is_alive(&self) -> bool {
        *self.alive.borrow()
    }

    /// What kills the kernel without holding it (a run may hold it).
    pub fn handle(&self) -> KernelHandle {
        KernelHandle { pid: self.pid, alive: self.alive.clone() }
    }

    pub async fn kill(&self) {
        self.handle().kill().await;
    }

    fn sign(&self, parts: &[&[u8]]) -> String {
        let mut mac = <HmacSha256 as KeyInit>::new_from_slice(&self.key).expect("any key length");
        for p in parts {
            mac.update(p);
        }
        mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    fn frames(&self, msg_type: &str, content: Value) -> (String, ZmqMessage) {
        let id = new_id();
        let header = json!({
            "msg_id": id, "msg_type": msg_type, "session": self.session, "username": "opendsec",
            "version": "5.3", "date": crate::rfc3339_now(),
        })
        .to_string();
        let (parent, meta, content) = ("{}".to_string(), "{}".to_string(), content.to_string());
        let sig = self.sign(&[header.as_bytes(), parent.as_bytes(), meta.as_bytes(), content.as_bytes()]);
        let parts: Vec<Bytes> = vec![
            Bytes::from_static(DELIM),
            Bytes::from(sig),
            Bytes::from(header),
            Bytes::from(parent),
            Bytes::from(meta),
            Bytes::from(content),
        ];
        (id, ZmqMessage::try_from(parts).expect("six frames"))
    }

    async fn send_shell(&mut self, msg_type: &str, content: Value) -> Result<String, AgentError> {
        let (id, m) = self.frames(msg_type, content);
        self.shell.send(m).await.map_err(|e| kernel_err(format!("shell: {e}")))?;
        Ok(id)
    }

    /// Whether `sig` (hex) signs `parts`, compared in constant time.
    fn verify(&self, sig: &[u8], parts: &[&[u8]]) -> bool {
        let Some(bytes) = sig
            .len()
            .is_multiple_of(2)
            .then(|| {
                sig.chunks(2)
                    .map(|h| std::str::from_utf8(h).ok().and_then(|h| u8::from_str_radix(h, 16).ok()))
                    .collect::<Option<Vec<u8>>>()
            })
            .flatten()
        else {
            return false;
        };
        let mut mac = <HmacSha256 as KeyInit>::new_from_slice(&self.key).expect("any key length");
        for p in parts {
            mac.update(p);
        }
        mac.verify_slice(&bytes).is_ok()
    }

    /// Parses (and checks the signature of) a received message.
    fn parse(&self, m: ZmqMessage) -> Option<Msg> {
        let frames = m.into_vec();
        let at = frames.iter().position(|f| f.as_ref() == DELIM)?;
        let rest = &frames[at + 1..];
        if rest.len() < 5 {
            return None;
        }
        if !self.verify(&rest[0], &[&rest[1], &rest[2], &rest[3], &rest[4]]) {
            return None;
        }
        let header: Value = serde_json::from_slice(&rest[1]).ok()?;
        let parent: Value = serde_json::from_slice(&rest[2]).ok()?;
        Some(Msg {
            msg_type: header["msg_type"].as_str().unwrap_or_default().to_string(),
            parent_id: parent["msg_id"].as_str().unwrap_or_default().to_string(),
            content: serde_json::from_slice(&rest[4]).ok()?,
        })
    }

    async fn recv_iopub_until(&mut self, until: Instant) -> Result<Option<Msg>, AgentError> {
        loop {
            let left = until.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.iopub.recv()).await {
                Err(_) => return Ok(None),
                Ok(Err(e)) => return Err(kernel_err(format!("iopub: {e}"))),
                Ok(Ok(m)) => {
                    if let Some(m) = self.parse(m) {
                        return Ok(Some(m));
                    }
                }
            }
        }
    }

    /// Runs `code`, sending its events to `tx` as they come; past `timeout` the kernel is
    /// interrupted. `Ok(false)`: it did not go idle after the interrupt (restart it).
    pub async fn execute(
        &mut self,
        code: &str,
        silent: bool,
        timeout: Option<Duration>,
        tx: &mpsc::Sender<Result<CodeEvent, tonic::Status>>,
    ) -> Result<bool, AgentError> {
        let content = json!({
            "code": code, "silent": silent, "store_history": !silent, "user_expressions": {},
            "allow_stdin": false, "stop_on_error": true,
        });
        let id = self.send_shell("execute_request", content).await?;
        let far = Instant::now() + Duration::from_secs(365 * 24 * 3600);
        let mut deadline = timeout.map_or(far, |t| Instant::now() + t);
        let mut interrupted = false;
        loop {
            // A caller that went away interrupts the run as its timeout would.
            let mut alive = self.alive.clone();
            let got = tokio::select! {
                m = self.recv_iopub_until(deadline) => m?,
                () = tx.closed(), if !interrupted && !silent => None,
                // Killed (a restart, a removal) or dead: this run is over, the kernel too.
                _ = alive.wait_for(|a| !*a) => return Ok(false),
            };
            let Some(m) = got else {
                if interrupted {
                    return Ok(false);
                }
                // Interrupt, as Jupyter does (SIGINT to the kernel), then wait for it to idle.
                if self.is_alive()
                    && let Some(p) = rustix::process::Pid::from_raw(self.pid as i32)
                {
                    let _ = rustix::process::kill_process(p, rustix::process::Signal::INT);
                }
                interrupted = true;
                deadline = Instant::now() + INTERRUPT_GRACE;
                let _ = tx
                    .send(Err(tonic::Status::deadline_exceeded(format!(
                        "the code ran past its timeout ({} ms) and was interrupted",
                        timeout.unwrap_or_default().as_millis()
                    ))))
                    .await;
                continue;
            };
            if m.parent_id != id {
                continue;
            }
            let ev = match m.msg_type.as_str() {
                "status" if m.content["execution_state"] == "idle" => break,
                "stream" => Some(code_event::Kind::Output(CodeOutput {
                    stderr: m.content["name"] == "stderr",
                    text: m.content["text"].as_str().unwrap_or_default().to_string(),
                    at_ms: crate::now_ms(),
                })),
                "execute_input" => {
                    m.content["execution_count"].as_u64().map(|n| code_event::Kind::ExecutionCount(n as u32))
                }
                "execute_result" | "display_data" => Some(code_event::Kind::Result(CodeResult {
                    data_json: m.content["data"].to_string(),
                    main: m.msg_type == "execute_result",
                })),
                "error" => {
                    let tb: Vec<&str> = m.content["traceback"]
                        .as_array()
                        .map(|a| a.iter().filter_map(Value::as_str).collect())
                        .unwrap_or_default();
                    Some(code_event::Kind::Error(CodeError {
                        name: m.content["ename"].as_str().unwrap_or_default().to_string(),
                        value: m.content["evalue"].as_str().unwrap_or_default().to_string(),
                        traceback: tb.join("\n"),
                    }))
                }
                _ => None,
            };
            // A caller that left: the run goes on to its end, its output unread.
            if let Some(kind) = ev
                && !interrupted
                && !silent
            {
                let _ = tx.send(Ok(CodeEvent { kind: Some(kind) })).await;
            }
        }
        // Its reply on the shell socket, so the next run reads its own.
        for _ in 0..1000 {
            match tokio::time::timeout(Duration::from_secs(5), self.shell.recv()).await {
                Ok(Ok(r)) => {
                    if self.parse(r).is_some_and(|m| m.parent_id == id) {
                        break;
                    }
                }
                _ => break,
            }
        }
        Ok(true)
    }

    /// Asks the kernel to end, then makes sure (the whole group).
    pub async fn shutdown(mut self) {
        let (_, m) = self.frames("shutdown_request", json!({"restart": false}));
        let _ = tokio::time::timeout(Duration::from_millis(500), self.control.send(m)).await;
        self.kill().await;
    }
}

fn libc_o_nofollow() -> i32 {
    rustix::fs::OFlags::NOFOLLOW.bits() as i32
}

/// The code that sets `env` for one run and the code that puts the old values back.
pub fn env_wrappers(env: &HashMap<String, String>) -> Option<(String, String)> {
    if env.is_empty() {
        return None;
    }
    // A JSON string literal is a Python string literal too.
    let vars = serde_json::to_string(&serde_json::to_string(env).ok()?).ok()?;
    let set = format!(
        "import os as __od_os, json as __od_json\n__od_env = __od_json.loads({vars})\n__od_saved = {{k: __od_os.environ.get(k) for k in __od_env}}\n__od_os.environ.update(__od_env)\n"
    );
    let reset = "for __od_k, __od_v in __od_saved.items():\n    if __od_v is None:\n        __od_os.environ.pop(__od_k, None)\n    else:\n        __od_os.environ[__od_k] = __od_v\n".to_string();
    Some((set, reset))
}

/// Where the kernels' files live (their connection files among them).
pub fn kernels_dir(state_dir: &Path) -> PathBuf {
    state_dir.join("kernels")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_wrappers_quote_any_value() {
        let env = HashMap::from([("A".to_string(), "x\"'\n\\y".to_string())]);
        let (set, reset) = env_wrappers(&env).unwrap();
        assert!(set.contains("__od_os.environ.update"));
        assert!(reset.contains("__od_saved"));
        assert!(env_wrappers(&HashMap::new()).is_none());
    }
}
