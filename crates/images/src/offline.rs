//! Offline imports: an OCI image layout directory, a `docker save` archive, and a plain root
//! file system (a directory or a tarball) made into one layer.
//!
//! Invariants: the same as registry imports (see [`crate::import`]): digests are checked
//! (blobs of a layout against their names before anything is unpacked, layers against the
//! config's diff ids), layers already stored are not unpacked again, and a failure leaves no
//! layer and no temporary file. Archives are read in place: an uncompressed `docker save` tar
//! is indexed once and each layer is read straight from its offset; only a compressed archive
//! is decompressed once into a temporary file (random access needs it). Paths inside an
//! archive or a layout never become file system paths except as validated digests.

use std::collections::HashMap;
use std::fs::File;
use std::io::{self, BufReader, Read, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::decompress::{self, Compression};
use crate::import::{Blob, ImportError, ImportOptions, Imported, LayerJob, import_layers, unpack_blocking};
use crate::layer::{Limits, import_layer};
use crate::progress::{LayerProgress, Progress};
use crate::registry::RegistryError;
use crate::registry::manifest::{
    self, Descriptor, ImageIndex, ImageManifest, ManifestDoc, OCI_INDEX, choose_amd64, sha256_digest, trunc,
    validate_digest,
};
use crate::store::{ImageConfig, LayerMeta, Store};

const REF_NAME: &str = "org.opencontainers.image.ref.name";
/// Entries in a `docker save` archive we are willing to index.
const MAX_ARCHIVE_ENTRIES: usize = 1_000_000;

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> ImportError + '_ {
    move |source| ImportError::Io { path: path.to_path_buf(), source }
}

fn invalid(path: &Path, why: impl Into<String>) -> ImportError {
    ImportError::InvalidArchive { path: path.to_path_buf(), why: why.into() }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ImportError> + Send + 'static,
) -> Result<T, ImportError> {
    tokio::task::spawn_blocking(f).await.unwrap_or_else(|e| {
        if e.is_panic() { std::panic::resume_unwind(e.into_panic()) } else { Err(ImportError::Interrupted) }
    })
}

// ---------------------------------------------------------------------------------------------
// OCI image layout

/// Where a blob of an OCI layout lives (the digest is validated, so the path stays inside).
fn layout_blob(dir: &Path, digest: &str) -> Result<PathBuf, ImportError> {
    let hex = validate_digest(digest)?;
    Ok(dir.join("blobs/sha256").join(hex))
}

/// Reads a small file whole, refusing more than `limit` bytes.
async fn read_small(path: &Path, limit: u64) -> Result<Vec<u8>, ImportError> {
    let f = tokio::fs::File::open(path).await.map_err(io_err(path))?;
    let mut out = Vec::new();
    use tokio::io::AsyncReadExt;
    f.take(limit + 1).read_to_end(&mut out).await.map_err(io_err(path))?;
    if out.len() as u64 > limit {
        return Err(RegistryError::TooLarge { what: path.display().to_string(), size: out.len() as u64, limit }.into());
    }
    Ok(out)
}

/// A small blob of a layout, size and digest checked.
async fn layout_small_blob(dir: &Path, d: &Descriptor, limit: u64) -> Result<Vec<u8>, ImportError> {
    let what = format!("blob {}", d.digest());
    if d.size() > limit {
        return Err(RegistryError::TooLarge { what, size: d.size(), limit }.into());
    }
    let bytes = read_small(&layout_blob(dir, d.digest().as_ref())?, limit).await?;
    if bytes.len() as u64 != d.size() {
        return Err(RegistryError::SizeMismatch { what, expected: d.size(), actual: bytes.len() as u64 }.into());
    }
    manifest::verify_digest(&what, d.digest().as_ref(), &bytes)?;
    Ok(bytes)
}

fn ref_names(index: &ImageIndex) -> Vec<String> {
    let mut names: Vec<String> =
        index.manifests().iter().filter_map(|d| manifest::annotation(d, REF_NAME)).map(|n| trunc(n)).collect();
    names.sort();
    names.dedup();
    names
}

/// Whether a `ref.name` annotation names `tag`: skopeo writes the bare tag, buildkit a whole
/// reference (`docker.io/library/x:tag`).
fn ref_name_matches(name: &str, tag: &str) -> bool {
    name == tag || name.rsplit_once(':').is_some_and(|(repo, t)| t == tag && !t.contains('/') && !repo.is_empty())
}

/// Which entry of a layout's index.json to import.
fn choose_in_layout(dir: &Path, index: &ImageIndex, tag: Option<&str>) -> Result<Descriptor, ImportError> {
    let shown = dir.display().to_string();
    let candidates: Vec<Descriptor> = match tag {
        Some(t) => index
            .manifests()
            .iter()
            .filter(|d| manifest::annotation(d, REF_NAME).is_some_and(|n| ref_name_matches(n, t)))
            .cloned()
            .collect(),
        None => {
            let names = ref_names(index);
            if names.len() > 1 {
                return Err(ImportError::Ambiguous { path: dir.to_path_buf(), names });
            }
            index.manifests().clone()
        }
    };
    match candidates.len() {
        0 if tag.is_some() => Err(RegistryError::ManifestNotFound {
            reference: format!("{} in {shown} (it has: {})", tag.unwrap_or(""), ref_names(index).join(", ")),
        }
        .into()),
        0 => Err(invalid(dir, "index.json lists no image")),
        1 => candidates.into_iter().next().ok_or_else(|| invalid(dir, "index.json lists no image")),
        // Several entries under one name: the platforms of one image.
        _ => Ok(choose_amd64(&shown, &candidates).cloned()?),
    }
}

/// Follows a descriptor of a layout to its image manifest (through at most one index).
async fn layout_manifest(dir: &Path, mut d: Descriptor) -> Result<(ImageManifest, String), ImportError> {
    for _ in 0..2 {
        let bytes = layout_small_blob(dir, &d, manifest::MAX_MANIFEST_BYTES).await?;
        let what = format!("manifest {}", d.digest());
        let media_type = d.media_type().to_string();
        let media_type = Some(media_type.as_str()).filter(|m| !m.is_empty());
        match manifest::parse_manifest(&what, &bytes, media_type)? {
            ManifestDoc::Image(m) => return Ok((m, d.digest().to_string())),
            ManifestDoc::Index(i) => {
                d = choose_amd64(&format!("{}@{}", dir.display(), d.digest()), i.manifests())?.clone()
            }
        }
    }
    Err(invalid(dir, "indexes nested more than one level deep"))
}

/// Imports an image from an OCI image layout directory (`oci-layout`, `index.json`,
/// `blobs/sha256/...`). `tag` picks the entry whose `org.opencontainers.image.ref.name` is
/// that tag; without it the layout must hold one image (possibly for several platforms).
pub async fn import_oci_layout(
    store: &Store,
    dir: &Path,
    tag: Option<&str>,
    opts: &ImportOptions,
) -> Result<Imported, ImportError> {
    #[derive(Deserialize)]
    struct OciLayout {
        #[serde(rename = "imageLayoutVersion")]
        version: String,
    }
    let layout_file = dir.join("oci-layout");
    let layout = read_small(&layout_file, 4096).await.map_err(|e| match e {
        ImportError::Io { source, .. } if source.kind() == io::ErrorKind::NotFound => {
            invalid(dir, "not an OCI image layout (no oci-layout file)")
        }
        e => e,
    })?;
    let layout: OciLayout = serde_json::from_slice(&layout)
        .map_err(|source| RegistryError::Json { what: layout_file.display().to_string(), source })?;
    if !layout.version.starts_with("1.") {
        return Err(invalid(dir, format!("image layout version {:?} (expected 1.x)", trunc(&layout.version))));
    }
    let index_bytes = read_small(&dir.join("index.json"), manifest::MAX_MANIFEST_BYTES).await?;
    let index = match manifest::parse_manifest("index.json", &index_bytes, Some(OCI_INDEX))? {
        ManifestDoc::Index(i) => i,
        ManifestDoc::Image(_) => return Err(invalid(dir, "index.json is an image manifest, not an index")),
    };
    let chosen = choose_in_layout(dir, &index, tag)?;
    let (manifest, manifest_digest) = layout_manifest(dir, chosen).await?;
    let config_bytes = layout_small_blob(dir, manifest.config(), manifest::MAX_CONFIG_BYTES).await?;
    let config = manifest::parse_config(
        &format!("config {}", manifest.config().digest()),
        &config_bytes,
        manifest.layers().len(),
    )?;
    let jobs = crate::import::layer_jobs(&manifest, &config);
    let mut ranges = Vec::with_capacity(manifest.layers().len());
    for l in manifest.layers() {
        if l.size() > opts.limits.max_layer_bytes {
            return Err(RegistryError::TooLarge {
                what: format!("blob {}", l.digest()),
                size: l.size(),
                limit: opts.limits.max_layer_bytes,
            }
            .into());
        }
        ranges.push((layout_blob(dir, l.digest().as_ref())?, l.size(), l.digest().to_string()));
    }
    let source = format!("oci-layout:{}@{}", dir.display(), manifest_digest);
    let progress = Progress::new(opts.progress);
    let fetch = move |i: usize, bar: LayerProgress| {
        let (path, len, digest) = ranges[i].clone();
        async move {
            bar.downloaded();
            Ok(Blob::Range { path, offset: 0, len, digest: Some(digest) })
        }
    };
    let (layers, fetched_layers, reused_layers) =
        import_layers(store, &jobs, &source, &opts.limits, opts.for_project.as_deref(), &progress, fetch).await?;
    Ok(Imported { layers, config: manifest::image_config(&config), source, fetched_layers, reused_layers })
}

// ---------------------------------------------------------------------------------------------
// docker save archives

/// An entry of an archive: its data's place, or a link to another entry.
#[derive(Clone, Debug, PartialEq, Eq)]
enum TarEntry {
    File { offset: u64, size: u64 },
    Link(String),
}

/// `a/./b/../c` -> `a/c`; `None` if it climbs out of the archive.
fn normalize(p: &str) -> Option<String> {
    let mut parts: Vec<&str> = Vec::new();
    for seg in p.split('/') {
        match seg {
            "" | "." => {}
            ".." => {
                parts.pop()?;
            }
            s => parts.push(s),
        }
    }
    Some(parts.join("/"))
}

/// Indexes the files and links of a tar (reading headers only, seeking over data).
fn index_tar(path: &Path) -> Result<HashMap<String, TarEntry>, ImportError> {
    let f = File::open(path).map_err(io_err(path))?;
    let mut archive = tar::Archive::new(BufReader::new(f));
    let bad_tar = |e: io::Error| invalid(path, format!("not a readable tar archive: {e}"));
    let mut out = HashMap::new();
    for entry in archive.entries_with_seek().map_err(bad_tar)? {
        let entry = entry.map_err(bad_tar)?;
        if out.len() >= MAX_ARCHIVE_ENTRIES {
            return Err(invalid(path, format!("more than {MAX_ARCHIVE_ENTRIES} entries")));
        }
        let name = String::from_utf8_lossy(&entry.path_bytes()).to_string();
        let Some(name) = normalize(&name) else { continue };
        let kind = entry.header().entry_type();
        let link = entry.link_name_bytes().map(|l| String::from_utf8_lossy(&l).to_string());
        let value = match (kind, link) {
            (tar::EntryType::Regular | tar::EntryType::Continuous, _) => {
                TarEntry::File { offset: entry.raw_file_position(), size: entry.size() }
            }
            // A symlink is relative to its directory; a hard link names an archive path.
            (tar::EntryType::Symlink, Some(l)) => {
                let parent = name.rsplit_once('/').map_or("", |(p, _)| p);
                let target = if l.starts_with('/') { l } else { format!("{parent}/{l}") };
                match normalize(&target) {
                    Some(t) => TarEntry::Link(t),
                    None => continue,
                }
            }
            (tar::EntryType::Link, Some(l)) => match normalize(&l) {
                Some(t) => TarEntry::Link(t),
                None => continue,
            },
            _ => continue,
        };
        out.insert(name, value);
    }
    Ok(out)
}

/// Finds the data of `name`, following links (docker save links identical layers).
fn lookup(path: &Path, entries: &HashMap<String, TarEntry>, name: &str) -> Result<(u64, u64), ImportError> {
    let mut cur =
        normalize(name).ok_or_else(|| invalid(path, format!("{:?} climbs out of the archive", trunc(name))))?;
    for _ in 0..8 {
        match entries.get(&cur) {
            Some(TarEntry::File { offset, size }) => return Ok((*offset, *size)),
            Some(TarEntry::Link(t)) => cur = t.clone(),
            None => return Err(invalid(path, format!("the archive has no file {:?}", trunc(name)))),
        }
    }
    Err(invalid(path, format!("{:?}: too many links", trunc(name))))
}

fn read_range(path: &Path, offset: u64, size: u64, limit: u64, what: &str) -> Result<Vec<u8>, ImportError> {
    if size > limit {
        return Err(RegistryError::TooLarge { what: what.into(), size, limit }.into());
    }
    let mut f = File::open(path).map_err(io_err(path))?;
    f.seek(SeekFrom::Start(offset)).map_err(io_err(path))?;
    let mut out = Vec::with_capacity(size as usize);
    f.take(size).read_to_end(&mut out).map_err(io_err(path))?;
    if out.len() as u64 != size {
        return Err(invalid(path, format!("{what} is truncated")));
    }
    Ok(out)
}

/// The digest a `docker save` file name implies: `blobs/sha256/<hex>` (docker 25+) or
/// `<hex>.json` (a legacy config, named by its digest).
fn digest_from_name(name: &str) -> Option<String> {
    let n = normalize(name)?;
    let hex = n.strip_prefix("blobs/sha256/").or_else(|| n.strip_suffix(".json").filter(|h| !h.contains('/')))?;
    let d = format!("sha256:{hex}");
    let ok = validate_digest(&d).is_ok();
    ok.then_some(d)
}

#[derive(Deserialize)]
struct SaveManifest {
    #[serde(rename = "Config")]
    config: String,
    #[serde(rename = "RepoTags", default)]
    repo_tags: Option<Vec<String>>,
    #[serde(rename = "Layers", default)]
    layers: Vec<String>,
}

/// What a `docker save` archive holds, read in a blocking task.
struct SaveArchive {
    /// The uncompressed tar (the archive itself, or `_decompressed`).
    tar: PathBuf,
    _decompressed: Option<tempfile::NamedTempFile>,
    config: manifest::ImageConfiguration,
    config_digest: String,
    layers: Vec<(u64, u64, Option<String>)>,
}

fn open_save_archive(archive: &Path, tmp_dir: &Path, limits: &Limits) -> Result<SaveArchive, ImportError> {
    let mut f = File::open(archive).map_err(io_err(archive))?;
    let mut head = [0u8; 4];
    let n = f.read(&mut head).map_err(io_err(archive))?;
    let compression = Compression::sniff(&head[..n]);
    let (tar, decompressed) = if compression == Compression::None {
        (archive.to_path_buf(), None)
    } else {
        // Random access needs a plain tar: decompress once, bounded.
        f.seek(SeekFrom::Start(0)).map_err(io_err(archive))?;
        let mut tmp =
            tempfile::Builder::new().prefix("archive-").suffix(".tar").tempfile_in(tmp_dir).map_err(io_err(tmp_dir))?;
        let limit = limits.max_layer_bytes.saturating_mul(4);
        let dec = decompress::decoder(BufReader::new(f), compression)
            .map_err(|e| invalid(archive, format!("cannot decompress: {e}")))?;
        let mut w = io::BufWriter::with_capacity(1 << 20, tmp.as_file_mut());
        let copied = io::copy(&mut dec.take(limit + 1), &mut w)
            .map_err(|e| invalid(archive, format!("cannot decompress: {e}")))?;
        w.flush().map_err(io_err(tmp_dir))?;
        drop(w);
        if copied > limit {
            return Err(RegistryError::TooLarge { what: archive.display().to_string(), size: copied, limit }.into());
        }
        (tmp.path().to_path_buf(), Some(tmp))
    };
    let entries = index_tar(&tar)?;
    let (off, size) = lookup(archive, &entries, "manifest.json")
        .map_err(|_| invalid(archive, "not a docker save archive (no manifest.json)"))?;
    let manifest_bytes = read_range(&tar, off, size, manifest::MAX_MANIFEST_BYTES, "manifest.json")?;
    let mut images: Vec<SaveManifest> = serde_json::from_slice(&manifest_bytes)
        .map_err(|source| RegistryError::Json { what: "manifest.json".into(), source })?;
    if images.len() != 1 {
        if images.is_empty() {
            return Err(invalid(archive, "manifest.json lists no image"));
        }
        let names = images
            .iter()
            .map(|i| i.repo_tags.clone().unwrap_or_default().join(" "))
            .map(|n| if n.is_empty() { "<untagged>".into() } else { trunc(&n) })
            .collect();
        return Err(ImportError::Ambiguous { path: archive.to_path_buf(), names });
    }
    let image = images.remove(0);
    if image.layers.len() > manifest::MAX_LAYERS {
        return Err(invalid(archive, format!("{} layers (at most {})", image.layers.len(), manifest::MAX_LAYERS)));
    }
    let (off, size) = lookup(archive, &entries, &image.config)?;
    let config_bytes = read_range(&tar, off, size, manifest::MAX_CONFIG_BYTES, "the image config")?;
    let config_digest = sha256_digest(&config_bytes);
    if let Some(expected) = digest_from_name(&image.config)
        && expected != config_digest
    {
        return Err(RegistryError::DigestMismatch {
            what: format!("config {}", trunc(&image.config)),
            expected,
            actual: config_digest,
        }
        .into());
    }
    let config =
        manifest::parse_config(&format!("config {}", trunc(&image.config)), &config_bytes, image.layers.len())?;
    let mut layers = Vec::with_capacity(image.layers.len());
    for name in &image.layers {
        let (off, size) = lookup(archive, &entries, name)?;
        layers.push((off, size, digest_from_name(name)));
    }
    Ok(SaveArchive { tar, _decompressed: decompressed, config, config_digest, layers })
}

/// Imports the image of a `docker save` archive (`manifest.json`, the config and the layer
/// tars; the archive itself may be gzip- or zstd-compressed). The archive must hold one image.
pub async fn import_docker_archive(store: &Store, tar: &Path, opts: &ImportOptions) -> Result<Imported, ImportError> {
    let archive = tar.to_path_buf();
    let tmp_dir = store.tmp_dir();
    let limits = opts.limits.clone();
    let save = blocking(move || open_save_archive(&archive, &tmp_dir, &limits)).await?;
    let jobs: Vec<LayerJob> = save
        .layers
        .iter()
        .zip(save.config.rootfs().diff_ids())
        .map(|((_, size, digest), diff_id)| LayerJob {
            blob_digest: digest.clone(),
            diff_id: diff_id.clone(),
            size: *size,
        })
        .collect();
    let source = format!("docker-archive:{}@{}", tar.display(), save.config_digest);
    let progress = Progress::new(opts.progress);
    let tar_path = save.tar.clone();
    let ranges = save.layers.clone();
    let fetch = move |i: usize, bar: LayerProgress| {
        let (offset, len, digest) = ranges[i].clone();
        let path = tar_path.clone();
        async move {
            bar.downloaded();
            Ok(Blob::Range { path, offset, len, digest })
        }
    };
    let (layers, fetched_layers, reused_layers) =
        import_layers(store, &jobs, &source, &opts.limits, opts.for_project.as_deref(), &progress, fetch).await?;
    let config = manifest::image_config(&save.config);
    drop(save); // removes the decompressed copy, if any
    Ok(Imported { layers, config, source, fetched_layers, reused_layers })
}

// ---------------------------------------------------------------------------------------------
// plain root file systems

/// Imports a root file system as one layer: a directory (archived on the fly, in sorted
/// order, with its real modes, owners, times, symlinks and hard links) or a tarball (plain,
/// gzip or zstd). Device files and sockets in a directory are skipped (a plain root file
/// system has no whiteouts, and `/dev` is provided at run time). The layer always unpacks:
/// its diff id is only known once it has been read.
pub async fn import_rootfs(
    store: &Store,
    dir_or_tarball: &Path,
    opts: &ImportOptions,
) -> Result<Imported, ImportError> {
    let path = dir_or_tarball.to_path_buf();
    let root = store.root().to_path_buf();
    let limits = opts.limits.clone();
    let source = format!("rootfs:{}", path.display());
    let progress = Progress::new(opts.progress);
    let bar = progress.layer("rootfs", 0);
    bar.unpacking();
    let src = source.clone();
    let meta = blocking(move || {
        let store = Store::open(root)?;
        let meta = std::fs::metadata(&path).map_err(io_err(&path))?;
        if meta.is_dir() {
            import_dir(&store, &path, &limits, &src)
        } else {
            let blob = Blob::Range { path: path.clone(), offset: 0, len: meta.len(), digest: None };
            unpack_blocking(&store, &blob, None, &[], &limits, &src)
        }
    })
    .await;
    match &meta {
        Ok(_) => bar.done(),
        Err(_) => bar.failed(),
    }
    let meta = meta?;
    Ok(Imported { layers: vec![meta.id], config: ImageConfig::default(), source, fetched_layers: 1, reused_layers: 0 })
}

/// Streams a tar of `dir` into `import_layer` through a pipe (no temporary copy).
fn import_dir(store: &Store, dir: &Path, limits: &Limits, source: &str) -> Result<LayerMeta, ImportError> {
    let (reader, writer) = io::pipe().map_err(io_err(dir))?;
    let root = dir.to_path_buf();
    let max_depth = limits.max_depth;
    let writer_thread = std::thread::Builder::new()
        .name("rootfs-tar".into())
        .spawn(move || write_tar(&root, writer, max_depth))
        .map_err(io_err(dir))?;
    let mut pipe = TarPipe { reader: Some(reader), writer: Some(writer_thread), error: None };
    let imported = import_layer(store, &mut pipe, Compression::None, None, &[], limits, source);
    // Set only when the reader met the end of the pipe and found the writer had failed: then
    // the writer's error is the cause. Otherwise a writer error is the broken pipe that
    // follows an import that stopped reading (a limit, a bad entry).
    let writer_failed_first = pipe.error.is_some();
    let written = pipe.finish();
    match (imported, written) {
        (Ok(meta), Ok(())) => Ok(meta),
        (Ok(_), Err(e)) => Err(e),
        (Err(_), Err(e)) if writer_failed_first => Err(e),
        (Err(source), _) => Err(ImportError::Layer { diff_id: format!("rootfs {}", dir.display()), source }),
    }
}

/// The read end of the tar pipe. It reports end of file only after the writer finished
/// successfully: a writer that failed half-way must not look like a shorter, complete tar.
struct TarPipe {
    reader: Option<io::PipeReader>,
    writer: Option<std::thread::JoinHandle<Result<(), ImportError>>>,
    error: Option<ImportError>,
}

impl TarPipe {
    fn join_writer(&mut self) -> io::Result<()> {
        if let Some(h) = self.writer.take() {
            match h.join() {
                Ok(Ok(())) => {}
                Ok(Err(e)) => self.error = Some(e),
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
        if self.error.is_some() { Err(io::Error::other("archiving the directory failed")) } else { Ok(()) }
    }

    /// Closes the pipe (so a writer still running stops on a broken pipe) and reports the
    /// writer's error, if any.
    fn finish(mut self) -> Result<(), ImportError> {
        self.reader = None;
        let _ = self.join_writer();
        match self.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Read for TarPipe {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Some(r) = self.reader.as_mut() else { return Ok(0) };
        let n = r.read(buf)?;
        if n == 0 && !buf.is_empty() {
            self.join_writer()?;
        }
        Ok(n)
    }
}

/// A reader that fails if its source ends before `left` bytes (a file that shrank while
/// archived would otherwise corrupt the tar).
struct Exact<R> {
    inner: R,
    left: u64,
}

impl<R: Read> Read for Exact<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Ok(0);
        }
        let want = buf.len().min(usize::try_from(self.left).unwrap_or(usize::MAX));
        let n = self.inner.read(&mut buf[..want])?;
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the file shrank while it was archived"));
        }
        self.left -= n as u64;
        Ok(n)
    }
}

fn write_tar(root: &Path, w: io::PipeWriter, max_depth: usize) -> Result<(), ImportError> {
    let mut b = tar::Builder::new(io::BufWriter::with_capacity(1 << 20, w));
    b.mode(tar::HeaderMode::Complete);
    b.follow_symlinks(false);
    let mut state = TarState { links: HashMap::new(), skipped: 0, max_depth };
    add_dir(&mut b, root, Path::new(""), 0, &mut state)?;
    let out_err = |e: io::Error| ImportError::Io { path: root.to_path_buf(), source: e };
    b.finish().map_err(out_err)?;
    b.into_inner().map_err(out_err)?.flush().map_err(out_err)?;
    if state.skipped > 0 {
        tracing::warn!(root = %root.display(), skipped = state.skipped, "device files and sockets were left out of the layer");
    }
    Ok(())
}

struct TarState {
    /// (device, inode) of files with several links -> the first name archived.
    links: HashMap<(u64, u64), PathBuf>,
    skipped: u64,
    max_depth: usize,
}

fn add_dir<W: Write>(
    b: &mut tar::Builder<W>,
    root: &Path,
    rel: &Path,
    depth: usize,
    st: &mut TarState,
) -> Result<(), ImportError> {
    if depth >= st.max_depth {
        return Err(invalid(&root.join(rel), format!("directories nested deeper than {}", st.max_depth)));
    }
    let dir = root.join(rel);
    let mut names: Vec<_> = std::fs::read_dir(&dir)
        .map_err(io_err(&dir))?
        .map(|e| e.map(|e| e.file_name()))
        .collect::<Result<_, _>>()
        .map_err(io_err(&dir))?;
    names.sort();
    for name in names {
        let rel_child = rel.join(&name);
        let full = root.join(&rel_child);
        let err = io_err(&full);
        let meta = std::fs::symlink_metadata(&full).map_err(io_err(&full))?;
        let ft = meta.file_type();
        let mut h = tar::Header::new_gnu();
        h.set_metadata_in_mode(&meta, tar::HeaderMode::Complete);
        h.set_size(0);
        if ft.is_dir() {
            b.append_data(&mut h, &rel_child, io::empty()).map_err(err)?;
            add_dir(b, root, &rel_child, depth + 1, st)?;
        } else if ft.is_symlink() {
            let target = std::fs::read_link(&full).map_err(io_err(&full))?;
            b.append_link(&mut h, &rel_child, target).map_err(err)?;
        } else if ft.is_file() {
            if meta.nlink() > 1 {
                let key = (meta.dev(), meta.ino());
                if let Some(first) = st.links.get(&key) {
                    h.set_entry_type(tar::EntryType::Link);
                    b.append_link(&mut h, &rel_child, first).map_err(err)?;
                    continue;
                }
                st.links.insert(key, rel_child.clone());
            }
            // Not following a symlink swapped in since the stat; the header describes the
            // file actually opened.
            let f = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&full)
                .map_err(io_err(&full))?;
            let m = f.metadata().map_err(io_err(&full))?;
            if !m.is_file() {
                return Err(invalid(&full, "changed type while it was archived"));
            }
            h.set_metadata_in_mode(&m, tar::HeaderMode::Complete);
            h.set_size(m.len());
            b.append_data(&mut h, &rel_child, Exact { inner: f, left: m.len() }).map_err(err)?;
        } else if ft.is_fifo() {
            b.append_data(&mut h, &rel_child, io::empty()).map_err(err)?;
        } else {
            st.skipped += 1;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_in_archives() {
        assert_eq!(normalize("./a/./b/../c").as_deref(), Some("a/c"));
        assert_eq!(normalize("/manifest.json").as_deref(), Some("manifest.json"));
        assert_eq!(normalize("../x"), None);
        assert_eq!(normalize("a/../../x"), None);
        let d = "a".repeat(64);
        assert_eq!(digest_from_name(&format!("blobs/sha256/{d}")), Some(format!("sha256:{d}")));
        assert_eq!(digest_from_name(&format!("./{d}.json")), Some(format!("sha256:{d}")));
        assert_eq!(digest_from_name("abc/layer.tar"), None);
        assert_eq!(digest_from_name(&format!("x/{d}.json")), None);
        assert!(ref_name_matches("latest", "latest"));
        assert!(ref_name_matches("docker.io/library/busybox:1.36", "1.36"));
        assert!(!ref_name_matches("docker.io/library/busybox:1.36", "1.3"));
        assert!(!ref_name_matches("v1", "latest"));
    }

    #[test]
    fn layout_choice() {
        let d = |n: char, name: Option<&str>, arch: Option<&str>| {
            let mut v = serde_json::json!({
                "mediaType": manifest::OCI_MANIFEST,
                "digest": format!("sha256:{}", n.to_string().repeat(64)),
                "size": 1,
            });
            if let Some(a) = arch {
                v["platform"] = serde_json::json!({"architecture": a, "os": "linux"});
            }
            if let Some(n) = name {
                v["annotations"] = serde_json::json!({ REF_NAME: n });
            }
            serde_json::from_value::<Descriptor>(v).unwrap()
        };
        let index_of = |manifests: Vec<Descriptor>| {
            serde_json::from_value::<ImageIndex>(serde_json::json!({"schemaVersion": 2, "manifests": manifests}))
                .unwrap()
        };
        let dir = Path::new("/l");
        let index = index_of(vec![d('1', Some("a"), None), d('2', Some("b"), None)]);
        let two = d('2', None, None);
        assert_eq!(choose_in_layout(dir, &index, Some("b")).unwrap().digest(), two.digest());
        assert!(matches!(choose_in_layout(dir, &index, None), Err(ImportError::Ambiguous { .. })));
        assert!(matches!(
            choose_in_layout(dir, &index, Some("c")),
            Err(ImportError::Registry(RegistryError::ManifestNotFound { .. }))
        ));
        let platforms = index_of(vec![d('1', Some("t"), Some("arm64")), d('2', Some("t"), Some("amd64"))]);
        assert_eq!(choose_in_layout(dir, &platforms, None).unwrap().digest(), two.digest());
        assert_eq!(choose_in_layout(dir, &platforms, Some("t")).unwrap().digest(), two.digest());
    }
}
