//! Layer import: what unpacked and stacked layers show, compared file by file with a real
//! overlayfs mount of the same layers, and every hostile input refused with a clear error and
//! nothing left in the store. Runs as root (whiteouts are devices; overlay mounts), as CI does.

use std::io::Read;
use std::os::unix::fs::MetadataExt;

use crate::support::*;
use opendsec_images::layer::{Compression, LayerError, Limits, existing_layer, import_layer, opaque_layer_id};
use opendsec_images::overlay::LayerStack;
use opendsec_images::{LayerId, Store};
use tar::EntryType;

const T1: u64 = 1_600_000_000;
const T2: u64 = 1_600_100_000;
const T3: u64 = 1_600_200_000;
const T4: u64 = 1_600_300_000;

fn l1() -> Vec<E> {
    use E::*;
    vec![
        Dir("etc", 0o755, 0, 0),
        File("etc/passwd", b"root:x:0:0", 0o644, 0, 0),
        File("etc/shadow", b"secret", 0o640, 0, 42),
        File("etc/hosts", b"127.0.0.1 localhost", 0o644, 0, 0),
        Dir("usr", 0o755, 0, 0),
        Dir("usr/bin", 0o755, 0, 0),
        File("usr/bin/tool", b"#!/bin/sh\necho tool", 0o4755, 0, 0),
        Link("usr/bin/tool2", "usr/bin/tool"),
        Dir("tmp", 0o1777, 0, 0),
        Dir("opt", 0o755, 0, 0),
        Dir("opt/app", 0o755, 0, 0),
        File("opt/app/a", b"a1", 0o644, 0, 0),
        File("opt/app/b", b"b1", 0o644, 0, 0),
        Dir("opt/app/sub", 0o755, 0, 0),
        File("opt/app/sub/deep", b"d", 0o644, 0, 0),
        Dir("var", 0o755, 0, 0),
        Dir("var/lib", 0o755, 0, 0),
        File("var/lib/x", b"x", 0o644, 0, 0),
        Fifo("var/fifo"),
        Symlink("bin", "usr/bin"),
        // Stored as data; it points nowhere harmful inside a container.
        Symlink("escape", "../../../../etc"),
        Dir("home", 0o755, 0, 0),
        Dir("home/user", 0o700, 1000, 1000),
        File("home/user/.profile", b"p", 0o600, 1000, 1000),
    ]
}

fn l2() -> Vec<E> {
    use E::*;
    vec![
        Dir("etc", 0o755, 0, 0),
        Whiteout("etc/shadow"),
        File("etc/passwd", b"root:x:0:0\nuser:x:1000:1000", 0o644, 0, 0),
        Dir("opt", 0o755, 0, 0),
        Dir("opt/app", 0o755, 0, 0),
        Opaque("opt/app"),
        File("opt/app/c", b"c2", 0o644, 0, 0),
        Dir("opt/app/sub", 0o755, 0, 0),
        File("opt/app/sub/new", b"n", 0o644, 0, 0),
        Whiteout("var"),
        Dir("home", 0o755, 0, 0),
        Dir("home/user", 0o700, 1000, 1000),
        File("home/user/notes", b"n", 0o644, 1000, 1000),
    ]
}

fn l3() -> Vec<E> {
    use E::*;
    vec![
        Dir("var", 0o755, 0, 0),
        Dir("var/new", 0o755, 0, 0),
        File("var/new/f", b"f3", 0o644, 0, 0),
        Dir("opt", 0o755, 0, 0),
        Whiteout("opt/app"),
        Dir("etc", 0o755, 0, 0),
        Whiteout("etc/nothere"),
        Dir("usr", 0o755, 0, 0),
        Dir("usr/bin", 0o755, 0, 0),
        Whiteout("usr/bin/tool"),
        Dir("srv", 0o755, 0, 0),
        File("srv/x", b"x", 0o644, 0, 0),
        // A later entry for the same path replaces the earlier one.
        Dir("srv/x", 0o711, 0, 0),
        File("srv/x/y", b"y", 0o644, 0, 0),
    ]
}

fn l4() -> Vec<E> {
    use E::*;
    vec![
        Dir("opt", 0o755, 0, 0),
        Dir("opt/app", 0o750, 0, 0),
        File("opt/app/again", b"again", 0o644, 0, 0),
        Dir("home", 0o755, 0, 0),
        // Whited out and present in the same layer: the directory hides the lower content.
        Whiteout("home/user"),
        Dir("home/user", 0o700, 1000, 1000),
        File("home/user/fresh", b"fresh", 0o644, 1000, 1000),
        Dir("etc", 0o755, 0, 0),
        Opaque("etc"),
        File("etc/passwd", b"only", 0o644, 0, 0),
        Symlink("bin", "usr/local/bin"),
        Dir("tmp", 0o1777, 0, 0),
        XattrFile("tmp/x", b"x", &[("user.test", b"v"), ("trusted.overlay.opaque", b"y")]),
    ]
}

fn layers() -> Vec<(Vec<E>, u64)> {
    vec![(l1(), T1), (l2(), T2), (l3(), T3), (l4(), T4)]
}

fn tars() -> Vec<Vec<u8>> {
    layers().iter().map(|(e, t)| tar_of(e, *t)).collect()
}

fn store() -> (tempfile::TempDir, Store) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("store")).unwrap();
    (dir, store)
}

#[test]
fn stacked_layers_show_what_overlayfs_shows() {
    let (_d, store) = store();
    let tars = tars();
    let ids = import_stack(&store, &tars);
    let all = layers();
    for k in 1..=ids.len() {
        let want = model(&all[..k]);
        let mount = Overlay::of(&store, &ids[..k]);
        let got = snapshot(mount.path());
        assert_same(&format!("overlay of the first {k} layers vs the OCI model"), &got, &want);
        // Our own merged-view computation agrees with the kernel's.
        let stack = LayerStack::from_store(&store, &ids[..k]).unwrap();
        let ours: Vec<String> = stack.tree().unwrap().into_keys().map(|p| String::from_utf8(p).unwrap()).collect();
        assert_eq!(ours, got.keys().cloned().collect::<Vec<_>>(), "LayerStack::tree of {k} layers");
    }
    // Spot checks of the format itself.
    let top = store.layer_rootfs(&ids[3]);
    let st = std::fs::symlink_metadata(top.join("etc/hosts")).unwrap();
    assert_eq!((st.mode() & 0o170000, st.rdev()), (0o020000, 0), "opaque etc: hosts is a 0:0 whiteout");
    let x = rustix::fs::getxattr(top.join("tmp/x"), "user.test", &mut [0u8; 16][..]).unwrap();
    assert_eq!(x, 1);
    assert!(rustix::fs::getxattr(top.join("tmp/x"), "trusted.overlay.opaque", &mut [0u8; 16][..]).is_err());
    let l1 = store.layer_rootfs(&ids[0]);
    let (a, b) =
        (std::fs::metadata(l1.join("usr/bin/tool")).unwrap(), std::fs::metadata(l1.join("usr/bin/tool2")).unwrap());
    assert_eq!((a.ino(), a.nlink()), (b.ino(), 2), "hard link restored as a link");
}

#[test]
fn ids_and_metas() {
    let (_d, store) = store();
    let tars = tars();
    let ids = import_stack(&store, &tars);
    // No opaque directory: id = diff id.
    let m1 = store.layer_meta(&ids[0]).unwrap();
    assert_eq!(m1.diff_id, sha256(&tars[0]));
    assert_eq!(m1.id.diff_id(), m1.diff_id);
    assert!(m1.lowers.is_empty());
    assert_eq!(m1.entries, l1().len() as u64);
    // Opaque: the id depends on what is below.
    let m2 = store.layer_meta(&ids[1]).unwrap();
    let d2 = LayerId::parse(&sha256(&tars[1])).unwrap();
    assert_eq!(m2.id, opaque_layer_id(&d2, &ids[..1]));
    assert_eq!(m2.lowers, ids[..1].to_vec());
    // L3 has no opaque directory (whiteouts only).
    assert_eq!(ids[2].diff_id(), sha256(&tars[2]));
    // L4: a directory both whited out and present counts as opaque.
    assert_eq!(ids[3], opaque_layer_id(&LayerId::parse(&sha256(&tars[3])).unwrap(), &ids[..3]));
    assert_eq!(existing_layer(&store, &sha256(&tars[1]), &ids[..1]), Some(ids[1].clone()));
    assert_eq!(existing_layer(&store, &sha256(&tars[1]), &[]), None);

    // The same opaque tar on other lowers is another layer.
    let other = import(&store, &tars[1], &[]).unwrap();
    assert_ne!(other.id, ids[1]);
    assert!(other.lowers.is_empty());

    // A stored layer's digest alone gets nothing: the blob is read and must match (callers
    // that may skip a stored layer check existing_layer themselves, before fetching).
    let wrong = compress(&tars[2], Comp::Gzip);
    let e =
        import_layer(&store, &mut &wrong[..], Compression::Gzip, Some(&sha256(&tars[0])), &[], &Limits::default(), "x")
            .unwrap_err();
    assert!(matches!(e, LayerError::DigestMismatch { .. }), "{e:?}");
    let right = compress(&tars[0], Comp::Gzip);
    let again =
        import_layer(&store, &mut &right[..], Compression::Gzip, Some(&sha256(&tars[0])), &[], &Limits::default(), "x")
            .unwrap();
    assert_eq!(again, m1);
    // Same content without a digest given up front: the stored copy stays.
    assert_eq!(import(&store, &tars[0], &[]).unwrap(), m1);
    assert_eq!(std::fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
}

#[test]
fn gzip_zstd_and_plain_give_the_same_layer() {
    let t = tar_of(&l1(), T1);
    let mut metas = Vec::new();
    for (blob, c) in [
        (t.clone(), Compression::None),
        (compress(&t, Comp::Gzip), Compression::Gzip),
        (compress(&t, Comp::Zstd), Compression::Zstd),
    ] {
        let (_d, store) = store();
        let mut r = &blob[..];
        let meta = import_layer(&store, &mut r, c, Some(&sha256(&t)), &[], &Limits::default(), "t").unwrap();
        let tree = snapshot(&store.layer_rootfs(&meta.id));
        metas.push((meta.id, meta.size_bytes, meta.entries, tree));
    }
    // Mislabelled blobs (a plain tar declared gzip, gzip declared plain) import the same.
    for (blob, c) in [
        (t.clone(), Compression::Gzip),
        (compress(&t, Comp::Gzip), Compression::None),
        (compress(&t, Comp::Zstd), Compression::Gzip),
    ] {
        let (_d, store) = store();
        let mut r = &blob[..];
        let meta = import_layer(&store, &mut r, c, Some(&sha256(&t)), &[], &Limits::default(), "t").unwrap();
        assert_eq!(meta.id, metas[0].0);
    }
    assert!(metas.windows(2).all(|w| w[0] == w[1]));
}

#[test]
fn root_entry_implicit_parents_and_replacements() {
    let (_d, store) = store();
    let mut b = tar::Builder::new(Vec::new());
    raw_entry(&mut b, b"./", EntryType::Directory, b"", None, 0o700, 5);
    // No entry for a/ or a/b/: created 0755 root.
    raw_entry(&mut b, b"a/b/c", EntryType::Regular, b"c", None, 0o644, 5);
    // A file, then a symlink, then a directory at one path; a directory, then a file.
    raw_entry(&mut b, b"p", EntryType::Regular, b"1", None, 0o644, 5);
    raw_entry(&mut b, b"p", EntryType::Symlink, b"", Some(b"/nowhere"), 0o777, 5);
    raw_entry(&mut b, b"p/", EntryType::Directory, b"", None, 0o755, 5);
    raw_entry(&mut b, b"d/", EntryType::Directory, b"", None, 0o755, 5);
    raw_entry(&mut b, b"d/inner", EntryType::Regular, b"i", None, 0o644, 5);
    raw_entry(&mut b, b"d", EntryType::Regular, b"now a file", None, 0o600, 5);
    // Hard link to itself, and a hard link replacing a file.
    raw_entry(&mut b, b"a/b/c", EntryType::Link, b"", Some(b"a/b/c"), 0o644, 5);
    raw_entry(&mut b, b"q", EntryType::Regular, b"old", None, 0o644, 5);
    raw_entry(&mut b, b"q", EntryType::Link, b"", Some(b"./a/b/c"), 0o644, 5);
    // AUFS bookkeeping is skipped; a PAX global header is not an entry.
    raw_entry(&mut b, b".wh..wh.plnk/1.2", EntryType::Regular, b"", None, 0o644, 5);
    raw_entry(&mut b, b"pax_global_header", EntryType::XGlobalHeader, b"11 comment=x\n", None, 0o644, 5);
    let t = b.into_inner().unwrap();
    let meta = import(&store, &t, &[]).unwrap();
    let root = store.layer_rootfs(&meta.id);
    assert_eq!(std::fs::metadata(&root).unwrap().mode() & 0o7777, 0o700);
    let s = snapshot(&root);
    assert_eq!((s["a"].kind, s["a"].mode, s["a/b"].mode), ('d', 0o755, 0o755));
    assert_eq!(s["p"].kind, 'd');
    assert_eq!((s["d"].kind, s["d"].content.as_slice(), s["d"].mode), ('f', &b"now a file"[..], 0o600));
    assert!(!s.contains_key("d/inner"));
    assert_eq!(s["q"].content, b"c");
    assert_eq!(std::fs::metadata(root.join("q")).unwrap().ino(), std::fs::metadata(root.join("a/b/c")).unwrap().ino());
    assert!(!root.join(".wh..wh.plnk").exists());
    assert_eq!(meta.entries, 12);
    assert_eq!(meta.size_bytes, 1 + 1 + 1 + 10 + 3);
}

// ---------------------------------------------------------------------------------------
// Hostile input: each fails with a clear error and leaves nothing in the store.

fn one(path: &[u8], kind: EntryType, data: &[u8], link: Option<&[u8]>) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    raw_entry(&mut b, path, kind, data, link, 0o644, 1);
    b.into_inner().unwrap()
}

fn refused(store: &Store, t: &[u8], limits: &Limits) -> LayerError {
    let e = import_with(store, t, Compression::None, &[], limits).expect_err("hostile layer imported");
    println!("refused: {e}");
    assert_store_clean(store);
    e
}

fn assert_invalid(e: LayerError, needle: &str) {
    match &e {
        LayerError::InvalidLayer { why, .. } if why.contains(needle) => {}
        other => panic!("want InvalidLayer mentioning {needle:?}, got {other:?}"),
    }
    assert!(e.to_string().starts_with("invalid layer: entry"), "{e}");
}

#[test]
fn paths_that_escape_are_refused() {
    let (d, store) = store();
    for (path, needle) in [
        (&b"../escaped"[..], "'..'"),
        (b"a/../../escaped", "'..'"),
        (b"/escaped", "absolute"),
        (b"/etc/escaped", "absolute"),
        (b"./..", "'..'"),
    ] {
        let e = refused(&store, &one(path, EntryType::Regular, b"x", None), &Limits::default());
        assert_invalid(e, needle);
    }
    assert!(!d.path().join("escaped").exists());
    // A NUL byte smuggled in through a PAX path.
    let mut b = tar::Builder::new(Vec::new());
    raw_entry(
        &mut b,
        &[b'a'; 120].iter().copied().chain(*b"\0/x").collect::<Vec<_>>(),
        EntryType::Regular,
        b"x",
        None,
        0o644,
        1,
    );
    assert_invalid(refused(&store, &b.into_inner().unwrap(), &Limits::default()), "NUL");
}

#[test]
fn writing_through_a_symlink_is_refused() {
    let (d, store) = store();
    let outside = d.path().join("outside");
    std::fs::create_dir(&outside).unwrap();
    let targets: [&[u8]; 4] = [outside.as_os_str().as_encoded_bytes(), b"../../../../../../../../..", b"/", b"inside"];
    for target in targets {
        let mut b = tar::Builder::new(Vec::new());
        raw_entry(&mut b, b"inside/", EntryType::Directory, b"", None, 0o755, 1);
        raw_entry(&mut b, b"link", EntryType::Symlink, b"", Some(target), 0o777, 1);
        raw_entry(&mut b, b"link/evil", EntryType::Regular, b"evil", None, 0o644, 1);
        let e = refused(&store, &b.into_inner().unwrap(), &Limits::default());
        assert_invalid(e, "symlink");
        // A directory created through the link, too.
        let mut b = tar::Builder::new(Vec::new());
        raw_entry(&mut b, b"link", EntryType::Symlink, b"", Some(target), 0o777, 1);
        raw_entry(&mut b, b"link/sub/evil", EntryType::Regular, b"evil", None, 0o644, 1);
        assert_invalid(refused(&store, &b.into_inner().unwrap(), &Limits::default()), "symlink");
    }
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0, "nothing written outside");
}

#[test]
fn hard_links_outside_absent_or_odd_are_refused() {
    let (d, store) = store();
    std::fs::write(d.path().join("secret"), b"s").unwrap();
    let cases: [(&[u8], &str); 5] = [
        (b"/etc/passwd", "absolute"),
        (b"../../secret", "'..'"),
        (b"nothere", "not in the layer"),
        (b"dir/nothere", "not in the layer"),
        (b"dir", "directory"),
    ];
    for (target, needle) in cases {
        let mut b = tar::Builder::new(Vec::new());
        raw_entry(&mut b, b"dir/", EntryType::Directory, b"", None, 0o755, 1);
        raw_entry(&mut b, b"l", EntryType::Link, b"", Some(target), 0o644, 1);
        assert_invalid(refused(&store, &b.into_inner().unwrap(), &Limits::default()), needle);
    }
    // Through a symlink that points outside.
    let mut b = tar::Builder::new(Vec::new());
    raw_entry(&mut b, b"s", EntryType::Symlink, b"", Some(d.path().as_os_str().as_encoded_bytes()), 0o777, 1);
    raw_entry(&mut b, b"l", EntryType::Link, b"", Some(b"s/secret"), 0o644, 1);
    assert_invalid(refused(&store, &b.into_inner().unwrap(), &Limits::default()), "symlink");
    // To a whiteout.
    let mut b = tar::Builder::new(Vec::new());
    raw_entry(&mut b, b".wh.gone", EntryType::Regular, b"", None, 0o644, 1);
    raw_entry(&mut b, b"l", EntryType::Link, b"", Some(b"gone"), 0o644, 1);
    assert_invalid(refused(&store, &b.into_inner().unwrap(), &Limits::default()), "whiteout");
    assert_eq!(std::fs::read(d.path().join("secret")).unwrap(), b"s");
    assert_eq!(std::fs::metadata(d.path().join("secret")).unwrap().nlink(), 1);
}

#[test]
fn devices_are_refused_fifos_are_not() {
    let (_d, store) = store();
    for kind in [EntryType::Char, EntryType::Block] {
        let mut b = tar::Builder::new(Vec::new());
        let mut h = tar::Header::new_gnu();
        h.set_entry_type(kind);
        h.set_size(0);
        h.set_mode(0o666);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1);
        h.set_device_major(1).unwrap();
        h.set_device_minor(3).unwrap();
        b.append_data(&mut h, "dev/null", &[][..]).unwrap();
        assert_invalid(refused(&store, &b.into_inner().unwrap(), &Limits::default()), "device");
    }
    // Even a 0:0 device: whiteouts come only from .wh. names.
    assert_invalid(refused(&store, &one(b"fake", EntryType::Char, b"", None), &Limits::default()), "device");
    let meta = import(&store, &one(b"pipe", EntryType::Fifo, b"", None), &[]).unwrap();
    assert_eq!(snapshot(&store.layer_rootfs(&meta.id))["pipe"].kind, 'p');
}

#[test]
fn odd_whiteouts_and_parents_are_refused() {
    let (_d, store) = store();
    for p in [&b".wh."[..], b"a/.wh..", b".wh..."] {
        assert_invalid(refused(&store, &one(p, EntryType::Regular, b"", None), &Limits::default()), "whiteout");
    }
    let mut b = tar::Builder::new(Vec::new());
    raw_entry(&mut b, b"f", EntryType::Regular, b"x", None, 0o644, 1);
    raw_entry(&mut b, b"f/x", EntryType::Regular, b"x", None, 0o644, 1);
    assert_invalid(refused(&store, &b.into_inner().unwrap(), &Limits::default()), "not a directory");
    assert_invalid(refused(&store, &one(b"./", EntryType::Regular, b"", None), &Limits::default()), "root");
    assert_invalid(refused(&store, &one(b"s", EntryType::Symlink, b"", None), &Limits::default()), "target");
    assert_invalid(refused(&store, &one(b"v", EntryType::new(b'V'), b"", None), &Limits::default()), "unsupported");
}

#[test]
fn limits_are_enforced() {
    let (_d, store) = store();
    let small = Limits {
        max_file_bytes: 10,
        max_layer_bytes: 1 << 20,
        max_entries: 3,
        max_depth: 4,
        max_path_bytes: 30,
        ..Limits::default()
    };
    let too_large = |e: LayerError, what: &str| match e {
        LayerError::TooLarge { what: w, .. } if w.contains(what) => {}
        other => panic!("want TooLarge {what}, got {other:?}"),
    };
    too_large(refused(&store, &one(b"big", EntryType::Regular, &[7; 11], None), &small), "one file");
    let mut b = tar::Builder::new(Vec::new());
    for n in 0..4 {
        raw_entry(&mut b, format!("f{n}").as_bytes(), EntryType::Regular, b"", None, 0o644, 1);
    }
    too_large(refused(&store, &b.into_inner().unwrap(), &small), "entries");
    too_large(refused(&store, &one(b"a/b/c/d/e", EntryType::Regular, b"", None), &small), "components");
    too_large(refused(&store, &one(&[b'x'; 31], EntryType::Regular, b"", None), &small), "path");
    // Total content over the layer limit (each file within its own).
    let layer = Limits { max_file_bytes: 1 << 20, max_layer_bytes: 3 << 20, ..Limits::default() };
    let mut b = tar::Builder::new(Vec::new());
    for n in 0..4 {
        raw_entry(&mut b, format!("f{n}").as_bytes(), EntryType::Regular, &vec![1; 1 << 20], None, 0o644, 1);
    }
    too_large(refused(&store, &b.into_inner().unwrap(), &layer), "");
    // Absurdly deep directories, with the default limits.
    let deep: Vec<u8> = (0..200).flat_map(|_| *b"d/").chain(*b"f").collect();
    too_large(refused(&store, &one(&deep, EntryType::Regular, b"", None), &Limits::default()), "components");
    // Data hidden in a directory entry counts against the stream.
    let stream = Limits { max_layer_bytes: 1 << 20, ..Limits::default() };
    too_large(refused(&store, &one(b"d/", EntryType::Directory, &vec![0; 2 << 20], None), &stream), "stream");
}

#[test]
fn huge_tar_metadata_is_refused() {
    let (_d, store) = store();
    let mut b = tar::Builder::new(Vec::new());
    let big = vec![b'a'; 17 << 20];
    b.append_pax_extensions([("comment", &big[..])]).unwrap();
    raw_entry(&mut b, b"f", EntryType::Regular, b"x", None, 0o644, 1);
    assert_invalid(refused(&store, &b.into_inner().unwrap(), &Limits::default()), "headers");
}

#[test]
fn truncated_and_corrupt_streams_are_refused() {
    let (_d, store) = store();
    let t = tar_of(&l1(), T1);
    for (blob, c) in [(compress(&t, Comp::Gzip), Compression::Gzip), (compress(&t, Comp::Zstd), Compression::Zstd)] {
        for cut in [10, blob.len() / 2, blob.len() - 1] {
            let e = import_with(&store, &blob[..blob.len() - cut], c, &[], &Limits::default()).expect_err("truncated");
            assert_store_clean(&store);
            assert_invalid(e, "malformed");
        }
    }
    let mut bad = compress(&t, Comp::Gzip);
    let mid = bad.len() / 2;
    bad[mid..mid + 8].iter_mut().for_each(|b| *b ^= 0xff);
    let e = import_with(&store, &bad, Compression::Gzip, &[], &Limits::default()).expect_err("corrupt gzip");
    assert_store_clean(&store);
    assert!(matches!(e, LayerError::InvalidLayer { .. }), "{e:?}");
    // zstd without a content checksum may decode a flipped byte "fine": the digest catches it.
    let mut bad = compress(&t, Comp::Zstd);
    let mid = bad.len() / 2;
    bad[mid] ^= 0x01;
    let mut r = &bad[..];
    let e = import_layer(&store, &mut r, Compression::Zstd, Some(&sha256(&t)), &[], &Limits::default(), "t")
        .expect_err("corrupt zstd");
    assert_store_clean(&store);
    assert!(matches!(e, LayerError::InvalidLayer { .. } | LayerError::DigestMismatch { .. }), "{e:?}");
    // An uncompressed tar cut inside a file.
    let e = import_with(&store, &t[..t.len() / 2 + 100], Compression::None, &[], &Limits::default())
        .expect_err("truncated tar");
    assert_store_clean(&store);
    assert!(matches!(e, LayerError::InvalidLayer { .. }), "{e:?}");
    // Nothing at all, compressed or not.
    for (blob, c) in [
        (vec![], Compression::None),
        (compress(b"", Comp::Gzip), Compression::Gzip),
        (compress(b"", Comp::Zstd), Compression::Zstd),
    ] {
        let e = import_with(&store, &blob, c, &[], &Limits::default()).expect_err("empty");
        assert_store_clean(&store);
        assert_invalid(e, "empty");
    }
    // Not a tar at all.
    let e = import_with(&store, &[0x42; 2048], Compression::None, &[], &Limits::default()).expect_err("garbage");
    assert_store_clean(&store);
    assert_invalid(e, "malformed");
}

#[test]
fn a_digest_mismatch_commits_nothing() {
    let (_d, store) = store();
    let t = tar_of(&l1(), T1);
    let wrong = sha256(b"something else");
    let mut r = &compress(&t, Comp::Gzip)[..];
    let e = import_layer(&store, &mut r, Compression::Gzip, Some(&wrong), &[], &Limits::default(), "t").unwrap_err();
    assert_store_clean(&store);
    match e {
        LayerError::DigestMismatch { expected, actual } => assert_eq!((expected, actual), (wrong, sha256(&t))),
        other => panic!("{other:?}"),
    }
}

#[test]
fn source_errors_and_missing_lowers_are_told_apart() {
    let (_d, store) = store();
    struct Broken(usize);
    impl Read for Broken {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.0 == 0 {
                return Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "connection reset"));
            }
            self.0 -= 1;
            let n = buf.len().min(512);
            buf[..n].fill(0);
            Ok(n)
        }
    }
    let e = import_layer(&store, &mut Broken(3), Compression::None, None, &[], &Limits::default(), "t").unwrap_err();
    assert_store_clean(&store);
    assert!(matches!(&e, LayerError::Read { source } if source.kind() == std::io::ErrorKind::ConnectionReset), "{e:?}");
    let e = import(&store, &tar_of(&l1(), T1), &[LayerId::from_digest(&[9; 32])]).unwrap_err();
    assert_store_clean(&store);
    assert!(matches!(e, LayerError::Store(opendsec_images::StoreError::LayerNotFound(_))), "{e:?}");
}

#[test]
fn oversized_extended_attributes_are_refused() {
    let (_d, store) = store();
    // A directory keeps its xattrs until the layer's end: an oversized one must fail at once.
    let mut b = tar::Builder::new(Vec::new());
    let big = vec![b'a'; 70 << 10];
    b.append_pax_extensions([("SCHILY.xattr.user.big", &big[..])]).unwrap();
    raw_entry(&mut b, b"d/", EntryType::Directory, b"", None, 0o755, 1);
    assert_invalid(refused(&store, &b.into_inner().unwrap(), &Limits::default()), "extended attributes");
    assert_store_clean(&store);
    // Each within its own limit, but together more than a layer's directories may hold in
    // memory until its end: refused, nothing left behind.
    let mut b = tar::Builder::new(Vec::new());
    let each = vec![b'a'; 60 << 10];
    let dirs = opendsec_images::unpack::DIR_XATTRS_MAX / each.len() + 2;
    for i in 0..dirs {
        b.append_pax_extensions([("SCHILY.xattr.user.x", &each[..])]).unwrap();
        raw_entry(&mut b, format!("d{i}/").as_bytes(), EntryType::Directory, b"", None, 0o755, 1);
    }
    match refused(&store, &b.into_inner().unwrap(), &Limits::default()) {
        LayerError::TooLarge { what, .. } if what.contains("directory extended attributes") => {}
        other => panic!("want TooLarge directory xattrs, got {other:?}"),
    }
    assert_store_clean(&store);
}
