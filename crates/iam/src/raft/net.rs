//! Raft messages between members over gRPC (`IamRaft`, mTLS with `iam` certificates on both
//! sides): each request and reply is an openraft value in JSON. A snapshot travels as a
//! stream: its meta and the leader's vote first, then its data in chunks.
//!
//! Every message also says, in its headers, which cluster the sender belongs to, which data
//! directory it runs on, and which data directory its cluster has recorded for the receiver;
//! every reply says the receiver's. A member refuses a message from another cluster, from a
//! member whose directory is not the recorded one, and any message that says its own
//! directory is another: a member whose directory was wiped or replaced takes no part until
//! it is added again under a new id ([`check_claims`]).

use std::future::Future;
use std::sync::Arc;

use opendsec_common::grpc::{Links, MAX_MESSAGE_BYTES};
use opendsec_common::pki::Role;
use opendsec_proto::v1 as pb;
use openraft::async_runtime::WatchReceiver;
use openraft::errors::{NetworkError, RPCError, RaftError, ReplicationClosed, StreamingError, Timeout, Unreachable};
use openraft::network::v2::RaftNetworkV2;
use openraft::network::{RPCOption, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, SnapshotResponse, TransferLeaderRequest, TransferLeaderResponse,
    VoteRequest, VoteResponse,
};
use openraft::type_config::alias::{SnapshotMetaOf, SnapshotOf, VoteOf};
use openraft::{BasicNode, OptionalSend, RPCTypes};
use pb::iam_raft_client::IamRaftClient;
use serde::Serialize;
use serde::de::DeserializeOwned;
use tokio_stream::StreamExt;
use tonic::transport::Channel;
use tonic::{Request, Response, Status, Streaming};

use super::types::C;
use crate::store::Shared;

/// The sender's cluster id.
const CLUSTER: &str = "x-opendsec-iam-cluster";
/// The sender's data directory id.
const FROM_DIR: &str = "x-opendsec-iam-from-dir";
/// The data directory id the sender's cluster recorded for the receiver.
const TO_DIR: &str = "x-opendsec-iam-to-dir";
/// In replies: the receiver's data directory id.
const DIR: &str = "x-opendsec-iam-dir";
/// In replies: the log format the receiver reads ([`LOG_FORMAT`]); absent, 1.
const FORMAT: &str = "x-opendsec-iam-log-format";

/// What this release reads in the log, said in every reply. 1: what the releases before this
/// number read. 2: the fenced reconciliations ([`crate::command::Command::FencedReconcile`]
/// and `FencedSweep`). 3: sandbox tokens ([`crate::command::Command::MintSandboxTokens`]) and the store's charges.
/// 4: pool members' leases (`AdmitMember`, `AdmitClaim`, reconciliations naming pools). A
/// member that cannot decode an entry stops short of it until it is
/// upgraded (it never applies an entry another way); so that a rolling upgrade does not stop
/// members that way, a leader does not propose an entry of a format
/// ([`crate::command::Command::log_format`]) that a member last answered it with a lower one.
pub const LOG_FORMAT: u32 = 4;

/// What a member says and checks about itself in Raft messages.
#[derive(Clone)]
pub struct Who {
    /// This member's id.
    pub id: u64,
    /// This member's data directory id.
    pub data_dir: String,
    /// The state: the cluster's id and the recorded data directories.
    pub shared: Arc<Shared>,
    /// Members' data directory ids seen in replies and not recorded yet (the leader records
    /// them; a full queue drops what it cannot take, the next reply brings it again).
    pub seen: tokio::sync::mpsc::Sender<(u64, String)>,
    /// The members that have answered with their data directory id since this start.
    answered: Arc<std::sync::Mutex<std::collections::BTreeSet<u64>>>,
    /// The log format each member last answered with, since this start.
    formats: Arc<std::sync::Mutex<std::collections::BTreeMap<u64, u32>>>,
    /// The log format this member says it reads: [`LOG_FORMAT`] (tests play an older release
    /// with a lower one).
    format: Arc<std::sync::atomic::AtomicU32>,
}

pub use crate::model::well_formed_id;

impl Who {
    pub fn new(id: u64, data_dir: String, shared: Arc<Shared>, seen: tokio::sync::mpsc::Sender<(u64, String)>) -> Who {
        Who {
            id,
            data_dir,
            shared,
            seen,
            answered: Arc::default(),
            formats: Arc::default(),
            format: Arc::new(LOG_FORMAT.into()),
        }
    }

    /// The log format member `id` last answered with since this start (none: it has not
    /// answered yet).
    pub fn format_of(&self, id: u64) -> Option<u32> {
        self.formats.lock().unwrap_or_else(|p| p.into_inner()).get(&id).copied()
    }

    /// Makes this member say it reads log format `format` (1: it says nothing, as the releases
    /// before the number). For tests that play a member on an older release.
    #[doc(hidden)]
    pub fn announce_format(&self, format: u32) {
        self.format.store(format, std::sync::atomic::Ordering::Relaxed);
    }

    /// The members that have answered with their data directory id since this start.
    pub fn answered(&self) -> std::collections::BTreeSet<u64> {
        self.answered.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    fn set(&self, md: &mut tonic::metadata::MetadataMap, key: &'static str, value: &str) {
        if !value.is_empty()
            && let Ok(v) = value.parse()
        {
            md.insert(key, v);
        }
    }

    /// Headers of a message to member `target`.
    fn stamp(&self, target: u64, md: &mut tonic::metadata::MetadataMap) {
        let (cluster, theirs) = {
            let st = self.shared.read();
            (st.meta.cluster.clone(), st.meta.members.get(&target).cloned().unwrap_or_default())
        };
        self.set(md, CLUSTER, &cluster);
        self.set(md, FROM_DIR, &self.data_dir);
        self.set(md, TO_DIR, &theirs);
    }

    /// Notes the data directory member `target` answered with, unless it is recorded.
    fn heard(&self, target: u64, md: &tonic::metadata::MetadataMap) {
        let format = md.get(FORMAT).and_then(|v| v.to_str().ok()?.parse().ok()).unwrap_or(1);
        self.formats.lock().unwrap_or_else(|p| p.into_inner()).insert(target, format);
        let Some(dir) = md.get(DIR).and_then(|v| v.to_str().ok()).filter(|d| well_formed_id(d)) else { return };
        self.answered.lock().unwrap_or_else(|p| p.into_inner()).insert(target);
        if !self.shared.read().meta.members.contains_key(&target) {
            let _ = self.seen.try_send((target, dir.to_string()));
        }
    }
}

/// What a Raft message claims about its cluster and the two members' data directories.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Claims {
    pub cluster: Option<String>,
    pub from_dir: Option<String>,
    pub to_dir: Option<String>,
}

impl Claims {
    fn of(md: &tonic::metadata::MetadataMap) -> Claims {
        let get = |k: &str| md.get(k).and_then(|v| v.to_str().ok()).map(str::to_string);
        Claims { cluster: get(CLUSTER), from_dir: get(FROM_DIR), to_dir: get(TO_DIR) }
    }
}

/// Whether a message from member `from` may be believed by a member on data directory
/// `own_dir` of cluster `own_cluster` (empty: not known yet) that has `records`. What a side
/// does not know yet is not checked.
pub fn check_claims(
    from: u64,
    me: u64,
    own_dir: &str,
    own_cluster: &str,
    records: &std::collections::BTreeMap<u64, String>,
    c: &Claims,
) -> Result<(), Status> {
    if [&c.cluster, &c.from_dir, &c.to_dir].into_iter().flatten().any(|v| !well_formed_id(v)) {
        return Err(Status::invalid_argument(format!(
            "member {from} sent a cluster or data directory id that is not 32 hex digits"
        )));
    }
    if let Some(theirs) = &c.cluster
        && !own_cluster.is_empty()
        && theirs != own_cluster
    {
        return Err(Status::permission_denied(format!(
            "member {from} belongs to IAM cluster {theirs}, this member to cluster {own_cluster}"
        )));
    }
    if let Some(mine) = &c.to_dir
        && mine != own_dir
    {
        return Err(Status::failed_precondition(format!(
            "IAM member {me} refuses member {from}: the cluster recorded data directory {mine} for member {me}, and \
             member {me} runs on {own_dir}: its directory was wiped or replaced. Remove member {me} (opendsecctl iam \
             remove {me}) and add its replacement under an id never used"
        )));
    }
    if let (Some(rec), Some(theirs)) = (records.get(&from), &c.from_dir)
        && rec != theirs
    {
        return Err(Status::permission_denied(format!(
            "IAM member {me} refuses member {from}: member {from} runs on data directory {theirs}, not on the one \
             recorded for it ({rec}): its directory was wiped or replaced"
        )));
    }
    Ok(())
}

/// Bytes of snapshot data per message.
const CHUNK: usize = 1 << 20;
/// The largest snapshot a member takes (IAM's whole state; twice the largest backup).
pub const MAX_SNAPSHOT_BYTES: usize = 2 << 30;

/// Makes connections to the other members.
#[derive(Clone)]
pub struct Network {
    pub from: u64,
    pub links: Arc<Links>,
    pub who: Who,
}

impl RaftNetworkFactory<C> for Network {
    type Network = Conn;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> Conn {
        Conn { from: self.from, target, addr: node.addr.clone(), links: self.links.clone(), who: self.who.clone() }
    }
}

pub struct Conn {
    from: u64,
    target: u64,
    addr: String,
    links: Arc<Links>,
    who: Who,
}

fn unreachable<E: std::fmt::Display>(e: E) -> RPCError<C> {
    RPCError::Unreachable(Unreachable::from_string(e.to_string()))
}

fn network<E: std::fmt::Display>(e: E) -> RPCError<C> {
    RPCError::Network(NetworkError::from_string(e.to_string()))
}

impl Conn {
    fn client(&self) -> Result<IamRaftClient<Channel>, RPCError<C>> {
        // The member at that address must be the one named: a reply's data directory id is
        // recorded as the target's.
        let name = self.target.to_string();
        let ch = self.links.channel(&self.addr, Role::Iam, Some(&name)).map_err(|e| unreachable(e.message))?;
        Ok(IamRaftClient::new(ch)
            .max_decoding_message_size(MAX_MESSAGE_BYTES)
            .max_encoding_message_size(MAX_MESSAGE_BYTES))
    }

    fn timeout(&self, action: RPCTypes, option: &RPCOption) -> RPCError<C> {
        RPCError::Timeout(Timeout { action, id: self.from, target: self.target, timeout: option.soft_ttl() })
    }

    /// One request, one reply, within the option's deadline.
    async fn unary<Req, Resp, F, Fut>(
        &self,
        action: RPCTypes,
        req: &Req,
        option: &RPCOption,
        call: F,
    ) -> Result<Resp, RPCError<C>>
    where
        Req: Serialize,
        Resp: DeserializeOwned,
        F: FnOnce(IamRaftClient<Channel>, Request<pb::RaftMessage>) -> Fut,
        Fut: Future<Output = Result<Response<pb::RaftMessage>, Status>>,
    {
        let data = serde_json::to_vec(req).map_err(network)?;
        let client = self.client()?;
        let mut msg = Request::new(pb::RaftMessage { data });
        self.who.stamp(self.target, msg.metadata_mut());
        let reply = match tokio::time::timeout(option.soft_ttl(), call(client, msg)).await {
            Err(_) => return Err(self.timeout(action, option)),
            Ok(Err(st)) if st.code() == tonic::Code::Unavailable => return Err(unreachable(st.message())),
            Ok(Err(st)) => return Err(network(st.message())),
            Ok(Ok(r)) => {
                self.who.heard(self.target, r.metadata());
                r.into_inner()
            }
        };
        let r: Result<Resp, RaftError<C>> = serde_json::from_slice(&reply.data).map_err(network)?;
        // Only a fatal error (the far member stopped) comes back: it cannot be reached.
        r.map_err(unreachable)
    }
}

impl RaftNetworkV2<C> for Conn {
    type SnapshotData = Vec<u8>;

    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<C>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<C>, RPCError<C>> {
        self.unary(RPCTypes::AppendEntries, &rpc, &option, |mut c, m| async move { c.append_entries(m).await }).await
    }

    async fn vote(&mut self, rpc: VoteRequest<C>, option: RPCOption) -> Result<VoteResponse<C>, RPCError<C>> {
        self.unary(RPCTypes::Vote, &(false, rpc), &option, |mut c, m| async move { c.vote(m).await }).await
    }

    async fn pre_vote(&mut self, rpc: VoteRequest<C>, option: RPCOption) -> Result<VoteResponse<C>, RPCError<C>> {
        self.unary(RPCTypes::Vote, &(true, rpc), &option, |mut c, m| async move { c.vote(m).await }).await
    }

    async fn transfer_leader(
        &mut self,
        req: TransferLeaderRequest<C>,
        option: RPCOption,
    ) -> Result<TransferLeaderResponse<C>, RPCError<C>> {
        self.unary(RPCTypes::TransferLeader, &req, &option, |mut c, m| async move { c.transfer_leader(m).await }).await
    }

    async fn full_snapshot(
        &mut self,
        vote: VoteOf<C>,
        snapshot: SnapshotOf<C, Vec<u8>>,
        cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<C>, StreamingError<C>> {
        let head = serde_json::to_vec(&(vote, snapshot.meta)).map_err(network)?;
        // Each chunk is copied out as the stream sends it: the snapshot is held once.
        let data = Arc::new(snapshot.snapshot);
        let chunks = data.len().div_ceil(CHUNK);
        let body = tokio_stream::iter(0..chunks)
            .map(move |i| pb::RaftMessage { data: data[i * CHUNK..((i + 1) * CHUNK).min(data.len())].to_vec() });
        let messages = tokio_stream::iter([pb::RaftMessage { data: head }]).chain(body);
        let mut client = self.client()?;
        let mut msg = Request::new(messages);
        self.who.stamp(self.target, msg.metadata_mut());
        let (who, target) = (self.who.clone(), self.target);
        let send = async move {
            let reply = client.install_snapshot(msg).await;
            match reply {
                Err(st) => Err(unreachable(st.message())),
                Ok(r) => {
                    who.heard(target, r.metadata());
                    let r: Result<SnapshotResponse<C>, RaftError<C>> =
                        serde_json::from_slice(&r.into_inner().data).map_err(network)?;
                    r.map_err(unreachable)
                }
            }
        };
        let timeout = option.hard_ttl();
        tokio::select! {
            closed = cancel => Err(StreamingError::Closed(closed)),
            r = tokio::time::timeout(timeout, send) => match r {
                Err(_) => Err(self.timeout(RPCTypes::InstallSnapshot, &option).into()),
                Ok(r) => Ok(r?),
            },
        }
    }
}

/// The `IamRaft` service: hands each message to this member's Raft, once it is sure the
/// message comes from the member it says it does. A member's certificate names its id
/// (`iam/<id>`): a leader's append, snapshot and hand-over must carry its own id in their vote,
/// a candidate's vote request its own, and the sender must be in this member's membership
/// (once it has one). So a removed member, or one posing as another, moves nothing.
pub struct RaftService {
    raft: super::Current,
    who: Who,
    /// A member whose Raft just started (the process, or a restart after a storage failure)
    /// has forgotten how recently it heard a leader: it grants no vote until a leader's lease
    /// would have run out, so that no leader is elected while the last one may still serve
    /// lease reads.
    lease: std::time::Duration,
    /// One snapshot install at a time (each is held whole in memory).
    installing: tokio::sync::Semaphore,
}

impl RaftService {
    pub fn new(raft: super::Current, who: Who, lease: std::time::Duration) -> RaftService {
        RaftService { raft, who, lease, installing: tokio::sync::Semaphore::new(1) }
    }

    /// A reply, with this member's data directory id and log format.
    fn reply<T: Serialize>(&self, r: &T) -> Result<Response<pb::RaftMessage>, Status> {
        let mut resp = reply(r)?;
        self.who.set(resp.metadata_mut(), DIR, &self.who.data_dir);
        let format = self.who.format.load(std::sync::atomic::Ordering::Relaxed);
        if format > 1 {
            self.who.set(resp.metadata_mut(), FORMAT, &format.to_string());
        }
        Ok(resp)
    }

    /// Refuses a message whose claims do not hold (another cluster, a wiped or replaced
    /// member's directory on either side); the refusal is kept for `Replica::refused`.
    fn believe(&self, from: u64, md: &tonic::metadata::MetadataMap) -> Result<(), Status> {
        let st = self.who.shared.read();
        let r =
            check_claims(from, self.who.id, &self.who.data_dir, &st.meta.cluster, &st.meta.members, &Claims::of(md));
        drop(st);
        if let Err(e) = &r
            && self.raft.refuse(from, e.code(), e.message())
        {
            tracing::error!(from, error = %e.message(), "iam raft message refused");
        }
        r
    }

    /// The sending member's id, from its certificate; refused unless it is in this member's
    /// membership (when it knows one: a member being added knows none until the leader's
    /// first message).
    fn sender<T>(&self, req: &Request<T>) -> Result<u64, Status> {
        let peer = opendsec_common::acl::peer(req).ok_or_else(|| Status::unauthenticated("no member certificate"))?;
        let id: u64 = peer
            .name
            .parse()
            .map_err(|_| Status::permission_denied(format!("{peer} is no IAM member (members are iam/<id>)")))?;
        let m = self.raft.get().metrics().borrow_watched().clone();
        let membership = m.membership_config.membership();
        if membership.nodes().next().is_some() && membership.get_node(&id).is_none() {
            return Err(Status::permission_denied(format!("IAM member {id} is not in this member's membership")));
        }
        self.believe(id, req.metadata())?;
        Ok(id)
    }
}

fn must_be(from: u64, claimed: u64, what: &str) -> Result<(), Status> {
    if from == claimed {
        Ok(())
    } else {
        Err(Status::permission_denied(format!("member {from} sent a {what} in the name of member {claimed}")))
    }
}

fn decode<T: DeserializeOwned>(m: &pb::RaftMessage) -> Result<T, Status> {
    serde_json::from_slice(&m.data).map_err(|e| Status::invalid_argument(format!("undecodable raft message: {e}")))
}

fn reply<T: Serialize>(r: &T) -> Result<Response<pb::RaftMessage>, Status> {
    let data = serde_json::to_vec(r).map_err(|e| Status::internal(format!("raft reply: {e}")))?;
    Ok(Response::new(pb::RaftMessage { data }))
}

#[tonic::async_trait]
impl pb::iam_raft_server::IamRaft for RaftService {
    async fn append_entries(&self, req: Request<pb::RaftMessage>) -> Result<Response<pb::RaftMessage>, Status> {
        let from = self.sender(&req)?;
        let rpc: AppendEntriesRequest<C> = decode(req.get_ref())?;
        must_be(from, rpc.vote.leader_id().node_id, "log append")?;
        self.reply(&self.raft.get().append_entries(rpc).await)
    }

    async fn vote(&self, req: Request<pb::RaftMessage>) -> Result<Response<pb::RaftMessage>, Status> {
        let from = self.sender(&req)?;
        let (pre, rpc): (bool, VoteRequest<C>) = decode(req.get_ref())?;
        must_be(from, rpc.vote.leader_id().node_id, "vote request")?;
        if tokio::time::Instant::now() < self.raft.started() + self.lease {
            return Err(Status::unavailable("this IAM member just started: it grants no vote for one leader lease"));
        }
        let raft = self.raft.get();
        // A member that holds no log has never applied its cluster's bootstrap. A candidate that
        // names a cluster speaks for one with history: this member may be a wiped one whose
        // record the candidate lacks, and its vote could elect a leader without committed
        // entries. It votes once a leader has given it the log.
        if Claims::of(req.metadata()).cluster.is_some() && raft.metrics().borrow_watched().last_log_index.is_none() {
            return Err(Status::failed_precondition(format!(
                "IAM member {} holds no log yet: it grants no vote in a bootstrapped cluster until a leader has sent it \
                 the log",
                self.who.id
            )));
        }
        if pre { self.reply(&raft.pre_vote(rpc).await) } else { self.reply(&raft.vote(rpc).await) }
    }

    async fn transfer_leader(&self, req: Request<pb::RaftMessage>) -> Result<Response<pb::RaftMessage>, Status> {
        let from = self.sender(&req)?;
        let rpc: TransferLeaderRequest<C> = decode(req.get_ref())?;
        must_be(from, rpc.from_leader().leader_id().node_id, "leadership hand-over")?;
        let r = self.raft.get().handle_transfer_leader(rpc).await.map_err(RaftError::<C>::Fatal);
        self.reply(&r)
    }

    async fn install_snapshot(
        &self,
        req: Request<Streaming<pb::RaftMessage>>,
    ) -> Result<Response<pb::RaftMessage>, Status> {
        let from = self.sender(&req)?;
        let mut stream = req.into_inner();
        let head = stream.message().await?.ok_or_else(|| Status::invalid_argument("an empty snapshot stream"))?;
        let (vote, meta): (VoteOf<C>, SnapshotMetaOf<C>) = decode(&head)?;
        must_be(from, vote.leader_id().node_id, "snapshot")?;
        // A leader this member has already seen superseded gets no memory for its snapshot.
        if vote < self.raft.get().metrics().borrow_watched().vote {
            return Err(Status::failed_precondition("a snapshot from a superseded leader"));
        }
        let _one = self.installing.acquire().await.map_err(|_| Status::unavailable("shutting down"))?;
        let mut data = Vec::new();
        while let Some(m) = stream.message().await? {
            if data.len() + m.data.len() > MAX_SNAPSHOT_BYTES {
                return Err(Status::resource_exhausted(format!("a snapshot above {MAX_SNAPSHOT_BYTES} bytes")));
            }
            data.extend_from_slice(&m.data);
        }
        let snap = SnapshotOf::<C, Vec<u8>> { meta, snapshot: data };
        let r = self.raft.get().install_full_snapshot(vote, snap).await.map_err(RaftError::<C>::Fatal);
        self.reply(&r)
    }
}

impl std::fmt::Debug for Who {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Who").field("data_dir", &self.data_dir).finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Network {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Network").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Conn").finish_non_exhaustive()
    }
}

impl std::fmt::Debug for RaftService {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RaftService").finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::{Claims, check_claims};

    /// Another cluster's member, a sender on another directory than its recorded one, and a
    /// message that names another directory as this member's are refused; what either side
    /// does not know yet is not held against it.
    #[test]
    fn claims_about_clusters_and_data_directories_are_checked() {
        // Ids as members make them: 32 hex digits.
        let id = |c: char| c.to_string().repeat(32);
        let (c1, c9, d0, d1, d2, d3, dx) = (id('c'), id('9'), id('0'), id('1'), id('2'), id('3'), id('e'));
        let records = BTreeMap::from([(2, d2.clone())]);
        let ok = |from, cluster: &str, c: &Claims| check_claims(from, 1, &d1, cluster, &records, c);
        let s = |v: &String| Some(v.clone());
        let claims = |cluster: Option<String>, from_dir: Option<String>, to_dir: Option<String>| Claims {
            cluster,
            from_dir,
            to_dir,
        };
        assert!(ok(2, &c1, &claims(None, None, None)).is_ok());
        assert!(ok(2, &c1, &claims(s(&c1), s(&d2), s(&d1))).is_ok());
        // Unrecorded sender, a receiver that knows no cluster yet (blank, being added).
        assert!(ok(3, &c1, &claims(s(&c1), s(&d3), None)).is_ok());
        assert!(ok(2, "", &claims(s(&c9), s(&d2), None)).is_ok());

        let e = ok(2, &c1, &claims(s(&c9), s(&d2), s(&d1))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains(&format!("cluster {c9}")), "{e:?}");
        let e = ok(2, &c1, &claims(s(&c1), s(&d2), s(&d0))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
        assert!(e.message().contains("IAM member 1 refuses member 2") && e.message().contains("wiped"), "{e:?}");
        let e = ok(2, &c1, &claims(s(&c1), s(&dx), s(&d1))).unwrap_err();
        assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
        assert!(e.message().contains(&format!("member 2 runs on data directory {dx}")), "{e:?}");
        // Anything but 32 hex digits is refused, and not repeated back.
        for bad in ["c1", "zz", &"a".repeat(33), &format!("{c1}\n")] {
            let e = ok(2, &c1, &claims(Some(bad.to_string()), None, None)).unwrap_err();
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad:?}: {e:?}");
            assert!(!e.message().contains(bad), "{e:?}");
        }
    }
}
