//! Memory snapshots of microVMs and the copies restored from them ([C 7] "Creating from
//! snapshots, fork"): the snapshot is the VM's device state (a migration stream without the
//! memory), its memory (a file, zero pages left as holes) and its writable disk, stored in the
//! image store (`opendsec_images::vmsnap`) and published as an image. A sandbox created from
//! that image is restored from it, not booted, and runs on from where the snapshot's VM
//! stopped, its processes and their memory included. After the restore it takes a hostname, a
//! machine-id and a random seed of its own (`PostRestore`), and the host's clock (the serial
//! handshake).
//!
//! A copy's memory is its own file: a copy of the snapshot's, data only (the pages the guest
//! had written), reserved on the host like every VM's memory file, which its VMM maps shared
//! exactly as after a pause. Not the snapshot's file mapped privately into every copy (as
//! Firecracker does, sharing the pages no copy wrote): QEMU 7.2 opens a memory backend file
//! read-write, as root, before it drops to the VM's uid (its `readonly=on` maps the memory
//! read-only, which no guest runs on), and keeps the descriptor; a VMM taken over by its guest
//! could write into the memory every other copy maps. The snapshot's files are only ever opened
//! by the edge. (QEMU 8.2's `rom=off` opens the file read-only and maps it private: sharing
//! pages between copies is then safe, and is the next step where that QEMU is installed.) Not a
//! migration stream carrying every page either: loading one touches every page of the guest's
//! memory, zero or not, a full guest's worth of host memory per copy.
//!
//! Copies' disks are sparse copies of the snapshot's disk (its data only), reserved on the
//! host like every VM disk, not qcow2 overlays: a qcow2's metadata is written by the VMM (the
//! guest's side) and read back by the next VMM, as root, before it drops privileges, and by
//! any host tool that flattens it for the next snapshot; a raw disk carries nothing anyone
//! reads as instructions. With every VM's disk reserved in full, sharing blocks would not save
//! reserved space; a copy costs the data the source wrote.
//!
//! Snapshots live in the shared store; each node keeps its own copy of the ones it restores
//! (`<vm state>/.snapshots/<id>/`, hard links where the store is on the same file system),
//! fetched once under a lock and shared by every copy on the node, removed once the store's
//! snapshot is gone.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use opendsec_images::Store;
use opendsec_images::vmsnap::{self, VmSnapshotRecord};

use super::{Machine, Shape, Vm, VmBackend, blocking, disks, internal};
use crate::backend::{BackendError, VmSnapshotTaken, VmSnapshotter};
use crate::record::SandboxRecord;

/// This node's copies of snapshots, in the VM state directory.
pub(super) const CACHE: &str = ".snapshots";
/// How long a restored guest may take to take its new identity.
const POST_RESTORE_WAIT: Duration = Duration::from_secs(30);

/// The record of snapshot `id`, checked against what this edge runs and the copy asks for:
/// the same VMM (QEMU version, accelerator, machine, devices) and the same shape (memory,
/// vCPUs, disk), since the guest was running on exactly that.
pub(super) fn restorable(
    store: &Store,
    id: &str,
    image: &str,
    vmm_key: &str,
    wanted: &Shape,
) -> Result<VmSnapshotRecord, BackendError> {
    let rec = store.vm_snapshot(id).map_err(|e| match e {
        opendsec_images::StoreError::SnapshotNotFound(_) => {
            BackendError::not_found(format!("image {image}: its memory snapshot {id} is gone"))
        }
        e => BackendError::unavailable(format!("image {image}: reading memory snapshot {id}: {e}")),
    })?;
    if rec.vmm != vmm_key {
        return Err(BackendError::invalid_argument(format!(
            "image {image} is a memory snapshot taken on {}; this edge runs {vmm_key}, which cannot restore it",
            rec.vmm
        )));
    }
    let have = (rec.memory_mb, rec.cpus, rec.disk_mb);
    if have != (wanted.memory_mb, wanted.cpus, wanted.disk_mb) {
        return Err(BackendError::invalid_argument(format!(
            "image {image} is a memory snapshot of a VM with {} MiB of memory, {} vCPUs and a {} MiB disk: \
             a copy must ask for the same (it asked for {} MiB, {} vCPUs, {} MiB)",
            rec.memory_mb, rec.cpus, rec.disk_mb, wanted.memory_mb, wanted.cpus, wanted.disk_mb
        )));
    }
    Ok(rec)
}

/// This node's copy of snapshot `rec` (its directory under `cache`): made by the first
/// creation that needs it, under a lock, hard-linked from the store where it can be (the
/// store's files never change), else copied with their holes.
pub(super) fn cached(cache: &Path, store: &Store, rec: &VmSnapshotRecord) -> Result<PathBuf, BackendError> {
    let dir = cache.join(&rec.id);
    if dir.join(vmsnap::RECORD).exists() {
        return Ok(dir);
    }
    std::fs::create_dir_all(cache).map_err(internal("creating the snapshot cache"))?;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(cache.join(format!("{}.lock", rec.id)))
        .map_err(internal("opening the snapshot cache's lock"))?;
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| BackendError::internal(format!("locking the snapshot cache: {e}")))?;
    if dir.join(vmsnap::RECORD).exists() {
        return Ok(dir); // fetched meanwhile
    }
    let from = store.vm_snapshot_dir(&rec.id).map_err(|e| BackendError::internal(e.to_string()))?;
    let tmp = cache.join(format!(".{}.tmp{}", rec.id, rand::random::<u32>()));
    let _ = std::fs::remove_dir_all(&tmp);
    let fetched = (|| {
        std::fs::create_dir_all(&tmp).map_err(internal("creating a snapshot cache entry"))?;
        // The record last: an entry exists exactly when its record does.
        for f in [vmsnap::STATE, vmsnap::MEM, vmsnap::DISK, vmsnap::RECORD] {
            if std::fs::hard_link(from.join(f), tmp.join(f)).is_err() {
                // The store's files are the edge's, written whole: their length is theirs.
                let len = std::fs::metadata(from.join(f)).map_err(internal("sizing a snapshot file"))?.len();
                disks::copy_sparse(&from.join(f), &tmp.join(f), len)?;
            }
        }
        std::fs::rename(&tmp, &dir).map_err(internal("placing a snapshot cache entry"))
    })();
    if let Err(e) = fetched {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    // A new entry: the ones whose snapshots were deleted meanwhile go.
    prune(cache, store, false);
    Ok(dir)
}

/// Removes this node's copies of snapshots the store no longer has, and with `at_start` (no
/// creation runs yet) the leftovers of interrupted fetches.
pub(super) fn prune(cache: &Path, store: &Store, at_start: bool) -> usize {
    let mut removed = 0;
    for e in std::fs::read_dir(cache).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let id = name.strip_suffix(".lock").unwrap_or(&name);
        let gone = if name.starts_with('.') { at_start } else { !store.has_vm_snapshot(id) };
        if gone {
            let p = e.path();
            let r = if p.is_dir() { std::fs::remove_dir_all(&p) } else { std::fs::remove_file(&p) };
            if r.is_ok() && !name.ends_with(".lock") {
                removed += 1;
            }
        }
    }
    removed
}

/// Tells a restored guest to take the identity of `sb`: a hostname (its lease), a new
/// machine-id and random seed.
pub(super) async fn post_restore(channel: &tonic::transport::Channel, sb: &SandboxRecord) -> Result<(), BackendError> {
    let mut c = opendsec_proto::v1::agent_control_client::AgentControlClient::new(channel.clone());
    let req = opendsec_proto::v1::PostRestoreRequest {
        hostname: sb.lease_id.clone(),
        machine_id: format!("{:032x}", rand::random::<u128>()),
        random_seed: rand::random::<[u8; 64]>().to_vec(),
    };
    match tokio::time::timeout(POST_RESTORE_WAIT, c.post_restore(req)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(st)) => Err(BackendError::internal(format!(
            "the restored agent of {} refused its new identity: {}",
            sb.id,
            crate::backend::untrusted_text(st.message(), 300)
        ))),
        Err(_) => Err(BackendError::unavailable(format!("the restored agent of {} did not answer in time", sb.id))),
    }
}

/// Bytes `path` takes on disk.
fn allocated(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(path).map(|m| m.blocks() * 512).unwrap_or(0)
}

impl VmBackend {
    /// A running VM: its vCPUs stopped while its device state is saved (its memory left out:
    /// it is the VM's own file) and its memory and disk are copied, then run on (also when the
    /// save failed). The migration flushed and inactivated the disk, so the copy is consistent.
    async fn snapshot_running(&self, vm: &Vm, shape: &Shape, tmp: &Path) -> Result<(), BackendError> {
        self.vmm.stop_vcpus(&vm.dir).await?;
        let save = async {
            self.vmm.save(&vm.dir, &tmp.join(vmsnap::STATE)).await?;
            copy_files(&vm.dir, tmp, shape, false).await
        };
        let saved = tokio::time::timeout(self.opts.boot_timeout, save)
            .await
            .unwrap_or_else(|_| Err(BackendError::unavailable(format!("{} was not saved in time", vm.dir.display()))));
        let ran = self.vmm.run_vcpus(&vm.dir).await;
        vm.agent.beat_now();
        saved.and(ran)
    }
}

/// Copies a VM's memory and disk from `dir` into the snapshot directory `tmp` (data only, as
/// large as its shape says), and with `state` its saved device state too (a paused microvm's,
/// which the pause wrote without the memory, as a snapshot's is).
async fn copy_files(dir: &Path, tmp: &Path, shape: &Shape, state: bool) -> Result<(), BackendError> {
    let (dir, tmp) = (dir.to_path_buf(), tmp.to_path_buf());
    let (mem, disk) = (shape.memory_mb << 20, shape.disk_mb << 20);
    blocking(move || {
        disks::copy_sparse(&dir.join("mem"), &tmp.join(vmsnap::MEM), mem)?;
        disks::copy_sparse(&dir.join("disk.img"), &tmp.join(vmsnap::DISK), disk)?;
        if state {
            // The edge wrote it, bounded ([`super::save_stream`]).
            let len = std::fs::metadata(dir.join("state")).map_err(internal("sizing the saved state"))?.len();
            disks::copy_sparse(&dir.join("state"), &tmp.join(vmsnap::STATE), len)?;
        }
        Ok(())
    })
    .await
}

#[async_trait]
impl VmSnapshotter for VmBackend {
    async fn snapshot_vm(&self, sb: &SandboxRecord) -> Result<VmSnapshotTaken, BackendError> {
        if self.opts.machine != Machine::Microvm {
            return Err(BackendError::invalid_argument("only microvm sandboxes have memory snapshots"));
        }
        let vm = self.lock().get(&sb.id).cloned().ok_or_else(|| BackendError::not_found(format!("no VM {}", sb.id)))?;
        let shape = Self::kept_vmm(&vm.dir)?.shape;
        if shape.layers.is_empty() {
            return Err(BackendError::invalid_argument(format!(
                "the VM of {} was started by an edge without memory snapshots; it cannot be snapshotted",
                sb.id
            )));
        }
        let (store, id) = (self.store.clone(), vmsnap::new_id());
        let tmp = {
            let (store, id) = (store.clone(), id.clone());
            blocking(move || store.begin_vm_snapshot(&id).map_err(|e| BackendError::unavailable(e.to_string()))).await?
        };
        let started = Instant::now();
        // A paused microvm has no VMM (pid 0): its saved state and memory are what a snapshot
        // holds already.
        let saved = if vm.pid == 0 {
            copy_files(&vm.dir, &tmp, &shape, true).await
        } else {
            self.snapshot_running(&vm, &shape, &tmp).await
        };
        let frozen = started.elapsed();
        let committed = match saved {
            Ok(()) => {
                let (store, tmp) = (store.clone(), tmp.clone());
                let rec = VmSnapshotRecord {
                    v: vmsnap::VERSION,
                    id: id.clone(),
                    backend: self.opts.machine.backend().to_string(),
                    vmm: self.vmm_key(),
                    layers: shape.layers.clone(),
                    memory_mb: shape.memory_mb,
                    cpus: shape.cpus,
                    disk_mb: shape.disk_mb,
                    net: shape.net,
                    source: sb.id.clone(),
                    created_at_ms: opendsec_common::time::now_ms(),
                    bytes: [vmsnap::STATE, vmsnap::MEM, vmsnap::DISK].iter().map(|f| allocated(&tmp.join(f))).sum(),
                };
                let bytes = rec.bytes;
                blocking(move || {
                    store.commit_vm_snapshot(&tmp, &rec).map_err(|e| BackendError::unavailable(e.to_string()))
                })
                .await
                .map(|()| bytes)
            }
            Err(e) => Err(e),
        };
        match committed {
            Ok(bytes) => Ok(VmSnapshotTaken { id, layers: shape.layers, bytes, frozen }),
            Err(e) => {
                let _ = std::fs::remove_dir_all(&tmp);
                Err(e)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A snapshot with files `state`, `mem` and `disk.img` in `store`.
    fn stored(store: &Store) -> VmSnapshotRecord {
        let id = vmsnap::new_id();
        let w = store.begin_vm_snapshot(&id).unwrap();
        std::fs::write(w.join(vmsnap::STATE), b"device state").unwrap();
        let mem = std::fs::File::create(w.join(vmsnap::MEM)).unwrap();
        mem.set_len(8 << 20).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&mem, b"a page", 4 << 20).unwrap();
        std::fs::write(w.join(vmsnap::DISK), b"disk").unwrap();
        let rec = VmSnapshotRecord {
            v: vmsnap::VERSION,
            id,
            backend: "microvm".into(),
            vmm: "qemu".into(),
            layers: vec![],
            memory_mb: 8,
            cpus: 1,
            disk_mb: 1,
            net: false,
            source: "e.l".into(),
            created_at_ms: 1,
            bytes: 0,
        };
        store.commit_vm_snapshot(&w, &rec).unwrap();
        rec
    }

    /// Another node's copy: the store on another file system (a network one in production, a
    /// tmpfs here) cannot be hard-linked, so its files are copied, holes kept; a second
    /// creation finds the copy; it goes once the store's snapshot is gone.
    #[test]
    fn a_snapshot_from_another_file_system_is_copied_once_and_pruned() {
        let remote = tempfile::tempdir_in("/dev/shm").unwrap();
        let node = tempfile::tempdir().unwrap();
        let store = Store::open(remote.path()).unwrap();
        let rec = stored(&store);
        let cache = node.path().join(CACHE);
        let dir = cached(&cache, &store, &rec).unwrap();
        let from = store.vm_snapshot_dir(&rec.id).unwrap();
        use std::os::unix::fs::MetadataExt;
        for f in [vmsnap::STATE, vmsnap::MEM, vmsnap::DISK, vmsnap::RECORD] {
            assert_eq!(std::fs::read(dir.join(f)).unwrap(), std::fs::read(from.join(f)).unwrap(), "{f}");
            assert_ne!(std::fs::metadata(dir.join(f)).unwrap().ino(), std::fs::metadata(from.join(f)).unwrap().ino());
        }
        assert!(std::fs::metadata(dir.join(vmsnap::MEM)).unwrap().blocks() * 512 <= 64 << 10, "holes kept");
        // Found, not fetched again.
        std::fs::write(dir.join("marker"), b"").unwrap();
        assert!(cached(&cache, &store, &rec).unwrap().join("marker").exists());
        // The store's snapshot gone: the node's copy goes at the next prune.
        store.delete_vm_snapshot(&rec.id).unwrap();
        assert_eq!(prune(&cache, &store, false), 1);
        assert!(!dir.exists());
    }
}
