//! Admission of container specs on a real edge (docs/containers.md "Minimums"): a spec the
//! container backend cannot start (memory, CPU or disk below its minimum, an `init_user` the
//! image does not have) is refused `invalid`, naming the field, before anything is made: no
//! record, no sandbox directory, no disk image, no cgroup, nothing allocated. Specs at the
//! minimums, a numeric `init_user` and a name the image has start and run as that user.
//! Needs root; under CI=true a missing privilege fails the test.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use opendsec::backends::container::{MIN_CPU_CORES, MIN_DISK_MB, MIN_MEMORY_MB};
use opendsec::config::Config;
use opendsec::pb::{self, edge_client::EdgeClient, runtime_client::RuntimeClient};
use opendsec::rpc::{self, failure_from_status};
use opendsec::types::Reason;
use tonic::transport::Channel;
use tonic::Request;

const TOKEN: &str = "test-service-token";

fn req<T>(m: T) -> Request<T> {
    rpc::client::internal(m, TOKEN)
}

#[path = "common/edge.rs"]
mod edge_harness;

struct Edge {
    edge: edge_harness::Edge,
    state: PathBuf,
    id: String,
}

impl Edge {
    async fn start(state: &Path, id: &str) -> Edge {
        // IAM is a port nothing listens on: creation needs no IAM call on the edge.
        let iam = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let iam_addr = iam.local_addr().unwrap().to_string();
        drop(iam);
        let agent_dir = PathBuf::from(env!("CARGO_BIN_EXE_opendsec"))
            .parent()
            .map(Path::to_path_buf)
            .unwrap();
        let v = serde_json::json!({
            "service_token": TOKEN,
            "iam": {"addr": iam_addr},
            "edges": [{
                "id": id,
                "state_dir": state.display().to_string(),
                "persist_state": true,
                "agent_dir": agent_dir.display().to_string(),
                "mem_reserve_mb": -1,
                "disk_reserve_mb": -1,
                "cpu_overcommit": 32,
                "images": {"host": ["/"]},
                "backends": {"container": {"runtime": "linux", "default_disk_mb": 64}}
            }]
        });
        let cfg: Config = serde_json::from_value(v).unwrap();
        cfg.validate().unwrap();
        Edge {
            edge: edge_harness::Edge::start(Arc::new(cfg), id).await,
            state: state.to_path_buf(),
            id: id.into(),
        }
    }

    fn channel(&self) -> Channel {
        self.edge.channel()
    }

    fn client(&self) -> EdgeClient<Channel> {
        self.edge.client()
    }

    /// What of sandbox `sid` is on the node: its directory, disk image, cgroups, mounts.
    fn traces(&self, sid: &str) -> Vec<String> {
        let base = self.state.join(&self.id);
        let mut out: Vec<String> = [
            base.join("containers").join(sid),
            base.join("disks").join(format!("{sid}.img")),
        ]
        .into_iter()
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
        for h in std::fs::read_dir("/sys/fs/cgroup").unwrap().flatten() {
            for p in [
                h.path().join("opendsec").join(&self.id).join(sid),
                // cgroup v2 mounted at /sys/fs/cgroup itself.
                Path::new("/sys/fs/cgroup/opendsec")
                    .join(&self.id)
                    .join(sid),
            ] {
                if p.exists() {
                    out.push(p.display().to_string());
                }
            }
        }
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
        out.extend(mounts.lines().filter(|l| l.contains(sid)).map(String::from));
        out.sort();
        out.dedup();
        out
    }

    async fn stop(self) {
        self.edge.stop(Duration::from_secs(60)).await
    }
}

fn spec() -> pb::SandboxSpec {
    pb::SandboxSpec {
        backend: "container".into(),
        image: "host".into(),
        cpu_cores_limit: 0.5,
        memory_limit_mb: 256,
        disk_mb: 64,
        ..Default::default()
    }
}

fn item(edge: &str, suffix: &str) -> pb::EdgeCreateItem {
    pb::EdgeCreateItem {
        sandbox_id: format!("{edge}.{suffix}"),
        lease_id: format!("lease-{suffix}"),
        project: "root".into(),
        principal: "admin".into(),
    }
}

/// A user of the host's /etc/passwd (the `host` image's) other than root: (name, uid).
fn host_user() -> (String, u32) {
    let text = std::fs::read_to_string("/etc/passwd").unwrap();
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            Some((f.first()?.to_string(), f.get(2)?.parse::<u32>().ok()?))
        })
        .find(|(n, uid)| *uid != 0 && !n.is_empty())
        .expect("a non-root user in /etc/passwd")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn specs_that_cannot_start_are_invalid_and_leave_nothing() {
    if !opendsec::sys::root_or_skip("the container admission test") {
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let edge_id = format!("adm-{}", std::process::id());
    let edge = Edge::start(tmp.path(), &edge_id).await;
    let mut c = edge.client();

    type Mutate = Box<dyn Fn(&mut pb::SandboxSpec)>;
    let bad: Vec<(&str, &str, Mutate)> = vec![
        (
            "mem",
            "memory_limit_mb",
            Box::new(|s| s.memory_limit_mb = MIN_MEMORY_MB - 1),
        ),
        (
            "mem8",
            "memory_limit_mb",
            Box::new(|s| s.memory_limit_mb = 8),
        ),
        (
            "mem-neg",
            "memory_limit_mb",
            Box::new(|s| s.memory_limit_mb = -1),
        ),
        (
            "cpu",
            "cpu_cores_limit",
            Box::new(|s| s.cpu_cores_limit = MIN_CPU_CORES / 2.0),
        ),
        (
            "cpu-nan",
            "cpu_cores_limit",
            Box::new(|s| s.cpu_cores_limit = f64::NAN),
        ),
        ("disk", "disk_mb", Box::new(|s| s.disk_mb = MIN_DISK_MB - 1)),
        ("disk-neg", "disk_mb", Box::new(|s| s.disk_mb = -5)),
        (
            "user",
            "init_user",
            Box::new(|s| s.init_user = "nosuchuser".into()),
        ),
        (
            "group",
            "init_user",
            Box::new(|s| s.init_user = "root:wheel".into()),
        ),
    ];
    for (suffix, field, f) in &bad {
        let mut s = spec();
        f(&mut s);
        let started = Instant::now();
        let r = c
            .create_sandboxes(req(pb::EdgeCreateRequest {
                fork: None,
                spec: Some(s),
                items: vec![
                    item(&edge_id, suffix),
                    item(&edge_id, &format!("{suffix}2")),
                ],
            }))
            .await;
        // Refused as a whole (the spec is the batch's), at once: not after aether's start timeout.
        let f = match r {
            Err(s) => failure_from_status(&s),
            Ok(resp) => {
                // Created after all: stop what was made before failing, so nothing stays running.
                for sb in resp
                    .into_inner()
                    .results
                    .into_iter()
                    .filter_map(|r| r.sandbox)
                {
                    let _ = c.stop_sandbox(req(pb::SandboxRef { id: sb.id })).await;
                }
                panic!("{suffix}: a spec with a bad {field} was not refused");
            }
        };
        assert_eq!(f.reason, Reason::Invalid, "{suffix}: {f:?}");
        assert!(f.message.contains(field), "{suffix}: {:?}", f.message);
        assert!(started.elapsed() < Duration::from_secs(5), "{suffix}");
        for sid in [
            format!("{edge_id}.{suffix}"),
            format!("{edge_id}.{suffix}2"),
        ] {
            assert_eq!(edge.traces(&sid), Vec::<String>::new(), "{sid}");
            let got = c.get_sandbox(req(pb::SandboxRef { id: sid.clone() })).await;
            assert_eq!(
                got.map_err(|s| failure_from_status(&s).reason).err(),
                Some(Reason::NotFound),
                "{sid} has a record"
            );
        }
    }
    // Nothing recorded, nothing allocated.
    let listed = c
        .list_sandboxes(req(pb::EdgeListRequest {
            include_ended: true,
            ..Default::default()
        }))
        .await
        .unwrap()
        .into_inner();
    assert!(listed.sandboxes.is_empty(), "{:?}", listed.sandboxes);
    let st = c
        .status(req(pb::StatusRequest { with_leases: true }))
        .await
        .unwrap()
        .into_inner();
    let state = st.state.unwrap_or_default();
    let alloc = state.allocated.unwrap_or_default();
    assert_eq!(
        (alloc.cpu_cores, alloc.memory_mb, alloc.disk_mb),
        (0.0, 0, 0),
        "{alloc:?}"
    );
    assert!(st.leases.is_empty(), "{:?}", st.leases);

    // What can start does: the minimums themselves, a uid the image has no entry for, a
    // uid:gid, and a name the image has; each session runs as that user.
    let (name, uid) = host_user();
    let good: Vec<(&str, Mutate, String)> = vec![
        (
            "minimums",
            Box::new(|s| {
                s.memory_limit_mb = MIN_MEMORY_MB;
                s.cpu_cores_limit = MIN_CPU_CORES.max(0.1);
                s.disk_mb = MIN_DISK_MB;
            }),
            "0".into(),
        ),
        (
            "uid",
            Box::new(|s| s.init_user = "54321".into()),
            "54321".into(),
        ),
        (
            "uidgid",
            Box::new(|s| s.init_user = "54321:54322".into()),
            "54321".into(),
        ),
        (
            "name",
            Box::new(move |s| s.init_user = name.clone()),
            uid.to_string(),
        ),
    ];
    let mut rt = RuntimeClient::new(edge.channel());
    for (suffix, f, want_uid) in &good {
        let mut s = spec();
        f(&mut s);
        let r = c
            .create_sandboxes(req(pb::EdgeCreateRequest {
                fork: None,
                spec: Some(s),
                items: vec![item(&edge_id, suffix)],
            }))
            .await
            .unwrap_or_else(|e| panic!("{suffix}: {e:?}"))
            .into_inner();
        let sb = match r.results.first() {
            Some(pb::EdgeCreateResult {
                sandbox: Some(sb),
                error: None,
            }) => sb.clone(),
            other => panic!("{suffix}: {other:?}"),
        };
        let out = rt
            .run_shell(req(pb::RunShellRequest {
                sandbox_id: sb.id.clone(),
                cmd: "id -u".into(),
                timeout: 30.0,
                ..Default::default()
            }))
            .await;
        // Stopped before anything is asserted, so that a failure leaves nothing running.
        let stopped = c
            .stop_sandbox(req(pb::SandboxRef { id: sb.id.clone() }))
            .await;
        let out = out
            .unwrap_or_else(|e| panic!("{suffix}: {e:?}"))
            .into_inner();
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            want_uid,
            "{suffix}: {out:?}"
        );
        stopped.unwrap_or_else(|e| panic!("{suffix}: {e:?}"));
        assert_eq!(edge.traces(&sb.id), Vec::<String>::new(), "{suffix}");
    }
    edge.stop().await;
}
