//! Memory of paused sandboxes (`edge.pause_reclaim`): after the freezer stopped a sandbox, its
//! processes' pages are pushed out with `process_madvise(MADV_PAGEOUT)` (anonymous pages go to
//! swap when the host has it; clean file pages are dropped), and on resume they are read back
//! ahead of use with `MADV_WILLNEED` before the thaw, so the first calls do not fault page by
//! page.
//!
//! Best effort by design: a process that exits meanwhile, a range the kernel will not advise
//! (locked, shared, special mappings) or a host without swap only makes the effect smaller; the
//! counts say what was advised. Reading `/proc/<pid>/maps` and advising is allowed to root
//! (PTRACE_MODE_READ and CAP_SYS_NICE).
#![allow(unsafe_code)]

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const SYS_PIDFD_OPEN: libc::c_long = 434;
const SYS_PROCESS_MADVISE: libc::c_long = 440;

/// What one pass advised.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Advised {
    pub processes: usize,
    pub ranges: usize,
    /// Bytes the kernel accepted advice for.
    pub bytes: u64,
}

/// Address ranges of `/proc/<pid>/maps` worth advising: every mapping but the kernel's special
/// ones (`[vsyscall]`, `[vvar]`, `[vdso]`), which cannot be paged.
pub fn parse_maps(text: &str) -> Vec<(u64, u64)> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let range = f.next()?;
            let name = f.nth(4).unwrap_or("");
            if matches!(name, "[vsyscall]" | "[vvar]" | "[vdso]" | "[vvar_vclock]") {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            let (a, b) = (u64::from_str_radix(a, 16).ok()?, u64::from_str_radix(b, 16).ok()?);
            (b > a).then_some((a, b - a))
        })
        .collect()
}

fn pidfd(pid: i32) -> Option<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
    let fd = unsafe { libc::syscall(SYS_PIDFD_OPEN, pid, 0) };
    // SAFETY: a non-negative return is a fresh fd this process owns.
    (fd >= 0).then(|| unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Ranges advised per pass at most: a sandbox chooses how many mappings its processes have,
/// and each costs the edge a syscall.
const MAX_RANGES: usize = 200_000;

/// Advises every range of every process in `pids` with `advice`, up to [`MAX_RANGES`]. The
/// pidfd is taken before the maps are read, so a pid reused meanwhile is caught: its maps then
/// belong to a process the pidfd does not name, and the kernel refuses nothing but we would
/// advise a stranger; hence the second check that the pidfd's process is still alive and the
/// same (`/proc/<pid>` re-read after the pidfd exists).
fn advise(pids: &[i32], advice: libc::c_int) -> Advised {
    let mut out = Advised::default();
    for &pid in pids {
        let Some(fd) = pidfd(pid) else { continue };
        let Ok(cgroup_before) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else { continue };
        let Ok(maps) = std::fs::read_to_string(format!("/proc/{pid}/maps")) else { continue };
        // pidfd_send_signal(0) fails once the pidfd's process is gone: then `/proc/<pid>` may
        // have been a newer process's.
        // SAFETY: signal 0 with no siginfo only checks the pidfd's process.
        let alive = unsafe { libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), 0, std::ptr::null::<u8>(), 0) };
        if alive < 0 || std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok().as_ref() != Some(&cgroup_before) {
            continue;
        }
        let mut ranges = parse_maps(&maps);
        ranges.truncate(MAX_RANGES.saturating_sub(out.ranges));
        out.processes += 1;
        // One range per call: the kernel stops a vector at the first range it refuses (a
        // locked or special mapping), which would hide every range after it.
        for (a, len) in ranges {
            let iov = libc::iovec { iov_base: a as *mut libc::c_void, iov_len: len as usize };
            // SAFETY: &iov is one valid iovec describing a range of the target process (never
            // dereferenced here); the kernel validates it.
            let n =
                unsafe { libc::syscall(SYS_PROCESS_MADVISE, fd.as_raw_fd(), &iov as *const libc::iovec, 1, advice, 0) };
            if n > 0 {
                out.ranges += 1;
                out.bytes += n as u64;
            }
        }
    }
    out
}

/// Pushes the pages of (frozen) processes out.
pub fn page_out(pids: &[i32]) -> Advised {
    advise(pids, libc::MADV_PAGEOUT)
}

/// Reads the pages of processes back ahead of use (before a thaw).
pub fn read_ahead(pids: &[i32]) -> Advised {
    advise(pids, libc::MADV_WILLNEED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_lines_become_ranges_without_special_mappings() {
        let text = "\
55d0c000-55d0e000 r--p 00000000 08:01 1234 /usr/bin/cat
7ffd1000-7ffd3000 rw-p 00000000 00:00 0 [stack]
7ffd4000-7ffd6000 r--p 00000000 00:00 0 [vvar]
7ffd6000-7ffd8000 r-xp 00000000 00:00 0 [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0 [vsyscall]
bad line
7f0000000000-7f0000001000 rw-p 00000000 00:00 0
";
        assert_eq!(parse_maps(text), vec![(0x55d0c000, 0x2000), (0x7ffd1000, 0x2000), (0x7f0000000000, 0x1000)]);
    }

    #[test]
    fn advising_this_process_is_accepted() {
        // Not frozen, so nothing is lost: WILLNEED on our own mappings just reads ahead.
        let a = read_ahead(&[std::process::id() as i32]);
        assert_eq!(a.processes, 1);
        assert!(a.ranges > 0, "{a:?}");
    }
}
