//! Offline imports: OCI layouts (ours and umoci's), `docker save` archives (plain and
//! compressed, legacy and blobs/ layouts), and plain root file systems (directory, tarball).

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::process::Command;

use crate::support::*;
use opendsec_images::import::{ImportError, ImportOptions, RegistryError};
use opendsec_images::layer::{LayerError, Limits};
use opendsec_images::offline::{import_docker_archive, import_oci_layout, import_rootfs};
use opendsec_images::{LayerId, Store};

fn new_store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("store")).unwrap();
    (dir, store)
}

fn two_layers() -> Image {
    let l1 = TarBuilder::new().dir("d").file("d/x", b"X").file("d/y", b"Y").file("a", b"A").finish();
    let l2 = TarBuilder::new().dir("d").opaque("d").file("d/z", b"Z").whiteout("a").finish();
    image(vec![layer(l1, Comp::Zstd), layer(l2, Comp::Gzip)], "amd64", &["PATH=/usr/bin"], &["run"])
}

#[tokio::test]
async fn oci_layout_by_tag() {
    let img = two_layers();
    let other = image(vec![layer(TarBuilder::new().file("o", b"O").finish(), Comp::Plain)], "amd64", &[], &[]);
    let dir = tempfile::tempdir().unwrap();
    Layout::new(dir.path()).add_image(&img, "one").add_image(&other, "two");
    let (_d, store) = new_store();

    let got = import_oci_layout(&store, dir.path(), Some("one"), &local_opts()).await.unwrap();

    assert_eq!(got.layers.len(), 2);
    assert_eq!(got.config.cmd, vec!["run"]);
    assert!(got.source.starts_with("oci-layout:") && got.source.ends_with(&img.digest), "{}", got.source);
    let view = merged(&store, &got.layers);
    assert_eq!(view.keys().map(String::as_str).collect::<Vec<_>>(), vec!["d", "d/z"]);
    // Two images and no tag: which one is ambiguous.
    match import_oci_layout(&store, dir.path(), None, &local_opts()).await {
        Err(ImportError::Ambiguous { names, .. }) => assert_eq!(names, vec!["one".to_string(), "two".to_string()]),
        other => panic!("expected Ambiguous, got {other:?}"),
    }
    assert!(matches!(
        import_oci_layout(&store, dir.path(), Some("three"), &local_opts()).await,
        Err(ImportError::Registry(RegistryError::ManifestNotFound { .. }))
    ));
    // Again: all reused.
    let again = import_oci_layout(&store, dir.path(), Some("one"), &local_opts()).await.unwrap();
    assert_eq!((again.fetched_layers, again.reused_layers), (0, 2));
    assert_tmp_empty(&store);
}

#[tokio::test]
async fn oci_layout_index_and_corruption() {
    let arm = image(vec![layer(TarBuilder::new().file("arch", b"arm64").finish(), Comp::Gzip)], "arm64", &[], &[]);
    let amd = image(vec![layer(TarBuilder::new().file("arch", b"amd64").finish(), Comp::Gzip)], "amd64", &[], &[]);
    let dir = tempfile::tempdir().unwrap();
    Layout::new(dir.path()).add_index(&[&arm, &amd], "latest");
    let (_d, store) = new_store();

    let got = import_oci_layout(&store, dir.path(), None, &local_opts()).await.unwrap();
    assert_eq!(std::fs::read(store.layer_rootfs(&got.layers[0]).join("arch")).unwrap(), b"amd64");

    // A blob that does not match its name is refused before anything is unpacked.
    let img = two_layers();
    let dir = tempfile::tempdir().unwrap();
    Layout::new(dir.path()).add_image(&img, "t");
    let blob = dir.path().join("blobs/sha256").join(img.layers[1].digest.strip_prefix("sha256:").unwrap());
    let mut bytes = std::fs::read(&blob).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 1;
    std::fs::write(&blob, bytes).unwrap();
    let (_d2, store2) = new_store();
    let err = import_oci_layout(&store2, dir.path(), Some("t"), &local_opts()).await.unwrap_err();
    assert!(matches!(err, ImportError::Registry(RegistryError::DigestMismatch { .. })), "{err:?}");
    // The bottom layer was fine and complete; nothing half-written, no temporary file.
    assert!(stored_layers(&store2).len() <= 1);
    assert_tmp_empty(&store2);

    // Not a layout at all.
    let empty = tempfile::tempdir().unwrap();
    assert!(matches!(
        import_oci_layout(&store2, empty.path(), None, &local_opts()).await,
        Err(ImportError::InvalidArchive { .. })
    ));
}

#[tokio::test]
async fn umoci_layout() {
    let work = tempfile::tempdir().unwrap();
    let layout = work.path().join("img");
    let bundle = work.path().join("bundle");
    let run = |args: &[&str]| {
        let out = Command::new("umoci").args(args).output().expect("umoci is needed");
        assert!(out.status.success(), "umoci {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    };
    let l = layout.to_str().unwrap();
    let b = bundle.to_str().unwrap();
    run(&["init", "--layout", l]);
    run(&["new", "--image", &format!("{l}:t")]);
    run(&["unpack", "--image", &format!("{l}:t"), b]);
    std::fs::create_dir_all(bundle.join("rootfs/bin")).unwrap();
    std::fs::copy("/bin/busybox", bundle.join("rootfs/bin/busybox")).unwrap();
    run(&["repack", "--refresh-bundle", "--image", &format!("{l}:t"), b]);
    std::fs::remove_file(bundle.join("rootfs/bin/busybox")).unwrap();
    run(&["repack", "--image", &format!("{l}:t"), b]);
    let (_d, store) = new_store();

    let got = import_oci_layout(&store, &layout, Some("t"), &local_opts()).await.unwrap();

    assert_eq!(got.layers.len(), 2);
    let view = merged(&store, &got.layers);
    assert!(view.contains_key("bin"), "{view:?}");
    assert!(!view.contains_key("bin/busybox"), "deleted in the second layer: {view:?}");
    assert!(store.layer_rootfs(&got.layers[0]).join("bin/busybox").is_file());
}

#[tokio::test]
async fn docker_save_archives() {
    // Layers 1 and 3 are the same tar: docker save links the second to the first.
    let base = TarBuilder::new().file("base", b"B").finish();
    let img = image(
        vec![
            layer(base.clone(), Comp::Plain),
            layer(TarBuilder::new().file("mid", b"M").finish(), Comp::Plain),
            layer(base, Comp::Plain),
        ],
        "amd64",
        &["X=1"],
        &["sh"],
    );
    let work = tempfile::tempdir().unwrap();
    let plain = work.path().join("save.tar");
    std::fs::write(&plain, docker_save_archive(&img, "x:latest")).unwrap();
    let (_d, store) = new_store();

    let got = import_docker_archive(&store, &plain, &local_opts()).await.unwrap();

    let ids: Vec<LayerId> = img.layers.iter().map(|l| LayerId::parse(&l.diff_id).unwrap()).collect();
    assert_eq!(got.layers, ids);
    assert_eq!(got.config.env, vec!["X=1"]);
    assert_eq!((got.fetched_layers, got.reused_layers), (2, 1));
    assert!(got.source.ends_with(&img.config_digest), "{}", got.source);

    // The same archive gzip-compressed.
    let gz = work.path().join("save.tar.gz");
    std::fs::write(&gz, compress(&std::fs::read(&plain).unwrap(), Comp::Gzip)).unwrap();
    let (_d2, store2) = new_store();
    let got2 = import_docker_archive(&store2, &gz, &local_opts()).await.unwrap();
    assert_eq!(got2.layers, ids);
    assert_tmp_empty(&store2);

    // A layer that does not match the config's diff id.
    let mut bad = img.clone();
    bad.layers[1] = layer(TarBuilder::new().file("mid", b"tampered").finish(), Comp::Plain);
    bad.layers[1].diff_id = img.layers[1].diff_id.clone();
    let bad_path = work.path().join("bad.tar");
    std::fs::write(&bad_path, docker_save_archive(&bad, "x:latest")).unwrap();
    let (_d3, store3) = new_store();
    let err = import_docker_archive(&store3, &bad_path, &local_opts()).await.unwrap_err();
    assert!(matches!(err, ImportError::Layer { .. }), "{err:?}");
    assert!(stored_layers(&store3).len() <= 1, "only the complete layer below");
    assert_tmp_empty(&store3);

    // Not a docker archive.
    let not = work.path().join("not.tar");
    std::fs::write(&not, TarBuilder::new().file("x", b"x").finish()).unwrap();
    assert!(matches!(
        import_docker_archive(&store3, &not, &local_opts()).await,
        Err(ImportError::InvalidArchive { .. })
    ));
}

#[tokio::test]
async fn docker_save_archive_with_blobs_layout() {
    // docker 25+: OCI-style blobs/sha256/<hex> named in manifest.json, compressed layers allowed.
    let img = two_layers();
    let mut b = tar::Builder::new(Vec::new());
    let mut add = |path: String, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(tar::EntryType::Regular);
        h.set_mode(0o644);
        h.set_size(data.len() as u64);
        b.append_data(&mut h, path, data).unwrap();
    };
    let name = |d: &str| format!("blobs/sha256/{}", d.strip_prefix("sha256:").unwrap());
    for l in &img.layers {
        add(name(&l.digest), &l.blob);
    }
    add(name(&img.config_digest), &img.config);
    let layers: Vec<String> = img.layers.iter().map(|l| name(&l.digest)).collect();
    let manifest = serde_json::json!([{"Config": name(&img.config_digest), "RepoTags": ["x:1"], "Layers": layers}]);
    add("manifest.json".into(), &serde_json::to_vec(&manifest).unwrap());
    let work = tempfile::tempdir().unwrap();
    let path = work.path().join("save.tar.zst");
    std::fs::write(&path, compress(&b.into_inner().unwrap(), Comp::Zstd)).unwrap();
    let (_d, store) = new_store();

    let got = import_docker_archive(&store, &path, &local_opts()).await.unwrap();

    assert_eq!(merged(&store, &got.layers).keys().map(String::as_str).collect::<Vec<_>>(), vec!["d", "d/z"]);
    assert_tmp_empty(&store);
}

#[tokio::test]
async fn rootfs_directory_and_tarball() {
    let work = tempfile::tempdir().unwrap();
    let root = work.path().join("rootfs");
    std::fs::create_dir_all(root.join("usr/bin")).unwrap();
    std::fs::create_dir_all(root.join("empty")).unwrap();
    std::fs::write(root.join("usr/bin/tool"), b"#!/bin/sh\necho hi\n").unwrap();
    std::fs::set_permissions(root.join("usr/bin/tool"), std::fs::Permissions::from_mode(0o4755)).unwrap();
    std::fs::write(root.join("owned"), b"o").unwrap();
    std::os::unix::fs::chown(root.join("owned"), Some(1234), Some(5678)).unwrap();
    std::fs::hard_link(root.join("owned"), root.join("owned-link")).unwrap();
    std::os::unix::fs::symlink("usr/bin/tool", root.join("tool")).unwrap();
    let fifo = Command::new("mkfifo").arg(root.join("fifo")).status().unwrap();
    assert!(fifo.success());
    let (_d, store) = new_store();

    let got = import_rootfs(&store, &root, &local_opts()).await.unwrap();

    assert_eq!(got.layers.len(), 1);
    let layer = store.layer_rootfs(&got.layers[0]);
    let t = snapshot(&layer);
    let src = snapshot(&root);
    for path in ["usr", "usr/bin", "usr/bin/tool", "empty", "owned", "owned-link", "tool"] {
        assert_eq!(t.get(path), src.get(path), "{path}");
    }
    let tool = t.get("usr/bin/tool").unwrap();
    assert_eq!((tool.kind, tool.mode, tool.uid, tool.gid), ('f', 0o4755, 0, 0));
    assert_eq!(tool.content, b"#!/bin/sh\necho hi\n");
    let m = std::fs::metadata(layer.join("owned")).unwrap();
    assert_eq!((m.uid(), m.gid()), (1234, 5678));
    assert_eq!(m.ino(), std::fs::metadata(layer.join("owned-link")).unwrap().ino());
    // The same directory gives the same layer.
    let again = import_rootfs(&store, &root, &local_opts()).await.unwrap();
    assert_eq!(again.layers, got.layers);

    // A tarball (gzip), whose layer id is the sha256 of the uncompressed tar.
    let tar = TarBuilder::new().dir("etc").file("etc/hostname", b"box\n").finish();
    let tgz = work.path().join("rootfs.tar.gz");
    std::fs::write(&tgz, compress(&tar, Comp::Gzip)).unwrap();
    let got = import_rootfs(&store, &tgz, &local_opts()).await.unwrap();
    assert_eq!(got.layers, vec![LayerId::parse(&sha256(&tar)).unwrap()]);
    assert_eq!(got.source, format!("rootfs:{}", tgz.display()));

    // A file over the limit: the layer's error, not the archiver's broken pipe.
    let big = work.path().join("big");
    std::fs::create_dir_all(&big).unwrap();
    std::fs::write(big.join("a"), b"small").unwrap();
    std::fs::write(big.join("b"), vec![7u8; 4 << 20]).unwrap();
    std::fs::write(big.join("c"), vec![8u8; 4 << 20]).unwrap();
    let (_d3, store3) = new_store();
    let opts = ImportOptions { limits: Limits { max_file_bytes: 1 << 20, ..Limits::default() }, ..local_opts() };
    let err = import_rootfs(&store3, &big, &opts).await.unwrap_err();
    assert!(matches!(&err, ImportError::Layer { source: LayerError::TooLarge { .. }, .. }), "{err:?}");
    assert_store_clean(&store3);

    // Too deep: refused with a clear error, whichever side sees it first.
    let deep = work.path().join("deep");
    std::fs::create_dir_all(deep.join("a/b/c/d/e/f/g")).unwrap();
    let opts = ImportOptions { limits: Limits { max_depth: 4, ..Limits::default() }, ..local_opts() };
    let err = import_rootfs(&store3, &deep, &opts).await.unwrap_err();
    assert!(matches!(err, ImportError::InvalidArchive { .. } | ImportError::Layer { .. }), "{err:?}");
    assert!(!err.to_string().to_lowercase().contains("pipe"), "{err}");
    assert_store_clean(&store3);

    // A truncated tarball fails and leaves nothing.
    let (_d2, store2) = new_store();
    let cut = work.path().join("cut.tar.gz");
    let full = compress(&tar, Comp::Gzip);
    std::fs::write(&cut, &full[..full.len() / 2]).unwrap();
    assert!(matches!(import_rootfs(&store2, &cut, &local_opts()).await, Err(ImportError::Layer { .. })));
    assert_store_clean(&store2);
}

/// A whole image is capped: blobs listed over the cap are refused before any is read, and
/// layers whose unpacked content passes it stop the import (each layer within its own limit).
#[tokio::test]
async fn a_whole_image_is_capped() {
    let big = vec![7u8; 64 << 10];
    let l1 = TarBuilder::new().file("a", &big).finish();
    let l2 = TarBuilder::new().file("b", &big).finish();
    let img = image(vec![layer(l1, Comp::Plain), layer(l2, Comp::Plain)], "amd64", &[], &[]);
    let dir = tempfile::tempdir().unwrap();
    Layout::new(dir.path()).add_image(&img, "big");
    let capped = |max_image_bytes: u64| ImportOptions {
        limits: Limits { max_image_bytes, ..Limits::default() },
        ..local_opts()
    };
    // The two blobs are listed at ~128 KiB together: a 100 KiB cap refuses at once.
    let (_d, store) = new_store();
    match import_oci_layout(&store, dir.path(), Some("big"), &capped(100 << 10)).await {
        Err(ImportError::Registry(RegistryError::TooLarge { what, .. })) => {
            assert!(what.starts_with("image "), "{what}")
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
    assert!(std::fs::read_dir(store.root().join("layers")).unwrap().flatten().all(|e| e.file_name() == ".tmp"));
    assert_tmp_empty(&store);
    // With room for the blobs, the content of both layers still fits: imported.
    let got = import_oci_layout(&store, dir.path(), Some("big"), &capped(1 << 20)).await.unwrap();
    assert_eq!(got.layers.len(), 2);
    // Compressed blobs list small; what they unpack to counts too.
    let zeros = vec![0u8; 64 << 10];
    let z1 = TarBuilder::new().file("z1", &zeros).finish();
    let z2 = TarBuilder::new().file("z2", &zeros).finish();
    let bomb = image(vec![layer(z1, Comp::Gzip), layer(z2, Comp::Gzip)], "amd64", &[], &[]);
    let dir = tempfile::tempdir().unwrap();
    Layout::new(dir.path()).add_image(&bomb, "bomb");
    let (_d, store) = new_store();
    match import_oci_layout(&store, dir.path(), Some("bomb"), &capped(100 << 10)).await {
        Err(ImportError::Registry(RegistryError::TooLarge { what, .. })) => {
            assert!(what.contains("content of its layers"), "{what}")
        }
        other => panic!("expected TooLarge, got {other:?}"),
    }
}

/// An image config naming a layer stored for another project grants nothing without the
/// layer's content: a stand-in blob is read, fails its diff id and records no project; the
/// real content is unpacked again, checked, and then recorded (the stored copy kept); an
/// import for the layer's own project reuses it without reading its blob.
#[tokio::test]
async fn a_stored_layer_of_another_project_is_reused_only_with_its_content() {
    let (_d, store) = new_store();
    let secret = layer(TarBuilder::new().file("secret", b"of root/a").finish(), Comp::Gzip);
    let for_project = |p: &str| ImportOptions { for_project: Some(p.into()), ..local_opts() };
    let dir = tempfile::tempdir().unwrap();
    Layout::new(dir.path()).add_image(&image(vec![secret.clone()], "amd64", &[], &[]), "a");
    let got = import_oci_layout(&store, dir.path(), None, &for_project("root/a")).await.unwrap();
    let id = got.layers[0].clone();
    store.add_layer_user(&id, "root/a").unwrap();

    // The attacker's image: the secret layer's diff id in its config, any blob as the layer.
    let dummy = layer(TarBuilder::new().file("nothing", b"").finish(), Comp::Gzip);
    let forged = Layer { diff_id: secret.diff_id.clone(), ..dummy };
    let dir = tempfile::tempdir().unwrap();
    Layout::new(dir.path()).add_image(&image(vec![forged], "amd64", &[], &[]), "b");
    let err = import_oci_layout(&store, dir.path(), None, &for_project("root/b")).await.unwrap_err();
    assert!(matches!(err, ImportError::Layer { source: LayerError::DigestMismatch { .. }, .. }), "{err:?}");
    assert_eq!(store.layer_users(&id).unwrap(), vec!["root/a".to_string()]);

    // The same image with the real content: unpacked (not reused), the stored layer kept.
    let dir = tempfile::tempdir().unwrap();
    Layout::new(dir.path()).add_image(&image(vec![secret.clone()], "amd64", &[], &[]), "b");
    let got = import_oci_layout(&store, dir.path(), None, &for_project("root/b")).await.unwrap();
    assert_eq!((got.layers[0].clone(), got.fetched_layers, got.reused_layers), (id.clone(), 1, 0));
    // For its own project, and with no project to record: reused without its blob.
    for opts in [for_project("root/a"), local_opts()] {
        let got = import_oci_layout(&store, dir.path(), None, &opts).await.unwrap();
        assert_eq!((got.fetched_layers, got.reused_layers), (0, 1));
    }
    assert_tmp_empty(&store);
    assert_eq!(stored_layers(&store).len(), 1);
}
