//! The audit log: one JSON line per public call (reference section 1, "Audit").
//!
//! Handlers hand a [`AuditRecord`] to [`AuditLog::write`], which waits when the bounded channel
//! is full (lines are never dropped to keep up); one writer thread appends them to the file and
//! rotates it by size: `<path>.1` is the newest rotated file, `<path>.<keep>` the oldest kept.
//! Records carry principals, projects and sandbox ids, never a token.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::Serialize;
use tokio::sync::mpsc;

/// Lines buffered between handlers and the writer.
const CHANNEL_CAPACITY: usize = 4096;
/// After writing what was queued, the writer lets lines gather this long before it looks
/// again, rather than being woken for each line: at thousands of calls a second, a wake per
/// line cost more than the line. Lines reach the file at most this much later.
const GATHER: std::time::Duration = std::time::Duration::from_millis(5);

#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AuditRecord {
    pub ts_ms: i64,
    pub method: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub project: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sandbox_id: Option<String>,
    /// "ok" or the error reason.
    pub reason: &'static str,
    pub duration_ms: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub count: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failed: Option<u32>,
}

#[derive(Debug, thiserror::Error)]
pub enum AuditError {
    #[error("failed to create audit directory {path}: {source}")]
    CreateDir { path: PathBuf, source: std::io::Error },
    #[error("failed to open audit log {path}: {source}")]
    Open { path: PathBuf, source: std::io::Error },
    #[error("failed to write audit log {path}: {source}")]
    Write { path: PathBuf, source: std::io::Error },
    #[error("failed to rotate audit log {path}: {source}")]
    Rotate { path: PathBuf, source: std::io::Error },
}

/// The file side: appends lines, rotating past `max_bytes`.
#[derive(Debug)]
pub struct AuditWriter {
    path: PathBuf,
    max_bytes: u64,
    keep: u32,
    file: BufWriter<File>,
    size: u64,
}

fn rotated(path: &Path, n: u32) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".{n}"));
    PathBuf::from(s)
}

fn open_append(path: &Path) -> Result<(BufWriter<File>, u64), AuditError> {
    let f = opendsec_common::fsperm::private_file()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|source| AuditError::Open { path: path.to_path_buf(), source })?;
    let size = f.metadata().map_err(|source| AuditError::Open { path: path.to_path_buf(), source })?.len();
    Ok((BufWriter::new(f), size))
}

impl AuditWriter {
    pub fn open(path: &Path, max_bytes: u64, keep: u32) -> Result<AuditWriter, AuditError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            opendsec_common::fsperm::parent_dir(dir)
                .map_err(|source| AuditError::CreateDir { path: dir.to_path_buf(), source })?;
        }
        let (file, size) = open_append(path)?;
        Ok(AuditWriter { path: path.to_path_buf(), max_bytes, keep, file, size })
    }

    /// Appends one line (a newline is added), rotating first if it would not fit.
    pub fn write_line(&mut self, line: &[u8]) -> Result<(), AuditError> {
        let len = line.len() as u64 + 1;
        if self.size > 0 && self.size + len > self.max_bytes {
            self.rotate()?;
        }
        let err = |source| AuditError::Write { path: self.path.clone(), source };
        self.file.write_all(line).map_err(err)?;
        self.file.write_all(b"\n").map_err(err)?;
        self.size += len;
        Ok(())
    }

    pub fn flush(&mut self) -> Result<(), AuditError> {
        self.file.flush().map_err(|source| AuditError::Write { path: self.path.clone(), source })
    }

    fn rotate(&mut self) -> Result<(), AuditError> {
        self.flush()?;
        let rot = |source| AuditError::Rotate { path: self.path.clone(), source };
        if self.keep == 0 {
            std::fs::remove_file(&self.path).map_err(rot)?;
        } else {
            // Shift .1 -> .2 ... ; what was .keep is overwritten, i.e. dropped.
            for n in (1..self.keep).rev() {
                match std::fs::rename(rotated(&self.path, n), rotated(&self.path, n + 1)) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(rot(e)),
                }
            }
            std::fs::rename(&self.path, rotated(&self.path, 1)).map_err(rot)?;
        }
        let (file, size) = open_append(&self.path)?;
        self.file = file;
        self.size = size;
        Ok(())
    }
}

/// The handlers' side. Disabled audit (or a closed log) makes `write` a no-op.
#[derive(Debug)]
pub struct AuditLog {
    tx: Mutex<Option<mpsc::Sender<AuditRecord>>>,
}

impl AuditLog {
    pub fn disabled() -> AuditLog {
        AuditLog { tx: Mutex::new(None) }
    }

    /// Starts the writer thread; it ends once the log is closed and every line is written.
    pub fn start(writer: AuditWriter) -> (AuditLog, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::channel(CHANNEL_CAPACITY);
        let handle = tokio::task::spawn_blocking(move || run_writer(writer, rx));
        (AuditLog { tx: Mutex::new(Some(tx)) }, handle)
    }

    /// Queues one line, waiting while the writer is behind.
    pub async fn write(&self, rec: AuditRecord) {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(tx) = tx {
            // Fails only once the writer is gone (shutdown).
            let _ = tx.send(rec).await;
        }
    }

    /// No more lines are accepted; the writer drains what is queued and ends.
    pub fn close(&self) {
        self.tx.lock().unwrap_or_else(|p| p.into_inner()).take();
    }
}

fn run_writer(mut w: AuditWriter, mut rx: mpsc::Receiver<AuditRecord>) {
    let mut failing = false;
    while let Some(first) = rx.blocking_recv() {
        let mut batch = vec![first];
        while let Ok(more) = rx.try_recv() {
            batch.push(more);
            if batch.len() >= 1024 {
                break;
            }
        }
        let mut result = Ok(());
        for rec in &batch {
            let line = match serde_json::to_vec(rec) {
                Ok(l) => l,
                Err(e) => {
                    tracing::error!(error = %e, "audit record does not serialize");
                    continue;
                }
            };
            result = result.and_then(|()| w.write_line(&line));
        }
        result = result.and_then(|()| w.flush());
        // Log a failing disk once per episode, not once per line.
        match result {
            Err(e) if !failing => {
                failing = true;
                tracing::error!(error = %e, "audit log write failed");
            }
            Err(_) => {}
            Ok(()) => failing = false,
        }
        // A full batch means more are waiting: no pause then.
        if batch.len() < 1024 {
            std::thread::sleep(GATHER);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(i: u32) -> AuditRecord {
        AuditRecord {
            ts_ms: 1,
            method: "GetSandbox",
            principal: Some("alice".into()),
            sandbox_id: Some(format!("e1.l{i}")),
            reason: "ok",
            ..AuditRecord::default()
        }
    }

    #[test]
    fn rotates_by_size_keeping_the_newest() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("audit/apiserver.log");
        let mut w = AuditWriter::open(&path, 100, 2).unwrap();
        let line = [b'x'; 39]; // 40 bytes with the newline: two per file
        for _ in 0..7 {
            w.write_line(&line).unwrap();
        }
        w.flush().unwrap();
        let size = |p: PathBuf| std::fs::metadata(p).map(|m| m.len()).ok();
        assert_eq!(size(path.clone()), Some(40), "7 lines: 2 + 2 + 2 rotated, 1 current");
        assert_eq!(size(rotated(&path, 1)), Some(80));
        assert_eq!(size(rotated(&path, 2)), Some(80));
        assert_eq!(size(rotated(&path, 3)), None, "only `keep` rotated files are kept");
    }

    #[tokio::test]
    async fn records_are_json_lines_and_all_are_written_before_the_writer_ends() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.log");
        let (log, handle) = AuditLog::start(AuditWriter::open(&path, 1 << 20, 3).unwrap());
        for i in 0..5000 {
            log.write(rec(i)).await;
        }
        log.close();
        handle.await.unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 5000);
        let v: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
        assert_eq!(v["method"], "GetSandbox");
        assert_eq!(v["reason"], "ok");
        assert_eq!(v["principal"], "alice");
        assert!(v.get("count").is_none());
    }
}
