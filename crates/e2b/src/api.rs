//! E2B's control-plane REST API (reference/e2b-protocol.md section 2) on the public API.
//!
//! Mapping: a template is an image (`e2b.templates`, else the image of that name) in the
//! caller's project; metadata are the sandbox's labels; envVars its environment; `timeout`
//! (seconds from now) sets both the idle and the lifetime TTL so the sandbox ends then, as
//! E2B's does; pause, resume and connect are the lifecycle calls. Sandbox ids are opendsec's,
//! verbatim.

use std::collections::HashMap;
use std::sync::Arc;

use axum::body::Body;
use axum::http::{HeaderValue, Method, Request, StatusCode};
use axum::response::Response;
use http_body_util::BodyExt;
use opendsec_client::Client;
use opendsec_common::egress::Rule;
use opendsec_common::{ApiError, Reason};
use opendsec_proto::v1 as pb;
use pb::SandboxState as St;

use crate::error::RestError;
use crate::model::{self, NewSandbox};
use crate::{ENVD_VERSION, Gateway, header};

/// Largest REST request body.
const MAX_BODY: usize = 1 << 20;
/// E2B's default sandbox timeout.
const DEFAULT_TIMEOUT_S: u64 = 300;

type Result<T> = std::result::Result<T, RestError>;

pub async fn handle(gw: Arc<Gateway>, caller: crate::Caller, req: Request<Body>) -> Response {
    match dispatch(&gw, caller, req).await {
        Ok(r) => r,
        Err(e) => e.response(),
    }
}

struct Call {
    client: Client,
    query: Vec<(String, String)>,
    /// The lease an `Idempotency-Key` stands for ([`lease_of`]).
    idempotency_lease: Option<String>,
}

impl Call {
    fn param(&self, name: &str) -> Option<&str> {
        self.query.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str()).filter(|v| !v.is_empty())
    }
}

async fn dispatch(gw: &Gateway, caller: crate::Caller, req: Request<Body>) -> Result<Response> {
    let Some(key) = header(req.headers(), "x-api-key").map(str::to_string) else {
        return Err(RestError::unauthorized("no API key: set E2B_API_KEY to an opendsec token"));
    };
    let client = gw.client(&key, caller).map_err(RestError::from)?;
    let query =
        req.uri().query().map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect()).unwrap_or_default();
    let token = opendsec_common::config::token_of_e2b_key(&key).unwrap_or_else(|| key.clone());
    let idempotency_lease = header(req.headers(), "idempotency-key").map(|k| lease_of(&token, k));
    let call = Call { client, query, idempotency_lease };
    let method = req.method().clone();
    let path = req.uri().path().trim_end_matches('/').to_string();
    let body = read_body(req.into_body()).await?;
    let mut segs: Vec<&str> = path.split('/').skip(1).collect();
    // Sandbox ids as E2B shows them (`<edge>-<lease>`) stand for opendsec's (`<edge>.<lease>`).
    let at = if segs.first() == Some(&"v2") { 2 } else { 1 };
    let id = segs.get(at).filter(|_| segs.get(at - 1) == Some(&"sandboxes")).map(|i| crate::host::opendsec_id(i));
    if let Some(id) = &id {
        segs[at] = id.as_str();
    }
    match (&method, segs.as_slice()) {
        (&Method::POST, ["sandboxes"] | ["v2", "sandboxes"]) => create(gw, &call, &body).await,
        (&Method::GET, ["v2", "sandboxes"]) => list(gw, &call, true).await,
        (&Method::GET, ["sandboxes"]) => list(gw, &call, false).await,
        (&Method::GET, ["sandboxes", id]) => detail(gw, &call, id).await,
        (&Method::DELETE, ["sandboxes", id]) => kill(&call, id).await,
        (&Method::POST, ["sandboxes", id, "timeout"]) => timeout(&call, id, &body).await,
        (&Method::POST, ["sandboxes", id, "refreshes"]) => refresh(&call, id, &body).await,
        (&Method::POST, ["sandboxes", id, "pause"]) => pause(&call, id).await,
        (&Method::POST, ["v2", "sandboxes", id, "connect"] | ["sandboxes", id, "connect" | "resume"]) => {
            connect(gw, &call, id, &body).await
        }
        (&Method::PUT, ["sandboxes", id, "network"]) => network(&call, id, &body).await,
        (&Method::GET, ["sandboxes", id, "metrics"]) => metrics(&call, id).await,
        (&Method::POST, ["sandboxes", id, "snapshots"]) => snapshot(&call, id, &body).await,
        (&Method::POST, ["sandboxes", id, "fork"]) => fork(gw, &call, id, &body).await,
        (&Method::GET, ["snapshots"]) => list_snapshots(&call).await,
        (&Method::DELETE, ["templates", id]) => delete_snapshot(&call, id).await,
        (_, ["sandboxes", _, "logs"] | ["snapshots" | "templates", ..]) => Err(RestError::new(
            StatusCode::NOT_IMPLEMENTED,
            format!("{method} {path} is not supported yet (docs/e2b.md)"),
        )),
        _ => Err(RestError::not_found(format!("no such endpoint: {method} {path}"))),
    }
}

/// E2B's snapshot request: an optional name; `memory: true` asks for what containers cannot
/// keep.
#[derive(Debug, Default, serde::Deserialize)]
struct SnapshotReq {
    name: Option<String>,
    memory: Option<bool>,
}

#[derive(Debug, Default, serde::Deserialize)]
struct ForkReq {
    timeout: Option<u64>,
    count: Option<u32>,
}

/// The E2B snapshot id of an image: its `repo:tag` in the caller's project, which
/// `Sandbox.create(snapshot_id)` then names as its template.
fn snapshot_info(img: &pb::Image) -> serde_json::Value {
    let id = format!("{}:{}", img.repo, img.tag);
    serde_json::json!({"snapshotID": id, "names": [id]})
}

/// A snapshot of the sandbox's file system (E2B's `create_snapshot`), as an image of its
/// project: `name`, or `snapshots/<lease>:<ms>`.
async fn snapshot(call: &Call, id: &str, body: &[u8]) -> Result<Response> {
    let req: SnapshotReq = parse(body)?;
    if req.memory == Some(true) {
        return Err(RestError::bad_request(
            "memory snapshots are not supported: a container snapshot keeps the file system",
        ));
    }
    live(call, id).await?;
    let name = match req.name.filter(|n| !n.is_empty()) {
        Some(n) => n,
        None => {
            let lease = opendsec_common::ids::split_sandbox_id(id).map(|(_, l)| l.to_string()).unwrap_or_default();
            format!("snapshots/{lease}:{}", now_ms())
        }
    };
    match call.client.create_snapshot(id, &name, false).await {
        Ok(s) => Ok(json(StatusCode::CREATED, &snapshot_info(&s.image.unwrap_or_default()))),
        Err(e) if e.reason == Reason::NotFound => Err(not_found(id)),
        Err(e) => Err(e.into()),
    }
}

/// E2B's fork: copies of the sandbox's file system (not its memory), one result per copy.
async fn fork(gw: &Gateway, call: &Call, id: &str, body: &[u8]) -> Result<Response> {
    let req: ForkReq = parse(body)?;
    live(call, id).await?;
    let count = req.count.unwrap_or(1);
    let freq = pb::ForkSandboxRequest { id: id.to_string(), count, ..Default::default() };
    let mut stream = match call.client.fork_sandbox(freq).await {
        Ok(s) => s,
        Err(e) if e.reason == Reason::NotFound => return Err(not_found(id)),
        Err(e) => return Err(e.into()),
    };
    let mut out = Vec::new();
    loop {
        let item = match stream.message().await {
            Ok(Some(i)) => i,
            Ok(None) => break,
            Err(st) => return Err(ApiError::from_status(&st).into()),
        };
        let made = match (item.sandbox, item.error) {
            (Some(sb), _) => match req.timeout {
                Some(t) => set_end(call, &sb, t).await.map_err(RestError::from),
                None => Ok(sb),
            },
            (None, Some(e)) => {
                Err(RestError::from(ApiError::new(Reason::parse(&e.reason).unwrap_or(Reason::Internal), e.message)))
            }
            (None, None) => Err(RestError::new(StatusCode::INTERNAL_SERVER_ERROR, "a fork answered nothing")),
        };
        let made = match made {
            Ok(sb) => sandbox_tokens(call, &sb.id).await.map(|t| (sb, t)),
            Err(e) => Err(e),
        };
        out.push(match made {
            Ok((sb, tokens)) => serde_json::json!({"sandbox": sandbox_answer(gw, &sb, &tokens)}),
            Err(e) => serde_json::json!({"error": {"code": e.status.as_u16(), "message": e.message}}),
        });
    }
    Ok(json(StatusCode::CREATED, &out))
}

/// The caller's snapshots (images made by snapshots in its project), by name, paged.
async fn list_snapshots(call: &Call) -> Result<Response> {
    let limit = match call.param("limit") {
        None => 100,
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=1000).contains(l))
            .ok_or_else(|| RestError::bad_request(format!("limit must be 1..=1000, got {l:?}")))?,
    };
    let source = call.param("sandboxID").map(|s| format!("snapshot:{}", crate::host::opendsec_id(s)));
    let list = call.client.list_images(pb::ListImagesRequest { project: String::new(), recursive: false }).await?;
    let mut snaps: Vec<pb::Image> = list
        .images
        .into_iter()
        .filter(|i| match &source {
            Some(s) => &i.source == s,
            None => i.source.starts_with("snapshot:"),
        })
        .filter(|i| call.param("name").is_none_or(|n| format!("{}:{}", i.repo, i.tag) == n || i.repo == n))
        .collect();
    snaps.sort_by_key(|i| format!("{}:{}", i.repo, i.tag));
    if let Some(after) = call.param("nextToken") {
        snaps.retain(|i| format!("{}:{}", i.repo, i.tag).as_str() > after);
    }
    let more = snaps.len() > limit;
    snaps.truncate(limit);
    let body: Vec<serde_json::Value> = snaps.iter().map(snapshot_info).collect();
    let mut r = json(StatusCode::OK, &body);
    if more && let Some(last) = snaps.last() {
        let token = format!("{}:{}", last.repo, last.tag);
        if let Ok(v) = axum::http::HeaderValue::from_str(&token) {
            r.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(r)
}

/// `DELETE /templates/{id}`: E2B's delete_snapshot, the image of that name in the caller's
/// project (404 when there is none).
async fn delete_snapshot(call: &Call, id: &str) -> Result<Response> {
    let name = percent_decode(id);
    match call.client.delete_image(pb::DeleteImageRequest { project: String::new(), name: name.clone() }).await {
        Ok(_) => Ok(no_content()),
        Err(e) if matches!(e.reason, Reason::NotFound | Reason::InvalidArgument) => {
            Err(RestError::not_found(format!("snapshot {name:?} not found")))
        }
        Err(e) => Err(e.into()),
    }
}

async fn read_body(body: Body) -> Result<bytes::Bytes> {
    let limited = http_body_util::Limited::new(body, MAX_BODY);
    match limited.collect().await {
        Ok(b) => Ok(b.to_bytes()),
        Err(e) => {
            Err(RestError::new(StatusCode::PAYLOAD_TOO_LARGE, format!("request body: {e} (at most {MAX_BODY} bytes)")))
        }
    }
}

fn parse<T: serde::de::DeserializeOwned + Default>(body: &[u8]) -> Result<T> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(body).map_err(|e| RestError::bad_request(format!("request body: {e}")))
}

fn json<T: serde::Serialize>(status: StatusCode, v: &T) -> Response {
    crate::connect::json_response(status, v)
}

fn no_content() -> Response {
    let mut r = Response::new(Body::empty());
    *r.status_mut() = StatusCode::NO_CONTENT;
    r
}

/// The egress rules of E2B's network options (`None`: the cluster's default).
fn egress_of(allow_internet: Option<bool>, net: Option<&model::Network>) -> Result<Option<Vec<pb::EgressRule>>> {
    let mut rules: Option<Vec<String>> = allow_internet.map(|a| if a { vec!["*".to_string()] } else { vec![] });
    if let Some(n) = net {
        if n.dns_servers.as_ref().is_some_and(|d| !d.is_empty()) {
            return Err(RestError::bad_request(
                "network.dnsServers is not supported: sandboxes resolve through their edge's DNS proxy",
            ));
        }
        if n.egress_proxy.as_ref().is_some_and(|p| !p.is_null()) || n.rules.as_ref().is_some_and(|r| !r.is_null()) {
            return Err(RestError::bad_request("network.egressProxy and network.rules are not supported"));
        }
        if let Some(a) = n.allow_internet_access {
            rules = Some(if a { vec!["*".into()] } else { vec![] });
        }
        // opendsec's rules only allow: a deny list is meaningful only as "deny everything
        // else" (E2B's `denyOut: ["0.0.0.0/0"]` beside an allow list).
        let deny = n.deny_out.clone().unwrap_or_default();
        if deny.iter().any(|d| d != "0.0.0.0/0") {
            return Err(RestError::bad_request(
                "network.denyOut may only be [\"0.0.0.0/0\"]: everything not allowed is denied already",
            ));
        }
        if !deny.is_empty() && n.allow_out.is_none() {
            rules = Some(vec![]);
        }
        if let Some(allow) = &n.allow_out {
            rules = Some(allow.clone());
        }
    }
    let Some(texts) = rules else { return Ok(None) };
    let mut out = Vec::with_capacity(texts.len());
    for t in &texts {
        let r = Rule::parse(t).map_err(|e| RestError::bad_request(format!("network rule {t:?}: {e}")))?;
        out.push(r.to_pb());
    }
    Ok(Some(out))
}

/// The lease id an E2B idempotency key stands for: a digest of the caller's token and the
/// key, so that a retry with the same token gets the same sandbox, and nobody can name (and,
/// its traffic being public by default, reach) a sandbox by guessing its key.
fn lease_of(token: &str, key: &str) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    h.update(token.as_bytes());
    h.update([0u8]);
    h.update(key.as_bytes());
    opendsec_common::hex::to_hex(&h.finalize()[..16])
}

async fn create(gw: &Gateway, call: &Call, body: &[u8]) -> Result<Response> {
    let req: NewSandbox = parse(body)?;
    let template = if req.template_id.is_empty() { "base".to_string() } else { req.template_id.clone() };
    let auto_pause = req.auto_pause == Some(true);
    let auto_resume = match &req.auto_resume {
        None | Some(serde_json::Value::Null) => false,
        Some(serde_json::Value::Bool(b)) => *b,
        Some(serde_json::Value::Object(o)) => o.get("enabled").and_then(serde_json::Value::as_bool).unwrap_or(false),
        Some(other) => return Err(RestError::bad_request(format!("autoResume {other} is not {{\"enabled\": bool}}"))),
    };
    if auto_pause && req.auto_pause_memory == Some(false) && auto_resume {
        return Err(RestError::bad_request(
            "autoResume cannot be combined with autoPauseMemory false: a file-system-only pause is resumed by connect",
        ));
    }
    if req.mcp.as_ref().is_some_and(|m| !m.is_null()) || req.volume_mounts.as_ref().is_some_and(|v| !v.is_empty()) {
        return Err(RestError::bad_request("mcp and volumeMounts are not supported"));
    }
    let timeout = req.timeout.unwrap_or(DEFAULT_TIMEOUT_S).max(1);
    let egress = egress_of(req.allow_internet_access, req.network.as_ref())?;
    let spec = pb::SandboxSpec {
        image: gw.image_of(&template),
        backend: gw.cfg.backend.clone(),
        resources: Some(pb::Resources {
            cpu_millis: gw.cfg.cpu_millis,
            memory_mb: gw.cfg.memory_mb,
            disk_mb: gw.cfg.disk_mb,
            gpus: 0,
        }),
        env: req.env_vars.unwrap_or_default(),
        labels: req.metadata.unwrap_or_default(),
        user: gw.cfg.default_user.clone(),
        ttl_running_stop_s: timeout,
        // An auto-pausing sandbox pauses when its timeout runs out (the idle TTL, which calls
        // do not extend); its lifetime and paused TTL are the gateway's `auto_pause_lifetime`.
        ttl_max_s: if auto_pause { gw.cfg.auto_pause_lifetime.as_secs().max(timeout) } else { timeout },
        ttl_paused_s: if auto_pause { gw.cfg.auto_pause_lifetime.as_secs() } else { 0 },
        pause_on_timeout: auto_pause,
        // As in E2B, a paused sandbox waits for connect unless it auto-resumes.
        manual_resume: !auto_resume,
        network: egress.map(|egress| pb::NetworkSpec { egress }),
        // E2B's default: a sandbox's ports answer anyone who has its host name.
        public_traffic: req.network.as_ref().and_then(|n| n.allow_public_traffic).unwrap_or(true),
        ..Default::default()
    };
    let sb = match &call.idempotency_lease {
        Some(lease) => {
            let r = pb::CreateSandboxRequest { spec: Some(spec), lease_id: lease.clone() };
            call.client.create_sandbox_with(r).await
        }
        None => call.client.create_sandbox(spec).await,
    }
    .map_err(|e| match e.reason {
        Reason::NotFound => RestError::not_found(format!("template {template:?}: {}", e.message)),
        _ => RestError::from(e),
    })?;
    let tokens = match sandbox_tokens(call, &sb.id).await {
        Ok(t) => t,
        Err(e) => {
            // Nobody could reach the sandbox without its tokens: it goes rather than idle
            // until its timeout.
            if let Err(stop) = call.client.stop_sandbox(&sb.id).await {
                tracing::warn!(sandbox_id = %sb.id, error = %stop, "stopping a sandbox whose tokens were refused");
            }
            return Err(e);
        }
    };
    Ok(json(StatusCode::CREATED, &sandbox_answer(gw, &sb, &tokens)))
}

/// The sandbox's tokens for the caller (`CreateSandboxTokens`: the same on every call): what
/// the SDK sends back on in-sandbox calls instead of the caller's API key, which no answer
/// carries.
async fn sandbox_tokens(call: &Call, id: &str) -> Result<pb::SandboxTokens> {
    call.client.create_sandbox_tokens(id).await.map_err(|e| match e.reason {
        Reason::NotFound | Reason::InvalidArgument => not_found(id),
        _ => RestError::from(e),
    })
}

fn sandbox_answer(gw: &Gateway, sb: &pb::Sandbox, tokens: &pb::SandboxTokens) -> model::Sandbox {
    let image = sb.spec.as_ref().map(|s| s.image.as_str()).unwrap_or_default();
    let template = gw.template_of(image);
    model::Sandbox {
        alias: gw.cfg.templates.contains_key(&template).then(|| template.clone()),
        template_id: template,
        sandbox_id: crate::host::e2b_id(&sb.id),
        client_id: sb.edge.clone(),
        envd_version: ENVD_VERSION,
        // Tokens for this sandbox only: the SDK sends them back on every in-sandbox call,
        // where they are the tokens those calls are made with.
        envd_access_token: tokens.runtime_token.clone(),
        traffic_access_token: Some(tokens.traffic_token.clone()),
        domain: Some(gw.domain.clone()),
    }
}

/// E2B's state of a sandbox (`None`: ended, which E2B does not list or find).
fn e2b_state(s: i32) -> Option<&'static str> {
    match St::try_from(s).unwrap_or(St::Unspecified) {
        St::Creating | St::Running | St::Resuming => Some("running"),
        St::Pausing | St::Paused => Some("paused"),
        St::Unspecified | St::Stopping | St::Stopped | St::Failed => None,
    }
}

fn detail_of(gw: &Gateway, sb: &pb::Sandbox, key: Option<&str>) -> Option<model::SandboxDetail> {
    let state = e2b_state(sb.state)?;
    let spec = sb.spec.clone().unwrap_or_default();
    let res = spec.resources.unwrap_or_default();
    let template = gw.template_of(&spec.image);
    Some(model::SandboxDetail {
        alias: gw.cfg.templates.contains_key(&template).then(|| template.clone()),
        template_id: template,
        sandbox_id: crate::host::e2b_id(&sb.id),
        client_id: sb.edge.clone(),
        started_at: model::rfc3339(sb.created_at_ms),
        end_at: model::rfc3339(sb.expires_at_ms),
        envd_version: ENVD_VERSION,
        cpu_count: res.cpu_millis.div_ceil(1000).max(1),
        memory_mb: res.memory_mb,
        disk_size_mb: res.disk_mb,
        state,
        metadata: spec.labels,
        envd_access_token: key.map(str::to_string),
        domain: Some(gw.domain.clone()),
    })
}

fn not_found(id: &str) -> RestError {
    RestError::not_found(format!("sandbox {id:?} not found"))
}

/// The sandbox if it is live (running or paused in E2B's terms), else 404.
async fn live(call: &Call, id: &str) -> Result<pb::Sandbox> {
    match call.client.get_sandbox(id).await {
        Ok(sb) if e2b_state(sb.state).is_some() => Ok(sb),
        Ok(_) => Err(not_found(id)),
        // Another project's sandbox is not found, not forbidden: its existence is not the
        // caller's to learn.
        Err(e) if matches!(e.reason, Reason::NotFound | Reason::InvalidArgument | Reason::PermissionDenied) => {
            Err(not_found(id))
        }
        Err(e) => Err(e.into()),
    }
}

async fn detail(gw: &Gateway, call: &Call, id: &str) -> Result<Response> {
    let sb = live(call, id).await?;
    let tokens = sandbox_tokens(call, id).await?;
    let d = detail_of(gw, &sb, Some(&tokens.runtime_token)).ok_or_else(|| not_found(id))?;
    Ok(json(StatusCode::OK, &d))
}

async fn kill(call: &Call, id: &str) -> Result<Response> {
    live(call, id).await?;
    match call.client.stop_sandbox(id).await {
        Ok(_) => Ok(no_content()),
        Err(e) if e.reason == Reason::NotFound => Err(not_found(id)),
        Err(e) => Err(e.into()),
    }
}

fn now_ms() -> i64 {
    opendsec_common::time::now_ms() as i64
}

/// Makes the sandbox end `secs` from now (E2B's timeout), shorter or longer.
async fn set_end(call: &Call, sb: &pb::Sandbox, secs: u64) -> std::result::Result<pb::Sandbox, ApiError> {
    let secs = secs.max(1);
    let lived_ms = (now_ms() - sb.created_at_ms).max(0) as u64;
    // An auto-pausing sandbox's timeout is its idle TTL only (the lifetime cap would stop it).
    let pauses = sb.spec.as_ref().is_some_and(|s| s.pause_on_timeout);
    let req = pb::SetSandboxTimeoutRequest {
        id: sb.id.clone(),
        ttl_running_stop_s: Some(secs),
        ttl_max_s: (!pauses).then(|| lived_ms.div_ceil(1000).saturating_add(secs)),
        ttl_paused_s: None,
    };
    call.client.set_sandbox_timeout(req).await
}

async fn timeout(call: &Call, id: &str, body: &[u8]) -> Result<Response> {
    let t: model::Timeout = parse(body)?;
    let secs = t.timeout.ok_or_else(|| RestError::bad_request("timeout is required"))?;
    let sb = live(call, id).await?;
    set_end(call, &sb, secs).await?;
    Ok(no_content())
}

async fn refresh(call: &Call, id: &str, body: &[u8]) -> Result<Response> {
    #[derive(serde::Deserialize, Default)]
    #[serde(default)]
    struct Refresh {
        duration: Option<u64>,
    }
    let r: Refresh = parse(body)?;
    let sb = live(call, id).await?;
    extend_to(call, &sb, r.duration.unwrap_or(DEFAULT_TIMEOUT_S)).await?;
    Ok(no_content())
}

/// Makes the sandbox live at least `secs` from now (never shortens).
async fn extend_to(call: &Call, sb: &pb::Sandbox, secs: u64) -> Result<()> {
    let wanted = now_ms().saturating_add(i64::try_from(secs).unwrap_or(i64::MAX).saturating_mul(1000));
    if sb.expires_at_ms >= wanted {
        return Ok(());
    }
    set_end(call, sb, secs).await?;
    Ok(())
}

async fn pause(call: &Call, id: &str) -> Result<Response> {
    let sb = live(call, id).await?;
    if e2b_state(sb.state) == Some("paused") {
        return Err(RestError::new(StatusCode::CONFLICT, format!("sandbox {id:?} is already paused")));
    }
    match call.client.pause_sandbox(id).await {
        Ok(_) => Ok(no_content()),
        Err(e) if e.reason == Reason::InvalidState => Err(RestError::new(StatusCode::CONFLICT, e.message)),
        Err(e) if e.reason == Reason::NotFound => Err(not_found(id)),
        Err(e) => Err(e.into()),
    }
}

async fn connect(gw: &Gateway, call: &Call, id: &str, body: &[u8]) -> Result<Response> {
    let t: model::Timeout = parse(body)?;
    let mut sb = live(call, id).await?;
    let mut status = StatusCode::OK;
    if e2b_state(sb.state) == Some("paused") {
        sb = match call.client.resume_sandbox(id).await {
            Ok(s) => s,
            Err(e) if e.reason == Reason::NotFound => {
                return Err(RestError::not_found(format!("Paused sandbox {id} not found")));
            }
            Err(e) => return Err(e.into()),
        };
        status = StatusCode::CREATED;
    }
    extend_to(call, &sb, t.timeout.unwrap_or(DEFAULT_TIMEOUT_S)).await?;
    let tokens = sandbox_tokens(call, id).await?;
    Ok(json(status, &sandbox_answer(gw, &sb, &tokens)))
}

/// The sandbox's use now, as one SandboxMetric (E2B keeps a history; the gateway keeps
/// nothing, so `start` and `end` name no other point).
async fn metrics(call: &Call, id: &str) -> Result<Response> {
    let sb = live(call, id).await?;
    let m = match call.client.get_sandbox_metrics(id).await {
        Ok(m) => m,
        Err(e) if matches!(e.reason, Reason::NotFound | Reason::PermissionDenied) => return Err(not_found(id)),
        Err(e) => return Err(e.into()),
    };
    let mem_total = match sb.spec.as_ref().and_then(|s| s.resources.as_ref()) {
        // An unlimited cgroup reports a huge limit: the sandbox's own size says more.
        Some(r) if r.memory_mb > 0 && m.memory_limit_bytes > r.memory_mb << 20 => r.memory_mb << 20,
        _ => m.memory_limit_bytes,
    };
    let one = serde_json::json!({
        "timestamp": model::rfc3339(m.at_ms),
        "timestampUnix": m.at_ms / 1000,
        "cpuCount": m.cpu_count,
        "cpuUsedPct": (m.cpu_used_pct * 100.0).round() / 100.0,
        "memUsed": m.memory_used_bytes,
        "memTotal": mem_total,
        "memCache": m.memory_cache_bytes,
        "diskUsed": m.disk_used_bytes,
        "diskTotal": m.disk_total_bytes,
    });
    // `start` and `end` (unix seconds) bound the points answered: the one point there is
    // (now) only when it lies within them.
    let bound = |name: &str| -> Result<Option<i64>> {
        call.param(name)
            .map(|v| v.parse::<i64>().map_err(|_| RestError::bad_request(format!("{name} {v:?} is not unix seconds"))))
            .transpose()
    };
    let (start, end) = (bound("start")?, bound("end")?);
    let at_s = m.at_ms / 1000;
    // The SDK's bounds are second-precision and a range ending "now" is asked before the
    // point is taken: within E2B's collection step (5 s) of `end` counts as in.
    let inside = start.is_none_or(|s| at_s >= s) && end.is_none_or(|e| at_s <= e.saturating_add(5));
    Ok(json(StatusCode::OK, &if inside { vec![one] } else { vec![] }))
}

async fn network(call: &Call, id: &str, body: &[u8]) -> Result<Response> {
    let n: model::Network = parse(body)?;
    let egress = egress_of(None, Some(&n))?.unwrap_or_default();
    live(call, id).await?;
    call.client.update_network(id, egress).await?;
    Ok(no_content())
}

/// The opendsec states of E2B's state filter.
fn states_of(filter: Option<&str>) -> Result<Vec<i32>> {
    let mut out = vec![];
    for s in filter.unwrap_or("running,paused").split(',').map(str::trim).filter(|s| !s.is_empty()) {
        match s {
            "running" => out.extend([St::Creating, St::Running, St::Resuming].map(|s| s as i32)),
            "paused" => out.extend([St::Pausing, St::Paused].map(|s| s as i32)),
            other => return Err(RestError::bad_request(format!("state {other:?}: expected running or paused"))),
        }
    }
    Ok(out)
}

/// E2B's metadata filter (`k=v&k2=v2`, each part escaped, the whole escaped again).
pub fn metadata_filter(text: &str) -> HashMap<String, String> {
    let once: String = percent_decode(text);
    form_urlencoded::parse(once.as_bytes()).into_owned().collect()
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        if b[i] == b'%'
            && i + 2 < b.len()
            && let (Some(h), Some(l)) = (hex(b[i + 1]), hex(b[i + 2]))
        {
            out.push((h * 16 + l) as u8);
            i += 3;
            continue;
        }
        out.push(if b[i] == b'+' { b' ' } else { b[i] });
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Sandboxes a list answers at most, after filters (E2B's SDK pages by `limit`).
const MAX_LISTED: usize = 10_000;

/// E2B's list: newest first (`order=asc` oldest first), filtered by metadata, state,
/// template and `startedAfter` (inclusive), paged by `limit` with a cursor in `nextToken`
/// (`<created ms>.<id>` of the last sandbox given). Sandboxes are ordered by creation across
/// edges, which opendsec's own list (by id) is not, so the gateway reads every match and
/// sorts: at most [`MAX_LISTED`] of them.
async fn list(gw: &Gateway, call: &Call, v2: bool) -> Result<Response> {
    let labels = call.param("metadata").map(metadata_filter).unwrap_or_default();
    let states = states_of(call.param("state"))?;
    let template = call.param("template").map(str::to_string);
    let started_after = match call.param("startedAfter") {
        Some(t) => Some(
            humantime::parse_rfc3339_weak(t)
                .or_else(|_| humantime::parse_rfc3339(t))
                .map(|t| t.duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as i64).unwrap_or(0))
                .map_err(|e| RestError::bad_request(format!("startedAfter {t:?}: {e}")))?,
        ),
        None => None,
    };
    let limit = match call.param("limit") {
        Some(l) => l
            .parse::<usize>()
            .map_err(|_| RestError::bad_request(format!("limit {l:?} is not a number")))?
            .clamp(1, 1000),
        None => 100,
    };
    let ascending = match call.param("order") {
        None | Some("desc") => false,
        Some("asc") => true,
        Some(o) => return Err(RestError::bad_request(format!("order {o:?} is not asc or desc"))),
    };
    let cursor = match call.param("nextToken") {
        Some(t) => {
            Some(cursor_of(t).ok_or_else(|| RestError::bad_request(format!("nextToken {t:?} is not one of ours")))?)
        }
        None => None,
    };
    let keep = |sb: &pb::Sandbox| {
        let spec = sb.spec.as_ref();
        let image = spec.map(|s| s.image.as_str()).unwrap_or_default();
        template.as_ref().is_none_or(|t| gw.image_of(t) == image || t == image)
            && started_after.is_none_or(|after| sb.created_at_ms >= after)
    };
    let req = pb::ListSandboxesRequest { states, labels, page_size: 1000, ..Default::default() };
    let mut all: Vec<pb::Sandbox> =
        call.client.list_all_sandboxes(req).await?.into_iter().filter(|s| keep(s)).collect();
    let key = |s: &pb::Sandbox| (s.created_at_ms, s.id.clone());
    all.sort_by_key(key);
    if !ascending {
        all.reverse();
    }
    all.truncate(MAX_LISTED);
    let after = |s: &pb::Sandbox| cursor.as_ref().is_none_or(|c| if ascending { key(s) > *c } else { key(s) < *c });
    let rest: Vec<&pb::Sandbox> = all.iter().filter(|s| after(s)).collect();
    // The v1 list has no pages: everything.
    let page: Vec<&pb::Sandbox> = if v2 { rest.iter().take(limit).copied().collect() } else { rest.clone() };
    let next =
        (v2 && rest.len() > page.len()).then(|| page.last().map(|s| format!("{}.{}", s.created_at_ms, s.id))).flatten();
    let items: Vec<model::SandboxDetail> = page.iter().filter_map(|s| detail_of(gw, s, None)).collect();
    let mut r = json(StatusCode::OK, &items);
    if let Some(next) = next
        && let Ok(v) = HeaderValue::from_str(&next)
    {
        r.headers_mut().insert("x-next-token", v);
    }
    Ok(r)
}

/// The (created ms, id) a `nextToken` names.
fn cursor_of(token: &str) -> Option<(i64, String)> {
    let (ms, id) = token.split_once('.')?;
    let ms = ms.parse::<i64>().ok()?;
    opendsec_common::ids::split_sandbox_id(id).ok()?;
    Some((ms, id.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_metadata_filter_decodes_as_the_sdk_encodes() {
        // SandboxQuery(metadata={"k": "v a", "x&y": "1"}) after the query's own decoding.
        let m = metadata_filter("k=v%2520a&x%2526y=1");
        assert_eq!(m.get("k").map(String::as_str), Some("v a"));
        assert_eq!(m.get("x&y").map(String::as_str), Some("1"));
        assert_eq!(m.len(), 2);
    }

    #[test]
    fn idempotency_keys_become_lease_ids() {
        let l = lease_of("dsk.a.secret", "job1");
        assert_eq!(l.len(), 32);
        assert!(opendsec_common::ids::validate_lease(&l).is_ok() && !l.contains('-'));
        // The same for the same caller; another caller's (or no) knowledge of the key names
        // another lease.
        assert_eq!(l, lease_of("dsk.a.secret", "job1"));
        assert_ne!(l, lease_of("dsk.b.secret", "job1"));
        assert_ne!(l, lease_of("dsk.a.secret", "job2"));
        assert_ne!(l, "job1");
    }

    #[test]
    fn network_options_become_allow_rules() {
        assert!(egress_of(None, None).unwrap().is_none());
        assert_eq!(egress_of(Some(true), None).unwrap().unwrap().len(), 1);
        assert!(egress_of(Some(false), None).unwrap().unwrap().is_empty());
        let n = model::Network {
            allow_out: Some(vec!["203.0.113.0/24".into(), "example.com".into()]),
            deny_out: Some(vec!["0.0.0.0/0".into()]),
            ..Default::default()
        };
        assert_eq!(egress_of(Some(true), Some(&n)).unwrap().unwrap().len(), 2);
        let deny_some = model::Network { deny_out: Some(vec!["192.0.2.1".into()]), ..Default::default() };
        assert_eq!(egress_of(None, Some(&deny_some)).unwrap_err().status, StatusCode::BAD_REQUEST);
        let bad = model::Network { allow_out: Some(vec!["not a rule!".into()]), ..Default::default() };
        assert!(egress_of(None, Some(&bad)).is_err());
    }

    #[test]
    fn states_filter_maps_to_opendsec_states() {
        assert_eq!(states_of(None).unwrap().len(), 5);
        assert_eq!(states_of(Some("paused")).unwrap(), vec![St::Pausing as i32, St::Paused as i32]);
        assert!(states_of(Some("killed")).is_err());
    }
}
