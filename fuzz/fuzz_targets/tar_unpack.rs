//! The layer unpacker on arbitrary bytes (plain, or whatever compression their first bytes
//! claim): it never panics, and whether it accepts or refuses, nothing escapes the store and a
//! refused layer leaves nothing behind.
#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use opendsec_images::Store;
use opendsec_images::layer::{self, Compression, Limits};

struct Env {
    _dir: tempfile::TempDir,
    store: Store,
    outside: std::path::PathBuf,
}

fn env() -> &'static Env {
    static ENV: OnceLock<Env> = OnceLock::new();
    ENV.get_or_init(|| {
        // tmpfs when there is one: every layer is synced.
        let base = if std::path::Path::new("/dev/shm").is_dir() { "/dev/shm" } else { "/tmp" };
        let dir = tempfile::Builder::new().prefix("opendsec-fuzz-").tempdir_in(base).unwrap();
        let store = Store::open(dir.path().join("store")).unwrap();
        let outside = dir.path().join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        Env { _dir: dir, store, outside }
    })
}

fuzz_target!(|data: &[u8]| {
    let e = env();
    let limits = Limits { max_file_bytes: 1 << 20, max_layer_bytes: 4 << 20, max_entries: 512, ..Limits::default() };
    let comp = Compression::sniff(data);
    match layer::import_layer(&e.store, &mut &data[..], comp, None, &[], &limits, "fuzz") {
        Ok(meta) => {
            // Accepted layers go away again so the store stays small.
            let _ = std::fs::remove_dir_all(e.store.layer_dir(&meta.id));
        }
        Err(_) => {}
    }
    let pending = std::fs::read_dir(e.store.tmp_dir()).unwrap().count();
    assert_eq!(pending, 0, "an import left a pending layer behind");
    assert_eq!(std::fs::read_dir(&e.outside).unwrap().count(), 0, "a layer wrote outside the store");
});
