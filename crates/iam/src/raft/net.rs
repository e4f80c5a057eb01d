//! Raft messages between members over gRPC (`IamRaft`, mTLS with `iam` certificates on both
//! sides): each request and reply is an openraft value in JSON. A snapshot travels as a
//! stream: its meta and the leader's vote first, then its data in chunks.

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

/// Bytes of snapshot data per message.
const CHUNK: usize = 1 << 20;
/// The largest snapshot a member takes (IAM's whole state; twice the largest backup).
pub const MAX_SNAPSHOT_BYTES: usize = 2 << 30;

/// Makes connections to the other members.
#[derive(Clone)]
pub struct Network {
    pub from: u64,
    pub links: Arc<Links>,
}

impl RaftNetworkFactory<C> for Network {
    type Network = Conn;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> Conn {
        Conn { from: self.from, target, addr: node.addr.clone(), links: self.links.clone() }
    }
}

pub struct Conn {
    from: u64,
    target: u64,
    addr: String,
    links: Arc<Links>,
}

fn unreachable<E: std::fmt::Display>(e: E) -> RPCError<C> {
    RPCError::Unreachable(Unreachable::from_string(e.to_string()))
}

fn network<E: std::fmt::Display>(e: E) -> RPCError<C> {
    RPCError::Network(NetworkError::from_string(e.to_string()))
}

impl Conn {
    fn client(&self) -> Result<IamRaftClient<Channel>, RPCError<C>> {
        let ch = self.links.channel(&self.addr, Role::Iam, None).map_err(|e| unreachable(e.message))?;
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
        F: FnOnce(IamRaftClient<Channel>, pb::RaftMessage) -> Fut,
        Fut: Future<Output = Result<Response<pb::RaftMessage>, Status>>,
    {
        let data = serde_json::to_vec(req).map_err(network)?;
        let client = self.client()?;
        let reply = match tokio::time::timeout(option.soft_ttl(), call(client, pb::RaftMessage { data })).await {
            Err(_) => return Err(self.timeout(action, option)),
            Ok(Err(st)) if st.code() == tonic::Code::Unavailable => return Err(unreachable(st.message())),
            Ok(Err(st)) => return Err(network(st.message())),
            Ok(Ok(r)) => r.into_inner(),
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
        let send = async move {
            let reply = client.install_snapshot(messages).await;
            match reply {
                Err(st) => Err(unreachable(st.message())),
                Ok(r) => {
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
    /// A member whose Raft just started (the process, or a restart after a storage failure)
    /// has forgotten how recently it heard a leader: it grants no vote until a leader's lease
    /// would have run out, so that no leader is elected while the last one may still serve
    /// lease reads.
    lease: std::time::Duration,
    /// One snapshot install at a time (each is held whole in memory).
    installing: tokio::sync::Semaphore,
}

impl RaftService {
    pub fn new(raft: super::Current, lease: std::time::Duration) -> RaftService {
        RaftService { raft, lease, installing: tokio::sync::Semaphore::new(1) }
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
        reply(&self.raft.get().append_entries(rpc).await)
    }

    async fn vote(&self, req: Request<pb::RaftMessage>) -> Result<Response<pb::RaftMessage>, Status> {
        let from = self.sender(&req)?;
        let (pre, rpc): (bool, VoteRequest<C>) = decode(req.get_ref())?;
        must_be(from, rpc.vote.leader_id().node_id, "vote request")?;
        if tokio::time::Instant::now() < self.raft.started() + self.lease {
            return Err(Status::unavailable("this IAM member just started: it grants no vote for one leader lease"));
        }
        let raft = self.raft.get();
        if pre { reply(&raft.pre_vote(rpc).await) } else { reply(&raft.vote(rpc).await) }
    }

    async fn transfer_leader(&self, req: Request<pb::RaftMessage>) -> Result<Response<pb::RaftMessage>, Status> {
        let from = self.sender(&req)?;
        let rpc: TransferLeaderRequest<C> = decode(req.get_ref())?;
        must_be(from, rpc.from_leader().leader_id().node_id, "leadership hand-over")?;
        let r = self.raft.get().handle_transfer_leader(rpc).await.map_err(RaftError::<C>::Fatal);
        reply(&r)
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
        reply(&r)
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
