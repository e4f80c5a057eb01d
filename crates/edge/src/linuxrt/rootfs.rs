//! Root file systems of container sandboxes: the node-local layer cache and the per-sandbox
//! upper disk (a sparse ext4 image file on a loop device).
//!
//! Invariants:
//! - a cached layer `<cache>/layers/<id>` is complete or absent: it is copied whole (`cp -a`,
//!   which keeps owners, modes, hard links, xattrs such as overlay opaque markers and whiteout
//!   device nodes) into a temporary name and renamed into place; layers are immutable, so a
//!   cached copy never needs refreshing. Within the edge one copy per layer runs at a time:
//!   concurrent first uses (a batch of 200 from a new image) wait for it instead of each
//!   copying the layer; across processes they race to the rename, and the loser's copy is
//!   dropped;
//! - each use touches `<cache>/layers/<id>.used` (its mtime is the last-used stamp);
//!   `prune` removes layers unused for longer than asked and not listed as in use;
//! - loop devices are attached with `LO_FLAGS_AUTOCLEAR`: once the sandbox's mount namespace
//!   (the only place the disk is mounted) dies and the last fd is closed, the kernel detaches
//!   the device by itself. `detach_under` cleans up leftovers whose backing file lies under a
//!   given directory.
//!
//! The overlay itself is mounted by the setup process inside the sandbox's mount namespace
//! (`linuxrt::init`), never on the host.
#![allow(unsafe_code)]

use std::ffi::OsStr;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

use opendsec_images::{LayerId, Store};

/// Errors of layer caching, disks and loop devices.
#[derive(Debug, thiserror::Error)]
pub enum RootfsError {
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("layer {0} is not in the image store")]
    MissingLayer(String),
    #[error("{cmd} failed: {detail}")]
    Command { cmd: &'static str, detail: String },
    #[error("loop device: {0}")]
    Loop(String),
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> RootfsError + 'a {
    move |source| RootfsError::Io { what, path: path.to_path_buf(), source }
}

/// The node-local copies of image layers.
#[derive(Clone, Debug)]
pub struct LayerCache {
    dir: PathBuf,
    /// One gate per layer being copied: later first uses wait on it.
    copying: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, std::sync::Arc<std::sync::Mutex<()>>>>>,
    /// Layers copied in from the store by this cache and its clones (what tests check).
    copies: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl LayerCache {
    /// A cache rooted at `<root>/layers`.
    pub fn new(root: impl AsRef<Path>) -> LayerCache {
        LayerCache { dir: root.as_ref().join("layers"), copying: Default::default(), copies: Default::default() }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// How many layers this cache (and its clones) copied in from the store.
    pub fn copies(&self) -> u64 {
        self.copies.load(std::sync::atomic::Ordering::Relaxed)
    }

    pub fn layer_path(&self, id: &LayerId) -> PathBuf {
        self.dir.join(id.as_str())
    }

    fn stamp_path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.used"))
    }

    /// The cached copy of `id`, copied from `store` on first use (blocking; concurrent first
    /// uses wait for one copy); touches its last-used stamp.
    pub fn ensure(&self, store: &Store, id: &LayerId) -> Result<PathBuf, RootfsError> {
        let dst = self.layer_path(id);
        if !dst.is_dir() {
            let gate = {
                let mut g = self.copying.lock().unwrap_or_else(|p| p.into_inner());
                g.entry(id.as_str().to_owned()).or_default().clone()
            };
            let _copy = gate.lock().unwrap_or_else(|p| p.into_inner());
            let res = self.copy_in(store, id, &dst);
            self.copying.lock().unwrap_or_else(|p| p.into_inner()).remove(id.as_str());
            res?;
        }
        self.touch(id.as_str())?;
        Ok(dst)
    }

    /// Copies layer `id` into `dst` unless it is there (whole or not at all).
    fn copy_in(&self, store: &Store, id: &LayerId, dst: &Path) -> Result<(), RootfsError> {
        if !dst.is_dir() {
            let src = store.layer_rootfs(id);
            if !src.is_dir() {
                return Err(RootfsError::MissingLayer(id.as_str().to_owned()));
            }
            std::fs::create_dir_all(&self.dir).map_err(io("create", &self.dir))?;
            let tmp = self.dir.join(format!(".tmp-{}-{}", id.as_str(), rand::random::<u64>()));
            let out = Command::new("cp")
                .arg("-a")
                .arg("--reflink=auto")
                .arg(&src)
                .arg(&tmp)
                .output()
                .map_err(io("run cp for", &src))?;
            if !out.status.success() {
                let _ = std::fs::remove_dir_all(&tmp);
                return Err(RootfsError::Command {
                    cmd: "cp",
                    detail: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
                });
            }
            self.copies.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            if let Err(e) = std::fs::rename(&tmp, dst) {
                let _ = std::fs::remove_dir_all(&tmp);
                // Another process won the race: its copy is as good as ours.
                if !dst.is_dir() {
                    return Err(io("rename into", dst)(e));
                }
            }
        }
        Ok(())
    }

    fn touch(&self, id: &str) -> Result<(), RootfsError> {
        let p = self.stamp_path(id);
        let f = OpenOptions::new().create(true).truncate(false).write(true).open(&p).map_err(io("open", &p))?;
        f.set_modified(SystemTime::now()).map_err(io("stamp", &p))
    }

    /// Removes cached layers whose stamp is older than `older_than` and whose id is not in
    /// `in_use`; also removes abandoned temporary copies. Returns the removed ids.
    pub fn prune(&self, older_than: Duration, in_use: &[LayerId]) -> Result<Vec<String>, RootfsError> {
        let mut removed = Vec::new();
        let Ok(rd) = std::fs::read_dir(&self.dir) else { return Ok(removed) };
        let now = SystemTime::now();
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            let path = e.path();
            if name.starts_with(".tmp-") {
                let old = e
                    .metadata()
                    .and_then(|m| m.modified())
                    .map(|m| now.duration_since(m).unwrap_or_default() > older_than);
                if old.unwrap_or(false) {
                    let _ = std::fs::remove_dir_all(&path);
                }
                continue;
            }
            if name.ends_with(".used") || !path.is_dir() || in_use.iter().any(|l| l.as_str() == name) {
                continue;
            }
            let stamp = self.stamp_path(&name);
            let age = std::fs::metadata(&stamp)
                .and_then(|m| m.modified())
                .map(|m| now.duration_since(m).unwrap_or_default())
                .unwrap_or(Duration::MAX);
            if age > older_than {
                std::fs::remove_dir_all(&path).map_err(io("remove", &path))?;
                let _ = std::fs::remove_file(&stamp);
                removed.push(name);
            }
        }
        Ok(removed)
    }
}

/// The overlay lower directories of an image whose manifest lists `layers` bottom first: each
/// layer cached, returned top layer first (overlayfs order).
pub fn lower_dirs(cache: &LayerCache, store: &Store, layers: &[LayerId]) -> Result<Vec<PathBuf>, RootfsError> {
    layers.iter().rev().map(|id| cache.ensure(store, id)).collect()
}

/// Creates the sparse upper disk of a sandbox: `disk_mb` MiB, ext4 without a journal (the disk
/// dies with the sandbox, so crash consistency buys nothing and the journal costs writes) and
/// without the blocks reserved for growing it online (it is never resized; reserving them made
/// mkfs of a 10 GiB disk 9 ms instead of 2.5 ms).
pub fn create_disk(path: &Path, disk_mb: u64) -> Result<(), RootfsError> {
    let f = File::create(path).map_err(io("create", path))?;
    f.set_len(disk_mb * 1024 * 1024).map_err(io("size", path))?;
    drop(f);
    let out = Command::new("mkfs.ext4")
        .args(["-q", "-F", "-O", "^has_journal,^resize_inode", "-E", "nodiscard,lazy_itable_init=1", "-m", "0"])
        .arg(path)
        .output()
        .map_err(io("run mkfs.ext4 on", path))?;
    if !out.status.success() {
        return Err(RootfsError::Command {
            cmd: "mkfs.ext4",
            detail: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(())
}

const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_NAME_SIZE: usize = 64;

#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

#[repr(C)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

/// An attached loop device. Dropping it closes the fd only; with autoclear the kernel detaches
/// the device once nothing (no mount, no fd) uses it.
#[derive(Debug)]
pub struct LoopDevice {
    pub path: PathBuf,
    file: File,
}

impl LoopDevice {
    pub fn file(&self) -> &File {
        &self.file
    }
}

/// Attaches `backing` to a free loop device with `LOOP_CONFIGURE` (autoclear).
pub fn attach_loop(backing: &Path) -> Result<LoopDevice, RootfsError> {
    let ctl_path = Path::new("/dev/loop-control");
    let ctl = OpenOptions::new().read(true).write(true).open(ctl_path).map_err(io("open", ctl_path))?;
    let back = OpenOptions::new().read(true).write(true).open(backing).map_err(io("open", backing))?;
    // Attachers of this process take turns (concurrent creations otherwise all get the same
    // free device and all but one fail); another process may still take the device between
    // GET_FREE and CONFIGURE (EBUSY): retry, backing off.
    static ATTACH: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _turn = ATTACH.lock().unwrap_or_else(|p| p.into_inner());
    for attempt in 0..64u64 {
        if attempt > 4 {
            std::thread::sleep(std::time::Duration::from_millis(attempt));
        }
        // SAFETY: LOOP_CTL_GET_FREE takes no argument and returns a device number.
        let n = unsafe { libc::ioctl(ctl.as_raw_fd(), LOOP_CTL_GET_FREE) };
        if n < 0 {
            return Err(RootfsError::Loop(format!("LOOP_CTL_GET_FREE: {}", std::io::Error::last_os_error())));
        }
        let path = PathBuf::from(format!("/dev/loop{n}"));
        let dev = OpenOptions::new().read(true).write(true).open(&path).map_err(io("open", &path))?;
        let mut name = [0u8; LO_NAME_SIZE];
        let b = backing.as_os_str().as_bytes();
        let k = b.len().min(LO_NAME_SIZE - 1);
        name[..k].copy_from_slice(&b[..k]);
        let cfg = LoopConfig {
            fd: back.as_raw_fd() as u32,
            block_size: 0,
            info: LoopInfo64 {
                lo_device: 0,
                lo_inode: 0,
                lo_rdevice: 0,
                lo_offset: 0,
                lo_sizelimit: 0,
                lo_number: 0,
                lo_encrypt_type: 0,
                lo_encrypt_key_size: 0,
                lo_flags: LO_FLAGS_AUTOCLEAR,
                lo_file_name: name,
                lo_crypt_name: [0; LO_NAME_SIZE],
                lo_encrypt_key: [0; 32],
                lo_init: [0; 2],
            },
            reserved: [0; 8],
        };
        // SAFETY: LOOP_CONFIGURE reads one `struct loop_config`, which `cfg` is (repr(C),
        // layout as in <linux/loop.h>), alive for the call.
        let r = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE, &cfg as *const LoopConfig) };
        if r == 0 {
            return Ok(LoopDevice { path, file: dev });
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::EBUSY) {
            return Err(RootfsError::Loop(format!("LOOP_CONFIGURE {}: {err}", path.display())));
        }
    }
    Err(RootfsError::Loop("no free loop device after 64 tries".into()))
}

/// Loop devices (`/dev/loopN`) whose backing file lies under `dir`.
pub fn loops_under(dir: &Path) -> Vec<(PathBuf, PathBuf)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/sys/block") else { return out };
    for e in rd.flatten() {
        let name = e.file_name();
        if !name.as_bytes().starts_with(b"loop") {
            continue;
        }
        if let Some(back) = backing_file(&name)
            && back.starts_with(dir)
        {
            out.push((Path::new("/dev").join(OsStr::new(&name)), back));
        }
    }
    out
}

/// The (major, minor) number of block device `dev`.
pub fn device_number(dev: &Path) -> std::io::Result<(u32, u32)> {
    use std::os::unix::fs::MetadataExt;
    let rdev = std::fs::metadata(dev)?.rdev();
    Ok((rustix::fs::major(rdev), rustix::fs::minor(rdev)))
}

/// The backing file of loop device `dev` (`/dev/loopN` or `loopN`); None when it has none.
pub fn loop_backing(dev: &Path) -> Option<PathBuf> {
    backing_file(dev.file_name()?)
}

fn backing_file(name: &OsStr) -> Option<PathBuf> {
    let back = std::fs::read_to_string(Path::new("/sys/block").join(name).join("loop/backing_file")).ok()?;
    Some(PathBuf::from(back.trim_end_matches('\n').trim_end_matches(" (deleted)")))
}

/// Detaches loop device `dev` if it still has a backing file. True when the kernel took it:
/// detached, or (still open or mounted somewhere) marked to detach on its last close.
pub fn detach(dev: &Path) -> bool {
    let Ok(f) = OpenOptions::new().read(true).open(dev) else { return false };
    // SAFETY: LOOP_CLR_FD takes no argument.
    unsafe { libc::ioctl(f.as_raw_fd(), LOOP_CLR_FD) == 0 }
}

/// Detaches every loop device whose backing file lies under `dir` (leftover cleanup; a device
/// still mounted somewhere stays busy and is only marked autoclear by the kernel).
pub fn detach_under(dir: &Path) -> Vec<PathBuf> {
    let mut done = Vec::new();
    for (dev, _) in loops_under(dir) {
        if detach(&dev) {
            done.push(dev);
        }
    }
    done
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loop_config_matches_the_kernel_layout() {
        assert_eq!(std::mem::size_of::<LoopInfo64>(), 232);
        assert_eq!(std::mem::size_of::<LoopConfig>(), 304);
    }
}
