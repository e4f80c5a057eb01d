//! What the registry client, its token dance, the documents it reads and the references it
//! parses can fail with. Messages never hold credentials; URLs in them are redacted.
use std::path::PathBuf;
use std::time::Duration;

use opendsec_common::reason::error_chain;

#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("invalid image reference {reference:?}: {why}")]
    InvalidReference { reference: String, why: &'static str },
    #[error("manifest {reference} not found")]
    ManifestNotFound { reference: String },
    #[error("blob {digest} not found in {repository}")]
    BlobNotFound { repository: String, digest: String },
    #[error("not authorized by {registry}: {why}")]
    Unauthorized { registry: String, why: String },
    #[error("{url} answered HTTP {status}{}{}", code.as_ref().map(|c| format!(" {c}")).unwrap_or_default(), message.as_ref().map(|m| format!(": {m}")).unwrap_or_default())]
    Status { url: String, status: u16, code: Option<String>, message: Option<String> },
    #[error("{url} did not answer within {timeout:?}")]
    Timeout { url: String, timeout: Duration },
    #[error("request to {url} failed: {}", error_chain(source))]
    Http { url: String, source: reqwest::Error },
    #[error("{url}: more than {max} redirects")]
    TooManyRedirects { url: String, max: usize },
    #[error("{url}: bad redirect: {why}")]
    BadRedirect { url: String, why: &'static str },
    #[error("token service {realm}: {why}")]
    Token { realm: String, why: String },
    #[error("digest mismatch for {what}: expected {expected}, got {actual}")]
    DigestMismatch { what: String, expected: String, actual: String },
    #[error("{what}: expected {expected} bytes, got {actual}")]
    SizeMismatch { what: String, expected: u64, actual: u64 },
    #[error("{what} is {size} bytes, more than the limit of {limit}")]
    TooLarge { what: String, size: u64, limit: u64 },
    #[error("unsupported digest {0:?} (only sha256 is supported)")]
    UnsupportedDigest(String),
    #[error("{what} has unsupported media type {media_type:?}")]
    UnsupportedMediaType { what: String, media_type: String },
    #[error("{reference} has no linux/amd64 image (it has: {})", available.join(", "))]
    NoAmd64 { reference: String, available: Vec<String> },
    #[error("{what} is not valid: {why}")]
    InvalidManifest { what: String, why: String },
    #[error("{what} is not valid JSON: {source}")]
    Json { what: String, source: serde_json::Error },
    #[error("docker config {path}: {why}")]
    DockerConfig { path: PathBuf, why: String },
    #[error("credential helper {helper}: {why}")]
    CredentialHelper { helper: String, why: String },
    #[error("i/o error on {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
}
