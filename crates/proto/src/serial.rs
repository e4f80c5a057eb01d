//! The agent's link to the edge in a VM: HTTP/2 (gRPC) over one virtio-serial port.
//!
//! A serial port is one byte stream that outlives its users: bytes of an earlier connection
//! (one cut by a pause, a snapshot restored into a new VMM, a host that gave up mid-way) may
//! still be queued on either side. So each connection starts with a handshake that both sides
//! find amid such leftovers: the host sends `OPENDSEC-HELLO <nonce> <time>\n` with a fresh
//! nonce and its wall clock (ns since the epoch, both 16 hex digits; a guest restored from a
//! snapshot sets its clock by it), the guest skips everything up to a well-formed hello and
//! answers `OPENDSEC-READY <nonce>\n`,
//! and the host skips everything up to the answer carrying its nonce. HTTP/2 begins right
//! after; bytes read past the handshake are handed on ([`Prefixed`]).
//!
//! What the guest sends is data, never trusted by the host: the host reads at most
//! [`MAX_SKIP`] bytes looking for the answer, and never parses anything else.

use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

/// The name of the agent's virtio-serial port (`virtserialport name=`), on both sides.
pub const AGENT_PORT: &str = "opendsec.agent";

const HELLO: &[u8] = b"OPENDSEC-HELLO ";
const READY: &[u8] = b"OPENDSEC-READY ";
/// Most bytes either side skips looking for the other's line before giving up.
pub const MAX_SKIP: usize = 16 << 20;

/// A stream with bytes already read from it put back in front.
#[derive(Debug)]
pub struct Prefixed<S> {
    rest: Vec<u8>,
    at: usize,
    inner: S,
}

impl<S> Prefixed<S> {
    pub fn new(rest: Vec<u8>, inner: S) -> Prefixed<S> {
        Prefixed { rest, at: 0, inner }
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Prefixed<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        if self.at < self.rest.len() {
            let n = (self.rest.len() - self.at).min(buf.remaining());
            let at = self.at;
            buf.put_slice(&self.rest[at..at + n]);
            self.at += n;
            if self.at == self.rest.len() {
                self.rest = Vec::new();
                self.at = 0;
            }
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Prefixed<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

fn line(tag: &[u8], nonce: u64, time: Option<u64>) -> Vec<u8> {
    let mut l = tag.to_vec();
    l.extend_from_slice(format!("{nonce:016x}").as_bytes());
    if let Some(t) = time {
        l.extend_from_slice(format!(" {t:016x}").as_bytes());
    }
    l.push(b'\n');
    l
}

fn hex16(b: &[u8]) -> Option<u64> {
    let s = std::str::from_utf8(b).ok()?;
    if s.len() != 16 || !s.bytes().all(|c| c.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(s, 16).ok()
}

/// Finds `tag` + 16 hex digits (+ ` ` + 16 more when `timed`) + `\n` in `buf`: the nonce,
/// the time, and the offset just past the line.
fn find(buf: &[u8], tag: &[u8], timed: bool) -> Option<(u64, u64, usize)> {
    let want = tag.len() + if timed { 34 } else { 17 };
    let mut from = 0;
    while let Some(i) = buf[from..].windows(tag.len()).position(|w| w == tag) {
        let at = from + i;
        if buf.len() < at + want {
            return None; // the rest of a candidate is still to come
        }
        let body = &buf[at + tag.len()..at + want - 1];
        if buf[at + want - 1] == b'\n'
            && let Some(n) = hex16(&body[..16])
        {
            let time = if timed { (body[16] == b' ').then(|| hex16(&body[17..])).flatten() } else { Some(0) };
            if let Some(t) = time {
                return Some((n, t, at + want));
            }
        }
        from = at + 1;
    }
    None
}

/// Reads until `accept` finds its line; returns what it found and the bytes after it.
async fn scan<S: AsyncRead + Unpin>(
    s: &mut S,
    tag: &[u8],
    timed: bool,
    accept: impl Fn(u64) -> bool,
) -> std::io::Result<(u64, u64, Vec<u8>)> {
    let mut buf: Vec<u8> = Vec::with_capacity(256);
    let mut skipped = 0usize;
    let mut chunk = [0u8; 4096];
    loop {
        let n = s.read(&mut chunk).await?;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the other side closed the port"));
        }
        buf.extend_from_slice(&chunk[..n]);
        while let Some((nonce, time, end)) = find(&buf, tag, timed) {
            if accept(nonce) {
                return Ok((nonce, time, buf.split_off(end)));
            }
            skipped += end;
            buf.drain(..end);
        }
        // Keep only what could still begin a line.
        let keep = tag.len() + 34;
        if buf.len() > keep {
            let cut = buf.len() - keep;
            skipped += cut;
            buf.drain(..cut);
        }
        if skipped > MAX_SKIP {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("no handshake in the first {MAX_SKIP} bytes"),
            ));
        }
    }
}

/// How often the host says hello again while no answer came: a guest may have read a hello
/// as part of a connection it still thought open (a VM restored from a snapshot), and answers
/// the next one.
const HELLO_AGAIN: std::time::Duration = std::time::Duration::from_millis(200);

/// The host's half: says hello with `nonce` and the time (again every [`HELLO_AGAIN`]), and
/// waits for the guest's answer.
pub async fn host_handshake<S: AsyncRead + AsyncWrite + Unpin>(s: S, nonce: u64) -> std::io::Result<Prefixed<S>> {
    let (mut r, mut w) = tokio::io::split(s);
    let rest = {
        let answer = scan(&mut r, READY, false, |n| n == nonce);
        tokio::pin!(answer);
        loop {
            let now =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
            w.write_all(&line(HELLO, nonce, Some(u64::try_from(now).unwrap_or(u64::MAX)))).await?;
            w.flush().await?;
            tokio::select! {
                r = &mut answer => break r?.2,
                () = tokio::time::sleep(HELLO_AGAIN) => {}
            }
        }
    };
    Ok(Prefixed::new(rest, r.unsplit(w)))
}

/// The guest's half: waits for a hello and answers it; returns the host's time too (ns
/// since the epoch). The host's repeats of that hello (sent before the answer reached it)
/// come before anything else it sends, and are dropped.
pub async fn guest_handshake<S: AsyncRead + AsyncWrite + Unpin>(mut s: S) -> std::io::Result<(Prefixed<S>, u64)> {
    let (nonce, time, mut rest) = scan(&mut s, HELLO, true, |_| true).await?;
    s.write_all(&line(READY, nonce, None)).await?;
    s.flush().await?;
    // A repeat is this hello's tag and nonce, then another time.
    let head = &line(HELLO, nonce, None)[..HELLO.len() + 16];
    let full = HELLO.len() + 34;
    loop {
        let k = rest.len().min(head.len());
        if rest[..k] != head[..k] {
            break; // not a repeat: HTTP/2 (its preface begins "PRI")
        }
        if rest.len() >= full {
            match find(&rest[..full], HELLO, true) {
                Some((n, _, end)) if n == nonce && end == full => {
                    rest.drain(..full);
                    continue;
                }
                _ => break,
            }
        }
        // Could still be a repeat: the host sends more (HTTP/2) once it has the answer.
        let mut chunk = [0u8; 256];
        let got = s.read(&mut chunk).await?;
        if got == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the other side closed the port"));
        }
        rest.extend_from_slice(&chunk[..got]);
    }
    Ok((Prefixed::new(rest, s), time))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn both_sides_find_each_other_amid_leftovers() {
        let (host, guest) = tokio::io::duplex(1 << 16);
        let g = tokio::spawn(async move {
            let mut guest = guest;
            // What an earlier connection left: a stale answer, half a hello, garbage.
            guest.write_all(b"\x00\x00PRI * HTTP/2.0OPENDSEC-READY 0000000000000001\nOPENDSEC-RE").await.unwrap();
            let (mut g, time) = guest_handshake(guest).await.unwrap();
            assert!(time > 1_700_000_000_000_000_000, "the host's clock: {time}");
            let mut got = [0u8; 5];
            g.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, b"after");
            g.write_all(b"reply").await.unwrap();
        });
        let mut host = host;
        host.write_all(b"junk OPENDSEC-HELLO zzzzzzzzzzzzzzzz 0000000000000000\nOPENDSEC-HELLO 12").await.unwrap();
        let mut h = host_handshake(host, 0xabc).await.unwrap();
        h.write_all(b"after").await.unwrap();
        let mut got = [0u8; 5];
        h.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"reply");
        g.await.unwrap();
    }

    #[tokio::test]
    async fn a_guest_that_read_the_first_hello_as_something_else_answers_a_repeat() {
        let (host, guest) = tokio::io::duplex(1 << 16);
        let g = tokio::spawn(async move {
            let mut guest = guest;
            // A connection it still thought open swallows the first hello.
            let mut swallowed = [0u8; 49];
            guest.read_exact(&mut swallowed).await.unwrap();
            assert!(swallowed.starts_with(HELLO));
            let (mut g, _) = guest_handshake(guest).await.unwrap();
            // The repeats sent before the answer arrived are gone: the stream starts with
            // what the host sent after.
            let mut got = [0u8; 3];
            g.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, b"PRI");
        });
        let mut h = host_handshake(host, 0x77).await.unwrap();
        h.write_all(b"PRI").await.unwrap();
        g.await.unwrap();
    }

    #[tokio::test]
    async fn the_host_gives_up_on_a_guest_that_only_talks() {
        let (host, mut guest) = tokio::io::duplex(1 << 16);
        tokio::spawn(async move {
            let junk = vec![b'x'; 1 << 16];
            while guest.write_all(&junk).await.is_ok() {}
        });
        let e = host_handshake(host, 7).await.err().unwrap();
        assert_eq!(e.kind(), std::io::ErrorKind::InvalidData);
    }

    #[test]
    fn lines_are_found_exactly() {
        let l = line(READY, 0xfeed, None);
        assert_eq!(find(&l, READY, false), Some((0xfeed, 0, l.len())));
        assert_eq!(find(&l[..l.len() - 1], READY, false), None);
        let mut bad = l.clone();
        bad[READY.len() + 3] = b'g';
        assert_eq!(find(&bad, READY, false), None);
        let h = line(HELLO, 7, Some(0x1234));
        assert_eq!(find(&h, HELLO, true), Some((7, 0x1234, h.len())));
        let mut bad = h.clone();
        bad[HELLO.len() + 16] = b'x';
        assert_eq!(find(&bad, HELLO, true), None);
    }
}
