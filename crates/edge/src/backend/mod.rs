//! The backend interface every isolation backend implements (reference section 5, "Backend
//! interface"): lifecycle calls on sandboxes described by their records, liveness, adoption
//! after an edge restart, and clean-up of leftovers no record claims.
//!
//! The edge calls a backend only under the sandbox's operation lock, so a backend never sees
//! two lifecycle calls for one sandbox at once; calls for different sandboxes run concurrently.
//!
//! Optional capabilities are methods returning `Option<&dyn Capability>` (default `None`):
//! [`Versioned`] and [`AgentAccess`] (the connection to a sandbox's agent, which the edge's
//! `Runtime` service forwards to), [`Snapshotter`] (file system snapshots) and
//! [`VmSnapshotter`] (a VM's memory snapshots).

use std::collections::HashSet;

use async_trait::async_trait;

use crate::record::SandboxRecord;

pub mod container;
mod error;
pub mod sim;
pub mod vm;

pub use error::{BackendError, Kind as BackendErrorKind};

/// What a backend measures its sandboxes actually use, in absolute units; the edge turns it into
/// shares of the node's capacity.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    pub cpu_millis: u64,
    pub memory_mb: u64,
}

/// A sandbox's use at one moment, as a backend reads it.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Readings {
    /// CPU time used since the sandbox started (all its processes).
    pub cpu_ns: u64,
    pub memory_used_bytes: u64,
    pub memory_limit_bytes: u64,
    pub memory_cache_bytes: u64,
    pub disk_used_bytes: u64,
    pub disk_total_bytes: u64,
}

/// Probes in flight at once in [`Backend::gone`]'s default.
const PROBE_CONCURRENCY: usize = 64;

/// One isolation backend (`sim`, `container`, `fncall`, `microvm`, `fullvm`).
#[async_trait]
pub trait Backend: Send + Sync {
    /// The name specs ask for (`spec.backend`).
    fn name(&self) -> &'static str;

    /// Creates and starts the sandbox described by the record (state CREATING).
    async fn create(&self, sb: &SandboxRecord) -> Result<(), BackendError>;

    /// Stops the sandbox and frees what it holds. Stopping a sandbox the backend does not have
    /// (already gone, or a creation that never finished) succeeds: the edge also calls it to
    /// remove leftovers of interrupted operations.
    async fn stop(&self, sb: &SandboxRecord) -> Result<(), BackendError>;

    async fn pause(&self, sb: &SandboxRecord) -> Result<(), BackendError>;

    async fn resume(&self, sb: &SandboxRecord) -> Result<(), BackendError>;

    /// Whether the sandbox `id` is still alive (RUNNING or PAUSED in the backend's view).
    async fn probe(&self, id: &str) -> Result<bool, BackendError>;

    /// Of these sandbox ids, the positions of those the backend answers are gone (a probe that
    /// fails says nothing). The edge's liveness sweep asks this of every live sandbox each round:
    /// a backend that can answer for many at once (`sim`: one lookup each under one lock) says so.
    async fn gone(&self, ids: &[&str]) -> Vec<usize> {
        let mut gone = Vec::new();
        for (c, chunk) in ids.chunks(PROBE_CONCURRENCY).enumerate() {
            let answers = futures::future::join_all(chunk.iter().map(|id| self.probe(id))).await;
            let base = c * PROBE_CONCURRENCY;
            gone.extend(answers.iter().enumerate().filter(|(_, a)| matches!(a, Ok(false))).map(|(i, _)| base + i));
        }
        gone
    }

    /// For a backend that hears of its sandboxes' deaths by itself: the ids of those it has
    /// lost and not yet been told to stop (each named every round until `stop`, or a new
    /// `create` or `adopt` of the id, or `cleanup`, clears it); the liveness sweep then does
    /// not ask it about every sandbox. `None`: ask (the default).
    fn losses(&self) -> Option<Vec<String>> {
        None
    }

    /// Takes back a RUNNING or PAUSED sandbox after an edge restart (reconnects to it).
    async fn adopt(&self, sb: &SandboxRecord) -> Result<(), BackendError>;

    /// Removes everything of this backend on the node that belongs to no sandbox id in `keep`;
    /// returns how many sandboxes' leftovers it removed.
    async fn cleanup(&self, keep: &HashSet<String>) -> Result<usize, BackendError>;

    /// What the backend's sandboxes actually use, when the backend can tell; `None` lets the
    /// edge measure the host instead.
    fn usage(&self) -> Option<Usage>;

    /// What the sandbox uses now (CPU time, memory, disk), when the backend can tell.
    async fn metrics(&self, sb: &SandboxRecord) -> Result<Readings, BackendError> {
        Err(BackendError::invalid_argument(format!("backend {} does not measure sandbox {}", self.name(), sb.id)))
    }

    /// Whether its sandboxes get a network from the edge (`netpol`): the edge then chooses a
    /// slot for each and records it before `create`.
    fn networked(&self) -> bool {
        false
    }

    /// Capability: runtime versions.
    fn versioned(&self) -> Option<&dyn Versioned> {
        None
    }

    /// Capability: the in-sandbox agent (shell sessions, files, processes).
    fn agent_access(&self) -> Option<&dyn AgentAccess> {
        None
    }

    /// Capability: snapshots of a sandbox's file system.
    fn snapshotter(&self) -> Option<&dyn Snapshotter> {
        None
    }

    /// Capability: warm pool members (sandboxes started ahead of time, claimed later).
    fn warm(&self) -> Option<&dyn Warm> {
        None
    }

    /// Capability: snapshots of a whole VM, memory included.
    fn vm_snapshotter(&self) -> Option<&dyn VmSnapshotter> {
        None
    }
}

/// A VM's memory snapshot, stored in the image store (`opendsec_images::vmsnap`).
#[derive(Clone, Debug)]
pub struct VmSnapshotTaken {
    /// Its id (`snapshots/<id>`).
    pub id: String,
    /// The image's layers under its disk, bottom first (the sandbox's).
    pub layers: Vec<opendsec_images::LayerId>,
    /// Bytes its files take in the store.
    pub bytes: u64,
    /// How long the VM's vCPUs were stopped.
    pub frozen: std::time::Duration,
}

/// Capability: stops a RUNNING VM's vCPUs for as long as it takes to save its memory, device
/// state and disk into the image store, then runs it on (a PAUSED one stays paused). A sandbox
/// created from the image the snapshot is published as is restored from it, not booted: its
/// processes and their memory are carried.
#[async_trait]
pub trait VmSnapshotter: Send + Sync {
    async fn snapshot_vm(&self, sb: &SandboxRecord) -> Result<VmSnapshotTaken, BackendError>;
}

/// Capability: a sandbox started ahead of time (a warm pool member, created through
/// [`Backend::create`] under its member id) becomes the sandbox of a claim.
#[async_trait]
pub trait Warm: Send + Sync {
    /// Makes running member `member` the sandbox `sb` (whose `member` names it): from now on
    /// every call names `sb`; its limits, network rules, id, hostname and env become `sb`'s.
    /// On an error the member is `sb`'s all the same: stopping `sb` removes it.
    async fn claim(&self, member: &SandboxRecord, sb: &SandboxRecord) -> Result<(), BackendError>;
}

/// A snapshot a backend took: the layer it stored and what the sandbox stands on.
#[derive(Clone, Debug)]
pub struct SnapshotTaken {
    /// The layers of the snapshot's image, bottom first: the sandbox's with the new layer on
    /// top, or with the top of a long chain merged into one.
    pub layers: Vec<opendsec_images::LayerId>,
    /// The layer of what the sandbox wrote.
    pub layer: opendsec_images::LayerMeta,
    /// How long the sandbox was frozen.
    pub frozen: std::time::Duration,
    /// PID 1's environment from the sandbox's image config (a move carries it along).
    pub image_env: Vec<String>,
}

/// Capability: freezes a RUNNING (or PAUSED) sandbox for as long as it takes to copy what it
/// wrote into a layer in the image store, then lets it run again as it was.
#[async_trait]
pub trait Snapshotter: Send + Sync {
    async fn snapshot(&self, sb: &SandboxRecord, pack_diff: bool) -> Result<SnapshotTaken, BackendError>;

    /// Saves the sandbox's session (`spec.session`) now, the sandbox frozen meanwhile and left
    /// as it was; returns the saved object's size.
    async fn save_session(&self, sb: &SandboxRecord) -> Result<u64, BackendError>;
}

/// Text that came from inside a sandbox (its agent, its guest, its VMM), made fit for
/// messages that reach logs and operators' terminals: at most `max` characters, anything but
/// printable ASCII replaced (no control sequence, no bidirectional override survives).
pub fn untrusted_text(s: &str, max: usize) -> String {
    s.chars().take(max).map(|c| if c == ' ' || c.is_ascii_graphic() { c } else { '?' }).collect()
}

/// A `Runtime` client of the agent in a sandbox: gRPC over a channel that reconnects by itself.
pub type AgentClient = opendsec_proto::v1::runtime_client::RuntimeClient<tonic::transport::Channel>;

/// A `Runtime` client over an agent's channel, with the message limits of every hop.
pub fn agent_client(channel: tonic::transport::Channel) -> AgentClient {
    use opendsec_common::grpc::MAX_MESSAGE_BYTES;
    AgentClient::new(channel).max_decoding_message_size(MAX_MESSAGE_BYTES).max_encoding_message_size(MAX_MESSAGE_BYTES)
}

/// Capability: reaches the agent of a RUNNING sandbox. Liveness rides on the agent too: a
/// backend with this capability reports a sandbox whose agent's Watch stream broke as gone
/// from `probe`, and the edge then marks it lost.
pub trait AgentAccess: Send + Sync {
    /// The channel to sandbox `id`'s agent (cheap to clone; see [`agent_client`]).
    fn agent(&self, id: &str) -> Result<tonic::transport::Channel, BackendError>;
}

/// Capability: reports the versions of the runtimes under the backend, e.g. "firecracker 1.17.0".
pub trait Versioned: Send + Sync {
    fn runtime_versions(&self) -> Vec<String>;
}

/// 8 hex digits of the hash of a backend's state directory (canonical): what the names of its
/// sandboxes carry, so that backends side by side on one host (two edges, two clusters, tests)
/// never take each other's sandboxes for leftovers.
pub fn state_tag(state_dir: &std::path::Path) -> String {
    use sha2::Digest;
    let canonical = std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
    let hash = sha2::Sha256::digest(canonical.as_os_str().as_encoded_bytes());
    hash.iter().take(4).map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trait_is_object_safe() {
        let b: std::sync::Arc<dyn Backend> = std::sync::Arc::new(sim::SimBackend::new());
        assert_eq!(b.name(), "sim");
    }
}
