//! The crate's integration tests, one module per file, linked into one test binary:
//! one link of the whole dependency tree instead of one per file (CI's disk and time).

mod cluster_down;
mod common;
mod container_cluster;
mod deploy;
mod edge_crash;
mod iam_faults;
mod image_cli;
mod moves;
mod multihost;
mod network;
mod pki_cli;
mod pool_cli;
mod pools;
mod sessions;
mod snapshots;
mod soak;
mod terminal_escape;
mod vm_network;
mod vms;
