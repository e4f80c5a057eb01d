//! opendsecctl: see `opendsec_cli::ctl`.

fn main() {
    // `cluster up` edges with the container backend re-execute this binary as a sandbox's
    // setup process: it must branch off before any thread or runtime exists, and never returns.
    opendsec_edge::linuxrt::init::run_if_init();
    opendsec_common::init_tracing_quiet();
    let cli = <opendsec_cli::ctl::Cli as clap::Parser>::parse();
    // Commands that print die quietly when a reader such as `head` closes the pipe, as Unix
    // tools do, instead of panicking in println!. Not `cluster up`: it serves, and a write to
    // a peer that just went away (an agent whose sandbox was stopped) must be an EPIPE error
    // on that connection, not the end of the whole cluster.
    if cli.serves() {
        opendsec_cli::raise_fd_limit();
    } else {
        // SAFETY: before the runtime (and any thread) starts; SIG_DFL is a valid disposition.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let has_token = cli.token.as_deref().is_some_and(|t| !t.is_empty());
    let cx = opendsec_cli::ctl::HintContext { addr: cli.addr.clone(), has_token };
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    match rt.block_on(opendsec_cli::ctl::run(cli)) {
        Ok(0) => {}
        // `exec` and `run`: the remote command's exit code.
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e}");
            if let Some(h) = opendsec_cli::ctl::hint(&e, &cx) {
                eprintln!("hint: {h}");
            }
            std::process::exit(e.exit_code());
        }
    }
}

/// The control plane allocates per call (protobuf messages, HTTP/2 frames, records): with
/// glibc's allocator, malloc and free were a quarter of a batched creation's CPU. With
/// mimalloc `make bench` creates 11,600-12,100/s batched instead of 8,200-9,400/s.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;
