//! `opendsecctl pki init|issue|rotate|show` as the command line runs them: files, modes,
//! identities, refusals.
use std::os::unix::fs::PermissionsExt;

use clap::Parser;
use opendsec_cli::ctl::{Cli, CtlError, run};
use opendsec_common::pki;

async fn ctl(args: &[&str]) -> Result<i32, CtlError> {
    let mut argv = vec!["opendsecctl", "--json"];
    argv.extend_from_slice(args);
    run(Cli::try_parse_from(argv).expect("a valid command line")).await
}

fn mode(p: &std::path::Path) -> u32 {
    std::fs::metadata(p).unwrap().permissions().mode() & 0o777
}

#[tokio::test]
async fn init_issue_show_and_rotate() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("pki");
    let d = dir.to_str().unwrap();
    ctl(&["pki", "init", d, "--dns", "example.com", "--ip", "10.0.0.0/16"]).await.unwrap();
    assert_eq!(mode(&dir.join("ca.key")), 0o600);
    assert_eq!(mode(&dir), 0o700);
    assert!(
        ctl(&["pki", "init", d]).await.unwrap_err().to_string().contains("--force"),
        "a CA is never replaced silently"
    );

    ctl(&["pki", "issue", "--ca-dir", d, "--id", "edge/node-1", "--lifetime", "2h"]).await.unwrap();
    let bundle = dir.join("edge-node-1.pem");
    assert_eq!(mode(&bundle), 0o600);
    let info = pki::inspect(&bundle).unwrap();
    assert_eq!(info.identity.uri(), "opendsec://edge/node-1");
    assert!(info.names.dns.is_empty(), "internal certificates need no DNS names");
    let api = t.path().join("api.pem");
    ctl(&[
        "pki",
        "issue",
        "--ca-dir",
        d,
        "--id",
        "apiserver/0",
        "--dns",
        "api.example.com",
        "--out",
        api.to_str().unwrap(),
    ])
    .await
    .unwrap();
    let info = pki::inspect(&api).unwrap();
    assert!(
        info.names.dns.contains(&pki::PUBLIC_NAME.to_string()) && info.names.dns.contains(&"api.example.com".into())
    );
    ctl(&["pki", "show", api.to_str().unwrap()]).await.unwrap();

    // Names outside what the CA was made for are refused (clients would refuse the leaf), and
    // the apiserver's public name is the apiserver's alone.
    for (id, flag, name) in [
        ("apiserver/1", "--dns", "api.example.org"),
        ("gateway/1", "--ip", "10.1.0.1"),
        ("apiserver/1", "--ip", "10.0.0.1"),
        ("gateway/0", "--dns", pki::PUBLIC_NAME),
    ] {
        let e = ctl(&["pki", "issue", "--ca-dir", d, "--id", id, flag, name]).await.unwrap_err().to_string();
        assert!(e.contains(name) || e.contains("only an apiserver") || e.contains("no addresses"), "{e}");
    }
    ctl(&["pki", "issue", "--ca-dir", d, "--id", "gateway/0", "--dns", "e2b.example.com", "--ip", "10.0.3.4"])
        .await
        .unwrap();
    let gw = pki::inspect(&dir.join("gateway-0.pem")).unwrap();
    assert!(!gw.names.dns.contains(&pki::PUBLIC_NAME.to_string()), "{:?}", gw.names);

    let before = std::fs::read(&bundle).unwrap();
    ctl(&["pki", "rotate", "--ca-dir", d, bundle.to_str().unwrap()]).await.unwrap();
    assert_ne!(std::fs::read(&bundle).unwrap(), before);
    assert_eq!(pki::inspect(&bundle).unwrap().identity.uri(), "opendsec://edge/node-1");

    for bad in ["edge", "king/x", "edge/Node_1", "edge/../x"] {
        assert!(ctl(&["pki", "issue", "--ca-dir", d, "--id", bad]).await.is_err(), "{bad}");
    }
    let nope = t.path().join("nope");
    assert!(ctl(&["pki", "issue", "--ca-dir", nope.to_str().unwrap(), "--id", "iam/0"]).await.is_err());
}

/// A TLS listener on loopback presenting `bundle` (HTTP/2 offered): counts completed
/// handshakes and the bytes that followed them.
struct Listener {
    addr: std::net::SocketAddr,
    handshakes: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    received: std::sync::Arc<std::sync::Mutex<Vec<u8>>>,
}

async fn listener(dir: &std::path::Path, bundle: &std::path::Path) -> Listener {
    use std::sync::atomic::Ordering;
    use tokio::io::AsyncReadExt;
    let id = pki::inspect(bundle).unwrap().identity;
    let creds = opendsec_common::tls::Credentials::load(opendsec_common::tls::TlsFiles {
        ca: dir.join(pki::CA_CERT),
        bundle: bundle.to_path_buf(),
    })
    .unwrap();
    assert_eq!(creds.identity(), Some(id));
    let acceptor = tokio_rustls::TlsAcceptor::from(creds.server_config(false));
    let tcp = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = tcp.local_addr().unwrap();
    let handshakes = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let received = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let (h, r) = (handshakes.clone(), received.clone());
    tokio::spawn(async move {
        while let Ok((s, _)) = tcp.accept().await {
            let (acceptor, h, r) = (acceptor.clone(), h.clone(), r.clone());
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(s).await else { return };
                h.fetch_add(1, Ordering::SeqCst);
                let mut buf = [0u8; 4096];
                while let Ok(Ok(n)) = tokio::time::timeout(std::time::Duration::from_secs(2), tls.read(&mut buf)).await
                {
                    if n == 0 {
                        break;
                    }
                    r.lock().unwrap().extend_from_slice(&buf[..n]);
                }
            });
        }
    });
    Listener { addr, handshakes, received }
}

/// A gateway's certificate (same CA, loopback names) at the apiserver's address: the Rust
/// client and `opendsecctl` refuse it in the handshake, whatever name they check, and send
/// no token; an apiserver's certificate on the same kind of listener is accepted (the
/// control, so the test can fail).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_certificate_at_the_api_address_gets_no_token() {
    use std::sync::atomic::Ordering;
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("pki");
    let ids: Vec<pki::Identity> =
        ["apiserver/0", "gateway/0"].iter().map(|s| pki::Identity::parse(s).unwrap()).collect();
    pki::local_pki(&dir, &ids, std::time::Duration::from_secs(3600)).unwrap();
    let ca = std::fs::read(dir.join(pki::CA_CERT)).unwrap();
    let token = "dsk.probe.0123456789abcdefABCDEF";

    let gw = listener(&dir, &pki::bundle_path(&dir, &ids[1])).await;
    // The Rust client, with the default name and with names the gateway does carry.
    for name in [None, Some("localhost")] {
        let tls = opendsec_common::grpc::PublicTls::with_ca(&ca, name).unwrap();
        let c = opendsec_client::Client::new(&[gw.addr.to_string()], Some(token), &tls)
            .unwrap()
            .with_retry_timeout(std::time::Duration::ZERO);
        let e = c.who_am_i(Default::default()).await.expect_err("a gateway is not an apiserver");
        assert_eq!(e.reason, opendsec_common::Reason::Unavailable, "{e}");
    }
    // opendsecctl, as a user runs it.
    let out = tokio::process::Command::new(env!("CARGO_BIN_EXE_opendsecctl"))
        .arg("whoami")
        .env("OPENDSEC_ADDR", gw.addr.to_string())
        .env("OPENDSEC_CA", dir.join(pki::CA_CERT))
        .env("OPENDSEC_TOKEN", token)
        .env("OPENDSEC_TLS_NAME", "localhost")
        .output()
        .await
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("not an apiserver"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    assert_eq!(gw.handshakes.load(Ordering::SeqCst), 0, "a handshake with the gateway's certificate completed");
    assert!(gw.received.lock().unwrap().is_empty());

    // The control: the apiserver's certificate is accepted, and the client then speaks.
    let api = listener(&dir, &pki::bundle_path(&dir, &ids[0])).await;
    let tls = opendsec_common::grpc::PublicTls::with_ca(&ca, None).unwrap();
    let c = opendsec_client::Client::new(&[api.addr.to_string()], Some(token), &tls)
        .unwrap()
        .with_retry_timeout(std::time::Duration::ZERO);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), c.who_am_i(Default::default())).await;
    assert!(api.handshakes.load(Ordering::SeqCst) >= 1);
    assert!(api.received.lock().unwrap().starts_with(b"PRI * HTTP/2.0"));
}
