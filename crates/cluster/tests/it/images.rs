//! End-to-end: the Images API and the image check of creations, through a real cluster (real
//! IAM permissions, a real store under the cluster's state directory).

use std::time::Duration;

use crate::common::*;
use opendsec_cluster::{EMPTY_LAYER_ID, SCRATCH_IMAGE};
use opendsec_common::Reason;
use opendsec_images::{LayerId, Store};
use opendsec_proto::v1 as pb;
use opendsec_testkit::put_layer;

fn register(project: &str, name: &str, layers: &[&str]) -> pb::RegisterImageRequest {
    let (repo, tag) = name.split_once(':').unwrap_or((name, "latest"));
    pb::RegisterImageRequest {
        image: Some(pb::Image {
            project: project.into(),
            repo: repo.into(),
            tag: tag.into(),
            layers: layers.iter().map(|l| l.to_string()).collect(),
            config: Some(pb::ImageConfig { env: vec!["PATH=/bin".into()], ..Default::default() }),
            ..Default::default()
        }),
        replace: false,
    }
}

fn with_image(project: &str, image: &str) -> pb::SandboxSpec {
    pb::SandboxSpec { image: image.into(), ..spec(project, 100, 64) }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_cluster_has_scratch_and_missing_images_are_not_found() {
    let t = start(1, |_| {}).await;
    let scratch =
        t.admin.get_image(pb::GetImageRequest { project: "root".into(), name: SCRATCH_IMAGE.into() }).await.unwrap();
    assert_eq!((scratch.project.as_str(), scratch.layers.clone()), ("root", vec![EMPTY_LAYER_ID.to_string()]));
    let store = Store::open(t.cluster.config.image_store_dir()).unwrap();
    assert!(store.has_layer(&LayerId::parse(EMPTY_LAYER_ID).unwrap()));

    let e = t.admin.create_sandbox(with_image("", "nope:1")).await.unwrap_err();
    assert_eq!(e.reason, Reason::NotFound, "{e}");
    assert!(e.message.contains("image nope:1 not found in root or above"), "{}", e.message);
    let e = match t.admin.create_sandboxes(with_image("", "nope"), 5).await {
        Err(e) => e,
        Ok(mut s) => opendsec_common::ApiError::from_status(&s.message().await.unwrap_err()),
    };
    assert_eq!(e.reason, Reason::NotFound);
    // A subproject finds root's image; placement's no_capacity stays told apart.
    project(&t.admin, "root/team", pb::Quota::default()).await;
    t.admin.create_sandbox(with_image("root/team", "scratch")).await.unwrap();
    let mut huge = with_image("root/team", "scratch:latest");
    huge.resources = Some(pb::Resources { cpu_millis: 1000, memory_mb: 1 << 20, disk_mb: 0, gpus: 0 });
    assert_eq!(t.admin.create_sandbox(huge).await.unwrap_err().reason, Reason::NoCapacity);
    assert_eq!(usage(&t.admin, "root").await.sandboxes, 1, "nothing reserved for the refused ones");
    t.cluster.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_compose_list_and_delete() {
    let t = start(1, |_| {}).await;
    let store = Store::open(t.cluster.config.image_store_dir()).unwrap();
    let (l1, l2) = (put_layer(&store, 1, "root"), put_layer(&store, 2, "root"));

    // A manifest naming a missing layer fails clearly and leaves nothing.
    let missing = "ab".repeat(32);
    let e = t.admin.register_image(register("root", "broken:1", &[&l1, &missing])).await.unwrap_err();
    assert_eq!(e.reason, Reason::NotFound);
    assert!(e.message.contains(&missing), "names the missing layer: {}", e.message);
    let e = t.admin.get_image(pb::GetImageRequest { project: "root".into(), name: "broken:1".into() }).await;
    assert_eq!(e.unwrap_err().reason, Reason::NotFound);
    let e = t.admin.register_image(register("root", "bad", &["../../etc/passwd"])).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidArgument);

    let base = t.admin.register_image(register("root", "base:1", &[&l1])).await.unwrap();
    assert_eq!(base.layers, vec![l1.clone()]);
    t.admin.register_image(register("root", "app:1", &[&l1, &l2])).await.unwrap();
    assert_eq!(
        t.admin.register_image(register("root", "app:1", &[&l2])).await.unwrap_err().reason,
        Reason::AlreadyExists
    );

    // Compose copies no data: the new manifest names the same layers.
    project(&t.admin, "root/team", pb::Quota::default()).await;
    let combo = t
        .admin
        .compose_image(pb::ComposeImageRequest {
            project: "root/team".into(),
            name: "combo:v1".into(),
            sources: vec!["app:1".into(), "root//scratch:latest".into()],
            replace: false,
        })
        .await
        .unwrap();
    assert_eq!(combo.layers, vec![l1.clone(), l2.clone(), EMPTY_LAYER_ID.to_string()]);
    let s = t.admin.create_sandbox(with_image("root/team", "combo:v1")).await.unwrap();
    assert_eq!(s.spec.unwrap().image, "combo:v1");

    let names = |r: pb::ListImagesResponse| {
        r.images.iter().map(|i| format!("{}//{}:{}", i.project, i.repo, i.tag)).collect::<Vec<_>>()
    };
    let listed = t.admin.list_images(pb::ListImagesRequest { project: "root".into(), recursive: false }).await.unwrap();
    assert_eq!(names(listed), ["root//app:1", "root//base:1", "root//scratch:latest"]);
    let listed = t.admin.list_images(pb::ListImagesRequest { project: "root".into(), recursive: true }).await.unwrap();
    assert_eq!(names(listed).len(), 4);

    t.admin
        .delete_image(pb::DeleteImageRequest { project: "root/team".into(), name: "combo:v1".into() })
        .await
        .unwrap();
    let e = t.admin.create_sandbox(with_image("root/team", "combo:v1")).await.unwrap_err();
    assert_eq!(e.reason, Reason::NotFound, "a deleted image is gone for creations at once");
    // Deleting looks in exactly the named project, never above.
    let e = t.admin.delete_image(pb::DeleteImageRequest { project: "root/team".into(), name: "app:1".into() }).await;
    assert_eq!(e.unwrap_err().reason, Reason::NotFound);
    assert!(store.has_layer(&LayerId::parse(&l2).unwrap()), "layers stay until GC");
    t.cluster.shutdown().await;
}

/// The account that builds environments and the one that runs jobs are separate: publishing
/// needs `layer.publish`, using needs `layer.use`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_and_using_are_separate_permissions() {
    let t = start(1, |_| {}).await;
    project(&t.admin, "root/ml", pb::Quota::default()).await;
    let store = Store::open(t.cluster.config.image_store_dir()).unwrap();
    let layer = put_layer(&store, 7, "root/ml");
    let builder = client(&t.cluster, &principal(&t.admin, "builder", "root/ml", &["layer.publish"]).await);
    let runner = client(&t.cluster, &principal(&t.admin, "runner", "root/ml", &["layer.use", "sandbox.create"]).await);
    let stranger = client(&t.cluster, &principal(&t.admin, "stranger", "root/ml", &["sandbox.create"]).await);

    // The builder publishes; the runner may not.
    builder.register_image(register("root/ml", "env:v1", &[&layer])).await.unwrap();
    let e = runner.register_image(register("root/ml", "env:v2", &[&layer])).await.unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied, "{e}");
    let e = runner.delete_image(pb::DeleteImageRequest { project: "root/ml".into(), name: "env:v1".into() }).await;
    assert_eq!(e.unwrap_err().reason, Reason::PermissionDenied);
    // Nor may the builder publish above its project.
    let e = builder.register_image(register("root", "env:v1", &[&layer])).await.unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied);

    // The runner uses it; the builder cannot run sandboxes, nor read images it may not use.
    let s = runner.create_sandbox(with_image("root/ml", "env:v1")).await.unwrap();
    assert_eq!(s.spec.unwrap().project, "root/ml");
    runner.get_image(pb::GetImageRequest { project: "root/ml".into(), name: "env:v1".into() }).await.unwrap();
    let e = builder.create_sandbox(with_image("root/ml", "env:v1")).await.unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied);
    let e = builder.list_images(pb::ListImagesRequest { project: "root/ml".into(), recursive: false }).await;
    assert_eq!(e.unwrap_err().reason, Reason::PermissionDenied);

    // sandbox.create alone is not enough: layer.use is checked where the image was found.
    let e = stranger.create_sandbox(with_image("root/ml", "env:v1")).await.unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied, "{e}");
    assert!(e.message.contains("layer.use"), "{}", e.message);
    // The runner may use root/ml's images, not root's.
    let e = runner.create_sandbox(with_image("root/ml", "scratch")).await.unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied);
    assert!(e.message.contains("layer.use") && e.message.contains("in root"), "{}", e.message);

    // Once the builder deletes it, creations fail with not_found.
    builder.delete_image(pb::DeleteImageRequest { project: "root/ml".into(), name: "env:v1".into() }).await.unwrap();
    let e = runner.create_sandbox(with_image("root/ml", "env:v1")).await.unwrap_err();
    assert_eq!(e.reason, Reason::NotFound);
    t.cluster.shutdown().await;
}

/// Layers are shared by content, not by knowing their ids: a tenant cannot register another
/// project's private layer under its own name (and so cannot run it), and learns nothing of
/// whether it exists. Once it may use the other project's images, it may.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_projects_layers_cannot_be_registered_by_id() {
    // New grants reach the apiserver when its authorization cache expires.
    let t = start(1, |c| c.apiserver.auth_cache_ttl = std::time::Duration::from_millis(200)).await;
    project(&t.admin, "root/a", pb::Quota::default()).await;
    project(&t.admin, "root/b", pb::Quota::default()).await;
    let store = Store::open(t.cluster.config.image_store_dir()).unwrap();
    let private = put_layer(&store, 11, "root/b");
    let own = put_layer(&store, 12, "root/a");
    let perms = ["layer.publish", "layer.use", "sandbox.create"];
    let b = client(&t.cluster, &principal(&t.admin, "b-builder", "root/b", &perms).await);
    b.register_image(register("root/b", "secret:1", &[&private])).await.unwrap();
    let a = client(&t.cluster, &principal(&t.admin, "a-tenant", "root/a", &perms).await);

    // root/a names root/b's layer by id: refused as if it did not exist, exactly like a
    // layer that does not exist.
    let e = a.register_image(register("root/a", "stolen:1", &[&own, &private])).await.unwrap_err();
    assert_eq!(e.reason, Reason::NotFound, "{e}");
    assert!(e.message.contains(&private), "{}", e.message);
    let missing = "cd".repeat(32);
    let e2 = a.register_image(register("root/a", "stolen:1", &[&own, &missing])).await.unwrap_err();
    assert_eq!(e2.message.replace(&missing, "X"), e.message.replace(&private, "X"), "the answers differ");
    let e = a.create_sandbox(with_image("root/a", "stolen:1")).await.unwrap_err();
    assert_eq!(e.reason, Reason::NotFound, "nothing was registered");
    // Composing from root/b's image needs layer.use there too (it already did).
    let e = a
        .compose_image(pb::ComposeImageRequest {
            project: "root/a".into(),
            name: "stolen:2".into(),
            sources: vec!["root/b//secret:1".into()],
            replace: false,
        })
        .await
        .unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied, "{e}");
    // Its own layers it registers; layers stored before layers had users count as root's.
    a.register_image(register("root/a", "mine:1", &[&own])).await.unwrap();
    let old = put_layer(&store, 13, "root");
    std::fs::remove_dir_all(store.layer_dir(&LayerId::parse(&old).unwrap()).join("users")).unwrap();
    assert_eq!(a.register_image(register("root/a", "old:1", &[&old])).await.unwrap_err().reason, Reason::NotFound);
    t.admin.register_image(register("root", "old:1", &[&old])).await.unwrap();

    // Granted layer.use on root/b, root/a may build on its layers.
    t.admin
        .grant(pb::GrantRequest {
            grant: Some(pb::Grant {
                principal: "a-tenant".into(),
                project: "root/b".into(),
                permission: "layer.use".into(),
            }),
        })
        .await
        .unwrap();
    // The grant reaches the apiserver's authorization cache within the security epoch's poll.
    eventually("the grant takes effect", Duration::from_secs(10), || async {
        match a.register_image(register("root/a", "shared:1", &[&own, &private])).await {
            Ok(_) => true,
            Err(e) => {
                assert_eq!(e.reason, Reason::NotFound, "{e}");
                false
            }
        }
    })
    .await;
    a.create_sandbox(with_image("root/a", "shared:1")).await.unwrap();
    t.cluster.shutdown().await;
}

/// A deleted project leaves nothing to a project made later under its name: its deletion is
/// refused while it holds images (and a caller who may not delete it does not learn whether
/// it does), and once it is gone it is no layer's user any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_project_made_again_under_a_deleted_name_inherits_no_images_or_layers() {
    let t = start(1, |_| {}).await;
    project(&t.admin, "root/t", pb::Quota::default()).await;
    project(&t.admin, "root/other", pb::Quota::default()).await;
    let store = Store::open(t.cluster.config.image_store_dir()).unwrap();
    let layer = put_layer(&store, 21, "root/t");
    let perms = ["layer.publish", "layer.use", "sandbox.create"];
    let old = client(&t.cluster, &principal(&t.admin, "old-builder", "root/t", &perms).await);
    old.register_image(register("root/t", "private:1", &[&layer])).await.unwrap();
    let stranger = client(&t.cluster, &principal(&t.admin, "stranger", "root/other", &perms).await);
    let delete = |p: &str| pb::DeleteProjectRequest { path: p.into() };

    let e = stranger.delete_project(delete("root/t")).await.unwrap_err();
    assert_eq!(e.reason, Reason::PermissionDenied, "{e}");
    assert!(!e.message.contains("private"), "{}", e.message);
    let e = t.admin.delete_project(delete("root/t")).await.unwrap_err();
    assert_eq!(e.reason, Reason::InvalidState, "{e}");
    assert!(e.message.contains("still has image private:1"), "{}", e.message);

    old.delete_image(pb::DeleteImageRequest { project: "root/t".into(), name: "private:1".into() }).await.unwrap();
    t.admin.delete_principal(pb::DeletePrincipalRequest { name: "old-builder".into() }).await.unwrap();
    t.admin.delete_project(delete("root/t")).await.unwrap();
    let id = LayerId::parse(&layer).unwrap();
    assert!(store.layer_users(&id).unwrap().is_empty(), "{:?}", store.layer_users(&id));

    // The new root/t may not name the old one's layer.
    project(&t.admin, "root/t", pb::Quota::default()).await;
    let new = client(&t.cluster, &principal(&t.admin, "new-builder", "root/t", &perms).await);
    let e = new.register_image(register("root/t", "mine:1", &[&layer])).await.unwrap_err();
    assert_eq!(e.reason, Reason::NotFound, "{e}");
    let e = new.get_image(pb::GetImageRequest { project: "root/t".into(), name: "private:1".into() }).await;
    assert_eq!(e.unwrap_err().reason, Reason::NotFound);
    t.cluster.shutdown().await;
}

/// The image store's quota: each image a project publishes is charged with the layers it
/// names, each distinct layer once in the project and each ancestor; past `store_bytes` a
/// registration or a composition is `quota_exceeded` and nothing is written; deleting gives
/// the bytes back. Before, publishing had no bound at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_bytes_bounds_what_a_project_publishes() {
    let t = start(1, |_| {}).await;
    let quota = pb::Quota { store_bytes: Some(100), ..Default::default() };
    project(&t.admin, "root/q", quota).await;
    project(&t.admin, "root/q/sub", pb::Quota::default()).await;
    let store = Store::open(t.cluster.config.image_store_dir()).unwrap();
    let (a, b, c) = (
        opendsec_testkit::put_layer_sized(&store, 31, "root/q", 60),
        opendsec_testkit::put_layer_sized(&store, 32, "root/q", 30),
        opendsec_testkit::put_layer_sized(&store, 33, "root/q", 60),
    );
    let used = |u: pb::Usage| u.store_bytes;

    t.admin.register_image(register("root/q", "one:1", &[&a])).await.unwrap();
    // The same layer again, in another image, a subproject's, and composed: counted once.
    t.admin.register_image(register("root/q", "again:1", &[&a])).await.unwrap();
    t.admin.register_image(register("root/q/sub", "mine:1", &[&a, &b])).await.unwrap();
    let compose = pb::ComposeImageRequest {
        project: "root/q".into(),
        name: "both:1".into(),
        sources: vec!["one:1".into(), "root/q/sub//mine:1".into()],
        replace: false,
    };
    t.admin.compose_image(compose).await.unwrap();
    assert_eq!(used(usage(&t.admin, "root/q").await), 90);
    assert_eq!(used(usage(&t.admin, "root/q/sub").await), 90);
    assert_eq!(used(usage(&t.admin, "root").await), 90);
    // A new 60-byte layer would take root/q to 150: refused, and no image of that name.
    let e = t.admin.register_image(register("root/q/sub", "more:1", &[&c])).await.unwrap_err();
    assert_eq!(e.reason, Reason::QuotaExceeded, "{e}");
    assert_eq!(e.metadata.get("key").map(String::as_str), Some("store_bytes"), "{e:?}");
    let get = |name: &str| pb::GetImageRequest { project: "root/q/sub".into(), name: name.into() };
    assert_eq!(t.admin.get_image(get("more:1")).await.unwrap_err().reason, Reason::NotFound);
    assert_eq!(used(usage(&t.admin, "root/q").await), 90);
    // Deleting gives back what no other image names: b goes with mine:1 and both:1.
    for (p, n) in [("root/q/sub", "mine:1"), ("root/q", "both:1")] {
        t.admin.delete_image(pb::DeleteImageRequest { project: p.into(), name: n.into() }).await.unwrap();
    }
    assert_eq!(used(usage(&t.admin, "root/q").await), 60);
    // a is still named (one:1, again:1): c still does not fit; with a gone, it does.
    assert_eq!(
        t.admin.register_image(register("root/q/sub", "more:1", &[&c])).await.unwrap_err().reason,
        Reason::QuotaExceeded
    );
    for n in ["one:1", "again:1"] {
        t.admin.delete_image(pb::DeleteImageRequest { project: "root/q".into(), name: n.into() }).await.unwrap();
    }
    assert_eq!(used(usage(&t.admin, "root/q").await), 0);
    t.admin.register_image(register("root/q/sub", "more:1", &[&c])).await.unwrap();
    assert_eq!(used(usage(&t.admin, "root/q").await), 60);
    t.cluster.shutdown().await;
}
