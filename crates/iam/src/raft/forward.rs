//! Every `Iam` and `Admin` call runs on the leader. Wrapped around both services, [`Forward`]
//! serves a call here when this member leads (after a lease read: see [`super::Replica::linearize`])
//! and otherwise hands it, unchanged, to the leader over the members' own mTLS links, with
//! the caller's identity in [`ON_BEHALF_OF`] (which the leader believes only from a member).
//! A call that was forwarded once is not forwarded again: a member that is not the leader
//! either answers `not_leader` and the caller tries another.

use std::convert::Infallible;
use std::sync::Arc;
use std::task::{Context, Poll};

use opendsec_common::acl::{Forwarded, ON_BEHALF_OF, Peer};
use opendsec_common::grpc::Links;
use opendsec_common::pki::Role;
use opendsec_common::{ApiError, Reason};
use tonic::body::Body;
use tonic::server::NamedService;
use tower::ServiceExt;

use super::Replica;
use crate::error::{IamError, to_api};

#[derive(Clone)]
pub struct Forward<S> {
    inner: S,
    replica: Replica,
}

impl<S> Forward<S> {
    pub fn new(inner: S, replica: Replica) -> Forward<S> {
        Forward { inner, replica }
    }
}

impl<S: NamedService> NamedService for Forward<S> {
    const NAME: &'static str = S::NAME;
}

fn refuse(e: &ApiError) -> http::Response<Body> {
    e.to_status().into_http()
}

impl<S> tower::Service<http::Request<Body>> for Forward<S>
where
    S: tower::Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = futures::future::BoxFuture<'static, Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // tonic's generated services are always ready; each call takes its own clone.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let (inner, replica) = (self.inner.clone(), self.replica.clone());
        Box::pin(async move {
            match replica.linearize().await {
                Ok(()) => inner.oneshot(req).await,
                Err(IamError::NotLeader(why)) if req.extensions().get::<Forwarded>().is_none() => {
                    match replica.leader_elsewhere() {
                        Some((leader, addr)) => Ok(forward(&replica.links, leader, &addr, req).await),
                        None => Ok(refuse(&ApiError::new(Reason::NotLeader, why))),
                    }
                }
                Err(e) => Ok(refuse(&to_api(&e))),
            }
        })
    }
}

/// Sends the call to the leader (member `leader`, at `addr`: its certificate must say so)
/// and its answer back, as they are.
async fn forward(links: &Arc<Links>, leader: u64, addr: &str, req: http::Request<Body>) -> http::Response<Body> {
    let Some(who) = req.extensions().get::<Peer>().map(|p| p.0.to_string()) else {
        return refuse(&ApiError::new(Reason::Unauthenticated, "no caller identity to forward"));
    };
    let Ok(who) = http::HeaderValue::from_str(&who) else {
        return refuse(&ApiError::new(Reason::Internal, "a caller identity that is no header value"));
    };
    let ch = match links.channel(addr, Role::Iam, Some(&leader.to_string())) {
        Ok(ch) => ch,
        Err(e) => return refuse(&e),
    };
    let (mut parts, body) = req.into_parts();
    // Nothing of this connection goes on (its TLS details, the caller checked here): the
    // channel sets the leader's scheme and authority, the header says whom for.
    parts.extensions = http::Extensions::new();
    parts.headers.insert(ON_BEHALF_OF, who);
    match ch.oneshot(http::Request::from_parts(parts, body)).await {
        Ok(resp) => resp,
        Err(e) => refuse(&ApiError::new(Reason::Unavailable, format!("forwarding to the IAM leader at {addr}: {e}"))),
    }
}

impl<S> std::fmt::Debug for Forward<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Forward").field("replica", &self.replica).finish_non_exhaustive()
    }
}
