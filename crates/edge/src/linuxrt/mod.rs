//! The Linux runtime of the container backend (reference section 6): sandbox cgroups and core
//! scheduling detection (`cgroup`), the layer cache and upper disks on loop devices (`rootfs`),
//! the seccomp profile (`seccomp`), host id ranges for user namespaces (`idmap`), the setup
//! process (`init`) and a driver over them (`sandbox`).
//! Everything here needs root; tests that need it skip themselves otherwise.
pub mod cgroup;
pub mod idmap;
pub mod init;
pub mod reclaim;
pub mod rootfs;
pub mod sandbox;
pub mod seccomp;

pub use sandbox::{Sandbox, SandboxError, SandboxSpec};
