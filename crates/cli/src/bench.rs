//! `opendsecctl bench create`: creates `count` sandboxes through the public API as fast as the
//! cluster takes them (batched with `--batch`, else one call each, `--concurrency` calls at a
//! time), then stops them all, and prints figures. It never passes or fails on time.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use clap::Args;
use futures::StreamExt;
use opendsec_client::Client;
use opendsec_common::ApiError;
use opendsec_proto::v1 as pb;
use serde_json::{Value, json};

use crate::error::CtlError;

#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    #[arg(long)]
    pub count: u32,
    /// Sandboxes per CreateSandboxes call; 1 (the default) creates one by one.
    #[arg(long, default_value_t = 1)]
    pub batch: u32,
    /// Calls in flight at once.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    #[arg(long, default_value = "sim")]
    pub backend: String,
    #[arg(long, default_value = "scratch")]
    pub image: String,
    /// CPU in millicores (default: 10 on `sim`, else what `sandbox create` gives).
    #[arg(long)]
    pub cpu: Option<u32>,
    /// Memory in MiB (default: 16 on `sim`, else what `sandbox create` gives).
    #[arg(long)]
    pub memory: Option<u64>,
    /// Disk in MiB (default: 0 on `sim`, else what `sandbox create` gives).
    #[arg(long)]
    pub disk: Option<u64>,
    /// Leave the sandboxes running (no stop phase).
    #[arg(long)]
    pub keep: bool,
    /// Claim members of this warm pool (its template gives image, backend and resources).
    #[arg(long, conflicts_with_all = ["backend", "image", "cpu", "memory", "disk"])]
    pub pool: Option<String>,
}

#[derive(Debug, Default)]
pub struct Phase {
    pub ok: u64,
    pub failed: u64,
    pub errors: BTreeMap<String, u64>,
    pub seconds: f64,
    /// Per call (a whole batch call in batched mode).
    pub latencies_ms: Vec<f64>,
}

impl Phase {
    fn rate(&self) -> f64 {
        if self.seconds > 0.0 { self.ok as f64 / self.seconds } else { 0.0 }
    }

    fn percentile(&self, p: f64) -> f64 {
        if self.latencies_ms.is_empty() {
            return 0.0;
        }
        let mut v = self.latencies_ms.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
        v[i.min(v.len() - 1)]
    }

    fn fail(&mut self, e: &ApiError) {
        self.failed += 1;
        *self.errors.entry(e.reason.to_string()).or_default() += 1;
    }

    pub fn json(&self) -> Value {
        json!({
            "ok": self.ok,
            "failed": self.failed,
            "errors": self.errors,
            "seconds": round(self.seconds, 3),
            "per_second": round(self.rate(), 1),
            "latency_ms": {
                "p50": round(self.percentile(50.0), 3),
                "p90": round(self.percentile(90.0), 3),
                "p99": round(self.percentile(99.0), 3),
                "max": round(self.percentile(100.0), 3),
            },
        })
    }
}

fn round(v: f64, digits: i32) -> f64 {
    let m = 10f64.powi(digits);
    (v * m).round() / m
}

#[derive(Debug)]
pub struct Report {
    pub args: BenchArgs,
    pub create: Phase,
    pub stop: Option<Phase>,
}

impl Report {
    pub fn to_json(&self) -> Value {
        json!({
            "mode": if self.args.batch > 1 { "batched" } else { "single" },
            "count": self.args.count,
            "batch": self.args.batch,
            "concurrency": self.args.concurrency,
            "create": self.create.json(),
            "stop": self.stop.as_ref().map(Phase::json),
        })
    }

    pub fn to_text(&self) -> String {
        let c = &self.create;
        let mut s = format!(
            "created {} ({} failed) in {:.3}s: {:.0} creations/s; per call p50 {:.2} ms, p99 {:.2} ms",
            c.ok,
            c.failed,
            c.seconds,
            c.rate(),
            c.percentile(50.0),
            c.percentile(99.0)
        );
        if !c.errors.is_empty() {
            s.push_str(&format!("\n  errors: {:?}", c.errors));
        }
        if let Some(st) = &self.stop {
            s.push_str(&format!(
                "\nstopped {} ({} failed) in {:.3}s: {:.0} stops/s; p50 {:.2} ms, p99 {:.2} ms",
                st.ok,
                st.failed,
                st.seconds,
                st.rate(),
                st.percentile(50.0),
                st.percentile(99.0)
            ));
        }
        s
    }
}

/// The resources of every sandbox of the run: tiny on `sim` (it runs nothing, and a cluster
/// of sim edges should hold tens of thousands), else `sandbox create`'s defaults, so that a
/// container's agent does not start under a 1 % CPU quota.
pub fn resources(args: &BenchArgs) -> pb::Resources {
    let (cpu, memory, disk) = if args.backend == "sim" {
        (10, 16, 0)
    } else {
        (crate::support::DEFAULT_CPU_MILLIS, crate::support::DEFAULT_MEMORY_MB, crate::support::DEFAULT_DISK_MB)
    };
    pb::Resources {
        cpu_millis: args.cpu.unwrap_or(cpu),
        memory_mb: args.memory.unwrap_or(memory),
        disk_mb: args.disk.unwrap_or(disk),
        gpus: 0,
    }
}

pub async fn create(client: &Client, project: Option<&str>, args: &BenchArgs) -> Result<Report, CtlError> {
    if args.count == 0 || args.batch == 0 || args.concurrency == 0 {
        return Err(CtlError::Api(ApiError::invalid("--count, --batch and --concurrency must be at least 1")));
    }
    // One call first: a cluster that cannot be reached (or a TLS setting that does not match
    // it) is one error after the retry budget, not one per sandbox.
    client.who_am_i(pb::WhoAmIRequest {}).await?;
    let run = opendsec_common::ids::new_lease_id();
    let labels = [("bench".to_string(), run)].into_iter().collect();
    let spec = match &args.pool {
        Some(pool) => pb::SandboxSpec {
            project: project.unwrap_or_default().to_string(),
            pool: pool.clone(),
            labels,
            ..Default::default()
        },
        None => pb::SandboxSpec {
            project: project.unwrap_or_default().to_string(),
            image: args.image.clone(),
            backend: args.backend.clone(),
            resources: Some(resources(args)),
            labels,
            ..Default::default()
        },
    };
    let mut phase = Phase::default();
    let mut ids = Vec::with_capacity(args.count as usize);
    let started = Instant::now();
    if args.batch > 1 {
        let mut sizes = Vec::new();
        let mut left = args.count;
        while left > 0 {
            let n = left.min(args.batch);
            sizes.push(n);
            left -= n;
        }
        let mut calls = futures::stream::iter(sizes.into_iter().map(|n| {
            let spec = spec.clone();
            async move {
                let t = Instant::now();
                let mut got = Vec::new();
                match client.create_sandboxes(spec, n).await {
                    Ok(mut stream) => loop {
                        match stream.message().await {
                            Ok(Some(item)) => got.push(match (item.sandbox, item.error) {
                                (Some(s), _) => Ok(s.id),
                                (None, Some(e)) => Err(ApiError::from_detail(&e)),
                                (None, None) => Err(ApiError::internal("empty batch item")),
                            }),
                            Ok(None) => break,
                            Err(s) => {
                                got.push(Err(ApiError::from_status(&s)));
                                break;
                            }
                        }
                    },
                    Err(e) => got.push(Err(e)),
                }
                (t.elapsed(), got)
            }
        }))
        .buffer_unordered(args.concurrency);
        while let Some((took, got)) = calls.next().await {
            phase.latencies_ms.push(took.as_secs_f64() * 1e3);
            for r in got {
                match r {
                    Ok(id) => {
                        phase.ok += 1;
                        ids.push(id);
                    }
                    Err(e) => phase.fail(&e),
                }
            }
        }
    } else {
        let mut calls = futures::stream::iter((0..args.count).map(|_| {
            let spec = spec.clone();
            async move {
                let t = Instant::now();
                let r = client.create_sandbox(spec).await;
                (t.elapsed(), r)
            }
        }))
        .buffer_unordered(args.concurrency);
        while let Some((took, r)) = calls.next().await {
            phase.latencies_ms.push(took.as_secs_f64() * 1e3);
            match r {
                Ok(s) => {
                    phase.ok += 1;
                    ids.push(s.id);
                }
                Err(e) => phase.fail(&e),
            }
        }
    }
    phase.seconds = started.elapsed().as_secs_f64();
    let stop = if args.keep { None } else { Some(stop_all(client, &ids, args.concurrency.max(64)).await) };
    Ok(Report { args: args.clone(), create: phase, stop })
}

async fn stop_all(client: &Client, ids: &[String], concurrency: usize) -> Phase {
    let mut phase = Phase::default();
    let started = Instant::now();
    let mut calls = futures::stream::iter(ids.iter().map(|id| async move {
        let t = Instant::now();
        let r = client.stop_sandbox(id).await;
        (t.elapsed(), r)
    }))
    .buffer_unordered(concurrency);
    while let Some((took, r)) = calls.next().await {
        phase.latencies_ms.push(took.as_secs_f64() * 1e3);
        match r {
            Ok(_) => phase.ok += 1,
            Err(e) => phase.fail(&e),
        }
    }
    phase.seconds = started.elapsed().as_secs_f64().max(Duration::from_micros(1).as_secs_f64());
    phase
}

/// `opendsecctl bench exec`: shell round trips in one session of an existing sandbox.
#[derive(Args, Debug, Clone)]
pub struct ExecBenchArgs {
    /// The sandbox (container backend: it has an agent).
    #[arg(long)]
    pub sandbox: String,
    #[arg(long, default_value_t = 1000)]
    pub count: u32,
    /// Calls in flight at once (each in its own session when more than one).
    #[arg(long, default_value_t = 1)]
    pub concurrency: u32,
    /// The shell text each call runs.
    #[arg(long, default_value = "true")]
    pub command: String,
}

/// Runs `count` Exec calls (`concurrency` sessions in parallel, one warm-up call each first, not
/// counted) and reports their latency; a failed call or a non-zero exit counts as failed.
pub async fn exec(client: &Client, args: &ExecBenchArgs) -> Result<Phase, CtlError> {
    if args.count == 0 || args.concurrency == 0 {
        return Err(CtlError::Api(ApiError::invalid("--count and --concurrency must be at least 1")));
    }
    let req = |session: u32| pb::ExecRequest {
        sandbox_id: args.sandbox.clone(),
        session_id: format!("bench-{session}"),
        command: args.command.clone(),
        timeout_ms: 60_000,
        ..Default::default()
    };
    let sessions = args.concurrency.min(args.count);
    for s in 0..sessions {
        client.exec(req(s)).await?;
    }
    let per = args.count.div_ceil(sessions);
    let start = Instant::now();
    let results: Vec<Vec<Result<f64, String>>> = futures::stream::iter(0..sessions)
        .map(|s| {
            let n = per.min(args.count.saturating_sub(s * per));
            let req = req(s);
            async move {
                let mut out = Vec::new();
                for _ in 0..n {
                    let t = Instant::now();
                    let r = client.exec(req.clone()).await;
                    out.push(match r {
                        Ok(x) if x.exit_code == 0 => Ok(t.elapsed().as_secs_f64() * 1e3),
                        Ok(_) => Err("nonzero_exit".to_string()),
                        Err(e) => Err(e.reason.to_string()),
                    });
                }
                out
            }
        })
        .buffer_unordered(sessions as usize)
        .collect()
        .await;
    let mut phase = Phase { seconds: start.elapsed().as_secs_f64(), ..Phase::default() };
    for r in results.into_iter().flatten() {
        match r {
            Ok(ms) => {
                phase.ok += 1;
                phase.latencies_ms.push(ms);
            }
            Err(kind) => {
                phase.failed += 1;
                *phase.errors.entry(kind).or_default() += 1;
            }
        }
    }
    // The sessions' shells would otherwise stay in the sandbox.
    for s in 0..sessions {
        let _ = client
            .close_session(pb::CloseSessionRequest {
                sandbox_id: args.sandbox.clone(),
                session_id: format!("bench-{s}"),
            })
            .await;
    }
    Ok(phase)
}

impl Phase {
    /// The figures of an exec benchmark, for people.
    pub fn exec_text(&self) -> String {
        let mut s = format!(
            "exec: {} calls ({} failed) in {:.3}s: {:.0} calls/s; p50 {:.3} ms, p90 {:.3} ms, p99 {:.3} ms",
            self.ok,
            self.failed,
            self.seconds,
            self.rate(),
            self.percentile(50.0),
            self.percentile(90.0),
            self.percentile(99.0)
        );
        if !self.errors.is_empty() {
            s.push_str(&format!("\n  errors: {:?}", self.errors));
        }
        s
    }
}
