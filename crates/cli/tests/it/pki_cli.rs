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
    ctl(&["pki", "init", d]).await.unwrap();
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
