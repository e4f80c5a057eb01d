//! A real S3-compatible server for tests: moto's server mode (`make s3-server` installs it in
//! `target/s3-venv`), started on a free loopback port, with one bucket made, stopped on drop.
//! Its Python (boto3 beside it) also lets a test put or read objects directly, as an attacker
//! with the store's keys would.

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub const ACCESS_KEY: &str = "test";
pub const SECRET_KEY: &str = "test";
pub const REGION: &str = "us-east-1";

#[derive(Debug)]
pub struct S3Server {
    child: Child,
    pub endpoint: String,
    pub bucket: String,
    venv: PathBuf,
}

fn venv() -> PathBuf {
    match std::env::var_os("OPENDSEC_S3_VENV") {
        Some(v) => PathBuf::from(v),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/s3-venv"),
    }
}

impl S3Server {
    /// Starts the server and makes `bucket`. Panics (never skips) when moto is missing.
    pub fn start(bucket: &str) -> S3Server {
        let venv = venv();
        let exe = venv.join("bin/moto_server");
        assert!(exe.exists(), "{} is missing: run `make s3-server`", exe.display());
        let mut child = Command::new(&exe)
            .args(["-H", "127.0.0.1", "-p", "0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start moto_server");
        let stderr = child.stderr.take().expect("moto's stderr");
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut sent = false;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if !sent && let Some(at) = line.find("http://127.0.0.1:") {
                    let url: String = line[at..].chars().take_while(|c| !c.is_whitespace()).collect();
                    let _ = tx.send(url);
                    sent = true;
                }
            }
        });
        let endpoint = rx.recv_timeout(Duration::from_secs(30)).expect("moto_server did not say where it listens");
        let s = S3Server { child, endpoint, bucket: bucket.to_string(), venv };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match s.python(&format!("c.create_bucket(Bucket={bucket:?})")) {
                Ok(_) => break,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("creating bucket {bucket}: {e}"),
            }
        }
        s
    }

    /// Runs `code` with `c` a boto3 S3 client of this server; returns its stdout.
    pub fn python(&self, code: &str) -> Result<String, String> {
        let prelude = format!(
            "import boto3, sys\nc = boto3.client('s3', endpoint_url={:?}, aws_access_key_id={ACCESS_KEY:?}, \
             aws_secret_access_key={SECRET_KEY:?}, region_name={REGION:?})\n",
            self.endpoint
        );
        let out = Command::new(self.venv.join("bin/python"))
            .args(["-c", &format!("{prelude}{code}")])
            .output()
            .map_err(|e| e.to_string())?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The keys in the bucket.
    pub fn keys(&self) -> Vec<String> {
        let code = format!("for o in c.list_objects_v2(Bucket={:?}).get('Contents', []): print(o['Key'])", self.bucket);
        self.python(&code).expect("list the bucket").lines().map(str::to_string).collect()
    }

    /// Replaces object `key` with `data`.
    pub fn put(&self, key: &str, data: &[u8]) {
        let hex: String = data.iter().map(|b| format!("{b:02x}")).collect();
        let code = format!("c.put_object(Bucket={:?}, Key={key:?}, Body=bytes.fromhex({hex:?}))", self.bucket);
        self.python(&code).expect("put an object");
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
