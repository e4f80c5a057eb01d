//! A small typed client of QEMU's machine protocol (QMP): JSON objects, one per line, over
//! the VM's unix socket. The greeting is read, capabilities negotiated, then each command is
//! sent and its answer awaited; events that arrive in between are skipped (nothing here
//! waits on one).
//!
//! QMP answers come from the QEMU process the edge started (not from the guest), but are still
//! read bounded: a line longer than [`MAX_LINE`] ends the connection.

use std::path::Path;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::UnixStream;
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};

/// Longest QMP line read.
pub const MAX_LINE: usize = 1 << 20;
/// Longest a command may take to answer.
const ANSWER_WAIT: Duration = Duration::from_secs(30);

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("QMP I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("QMP: {0}")]
    Protocol(String),
    /// QEMU refused the command: its error class and description.
    #[error("QMP {command}: {class}: {desc}")]
    Command { command: String, class: String, desc: String },
}

/// A QMP connection.
#[derive(Debug)]
pub struct Qmp {
    read: BufReader<OwnedReadHalf>,
    write: OwnedWriteHalf,
}

impl Qmp {
    /// Connects to the QMP socket at `path` and negotiates capabilities.
    pub async fn connect(path: &Path) -> Result<Qmp, QmpError> {
        let s = UnixStream::connect(path).await?;
        let (r, w) = s.into_split();
        let mut q = Qmp { read: BufReader::new(r), write: w };
        let greeting = tokio::time::timeout(ANSWER_WAIT, q.line())
            .await
            .map_err(|_| QmpError::Protocol("no greeting".into()))??;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol("the first line is not a QMP greeting".into()));
        }
        q.execute("qmp_capabilities", None).await?;
        Ok(q)
    }

    async fn line(&mut self) -> Result<Value, QmpError> {
        let mut buf = Vec::new();
        let n = (&mut self.read).take(MAX_LINE as u64 + 1).read_until(b'\n', &mut buf).await?;
        if n == 0 {
            return Err(QmpError::Protocol("QEMU closed the connection".into()));
        }
        if buf.last() != Some(&b'\n') {
            return Err(QmpError::Protocol(format!("a line longer than {MAX_LINE} bytes")));
        }
        serde_json::from_slice(&buf).map_err(|e| QmpError::Protocol(format!("not JSON: {e}")))
    }

    /// Runs `command` with `arguments`; returns its `return` value.
    pub async fn execute(&mut self, command: &str, arguments: Option<Value>) -> Result<Value, QmpError> {
        let mut msg = json!({ "execute": command });
        if let Some(a) = arguments {
            msg["arguments"] = a;
        }
        let mut out = serde_json::to_vec(&msg).map_err(|e| QmpError::Protocol(e.to_string()))?;
        out.push(b'\n');
        self.write.write_all(&out).await?;
        self.answer(command).await
    }

    /// The answer to `command`, just sent; events before it are skipped.
    async fn answer(&mut self, command: &str) -> Result<Value, QmpError> {
        let answer = async {
            loop {
                let v = self.line().await?;
                if v.get("event").is_some() {
                    continue;
                }
                if let Some(r) = v.get("return") {
                    return Ok(r.clone());
                }
                if let Some(e) = v.get("error") {
                    return Err(QmpError::Command {
                        command: command.to_string(),
                        class: e["class"].as_str().unwrap_or("").to_string(),
                        desc: e["desc"].as_str().unwrap_or("").to_string(),
                    });
                }
                return Err(QmpError::Protocol("a message that is no answer, error or event".into()));
            }
        };
        tokio::time::timeout(ANSWER_WAIT, answer)
            .await
            .map_err(|_| QmpError::Protocol(format!("{command} got no answer within {} s", ANSWER_WAIT.as_secs())))?
    }

    /// Hands QEMU the file descriptor `fd` under `name` (`getfd`, the descriptor sent beside
    /// the command with SCM_RIGHTS), for commands that take `fd:<name>`: a confined QEMU can
    /// open no file of its own.
    pub async fn getfd(&mut self, name: &str, fd: std::os::fd::BorrowedFd<'_>) -> Result<(), QmpError> {
        use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags, sendmsg};
        let mut out = serde_json::to_vec(&json!({ "execute": "getfd", "arguments": { "fdname": name } }))
            .map_err(|e| QmpError::Protocol(e.to_string()))?;
        out.push(b'\n');
        let stream: &UnixStream = self.write.as_ref();
        let mut sent = 0;
        while sent < out.len() {
            stream.writable().await?;
            let n = stream.try_io(tokio::io::Interest::WRITABLE, || {
                let fds = [fd];
                let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
                let mut anc = SendAncillaryBuffer::new(&mut space);
                // The descriptor rides with the first byte only.
                if sent == 0 {
                    anc.push(SendAncillaryMessage::ScmRights(&fds));
                }
                sendmsg(stream, &[std::io::IoSlice::new(&out[sent..])], &mut anc, SendFlags::NOSIGNAL)
                    .map_err(std::io::Error::from)
            });
            match n {
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e.into()),
            }
        }
        self.answer("getfd").await.map(drop)
    }

    /// Makes migrations leave out RAM that is mapped shared (`x-ignore-shared`): a VM's
    /// memory is its own file, so a saved state (a pause's, a snapshot's) never carries it.
    /// Both ends of one stream must agree.
    pub async fn ignore_shared(&mut self) -> Result<(), QmpError> {
        self.execute(
            "migrate-set-capabilities",
            Some(json!({"capabilities": [{"capability": "x-ignore-shared", "state": true}]})),
        )
        .await
        .map(drop)
    }

    /// The VM's run state (`running`, `paused`, `inmigrate`, `postmigrate`, ...).
    pub async fn status(&mut self) -> Result<String, QmpError> {
        let v = self.execute("query-status", None).await?;
        Ok(v["status"].as_str().unwrap_or("").to_string())
    }

    /// Stops the vCPUs (memory stays).
    pub async fn stop(&mut self) -> Result<(), QmpError> {
        self.execute("stop", None).await.map(drop)
    }

    /// Lets the vCPUs run again.
    pub async fn cont(&mut self) -> Result<(), QmpError> {
        self.execute("cont", None).await.map(drop)
    }

    /// Ends QEMU.
    pub async fn quit(&mut self) -> Result<(), QmpError> {
        match self.execute("quit", None).await {
            // QEMU may close the socket before its answer arrives.
            Err(QmpError::Protocol(_)) | Ok(_) => Ok(()),
            Err(e) => Err(e),
        }
    }

    /// Reads up to `size` bytes of the ring buffer chardev `id` (the guest's console).
    pub async fn ringbuf_read(&mut self, id: &str, size: u64) -> Result<String, QmpError> {
        let v = self.execute("ringbuf-read", Some(json!({ "device": id, "size": size, "format": "utf8" }))).await?;
        Ok(v.as_str().unwrap_or("").to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A QMP peer: the greeting, then canned answers per command, an event in between.
    async fn peer(path: std::path::PathBuf) {
        let l = tokio::net::UnixListener::bind(&path).unwrap();
        let (s, _) = l.accept().await.unwrap();
        let (r, mut w) = s.into_split();
        w.write_all(b"{\"QMP\": {\"version\": {\"qemu\": {\"micro\": 22, \"minor\": 2, \"major\": 7}}, \"capabilities\": []}}\n")
            .await
            .unwrap();
        let mut lines = BufReader::new(r).lines();
        while let Some(l) = lines.next_line().await.unwrap() {
            let v: Value = serde_json::from_str(&l).unwrap();
            let answer = match v["execute"].as_str().unwrap() {
                "qmp_capabilities" => "{\"return\": {}}\n".to_string(),
                "query-status" => {
                    "{\"event\": \"STOP\", \"data\": {}}\n{\"return\": {\"status\": \"paused\", \"running\": false}}\n"
                        .to_string()
                }
                "nope" => "{\"error\": {\"class\": \"CommandNotFound\", \"desc\": \"no nope\"}}\n".to_string(),
                "big" => format!("{{\"return\": \"{}\"}}\n", "x".repeat(MAX_LINE + 10)),
                _ => "{\"return\": {}}\n".to_string(),
            };
            w.write_all(answer.as_bytes()).await.unwrap();
        }
    }

    #[tokio::test]
    async fn commands_answers_errors_and_events() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("qmp.sock");
        tokio::spawn(peer(path.clone()));
        let mut q = loop {
            match Qmp::connect(&path).await {
                Ok(q) => break q,
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        };
        // The event the peer sends before its answer is skipped.
        assert_eq!(q.status().await.unwrap(), "paused");
        match q.execute("nope", None).await {
            Err(QmpError::Command { class, .. }) => assert_eq!(class, "CommandNotFound"),
            other => panic!("{other:?}"),
        }
        // An oversized line ends the connection instead of growing without bound.
        assert!(matches!(q.execute("big", None).await, Err(QmpError::Protocol(_))));
        let _ = q.read.read_u8().await;
    }
}
