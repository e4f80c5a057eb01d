//! The E2B gateway's listener: HTTPS/1.1 with a `gateway` certificate when the cluster has
//! TLS (checked against the cluster's CA, by name and by address; a certificate that opens
//! nothing inside the cluster), nothing answered in plain text there, a handshaken but silent
//! connection cut; plain HTTP only on a cluster without TLS. (The E2B SDKs over this listener: tests/e2b.)

use crate::common;

use std::sync::Arc;
use std::time::Duration;

use rustls_pki_types::ServerName;
use rustls_pki_types::pem::PemObject;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

fn client_config(ca: &std::path::Path) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pki_types::CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut cfg = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    cfg.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Arc::new(cfg)
}

fn request(path: &str, key: &str) -> Vec<u8> {
    format!("GET {path} HTTP/1.1\r\nHost: gateway\r\nX-API-Key: {key}\r\nConnection: close\r\n\r\n").into_bytes()
}

async fn read_all(s: &mut (impl AsyncReadExt + Unpin)) -> String {
    let mut out = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut out)).await.expect("the answer ends");
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_speaks_https_with_a_certificate_of_its_own() {
    let tc = common::start(1, |_| {}).await;
    let addr = tc.cluster.e2b_addr.expect("a gateway");
    let tls = tokio_rustls::TlsConnector::from(client_config(&tc.cluster.ca_path));

    // By address and by name (the apiserver's certificate carries both), HTTP/1.1 chosen.
    for name in [ServerName::IpAddress(addr.ip().into()), ServerName::try_from("localhost").unwrap()] {
        let tcp = TcpStream::connect(addr).await.unwrap();
        let mut s = tls.connect(name, tcp).await.expect("the handshake with the cluster's CA");
        assert_eq!(s.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
        s.write_all(&request("/v2/sandboxes", &tc.cluster.admin_token)).await.unwrap();
        let answer = read_all(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("[]"), "{answer}");
    }

    // Another CA's client does not get through the handshake.
    let other = tempfile::tempdir().unwrap();
    opendsec_common::pki::init_ca(other.path(), false).unwrap();
    let stranger = tokio_rustls::TlsConnector::from(client_config(&other.path().join("ca.pem")));
    let tcp = TcpStream::connect(addr).await.unwrap();
    assert!(stranger.connect(ServerName::try_from("localhost").unwrap(), tcp).await.is_err());

    // A plain-text request on the TLS port gets no HTTP answer: a key sent in the clear is
    // never taken.
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(&request("/v2/sandboxes", &tc.cluster.admin_token)).await.unwrap();
    let answer = read_all(&mut tcp).await;
    assert!(!answer.contains("HTTP/1.1"), "{answer}");

    // A client that completes the handshake and then says nothing is cut.
    let tcp = TcpStream::connect(addr).await.unwrap();
    let mut s = tls.connect(ServerName::try_from("localhost").unwrap(), tcp).await.unwrap();
    assert_eq!(read_all(&mut s).await, "");

    // The gateway's own certificate opens nothing inside the cluster: IAM refuses it.
    use opendsec_common::pki::{Identity, Role};
    let pki_dir = tc.cluster.config.pki_dir();
    let creds = opendsec_common::tls::Credentials::in_dir(&pki_dir, &Identity::new(Role::Gateway, "0").unwrap())
        .expect("cluster up issued the gateway's bundle");
    let links = opendsec_common::grpc::Links::new(creds);
    let ch = links.channel(&tc.cluster.config.iam.addrs[0], Role::Iam, None).unwrap();
    let e = opendsec_proto::v1::iam_client::IamClient::new(ch)
        .get_epoch(opendsec_proto::v1::GetEpochRequest {})
        .await
        .expect_err("a gateway may not call IAM");
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e}");

    // The trust bundle ends with the cluster's CA (after the system's, where it has them).
    let bundle = std::fs::read_to_string(tc.cluster.trust_bundle_path.as_ref().expect("a trust bundle")).unwrap();
    let ca = std::fs::read_to_string(&tc.cluster.ca_path).unwrap();
    assert!(bundle.ends_with(&ca));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_tls_the_gateway_speaks_plain_http_on_loopback() {
    let tc = common::start(1, |c| c.apiserver.insecure_plaintext = true).await;
    let addr = tc.cluster.e2b_addr.expect("a gateway");
    assert!(addr.ip().is_loopback());
    assert!(tc.cluster.trust_bundle_path.is_none());
    let mut tcp = TcpStream::connect(addr).await.unwrap();
    tcp.write_all(&request("/v2/sandboxes", &tc.cluster.admin_token)).await.unwrap();
    let answer = read_all(&mut tcp).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}
