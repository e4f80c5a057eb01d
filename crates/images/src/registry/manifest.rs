//! Image manifests, indexes and configs (Docker v2 schema 2 and OCI), digests, and the
//! choice of the linux/amd64 image in an index.
//!
//! Pure parsing and checking, shared by the registry client and the offline imports. The
//! document types are `oci-spec`'s (Docker's schema 2 has the same shape); what is ours is
//! the choice of document kind, the limits and the checks on top.
//! Invariants: every digest accepted here is `sha256:` + 64 lowercase hex digits (so it is safe
//! in a URL path or a file name); a manifest is only accepted with a supported media type, a
//! config descriptor and layers of a supported layer media type; the layer count matches the
//! config's diff ids.

use oci_spec::image::{Arch, Os};
pub use oci_spec::image::{Descriptor, ImageConfiguration, ImageIndex, ImageManifest, Platform};
use serde::Deserialize;
use sha2::{Digest, Sha256};

use super::error::RegistryError;
use crate::store::ImageConfig;

pub const DOCKER_MANIFEST: &str = "application/vnd.docker.distribution.manifest.v2+json";
pub const DOCKER_MANIFEST_LIST: &str = "application/vnd.docker.distribution.manifest.list.v2+json";
pub const OCI_MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
pub const OCI_INDEX: &str = "application/vnd.oci.image.index.v1+json";
pub const DOCKER_CONFIG: &str = "application/vnd.docker.container.image.v1+json";
pub const OCI_CONFIG: &str = "application/vnd.oci.image.config.v1+json";
/// Schema 1 manifests (signed and unsigned) are long deprecated and not supported.
const DOCKER_SCHEMA1: [&str; 2] = [
    "application/vnd.docker.distribution.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.v1+prettyjws",
];

/// What we send in `Accept` when asking for a manifest.
pub const MANIFEST_ACCEPT: &str = "application/vnd.oci.image.index.v1+json, \
     application/vnd.docker.distribution.manifest.list.v2+json, \
     application/vnd.oci.image.manifest.v1+json, \
     application/vnd.docker.distribution.manifest.v2+json";

/// Layer media types we unpack (the compression itself is read from the blob's first bytes,
/// as docker does, so a mislabelled blob still unpacks; its diff id is checked either way).
const LAYER_MEDIA_TYPES: [&str; 10] = [
    "application/vnd.oci.image.layer.v1.tar",
    "application/vnd.oci.image.layer.v1.tar+gzip",
    "application/vnd.oci.image.layer.v1.tar+zstd",
    "application/vnd.oci.image.layer.nondistributable.v1.tar",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip",
    "application/vnd.oci.image.layer.nondistributable.v1.tar+zstd",
    "application/vnd.docker.image.rootfs.diff.tar",
    "application/vnd.docker.image.rootfs.diff.tar.gzip",
    "application/vnd.docker.image.rootfs.diff.tar.zstd",
    "application/vnd.docker.image.rootfs.foreign.diff.tar.gzip",
];

/// Manifests and indexes larger than this are refused (docker's registry caps them at 4 MiB).
pub const MAX_MANIFEST_BYTES: u64 = 4 << 20;
/// Image configs larger than this are refused.
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;
/// Images with more layers than this are refused (overlayfs cannot stack many more anyway).
pub const MAX_LAYERS: usize = 500;

pub fn is_layer_media_type(mt: &str) -> bool {
    LAYER_MEDIA_TYPES.contains(&mt)
}

/// `sha256:<hex>` of `bytes`.
pub fn sha256_digest(bytes: &[u8]) -> String {
    format!("sha256:{}", hex(&Sha256::digest(bytes)))
}

pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Checks that `digest` is `sha256:` + 64 lowercase hex digits and returns the hex part.
pub fn validate_digest(digest: &str) -> Result<&str, RegistryError> {
    match digest.split_once(':') {
        Some(("sha256", hex))
            if hex.len() == 64 && hex.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)) =>
        {
            Ok(hex)
        }
        Some((alg, _)) if !alg.is_empty() && alg != "sha256" => Err(RegistryError::UnsupportedDigest(trunc(digest))),
        _ => Err(RegistryError::InvalidManifest {
            what: "digest".into(),
            why: format!("{:?} is not sha256:<64 hex digits>", trunc(digest)),
        }),
    }
}

/// Checks that `bytes` hash to `expected`.
pub fn verify_digest(what: &str, expected: &str, bytes: &[u8]) -> Result<(), RegistryError> {
    validate_digest(expected)?;
    let actual = sha256_digest(bytes);
    if actual != expected {
        return Err(RegistryError::DigestMismatch { what: what.into(), expected: expected.into(), actual });
    }
    Ok(())
}

/// At most 100 characters of something from outside, for error messages.
pub(crate) fn trunc(s: &str) -> String {
    s.chars().take(100).collect()
}

/// How a platform is shown: `os/architecture[/variant]`.
pub fn platform_name(p: &Platform) -> String {
    match p.variant() {
        Some(v) => format!("{}/{}/{v}", p.os(), p.architecture()),
        None => format!("{}/{}", p.os(), p.architecture()),
    }
}

/// The annotation `key` of a descriptor.
pub fn annotation<'a>(d: &'a Descriptor, key: &str) -> Option<&'a String> {
    d.annotations().as_ref().and_then(|a| a.get(key))
}

/// A manifest document: one image, or an index of several.
#[derive(Clone, Debug, PartialEq, Eq)]
#[allow(clippy::large_enum_variant)] // one document per import: its size does not matter
pub enum ManifestDoc {
    Image(ImageManifest),
    Index(ImageIndex),
}

/// Reads a manifest or index. The kind comes from the document's `mediaType`, else the HTTP
/// content type, else its shape (`manifests` vs `layers`).
pub fn parse_manifest(what: &str, bytes: &[u8], content_type: Option<&str>) -> Result<ManifestDoc, RegistryError> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Probe {
        #[serde(default)]
        schema_version: u32,
        #[serde(default)]
        media_type: Option<String>,
        #[serde(default)]
        manifests: Option<serde_json::Value>,
        #[serde(default)]
        config: Option<serde_json::Value>,
    }
    let json = |source| RegistryError::Json { what: what.into(), source };
    let probe: Probe = serde_json::from_slice(bytes).map_err(json)?;
    // The content type may carry parameters (`; charset=utf-8`).
    let header = content_type.map(|c| c.split(';').next().unwrap_or("").trim()).filter(|c| !c.is_empty());
    let mt = probe.media_type.as_deref().or(header.filter(|h| *h != "application/json" && *h != "text/plain"));
    let is_index = match mt {
        Some(OCI_INDEX | DOCKER_MANIFEST_LIST) => true,
        Some(OCI_MANIFEST | DOCKER_MANIFEST) => false,
        Some(m) if DOCKER_SCHEMA1.contains(&m) => {
            return Err(RegistryError::UnsupportedMediaType { what: what.into(), media_type: m.into() });
        }
        None if probe.schema_version == 1 => {
            return Err(RegistryError::UnsupportedMediaType {
                what: what.into(),
                media_type: DOCKER_SCHEMA1[0].into(),
            });
        }
        None => probe.manifests.is_some() && probe.config.is_none(),
        Some(m) => return Err(RegistryError::UnsupportedMediaType { what: what.into(), media_type: trunc(m) }),
    };
    if probe.schema_version != 2 {
        return Err(RegistryError::InvalidManifest {
            what: what.into(),
            why: format!("schemaVersion {} (expected 2)", probe.schema_version),
        });
    }
    if is_index {
        let index: ImageIndex = serde_json::from_slice(bytes).map_err(json)?;
        for d in index.manifests() {
            validate_digest(d.digest().as_ref())?;
        }
        Ok(ManifestDoc::Index(index))
    } else {
        let m: ImageManifest = serde_json::from_slice(bytes).map_err(json)?;
        validate_image_manifest(what, &m)?;
        Ok(ManifestDoc::Image(m))
    }
}

fn validate_image_manifest(what: &str, m: &ImageManifest) -> Result<(), RegistryError> {
    validate_digest(m.config().digest().as_ref())?;
    let config_type = m.config().media_type().to_string();
    if config_type != DOCKER_CONFIG && config_type != OCI_CONFIG {
        // Artifacts (helm charts, signatures, ...) are not images.
        return Err(RegistryError::UnsupportedMediaType {
            what: format!("config of {what}"),
            media_type: trunc(&config_type),
        });
    }
    if m.layers().len() > MAX_LAYERS {
        return Err(RegistryError::InvalidManifest {
            what: what.into(),
            why: format!("{} layers (at most {MAX_LAYERS})", m.layers().len()),
        });
    }
    for l in m.layers() {
        validate_digest(l.digest().as_ref())?;
        let mt = l.media_type().to_string();
        if !is_layer_media_type(&mt) {
            return Err(RegistryError::UnsupportedMediaType {
                what: format!("layer {}", l.digest()),
                media_type: trunc(&mt),
            });
        }
    }
    Ok(())
}

/// Attestation manifests (buildx) sit in indexes under platform `unknown/unknown`.
fn is_attestation(d: &Descriptor) -> bool {
    annotation(d, "vnd.docker.reference.type").is_some_and(|t| t == "attestation-manifest")
}

/// Picks the linux/amd64 image of an index: an entry without variant (or `v1`) first, else
/// the first amd64 entry whatever its variant.
pub fn choose_amd64<'a>(reference: &str, manifests: &'a [Descriptor]) -> Result<&'a Descriptor, RegistryError> {
    let candidates: Vec<&Descriptor> = manifests
        .iter()
        .filter(|d| !is_attestation(d))
        .filter(|d| d.platform().as_ref().is_some_and(|p| *p.os() == Os::Linux && *p.architecture() == Arch::Amd64))
        .collect();
    let plain = candidates
        .iter()
        .find(|d| d.platform().as_ref().and_then(|p| p.variant().as_deref()).is_none_or(|v| v.is_empty() || v == "v1"));
    match plain.or(candidates.first()) {
        Some(d) => Ok(d),
        None => Err(RegistryError::NoAmd64 {
            reference: reference.into(),
            available: manifests
                .iter()
                .filter(|d| !is_attestation(d))
                .map(|d| d.platform().as_ref().map_or_else(|| "unknown".to_string(), |p| trunc(&platform_name(p))))
                .collect(),
        }),
    }
}

/// Parses an image config (`application/vnd.oci.image.config.v1+json` or Docker's) and checks
/// its diff ids against the manifest's layer count.
pub fn parse_config(what: &str, bytes: &[u8], layers: usize) -> Result<ImageConfiguration, RegistryError> {
    let c: ImageConfiguration =
        serde_json::from_slice(bytes).map_err(|source| RegistryError::Json { what: what.into(), source })?;
    if c.rootfs().typ() != "layers" {
        return Err(RegistryError::InvalidManifest {
            what: what.into(),
            why: format!("rootfs type {:?} (expected \"layers\")", trunc(c.rootfs().typ())),
        });
    }
    let diff_ids = c.rootfs().diff_ids();
    if diff_ids.len() != layers {
        return Err(RegistryError::InvalidManifest {
            what: what.into(),
            why: format!("{} diff ids for {layers} layers", diff_ids.len()),
        });
    }
    for d in diff_ids {
        validate_digest(d)?;
    }
    if *c.os() != Os::Linux || *c.architecture() != Arch::Amd64 {
        tracing::warn!(what, os = %c.os(), architecture = %c.architecture(), "image is not linux/amd64");
    }
    Ok(c)
}

/// What the store keeps about running an image.
pub fn image_config(c: &ImageConfiguration) -> ImageConfig {
    let Some(c) = c.config() else { return ImageConfig::default() };
    ImageConfig {
        env: c.env().clone().unwrap_or_default(),
        workdir: c.working_dir().clone().unwrap_or_default(),
        user: c.user().clone().unwrap_or_default(),
        entrypoint: c.entrypoint().clone().unwrap_or_default(),
        cmd: c.cmd().clone().unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: char) -> String {
        format!("sha256:{}", n.to_string().repeat(64))
    }

    #[test]
    fn digests() {
        assert_eq!(sha256_digest(b""), "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
        assert!(validate_digest(&d('a')).is_ok());
        assert!(matches!(
            validate_digest(&format!("sha512:{}", "a".repeat(128))),
            Err(RegistryError::UnsupportedDigest(_))
        ));
        for bad in ["", "sha256:", "sha256:ABC", &format!("sha256:{}", "A".repeat(64)), "sha256:../../x", &d('a')[1..]]
        {
            assert!(validate_digest(bad).is_err(), "{bad}");
        }
        assert!(verify_digest("x", &sha256_digest(b"hi"), b"hi").is_ok());
        assert!(matches!(verify_digest("x", &sha256_digest(b"hi"), b"ho"), Err(RegistryError::DigestMismatch { .. })));
    }

    fn manifest_json(mt: Option<&str>, layer_mt: &str) -> String {
        let mt = mt.map(|m| format!(r#""mediaType":"{m}","#)).unwrap_or_default();
        format!(
            r#"{{"schemaVersion":2,{mt}"config":{{"mediaType":"{OCI_CONFIG}","digest":"{}","size":10}},
               "layers":[{{"mediaType":"{layer_mt}","digest":"{}","size":20}}]}}"#,
            d('c'),
            d('1')
        )
    }

    #[test]
    fn manifests_and_indexes() {
        let m = parse_manifest(
            "m",
            manifest_json(Some(OCI_MANIFEST), "application/vnd.oci.image.layer.v1.tar+zstd").as_bytes(),
            None,
        )
        .unwrap();
        let ManifestDoc::Image(m) = m else { panic!("expected an image manifest") };
        assert_eq!(m.layers()[0].size(), 20);
        // No mediaType in the body: the header decides, else the shape.
        let body = manifest_json(None, "application/vnd.docker.image.rootfs.diff.tar.gzip");
        assert!(matches!(parse_manifest("m", body.as_bytes(), Some(DOCKER_MANIFEST)), Ok(ManifestDoc::Image(_))));
        assert!(matches!(
            parse_manifest("m", body.as_bytes(), Some("application/json; charset=utf-8")),
            Ok(ManifestDoc::Image(_))
        ));
        let bad_layer = manifest_json(Some(OCI_MANIFEST), "application/vnd.cncf.helm.chart.content.v1.tar+gzip");
        assert!(matches!(
            parse_manifest("m", bad_layer.as_bytes(), None),
            Err(RegistryError::UnsupportedMediaType { .. })
        ));
        let schema1 = r#"{"schemaVersion":1,"name":"x","fsLayers":[]}"#;
        assert!(matches!(
            parse_manifest("m", schema1.as_bytes(), None),
            Err(RegistryError::UnsupportedMediaType { .. })
        ));
        assert!(matches!(parse_manifest("m", b"{not json", None), Err(RegistryError::Json { .. })));

        let index = format!(
            r#"{{"schemaVersion":2,"manifests":[
                {{"mediaType":"{OCI_MANIFEST}","digest":"{}","size":1,"platform":{{"os":"linux","architecture":"arm64","variant":"v8"}}}},
                {{"mediaType":"{OCI_MANIFEST}","digest":"{}","size":1,"platform":{{"os":"unknown","architecture":"unknown"}},
                  "annotations":{{"vnd.docker.reference.type":"attestation-manifest"}}}},
                {{"mediaType":"{OCI_MANIFEST}","digest":"{}","size":1,"platform":{{"os":"linux","architecture":"amd64","variant":"v3"}}}},
                {{"mediaType":"{OCI_MANIFEST}","digest":"{}","size":1,"platform":{{"os":"linux","architecture":"amd64"}}}}]}}"#,
            d('1'),
            d('2'),
            d('3'),
            d('4')
        );
        let ManifestDoc::Index(i) = parse_manifest("i", index.as_bytes(), Some(DOCKER_MANIFEST_LIST)).unwrap() else {
            panic!("expected an index")
        };
        assert_eq!(choose_amd64("r", i.manifests()).unwrap().digest().as_ref(), d('4'));
        let only_v3 = &i.manifests()[..3];
        assert_eq!(choose_amd64("r", only_v3).unwrap().digest().as_ref(), d('3'));
        let arm = &i.manifests()[..2];
        match choose_amd64("r", arm) {
            Err(RegistryError::NoAmd64 { available, .. }) => assert_eq!(available, vec!["linux/arm64/v8".to_string()]),
            other => panic!("expected NoAmd64, got {other:?}"),
        }
    }

    #[test]
    fn configs() {
        let c = format!(
            r#"{{"architecture":"amd64","os":"linux","config":{{"Env":["PATH=/bin"],"Cmd":["sh"],"WorkingDir":"/w","User":"1:1"}},
               "rootfs":{{"type":"layers","diff_ids":["{}"]}}}}"#,
            d('a')
        );
        let parsed = parse_config("c", c.as_bytes(), 1).unwrap();
        let ic = image_config(&parsed);
        assert_eq!(ic.env, vec!["PATH=/bin"]);
        assert_eq!(ic.cmd, vec!["sh"]);
        assert_eq!(ic.workdir, "/w");
        assert_eq!(ic.user, "1:1");
        assert!(ic.entrypoint.is_empty());
        assert!(matches!(parse_config("c", c.as_bytes(), 2), Err(RegistryError::InvalidManifest { .. })));
        // Null fields (docker writes `"Cmd": null`) are fine.
        let nulls = format!(
            r#"{{"architecture":"amd64","os":"linux","config":{{"Env":null,"Cmd":null}},"rootfs":{{"type":"layers","diff_ids":["{}"]}}}}"#,
            d('b')
        );
        assert_eq!(image_config(&parse_config("c", nulls.as_bytes(), 1).unwrap()), ImageConfig::default());
        // The OCI spec requires os and architecture: a config without them is not an image's.
        let bare = format!(r#"{{"rootfs":{{"type":"layers","diff_ids":["{}"]}}}}"#, d('b'));
        assert!(matches!(parse_config("c", bare.as_bytes(), 1), Err(RegistryError::Json { .. })));
    }
}
