//! The gRPC layer: `Iam` (internal: apiservers, watchers, edges) and `Admin` (proxied by
//! apiservers with the caller's bearer token). Both are served over mTLS behind the role table
//! of `opendsec_common::acl`; an edge releases only leases bound to itself.
//!
//! This module only translates between protobuf and [`crate::Iam`]; every decision is made
//! in the state machine or the read side, and every error is classified once by
//! [`crate::to_api`].

use opendsec_common::grpc::{self, MAX_MESSAGE_BYTES};
use opendsec_common::pki::Role;
use opendsec_proto::v1 as pb;
use pb::admin_server::{Admin, AdminServer};
use pb::iam_server::{Iam as IamRpc, IamServer};
use tonic::{Request, Response, Status};

use crate::error::{IamError, to_api};
use crate::model::ProjectView;
use crate::model::{GrantRecord, LeaseRecord, PrincipalRecord, Quota, Resources, TokenRecord, Usage};
use crate::query::Authenticated;
use crate::{Iam, LiveLease};

pub type IamGrpc = IamServer<IamService>;
pub type AdminGrpc = AdminServer<AdminService>;

pub(crate) fn iam_grpc(iam: Iam) -> IamGrpc {
    IamServer::new(IamService { iam })
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

pub(crate) fn admin_grpc(iam: Iam) -> AdminGrpc {
    AdminServer::new(AdminService { iam })
        .max_decoding_message_size(MAX_MESSAGE_BYTES)
        .max_encoding_message_size(MAX_MESSAGE_BYTES)
}

fn status(e: IamError) -> Status {
    to_api(&e).to_status()
}

type Rpc<T> = Result<Response<T>, Status>;

fn ok<T>(v: T) -> Rpc<T> {
    Ok(Response::new(v))
}

async fn admit(iam: &Iam, r: pb::AdmitRequest) -> Result<pb::AdmitResponse, IamError> {
    let res = r
        .resources
        .as_ref()
        .map(resources_from_pb)
        .ok_or_else(|| IamError::InvalidArgument("resources are required".into()))?;
    let egress = rule_texts(&r.egress);
    let a = iam.admit(&r.token, &r.lease_id, &r.project, res, &r.edge, r.keep_existing, egress, &r.pool).await?;
    Ok(pb::AdmitResponse {
        principal: a.principal,
        rebound: a.rebound,
        existing: a.existing,
        edge: a.edge,
        bound_at_ms: a.bound_at_ms,
        member_lease: a.member_lease,
    })
}

// ----- conversions -----

pub fn quota_from_pb(q: Option<pb::Quota>) -> Quota {
    let q = q.unwrap_or_default();
    Quota {
        cpu_millis: q.cpu_millis,
        memory_mb: q.memory_mb,
        disk_mb: q.disk_mb,
        gpus: q.gpus,
        sandboxes: q.sandboxes,
        store_bytes: q.store_bytes,
    }
}

pub fn quota_to_pb(q: &Quota) -> pb::Quota {
    pb::Quota {
        cpu_millis: q.cpu_millis,
        memory_mb: q.memory_mb,
        disk_mb: q.disk_mb,
        gpus: q.gpus,
        sandboxes: q.sandboxes,
        store_bytes: q.store_bytes,
    }
}

pub fn usage_to_pb(u: &Usage) -> pb::Usage {
    pb::Usage {
        cpu_millis: u.cpu_millis,
        memory_mb: u.memory_mb,
        disk_mb: u.disk_mb,
        gpus: u.gpus,
        sandboxes: u.sandboxes,
        store_bytes: u.store_bytes,
    }
}

pub fn resources_from_pb(r: &pb::Resources) -> Resources {
    Resources {
        cpu_millis: u64::from(r.cpu_millis),
        memory_mb: r.memory_mb,
        disk_mb: r.disk_mb,
        gpus: u64::from(r.gpus),
    }
}

/// Lease resources always came through `resources_from_pb`, so they fit the proto's u32s;
/// saturate rather than wrap if that ever stops holding.
pub fn resources_to_pb(r: &Resources) -> pb::Resources {
    pb::Resources {
        cpu_millis: u32::try_from(r.cpu_millis).unwrap_or(u32::MAX),
        memory_mb: r.memory_mb,
        disk_mb: r.disk_mb,
        gpus: u32::try_from(r.gpus).unwrap_or(u32::MAX),
    }
}

/// A pool from a request: the template as IAM keeps it (env sorted, egress as text).
pub fn pool_from_pb(p: Option<pb::Pool>) -> Result<crate::model::PoolRecord, Status> {
    let p = p.ok_or_else(|| opendsec_common::ApiError::invalid("pool is required").to_status())?;
    Ok(crate::model::PoolRecord {
        template: opendsec_common::pool::PoolTemplate::from_pb(&p.template.unwrap_or_default()),
        project: p.project,
        name: p.name,
        size_per_edge: p.size_per_edge,
        created_at_ms: 0,
        updated_at_ms: 0,
    })
}

pub fn pool_to_pb(p: &crate::model::PoolRecord) -> pb::Pool {
    let t = &p.template;
    pb::Pool {
        project: p.project.clone(),
        name: p.name.clone(),
        template: Some(pb::PoolTemplate {
            image: t.image.clone(),
            backend: t.backend.clone(),
            resources: Some(pb::Resources {
                cpu_millis: t.cpu_millis,
                memory_mb: t.memory_mb,
                disk_mb: t.disk_mb,
                gpus: 0,
            }),
            env: t.env.clone().into_iter().collect(),
            egress: t.egress.clone(),
            user: t.user.clone(),
            workdir: t.workdir.clone(),
        }),
        size_per_edge: p.size_per_edge,
        revision: p.template.revision(),
        created_at_ms: p.created_at_ms,
        updated_at_ms: p.updated_at_ms,
        edges: Vec::new(),
    }
}

pub fn project_to_pb(v: &ProjectView) -> pb::Project {
    pb::Project {
        path: v.path.clone(),
        quota: Some(quota_to_pb(&v.quota)),
        effective: Some(quota_to_pb(&v.effective)),
        usage: Some(usage_to_pb(&v.usage)),
        created_at_ms: v.created_at_ms,
        egress_ceiling: v.egress_ceiling.as_ref().map(|c| pb::EgressCeiling {
            allow: c.iter().filter_map(|t| opendsec_common::egress::Rule::parse(t).ok()).map(|r| r.to_pb()).collect(),
        }),
    }
}

/// Egress rules from the wire in their text form (the state machine checks them).
fn rule_texts(rules: &[pb::EgressRule]) -> Vec<String> {
    rules.iter().map(opendsec_common::egress::pb_text).collect()
}

pub fn principal_to_pb(p: &PrincipalRecord) -> pb::Principal {
    pb::Principal { name: p.name.clone(), project: p.project.clone(), created_at_ms: p.created_at_ms }
}

pub fn token_to_pb(t: &TokenRecord) -> pb::TokenInfo {
    pb::TokenInfo {
        id: t.id.clone(),
        principal: t.principal.clone(),
        description: t.description.clone(),
        created_at_ms: t.created_at_ms,
        expires_at_ms: t.expires_at_ms,
        revoked: t.revoked,
    }
}

pub fn grant_to_pb(g: &GrantRecord) -> pb::Grant {
    pb::Grant { principal: g.principal.clone(), project: g.project.clone(), permission: g.permission.clone() }
}

fn grant_from_pb(g: Option<pb::Grant>) -> Result<GrantRecord, Status> {
    let g = g.ok_or_else(|| status(IamError::InvalidArgument("grant is required".into())))?;
    Ok(GrantRecord { principal: g.principal, project: g.project, permission: g.permission })
}

fn members_to_pb(m: crate::raft::Members) -> pb::IamMembersResponse {
    pb::IamMembersResponse {
        members: m
            .members
            .into_iter()
            .map(|m| pb::IamMember {
                id: m.id,
                address: m.address,
                voter: m.voter,
                leader: m.leader,
                matched_index: m.matched_index,
                data_dir: m.data_dir,
            })
            .collect(),
        term: m.term,
        committed_index: m.committed_index,
        replicated: true,
    }
}

pub fn lease_to_pb(l: &LeaseRecord) -> pb::Lease {
    pb::Lease {
        id: l.id.clone(),
        project: l.project.clone(),
        principal: l.principal.clone(),
        edge: l.edge.clone(),
        resources: Some(resources_to_pb(&l.resources)),
        created_at_ms: l.created_at_ms,
        bound_at_ms: l.bound_at_ms,
    }
}

/// [`lease_to_pb`] for an owned record (moves its strings instead of copying them).
pub fn lease_into_pb(l: LeaseRecord) -> pb::Lease {
    pb::Lease {
        resources: Some(resources_to_pb(&l.resources)),
        id: l.id,
        project: l.project,
        principal: l.principal,
        edge: l.edge,
        created_at_ms: l.created_at_ms,
        bound_at_ms: l.bound_at_ms,
    }
}

// ----- Iam -----

#[derive(Debug)]
pub struct IamService {
    iam: Iam,
}

#[tonic::async_trait]
impl IamRpc for IamService {
    async fn authenticate(&self, req: Request<pb::AuthenticateRequest>) -> Rpc<pb::AuthenticateResponse> {
        let a = self.iam.authenticate_scoped(&req.get_ref().token).map_err(status)?;
        let (scope_lease, scope_kind) = match a.scope {
            Some(s) => {
                let kind = match s.kind {
                    crate::model::ScopeKind::Runtime => pb::SandboxTokenKind::Runtime,
                    crate::model::ScopeKind::Traffic => pb::SandboxTokenKind::Traffic,
                };
                (s.lease, kind as i32)
            }
            None => (String::new(), pb::SandboxTokenKind::Unspecified as i32),
        };
        ok(pb::AuthenticateResponse {
            principal: a.principal,
            project: a.project,
            token_id: a.token_id,
            expires_at_ms: a.expires_at_ms,
            scope_lease,
            scope_kind,
        })
    }

    async fn charge_image(&self, req: Request<pb::ChargeImageRequest>) -> Rpc<pb::ChargeImageResponse> {
        let r = req.into_inner();
        let parts = r.parts.into_iter().map(|p| crate::model::StoredPart { id: p.id, bytes: p.bytes }).collect();
        let charge = crate::model::ImageCharge { project: r.project, name: r.name, parts };
        self.iam.charge_image(charge).await.map_err(status)?;
        ok(pb::ChargeImageResponse {})
    }

    async fn store_room(&self, req: Request<pb::StoreRoomRequest>) -> Rpc<pb::ChargeImageResponse> {
        let r = req.get_ref();
        self.iam.store_room(&r.project, r.bytes).map_err(status)?;
        ok(pb::ChargeImageResponse {})
    }

    async fn uncharge_image(&self, req: Request<pb::UnchargeImageRequest>) -> Rpc<pb::ChargeImageResponse> {
        let r = req.get_ref();
        self.iam.uncharge_image(&r.project, &r.name).await.map_err(status)?;
        ok(pb::ChargeImageResponse {})
    }

    async fn mint_sandbox_tokens(&self, req: Request<pb::MintSandboxTokensRequest>) -> Rpc<pb::SandboxTokens> {
        let r = req.get_ref();
        let (runtime_token, traffic_token) =
            self.iam.mint_sandbox_tokens(&r.token, &r.lease_id).await.map_err(status)?;
        ok(pb::SandboxTokens { runtime_token, traffic_token })
    }

    async fn authorize(&self, req: Request<pb::AuthorizeRequest>) -> Rpc<pb::AuthorizeResponse> {
        let r = req.get_ref();
        let allowed = self.iam.authorize(&r.principal, &r.permission, &r.project).map_err(status)?;
        ok(pb::AuthorizeResponse { allowed })
    }

    async fn admit(&self, req: Request<pb::AdmitRequest>) -> Rpc<pb::AdmitResponse> {
        ok(admit(&self.iam, req.into_inner()).await.map_err(status)?)
    }

    async fn admit_many(&self, req: Request<pb::AdmitManyRequest>) -> Rpc<pb::AdmitManyResponse> {
        let items = req.into_inner().items;
        if items.len() > crate::MAX_ADMIT_MANY {
            return Err(status(IamError::InvalidArgument(format!(
                "{} admissions in one call; at most {}",
                items.len(),
                crate::MAX_ADMIT_MANY
            ))));
        }
        // Each on its own, all at once: the commands they make are committed together.
        let results = futures::future::join_all(items.into_iter().map(|r| admit(&self.iam, r))).await;
        let results = results
            .into_iter()
            .map(|r| match r {
                Ok(a) => pb::AdmitResult { admitted: Some(a), error: None },
                Err(e) => pb::AdmitResult { admitted: None, error: Some(to_api(&e).to_detail()) },
            })
            .collect();
        ok(pb::AdmitManyResponse { results })
    }

    async fn check_egress(&self, req: Request<pb::CheckEgressRequest>) -> Rpc<pb::CheckEgressResponse> {
        let r = req.get_ref();
        self.iam.check_egress(&r.project, &rule_texts(&r.egress)).map_err(status)?;
        ok(pb::CheckEgressResponse {})
    }

    async fn release_leases(&self, req: Request<pb::ReleaseLeasesRequest>) -> Rpc<pb::ReleaseLeasesResponse> {
        // An edge releases leases bound to itself only (an empty edge would mean "wherever").
        opendsec_common::acl::require_self(&req, Role::Edge, &req.get_ref().edge, &[Role::Apiserver])
            .map_err(|e| e.to_status())?;
        let r = req.into_inner();
        let released = self.iam.release_leases(r.lease_ids, &r.edge).await.map_err(status)?;
        ok(pb::ReleaseLeasesResponse { released })
    }

    async fn admit_member(&self, req: Request<pb::AdmitMemberRequest>) -> Rpc<pb::ChargeImageResponse> {
        // An edge charges members on itself only.
        opendsec_common::acl::require_self(&req, Role::Edge, &req.get_ref().edge, &[]).map_err(|e| e.to_status())?;
        let r = req.into_inner();
        let res = r
            .resources
            .as_ref()
            .map(resources_from_pb)
            .ok_or_else(|| IamError::InvalidArgument("resources are required".into()))
            .map_err(status)?;
        self.iam.admit_member(&r.edge, &r.lease_id, &r.project, &r.pool, res).await.map_err(status)?;
        ok(pb::ChargeImageResponse {})
    }

    async fn get_lease(&self, req: Request<pb::GetLeaseRequest>) -> Rpc<pb::GetLeaseResponse> {
        let lease = self.iam.get_lease(&req.get_ref().lease_id).map_err(status)?;
        ok(pb::GetLeaseResponse { found: lease.is_some(), lease: lease.as_ref().map(lease_to_pb) })
    }

    async fn get_leases(&self, req: Request<pb::GetLeasesRequest>) -> Rpc<pb::GetLeasesResponse> {
        // An edge learns only where each lease is bound (what it asks for: whether its
        // sandboxes' leases are still its own), never whose or how large another's are.
        let edge = opendsec_common::acl::peer(&req).is_some_and(|p| p.role == Role::Edge);
        let leases = self.iam.get_leases(&req.get_ref().lease_ids).map_err(status)?;
        let leases = leases.into_iter().map(lease_into_pb);
        let leases = if edge {
            leases.map(|l| pb::Lease { id: l.id, edge: l.edge, ..Default::default() }).collect()
        } else {
            leases.collect()
        };
        ok(pb::GetLeasesResponse { leases })
    }

    async fn reconcile(&self, req: Request<pb::ReconcileRequest>) -> Rpc<pb::ReconcileResponse> {
        let r = req.into_inner();
        let live = r
            .live
            .into_iter()
            .map(|l| LiveLease {
                resources: l.resources.as_ref().map(resources_from_pb).unwrap_or_default(),
                lease_id: l.lease_id,
                project: l.project,
                principal: l.principal,
                pool: l.pool,
            })
            .collect();
        let (adopted, released) = self.iam.reconcile(&r.edge, &r.holder, r.read_at_ms, live).await.map_err(status)?;
        ok(pb::ReconcileResponse { adopted, released })
    }

    async fn sweep_unbound(&self, req: Request<pb::SweepUnboundRequest>) -> Rpc<pb::SweepUnboundResponse> {
        let r = req.into_inner();
        let released = self.iam.sweep_unbound(r.known_edges, r.older_than_s, &r.holder).await.map_err(status)?;
        ok(pb::SweepUnboundResponse { released })
    }

    async fn get_epoch(&self, req: Request<pb::GetEpochRequest>) -> Rpc<pb::GetEpochResponse> {
        use crate::state::Revoked;
        use pb::revocation::What;
        let (epoch, revoked) = self.iam.epoch_since(req.get_ref().since);
        // Past this many, the answer says "clear everything" rather than grow without bound.
        const MAX_REVOCATIONS_ANSWERED: usize = 4096;
        let revoked = revoked.filter(|r| r.len() <= MAX_REVOCATIONS_ANSWERED);
        let complete = revoked.is_some();
        let revoked = revoked
            .unwrap_or_default()
            .into_iter()
            .map(|r| pb::Revocation {
                what: Some(match r {
                    Revoked::Token(id) => What::TokenId(id),
                    Revoked::Principal(p) => What::Principal(p),
                    Revoked::Project(p) => What::Project(p),
                }),
            })
            .collect();
        ok(pb::GetEpochResponse { epoch, complete, revoked })
    }

    async fn acquire_lock(&self, req: Request<pb::AcquireLockRequest>) -> Rpc<pb::AcquireLockResponse> {
        let r = req.get_ref();
        let (acquired, holder, expires_at_ms) =
            self.iam.acquire_lock(&r.name, &r.holder, r.ttl_ms).await.map_err(status)?;
        ok(pb::AcquireLockResponse { acquired, holder, expires_at_ms })
    }

    async fn resolve_pool(&self, req: Request<pb::ResolvePoolRequest>) -> Rpc<pb::Pool> {
        let r = req.get_ref();
        let p = self.iam.resolve_pool(&r.principal, &r.project, &r.name).map_err(status)?;
        ok(pool_to_pb(&p))
    }

    async fn list_all_pools(&self, _req: Request<pb::ListAllPoolsRequest>) -> Rpc<pb::ListPoolsResponse> {
        ok(pb::ListPoolsResponse { pools: self.iam.all_pools().iter().map(pool_to_pb).collect() })
    }
}

// ----- Admin -----

#[derive(Debug)]
pub struct AdminService {
    iam: Iam,
}

impl AdminService {
    /// The caller, from its `authorization: Bearer` token.
    fn caller<T>(&self, req: &Request<T>) -> Result<Authenticated, Status> {
        let token = grpc::bearer(req.metadata()).map_err(|e| e.to_status())?;
        self.iam.authenticate(token).map_err(status)
    }
}

#[tonic::async_trait]
impl Admin for AdminService {
    async fn who_am_i(&self, req: Request<pb::WhoAmIRequest>) -> Rpc<pb::WhoAmIResponse> {
        let who = self.caller(&req)?;
        let grants = self.iam.read(|s| s.grants_of(&who.principal));
        ok(pb::WhoAmIResponse {
            grants: grants.iter().map(grant_to_pb).collect(),
            principal: who.principal,
            project: who.project,
            token_id: who.token_id,
            token_expires_at_ms: who.expires_at_ms,
        })
    }

    async fn create_project(&self, req: Request<pb::CreateProjectRequest>) -> Rpc<pb::Project> {
        let who = self.caller(&req)?;
        let r = req.into_inner();
        let v = self.iam.create_project(&who, &r.path, quota_from_pb(r.quota)).await.map_err(status)?;
        ok(project_to_pb(&v))
    }

    async fn get_project(&self, req: Request<pb::GetProjectRequest>) -> Rpc<pb::Project> {
        let who = self.caller(&req)?;
        let v = self.iam.get_project(&who, &req.get_ref().path).map_err(status)?;
        ok(project_to_pb(&v))
    }

    async fn list_projects(&self, req: Request<pb::ListProjectsRequest>) -> Rpc<pb::ListProjectsResponse> {
        let who = self.caller(&req)?;
        let v = self.iam.list_projects(&who, &req.get_ref().path).map_err(status)?;
        ok(pb::ListProjectsResponse { projects: v.iter().map(project_to_pb).collect() })
    }

    async fn delete_project(&self, req: Request<pb::DeleteProjectRequest>) -> Rpc<pb::DeleteProjectResponse> {
        let who = self.caller(&req)?;
        self.iam.delete_project(&who, &req.get_ref().path).await.map_err(status)?;
        ok(pb::DeleteProjectResponse {})
    }

    async fn set_quota(&self, req: Request<pb::SetQuotaRequest>) -> Rpc<pb::Project> {
        let who = self.caller(&req)?;
        let r = req.into_inner();
        let v = self.iam.set_quota(&who, &r.path, quota_from_pb(r.quota)).await.map_err(status)?;
        ok(project_to_pb(&v))
    }

    async fn set_egress_ceiling(&self, req: Request<pb::SetEgressCeilingRequest>) -> Rpc<pb::Project> {
        let who = self.caller(&req)?;
        let r = req.into_inner();
        let ceiling = r.ceiling.map(|c| rule_texts(&c.allow));
        let v = self.iam.set_egress_ceiling(&who, &r.path, ceiling).await.map_err(status)?;
        ok(project_to_pb(&v))
    }

    async fn create_principal(&self, req: Request<pb::CreatePrincipalRequest>) -> Rpc<pb::Principal> {
        let who = self.caller(&req)?;
        let r = req.get_ref();
        let p = self.iam.create_principal(&who, &r.name, &r.project).await.map_err(status)?;
        ok(principal_to_pb(&p))
    }

    async fn list_principals(&self, req: Request<pb::ListPrincipalsRequest>) -> Rpc<pb::ListPrincipalsResponse> {
        let who = self.caller(&req)?;
        let v = self.iam.list_principals(&who, &req.get_ref().project).map_err(status)?;
        ok(pb::ListPrincipalsResponse { principals: v.iter().map(principal_to_pb).collect() })
    }

    async fn delete_principal(&self, req: Request<pb::DeletePrincipalRequest>) -> Rpc<pb::DeletePrincipalResponse> {
        let who = self.caller(&req)?;
        self.iam.delete_principal(&who, &req.get_ref().name).await.map_err(status)?;
        ok(pb::DeletePrincipalResponse {})
    }

    async fn create_token(&self, req: Request<pb::CreateTokenRequest>) -> Rpc<pb::CreateTokenResponse> {
        let who = self.caller(&req)?;
        let r = req.get_ref();
        let (token, info) = self.iam.create_token(&who, &r.principal, r.ttl_s, &r.description).await.map_err(status)?;
        ok(pb::CreateTokenResponse { token, info: Some(token_to_pb(&info)) })
    }

    async fn list_tokens(&self, req: Request<pb::ListTokensRequest>) -> Rpc<pb::ListTokensResponse> {
        let who = self.caller(&req)?;
        let v = self.iam.list_tokens(&who, &req.get_ref().principal).map_err(status)?;
        ok(pb::ListTokensResponse { tokens: v.iter().map(token_to_pb).collect() })
    }

    async fn revoke_token(&self, req: Request<pb::RevokeTokenRequest>) -> Rpc<pb::RevokeTokenResponse> {
        let who = self.caller(&req)?;
        self.iam.revoke_token(&who, &req.get_ref().id).await.map_err(status)?;
        ok(pb::RevokeTokenResponse {})
    }

    async fn grant(&self, req: Request<pb::GrantRequest>) -> Rpc<pb::GrantResponse> {
        let who = self.caller(&req)?;
        let g = grant_from_pb(req.into_inner().grant)?;
        self.iam.grant(&who, g).await.map_err(status)?;
        ok(pb::GrantResponse {})
    }

    async fn revoke_grant(&self, req: Request<pb::RevokeGrantRequest>) -> Rpc<pb::RevokeGrantResponse> {
        let who = self.caller(&req)?;
        let g = grant_from_pb(req.into_inner().grant)?;
        self.iam.revoke_grant(&who, g).await.map_err(status)?;
        ok(pb::RevokeGrantResponse {})
    }

    async fn list_grants(&self, req: Request<pb::ListGrantsRequest>) -> Rpc<pb::ListGrantsResponse> {
        let who = self.caller(&req)?;
        let r = req.get_ref();
        let v = self.iam.list_grants(&who, &r.principal, &r.project).map_err(status)?;
        ok(pb::ListGrantsResponse { grants: v.iter().map(grant_to_pb).collect() })
    }

    async fn get_usage(&self, req: Request<pb::GetUsageRequest>) -> Rpc<pb::GetUsageResponse> {
        let who = self.caller(&req)?;
        let v = self.iam.list_projects(&who, &req.get_ref().project).map_err(status)?;
        ok(pb::GetUsageResponse { projects: v.iter().map(project_to_pb).collect() })
    }

    async fn backup(&self, req: Request<pb::BackupRequest>) -> Rpc<pb::BackupResponse> {
        let who = self.caller(&req)?;
        let data = self.iam.backup(&who).map_err(status)?;
        ok(pb::BackupResponse { data })
    }

    async fn restore(&self, req: Request<pb::RestoreRequest>) -> Rpc<pb::RestoreResponse> {
        let who = self.caller(&req)?;
        self.iam.restore(&who, &req.get_ref().data).await.map_err(status)?;
        ok(pb::RestoreResponse {})
    }

    async fn iam_members(&self, req: Request<pb::IamMembersRequest>) -> Rpc<pb::IamMembersResponse> {
        let who = self.caller(&req)?;
        match self.iam.members(&who).map_err(status)? {
            Some(m) => ok(members_to_pb(m)),
            None => ok(pb::IamMembersResponse {
                members: vec![pb::IamMember { id: 1, voter: true, leader: true, ..Default::default() }],
                replicated: false,
                ..Default::default()
            }),
        }
    }

    async fn add_iam_member(&self, req: Request<pb::AddIamMemberRequest>) -> Rpc<pb::IamMembersResponse> {
        let who = self.caller(&req)?;
        let r = req.into_inner();
        ok(members_to_pb(self.iam.add_member(&who, r.id, &r.address, r.learner_only).await.map_err(status)?))
    }

    async fn remove_iam_member(&self, req: Request<pb::RemoveIamMemberRequest>) -> Rpc<pb::IamMembersResponse> {
        let who = self.caller(&req)?;
        ok(members_to_pb(self.iam.remove_member(&who, req.get_ref().id).await.map_err(status)?))
    }

    async fn transfer_iam_leader(&self, req: Request<pb::TransferIamLeaderRequest>) -> Rpc<pb::IamMembersResponse> {
        let who = self.caller(&req)?;
        ok(members_to_pb(self.iam.transfer_leader(&who, req.get_ref().to).await.map_err(status)?))
    }

    async fn create_pool(&self, req: Request<pb::CreatePoolRequest>) -> Rpc<pb::Pool> {
        let who = self.caller(&req)?;
        let p = pool_from_pb(req.into_inner().pool)?;
        ok(pool_to_pb(&self.iam.put_pool(&who, p, true).await.map_err(status)?))
    }

    async fn update_pool(&self, req: Request<pb::UpdatePoolRequest>) -> Rpc<pb::Pool> {
        let who = self.caller(&req)?;
        let p = pool_from_pb(req.into_inner().pool)?;
        ok(pool_to_pb(&self.iam.put_pool(&who, p, false).await.map_err(status)?))
    }

    async fn delete_pool(&self, req: Request<pb::DeletePoolRequest>) -> Rpc<pb::DeletePoolResponse> {
        let who = self.caller(&req)?;
        let r = req.get_ref();
        self.iam.delete_pool(&who, &r.project, &r.name).await.map_err(status)?;
        ok(pb::DeletePoolResponse {})
    }

    async fn get_pool(&self, req: Request<pb::GetPoolRequest>) -> Rpc<pb::Pool> {
        let who = self.caller(&req)?;
        let r = req.get_ref();
        ok(pool_to_pb(&self.iam.get_pool(&who, &r.project, &r.name).map_err(status)?))
    }

    async fn list_pools(&self, req: Request<pb::ListPoolsRequest>) -> Rpc<pb::ListPoolsResponse> {
        let who = self.caller(&req)?;
        let v = self.iam.list_pools(&who, &req.get_ref().project).map_err(status)?;
        ok(pb::ListPoolsResponse { pools: v.iter().map(pool_to_pb).collect() })
    }
}
