//! Session sync end to end, as root, through a real S3-compatible server on loopback (moto,
//! started by the test): a container sandbox's named paths are saved when it stops and
//! restored when the next sandbox of the project names the session (files, modes, owners,
//! symlinks, a 4 MB file; nothing outside the paths); a second run's changes and deletions
//! are carried on top of the first's; another project's sandbox does not see the session;
//! the CLI names one; a garbage object in the store and bad specs are refused clearly.

use std::time::Duration;

use crate::common::*;
use opendsec_common::Reason;
use opendsec_common::config::SessionStoreConfig;
use opendsec_proto::v1 as pb;
use opendsec_testkit::s3::{ACCESS_KEY, REGION, S3Server, SECRET_KEY};

const FINGERPRINT: &str = "cd / && find data root -xdev 2>/dev/null | sort | \
     while read -r p; do stat -c '%n|%A|%u|%g' \"$p\"; [ -f \"$p\" ] && md5sum < \"$p\"; done; readlink data/link";

fn session_spec(project: &str, name: &str, paths: &[&str]) -> pb::SandboxSpec {
    pb::SandboxSpec {
        project: project.into(),
        session: Some(pb::SessionSync { name: name.into(), paths: paths.iter().map(|p| p.to_string()).collect() }),
        ..container_spec("busybox", 64, 128)
    }
}

async fn with_store(s3: &S3Server) -> Fixture {
    let store = SessionStoreConfig {
        endpoint: s3.endpoint.clone(),
        bucket: s3.bucket.clone(),
        region: REGION.into(),
        access_key_id: ACCESS_KEY.into(),
        secret_access_key: SECRET_KEY.into(),
        allow_http: true,
        prefix: "sessions/".into(),
    };
    fixture_with(move |c| c.edge.session_store = Some(store)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_is_saved_at_stop_and_restored_at_creation() {
    let s3 = S3Server::start("sessions");
    let f = with_store(&s3).await;
    let mut rt = runtime(&f.cluster.ca_path, &f.addr, &f.cluster.admin_token);
    let admin = f.admin.clone();
    let spec = session_spec("root", "episode-1", &["/data", "/root/"]);

    // The first run finds nothing saved and starts from the image.
    let a = admin.create_sandbox(spec.clone()).await.unwrap();
    let setup = "[ ! -e /data ] && mkdir -p /data/sub /root && echo one > /data/a && chown 1000:1001 /data/a && \
         chmod 4750 /data/a && ln -s a /data/link && echo bye > /data/gone && mkdir -m 0700 /data/priv && \
         echo h > /root/.ash_history && echo out > /outside && \
         dd if=/dev/urandom of=/data/sub/big bs=1M count=4 2>/dev/null";
    assert_eq!(exec_in(&mut rt, &a.id, "main", setup).await.exit_code, 0);
    let want = out(&exec_in(&mut rt, &a.id, "fp", FINGERPRINT).await);
    assert!(want.contains("data/a|-rwsr-x---|1000|1001"), "{want}");
    admin.stop_sandbox(&a.id).await.unwrap();
    assert_eq!(s3.keys(), ["sessions/root/episode-1.tar.zst"]);

    // The next run of the session starts with those files, and only those.
    let b = admin.create_sandbox(spec.clone()).await.unwrap();
    assert_eq!(out(&exec_in(&mut rt, &b.id, "fp", FINGERPRINT).await), want);
    assert_eq!(out(&exec_in(&mut rt, &b.id, "x", "[ -e /outside ] && echo there || echo absent").await), "absent");
    let change = "rm /data/gone && echo two > /data/b && echo one-more >> /data/a";
    assert_eq!(exec_in(&mut rt, &b.id, "main", change).await.exit_code, 0);
    admin.stop_sandbox(&b.id).await.unwrap();

    // A third run sees both runs: the first's files, the second's changes and deletion.
    let c = admin.create_sandbox(spec.clone()).await.unwrap();
    let r = exec_in(
        &mut rt,
        &c.id,
        "s",
        "cat /data/a /data/b; [ -e /data/gone ] && echo gone-is-back; readlink /data/link",
    )
    .await;
    assert_eq!(out(&r), "one\none-more\ntwo\na");

    // Saved on demand (the CLI's save-session), the sandbox runs on: a sandbox started
    // meanwhile sees the save, and the saver keeps its session shell.
    exec_in(&mut rt, &c.id, "keep", "export KEPT=yes; echo three > /data/c").await;
    ctl_admin(&f.cluster, &["save-session", &c.id]).await.unwrap();
    let saved = admin.save_session(&c.id).await.unwrap();
    assert_eq!(saved.name, "episode-1");
    assert!(saved.bytes > 4 << 20, "{saved:?}");
    assert_eq!(out(&exec_in(&mut rt, &c.id, "keep", "echo $KEPT; cat /data/c").await), "yes\nthree");
    let d = admin.create_sandbox(spec.clone()).await.unwrap();
    assert_eq!(out(&exec_in(&mut rt, &d.id, "s", "cat /data/c /data/b").await), "three\ntwo");
    admin.stop_sandbox(&d.id).await.unwrap();
    let e = admin.save_session(&d.id).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidState, "a stopped sandbox saves nothing: {e}");
    assert_eq!(out(&exec_in(&mut rt, &c.id, "s", "md5sum < /data/sub/big").await).len(), 35);

    // The CLI names a session too.
    ctl_admin(
        &f.cluster,
        &[
            "sandbox",
            "create",
            "--backend",
            "container",
            "--image",
            "busybox",
            "--memory",
            "64",
            "--disk",
            "128",
            "--session",
            "episode-1",
            "--sync",
            "/data",
            "--label",
            "via=cli",
        ],
    )
    .await
    .unwrap();
    let listed = admin
        .list_sandboxes(pb::ListSandboxesRequest {
            project: "root".into(),
            labels: [("via".to_string(), "cli".to_string())].into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .sandboxes;
    assert_eq!(listed.len(), 1);
    assert_eq!(out(&exec_in(&mut rt, &listed[0].id, "s", "cat /data/b").await), "two");

    // Another project naming the same session gets its own (none yet), not this one.
    admin.create_project(pb::CreateProjectRequest { path: "root/other".into(), quota: None }).await.unwrap();
    let o = admin.create_sandbox(session_spec("root/other", "episode-1", &["/data"])).await.unwrap();
    assert_eq!(out(&exec_in(&mut rt, &o.id, "s", "[ -e /data ] && echo leaked || echo own").await), "own");
    admin.stop_sandbox(&o.id).await.unwrap();
    let mut keys = s3.keys();
    keys.sort();
    assert_eq!(keys, ["sessions/root/episode-1.tar.zst", "sessions/root/other/episode-1.tar.zst"]);

    // What the store holds is untrusted: garbage under the key refuses the creation clearly,
    // and leaves nothing running.
    s3.put("sessions/root/episode-1.tar.zst", b"this is not a session");
    let before = admin
        .list_sandboxes(pb::ListSandboxesRequest { project: "root".into(), ..Default::default() })
        .await
        .unwrap()
        .sandboxes
        .len();
    let e = admin.create_sandbox(spec.clone()).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument, "{e}");
    assert!(e.message.contains("session"), "{e}");
    let after = admin
        .list_sandboxes(pb::ListSandboxesRequest { project: "root".into(), ..Default::default() })
        .await
        .unwrap()
        .sandboxes
        .len();
    assert_eq!(after, before);
    for id in [&c.id, &listed[0].id] {
        admin.stop_sandbox(id).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(10)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_sessions_are_refused() {
    // No session store configured: a sandbox naming a session is refused, not started without.
    let f = fixture().await;
    let admin = f.admin.clone();
    let e = admin.create_sandbox(session_spec("root", "s", &["/data"])).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument, "{e}");
    assert!(e.message.contains("session store"), "{e}");
    let plain = admin.create_sandbox(container_spec("busybox", 32, 64)).await.unwrap();
    let e = admin.save_session(&plain.id).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument, "{e}");
    for (name, paths) in [
        ("Bad/Name", vec!["/data"]),
        ("..", vec!["/data"]),
        ("s", vec![]),
        ("s", vec!["/"]),
        ("s", vec!["data"]),
        ("s", vec!["/a/../etc"]),
        ("s", vec!["/x"; 17]),
    ] {
        let e = admin.create_sandbox(session_spec("root", name, &paths)).await.unwrap_err();
        assert_eq!(e.reason, Reason::InvalidArgument, "{name:?} {paths:?}: {e}");
        assert_eq!(e.metadata.get("field").map(String::as_str), Some("spec.session"), "{e}");
    }
}
