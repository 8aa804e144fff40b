//! The watcher over real sockets: probing marks a dead edge unhealthy, registrations add
//! edges, and a lost edge's quota is released after `lost_edge_grace`.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::sync::Arc;
use std::time::Duration;

use opendsec::config::{ApiserverConfig, BackendConfig, Config, EdgeConfig};
use opendsec::pb;
use opendsec::rpc::client::{channel, internal, with_token};
use opendsec::shutdown::Shutdown;
use opendsec::telemetry::Ready;
use tokio::net::TcpListener;

async fn listener() -> (TcpListener, String) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = l.local_addr().unwrap().to_string();
    (l, a)
}

fn edge(id: &str, addr: &str, dir: &std::path::Path) -> EdgeConfig {
    let mut backends = std::collections::BTreeMap::new();
    backends.insert(
        "sim".to_string(),
        BackendConfig {
            runtime: "sim".into(),
            ..Default::default()
        },
    );
    EdgeConfig {
        id: id.into(),
        addr: addr.into(),
        backends,
        state_dir: dir.display().to_string(),
        mem_reserve_mb: -1,
        disk_reserve_mb: -1,
        ..Default::default()
    }
}

async fn snapshot(addr: &str, token: &str) -> pb::Snapshot {
    let mut w =
        pb::watcher_client::WatcherClient::new(channel(addr, Duration::from_secs(1)).unwrap());
    w.get_snapshot(internal(pb::GetSnapshotRequest { min_version: 0 }, token))
        .await
        .unwrap()
        .into_inner()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_edges_turn_unhealthy_and_their_quota_is_released() {
    let dir = tempfile::tempdir().unwrap();
    let (iam_l, iam_a) = listener().await;
    let (w_l, w_a) = listener().await;
    let (e1_l, e1_a) = listener().await;
    let (e2_l, e2_a) = listener().await;
    let (api_l, api_a) = listener().await;
    let mut cfg = Config {
        service_token: "svc".into(),
        ..Default::default()
    };
    cfg.iam.addr = iam_a;
    cfg.iam.admin_token = "dsk.admin.topsecret".into();
    cfg.watcher.addr = w_a.clone();
    cfg.watcher.probe_interval = 0.1;
    cfg.watcher.probe_timeout = 0.5;
    cfg.watcher.unhealthy_after = 2;
    cfg.watcher.reconcile_interval = 0.3;
    // Leases younger than this are never released: creations in flight are not on the edge yet
    // (IAM counts whole seconds, so 2 means at least one full second).
    cfg.watcher.reconcile_min_age = 2.0;
    cfg.watcher.lost_edge_grace = 0.5;
    cfg.apiserver = vec![ApiserverConfig {
        addr: api_a.clone(),
        snapshot_refresh: 0.1,
        ..Default::default()
    }];
    // e2 is not listed: it is known only through its registration.
    cfg.edges = vec![edge("e1", &e1_a, dir.path())];
    let mut tmpl = edge("tmpl", "", dir.path());
    tmpl.id = String::new();
    cfg.edge_template = Some(tmpl);
    let cfg = Arc::new(cfg);
    let all = Shutdown::new();
    let e1_down = Shutdown::new();
    opendsec::roles::iam::start(cfg.clone(), iam_l, all.clone(), Ready::default())
        .await
        .unwrap();
    let e1 = opendsec::roles::edge::start(
        cfg.clone(),
        "e1".into(),
        e1_l,
        e1_down.clone(),
        Ready::default(),
    )
    .await
    .unwrap();
    opendsec::roles::edge::start(
        cfg.clone(),
        "e2".into(),
        e2_l,
        all.clone(),
        Ready::default(),
    )
    .await
    .unwrap();
    opendsec::roles::watcher::start(cfg.clone(), "0", w_l, all.clone(), Ready::default())
        .await
        .unwrap();
    let api_ready = Ready::default();
    opendsec::roles::apiserver::start(cfg.clone(), 0, api_l, all.clone(), api_ready.clone())
        .await
        .unwrap();

    // Both edges become healthy; e2 through its registration.
    let mut both = false;
    for _ in 0..100 {
        let s = snapshot(&w_a, "svc").await;
        if s.edges.len() == 2 && s.edges.iter().all(|e| e.healthy) {
            both = true;
            assert_eq!(s.edges.iter().find(|e| e.id == "e2").unwrap().addr, e2_a);
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(both, "edges did not all become healthy");
    // The watcher refuses callers without the service token.
    let mut w =
        pb::watcher_client::WatcherClient::new(channel(&w_a, Duration::from_secs(1)).unwrap());
    assert!(w
        .get_snapshot(pb::GetSnapshotRequest { min_version: 0 })
        .await
        .is_err());

    while !api_ready.get() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut c = pb::d_sec_client::DSecClient::new(channel(&api_a, Duration::from_secs(1)).unwrap());
    let t = "dsk.admin.topsecret";
    // The apiserver places from its own copy of the snapshot, refreshed on its own schedule:
    // wait until that copy has both edges too.
    let mut seen = 0;
    for _ in 0..100 {
        let s = c
            .cluster_status(with_token(pb::Empty {}, t))
            .await
            .unwrap()
            .into_inner();
        seen = s.edges.iter().filter(|e| e.healthy).count();
        if seen == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(seen, 2, "the apiserver's snapshot never showed both edges");
    let mut s = c
        .create_sandboxes(with_token(
            pb::CreateSandboxesRequest {
                spec: Some(pb::SandboxSpec {
                    backend: "sim".into(),
                    ..Default::default()
                }),
                project: "root".into(),
                count: 40,
                idempotency_key: String::new(),
            },
            t,
        ))
        .await
        .unwrap()
        .into_inner();
    let mut on_e1 = 0;
    while let Some(item) = s.message().await.unwrap() {
        if item.sandbox.unwrap().edge_id == "e1" {
            on_e1 += 1;
        }
    }
    assert!(
        on_e1 > 0 && on_e1 < 40,
        "placement should use both edges, e1 got {on_e1}"
    );
    let usage = |p: pb::Project| p.usage.get("sandboxes").copied().unwrap_or(0.0);
    assert_eq!(
        usage(
            c.get_project(with_token(
                pb::ProjectRef {
                    project: "root".into()
                },
                t
            ))
            .await
            .unwrap()
            .into_inner()
        ),
        40.0
    );

    // Reconciliation of healthy edges changes nothing.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        usage(
            c.get_project(with_token(
                pb::ProjectRef {
                    project: "root".into()
                },
                t
            ))
            .await
            .unwrap()
            .into_inner()
        ),
        40.0
    );
    // e1 dies: it turns unhealthy, then its quota comes back; e2's stays.
    e1_down.fire();
    let _ = e1.await;
    let mut released = false;
    for _ in 0..100 {
        let s = snapshot(&w_a, "svc").await;
        let e1_state = s.edges.iter().find(|e| e.id == "e1").unwrap();
        let used = usage(
            c.get_project(with_token(
                pb::ProjectRef {
                    project: "root".into(),
                },
                t,
            ))
            .await
            .unwrap()
            .into_inner(),
        );
        if !e1_state.healthy && used == (40 - on_e1) as f64 {
            released = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(released, "the lost edge's quota was not released");
    // A list names the lost edge instead of silently leaving its sandboxes out.
    let listed = c
        .list_sandboxes(with_token(
            pb::ListSandboxesRequest {
                project: "root".into(),
                ..Default::default()
            },
            t,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.sandboxes.len(), 40 - on_e1);
    assert!(listed.sandboxes.iter().all(|s| s.edge_id == "e2"));
    assert_eq!(listed.unreachable_edges, vec!["e1".to_string()]);
    all.fire();
}
