//! envd's HTTP endpoints: `GET /files` (the file's bytes), `POST /files` (multipart, one part
//! per file named by its raw filename, or one octet-stream body, gzip allowed) and
//! `GET /health`. Uploads are streamed to the agent and only land when complete.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use axum::body::Body;
use axum::http::{HeaderValue, Request, StatusCode, header as h};
use axum::response::Response;
use bytes::Bytes;
use futures::{Stream, StreamExt};
use http_body_util::BodyExt;
use opendsec_client::Upload;
use opendsec_common::{ApiError, Reason};
use opendsec_proto::v1 as pb;
use serde_json::json;

use crate::sandbox::{Ctx, stat_of, user_path};
use crate::{error, header};

/// A gzip upload is inflated in memory from at most this many compressed bytes.
const MAX_GZIP_BODY: usize = 64 << 20;
/// Bytes a multipart body may carry outside its parts' data (headers, preamble, other fields).
const MAX_BETWEEN_PARTS: u64 = 1 << 20;
/// Upload chunks sent to the agent.
const CHUNK: usize = 1 << 20;

fn rest(status: StatusCode, message: impl AsRef<str>) -> Response {
    error::json_error(status, message.as_ref())
}

/// An opendsec error on a file call, as envd's HTTP answers it (the SDK maps by status).
async fn fail(ctx: &Ctx, path: &str, e: &ApiError) -> Response {
    if ctx.may_be_gone(e) && ctx.gone().await {
        return error::sandbox_not_found(&ctx.id);
    }
    match e.reason {
        Reason::NotFound => rest(StatusCode::NOT_FOUND, format!("path '{path}' does not exist")),
        Reason::InvalidArgument | Reason::InvalidState | Reason::AlreadyExists => {
            rest(StatusCode::BAD_REQUEST, e.message.clone())
        }
        Reason::Unauthenticated => rest(StatusCode::UNAUTHORIZED, e.message.clone()),
        Reason::PermissionDenied => rest(StatusCode::FORBIDDEN, e.message.clone()),
        Reason::QuotaExceeded | Reason::RateLimited => rest(StatusCode::TOO_MANY_REQUESTS, e.message.clone()),
        _ if e.message.contains("No space left") || e.message.contains("Disk quota") => {
            rest(StatusCode::INSUFFICIENT_STORAGE, e.message.clone())
        }
        _ => rest(StatusCode::INTERNAL_SERVER_ERROR, e.message.clone()),
    }
}

pub async fn health(ctx: &Ctx) -> Response {
    use opendsec_proto::v1::SandboxState as S;
    match ctx.client.get_sandbox(&ctx.id).await {
        // Paused: not running, as E2B's proxy answers (a call into it would resume it).
        Ok(sb) if sb.state == S::Running as i32 => {
            let mut r = Response::new(Body::empty());
            *r.status_mut() = StatusCode::NO_CONTENT;
            r
        }
        Ok(_) => error::sandbox_not_found(&ctx.id),
        Err(e) if matches!(e.reason, Reason::NotFound | Reason::InvalidArgument | Reason::PermissionDenied) => {
            error::sandbox_not_found(&ctx.id)
        }
        Err(e) if e.reason == Reason::Unauthenticated => rest(StatusCode::UNAUTHORIZED, e.message.clone()),
        Err(e) => rest(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
}

pub async fn handle(ctx: &Ctx, req: Request<Body>) -> Response {
    let q: Vec<(String, String)> =
        req.uri().query().map(|q| form_urlencoded::parse(q.as_bytes()).into_owned().collect()).unwrap_or_default();
    let param = |n: &str| q.iter().find(|(k, _)| k == n).map(|(_, v)| v.clone()).filter(|v| !v.is_empty());
    // `username` overrides the Basic user (the SDK sends one or the other).
    let user = match param("username") {
        Some(u) if !crate::sandbox::valid_user(&u) => {
            return rest(
                StatusCode::UNAUTHORIZED,
                format!("invalid username: '{}'", u.chars().take(64).collect::<String>()),
            );
        }
        Some(u) => u,
        None => ctx.user.clone(),
    };
    let ctx = &Ctx { gw: ctx.gw.clone(), client: ctx.client.clone(), id: ctx.id.clone(), user };
    let path = param("path");
    match *req.method() {
        axum::http::Method::GET => match path {
            Some(p) => read(ctx, &p).await,
            None => rest(StatusCode::BAD_REQUEST, "path is required"),
        },
        axum::http::Method::POST => write(ctx, path, req).await,
        _ => rest(StatusCode::METHOD_NOT_ALLOWED, "GET or POST"),
    }
}

async fn read(ctx: &Ctx, path: &str) -> Response {
    let req = pb::ReadFileRequest {
        sandbox_id: ctx.id.clone(),
        session_id: ctx.session(),
        path: user_path(path),
        user: ctx.user.clone(),
        ..Default::default()
    };
    let mut stream = match ctx.client.read_file(req).await {
        Ok(s) => s,
        Err(e) => return fail(ctx, path, &e).await,
    };
    // The first chunk decides between an error status and the file.
    let first = match stream.next().await {
        None => Bytes::new(),
        Some(Ok(c)) => Bytes::from(c.data),
        Some(Err(s)) => return fail(ctx, path, &ApiError::from_status(&s)).await,
    };
    let rest =
        stream.map(|c| c.map(|c| Bytes::from(c.data)).map_err(|s| std::io::Error::other(s.message().to_string())));
    let body = Body::from_stream(futures::stream::once(async move { Ok(first) }).chain(rest));
    let mut r = Response::new(body);
    r.headers_mut().insert(h::CONTENT_TYPE, HeaderValue::from_static("application/octet-stream"));
    let name = path.rsplit('/').next().unwrap_or_default();
    if let Ok(v) = HeaderValue::from_str(&format!("inline; filename={:?}", name)) {
        r.headers_mut().insert(h::CONTENT_DISPOSITION, v);
    }
    r
}

/// The prefix of E2B's file metadata among a file's `user.` extended attributes.
pub(crate) const METADATA_XATTRS: &str = "e2b.";

/// E2B's file metadata of an upload: its `X-Metadata-<key>` headers (keys lowercase, as
/// header names are), values printable ASCII.
fn metadata_of(h: &axum::http::HeaderMap) -> Result<HashMap<String, String>, String> {
    let mut out = HashMap::new();
    for (name, value) in h {
        let Some(key) = name.as_str().strip_prefix("x-metadata-") else { continue };
        let value = value
            .to_str()
            .ok()
            .filter(|v| v.bytes().all(|b| (0x20..0x7f).contains(&b)))
            .ok_or_else(|| format!("metadata {key:?}: values must be printable ASCII"))?;
        if key.is_empty() {
            return Err("a metadata key is empty".into());
        }
        out.insert(key.to_string(), value.to_string());
    }
    Ok(out)
}

/// Writes one file from `data`: the upload lands only if every chunk arrived. Its metadata
/// replaces what the file had (an upload without any clears it, as envd does).
async fn put<S>(
    ctx: &Ctx,
    path: &str,
    data: S,
    metadata: &HashMap<String, String>,
) -> Result<serde_json::Value, Response>
where
    S: Stream<Item = Result<Bytes, String>> + Send + 'static,
{
    let first = pb::WriteFileRequest {
        sandbox_id: ctx.id.clone(),
        session_id: ctx.session(),
        path: user_path(path),
        user: ctx.user.clone(),
        make_parents: true,
        xattrs: metadata.iter().map(|(k, v)| (format!("{METADATA_XATTRS}{k}"), v.clone())).collect(),
        clear_xattrs: METADATA_XATTRS.to_string(),
        ..Default::default()
    };
    let id = ctx.id.clone();
    let chunks = rechunk(data);
    let msgs = futures::stream::once(async move { Upload::Message(first) })
        .chain(chunks.map(move |c| match c {
            Ok(data) => Upload::Message(pb::WriteFileRequest { sandbox_id: id.clone(), data, ..Default::default() }),
            Err(e) => Upload::Abort(e),
        }))
        .chain(futures::stream::once({
            let id = ctx.id.clone();
            async move { Upload::Message(pb::WriteFileRequest { sandbox_id: id, finish: true, ..Default::default() }) }
        }));
    if let Err(e) = ctx.client.write_file(msgs).await {
        return Err(fail(ctx, path, &e).await);
    }
    // The answer names the absolute path: a relative one is resolved by asking.
    let abs = if path.starts_with('/') {
        path.to_string()
    } else {
        match stat_of(ctx, path).await {
            Ok(i) => i.path,
            Err(e) => return Err(fail(ctx, path, &e).await),
        }
    };
    let name = abs.rsplit('/').next().unwrap_or_default().to_string();
    let mut out = json!({"path": abs, "name": name, "type": "file"});
    if !metadata.is_empty() {
        out["metadata"] = json!(metadata);
    }
    Ok(out)
}

/// Chunks of at most [`CHUNK`] bytes (gRPC messages stay small whatever the client sends).
fn rechunk<S>(data: S) -> impl Stream<Item = Result<Vec<u8>, String>> + Send + 'static
where
    S: Stream<Item = Result<Bytes, String>> + Send + 'static,
{
    data.flat_map(|c| {
        let parts: Vec<Result<Vec<u8>, String>> = match c {
            Ok(b) => b.chunks(CHUNK).map(|p| Ok(p.to_vec())).collect(),
            Err(e) => vec![Err(e)],
        };
        futures::stream::iter(parts)
    })
}

async fn write(ctx: &Ctx, path: Option<String>, req: Request<Body>) -> Response {
    // The caller may reach the sandbox before any of the body is read.
    match ctx.client.get_sandbox(&ctx.id).await {
        Ok(_) => {}
        Err(e) if e.reason == Reason::Unauthenticated => return rest(StatusCode::UNAUTHORIZED, e.message),
        Err(e) if matches!(e.reason, Reason::NotFound | Reason::InvalidArgument | Reason::PermissionDenied) => {
            return error::sandbox_not_found(&ctx.id);
        }
        Err(e) => return rest(StatusCode::SERVICE_UNAVAILABLE, e.to_string()),
    }
    let metadata = match metadata_of(req.headers()) {
        Ok(m) => m,
        Err(m) => return rest(StatusCode::BAD_REQUEST, m),
    };
    let ctype = header(req.headers(), "content-type").unwrap_or_default().to_string();
    let gzip = header(req.headers(), "content-encoding").is_some_and(|e| e.eq_ignore_ascii_case("gzip"));
    let mut written = Vec::new();
    if ctype.starts_with("multipart/form-data") {
        let boundary = match multer::parse_boundary(&ctype) {
            Ok(b) => b,
            Err(e) => return rest(StatusCode::BAD_REQUEST, format!("multipart: {e}")),
        };
        // Bytes between parts (their headers, the preamble) are few: a body that sends more
        // there is refused instead of buffered.
        let in_part = Arc::new(AtomicBool::new(false));
        let outside = Arc::new(AtomicU64::new(0));
        let (ip, out) = (in_part.clone(), outside.clone());
        let body = req.into_body().into_data_stream().map(move |c| {
            let b = c.map_err(std::io::Error::other)?;
            if !ip.load(Ordering::Relaxed) && out.fetch_add(b.len() as u64, Ordering::Relaxed) > MAX_BETWEEN_PARTS {
                return Err(std::io::Error::other(format!("more than {MAX_BETWEEN_PARTS} bytes between parts")));
            }
            Ok(b)
        });
        let mut mp = multer::Multipart::new(body, boundary);
        let mut seen = std::collections::HashSet::new();
        // One budget for what a refused upload still reads: the rest of its part, then what
        // follows it.
        let mut drain = Drain::default();
        loop {
            let field = match mp.next_field().await {
                Ok(Some(f)) => f,
                Ok(None) => break,
                Err(e) => return rest(StatusCode::BAD_REQUEST, format!("multipart: {e}")),
            };
            in_part.store(true, Ordering::Relaxed);
            outside.store(0, Ordering::Relaxed);
            if field.name() != Some("file") {
                // Read through (counted as between parts: other fields carry nothing of ours).
                in_part.store(false, Ordering::Relaxed);
                continue;
            }
            // The raw filename is the path (no basename taken); a `path` parameter wins.
            let target = match (&path, field.file_name()) {
                (Some(p), _) => p.clone(),
                (None, Some(f)) if !f.is_empty() => f.to_string(),
                _ => return rest(StatusCode::BAD_REQUEST, "a file part without a filename and no path parameter"),
            };
            if !seen.insert(target.clone()) {
                return rest(StatusCode::BAD_REQUEST, format!("path '{target}' is uploaded twice"));
            }
            let data = field.map(|c| c.map_err(|e| e.to_string()));
            // Each part is written before the next is read (the parts are one stream).
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, String>>(4);
            let part_drain = &mut drain;
            let pump = async move {
                futures::pin_mut!(data);
                while let Some(c) = data.next().await {
                    let bad = c.as_ref().err().cloned();
                    let taken = tx.send(c).await.is_ok();
                    if bad.is_some() {
                        return bad;
                    }
                    if !taken {
                        // The write failed (a full disk, say): the rest of the part is read and
                        // dropped, within bounds, so that a client still sending it gets the
                        // answer instead of a broken pipe.
                        part_drain.drop_rest(&mut data).await;
                        return None;
                    }
                }
                None
            };
            let (bad, r) =
                tokio::join!(pump, put(ctx, &target, tokio_stream::wrappers::ReceiverStream::new(rx), &metadata));
            in_part.store(false, Ordering::Relaxed);
            // A body that broke off is the client's error (and wrote nothing).
            if let Some(e) = bad {
                return rest(StatusCode::BAD_REQUEST, format!("multipart: {e}"));
            }
            match r {
                Ok(v) => written.push(v),
                Err(resp) => {
                    // And what follows the part (its closing boundary, any other part).
                    let until = drain.start();
                    let _ = tokio::time::timeout_at(until, async {
                        while let Ok(Some(f)) = mp.next_field().await {
                            in_part.store(true, Ordering::Relaxed);
                            futures::pin_mut!(f);
                            drain.drop_rest(&mut f.map(|c| c.map_err(|e| e.to_string()))).await;
                            in_part.store(false, Ordering::Relaxed);
                        }
                    })
                    .await;
                    return resp;
                }
            }
        }
        if written.is_empty() {
            return rest(StatusCode::BAD_REQUEST, "no file part in the upload");
        }
    } else {
        let Some(p) = path else { return rest(StatusCode::BAD_REQUEST, "path is required") };
        let r = if gzip {
            let compressed = match http_body_util::Limited::new(req.into_body(), MAX_GZIP_BODY).collect().await {
                Ok(b) => b.to_bytes(),
                Err(e) => return rest(StatusCode::PAYLOAD_TOO_LARGE, format!("gzip body: {e}")),
            };
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, String>>(4);
            let inflating = tokio::task::spawn_blocking(move || inflate(&compressed, &tx));
            let r = put(ctx, &p, tokio_stream::wrappers::ReceiverStream::new(rx), &metadata).await;
            if let Ok(Some(e)) = inflating.await {
                return rest(StatusCode::BAD_REQUEST, e);
            }
            r
        } else {
            let data = req.into_body().into_data_stream().map(|c| c.map_err(|e| e.to_string()));
            let (data, reader) = feed(data);
            let r = put(ctx, &p, data, &metadata).await;
            if r.is_err() {
                // Answer only once the client stopped sending (within bounds): a client still
                // writing its body when the connection closes sees a broken pipe, not the
                // answer (a full disk, say).
                let _ = tokio::time::timeout(DRAIN_TIME, reader).await;
            }
            r
        };
        match r {
            Ok(v) => written.push(v),
            Err(resp) => return resp,
        }
    }
    crate::connect::json_response(StatusCode::OK, &written)
}

/// How much of a refused upload is read (and dropped) so that its client gets the answer.
const DRAIN_BYTES: u64 = 1 << 30;
const DRAIN_TIME: std::time::Duration = std::time::Duration::from_secs(30);

/// What a refused upload may still read and drop: [`DRAIN_BYTES`] and [`DRAIN_TIME`] in all,
/// the time counted from the first drop.
#[derive(Default)]
struct Drain {
    until: Option<tokio::time::Instant>,
    dropped: u64,
}

impl Drain {
    /// The deadline, set by the first call.
    fn start(&mut self) -> tokio::time::Instant {
        *self.until.get_or_insert_with(|| tokio::time::Instant::now() + DRAIN_TIME)
    }

    /// Reads what is left of `data` and drops it, within what is left of the budget.
    async fn drop_rest<S>(&mut self, data: &mut S)
    where
        S: Stream<Item = Result<Bytes, String>> + Unpin,
    {
        let until = self.start();
        let _ = tokio::time::timeout_at(until, async {
            while self.dropped <= DRAIN_BYTES
                && let Some(Ok(b)) = data.next().await
            {
                self.dropped += b.len() as u64;
            }
        })
        .await;
    }
}

/// The body as a stream for `put`, read by a task of its own; once `put` stops taking it (it
/// failed), the task reads the rest and drops it, within a [`Drain`].
fn feed<S>(mut body: S) -> (tokio_stream::wrappers::ReceiverStream<Result<Bytes, String>>, tokio::task::JoinHandle<()>)
where
    S: Stream<Item = Result<Bytes, String>> + Send + Unpin + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Bytes, String>>(4);
    let reader = tokio::spawn(async move {
        while let Some(c) = body.next().await {
            if let Err(tokio::sync::mpsc::error::SendError(_)) = tx.send(c).await {
                Drain::default().drop_rest(&mut body).await;
                return;
            }
        }
    });
    (tokio_stream::wrappers::ReceiverStream::new(rx), reader)
}

/// Inflates a gzip body into `tx`; a broken body ends the stream with its error (nothing is
/// written) and is returned.
fn inflate(compressed: &[u8], tx: &tokio::sync::mpsc::Sender<Result<Bytes, String>>) -> Option<String> {
    use std::io::Read;
    let mut d = flate2::read::MultiGzDecoder::new(compressed);
    let mut buf = vec![0u8; CHUNK];
    loop {
        match d.read(&mut buf) {
            Ok(0) => return None,
            Ok(n) => {
                if tx.blocking_send(Ok(Bytes::copy_from_slice(&buf[..n]))).is_err() {
                    return None;
                }
            }
            Err(e) => {
                let e = format!("gzip body: {e}");
                let _ = tx.blocking_send(Err(e.clone()));
                return Some(e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body that goes on sending chunks of `size` bytes for as long as it is read.
    fn endless(size: usize) -> impl Stream<Item = Result<Bytes, String>> + Unpin {
        futures::stream::repeat_with(move || Ok(Bytes::from(vec![0u8; size])))
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_upload_is_drained_within_one_budget_of_bytes_and_time() {
        // Bytes: an endless body is read up to the budget, and not a chunk past it.
        let mut d = Drain::default();
        d.drop_rest(&mut endless(1 << 20)).await;
        assert!(d.dropped > DRAIN_BYTES && d.dropped <= DRAIN_BYTES + (1 << 20), "{}", d.dropped);
        // The budget is the upload's: a second part finds it spent and reads nothing.
        let mut second = endless(1);
        d.drop_rest(&mut second).await;
        assert!(d.dropped <= DRAIN_BYTES + (1 << 20));

        // Time: a body that stalls is left at the deadline, counted from the first drop, for
        // both parts together.
        let mut d = Drain::default();
        let t0 = tokio::time::Instant::now();
        d.drop_rest(&mut futures::stream::pending::<Result<Bytes, String>>()).await;
        assert_eq!(t0.elapsed(), DRAIN_TIME);
        d.drop_rest(&mut futures::stream::pending::<Result<Bytes, String>>()).await;
        assert_eq!(t0.elapsed(), DRAIN_TIME, "the second drain had its own 30 s");

        // A body that ends is read to its end, whatever is left.
        let mut d = Drain::default();
        d.drop_rest(&mut futures::stream::iter([Ok(Bytes::from_static(b"abc")), Ok(Bytes::from_static(b"de"))])).await;
        assert_eq!(d.dropped, 5);
    }
}
