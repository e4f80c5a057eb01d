//! A sandbox's own ports (E2B's `get_host(port)`: web servers, previews, APIs a sandbox
//! serves): an HTTP request to `<port>-<id>.<domain>` (or with `E2b-Sandbox-Id` and
//! `E2b-Sandbox-Port`) goes to that port inside the sandbox through the public API's
//! `HttpRequest`, with the caller's token, and its answer comes back.
//!
//! - The token is the sandbox's `trafficAccessToken` (`e2b-traffic-access-token`, what E2B
//!   asks of a sandbox without public traffic), else an access token. (An `X-API-Key` is the
//!   web app's own business here, passed on to it like any header, never taken as a token.)
//!   A request with none is made for nobody
//!   ([`opendsec_common::grpc::PUBLIC_TRAFFIC_HEADER`]): the apiserver serves it only for a
//!   sandbox created with public traffic (E2B's default, `allowPublicTraffic`), and it is
//!   refused (403, as E2B's proxy answers) for any other.
//! - Bodies are whole messages both ways, bounded: a request by what one Runtime message may
//!   carry ([`MAX_REQUEST`], read within [`BODY_READ`]), an answer by [`MAX_ANSWER`] (a larger
//!   one is 502, not cut). What exchanges hold, from the request's first byte until the client
//!   has read the answer, is bounded per client address and in all ([`Budget`]): past it, 503.
//! - The headers that name the hop (connection, framing, those `Connection` lists, proxy
//!   authorization, the gateway's own routing and tokens) are not passed on; the agent sends
//!   `Host: 127.0.0.1:<port>`. A cookie the sandbox sets is kept to its own host (`Domain=` is
//!   taken out): every sandbox host shares the gateway's domain.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Request, StatusCode};
use axum::response::Response;
use http_body_util::BodyExt;
use opendsec_common::Reason;
use opendsec_proto::v1 as pb;

use crate::error::json_error;
use crate::{Gateway, error, header};

/// The largest request body passed on: what one Runtime message may carry, less its framing.
pub const MAX_REQUEST: usize = (2 << 20) - (64 << 10);
/// The largest answer body passed back.
pub const MAX_ANSWER: usize = 8 << 20;
/// How long a request body may take to arrive.
const BODY_READ: std::time::Duration = std::time::Duration::from_secs(30);

/// Headers that belong to one hop, or to the gateway (routing, the caller's tokens): never
/// passed to the sandbox's server or back.
const HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "transfer-encoding",
    "te",
    "trailer",
    "upgrade",
    "content-length",
    "host",
    "e2b-sandbox-id",
    "e2b-sandbox-port",
    "e2b-traffic-access-token",
    "x-access-token",
    "proxy-authorization",
    "proxy-authenticate",
];

/// Bytes that exchanges with sandbox ports may hold at once: per client address and in all. A
/// request reserves room for its body and the largest answer before reading anything, then
/// keeps what its answer holds until the client has taken it (the reservation goes with the
/// last reference to the bytes).
#[derive(Debug)]
pub(crate) struct Budget {
    per_source: usize,
    total: usize,
    inner: std::sync::Mutex<(usize, std::collections::HashMap<std::net::IpAddr, usize>)>,
}

/// One reservation of a [`Budget`].
#[derive(Debug)]
pub(crate) struct Reserved {
    budget: Arc<Budget>,
    source: Option<std::net::IpAddr>,
    bytes: usize,
}

impl Budget {
    pub(crate) fn new(per_source: usize, total: usize) -> Arc<Budget> {
        Arc::new(Budget { per_source, total, inner: Default::default() })
    }

    fn take(self: &Arc<Self>, source: Option<std::net::IpAddr>, bytes: usize) -> Option<Reserved> {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        let src = source.map(opendsec_common::conn::source_of);
        let held = src.and_then(|s| g.1.get(&s).copied()).unwrap_or(0);
        if g.0 + bytes > self.total || held + bytes > self.per_source {
            return None;
        }
        g.0 += bytes;
        if let Some(s) = src {
            *g.1.entry(s).or_default() += bytes;
        }
        Some(Reserved { budget: self.clone(), source: src, bytes })
    }

    fn give_back(&self, source: Option<std::net::IpAddr>, bytes: usize) {
        let mut g = self.inner.lock().unwrap_or_else(|p| p.into_inner());
        g.0 = g.0.saturating_sub(bytes);
        if let Some(s) = source
            && let Some(h) = g.1.get_mut(&s)
        {
            *h = h.saturating_sub(bytes);
            if *h == 0 {
                g.1.remove(&s);
            }
        }
    }
}

impl Reserved {
    /// Keeps `bytes` of the reservation (an answer smaller than the most it could have been).
    fn shrink(&mut self, bytes: usize) {
        let give = self.bytes.saturating_sub(bytes);
        self.budget.give_back(self.source, give);
        self.bytes -= give;
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        self.budget.give_back(self.source, self.bytes);
    }
}

/// An answer's bytes and the reservation they hold until the last reference goes.
struct Held {
    data: Vec<u8>,
    _reserved: Reserved,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        &self.data
    }
}

/// `Set-Cookie` without its `Domain` attribute: a host-only cookie of the sandbox's own host.
fn host_only(cookie: &str) -> String {
    cookie
        .split(';')
        .enumerate()
        .filter(|(i, a)| *i == 0 || !a.trim_start().to_ascii_lowercase().starts_with("domain"))
        .map(|(_, a)| a)
        .collect::<Vec<_>>()
        .join(";")
}

pub async fn handle(gw: Arc<Gateway>, caller: crate::Caller, id: String, port: u16, req: Request<Body>) -> Response {
    let h = req.headers();
    let token = ["e2b-traffic-access-token", "x-access-token"].into_iter().find_map(|n| header(h, n));
    if h.contains_key("upgrade") {
        return json_error(
            StatusCode::NOT_IMPLEMENTED,
            "protocol upgrades (WebSocket) to a sandbox port are not supported yet",
        );
    }
    let client = match token {
        Some(t) => match gw.client(t, caller) {
            Ok(c) => c,
            Err(e) => return json_error(StatusCode::UNAUTHORIZED, &e.message),
        },
        None => gw.public_client(caller),
    };
    let anonymous = token.is_none();
    let method = req.method().as_str().to_string();
    let path = req.uri().path_and_query().map_or("/", |p| p.as_str()).to_string();
    // Headers the request's `Connection` names belong to this hop too.
    let listed: Vec<String> = h
        .get_all("connection")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(',').map(|n| n.trim().to_ascii_lowercase()))
        .collect();
    let headers: Vec<pb::HttpHeader> = h
        .iter()
        .filter(|(n, _)| !HOP.contains(&n.as_str()) && !listed.iter().any(|l| l == n.as_str()))
        .filter_map(|(n, v)| Some(pb::HttpHeader { name: n.as_str().to_string(), value: v.to_str().ok()?.to_string() }))
        .collect();
    // Room for the whole exchange before any of it is read: the request's body, then the
    // answer's.
    let Some(mut reserved) = gw.ports.take(caller.0, MAX_REQUEST + MAX_ANSWER) else {
        let mut r =
            json_error(StatusCode::SERVICE_UNAVAILABLE, "too many requests to sandbox ports in flight; try again");
        r.headers_mut().insert("retry-after", HeaderValue::from_static("1"));
        return r;
    };
    let body =
        match tokio::time::timeout(BODY_READ, http_body_util::Limited::new(req.into_body(), MAX_REQUEST).collect())
            .await
        {
            Ok(Ok(b)) => b.to_bytes(),
            Ok(Err(e)) => return json_error(StatusCode::PAYLOAD_TOO_LARGE, &format!("request body: {e}")),
            Err(_) => return json_error(StatusCode::REQUEST_TIMEOUT, "the request body did not arrive in time"),
        };
    let call = pb::HttpRequestRequest {
        sandbox_id: id.clone(),
        port: u32::from(port),
        method,
        path,
        headers,
        body: body.into(),
        max_body_bytes: MAX_ANSWER as u64,
        ..Default::default()
    };
    let answer = match client.http_request(call).await {
        Ok(a) => a,
        Err(e) => {
            let e2b = crate::host::e2b_id(&id);
            return match e.reason {
                // A sandbox whose traffic is not public, to a request without a token.
                Reason::PermissionDenied if anonymous => json_error(
                    StatusCode::FORBIDDEN,
                    "this sandbox's ports need its traffic access token (the e2b-traffic-access-token header)",
                ),
                // The agent's answer for a closed port.
                Reason::InvalidState if e.message.contains("nothing listens on port") => {
                    error::port_not_open(&e2b, &port.to_string())
                }
                Reason::NotFound | Reason::InvalidArgument | Reason::PermissionDenied | Reason::InvalidState => {
                    error::sandbox_not_found(&e2b)
                }
                Reason::Unauthenticated => json_error(StatusCode::UNAUTHORIZED, &e.message),
                Reason::DeadlineExceeded => json_error(StatusCode::GATEWAY_TIMEOUT, &e.message),
                _ => json_error(StatusCode::BAD_GATEWAY, &e.message),
            };
        }
    };
    if answer.body_dropped_bytes > 0 {
        return json_error(
            StatusCode::BAD_GATEWAY,
            &format!("the sandbox's answer is larger than {} MiB", MAX_ANSWER >> 20),
        );
    }
    let status = u16::try_from(answer.status).ok().and_then(|s| StatusCode::from_u16(s).ok());
    let Some(status) = status else {
        return json_error(StatusCode::BAD_GATEWAY, &format!("the sandbox answered status {}", answer.status));
    };
    reserved.shrink(answer.body.len());
    let body = bytes::Bytes::from_owner(Held { data: answer.body, _reserved: reserved });
    let mut resp = Response::new(Body::from(body));
    *resp.status_mut() = status;
    let out = resp.headers_mut();
    for hd in &answer.headers {
        let value = if hd.name.eq_ignore_ascii_case("set-cookie") { host_only(&hd.value) } else { hd.value.clone() };
        let (Ok(n), Ok(v)) = (HeaderName::from_bytes(hd.name.as_bytes()), HeaderValue::from_str(&value)) else {
            continue;
        };
        if !HOP.contains(&n.as_str()) {
            out.append(n, v);
        }
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_stay_on_their_host() {
        assert_eq!(host_only("a=1; Domain=.sandbox.localhost; Path=/; HttpOnly"), "a=1; Path=/; HttpOnly");
        assert_eq!(host_only("a=1;domain=x"), "a=1");
        assert_eq!(host_only("domain=1; Secure"), "domain=1; Secure");
    }

    #[test]
    fn answers_are_bounded_per_source_and_in_all() {
        let b = Budget::new(10, 15);
        let (x, y) = (Some("192.0.2.1".parse().unwrap()), Some("192.0.2.2".parse().unwrap()));
        let mut r1 = b.take(x, 8).unwrap();
        assert!(b.take(x, 4).is_none(), "per source");
        r1.shrink(2);
        let r2 = b.take(x, 8).unwrap();
        assert!(b.take(y, 6).is_none(), "in all");
        drop(r2);
        let _r3 = b.take(y, 6).unwrap();
        drop(r1);
        assert_eq!(b.inner.lock().unwrap().1.len(), 1);
    }
}
