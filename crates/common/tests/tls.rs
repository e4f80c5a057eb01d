//! TLS through real servers and clients on 127.0.0.1: a rotated certificate is served without a
//! restart (new connections get the new one, the open ones go on), a server with another
//! identity is refused by a client that meant someone else, and the role table answers before
//! a method runs.
use std::sync::Arc;
use std::time::Duration;

use opendsec_common::grpc;
use opendsec_common::pki::{self, Identity, Role};
use opendsec_common::tls::Credentials;
use opendsec_proto::v1 as pb;
use tonic::{Request, Response, Status};

struct Watcher;

#[tonic::async_trait]
impl pb::watcher_server::Watcher for Watcher {
    async fn get_snapshot(&self, r: Request<pb::GetSnapshotRequest>) -> Result<Response<pb::ClusterSnapshot>, Status> {
        // Answers with who called, as the role table saw it.
        let who = opendsec_common::acl::peer(&r).map(|p| p.to_string()).unwrap_or_default();
        Ok(Response::new(pb::ClusterSnapshot { version: who.len() as u64, ..Default::default() }))
    }
    async fn register_edge(
        &self,
        _: Request<pb::RegisterEdgeRequest>,
    ) -> Result<Response<pb::RegisterEdgeResponse>, Status> {
        Ok(Response::new(pb::RegisterEdgeResponse {}))
    }
}

fn id(role: Role, name: &str) -> Identity {
    Identity::new(role, name).unwrap()
}

/// The SHA-256 of the certificate a TLS server at `addr` presents.
async fn served_cert(addr: &str, client: &Arc<Credentials>) -> Vec<u8> {
    use sha2::Digest;
    let tls =
        opendsec_common::tls::connect(addr, client.client_config(), opendsec_common::tls::expect(Role::Watcher, None))
            .await
            .unwrap();
    let (_, conn) = tls.get_ref();
    sha2::Sha256::digest(conn.peer_certificates().unwrap()[0].as_ref()).to_vec()
}

#[tokio::test]
async fn a_rotated_certificate_is_served_without_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let pki_dir = dir.path();
    pki::local_pki(pki_dir, &[id(Role::Watcher, "0"), id(Role::Apiserver, "0")], Duration::from_secs(3600)).unwrap();
    let server = Credentials::in_dir(pki_dir, &id(Role::Watcher, "0")).unwrap();
    let client = Credentials::in_dir(pki_dir, &id(Role::Apiserver, "0")).unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let router = grpc::internal_server().add_service(pb::watcher_server::WatcherServer::new(Watcher));
    let s = server.clone();
    tokio::spawn(async move { grpc::serve_internal(router, l, &s, std::future::pending()).await });

    let links = grpc::Links::new(client.clone());
    let mut open = pb::watcher_client::WatcherClient::new(links.channel(&addr, Role::Watcher, None).unwrap());
    let who = open.get_snapshot(pb::GetSnapshotRequest {}).await.unwrap().into_inner();
    assert_eq!(who.version, "apiserver/0".len() as u64, "the handler sees its caller");
    let before = served_cert(&addr, &client).await;

    // Rotate both ends' certificates in place (new keys); past the reload check, new
    // connections see the new certificate, and the open channel goes on working.
    pki::rotate(pki_dir, &pki::bundle_path(pki_dir, &id(Role::Watcher, "0"))).unwrap();
    pki::rotate(pki_dir, &pki::bundle_path(pki_dir, &id(Role::Apiserver, "0"))).unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let after = served_cert(&addr, &client).await;
    assert_ne!(before, after, "the server still presents the old certificate");
    open.get_snapshot(pb::GetSnapshotRequest {}).await.unwrap();
    let fresh = grpc::Links::new(Credentials::in_dir(pki_dir, &id(Role::Apiserver, "0")).unwrap());
    let mut c = pb::watcher_client::WatcherClient::new(fresh.channel(&addr, Role::Watcher, None).unwrap());
    c.get_snapshot(pb::GetSnapshotRequest {}).await.unwrap();

    // A broken bundle is not loaded: the server keeps serving the last good one.
    std::fs::write(pki::bundle_path(pki_dir, &id(Role::Watcher, "0")), b"not a certificate").unwrap();
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(served_cert(&addr, &client).await, after);

    // The client checks whom it reached: this server is no edge, and no IAM.
    for (role, name) in [(Role::Edge, Some("e1")), (Role::Iam, None)] {
        let mut c = pb::watcher_client::WatcherClient::new(links.channel(&addr, role, name).unwrap());
        assert!(c.get_snapshot(pb::GetSnapshotRequest {}).await.is_err(), "{role}");
    }
}

/// One source address holds at most `per_source` connections of a server: one over the cap is
/// closed at once, and the slot comes back when a held one closes.
#[tokio::test]
async fn one_source_holds_at_most_its_share_of_connections() {
    let dir = tempfile::tempdir().unwrap();
    pki::local_pki(dir.path(), &[id(Role::Watcher, "0"), id(Role::Apiserver, "0")], Duration::from_secs(3600)).unwrap();
    let server = Credentials::in_dir(dir.path(), &id(Role::Watcher, "0")).unwrap();
    let client = Credentials::in_dir(dir.path(), &id(Role::Apiserver, "0")).unwrap();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let incoming =
        opendsec_common::tls::incoming(l, server.server_config(true), 64, 3, opendsec_common::tls::HTTP2_OPENING);
    let router = grpc::server().add_service(pb::watcher_server::WatcherServer::new(Watcher));
    tokio::spawn(async move { router.serve_with_incoming_shutdown(incoming, std::future::pending()).await });
    let expect = || opendsec_common::tls::expect(Role::Watcher, None);

    // Three handshaken connections that send nothing hold the source's three slots.
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(opendsec_common::tls::connect(&addr, client.client_config(), expect()).await.unwrap());
    }
    let over = opendsec_common::tls::connect(&addr, client.client_config(), expect()).await;
    assert!(over.is_err(), "a fourth connection from the same address got through");
    // One closes: a real client gets its slot and an answer.
    drop(idle.pop());
    tokio::time::sleep(Duration::from_millis(100)).await;
    let links = grpc::Links::new(client.clone());
    let mut c = pb::watcher_client::WatcherClient::new(links.channel(&addr, Role::Watcher, None).unwrap());
    c.get_snapshot(pb::GetSnapshotRequest {}).await.unwrap();
}
