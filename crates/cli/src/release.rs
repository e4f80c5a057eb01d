//! `opendsecctl release pack`: the release tarball an operator installs on each host
//! (docs/operations.md): the two binaries, the static agent, the systemd units, one example
//! config per role, the operations guide, and `SHA256SUMS` (`sha256sum -c` checks it).
//!
//! The units, configs and guide are compiled into this binary from `deploy/` and `docs/`, so
//! a tarball always carries the ones of the release it was built from. Entries have fixed
//! owners (root) and times (the epoch): packing the same binaries twice gives the same bytes.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Subcommand;
use sha2::{Digest, Sha256};

use opendsec_images::registry::manifest::hex;

use crate::error::CtlError;
use crate::output::Out;

#[derive(Subcommand, Debug)]
pub enum ReleaseCmd {
    /// Build the release tarball from the binaries beside this one.
    #[command(
        after_help = "Example (after `cargo build --release -p opendsec-cli && make agent`):\n  target/release/opendsecctl release pack --out opendsec.tar.gz"
    )]
    Pack {
        /// The tarball to write (default opendsec-<version>-x86_64-linux.tar.gz here).
        #[arg(long)]
        out: Option<PathBuf>,
        /// The static agent (default: found as the edge finds it, beside this binary or in
        /// cargo's static target directory).
        #[arg(long)]
        agent: Option<PathBuf>,
    },
}

/// The files compiled in: (path in the tarball, content).
pub const DEPLOY_FILES: &[(&str, &str)] = &[
    ("systemd/opendsec-iam.service", include_str!("../../../deploy/systemd/opendsec-iam.service")),
    ("systemd/opendsec-apiserver.service", include_str!("../../../deploy/systemd/opendsec-apiserver.service")),
    ("systemd/opendsec-watcher.service", include_str!("../../../deploy/systemd/opendsec-watcher.service")),
    ("systemd/opendsec-edge.service", include_str!("../../../deploy/systemd/opendsec-edge.service")),
    ("systemd/opendsec-e2b.service", include_str!("../../../deploy/systemd/opendsec-e2b.service")),
    ("config/iam.json", include_str!("../../../deploy/config/iam.json")),
    ("config/apiserver.json", include_str!("../../../deploy/config/apiserver.json")),
    ("config/watcher.json", include_str!("../../../deploy/config/watcher.json")),
    ("config/edge.json", include_str!("../../../deploy/config/edge.json")),
    ("config/e2b.json", include_str!("../../../deploy/config/e2b.json")),
    ("README.md", include_str!("../../../deploy/README.md")),
    ("operations.md", include_str!("../../../docs/operations.md")),
];

pub fn run(out: &Out, cmd: ReleaseCmd) -> Result<(), CtlError> {
    let ReleaseCmd::Pack { out: path, agent } = cmd;
    let version = env!("CARGO_PKG_VERSION");
    let top = format!("opendsec-{version}");
    let path = path.unwrap_or_else(|| PathBuf::from(format!("{top}-x86_64-linux.tar.gz")));

    let me = std::env::current_exe().map_err(|e| local(format!("cannot find the running executable: {e}")))?;
    let dir = me.parent().unwrap_or(Path::new("/"));
    let agent = match agent {
        Some(a) => a,
        None => opendsec_cluster::agent_path(&Default::default()).map_err(|e| local(e.to_string()))?,
    };
    let read = |p: &Path| std::fs::read(p).map_err(|e| local(format!("{}: {e}", p.display())));
    let agent_bytes = read(&agent)?;
    opendsec_edge::backend::container::check_static_elf(&agent_bytes)
        .map_err(|why| local(format!("{}: the agent must be static: {why}", agent.display())))?;
    let mut files: Vec<(String, Vec<u8>, u32)> = vec![
        ("bin/opendsec".into(), read(&dir.join("opendsec"))?, 0o755),
        ("bin/opendsecctl".into(), read(&me)?, 0o755),
        ("lib/opendsec-agent".into(), agent_bytes, 0o755),
    ];
    for (name, text) in DEPLOY_FILES {
        files.push(((*name).into(), text.as_bytes().to_vec(), 0o644));
    }
    let sums: String =
        files.iter().map(|(name, data, _)| format!("{}  {name}\n", hex(&Sha256::digest(data)))).collect();
    files.push(("SHA256SUMS".into(), sums.into_bytes(), 0o644));

    // Written beside the target under a new name (never through a file or link already
    // there) and renamed: a failed pack leaves no half tarball.
    let tmp = path.with_extension("partial");
    let write = || -> std::io::Result<()> {
        let f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        let gz = flate2::write::GzEncoder::new(std::io::BufWriter::new(f), flate2::Compression::default());
        let mut tar = tar::Builder::new(gz);
        let mut dirs: Vec<String> = vec![String::new()];
        for (name, _, _) in &files {
            if let Some((d, _)) = name.rsplit_once('/')
                && !dirs.iter().any(|x| x == d)
            {
                dirs.push(d.to_string());
            }
        }
        for d in &dirs {
            let mut h = header(tar::EntryType::Directory, 0o755, 0);
            let p = if d.is_empty() { format!("{top}/") } else { format!("{top}/{d}/") };
            tar.append_data(&mut h, p, std::io::empty())?;
        }
        for (name, data, mode) in &files {
            let mut h = header(tar::EntryType::Regular, *mode, data.len() as u64);
            tar.append_data(&mut h, format!("{top}/{name}"), data.as_slice())?;
        }
        let gz = tar.into_inner()?;
        let mut w = gz.finish()?;
        w.flush()?;
        w.into_inner().map_err(|e| e.into_error())?.sync_all()
    };
    if let Err(e) = write() {
        if e.kind() != std::io::ErrorKind::AlreadyExists {
            let _ = std::fs::remove_file(&tmp);
        }
        return Err(local(format!("{}: {e}", tmp.display())));
    }
    if let Err(e) = std::fs::rename(&tmp, &path) {
        let _ = std::fs::remove_file(&tmp);
        return Err(local(format!("{}: {e}", path.display())));
    }
    // The rename itself made durable.
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::File::open(parent).and_then(|d| d.sync_all()).map_err(|e| local(format!("{}: {e}", parent.display())))?;
    let listed: Vec<&str> = files.iter().map(|(n, _, _)| n.as_str()).collect();
    out.print(serde_json::json!({"tarball": path.display().to_string(), "files": listed}), || {
        format!("wrote {} ({} files)", path.display(), files.len())
    });
    Ok(())
}

fn header(kind: tar::EntryType, mode: u32, size: u64) -> tar::Header {
    let mut h = tar::Header::new_gnu();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h
}

fn local(message: String) -> CtlError {
    CtlError::Local(message)
}
