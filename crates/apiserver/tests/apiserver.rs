//! The apiserver through real gRPC on 127.0.0.1:0, against small fake IAM, watcher and edge
//! servers written here (each served over mTLS behind the role table the real ones use, with
//! certificates of a CA made per test). The public port runs in plain text here (loopback,
//! `insecure_plaintext`); the cluster tests exercise it over TLS.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opendsec_apiserver::{ApiserverOptions, serve};
use opendsec_common::config::{ApiserverConfig, AuditConfig, PlacementConfig};
use opendsec_common::grpc;
use opendsec_common::pki::Role;
use opendsec_common::{ApiError, Reason, ids, time};
use opendsec_images::{ImageConfig, LayerId, Manifest, Store};
use opendsec_proto::v1 as pb;
use opendsec_proto::v1::admin_client::AdminClient;
use opendsec_proto::v1::admin_server::{Admin, AdminServer};
use opendsec_proto::v1::edge_server::{Edge, EdgeServer};
use opendsec_proto::v1::iam_server::{Iam, IamServer};
use opendsec_proto::v1::images_client::ImagesClient;
use opendsec_proto::v1::runtime_client::RuntimeClient;
use opendsec_proto::v1::runtime_server::{Runtime, RuntimeServer};
use opendsec_proto::v1::sandboxes_client::SandboxesClient;
use opendsec_proto::v1::watcher_server::WatcherServer;
use opendsec_testkit::creds;
use opendsec_testkit::{FakeWatcher, put_layer};
use opendsec_testkit::{WAIT, until};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::oneshot;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

const ALICE: &str = "dsk.alice.aaaaaaaaaaaaaaaaaaaa";
const BOB: &str = "dsk.bob.bbbbbbbbbbbbbbbbbbbbbbbb";

// ---------------------------------------------------------------------------------------------
// Fake IAM

#[derive(Default)]
struct IamState {
    /// token -> (principal, project)
    tokens: HashMap<String, (String, String)>,
    /// principal -> its project (kept when a token is revoked)
    principals: HashMap<String, String>,
    epoch: u64,
    /// (lease, edge) in call order
    admits: Vec<(String, String)>,
    released: Vec<String>,
    leases: HashMap<String, pb::Lease>,
    /// Bearer tokens seen by Admin.WhoAmI
    admin_bearers: Vec<String>,
    /// Authenticate calls answered.
    authentications: usize,
    /// Admin calls that reached the fake (any method).
    admin_calls: usize,
    /// How long each admission takes (none: at once).
    admit_delay: Option<std::time::Duration>,
    /// The number of admissions in each AdmitMany call.
    admit_many_sizes: Vec<usize>,
}

#[derive(Clone, Default)]
struct FakeIam(Arc<Mutex<IamState>>);

impl FakeIam {
    fn st(&self) -> std::sync::MutexGuard<'_, IamState> {
        self.0.lock().unwrap()
    }

    fn revoke(&self, token: &str) {
        let mut s = self.st();
        s.tokens.remove(token);
        s.epoch += 1;
    }

    fn auth(&self, token: &str) -> Result<(String, String), Status> {
        self.st()
            .tokens
            .get(token)
            .cloned()
            .ok_or_else(|| ApiError::new(Reason::Unauthenticated, "unknown token").to_status())
    }
}

/// A principal may do anything within its own project.
fn allowed(principal_project: &str, project: &str) -> bool {
    ids::project_within(project, principal_project)
}

#[tonic::async_trait]
impl Iam for FakeIam {
    async fn authenticate(
        &self,
        r: Request<pb::AuthenticateRequest>,
    ) -> Result<Response<pb::AuthenticateResponse>, Status> {
        self.st().authentications += 1;
        let (principal, project) = self.auth(&r.get_ref().token)?;
        Ok(Response::new(pb::AuthenticateResponse {
            principal,
            project,
            token_id: "t".into(),
            expires_at_ms: 0,
            ..Default::default()
        }))
    }

    async fn authorize(&self, r: Request<pb::AuthorizeRequest>) -> Result<Response<pb::AuthorizeResponse>, Status> {
        let r = r.into_inner();
        let s = self.st();
        let own = s.principals.get(&r.principal);
        Ok(Response::new(pb::AuthorizeResponse { allowed: own.is_some_and(|p| allowed(p, &r.project)) }))
    }

    async fn check_egress(
        &self,
        _: Request<pb::CheckEgressRequest>,
    ) -> Result<Response<pb::CheckEgressResponse>, Status> {
        Ok(Response::new(pb::CheckEgressResponse {}))
    }

    async fn admit(&self, r: Request<pb::AdmitRequest>) -> Result<Response<pb::AdmitResponse>, Status> {
        let delay = self.st().admit_delay;
        if let Some(d) = delay {
            tokio::time::sleep(d).await;
        }
        let r = r.into_inner();
        let (principal, project) = self.auth(&r.token)?;
        if !allowed(&project, &r.project) {
            return Err(ApiError::denied("no sandbox.create").to_status());
        }
        let mut s = self.st();
        if r.keep_existing
            && let Some(l) = s.leases.get(&r.lease_id)
        {
            let (edge, bound_at_ms) = (l.edge.clone(), l.bound_at_ms);
            return Ok(Response::new(pb::AdmitResponse {
                principal,
                rebound: false,
                existing: true,
                edge,
                bound_at_ms,
                member_lease: String::new(),
            }));
        }
        s.admits.push((r.lease_id.clone(), r.edge.clone()));
        let rebound = s.leases.contains_key(&r.lease_id);
        let edge = r.edge.clone();
        s.leases.insert(
            r.lease_id.clone(),
            pb::Lease {
                id: r.lease_id,
                project: r.project,
                principal: principal.clone(),
                edge: r.edge,
                resources: r.resources,
                bound_at_ms: opendsec_common::time::now_ms(),
                ..Default::default()
            },
        );
        Ok(Response::new(pb::AdmitResponse {
            principal,
            rebound,
            existing: false,
            edge,
            bound_at_ms: 0,
            member_lease: String::new(),
        }))
    }

    async fn admit_many(&self, r: Request<pb::AdmitManyRequest>) -> Result<Response<pb::AdmitManyResponse>, Status> {
        let items = r.into_inner().items;
        self.st().admit_many_sizes.push(items.len());
        let answers = futures::future::join_all(items.into_iter().map(|i| self.admit(Request::new(i)))).await;
        let mut results = Vec::new();
        for answer in answers {
            results.push(match answer {
                Ok(a) => pb::AdmitResult { admitted: Some(a.into_inner()), error: None },
                Err(st) => pb::AdmitResult { admitted: None, error: Some(ApiError::from_status(&st).to_detail()) },
            });
        }
        Ok(Response::new(pb::AdmitManyResponse { results }))
    }

    async fn release_leases(
        &self,
        r: Request<pb::ReleaseLeasesRequest>,
    ) -> Result<Response<pb::ReleaseLeasesResponse>, Status> {
        let mut s = self.st();
        let mut released = 0;
        for l in r.into_inner().lease_ids {
            released += u32::from(s.leases.remove(&l).is_some());
            s.released.push(l);
        }
        Ok(Response::new(pb::ReleaseLeasesResponse { released }))
    }

    async fn get_lease(&self, r: Request<pb::GetLeaseRequest>) -> Result<Response<pb::GetLeaseResponse>, Status> {
        let lease = self.st().leases.get(&r.get_ref().lease_id).cloned();
        Ok(Response::new(pb::GetLeaseResponse { found: lease.is_some(), lease }))
    }

    async fn get_leases(&self, r: Request<pb::GetLeasesRequest>) -> Result<Response<pb::GetLeasesResponse>, Status> {
        let s = self.st();
        let leases = r.get_ref().lease_ids.iter().filter_map(|id| s.leases.get(id).cloned()).collect();
        Ok(Response::new(pb::GetLeasesResponse { leases }))
    }

    async fn reconcile(&self, _: Request<pb::ReconcileRequest>) -> Result<Response<pb::ReconcileResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn sweep_unbound(
        &self,
        _: Request<pb::SweepUnboundRequest>,
    ) -> Result<Response<pb::SweepUnboundResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn get_epoch(&self, _: Request<pb::GetEpochRequest>) -> Result<Response<pb::GetEpochResponse>, Status> {
        Ok(Response::new(pb::GetEpochResponse { epoch: self.st().epoch, ..Default::default() }))
    }
    async fn mint_sandbox_tokens(
        &self,
        _: Request<pb::MintSandboxTokensRequest>,
    ) -> Result<Response<pb::SandboxTokens>, Status> {
        Err(Status::unimplemented("not in the fake"))
    }
    async fn charge_image(
        &self,
        _: Request<pb::ChargeImageRequest>,
    ) -> Result<Response<pb::ChargeImageResponse>, Status> {
        Ok(Response::new(pb::ChargeImageResponse {}))
    }
    async fn uncharge_image(
        &self,
        _: Request<pb::UnchargeImageRequest>,
    ) -> Result<Response<pb::ChargeImageResponse>, Status> {
        Ok(Response::new(pb::ChargeImageResponse {}))
    }
    async fn store_room(&self, _: Request<pb::StoreRoomRequest>) -> Result<Response<pb::ChargeImageResponse>, Status> {
        Ok(Response::new(pb::ChargeImageResponse {}))
    }
    async fn admit_member(
        &self,
        _: Request<pb::AdmitMemberRequest>,
    ) -> Result<Response<pb::ChargeImageResponse>, Status> {
        Ok(Response::new(pb::ChargeImageResponse {}))
    }

    async fn acquire_lock(
        &self,
        _: Request<pb::AcquireLockRequest>,
    ) -> Result<Response<pb::AcquireLockResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn resolve_pool(&self, _: Request<pb::ResolvePoolRequest>) -> Result<Response<pb::Pool>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn list_all_pools(
        &self,
        _: Request<pb::ListAllPoolsRequest>,
    ) -> Result<Response<pb::ListPoolsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

async fn fake_who_am_i(iam: &FakeIam, r: Request<pb::WhoAmIRequest>) -> Result<Response<pb::WhoAmIResponse>, Status> {
    iam.st().admin_calls += 1;
    let token = grpc::bearer(r.metadata()).map_err(|e| e.to_status())?.to_string();
    iam.st().admin_bearers.push(token.clone());
    let (principal, project) = iam.auth(&token)?;
    Ok(Response::new(pb::WhoAmIResponse { principal, project, ..Default::default() }))
}

/// The fake Admin: WhoAmI answers, everything else is `not_found` (async_trait must see every
/// method, so the macro writes the whole impl).
macro_rules! fake_admin {
    ($($name:ident($req:ty) -> $resp:ty;)*) => {
        #[tonic::async_trait]
        impl Admin for FakeIam {
            async fn who_am_i(&self, r: Request<pb::WhoAmIRequest>) -> Result<Response<pb::WhoAmIResponse>, Status> {
                fake_who_am_i(self, r).await
            }
            $(
                async fn $name(&self, _: Request<$req>) -> Result<Response<$resp>, Status> {
                    self.st().admin_calls += 1;
                    Err(ApiError::new(Reason::NotFound, "fake admin does not know this").to_status())
                }
            )*
        }
    };
}

fake_admin! {
    create_project(pb::CreateProjectRequest) -> pb::Project;
    get_project(pb::GetProjectRequest) -> pb::Project;
    list_projects(pb::ListProjectsRequest) -> pb::ListProjectsResponse;
    delete_project(pb::DeleteProjectRequest) -> pb::DeleteProjectResponse;
    set_quota(pb::SetQuotaRequest) -> pb::Project;
    set_egress_ceiling(pb::SetEgressCeilingRequest) -> pb::Project;
    create_principal(pb::CreatePrincipalRequest) -> pb::Principal;
    list_principals(pb::ListPrincipalsRequest) -> pb::ListPrincipalsResponse;
    delete_principal(pb::DeletePrincipalRequest) -> pb::DeletePrincipalResponse;
    create_token(pb::CreateTokenRequest) -> pb::CreateTokenResponse;
    list_tokens(pb::ListTokensRequest) -> pb::ListTokensResponse;
    revoke_token(pb::RevokeTokenRequest) -> pb::RevokeTokenResponse;
    grant(pb::GrantRequest) -> pb::GrantResponse;
    revoke_grant(pb::RevokeGrantRequest) -> pb::RevokeGrantResponse;
    list_grants(pb::ListGrantsRequest) -> pb::ListGrantsResponse;
    get_usage(pb::GetUsageRequest) -> pb::GetUsageResponse;
    backup(pb::BackupRequest) -> pb::BackupResponse;
    restore(pb::RestoreRequest) -> pb::RestoreResponse;
    iam_members(pb::IamMembersRequest) -> pb::IamMembersResponse;
    add_iam_member(pb::AddIamMemberRequest) -> pb::IamMembersResponse;
    remove_iam_member(pb::RemoveIamMemberRequest) -> pb::IamMembersResponse;
    transfer_iam_leader(pb::TransferIamLeaderRequest) -> pb::IamMembersResponse;
    create_pool(pb::CreatePoolRequest) -> pb::Pool;
    update_pool(pb::UpdatePoolRequest) -> pb::Pool;
    delete_pool(pb::DeletePoolRequest) -> pb::DeletePoolResponse;
    get_pool(pb::GetPoolRequest) -> pb::Pool;
    list_pools(pb::ListPoolsRequest) -> pb::ListPoolsResponse;
}

// ---------------------------------------------------------------------------------------------
// Fake edge

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Accept,
    NoCapacity,
    Unavailable,
    /// Accepts, but a CreateMany call breaks off after its first answer.
    BreakMany,
}

struct EdgeState {
    mode: Mode,
    sandboxes: BTreeMap<String, pb::Sandbox>,
    creates: usize,
    /// CreateMany calls, and the creations they carried.
    many: Vec<usize>,
    /// ListSandboxes calls.
    lists: usize,
    /// GetSandbox calls (the apiserver caches a sandbox's project for runtime calls).
    gets: usize,
    /// Runtime calls as (method, sandbox id).
    runtime_calls: Vec<(&'static str, String)>,
    /// Uploads completed: (path, data).
    files: Vec<(String, Vec<u8>)>,
    /// How long each creation takes.
    create_delay: Duration,
    /// Uploads whose stream broke before its end.
    aborted_uploads: usize,
    /// Messages of the upload in progress.
    upload_messages: usize,
    /// Sandboxes that moved away: id → the edge they went to (told by ListSandboxes).
    moved_away: BTreeMap<String, String>,
}

#[derive(Clone)]
struct FakeEdge {
    name: String,
    st: Arc<Mutex<EdgeState>>,
    /// Exec "hold" waits for a permit of this (none at first): calls kept in flight until the
    /// test lets them go.
    gate: Arc<tokio::sync::Semaphore>,
}

impl FakeEdge {
    fn new(name: &str, mode: Mode) -> FakeEdge {
        FakeEdge {
            name: name.into(),
            gate: Arc::new(tokio::sync::Semaphore::new(0)),
            st: Arc::new(Mutex::new(EdgeState {
                mode,
                sandboxes: BTreeMap::new(),
                creates: 0,
                many: Vec::new(),
                lists: 0,
                gets: 0,
                runtime_calls: Vec::new(),
                files: Vec::new(),
                create_delay: Duration::ZERO,
                aborted_uploads: 0,
                moved_away: BTreeMap::new(),
                upload_messages: 0,
            })),
        }
    }

    fn get(&self, id: &str) -> Result<pb::Sandbox, Status> {
        self.st
            .lock()
            .unwrap()
            .sandboxes
            .get(id)
            .cloned()
            .ok_or_else(|| ApiError::not_found(format!("sandbox {id} not found")).to_status())
    }

    fn set_state(&self, id: &str, state: pb::SandboxState) -> Result<Response<pb::Sandbox>, Status> {
        let mut st = self.st.lock().unwrap();
        let sb = st.sandboxes.get_mut(id).ok_or_else(|| ApiError::not_found("no such sandbox").to_status())?;
        sb.state = state as i32;
        Ok(Response::new(sb.clone()))
    }
}

#[tonic::async_trait]
impl Edge for FakeEdge {
    async fn status(&self, _: Request<pb::StatusRequest>) -> Result<Response<pb::EdgeStatus>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn set_draining(&self, _: Request<pb::SetDrainingRequest>) -> Result<Response<pb::EdgeStatus>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn create_sandbox(&self, r: Request<pb::EdgeCreateRequest>) -> Result<Response<pb::Sandbox>, Status> {
        let r = r.into_inner();
        let delay = self.st.lock().unwrap().create_delay;
        tokio::time::sleep(delay).await;
        let mut st = self.st.lock().unwrap();
        st.creates += 1;
        match st.mode {
            Mode::NoCapacity => return Err(ApiError::new(Reason::NoCapacity, "fake edge is full").to_status()),
            Mode::Unavailable => return Err(ApiError::unavailable("fake edge is restarting").to_status()),
            Mode::Accept | Mode::BreakMany => {}
        }
        let id = ids::sandbox_id(&self.name, &r.lease_id);
        let sb = pb::Sandbox {
            id: id.clone(),
            edge: self.name.clone(),
            lease_id: r.lease_id,
            spec: r.spec,
            state: pb::SandboxState::Running as i32,
            principal: r.principal,
            created_at_ms: time::now_ms(),
            ..Default::default()
        };
        st.sandboxes.insert(id, sb.clone());
        Ok(Response::new(sb))
    }

    type CreateManyStream = futures::stream::Iter<std::vec::IntoIter<Result<pb::EdgeCreateResult, Status>>>;

    async fn create_many(
        &self,
        r: Request<pb::EdgeCreateManyRequest>,
    ) -> Result<Response<Self::CreateManyStream>, Status> {
        let items = r.into_inner().items;
        self.st.lock().unwrap().many.push(items.len());
        let answers = futures::future::join_all(items.into_iter().map(|i| self.create_sandbox(Request::new(i)))).await;
        // Answered in reverse: the apiserver matches answers by index, not by order.
        let mut results: Vec<_> = (0u32..)
            .zip(answers)
            .map(|(index, a)| {
                Ok(match a {
                    Ok(sb) => pb::EdgeCreateResult { index, sandbox: Some(sb.into_inner()), error: None },
                    Err(st) => pb::EdgeCreateResult {
                        index,
                        sandbox: None,
                        error: Some(ApiError::from_status(&st).to_detail()),
                    },
                })
            })
            .collect();
        results.reverse();
        if self.st.lock().unwrap().mode == Mode::BreakMany {
            results.truncate(1);
            results.push(Err(Status::unknown("h2 protocol error: connection reset")));
        }
        Ok(Response::new(futures::stream::iter(results)))
    }

    async fn get_sandbox(&self, r: Request<pb::GetSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        self.st.lock().unwrap().gets += 1;
        self.get(&r.get_ref().id).map(Response::new)
    }

    async fn list_sandboxes(&self, r: Request<pb::EdgeListRequest>) -> Result<Response<pb::EdgeListResponse>, Status> {
        let r = r.into_inner();
        let mut st = self.st.lock().unwrap();
        st.lists += 1;
        let mut all: Vec<pb::Sandbox> = st
            .sandboxes
            .values()
            .filter(|sb| sb.id > r.after)
            .filter(|sb| sb.spec.as_ref().is_some_and(|sp| ids::project_within(&sp.project, &r.project)))
            .cloned()
            .collect();
        let more = all.len() > r.limit as usize;
        all.truncate(r.limit as usize);
        // As an edge does: those met before the page's end, at most `limit`.
        let end = if more { all.last().map(|sb| sb.id.clone()) } else { None };
        let mut moved_away: Vec<pb::MovedAway> = st
            .moved_away
            .iter()
            .filter(|(id, _)| **id > r.after && end.as_ref().is_none_or(|e| *id < e))
            .map(|(id, to)| pb::MovedAway { id: id.clone(), to: to.clone() })
            .collect();
        let mut moved_away_upto = String::new();
        if moved_away.len() > r.limit as usize {
            moved_away.truncate(r.limit as usize);
            moved_away_upto = moved_away.last().map(|m| m.id.clone()).unwrap_or_default();
        }
        Ok(Response::new(pb::EdgeListResponse { sandboxes: all, more, moved_away, moved_away_upto }))
    }

    async fn stop_sandbox(&self, r: Request<pb::StopSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        self.set_state(&r.get_ref().id, pb::SandboxState::Stopped)
    }

    async fn pause_sandbox(&self, r: Request<pb::PauseSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        self.set_state(&r.get_ref().id, pb::SandboxState::Paused)
    }

    async fn resume_sandbox(&self, r: Request<pb::ResumeSandboxRequest>) -> Result<Response<pb::Sandbox>, Status> {
        self.set_state(&r.get_ref().id, pb::SandboxState::Running)
    }

    async fn set_sandbox_timeout(
        &self,
        r: Request<pb::SetSandboxTimeoutRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        self.get(&r.get_ref().id).map(Response::new)
    }

    async fn update_network(&self, r: Request<pb::UpdateNetworkRequest>) -> Result<Response<pb::Sandbox>, Status> {
        self.get(&r.get_ref().id).map(Response::new)
    }

    async fn get_sandbox_metrics(
        &self,
        _: Request<pb::GetSandboxMetricsRequest>,
    ) -> Result<Response<pb::SandboxMetrics>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn create_snapshot(&self, _: Request<pb::EdgeSnapshotRequest>) -> Result<Response<pb::EdgeSnapshot>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn move_out(&self, _: Request<pb::EdgeMoveOutRequest>) -> Result<Response<pb::EdgeMoveOut>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn finish_move(&self, _: Request<pb::EdgeFinishMoveRequest>) -> Result<Response<pb::Sandbox>, Status> {
        Err(Status::unimplemented("fake"))
    }

    async fn save_session(&self, _: Request<pb::SaveSessionRequest>) -> Result<Response<pb::SessionSaved>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

/// The edge's `Runtime` service: Exec echoes the command, ExecStream sends one output chunk
/// and exit 3, WriteFile keeps what it got, ReadFile sends two chunks; the rest is
/// unimplemented (async_trait must see every method, so the macro writes the whole impl).
macro_rules! fake_runtime {
    ($($name:ident($req:ty) -> $resp:ty;)*) => {
        #[tonic::async_trait]
        impl Runtime for FakeEdge {
            async fn exec(&self, r: Request<pb::ExecRequest>) -> Result<Response<pb::ExecResult>, Status> {
                let r = r.into_inner();
                self.ran("Exec", &r.sandbox_id)?;
                // "hold" holds the call until the test adds a permit to the gate.
                if r.command == "hold" {
                    self.gate.acquire().await.map_err(|_| Status::unavailable("gate closed"))?.forget();
                }
                // "sleep:<ms>" holds the call that long (calls in flight).
                if let Some(ms) = r.command.strip_prefix("sleep:").and_then(|v| v.parse().ok()) {
                    tokio::time::sleep(Duration::from_millis(ms)).await;
                }
                // "big:<bytes>": that much output.
                if let Some(n) = r.command.strip_prefix("big:").and_then(|v| v.parse().ok()) {
                    return Ok(Response::new(pb::ExecResult { stdout: vec![b'x'; n], request_id: r.request_id, ..Default::default() }));
                }
                Ok(Response::new(pb::ExecResult {
                    stdout: r.command.into_bytes(),
                    request_id: r.request_id,
                    ..Default::default()
                }))
            }

            type ExecStreamStream = tokio_stream::Iter<std::vec::IntoIter<Result<pb::ExecChunk, Status>>>;

            async fn exec_stream(&self, r: Request<pb::ExecRequest>) -> Result<Response<Self::ExecStreamStream>, Status> {
                let r = r.into_inner();
                self.ran("ExecStream", &r.sandbox_id)?;
                let out = pb::OutputData { stream: pb::OutputStream::Stdout as i32, offset: 0, data: r.command.into_bytes() };
                let chunks = vec![
                    Ok(pb::ExecChunk { kind: Some(pb::exec_chunk::Kind::Output(out)), request_id: r.request_id }),
                    Ok(pb::ExecChunk {
                        kind: Some(pb::exec_chunk::Kind::Exit(pb::ExecExit { exit_code: 3, ..Default::default() })),
                        request_id: String::new(),
                    }),
                ];
                Ok(Response::new(tokio_stream::iter(chunks)))
            }

            type ReadFileStream = tokio_stream::Iter<std::vec::IntoIter<Result<pb::FileChunk, Status>>>;

            async fn read_file(&self, r: Request<pb::ReadFileRequest>) -> Result<Response<Self::ReadFileStream>, Status> {
                self.ran("ReadFile", &r.get_ref().sandbox_id)?;
                let chunks = vec![
                    Ok(pb::FileChunk { offset: 0, data: b"hello ".to_vec() }),
                    Ok(pb::FileChunk { offset: 6, data: b"world".to_vec() }),
                ];
                Ok(Response::new(tokio_stream::iter(chunks)))
            }

            async fn write_file(
                &self,
                r: Request<tonic::Streaming<pb::WriteFileRequest>>,
            ) -> Result<Response<pb::WriteFileResponse>, Status> {
                let mut incoming = r.into_inner();
                let first = match incoming.message().await {
                    Ok(Some(m)) => m,
                    Ok(None) => return Err(Status::invalid_argument("empty")),
                    Err(e) => {
                        self.st.lock().unwrap().aborted_uploads += 1;
                        return Err(e);
                    }
                };
                self.ran("WriteFile", &first.sandbox_id)?;
                let mut data = first.data;
                self.st.lock().unwrap().upload_messages = 1;
                loop {
                    match incoming.message().await {
                        Ok(Some(m)) => {
                            data.extend(m.data);
                            self.st.lock().unwrap().upload_messages += 1;
                        }
                        Ok(None) => break,
                        Err(e) => {
                            self.st.lock().unwrap().aborted_uploads += 1;
                            return Err(e);
                        }
                    }
                }
                let n = data.len() as u64;
                self.st.lock().unwrap().files.push((first.path, data));
                Ok(Response::new(pb::WriteFileResponse { bytes_written: n }))
            }

            type ConnectProcessStream = tokio_stream::Iter<std::vec::IntoIter<Result<pb::ProcessEvent, Status>>>;

            async fn connect_process(
                &self,
                _: Request<pb::ConnectProcessRequest>,
            ) -> Result<Response<Self::ConnectProcessStream>, Status> {
                Err(Status::unimplemented("fake"))
            }

            type WatchStream = tokio_stream::Iter<std::vec::IntoIter<Result<pb::Heartbeat, Status>>>;

            async fn watch(&self, _: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
                Err(Status::unimplemented("fake"))
            }

            type WatchDirStream = tokio_stream::Iter<std::vec::IntoIter<Result<pb::WatchDirEvent, Status>>>;

            async fn watch_dir(&self, _: Request<pb::WatchDirRequest>) -> Result<Response<Self::WatchDirStream>, Status> {
                Err(Status::unimplemented("fake"))
            }

            type RunCodeStream = tokio_stream::Iter<std::vec::IntoIter<Result<pb::CodeEvent, Status>>>;

            async fn run_code(&self, _: Request<pb::RunCodeRequest>) -> Result<Response<Self::RunCodeStream>, Status> {
                Err(Status::unimplemented("fake"))
            }

            $(
                async fn $name(&self, _: Request<$req>) -> Result<Response<$resp>, Status> {
                    Err(Status::unimplemented("fake"))
                }
            )*
        }
    };
}

fake_runtime! {
    get_output(pb::GetOutputRequest) -> pb::GetOutputResponse;
    close_session(pb::CloseSessionRequest) -> pb::CloseSessionResponse;
    list_dir(pb::ListDirRequest) -> pb::ListDirResponse;
    stat(pb::StatRequest) -> pb::FileInfo;
    make_dir(pb::MakeDirRequest) -> pb::MakeDirResponse;
    remove(pb::RemoveRequest) -> pb::RemoveResponse;
    r#move(pb::MoveRequest) -> pb::MoveResponse;
    http_request(pb::HttpRequestRequest) -> pb::HttpRequestResponse;
    start_process(pb::StartProcessRequest) -> pb::StartProcessResponse;
    send_input(pb::SendInputRequest) -> pb::SendInputResponse;
    signal_process(pb::SignalProcessRequest) -> pb::SignalProcessResponse;
    list_processes(pb::ListProcessesRequest) -> pb::ListProcessesResponse;
    resize_process(pb::ResizeProcessRequest) -> pb::ResizeProcessResponse;
    create_watcher(pb::WatchDirRequest) -> pb::CreateWatcherResponse;
    get_watcher_events(pb::GetWatcherEventsRequest) -> pb::GetWatcherEventsResponse;
    remove_watcher(pb::RemoveWatcherRequest) -> pb::RemoveWatcherResponse;
    create_code_context(pb::CreateCodeContextRequest) -> pb::CodeContext;
    list_code_contexts(pb::ListCodeContextsRequest) -> pb::ListCodeContextsResponse;
    restart_code_context(pb::CodeContextRequest) -> pb::CodeContext;
    remove_code_context(pb::CodeContextRequest) -> pb::RemoveCodeContextResponse;
}

impl FakeEdge {
    /// Records a runtime call; a sandbox this edge does not hold is `not_found`, as on a real edge.
    /// Runtime calls of `method` that reached this edge.
    fn calls(&self, method: &str) -> usize {
        self.st.lock().unwrap().runtime_calls.iter().filter(|(m, _)| *m == method).count()
    }

    fn ran(&self, method: &'static str, id: &str) -> Result<(), Status> {
        self.get(id)?;
        self.st.lock().unwrap().runtime_calls.push((method, id.to_string()));
        Ok(())
    }
}

// ---------------------------------------------------------------------------------------------
// Fake watcher

fn edge_info(name: &str, addr: SocketAddr, allocated_cpu: u32) -> pb::EdgeInfo {
    pb::EdgeInfo {
        name: name.into(),
        address: addr.to_string(),
        healthy: true,
        status: Some(pb::EdgeStatus {
            edge: name.into(),
            backends: vec!["sim".into()],
            capacity: Some(pb::Resources { cpu_millis: 64_000, memory_mb: 512 * 1024, disk_mb: 1 << 20, gpus: 0 }),
            allocated: Some(pb::Resources { cpu_millis: allocated_cpu, ..Default::default() }),
            max_sandboxes: 1000,
            ..Default::default()
        }),
        last_seen_ms: time::now_ms(),
        unhealthy_since_ms: 0,
    }
}

// ---------------------------------------------------------------------------------------------
// Harness

struct Cluster {
    iam: FakeIam,
    image_store: std::path::PathBuf,
    edges: Vec<FakeEdge>,
    /// What the watcher's snapshot says of each edge.
    snapshot_edges: Arc<Mutex<Vec<pb::EdgeInfo>>>,
    api: SocketAddr,
    /// The apiserver's metrics and health endpoint.
    metrics: SocketAddr,
    audit_path: std::path::PathBuf,
    _dir: tempfile::TempDir,
    stops: Vec<oneshot::Sender<()>>,
    apiserver: Option<tokio::task::JoinHandle<Result<(), opendsec_apiserver::ApiserverError>>>,
}

async fn listen() -> (tokio::net::TcpListener, SocketAddr) {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap();
    (l, a)
}

fn stopper(stops: &mut Vec<oneshot::Sender<()>>) -> impl Future<Output = ()> + Send + 'static {
    let (tx, rx) = oneshot::channel();
    stops.push(tx);
    async move {
        let _ = rx.await;
    }
}

async fn http_get(addr: SocketAddr, path: &str) -> String {
    let Ok(mut s) = tokio::net::TcpStream::connect(addr).await else { return String::new() };
    let _ = s.write_all(format!("GET {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n").as_bytes()).await;
    let mut out = String::new();
    let _ = s.read_to_string(&mut out).await;
    out
}

/// A layer id made of one repeated byte.
fn layer_id(n: u8) -> String {
    format!("{n:02x}").repeat(32)
}

/// The store the tests start with: one layer, `debian:12` in root/a and root/b (the projects of
/// alice and bob), and `shared:1` in root (which neither may use).
fn seed_images(dir: &std::path::Path) {
    let store = Store::open(dir).unwrap();
    let id = LayerId::parse(&put_layer(&store, 1, "root/a")).unwrap();
    for (project, repo, tag) in [("root/a", "debian", "12"), ("root/b", "debian", "12"), ("root", "shared", "1")] {
        let m = Manifest {
            v: 1,
            project: project.into(),
            repo: repo.into(),
            tag: tag.into(),
            layers: vec![id.clone()],
            config: ImageConfig::default(),
            created_at_ms: 1,
            source: "test".into(),
            vm_snapshot: String::new(),
        };
        store.write_manifest(&m).unwrap();
    }
}

fn test_config() -> ApiserverConfig {
    let defaults = ApiserverConfig::default();
    ApiserverConfig {
        epoch_poll_interval: Duration::from_millis(200),
        snapshot_refresh: Duration::from_millis(100),
        edge_call_timeout: Duration::from_secs(5),
        placement: PlacementConfig { penalty: Duration::from_secs(60), ..defaults.placement.clone() },
        audit: AuditConfig { max_bytes: 1 << 20, ..defaults.audit.clone() },
        insecure_plaintext: true,
        ..defaults
    }
}

impl Cluster {
    /// Edges given as (name, mode, allocated cpu millis: lower is preferred by placement).
    async fn start(edges: &[(&str, Mode, u32)], cfg: ApiserverConfig) -> Cluster {
        let mut stops = Vec::new();
        let iam = FakeIam::default();
        {
            let mut s = iam.st();
            s.epoch = 1;
            s.tokens.insert(ALICE.into(), ("alice".into(), "root/a".into()));
            s.tokens.insert(BOB.into(), ("bob".into(), "root/b".into()));
            s.principals.insert("alice".into(), "root/a".into());
            s.principals.insert("bob".into(), "root/b".into());
        }
        let dir = tempfile::tempdir().unwrap();
        let pki = dir.path().join("pki");
        let (l, iam_addr) = listen().await;
        let router =
            grpc::internal_server().add_service(IamServer::new(iam.clone())).add_service(AdminServer::new(iam.clone()));
        let (tls, stop) = (creds(&pki, Role::Iam, "0"), stopper(&mut stops));
        tokio::spawn(async move { grpc::serve_internal(router, l, &tls, stop).await });

        let watcher = FakeWatcher::default();
        let snapshot_edges = watcher.edges.clone();
        let mut fakes = Vec::new();
        for (name, mode, cpu) in edges {
            let fake = FakeEdge::new(name, *mode);
            let (l, addr) = listen().await;
            let router = grpc::internal_server()
                .add_service(EdgeServer::new(fake.clone()))
                .add_service(RuntimeServer::new(fake.clone()));
            let (tls, stop) = (creds(&pki, Role::Edge, name), stopper(&mut stops));
            tokio::spawn(async move { grpc::serve_internal(router, l, &tls, stop).await });
            watcher.edges.lock().unwrap().push(edge_info(name, addr, *cpu));
            fakes.push(fake);
        }
        let (l, watcher_addr) = listen().await;
        let router = grpc::internal_server().add_service(WatcherServer::new(watcher));
        let (tls, stop) = (creds(&pki, Role::Watcher, "0"), stopper(&mut stops));
        tokio::spawn(async move { grpc::serve_internal(router, l, &tls, stop).await });

        let audit_path = dir.path().join("audit/apiserver.log");
        let image_store = dir.path().join("images");
        seed_images(&image_store);
        let opts = ApiserverOptions {
            config: cfg,
            iam_addrs: vec![iam_addr.to_string()],
            watcher_addrs: vec![watcher_addr.to_string()],
            tls: creds(&pki, Role::Apiserver, "0"),
            audit_path: audit_path.clone(),
            image_store: image_store.clone(),
            default_egress: Vec::new(),
        };
        let (api_l, api) = listen().await;
        let (metrics_l, metrics) = listen().await;
        let apiserver = tokio::spawn(serve(opts, api_l, Some(metrics_l), stopper(&mut stops)));

        // Ready once it heard from IAM and has a snapshot.
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let r = http_get(metrics, "/readyz").await;
            if r.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(tokio::time::Instant::now() < deadline, "apiserver not ready: {r}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(http_get(metrics, "/metrics").await.contains("opendsec_apiserver"));
        Cluster {
            iam,
            image_store,
            edges: fakes,
            snapshot_edges,
            api,
            metrics,
            audit_path,
            _dir: dir,
            stops,
            apiserver: Some(apiserver),
        }
    }

    fn images(&self) -> ImagesClient<Channel> {
        ImagesClient::new(grpc::channel(&self.api.to_string()).unwrap())
    }

    fn runtime(&self) -> RuntimeClient<Channel> {
        RuntimeClient::new(grpc::channel(&self.api.to_string()).unwrap())
    }

    fn client(&self) -> SandboxesClient<Channel> {
        SandboxesClient::new(grpc::channel(&self.api.to_string()).unwrap())
    }

    fn edge(&self, name: &str) -> &FakeEdge {
        self.edges.iter().find(|e| e.name == name).unwrap()
    }

    /// Stops everything and returns the audit lines.
    async fn stop(mut self) -> String {
        for s in self.stops.drain(..) {
            let _ = s.send(());
        }
        if let Some(h) = self.apiserver.take() {
            tokio::time::timeout(Duration::from_secs(10), h).await.unwrap().unwrap().unwrap();
        }
        std::fs::read_to_string(&self.audit_path).unwrap_or_default()
    }
}

fn with_token<T>(msg: T, token: &str) -> Request<T> {
    let mut r = Request::new(msg);
    grpc::set_bearer(&mut r, token).unwrap();
    r
}

fn spec() -> pb::SandboxSpec {
    pb::SandboxSpec {
        image: "debian:12".into(),
        backend: "sim".into(),
        resources: Some(pb::Resources { cpu_millis: 1000, memory_mb: 256, disk_mb: 0, gpus: 0 }),
        ..Default::default()
    }
}

fn create_req(lease: &str) -> pb::CreateSandboxRequest {
    pb::CreateSandboxRequest { spec: Some(spec()), lease_id: lease.into() }
}

fn reason(s: &Status) -> Reason {
    ApiError::from_status(s).reason
}

// ---------------------------------------------------------------------------------------------
// Tests

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_creation_goes_place_admit_edge_and_later_calls_are_forwarded() {
    let c = Cluster::start(&[("e1", Mode::Accept, 0)], test_config()).await;
    let mut api = c.client();

    let sb = api.create_sandbox(with_token(create_req(""), ALICE)).await.unwrap().into_inner();
    assert!(sb.id.starts_with("e1."), "{}", sb.id);
    let filled = sb.spec.clone().unwrap();
    assert_eq!(filled.project, "root/a", "empty project is the caller's own");
    assert_eq!((filled.ttl_running_stop_s, filled.ttl_max_s), (600, 3600), "default TTLs filled");
    assert_eq!(sb.principal, "alice");
    assert_eq!(c.iam.st().admits, vec![(sb.lease_id.clone(), "e1".to_string())]);

    let got = api.get_sandbox(with_token(pb::GetSandboxRequest { id: sb.id.clone() }, ALICE)).await.unwrap();
    assert_eq!(got.into_inner().id, sb.id);

    // The same lease id again: the first sandbox, no second admission or creation.
    let first = api.create_sandbox(with_token(create_req("job-1"), ALICE)).await.unwrap().into_inner();
    let again = api.create_sandbox(with_token(create_req("job-1"), ALICE)).await.unwrap().into_inner();
    assert_eq!(first.id, again.id);
    let scoped = opendsec_apiserver::admission::scoped_lease_id("root/a", "job-1");
    assert_eq!(first.lease_id, scoped);
    assert_eq!(c.iam.st().admits.iter().filter(|(l, _)| *l == scoped).count(), 1);
    assert_eq!(c.edge("e1").st.lock().unwrap().creates, 2);

    let list = api
        .list_sandboxes(with_token(pb::ListSandboxesRequest { page_size: 1, ..Default::default() }, ALICE))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(list.sandboxes.len(), 1);
    assert!(!list.next_page_token.is_empty());
    let rest = api
        .list_sandboxes(with_token(
            pb::ListSandboxesRequest { page_size: 10, page_token: list.next_page_token.clone(), ..Default::default() },
            ALICE,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(rest.sandboxes.len(), 1);
    assert!(rest.next_page_token.is_empty());
    assert_ne!(rest.sandboxes[0].id, list.sandboxes[0].id);

    let stopped = api.stop_sandbox(with_token(pb::StopSandboxRequest { id: sb.id.clone() }, ALICE)).await.unwrap();
    assert_eq!(stopped.into_inner().state, pb::SandboxState::Stopped as i32);
    let e = api
        .set_sandbox_timeout(with_token(
            pb::SetSandboxTimeoutRequest { id: sb.id.clone(), ttl_max_s: Some(u64::MAX), ..Default::default() },
            ALICE,
        ))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::InvalidArgument);

    // A bad spec and a missing token never reach IAM's Admit.
    let mut bad = create_req("");
    bad.spec.as_mut().unwrap().backend = "kvm".into();
    assert_eq!(reason(&api.create_sandbox(with_token(bad, ALICE)).await.unwrap_err()), Reason::InvalidArgument);
    let e = api.create_sandbox(Request::new(create_req(""))).await.unwrap_err();
    assert_eq!(reason(&e), Reason::Unauthenticated);
    assert_eq!(c.iam.st().admits.len(), 2);

    // Admin is proxied with the caller's own token.
    let mut admin = AdminClient::new(grpc::channel(&c.api.to_string()).unwrap());
    let me = admin.who_am_i(with_token(pb::WhoAmIRequest {}, BOB)).await.unwrap().into_inner();
    assert_eq!(me.principal, "bob");
    assert_eq!(c.iam.st().admin_bearers, vec![BOB.to_string()]);
    let e = admin.get_project(with_token(pb::GetProjectRequest { path: "root".into() }, BOB)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::NotFound, "IAM's error comes back as it is");

    let audit = c.stop().await;
    assert!(audit.lines().any(|l| l.contains("\"method\":\"CreateSandbox\"") && l.contains("\"reason\":\"ok\"")));
    assert!(audit.lines().any(|l| l.contains("\"method\":\"WhoAmI\"")));
    assert!(!audit.contains("dsk."), "no token in the audit log");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_edge_is_penalized_and_the_same_lease_is_rebound_elsewhere() {
    // e1 is the less loaded, so placement tries it first; it refuses.
    let c = Cluster::start(&[("e1", Mode::NoCapacity, 0), ("e2", Mode::Accept, 32_000)], test_config()).await;
    let mut api = c.client();

    let sb = api.create_sandbox(with_token(create_req(""), ALICE)).await.unwrap().into_inner();
    assert!(sb.id.starts_with("e2."), "{}", sb.id);
    let lease = sb.lease_id.clone();
    assert_eq!(c.iam.st().admits, vec![(lease.clone(), "e1".to_string()), (lease.clone(), "e2".to_string())]);
    assert!(c.iam.st().released.is_empty());

    // e1 is penalized now: the next creation goes straight to e2.
    let next = api.create_sandbox(with_token(create_req(""), ALICE)).await.unwrap().into_inner();
    assert!(next.id.starts_with("e2."));
    assert_eq!(c.edge("e1").st.lock().unwrap().creates, 1);

    // The stages of the creations that succeeded: three admissions (one of them for the
    // edge that refused), two edge creations.
    let text = http_get(c.metrics, "/metrics").await;
    for (series, n) in [("admit_seconds", 3), ("edge_create_seconds", 2), ("creation_seconds", 2)] {
        let line = format!("opendsec_apiserver_{series}_count {n}");
        assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
    }
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_edge_refuses_the_lease_is_released() {
    let c = Cluster::start(&[("e1", Mode::NoCapacity, 0), ("e2", Mode::Unavailable, 0)], test_config()).await;
    let mut api = c.client();

    let e = api.create_sandbox(with_token(create_req("doomed"), ALICE)).await.unwrap_err();
    assert!(matches!(reason(&e), Reason::NoCapacity | Reason::Unavailable), "{e:?}");
    {
        let st = c.iam.st();
        let doomed = opendsec_apiserver::admission::scoped_lease_id("root/a", "doomed");
        assert_eq!(st.admits.len(), 2);
        assert!(st.admits.iter().all(|(l, _)| *l == doomed));
        assert_eq!(st.released, vec![doomed]);
    }
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_token_is_refused_within_two_seconds() {
    let c = Cluster::start(&[("e1", Mode::Accept, 0)], test_config()).await;
    let mut api = c.client();
    let sb = api.create_sandbox(with_token(create_req(""), ALICE)).await.unwrap().into_inner();
    let get = || with_token(pb::GetSandboxRequest { id: sb.id.clone() }, ALICE);
    api.get_sandbox(get()).await.unwrap(); // cached now

    c.iam.revoke(ALICE);
    // Polled until refused, within the bound the reference gives (caches cleared on the epoch
    // change, polled every second).
    let refused = tokio::time::timeout(Duration::from_secs(2), async {
        loop {
            match api.get_sandbox(get()).await {
                Err(e) if reason(&e) == Reason::Unauthenticated => break,
                Err(e) => panic!("unexpected error {e:?}"),
                Ok(_) => tokio::time::sleep(Duration::from_millis(25)).await,
            }
        }
    })
    .await;
    assert!(refused.is_ok(), "revoked token still works after 2 s");
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_projects_unknown_edges_and_malformed_ids_are_refused() {
    let c = Cluster::start(&[("e1", Mode::Accept, 0)], test_config()).await;
    let mut api = c.client();
    let bobs = api.create_sandbox(with_token(create_req(""), BOB)).await.unwrap().into_inner();

    let e = api.get_sandbox(with_token(pb::GetSandboxRequest { id: bobs.id.clone() }, ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::PermissionDenied);
    let e = api.stop_sandbox(with_token(pb::StopSandboxRequest { id: bobs.id.clone() }, ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::PermissionDenied);
    let e =
        api.get_sandbox(with_token(pb::GetSandboxRequest { id: "nowhere.abc123".into() }, ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::NotFound);
    assert!(e.message().contains("edge nowhere is not known"), "{}", e.message());
    let e = api.get_sandbox(with_token(pb::GetSandboxRequest { id: "no-dot".into() }, ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::InvalidArgument);
    let e = api
        .list_sandboxes(with_token(pb::ListSandboxesRequest { project: "root/b".into(), ..Default::default() }, ALICE))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::PermissionDenied);
    let e = api
        .list_sandboxes(with_token(pb::ListSandboxesRequest { page_size: 1001, ..Default::default() }, ALICE))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::InvalidArgument);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_stream_every_item_and_wait_for_rate_limits() {
    let mut cfg = test_config();
    cfg.rate_per_principal = 5.0;
    cfg.burst_per_principal = 2.0;
    cfg.batch_concurrency = 4;
    let c = Cluster::start(&[("e1", Mode::Accept, 0), ("e2", Mode::Accept, 0)], cfg).await;
    let mut api = c.client();

    let e = api
        .create_sandboxes(with_token(
            pb::CreateSandboxesRequest { spec: Some(spec()), count: 32_769, patches: vec![] },
            ALICE,
        ))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::InvalidArgument);
    assert!(c.iam.st().admits.is_empty());

    // 6 items with a burst of 2: the rate limit makes items wait, none fails.
    let mut stream = api
        .create_sandboxes(with_token(
            pb::CreateSandboxesRequest { spec: Some(spec()), count: 6, patches: vec![] },
            ALICE,
        ))
        .await
        .unwrap()
        .into_inner();
    let mut seen = Vec::new();
    while let Some(item) = stream.message().await.unwrap() {
        assert!(item.error.is_none(), "item {} failed: {:?}", item.index, item.error);
        assert!(item.sandbox.is_some());
        seen.push(item.index);
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..6).collect::<Vec<_>>());
    assert_eq!(c.iam.st().admits.len(), 6);

    // Single creations over the rate are refused with a retry hint.
    let mut limited = None;
    for _ in 0..5 {
        if let Err(e) = api.create_sandbox(with_token(create_req(""), ALICE)).await {
            limited = Some(e);
            break;
        }
    }
    let e = limited.expect("a burst of single creations hits the rate limit");
    let err = ApiError::from_status(&e);
    assert_eq!(err.reason, Reason::RateLimited);
    assert!(err.metadata.get("retry_after_ms").is_some_and(|v| v.parse::<u64>().is_ok()));

    let audit = c.stop().await;
    let line =
        audit.lines().find(|l| l.contains("\"method\":\"CreateSandboxes\"") && l.contains("\"count\":6")).unwrap();
    assert!(line.contains("\"failed\":0"), "{line}");
}

/// The admissions of a batch's concurrent items go to IAM gathered: while the first calls are
/// out (IAM slow here), the rest queue and go together in AdmitMany calls; every item is
/// admitted once and created.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batchs_admissions_are_gathered_into_admit_many_calls() {
    let mut cfg = test_config();
    cfg.rate_per_principal = 10_000.0;
    cfg.burst_per_principal = 10_000.0;
    cfg.batch_concurrency = 64;
    let c = Cluster::start(&[("e1", Mode::Accept, 0), ("e2", Mode::Accept, 0)], cfg).await;
    c.iam.st().admit_delay = Some(std::time::Duration::from_millis(200));
    let mut api = c.client();
    let req = pb::CreateSandboxesRequest { spec: Some(spec()), count: 64, patches: vec![] };
    let mut stream = api.create_sandboxes(with_token(req, ALICE)).await.unwrap().into_inner();
    let mut ok = 0;
    while let Some(item) = stream.message().await.unwrap() {
        assert!(item.error.is_none(), "item {} failed: {:?}", item.index, item.error);
        ok += 1;
    }
    assert_eq!(ok, 64);
    let st = c.iam.st();
    let mut leases: Vec<&String> = st.admits.iter().map(|(l, _)| l).collect();
    leases.sort_unstable();
    leases.dedup();
    assert_eq!((st.admits.len(), leases.len()), (64, 64), "each admitted once");
    let gathered: usize = st.admit_many_sizes.iter().sum();
    assert!(
        st.admit_many_sizes.iter().any(|&n| n > 1) && gathered > 32,
        "admissions were not gathered: AdmitMany sizes {:?}",
        st.admit_many_sizes
    );
}

/// A batch goes out in runs placed together, and the creations bound for one edge go to it
/// together in CreateMany calls. A run placed on an edge that refuses is placed again item
/// by item; an edge that does not answer in time leaves every item of its call
/// `deadline_exceeded`, its lease still bound there (the edge may make them yet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_goes_to_edges_in_runs_each_made_in_one_call() {
    let mut cfg = test_config();
    cfg.rate_per_principal = 10_000.0;
    cfg.burst_per_principal = 10_000.0;
    cfg.batch_concurrency = 64;
    cfg.placement.batch_run = 16;
    // e3 is the least loaded (placement's first choice when drawn) and refuses everything.
    let c =
        Cluster::start(&[("e1", Mode::Accept, 32_000), ("e2", Mode::Accept, 32_000), ("e3", Mode::NoCapacity, 0)], cfg)
            .await;
    for e in ["e1", "e2", "e3"] {
        c.edge(e).st.lock().unwrap().create_delay = Duration::from_millis(50);
    }
    let mut api = c.client();
    let req = pb::CreateSandboxesRequest { spec: Some(spec()), count: 64, patches: vec![] };
    let mut stream = api.create_sandboxes(with_token(req, ALICE)).await.unwrap().into_inner();
    let mut ids = HashSet::new();
    while let Some(item) = stream.message().await.unwrap() {
        assert!(item.error.is_none(), "item {} failed: {:?}", item.index, item.error);
        let sb = item.sandbox.unwrap();
        assert!(sb.id.starts_with("e1.") || sb.id.starts_with("e2."), "{}", sb.id);
        ids.insert(sb.id);
    }
    assert_eq!(ids.len(), 64);
    let many: Vec<usize> = ["e1", "e2", "e3"].iter().flat_map(|e| c.edge(e).st.lock().unwrap().many.clone()).collect();
    assert!(
        many.iter().sum::<usize>() >= 48 && many.iter().any(|&n| n >= 8),
        "creations were not gathered per edge: CreateMany sizes {many:?}"
    );
    // Each lease was released only where an edge refused it (e3), never for a created one.
    {
        let st = c.iam.st();
        assert!(st.released.iter().all(|l| !ids.iter().any(|id| id.ends_with(l.as_str()))), "{:?}", st.released);
    }

    // An edge slower than edge_call_timeout: every item of its call runs out of time.
    let mut cfg = test_config();
    cfg.edge_call_timeout = Duration::from_millis(300);
    cfg.placement.batch_run = 8;
    let c = Cluster::start(&[("e1", Mode::Accept, 0)], cfg).await;
    c.edge("e1").st.lock().unwrap().create_delay = Duration::from_secs(2);
    let mut api = c.client();
    let req = pb::CreateSandboxesRequest { spec: Some(spec()), count: 8, patches: vec![] };
    let mut stream = api.create_sandboxes(with_token(req, ALICE)).await.unwrap().into_inner();
    let mut late = 0;
    while let Some(item) = stream.message().await.unwrap() {
        let e = item.error.expect("the edge did not answer in time");
        assert_eq!(e.reason, Reason::DeadlineExceeded.as_str(), "{e:?}");
        late += 1;
    }
    assert_eq!(late, 8);
    assert!(c.iam.st().released.is_empty(), "a lease of a creation that may still happen was released");
    assert!(c.edge("e1").st.lock().unwrap().many.iter().any(|&n| n > 1));
}

/// Single creations made one at a time spread as placement spreads them; concurrent ones of
/// one kind go to one edge in runs, and reach it together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn single_creations_go_in_runs_only_while_others_are_under_way() {
    let mut cfg = test_config();
    cfg.rate_per_principal = 10_000.0;
    cfg.burst_per_principal = 10_000.0;
    cfg.placement.batch_run = 4;
    let c = Cluster::start(&[("e1", Mode::Accept, 0), ("e2", Mode::Accept, 0), ("e3", Mode::Accept, 0)], cfg).await;
    let mut api = c.client();
    // Not packed into runs of 4 (runs of consecutive creations did exactly that; placement
    // choosing the same edge for each of three runs of 4 by chance is about 1 in 50,000).
    let mut edges = Vec::new();
    for _ in 0..12 {
        edges.push(api.create_sandbox(with_token(create_req(""), ALICE)).await.unwrap().into_inner().edge);
    }
    let packed = edges.iter().enumerate().all(|(i, e)| *e == edges[i - i % 4]);
    assert!(!packed, "creations one at a time went in runs: {edges:?}");

    for e in ["e1", "e2", "e3"] {
        c.edge(e).st.lock().unwrap().create_delay = Duration::from_millis(100);
    }
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let mut api = c.client();
            tokio::spawn(async move { api.create_sandbox(with_token(create_req(""), ALICE)).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    let many: Vec<usize> = ["e1", "e2", "e3"].iter().flat_map(|e| c.edge(e).st.lock().unwrap().many.clone()).collect();
    assert!(many.iter().any(|&n| n > 1), "no creations were gathered: {many:?}");
    c.stop().await;
}

/// A CreateMany call that breaks off after the edge took it: the creations it did not answer
/// may have been made there, so none of their leases is released; each is placed again
/// under its lease (IAM rebinds it) and made elsewhere.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_broken_midway_keeps_the_leases_and_places_the_rest_again() {
    let mut cfg = test_config();
    cfg.placement.batch_run = 8;
    // e1 is the first choice and breaks off its calls; e2 takes what is placed again.
    let c = Cluster::start(&[("e1", Mode::BreakMany, 0), ("e2", Mode::Accept, 32_000)], cfg).await;
    c.edge("e1").st.lock().unwrap().create_delay = Duration::from_millis(50);
    let mut api = c.client();
    let req = pb::CreateSandboxesRequest { spec: Some(spec()), count: 8, patches: vec![] };
    let mut stream = api.create_sandboxes(with_token(req, ALICE)).await.unwrap().into_inner();
    let mut on = BTreeMap::<String, usize>::new();
    while let Some(item) = stream.message().await.unwrap() {
        let sb = item.sandbox.unwrap_or_else(|| panic!("item {} failed: {:?}", item.index, item.error));
        *on.entry(sb.edge).or_default() += 1;
    }
    assert_eq!(on.values().sum::<usize>(), 8, "{on:?}");
    assert!(c.edge("e1").st.lock().unwrap().many.iter().any(|&n| n > 1), "no CreateMany call to break");
    assert!(on.get("e2").is_some_and(|&n| n >= 1), "nothing was placed again: {on:?}");
    assert!(c.iam.st().released.is_empty(), "a lease the edge may hold was released: {:?}", c.iam.st().released);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_items_take_their_own_env_and_labels() {
    let c = Cluster::start(&[("e1", Mode::Accept, 0)], test_config()).await;
    let mut api = c.client();
    let mut shared = spec();
    shared.labels.insert("job".into(), "eval".into());
    shared.env.insert("MODE".into(), "base".into());
    let patch = |i: u32| pb::ItemPatch {
        env: [("SHARD".to_string(), i.to_string()), ("MODE".to_string(), "patched".to_string())].into(),
        labels: [("shard".to_string(), i.to_string())].into(),
    };
    // Three patches for four items: the last takes the shared spec.
    let req = pb::CreateSandboxesRequest { spec: Some(shared.clone()), count: 4, patches: (0..3).map(patch).collect() };
    let mut stream = api.create_sandboxes(with_token(req, ALICE)).await.unwrap().into_inner();
    let mut got = std::collections::BTreeMap::new();
    while let Some(item) = stream.message().await.unwrap() {
        got.insert(item.index, item.sandbox.unwrap().spec.unwrap());
    }
    for i in 0..3u32 {
        let sp = &got[&i];
        assert_eq!(sp.env.get("SHARD").map(String::as_str), Some(i.to_string().as_str()));
        assert_eq!(sp.env.get("MODE").map(String::as_str), Some("patched"));
        assert_eq!(sp.labels.get("shard").map(String::as_str), Some(i.to_string().as_str()));
        assert_eq!(sp.labels.get("job").map(String::as_str), Some("eval"));
    }
    assert_eq!(got[&3].env.get("MODE").map(String::as_str), Some("base"));
    assert!(!got[&3].labels.contains_key("shard"));

    // More patches than items, or one patch that makes a bad spec: the whole batch is refused
    // before anything is admitted.
    let admits = c.iam.st().admits.len();
    let req = pb::CreateSandboxesRequest { spec: Some(shared.clone()), count: 1, patches: vec![patch(0), patch(1)] };
    assert_eq!(reason(&api.create_sandboxes(with_token(req, ALICE)).await.unwrap_err()), Reason::InvalidArgument);
    let bad = pb::ItemPatch { env: [("A=B".to_string(), "x".to_string())].into(), ..Default::default() };
    let req = pb::CreateSandboxesRequest { spec: Some(shared), count: 3, patches: vec![patch(0), bad] };
    let e = api.create_sandboxes(with_token(req, ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::InvalidArgument, "{}", e.message());
    assert_eq!(c.iam.st().admits.len(), admits);
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_creation_needs_an_image_it_may_use() {
    let c = Cluster::start(&[("e1", Mode::Accept, 0)], test_config()).await;
    let mut api = c.client();
    let with_image = |image: &str| {
        let mut r = create_req("");
        r.spec.as_mut().unwrap().image = image.into();
        r
    };

    // Missing: not_found, naming the image and where it was looked for, before any Admit.
    let e = api.create_sandbox(with_token(with_image("nope:1"), ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::NotFound);
    assert!(e.message().contains("image nope:1 not found in root/a or above"), "{}", e.message());
    let e = api
        .create_sandboxes(with_token(
            pb::CreateSandboxesRequest { spec: with_image("nope").spec, count: 3, patches: vec![] },
            ALICE,
        ))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::NotFound, "a batch checks its image once, up front");
    let e = api.create_sandbox(with_token(with_image("Not A Name"), ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::InvalidArgument);
    // Found, but where the caller may not use it: in root (above alice's project) or bob's.
    for image in ["shared:1", "root/b//debian:12"] {
        let e = api.create_sandbox(with_token(with_image(image), ALICE)).await.unwrap_err();
        assert_eq!(reason(&e), Reason::PermissionDenied, "{image}: {e:?}");
        assert!(e.message().contains("layer.use"), "{}", e.message());
    }
    assert!(c.iam.st().admits.is_empty());
    // Found in the sandbox's own project, or exactly where it is.
    api.create_sandbox(with_token(with_image("debian:12"), ALICE)).await.unwrap();
    api.create_sandbox(with_token(with_image("root/a//debian:12"), ALICE)).await.unwrap();
    assert_eq!(c.iam.st().admits.len(), 2);
    // No edge offers the backend: placement's not_found is still about the backend.
    let mut kvm = with_image("debian:12");
    kvm.spec.as_mut().unwrap().backend = "microvm".into();
    let e = api.create_sandbox(with_token(kvm, ALICE)).await.unwrap_err();
    assert!(!e.message().contains("image"), "{}", e.message());
    c.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn images_register_get_list_compose_and_delete() {
    let c = Cluster::start(&[("e1", Mode::Accept, 0)], test_config()).await;
    let mut images = c.images();
    let mut api = c.client();
    let image = |repo: &str, tag: &str, layers: Vec<String>| pb::Image {
        repo: repo.into(),
        tag: tag.into(),
        layers,
        config: Some(pb::ImageConfig { env: vec!["PATH=/bin".into()], cmd: vec!["sh".into()], ..Default::default() }),
        ..Default::default()
    };
    let register = |img: pb::Image, replace: bool| pb::RegisterImageRequest { image: Some(img), replace };

    // A second layer in the store, as an import would leave it.
    let store = Store::open(&c.image_store).unwrap();
    let second = LayerId::parse(&put_layer(&store, 2, "root/a")).unwrap();
    assert_eq!(second.to_string(), layer_id(2));

    let tools = images
        .register_image(with_token(register(image("tools", "v1", vec![layer_id(2)]), false), ALICE))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (tools.project.as_str(), tools.repo.as_str(), tools.layers.clone()),
        ("root/a", "tools", vec![layer_id(2)])
    );
    assert!(tools.created_at_ms > 0);
    // A sandbox can use it at once (this apiserver's cache was cleared by the write).
    let mut req = create_req("");
    req.spec.as_mut().unwrap().image = "tools:v1".into();
    api.create_sandbox(with_token(req, ALICE)).await.unwrap();

    // The same name again: already_exists unless replacing.
    let e = images
        .register_image(with_token(register(image("tools", "v1", vec![layer_id(2)]), false), ALICE))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::AlreadyExists);
    images
        .register_image(with_token(register(image("tools", "v1", vec![layer_id(1), layer_id(2)]), true), ALICE))
        .await
        .unwrap();
    // A manifest naming a missing layer fails clearly and writes nothing.
    let e = images
        .register_image(with_token(register(image("broken", "1", vec![layer_id(1), layer_id(9)]), false), ALICE))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::NotFound);
    assert!(e.message().contains(&layer_id(9)), "{}", e.message());
    // Another project's images: bob may neither write nor read them.
    let mut in_a = image("evil", "1", vec![layer_id(1)]);
    in_a.project = "root/a".into();
    let e = images.register_image(with_token(register(in_a, true), BOB)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::PermissionDenied);
    let e = images
        .get_image(with_token(pb::GetImageRequest { project: String::new(), name: "root/a//tools:v1".into() }, BOB))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::PermissionDenied);

    // Get resolves upward from a subproject, as a creation there would.
    let got = images
        .get_image(with_token(pb::GetImageRequest { project: "root/a/sub".into(), name: "tools:v1".into() }, ALICE))
        .await
        .unwrap()
        .into_inner();
    assert_eq!((got.project.as_str(), got.layers.len()), ("root/a", 2));
    assert_eq!(got.config.unwrap().cmd, ["sh"]);

    // Compose: layer lists concatenated, copying nothing; a repeated layer kept at its top.
    let combo = images
        .compose_image(with_token(
            pb::ComposeImageRequest {
                project: String::new(),
                name: "combo:1".into(),
                sources: vec!["tools:v1".into(), "root/a//debian:12".into()],
                replace: false,
            },
            ALICE,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(combo.layers, vec![layer_id(2), layer_id(1)]);
    assert!(combo.source.starts_with("compose:"), "{}", combo.source);
    let e = images
        .compose_image(with_token(
            pb::ComposeImageRequest {
                name: "x:1".into(),
                sources: vec!["debian:12".into(), "root/b//debian:12".into()],
                ..Default::default()
            },
            ALICE,
        ))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::PermissionDenied, "composing reads every source");

    let list = images
        .list_images(with_token(pb::ListImagesRequest { project: String::new(), recursive: false }, ALICE))
        .await
        .unwrap()
        .into_inner();
    let names: Vec<String> = list.images.iter().map(|i| format!("{}:{}", i.repo, i.tag)).collect();
    assert_eq!(names, ["combo:1", "debian:12", "tools:v1"]);
    let e = images
        .list_images(with_token(pb::ListImagesRequest { project: "root".into(), recursive: true }, ALICE))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::PermissionDenied);

    images
        .delete_image(with_token(pb::DeleteImageRequest { project: String::new(), name: "tools:v1".into() }, ALICE))
        .await
        .unwrap();
    let e = images
        .get_image(with_token(pb::GetImageRequest { project: String::new(), name: "tools:v1".into() }, ALICE))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::NotFound);
    let e = images
        .delete_image(with_token(pb::DeleteImageRequest { project: String::new(), name: "tools:v1".into() }, ALICE))
        .await
        .unwrap_err();
    assert_eq!(reason(&e), Reason::NotFound);
    // The layers stay (GC decides), and the composed image still works.
    assert!(store.has_layer(&second));
    let audit = c.stop().await;
    assert!(audit.lines().any(|l| l.contains("\"method\":\"RegisterImage\"") && l.contains("\"reason\":\"ok\"")));
}

fn exec_req(id: &str, command: &str) -> pb::ExecRequest {
    pb::ExecRequest { sandbox_id: id.into(), command: command.into(), request_id: "r1".into(), ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_calls_are_authorized_on_the_sandbox_project_and_forwarded_to_its_edge() {
    let c = Cluster::start(&[("e1", Mode::Accept, 0)], test_config()).await;
    let sb = c.client().create_sandbox(with_token(create_req(""), ALICE)).await.unwrap().into_inner();
    let mut rt = c.runtime();

    // Unary: forwarded as it is; the project is asked of the edge once, then cached.
    for _ in 0..3 {
        let r = rt.exec(with_token(exec_req(&sb.id, "echo hi"), ALICE)).await.unwrap().into_inner();
        assert_eq!((r.stdout.as_slice(), r.request_id.as_str()), (b"echo hi".as_slice(), "r1"));
    }
    assert_eq!(c.edge("e1").st.lock().unwrap().gets, 1, "one GetSandbox for three execs");

    // Server streaming: every item, then the end.
    let mut s = rt.exec_stream(with_token(exec_req(&sb.id, "make"), ALICE)).await.unwrap().into_inner();
    let mut got = Vec::new();
    while let Some(chunk) = s.message().await.unwrap() {
        got.push(chunk.kind);
    }
    assert_eq!(got.len(), 2);
    assert!(matches!(&got[1], Some(pb::exec_chunk::Kind::Exit(x)) if x.exit_code == 3));
    let mut f = rt
        .read_file(with_token(
            pb::ReadFileRequest { sandbox_id: sb.id.clone(), path: "/a".into(), ..Default::default() },
            ALICE,
        ))
        .await
        .unwrap()
        .into_inner();
    let mut data = Vec::new();
    while let Some(chunk) = f.message().await.unwrap() {
        data.extend(chunk.data);
    }
    assert_eq!(data, b"hello world");

    // Client streaming: the first message names the sandbox, the rest follow.
    let msgs = vec![
        pb::WriteFileRequest {
            sandbox_id: sb.id.clone(),
            path: "/f".into(),
            data: b"ab".to_vec(),
            ..Default::default()
        },
        pb::WriteFileRequest { data: b"cd".to_vec(), ..Default::default() },
        pb::WriteFileRequest { sandbox_id: sb.id.clone(), data: b"e".to_vec(), ..Default::default() },
    ];
    let w = rt.write_file(with_token(tokio_stream::iter(msgs), ALICE)).await.unwrap().into_inner();
    assert_eq!(w.bytes_written, 5);
    assert_eq!(c.edge("e1").st.lock().unwrap().files, vec![("/f".to_string(), b"abcde".to_vec())]);

    // Another project's sandbox, an unknown edge, a malformed id, no token.
    let e = rt.exec(with_token(exec_req(&sb.id, "id"), BOB)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::PermissionDenied);
    let e = rt.exec_stream(with_token(exec_req(&sb.id, "id"), BOB)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::PermissionDenied);
    let bad = vec![pb::WriteFileRequest { sandbox_id: sb.id.clone(), path: "/g".into(), ..Default::default() }];
    let e = rt.write_file(with_token(tokio_stream::iter(bad), BOB)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::PermissionDenied);
    let e = rt.exec(with_token(exec_req("nowhere.abc123", "id"), ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::NotFound);
    let e = rt.exec(with_token(exec_req("no-dot", "id"), ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::InvalidArgument);
    let e = rt.exec(Request::new(exec_req(&sb.id, "id"))).await.unwrap_err();
    assert_eq!(reason(&e), Reason::Unauthenticated);
    // A sandbox the edge does not hold: the edge's own not_found comes back.
    let e = rt.exec(with_token(exec_req("e1.nosuchlease", "id"), ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::NotFound);
    let calls = c.edge("e1").st.lock().unwrap().runtime_calls.len();
    assert_eq!(calls, 6, "refused calls never reach the edge");

    let audit = c.stop().await;
    assert_eq!(audit.lines().filter(|l| l.contains("\"method\":\"Exec\"")).count(), 8);
    assert!(audit.lines().any(|l| l.contains("\"method\":\"ExecStream\"") && l.contains("\"reason\":\"ok\"")));
    assert!(
        audit.lines().any(|l| l.contains("\"method\":\"WriteFile\"") && l.contains("\"reason\":\"permission_denied\""))
    );
}

/// Waits (generously) until `cond` holds on the edge's state.
async fn until_edge(c: &Cluster, what: &str, cond: impl Fn(&EdgeState) -> bool) {
    until(what, WAIT, || cond(&c.edge("e1").st.lock().unwrap())).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upload_that_fails_midway_is_reset_at_the_edge_not_completed() {
    use opendsec_proto::upload::{self, Upload};
    use tokio_stream::wrappers::ReceiverStream;

    let c = Cluster::start(&[("e1", Mode::Accept, 0)], test_config()).await;
    let sb = c.client().create_sandbox(with_token(create_req(""), ALICE)).await.unwrap().into_inner();
    let authed = || {
        tonic::service::interceptor::InterceptedService::new(
            grpc::channel(&c.api.to_string()).unwrap(),
            |mut r: Request<()>| {
                grpc::set_bearer(&mut r, ALICE).map_err(|e| e.to_status())?;
                Ok(r)
            },
        )
    };
    let first = || {
        Upload::Message(pb::WriteFileRequest {
            sandbox_id: sb.id.clone(),
            path: "/f".into(),
            data: b"ab".to_vec(),
            ..Default::default()
        })
    };

    // The caller aborts after its first message reached the edge.
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(first()).await.unwrap();
    let call = tokio::spawn(upload::write_file(authed(), ReceiverStream::new(rx)));
    until_edge(&c, "the first message never reached the edge", |st| st.upload_messages == 1).await;
    tx.send(Upload::Abort("local read error".into())).await.unwrap();
    assert!(call.await.unwrap().is_err());
    until_edge(&c, "the edge never saw the upload fail", |st| st.aborted_uploads == 1).await;

    // A later message for another sandbox fails the upload in the apiserver.
    let other = Upload::Message(pb::WriteFileRequest { sandbox_id: "e1.other".into(), ..Default::default() });
    let e = upload::write_file(authed(), tokio_stream::iter(vec![first(), other])).await.unwrap_err();
    assert_eq!(reason(&e), Reason::InvalidArgument);
    until_edge(&c, "the edge never saw the second upload fail", |st| st.aborted_uploads == 2).await;

    assert!(c.edge("e1").st.lock().unwrap().files.is_empty(), "no short file completed");
    drop(tx);
    c.stop().await;
}

/// Plain text on the public port is for local development: refused unless the apiserver listens
/// on a loopback address (before anything is served).
#[tokio::test]
async fn plain_text_is_refused_off_loopback() {
    let dir = tempfile::tempdir().unwrap();
    let opts = ApiserverOptions {
        config: test_config(),
        iam_addrs: vec!["127.0.0.1:1".into()],
        watcher_addrs: vec!["127.0.0.1:1".into()],
        tls: creds(&dir.path().join("pki"), Role::Apiserver, "0"),
        audit_path: dir.path().join("audit.log"),
        image_store: dir.path().join("images"),
        default_egress: Vec::new(),
    };
    let wide = tokio::net::TcpListener::bind("0.0.0.0:0").await.unwrap();
    let e = serve(opts.clone(), wide, None, std::future::pending()).await.unwrap_err();
    assert!(matches!(e, opendsec_apiserver::ApiserverError::PlaintextNotLoopback(_)), "{e}");
    assert!(e.to_string().contains("loopback"), "{e}");
}

/// Nothing of a call is decoded before its caller authenticated; bad tokens cost IAM one call
/// per negative TTL; a source failing too often is paused (tokens the apiserver knows still pass).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callers_authenticate_before_decoding_and_failing_sources_pause() {
    let mut cfg = test_config();
    cfg.auth_failures = opendsec_common::config::AuthFailureConfig {
        max: 3,
        window: Duration::from_secs(60),
        pause: Duration::from_millis(800),
        negative_ttl: Duration::from_secs(60),
    };
    let c = Cluster::start(&[("e1", Mode::Accept, 0)], cfg).await;
    let mut api = c.client();
    let mut big = create_req("");
    big.spec.as_mut().unwrap().image = "x".repeat(4 << 20);
    // Without a token: unauthenticated, the 4 MiB body never decoded (failure 1).
    let e = api.create_sandbox(Request::new(big.clone())).await.unwrap_err();
    assert_eq!(reason(&e), Reason::Unauthenticated, "{e:?}");
    // With one: past the guard, the decoder's limit refuses it.
    let e = api.create_sandbox(with_token(big, ALICE)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::OutOfRange, "{e:?}");
    // A bad token twice: one IAM call (failures 2 and 3: the source is paused).
    let n0 = c.iam.st().authentications;
    let bad = "dsk.nobody.bbbbbbbbbbbbbbbbbbbb";
    for _ in 0..2 {
        let e = api.list_sandboxes(with_token(pb::ListSandboxesRequest::default(), bad)).await.unwrap_err();
        assert_eq!(reason(&e), Reason::Unauthenticated, "{e:?}");
    }
    assert_eq!(c.iam.st().authentications - n0, 1, "the refused token was asked about once");
    // Malformed tokens never reach IAM either.
    let n1 = c.iam.st().authentications;
    // Paused: a token this apiserver does not know yet is refused without asking IAM, even a
    // good one; one it knows (alice's, a moment ago) still passes: the source may be a proxy
    // or a NAT that many clients share.
    let e = api.list_sandboxes(with_token(pb::ListSandboxesRequest::default(), BOB)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::Unauthenticated, "{e:?}");
    assert!(e.message().contains("too many failed authentications"), "{e:?}");
    assert_eq!(c.iam.st().authentications, n1);
    api.list_sandboxes(with_token(pb::ListSandboxesRequest::default(), ALICE)).await.unwrap();
    // Once the pause is over, bob's works too (refused as paused until then).
    let mut tries = 0;
    while let Err(e) = api.list_sandboxes(with_token(pb::ListSandboxesRequest::default(), BOB)).await {
        assert!(e.message().contains("too many failed authentications"), "{e:?}");
        tries += 1;
        assert!(tries < 500, "the pause never ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    c.stop().await;
}

/// Restore, the one large message, is decoded only for a root admin; any other Admin message
/// is cut at 1 MiB while it arrives (nothing reaches IAM); a principal's calls in flight are
/// capped, whatever the service.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_messages_are_bounded_and_calls_capped_per_principal() {
    let mut cfg = test_config();
    cfg.max_calls_per_principal = 2;
    let c = Cluster::start(&[("e1", Mode::Accept, 0)], cfg).await;
    let mut admin = AdminClient::new(grpc::channel(&c.api.to_string()).unwrap()).max_encoding_message_size(usize::MAX);
    let bearers = || c.iam.st().admin_calls;
    let n0 = bearers();
    let restore = pb::RestoreRequest { data: vec![7u8; 8 << 20] };
    let e = admin.restore(with_token(restore, ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::PermissionDenied, "{e:?}");
    assert!(e.message().contains("iam.admin"), "{e:?}");
    let big = pb::CreateProjectRequest { path: format!("root/a/{}", "x".repeat(2 << 20)), quota: None };
    let e = admin.create_project(with_token(big, ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::InvalidArgument, "{e:?}");
    assert!(e.message().contains("request larger than 1048576 bytes"), "{e:?}");
    // A small one still goes through to IAM (the fake answers not_found).
    let small = pb::CreateProjectRequest { path: "root/a/y".into(), quota: None };
    let e = admin.create_project(with_token(small, ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::NotFound, "{e:?}");
    admin.who_am_i(with_token(pb::WhoAmIRequest::default(), ALICE)).await.unwrap();
    assert_eq!(bearers() - n0, 2, "only the small calls reached IAM's Admin");

    // Two slow Runtime calls hold alice's two slots: her third call of any kind waits its
    // turn; bob's is served. An answered call lets go of its slot only once the server has
    // sent its last frame, a moment after the client has the answer: the held calls retry on
    // rate_limited as a client would.
    let mut api = c.client();
    let sb = api.create_sandbox(with_token(create_req(""), ALICE)).await.unwrap().into_inner();
    let slow: Vec<_> = (0..2)
        .map(|_| {
            let mut rt = c.runtime();
            let req = pb::ExecRequest { sandbox_id: sb.id.clone(), command: "hold".into(), ..Default::default() };
            tokio::spawn(async move {
                loop {
                    match rt.exec(with_token(req.clone(), ALICE)).await {
                        Err(e) if reason(&e) == Reason::RateLimited => {
                            tokio::time::sleep(Duration::from_millis(20)).await
                        }
                        other => return other,
                    }
                }
            })
        })
        .collect();
    until("both held calls reached the edge", WAIT, || c.edge("e1").calls("Exec") == 2).await;
    let e = api.list_sandboxes(with_token(pb::ListSandboxesRequest::default(), ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::RateLimited, "{e:?}");
    assert!(e.message().contains("2 calls in flight"), "{e:?}");
    api.list_sandboxes(with_token(pb::ListSandboxesRequest::default(), BOB)).await.unwrap();
    c.edge("e1").gate.add_permits(2);
    for t in slow {
        t.await.unwrap().unwrap();
    }
    api.list_sandboxes(with_token(pb::ListSandboxesRequest::default(), ALICE)).await.unwrap();
    c.stop().await;
}

/// One principal's Runtime calls in flight are capped; oversized HTTP answers are refused up
/// front.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn runtime_calls_are_capped_per_principal() {
    let mut cfg = test_config();
    cfg.max_runtime_calls_per_principal = 2;
    cfg.runtime_result_budget_mb = 40;
    let c = Cluster::start(&[("e1", Mode::Accept, 0)], cfg).await;
    let mut api = c.client();
    let sb = api.create_sandbox(with_token(create_req(""), ALICE)).await.unwrap().into_inner();
    let exec = |cmd: &str| pb::ExecRequest { sandbox_id: sb.id.clone(), command: cmd.into(), ..Default::default() };
    let slow: Vec<_> = (0..2)
        .map(|_| {
            let (mut rt, req) = (c.runtime(), exec("hold"));
            tokio::spawn(async move { rt.exec(with_token(req, ALICE)).await })
        })
        .collect();
    until("both held calls reached the edge", WAIT, || c.edge("e1").calls("Exec") == 2).await;
    let mut rt = c.runtime();
    let e = rt.exec(with_token(exec("true"), ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::RateLimited, "{e:?}");
    assert!(ApiError::from_status(&e).metadata.contains_key("retry_after_ms"));
    assert_eq!(c.edge("e1").calls("Exec"), 2, "the refused call never reached the edge");
    c.edge("e1").gate.add_permits(2);
    for t in slow {
        t.await.unwrap().unwrap();
    }
    // Many more calls than the old worst-case reservations allowed (40 MiB / 32 MiB each):
    // answers count by their real size.
    let many: Vec<_> = (0..2)
        .map(|_| {
            let (mut rt, req) = (c.runtime(), exec("sleep:100"));
            tokio::spawn(async move { rt.exec(with_token(req, ALICE)).await })
        })
        .collect();
    for t in many {
        t.await.unwrap().unwrap();
    }
    let http =
        pb::HttpRequestRequest { sandbox_id: sb.id.clone(), port: 80, max_body_bytes: 64 << 20, ..Default::default() };
    let e = rt.http_request(with_token(http, ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::InvalidArgument, "{e:?}");
    c.stop().await;
}

/// Starts a unary Exec over a bare HTTP/2 connection that never reads its answer (a window
/// of 64 KiB): the apiserver cannot send it, so the answer stays held.
async fn exec_never_read(
    api: SocketAddr,
    token: &str,
    req: pb::ExecRequest,
) -> (h2::client::SendRequest<bytes::Bytes>, http::Response<h2::RecvStream>) {
    use prost::Message;
    let tcp = tokio::net::TcpStream::connect(api).await.unwrap();
    let (send, conn) = h2::client::Builder::new().initial_window_size(65_535).handshake(tcp).await.unwrap();
    tokio::spawn(conn);
    let msg = req.encode_to_vec();
    let mut body = vec![0u8];
    body.extend_from_slice(&(msg.len() as u32).to_be_bytes());
    body.extend_from_slice(&msg);
    let request = http::Request::post(format!("http://{api}/opendsec.v1.Runtime/Exec"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("authorization", format!("Bearer {token}"))
        .body(())
        .unwrap();
    let (resp, mut stream) = send.clone().ready().await.unwrap().send_request(request, false).unwrap();
    stream.send_data(body.into(), true).unwrap();
    // The headers come; the body is left unread.
    let resp = resp.await.unwrap();
    assert_eq!(resp.status(), 200);
    (send, resp)
}

/// Unary answers count against the apiserver's result budget by their size, from when they
/// arrive until the caller has read them, and one principal holds at most its share: alice's
/// answer that she does not read holds her share, so her next large answer waits (it is not
/// refused), while bob's is served at once; when her connection goes, hers comes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_principal_that_does_not_read_its_answers_holds_only_its_share() {
    let mut cfg = test_config();
    cfg.runtime_result_budget_mb = 40;
    cfg.runtime_result_share_percent = 50;
    let c = Cluster::start(&[("e1", Mode::Accept, 0)], cfg).await;
    let mut api = c.client();
    let sa = api.create_sandbox(with_token(create_req(""), ALICE)).await.unwrap().into_inner();
    let mut req_b = create_req("");
    req_b.spec.as_mut().unwrap().project = "root/b".into();
    let sb = api.create_sandbox(with_token(req_b, BOB)).await.unwrap().into_inner();
    let big = |id: &str| pb::ExecRequest {
        sandbox_id: id.into(),
        command: format!("big:{}", 15 << 20),
        limits: Some(pb::OutputLimits { stdout_max_bytes: 16 << 20, stderr_max_bytes: 0 }),
        ..Default::default()
    };
    // Its headers came: the apiserver decoded the whole answer, so it holds its reservation.
    let held = exec_never_read(c.api, ALICE, big(&sa.id)).await;
    let mut rt = c.runtime().max_decoding_message_size(64 << 20);
    // Three more of hers wait for room, each leaving what its stream's window lets through
    // unread on the apiserver's one connection to the edge, which every tenant shares.
    let waiting: Vec<_> = (0..3)
        .map(|_| {
            let (mut rt, req) = (rt.clone(), big(&sa.id));
            tokio::spawn(async move { rt.exec(with_token(req, ALICE)).await })
        })
        .collect();
    // All three reached the edge and were answered there; none may come through while her
    // share is held (given a moment in which a wrong budget would let them pass).
    until("her three calls reached the edge", WAIT, || c.edge("e1").calls("Exec") == 4).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    if let Some(done) = waiting.iter().position(|w| w.is_finished()) {
        panic!("alice's answer {done} went past her share");
    }
    let r = tokio::time::timeout(Duration::from_secs(4), rt.exec(with_token(big(&sb.id), BOB))).await;
    assert_eq!(r.expect("bob waited for alice").unwrap().into_inner().stdout.len(), 15 << 20);
    drop(held);
    for w in waiting {
        let r = tokio::time::timeout(Duration::from_secs(10), w).await.expect("alice's answer never came");
        assert_eq!(r.unwrap().unwrap().into_inner().stdout.len(), 15 << 20);
    }
    // An answer that finds no room within the call timeout fails rather than waiting on.
    let held = exec_never_read(c.api, ALICE, big(&sa.id)).await;
    let e = rt.exec(with_token(big(&sa.id), ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::RateLimited, "{e:?}");
    assert!(e.message().contains("no room for this answer"), "{e:?}");
    drop(held);
    c.stop().await;
}

/// A unary call keeps its principal's slot until its answer has been read: answers left
/// unread use up the principal's calls in flight (and only theirs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unread_answers_hold_their_callers_slots() {
    let mut cfg = test_config();
    cfg.max_calls_per_principal = 2;
    let c = Cluster::start(&[("e1", Mode::Accept, 0)], cfg).await;
    let mut api = c.client();
    let sa = api.create_sandbox(with_token(create_req(""), ALICE)).await.unwrap().into_inner();
    let big = pb::ExecRequest {
        sandbox_id: sa.id.clone(),
        command: format!("big:{}", 4 << 20),
        limits: Some(pb::OutputLimits { stdout_max_bytes: 8 << 20, stderr_max_bytes: 0 }),
        ..Default::default()
    };
    // Their headers came: both calls are in flight until their answers are read.
    let unread = [exec_never_read(c.api, ALICE, big.clone()).await, exec_never_read(c.api, ALICE, big).await];
    let e = api.list_sandboxes(with_token(pb::ListSandboxesRequest::default(), ALICE)).await.unwrap_err();
    assert_eq!(reason(&e), Reason::RateLimited, "{e:?}");
    api.list_sandboxes(with_token(pb::ListSandboxesRequest::default(), BOB)).await.unwrap();
    drop(unread);
    // The connections close; the slots come back once the apiserver sees it.
    let mut tries = 0;
    while let Err(e) = api.list_sandboxes(with_token(pb::ListSandboxesRequest::default(), ALICE)).await {
        assert_eq!(reason(&e), Reason::RateLimited, "{e:?}");
        tries += 1;
        assert!(tries < 1000, "the slots never came back");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    c.stop().await;
}

/// Creation slots go round-robin between the principals waiting: a single creation of one
/// tenant is served while another tenant's large batch is still queued, instead of being
/// refused for the batch holding every slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_batch_does_not_starve_another_tenants_single_creation() {
    let mut cfg = test_config();
    cfg.max_inflight_creations = 2;
    cfg.batch_concurrency = 16;
    cfg.rate_per_principal = 100_000.0;
    cfg.burst_per_principal = 100_000.0;
    let c = Cluster::start(&[("e1", Mode::Accept, 0)], cfg).await;
    c.edge("e1").st.lock().unwrap().create_delay = Duration::from_millis(40);
    let mut api = c.client();
    let mut batch = api
        .create_sandboxes(with_token(
            pb::CreateSandboxesRequest { spec: Some(spec()), count: 40, patches: vec![] },
            ALICE,
        ))
        .await
        .unwrap()
        .into_inner();
    let first = batch.message().await.unwrap().unwrap();
    assert!(first.sandbox.is_some(), "{first:?}");
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(1));
    let d = done.clone();
    let drain = tokio::spawn(async move {
        while let Some(item) = batch.message().await.unwrap() {
            assert!(item.sandbox.is_some(), "{item:?}");
            d.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    let mut bob = c.client();
    let mut req = create_req("");
    req.spec.as_mut().unwrap().project = "root/b".into();
    let sb = bob.create_sandbox(with_token(req, BOB)).await.unwrap().into_inner();
    let at = done.load(std::sync::atomic::Ordering::SeqCst);
    assert!(sb.id.starts_with("e1."));
    assert!(at < 40, "bob's creation waited for the whole batch ({at} of 40 were done)");
    drain.await.unwrap();
    assert_eq!(done.load(std::sync::atomic::Ordering::SeqCst), 40);
    c.stop().await;
}

/// A sandbox of project `project` held by edge `holder` under id `id`, as edges list them.
fn held(id: &str, project: &str) -> pb::Sandbox {
    pb::Sandbox {
        id: id.into(),
        state: pb::SandboxState::Running as i32,
        spec: Some(pb::SandboxSpec { project: project.into(), ..Default::default() }),
        ..Default::default()
    }
}

/// A page of alice's listing.
async fn alice_page(c: &Cluster, token: String, page_size: u32) -> pb::ListSandboxesResponse {
    let req = pb::ListSandboxesRequest { page_size, page_token: token, ..Default::default() };
    c.client().list_sandboxes(with_token(req, ALICE)).await.unwrap().into_inner()
}

/// 24 edges, e00 to e23, taking every creation.
async fn twenty_four_edges() -> (Vec<String>, Cluster) {
    let names: Vec<String> = (0..24).map(|i| format!("e{i:02}")).collect();
    let edges: Vec<(&str, Mode, u32)> = names.iter().map(|n| (n.as_str(), Mode::Accept, 0)).collect();
    let c = Cluster::start(&edges, test_config()).await;
    (names, c)
}

/// Pages through 24 edges: every sandbox once and in id order, while others are created
/// between pages (those after the page token show up, none is repeated or skipped), a
/// sandbox that moved (its id names edge e03, edge e23 holds it) listed once, and a page asks
/// only the edges it needs, not every edge.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_walk_the_edges_in_id_order_and_skip_or_repeat_nothing() {
    let (names, c) = twenty_four_edges().await;
    let mut want = BTreeSet::new();
    for (i, e) in c.edges.iter().enumerate() {
        let mut st = e.st.lock().unwrap();
        for k in 0..(i % 4) * 3 {
            let id = format!("{}.l{k:03}", names[i]);
            st.sandboxes.insert(id.clone(), held(&id, "root/a"));
            want.insert(id);
        }
        // Another tenant's sandboxes are not listed.
        st.sandboxes.insert(format!("{}.zz", names[i]), held(&format!("{}.zz", names[i]), "root/b"));
    }
    // Moved sandboxes: one whose id falls in the first round's runs, one far past them (both
    // held by the last edge), and all of e09's, held by e00.
    let mut moved_in: BTreeMap<usize, Vec<String>> = BTreeMap::new();
    for (id, to) in [("e03.moved", 23), ("e17.moved", 23)] {
        moved_in.entry(to).or_default().push(id.to_string());
    }
    let e09: Vec<String> = std::mem::take(&mut c.edges[9].st.lock().unwrap().sandboxes)
        .into_keys()
        .filter(|id| !id.ends_with(".zz"))
        .collect();
    assert!(!e09.is_empty());
    moved_in.entry(0).or_default().extend(e09);
    for (to, ids) in &moved_in {
        for id in ids {
            c.edges[*to].st.lock().unwrap().sandboxes.insert(id.clone(), held(id, "root/a"));
            want.insert(id.clone());
        }
        c.snapshot_edges.lock().unwrap()[*to].status.as_mut().unwrap().moved_in = ids.clone();
    }
    tokio::time::sleep(Duration::from_millis(400)).await; // the apiserver's next snapshot

    let list = |token: String, page_size: u32| alice_page(&c, token, page_size);
    let lists = |c: &Cluster| c.edges.iter().map(|e| e.st.lock().unwrap().lists).sum::<usize>();
    // The first page needs the first runs and the edges holding moved sandboxes only.
    let before = lists(&c);
    let first = list(String::new(), 4).await;
    let asked = lists(&c) - before;
    assert!(asked <= 9, "a page of 4 asked {asked} of 24 edges");
    assert_eq!(first.sandboxes.len(), 4);

    let (mut got, mut token, mut added) = (Vec::new(), String::new(), 0);
    loop {
        let page = list(token.clone(), 4).await;
        got.extend(page.sandboxes.iter().map(|sb| sb.id.clone()));
        // Between pages, sandboxes come: one behind the token (not listed now: it sorts before
        // where the listing is), one ahead of it on another edge (listed when reached).
        if let Some(last) = page.sandboxes.last() {
            let (edge, _) = last.id.split_once('.').unwrap();
            let i: usize = edge[1..].parse().unwrap();
            let behind = format!("{edge}.a{added:03}");
            c.edges[i].st.lock().unwrap().sandboxes.insert(behind.clone(), held(&behind, "root/a"));
            if i + 2 < 24 {
                let ahead = format!("{}.n{added:03}", names[i + 2]);
                c.edges[i + 2].st.lock().unwrap().sandboxes.insert(ahead.clone(), held(&ahead, "root/a"));
                want.insert(ahead);
            }
            added += 1;
        }
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    let mut sorted = got.clone();
    sorted.sort();
    sorted.dedup();
    assert_eq!(got, sorted, "pages in id order, nothing twice");
    let got: BTreeSet<String> = got.into_iter().collect();
    let missing: Vec<&String> = want.difference(&got).collect();
    assert!(missing.is_empty(), "skipped: {missing:?}");
    let extra: Vec<&String> = got.difference(&want).collect();
    assert!(extra.is_empty(), "listed though behind the page token when made: {extra:?}");
    assert!(added > 10, "{added}");

    // Again, a sandbox a page, nothing changing: exactly what the edges hold, in order.
    let held_now: Vec<String> = c
        .edges
        .iter()
        .flat_map(|e| {
            e.st.lock().unwrap().sandboxes.keys().filter(|id| !id.ends_with(".zz")).cloned().collect::<Vec<_>>()
        })
        .collect::<BTreeSet<_>>()
        .into_iter()
        .collect();
    let (mut again, mut token) = (Vec::new(), String::new());
    loop {
        let page = list(token, 1).await;
        assert!(page.sandboxes.len() == 1 || page.next_page_token.is_empty(), "a short page mid-listing: {page:?}");
        again.extend(page.sandboxes.into_iter().map(|sb| sb.id));
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    assert_eq!(again, held_now);
}

/// A sandbox moved (its id names edge e03; edge e20 holds it) where the snapshot does not know
/// yet (the move went through another apiserver less than a probe ago): e03 tells that it
/// moved away and where to, and the page asks e20 too, so it is listed, once, in id order,
/// though e20's own run is far past the page. An edge that met more moved-away sandboxes than
/// it tells cuts the page there, and the next page goes on from the cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_finds_a_sandbox_moved_where_the_snapshot_does_not_know() {
    let (names, c) = twenty_four_edges().await;
    let mut want = Vec::new();
    for i in [3usize, 4] {
        let mut st = c.edges[i].st.lock().unwrap();
        for k in 0..3 {
            let id = format!("{}.l{k}", names[i]);
            st.sandboxes.insert(id.clone(), held(&id, "root/a"));
            want.push(id);
        }
    }
    let moved = "e03.l1m".to_string();
    c.edges[20].st.lock().unwrap().sandboxes.insert(moved.clone(), held(&moved, "root/a"));
    c.edges[3].st.lock().unwrap().moved_away.insert(moved.clone(), "e20".into());
    want.push(moved.clone());
    want.sort();
    tokio::time::sleep(Duration::from_millis(400)).await; // the apiserver's snapshot

    let list = |token: String, page_size: u32| alice_page(&c, token, page_size);
    let walk = |page_size: u32| async move {
        let (mut got, mut token, mut pages) = (Vec::new(), String::new(), 0);
        loop {
            let page = list(token, page_size).await;
            got.extend(page.sandboxes.into_iter().map(|sb| sb.id));
            pages += 1;
            if page.next_page_token.is_empty() {
                return (got, pages);
            }
            token = page.next_page_token;
        }
    };
    let first = list(String::new(), 4).await;
    let ids: Vec<&str> = first.sandboxes.iter().map(|sb| sb.id.as_str()).collect();
    assert_eq!(ids, ["e03.l0", "e03.l1", "e03.l1m", "e03.l2"], "e20's run was not reached, its copy was");
    assert_eq!(walk(4).await.0, want);
    assert_eq!(walk(1).await.0, want);

    // More moved away from e04 than a page's limit: e04 stops telling at its limit, and the
    // page is cut there; every page goes on from its cut, and nothing is skipped.
    // The first ones told went to e21 and ended there (not listed); the rest went to e22, which
    // the page learns of only from the next report.
    for k in 0..12 {
        let id = format!("e04.l0m{k:02}");
        let to = if k < 4 { 21 } else { 22 };
        c.edges[4].st.lock().unwrap().moved_away.insert(id.clone(), names[to].clone());
        if to == 22 {
            c.edges[to].st.lock().unwrap().sandboxes.insert(id.clone(), held(&id, "root/a"));
            want.push(id);
        }
    }
    want.sort();
    let (got, pages) = walk(3).await;
    assert_eq!(got, want);
    assert!(pages >= want.len() / 3, "{pages} pages");

    // A sandbox that keeps moving while a page is listed (each edge it went to says it moved
    // on) fails the page, to be asked again, rather than be skipped.
    let hops = [3usize, 10, 11, 12, 13, 14, 15];
    for w in hops.windows(2) {
        c.edges[w[0]].st.lock().unwrap().moved_away.insert("e03.l0x".into(), names[w[1]].clone());
    }
    let req = pb::ListSandboxesRequest { page_size: 3, ..Default::default() };
    let e = c.client().list_sandboxes(with_token(req, ALICE)).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains("moved again and again"), "{e:?}");
    c.stop().await;
}
