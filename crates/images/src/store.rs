//! Store layout, names, and atomic writes of layers and manifests.

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

use opendsec_common::ids;
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{what} {value:?} is not valid: {why}")]
    InvalidName { what: &'static str, value: String, why: &'static str },
    #[error("i/o error on {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path} is corrupt: {source}")]
    Corrupt { path: PathBuf, source: serde_json::Error },
    #[error("image {0} not found")]
    ImageNotFound(String),
    #[error("layer {0} not found")]
    LayerNotFound(String),
    #[error("image {0} already exists")]
    ImageExists(String),
    #[error("vm snapshot {0} not found")]
    SnapshotNotFound(String),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io { path: path.to_path_buf(), source }
}

/// A layer id: the 64 lowercase hex digits of the sha256 of the layer's uncompressed tar (its
/// OCI diff id), or of the ids it was merged from.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct LayerId(String);

impl LayerId {
    pub fn parse(s: &str) -> Result<LayerId, StoreError> {
        let hex = s.strip_prefix("sha256:").unwrap_or(s);
        if hex.len() == 64 && hex.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)) {
            Ok(LayerId(hex.to_string()))
        } else {
            Err(StoreError::InvalidName {
                what: "layer id",
                value: s.chars().take(80).collect(),
                why: "64 lowercase hex digits (sha256)",
            })
        }
    }

    /// From a sha256 digest.
    pub fn from_digest(digest: &[u8; 32]) -> LayerId {
        LayerId(digest.iter().map(|b| format!("{b:02x}")).collect())
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The OCI form, `sha256:<hex>`.
    pub fn diff_id(&self) -> String {
        format!("sha256:{}", self.0)
    }
}

impl TryFrom<String> for LayerId {
    type Error = StoreError;
    fn try_from(s: String) -> Result<Self, StoreError> {
        LayerId::parse(&s)
    }
}

impl From<LayerId> for String {
    fn from(l: LayerId) -> String {
        l.0
    }
}

impl std::fmt::Display for LayerId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// An image name inside a project: `<repo>:<tag>`. Repos are registry-style paths
/// (`library/busybox`): segments `[a-z0-9][a-z0-9._-]*`, at most 255 bytes; tags
/// `[A-Za-z0-9_][A-Za-z0-9._-]{0,127}`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageRef {
    pub project: String,
    pub repo: String,
    pub tag: String,
}

impl ImageRef {
    pub fn new(project: &str, repo: &str, tag: &str) -> Result<ImageRef, StoreError> {
        ids::validate_project(project).map_err(|_| StoreError::InvalidName {
            what: "project",
            value: project.into(),
            why: "a project path such as root/team-a",
        })?;
        validate_repo(repo)?;
        validate_tag(tag)?;
        Ok(ImageRef { project: project.into(), repo: repo.into(), tag: tag.into() })
    }

    /// Parses `repo[:tag]` (tag defaults to `latest`) in `project`.
    pub fn parse(project: &str, name: &str) -> Result<ImageRef, StoreError> {
        let (repo, tag) = match name.rsplit_once(':') {
            Some((r, t)) if !t.contains('/') => (r, t),
            _ => (name, "latest"),
        };
        ImageRef::new(project, repo, tag)
    }

    /// `repo:tag`.
    pub fn name(&self) -> String {
        format!("{}:{}", self.repo, self.tag)
    }

    fn rel_path(&self) -> PathBuf {
        PathBuf::from(&self.project).join(self.repo.replace('/', "+")).join(format!("{}.json", self.tag))
    }
}

impl std::fmt::Display for ImageRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}//{}:{}", self.project, self.repo, self.tag)
    }
}

fn validate_repo(repo: &str) -> Result<(), StoreError> {
    let bad = |why| StoreError::InvalidName { what: "repository", value: repo.chars().take(80).collect(), why };
    if repo.is_empty() || repo.len() > 255 {
        return Err(bad("1..=255 bytes"));
    }
    for seg in repo.split('/') {
        let b = seg.as_bytes();
        let first_ok = b.first().is_some_and(|c| c.is_ascii_lowercase() || c.is_ascii_digit());
        if !first_ok || !b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || b"._-".contains(c)) {
            return Err(bad("segments of [a-z0-9._-] starting with a letter or digit, separated by /"));
        }
    }
    Ok(())
}

fn validate_tag(tag: &str) -> Result<(), StoreError> {
    let b = tag.as_bytes();
    let first_ok = b.first().is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_');
    if !first_ok || b.len() > 128 || !b.iter().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(c)) {
        return Err(StoreError::InvalidName {
            what: "tag",
            value: tag.chars().take(80).collect(),
            why: "[A-Za-z0-9_][A-Za-z0-9._-]{0,127}",
        });
    }
    Ok(())
}

/// What the image's config says about running it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImageConfig {
    pub env: Vec<String>,
    pub workdir: String,
    pub user: String,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

/// `images/<project>/<repo>/<tag>.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// Encoding version (1).
    pub v: u32,
    pub project: String,
    pub repo: String,
    pub tag: String,
    /// Bottom layer first.
    pub layers: Vec<LayerId>,
    #[serde(default)]
    pub config: ImageConfig,
    pub created_at_ms: i64,
    /// Where it came from (`registry/repo@digest`, `oci-layout:...`, `compose:...`), for people.
    #[serde(default)]
    pub source: String,
    /// A microvm's memory snapshot (`snapshots/<id>`, [`crate::vmsnap`]) that sandboxes of this
    /// image are restored from; empty for an ordinary image. Only the apiserver's snapshot
    /// publication sets it: a registered or composed image never names one.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub vm_snapshot: String,
}

/// `layers/<id>/meta.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerMeta {
    pub v: u32,
    pub id: LayerId,
    /// Bytes of file content in the layer.
    pub size_bytes: u64,
    /// Entries (files, directories, links, whiteouts).
    pub entries: u64,
    pub created_at_ms: i64,
    #[serde(default)]
    pub source: String,
    /// The OCI diff id (`sha256:<hex>`) of the tar the layer was unpacked from; empty for
    /// layers made otherwise (merges).
    #[serde(default)]
    pub diff_id: String,
    /// The layers (bottom first) this layer's content depends on: set for layers whose opaque
    /// directories were expanded against them, and for merges. Empty otherwise.
    #[serde(default)]
    pub lowers: Vec<LayerId>,
}

/// The directory in a layer's directory naming the projects that may use it.
pub const LAYER_USERS: &str = "users";

/// Layers below this depth of a path are refused (absurdly deep directories).
pub const MAX_PATH_DEPTH: usize = 128;

#[derive(Debug)]
pub struct Store {
    root: PathBuf,
}

impl Store {
    /// Opens a store, creating its top-level directories. The root is private (0700, or its
    /// owner's and group's where an operator shares it): layers hold untrusted images' files,
    /// setuid binaries and file capabilities included, which no host user may reach.
    pub fn open(root: impl Into<PathBuf>) -> Result<Store, StoreError> {
        let root = root.into();
        opendsec_common::fsperm::private_dir(&root).map_err(io(&root))?;
        for d in ["layers/.tmp", "images", "snapshots", "vmdisks", "inuse"] {
            let p = root.join(d);
            fs::create_dir_all(&p).map_err(io(&p))?;
        }
        Ok(Store { root })
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    pub fn layer_dir(&self, id: &LayerId) -> PathBuf {
        self.root.join("layers").join(id.as_str())
    }

    pub fn layer_rootfs(&self, id: &LayerId) -> PathBuf {
        self.layer_dir(id).join("rootfs")
    }

    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join("layers/.tmp")
    }

    pub fn has_layer(&self, id: &LayerId) -> bool {
        self.layer_dir(id).join("meta.json").is_file()
    }

    pub fn layer_meta(&self, id: &LayerId) -> Result<LayerMeta, StoreError> {
        let p = self.layer_dir(id).join("meta.json");
        let text = match fs::read(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(StoreError::LayerNotFound(id.to_string()));
            }
            Err(e) => return Err(StoreError::Io { path: p, source: e }),
        };
        serde_json::from_slice(&text).map_err(|source| StoreError::Corrupt { path: p, source })
    }

    /// Records that `project` may reference layer `id` in its manifests
    /// (`layers/<id>/users/<project>`, `/` written as `+`): the project it was imported for, and
    /// every project an image using it was published in. Layers are content-addressed and
    /// shared, so knowing a layer's id must not be enough to use it.
    pub fn add_layer_user(&self, id: &LayerId, project: &str) -> Result<(), StoreError> {
        if !self.has_layer(id) {
            return Err(StoreError::LayerNotFound(id.to_string()));
        }
        let dir = self.layer_dir(id).join(LAYER_USERS);
        fs::create_dir_all(&dir).map_err(io(&dir))?;
        let p = dir.join(project.replace('/', "+"));
        if !p.exists() {
            fs::write(&p, b"").map_err(io(&p))?;
        }
        Ok(())
    }

    /// Forgets `project` as a user of every layer (its project was deleted: a project made
    /// later under the same name must not inherit the right to name them). Returns how many
    /// records went.
    pub fn remove_layer_users(&self, project: &str) -> Result<usize, StoreError> {
        let layers = self.root.join("layers");
        let rd = match fs::read_dir(&layers) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(StoreError::Io { path: layers, source: e }),
        };
        let name = project.replace('/', "+");
        let (mut n, mut first_error) = (0, None);
        for e in rd.flatten() {
            if !e.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            let p = e.path().join(LAYER_USERS).join(&name);
            match fs::remove_file(&p) {
                Ok(()) => n += 1,
                Err(e) if matches!(e.kind(), std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory) => {}
                // The others still go; the first failure is told.
                Err(e) => {
                    first_error.get_or_insert(StoreError::Io { path: p, source: e });
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(n),
        }
    }

    /// The projects recorded by [`Store::add_layer_user`] (none for layers stored before
    /// layers had users).
    pub fn layer_users(&self, id: &LayerId) -> Result<Vec<String>, StoreError> {
        if !self.has_layer(id) {
            return Err(StoreError::LayerNotFound(id.to_string()));
        }
        let dir = self.layer_dir(id).join(LAYER_USERS);
        let rd = match fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(StoreError::Io { path: dir, source: e }),
        };
        let mut out: Vec<String> =
            rd.flatten().filter_map(|e| e.file_name().to_str().map(|n| n.replace('+', "/"))).collect();
        out.sort();
        Ok(out)
    }

    /// A fresh temporary directory for a layer being written, with an empty `rootfs/`.
    pub fn begin_layer(&self) -> Result<PendingLayer, StoreError> {
        let name = format!("{:016x}{:016x}", rand::random::<u64>(), rand::random::<u64>());
        let dir = self.tmp_dir().join(name);
        let rootfs = dir.join("rootfs");
        fs::create_dir_all(&rootfs).map_err(io(&rootfs))?;
        Ok(PendingLayer { dir, committed: false })
    }

    /// Puts a finished layer in place: meta.json written and synced inside the temporary dir,
    /// then the dir renamed to `layers/<id>`. A layer that appeared meanwhile (a concurrent
    /// import of the same content) wins; ours is discarded.
    pub fn commit_layer(&self, mut pending: PendingLayer, meta: &LayerMeta) -> Result<(), StoreError> {
        let meta_path = pending.dir.join("meta.json");
        let bytes = serde_json::to_vec_pretty(meta)
            .map_err(|source| StoreError::Corrupt { path: meta_path.clone(), source })?;
        write_synced(&meta_path, &bytes)?;
        let target = self.layer_dir(&meta.id);
        if self.has_layer(&meta.id) {
            return Ok(()); // pending's Drop removes our copy
        }
        match fs::rename(&pending.dir, &target) {
            Ok(()) => {
                pending.committed = true;
                sync_dir(&self.root.join("layers"))
            }
            // Lost a race to an identical layer: fine, it is content-addressed.
            Err(_) if self.has_layer(&meta.id) => Ok(()),
            Err(e) => Err(StoreError::Io { path: target, source: e }),
        }
    }

    fn manifest_path(&self, r: &ImageRef) -> PathBuf {
        self.root.join("images").join(r.rel_path())
    }

    pub fn has_image(&self, r: &ImageRef) -> bool {
        self.manifest_path(r).is_file()
    }

    pub fn read_manifest(&self, r: &ImageRef) -> Result<Manifest, StoreError> {
        let p = self.manifest_path(r);
        let text = match fs::read(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(StoreError::ImageNotFound(r.to_string())),
            Err(e) => return Err(StoreError::Io { path: p, source: e }),
        };
        serde_json::from_slice(&text).map_err(|source| StoreError::Corrupt { path: p, source })
    }

    /// Writes (or replaces) a manifest whole: temp file, fsync, rename. Every layer it names
    /// must be in the store.
    pub fn write_manifest(&self, m: &Manifest) -> Result<ImageRef, StoreError> {
        let r = ImageRef::new(&m.project, &m.repo, &m.tag)?;
        for l in &m.layers {
            if !self.has_layer(l) {
                return Err(StoreError::LayerNotFound(l.to_string()));
            }
        }
        if !m.vm_snapshot.is_empty() && !self.has_vm_snapshot(&m.vm_snapshot) {
            return Err(StoreError::SnapshotNotFound(m.vm_snapshot.clone()));
        }
        let p = self.manifest_path(&r);
        let dir = p.parent().map(Path::to_path_buf).unwrap_or_else(|| self.root.join("images"));
        fs::create_dir_all(&dir).map_err(io(&dir))?;
        let bytes = serde_json::to_vec_pretty(m).map_err(|source| StoreError::Corrupt { path: p.clone(), source })?;
        let tmp = dir.join(format!(".{}.{:016x}.tmp", r.tag, rand::random::<u64>()));
        write_synced(&tmp, &bytes)?;
        fs::rename(&tmp, &p).map_err(io(&p))?;
        sync_dir(&dir)?;
        Ok(r)
    }

    pub fn delete_manifest(&self, r: &ImageRef) -> Result<(), StoreError> {
        let p = self.manifest_path(r);
        match fs::remove_file(&p) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(StoreError::ImageNotFound(r.to_string())),
            Err(e) => Err(StoreError::Io { path: p, source: e }),
        }
    }

    /// Every manifest in `project` (and, with `recursive`, its subprojects), sorted.
    pub fn list_manifests(&self, project: &str, recursive: bool) -> Result<Vec<Manifest>, StoreError> {
        let base = self.root.join("images");
        let mut out = Vec::new();
        let mut stack = vec![base.join(project)];
        while let Some(dir) = stack.pop() {
            let entries = match fs::read_dir(&dir) {
                Ok(e) => e,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(StoreError::Io { path: dir, source: e }),
            };
            for e in entries {
                let e = e.map_err(io(&dir))?;
                let path = e.path();
                let name = e.file_name().to_string_lossy().to_string();
                if !e.file_type().map_err(io(&path))?.is_dir() {
                    continue;
                }
                if ids::validate_project(&format!("root/{name}")).is_ok()
                    && !name.contains('.')
                    && !name.contains('+')
                    && recursive
                {
                    // Could be a subproject or a repo: look inside both ways.
                    stack.push(path.clone());
                }
                // A repo dir holds <tag>.json files.
                let files = fs::read_dir(&path).map_err(io(&path))?;
                for f in files {
                    let f = f.map_err(io(&path))?;
                    let fname = f.file_name().to_string_lossy().to_string();
                    if fname.starts_with('.') || !fname.ends_with(".json") {
                        continue;
                    }
                    let fp = f.path();
                    let text = fs::read(&fp).map_err(io(&fp))?;
                    let m: Manifest = serde_json::from_slice(&text)
                        .map_err(|source| StoreError::Corrupt { path: fp.clone(), source })?;
                    // Only manifests that live exactly where their names say.
                    if let Ok(r) = ImageRef::new(&m.project, &m.repo, &m.tag)
                        && self.manifest_path(&r) == fp
                        && (m.project == project || (recursive && ids::project_within(&m.project, project)))
                    {
                        out.push(m);
                    }
                }
            }
        }
        out.sort_by(|a, b| (&a.project, &a.repo, &a.tag).cmp(&(&b.project, &b.repo, &b.tag)));
        out.dedup_by(|a, b| a.project == b.project && a.repo == b.repo && a.tag == b.tag);
        Ok(out)
    }

    /// Finds `repo[:tag]` in `project` or, failing that, its nearest ancestor that has it.
    pub fn resolve(&self, project: &str, name: &str) -> Result<(ImageRef, Manifest), StoreError> {
        for p in ids::project_chain(project) {
            let r = ImageRef::parse(p, name)?;
            match self.read_manifest(&r) {
                Ok(m) => return Ok((r, m)),
                Err(StoreError::ImageNotFound(_)) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(StoreError::ImageNotFound(format!("{name} (in {project} or above)")))
    }
}

/// A layer being written; removed on drop unless committed.
#[derive(Debug)]
pub struct PendingLayer {
    dir: PathBuf,
    committed: bool,
}

impl PendingLayer {
    /// Where the layer's files go.
    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for PendingLayer {
    fn drop(&mut self) {
        if !self.committed {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

/// Writes a file and fsyncs it.
pub fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), StoreError> {
    let mut f = fs::File::create(path).map_err(io(path))?;
    f.write_all(bytes).map_err(io(path))?;
    f.sync_all().map_err(io(path))
}

pub fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    fs::File::open(dir).and_then(|d| d.sync_all()).map_err(io(dir))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(n: u8) -> LayerId {
        LayerId::from_digest(&[n; 32])
    }

    fn layer(store: &Store, n: u8) -> LayerId {
        let p = store.begin_layer().unwrap();
        fs::write(p.rootfs().join("f"), [n]).unwrap();
        let meta = LayerMeta {
            v: 1,
            id: id(n),
            size_bytes: 1,
            entries: 1,
            created_at_ms: 1,
            source: "test".into(),
            diff_id: String::new(),
            lowers: vec![],
        };
        store.commit_layer(p, &meta).unwrap();
        id(n)
    }

    #[test]
    fn names() {
        assert!(LayerId::parse(&"a".repeat(64)).is_ok());
        assert!(LayerId::parse(&format!("sha256:{}", "0".repeat(64))).is_ok());
        for bad in ["", "xyz", &"A".repeat(64), &"a".repeat(63), "../../etc/passwd"] {
            assert!(LayerId::parse(bad).is_err(), "{bad}");
        }
        let r = ImageRef::parse("root/team-a", "library/busybox:1.36").unwrap();
        assert_eq!((r.repo.as_str(), r.tag.as_str()), ("library/busybox", "1.36"));
        assert_eq!(ImageRef::parse("root", "busybox").unwrap().tag, "latest");
        assert!(ImageRef::parse("root", "localhost:5000/x").unwrap_err().to_string().contains("repository"));
        for bad in ["", "../x", "a//b", "A", "a:b:c", "a:", ":t", "x:../../y"] {
            assert!(ImageRef::parse("root", bad).is_err(), "{bad}");
        }
        assert!(ImageRef::parse("root/../x", "busybox").is_err());
    }

    #[test]
    fn layers_appear_whole_and_once() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let a = layer(&store, 1);
        assert!(store.has_layer(&a));
        assert_eq!(fs::read(store.layer_rootfs(&a).join("f")).unwrap(), [1]);
        // The same content again: the first copy stays, the second is discarded.
        layer(&store, 1);
        assert_eq!(fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
        // An abandoned write leaves nothing behind.
        let p = store.begin_layer().unwrap();
        fs::write(p.rootfs().join("x"), b"x").unwrap();
        drop(p);
        assert_eq!(fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
    }

    #[test]
    fn manifests_round_trip_resolve_and_list() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let a = layer(&store, 1);
        let m = Manifest {
            v: 1,
            project: "root".into(),
            repo: "library/busybox".into(),
            tag: "latest".into(),
            layers: vec![a.clone()],
            config: ImageConfig { env: vec!["PATH=/bin".into()], ..Default::default() },
            created_at_ms: 1,
            source: "test".into(),
            vm_snapshot: String::new(),
        };
        store.write_manifest(&m).unwrap();
        let (r, got) = store.resolve("root/team-a/rl", "library/busybox").unwrap();
        assert_eq!(r.project, "root");
        assert_eq!(got, m);
        let mut sub = m.clone();
        sub.project = "root/team-a".into();
        sub.repo = "tools".into();
        store.write_manifest(&sub).unwrap();
        assert_eq!(store.list_manifests("root", false).unwrap(), vec![m.clone()]);
        assert_eq!(store.list_manifests("root", true).unwrap().len(), 2);
        assert_eq!(store.list_manifests("root/team-a", true).unwrap(), vec![sub]);
        let mut missing = m.clone();
        missing.layers.push(id(9));
        assert!(matches!(store.write_manifest(&missing), Err(StoreError::LayerNotFound(_))));
        store.delete_manifest(&r).unwrap();
        assert!(matches!(store.resolve("root", "library/busybox"), Err(StoreError::ImageNotFound(_))));
    }

    /// Stored bytes from the first version; never edit them.
    #[test]
    fn golden_manifest_and_meta() {
        let m = r#"{"v":1,"project":"root/team-a","repo":"library/busybox","tag":"1.36","layers":["aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"],"config":{"env":["PATH=/bin"],"workdir":"/","user":"","entrypoint":[],"cmd":["sh"]},"created_at_ms":1700000000000,"source":"127.0.0.1:5000/busybox@sha256:00"}"#;
        let m: Manifest = serde_json::from_str(m).unwrap();
        assert_eq!(m.layers[0].as_str(), "a".repeat(64));
        let meta = r#"{"v":1,"id":"bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb","size_bytes":10,"entries":3,"created_at_ms":1700000000000,"source":"x"}"#;
        let meta: LayerMeta = serde_json::from_str(meta).unwrap();
        assert_eq!(meta.entries, 3);
    }
}
