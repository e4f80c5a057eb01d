//! `opendsecctl` and `opendsec`: thin binaries over the libraries. This crate holds their
//! command parsing, output formatting (human and `--json`) and the benchmark.

pub mod bench;
pub mod ctl;
pub mod error;
pub mod image;
pub mod json;
pub mod output;
pub mod pki;
pub mod release;
pub mod runtime;
pub mod support;
pub mod table;
pub mod term;

/// Raises this process's soft limit of open files to its hard limit: a server holds a socket
/// per connection, and the usual soft limit (1,024) would make `accept` fail long before the
/// connection caps do.
pub fn raise_fd_limit() {
    use rustix::process::{Resource, getrlimit, setrlimit};
    let lim = getrlimit(Resource::Nofile);
    // None is "unlimited".
    let below = match (lim.current, lim.maximum) {
        (Some(cur), Some(max)) => cur < max,
        (Some(_), None) => true,
        (None, _) => false,
    };
    if below && let Err(e) = setrlimit(Resource::Nofile, rustix::process::Rlimit { current: lim.maximum, ..lim }) {
        tracing::warn!(error = %std::io::Error::from(e), "could not raise the open-file limit");
    }
}
