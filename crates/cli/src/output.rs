//! Output: JSON (`--json`) or text (tables, one-line summaries, the batch progress bar).

use std::collections::HashMap;

use opendsec_proto::v1 as pb;
use serde_json::Value;

use crate::json as j;
use crate::table::{Table, age};

#[derive(Debug)]
pub struct Out {
    pub json: bool,
}

impl Out {
    pub fn print(&self, value: Value, text: impl FnOnce() -> String) {
        if self.json {
            println!("{}", serde_json::to_string_pretty(&value).unwrap_or_default());
        } else {
            println!("{}", text());
        }
    }
}

pub(crate) fn now_ms() -> i64 {
    opendsec_common::time::now_ms() as i64
}

/// Seconds from `from_ms` to `to_ms` for people (`-` when either is unset).
pub(crate) fn span(from_ms: i64, to_ms: i64) -> String {
    if from_ms <= 0 || to_ms <= 0 {
        return "-".into();
    }
    age((to_ms - from_ms).max(0) as u64 / 1000)
}

pub(crate) fn labels_text(l: &HashMap<String, String>) -> String {
    let mut v: Vec<String> = l.iter().map(|(k, v)| format!("{k}={v}")).collect();
    v.sort();
    v.join(",")
}

pub(crate) fn sandbox_table(items: &[pb::Sandbox]) -> Table {
    let now = now_ms();
    let mut t = Table::new(&["ID", "STATE", "BACKEND", "IMAGE", "PROJECT", "AGE", "EXPIRES IN", "LABELS"]);
    for s in items {
        let spec = s.spec.clone().unwrap_or_default();
        let mut state = j::state_name(s.state).to_ascii_lowercase();
        if !s.end_reason.is_empty() {
            state = format!("{state} ({})", s.end_reason);
        }
        let expires =
            if s.expires_at_ms > 0 && s.expires_at_ms > now { span(now, s.expires_at_ms) } else { "-".into() };
        t.row(vec![
            s.id.clone(),
            state,
            spec.backend,
            spec.image,
            spec.project,
            span(s.created_at_ms, now),
            expires,
            labels_text(&spec.labels),
        ]);
    }
    t
}

pub(crate) fn sandbox_text(s: &pb::Sandbox) -> String {
    let spec = s.spec.clone().unwrap_or_default();
    let r = spec.resources.unwrap_or_default();
    let now = now_ms();
    let mut lines = vec![
        format!("id:          {}", s.id),
        format!("state:       {}", j::state_name(s.state).to_ascii_lowercase()),
        format!("backend:     {}", spec.backend),
        format!("image:       {}", spec.image),
        format!("project:     {}", spec.project),
        format!(
            "resources:   {} millicores, {} MiB memory, {} MiB disk{}",
            r.cpu_millis,
            r.memory_mb,
            r.disk_mb,
            if r.gpus > 0 { format!(", {} GPUs", r.gpus) } else { String::new() }
        ),
        format!("created:     {} ago by {}", span(s.created_at_ms, now), s.principal),
        format!("last active: {} ago", span(s.last_active_ms, now)),
    ];
    if s.expires_at_ms > now {
        lines.push(format!("expires in:  {} (unless active)", span(now, s.expires_at_ms)));
    }
    if !spec.labels.is_empty() {
        lines.push(format!("labels:      {}", labels_text(&spec.labels)));
    }
    if !s.end_reason.is_empty() {
        lines.push(format!("ended:       {}", s.end_reason));
    }
    lines.join("\n")
}

pub(crate) fn sandbox_line(s: &pb::Sandbox) -> String {
    let spec = s.spec.clone().unwrap_or_default();
    let end = if s.end_reason.is_empty() { String::new() } else { format!("  ({})", s.end_reason) };
    format!("{}  {:<8}  {}  {}  {}{end}", s.id, j::state_name(s.state), spec.backend, spec.project, spec.image)
}

/// Projects with `used/limit` per quota key (`-`: no limit on the chain).
pub(crate) fn usage_table(projects: &[pb::Project]) -> Table {
    let mut t = Table::new(&[
        "PROJECT",
        "SANDBOXES",
        "CPU (millicores)",
        "MEMORY (MiB)",
        "DISK (MiB)",
        "GPUS",
        "STORE (bytes)",
    ]);
    for p in projects {
        let q = p.effective.unwrap_or_default();
        let u = p.usage.unwrap_or_default();
        let c = |used: u64, lim: Option<u64>| {
            format!("{used}/{}", lim.map(|v| v.to_string()).unwrap_or_else(|| "-".into()))
        };
        t.row(vec![
            p.path.clone(),
            c(u.sandboxes, q.sandboxes),
            c(u.cpu_millis, q.cpu_millis),
            c(u.memory_mb, q.memory_mb),
            c(u.disk_mb, q.disk_mb),
            c(u.gpus, q.gpus),
            c(u.store_bytes, q.store_bytes),
        ]);
    }
    t
}

pub(crate) fn project_text(p: &pb::Project) -> String {
    let q = p.effective.unwrap_or_default();
    let u = p.usage.unwrap_or_default();
    let lim = |v: Option<u64>| v.map(|v| v.to_string()).unwrap_or_else(|| "-".into());
    let ceiling = match &p.egress_ceiling {
        None => String::new(),
        Some(c) if c.allow.is_empty() => "\n  egress ceiling: none allowed".into(),
        Some(c) => format!(
            "\n  egress ceiling: {}",
            c.allow.iter().map(opendsec_common::egress::pb_text).collect::<Vec<_>>().join(", ")
        ),
    };
    let text = format!(
        "{}\n  cpu_millis  {} / {}\n  memory_mb   {} / {}\n  disk_mb     {} / {}\n  gpus        {} / {}\n  sandboxes   {} / {}\n  store_bytes {} / {}",
        p.path,
        u.cpu_millis,
        lim(q.cpu_millis),
        u.memory_mb,
        lim(q.memory_mb),
        u.disk_mb,
        lim(q.disk_mb),
        u.gpus,
        lim(q.gpus),
        u.sandboxes,
        lim(q.sandboxes),
        u.store_bytes,
        lim(q.store_bytes)
    );
    text + &ceiling
}

/// The progress bar of a batch creation: on stderr when it is a terminal and the output is
/// text; hidden (every call a no-op) otherwise.
pub(crate) fn batch_bar(count: u32, json: bool) -> indicatif::ProgressBar {
    use std::io::IsTerminal;
    if json || !std::io::stderr().is_terminal() {
        return indicatif::ProgressBar::hidden();
    }
    let style = indicatif::ProgressStyle::with_template("creating [{bar:30}] {pos}/{len} {elapsed} {msg}")
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> ");
    let bar = indicatif::ProgressBar::with_draw_target(Some(count as u64), indicatif::ProgressDrawTarget::stderr());
    bar.set_style(style);
    bar.enable_steady_tick(std::time::Duration::from_millis(200));
    bar
}
