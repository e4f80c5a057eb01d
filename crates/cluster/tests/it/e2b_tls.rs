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
    opendsec_common::pki::init_ca(other.path(), false, &Default::default()).unwrap();
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
        .get_epoch(opendsec_proto::v1::GetEpochRequest::default())
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

/// Sends one keep-alive request on `s` and reads its whole answer (a JSON body of known
/// length), leaving the connection open.
async fn keep_alive_request(s: &mut (impl AsyncReadExt + AsyncWriteExt + Unpin), key: &str) -> String {
    let req = format!("GET /v2/sandboxes HTTP/1.1\r\nHost: gateway\r\nX-API-Key: {key}\r\n\r\n");
    s.write_all(req.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(30), s.read(&mut buf)).await.expect("an answer").unwrap();
        assert!(n > 0, "the connection closed before the answer: {}", String::from_utf8_lossy(&got));
        got.extend_from_slice(&buf[..n]);
        let text = String::from_utf8_lossy(&got);
        if let Some(head_end) = text.find("\r\n\r\n") {
            let len = text[..head_end]
                .lines()
                .find_map(|l| l.to_ascii_lowercase().strip_prefix("content-length:").map(|v| v.trim().parse::<usize>()))
                .expect("a content-length")
                .unwrap();
            if got.len() >= head_end + 4 + len {
                return text.into_owned();
            }
        }
    }
}

/// Whether the server closes `s` within `within` (a read sees EOF or an error).
async fn closed_within(s: &mut (impl AsyncReadExt + Unpin), within: Duration) -> bool {
    let mut buf = [0u8; 64];
    matches!(tokio::time::timeout(within, s.read(&mut buf)).await, Ok(Ok(0)) | Ok(Err(_)))
}

/// One source may hold only so many connections to the gateway (`e2b.max_connections_per_source`),
/// and a connection idle between requests, or sending its headers slowly, is closed after
/// `e2b.idle_timeout`. Before, one client could hold all 16,384 of the gateway's connections,
/// each for ever after its first 16 bytes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_bounds_connections_per_source_and_closes_idle_ones() {
    let tc = common::start(1, |c| {
        c.e2b.max_connections_per_source = 4;
        c.e2b.idle_timeout = Duration::from_secs(2);
    })
    .await;
    let addr = tc.cluster.e2b_addr.expect("a gateway");
    let tls = tokio_rustls::TlsConnector::from(client_config(&tc.cluster.ca_path));
    let name = || ServerName::try_from("localhost").unwrap();
    let key = tc.cluster.admin_token.clone();

    // Four connections from 127.0.0.1 are served and stay open between requests.
    let mut held = Vec::new();
    for _ in 0..4 {
        let mut s = tls.connect(name(), TcpStream::connect(addr).await.unwrap()).await.unwrap();
        assert!(keep_alive_request(&mut s, &key).await.starts_with("HTTP/1.1 200"));
        held.push(s);
    }
    // A fifth from the same source is closed at once; one from another loopback address is not.
    let fifth = tls.connect(name(), TcpStream::connect(addr).await.unwrap()).await;
    match fifth {
        Err(_) => {}
        Ok(mut s) => assert!(closed_within(&mut s, Duration::from_secs(5)).await, "a fifth connection was kept"),
    }
    let other = tokio::net::TcpSocket::new_v4().unwrap();
    other.bind("127.0.0.2:0".parse().unwrap()).unwrap();
    let mut s = tls.connect(name(), other.connect(addr).await.unwrap()).await.unwrap();
    assert!(keep_alive_request(&mut s, &key).await.starts_with("HTTP/1.1 200"));

    // Idle past the timeout, every held connection is closed by the gateway, and their slots
    // are free again.
    for s in &mut held {
        assert!(closed_within(s, Duration::from_secs(10)).await, "an idle keep-alive connection was kept");
    }
    let mut s = tls.connect(name(), TcpStream::connect(addr).await.unwrap()).await.unwrap();
    assert!(keep_alive_request(&mut s, &key).await.starts_with("HTTP/1.1 200"));

    // Headers sent a byte at a time, slower than the timeout allows, are cut off.
    let mut slow = tls.connect(name(), TcpStream::connect(addr).await.unwrap()).await.unwrap();
    let req = format!("GET /v2/sandboxes HTTP/1.1\r\nHost: gateway\r\nX-API-Key: {key}\r\n");
    let started = std::time::Instant::now();
    let mut cut = false;
    for b in req.bytes().cycle() {
        if slow.write_all(&[b]).await.is_err() || slow.flush().await.is_err() {
            cut = true;
            break;
        }
        if closed_within(&mut slow, Duration::from_millis(250)).await {
            cut = true;
            break;
        }
        assert!(started.elapsed() < Duration::from_secs(30), "slow headers were never cut");
    }
    assert!(cut);
}

/// A TLS connection to the gateway from loopback address `from`.
async fn connect_from(
    tls: &tokio_rustls::TlsConnector,
    addr: std::net::SocketAddr,
    from: &str,
) -> tokio_rustls::client::TlsStream<TcpStream> {
    let sock = tokio::net::TcpSocket::new_v4().unwrap();
    sock.bind(format!("{from}:0").parse().unwrap()).unwrap();
    tls.connect(ServerName::try_from("localhost").unwrap(), sock.connect(addr).await.unwrap()).await.unwrap()
}

/// 1,000 junk keys through the gateway from one client pause that client, at the gateway
/// and at the apiserver (which learns the client's address from the gateway, believed only
/// from a gateway's certificate), and nobody else: a fresh valid key from another client
/// works at once, as does a key the flooding client used successfully before. Before, the
/// apiserver counted every E2B caller as the gateway's own address and paused them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_guessing_keys_through_the_gateway_locks_out_only_itself() {
    let tc = common::start(1, |_| {}).await;
    let addr = tc.cluster.e2b_addr.expect("a gateway");
    let tls = tokio_rustls::TlsConnector::from(client_config(&tc.cluster.ca_path));
    let admin_key = tc.cluster.admin_token.clone();

    // The attacker, on 127.0.0.2, first uses a key of its own that works.
    let mut attacker = connect_from(&tls, addr, "127.0.0.2").await;
    assert!(keep_alive_request(&mut attacker, &admin_key).await.starts_with("HTTP/1.1 200"));
    // Then 1,000 junk keys, all refused.
    for i in 0..1000 {
        let junk = format!("dsk.junk{i}.0123456789abcdefghijklmnop");
        let answer = keep_alive_request(&mut attacker, &junk).await;
        assert!(answer.starts_with("HTTP/1.1 401"), "{answer}");
    }
    // The attacker is paused: a new key of its own is refused without a word to the
    // apiserver; the key that worked before still works (one address can be many clients).
    let fresh = common::principal(&tc.admin, "eve", "root", &["sandbox.view"]).await;
    let answer = keep_alive_request(&mut attacker, &fresh).await;
    assert!(answer.starts_with("HTTP/1.1 401") && answer.contains("too many failed"), "{answer}");
    assert!(keep_alive_request(&mut attacker, &admin_key).await.starts_with("HTTP/1.1 200"));

    // Another client, with a key never seen before, is served at once.
    let alice = common::principal(&tc.admin, "alice", "root", &["sandbox.view"]).await;
    let mut other = connect_from(&tls, addr, "127.0.0.1").await;
    let answer = keep_alive_request(&mut other, &alice).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
}
