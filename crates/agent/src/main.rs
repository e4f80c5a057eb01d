//! `opendsec-agent aether ...` (PID 1 of a sandbox) or `opendsec-agent chronus ...` (one shell
//! session, started by aether).

use std::path::PathBuf;
use std::process::ExitCode;

use opendsec_agent::{aether, chronus};

const USAGE: &str = "usage: opendsec-agent aether --socket PATH [--state-dir DIR] [--passwd PATH] [--session-bytes N]\n       opendsec-agent chronus --socket PATH --dir DIR [--session-bytes N]";

struct Args {
    mode: String,
    socket: Option<PathBuf>,
    state_dir: PathBuf,
    passwd: PathBuf,
    dir: Option<PathBuf>,
    session_bytes: u64,
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        mode: it.next().ok_or("no mode")?,
        socket: None,
        state_dir: PathBuf::from("/run/opendsec-agent"),
        passwd: PathBuf::from("/etc/passwd"),
        dir: None,
        session_bytes: chronus::DEFAULT_SESSION_BUDGET,
    };
    while let Some(k) = it.next() {
        let v = it.next().ok_or_else(|| format!("{k} needs a value"))?;
        match k.as_str() {
            "--socket" => a.socket = Some(v.into()),
            "--state-dir" => a.state_dir = v.into(),
            "--passwd" => a.passwd = v.into(),
            "--dir" => a.dir = Some(v.into()),
            "--session-bytes" => a.session_bytes = v.parse().map_err(|_| format!("bad --session-bytes {v}"))?,
            _ => return Err(format!("unknown option {k}")),
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("opendsec-agent: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let Some(socket) = a.socket.clone() else {
        eprintln!("opendsec-agent: --socket is required\n{USAGE}");
        return ExitCode::from(2);
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("opendsec-agent: runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let r = rt.block_on(async {
        match a.mode.as_str() {
            "aether" => {
                let cfg = aether::Config { state_dir: a.state_dir, passwd: a.passwd, session_bytes: a.session_bytes };
                aether::main(&socket, cfg).await
            }
            "chronus" => {
                let Some(dir) = a.dir else {
                    return Err(std::io::Error::other("chronus needs --dir"));
                };
                chronus::main(socket, dir, a.session_bytes).await
            }
            m => Err(std::io::Error::other(format!("unknown mode {m}"))),
        }
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("opendsec-agent {}: {e}", a.mode);
            ExitCode::FAILURE
        }
    }
}
