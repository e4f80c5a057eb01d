//! Accepted connections and what bounds them: each holds a slot of its server's connection
//! limit and of its source's (an IPv4 address, an IPv6 /64) until it closes, and may be cut
//! when its peer's first bytes do not come in time. Used by the TLS acceptor
//! (the TLS acceptor wraps [`incoming`]) for every server.
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tonic::transport::server::Connected;

/// An accepted connection holding a slot of its server's connection limit (and of its
/// source's) until it closes; optionally failing its reads when the peer's first bytes do not
/// come within a deadline of the start (a client that connects and stays silent, or sends a
/// byte and then nothing, holds no slot for long).
#[derive(Debug)]
pub struct Conn<S> {
    inner: S,
    _slot: tokio::sync::OwnedSemaphorePermit,
    _source: Option<SourceSlot>,
    first_byte: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    /// Bytes still awaited before `first_byte`'s deadline.
    awaited: usize,
}

impl<S> Conn<S> {
    pub fn new(inner: S, slot: tokio::sync::OwnedSemaphorePermit) -> Conn<S> {
        Conn { inner, _slot: slot, _source: None, first_byte: None, awaited: 0 }
    }

    pub fn with_source(mut self, source: Option<SourceSlot>) -> Conn<S> {
        self._source = source;
        self
    }

    /// The connection inside.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    /// Reads fail with `TimedOut` unless the peer's first `n` bytes come within `d`.
    pub fn first_bytes_within(mut self, n: usize, d: Duration) -> Conn<S> {
        self.first_byte = Some(Box::pin(tokio::time::sleep(d)));
        self.awaited = n;
        self
    }
}

impl<S: Connected> Connected for Conn<S> {
    type ConnectInfo = S::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.inner.connect_info()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Conn<S> {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        if self.first_byte.is_some() {
            match &r {
                std::task::Poll::Ready(Ok(())) if buf.filled().len() > before => {
                    self.awaited = self.awaited.saturating_sub(buf.filled().len() - before);
                    if self.awaited == 0 {
                        self.first_byte = None;
                    }
                }
                std::task::Poll::Pending => {
                    if let Some(d) = self.first_byte.as_mut()
                        && d.as_mut().poll(cx).is_ready()
                    {
                        return std::task::Poll::Ready(Err(std::io::Error::new(
                            std::io::ErrorKind::TimedOut,
                            "the peer sent nothing after connecting",
                        )));
                    }
                }
                _ => {}
            }
        }
        r
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Conn<S> {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> std::task::Poll<std::io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// How many connections of a server each source address holds, capped.
pub(crate) struct Sources {
    cap: usize,
    open: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>,
}

/// One source's connection, counted until dropped.
pub struct SourceSlot {
    sources: Arc<Sources>,
    ip: std::net::IpAddr,
}
impl std::fmt::Debug for SourceSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SourceSlot").finish_non_exhaustive()
    }
}

impl Drop for SourceSlot {
    fn drop(&mut self) {
        let mut m = self.sources.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = m.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

impl Sources {
    pub(crate) fn new(cap: usize) -> Sources {
        Sources { cap, open: Default::default() }
    }

    /// The source an address counts as: [`source_of`].
    pub(crate) fn source_of(ip: std::net::IpAddr) -> std::net::IpAddr {
        source_of(ip)
    }
}

/// The source an address counts as in every per-source bound: itself for IPv4, its /64 for
/// IPv6 (one host's usual allocation).
pub fn source_of(ip: std::net::IpAddr) -> std::net::IpAddr {
    use std::net::{IpAddr, Ipv6Addr};
    match ip {
        IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => {
                let s = v6.segments();
                IpAddr::V6(Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
            }
        },
        v4 => v4,
    }
}

impl Sources {
    pub(crate) fn take(self: &Arc<Self>, ip: std::net::IpAddr) -> Option<SourceSlot> {
        let ip = Sources::source_of(ip);
        let mut m = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let n = m.entry(ip).or_insert(0);
        if *n >= self.cap {
            return None;
        }
        *n += 1;
        Some(SourceSlot { sources: self.clone(), ip })
    }
}

/// How long a connection's opening (a TLS handshake) and then its first bytes may take.
pub const OPENING_TIMEOUT: Duration = Duration::from_secs(10);

/// Accepted connections of `listener`, each made ready by `open` (a TLS handshake, or
/// nothing) in a task of its own (a client that never finishes holds no accept slot): at most
/// `max_conns` open at once (beyond, new ones wait in the kernel's backlog), and at most
/// `per_source` from one source (an IPv4 address, an IPv6 /64; 0: no such cap; beyond, a new
/// one is closed at once). A connection whose first `opening` bytes do not come within
/// [`OPENING_TIMEOUT`] of its opening is closed ([`Conn::first_bytes_within`]).
/// TCP_NODELAY is set on each. The stream ends when its receiver is dropped, and then the
/// listener is closed too.
pub fn incoming<S, F, Fut>(
    listener: tokio::net::TcpListener,
    max_conns: usize,
    per_source: usize,
    opening: usize,
    open: F,
) -> tokio_stream::wrappers::ReceiverStream<std::io::Result<Conn<S>>>
where
    S: Send + 'static,
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: Future<Output = std::io::Result<S>> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(64);
    let limit = Arc::new(tokio::sync::Semaphore::new(max_conns.max(1)));
    let sources = Arc::new(Sources::new(per_source));
    tokio::spawn(async move {
        loop {
            let permit = tokio::select! {
                _ = tx.closed() => return,
                p = limit.clone().acquire_owned() => match p { Ok(p) => p, Err(_) => return },
            };
            let accepted = tokio::select! {
                _ = tx.closed() => return,
                a = listener.accept() => a,
            };
            let (tcp, peer) = match accepted {
                Ok(a) => a,
                Err(e) => {
                    // Out of fds and the like: back off instead of spinning.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let source = match per_source {
                0 => None,
                _ => match sources.take(peer.ip()) {
                    Some(s) => Some(s),
                    None => {
                        tracing::debug!(peer = %peer, per_source, "closing a connection over its source's cap");
                        continue;
                    }
                },
            };
            let _ = tcp.set_nodelay(true);
            let (opened, tx) = (open(tcp), tx.clone());
            tokio::spawn(async move {
                match opened.await {
                    Ok(s) => {
                        let conn =
                            Conn::new(s, permit).with_source(source).first_bytes_within(opening, OPENING_TIMEOUT);
                        let _ = tx.send(Ok(conn)).await;
                    }
                    Err(e) => tracing::debug!(peer = %peer, error = %e, "opening a connection failed"),
                }
            });
        }
    });
    tokio_stream::wrappers::ReceiverStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection whose peer sends nothing, or less than awaited, fails its read at the
    /// deadline; one whose peer spoke in time does not fail later for being quiet.
    #[tokio::test]
    async fn a_silent_or_trickling_peer_is_cut_at_the_deadline_and_a_talking_one_is_not() {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let slots = Arc::new(tokio::sync::Semaphore::new(2));
        let (a, _a_peer) = tokio::io::duplex(64);
        let mut silent =
            Conn::new(a, slots.clone().try_acquire_owned().unwrap()).first_bytes_within(3, Duration::from_millis(50));
        let mut buf = [0u8; 8];
        let e = silent.read(&mut buf).await.unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);
        drop(silent);
        assert_eq!(slots.available_permits(), 2, "the closed connection gave its slot back");
        // A byte, then nothing: cut too.
        let (c, mut c_peer) = tokio::io::duplex(64);
        let mut trickle =
            Conn::new(c, slots.clone().try_acquire_owned().unwrap()).first_bytes_within(3, Duration::from_millis(50));
        c_peer.write_all(b"P").await.unwrap();
        assert_eq!(trickle.read(&mut buf).await.unwrap(), 1);
        assert_eq!(trickle.read(&mut buf).await.unwrap_err().kind(), std::io::ErrorKind::TimedOut);
        drop(trickle);

        let (b, mut b_peer) = tokio::io::duplex(64);
        let mut talking =
            Conn::new(b, slots.clone().try_acquire_owned().unwrap()).first_bytes_within(3, Duration::from_millis(50));
        b_peer.write_all(b"PRI").await.unwrap();
        assert_eq!(talking.read(&mut buf).await.unwrap(), 3);
        let late = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(150)).await;
            b_peer.write_all(b"x").await.unwrap();
            b_peer
        });
        assert_eq!(talking.read(&mut buf).await.unwrap(), 1, "quiet after its first bytes is fine");
        late.await.unwrap();
    }
}
