//! What the edge reads from its host: memory (/proc/meminfo), free space of the file system
//! holding the state (statvfs), CPU pressure (/proc/pressure/cpu, when present) and CPU use
//! (/proc/stat, smoothed over 10 s).
//!
//! Behind the small [`HostProbe`] trait so that admission and status logic can be tested with
//! [`FixedHost`]; parsing is pure and unit-tested. Sim-only edges never look at the host: a
//! hundred of them share one machine, and the host says nothing about simulated sandboxes.

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::admission::HostReading;

/// CPU use is smoothed over this window.
pub const CPU_WINDOW: Duration = Duration::from_secs(10);

/// The size of the host, for capacities configured as zero ("measure the host").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HostSize {
    pub cpu_millis: u64,
    pub memory_mb: u64,
    pub disk_mb: u64,
}

pub trait HostProbe: Send + Sync {
    /// Memory, free space of `state_dir`'s file system, CPU PSI.
    fn reading(&self, state_dir: &Path) -> HostReading;
    /// Share of the CPUs in use (0..1), smoothed over [`CPU_WINDOW`]; each call also takes a
    /// sample, so callers call it regularly. `None` until two samples exist.
    fn cpu_use(&self) -> Option<f64>;
    fn size(&self, state_dir: &Path) -> HostSize;
}

/// Reads the real host.
#[derive(Debug, Default)]
pub struct ProcHost {
    samples: Mutex<VecDeque<CpuSample>>,
}

impl ProcHost {
    pub fn new() -> ProcHost {
        ProcHost::default()
    }
}

impl HostProbe for ProcHost {
    fn reading(&self, state_dir: &Path) -> HostReading {
        let (mem_total_mb, mem_available_mb) =
            std::fs::read_to_string("/proc/meminfo").map(|t| parse_meminfo(&t)).unwrap_or((None, None));
        let disk_free_mb = statvfs_mb(state_dir).map(|(free, _)| free);
        let cpu_some_avg10 = std::fs::read_to_string("/proc/pressure/cpu").ok().and_then(|t| parse_psi_some_avg10(&t));
        HostReading { mem_total_mb, mem_available_mb, disk_free_mb, cpu_some_avg10 }
    }

    fn cpu_use(&self) -> Option<f64> {
        let times = std::fs::read_to_string("/proc/stat").ok().and_then(|t| parse_proc_stat(&t))?;
        let mut samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        push_sample(&mut samples, CpuSample { at: Instant::now(), times });
        cpu_share(&samples)
    }

    fn size(&self, state_dir: &Path) -> HostSize {
        let cpus = std::thread::available_parallelism().map_or(1, |n| n.get() as u64);
        let memory_mb = std::fs::read_to_string("/proc/meminfo").ok().and_then(|t| parse_meminfo(&t).0).unwrap_or(0);
        let disk_mb = statvfs_mb(state_dir).map_or(0, |(_, total)| total);
        HostSize { cpu_millis: cpus * 1000, memory_mb, disk_mb }
    }
}

/// A host whose readings are set by hand (tests, and edges that must not look at the host).
#[derive(Debug, Default)]
pub struct FixedHost {
    reading: Mutex<HostReading>,
    cpu_use: Mutex<Option<f64>>,
    size: HostSize,
}

impl FixedHost {
    pub fn new(reading: HostReading, size: HostSize) -> FixedHost {
        FixedHost { reading: Mutex::new(reading), cpu_use: Mutex::new(None), size }
    }

    pub fn set_reading(&self, reading: HostReading) {
        *self.reading.lock().unwrap_or_else(|p| p.into_inner()) = reading;
    }

    pub fn set_cpu_use(&self, share: Option<f64>) {
        *self.cpu_use.lock().unwrap_or_else(|p| p.into_inner()) = share;
    }
}

impl HostProbe for FixedHost {
    fn reading(&self, _state_dir: &Path) -> HostReading {
        *self.reading.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn cpu_use(&self) -> Option<f64> {
        *self.cpu_use.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn size(&self, _state_dir: &Path) -> HostSize {
        self.size
    }
}

/// Cumulative CPU times from the first line of /proc/stat (in ticks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuTimes {
    pub busy: u64,
    pub total: u64,
}

#[derive(Clone, Copy, Debug)]
struct CpuSample {
    at: Instant,
    times: CpuTimes,
}

/// Keeps the samples of the last window, plus the newest one older than it as the anchor.
fn push_sample(samples: &mut VecDeque<CpuSample>, s: CpuSample) {
    samples.push_back(s);
    while samples.len() > 2 && s.at.duration_since(samples[1].at) >= CPU_WINDOW {
        samples.pop_front();
    }
}

fn cpu_share(samples: &VecDeque<CpuSample>) -> Option<f64> {
    let (first, last) = (samples.front()?, samples.back()?);
    let total = last.times.total.checked_sub(first.times.total)?;
    let busy = last.times.busy.checked_sub(first.times.busy)?;
    if total == 0 {
        return None;
    }
    Some((busy as f64 / total as f64).clamp(0.0, 1.0))
}

/// `cpu  user nice system idle iowait irq softirq steal guest guest_nice`; idle and iowait are
/// not busy; guest time is already counted in user.
pub fn parse_proc_stat(text: &str) -> Option<CpuTimes> {
    let line = text.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line.split_whitespace().skip(1).take(8).map(|x| x.parse().ok()).collect::<Option<_>>()?;
    if v.len() < 4 {
        return None;
    }
    let total: u64 = v.iter().sum();
    let idle = v[3] + v.get(4).copied().unwrap_or(0);
    Some(CpuTimes { busy: total - idle, total })
}

/// (MemTotal, MemAvailable) in MiB.
pub fn parse_meminfo(text: &str) -> (Option<u64>, Option<u64>) {
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb / 1024)
    };
    (field("MemTotal:"), field("MemAvailable:"))
}

/// `some avg10=1.23 avg60=... avg300=... total=...` -> 1.23.
pub fn parse_psi_some_avg10(text: &str) -> Option<f64> {
    let line = text.lines().find(|l| l.starts_with("some "))?;
    line.split_whitespace().find_map(|kv| kv.strip_prefix("avg10=")).and_then(|v| v.parse().ok())
}

/// (free for unprivileged users, total) of the file system holding `path`, in MiB.
fn statvfs_mb(path: &Path) -> Option<(u64, u64)> {
    let st = rustix::fs::statvfs(path).ok()?;
    let (frsize, bavail, blocks) = (st.f_frsize, st.f_bavail, st.f_blocks);
    Some((bavail.saturating_mul(frsize) >> 20, blocks.saturating_mul(frsize) >> 20))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn proc_stat() {
        let t = "cpu  100 5 50 800 20 1 2 3 0 0\ncpu0 1 2 3 4\n";
        assert_eq!(parse_proc_stat(t), Some(CpuTimes { busy: 161, total: 981 }));
        assert_eq!(parse_proc_stat("cpu0 1 2 3"), None);
        assert_eq!(parse_proc_stat("cpu  x y"), None);
    }

    #[test]
    fn meminfo() {
        let t = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   12288000 kB\n";
        assert_eq!(parse_meminfo(t), (Some(24000), Some(12000)));
        assert_eq!(parse_meminfo("garbage"), (None, None));
    }

    #[test]
    fn psi() {
        let t = "some avg10=91.50 avg60=3.00 avg300=1.00 total=123\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=0\n";
        assert_eq!(parse_psi_some_avg10(t), Some(91.5));
        assert_eq!(parse_psi_some_avg10(""), None);
    }

    #[test]
    fn cpu_use_is_smoothed_over_the_window() {
        let t0 = Instant::now();
        let mut s = VecDeque::new();
        let at = |secs| t0 + Duration::from_secs(secs);
        push_sample(&mut s, CpuSample { at: at(0), times: CpuTimes { busy: 0, total: 0 } });
        assert_eq!(cpu_share(&s), None);
        push_sample(&mut s, CpuSample { at: at(5), times: CpuTimes { busy: 100, total: 1000 } });
        assert_eq!(cpu_share(&s), Some(0.1));
        for i in 6..=30 {
            push_sample(&mut s, CpuSample { at: at(i), times: CpuTimes { busy: 100 + (i - 5) * 50, total: i * 200 } });
        }
        // Only the last ~10 s count: 50 busy ticks of every 200.
        let share = cpu_share(&s).unwrap();
        assert!((share - 0.25).abs() < 1e-9, "{share}");
        assert!(s.len() <= 12, "{}", s.len());
    }

    #[test]
    fn the_real_host_can_be_read() {
        let h = ProcHost::new();
        let r = h.reading(Path::new("/"));
        assert!(r.mem_total_mb.is_some_and(|m| m > 0));
        assert!(r.disk_free_mb.is_some());
        assert!(h.size(Path::new("/")).cpu_millis >= 1000);
    }
}
