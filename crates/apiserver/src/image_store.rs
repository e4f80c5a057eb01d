//! The apiserver's view of the image store: its errors as public reasons, store I/O on the
//! blocking pool, and the creation path's cache of where each image name resolves.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opendsec_common::{ApiError, Reason};
use opendsec_images::compose::{ComposeError, Source};
use opendsec_images::{ImageRef, Store, StoreError};

/// How long one resolution of (project, image) is reused.
pub const RESOLVE_CACHE_TTL: Duration = Duration::from_secs(2);

/// Entries kept before expired ones are swept (and, if that is not enough, all are dropped).
const MAX_CACHE_ENTRIES: usize = 100_000;

/// Why an image call failed, before it becomes an [`ApiError`].
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Compose(#[from] ComposeError),
    #[error("image {name} not found in {project} or above")]
    NotFound { name: String, project: String },
    #[error("{field}: {message}")]
    Invalid { field: &'static str, message: String },
    #[error("the image store task failed: {0}")]
    Task(String),
}

fn store_error(e: StoreError) -> ApiError {
    let msg = e.to_string();
    match e {
        StoreError::InvalidName { what, .. } => ApiError::invalid(msg).with("field", what),
        StoreError::ImageNotFound(name) => ApiError::not_found(msg).with("image", name),
        StoreError::LayerNotFound(layer) => ApiError::not_found(msg).with("layer", layer),
        StoreError::ImageExists(name) => ApiError::new(Reason::AlreadyExists, msg).with("image", name),
        StoreError::SnapshotNotFound(id) => ApiError::not_found(msg).with("vm_snapshot", id),
        // The store cannot be read or holds garbage: this apiserver cannot serve images now.
        StoreError::Io { .. } | StoreError::Corrupt { .. } => {
            tracing::warn!(error = %msg, "image store error");
            ApiError::unavailable(format!("image store: {msg}"))
        }
    }
}

impl From<ImageError> for ApiError {
    fn from(e: ImageError) -> ApiError {
        let msg = e.to_string();
        match e {
            ImageError::Store(s) => store_error(s),
            ImageError::Compose(c) => match c {
                ComposeError::NoSources | ComposeError::TooManySources(_) | ComposeError::TooManyLayers { .. } => {
                    ApiError::invalid(msg).with("field", "sources")
                }
                ComposeError::Store(s) => store_error(s),
            },
            ImageError::NotFound { name, project } => {
                ApiError::not_found(msg).with("image", name).with("project", project)
            }
            ImageError::Invalid { field, .. } => ApiError::invalid(msg).with("field", field),
            ImageError::Task(_) => ApiError::unavailable(msg),
        }
    }
}

/// Runs store I/O on the blocking pool (the store may be a slow network file system).
pub(crate) async fn blocking<T, F>(f: F) -> Result<T, ImageError>
where
    T: Send + 'static,
    F: FnOnce() -> Result<T, ImageError> + Send + 'static,
{
    tokio::task::spawn_blocking(f).await.map_err(|e| ImageError::Task(e.to_string()))?
}

/// (project, image name) -> when resolved, and where the image was found (`None`: nowhere).
type ResolveCache = HashMap<(String, String), (Instant, Option<Resolved>)>;

/// Where an image name resolved, and what a creation must know of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub image: ImageRef,
    /// The image is a microvm's memory snapshot (only backend microvm restores it).
    pub vm_snapshot: bool,
}

/// The store and the creation path's resolution cache.
#[derive(Debug)]
pub struct ImageStore {
    pub(crate) store: Arc<Store>,
    cache: Mutex<ResolveCache>,
}

impl ImageStore {
    pub fn new(store: Store) -> ImageStore {
        ImageStore { store: Arc::new(store), cache: Mutex::new(HashMap::new()) }
    }

    fn cache(&self) -> std::sync::MutexGuard<'_, ResolveCache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Drops every cached resolution (after a write through this apiserver).
    pub fn invalidate(&self) {
        self.cache().clear();
    }

    /// Refuses to let `project` go while it holds images (as IAM refuses while it holds
    /// subprojects, principals or leases): they would pass to a project made later under the
    /// same name.
    pub async fn check_empty(&self, project: &str) -> Result<(), ApiError> {
        let (store, p) = (self.store.clone(), project.to_string());
        let held = blocking(move || Ok(store.list_manifests(&p, false)?)).await.map_err(ApiError::from)?;
        match held.first() {
            None => Ok(()),
            Some(m) => Err(ApiError::new(
                Reason::InvalidState,
                format!("project {project} still has image {}:{}; delete its images first", m.repo, m.tag),
            )),
        }
    }

    /// After `project` was deleted: it is no layer's user any more.
    pub async fn forget_project(&self, project: &str) -> Result<usize, ApiError> {
        let (store, p) = (self.store.clone(), project.to_string());
        let n = blocking(move || Ok(store.remove_layer_users(&p)?)).await.map_err(ApiError::from)?;
        self.invalidate();
        Ok(n)
    }

    /// Where `name` (a sandbox's `spec.image`) is found for a sandbox in `project`: cached for
    /// [`RESOLVE_CACHE_TTL`], found or not; store errors are not cached.
    pub async fn resolve(&self, project: &str, name: &str) -> Result<ImageRef, ImageError> {
        Ok(self.resolve_full(project, name).await?.image)
    }

    /// [`ImageStore::resolve`], with what a creation must know of the image.
    pub async fn resolve_full(&self, project: &str, name: &str) -> Result<Resolved, ImageError> {
        let key = (project.to_string(), name.to_string());
        let now = Instant::now();
        if let Some((at, found)) = self.cache().get(&key)
            && now.duration_since(*at) < RESOLVE_CACHE_TTL
        {
            return found.clone().ok_or_else(|| ImageError::NotFound { name: key.1.clone(), project: key.0.clone() });
        }
        let store = self.store.clone();
        let (p, n) = key.clone();
        let found = blocking(move || match Source::parse(&n)?.resolve(&store, &p) {
            Ok((image, m)) => Ok(Some(Resolved { image, vm_snapshot: !m.vm_snapshot.is_empty() })),
            Err(StoreError::ImageNotFound(_)) => Ok(None),
            Err(e) => Err(e.into()),
        })
        .await?;
        {
            let mut c = self.cache();
            if c.len() >= MAX_CACHE_ENTRIES {
                c.retain(|_, (at, _)| now.duration_since(*at) < RESOLVE_CACHE_TTL);
                if c.len() >= MAX_CACHE_ENTRIES {
                    c.clear();
                }
            }
            c.insert(key.clone(), (now, found.clone()));
        }
        found.ok_or(ImageError::NotFound { name: key.1, project: key.0 })
    }
}
