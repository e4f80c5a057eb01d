//! `opendsecctl pool ...` end to end, in process, against a cluster: create, get, list,
//! update (a new revision), delete, and the refusals a user meets.

use opendsec_cli::ctl::reason_of;
use opendsec_common::Reason;
use opendsec_proto::v1 as pb;

use crate::common::{ctl_admin as ctl, sim_cluster};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = sim_cluster(dir.path()).await;
    let admin = opendsec_client::Client::new(
        &[cluster.apiserver_addr.to_string()],
        Some(&cluster.admin_token),
        &cluster.client_tls(),
    )
    .unwrap();

    ctl(
        &cluster,
        &[
            "pool",
            "create",
            "py",
            "--image",
            "python:3.12",
            "--size",
            "4",
            "--memory",
            "512",
            "--env",
            "MODE=warm",
            "--allow",
            "pypi.org:tcp/443",
        ],
    )
    .await
    .unwrap();
    let p = admin.get_pool(pb::GetPoolRequest { project: "root".into(), name: "py".into() }).await.unwrap();
    let t = p.template.clone().unwrap();
    assert_eq!((t.image.as_str(), t.backend.as_str(), p.size_per_edge), ("python:3.12", "fncall", 4));
    assert_eq!(t.env.get("MODE").map(String::as_str), Some("warm"));
    assert_eq!(t.resources.unwrap().memory_mb, 512);
    ctl(&cluster, &["pool", "get", "py"]).await.unwrap();
    ctl(&cluster, &["pool", "list"]).await.unwrap();

    let e = ctl(&cluster, &["pool", "create", "py", "--image", "x", "--size", "1"]).await.unwrap_err();
    assert_eq!(reason_of(&e), Some(Reason::AlreadyExists));
    let e = ctl(&cluster, &["pool", "create", "Py!", "--image", "x", "--size", "1"]).await.unwrap_err();
    assert_eq!(reason_of(&e), Some(Reason::InvalidArgument));
    let e = ctl(&cluster, &["pool", "create", "bad-env", "--image", "x", "--size", "1", "--env", "NOEQUALS"])
        .await
        .unwrap_err();
    assert_eq!(reason_of(&e), Some(Reason::InvalidArgument));

    ctl(&cluster, &["pool", "update", "py", "--image", "python:3.13", "--size", "2"]).await.unwrap();
    let q = admin.get_pool(pb::GetPoolRequest { project: "root".into(), name: "py".into() }).await.unwrap();
    assert_ne!(q.revision, p.revision);
    assert_eq!(q.size_per_edge, 2);
    ctl(&cluster, &["pool", "delete", "py"]).await.unwrap();
    let e = ctl(&cluster, &["pool", "get", "py"]).await.unwrap_err();
    assert_eq!(reason_of(&e), Some(Reason::NotFound));
}
