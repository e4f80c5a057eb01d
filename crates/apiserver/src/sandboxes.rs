//! The public `Sandboxes` service: translation between gRPC and the creation path, and the
//! forwarding of every later call to the edge named in the sandbox id.
//!
//! Every call authenticates the bearer token first. Calls on an existing sandbox get it from its
//! edge, then authorize on the sandbox's own project (`sandbox.view` to read, `sandbox.operate`
//! to change it), so a caller learns nothing about another project's sandbox but that it
//! exists. Each call runs in its own task and ends with exactly one audit line, even when the
//! client goes away mid-call.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use opendsec_common::{ApiError, ids};
use opendsec_proto::v1 as pb;
use opendsec_proto::v1::sandboxes_server::Sandboxes;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataMap;
use tonic::{Request, Response, Status};

use crate::admission;
use crate::auth::Identity;
use crate::call::{PERM_OPERATE, PERM_VIEW, caller, run};
use crate::create::{self, BatchItem};
use crate::forward;
use crate::images;
use crate::moves;
use crate::pools;
use crate::state::{Call, Routes, Shared, Snapshot};

pub struct SandboxesService {
    shared: Arc<Shared>,
}

impl SandboxesService {
    pub fn new(shared: Arc<Shared>) -> Self {
        SandboxesService { shared }
    }
}

async fn create_sandbox(
    s: &Shared,
    call: &mut Call,
    md: MetadataMap,
    req: pb::CreateSandboxRequest,
) -> Result<pb::Sandbox, ApiError> {
    let (token, ident) = caller(s, call, &md).await?;
    let pooled = pools::resolve(s, &ident, req.spec.as_ref()).await?;
    let given = pooled.as_ref().map(|p| &p.spec).or(req.spec.as_ref());
    let mut spec = admission::check_spec(given, &ident.project, &s.cfg)?;
    admission::check_network(&mut spec, &s.default_egress)?;
    call.project = Some(spec.project.clone());
    let lease = admission::check_lease_id(&req.lease_id)?.map(|key| admission::scoped_lease_id(&spec.project, &key));
    images::check_image(s, &ident.principal, &spec).await?;
    let revision = pooled.map(|p| p.revision).unwrap_or_default();
    let sb = create::create_single(s, &token, &ident, &spec, &revision, lease).await?;
    call.sandbox_id = Some(sb.id.clone());
    Ok(sb)
}

/// The project of a sandbox the edge answered with (`authorized_get` refuses one without).
fn project_of(sb: &pb::Sandbox) -> String {
    sb.spec.as_ref().map(|sp| sp.project.clone()).unwrap_or_default()
}

/// Edge call `f` for sandbox `id` once the caller holds `permission` on its project; the
/// request names that project to the edge ([`forward::to_edge`]).
async fn authorized_forward<Q, T, F, Fut>(
    s: &Shared,
    call: &mut Call,
    md: &MetadataMap,
    id: &str,
    permission: &str,
    req: Q,
    f: F,
) -> Result<T, ApiError>
where
    Q: Clone,
    F: Fn(pb::edge_client::EdgeClient<tonic::transport::Channel>, Request<Q>) -> Fut,
    Fut: std::future::Future<Output = Result<Response<T>, Status>>,
{
    let (_, sb) = authorized_get(s, call, md, id, permission).await?;
    let project = project_of(&sb);
    // A move that began since the get: the call waits for it and goes to the copy.
    let f = &f;
    let answered = moves::follow(s, id, |edge| {
        let req = forward::to_edge(req.clone(), &project);
        async move { forward::edge_forward(s, &edge, |c| async move { f(c, req?).await }).await }
    })
    .await?;
    Ok(answered.1)
}

/// Gets a sandbox from its edge and checks that the caller holds `permission` on its project.
async fn authorized_get(
    s: &Shared,
    call: &mut Call,
    md: &MetadataMap,
    id: &str,
    permission: &str,
) -> Result<(String, pb::Sandbox), ApiError> {
    let (_, ident) = caller(s, call, md).await?;
    ids::split_sandbox_id(id)?;
    call.sandbox_id = Some(id.to_string());
    ident.may_reach(id)?;
    let (edge, sb) = moves::follow(s, id, |edge| async move { forward::edge_get(s, &edge, id).await }).await?;
    let project = sb.spec.as_ref().map(|sp| sp.project.clone()).unwrap_or_default();
    if project.is_empty() {
        return Err(ApiError::denied(format!("sandbox {id} has no project")));
    }
    call.project = Some(project.clone());
    s.authorize(&ident.principal, permission, &project).await?;
    Ok((edge, sb))
}

/// How long an edge may take to snapshot a sandbox (its disk is copied: bounded by its size).
const SNAPSHOT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// A snapshot: the sandbox's edge stores the layer, the image is registered here, in the
/// sandbox's project, under a name not taken yet (checked before the sandbox is frozen, and
/// again when the manifest is written).
async fn create_snapshot(
    s: &Shared,
    call: &mut Call,
    md: MetadataMap,
    req: pb::CreateSnapshotRequest,
) -> Result<pb::Snapshot, ApiError> {
    let (edge, sb) = authorized_get(s, call, &md, &req.id, PERM_OPERATE).await?;
    let (_, ident) = caller(s, call, &md).await?;
    take_snapshot(s, &ident, &edge, &sb, &req.name, req.pack_diff).await
}

/// Checks `layer.publish` and the name, has the edge take the snapshot and registers its image.
async fn take_snapshot(
    s: &Shared,
    ident: &Identity,
    edge: &str,
    sb: &pb::Sandbox,
    name: &str,
    pack_diff: bool,
) -> Result<pb::Snapshot, ApiError> {
    let project = project_of(sb);
    s.authorize(&ident.principal, images::PERM_PUBLISH, &project).await?;
    // The snapshot's image carries the source image's layers: the caller must be allowed to
    // use that image, as a creation from it would need (publishing is not enough).
    images::check_image(s, &ident.principal, sb.spec.as_ref().unwrap_or(&pb::SandboxSpec::default())).await?;
    let target = images::snapshot_target(s, &project, name).await?;
    // The store quota before the sandbox is frozen and its disk copied: what its disk holds
    // now must fit (a refused snapshot would otherwise still write a layer, left for GC).
    let mreq = forward::to_edge(pb::GetSandboxMetricsRequest { id: sb.id.clone() }, &project)?;
    let disk = forward::edge_forward(s, edge, |mut c| async move { c.get_sandbox_metrics(mreq).await })
        .await
        .map_or(0, |m| m.disk_used_bytes);
    let room = pb::StoreRoomRequest { project: project.clone(), bytes: disk };
    s.up.iam(|mut c| {
        let r = room.clone();
        async move { c.store_room(r).await }
    })
    .await?;
    let ereq = forward::to_edge(pb::EdgeSnapshotRequest { id: sb.id.clone(), pack_diff }, &project)?;
    let mut c = s.up.edge(edge, &s.edge_addr(edge)?)?;
    let taken = forward::within(edge, Some(SNAPSHOT_TIMEOUT), async move { c.create_snapshot(ereq).await }).await?;
    let image = sb.spec.as_ref().map(|sp| sp.image.clone()).unwrap_or_default();
    let published = images::publish_snapshot(s, target, &image, &taken.layers, &sb.id, &taken.vm_snapshot).await?;
    Ok(pb::Snapshot {
        image: Some(published),
        sandbox_id: sb.id.clone(),
        layer: taken.layer,
        layer_bytes: taken.layer_bytes,
        layer_entries: taken.layer_entries,
        frozen_ms: taken.frozen_ms,
        vm_snapshot: taken.vm_snapshot,
        vm_snapshot_bytes: taken.vm_snapshot_bytes,
    })
}

/// Most copies one ForkSandbox makes.
pub const MAX_FORK: u32 = 256;

/// A fork: one snapshot, then a batch of creations from it with the source's spec, preferring
/// the source's edge. Returns what the batch needs.
async fn prepare_fork(
    s: &Shared,
    call: &mut Call,
    md: &MetadataMap,
    req: &pb::ForkSandboxRequest,
) -> Result<(String, Arc<Identity>, pb::SandboxSpec, String), ApiError> {
    if req.count == 0 || req.count > MAX_FORK {
        return Err(
            ApiError::invalid(format!("count must be 1..={MAX_FORK}, got {}", req.count)).with("field", "count")
        );
    }
    let (edge, sb) = authorized_get(s, call, md, &req.id, PERM_OPERATE).await?;
    let (token, ident) = caller(s, call, md).await?;
    // What the copies need is checked before the sandbox is frozen and copied: creating in
    // its project, and the source's spec as a creation (the image changes, nothing else).
    let project = project_of(&sb);
    s.authorize(&ident.principal, crate::call::PERM_CREATE, &project).await?;
    let mut spec = admission::check_spec(sb.spec.as_ref(), &ident.project, &s.cfg)?;
    admission::check_network(&mut spec, &s.default_egress)?;
    let name = if req.snapshot_name.is_empty() {
        let lease = ids::split_sandbox_id(&req.id)?.1.to_string();
        format!("forks/{lease}:{}", opendsec_common::time::now_ms())
    } else {
        req.snapshot_name.clone()
    };
    let snap = take_snapshot(s, &ident, &edge, &sb, &name, req.pack_diff).await?;
    let image = snap.image.as_ref().map(|i| format!("{}:{}", i.repo, i.tag)).unwrap_or_default();
    // The snapshot's image is in the source's project, which the caller may use (checked
    // by the snapshot).
    spec.image = image;
    Ok((token, ident, spec, edge))
}

/// A move to another edge: the caller may see the sandbox and manages edges (`edge.manage`
/// on root); asked again once done, it answers the sandbox where it is.
async fn move_sandbox(
    s: &Shared,
    call: &mut Call,
    md: MetadataMap,
    req: pb::MoveSandboxRequest,
) -> Result<pb::Sandbox, ApiError> {
    ids::validate_edge(&req.to_edge)
        .map_err(|e| ApiError::invalid(format!("to_edge: {}", e.message)).with("field", "to_edge"))?;
    let (token, ident) = caller(s, call, &md).await?;
    // The operator's permission first: a tenant learns nothing about the sandbox or the edges.
    s.authorize(&ident.principal, moves::PERM_EDGE_MANAGE, ids::ROOT_PROJECT).await?;
    let (edge, sb) = authorized_get(s, call, &md, &req.id, PERM_OPERATE).await?;
    if edge == req.to_edge {
        return Ok(sb);
    }
    moves::move_sandbox(s, &token, &edge, &sb, &req.to_edge).await
}

/// Drains an edge or ends its drain: the operator's (`edge.manage` on root). The edge keeps
/// the mark; placements skip it from the next snapshot on, and it refuses creations meanwhile.
async fn drain_edge(
    s: &Shared,
    call: &mut Call,
    md: MetadataMap,
    req: pb::DrainEdgeRequest,
) -> Result<pb::DrainEdgeResponse, ApiError> {
    ids::validate_edge(&req.edge)
        .map_err(|e| ApiError::invalid(format!("edge: {}", e.message)).with("field", "edge"))?;
    let (_, ident) = caller(s, call, &md).await?;
    s.authorize(&ident.principal, moves::PERM_EDGE_MANAGE, ids::ROOT_PROJECT).await?;
    let addr = match s.snapshot().addrs.get(&req.edge) {
        Some((addr, _)) => addr.clone(),
        None => return Err(ApiError::not_found(format!("edge {} is not known", req.edge)).with("edge", &req.edge)),
    };
    let mut c = s.up.edge(&req.edge, &addr)?;
    let st = forward::edge_call(
        s,
        &req.edge,
        c.set_draining(pb::SetDrainingRequest { draining: !req.undrain, query: req.query }),
    )
    .await?;
    Ok(pb::DrainEdgeResponse { edge: req.edge, draining: st.draining, sandboxes: st.sandboxes })
}

async fn list_sandboxes(
    s: &Shared,
    call: &mut Call,
    md: MetadataMap,
    req: pb::ListSandboxesRequest,
) -> Result<pb::ListSandboxesResponse, ApiError> {
    let (_, ident) = caller(s, call, &md).await?;
    let page_size = admission::check_list(&req)?;
    let project = if req.project.is_empty() { ident.project.clone() } else { req.project.clone() };
    ids::validate_project(&project)?;
    call.project = Some(project.clone());
    s.authorize(&ident.principal, PERM_VIEW, &project).await?;

    let snap = s.snapshot();
    let edge_req = pb::EdgeListRequest {
        project: project.clone(),
        states: req.states.clone(),
        labels: req.labels.clone(),
        after: req.page_token.clone(),
        limit: page_size + 1,
    };
    let after = req.page_token.as_str();
    let plan = ListPlan::new(&snap, &s.routes, after);
    let limit = page_size as usize + 1;
    let size = page_size as usize;
    let mut merged = BTreeMap::new();
    // The smallest last id among edges that hold more than they sent: beyond it the merged
    // order has holes, so the page ends there at the latest.
    let mut cutoff: Option<String> = None;
    let (mut next, mut wave) = (0, FIRST_WAVE);
    let mut ask: Vec<&str> = plan.movers.iter().map(String::as_str).collect();
    // Sandboxes an edge said moved away (id, where to) and the page does not hold yet: the
    // edge they went to is asked (again) in a round of its own, since the snapshot may not
    // know of the move yet, and that edge may have answered before the copy there was listed.
    let mut told: BTreeSet<(String, String)> = BTreeSet::new();
    let (mut chases, mut chasing) = (0, false);
    // Ids below this are complete: at or past the first run not asked yet, that run's own
    // sandboxes may be missing (ids moved elsewhere, there, are kept for when it is asked).
    let complete = |next: usize, cutoff: &Option<String>, id: &str| {
        plan.runs.get(next).is_none_or(|(bound, _)| id < bound.as_str()) && cutoff.as_deref().is_none_or(|c| id <= c)
    };
    loop {
        // A round that chases moved-away sandboxes asks only where they went.
        if !chasing {
            chases = 0;
            let upto = (next + wave).min(plan.runs.len());
            ask.extend(plan.runs[next..upto].iter().map(|(_, n)| *n));
            next = upto;
            wave = (wave * 2).min(MAX_WAVE);
        }
        ask.sort_unstable();
        ask.dedup();
        let calls = ask.drain(..).map(|name| {
            let r = edge_req.clone();
            async move { forward::edge_forward(s, name, |mut c| async move { c.list_sandboxes(r).await }).await }
        });
        let mut moved = Vec::new();
        for res in futures::future::join_all(calls).await {
            // A partial list could make a caller act on sandboxes it believes gone: fail instead.
            let mut page = res?;
            // What is not after the token was not asked for (an edge answering wrong must not
            // move the listing backwards).
            page.sandboxes.retain(|sb| sb.id.as_str() > after);
            let mut cut = None;
            if (page.more || page.sandboxes.len() >= limit)
                && let Some(last) = page.sandboxes.last()
            {
                cut = Some(last.id.clone());
            }
            // An edge that met more moved-away sandboxes than it tells says where it stopped.
            if page.moved_away_upto.as_str() > after && cut.as_ref().is_none_or(|c| page.moved_away_upto < *c) {
                cut = Some(std::mem::take(&mut page.moved_away_upto));
            }
            if let Some(c) = cut
                && cutoff.as_ref().is_none_or(|old| c < *old)
            {
                cutoff = Some(c);
            }
            for sb in page.sandboxes {
                merged.insert(sb.id.clone(), sb);
            }
            moved.extend(page.moved_away.into_iter().filter(|m| m.id.as_str() > after));
        }
        for m in moved {
            if merged.contains_key(&m.id) || cutoff.as_ref().is_some_and(|c| m.id > *c) {
                continue;
            }
            // Gone to an edge the snapshot does not show healthy: not listed, as that edge's
            // own sandboxes are not.
            let Some((to, _)) = snap.addrs.get_key_value(&m.to).filter(|(_, (_, healthy))| *healthy) else {
                continue;
            };
            if !told.insert((m.id.clone(), m.to)) {
                continue;
            }
            if chases == MAX_CHASES {
                return Err(ApiError::unavailable(format!(
                    "sandbox {} moved again and again while this page was listed; ask for the page again",
                    m.id
                )));
            }
            ask.push(to.as_str());
        }
        chasing = !ask.is_empty();
        chases += usize::from(chasing);
        if chasing {
            continue;
        }
        let Some((bound, _)) = plan.runs.get(next) else { break };
        // Full, or cut before the runs not asked yet (asking them cannot add below the cut).
        if merged.keys().filter(|id| complete(next, &cutoff, id)).take(size).count() >= size
            || cutoff.as_deref().is_some_and(|c| c < bound.as_str())
        {
            break;
        }
    }
    merged.retain(|id, _| complete(next, &cutoff, id));
    // More may follow where the page was cut: at an edge that had more, or at runs not asked.
    let more = merged.len() > size || cutoff.is_some() || next < plan.runs.len();
    let sandboxes: Vec<pb::Sandbox> = merged.into_values().take(size).collect();
    // A full page goes on after its last sandbox; a short one after its cut, below which
    // everything was given (a page cut where an edge stopped telling moved-away sandboxes may
    // hold none of its own).
    let next_page_token = match (more, sandboxes.len() == size, &cutoff) {
        (false, _, _) => String::new(),
        (true, false, Some(c)) => c.clone(),
        (true, _, _) => sandboxes.last().map(|sb| sb.id.clone()).unwrap_or_default(),
    };
    Ok(pb::ListSandboxesResponse { sandboxes, next_page_token })
}

/// Edges asked at once for a page at first; each further round asks twice as many, up to
/// `MAX_WAVE`.
const FIRST_WAVE: usize = 8;
const MAX_WAVE: usize = 256;
/// Rounds a page spends, after each round of runs, asking the edges that moved-away sandboxes
/// went to; a sandbox still moving after them fails the page (`unavailable`) rather than be
/// skipped.
const MAX_CHASES: usize = 4;

/// Which edges a page of ids after `after` needs, in the order it needs them. Edge names hold
/// no dot and an edge gives out ids `<edge>.<lease>`, so each edge's own ids are one run of the
/// id order, the runs ordered by `<edge>.`: a page walks the runs from the one `after` falls in
/// and stops once it is full, instead of asking every edge for a page of its own. Sandboxes
/// that moved keep their ids and live on another edge: the edges holding any with an id after
/// `after` (the snapshot says which, and the routes this apiserver learned, as routing uses)
/// are asked in the first round too (and again when their own run comes).
struct ListPlan<'a> {
    /// (`<edge>.`, edge) of the healthy edges whose runs may hold ids after `after`, in order.
    runs: Vec<(String, &'a str)>,
    movers: BTreeSet<String>,
}

impl<'a> ListPlan<'a> {
    fn new(snap: &'a Snapshot, routes: &Routes, after: &str) -> ListPlan<'a> {
        let mut runs: Vec<(String, &str)> = snap
            .addrs
            .iter()
            .filter(|(_, (_, healthy))| *healthy)
            .map(|(name, _)| (format!("{name}."), name.as_str()))
            // A run wholly before `after` holds nothing after it: its key sorts below `after`
            // and is not the start of it.
            .filter(|(key, _)| key.as_str() > after || after.starts_with(key.as_str()))
            .collect();
        runs.sort_unstable();
        let healthy = |edge: &String| snap.addrs.get(edge).is_some_and(|(_, healthy)| *healthy);
        let mut movers: BTreeSet<String> = snap
            .moved
            .iter()
            .filter(|(id, edge)| id.as_str() > after && healthy(edge))
            .map(|(_, edge)| edge.clone())
            .collect();
        movers.extend(routes.holders_after(after).into_iter().filter(healthy));
        ListPlan { runs, movers }
    }
}

#[tonic::async_trait]
impl Sandboxes for SandboxesService {
    async fn create_sandbox(
        &self,
        request: Request<pb::CreateSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (md, _, req) = request.into_parts();
        run(&self.shared, "CreateSandbox", move |s, call| Box::pin(create_sandbox(s, call, md, req))).await
    }

    type CreateSandboxesStream = ReceiverStream<BatchItem>;

    async fn create_sandboxes(
        &self,
        request: Request<pb::CreateSandboxesRequest>,
    ) -> Result<Response<Self::CreateSandboxesStream>, Status> {
        let (md, _, req) = request.into_parts();
        let s = &self.shared;
        let mut call = Call::new("CreateSandboxes");
        let prepared = async {
            // The count first: an oversized batch is refused before anything else happens.
            admission::check_batch_count(req.count)?;
            let (token, ident) = caller(s, &mut call, &md).await?;
            let pooled = pools::resolve(s, &ident, req.spec.as_ref()).await?;
            let given = pooled.as_ref().map(|p| &p.spec).or(req.spec.as_ref());
            let mut spec = admission::check_spec(given, &ident.project, &s.cfg)?;
            admission::check_network(&mut spec, &s.default_egress)?;
            let revision = pooled.map(|p| p.revision).unwrap_or_default();
            // Patches change env and labels only: the project, image and backend stay shared.
            let patched = admission::patched_specs(&spec, &req.patches, req.count, &s.cfg)?;
            // Once for the whole batch: every item has the same image and principal.
            images::check_image(s, &ident.principal, &spec).await?;
            Ok::<_, ApiError>((token, ident, spec, patched, revision))
        }
        .await;
        match prepared {
            Ok((token, ident, spec, patched, pool_revision)) => {
                call.project = Some(spec.project.clone());
                let batch = create::Batch { spec, patched, count: req.count, prefer: None, pool_revision };
                let rx = create::start_batch(s.clone(), token, ident, batch, call);
                Ok(Response::new(ReceiverStream::new(rx)))
            }
            Err(e) => {
                call.count = Some(req.count);
                s.finish(call, Err(&e)).await;
                Err(e.to_status())
            }
        }
    }

    type ForkSandboxStream = ReceiverStream<BatchItem>;

    async fn fork_sandbox(
        &self,
        request: Request<pb::ForkSandboxRequest>,
    ) -> Result<Response<Self::ForkSandboxStream>, Status> {
        let (md, _, req) = request.into_parts();
        let s = &self.shared;
        let mut call = Call::new("ForkSandbox");
        match prepare_fork(s, &mut call, &md, &req).await {
            Ok((token, ident, spec, edge)) => {
                call.project = Some(spec.project.clone());
                let batch = create::Batch {
                    spec,
                    patched: Vec::new(),
                    count: req.count,
                    prefer: Some(edge),
                    pool_revision: String::new(),
                };
                let rx = create::start_batch(s.clone(), token, ident, batch, call);
                Ok(Response::new(ReceiverStream::new(rx)))
            }
            Err(e) => {
                call.count = Some(req.count);
                s.finish(call, Err(&e)).await;
                Err(e.to_status())
            }
        }
    }

    async fn drain_edge(
        &self,
        request: Request<pb::DrainEdgeRequest>,
    ) -> Result<Response<pb::DrainEdgeResponse>, Status> {
        let (md, _, req) = request.into_parts();
        run(&self.shared, "DrainEdge", move |s, call| Box::pin(drain_edge(s, call, md, req))).await
    }

    async fn move_sandbox(&self, request: Request<pb::MoveSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let (md, _, req) = request.into_parts();
        run(&self.shared, "MoveSandbox", move |s, call| Box::pin(move_sandbox(s, call, md, req))).await
    }

    async fn save_session(
        &self,
        request: Request<pb::SaveSessionRequest>,
    ) -> Result<Response<pb::SessionSaved>, Status> {
        let (md, _, req) = request.into_parts();
        run(&self.shared, "SaveSession", move |s, call| {
            Box::pin(async move {
                let id = req.id.clone();
                authorized_forward(
                    s,
                    call,
                    &md,
                    &id,
                    PERM_OPERATE,
                    req,
                    |mut c, r| async move { c.save_session(r).await },
                )
                .await
            })
        })
        .await
    }

    async fn create_sandbox_tokens(
        &self,
        request: Request<pb::CreateSandboxTokensRequest>,
    ) -> Result<Response<pb::SandboxTokens>, Status> {
        let (md, _, req) = request.into_parts();
        run(&self.shared, "CreateSandboxTokens", move |s, call| {
            Box::pin(async move {
                // The sandbox must be one the caller operates (its project comes from its edge);
                // IAM checks the permission again on the lease and mints for the caller.
                let (_, sb) = authorized_get(s, call, &md, &req.sandbox_id, PERM_OPERATE).await?;
                let (_, lease) = ids::split_sandbox_id(&req.sandbox_id)?;
                let _ = sb;
                let token = opendsec_common::grpc::bearer(&md)?.to_string();
                let req = pb::MintSandboxTokensRequest { token, lease_id: lease.to_string() };
                s.up.iam(|mut c| {
                    let r = req.clone();
                    async move { c.mint_sandbox_tokens(r).await }
                })
                .await
            })
        })
        .await
    }

    async fn get_sandbox(&self, request: Request<pb::GetSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let (md, _, req) = request.into_parts();
        run(&self.shared, "GetSandbox", move |s, call| {
            Box::pin(async move { Ok(authorized_get(s, call, &md, &req.id, PERM_VIEW).await?.1) })
        })
        .await
    }

    async fn get_sandbox_metrics(
        &self,
        request: Request<pb::GetSandboxMetricsRequest>,
    ) -> Result<Response<pb::SandboxMetrics>, Status> {
        let (md, _, req) = request.into_parts();
        run(&self.shared, "GetSandboxMetrics", move |s, call| {
            Box::pin(async move {
                let id = req.id.clone();
                authorized_forward(s, call, &md, &id, PERM_VIEW, req, |mut c, r| async move {
                    c.get_sandbox_metrics(r).await
                })
                .await
            })
        })
        .await
    }

    async fn create_snapshot(
        &self,
        request: Request<pb::CreateSnapshotRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        let (md, _, req) = request.into_parts();
        run(&self.shared, "CreateSnapshot", move |s, call| Box::pin(create_snapshot(s, call, md, req))).await
    }

    async fn list_sandboxes(
        &self,
        request: Request<pb::ListSandboxesRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        let (md, _, req) = request.into_parts();
        run(&self.shared, "ListSandboxes", move |s, call| Box::pin(list_sandboxes(s, call, md, req))).await
    }

    async fn stop_sandbox(&self, request: Request<pb::StopSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let (md, _, req) = request.into_parts();
        run(&self.shared, "StopSandbox", move |s, call| {
            Box::pin(async move {
                let id = req.id.clone();
                authorized_forward(
                    s,
                    call,
                    &md,
                    &id,
                    PERM_OPERATE,
                    req,
                    |mut c, r| async move { c.stop_sandbox(r).await },
                )
                .await
            })
        })
        .await
    }

    async fn pause_sandbox(&self, request: Request<pb::PauseSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let (md, _, req) = request.into_parts();
        run(&self.shared, "PauseSandbox", move |s, call| {
            Box::pin(async move {
                let id = req.id.clone();
                authorized_forward(
                    s,
                    call,
                    &md,
                    &id,
                    PERM_OPERATE,
                    req,
                    |mut c, r| async move { c.pause_sandbox(r).await },
                )
                .await
            })
        })
        .await
    }

    async fn resume_sandbox(
        &self,
        request: Request<pb::ResumeSandboxRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (md, _, req) = request.into_parts();
        run(&self.shared, "ResumeSandbox", move |s, call| {
            Box::pin(async move {
                let id = req.id.clone();
                authorized_forward(
                    s,
                    call,
                    &md,
                    &id,
                    PERM_OPERATE,
                    req,
                    |mut c, r| async move { c.resume_sandbox(r).await },
                )
                .await
            })
        })
        .await
    }

    async fn set_sandbox_timeout(
        &self,
        request: Request<pb::SetSandboxTimeoutRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (md, _, req) = request.into_parts();
        run(&self.shared, "SetSandboxTimeout", move |s, call| {
            Box::pin(async move {
                admission::check_timeout_update(&req, &s.cfg.ttl)?;
                let id = req.id.clone();
                authorized_forward(s, call, &md, &id, PERM_OPERATE, req, |mut c, r| async move {
                    c.set_sandbox_timeout(r).await
                })
                .await
            })
        })
        .await
    }

    async fn update_network(
        &self,
        request: Request<pb::UpdateNetworkRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        let (md, _, req) = request.into_parts();
        run(&self.shared, "UpdateNetwork", move |s, call| {
            Box::pin(async move {
                let network = admission::check_network_update(&req)?;
                let (edge, sb) = authorized_get(s, call, &md, &req.id, PERM_OPERATE).await?;
                // The project's (and its ancestors') ceiling, asked fresh: no cache.
                let check = pb::CheckEgressRequest { project: project_of(&sb), egress: network.egress.clone() };
                s.up.iam(|mut c| {
                    let r = check.clone();
                    async move { c.check_egress(r).await }
                })
                .await?;
                let req = pb::UpdateNetworkRequest { id: req.id, network: Some(network) };
                let req = forward::to_edge(req, &project_of(&sb))?;
                forward::edge_forward(s, &edge, |mut c| async move { c.update_network(req).await }).await
            })
        })
        .await
    }
}
