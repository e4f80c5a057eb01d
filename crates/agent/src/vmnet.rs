//! A VM guest's network, set up by `vm-init` before the agent serves: the loopback device up
//! (the agent's HttpRequest reaches the sandbox's ports on 127.0.0.1), and when the VM has a
//! NIC, that NIC with the fixed address of `opendsec_proto::vmnet`, a default route through the
//! gateway and the gateway as name server. The guest has no `ip` tool to rely on: this is done
//! with the kernel's interface ioctls.

use std::net::Ipv4Addr;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use opendsec_proto::vmnet;
use rustix::ioctl::{Opcode, Setter, Updater, ioctl};

const SIOCGIFFLAGS: Opcode = 0x8913;
const SIOCSIFFLAGS: Opcode = 0x8914;
const SIOCSIFADDR: Opcode = 0x8916;
const SIOCSIFNETMASK: Opcode = 0x891c;
const SIOCADDRT: Opcode = 0x890b;
const IFF_UP: i16 = 0x1;
const RTF_UP: u16 = 0x1;
const RTF_GATEWAY: u16 = 0x2;
/// How long the NIC may take to appear once its module is loaded.
const NIC_WAIT: Duration = Duration::from_secs(30);

/// `struct ifreq`: a name and a union of 24 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
struct IfReq {
    name: [u8; 16],
    data: [u8; 24],
}

/// `struct sockaddr_in` as the 16 bytes of a `struct sockaddr`.
fn sockaddr(a: Ipv4Addr) -> [u8; 16] {
    let mut s = [0u8; 16];
    s[..2].copy_from_slice(&2u16.to_ne_bytes()); // AF_INET
    s[4..8].copy_from_slice(&a.octets());
    s
}

fn ifreq(name: &str) -> std::io::Result<IfReq> {
    let mut r = IfReq { name: [0; 16], data: [0; 24] };
    if name.len() >= 16 {
        return Err(std::io::Error::other(format!("interface name {name:?} is too long")));
    }
    r.name[..name.len()].copy_from_slice(name.as_bytes());
    Ok(r)
}

/// `struct rtentry` (x86_64).
#[repr(C)]
struct RtEntry {
    pad1: u64,
    dst: [u8; 16],
    gateway: [u8; 16],
    genmask: [u8; 16],
    flags: u16,
    pad2: i16,
    pad3: u64,
    pad4: *mut u8,
    metric: i16,
    dev: *mut u8,
    mtu: u64,
    window: u64,
    irtt: u16,
}

fn err(what: &str, e: rustix::io::Errno) -> std::io::Error {
    std::io::Error::other(format!("{what}: {e}"))
}

fn socket() -> std::io::Result<std::os::fd::OwnedFd> {
    rustix::net::socket(rustix::net::AddressFamily::INET, rustix::net::SocketType::DGRAM, None)
        .map_err(|e| err("an inet socket", e))
}

/// Sets interface `name` up.
fn up(sock: impl AsFd, name: &str) -> std::io::Result<()> {
    let mut r = ifreq(name)?;
    // SAFETY: SIOCGIFFLAGS reads and writes an ifreq, which `r` is, alive for the call.
    unsafe { ioctl(&sock, Updater::<SIOCGIFFLAGS, IfReq>::new(&mut r)) }
        .map_err(|e| err(&format!("the flags of {name}"), e))?;
    let flags = i16::from_ne_bytes([r.data[0], r.data[1]]) | IFF_UP;
    r.data[..2].copy_from_slice(&flags.to_ne_bytes());
    // SAFETY: SIOCSIFFLAGS reads an ifreq, passed by pointer to the Setter's own copy.
    unsafe { ioctl(&sock, Setter::<SIOCSIFFLAGS, IfReq>::new(r)) }.map_err(|e| err(&format!("setting {name} up"), e))
}

/// The loopback device up.
pub fn loopback() -> std::io::Result<()> {
    up(socket()?, "lo")
}

/// The first network interface other than `lo` (a VM has one NIC at most), once it appears.
fn wait_for_nic() -> std::io::Result<String> {
    let deadline = Instant::now() + NIC_WAIT;
    loop {
        let found = std::fs::read_dir("/sys/class/net")?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .find(|n| n != "lo");
        if let Some(n) = found {
            return Ok(n);
        }
        if Instant::now() > deadline {
            return Err(std::io::Error::other("the VM's NIC did not appear"));
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// The NIC with the guest's fixed address, the default route through the gateway; returns
/// the NIC's name.
pub fn nic() -> std::io::Result<String> {
    let name = wait_for_nic()?;
    let sock = socket()?;
    let mut r = ifreq(&name)?;
    r.data[..16].copy_from_slice(&sockaddr(vmnet::GUEST_ADDR));
    // SAFETY: SIOCSIFADDR reads an ifreq holding a sockaddr_in, the Setter's own copy.
    unsafe { ioctl(&sock, Setter::<SIOCSIFADDR, IfReq>::new(r)) }.map_err(|e| err("the NIC's address", e))?;
    let mask = Ipv4Addr::from(u32::MAX << (32 - u32::from(vmnet::PREFIX)));
    r.data[..16].copy_from_slice(&sockaddr(mask));
    // SAFETY: as above, with the netmask.
    unsafe { ioctl(&sock, Setter::<SIOCSIFNETMASK, IfReq>::new(r)) }.map_err(|e| err("the NIC's netmask", e))?;
    up(&sock, &name)?;
    let route = RtEntry {
        pad1: 0,
        dst: sockaddr(Ipv4Addr::UNSPECIFIED),
        gateway: sockaddr(vmnet::GATEWAY_ADDR),
        genmask: sockaddr(Ipv4Addr::UNSPECIFIED),
        flags: RTF_UP | RTF_GATEWAY,
        pad2: 0,
        pad3: 0,
        pad4: std::ptr::null_mut(),
        metric: 0,
        dev: std::ptr::null_mut(),
        mtu: 0,
        window: 0,
        irtt: 0,
    };
    // SAFETY: SIOCADDRT reads a struct rtentry, which `route` is (x86_64 layout), with no
    // device name (`dev` null: the kernel finds the NIC by the gateway).
    unsafe { ioctl(&sock, Setter::<SIOCADDRT, RtEntry>::new(route)) }.map_err(|e| err("the default route", e))?;
    Ok(name)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_structs_are_the_kernels_size() {
        assert_eq!(std::mem::size_of::<super::IfReq>(), 40);
        assert_eq!(std::mem::size_of::<super::RtEntry>(), 120);
    }
}
