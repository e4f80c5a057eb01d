//! A Docker Registry HTTP API v2 client: manifests and blobs of one repository, with
//! authentication (anonymous, Basic, bearer tokens from a token service, identity tokens),
//! redirects, timeouts and size limits.
//!
//! Invariants:
//! - credentials (an `Authorization` header) go only to the registry's own origin (scheme,
//!   host and port) and to the token realm it names; redirects are followed by hand (at most
//!   [`MAX_REDIRECTS`]) and a redirect to any other origin carries no `Authorization`;
//! - every request has a connect timeout and an idle (per read) timeout, so a registry that
//!   stops answering fails with [`RegistryError::Timeout`];
//! - nothing is read into memory unbounded: manifests and configs have size caps, blobs are
//!   streamed to a temporary file while hashed, and cut off at their declared size;
//! - every byte handed out has been checked against its sha256 digest;
//! - URLs in errors and logs carry no query string (presigned blob URLs hold signatures), and
//!   no credential or token is ever logged.

pub mod auth;
mod error;
pub mod manifest;
pub mod reference;

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use reqwest::header::{ACCEPT, AUTHORIZATION, CONTENT_TYPE, HeaderValue, LOCATION, WWW_AUTHENTICATE};
use reqwest::{StatusCode, Url};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

pub use auth::{Auth, Credentials};
pub use error::RegistryError;
pub use manifest::{Descriptor, ManifestDoc};
pub use reference::Reference;

use manifest::{MANIFEST_ACCEPT, hex, trunc, validate_digest};

/// Redirects followed per request.
pub const MAX_REDIRECTS: usize = 5;
/// Error bodies and token answers are read up to this size.
const MAX_SMALL_BODY: u64 = 1 << 20;

/// A URL without its query and fragment, for messages.
pub fn redact(url: &Url) -> String {
    let mut u = url.clone();
    u.set_query(None);
    u.set_fragment(None);
    let _ = u.set_username("");
    let _ = u.set_password(None);
    u.to_string()
}

fn same_origin(a: &Url, b: &Url) -> bool {
    a.scheme() == b.scheme() && a.host_str() == b.host_str() && a.port_or_known_default() == b.port_or_known_default()
}

/// A manifest as the registry sent it.
#[derive(Debug)]
pub struct FetchedManifest {
    pub bytes: Vec<u8>,
    pub content_type: Option<String>,
    /// The `Docker-Content-Digest` header, when sent.
    pub digest_header: Option<String>,
}

/// What a request was for, to name it in a not-found error.
enum Target<'a> {
    Manifest(&'a str),
    Blob(&'a str),
}

/// A client for one repository of one registry. Shared by the concurrent downloads of an
/// import (`Arc<Client>`); the current `Authorization` for the registry is shared too, so one
/// token serves them all.
#[derive(Debug)]
pub struct Client {
    http: reqwest::Client,
    base: Url,
    registry: String,
    repository: String,
    auth: Auth,
    insecure_http: bool,
    timeout: Duration,
    authorization: Mutex<Option<HeaderValue>>,
}

impl Client {
    /// `insecure_http` talks plain http to the registry (local test registries); `timeout` is
    /// the connect timeout and the longest silence tolerated while waiting for bytes.
    pub fn new(
        reference: &Reference,
        auth: Auth,
        insecure_http: bool,
        timeout: Duration,
    ) -> Result<Client, RegistryError> {
        let scheme = if insecure_http { "http" } else { "https" };
        let base = Url::parse(&format!("{scheme}://{}/", reference.registry)).map_err(|_| {
            RegistryError::InvalidReference {
                reference: reference.to_string(),
                why: "the registry is not a valid host",
            }
        })?;
        let mut builder = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(timeout)
            .read_timeout(timeout)
            .user_agent(concat!("opendsec/", env!("CARGO_PKG_VERSION")));
        // A proxy from the environment must not capture loopback registries.
        let host = base.host_str().unwrap_or("").trim_start_matches('[').trim_end_matches(']');
        if host == "localhost" || host.parse::<std::net::IpAddr>().is_ok_and(|ip| ip.is_loopback()) {
            builder = builder.no_proxy();
        }
        let http = builder.build().map_err(|source| RegistryError::Http { url: redact(&base), source })?;
        Ok(Client {
            http,
            base,
            registry: reference.registry.clone(),
            repository: reference.repository.clone(),
            auth,
            insecure_http,
            timeout,
            authorization: Mutex::new(None),
        })
    }

    pub fn registry(&self) -> &str {
        &self.registry
    }

    pub fn repository(&self) -> &str {
        &self.repository
    }

    fn http_error(&self, url: &Url, e: reqwest::Error) -> RegistryError {
        if e.is_timeout() {
            RegistryError::Timeout { url: redact(url), timeout: self.timeout }
        } else {
            RegistryError::Http { url: redact(url), source: e.without_url() }
        }
    }

    fn current_authorization(&self) -> Option<HeaderValue> {
        self.authorization.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set_authorization(&self, value: &str) -> Result<(), RegistryError> {
        let mut v = HeaderValue::from_str(value).map_err(|_| RegistryError::Unauthorized {
            registry: self.registry.clone(),
            why: "the token is not a valid header value".into(),
        })?;
        v.set_sensitive(true);
        *self.authorization.lock().unwrap_or_else(|p| p.into_inner()) = Some(v);
        Ok(())
    }

    /// Sends a GET, following redirects by hand. Returns the final response and whether it came
    /// from the registry's origin (only then is a 401 ours to answer).
    async fn send_following(
        &self,
        url: Url,
        accept: Option<&str>,
        authorization: Option<&HeaderValue>,
    ) -> Result<(reqwest::Response, bool), RegistryError> {
        let mut url = url;
        for _ in 0..=MAX_REDIRECTS {
            let on_registry = same_origin(&url, &self.base);
            let mut req = self.http.get(url.clone());
            if let Some(a) = accept {
                req = req.header(ACCEPT, a);
            }
            if on_registry && let Some(a) = authorization {
                req = req.header(AUTHORIZATION, a.clone());
            }
            let resp = req.send().await.map_err(|e| self.http_error(&url, e))?;
            if resp.status().is_redirection()
                && let Some(loc) = resp.headers().get(LOCATION)
            {
                let bad = |why: &'static str| RegistryError::BadRedirect { url: redact(&url), why };
                let loc = loc.to_str().map_err(|_| bad("the Location header is not text"))?;
                let next = url.join(loc).map_err(|_| bad("the Location header is not a URL"))?;
                if next.scheme() != "https" && next.scheme() != "http" {
                    return Err(bad("redirect to a scheme other than http or https"));
                }
                tracing::debug!(from = %redact(&url), to = %redact(&next), "following redirect");
                url = next;
                continue;
            }
            return Ok((resp, on_registry));
        }
        Err(RegistryError::TooManyRedirects { url: redact(&url), max: MAX_REDIRECTS })
    }

    /// GET `path` (relative to the registry root), authenticating on a 401 challenge once.
    async fn get(
        &self,
        path: &str,
        accept: Option<&str>,
        target: Target<'_>,
    ) -> Result<reqwest::Response, RegistryError> {
        let url = self
            .base
            .join(path)
            .map_err(|_| RegistryError::InvalidReference { reference: trunc(path), why: "not a valid URL path" })?;
        let mut authenticated = false;
        loop {
            let authorization = self.current_authorization();
            let (resp, on_registry) = self.send_following(url.clone(), accept, authorization.as_ref()).await?;
            let status = resp.status();
            if status.is_success() {
                return Ok(resp);
            }
            if status == StatusCode::UNAUTHORIZED && on_registry && !authenticated {
                authenticated = true;
                let challenges: Vec<auth::Challenge> = resp
                    .headers()
                    .get_all(WWW_AUTHENTICATE)
                    .iter()
                    .filter_map(|h| h.to_str().ok())
                    .flat_map(auth::parse_challenges)
                    .collect();
                self.authenticate(&challenges).await?;
                continue;
            }
            let final_url = resp.url().clone();
            return Err(self.status_error(resp, &final_url, target).await);
        }
    }

    /// Answers a 401: a bearer token from the realm, or Basic credentials.
    async fn authenticate(&self, challenges: &[auth::Challenge]) -> Result<(), RegistryError> {
        let bearer = challenges.iter().find_map(|c| match c {
            auth::Challenge::Bearer { realm, service, scope } => Some((realm, service, scope)),
            auth::Challenge::Basic => None,
        });
        if let Some((realm, service, scope)) = bearer {
            let token = self.fetch_token(realm, service.as_deref(), scope.as_deref()).await?;
            return self.set_authorization(&format!("Bearer {token}"));
        }
        if challenges.contains(&auth::Challenge::Basic) {
            return match &self.auth {
                Auth::Basic(c) => self.set_authorization(&auth::basic_header(c)),
                Auth::Anonymous => {
                    Err(self.unauthorized("the registry needs a user name and password (--username, or docker login)"))
                }
                Auth::IdentityToken(_) => Err(self.unauthorized(
                    "the registry wants Basic credentials, but docker's config only holds an identity token for it",
                )),
            };
        }
        Err(self.unauthorized("the registry refused the request without offering Bearer or Basic authentication"))
    }

    fn unauthorized(&self, why: &str) -> RegistryError {
        RegistryError::Unauthorized { registry: self.registry.clone(), why: why.into() }
    }

    /// Gets a token from a token service (docker's token protocol; OAuth2 refresh for
    /// identity tokens).
    async fn fetch_token(
        &self,
        realm: &str,
        service: Option<&str>,
        scope: Option<&str>,
    ) -> Result<String, RegistryError> {
        let mut url = Url::parse(realm)
            .map_err(|_| RegistryError::Token { realm: trunc(realm), why: "the realm is not a URL".into() })?;
        let realm_shown = redact(&url);
        if url.scheme() != "https" && url.scheme() != "http" {
            return Err(RegistryError::Token { realm: realm_shown, why: "the realm is not http or https".into() });
        }
        let default_scope = format!("repository:{}:pull", self.repository);
        let scope = scope.unwrap_or(&default_scope);
        // Credentials never travel in clear text, unless the user asked for plain http.
        let may_send_secrets = url.scheme() == "https" || self.insecure_http;
        if !may_send_secrets && self.auth != Auth::Anonymous {
            return Err(RegistryError::Token {
                realm: realm_shown,
                why: "refusing to send credentials to a token service over plain http".into(),
            });
        }
        let req = match &self.auth {
            Auth::IdentityToken(t) => {
                let mut form: Vec<(&str, &str)> = vec![
                    ("grant_type", "refresh_token"),
                    ("refresh_token", t),
                    ("scope", scope),
                    ("client_id", "opendsec"),
                ];
                if let Some(s) = service {
                    form.push(("service", s));
                }
                self.http.post(url.clone()).form(&form)
            }
            other => {
                {
                    let mut q = url.query_pairs_mut();
                    if let Some(s) = service {
                        q.append_pair("service", s);
                    }
                    q.append_pair("scope", scope);
                    if let Auth::Basic(c) = other {
                        q.append_pair("account", &c.username);
                    }
                }
                let mut req = self.http.get(url.clone());
                if let Auth::Basic(c) = other {
                    let mut v = HeaderValue::from_str(&auth::basic_header(c)).map_err(|_| {
                        self.unauthorized("the user name or password holds characters a header cannot carry")
                    })?;
                    v.set_sensitive(true);
                    req = req.header(AUTHORIZATION, v);
                }
                req
            }
        };
        let mut resp = req.send().await.map_err(|e| self.http_error(&url, e))?;
        let status = resp.status();
        if status == StatusCode::UNAUTHORIZED || status == StatusCode::FORBIDDEN {
            return Err(self.unauthorized(match self.auth {
                Auth::Anonymous => "the token service needs a user name and password (--username, or docker login)",
                _ => "the token service rejected the credentials",
            }));
        }
        if !status.is_success() {
            return Err(RegistryError::Token { realm: realm_shown, why: format!("answered {status}") });
        }
        let body = read_limited(&mut resp, MAX_SMALL_BODY, "token answer").await.map_err(|e| match e {
            RegistryError::Http { source, .. } if source.is_timeout() => {
                RegistryError::Timeout { url: realm_shown.clone(), timeout: self.timeout }
            }
            e => e,
        })?;
        let parsed: auth::TokenResponse = serde_json::from_slice(&body).map_err(|_| RegistryError::Token {
            realm: realm_shown.clone(),
            why: "the answer is not the expected JSON".into(),
        })?;
        parsed.into_token().ok_or(RegistryError::Token { realm: realm_shown, why: "the answer holds no token".into() })
    }

    /// Turns an unsuccessful response into an error, with the registry's error code if any.
    async fn status_error(&self, mut resp: reqwest::Response, url: &Url, target: Target<'_>) -> RegistryError {
        let status = resp.status();
        match status {
            StatusCode::NOT_FOUND => {
                return match target {
                    Target::Manifest(r) => RegistryError::ManifestNotFound { reference: r.to_string() },
                    Target::Blob(d) => RegistryError::BlobNotFound {
                        repository: format!("{}/{}", self.registry, self.repository),
                        digest: d.into(),
                    },
                };
            }
            StatusCode::UNAUTHORIZED => {
                return self.unauthorized(match self.auth {
                    Auth::Anonymous => "the registry needs credentials (--username, or docker login)",
                    _ => "the registry rejected the credentials",
                });
            }
            StatusCode::FORBIDDEN => return self.unauthorized("access denied"),
            _ => {}
        }
        #[derive(serde::Deserialize)]
        struct Errors {
            #[serde(default)]
            errors: Vec<RegistryErr>,
        }
        #[derive(serde::Deserialize)]
        struct RegistryErr {
            #[serde(default)]
            code: String,
            #[serde(default)]
            message: String,
        }
        let body = read_limited(&mut resp, 64 << 10, "error answer").await.unwrap_or_default();
        let first = serde_json::from_slice::<Errors>(&body).ok().and_then(|e| e.errors.into_iter().next());
        RegistryError::Status {
            url: redact(url),
            status: status.as_u16(),
            code: first.as_ref().map(|e| trunc(&e.code)).filter(|c| !c.is_empty()),
            message: first.map(|e| trunc(&e.message)).filter(|m| !m.is_empty()),
        }
    }

    /// Fetches a manifest or index by tag or digest (bounded in size, not yet verified: the
    /// caller knows which digest to expect).
    pub async fn manifest(&self, reference: &str, shown: &str) -> Result<FetchedManifest, RegistryError> {
        let path = format!("v2/{}/manifests/{}", self.repository, reference);
        let mut resp = self.get(&path, Some(MANIFEST_ACCEPT), Target::Manifest(shown)).await?;
        let header = |h| resp.headers().get(h).and_then(|v: &HeaderValue| v.to_str().ok()).map(str::to_string);
        let content_type = header(CONTENT_TYPE);
        let digest_header = header(reqwest::header::HeaderName::from_static("docker-content-digest"));
        let url = resp.url().clone();
        let bytes = read_limited(&mut resp, manifest::MAX_MANIFEST_BYTES, "manifest")
            .await
            .map_err(|e| self.body_error(&url, e))?;
        Ok(FetchedManifest { bytes, content_type, digest_header })
    }

    fn body_error(&self, url: &Url, e: RegistryError) -> RegistryError {
        match e {
            RegistryError::Http { source, .. } if source.is_timeout() => {
                RegistryError::Timeout { url: redact(url), timeout: self.timeout }
            }
            RegistryError::Http { source, .. } => RegistryError::Http { url: redact(url), source },
            e => e,
        }
    }

    /// Checks a blob's descriptor (a sha256 digest, at most `limit` bytes) and opens it:
    /// (what errors call it, the answer whose body is the blob).
    async fn open_blob(&self, desc: &Descriptor, limit: u64) -> Result<(String, reqwest::Response), RegistryError> {
        validate_digest(desc.digest().as_ref())?;
        let what = format!("blob {}", desc.digest());
        if desc.size() > limit {
            return Err(RegistryError::TooLarge { what, size: desc.size(), limit });
        }
        let path = format!("v2/{}/blobs/{}", self.repository, desc.digest());
        let resp = self.get(&path, None, Target::Blob(desc.digest().as_ref())).await?;
        Ok((what, resp))
    }

    /// A small blob (an image config) in memory, size and digest checked.
    pub async fn blob_bytes(&self, desc: &Descriptor, limit: u64) -> Result<Vec<u8>, RegistryError> {
        let (what, mut resp) = self.open_blob(desc, limit).await?;
        let url = resp.url().clone();
        let bytes = read_limited(&mut resp, desc.size(), &what).await.map_err(|e| match e {
            RegistryError::TooLarge { what, .. } => {
                RegistryError::SizeMismatch { what, expected: desc.size(), actual: desc.size() + 1 }
            }
            e => self.body_error(&url, e),
        })?;
        if bytes.len() as u64 != desc.size() {
            return Err(RegistryError::SizeMismatch { what, expected: desc.size(), actual: bytes.len() as u64 });
        }
        manifest::verify_digest(&what, desc.digest().as_ref(), &bytes)?;
        Ok(bytes)
    }

    /// Streams a blob into a new temporary file in `dir` while hashing it; the file is
    /// returned only if size and digest match (it is deleted on any error, and when dropped).
    /// `on_bytes` is told how many bytes arrived, for progress.
    pub async fn blob_to_file(
        &self,
        desc: &Descriptor,
        dir: &Path,
        limit: u64,
        mut on_bytes: impl FnMut(u64),
    ) -> Result<tempfile::NamedTempFile, RegistryError> {
        let (what, mut resp) = self.open_blob(desc, limit).await?;
        let url = resp.url().clone();
        if let Some(len) = resp.content_length()
            && len != desc.size()
        {
            return Err(RegistryError::SizeMismatch { what, expected: desc.size(), actual: len });
        }
        let tmp = tempfile::Builder::new()
            .prefix("blob-")
            .suffix(".part")
            .tempfile_in(dir)
            .map_err(|source| RegistryError::Io { path: dir.to_path_buf(), source })?;
        let io_err = |source| RegistryError::Io { path: tmp.path().to_path_buf(), source };
        let file = tmp.as_file().try_clone().map_err(io_err)?;
        let mut out = tokio::io::BufWriter::with_capacity(1 << 20, tokio::fs::File::from_std(file));
        let mut hasher = Sha256::new();
        let mut n: u64 = 0;
        while let Some(chunk) = resp.chunk().await.map_err(|e| self.http_error(&url, e))? {
            n += chunk.len() as u64;
            if n > desc.size() {
                return Err(RegistryError::SizeMismatch { what, expected: desc.size(), actual: n });
            }
            hasher.update(&chunk);
            out.write_all(&chunk).await.map_err(io_err)?;
            on_bytes(chunk.len() as u64);
        }
        out.flush().await.map_err(io_err)?;
        if n != desc.size() {
            return Err(RegistryError::SizeMismatch { what, expected: desc.size(), actual: n });
        }
        let actual = format!("sha256:{}", hex(&hasher.finalize()));
        if actual != desc.digest().as_ref() {
            return Err(RegistryError::DigestMismatch { what, expected: desc.digest().to_string(), actual });
        }
        Ok(tmp)
    }
}

/// Reads a body up to `limit` bytes (more is `TooLarge`).
async fn read_limited(resp: &mut reqwest::Response, limit: u64, what: &str) -> Result<Vec<u8>, RegistryError> {
    if let Some(len) = resp.content_length()
        && len > limit
    {
        return Err(RegistryError::TooLarge { what: what.into(), size: len, limit });
    }
    let mut out = Vec::new();
    while let Some(chunk) =
        resp.chunk().await.map_err(|e| RegistryError::Http { url: redact(resp.url()), source: e.without_url() })?
    {
        if out.len() as u64 + chunk.len() as u64 > limit {
            return Err(RegistryError::TooLarge {
                what: what.into(),
                size: out.len() as u64 + chunk.len() as u64,
                limit,
            });
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_and_redaction() {
        let u = |s: &str| Url::parse(s).unwrap();
        assert!(same_origin(&u("https://r.example/v2/x"), &u("https://r.example:443/")));
        assert!(!same_origin(&u("https://r.example/"), &u("http://r.example/")));
        assert!(!same_origin(&u("http://127.0.0.1:5000/"), &u("http://127.0.0.1:5001/")));
        assert!(!same_origin(&u("https://cdn.example/"), &u("https://r.example/")));
        assert_eq!(redact(&u("https://u:p@s3.example/b?X-Amz-Signature=secret#f")), "https://s3.example/b");
    }
}
