//! Memory snapshots of microVMs in the store ([C 7], [C 10] `snapshots/<id>/`). One
//! directory per snapshot:
//!
//! ```text
//! snapshots/<id>/record.json   what it is (VmSnapshotRecord); written last
//! snapshots/<id>/state         QEMU's migration stream of the device state (the memory left
//!                              out: it is `mem`)
//! snapshots/<id>/mem           the guest's memory, its zero pages holes
//! snapshots/<id>/disk.img      the guest's writable disk, raw ext4, sparse
//! ```
//!
//! Invariants: a snapshot is written in `snapshots/.tmp-<id>.<random>/`, every file fsynced,
//! and renamed into place whole, so it exists exactly when `record.json` does; it never changes
//! after. Its id is `vm-` and 32 hex digits: never 64, which GC would read as a layer id. A
//! snapshot is named by the manifest of the image it was published as
//! ([`crate::Manifest::vm_snapshot`]); its record names the image layers under its disk, which
//! GC keeps while the snapshot exists (`gc`).

use std::fs;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::store::{LayerId, Store, StoreError, sync_dir, write_synced};

/// Encoding version of [`VmSnapshotRecord`]. 2: the memory is a file of its own (`mem`); a
/// version 1 snapshot carried it in the stream and is not restored (not found).
pub const VERSION: u32 = 2;
/// The file a snapshot exists by.
pub const RECORD: &str = "record.json";
/// The migration stream of the device state.
pub const STATE: &str = "state";
/// The guest's memory.
pub const MEM: &str = "mem";
/// The writable disk.
pub const DISK: &str = "disk.img";

/// `snapshots/<id>/record.json`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct VmSnapshotRecord {
    pub v: u32,
    pub id: String,
    /// The backend that restores it (`microvm`).
    pub backend: String,
    /// What a VMM must be to restore its state: QEMU's version, the accelerator, the machine
    /// and the device layout (`qemu 7.2.22 tcg microvm devices-2`).
    pub vmm: String,
    /// The image's layers under its disk (its image disk is built from them), bottom first.
    pub layers: Vec<LayerId>,
    /// The guest's memory, vCPUs and writable disk: a copy has exactly these.
    pub memory_mb: u64,
    pub cpus: u64,
    pub disk_mb: u64,
    /// The VM had a NIC (its copies have one too: the devices are restored as they were).
    #[serde(default)]
    pub net: bool,
    /// The sandbox it was taken of.
    pub source: String,
    pub created_at_ms: i64,
    /// Bytes its files take on disk.
    pub bytes: u64,
}

/// A new snapshot id.
pub fn new_id() -> String {
    format!("vm-{:032x}", rand::random::<u128>())
}

/// Checks that `id` is a snapshot id (so that it names a directory under `snapshots/` and
/// nothing else).
pub fn check_id(id: &str) -> Result<(), StoreError> {
    let ok = id.strip_prefix("vm-").is_some_and(|h| h.len() == 32 && h.bytes().all(|b| b.is_ascii_hexdigit()));
    if ok {
        Ok(())
    } else {
        Err(StoreError::InvalidName {
            what: "vm snapshot id",
            value: id.chars().take(80).collect(),
            why: "vm- and 32 hex digits",
        })
    }
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> StoreError + '_ {
    move |source| StoreError::Io { path: path.to_path_buf(), source }
}

impl Store {
    /// The directory of snapshot `id` (which may not exist).
    pub fn vm_snapshot_dir(&self, id: &str) -> Result<PathBuf, StoreError> {
        check_id(id)?;
        Ok(self.root().join("snapshots").join(id))
    }

    pub fn has_vm_snapshot(&self, id: &str) -> bool {
        self.vm_snapshot_dir(id).is_ok_and(|d| d.join(RECORD).exists())
    }

    /// A new, empty directory to write snapshot `id`'s files into, then
    /// [`Store::commit_vm_snapshot`].
    pub fn begin_vm_snapshot(&self, id: &str) -> Result<PathBuf, StoreError> {
        check_id(id)?;
        let tmp = self.root().join("snapshots").join(format!(".tmp-{id}.{:08x}", rand::random::<u32>()));
        fs::create_dir_all(&tmp).map_err(io(&tmp))?;
        Ok(tmp)
    }

    /// Places the snapshot written in `tmp` whole: its files fsynced, its record written last,
    /// the directory renamed into place.
    pub fn commit_vm_snapshot(&self, tmp: &Path, rec: &VmSnapshotRecord) -> Result<(), StoreError> {
        let dir = self.vm_snapshot_dir(&rec.id)?;
        for f in [STATE, MEM, DISK] {
            let p = tmp.join(f);
            fs::File::open(&p).and_then(|f| f.sync_all()).map_err(io(&p))?;
        }
        let rp = tmp.join(RECORD);
        let bytes =
            serde_json::to_vec_pretty(rec).map_err(|source| StoreError::Corrupt { path: rp.clone(), source })?;
        write_synced(&rp, &bytes)?;
        sync_dir(tmp)?;
        fs::rename(tmp, &dir).map_err(io(&dir))?;
        sync_dir(&self.root().join("snapshots"))
    }

    /// Snapshot `id`'s record.
    pub fn vm_snapshot(&self, id: &str) -> Result<VmSnapshotRecord, StoreError> {
        let p = self.vm_snapshot_dir(id)?.join(RECORD);
        let text = match fs::read(&p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err(StoreError::SnapshotNotFound(id.into())),
            Err(e) => return Err(StoreError::Io { path: p, source: e }),
        };
        let rec: VmSnapshotRecord =
            serde_json::from_slice(&text).map_err(|source| StoreError::Corrupt { path: p.clone(), source })?;
        if rec.id != id || rec.v != VERSION {
            return Err(StoreError::SnapshotNotFound(format!("{id} (its record names {} v{})", rec.id, rec.v)));
        }
        Ok(rec)
    }

    /// Removes snapshot `id` whole (renamed away first, so it never shows half-deleted).
    pub fn delete_vm_snapshot(&self, id: &str) -> Result<(), StoreError> {
        let dir = self.vm_snapshot_dir(id)?;
        let gone = self.root().join("snapshots").join(format!(".gone-{id}.{:08x}", rand::random::<u32>()));
        match fs::rename(&dir, &gone) {
            Ok(()) => fs::remove_dir_all(&gone).map_err(io(&gone)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(StoreError::SnapshotNotFound(id.into())),
            Err(e) => Err(StoreError::Io { path: dir, source: e }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_name_one_directory_and_never_look_like_layers() {
        let id = new_id();
        check_id(&id).unwrap();
        assert!(crate::gc::scan_layer_ids(id.as_bytes()).is_empty());
        for bad in ["", "vm-", "vm-../../etc", &format!("{id}0"), "layer-0123456789abcdef0123456789abcdef"] {
            assert!(check_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_snapshot_appears_whole_and_goes_whole() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(tmp.path()).unwrap();
        let id = new_id();
        assert!(matches!(store.vm_snapshot(&id), Err(StoreError::SnapshotNotFound(_))));
        let w = store.begin_vm_snapshot(&id).unwrap();
        fs::write(w.join(STATE), b"state").unwrap();
        fs::write(w.join(MEM), b"mem").unwrap();
        fs::write(w.join(DISK), b"disk").unwrap();
        assert!(!store.has_vm_snapshot(&id), "not before its commit");
        let rec = VmSnapshotRecord {
            v: VERSION,
            id: id.clone(),
            backend: "microvm".into(),
            vmm: "qemu 7.2.22 tcg microvm devices-2".into(),
            layers: vec![LayerId::parse(&"a".repeat(64)).unwrap()],
            memory_mb: 192,
            cpus: 1,
            disk_mb: 64,
            net: false,
            source: "e1.x".into(),
            created_at_ms: 1,
            bytes: 9,
        };
        store.commit_vm_snapshot(&w, &rec).unwrap();
        assert!(!w.exists());
        assert_eq!(store.vm_snapshot(&id).unwrap(), rec);
        // A record of the first version (its memory in the stream) is not restored: not found.
        let path = store.vm_snapshot_dir(&id).unwrap().join(RECORD);
        let old = serde_json::to_vec(&VmSnapshotRecord { v: 1, ..rec.clone() }).unwrap();
        let current = fs::read(&path).unwrap();
        fs::write(&path, &old).unwrap();
        assert!(matches!(store.vm_snapshot(&id), Err(StoreError::SnapshotNotFound(_))));
        fs::write(&path, &current).unwrap();
        assert_eq!(fs::read(store.vm_snapshot_dir(&id).unwrap().join(STATE)).unwrap(), b"state");
        store.delete_vm_snapshot(&id).unwrap();
        assert!(!store.has_vm_snapshot(&id));
        assert!(matches!(store.delete_vm_snapshot(&id), Err(StoreError::SnapshotNotFound(_))));
    }

    /// Stored bytes from the first version; never edit them.
    #[test]
    fn golden_record() {
        let r = r#"{"v":1,"id":"vm-0123456789abcdef0123456789abcdef","backend":"microvm","vmm":"qemu 7.2.22 tcg microvm devices-1","layers":["aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"],"memory_mb":192,"cpus":1,"disk_mb":64,"source":"e1.l1","created_at_ms":1700000000000,"bytes":4096}"#;
        let r: VmSnapshotRecord = serde_json::from_str(r).unwrap();
        assert_eq!((r.memory_mb, r.cpus, r.disk_mb, r.layers.len()), (192, 1, 64, 1));
    }
}
