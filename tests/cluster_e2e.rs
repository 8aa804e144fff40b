//! End to end through the whole stack (client → apiserver → IAM → edge) on an in-process
//! simulated cluster: lifecycle, batches, idempotent retries and bad input.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::Duration;

use opendsec::pb;
use opendsec::pb::d_sec_client::DSecClient;
use opendsec::roles::cluster::{LocalCluster, UpOptions};
use opendsec::rpc::client::{channel, with_token};
use opendsec::rpc::failure_from_status;
use opendsec::types::Reason;
use tonic::transport::Channel;

async fn up(edges: usize) -> (LocalCluster, DSecClient<Channel>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let o = UpOptions {
        sim_edges: edges,
        addr: "127.0.0.1:0".into(),
        state_dir: dir.path().display().to_string(),
        disk_reserve_mb: -1,
        ..Default::default()
    };
    let c = LocalCluster::up(&o).await.unwrap();
    let client = DSecClient::new(channel(&c.api_addrs[0], Duration::from_secs(2)).unwrap())
        .max_decoding_message_size(80 << 20);
    (c, client, dir)
}

fn spec() -> pb::SandboxSpec {
    pb::SandboxSpec {
        backend: "sim".into(),
        ..Default::default()
    }
}

async fn count(c: &mut DSecClient<Channel>, token: &str, project: &str) -> usize {
    c.list_sandboxes(with_token(
        pb::ListSandboxesRequest {
            project: project.into(),
            task_id: String::new(),
            include_ended: false,
        },
        token,
    ))
    .await
    .unwrap()
    .into_inner()
    .sandboxes
    .len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_through_the_stack() {
    let (cluster, mut c, _d) = up(2).await;
    let t = cluster.admin_token.clone();
    let sb = c
        .create_sandbox(with_token(
            pb::CreateSandboxRequest {
                spec: Some(pb::SandboxSpec {
                    task_id: "job-1".into(),
                    ..spec()
                }),
                ..Default::default()
            },
            &t,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(sb.state, pb::SandboxState::Running as i32);
    assert_eq!(sb.project, "root");
    assert_eq!(sb.principal, "admin");
    assert!(sb.id.starts_with(&format!("{}.", sb.edge_id)));
    let s = sb.spec.clone().unwrap();
    assert_eq!(
        (
            s.cpu_cores_limit,
            s.memory_limit_mb,
            s.ttl_running_stop,
            s.ttl_max
        ),
        (1.0, 2048, 3600, 86400)
    );

    let got = c
        .get_sandbox(with_token(pb::SandboxRef { id: sb.id.clone() }, &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(got.id, sb.id);
    let p = c
        .pause_sandbox(with_token(pb::SandboxRef { id: sb.id.clone() }, &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(p.state, pb::SandboxState::Paused as i32);
    let r = c
        .resume_sandbox(with_token(pb::SandboxRef { id: sb.id.clone() }, &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.state, pb::SandboxState::Running as i32);
    let tr = c
        .pause_task(with_token(
            pb::TaskRequest {
                project: "root".into(),
                task_id: "job-1".into(),
            },
            &t,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(tr.affected, 1);
    assert_eq!(count(&mut c, &t, "root").await, 1);

    let proj = c
        .get_project(with_token(
            pb::ProjectRef {
                project: "root".into(),
            },
            &t,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(proj.usage.get("sandboxes").copied().unwrap_or(0.0), 1.0);

    let st = c
        .stop_sandbox(with_token(pb::SandboxRef { id: sb.id.clone() }, &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.state, pb::SandboxState::Stopped as i32);
    assert_eq!(count(&mut c, &t, "root").await, 0);
    // The quota comes back at once.
    let mut freed = false;
    for _ in 0..50 {
        let proj = c
            .get_project(with_token(
                pb::ProjectRef {
                    project: "root".into(),
                },
                &t,
            ))
            .await
            .unwrap()
            .into_inner();
        if proj.usage.get("sandboxes").copied().unwrap_or(0.0) == 0.0 {
            freed = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(freed, "quota not returned after stop");
    let ended = c
        .list_sandboxes(with_token(
            pb::ListSandboxesRequest {
                project: "root".into(),
                task_id: String::new(),
                include_ended: true,
            },
            &t,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(ended.sandboxes.len(), 1);
    cluster.down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_are_in_order_and_retries_create_only_what_is_missing() {
    let (cluster, mut c, _d) = up(3).await;
    let t = cluster.admin_token.clone();
    let req = pb::CreateSandboxesRequest {
        spec: Some(spec()),
        project: "root".into(),
        count: 2000,
        idempotency_key: "batch-key-1".into(),
    };
    // First attempt: read part of the stream, then drop it (a broken connection).
    let mut s = c
        .create_sandboxes(with_token(req.clone(), &t))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..300 {
        s.message().await.unwrap().unwrap();
    }
    drop(s);
    // The retry with the same key ends with exactly 2000 distinct sandboxes.
    let mut s = c
        .create_sandboxes(with_token(req.clone(), &t))
        .await
        .unwrap()
        .into_inner();
    let mut ids = std::collections::BTreeSet::new();
    let mut indices = std::collections::BTreeSet::new();
    while let Some(item) = s.message().await.unwrap() {
        assert!(item.error.is_none(), "{:?}", item.error);
        indices.insert(item.index);
        ids.insert(item.sandbox.unwrap().id);
    }
    assert_eq!(ids.len(), 2000);
    assert_eq!(indices.len(), 2000);
    assert_eq!(count(&mut c, &t, "root").await, 2000);
    let proj = c
        .get_project(with_token(
            pb::ProjectRef {
                project: "root".into(),
            },
            &t,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        proj.usage.get("sandboxes").copied().unwrap_or(0.0),
        2000.0,
        "one lease per sandbox"
    );
    // A single creation retried with its key returns the same sandbox.
    let one = pb::CreateSandboxRequest {
        spec: Some(spec()),
        project: String::new(),
        idempotency_key: "single-1".into(),
    };
    let a = c
        .create_sandbox(with_token(one.clone(), &t))
        .await
        .unwrap()
        .into_inner();
    let b = c
        .create_sandbox(with_token(one, &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(a.id, b.id);
    assert_eq!(count(&mut c, &t, "root").await, 2001);
    cluster.down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_the_right_reason_and_changes_nothing() {
    let (cluster, mut c, _d) = up(1).await;
    let t = cluster.admin_token.clone();
    let create = |s: pb::SandboxSpec, project: &str| pb::CreateSandboxRequest {
        spec: Some(s),
        project: project.into(),
        idempotency_key: String::new(),
    };
    let cases: Vec<(pb::CreateSandboxRequest, Reason)> = vec![
        (
            create(
                pb::SandboxSpec {
                    backend: "nope".into(),
                    ..Default::default()
                },
                "",
            ),
            Reason::Invalid,
        ),
        (
            create(
                pb::SandboxSpec {
                    backend: String::new(),
                    ..Default::default()
                },
                "",
            ),
            Reason::Invalid,
        ),
        (
            create(
                pb::SandboxSpec {
                    ttl_max: 604801,
                    ..spec()
                },
                "",
            ),
            Reason::Invalid,
        ),
        (
            create(
                pb::SandboxSpec {
                    cpu_cores_limit: -2.0,
                    ..spec()
                },
                "",
            ),
            Reason::Invalid,
        ),
        (
            create(
                pb::SandboxSpec {
                    memory_limit_mb: i64::MAX,
                    ..spec()
                },
                "",
            ),
            Reason::Invalid,
        ),
        (
            create(
                pb::SandboxSpec {
                    disk_mb: -1,
                    ..spec()
                },
                "",
            ),
            Reason::Invalid,
        ),
        (create(spec(), "root/bad name"), Reason::Invalid),
        (create(spec(), "elsewhere"), Reason::Invalid),
        (
            create(
                pb::SandboxSpec {
                    image: "no-such-local-image".into(),
                    ..spec()
                },
                "",
            ),
            Reason::NotFound,
        ),
    ];
    for (i, (req, want)) in cases.into_iter().enumerate() {
        let e = c.create_sandbox(with_token(req, &t)).await.unwrap_err();
        assert_eq!(
            failure_from_status(&e).reason,
            want,
            "case {i}: {}",
            e.message()
        );
    }
    let e = c
        .create_sandboxes(with_token(
            pb::CreateSandboxesRequest {
                spec: Some(spec()),
                project: String::new(),
                count: 32769,
                idempotency_key: String::new(),
            },
            &t,
        ))
        .await
        .unwrap_err();
    assert_eq!(failure_from_status(&e).reason, Reason::Invalid);
    for bad in ["", "garbage", "dsk.admin.wrong-secret", "dsk.nobody.x.y"] {
        let e = c
            .create_sandbox(with_token(create(spec(), ""), bad))
            .await
            .unwrap_err();
        assert_eq!(
            failure_from_status(&e).reason,
            Reason::Unauthenticated,
            "token {bad:?}"
        );
    }
    for bad in ["nodot", "sim-0.", "UPPER.x", "sim-0.a/b"] {
        let e = c
            .get_sandbox(with_token(pb::SandboxRef { id: bad.into() }, &t))
            .await
            .unwrap_err();
        assert_eq!(
            failure_from_status(&e).reason,
            Reason::Invalid,
            "id {bad:?}"
        );
    }
    let e = c
        .get_sandbox(with_token(
            pb::SandboxRef {
                id: "sim-0.abcdef".into(),
            },
            &t,
        ))
        .await
        .unwrap_err();
    assert_eq!(failure_from_status(&e).reason, Reason::NotFound);
    let e = c
        .get_sandbox(with_token(
            pb::SandboxRef {
                id: "no-edge.abcdef".into(),
            },
            &t,
        ))
        .await
        .unwrap_err();
    assert_eq!(failure_from_status(&e).reason, Reason::NotFound);
    assert_eq!(
        count(&mut c, &t, "root").await,
        0,
        "bad input created something"
    );
    let proj = c
        .get_project(with_token(
            pb::ProjectRef {
                project: "root".into(),
            },
            &t,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(proj.usage.get("sandboxes").copied().unwrap_or(0.0), 0.0);
    // The servers are all still up.
    c.create_sandbox(with_token(create(spec(), ""), &t))
        .await
        .unwrap();
    cluster.down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_and_permissions_through_the_apiserver() {
    let (cluster, mut c, _d) = up(1).await;
    let t = cluster.admin_token.clone();
    let mut q = std::collections::HashMap::new();
    q.insert("sandboxes".to_string(), 2.0);
    c.create_project(with_token(
        pb::CreateProjectRequest {
            parent: "root".into(),
            name: "team".into(),
            quota: q,
        },
        &t,
    ))
    .await
    .unwrap();
    c.create_project(with_token(
        pb::CreateProjectRequest {
            parent: "root/team".into(),
            name: "rl".into(),
            quota: Default::default(),
        },
        &t,
    ))
    .await
    .unwrap();
    let p = c
        .create_principal(with_token(
            pb::CreatePrincipalRequest {
                project: "root/team".into(),
                principal_id: "trainer".into(),
                kind: "agent".into(),
                ttl: 0,
            },
            &t,
        ))
        .await
        .unwrap()
        .into_inner();
    let tok = p.token;
    // No permission yet: forbidden.
    let req = || pb::CreateSandboxRequest {
        spec: Some(spec()),
        project: "root/team/rl".into(),
        idempotency_key: String::new(),
    };
    let e = c.create_sandbox(with_token(req(), &tok)).await.unwrap_err();
    assert_eq!(failure_from_status(&e).reason, Reason::Forbidden);
    c.grant(with_token(
        pb::GrantRequest {
            project: "root/team".into(),
            principal: "trainer".into(),
            permissions: vec!["sandbox.create".into(), "sandbox.operate".into()],
        },
        &t,
    ))
    .await
    .unwrap();
    c.create_sandbox(with_token(req(), &tok)).await.unwrap();
    c.create_sandbox(with_token(req(), &tok)).await.unwrap();
    // The third is over root/team's quota, though root/team/rl has none of its own.
    let e = c.create_sandbox(with_token(req(), &tok)).await.unwrap_err();
    let f = failure_from_status(&e);
    assert_eq!(f.reason, Reason::QuotaExceeded);
    assert!(
        f.message.contains("root/team") && f.message.contains("sandboxes"),
        "{}",
        f.message
    );
    // The principal sees its project's sandboxes but cannot list root's.
    assert_eq!(count(&mut c, &tok, "root/team").await, 2);
    let e = c
        .list_sandboxes(with_token(
            pb::ListSandboxesRequest {
                project: "root".into(),
                ..Default::default()
            },
            &tok,
        ))
        .await
        .unwrap_err();
    assert_eq!(failure_from_status(&e).reason, Reason::Forbidden);
    cluster.down().await;
}

/// `UpdateNetwork` through the apiserver: rules are checked there (a malformed rule or an
/// unknown rule set is `invalid` naming it, and no edge is asked), `sandbox.operate` is
/// needed, and the edge answers for its networking (off on sim edges: an allowance is
/// refused naming the setting, taking rules back is fine) and for ended sandboxes.
/// A sim sandbox, and the token of a new principal of root ("viewer") with no grant on it.
async fn sandbox_and_viewer(
    c: &mut DSecClient<Channel>,
    t: &str,
) -> (pb::Sandbox, pb::CreatePrincipalResponse) {
    let sb = c
        .create_sandbox(with_token(
            pb::CreateSandboxRequest {
                spec: Some(spec()),
                ..Default::default()
            },
            t,
        ))
        .await
        .unwrap()
        .into_inner();
    let p = c
        .create_principal(with_token(
            pb::CreatePrincipalRequest {
                project: "root".into(),
                principal_id: "viewer".into(),
                kind: "agent".into(),
                ttl: 0,
            },
            t,
        ))
        .await
        .unwrap()
        .into_inner();
    (sb, p)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_network_through_the_apiserver() {
    let (cluster, mut c, _d) = up(1).await;
    let t = cluster.admin_token.clone();
    let (sb, p) = sandbox_and_viewer(&mut c, &t).await;
    let update = |rules: &[(&str, bool)], replace: bool| pb::UpdateNetworkRequest {
        id: sb.id.clone(),
        rules: rules.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        replace,
    };
    let fail = |e: tonic::Status| failure_from_status(&e);
    for (rules, says) in [
        (
            &[("x.io:70000", true)][..],
            "rules: network rule \"x.io:70000\": port outside 1-65535",
        ),
        (
            &[("npm", true)],
            "rules: network rule \"npm\": no rule set named \"npm\"",
        ),
        (
            &[("github.com", true), ("*.github.com", false)],
            "are the same rule with different values",
        ),
    ] {
        let f = fail(
            c.update_network(with_token(update(rules, false), &t))
                .await
                .unwrap_err(),
        );
        assert_eq!(f.reason, Reason::Invalid, "{rules:?}");
        assert!(f.message.contains(says), "{rules:?}: {}", f.message);
    }
    let f = fail(
        c.update_network(with_token(update(&[("192.0.2.10", true)], false), &t))
            .await
            .unwrap_err(),
    );
    assert_eq!(f.reason, Reason::Invalid);
    assert!(
        f.message.contains("edges[].network.enabled is false"),
        "{}",
        f.message
    );
    let got = c
        .update_network(with_token(update(&[("*", false)], false), &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        got.spec.unwrap().network_rules,
        [("*".to_string(), false)].into()
    );
    let got = c
        .get_sandbox(with_token(pb::SandboxRef { id: sb.id.clone() }, &t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        got.spec.unwrap().network_rules,
        [("*".to_string(), false)].into()
    );

    // A principal without sandbox.operate on the sandbox's project.
    let f = fail(
        c.update_network(with_token(update(&[], true), &p.token))
            .await
            .unwrap_err(),
    );
    assert_eq!(f.reason, Reason::Forbidden);

    c.stop_sandbox(with_token(pb::SandboxRef { id: sb.id.clone() }, &t))
        .await
        .unwrap();
    let f = fail(
        c.update_network(with_token(update(&[], true), &t))
            .await
            .unwrap_err(),
    );
    assert_eq!(f.reason, Reason::Conflict);
    cluster.down().await;
}

/// `ConnectPort` through the apiserver: the first frame is checked (port, sandbox) and
/// authorized with sandbox.operate before any edge is asked; a sim sandbox runs nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connect_port_checks_its_first_frame_and_authorizes() {
    let (cluster, mut c, _d) = up(1).await;
    let t = cluster.admin_token.clone();
    let (sb, p) = sandbox_and_viewer(&mut c, &t).await;
    let frame = |id: &str, port: u32| pb::PortFrame {
        sandbox_id: id.into(),
        port,
        ..Default::default()
    };
    let missing = format!("{}x", sb.id);
    for (first, token, reason, says) in [
        (
            frame(&sb.id, 0),
            &t,
            Reason::Invalid,
            "port: 0 is outside 1-65535",
        ),
        (
            frame(&sb.id, 65536),
            &t,
            Reason::Invalid,
            "port: 65536 is outside 1-65535",
        ),
        (frame(&sb.id, 80), &t, Reason::Invalid, "runs nothing"),
        (frame(&missing, 80), &t, Reason::NotFound, ""),
        (frame(&sb.id, 80), &p.token, Reason::Forbidden, ""),
    ] {
        let e = c
            .connect_port(with_token(tokio_stream::once(first.clone()), token))
            .await
            .unwrap_err();
        let f = failure_from_status(&e);
        assert_eq!(f.reason, reason, "{first:?}: {}", f.message);
        assert!(f.message.contains(says), "{first:?}: {}", f.message);
    }
    // A stream that ends before its first frame.
    let e = c
        .connect_port(with_token(tokio_stream::empty(), &t))
        .await
        .unwrap_err();
    let f = failure_from_status(&e);
    assert_eq!(f.reason, Reason::Invalid);
    assert!(
        f.message.contains("before its first frame"),
        "{}",
        f.message
    );
    cluster.down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_audit_log_records_calls_and_only_digests_of_commands() {
    let dir = tempfile::tempdir().unwrap();
    let audit = dir.path().join("audit");
    let o = UpOptions {
        sim_edges: 1,
        addr: "127.0.0.1:0".into(),
        state_dir: dir.path().display().to_string(),
        disk_reserve_mb: -1,
        audit_dir: audit.display().to_string(),
        audit_runtime: true,
        ..Default::default()
    };
    let cluster = LocalCluster::up(&o).await.unwrap();
    let mut c = DSecClient::new(channel(&cluster.api_addrs[0], Duration::from_secs(2)).unwrap());
    let t = cluster.admin_token.clone();
    let sb = c
        .create_sandbox(with_token(
            pb::CreateSandboxRequest {
                spec: Some(spec()),
                ..Default::default()
            },
            &t,
        ))
        .await
        .unwrap()
        .into_inner();
    let secret_cmd = "echo the-secret-password";
    // The sim backend runs nothing, so the command fails; it is audited all the same.
    let e = c
        .run_shell(with_token(
            pb::RunShellRequest {
                sandbox_id: sb.id.clone(),
                cmd: secret_cmd.into(),
                ..Default::default()
            },
            &t,
        ))
        .await
        .unwrap_err();
    assert_eq!(failure_from_status(&e).reason, Reason::Invalid);
    c.stop_sandbox(with_token(pb::SandboxRef { id: sb.id.clone() }, &t))
        .await
        .unwrap();
    let _ = c
        .create_sandbox(with_token(
            pb::CreateSandboxRequest {
                spec: Some(spec()),
                ..Default::default()
            },
            "dsk.admin.wrong",
        ))
        .await
        .unwrap_err();
    let text = std::fs::read_to_string(audit.join("audit.log")).unwrap();
    assert!(
        !text.contains("the-secret-password"),
        "commands must never be written in clear"
    );
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let find = |m: &str| {
        lines
            .iter()
            .find(|l| l["method"] == m)
            .cloned()
            .unwrap_or_else(|| panic!("no {m} line in {text}"))
    };
    let create = find("CreateSandbox");
    assert_eq!(create["principal"], "admin");
    assert_eq!(create["sandbox_id"], sb.id);
    assert_eq!(create["reason"], "ok");
    let run = find("RunShell");
    assert_eq!(run["cmd_len"], secret_cmd.len());
    assert_eq!(run["cmd_sha256"].as_str().unwrap().len(), 64);
    assert_eq!(run["reason"], "invalid");
    assert_eq!(find("StopSandbox")["reason"], "ok");
    assert!(
        lines.iter().any(|l| l["reason"] == "unauthenticated"),
        "failed authentications are audited"
    );
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(
        std::fs::metadata(audit.join("audit.log"))
            .unwrap()
            .permissions()
            .mode()
            & 0o777,
        0o600
    );
    cluster.down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_whose_caller_went_away_stops_creating() {
    // Each sim creation takes a second, so whether the apiserver noticed the caller leave is
    // a matter of a second, not of how fast a loaded machine schedules the connection task.
    let dir = tempfile::tempdir().unwrap();
    let o = UpOptions {
        sim_edges: 2,
        addr: "127.0.0.1:0".into(),
        state_dir: dir.path().display().to_string(),
        disk_reserve_mb: -1,
        create_latency_ms: 1000.0,
        ..Default::default()
    };
    let cluster = LocalCluster::up(&o).await.unwrap();
    let mut c = DSecClient::new(channel(&cluster.api_addrs[0], Duration::from_secs(2)).unwrap())
        .max_decoding_message_size(80 << 20);
    let t = cluster.admin_token.clone();
    let req = pb::CreateSandboxesRequest {
        spec: Some(spec()),
        project: "root".into(),
        count: 30000,
        idempotency_key: "gone".into(),
    };
    let mut s = c
        .create_sandboxes(with_token(req, &t))
        .await
        .unwrap()
        .into_inner();
    for _ in 0..10 {
        s.message().await.unwrap().unwrap();
    }
    drop(s);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let n = count(&mut c, &t, "root").await;
    // Four chunks of 512 start at once; when the first results reach the caller, the next four
    // have started. Had the batch gone on, four more would have started a second later.
    assert!(n <= 8 * 512, "{n} sandboxes created after the caller left");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(count(&mut c, &t, "root").await, n, "creation went on");
    cluster.down().await;
}
