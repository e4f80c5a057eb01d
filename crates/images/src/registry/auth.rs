//! Registry credentials: where they come from (`--username` + password, docker's
//! `config.json`, docker credential helpers) and the `WWW-Authenticate` challenges that say
//! how to use them.
//!
//! Invariants: a password, identity token or bearer token never appears in a `Debug` or
//! `Display` output, an error message or a log line; credentials are only ever attached to
//! requests for the registry's own origin and its token realm (see `registry::Client`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde::Deserialize;

use super::error::RegistryError;

/// A user name and password (or personal access token) for a registry.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    pub username: String,
    pub password: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials").field("username", &self.username).field("password", &"<redacted>").finish()
    }
}

/// How we authenticate to one registry.
#[derive(Clone, PartialEq, Eq)]
pub enum Auth {
    Anonymous,
    /// Sent as `Basic` to the registry, or to the token realm in exchange for a token.
    Basic(Credentials),
    /// An OAuth2 refresh token (docker's `identitytoken`), exchanged at the realm with
    /// `grant_type=refresh_token`.
    IdentityToken(String),
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Auth::Anonymous => f.write_str("Anonymous"),
            Auth::Basic(c) => f.debug_tuple("Basic").field(c).finish(),
            Auth::IdentityToken(_) => f.write_str("IdentityToken(<redacted>)"),
        }
    }
}

/// `Basic <base64(user:password)>`.
pub fn basic_header(c: &Credentials) -> String {
    format!("Basic {}", BASE64.encode(format!("{}:{}", c.username, c.password)))
}

/// The registry hosts that mean Docker Hub, and the key docker uses for it in config.json.
const DOCKER_HUB_HOSTS: [&str; 3] = ["registry-1.docker.io", "index.docker.io", "docker.io"];
const DOCKER_HUB_SERVER: &str = "https://index.docker.io/v1/";

pub fn is_docker_hub(host: &str) -> bool {
    DOCKER_HUB_HOSTS.contains(&host)
}

/// A config.json key (`https://host:port/v1/`, `host:port`, ...) reduced to `host:port`.
fn normalize_key(key: &str) -> String {
    let k = key.strip_prefix("https://").or_else(|| key.strip_prefix("http://")).unwrap_or(key);
    k.split('/').next().unwrap_or("").to_ascii_lowercase()
}

fn key_matches(key: &str, host: &str) -> bool {
    let k = normalize_key(key);
    if is_docker_hub(host) { is_docker_hub(&k) } else { k == host.to_ascii_lowercase() }
}

/// The part of docker's config.json we read.
#[derive(Debug, Default, Deserialize)]
pub struct DockerConfig {
    #[serde(default)]
    auths: std::collections::BTreeMap<String, AuthEntry>,
    #[serde(default, rename = "credsStore")]
    creds_store: Option<String>,
    #[serde(default, rename = "credHelpers")]
    cred_helpers: std::collections::BTreeMap<String, String>,
}

#[derive(Default, Deserialize)]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    identitytoken: Option<String>,
}

impl std::fmt::Debug for AuthEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AuthEntry(<redacted>)")
    }
}

/// Where the credentials for a host are, according to config.json.
#[derive(Debug, PartialEq, Eq)]
pub enum Found {
    Auth(Auth),
    /// Ask `docker-credential-<helper>`.
    Helper(String),
    None,
}

impl DockerConfig {
    pub fn parse(path: &Path, bytes: &[u8]) -> Result<DockerConfig, RegistryError> {
        serde_json::from_slice(bytes).map_err(|e| RegistryError::DockerConfig {
            path: path.to_path_buf(),
            // Only the position: serde's messages may quote values, which may be secrets.
            why: format!(
                "not a valid docker config ({:?} error at line {}, column {})",
                e.classify(),
                e.line(),
                e.column()
            ),
        })
    }

    /// docker's order: a helper for this host, else an inline entry, else the default store.
    pub fn lookup(&self, path: &Path, host: &str) -> Result<Found, RegistryError> {
        if let Some((_, helper)) = self.cred_helpers.iter().find(|(k, _)| key_matches(k, host)) {
            return Ok(Found::Helper(helper.clone()));
        }
        // Several keys may match (`docker.io` and `https://index.docker.io/v1/`): prefer one
        // that holds something.
        for (_, e) in self.auths.iter().filter(|(k, _)| key_matches(k, host)) {
            if let Some(t) = e.identitytoken.as_deref().filter(|t| !t.is_empty()) {
                return Ok(Found::Auth(Auth::IdentityToken(t.to_string())));
            }
            if let Some(a) = e.auth.as_deref().filter(|a| !a.is_empty()) {
                let bad = |why: &str| RegistryError::DockerConfig {
                    path: path.to_path_buf(),
                    why: format!("auths entry for {host}: {why}"),
                };
                let decoded = BASE64.decode(a.trim()).map_err(|_| bad("auth is not base64"))?;
                let text = String::from_utf8(decoded).map_err(|_| bad("auth is not UTF-8"))?;
                let (u, p) = text.split_once(':').ok_or_else(|| bad("auth is not user:password"))?;
                return Ok(Found::Auth(Auth::Basic(Credentials { username: u.into(), password: p.into() })));
            }
            if let (Some(u), Some(p)) = (&e.username, &e.password) {
                return Ok(Found::Auth(Auth::Basic(Credentials { username: u.clone(), password: p.clone() })));
            }
        }
        match &self.creds_store {
            Some(s) if !s.is_empty() => Ok(Found::Helper(s.clone())),
            _ => Ok(Found::None),
        }
    }
}

/// `--docker-config`, else `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`.
pub fn docker_config_path(explicit: Option<&Path>) -> Option<PathBuf> {
    if let Some(p) = explicit {
        return Some(p.to_path_buf());
    }
    if let Some(d) = std::env::var_os("DOCKER_CONFIG").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d).join("config.json"));
    }
    std::env::var_os("HOME").filter(|h| !h.is_empty()).map(|h| PathBuf::from(h).join(".docker/config.json"))
}

/// The credentials to use for `host`: explicit ones, else docker's config (a missing file
/// means anonymous; a broken one is an error only when it was named explicitly).
pub async fn resolve(
    host: &str,
    explicit: Option<&Credentials>,
    docker_config: Option<&Path>,
    timeout: Duration,
) -> Result<Auth, RegistryError> {
    if let Some(c) = explicit {
        return Ok(Auth::Basic(c.clone()));
    }
    let Some(path) = docker_config_path(docker_config) else { return Ok(Auth::Anonymous) };
    let bytes = match tokio::fs::read(&path).await {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && docker_config.is_none() => return Ok(Auth::Anonymous),
        Err(source) => return Err(RegistryError::Io { path, source }),
    };
    let found = DockerConfig::parse(&path, &bytes).and_then(|c| c.lookup(&path, host));
    let found = match found {
        Ok(f) => f,
        Err(e) if docker_config.is_none() => {
            tracing::warn!(error = %e, "ignoring the default docker config");
            Found::None
        }
        Err(e) => return Err(e),
    };
    match found {
        Found::Auth(a) => Ok(a),
        Found::None => Ok(Auth::Anonymous),
        Found::Helper(h) => match run_helper(&h, host, timeout).await {
            Ok(a) => Ok(a),
            // A default config copied from another machine often names a helper that is not
            // installed here: that must not break anonymous pulls.
            Err(e) if docker_config.is_none() => {
                tracing::warn!(error = %e, "ignoring the credential helper of the default docker config");
                Ok(Auth::Anonymous)
            }
            Err(e) => Err(e),
        },
    }
}

/// What a docker credential helper prints for `get`.
#[derive(Deserialize)]
struct HelperOutput {
    #[serde(rename = "Username", default)]
    username: String,
    #[serde(rename = "Secret", default)]
    secret: String,
}

/// Interprets a helper's answer: the user name `<token>` marks an identity token.
fn helper_auth(stdout: &[u8]) -> Option<Auth> {
    let out: HelperOutput = serde_json::from_slice(stdout).ok()?;
    if out.secret.is_empty() {
        return Some(Auth::Anonymous);
    }
    Some(if out.username == "<token>" {
        Auth::IdentityToken(out.secret)
    } else {
        Auth::Basic(Credentials { username: out.username, password: out.secret })
    })
}

/// Runs `docker-credential-<helper> get` with the server URL on stdin.
async fn run_helper(helper: &str, host: &str, timeout: Duration) -> Result<Auth, RegistryError> {
    let err = |why: String| RegistryError::CredentialHelper { helper: helper.chars().take(64).collect(), why };
    // The name comes from a file: it must not be able to name another program.
    if helper.is_empty() || !helper.bytes().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c)) {
        return Err(err("the helper name must be [A-Za-z0-9._-]+".into()));
    }
    let server = if is_docker_hub(host) { DOCKER_HUB_SERVER.to_string() } else { host.to_string() };
    run_helper_program(helper, Path::new(&format!("docker-credential-{helper}")), &server, timeout).await
}

/// Runs a credential helper program (looked up in `PATH` unless a path) for `server`.
async fn run_helper_program(
    helper: &str,
    program: &Path,
    server: &str,
    timeout: Duration,
) -> Result<Auth, RegistryError> {
    use tokio::io::AsyncWriteExt;
    let err = |why: String| RegistryError::CredentialHelper { helper: helper.chars().take(64).collect(), why };
    let program_name = program.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let program = program.as_os_str();
    let mut child = tokio::process::Command::new(program)
        .arg("get")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .map_err(|e| err(format!("cannot run {program_name}: {e}")))?;
    if let Some(mut stdin) = child.stdin.take() {
        // A helper that does not read its input (a broken pipe here) is judged by its answer.
        let _ = stdin.write_all(server.as_bytes()).await;
    }
    let out = tokio::time::timeout(timeout.max(Duration::from_secs(10)), child.wait_with_output())
        .await
        .map_err(|_| err(format!("{program_name} did not answer")))?
        .map_err(|e| err(format!("{program_name}: {e}")))?;
    if !out.status.success() {
        // The helpers' way of saying "nothing stored"; anything else is not echoed (it
        // could contain secrets).
        let text = String::from_utf8_lossy(&out.stdout).to_string() + &String::from_utf8_lossy(&out.stderr);
        if text.contains("credentials not found") {
            return Ok(Auth::Anonymous);
        }
        return Err(err(format!("{program_name} failed ({})", out.status)));
    }
    helper_auth(&out.stdout).ok_or_else(|| err(format!("{program_name} printed something that is not its JSON answer")))
}

/// One authentication challenge from a `WWW-Authenticate` header.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Challenge {
    Bearer { realm: String, service: Option<String>, scope: Option<String> },
    Basic,
}

/// Parses `WWW-Authenticate` (RFC 7235: `scheme param="value", param=token, Other ...`).
/// Schemes other than Bearer and Basic are skipped; a Bearer challenge without realm too.
pub fn parse_challenges(header: &str) -> Vec<Challenge> {
    let mut out = Vec::new();
    let mut scheme: Option<String> = None;
    let mut params: Vec<(String, String)> = Vec::new();
    let flush = |scheme: &mut Option<String>, params: &mut Vec<(String, String)>, out: &mut Vec<Challenge>| {
        if let Some(s) = scheme.take() {
            let get = |k: &str| params.iter().find(|(pk, _)| pk.eq_ignore_ascii_case(k)).map(|(_, v)| v.clone());
            if s.eq_ignore_ascii_case("bearer") {
                if let Some(realm) = get("realm") {
                    out.push(Challenge::Bearer { realm, service: get("service"), scope: get("scope") });
                }
            } else if s.eq_ignore_ascii_case("basic") {
                out.push(Challenge::Basic);
            }
        }
        params.clear();
    };
    let chars: Vec<char> = header.chars().collect();
    let mut i = 0;
    let token = |i: &mut usize| {
        let start = *i;
        while *i < chars.len() && !chars[*i].is_whitespace() && chars[*i] != ',' && chars[*i] != '=' {
            *i += 1;
        }
        chars[start..*i].iter().collect::<String>()
    };
    let skip_ws = |i: &mut usize| {
        while *i < chars.len() && chars[*i].is_whitespace() {
            *i += 1;
        }
    };
    while i < chars.len() {
        skip_ws(&mut i);
        if i < chars.len() && chars[i] == ',' {
            i += 1;
            continue;
        }
        let word = token(&mut i);
        if word.is_empty() {
            // A stray '=' or similar: skip it.
            i += 1;
            continue;
        }
        skip_ws(&mut i);
        if i < chars.len() && chars[i] == '=' {
            // A parameter (or a token68 padding, which we do not use).
            i += 1;
            skip_ws(&mut i);
            let value = if i < chars.len() && chars[i] == '"' {
                i += 1;
                let mut v = String::new();
                while i < chars.len() && chars[i] != '"' {
                    if chars[i] == '\\' && i + 1 < chars.len() {
                        i += 1;
                    }
                    v.push(chars[i]);
                    i += 1;
                }
                i += 1; // closing quote
                v
            } else {
                token(&mut i)
            };
            params.push((word, value));
        } else {
            // A new scheme.
            flush(&mut scheme, &mut params, &mut out);
            scheme = Some(word);
        }
    }
    flush(&mut scheme, &mut params, &mut out);
    out
}

/// A token service's answer: `token` (docker) or `access_token` (OAuth2).
#[derive(Debug, Deserialize)]
pub struct TokenResponse {
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    access_token: Option<String>,
}

impl TokenResponse {
    pub fn into_token(self) -> Option<String> {
        self.token.filter(|t| !t.is_empty()).or(self.access_token.filter(|t| !t.is_empty()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn challenges() {
        let h = r#"Bearer realm="https://auth.docker.io/token",service="registry.docker.io",scope="repository:library/busybox:pull""#;
        assert_eq!(
            parse_challenges(h),
            vec![Challenge::Bearer {
                realm: "https://auth.docker.io/token".into(),
                service: Some("registry.docker.io".into()),
                scope: Some("repository:library/busybox:pull".into()),
            }]
        );
        assert_eq!(parse_challenges(r#"Basic realm="Registry Realm""#), vec![Challenge::Basic]);
        let several = r#"Negotiate, Basic realm="a, b", BEARER Realm=http://t/x , scope="repository:a:pull,push", Bearer service=x"#;
        assert_eq!(
            parse_challenges(several),
            vec![
                Challenge::Basic,
                Challenge::Bearer {
                    realm: "http://t/x".into(),
                    service: None,
                    scope: Some("repository:a:pull,push".into())
                }
            ]
        );
        assert_eq!(
            parse_challenges(r#"Bearer realm="a\"b""#),
            vec![Challenge::Bearer { realm: "a\"b".into(), service: None, scope: None }]
        );
        for junk in ["", "=", "\"", ",,,", "Bearer realm=\"unterminated", "===Bearer"] {
            let _ = parse_challenges(junk); // must not panic
        }
    }

    #[test]
    fn docker_config_lookup() {
        let p = Path::new("/x/config.json");
        let cfg = DockerConfig::parse(
            p,
            format!(
                r#"{{"auths":{{
                    "https://index.docker.io/v1/":{{"auth":"{}"}},
                    "127.0.0.1:5000":{{"identitytoken":"refresh-me"}},
                    "http://reg.example:8443/v2/":{{"username":"u","password":"p"}},
                    "bad.example":{{"auth":"!!!"}},
                    "helper.example":{{}}
                }},
                "credHelpers":{{"ecr.example":"ecr-login"}},
                "credsStore":"desktop"}}"#,
                BASE64.encode("hub:secret")
            )
            .as_bytes(),
        )
        .unwrap();
        let basic = |u: &str, p: &str| Found::Auth(Auth::Basic(Credentials { username: u.into(), password: p.into() }));
        assert_eq!(cfg.lookup(p, "registry-1.docker.io").unwrap(), basic("hub", "secret"));
        assert_eq!(cfg.lookup(p, "127.0.0.1:5000").unwrap(), Found::Auth(Auth::IdentityToken("refresh-me".into())));
        assert_eq!(cfg.lookup(p, "reg.example:8443").unwrap(), basic("u", "p"));
        assert_eq!(cfg.lookup(p, "ecr.example").unwrap(), Found::Helper("ecr-login".into()));
        assert_eq!(cfg.lookup(p, "helper.example").unwrap(), Found::Helper("desktop".into()));
        assert_eq!(cfg.lookup(p, "other.example").unwrap(), Found::Helper("desktop".into()));
        let err = cfg.lookup(p, "bad.example").unwrap_err().to_string();
        assert!(err.contains("not base64") && !err.contains("!!!"), "{err}");
        let plain = DockerConfig::parse(p, b"{}").unwrap();
        assert_eq!(plain.lookup(p, "x").unwrap(), Found::None);
        assert!(DockerConfig::parse(p, b"[").is_err());
    }

    #[test]
    fn helper_answers() {
        assert_eq!(
            helper_auth(br#"{"ServerURL":"x","Username":"u","Secret":"s"}"#),
            Some(Auth::Basic(Credentials { username: "u".into(), password: "s".into() }))
        );
        assert_eq!(helper_auth(br#"{"Username":"<token>","Secret":"t"}"#), Some(Auth::IdentityToken("t".into())));
        assert_eq!(helper_auth(b"nope"), None);
    }

    #[tokio::test]
    async fn helper_programs() {
        let dir = tempfile::tempdir().unwrap();
        let script = |name: &str, body: &str| {
            let p = dir.path().join(name);
            std::fs::write(&p, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
            p
        };
        // All written before any runs: a process forked meanwhile elsewhere in the test binary
        // briefly holds the written file open, and exec'ing it then fails (ETXTBSY).
        let ok =
            script("ok", r#"read s; [ "$1" = get ] && [ "$s" = reg.example ] && echo '{"Username":"u","Secret":"p"}'"#);
        let none = script("none", "echo 'credentials not found in native keychain'; exit 1");
        let broken = script("broken", "echo 'secret-ish output'; exit 3");
        tokio::time::sleep(Duration::from_millis(50)).await;
        let t = Duration::from_secs(10);
        // The server URL arrives on stdin; the answer is JSON on stdout.
        assert_eq!(
            run_helper_program("ok", &ok, "reg.example", t).await.unwrap(),
            Auth::Basic(Credentials { username: "u".into(), password: "p".into() })
        );
        assert_eq!(run_helper_program("none", &none, "x", t).await.unwrap(), Auth::Anonymous);
        let e = run_helper_program("broken", &broken, "x", t).await.unwrap_err().to_string();
        assert!(e.contains("failed") && !e.contains("secret-ish"), "{e}");
        assert!(run_helper_program("missing", &dir.path().join("missing"), "x", t).await.is_err());
        assert!(matches!(run_helper("../../bin/sh", "x", t).await, Err(RegistryError::CredentialHelper { .. })));
    }

    #[test]
    fn secrets_stay_out_of_debug() {
        let c = Credentials { username: "u".into(), password: "hunter2".into() };
        assert!(!format!("{:?}", Auth::Basic(c)).contains("hunter2"));
        assert!(!format!("{:?}", Auth::IdentityToken("tok-123".into())).contains("tok-123"));
        assert_eq!(
            basic_header(&Credentials { username: "a".into(), password: "b:c".into() }),
            format!("Basic {}", BASE64.encode("a:b:c"))
        );
        let t: TokenResponse = serde_json::from_str(r#"{"access_token":"x","token":""}"#).unwrap();
        assert_eq!(t.into_token().as_deref(), Some("x"));
    }
}
