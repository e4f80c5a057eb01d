//! The read side: authentication, authorization and the admin listings, as pure functions of
//! [`State`] (and, for expiry, a time the caller passes in).
//!
//! Reads never change state. Each listing checks the caller's permission before it looks at
//! the target, so a caller without the permission gets `permission_denied` whether or not the
//! target exists.

use opendsec_common::ids::{self, ROOT_PROJECT, project_within};

use crate::backup::{BACKUP_VERSION, Snapshot};
use crate::command::Actor;
use crate::error::IamError;
use crate::model::ProjectView;
use crate::model::{GrantRecord, PrincipalRecord, TokenRecord, TokenScope, validate_permission};
use crate::state::State;
use crate::token;

/// Who a token belongs to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Authenticated {
    pub principal: String,
    pub project: String,
    pub token_id: String,
    /// 0 = never.
    pub expires_at_ms: i64,
    /// The sandbox a token minted for one is limited to.
    pub scope: Option<TokenScope>,
}

impl Authenticated {
    pub fn actor(&self) -> Actor {
        Actor { principal: self.principal.clone(), token_id: self.token_id.clone() }
    }
}

fn unauthenticated(msg: String) -> IamError {
    IamError::Unauthenticated(msg)
}

impl State {
    /// Checks a `dsk.<id>.<secret>` token. Every failure is `unauthenticated`; messages name
    /// the token id at most, never the secret.
    pub fn authenticate(&self, token_str: &str, now_ms: i64) -> Result<Authenticated, IamError> {
        if !self.meta.bootstrapped {
            return Err(IamError::NotBootstrapped);
        }
        let (id, secret) = token::parse(token_str)
            .ok_or_else(|| unauthenticated("malformed token: expected dsk.<id>.<secret>".into()))?;
        let t = self
            .tokens
            .get(id)
            .filter(|t| token::verify(&self.hash_key, secret, &t.secret_hash))
            .ok_or_else(|| unauthenticated(format!("token {id} is unknown or its secret is wrong")))?;
        if t.revoked {
            return Err(unauthenticated(format!("token {id} has been revoked")));
        }
        if t.expired_at(now_ms) {
            return Err(unauthenticated(format!("token {id} has expired")));
        }
        let p = self
            .principals
            .get(&t.principal)
            .ok_or_else(|| unauthenticated(format!("principal {} of token {id} no longer exists", t.principal)))?;
        if let Some(scope) = &t.scope {
            if !self.leases.contains_key(&scope.lease) {
                return Err(unauthenticated(format!("token {id} was for a sandbox that has ended")));
            }
            // A sandbox's token works only while the token it was minted with does.
            let parent_ok = self.tokens.get(&scope.parent).is_some_and(|p| !p.revoked && !p.expired_at(now_ms));
            if !scope.parent.is_empty() && !parent_ok {
                return Err(unauthenticated(format!("token {id} was minted with a token that no longer works")));
            }
        }
        Ok(Authenticated {
            principal: p.name.clone(),
            project: p.project.clone(),
            token_id: t.id.clone(),
            expires_at_ms: t.expires_at_ms,
            scope: t.scope.clone(),
        })
    }

    /// Whether `principal` holds `permission` on `project` (unknown principals hold nothing).
    pub fn authorize(&self, principal: &str, permission: &str, project: &str) -> Result<bool, IamError> {
        validate_permission(permission)?;
        ids::validate_project(project).map_err(IamError::invalid)?;
        Ok(self.principals.contains_key(principal) && self.holds(principal, permission, project))
    }

    /// The grants a principal holds, in order.
    pub fn grants_of(&self, principal: &str) -> Vec<GrantRecord> {
        self.grants
            .get(principal)
            .map(|set| {
                set.iter()
                    .map(|(p, perm)| GrantRecord {
                        principal: principal.to_string(),
                        project: p.clone(),
                        permission: perm.clone(),
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    /// An empty path means the caller's own project.
    fn resolve<'a>(who: &'a Authenticated, path: &'a str) -> Result<&'a str, IamError> {
        let path = if path.is_empty() { who.project.as_str() } else { path };
        ids::validate_project(path).map_err(IamError::invalid)?;
        Ok(path)
    }

    pub fn get_project(&self, who: &Authenticated, path: &str) -> Result<ProjectView, IamError> {
        let path = State::resolve(who, path)?;
        self.require(&who.principal, "project.view", path, || format!("project {path}"))?;
        self.view(path).ok_or_else(|| IamError::NotFound { kind: "project", name: path.into() })
    }

    /// The project and every project below it, in path order (also what GetUsage answers).
    pub fn list_projects(&self, who: &Authenticated, path: &str) -> Result<Vec<ProjectView>, IamError> {
        let path = State::resolve(who, path)?;
        self.require(&who.principal, "project.view", path, || format!("project {path}"))?;
        if !self.projects.contains_key(path) {
            return Err(IamError::NotFound { kind: "project", name: path.into() });
        }
        Ok(self
            .projects
            .range(path.to_string()..)
            .take_while(|(p, _)| p.starts_with(path))
            .filter(|(p, _)| project_within(p, path))
            .filter_map(|(p, _)| self.view(p))
            .collect())
    }

    /// Principals of the project and its subprojects.
    pub fn list_principals(&self, who: &Authenticated, project: &str) -> Result<Vec<PrincipalRecord>, IamError> {
        let project = State::resolve(who, project)?;
        self.require(&who.principal, "principal.manage", project, || format!("project {project}"))?;
        if !self.projects.contains_key(project) {
            return Err(IamError::NotFound { kind: "project", name: project.into() });
        }
        Ok(self.principals.values().filter(|p| project_within(&p.project, project)).cloned().collect())
    }

    /// A principal's tokens (never their hashes' secrets, which are not kept). Empty: the caller.
    pub fn list_tokens(&self, who: &Authenticated, principal: &str) -> Result<Vec<TokenRecord>, IamError> {
        let principal = if principal.is_empty() { who.principal.as_str() } else { principal };
        ids::validate_principal(principal).map_err(IamError::invalid)?;
        if principal != who.principal
            && self.require_over_principal(&who.principal, "principal.manage", principal)?.is_none()
        {
            return Err(IamError::NotFound { kind: "principal", name: principal.into() });
        }
        // Sandbox tokens (one pair per sandbox) are the sandbox's, not the principal's to manage.
        let mut out: Vec<TokenRecord> = self
            .tokens_by_principal
            .get(principal)
            .map(|ids| ids.iter().filter_map(|id| self.tokens.get(id)).filter(|t| t.scope.is_none()).cloned().collect())
            .unwrap_or_default();
        out.sort_by(|a, b| a.created_at_ms.cmp(&b.created_at_ms).then_with(|| a.id.cmp(&b.id)));
        Ok(out)
    }

    /// Grants filtered by principal and/or project (grants on the project and below). Own
    /// grants are always visible; others' need `grant.manage` on the project (on the root when
    /// no project is given).
    pub fn list_grants(
        &self,
        who: &Authenticated,
        principal: &str,
        project: &str,
    ) -> Result<Vec<GrantRecord>, IamError> {
        if !principal.is_empty() {
            ids::validate_principal(principal).map_err(IamError::invalid)?;
        }
        if !project.is_empty() {
            ids::validate_project(project).map_err(IamError::invalid)?;
        }
        let own = (principal.is_empty() && project.is_empty()) || principal == who.principal;
        if !own {
            let on = if project.is_empty() { ROOT_PROJECT } else { project };
            self.require(&who.principal, "grant.manage", on, || format!("project {on}"))?;
        }
        let principal = if principal.is_empty() && project.is_empty() { who.principal.as_str() } else { principal };
        let grants: Vec<GrantRecord> =
            if principal.is_empty() { self.grant_records().collect() } else { self.grants_of(principal) };
        Ok(grants.into_iter().filter(|g| project.is_empty() || project_within(&g.project, project)).collect())
    }

    /// The backup of everything but leases and locks.
    pub fn backup(&self, who: &Authenticated) -> Result<Snapshot, IamError> {
        self.require(&who.principal, "iam.admin", ROOT_PROJECT, || format!("project {ROOT_PROJECT}"))?;
        let mut tokens: Vec<TokenRecord> = self.tokens.values().cloned().collect();
        tokens.sort_by(|a, b| a.id.cmp(&b.id));
        Ok(Snapshot {
            version: BACKUP_VERSION,
            hash_key: self.meta.hash_key.clone(),
            epoch: self.meta.epoch,
            projects: self.projects.values().cloned().collect(),
            principals: self.principals.values().cloned().collect(),
            tokens,
            grants: self.grant_records().collect(),
            pools: Some(self.pools.values().cloned().collect()),
        })
    }
}
