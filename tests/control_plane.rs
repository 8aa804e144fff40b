//! The control plane under create/stop churn, on an in-process simulated cluster: quota is
//! free the moment a stop returns, placement never refuses a sandbox that fits because the
//! snapshot still shows one just stopped, an edge's internal failures never turn into
//! `no_capacity`, an idempotency key is tied to its spec, and every apiserver request has
//! its own tracing span.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use opendsec::config::{ApiserverConfig, BackendConfig, CapacityConfig, Config, EdgeConfig};
use opendsec::pb;
use opendsec::pb::d_sec_client::DSecClient;
use opendsec::roles::cluster::LocalCluster;
use opendsec::rpc::client::{channel, with_token};
use opendsec::rpc::failure_from_status;
use opendsec::types::{Failure, Reason};
use tonic::transport::Channel;

/// One simulated edge per entry of `edges`: (cpu cores, failure rate of its creations).
async fn cluster(
    edges: &[(f64, f64)],
) -> (LocalCluster, DSecClient<Channel>, String, tempfile::TempDir) {
    cluster_with(edges, |_| {}).await
}

/// [`cluster`], with `tune` applied to the config last.
async fn cluster_with(
    edges: &[(f64, f64)],
    tune: impl FnOnce(&mut Config),
) -> (LocalCluster, DSecClient<Channel>, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let secret = || hex::encode(rand::random::<[u8; 16]>());
    let mut cfg = Config {
        service_token: secret(),
        ..Default::default()
    };
    cfg.iam.addr = "127.0.0.1:0".into();
    cfg.iam.admin_token = format!("dsk.admin.{}", secret());
    cfg.watcher.addr = "127.0.0.1:0".into();
    cfg.watcher.probe_interval = 0.25;
    cfg.watcher.reconcile_interval = 5.0;
    cfg.apiserver = vec![ApiserverConfig {
        addr: "127.0.0.1:0".into(),
        snapshot_refresh: 0.25,
        ..Default::default()
    }];
    cfg.admission.create_rate = -1.0;
    cfg.admission.request_rate = -1.0;
    for (i, (cpu, failure_rate)) in edges.iter().enumerate() {
        let mut backends = BTreeMap::new();
        backends.insert(
            "sim".to_string(),
            BackendConfig {
                runtime: "sim".into(),
                default_disk_mb: 1024,
                failure_rate: *failure_rate,
                ..Default::default()
            },
        );
        cfg.edges.push(EdgeConfig {
            id: format!("sim-{i}"),
            addr: "127.0.0.1:0".into(),
            capacity: CapacityConfig {
                cpu_cores: *cpu,
                memory_mb: 1 << 30,
                gpus: 0,
                disk_mb: 1 << 30,
            },
            backends,
            state_dir: dir.path().display().to_string(),
            mem_reserve_mb: -1,
            disk_reserve_mb: -1,
            persist_state: Some(false),
            ..Default::default()
        });
    }
    tune(&mut cfg);
    let c = LocalCluster::from_config(cfg).await.unwrap();
    let client = DSecClient::new(channel(&c.api_addrs[0], Duration::from_secs(2)).unwrap())
        .max_decoding_message_size(80 << 20);
    let t = c.admin_token.clone();
    (c, client, t, dir)
}

fn spec(cpu: f64) -> pb::SandboxSpec {
    pb::SandboxSpec {
        backend: "sim".into(),
        cpu_cores_limit: cpu,
        ..Default::default()
    }
}

async fn create(
    c: &mut DSecClient<Channel>,
    t: &str,
    project: &str,
    spec: pb::SandboxSpec,
    key: &str,
) -> Result<pb::Sandbox, Failure> {
    c.create_sandbox(with_token(
        pb::CreateSandboxRequest {
            spec: Some(spec),
            project: project.into(),
            idempotency_key: key.into(),
        },
        t,
    ))
    .await
    .map(|r| r.into_inner())
    .map_err(|s| failure_from_status(&s))
}

async fn stop(c: &mut DSecClient<Channel>, t: &str, id: &str) {
    let sb = c
        .stop_sandbox(with_token(pb::SandboxRef { id: id.into() }, t))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(sb.state, pb::SandboxState::Stopped as i32);
}

async fn batch(
    c: &mut DSecClient<Channel>,
    t: &str,
    project: &str,
    spec: pb::SandboxSpec,
    count: u32,
    key: &str,
) -> Vec<Result<pb::Sandbox, Failure>> {
    use tokio_stream::StreamExt;
    let mut s = c
        .create_sandboxes(with_token(
            pb::CreateSandboxesRequest {
                spec: Some(spec),
                project: project.into(),
                count,
                idempotency_key: key.into(),
            },
            t,
        ))
        .await
        .unwrap()
        .into_inner();
    let mut out: Vec<Option<Result<pb::Sandbox, Failure>>> = vec![None; count as usize];
    while let Some(item) = s.next().await {
        let item = item.unwrap();
        out[item.index as usize] = Some(match (item.sandbox, item.error) {
            (Some(sb), None) => Ok(sb),
            (_, Some(e)) => Err(opendsec::rpc::status::failure_from_detail(&e)),
            _ => Err(Failure::internal("empty item")),
        });
    }
    out.into_iter().map(|x| x.unwrap()).collect()
}

async fn project_with_quota(c: &mut DSecClient<Channel>, t: &str, name: &str, sandboxes: f64) {
    let mut q = std::collections::HashMap::new();
    q.insert("sandboxes".to_string(), sandboxes);
    c.create_project(with_token(
        pb::CreateProjectRequest {
            parent: "root".into(),
            name: name.into(),
            quota: q,
        },
        t,
    ))
    .await
    .unwrap();
}

/// A sandbox access token spends the call rate of its sandbox's creator: a caller with
/// three sandboxes gets no more calls through their three tokens than by itself, and the
/// calls it made through them count against its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandbox_tokens_spend_their_creator_s_call_rate() {
    const BURST: f64 = 12.0;
    let (cluster, mut c, t, _d) = cluster_with(&[(64.0, 0.0)], |cfg| {
        // Next to no refill: what passes is the burst.
        cfg.admission.request_rate = 0.01;
        cfg.admission.request_burst = BURST;
    })
    .await;
    let key =
        opendsec::rpc::grant::GrantKey::from_service_token(&cluster.cfg.service_token).unwrap();
    let made = batch(&mut c, &t, "", spec(1.0), 3, "").await;
    let tokens: Vec<(String, String)> = made
        .into_iter()
        .map(|r| {
            let id = r.unwrap().id;
            (key.mint(&id), id)
        })
        .collect();
    let (mut passed, mut limited) = (0, 0);
    for round in 0..BURST as usize {
        for (token, id) in &tokens {
            let r = c
                .get_sandbox(with_token(pb::SandboxRef { id: id.clone() }, token))
                .await;
            match r.map_err(|s| failure_from_status(&s)) {
                Ok(sb) => {
                    assert_eq!(&sb.into_inner().id, id);
                    passed += 1;
                }
                Err(f) => {
                    assert_eq!(f.reason, Reason::RateLimited, "round {round}: {f}");
                    assert!(f.message.contains("\"admin\""), "{f}");
                    limited += 1;
                }
            }
        }
    }
    // One burst in all (less the creation's call); per sandbox, each token would have had
    // a whole burst of its own and none would have been refused.
    assert!(passed <= BURST as usize, "{passed} calls passed");
    assert!(limited >= 2 * BURST as usize, "{limited} calls refused");
    assert_eq!(passed + limited, 3 * BURST as usize);
    // The creator's own calls are out of rate now too.
    let f = c
        .get_sandbox(with_token(
            pb::SandboxRef {
                id: tokens[0].1.clone(),
            },
            &t,
        ))
        .await
        .map_err(|s| failure_from_status(&s))
        .unwrap_err();
    assert_eq!(f.reason, Reason::RateLimited, "{f}");
    cluster.down().await;
}

/// Item 10: the edge used to queue the lease of a stopped sandbox for a batched release
/// (up to 50 ms), so a creation right after `stop()` was over quota.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quota_is_free_the_moment_a_stop_returns() {
    let (cluster, mut c, t, _d) = cluster(&[(64.0, 0.0)]).await;
    project_with_quota(&mut c, &t, "one", 1.0).await;
    for i in 0..30 {
        let sb = create(&mut c, &t, "root/one", spec(1.0), "")
            .await
            .unwrap_or_else(|f| panic!("cycle {i}: {f}"));
        stop(&mut c, &t, &sb.id).await;
    }
    // stop_task: every sandbox of the task is stopped and its quota free when it returns.
    project_with_quota(&mut c, &t, "three", 3.0).await;
    for i in 0..10 {
        let got = batch(
            &mut c,
            &t,
            "root/three",
            pb::SandboxSpec {
                task_id: "job".into(),
                ..spec(1.0)
            },
            3,
            "",
        )
        .await;
        for r in &got {
            assert!(r.is_ok(), "wave {i}: {:?}", r.as_ref().err());
        }
        let r = c
            .stop_task(with_token(
                pb::TaskRequest {
                    project: "root/three".into(),
                    task_id: "job".into(),
                },
                &t,
            ))
            .await
            .unwrap()
            .into_inner();
        assert_eq!((r.affected, r.failed), (3, 0), "wave {i}");
    }
    let proj = c
        .get_project(with_token(
            pb::ProjectRef {
                project: "root/three".into(),
            },
            &t,
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(proj.usage.get("sandboxes").copied().unwrap_or(0.0), 0.0);
    cluster.down().await;
}

/// Item 11: a snapshot taken before a stop still counted the sandbox, so the next creation
/// of a sandbox that takes the whole node was refused for up to a snapshot period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sequential_create_and_stop_of_a_whole_node_is_never_refused() {
    let (cluster, mut c, t, _d) = cluster(&[(2.0, 0.0)]).await;
    let mut refused = Vec::new();
    for i in 0..100 {
        match create(&mut c, &t, "root", spec(2.0), "").await {
            Ok(sb) => stop(&mut c, &t, &sb.id).await,
            Err(f) => refused.push(format!("cycle {i}: {f}")),
        }
    }
    assert!(refused.is_empty(), "{} refused: {refused:?}", refused.len());
    cluster.down().await;
}

/// Item 11: waves of concurrent creations and stops on an idle node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waves_of_concurrent_create_and_stop_are_never_refused() {
    let (cluster, c, t, _d) = cluster(&[(10.0, 0.0)]).await;
    let mut refused = Vec::new();
    for wave in 0..10 {
        let made = futures::future::join_all((0..10).map(|_| {
            let mut c = c.clone();
            let t = t.clone();
            async move { create(&mut c, &t, "root", spec(1.0), "").await }
        }))
        .await;
        let mut ids = Vec::new();
        for r in made {
            match r {
                Ok(sb) => ids.push(sb.id),
                Err(f) => refused.push(format!("wave {wave}: {f}")),
            }
        }
        futures::future::join_all(ids.iter().map(|id| {
            let mut c = c.clone();
            let t = t.clone();
            async move { stop(&mut c, &t, id).await }
        }))
        .await;
    }
    assert!(refused.is_empty(), "{} refused: {refused:?}", refused.len());
    cluster.down().await;
}

/// Item 14: creations that fail on the node (`internal`) never make the one-node cluster
/// refuse the others as `no_capacity`, in a burst or after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn internal_failures_on_a_one_node_cluster_never_become_no_capacity() {
    let (cluster, mut c, t, _d) = cluster(&[(1000.0, 0.3)]).await;
    let mut reasons: BTreeMap<String, usize> = BTreeMap::new();
    let mut created = 0;
    for wave in 0..6 {
        for r in batch(&mut c, &t, "root", spec(0.5), 100, &format!("w{wave}")).await {
            match r {
                Ok(_) => created += 1,
                Err(f) => *reasons.entry(f.reason.as_str().to_string()).or_default() += 1,
            }
        }
        for _ in 0..10 {
            match create(&mut c, &t, "root", spec(0.5), "").await {
                Ok(_) => created += 1,
                Err(f) => *reasons.entry(f.reason.as_str().to_string()).or_default() += 1,
            }
        }
    }
    assert!(created > 300, "created {created}, failures {reasons:?}");
    assert_eq!(
        reasons.keys().cloned().collect::<Vec<_>>(),
        vec!["internal".to_string()],
        "{reasons:?}"
    );
    cluster.down().await;
}

/// Item 13: a caller-chosen key survives the caller's restart; with another spec it is
/// `conflict`, not the old sandbox, while the sandbox lives and after it ended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_is_tied_to_its_spec() {
    let (cluster, mut c, t, _d) = cluster(&[(64.0, 0.0)]).await;
    let a = create(&mut c, &t, "root", spec(1.0), "trainer-1/step-7")
        .await
        .unwrap();
    let again = create(&mut c, &t, "root", spec(1.0), "trainer-1/step-7")
        .await
        .unwrap();
    assert_eq!(again.id, a.id);
    let f = create(&mut c, &t, "root", spec(2.0), "trainer-1/step-7")
        .await
        .unwrap_err();
    assert_eq!(f.reason, Reason::Conflict, "{f}");
    assert!(f.message.contains("different spec"), "{f}");

    let first = batch(&mut c, &t, "root", spec(1.0), 3, "trainer-1/batch").await;
    let second = batch(&mut c, &t, "root", spec(1.0), 3, "trainer-1/batch").await;
    let ids = |v: &Vec<Result<pb::Sandbox, Failure>>| -> Vec<String> {
        v.iter().map(|r| r.as_ref().unwrap().id.clone()).collect()
    };
    assert_eq!(ids(&first), ids(&second));
    for r in batch(&mut c, &t, "root", spec(0.5), 3, "trainer-1/batch").await {
        assert_eq!(r.unwrap_err().reason, Reason::Conflict);
    }
    // Ended: its lease is gone, the edge's record still ties the key to the spec.
    stop(&mut c, &t, &a.id).await;
    let f = create(&mut c, &t, "root", spec(2.0), "trainer-1/step-7")
        .await
        .unwrap_err();
    assert_eq!(f.reason, Reason::Conflict, "{f}");
    cluster.down().await;
}

/// Collects what the process logs, for the span test.
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn captured() -> &'static Captured {
    static LOG: OnceLock<Captured> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Captured::default();
        let w = log.clone();
        let sub = tracing_subscriber::fmt()
            .with_env_filter("opendsec=debug")
            .with_ansi(false)
            .with_writer(move || w.clone())
            .finish();
        tracing::subscriber::set_global_default(sub).unwrap();
        log
    })
}

/// Item 21: each apiserver request runs in a span naming method, principal, project and
/// sandbox.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_apiserver_request_has_a_span_with_principal_project_and_sandbox() {
    let log = captured();
    let (cluster, mut c, t, _d) = cluster(&[(64.0, 0.0)]).await;
    let sb = create(&mut c, &t, "root", spec(1.0), "").await.unwrap();
    stop(&mut c, &t, &sb.id).await;
    cluster.down().await;
    let text = String::from_utf8(log.0.lock().unwrap().clone()).unwrap();
    let line = text
        .lines()
        // Other tests of this binary log to the same capture at once: find this test's call.
        .find(|l| {
            l.contains("method=StopSandbox")
                && l.contains("call done")
                && l.contains(&format!("sandbox_id=\"{}\"", sb.id))
        })
        .unwrap_or_else(|| panic!("no StopSandbox span in:\n{text}"));
    assert!(
        line.contains("principal=\"admin\"")
            && line.contains("project=\"root\"")
            && line.contains(&format!("sandbox_id=\"{}\"", sb.id)),
        "{line}"
    );
    assert!(
        text.lines()
            .any(|l| l.contains("method=CreateSandbox") && l.contains("principal=\"admin\"")),
        "{text}"
    );
}
