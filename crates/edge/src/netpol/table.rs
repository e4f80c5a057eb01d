//! The edge's nftables table: its fixed part (base chains, hooks, the always-closed ranges) is
//! loaded with `nft -f` once at start; each sandbox adds its own chain and two sets of its own
//! over netlink ([`super::nl`]), in one batch.
//!
//! Every packet a sandbox sends enters its own chain, matched by its host-side veth **and**
//! source address: `sandboxes` maps (veth, address) to the sandbox's conntrack mark, so a
//! forged source matches nothing and is dropped; `jumps` maps the same pair to a jump into
//! chain `s_<slot>`, whose two rules accept what its sets `a_<slot>` (networks) and `r_<slot>`
//! (addresses learned through DNS, with timeouts) hold as (destination . protocol . port)
//! ranges. A sandbox's sets are small whatever the number of sandboxes, so changing them costs
//! the same with 10 sandboxes or 10,000 (one shared set of every sandbox's ranges made each
//! deletion walk all of them). Established connections pass through the same checks: taking
//! a rule back cuts its connections at the next packet. New connections towards a sandbox are
//! dropped on every path (forward from anywhere, output from the host); replies pass.
//!
//! Conntrack is bounded three ways, for new connections only (chain `limits`): per sandbox
//! (connections open and new ones a second, dynamic sets keyed by source address), per
//! tenant (`tenants` maps a sandbox's (veth, address) to a jump into chain `t_<n>` of its
//! top-level project, whose `ct count` and rate rules count every sandbox of that tenant
//! together), and per edge (chain `shed`, which the edge fills with a drop while the host's
//! conntrack table is fuller than `network.conntrack_shed_percent`; lookups at the edge's DNS
//! proxy are not shed). Closed TCP connections of sandboxes leave conntrack after 10 s
//! (`sandbox_tcp`), so what a tenant's bounded rate of new ones leaves behind is bounded too.

use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::time::Duration;

use opendsec_common::egress::Ipv4Net;

use super::boxes::Box3;
use super::nl::Element;

/// Connections one sandbox may have open at once (conntrack entries not closed).
pub const MAX_CONNS: u32 = 4096;
/// New connections per second one sandbox may open (burst: twice that).
pub const NEW_CONN_RATE: u32 = 200;

/// The maps every sandbox has an element in.
pub const SANDBOXES: &str = "sandboxes";
pub const CHAINS: &str = "jumps";
/// (veth, address) -> a jump into the sandbox's tenant's chain ([`tenant_chain`]).
pub const TENANTS: &str = "tenants";
/// The chain that drops every new connection of a sandbox while the edge sheds load.
pub const SHED: &str = "shed";

/// The conntrack timeout policy of sandboxes' TCP connections, and how long a closed one stays.
pub const TCP_TIMEOUTS: &str = "sandbox_tcp";
const CLOSED_SECS: u32 = 10;

/// The name of a tenant's chain on this edge (its index in the edge's table).
pub fn tenant_chain(index: u32) -> String {
    format!("t_{index:x}")
}
/// (veth, address) -> the sandbox's reply chain, for packets towards it.
pub const REPLY_CHAINS: &str = "replies";

/// The name of slot `slot`'s reply chain: replies pass only from what its sets still allow.
pub fn reply_chain(slot: u32) -> String {
    format!("i_{slot:x}")
}

/// The names of slot `slot`'s chain, network set and learned set. The underscore keeps a
/// name from ever spelling an nft keyword (`a` + `dd` would be `add`, which the recovery
/// script could not name).
pub fn slot_names(slot: u32) -> (String, String, String) {
    (format!("s_{slot:x}"), format!("a_{slot:x}"), format!("r_{slot:x}"))
}

/// One sandbox's part of a rebuild from records.
#[derive(Clone, Debug)]
pub struct SlotTable {
    pub slot: u32,
    pub ifname: String,
    pub addr: Ipv4Addr,
    pub mark: u32,
    pub allow: Vec<Element>,
    /// Its tenant's chain ([`tenant_chain`]).
    pub tenant_chain: String,
}

/// The fixed facts the table is made from.
#[derive(Clone, Debug)]
pub struct TableSpec {
    pub name: String,
    /// Host-side veth names all start with this (`nft` wildcard `<prefix>*`).
    pub veth_prefix: String,
    pub subnet: Ipv4Net,
    /// Where the DNS proxy listens (UDP and TCP 53).
    pub dns: Ipv4Addr,
    /// The uplink egress is masqueraded through; empty (the host had no default route when
    /// the edge started): every interface but the sandboxes' own, so that a route added later
    /// works.
    pub uplink: String,
    /// Closed whatever the rules: the host's own addresses and the edge's subnet.
    pub local: Vec<Ipv4Net>,
    /// Closed unless a rule's network lies in an opened range: always-closed ranges minus
    /// the operator's `network.open_private`, as address intervals.
    pub closed: Vec<(u32, u32)>,
    /// Who owns the table (the table's comment): an edge finding another owner's table under
    /// its name refuses to touch it.
    pub owner: String,
    /// Connections one tenant's sandboxes may have open together, and new ones a second.
    pub tenant_conns: u32,
    pub tenant_rate: u32,
}

fn ip(a: u32) -> Ipv4Addr {
    Ipv4Addr::from(a)
}

fn intervals(v: &[(u32, u32)]) -> String {
    v.iter()
        .map(|(a, b)| if a == b { ip(*a).to_string() } else { format!("{}-{}", ip(*a), ip(*b)) })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The table as `nft -f` input: created (or replaced) whole, in one transaction, with the
/// given per-sandbox elements (recovery) already in.
pub fn script(t: &TableSpec, sandboxes: &[SlotTable]) -> String {
    let mut s = String::new();
    let n = &t.name;
    let p = &t.veth_prefix;
    // Create-then-delete makes the delete safe when the table does not exist yet.
    let _ = writeln!(s, "table inet {n} {{}}\ndelete table inet {n}\ntable inet {n} {{");
    let _ = writeln!(s, "  comment \"{}\"", t.owner.replace('"', ""));
    let _ = writeln!(s, "  map {SANDBOXES} {{ type ifname . ipv4_addr : mark; }}");
    let _ = writeln!(s, "  map {CHAINS} {{ type ifname . ipv4_addr : verdict; }}");
    let _ = writeln!(s, "  map {REPLY_CHAINS} {{ type ifname . ipv4_addr : verdict; }}");
    let _ = writeln!(s, "  map {TENANTS} {{ type ifname . ipv4_addr : verdict; }}");
    let local: Vec<(u32, u32)> = t.local.iter().map(|l| (l.first(), l.last())).collect();
    let _ = writeln!(
        s,
        "  set local {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {} }} }}",
        intervals(&local)
    );
    if t.closed.is_empty() {
        let _ = writeln!(s, "  set closed {{ type ipv4_addr; flags interval; }}");
    } else {
        let _ = writeln!(
            s,
            "  set closed {{ type ipv4_addr; flags interval; auto-merge; elements = {{ {} }} }}",
            intervals(&t.closed)
        );
    }
    // Per-sandbox bounds on conntrack: connections open at once, and new ones per second
    // (closed TCP connections linger in conntrack; the rate bounds what they can fill).
    // Sandboxes' closed TCP connections linger in the host's conntrack table 10 s, not the
    // kernel's 120 s: what a tenant's new connections a second can leave behind is bounded by
    // that (a tenant's `ct count` does not see closed ones).
    let _ = writeln!(
        s,
        "  ct timeout {TCP_TIMEOUTS} {{ protocol tcp; l3proto ip; policy = {{ time_wait: {CLOSED_SECS}, close: {CLOSED_SECS} }}; }}"
    );
    let _ = writeln!(s, "  set conns {{ type ipv4_addr; flags dynamic; size 65536; }}");
    let _ = writeln!(s, "  set new_rate {{ type ipv4_addr; flags dynamic,timeout; timeout 60s; size 65536; }}");
    let _ = writeln!(s, "  set dns_tcp_rate {{ type ipv4_addr; flags dynamic,timeout; timeout 60s; size 65536; }}");
    let _ = writeln!(
        s,
        r#"  chain forward {{
    type filter hook forward priority filter - 10; policy accept;
    iifname "{p}*" jump egress
    ip saddr {subnet} drop
    oifname "{p}*" ct state related accept
    oifname "{p}*" ct state established oifname . ip daddr vmap @{REPLY_CHAINS}
    oifname "{p}*" drop
  }}
  chain {SHED} {{
  }}
  chain limits {{
    ct state new update @new_rate {{ ip saddr limit rate over {new_rate}/second burst {new_burst} packets }} drop
    ct state new add @conns {{ ip saddr ct count over {max_conns} }} drop
    ct state new iifname . ip saddr vmap @{TENANTS}
    ct state new ip daddr != {dns} jump {SHED}
    ct state new meta l4proto tcp ct timeout set "{TCP_TIMEOUTS}"
  }}
  chain egress {{
    meta nfproto != ipv4 drop
    iifname . ip saddr != @{SANDBOXES} drop
    ct mark set iifname . ip saddr map @{SANDBOXES}
    jump limits
    udp dport {{ 53, 853 }} drop
    tcp dport {{ 53, 853 }} drop
    ip daddr @local drop
    ip daddr @closed drop
    iifname . ip saddr vmap @{CHAINS}
    drop
  }}
  chain input {{
    type filter hook input priority filter - 10; policy accept;
    iifname "{p}*" jump to_host
    ip saddr {subnet} drop
  }}
  chain to_host {{
    meta nfproto != ipv4 drop
    iifname . ip saddr != @{SANDBOXES} drop
    ct mark set iifname . ip saddr map @{SANDBOXES}
    jump limits
    ip daddr {dns} udp dport 53 accept
    ip daddr {dns} tcp dport 53 ct state new update @dns_tcp_rate {{ ip saddr limit rate over 20/second burst 40 packets }} drop
    ip daddr {dns} tcp dport 53 accept
    drop
  }}
  chain output {{
    type filter hook output priority filter - 10; policy accept;
    oifname "{p}*" ct state established,related accept
    oifname "{p}*" drop
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {subnet} {masquerade_out} masquerade
  }}
}}"#,
        dns = t.dns,
        subnet = t.subnet,
        masquerade_out =
            if t.uplink.is_empty() { format!(r#"oifname != "{p}*""#) } else { format!(r#"oifname "{}""#, t.uplink) },
        max_conns = MAX_CONNS,
        new_rate = NEW_CONN_RATE,
        new_burst = NEW_CONN_RATE * 2,
    );
    // The tenants' chains, then per-sandbox chains, sets and elements, for a rebuild from
    // records.
    let mut tenants: Vec<&str> = sandboxes.iter().map(|sb| sb.tenant_chain.as_str()).collect();
    tenants.sort_unstable();
    tenants.dedup();
    for c in tenants {
        let _ = writeln!(s, "add chain inet {n} {c}");
        let _ = writeln!(s, "add rule inet {n} {c} ct count over {} drop", t.tenant_conns);
        let _ = writeln!(
            s,
            "add rule inet {n} {c} limit rate over {}/second burst {} packets drop",
            t.tenant_rate,
            t.tenant_rate.saturating_mul(2)
        );
    }
    let boxes = "type ipv4_addr . inet_proto . inet_service";
    for sb in sandboxes {
        let (chain, allow, learned) = slot_names(sb.slot);
        let _ = writeln!(s, "add set inet {n} {allow} {{ {boxes}; flags interval; }}");
        let _ = writeln!(s, "add set inet {n} {learned} {{ {boxes}; flags interval,timeout; }}");
        let _ = writeln!(s, "add chain inet {n} {chain}");
        let replies = reply_chain(sb.slot);
        let _ = writeln!(s, "add chain inet {n} {replies}");
        for set in [&allow, &learned] {
            let _ = writeln!(s, "add rule inet {n} {chain} ip daddr . meta l4proto . th dport @{set} accept");
            let _ = writeln!(s, "add rule inet {n} {replies} ip saddr . meta l4proto . th sport @{set} accept");
        }
        let e: Vec<String> = sb.allow.iter().filter_map(element_text).collect();
        if !e.is_empty() {
            let _ = writeln!(s, "add element inet {n} {allow} {{ {} }}", e.join(", "));
        }
        let (ifname, addr) = (&sb.ifname, sb.addr);
        let _ = writeln!(s, "add element inet {n} {SANDBOXES} {{ \"{ifname}\" . {addr} : {:#x} }}", sb.mark);
        let _ = writeln!(s, "add element inet {n} {CHAINS} {{ \"{ifname}\" . {addr} : jump {chain} }}");
        let _ = writeln!(s, "add element inet {n} {REPLY_CHAINS} {{ \"{ifname}\" . {addr} : jump {replies} }}");
        let tc = &sb.tenant_chain;
        let _ = writeln!(s, "add element inet {n} {TENANTS} {{ \"{ifname}\" . {addr} : jump {tc} }}");
    }
    s
}

/// The `nft` text of a box element (from its key bytes).
fn element_text(e: &Element) -> Option<String> {
    let lo = decode_box_key(&e.key)?;
    let hi = decode_box_key(e.key_end.as_ref().unwrap_or(&e.key))?;
    let range = |a: String, b: String| if a == b { a } else { format!("{a}-{b}") };
    Some(format!(
        "{} . {} . {}",
        range(ip(lo.0).to_string(), ip(hi.0).to_string()),
        range(lo.1.to_string(), hi.1.to_string()),
        range(lo.2.to_string(), hi.2.to_string())
    ))
}

/// Key bytes of a box element: destination . protocol . port, each field padded to 4 bytes
/// as the kernel's registers hold them.
pub fn box_key(dst: u32, proto: u8, port: u16) -> Vec<u8> {
    let mut k = Vec::with_capacity(12);
    k.extend_from_slice(&dst.to_be_bytes());
    k.extend_from_slice(&[proto, 0, 0, 0]);
    k.extend_from_slice(&port.to_be_bytes());
    k.extend_from_slice(&[0, 0]);
    k
}

fn decode_box_key(k: &[u8]) -> Option<(u32, u8, u16)> {
    if k.len() != 12 {
        return None;
    }
    Some((u32::from_be_bytes(k[0..4].try_into().ok()?), k[4], u16::from_be_bytes([k[8], k[9]])))
}

/// The elements of boxes (disjoint already), with an optional timeout.
pub fn box_elements(boxes: &[Box3], timeout: Option<Duration>) -> Vec<Element> {
    boxes
        .iter()
        .map(|b| Element {
            key: box_key(b.addr.0, b.proto.0, b.port.0),
            key_end: Some(box_key(b.addr.1, b.proto.1, b.port.1)),
            data: None,
            timeout,
            jump: None,
        })
        .collect()
}

fn pair_key(ifname: &str, addr: Ipv4Addr) -> Vec<u8> {
    let mut key = vec![0u8; 16];
    let n = ifname.len().min(15);
    key[..n].copy_from_slice(&ifname.as_bytes()[..n]);
    key.extend_from_slice(&addr.octets());
    key
}

/// The `chains` element of a sandbox: (host-side veth, address) -> jump to its chain.
pub fn chain_element(ifname: &str, addr: Ipv4Addr, chain: &str) -> Element {
    Element { key: pair_key(ifname, addr), key_end: None, data: None, timeout: None, jump: Some(chain.into()) }
}

/// The `sandboxes` element of a sandbox: (host-side veth, address) -> conntrack mark.
pub fn sandbox_element(ifname: &str, addr: Ipv4Addr, mark: u32) -> Element {
    // Marks are host-endian integers in the kernel's registers.
    Element {
        key: pair_key(ifname, addr),
        key_end: None,
        data: Some(mark.to_ne_bytes().to_vec()),
        timeout: None,
        jump: None,
    }
}

/// `ranges` minus `holes`, as sorted disjoint intervals.
pub fn subtract(ranges: &[Ipv4Net], holes: &[Ipv4Net]) -> Vec<(u32, u32)> {
    let mut out: Vec<(u32, u32)> = ranges.iter().map(|r| (r.first(), r.last())).collect();
    for h in holes {
        let (hs, he) = (h.first(), h.last());
        out = out
            .into_iter()
            .flat_map(|(a, b)| {
                if he < a || hs > b {
                    return vec![(a, b)];
                }
                let mut v = Vec::new();
                if hs > a {
                    v.push((a, hs - 1));
                }
                if he < b {
                    v.push((he + 1, b));
                }
                v
            })
            .collect();
    }
    out.sort_unstable();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> Ipv4Net {
        Ipv4Net::parse(s).unwrap()
    }

    #[test]
    fn opened_networks_are_cut_out_of_the_closed_ranges() {
        let c = subtract(&[net("10.0.0.0/8"), net("169.254.0.0/16")], &[net("10.1.0.0/16")]);
        assert_eq!(
            c,
            vec![
                (net("10.0.0.0/16").first(), net("10.0.255.255/32").first()),
                (net("10.2.0.0/32").first(), net("10.255.255.255/32").first()),
                (net("169.254.0.0/16").first(), net("169.254.0.0/16").last())
            ]
        );
        assert_eq!(subtract(&[net("10.0.0.0/8")], &[net("0.0.0.0/0")]), vec![]);
    }

    #[test]
    fn keys_round_trip_into_nft_text() {
        let src: Ipv4Addr = "10.88.0.3".parse().unwrap();
        let b =
            Box3 { addr: (net("203.0.113.0/24").first(), net("203.0.113.0/24").last()), proto: (6, 6), port: (80, 80) };
        let e = box_elements(&[b], None);
        assert_eq!(element_text(&e[0]).unwrap(), "203.0.113.0-203.0.113.255 . 6 . 80");
        let s = sandbox_element("odab12-1", src, 7);
        assert_eq!(s.key.len(), 20);
        assert_eq!(&s.key[..8], b"odab12-1");
    }
}
