//! Registry imports against a real registry (Debian's docker-registry on 127.0.0.1, images
//! pushed by skopeo from layouts the tests write) and against fake registries for what a real
//! one will not do (token services, redirects to another host, corrupt blobs, hangs).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::support::*;
use opendsec_images::import::{Credentials, ImportError, ImportOptions, RegistryError, import_from_registry};
use opendsec_images::layer::{Compression, Limits, import_layer};
use opendsec_images::{LayerId, Store};

fn new_store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("store")).unwrap();
    (dir, store)
}

/// A busybox image: /bin/busybox from busybox-static and a few applet links.
fn busybox_image() -> Image {
    let bin = std::fs::read("/bin/busybox").expect("busybox-static is needed");
    let mut t = TarBuilder::new().dir("bin").file_mode("bin/busybox", &bin, 0o755);
    for applet in ["sh", "ls", "echo", "cat"] {
        t = t.symlink(&format!("bin/{applet}"), "busybox");
    }
    image(vec![layer(t.finish(), Comp::Gzip)], "amd64", &["PATH=/bin"], &["sh"])
}

/// Three layers with deletions: a whiteout, an opaque directory, and hard links.
fn layered_image() -> Image {
    let l1 = TarBuilder::new()
        .dir("etc")
        .file("etc/a", b"A")
        .file("etc/b", b"B")
        .dir("d")
        .file("d/x", b"X")
        .dir("d/sub")
        .file("d/sub/y", b"Y")
        .file("keep", b"K")
        .finish();
    let l2 = TarBuilder::new()
        .dir("etc")
        .whiteout("etc/a")
        .dir("d")
        .opaque("d")
        .file("d/z", b"Z")
        .file("new", b"N")
        .finish();
    let l3 = TarBuilder::new().file("h1", b"H").hardlink("h2", "h1").symlink("s", "keep").whiteout("keep").finish();
    image(vec![layer(l1, Comp::Gzip), layer(l2, Comp::Gzip), layer(l3, Comp::Gzip)], "amd64", &["A=1"], &["/bin/true"])
}

fn push(reg: &Registry, img: &Image, repo: &str, tag: &str) {
    let dir = tempfile::tempdir().unwrap();
    Layout::new(dir.path()).add_image(img, tag);
    reg.push(dir.path(), tag, repo, false);
}

#[tokio::test]
async fn busybox_from_a_real_registry() {
    let reg = Registry::start(None);
    let img = busybox_image();
    push(&reg, &img, "tools/busybox", "1.35");
    let (_d, store) = new_store();

    let got = import_from_registry(&store, &reg.reference("tools/busybox:1.35"), &local_opts()).await.unwrap();

    assert_eq!(got.layers, vec![LayerId::parse(&img.layers[0].diff_id).unwrap()]);
    assert_eq!((got.fetched_layers, got.reused_layers), (1, 0));
    assert_eq!(got.config.env, vec!["PATH=/bin"]);
    assert_eq!(got.config.cmd, vec!["sh"]);
    assert!(got.source.starts_with(&format!("{}/tools/busybox@sha256:", reg.addr)), "{}", got.source);
    let rootfs = store.layer_rootfs(&got.layers[0]);
    assert_eq!(std::fs::read(rootfs.join("bin/busybox")).unwrap(), std::fs::read("/bin/busybox").unwrap());
    assert_eq!(std::fs::read_link(rootfs.join("bin/sh")).unwrap().to_str(), Some("busybox"));
    let out = std::process::Command::new(rootfs.join("bin/busybox")).args(["echo", "hello"]).output().unwrap();
    assert_eq!(out.stdout, b"hello\n");
    assert_tmp_empty(&store);

    // The same image as a Docker schema 2 manifest (Docker media types throughout).
    let dir = tempfile::tempdir().unwrap();
    Layout::new(dir.path()).add_image(&img, "v2s2");
    reg.push_as(dir.path(), "v2s2", "tools/busybox", false, Some("v2s2"));
    let (_d2, store2) = new_store();
    let served = reqwest::Client::new()
        .get(format!("http://{}/v2/tools/busybox/manifests/v2s2", reg.addr))
        .header("Accept", "application/vnd.docker.distribution.manifest.v2+json")
        .send()
        .await
        .unwrap();
    assert_eq!(served.headers()["content-type"], "application/vnd.docker.distribution.manifest.v2+json");
    let docker = import_from_registry(&store2, &reg.reference("tools/busybox:v2s2"), &local_opts()).await.unwrap();
    assert_eq!(docker.layers, got.layers);
    assert_eq!(docker.config, got.config);
}

#[tokio::test]
async fn layers_with_deletions_stack_like_the_originals() {
    let reg = Registry::start(None);
    let img = layered_image();
    push(&reg, &img, "layered", "v1");
    let (_d, store) = new_store();

    let got = import_from_registry(&store, &reg.reference("layered:v1"), &local_opts()).await.unwrap();

    // The import path gives the same layers as unpacking the tars directly.
    let (_d2, direct) = new_store();
    let mut direct_ids: Vec<LayerId> = Vec::new();
    for l in &img.layers {
        let meta = import_layer(
            &direct,
            &mut l.tar.as_slice(),
            Compression::None,
            Some(&l.diff_id),
            &direct_ids,
            &Limits::default(),
            "direct",
        )
        .unwrap();
        direct_ids.push(meta.id);
    }
    assert_eq!(got.layers, direct_ids);
    for (a, b) in got.layers.iter().zip(&direct_ids) {
        assert_eq!(snapshot(&store.layer_rootfs(a)), snapshot(&direct.layer_rootfs(b)), "layer {a}");
    }
    // The opaque layer's id depends on what is below it; the others are their diff ids.
    assert_eq!(got.layers[0].diff_id(), img.layers[0].diff_id);
    assert_ne!(got.layers[1].diff_id(), img.layers[1].diff_id);
    assert_eq!(got.layers[2].diff_id(), img.layers[2].diff_id);
    let l2 = snapshot(&store.layer_rootfs(&got.layers[1]));
    for hidden in ["etc/a", "d/x", "d/sub"] {
        assert!(l2.get(hidden).is_some_and(Node::is_whiteout), "{hidden} in layer 2: {l2:?}");
        // Whiteouts carry no time of unpacking: a layer unpacked twice is the same tree.
        assert_eq!(l2[hidden].mtime, 0, "{hidden}");
    }
    // Stacked, the image shows what the layers say.
    let view = merged(&store, &got.layers);
    let names: Vec<&str> = view.keys().map(String::as_str).collect();
    assert_eq!(names, vec!["d", "d/z", "etc", "etc/b", "h1", "h2", "new", "s"]);
    assert_eq!(content_of(&view, "d/z"), Some(&b"Z"[..]));
    assert_eq!(view.get("s").map(|n| (n.kind, n.content.as_slice())), Some(('l', &b"keep"[..])));
    let l3 = store.layer_rootfs(&got.layers[2]);
    use std::os::unix::fs::MetadataExt;
    assert_eq!(std::fs::metadata(l3.join("h1")).unwrap().ino(), std::fs::metadata(l3.join("h2")).unwrap().ino());

    // Again: nothing is fetched.
    let again = import_from_registry(&store, &reg.reference("layered:v1"), &local_opts()).await.unwrap();
    assert_eq!(again.layers, got.layers);
    assert_eq!((again.fetched_layers, again.reused_layers), (0, 3));
    // By digest too.
    let pinned = got.source.clone();
    let by_digest = import_from_registry(&store, &pinned, &local_opts()).await.unwrap();
    assert_eq!(by_digest.layers, got.layers);
    assert_tmp_empty(&store);
}

#[tokio::test]
async fn an_index_resolves_to_linux_amd64() {
    let reg = Registry::start(None);
    let arm = image(vec![layer(TarBuilder::new().file("arch", b"arm64").finish(), Comp::Gzip)], "arm64", &[], &[]);
    let amd = image(vec![layer(TarBuilder::new().file("arch", b"amd64").finish(), Comp::Gzip)], "amd64", &[], &[]);
    let dir = tempfile::tempdir().unwrap();
    Layout::new(dir.path()).add_index(&[&arm, &amd], "multi");
    reg.push(dir.path(), "multi", "multi", true);
    let (_d, store) = new_store();

    let got = import_from_registry(&store, &reg.reference("multi:multi"), &local_opts()).await.unwrap();

    assert_eq!(std::fs::read(store.layer_rootfs(&got.layers[0]).join("arch")).unwrap(), b"amd64");
    assert!(got.source.ends_with(&amd.digest), "{}", got.source);

    // A Docker manifest list.
    reg.push_as(dir.path(), "multi", "multi-docker", true, Some("v2s2"));
    let served = reqwest::Client::new()
        .get(format!("http://{}/v2/multi-docker/manifests/multi", reg.addr))
        .header("Accept", "application/vnd.docker.distribution.manifest.list.v2+json")
        .send()
        .await
        .unwrap();
    assert_eq!(served.headers()["content-type"], "application/vnd.docker.distribution.manifest.list.v2+json");
    let (_d3, store3) = new_store();
    let docker = import_from_registry(&store3, &reg.reference("multi-docker:multi"), &local_opts()).await.unwrap();
    assert_eq!(std::fs::read(store3.layer_rootfs(&docker.layers[0]).join("arch")).unwrap(), b"amd64");

    // An index without amd64 is refused, naming what it has.
    let only_arm = tempfile::tempdir().unwrap();
    Layout::new(only_arm.path()).add_index(&[&arm], "arm");
    reg.push(only_arm.path(), "arm", "armonly", true);
    let (_d2, store2) = new_store();
    match import_from_registry(&store2, &reg.reference("armonly:arm"), &local_opts()).await {
        Err(ImportError::Registry(RegistryError::NoAmd64 { available, .. })) => {
            assert_eq!(available, vec!["linux/arm64".to_string()])
        }
        other => panic!("expected NoAmd64, got {other:?}"),
    }
    assert_store_clean(&store2);
}

#[tokio::test]
async fn zstd_and_uncompressed_layers() {
    let reg = Registry::start(None);
    let img = image(
        vec![
            layer(TarBuilder::new().file("g", b"gzip").finish(), Comp::Gzip),
            layer(TarBuilder::new().file("z", b"zstd").finish(), Comp::Zstd),
            layer(TarBuilder::new().file("p", b"plain").finish(), Comp::Plain),
        ],
        "amd64",
        &[],
        &[],
    );
    push(&reg, &img, "comp", "all");
    let (_d, store) = new_store();

    let got = import_from_registry(&store, &reg.reference("comp:all"), &local_opts()).await.unwrap();

    let view = merged(&store, &got.layers);
    assert_eq!(content_of(&view, "g"), Some(&b"gzip"[..]));
    assert_eq!(content_of(&view, "z"), Some(&b"zstd"[..]));
    assert_eq!(content_of(&view, "p"), Some(&b"plain"[..]));
    assert_eq!(got.fetched_layers, 3);
}

#[tokio::test]
async fn basic_auth_registry() {
    let reg = Registry::start(Some(("alice", "s3cret-pw")));
    let img = busybox_image();
    push(&reg, &img, "private/bb", "v1");
    let reference = reg.reference("private/bb:v1");

    // Without credentials: a clear refusal, nothing stored.
    let (_d, store) = new_store();
    let err = import_from_registry(&store, &reference, &local_opts()).await.unwrap_err();
    assert!(matches!(err, ImportError::Registry(RegistryError::Unauthorized { .. })), "{err:?}");
    assert!(err.to_string().contains("user name and password"), "{err}");
    assert_store_clean(&store);

    // Wrong password.
    let wrong = ImportOptions {
        credentials: Some(Credentials { username: "alice".into(), password: "nope".into() }),
        ..local_opts()
    };
    let err = import_from_registry(&store, &reference, &wrong).await.unwrap_err();
    assert!(matches!(err, ImportError::Registry(RegistryError::Unauthorized { .. })), "{err:?}");
    assert!(!err.to_string().contains("nope"));
    assert_store_clean(&store);

    // --username + password.
    let opts = ImportOptions {
        credentials: Some(Credentials { username: "alice".into(), password: "s3cret-pw".into() }),
        ..local_opts()
    };
    let got = import_from_registry(&store, &reference, &opts).await.unwrap();
    assert_eq!(got.layers.len(), 1);

    // docker's config.json.
    let (_d2, store2) = new_store();
    let cfg_dir = tempfile::tempdir().unwrap();
    let cfg = cfg_dir.path().join("config.json");
    use base64::Engine;
    let auth = base64::engine::general_purpose::STANDARD.encode("alice:s3cret-pw");
    std::fs::write(&cfg, format!(r#"{{"auths":{{"http://{}/v2/":{{"auth":"{auth}"}}}}}}"#, reg.addr)).unwrap();
    let opts = ImportOptions { docker_config: Some(cfg), ..local_opts() };
    let got2 = import_from_registry(&store2, &reference, &opts).await.unwrap();
    assert_eq!(got2.layers, got.layers);
}

#[tokio::test]
async fn token_service_and_redirects_without_credentials() {
    let img = layered_image();
    let fake = Arc::new(Fake::default());
    fake.add_image(&img, "v1");
    let tokens = serve_tokens("bob", "pw", "refresh-123", "tok-abc").await;
    *fake.bearer.lock().unwrap() = Some((tokens.realm.clone(), "tok-abc".into()));
    let blobs = serve_blob_host(fake.clone()).await;
    *fake.redirect_blobs.lock().unwrap() = Some(format!("http://{}", blobs.addr));
    let server = serve_fake(fake.clone()).await;
    let reference = format!("{}/team/app:v1", server.addr);

    // Anonymous: the token service refuses.
    let (_d, store) = new_store();
    let err = import_from_registry(&store, &reference, &local_opts()).await.unwrap_err();
    assert!(matches!(err, ImportError::Registry(RegistryError::Unauthorized { .. })), "{err:?}");
    assert_store_clean(&store);

    // Basic credentials exchanged for a token; blobs come from the other port, without them.
    let opts = ImportOptions {
        credentials: Some(Credentials { username: "bob".into(), password: "pw".into() }),
        ..local_opts()
    };
    let got = import_from_registry(&store, &reference, &opts).await.unwrap();
    assert_eq!(got.layers.len(), 3);
    assert!(!blobs.saw_authorization.load(Ordering::SeqCst), "the redirect carried credentials");
    assert_eq!(blobs.gets.load(Ordering::SeqCst), 4, "config and three layers from the blob host");
    assert!(fake.authorized_gets.load(Ordering::SeqCst) >= 5);
    assert_eq!(tokens.issued.load(Ordering::SeqCst), 1, "one token serves every request");

    // An identity token from docker's config: OAuth2 refresh at the realm.
    let (_d2, store2) = new_store();
    let cfg_dir = tempfile::tempdir().unwrap();
    let cfg = cfg_dir.path().join("config.json");
    std::fs::write(&cfg, format!(r#"{{"auths":{{"{}":{{"identitytoken":"refresh-123"}}}}}}"#, server.addr)).unwrap();
    let opts = ImportOptions { docker_config: Some(cfg), ..local_opts() };
    let got2 = import_from_registry(&store2, &reference, &opts).await.unwrap();
    assert_eq!(got2.layers, got.layers);
    assert_eq!(tokens.issued.load(Ordering::SeqCst), 2);

    // Re-import: no blob is fetched.
    let before = fake.blob_gets.load(Ordering::SeqCst);
    let again = import_from_registry(&store2, &reference, &opts).await.unwrap();
    assert_eq!((again.fetched_layers, again.reused_layers), (0, 3));
    assert_eq!(fake.blob_gets.load(Ordering::SeqCst), before + 1, "only the config blob");
}

#[tokio::test]
async fn a_registry_that_hangs_times_out() {
    let hang = serve_hang().await;
    let (_d, store) = new_store();
    let opts = ImportOptions { timeout: Duration::from_millis(500), ..local_opts() };
    // Bounded: an import that waited on the hung registry forever would fail here.
    let err = tokio::time::timeout(
        Duration::from_secs(30),
        import_from_registry(&store, &format!("{}/x:y", hang.addr), &opts),
    )
    .await
    .expect("the import gave up on the hung registry")
    .unwrap_err();

    assert!(matches!(err, ImportError::Registry(RegistryError::Timeout { .. })), "{err:?}");
    assert!(err.to_string().contains("did not answer"), "{err}");
    assert_store_clean(&store);
}

#[tokio::test]
async fn a_registry_that_is_not_there() {
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let (_d, store) = new_store();

    let err = import_from_registry(&store, &format!("127.0.0.1:{port}/x:y"), &local_opts()).await.unwrap_err();

    assert!(matches!(err, ImportError::Registry(RegistryError::Http { .. })), "{err:?}");
    assert!(err.to_string().contains("refused"), "{err}");
    assert_store_clean(&store);
}

#[tokio::test]
async fn a_blob_that_stalls_times_out_and_leaves_nothing() {
    let img = layered_image();
    let fake = Arc::new(Fake::default());
    fake.add_image(&img, "v1");
    fake.stall.lock().unwrap().insert(img.layers[0].digest.clone());
    let server = serve_fake(fake.clone()).await;
    let (_d, store) = new_store();
    let opts = ImportOptions { timeout: Duration::from_millis(500), ..local_opts() };

    let err = import_from_registry(&store, &format!("{}/x:v1", server.addr), &opts).await.unwrap_err();

    assert!(matches!(err, ImportError::Registry(RegistryError::Timeout { .. })), "{err:?}");
    assert_store_clean(&store);
}

#[tokio::test]
async fn a_corrupt_blob_is_a_digest_mismatch() {
    let img = busybox_image();
    let fake = Arc::new(Fake::default());
    fake.add_image(&img, "v1");
    fake.corrupt.lock().unwrap().insert(img.layers[0].digest.clone());
    let server = serve_fake(fake.clone()).await;
    let (_d, store) = new_store();

    let err = import_from_registry(&store, &format!("{}/x:v1", server.addr), &local_opts()).await.unwrap_err();

    match &err {
        ImportError::Registry(RegistryError::DigestMismatch { expected, .. }) => {
            assert_eq!(expected, &img.layers[0].digest)
        }
        other => panic!("expected DigestMismatch, got {other:?}"),
    }
    assert_store_clean(&store);

    // A manifest fetched by digest must hash to it.
    let other = layered_image();
    fake.manifests.lock().unwrap().insert(img.digest.clone(), (OCI_MANIFEST.into(), other.manifest.clone()));
    let err =
        import_from_registry(&store, &format!("{}/x@{}", server.addr, img.digest), &local_opts()).await.unwrap_err();
    assert!(matches!(err, ImportError::Registry(RegistryError::DigestMismatch { .. })), "{err:?}");
    assert_store_clean(&store);
}

#[tokio::test]
async fn a_manifest_naming_a_missing_blob() {
    let img = layered_image();
    let fake = Arc::new(Fake::default());
    fake.add_image(&img, "v1");
    fake.blobs.lock().unwrap().remove(&img.layers[0].digest);
    let server = serve_fake(fake.clone()).await;
    let (_d, store) = new_store();

    let err = import_from_registry(&store, &format!("{}/x:v1", server.addr), &local_opts()).await.unwrap_err();

    match &err {
        ImportError::Registry(RegistryError::BlobNotFound { digest, .. }) => assert_eq!(digest, &img.layers[0].digest),
        other => panic!("expected BlobNotFound, got {other:?}"),
    }
    assert_store_clean(&store);

    // The top layer missing: what was stored below is complete, nothing is half-written.
    let fake = Arc::new(Fake::default());
    fake.add_image(&img, "v1");
    fake.blobs.lock().unwrap().remove(&img.layers[2].digest);
    let server = serve_fake(fake.clone()).await;
    let (_d2, store2) = new_store();
    let err = import_from_registry(&store2, &format!("{}/x:v1", server.addr), &local_opts()).await.unwrap_err();
    assert!(matches!(err, ImportError::Registry(RegistryError::BlobNotFound { .. })), "{err:?}");
    assert!(stored_layers(&store2).len() <= 2);
    assert_tmp_empty(&store2);

    // And a missing manifest.
    let err = import_from_registry(&store2, &format!("{}/x:nope", server.addr), &local_opts()).await.unwrap_err();
    assert!(matches!(err, ImportError::Registry(RegistryError::ManifestNotFound { .. })), "{err:?}");
}

#[tokio::test]
async fn limits_stop_downloads() {
    let img = busybox_image();
    let fake = Arc::new(Fake::default());
    fake.add_image(&img, "v1");
    let server = serve_fake(fake.clone()).await;
    let (_d, store) = new_store();
    let opts = ImportOptions { limits: Limits { max_layer_bytes: 1000, ..Limits::default() }, ..local_opts() };

    let err = import_from_registry(&store, &format!("{}/x:v1", server.addr), &opts).await.unwrap_err();

    assert!(matches!(err, ImportError::Registry(RegistryError::TooLarge { .. })), "{err:?}");
    assert_eq!(fake.blob_gets.load(Ordering::SeqCst), 1, "only the config was fetched");
    assert_store_clean(&store);
}
