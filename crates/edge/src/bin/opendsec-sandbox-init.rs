//! A standalone sandbox setup process (the same code the edge runs when re-executed); used by
//! tests, which cannot re-execute the test harness.
fn main() {
    opendsec_edge::linuxrt::init::run_if_init();
    eprintln!("opendsec-sandbox-init: run by the edge only (argv[1] = {})", opendsec_edge::linuxrt::init::MARKER);
    std::process::exit(2);
}
