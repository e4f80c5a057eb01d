//! Creations that name a warm pool (`spec.pool`): the pool is read from IAM (which checks the
//! caller may create sandboxes in its project before saying anything about it), the spec is
//! filled from its template, and the creation is placed preferring an edge that reported
//! idle members of the pool's current revision. The edge hands out a member only of that
//! revision; without one it creates the sandbox cold from the same spec (a miss).

use opendsec_common::ApiError;
use opendsec_proto::v1 as pb;

use crate::admission::AdmissionError;
use crate::auth::Identity;
use crate::state::Shared;

/// A spec naming a pool, with the pool's template filled in, and the template's revision.
#[derive(Clone, Debug)]
pub struct PoolSpec {
    pub spec: pb::SandboxSpec,
    pub revision: String,
}

/// Reads the pool `spec.pool` names (in the spec's project, the caller's when empty) and fills
/// the spec from it; `None` when the spec names no pool.
pub async fn resolve(
    s: &Shared,
    ident: &Identity,
    spec: Option<&pb::SandboxSpec>,
) -> Result<Option<PoolSpec>, ApiError> {
    let Some(spec) = spec.filter(|sp| !sp.pool.is_empty()) else { return Ok(None) };
    let project = if spec.project.is_empty() { ident.project.clone() } else { spec.project.clone() };
    opendsec_common::ids::validate_project(&project).map_err(|e| e.with("field", "spec.project"))?;
    let req = pb::ResolvePoolRequest {
        principal: ident.principal.clone(),
        project: project.clone(),
        name: spec.pool.clone(),
    };
    let pool =
        s.up.iam(|mut c| {
            let r = req.clone();
            async move { c.resolve_pool(r).await }
        })
        .await?;
    let mut filled = fill(spec, &pool)?;
    filled.project = project;
    Ok(Some(PoolSpec { spec: filled, revision: pool.revision }))
}

/// `spec` with what `pool`'s template fixes: image, backend, resources, network, user and
/// workdir (a spec that sets one of them otherwise is refused, not silently overridden); the
/// template's env under the spec's; everything else the spec's own. Mount changes cannot be
/// made to a member already running, so masked and read-only paths are refused.
pub fn fill(spec: &pb::SandboxSpec, pool: &pb::Pool) -> Result<pb::SandboxSpec, AdmissionError> {
    let t = pool.template.clone().unwrap_or_default();
    let fixed = |field: &'static str, given: &str, want: &str| -> Result<(), AdmissionError> {
        if given.is_empty() || given == want {
            Ok(())
        } else {
            Err(AdmissionError::Invalid {
                field,
                message: format!("pool {} fixes it to {want:?}; leave it empty", pool.name),
            })
        }
    };
    fixed("spec.image", &spec.image, &t.image)?;
    fixed("spec.backend", &spec.backend, &t.backend)?;
    fixed("spec.user", &spec.user, &t.user)?;
    fixed("spec.workdir", &spec.workdir, &t.workdir)?;
    let want_res = t.resources.unwrap_or_default();
    if let Some(r) = spec.resources.filter(|r| *r != pb::Resources::default())
        && r != want_res
    {
        return Err(AdmissionError::Invalid {
            field: "spec.resources",
            message: format!(
                "pool {} fixes them to {} millicores, {} MiB of memory, {} MiB of disk; leave them empty",
                pool.name, want_res.cpu_millis, want_res.memory_mb, want_res.disk_mb
            ),
        });
    }
    let rules: Vec<pb::EgressRule> =
        t.egress.iter().filter_map(|r| opendsec_common::egress::Rule::parse(r).ok()).map(|r| r.to_pb()).collect();
    if let Some(n) = &spec.network {
        let text = |rs: &[pb::EgressRule]| -> Result<Vec<String>, AdmissionError> {
            let mut v: Vec<String> = opendsec_common::egress::from_pb_list(rs)
                .map_err(|e| AdmissionError::Invalid { field: "spec.network", message: e.to_string() })?
                .iter()
                .map(|r| r.to_string())
                .collect();
            v.sort();
            v.dedup();
            Ok(v)
        };
        if text(&n.egress)? != text(&rules)? {
            return Err(AdmissionError::Invalid {
                field: "spec.network",
                message: format!("pool {} fixes the egress rules; leave the network empty", pool.name),
            });
        }
    }
    for (field, paths) in [("spec.masked_paths", &spec.masked_paths), ("spec.readonly_paths", &spec.readonly_paths)] {
        if !paths.is_empty() {
            return Err(AdmissionError::Invalid {
                field,
                message: format!("members of pool {} are already running: their mounts cannot change", pool.name),
            });
        }
    }
    let mut out = spec.clone();
    out.image = t.image;
    out.backend = t.backend;
    out.resources = Some(want_res);
    out.user = t.user;
    out.workdir = t.workdir;
    out.network = Some(pb::NetworkSpec { egress: rules });
    let mut env = t.env;
    env.extend(spec.env.clone());
    out.env = env;
    Ok(out)
}

/// The healthy edge that reported the most idle members of `project/name` at `revision`.
pub fn edge_with_members(
    s: &Shared,
    project: &str,
    name: &str,
    revision: &str,
    skip: &std::collections::HashSet<String>,
) -> Option<String> {
    let snap = s.snapshot();
    snap.edges
        .iter()
        .filter(|e| e.healthy && !e.draining && !skip.contains(&e.name))
        .filter_map(|e| {
            let idle = e
                .pools
                .iter()
                .find(|p| p.project == project && p.name == name && p.revision == revision)
                .map_or(0, |p| p.idle);
            (idle > 0).then(|| (idle, e.name.clone()))
        })
        .max()
        .map(|(_, n)| n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool() -> pb::Pool {
        pb::Pool {
            name: "py".into(),
            template: Some(pb::PoolTemplate {
                image: "python:3.12".into(),
                backend: "fncall".into(),
                resources: Some(pb::Resources { cpu_millis: 1000, memory_mb: 512, disk_mb: 1024, gpus: 0 }),
                env: [("A".to_string(), "1".to_string()), ("B".to_string(), "1".to_string())].into(),
                egress: vec!["pypi.org".into()],
                user: "user".into(),
                workdir: "/work".into(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn the_template_fills_the_spec_and_the_spec_adds_env_labels_and_ttls() {
        let spec = pb::SandboxSpec {
            pool: "py".into(),
            env: [("B".to_string(), "2".to_string())].into(),
            labels: [("k".to_string(), "v".to_string())].into(),
            ttl_max_s: 60,
            ..Default::default()
        };
        let s = fill(&spec, &pool()).unwrap();
        assert_eq!((s.image.as_str(), s.backend.as_str(), s.user.as_str()), ("python:3.12", "fncall", "user"));
        assert_eq!(s.resources.unwrap().memory_mb, 512);
        assert_eq!(s.env["A"], "1");
        assert_eq!(s.env["B"], "2");
        assert_eq!(s.labels["k"], "v");
        assert_eq!(s.ttl_max_s, 60);
        assert_eq!(s.network.unwrap().egress.len(), 1);
        // Restating what the template says is fine.
        let same = pb::SandboxSpec { image: "python:3.12".into(), backend: "fncall".into(), ..spec.clone() };
        assert!(fill(&same, &pool()).is_ok());
    }

    #[test]
    fn a_spec_contradicting_the_template_is_refused_with_the_field() {
        let base = pb::SandboxSpec { pool: "py".into(), ..Default::default() };
        let cases = [
            (pb::SandboxSpec { image: "other".into(), ..base.clone() }, "spec.image"),
            (pb::SandboxSpec { backend: "container".into(), ..base.clone() }, "spec.backend"),
            (pb::SandboxSpec { user: "root".into(), ..base.clone() }, "spec.user"),
            (pb::SandboxSpec { workdir: "/".into(), ..base.clone() }, "spec.workdir"),
            (
                pb::SandboxSpec {
                    resources: Some(pb::Resources { cpu_millis: 2000, memory_mb: 512, disk_mb: 1024, gpus: 0 }),
                    ..base.clone()
                },
                "spec.resources",
            ),
            (
                pb::SandboxSpec {
                    network: Some(pb::NetworkSpec {
                        egress: vec![pb::EgressRule { target: "*".into(), ..Default::default() }],
                    }),
                    ..base.clone()
                },
                "spec.network",
            ),
            (pb::SandboxSpec { masked_paths: vec!["/x".into()], ..base.clone() }, "spec.masked_paths"),
        ];
        for (spec, field) in cases {
            let e = fill(&spec, &pool()).unwrap_err();
            assert_eq!(e.field(), field, "{e}");
        }
    }
}
