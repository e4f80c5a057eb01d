//! `opendsec-agent aether ...` (PID 1 of a sandbox) or `opendsec-agent chronus ...` (one shell
//! session, started by aether).

use std::path::PathBuf;
use std::process::ExitCode;

use opendsec_agent::{aether, chronus};

const USAGE: &str = "usage: opendsec-agent aether (--socket PATH | --listen-fd N | --serial PORT) [--state-dir DIR] [--passwd PATH] [--session-bytes N] [--user U] [--workdir D]\n       opendsec-agent vm-init (PID 1 of a VM, from its initramfs)\n       opendsec-agent vm-agent (the agent as a service of a full VM's own init)\n       opendsec-agent hold-netns DIR (the edge's placeholder of a VM's network namespace)\n       opendsec-agent chronus --socket PATH --dir DIR [--session-bytes N]";

/// Blocking threads started up front (see `main`).
const BLOCKING_THREADS: usize = 2;

struct Args {
    mode: String,
    socket: Option<PathBuf>,
    listen_fd: Option<i32>,
    serial: Option<PathBuf>,
    state_dir: PathBuf,
    passwd: PathBuf,
    dir: Option<PathBuf>,
    session_bytes: u64,
    user: String,
    workdir: String,
}

fn parse() -> Result<Args, String> {
    let mut it = std::env::args().skip(1);
    let mut a = Args {
        mode: it.next().ok_or("no mode")?,
        socket: None,
        listen_fd: None,
        serial: None,
        state_dir: PathBuf::from("/run/opendsec-agent"),
        passwd: PathBuf::from("/etc/passwd"),
        dir: None,
        session_bytes: chronus::DEFAULT_SESSION_BUDGET,
        user: String::new(),
        workdir: String::new(),
    };
    while let Some(k) = it.next() {
        let v = it.next().ok_or_else(|| format!("{k} needs a value"))?;
        match k.as_str() {
            "--socket" => a.socket = Some(v.into()),
            "--serial" => a.serial = Some(v.into()),
            "--listen-fd" => a.listen_fd = Some(v.parse().map_err(|_| format!("bad --listen-fd {v}"))?),
            "--state-dir" => a.state_dir = v.into(),
            "--passwd" => a.passwd = v.into(),
            "--user" => a.user = v,
            "--workdir" => a.workdir = v,
            "--dir" => a.dir = Some(v.into()),
            "--session-bytes" => a.session_bytes = v.parse().map_err(|_| format!("bad --session-bytes {v}"))?,
            _ => return Err(format!("unknown option {k}")),
        }
    }
    Ok(a)
}

fn main() -> ExitCode {
    // The kernel runs the initramfs's /init with the words after `--` on its command line.
    if std::env::args().nth(1).as_deref() == Some("vm-init") {
        let e = opendsec_agent::vminit::main();
        // One line the edge watches the console for, to fail the creation at once.
        eprintln!("{} {e}", opendsec_proto::vmnet::INIT_FAILED);
        // PID 1 must not exit (the kernel panics): leave the reason on the console and wait
        // for the edge, which sees no agent, to stop the VM.
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
    // A full-init guest's agent service (vm-init made it a systemd unit).
    if std::env::args().nth(1).as_deref() == Some("vm-agent") {
        let e = opendsec_agent::vminit::service();
        eprintln!("opendsec-agent vm-agent: {e}");
        return ExitCode::FAILURE;
    }
    // The placeholder that keeps a VM's network namespace alive while its VMM is gone (a
    // paused microvm): started by the edge inside that namespace, under the VM's uid; it does
    // nothing until it is killed. Its argument (the VM's directory) names it for the edge.
    if std::env::args().nth(1).as_deref() == Some("hold-netns") {
        loop {
            std::thread::park();
        }
    }
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("opendsec-agent: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let listen = match (a.socket.clone(), a.listen_fd, a.serial.clone(), a.mode.as_str()) {
        (Some(p), None, None, _) => aether::Listen::Path(p),
        (None, Some(fd), None, "aether") => aether::Listen::Fd(fd),
        (None, None, Some(port), "aether") => aether::Listen::Serial(port),
        _ => {
            eprintln!(
                "opendsec-agent: give exactly one of --socket, --listen-fd and --serial (the last two aether only)\n{USAGE}"
            );
            return ExitCode::from(2);
        }
    };
    // Every thread the agent will need exists before the sandbox's workload can exhaust its
    // pids limit (a fork bomb): tokio panics when it cannot spawn a blocking thread while none
    // is alive, but queues the work when one is. The blocking threads are kept forever.
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .max_blocking_threads(64)
        .thread_keep_alive(std::time::Duration::from_secs(100 * 365 * 86400))
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("opendsec-agent: runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async {
        let warm: Vec<_> = (0..BLOCKING_THREADS)
            .map(|_| tokio::task::spawn_blocking(|| std::thread::sleep(std::time::Duration::from_millis(5))))
            .collect();
        for h in warm {
            let _ = h.await;
        }
    });
    let r = rt.block_on(async {
        match a.mode.as_str() {
            "aether" => {
                // Inside a sandbox (PID 1 on an inherited socket) the id goes where the
                // sandbox looks for it; a standalone aether (tests) keeps it in its state.
                let identity_file = match listen {
                    aether::Listen::Fd(_) | aether::Listen::Serial(_) => PathBuf::from(aether::IDENTITY_FILE),
                    aether::Listen::Path(_) => a.state_dir.join("sandbox-id"),
                };
                let cfg = aether::Config {
                    identity_file,
                    state_dir: a.state_dir,
                    passwd: a.passwd,
                    session_bytes: a.session_bytes,
                    default_user: a.user,
                    workdir: a.workdir,
                    // What PID 1 was started with: the image's variables and the sandbox's.
                    env: std::env::vars_os()
                        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
                        .collect(),
                };
                aether::main(listen, cfg).await
            }
            "chronus" => {
                let Some(dir) = a.dir else {
                    return Err(std::io::Error::other("chronus needs --dir"));
                };
                let aether::Listen::Path(socket) = listen else {
                    return Err(std::io::Error::other("chronus needs --socket"));
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
