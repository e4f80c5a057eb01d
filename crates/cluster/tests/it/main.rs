//! The crate's integration tests, one module per file, linked into one test binary:
//! one link of the whole dependency tree instead of one per file (CI's disk and time).

mod access;
mod common;
mod e2b_tls;
mod iam_raft;
mod images;
mod lifecycle;
mod pools;
