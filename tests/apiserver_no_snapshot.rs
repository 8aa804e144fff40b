//! A freshly started apiserver that has no cluster snapshot from a watcher yet (just
//! restarted, watcher slow or restarting) must answer `unavailable`, which callers retry —
//! not `not_found` ("no edge"), `invalid` ("no edge offers the backend") or an empty list.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::sync::Arc;
use std::time::Duration;

use opendsec::config::{ApiserverConfig, Config};
use opendsec::pb;
use opendsec::pb::d_sec_client::DSecClient;
use opendsec::rpc::client::{channel, with_token};
use opendsec::rpc::failure_from_status;
use opendsec::shutdown::Shutdown;
use opendsec::telemetry::Ready;
use opendsec::types::Reason;

fn reason(s: &tonic::Status) -> Reason {
    failure_from_status(s).reason
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_apiserver_without_a_snapshot_answers_unavailable() {
    // A watcher address nobody listens on: the snapshot never comes.
    let dead = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let watcher_addr = dead.local_addr().unwrap().to_string();
    drop(dead);
    let iam_l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api_l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let api_addr = api_l.local_addr().unwrap().to_string();
    let token = "dsk.admin.no-snapshot-test-secret".to_string();
    let mut cfg = Config {
        service_token: "svc-secret".into(),
        ..Default::default()
    };
    cfg.iam.addr = iam_l.local_addr().unwrap().to_string();
    cfg.iam.admin_token = token.clone();
    cfg.watcher.addr = watcher_addr;
    cfg.apiserver = vec![ApiserverConfig {
        addr: api_addr.clone(),
        snapshot_refresh: 0.2,
        ..Default::default()
    }];
    let cfg = Arc::new(cfg);
    let shutdown = Shutdown::new();
    let iam = opendsec::roles::iam::start(cfg.clone(), iam_l, shutdown.clone(), Ready::default())
        .await
        .unwrap();
    let api = opendsec::roles::apiserver::start(
        cfg.clone(),
        0,
        api_l,
        shutdown.clone(),
        Ready::default(),
    )
    .await
    .unwrap();
    let mut c = DSecClient::new(channel(&api_addr, Duration::from_secs(2)).unwrap());
    // IAM answers (authentication works), so only the snapshot is missing.
    let me = c
        .who_am_i(with_token(pb::Empty {}, &token))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(me.principal, "admin");

    let got = c
        .get_sandbox(with_token(
            pb::SandboxRef {
                id: "e1.abcdef".into(),
            },
            &token,
        ))
        .await
        .unwrap_err();
    assert_eq!(reason(&got), Reason::Unavailable, "{got:?}");
    let stop = c
        .stop_sandbox(with_token(
            pb::SandboxRef {
                id: "e1.abcdef".into(),
            },
            &token,
        ))
        .await
        .unwrap_err();
    assert_eq!(reason(&stop), Reason::Unavailable, "{stop:?}");
    let spec = pb::SandboxSpec {
        backend: "sim".into(),
        ..Default::default()
    };
    let one = c
        .create_sandbox(with_token(
            pb::CreateSandboxRequest {
                spec: Some(spec.clone()),
                project: "root".into(),
                ..Default::default()
            },
            &token,
        ))
        .await
        .unwrap_err();
    assert_eq!(reason(&one), Reason::Unavailable, "{one:?}");
    let list = c
        .list_sandboxes(with_token(
            pb::ListSandboxesRequest {
                project: "root".into(),
                ..Default::default()
            },
            &token,
        ))
        .await
        .unwrap_err();
    assert_eq!(reason(&list), Reason::Unavailable, "{list:?}");
    // A batch ends its stream with `unavailable` (the SDK resumes it with the same key)
    // rather than sending each item as failed.
    let req = pb::CreateSandboxesRequest {
        spec: Some(spec),
        project: "root".into(),
        count: 3,
        idempotency_key: "k".into(),
    };
    let mut s = c
        .create_sandboxes(with_token(req, &token))
        .await
        .unwrap()
        .into_inner();
    let end = match s.message().await {
        Ok(Some(item)) => panic!("no item expected, got {item:?}"),
        Ok(None) => panic!("the stream ended without an error"),
        Err(st) => st,
    };
    assert_eq!(reason(&end), Reason::Unavailable, "{end:?}");
    // Nothing was admitted: no quota is held.
    let p = c
        .get_project(with_token(
            pb::ProjectRef {
                project: "root".into(),
            },
            &token,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.usage.get("sandboxes").copied().unwrap_or(0.0), 0.0);

    shutdown.fire();
    let _ = tokio::time::timeout(Duration::from_secs(10), async {
        let _ = api.await;
        let _ = iam.await;
    })
    .await;
}
