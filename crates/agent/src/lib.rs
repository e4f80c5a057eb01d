//! The in-sandbox agent (`opendsec-agent`): *aether* is PID 1 in a sandbox and serves the
//! `Runtime` service on a unix socket; *chronus* (one per shell session, a re-exec of the same
//! binary running as the session's user) keeps one long-lived shell and its output records.
//! aether routes session calls to the session's chronus over a per-session unix socket, using
//! the same `Runtime` service, so one set of messages serves every hop.

pub mod aether;
pub mod chronus;
pub mod contexts;
pub mod error;
pub mod files;
pub mod http;
pub mod kernel;
pub mod passwd;
pub mod procs;
pub mod reaper;
pub mod restore;
pub mod serial;
pub mod vminit;
pub mod vmnet;
pub mod watch;

use std::path::PathBuf;
use std::pin::Pin;

use tonic::Status;
use tonic::transport::{Channel, Endpoint};

/// Largest gRPC message either way (the control plane's limit, one constant for every hop).
pub use opendsec_proto::upload::MAX_MESSAGE_BYTES;
/// Chunk size of streamed output and files.
pub const CHUNK: usize = 64 << 10;

pub type BoxStream<T> = Pin<Box<dyn tokio_stream::Stream<Item = Result<T, Status>> + Send>>;

/// Unix milliseconds now.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0)
}

/// Now in RFC 3339 (UTC, microseconds), as Jupyter's message headers carry it.
pub fn rfc3339_now() -> String {
    let d = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let secs = d.as_secs() as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:06}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60,
        d.subsec_micros()
    )
}

/// The last `n` bytes of `b` as text, for error messages.
pub fn tail_text(b: &[u8], n: usize) -> String {
    String::from_utf8_lossy(&b[b.len().saturating_sub(n)..]).trim().to_string()
}

/// A gRPC channel to a unix socket (aether's or a chronus's).
pub async fn unix_channel(path: PathBuf) -> Result<Channel, tonic::transport::Error> {
    Endpoint::from_static("http://agent.invalid")
        .connect_with_connector(tower::service_fn(move |_| {
            let p = path.clone();
            async move {
                Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                    tokio::net::UnixStream::connect(p).await?,
                ))
            }
        }))
        .await
}

/// A Runtime client on a unix socket with the agent's message limits.
pub async fn unix_client(
    path: PathBuf,
) -> Result<opendsec_proto::v1::runtime_client::RuntimeClient<Channel>, tonic::transport::Error> {
    Ok(runtime_client(unix_channel(path).await?))
}

/// A Runtime client over `channel` with the agent's message limits.
pub fn runtime_client(channel: Channel) -> opendsec_proto::v1::runtime_client::RuntimeClient<Channel> {
    opendsec_proto::v1::runtime_client::RuntimeClient::new(channel)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

/// Forwards a WriteFile stream (its first message already read) to the next hop, aborting it
/// visibly when the incoming side fails (see `opendsec_proto::upload`).
pub async fn upload_forward(
    channel: Channel,
    first: opendsec_proto::v1::WriteFileRequest,
    mut incoming: tonic::Streaming<opendsec_proto::v1::WriteFileRequest>,
) -> Result<tonic::Response<opendsec_proto::v1::WriteFileResponse>, tonic::Status> {
    let hop = opendsec_proto::upload::Hop { abort_wait: std::time::Duration::from_secs(10), ..Default::default() };
    opendsec_proto::upload::forward(channel, first, &mut incoming, |_| Ok(()), hop).await
}

/// Binds a unix socket at `path` (an old socket file is replaced; the socket is for its owner
/// only).
pub fn bind_unix(path: &std::path::Path) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    let _ = std::fs::remove_file(path);
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

/// Takes over the listening unix socket inherited at `fd` (made close-on-exec, so no child
/// of the agent inherits it).
pub fn inherited_listener(fd: i32) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::fd::{FromRawFd, OwnedFd};
    if fd < 3 {
        return Err(std::io::Error::other(format!("--listen-fd {fd}: not an inherited fd")));
    }
    // SAFETY: the fd number was handed over by our parent for us to own; fstat below checks it
    // is open and a socket before anything else uses it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let st = rustix::fs::fstat(&owned)?;
    if rustix::fs::FileType::from_raw_mode(st.st_mode) != rustix::fs::FileType::Socket {
        return Err(std::io::Error::other(format!("--listen-fd {fd}: not a socket")));
    }
    rustix::io::fcntl_setfd(&owned, rustix::io::FdFlags::CLOEXEC)?;
    let std_listener = std::os::unix::net::UnixListener::from(owned);
    std_listener.set_nonblocking(true)?;
    tokio::net::UnixListener::from_std(std_listener)
}

/// Makes this process non-dumpable and points stdout and stderr at `log`, a file in the
/// sandbox's own file system (see `aether::main`).
pub fn seal_pid1(log: &std::path::Path) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    rustix::process::set_dumpable_behavior(rustix::process::DumpableBehavior::NotDumpable)?;
    let null = std::fs::OpenOptions::new().create(true).append(true).mode(0o600).open(log)?;
    rustix::stdio::dup2_stdout(&null)?;
    rustix::stdio::dup2_stderr(&null)?;
    Ok(())
}

/// Serves `svc` on `listener` until the process ends.
pub async fn serve_unix<S>(listener: tokio::net::UnixListener, svc: S) -> std::io::Result<()>
where
    S: opendsec_proto::v1::runtime_server::Runtime,
{
    serve_unix_with::<S, aether::ControlService>(listener, svc, None).await
}

/// Serves `svc`, and the edge's `AgentControl` when given, on `listener`.
pub async fn serve_unix_with<S, C>(
    listener: tokio::net::UnixListener,
    svc: S,
    control: Option<opendsec_proto::v1::agent_control_server::AgentControlServer<C>>,
) -> std::io::Result<()>
where
    S: opendsec_proto::v1::runtime_server::Runtime,
    C: opendsec_proto::v1::agent_control_server::AgentControl,
{
    serve_incoming(tokio_stream::wrappers::UnixListenerStream::new(listener), svc, control).await
}

/// Serves `svc`, and `control` when given, on each connection `incoming` yields.
pub async fn serve_incoming<S, C, I, IO>(
    incoming: I,
    svc: S,
    control: Option<opendsec_proto::v1::agent_control_server::AgentControlServer<C>>,
) -> std::io::Result<()>
where
    S: opendsec_proto::v1::runtime_server::Runtime,
    C: opendsec_proto::v1::agent_control_server::AgentControl,
    I: futures::Stream<Item = std::io::Result<IO>>,
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + tonic::transport::server::Connected + Unpin + Send + 'static,
{
    let server = opendsec_proto::v1::runtime_server::RuntimeServer::new(svc)
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES);
    tonic::transport::Server::builder()
        .add_service(server)
        .add_optional_service(control)
        .serve_with_incoming(incoming)
        .await
        .map_err(std::io::Error::other)
}

/// `oom_score_adj` of everything the agent starts (sessions, their shells, processes): raised,
/// so that when the sandbox's memory runs out its workload is killed, not aether. aether runs
/// lowered where the host lets the edge lower it (CAP_SYS_RESOURCE), and at the edge's score
/// elsewhere; raising needs no privilege, so this ranking holds on every host.
pub const WORKLOAD_OOM_SCORE_ADJ: &str = "500";

/// Sets this process's `oom_score_adj` to [`WORKLOAD_OOM_SCORE_ADJ`].
pub fn raise_oom_score() {
    let _ = std::fs::write("/proc/self/oom_score_adj", WORKLOAD_OOM_SCORE_ADJ);
}

/// [`raise_oom_score`] with raw syscalls only (no allocation), for use between fork and exec.
pub fn raise_oom_score_raw() {
    use rustix::fs::{Mode, OFlags};
    if let Ok(fd) = rustix::fs::open(c"/proc/self/oom_score_adj", OFlags::WRONLY | OFlags::CLOEXEC, Mode::empty()) {
        let _ = rustix::io::write(&fd, WORKLOAD_OOM_SCORE_ADJ.as_bytes());
    }
}

/// Quotes `s` for a POSIX shell.
pub fn sh_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn quote() {
        assert_eq!(super::sh_quote("a'b"), r"'a'\''b'");
    }
}
