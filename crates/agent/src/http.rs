//! One HTTP/1.1 request to 127.0.0.1:<port> inside the sandbox, through hyper's client
//! connection (framing, chunked bodies, informational answers, HEAD and malformed answers are
//! hyper's to get right), with the body bounded: bytes past the limit are read and counted,
//! not kept. The connection is closed after the one exchange (`Connection: close`).

use std::time::Duration;

use bytes::Bytes;
use http::header::{CONNECTION, CONTENT_LENGTH, HOST, HeaderName, HeaderValue, TRANSFER_ENCODING};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use opendsec_proto::v1::{HttpHeader, HttpRequestRequest, HttpRequestResponse};

use crate::error::AgentError;

/// Bytes of a response head the agent reads before it gives up (hyper's read buffer).
const MAX_HEAD: usize = 64 << 10;
/// The body kept when the caller names no limit, and the most it may name: a whole answer is
/// held in memory at every hop.
const DEFAULT_BODY: u64 = 16 << 20;
const MAX_BODY: u64 = 32 << 20;
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(30);

/// A checked request: where to send it, what, how much body to keep, and for how long.
#[derive(Debug)]
pub struct Prepared {
    pub port: u16,
    pub request: http::Request<Full<Bytes>>,
    pub max_body: u64,
    pub timeout: Duration,
}

/// Checks a caller's request and builds it. Refused: port 0 or above 65535, a method that is
/// not an upper-case token, a path that is not absolute or holds spaces or controls, header
/// names or values HTTP does not allow. `Host`, `Connection`, `Content-Length` and
/// `Transfer-Encoding` are the agent's own and are not taken from the caller.
pub fn prepare(mut r: HttpRequestRequest) -> Result<Prepared, AgentError> {
    let port = u16::try_from(r.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| AgentError::Invalid(format!("bad port {}", r.port)))?;
    let method = if r.method.is_empty() { "GET" } else { r.method.as_str() };
    if !method.bytes().all(|b| b.is_ascii_uppercase()) {
        return Err(AgentError::Invalid(format!("bad method {method:?}")));
    }
    let method = http::Method::from_bytes(method.as_bytes())
        .map_err(|_| AgentError::Invalid(format!("bad method {method:?}")))?;
    let path = if r.path.is_empty() { "/" } else { r.path.as_str() };
    if !path.starts_with('/') || path.bytes().any(|b| b <= b' ' || b == 0x7f) {
        return Err(AgentError::Invalid(format!("bad path {path:?}")));
    }
    let uri: http::Uri = path.parse().map_err(|_| AgentError::Invalid(format!("bad path {path:?}")))?;
    let body = std::mem::take(&mut r.body);
    let body_len = body.len();
    let mut request = http::Request::new(Full::new(Bytes::from(body)));
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    let headers = request.headers_mut();
    for h in &r.headers {
        let bad = || AgentError::Invalid(format!("bad header {:?}", h.name));
        let name = HeaderName::from_bytes(h.name.as_bytes()).map_err(|_| bad())?;
        let value = HeaderValue::from_str(&h.value).map_err(|_| bad())?;
        if [HOST, CONNECTION, CONTENT_LENGTH, TRANSFER_ENCODING].contains(&name) {
            continue;
        }
        headers.append(name, value);
    }
    let host = HeaderValue::try_from(format!("127.0.0.1:{port}")).expect("an address is a header value");
    headers.insert(HOST, host);
    headers.insert(CONNECTION, HeaderValue::from_static("close"));
    headers.insert(CONTENT_LENGTH, HeaderValue::from(body_len));
    let max_body = if r.max_body_bytes == 0 { DEFAULT_BODY } else { r.max_body_bytes.min(MAX_BODY) };
    let timeout = if r.timeout_ms == 0 { DEFAULT_TIMEOUT } else { Duration::from_millis(r.timeout_ms) };
    Ok(Prepared { port, request, max_body, timeout })
}

/// Sends the request and reads the whole answer within the request's timeout.
pub async fn request(r: HttpRequestRequest) -> Result<HttpRequestResponse, AgentError> {
    let p = prepare(r)?;
    tokio::time::timeout(p.timeout, exchange(p.port, p.request, p.max_body))
        .await
        .map_err(|_| AgentError::Http("timed out".into()))?
}

fn http_err(what: &str) -> impl FnOnce(hyper::Error) -> AgentError + '_ {
    move |e| {
        let mut msg = format!("{what}: {e}");
        if let Some(c) = std::error::Error::source(&e) {
            msg.push_str(&format!(": {c}"));
        }
        AgentError::Http(msg)
    }
}

async fn exchange(
    port: u16,
    request: http::Request<Full<Bytes>>,
    max_body: u64,
) -> Result<HttpRequestResponse, AgentError> {
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", port)).await.map_err(|e| match e.kind() {
        std::io::ErrorKind::ConnectionRefused => AgentError::PortClosed(port),
        _ => AgentError::Http(format!("connect to port {port}: {e}")),
    })?;
    let (mut send, conn) = hyper::client::conn::http1::Builder::new()
        .max_buf_size(MAX_HEAD)
        .handshake::<_, Full<Bytes>>(TokioIo::new(tcp))
        .await
        .map_err(http_err("handshake"))?;
    let answer = async move {
        let resp = send.send_request(request).await.map_err(http_err("request"))?;
        let status = u32::from(resp.status().as_u16());
        let headers = resp
            .headers()
            .iter()
            .map(|(n, v)| HttpHeader {
                name: n.as_str().to_string(),
                value: String::from_utf8_lossy(v.as_bytes()).into(),
            })
            .collect();
        let mut body = resp.into_body();
        let (mut kept, mut dropped) = (Vec::new(), 0u64);
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(http_err("reading the body"))?;
            let Ok(data) = frame.into_data() else { continue };
            let room = usize::try_from(max_body.saturating_sub(kept.len() as u64)).unwrap_or(usize::MAX);
            let keep = room.min(data.len());
            kept.extend_from_slice(&data[..keep]);
            dropped += (data.len() - keep) as u64;
        }
        Ok(HttpRequestResponse { status, headers, body: kept, body_dropped_bytes: dropped })
    };
    // The connection is driven beside the exchange; it ends once the answer is read (or fails,
    // which fails the exchange too).
    let mut conn = std::pin::pin!(conn);
    let mut answer = std::pin::pin!(answer);
    let mut conn_done = false;
    loop {
        tokio::select! {
            r = &mut answer => return r,
            c = &mut conn, if !conn_done => {
                conn_done = true;
                c.map_err(http_err("connection"))?;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(f: impl FnOnce(&mut HttpRequestRequest)) -> HttpRequestRequest {
        let mut r = HttpRequestRequest { port: 80, ..Default::default() };
        f(&mut r);
        r
    }

    #[test]
    fn requests_are_checked_and_the_agent_sets_its_own_framing() {
        for bad in [
            req(|r| r.port = 0),
            req(|r| r.port = 70_000),
            req(|r| r.method = "get".into()),
            req(|r| r.method = "G ET".into()),
            req(|r| r.path = "x".into()),
            req(|r| r.path = "/a b".into()),
            req(|r| r.path = "/a\u{7f}".into()),
            req(|r| r.headers = vec![HttpHeader { name: "a:b".into(), value: "v".into() }]),
            req(|r| r.headers = vec![HttpHeader { name: "x".into(), value: "v\r\nInjected: 1".into() }]),
            req(|r| r.headers = vec![HttpHeader { name: String::new(), value: "v".into() }]),
        ] {
            assert!(matches!(prepare(bad.clone()), Err(AgentError::Invalid(_))), "{bad:?}");
        }
        let p = prepare(req(|r| {
            r.body = b"abc".to_vec();
            r.headers = vec![
                HttpHeader { name: "X-A".into(), value: "1".into() },
                HttpHeader { name: "Content-Length".into(), value: "999".into() },
                HttpHeader { name: "Transfer-Encoding".into(), value: "chunked".into() },
                HttpHeader { name: "Host".into(), value: "evil".into() },
            ];
            r.max_body_bytes = u64::MAX;
        }))
        .unwrap();
        let h = p.request.headers();
        assert_eq!(h["x-a"], "1");
        assert_eq!(h[CONTENT_LENGTH], "3");
        assert!(!h.contains_key(TRANSFER_ENCODING));
        assert_eq!(h[HOST], "127.0.0.1:80");
        assert_eq!(h[CONNECTION], "close");
        assert_eq!((p.request.method(), p.request.uri().path()), (&http::Method::GET, "/"));
        assert_eq!(p.max_body, MAX_BODY);
        assert_eq!(p.timeout, DEFAULT_TIMEOUT);
    }
}
