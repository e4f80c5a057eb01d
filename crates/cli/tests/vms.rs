//! VM sandboxes through the public API, as root, under TCG: a microvm created by
//! `CreateSandbox` with `backend = microvm`, its shell sessions, files, pause and resume, and
//! its stop releasing the lease; a fullvm likewise, more briefly. What a VM cannot do yet is
//! refused clearly (a snapshot: containers only).

mod common;

use std::time::Duration;

use common::*;
use opendsec_common::Reason;
use opendsec_proto::v1 as pb;

fn vm_kernel() -> std::path::PathBuf {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/vm-kernel.sh");
    let out = std::process::Command::new(script).arg("--path").output().unwrap();
    let dir = std::path::PathBuf::from(String::from_utf8(out.stdout).unwrap().trim());
    assert!(dir.join("complete").exists(), "no guest kernel in {}: run `make vm-kernel`", dir.display());
    dir
}

fn vm_spec(backend: &str) -> pb::SandboxSpec {
    pb::SandboxSpec { backend: backend.into(), ..container_spec("busybox", 192, 64) }
}

async fn live_usage(admin: &opendsec_client::Client) -> u64 {
    let usage = admin.get_usage(pb::GetUsageRequest { project: "root".into() }).await.unwrap();
    usage.projects.iter().find(|p| p.path == "root").and_then(|p| p.usage).map(|u| u.sandboxes).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vm_sandboxes_run_sessions_files_and_pause() {
    let f = fixture_edges(1, |c| {
        c.edge.backends.extend(["microvm".to_string(), "fullvm".to_string()]);
        c.edge.vm.kernel_dir = Some(vm_kernel());
        c.edge.vm.accel = "tcg".into();
    })
    .await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();

    let started = std::time::Instant::now();
    let sb = admin.create_sandbox(vm_spec("microvm")).await.unwrap();
    eprintln!("microvm through the API: {} ms to running (TCG)", started.elapsed().as_millis());
    assert_eq!(state(&sb), pb::SandboxState::Running);
    let r = exec_in(&mut rt, &sb.id, "main", "cd /tmp && X=kept; uname -r; cat /run/opendsec/sandbox-id").await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let text = out(&r);
    assert!(text.lines().next().unwrap().ends_with("-amd64"), "{text}");
    assert_eq!(text.lines().nth(1), Some(sb.id.as_str()));

    // Files through the API, both ways.
    let first = pb::WriteFileRequest {
        sandbox_id: sb.id.clone(),
        path: "/data/up.bin".into(),
        make_parents: true,
        finish: true,
        ..Default::default()
    };
    let data: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    admin.write_file_all(first, &data).await.unwrap();
    assert_eq!(read_all(&mut rt, &sb.id, "/data/up.bin").await.unwrap(), data);

    // Pause and resume: the session (its directory, its variable) is still there.
    let p = admin.pause_sandbox(&sb.id).await.unwrap();
    assert_eq!(state(&p), pb::SandboxState::Paused);
    admin.resume_sandbox(&sb.id).await.unwrap();
    let r = exec_in(&mut rt, &sb.id, "main", "echo $(pwd) $X").await;
    assert_eq!(out(&r), "/tmp kept");

    // Not yet for VMs: a snapshot.
    let e = admin.create_snapshot(&sb.id, "vm:snap", false).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument, "{e}");

    // A full VM too.
    let full = admin.create_sandbox(vm_spec("fullvm")).await.unwrap();
    assert_eq!(out(&exec_in(&mut rt, &full.id, "main", "echo full").await), "full");
    assert_eq!(live_usage(&admin).await, 2);

    for id in [&sb.id, &full.id] {
        let s = admin.stop_sandbox(id).await.unwrap();
        assert_eq!(state(&s), pb::SandboxState::Stopped);
    }
    opendsec_testkit::eventually("the leases released", Duration::from_secs(10), || async {
        live_usage(&admin).await == 0
    })
    .await;
    let vms = f.cluster.config.edge_state_dir(EDGE).join("vms");
    let left: Vec<_> = std::fs::read_dir(&vms)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().to_string())
        .filter(|n| !n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
