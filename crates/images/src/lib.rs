//! The image store: one directory every edge and apiserver mounts (NFS, CephFS or JuiceFS in
//! production; a local folder by default). Layout (reference section 10):
//!
//! ```text
//! <root>/layers/<id>/rootfs/...          a layer in overlay format (whiteouts: 0:0 char devices)
//! <root>/layers/<id>/meta.json           written last inside the temporary dir: a layer exists
//!                                        exactly when layers/<id>/meta.json does
//! <root>/layers/.tmp/<random>/           layers being written (GC removes stale ones)
//! <root>/images/<project>/<repo>/<tag>.json   manifests (repo '/' stored as '+')
//! <root>/snapshots/<id>/                 microVM memory snapshots (`vmsnap`)
//! <root>/vmdisks/<key>.erofs             microVM image disks (built by the edge's VM backend)
//! <root>/inuse/<holder>                  layer ids used by a running sandbox (for GC)
//! ```
//!
//! Invariants: layers and manifests are immutable and appear whole (written to a temporary
//! place, then renamed into place); layers are content-addressed by the sha256 of their
//! uncompressed tar (the OCI diff id), so a layer already in the store is never fetched or
//! unpacked again; nothing from an image is trusted (see `unpack`).

#![forbid(unsafe_code)]

pub mod compose;
pub mod decompress;
pub mod gc;
pub mod import;
pub mod layer;
pub mod limits;
pub mod merge;
pub mod offline;
pub mod overlay;
pub mod progress;
pub mod registry;
pub mod snapshot;
pub mod store;
pub mod storecheck;
pub mod unpack;
pub mod vmsnap;

pub use store::{ImageConfig, ImageRef, LayerId, LayerMeta, Manifest, Store, StoreError};
