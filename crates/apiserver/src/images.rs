//! The public `Images` service and the image check of every creation (reference section 1,
//! "Image API"; docs/images.md).
//!
//! The apiserver writes manifests to the shared store directly. Writing (register, compose,
//! delete) needs `layer.publish` on the image's project; using (get, list, creating sandboxes)
//! needs `layer.use` on the project where the image was found, so the account that builds
//! environments and the one that runs jobs can be separate. Registering touches every layer
//! before the manifest is written ([`opendsec_images::gc::publish_manifest`]), so GC's grace
//! period protects layers about to be referenced.
//!
//! The creation path resolves `spec.image` (`repo[:tag]` from the sandbox's project upward, or
//! `project//repo:tag`) before placement. It runs thousands of times a second, so resolutions
//! (found or not) are cached for [`RESOLVE_CACHE_TTL`] per (project, image), the file I/O runs
//! on the blocking pool, and `layer.use` goes through the authorization cache. A write through
//! this apiserver clears its cache; other apiservers see it within the TTL.
//!
//! Store errors map once, here: a bad name is `invalid_argument`, a missing image or layer
//! `not_found`, an unreadable or corrupt store `unavailable` (this node cannot serve).

use std::collections::BTreeSet;
use std::sync::Arc;

use futures::future::BoxFuture;
use opendsec_common::{ApiError, ids, time};
use opendsec_images::compose::{self, ComposeError, Source};
use opendsec_images::{ImageConfig, ImageRef, LayerId, Manifest, Store, StoreError, gc};
use opendsec_proto::v1 as pb;
use opendsec_proto::v1::images_server::Images;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use crate::call::{caller, run};
use crate::image_store::blocking;
pub use crate::image_store::{ImageError, ImageStore, RESOLVE_CACHE_TTL};
use crate::state::{Call, Shared};

pub const PERM_PUBLISH: &str = "layer.publish";
pub const PERM_USE: &str = "layer.use";

/// Bounds of a registered image's config (the message limit alone would allow 80 MB).
const MAX_LIST_ENTRIES: usize = 1024;
const MAX_STRING_BYTES: usize = 32 * 1024;
const MAX_SOURCE_BYTES: usize = 1024;

/// The image check of a creation (one per `CreateSandbox`, one per batch): the image exists in
/// the sandbox's project or above, and the caller holds `layer.use` where it was found.
pub async fn check_image(s: &Shared, principal: &str, spec: &pb::SandboxSpec) -> Result<(), ApiError> {
    let found = s.images.resolve_full(&spec.project, &spec.image).await?;
    s.authorize(principal, PERM_USE, &found.image.project).await?;
    // A memory snapshot is restored by the backend that took it; another would boot only the
    // image under it and lose what the snapshot holds.
    if found.vm_snapshot && spec.backend != VM_SNAPSHOT_BACKEND {
        return Err(ApiError::invalid(format!(
            "image {} is a microvm's memory snapshot: only backend {VM_SNAPSHOT_BACKEND} restores it, not {}",
            spec.image, spec.backend
        ))
        .with("field", "backend"));
    }
    Ok(())
}

/// The backend that takes and restores memory snapshots.
pub const VM_SNAPSHOT_BACKEND: &str = "microvm";

// ---------------------------------------------------------------------------------------------
// Conversions

pub fn to_proto(m: &Manifest) -> pb::Image {
    pb::Image {
        project: m.project.clone(),
        repo: m.repo.clone(),
        tag: m.tag.clone(),
        layers: m.layers.iter().map(|l| l.to_string()).collect(),
        config: Some(pb::ImageConfig {
            env: m.config.env.clone(),
            workdir: m.config.workdir.clone(),
            user: m.config.user.clone(),
            entrypoint: m.config.entrypoint.clone(),
            cmd: m.config.cmd.clone(),
        }),
        created_at_ms: m.created_at_ms,
        source: m.source.clone(),
        vm_snapshot: m.vm_snapshot.clone(),
    }
}

fn check_list(field: &'static str, items: &[String]) -> Result<(), ImageError> {
    if items.len() > MAX_LIST_ENTRIES {
        return Err(ImageError::Invalid {
            field,
            message: format!("{} entries, at most {MAX_LIST_ENTRIES}", items.len()),
        });
    }
    items.iter().try_for_each(|s| check_string(field, s, MAX_STRING_BYTES))
}

fn check_string(field: &'static str, s: &str, max: usize) -> Result<(), ImageError> {
    if s.len() > max {
        return Err(ImageError::Invalid { field, message: format!("{} bytes, at most {max}", s.len()) });
    }
    Ok(())
}

/// The manifest a `RegisterImage` asks for, validated (names, layer ids, bounds); `project` is
/// the caller's when the request leaves it empty.
pub fn manifest_from_request(
    image: Option<&pb::Image>,
    caller_project: &str,
    now_ms: i64,
) -> Result<Manifest, ImageError> {
    let img = image.ok_or(ImageError::Invalid { field: "image", message: "is required".into() })?;
    let project = if img.project.is_empty() { caller_project } else { &img.project };
    let r = ImageRef::new(project, &img.repo, &img.tag)?;
    if img.layers.is_empty() {
        return Err(ImageError::Invalid { field: "image.layers", message: "an image needs at least one layer".into() });
    }
    if img.layers.len() > compose::MAX_LAYERS {
        return Err(ImageError::Invalid {
            field: "image.layers",
            message: format!("{} layers, at most {}", img.layers.len(), compose::MAX_LAYERS),
        });
    }
    let layers = img.layers.iter().map(|l| LayerId::parse(l)).collect::<Result<Vec<_>, _>>()?;
    if layers.iter().collect::<BTreeSet<_>>().len() != layers.len() {
        return Err(ImageError::Invalid {
            field: "image.layers",
            message: "a layer appears twice (overlay cannot stack the same layer twice)".into(),
        });
    }
    let c = img.config.clone().unwrap_or_default();
    check_list("image.config.env", &c.env)?;
    check_list("image.config.entrypoint", &c.entrypoint)?;
    check_list("image.config.cmd", &c.cmd)?;
    check_string("image.config.workdir", &c.workdir, 4096)?;
    check_string("image.config.user", &c.user, 256)?;
    check_string("image.source", &img.source, MAX_SOURCE_BYTES)?;
    Ok(Manifest {
        v: 1,
        project: r.project,
        repo: r.repo,
        tag: r.tag,
        layers,
        config: ImageConfig { env: c.env, workdir: c.workdir, user: c.user, entrypoint: c.entrypoint, cmd: c.cmd },
        created_at_ms: now_ms,
        source: img.source.clone(),
        vm_snapshot: String::new(),
    })
}

/// Writes a manifest (refusing an existing name unless `replace`) and clears the cache. The
/// image is charged to its project's `store_bytes` first (IAM: the layers and snapshot files
/// it names, with their sizes, each distinct one counted once in the project and each
/// ancestor): past a limit it is `quota_exceeded` and nothing is written. A crash between the
/// charge and the write over-counts until the name is deleted or published again.
async fn publish(s: &Shared, m: Manifest, replace: bool) -> Result<pb::Image, ApiError> {
    let store = s.images.store.clone();
    let mc = m.clone();
    let parts = blocking(move || {
        let r = ImageRef::new(&mc.project, &mc.repo, &mc.tag)?;
        if !replace && store.has_image(&r) {
            return Err(StoreError::ImageExists(r.to_string()).into());
        }
        parts_of(&store, &mc)
    })
    .await?;
    let (project, name) = (m.project.clone(), format!("{}:{}", m.repo, m.tag));
    charge(s, &project, &name, parts.clone()).await?;
    let store = s.images.store.clone();
    let written = blocking(move || {
        gc::publish_manifest(&store, &m)?;
        // Whoever may use this image's project may now use its layers.
        for l in &m.layers {
            store.add_layer_user(l, &m.project)?;
        }
        // Two publications of one name at once (on this apiserver or another) may be charged
        // in one order and written in the other: what the store holds now is what counts.
        let now = store.read_manifest(&ImageRef::new(&m.project, &m.repo, &m.tag)?)?;
        let parts_now = parts_of(&store, &now)?;
        Ok::<_, ImageError>((m, now, parts_now))
    })
    .await;
    let (m, now, parts_now) = match written {
        Ok(w) => w,
        Err(e) => {
            // Nothing written: the charge goes (a replaced image's stays over-counted until
            // it is published or deleted again).
            if !replace {
                uncharge(s, &project, &name).await;
            }
            return Err(e.into());
        }
    };
    if parts_now != parts {
        // Another publication's manifest won: charge it. Past the quota, it goes.
        if let Err(e) = charge(s, &project, &name, parts_now).await {
            let store = s.images.store.clone();
            let gone = blocking(move || {
                let r = ImageRef::new(&now.project, &now.repo, &now.tag)?;
                if store.read_manifest(&r).is_ok_and(|held| held == now) {
                    store.delete_manifest(&r)?;
                }
                Ok::<_, ImageError>(())
            })
            .await;
            if let Err(g) = gone {
                tracing::warn!(project, image = name, error = %g, "could not remove an image over the store quota");
            }
            uncharge(s, &project, &name).await;
            s.images.invalidate();
            return Err(e);
        }
    }
    s.images.invalidate();
    tracing::info!(image = %format!("{}//{}:{}", m.project, m.repo, m.tag), layers = m.layers.len(), "image published");
    Ok(to_proto(&m))
}

/// The parts of the store manifest `m` names, with their sizes (what its charge counts).
fn parts_of(store: &Store, m: &Manifest) -> Result<Vec<pb::StoredPart>, ImageError> {
    let mut parts = Vec::with_capacity(m.layers.len() + 1);
    for l in &m.layers {
        parts.push(pb::StoredPart { id: l.to_string(), bytes: store.layer_meta(l)?.size_bytes });
    }
    if !m.vm_snapshot.is_empty() {
        let bytes = store.vm_snapshot(&m.vm_snapshot)?.bytes;
        parts.push(pb::StoredPart { id: format!("vm:{}", m.vm_snapshot), bytes });
    }
    Ok(parts)
}

/// Charges an image to its project's `store_bytes` (`quota_exceeded` past a limit).
async fn charge(s: &Shared, project: &str, name: &str, parts: Vec<pb::StoredPart>) -> Result<(), ApiError> {
    let req = pb::ChargeImageRequest { project: project.to_string(), name: name.to_string(), parts };
    s.up.iam(|mut c| {
        let r = req.clone();
        async move { c.charge_image(r).await }
    })
    .await
    .map(|_| ())
}

/// Takes an image's store charge away (best effort: a failure over-counts, and is logged).
async fn uncharge(s: &Shared, project: &str, name: &str) {
    let req = pb::UnchargeImageRequest { project: project.to_string(), name: name.to_string() };
    let r =
        s.up.iam(|mut c| {
            let r = req.clone();
            async move { c.uncharge_image(r).await }
        })
        .await;
    if let Err(e) = r {
        tracing::warn!(project, image = name, error = %e, "could not take an image's store charge away");
    }
}

/// Finds a source image; "not found" names where a search looked.
fn resolve_source(store: &Store, src: &Source, project: &str) -> Result<(ImageRef, Manifest), ImageError> {
    match (src.resolve(store, project), src) {
        (Err(StoreError::ImageNotFound(_)), Source::Search(name)) => {
            Err(ImageError::NotFound { name: name.clone(), project: project.to_string() })
        }
        (r, _) => r.map_err(ImageError::from),
    }
}

fn project_or(req: &str, caller_project: &str) -> Result<String, ApiError> {
    let p = if req.is_empty() { caller_project.to_string() } else { req.to_string() };
    ids::validate_project(&p)?;
    Ok(p)
}

/// The image a snapshot named `name` becomes, in `project`; an existing one is
/// `already_exists` (checked before the sandbox is frozen).
pub(crate) async fn snapshot_target(s: &Shared, project: &str, name: &str) -> Result<ImageRef, ApiError> {
    let target = ImageRef::parse(project, name).map_err(ImageError::from)?;
    let store = s.images.store.clone();
    let t = target.clone();
    blocking(move || {
        if store.has_image(&t) {
            return Err(ImageError::from(StoreError::ImageExists(t.to_string())));
        }
        Ok(())
    })
    .await?;
    Ok(target)
}

/// Registers a snapshot's image: the layers the edge stored, the config of the image the
/// sandbox was made from (as it is now; the default config if that image is gone).
pub(crate) async fn publish_snapshot(
    s: &Shared,
    target: ImageRef,
    source_image: &str,
    layers: &[String],
    sandbox_id: &str,
    vm_snapshot: &str,
) -> Result<pb::Image, ApiError> {
    let layers = layers.iter().map(|l| LayerId::parse(l)).collect::<Result<Vec<_>, _>>().map_err(ImageError::from)?;
    let store = s.images.store.clone();
    let (project, image) = (target.project.clone(), source_image.to_string());
    let config = blocking(move || Ok::<_, ImageError>(store.resolve(&project, &image).map(|(_, m)| m.config).ok()))
        .await?
        .unwrap_or_default();
    let m = Manifest {
        v: 1,
        project: target.project,
        repo: target.repo,
        tag: target.tag,
        layers,
        config,
        created_at_ms: time::now_ms(),
        source: format!("snapshot:{sandbox_id}"),
        vm_snapshot: vm_snapshot.to_string(),
    };
    publish(s, m, false).await
}

// ---------------------------------------------------------------------------------------------
// Handlers

async fn register_image(
    s: &Shared,
    call: &mut Call,
    md: MetadataMap,
    req: pb::RegisterImageRequest,
) -> Result<pb::Image, ApiError> {
    let (_, ident) = caller(s, call, &md).await?;
    let m = manifest_from_request(req.image.as_ref(), &ident.project, time::now_ms())?;
    call.project = Some(m.project.clone());
    s.authorize(&ident.principal, PERM_PUBLISH, &m.project).await?;
    authorize_layers(s, &ident.principal, &m.layers).await?;
    publish(s, m, req.replace).await
}

/// A manifest may name a stored layer only if the caller holds `layer.use` or `layer.publish`
/// on a project the layer was imported into or published in ([`Store::layer_users`]; layers
/// stored before users were recorded count as the root's): a builder publishes what it
/// imported, a runner re-tags what it may run. Layers are shared by content: without this,
/// knowing another project's private layer id would be enough to run it. A layer the caller
/// may not name is reported as missing, so that ids cannot be probed.
async fn authorize_layers(s: &Shared, principal: &str, layers: &[LayerId]) -> Result<(), ApiError> {
    let store = s.images.store.clone();
    let ids = layers.to_vec();
    let users = blocking(move || {
        ids.iter().map(|l| store.layer_users(l).map_err(ImageError::from)).collect::<Result<Vec<_>, _>>()
    })
    .await?;
    for (layer, users) in layers.iter().zip(users) {
        let users = if users.is_empty() { vec![ids::ROOT_PROJECT.to_string()] } else { users };
        let mut allowed = false;
        'users: for p in &users {
            for perm in [PERM_USE, PERM_PUBLISH] {
                if s.authorize(principal, perm, p).await.is_ok() {
                    allowed = true;
                    break 'users;
                }
            }
        }
        if !allowed {
            return Err(ImageError::from(StoreError::LayerNotFound(layer.to_string())).into());
        }
    }
    Ok(())
}

async fn compose_image(
    s: &Shared,
    call: &mut Call,
    md: MetadataMap,
    req: pb::ComposeImageRequest,
) -> Result<pb::Image, ApiError> {
    let (_, ident) = caller(s, call, &md).await?;
    let project = project_or(&req.project, &ident.project)?;
    call.project = Some(project.clone());
    let target = ImageRef::parse(&project, &req.name).map_err(ImageError::from)?;
    let too_many = match req.sources.len() {
        0 => Some(ComposeError::NoSources),
        n if n > compose::MAX_SOURCES => Some(ComposeError::TooManySources(n)),
        _ => None,
    };
    if let Some(e) = too_many {
        return Err(ImageError::from(e).into());
    }
    let sources =
        req.sources.iter().map(|src| Source::parse(src)).collect::<Result<Vec<_>, _>>().map_err(ImageError::from)?;
    s.authorize(&ident.principal, PERM_PUBLISH, &project).await?;
    let store = s.images.store.clone();
    let p = project.clone();
    let resolved =
        blocking(move || sources.iter().map(|src| resolve_source(&store, src, &p)).collect::<Result<Vec<_>, _>>())
            .await?;
    // Composing reads the sources: the caller must be allowed to use each of them.
    let used: BTreeSet<&str> = resolved.iter().map(|(r, _)| r.project.as_str()).collect();
    for p in used {
        s.authorize(&ident.principal, PERM_USE, p).await?;
    }
    let m = compose::compose(&target, &resolved, time::now_ms()).map_err(ImageError::from)?;
    publish(s, m, req.replace).await
}

async fn delete_image(
    s: &Shared,
    call: &mut Call,
    md: MetadataMap,
    req: pb::DeleteImageRequest,
) -> Result<pb::DeleteImageResponse, ApiError> {
    let (_, ident) = caller(s, call, &md).await?;
    let project = project_or(&req.project, &ident.project)?;
    call.project = Some(project.clone());
    let r = ImageRef::parse(&project, &req.name).map_err(ImageError::from)?;
    s.authorize(&ident.principal, PERM_PUBLISH, &project).await?;
    let store = s.images.store.clone();
    let name = format!("{}:{}", r.repo, r.tag);
    let deleted: Result<(), ApiError> =
        blocking(move || store.delete_manifest(&r).map_err(ImageError::from)).await.map_err(ApiError::from);
    // Gone (now, or before): its store charge goes too.
    if deleted.as_ref().is_ok() || deleted.as_ref().is_err_and(|e| e.reason == opendsec_common::Reason::NotFound) {
        uncharge(s, &project, &name).await;
    }
    deleted?;
    s.images.invalidate();
    Ok(pb::DeleteImageResponse {})
}

async fn list_images(
    s: &Shared,
    call: &mut Call,
    md: MetadataMap,
    req: pb::ListImagesRequest,
) -> Result<pb::ListImagesResponse, ApiError> {
    let (_, ident) = caller(s, call, &md).await?;
    let project = project_or(&req.project, &ident.project)?;
    call.project = Some(project.clone());
    s.authorize(&ident.principal, PERM_USE, &project).await?;
    let store = s.images.store.clone();
    let recursive = req.recursive;
    let list = blocking(move || store.list_manifests(&project, recursive).map_err(ImageError::from)).await?;
    Ok(pb::ListImagesResponse { images: list.iter().map(to_proto).collect() })
}

async fn get_image(
    s: &Shared,
    call: &mut Call,
    md: MetadataMap,
    req: pb::GetImageRequest,
) -> Result<pb::Image, ApiError> {
    let (_, ident) = caller(s, call, &md).await?;
    let project = project_or(&req.project, &ident.project)?;
    call.project = Some(project.clone());
    let source = Source::parse(&req.name).map_err(ImageError::from)?;
    let store = s.images.store.clone();
    let p = project.clone();
    let (r, m) = blocking(move || resolve_source(&store, &source, &p)).await?;
    s.authorize(&ident.principal, PERM_USE, &r.project).await?;
    Ok(to_proto(&m))
}

#[derive(Debug)]
pub struct ImagesService {
    shared: Arc<Shared>,
}

impl ImagesService {
    pub fn new(shared: Arc<Shared>) -> Self {
        ImagesService { shared }
    }
}

type Handler<Q, R> = for<'a> fn(&'a Shared, &'a mut Call, MetadataMap, Q) -> BoxFuture<'a, Result<R, ApiError>>;

async fn serve_call<Q: Send + 'static, R: Send + 'static>(
    shared: &Arc<Shared>,
    method: &'static str,
    request: Request<Q>,
    handler: Handler<Q, R>,
) -> Result<Response<R>, Status> {
    let (md, _, req) = request.into_parts();
    run(shared, method, move |s, call| handler(s, call, md, req)).await
}

#[tonic::async_trait]
impl Images for ImagesService {
    async fn register_image(&self, request: Request<pb::RegisterImageRequest>) -> Result<Response<pb::Image>, Status> {
        serve_call(&self.shared, "RegisterImage", request, |s, c, md, r| Box::pin(register_image(s, c, md, r))).await
    }

    async fn compose_image(&self, request: Request<pb::ComposeImageRequest>) -> Result<Response<pb::Image>, Status> {
        serve_call(&self.shared, "ComposeImage", request, |s, c, md, r| Box::pin(compose_image(s, c, md, r))).await
    }

    async fn delete_image(
        &self,
        request: Request<pb::DeleteImageRequest>,
    ) -> Result<Response<pb::DeleteImageResponse>, Status> {
        serve_call(&self.shared, "DeleteImage", request, |s, c, md, r| Box::pin(delete_image(s, c, md, r))).await
    }

    async fn list_images(
        &self,
        request: Request<pb::ListImagesRequest>,
    ) -> Result<Response<pb::ListImagesResponse>, Status> {
        serve_call(&self.shared, "ListImages", request, |s, c, md, r| Box::pin(list_images(s, c, md, r))).await
    }

    async fn get_image(&self, request: Request<pb::GetImageRequest>) -> Result<Response<pb::Image>, Status> {
        serve_call(&self.shared, "GetImage", request, |s, c, md, r| Box::pin(get_image(s, c, md, r))).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opendsec_common::Reason;

    fn id(n: u8) -> String {
        format!("{n:02x}").repeat(32)
    }

    fn image(layers: Vec<String>) -> pb::Image {
        pb::Image { repo: "library/busybox".into(), tag: "1.36".into(), layers, ..Default::default() }
    }

    #[test]
    fn a_register_request_becomes_a_checked_manifest() {
        let m = manifest_from_request(Some(&image(vec![id(1), format!("sha256:{}", id(2))])), "root/a", 7).unwrap();
        assert_eq!(
            (m.project.as_str(), m.repo.as_str(), m.tag.as_str(), m.created_at_ms),
            ("root/a", "library/busybox", "1.36", 7)
        );
        assert_eq!(m.layers.iter().map(|l| l.to_string()).collect::<Vec<_>>(), [id(1), id(2)]);

        let reason =
            |img: Option<pb::Image>| ApiError::from(manifest_from_request(img.as_ref(), "root", 1).unwrap_err()).reason;
        assert_eq!(reason(None), Reason::InvalidArgument);
        assert_eq!(reason(Some(image(vec![]))), Reason::InvalidArgument);
        assert_eq!(reason(Some(image(vec!["../../etc".into()]))), Reason::InvalidArgument);
        assert_eq!(reason(Some(image(vec![id(1), id(1)]))), Reason::InvalidArgument);
        assert_eq!(reason(Some(pb::Image { repo: "A//b".into(), ..image(vec![id(1)]) })), Reason::InvalidArgument);
        assert_eq!(
            reason(Some(pb::Image { project: "elsewhere".into(), ..image(vec![id(1)]) })),
            Reason::InvalidArgument
        );
        let mut big = image(vec![id(1)]);
        big.config = Some(pb::ImageConfig { env: vec!["A=1".into(); 2000], ..Default::default() });
        assert_eq!(reason(Some(big)), Reason::InvalidArgument);
    }

    #[test]
    fn store_errors_map_to_reasons() {
        let io = StoreError::Io { path: "/x".into(), source: std::io::Error::other("nfs gone") };
        assert_eq!(ApiError::from(ImageError::Store(io)).reason, Reason::Unavailable);
        assert_eq!(ApiError::from(ImageError::Store(StoreError::LayerNotFound(id(3)))).reason, Reason::NotFound);
        let e = ApiError::from(ImageError::NotFound { name: "busybox".into(), project: "root/a".into() });
        assert_eq!(e.reason, Reason::NotFound);
        assert_eq!(e.message, "image busybox not found in root/a or above");
        assert_eq!(
            ApiError::from(ImageError::Store(StoreError::ImageExists("x".into()))).reason,
            Reason::AlreadyExists
        );
    }

    #[tokio::test]
    async fn resolutions_are_cached_and_a_write_clears_them() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let images = ImageStore::new(store);
        let e = images.resolve("root/a", "busybox").await.unwrap_err();
        assert!(matches!(e, ImageError::NotFound { .. }), "{e:?}");
        // Put an image in place behind the cache's back: the cached "not found" holds.
        let s = &images.store;
        let p = s.begin_layer().unwrap();
        let meta = opendsec_images::LayerMeta {
            v: 1,
            id: LayerId::parse(&id(1)).unwrap(),
            size_bytes: 0,
            entries: 0,
            created_at_ms: 1,
            source: String::new(),
            diff_id: String::new(),
            lowers: vec![],
        };
        s.commit_layer(p, &meta).unwrap();
        let m = manifest_from_request(
            Some(&pb::Image {
                repo: "busybox".into(),
                tag: "latest".into(),
                layers: vec![id(1)],
                ..Default::default()
            }),
            "root",
            1,
        )
        .unwrap();
        gc::publish_manifest(s, &m).unwrap();
        assert!(images.resolve("root/a", "busybox").await.is_err());
        images.invalidate();
        assert_eq!(images.resolve("root/a", "busybox").await.unwrap().project, "root");
        assert_eq!(images.resolve("root/a", "root//busybox:latest").await.unwrap().project, "root");
        assert!(matches!(
            images.resolve("root/a", "Bad Name").await,
            Err(ImageError::Store(StoreError::InvalidName { .. }))
        ));
    }
}
