//! Registry documents from arbitrary bytes: manifests and indexes under every media type,
//! image configs, references and Docker credential files parse or fail, never panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use opendsec_images::registry::{auth, manifest, reference};

const TYPES: [Option<&str>; 5] = [
    None,
    Some("application/vnd.oci.image.manifest.v1+json"),
    Some("application/vnd.oci.image.index.v1+json"),
    Some("application/vnd.docker.distribution.manifest.v2+json"),
    Some("application/vnd.docker.distribution.manifest.list.v2+json"),
];

fuzz_target!(|data: &[u8]| {
    for t in TYPES {
        if let Ok(manifest::ManifestDoc::Index(i)) = manifest::parse_manifest("fuzz", data, t) {
            let _ = manifest::choose_amd64("fuzz", i.manifests());
        }
    }
    for layers in [0, 1, 3] {
        if let Ok(c) = manifest::parse_config("fuzz", data, layers) {
            let _ = manifest::image_config(&c);
        }
    }
    let _ = auth::DockerConfig::parse(std::path::Path::new("fuzz.json"), data);
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = reference::Reference::parse(s);
        let _ = opendsec_images::LayerId::parse(s);
        let _ = opendsec_images::ImageRef::parse("root", s);
        let _ = opendsec_images::compose::Source::parse(s);
    }
});
