//! Unit tests of the edge's core with a recording test backend and a fake lease sink:
//! re-adoption from records, TTL passes at injected times, pressure and pause accounting.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use async_trait::async_trait;

use super::host::HostSample;
use super::leases::{BatchConfig, LeaseSink, Releaser};
use super::machine::Op;
use super::node::{lock, Core, Slot};
use super::ops::Cause;
use super::record::SandboxRecord;
use super::store::Store;
use crate::backends::{
    Adopted, Backend, BackendError, BackendState, CleanupReport, CreateRequest, Handle, Health,
    Recorded,
};
use crate::config::EdgeConfig;
use crate::pb::{self, SandboxState};
use crate::types::{now_s, Failure, Reason};

#[derive(Default)]
struct TestBackend {
    frees: bool,
    /// Added to a running sandbox's memory, as a microVM's `vm_overhead_mb` is.
    overhead_mb: i64,
    fail_adopt: HashSet<String>,
    adopted: Mutex<Vec<(String, Recorded)>>,
    cleaned: Mutex<Vec<HashSet<String>>>,
    created: Mutex<usize>,
    stopped: Mutex<Vec<String>>,
    /// When set, each creation waits for a permit.
    gate: Option<Arc<tokio::sync::Semaphore>>,
    /// When set, each creation blocks its thread until the hold is opened (a backend whose
    /// work keeps a runtime's workers busy).
    hold: Option<Arc<Hold>>,
    /// The rules each `update_network` was asked to apply, by sandbox.
    networks: Mutex<Vec<(String, HashMap<String, bool>)>>,
    /// `update_network` fails (as a container's would for a rule set the config lacks).
    refuse_network: bool,
    /// The rules each adopted sandbox's handle carried.
    adopted_rules: Mutex<Vec<(String, HashMap<String, bool>)>>,
}

#[derive(Default)]
struct Hold {
    open: Mutex<bool>,
    cv: std::sync::Condvar,
}

impl Hold {
    fn wait(&self) {
        let mut open = lock(&self.open);
        while !*open {
            open = self.cv.wait(open).unwrap_or_else(|e| e.into_inner());
        }
    }
    fn release(&self) {
        *lock(&self.open) = true;
        self.cv.notify_all();
    }
}

#[async_trait]
impl Backend for Arc<TestBackend> {
    fn name(&self) -> &str {
        "vm"
    }
    fn runtime_kind(&self) -> &'static str {
        "firecracker"
    }
    fn pause_frees_memory(&self) -> bool {
        self.frees
    }
    fn memory_charge(&self) -> pb::MemoryCharge {
        pb::MemoryCharge {
            floor_mb: 0,
            overhead_mb: self.overhead_mb,
        }
    }
    async fn create(&self, req: &CreateRequest) -> Result<BackendState, BackendError> {
        if let Some(g) = &self.gate {
            if let Ok(p) = g.acquire().await {
                p.forget();
            }
        }
        if let Some(h) = &self.hold {
            h.wait();
        }
        *lock(&self.created) += 1;
        Ok(serde_json::json!({ "for": req.sandbox_id }))
    }
    async fn stop(&self, s: &Handle<'_>) -> Result<(), BackendError> {
        lock(&self.stopped).push(s.sandbox_id.to_string());
        Ok(())
    }
    async fn pause(&self, s: &Handle<'_>) -> Result<BackendState, BackendError> {
        Ok(s.state.clone())
    }
    async fn resume(&self, s: &Handle<'_>) -> Result<BackendState, BackendError> {
        Ok(s.state.clone())
    }
    async fn probe(&self, _s: &Handle<'_>) -> Health {
        Health::Alive
    }
    async fn update_network(&self, s: &Handle<'_>) -> Result<(), BackendError> {
        if self.refuse_network {
            return Err(BackendError::Invalid {
                sandbox_id: s.sandbox_id.to_string(),
                message: "network_rules: no rule set named \"npm\"".into(),
            });
        }
        lock(&self.networks).push((s.sandbox_id.to_string(), s.spec.network_rules.clone()));
        Ok(())
    }
    async fn adopt(&self, s: &Handle<'_>, recorded: Recorded) -> Result<Adopted, BackendError> {
        lock(&self.adopted).push((s.sandbox_id.to_string(), recorded));
        lock(&self.adopted_rules).push((s.sandbox_id.to_string(), s.spec.network_rules.clone()));
        if self.fail_adopt.contains(s.sandbox_id) {
            return Err(BackendError::Adopt {
                sandbox_id: s.sandbox_id.to_string(),
                message: "process gone".into(),
            });
        }
        Ok(Adopted {
            state: serde_json::json!("adopted"),
            paused: recorded == Recorded::Paused,
        })
    }
    async fn cleanup(&self, keep: &HashSet<String>) -> Result<CleanupReport, BackendError> {
        lock(&self.cleaned).push(keep.clone());
        Ok(CleanupReport::default())
    }
}

#[derive(Default)]
struct Sink {
    released: Mutex<Vec<String>>,
    /// IAM's lease bindings; `None`: lookups fail (no IAM). Releases remove them.
    bindings: Option<Mutex<BTreeMap<String, pb::LeaseInfo>>>,
    /// When set, each release waits for a permit.
    gate: Option<Arc<tokio::sync::Semaphore>>,
}

#[async_trait]
impl LeaseSink for Sink {
    async fn release(&self, ids: Vec<String>, _at: i64) -> Result<(), Failure> {
        if let Some(g) = &self.gate {
            if let Ok(p) = g.acquire().await {
                p.forget();
            }
        }
        if let Some(b) = &self.bindings {
            for id in &ids {
                lock(b).remove(id);
            }
        }
        lock(&self.released).extend(ids);
        Ok(())
    }
    async fn lookup(&self, id: &str) -> Result<Option<pb::LeaseInfo>, Failure> {
        match &self.bindings {
            Some(b) => Ok(lock(b).get(id).cloned()),
            None => Err(Failure::unavailable("no IAM in unit tests")),
        }
    }
}

fn bound(edge: &str, sandbox: &str) -> pb::LeaseInfo {
    pb::LeaseInfo {
        edge_id: edge.into(),
        sandbox_id: sandbox.into(),
        ..Default::default()
    }
}

fn host() -> HostSample {
    HostSample {
        cpus: 4.0,
        mem_total_mb: 16000,
        mem_available_mb: 8000,
        disk_total_mb: 100_000,
        disk_free_mb: 50_000,
        cpu_pressure: None,
        cpu_usage: 0.0,
    }
}

fn core(
    backend: Arc<TestBackend>,
    cfg: EdgeConfig,
    store: Option<Store>,
    sink: Arc<Sink>,
) -> Arc<Core> {
    core_of(vec![("vm", backend)], cfg, store, sink)
}

/// A core whose backends are `backends`, by their configured names.
fn core_of(
    backends: Vec<(&str, Arc<TestBackend>)>,
    cfg: EdgeConfig,
    store: Option<Store>,
    sink: Arc<Sink>,
) -> Arc<Core> {
    let (releaser, _task) = Releaser::spawn(
        sink.clone(),
        BatchConfig {
            wait: Duration::from_millis(5),
            ..Default::default()
        },
    );
    let mut slots = BTreeMap::new();
    for (name, backend) in backends {
        let b: Arc<dyn Backend> = Arc::new(backend);
        slots.insert(
            name.to_string(),
            Slot {
                backend: b,
                max_sandboxes: 0,
                default_disk_mb: 1024,
            },
        );
    }
    let c = Arc::new(Core {
        edge_id: "e1".into(),
        addr: "127.0.0.1:1".into(),
        service_token: String::new(),
        dialer: crate::rpc::client::Dialer::plain(),
        watchers: vec![],
        slots,
        entries: Mutex::new(Default::default()),
        alloc: Mutex::new(Default::default()),
        host: RwLock::new(host()),
        capacity: RwLock::new(Default::default()),
        reserves: RwLock::new(Default::default()),
        draining: AtomicBool::new(false),
        drain_lock: tokio::sync::Mutex::new(()),
        store,
        leases: sink,
        releaser,
        paused_mem_charge: cfg.paused_mem_charge.unwrap_or(1.0),
        retention: cfg.stopped_retention() as i64,
        lease_checks: tokio::sync::Semaphore::new(4),
        real: true,
        incarnation: "test".into(),
        image_store: None,
        cfg,
    });
    super::loops::sample_into(&c, host());
    c
}

/// Creates sandbox `suffix` of `spec()` and returns its id.
async fn create_one(c: &Arc<Core>, suffix: &str) -> String {
    let out = c
        .create_batch(Some(spec()), vec![item(suffix)])
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    out[0]
        .sandbox
        .as_ref()
        .map(|s| s.id.clone())
        .unwrap_or_default()
}

fn spec() -> pb::SandboxSpec {
    pb::SandboxSpec {
        backend: "vm".into(),
        cpu_cores_limit: 1.0,
        memory_limit_mb: 1000,
        ttl_max: 100,
        ..Default::default()
    }
}

fn item(s: &str) -> pb::EdgeCreateItem {
    pb::EdgeCreateItem {
        sandbox_id: format!("e1.{s}"),
        lease_id: format!("L-{s}"),
        project: "root".into(),
        principal: "p".into(),
    }
}

fn rec(id: &str, state: SandboxState) -> SandboxRecord {
    let mut r = SandboxRecord::creating(
        &format!("e1.{id}"),
        "e1",
        &format!("L-{id}"),
        "root",
        "p",
        spec(),
        now_s(),
    );
    r.set_state(state);
    if matches!(state, SandboxState::Stopped | SandboxState::Failed) {
        r.sandbox.ended_at = now_s();
    }
    r
}

async fn released_eventually(sink: &Sink, n: usize) -> Vec<String> {
    for _ in 0..200 {
        let mut v = lock(&sink.released).clone();
        if v.len() >= n {
            v.sort();
            return v;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut v = lock(&sink.released).clone();
    v.sort();
    v
}

#[tokio::test]
async fn recovery_adopts_live_records_and_fails_interrupted_ones() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let store = Store::open(dir.path(), "e1").unwrap_or_else(|e| panic!("{e}"));
    let mut other = rec("other", SandboxState::Running);
    if let Some(s) = other.sandbox.spec.as_mut() {
        s.backend = "gone".into();
    }
    let recs = vec![
        rec("run", SandboxState::Running),
        rec("paused", SandboxState::Paused),
        rec("pausing", SandboxState::Pausing),
        rec("creating", SandboxState::Creating),
        rec("stopping", SandboxState::Stopping),
        rec("stopped", SandboxState::Stopped),
        rec("lost", SandboxState::Running),
        other,
    ];
    assert!(store.write_many(&recs).await.iter().all(|r| r.is_ok()));
    let backend = Arc::new(TestBackend {
        fail_adopt: ["e1.lost".to_string()].into_iter().collect(),
        ..Default::default()
    });
    let sink = Arc::new(Sink::default());
    let c = core(
        backend.clone(),
        EdgeConfig::default(),
        Some(store.clone()),
        sink.clone(),
    );
    let report = c.recover().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (
            report.adopted,
            report.failed,
            report.stopped,
            report.kept_ended
        ),
        (3, 3, 1, 1),
        "{report:?}"
    );

    let state = |id: &str| c.get(&format!("e1.{id}")).map(|e| e.snapshot().state());
    assert_eq!(state("run"), Some(SandboxState::Running));
    assert_eq!(state("paused"), Some(SandboxState::Paused));
    assert_eq!(
        state("pausing"),
        Some(SandboxState::Running),
        "the backend says the pause did not happen"
    );
    assert_eq!(state("creating"), Some(SandboxState::Failed));
    assert_eq!(state("stopping"), Some(SandboxState::Stopped));
    assert_eq!(state("stopped"), Some(SandboxState::Stopped));
    assert_eq!(state("lost"), Some(SandboxState::Failed));
    assert_eq!(state("other"), Some(SandboxState::Failed));
    assert_eq!(
        c.get("e1.run").map(|e| e.snapshot().backend_state),
        Some(serde_json::json!("adopted"))
    );
    let mut adopted = lock(&backend.adopted).clone();
    adopted.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(
        adopted,
        vec![
            ("e1.lost".into(), Recorded::Running),
            ("e1.paused".into(), Recorded::Paused),
            ("e1.pausing".into(), Recorded::Running),
            ("e1.run".into(), Recorded::Running)
        ]
    );
    let keep: HashSet<String> = ["e1.run", "e1.paused", "e1.pausing"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(
        lock(&backend.cleaned).clone(),
        vec![keep],
        "cleanup keeps exactly the live records"
    );
    assert_eq!(
        lock(&c.alloc).count("vm"),
        3,
        "allocation rebuilt from live records"
    );
    // Interrupted and unadoptable sandboxes give their leases back (the sink's lookup fails,
    // so verified releases stay queued: nothing is released blindly).
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        lock(&sink.released).is_empty(),
        "verified releases wait for IAM to confirm the binding"
    );
    // The new states are on disk.
    let (back, _) = store.load_all().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        back.iter()
            .find(|r| r.id() == "e1.creating")
            .map(|r| r.state()),
        Some(SandboxState::Failed)
    );
}

/// Every backend's cleanup at recovery is given every live sandbox of the edge, not only
/// its own: backends share what they keep per sandbox (the image store's in-use records of
/// the edge), and a container backend once removed a running microVM's that way.
#[tokio::test]
async fn recovery_cleanup_keeps_every_backends_live_sandboxes() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let store = Store::open(dir.path(), "e1").unwrap_or_else(|e| panic!("{e}"));
    let mut vm = rec("vm1", SandboxState::Paused);
    if let Some(s) = vm.sandbox.spec.as_mut() {
        s.backend = "microvm".into();
    }
    let recs = vec![
        rec("ct1", SandboxState::Running),
        vm,
        rec("ended", SandboxState::Stopped),
    ];
    assert!(store.write_many(&recs).await.iter().all(|r| r.is_ok()));
    let (ct, mv) = (
        Arc::new(TestBackend::default()),
        Arc::new(TestBackend::default()),
    );
    let c = core_of(
        vec![("vm", ct.clone()), ("microvm", mv.clone())],
        EdgeConfig::default(),
        Some(store),
        Arc::new(Sink::default()),
    );
    let report = c.recover().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.adopted, 2, "{report:?}");
    let keep: HashSet<String> = ["e1.ct1", "e1.vm1"].iter().map(|s| s.to_string()).collect();
    assert_eq!(lock(&ct.cleaned).clone(), vec![keep.clone()]);
    assert_eq!(lock(&mv.cleaned).clone(), vec![keep]);
}

#[tokio::test]
async fn ttl_pass_stops_at_the_lifetime_and_drops_after_retention() {
    let sink = Arc::new(Sink::default());
    let cfg = EdgeConfig {
        stopped_retention: 50.0,
        ..Default::default()
    };
    let c = core(Arc::new(TestBackend::default()), cfg, None, sink.clone());
    let out = c
        .create_batch(Some(spec()), vec![item("a"), item("b")])
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert!(out.iter().all(|r| r.error.is_none()));
    let t0 = now_s();
    super::loops::ttl_pass(&c, t0 + 50).await;
    assert_eq!(
        c.get("e1.a").map(|e| e.snapshot().state()),
        Some(SandboxState::Running)
    );
    // Past the 100 s lifetime (as if time had passed).
    super::loops::ttl_pass(&c, t0 + 200).await;
    for _ in 0..200 {
        if c.all().iter().all(|e| e.snapshot().is_ended()) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let a = c
        .get("e1.a")
        .map(|e| e.snapshot())
        .unwrap_or_else(|| panic!("record gone too early"));
    assert_eq!(a.state(), SandboxState::Stopped);
    assert_eq!(a.sandbox.message, super::ttl::LIFETIME_MESSAGE);
    assert_eq!(
        released_eventually(&sink, 2).await,
        vec!["L-a", "L-b"],
        "ended by TTL: leases released"
    );
    assert_eq!(lock(&c.alloc).total.memory_mb, 0);
    // Retention: dropped 50 s after the end.
    super::loops::ttl_pass(&c, a.sandbox.ended_at + 10).await;
    assert!(c.get("e1.a").is_some());
    super::loops::ttl_pass(&c, a.sandbox.ended_at + 51).await;
    assert!(c.get("e1.a").is_none() && c.get("e1.b").is_none());
}

#[tokio::test]
async fn a_call_in_flight_holds_off_the_idle_timeout() {
    let c = core(
        Arc::new(TestBackend::default()),
        EdgeConfig::default(),
        None,
        Arc::new(Sink::default()),
    );
    let idle = pb::SandboxSpec {
        ttl_running_stop: 10,
        ttl_max: 0,
        ..spec()
    };
    c.create_batch(Some(idle), vec![item("a")])
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    let e = c.get("e1.a").unwrap_or_else(|| panic!("missing"));
    e.calls.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
    super::loops::ttl_pass(&c, now_s() + 1000).await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(e.snapshot().state(), SandboxState::Running);
    e.calls.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    super::loops::ttl_pass(&c, now_s() + 1000).await;
    for _ in 0..200 {
        if e.snapshot().is_ended() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(e.snapshot().sandbox.message, super::ttl::IDLE_MESSAGE);
}

#[tokio::test]
async fn pressure_and_capacity_refuse_with_no_capacity() {
    let cfg = EdgeConfig {
        capacity: crate::config::CapacityConfig {
            memory_mb: 2500,
            ..Default::default()
        },
        ..Default::default()
    };
    let c = core(
        Arc::new(TestBackend::default()),
        cfg,
        None,
        Arc::new(Sink::default()),
    );
    let out = c
        .create_batch(Some(spec()), vec![item("a"), item("b"), item("c")])
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    let errs: Vec<_> = out
        .iter()
        .map(|r| {
            r.error
                .as_ref()
                .map(|e| (e.reason.clone(), e.message.clone()))
        })
        .collect();
    assert!(errs[0].is_none() && errs[1].is_none());
    let (reason, msg) = errs[2].clone().unwrap_or_default();
    assert_eq!(reason, "no_capacity");
    assert!(
        msg.contains("memory_mb: 1000 requested, 500 of 2500 free"),
        "{msg}"
    );
    // Memory pressure refuses everything, naming it.
    super::loops::sample_into(
        &c,
        HostSample {
            mem_available_mb: 10,
            ..host()
        },
    );
    let out = c
        .create_batch(Some(spec()), vec![item("d")])
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    let e = out[0].error.clone().unwrap_or_default();
    assert_eq!(e.reason, "no_capacity");
    assert!(e.message.contains("memory pressure"), "{}", e.message);
    let st = c.edge_state();
    assert!(st.under_pressure && st.pressure_reason.contains("MemAvailable 10 MB"));
    // Bad specs are invalid for the whole call.
    let bad = c
        .create_batch(
            Some(pb::SandboxSpec {
                cpu_cores_limit: -1.0,
                ..spec()
            }),
            vec![item("e")],
        )
        .await;
    assert_eq!(bad.err().map(|f| f.reason), Some(Reason::Invalid));
}

/// A running microVM takes its guest memory plus `vm_overhead_mb` from the node; paused, the
/// VMM is gone and only `paused_mem_charge` of the guest memory stays charged.
#[tokio::test]
async fn admission_charges_the_backends_overhead_while_running() {
    let cfg = EdgeConfig {
        paused_mem_charge: Some(0.25),
        capacity: crate::config::CapacityConfig {
            memory_mb: 2150,
            ..Default::default()
        },
        ..Default::default()
    };
    let c = core(
        Arc::new(TestBackend {
            frees: true,
            overhead_mb: 100,
            ..Default::default()
        }),
        cfg,
        None,
        Arc::new(Sink::default()),
    );
    c.create_batch(Some(spec()), vec![item("a")])
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(lock(&c.alloc).total.memory_mb, 1100, "1000 + 100 overhead");
    // Placement learns the same charge from the edge's state.
    assert_eq!(
        c.edge_state().memory_charges.get("vm"),
        Some(&pb::MemoryCharge {
            floor_mb: 0,
            overhead_mb: 100
        })
    );
    // 1000 + 1000 would fit 2150; with the overhead it does not.
    let out = c
        .create_batch(Some(spec()), vec![item("b")])
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    let e = out[0].error.clone().unwrap_or_default();
    assert_eq!(e.reason, "no_capacity");
    assert!(
        e.message.contains("memory_mb: 1100 requested"),
        "{}",
        e.message
    );
    assert_eq!(
        lock(&c.alloc).total.memory_mb,
        1100,
        "a refusal charges nothing"
    );
    c.lifecycle("e1.a", Op::Pause, Cause::Caller)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(
        lock(&c.alloc).total.memory_mb,
        250,
        "1000 × 0.25, no overhead"
    );
    // 250 + 1100 for a new one fits; then a's resume needs its 1100 back: 850 more, 800 free.
    c.create_batch(Some(spec()), vec![item("c")])
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    let r = c.lifecycle("e1.a", Op::Resume, Cause::Caller).await;
    assert_eq!(r.err().map(|f| f.reason), Some(Reason::NoCapacity));
    c.lifecycle("e1.c", Op::Stop, Cause::Caller)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    c.lifecycle("e1.a", Op::Resume, Cause::Caller)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(lock(&c.alloc).total.memory_mb, 1100);
}

#[tokio::test]
async fn paused_memory_is_charged_by_paused_mem_charge_and_needed_back_to_resume() {
    let cfg = EdgeConfig {
        paused_mem_charge: Some(0.25),
        capacity: crate::config::CapacityConfig {
            memory_mb: 2000,
            ..Default::default()
        },
        ..Default::default()
    };
    let c = core(
        Arc::new(TestBackend {
            frees: true,
            ..Default::default()
        }),
        cfg,
        None,
        Arc::new(Sink::default()),
    );
    c.create_batch(Some(spec()), vec![item("a"), item("b")])
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    c.lifecycle("e1.a", Op::Pause, Cause::Caller)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(lock(&c.alloc).total.memory_mb, 1250, "1000 + 1000 × 0.25");
    assert_eq!(
        lock(&c.alloc).count("vm"),
        2,
        "paused still counts as a sandbox"
    );
    // The freed 750 MB are taken by a smaller sandbox; resuming a needs them back.
    let small = pb::SandboxSpec {
        memory_limit_mb: 700,
        ..spec()
    };
    let out = c
        .create_batch(Some(small), vec![item("c")])
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert!(out[0].error.is_none());
    let r = c.lifecycle("e1.a", Op::Resume, Cause::Caller).await;
    assert_eq!(r.err().map(|f| f.reason), Some(Reason::NoCapacity));
    assert_eq!(
        c.get("e1.a").map(|e| e.snapshot().state()),
        Some(SandboxState::Paused),
        "a refused resume leaves it paused"
    );
    c.lifecycle("e1.c", Op::Stop, Cause::Caller)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    let r = c
        .lifecycle("e1.a", Op::Resume, Cause::Caller)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(r.state, SandboxState::Running as i32);
    assert_eq!(lock(&c.alloc).total.memory_mb, 2000);
}

#[tokio::test]
async fn big_batches_and_duplicate_ids_create_each_sandbox_once() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let store = Store::open(dir.path(), "e1").unwrap_or_else(|e| panic!("{e}"));
    let backend = Arc::new(TestBackend::default());
    let big = crate::config::CapacityConfig {
        cpu_cores: 10_000.0,
        memory_mb: 10_000_000,
        disk_mb: 10_000_000,
        gpus: 0,
    };
    let c = core(
        backend.clone(),
        EdgeConfig {
            capacity: big,
            ..Default::default()
        },
        Some(store.clone()),
        Arc::new(Sink::default()),
    );
    let mut items: Vec<_> = (0..2000).map(|i| item(&format!("s{i}"))).collect();
    items.push(item("s7"));
    let out = c
        .create_batch(Some(spec()), items)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(out.len(), 2001);
    let errs: Vec<_> = out.iter().filter_map(|r| r.error.clone()).collect();
    assert!(
        errs.is_empty(),
        "{} errors, first {:?}",
        errs.len(),
        errs.first()
    );
    assert_eq!(
        out[2000].sandbox.as_ref().map(|s| s.id.as_str()),
        Some("e1.s7")
    );
    assert_eq!(*lock(&backend.created), 2000);
    let (back, _) = store.load_all().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(back.len(), 2000);
    assert!(back.iter().all(|r| r.state() == SandboxState::Running));
    // A retry of part of the batch creates nothing.
    let again = c
        .create_batch(
            Some(spec()),
            (0..10).map(|i| item(&format!("s{i}"))).collect(),
        )
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert!(again.iter().all(|r| r.sandbox.is_some()));
    assert_eq!(*lock(&backend.created), 2000);
}

#[tokio::test]
async fn sim_only_edges_report_no_actual_use_while_real_ones_report_the_host() {
    let real = core(
        Arc::new(TestBackend::default()),
        EdgeConfig::default(),
        None,
        Arc::new(Sink::default()),
    );
    super::loops::sample_into(
        &real,
        HostSample {
            cpu_usage: 0.7,
            mem_available_mb: 4000,
            ..host()
        },
    );
    let st = real.edge_state();
    assert!((st.cpu_usage - 0.7).abs() < 1e-9);
    assert!(st.mem_usage > 0.5);

    let sim = core(
        Arc::new(TestBackend::default()),
        EdgeConfig::default(),
        None,
        Arc::new(Sink::default()),
    );
    let mut sim = Arc::try_unwrap(sim).unwrap_or_else(|_| panic!("core still shared"));
    let b: Arc<dyn Backend> = Arc::new(
        crate::backends::sim::SimBackend::new("sim", &crate::config::BackendConfig::default())
            .unwrap(),
    );
    sim.slots.clear();
    sim.slots.insert(
        "sim".to_string(),
        Slot {
            backend: b,
            max_sandboxes: 0,
            default_disk_mb: 1024,
        },
    );
    super::loops::sample_into(
        &sim,
        HostSample {
            cpu_usage: 0.7,
            mem_available_mb: 4000,
            ..host()
        },
    );
    let st = sim.edge_state();
    assert_eq!(
        (st.cpu_usage, st.mem_usage),
        (0.0, 0.0),
        "simulated sandboxes use nothing; the host's load must not steer placement"
    );
}

fn service(c: &Arc<Core>) -> super::service::EdgeService {
    super::service::EdgeService {
        core: c.clone(),
        work: Arc::new(
            crate::rt::Dedicated::per_cpu("edge-work").unwrap_or_else(|e| panic!("{e}")),
        ),
    }
}

/// The watcher's probe (`Status`, 0.5 s timeout) must be answered while every worker of the
/// edge's operations is busy: here each creation blocks its thread until the test (or, so
/// that a broken build fails rather than hangs, a timer 10 s later) lets it go.
#[tokio::test]
async fn status_answers_while_creations_keep_every_worker_busy() {
    use pb::edge_server::Edge;
    let hold = Arc::new(Hold::default());
    let backend = Arc::new(TestBackend {
        hold: Some(hold.clone()),
        ..Default::default()
    });
    let c = core(
        backend.clone(),
        EdgeConfig::default(),
        None,
        Arc::new(Sink::default()),
    );
    let svc = Arc::new(service(&c));
    let released_by_timer = Arc::new(AtomicBool::new(false));
    // Detached: it outlives a passing test harmlessly.
    let _timer = {
        let (hold, flag) = (hold.clone(), released_by_timer.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(10));
            flag.store(true, std::sync::atomic::Ordering::SeqCst);
            hold.release();
        })
    };
    let n = std::thread::available_parallelism().map_or(1, |n| n.get()) + 2;
    let mut calls = Vec::new();
    for i in 0..n {
        let svc = svc.clone();
        calls.push(tokio::spawn(async move {
            svc.create_sandboxes(tonic::Request::new(pb::EdgeCreateRequest {
                spec: Some(spec()),
                fork: None,
                items: vec![item(&format!("b{i}"))],
            }))
            .await
        }));
    }
    // Every creation has reached the backend (and blocks a worker there).
    for _ in 0..500 {
        let creating = (0..n)
            .filter(|i| {
                c.get(&format!("e1.b{i}"))
                    .is_some_and(|e| e.snapshot().state() == SandboxState::Creating)
            })
            .count();
        if creating == n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let st = svc
        .status(tonic::Request::new(pb::StatusRequest {
            with_leases: false,
        }))
        .await
        .unwrap_or_else(|s| panic!("{s}"))
        .into_inner();
    assert!(
        !released_by_timer.load(std::sync::atomic::Ordering::SeqCst),
        "Status waited until the creations were let go"
    );
    assert_eq!(st.edge_id, "e1");
    hold.release();
    for call in calls {
        let out = call
            .await
            .unwrap_or_else(|e| panic!("{e}"))
            .unwrap_or_else(|s| panic!("{s}"))
            .into_inner();
        assert_eq!(
            out.results[0].sandbox.as_ref().map(|s| s.state),
            Some(SandboxState::Running as i32)
        );
    }
    assert_eq!(*lock(&backend.created), n);
}

#[tokio::test]
async fn a_caller_that_goes_away_does_not_leave_a_creation_halfway() {
    use pb::edge_server::Edge;
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let backend = Arc::new(TestBackend {
        gate: Some(gate.clone()),
        ..Default::default()
    });
    let c = core(
        backend.clone(),
        EdgeConfig::default(),
        None,
        Arc::new(Sink::default()),
    );
    let svc = service(&c);
    let call = svc.create_sandboxes(tonic::Request::new(pb::EdgeCreateRequest {
        spec: Some(spec()),
        fork: None,
        items: vec![item("a")],
    }));
    // The apiserver goes away while the backend is still creating: its call is dropped.
    assert!(tokio::time::timeout(Duration::from_millis(200), call)
        .await
        .is_err());
    assert_eq!(
        c.get("e1.a").map(|e| e.snapshot().state()),
        Some(SandboxState::Creating)
    );
    gate.add_permits(1);
    for _ in 0..200 {
        if c.get("e1.a")
            .is_some_and(|e| e.snapshot().state() != SandboxState::Creating)
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        c.get("e1.a").map(|e| e.snapshot().state()),
        Some(SandboxState::Running),
        "the creation went on to the end"
    );
    // The retry finds it RUNNING and creates nothing more.
    let again = svc.create_sandboxes(tonic::Request::new(pb::EdgeCreateRequest {
        spec: Some(spec()),
        fork: None,
        items: vec![item("a")],
    }));
    let out = tokio::time::timeout(Duration::from_secs(5), again)
        .await
        .unwrap_or_else(|_| panic!("retry hung"))
        .unwrap_or_else(|s| panic!("{s}"))
        .into_inner();
    assert_eq!(
        out.results[0].sandbox.as_ref().map(|s| s.state),
        Some(SandboxState::Running as i32)
    );
    assert_eq!(*lock(&backend.created), 1);
}

#[tokio::test]
async fn a_retry_creates_again_what_a_restart_interrupted_once_its_lease_is_settled() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let store = Store::open(dir.path(), "e1").unwrap_or_else(|e| panic!("{e}"));
    let mut broken = rec("broken", SandboxState::Failed);
    broken.sandbox.message = "the backend failed".into();
    assert!(store
        .write_many(&[rec("cut", SandboxState::Creating), broken])
        .await
        .iter()
        .all(|r| r.is_ok()));
    let bindings: BTreeMap<String, pb::LeaseInfo> = [("L-cut".to_string(), bound("e1", "e1.cut"))]
        .into_iter()
        .collect();
    let release_gate = Arc::new(tokio::sync::Semaphore::new(0));
    let sink = Arc::new(Sink {
        bindings: Some(Mutex::new(bindings)),
        gate: Some(release_gate.clone()),
        ..Default::default()
    });
    let backend = Arc::new(TestBackend::default());
    let c = core(
        backend.clone(),
        EdgeConfig::default(),
        Some(store.clone()),
        sink.clone(),
    );
    let report = c.recover().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.failed, 1);
    let create = |s: &'static str| {
        let c = c.clone();
        async move {
            c.create_batch(Some(spec()), vec![item(s)])
                .await
                .unwrap_or_else(|f| panic!("{f}"))
                .remove(0)
        }
    };

    // While the interrupted creation's lease is being released: unavailable (retry).
    let r = create("cut").await;
    assert_eq!(
        r.error.as_ref().map(|e| e.reason.as_str()),
        Some("unavailable"),
        "{r:?}"
    );
    assert!(
        r.error
            .as_ref()
            .is_some_and(|e| e.message.contains("still being released")),
        "{r:?}"
    );
    release_gate.add_permits(1);
    assert_eq!(released_eventually(&sink, 1).await, vec!["L-cut"]);
    for _ in 0..200 {
        if !c.releaser.is_pending("L-cut") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(!c.releaser.is_pending("L-cut"));
    // Released, and not admitted again yet: still unavailable.
    let r = create("cut").await;
    assert_eq!(
        r.error.as_ref().map(|e| e.reason.as_str()),
        Some("unavailable"),
        "{r:?}"
    );
    assert_eq!(*lock(&backend.created), 0);

    // The apiserver's retry admits the lease again, bound here: created again, once.
    if let Some(b) = &sink.bindings {
        lock(b).insert("L-cut".into(), bound("e1", "e1.cut"));
    }
    let r = create("cut").await;
    let sb = r.sandbox.unwrap_or_else(|| panic!("{:?}", r.error));
    assert_eq!((sb.state, sb.ended_at), (SandboxState::Running as i32, 0));
    assert_eq!(*lock(&backend.created), 1);
    assert!(c.get("e1.cut").is_some_and(|e| !e.snapshot().interrupted));
    let r = create("cut").await;
    assert_eq!(
        r.sandbox.map(|s| s.state),
        Some(SandboxState::Running as i32)
    );
    assert_eq!(*lock(&backend.created), 1);
    let (back, _) = store.load_all().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        back.iter().find(|r| r.id() == "e1.cut").map(|r| r.state()),
        Some(SandboxState::Running)
    );

    // A creation that failed on its own is not tried again: the retry gets the failure.
    let r = create("broken").await;
    assert_eq!(
        r.sandbox.map(|s| (s.state, s.message)),
        Some((
            SandboxState::Failed as i32,
            "the backend failed".to_string()
        ))
    );
    assert_eq!(*lock(&backend.created), 1);
}

/// A creation waits for no fsync: its CREATING record is staged and its RUNNING record is
/// renamed into place before the answer and made durable by the syncer thread right after,
/// in group rounds. With the syncer held, creations are still answered (and their RUNNING
/// records are on disk); released, one sandbox costs its file and the directory, and a
/// batch of three costs three files and one directory (it was four fsyncs a creation with
/// every record synced, then two on each creation's path).
#[tokio::test]
// The guard blocks the syncer thread, not this task: holding it across the creation is the test.
#[allow(clippy::await_holding_lock)]
async fn a_creation_waits_for_no_fsync_and_its_record_is_synced_behind() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let store = Store::open(dir.path(), "e1").unwrap_or_else(|e| panic!("{e}"));
    let c = core(
        Arc::new(TestBackend::default()),
        EdgeConfig::default(),
        Some(store.clone()),
        Arc::new(Sink::default()),
    );
    let held = store.hold_syncs();
    let out = c
        .create_batch(Some(spec()), vec![item("one")])
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert!(out[0].error.is_none(), "{out:?}");
    assert_eq!(store.syncs(), 0, "nothing synced on the creation's path");
    let (back, _) = store.load_all().unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        back.iter().map(|r| r.state()).collect::<Vec<_>>(),
        vec![SandboxState::Running],
        "the RUNNING record is in place before the answer"
    );
    drop(held);
    store.flush().await;
    assert_eq!(store.syncs(), 2, "one record file and its directory");
    let held = store.hold_syncs();
    let out = c
        .create_batch(Some(spec()), vec![item("b1"), item("b2"), item("b3")])
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert!(out.iter().all(|r| r.error.is_none()), "{out:?}");
    assert_eq!(store.syncs(), 2);
    drop(held);
    store.flush().await;
    assert_eq!(store.syncs(), 2 + 4, "three record files and one directory");
    let (back, bad) = store.load_all().unwrap_or_else(|e| panic!("{e}"));
    assert!(bad.is_empty());
    assert_eq!(back.len(), 4);
    assert!(back.iter().all(|r| r.state() == SandboxState::Running));
}

/// What a crash can leave of a staged CREATING record, each ending right at the restart:
/// the record whole (FAILED, interrupted, its lease released once IAM confirms it), a torn
/// file (set aside as corrupt) or no file at all. Neither of the last two is kept from the
/// backend's cleanup of leftovers, and the caller's retry creates each once.
#[tokio::test]
async fn a_crash_that_loses_a_staged_creating_record_ends_right() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let store = Store::open(dir.path(), "e1").unwrap_or_else(|e| panic!("{e}"));
    assert!(store
        .stage_many(&[
            rec("whole", SandboxState::Creating),
            rec("torn", SandboxState::Creating),
            rec("live", SandboxState::Running),
        ])
        .await
        .iter()
        .all(|r| r.is_ok()));
    assert_eq!(store.syncs(), 0, "staged: no fsync");
    // The crash: the torn one's rename reached the disk, its data did not; the lost one
    // (never on disk) needs no file. "live" stands for the sandboxes that are kept.
    std::fs::write(store.path_of("e1.torn"), b"").unwrap_or_else(|e| panic!("{e}"));
    let bindings: BTreeMap<String, pb::LeaseInfo> = ["whole", "torn", "lost"]
        .iter()
        .map(|s| (format!("L-{s}"), bound("e1", &format!("e1.{s}"))))
        .collect();
    let sink = Arc::new(Sink {
        bindings: Some(Mutex::new(bindings)),
        ..Default::default()
    });
    let backend = Arc::new(TestBackend::default());
    let c = core(
        backend.clone(),
        EdgeConfig::default(),
        Some(store.clone()),
        sink.clone(),
    );
    let report = c.recover().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(
        (report.adopted, report.failed, report.corrupt),
        (1, 1, 1),
        "{report:?}"
    );
    let keep: HashSet<String> = ["e1.live".to_string()].into_iter().collect();
    assert_eq!(
        lock(&backend.cleaned).clone(),
        vec![keep],
        "whatever the torn and the lost creations made is cleaned up"
    );
    assert!(c.get("e1.whole").is_some_and(|e| {
        let r = e.snapshot();
        r.state() == SandboxState::Failed && r.interrupted
    }));
    assert!(c.get("e1.torn").is_none() && c.get("e1.lost").is_none());
    assert_eq!(released_eventually(&sink, 1).await, vec!["L-whole"]);

    // The callers retry; the apiserver binds the whole one's lease here again.
    if let Some(b) = &sink.bindings {
        lock(b).insert("L-whole".into(), bound("e1", "e1.whole"));
    }
    for _ in 0..200 {
        if !c.releaser.is_pending("L-whole") {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    for s in ["whole", "torn", "lost"] {
        let r = c
            .create_batch(Some(spec()), vec![item(s)])
            .await
            .unwrap_or_else(|f| panic!("{f}"))
            .remove(0);
        let sb = r.sandbox.unwrap_or_else(|| panic!("{s}: {:?}", r.error));
        assert_eq!(sb.state, SandboxState::Running as i32, "{s}");
    }
    assert_eq!(*lock(&backend.created), 3, "each created once");
    let (back, _) = store.load_all().unwrap_or_else(|e| panic!("{e}"));
    for s in ["whole", "torn", "lost"] {
        assert_eq!(
            back.iter()
                .find(|r| r.id() == format!("e1.{s}"))
                .map(|r| r.state()),
            Some(SandboxState::Running),
            "{s}"
        );
    }
    assert_eq!(
        lock(&sink.released).clone(),
        vec!["L-whole"],
        "no lease of a retried creation was given back"
    );
}

/// A sandbox the backend lost (its agent exited: a sandbox's root can end it) is FAILED, and
/// what it left on the node is removed at once (before, only the edge's next start did).
#[tokio::test]
async fn a_lost_sandbox_is_failed_and_removed_from_the_node() {
    let backend = Arc::new(TestBackend::default());
    let c = core(
        backend.clone(),
        EdgeConfig::default(),
        None,
        Arc::new(Sink::default()),
    );
    let id = create_one(&c, "lost").await;
    assert!(lock(&backend.stopped).is_empty());
    c.mark_lost(&id, "aether exited").await;
    let rec = c.get(&id).map(|e| e.snapshot());
    assert_eq!(rec.map(|r| r.state()), Some(SandboxState::Failed));
    assert_eq!(*lock(&backend.stopped), vec![id]);
}

/// An edge without sandbox networking refuses network rules, naming its setting; with
/// networking on, the same spec is taken.
#[tokio::test]
async fn network_rules_need_an_edge_with_networking() {
    let mut s = spec();
    s.network_rules.insert("192.0.2.0/24:443".into(), true);
    let off = core(
        Arc::new(TestBackend::default()),
        EdgeConfig::default(),
        None,
        Arc::new(Sink::default()),
    );
    let f = off
        .create_batch(Some(s.clone()), vec![item("n")])
        .await
        .unwrap_err();
    assert_eq!(f.reason, Reason::Invalid);
    assert_eq!(
        f.message,
        "network_rules: edge e1 has no sandbox networking (its edges[].network.enabled is \
         false), so its sandboxes have only a loopback interface; leave network_rules empty"
    );
    assert!(off.all().is_empty());
    let mut cfg = EdgeConfig::default();
    cfg.network.enabled = true;
    let on = core(
        Arc::new(TestBackend::default()),
        cfg,
        None,
        Arc::new(Sink::default()),
    );
    let out = on
        .create_batch(Some(s), vec![item("n")])
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert!(out[0].error.is_none(), "{:?}", out[0].error);
}

fn rules(pairs: &[(&str, bool)]) -> HashMap<String, bool> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

fn networked() -> EdgeConfig {
    let mut cfg = EdgeConfig::default();
    cfg.network.enabled = true;
    cfg
}

/// Creates sandbox `e1.<suffix>` with `own` as its network rules; returns its id.
async fn create_with_rules(c: &Arc<Core>, suffix: &str, own: &[(&str, bool)]) -> String {
    let mut s = spec();
    s.network_rules = rules(own);
    let out = c
        .create_batch(Some(s), vec![item(suffix)])
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert!(out[0].error.is_none(), "{:?}", out[0].error);
    format!("e1.{suffix}")
}

fn rules_of(sb: &pb::Sandbox) -> HashMap<String, bool> {
    sb.spec.clone().unwrap_or_default().network_rules
}

/// `UpdateNetwork` merges (the given rules win, whatever their spelling) or replaces; the
/// backend applies the result before it is recorded, and `GetSandbox` shows it. A paused
/// sandbox's rules change too, and it stays paused.
#[tokio::test]
async fn update_network_merges_or_replaces_and_the_backend_applies_it() {
    let backend = Arc::new(TestBackend::default());
    let c = core(
        backend.clone(),
        networked(),
        None,
        Arc::new(Sink::default()),
    );
    let id = create_with_rules(&c, "n", &[("pypi", true), ("github.com", true)]).await;
    let sb = c
        .update_network(
            &id,
            rules(&[("*.GitHub.com", false), ("192.0.2.10", true)]),
            false,
        )
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    let want = rules(&[
        ("pypi", true),
        ("*.GitHub.com", false),
        ("192.0.2.10", true),
    ]);
    assert_eq!(rules_of(&sb), want);
    assert_eq!(
        rules_of(&c.get_sandbox(&id).unwrap_or_else(|f| panic!("{f}"))),
        want
    );
    assert_eq!(*lock(&backend.networks), vec![(id.clone(), want)]);

    let sb = c
        .update_network(&id, rules(&[("npm", true)]), true)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(rules_of(&sb), rules(&[("npm", true)]));
    // The same rules again change nothing and ask the backend for nothing.
    c.update_network(&id, rules(&[("npm", true)]), false)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(lock(&backend.networks).len(), 2);

    c.lifecycle(&id, Op::Pause, Cause::Caller)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    let sb = c
        .update_network(&id, HashMap::new(), true)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert!(rules_of(&sb).is_empty());
    assert_eq!(sb.state(), SandboxState::Paused);
    assert_eq!(lock(&backend.networks).len(), 3);
    // The other fields of the spec are untouched.
    let s = sb.spec.unwrap_or_default();
    assert_eq!((s.memory_limit_mb, s.ttl_max), (1000, 100));
}

/// A malformed rule, a backend that cannot apply the rules, too many rules, an ended
/// sandbox and an edge without networking are refused, and the rules stay as they were.
#[tokio::test]
async fn update_network_refusals_change_nothing() {
    let backend = Arc::new(TestBackend::default());
    let c = core(
        backend.clone(),
        networked(),
        None,
        Arc::new(Sink::default()),
    );
    let id = create_with_rules(&c, "n", &[("pypi", true)]).await;
    let unchanged = |c: &Arc<Core>| {
        assert_eq!(
            rules_of(&c.get_sandbox(&id).unwrap_or_else(|f| panic!("{f}"))),
            rules(&[("pypi", true)])
        );
    };
    let f = c
        .update_network(&id, rules(&[("ok.io", true), ("x.io:0", true)]), false)
        .await
        .unwrap_err();
    assert_eq!(f.reason, Reason::Invalid);
    assert_eq!(
        f.message,
        "rules: network rule \"x.io:0\": port outside 1-65535"
    );
    unchanged(&c);
    let many: HashMap<String, bool> = (0..crate::netpol::MAX_NETWORK_RULES)
        .map(|i| (format!("h{i}.example.com"), true))
        .collect();
    let f = c.update_network(&id, many, false).await.unwrap_err();
    assert_eq!(f.reason, Reason::Invalid);
    assert!(
        f.message.contains("1025 network rules, at most 1024"),
        "{}",
        f.message
    );
    unchanged(&c);
    assert!(
        lock(&backend.networks).is_empty(),
        "the backend was not asked"
    );
    let f = c
        .update_network("e1.nope", rules(&[("npm", true)]), false)
        .await
        .unwrap_err();
    assert_eq!(f.reason, Reason::NotFound);

    let refusing = Arc::new(TestBackend {
        refuse_network: true,
        ..Default::default()
    });
    let r = core(refusing, networked(), None, Arc::new(Sink::default()));
    let rid = create_with_rules(&r, "n", &[("pypi", true)]).await;
    let f = r
        .update_network(&rid, rules(&[("npm", true)]), false)
        .await
        .unwrap_err();
    assert_eq!(f.reason, Reason::Invalid);
    assert!(f.message.contains("no rule set named"), "{}", f.message);
    assert_eq!(
        rules_of(&r.get_sandbox(&rid).unwrap_or_else(|f| panic!("{f}"))),
        rules(&[("pypi", true)])
    );

    c.lifecycle(&id, Op::Stop, Cause::Caller)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    let f = c
        .update_network(&id, rules(&[("npm", true)]), false)
        .await
        .unwrap_err();
    assert_eq!(f.reason, Reason::Conflict);
    assert!(f.message.contains("STOPPED"), "{}", f.message);
    unchanged(&c);

    // Without networking: an allowance is refused as at creation; taking rules back is not.
    let off = core(
        Arc::new(TestBackend::default()),
        EdgeConfig::default(),
        None,
        Arc::new(Sink::default()),
    );
    let oid = create_with_rules(&off, "o", &[]).await;
    let f = off
        .update_network(&oid, rules(&[("192.0.2.0/24:443", true)]), false)
        .await
        .unwrap_err();
    assert_eq!(f.reason, Reason::Invalid);
    assert_eq!(
        f.message,
        "network_rules: edge e1 has no sandbox networking (its edges[].network.enabled is \
         false), so its sandboxes have only a loopback interface; leave network_rules empty"
    );
    let sb = off
        .update_network(&oid, rules(&[("*", false)]), false)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert_eq!(rules_of(&sb), rules(&[("*", false)]));
    let sb = off
        .update_network(&oid, HashMap::new(), true)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    assert!(rules_of(&sb).is_empty());
}

/// The new rules are in the sandbox's record on disk: a restarted edge shows them and
/// adopts the sandbox with them (a container's chains are written from them again).
#[tokio::test]
async fn updated_network_rules_survive_an_edge_restart() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let store = Store::open(dir.path(), "e1").unwrap_or_else(|e| panic!("{e}"));
    let c = core(
        Arc::new(TestBackend::default()),
        networked(),
        Some(store.clone()),
        Arc::new(Sink::default()),
    );
    let id = create_with_rules(&c, "n", &[("pypi", true)]).await;
    // Through the gRPC handler, as the apiserver calls it.
    {
        use pb::edge_server::Edge;
        let svc = service(&c);
        let sb = svc
            .update_network(tonic::Request::new(pb::UpdateNetworkRequest {
                id: id.clone(),
                rules: rules(&[("192.0.2.10", true)]),
                replace: true,
            }))
            .await
            .unwrap_or_else(|s| panic!("{s}"))
            .into_inner();
        assert_eq!(rules_of(&sb), rules(&[("192.0.2.10", true)]));
    }
    drop(c);

    let backend = Arc::new(TestBackend::default());
    let c2 = core(
        backend.clone(),
        networked(),
        Some(store),
        Arc::new(Sink::default()),
    );
    let report = c2.recover().await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.adopted, 1, "{report:?}");
    assert_eq!(
        rules_of(&c2.get_sandbox(&id).unwrap_or_else(|f| panic!("{f}"))),
        rules(&[("192.0.2.10", true)])
    );
    assert_eq!(
        *lock(&backend.adopted_rules),
        vec![(id, rules(&[("192.0.2.10", true)]))]
    );
}

/// `SnapshotSandbox` refusals: a directory name that is a path `invalid`, an unknown sandbox `not_found`, a backend without memory snapshots
/// `invalid` saying memory=True is for microVMs, a stopped sandbox `conflict`; none
/// leaves anything under `snapshots/`.
#[tokio::test]
async fn snapshot_refusals_name_the_reason_and_write_nothing() {
    let backend = Arc::new(TestBackend::default());
    let mut c = core(
        backend,
        EdgeConfig::default(),
        None,
        Arc::new(Sink::default()),
    );
    let req = |id: &str, dir: &str| pb::EdgeSnapshotRequest {
        id: id.into(),
        dir: dir.into(),
    };
    let reason = |r: Result<pb::EdgeSnapshotResponse, Failure>| match r {
        Ok(ok) => panic!("taken: {ok:?}"),
        Err(f) => (f.reason, f.message),
    };
    let store = tempfile::tempdir().expect("tempdir");
    std::fs::create_dir_all(store.path().join("snapshots")).expect("snapshots/");
    Arc::get_mut(&mut c)
        .expect("the only reference")
        .image_store = Some(store.path().to_path_buf());
    let id = create_one(&c, "a").await;
    for dir in ["../layers", "", "a/b", "UPPER"] {
        let (r, m) = reason(c.snapshot(req(&id, dir)).await);
        assert_eq!(r, Reason::Invalid, "{dir:?}: {m}");
    }
    let (r, _) = reason(c.snapshot(req("e1.nope", "1-a")).await);
    assert_eq!(r, Reason::NotFound);
    let (r, m) = reason(c.snapshot(req(&id, "1-a")).await);
    assert_eq!(r, Reason::Invalid);
    assert!(m.contains("memory=True is for microVMs"), "{m}");
    c.lifecycle(&id, Op::Stop, Cause::Caller)
        .await
        .unwrap_or_else(|f| panic!("{f}"));
    let (r, _) = reason(c.snapshot(req(&id, "1-a")).await);
    assert_eq!(r, Reason::Conflict);
    let left: Vec<_> = std::fs::read_dir(store.path().join("snapshots"))
        .expect("snapshots/")
        .collect();
    assert!(left.is_empty(), "{left:?}");
}
