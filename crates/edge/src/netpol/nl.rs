//! Netlink from Rust, synchronously: one request (or one netfilter batch) per call, answered
//! by the kernel's acknowledgements. Used for links, addresses and routes (message types from
//! rtnetlink's builders), nftables set elements and conntrack flushes (encoded here: the few
//! attributes we need).
//!
//! Why not the `ip`/`nft` commands: each call rereads the whole ruleset or copies the mount
//! table, 100-300 ms on a host with thousands of sandboxes; a netlink batch costs tens of
//! microseconds. Only the edge's base table is loaded with `nft`, once, at start.
//!
//! A socket is bound to the network namespace it was opened in, whatever thread uses it later:
//! [`NlSocket::open_in`] opens one inside a sandbox's namespace from a short-lived thread.

use std::io;
use std::os::fd::AsFd;
use std::path::Path;
use std::time::Duration;

use rtnetlink::packet_core::{NLM_F_ACK, NLM_F_CREATE, NLM_F_EXCL, NLM_F_REQUEST, NetlinkMessage, NetlinkPayload};
use rtnetlink::packet_route::RouteNetlinkMessage;
use rtnetlink::sys::{Socket, protocols};

/// Largest netfilter batch sent (one datagram).
pub const MAX_BATCH_BYTES: usize = 8 << 20;
/// Most elements in one message: its element list's length must fit the u16 of a netlink
/// attribute (an element is at most ~100 bytes).
pub const MAX_ELEMENTS_PER_MESSAGE: usize = 256;

/// How long the kernel has to answer one request.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(5);

#[derive(Debug, thiserror::Error)]
pub enum NlError {
    #[error("netlink socket: {0}")]
    Socket(#[source] io::Error),
    #[error("netlink {what}: {source}")]
    Refused {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("netlink {what}: malformed answer")]
    Malformed { what: String },
}

impl NlError {
    /// The errno the kernel answered with, if it refused.
    pub fn errno(&self) -> Option<i32> {
        match self {
            NlError::Refused { source, .. } => source.raw_os_error(),
            _ => None,
        }
    }
}

/// A netlink socket of one protocol, in the namespace it was opened in.
#[derive(Debug)]
pub struct NlSocket {
    sock: Socket,
    seq: u32,
    buf: Vec<u8>,
}

const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const NLMSG_HDRLEN: usize = 16;

impl NlSocket {
    pub fn route() -> Result<NlSocket, NlError> {
        NlSocket::open(protocols::NETLINK_ROUTE)
    }

    pub fn netfilter() -> Result<NlSocket, NlError> {
        NlSocket::open(protocols::NETLINK_NETFILTER)
    }

    fn open(protocol: isize) -> Result<NlSocket, NlError> {
        let mut sock = Socket::new(protocol).map_err(NlError::Socket)?;
        sock.bind_auto().map_err(NlError::Socket)?;
        // Errors come back without a copy of the request (acks stay small).
        let _ = sock.set_cap_ack(true);
        let _ = sock.set_ext_ack(true);
        rustix::net::sockopt::set_socket_timeout(
            sock.as_fd(),
            rustix::net::sockopt::Timeout::Recv,
            Some(ANSWER_TIMEOUT),
        )
        .map_err(|e| NlError::Socket(e.into()))?;
        let _ = sock.set_rx_buf_sz(1 << 20);
        // A batch is one datagram: room for the largest a sandbox can make (as root, beyond
        // the default limit).
        let _ = rustix::net::sockopt::set_socket_send_buffer_size_force(sock.as_fd(), MAX_BATCH_BYTES);
        Ok(NlSocket { sock, seq: rand::random::<u32>() >> 1, buf: vec![0; 1 << 16] })
    }

    /// Opens a route socket inside the network namespace at `netns` (e.g. `/proc/<pid>/ns/net`).
    /// A thread of its own enters the namespace and ends: the caller's thread never moves.
    pub fn route_in(netns: &Path) -> Result<NlSocket, NlError> {
        let ns = std::fs::File::open(netns).map_err(NlError::Socket)?;
        std::thread::scope(|s| {
            s.spawn(|| {
                rustix::thread::move_into_link_name_space(ns.as_fd(), Some(rustix::thread::LinkNameSpaceType::Network))
                    .map_err(|e| NlError::Socket(e.into()))?;
                NlSocket::route()
            })
            .join()
            .unwrap_or_else(|_| Err(NlError::Socket(io::Error::other("netns thread panicked"))))
        })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1).max(1);
        self.seq
    }

    /// Sends one route request that changes something and waits for its ack.
    pub fn route_change(&mut self, what: &str, msg: RouteNetlinkMessage, exclusive: bool) -> Result<(), NlError> {
        let mut flags = NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE;
        if exclusive {
            flags |= NLM_F_EXCL;
        }
        let bytes = self.route_bytes(msg, flags);
        let seq = self.seq;
        self.sock.send(&bytes, 0).map_err(|source| NlError::Refused { what: what.into(), source })?;
        self.wait_acks(what, seq, seq)
    }

    /// Sends one route request that deletes something and waits for its ack.
    pub fn route_delete(&mut self, what: &str, msg: RouteNetlinkMessage) -> Result<(), NlError> {
        let bytes = self.route_bytes(msg, NLM_F_REQUEST | NLM_F_ACK);
        let seq = self.seq;
        self.sock.send(&bytes, 0).map_err(|source| NlError::Refused { what: what.into(), source })?;
        self.wait_acks(what, seq, seq)
    }

    /// Sends a get request (a dump when `dump`) and returns every answer.
    pub fn route_get(
        &mut self,
        what: &str,
        msg: RouteNetlinkMessage,
        dump: bool,
    ) -> Result<Vec<RouteNetlinkMessage>, NlError> {
        let mut flags = NLM_F_REQUEST;
        if dump {
            flags |= rtnetlink::packet_core::NLM_F_DUMP;
        }
        let bytes = self.route_bytes(msg, flags);
        let seq = self.seq;
        self.sock.send(&bytes, 0).map_err(|source| NlError::Refused { what: what.into(), source })?;
        let mut out = Vec::new();
        loop {
            let n = self.recv(what)?;
            let mut off = 0;
            while off + NLMSG_HDRLEN <= n {
                let (len, ty, mseq) = header(&self.buf[off..n]);
                if len < NLMSG_HDRLEN || off + len > n {
                    return Err(NlError::Malformed { what: what.into() });
                }
                let chunk = &self.buf[off..off + len];
                off += align(len);
                if mseq != seq {
                    continue;
                }
                match ty {
                    NLMSG_DONE => return Ok(out),
                    NLMSG_ERROR => {
                        let code = error_code(chunk).ok_or_else(|| NlError::Malformed { what: what.into() })?;
                        return if code == 0 { Ok(out) } else { Err(refused(what, code)) };
                    }
                    _ => {
                        let m = NetlinkMessage::<RouteNetlinkMessage>::deserialize(chunk)
                            .map_err(|_| NlError::Malformed { what: what.into() })?;
                        if let NetlinkPayload::InnerMessage(m) = m.payload {
                            out.push(m);
                        }
                        if !dump {
                            return Ok(out);
                        }
                    }
                }
            }
        }
    }

    fn route_bytes(&mut self, msg: RouteNetlinkMessage, flags: u16) -> Vec<u8> {
        let seq = self.next_seq();
        let mut m = NetlinkMessage::from(msg);
        m.header.flags = flags;
        m.header.sequence_number = seq;
        m.finalize();
        let mut bytes = vec![0u8; m.buffer_len()];
        m.serialize(&mut bytes);
        bytes
    }

    /// Sends a netfilter batch of `msgs` (each from [`NfMsg`]) and waits until the kernel
    /// acknowledged every one; the batch is all or nothing.
    pub fn nf_batch(&mut self, what: &str, msgs: &[NfMsg]) -> Result<(), NlError> {
        if msgs.is_empty() {
            return Ok(());
        }
        let mut out = Vec::with_capacity(msgs.iter().map(|m| m.attrs.len() + 40).sum::<usize>() + 64);
        let begin = self.next_seq();
        push_nf(&mut out, NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, begin, 0, NFNL_SUBSYS_NFTABLES, &[]);
        let first = begin.wrapping_add(1);
        let mut last = first;
        for m in msgs {
            last = self.next_seq();
            push_nf(&mut out, m.ty, m.flags | NLM_F_REQUEST | NLM_F_ACK, last, m.family, 0, &m.attrs);
        }
        let end = self.next_seq();
        push_nf(&mut out, NFNL_MSG_BATCH_END, NLM_F_REQUEST, end, 0, NFNL_SUBSYS_NFTABLES, &[]);
        if out.len() > MAX_BATCH_BYTES {
            return Err(NlError::Refused {
                what: format!("{what} ({} bytes, above {MAX_BATCH_BYTES})", out.len()),
                source: io::Error::from_raw_os_error(90),
            });
        }
        self.sock.send(&out, 0).map_err(|source| NlError::Refused { what: what.into(), source })?;
        self.wait_batch_acks(what, begin, first, last)
    }

    /// Sends one netfilter message outside a batch (conntrack) and waits for its ack.
    pub fn nf_one(&mut self, what: &str, m: &NfMsg) -> Result<(), NlError> {
        let seq = self.next_seq();
        let mut out = Vec::new();
        push_nf(&mut out, m.ty, m.flags | NLM_F_REQUEST | NLM_F_ACK, seq, m.family, 0, &m.attrs);
        self.sock.send(&out, 0).map_err(|source| NlError::Refused { what: what.into(), source })?;
        self.wait_acks(what, seq, seq)
    }

    fn recv(&mut self, what: &str) -> Result<usize, NlError> {
        let mut b = &mut self.buf[..];
        self.sock
            .recv(&mut b, 0)
            .map_err(|source| NlError::Refused { what: format!("{what} (waiting for the kernel)"), source })
    }

    /// [`NlSocket::wait_acks`] for a batch: a refusal of the batch as a whole comes back under
    /// the begin message's number, and then nothing else does.
    fn wait_batch_acks(&mut self, what: &str, begin: u32, first: u32, last: u32) -> Result<(), NlError> {
        self.wait_acks_or(what, Some(begin), first, last)
    }

    fn wait_acks(&mut self, what: &str, first: u32, last: u32) -> Result<(), NlError> {
        self.wait_acks_or(what, None, first, last)
    }

    /// Reads acks until every sequence number in `first..=last` was answered; the first
    /// refusal is returned once all are in (so no stale ack is left for the next call).
    fn wait_acks_or(&mut self, what: &str, begin: Option<u32>, first: u32, last: u32) -> Result<(), NlError> {
        let want = last.wrapping_sub(first) as usize + 1;
        let mut seen = 0usize;
        let mut failed: Option<NlError> = None;
        while seen < want {
            let n = self.recv(what)?;
            let mut off = 0;
            while off + NLMSG_HDRLEN <= n {
                let (len, ty, seq) = header(&self.buf[off..n]);
                if len < NLMSG_HDRLEN || off + len > n {
                    return Err(NlError::Malformed { what: what.into() });
                }
                let chunk = &self.buf[off..off + len];
                off += align(len);
                if ty == NLMSG_ERROR && Some(seq) == begin {
                    let code = error_code(chunk).ok_or_else(|| NlError::Malformed { what: what.into() })?;
                    if code != 0 {
                        return Err(refused(what, code));
                    }
                    continue;
                }
                if seq.wrapping_sub(first) as usize >= want || ty != NLMSG_ERROR {
                    continue;
                }
                seen += 1;
                let code = error_code(chunk).ok_or_else(|| NlError::Malformed { what: what.into() })?;
                if code != 0 && failed.is_none() {
                    failed = Some(refused(what, code));
                }
            }
        }
        failed.map_or(Ok(()), Err)
    }
}

fn refused(what: &str, code: i32) -> NlError {
    NlError::Refused { what: what.into(), source: io::Error::from_raw_os_error(-code) }
}

fn header(b: &[u8]) -> (usize, u16, u32) {
    let len = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let ty = u16::from_ne_bytes([b[4], b[5]]);
    let seq = u32::from_ne_bytes([b[8], b[9], b[10], b[11]]);
    (len, ty, seq)
}

fn error_code(msg: &[u8]) -> Option<i32> {
    let b = msg.get(NLMSG_HDRLEN..NLMSG_HDRLEN + 4)?;
    Some(i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
}

const fn align(n: usize) -> usize {
    (n + 3) & !3
}

// --- netfilter messages ---------------------------------------------------------------------

const NFNL_SUBSYS_CTNETLINK: u16 = 1;
const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_NEWSET: u16 = 9;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_DELSETELEM: u16 = 14;
const NFT_MSG_DESTROYCHAIN: u16 = 27;
const NFT_MSG_DESTROYRULE: u16 = 28;
const NFT_MSG_DESTROYSET: u16 = 29;
const NLM_F_APPEND: u16 = 0x800;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_PAYLOAD_DREG: u16 = 1;
const NFTA_PAYLOAD_BASE: u16 = 2;
const NFTA_PAYLOAD_OFFSET: u16 = 3;
const NFTA_PAYLOAD_LEN: u16 = 4;
const NFT_PAYLOAD_NETWORK_HEADER: u32 = 1;
const NFT_PAYLOAD_TRANSPORT_HEADER: u32 = 2;
const NFTA_META_DREG: u16 = 1;
const NFTA_META_KEY: u16 = 2;
const NFT_META_L4PROTO: u32 = 16;
const NFTA_LOOKUP_SET: u16 = 1;
const NFTA_LOOKUP_SREG: u16 = 2;
const NFTA_LOOKUP_SET_ID: u16 = 4;
const NFTA_IMMEDIATE_DREG: u16 = 1;
const NFTA_IMMEDIATE_DATA: u16 = 2;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFTA_VERDICT_CHAIN: u16 = 2;
const NF_ACCEPT: u32 = 1;
const NF_DROP: u32 = 0;
const NFT_JUMP: i32 = -3;
const NFTA_CONNLIMIT_COUNT: u16 = 1;
const NFTA_CONNLIMIT_FLAGS: u16 = 2;
const NFT_CONNLIMIT_F_INV: u32 = 1;
const NFTA_LIMIT_RATE: u16 = 1;
const NFTA_LIMIT_UNIT: u16 = 2;
const NFTA_LIMIT_BURST: u16 = 3;
const NFTA_LIMIT_TYPE: u16 = 4;
const NFTA_LIMIT_FLAGS: u16 = 5;
const NFT_LIMIT_PKTS: u32 = 0;
const NFT_LIMIT_F_INV: u32 = 1;
const NFTA_SET_TABLE: u16 = 1;
const NFTA_SET_NAME: u16 = 2;
const NFTA_SET_FLAGS: u16 = 3;
const NFTA_SET_KEY_TYPE: u16 = 4;
const NFTA_SET_KEY_LEN: u16 = 5;
const NFTA_SET_DESC: u16 = 9;
const NFTA_SET_ID: u16 = 10;
const NFTA_SET_DESC_CONCAT: u16 = 2;
const NFTA_SET_FIELD_LEN: u16 = 1;
const NFT_SET_INTERVAL: u32 = 0x4;
const NFT_SET_TIMEOUT: u32 = 0x10;
const NFT_SET_CONCAT: u32 = 0x80;
const NFT_MSG_DESTROYSETELEM: u16 = 30;
const IPCTNL_MSG_CT_DELETE: u16 = 2;
const NFPROTO_INET: u8 = 1;

const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_SET_ELEM_TIMEOUT: u16 = 4;
const NFTA_SET_ELEM_KEY_END: u16 = 10;
const NFTA_DATA_VALUE: u16 = 1;
const CTA_MARK: u16 = 8;
const CTA_MARK_MASK: u16 = 21;
const NLA_F_NESTED: u16 = 0x8000;

/// One netfilter message: type, flags, family and its attributes, encoded.
#[derive(Clone, Debug)]
pub struct NfMsg {
    ty: u16,
    flags: u16,
    family: u8,
    attrs: Vec<u8>,
}

fn push_nf(out: &mut Vec<u8>, ty: u16, flags: u16, seq: u32, family: u8, res_id: u16, attrs: &[u8]) {
    let len = NLMSG_HDRLEN + 4 + attrs.len();
    out.extend_from_slice(&(len as u32).to_ne_bytes());
    out.extend_from_slice(&ty.to_ne_bytes());
    out.extend_from_slice(&flags.to_ne_bytes());
    out.extend_from_slice(&seq.to_ne_bytes());
    out.extend_from_slice(&0u32.to_ne_bytes());
    // nfgenmsg: family, version 0, resource id (big endian).
    out.push(family);
    out.push(0);
    out.extend_from_slice(&res_id.to_be_bytes());
    out.extend_from_slice(attrs);
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

fn attr(out: &mut Vec<u8>, ty: u16, payload: &[u8]) {
    out.extend_from_slice(&((4 + payload.len()) as u16).to_ne_bytes());
    out.extend_from_slice(&ty.to_ne_bytes());
    out.extend_from_slice(payload);
    while !out.len().is_multiple_of(4) {
        out.push(0);
    }
}

fn nested(out: &mut Vec<u8>, ty: u16, inner: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&(ty | NLA_F_NESTED).to_ne_bytes());
    inner(out);
    let len = (out.len() - start) as u16;
    out[start..start + 2].copy_from_slice(&len.to_ne_bytes());
}

fn cstr(s: &str) -> Vec<u8> {
    let mut v = s.as_bytes().to_vec();
    v.push(0);
    v
}

/// One element of an nftables set: its key (the range's end too for interval sets), its data
/// for maps, and its timeout for sets that have them.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Element {
    pub key: Vec<u8>,
    pub key_end: Option<Vec<u8>>,
    pub data: Option<Vec<u8>>,
    pub timeout: Option<Duration>,
    /// Verdict maps: jump to this chain.
    pub jump: Option<String>,
}

/// Which set elements a message adds or deletes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ElemOp {
    /// Added; an identical element already there is no error.
    Add,
    /// Deleted if there (`NFT_MSG_DESTROYSETELEM`, Linux 6.3 and later): an element the
    /// kernel already expired, or never had, is no error. Keys must match exactly.
    Delete,
}

/// Messages adding or deleting `elems` in set `set`, at most [`MAX_ELEMENTS_PER_MESSAGE`]
/// each (one batch still makes them all or nothing).
pub fn set_elements_chunked(op: ElemOp, table: &str, set: &str, elems: &[Element]) -> Vec<NfMsg> {
    elems.chunks(MAX_ELEMENTS_PER_MESSAGE).map(|c| set_elements(op, table, set, c)).collect()
}

/// A message adding or deleting `elems` in set `set` of the `inet` table `table`.
pub fn set_elements(op: ElemOp, table: &str, set: &str, elems: &[Element]) -> NfMsg {
    let mut a = Vec::with_capacity(64 + elems.len() * 64);
    attr(&mut a, NFTA_SET_ELEM_LIST_TABLE, &cstr(table));
    attr(&mut a, NFTA_SET_ELEM_LIST_SET, &cstr(set));
    nested(&mut a, NFTA_SET_ELEM_LIST_ELEMENTS, |a| {
        for e in elems {
            nested(a, NFTA_LIST_ELEM, |a| {
                nested(a, NFTA_SET_ELEM_KEY, |a| attr(a, NFTA_DATA_VALUE, &e.key));
                if let Some(end) = &e.key_end {
                    nested(a, NFTA_SET_ELEM_KEY_END, |a| attr(a, NFTA_DATA_VALUE, end));
                }
                if let Some(t) = e.timeout
                    && op == ElemOp::Add
                {
                    attr(a, NFTA_SET_ELEM_TIMEOUT, &(t.as_millis() as u64).to_be_bytes());
                }
                if let Some(d) = &e.data
                    && op == ElemOp::Add
                {
                    nested(a, NFTA_SET_ELEM_DATA, |a| attr(a, NFTA_DATA_VALUE, d));
                }
                if let Some(chain) = &e.jump
                    && op == ElemOp::Add
                {
                    nested(a, NFTA_SET_ELEM_DATA, |a| jump_verdict(a, chain));
                }
            });
        }
    });
    let (ty, flags) = match op {
        ElemOp::Add => (NFT_MSG_NEWSETELEM, NLM_F_CREATE),
        ElemOp::Delete => (NFT_MSG_DESTROYSETELEM, 0),
    };
    NfMsg { ty: (NFNL_SUBSYS_NFTABLES << 8) | ty, flags, family: NFPROTO_INET, attrs: a }
}

fn jump_verdict(a: &mut Vec<u8>, chain: &str) {
    nested(a, NFTA_DATA_VERDICT, |a| {
        attr(a, NFTA_VERDICT_CODE, &NFT_JUMP.to_be_bytes());
        attr(a, NFTA_VERDICT_CHAIN, &cstr(chain));
    });
}

fn nft_msg(ty: u16, flags: u16, attrs: Vec<u8>) -> NfMsg {
    NfMsg { ty: (NFNL_SUBSYS_NFTABLES << 8) | ty, flags, family: NFPROTO_INET, attrs }
}

/// A message naming one object of `table`: its table and name attributes, nothing else.
fn named(ty: u16, flags: u16, attrs: (u16, u16), table: &str, name: &str) -> NfMsg {
    let mut a = Vec::new();
    attr(&mut a, attrs.0, &cstr(table));
    attr(&mut a, attrs.1, &cstr(name));
    nft_msg(ty, flags, a)
}

/// A regular chain `chain` in `table`.
pub fn new_chain(table: &str, chain: &str) -> NfMsg {
    named(NFT_MSG_NEWCHAIN, NLM_F_CREATE, (NFTA_CHAIN_TABLE, NFTA_CHAIN_NAME), table, chain)
}

/// Removes chain `chain` if it is there (it must be empty and unreferenced by then).
pub fn destroy_chain(table: &str, chain: &str) -> NfMsg {
    named(NFT_MSG_DESTROYCHAIN, 0, (NFTA_CHAIN_TABLE, NFTA_CHAIN_NAME), table, chain)
}

/// Removes every rule of chain `chain`, if the chain is there.
pub fn flush_chain(table: &str, chain: &str) -> NfMsg {
    named(NFT_MSG_DESTROYRULE, 0, (NFTA_RULE_TABLE, NFTA_RULE_CHAIN), table, chain)
}

/// nftables' data type of `ipv4_addr . inet_proto . inet_service` (shown by `nft list`).
const BOX_KEY_TYPE: u32 = ((7 << 6 | 12) << 6) | 13;

/// A set of (destination . protocol . port) ranges: the kernel's concatenated-range set
/// (fields of 4, 1 and 2 bytes, each in a 4-byte register), with element timeouts when
/// `timeout`. `id` names it within the batch (rules of the same batch look it up by it).
pub fn new_box_set(table: &str, set: &str, id: u32, timeout: bool) -> NfMsg {
    let mut a = Vec::new();
    attr(&mut a, NFTA_SET_TABLE, &cstr(table));
    attr(&mut a, NFTA_SET_NAME, &cstr(set));
    let mut flags = NFT_SET_INTERVAL | NFT_SET_CONCAT;
    if timeout {
        flags |= NFT_SET_TIMEOUT;
    }
    attr(&mut a, NFTA_SET_FLAGS, &flags.to_be_bytes());
    attr(&mut a, NFTA_SET_KEY_TYPE, &BOX_KEY_TYPE.to_be_bytes());
    attr(&mut a, NFTA_SET_KEY_LEN, &12u32.to_be_bytes());
    attr(&mut a, NFTA_SET_ID, &id.to_be_bytes());
    nested(&mut a, NFTA_SET_DESC, |a| {
        nested(a, NFTA_SET_DESC_CONCAT, |a| {
            for len in [4u32, 1, 2] {
                nested(a, NFTA_LIST_ELEM, |a| attr(a, NFTA_SET_FIELD_LEN, &len.to_be_bytes()));
            }
        });
    });
    nft_msg(NFT_MSG_NEWSET, NLM_F_CREATE, a)
}

/// Removes set `set` if it is there (no rule may use it by then).
pub fn destroy_set(table: &str, set: &str) -> NfMsg {
    named(NFT_MSG_DESTROYSET, 0, (NFTA_SET_TABLE, NFTA_SET_NAME), table, set)
}

/// Removes every element of set `set`.
pub fn flush_set(table: &str, set: &str) -> NfMsg {
    named(NFT_MSG_DELSETELEM, 0, (NFTA_SET_ELEM_LIST_TABLE, NFTA_SET_ELEM_LIST_SET), table, set)
}

/// The rule `ip daddr . meta l4proto . th dport @set accept` appended to `chain` (`set_id`:
/// the set's id when it is created in the same batch).
pub fn box_lookup_rule(table: &str, chain: &str, set: &str, set_id: u32) -> NfMsg {
    lookup_rule(table, chain, set, set_id, Direction::Out)
}

/// Which packets a box rule matches: a sandbox's own (destination . protocol . destination
/// port), or the replies it gets (source . protocol . source port), against the same sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Direction {
    Out,
    Reply,
}

/// The rule `ip saddr . meta l4proto . th sport @set accept` appended to `chain`: replies from
/// what the set still allows.
pub fn reply_lookup_rule(table: &str, chain: &str, set: &str, set_id: u32) -> NfMsg {
    lookup_rule(table, chain, set, set_id, Direction::Reply)
}

fn lookup_rule(table: &str, chain: &str, set: &str, set_id: u32, dir: Direction) -> NfMsg {
    // ip saddr is at 12, daddr at 16; th sport at 0, dport at 2.
    let (addr_at, port_at) = match dir {
        Direction::Out => (16, 2),
        Direction::Reply => (12, 0),
    };
    const REG32_00: u32 = 8;
    let mut a = Vec::new();
    attr(&mut a, NFTA_RULE_TABLE, &cstr(table));
    attr(&mut a, NFTA_RULE_CHAIN, &cstr(chain));
    let expr = |a: &mut Vec<u8>, name: &str, data: &dyn Fn(&mut Vec<u8>)| {
        nested(a, NFTA_LIST_ELEM, |a| {
            attr(a, NFTA_EXPR_NAME, &cstr(name));
            nested(a, NFTA_EXPR_DATA, |a| data(a));
        });
    };
    let be = |v: u32| v.to_be_bytes();
    nested(&mut a, NFTA_RULE_EXPRESSIONS, |a| {
        expr(a, "payload", &|a| {
            attr(a, NFTA_PAYLOAD_DREG, &be(REG32_00));
            attr(a, NFTA_PAYLOAD_BASE, &be(NFT_PAYLOAD_NETWORK_HEADER));
            attr(a, NFTA_PAYLOAD_OFFSET, &be(addr_at));
            attr(a, NFTA_PAYLOAD_LEN, &be(4));
        });
        expr(a, "meta", &|a| {
            attr(a, NFTA_META_DREG, &be(REG32_00 + 1));
            attr(a, NFTA_META_KEY, &be(NFT_META_L4PROTO));
        });
        expr(a, "payload", &|a| {
            attr(a, NFTA_PAYLOAD_DREG, &be(REG32_00 + 2));
            attr(a, NFTA_PAYLOAD_BASE, &be(NFT_PAYLOAD_TRANSPORT_HEADER));
            attr(a, NFTA_PAYLOAD_OFFSET, &be(port_at));
            attr(a, NFTA_PAYLOAD_LEN, &be(2));
        });
        expr(a, "lookup", &|a| {
            attr(a, NFTA_LOOKUP_SET, &cstr(set));
            attr(a, NFTA_LOOKUP_SREG, &be(REG32_00));
            attr(a, NFTA_LOOKUP_SET_ID, &be(set_id));
        });
        expr(a, "immediate", &|a| {
            attr(a, NFTA_IMMEDIATE_DREG, &be(0));
            nested(a, NFTA_IMMEDIATE_DATA, |a| {
                nested(a, NFTA_DATA_VERDICT, |a| attr(a, NFTA_VERDICT_CODE, &be(NF_ACCEPT)));
            });
        });
    });
    nft_msg(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, a)
}

/// What a drop rule matches before it drops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DropWhen {
    /// Always (`drop`).
    Always,
    /// More than this many connections have passed the rule and are still open
    /// (`ct count over N drop`): one count for every packet that reaches the rule.
    CountOver(u32),
    /// More than this many packets a second, with this burst (`limit rate over R/second
    /// burst B packets drop`).
    RateOver { per_second: u64, burst: u32 },
}

/// A rule appended to `chain` that drops what `when` says (see [`DropWhen`]).
pub fn drop_rule(table: &str, chain: &str, when: DropWhen) -> NfMsg {
    let mut a = Vec::new();
    attr(&mut a, NFTA_RULE_TABLE, &cstr(table));
    attr(&mut a, NFTA_RULE_CHAIN, &cstr(chain));
    let expr = |a: &mut Vec<u8>, name: &str, data: &dyn Fn(&mut Vec<u8>)| {
        nested(a, NFTA_LIST_ELEM, |a| {
            attr(a, NFTA_EXPR_NAME, &cstr(name));
            nested(a, NFTA_EXPR_DATA, |a| data(a));
        });
    };
    nested(&mut a, NFTA_RULE_EXPRESSIONS, |a| {
        match when {
            DropWhen::Always => {}
            DropWhen::CountOver(n) => expr(a, "connlimit", &|a| {
                attr(a, NFTA_CONNLIMIT_COUNT, &n.to_be_bytes());
                attr(a, NFTA_CONNLIMIT_FLAGS, &NFT_CONNLIMIT_F_INV.to_be_bytes());
            }),
            DropWhen::RateOver { per_second, burst } => expr(a, "limit", &|a| {
                attr(a, NFTA_LIMIT_RATE, &per_second.to_be_bytes());
                attr(a, NFTA_LIMIT_UNIT, &1u64.to_be_bytes());
                attr(a, NFTA_LIMIT_BURST, &burst.to_be_bytes());
                attr(a, NFTA_LIMIT_TYPE, &NFT_LIMIT_PKTS.to_be_bytes());
                attr(a, NFTA_LIMIT_FLAGS, &NFT_LIMIT_F_INV.to_be_bytes());
            }),
        }
        expr(a, "immediate", &|a| {
            attr(a, NFTA_IMMEDIATE_DREG, &0u32.to_be_bytes());
            nested(a, NFTA_IMMEDIATE_DATA, |a| {
                nested(a, NFTA_DATA_VERDICT, |a| attr(a, NFTA_VERDICT_CODE, &NF_DROP.to_be_bytes()));
            });
        });
    });
    nft_msg(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, a)
}

/// A message deleting every conntrack entry whose mark is `mark` (all families).
pub fn conntrack_flush_mark(mark: u32) -> NfMsg {
    let mut a = Vec::with_capacity(16);
    attr(&mut a, CTA_MARK, &mark.to_be_bytes());
    attr(&mut a, CTA_MARK_MASK, &u32::MAX.to_be_bytes());
    NfMsg { ty: (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_DELETE, flags: 0, family: 0, attrs: a }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn element_messages_nest_and_pad() {
        let e = Element {
            key: vec![1, 2, 3, 4, 5],
            key_end: Some(vec![9; 5]),
            data: None,
            timeout: Some(Duration::from_secs(2)),
            jump: None,
        };
        let m = set_elements(ElemOp::Add, "t", "s", &[e]);
        assert_eq!(m.attrs.len() % 4, 0);
        // table "t\0" padded: len 6 -> 8 bytes, then the set.
        assert_eq!(&m.attrs[..8], &[6, 0, 1, 0, b't', 0, 0, 0]);
        assert_eq!(&m.attrs[8..16], &[6, 0, 2, 0, b's', 0, 0, 0]);
        let list_len = u16::from_ne_bytes([m.attrs[16], m.attrs[17]]) as usize;
        assert_eq!(16 + list_len, m.attrs.len(), "the element list spans the rest");
        assert!(m.attrs.windows(8).any(|w| w == 2000u64.to_be_bytes()), "timeout in ms, big endian");
        // A deletion carries no timeout.
        let d = set_elements(
            ElemOp::Delete,
            "t",
            "s",
            &[Element {
                key: vec![0; 4],
                key_end: None,
                data: None,
                timeout: Some(Duration::from_secs(2)),
                jump: None,
            }],
        );
        assert!(!d.attrs.windows(8).any(|w| w == 2000u64.to_be_bytes()));
    }
}
