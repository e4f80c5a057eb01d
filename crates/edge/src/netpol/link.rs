//! Links, addresses and routes of the sandbox network, over netlink with rtnetlink's message
//! builders ([`super::nl`] carries them): a veth pair per sandbox, the host end in the edge's
//! namespace, the other end (`eth0`) created straight inside the sandbox's namespace; the DNS
//! proxy's address on `lo`, labelled as the edge's.

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::Path;

use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::packet_route::link::{InfoData, InfoVeth, LinkAttribute, LinkMessage};
use rtnetlink::{AddressMessageBuilder, LinkMessageBuilder, LinkUnspec, LinkVeth, RouteMessageBuilder};

use super::nl::{NlError, NlSocket};

/// The name of a sandbox's end of its veth, inside its namespace.
pub const SANDBOX_IFNAME: &str = "eth0";

const ENODEV: i32 = 19;
const EEXIST: i32 = 17;

/// The index of link `name`, or `None` when there is none.
pub fn index_of(sock: &mut NlSocket, name: &str) -> Result<Option<u32>, NlError> {
    let msg = LinkUnspec::new_with_name(name).build();
    match sock.route_get(&format!("get link {name}"), RouteNetlinkMessage::GetLink(msg), false) {
        Ok(v) => Ok(v.into_iter().find_map(|m| match m {
            RouteNetlinkMessage::NewLink(l) => Some(l.header.index),
            _ => None,
        })),
        Err(e) if e.errno() == Some(ENODEV) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Every link of the namespace: (index, name).
pub fn links(sock: &mut NlSocket) -> Result<Vec<(u32, String)>, NlError> {
    let v = sock.route_get("list links", RouteNetlinkMessage::GetLink(LinkMessage::default()), true)?;
    Ok(v.into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewLink(l) => {
                let index = l.header.index;
                l.attributes.into_iter().find_map(|a| match a {
                    LinkAttribute::IfName(n) => Some((index, n)),
                    _ => None,
                })
            }
            _ => None,
        })
        .collect())
}

/// An IPv4 address of the namespace: address, prefix length, label, link index.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Addr {
    pub addr: Ipv4Addr,
    pub prefix: u8,
    pub label: String,
    pub index: u32,
}

/// Every IPv4 address of the namespace the socket is in.
pub fn addresses(sock: &mut NlSocket) -> Result<Vec<Addr>, NlError> {
    use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage};
    let v = sock.route_get("list addresses", RouteNetlinkMessage::GetAddress(AddressMessage::default()), true)?;
    Ok(v.into_iter()
        .filter_map(|m| match m {
            RouteNetlinkMessage::NewAddress(a) => {
                let (prefix, index) = (a.header.prefix_len, a.header.index);
                let mut ip = None;
                let mut label = String::new();
                for at in a.attributes {
                    match at {
                        AddressAttribute::Address(std::net::IpAddr::V4(x)) => ip = Some(x),
                        AddressAttribute::Label(l) => label = l,
                        _ => {}
                    }
                }
                ip.map(|addr| Addr { addr, prefix, label, index })
            }
            _ => None,
        })
        .collect())
}

/// Sets link `index` up.
fn up(sock: &mut NlSocket, index: u32, what: &str) -> Result<(), NlError> {
    let msg = LinkUnspec::new_with_index(index).up().build();
    sock.route_change(what, RouteNetlinkMessage::SetLink(msg), false)
}

fn add_address(sock: &mut NlSocket, index: u32, addr: Ipv4Addr, prefix: u8, what: &str) -> Result<(), NlError> {
    let msg = AddressMessageBuilder::<Ipv4Addr>::new().index(index).address(addr, prefix).build();
    sock.route_change(what, RouteNetlinkMessage::NewAddress(msg), true)
}

/// Creates the veth pair of a sandbox: `host_if` in the caller's namespace with `host_addr`,
/// `eth0` in the namespace at `netns` with `sandbox_addr` (both /31) and a default route via
/// the host end. Both ends up. On failure the pair is removed again.
pub fn create_veth(
    host: &mut NlSocket,
    netns: &Path,
    host_if: &str,
    host_addr: Ipv4Addr,
    sandbox_addr: Ipv4Addr,
) -> Result<(), NlError> {
    let ns = std::fs::File::open(netns).map_err(NlError::Socket)?;
    let peer =
        LinkMessageBuilder::<LinkUnspec>::new().name(SANDBOX_IFNAME.to_string()).setns_by_fd(ns.as_raw_fd()).build();
    let msg = LinkVeth::new(host_if, SANDBOX_IFNAME).set_info_data(InfoData::Veth(InfoVeth::Peer(peer))).build();
    host.route_change(&format!("create veth {host_if}"), RouteNetlinkMessage::NewLink(msg), true)?;
    let configured = (|| {
        let idx = index_of(host, host_if)?
            .ok_or_else(|| NlError::Malformed { what: format!("veth {host_if} vanished after its creation") })?;
        // No IPv6 on the host end: nothing of the sandbox's IPv6 reaches the host's stack.
        let _ = std::fs::write(format!("/proc/sys/net/ipv6/conf/{host_if}/disable_ipv6"), "1");
        add_address(host, idx, host_addr, 31, &format!("address of {host_if}"))?;
        up(host, idx, &format!("set {host_if} up"))?;
        let mut inner = NlSocket::route_in(netns)?;
        let idx = index_of(&mut inner, SANDBOX_IFNAME)?
            .ok_or_else(|| NlError::Malformed { what: "the sandbox's eth0 is missing".into() })?;
        add_address(&mut inner, idx, sandbox_addr, 31, "address of the sandbox's eth0")?;
        up(&mut inner, idx, "set the sandbox's eth0 up")?;
        let route = RouteMessageBuilder::<Ipv4Addr>::new().gateway(host_addr).output_interface(idx).build();
        inner.route_change("the sandbox's default route", RouteNetlinkMessage::NewRoute(route), true)
    })();
    if let Err(e) = configured {
        let _ = delete(host, host_if);
        return Err(e);
    }
    Ok(())
}

/// Link `name` of the namespace `sock` is in: its MAC set to `mac`, `addr`/`prefix` added,
/// up (a VM's tap, made by the tun device; see `backend::vm::net`).
pub fn configure(sock: &mut NlSocket, name: &str, mac: [u8; 6], addr: Ipv4Addr, prefix: u8) -> Result<(), NlError> {
    let idx = index_of(sock, name)?.ok_or_else(|| NlError::Malformed { what: format!("link {name} is missing") })?;
    let msg = LinkUnspec::new_with_index(idx).address(mac.to_vec()).build();
    sock.route_change(&format!("the MAC of {name}"), RouteNetlinkMessage::SetLink(msg), false)?;
    add_address(sock, idx, addr, prefix, &format!("the address of {name}"))?;
    up(sock, idx, &format!("set {name} up"))
}

/// Deletes link `name` (one end of a veth takes the other with it); a link that is not there
/// is no error.
pub fn delete(sock: &mut NlSocket, name: &str) -> Result<(), NlError> {
    let Some(idx) = index_of(sock, name)? else { return Ok(()) };
    let msg = LinkUnspec::new_with_index(idx).build();
    match sock.route_delete(&format!("delete link {name}"), RouteNetlinkMessage::DelLink(msg)) {
        Err(e) if e.errno() == Some(ENODEV) => Ok(()),
        r => r,
    }
}

/// Makes sure `lo` holds `addr`/32 under `label` (`lo:<something>`): the DNS proxy's
/// address, local to the host and reachable from every veth. The label tells this edge's
/// address from anyone else's.
pub fn ensure_local_address(sock: &mut NlSocket, label: &str, addr: Ipv4Addr) -> Result<(), NlError> {
    use rtnetlink::packet_route::address::AddressAttribute;
    let idx = index_of(sock, "lo")?.ok_or_else(|| NlError::Malformed { what: "no loopback link".into() })?;
    let mut msg = AddressMessageBuilder::<Ipv4Addr>::new().index(idx).address(addr, 32).build();
    msg.attributes.push(AddressAttribute::Label(label.to_string()));
    match sock.route_change(&format!("address {addr} on lo"), RouteNetlinkMessage::NewAddress(msg), true) {
        Err(e) if e.errno() == Some(EEXIST) => Ok(()),
        r => r,
    }
}

/// Removes `addr`/32 from `lo` (no error if it is not there).
pub fn remove_local_address(sock: &mut NlSocket, addr: Ipv4Addr) -> Result<(), NlError> {
    let idx = index_of(sock, "lo")?.ok_or_else(|| NlError::Malformed { what: "no loopback link".into() })?;
    let msg = AddressMessageBuilder::<Ipv4Addr>::new().index(idx).address(addr, 32).build();
    match sock.route_delete(&format!("address {addr} on lo"), RouteNetlinkMessage::DelAddress(msg)) {
        // EADDRNOTAVAIL: not there.
        Err(e) if e.errno() == Some(99) => Ok(()),
        r => r,
    }
}

/// The name of the interface of the default IPv4 route, if there is one.
pub fn default_route_interface(sock: &mut NlSocket) -> Result<Option<String>, NlError> {
    use rtnetlink::packet_route::route::{RouteAttribute, RouteMessage};
    let v = sock.route_get(
        "list routes",
        RouteNetlinkMessage::GetRoute(RouteMessageBuilder::<Ipv4Addr>::new().build()),
        true,
    )?;
    let oif = v.into_iter().find_map(|m| match m {
        RouteNetlinkMessage::NewRoute(RouteMessage { header, attributes, .. })
            if header.destination_prefix_length == 0 && header.table == 254 =>
        {
            attributes.into_iter().find_map(|a| match a {
                RouteAttribute::Oif(i) => Some(i),
                _ => None,
            })
        }
        _ => None,
    });
    let Some(oif) = oif else { return Ok(None) };
    let msg = LinkUnspec::new_with_index(oif).build();
    let v = sock.route_get("get the default route's link", RouteNetlinkMessage::GetLink(msg), false)?;
    Ok(v.into_iter().find_map(|m| match m {
        RouteNetlinkMessage::NewLink(l) => l.attributes.into_iter().find_map(|a| match a {
            LinkAttribute::IfName(n) => Some(n),
            _ => None,
        }),
        _ => None,
    }))
}
