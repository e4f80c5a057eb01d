//! Composition: a new image whose layers are the layers of several images, in order, copying
//! no data (reference section 10, "Composition").
//!
//! Decisions, so the result is predictable:
//! - **Layers**: the sources' lists concatenated, the first source at the bottom. A layer that
//!   appears more than once is kept only at its top-most place: in overlay stacking every path
//!   a layer provides (files, directories, whiteouts) is also provided by its higher copy, so
//!   the lower copy changes nothing visible, and overlayfs refuses the same lower directory
//!   twice. At most [`MAX_LAYERS`] layers (the kernel's overlay stack limit).
//! - **Config**: the last source's (entrypoint, cmd, workdir, user): the top image says how to
//!   run the result. **Env** is merged: every source's variables in order, a later source's
//!   value replacing an earlier one of the same name (the first position is kept), so a
//!   toolchain image's `JAVA_HOME` survives under an app image's `PATH`.
//! - Layers expanded for opaque directories at import carry whiteouts for what was below them
//!   *in their own image*; names a composed lower image adds below them stay visible.
//!
//! Sources are `repo[:tag]`, found in the composing project or the nearest ancestor that has
//! it (as a sandbox's image is), or `project//repo:tag` for one exact place.

use std::collections::HashMap;

use crate::store::{ImageConfig, ImageRef, LayerId, Manifest, Store, StoreError};

/// Most layers one image may stack (overlayfs' `OVL_MAX_STACK`).
pub const MAX_LAYERS: usize = 500;

/// Most sources of one composition.
pub const MAX_SOURCES: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum ComposeError {
    #[error("a composition needs at least one source image")]
    NoSources,
    #[error("a composition takes at most {MAX_SOURCES} source images, got {0}")]
    TooManySources(usize),
    #[error("the composed image would stack {count} layers, at most {max}")]
    TooManyLayers { count: usize, max: usize },
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Where a source image is looked for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    /// `repo[:tag]`: the composing project, then its ancestors.
    Search(String),
    /// `project//repo:tag`.
    Exact(ImageRef),
}

impl Source {
    pub fn parse(s: &str) -> Result<Source, StoreError> {
        match s.split_once("//") {
            Some((project, name)) => Ok(Source::Exact(ImageRef::parse(project, name)?)),
            None => Ok(Source::Search(s.to_string())),
        }
    }

    /// Finds the source's manifest, searching from `project` upward for `Search`.
    pub fn resolve(&self, store: &Store, project: &str) -> Result<(ImageRef, Manifest), StoreError> {
        match self {
            Source::Search(name) => store.resolve(project, name),
            Source::Exact(r) => Ok((r.clone(), store.read_manifest(r)?)),
        }
    }
}

/// Merges env lists (`KEY=VALUE`) in order: a later value replaces an earlier one of the same
/// key, in the earlier one's place. An entry without `=` is a key with no value.
pub fn merge_env<'a>(lists: impl IntoIterator<Item = &'a [String]>) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut at: HashMap<String, usize> = HashMap::new();
    for list in lists {
        for kv in list {
            let key = kv.split_once('=').map_or(kv.as_str(), |(k, _)| k).to_string();
            match at.get(&key) {
                Some(&i) => out[i] = kv.clone(),
                None => {
                    at.insert(key, out.len());
                    out.push(kv.clone());
                }
            }
        }
    }
    out
}

/// Concatenates the layer lists, keeping each layer only at its top-most place.
pub fn concat_layers<'a>(lists: impl IntoIterator<Item = &'a [LayerId]>) -> Vec<LayerId> {
    let all: Vec<&LayerId> = lists.into_iter().flatten().collect();
    let mut last: HashMap<&LayerId, usize> = HashMap::new();
    for (i, l) in all.iter().enumerate() {
        last.insert(l, i);
    }
    all.iter().enumerate().filter(|(i, l)| last.get(*l) == Some(i)).map(|(_, l)| (*l).clone()).collect()
}

/// The manifest of `target` composed from `sources` (bottom first). Pure: reads and writes
/// nothing.
pub fn compose(
    target: &ImageRef,
    sources: &[(ImageRef, Manifest)],
    created_at_ms: i64,
) -> Result<Manifest, ComposeError> {
    let Some((_, top)) = sources.last() else { return Err(ComposeError::NoSources) };
    if sources.len() > MAX_SOURCES {
        return Err(ComposeError::TooManySources(sources.len()));
    }
    let layers = concat_layers(sources.iter().map(|(_, m)| m.layers.as_slice()));
    if layers.len() > MAX_LAYERS {
        return Err(ComposeError::TooManyLayers { count: layers.len(), max: MAX_LAYERS });
    }
    let config =
        ImageConfig { env: merge_env(sources.iter().map(|(_, m)| m.config.env.as_slice())), ..top.config.clone() };
    let source = format!("compose:{}", sources.iter().map(|(r, _)| r.to_string()).collect::<Vec<_>>().join("+"));
    Ok(Manifest {
        v: 1,
        project: target.project.clone(),
        repo: target.repo.clone(),
        tag: target.tag.clone(),
        layers,
        config,
        created_at_ms,
        source,
        vm_snapshot: String::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::LayerMeta;

    fn id(n: u8) -> LayerId {
        LayerId::from_digest(&[n; 32])
    }

    fn manifest(project: &str, repo: &str, layers: &[u8], env: &[&str], cmd: &[&str]) -> (ImageRef, Manifest) {
        let r = ImageRef::new(project, repo, "latest").unwrap();
        let m = Manifest {
            v: 1,
            project: project.into(),
            repo: repo.into(),
            tag: "latest".into(),
            layers: layers.iter().map(|n| id(*n)).collect(),
            config: ImageConfig {
                env: env.iter().map(|s| s.to_string()).collect(),
                cmd: cmd.iter().map(|s| s.to_string()).collect(),
                workdir: format!("/{repo}"),
                ..Default::default()
            },
            created_at_ms: 1,
            source: String::new(),
            vm_snapshot: String::new(),
        };
        (r, m)
    }

    #[test]
    fn layers_concatenate_in_order_and_the_top_image_says_how_to_run() {
        let base = manifest("root", "base", &[1, 2], &["PATH=/bin", "LANG=C"], &["sh"]);
        let tools = manifest("root/a", "tools", &[1, 3], &["JAVA_HOME=/jdk", "PATH=/jdk/bin:/bin"], &["java"]);
        let app = manifest("root/a", "app", &[4], &["MODE=prod"], &["run"]);
        let target = ImageRef::new("root/a", "combo", "v1").unwrap();
        let m = compose(&target, &[base, tools, app], 42).unwrap();
        // Layer 1 appears twice: kept only at its higher place.
        assert_eq!(m.layers, vec![id(2), id(1), id(3), id(4)]);
        assert_eq!(m.config.env, ["PATH=/jdk/bin:/bin", "LANG=C", "JAVA_HOME=/jdk", "MODE=prod"]);
        assert_eq!(m.config.cmd, ["run"]);
        assert_eq!(m.config.workdir, "/app");
        assert_eq!(
            (m.project.as_str(), m.repo.as_str(), m.tag.as_str(), m.created_at_ms),
            ("root/a", "combo", "v1", 42)
        );
        assert_eq!(m.source, "compose:root//base:latest+root/a//tools:latest+root/a//app:latest");
    }

    #[test]
    fn bounds() {
        let target = ImageRef::new("root", "x", "latest").unwrap();
        assert!(matches!(compose(&target, &[], 1), Err(ComposeError::NoSources)));
        let big: Vec<u8> = (0..=255).collect();
        let a = manifest("root", "a", &big, &[], &[]);
        let mut b = manifest("root", "b", &[], &[], &[]);
        b.1.layers = (0..=255u8)
            .map(|n| {
                // Never all one byte: no collision with `id`.
                let mut d = [0xbb; 32];
                d[0] = n;
                d[1] = 0xaa;
                LayerId::from_digest(&d)
            })
            .collect();
        assert!(matches!(compose(&target, &[a, b], 1), Err(ComposeError::TooManyLayers { count: 512, .. })));
    }

    #[test]
    fn sources_resolve_upward_or_exactly() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path()).unwrap();
        let p = store.begin_layer().unwrap();
        let meta = LayerMeta {
            v: 1,
            id: id(1),
            size_bytes: 0,
            entries: 0,
            created_at_ms: 1,
            source: String::new(),
            diff_id: String::new(),
            lowers: vec![],
        };
        store.commit_layer(p, &meta).unwrap();
        store.write_manifest(&manifest("root", "base", &[1], &[], &[]).1).unwrap();
        assert_eq!(Source::parse("base").unwrap().resolve(&store, "root/a/b").unwrap().0.project, "root");
        let exact = Source::parse("root//base:latest").unwrap();
        assert_eq!(exact, Source::Exact(ImageRef::new("root", "base", "latest").unwrap()));
        assert!(exact.resolve(&store, "root/zzz").is_ok());
        assert!(matches!(
            Source::parse("root/a//base").unwrap().resolve(&store, "root"),
            Err(StoreError::ImageNotFound(_))
        ));
        assert!(Source::parse("nope//base").is_err());
    }
}
