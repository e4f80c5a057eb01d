//! What one layer may hold ([`Limits`]) and why a layer is refused ([`LayerError`]): shared by
//! the unpacker, the opaque-directory expansion, merges and the layer import that drives them.
use std::path::PathBuf;

use crate::store::StoreError;

/// Bounds on what one layer may contain. Exceeding one fails the import with
/// [`LayerError::TooLarge`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Bytes of one regular file.
    pub max_file_bytes: u64,
    /// Bytes of file content in the layer, and of its uncompressed tar stream.
    pub max_layer_bytes: u64,
    /// Tar entries in the layer.
    pub max_entries: u64,
    /// Components of one path.
    pub max_depth: usize,
    /// Bytes of one path (and of a hard link's target).
    pub max_path_bytes: usize,
    /// Bytes of a whole image: its blobs as the manifest lists them (checked before anything
    /// is fetched) and its layers' contents as unpacked.
    pub max_image_bytes: u64,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_file_bytes: 8 << 30,
            max_layer_bytes: 64 << 30,
            max_entries: 2_000_000,
            max_depth: crate::store::MAX_PATH_DEPTH,
            max_path_bytes: 4096,
            max_image_bytes: 128 << 30,
        }
    }
}

/// Why a layer could not be imported or merged. Callers map these to reasons:
/// `InvalidLayer`, `DigestMismatch` and `TooLarge` are the image's fault (invalid_argument),
/// `Read` is the source's (unavailable, usually), `Io` and `Store` the store's.
#[derive(Debug, thiserror::Error)]
pub enum LayerError {
    /// Hostile or malformed content: the entry named and what was wrong with it (a path that
    /// escapes, a device file, a link outside, a corrupt compressed stream, a broken tar...).
    #[error("invalid layer: entry {path:?}: {why}")]
    InvalidLayer { path: String, why: String },
    /// The uncompressed tar does not hash to the diff id the image names.
    #[error("layer digest mismatch: expected {expected}, the uncompressed tar hashes to {actual}")]
    DigestMismatch { expected: String, actual: String },
    /// A configured [`Limits`] bound was exceeded.
    #[error("layer too large: entry {path:?}: more than {limit} {what}")]
    TooLarge { path: String, what: &'static str, limit: u64 },
    /// Reading the blob itself failed (the download or the file the caller passed).
    #[error("reading the layer blob failed: {source}")]
    Read { source: std::io::Error },
    /// Writing into or reading from the store failed.
    #[error("i/o error on {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error(transparent)]
    Store(#[from] StoreError),
    /// `merge_layers` was given no layers.
    #[error("a merge needs at least one layer")]
    EmptyMerge,
}
