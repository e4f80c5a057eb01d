//! Garbage collection of the image store (reference section 10, "GC").
//!
//! A layer is **referenced** when any of these names it:
//! - a manifest: every file under `images/` (including manifests still being written, the
//!   `.<tag>.<random>.tmp` files), read as a [`Manifest`];
//! - a snapshot record: `snapshots/<id>/record.json`, its `"layers"` array when present;
//! - a holder file `inuse/<holder>`: the layers a running sandbox (or anything else that must
//!   keep layers alive) uses.
//!
//! **The `inuse/<holder>` format.** One file per holder (an edge writes one per sandbox, named
//! `<edge>.<lease>`); its content is either a JSON array of layer ids
//! (`["<64 hex>", "sha256:<64 hex>"]`) or one layer id per line (blank lines and lines starting
//! with `#` are ignored). Writers replace it whole (temp file + rename) and remove it when the
//! holder is gone. Every reference is read **conservatively**: whatever the format, every
//! 64-hex-digit token in the file counts (likewise for a manifest or record that does not
//! parse), so a half-written, mixed or unknown file keeps more layers, never fewer. A holder
//! must write its file *before* it starts using the layers and then check they still exist
//! (GC may have decided on an older view of `inuse/`).
//!
//! Unreferenced layers are removed once their `meta.json` has not changed for `grace`, and
//! entries of `layers/.tmp/` (interrupted writes) once nothing in them has changed for `grace`
//! (ages use the later of mtime and ctime: unpacked files keep the image's old mtimes, but
//! their ctime is when they were written).
//!
//! **Running beside imports and creations.** A new layer is younger than `grace` until it is
//! referenced (an import registers its manifest well within `grace`). Registering an image
//! first [`touch_layer`]s every layer it names, then writes the manifest. GC removes a layer by
//! renaming `layers/<id>` into `layers/.tmp/` (so it vanishes whole, never half-deleted), then
//! looks at the moved `meta.json` again: if it changed since GC judged it (a register touched it
//! in between) the layer is renamed back; otherwise it is deleted. A touch that comes after the
//! rename fails, so that registration fails with `not_found` instead of naming a missing layer.
//! What remains: (1) while a layer is being put back it is absent for an instant, so a
//! creation that resolves it exactly then fails and is retried; (2) ages compare GC's clock with
//! the file server's timestamps, so their skew must be far below `grace`; (3) a holder that
//! starts using layers of an image deleted more than `grace` ago, between GC's reading of
//! `inuse/` and its removal, loses them (hence "write, then check").
//!
//! A VM snapshot (`snapshots/<id>/`, [`crate::vmsnap`]) is kept while a manifest names it
//! (its `vm_snapshot` field; in a file that does not parse as a manifest, every `vm-<32 hex>`
//! token counts: conservative, as for layers; a token elsewhere in a manifest, an env value
//! say, keeps nothing), and
//! otherwise removed once its record is older than `grace` (an edge writes the snapshot, then
//! the apiserver publishes its image, well within `grace`), renamed away first so it vanishes
//! whole. Interrupted snapshot writes (`snapshots/.tmp-*`, `.gone-*`) go after `grace` too.
//! A creation that resolved a snapshot's image just before the image was deleted may find the
//! snapshot gone and fail with `not_found`. While a snapshot exists its record's layers are
//! referenced (above), so its image disk can always be built.
//!
//! vmdisks and manifests are never removed here.

use std::collections::BTreeSet;
use std::fs;
use std::io;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::Serialize;

use crate::store::{ImageRef, LayerId, Manifest, Store, StoreError};

/// What one GC run found and did (in a dry run: would do).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GcReport {
    pub dry_run: bool,
    /// Distinct layer ids named by manifests, snapshot records and holders.
    pub referenced: usize,
    /// Referenced layers present in the store.
    pub kept: usize,
    /// Unreferenced layers still within the grace period.
    pub young: Vec<LayerId>,
    /// Unreferenced layers removed.
    pub removed: Vec<LayerId>,
    /// File bytes of the removed layers (from their meta.json).
    pub bytes_freed: u64,
    /// Stale entries of `layers/.tmp/` removed (interrupted writes).
    pub tmp_removed: Vec<String>,
    /// VM snapshots (`snapshots/<id>`) no manifest names any more, removed, and interrupted
    /// snapshot writes.
    pub snapshots_removed: Vec<String>,
    /// Layers referenced but not in the store (e.g. a manifest naming a missing layer).
    pub missing: Vec<LayerId>,
    /// Files read conservatively or entries skipped, for people.
    pub warnings: Vec<String>,
    /// Removals that failed; the run went on with the rest.
    pub errors: Vec<String>,
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> StoreError + '_ {
    move |source| StoreError::Io { path: path.to_path_buf(), source }
}

/// The later of a file's modification and status-change times.
fn changed_at(m: &fs::Metadata) -> SystemTime {
    let ctime = u64::try_from(m.ctime())
        .ok()
        .map(|s| SystemTime::UNIX_EPOCH + Duration::new(s, u32::try_from(m.ctime_nsec()).unwrap_or(0)))
        .unwrap_or(SystemTime::UNIX_EPOCH);
    match m.modified() {
        Ok(mtime) => mtime.max(ctime),
        Err(_) => ctime,
    }
}

/// How long ago `t` was, as of `now`; a time in the future is age zero (young).
fn age(now: SystemTime, t: SystemTime) -> Duration {
    now.duration_since(t).unwrap_or(Duration::ZERO)
}

/// Every 64-hex-digit token in `text` (bounded by non-hex characters): the conservative
/// reading of a reference file.
pub fn scan_layer_ids(text: &[u8]) -> Vec<LayerId> {
    let mut out = Vec::new();
    let is_hex = |c: u8| c.is_ascii_digit() || (b'a'..=b'f').contains(&c);
    let mut i = 0;
    while i < text.len() {
        if !is_hex(text[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < text.len() && (is_hex(text[i]) || text[i].is_ascii_hexdigit()) {
            i += 1;
        }
        if i - start == 64
            && let Ok(s) = std::str::from_utf8(&text[start..i])
            && let Ok(id) = LayerId::parse(s)
        {
            out.push(id);
        }
    }
    out
}

/// Parses an `inuse/<holder>` file: a JSON array of ids or one id per line. Strict: for writers
/// and tests; GC itself reads holders with [`scan_layer_ids`].
pub fn parse_inuse(text: &str) -> Result<Vec<LayerId>, StoreError> {
    let t = text.trim_start();
    if t.starts_with('[') {
        let ids: Vec<String> =
            serde_json::from_str(t).map_err(|source| StoreError::Corrupt { path: PathBuf::from("inuse"), source })?;
        return ids.iter().map(|s| LayerId::parse(s)).collect();
    }
    text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).map(LayerId::parse).collect()
}

/// Marks a layer as about to be referenced: sets its meta.json's mtime to now, so GC's grace
/// period starts again. `LayerNotFound` when the layer is not (or no longer) in the store.
pub fn touch_layer(store: &Store, id: &LayerId) -> Result<(), StoreError> {
    let p = store.layer_dir(id).join("meta.json");
    let f = match fs::OpenOptions::new().write(true).open(&p) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Err(StoreError::LayerNotFound(id.to_string())),
        Err(e) => return Err(StoreError::Io { path: p, source: e }),
    };
    f.set_modified(SystemTime::now()).map_err(io_err(&p))
}

/// Writes a manifest the way GC expects while it may run: the names are checked, every layer
/// it names is touched (`LayerNotFound` naming the first missing one), then the manifest is
/// written whole. The one way the apiserver registers images.
pub fn publish_manifest(store: &Store, m: &Manifest) -> Result<ImageRef, StoreError> {
    ImageRef::new(&m.project, &m.repo, &m.tag)?;
    for l in &m.layers {
        touch_layer(store, l)?;
    }
    store.write_manifest(m)
}

/// Reads one reference file: `parse` for its normal form; when that fails, every id token in
/// it (with a warning).
fn read_refs(
    path: &Path,
    parse: impl FnOnce(&[u8]) -> Option<Vec<LayerId>>,
    refs: &mut BTreeSet<LayerId>,
    warnings: &mut Vec<String>,
) -> Result<(), StoreError> {
    let bytes = match fs::read(path) {
        Ok(b) => b,
        // Removed between listing and reading (a manifest deleted, a holder gone): no reference.
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(StoreError::Io { path: path.to_path_buf(), source: e }),
    };
    match parse(&bytes) {
        Some(ids) => refs.extend(ids),
        None => {
            warnings.push(format!("{} does not parse; every layer id in it is kept", path.display()));
            refs.extend(scan_layer_ids(&bytes));
        }
    }
    Ok(())
}

fn read_dir_or_empty(dir: &Path) -> Result<Vec<fs::DirEntry>, StoreError> {
    match fs::read_dir(dir) {
        Ok(rd) => rd.collect::<Result<Vec<_>, _>>().map_err(io_err(dir)),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(StoreError::Io { path: dir.to_path_buf(), source: e }),
    }
}

/// Every layer id the store's manifests, snapshot records and holders name. Fails when any of
/// them cannot be read (GC must not decide on a partial view).
pub fn referenced_layers(store: &Store, warnings: &mut Vec<String>) -> Result<BTreeSet<LayerId>, StoreError> {
    let mut refs = BTreeSet::new();
    let root = store.root();

    // Manifests: every regular file below images/.
    let mut stack = vec![root.join("images")];
    while let Some(dir) = stack.pop() {
        for e in read_dir_or_empty(&dir)? {
            let path = e.path();
            let ft = e.file_type().map_err(io_err(&path))?;
            if ft.is_dir() {
                stack.push(path);
            } else if ft.is_file() {
                read_refs(
                    &path,
                    |b| serde_json::from_slice::<Manifest>(b).ok().map(|m| m.layers),
                    &mut refs,
                    warnings,
                )?;
            }
        }
    }

    // Snapshot records.
    for e in read_dir_or_empty(&root.join("snapshots"))? {
        let record = e.path().join("record.json");
        if !record.exists() {
            continue;
        }
        read_refs(
            &record,
            |b| {
                let v: serde_json::Value = serde_json::from_slice(b).ok()?;
                match v.get("layers") {
                    None => Some(Vec::new()),
                    Some(serde_json::Value::Array(items)) => items
                        .iter()
                        .map(|i| i.as_str().and_then(|s| LayerId::parse(s).ok()))
                        .collect::<Option<Vec<_>>>(),
                    Some(_) => None,
                }
            },
            &mut refs,
            warnings,
        )?;
    }

    // Holders: always read by token, whatever their form.
    for e in read_dir_or_empty(&root.join("inuse"))? {
        let path = e.path();
        if e.file_type().map_err(io_err(&path))?.is_file() {
            read_refs(&path, |b| Some(scan_layer_ids(b)), &mut refs, warnings)?;
        }
    }
    Ok(refs)
}

/// Every `vm-<32 hex>` token in `text`: the conservative reading of a manifest's snapshot.
pub fn scan_snapshot_ids(text: &[u8]) -> Vec<String> {
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = text[i..].windows(3).position(|w| w == b"vm-") {
        let start = i + at;
        let hex = &text[start + 3..];
        let n = hex.iter().take_while(|b| b.is_ascii_hexdigit()).count();
        let bounded = start == 0 || !text[start - 1].is_ascii_alphanumeric();
        if n == 32 && bounded {
            out.push(String::from_utf8_lossy(&text[start..start + 35]).into_owned());
        }
        i = start + 3;
    }
    out
}

/// The VM snapshots manifests name. Fails when a manifest cannot be read.
fn referenced_snapshots(store: &Store) -> Result<BTreeSet<String>, StoreError> {
    let mut refs = BTreeSet::new();
    let mut stack = vec![store.root().join("images")];
    while let Some(dir) = stack.pop() {
        for e in read_dir_or_empty(&dir)? {
            let path = e.path();
            let ft = e.file_type().map_err(io_err(&path))?;
            if ft.is_dir() {
                stack.push(path);
            } else if ft.is_file() {
                // The manifest's own field; a file that does not parse is read by token.
                match fs::read(&path) {
                    Ok(b) => match serde_json::from_slice::<Manifest>(&b) {
                        Ok(m) if m.vm_snapshot.is_empty() => {}
                        Ok(m) => {
                            refs.insert(m.vm_snapshot);
                        }
                        Err(_) => refs.extend(scan_snapshot_ids(&b)),
                    },
                    Err(err) if err.kind() == io::ErrorKind::NotFound => {}
                    Err(err) => return Err(StoreError::Io { path, source: err }),
                }
            }
        }
    }
    Ok(refs)
}

/// Removes VM snapshots no manifest names, older than `grace`, and stale interrupted writes.
fn collect_snapshots(store: &Store, grace: Duration, now: SystemTime, report: &mut GcReport) -> Result<(), StoreError> {
    let refs = referenced_snapshots(store)?;
    let dir = store.root().join("snapshots");
    for e in read_dir_or_empty(&dir)? {
        let name = e.file_name().to_string_lossy().into_owned();
        let path = e.path();
        let stale = if name.starts_with(".tmp-") || name.starts_with(".gone-") {
            tree_is_stale(&path, grace, now)
        } else if crate::vmsnap::check_id(&name).is_ok() {
            // Judged by its record (or, without one, by the directory itself).
            let m = fs::symlink_metadata(path.join(crate::vmsnap::RECORD)).or_else(|_| fs::symlink_metadata(&path));
            !refs.contains(&name) && m.is_ok_and(|m| age(now, changed_at(&m)) >= grace)
        } else {
            false
        };
        if !stale {
            continue;
        }
        if !report.dry_run {
            let grave = dir.join(format!(".gone-{}", graveyard_name("snapshot")));
            let removed = if name.starts_with('.') {
                remove_any(&path)
            } else {
                fs::rename(&path, &grave).and_then(|()| remove_any(&grave))
            };
            match removed {
                Ok(()) => tracing::info!(snapshot = %name, "gc removed a vm snapshot"),
                Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
                Err(err) => {
                    report.errors.push(format!("{}: {err}", path.display()));
                    continue;
                }
            }
        }
        report.snapshots_removed.push(name);
    }
    report.snapshots_removed.sort();
    Ok(())
}

/// Whether nothing in the tree at `path` (not following symlinks) changed within `grace`.
/// Stops at the first young entry. Entries that vanish while walking are skipped; any other
/// error counts as young (keep what cannot be judged).
fn tree_is_stale(path: &Path, grace: Duration, now: SystemTime) -> bool {
    let mut stack = vec![path.to_path_buf()];
    while let Some(p) = stack.pop() {
        let m = match fs::symlink_metadata(&p) {
            Ok(m) => m,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(_) => return false,
        };
        if age(now, changed_at(&m)) < grace {
            return false;
        }
        if m.is_dir() {
            match fs::read_dir(&p) {
                Ok(rd) => {
                    for e in rd {
                        match e {
                            Ok(e) => stack.push(e.path()),
                            Err(_) => return false,
                        }
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(_) => return false,
            }
        }
    }
    true
}

/// The (mtime, ctime) stamp of a file, to notice a change between two looks.
fn stamp(m: &fs::Metadata) -> (i64, i64, i64, i64) {
    (m.mtime(), m.mtime_nsec(), m.ctime(), m.ctime_nsec())
}

fn graveyard_name(what: &str) -> String {
    format!("gc-{what}-{:016x}", rand::random::<u64>())
}

/// Removes a directory tree, or a file or symlink (never following it).
fn remove_any(path: &Path) -> io::Result<()> {
    if fs::symlink_metadata(path)?.is_dir() { fs::remove_dir_all(path) } else { fs::remove_file(path) }
}

/// What happened to one unreferenced, old layer.
enum Removal {
    Removed,
    /// Touched between the check and the rename: put back.
    Revived,
    Vanished,
}

/// Removes one layer safely (see the module doc): rename out of `layers/`, look again, then
/// delete or put back.
fn remove_layer(store: &Store, id: &LayerId, judged: (i64, i64, i64, i64)) -> Result<Removal, StoreError> {
    let dir = store.layer_dir(id);
    let grave = store.tmp_dir().join(graveyard_name(&id.as_str()[..12]));
    match fs::rename(&dir, &grave) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Removal::Vanished),
        Err(e) => return Err(StoreError::Io { path: dir, source: e }),
    }
    let now_stamp = fs::symlink_metadata(grave.join("meta.json")).map(|m| stamp(&m)).ok();
    if now_stamp.is_some_and(|s| s != judged) {
        // A register touched it after we judged it: it is about to be referenced.
        match fs::rename(&grave, &dir) {
            Ok(()) => return Ok(Removal::Revived),
            // An identical layer was imported meanwhile (content-addressed): ours is surplus.
            Err(_) if store.has_layer(id) => {}
            Err(e) => return Err(StoreError::Io { path: dir, source: e }),
        }
    }
    remove_any(&grave).map_err(io_err(&grave))?;
    Ok(Removal::Removed)
}

/// Collects garbage: removes layers no manifest, snapshot record or holder names once their
/// meta.json is older than `grace`, and interrupted writes in `layers/.tmp/` older than `grace`.
/// With `dry_run` nothing changes; the report says what would go. Fails only when the
/// references cannot be read; failed removals are listed in `errors`.
pub fn gc(store: &Store, grace: Duration, now: SystemTime, dry_run: bool) -> Result<GcReport, StoreError> {
    let mut report = GcReport { dry_run, ..GcReport::default() };
    let refs = referenced_layers(store, &mut report.warnings)?;
    report.referenced = refs.len();

    let layers_dir = store.root().join("layers");
    let mut present = BTreeSet::new();
    for e in read_dir_or_empty(&layers_dir)? {
        let name = e.file_name().to_string_lossy().into_owned();
        if name == ".tmp" {
            continue;
        }
        let Ok(id) = LayerId::parse(&name) else {
            report.warnings.push(format!("layers/{name} is not a layer id; left alone"));
            continue;
        };
        if id.as_str() != name {
            report.warnings.push(format!("layers/{name} is not a canonical layer id; left alone"));
            continue;
        }
        present.insert(id.clone());
        if refs.contains(&id) {
            report.kept += 1;
            continue;
        }
        let meta_path = store.layer_dir(&id).join("meta.json");
        // A layer dir without meta.json is no layer (interrupted before the invariant held):
        // judged by the dir itself.
        let judged = match fs::symlink_metadata(&meta_path).or_else(|_| fs::symlink_metadata(e.path())) {
            Ok(m) => m,
            Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
            Err(err) => {
                report.errors.push(format!("{}: {err}", meta_path.display()));
                continue;
            }
        };
        if age(now, changed_at(&judged)) < grace {
            report.young.push(id);
            continue;
        }
        let size = store.layer_meta(&id).map(|m| m.size_bytes).unwrap_or(0);
        if dry_run {
            report.bytes_freed += size;
            report.removed.push(id);
            continue;
        }
        // Looked at again right before the removal: the first look may be a while ago on a
        // big store.
        let judged = match fs::symlink_metadata(&meta_path) {
            Ok(m) if age(now.max(SystemTime::now()), changed_at(&m)) >= grace => stamp(&m),
            Ok(_) => {
                report.young.push(id);
                continue;
            }
            Err(_) => stamp(&judged),
        };
        match remove_layer(store, &id, judged) {
            Ok(Removal::Removed) => {
                tracing::info!(layer = %id, bytes = size, "gc removed an unreferenced layer");
                report.bytes_freed += size;
                report.removed.push(id);
            }
            Ok(Removal::Revived) => report.young.push(id),
            Ok(Removal::Vanished) => {}
            Err(err) => report.errors.push(err.to_string()),
        }
    }
    report.missing = refs.difference(&present).cloned().collect();

    for e in read_dir_or_empty(&store.tmp_dir())? {
        let path = e.path();
        if !tree_is_stale(&path, grace, now) {
            continue;
        }
        let name = e.file_name().to_string_lossy().into_owned();
        if !dry_run {
            match remove_any(&path) {
                Ok(()) => tracing::info!(entry = %name, "gc removed an interrupted write"),
                Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
                Err(err) => {
                    report.errors.push(format!("{}: {err}", path.display()));
                    continue;
                }
            }
        }
        report.tmp_removed.push(name);
    }
    collect_snapshots(store, grace, now, &mut report)?;
    report.young.sort();
    report.removed.sort();
    report.tmp_removed.sort();
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::{ImageConfig, LayerMeta};

    const HOUR: Duration = Duration::from_secs(3600);

    fn id(n: u8) -> LayerId {
        LayerId::from_digest(&[n; 32])
    }

    fn layer(store: &Store, n: u8) -> LayerId {
        let p = store.begin_layer().unwrap();
        fs::create_dir(p.rootfs().join("d")).unwrap();
        fs::write(p.rootfs().join("d/f"), vec![n; 100]).unwrap();
        let meta = LayerMeta {
            v: 1,
            id: id(n),
            size_bytes: 100,
            entries: 2,
            created_at_ms: 1,
            source: "test".into(),
            diff_id: String::new(),
            lowers: vec![],
        };
        store.commit_layer(p, &meta).unwrap();
        id(n)
    }

    fn manifest(store: &Store, repo: &str, layers: Vec<LayerId>) {
        store
            .write_manifest(&Manifest {
                v: 1,
                project: "root".into(),
                repo: repo.into(),
                tag: "latest".into(),
                layers,
                config: ImageConfig::default(),
                created_at_ms: 1,
                source: "test".into(),
                vm_snapshot: String::new(),
            })
            .unwrap();
    }

    /// "Later": everything written by the test is older than the grace period by then.
    fn later() -> SystemTime {
        SystemTime::now() + 2 * HOUR
    }

    fn new_store() -> (tempfile::TempDir, Store) {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        (dir, store)
    }

    #[test]
    fn referenced_layers_stay_and_the_rest_goes_after_the_grace_period() {
        let (_d, store) = new_store();
        let by_manifest = layer(&store, 1);
        let by_snapshot = layer(&store, 2);
        let by_holder_json = layer(&store, 3);
        let by_holder_lines = layer(&store, 4);
        let garbage = layer(&store, 5);
        manifest(&store, "app", vec![by_manifest.clone()]);
        let snap = store.root().join("snapshots/snap-1");
        fs::create_dir_all(&snap).unwrap();
        fs::write(snap.join("record.json"), format!(r#"{{"v":1,"layers":["{}"]}}"#, by_snapshot.diff_id())).unwrap();
        // A snapshot record without layers names none.
        fs::create_dir_all(store.root().join("snapshots/snap-2")).unwrap();
        fs::write(store.root().join("snapshots/snap-2/record.json"), r#"{"v":1}"#).unwrap();
        fs::write(store.root().join("inuse/edge-1.abc"), format!(r#"["{by_holder_json}"]"#)).unwrap();
        fs::write(store.root().join("inuse/edge-1.def"), format!("# sandbox def\n{by_holder_lines}\n\n")).unwrap();

        // Within the grace period nothing goes.
        let r = gc(&store, HOUR, SystemTime::now(), false).unwrap();
        assert_eq!((r.kept, r.young.clone(), r.removed.len()), (4, vec![garbage.clone()], 0));

        let r = gc(&store, HOUR, later(), false).unwrap();
        assert_eq!(r.referenced, 4);
        assert_eq!(r.kept, 4);
        assert_eq!(r.removed, vec![garbage.clone()]);
        assert_eq!(r.bytes_freed, 100);
        assert!(r.errors.is_empty() && r.warnings.is_empty(), "{r:?}");
        for l in [&by_manifest, &by_snapshot, &by_holder_json, &by_holder_lines] {
            assert!(store.has_layer(l), "{l} was referenced");
        }
        assert!(!store.has_layer(&garbage));
        assert!(!store.layer_dir(&garbage).exists());
        assert_eq!(fs::read_dir(store.tmp_dir()).unwrap().count(), 0, "the removed layer left nothing behind");

        // Once the holder and the manifest are gone, their layers go too.
        fs::remove_file(store.root().join("inuse/edge-1.abc")).unwrap();
        store.delete_manifest(&crate::ImageRef::new("root", "app", "latest").unwrap()).unwrap();
        let r = gc(&store, HOUR, later(), false).unwrap();
        assert_eq!(r.removed, vec![by_manifest, by_holder_json]);
    }

    fn vm_snapshot(store: &Store, layers: Vec<LayerId>) -> String {
        let id = crate::vmsnap::new_id();
        let w = store.begin_vm_snapshot(&id).unwrap();
        fs::write(w.join(crate::vmsnap::STATE), b"s").unwrap();
        fs::write(w.join(crate::vmsnap::MEM), b"m").unwrap();
        fs::write(w.join(crate::vmsnap::DISK), b"d").unwrap();
        let rec = crate::vmsnap::VmSnapshotRecord {
            v: crate::vmsnap::VERSION,
            id: id.clone(),
            backend: "microvm".into(),
            vmm: "qemu".into(),
            layers,
            memory_mb: 128,
            cpus: 1,
            disk_mb: 64,
            net: false,
            source: "e.l".into(),
            created_at_ms: 1,
            bytes: 2,
        };
        store.commit_vm_snapshot(&w, &rec).unwrap();
        id
    }

    #[test]
    fn vm_snapshots_live_while_an_image_names_them_and_keep_their_layers() {
        let (_d, store) = new_store();
        let (under_named, under_unnamed) = (layer(&store, 1), layer(&store, 2));
        let named = vm_snapshot(&store, vec![under_named.clone()]);
        let unnamed = vm_snapshot(&store, vec![under_unnamed.clone()]);
        let m = Manifest {
            v: 1,
            project: "root".into(),
            repo: "forks/x".into(),
            tag: "1".into(),
            layers: vec![under_named.clone()],
            config: ImageConfig::default(),
            created_at_ms: 1,
            source: "snapshot:e.l".into(),
            vm_snapshot: named.clone(),
        };
        store.write_manifest(&m).unwrap();
        // A snapshot's id written elsewhere in a manifest (a tenant who learned it) keeps
        // nothing.
        let squatter = Manifest {
            repo: "squatter".into(),
            vm_snapshot: String::new(),
            config: ImageConfig { env: vec![format!("X={unnamed}")], ..Default::default() },
            ..m.clone()
        };
        store.write_manifest(&squatter).unwrap();
        // An interrupted write, and a name that is no snapshot's (left alone).
        let tmp = store.begin_vm_snapshot(&crate::vmsnap::new_id()).unwrap();
        fs::create_dir_all(store.root().join("snapshots/not-a-snapshot")).unwrap();

        // Within the grace period nothing goes: the unnamed one is being published.
        let r = gc(&store, HOUR, SystemTime::now(), false).unwrap();
        assert!(r.snapshots_removed.is_empty(), "{r:?}");
        let r = gc(&store, HOUR, later(), true).unwrap();
        assert_eq!(r.snapshots_removed.len(), 2, "a dry run says: {r:?}");
        assert!(store.has_vm_snapshot(&unnamed) && tmp.exists());

        let r = gc(&store, HOUR, later(), false).unwrap();
        let mut expect = vec![unnamed.clone(), tmp.file_name().unwrap().to_string_lossy().into_owned()];
        expect.sort();
        assert_eq!(r.snapshots_removed, expect);
        assert!(store.has_vm_snapshot(&named) && !store.has_vm_snapshot(&unnamed) && !tmp.exists());
        assert!(store.root().join("snapshots/not-a-snapshot").exists());
        // The removed snapshot's layers were referenced by it, so they go one run later.
        assert!(store.has_layer(&under_unnamed));
        let r = gc(&store, HOUR, later(), false).unwrap();
        assert_eq!(r.removed, vec![under_unnamed]);
        let left: Vec<_> =
            fs::read_dir(store.root().join("snapshots")).unwrap().flatten().map(|e| e.file_name()).collect();
        assert_eq!(left.len(), 2, "{left:?}");

        // Its image gone, the named one goes too.
        store.delete_manifest(&crate::ImageRef::new("root", "forks/x", "1").unwrap()).unwrap();
        let r = gc(&store, HOUR, later(), false).unwrap();
        assert_eq!(r.snapshots_removed, vec![named]);
    }

    #[test]
    fn snapshot_ids_are_read_from_any_text() {
        let id = "vm-0123456789abcdef0123456789abcdef";
        assert_eq!(scan_snapshot_ids(format!(r#"{{"vm_snapshot":"{id}"}}"#).as_bytes()), vec![id]);
        assert_eq!(scan_snapshot_ids(format!("{id}\nxvm-{}", &id[3..]).as_bytes()), vec![id]);
        assert!(scan_snapshot_ids(b"vm-0123").is_empty());
        assert!(scan_snapshot_ids(format!("{id}0").as_bytes()).is_empty(), "33 digits name no snapshot");
    }

    #[test]
    fn a_dry_run_changes_nothing() {
        let (_d, store) = new_store();
        let garbage = layer(&store, 7);
        let stale = store.tmp_dir().join("0123abcd");
        fs::create_dir_all(stale.join("rootfs")).unwrap();
        let r = gc(&store, HOUR, later(), true).unwrap();
        assert!(r.dry_run);
        assert_eq!(r.removed, vec![garbage.clone()]);
        assert_eq!(r.tmp_removed, vec!["0123abcd".to_string()]);
        assert!(store.has_layer(&garbage));
        assert!(stale.exists());
    }

    #[test]
    fn stale_interrupted_writes_go_and_fresh_ones_stay() {
        let (_d, store) = new_store();
        let pending = store.begin_layer().unwrap();
        fs::write(pending.rootfs().join("big"), b"half").unwrap();
        let r = gc(&store, HOUR, SystemTime::now(), false).unwrap();
        assert!(r.tmp_removed.is_empty());
        assert!(pending.dir().exists(), "a write in progress is left alone");
        let r = gc(&store, HOUR, later(), false).unwrap();
        assert_eq!(r.tmp_removed.len(), 1);
        assert!(!pending.dir().exists());
        drop(pending);
    }

    #[test]
    fn a_missing_layer_is_reported_and_unreadable_references_are_read_conservatively() {
        let (_d, store) = new_store();
        let kept = layer(&store, 1);
        // A holder file that is neither JSON nor lines of ids, and a corrupt manifest.
        fs::write(store.root().join("inuse/odd"), format!("sandbox x uses {kept}, {}", id(9))).unwrap();
        fs::create_dir_all(store.root().join("images/root/broken")).unwrap();
        fs::write(store.root().join("images/root/broken/latest.json"), format!("{{\"layers\": [\"{}", id(8))).unwrap();
        let r = gc(&store, HOUR, later(), false).unwrap();
        assert!(store.has_layer(&kept));
        assert_eq!(r.missing, vec![id(8), id(9)]);
        assert_eq!(r.warnings.len(), 1, "{:?}", r.warnings);
    }

    #[test]
    fn a_layer_touched_after_it_was_judged_is_put_back() {
        let (_d, store) = new_store();
        let l = layer(&store, 3);
        let judged = stamp(&fs::symlink_metadata(store.layer_dir(&l).join("meta.json")).unwrap());
        // A register touches it between GC's look and its rename.
        std::thread::sleep(Duration::from_millis(20));
        touch_layer(&store, &l).unwrap();
        assert!(matches!(remove_layer(&store, &l, judged).unwrap(), Removal::Revived));
        assert!(store.has_layer(&l));
        assert_eq!(fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
        // Touching a layer that is gone fails clearly.
        assert!(matches!(touch_layer(&store, &id(99)), Err(StoreError::LayerNotFound(_))));
    }

    #[test]
    fn inuse_files_parse_in_both_forms() {
        let a = id(1);
        let b = id(2);
        assert_eq!(parse_inuse(&format!(r#"["{a}", "{}"]"#, b.diff_id())).unwrap(), vec![a.clone(), b.clone()]);
        assert_eq!(parse_inuse(&format!("{a}\n# comment\n\n{}\n", b.diff_id())).unwrap(), vec![a.clone(), b]);
        assert!(parse_inuse("not-an-id\n").is_err());
        assert_eq!(scan_layer_ids(format!("x{a}y").as_bytes()), vec![a.clone()]);
        assert_eq!(scan_layer_ids(format!("f{a} {} {}", "f".repeat(65), "A".repeat(64)).as_bytes()), vec![]);
        assert_eq!(scan_layer_ids(format!("[\"sha256:{a}\"]").as_bytes()), vec![a]);
    }
}
