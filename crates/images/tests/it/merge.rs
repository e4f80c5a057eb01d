//! Layer merge: a merged run stacks exactly like the original layers (compared file by file
//! through real overlayfs mounts), keeps only the whiteouts that still hide something, and
//! keeps hard links. Runs as root, as CI does.

use std::os::unix::fs::MetadataExt;

use crate::support::*;
use opendsec_images::layer::LayerError;
use opendsec_images::merge::{merge_layers, merged_layer_id};
use opendsec_images::{LayerId, Store, StoreError};

fn stack() -> Vec<(Vec<E>, u64)> {
    use E::*;
    let l0 = vec![
        Dir("etc", 0o755, 0, 0),
        File("etc/passwd", b"root", 0o644, 0, 0),
        File("etc/shadow", b"s", 0o600, 0, 0),
        File("etc/hosts", b"h", 0o644, 0, 0),
        Dir("usr", 0o755, 0, 0),
        Dir("usr/bin", 0o755, 0, 0),
        File("usr/bin/tool", b"tool", 0o4755, 0, 0),
        Link("usr/bin/tool2", "usr/bin/tool"),
        File("usr/bin/cat", b"cat", 0o755, 0, 0),
        Link("usr/bin/dog", "usr/bin/cat"),
        Dir("opt", 0o755, 0, 0),
        Dir("opt/app", 0o755, 0, 0),
        File("opt/app/a", b"a", 0o644, 0, 0),
        Dir("opt/app/sub", 0o755, 0, 0),
        File("opt/app/sub/deep", b"d", 0o644, 0, 0),
        Dir("var", 0o755, 0, 0),
        Dir("var/lib", 0o755, 0, 0),
        File("var/lib/x", b"x", 0o644, 0, 0),
        Fifo("var/fifo"),
        Symlink("bin", "usr/bin"),
        Dir("tmp", 0o1777, 0, 0),
    ];
    let l1 = vec![
        Dir("etc", 0o755, 0, 0),
        Whiteout("etc/shadow"),
        Dir("opt", 0o755, 0, 0),
        Dir("opt/app", 0o700, 0, 0),
        Opaque("opt/app"),
        File("opt/app/c", b"c", 0o644, 0, 0),
        Dir("opt/app/sub", 0o755, 0, 0),
        File("opt/app/sub/new", b"n", 0o644, 0, 0),
        Whiteout("var"),
        Dir("home", 0o755, 0, 0),
        Dir("home/u", 0o700, 1000, 1000),
        File("home/u/f", b"f", 0o644, 1000, 1000),
        Link("home/u/g", "home/u/f"),
    ];
    let l2 = vec![
        Dir("var", 0o750, 0, 0),
        File("var/new", b"new", 0o644, 0, 0),
        Dir("etc", 0o755, 0, 0),
        Whiteout("etc/nothere"),
        Dir("usr", 0o755, 0, 0),
        Dir("usr/bin", 0o755, 0, 0),
        Whiteout("usr/bin/tool"),
        Dir("home", 0o755, 0, 0),
        Dir("home/u", 0o700, 1000, 1000),
        Whiteout("home/u/g"),
        Dir("tmp", 0o1777, 0, 0),
        File("tmp/t", b"t", 0o644, 0, 0),
    ];
    let l3 = vec![
        Dir("etc", 0o755, 0, 0),
        Opaque("etc"),
        File("etc/passwd", b"only", 0o644, 0, 0),
        Dir("opt", 0o755, 0, 0),
        Whiteout("opt/app"),
        Dir("opt/other", 0o755, 0, 0),
        Symlink("bin", "usr/local/bin"),
    ];
    vec![(l0, 1_700_000_000), (l1, 1_700_100_000), (l2, 1_700_200_000), (l3, 1_700_300_000)]
}

fn setup() -> (tempfile::TempDir, Store, Vec<LayerId>) {
    stored_stack(&stack())
}

fn whiteouts_in(root: &std::path::Path) -> Vec<String> {
    snapshot(root).into_iter().filter(|(_, n)| n.kind == 'c').map(|(p, _)| p).collect()
}

#[test]
fn a_merged_run_stacks_like_the_run() {
    let (_d, store, ids) = setup();
    let original = snapshot(Overlay::of(&store, &ids).path());
    assert_same("original stack vs the OCI model", &original, &model(&stack()));
    // Every contiguous run, on what is below it, with what is above it stacked on top.
    for lo in 0..ids.len() {
        for hi in lo + 1..=ids.len() {
            let merged = merge_layers(&store, &ids[lo..hi], &ids[..lo]).unwrap();
            assert_eq!(merged.id, merged_layer_id(&ids[lo..hi], &ids[..lo]));
            assert_eq!(merged.lowers, ids[..lo].to_vec());
            let mut stacked = ids[..lo].to_vec();
            stacked.push(merged.id.clone());
            stacked.extend_from_slice(&ids[hi..]);
            let got = snapshot(Overlay::of(&store, &stacked).path());
            assert_same(&format!("layers {lo}..{hi} merged, stacked with the rest"), &got, &original);
            // And the run alone, on its lowers.
            let mut run_only = ids[..lo].to_vec();
            run_only.push(merged.id.clone());
            let want = snapshot(Overlay::of(&store, &ids[..hi]).path());
            assert_same(
                &format!("layers {lo}..{hi} merged on their lowers"),
                &snapshot(Overlay::of(&store, &run_only).path()),
                &want,
            );
        }
    }
    assert_eq!(std::fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
}

#[test]
fn whiteouts_are_kept_only_where_something_below_is_hidden() {
    let (_d, store, ids) = setup();
    // Nothing below: no whiteout at all.
    let all = merge_layers(&store, &ids, &[]).unwrap();
    assert_eq!(whiteouts_in(&store.layer_rootfs(&all.id)), Vec::<String>::new());
    // On l0: whiteouts for l0's names only, and a directory cut off from l0 (var, whited out
    // in l1 and made again in l2) hides l0's content.
    let top = merge_layers(&store, &ids[1..], &ids[..1]).unwrap();
    let w = whiteouts_in(&store.layer_rootfs(&top.id));
    for want in ["etc/shadow", "etc/hosts", "usr/bin/tool", "opt/app", "var/lib", "var/fifo"] {
        assert!(w.contains(&want.to_string()), "{want} whiteout kept: {w:?}");
    }
    for gone in ["etc/nothere", "home/u/g"] {
        assert!(!w.contains(&gone.to_string()), "{gone} whiteout dropped: {w:?}");
    }
    assert_eq!(w.len(), 6, "{w:?}");
}

#[test]
fn hard_links_survive_when_both_ends_do() {
    let (_d, store, ids) = setup();
    let m = merge_layers(&store, &ids[..3], &[]).unwrap();
    let root = store.layer_rootfs(&m.id);
    let (cat, dog) =
        (std::fs::metadata(root.join("usr/bin/cat")).unwrap(), std::fs::metadata(root.join("usr/bin/dog")).unwrap());
    assert_eq!((cat.ino(), cat.nlink()), (dog.ino(), 2));
    // One end whited out: the other keeps the content, alone.
    let tool2 = std::fs::metadata(root.join("usr/bin/tool2")).unwrap();
    assert_eq!((tool2.nlink(), tool2.mode() & 0o7777), (1, 0o4755));
    assert_eq!(std::fs::read(root.join("usr/bin/tool2")).unwrap(), b"tool");
    assert!(!root.join("usr/bin/tool").exists());
    let f = std::fs::metadata(root.join("home/u/f")).unwrap();
    assert_eq!((f.nlink(), f.uid()), (1, 1000));
}

#[test]
fn merges_are_done_once_and_bad_requests_leave_nothing() {
    let (_d, store, ids) = setup();
    let a = merge_layers(&store, &ids[1..3], &ids[..1]).unwrap();
    let b = merge_layers(&store, &ids[1..3], &ids[..1]).unwrap();
    assert_eq!(a, b);
    // Golden: the merged id's exact input.
    use sha2::Digest;
    let text = format!("merge\n{}\n{}\n--\n{}", ids[1], ids[2], ids[0]);
    let d: [u8; 32] = sha2::Sha256::digest(text.as_bytes()).into();
    assert_eq!(a.id, LayerId::from_digest(&d));

    let before = std::fs::read_dir(store.root().join("layers")).unwrap().count();
    assert!(matches!(merge_layers(&store, &[], &ids), Err(LayerError::EmptyMerge)));
    let missing = LayerId::from_digest(&[7; 32]);
    let e = merge_layers(&store, std::slice::from_ref(&missing), &ids).unwrap_err();
    assert!(matches!(e, LayerError::Store(StoreError::LayerNotFound(_))), "{e:?}");
    let e = merge_layers(&store, &ids[1..], &[missing]).unwrap_err();
    assert!(matches!(e, LayerError::Store(StoreError::LayerNotFound(_))), "{e:?}");
    assert_eq!(std::fs::read_dir(store.root().join("layers")).unwrap().count(), before);
    assert_eq!(std::fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
}
