//! The iam role over real gRPC on loopback: reasons on the wire, restart durability (leases
//! included), revocation and the epoch, backup/restore, the failed-authentication limit and
//! concurrent batch admission.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use opendsec::config::Config;
use opendsec::pb;
use opendsec::pb::iam_client::IamClient;
use opendsec::roles::iam;
use opendsec::rpc::client::{channel, internal, with_token};
use opendsec::rpc::failure_from_status;
use opendsec::shutdown::Shutdown;
use opendsec::telemetry::Ready;
use opendsec::types::Reason;
use tonic::transport::Channel;

const SVC: &str = "svc-secret";
const ADMIN: &str = "dsk.admin.admin-secret-123";

fn config(state: Option<&Path>) -> Config {
    let mut c = Config {
        service_token: SVC.into(),
        ..Default::default()
    };
    c.iam.admin_token = ADMIN.into();
    if let Some(p) = state {
        c.iam.state = p.display().to_string();
    }
    c
}

struct Running {
    client: IamClient<Channel>,
    shutdown: Shutdown,
    handle: tokio::task::JoinHandle<()>,
}

impl Running {
    async fn start(cfg: Config) -> Running {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let shutdown = Shutdown::new();
        let handle = iam::start(Arc::new(cfg), listener, shutdown.clone(), Ready::default())
            .await
            .unwrap();
        let client = IamClient::new(channel(&addr, Duration::from_secs(5)).unwrap());
        Running {
            client,
            shutdown,
            handle,
        }
    }

    async fn stop(self) {
        drop(self.client);
        self.shutdown.fire();
        self.handle.await.unwrap();
    }
}

fn reason<T: std::fmt::Debug>(r: Result<tonic::Response<T>, tonic::Status>) -> Reason {
    failure_from_status(&r.expect_err("call should fail")).reason
}

fn item(lease: &str, project: &str, cpu: f64) -> pb::AdmitItem {
    pb::AdmitItem {
        lease_id: lease.into(),
        project: project.into(),
        resources: Some(pb::Resources {
            cpu_cores: cpu,
            memory_mb: 512,
            sandboxes: 1,
            ..Default::default()
        }),
        edge_id: "edge-1".into(),
        sandbox_id: format!("edge-1.{lease}"),
        keep_binding: false,
        spec_digest: String::new(),
    }
}

async fn admit(
    c: &mut IamClient<Channel>,
    token: &str,
    items: Vec<pb::AdmitItem>,
) -> pb::AdmitResponse {
    let req = pb::AdmitRequest {
        token: token.into(),
        client_addr: "192.0.2.10".into(),
        image_project: "root".into(),
        items,
    };
    c.admit(internal(req, SVC)).await.unwrap().into_inner()
}

async fn epoch(c: &mut IamClient<Channel>) -> u64 {
    c.get_epoch(internal(pb::Empty {}, SVC))
        .await
        .unwrap()
        .into_inner()
        .epoch
}

/// Admin sets up root/team-a (2 sandboxes) and a trainer allowed to create there.
async fn onboard(c: &mut IamClient<Channel>) -> String {
    let req = pb::CreateProjectRequest {
        parent: "root".into(),
        name: "team-a".into(),
        quota: [("sandboxes".to_string(), 2.0)].into(),
    };
    let p = c
        .create_project(with_token(req, ADMIN))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.path, "root/team-a");
    let req = pb::CreatePrincipalRequest {
        project: "root/team-a".into(),
        principal_id: "trainer".into(),
        kind: "".into(),
        ttl: 0,
    };
    let created = c
        .create_principal(with_token(req, ADMIN))
        .await
        .unwrap()
        .into_inner();
    assert!(created.token.starts_with("dsk.trainer."));
    for (project, perm) in [("root/team-a", "sandbox.create"), ("root", "layer.use")] {
        let req = pb::GrantRequest {
            project: project.into(),
            principal: "trainer".into(),
            permissions: vec![perm.into()],
        };
        c.grant(with_token(req, ADMIN)).await.unwrap();
    }
    created.token
}

#[tokio::test]
async fn state_survives_a_restart_and_reasons_reach_the_caller() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("iam.json");
    let mut r = Running::start(config(Some(&state))).await;
    let c = &mut r.client;

    let me = c
        .who_am_i(with_token(pb::Empty {}, ADMIN))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            me.principal.as_str(),
            me.project.as_str(),
            me.token_id.as_str()
        ),
        ("admin", "root", "primary")
    );
    let trainer = onboard(c).await;

    // Admission: two fit, the third is over root/team-a's quota; nothing else fails.
    let out = admit(
        c,
        &trainer,
        vec![
            item("l1", "root/team-a", 1.0),
            item("l2", "root/team-a", 1.0),
            item("l3", "root/team-a", 1.0),
        ],
    )
    .await;
    assert_eq!(out.principal, "trainer");
    assert!(out.results[0].error.is_none() && out.results[1].error.is_none());
    let err = out.results[2].error.as_ref().unwrap();
    assert_eq!(err.reason, "quota_exceeded");
    assert!(
        err.message.contains("root/team-a") && err.message.contains("sandboxes"),
        "{}",
        err.message
    );

    // Reasons of the other kinds.
    let req = pb::CreateProjectRequest {
        parent: "root/team-a".into(),
        name: "x".into(),
        quota: Default::default(),
    };
    assert_eq!(
        reason(c.create_project(with_token(req, &trainer)).await),
        Reason::Forbidden
    );
    assert_eq!(
        reason(
            c.get_project(with_token(
                pb::ProjectRef {
                    project: "root/none".into()
                },
                ADMIN
            ))
            .await
        ),
        Reason::NotFound
    );
    let req = pb::CreateProjectRequest {
        parent: "root".into(),
        name: "bad".into(),
        quota: [("cpu_cores".to_string(), f64::NAN)].into(),
    };
    assert_eq!(
        reason(c.create_project(with_token(req, ADMIN)).await),
        Reason::Invalid
    );
    let req = pb::CreateProjectRequest {
        parent: "root".into(),
        name: "huge".into(),
        quota: [("cpu_cores".to_string(), 2e12)].into(),
    };
    assert_eq!(
        reason(c.create_project(with_token(req, ADMIN)).await),
        Reason::Invalid
    );
    assert_eq!(
        reason(
            c.who_am_i(with_token(pb::Empty {}, "dsk.admin.wrong"))
                .await
        ),
        Reason::Unauthenticated
    );
    assert_eq!(
        reason(c.who_am_i(with_token(pb::Empty {}, "garbage")).await),
        Reason::Unauthenticated
    );
    assert_eq!(
        reason(c.who_am_i(pb::Empty {}).await),
        Reason::Unauthenticated
    );
    let grant = pb::GrantRequest {
        project: "root/team-a".into(),
        principal: "trainer".into(),
        permissions: vec!["layer.publish".into()],
    };
    let e = c.grant(with_token(grant, &trainer)).await.unwrap_err();
    assert_eq!(failure_from_status(&e).reason, Reason::Forbidden);
    assert!(e.message().contains("project.admin"), "{}", e.message());

    // Revocation changes the epoch, and the revoked token stops working.
    let e0 = epoch(c).await;
    let req = pb::CreateTokenRequest {
        principal: "".into(),
        ttl: 0,
        description: "node-7".into(),
    };
    let extra = c
        .create_token(with_token(req, &trainer))
        .await
        .unwrap()
        .into_inner();
    let info = extra.info.unwrap();
    assert_eq!(
        (
            info.principal.as_str(),
            info.description.as_str(),
            info.created_by.as_str()
        ),
        ("trainer", "node-7", "trainer")
    );
    let auth = pb::AuthenticateRequest {
        token: extra.token.clone(),
        client_addr: "192.0.2.1".into(),
    };
    assert_eq!(
        c.authenticate(internal(auth.clone(), SVC))
            .await
            .unwrap()
            .into_inner()
            .principal,
        "trainer"
    );
    let listed = c
        .list_tokens(with_token(
            pb::PrincipalRef {
                principal: "trainer".into(),
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.tokens.len(), 2);
    c.revoke_token(with_token(
        pb::RevokeTokenRequest {
            principal: "trainer".into(),
            token_id: info.id.clone(),
        },
        ADMIN,
    ))
    .await
    .unwrap();
    let e1 = epoch(c).await;
    assert!(e1 > e0, "epoch {e0} -> {e1}");
    assert_eq!(
        reason(c.authenticate(internal(auth, SVC)).await),
        Reason::Unauthenticated
    );

    let before = c
        .get_project(with_token(
            pb::ProjectRef {
                project: "root/team-a".into(),
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(before.usage["sandboxes"], 2.0);
    r.stop().await;

    // Restart on the same state file: everything committed is there, leases included.
    let mut r = Running::start(config(Some(&state))).await;
    let c = &mut r.client;
    let after = c
        .get_project(with_token(
            pb::ProjectRef {
                project: "root/team-a".into(),
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(after, before);
    assert_eq!(epoch(c).await, e1);
    let lease = c
        .get_lease(internal(
            pb::GetLeaseRequest {
                lease_id: "l1".into(),
            },
            SVC,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        (
            lease.project.as_str(),
            lease.principal.as_str(),
            lease.edge_id.as_str()
        ),
        ("root/team-a", "trainer", "edge-1")
    );
    // Batched lookups return only the leases held.
    let many = c
        .get_leases(internal(
            pb::GetLeasesRequest {
                lease_ids: vec!["l1".into(), "never-admitted".into()],
            },
            SVC,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        many.leases
            .iter()
            .map(|l| l.lease_id.as_str())
            .collect::<Vec<_>>(),
        vec!["l1"]
    );
    let too_many = c
        .get_leases(internal(
            pb::GetLeasesRequest {
                lease_ids: (0..4097).map(|i| i.to_string()).collect(),
            },
            SVC,
        ))
        .await;
    assert_eq!(
        failure_from_status(&too_many.unwrap_err()).reason,
        Reason::Invalid
    );
    assert!(
        c.get_leases(pb::GetLeasesRequest {
            lease_ids: vec!["l1".into()]
        })
        .await
        .is_err(),
        "internal calls need the service token"
    );
    // A retried admission finds the lease and charges nothing.
    let out = admit(c, &trainer, vec![item("l1", "root/team-a", 1.0)]).await;
    assert!(out.results[0].existed && out.results[0].error.is_none());
    assert_eq!(out.results[0].edge_id, "edge-1");
    // Releasing frees the quota and the usage report counts it.
    let rel = c
        .release_leases(internal(
            pb::ReleaseLeasesRequest {
                lease_ids: vec!["l1".into(), "l2".into(), "zz".into()],
                at: 0,
                not_created: false,
            },
            SVC,
        ))
        .await
        .unwrap();
    assert_eq!(rel.into_inner().released, 2);
    let out = admit(c, &trainer, vec![item("l4", "root/team-a", 1.0)]).await;
    assert!(out.results[0].error.is_none());
    let usage = c
        .get_usage(with_token(
            pb::GetUsageRequest {
                project: "root".into(),
                ..Default::default()
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner();
    let total = usage.rows.last().unwrap();
    assert_eq!(
        (total.day.as_str(), total.project.as_str()),
        ("total", "root")
    );
    assert_eq!(total.sandboxes_started, 3);
    // Reconciliation: an unknown lease on the edge is adopted; a lost edge releases all.
    let alive = |id: &str| pb::LeaseInfo {
        lease_id: id.into(),
        project: "root/team-a".into(),
        principal: "trainer".into(),
        resources: Some(pb::Resources {
            cpu_cores: 1.0,
            ..Default::default()
        }),
        edge_id: "edge-1".into(),
        sandbox_id: format!("edge-1.{id}"),
        ..Default::default()
    };
    let req = pb::ReconcileRequest {
        edge_id: "edge-1".into(),
        leases: vec![alive("l4"), alive("l9")],
        min_age_s: 60,
        fence: 0,
    };
    assert_eq!(
        c.reconcile(internal(req.clone(), SVC))
            .await
            .unwrap()
            .into_inner(),
        pb::ReconcileResponse {
            adopted: 1,
            released: 0
        }
    );
    assert_eq!(
        c.reconcile(internal(req, SVC)).await.unwrap().into_inner(),
        pb::ReconcileResponse {
            adopted: 0,
            released: 0
        }
    );
    // A reconciliation under a fence of the watchers' lock applies only while that hold
    // lasts: once another watcher has the lock, a late call changes nothing.
    let lock = |holder: &str| pb::LockRequest {
        name: "watcher-reconcile".into(),
        holder: holder.into(),
        ttl_ms: 10_000,
    };
    let old = c
        .lock(internal(lock("watcher/a"), SVC))
        .await
        .unwrap()
        .into_inner();
    let unlock = pb::UnlockRequest {
        name: "watcher-reconcile".into(),
        holder: "watcher/a".into(),
    };
    c.unlock(internal(unlock, SVC)).await.unwrap();
    let new = c
        .lock(internal(lock("watcher/b"), SVC))
        .await
        .unwrap()
        .into_inner();
    assert!(new.fence > old.fence);
    let late = pb::ReconcileRequest {
        edge_id: "edge-1".into(),
        leases: vec![],
        min_age_s: 0,
        fence: old.fence,
    };
    assert_eq!(
        reason(c.reconcile(internal(late, SVC)).await),
        Reason::Conflict
    );
    let sweep = pb::SweepUnboundRequest {
        max_age_s: -1,
        fence: old.fence,
    };
    assert_eq!(
        reason(c.sweep_unbound(internal(sweep, SVC)).await),
        Reason::Conflict
    );
    let lost = pb::ReconcileRequest {
        edge_id: "edge-1".into(),
        leases: vec![],
        min_age_s: 0,
        fence: new.fence,
    };
    assert_eq!(
        c.reconcile(internal(lost, SVC)).await.unwrap().into_inner(),
        pb::ReconcileResponse {
            adopted: 0,
            released: 2
        }
    );
    let p = c
        .get_project(with_token(
            pb::ProjectRef {
                project: "root".into(),
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.usage["sandboxes"], 0.0);
    let bad = pb::GetUsageRequest {
        project: "root".into(),
        start: "2026-13-45".into(),
        ..Default::default()
    };
    assert_eq!(
        reason(c.get_usage(with_token(bad, ADMIN)).await),
        Reason::Invalid
    );
    assert_eq!(
        reason(
            c.get_usage(with_token(
                pb::GetUsageRequest {
                    project: "root".into(),
                    ..Default::default()
                },
                &trainer
            ))
            .await
        ),
        Reason::Forbidden
    );
    r.stop().await;
}

#[tokio::test]
async fn internal_calls_need_the_service_token() {
    let mut r = Running::start(config(None)).await;
    let c = &mut r.client;
    assert_eq!(
        reason(c.get_epoch(pb::Empty {}).await),
        Reason::Unauthenticated
    );
    assert_eq!(
        reason(c.get_epoch(internal(pb::Empty {}, "wrong")).await),
        Reason::Unauthenticated
    );
    let req = pb::AuthorizeRequest {
        principal: "admin".into(),
        project: "root".into(),
        permission: "fleet.operate".into(),
    };
    assert!(
        c.authorize(internal(req, SVC))
            .await
            .unwrap()
            .into_inner()
            .allowed
    );
    // A project that does not exist: not_found for a caller the permission would cover, a
    // plain refusal for one it would not (nothing leaks).
    let req = pb::AuthorizeRequest {
        principal: "admin".into(),
        project: "root/x".into(),
        permission: "layer.publish".into(),
    };
    assert_eq!(
        reason(c.authorize(internal(req, SVC)).await),
        Reason::NotFound
    );
    let req = pb::AuthorizeRequest {
        principal: "nobody".into(),
        project: "root/x".into(),
        permission: "layer.publish".into(),
    };
    assert!(
        !c.authorize(internal(req, SVC))
            .await
            .unwrap()
            .into_inner()
            .allowed
    );
    let req = pb::AuthorizeRequest {
        principal: "admin".into(),
        project: "root".into(),
        permission: "root.all".into(),
    };
    assert_eq!(
        reason(c.authorize(internal(req, SVC)).await),
        Reason::Invalid
    );
    let req = pb::SweepUnboundRequest {
        max_age_s: -1,
        fence: 0,
    };
    assert_eq!(
        reason(c.sweep_unbound(internal(req, SVC)).await),
        Reason::Invalid
    );
    r.stop().await;
}

#[tokio::test]
async fn backup_and_restore_keep_leases() {
    let mut r = Running::start(config(None)).await;
    let c = &mut r.client;
    let trainer = onboard(c).await;
    assert_eq!(
        reason(c.backup(with_token(pb::Empty {}, &trainer)).await),
        Reason::Forbidden
    );
    let data = c
        .backup(with_token(pb::Empty {}, ADMIN))
        .await
        .unwrap()
        .into_inner()
        .data;
    let out = admit(c, &trainer, vec![item("l1", "root/team-a", 1.0)]).await;
    assert!(out.results[0].error.is_none());
    let req = pb::CreateProjectRequest {
        parent: "root".into(),
        name: "later".into(),
        quota: Default::default(),
    };
    c.create_project(with_token(req, ADMIN)).await.unwrap();
    let e0 = epoch(c).await;
    assert_eq!(
        reason(
            c.restore(with_token(
                pb::IamRestoreRequest {
                    data: b"nope".to_vec()
                },
                ADMIN
            ))
            .await
        ),
        Reason::Invalid
    );
    c.restore(with_token(pb::IamRestoreRequest { data }, ADMIN))
        .await
        .unwrap();
    assert!(epoch(c).await > e0);
    assert_eq!(
        reason(
            c.get_project(with_token(
                pb::ProjectRef {
                    project: "root/later".into()
                },
                ADMIN
            ))
            .await
        ),
        Reason::NotFound
    );
    let p = c
        .get_project(with_token(
            pb::ProjectRef {
                project: "root/team-a".into(),
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.usage["sandboxes"], 1.0);
    assert!(c
        .get_lease(internal(
            pb::GetLeaseRequest {
                lease_id: "l1".into()
            },
            SVC
        ))
        .await
        .is_ok());
    r.stop().await;
}

#[tokio::test]
async fn failed_authentications_lock_out_new_tokens_of_that_address() {
    let mut cfg = config(None);
    cfg.admission.auth_fail_rate = 2.0;
    let mut r = Running::start(cfg).await;
    let c = &mut r.client;
    let trainer = onboard(c).await;
    let auth = |token: &str, addr: &str| {
        internal(
            pb::AuthenticateRequest {
                token: token.into(),
                client_addr: addr.into(),
            },
            SVC,
        )
    };
    c.authenticate(auth(ADMIN, "203.0.113.5")).await.unwrap();
    for _ in 0..3 {
        assert_eq!(
            reason(c.authenticate(auth("dsk.admin.guess", "203.0.113.5")).await),
            Reason::Unauthenticated
        );
    }
    // Locked out: a token never seen from there is not checked, even a valid one.
    assert_eq!(
        reason(c.authenticate(auth(&trainer, "203.0.113.5")).await),
        Reason::RateLimited
    );
    assert_eq!(
        reason(c.authenticate(auth("dsk.admin.guess", "203.0.113.5")).await),
        Reason::RateLimited
    );
    // The token that authenticated from there keeps working; other addresses are unaffected.
    c.authenticate(auth(ADMIN, "203.0.113.5")).await.unwrap();
    c.authenticate(auth(&trainer, "203.0.113.6")).await.unwrap();
    r.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_and_single_admissions_run_concurrently() {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("iam.json");
    let mut r = Running::start(config(Some(&state))).await;
    let c = &mut r.client;
    let trainer = onboard(c).await;
    let req = pb::SetQuotaRequest {
        project: "root/team-a".into(),
        quota: [("sandboxes".to_string(), 100000.0)].into(),
    };
    c.set_quota(with_token(req, ADMIN)).await.unwrap();
    let mut tasks = Vec::new();
    for b in 0..4 {
        let (mut c, t) = (r.client.clone(), trainer.clone());
        tasks.push(tokio::spawn(async move {
            let items = (0..256)
                .map(|i| item(&format!("b{b}-{i}"), "root/team-a", 0.25))
                .collect();
            let out = admit(&mut c, &t, items).await;
            assert!(out.results.iter().all(|r| r.error.is_none()));
        }));
    }
    for s in 0..4 {
        let (mut c, t) = (r.client.clone(), trainer.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..25 {
                let out = admit(
                    &mut c,
                    &t,
                    vec![item(&format!("s{s}-{i}"), "root/team-a", 0.25)],
                )
                .await;
                assert!(out.results[0].error.is_none());
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let p = r
        .client
        .get_project(with_token(
            pb::ProjectRef {
                project: "root/team-a".into(),
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.usage["sandboxes"], 1124.0);
    r.stop().await;
    let mut r = Running::start(config(Some(&state))).await;
    let p = r
        .client
        .get_project(with_token(
            pb::ProjectRef {
                project: "root".into(),
            },
            ADMIN,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.usage["sandboxes"], 1124.0);
    assert_eq!(p.usage["cpu_cores"], 281.0);
    r.stop().await;
}

#[tokio::test]
async fn placeholder_admin_tokens_are_refused() {
    let mut cfg = config(None);
    cfg.iam.admin_token = "dsk.admin.change-me".into();
    assert!(matches!(
        iam::build(&cfg).await,
        Err(iam::IamError::Config(_))
    ));
    cfg.iam.admin_token = "dsk.someone-else.secret".into();
    assert!(matches!(
        iam::build(&cfg).await,
        Err(iam::IamError::Config(_))
    ));
}
