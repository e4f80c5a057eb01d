//! A VM's network ([C 7] "network for clones", [C 9]): the sandbox's own network namespace,
//! as a container's, with a tap inside it that the VMM's NIC is attached to.
//!
//! - **The namespace** is held by a placeholder process (`opendsec-agent hold-netns <dir>`),
//!   not by the VMM, which lives in an empty namespace of its own and is gone while a microvm
//!   is paused. The placeholder runs under an id of the VM's block other than the VMM's (a VMM
//!   taken over by its guest cannot ptrace it), with no capability and `no_new_privs`, in the
//!   VM's cgroup, in a session of its own (it outlives an edge restart and is adopted from `netns.pid`); killing it, or removing
//!   the cgroup, takes the namespace with its tap and veth away.
//! - **Inside it**: `eth0`, the sandbox's end of its veth, with the sandbox's address from the
//!   edge's subnet (made by `netpol`, exactly as for a container, and policed on the host the
//!   same way), and `tap0`, persistent, with the same MAC and the gateway address of
//!   `opendsec_proto::vmnet` in every VM. Every guest has the same address behind it; nftables
//!   in the namespace translate it to the sandbox's address on the way out (and the gateway's
//!   DNS port to the edge's DNS proxy), forward nothing else, and accept nothing addressed to
//!   the namespace itself. A copy restored from a snapshot therefore needs no change to its
//!   guest's network: only the namespace around it is new.
//! - **The VMM** gets the tap as a descriptor the edge opened inside the namespace (`-netdev
//!   tap,fd=`), for every start: boot, resume and restore alike.

use std::net::Ipv4Addr;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};

use opendsec_proto::vmnet;
use rustix::ioctl::{IntegerSetter, Opcode, Setter, ioctl};

use crate::backend::BackendError;
use crate::netpol::link;
use crate::netpol::nl::NlSocket;

/// The placeholder's pid file in the VM's directory.
pub(super) const HOLDER_PID: &str = "netns.pid";
/// The table of the translation in the namespace.
const TABLE: &str = "opendsec_vm";

const TUNSETIFF: Opcode = 0x4004_54ca;
const TUNSETPERSIST: Opcode = 0x4004_54cb;
const IFF_TAP: i16 = 0x0002;
const IFF_NO_PI: i16 = 0x1000;
const IFF_VNET_HDR: i16 = 0x4000;

/// The placeholder's pid, if that process is alive and is the placeholder of `dir` (exactly:
/// one VM's directory is a prefix of another's, `….e1.a` of `….e1.ab`).
pub(super) fn holder_pid(dir: &Path) -> Option<i32> {
    let me = dir.as_os_str().as_encoded_bytes();
    super::pid_in(dir, HOLDER_PID, |args| args.contains(&b"hold-netns".as_slice()) && args.contains(&me))
}

/// The namespace the placeholder of `dir` holds, open.
pub(super) fn netns_of(dir: &Path) -> Result<std::fs::File, BackendError> {
    let gone = || BackendError::unavailable(format!("the network namespace of {} is gone", dir.display()));
    let pid = holder_pid(dir).ok_or_else(gone)?;
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).map_err(|_| gone())?;
    // The pid could have been reused between the look and the open: looked at again, with the
    // namespace held.
    if holder_pid(dir) != Some(pid) {
        return Err(gone());
    }
    Ok(ns)
}

/// A path that names the open namespace `ns` (for code that opens namespaces by path).
pub(super) fn path_of(ns: &std::fs::File) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(ns)))
}

/// Starts the placeholder of `dir` (`agent hold-netns <dir>`) in a new network namespace,
/// joined to the cgroup whose `cgroup.procs` files are `procs`, under `uid`; returns its pid.
pub(super) fn start_holder(
    agent: &Path,
    dir: &Path,
    procs: &[std::ffi::CString],
    uid: u32,
) -> Result<i32, BackendError> {
    use std::os::unix::process::CommandExt;
    let procs = procs.to_vec();
    let mut cmd = std::process::Command::new(agent);
    cmd.arg("hold-netns")
        .arg(dir)
        .env_clear()
        .current_dir("/")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    #[allow(unsafe_code)]
    // SAFETY: between fork and exec the closure makes raw system calls only (open, write,
    // unshare, setsid, setgroups, setgid, setuid) on memory prepared before the fork.
    unsafe {
        cmd.pre_exec(move || {
            for p in &procs {
                let fd = rustix::fs::open(p.as_c_str(), rustix::fs::OFlags::WRONLY, rustix::fs::Mode::empty())?;
                rustix::io::write(&fd, b"0")?;
            }
            rustix::thread::unshare_unsafe(rustix::thread::UnshareFlags::NEWNET)?;
            rustix::process::setsid()?;
            let id = rustix::process::Gid::from_raw(uid);
            rustix::thread::set_thread_groups(&[])?;
            rustix::thread::set_thread_gid(id)?;
            rustix::thread::set_thread_uid(rustix::process::Uid::from_raw(uid))?;
            rustix::thread::set_no_new_privs(true)?;
            Ok(())
        });
    }
    let mut child = cmd.spawn().map_err(super::internal(format!("starting {}", agent.display())))?;
    let pid = i32::try_from(child.id()).unwrap_or(0);
    let tmp = dir.join(format!("{HOLDER_PID}.tmp"));
    if let Err(e) = std::fs::write(&tmp, pid.to_string()).and_then(|()| std::fs::rename(&tmp, dir.join(HOLDER_PID))) {
        let _ = child.kill();
        let _ = child.wait();
        return Err(BackendError::internal(format!("recording the network placeholder's pid: {e}")));
    }
    // Reaped by a thread while the edge runs; an adopted one by whoever inherits it.
    std::thread::spawn(move || {
        let _ = child.wait();
    });
    Ok(pid)
}

/// Kills the placeholder of `dir` (its namespace goes with it) and waits for it to be gone.
pub(super) fn stop_holder(dir: &Path) {
    super::kill_and_wait(dir, "the network placeholder", || holder_pid(dir));
}

/// Runs `f` on a thread of its own that has entered the namespace `ns` (network namespaces
/// are per thread: the edge's own threads stay where they are).
fn in_netns<T: Send>(ns: &std::fs::File, f: impl FnOnce() -> std::io::Result<T> + Send) -> std::io::Result<T> {
    std::thread::scope(|s| {
        s.spawn(move || {
            rustix::thread::move_into_link_name_space(ns.as_fd(), Some(rustix::thread::LinkNameSpaceType::Network))?;
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(std::io::Error::other("a thread in a VM's network namespace panicked")))
    })
}

/// `struct ifreq` for the tun device: a name and the flags.
#[repr(C)]
struct TunReq {
    name: [u8; 16],
    flags: i16,
    pad: [u8; 22],
}

/// Opens (and with `create`, makes persistent) the tap of the namespace the calling thread is
/// in.
#[allow(unsafe_code)]
fn tun(create: bool) -> std::io::Result<OwnedFd> {
    let fd = rustix::fs::open(
        "/dev/net/tun",
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )?;
    let mut req = TunReq { name: [0; 16], flags: IFF_TAP | IFF_NO_PI | IFF_VNET_HDR, pad: [0; 22] };
    req.name[..vmnet::TAP.len()].copy_from_slice(vmnet::TAP.as_bytes());
    // SAFETY: TUNSETIFF reads a struct ifreq, which TunReq is (40 bytes, name then flags), the
    // Setter's own copy, alive for the call.
    unsafe { ioctl(&fd, Setter::<TUNSETIFF, TunReq>::new(req)) }?;
    if create {
        // SAFETY: TUNSETPERSIST takes an integer argument, no pointer.
        unsafe { ioctl(&fd, IntegerSetter::<TUNSETPERSIST>::new_usize(1)) }?;
    }
    Ok(fd)
}

/// Sets up the namespace `netns` of a new VM: the tap, and with `out` (the sandbox's address
/// on its veth, the edge's DNS proxy) the translation between the guest and the sandbox's
/// address. Without `out` the VM has a NIC and nowhere to reach (a copy of a networked VM on
/// an edge without the network).
pub(super) fn set_up(netns: &std::fs::File, out: Option<(Ipv4Addr, Ipv4Addr)>) -> Result<(), BackendError> {
    let ruleset = out.map(|(addr, dns)| ruleset(addr, dns));
    in_netns(netns, move || {
        drop(tun(true)?);
        let mut sock = NlSocket::route().map_err(std::io::Error::other)?;
        link::configure(&mut sock, vmnet::TAP, vmnet::TAP_MAC, vmnet::GATEWAY_ADDR, vmnet::PREFIX)
            .map_err(std::io::Error::other)?;
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{}/disable_ipv6", vmnet::TAP), "1");
        if let Some(ruleset) = ruleset {
            std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")?;
            nft(&ruleset)?;
        }
        Ok(())
    })
    .map_err(super::internal("the VM's network namespace"))
}

/// The translation in a VM's namespace (see the module's text).
fn ruleset(addr: Ipv4Addr, dns: Ipv4Addr) -> String {
    let (guest, gw, tap, eth) = (vmnet::GUEST_ADDR, vmnet::GATEWAY_ADDR, vmnet::TAP, link::SANDBOX_IFNAME);
    format!(
        "table ip {TABLE} {{
  chain guest_pre {{ type nat hook prerouting priority dstnat; policy accept;
    iifname \"{tap}\" ip saddr {guest} ip daddr {gw} udp dport 53 dnat to {dns}
    iifname \"{tap}\" ip saddr {guest} ip daddr {gw} tcp dport 53 dnat to {dns}
  }}
  chain guest_post {{ type nat hook postrouting priority srcnat; policy accept;
    oifname \"{eth}\" ip saddr {guest} snat to {addr}
  }}
  chain guest_forward {{ type filter hook forward priority filter; policy drop;
    iifname \"{tap}\" oifname \"{eth}\" ip saddr {guest} accept
    iifname \"{eth}\" oifname \"{tap}\" ct state established,related accept
  }}
  chain namespace_input {{ type filter hook input priority filter; policy drop; }}
}}
"
    )
}

/// `nft -f -` of `ruleset` in the calling thread's namespace (the child inherits it).
fn nft(ruleset: &str) -> std::io::Result<()> {
    use std::io::Write;
    let mut child = std::process::Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    child.stdin.take().ok_or_else(|| std::io::Error::other("nft's stdin"))?.write_all(ruleset.as_bytes())?;
    let out = child.wait_with_output()?;
    if !out.status.success() {
        return Err(std::io::Error::other(format!("nft: {}", String::from_utf8_lossy(&out.stderr).trim())));
    }
    Ok(())
}

/// The tap of the namespace `netns`, open, for a VMM.
pub(super) fn open_tap(netns: &std::fs::File) -> Result<OwnedFd, BackendError> {
    in_netns(netns, || tun(false)).map_err(super::internal("opening the VM's tap"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_tun_request_is_an_ifreq() {
        assert_eq!(std::mem::size_of::<super::TunReq>(), 40);
    }

    #[test]
    fn the_translation_names_both_addresses() {
        let r = super::ruleset("10.88.0.3".parse().unwrap(), "10.88.0.1".parse().unwrap());
        assert!(r.contains("snat to 10.88.0.3") && r.contains("dnat to 10.88.0.1"), "{r}");
        assert!(r.contains("ip saddr 172.16.0.2"), "{r}");
    }
}
