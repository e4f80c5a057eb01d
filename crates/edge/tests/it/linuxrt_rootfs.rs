//! Root tests of the layer cache, upper disks and loop devices. Skipped when not root.
use std::path::Path;
use std::time::Duration;

use opendsec_edge::linuxrt::rootfs::{self, LayerCache};
use opendsec_images::Store;
use opendsec_testkit::is_root;

/// A busybox root file system (static busybox + applet symlinks) imported as one layer.
async fn busybox_layer(store: &Store, tmp: &Path) -> opendsec_images::LayerId {
    let root = tmp.join("bbroot");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    for d in ["proc", "sys", "dev", "tmp", "etc", "run"] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    for applet in ["sh", "ls", "cat", "echo", "mount", "sleep", "hostname", "ps", "dd", "mkdir"] {
        std::os::unix::fs::symlink("busybox", root.join("bin").join(applet)).unwrap();
    }
    let imported = opendsec_images::offline::import_rootfs(store, &root, &Default::default()).await.unwrap();
    imported.layers[0].clone()
}

#[tokio::test]
async fn layer_cache_copies_once_and_prunes() {
    if !is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let store = Store::open(tmp.path().join("store")).unwrap();
    let id = busybox_layer(&store, tmp.path()).await;
    let cache = LayerCache::new(tmp.path().join("cache"));
    // Many first uses at once (a batch from a new image) make one copy, not one each.
    let paths: Vec<_> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..8).map(|_| s.spawn(|| cache.ensure(&store, &id).unwrap())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(cache.copies(), 1);
    let p = paths[0].clone();
    assert!(paths.iter().all(|q| *q == p));
    assert!(p.join("bin/busybox").is_file());
    assert_eq!(std::fs::read_link(p.join("bin/sh")).unwrap(), Path::new("busybox"));
    // Later use: same path, no copy; no temporary copy left behind.
    assert_eq!(cache.ensure(&store, &id).unwrap(), p);
    assert_eq!(cache.copies(), 1);
    let names: Vec<String> = std::fs::read_dir(cache.dir())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(names.iter().all(|n| !n.starts_with(".tmp-")), "{names:?}");
    // In use or fresh: kept.
    assert!(cache.prune(Duration::ZERO, std::slice::from_ref(&id)).unwrap().is_empty());
    assert!(cache.prune(Duration::from_secs(3600), &[]).unwrap().is_empty());
    assert_eq!(cache.prune(Duration::ZERO, &[]).unwrap(), vec![id.as_str().to_string()]);
    assert!(!p.exists());
}

#[test]
fn disk_on_autoclear_loop_device() {
    if !is_root() {
        panic!("this test needs root (CI runs as root)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let disk = tmp.path().join("disk.img");
    rootfs::create_disk(&disk, 16).unwrap();
    // Sparse: far less allocated than its size.
    let meta = std::fs::metadata(&disk).unwrap();
    assert_eq!(meta.len(), 16 << 20);
    assert!(std::os::unix::fs::MetadataExt::blocks(&meta) * 512 < 8 << 20);
    let dev = rootfs::attach_loop(&disk).unwrap();
    let found = rootfs::loops_under(tmp.path());
    assert_eq!(found.len(), 1, "{found:?}");
    assert_eq!(found[0].0, dev.path);
    // The one-device look teardown uses sees the same backing file.
    assert_eq!(rootfs::loop_backing(&dev.path), Some(disk.clone()));
    drop(dev); // autoclear: the last close detaches
    let mut left = rootfs::loops_under(tmp.path());
    for _ in 0..100 {
        if left.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        left = rootfs::loops_under(tmp.path());
    }
    assert!(left.is_empty(), "{left:?}");

    // Leftover cleanup by backing directory.
    let dev = rootfs::attach_loop(&disk).unwrap();
    let path = dev.path.clone();
    let detached = rootfs::detach_under(tmp.path());
    assert_eq!(detached, vec![path.clone()]);
    drop(dev);
    assert!(rootfs::loops_under(tmp.path()).is_empty());
    // One device by name (still open here: it goes with the last close), then nothing of
    // ours is left. (A freed device number may at once serve someone else: look by backing
    // file, never detach by number after it is free.)
    let dev = rootfs::attach_loop(&disk).unwrap();
    assert!(rootfs::detach(&dev.path));
    drop(dev);
    assert!(rootfs::loops_under(tmp.path()).is_empty());
}
