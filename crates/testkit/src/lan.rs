//! Hosts on a test LAN: each "host" is a network namespace of its own, joined by a veth to a
//! bridge in the test's private namespace ([`crate::netns::enter_private_namespace`] first),
//! where the test itself sits at [`Lan::GATEWAY`]. Daemons run in a host with
//! [`Host::command`]. Nothing here has a route anywhere but the LAN: no packet can reach the
//! machine's real network.
//!
//! Faults: [`Lan::unplug`] takes a host's cable out (nobody reaches it, it reaches nobody),
//! [`Lan::isolate`] drops its traffic with some peers only (an nftables table in the host),
//! [`Lan::plug`] / [`Lan::heal`] undo them.

use std::net::Ipv4Addr;
use std::process::Command;

use crate::netns::sh;

/// A host on the LAN.
#[derive(Debug)]
pub struct Host {
    /// Its network namespace (`/run/netns/<ns>`).
    pub ns: String,
    pub addr: Ipv4Addr,
    /// The bridge side of its veth.
    port: String,
}

impl Host {
    /// `program` to be run inside this host's network namespace. Only the network namespace
    /// changes (`nsenter --net`, which then execs the program: the child's pid is the
    /// program's): `ip netns exec` would also give it a fresh `/sys`, without the cgroup file
    /// systems a container edge needs.
    pub fn command(&self, program: &str) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net=/run/netns/{}", self.ns)).arg("--").arg(program);
        c
    }

    /// Runs `args` in this host; panics with its output if it fails.
    pub fn sh(&self, args: &[&str]) -> String {
        let net = format!("--net=/run/netns/{}", self.ns);
        let mut v = vec!["nsenter", net.as_str(), "--"];
        v.extend_from_slice(args);
        sh(&v)
    }
}

/// The LAN and its hosts. Dropping it removes the hosts' namespaces (and their veths).
#[derive(Debug)]
pub struct Lan {
    pub hosts: Vec<Host>,
}

impl Lan {
    /// The test's own address on the LAN (the bridge's).
    pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 1);
    const BRIDGE: &'static str = "odt-lan";

    /// Makes `n` hosts, `10.77.0.11` onwards. Panics unless the calling thread's namespace is
    /// a private one the test made (nothing in it but `lo`).
    pub fn start(n: usize) -> Lan {
        assert!(n < 200, "at most 199 hosts");
        let links = sh(&["ip", "-o", "link", "show"]);
        assert!(
            links.lines().all(|l| l.contains(": lo:")),
            "Lan::start runs in a private network namespace (netns::enter_private_namespace): {links}"
        );
        sh(&["ip", "link", "add", Self::BRIDGE, "type", "bridge"]);
        sh(&["ip", "addr", "add", &format!("{}/24", Self::GATEWAY), "dev", Self::BRIDGE]);
        sh(&["ip", "link", "set", Self::BRIDGE, "up"]);
        let tag = format!("{:06x}", crate::netns::rand_u32() & 0xff_ffff);
        let mut hosts = Vec::new();
        for i in 0..n {
            let ns = format!("odt-h{tag}-{i}");
            let port = format!("odh{tag}{i}");
            let addr = Ipv4Addr::new(10, 77, 0, 11 + i as u8);
            sh(&["ip", "netns", "add", &ns]);
            // Pushed into `hosts` at once: a failure below still removes the namespace.
            hosts.push(Host { ns: ns.clone(), addr, port: port.clone() });
            sh(&["ip", "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns]);
            sh(&["ip", "link", "set", &port, "master", Self::BRIDGE]);
            sh(&["ip", "link", "set", &port, "up"]);
            let h = &hosts[i];
            h.sh(&["ip", "link", "set", "lo", "up"]);
            h.sh(&["ip", "addr", "add", &format!("{addr}/24"), "dev", "eth0"]);
            h.sh(&["ip", "link", "set", "eth0", "up"]);
        }
        Lan { hosts }
    }

    /// Takes host `i`'s cable out.
    pub fn unplug(&self, i: usize) {
        sh(&["ip", "link", "set", &self.hosts[i].port, "down"]);
    }

    /// Puts host `i`'s cable back.
    pub fn plug(&self, i: usize) {
        sh(&["ip", "link", "set", &self.hosts[i].port, "up"]);
    }

    /// Host `i` drops everything to and from `peers` (the others still reach it).
    pub fn isolate(&self, i: usize, peers: &[Ipv4Addr]) {
        let set = peers.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(", ");
        let rules = format!(
            "table inet odt_cut {{\n\
             chain in {{ type filter hook input priority -100; ip saddr {{ {set} }} drop; }}\n\
             chain out {{ type filter hook output priority -100; ip daddr {{ {set} }} drop; }}\n\
             }}\n"
        );
        // Through a pipe: no file anyone else could have put a link at.
        let mut nft = self.hosts[i]
            .command("nft")
            .args(["-f", "-"])
            .stdin(std::process::Stdio::piped())
            .spawn()
            .expect("run nft");
        std::io::Write::write_all(&mut nft.stdin.take().expect("nft's stdin"), rules.as_bytes()).expect("feed nft");
        assert!(nft.wait().expect("nft's exit").success(), "nft -f refused: {rules}");
    }

    /// Undoes [`Self::isolate`] on host `i`.
    pub fn heal(&self, i: usize) {
        self.hosts[i].sh(&["nft", "delete", "table", "inet", "odt_cut"]);
    }
}

impl Drop for Lan {
    fn drop(&mut self) {
        for h in &self.hosts {
            let _ = Command::new("ip").args(["netns", "del", &h.ns]).status();
        }
    }
}
