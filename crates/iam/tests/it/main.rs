//! The crate's integration tests, one module per file, linked into one test binary:
//! one link of the whole dependency tree instead of one per file (CI's disk and time).

mod raft_peers;
mod server;
mod wal_crash;
