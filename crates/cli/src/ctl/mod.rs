//! `opendsecctl`: the public API on the command line, plus `cluster up`, `bench` and the image
//! store tools (`image import|gc|store-check|merge`); commands inside a sandbox (`exec`, `run`,
//! `cp`, `ps`, `kill`) are in [`crate::runtime`].
//!
//! Exit codes: 0 success; 1 a local failure (file, config); 2 usage; 10.. one per error
//! reason (docs/errors.md, `Reason::exit_code`). `exec` and `run` exit with the remote
//! command's own code once the call succeeded.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use opendsec_client::Client;
use opendsec_common::config::Config;
use opendsec_common::{ApiError, Reason};
use opendsec_proto::v1 as pb;
use serde_json::{Value, json};

use crate::json as j;
use crate::table::Table;

mod args;
mod cluster;
mod sandbox;

pub use crate::error::*;
pub use crate::output::*;
pub use crate::support::{DEFAULT_CPU_MILLIS, DEFAULT_DISK_MB, DEFAULT_MEMORY_MB, kv, wait_for_signal};
pub use args::*;
use cluster::cluster_up;
use sandbox::{network, sandbox};

/// Runs one parsed command line; `Ok` holds the exit code (the remote command's for `exec` and
/// `run`, else 0).
pub async fn run(cli: Cli) -> Result<i32, CtlError> {
    let out = Out { json: cli.json };
    if let Command::Cluster(ClusterCmd::Up {
        config,
        state_dir,
        sim_edges,
        iam_replicas,
        insecure_plaintext,
        keep_sandboxes,
    }) = &cli.command
    {
        let (config, state_dir) = (config.clone(), state_dir.clone());
        return cluster_up(config, state_dir, *sim_edges, *iam_replicas, *insecure_plaintext, *keep_sandboxes)
            .await
            .map(|()| 0);
    }
    if let Command::Pki(cmd) = cli.command {
        return crate::pki::run(&out, cmd).map(|()| 0);
    }
    if let Command::Release(cmd) = cli.command {
        return crate::release::run(&out, cmd).map(|()| 0);
    }
    let addrs: Vec<String> = cli.addr.split(',').map(str::to_string).collect();
    let tls =
        opendsec_common::grpc::PublicTls::choose(cli.ca.as_deref(), cli.insecure_plaintext, cli.tls_name.as_deref())?;
    let client = Client::new(&addrs, cli.token.as_deref(), &tls)?;
    let project = cli.project.clone();
    match cli.command {
        Command::Exec(a) => crate::runtime::exec(&client, &out, a).await,
        Command::Run(a) => crate::runtime::run(&client, &out, a).await,
        Command::Cp(a) => crate::runtime::cp(&client, &out, a).await.map(|()| 0),
        Command::Ps { sandbox } => crate::runtime::ps(&client, &out, sandbox).await.map(|()| 0),
        Command::Kill(a) => crate::runtime::kill(&client, &out, a).await.map(|()| 0),
        other => api(&client, &out, project, other).await.map(|()| 0),
    }
}

/// The commands that map one-to-one onto public calls.
async fn api(client: &Client, out: &Out, project: Option<String>, command: Command) -> Result<(), CtlError> {
    match command {
        Command::Cluster(_)
        | Command::Pki(_)
        | Command::Release(_)
        | Command::Exec(_)
        | Command::Run(_)
        | Command::Cp(_)
        | Command::Ps { .. }
        | Command::Kill(_) => {
            unreachable!("handled in run")
        }
        Command::Sandbox(cmd) => sandbox(client, out, project.as_deref(), cmd).await,
        Command::Network(cmd) => network(client, out, cmd).await,
        Command::Pool(cmd) => {
            let project = project.unwrap_or_default();
            let line = |p: &pb::Pool| {
                let image = p.template.as_ref().map(|t| t.image.clone()).unwrap_or_default();
                let mut s = format!(
                    "pool {} in {}: {image}, {} per edge, revision {}",
                    p.name,
                    p.project,
                    p.size_per_edge,
                    &p.revision[..p.revision.len().min(12)]
                );
                // What the edges keep of it, as of the apiserver's cluster snapshot.
                for e in &p.edges {
                    s.push_str(&format!(
                        "\n  {}: {} idle, {} starting, {} stale; {} claims, {} misses; refill p50 {} ms",
                        e.edge, e.idle, e.starting, e.stale, e.claims, e.misses, e.refill_p50_ms
                    ));
                }
                s
            };
            match cmd {
                PoolCmd::Create(a) => {
                    let p = client.create_pool(pb::CreatePoolRequest { pool: Some(a.to_pb(Some(&project))?) }).await?;
                    out.print(j::of(&p), || format!("created {}", line(&p)));
                }
                PoolCmd::Update(a) => {
                    let p = client.update_pool(pb::UpdatePoolRequest { pool: Some(a.to_pb(Some(&project))?) }).await?;
                    out.print(j::of(&p), || format!("updated {}", line(&p)));
                }
                PoolCmd::Get { name } => {
                    let p = client.get_pool(pb::GetPoolRequest { project, name }).await?;
                    out.print(j::of(&p), || line(&p));
                }
                PoolCmd::List => {
                    let r = client.list_pools(pb::ListPoolsRequest { project }).await?;
                    out.print(Value::Array(r.pools.iter().map(j::of).collect()), || {
                        if r.pools.is_empty() {
                            "no pools".to_string()
                        } else {
                            r.pools.iter().map(line).collect::<Vec<_>>().join("\n")
                        }
                    });
                }
                PoolCmd::Delete { name } => {
                    client.delete_pool(pb::DeletePoolRequest { project, name: name.clone() }).await?;
                    out.print(json!({"deleted": name}), || format!("deleted pool {name}"));
                }
            }
            Ok(())
        }
        Command::Project(cmd) => match cmd {
            ProjectCmd::Create { path, quota } => {
                let p = client.create_project(pb::CreateProjectRequest { path, quota: Some(quota.to_pb()) }).await?;
                out.print(j::of(&p), || format!("created {}", p.path));
                Ok(())
            }
            ProjectCmd::Get { path } => {
                let p = client.get_project(pb::GetProjectRequest { path }).await?;
                out.print(j::of(&p), || project_text(&p));
                Ok(())
            }
            ProjectCmd::List { path } => {
                let path = path.or(project).unwrap_or_else(|| "root".into());
                let r = client.list_projects(pb::ListProjectsRequest { path }).await?;
                out.print(Value::Array(r.projects.iter().map(j::of).collect()), || {
                    usage_table(&r.projects).render("no projects")
                });
                Ok(())
            }
            ProjectCmd::Ceiling { path, allow, clear } => {
                let ceiling =
                    (!clear).then(|| egress_rules(&allow)).transpose()?.map(|allow| pb::EgressCeiling { allow });
                let p = client.set_egress_ceiling(pb::SetEgressCeilingRequest { path, ceiling }).await?;
                out.print(j::of(&p), || project_text(&p));
                Ok(())
            }
            ProjectCmd::Delete { path } => {
                client.delete_project(pb::DeleteProjectRequest { path: path.clone() }).await?;
                out.print(json!({"deleted": path}), || format!("deleted {path}"));
                Ok(())
            }
        },
        Command::Quota(cmd) => match cmd {
            QuotaCmd::Set { path, quota } => {
                let p = client.set_quota(pb::SetQuotaRequest { path, quota: Some(quota.to_pb()) }).await?;
                out.print(j::of(&p), || project_text(&p));
                Ok(())
            }
            QuotaCmd::Get { path } => {
                let p = client.get_project(pb::GetProjectRequest { path }).await?;
                out.print(json!({"path": p.path, "quota": j::of(&p.quota), "effective": j::of(&p.effective)}), || {
                    project_text(&p)
                });
                Ok(())
            }
        },
        Command::Principal(cmd) => match cmd {
            PrincipalCmd::Create { name } => {
                let project =
                    project.ok_or_else(|| CtlError::Api(ApiError::invalid("principal create needs --project")))?;
                let p = client.create_principal(pb::CreatePrincipalRequest { name, project }).await?;
                out.print(j::of(&p), || format!("created principal {} in {}", p.name, p.project));
                Ok(())
            }
            PrincipalCmd::List => {
                let project = project.unwrap_or_else(|| "root".into());
                let r = client.list_principals(pb::ListPrincipalsRequest { project }).await?;
                out.print(Value::Array(r.principals.iter().map(j::of).collect()), || {
                    let mut t = Table::new(&["NAME", "PROJECT"]);
                    for p in &r.principals {
                        t.row(vec![p.name.clone(), p.project.clone()]);
                    }
                    t.render("no principals")
                });
                Ok(())
            }
            PrincipalCmd::Delete { name } => {
                client.delete_principal(pb::DeletePrincipalRequest { name: name.clone() }).await?;
                out.print(json!({"deleted": name}), || format!("deleted principal {name}"));
                Ok(())
            }
        },
        Command::Token(cmd) => match cmd {
            TokenCmd::Create { principal, ttl, description, e2b } => {
                let r = client
                    .create_token(pb::CreateTokenRequest {
                        principal: principal.unwrap_or_default(),
                        ttl_s: ttl,
                        description,
                    })
                    .await?;
                let info = r.info.clone().unwrap_or_default();
                let token = if e2b { opendsec_common::config::e2b_key(&r.token) } else { r.token.clone() };
                out.print(json!({"token": token, "info": j::of(&info)}), || token.clone());
                Ok(())
            }
            TokenCmd::List { principal } => {
                let r = client.list_tokens(pb::ListTokensRequest { principal: principal.unwrap_or_default() }).await?;
                out.print(Value::Array(r.tokens.iter().map(j::of).collect()), || {
                    let now = now_ms();
                    let mut tb = Table::new(&["ID", "PRINCIPAL", "STATUS", "DESCRIPTION"]);
                    for t in &r.tokens {
                        let status = match (t.revoked, t.expires_at_ms) {
                            (true, _) => "revoked".to_string(),
                            (false, 0) => "valid, no expiry".to_string(),
                            (false, e) if e <= now => "expired".to_string(),
                            (false, e) => format!("expires in {}", span(now, e)),
                        };
                        tb.row(vec![t.id.clone(), t.principal.clone(), status, t.description.clone()]);
                    }
                    tb.render("no tokens")
                });
                Ok(())
            }
            TokenCmd::Revoke { id } => {
                client.revoke_token(pb::RevokeTokenRequest { id: id.clone() }).await?;
                out.print(json!({"revoked": id}), || format!("revoked {id}"));
                Ok(())
            }
        },
        Command::Grant(cmd) => match cmd {
            GrantCmd::Add { principal, project, permission } => {
                let g = pb::Grant { principal, project, permission };
                client.grant(pb::GrantRequest { grant: Some(g.clone()) }).await?;
                out.print(j::of(&g), || format!("granted {} on {} to {}", g.permission, g.project, g.principal));
                Ok(())
            }
            GrantCmd::Remove { principal, project, permission } => {
                let g = pb::Grant { principal, project, permission };
                client.revoke_grant(pb::RevokeGrantRequest { grant: Some(g.clone()) }).await?;
                out.print(j::of(&g), || format!("revoked {} on {} from {}", g.permission, g.project, g.principal));
                Ok(())
            }
            GrantCmd::List { principal, on_project } => {
                let r = client
                    .list_grants(pb::ListGrantsRequest {
                        principal: principal.unwrap_or_default(),
                        project: on_project.unwrap_or_default(),
                    })
                    .await?;
                out.print(Value::Array(r.grants.iter().map(j::of).collect()), || {
                    let mut t = Table::new(&["PRINCIPAL", "PROJECT", "PERMISSION"]);
                    for g in &r.grants {
                        t.row(vec![g.principal.clone(), g.project.clone(), g.permission.clone()]);
                    }
                    t.render("no grants")
                });
                Ok(())
            }
        },
        Command::Usage { project: p } => {
            let path = p.or(project).unwrap_or_else(|| "root".into());
            let r = client.get_usage(pb::GetUsageRequest { project: path }).await?;
            out.print(Value::Array(r.projects.iter().map(j::of).collect()), || {
                usage_table(&r.projects).render("no projects")
            });
            Ok(())
        }
        Command::Snapshot { id, name, pack_diff } => {
            let s = client.create_snapshot(&id, &name, pack_diff).await?;
            let image = s.image.as_ref().map(|i| format!("{}:{}", i.repo, i.tag)).unwrap_or_default();
            out.print(j::of(&s), || {
                format!(
                    "{image}: layer {} ({} bytes, {} entries; frozen {} ms)",
                    s.layer, s.layer_bytes, s.layer_entries, s.frozen_ms
                )
            });
            Ok(())
        }
        Command::Fork { id, count, snapshot_name, pack_diff } => {
            let stream = client.fork_sandbox(pb::ForkSandboxRequest { id, count, snapshot_name, pack_diff }).await?;
            sandbox::print_batch(out, stream, count, "copies").await
        }
        Command::SaveSession { id } => {
            let saved = client.save_session(&id).await?;
            out.print(j::of(&saved), || format!("session {} saved ({} bytes)", saved.name, saved.bytes));
            Ok(())
        }
        Command::Edge(EdgeCmd::Drain { name, move_to, no_wait, undrain, timeout }) => {
            drain(client, out, &name, move_to.as_deref(), no_wait, undrain, timeout).await
        }
        Command::Move { id, to } => {
            let sb = client.move_sandbox(&id, &to).await?;
            out.print(j::of(&sb), || format!("{} runs on {} now", sb.id, sb.edge));
            Ok(())
        }
        Command::Whoami => {
            let r = client.who_am_i(pb::WhoAmIRequest {}).await?;
            out.print(j::of(&r), || format!("{} ({})", r.principal, r.project));
            Ok(())
        }
        Command::Backup { file } => {
            let r = client.backup(pb::BackupRequest {}).await?;
            write_file_atomic(&file, &r.data)?;
            out.print(json!({"file": file, "bytes": r.data.len()}), || {
                format!("wrote {} bytes to {}", r.data.len(), file.display())
            });
            Ok(())
        }
        Command::Restore { file } => {
            let data =
                std::fs::read(&file).map_err(|e| CtlError::Local(format!("failed to read {}: {e}", file.display())))?;
            client.restore(pb::RestoreRequest { data }).await?;
            out.print(json!({"restored": file}), || format!("restored from {}", file.display()));
            Ok(())
        }
        Command::Iam(cmd) => {
            let r = match cmd {
                IamCmd::Members => client.iam_members(pb::IamMembersRequest {}).await?,
                IamCmd::Add { id, address, learner } => {
                    client.add_iam_member(pb::AddIamMemberRequest { id, address, learner_only: learner }).await?
                }
                IamCmd::Remove { id } => client.remove_iam_member(pb::RemoveIamMemberRequest { id }).await?,
                IamCmd::TransferLeader { to } => {
                    client.transfer_iam_leader(pb::TransferIamLeaderRequest { to }).await?
                }
            };
            out.print(j::of(&r), || {
                let mut t = if r.replicated {
                    format!("term {}, committed index {}\n", r.term, r.committed_index)
                } else {
                    "standalone (one member, no log to replicate)\n".to_string()
                };
                for m in &r.members {
                    t.push_str(&format!(
                        "{:>3}  {:<22} {:<8} {:<7} {:<10} {}\n",
                        m.id,
                        m.address,
                        if m.voter { "voter" } else { "learner" },
                        if m.leader { "leader" } else { "" },
                        m.matched_index,
                        if m.data_dir.is_empty() { "-" } else { &m.data_dir }
                    ));
                }
                t.trim_end().to_string()
            });
            Ok(())
        }
        Command::Image(cmd) => crate::image::run(client, out, project.as_deref(), cmd).await,
        Command::Bench(BenchCmd::Create(args)) => {
            let report = crate::bench::create(client, project.as_deref(), &args).await?;
            out.print(report.to_json(), || report.to_text());
            Ok(())
        }
        Command::Bench(BenchCmd::Exec(args)) => {
            let phase = crate::bench::exec(client, &args).await?;
            out.print(phase.json(), || phase.exec_text());
            Ok(())
        }
    }
}

fn write_file_atomic(path: &std::path::Path, data: &[u8]) -> Result<(), CtlError> {
    let err = |e: std::io::Error| CtlError::Local(format!("failed to write {}: {e}", path.display()));
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, data).map_err(err)?;
    std::fs::rename(&tmp, path).map_err(err)
}

/// `edge drain`: the mark, then (unless told not to) the moves and the wait for the edge to
/// empty.
async fn drain(
    client: &Client,
    out: &Out,
    name: &str,
    move_to: Option<&str>,
    no_wait: bool,
    undrain: bool,
    timeout: std::time::Duration,
) -> Result<(), CtlError> {
    if move_to == Some(name) {
        return Err(CtlError::Local(format!("--move-to {name}: the edge being drained takes nothing")));
    }
    let r = client.drain_edge(name, undrain).await?;
    if undrain || no_wait {
        out.print(j::of(&r), || {
            let what = if r.draining { "draining" } else { "taking sandboxes" };
            format!("edge {} is {what} ({} sandboxes on it)", r.edge, r.sandboxes)
        });
        return Ok(());
    }
    let deadline = std::time::Instant::now() + timeout;
    let mut moved: Vec<String> = Vec::new();
    // Sandboxes a move refused for good (a backend that cannot move): left to end.
    let mut staying = std::collections::HashSet::new();
    loop {
        // Every sandbox in the cluster (needs sandbox.view on root), those on this edge kept.
        let all = client
            .list_all_sandboxes(pb::ListSandboxesRequest { project: "root".into(), ..Default::default() })
            .await?;
        let here: Vec<pb::Sandbox> = all.into_iter().filter(|sb| sb.edge == name).collect();
        if let Some(to) = move_to {
            for sb in &here {
                if std::time::Instant::now() >= deadline {
                    break;
                }
                let settled = matches!(
                    pb::SandboxState::try_from(sb.state),
                    Ok(pb::SandboxState::Running | pb::SandboxState::Paused)
                );
                // One still being created (or stopping) is looked at again next round.
                if !settled || staying.contains(&sb.id) {
                    continue;
                }
                match client.move_sandbox(&sb.id, to).await {
                    Ok(m) if m.edge != name => moved.push(m.id),
                    Ok(_) => {}
                    Err(e)
                        if matches!(
                            e.reason,
                            Reason::InvalidArgument | Reason::PermissionDenied | Reason::NotFound
                        ) =>
                    {
                        eprintln!("{} stays on {name} until it ends: {}: {}", sb.id, e.reason, e.message);
                        staying.insert(sb.id.clone());
                    }
                    // Passing (the target is busy, the sandbox is mid-call): tried again.
                    Err(e) => eprintln!("{}: not moved yet: {}: {}", sb.id, e.reason, e.message),
                }
            }
        }
        let st = client.edge_drain_status(name).await?;
        if here.is_empty() && st.sandboxes == 0 {
            out.print(serde_json::json!({"edge": name, "draining": st.draining, "moved": moved}), || {
                format!(
                    "edge {name} is drained: nothing runs on it ({} moved to {})",
                    moved.len(),
                    move_to.unwrap_or("-")
                )
            });
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            let ids: Vec<&str> = here.iter().map(|s| s.id.as_str()).take(20).collect();
            return Err(CtlError::Local(format!(
                "edge {name} still has {} sandboxes after {} (it stays draining): {}",
                st.sandboxes.max(here.len() as u32),
                humantime::format_duration(timeout),
                ids.join(", ")
            )));
        }
        tokio::time::sleep(std::time::Duration::from_secs(1)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use opendsec_common::Reason;

    #[test]
    fn errors_say_what_to_do_next() {
        let cx = HintContext { addr: "127.0.0.1:7000".into(), has_token: false };
        let h = |e: ApiError| hint(&CtlError::Api(e), &cx).unwrap_or_default();
        assert!(h(ApiError::new(Reason::Unavailable, "tcp connect error")).contains("make up"));
        // A running cluster that cannot serve this now is not told to start one.
        let busy = h(ApiError::new(Reason::Unavailable, "a creation with lease id x is in progress"));
        assert!(!busy.contains("make up") && busy.contains("retry"), "{busy}");
        assert!(h(ApiError::new(Reason::Unauthenticated, "no token")).contains("admin.token"));
        let with_token = HintContext { has_token: true, ..cx };
        let e = CtlError::Api(ApiError::new(Reason::Unauthenticated, "unknown token"));
        assert!(hint(&e, &with_token).unwrap_or_default().contains("token create"));
        let cx = HintContext { addr: String::new(), has_token: true };
        let h = |e: ApiError| hint(&CtlError::Api(e), &cx).unwrap_or_default();
        assert!(
            h(ApiError::new(Reason::NotFound, "no edge offers backend").with("backend", "microvm")).contains("microvm")
        );
        assert!(h(ApiError::new(Reason::NotFound, "image x").with("image", "x")).contains("image import"));
        assert!(h(ApiError::new(Reason::QuotaExceeded, "over")).contains("quota set"));
        assert_eq!(hint(&CtlError::Local("disk".into()), &cx), None);
    }

    #[test]
    fn only_cluster_up_serves() {
        let p = |a: &[&str]| <Cli as clap::Parser>::try_parse_from(a).unwrap();
        assert!(p(&["opendsecctl", "cluster", "up"]).serves());
        assert!(!p(&["opendsecctl", "sandbox", "list"]).serves());
    }
}
