//! The `IamRaft` service believes a Raft message only from the member it names: a member's
//! certificate says `iam/<id>`, a leader's append carries its own id, a candidate asks for
//! votes only for itself, and a member outside the membership moves nothing. A member that
//! just started grants no vote for one leader lease.

use std::collections::BTreeMap;
use std::time::Duration;

use opendsec_common::acl::Peer;
use opendsec_common::config::IamRaftConfig;
use opendsec_common::pki::{Identity, Role};
use opendsec_iam::{Iam, IamOptions};
use opendsec_proto::v1 as pb;
use opendsec_proto::v1::iam_raft_server::IamRaft;
use openraft::async_runtime::WatchReceiver;
use openraft::raft::{AppendEntriesRequest, VoteRequest};

const ADMIN_TOKEN: &str = "dsk.admin01.AdminSecretAdminSecret0123456789";

fn from(name: &str, data: Vec<u8>) -> tonic::Request<pb::RaftMessage> {
    let mut r = tonic::Request::new(pb::RaftMessage { data });
    r.extensions_mut().insert(Peer(Identity::new(Role::Iam, name).unwrap()));
    r
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn raft_messages_are_believed_only_from_the_member_they_name() {
    let dir = tempfile::tempdir().unwrap();
    let tls = opendsec_testkit::creds(&dir.path().join("pki"), Role::Iam, "1");
    let opts = IamOptions {
        data_dir: dir.path().join("iam"),
        admin_principal: "admin".into(),
        admin_token: ADMIN_TOKEN.into(),
        reconcile_min_age: Duration::from_secs(60),
        commit_batch_max: 256,
    };
    // Members 1 and 2 (2 never starts: 1 stays a candidate with a membership).
    let rcfg = IamRaftConfig {
        id: 1,
        initial_members: BTreeMap::from([(1, "127.0.0.1:9".to_string()), (2, "127.0.0.1:10".to_string())]),
        ..Default::default()
    };
    let iam = Iam::open_replicated(opts, &rcfg, tls).await.unwrap();
    let replica = iam.replica().unwrap().clone();
    let service =
        opendsec_iam::raft::net::RaftService::new(replica.raft.clone(), replica.who.clone(), Duration::from_secs(60));
    replica
        .raft
        .get()
        .wait(Some(Duration::from_secs(10)))
        .metrics(|m| m.membership_config.membership().nodes().count() == 2, "the membership")
        .await
        .unwrap();
    let vote = replica.raft.get().metrics().borrow_watched().vote;
    assert_eq!(vote.leader_id().node_id, 1);

    // A log append in member 1's name: from member 2 it is refused, from outside the
    // membership too; from 1 itself it reaches Raft.
    let append = serde_json::to_vec(&AppendEntriesRequest::<opendsec_iam::raft::C> {
        vote,
        prev_log_id: None,
        entries: vec![],
        leader_commit: None,
    })
    .unwrap();
    let e = service.append_entries(from("2", append.clone())).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("in the name of member 1"), "{e:?}");
    let e = service.append_entries(from("3", append.clone())).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    assert!(e.message().contains("not in this member's membership"), "{e:?}");
    let e = service.append_entries(from("0", append.clone())).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    service.append_entries(from("1", append)).await.expect("its own append reaches Raft");

    // A vote request for member 1 from member 2 is refused; member 2's own, while this member
    // has just started, gets no vote.
    let ask = |v| {
        serde_json::to_vec(&(
            false,
            VoteRequest::<opendsec_iam::raft::C> { vote: v, last_log_id: None, leadership_transfer: false },
        ))
        .unwrap()
    };
    let e = service.vote(from("2", ask(vote))).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::PermissionDenied, "{e:?}");
    let mut theirs = vote;
    theirs.leader_id.node_id = 2;
    theirs.leader_id.term += 1;
    let e = service.vote(from("2", ask(theirs))).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
    assert!(e.message().contains("just started"), "{e:?}");

    // Garbage is refused, not applied.
    let e = service.append_entries(from("1", b"{not json".to_vec())).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    iam.shutdown().await;
}

/// A member that holds no log (started to be added, or wiped) grants no vote to a candidate
/// that names a cluster: one with history, whose record of this member it may lack. Asked by
/// a candidate of a cluster not bootstrapped yet, it answers as Raft would. Every reply names
/// its data directory; a claim that is no 32-hex-digit id is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_without_a_log_grants_no_vote_in_a_bootstrapped_cluster() {
    let dir = tempfile::tempdir().unwrap();
    let tls = opendsec_testkit::creds(&dir.path().join("pki"), Role::Iam, "3");
    let opts = IamOptions {
        data_dir: dir.path().join("iam"),
        admin_principal: "admin".into(),
        admin_token: String::new(),
        reconcile_min_age: Duration::from_secs(60),
        commit_batch_max: 256,
    };
    // No initial members: it waits to be added, with an empty log.
    let rcfg = IamRaftConfig { id: 3, ..Default::default() };
    let iam = Iam::open_replicated(opts, &rcfg, tls).await.unwrap();
    let replica = iam.replica().unwrap().clone();
    assert_eq!(replica.last_log_index(), None);
    let service = opendsec_iam::raft::net::RaftService::new(replica.raft.clone(), replica.who.clone(), Duration::ZERO);
    let mut vote = replica.raft.get().metrics().borrow_watched().vote;
    (vote.leader_id.term, vote.leader_id.node_id) = (5, 2);
    let candidate = |cluster: Option<&str>| {
        let body = serde_json::to_vec(&(
            false,
            VoteRequest::<opendsec_iam::raft::C> { vote, last_log_id: None, leadership_transfer: false },
        ))
        .unwrap();
        let mut r = from("2", body);
        if let Some(c) = cluster {
            r.metadata_mut().insert("x-opendsec-iam-cluster", c.parse().unwrap());
        }
        r
    };
    let e = service.vote(candidate(Some(&"ab".repeat(16)))).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::FailedPrecondition, "{e:?}");
    assert!(e.message().contains("holds no log"), "{e:?}");
    let e = service.vote(candidate(Some("not-an-id"))).await.unwrap_err();
    assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
    let ok = service.vote(candidate(None)).await.expect("a vote answered by Raft");
    let dir_id = ok.metadata().get("x-opendsec-iam-dir").and_then(|v| v.to_str().ok()).unwrap_or_default();
    assert!(opendsec_iam::raft::net::well_formed_id(dir_id), "{dir_id:?}");
    assert_eq!(dir_id, replica.who.data_dir);
    iam.shutdown().await;
}
