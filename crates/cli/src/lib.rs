//! `opendsecctl` and `opendsec`: thin binaries over the libraries. This crate holds their
//! command parsing, output formatting (human and `--json`) and the benchmark.

pub mod bench;
pub mod ctl;
pub mod error;
pub mod image;
pub mod json;
pub mod output;
pub mod pki;
pub mod runtime;
pub mod support;
pub mod table;
pub mod term;

/// Raises this process's soft limit of open files to its hard limit: a server holds a socket
/// per connection, and the usual soft limit (1,024) would make `accept` fail long before the
/// connection caps do.
pub fn raise_fd_limit() {
    let mut lim = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit/setrlimit with a pointer to a live rlimit.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                tracing::warn!(error = %std::io::Error::last_os_error(), "could not raise the open-file limit");
            }
        }
    }
}
