//! Tests of the pure state machine: every command goes through [`apply`], and after each one
//! the harness checks the invariants (a failed command changes nothing and writes nothing; the
//! writes replayed into an empty store rebuild exactly the same state; usage equals the sum of
//! the leases).

use std::collections::BTreeMap;

use proptest::prelude::*;

use crate::backup::Snapshot;
use crate::command::{Actor, Admission, Command, LiveLease, Output, Row, Table, Write};
use crate::error::{IamError, to_api};
use crate::model::{GrantRecord, Quota, Resources, Usage};
use crate::state::{State, apply};
use crate::token;
use opendsec_common::Reason;
use opendsec_common::ids::project_within;

const KEY_HEX: &str = "0000000000000000000000000000000000000000000000000000000000000000";

fn secret_of(token_id: &str) -> String {
    format!("secret-of-{token_id}-0123456789")
}

fn hash_of(token_id: &str) -> String {
    token::hash_secret_hex(&[0u8; 32], &secret_of(token_id))
}

fn res(cpu: u64, mem: u64) -> Resources {
    Resources { cpu_millis: cpu, memory_mb: mem, disk_mb: 0, gpus: 0 }
}

fn reason(r: &Result<Output, IamError>) -> Reason {
    match r {
        Ok(o) => panic!("expected an error, got {o:?}"),
        Err(e) => to_api(e).reason,
    }
}

/// A state plus a model of the store its writes would build.
struct Harness {
    st: State,
    store: BTreeMap<(Table, String), Row>,
    now: i64,
    tokens: u32,
}

impl Harness {
    fn new() -> Harness {
        let mut h = Harness { st: State::default(), store: BTreeMap::new(), now: 1_000_000, tokens: 0 };
        h.run(Command::Bootstrap {
            now_ms: h.now,
            hash_key: KEY_HEX.into(),
            admin_principal: "admin".into(),
            admin_token_id: "admintoken".into(),
            admin_token_hash: hash_of("admintoken"),
            cluster: "c1a55e".repeat(5) + "c1",
        })
        .unwrap();
        h
    }

    fn admin() -> Actor {
        Actor { principal: "admin".into(), token_id: "admintoken".into() }
    }

    fn run(&mut self, cmd: Command) -> Result<Output, IamError> {
        let before = self.st.clone();
        let (r, writes) = apply(&mut self.st, &cmd);
        if r.is_err() {
            assert_eq!(self.st, before, "failed {} changed the state", cmd.kind());
            assert!(writes.is_empty(), "failed {} produced writes", cmd.kind());
        }
        for w in writes {
            match w {
                Write::Put(row) => {
                    self.store.insert((row.table(), row.key()), row);
                }
                Write::Delete { table, key } => {
                    self.store.remove(&(table, key));
                }
            }
        }
        let rebuilt = State::from_rows(self.store.values().cloned());
        assert_eq!(rebuilt, self.st, "the writes of {} do not rebuild the state", cmd.kind());
        check_usage(&self.st);
        r
    }

    fn tick(&mut self, ms: i64) {
        self.now += ms;
    }

    /// `holder` takes (or renews) the reconcile lock for `ttl_ms` from now.
    fn lock_for(&mut self, holder: &str, ttl_ms: i64) {
        let cmd = Command::AcquireLock {
            now_ms: self.now,
            name: opendsec_common::RECONCILE_LOCK.into(),
            holder: holder.into(),
            ttl_ms,
        };
        assert!(matches!(self.run(cmd).unwrap(), Output::Lock { acquired: true, .. }), "{holder} did not get the lock");
    }

    fn project(&mut self, path: &str, quota: Quota) {
        self.run(Command::CreateProject { actor: Harness::admin(), now_ms: self.now, path: path.into(), quota })
            .unwrap();
    }

    /// A principal in `project` with one token; returns it as an actor.
    fn principal(&mut self, name: &str, project: &str) -> Actor {
        self.run(Command::CreatePrincipal {
            actor: Harness::admin(),
            now_ms: self.now,
            name: name.into(),
            project: project.into(),
        })
        .unwrap();
        self.token_for(name)
    }

    fn token_for(&mut self, name: &str) -> Actor {
        self.tokens += 1;
        let id = format!("tok{}", self.tokens);
        self.run(Command::CreateToken {
            actor: Harness::admin(),
            now_ms: self.now,
            principal: name.into(),
            token_id: id.clone(),
            secret_hash: hash_of(&id),
            expires_at_ms: 0,
            description: String::new(),
        })
        .unwrap();
        Actor { principal: name.into(), token_id: id }
    }

    fn grant_as(&mut self, actor: &Actor, principal: &str, project: &str, perm: &str) -> Result<Output, IamError> {
        self.run(Command::Grant {
            actor: actor.clone(),
            now_ms: self.now,
            grant: GrantRecord { principal: principal.into(), project: project.into(), permission: perm.into() },
        })
    }

    fn grant(&mut self, principal: &str, project: &str, perm: &str) {
        self.grant_as(&Harness::admin(), principal, project, perm).unwrap();
    }

    fn admit(
        &mut self,
        actor: &Actor,
        lease: &str,
        project: &str,
        r: Resources,
        edge: &str,
    ) -> Result<Output, IamError> {
        self.admit_with(actor, lease, project, r, edge, false)
    }

    fn admit_with(
        &mut self,
        actor: &Actor,
        lease: &str,
        project: &str,
        r: Resources,
        edge: &str,
        keep_existing: bool,
    ) -> Result<Output, IamError> {
        self.run(Command::Admit {
            actor: actor.clone(),
            now_ms: self.now,
            lease_id: lease.into(),
            project: project.into(),
            resources: r,
            edge: edge.into(),
            keep_existing,
            egress: Vec::new(),
        })
    }

    fn release(&mut self, ids: &[&str]) -> u32 {
        self.release_on(ids, "")
    }

    /// Releases with an edge (empty: any edge).
    fn release_on(&mut self, ids: &[&str], edge: &str) -> u32 {
        match self.run(Command::ReleaseLeases {
            now_ms: self.now,
            lease_ids: ids.iter().map(|s| s.to_string()).collect(),
            edge: edge.into(),
        }) {
            Ok(Output::Released { released }) => released,
            o => panic!("{o:?}"),
        }
    }

    fn usage(&self, p: &str) -> Usage {
        self.st.usage(p).unwrap()
    }
}

/// Usage of every project equals the sum over the leases within it, and its store bytes the
/// sum over the distinct parts its images name; every lease's project exists.
fn check_usage(st: &State) {
    for p in st.projects() {
        let mut sum = Usage::default();
        for l in st.leases().filter(|l| project_within(&l.project, &p.path)) {
            sum.add(&Usage::of(&l.resources));
        }
        let parts: BTreeMap<&str, u64> = st
            .images
            .values()
            .filter(|c| project_within(&c.project, &p.path))
            .flat_map(|c| c.parts.iter().map(|x| (x.id.as_str(), x.bytes)))
            .collect();
        sum.store_bytes = parts.values().sum();
        assert_eq!(st.usage(&p.path), Some(sum), "usage of {}", p.path);
    }
    for l in st.leases() {
        assert!(st.project(&l.project).is_some(), "lease {} in missing project {}", l.id, l.project);
    }
}

fn quota(cpu: Option<u64>, mem: Option<u64>, sandboxes: Option<u64>) -> Quota {
    Quota { cpu_millis: cpu, memory_mb: mem, sandboxes, ..Quota::default() }
}

#[test]
fn bootstrap_makes_root_admin_and_epoch() {
    let mut h = Harness::new();
    assert!(h.st.bootstrapped());
    assert_eq!(h.st.epoch(), 1);
    assert!(h.st.holds("admin", "iam.admin", "root/any/thing"));
    let a = h.st.authenticate(&token::format("admintoken", &secret_of("admintoken")), h.now).unwrap();
    assert_eq!((a.principal.as_str(), a.project.as_str()), ("admin", "root"));
    let again = h.run(Command::Bootstrap {
        now_ms: 1,
        hash_key: KEY_HEX.into(),
        admin_principal: "x".into(),
        admin_token_id: "x".into(),
        admin_token_hash: hash_of("x"),
        cluster: String::new(),
    });
    assert_eq!(reason(&again), Reason::InvalidState);
}

/// The first data directory id a member answered with is its own for good; a later one is
/// not recorded over it; ids that are not hex are refused; a restore keeps the records and
/// the cluster's id.
#[test]
fn member_records_are_written_once_and_kept_by_a_restore() {
    let mut h = Harness::new();
    let cluster = "c1a55e".repeat(5) + "c1";
    assert_eq!(h.st.meta.cluster, cluster);
    let (a, b) = ("ab".repeat(16), "cd".repeat(16));
    h.run(Command::MemberSeen { id: 2, data_dir: a.clone() }).unwrap();
    h.run(Command::MemberSeen { id: 2, data_dir: b.clone() }).unwrap();
    assert_eq!(h.st.meta.members.get(&2), Some(&a));
    for (id, dir) in
        [(0, a.clone()), (3, String::new()), (3, "not hex".into()), (3, "a".repeat(31)), (3, "a".repeat(33))]
    {
        let r = h.run(Command::MemberSeen { id, data_dir: dir.clone() });
        assert_eq!(reason(&r), Reason::InvalidArgument, "{id} {dir}");
    }
    // A cluster that has an id keeps it.
    h.run(Command::SetCluster { cluster: b.clone() }).unwrap();
    assert_eq!(h.st.meta.cluster, cluster);
    let admin_who = h.st.authenticate(&token::format("admintoken", &secret_of("admintoken")), h.now).unwrap();
    let snap = h.st.backup(&admin_who).unwrap();
    h.run(Command::Restore { actor: Harness::admin(), now_ms: h.now, snapshot: snap }).unwrap();
    assert_eq!(h.st.meta.members.get(&2), Some(&a));
    assert_eq!(h.st.meta.cluster, cluster);
    // As the store keeps it, and reads it back.
    let row = Row::Meta(h.st.meta.clone());
    let stored = crate::store::encode_row(&row).unwrap();
    assert_eq!(crate::store::decode_row(Table::Meta, "meta", &stored).unwrap(), row, "{stored}");
}

/// A cluster bootstrapped before cluster ids (none in its meta) gets one, once.
#[test]
fn a_cluster_without_an_id_gets_one() {
    let mut h = Harness::new();
    h.st.meta.cluster.clear();
    let row = Row::Meta(h.st.meta.clone());
    h.store.insert((row.table(), row.key()), row);
    let r = h.run(Command::SetCluster { cluster: "xyz".into() });
    assert_eq!(reason(&r), Reason::InvalidArgument);
    h.run(Command::SetCluster { cluster: "0a".repeat(16) }).unwrap();
    h.run(Command::SetCluster { cluster: "0b".repeat(16) }).unwrap();
    assert_eq!(h.st.meta.cluster, "0a".repeat(16));
}

#[test]
fn nothing_applies_before_bootstrap() {
    let mut st = State::default();
    let (r, w) =
        apply(&mut st, &Command::ReleaseLeases { now_ms: 1, lease_ids: vec!["a".into()], edge: String::new() });
    assert!(matches!(r, Err(IamError::NotBootstrapped)));
    assert!(w.is_empty());
    assert_eq!(to_api(&IamError::NotBootstrapped).reason, Reason::Unavailable);
}

#[test]
fn quotas_inherit_and_reservations_are_all_or_nothing() {
    let mut h = Harness::new();
    h.run(Command::SetQuota {
        actor: Harness::admin(),
        now_ms: h.now,
        path: "root".into(),
        quota: quota(Some(10_000), None, None),
    })
    .unwrap();
    h.project("root/a", quota(None, Some(1000), None));
    h.project("root/a/b", Quota::default());
    let eff = h.st.effective_quota("root/a/b");
    assert_eq!((eff.cpu_millis, eff.memory_mb, eff.disk_mb), (Some(10_000), Some(1000), None));

    let u = h.principal("user", "root/a");
    h.grant("user", "root/a", "sandbox.create");
    h.admit(&u, "l1", "root/a/b", res(4000, 500), "e1").unwrap();
    h.admit(&u, "l2", "root/a/b", res(4000, 500), "e1").unwrap();
    assert_eq!(h.usage("root/a/b"), Usage { cpu_millis: 8000, memory_mb: 1000, sandboxes: 2, ..Usage::default() });
    assert_eq!(h.usage("root").cpu_millis, 8000);

    // Memory is full at root/a (inherited by root/a/b): refused, naming the level and numbers.
    let r = h.admit(&u, "l3", "root/a/b", res(1000, 1), "e1");
    match &r {
        Err(IamError::QuotaExceeded { project, key, limit, used, requested }) => {
            assert_eq!((project.as_str(), *key, *limit, *used, *requested), ("root/a", "memory_mb", 1000, 1000, 1));
        }
        o => panic!("{o:?}"),
    }
    assert_eq!(reason(&r), Reason::QuotaExceeded);
    // CPU is full at the root even though root/a/b sets nothing.
    h.release(&["l2"]);
    let r = h.admit(&u, "l3", "root/a/b", res(6001, 1), "e1");
    assert!(matches!(&r, Err(IamError::QuotaExceeded { project, key: "cpu_millis", .. }) if project == "root"));
    h.admit(&u, "l3", "root/a/b", res(6000, 1), "e1").unwrap();
    assert_eq!(h.usage("root").cpu_millis, 10_000);
}

#[test]
fn each_lease_counts_one_sandbox() {
    let mut h = Harness::new();
    h.project("root/a", quota(None, None, Some(2)));
    let u = h.principal("user", "root/a");
    h.grant("user", "root/a", "sandbox.create");
    h.admit(&u, "l1", "root/a", res(1, 1), "e1").unwrap();
    h.admit(&u, "l2", "root/a", res(1, 1), "e1").unwrap();
    let r = h.admit(&u, "l3", "root/a", res(1, 1), "e1");
    assert!(matches!(r, Err(IamError::QuotaExceeded { key: "sandboxes", .. })));
    // A lowered limit on a key the demand does not use does not block.
    h.run(Command::SetQuota {
        actor: Harness::admin(),
        now_ms: h.now,
        path: "root/a".into(),
        quota: Quota { sandboxes: Some(5), gpus: Some(0), ..Quota::default() },
    })
    .unwrap();
    h.admit(&u, "l3", "root/a", res(1, 1), "e1").unwrap();
    assert_eq!(h.release(&["l1", "l2", "l3", "nope", "l1"]), 3);
    assert!(h.usage("root").is_zero());
}

#[test]
fn readmitting_a_lease_only_rebinds_it() {
    let mut h = Harness::new();
    h.project("root/a", quota(Some(1000), None, None));
    let u = h.principal("user", "root/a");
    h.grant("user", "root/a", "sandbox.create");
    let first = h.now;
    assert_eq!(h.admit(&u, "l1", "root/a", res(1000, 1), "e1").unwrap(), admitted("user", false, false, "e1", first));
    h.tick(500);
    // The quota is full, yet the same lease again succeeds: it is only rebound.
    assert_eq!(h.admit(&u, "l1", "root/a", res(1000, 1), "e2").unwrap(), admitted("user", true, false, "e2", h.now));
    let l = h.st.lease("l1").unwrap();
    assert_eq!((l.edge.as_str(), l.bound_at_ms, l.created_at_ms), ("e2", h.now, h.now - 500));
    assert_eq!(h.usage("root/a").cpu_millis, 1000);
    let r = h.admit(&u, "l1", "root/a", res(999, 1), "e2");
    assert_eq!(reason(&r), Reason::InvalidArgument);
    let r = h.admit(&Harness::admin(), "l1", "root", res(1000, 1), "e2");
    assert_eq!(reason(&r), Reason::InvalidArgument);
}

fn admitted(principal: &str, rebound: bool, existing: bool, edge: &str, bound_at_ms: i64) -> Output {
    Output::Admitted(Admission {
        principal: principal.into(),
        rebound,
        existing,
        edge: edge.into(),
        bound_at_ms,
        member_lease: String::new(),
    })
}

#[test]
fn keep_existing_leaves_an_existing_lease_where_it_is() {
    let mut h = Harness::new();
    h.project("root/a", quota(Some(1000), None, None));
    let u = h.principal("user", "root/a");
    h.grant("user", "root/a", "sandbox.create");
    // A new lease is reserved as without the flag.
    let first = h.now;
    assert_eq!(
        h.admit_with(&u, "l1", "root/a", res(1000, 1), "e1", true).unwrap(),
        admitted("user", false, false, "e1", first)
    );
    h.tick(500);
    // Again with the flag: nothing changes, the answer says where it is bound (no writes: the
    // harness would see a changed store).
    let before = h.st.clone();
    assert_eq!(
        h.admit_with(&u, "l1", "root/a", res(1000, 1), "e2", true).unwrap(),
        admitted("user", false, true, "e1", first)
    );
    assert_eq!(h.st, before);
    let (_, writes) = apply(&mut h.st.clone(), &keep_admit(&u, "l1", h.now));
    assert!(writes.is_empty(), "{writes:?}");
    // The same checks still apply: a different project or resources is invalid...
    assert_eq!(reason(&h.admit_with(&u, "l1", "root/a", res(999, 1), "e2", true)), Reason::InvalidArgument);
    // ...another principal (even one allowed to create there) finds it taken...
    let other = h.principal("other", "root/a");
    h.grant("other", "root/a", "sandbox.create");
    let r = h.admit_with(&other, "l1", "root/a", res(1000, 1), "e2", true);
    assert_eq!(reason(&r), Reason::AlreadyExists);
    // ...and without sandbox.create or with a revoked token nothing is answered.
    h.principal("stranger", "root");
    let stranger = h.token_for("stranger");
    assert_eq!(reason(&h.admit_with(&stranger, "l1", "root/a", res(1000, 1), "e2", true)), Reason::PermissionDenied);
    h.run(Command::RevokeToken { actor: Harness::admin(), now_ms: h.now, token_id: u.token_id.clone() }).unwrap();
    assert_eq!(reason(&h.admit_with(&u, "l1", "root/a", res(1000, 1), "e2", true)), Reason::Unauthenticated);
    // Without the flag, a retry rebinds as before.
    let u = h.token_for("user");
    assert_eq!(h.admit(&u, "l1", "root/a", res(1000, 1), "e2").unwrap(), admitted("user", true, false, "e2", h.now));
    assert_eq!(h.usage("root/a").sandboxes, 1);
}

fn keep_admit(actor: &Actor, lease: &str, now_ms: i64) -> Command {
    Command::Admit {
        actor: actor.clone(),
        now_ms,
        lease_id: lease.into(),
        project: "root/a".into(),
        resources: res(1000, 1),
        edge: "e9".into(),
        keep_existing: true,
        egress: Vec::new(),
    }
}

#[test]
fn the_proposer_precheck_agrees_with_apply() {
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    let u = h.principal("user", "root/a");
    h.grant("user", "root/a", "sandbox.create");
    // No lease yet: the precheck leaves it to apply.
    assert_eq!(h.st.admit_precheck("user", "l1", "root/a", &res(1000, 1), true).unwrap(), None);
    h.admit(&u, "l1", "root/a", res(1000, 1), "e1").unwrap();
    // Existing, kept: the precheck answers exactly what apply would.
    let pre = h.st.admit_precheck("user", "l1", "root/a", &res(1000, 1), true).unwrap().unwrap();
    assert_eq!(h.run(keep_admit(&u, "l1", h.now)).unwrap(), Output::Admitted(pre));
    // Existing, not kept: apply rebinds.
    assert_eq!(h.st.admit_precheck("user", "l1", "root/a", &res(1000, 1), false).unwrap(), None);
    assert!(matches!(
        h.st.admit_precheck("user", "l1", "root/a/missing", &res(1000, 1), true),
        Err(IamError::NotFound { .. })
    ));
}

#[test]
fn releasing_with_an_edge_leaves_leases_bound_elsewhere() {
    let mut h = Harness::new();
    let a = Harness::admin();
    h.admit(&a, "here", "root", res(1, 1), "e1").unwrap();
    h.admit(&a, "moved", "root", res(1, 1), "e1").unwrap();
    h.admit(&a, "moved", "root", res(1, 1), "e2").unwrap(); // rebound to e2
    h.admit(&a, "other", "root", res(1, 1), "e2").unwrap();
    // e1 releases what it ran: only the lease still bound to it goes; unknown ids are skipped.
    assert_eq!(h.release_on(&["here", "moved", "nope"], "e1"), 1);
    assert!(h.st.lease("here").is_none());
    assert_eq!(h.st.lease("moved").unwrap().edge, "e2");
    assert_eq!(h.usage("root").sandboxes, 2);
    // Without an edge, as before: any binding.
    assert_eq!(h.release_on(&["moved"], ""), 1);
    assert_eq!(h.release_on(&["other"], "e2"), 1);
    assert!(h.usage("root").is_zero());
    // A malformed edge is refused and changes nothing.
    h.admit(&a, "x", "root", res(1, 1), "e1").unwrap();
    let r = h.run(Command::ReleaseLeases { now_ms: h.now, lease_ids: vec!["x".into()], edge: "E!".into() });
    assert_eq!(reason(&r), Reason::InvalidArgument);
    assert!(h.st.lease("x").is_some());
}

#[test]
fn admit_checks_the_token_and_permission_at_apply_time() {
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    let u = h.principal("user", "root/a");
    // No sandbox.create yet.
    assert_eq!(reason(&h.admit(&u, "l1", "root/a", res(1, 1), "e1")), Reason::PermissionDenied);
    h.grant("user", "root/a", "sandbox.create");
    // Not on a sibling project.
    h.project("root/b", Quota::default());
    assert_eq!(reason(&h.admit(&u, "l1", "root/b", res(1, 1), "e1")), Reason::PermissionDenied);
    // Revoked between the proposer's check and the commit: refused when applied.
    h.run(Command::RevokeToken { actor: Harness::admin(), now_ms: h.now, token_id: u.token_id.clone() }).unwrap();
    assert_eq!(reason(&h.admit(&u, "l1", "root/a", res(1, 1), "e1")), Reason::Unauthenticated);
}

#[test]
fn absurd_admits_are_invalid() {
    let mut h = Harness::new();
    let a = Harness::admin();
    for (lease, project, r, edge) in [
        ("l1", "root", res(0, 1), "e1"),
        ("l1", "root", res(1_024_001, 1), "e1"),
        ("l1", "root", res(1, 0), "e1"),
        ("l1", "root", res(1, 16 * 1024 * 1024 + 1), "e1"),
        ("l1", "root", Resources { disk_mb: 64 * 1024 * 1024 + 1, ..res(1, 1) }, "e1"),
        ("l1", "root", Resources { gpus: 65, ..res(1, 1) }, "e1"),
        ("L1", "root", res(1, 1), "e1"),
        ("", "root", res(1, 1), "e1"),
        ("l1", "team", res(1, 1), "e1"),
        ("l1", "root", res(1, 1), "e.1"),
        ("l1", "root", res(1, 1), ""),
    ] {
        assert_eq!(reason(&h.admit(&a, lease, project, r, edge)), Reason::InvalidArgument, "{lease} {project} {edge}");
    }
    assert_eq!(reason(&h.admit(&a, "l1", "root/missing", res(1, 1), "e1")), Reason::NotFound);
}

#[test]
fn delegation_cannot_escalate() {
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    h.project("root/a/x", Quota::default());
    let alice = h.principal("alice", "root/a");
    h.principal("bob", "root/a");
    h.grant("alice", "root/a", "grant.manage");
    h.grant("alice", "root/a", "sandbox.create");

    h.grant_as(&alice, "bob", "root/a", "sandbox.create").unwrap();
    h.grant_as(&alice, "bob", "root/a/x", "sandbox.create").unwrap();
    h.grant_as(&alice, "bob", "root/a", "sandbox.create").unwrap(); // idempotent
    for (project, perm) in
        [("root/a", "project.manage"), ("root/a", "*"), ("root/a", "sandbox.view"), ("root", "sandbox.create")]
    {
        let r = h.grant_as(&alice, "bob", project, perm);
        assert_eq!(reason(&r), Reason::PermissionDenied, "{perm} on {project}");
    }
    // What she holds she may pass on, grant.manage included.
    h.grant_as(&alice, "bob", "root/a/x", "grant.manage").unwrap();
    // Nor can alice grant herself more.
    assert_eq!(reason(&h.grant_as(&alice, "alice", "root/a", "iam.admin")), Reason::PermissionDenied);
    // With `*` on root/a she can grant anything there, `*` included, but nothing above.
    h.grant("alice", "root/a", "*");
    h.grant_as(&alice, "bob", "root/a/x", "*").unwrap();
    assert_eq!(reason(&h.grant_as(&alice, "bob", "root", "project.view")), Reason::PermissionDenied);
    // Revoking needs the same.
    h.run(Command::RevokeGrant {
        actor: alice.clone(),
        now_ms: h.now,
        grant: GrantRecord { principal: "bob".into(), project: "root/a/x".into(), permission: "*".into() },
    })
    .unwrap();
    assert_eq!(reason(&h.grant_as(&alice, "bob", "root/a", "everything")), Reason::InvalidArgument);
}

#[test]
fn nobody_raises_their_own_projects_quota() {
    let mut h = Harness::new();
    h.project("root/a", quota(Some(100), None, None));
    let m = h.principal("manager", "root/a");
    h.grant("manager", "root/a", "project.manage");
    let set = |path: &str| Command::SetQuota {
        actor: m.clone(),
        now_ms: 0,
        path: path.into(),
        quota: quota(Some(1_000_000), None, None),
    };
    assert_eq!(reason(&h.run(set("root/a"))), Reason::PermissionDenied);
    assert_eq!(reason(&h.run(set("root"))), Reason::PermissionDenied);
    h.run(Command::CreateProject {
        actor: m.clone(),
        now_ms: h.now,
        path: "root/a/sub".into(),
        quota: Quota::default(),
    })
    .unwrap();
    h.run(set("root/a/sub")).unwrap();
    // ...which still cannot exceed root/a's 100 in practice.
    h.grant("manager", "root/a", "sandbox.create");
    assert!(
        matches!(h.admit(&m, "l1", "root/a/sub", res(101, 1), "e"), Err(IamError::QuotaExceeded { project, .. }) if project == "root/a")
    );
    // The root's quota needs iam.admin on root.
    h.grant("manager", "root", "project.manage");
    assert_eq!(reason(&h.run(set("root"))), Reason::PermissionDenied);
    h.run(Command::SetQuota { actor: Harness::admin(), now_ms: h.now, path: "root".into(), quota: Quota::default() })
        .unwrap();
}

#[test]
fn project_rules_and_deletion() {
    let mut h = Harness::new();
    let a = Harness::admin();
    let create =
        |path: &str| Command::CreateProject { actor: a.clone(), now_ms: 5, path: path.into(), quota: Quota::default() };
    let delete = |path: &str| Command::DeleteProject { actor: a.clone(), now_ms: 5, path: path.into() };
    h.run(create("root/a")).unwrap();
    assert_eq!(reason(&h.run(create("root/a"))), Reason::AlreadyExists);
    assert_eq!(reason(&h.run(create("root"))), Reason::AlreadyExists);
    assert_eq!(reason(&h.run(create("root/missing/x"))), Reason::NotFound);
    assert_eq!(reason(&h.run(create("root/A"))), Reason::InvalidArgument);
    assert_eq!(reason(&h.run(create(""))), Reason::InvalidArgument);
    h.run(create("root/a/b")).unwrap();
    assert_eq!(reason(&h.run(delete("root/a"))), Reason::InvalidState);
    assert_eq!(reason(&h.run(delete("root"))), Reason::InvalidArgument);
    assert_eq!(reason(&h.run(delete("root/nope"))), Reason::NotFound);

    let u = h.principal("user", "root/a/b");
    assert_eq!(reason(&h.run(delete("root/a/b"))), Reason::InvalidState);
    h.grant("user", "root/a/b", "sandbox.create");
    h.admit(&u, "l1", "root/a/b", res(1, 1), "e").unwrap();
    h.run(Command::DeletePrincipal { actor: a.clone(), now_ms: 5, name: "user".into() }).unwrap();
    assert_eq!(reason(&h.run(delete("root/a/b"))), Reason::InvalidState); // the lease
    h.release(&["l1"]);
    h.grant("admin", "root/a/b", "layer.use");
    let epoch = h.st.epoch();
    h.run(delete("root/a/b")).unwrap();
    assert!(h.st.epoch() > epoch);
    // Its grants went with it: recreating the project gives nobody anything.
    assert!(!h.st.grant_records().any(|g| g.project == "root/a/b"));
    h.run(delete("root/a")).unwrap();
    // Absurd quotas are invalid.
    let r = h.run(Command::CreateProject {
        actor: a.clone(),
        now_ms: 5,
        path: "root/q".into(),
        quota: quota(Some(u64::MAX), None, None),
    });
    assert_eq!(reason(&r), Reason::InvalidArgument);
}

#[test]
fn missing_targets_are_hidden_from_callers_without_permission() {
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    h.project("root/b", Quota::default());
    let m = h.principal("manager", "root/a");
    h.grant("manager", "root/a", "principal.manage");
    h.principal("other", "root/b");
    let del = |name: &str| Command::DeletePrincipal { actor: m.clone(), now_ms: 5, name: name.into() };
    // Without the permission: denied, whether or not the target exists.
    assert_eq!(reason(&h.run(del("other"))), Reason::PermissionDenied);
    assert_eq!(reason(&h.run(del("ghost"))), Reason::PermissionDenied);
    let e1 = to_api(&h.run(del("other")).unwrap_err()).message;
    let e2 = to_api(&h.run(del("ghost")).unwrap_err()).message;
    assert!(!e1.contains("root/b"), "{e1}");
    assert_eq!(e1.replace("other", "X"), e2.replace("ghost", "X"));
    // With it: not_found for a missing target.
    let admin_del = Command::DeletePrincipal { actor: Harness::admin(), now_ms: 5, name: "ghost".into() };
    assert_eq!(reason(&h.run(admin_del)), Reason::NotFound);
    // Projects: permission first, then existence.
    let c = Command::CreateProject { actor: m.clone(), now_ms: 5, path: "root/b/x".into(), quota: Quota::default() };
    assert_eq!(reason(&h.run(c)), Reason::PermissionDenied);
    let r = h.run(Command::RevokeToken { actor: m.clone(), now_ms: 5, token_id: "nosuchtoken".into() });
    assert_eq!(reason(&r), Reason::PermissionDenied);
}

#[test]
fn deleting_a_principal_revokes_its_tokens_and_grants() {
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    let u = h.principal("user", "root/a");
    h.grant("user", "root/a", "sandbox.view");
    let epoch = h.st.epoch();
    h.run(Command::DeletePrincipal { actor: Harness::admin(), now_ms: h.now, name: "user".into() }).unwrap();
    assert_eq!(h.st.epoch(), epoch + 1);
    assert!(h.st.token_record(&u.token_id).is_none());
    assert!(h.st.grants_of("user").is_empty());
    let t = token::format(&u.token_id, &secret_of(&u.token_id));
    assert!(matches!(h.st.authenticate(&t, h.now), Err(IamError::Unauthenticated(_))));
    // A new principal of the same name inherits nothing.
    h.principal("user", "root/a");
    assert!(h.st.grants_of("user").is_empty());
    assert!(matches!(h.st.authenticate(&t, h.now), Err(IamError::Unauthenticated(_))));
}

#[test]
fn tokens_self_service_and_authentication() {
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    let u = h.principal("user", "root/a");
    h.principal("peer", "root/a");
    // Any principal may make and revoke its own tokens.
    let mk = |actor: &Actor, principal: &str, id: &str, expires: i64| Command::CreateToken {
        actor: actor.clone(),
        now_ms: 2_000_000,
        principal: principal.into(),
        token_id: id.into(),
        secret_hash: hash_of(id),
        expires_at_ms: expires,
        description: "ci".into(),
    };
    h.now = 2_000_000;
    h.run(mk(&u, "user", "own1", 0)).unwrap();
    h.run(mk(&u, "user", "short1", 2_000_100)).unwrap();
    assert_eq!(reason(&h.run(mk(&u, "peer", "peer1", 0))), Reason::PermissionDenied);
    assert_eq!(reason(&h.run(mk(&u, "user", "own1", 0))), Reason::AlreadyExists);
    assert_eq!(reason(&h.run(mk(&u, "user", "past1", 2_000_000))), Reason::InvalidArgument);
    assert_eq!(reason(&h.run(mk(&u, "user", "BAD", 0))), Reason::InvalidArgument);
    let mut long = mk(&u, "user", "long1", 0);
    if let Command::CreateToken { description, .. } = &mut long {
        *description = "x".repeat(300);
    }
    assert_eq!(reason(&h.run(long)), Reason::InvalidArgument);

    let tok = |id: &str| token::format(id, &secret_of(id));
    assert_eq!(h.st.authenticate(&tok("own1"), h.now).unwrap().principal, "user");
    assert_eq!(h.st.authenticate(&tok("short1"), 2_000_099).unwrap().expires_at_ms, 2_000_100);
    for bad in [
        tok("short1").as_str(),               // checked below at expiry
        "dsk.own1.wrong-secret-0123456789",   // wrong secret
        "dsk.nosuch.secret-0123456789abcdef", // unknown id
        "garbage",
        "",
        &"x".repeat(10_000),
    ] {
        let now = if bad.starts_with("dsk.short1") { 2_000_100 } else { h.now };
        let e = h.st.authenticate(bad, now).unwrap_err();
        assert_eq!(to_api(&e).reason, Reason::Unauthenticated, "{bad}");
        assert!(!e.to_string().contains("wrong-secret"), "the secret must never be echoed: {e}");
    }
    let epoch = h.st.epoch();
    h.run(Command::RevokeToken { actor: u.clone(), now_ms: h.now, token_id: "own1".into() }).unwrap();
    assert_eq!(h.st.epoch(), epoch + 1);
    assert!(h.st.authenticate(&tok("own1"), h.now).unwrap_err().to_string().contains("revoked"));
    // Revoking again changes nothing.
    h.run(Command::RevokeToken { actor: u.clone(), now_ms: h.now, token_id: "own1".into() }).unwrap();
    assert_eq!(h.st.epoch(), epoch + 1);
    // Someone else's token needs principal.manage.
    let p = h.token_for("peer");
    let r = h.run(Command::RevokeToken { actor: u.clone(), now_ms: h.now, token_id: p.token_id.clone() });
    assert_eq!(reason(&r), Reason::PermissionDenied);
}

#[test]
fn epoch_moves_only_when_access_can_shrink() {
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    h.principal("user", "root/a");
    let e0 = h.st.epoch();
    h.grant("user", "root/a", "sandbox.view");
    h.project("root/a/b", Quota::default());
    assert_eq!(h.st.epoch(), e0, "additions do not bump the epoch");
    h.run(Command::RevokeGrant {
        actor: Harness::admin(),
        now_ms: h.now,
        grant: GrantRecord { principal: "user".into(), project: "root/a".into(), permission: "sandbox.view".into() },
    })
    .unwrap();
    assert_eq!(h.st.epoch(), e0 + 1);
    let r = h.run(Command::RevokeGrant {
        actor: Harness::admin(),
        now_ms: h.now,
        grant: GrantRecord { principal: "user".into(), project: "root/a".into(), permission: "sandbox.view".into() },
    });
    assert_eq!(reason(&r), Reason::NotFound);
}

#[test]
fn each_epoch_bump_says_what_it_took_away() {
    use crate::state::Revoked;
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    h.project("root/a/b", Quota::default());
    let u = h.principal("user", "root/a");
    h.grant("user", "root/a/b", "sandbox.view");
    let e0 = h.st.epoch();
    assert_eq!(h.st.revoked_since(e0), Some(vec![]));
    h.run(Command::RevokeToken { actor: u.clone(), now_ms: h.now, token_id: u.token_id.clone() }).unwrap();
    h.run(Command::RevokeGrant {
        actor: Harness::admin(),
        now_ms: h.now,
        grant: GrantRecord { principal: "user".into(), project: "root/a/b".into(), permission: "sandbox.view".into() },
    })
    .unwrap();
    h.run(Command::DeleteProject { actor: Harness::admin(), now_ms: h.now, path: "root/a/b".into() }).unwrap();
    h.run(Command::DeletePrincipal { actor: Harness::admin(), now_ms: h.now, name: "user".into() }).unwrap();
    assert_eq!(h.st.epoch(), e0 + 4);
    assert_eq!(
        h.st.revoked_since(e0),
        Some(vec![
            Revoked::Token(u.token_id.clone()),
            Revoked::Principal("user".into()),
            Revoked::Project("root/a/b".into()),
            Revoked::Principal("user".into()),
        ])
    );
    assert_eq!(h.st.revoked_since(e0 + 3), Some(vec![Revoked::Principal("user".into())]));
    // A state loaded from its rows saw nothing applied: before its epoch, nothing is known
    // (the caller clears everything).
    let reloaded = State::from_rows(h.st.rows());
    assert_eq!(reloaded, h.st);
    assert_eq!(reloaded.revoked_since(e0), None);
    assert_eq!(reloaded.revoked_since(e0 + 4), Some(vec![]));
}

fn mint(h: &mut Harness, actor: &Actor, lease: &str, ids: [&str; 2]) -> Result<Output, IamError> {
    use crate::command::MintedToken;
    use crate::model::ScopeKind;
    let tokens = [ScopeKind::Runtime, ScopeKind::Traffic]
        .into_iter()
        .zip(ids)
        .map(|(kind, id)| MintedToken { kind, token_id: id.into(), secret_hash: hash_of(id) })
        .collect();
    h.run(Command::MintSandboxTokens { actor: actor.clone(), now_ms: h.now, lease_id: lease.into(), tokens })
}

#[test]
fn a_sandbox_token_is_scoped_to_its_lease_and_ends_with_it() {
    use crate::model::{ScopeKind, TokenScope};
    use crate::state::Revoked;
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    let u = h.principal("user", "root/a");
    h.grant("user", "root/a", "sandbox.create");
    h.admit(&u, "l1", "root/a", res(100, 1), "e1").unwrap();
    // Without sandbox.operate: as if the sandbox did not exist.
    assert_eq!(reason(&mint(&mut h, &u, "l1", ["rt1", "tr1"])), Reason::NotFound);
    h.grant("user", "root/a", "sandbox.operate");
    assert_eq!(reason(&mint(&mut h, &u, "nolease", ["rt1", "tr1"])), Reason::NotFound);
    let Output::SandboxTokens(ids) = mint(&mut h, &u, "l1", ["rt1", "tr1"]).unwrap() else { panic!("tokens") };
    assert_eq!((ids[&ScopeKind::Runtime].as_str(), ids[&ScopeKind::Traffic].as_str()), ("rt1", "tr1"));
    // Asked again: the same tokens, nothing new.
    let Output::SandboxTokens(again) = mint(&mut h, &u, "l1", ["rt2", "tr2"]).unwrap() else { panic!("tokens") };
    assert_eq!(again, ids);
    assert!(!h.st.tokens.contains_key("rt2"));

    // The token knows its scope; it can change nothing in IAM, and is not listed.
    let who = h.st.authenticate(&token::format("rt1", &secret_of("rt1")), h.now).unwrap();
    assert_eq!(
        who.scope,
        Some(TokenScope { lease: "l1".into(), kind: ScopeKind::Runtime, parent: u.token_id.clone() })
    );
    let scoped = Actor { principal: "user".into(), token_id: "rt1".into() };
    let r = h.run(Command::CreateProject {
        actor: scoped.clone(),
        now_ms: h.now,
        path: "root/a/x".into(),
        quota: Quota::default(),
    });
    assert_eq!(reason(&r), Reason::PermissionDenied);
    assert_eq!(reason(&h.admit(&scoped, "l2", "root/a", res(1, 1), "e1")), Reason::PermissionDenied);
    assert_eq!(reason(&mint(&mut h, &scoped, "l1", ["rt3", "tr3"])), Reason::PermissionDenied);
    let user_who = h.st.authenticate(&token::format(&u.token_id, &secret_of(&u.token_id)), h.now).unwrap();
    assert!(h.st.list_tokens(&user_who, "").unwrap().iter().all(|t| t.scope.is_none()));

    // Another token of the same principal gets tokens of its own; revoking it ends them
    // (named in the feed), and leaves the first pair alone.
    let u2 = h.token_for("user");
    let Output::SandboxTokens(other) = mint(&mut h, &u2, "l1", ["rt5", "tr5"]).unwrap() else { panic!("tokens") };
    assert_ne!(other, ids);
    let e = h.st.epoch();
    h.run(Command::RevokeToken { actor: u2.clone(), now_ms: h.now, token_id: u2.token_id.clone() }).unwrap();
    let mut gone = h.st.revoked_since(e).unwrap();
    gone.sort_by_key(|r| format!("{r:?}"));
    assert_eq!(
        gone,
        vec![Revoked::Token("rt5".into()), Revoked::Token(u2.token_id.clone()), Revoked::Token("tr5".into())]
    );
    assert!(h.st.authenticate(&token::format("rt5", &secret_of("rt5")), h.now).is_err());
    assert!(h.st.authenticate(&token::format("rt1", &secret_of("rt1")), h.now).is_ok());

    // The lease released (the sandbox ended): the tokens are gone, named in the epoch's feed.
    let e0 = h.st.epoch();
    h.run(Command::ReleaseLeases { now_ms: h.now, lease_ids: vec!["l1".into()], edge: String::new() }).unwrap();
    assert_eq!(h.st.epoch(), e0 + 1);
    let mut ended = h.st.revoked_since(e0).unwrap();
    ended.sort_by_key(|r| format!("{r:?}"));
    assert_eq!(
        ended,
        vec![
            Revoked::Token("rt1".into()),
            Revoked::Token("rt5".into()),
            Revoked::Token("tr1".into()),
            Revoked::Token("tr5".into())
        ]
    );
    for id in ["rt1", "tr1"] {
        assert_eq!(
            to_api(&h.st.authenticate(&token::format(id, &secret_of(id)), h.now).unwrap_err()).reason,
            Reason::Unauthenticated
        );
    }
    // A lease that comes back under the same id has none of them.
    h.admit(&u, "l1", "root/a", res(100, 1), "e1").unwrap();
    assert!(!h.st.tokens_by_lease.contains_key("l1"));
}

#[test]
fn store_bytes_count_each_part_once_and_refuse_past_the_limit() {
    use crate::model::{ImageCharge, StoredPart};
    let mut h = Harness::new();
    h.project("root/a", Quota { store_bytes: Some(100), ..Quota::default() });
    h.project("root/a/x", Quota::default());
    h.project("root/a/y", Quota::default());
    let img = |project: &str, name: &str, parts: &[(&str, u64)]| ImageCharge {
        project: project.into(),
        name: name.into(),
        parts: parts.iter().map(|(id, bytes)| StoredPart { id: (*id).into(), bytes: *bytes }).collect(),
    };
    let charge = |h: &mut Harness, c: ImageCharge| h.run(Command::ChargeImage { now_ms: h.now, charge: c });
    let used = |h: &Harness, p: &str| h.st.usage[p].store_bytes;
    charge(&mut h, img("root/a/x", "base:1", &[("l1", 40), ("l2", 20)])).unwrap();
    // A sibling naming l1 pays for it too; their parent counts it once.
    charge(&mut h, img("root/a/y", "app:1", &[("l1", 40), ("l3", 10), ("l3", 10)])).unwrap();
    assert_eq!((used(&h, "root/a/x"), used(&h, "root/a/y"), used(&h, "root/a"), used(&h, "root")), (60, 50, 70, 70));
    // Past root/a's 100: refused, nothing changed.
    let r = charge(&mut h, img("root/a/x", "big:1", &[("l4", 31)]));
    assert_eq!(reason(&r), Reason::QuotaExceeded);
    assert_eq!(used(&h, "root/a"), 70);
    charge(&mut h, img("root/a/x", "big:1", &[("l4", 30)])).unwrap();
    assert_eq!(used(&h, "root/a"), 100);
    // Replacing an image swaps its parts (what it no longer names is given back).
    charge(&mut h, img("root/a/x", "big:1", &[("l1", 40)])).unwrap();
    assert_eq!(used(&h, "root/a"), 70);
    // Deleting gives back what nothing else names; deleting twice is no error.
    for _ in 0..2 {
        h.run(Command::UnchargeImage { now_ms: h.now, project: "root/a/y".into(), name: "app:1".into() }).unwrap();
    }
    assert_eq!((used(&h, "root/a/y"), used(&h, "root/a")), (0, 60));
    // A project holding images is not deleted.
    let r = h.run(Command::DeleteProject { actor: Harness::admin(), now_ms: h.now, path: "root/a/x".into() });
    assert_eq!(reason(&r), Reason::InvalidState);
    // What the writes rebuild (the harness checks every command) holds the usage too.
    assert_eq!(State::from_rows(h.st.rows()).usage["root/a"].store_bytes, 60);
}

#[test]
fn reconcile_adopts_releases_and_respects_min_age() {
    let mut h = Harness::new();
    h.project("root/a", quota(Some(1000), None, None));
    let u = h.principal("user", "root/a");
    h.grant("user", "root/a", "sandbox.create");
    h.admit(&u, "old", "root/a", res(500, 1), "e1").unwrap();
    h.admit(&u, "elsewhere", "root/a", res(100, 1), "e2").unwrap();
    h.tick(60_000);
    h.admit(&u, "young", "root/a", res(100, 1), "e1").unwrap();
    h.tick(1_000);
    h.lock_for("w", 10_000_000);
    let live = |id: &str, project: &str, cpu: u64| LiveLease {
        lease_id: id.into(),
        project: project.into(),
        principal: "user".into(),
        resources: res(cpu, 1),
        pool: String::new(),
    };
    let r = h
        .run(Command::FencedReconcile {
            now_ms: h.now,
            edge: "e1".into(),
            live: vec![
                live("adopted", "root/a", 900),   // over quota, adopted anyway
                live("elsewhere", "root/a", 100), // IAM binds it to e2: left alone
                live("bad id", "root/a", 1),
                live("orphan", "root/gone", 1),
                live("huge", "root/a", 2_000_000),
            ],
            min_age_ms: 30_000,
            holder: "w".into(),
            read_at_ms: 0,
        })
        .unwrap();
    // "old" is missing and old enough: released; "young" is missing but too young: kept.
    assert_eq!(r, Output::Reconciled { adopted: 1, released: 1 });
    assert!(h.st.lease("old").is_none());
    assert!(h.st.lease("young").is_some());
    assert_eq!(h.st.lease("elsewhere").unwrap().edge, "e2");
    let adopted = h.st.lease("adopted").unwrap();
    assert_eq!((adopted.edge.as_str(), adopted.bound_at_ms), ("e1", h.now));
    assert_eq!(h.usage("root/a").cpu_millis, 100 + 100 + 900);
    // Reconciling again with the same report changes nothing.
    let r = h
        .run(Command::FencedReconcile {
            now_ms: h.now,
            edge: "e1".into(),
            live: vec![live("adopted", "root/a", 900), live("young", "root/a", 100)],
            min_age_ms: 30_000,
            holder: "w".into(),
            read_at_ms: h.now,
        })
        .unwrap();
    assert_eq!(r, Output::Reconciled { adopted: 0, released: 0 });
    // An edge reported empty long enough later loses everything.
    h.tick(3_600_000);
    h.lock_for("w", 10_000);
    let r = h.run(reconcile_empty(h.now, "e1", 30_000, "w", 0)).unwrap();
    assert_eq!(r, Output::Reconciled { adopted: 0, released: 2 });
    let bad = h.run(reconcile_empty(h.now, "E!", 0, "w", 0));
    assert_eq!(reason(&bad), Reason::InvalidArgument);
}

fn reconcile_empty(now_ms: i64, edge: &str, min_age_ms: i64, holder: &str, read_at_ms: i64) -> Command {
    Command::FencedReconcile { now_ms, edge: edge.into(), live: vec![], min_age_ms, holder: holder.into(), read_at_ms }
}

/// A reconciliation is applied only for the reconcile lock's holder, while it holds it, and
/// ages leases at the moment its list was read: a watcher that lost the lock, or whose call
/// comes late, releases nothing it should not.
#[test]
fn reconcile_is_fenced_by_the_lock_and_ages_leases_when_the_list_was_read() {
    let mut h = Harness::new();
    let a = Harness::admin();
    h.admit(&a, "old", "root", res(1, 1), "e1").unwrap();
    h.tick(120_000);
    // No lock at all, then another's lock: refused, nothing released.
    let r = h.run(reconcile_empty(h.now, "e1", 60_000, "w1", 0));
    assert_eq!(reason(&r), Reason::InvalidState, "{r:?}");
    h.lock_for("w2", 15_000);
    let r = h.run(reconcile_empty(h.now, "e1", 60_000, "w1", 0));
    assert_eq!(reason(&r), Reason::InvalidState, "{r:?}");
    assert!(h.st.lease("old").is_some());
    // The holder's own lock, once expired: refused too.
    h.tick(15_000);
    let r = h.run(reconcile_empty(h.now, "e1", 60_000, "w2", 0));
    assert_eq!(reason(&r), Reason::InvalidState, "{r:?}");
    assert!(h.st.lease("old").is_some());
    // A fenced kind without a holder is no fence: refused, whoever holds the lock.
    let r = h.run(reconcile_empty(h.now, "e1", 60_000, "", 0));
    assert_eq!(reason(&r), Reason::InvalidArgument, "{r:?}");
    let r = h.run(Command::FencedSweep { now_ms: h.now, known_edges: vec![], older_than_ms: 0, holder: String::new() });
    assert_eq!(reason(&r), Reason::InvalidArgument, "{r:?}");
    assert!(h.st.lease("old").is_some());

    // A list read before "late" was bound, applied long after: "late" is not in it, yet it
    // was bound after the read, so it stays; "old" was old enough at the read and goes.
    h.lock_for("w2", 15_000);
    let read_at = h.now;
    h.tick(10);
    h.admit(&a, "late", "root", res(1, 1), "e1").unwrap();
    h.tick(300_000);
    h.lock_for("w2", 15_000);
    let r = h.run(reconcile_empty(h.now, "e1", 60_000, "w2", read_at)).unwrap();
    assert_eq!(r, Output::Reconciled { adopted: 0, released: 1 });
    assert!(h.st.lease("old").is_none() && h.st.lease("late").is_some());
    // A read time after the apply time counts as the apply time.
    let r = h.run(reconcile_empty(h.now, "e1", 60_000, "w2", h.now + 10_000_000)).unwrap();
    assert_eq!(r, Output::Reconciled { adopted: 0, released: 1 });
    assert!(h.usage("root").is_zero());
    // A read time far back releases nothing bound since, and does not backdate an adoption:
    // the adopted lease is stamped when IAM applies the call, so it is not released at once.
    h.admit(&a, "kept", "root", res(1, 1), "e1").unwrap();
    h.tick(120_000);
    h.lock_for("w2", 15_000);
    let found = LiveLease {
        lease_id: "found".into(),
        project: "root".into(),
        principal: "".into(),
        resources: res(1, 1),
        pool: String::new(),
    };
    let cmd = Command::FencedReconcile {
        now_ms: h.now,
        edge: "e1".into(),
        live: vec![found],
        min_age_ms: 60_000,
        holder: "w2".into(),
        read_at_ms: 1,
    };
    assert_eq!(h.run(cmd).unwrap(), Output::Reconciled { adopted: 1, released: 0 });
    assert_eq!(h.st.lease("found").unwrap().bound_at_ms, h.now);
    assert!(h.st.lease("kept").is_some());
    h.tick(1_000);
    let r = h.run(reconcile_empty(h.now, "e1", 60_000, "w2", 0)).unwrap();
    assert_eq!(r, Output::Reconciled { adopted: 0, released: 1 }, "only the old one, not the one just adopted");
    assert!(h.st.lease("found").is_some() && h.st.lease("kept").is_none());
}

#[test]
fn sweep_releases_old_leases_on_unknown_edges() {
    let mut h = Harness::new();
    let a = Harness::admin();
    h.admit(&a, "on-known", "root", res(1, 1), "known").unwrap();
    h.admit(&a, "on-lost-old", "root", res(1, 1), "lost").unwrap();
    h.tick(10_000);
    h.admit(&a, "on-lost-new", "root", res(1, 1), "lost").unwrap();
    h.tick(1_000);
    h.lock_for("w", 10_000);
    let sweep = |now_ms: i64, known_edges: Vec<String>, older_than_ms: i64, holder: &str| Command::FencedSweep {
        now_ms,
        known_edges,
        older_than_ms,
        holder: holder.into(),
    };
    // Not for the lock's holder: refused, nothing released.
    let r = h.run(sweep(h.now, vec!["known".into()], 5_000, "other"));
    assert_eq!(reason(&r), Reason::InvalidState);
    assert!(h.st.lease("on-lost-old").is_some());
    let r = h.run(sweep(h.now, vec!["known".into()], 5_000, "w")).unwrap();
    assert_eq!(r, Output::Released { released: 1 });
    assert!(h.st.lease("on-lost-old").is_none());
    assert!(h.st.lease("on-lost-new").is_some() && h.st.lease("on-known").is_some());
    let r = h.run(sweep(h.now, vec![], 0, "w")).unwrap();
    assert_eq!(r, Output::Released { released: 2 });
    assert!(h.usage("root").is_zero());
}

#[test]
fn locks_are_held_renewed_and_taken_over_after_expiry() {
    let mut h = Harness::new();
    let acq = |now: i64, holder: &str| Command::AcquireLock {
        now_ms: now,
        name: "watcher-leader".into(),
        holder: holder.into(),
        ttl_ms: 15_000,
    };
    let lock =
        |acquired: bool, holder: &str, exp: i64| Output::Lock { acquired, holder: holder.into(), expires_at_ms: exp };
    assert_eq!(h.run(acq(1_000, "w1")).unwrap(), lock(true, "w1", 16_000));
    assert_eq!(h.run(acq(2_000, "w2")).unwrap(), lock(false, "w1", 16_000));
    assert_eq!(h.run(acq(5_000, "w1")).unwrap(), lock(true, "w1", 20_000));
    assert_eq!(h.run(acq(19_999, "w2")).unwrap(), lock(false, "w1", 20_000));
    assert_eq!(h.run(acq(20_000, "w2")).unwrap(), lock(true, "w2", 35_000));
    for bad in [
        Command::AcquireLock { now_ms: 1, name: "".into(), holder: "w".into(), ttl_ms: 1 },
        Command::AcquireLock { now_ms: 1, name: "n".into(), holder: "w x".into(), ttl_ms: 1 },
        Command::AcquireLock { now_ms: 1, name: "n".into(), holder: "w".into(), ttl_ms: 0 },
        Command::AcquireLock { now_ms: 1, name: "x".repeat(200), holder: "w".into(), ttl_ms: 1 },
    ] {
        assert_eq!(reason(&h.run(bad)), Reason::InvalidArgument);
    }
}

#[test]
fn listings_check_permissions() {
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    h.project("root/a/x", Quota::default());
    h.project("root/a-b", Quota::default());
    h.principal("user", "root/a");
    h.principal("viewer", "root/a");
    h.grant("viewer", "root/a", "project.view");
    h.grant("user", "root/a/x", "sandbox.create");
    let who = |name: &str| {
        let t = h.st.tokens.values().find(|t| t.principal == name).unwrap().id.clone();
        h.st.authenticate(&token::format(&t, &secret_of(&t)), h.now).unwrap()
    };
    let (user, viewer) = (who("user"), who("viewer"));
    let paths: Vec<String> = h.st.list_projects(&viewer, "").unwrap().into_iter().map(|v| v.path).collect();
    assert_eq!(paths, ["root/a", "root/a/x"]);
    assert!(matches!(h.st.list_projects(&viewer, "root"), Err(IamError::PermissionDenied { .. })));
    assert!(matches!(h.st.get_project(&user, "root/a"), Err(IamError::PermissionDenied { .. })));
    assert!(matches!(h.st.get_project(&viewer, "root/a/nope"), Err(IamError::NotFound { .. })));
    assert!(matches!(h.st.list_principals(&viewer, ""), Err(IamError::PermissionDenied { .. })));
    // Own grants always; others' need grant.manage.
    assert_eq!(h.st.list_grants(&user, "", "").unwrap().len(), 1);
    assert_eq!(h.st.list_grants(&user, "user", "root").unwrap().len(), 1);
    assert!(matches!(h.st.list_grants(&user, "viewer", ""), Err(IamError::PermissionDenied { .. })));
    assert!(matches!(h.st.list_grants(&user, "", "root/a"), Err(IamError::PermissionDenied { .. })));
    let admin = who("admin");
    assert_eq!(h.st.list_grants(&admin, "", "root/a").unwrap().len(), 2);
    assert_eq!(h.st.list_tokens(&user, "").unwrap().len(), 1);
    assert!(matches!(h.st.list_tokens(&user, "viewer"), Err(IamError::PermissionDenied { .. })));
    assert!(matches!(h.st.list_tokens(&user, "ghost"), Err(IamError::PermissionDenied { .. })));
    assert!(matches!(h.st.list_tokens(&admin, "ghost"), Err(IamError::NotFound { .. })));
    assert!(matches!(h.st.backup(&user), Err(IamError::PermissionDenied { .. })));
    assert!(h.st.authorize("user", "sandbox.create", "root/a/x/deeper").unwrap());
    assert!(!h.st.authorize("user", "sandbox.create", "root/a").unwrap());
    assert!(!h.st.authorize("ghost", "sandbox.create", "root").unwrap());
    assert!(h.st.authorize("user", "fly", "root").is_err());
}

#[test]
fn restore_replaces_identities_and_keeps_leases() {
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    h.project("root/gone", Quota::default());
    let a = Harness::admin();
    h.admit(&a, "keep", "root/a", res(1, 1), "e1").unwrap();
    h.admit(&a, "orphan", "root/gone", res(1, 1), "e1").unwrap();
    h.run(Command::AcquireLock { now_ms: h.now, name: "l".into(), holder: "w".into(), ttl_ms: 1000 }).unwrap();
    let admin_who = h.st.authenticate(&token::format("admintoken", &secret_of("admintoken")), h.now).unwrap();
    let mut snap = h.st.backup(&admin_who).unwrap();
    snap.projects.retain(|p| p.path != "root/gone");
    snap.epoch = 40;
    h.principal("later", "root/a");

    // A broken snapshot changes nothing.
    let mut broken = snap.clone();
    broken.principals.push(crate::model::PrincipalRecord {
        name: "x".into(),
        project: "root/zzz".into(),
        created_at_ms: 0,
    });
    let r = h.run(Command::Restore { actor: a.clone(), now_ms: h.now, snapshot: broken });
    assert_eq!(reason(&r), Reason::InvalidArgument);

    h.run(Command::Restore { actor: a.clone(), now_ms: h.now, snapshot: snap.clone() }).unwrap();
    assert_eq!(h.st.epoch(), 41);
    assert!(h.st.principal("later").is_none());
    assert!(h.st.project("root/gone").is_none());
    assert!(h.st.lease("keep").is_some() && h.st.lease("orphan").is_none());
    assert!(h.st.lock("l").is_some());
    // Restoring an older backup still moves the epoch forward.
    snap.epoch = 1;
    h.run(Command::Restore { actor: a, now_ms: h.now, snapshot: snap }).unwrap();
    assert_eq!(h.st.epoch(), 42);
}

#[test]
fn commands_round_trip_through_their_encoding() {
    let cmd = Command::Reconcile {
        now_ms: 5,
        edge: "e1".into(),
        live: vec![LiveLease {
            lease_id: "l".into(),
            project: "root".into(),
            principal: "".into(),
            resources: res(1, 2),
            pool: String::new(),
        }],
        min_age_ms: 60_000,
        holder: "watcher-1".into(),
        read_at_ms: 4,
    };
    assert_eq!(Command::decode(&cmd.encode().unwrap()).unwrap(), cmd);
    assert!(Command::decode(br#"{"v":2,"command":{"type":"release_leases","now_ms":1,"lease_ids":[]}}"#).is_err());
    assert!(Command::decode(b"nonsense").is_err());
}

/// Stored bytes: never edit these strings. If a change breaks this test, the change breaks
/// existing stores and logs; add a migration instead.
#[test]
fn golden_encodings_still_decode() {
    const COMMAND_V1: &str = r#"{"v":1,"command":{"type":"admit","actor":{"principal":"alice","token_id":"a1b2c3d4e5f6g7h8"},"now_ms":1767225600000,"lease_id":"0190a1b2c3d4e5f6a7b8c9d0","project":"root/team-a/rl","resources":{"cpu_millis":2000,"memory_mb":4096,"disk_mb":10240,"gpus":0},"edge":"sim-001"}}"#;
    let cmd = Command::decode(COMMAND_V1.as_bytes()).unwrap();
    assert_eq!(
        cmd,
        Command::Admit {
            actor: Actor { principal: "alice".into(), token_id: "a1b2c3d4e5f6g7h8".into() },
            now_ms: 1_767_225_600_000,
            lease_id: "0190a1b2c3d4e5f6a7b8c9d0".into(),
            project: "root/team-a/rl".into(),
            resources: Resources { cpu_millis: 2000, memory_mb: 4096, disk_mb: 10240, gpus: 0 },
            edge: "sim-001".into(),
            keep_existing: false,
            egress: Vec::new(),
        }
    );
    // Fields added later are left out when unset, so such commands still encode the same.
    assert_eq!(String::from_utf8(cmd.encode().unwrap()).unwrap(), COMMAND_V1);

    const RELEASE_V1: &str =
        r#"{"v":1,"command":{"type":"release_leases","now_ms":1767225600000,"lease_ids":["a","b"]}}"#;
    let cmd = Command::decode(RELEASE_V1.as_bytes()).unwrap();
    assert_eq!(
        cmd,
        Command::ReleaseLeases {
            now_ms: 1_767_225_600_000,
            lease_ids: vec!["a".into(), "b".into()],
            edge: String::new()
        }
    );
    assert_eq!(String::from_utf8(cmd.encode().unwrap()).unwrap(), RELEASE_V1);

    // With the fields added since: keep_existing on Admit, edge on ReleaseLeases.
    const ADMIT_KEEP_V1: &str = r#"{"v":1,"command":{"type":"admit","actor":{"principal":"alice","token_id":"a1b2c3d4e5f6g7h8"},"now_ms":1767225600000,"lease_id":"0190a1b2c3d4e5f6a7b8c9d0","project":"root/team-a/rl","resources":{"cpu_millis":2000,"memory_mb":4096,"disk_mb":10240,"gpus":0},"edge":"sim-001","keep_existing":true}}"#;
    let Command::Admit { keep_existing, edge, .. } = Command::decode(ADMIT_KEEP_V1.as_bytes()).unwrap() else {
        panic!()
    };
    assert!(keep_existing);
    assert_eq!(edge, "sim-001");
    const RELEASE_EDGE_V1: &str =
        r#"{"v":1,"command":{"type":"release_leases","now_ms":1767225600000,"lease_ids":["a"],"edge":"sim-001"}}"#;
    let cmd = Command::decode(RELEASE_EDGE_V1.as_bytes()).unwrap();
    assert_eq!(
        cmd,
        Command::ReleaseLeases { now_ms: 1_767_225_600_000, lease_ids: vec!["a".into()], edge: "sim-001".into() }
    );
    assert_eq!(String::from_utf8(cmd.encode().unwrap()).unwrap(), RELEASE_EDGE_V1);

    // A Reconcile logged before the lock fence (no holder, no read time): applied as it was.
    const RECONCILE_V1: &str = r#"{"v":1,"command":{"type":"reconcile","now_ms":1767225600000,"edge":"sim-001","live":[],"min_age_ms":60000}}"#;
    let cmd = Command::decode(RECONCILE_V1.as_bytes()).unwrap();
    let Command::Reconcile { holder, read_at_ms, .. } = &cmd else { panic!("{cmd:?}") };
    assert_eq!((holder.as_str(), *read_at_ms), ("", 0));
    assert_eq!(String::from_utf8(cmd.encode().unwrap()).unwrap(), RECONCILE_V1);
    let mut h = Harness::new();
    assert_eq!(h.run(cmd).unwrap(), Output::Reconciled { adopted: 0, released: 0 });

    // The fenced kinds: their types are what a release before them cannot decode (it stops
    // short of such an entry instead of applying it without the fence).
    const FENCED_RECONCILE_V1: &str = r#"{"v":1,"command":{"type":"fenced_reconcile","now_ms":1767225600000,"edge":"sim-001","live":[],"min_age_ms":60000,"holder":"watcher-a","read_at_ms":1767225599000}}"#;
    let cmd = Command::decode(FENCED_RECONCILE_V1.as_bytes()).unwrap();
    assert!(
        matches!(&cmd, Command::FencedReconcile { holder, read_at_ms: 1_767_225_599_000, .. } if holder == "watcher-a"),
        "{cmd:?}"
    );
    assert_eq!(String::from_utf8(cmd.encode().unwrap()).unwrap(), FENCED_RECONCILE_V1);
    assert_eq!(reason(&h.run(cmd)), Reason::InvalidState, "no lock held: fenced");
    const FENCED_SWEEP_V1: &str = r#"{"v":1,"command":{"type":"fenced_sweep","now_ms":1767225600000,"known_edges":["sim-001"],"older_than_ms":3600000,"holder":"watcher-a"}}"#;
    let cmd = Command::decode(FENCED_SWEEP_V1.as_bytes()).unwrap();
    assert_eq!(String::from_utf8(cmd.encode().unwrap()).unwrap(), FENCED_SWEEP_V1);
    assert_eq!(cmd.log_format(), 2);
    assert_eq!(reason(&h.run(cmd)), Reason::InvalidState, "no lock held: fenced");
    // What the development release before them wrote: a holder on a Reconcile, fenced too.
    const RECONCILE_HOLDER: &str = r#"{"v":1,"command":{"type":"reconcile","now_ms":1767225600000,"edge":"sim-001","live":[],"min_age_ms":60000,"holder":"watcher-a","read_at_ms":1767225599000}}"#;
    let cmd = Command::decode(RECONCILE_HOLDER.as_bytes()).unwrap();
    assert_eq!(reason(&h.run(cmd)), Reason::InvalidState, "no lock held: fenced");

    const LEASE_ROW_V1: &str = r#"{"v":1,"id":"0190a1b2c3d4e5f6a7b8c9d0","project":"root/team-a/rl","principal":"alice","edge":"sim-001","resources":{"cpu_millis":2000,"memory_mb":4096,"disk_mb":10240,"gpus":0},"created_at_ms":1767225600000,"bound_at_ms":1767225601000}"#;
    let row = crate::store::decode_row(Table::Leases, "0190a1b2c3d4e5f6a7b8c9d0", LEASE_ROW_V1).unwrap();
    let Row::Lease(l) = row else { panic!("{row:?}") };
    assert_eq!((l.project.as_str(), l.edge.as_str(), l.bound_at_ms), ("root/team-a/rl", "sim-001", 1_767_225_601_000));

    const PROJECT_ROW_V1: &str =
        r#"{"v":1,"path":"root/team-a","quota":{"cpu_millis":64000,"sandboxes":100},"created_at_ms":1767225600000}"#;
    let Row::Project(p) = crate::store::decode_row(Table::Projects, "root/team-a", PROJECT_ROW_V1).unwrap() else {
        panic!()
    };
    assert_eq!(p.quota, Quota { cpu_millis: Some(64000), sandboxes: Some(100), ..Quota::default() });

    const META_ROW_V1: &str = r#"{"v":1,"bootstrapped":true,"epoch":7,"hash_key":"0000000000000000000000000000000000000000000000000000000000000000","applied_index":123}"#;
    let Row::Meta(m) = crate::store::decode_row(Table::Meta, "meta", META_ROW_V1).unwrap() else { panic!() };
    assert_eq!((m.epoch, m.applied_index, m.bootstrapped), (7, 123, true));

    const TOKEN_ROW_V1: &str = r#"{"v":1,"id":"a1b2c3d4e5f6g7h8","principal":"alice","secret_hash":"5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843","description":"ci","created_at_ms":1,"expires_at_ms":0,"revoked":false}"#;
    assert!(matches!(
        crate::store::decode_row(Table::Tokens, "a1b2c3d4e5f6g7h8", TOKEN_ROW_V1).unwrap(),
        Row::Token(_)
    ));
    // A row from a future version is refused, not misread.
    let future = r#"{"v":2,"name":"l","holder":"w","expires_at_ms":1}"#;
    assert!(matches!(crate::store::decode_row(Table::Locks, "l", future), Err(IamError::RowVersion { .. })));
}

#[test]
fn backups_encode_and_decode() {
    let h = Harness::new();
    let who = h.st.authenticate(&token::format("admintoken", &secret_of("admintoken")), h.now).unwrap();
    let snap = h.st.backup(&who).unwrap();
    assert_eq!(Snapshot::decode(&snap.encode().unwrap()).unwrap(), snap);
}

// ----- property test -----

#[derive(Clone, Debug)]
enum Op {
    Admit {
        lease: u8,
        project: u8,
        cpu: u64,
        mem: u64,
        edge: u8,
        keep: bool,
    },
    /// `edge`: release only if bound there (`None`: wherever).
    Release {
        lease: u8,
        edge: Option<u8>,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..24, 0u8..5, 1u64..400, 1u64..400, 0u8..3, any::<bool>())
            .prop_map(|(lease, project, cpu, mem, edge, keep)| Op::Admit { lease, project, cpu, mem, edge, keep }),
        1 => (0u8..24, proptest::option::of(0u8..3)).prop_map(|(lease, edge)| Op::Release { lease, edge }),
    ]
}

const PROJECTS: [&str; 5] = ["root", "root/a", "root/a/x", "root/a/y", "root/b"];

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn usage_never_exceeds_effective_limits(
        limits in proptest::collection::vec(proptest::option::of(0u64..1500), 15),
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let mut h = Harness::new();
        let set = |i: usize| Quota { cpu_millis: limits[i * 3], memory_mb: limits[i * 3 + 1], sandboxes: limits[i * 3 + 2].map(|v| v % 8), ..Quota::default() };
        h.run(Command::SetQuota { actor: Harness::admin(), now_ms: h.now, path: "root".into(), quota: set(0) }).unwrap();
        for (i, p) in PROJECTS.iter().enumerate().skip(1) {
            h.project(p, set(i.min(4)));
        }
        for op in ops {
            h.tick(1);
            match op {
                Op::Admit { lease, project, cpu, mem, edge, keep } => {
                    let id = format!("l{lease}");
                    let before = h.st.lease(&id).map(|l| l.edge.clone());
                    let edge = format!("e{edge}");
                    let r = h.admit_with(&Harness::admin(), &id, PROJECTS[project as usize], res(cpu, mem), &edge, keep);
                    match &r {
                        Err(e) => {
                            let r = to_api(e).reason;
                            prop_assert!(r == Reason::QuotaExceeded || r == Reason::InvalidArgument, "{e}");
                        }
                        Ok(Output::Admitted(a)) => {
                            // Bound where the answer says; a kept lease did not move.
                            prop_assert_eq!(&h.st.lease(&id).unwrap().edge, &a.edge);
                            prop_assert_eq!(a.existing, keep && before.is_some());
                            if a.existing {
                                prop_assert_eq!(Some(a.edge.clone()), before);
                            }
                        }
                        Ok(o) => prop_assert!(false, "{o:?}"),
                    }
                }
                Op::Release { lease, edge } => {
                    let id = format!("l{lease}");
                    let edge = edge.map(|e| format!("e{e}")).unwrap_or_default();
                    let bound = h.st.lease(&id).map(|l| l.edge.clone());
                    let n = h.release_on(&[&id], &edge);
                    let expected = bound.as_ref().is_some_and(|b| edge.is_empty() || *b == edge);
                    prop_assert_eq!(n, u32::from(expected));
                    prop_assert_eq!(h.st.lease(&id).is_none(), expected || bound.is_none());
                }
            }
            // The harness already checked usage == sum of leases; now the limits.
            for p in PROJECTS {
                let u = h.usage(p).values();
                for (i, limit) in h.st.effective_quota(p).values().into_iter().enumerate() {
                    if let Some(limit) = limit {
                        prop_assert!(u[i] <= limit, "{p}: key {i} usage {} above {limit}", u[i]);
                    }
                }
            }
        }
    }
}

#[test]
fn taking_over_an_identity_needs_authority_wherever_it_is_granted() {
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    h.project("root/b", Quota::default());
    let a = h.principal("a-admin", "root/a");
    h.grant("a-admin", "root/a", "*");
    let b = h.principal("b-admin", "root/b");
    h.grant("b-admin", "root/b", "*");
    // y lives in root/a; root/b's admin gives it rights there.
    h.principal("y", "root/a");
    h.grant_as(&b, "y", "root/b", "sandbox.create").unwrap();
    let mint = |h: &mut Harness, by: &Actor, principal: &str, id: &str| {
        h.run(Command::CreateToken {
            actor: by.clone(),
            now_ms: h.now,
            principal: principal.into(),
            token_id: id.into(),
            secret_hash: hash_of(id),
            expires_at_ms: 0,
            description: String::new(),
        })
    };
    // root/a's admin can neither become y nor delete it; nor can root/b's (y is not theirs).
    assert_eq!(reason(&mint(&mut h, &a, "y", "ya1")), Reason::PermissionDenied);
    let del = |by: &Actor| Command::DeletePrincipal { actor: by.clone(), now_ms: 1_000_000, name: "y".into() };
    assert_eq!(reason(&h.run(del(&a))), Reason::PermissionDenied);
    assert_eq!(reason(&mint(&mut h, &b, "y", "yb1")), Reason::PermissionDenied);
    // A principal of root/a granted only there stays root/a's to manage.
    h.principal("z", "root/a");
    h.grant_as(&a, "z", "root/a", "sandbox.view").unwrap();
    mint(&mut h, &a, "z", "za1").unwrap();
    // Once root/b takes its grant back, y is root/a's alone again.
    h.run(Command::RevokeGrant {
        actor: b.clone(),
        now_ms: h.now,
        grant: GrantRecord { principal: "y".into(), project: "root/b".into(), permission: "sandbox.create".into() },
    })
    .unwrap();
    mint(&mut h, &a, "y", "ya2").unwrap();
    h.run(del(&a)).unwrap();
    // Someone with authority over both may (the cluster admin).
    h.principal("w", "root/a");
    h.grant_as(&b, "w", "root/b", "sandbox.view").unwrap();
    mint(&mut h, &Harness::admin(), "w", "wadm").unwrap();
}

/// One IAM call of the authorization model: by actor `by` (an index into the actors).
#[derive(Clone, Debug)]
enum AuthOp {
    CreatePrincipal { name: u8, home: u8 },
    Grant { principal: u8, project: u8, perm: u8 },
    Revoke { principal: u8, project: u8, perm: u8 },
    Mint { principal: u8 },
    Delete { principal: u8 },
}

fn auth_op() -> impl Strategy<Value = AuthOp> {
    prop_oneof![
        1 => (0u8..6, 0u8..5).prop_map(|(name, home)| AuthOp::CreatePrincipal { name, home }),
        3 => (0u8..9, 0u8..5, 0u8..11).prop_map(|(principal, project, perm)| AuthOp::Grant { principal, project, perm }),
        1 => (0u8..9, 0u8..5, 0u8..11).prop_map(|(principal, project, perm)| AuthOp::Revoke { principal, project, perm }),
        3 => (0u8..9).prop_map(|principal| AuthOp::Mint { principal }),
        1 => (0u8..9).prop_map(|principal| AuthOp::Delete { principal }),
    ]
}

const AUTH_PROJECTS: [&str; 5] = ["root", "root/a", "root/a/x", "root/b", "root/b/y"];
/// The three actors first, then the pool the calls create, mint for and grant to.
const AUTH_PRINCIPALS: [&str; 9] = ["a-admin", "b-admin", "a-ops", "p0", "p1", "p2", "p3", "p4", "p5"];

/// What actor `tokens` can reach: every (permission, project) some principal it holds a valid
/// token of holds, plus everything on projects where one holds `principal.manage` (the power
/// to act as that project's principals).
fn reach(h: &Harness, tokens: &[Actor]) -> std::collections::BTreeSet<(&'static str, &'static str)> {
    let mut out = std::collections::BTreeSet::new();
    for t in tokens.iter().filter(|t| h.st.check_actor(t, h.now).is_ok()) {
        for proj in AUTH_PROJECTS {
            let manages = h.st.holds(&t.principal, "principal.manage", proj);
            for perm in &crate::model::PERMISSIONS[1..] {
                if manages || h.st.holds(&t.principal, perm, proj) {
                    out.insert((*perm, proj));
                }
            }
        }
    }
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// No sequence of an actor's own IAM calls lets it reach a permission on a project it did
    /// not reach before: grants are bounded by what the granter holds, and becoming another
    /// principal (minting its token) needs authority wherever that principal is granted.
    /// Actors act in turns; the others' grants between turns (their trust decisions) may
    /// widen an actor's reach, its own calls never do.
    #[test]
    fn no_actor_widens_its_own_reach(turns in proptest::collection::vec((0usize..3, proptest::collection::vec(auth_op(), 1..12)), 1..8)) {
        let mut h = Harness::new();
        for p in &AUTH_PROJECTS[1..] {
            h.project(p, Quota::default());
        }
        let mut held: Vec<Vec<Actor>> = vec![
            vec![h.principal("a-admin", "root/a")],
            vec![h.principal("b-admin", "root/b")],
            vec![h.principal("a-ops", "root/a")],
        ];
        h.grant("a-admin", "root/a", "*");
        h.grant("b-admin", "root/b", "*");
        for perm in ["principal.manage", "grant.manage", "sandbox.create"] {
            h.grant("a-ops", "root/a/x", perm);
        }
        // Identities granted across projects, as tenants set them up for collaboration.
        h.run(Command::CreatePrincipal { actor: Harness::admin(), now_ms: h.now, name: "p0".into(), project: "root/a".into() }).unwrap();
        h.run(Command::CreatePrincipal { actor: Harness::admin(), now_ms: h.now, name: "p1".into(), project: "root/b".into() }).unwrap();
        h.run(Command::CreatePrincipal { actor: Harness::admin(), now_ms: h.now, name: "p2".into(), project: "root/a/x".into() }).unwrap();
        h.grant("p0", "root/b", "sandbox.create");
        h.grant("p1", "root/a/x", "sandbox.operate");
        h.grant("p2", "root/b/y", "layer.use");
        let mut minted = 0u32;
        for (by, ops) in turns {
            let before = reach(&h, &held[by]);
            for op in ops {
                h.tick(1);
                // The actor calls with the first of its tokens that still stands.
                let Some(actor) = held[by].iter().find(|t| h.st.check_actor(t, h.now).is_ok()).cloned() else { break };
                let name = |i: u8| AUTH_PRINCIPALS[i as usize].to_string();
                let grant = |principal: u8, project: u8, perm: u8| GrantRecord {
                    principal: name(principal),
                    project: AUTH_PROJECTS[project as usize].into(),
                    permission: crate::model::PERMISSIONS[perm as usize].into(),
                };
                let cmd = match op {
                    AuthOp::CreatePrincipal { name: n, home } => Command::CreatePrincipal {
                        actor, now_ms: h.now, name: name(n + 3), project: AUTH_PROJECTS[home as usize].into(),
                    },
                    AuthOp::Grant { principal, project, perm } => Command::Grant { actor, now_ms: h.now, grant: grant(principal, project, perm) },
                    AuthOp::Revoke { principal, project, perm } => Command::RevokeGrant { actor, now_ms: h.now, grant: grant(principal, project, perm) },
                    AuthOp::Delete { principal } => Command::DeletePrincipal { actor, now_ms: h.now, name: name(principal) },
                    AuthOp::Mint { principal } => {
                        minted += 1;
                        let id = format!("m{minted}");
                        let cmd = Command::CreateToken {
                            actor, now_ms: h.now, principal: name(principal), token_id: id.clone(),
                            secret_hash: hash_of(&id), expires_at_ms: 0, description: String::new(),
                        };
                        if h.run(cmd).is_ok() {
                            held[by].push(Actor { principal: name(principal), token_id: id });
                        }
                        let now = reach(&h, &held[by]);
                        let gained: Vec<_> = now.difference(&before).collect();
                        prop_assert!(gained.is_empty(), "{} gained {gained:?} by minting", AUTH_PRINCIPALS[by]);
                        continue;
                    }
                };
                let _ = h.run(cmd);
                let now = reach(&h, &held[by]);
                let gained: Vec<_> = now.difference(&before).collect();
                prop_assert!(gained.is_empty(), "{} gained {gained:?}", AUTH_PRINCIPALS[by]);
            }
        }
    }
}

#[test]
fn egress_ceilings_bound_the_project_and_its_subprojects() {
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    h.project("root/a/b", Quota::default());
    let u = h.principal("user", "root/a");
    h.grant("user", "root/a", "sandbox.create");
    let ceiling = |h: &mut Harness, actor: &Actor, path: &str, c: Option<Vec<&str>>| {
        h.run(Command::SetEgressCeiling {
            actor: actor.clone(),
            now_ms: h.now,
            path: path.into(),
            ceiling: c.map(|v| v.into_iter().map(String::from).collect()),
        })
    };
    let admit = |h: &mut Harness, lease: &str, egress: &[&str]| {
        h.run(Command::Admit {
            actor: u.clone(),
            now_ms: h.now,
            lease_id: lease.into(),
            project: "root/a/b".into(),
            resources: res(100, 10),
            edge: "e1".into(),
            keep_existing: false,
            egress: egress.iter().map(|s| s.to_string()).collect(),
        })
    };
    // Only the project's admins set it; a bad rule is refused.
    assert!(matches!(ceiling(&mut h, &u, "root/a", Some(vec!["*"])), Err(IamError::PermissionDenied { .. })));
    assert!(matches!(
        ceiling(&mut h, &Harness::admin(), "root/a", Some(vec!["192.0.2.1/24"])),
        Err(IamError::InvalidArgument(_))
    ));
    ceiling(&mut h, &Harness::admin(), "root/a", Some(vec!["pypi.org", "203.0.113.0/24:tcp"])).unwrap();
    assert_eq!(h.st.view("root/a").unwrap().egress_ceiling, Some(vec!["pypi.org".into(), "203.0.113.0/24:tcp".into()]));

    // Within the ceiling of the parent: admitted.
    admit(&mut h, "l1", &["files.pypi.org:tcp/443", "203.0.113.7:tcp/80"]).unwrap();
    // More than it: refused, naming the rule and the project whose ceiling it is.
    let e = admit(&mut h, "l2", &["pypi.org", "*"]).unwrap_err();
    assert!(matches!(&e, IamError::EgressCeiling { project, rule } if project == "root/a" && rule == "*"), "{e}");
    assert_eq!(to_api(&e).reason, Reason::PermissionDenied);
    assert!(admit(&mut h, "l3", &["203.0.113.0/24:udp/53"]).is_err());
    assert!(!h.st.leases.contains_key("l2"), "a refused admission reserves nothing");
    // A stricter ceiling below applies as well; removing the parent's leaves only it.
    ceiling(&mut h, &Harness::admin(), "root/a/b", Some(vec!["pypi.org:tcp/443"])).unwrap();
    assert!(admit(&mut h, "l4", &["pypi.org:tcp/80"]).is_err());
    ceiling(&mut h, &Harness::admin(), "root/a", None).unwrap();
    admit(&mut h, "l5", &["pypi.org:tcp/443"]).unwrap();
    assert!(admit(&mut h, "l6", &["*"]).is_err());
    ceiling(&mut h, &Harness::admin(), "root/a/b", None).unwrap();
    admit(&mut h, "l7", &["*"]).unwrap();
}

fn pool(project: &str, name: &str, image: &str, size: u32) -> crate::model::PoolRecord {
    crate::model::PoolRecord {
        project: project.into(),
        name: name.into(),
        template: opendsec_common::pool::PoolTemplate {
            image: image.into(),
            backend: "fncall".into(),
            cpu_millis: 1000,
            memory_mb: 256,
            disk_mb: 512,
            egress: vec!["pypi.org:tcp/443".into(), "198.51.100.0/24".into()],
            ..Default::default()
        },
        size_per_edge: size,
        created_at_ms: 0,
        updated_at_ms: 0,
    }
}

#[test]
fn pools_are_kept_with_their_revision_and_need_pool_manage() {
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    let put = |h: &mut Harness, actor: &Actor, p: crate::model::PoolRecord, create: bool| {
        let now = h.now;
        h.run(Command::PutPool { actor: actor.clone(), now_ms: now, pool: p, create })
    };
    let created = match put(&mut h, &Harness::admin(), pool("root/a", "py", "python:3.12", 4), true).unwrap() {
        Output::Pool(p) => p,
        o => panic!("{o:?}"),
    };
    // The template is kept canonical (egress sorted), so its revision names it exactly.
    assert_eq!(created.template.egress, vec!["198.51.100.0/24".to_string(), "pypi.org:tcp/443".to_string()]);
    assert_eq!(reason(&put(&mut h, &Harness::admin(), pool("root/a", "py", "x", 1), true)), Reason::AlreadyExists);
    assert_eq!(reason(&put(&mut h, &Harness::admin(), pool("root/a", "nope", "x", 1), false)), Reason::NotFound);
    h.tick(10);
    let updated = match put(&mut h, &Harness::admin(), pool("root/a", "py", "python:3.13", 8), false).unwrap() {
        Output::Pool(p) => p,
        o => panic!("{o:?}"),
    };
    assert_ne!(updated.template.revision(), created.template.revision());
    assert_eq!((updated.created_at_ms, updated.size_per_edge), (created.created_at_ms, 8));
    assert!(updated.updated_at_ms > created.updated_at_ms);
    assert_eq!(h.st.pool("root/a", "py"), Some(&updated));

    // Bad pools: a name, a backend, no resources, a size over the bound, a project missing.
    let mut bad = vec![pool("root/a", "Bad_Name", "x", 1), pool("root/a", "z", "", 1), pool("root/a", "z", "x", 1001)];
    let mut b = pool("root/a", "z", "x", 1);
    b.template.backend = "container".into();
    bad.push(b);
    let mut b = pool("root/a", "z", "x", 1);
    b.template.memory_mb = 0;
    bad.push(b);
    for p in bad {
        assert_eq!(reason(&put(&mut h, &Harness::admin(), p.clone(), true)), Reason::InvalidArgument, "{p:?}");
    }
    assert_eq!(reason(&put(&mut h, &Harness::admin(), pool("root/none", "z", "x", 1), true)), Reason::NotFound);

    // pool.manage on the project (or above) is needed; sandbox rights are not enough.
    let u = h.principal("u", "root/a");
    h.grant("u", "root/a", "sandbox.create");
    assert_eq!(reason(&put(&mut h, &u, pool("root/a", "mine", "x", 1), true)), Reason::PermissionDenied);
    h.grant("u", "root/a", "pool.manage");
    put(&mut h, &u, pool("root/a", "mine", "x", 1), true).unwrap();
    assert_eq!(reason(&put(&mut h, &u, pool("root", "rootpool", "x", 1), true)), Reason::PermissionDenied);
    assert_eq!(h.st.pools_within("root").count(), 2);

    // A project with a pool is not deleted; deleting the pool lets it go.
    let now = h.now;
    let del_project = Command::DeleteProject { actor: Harness::admin(), now_ms: now, path: "root/a".into() };
    h.run(Command::DeletePrincipal { actor: Harness::admin(), now_ms: now, name: "u".into() }).unwrap();
    assert_eq!(reason(&h.run(del_project.clone())), Reason::InvalidState);
    for name in ["py", "mine"] {
        h.run(Command::DeletePool {
            actor: Harness::admin(),
            now_ms: now,
            project: "root/a".into(),
            name: name.into(),
        })
        .unwrap();
    }
    let again =
        Command::DeletePool { actor: Harness::admin(), now_ms: now, project: "root/a".into(), name: "py".into() };
    assert_eq!(reason(&h.run(again)), Reason::NotFound);
    h.run(del_project).unwrap();
}

#[test]
fn backups_carry_pools_and_older_backups_keep_them() {
    let mut h = Harness::new();
    h.project("root/a", Quota::default());
    let now = h.now;
    h.run(Command::PutPool {
        actor: Harness::admin(),
        now_ms: now,
        pool: pool("root/a", "py", "python:3.12", 2),
        create: true,
    })
    .unwrap();
    let admin_who = h.st.authenticate(&token::format("admintoken", &secret_of("admintoken")), h.now).unwrap();
    let snap = h.st.backup(&admin_who).unwrap();
    let decoded = Snapshot::decode(&snap.encode().unwrap()).unwrap();
    assert_eq!(decoded.pools.as_ref().map(Vec::len), Some(1));

    // A pool made after the backup goes with its restore; the backed-up one comes back.
    h.run(Command::PutPool {
        actor: Harness::admin(),
        now_ms: now,
        pool: pool("root/a", "later", "x", 1),
        create: true,
    })
    .unwrap();
    h.run(Command::DeletePool { actor: Harness::admin(), now_ms: now, project: "root/a".into(), name: "py".into() })
        .unwrap();
    h.run(Command::Restore { actor: Harness::admin(), now_ms: h.now, snapshot: decoded.clone() }).unwrap();
    assert!(h.st.pool("root/a", "py").is_some());
    assert!(h.st.pool("root/a", "later").is_none());

    // A backup from before pools (no "pools" key) keeps the pools there are.
    let mut old = decoded.clone();
    old.pools = None;
    h.run(Command::Restore { actor: Harness::admin(), now_ms: h.now, snapshot: old }).unwrap();
    assert!(h.st.pool("root/a", "py").is_some());

    // A backup naming a pool of a project it lacks, or a bad pool, is refused whole.
    let mut bad = decoded;
    bad.pools.as_mut().unwrap().push(pool("root/none", "z", "x", 1));
    let r = h.run(Command::Restore { actor: Harness::admin(), now_ms: h.now, snapshot: bad });
    assert!(r.is_err());
}

#[test]
fn idle_pool_members_are_charged_and_a_claim_takes_a_charge_over() {
    const MEMBER: Resources = Resources { cpu_millis: 1000, memory_mb: 256, disk_mb: 512, gpus: 0 };
    let mut h = Harness::new();
    h.project("root/a", quota(None, None, Some(3)));
    h.project("root/b", quota(None, None, Some(3)));
    let now = h.now;
    h.run(Command::PutPool { actor: Harness::admin(), now_ms: now, pool: pool("root/a", "py", "x", 2), create: true })
        .unwrap();
    let member = |h: &mut Harness, edge: &str, lease: &str| {
        let now = h.now;
        h.run(Command::AdmitMember {
            now_ms: now,
            edge: edge.into(),
            lease_id: lease.into(),
            project: "root/a".into(),
            pool: "py".into(),
            resources: MEMBER,
        })
    };
    // Members on two edges are charged like sandboxes: the quota bounds them over all edges.
    member(&mut h, "e1", "m1").unwrap();
    h.tick(1);
    member(&mut h, "e1", "m2").unwrap();
    h.tick(1);
    member(&mut h, "e2", "m3").unwrap();
    assert_eq!(h.usage("root/a").sandboxes, 3);
    assert_eq!(reason(&member(&mut h, "e2", "m4")), Reason::QuotaExceeded);
    // Again on the same edge: nothing changes; elsewhere, or a sandbox's lease, or no such pool: refused.
    member(&mut h, "e1", "m1").unwrap();
    assert_eq!(reason(&member(&mut h, "e2", "m1")), Reason::AlreadyExists);
    let u = h.principal("u", "root/a");
    h.grant("u", "root/a", "sandbox.create");
    assert_eq!(reason(&h.admit(&u, "m1", "root/a", MEMBER, "e1")), Reason::AlreadyExists);
    let now = h.now;
    let nopool = Command::AdmitMember {
        now_ms: now,
        edge: "e1".into(),
        lease_id: "m9".into(),
        project: "root/b".into(),
        pool: "py".into(),
        resources: res(1, 1),
    };
    assert_eq!(reason(&h.run(nopool)), Reason::NotFound);
    assert_eq!(h.usage("root/b").sandboxes, 0);
    // Only the template's resources are a member's.
    let now = h.now;
    let bigger = Command::AdmitMember {
        now_ms: now,
        edge: "e1".into(),
        lease_id: "m8".into(),
        project: "root/a".into(),
        pool: "py".into(),
        resources: Resources { memory_mb: 100_000, ..MEMBER },
    };
    assert_eq!(reason(&h.run(bigger)), Reason::InvalidArgument);

    // A plain creation finds the quota full of members.
    assert_eq!(reason(&h.admit(&u, "s0", "root/a", MEMBER, "e1")), Reason::QuotaExceeded);
    let claim = |h: &mut Harness, lease: &str, edge: &str, project: &str, r: Resources| {
        let now = h.now;
        h.run(Command::AdmitClaim {
            actor: u.clone(),
            now_ms: now,
            lease_id: lease.into(),
            project: project.into(),
            resources: r,
            edge: edge.into(),
            keep_existing: false,
            egress: Vec::new(),
            pool: "root/a//py".into(),
        })
    };
    // A claim on e1 takes over the oldest member's charge there.
    match claim(&mut h, "s1", "e1", "root/a", MEMBER).unwrap() {
        Output::Admitted(a) => assert_eq!(a.member_lease, "m1"),
        o => panic!("{o:?}"),
    }
    assert!(h.st.lease("m1").is_none());
    assert_eq!(h.usage("root/a").sandboxes, 3);
    // Resources other than the members': no member's charge moves (and the quota is full).
    assert_eq!(reason(&claim(&mut h, "s2", "e1", "root/a", res(2000, 256))), Reason::QuotaExceeded);
    match claim(&mut h, "s2", "e1", "root/a", MEMBER).unwrap() {
        Output::Admitted(a) => assert_eq!(a.member_lease, "m2"),
        o => panic!("{o:?}"),
    }
    // No member left on e1: a claim there is charged on its own, past the quota: refused,
    // and the member on e2 keeps its charge.
    assert_eq!(reason(&claim(&mut h, "s3", "e1", "root/a", MEMBER)), Reason::QuotaExceeded);
    assert!(h.st.lease("m3").is_some());
    // The edge releases a member that goes; the charge goes with it.
    assert_eq!(h.release_on(&["m3"], "e2"), 1);
    assert_eq!(h.usage("root/a").sandboxes, 2);

    // Reconciliation keeps a member's lease an edge reports, but never adopts one IAM does
    // not hold (that would skip the quota): the edge charges it again.
    // A reconciliation of e2, two minutes on, which reports member m5 of pool py.
    let reconcile_m5 = |h: &mut Harness| {
        h.tick(120_000);
        h.lock_for("w1", 15_000);
        let now = h.now;
        let live = LiveLease {
            lease_id: "m5".into(),
            project: "root/a".into(),
            principal: String::new(),
            resources: MEMBER,
            pool: "root/a//py".into(),
        };
        h.run(Command::FencedReconcile {
            now_ms: now,
            edge: "e2".into(),
            live: vec![live],
            min_age_ms: 60_000,
            holder: "w1".into(),
            read_at_ms: now,
        })
        .unwrap()
    };
    assert_eq!(reconcile_m5(&mut h), Output::Reconciled { adopted: 0, released: 0 });
    assert!(h.st.lease("m5").is_none());
    let now = h.now;
    h.run(Command::AdmitMember {
        now_ms: now,
        edge: "e2".into(),
        lease_id: "m5".into(),
        project: "root/a".into(),
        pool: "py".into(),
        resources: MEMBER,
    })
    .unwrap();
    // Reported, it is kept (a member not reported is released like any lease).
    assert_eq!(reconcile_m5(&mut h), Output::Reconciled { adopted: 0, released: 0 });
    match claim(&mut h, "s4", "e2", "root/a", MEMBER).unwrap() {
        Output::Admitted(a) => assert_eq!(a.member_lease, "m5"),
        o => panic!("{o:?}"),
    }
    assert_eq!(h.usage("root/a").sandboxes, 3);

    // The quota lowered under what is held: a claim still takes a member's charge over (no
    // usage changes), so the project drains as members go instead of locking up.
    let now = h.now;
    h.run(Command::AdmitMember {
        now_ms: now,
        edge: "e2".into(),
        lease_id: "m6".into(),
        project: "root/a".into(),
        pool: "py".into(),
        resources: MEMBER,
    })
    .unwrap_err();
    h.release_on(&["s4"], "e2");
    h.run(Command::AdmitMember {
        now_ms: now,
        edge: "e2".into(),
        lease_id: "m6".into(),
        project: "root/a".into(),
        pool: "py".into(),
        resources: MEMBER,
    })
    .unwrap();
    let now = h.now;
    h.run(Command::SetQuota {
        actor: Harness::admin(),
        now_ms: now,
        path: "root/a".into(),
        quota: quota(None, None, Some(1)),
    })
    .unwrap();
    match claim(&mut h, "s5", "e2", "root/a", MEMBER).unwrap() {
        Output::Admitted(a) => assert_eq!(a.member_lease, "m6"),
        o => panic!("{o:?}"),
    }
    assert_eq!(h.usage("root/a").sandboxes, 3);
}
