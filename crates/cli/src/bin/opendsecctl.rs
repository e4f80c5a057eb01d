//! opendsecctl: see `opendsec_cli::ctl`.

fn main() {
    opendsec_common::init_tracing_quiet();
    let cli = <opendsec_cli::ctl::Cli as clap::Parser>::parse();
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            std::process::exit(1);
        }
    };
    if let Err(e) = rt.block_on(opendsec_cli::ctl::run(cli)) {
        eprintln!("error: {e}");
        std::process::exit(e.exit_code());
    }
}
