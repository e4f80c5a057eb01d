//! The guest's end of the agent's virtio-serial port (see `opendsec_proto::serial`): one
//! connection at a time, each begun with the handshake, served as one HTTP/2 connection; when
//! it ends (the host went away: EOF), the port is opened again for the next.

use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use opendsec_proto::serial::{Prefixed, guest_handshake};
use tokio::io::unix::AsyncFd;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The port, opened non-blocking.
#[derive(Debug)]
pub struct Port(AsyncFd<OwnedFd>);

impl Port {
    fn open(path: &std::path::Path) -> std::io::Result<Port> {
        use rustix::fs::{Mode, OFlags};
        let fd =
            rustix::fs::open(path, OFlags::RDWR | OFlags::NONBLOCK | OFlags::CLOEXEC | OFlags::NOCTTY, Mode::empty())?;
        // SAFETY: `fd` is owned by the AsyncFd from here on, and is neither replaced nor closed
        // while registered (it is closed when the AsyncFd drops it).
        Ok(Port(unsafe { AsyncFd::register(fd)? }))
    }
}

impl AsyncRead for Port {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        loop {
            let mut g = ready!(self.0.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match g.try_io(|fd| rustix::io::read(fd.get_ref(), &mut *unfilled).map_err(std::io::Error::from)) {
                Ok(Ok(n)) => {
                    buf.advance(n);
                    return Poll::Ready(Ok(()));
                }
                Ok(Err(e)) => return Poll::Ready(Err(e)),
                Err(_would_block) => continue,
            }
        }
    }
}

impl AsyncWrite for Port {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        loop {
            let mut g = ready!(self.0.poll_write_ready(cx))?;
            match g.try_io(|fd| rustix::io::write(fd.get_ref(), data).map_err(std::io::Error::from)) {
                Ok(r) => return Poll::Ready(r),
                Err(_would_block) => continue,
            }
        }
    }
    fn poll_flush(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
    fn poll_shutdown(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

/// One connection over the port; the next is opened once this one is dropped.
#[derive(Debug)]
pub struct Conn {
    io: Prefixed<Port>,
    _done: tokio::sync::oneshot::Sender<()>,
}

impl AsyncRead for Conn {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Conn {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.io).poll_write(cx, data)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Conn {
    type ConnectInfo = ();
    fn connect_info(&self) {}
}

/// Opens the port and waits for the host's hello, as often as it takes. While no host is
/// connected the port reads as ended: tried again shortly.
async fn accept(path: &std::path::Path) -> Prefixed<Port> {
    let mut wait = Duration::from_millis(1);
    loop {
        let attempt = async { guest_handshake(Port::open(path)?).await };
        match attempt.await {
            Ok((io, host_ns)) => {
                set_clock(host_ns);
                return io;
            }
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {}
            Err(e) => eprintln!("opendsec-agent: agent port {}: {e}", path.display()),
        }
        tokio::time::sleep(wait).await;
        wait = (wait * 2).min(Duration::from_millis(20));
    }
}

/// Sets the guest's wall clock to the host's when they differ by more than a little: a VM
/// restored from a snapshot (a resume, a fork) wakes with the clock it was saved with.
fn set_clock(host_ns: u64) {
    const SLACK_NS: u128 = 50_000_000;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    if host_ns == 0 || now.abs_diff(u128::from(host_ns)) <= SLACK_NS {
        return;
    }
    let ts =
        rustix::time::Timespec { tv_sec: (host_ns / 1_000_000_000) as i64, tv_nsec: (host_ns % 1_000_000_000) as i64 };
    if let Err(e) = rustix::time::clock_settime(rustix::time::ClockId::Realtime, ts) {
        eprintln!("opendsec-agent: setting the clock: {e}");
    }
}

/// The connections over the port at `path`, one after another: the next is opened once the
/// previous one is dropped (a serial port opens once at a time).
pub fn incoming(path: PathBuf) -> impl futures::Stream<Item = std::io::Result<Conn>> {
    futures::stream::unfold(
        (path, None),
        |(path, done): (PathBuf, Option<tokio::sync::oneshot::Receiver<()>>)| async move {
            if let Some(done) = done {
                let _ = done.await;
            }
            let io = accept(&path).await;
            let (tx, rx) = tokio::sync::oneshot::channel();
            Some((Ok(Conn { io, _done: tx }), (path, Some(rx))))
        },
    )
}
