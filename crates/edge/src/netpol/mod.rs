//! The sandbox network ([C 9], issue 11): a veth pair per sandbox from the edge's subnet,
//! masqueraded egress through the uplink, default deny, allow-lists by network and by domain
//! (through the edge's DNS proxy), changed live.
//!
//! Layout of the edge's subnet (a /31 per sandbox): slot `s` (from 1) is the pair
//! `base + 2s` (host end) / `base + 2s + 1` (sandbox); `base + 1` is the DNS proxy, on `lo`
//! with the label `lo:od<tag>`. Host-side veths are named `od<tag>-<slot in hex>`, the tag a hash of the
//! edge's state directory, so one edge's clean-up never touches another's links.
//!
//! Invariants:
//! - the slot is chosen by [`Network::reserve`] and written in the sandbox's record before
//!   anything is created; [`Network::start`] takes the records' slots back;
//! - per-sandbox state is only set elements ([`table`]), each change one netlink batch, all or
//!   nothing; the bookkeeping here changes only once the kernel took the batch;
//! - every element a sandbox has starts with its own address, so removing a sandbox removes
//!   exactly its elements; [`Network::detach`] also flushes its conntrack entries (by mark);
//! - the DNS proxy adds learned addresses before it answers.
//!
//! The backend hands over a namespace (`/proc/<pid>/ns/net`); a microVM backend hands over
//! the namespace its tap lives in, the rest is the same.

pub mod boxes;
pub mod dns;
pub mod link;
pub mod nl;
pub mod table;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use opendsec_common::egress::{self, Ipv4Net, Protocol, Rule, Target};
use opendsec_common::ids;

use boxes::Box3;
use nl::{ElemOp, Element, NlError, NlSocket};

/// Most addresses one sandbox may have learned through DNS at once.
pub const MAX_LEARNED: usize = 1024;
/// Most names kept per learned address (the latest; an address serving more names keeps the
/// longest expiry among those kept).
pub const MAX_NAMES_PER_ADDRESS: usize = 8;
/// Most A records of one answer that are learned (the rest of the answer still goes back).
pub const MAX_ADDRESSES_PER_ANSWER: usize = 32;

/// How the network of an edge is set up.
#[derive(Clone, Debug)]
pub struct NetOptions {
    pub subnet: Ipv4Net,
    /// 6 hex digits naming this edge's links and table.
    pub tag: String,
    /// Who the edge is (its state directory): written in its table's comment, checked before
    /// the table is replaced.
    pub owner: String,
    /// Egress goes out masqueraded through this link; `None`: the default route's.
    pub uplink: Option<String>,
    /// Where the DNS proxy forwards allowed names.
    pub upstream: Vec<SocketAddr>,
    /// Rule sets named by `@name`.
    pub rule_sets: BTreeMap<String, Vec<Rule>>,
    /// Ranges of the always-closed ones that rules may open: only rules whose network lies
    /// within one reach it ([`compile`]), and only answers for the domains listed with it
    /// open addresses in it ([`Network::learn`](dns::DnsPolicy::learn)).
    pub open_private: Vec<Ipv4Net>,
    /// The domains whose answers may open addresses in each opened range.
    pub open_private_domains: Vec<(Ipv4Net, Vec<String>)>,
    /// Per sandbox: queries per second, and the burst.
    pub dns_rate: f64,
    pub dns_burst: f64,
    /// The DNS proxy's slots and each tenant's share of them.
    pub dns_slots: dns::DnsSlots,
    /// Connections one tenant's sandboxes may hold together, and new ones a second.
    pub tenant_conns: u32,
    pub tenant_rate: u32,
    /// When sandboxes' new connections are refused: while the host's conntrack table is
    /// fuller than this.
    pub conntrack_shed: ShedAt,
    /// Learned addresses stay open for the answer's TTL, bounded by these.
    pub dns_ttl_min: Duration,
    pub dns_ttl_max: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    #[error(transparent)]
    Netlink(#[from] NlError),
    #[error("nft -f of table {table} failed: {message}")]
    Nft { table: String, message: String },
    #[error("subnet {subnet} is in use on this host already ({holder}); give each edge its own network.subnet")]
    SubnetInUse { subnet: Ipv4Net, holder: String },
    #[error("no free address left in {0}")]
    Exhausted(Ipv4Net),
    #[error(transparent)]
    Rule(#[from] egress::EgressError),
    #[error("sandbox {0} has no network on this edge")]
    NotAttached(String),
    #[error("network setup: {what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("sandbox {id} learned {MAX_LEARNED} addresses already")]
    TooManyLearned { id: String },
    #[error(
        "nftables table {table} belongs to {owner:?}, not to this edge ({ours:?}); give each edge its own state directory"
    )]
    TableInUse { table: String, owner: String, ours: String },
}

/// What the edge records about a sandbox's network.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Slot(pub u32);

/// A record's claim on the network, for [`Network::start`].
#[derive(Clone, Debug)]
pub struct Claim {
    pub id: String,
    pub slot: Slot,
    /// The sandbox's project (its tenant shares bounds with the tenant's other sandboxes).
    pub project: String,
    pub rules: Vec<Rule>,
}

/// Rules in the form the table takes: boxes for networks, domains for the DNS proxy.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Compiled {
    pub boxes: Vec<Box3>,
    pub domains: Vec<Rule>,
}

/// Expands named sets and splits rules into boxes and domains. An unknown set name fails.
/// A range the operator opened (`opened`) is reached only by a network that lies within it:
/// `*` and wider networks are cut around it, so opening a range for one tenant's mirror opens
/// it to nobody who did not name it.
pub fn compile(
    rules: &[Rule],
    sets: &BTreeMap<String, Vec<Rule>>,
    opened: &[Ipv4Net],
) -> Result<Compiled, egress::EgressError> {
    let mut boxes = Vec::new();
    let mut domains = Vec::new();
    let add = |r: Rule, boxes: &mut Vec<Box3>, domains: &mut Vec<Rule>| match &r.target {
        Target::Any => boxes.extend(clip(0, u32::MAX, opened).into_iter().map(|(a, b)| Box3::of_rule(a, b, &r))),
        Target::Network(n) => {
            boxes.extend(clip(n.first(), n.last(), opened).into_iter().map(|(a, b)| Box3::of_rule(a, b, &r)))
        }
        Target::Domain(_) => domains.push(r),
        Target::Named(_) => {}
    };
    for r in rules {
        if let Target::Named(name) = &r.target {
            let members = sets.get(name).ok_or_else(|| egress::EgressError {
                rule: r.to_string(),
                why: format!("no rule set {name:?} in the cluster config (network.rule_sets)"),
            })?;
            for m in members {
                if let Some(m) = narrow(m, r) {
                    add(m, &mut boxes, &mut domains);
                }
            }
        } else {
            add(r.clone(), &mut boxes, &mut domains);
        }
    }
    domains.sort();
    domains.dedup();
    Ok(Compiled { boxes: boxes::disjoint(&boxes), domains })
}

/// The addresses `first..=last` a rule reaches: all of them when they lie within one opened
/// range (the rule names it), else those outside every opened range.
fn clip(first: u32, last: u32, opened: &[Ipv4Net]) -> Vec<(u32, u32)> {
    if opened.iter().any(|o| o.first() <= first && last <= o.last()) {
        return vec![(first, last)];
    }
    let mut out = vec![(first, last)];
    for o in opened {
        let (hs, he) = (o.first(), o.last());
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
    out
}

/// `member` limited to what `outer` (the `@name` reference) allows; `None` if nothing is left.
fn narrow(member: &Rule, outer: &Rule) -> Option<Rule> {
    let protocol = match (member.protocol, outer.protocol) {
        (m, Protocol::Any) => m,
        (Protocol::Any, o) => o,
        (m, o) if m == o => m,
        _ => return None,
    };
    let ports = (member.ports.0.max(outer.ports.0), member.ports.1.min(outer.ports.1));
    (ports.0 <= ports.1).then(|| Rule { target: member.target.clone(), protocol, ports })
}

/// Addresses learned through DNS for one destination.
#[derive(Debug, Default)]
struct Learned {
    /// Names that resolved to it, and until when each keeps it open.
    names: HashMap<String, Instant>,
    elems: Vec<Element>,
}

#[derive(Debug)]
struct Attached {
    slot: Slot,
    addr: Ipv4Addr,
    /// The sandbox's top-level project.
    tenant: Arc<str>,
    compiled: Compiled,
    allow: Vec<Element>,
    learned: HashMap<Ipv4Addr, Learned>,
}

/// A tenant with sandboxes on this edge: the index of its chain, and how many it has.
#[derive(Debug, Clone, Copy)]
struct TenantChain {
    index: u32,
    sandboxes: u32,
}

#[derive(Debug, Default)]
struct State {
    sandboxes: HashMap<String, Attached>,
    by_addr: HashMap<Ipv4Addr, String>,
    tenants: HashMap<Arc<str>, TenantChain>,
    next_tenant: u32,
    /// Whether the edge sheds new connections now (chain `shed` holds a drop).
    shedding: bool,
    /// Reserved slots (attached or about to be).
    slots: BTreeSet<u32>,
    cursor: u32,
}

impl State {
    /// The chain of `tenant`, made (its index chosen) if it has none: `(index, new)`.
    fn tenant_chain(&mut self, tenant: &Arc<str>) -> (u32, bool) {
        if let Some(t) = self.tenants.get(tenant) {
            return (t.index, false);
        }
        self.next_tenant += 1;
        (self.next_tenant, true)
    }
}

#[derive(Debug)]
struct Inner {
    nf: NlSocket,
    state: State,
}

/// The network of one edge.
#[derive(Debug)]
pub struct Network {
    opts: NetOptions,
    table: table::TableSpec,
    inner: Mutex<Inner>,
    max_slot: u32,
    /// The DNS proxy, once [`Network::serve_dns`] started it.
    dns: Mutex<Option<Arc<dns::DnsProxy>>>,
}

/// Options from the cluster config's `network` section, for an edge on `subnet` (the
/// section's, or a part of it when several edges share a host) whose state is in `state_dir`.
pub fn options_from(
    cfg: &opendsec_common::config::NetworkConfig,
    subnet: Ipv4Net,
    state_dir: &Path,
) -> Result<NetOptions, NetworkError> {
    let parse = |t: &String| Rule::parse(t).map_err(NetworkError::Rule);
    let rule_sets = cfg
        .rule_sets
        .iter()
        .map(|(k, v)| Ok((k.clone(), v.iter().map(parse).collect::<Result<Vec<_>, _>>()?)))
        .collect::<Result<BTreeMap<_, _>, NetworkError>>()?;
    let open_private = cfg.open_private.iter().filter_map(|n| Ipv4Net::parse(n).ok()).collect();
    let open_private_domains = cfg
        .open_private_domains
        .iter()
        .filter_map(|(n, d)| {
            let domains = d.iter().filter_map(|d| egress::parse_domain(d).ok()).collect();
            Ipv4Net::parse(n).ok().map(|n| (n, domains))
        })
        .collect();
    let mut upstream: Vec<SocketAddr> = cfg
        .upstream_dns
        .iter()
        .filter_map(|u| {
            u.parse::<SocketAddr>()
                .ok()
                .or_else(|| u.parse::<std::net::IpAddr>().ok().map(|ip| SocketAddr::new(ip, 53)))
        })
        .collect();
    if upstream.is_empty() {
        upstream = host_resolvers();
    }
    Ok(NetOptions {
        subnet,
        tag: tag_of(state_dir),
        owner: std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf()).display().to_string(),
        uplink: (!cfg.uplink.is_empty()).then(|| cfg.uplink.clone()),
        upstream,
        rule_sets,
        open_private,
        open_private_domains,
        dns_rate: cfg.dns_rate,
        dns_burst: cfg.dns_burst,
        dns_slots: dns::DnsSlots {
            in_flight: cfg.dns_in_flight,
            tcp: cfg.dns_tcp_connections,
            tenant_share_percent: cfg.dns_tenant_share_percent,
        },
        tenant_conns: cfg.max_conns_per_tenant,
        tenant_rate: cfg.new_conns_per_tenant,
        conntrack_shed: ShedAt::Percent(cfg.conntrack_shed_percent),
        dns_ttl_min: cfg.dns_ttl_min,
        dns_ttl_max: cfg.dns_ttl_max,
    })
}

/// Where the kernel tells the size and fill of this network namespace's conntrack table.
const CONNTRACK_MAX: &str = "/proc/sys/net/netfilter/nf_conntrack_max";
const CONNTRACK_COUNT: &str = "/proc/sys/net/netfilter/nf_conntrack_count";
/// How often the edge looks at its host's conntrack table.
const SHED_CHECK: Duration = Duration::from_millis(250);

fn read_u64(path: &str) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// How full the host's conntrack table may get before sandboxes' new connections are refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShedAt {
    /// A percentage of `nf_conntrack_max` (0: never).
    Percent(u32),
    /// A number of entries (tests).
    Entries(u64),
}

impl ShedAt {
    /// The number of entries above which to shed now (`None`: never, or no conntrack yet).
    fn limit(self) -> Option<u64> {
        match self {
            ShedAt::Percent(0) => None,
            ShedAt::Percent(p) => read_u64(CONNTRACK_MAX).map(|m| m * u64::from(p.min(100)) / 100),
            ShedAt::Entries(n) => Some(n),
        }
    }
}

/// The host's resolvers, from /etc/resolv.conf.
fn host_resolvers() -> Vec<SocketAddr> {
    let text = std::fs::read_to_string("/etc/resolv.conf").unwrap_or_default();
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|a| a.trim().parse::<std::net::IpAddr>().ok())
        .map(|ip| SocketAddr::new(ip, 53))
        .collect()
}

/// The table and link names of an edge whose state directory is `state_dir`.
pub fn tag_of(state_dir: &Path) -> String {
    use sha2::Digest;
    let canonical = std::fs::canonicalize(state_dir).unwrap_or_else(|_| state_dir.to_path_buf());
    let h = sha2::Sha256::digest(canonical.as_os_str().as_encoded_bytes());
    format!("{:02x}{:02x}{:02x}", h[0], h[1], h[2])
}

impl Network {
    /// The DNS proxy's address.
    pub fn dns_addr(&self) -> Ipv4Addr {
        Ipv4Addr::from(self.opts.subnet.first() + 1)
    }

    pub fn table_name(&self) -> &str {
        &self.table.name
    }

    pub fn veth_prefix(&self) -> &str {
        &self.table.veth_prefix
    }

    /// The host-side veth of slot `s`.
    pub fn ifname(&self, s: Slot) -> String {
        format!("{}{:x}", self.table.veth_prefix, s.0)
    }

    /// The addresses of slot `s`: (host end, sandbox).
    pub fn addrs(&self, s: Slot) -> (Ipv4Addr, Ipv4Addr) {
        let base = self.opts.subnet.first() + 2 * s.0;
        (Ipv4Addr::from(base), Ipv4Addr::from(base + 1))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every change is committed whole after the kernel took it: a panic cannot leave it
        // half done.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Prepares the edge's network (blocking): checks that no other holder uses the subnet,
    /// turns on forwarding, creates the DNS address, finds the uplink. The table is loaded by
    /// [`Network::recover`], with the records' sandboxes in it.
    pub fn new(opts: NetOptions) -> Result<Network, NetworkError> {
        let tag = opts.tag.clone();
        let veth_prefix = format!("od{tag}-");
        let dns_label = format!("lo:od{tag}");
        let mut rt = NlSocket::route()?;
        let subnet = opts.subnet;
        let dns = Ipv4Addr::from(subnet.first() + 1);
        // Another holder of the subnet (another edge, a host network): refuse to start.
        let names: HashMap<u32, String> = link::links(&mut rt)?.into_iter().collect();
        for a in link::addresses(&mut rt)? {
            if subnet.overlaps(&Ipv4Net::of(a.addr, a.prefix)) {
                let owner = names.get(&a.index).cloned().unwrap_or_default();
                let ours = owner.starts_with(&veth_prefix) || (a.label == dns_label && a.addr == dns && a.prefix == 32);
                if !ours {
                    return Err(NetworkError::SubnetInUse {
                        subnet,
                        holder: format!("{}/{} on {owner} ({})", a.addr, a.prefix, a.label),
                    });
                }
            }
        }
        write_sysctl("net/ipv4/ip_forward", "1")?;
        link::ensure_local_address(&mut rt, &dns_label, dns)?;
        let uplink = match &opts.uplink {
            Some(u) => Some(u.clone()),
            None => link::default_route_interface(&mut rt)?,
        };
        if uplink.is_none() {
            tracing::warn!(
                "no default route: sandbox egress is masqueraded through whatever interface routes it, once one does"
            );
        }
        let mut local: Vec<Ipv4Net> = link::addresses(&mut rt)?.into_iter().map(|a| Ipv4Net::of(a.addr, 32)).collect();
        local.push(subnet);
        let closed = table::subtract(&egress::always_closed(), &opts.open_private);
        let spec = table::TableSpec {
            name: format!("opendsec-{tag}"),
            veth_prefix,
            subnet,
            dns,
            uplink: uplink.unwrap_or_default(),
            local,
            closed,
            owner: opts.owner.clone(),
            tenant_conns: opts.tenant_conns,
            tenant_rate: opts.tenant_rate,
        };
        let max_slot = u32::try_from(subnet.size() / 2).unwrap_or(u32::MAX).saturating_sub(1);
        Ok(Network {
            opts,
            table: spec,
            inner: Mutex::new(Inner { nf: NlSocket::netfilter()?, state: State::default() }),
            max_slot,
            dns: Mutex::new(None),
        })
    }

    /// Loads the table with the claims' elements in one transaction, takes their slots, and
    /// removes this edge's links no claim holds (blocking). Called once, before the edge
    /// serves. Addresses learned through DNS before the restart are not kept: a sandbox's
    /// next lookup learns them again.
    pub fn recover(&self, claims: &[Claim]) -> Result<(), NetworkError> {
        let mut sandboxes = Vec::new();
        let mut attached = Vec::new();
        // Only its tenant bookkeeping: the state is replaced whole below.
        let mut tenants = State::default();
        for c in claims {
            if c.slot.0 == 0 || c.slot.0 > self.max_slot {
                continue;
            }
            let compiled = compile(&c.rules, &self.opts.rule_sets, &self.opts.open_private).unwrap_or_default();
            let (_, addr) = self.addrs(c.slot);
            let elems = table::box_elements(&compiled.boxes, None);
            let tenant: Arc<str> = ids::tenant_of(&c.project).into();
            let (index, _) = tenants.tenant_chain(&tenant);
            tenants.tenants.entry(tenant.clone()).or_insert(TenantChain { index, sandboxes: 0 }).sandboxes += 1;
            sandboxes.push(table::SlotTable {
                slot: c.slot.0,
                ifname: self.ifname(c.slot),
                addr,
                mark: u32::from(addr),
                allow: elems.clone(),
                tenant_chain: table::tenant_chain(index),
            });
            attached.push((
                c.id.clone(),
                Attached { slot: c.slot, addr, tenant, compiled, allow: elems, learned: HashMap::new() },
            ));
        }
        if let Some(owner) = table_owner(&self.table.name)?
            && owner != self.table.owner
        {
            return Err(NetworkError::TableInUse {
                table: self.table.name.clone(),
                owner,
                ours: self.table.owner.clone(),
            });
        }
        load_table(&self.table.name, &table::script(&self.table, &sandboxes))?;
        {
            let mut g = self.lock();
            g.state = State { tenants: tenants.tenants, next_tenant: tenants.next_tenant, ..State::default() };
            for (id, a) in attached {
                g.state.slots.insert(a.slot.0);
                g.state.by_addr.insert(a.addr, id.clone());
                g.state.sandboxes.insert(id, a);
            }
        }
        // Links of this edge no claim holds (sandboxes that ended while the edge was down).
        let keep: BTreeSet<String> = claims.iter().map(|c| self.ifname(c.slot)).collect();
        let mut rt = NlSocket::route()?;
        for (_, name) in link::links(&mut rt)? {
            if name.starts_with(&self.table.veth_prefix) && !keep.contains(&name) {
                link::delete(&mut rt, &name)?;
            }
        }
        Ok(())
    }

    /// Binds the DNS proxy on the DNS address and serves it until `shutdown`.
    pub async fn serve_dns(
        self: &Arc<Self>,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> Result<tokio::task::JoinHandle<()>, NetworkError> {
        let at = SocketAddr::from((self.dns_addr(), 53));
        let io = |what: &str| {
            let what = format!("{what} {at}");
            move |source| NetworkError::Io { what, source }
        };
        let udp = tokio::net::UdpSocket::bind(at).await.map_err(io("bind udp"))?;
        let tcp = tokio::net::TcpListener::bind(at).await.map_err(io("bind tcp"))?;
        let policy: Arc<dyn dns::DnsPolicy> = self.clone();
        let proxy = Arc::new(dns::DnsProxy::new(
            self.opts.upstream.clone(),
            policy,
            self.opts.dns_rate,
            self.opts.dns_burst,
            self.opts.dns_slots,
        ));
        *self.dns.lock().unwrap_or_else(|p| p.into_inner()) = Some(proxy.clone());
        // The edge's bound on the host's conntrack table, while the network lives.
        let me = Arc::downgrade(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(SHED_CHECK).await;
                let Some(net) = me.upgrade() else { return };
                if let Err(e) = tokio::task::spawn_blocking(move || net.check_shed()).await.unwrap_or(Ok(())) {
                    tracing::warn!(error = %e, "could not change whether the edge sheds new connections");
                }
            }
        });
        Ok(tokio::spawn(proxy.serve(udp, tcp, shutdown)))
    }

    /// Chooses the slot of a new sandbox (next fit: a freed slot is not reused at once).
    pub fn reserve(&self) -> Result<Slot, NetworkError> {
        let mut g = self.lock();
        let st = &mut g.state;
        for i in 0..self.max_slot {
            let s = (st.cursor + i) % self.max_slot + 1;
            if !st.slots.contains(&s) {
                st.slots.insert(s);
                st.cursor = s;
                return Ok(Slot(s));
            }
        }
        Err(NetworkError::Exhausted(self.opts.subnet))
    }

    /// Gives back a slot [`Network::reserve`] chose for a creation that never got as far as
    /// [`Network::attach`].
    pub fn unreserve(&self, slot: Slot) {
        let mut g = self.lock();
        if !g.state.sandboxes.values().any(|a| a.slot == slot) {
            g.state.slots.remove(&slot.0);
        }
    }

    /// Connects the sandbox in namespace `netns` on `slot` and applies `rules` (blocking).
    pub fn attach(
        &self,
        id: &str,
        slot: Slot,
        project: &str,
        rules: &[Rule],
        netns: &Path,
    ) -> Result<(), NetworkError> {
        let compiled = compile(rules, &self.opts.rule_sets, &self.opts.open_private)?;
        let (host_addr, addr) = self.addrs(slot);
        let ifname = self.ifname(slot);
        let mut rt = NlSocket::route()?;
        link::create_veth(&mut rt, netns, &ifname, host_addr, addr)?;
        let allow = table::box_elements(&compiled.boxes, None);
        let t = &self.table.name;
        let (chain, aset, rset) = table::slot_names(slot.0);
        // The sets' ids name them within this batch (the rules look them up by id too).
        let (aid, rid) = (slot.0 * 2, slot.0 * 2 + 1);
        let replies = table::reply_chain(slot.0);
        let mut msgs = vec![
            nl::new_chain(t, &chain),
            nl::new_chain(t, &replies),
            nl::new_box_set(t, &aset, aid, false),
            nl::new_box_set(t, &rset, rid, true),
            nl::box_lookup_rule(t, &chain, &aset, aid),
            nl::box_lookup_rule(t, &chain, &rset, rid),
            nl::reply_lookup_rule(t, &replies, &aset, aid),
            nl::reply_lookup_rule(t, &replies, &rset, rid),
        ];
        msgs.extend(nl::set_elements_chunked(ElemOp::Add, t, &aset, &allow));
        msgs.push(nl::set_elements(
            ElemOp::Add,
            t,
            table::SANDBOXES,
            &[table::sandbox_element(&ifname, addr, u32::from(addr))],
        ));
        msgs.push(nl::set_elements(ElemOp::Add, t, table::CHAINS, &[table::chain_element(&ifname, addr, &chain)]));
        msgs.push(nl::set_elements(
            ElemOp::Add,
            t,
            table::REPLY_CHAINS,
            &[table::chain_element(&ifname, addr, &replies)],
        ));
        let mut g = self.lock();
        // Its tenant's chain (made with the tenant's first sandbox here), and its jump there.
        let tenant: Arc<str> = ids::tenant_of(project).into();
        let (index, new) = g.state.tenant_chain(&tenant);
        let tchain = table::tenant_chain(index);
        if new {
            msgs.extend([
                nl::new_chain(t, &tchain),
                nl::drop_rule(t, &tchain, nl::DropWhen::CountOver(self.opts.tenant_conns)),
                nl::drop_rule(
                    t,
                    &tchain,
                    nl::DropWhen::RateOver {
                        per_second: u64::from(self.opts.tenant_rate),
                        burst: self.opts.tenant_rate.saturating_mul(2),
                    },
                ),
            ]);
        }
        msgs.push(nl::set_elements(ElemOp::Add, t, table::TENANTS, &[table::chain_element(&ifname, addr, &tchain)]));
        if let Err(e) = g.nf.nf_batch(&format!("rules of {id}"), &msgs) {
            drop(g);
            let _ = link::delete(&mut rt, &ifname);
            return Err(e.into());
        }
        g.state.tenants.entry(tenant.clone()).or_insert(TenantChain { index, sandboxes: 0 }).sandboxes += 1;
        if new {
            g.state.next_tenant = index;
        }
        g.state.slots.insert(slot.0);
        g.state.by_addr.insert(addr, id.to_string());
        g.state
            .sandboxes
            .insert(id.to_string(), Attached { slot, addr, tenant, compiled, allow, learned: HashMap::new() });
        Ok(())
    }

    /// Replaces the rules of an attached sandbox in one transaction (blocking). Addresses it
    /// learned stay open only as far as the new rules still allow their names.
    pub fn update(&self, id: &str, rules: &[Rule]) -> Result<(), NetworkError> {
        let compiled = compile(rules, &self.opts.rule_sets, &self.opts.open_private)?;
        let mut g = self.lock();
        let now = Instant::now();
        let Inner { nf, state } = &mut *g;
        let a = state.sandboxes.get_mut(id).ok_or_else(|| NetworkError::NotAttached(id.into()))?;
        let allow = table::box_elements(&compiled.boxes, None);
        let mut add: Vec<Element> = Vec::new();
        let mut relearned: Vec<(Ipv4Addr, Vec<Element>)> = Vec::new();
        for (ip, l) in &a.learned {
            let e = learned_elements(*ip, &l.names, &compiled.domains, now);
            add.extend(e.iter().cloned());
            relearned.push((*ip, e));
        }
        // The sandbox's own sets, emptied and filled again: small whatever the edge holds.
        let t = &self.table.name;
        let (_, aset, rset) = table::slot_names(a.slot.0);
        let mut msgs = vec![nl::flush_set(t, &aset), nl::flush_set(t, &rset)];
        msgs.extend(nl::set_elements_chunked(ElemOp::Add, t, &aset, &allow));
        msgs.extend(nl::set_elements_chunked(ElemOp::Add, t, &rset, &add));
        nf.nf_batch(&format!("rules of {id}"), &msgs)?;
        a.allow = allow;
        a.compiled = compiled;
        for (ip, e) in relearned {
            if e.is_empty() {
                a.learned.remove(&ip);
            } else if let Some(l) = a.learned.get_mut(&ip) {
                l.elems = e;
            }
        }
        Ok(())
    }

    /// Hands the attachment of `from` to `to` (a warm pool member claimed as a sandbox): the
    /// same slot, address, rules and learned names, under the new id.
    pub fn rename(&self, from: &str, to: &str) -> Result<(), NetworkError> {
        let mut g = self.lock();
        let a = g.state.sandboxes.remove(from).ok_or_else(|| NetworkError::NotAttached(from.into()))?;
        g.state.by_addr.insert(a.addr, to.to_string());
        g.state.sandboxes.insert(to.to_string(), a);
        Ok(())
    }

    /// Removes everything of the sandbox on `slot` (blocking): its elements, its veth, its
    /// conntrack entries, the slot. Idempotent: what is gone already is no error.
    pub fn detach(&self, id: &str, slot: Slot) -> Result<(), NetworkError> {
        let (_, addr) = self.addrs(slot);
        let ifname = self.ifname(slot);
        {
            let mut g = self.lock();
            let Inner { nf, state } = &mut *g;
            // Elements first (they reference the chain), then the rules, sets and chain; each
            // only if there (a creation cut short may have made none of them).
            let t = &self.table.name;
            let (chain, aset, rset) = table::slot_names(slot.0);
            let replies = table::reply_chain(slot.0);
            // Its tenant's jump; the tenant's chain too when this was its last sandbox here.
            let tenant = state.sandboxes.get(id).map(|a| a.tenant.clone());
            let tchain =
                tenant.as_ref().and_then(|t| state.tenants.get(t)).map(|c| (table::tenant_chain(c.index), c.sandboxes));
            let mut msgs = Vec::new();
            if let Some((tc, _)) = &tchain {
                msgs.push(nl::set_elements(
                    ElemOp::Delete,
                    t,
                    table::TENANTS,
                    &[table::chain_element(&ifname, addr, tc)],
                ));
            }
            if let Some((tc, 1)) = &tchain {
                msgs.extend([nl::flush_chain(t, tc), nl::destroy_chain(t, tc)]);
            }
            msgs.extend([
                nl::set_elements(ElemOp::Delete, t, table::CHAINS, &[table::chain_element(&ifname, addr, &chain)]),
                nl::set_elements(
                    ElemOp::Delete,
                    t,
                    table::REPLY_CHAINS,
                    &[table::chain_element(&ifname, addr, &replies)],
                ),
                nl::flush_chain(t, &replies),
                nl::set_elements(
                    ElemOp::Delete,
                    t,
                    table::SANDBOXES,
                    &[table::sandbox_element(&ifname, addr, u32::from(addr))],
                ),
                nl::flush_chain(t, &chain),
                nl::destroy_set(t, &aset),
                nl::destroy_set(t, &rset),
                nl::destroy_chain(t, &chain),
                nl::destroy_chain(t, &replies),
            ]);
            nf.nf_batch(&format!("rules of {id}"), &msgs)?;
            if let Some(tenant) = tenant
                && let Some(c) = state.tenants.get_mut(&tenant)
            {
                c.sandboxes -= 1;
                if c.sandboxes == 0 {
                    state.tenants.remove(&tenant);
                }
            }
            state.sandboxes.remove(id);
            if state.by_addr.get(&addr).is_some_and(|o| o == id) {
                state.by_addr.remove(&addr);
            }
        }
        let mut rt = NlSocket::route()?;
        link::delete(&mut rt, &ifname)?;
        let mut ct = NlSocket::netfilter()?;
        match ct.nf_one("flush conntrack", &nl::conntrack_flush_mark(u32::from(addr))) {
            // ENOENT: no entry had the mark.
            Err(e) if e.errno() == Some(2) => {}
            r => r?,
        }
        self.lock().state.slots.remove(&slot.0);
        Ok(())
    }

    /// Takes the edge's network off the host (its table and DNS address), once no sandbox is
    /// attached any more: an edge stopping with its sandboxes leaves nothing behind. With
    /// sandboxes still attached (kept across a restart) it does nothing. Blocking.
    pub fn shutdown(&self) -> Result<(), NetworkError> {
        if self.attached() > 0 {
            return Ok(());
        }
        remove_table(&self.table.name)?;
        let mut rt = NlSocket::route()?;
        link::remove_local_address(&mut rt, self.dns_addr())?;
        Ok(())
    }

    /// Sheds sandboxes' new connections while the host's conntrack table is fuller than
    /// [`NetOptions::conntrack_shed`], and stops at nine tenths of that (blocking).
    pub fn check_shed(&self) -> Result<(), NetworkError> {
        let (Some(limit), Some(count)) = (self.opts.conntrack_shed.limit(), read_u64(CONNTRACK_COUNT)) else {
            return Ok(());
        };
        let mut g = self.lock();
        let shed = if g.state.shedding { count > limit * 9 / 10 } else { count > limit };
        if shed == g.state.shedding {
            return Ok(());
        }
        let t = &self.table.name;
        let msgs = if shed {
            vec![nl::flush_chain(t, table::SHED), nl::drop_rule(t, table::SHED, nl::DropWhen::Always)]
        } else {
            vec![nl::flush_chain(t, table::SHED)]
        };
        g.nf.nf_batch("the edge's shed chain", &msgs)?;
        g.state.shedding = shed;
        if shed {
            tracing::warn!(
                conntrack = count,
                limit,
                "the host's conntrack table is full: refusing sandboxes' new connections"
            );
        } else {
            tracing::info!(conntrack = count, "sandboxes' new connections accepted again");
        }
        Ok(())
    }

    /// Whether the edge sheds sandboxes' new connections now.
    pub fn shedding(&self) -> bool {
        self.lock().state.shedding
    }

    /// The DNS proxy (its counters), once serving.
    pub fn dns_proxy(&self) -> Option<Arc<dns::DnsProxy>> {
        self.dns.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// The number of sandboxes attached (for tests and status).
    pub fn attached(&self) -> usize {
        self.lock().state.sandboxes.len()
    }

    /// Whether an answer for `name` may open `ip`: always outside the opened ranges; inside
    /// one, only for a domain listed with it.
    fn may_learn(&self, name: &str, ip: Ipv4Addr) -> bool {
        if !self.opts.open_private.iter().any(|o| o.contains(ip)) {
            return true;
        }
        self.opts
            .open_private_domains
            .iter()
            .any(|(net, domains)| net.contains(ip) && domains.iter().any(|d| egress::domain_within(name, d)))
    }

    fn timeout_of(&self, ttl: u32) -> Duration {
        Duration::from_secs(u64::from(ttl)).clamp(self.opts.dns_ttl_min, self.opts.dns_ttl_max)
    }
}

/// The `resolved` elements of destination `ip` for sandbox `src`: a box per domain rule that
/// matches a name still open, with the time left of the longest-open name.
fn learned_elements(ip: Ipv4Addr, names: &HashMap<String, Instant>, domains: &[Rule], now: Instant) -> Vec<Element> {
    let d = u32::from(ip);
    let mut bx = Vec::new();
    let mut until = now;
    for (name, exp) in names {
        if *exp <= now {
            continue;
        }
        for r in domains {
            if let Target::Domain(dom) = &r.target
                && egress::domain_within(name, dom)
            {
                bx.push(Box3::of_rule(d, d, r));
                until = until.max(*exp);
            }
        }
    }
    if bx.is_empty() {
        return Vec::new();
    }
    let left = until.duration_since(now).max(Duration::from_millis(1));
    table::box_elements(&boxes::disjoint(&bx), Some(left))
}

impl dns::DnsPolicy for Network {
    fn tenant(&self, src: Ipv4Addr) -> Option<Arc<str>> {
        let g = self.lock();
        let id = g.state.by_addr.get(&src)?;
        g.state.sandboxes.get(id).map(|a| a.tenant.clone())
    }

    fn allowed(&self, src: Ipv4Addr, name: &str) -> Option<bool> {
        let g = self.lock();
        let id = g.state.by_addr.get(&src)?;
        let a = g.state.sandboxes.get(id)?;
        Some(
            a.compiled.domains.iter().any(|r| matches!(&r.target, Target::Domain(d) if egress::domain_within(name, d))),
        )
    }

    fn learn(&self, src: Ipv4Addr, name: &str, addrs: &[Ipv4Addr], ttl: u32) -> Result<(), String> {
        let mut g = self.lock();
        // Taken under the lock: the kernel's timeouts start no earlier than the bookkeeping's.
        let now = Instant::now();
        let until = now + self.timeout_of(ttl);
        let Inner { nf, state } = &mut *g;
        let Some(id) = state.by_addr.get(&src).cloned() else { return Err(format!("no sandbox has {src}")) };
        let Some(a) = state.sandboxes.get_mut(&id) else { return Err(format!("no sandbox has {src}")) };
        // Forget what expired (the kernel dropped those elements already).
        a.learned.retain(|_, l| l.names.values().any(|e| *e > now));
        let mut del = Vec::new();
        let mut add = Vec::new();
        let mut next: Vec<(Ipv4Addr, HashMap<String, Instant>, Vec<Element>)> = Vec::new();
        // An answer pointing into an opened range opens nothing unless the operator listed the
        // name for that range (else any allowed domain could rebind a sandbox into it).
        let mut uniq: Vec<Ipv4Addr> =
            addrs.iter().copied().take(MAX_ADDRESSES_PER_ANSWER).filter(|ip| self.may_learn(name, *ip)).collect();
        uniq.sort();
        uniq.dedup();
        let fresh = uniq.iter().filter(|ip| !a.learned.contains_key(ip)).count();
        if a.learned.len() + fresh > MAX_LEARNED {
            return Err(NetworkError::TooManyLearned { id }.to_string());
        }
        // An address this name opened recently enough needs no kernel change (its element
        // lives at least nine tenths as long as a new one would): repeated lookups of a name
        // cost no netlink batch.
        let slack = self.timeout_of(ttl) / 10;
        uniq.retain(|ip| {
            let fresh = a.learned.get(ip).and_then(|l| l.names.get(name)).is_some_and(|e| *e + slack >= until);
            !fresh
        });
        if uniq.is_empty() {
            return Ok(());
        }
        for ip in uniq {
            let mut names = a.learned.get(&ip).map(|l| l.names.clone()).unwrap_or_default();
            names.retain(|_, e| *e > now);
            names.insert(name.to_string(), until);
            while names.len() > MAX_NAMES_PER_ADDRESS {
                // The name closest to expiry goes (the newest, `name`, never does).
                let Some(oldest) =
                    names.iter().filter(|(n, _)| *n != name).min_by_key(|(_, e)| **e).map(|(n, _)| n.clone())
                else {
                    break;
                };
                names.remove(&oldest);
            }
            let e = learned_elements(ip, &names, &a.compiled.domains, now);
            if let Some(l) = a.learned.get(&ip) {
                del.extend(l.elems.iter().cloned());
            }
            add.extend(e.iter().cloned());
            next.push((ip, names, e));
        }
        let (_, _, rset) = table::slot_names(a.slot.0);
        let mut msgs = nl::set_elements_chunked(ElemOp::Delete, &self.table.name, &rset, &del);
        msgs.extend(nl::set_elements_chunked(ElemOp::Add, &self.table.name, &rset, &add));
        nf.nf_batch(&format!("learned addresses of {id}"), &msgs).map_err(|e| e.to_string())?;
        for (ip, names, elems) in next {
            a.learned.insert(ip, Learned { names, elems });
        }
        Ok(())
    }
}

fn write_sysctl(key: &str, value: &str) -> Result<(), NetworkError> {
    let path = format!("/proc/sys/{key}");
    if std::fs::read_to_string(&path).is_ok_and(|v| v.trim() == value) {
        return Ok(());
    }
    std::fs::write(&path, value).map_err(|source| NetworkError::Io { what: format!("write {path}"), source })
}

/// The comment of table `name`, if the table exists (`Some("")` for one without a comment).
fn table_owner(name: &str) -> Result<Option<String>, NetworkError> {
    let out = std::process::Command::new("nft").args(["list", "table", "inet", name]).output().map_err(|e| {
        NetworkError::Nft { table: name.into(), message: format!("cannot run nft ({e}); install nftables") }
    })?;
    if !out.status.success() {
        return Ok(None);
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(Some(
        text.lines()
            .find_map(|l| l.trim().strip_prefix("comment \"").and_then(|c| c.strip_suffix('"')))
            .unwrap_or_default()
            .to_string(),
    ))
}

/// Loads `script` with `nft -f -` (the table's fixed part, once per start).
fn load_table(table: &str, script: &str) -> Result<(), NetworkError> {
    use std::io::Write;
    let mut child = std::process::Command::new("nft")
        .args(["-f", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| NetworkError::Nft {
            table: table.into(),
            message: format!("cannot run nft ({e}); install nftables"),
        })?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(script.as_bytes())
            .map_err(|e| NetworkError::Nft { table: table.into(), message: format!("writing the script: {e}") })?;
    }
    let out =
        child.wait_with_output().map_err(|e| NetworkError::Nft { table: table.into(), message: e.to_string() })?;
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        return Err(NetworkError::Nft {
            table: table.into(),
            message: err.lines().take(6).collect::<Vec<_>>().join(" | "),
        });
    }
    Ok(())
}

/// Removes the table of an edge (when its network is turned off, and in tests).
pub fn remove_table(name: &str) -> Result<(), NetworkError> {
    load_table(name, &format!("table inet {name} {{}}\ndelete table inet {name}\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(s: &str) -> Rule {
        Rule::parse(s).unwrap()
    }

    #[test]
    fn named_sets_expand_and_narrow() {
        let sets: BTreeMap<String, Vec<Rule>> =
            [("pypi".to_string(), vec![r("pypi.org"), r("files.pythonhosted.org:tcp/443"), r("192.0.2.0/24:udp")])]
                .into();
        let c = compile(&[r("@pypi:tcp/443"), r("203.0.113.0/24:tcp/80")], &sets, &[]).unwrap();
        assert_eq!(c.domains, vec![r("files.pythonhosted.org:tcp/443"), r("pypi.org:tcp/443")]);
        assert_eq!(c.boxes.len(), 1, "the udp member is narrowed away: {:?}", c.boxes);
        let e = compile(&[r("@npm")], &sets, &[]).unwrap_err();
        assert!(e.why.contains("no rule set"), "{e}");
        // Overlapping rules become disjoint boxes.
        let c = compile(&[r("*"), r("203.0.113.0/24:tcp/80")], &sets, &[]).unwrap();
        assert_eq!(c.boxes, vec![Box3 { addr: (0, u32::MAX), proto: (0, 255), port: (0, u16::MAX) }]);
    }

    #[test]
    fn an_opened_range_is_reached_only_by_rules_within_it() {
        let opened = [Ipv4Net::parse("10.0.0.0/24").unwrap()];
        let sets: BTreeMap<String, Vec<Rule>> = [("wide".to_string(), vec![r("10.0.0.0/8")])].into();
        let reaches = |rule: &str, addr: &str| {
            let c = compile(&[r(rule)], &sets, &opened).unwrap();
            let a = u32::from(addr.parse::<Ipv4Addr>().unwrap());
            c.boxes.iter().any(|b| b.contains(a, 6, 80))
        };
        for wide in ["*", "0.0.0.0/0", "10.0.0.0/8", "10.0.0.0/23", "@wide"] {
            assert!(!reaches(wide, "10.0.0.1"), "{wide} reached the opened range");
        }
        assert!(reaches("*", "198.51.100.10") && reaches("10.0.0.0/23", "10.0.1.1"));
        for within in ["10.0.0.0/24", "10.0.0.1/32", "10.0.0.0/25:tcp/80"] {
            assert!(reaches(within, "10.0.0.1"), "{within}");
        }
    }

    #[test]
    fn learned_boxes_follow_the_names_still_open() {
        let now = Instant::now();
        let names: HashMap<String, Instant> =
            [("a.x.org".to_string(), now + Duration::from_secs(60)), ("old.y.org".to_string(), now)].into();
        let domains = vec![r("x.org:tcp/443"), r("y.org")];
        let e = learned_elements(Ipv4Addr::new(192, 0, 2, 1), &names, &domains, now);
        assert_eq!(e.len(), 1, "only x.org's box: y.org's name expired");
        assert!(e[0].timeout.unwrap() > Duration::from_secs(59));
        assert!(learned_elements(Ipv4Addr::new(192, 0, 2, 1), &names, &[], now).is_empty());
    }
}
