//! A sandbox's own ports (E2B's `get_host(port)`: web servers, previews, APIs a sandbox
//! serves): an HTTP request to `<port>-<id>.<domain>` (or with `E2b-Sandbox-Id` and
//! `E2b-Sandbox-Port`) goes to that port inside the sandbox through the public API's
//! `HttpRequest`, with the caller's token, and its answer comes back.
//!
//! - The token is the sandbox's `trafficAccessToken` (`e2b-traffic-access-token`, what E2B
//!   asks of a sandbox without public traffic), else an access token or an API key (a caller
//!   that may run commands in the sandbox may reach its ports). A request with none is made
//!   for nobody ([`opendsec_common::grpc::PUBLIC_TRAFFIC_HEADER`]): the apiserver serves it
//!   only for a sandbox created with public traffic (E2B's default, `allowPublicTraffic`),
//!   and it is refused (403, as E2B's proxy answers) for any other.
//! - Bodies are whole messages both ways, bounded ([`MAX_BODY`]): an answer larger than that
//!   is refused (502), not cut. A protocol upgrade (WebSocket) is refused (501).
//! - The headers that name the hop (connection, framing, the gateway's own routing and
//!   authentication headers) are not passed on; the agent sends `Host: 127.0.0.1:<port>`.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderName, HeaderValue, Request, StatusCode};
use axum::response::Response;
use http_body_util::BodyExt;
use opendsec_common::Reason;
use opendsec_proto::v1 as pb;

use crate::error::json_error;
use crate::{Gateway, error, header};

/// The largest request or answer body passed through (the agent keeps at most this much of an
/// answer).
pub const MAX_BODY: usize = 32 << 20;

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
    "x-api-key",
];

pub async fn handle(gw: Arc<Gateway>, caller: crate::Caller, id: String, port: u16, req: Request<Body>) -> Response {
    let h = req.headers();
    let token = ["e2b-traffic-access-token", "x-access-token", "x-api-key"].into_iter().find_map(|n| header(h, n));
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
    let headers: Vec<pb::HttpHeader> = h
        .iter()
        .filter(|(n, _)| !HOP.contains(&n.as_str()))
        .filter_map(|(n, v)| Some(pb::HttpHeader { name: n.as_str().to_string(), value: v.to_str().ok()?.to_string() }))
        .collect();
    let body = match http_body_util::Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return json_error(StatusCode::PAYLOAD_TOO_LARGE, &format!("request body: {e}")),
    };
    let call = pb::HttpRequestRequest {
        sandbox_id: id.clone(),
        port: u32::from(port),
        method,
        path,
        headers,
        body: body.to_vec(),
        max_body_bytes: MAX_BODY as u64,
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
            &format!("the sandbox's answer is larger than {} MiB", MAX_BODY >> 20),
        );
    }
    let status = u16::try_from(answer.status).ok().and_then(|s| StatusCode::from_u16(s).ok());
    let Some(status) = status else {
        return json_error(StatusCode::BAD_GATEWAY, &format!("the sandbox answered status {}", answer.status));
    };
    let mut resp = Response::new(Body::from(answer.body));
    *resp.status_mut() = status;
    let out = resp.headers_mut();
    for hd in &answer.headers {
        let (Ok(n), Ok(v)) = (HeaderName::from_bytes(hd.name.as_bytes()), HeaderValue::from_str(&hd.value)) else {
            continue;
        };
        if !HOP.contains(&n.as_str()) {
            out.append(n, v);
        }
    }
    resp
}
