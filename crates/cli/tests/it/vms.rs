//! VM sandboxes through the public API, as root, under TCG: a microvm created by
//! `CreateSandbox` with `backend = microvm`, its shell sessions, files, pause and resume, and
//! its stop releasing the lease, and a fork of it carrying its memory; a fullvm likewise, more
//! briefly (its snapshots are refused: a full VM has none).

use std::time::Duration;

use crate::common::*;
use opendsec_common::Reason;
use opendsec_proto::v1 as pb;

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
        // Room for a GPU, but none to pass through (edge.vm.gpu_devices is empty).
        c.edge.capacity.gpus = 1;
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

    // Its metrics: CPU and memory as its VMM's cgroup counts them, its disk's size.
    let m = admin.get_sandbox_metrics(&sb.id).await.unwrap();
    assert!(m.memory_used_bytes > 64 << 20 && m.memory_limit_bytes >= 192 << 20, "{m:?}");
    assert_eq!(m.disk_total_bytes, 64 << 20, "{m:?}");

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

    // A fork carries memory: a process counting in the background and the session's shell
    // variable run on in each copy, which then goes its own way under its own hostname.
    let counting = "(i=0; while :; do i=$((i+1)); echo $i > /tmp/n; sleep 0.1; done) >/dev/null 2>&1 & \
                    MARK=from-$(hostname)";
    exec_in(&mut rt, &sb.id, "main", counting).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let req = pb::ForkSandboxRequest { id: sb.id.clone(), count: 2, ..Default::default() };
    let started = std::time::Instant::now();
    let mut stream = admin.fork_sandbox(req).await.unwrap();
    let mut copies = Vec::new();
    while let Some(r) = stream.message().await.unwrap() {
        copies.push(r.sandbox.unwrap_or_else(|| panic!("{:?}", r.error)));
    }
    eprintln!("microvm fork x2 through the API: {} ms to both running (TCG)", started.elapsed().as_millis());
    assert_eq!(copies.len(), 2);
    let image = copies[0].spec.as_ref().unwrap().image.clone();
    let img = admin.get_image(pb::GetImageRequest { project: "root".into(), name: image.clone() }).await.unwrap();
    assert!(img.vm_snapshot.starts_with("vm-"), "{img:?}");
    let source_host = out(&exec_in(&mut rt, &sb.id, "x", "hostname").await);
    let mut hosts = vec![source_host.clone()];
    for c in &copies {
        let r = exec_in(
            &mut rt,
            &c.id,
            "main",
            "a=$(cat /tmp/n); sleep 0.5; b=$(cat /tmp/n); echo $MARK $((b > a)); hostname",
        )
        .await;
        let text = out(&r);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[0], format!("from-{source_host} 1"), "{}: {text}", c.id);
        hosts.push(lines[1].to_string());
    }
    hosts.sort();
    hosts.dedup();
    assert_eq!(hosts.len(), 3, "every copy has a hostname of its own: {hosts:?}");
    exec_in(&mut rt, &copies[0].id, "main", "echo mine > /only-here").await;
    let r = exec_in(&mut rt, &copies[1].id, "main", "cat /only-here 2>/dev/null || echo absent").await;
    assert_eq!(out(&r), "absent");
    assert_eq!(live_usage(&admin).await, 3, "each copy is charged");
    // The snapshot image is restored by microvm only; a copy of another shape is refused.
    let e = admin.create_sandbox(pb::SandboxSpec { image: image.clone(), ..container_spec("x", 32, 32) }).await;
    assert_eq!(e.unwrap_err().reason, Reason::InvalidArgument);
    let mut bigger = vm_spec("microvm");
    bigger.image = image.clone();
    bigger.resources.as_mut().unwrap().memory_mb = 256;
    let e = admin.create_sandbox(bigger).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument, "{e}");
    assert!(e.message.contains("192 MiB"), "{e}");
    for c in &copies {
        admin.stop_sandbox(&c.id).await.unwrap();
    }

    // GPUs: a microvm has no PCI bus for them; a full VM gets one only if the edge has one to
    // pass through (here none: no_capacity, and nothing left behind).
    let mut gpu = vm_spec("microvm");
    gpu.resources.as_mut().unwrap().gpus = 1;
    assert_eq!(admin.create_sandbox(gpu.clone()).await.unwrap_err().reason, Reason::InvalidArgument);
    gpu.backend = "fullvm".into();
    let e = admin.create_sandbox(gpu).await.unwrap_err();
    assert_eq!(e.reason, Reason::NoCapacity, "{e}");
    assert!(e.message.contains("GPU"), "{e}");

    // A full VM too; it has no memory snapshots ([C 8]).
    let full = admin.create_sandbox(vm_spec("fullvm")).await.unwrap();
    assert_eq!(out(&exec_in(&mut rt, &full.id, "main", "echo full").await), "full");
    let e = admin.create_snapshot(&full.id, "vm:snap", false).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument, "{e}");
    opendsec_testkit::eventually("the copies' leases released", Duration::from_secs(10), || async {
        live_usage(&admin).await == 2
    })
    .await;

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

/// `full_init`: a full VM boots its image's own init (systemd), the agent a service of it; an
/// image whose init is not systemd fails clearly and leaves nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_vm_boots_its_images_own_init() {
    let f = fixture_edges(1, |c| {
        c.edge.backends.push("fullvm".to_string());
        c.edge.vm.kernel_dir = Some(vm_kernel());
        c.edge.vm.accel = "tcg".into();
        c.edge.vm.boot_timeout = Duration::from_secs(120);
    })
    .await;
    import(&f.ca, &f.addr, &f.cluster.admin_token, &debian_systemd_rootfs(), &f.store, "debian-systemd:latest").await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    let spec = pb::SandboxSpec { full_init: true, ..vm_spec("fullvm") };
    let started = std::time::Instant::now();
    let sb =
        admin.create_sandbox(pb::SandboxSpec { image: "debian-systemd:latest".into(), ..spec.clone() }).await.unwrap();
    eprintln!("fullvm with systemd as init: {} ms to the agent answering (TCG)", started.elapsed().as_millis());
    let lease = sb.id.split_once('.').unwrap().1.to_string();
    // systemd is PID 1 and the agent (with the session's shell) is in its service's cgroup.
    let r = exec_in(&mut rt, &sb.id, "main", "cat /proc/1/comm; hostname; cat /proc/self/cgroup; X=kept").await;
    let text = out(&r);
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines[..2], ["systemd", lease.as_str()], "{text}");
    assert!(lines[2].ends_with("/opendsec-agent.service"), "{text}");
    admin.pause_sandbox(&sb.id).await.unwrap();
    admin.resume_sandbox(&sb.id).await.unwrap();
    assert_eq!(out(&exec_in(&mut rt, &sb.id, "main", "echo $X").await), "kept");
    admin.stop_sandbox(&sb.id).await.unwrap();

    // busybox's init is no systemd: refused by the guest, its reason in the error.
    let e = admin.create_sandbox(spec).await.unwrap_err();
    assert!(e.message.contains("not systemd"), "{e}");
    let vms = f.cluster.config.edge_state_dir(EDGE).join("vms");
    opendsec_testkit::eventually("nothing left", Duration::from_secs(10), || async {
        std::fs::read_dir(&vms).unwrap().flatten().all(|e| e.file_name().to_string_lossy().starts_with('.'))
    })
    .await;
}

/// A snapshot fetched by another node: a fork too big for its source's edge spills its second
/// copy onto a second edge, which copies the snapshot from the shared store into its own cache
/// once; a further copy there restores from that cache. Every copy runs on from the source's
/// memory. Once the snapshot image is deleted, the edge's copy goes with the next stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_edge_fetches_a_snapshot_once_for_its_copies() {
    let f = fixture_edges(2, |c| {
        c.edge.backends.push("microvm".to_string());
        c.edge.vm.kernel_dir = Some(vm_kernel());
        c.edge.vm.accel = "tcg".into();
        // Room for two 192 MiB VMs per edge, not three.
        c.edge.capacity.memory_mb = 400;
    })
    .await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    let sb = admin.create_sandbox(vm_spec("microvm")).await.unwrap();
    exec_in(&mut rt, &sb.id, "main", "echo remembered > /tmp/m; V=held").await;
    let req = pb::ForkSandboxRequest { id: sb.id.clone(), count: 2, ..Default::default() };
    let mut stream = admin.fork_sandbox(req).await.unwrap();
    let mut copies = Vec::new();
    while let Some(r) = stream.message().await.unwrap() {
        copies.push(r.sandbox.unwrap_or_else(|| panic!("{:?}", r.error)));
    }
    let other: Vec<_> = copies.iter().filter(|c| c.edge != sb.edge).collect();
    assert_eq!(other.len(), 1, "one copy fits beside its source, the other spills: {copies:?}");
    let there = other[0].edge.clone();
    let image = copies[0].spec.as_ref().unwrap().image.clone();
    // A third copy from the image can only go to the second edge, and finds the snapshot there.
    let third = admin.create_sandbox(pb::SandboxSpec { image: image.clone(), ..vm_spec("microvm") }).await.unwrap();
    assert_eq!(third.edge, there);
    for c in copies.iter().chain([&third]) {
        let r = exec_in(&mut rt, &c.id, "main", "echo $V $(cat /tmp/m)").await;
        assert_eq!(out(&r), "held remembered", "{}: {r:?}", c.id);
    }
    let cache = f.cluster.config.edge_state_dir(&there).join("vms").join(".snapshots");
    let cached = || -> Vec<String> {
        std::fs::read_dir(&cache)
            .into_iter()
            .flatten()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| !n.ends_with(".lock") && !n.starts_with('.'))
            .collect()
    };
    assert_eq!(cached().len(), 1, "fetched once: {:?}", cached());

    // The image deleted (its snapshot with it), the node's copy goes once a VM there stops.
    admin.delete_image(pb::DeleteImageRequest { project: "root".into(), name: image.clone() }).await.unwrap();
    let store = opendsec_images::Store::open(&f.store).unwrap();
    let swept = opendsec_images::gc::gc(&store, Duration::ZERO, std::time::SystemTime::now(), false).unwrap();
    assert_eq!(swept.snapshots_removed.len(), 1, "{swept:?}");
    admin.stop_sandbox(&third.id).await.unwrap();
    opendsec_testkit::eventually("the node's copy of the snapshot removed", Duration::from_secs(30), || async {
        cached().is_empty()
    })
    .await;
    // The copies restored from it run on: their memory and disks are their own.
    let r = exec_in(&mut rt, &other[0].id, "main", "cat /tmp/m").await;
    assert_eq!(out(&r), "remembered");
    for c in copies.iter().chain([&sb]) {
        admin.stop_sandbox(&c.id).await.unwrap();
    }
}
