//! Snapshots end to end, as root: container sandboxes made from a busybox image change their
//! file system (files, modes, owners, deletions of the image's files, a directory replaced,
//! symlinks, hard links, fifos, a 100 MB file), are snapshotted through the public API while
//! they keep running, and sandboxes created from the snapshot's image see exactly that file
//! system (and none of the source's processes); copies are independent; a chain of snapshots
//! past `edge.snapshot_max_layers` is merged and still stacks the same; a snapshot of a busy
//! sandbox is consistent (it was frozen); bad requests and other tenants are refused.

use crate::common;

use std::time::Duration;

use crate::common::*;
use opendsec_common::Reason;
use opendsec_proto::v1 as pb;

/// What a sandbox's file system looks like under the paths a test touches: each entry's
/// type, mode and owner, and each regular file's link count and md5 (not /etc/hosts, which
/// every sandbox gets written for its own hostname, nor directory sizes, which depend on the
/// file system below).
const FINGERPRINT: &str = "cd / && find data etc bin/cat bin/sh tmp root -xdev 2>/dev/null | grep -vx etc/hosts | sort | \
     while read -r p; do if [ -f \"$p\" ] && [ ! -L \"$p\" ]; then stat -c '%n|%A|%u|%g|%h' \"$p\"; md5sum \"$p\"; \
     else stat -c '%n|%A|%u|%g' \"$p\"; fi; done; readlink data/link";

async fn fingerprint(rt: &mut Rt, id: &str) -> String {
    let r = exec_in(rt, id, "fp", FINGERPRINT).await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    out(&r)
}

fn reason_of(e: &opendsec_common::ApiError) -> Reason {
    e.reason
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_carries_the_file_system_and_the_sandbox_runs_on() {
    let f = fixture().await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    let src = admin.create_sandbox(container_spec("busybox", 64, 256)).await.unwrap();
    let setup = "mkdir -p /data/sub /root && echo hello > /data/a && chown 1000:1001 /data/a && chmod 4750 /data/a && \
         ln -s a /data/link && ln /data/a /data/hard && mkfifo /data/fifo && mkdir -m 0700 /data/priv && \
         rm /bin/cat && rm -r /etc && mkdir /etc && echo new > /etc/motd && \
         dd if=/dev/urandom of=/data/big bs=1M count=100 2>/dev/null && \
         echo t > /tmp/t && echo hist > /root/.ash_history && echo h2 > /root/.bash_history && \
         export KEPT=yes && (sleep 1000 &)";
    let r = exec_in(&mut rt, &src.id, "main", setup).await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let want = fingerprint(&mut rt, &src.id).await;
    assert!(want.contains("data/a|-rwsr-x---|1000|1001|2"), "{want}");

    let snap = admin.create_snapshot(&src.id, "snap:one", false).await.unwrap();
    let image = snap.image.clone().unwrap();
    assert_eq!((image.project.as_str(), image.repo.as_str(), image.tag.as_str()), ("root", "snap", "one"));
    assert_eq!(image.layers.len(), 2, "the busybox layer and the snapshot's");
    assert_eq!(image.layers[1], snap.layer);
    assert!(snap.layer_bytes >= 100 << 20, "{snap:?}");
    assert!(image.source.contains(&src.id));

    // The same through the CLI.
    common::ctl_admin(&f.cluster, &["snapshot", &src.id, "snap:cli"]).await.unwrap();
    let cli = admin.get_image(pb::GetImageRequest { project: "root".into(), name: "snap:cli".into() }).await.unwrap();
    assert_eq!(cli.layers, image.layers, "nothing changed in between: the same content-addressed layer");

    // The source runs on, its session intact.
    assert_eq!(state(&admin.get_sandbox(&src.id).await.unwrap()), pb::SandboxState::Running);
    assert_eq!(out(&exec_in(&mut rt, &src.id, "main", "echo $KEPT").await), "yes");

    // A copy from the snapshot sees the same file system, and none of the source's processes.
    let copy = admin.create_sandbox(container_spec("snap:one", 64, 256)).await.unwrap();
    assert_eq!(fingerprint(&mut rt, &copy.id).await, want);
    let sleeping = "ps -o args | grep -c '[s]leep 1000' || true";
    assert_eq!(out(&exec_in(&mut rt, &src.id, "main", sleeping).await), "1");
    assert_eq!(out(&exec_in(&mut rt, &copy.id, "main", sleeping).await), "0", "processes are not copied");

    // Source and copy are independent.
    exec_in(&mut rt, &copy.id, "main", "echo copy > /data/a").await;
    exec_in(&mut rt, &src.id, "main", "echo source > /data/only-source").await;
    assert_eq!(out(&exec_in(&mut rt, &src.id, "main", "cat /data/a").await), "hello");
    let r = exec_in(&mut rt, &copy.id, "main", "test -e /data/only-source; echo $?").await;
    assert_eq!(out(&r), "1");

    // pack_diff: no /tmp contents, no histories; the rest as before.
    let packed = admin.create_snapshot(&src.id, "snap:packed", true).await.unwrap();
    assert!(packed.layer_bytes >= 100 << 20);
    let p = admin.create_sandbox(container_spec("snap:packed", 64, 256)).await.unwrap();
    let r = exec_in(&mut rt, &p.id, "main", "[ -z \"$(ls -A /tmp)\" ] && [ ! -e /root/.ash_history ] && [ ! -e /root/.bash_history ] && cat /etc/motd /data/a").await;
    assert_eq!(out(&r), "new\nhello", "{r:?}");

    // A snapshot of a copy stacks one more layer: a fork of a fork.
    let again = admin.create_snapshot(&copy.id, "snap:two", false).await.unwrap();
    assert_eq!(again.image.unwrap().layers.len(), 3);

    // A paused sandbox stays paused.
    admin.pause_sandbox(&src.id).await.unwrap();
    admin.create_snapshot(&src.id, "snap:paused", false).await.unwrap();
    assert_eq!(state(&admin.get_sandbox(&src.id).await.unwrap()), pb::SandboxState::Paused);
    assert_eq!(freezer_state_of(&f, &src), "FROZEN", "the snapshot left it frozen");
    admin.resume_sandbox(&src.id).await.unwrap();

    // A sparse file claiming more than the sandbox's disk (256 MiB) would be written out whole
    // into the store: refused, and the sandbox runs on.
    exec_in(&mut rt, &src.id, "main", "truncate -s 1G /data/sparse").await;
    let e = admin.create_snapshot(&src.id, "snap:sparse", false).await.unwrap_err();
    assert_eq!(reason_of(&e), Reason::InvalidArgument, "{e}");
    assert!(e.message.contains("too large"), "{e}");
    assert_eq!(out(&exec_in(&mut rt, &src.id, "main", "rm /data/sparse && echo ok").await), "ok");

    // Bad requests: a name taken, a bad name, a stopped sandbox, a sim sandbox.
    let e = admin.create_snapshot(&src.id, "snap:one", false).await.unwrap_err();
    assert_eq!(reason_of(&e), Reason::AlreadyExists, "{e}");
    for bad in ["", "../x", "UPPER:tag", "a:b:c"] {
        let e = admin.create_snapshot(&src.id, bad, false).await.unwrap_err();
        assert_eq!(reason_of(&e), Reason::InvalidArgument, "{bad:?}: {e}");
    }
    let sim = admin
        .create_sandbox(pb::SandboxSpec { backend: "sim".into(), ..container_spec("busybox", 64, 16) })
        .await
        .unwrap();
    let e = admin.create_snapshot(&sim.id, "snap:sim", false).await.unwrap_err();
    assert_eq!(reason_of(&e), Reason::InvalidArgument, "{e}");
    admin.stop_sandbox(&p.id).await.unwrap();
    let e = admin.create_snapshot(&p.id, "snap:stopped", false).await.unwrap_err();
    assert!(matches!(reason_of(&e), Reason::InvalidState | Reason::NotFound), "{e}");

    // Another tenant cannot snapshot this sandbox, even holding every permission in its own
    // project; in the sandbox's project, operating it is not enough without layer.publish.
    admin.create_project(pb::CreateProjectRequest { path: "root/other".into(), quota: None }).await.unwrap();
    let other =
        principal(&admin, "mallory", "root/other", &["sandbox.operate", "sandbox.view", "layer.publish", "layer.use"])
            .await;
    let mallory =
        opendsec_client::Client::new(std::slice::from_ref(&f.addr), Some(&other), &f.cluster.client_tls()).unwrap();
    let e = mallory.create_snapshot(&src.id, "stolen:x", false).await.unwrap_err();
    assert!(matches!(reason_of(&e), Reason::PermissionDenied | Reason::NotFound), "{e}");
    let op = principal(&admin, "operator", "root", &["sandbox.operate", "sandbox.view"]).await;
    let operator =
        opendsec_client::Client::new(std::slice::from_ref(&f.addr), Some(&op), &f.cluster.client_tls()).unwrap();
    let e = operator.create_snapshot(&src.id, "snap:op", false).await.unwrap_err();
    assert_eq!(reason_of(&e), Reason::PermissionDenied, "{e}");
    // Publishing where the sandbox is does not make the image's layers (root's busybox) the
    // caller's to copy: a snapshot needs layer.use on the source image, as a creation does.
    admin.create_project(pb::CreateProjectRequest { path: "root/p".into(), quota: None }).await.unwrap();
    let inp = admin
        .create_sandbox(pb::SandboxSpec { project: "root/p".into(), ..container_spec("busybox", 64, 32) })
        .await
        .unwrap();
    let publ = principal(&admin, "publisher", "root/p", &["sandbox.operate", "sandbox.view", "layer.publish"]).await;
    let publisher =
        opendsec_client::Client::new(std::slice::from_ref(&f.addr), Some(&publ), &f.cluster.client_tls()).unwrap();
    let e = publisher.create_snapshot(&inp.id, "copied:x", false).await.unwrap_err();
    assert_eq!(reason_of(&e), Reason::PermissionDenied, "{e}");
    admin.stop_sandbox(&inp.id).await.unwrap();
    let listed = admin.list_images(pb::ListImagesRequest { project: "root".into(), recursive: true }).await.unwrap();
    let names: Vec<String> = listed.images.iter().map(|i| format!("{}:{}", i.repo, i.tag)).collect();
    assert!(!names.iter().any(|n| ["stolen:x", "snap:op", "snap:sim", "copied:x"].contains(&n.as_str())), "{names:?}");

    for id in [&src.id, &copy.id, &sim.id] {
        admin.stop_sandbox(id).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_chain_is_merged_and_stacks_the_same() {
    let f = fixture_with(|c| c.edge.snapshot_max_layers = 4).await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    let mut image = "busybox".to_string();
    let mut counts = Vec::new();
    for g in 0..5u32 {
        let sb = admin.create_sandbox(container_spec(&image, 64, 32)).await.unwrap();
        let mut script = format!("mkdir -p /gen && echo {g} > /gen/{g} && echo {g} > /gen/last");
        if g > 0 {
            script.push_str(&format!(" && rm /gen/{}", g - 1));
        }
        assert_eq!(exec_in(&mut rt, &sb.id, "main", &script).await.exit_code, 0);
        let name = format!("chain:g{g}");
        let snap = admin.create_snapshot(&sb.id, &name, false).await.unwrap();
        counts.push(snap.image.unwrap().layers.len());
        admin.stop_sandbox(&sb.id).await.unwrap();
        image = name;
    }
    // 2, 3, 4, then past 4: the bottom 2 kept and the rest merged into one.
    assert_eq!(counts, vec![2, 3, 4, 3, 4]);
    let last = admin.create_sandbox(container_spec(&image, 64, 32)).await.unwrap();
    let r = exec_in(&mut rt, &last.id, "main", "ls /gen | tr '\\n' ' '; cat /gen/last").await;
    // Each generation wrote its file and deleted its predecessor's (whiteouts through the merge).
    assert_eq!(out(&r), "4 last 4", "{r:?}");
    admin.stop_sandbox(&last.id).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_of_a_busy_sandbox_is_consistent() {
    let f = fixture().await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    let sb = admin.create_sandbox(container_spec("busybox", 64, 64)).await.unwrap();
    // Two files written one after the other in a loop: whenever the sandbox is stopped in
    // time, b is a or a - 1.
    let writer = "(i=0; while :; do i=$((i+1)); echo $i > /a.t && mv /a.t /a; echo $i > /b.t && mv /b.t /b; done) \
                  >/dev/null 2>&1 &";
    exec_in(&mut rt, &sb.id, "main", writer).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let store = opendsec_images::Store::open(&f.store).unwrap();
    for i in 0..4 {
        let snap = admin.create_snapshot(&sb.id, &format!("busy:s{i}"), false).await.unwrap();
        let top = store.layer_rootfs(&opendsec_images::LayerId::parse(&snap.layer).unwrap());
        let read = |n: &str| std::fs::read_to_string(top.join(n)).unwrap().trim().parse::<u64>().unwrap();
        let (a, b) = (read("a"), read("b"));
        assert!(b == a || b + 1 == a, "snapshot {i}: a = {a}, b = {b}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The writer still runs: it was frozen, not stopped.
    let r = exec_in(&mut rt, &sb.id, "main", "a=$(cat /a); sleep 0.3; b=$(cat /a); [ $b -gt $a ] && echo moving").await;
    assert_eq!(out(&r), "moving");
    admin.stop_sandbox(&sb.id).await.unwrap();
}

/// Sandboxes of a fork's stream, and the errors of its items.
async fn collect(mut s: tonic::Streaming<pb::CreateSandboxesResponse>) -> (Vec<pb::Sandbox>, Vec<pb::ErrorDetail>) {
    let (mut ok, mut failed) = (Vec::new(), Vec::new());
    while let Some(r) = s.message().await.unwrap() {
        match (r.sandbox, r.error) {
            (Some(sb), _) => ok.push(sb),
            (None, Some(e)) => failed.push(e),
            (None, None) => panic!("an item with neither a sandbox nor an error"),
        }
    }
    (ok, failed)
}

fn fork(id: &str, count: u32) -> pb::ForkSandboxRequest {
    pb::ForkSandboxRequest { id: id.into(), count, ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_makes_independent_copies_and_each_is_charged() {
    let f = fixture().await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    let mut spec = container_spec("busybox", 32, 32);
    spec.labels.insert("job".into(), "episode".into());
    spec.env.insert("SEED".into(), "7".into());
    let src = admin.create_sandbox(spec).await.unwrap();
    exec_in(&mut rt, &src.id, "main", "mkdir /state && echo step-40 > /state/step && (sleep 1000 &)").await;

    let (copies, failed) = collect(admin.fork_sandbox(fork(&src.id, 16)).await.unwrap()).await;
    assert!(failed.is_empty(), "{failed:?}");
    assert_eq!(copies.len(), 16);
    let image = copies[0].spec.as_ref().unwrap().image.clone();
    assert!(image.starts_with("forks/"), "{image}");
    for c in &copies {
        let sp = c.spec.as_ref().unwrap();
        assert_eq!(sp.image, image, "one snapshot for every copy");
        assert_eq!(sp.labels.get("job").map(String::as_str), Some("episode"));
        assert_eq!(c.edge, src.edge, "copies go to the source's edge while it has room");
        assert_eq!(state(c), pb::SandboxState::Running);
    }
    // Each copy starts from the source's state, with its env and none of its processes, and
    // writes only to itself.
    for (i, c) in copies.iter().enumerate() {
        let r = exec_in(&mut rt, &c.id, "main", &format!("cat /state/step; echo $SEED; echo {i} > /state/mine")).await;
        assert_eq!(out(&r), "step-40\n7", "{r:?}");
    }
    for (i, c) in copies.iter().enumerate() {
        let r = exec_in(&mut rt, &c.id, "main", "cat /state/mine; ps -o args | grep -c '[s]leep 1000' || true").await;
        assert_eq!(out(&r), format!("{i}\n0"));
    }
    assert_eq!(out(&exec_in(&mut rt, &src.id, "main", "ls /state").await), "step");

    // A fork of a fork, under a name of our choosing, kept as an image.
    let req = pb::ForkSandboxRequest {
        id: copies[3].id.clone(),
        count: 2,
        snapshot_name: "episode:branch".into(),
        pack_diff: false,
    };
    let (grand, failed) = collect(admin.fork_sandbox(req.clone()).await.unwrap()).await;
    assert!(failed.is_empty() && grand.len() == 2, "{failed:?}");
    assert_eq!(out(&exec_in(&mut rt, &grand[1].id, "main", "cat /state/mine").await), "3");
    let img =
        admin.get_image(pb::GetImageRequest { project: "root".into(), name: "episode:branch".into() }).await.unwrap();
    assert_eq!(img.layers.len(), 3);
    let e = admin.fork_sandbox(req).await.unwrap_err();
    assert_eq!(e.reason, Reason::AlreadyExists, "{e}");

    // The CLI forks too.
    common::ctl_admin(&f.cluster, &["fork", &src.id, "--count", "2"]).await.unwrap();
    let listed = admin
        .list_sandboxes(pb::ListSandboxesRequest { project: "root".into(), ..Default::default() })
        .await
        .unwrap()
        .sandboxes;
    let cli_copies: Vec<_> = listed
        .iter()
        .filter(|x| x.spec.as_ref().is_some_and(|sp| sp.image.starts_with("forks/") && sp.image != image))
        .collect();
    assert_eq!(cli_copies.len(), 2);

    // Counts out of range, another tenant.
    for n in [0, 257] {
        let e = admin.fork_sandbox(fork(&src.id, n)).await.unwrap_err();
        assert_eq!(e.reason, Reason::InvalidArgument, "{n}: {e}");
    }
    admin.create_project(pb::CreateProjectRequest { path: "root/other".into(), quota: None }).await.unwrap();
    let tok =
        principal(&admin, "eve", "root/other", &["sandbox.create", "sandbox.operate", "layer.publish", "layer.use"])
            .await;
    let eve = opendsec_client::Client::new(std::slice::from_ref(&f.addr), Some(&tok), &f.cluster.client_tls()).unwrap();
    let e = eve.fork_sandbox(fork(&src.id, 1)).await.unwrap_err();
    assert!(matches!(e.reason, Reason::PermissionDenied | Reason::NotFound), "{e}");

    // Each copy is admitted on its own: with room for three more in the project's quota, a
    // fork of five makes three and refuses two, charging exactly the three.
    let quota = pb::Quota { memory_mb: Some(32 * 4), ..Default::default() };
    admin.create_project(pb::CreateProjectRequest { path: "root/q".into(), quota: Some(quota) }).await.unwrap();
    let q = admin
        .create_sandbox(pb::SandboxSpec { project: "root/q".into(), ..container_spec("busybox", 32, 32) })
        .await
        .unwrap();
    let (made, refused) = collect(admin.fork_sandbox(fork(&q.id, 5)).await.unwrap()).await;
    assert_eq!((made.len(), refused.len()), (3, 2), "{refused:?}");
    assert!(refused.iter().all(|e| e.reason == "quota_exceeded"), "{refused:?}");
    let usage = admin.get_usage(pb::GetUsageRequest { project: "root/q".into() }).await.unwrap();
    let used = usage.projects.iter().find(|p| p.path == "root/q").and_then(|p| p.usage).unwrap();
    assert_eq!((used.memory_mb, used.sandboxes), (32 * 4, 4));

    let cli_ids: Vec<String> = cli_copies.iter().map(|x| x.id.clone()).collect();
    for id in &cli_ids {
        admin.stop_sandbox(id).await.unwrap();
    }
    for sb in copies.iter().chain(&grand).chain(&made).chain([&src, &q]) {
        admin.stop_sandbox(&sb.id).await.unwrap();
    }
}

/// Snapshots and forks are charged to the project's `store_bytes` like any image it
/// publishes: once the project's images (each distinct layer once) would pass the limit, a
/// snapshot and a fork are `quota_exceeded` and publish nothing. Before, repeated snapshots
/// of a full disk grew the shared store without bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn snapshots_and_forks_stop_at_the_store_quota() {
    let f = fixture().await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    admin.create_project(pb::CreateProjectRequest { path: "root/s".into(), quota: None }).await.unwrap();
    let mut spec = container_spec("busybox", 64, 64);
    spec.project = "root/s".into();
    let src = admin.create_sandbox(spec).await.unwrap();
    let write = |name: &str| format!("dd if=/dev/urandom of=/{name} bs=1k count=600 2>/dev/null");
    assert_eq!(exec_in(&mut rt, &src.id, "main", &write("one")).await.exit_code, 0);
    admin.create_snapshot(&src.id, "s:one", false).await.unwrap();
    let project = |admin: &opendsec_client::Client| {
        let admin = admin.clone();
        async move { admin.get_project(pb::GetProjectRequest { path: "root/s".into() }).await.unwrap() }
    };
    let used = project(&admin).await.usage.unwrap().store_bytes;
    assert!(used > 600 << 10, "the snapshot's 600 KiB and the image's layers: {used}");
    // The limit leaves 300 KiB: a snapshot of another 600 KiB, or a fork (whose snapshot
    // carries it too), does not fit.
    let quota = pb::Quota { store_bytes: Some(used + (300 << 10)), ..Default::default() };
    admin.set_quota(pb::SetQuotaRequest { path: "root/s".into(), quota: Some(quota) }).await.unwrap();
    assert_eq!(exec_in(&mut rt, &src.id, "main", &write("two")).await.exit_code, 0);
    let e = admin.create_snapshot(&src.id, "s:two", false).await.unwrap_err();
    assert_eq!(e.reason, Reason::QuotaExceeded, "{e}");
    let e = match admin.fork_sandbox(fork(&src.id, 2)).await {
        Err(e) => e,
        Ok(s) => {
            let (copies, failed) = collect(s).await;
            assert!(copies.is_empty(), "a fork past the store quota made copies");
            opendsec_common::ApiError::new(Reason::parse(&failed[0].reason).unwrap(), failed[0].message.clone())
        }
    };
    assert_eq!(e.reason, Reason::QuotaExceeded, "{e}");
    let get = pb::GetImageRequest { project: "root/s".into(), name: "s:two".into() };
    assert_eq!(admin.get_image(get).await.unwrap_err().reason, Reason::NotFound);
    assert_eq!(project(&admin).await.usage.unwrap().store_bytes, used, "nothing more charged");
    // The sandbox runs on.
    assert_eq!(exec_in(&mut rt, &src.id, "main", "rm /two").await.exit_code, 0);
    admin.stop_sandbox(&src.id).await.unwrap();
}
