//! One HTTP/1.1 request to 127.0.0.1:<port> inside the sandbox (`Connection: close`, the
//! response read to its end, chunked bodies decoded), with the body bounded: bytes past the
//! limit are read and counted, not kept.

use std::time::Duration;

use opendsec_proto::v1::{HttpHeader, HttpRequestRequest, HttpRequestResponse};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::error::AgentError;

const MAX_HEAD: usize = 64 << 10;

pub async fn request(r: HttpRequestRequest) -> Result<HttpRequestResponse, AgentError> {
    let port = u16::try_from(r.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| AgentError::Invalid(format!("bad port {}", r.port)))?;
    let method = if r.method.is_empty() { "GET" } else { r.method.as_str() };
    if !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(AgentError::Invalid(format!("bad method {method:?}")));
    }
    let path = if r.path.is_empty() { "/" } else { r.path.as_str() };
    if !path.starts_with('/') || path.bytes().any(|b| b <= b' ') {
        return Err(AgentError::Invalid(format!("bad path {path:?}")));
    }
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n");
    for h in &r.headers {
        let bad = |s: &str| s.bytes().any(|b| b == b'\r' || b == b'\n');
        if h.name.is_empty() || bad(&h.name) || bad(&h.value) || h.name.contains(':') {
            return Err(AgentError::Invalid(format!("bad header {:?}", h.name)));
        }
        let n = h.name.to_ascii_lowercase();
        if n == "host" || n == "connection" || n == "content-length" || n == "transfer-encoding" {
            continue;
        }
        head.push_str(&format!("{}: {}\r\n", h.name, h.value));
    }
    head.push_str(&format!("Content-Length: {}\r\n\r\n", r.body.len()));
    let timeout = Duration::from_millis(if r.timeout_ms == 0 { 30_000 } else { r.timeout_ms });
    // The caller's limit, within the cap every hop holds answers to (a whole answer is held in memory).
    let max = if r.max_body_bytes == 0 { 16 << 20 } else { r.max_body_bytes.min(32 << 20) };
    let io = async {
        let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port)).await?;
        s.write_all(head.as_bytes()).await?;
        s.write_all(&r.body).await?;
        let mut raw = Vec::new();
        let mut buf = vec![0u8; 64 << 10];
        let mut dropped = 0u64;
        loop {
            let n = s.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            // Keep the head plus up to `max` raw body bytes (chunk framing counts too).
            let room = (MAX_HEAD as u64).saturating_add(max).saturating_sub(raw.len() as u64) as usize;
            let keep = room.min(n);
            raw.extend_from_slice(&buf[..keep]);
            dropped += (n - keep) as u64;
        }
        Ok::<_, std::io::Error>((raw, dropped))
    };
    let (raw, dropped) = tokio::time::timeout(timeout, io)
        .await
        .map_err(|_| AgentError::Http("timed out".into()))?
        .map_err(|e| AgentError::Http(e.to_string()))?;
    parse_response(&raw, max, dropped)
}

/// Parses a whole HTTP/1.1 response.
pub fn parse_response(raw: &[u8], max: u64, dropped: u64) -> Result<HttpRequestResponse, AgentError> {
    let end = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .ok_or_else(|| AgentError::Http("no complete response head".into()))?;
    let head = String::from_utf8_lossy(&raw[..end]);
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or_default();
    let status = status_line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse::<u32>().ok())
        .ok_or_else(|| AgentError::Http(format!("bad status line {status_line:?}")))?;
    let mut headers = vec![];
    let mut chunked = false;
    for l in lines {
        if let Some((n, v)) = l.split_once(':') {
            let (n, v) = (n.trim(), v.trim());
            if n.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked") {
                chunked = true;
            }
            headers.push(HttpHeader { name: n.to_string(), value: v.to_string() });
        }
    }
    let mut body = raw[end + 4..].to_vec();
    if chunked {
        body = dechunk(&body);
    }
    let mut dropped = dropped;
    if body.len() as u64 > max {
        dropped += body.len() as u64 - max;
        body.truncate(max as usize);
    }
    Ok(HttpRequestResponse { status, headers, body, body_dropped_bytes: dropped })
}

/// Decodes a chunked body as far as it is complete.
fn dechunk(mut b: &[u8]) -> Vec<u8> {
    let mut out = vec![];
    while let Some(eol) = b.windows(2).position(|w| w == b"\r\n") {
        let size_txt = String::from_utf8_lossy(&b[..eol]);
        let size_txt = size_txt.split(';').next().unwrap_or("").trim();
        let Ok(size) = usize::from_str_radix(size_txt, 16) else {
            break;
        };
        b = &b[eol + 2..];
        if size == 0 {
            break;
        }
        let take = size.min(b.len());
        out.extend_from_slice(&b[..take]);
        if take < size || b.len() < size + 2 {
            break;
        }
        b = &b[size + 2..];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses() {
        let r = parse_response(b"HTTP/1.1 201 Created\r\nA: b\r\n\r\nhello", 3, 0).unwrap();
        assert_eq!((r.status, r.body.as_slice(), r.body_dropped_bytes), (201, &b"hel"[..], 2));
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
            100,
            0,
        )
        .unwrap();
        assert_eq!(r.body, b"abcde");
        assert!(parse_response(b"garbage", 1, 0).is_err());
    }
}
