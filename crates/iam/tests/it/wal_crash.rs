//! The standalone store under `kill -9`: a child process (this test binary, run as
//! `wal_crash::writer`) admits and releases leases from eight tasks and says what it starts and
//! what each call returned; the parent kills it at a random moment, reopens the IAM and checks
//! that every acknowledged admission is there unless a release of it was started, every
//! acknowledged release is gone, and usage counts exactly the leases there are. Twelve kills,
//! each after 50 to 400 ms, going on from the last one's store; at least one of them must have
//! left commits in the log that redb did not hold yet (so the log's replay is what is tested).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use opendsec_iam::{Iam, IamOptions, Quota, Resources};

const DIR_VAR: &str = "OPENDSEC_IAM_CRASH_DIR";
const ADMIN_TOKEN: &str = "dsk.admin01.AdminSecretAdminSecret0123456789";
const PROJECT: &str = "root/load";

fn options(dir: &std::path::Path) -> IamOptions {
    IamOptions {
        data_dir: dir.join("iam"),
        admin_principal: "admin".into(),
        admin_token: ADMIN_TOKEN.into(),
        reconcile_min_age: Duration::from_secs(60),
        commit_batch_max: 256,
    }
}

fn res() -> Resources {
    Resources { cpu_millis: 10, memory_mb: 16, disk_mb: 0, gpus: 0 }
}

/// The child, started by the test below (with `--ignored`): not a test of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "the writer process of iam_commits_survive_kill_9_at_any_moment, which starts it"]
async fn writer() {
    let dir = std::path::PathBuf::from(std::env::var(DIR_VAR).expect("started by the test"));
    let run = std::env::var("OPENDSEC_IAM_CRASH_RUN").unwrap();
    let token = std::fs::read_to_string(dir.join("token")).unwrap();
    let iam = Iam::open(options(&dir)).unwrap();
    println!("open");
    let tasks: Vec<_> = (0..8)
        .map(|t| {
            let (iam, token, run) = (iam.clone(), token.clone(), run.clone());
            tokio::spawn(async move {
                let mut mine: Vec<String> = Vec::new();
                for i in 0u64.. {
                    if i % 3 == 2
                        && let Some(lease) = mine.pop()
                    {
                        println!("start release {lease}");
                        iam.release_leases(vec![lease.clone()], "").await.unwrap();
                        println!("acked release {lease}");
                        continue;
                    }
                    let lease = format!("r{run}-t{t}-{i}");
                    println!("start admit {lease}");
                    iam.admit(&token, &lease, PROJECT, res(), "e1", false, Vec::new(), "").await.unwrap();
                    println!("acked admit {lease}");
                    mine.push(lease);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
}

#[tokio::test]
async fn iam_commits_survive_kill_9_at_any_moment() {
    let dir = tempfile::tempdir().unwrap();
    {
        let iam = Iam::open(options(dir.path())).unwrap();
        let admin = iam.authenticate(ADMIN_TOKEN).unwrap();
        iam.create_project(&admin, PROJECT, Quota::default()).await.unwrap();
        iam.create_principal(&admin, "loader", PROJECT).await.unwrap();
        let grant = opendsec_iam::GrantRecord {
            principal: "loader".into(),
            project: PROJECT.into(),
            permission: "sandbox.create".into(),
        };
        iam.grant(&admin, grant).await.unwrap();
        let token = iam.create_token(&admin, "loader", 0, "test").await.unwrap().0;
        std::fs::write(dir.path().join("token"), token).unwrap();
    }
    // Leases there must be (acknowledged, no release started) and must not be.
    let (mut present, mut absent) = (BTreeSet::new(), BTreeSet::new());
    let mut replayed = 0;
    for run in 1..=12u64 {
        let env = [(DIR_VAR, dir.path().display().to_string()), ("OPENDSEC_IAM_CRASH_RUN", run.to_string())];
        let after = Duration::from_millis(50 + rand::random::<u64>() % 351);
        let lines = opendsec_testkit::run_and_kill("wal_crash::writer", &env, after);

        let mut started_release = BTreeSet::new();
        let mut acked = 0;
        for l in &lines {
            match l.split(' ').collect::<Vec<_>>().as_slice() {
                ["acked", "admit", lease] => {
                    acked += 1;
                    present.insert(lease.to_string());
                }
                ["start", "release", lease] => {
                    started_release.insert(lease.to_string());
                }
                ["acked", "release", lease] => {
                    absent.insert(lease.to_string());
                }
                // The last line may be cut by the kill.
                _ => {}
            }
        }
        for l in &started_release {
            present.remove(l);
        }
        let (_, frames) = opendsec_iam::wal::Wal::open(&dir.path().join("iam")).unwrap();
        replayed += usize::from(!frames.is_empty());

        let iam = Iam::open(options(dir.path())).unwrap();
        let st = iam.read(|s| s.clone());
        let leases: BTreeMap<&str, &str> = st.leases().map(|l| (l.id.as_str(), l.project.as_str())).collect();
        for l in &present {
            assert!(leases.contains_key(l.as_str()), "run {run}: acknowledged lease {l} is missing");
        }
        for l in &absent {
            assert!(!leases.contains_key(l.as_str()), "run {run}: released lease {l} is back");
        }
        let usage = st.usage(PROJECT).unwrap();
        assert_eq!(usage.sandboxes, leases.len() as u64, "run {run}: usage against leases");
        assert_eq!(usage.cpu_millis, 10 * leases.len() as u64, "run {run}");
        assert!(acked > 0 || !lines.iter().any(|l| l == "open"), "run {run}: nothing acknowledged: {lines:?}");
        drop(iam);
    }
    assert!(replayed > 0, "no kill left commits in the log: the replay was not exercised");
    assert!(present.len() > 100, "too little was written to test: {}", present.len());
}
