//! The VMM behind the VM backends ([C 7]: Firecracker there, QEMU here, [`super::qemu`]):
//! what the backend asks of whatever runs a guest, so that another VMM can stand beside QEMU
//! where it can be installed and tested. The backend keeps everything around the VMM: the
//! VM's directory and files, its cgroup, uid and network, the confined process that runs the
//! VMM's command (`spawn_vmm`), snapshots, adoption and liveness. A [`Vmm`] says what command
//! starts a VM and controls the running one.

use std::path::Path;

use async_trait::async_trait;

use super::{Drive, Shape};
use crate::backend::BackendError;

/// What a VM is started with, whatever runs it.
#[derive(Debug)]
pub(super) struct VmSpec<'a> {
    /// The VM's directory (its memory file, disks and sockets' names).
    pub dir: &'a Path,
    /// The image disk.
    pub image: &'a Path,
    pub shape: Shape,
    /// The uid the VMM drops to.
    pub uid: u32,
}

/// How a VM is started, kept in its directory (`vmm.json`) for the VMMs that resume it, with
/// the VM's shape (what a snapshot of it records).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(super) struct Launch {
    /// The command's arguments.
    pub argv: Vec<String>,
    /// Disks the command names by descriptor, opened by the edge.
    pub drives: Vec<Drive>,
    #[serde(default)]
    pub shape: Shape,
}

/// A VMM: the command that starts a VM, and the control of a running one (its directory
/// names it).
#[async_trait]
pub(super) trait Vmm: Send + Sync + std::fmt::Debug {
    /// What it is, for the edge's runtime versions (`qemu 7.2.22 (tcg)`).
    fn version(&self) -> String;
    /// What a VMM restoring a VM this one saved must be (snapshots record it).
    fn restore_key(&self) -> String;
    /// The command that starts the VM of `spec`.
    fn command(&self, spec: VmSpec<'_>) -> Launch;
    /// What the command adds to start the VM stopped, waiting for [`Vmm::load`].
    fn incoming_args(&self) -> Vec<String>;
    /// Stops the vCPUs.
    async fn stop_vcpus(&self, dir: &Path) -> Result<(), BackendError>;
    /// Runs the vCPUs again.
    async fn run_vcpus(&self, dir: &Path) -> Result<(), BackendError>;
    /// Whether the vCPUs are stopped (an adopted VM may have been paused).
    async fn stopped(&self, dir: &Path) -> Result<bool, BackendError>;
    /// Saves the stopped VM's device state into a new file at `state`, its memory left out
    /// (the VM's own memory file holds it). On an error the save is abandoned, `state`
    /// removed, the VM as it was.
    async fn save(&self, dir: &Path, state: &Path) -> Result<(), BackendError>;
    /// Loads the state at `state` into the VMM `pid`, started to receive one, leaving the VM
    /// stopped.
    async fn load(&self, dir: &Path, pid: i32, state: &Path) -> Result<(), BackendError>;
    /// Ends the VMM (the caller makes sure it is gone).
    async fn quit(&self, dir: &Path) -> Result<(), BackendError>;
    /// What the guest wrote on its console since the last read.
    async fn console(&self, dir: &Path) -> String;
}
