//! The crate's integration tests, one module per file, linked into one test binary:
//! one link of the whole dependency tree instead of one per file (CI's disk and time).

mod conformance;
mod container_backend;
mod edge_grpc;
mod linuxrt_cgroup;
mod linuxrt_rootfs;
mod linuxrt_sandbox;
mod linuxrt_seccomp;
mod netpol;
mod reclaim;
mod record_crash;
mod support;
mod vm;
