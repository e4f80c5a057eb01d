//! Layers for the unpack, merge and import tests: tars built in code from entries (including
//! hostile ones, with headers written byte by byte), a model of what stacking them must show
//! (the OCI layer rules, independent of our code), snapshots of directory trees, and
//! read-only overlay mounts. Needs root (whiteouts are devices; overlay mounts).

use std::collections::BTreeMap;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use opendsec_images::layer::{Compression, LayerError, Limits, import_layer};
use opendsec_images::{LayerId, LayerMeta, Store};
use tar::{EntryType, Header};

/// One entry of a test layer, with the same meaning for the tar and for the model.
#[derive(Clone, Debug)]
pub enum E {
    Dir(&'static str, u32, u32, u32),
    File(&'static str, &'static [u8], u32, u32, u32),
    Symlink(&'static str, &'static str),
    Link(&'static str, &'static str),
    /// The path of the hidden name (written as `<dir>/.wh.<name>`).
    Whiteout(&'static str),
    /// A directory made opaque (written as `<dir>/.wh..wh..opq`).
    Opaque(&'static str),
    Fifo(&'static str),
    /// A file with PAX xattrs.
    XattrFile(&'static str, &'static [u8], &'static [(&'static str, &'static [u8])]),
}

fn split(p: &str) -> (&str, &str) {
    match p.rsplit_once('/') {
        Some((d, n)) => (d, n),
        None => ("", p),
    }
}

fn in_dir(d: &str, n: &str) -> String {
    if d.is_empty() { n.to_string() } else { format!("{d}/{n}") }
}

/// Appends an entry with exactly these path bytes (no checks: hostile paths welcome).
pub fn raw_entry(
    b: &mut tar::Builder<Vec<u8>>,
    path: &[u8],
    kind: EntryType,
    data: &[u8],
    link: Option<&[u8]>,
    mode: u32,
    mtime: u64,
) {
    let mut h = Header::new_gnu();
    h.set_entry_type(kind);
    h.set_size(data.len() as u64);
    h.set_mode(mode);
    h.set_mtime(mtime);
    h.set_uid(0);
    h.set_gid(0);
    let mut pax: Vec<(&str, &[u8])> = Vec::new();
    if path.len() <= 100 {
        h.as_old_mut().name[..path.len()].copy_from_slice(path);
    } else {
        pax.push(("path", path));
        h.as_old_mut().name[..4].copy_from_slice(b"long");
    }
    if let Some(l) = link {
        if l.len() <= 100 {
            h.as_old_mut().linkname[..l.len()].copy_from_slice(l);
        } else {
            pax.push(("linkpath", l));
        }
    }
    if !pax.is_empty() {
        b.append_pax_extensions(pax).unwrap();
    }
    h.set_cksum();
    b.append(&h, data).unwrap();
}

/// A tar of `entries`; every entry gets mtime `mtime0 + index`.
pub fn tar_of(entries: &[E], mtime0: u64) -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (i, e) in entries.iter().enumerate() {
        let t = mtime0 + i as u64;
        let mut h = Header::new_gnu();
        h.set_mtime(t);
        h.set_uid(0);
        h.set_gid(0);
        h.set_mode(0o644);
        h.set_size(0);
        match e {
            E::Dir(p, mode, uid, gid) => {
                h.set_entry_type(EntryType::Directory);
                h.set_mode(*mode);
                h.set_uid(*uid as u64);
                h.set_gid(*gid as u64);
                b.append_data(&mut h, format!("{p}/"), &[][..]).unwrap();
            }
            E::File(p, data, mode, uid, gid) => {
                h.set_entry_type(EntryType::Regular);
                h.set_mode(*mode);
                h.set_uid(*uid as u64);
                h.set_gid(*gid as u64);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, p, *data).unwrap();
            }
            E::XattrFile(p, data, xattrs) => {
                let keys: Vec<(String, &[u8])> =
                    xattrs.iter().map(|(k, v)| (format!("SCHILY.xattr.{k}"), *v)).collect();
                b.append_pax_extensions(keys.iter().map(|(k, v)| (k.as_str(), *v))).unwrap();
                h.set_entry_type(EntryType::Regular);
                h.set_size(data.len() as u64);
                b.append_data(&mut h, p, *data).unwrap();
            }
            E::Symlink(p, target) => {
                h.set_entry_type(EntryType::Symlink);
                h.set_mode(0o777);
                b.append_link(&mut h, p, target).unwrap();
            }
            E::Link(p, target) => {
                h.set_entry_type(EntryType::Link);
                b.append_link(&mut h, p, target).unwrap();
            }
            E::Whiteout(p) => {
                let (d, n) = split(p);
                h.set_entry_type(EntryType::Regular);
                b.append_data(&mut h, in_dir(d, &format!(".wh.{n}")), &[][..]).unwrap();
            }
            E::Opaque(d) => {
                h.set_entry_type(EntryType::Regular);
                b.append_data(&mut h, in_dir(d, ".wh..wh..opq"), &[][..]).unwrap();
            }
            E::Fifo(p) => {
                h.set_entry_type(EntryType::Fifo);
                b.append_data(&mut h, p, &[][..]).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

pub fn import(store: &Store, tar: &[u8], lowers: &[LayerId]) -> Result<LayerMeta, LayerError> {
    import_with(store, tar, Compression::None, lowers, &Limits::default())
}

pub fn import_with(
    store: &Store,
    blob: &[u8],
    c: Compression,
    lowers: &[LayerId],
    limits: &Limits,
) -> Result<LayerMeta, LayerError> {
    let mut r = blob;
    import_layer(store, &mut r, c, None, lowers, limits, "test")
}

/// Imports each layer on top of the previous ones; returns their ids, bottom first.
/// A fresh store in a temporary directory holding `layers` (bottom first), imported in order.
pub fn stored_stack(layers: &[(Vec<E>, u64)]) -> (tempfile::TempDir, Store, Vec<LayerId>) {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("store")).unwrap();
    let tars: Vec<Vec<u8>> = layers.iter().map(|(e, t)| tar_of(e, *t)).collect();
    let ids = import_stack(&store, &tars);
    (dir, store, ids)
}

pub fn import_stack(store: &Store, layers: &[Vec<u8>]) -> Vec<LayerId> {
    let mut ids = Vec::new();
    for t in layers {
        let meta = import(store, t, &ids).unwrap();
        ids.push(meta.id);
    }
    ids
}

/// What one path shows: type, mode bits, owner, mtime, and content (file bytes, symlink
/// target).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Node {
    pub kind: char,
    pub mode: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: i64,
    pub content: Vec<u8>,
}

impl Node {
    /// An overlay whiteout: a 0:0 character device.
    pub fn is_whiteout(&self) -> bool {
        self.kind == 'c' && self.content == 0u64.to_le_bytes()
    }
}

/// Every path below `root` (not the root itself), as `/`-joined relative strings.
pub fn snapshot(root: &Path) -> BTreeMap<String, Node> {
    fn walk(root: &Path, rel: &str, out: &mut BTreeMap<String, Node>) {
        let mut names: Vec<_> = std::fs::read_dir(root.join(rel)).unwrap().map(|e| e.unwrap().file_name()).collect();
        names.sort();
        for n in names {
            let r = in_dir(rel, n.to_str().unwrap());
            let p = root.join(&r);
            let m = std::fs::symlink_metadata(&p).unwrap();
            let ft = m.file_type();
            let (kind, content) = if ft.is_dir() {
                ('d', vec![])
            } else if ft.is_symlink() {
                ('l', std::fs::read_link(&p).unwrap().into_os_string().into_encoded_bytes())
            } else if ft.is_file() {
                ('f', std::fs::read(&p).unwrap())
            } else if ft.is_fifo() {
                ('p', vec![])
            } else if ft.is_char_device() {
                ('c', m.rdev().to_le_bytes().to_vec())
            } else {
                ('?', vec![])
            };
            let mode = if kind == 'l' { 0o777 } else { m.mode() & 0o7777 };
            out.insert(r.clone(), Node { kind, mode, uid: m.uid(), gid: m.gid(), mtime: m.mtime(), content });
            if kind == 'd' {
                walk(root, &r, out);
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(root, "", &mut out);
    out
}

/// What stacking the layers must show, by the OCI rules: in each layer, whiteouts and opaque
/// markers hide what the layers below put there, then the layer's entries are added in order
/// (a later entry replaces an earlier one; a directory over a directory keeps its content).
pub fn model(layers: &[(Vec<E>, u64)]) -> BTreeMap<String, Node> {
    let mut m: BTreeMap<String, Node> = BTreeMap::new();
    let remove_tree = |m: &mut BTreeMap<String, Node>, p: &str| {
        m.remove(p);
        let prefix = format!("{p}/");
        m.retain(|k, _| !k.starts_with(&prefix));
    };
    for (entries, mtime0) in layers {
        for e in entries {
            match e {
                E::Whiteout(p) => remove_tree(&mut m, p),
                E::Opaque(d) => {
                    let prefix = format!("{d}/");
                    m.retain(|k, _| !k.starts_with(&prefix));
                }
                _ => {}
            }
        }
        for (i, e) in entries.iter().enumerate() {
            let t = (*mtime0 + i as u64) as i64;
            let node = |kind, mode, uid, gid, content: &[u8]| Node {
                kind,
                mode,
                uid,
                gid,
                mtime: t,
                content: content.to_vec(),
            };
            match e {
                E::Dir(p, mode, uid, gid) => {
                    if m.get(*p).map(|n| n.kind) != Some('d') {
                        remove_tree(&mut m, p);
                    }
                    m.insert(p.to_string(), node('d', *mode, *uid, *gid, b""));
                }
                E::File(p, data, mode, uid, gid) => {
                    remove_tree(&mut m, p);
                    m.insert(p.to_string(), node('f', *mode, *uid, *gid, data));
                }
                E::XattrFile(p, data, _) => {
                    remove_tree(&mut m, p);
                    m.insert(p.to_string(), node('f', 0o644, 0, 0, data));
                }
                E::Symlink(p, target) => {
                    remove_tree(&mut m, p);
                    m.insert(p.to_string(), node('l', 0o777, 0, 0, target.as_bytes()));
                }
                E::Link(p, target) => {
                    let n = m.get(*target).cloned().expect("model: link target exists");
                    remove_tree(&mut m, p);
                    m.insert(p.to_string(), n);
                }
                E::Fifo(p) => {
                    remove_tree(&mut m, p);
                    m.insert(p.to_string(), node('p', 0o644, 0, 0, b""));
                }
                E::Whiteout(_) | E::Opaque(_) => {}
            }
        }
    }
    m
}

/// A read-only overlay mount of layer rootfs dirs (bottom first); unmounted on drop.
pub struct Overlay {
    pub dir: tempfile::TempDir,
    _empty: tempfile::TempDir,
}

impl Overlay {
    pub fn mount(lowers_bottom_first: &[PathBuf]) -> Overlay {
        let dir = tempfile::tempdir().unwrap();
        // Overlay needs two lower dirs when it has no upper one: an empty one at the bottom.
        let empty = tempfile::tempdir().unwrap();
        let mut l: Vec<String> = lowers_bottom_first.iter().rev().map(|p| p.display().to_string()).collect();
        l.push(empty.path().display().to_string());
        let st = Command::new("mount")
            .args(["-t", "overlay", "overlay", "-o", &format!("ro,lowerdir={}", l.join(":"))])
            .arg(dir.path())
            .status()
            .unwrap();
        assert!(st.success(), "mount -t overlay failed");
        Overlay { dir, _empty: empty }
    }

    pub fn of(store: &Store, ids: &[LayerId]) -> Overlay {
        Overlay::mount(&ids.iter().map(|i| store.layer_rootfs(i)).collect::<Vec<_>>())
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Overlay {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.dir.path()).status();
    }
}

/// Asserts two snapshots are equal, listing every difference.
pub fn assert_same(what: &str, got: &BTreeMap<String, Node>, want: &BTreeMap<String, Node>) {
    let mut diffs = Vec::new();
    for (p, w) in want {
        match got.get(p) {
            None => diffs.push(format!("missing {p}: want {w:?}")),
            Some(g) if g != w => diffs.push(format!("differs {p}: got {g:?}, want {w:?}")),
            Some(_) => {}
        }
    }
    for (p, g) in got {
        if !want.contains_key(p) {
            diffs.push(format!("unexpected {p}: {g:?}"));
        }
    }
    assert!(diffs.is_empty(), "{what}:\n{}", diffs.join("\n"));
}
