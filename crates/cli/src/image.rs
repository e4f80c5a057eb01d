//! `opendsecctl image ...`: the Images API (list, get, compose, delete, and the registration
//! step of import) and the local store tools (import into the store, gc, store-check, merge).
//!
//! Local tools work on the store directory itself (`--store DIR`, env `OPENDSEC_IMAGE_STORE`,
//! else `images.store_dir` of `--config FILE`, else `opendsec-state/images`), as root, like the
//! edges that mount it. Import puts layers in the store, then registers the image through the
//! apiserver (which checks `layer.publish`); `--no-register` only prints the layer ids.

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use clap::{Args, Subcommand};
use opendsec_client::Client;
use opendsec_common::ApiError;
use opendsec_common::config::{Config, ImagesConfig};
use opendsec_images::import::{self, Credentials, ImportOptions, Imported};
use opendsec_images::layer::Limits;
use opendsec_images::offline;
use opendsec_images::{ImageRef, LayerId, Store, gc, merge, storecheck};
use opendsec_proto::v1 as pb;
use serde_json::{Value, json};

use crate::error::CtlError;
use crate::json as j;
use crate::output::Out;

/// Where the store is, for the local tools.
#[derive(Args, Debug, Clone, Default)]
pub struct StoreArgs {
    /// The image store directory.
    #[arg(long, env = "OPENDSEC_IMAGE_STORE")]
    pub store: Option<PathBuf>,
    /// Cluster config to take `images.*` (store, limits, GC grace) from.
    #[arg(long)]
    pub config: Option<PathBuf>,
}

impl StoreArgs {
    fn images_config(&self) -> Result<(PathBuf, ImagesConfig), CtlError> {
        let cfg = match &self.config {
            Some(p) => Config::load(p).map_err(|e| CtlError::Local(e.to_string()))?,
            None => Config::default(),
        };
        let dir = self.store.clone().unwrap_or_else(|| cfg.image_store_dir());
        Ok((dir, cfg.images))
    }

    fn open(&self) -> Result<(Store, ImagesConfig), CtlError> {
        let (dir, images) = self.images_config()?;
        let store = Store::open(&dir).map_err(|e| CtlError::Local(format!("image store {}: {e}", dir.display())))?;
        Ok((store, images))
    }
}

/// The unpack bounds of the config (`images.*`); the path length bound stays the default.
pub fn limits(c: &ImagesConfig) -> Limits {
    Limits {
        max_file_bytes: c.max_file_bytes,
        max_layer_bytes: c.max_layer_bytes,
        max_entries: c.max_entries,
        max_depth: c.max_depth,
        max_image_bytes: c.max_image_bytes,
        ..Limits::default()
    }
}

#[derive(Args, Debug)]
pub struct ImportArgs {
    /// `host[:port]/repo[:tag|@sha256:...]` (no host: Docker Hub). With --oci-layout: the tag
    /// to take from the layout (needed when it holds several images).
    pub reference: Option<String>,
    #[arg(long, requires = "password_stdin")]
    pub username: Option<String>,
    /// Read the password (or token) from the first line of stdin.
    #[arg(long, requires = "username")]
    pub password_stdin: bool,
    /// docker's config.json with saved credentials (default: $DOCKER_CONFIG or ~/.docker).
    #[arg(long)]
    pub docker_config: Option<PathBuf>,
    /// Plain http to the registry (a local registry such as 127.0.0.1:5000).
    #[arg(long)]
    pub insecure: bool,
    /// Import from an OCI image layout directory instead of a registry.
    #[arg(long, conflicts_with_all = ["docker_archive", "rootfs"])]
    pub oci_layout: Option<PathBuf>,
    /// Import from a `docker save` archive.
    #[arg(long, conflicts_with_all = ["oci_layout", "rootfs"])]
    pub docker_archive: Option<PathBuf>,
    /// Import a plain root file system (a directory or a tarball) as one layer.
    #[arg(long, conflicts_with_all = ["oci_layout", "docker_archive"])]
    pub rootfs: Option<PathBuf>,
    #[command(flatten)]
    pub store: StoreArgs,
    /// The image's name in the project, `repo[:tag]` (default: from the reference or the file).
    #[arg(long)]
    pub name: Option<String>,
    /// Only put the layers in the store and print their ids.
    #[arg(long)]
    pub no_register: bool,
    /// Replace an image of the same name.
    #[arg(long)]
    pub replace: bool,
    /// Longest silence from the registry before giving up.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    pub timeout: Duration,
}

#[derive(Subcommand, Debug)]
pub enum ImageCmd {
    /// Import an image into the store (from a registry, an OCI layout, a docker archive or a
    /// root file system) and register it in the project.
    #[command(after_help = "Examples (as root, beside the cluster; the store is OPENDSEC_IMAGE_STORE or \
    opendsec-state/images):\n  \
    opendsecctl image import 127.0.0.1:5000/library/python:3.12 --insecure\n  \
    opendsecctl image import --rootfs /var/cache/opendsec/debian-bookworm-*/rootfs --name debian:bookworm\n  \
    opendsecctl image import --oci-layout ./layout app:v1\n  \
    opendsecctl image import --docker-archive ./app.tar --name app:v1")]
    Import(ImportArgs),
    /// Images of the project (--project; default: the caller's).
    List {
        /// Include every subproject.
        #[arg(long)]
        recursive: bool,
    },
    /// One image, found as a sandbox in the project would find it (`repo[:tag]` from the
    /// project upward, or `project//repo:tag`).
    Get { name: String },
    /// A new image from the layers of others, in order (the first at the bottom); copies no data.
    Compose {
        /// `repo[:tag]` of the new image.
        name: String,
        /// Source images, bottom first.
        #[arg(required = true)]
        sources: Vec<String>,
        #[arg(long)]
        replace: bool,
    },
    /// Remove an image's name (its layers stay until `image gc`).
    Delete { name: String },
    /// Remove layers nothing references and interrupted writes, once older than the grace.
    Gc {
        #[command(flatten)]
        store: StoreArgs,
        /// Default: `images.gc_grace` of the config (1h).
        #[arg(long, value_parser = humantime::parse_duration)]
        grace: Option<Duration>,
        /// Report what would be removed; change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Try in DIR each capability the store needs; exit 1 when any fails.
    StoreCheck { dir: PathBuf },
    /// Squash a run of layers (bottom first) into one; prints the new layer id.
    Merge {
        #[command(flatten)]
        store: StoreArgs,
        #[arg(required = true)]
        layers: Vec<String>,
        /// The layers below the run (bottom first), as the image stacks them.
        #[arg(long = "lower")]
        lowers: Vec<String>,
    },
}

fn image_name(i: &pb::Image) -> String {
    format!("{}//{}:{}", i.project, i.repo, i.tag)
}

fn image_text(i: &pb::Image) -> String {
    let c = i.config.clone().unwrap_or_default();
    let mut s = format!("{}\n  source:  {}\n  layers:", image_name(i), i.source);
    for l in &i.layers {
        s.push_str(&format!("\n    {l}"));
    }
    for (k, v) in [("env", c.env.join(" ")), ("entrypoint", c.entrypoint.join(" ")), ("cmd", c.cmd.join(" "))] {
        if !v.is_empty() {
            s.push_str(&format!("\n  {k}: {v}"));
        }
    }
    for (k, v) in [("workdir", &c.workdir), ("user", &c.user)] {
        if !v.is_empty() {
            s.push_str(&format!("\n  {k}: {v}"));
        }
    }
    s
}

fn local<E: std::fmt::Display>(what: &str) -> impl FnOnce(E) -> CtlError + '_ {
    move |e| CtlError::Local(format!("{what}: {e}"))
}

/// Runs one image command (the local tools never call `client`).
pub async fn run(client: &Client, out: &Out, project: Option<&str>, cmd: ImageCmd) -> Result<(), CtlError> {
    let project = project.unwrap_or_default().to_string();
    match cmd {
        ImageCmd::Import(args) => import_cmd(client, out, &project, args).await,
        ImageCmd::List { recursive } => {
            let r = client.list_images(pb::ListImagesRequest { project, recursive }).await?;
            out.print(Value::Array(r.images.iter().map(j::of).collect()), || {
                let mut t = crate::table::Table::new(&["IMAGE", "PROJECT", "LAYERS", "SOURCE"]);
                for i in &r.images {
                    t.row(vec![
                        format!("{}:{}", i.repo, i.tag),
                        i.project.clone(),
                        i.layers.len().to_string(),
                        i.source.clone(),
                    ]);
                }
                t.render("no images")
            });
            Ok(())
        }
        ImageCmd::Get { name } => {
            let i = client.get_image(pb::GetImageRequest { project, name }).await?;
            out.print(j::of(&i), || image_text(&i));
            Ok(())
        }
        ImageCmd::Compose { name, sources, replace } => {
            let i = client.compose_image(pb::ComposeImageRequest { project, name, sources, replace }).await?;
            out.print(j::of(&i), || format!("composed {} ({} layers)", image_name(&i), i.layers.len()));
            Ok(())
        }
        ImageCmd::Delete { name } => {
            client.delete_image(pb::DeleteImageRequest { project: project.clone(), name: name.clone() }).await?;
            out.print(json!({"deleted": name, "project": project}), || format!("deleted {name}"));
            Ok(())
        }
        ImageCmd::Gc { store, grace, dry_run } => {
            let (store, images) = store.open()?;
            let grace = grace.unwrap_or(images.gc_grace);
            let report = tokio::task::spawn_blocking(move || gc::gc(&store, grace, SystemTime::now(), dry_run))
                .await
                .map_err(local("gc"))?
                .map_err(local("gc"))?;
            let verb = if dry_run { "would remove" } else { "removed" };
            out.print(serde_json::to_value(&report).unwrap_or_default(), || {
                let mut s = format!(
                    "{verb} {} layers ({} bytes), {} vm snapshots and {} interrupted writes; kept {} referenced, {} within the grace period",
                    report.removed.len(),
                    report.bytes_freed,
                    report.snapshots_removed.len(),
                    report.tmp_removed.len(),
                    report.kept,
                    report.young.len()
                );
                for l in &report.removed {
                    s.push_str(&format!("\n  {verb} layer {l}"));
                }
                for l in &report.missing {
                    s.push_str(&format!("\n  missing: layer {l} is referenced but not in the store"));
                }
                for w in report.warnings.iter().chain(&report.errors) {
                    s.push_str(&format!("\n  {w}"));
                }
                s
            });
            if report.errors.is_empty() {
                Ok(())
            } else {
                Err(CtlError::Local(format!("{} removals failed", report.errors.len())))
            }
        }
        ImageCmd::StoreCheck { dir } => {
            let d = dir.clone();
            let checks =
                tokio::task::spawn_blocking(move || storecheck::store_check(&d)).await.map_err(local("store-check"))?;
            out.print(serde_json::to_value(&checks).unwrap_or_default(), || {
                checks
                    .iter()
                    .map(|c| match (c.ok, c.required) {
                        (true, _) => format!("PASS  {:<16}  {}", c.name, c.detail),
                        (false, true) => format!("FAIL  {:<16}  {}\n      fix: {}", c.name, c.detail, c.fix),
                        (false, false) => format!("WARN  {:<16}  {}\n      fix: {}", c.name, c.detail, c.fix),
                    })
                    .collect::<Vec<_>>()
                    .join("\n")
            });
            let failed = checks.iter().filter(|c| !c.ok && c.required).count();
            if failed == 0 {
                Ok(())
            } else {
                Err(CtlError::Local(format!("{failed} of {} checks failed in {}", checks.len(), dir.display())))
            }
        }
        ImageCmd::Merge { store, layers, lowers } => {
            let (store, _) = store.open()?;
            let parse = |v: &[String]| {
                v.iter()
                    .map(|l| LayerId::parse(l))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| CtlError::Api(ApiError::invalid(e.to_string())))
            };
            let (layers, lowers) = (parse(&layers)?, parse(&lowers)?);
            let meta = tokio::task::spawn_blocking(move || merge::merge_layers(&store, &layers, &lowers))
                .await
                .map_err(local("merge"))?
                .map_err(local("merge"))?;
            out.print(json!({"layer": meta.id, "size_bytes": meta.size_bytes, "entries": meta.entries}), || {
                meta.id.to_string()
            });
            Ok(())
        }
    }
}

/// The image name a reference implies: `host[:port]/repo[:tag|@digest]` → `repo:tag` (a
/// digest without a tag gives the tag `sha256-<first 16 hex>`).
pub fn name_from_reference(reference: &str) -> Option<String> {
    let (rest, digest) = match reference.split_once('@') {
        Some((r, d)) => (r, Some(d)),
        None => (reference, None),
    };
    let path = match rest.split_once('/') {
        // Docker's rule: a first component with '.' or ':', or "localhost", is a registry host.
        Some((first, path)) if first.contains(['.', ':']) || first == "localhost" => path,
        _ => rest,
    };
    let (repo, tag) = match path.rsplit_once(':') {
        Some((r, t)) if !t.contains('/') => (r, Some(t.to_string())),
        _ => (path, None),
    };
    let tag = tag.or_else(|| {
        digest.map(|d| format!("sha256-{}", d.trim_start_matches("sha256:").chars().take(16).collect::<String>()))
    });
    let name = format!("{repo}:{}", tag.unwrap_or_else(|| "latest".into()));
    ImageRef::parse("root", &name).ok().map(|r| r.name())
}

/// An image name from a file or directory name: lowercased, other characters as '-'.
pub fn name_from_path(path: &Path, tag: Option<&str>) -> Option<String> {
    let stem = path.file_stem()?.to_string_lossy().to_ascii_lowercase();
    let stem = stem.strip_suffix(".tar").unwrap_or(&stem);
    let repo: String =
        stem.chars().map(|c| if c.is_ascii_alphanumeric() || "._-".contains(c) { c } else { '-' }).collect();
    let repo = repo.trim_start_matches(['.', '_', '-']);
    ImageRef::parse("root", &format!("{repo}:{}", tag.unwrap_or("latest"))).ok().map(|r| r.name())
}

fn read_password() -> Result<String, CtlError> {
    let mut line = String::new();
    std::io::stdin().lock().read_line(&mut line).map_err(local("reading the password from stdin"))?;
    let pw = line.trim_end_matches(['\n', '\r']).to_string();
    if pw.is_empty() {
        return Err(CtlError::Local("--password-stdin: stdin held no password".into()));
    }
    Ok(pw)
}

async fn import_cmd(client: &Client, out: &Out, project: &str, args: ImportArgs) -> Result<(), CtlError> {
    let (store, images) = args.store.open()?;
    let credentials = match (&args.username, args.password_stdin) {
        (Some(u), true) => Some(Credentials { username: u.clone(), password: read_password()? }),
        _ => None,
    };
    // The project the layers are imported for (the caller's when registering and none is
    // named; none at all with --no-register and no --project): its users may name them in
    // manifests. Layers stored for other projects are reused only after their blob is read
    // and matches.
    let target = match (project, args.no_register) {
        ("", true) => None,
        ("", false) => Some(client.who_am_i(pb::WhoAmIRequest {}).await?.project),
        (p, _) => Some(p.to_string()),
    };
    let opts = ImportOptions {
        credentials,
        docker_config: args.docker_config.clone(),
        insecure_http: args.insecure,
        limits: limits(&images),
        progress: !out.json,
        timeout: args.timeout,
        for_project: target.clone(),
    };
    let reference = args.reference.as_deref();
    let derived = || -> Option<String> {
        match (&args.oci_layout, &args.docker_archive, &args.rootfs) {
            (Some(d), _, _) => name_from_path(d, reference),
            (_, Some(f), _) => name_from_path(f, None),
            (_, _, Some(p)) => name_from_path(p, None),
            _ => reference.and_then(name_from_reference),
        }
    };
    let name = match args.name.clone().or_else(derived) {
        Some(n) => n,
        None if args.no_register => String::new(),
        None => return Err(CtlError::Api(ApiError::invalid("cannot derive an image name: give --name repo:tag"))),
    };
    let imported: Imported = match (&args.oci_layout, &args.docker_archive, &args.rootfs) {
        (Some(dir), _, _) => offline::import_oci_layout(&store, dir, reference, &opts).await,
        (_, Some(file), _) => offline::import_docker_archive(&store, file, &opts).await,
        (_, _, Some(path)) => offline::import_rootfs(&store, path, &opts).await,
        _ => {
            let r = reference.ok_or_else(|| {
                CtlError::Api(ApiError::invalid(
                    "image import needs a reference (or --oci-layout, --docker-archive, --rootfs)",
                ))
            })?;
            import::import_from_registry(&store, r, &opts).await
        }
    }
    .map_err(local("import"))?;

    let layers: Vec<String> = imported.layers.iter().map(|l| l.to_string()).collect();
    let summary = json!({
        "source": imported.source,
        "layers": layers,
        "fetched_layers": imported.fetched_layers,
        "reused_layers": imported.reused_layers,
    });
    if let Some(t) = &target {
        for l in &imported.layers {
            store.add_layer_user(l, t).map_err(local("record the layer's project"))?;
        }
    }
    if args.no_register {
        // Recorded for a project named here (no cluster is asked): a later registration by
        // someone who may use it can name the layers.
        out.print(summary, || layers.join("\n"));
        return Ok(());
    }
    let (repo, tag) = {
        let r = ImageRef::parse("root", &name).map_err(|e| CtlError::Api(ApiError::invalid(e.to_string())))?;
        (r.repo, r.tag)
    };
    let c = &imported.config;
    let image = pb::Image {
        project: project.to_string(),
        repo,
        tag,
        layers: layers.clone(),
        config: Some(pb::ImageConfig {
            env: c.env.clone(),
            workdir: c.workdir.clone(),
            user: c.user.clone(),
            entrypoint: c.entrypoint.clone(),
            cmd: c.cmd.clone(),
        }),
        created_at_ms: 0,
        source: imported.source.clone(),
        vm_snapshot: String::new(),
    };
    let registered =
        client.register_image(pb::RegisterImageRequest { image: Some(image), replace: args.replace }).await?;
    let mut value = summary;
    value["image"] = j::of(&registered);
    out.print(value, || {
        format!(
            "imported {} ({} layers: {} fetched, {} already stored)\nregistered {}",
            imported.source,
            layers.len(),
            imported.fetched_layers,
            imported.reused_layers,
            image_name(&registered)
        )
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_come_from_references_and_paths() {
        for (reference, name) in [
            ("busybox", "busybox:latest"),
            ("library/busybox:1.36", "library/busybox:1.36"),
            ("127.0.0.1:5000/tools/python:3.12", "tools/python:3.12"),
            ("localhost/x", "x:latest"),
            ("registry.example.com/a/b@sha256:0123456789abcdef0123", "a/b:sha256-0123456789abcdef"),
            ("host:5000/app:v1@sha256:00", "app:v1"),
        ] {
            assert_eq!(name_from_reference(reference).as_deref(), Some(name), "{reference}");
        }
        assert_eq!(name_from_reference("UPPER/Case"), None);
        assert_eq!(name_from_path(Path::new("/tmp/My Image.tar"), None).as_deref(), Some("my-image:latest"));
        assert_eq!(name_from_path(Path::new("/srv/layouts/busybox"), Some("1.36")).as_deref(), Some("busybox:1.36"));
        assert_eq!(name_from_path(Path::new("/x/rootfs.tar.gz"), None).as_deref(), Some("rootfs:latest"));
    }

    #[test]
    fn the_command_line_is_consistent() {
        <crate::ctl::Cli as clap::CommandFactory>::command().debug_assert();
    }

    #[test]
    fn limits_mirror_the_config() {
        let c = ImagesConfig {
            max_file_bytes: 1,
            max_layer_bytes: 2,
            max_entries: 3,
            max_depth: 4,
            max_image_bytes: 5,
            ..Default::default()
        };
        let l = limits(&c);
        assert_eq!(
            (l.max_file_bytes, l.max_layer_bytes, l.max_entries, l.max_depth, l.max_image_bytes),
            (1, 2, 3, 4, 5)
        );
        assert_eq!(l.max_path_bytes, Limits::default().max_path_bytes);
        // The defaults agree.
        let d = limits(&ImagesConfig::default());
        assert_eq!(d, Limits::default());
    }
}
