//! File calls of a session, run inside its chronus (so as the session's user): relative paths
//! are resolved against the session's current directory. Escaping with `..` or symlinks is not
//! checked here: the container's root is the boundary, and the kernel's permission checks for
//! the session's user apply. Reads and writes refuse anything but regular files (devices and
//! fifos would block or never end).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use opendsec_proto::v1::*;
use tokio::io::{AsyncReadExt, AsyncSeekExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Streaming;

use crate::error::AgentError;
use crate::{BoxStream, CHUNK};

/// `path` against `cwd` (lexically; `..` is left to the kernel).
pub fn resolve(cwd: &Path, path: &str) -> Result<PathBuf, AgentError> {
    if path.is_empty() {
        return Err(AgentError::Invalid("empty path".into()));
    }
    if path.contains('\0') {
        return Err(AgentError::Invalid("path contains NUL".into()));
    }
    Ok(cwd.join(path))
}

fn not_regular(op: &'static str, p: &Path) -> AgentError {
    AgentError::fs(op, p, std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file"))
}

pub async fn read(cwd: &Path, path: &str, offset: u64, length: u64) -> Result<BoxStream<FileChunk>, AgentError> {
    let p = resolve(cwd, path)?;
    let mut f = tokio::fs::File::open(&p).await.map_err(|e| AgentError::fs("open", &p, e))?;
    let md = f.metadata().await.map_err(|e| AgentError::fs("stat", &p, e))?;
    if !md.is_file() {
        return Err(not_regular("read", &p));
    }
    f.seek(std::io::SeekFrom::Start(offset)).await.map_err(|e| AgentError::fs("seek", &p, e))?;
    let (tx, rx) = mpsc::channel(4);
    tokio::spawn(async move {
        let mut off = offset;
        let mut left = if length == 0 { u64::MAX } else { length };
        let mut buf = vec![0u8; CHUNK];
        while left > 0 {
            let want = (left.min(CHUNK as u64)) as usize;
            match f.read(&mut buf[..want]).await {
                Ok(0) => break,
                Ok(n) => {
                    let c = FileChunk { offset: off, data: buf[..n].to_vec() };
                    if tx.send(Ok(c)).await.is_err() {
                        return;
                    }
                    off += n as u64;
                    left -= n as u64;
                }
                Err(e) => {
                    let _ = tx.send(Err(AgentError::fs("read", &p, e).into())).await;
                    return;
                }
            }
        }
    });
    Ok(Box::pin(ReceiverStream::new(rx)))
}

/// Writes a file from a WriteFile stream. The data is staged in `staging` (the session's own
/// directory) and copied into the target only when a message with `finish` arrived: a stream
/// that ends without it (a caller that gave up, a broken hop) leaves the target untouched.
/// The copy writes the target in place, as any program would: an existing file keeps its
/// owner, mode, links and xattrs, and a symlink is written through. `mode` applies to a new
/// file (or changes an existing one's when set).
pub async fn write(cwd: &Path, staging: &Path, mut s: Streaming<WriteFileRequest>) -> Result<u64, tonic::Status> {
    let Some(first) = s.message().await? else {
        return Err(AgentError::Invalid("empty write stream".into()).into());
    };
    let p = resolve(cwd, &first.path)?;
    if let Ok(md) = tokio::fs::metadata(&p).await
        && !md.is_file()
    {
        return Err(not_regular("write", &p).into());
    }
    check_xattrs(&first.xattrs)?;
    let stage = staging.join(format!("upload-{:016x}", rand::random::<u64>()));
    let result = async {
        let mut st = tokio::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&stage)
            .await
            .map_err(|e| AgentError::fs("stage", &p, e))?;
        let (mut n, mut finished) = (0u64, first.finish);
        st.write_all(&first.data).await.map_err(|e| AgentError::fs("write", &p, e))?;
        n += first.data.len() as u64;
        while !finished {
            match s.message().await? {
                Some(m) => {
                    st.write_all(&m.data).await.map_err(|e| AgentError::fs("write", &p, e))?;
                    n += m.data.len() as u64;
                    finished = m.finish;
                }
                None => {
                    return Err(AgentError::Invalid(
                        "the upload ended without a message setting `finish`: nothing was written".into(),
                    )
                    .into());
                }
            }
        }
        st.flush().await.map_err(|e| AgentError::fs("write", &p, e))?;
        drop(st);
        if first.make_parents
            && let Some(parent) = p.parent()
        {
            tokio::fs::create_dir_all(parent).await.map_err(|e| AgentError::fs("mkdir", parent, e))?;
        }
        let mode = if first.mode == 0 { 0o644 } else { first.mode & 0o7777 };
        let existed = tokio::fs::symlink_metadata(&p).await.is_ok();
        let mut f = tokio::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .append(first.append)
            .truncate(!first.append)
            .mode(mode)
            .custom_flags(rustix::fs::OFlags::NONBLOCK.bits() as i32)
            .open(&p)
            .await
            .map_err(|e| AgentError::fs("open", &p, e))?;
        // Opened without following a swap to a special file in between: check what we got.
        let md = f.metadata().await.map_err(|e| AgentError::fs("stat", &p, e))?;
        if !md.is_file() {
            return Err(not_regular("write", &p).into());
        }
        // A new file gets exactly its mode, whatever the umask (set as envd's uploads set it,
        // so a watcher sees the same create, attribute change and write).
        if !existed || (first.mode != 0 && md.permissions().mode() & 0o7777 != mode) {
            f.set_permissions(std::fs::Permissions::from_mode(mode))
                .await
                .map_err(|e| AgentError::fs("chmod", &p, e))?;
        }
        let mut src = tokio::fs::File::open(&stage).await.map_err(|e| AgentError::fs("stage", &p, e))?;
        tokio::io::copy(&mut src, &mut f).await.map_err(|e| AgentError::fs("write", &p, e))?;
        f.flush().await.map_err(|e| AgentError::fs("write", &p, e))?;
        if !first.clear_xattrs.is_empty() || !first.xattrs.is_empty() {
            set_user_xattrs(&f, &first.clear_xattrs, &first.xattrs).map_err(|e| AgentError::fs("setxattr", &p, e))?;
        }
        Ok::<u64, tonic::Status>(n)
    }
    .await;
    let _ = tokio::fs::remove_file(&stage).await;
    result
}

fn info(path: &Path, md: &std::fs::Metadata) -> FileInfo {
    let ft = md.file_type();
    let kind = if ft.is_symlink() {
        FileType::Symlink
    } else if ft.is_dir() {
        FileType::Dir
    } else if ft.is_file() {
        FileType::File
    } else {
        FileType::Other
    };
    FileInfo {
        name: path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default(),
        path: path.display().to_string(),
        r#type: kind as i32,
        size: md.len(),
        mode: md.permissions().mode() & 0o7777,
        modified_ms: md.mtime().saturating_mul(1000).saturating_add(md.mtime_nsec() / 1_000_000),
        uid: md.uid(),
        gid: md.gid(),
        symlink_target: if ft.is_symlink() {
            std::fs::read_link(path).map(|t| t.display().to_string()).unwrap_or_default()
        } else {
            String::new()
        },
        xattrs: Default::default(),
    }
}

pub async fn stat(cwd: &Path, path: &str, with_xattrs: bool) -> Result<FileInfo, AgentError> {
    let p = resolve(cwd, path)?;
    let md = tokio::fs::symlink_metadata(&p).await.map_err(|e| AgentError::fs("stat", &p, e))?;
    let mut i = info(&p, &md);
    if with_xattrs {
        i.xattrs = user_xattrs(&p);
    }
    Ok(i)
}

pub async fn list(cwd: &Path, path: &str, with_xattrs: bool) -> Result<Vec<FileInfo>, AgentError> {
    let p = resolve(cwd, if path.is_empty() { "." } else { path })?;
    let mut rd = tokio::fs::read_dir(&p).await.map_err(|e| AgentError::fs("list", &p, e))?;
    let mut out = vec![];
    while let Some(e) = rd.next_entry().await.map_err(|e| AgentError::fs("list", &p, e))? {
        let ep = e.path();
        if let Ok(md) = tokio::fs::symlink_metadata(&ep).await {
            let mut i = info(&ep, &md);
            if with_xattrs {
                i.xattrs = user_xattrs(&ep);
            }
            out.push(i);
        }
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(out)
}

/// Extended attributes a file gets or reports at most, and their bounds.
const MAX_XATTRS: usize = 64;
const MAX_XATTR_NAME: usize = 200;
const MAX_XATTR_VALUE: usize = 4096;
const USER: &str = "user.";

fn check_xattrs(x: &std::collections::HashMap<String, String>) -> Result<(), AgentError> {
    if x.len() > MAX_XATTRS {
        return Err(AgentError::Invalid(format!("at most {MAX_XATTRS} xattrs per file")));
    }
    for (k, v) in x {
        if k.is_empty() || k.len() > MAX_XATTR_NAME || k.contains('\0') {
            return Err(AgentError::Invalid(format!("bad xattr name {:?}", k.chars().take(64).collect::<String>())));
        }
        if v.len() > MAX_XATTR_VALUE {
            return Err(AgentError::Invalid(format!("xattr {k:?}: value over {MAX_XATTR_VALUE} bytes")));
        }
    }
    Ok(())
}

/// Removes the file's `user.<clear>*` attributes (none for an empty `clear`), then sets
/// `set` as `user.<name>`, on the open file.
fn set_user_xattrs(
    f: &tokio::fs::File,
    clear: &str,
    set: &std::collections::HashMap<String, String>,
) -> std::io::Result<()> {
    use rustix::fs::{XattrFlags, fremovexattr, fsetxattr};
    if !clear.is_empty() {
        let prefix = format!("{USER}{clear}");
        // (A file system without extended attributes lists none: a plain upload lands there
        // too; one that sets some fails below, saying why.)
        for name in xattr_names(|| rustix::fs::flistxattr_query(f), |buf| rustix::fs::flistxattr(f, buf))? {
            if name.starts_with(&prefix) {
                fremovexattr(f, name.as_str()).map_err(std::io::Error::from)?;
            }
        }
    }
    for (k, v) in set {
        fsetxattr(f, format!("{USER}{k}").as_str(), v.as_bytes(), XattrFlags::empty()).map_err(std::io::Error::from)?;
    }
    Ok(())
}

/// The names a `listxattr` call gives (sized by a first call, grown until they fit, within
/// bounds): most files have none, and cost one call and no buffer.
fn xattr_names(
    query: impl Fn() -> rustix::io::Result<usize>,
    list: impl Fn(&mut [u8]) -> rustix::io::Result<usize>,
) -> std::io::Result<Vec<String>> {
    let size = query()?;
    if size == 0 {
        return Ok(Vec::new());
    }
    let mut buf = vec![0u8; size.min(1 << 16)];
    loop {
        match list(&mut buf) {
            Ok(n) => {
                buf.truncate(n);
                return Ok(buf
                    .split(|b| *b == 0)
                    .filter(|n| !n.is_empty())
                    .map(|n| String::from_utf8_lossy(n).into_owned())
                    .collect());
            }
            Err(rustix::io::Errno::RANGE) if buf.len() < (1 << 16) => buf.resize(buf.len() * 4, 0),
            Err(e) => return Err(e.into()),
        }
    }
}

/// A file's `user.` attributes (not following a symlink), names without `user.`; none when
/// the file system has none, or they cannot be read.
fn user_xattrs(p: &Path) -> std::collections::HashMap<String, String> {
    let mut out = std::collections::HashMap::new();
    let Ok(names) = xattr_names(|| rustix::fs::llistxattr_query(p), |buf| rustix::fs::llistxattr(p, buf)) else {
        return out;
    };
    for name in names.into_iter().filter(|n| n.starts_with(USER)) {
        if out.len() >= MAX_XATTRS {
            break;
        }
        let mut val = vec![0u8; MAX_XATTR_VALUE];
        if let Ok(n) = rustix::fs::lgetxattr(p, name.as_str(), &mut val) {
            val.truncate(n);
            out.insert(name[USER.len()..].to_string(), String::from_utf8_lossy(&val).into_owned());
        }
    }
    out
}

pub async fn mkdir(cwd: &Path, path: &str, parents: bool, mode: u32) -> Result<(), AgentError> {
    let p = resolve(cwd, path)?;
    let mut b = tokio::fs::DirBuilder::new();
    b.recursive(parents).mode(if mode == 0 { 0o755 } else { mode & 0o7777 });
    b.create(&p).await.map_err(|e| AgentError::fs("mkdir", &p, e))
}

pub async fn remove(cwd: &Path, path: &str, recursive: bool) -> Result<(), AgentError> {
    let p = resolve(cwd, path)?;
    let md = tokio::fs::symlink_metadata(&p).await.map_err(|e| AgentError::fs("remove", &p, e))?;
    let r = if md.is_dir() {
        if recursive { tokio::fs::remove_dir_all(&p).await } else { tokio::fs::remove_dir(&p).await }
    } else {
        tokio::fs::remove_file(&p).await
    };
    r.map_err(|e| AgentError::fs("remove", &p, e))
}

pub async fn rename(cwd: &Path, from: &str, to: &str) -> Result<(), AgentError> {
    let (f, t) = (resolve(cwd, from)?, resolve(cwd, to)?);
    tokio::fs::rename(&f, &t).await.map_err(|e| AgentError::fs("move", &f, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resolves() {
        let cwd = Path::new("/home/a");
        assert_eq!(resolve(cwd, "x").unwrap(), PathBuf::from("/home/a/x"));
        assert_eq!(resolve(cwd, "/etc/x").unwrap(), PathBuf::from("/etc/x"));
        assert!(resolve(cwd, "").is_err());
        assert!(resolve(cwd, "a\0b").is_err());
    }

    #[tokio::test]
    async fn user_xattrs_are_set_cleared_by_prefix_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        let f = tokio::fs::File::create(&p).await.unwrap();
        assert!(user_xattrs(&p).is_empty());
        let set =
            std::collections::HashMap::from([("e2b.a".to_string(), "1".to_string()), ("other".into(), "x".into())]);
        set_user_xattrs(&f, "", &set).unwrap();
        assert_eq!(user_xattrs(&p), set);
        // Clearing "e2b." takes only those; a long value reads back whole.
        let long = std::collections::HashMap::from([("e2b.b".to_string(), "v".repeat(4000))]);
        set_user_xattrs(&f, "e2b.", &long).unwrap();
        let got = user_xattrs(&p);
        assert_eq!((got.get("e2b.a"), got.get("other").map(String::as_str)), (None, Some("x")));
        assert_eq!(got["e2b.b"].len(), 4000);
        assert!(check_xattrs(&std::collections::HashMap::from([(String::new(), String::new())])).is_err());
    }
}
