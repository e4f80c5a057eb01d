//! The code interpreter's API (port 49999, `e2b-code-interpreter`; reference/e2b-protocol.md
//! section 5) on the `Runtime` API's code contexts: `/execute` streams NDJSON lines as the
//! kernel produces them; `/contexts` creates, lists, restarts and removes contexts.
//!
//! The SDK sends `X-Access-Token` on `/execute` only, and `E2B-Traffic-Access-Token` on every
//! call when the sandbox has a traffic token: both are the caller's key (see api.rs).

use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderValue, Method, Request, StatusCode, header as h};
use axum::response::Response;
use bytes::Bytes;
use futures::StreamExt;
use http_body_util::BodyExt;
use opendsec_common::{ApiError, Reason};
use opendsec_proto::v1 as pb;
use serde_json::{Value, json};

use crate::sandbox::Ctx;
use crate::{Gateway, error, header, model};

const MAX_BODY: usize = 16 << 20;

fn rest(status: StatusCode, message: impl AsRef<str>) -> Response {
    error::json_error(status, message.as_ref())
}

type Call = Ctx;

impl Ctx {
    /// A failed call's answer: 502 when the sandbox is gone (the SDK turns it into "the
    /// sandbox timed out"), else the error's status.
    async fn fail_http(&self, e: &ApiError) -> Response {
        if self.gone().await {
            return error::sandbox_not_found(&self.id);
        }
        let status = match e.reason {
            Reason::NotFound => StatusCode::NOT_FOUND,
            Reason::InvalidArgument => StatusCode::BAD_REQUEST,
            Reason::InvalidState => StatusCode::SERVICE_UNAVAILABLE,
            Reason::Unauthenticated => StatusCode::UNAUTHORIZED,
            Reason::PermissionDenied => StatusCode::FORBIDDEN,
            Reason::RateLimited | Reason::QuotaExceeded => StatusCode::TOO_MANY_REQUESTS,
            _ => StatusCode::INTERNAL_SERVER_ERROR,
        };
        rest(status, e.message.clone())
    }
}

pub async fn handle(gw: Arc<Gateway>, caller: crate::Caller, id: String, req: Request<Body>) -> Response {
    let hs = req.headers();
    let token = header(hs, "x-access-token").or_else(|| header(hs, "e2b-traffic-access-token")).map(str::to_string);
    let Some(token) = token else {
        return rest(
            StatusCode::UNAUTHORIZED,
            "no access token: connect to the sandbox through Sandbox.create or Sandbox.connect",
        );
    };
    let client = match gw.client(&token, caller) {
        Ok(c) => c,
        Err(e) => return rest(StatusCode::UNAUTHORIZED, e.message),
    };
    let call = Ctx { gw: gw.clone(), client, id, user: String::new() };
    let method = req.method().clone();
    let path = req.uri().path().trim_end_matches('/').to_string();
    let body = match http_body_util::Limited::new(req.into_body(), MAX_BODY).collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return rest(StatusCode::PAYLOAD_TOO_LARGE, format!("request body: {e}")),
    };
    let segs: Vec<&str> = path.split('/').skip(1).collect();
    match (&method, segs.as_slice()) {
        (&Method::POST, ["execute"]) => execute(&gw, &call, &body).await,
        (&Method::POST, ["contexts"]) => create(&gw, &call, &body).await,
        (&Method::GET, ["contexts"]) => list(&call).await,
        (&Method::POST, ["contexts", ctx, "restart"]) => restart(&call, ctx).await,
        (&Method::DELETE, ["contexts", ctx]) => remove(&call, ctx).await,
        (&Method::GET, ["health"]) => match call.client.get_sandbox(&call.id).await {
            Ok(sb) if sb.state == pb::SandboxState::Running as i32 => Response::new(Body::from("OK")),
            Err(e) if e.reason == Reason::Unauthenticated => rest(StatusCode::UNAUTHORIZED, e.message),
            _ => error::sandbox_not_found(&call.id),
        },
        _ => rest(StatusCode::NOT_FOUND, format!("no such endpoint: {method} {path}")),
    }
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct ExecuteRequest {
    code: String,
    context_id: Option<String>,
    language: Option<String>,
    env_vars: Option<std::collections::HashMap<String, String>>,
}

/// One NDJSON line of an event.
pub fn line_of(ev: pb::CodeEvent) -> Option<Value> {
    use pb::code_event::Kind;
    Some(match ev.kind? {
        Kind::Output(o) => json!({
            "type": if o.stderr { "stderr" } else { "stdout" },
            "text": o.text,
            "timestamp": model::rfc3339(o.at_ms),
        }),
        Kind::Result(r) => result_line(&r),
        Kind::Error(e) => json!({"type": "error", "name": e.name, "value": e.value, "traceback": e.traceback}),
        Kind::ExecutionCount(n) => json!({"type": "number_of_executions", "execution_count": n}),
    })
}

/// A result line: the MIME bundle's known types under E2B's names, the rest in `extra`.
fn result_line(r: &pb::CodeResult) -> Value {
    let data: serde_json::Map<String, Value> = serde_json::from_str(&r.data_json).unwrap_or_default();
    let mut line = json!({"type": "result", "is_main_result": r.main});
    let mut extra = serde_json::Map::new();
    for (mime, v) in data {
        let key = match mime.as_str() {
            "text/plain" => "text",
            "text/html" => "html",
            "text/markdown" => "markdown",
            "image/svg+xml" => "svg",
            "image/png" => "png",
            "image/jpeg" => "jpeg",
            "application/pdf" => "pdf",
            "text/latex" => "latex",
            "application/json" => "json",
            "application/javascript" => "javascript",
            _ => {
                extra.insert(mime, v);
                continue;
            }
        };
        // Jupyter may split text into lines (a list of strings).
        let v = match v {
            Value::Array(parts) if key != "json" => Value::String(parts.iter().filter_map(Value::as_str).collect()),
            v => v,
        };
        let v = match v {
            // Base64 images may carry line breaks.
            Value::String(s) if matches!(key, "png" | "jpeg" | "pdf") => Value::String(s.replace('\n', "")),
            // A text in quotes (a string's repr) loses them, as E2B's code interpreter shows it.
            Value::String(s) if key == "text" => Value::String(unquoted(&s).to_string()),
            v => v,
        };
        line[key] = v;
    }
    if !extra.is_empty() {
        line["extra"] = Value::Object(extra);
    }
    line
}

/// `s` without the quotes around it, if it starts and ends with the same one.
fn unquoted(s: &str) -> &str {
    let b = s.as_bytes();
    if b.len() >= 2 && (b[0] == b'\'' || b[0] == b'"') && b[b.len() - 1] == b[0] { &s[1..s.len() - 1] } else { s }
}

async fn execute(gw: &Gateway, call: &Call, body: &[u8]) -> Response {
    let req: ExecuteRequest = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return rest(StatusCode::BAD_REQUEST, format!("request body: {e}")),
    };
    if req.context_id.is_some() && req.language.is_some() {
        return rest(StatusCode::BAD_REQUEST, "context_id and language: give one of them");
    }
    let run = pb::RunCodeRequest {
        sandbox_id: call.id.clone(),
        context_id: req.context_id.unwrap_or_default(),
        language: req.language.unwrap_or_default(),
        code: req.code,
        env: req.env_vars.unwrap_or_default(),
        timeout_ms: 0,
        user: gw.cfg.default_user.clone(),
    };
    let mut events = match call.client.run_code(run).await {
        Ok(s) => s,
        Err(e) => return call.fail_http(&e).await,
    };
    // The first event (or error) decides between an error status and the stream.
    let first = events.next().await;
    let first = match first {
        Some(Err(s)) => {
            let e = ApiError::from_status(&s);
            if e.reason != Reason::DeadlineExceeded {
                return call.fail_http(&e).await;
            }
            Some(Err(s))
        }
        other => other,
    };
    // A run whose sandbox ended under it breaks the connection off, as E2B's does (the SDK
    // then finds the sandbox gone and says it was killed); other failures are error lines.
    let (client, id) = (call.client.clone(), call.id.clone());
    let lines = futures::stream::iter(first).chain(events).then(move |ev| {
        let (client, id) = (client.clone(), id.clone());
        async move {
            match ev {
                Ok(ev) => Ok(line_of(ev)),
                Err(_) if crate::sandbox::sandbox_gone(&client, &id).await => {
                    Err(std::io::Error::new(std::io::ErrorKind::ConnectionAborted, "the sandbox ended"))
                }
                Err(s) => {
                    Ok(Some(json!({"type": "error", "name": "ExecutionError", "value": s.message(), "traceback": ""})))
                }
            }
        }
    });
    // (hyper breaks the connection off at the first error and reads no further: nothing,
    // not even the end line, follows a broken-off run.)
    let end = futures::stream::once(async { Ok(Bytes::from_static(b"{\"type\":\"end_of_execution\"}\n")) });
    let lines = lines.filter_map(|l| async move { l.map(|l| l.map(|l| Bytes::from(format!("{l}\n")))).transpose() });
    let mut r = Response::new(Body::from_stream(lines.chain(end)));
    r.headers_mut().insert(h::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r
}

#[derive(Debug, Default, serde::Deserialize)]
#[serde(default)]
struct CreateRequest {
    language: Option<String>,
    cwd: Option<String>,
}

fn context_json(c: &pb::CodeContext) -> Value {
    json!({"id": c.id, "language": c.language, "cwd": c.cwd})
}

async fn create(gw: &Gateway, call: &Call, body: &[u8]) -> Response {
    let req: CreateRequest = if body.iter().all(u8::is_ascii_whitespace) {
        CreateRequest::default()
    } else {
        match serde_json::from_slice(body) {
            Ok(r) => r,
            Err(e) => return rest(StatusCode::BAD_REQUEST, format!("request body: {e}")),
        }
    };
    let r = pb::CreateCodeContextRequest {
        sandbox_id: call.id.clone(),
        language: req.language.unwrap_or_default(),
        cwd: req.cwd.unwrap_or_default(),
        user: gw.cfg.default_user.clone(),
    };
    match call.client.create_code_context(r).await {
        Ok(c) => crate::connect::json_response(StatusCode::OK, &context_json(&c)),
        Err(e) => call.fail_http(&e).await,
    }
}

async fn list(call: &Call) -> Response {
    match call.client.list_code_contexts(pb::ListCodeContextsRequest { sandbox_id: call.id.clone() }).await {
        Ok(l) => {
            let v: Vec<Value> = l.contexts.iter().map(context_json).collect();
            crate::connect::json_response(StatusCode::OK, &v)
        }
        Err(e) => call.fail_http(&e).await,
    }
}

async fn restart(call: &Call, ctx: &str) -> Response {
    let r = pb::CodeContextRequest { sandbox_id: call.id.clone(), context_id: ctx.to_string() };
    match call.client.restart_code_context(r).await {
        Ok(c) => crate::connect::json_response(StatusCode::OK, &context_json(&c)),
        Err(e) => call.fail_http(&e).await,
    }
}

async fn remove(call: &Call, ctx: &str) -> Response {
    let r = pb::CodeContextRequest { sandbox_id: call.id.clone(), context_id: ctx.to_string() };
    match call.client.remove_code_context(r).await {
        Ok(_) => {
            let mut r = Response::new(Body::empty());
            *r.status_mut() = StatusCode::NO_CONTENT;
            r
        }
        Err(e) => call.fail_http(&e).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_use_e2b_names_and_keep_unknown_types() {
        let r = pb::CodeResult {
            data_json: r#"{"text/plain":"2","image/png":"iVBO\nRw==","application/vnd.custom":{"a":1},"text/html":["<b>","x</b>"]}"#.into(),
            main: true,
        };
        let l = result_line(&r);
        assert_eq!(l["type"], "result");
        assert_eq!(l["text"], "2");
        assert_eq!(l["png"], "iVBORw==");
        assert_eq!(l["html"], "<b>x</b>");
        assert_eq!(l["is_main_result"], true);
        assert_eq!(l["extra"]["application/vnd.custom"]["a"], 1);
        // A string's repr shows as the string.
        for (plain, shown) in [("'x y'", "x y"), ("\"q\"", "q"), ("('a', 'b')", "('a', 'b')"), ("'", "'"), ("''", "")] {
            let r = pb::CodeResult { data_json: json!({"text/plain": plain}).to_string(), main: true };
            assert_eq!(result_line(&r)["text"], shown, "{plain}");
        }
    }

    #[test]
    fn events_become_ndjson_lines() {
        use pb::code_event::Kind;
        let out = line_of(pb::CodeEvent {
            kind: Some(Kind::Output(pb::CodeOutput { stderr: false, text: "hi\n".into(), at_ms: 0 })),
        })
        .unwrap();
        assert_eq!((out["type"].as_str(), out["text"].as_str()), (Some("stdout"), Some("hi\n")));
        let n = line_of(pb::CodeEvent { kind: Some(Kind::ExecutionCount(3)) }).unwrap();
        assert_eq!(n["execution_count"], 3);
        assert!(line_of(pb::CodeEvent { kind: None }).is_none());
    }
}
