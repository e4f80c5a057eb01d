//! Sandbox ids as E2B shows them, and sandbox hosts (`<port>-<id>.<domain>`, E2B's
//! `get_host(port)` and the URLs its SDK derives when no `E2B_SANDBOX_URL` is set).
//!
//! An opendsec id is `<edge>.<lease>`; a DNS label holds no dot, so E2B sees `<edge>-<lease>`
//! ([C 16]). That is reversible when the lease holds no dash (split at the last one): every
//! lease opendsec makes is hex, and the gateway makes the lease of an idempotent creation
//! dash-free too. A sandbox whose lease has a dash (one named by an opendsec client) keeps
//! its dotted id: it works everywhere but in a host name. Both forms are accepted
//! everywhere an id is.

use axum::http::HeaderMap;

/// The id E2B's SDKs see for the opendsec sandbox `id`.
pub fn e2b_id(id: &str) -> String {
    match id.split_once('.') {
        Some((edge, lease)) if !lease.contains('-') => format!("{edge}-{lease}"),
        _ => id.to_string(),
    }
}

/// The opendsec id an E2B id stands for (a dotted id as it is).
pub fn opendsec_id(id: &str) -> String {
    if id.contains('.') {
        return id.to_string();
    }
    match id.rsplit_once('-') {
        Some((edge, lease)) if !edge.is_empty() && !lease.is_empty() => format!("{edge}.{lease}"),
        _ => id.to_string(),
    }
}

/// The sandbox and port a request's host names, `<port>-<id>.<domain>` (the left-most label,
/// as E2B's proxy reads it) under the gateway's `domain` only. `None`: not a sandbox host (an
/// address, `localhost`, the API's own name, a name under another domain), so the REST API's.
pub fn target(h: &HeaderMap, domain: &str) -> Option<(u16, String)> {
    let host = crate::header(h, "host")?;
    parse(host, domain)
}

/// A host name without its port (`None`: an IPv6 address, never a sandbox host).
fn name_of(host: &str) -> Option<&str> {
    if host.starts_with('[') {
        return None;
    }
    Some(host.rsplit_once(':').map_or(host, |(n, _)| n))
}

fn parse(host: &str, domain: &str) -> Option<(u16, String)> {
    let name = name_of(host)?.trim_end_matches('.').to_ascii_lowercase();
    let domain = name_of(domain)?.trim_end_matches('.').to_ascii_lowercase();
    let (label, rest) = name.split_once('.')?;
    if rest != domain {
        return None;
    }
    let (port, id) = label.split_once('-')?;
    if port.is_empty() || port.len() > 5 || !port.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let port = port.parse::<u16>().ok().filter(|p| *p != 0)?;
    let id = opendsec_id(id);
    opendsec_common::ids::split_sandbox_id(&id).ok()?;
    Some((port, id))
}

/// The domain sandbox hosts are under, as the create and connect answers give it (the SDK
/// builds `<port>-<id>.<domain>` from it): `e2b.domain`, else `sandbox.localhost` and the
/// gateway's port (every `*.localhost` name is the loopback address; three labels, so that a
/// certificate for `*.sandbox.localhost` is one every TLS client accepts).
pub fn domain(configured: &str, port: u16) -> String {
    if !configured.is_empty() {
        return configured.to_string();
    }
    if port == 443 { DEFAULT_DOMAIN.to_string() } else { format!("{DEFAULT_DOMAIN}:{port}") }
}

/// The domain a gateway uses when none is configured (with its port).
pub const DEFAULT_DOMAIN: &str = "sandbox.localhost";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_lose_their_dot_and_get_it_back() {
        for id in ["edge-000.0196f0c2a1b2c3d4e5f6a7b8", "e.1", "edge_a-b.abc"] {
            let e = e2b_id(id);
            assert!(!e.contains('.'), "{e}");
            assert_eq!(opendsec_id(&e), id);
        }
        // A lease with a dash keeps the dot: the dashed form would be ambiguous.
        assert_eq!(e2b_id("edge-000.my-lease"), "edge-000.my-lease");
        assert_eq!(opendsec_id("edge-000.my-lease"), "edge-000.my-lease");
        assert_eq!(opendsec_id("nodash"), "nodash");
    }

    #[test]
    fn sandbox_hosts_name_a_port_and_a_sandbox() {
        let id = "edge-000.0196f0c2a1b2c3d4e5f6a7b8";
        let d = "sandbox.localhost:8443";
        let host = format!("8001-{}.sandbox.localhost:8443", e2b_id(id));
        assert_eq!(parse(&host, d), Some((8001, id.to_string())));
        let e2b = "E2B.example.com";
        assert_eq!(parse(&format!("49983-{}.e2b.EXAMPLE.com.", e2b_id(id)), e2b), Some((49983, id.to_string())));
        for not in [
            "127.0.0.1:8443",
            "localhost:8443",
            "[::1]:8443",
            "sandbox.localhost:8443",
            "api.sandbox.localhost",
            "0-edge-000-0196f0c2a1b2c3d4e5f6a7b8.sandbox.localhost",
            "99999-edge-000-0196f0c2a1b2c3d4e5f6a7b8.sandbox.localhost",
            "x1-edge-000-0196f0c2a1b2c3d4e5f6a7b8.sandbox.localhost",
            "8001-UPPER_.sandbox.localhost",
            "8001-.sandbox.localhost",
            // Under another name (a rebinding page's, a deeper one): not ours.
            "8001-edge-000-0196f0c2a1b2c3d4e5f6a7b8.attacker.example",
            "8001-edge-000-0196f0c2a1b2c3d4e5f6a7b8.x.sandbox.localhost",
        ] {
            assert_eq!(parse(not, d), None, "{not}");
        }
    }

    #[test]
    fn the_domain_carries_the_port_unless_it_is_https_own() {
        assert_eq!(domain("", 8443), "sandbox.localhost:8443");
        assert_eq!(domain("", 443), "sandbox.localhost");
        assert_eq!(domain("e2b.example.com", 8443), "e2b.example.com");
    }
}
