//! `pause_reclaim`'s kernel path on a real process: a stopped process's pages are pushed out
//! by `process_madvise(MADV_PAGEOUT)` (measured as its file-backed RSS falling: this host has no
//! swap, so clean file pages are what can go) and advised back with `MADV_WILLNEED`. Root (CI
//! runs as root): process_madvise on another process needs CAP_SYS_NICE.
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use opendsec_edge::linuxrt::reclaim;

fn rss_file_kb(pid: u32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines()
        .find_map(|l| l.strip_prefix("RssFile:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap()
}

#[test]
fn paged_out_memory_leaves_and_is_read_back() {
    assert!(rustix::process::geteuid().is_root(), "this test needs root (CI runs as root)");
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("data");
    std::fs::write(&file, vec![1u8; 16 << 20]).unwrap();
    // A process with 16 MiB of a private file mapped and touched (mapped by it alone, so the
    // kernel may drop the pages), then waiting.
    let script = "import mmap,sys\nf=open(sys.argv[1],'rb')\nm=mmap.mmap(f.fileno(),0,prot=mmap.PROT_READ)\ns=sum(m[i] for i in range(0,len(m),4096))\nprint(s,flush=True)\nsys.stdin.read()\n";
    let mut child = Command::new("python3")
        .args(["-c", script, file.to_str().unwrap()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap()).read_line(&mut line).unwrap();
    assert_eq!(line.trim(), "4096");
    let pid = child.id();
    let before = rss_file_kb(pid);
    assert!(before >= 16 << 10, "RssFile {before} kB");
    rustix::process::kill_process(rustix::process::Pid::from_raw(pid as i32).unwrap(), rustix::process::Signal::STOP)
        .unwrap();

    let out = reclaim::page_out(&[pid as i32]);
    assert_eq!(out.processes, 1);
    assert!(out.bytes >= 16 << 20, "{out:?}");
    let after = rss_file_kb(pid);
    assert!(after + (12 << 10) <= before, "RssFile {before} kB -> {after} kB");

    let back = reclaim::read_ahead(&[pid as i32]);
    assert!(back.bytes >= 16 << 20, "{back:?}");
    // Gone processes are skipped, not errors.
    assert_eq!(reclaim::page_out(&[i32::MAX]).processes, 0);

    rustix::process::kill_process(rustix::process::Pid::from_raw(pid as i32).unwrap(), rustix::process::Signal::KILL)
        .unwrap();
    child.wait().unwrap();
}
