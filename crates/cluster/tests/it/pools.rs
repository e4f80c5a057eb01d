//! Pools through the public API of an in-process cluster: the Admin calls, proxied by the
//! apiserver to IAM with the caller's token, kept across an IAM restart, and refused without
//! `pool.manage`.

use crate::common;

use opendsec_common::Reason;
use opendsec_proto::v1 as pb;

fn pool(name: &str, image: &str, size: u32) -> pb::Pool {
    pb::Pool {
        project: "root".into(),
        name: name.into(),
        template: Some(pb::PoolTemplate {
            image: image.into(),
            backend: "fncall".into(),
            resources: Some(pb::Resources { cpu_millis: 500, memory_mb: 128, disk_mb: 256, gpus: 0 }),
            env: [("MODE".to_string(), "warm".to_string())].into(),
            egress: vec![],
            user: String::new(),
            workdir: String::new(),
        }),
        size_per_edge: size,
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pools_through_the_api() {
    let tc = common::start(1, |_| {}).await;
    let admin = &tc.admin;
    let p = admin.create_pool(pb::CreatePoolRequest { pool: Some(pool("py", "busybox", 2)) }).await.unwrap();
    assert_eq!(p.revision.len(), 64);
    let e = admin.create_pool(pb::CreatePoolRequest { pool: Some(pool("py", "busybox", 2)) }).await.unwrap_err();
    assert_eq!(e.reason, Reason::AlreadyExists);
    let u = admin.update_pool(pb::UpdatePoolRequest { pool: Some(pool("py", "busybox:2", 3)) }).await.unwrap();
    assert_ne!(u.revision, p.revision);
    assert_eq!(u.size_per_edge, 3);
    let got = admin.get_pool(pb::GetPoolRequest { project: "root".into(), name: "py".into() }).await.unwrap();
    assert_eq!(got, u);
    let listed = admin.list_pools(pb::ListPoolsRequest { project: String::new() }).await.unwrap();
    assert_eq!(listed.pools, vec![u.clone()]);

    // Without pool.manage: refused, reading too.
    let tok = common::principal(admin, "dev", "root", &["sandbox.create", "sandbox.view"]).await;
    let dev = common::client(&tc.cluster, &tok);
    let e = dev.create_pool(pb::CreatePoolRequest { pool: Some(pool("mine", "busybox", 1)) }).await.unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied);
    let e = dev.list_pools(pb::ListPoolsRequest { project: String::new() }).await.unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied);
    // A bad template is a clear invalid_argument.
    let mut bad = pool("bad", "busybox", 1);
    bad.template.as_mut().unwrap().backend = "container".into();
    let e = admin.create_pool(pb::CreatePoolRequest { pool: Some(bad) }).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument);
    assert!(e.message.contains("fncall"), "{e}");

    admin.delete_pool(pb::DeletePoolRequest { project: "root".into(), name: "py".into() }).await.unwrap();
    let e = admin.get_pool(pb::GetPoolRequest { project: "root".into(), name: "py".into() }).await.unwrap_err();
    assert_eq!(e.reason, Reason::NotFound);
}
