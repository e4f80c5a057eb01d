//! Pieces every opendsec process shares: the error reasons and their one mapping to gRPC, the
//! cluster config, id validation, private host files, the PKI and TLS of every link, the role
//! table of internal calls, gRPC serving and channels, and the `/metrics` `/healthz` `/readyz`
//! endpoint.
#![forbid(unsafe_code)]

pub mod acl;
pub mod ahead;
pub mod auth_failures;
pub mod bounds;
pub mod config;
pub mod conn;
pub mod egress;
pub mod fsperm;
pub mod grpc;
pub mod hex;
pub mod http;
pub mod ids;
pub mod periodic;
pub mod pki;
pub mod pool;
pub mod reason;
pub mod retry;
pub mod spec;
pub mod time;
pub mod tls;

pub use reason::{ApiError, Reason};

/// The IAM lock a watcher holds while it reconciles; IAM applies a Reconcile or SweepUnbound
/// only for its holder.
pub const RECONCILE_LOCK: &str = "watcher-reconcile";

/// Whether this thread runs a multi-thread tokio runtime, where a worker blocked for a moment
/// (a commit's sync) leaves the others to run the rest. The group commits of IAM and of the
/// edges' record logs commit a lone write on its caller's thread only there.
pub fn on_multi_thread_runtime() -> bool {
    tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
}

/// Sets up `tracing` for a command-line tool: warnings only unless `RUST_LOG` says otherwise.
pub fn init_tracing_quiet() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Sets up `tracing` for a binary: `RUST_LOG` filter (default `info`), plain text on stderr.
pub fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}
