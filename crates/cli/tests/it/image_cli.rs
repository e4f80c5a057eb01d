//! `opendsecctl image ...` end to end, in process: a cluster, a root file system imported into
//! its store and registered through the API, then list, get, compose, a sandbox from it, gc,
//! store-check, merge and delete, each as the command line would run it.

use crate::common;

use opendsec_cli::ctl::CtlError;
use opendsec_cluster::Cluster;
use opendsec_common::Reason;

async fn ctl(cluster: &Cluster, args: &[&str]) -> Result<(), CtlError> {
    common::ctl_admin(cluster, args).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn import_register_use_and_collect() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = common::sim_cluster(dir.path()).await;
    let store = cluster.config.image_store_dir();
    let store = store.to_str().unwrap();

    let rootfs = dir.path().join("rootfs");
    std::fs::create_dir_all(rootfs.join("bin")).unwrap();
    std::fs::write(rootfs.join("bin/hello"), b"#!/bin/sh\necho hello\n").unwrap();
    let rootfs = rootfs.to_str().unwrap();

    ctl(&cluster, &["image", "import", "--rootfs", rootfs, "--store", store, "--name", "hello:v1"]).await.unwrap();
    // The name is taken: a second import fails unless replacing; the layer is reused.
    let e = ctl(&cluster, &["image", "import", "--rootfs", rootfs, "--store", store, "--name", "hello:v1"]).await;
    assert_eq!(opendsec_cli::ctl::reason_of(&e.unwrap_err()), Some(Reason::AlreadyExists));
    ctl(&cluster, &["image", "import", "--rootfs", rootfs, "--store", store, "--name", "hello:v1", "--replace"])
        .await
        .unwrap();
    // An OCI layout made with umoci (Debian package, installed by CI): its config reaches the
    // registered image, its name comes from the directory and the tag.
    let layout = dir.path().join("busybox");
    let bundle = dir.path().join("bundle");
    let umoci = |args: &[&str]| {
        let ok = std::process::Command::new("umoci").args(args).status().expect("umoci is installed").success();
        assert!(ok, "umoci {args:?}");
    };
    let (l, b) = (layout.to_str().unwrap(), bundle.to_str().unwrap());
    umoci(&["init", "--layout", l]);
    umoci(&["new", "--image", &format!("{l}:1.36")]);
    umoci(&["unpack", "--image", &format!("{l}:1.36"), b]);
    std::fs::create_dir_all(bundle.join("rootfs/etc")).unwrap();
    std::fs::write(bundle.join("rootfs/etc/motd"), b"hi\n").unwrap();
    umoci(&["repack", "--image", &format!("{l}:1.36"), b]);
    umoci(&["config", "--image", &format!("{l}:1.36"), "--config.env", "FOO=bar", "--config.cmd", "sh"]);
    ctl(&cluster, &["image", "import", "--oci-layout", l, "1.36", "--store", store]).await.unwrap();
    let client = opendsec_client::Client::new(
        &[cluster.apiserver_addr.to_string()],
        Some(&cluster.admin_token),
        &cluster.client_tls(),
    )
    .unwrap();
    let got = client
        .get_image(opendsec_proto::v1::GetImageRequest { project: "root".into(), name: "busybox:1.36".into() })
        .await
        .unwrap();
    let config = got.config.unwrap();
    assert_eq!((config.env, config.cmd), (vec!["FOO=bar".to_string()], vec!["sh".to_string()]));
    assert!(got.source.starts_with("oci-layout:"), "{}", got.source);

    ctl(&cluster, &["image", "list"]).await.unwrap();
    ctl(&cluster, &["image", "get", "hello:v1"]).await.unwrap();
    ctl(&cluster, &["image", "compose", "combo:1", "scratch", "hello:v1"]).await.unwrap();
    ctl(&cluster, &["sandbox", "create", "--backend", "sim", "--image", "combo:1", "--cpu", "100", "--memory", "64"])
        .await
        .unwrap();
    ctl(&cluster, &["sandbox", "create", "--backend", "sim"]).await.expect("the default image exists on a new cluster");
    let e = ctl(&cluster, &["sandbox", "create", "--backend", "sim", "--image", "nope"]).await.unwrap_err();
    assert_eq!(opendsec_cli::ctl::reason_of(&e), Some(Reason::NotFound));
    assert_eq!(e.exit_code(), Reason::NotFound.exit_code());

    // Local tools on the same store.
    let s = opendsec_images::Store::open(store).unwrap();
    let hello = s.list_manifests("root", false).unwrap().into_iter().find(|m| m.repo == "hello").unwrap();
    let layer = hello.layers[0].to_string();
    ctl(&cluster, &["image", "merge", "--store", store, &layer]).await.unwrap();
    ctl(&cluster, &["image", "gc", "--store", store, "--dry-run"]).await.unwrap();
    ctl(&cluster, &["image", "gc", "--store", store, "--grace", "1m"]).await.unwrap();
    assert!(s.has_layer(&hello.layers[0]), "a referenced layer survives gc");
    let check = dir.path().join("check");
    std::fs::create_dir(&check).unwrap();
    ctl(&cluster, &["image", "store-check", check.to_str().unwrap()]).await.expect("every check passes as root");
    let e = ctl(&cluster, &["image", "store-check", "/nonexistent/dir"]).await.unwrap_err();
    assert_eq!(e.exit_code(), 1);

    ctl(&cluster, &["image", "delete", "combo:1"]).await.unwrap();
    let e = ctl(&cluster, &["image", "get", "combo:1"]).await.unwrap_err();
    assert_eq!(opendsec_cli::ctl::reason_of(&e), Some(Reason::NotFound));
    let e = ctl(&cluster, &["image", "import", "--store", store]).await.unwrap_err();
    assert_eq!(opendsec_cli::ctl::reason_of(&e), Some(Reason::InvalidArgument));
    cluster.shutdown().await;
}
