//! The public `Admin` service: a proxy to IAM's `Admin` with the caller's own bearer token.
//!
//! IAM authenticates and authorizes every Admin call itself, so the apiserver neither checks
//! nor caches anything here; it forwards the message with the caller's `authorization` header
//! (and the service token on the channel) and returns IAM's answer or status as it is. The audit
//! line names the principal only when the token is already in the authentication cache (asking
//! IAM just for the audit line would double the cost of every Admin call).

use std::sync::Arc;

use futures::FutureExt;
use futures::future::BoxFuture;
use opendsec_common::grpc;
use opendsec_common::{ApiError, Reason, ids};
use opendsec_proto::v1 as pb;
use opendsec_proto::v1::admin_client::AdminClient;
use opendsec_proto::v1::admin_server::Admin;
use tonic::transport::Channel as ServiceChannel;
use tonic::{Request, Response, Status};

use crate::auth::token_key;
use crate::state::{Call, Shared};

pub struct AdminProxy {
    shared: Arc<Shared>,
}

impl AdminProxy {
    pub fn new(shared: Arc<Shared>) -> Self {
        AdminProxy { shared }
    }
}

/// What the apiserver does around an Admin call besides forwarding it: only a project's
/// deletion touches what the apiserver holds (the project's images and layer records).
trait Around {
    /// The project this call deletes.
    fn deletes_project(&self) -> Option<&str> {
        None
    }
}

impl Around for pb::DeleteProjectRequest {
    fn deletes_project(&self) -> Option<&str> {
        Some(&self.path)
    }
}

/// Refuses the deletion of project `path` by the token's principal when IAM would (it may not
/// manage the project: `project.manage` on its parent), or when the project holds images.
async fn may_delete_empty(shared: &Shared, token: &str, path: &str) -> Result<(), ApiError> {
    let Some(parent) = ids::parent_project(path).filter(|_| ids::validate_project(path).is_ok()) else {
        return Ok(()); // IAM answers for root and malformed paths.
    };
    let who = shared.authenticate(token).await?;
    shared.authorize(&who.principal, "project.manage", parent).await?;
    shared.images.check_empty(path).await
}

/// What the apiserver adds to an Admin answer: a pool's state on the edges, from its cluster
/// snapshot (IAM stores pools; only the edges know their members).
trait Decorate {
    fn decorate(&mut self, _shared: &Shared) {}
}

macro_rules! as_answered {
    ($($resp:ty),* $(,)?) => {
        $(impl Decorate for $resp {})*
    };
}

as_answered!(
    pb::WhoAmIResponse,
    pb::Project,
    pb::ListProjectsResponse,
    pb::DeleteProjectResponse,
    pb::Principal,
    pb::ListPrincipalsResponse,
    pb::DeletePrincipalResponse,
    pb::CreateTokenResponse,
    pb::ListTokensResponse,
    pb::RevokeTokenResponse,
    pb::GrantResponse,
    pb::RevokeGrantResponse,
    pb::ListGrantsResponse,
    pb::GetUsageResponse,
    pb::BackupResponse,
    pb::RestoreResponse,
    pb::IamMembersResponse,
    pb::DeletePoolResponse,
);

impl Decorate for pb::Pool {
    fn decorate(&mut self, shared: &Shared) {
        let snap = shared.snapshot();
        self.edges = snap
            .edges
            .iter()
            .filter_map(|e| {
                let p = e.pools.iter().find(|p| p.project == self.project && p.name == self.name)?;
                Some(pb::PoolStatus { edge: e.name.clone(), ..p.clone() })
            })
            .collect();
    }
}

impl Decorate for pb::ListPoolsResponse {
    fn decorate(&mut self, shared: &Shared) {
        for p in &mut self.pools {
            p.decorate(shared);
        }
    }
}

type AdminCall<Q, R> = fn(AdminClient<ServiceChannel>, Request<Q>) -> BoxFuture<'static, Result<Response<R>, Status>>;

async fn forward<Q, R>(
    shared: &Arc<Shared>,
    method: &'static str,
    request: Request<Q>,
    f: AdminCall<Q, R>,
) -> Result<Response<R>, Status>
where
    Q: Around + Clone + Send + Sync + 'static,
    R: Decorate + Send + 'static,
{
    let (md, _, msg) = request.into_parts();
    let shared = shared.clone();
    let task = tokio::spawn(async move {
        let mut call = Call::new(method);
        let token = match grpc::bearer(&md) {
            Ok(t) => t.to_string(),
            Err(e) => {
                shared.finish(call, Err(&e)).await;
                return Err(e.to_status());
            }
        };
        call.principal = shared.auth.cached_principal(&token_key(&token));
        // A project holding images is not deleted (IAM knows nothing of images). Only a
        // caller who may delete it learns that it holds any: the same rule as IAM's first.
        let deletes = msg.deletes_project().map(str::to_string);
        if let Some(p) = &deletes
            && let Err(e) = may_delete_empty(&shared, &token, p).await
        {
            shared.finish(call, Err(&e)).await;
            return Err(e.to_status());
        }
        let res = shared
            .up
            .admin(|c| {
                let mut r = Request::new(msg.clone());
                match grpc::set_bearer(&mut r, &token) {
                    Ok(()) => f(c, r),
                    Err(e) => futures::future::ready(Err(e.to_status())).boxed(),
                }
            })
            .await;
        let outcome = res.as_ref().map(|_| ()).map_err(ApiError::from_status);
        let gone = match &outcome {
            Ok(()) => true,
            // Deleted by an earlier try whose answer was lost, or never there: its records
            // are stale either way (the caller may delete it, as checked above).
            Err(e) => e.reason == Reason::NotFound,
        };
        if let (true, Some(p)) = (gone, &deletes) {
            // Gone at IAM: a project later made under the name inherits no layer rights.
            if let Err(e) = shared.images.forget_project(p).await {
                tracing::error!(project = %p, error = %e.message, "could not forget a deleted project's layer records");
            }
        }
        shared.finish(call, outcome.as_ref().map(|_| ())).await;
        res.map(|mut r| {
            r.get_mut().decorate(&shared);
            r
        })
    });
    match task.await {
        Ok(r) => r,
        Err(e) => {
            tracing::error!(method, error = %e, "admin proxy task failed");
            Err(ApiError::new(Reason::Internal, format!("{method} failed inside the apiserver")).to_status())
        }
    }
}

/// Implements every Admin method as a forward to the same IAM method.
macro_rules! admin_proxy {
    ($($name:ident: $label:literal, $req:ty => $resp:ty;)*) => {
        #[tonic::async_trait]
        impl Admin for AdminProxy {
            $(
                async fn $name(&self, request: Request<$req>) -> Result<Response<$resp>, Status> {
                    forward(&self.shared, $label, request, |mut c, r| async move { c.$name(r).await }.boxed()).await
                }
            )*
        }
    };
}

/// Nothing around the other calls.
macro_rules! nothing_around {
    ($($req:ty),* $(,)?) => {
        $(impl Around for $req {})*
    };
}

nothing_around!(
    pb::WhoAmIRequest,
    pb::CreateProjectRequest,
    pb::GetProjectRequest,
    pb::ListProjectsRequest,
    pb::SetQuotaRequest,
    pb::SetEgressCeilingRequest,
    pb::CreatePrincipalRequest,
    pb::ListPrincipalsRequest,
    pb::DeletePrincipalRequest,
    pb::CreateTokenRequest,
    pb::ListTokensRequest,
    pb::RevokeTokenRequest,
    pb::GrantRequest,
    pb::RevokeGrantRequest,
    pb::ListGrantsRequest,
    pb::GetUsageRequest,
    pb::BackupRequest,
    pb::RestoreRequest,
    pb::IamMembersRequest,
    pb::AddIamMemberRequest,
    pb::RemoveIamMemberRequest,
    pb::TransferIamLeaderRequest,
    pb::CreatePoolRequest,
    pb::UpdatePoolRequest,
    pb::DeletePoolRequest,
    pb::GetPoolRequest,
    pb::ListPoolsRequest,
);

admin_proxy! {
    who_am_i: "WhoAmI", pb::WhoAmIRequest => pb::WhoAmIResponse;
    create_project: "CreateProject", pb::CreateProjectRequest => pb::Project;
    get_project: "GetProject", pb::GetProjectRequest => pb::Project;
    list_projects: "ListProjects", pb::ListProjectsRequest => pb::ListProjectsResponse;
    delete_project: "DeleteProject", pb::DeleteProjectRequest => pb::DeleteProjectResponse;
    set_quota: "SetQuota", pb::SetQuotaRequest => pb::Project;
    set_egress_ceiling: "SetEgressCeiling", pb::SetEgressCeilingRequest => pb::Project;
    create_principal: "CreatePrincipal", pb::CreatePrincipalRequest => pb::Principal;
    list_principals: "ListPrincipals", pb::ListPrincipalsRequest => pb::ListPrincipalsResponse;
    delete_principal: "DeletePrincipal", pb::DeletePrincipalRequest => pb::DeletePrincipalResponse;
    create_token: "CreateToken", pb::CreateTokenRequest => pb::CreateTokenResponse;
    list_tokens: "ListTokens", pb::ListTokensRequest => pb::ListTokensResponse;
    revoke_token: "RevokeToken", pb::RevokeTokenRequest => pb::RevokeTokenResponse;
    grant: "Grant", pb::GrantRequest => pb::GrantResponse;
    revoke_grant: "RevokeGrant", pb::RevokeGrantRequest => pb::RevokeGrantResponse;
    list_grants: "ListGrants", pb::ListGrantsRequest => pb::ListGrantsResponse;
    get_usage: "GetUsage", pb::GetUsageRequest => pb::GetUsageResponse;
    backup: "Backup", pb::BackupRequest => pb::BackupResponse;
    restore: "Restore", pb::RestoreRequest => pb::RestoreResponse;
    iam_members: "IamMembers", pb::IamMembersRequest => pb::IamMembersResponse;
    add_iam_member: "AddIamMember", pb::AddIamMemberRequest => pb::IamMembersResponse;
    remove_iam_member: "RemoveIamMember", pb::RemoveIamMemberRequest => pb::IamMembersResponse;
    transfer_iam_leader: "TransferIamLeader", pb::TransferIamLeaderRequest => pb::IamMembersResponse;
    create_pool: "CreatePool", pb::CreatePoolRequest => pb::Pool;
    update_pool: "UpdatePool", pb::UpdatePoolRequest => pb::Pool;
    delete_pool: "DeletePool", pb::DeletePoolRequest => pb::DeletePoolResponse;
    get_pool: "GetPool", pb::GetPoolRequest => pb::Pool;
    list_pools: "ListPools", pb::ListPoolsRequest => pb::ListPoolsResponse;
}
