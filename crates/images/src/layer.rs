//! Importing one layer blob into the store: the entry point the registry and offline imports
//! call (blocking; run it in `spawn_blocking`).
//!
//! Flow: decompress ([`crate::decompress`]) → hash the uncompressed tar while reading it →
//! unpack it safely into a pending layer ([`crate::unpack`]) → compare the hash with the
//! expected diff id → expand opaque directories against the layers below
//! ([`crate::overlay`]) → one `syncfs` → commit (rename into place).
//!
//! Invariants: nothing is left in the store when an import fails (the pending layer is removed
//! on drop); a layer is committed only after its digest matched; layer ids are content
//! addresses:
//! - a layer without opaque directories has id = its diff id (sha256 of the uncompressed tar);
//! - a layer with opaque directories depends on the layers below it (the expansion writes a
//!   whiteout for every name visible below), so its id is the sha256 of
//!   `"opaque\n" + <diff id hex> + "\n" + <lower id hex, bottom first, joined by "\n">`.
//!
//! Durability: files are not fsynced one by one (far too slow for layers of 10k files,
//! especially on NFS); one `syncfs` of the store's file system after the layer is written
//! flushes every file and directory before the rename makes the layer visible. On NFS, close()
//! already commits each file to the server (close-to-open consistency), and `syncfs` flushes
//! what remains.

use std::io::Read;

use sha2::{Digest, Sha256};

use crate::overlay::{self, LayerStack};
use crate::store::{LayerId, LayerMeta, Store, StoreError};
use crate::unpack;

pub use crate::decompress::Compression;
pub use crate::limits::{LayerError, Limits};

/// The id of a layer with opaque directories unpacked from the tar with this diff id on top of
/// `lowers` (bottom first).
pub fn opaque_layer_id(diff_id: &LayerId, lowers: &[LayerId]) -> LayerId {
    let mut h = Sha256::new();
    h.update(b"opaque\n");
    h.update(diff_id.as_str().as_bytes());
    h.update(b"\n");
    let lower: Vec<&str> = lowers.iter().map(LayerId::as_str).collect();
    h.update(lower.join("\n").as_bytes());
    LayerId::from_digest(&h.finalize().into())
}

/// The id a layer with this diff id would have on top of `lowers` if it is already stored
/// (checked before anything is downloaded): the diff id itself, or the opaque-expanded id.
pub fn existing_layer(store: &Store, diff_id: &str, lowers: &[LayerId]) -> Option<LayerId> {
    let diff = LayerId::parse(diff_id).ok()?;
    if store.has_layer(&diff) {
        return Some(diff);
    }
    let opaque = opaque_layer_id(&diff, lowers);
    store.has_layer(&opaque).then_some(opaque)
}

/// Decompresses, hashes (the uncompressed stream must hash to `expected_diff_id` when given)
/// and safely unpacks one layer tar into a pending layer, expands opaque directories against
/// `lowers` (bottom first, all in the store), and commits it. Returns its meta. On any error
/// nothing is left in the store. The blob is always read and checked, even for a layer already
/// stored (whose meta is then returned and the new copy dropped): callers skip a stored layer
/// themselves when they may ([`existing_layer`]), so nothing is taken as stored on a digest's
/// word alone.
/// `compression` is what the image declares; the blob's magic bytes decide (registries
/// sometimes mislabel layers), which the diff id check keeps safe.
pub fn import_layer(
    store: &Store,
    blob: &mut dyn Read,
    compression: Compression,
    expected_diff_id: Option<&str>,
    lowers: &[LayerId],
    limits: &Limits,
    source: &str,
) -> Result<LayerMeta, LayerError> {
    let expected = expected_diff_id.map(LayerId::parse).transpose()?;
    for l in lowers {
        if !store.has_layer(l) {
            return Err(StoreError::LayerNotFound(l.to_string()).into());
        }
    }
    let pending = store.begin_layer()?;
    let mut unpacked = unpack::unpack(&pending.rootfs(), blob, compression, limits)?;
    let diff_id = unpacked.diff_id.clone();
    if let Some(want) = expected
        && want != diff_id
    {
        return Err(LayerError::DigestMismatch { expected: want.diff_id(), actual: diff_id.diff_id() });
    }
    let opaque = !unpacked.expand.is_empty();
    let id = if opaque { opaque_layer_id(&diff_id, lowers) } else { diff_id.clone() };
    if store.has_layer(&id) {
        // Imported meanwhile by someone else (or no digest was given up front).
        return Ok(store.layer_meta(&id)?);
    }
    if opaque {
        let below = LayerStack::from_store(store, lowers)?;
        for dir in &unpacked.expand {
            unpacked.entries += overlay::expand_opaque(unpacked.root(), &pending.rootfs(), dir, &below)?;
        }
    }
    unpacked.finish()?;
    let meta = LayerMeta {
        v: 1,
        id,
        size_bytes: unpacked.size_bytes,
        entries: unpacked.entries,
        created_at_ms: opendsec_common::time::now_ms(),
        source: source.to_string(),
        diff_id: diff_id.diff_id(),
        lowers: if opaque { lowers.to_vec() } else { Vec::new() },
    };
    store.commit_layer(pending, &meta)?;
    tracing::debug!(layer = %meta.id, entries = meta.entries, bytes = meta.size_bytes, opaque, "layer imported");
    Ok(meta)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opaque_ids_depend_on_the_lowers() {
        let d = LayerId::from_digest(&[1; 32]);
        let a = LayerId::from_digest(&[2; 32]);
        let b = LayerId::from_digest(&[3; 32]);
        assert_ne!(opaque_layer_id(&d, std::slice::from_ref(&a)), opaque_layer_id(&d, std::slice::from_ref(&b)));
        assert_ne!(opaque_layer_id(&d, &[a.clone(), b.clone()]), opaque_layer_id(&d, &[b.clone(), a.clone()]));
        assert_ne!(opaque_layer_id(&d, &[]), d);
        // Golden: the exact bytes hashed are part of the store format.
        let mut h = Sha256::new();
        h.update(format!("opaque\n{d}\n{a}\n{b}"));
        assert_eq!(opaque_layer_id(&d, &[a, b]), LayerId::from_digest(&h.finalize().into()));
    }

    #[test]
    fn existing_layer_checks_both_ids() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let d = LayerId::from_digest(&[1; 32]);
        let low = LayerId::from_digest(&[2; 32]);
        assert_eq!(existing_layer(&store, &d.diff_id(), std::slice::from_ref(&low)), None);
        assert_eq!(existing_layer(&store, "not a digest", &[]), None);
        let put = |id: &LayerId| {
            let p = store.begin_layer().unwrap();
            let meta = LayerMeta {
                v: 1,
                id: id.clone(),
                size_bytes: 0,
                entries: 0,
                created_at_ms: 1,
                source: "t".into(),
                diff_id: d.diff_id(),
                lowers: vec![],
            };
            store.commit_layer(p, &meta).unwrap();
        };
        let opaque = opaque_layer_id(&d, std::slice::from_ref(&low));
        put(&opaque);
        assert_eq!(existing_layer(&store, &d.diff_id(), std::slice::from_ref(&low)), Some(opaque));
        assert_eq!(existing_layer(&store, &d.diff_id(), &[]), None);
        put(&d);
        assert_eq!(existing_layer(&store, d.as_str(), &[]), Some(d));
    }
}
