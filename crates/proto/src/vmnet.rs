//! What the edge and a VM guest's init agree on. The network every VM guest sees, the same in every VM and every copy restored from a
//! snapshot ([C 7] "network for clones"): its NIC has one fixed address and MAC behind a tap of
//! one fixed name and MAC in the sandbox's own network namespace, where the edge translates
//! the guest's address to the sandbox's own (and the gateway's DNS port to the edge's DNS
//! proxy). A copy's guest therefore needs no change to its network: only the namespace around
//! it is new. Shared by the edge (which builds the namespace) and the agent (which configures
//! the guest).

use std::net::Ipv4Addr;

/// The guest's address on its NIC.
pub const GUEST_ADDR: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 2);
/// The tap's address in the sandbox's namespace: the guest's gateway and name server.
pub const GATEWAY_ADDR: Ipv4Addr = Ipv4Addr::new(172, 16, 0, 1);
/// The prefix length of the link between them.
pub const PREFIX: u8 = 30;
/// The tap's name in the sandbox's namespace.
pub const TAP: &str = "tap0";
/// The tap's MAC: what the guest's neighbour table holds for its gateway, in every copy.
pub const TAP_MAC: [u8; 6] = [0x02, 0x6f, 0x64, 0x00, 0x00, 0x01];
/// The guest NIC's MAC.
pub const GUEST_MAC: [u8; 6] = [0x02, 0x6f, 0x64, 0x00, 0x00, 0x02];

/// What a guest's init prints on its console, before the reason, when it cannot start the
/// agent (the edge then fails the creation at once instead of waiting for its boot timeout).
pub const INIT_FAILED: &str = "OPENDSEC-INIT-FAILED:";

/// `aa:bb:..` of `mac`.
pub fn mac_text(mac: [u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect::<Vec<_>>().join(":")
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_link_holds_both_ends() {
        let net = |a: std::net::Ipv4Addr| u32::from(a) >> (32 - super::PREFIX);
        assert_eq!(net(super::GUEST_ADDR), net(super::GATEWAY_ADDR));
        assert_eq!(super::mac_text(super::GUEST_MAC), "02:6f:64:00:00:02");
    }
}
