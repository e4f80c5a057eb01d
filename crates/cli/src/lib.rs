//! `opendsecctl` and `opendsec`: thin binaries over the libraries. This crate holds their
//! command parsing, output formatting (human and `--json`) and the benchmark.

pub mod bench;
pub mod ctl;
pub mod image;
pub mod json;
pub mod pki;
pub mod runtime;
pub mod table;
