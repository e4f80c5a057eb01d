//! Issue 14's VM benchmarks (`make bench-vm`, in release, as root; `cargo bench -p opendsec-cli
//! --bench vm`). Prints figures, asserts nothing about time. Through the public API of an
//! in-process cluster (real gRPC between apiserver, edge and the agent in the guest), busybox
//! VMs with the resources a user gets by default (1 vCPU, 1 GiB of memory) and a 1 GiB disk
//! (every VM's disk is reserved on the host whole: the containers' default of 10 GiB would
//! reserve 90 GiB for a fork of eight). Under whatever accelerator the edge finds: TCG on our
//! development and CI machines (software emulation: seconds, not milliseconds).
//!
//! - create → agent answering, p50/p99, microvm and fullvm, beside QEMU booting the same
//!   kernel by hand on the same machine type to a busybox shell in an initramfs (the peer);
//! - pause and resume p50 (microvm: snapshot and exit, restore in a new VMM; fullvm: stop/cont);
//! - a microvm's memory snapshot: its size in the store and its time;
//! - fork ×8 of a microvm until every copy answers;
//! - host memory of a running VM (its VMM's proportional set size, and what its cgroup is
//!   charged) and of a paused microvm (no VMM: what its cgroup is still charged).

#[path = "../tests/it/common/mod.rs"]
mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use opendsec_proto::v1 as pb;

const RUNS: usize = 8;

fn spec(backend: &str) -> pb::SandboxSpec {
    use opendsec_cli::ctl::{DEFAULT_CPU_MILLIS, DEFAULT_MEMORY_MB};
    pb::SandboxSpec {
        backend: backend.into(),
        resources: Some(pb::Resources {
            cpu_millis: DEFAULT_CPU_MILLIS,
            memory_mb: DEFAULT_MEMORY_MB,
            disk_mb: 1024,
            gpus: 0,
        }),
        ..container_spec("busybox", DEFAULT_MEMORY_MB, 1024)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// p50 and p99 (nearest rank) of `v`.
fn p50_p99(v: &mut [Duration]) -> (f64, f64) {
    v.sort();
    let rank = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    (ms(rank(0.5)), ms(rank(0.99)))
}

/// The peer: an initramfs whose /init is a busybox shell that says it runs and powers off.
fn peer_initramfs(dir: &Path) -> PathBuf {
    let root = dir.join("peer-root");
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    std::fs::write(
        root.join("init"),
        "#!/bin/busybox sh\n/bin/busybox echo OPENDSEC-PEER-READY\n/bin/busybox poweroff -f\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(root.join("init"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = dir.join("peer.cpio");
    let st = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("cd {} && find . | cpio -o -H newc 2>/dev/null > {}", root.display(), out.display()))
        .status()
        .unwrap();
    assert!(st.success());
    out
}

/// QEMU by hand: the same kernel, machine and memory, to the peer's shell.
/// `accel`: the accelerator the edge's probe chose (`kvm` or `tcg`), so both sides run alike.
fn peer_boot(kernel: &Path, initramfs: &Path, machine: &str, accel: &str) -> Duration {
    use std::io::BufRead;
    let m = match machine {
        "microvm" => "microvm,x-option-roms=off,pit=off,pic=off",
        _ => "q35",
    };
    let mut append = "console=ttyS0 quiet panic=-1 cryptomgr.notests mitigations=off rdinit=/init".to_string();
    if machine == "microvm"
        && let Some(k) = opendsec_edge::backend::vm::host_tsc_khz()
    {
        append.push_str(&format!(" tsc_early_khz={k}"));
    }
    let t = Instant::now();
    let mut child = std::process::Command::new("qemu-system-x86_64")
        .args(["-accel", if accel == "kvm" { "kvm" } else { "tcg,tb-size=64" }])
        .args(["-cpu", if accel == "kvm" { "host" } else { "max" }, "-smp", "1", "-m", "1024M", "-M", m])
        .args(["-nodefaults", "-no-user-config", "-nographic", "-no-reboot", "-serial", "stdio", "-kernel"])
        .arg(kernel.join("vmlinux"))
        .arg("-initrd")
        .arg(initramfs)
        .args(["-append", &append])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    for l in lines.map_while(Result::ok) {
        if l.contains("OPENDSEC-PEER-READY") {
            break;
        }
    }
    let took = t.elapsed();
    let _ = child.kill();
    let _ = child.wait();
    took
}

/// The name of sandbox `id`'s VM (its directory and cgroup).
fn vm_name(f: &Fixture, backend: &str, id: &str) -> String {
    use opendsec_edge::backend::vm::{Machine, name_of};
    let m = if backend == "microvm" { Machine::Microvm } else { Machine::Q35 };
    name_of(m, &f.cluster.config.edge_state_dir(EDGE).join("vms"), id)
}

/// The VM directory of sandbox `id`.
fn vm_dir(f: &Fixture, backend: &str, id: &str) -> PathBuf {
    f.cluster.config.edge_state_dir(EDGE).join("vms").join(vm_name(f, backend, id))
}

/// The proportional set size of the VMM of `dir` (0 without one), in MiB.
fn vmm_pss_mb(dir: &Path) -> f64 {
    let Ok(pid) = std::fs::read_to_string(dir.join("pid")) else { return 0.0 };
    let rollup = std::fs::read_to_string(format!("/proc/{}/smaps_rollup", pid.trim())).unwrap_or_default();
    let cmdline = std::fs::read(format!("/proc/{}/cmdline", pid.trim())).unwrap_or_default();
    if !String::from_utf8_lossy(&cmdline).contains(dir.to_str().unwrap()) {
        return 0.0;
    }
    let kb: f64 = rollup
        .lines()
        .find_map(|l| l.strip_prefix("Pss:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0.0);
    kb / 1024.0
}

/// What the cgroup of VM `name` is charged (v1 memory controller), in MiB.
fn cgroup_mb(name: &str) -> f64 {
    let cg = opendsec_edge::linuxrt::cgroup::SandboxCgroup::open(name).unwrap();
    let d = cg.memory_dir();
    let v = std::fs::read_to_string(d.join("memory.usage_in_bytes"))
        .or_else(|_| std::fs::read_to_string(d.join("memory.current")))
        .unwrap_or_default();
    v.trim().parse::<f64>().unwrap_or(0.0) / (1 << 20) as f64
}

async fn bench() {
    let f = fixture_with(|c| {
        room_for_thousands(c);
        c.edge.backends.extend(["microvm".to_string(), "fullvm".to_string()]);
        c.edge.vm.kernel_dir = Some(vm_kernel());
        c.edge.vm.accel = "auto".into();
    })
    .await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    let tmp = tempfile::tempdir().unwrap();
    let peer = peer_initramfs(tmp.path());
    let kernel = vm_kernel();
    // What the edge's probe chose when it started (its answer is kept in its state).
    let accel = std::fs::read_dir(f.cluster.config.edge_state_dir(EDGE).join("vms/.boot"))
        .into_iter()
        .flatten()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("kvm-probe-"))
        .and_then(|e| std::fs::read_to_string(e.path()).ok())
        .map(|a| a.trim().to_string())
        .unwrap_or_else(|| "tcg".into());

    for backend in ["microvm", "fullvm"] {
        let mut ours = Vec::new();
        let mut theirs = Vec::new();
        let mut kept = None;
        for i in 0..RUNS {
            let t = Instant::now();
            let sb = admin.create_sandbox(spec(backend)).await.unwrap();
            let r = exec_in(&mut rt, &sb.id, "main", "true").await;
            assert_eq!(r.exit_code, 0);
            ours.push(t.elapsed());
            if i == 0 {
                kept = Some(sb);
            } else {
                admin.stop_sandbox(&sb.id).await.unwrap();
            }
            theirs.push(peer_boot(&kernel, &peer, backend, &accel));
        }
        let (p50, p99) = p50_p99(&mut ours);
        let (q50, q99) = p50_p99(&mut theirs);
        println!(
            "{backend}: create -> agent answering p50 {p50:.0} ms, p99 {p99:.0} ms (n={RUNS}); \
             peer, QEMU by hand to a busybox shell: p50 {q50:.0} ms, p99 {q99:.0} ms"
        );

        let sb = kept.unwrap();
        let dir = vm_dir(&f, backend, &sb.id);
        let name = vm_name(&f, backend, &sb.id);
        println!(
            "{backend}: host memory of a running VM: VMM {:.0} MiB proportional set size, cgroup charged {:.0} MiB",
            vmm_pss_mb(&dir),
            cgroup_mb(&name)
        );
        let (mut pauses, mut resumes) = (Vec::new(), Vec::new());
        for _ in 0..RUNS {
            let t = Instant::now();
            admin.pause_sandbox(&sb.id).await.unwrap();
            pauses.push(t.elapsed());
            let t = Instant::now();
            admin.resume_sandbox(&sb.id).await.unwrap();
            exec_in(&mut rt, &sb.id, "main", "true").await;
            resumes.push(t.elapsed());
        }
        admin.pause_sandbox(&sb.id).await.unwrap();
        println!(
            "{backend}: pause p50 {:.0} ms, resume to the agent answering p50 {:.0} ms (n={RUNS}); paused: VMM {:.0} MiB, cgroup charged {:.0} MiB",
            p50_p99(&mut pauses).0,
            p50_p99(&mut resumes).0,
            vmm_pss_mb(&dir),
            cgroup_mb(&name)
        );
        admin.resume_sandbox(&sb.id).await.unwrap();
        if backend == "fullvm" {
            admin.stop_sandbox(&sb.id).await.unwrap();
            continue;
        }

        // A memory snapshot and a fork of eight.
        exec_in(&mut rt, &sb.id, "main", "(while :; do sleep 1; done) >/dev/null 2>&1 &").await;
        let t = Instant::now();
        let snap = admin.create_snapshot(&sb.id, "bench:vm", false).await.unwrap();
        println!(
            "microvm: memory snapshot {:.0} ms (vCPUs stopped {} ms), {:.1} MiB in the store (state, memory and disk, zero pages left out)",
            ms(t.elapsed()),
            snap.frozen_ms,
            snap.vm_snapshot_bytes as f64 / (1 << 20) as f64
        );
        let t = Instant::now();
        let mut stream = admin
            .fork_sandbox(pb::ForkSandboxRequest { id: sb.id.clone(), count: 8, ..Default::default() })
            .await
            .unwrap();
        let mut tasks = tokio::task::JoinSet::new();
        while let Some(item) = stream.message().await.unwrap() {
            let c = item.sandbox.unwrap_or_else(|| panic!("a copy failed: {:?}", item.error));
            let mut rt = rt.clone();
            tasks.spawn(async move {
                let r = exec_in(&mut rt, &c.id, "main", "true").await;
                assert_eq!(r.exit_code, 0);
                (c.id, t.elapsed())
            });
        }
        let mut done = Vec::new();
        while let Some(r) = tasks.join_next().await {
            done.push(r.unwrap());
        }
        let first = done.iter().map(|(_, d)| *d).min().unwrap();
        println!(
            "microvm: fork x8 (snapshot, then eight restores): every copy answering after {:.0} ms, the first after {:.0} ms",
            ms(t.elapsed()),
            ms(first)
        );
        let copy = &done[0].0;
        println!(
            "microvm: host memory of a restored copy: VMM {:.0} MiB proportional set size, cgroup charged {:.0} MiB",
            vmm_pss_mb(&vm_dir(&f, "microvm", copy)),
            cgroup_mb(&vm_name(&f, "microvm", copy))
        );
        for (id, _) in done {
            admin.stop_sandbox(&id).await.unwrap();
        }
        admin.stop_sandbox(&sb.id).await.unwrap();
    }
    println!(
        "accelerator: {}; published anchors, not measured here: Firecracker boots in ~125 ms with <= 5 MiB per VM on KVM; \
         the reference resumes from a snapshot in ~50 ms",
        accel
    );
}

fn main() {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime");
    println!("== bench_vms");
    rt.block_on(bench());
}
