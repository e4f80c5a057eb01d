//! How fast one layer imports, next to GNU tar unpacking the same blob (the peer closest to
//! what `umoci unpack` does per layer). Prints figures; never passes or fails on time.
//!
//! ```text
//! OPENDSEC_BENCH_LAYER=/path/layer.tar.gz \
//!   cargo bench -p opendsec-images --bench unpack
//! ```

use std::io::BufReader;
use std::process::Command;
use std::time::Instant;

use opendsec_images::Store;
use opendsec_images::layer::{Compression, Limits, import_layer};

fn import_one_layer() {
    let Ok(path) = std::env::var("OPENDSEC_BENCH_LAYER") else {
        eprintln!("OPENDSEC_BENCH_LAYER not set: nothing to measure");
        return;
    };
    let mut head = [0u8; 4];
    std::io::Read::read_exact(&mut std::fs::File::open(&path).unwrap(), &mut head).unwrap();
    let compression = Compression::sniff(&head);
    let dir = tempfile::tempdir_in(std::env::var("OPENDSEC_BENCH_DIR").unwrap_or_else(|_| "/tmp".into())).unwrap();

    let store = Store::open(dir.path().join("store")).unwrap();
    let cpu0 = cpu_seconds();
    let t = Instant::now();
    let mut blob = BufReader::new(std::fs::File::open(&path).unwrap());
    let meta = import_layer(&store, &mut blob, compression, None, &[], &Limits::default(), "bench").unwrap();
    let ours = t.elapsed();
    let cpu1 = cpu_seconds();

    let out = dir.path().join("tar");
    std::fs::create_dir(&out).unwrap();
    let t = Instant::now();
    let flag = match compression {
        Compression::Gzip => "-z",
        Compression::Zstd => "--zstd",
        Compression::None => "--no-auto-compress",
    };
    let st = Command::new("tar")
        .args(["-x", flag, "--numeric-owner", "--same-permissions", "--xattrs", "-f", &path, "-C"])
        .arg(&out)
        .status()
        .unwrap();
    let _ = Command::new("sync").arg("-f").arg(&out).status();
    let tar = t.elapsed();
    assert!(st.success());
    println!(
        "layer {path}: {} entries, {} MB of content\n  opendsec import_layer (hash + unpack + syncfs + commit): {:.2} s (cpu: {:.2} s user, {:.2} s system)\n  GNU tar -x + sync -f:                                  {:.2} s",
        meta.entries,
        meta.size_bytes >> 20,
        ours.as_secs_f64(),
        cpu1.0 - cpu0.0,
        cpu1.1 - cpu0.1,
        tar.as_secs_f64()
    );
}

/// (user, system) CPU seconds of this process, from /proc/self/stat.
fn cpu_seconds() -> (f64, f64) {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    // Fields after the command name (which may hold spaces) start at state (field 3).
    let rest = &stat[stat.rfind(')').unwrap() + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let tick = 100.0; // USER_HZ on Linux
    (f[11].parse::<f64>().unwrap() / tick, f[12].parse::<f64>().unwrap() / tick)
}

/// Runs every benchmark, or those whose names contain one of the arguments.
fn main() {
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let wanted = |n: &str| filters.is_empty() || filters.iter().any(|f| n.contains(f.as_str()));
    if wanted("import_one_layer") {
        println!("== import_one_layer");
        import_one_layer();
    }
}
