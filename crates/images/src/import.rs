//! Importing images into the store: from an OCI registry ([`import_from_registry`]) and, via
//! [`crate::offline`], from an OCI layout, a `docker save` archive or a plain root file system.
//!
//! Flow of a registry import: parse the reference → credentials → manifest (an index resolves
//! to its linux/amd64 image) → config (diff ids, run config) → which layers are already
//! stored, bottom-up so the lowers of opaque layers are known → download the missing blobs
//! concurrently ([`DOWNLOAD_CONCURRENCY`]) into temporary files in `layers/.tmp`, hashing as
//! they stream → unpack them in order, each as soon as it and everything below it is ready
//! ([`crate::layer::import_layer`], in `spawn_blocking`).
//!
//! Invariants: a layer already in the store is neither downloaded nor unpacked; every byte is
//! verified against its digest (manifests, configs, blobs, and by `import_layer` the
//! uncompressed tar against the diff id); on failure the store holds no layer of the failed
//! one and `layers/.tmp` holds none of our temporary files (downloads are aborted and awaited
//! before the error is returned). The import writes no manifest: the caller registers the
//! image (through the apiserver's Images API, which checks `layer.publish`).

use std::collections::HashMap;
use std::future::Future;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use sha2::{Digest, Sha256};

use crate::layer::{Compression, LayerError, Limits, existing_layer, import_layer};
use crate::progress::{LayerProgress, Progress};
use crate::registry::manifest::{self, ImageManifest, ManifestDoc, hex};
use crate::registry::{Client, Reference, auth};
use crate::store::{ImageConfig, LayerId, LayerMeta, Store, StoreError};

pub use crate::registry::{Credentials, RegistryError};

/// Layer blobs downloaded at the same time.
pub const DOWNLOAD_CONCURRENCY: usize = 4;

/// Why an import failed: the registry's answer or a document's check ([`RegistryError`]: sizes,
/// digests, JSON, limits, whatever the image came from), or what only an import meets
/// (archives, layers, the store).
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    #[error(transparent)]
    Registry(#[from] RegistryError),
    #[error("{path}: {why}")]
    InvalidArchive { path: PathBuf, why: String },
    #[error("{path} holds several images ({}); name one with a tag", names.join(", "))]
    Ambiguous { path: PathBuf, names: Vec<String> },
    #[error("layer {diff_id}: {source}")]
    Layer { diff_id: String, source: LayerError },
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("i/o error on {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("the import was interrupted (the runtime is shutting down)")]
    Interrupted,
}

/// How to import. `Default`: anonymous (or docker's config), https, default limits, no
/// progress display, 30 s timeout.
#[derive(Clone, Debug)]
pub struct ImportOptions {
    /// Explicit credentials (`--username` + password from stdin); override docker's config.
    pub credentials: Option<Credentials>,
    /// docker's `config.json`; default `$DOCKER_CONFIG/config.json` or
    /// `~/.docker/config.json`.
    pub docker_config: Option<PathBuf>,
    /// Plain http to the registry (local registries such as 127.0.0.1:5000).
    pub insecure_http: bool,
    /// Bounds on each layer (a blob larger than `max_layer_bytes` is not downloaded).
    pub limits: Limits,
    /// Show a progress bar on stderr (when it is a terminal).
    pub progress: bool,
    /// Connect timeout, and the longest silence tolerated while waiting for bytes.
    pub timeout: Duration,
    /// The project the import is for (its layers get recorded for it). A layer already stored
    /// is reused without reading its blob only when this project may already use it; any
    /// other stored layer is fetched and unpacked again, and must match the stored one: an
    /// image config naming another project's layer grants nothing without its content.
    /// `None`: every stored layer is reused (the import records no project).
    pub for_project: Option<String>,
}

impl Default for ImportOptions {
    fn default() -> ImportOptions {
        ImportOptions {
            credentials: None,
            docker_config: None,
            insecure_http: false,
            limits: Limits::default(),
            progress: false,
            timeout: Duration::from_secs(30),
            for_project: None,
        }
    }
}

/// An imported image: its layers (bottom first, all in the store) and run config.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Imported {
    pub layers: Vec<LayerId>,
    pub config: ImageConfig,
    /// Where it came from, pinned (`host/repo@sha256:...`, `oci-layout:DIR@sha256:...`, ...).
    pub source: String,
    /// Layers unpacked by this import.
    pub fetched_layers: usize,
    /// Layers that were already in the store (not downloaded, not unpacked).
    pub reused_layers: usize,
}

/// Imports `reference` (`host[:port]/repo[:tag|@sha256:...]`; no host means Docker Hub) from
/// its registry.
pub async fn import_from_registry(
    store: &Store,
    reference: &str,
    opts: &ImportOptions,
) -> Result<Imported, ImportError> {
    let r = Reference::parse(reference)?;
    let auth =
        auth::resolve(&r.registry, opts.credentials.as_ref(), opts.docker_config.as_deref(), opts.timeout).await?;
    let client = Arc::new(Client::new(&r, auth, opts.insecure_http, opts.timeout)?);
    let (manifest, manifest_digest) = resolve_manifest(&client, &r).await?;
    let config_what = format!("config {}", manifest.config().digest());
    let config_bytes = client.blob_bytes(manifest.config(), manifest::MAX_CONFIG_BYTES).await?;
    let config = manifest::parse_config(&config_what, &config_bytes, manifest.layers().len())?;
    let source = r.pinned(&manifest_digest);
    let jobs = layer_jobs(&manifest, &config);
    let progress = Progress::new(opts.progress);
    let descriptors = Arc::new(manifest.layers().clone());
    let tmp = store.tmp_dir();
    let limit = opts.limits.max_layer_bytes;
    let fetch = move |i: usize, bar: LayerProgress| {
        let client = client.clone();
        let descriptors = descriptors.clone();
        let tmp = tmp.clone();
        async move {
            let desc = &descriptors[i];
            bar.downloading();
            let file = client.blob_to_file(desc, &tmp, limit, |n| bar.inc(n)).await;
            match &file {
                Ok(_) => bar.downloaded(),
                Err(_) => bar.failed(),
            }
            Ok(Blob::Temp(file?))
        }
    };
    let (layers, fetched_layers, reused_layers) =
        import_layers(store, &jobs, &source, &opts.limits, opts.for_project.as_deref(), &progress, fetch).await?;
    tracing::info!(%source, layers = layers.len(), fetched_layers, reused_layers, "image imported");
    Ok(Imported { layers, config: manifest::image_config(&config), source, fetched_layers, reused_layers })
}

/// The image manifest `r` names (an index resolves to its linux/amd64 entry) and its digest,
/// verified: against the reference's digest, else against `Docker-Content-Digest`.
async fn resolve_manifest(client: &Client, r: &Reference) -> Result<(ImageManifest, String), ImportError> {
    let shown = r.to_string();
    let fetched = client.manifest(r.manifest_ref(), &shown).await?;
    let digest = manifest::sha256_digest(&fetched.bytes);
    let what = format!("manifest {shown}");
    let expected = r.digest.clone().or_else(|| fetched.digest_header.clone().filter(|h| h.starts_with("sha256:")));
    if let Some(e) = expected
        && e != digest
    {
        return Err(RegistryError::DigestMismatch { what, expected: e, actual: digest }.into());
    }
    match manifest::parse_manifest(&what, &fetched.bytes, fetched.content_type.as_deref())? {
        ManifestDoc::Image(m) => Ok((m, digest)),
        ManifestDoc::Index(index) => {
            let d = manifest::choose_amd64(&shown, index.manifests())?;
            let child_shown = format!("{}/{}@{}", r.registry, r.repository, d.digest());
            let child_what = format!("manifest {child_shown}");
            if d.size() > manifest::MAX_MANIFEST_BYTES {
                return Err(RegistryError::TooLarge {
                    what: child_what,
                    size: d.size(),
                    limit: manifest::MAX_MANIFEST_BYTES,
                }
                .into());
            }
            let child = client.manifest(d.digest().as_ref(), &child_shown).await?;
            manifest::verify_digest(&child_what, d.digest().as_ref(), &child.bytes)?;
            match manifest::parse_manifest(&child_what, &child.bytes, child.content_type.as_deref())? {
                ManifestDoc::Image(m) => Ok((m, d.digest().to_string())),
                ManifestDoc::Index(_) => Err(RegistryError::InvalidManifest {
                    what: child_what,
                    why: "an index where the linux/amd64 image manifest should be".into(),
                }
                .into()),
            }
        }
    }
}

/// One layer of an image to import.
pub(crate) struct LayerJob {
    /// The blob's digest, when known (for messages and progress labels).
    pub blob_digest: Option<String>,
    /// `sha256:<hex>` of the uncompressed tar, from the config.
    pub diff_id: String,
    pub size: u64,
}

pub(crate) fn layer_jobs(m: &ImageManifest, c: &manifest::ImageConfiguration) -> Vec<LayerJob> {
    m.layers()
        .iter()
        .zip(c.rootfs().diff_ids())
        .map(|(l, d)| LayerJob { blob_digest: Some(l.digest().to_string()), diff_id: d.clone(), size: l.size() })
        .collect()
}

/// A fetched layer blob, ready to unpack.
pub(crate) enum Blob {
    /// A downloaded and verified temporary file (deleted when dropped).
    Temp(tempfile::NamedTempFile),
    /// `len` bytes at `offset` of a local file; checked against `digest` (when given) before
    /// anything is unpacked.
    Range { path: PathBuf, offset: u64, len: u64, digest: Option<String> },
}

/// Which layers are already stored, bottom-up. While every layer below is known, the full
/// check (plain or opaque-expanded id) applies; above a missing layer only the plain id can
/// match (an opaque layer's id depends on lower ids not known yet, and a layer stored under
/// its plain id has no opaque directories, so it is valid on any lowers).
///
/// Only layers `for_project` may already use count (see [`ImportOptions::for_project`]).
fn plan(store: &Store, jobs: &[LayerJob], for_project: Option<&str>) -> Vec<Option<LayerId>> {
    let mut out: Vec<Option<LayerId>> = Vec::with_capacity(jobs.len());
    let mut lowers: Option<Vec<LayerId>> = Some(Vec::new());
    for j in jobs {
        let found = match &lowers {
            Some(l) => existing_layer(store, &j.diff_id, l),
            None => LayerId::parse(&j.diff_id).ok().filter(|id| store.has_layer(id)),
        }
        .filter(|id| reusable(store, id, for_project));
        match (&found, &mut lowers) {
            (Some(id), Some(l)) => l.push(id.clone()),
            (None, _) => lowers = None,
            _ => {}
        }
        out.push(found);
    }
    out
}

/// Whether a stored layer may stand in for an image's layer without its blob being read: the
/// import records no project, or the project may use the layer already (recorded for it; a
/// layer recorded for nobody is root's, as the apiserver reads it).
fn reusable(store: &Store, id: &LayerId, for_project: Option<&str>) -> bool {
    let Some(project) = for_project else { return true };
    match store.layer_users(id) {
        Ok(users) if users.is_empty() => project == opendsec_common::ids::ROOT_PROJECT,
        Ok(users) => users.iter().any(|u| u == project),
        Err(_) => false,
    }
}

fn short(digest: &str) -> String {
    let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
    hex.chars().take(12).collect()
}

/// Imports the layers of one image: skips those already stored, fetches the others with
/// `fetch` ([`DOWNLOAD_CONCURRENCY`] at a time, as spawned tasks so they keep going while a
/// layer unpacks) and unpacks them in order. Returns the layer ids and the fetched and reused
/// counts. On error every fetch task is aborted and awaited (so its temporary file is gone)
/// before returning.
pub(crate) async fn import_layers<F, Fut>(
    store: &Store,
    jobs: &[LayerJob],
    source: &str,
    limits: &Limits,
    for_project: Option<&str>,
    progress: &Progress,
    fetch: F,
) -> Result<(Vec<LayerId>, usize, usize), ImportError>
where
    F: Fn(usize, LayerProgress) -> Fut,
    Fut: Future<Output = Result<Blob, ImportError>> + Send + 'static,
{
    // The manifest's sizes are the compressed blobs': less than what unpacks, so a sum over
    // the cap is refused before a byte is fetched.
    let listed = jobs.iter().fold(0u64, |a, j| a.saturating_add(j.size));
    if listed > limits.max_image_bytes {
        return Err(RegistryError::TooLarge {
            what: format!("image {source}"),
            size: listed,
            limit: limits.max_image_bytes,
        }
        .into());
    }
    let mut ids = plan(store, jobs, for_project);
    let mut reused = ids.iter().filter(|i| i.is_some()).count();
    let semaphore = Arc::new(tokio::sync::Semaphore::new(DOWNLOAD_CONCURRENCY));
    let mut tasks = tokio::task::JoinSet::new();
    let spawn = |tasks: &mut tokio::task::JoinSet<_>, i: usize, bar: LayerProgress| {
        let fut = fetch(i, bar);
        let semaphore = semaphore.clone();
        tasks.spawn(async move {
            // The semaphore is never closed; a closed one would just mean no limit.
            let _permit = semaphore.acquire_owned().await.ok();
            (i, fut.await)
        });
    };
    let mut bars = HashMap::new();
    // A layer whose tar repeats one below it is most likely stored by the time its turn
    // comes: it is fetched then, only if it is not.
    let mut deferred = vec![false; jobs.len()];
    for (i, job) in jobs.iter().enumerate() {
        let label = job.blob_digest.as_deref().map_or_else(|| format!("layer {}", i + 1), short);
        if ids[i].is_some() {
            progress.reused(&label);
            continue;
        }
        let bar = progress.layer(&label, job.size);
        bars.insert(i, bar.clone());
        if jobs[..i].iter().any(|j| j.diff_id == job.diff_id) {
            deferred[i] = true;
            continue;
        }
        spawn(&mut tasks, i, bar);
    }
    let result = async {
        let mut ready: HashMap<usize, Blob> = HashMap::new();
        let mut fetched = 0;
        // Content bytes of the layers so far (reused ones as stored).
        let mut total = 0u64;
        for id in ids.iter().flatten() {
            total = total.saturating_add(store.layer_meta(id).map(|m| m.size_bytes).unwrap_or(0));
        }
        for i in 0..jobs.len() {
            if ids[i].is_some() {
                continue;
            }
            if deferred[i] {
                let lowers: Vec<LayerId> = ids[..i].iter().flatten().cloned().collect();
                if let Some(id) =
                    existing_layer(store, &jobs[i].diff_id, &lowers).filter(|id| reusable(store, id, for_project))
                {
                    if let Some(bar) = bars.get(&i) {
                        bar.done();
                    }
                    ids[i] = Some(id);
                    reused += 1;
                    continue;
                }
                spawn(&mut tasks, i, bars.get(&i).cloned().unwrap_or_else(LayerProgress::hidden));
            }
            while !ready.contains_key(&i) {
                match tasks.join_next().await {
                    Some(Ok((j, Ok(blob)))) => {
                        ready.insert(j, blob);
                    }
                    Some(Ok((_, Err(e)))) => return Err(e),
                    Some(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                    Some(Err(_)) | None => return Err(ImportError::Interrupted),
                }
            }
            let Some(blob) = ready.remove(&i) else { return Err(ImportError::Interrupted) };
            // Every layer below is in the store now (unpacked in order).
            let lowers: Vec<LayerId> = ids[..i].iter().flatten().cloned().collect();
            let bar = bars.get(&i).cloned().unwrap_or_else(LayerProgress::hidden);
            bar.unpacking();
            let meta = unpack(store, blob, &jobs[i].diff_id, lowers, limits, source).await;
            match &meta {
                Ok(_) => bar.done(),
                Err(_) => bar.failed(),
            }
            let meta = meta?;
            total = total.saturating_add(meta.size_bytes);
            if total > limits.max_image_bytes {
                return Err(RegistryError::TooLarge {
                    what: format!("image {source} (content of its layers)"),
                    size: total,
                    limit: limits.max_image_bytes,
                }
                .into());
            }
            ids[i] = Some(meta.id);
            fetched += 1;
        }
        Ok(fetched)
    }
    .await;
    tasks.shutdown().await;
    let fetched = result?;
    let layers: Vec<LayerId> = ids.into_iter().flatten().collect();
    debug_assert_eq!(layers.len(), jobs.len(), "every layer was either reused or unpacked");
    Ok((layers, fetched, reused))
}

/// Unpacks one blob into the store (blocking work on the blocking pool).
pub(crate) async fn unpack(
    store: &Store,
    blob: Blob,
    diff_id: &str,
    lowers: Vec<LayerId>,
    limits: &Limits,
    source: &str,
) -> Result<LayerMeta, ImportError> {
    let root = store.root().to_path_buf();
    let diff_id = diff_id.to_string();
    let limits = limits.clone();
    let source = source.to_string();
    tokio::task::spawn_blocking(move || {
        // `Store` is a root path: a second handle on it is free.
        let store = Store::open(root)?;
        unpack_blocking(&store, &blob, Some(&diff_id), &lowers, &limits, &source)
    })
    .await
    .unwrap_or_else(|e| {
        if e.is_panic() { std::panic::resume_unwind(e.into_panic()) } else { Err(ImportError::Interrupted) }
    })
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> ImportError + '_ {
    move |source| ImportError::Io { path: path.to_path_buf(), source }
}

/// Opens a blob, checks its digest if it is a local range that has one, and unpacks it with
/// the compression its first bytes show.
pub(crate) fn unpack_blocking(
    store: &Store,
    blob: &Blob,
    diff_id: Option<&str>,
    lowers: &[LayerId],
    limits: &Limits,
    source: &str,
) -> Result<LayerMeta, ImportError> {
    let reader: Box<dyn Read> = match blob {
        Blob::Temp(t) => Box::new(t.reopen().map_err(io_err(t.path()))?),
        Blob::Range { path, offset, len, digest } => {
            let mut f = std::fs::File::open(path).map_err(io_err(path))?;
            if let Some(d) = digest {
                verify_range(&mut f, path, *offset, *len, d)?;
            }
            f.seek(SeekFrom::Start(*offset)).map_err(io_err(path))?;
            Box::new(f.take(*len))
        }
    };
    let mut r = BufReader::with_capacity(1 << 20, reader);
    let head = r.fill_buf().map_err(|source| ImportError::Layer {
        diff_id: diff_id.unwrap_or("").into(),
        source: LayerError::Read { source },
    })?;
    let compression = Compression::sniff(head);
    import_layer(store, &mut r, compression, diff_id, lowers, limits, source)
        .map_err(|source| ImportError::Layer { diff_id: diff_id.unwrap_or("(unknown)").into(), source })
}

/// Hashes `len` bytes at `offset` of `f` and compares them with `digest`.
fn verify_range(f: &mut std::fs::File, path: &Path, offset: u64, len: u64, digest: &str) -> Result<(), ImportError> {
    manifest::validate_digest(digest)?;
    f.seek(SeekFrom::Start(offset)).map_err(io_err(path))?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut left = len;
    while left > 0 {
        let want = buf.len().min(usize::try_from(left).unwrap_or(usize::MAX));
        let n = f.read(&mut buf[..want]).map_err(io_err(path))?;
        if n == 0 {
            return Err(RegistryError::SizeMismatch {
                what: format!("blob {digest}"),
                expected: len,
                actual: len - left,
            }
            .into());
        }
        h.update(&buf[..n]);
        left -= n as u64;
    }
    let actual = format!("sha256:{}", hex(&h.finalize()));
    if actual != digest {
        return Err(
            RegistryError::DigestMismatch { what: format!("blob {digest}"), expected: digest.into(), actual }.into()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put_layer(store: &Store, id: &LayerId, lowers: Vec<LayerId>) {
        let p = store.begin_layer().unwrap();
        let meta = LayerMeta {
            v: 1,
            id: id.clone(),
            size_bytes: 0,
            entries: 0,
            created_at_ms: 1,
            source: "test".into(),
            diff_id: String::new(),
            lowers,
        };
        store.commit_layer(p, &meta).unwrap();
    }

    fn job(id: &LayerId) -> LayerJob {
        LayerJob { blob_digest: None, diff_id: id.diff_id(), size: 1 }
    }

    #[test]
    fn plan_is_bottom_up() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let [a, b, c, d] = [1u8, 2, 3, 4].map(|n| LayerId::from_digest(&[n; 32]));
        put_layer(&store, &a, vec![]);
        // b is stored opaque-expanded on top of a.
        let b_opaque = crate::layer::opaque_layer_id(&b, std::slice::from_ref(&a));
        put_layer(&store, &b_opaque, vec![a.clone()]);
        put_layer(&store, &d, vec![]);
        let p = plan(&store, &[job(&a), job(&b), job(&c), job(&d)], None);
        assert_eq!(p, vec![Some(a.clone()), Some(b_opaque.clone()), None, Some(d.clone())]);
        // Above a missing layer, an opaque-expanded id cannot be known.
        let p = plan(&store, &[job(&c), job(&a), job(&b)], None);
        assert_eq!(p, vec![None, Some(a), None]);
    }

    #[test]
    fn errors_read_well_and_hold_no_secrets() {
        let e = RegistryError::Status {
            url: "https://r.example/v2/x/manifests/y".into(),
            status: 500,
            code: Some("UNKNOWN".into()),
            message: Some("boom".into()),
        };
        assert_eq!(e.to_string(), "https://r.example/v2/x/manifests/y answered HTTP 500 UNKNOWN: boom");
        let e = RegistryError::Status { url: "u".into(), status: 502, code: None, message: None };
        assert_eq!(e.to_string(), "u answered HTTP 502");
        let o = ImportOptions {
            credentials: Some(Credentials { username: "u".into(), password: "hunter2".into() }),
            ..Default::default()
        };
        assert!(!format!("{o:?}").contains("hunter2"));
    }
}
