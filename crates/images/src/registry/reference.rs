//! Image references: `[host[:port]/]repo[:tag][@sha256:...]`, docker's rules.
//!
//! A first path segment is a host when it contains `.` or `:` or is `localhost`; otherwise the
//! image is on Docker Hub (`registry-1.docker.io`), where single-segment names live under
//! `library/`. Invariant: every part of a parsed reference is safe to put in a URL path.
//!
//! The grammar is docker's; a test holds this parser to `oci-spec`'s (docker's regular
//! expression) on a corpus. Ours stays because it also takes IPv6 literal registries
//! (`[::1]:5000/x`, which that expression refuses), refuses digests other than sha256 up front,
//! and says which part of a reference is wrong.

use super::auth::is_docker_hub;
use super::error::RegistryError;
use super::manifest::{trunc, validate_digest};

pub const DOCKER_HUB_REGISTRY: &str = "registry-1.docker.io";

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Reference {
    /// `host[:port]`.
    pub registry: String,
    pub repository: String,
    pub tag: Option<String>,
    /// `sha256:<hex>`; when present it decides what is fetched (the tag is informative).
    pub digest: Option<String>,
}

impl Reference {
    pub fn parse(input: &str) -> Result<Reference, RegistryError> {
        let bad = |why: &'static str| RegistryError::InvalidReference { reference: trunc(input), why };
        if input.is_empty() || input.len() > 1024 {
            return Err(bad("empty or longer than 1024 bytes"));
        }
        let (name_tag, digest) = match input.split_once('@') {
            Some((n, d)) => {
                validate_digest(d).map_err(|e| match e {
                    RegistryError::UnsupportedDigest(d) => RegistryError::UnsupportedDigest(d),
                    _ => bad("the digest must be sha256:<64 lowercase hex digits>"),
                })?;
                (n, Some(d.to_string()))
            }
            None => (input, None),
        };
        let (name, tag) = match name_tag.rfind(':') {
            Some(i) if !name_tag[i + 1..].contains('/') => (&name_tag[..i], Some(&name_tag[i + 1..])),
            _ => (name_tag, None),
        };
        let (host, repo) = match name.split_once('/') {
            Some((h, rest)) if h.contains('.') || h.contains(':') || h == "localhost" => (h, rest),
            _ => ("docker.io", name),
        };
        if !valid_host(host) {
            return Err(bad("the registry must be host[:port]"));
        }
        let hub = is_docker_hub(host);
        let registry = if hub { DOCKER_HUB_REGISTRY.to_string() } else { host.to_string() };
        let repository = if hub && !repo.contains('/') { format!("library/{repo}") } else { repo.to_string() };
        if !valid_repository(&repository) {
            return Err(bad(
                "the repository must be lowercase path segments of [a-z0-9] joined by '.', '_', '__' or '-'",
            ));
        }
        if let Some(t) = tag
            && !valid_tag(t)
        {
            return Err(bad("the tag must be [A-Za-z0-9_][A-Za-z0-9._-]{0,127}"));
        }
        Ok(Reference { registry, repository, tag: tag.map(str::to_string), digest })
    }

    /// What goes after `/manifests/`: the digest if any, else the tag (default `latest`).
    pub fn manifest_ref(&self) -> &str {
        self.digest.as_deref().or(self.tag.as_deref()).unwrap_or("latest")
    }

    /// `host/repo@digest` once the manifest digest is known (for `source` fields).
    pub fn pinned(&self, manifest_digest: &str) -> String {
        format!("{}/{}@{}", self.registry, self.repository, manifest_digest)
    }
}

impl std::fmt::Display for Reference {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.registry, self.repository)?;
        if let Some(t) = &self.tag {
            write!(f, ":{t}")?;
        }
        if let Some(d) = &self.digest {
            write!(f, "@{d}")?;
        }
        Ok(())
    }
}

fn valid_host(h: &str) -> bool {
    let (name, port) = if let Some(rest) = h.strip_prefix('[') {
        // [v6]:port
        let Some((v6, after)) = rest.split_once(']') else { return false };
        if v6.is_empty() || !v6.bytes().all(|c| c.is_ascii_hexdigit() || c == b':' || c == b'.') {
            return false;
        }
        match after {
            "" => return true,
            p => match p.strip_prefix(':') {
                Some(p) => ("v6", Some(p)),
                None => return false,
            },
        }
    } else {
        match h.rsplit_once(':') {
            Some((n, p)) => (n, Some(p)),
            None => (h, None),
        }
    };
    let name_ok = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|l| {
            !l.is_empty()
                && !l.starts_with('-')
                && !l.ends_with('-')
                && l.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'-')
        });
    let port_ok = port.is_none_or(|p| {
        !p.is_empty() && p.len() <= 5 && p.bytes().all(|c| c.is_ascii_digit()) && p.parse::<u16>().is_ok_and(|n| n > 0)
    });
    name_ok && port_ok
}

fn valid_repository(r: &str) -> bool {
    !r.is_empty()
        && r.len() <= 255
        && r.split('/').all(|seg| {
            let b = seg.as_bytes();
            let alnum = |c: &u8| c.is_ascii_lowercase() || c.is_ascii_digit();
            if b.is_empty() || !alnum(&b[0]) || !alnum(&b[b.len() - 1]) {
                return false;
            }
            // Separators: '.', '_', '__', or any run of '-'; never two separators of other kinds
            // in a row.
            let mut i = 0;
            while i < b.len() {
                if alnum(&b[i]) {
                    i += 1;
                    continue;
                }
                let start = i;
                while i < b.len() && !alnum(&b[i]) {
                    i += 1;
                }
                let sep = &seg[start..i];
                let ok = sep == "." || sep == "_" || sep == "__" || sep.bytes().all(|c| c == b'-');
                if !ok {
                    return false;
                }
            }
            true
        })
}

fn valid_tag(t: &str) -> bool {
    let b = t.as_bytes();
    b.first().is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_')
        && b.len() <= 128
        && b.iter().all(|c| c.is_ascii_alphanumeric() || b"._-".contains(c))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(s: &str) -> (String, String, Option<String>, Option<String>) {
        let r = Reference::parse(s).unwrap();
        (r.registry, r.repository, r.tag, r.digest)
    }

    #[test]
    fn parses_like_docker() {
        let hub = DOCKER_HUB_REGISTRY.to_string();
        assert_eq!(p("busybox"), (hub.clone(), "library/busybox".into(), None, None));
        assert_eq!(p("busybox:1.36"), (hub.clone(), "library/busybox".into(), Some("1.36".into()), None));
        assert_eq!(p("docker.io/library/busybox"), (hub.clone(), "library/busybox".into(), None, None));
        assert_eq!(p("index.docker.io/busybox"), (hub.clone(), "library/busybox".into(), None, None));
        assert_eq!(p("someone/tool:v1"), (hub, "someone/tool".into(), Some("v1".into()), None));
        assert_eq!(p("127.0.0.1:5000/a/b"), ("127.0.0.1:5000".into(), "a/b".into(), None, None));
        assert_eq!(p("localhost/x:y"), ("localhost".into(), "x".into(), Some("y".into()), None));
        assert_eq!(p("[::1]:5000/x"), ("[::1]:5000".into(), "x".into(), None, None));
        let d = format!("sha256:{}", "a".repeat(64));
        assert_eq!(
            p(&format!("reg.example/x:t@{d}")),
            ("reg.example".into(), "x".into(), Some("t".into()), Some(d.clone()))
        );
        let r = Reference::parse(&format!("reg.example/x:t@{d}")).unwrap();
        assert_eq!(r.manifest_ref(), d);
        assert_eq!(r.to_string(), format!("reg.example/x:t@{d}"));
        assert_eq!(Reference::parse("reg.example/x").unwrap().manifest_ref(), "latest");
        assert_eq!(p("a/b__c.d-e--f"), (DOCKER_HUB_REGISTRY.into(), "a/b__c.d-e--f".into(), None, None));
    }

    #[test]
    fn refuses_nonsense() {
        for bad in [
            "",
            "UPPER",
            "x/../y",
            "reg.example/",
            "reg.example//x",
            "reg.example:99999/x",
            "reg.example:0/x",
            "reg_bad.example/x",
            "x:",
            "x:.bad",
            "x@sha256:abc",
            "a/b._c",
            "a/-b",
            "x y",
        ] {
            assert!(matches!(Reference::parse(bad), Err(RegistryError::InvalidReference { .. })), "{bad:?}");
        }
        assert!(matches!(
            Reference::parse(&format!("x@sha512:{}", "a".repeat(128))),
            Err(RegistryError::UnsupportedDigest(_))
        ));
    }

    /// On references both accept, both read the same registry, repository, tag and digest
    /// (with docker.io as Docker Hub and `latest` when no tag is named); what one refuses the
    /// other refuses, but for IPv6 literal hosts and non-sha256 digests (see the module
    /// documentation).
    #[test]
    fn agrees_with_oci_spec() {
        let d = format!("sha256:{}", "a".repeat(64));
        let corpus = [
            "busybox".to_string(),
            "busybox:1.36".into(),
            "library/busybox:latest".into(),
            "docker.io/library/busybox".into(),
            "index.docker.io/busybox".into(),
            "someone/tool:v1".into(),
            "127.0.0.1:5000/a/b".into(),
            "localhost/x:y".into(),
            "localhost:5000/x".into(),
            "reg.example/deep/path/name:tag-1.2_3".into(),
            format!("reg.example/x:t@{d}"),
            format!("reg.example/x@{d}"),
            "a/b__c.d-e--f".into(),
            "test.com:5000".into(),
            "UPPER".into(),
            "x/../y".into(),
            "reg.example/".into(),
            "reg.example//x".into(),
            "x:".into(),
            "x:.bad".into(),
            "x@sha256:abc".into(),
            "a/b._c".into(),
            "a/-b".into(),
            "x y".into(),
            "-x".into(),
        ];
        for input in &corpus {
            let ours = Reference::parse(input);
            let theirs = oci_spec::distribution::Reference::try_from(input.as_str());
            match (ours, theirs) {
                (Ok(o), Ok(t)) => {
                    let registry = if t.registry() == "docker.io" { DOCKER_HUB_REGISTRY } else { t.registry() };
                    assert_eq!(o.registry, registry, "{input}");
                    assert_eq!(o.repository, t.repository(), "{input}");
                    assert_eq!(o.digest.as_deref(), t.digest(), "{input}");
                    let tag = o.tag.as_deref().or(o.digest.is_none().then_some("latest"));
                    assert_eq!(tag, t.tag(), "{input}");
                }
                (Err(_), Err(_)) => {}
                (o, t) => panic!("{input:?}: ours {o:?}, oci-spec {t:?}"),
            }
        }
    }
}
