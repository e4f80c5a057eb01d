//! Session sync (docs/sessions.md): the paths a sandbox's spec names are saved to S3-compatible
//! object storage when it stops, and restored from there when a sandbox of the same project
//! names the same session. The object is `<prefix><project>/<session>.tar.zst`: a layer tar of
//! what the sandbox wrote under those paths (whiteouts included), zstd-compressed.
//!
//! Invariants:
//! - a session's key is made from the sandbox's own project: no spec can name another
//!   project's session;
//! - what comes back from the store is untrusted: it is fetched to a file bounded by the
//!   sandbox's disk and imported like any image layer (checked, bounded, content-addressed),
//!   then stacked on top of the image's layers;
//! - uploads go through a temporary file, never whole into memory; one object is replaced
//!   whole (the store's put is atomic per object).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use futures::StreamExt;
use object_store::aws::AmazonS3Builder;
use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload, WriteMultipart};
use opendsec_common::config::SessionStoreConfig;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::backend::BackendError;

/// Objects up to this size go in one request; larger ones in parts of this size.
const PART_BYTES: usize = 8 << 20;
/// Parts uploaded at once.
const PARTS_IN_FLIGHT: usize = 4;

/// The cluster's session store.
pub struct SessionStore {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    /// Where uploads and downloads are staged (`<edge state>/sessions`).
    pub staging: PathBuf,
}

impl std::fmt::Debug for SessionStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SessionStore").field("store", &self.store.to_string()).field("prefix", &self.prefix).finish()
    }
}

fn store_err(what: &str, e: impl std::error::Error + Send + Sync + 'static) -> BackendError {
    BackendError::unavailable(format!("session store: {what}")).caused_by(e)
}

impl SessionStore {
    pub fn new(cfg: &SessionStoreConfig, staging: PathBuf) -> Result<SessionStore, String> {
        let store = AmazonS3Builder::new()
            .with_endpoint(&cfg.endpoint)
            .with_bucket_name(&cfg.bucket)
            .with_region(if cfg.region.is_empty() { "us-east-1" } else { &cfg.region })
            .with_access_key_id(&cfg.access_key_id)
            .with_secret_access_key(&cfg.secret_access_key)
            .with_allow_http(cfg.allow_http)
            .build()
            .map_err(|e| format!("edge.session_store: {e}"))?;
        std::fs::create_dir_all(&staging).map_err(|e| format!("{}: {e}", staging.display()))?;
        Ok(SessionStore { store: Arc::new(store), prefix: cfg.prefix.clone(), staging })
    }

    /// The key of session `name` of `project` (both checked by the apiserver and again here).
    fn key(&self, project: &str, name: &str) -> Result<Key, BackendError> {
        opendsec_common::ids::validate_project(project).map_err(|e| BackendError::invalid_argument(e.message))?;
        opendsec_common::spec::check_session(name, &["/x".into()]).map_err(BackendError::invalid_argument)?;
        Key::parse(format!("{}{project}/{name}.tar.zst", self.prefix))
            .map_err(|e| BackendError::invalid_argument(format!("session key: {e}")))
    }

    /// Uploads `file` as session `name` of `project`; returns its size.
    pub async fn save(&self, project: &str, name: &str, file: &Path) -> Result<u64, BackendError> {
        let key = self.key(project, name)?;
        let mut f = tokio::fs::File::open(file).await.map_err(|e| store_err("open the staged session", e))?;
        let size = f.metadata().await.map_err(|e| store_err("stat the staged session", e))?.len();
        if size <= PART_BYTES as u64 {
            let mut buf = Vec::with_capacity(size as usize);
            f.read_to_end(&mut buf).await.map_err(|e| store_err("read the staged session", e))?;
            self.store.put(&key, PutPayload::from(buf)).await.map_err(|e| store_err("put", e))?;
            return Ok(size);
        }
        let upload = self.store.put_multipart(&key).await.map_err(|e| store_err("start an upload", e))?;
        let mut w = WriteMultipart::new_with_chunk_size(upload, PART_BYTES);
        let mut buf = vec![0u8; PART_BYTES];
        loop {
            let n = match f.read(&mut buf).await {
                Ok(n) => n,
                Err(e) => {
                    let _ = w.abort().await;
                    return Err(store_err("read the staged session", e));
                }
            };
            if n == 0 {
                break;
            }
            if let Err(e) = w.wait_for_capacity(PARTS_IN_FLIGHT).await {
                let _ = w.abort().await;
                return Err(store_err("upload a part", e));
            }
            w.write(&buf[..n]);
        }
        w.finish().await.map_err(|e| store_err("finish the upload", e))?;
        Ok(size)
    }

    /// Downloads session `name` of `project` to `dest`, at most `max_bytes`; `false` if no
    /// such session was saved.
    pub async fn fetch(&self, project: &str, name: &str, dest: &Path, max_bytes: u64) -> Result<bool, BackendError> {
        let key = self.key(project, name)?;
        let got = match self.store.get(&key).await {
            Ok(g) => g,
            Err(object_store::Error::NotFound { .. }) => return Ok(false),
            Err(e) => return Err(store_err("get", e)),
        };
        if got.meta.size > max_bytes {
            return Err(BackendError::invalid_argument(format!(
                "session {name} holds {} bytes, more than the sandbox's disk ({max_bytes})",
                got.meta.size
            )));
        }
        let mut out = tokio::fs::File::create(dest).await.map_err(|e| store_err("stage the session", e))?;
        let mut stream = got.into_stream();
        let mut total = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| store_err("download", e))?;
            total += chunk.len() as u64;
            if total > max_bytes {
                return Err(BackendError::invalid_argument(format!(
                    "session {name} is larger than the sandbox's disk ({max_bytes} bytes)"
                )));
            }
            out.write_all(&chunk).await.map_err(|e| store_err("stage the session", e))?;
        }
        out.flush().await.map_err(|e| store_err("stage the session", e))?;
        Ok(true)
    }
}
