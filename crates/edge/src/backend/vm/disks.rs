//! What a VM boots from and writes to ([C 7]): the initramfs (the agent as `/init` and the
//! kernel modules it loads), the image disk (the image's layers flattened into one EROFS file,
//! built once per layer set into the store's `vmdisks/` under a lock and shared by every VM of
//! that image; virtio-blk on a microvm, virtio-pmem read with DAX on a full VM), the writable disk (sparse ext4, `disk_mb`) and the config disk (raw: a
//! little-endian u32 length, then JSON; read once by the agent).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use opendsec_images::{LayerId, Store};
use sha2::{Digest, Sha256};

use crate::backend::BackendError;

fn io_err(what: impl std::fmt::Display) -> impl FnOnce(std::io::Error) -> BackendError {
    move |e| BackendError::internal(format!("{what}: {e}"))
}

/// The last bytes of a tool's or a console's output, as text, for error messages.
pub(crate) fn tail(b: &[u8]) -> String {
    String::from_utf8_lossy(&b[b.len().saturating_sub(600)..]).trim().to_string()
}

/// Runs a tool; its output goes into the error when it fails.
fn run(cmd: &mut Command) -> Result<(), BackendError> {
    let out = cmd.output().map_err(|e| BackendError::internal(format!("cannot run {:?}: {e}", cmd.get_program())))?;
    if !out.status.success() {
        return Err(BackendError::internal(format!(
            "{:?} failed ({}): {}",
            cmd.get_program(),
            out.status,
            tail(&out.stderr)
        )));
    }
    Ok(())
}

/// The newc cpio archive of an initramfs, written entry by entry.
struct Cpio<W: Write> {
    out: W,
    ino: u32,
}

impl<W: Write> Cpio<W> {
    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) -> std::io::Result<()> {
        self.ino += 1;
        let namesize = name.len() + 1;
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            rdev.0,
            rdev.1,
            namesize,
            0
        );
        self.out.write_all(header.as_bytes())?;
        self.out.write_all(name.as_bytes())?;
        self.out.write_all(&[0])?;
        let pad = |n: usize| (4 - n % 4) % 4;
        self.out.write_all(&[0; 3][..pad(110 + namesize)])?;
        self.out.write_all(data)?;
        self.out.write_all(&[0; 3][..pad(data.len())])
    }

    fn finish(mut self) -> std::io::Result<W> {
        self.entry("TRAILER!!!", 0, (0, 0), &[])?;
        Ok(self.out)
    }
}

/// The initramfs for `agent` and the modules in `kernel_dir` (scripts/vm-kernel.sh), built
/// once into `cache` and named by the hash of what went in.
pub fn initramfs(cache: &Path, agent: &Path, kernel_dir: &Path) -> Result<PathBuf, BackendError> {
    let agent_bytes = std::fs::read(agent).map_err(io_err(format!("reading the agent {}", agent.display())))?;
    let modules = kernel_dir.join("modules");
    let mut names: Vec<String> = Vec::new();
    for order in ["mmio.order", "pci.order"] {
        let list = std::fs::read_to_string(kernel_dir.join(order))
            .map_err(io_err(format!("reading {} (run scripts/vm-kernel.sh)", kernel_dir.join(order).display())))?;
        for n in list.lines().map(str::trim).filter(|l| !l.is_empty()) {
            if n.contains('/') || !n.ends_with(".ko") {
                return Err(BackendError::invalid_argument(format!("{order} names {n:?}, not a module file")));
            }
            if !names.iter().any(|x| x == n) {
                names.push(n.to_string());
            }
        }
    }
    let mut h = Sha256::new();
    h.update(&agent_bytes);
    for n in &names {
        h.update(n.as_bytes());
        h.update(std::fs::read(modules.join(n)).map_err(io_err(format!("reading module {n}")))?);
    }
    for order in ["mmio.order", "pci.order"] {
        h.update(std::fs::read(kernel_dir.join(order)).unwrap_or_default());
    }
    let key: String = h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    let path = cache.join(format!("initramfs-{key}.cpio"));
    if path.exists() {
        return Ok(path);
    }
    std::fs::create_dir_all(cache).map_err(io_err(format!("creating {}", cache.display())))?;
    let tmp = cache.join(format!(".initramfs-{key}.tmp{}", rand::random::<u32>()));
    let build = || -> std::io::Result<()> {
        let f = std::io::BufWriter::new(std::fs::File::create(&tmp)?);
        let mut c = Cpio { out: f, ino: 0 };
        c.entry("dev", 0o040755, (0, 0), &[])?;
        // The kernel opens it for init's stdin, stdout and stderr before /dev is mounted.
        c.entry("dev/console", 0o020600, (5, 1), &[])?;
        c.entry("init", 0o100755, (0, 0), &agent_bytes)?;
        c.entry("modules", 0o040755, (0, 0), &[])?;
        for order in ["mmio.order", "pci.order"] {
            c.entry(&format!("modules/{order}"), 0o100644, (0, 0), &std::fs::read(kernel_dir.join(order))?)?;
        }
        for n in &names {
            c.entry(&format!("modules/{n}"), 0o100644, (0, 0), &std::fs::read(modules.join(n))?)?;
        }
        let mut f = c.finish()?;
        f.flush()?;
        f.into_inner().map_err(|e| e.into_error())?.sync_all()
    };
    build().map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        BackendError::internal(format!("building the initramfs: {e}"))
    })?;
    std::fs::rename(&tmp, &path).map_err(io_err("placing the initramfs"))?;
    Ok(path)
}

/// The image disk of `layers`: `<store>/vmdisks/<key>.erofs`, built by the first VM that needs
/// it (under `<key>.lock`, so concurrent creations on any node build it once) and shared by
/// the VMs of `scope`: every VM when `None` (a block device: each guest reads its own copy),
/// one project's when `Some` (a full VM maps it with DAX, and VMs mapping one file run on the
/// same physical pages: a cache side channel between them, kept within a tenant).
pub fn image_disk(store: &Store, layers: &[LayerId], scope: Option<&str>) -> Result<PathBuf, BackendError> {
    if layers.is_empty() {
        return Err(BackendError::invalid_argument("an image without layers has nothing to boot"));
    }
    let mut h = Sha256::new();
    h.update(b"erofs-v2\n");
    if let Some(project) = scope {
        h.update(format!("project {project}\n").as_bytes());
    }
    for l in layers {
        h.update(l.as_str().as_bytes());
        h.update(b"\n");
    }
    let key: String = h.finalize().iter().take(16).map(|b| format!("{b:02x}")).collect();
    let dir = store.root().join("vmdisks");
    std::fs::create_dir_all(&dir).map_err(io_err(format!("creating {}", dir.display())))?;
    let disk = dir.join(format!("{key}.erofs"));
    if disk.exists() {
        return Ok(disk);
    }
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dir.join(format!("{key}.lock")))
        .map_err(io_err("opening the image disk's lock"))?;
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive)
        .map_err(|e| BackendError::internal(format!("locking the image disk: {e}")))?;
    if disk.exists() {
        return Ok(disk); // built meanwhile
    }
    // One tree of all layers (whiteouts applied), then one EROFS file of it; uncompressed: a
    // guest under TCG reads it faster than it decompresses.
    let tree = match layers {
        [one] => store.layer_rootfs(one),
        _ => {
            let merged = opendsec_images::merge::merge_layers(store, layers, &[])
                .map_err(|e| BackendError::internal(format!("flattening the image's layers: {e}")))?;
            store.layer_rootfs(&merged.id)
        }
    };
    let tmp = dir.join(format!(".{key}.tmp{}", rand::random::<u32>()));
    // Padded to whole 2 MiB: a full VM maps it as virtio-pmem, whose size must be aligned
    // (EROFS ignores what follows its last block).
    let built = run(Command::new("mkfs.erofs").arg("-T0").arg(&tmp).arg(&tree)).and_then(|()| {
        let f = std::fs::OpenOptions::new().write(true).open(&tmp).map_err(io_err("opening the image disk"))?;
        let len = f.metadata().map_err(io_err("sizing the image disk"))?.len();
        f.set_len(len.next_multiple_of(2 << 20)).map_err(io_err("padding the image disk"))
    });
    if let Err(e) = built {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    std::fs::rename(&tmp, &disk).map_err(io_err("placing the image disk"))?;
    Ok(disk)
}

/// A sparse ext4 file of `mb` MiB at `path`.
pub fn writable_disk(path: &Path, mb: u64) -> Result<(), BackendError> {
    reserve(path, mb)?;
    run(Command::new("mkfs.ext4")
        .args(["-q", "-F", "-m", "0", "-E", "lazy_itable_init=1,lazy_journal_init=1,nodiscard"])
        .arg(path))?;
    // mke2fs zeroes parts of a file by punching holes: allocated again.
    allocate(
        &std::fs::OpenOptions::new().write(true).open(path).map_err(io_err("opening the writable disk"))?,
        path,
        mb,
    )
}

/// Creates `path` with `mb` MiB allocated on the host's disk (unwritten extents: no data
/// written, the space held), so that a VM filling its disk or its memory cannot run the host's
/// file system out of space later; a host without the room fails now, with `no_capacity`.
pub fn reserve(path: &Path, mb: u64) -> Result<(), BackendError> {
    let f = std::fs::File::create(path).map_err(io_err(format!("creating {}", path.display())))?;
    allocate(&f, path, mb)
}

/// Allocates `mb` MiB for the existing file at `path` (its data kept; see [`reserve`]).
pub fn reserve_existing(path: &Path, mb: u64) -> Result<(), BackendError> {
    let f =
        std::fs::OpenOptions::new().write(true).open(path).map_err(io_err(format!("opening {}", path.display())))?;
    allocate(&f, path, mb)
}

/// Copies the first `len` bytes of `src` into a new file `dst` of exactly `len` bytes, data
/// only: holes stay holes and pages of zeros become holes (a VM's disk or memory is mostly
/// either); what `src` holds beyond `len` is left out, and a shorter `src` reads as zeros
/// beyond its end. The length is the caller's (a VM's shape), never the file's: a VMM holds
/// its files open for writing and could make them any size. Returns the bytes of data
/// written. Not synced: a caller that needs the copy durable syncs it (a snapshot is, once
/// its VM runs again).
pub fn copy_sparse(src: &Path, dst: &Path, len: u64) -> Result<u64, BackendError> {
    use std::os::unix::fs::FileExt;
    const PAGE: usize = 4096;
    const CHUNK: usize = 1 << 20;
    let from = std::fs::File::open(src).map_err(io_err(format!("opening {}", src.display())))?;
    let have = from.metadata().map_err(io_err(format!("reading {}", src.display())))?.len();
    let to = std::fs::File::create(dst).map_err(io_err(format!("creating {}", dst.display())))?;
    to.set_len(len).map_err(io_err(format!("sizing {}", dst.display())))?;
    let len = len.min(have);
    let mut buf = vec![0u8; CHUNK];
    let (mut at, mut written) = (0u64, 0u64);
    while at < len {
        // The next run of data (a file system without SEEK_DATA: all of it is data).
        let start = match rustix::fs::seek(&from, rustix::fs::SeekFrom::Data(at)) {
            Ok(p) => p,
            Err(rustix::io::Errno::NXIO) => break,
            Err(rustix::io::Errno::INVAL) => at,
            Err(e) => return Err(BackendError::internal(format!("seeking in {}: {e}", src.display()))),
        };
        let end = match rustix::fs::seek(&from, rustix::fs::SeekFrom::Hole(start)) {
            Ok(p) => p.min(len),
            Err(_) => len,
        };
        let mut off = start;
        while off < end {
            let n = (CHUNK as u64).min(end - off) as usize;
            from.read_exact_at(&mut buf[..n], off).map_err(io_err(format!("reading {}", src.display())))?;
            for (i, page) in buf[..n].chunks(PAGE).enumerate() {
                if page.iter().any(|&b| b != 0) {
                    to.write_all_at(page, off + (i * PAGE) as u64)
                        .map_err(io_err(format!("writing {}", dst.display())))?;
                    written += page.len() as u64;
                }
            }
            off += n as u64;
        }
        at = end.max(start + 1);
    }
    Ok(written)
}

fn allocate(f: &std::fs::File, path: &Path, mb: u64) -> Result<(), BackendError> {
    match rustix::fs::fallocate(f, rustix::fs::FallocateFlags::empty(), 0, mb << 20) {
        Ok(()) => Ok(()),
        Err(rustix::io::Errno::NOSPC) => {
            Err(BackendError::no_capacity(format!("the host's disk has no room for {mb} MiB more")))
        }
        // A file system that cannot allocate ahead (tmpfs can; some cannot): sparse.
        Err(rustix::io::Errno::OPNOTSUPP) => f.set_len(mb << 20).map_err(io_err("sizing a VM file")),
        Err(e) => Err(BackendError::internal(format!("reserving {}: {e}", path.display()))),
    }
}

/// The config disk: the length, the JSON, padded to whole sectors.
pub fn config_disk(path: &Path, json: &[u8]) -> Result<(), BackendError> {
    let mut raw = u32::try_from(json.len())
        .map_err(|_| BackendError::invalid_argument("the VM's config is too large"))?
        .to_le_bytes()
        .to_vec();
    raw.extend_from_slice(json);
    raw.resize(raw.len().div_ceil(4096) * 4096, 0);
    std::fs::write(path, raw).map_err(io_err(format!("writing {}", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpio_archive_lists_what_went_in() {
        let mut c = Cpio { out: Vec::new(), ino: 0 };
        c.entry("init", 0o100755, (0, 0), b"#!x").unwrap();
        c.entry("dev/console", 0o020600, (5, 1), &[]).unwrap();
        let out = c.finish().unwrap();
        assert_eq!(out.len() % 4, 0);
        // cpio(1) reads it back.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.cpio");
        std::fs::write(&p, &out).unwrap();
        let o = Command::new("sh").arg("-c").arg(format!("cpio -t < {} 2>/dev/null", p.display())).output().unwrap();
        assert!(o.status.success(), "cpio(1) is part of make setup");
        assert_eq!(String::from_utf8_lossy(&o.stdout), "init\ndev/console\n");
    }

    #[test]
    fn a_sparse_copy_keeps_the_data_and_leaves_zeros_out() {
        use std::os::unix::fs::{FileExt, MetadataExt};
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("src"), dir.path().join("dst"));
        let f = std::fs::File::create(&src).unwrap();
        f.set_len(64 << 20).unwrap();
        // Data at the start, in the middle (unaligned), a page of written zeros, and the end.
        f.write_all_at(b"head", 0).unwrap();
        f.write_all_at(&[7u8; 10_000], (20 << 20) + 123).unwrap();
        f.write_all_at(&[0u8; 8192], 30 << 20).unwrap();
        f.write_all_at(b"tail", (64 << 20) - 4).unwrap();
        f.sync_all().unwrap();
        let written = copy_sparse(&src, &dst, 64 << 20).unwrap();
        assert_eq!(std::fs::read(&src).unwrap(), std::fs::read(&dst).unwrap());
        // The non-zero pages only: "head", three pages of 7s, "tail".
        assert_eq!(written, 5 * 4096);
        let m = std::fs::metadata(&dst).unwrap();
        assert_eq!(m.len(), 64 << 20);
        assert!(m.blocks() * 512 <= 64 << 10, "{} bytes allocated", m.blocks() * 512);
        // The length is the caller's: what lies beyond is left out, a short file reads as zeros.
        assert_eq!(copy_sparse(&src, &dst, 4096).unwrap(), 4096);
        assert_eq!(std::fs::read(&dst).unwrap()[..4], *b"head");
        assert_eq!(std::fs::metadata(&dst).unwrap().len(), 4096);
        std::fs::File::create(&src).unwrap();
        assert_eq!(copy_sparse(&src, &dst, 8192).unwrap(), 0);
        assert_eq!(std::fs::read(&dst).unwrap(), vec![0u8; 8192]);
    }

    #[test]
    fn the_config_disk_is_whole_sectors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("c.img");
        config_disk(&p, b"{}").unwrap();
        let raw = std::fs::read(&p).unwrap();
        assert_eq!((raw.len(), &raw[..6]), (4096, &[2u8, 0, 0, 0, b'{', b'}'][..]));
    }
}
