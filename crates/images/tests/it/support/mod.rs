//! Test support for the images tests, one toolkit: layers built from entries, their model and
//! tree snapshots (`layers`), and for the import tests a real registry (Debian's `docker-registry`, started per
//! test on a free 127.0.0.1 port, optionally behind htpasswd Basic auth), a small OCI writer
//! (layer tars, gzip/zstd/plain blobs, configs, manifests, indexes, image layouts), pushing
//! with `skopeo`, fake registries (token service, redirects, corrupt or missing blobs, stalls)
//! and a view of the store for assertions.
//!
//! Tests run as root (whiteouts are 0:0 character devices), as in CI.

#![allow(dead_code)]

mod layers;
pub use layers::*;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io::Write;
use std::net::TcpListener as StdListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::extract::{Path as UrlPath, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use opendsec_images::Store;
use opendsec_images::import::ImportOptions;
use sha2::{Digest, Sha256};

pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";

pub fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect::<String>())
}

fn hex_of(digest: &str) -> &str {
    digest.strip_prefix("sha256:").unwrap_or(digest)
}

/// Options for talking to the 127.0.0.1 test registries.
pub fn local_opts() -> ImportOptions {
    ImportOptions { insecure_http: true, timeout: Duration::from_secs(20), ..Default::default() }
}

// ---------------------------------------------------------------------------------------------
// layer tars

/// Builds a layer tar in memory.
pub struct TarBuilder {
    b: tar::Builder<Vec<u8>>,
}

impl Default for TarBuilder {
    fn default() -> Self {
        TarBuilder::new()
    }
}

impl TarBuilder {
    pub fn new() -> TarBuilder {
        TarBuilder { b: tar::Builder::new(Vec::new()) }
    }

    fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_size(size);
        h.set_mtime(1_700_000_000);
        h.set_uid(0);
        h.set_gid(0);
        h
    }

    pub fn dir(mut self, path: &str) -> Self {
        let mut h = Self::header(tar::EntryType::Directory, 0o755, 0);
        self.b.append_data(&mut h, path, std::io::empty()).unwrap();
        self
    }

    pub fn file(self, path: &str, content: &[u8]) -> Self {
        self.file_mode(path, content, 0o644)
    }

    pub fn file_mode(mut self, path: &str, content: &[u8], mode: u32) -> Self {
        let mut h = Self::header(tar::EntryType::Regular, mode, content.len() as u64);
        self.b.append_data(&mut h, path, content).unwrap();
        self
    }

    pub fn symlink(mut self, path: &str, target: &str) -> Self {
        let mut h = Self::header(tar::EntryType::Symlink, 0o777, 0);
        self.b.append_link(&mut h, path, target).unwrap();
        self
    }

    pub fn hardlink(mut self, path: &str, target: &str) -> Self {
        let mut h = Self::header(tar::EntryType::Link, 0o644, 0);
        self.b.append_link(&mut h, path, target).unwrap();
        self
    }

    /// An OCI whiteout: deletes `path` from the layers below.
    pub fn whiteout(self, path: &str) -> Self {
        let (dir, name) = path.rsplit_once('/').map_or(("", path), |(d, n)| (d, n));
        let wh = if dir.is_empty() { format!(".wh.{name}") } else { format!("{dir}/.wh.{name}") };
        self.file(&wh, b"")
    }

    /// An OCI opaque marker: hides everything below in `dir`.
    pub fn opaque(self, dir: &str) -> Self {
        self.file(&format!("{dir}/.wh..wh..opq"), b"")
    }

    pub fn finish(self) -> Vec<u8> {
        self.b.into_inner().unwrap()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Comp {
    Plain,
    Gzip,
    Zstd,
}

pub fn compress(tar: &[u8], comp: Comp) -> Vec<u8> {
    match comp {
        Comp::Plain => tar.to_vec(),
        Comp::Gzip => {
            let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
            e.write_all(tar).unwrap();
            e.finish().unwrap()
        }
        Comp::Zstd => zstd::encode_all(tar, 3).unwrap(),
    }
}

/// A layer blob with its digests.
#[derive(Clone, Debug)]
pub struct Layer {
    pub blob: Vec<u8>,
    pub media_type: String,
    pub digest: String,
    pub diff_id: String,
    pub tar: Vec<u8>,
}

pub fn layer(tar: Vec<u8>, comp: Comp) -> Layer {
    let blob = compress(&tar, comp);
    let media_type = match comp {
        Comp::Plain => "application/vnd.oci.image.layer.v1.tar",
        Comp::Gzip => "application/vnd.oci.image.layer.v1.tar+gzip",
        Comp::Zstd => "application/vnd.oci.image.layer.v1.tar+zstd",
    };
    Layer { digest: sha256(&blob), diff_id: sha256(&tar), blob, media_type: media_type.into(), tar }
}

// ---------------------------------------------------------------------------------------------
// images

/// An image: its layers, config and manifest, as bytes.
#[derive(Clone, Debug)]
pub struct Image {
    pub layers: Vec<Layer>,
    pub config: Vec<u8>,
    pub config_digest: String,
    pub manifest: Vec<u8>,
    pub digest: String,
    pub arch: String,
}

pub fn image(layers: Vec<Layer>, arch: &str, env: &[&str], cmd: &[&str]) -> Image {
    let config = serde_json::to_vec(&serde_json::json!({
        "architecture": arch,
        "os": "linux",
        "config": {"Env": env, "Cmd": cmd, "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": layers.iter().map(|l| l.diff_id.clone()).collect::<Vec<_>>()},
    }))
    .unwrap();
    let config_digest = sha256(&config);
    let manifest = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": config.len()},
        "layers": layers.iter().map(|l| serde_json::json!({"mediaType": l.media_type, "digest": l.digest, "size": l.blob.len()})).collect::<Vec<_>>(),
    }))
    .unwrap();
    Image { digest: sha256(&manifest), layers, config, config_digest, manifest, arch: arch.into() }
}

/// An index of several platform images.
pub fn index(images: &[&Image]) -> (Vec<u8>, String) {
    let bytes = serde_json::to_vec(&serde_json::json!({
        "schemaVersion": 2,
        "mediaType": OCI_INDEX,
        "manifests": images.iter().map(|i| serde_json::json!({
            "mediaType": OCI_MANIFEST, "digest": i.digest, "size": i.manifest.len(),
            "platform": {"os": "linux", "architecture": i.arch},
        })).collect::<Vec<_>>(),
    }))
    .unwrap();
    let d = sha256(&bytes);
    (bytes, d)
}

/// Writes OCI image layouts.
pub struct Layout {
    pub dir: PathBuf,
    entries: Vec<serde_json::Value>,
}

impl Layout {
    pub fn new(dir: &Path) -> Layout {
        std::fs::create_dir_all(dir.join("blobs/sha256")).unwrap();
        std::fs::write(dir.join("oci-layout"), br#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
        let l = Layout { dir: dir.to_path_buf(), entries: Vec::new() };
        l.write_index();
        l
    }

    pub fn blob(&self, bytes: &[u8]) -> String {
        let d = sha256(bytes);
        std::fs::write(self.dir.join("blobs/sha256").join(hex_of(&d)), bytes).unwrap();
        d
    }

    fn image_blobs(&self, img: &Image) {
        for l in &img.layers {
            self.blob(&l.blob);
        }
        self.blob(&img.config);
        self.blob(&img.manifest);
    }

    fn write_index(&self) {
        let index = serde_json::json!({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": self.entries});
        std::fs::write(self.dir.join("index.json"), serde_json::to_vec(&index).unwrap()).unwrap();
    }

    /// Adds an image under `tag`.
    pub fn add_image(&mut self, img: &Image, tag: &str) -> &mut Self {
        self.image_blobs(img);
        self.entries.push(serde_json::json!({
            "mediaType": OCI_MANIFEST, "digest": img.digest, "size": img.manifest.len(),
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }));
        self.write_index();
        self
    }

    /// Adds a multi-platform image (an index) under `tag`.
    pub fn add_index(&mut self, images: &[&Image], tag: &str) -> &mut Self {
        for i in images {
            self.image_blobs(i);
        }
        let (bytes, digest) = index(images);
        self.blob(&bytes);
        self.entries.push(serde_json::json!({
            "mediaType": OCI_INDEX, "digest": digest, "size": bytes.len(),
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }));
        self.write_index();
        self
    }
}

/// A `docker save`-style archive (legacy layout: `<id>/layer.tar`, `<config hex>.json`,
/// `manifest.json`), with a symlinked duplicate layer when two layers are identical.
pub fn docker_save_archive(img: &Image, repo_tag: &str) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    let add = |b: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        b.append_data(&mut h, path, data).unwrap();
    };
    let mut names = Vec::new();
    let mut seen: HashMap<String, String> = HashMap::new();
    for (i, l) in img.layers.iter().enumerate() {
        let id = format!("{:064x}", i + 1);
        let name = format!("{id}/layer.tar");
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(0o755);
        h.set_size(0);
        b.append_data(&mut h, format!("{id}/"), std::io::empty()).unwrap();
        if let Some(first) = seen.get(&l.diff_id) {
            let mut h = tar::Header::new_gnu();
            h.set_entry_type(tar::EntryType::Symlink);
            h.set_size(0);
            b.append_link(&mut h, &name, format!("../{first}")).unwrap();
        } else {
            // Legacy archives hold the uncompressed tar.
            add(&mut b, &name, &l.tar);
            seen.insert(l.diff_id.clone(), name.clone());
        }
        names.push(name);
    }
    let config_name = format!("{}.json", hex_of(&img.config_digest));
    add(&mut b, &config_name, &img.config);
    let manifest =
        serde_json::to_vec(&serde_json::json!([{"Config": config_name, "RepoTags": [repo_tag], "Layers": names}]))
            .unwrap();
    add(&mut b, "manifest.json", &manifest);
    b.into_inner().unwrap()
}

// ---------------------------------------------------------------------------------------------
// the real registry

fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// Debian's docker-registry on 127.0.0.1, killed on drop.
pub struct Registry {
    child: Child,
    pub addr: String,
    pub creds: Option<(String, String)>,
    _dir: tempfile::TempDir,
}

impl Registry {
    pub fn start(creds: Option<(&str, &str)>) -> Registry {
        let bin = "/usr/bin/docker-registry";
        assert!(Path::new(bin).exists(), "{bin} is missing: apt-get install docker-registry");
        let dir = tempfile::tempdir().unwrap();
        let mut auth = String::new();
        if let Some((u, p)) = creds {
            let out =
                Command::new("htpasswd").args(["-Bbn", u, p]).output().expect("htpasswd (apache2-utils) is needed");
            assert!(out.status.success());
            std::fs::write(dir.path().join("htpasswd"), &out.stdout).unwrap();
            auth = format!(
                "auth:\n  htpasswd:\n    realm: test-realm\n    path: {}\n",
                dir.path().join("htpasswd").display()
            );
        }
        // A port taken between the probe and the registry's bind makes it exit: retry.
        for _ in 0..5 {
            let port = free_port();
            let addr = format!("127.0.0.1:{port}");
            let config = format!(
                "version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: {}\n  delete:\n    enabled: true\nhttp:\n  addr: {addr}\n  secret: test-secret\n{auth}",
                dir.path().join("data").display()
            );
            let cfg_path = dir.path().join("config.yml");
            std::fs::write(&cfg_path, config).unwrap();
            let mut child = Command::new(bin)
                .arg("serve")
                .arg(&cfg_path)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let deadline = Instant::now() + Duration::from_secs(20);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    break;
                }
                if let Ok(mut s) = std::net::TcpStream::connect(&addr) {
                    use std::io::Read;
                    let _ = s.set_read_timeout(Some(Duration::from_secs(2)));
                    let _ = s.write_all(b"GET /v2/ HTTP/1.0\r\n\r\n");
                    let mut buf = [0u8; 64];
                    if let Ok(n) = s.read(&mut buf)
                        && buf[..n].starts_with(b"HTTP/1.")
                    {
                        return Registry { child, addr, creds: creds.map(|(u, p)| (u.into(), p.into())), _dir: dir };
                    }
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        panic!("docker-registry did not start");
    }

    /// Pushes `oci:<layout>:<tag>` to `<repo>:<tag>` with skopeo (`all` for indexes).
    pub fn push(&self, layout: &Path, tag: &str, repo: &str, all: bool) {
        self.push_as(layout, tag, repo, all, None);
    }

    /// Pushes, converting to a manifest `format` (`v2s2`: Docker schema 2) when given.
    pub fn push_as(&self, layout: &Path, tag: &str, repo: &str, all: bool, format: Option<&str>) {
        let mut cmd = Command::new("skopeo");
        cmd.args(["copy", "--quiet", "--insecure-policy", "--dest-tls-verify=false"]);
        match format {
            Some(f) => {
                cmd.arg("--format").arg(f);
            }
            None => {
                cmd.arg("--preserve-digests");
            }
        }
        if all {
            cmd.arg("--all");
        }
        if let Some((u, p)) = &self.creds {
            cmd.arg("--dest-creds").arg(format!("{u}:{p}"));
        }
        cmd.arg(format!("oci:{}:{tag}", layout.display()));
        cmd.arg(format!("docker://{}/{repo}:{tag}", self.addr));
        let out = cmd.output().expect("skopeo is needed");
        assert!(out.status.success(), "skopeo copy failed: {}", String::from_utf8_lossy(&out.stderr));
    }

    pub fn reference(&self, repo_tag: &str) -> String {
        format!("{}/{repo_tag}", self.addr)
    }
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------------
// fake registries

/// Serves the blobs and manifests it is given, with optional bearer-token auth (the token
/// from a separate token service), blob redirects to another port, corrupt or missing blobs and
/// stalled blob bodies. Counts requests.
#[derive(Default)]
pub struct Fake {
    pub blobs: std::sync::Mutex<HashMap<String, Vec<u8>>>,
    /// tag or digest -> (media type, bytes)
    pub manifests: std::sync::Mutex<HashMap<String, (String, Vec<u8>)>>,
    /// Require `Authorization: Bearer <token>`, challenging with this realm.
    pub bearer: std::sync::Mutex<Option<(String, String)>>,
    /// Redirect blob GETs to `<base>/blobs/<digest>`.
    pub redirect_blobs: std::sync::Mutex<Option<String>>,
    /// Serve these blobs with one byte flipped.
    pub corrupt: std::sync::Mutex<HashSet<String>>,
    /// Send these blobs' first bytes, then nothing, forever.
    pub stall: std::sync::Mutex<HashSet<String>>,
    pub manifest_gets: AtomicUsize,
    pub blob_gets: AtomicUsize,
    pub authorized_gets: AtomicUsize,
}

impl Fake {
    pub fn add_image(&self, img: &Image, tag: &str) {
        let mut blobs = self.blobs.lock().unwrap();
        for l in &img.layers {
            blobs.insert(l.digest.clone(), l.blob.clone());
        }
        blobs.insert(img.config_digest.clone(), img.config.clone());
        let mut m = self.manifests.lock().unwrap();
        m.insert(tag.into(), (OCI_MANIFEST.into(), img.manifest.clone()));
        m.insert(img.digest.clone(), (OCI_MANIFEST.into(), img.manifest.clone()));
    }
}

async fn fake_v2(State(f): State<Arc<Fake>>, UrlPath(rest): UrlPath<String>, headers: HeaderMap) -> Response {
    if let Some((realm, token)) = f.bearer.lock().unwrap().clone() {
        let ok = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) == Some(&format!("Bearer {token}"));
        if !ok {
            let repo = rest.split("/manifests/").next().unwrap_or("").split("/blobs/").next().unwrap_or("");
            let challenge = format!(r#"Bearer realm="{realm}",service="fake-registry",scope="repository:{repo}:pull""#);
            return (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, challenge)],
                r#"{"errors":[{"code":"UNAUTHORIZED"}]}"#,
            )
                .into_response();
        }
        f.authorized_gets.fetch_add(1, Ordering::SeqCst);
    }
    if let Some((_, reference)) = rest.split_once("/manifests/") {
        f.manifest_gets.fetch_add(1, Ordering::SeqCst);
        return match f.manifests.lock().unwrap().get(reference) {
            Some((mt, bytes)) => (StatusCode::OK, [(header::CONTENT_TYPE, mt.clone())], bytes.clone()).into_response(),
            None => (StatusCode::NOT_FOUND, r#"{"errors":[{"code":"MANIFEST_UNKNOWN","message":"manifest unknown"}]}"#)
                .into_response(),
        };
    }
    if let Some((_, digest)) = rest.split_once("/blobs/") {
        f.blob_gets.fetch_add(1, Ordering::SeqCst);
        if let Some(base) = f.redirect_blobs.lock().unwrap().clone() {
            return (
                StatusCode::TEMPORARY_REDIRECT,
                [(header::LOCATION, format!("{base}/blobs/{digest}?X-Signature=secret"))],
            )
                .into_response();
        }
        return serve_blob(&f, digest);
    }
    StatusCode::NOT_FOUND.into_response()
}

fn serve_blob(f: &Fake, digest: &str) -> Response {
    let Some(mut bytes) = f.blobs.lock().unwrap().get(digest).cloned() else {
        return (StatusCode::NOT_FOUND, r#"{"errors":[{"code":"BLOB_UNKNOWN","message":"blob unknown to registry"}]}"#)
            .into_response();
    };
    if f.corrupt.lock().unwrap().contains(digest) {
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0xff;
    }
    if f.stall.lock().unwrap().contains(digest) {
        let len = bytes.len();
        let first = Bytes::from(bytes[..len / 2].to_vec());
        let stream =
            futures::stream::once(async move { Ok::<_, std::io::Error>(first) }).chain(futures::stream::pending());
        return Response::builder().header(header::CONTENT_LENGTH, len).body(Body::from_stream(stream)).unwrap();
    }
    (StatusCode::OK, bytes).into_response()
}

use futures::StreamExt;

/// A running fake registry.
pub struct FakeServer {
    pub state: Arc<Fake>,
    pub addr: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for FakeServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn serve_fake(state: Arc<Fake>) -> FakeServer {
    let router = axum::Router::new().route("/v2/{*rest}", get(fake_v2)).with_state(state.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    FakeServer { state, addr, task }
}

/// Where redirected blobs are served: fails (and remembers) any request that carries an
/// `Authorization` header.
pub struct BlobHost {
    pub addr: String,
    pub saw_authorization: Arc<AtomicBool>,
    pub gets: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for BlobHost {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn serve_blob_host(registry: Arc<Fake>) -> BlobHost {
    let saw = Arc::new(AtomicBool::new(false));
    let gets = Arc::new(AtomicUsize::new(0));
    let (saw2, gets2) = (saw.clone(), gets.clone());
    let router = axum::Router::new().route(
        "/blobs/{digest}",
        get(move |UrlPath(digest): UrlPath<String>, headers: HeaderMap| {
            let (saw, gets, registry) = (saw2.clone(), gets2.clone(), registry.clone());
            async move {
                gets.fetch_add(1, Ordering::SeqCst);
                if headers.contains_key(header::AUTHORIZATION) {
                    saw.store(true, Ordering::SeqCst);
                    return (StatusCode::BAD_REQUEST, "credentials leaked to the blob host").into_response();
                }
                serve_blob(&registry, &digest)
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    BlobHost { addr, saw_authorization: saw, gets, task }
}

/// A token service: `GET /token` with Basic `user:pass`, or `POST /token` with
/// `grant_type=refresh_token&refresh_token=<refresh>`, answers the token.
pub struct TokenServer {
    pub realm: String,
    pub issued: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn serve_tokens(user: &str, pass: &str, refresh: &str, token: &str) -> TokenServer {
    use base64::Engine;
    let basic = format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(format!("{user}:{pass}")));
    let issued = Arc::new(AtomicUsize::new(0));
    let (issued_get, issued_post) = (issued.clone(), issued.clone());
    let (token_get, token_post) = (token.to_string(), token.to_string());
    let refresh = refresh.to_string();
    let router = axum::Router::new().route(
        "/token",
        get(move |headers: HeaderMap, uri: axum::http::Uri| {
            let (basic, token, issued) = (basic.clone(), token_get.clone(), issued_get.clone());
            async move {
                let query = uri.query().unwrap_or("");
                if !query.contains("service=fake-registry") || !query.contains("scope=repository") {
                    return (StatusCode::BAD_REQUEST, "missing service or scope").into_response();
                }
                if headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) != Some(basic.as_str()) {
                    return (StatusCode::UNAUTHORIZED, "bad credentials").into_response();
                }
                issued.fetch_add(1, Ordering::SeqCst);
                ([(header::CONTENT_TYPE, "application/json")], format!(r#"{{"token":"{token}","expires_in":300}}"#))
                    .into_response()
            }
        })
        .post(move |body: String| {
            let (refresh, token, issued) = (refresh.clone(), token_post.clone(), issued_post.clone());
            async move {
                let form: HashMap<&str, &str> = body.split('&').filter_map(|kv| kv.split_once('=')).collect();
                if form.get("grant_type") != Some(&"refresh_token")
                    || form.get("refresh_token") != Some(&refresh.as_str())
                {
                    return (StatusCode::UNAUTHORIZED, "bad refresh token").into_response();
                }
                issued.fetch_add(1, Ordering::SeqCst);
                ([(header::CONTENT_TYPE, "application/json")], format!(r#"{{"access_token":"{token}"}}"#))
                    .into_response()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let _ = axum::serve(listener, router).await;
    });
    TokenServer { realm: format!("http://{addr}/token"), issued, task }
}

/// A TCP listener that accepts connections and never answers.
pub struct Hang {
    pub addr: String,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Hang {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub async fn serve_hang() -> Hang {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((s, _)) = listener.accept().await {
            held.push(s);
        }
    });
    Hang { addr, task }
}

// ---------------------------------------------------------------------------------------------
// the store, seen from outside

/// Layer ids in the store (complete ones: meta.json present).
pub fn stored_layers(store: &Store) -> Vec<String> {
    let mut out: Vec<String> = std::fs::read_dir(store.root().join("layers"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| n != ".tmp")
        .collect();
    out.sort();
    for id in &out {
        assert!(store.root().join("layers").join(id).join("meta.json").is_file(), "layer {id} is incomplete");
    }
    out
}

/// Nothing left in `layers/.tmp`.
pub fn assert_tmp_empty(store: &Store) {
    let left: Vec<_> = std::fs::read_dir(store.tmp_dir()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "layers/.tmp is not empty: {left:?}");
}

/// After a failed import into an empty store: no layer, no temporary file.
pub fn assert_store_clean(store: &Store) {
    assert_eq!(stored_layers(store), Vec::<String>::new(), "a failed import left layers");
    assert_tmp_empty(store);
}

/// The union of layers (bottom first) as overlayfs shows it, computed from the layers'
/// overlay format: a whiteout hides the name and everything under it; a non-directory hides
/// what was under its name.
pub fn merged(store: &Store, layers: &[opendsec_images::LayerId]) -> BTreeMap<String, Node> {
    let mut view: BTreeMap<String, Node> = BTreeMap::new();
    for id in layers {
        for (path, node) in snapshot(&store.layer_rootfs(id)) {
            let hides_below = node.kind != 'd';
            if hides_below {
                let prefix = format!("{path}/");
                view.retain(|k, _| !k.starts_with(&prefix));
            }
            if node.is_whiteout() {
                view.remove(&path);
            } else {
                view.insert(path, node);
            }
        }
    }
    view
}

/// The content of a regular file in a view.
pub fn content_of<'a>(view: &'a BTreeMap<String, Node>, path: &str) -> Option<&'a [u8]> {
    view.get(path).filter(|n| n.kind == 'f').map(|n| n.content.as_slice())
}
