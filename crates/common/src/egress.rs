//! Egress rules of a sandbox (issue 11, [C 9]): what they may name, their text form, their
//! checks, and when one rule lies within another (a project's ceiling).
//!
//! Pure functions over plain data: the apiserver and IAM check rules with them, the edge
//! compiles them into its nftables sets and DNS proxy policy.
//!
//! A rule is a target (`*`, an IPv4 network, a domain with its subdomains, or `@name`, a rule
//! set from the cluster config), optionally limited to one protocol and, for TCP and UDP, a
//! destination port range. Text form: `TARGET[:PROTOCOL[/PORT[-PORT]]]`.

use std::fmt;
use std::net::Ipv4Addr;

use opendsec_proto::v1 as pb;

/// Most rules one sandbox (or one ceiling, or one named set) may hold.
pub const MAX_RULES: usize = 64;
/// Longest domain name (RFC 1035, without the final dot).
pub const MAX_DOMAIN: usize = 253;
/// Longest rule set name.
pub const MAX_SET_NAME: usize = 63;

/// A rule that cannot be used, with the rule's text and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("egress rule {rule:?}: {why}")]
pub struct EgressError {
    pub rule: String,
    pub why: String,
}

/// Longest rule text an error repeats (a rule is at most a domain and a few characters).
const MAX_SHOWN: usize = 300;

fn bad(rule: impl Into<String>, why: impl Into<String>) -> EgressError {
    let mut rule = rule.into();
    if rule.len() > MAX_SHOWN {
        let cut = (0..=MAX_SHOWN).rev().find(|i| rule.is_char_boundary(*i)).unwrap_or(0);
        rule.truncate(cut);
        rule.push('…');
    }
    EgressError { rule, why: why.into() }
}

/// An IPv4 network: its first address and prefix length (host bits zero).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Ipv4Net {
    pub addr: Ipv4Addr,
    pub prefix: u8,
}

impl Ipv4Net {
    /// Parses `a.b.c.d/n` or a bare address (a /32). Host bits must be zero.
    pub fn parse(s: &str) -> Result<Ipv4Net, String> {
        let (a, p) = s.split_once('/').unwrap_or((s, "32"));
        let addr: Ipv4Addr = a.parse().map_err(|_| format!("{a:?} is not an IPv4 address"))?;
        let prefix: u8 = p.parse().ok().filter(|p| *p <= 32).ok_or_else(|| format!("bad prefix length {p:?}"))?;
        let net = Ipv4Net { addr, prefix };
        if net.first() != u32::from(addr) {
            return Err(format!("{s} has host bits set (the network is {})", Ipv4Net::of(addr, prefix)));
        }
        Ok(net)
    }

    /// The network of `prefix` bits that holds `addr`.
    pub fn of(addr: Ipv4Addr, prefix: u8) -> Ipv4Net {
        let mask = Self::mask(prefix);
        Ipv4Net { addr: Ipv4Addr::from(u32::from(addr) & mask), prefix }
    }

    fn mask(prefix: u8) -> u32 {
        if prefix == 0 { 0 } else { u32::MAX << (32 - u32::from(prefix.min(32))) }
    }

    pub fn first(&self) -> u32 {
        u32::from(self.addr) & Self::mask(self.prefix)
    }

    pub fn last(&self) -> u32 {
        self.first() | !Self::mask(self.prefix)
    }

    pub fn contains(&self, a: Ipv4Addr) -> bool {
        (self.first()..=self.last()).contains(&u32::from(a))
    }

    /// Whether every address of `other` is in `self`.
    pub fn covers(&self, other: &Ipv4Net) -> bool {
        self.first() <= other.first() && other.last() <= self.last()
    }

    pub fn overlaps(&self, other: &Ipv4Net) -> bool {
        self.first() <= other.last() && other.first() <= self.last()
    }

    /// How many addresses it holds.
    pub fn size(&self) -> u64 {
        1u64 << (32 - u32::from(self.prefix))
    }
}

impl fmt::Display for Ipv4Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix)
    }
}

/// Ranges no sandbox reaches whatever its rules, unless the operator opens a network of them
/// in the cluster config (`network.open_private`): private (RFC 1918), shared (100.64/10),
/// "this network", loopback, link-local (cloud metadata services live there), the IETF
/// protocol block, benchmarking (198.18/15), multicast, reserved and broadcast, and Azure's
/// WireServer (168.63.129.16: a public address that hands a VM's secrets to whoever asks from
/// it).
pub const ALWAYS_CLOSED: [(&str, u8); 11] = [
    ("0.0.0.0", 8),
    ("10.0.0.0", 8),
    ("100.64.0.0", 10),
    ("127.0.0.0", 8),
    ("168.63.129.16", 32),
    ("169.254.0.0", 16),
    ("172.16.0.0", 12),
    ("192.0.0.0", 24),
    ("192.168.0.0", 16),
    ("198.18.0.0", 15),
    ("224.0.0.0", 3),
];

/// [`ALWAYS_CLOSED`] as networks.
pub fn always_closed() -> Vec<Ipv4Net> {
    ALWAYS_CLOSED
        .iter()
        .map(|(a, p)| Ipv4Net { addr: a.parse().unwrap_or(Ipv4Addr::UNSPECIFIED), prefix: *p })
        .collect()
}

/// What a rule lets through.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// Every public address.
    Any,
    Network(Ipv4Net),
    /// A domain and its subdomains (lowercase, no final dot).
    Domain(String),
    /// A rule set named in the cluster config (`network.rule_sets`).
    Named(String),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    Any,
    Tcp,
    Udp,
    Icmp,
}

impl Protocol {
    pub fn name(self) -> &'static str {
        match self {
            Protocol::Any => "",
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
            Protocol::Icmp => "icmp",
        }
    }

    /// The IP protocol numbers it covers (inclusive).
    pub fn numbers(self) -> (u8, u8) {
        match self {
            Protocol::Any => (0, 255),
            Protocol::Tcp => (6, 6),
            Protocol::Udp => (17, 17),
            Protocol::Icmp => (1, 1),
        }
    }
}

/// One egress rule, checked.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Rule {
    pub target: Target,
    pub protocol: Protocol,
    /// Destination ports, inclusive; `(0, 65535)` is any port (always so for ICMP and for
    /// any protocol).
    pub ports: (u16, u16),
}

pub const ANY_PORT: (u16, u16) = (0, u16::MAX);

impl Rule {
    /// A rule for `target` on any protocol and port.
    pub fn to(target: Target) -> Rule {
        Rule { target, protocol: Protocol::Any, ports: ANY_PORT }
    }

    /// Parses the text form `TARGET[:PROTOCOL[/PORT[-PORT]]]`.
    pub fn parse(text: &str) -> Result<Rule, EgressError> {
        let (target, rest) = text.split_once(':').unwrap_or((text, ""));
        let (proto, ports) = rest.split_once('/').unwrap_or((rest, ""));
        let (min, max) = if ports.is_empty() {
            (0, 0)
        } else {
            let (a, b) = ports.split_once('-').unwrap_or((ports, ports));
            let port = |p: &str| p.parse::<u32>().map_err(|_| bad(text, format!("bad port {p:?}")));
            let (a, b) = (port(a)?, port(b)?);
            if a == 0 || b == 0 {
                return Err(bad(text, "ports must be 1..=65535, the first not above the last"));
            }
            (a, b)
        };
        if rest.contains(':') {
            return Err(bad(text, "more than one ':'"));
        }
        Rule::from_parts(text, target, proto, min, max)
    }

    /// Checks a rule from the API.
    pub fn from_pb(r: &pb::EgressRule) -> Result<Rule, EgressError> {
        let text = pb_text(r);
        Rule::from_parts(&text, &r.target, &r.protocol, r.port_min, r.port_max)
    }

    fn from_parts(text: &str, target: &str, proto: &str, min: u32, max: u32) -> Result<Rule, EgressError> {
        let target = parse_target(target).map_err(|why| bad(text, why))?;
        let protocol = match proto {
            "" | "any" => Protocol::Any,
            "tcp" => Protocol::Tcp,
            "udp" => Protocol::Udp,
            "icmp" => Protocol::Icmp,
            p => return Err(bad(text, format!("unknown protocol {p:?} (tcp, udp or icmp)"))),
        };
        let ports = match (min, max) {
            (0, 0) => ANY_PORT,
            _ if !matches!(protocol, Protocol::Tcp | Protocol::Udp) => {
                return Err(bad(text, "ports need the protocol tcp or udp"));
            }
            (a, b) if a == 0 || b == 0 || a > b || b > 65535 => {
                return Err(bad(text, "ports must be 1..=65535, the first not above the last"));
            }
            (a, b) => (a as u16, b as u16),
        };
        Ok(Rule { target, protocol, ports })
    }

    pub fn to_pb(&self) -> pb::EgressRule {
        let (port_min, port_max) = if self.ports == ANY_PORT { (0, 0) } else { self.ports };
        pb::EgressRule {
            target: self.target_text(),
            protocol: self.protocol.name().into(),
            port_min: port_min.into(),
            port_max: port_max.into(),
        }
    }

    fn target_text(&self) -> String {
        match &self.target {
            Target::Any => "*".into(),
            Target::Network(n) => n.to_string(),
            Target::Domain(d) => d.clone(),
            Target::Named(n) => format!("@{n}"),
        }
    }

    /// Whether everything this rule lets through, `outer` lets through too (a ceiling check).
    /// A domain lies only within the same domain, a parent domain or `*`; a named set only
    /// within the same name or `*` (sets are expanded by the edges, not here).
    pub fn within(&self, outer: &Rule) -> bool {
        let proto = outer.protocol == Protocol::Any || outer.protocol == self.protocol;
        let ports = outer.ports.0 <= self.ports.0 && self.ports.1 <= outer.ports.1;
        let target = match (&self.target, &outer.target) {
            (_, Target::Any) => true,
            (Target::Network(n), Target::Network(o)) => o.covers(n),
            (Target::Domain(d), Target::Domain(o)) => domain_within(d, o),
            (Target::Named(n), Target::Named(o)) => n == o,
            _ => false,
        };
        proto && ports && target
    }
}

/// The text form of a rule from the API, for messages (whatever it holds).
pub fn pb_text(r: &pb::EgressRule) -> String {
    let mut t = r.target.clone();
    if !r.protocol.is_empty() || r.port_min != 0 || r.port_max != 0 {
        t.push(':');
        t.push_str(&r.protocol);
    }
    if r.port_min != 0 || r.port_max != 0 {
        if r.port_min == r.port_max {
            t.push_str(&format!("/{}", r.port_min));
        } else {
            t.push_str(&format!("/{}-{}", r.port_min, r.port_max));
        }
    }
    t
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&pb_text(&self.to_pb()))
    }
}

/// Whether `name` is `domain` or one of its subdomains.
pub fn domain_within(name: &str, domain: &str) -> bool {
    name == domain
        || (name.len() > domain.len()
            && name.ends_with(domain)
            && name.as_bytes()[name.len() - domain.len() - 1] == b'.')
}

fn parse_target(t: &str) -> Result<Target, String> {
    if t == "*" {
        return Ok(Target::Any);
    }
    if let Some(name) = t.strip_prefix('@') {
        let ok = !name.is_empty()
            && name.len() <= MAX_SET_NAME
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_');
        return if ok { Ok(Target::Named(name.into())) } else { Err("rule set names are [a-z0-9_-]{1,63}".into()) };
    }
    if t.bytes().next().is_some_and(|b| b.is_ascii_digit())
        && t.bytes().all(|b| b.is_ascii_digit() || b == b'.' || b == b'/')
    {
        return Ipv4Net::parse(t).map(Target::Network);
    }
    parse_domain(t).map(Target::Domain)
}

/// Checks and normalises a domain: lowercase, `*.` prefix and final dot dropped (subdomains
/// are always included), labels of letters, digits and inner hyphens (or underscores), at
/// least two labels.
pub fn parse_domain(t: &str) -> Result<String, String> {
    let d = t.strip_prefix("*.").unwrap_or(t);
    let d = d.strip_suffix('.').unwrap_or(d).to_ascii_lowercase();
    if d.is_empty() || d.len() > MAX_DOMAIN {
        return Err(format!("a domain has 1..={MAX_DOMAIN} characters"));
    }
    let labels: Vec<&str> = d.split('.').collect();
    if labels.len() < 2 {
        return Err("a domain needs at least two labels (e.g. example.com)".into());
    }
    for l in &labels {
        let ok = !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
            && !l.starts_with('-')
            && !l.ends_with('-');
        if !ok {
            return Err(format!("bad domain label {l:?}"));
        }
    }
    if labels.last().is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit())) {
        return Err("the last label of a domain is not a number (networks are a.b.c.d/n)".into());
    }
    Ok(d)
}

/// Checks a rule list from the API: each rule, and at most [`MAX_RULES`].
pub fn from_pb_list(rules: &[pb::EgressRule]) -> Result<Vec<Rule>, EgressError> {
    if rules.len() > MAX_RULES {
        return Err(bad(format!("{} rules", rules.len()), format!("at most {MAX_RULES} rules")));
    }
    rules.iter().map(Rule::from_pb).collect()
}

/// The first of `rules` that lies within none of `ceiling`'s rules.
pub fn first_outside<'a>(rules: &'a [Rule], ceiling: &[Rule]) -> Option<&'a Rule> {
    rules.iter().find(|r| !ceiling.iter().any(|c| r.within(c)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> Rule {
        Rule::parse(s).unwrap()
    }

    #[test]
    fn text_forms_parse_and_print_back() {
        for t in [
            "*",
            "pypi.org",
            "@pypi",
            "203.0.113.0/24:tcp/80",
            "*:tcp/443",
            "198.51.100.7/32:udp/1000-2000",
            "a.b:icmp",
        ] {
            assert_eq!(r(t).to_string(), t, "{t}");
        }
        assert_eq!(r("198.51.100.7").target, Target::Network(Ipv4Net::parse("198.51.100.7/32").unwrap()));
        assert_eq!(r("*.PyPI.org.").target, Target::Domain("pypi.org".into()));
        assert_eq!(r("x.org:tcp").ports, ANY_PORT);
    }

    #[test]
    fn bad_rules_say_why() {
        for (t, why) in [
            ("203.0.113.1/24", "host bits"),
            ("203.0.113.0/33", "prefix"),
            ("300.1.2.3", "not an IPv4"),
            ("localhost", "two labels"),
            ("a..b", "label"),
            ("-a.com", "label"),
            ("x.com:sctp", "unknown protocol"),
            ("x.com/80", "label"),
            ("x.com:icmp/80", "tcp or udp"),
            ("x.com:tcp/0", "1..=65535"),
            ("x.com:tcp/90-80", "1..=65535"),
            ("x.com:tcp/70000", "1..=65535"),
            ("x.com:tcp/x", "bad port"),
            ("@Big", "rule set"),
            ("@", "rule set"),
            ("1.2.3", "not an IPv4"),
            ("x.123", "number"),
        ] {
            let e = Rule::parse(t).unwrap_err();
            assert!(e.why.contains(why), "{t}: {e}");
            assert_eq!(e.rule, t);
        }
        let many = vec![pb::EgressRule { target: "*".into(), ..Default::default() }; MAX_RULES + 1];
        assert!(from_pb_list(&many).is_err());
        // A huge rule is refused, and not echoed whole.
        let huge = format!("{}.com", "a".repeat(100_000));
        let e = Rule::parse(&huge).unwrap_err();
        assert!(e.rule.len() < 400 && e.why.contains("characters"), "{}", e.why);
    }

    #[test]
    fn within_follows_targets_protocols_and_ports() {
        assert!(r("pypi.org:tcp/443").within(&r("*")));
        assert!(r("files.pypi.org").within(&r("pypi.org")));
        assert!(!r("evilpypi.org").within(&r("pypi.org")));
        assert!(!r("pypi.org").within(&r("files.pypi.org")));
        assert!(r("203.0.113.0/25:tcp/80").within(&r("203.0.113.0/24:tcp/1-1024")));
        assert!(!r("203.0.112.0/23").within(&r("203.0.113.0/24")));
        assert!(!r("203.0.113.0/24").within(&r("203.0.113.0/24:tcp")));
        assert!(!r("203.0.113.0/24:tcp/80-2000").within(&r("203.0.113.0/24:tcp/1-1024")));
        assert!(!r("*").within(&r("203.0.0.0/8")));
        assert!(!r("pypi.org").within(&r("0.0.0.0/0")));
        assert!(r("@pypi").within(&r("@pypi")) && !r("@pypi").within(&r("@npm")));
        let ceiling = [r("pypi.org"), r("203.0.113.0/24:tcp")];
        let asked = [r("pypi.org:tcp/443"), r("203.0.113.9:udp/53")];
        assert_eq!(first_outside(&asked, &ceiling), Some(&asked[1]));
    }

    #[test]
    fn networks_know_their_bounds() {
        let n = Ipv4Net::parse("10.88.0.0/16").unwrap();
        assert_eq!((n.first(), n.last(), n.size()), (0x0a58_0000, 0x0a58_ffff, 65536));
        assert!(n.contains("10.88.3.4".parse().unwrap()) && !n.contains("10.89.0.0".parse().unwrap()));
        assert!(Ipv4Net::parse("0.0.0.0/0").unwrap().covers(&n));
        assert_eq!(always_closed().len(), ALWAYS_CLOSED.len());
        for addr in ["169.254.169.254", "168.63.129.16", "198.18.0.1", "198.19.255.254"] {
            assert!(always_closed().iter().any(|c| c.contains(addr.parse().unwrap())), "{addr}");
        }
    }
}
