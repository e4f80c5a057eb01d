//! `opendsecctl sandbox ...`: create (one or a batch), list, get, pause, resume, set-timeout, stop.

use super::*;

pub(crate) async fn sandbox(
    client: &Client,
    out: &Out,
    project: Option<&str>,
    cmd: SandboxCmd,
) -> Result<(), CtlError> {
    match cmd {
        SandboxCmd::Create { spec, count } => {
            let spec = spec.to_spec(project)?;
            if count <= 1 {
                let s = client.create_sandbox(spec).await?;
                out.print(j::of(&s), || s.id.clone());
                return Ok(());
            }
            let stream = client.create_sandboxes(spec, count).await?;
            print_batch(out, stream, count, "creations").await
        }
        SandboxCmd::List { states, labels, page_size, page_token, all } => {
            let mut st = Vec::new();
            for s in &states {
                let v = j::parse_state(s)
                    .ok_or_else(|| CtlError::Api(ApiError::invalid(format!("unknown state {s:?}"))))?;
                st.push(v as i32);
            }
            let req = pb::ListSandboxesRequest {
                project: project.unwrap_or_default().to_string(),
                states: st,
                labels: kv(&labels, "label")?,
                page_size,
                page_token,
            };
            let (items, next) = if all {
                (client.list_all_sandboxes(req).await?, String::new())
            } else {
                let r = client.list_sandboxes(req).await?;
                (r.sandboxes, r.next_page_token)
            };
            out.print(
                json!({"sandboxes": items.iter().map(j::of).collect::<Vec<_>>(), "next_page_token": next}),
                || {
                    let mut s = sandbox_table(&items).render("no sandboxes");
                    if !next.is_empty() {
                        s.push_str(&format!("\n(more: --page-token {next})"));
                    }
                    s
                },
            );
            Ok(())
        }
        SandboxCmd::Get { id } => {
            let s = client.get_sandbox(&id).await?;
            out.print(j::of(&s), || sandbox_text(&s));
            Ok(())
        }
        SandboxCmd::Stop { id } => {
            let s = client.stop_sandbox(&id).await?;
            out.print(j::of(&s), || sandbox_line(&s));
            Ok(())
        }
        SandboxCmd::Pause { id } => {
            let s = client.pause_sandbox(&id).await?;
            out.print(j::of(&s), || sandbox_line(&s));
            Ok(())
        }
        SandboxCmd::Resume { id } => {
            let s = client.resume_sandbox(&id).await?;
            out.print(j::of(&s), || sandbox_line(&s));
            Ok(())
        }
        SandboxCmd::SetTimeout { id, idle, max, paused } => {
            let s = client
                .set_sandbox_timeout(pb::SetSandboxTimeoutRequest {
                    id,
                    ttl_running_stop_s: idle,
                    ttl_max_s: max,
                    ttl_paused_s: paused,
                })
                .await?;
            out.print(j::of(&s), || sandbox_line(&s));
            Ok(())
        }
    }
}

/// `opendsecctl network set|get`.
pub(crate) async fn network(client: &Client, out: &Out, cmd: NetworkCmd) -> Result<(), CtlError> {
    let s = match cmd {
        NetworkCmd::Set { id, allow } => client.update_network(&id, egress_rules(&allow)?).await?,
        NetworkCmd::Get { id } => client.get_sandbox(&id).await?,
    };
    let rules: Vec<String> = s
        .spec
        .as_ref()
        .and_then(|sp| sp.network.as_ref())
        .map(|n| n.egress.iter().map(opendsec_common::egress::pb_text).collect())
        .unwrap_or_default();
    let shown = json!({"id": s.id, "address": s.address, "egress": rules});
    out.print(shown, || {
        let mut lines = vec![format!("{}  address {}", s.id, if s.address.is_empty() { "-" } else { &s.address })];
        if rules.is_empty() {
            lines.push("  no egress".into());
        }
        lines.extend(rules.iter().map(|r| format!("  allow {r}")));
        lines.join("\n")
    });
    Ok(())
}

/// Prints a stream of batch results: ids to stdout as they come (JSON: one array at the end),
/// failures to stderr, a progress bar on a terminal; fails if any item failed.
pub(crate) async fn print_batch(
    out: &Out,
    mut stream: tonic::Streaming<pb::CreateSandboxesResponse>,
    count: u32,
    what: &str,
) -> Result<(), CtlError> {
    let mut results = Vec::new();
    let mut failed = 0u32;
    // Ids go to stdout as they come (for scripts); the bar to stderr, on a terminal only.
    let bar = batch_bar(count, out.json);
    while let Some(item) = stream.message().await.map_err(|s| CtlError::Api(ApiError::from_status(&s)))? {
        match (&item.sandbox, &item.error) {
            (Some(s), _) => {
                if !out.json {
                    bar.suspend(|| println!("{}", s.id));
                }
                results.push(json!({"index": item.index, "sandbox": j::of(s)}));
            }
            (None, Some(e)) => {
                failed += 1;
                if !out.json {
                    bar.suspend(|| eprintln!("#{}: {}: {}", item.index, e.reason, e.message));
                }
                results.push(json!({"index": item.index, "error": {"reason": e.reason, "message": e.message}}));
            }
            (None, None) => {}
        }
        bar.inc(1);
        if failed > 0 {
            bar.set_message(format!("{failed} failed"));
        }
    }
    bar.finish_and_clear();
    if out.json {
        println!("{}", serde_json::to_string_pretty(&Value::Array(results)).unwrap_or_default());
    }
    if failed > 0 {
        return Err(CtlError::Local(format!("{failed} of {count} {what} failed")));
    }
    Ok(())
}
