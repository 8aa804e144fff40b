//! The edge over gRPC with the sim backend: batches, lifecycle calls, idempotent retries,
//! restart and re-adoption from the state directory, TTL expiry, admission limits, drain,
//! and the IAM side (batched ReleaseLeases, GetLease orphan deletion) against a fake IAM.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opendsec::config::Config;
use opendsec::pb::{self, edge_client::EdgeClient, runtime_client::RuntimeClient, SandboxState};
use opendsec::rpc::{self, failure_from_status};
use opendsec::shutdown::Shutdown;
use opendsec::types::{Failure, Reason};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

const TOKEN: &str = "test-service-token";

/// A port nothing listens on.
async fn closed_port() -> String {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("bind: {e}"));
    let a = l.local_addr().unwrap_or_else(|e| panic!("{e}")).to_string();
    drop(l);
    a
}

fn config(
    state_dir: &std::path::Path,
    iam_addr: &str,
    backend: serde_json::Value,
    persist: bool,
) -> Arc<Config> {
    let v = serde_json::json!({
        "service_token": TOKEN,
        "iam": {"addr": iam_addr},
        "edges": [{
            "id": "e1",
            "state_dir": state_dir.display().to_string(),
            "persist_state": persist,
            "mem_reserve_mb": -1,
            "disk_reserve_mb": -1,
            "images": {"local/py": ["/nonexistent"]},
            "backends": {"sim": backend}
        }]
    });
    let cfg: Config = serde_json::from_value(v).unwrap_or_else(|e| panic!("config: {e}"));
    cfg.validate().unwrap_or_else(|e| panic!("validate: {e}"));
    Arc::new(cfg)
}

#[path = "common/edge.rs"]
mod edge_harness;

/// The edge of `config`'s (`e1`), started in this process.
struct Edge(edge_harness::Edge);

impl Edge {
    async fn start(cfg: Arc<Config>) -> Edge {
        Edge(edge_harness::Edge::start(cfg, "e1").await)
    }

    fn client(&self) -> EdgeClient<Channel> {
        self.0.client()
    }

    async fn stop(self) {
        self.0.stop(Duration::from_secs(30)).await
    }
}

impl std::ops::Deref for Edge {
    type Target = edge_harness::Edge;
    fn deref(&self) -> &edge_harness::Edge {
        &self.0
    }
}

fn req<T>(m: T) -> Request<T> {
    rpc::client::internal(m, TOKEN)
}

fn spec(task: &str) -> pb::SandboxSpec {
    pb::SandboxSpec {
        backend: "sim".into(),
        cpu_cores_limit: 1.0,
        memory_limit_mb: 256,
        task_id: task.into(),
        ..Default::default()
    }
}

fn item(suffix: &str, lease: &str) -> pb::EdgeCreateItem {
    pb::EdgeCreateItem {
        sandbox_id: format!("e1.{suffix}"),
        lease_id: lease.into(),
        project: "root/p".into(),
        principal: "alice".into(),
    }
}

async fn create(
    c: &mut EdgeClient<Channel>,
    spec: pb::SandboxSpec,
    items: Vec<pb::EdgeCreateItem>,
) -> Vec<Result<pb::Sandbox, Failure>> {
    let r = c
        .create_sandboxes(req(pb::EdgeCreateRequest {
            fork: None,
            spec: Some(spec),
            items,
        }))
        .await
        .unwrap_or_else(|s| panic!("create: {s:?}"));
    r.into_inner()
        .results
        .into_iter()
        .map(|r| match (r.sandbox, r.error) {
            (Some(s), None) => Ok(s),
            (_, Some(e)) => Err(rpc::status::failure_from_detail(&e)),
            (None, None) => Err(Failure::internal("empty result")),
        })
        .collect()
}

fn state_of(s: &pb::Sandbox) -> SandboxState {
    SandboxState::try_from(s.state).unwrap_or(SandboxState::StateUnspecified)
}

async fn get(c: &mut EdgeClient<Channel>, id: &str) -> Result<pb::Sandbox, Failure> {
    c.get_sandbox(req(pb::SandboxRef { id: id.into() }))
        .await
        .map(Response::into_inner)
        .map_err(|s| failure_from_status(&s))
}

async fn op(c: &mut EdgeClient<Channel>, which: &str, id: &str) -> Result<pb::Sandbox, Failure> {
    let r = req(pb::SandboxRef { id: id.into() });
    let r = match which {
        "pause" => c.pause_sandbox(r).await,
        "resume" => c.resume_sandbox(r).await,
        "stop" => c.stop_sandbox(r).await,
        "touch" => c.touch_sandbox(r).await,
        _ => panic!("no op {which}"),
    };
    r.map(Response::into_inner)
        .map_err(|s| failure_from_status(&s))
}

async fn list(c: &mut EdgeClient<Channel>, project: &str, task: &str, ended: bool) -> Vec<String> {
    let r = c
        .list_sandboxes(req(pb::EdgeListRequest {
            project: project.into(),
            task_id: task.into(),
            include_ended: ended,
        }))
        .await
        .unwrap_or_else(|s| panic!("{s:?}"));
    r.into_inner().sandboxes.into_iter().map(|s| s.id).collect()
}

async fn status(c: &mut EdgeClient<Channel>, leases: bool) -> pb::EdgeStatus {
    c.status(req(pb::StatusRequest {
        with_leases: leases,
    }))
    .await
    .unwrap_or_else(|s| panic!("{s:?}"))
    .into_inner()
}

/// Polls until `f` holds for the record, or fails after 20 s.
async fn wait_for(
    c: &mut EdgeClient<Channel>,
    id: &str,
    what: &str,
    f: impl Fn(&pb::Sandbox) -> bool,
) -> pb::Sandbox {
    for _ in 0..200 {
        if let Ok(s) = get(c, id).await {
            if f(&s) {
                return s;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{id}: never {what}: {:?}", get(c, id).await)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_retry_drain_and_restart() {
    // Install the recorder before anything is counted.
    let metrics = opendsec::telemetry::metrics_handle();
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let iam = closed_port().await;
    let cfg = config(dir.path(), &iam, serde_json::json!({}), true);
    let edge = Edge::start(cfg.clone()).await;
    let mut c = edge.client();

    // A batch of three.
    let items = vec![item("a", "L-a"), item("b", "L-b"), item("c", "L-c")];
    let made = create(&mut c, spec("t1"), items.clone()).await;
    assert_eq!(made.len(), 3);
    for r in &made {
        let s = r.as_ref().unwrap_or_else(|f| panic!("{f}"));
        assert_eq!(state_of(s), SandboxState::Running, "{s:?}");
        assert_eq!(s.edge_id, "e1");
        assert_eq!(
            s.spec.as_ref().map(|s| s.disk_mb),
            Some(10240),
            "disk defaults to the backend's default_disk_mb"
        );
    }
    assert!(
        dir.path().join("edges/e1/sandboxes/e1.a.json").exists(),
        "records are persisted"
    );

    // Get, list with filters.
    assert_eq!(
        get(&mut c, "e1.a").await.map(|s| s.lease_id).ok(),
        Some("L-a".to_string())
    );
    assert_eq!(
        get(&mut c, "e1.zzz").await.err().map(|f| f.reason),
        Some(Reason::NotFound)
    );
    assert_eq!(
        list(&mut c, "root", "", false).await,
        vec!["e1.a", "e1.b", "e1.c"]
    );
    assert_eq!(list(&mut c, "root/p", "t1", false).await.len(), 3);
    assert!(list(&mut c, "root/q", "", false).await.is_empty());
    assert!(list(&mut c, "", "t2", false).await.is_empty());

    // Pause, pause again, resume, stop, stop again; ended sandboxes refuse changes.
    assert_eq!(
        op(&mut c, "pause", "e1.a").await.map(|s| state_of(&s)).ok(),
        Some(SandboxState::Paused)
    );
    assert_eq!(
        op(&mut c, "pause", "e1.a").await.map(|s| state_of(&s)).ok(),
        Some(SandboxState::Paused)
    );
    assert_eq!(
        op(&mut c, "resume", "e1.a")
            .await
            .map(|s| state_of(&s))
            .ok(),
        Some(SandboxState::Running)
    );
    assert_eq!(
        op(&mut c, "resume", "e1.a")
            .await
            .map(|s| state_of(&s))
            .ok(),
        Some(SandboxState::Running)
    );
    let stopped = op(&mut c, "stop", "e1.c")
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(state_of(&stopped), SandboxState::Stopped);
    assert!(stopped.ended_at > 0);
    assert_eq!(
        op(&mut c, "stop", "e1.c").await.map(|s| state_of(&s)).ok(),
        Some(SandboxState::Stopped)
    );
    assert_eq!(
        op(&mut c, "pause", "e1.c").await.err().map(|f| f.reason),
        Some(Reason::Conflict)
    );
    assert_eq!(
        op(&mut c, "touch", "e1.c").await.err().map(|f| f.reason),
        Some(Reason::Conflict)
    );
    assert_eq!(
        op(&mut c, "touch", "e1.b").await.map(|s| state_of(&s)).ok(),
        Some(SandboxState::Running)
    );
    // touch resumes a paused sandbox, as any runtime call does.
    assert_eq!(
        op(&mut c, "pause", "e1.b").await.map(|s| state_of(&s)).ok(),
        Some(SandboxState::Paused)
    );
    assert_eq!(
        op(&mut c, "touch", "e1.b").await.map(|s| state_of(&s)).ok(),
        Some(SandboxState::Running)
    );
    assert_eq!(list(&mut c, "root", "", false).await, vec!["e1.a", "e1.b"]);
    assert_eq!(
        list(&mut c, "root", "", true).await,
        vec!["e1.a", "e1.b", "e1.c"]
    );

    // SetSandboxTimeout: lifetime = age + timeout.
    let t = c
        .set_sandbox_timeout(req(pb::SetSandboxTimeoutRequest {
            id: "e1.b".into(),
            timeout_s: 3000,
        }))
        .await
        .unwrap_or_else(|s| panic!("{s:?}"))
        .into_inner();
    let ttl_max = t.spec.as_ref().map(|s| s.ttl_max).unwrap_or(0);
    assert!((3000..3100).contains(&ttl_max), "{ttl_max}");
    let bad = c
        .set_sandbox_timeout(req(pb::SetSandboxTimeoutRequest {
            id: "e1.b".into(),
            timeout_s: 0,
        }))
        .await;
    assert_eq!(
        bad.err().map(|s| failure_from_status(&s).reason),
        Some(Reason::Invalid)
    );

    // Retrying the batch returns the same records, creating nothing.
    let again = create(&mut c, spec("t1"), items.clone()).await;
    let ids: Vec<_> = again
        .iter()
        .map(|r| {
            r.as_ref()
                .map(|s| (s.id.clone(), s.created_at, state_of(s)))
                .unwrap_or_else(|f| panic!("{f}"))
        })
        .collect();
    assert_eq!(
        ids[2].2,
        SandboxState::Stopped,
        "the stopped one is returned as is"
    );
    for (r, old) in again.iter().zip(&made) {
        let (r, old) = (r.as_ref().ok(), old.as_ref().ok());
        assert_eq!(
            r.map(|s| (&s.id, s.created_at)),
            old.map(|s| (&s.id, s.created_at))
        );
    }
    assert_eq!(list(&mut c, "root", "", true).await.len(), 3);
    let st = status(&mut c, false).await;
    let state = st.state.unwrap_or_default();
    assert_eq!(state.sandboxes_by_backend.get("sim"), Some(&2));
    assert_eq!(state.allocated.as_ref().map(|a| a.memory_mb), Some(512));
    assert_eq!(state.backends, vec!["sim"]);
    assert_eq!(state.images, vec!["local/py"]);
    assert_eq!(state.addr, edge.addr);
    assert_eq!(state.zone, "onprem");
    assert_eq!(
        state.capacity.as_ref().map(|c| c.memory_mb),
        Some(0),
        "sim-only edge: unlimited"
    );

    // Bad input.
    let unknown = c
        .create_sandboxes(req(pb::EdgeCreateRequest {
            fork: None,
            spec: Some(pb::SandboxSpec {
                backend: "microvm".into(),
                ..Default::default()
            }),
            items: vec![item("x", "L-x")],
        }))
        .await;
    assert_eq!(
        unknown.err().map(|s| failure_from_status(&s).reason),
        Some(Reason::Invalid)
    );
    let wrong_edge = create(
        &mut c,
        spec(""),
        vec![pb::EdgeCreateItem {
            sandbox_id: "e2.x".into(),
            ..item("x", "L")
        }],
    )
    .await;
    assert_eq!(
        wrong_edge[0].as_ref().err().map(|f| f.reason),
        Some(Reason::Invalid)
    );
    let unauth = c.status(Request::new(pb::StatusRequest::default())).await;
    assert_eq!(
        unauth.err().map(|s| failure_from_status(&s).reason),
        Some(Reason::Unauthenticated)
    );

    // Drain: Status shows it, creations are refused, the flag survives a restart.
    let d = c
        .drain(req(pb::DrainEdgeRequest {
            edge_id: "e1".into(),
            undo: false,
        }))
        .await
        .unwrap_or_else(|s| panic!("{s:?}"))
        .into_inner();
    assert!(d.draining);
    assert!(status(&mut c, false)
        .await
        .state
        .is_some_and(|s| s.draining));
    let refused = create(&mut c, spec(""), vec![item("d", "L-d")]).await;
    let f = refused[0]
        .as_ref()
        .err()
        .cloned()
        .unwrap_or_else(|| Failure::internal("created while draining"));
    assert_eq!(f.reason, Reason::NoCapacity);
    assert!(f.message.contains("draining"), "{}", f.message);

    // Restart on the same state directory: the live sandboxes are RUNNING again.
    edge.stop().await;
    let edge = Edge::start(cfg.clone()).await;
    let mut c = edge.client();
    for id in ["e1.a", "e1.b"] {
        let s = get(&mut c, id)
            .await
            .unwrap_or_else(|f| panic!("{id}: {f}"));
        assert_eq!(state_of(&s), SandboxState::Running, "{id} re-adopted");
    }
    assert_eq!(
        get(&mut c, "e1.c").await.map(|s| state_of(&s)).ok(),
        Some(SandboxState::Stopped),
        "ended record kept"
    );
    let st = status(&mut c, true).await;
    let state = st.state.clone().unwrap_or_default();
    assert!(state.draining, "the draining flag was persisted");
    assert_eq!(
        state.sandboxes_by_backend.get("sim"),
        Some(&2),
        "allocation rebuilt"
    );
    let leases: Vec<_> = st.leases.iter().map(|l| l.lease_id.as_str()).collect();
    assert_eq!(leases, vec!["L-a", "L-b"]);
    let undone = c
        .drain(req(pb::DrainEdgeRequest {
            edge_id: String::new(),
            undo: true,
        }))
        .await
        .unwrap_or_else(|s| panic!("{s:?}"))
        .into_inner();
    assert!(!undone.draining);
    let d2 = create(&mut c, spec(""), vec![item("d", "L-d")]).await;
    assert!(d2[0].is_ok(), "{:?}", d2[0]);

    // Metrics are named as docs/architecture.md says.
    tokio::time::sleep(Duration::from_millis(1200)).await; // one sampling tick for the gauges
    let text = metrics.render();
    for name in [
        "opendsec_edge_created_total",
        "opendsec_edge_rejected_total",
        "opendsec_edge_sandboxes",
        "opendsec_edge_capacity",
        "opendsec_edge_allocated",
        "opendsec_edge_draining",
        "opendsec_edge_under_pressure",
        "opendsec_edge_mem_available_mb",
        "opendsec_edge_disk_available_mb",
        "opendsec_edge_create_seconds",
        "opendsec_edge_op_seconds",
    ] {
        assert!(text.contains(name), "{name} missing from:\n{text}");
    }
    edge.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_timeout_stops_and_max_sandboxes_refuses() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let iam = closed_port().await;
    let cfg = config(
        dir.path(),
        &iam,
        serde_json::json!({"max_sandboxes": 2, "create_latency_ms": 5, "latency_sigma": 0.3}),
        false,
    );
    let edge = Edge::start(cfg).await;
    let mut c = edge.client();

    // max_sandboxes 2: the third of a batch is refused.
    let made = create(
        &mut c,
        spec("t"),
        vec![item("a", "L-a"), item("b", "L-b"), item("c", "L-c")],
    )
    .await;
    assert!(made[0].is_ok() && made[1].is_ok(), "{made:?}");
    let f = made[2]
        .as_ref()
        .err()
        .cloned()
        .unwrap_or_else(|| Failure::internal("third admitted"));
    assert_eq!(f.reason, Reason::NoCapacity);
    assert!(f.message.contains("max_sandboxes"), "{}", f.message);
    assert_eq!(
        get(&mut c, "e1.c").await.err().map(|f| f.reason),
        Some(Reason::NotFound),
        "a refused item leaves no record"
    );
    assert!(
        !dir.path().join("edges").exists(),
        "persist_state off writes nothing"
    );

    // Runtime calls on sim: invalid.
    let mut rt = RuntimeClient::new(
        rpc::client::channel(&edge.addr, Duration::from_secs(2)).unwrap_or_else(|e| panic!("{e}")),
    );
    let r = rt
        .run_shell(req(pb::RunShellRequest {
            sandbox_id: "e1.a".into(),
            cmd: "true".into(),
            ..Default::default()
        }))
        .await;
    let f = r
        .err()
        .map(|s| failure_from_status(&s))
        .unwrap_or_else(|| Failure::internal("ran"));
    assert_eq!(f.reason, Reason::Invalid);
    assert_eq!(f.message, "backend sim runs nothing");

    // Free a slot (task stop), then a 1-second idle timeout.
    let t = c
        .task_action(req(pb::EdgeTaskRequest {
            project: "root".into(),
            task_id: "t".into(),
            action: "stop".into(),
        }))
        .await
        .unwrap_or_else(|s| panic!("{s:?}"))
        .into_inner();
    assert_eq!((t.affected, t.failed), (2, 0));
    let bad = c
        .task_action(req(pb::EdgeTaskRequest {
            project: "root".into(),
            task_id: "t".into(),
            action: "explode".into(),
        }))
        .await;
    assert_eq!(
        bad.err().map(|s| failure_from_status(&s).reason),
        Some(Reason::Invalid)
    );
    let idle = pb::SandboxSpec {
        ttl_running_stop: 1,
        ..spec("idle")
    };
    let made = create(&mut c, idle, vec![item("i", "L-i")]).await;
    assert!(made[0].is_ok(), "{made:?}");
    let s = wait_for(&mut c, "e1.i", "stopped by its idle timeout", |s| {
        state_of(s) == SandboxState::Stopped
    })
    .await;
    assert_eq!(s.message, "idle timeout (ttl_running_stop) reached");

    // With ttl_paused_s the idle timeout pauses instead.
    let pausing = pb::SandboxSpec {
        ttl_running_stop: 1,
        ttl_paused_s: 3600,
        ..spec("idle")
    };
    assert!(create(&mut c, pausing, vec![item("p", "L-p")]).await[0].is_ok());
    let s = wait_for(&mut c, "e1.p", "paused by its idle timeout", |s| {
        state_of(s) == SandboxState::Paused
    })
    .await;
    assert!(s.message.contains("idle timeout"), "{}", s.message);
    edge.stop().await;
}

/// IAM with only GetLease and ReleaseLeases; the first ReleaseLeases fails as unavailable.
#[derive(Default, Clone)]
struct FakeIam {
    released: Arc<Mutex<Vec<Vec<String>>>>,
    failed_once: Arc<Mutex<bool>>,
    lookups: Arc<Mutex<Vec<String>>>,
}

type R<T> = Result<Response<T>, Status>;

fn unimpl<T>() -> R<T> {
    Err(Status::unimplemented("not in the fake"))
}

#[tonic::async_trait]
impl pb::iam_server::Iam for FakeIam {
    async fn release_leases(
        &self,
        r: Request<pb::ReleaseLeasesRequest>,
    ) -> R<pb::ReleaseLeasesResponse> {
        assert_eq!(
            r.metadata()
                .get(rpc::SERVICE_TOKEN)
                .and_then(|v| v.to_str().ok()),
            Some(TOKEN)
        );
        let r = r.into_inner();
        {
            let mut f = self.failed_once.lock().unwrap_or_else(|p| p.into_inner());
            if !*f {
                *f = true;
                return Err(rpc::to_status(&Failure::unavailable("not yet")));
            }
        }
        let n = r.lease_ids.len() as i64;
        self.released
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(r.lease_ids);
        Ok(Response::new(pb::ReleaseLeasesResponse { released: n }))
    }
    async fn get_lease(&self, r: Request<pb::GetLeaseRequest>) -> R<pb::LeaseInfo> {
        let id = r.into_inner().lease_id;
        self.lookups
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(id.clone());
        match id.as_str() {
            "L-gone" => Err(rpc::to_status(&Failure::not_found("no such lease"))),
            "L-moved" => Ok(Response::new(pb::LeaseInfo {
                lease_id: id,
                edge_id: "e2".into(),
                sandbox_id: "e2.zz".into(),
                ..Default::default()
            })),
            _ => Ok(Response::new(pb::LeaseInfo {
                lease_id: id,
                edge_id: "e1".into(),
                ..Default::default()
            })),
        }
    }
    async fn get_leases(&self, r: Request<pb::GetLeasesRequest>) -> R<pb::GetLeasesResponse> {
        let mut leases = Vec::new();
        for id in r.into_inner().lease_ids {
            self.lookups
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(id.clone());
            match id.as_str() {
                "L-gone" => {}
                "L-moved" => leases.push(pb::LeaseInfo {
                    lease_id: id,
                    edge_id: "e2".into(),
                    sandbox_id: "e2.zz".into(),
                    ..Default::default()
                }),
                _ => leases.push(pb::LeaseInfo {
                    lease_id: id,
                    edge_id: "e1".into(),
                    ..Default::default()
                }),
            }
        }
        Ok(Response::new(pb::GetLeasesResponse { leases }))
    }
    async fn authenticate(
        &self,
        _: Request<pb::AuthenticateRequest>,
    ) -> R<pb::AuthenticateResponse> {
        unimpl()
    }
    async fn authorize(&self, _: Request<pb::AuthorizeRequest>) -> R<pb::AuthorizeResponse> {
        unimpl()
    }
    async fn admit(&self, _: Request<pb::AdmitRequest>) -> R<pb::AdmitResponse> {
        unimpl()
    }
    async fn reconcile(&self, _: Request<pb::ReconcileRequest>) -> R<pb::ReconcileResponse> {
        unimpl()
    }
    async fn sweep_unbound(
        &self,
        _: Request<pb::SweepUnboundRequest>,
    ) -> R<pb::SweepUnboundResponse> {
        unimpl()
    }
    async fn get_epoch(&self, _: Request<pb::Empty>) -> R<pb::EpochResponse> {
        unimpl()
    }
    async fn who_am_i(&self, _: Request<pb::Empty>) -> R<pb::WhoAmIResponse> {
        unimpl()
    }
    async fn create_project(&self, _: Request<pb::CreateProjectRequest>) -> R<pb::Project> {
        unimpl()
    }
    async fn get_project(&self, _: Request<pb::ProjectRef>) -> R<pb::Project> {
        unimpl()
    }
    async fn set_quota(&self, _: Request<pb::SetQuotaRequest>) -> R<pb::Project> {
        unimpl()
    }
    async fn delete_project(&self, _: Request<pb::ProjectRef>) -> R<pb::Empty> {
        unimpl()
    }
    async fn create_principal(
        &self,
        _: Request<pb::CreatePrincipalRequest>,
    ) -> R<pb::CreatePrincipalResponse> {
        unimpl()
    }
    async fn delete_principal(&self, _: Request<pb::PrincipalRef>) -> R<pb::Empty> {
        unimpl()
    }
    async fn grant(&self, _: Request<pb::GrantRequest>) -> R<pb::Project> {
        unimpl()
    }
    async fn revoke(&self, _: Request<pb::GrantRequest>) -> R<pb::Project> {
        unimpl()
    }
    async fn create_token(&self, _: Request<pb::CreateTokenRequest>) -> R<pb::CreateTokenResponse> {
        unimpl()
    }
    async fn list_tokens(&self, _: Request<pb::PrincipalRef>) -> R<pb::ListTokensResponse> {
        unimpl()
    }
    async fn revoke_token(&self, _: Request<pb::RevokeTokenRequest>) -> R<pb::Empty> {
        unimpl()
    }
    async fn get_usage(&self, _: Request<pb::GetUsageRequest>) -> R<pb::UsageReport> {
        unimpl()
    }
    async fn backup(&self, _: Request<pb::Empty>) -> R<pb::IamBackupResponse> {
        unimpl()
    }
    async fn restore(&self, _: Request<pb::IamRestoreRequest>) -> R<pb::Empty> {
        unimpl()
    }
    async fn members(&self, _: Request<pb::Empty>) -> R<pb::IamMembersResponse> {
        unimpl()
    }
    async fn member_add(&self, _: Request<pb::IamMemberAddRequest>) -> R<pb::IamMembersResponse> {
        unimpl()
    }
    async fn member_remove(
        &self,
        _: Request<pb::IamMemberRemoveRequest>,
    ) -> R<pb::IamMembersResponse> {
        unimpl()
    }
    async fn lock(&self, _: Request<pb::LockRequest>) -> R<pb::LockResponse> {
        unimpl()
    }
    async fn unlock(&self, _: Request<pb::UnlockRequest>) -> R<pb::Empty> {
        unimpl()
    }
    async fn kv_get(&self, _: Request<pb::KvGetRequest>) -> R<pb::KvEntry> {
        unimpl()
    }
    async fn kv_list(&self, _: Request<pb::KvListRequest>) -> R<pb::KvListResponse> {
        unimpl()
    }
    async fn kv_put(&self, _: Request<pb::KvPutRequest>) -> R<pb::KvPutResponse> {
        unimpl()
    }
    async fn kv_delete(&self, _: Request<pb::KvDeleteRequest>) -> R<pb::KvPutResponse> {
        unimpl()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn leases_are_released_in_batches_and_orphans_deleted() {
    let fake = FakeIam::default();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let iam_addr = l.local_addr().unwrap_or_else(|e| panic!("{e}")).to_string();
    let iam_down = Shutdown::new();
    let router = rpc::serve::builder(None, rpc::acl::Policy::Public)
        .unwrap()
        .add_service(pb::iam_server::IamServer::new(fake.clone()));
    let iam_task = tokio::spawn(rpc::serve::serve(router, l, iam_down.clone()));

    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let edge = Edge::start(config(dir.path(), &iam_addr, serde_json::json!({}), true)).await;
    let mut c = edge.client();
    let made = create(
        &mut c,
        spec("job"),
        vec![
            item("a", "L-a"),
            item("b", "L-b"),
            item("m", "L-moved"),
            item("g", "L-gone"),
        ],
    )
    .await;
    assert!(made.iter().all(|r| r.is_ok()), "{made:?}");

    // The lease of e1.m is bound to another edge, that of e1.g was released: both go.
    let m = wait_for(&mut c, "e1.m", "deleted as an orphan", |s| {
        state_of(s) == SandboxState::Stopped
    })
    .await;
    assert!(m.message.contains("e2"), "{}", m.message);
    let g = wait_for(&mut c, "e1.g", "deleted as an orphan", |s| {
        state_of(s) == SandboxState::Stopped
    })
    .await;
    assert!(g.message.contains("released"), "{}", g.message);
    for id in ["e1.a", "e1.b"] {
        assert_eq!(
            get(&mut c, id).await.map(|s| state_of(&s)).ok(),
            Some(SandboxState::Running),
            "{id} is bound here and kept"
        );
    }
    let st = status(&mut c, true).await;
    let leases: Vec<_> = st.leases.iter().map(|l| l.lease_id.as_str()).collect();
    assert_eq!(leases, vec!["L-a", "L-b"], "orphans are not reported");

    // Stopping the task releases both leases (after one unavailable answer).
    let t = c
        .task_action(req(pb::EdgeTaskRequest {
            project: "root/p".into(),
            task_id: "job".into(),
            action: "stop".into(),
        }))
        .await
        .unwrap_or_else(|s| panic!("{s:?}"))
        .into_inner();
    assert_eq!((t.affected, t.failed), (2, 0));
    let mut all = Vec::new();
    for _ in 0..200 {
        all = fake
            .released
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .flatten()
            .cloned()
            .collect::<Vec<_>>();
        if all.len() >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    all.sort();
    assert_eq!(
        all,
        vec!["L-a", "L-b"],
        "each lease released once; never the orphans'"
    );
    let lookups = fake
        .lookups
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    assert!(lookups.contains(&"L-moved".to_string()) && lookups.contains(&"L-a".to_string()));
    edge.stop().await;
    iam_down.fire();
    let _ = iam_task.await;
}

/// A watcher that only records registrations.
#[derive(Default, Clone)]
struct FakeWatcher {
    seen: Arc<Mutex<Vec<(String, String, bool)>>>,
}

#[tonic::async_trait]
impl pb::watcher_server::Watcher for FakeWatcher {
    async fn get_snapshot(&self, _: Request<pb::GetSnapshotRequest>) -> R<pb::Snapshot> {
        unimpl()
    }
    async fn register(&self, r: Request<pb::RegisterEdgeRequest>) -> R<pb::RegisterEdgeResponse> {
        let token_ok = r
            .metadata()
            .get(rpc::SERVICE_TOKEN)
            .and_then(|v| v.to_str().ok())
            == Some(TOKEN);
        let r = r.into_inner();
        self.seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((r.edge_id, r.addr, token_ok));
        Ok(Response::new(pb::RegisterEdgeResponse { known: true }))
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn registers_with_every_watcher_and_survives_a_missing_one() {
    let fake = FakeWatcher::default();
    let l = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .unwrap_or_else(|e| panic!("{e}"));
    let waddr = l.local_addr().unwrap_or_else(|e| panic!("{e}")).to_string();
    let down = Shutdown::new();
    let wt = tokio::spawn(rpc::serve::serve(
        rpc::serve::builder(None, rpc::acl::Policy::Public)
            .unwrap()
            .add_service(pb::watcher_server::WatcherServer::new(fake.clone())),
        l,
        down.clone(),
    ));
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let dead = closed_port().await;
    let mut cfg = (*config(dir.path(), "", serde_json::json!({}), false)).clone();
    cfg.watcher.replicas = vec![
        opendsec::config::WatcherReplica {
            id: "0".into(),
            addr: dead,
        },
        opendsec::config::WatcherReplica {
            id: "1".into(),
            addr: waddr,
        },
    ];
    let edge = Edge::start(Arc::new(cfg)).await;
    let mut seen = Vec::new();
    for _ in 0..100 {
        seen = fake.seen.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if !seen.is_empty() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        seen.first(),
        Some(&("e1".to_string(), edge.addr.clone(), true)),
        "registered with its address and the service token"
    );
    edge.stop().await;
    down.fire();
    let _ = wt.await;
}
