//! The import benchmark of issue 3: the same multi-layer image from the local registry,
//! imported by us and by `skopeo copy` to an OCI layout followed by `umoci unpack`, in the same
//! run. Prints both figures; never passes or fails on time.
//!
//! `cargo bench -p opendsec-images --bench registry`
//! (`BENCH_LAYERS`, `BENCH_LAYER_MB` change the image size).

#[path = "../tests/it/support/mod.rs"]
mod support;

use std::process::Command;
use std::time::Instant;

use opendsec_images::Store;
use opendsec_images::import::import_from_registry;
use support::*;

/// Text-like content (compresses like real files do, unlike random bytes).
fn content(seed: u64, len: usize) -> Vec<u8> {
    let words = ["alpha ", "beta ", "gamma ", "delta\n", "epsilon ", "zeta ", "eta\n", "theta "];
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    let mut out = Vec::with_capacity(len);
    while out.len() < len {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        out.extend_from_slice(words[(x >> 61) as usize].as_bytes());
        if (x >> 40) & 7 == 0 {
            out.extend_from_slice(format!("{x:x}").as_bytes());
        }
    }
    out.truncate(len);
    out
}

fn bench_image(layers: usize, layer_mb: usize) -> Image {
    let mut out = Vec::new();
    for l in 0..layers {
        let mut t = TarBuilder::new().dir(&format!("l{l}"));
        let mut size = 0;
        let mut n = 0u64;
        while size < layer_mb << 20 {
            // Mostly small files, some large ones, as in real images.
            let len = if n.is_multiple_of(50) { 2 << 20 } else { 1024 + (n as usize * 7919) % (48 << 10) };
            let dir = format!("l{l}/d{}", n % 40);
            if n < 40 {
                t = t.dir(&dir);
            }
            t = t.file(&format!("{dir}/f{n}"), &content(n + (l as u64) * 1_000_000, len));
            size += len;
            n += 1;
        }
        out.push(layer(t.finish(), Comp::Gzip));
    }
    image(out, "amd64", &[], &[])
}

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

async fn import_against_skopeo_and_umoci() {
    let layers = env_or("BENCH_LAYERS", 5);
    let layer_mb = env_or("BENCH_LAYER_MB", 40);
    let reg = Registry::start(None);
    let img = bench_image(layers, layer_mb);
    let blob_mb: usize = img.layers.iter().map(|l| l.blob.len()).sum::<usize>() >> 20;
    let dir = tempfile::tempdir().unwrap();
    Layout::new(dir.path()).add_image(&img, "v1");
    reg.push(dir.path(), "v1", "bench", false);
    let reference = reg.reference("bench:v1");
    let work = tempfile::tempdir().unwrap();

    let store = Store::open(work.path().join("store")).unwrap();
    let start = Instant::now();
    let got = import_from_registry(&store, &reference, &local_opts()).await.unwrap();
    let ours = start.elapsed();
    assert_eq!(got.fetched_layers, layers);

    let start = Instant::now();
    let layout = work.path().join("layout");
    let out = Command::new("skopeo")
        .args(["copy", "--quiet", "--insecure-policy", "--src-tls-verify=false"])
        .arg(format!("docker://{reference}"))
        .arg(format!("oci:{}:v1", layout.display()))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let copied = start.elapsed();
    let out = Command::new("umoci")
        .args(["unpack", "--image"])
        .arg(format!("{}:v1", layout.display()))
        .arg(work.path().join("bundle"))
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let theirs = start.elapsed();

    println!(
        "image-import: {layers} layers x {layer_mb} MiB ({blob_mb} MiB compressed): opendsec {:.2} s; skopeo copy + umoci unpack {:.2} s (copy {:.2} s)",
        ours.as_secs_f64(),
        theirs.as_secs_f64(),
        copied.as_secs_f64()
    );
}

/// Runs every benchmark, or those whose names contain one of the arguments.
fn main() {
    let filters: Vec<String> = std::env::args().skip(1).filter(|a| !a.starts_with("--")).collect();
    let wanted = |n: &str| filters.is_empty() || filters.iter().any(|f| n.contains(f.as_str()));
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("tokio runtime");
    if wanted("import_against_skopeo_and_umoci") {
        println!("== import_against_skopeo_and_umoci");
        rt.block_on(import_against_skopeo_and_umoci());
    }
}
