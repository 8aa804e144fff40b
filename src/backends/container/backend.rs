//! `ContainerBackend`: the `Backend` of runtime `linux` (docs/architecture.md). Each sandbox is a
//! pid namespace whose PID 1 is aether, built by the setup process (init.rs) in its own
//! cgroup, on an overlay root whose writable layer is a per-sandbox ext4 image on a loop
//! device. The backend's state per sandbox is aether's host pid (with its start time, so a
//! reused pid is never taken for it) and the paths it needs; everything else is found again
//! by the sandbox id, which is how an edge restart re-adopts running sandboxes.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tonic::transport::Channel;

use super::agent::{self, SetupExe};
use super::cgroup::DEFAULT_PIDS_MAX;
use super::cgroup::{CgroupError, Cgroups, DiskIo, Limits, SandboxCgroup};
use super::disk::Disks;
use super::diskpool::{DiskPool, PreparedDisk};
use super::resolve::{Images, Resolved};
use super::setup::{
    self, PreparedDiskRef, SetupResult, SetupSpec, AGENT_PATH, LISTEN_FD, RUN_DIR, WORKLOAD_FD,
};
use crate::backends::{
    Adopted, Backend, BackendContext, BackendError, BackendState, CleanupReport, CreateRequest,
    Handle, Health, Packer, Recorded, Runtime,
};
use crate::config::BackendConfig;
use crate::guest::config::AetherConfig;
use crate::netpol::network::Network;
use crate::netpol::Policy;
use crate::pb;

/// How long a new sandbox's aether has to answer its first `Watch`.
const AGENT_START_TIMEOUT: Duration = Duration::from_secs(15);
/// The least memory a container sandbox is created with (docs/containers.md "Minimums").
/// The sandbox's cgroup is charged for its agents' anonymous memory (aether and chronus
/// about 0.7 MB each, a session's bash about 0.9 MB) and for every file page it faults in
/// first: when the agent binary and the image's programs are not yet in the host's page
/// cache, aether, one session and `python3 -c 'import json, os, subprocess'` peak at about
/// 35 MB without a limit (about 8 MB when the cache is warm). Measured with cold pages on
/// cgroup v1 (three tries each): at 2-6 MB aether never answers; at 8 MB the kernel
/// OOM-kills the agents and sessions hang; at 12 MB python is OOM-killed; from 16 MB all
/// of it works, at 16-20 MB by evicting its own pages (creation 2-3 times slower). 32 MB
/// is twice the least that worked.
pub const MIN_MEMORY_MB: i64 = 32;
/// The least CPU: the CFS quota cannot be set below 1 ms per 100 ms period (a sandbox of
/// 0.01 cores starts in about 1 s and answers commands).
pub const MIN_CPU_CORES: f64 = 0.01;
/// The least disk. An image of 2 MB already starts (the writable layer holds only what the
/// sandbox writes); 16 MB leaves room for ext4's own metadata and a session's first files.
pub const MIN_DISK_MB: i64 = 16;

/// What the edge records for one container sandbox.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ContainerState {
    /// aether's pid in the host's pid namespace.
    pub pid: u32,
    /// Its start time (clock ticks since boot, /proc/<pid>/stat field 22).
    pub start_time: u64,
    /// aether's unix socket on the host.
    pub socket: PathBuf,
    /// The writable layer's loop device, `major:minor`.
    pub loop_device: String,
    /// The store layers (hex) it stacks, kept in the node's cache while it runs.
    pub layers: Vec<String>,
    /// Its network slot (docs/network.md) when the edge has sandbox networking.
    pub net_slot: Option<u32>,
}

/// The container backend; see the module doc.
pub struct ContainerBackend {
    name: String,
    pids_max: i64,
    disk_io: Option<DiskIo>,
    core_sched: bool,
    images: Images,
    dir: PathBuf,
    cgroups: Cgroups,
    disks: Disks,
    /// Disks made ahead of their sandboxes.
    pool: Arc<DiskPool>,
    setup: SetupExe,
    agent: PathBuf,
    channels: Mutex<HashMap<String, Channel>>,
    warned_core_sched: AtomicBool,
    /// The cluster's state directory, as the host resolves it: hidden in every sandbox whose
    /// image has it in a lower layer (see [`hidden_state`]).
    state_dir: PathBuf,
    /// The edge's sandbox networking, when on.
    network: Option<Arc<Network>>,
}

/// The paths, inside a sandbox whose image has `lowers`, under which it would see the
/// cluster's state directory `state_dir` (every sandbox's disk image, the records, the
/// cluster's config and tokens): with the development image `host` (the host's `/`), that is
/// `state_dir` itself. Each is masked (an empty read-only directory) like `masked_paths`.
fn hidden_state(state_dir: &Path, lowers: &[PathBuf]) -> Vec<String> {
    let mut out: Vec<String> = lowers
        .iter()
        .filter_map(|l| {
            let l = l.canonicalize().unwrap_or_else(|_| l.clone());
            let rel = state_dir.strip_prefix(&l).ok()?;
            Some(Path::new("/").join(rel).display().to_string())
        })
        .collect();
    out.sort();
    out.dedup();
    out
}

/// What a sandbox of the development image `host` (a lower that is the host's `/`) must
/// not see of the host: its password hashes, and its temporary directories, where other
/// clusters' state and tokens (the quickstart's `/tmp/opendsec`) and other users' files
/// live. The directories come up empty and writable on the sandbox's own disk.
const HOST_HIDDEN: [&str; 6] = [
    "/tmp",
    "/var/tmp",
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
];

/// The paths to hide through the upper layer for an image of `lowers` (see [`HOST_HIDDEN`]).
fn hidden_lower(lowers: &[PathBuf]) -> Vec<String> {
    let host = lowers
        .iter()
        .any(|l| l.canonicalize().unwrap_or_else(|_| l.clone()) == Path::new("/"));
    if host {
        HOST_HIDDEN.iter().map(|p| p.to_string()).collect()
    } else {
        Vec::new()
    }
}

fn cfg_err(backend: &str, message: impl std::fmt::Display) -> BackendError {
    BackendError::Config {
        backend: backend.to_string(),
        message: message.to_string(),
    }
}

/// The user a sandbox's processes run as: the creation's, else the image's, else root.
fn init_user(asked: &str, image: &str) -> String {
    [asked, image]
        .into_iter()
        .find(|u| !u.is_empty())
        .unwrap_or("root")
        .to_string()
}

/// Checks that the image of `lowers` (topmost first) knows `user`: its own /etc/passwd (the
/// topmost layer that has one) must name it; numeric uids need no entry. Errors: why not,
/// for `invalid`.
pub(crate) fn check_user(lowers: &[PathBuf], user: &str, image: &str) -> Result<(), String> {
    let root = lowers
        .iter()
        .find(|l| std::fs::symlink_metadata(l.join("etc/passwd")).is_ok_and(|m| m.is_file()))
        .cloned()
        .unwrap_or_else(|| PathBuf::from("/nonexistent"));
    crate::guest::user::resolve(user, &root)
        .map(|_| ())
        .map_err(|e| format!("init_user {user:?}: {e} (image {image:?})"))
}

fn create_err(id: &str, message: impl std::fmt::Display) -> BackendError {
    BackendError::Create {
        sandbox_id: id.to_string(),
        message: message.to_string(),
    }
}

impl ContainerBackend {
    /// Builds the backend: detects the cgroup layout, installs the agent binary (from
    /// `agent_dir/opendsec-aether` or `agent_dir/opendsec` if present, else this executable)
    /// and makes the sealed setup copy of the same file. Errors: `Config` with the step that failed.
    pub fn new(
        name: &str,
        cfg: &BackendConfig,
        ctx: &BackendContext,
    ) -> Result<ContainerBackend, BackendError> {
        if !nix::unistd::geteuid().is_root() {
            return Err(cfg_err(name, "runtime \"linux\" needs root"));
        }
        let disk_io = parse_disk_io(&cfg.disk_io).map_err(|m| cfg_err(name, m))?;
        let cgroups =
            Cgroups::detect(&format!("opendsec/{}", ctx.edge_id)).map_err(|e| cfg_err(name, e))?;
        // Per edge, so that edges sharing a state_dir never clean up each other's sandboxes.
        let base = ctx.state_dir.join(&ctx.edge_id);
        let dir = base.join("containers");
        std::fs::create_dir_all(&dir).map_err(|e| {
            cfg_err(
                name,
                format!("{}: {e}", dir.display(), e = crate::types::chain(&e)),
            )
        })?;
        let disks = Disks::new(base.join("disks"));
        let depth = cfg.prepared_disks.unwrap_or(2).clamp(0, 64) as usize;
        let pool = DiskPool::new(disks.clone(), depth);
        pool.fill(cfg.default_disk_mb().max(1) as u64);
        // The agent and the setup program are this same executable; `agent_dir` may hold
        // another build of it (tests run the backend inside a test harness).
        let src = ["opendsec-aether", "opendsec"]
            .iter()
            .map(|n| ctx.agent_dir.join(n))
            .find(|p| p.is_file())
            .unwrap_or_else(|| PathBuf::from("/proc/self/exe"));
        let agent = agent::install(&src, &ctx.state_dir).map_err(|e| cfg_err(name, e))?;
        let setup = SetupExe::new(&src).map_err(|e| cfg_err(name, e))?;
        let mut images = BTreeMap::new();
        for (img, lowers) in &ctx.images {
            let mut ls = Vec::new();
            for l in lowers {
                setup::check_lower(l).map_err(|m| cfg_err(name, format!("image {img}: {m}")))?;
                ls.push(l.clone());
            }
            images.insert(img.clone(), ls);
        }
        let cache = cfg.layer_cache.unwrap_or(true).then(|| base.join("layers"));
        let images = Images::new(
            name,
            &ctx.edge_id,
            images,
            ctx.image_store.as_deref(),
            cache,
        )?;
        Ok(ContainerBackend {
            name: name.to_string(),
            pids_max: if cfg.pids_max > 0 {
                cfg.pids_max
            } else {
                DEFAULT_PIDS_MAX
            },
            disk_io,
            core_sched: cfg.core_sched.unwrap_or(true),
            images,
            dir,
            cgroups,
            disks,
            pool,
            setup,
            agent,
            channels: Mutex::new(HashMap::new()),
            warned_core_sched: AtomicBool::new(false),
            state_dir: ctx
                .state_dir
                .canonicalize()
                .unwrap_or_else(|_| ctx.state_dir.clone()),
            network: ctx.network.clone(),
        })
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    fn channels(&self) -> std::sync::MutexGuard<'_, HashMap<String, Channel>> {
        match self.channels.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    fn setup_spec(
        &self,
        req: &CreateRequest,
        image: Resolved,
        cg: &SandboxCgroup,
        limits: &Limits,
    ) -> SetupSpec {
        let lowers = image.lowers;
        let id = &req.sandbox_id;
        let host = id.rsplit('.').next().unwrap_or(id);
        let hostname: String = host
            .chars()
            .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
            .take(63)
            .collect();
        let cgroup = cg.setup_steps(limits);
        let split = cgroup.workload.len();
        let fds = |from: usize| -> Vec<i32> {
            (from..from + split)
                .filter_map(|i| i32::try_from(i).ok())
                .map(|i| WORKLOAD_FD + i)
                .collect()
        };
        let workload_fds = fds(0);
        let workload_dir_fds = fds(split);
        let hidden_lower = hidden_lower(&lowers);
        // A state directory below a hidden one is not there to mask.
        let hidden: Vec<String> = hidden_state(&self.state_dir, &lowers)
            .into_iter()
            .filter(|p| {
                !hidden_lower
                    .iter()
                    .any(|h| Path::new(p).starts_with(Path::new(h)))
            })
            .collect();
        SetupSpec {
            sandbox_id: id.clone(),
            dir: self.sandbox_dir(id),
            disk_image: self.disks.path(id),
            prepared_disk: None,
            lowers,
            cgroup,
            cgroup_mounts: cg.mounts(),
            agent: self.agent.clone(),
            hostname: if hostname.is_empty() {
                "sandbox".into()
            } else {
                hostname
            },
            readonly_paths: req.spec.readonly_paths.clone(),
            masked_paths: req
                .spec
                .masked_paths
                .iter()
                .cloned()
                .chain(hidden)
                .collect(),
            hidden_lower,
            core_sched: self.core_sched,
            resolv_conf: None,
            aether: AetherConfig {
                sandbox_id: id.clone(),
                listen_fd: Some(LISTEN_FD),
                socket: String::new(),
                run_dir: RUN_DIR.into(),
                agent: AGENT_PATH.into(),
                init_user: init_user(&req.spec.init_user, &image.user),
                env: image.env,
                workdir: image.workdir,
                pid1: true,
                protect_from_oom: true,
                disk_mb: req.spec.disk_mb.max(1) as u64,
                cgroup_dir: crate::guest::chronus::oom::CGROUP_ROOT.into(),
                workload_cgroup_fds: workload_fds,
                workload_cgroup_dir_fds: workload_dir_fds,
                session_memory_max: super::cgroup::session_memory_mb(limits.memory_mb)
                    .saturating_mul(1 << 20),
                command_cgroup_dir_fd: None,
                session_pids_max: super::cgroup::session_pids_max(limits.pids_max),
                session_oom_fd: None,
            },
        }
    }

    async fn run_setup(&self, spec: &SetupSpec) -> Result<SetupResult, String> {
        let input = serde_json::to_vec(spec).map_err(|e| crate::types::chain(&e))?;
        let mut cmd = tokio::process::Command::new(self.setup.path());
        cmd.arg0("opendsec")
            .arg("sandbox-init")
            .env_clear()
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .kill_on_drop(true);
        // A spawn is a vfork: the calling thread waits until the child has exec'd, which
        // under a burst of creations (a loaded CPU) takes milliseconds. On a blocking
        // thread, the runtime's workers go on meanwhile.
        let mut child = tokio::task::spawn_blocking(move || cmd.spawn())
            .await
            .map_err(|e| {
                format!(
                    "starting the setup process: {e}",
                    e = crate::types::chain(&e)
                )
            })?
            .map_err(|e| {
                format!(
                    "starting the setup process: {e}",
                    e = crate::types::chain(&e)
                )
            })?;
        if let Some(mut stdin) = child.stdin.take() {
            stdin
                .write_all(&input)
                .await
                .map_err(|e| format!("writing the setup spec: {e}", e = crate::types::chain(&e)))?;
        }
        let mut out = String::new();
        if let Some(stdout) = child.stdout.take() {
            // The result is one line. Its end, not the pipe's: the pipe closes only once the
            // sandbox's PID 1 has handed its copy to /dev/null on its way to exec aether.
            let mut stdout = tokio::io::BufReader::new(stdout);
            let read = tokio::time::timeout(AGENT_START_TIMEOUT, stdout.read_line(&mut out));
            read.await
                .map_err(|_| "the setup process did not answer".to_string())?
                .map_err(|e| {
                    format!("reading the setup result: {e}", e = crate::types::chain(&e))
                })?;
        }
        let _ = child.wait().await;
        let res: SetupResult = serde_json::from_str(out.trim()).map_err(|e| {
            format!(
                "bad setup result {:?}: {e}",
                crate::types::names::shown(&out),
                e = crate::types::chain(&e)
            )
        })?;
        if !res.error.is_empty() || res.pid == 0 {
            return Err(res.error);
        }
        Ok(res)
    }

    /// Removes everything of sandbox `id`: its processes, cgroup, loop device, disk and
    /// directory. Missing pieces are fine. Every step is tried even after one fails, but a
    /// sandbox whose processes would not die keeps its directory, so that the edge's cleanup
    /// at its next start still finds it; and it is tried again in the background
    /// ([`destroy_later`]). The error lists every failed step.
    /// `loop_device` (`major:minor`), when known, is the only loop device looked at;
    /// `net_slot`, when set, is the network slot whose veth and rules go (first, so that a
    /// sandbox whose processes will not die is at least cut off).
    async fn destroy(
        &self,
        id: &str,
        loop_device: Option<String>,
        net_slot: Option<u32>,
    ) -> Result<(), BackendError> {
        self.channels().remove(id);
        self.images.release(id).await;
        let net_failed = super::super::netslot::release(self.network.as_ref(), net_slot).await;
        let steps = DestroySteps {
            cg: self.cgroups.open(id),
            disk: self.disks.path(id),
            dir: self.sandbox_dir(id),
            disks: self.disks.clone(),
            id: id.to_string(),
            loop_device,
        };
        let (mut failed, steps) = tokio::task::spawn_blocking(move || (steps.run(), steps))
            .await
            .map_err(|e| BackendError::Operation {
                op: "stop",
                sandbox_id: id.to_string(),
                message: e.to_string(),
            })?;
        failed.extend(net_failed);
        if failed.is_empty() {
            return Ok(());
        }
        if steps.cg.exists() {
            destroy_later(steps);
        }
        Err(BackendError::Operation {
            op: "stop",
            sandbox_id: id.to_string(),
            message: failed.join("; "),
        })
    }

    fn state_of(h: &Handle<'_>) -> ContainerState {
        serde_json::from_value(h.state.clone()).unwrap_or_default()
    }
}

/// When a stop could not end a sandbox's processes, how long to wait before each new try.
const DESTROY_RETRIES: [Duration; 5] = [
    Duration::from_secs(2),
    Duration::from_secs(10),
    Duration::from_secs(30),
    Duration::from_secs(60),
    Duration::from_secs(300),
];

/// Tries `steps` again in the background, a few times with growing pauses, until the
/// sandbox is gone: its record already says the stop failed, but its processes must not
/// run on unnoticed.
fn destroy_later(steps: DestroySteps) {
    tokio::spawn(async move {
        let mut steps = steps;
        for pause in DESTROY_RETRIES {
            tokio::time::sleep(pause).await;
            let Ok((failed, back)) =
                tokio::task::spawn_blocking(move || (steps.run(), steps)).await
            else {
                return;
            };
            steps = back;
            if failed.is_empty() {
                tracing::info!(sandbox_id = %steps.id, "a failed stop was finished");
                return;
            }
            tracing::warn!(sandbox_id = %steps.id, error = %failed.join("; "), "a failed stop was tried again and failed");
        }
    });
}

/// The blocking steps of [`ContainerBackend::destroy`].
struct DestroySteps {
    cg: SandboxCgroup,
    disk: PathBuf,
    dir: PathBuf,
    disks: Disks,
    id: String,
    loop_device: Option<String>,
}

impl DestroySteps {
    /// Runs every step; returns what failed, in order.
    fn run(&self) -> Vec<String> {
        destroy_steps(
            &self.cg,
            &self.disk,
            self.loop_device.as_deref(),
            &self.disks,
            &self.id,
            &self.dir,
        )
    }
}

/// The steps of [`DestroySteps::run`]: a sandbox whose processes would not die keeps its
/// directory (cleanup at the edge's start knows a sandbox by it).
fn destroy_steps(
    cg: &SandboxCgroup,
    disk: &Path,
    loop_device: Option<&str>,
    disks: &Disks,
    id: &str,
    dir: &Path,
) -> Vec<String> {
    let mut failed = Vec::new();
    let mut alive = false;
    if cg.exists() {
        match cg.kill_all() {
            // remove() would only try the same kill again.
            Err(e) => {
                alive = true;
                failed.push(e.to_string())
            }
            Ok(()) => {
                if let Err(e) = cg.remove() {
                    failed.push(e.to_string());
                }
            }
        }
    }
    if alive {
        return failed;
    }
    // The sandbox's mount namespace held the only mount of the loop device; with
    // autoclear the kernel detaches it shortly after the last process is gone.
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        // Its own device alone when the record names it: reading every loop device of the
        // host made a stop O(loop devices), 58 ms instead of 35 with 6,785 of them.
        let attached = match loop_device.filter(|d| !d.is_empty()) {
            Some(d) => crate::sys::loopdev::attached_as(d, disk)
                .into_iter()
                .collect(),
            None => crate::sys::loopdev::attached(disk),
        };
        if attached.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            for (dev, _) in attached {
                if let Err(e) = crate::sys::loopdev::detach(&dev) {
                    failed.push(format!("detaching {}: {e}", dev.display()));
                }
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if let Err(e) = disks.remove(id) {
        failed.push(e.to_string());
    }
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => failed.push(format!("removing {}: {e}", dir.display())),
    }
    failed
}

/// `disk_io` from the backend config: `{"read_mbps", "write_mbps", "read_iops",
/// "write_iops"}`, 0 or absent for unlimited; `null`/`{}` for none.
fn parse_disk_io(v: &serde_json::Value) -> Result<Option<DiskIo>, String> {
    if v.is_null() {
        return Ok(None);
    }
    let obj = v.as_object().ok_or("disk_io must be an object")?;
    let mut io = DiskIo {
        read_mbps: 0,
        write_mbps: 0,
        read_iops: 0,
        write_iops: 0,
    };
    for (k, val) in obj {
        let n = val
            .as_i64()
            .filter(|n| *n >= 0)
            .ok_or_else(|| format!("disk_io.{k} must be a whole number >= 0"))?;
        match k.as_str() {
            "read_mbps" => io.read_mbps = n,
            "write_mbps" => io.write_mbps = n,
            "read_iops" => io.read_iops = n,
            "write_iops" => io.write_iops = n,
            other => return Err(format!("unknown disk_io field {other:?}")),
        }
    }
    if io.read_mbps + io.write_mbps + io.read_iops + io.write_iops == 0 {
        return Ok(None);
    }
    Ok(Some(io))
}

/// A process's start time (clock ticks since boot), or `None` when it is gone or a zombie.
/// The start time of process `pid` (field 22 of `/proc/<pid>/stat`): `Ok(None)` when no
/// such process runs (gone, or a zombie). Errors: /proc could not be read for another reason
/// (too many open files, say): then nobody can tell.
pub fn start_time(pid: u32) -> std::io::Result<Option<u64>> {
    let stat = match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(s) => s,
        Err(e)
            if e.kind() == std::io::ErrorKind::NotFound
                || e.raw_os_error() == Some(libc::ESRCH) =>
        {
            return Ok(None)
        }
        Err(e) => return Err(e),
    };
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return Ok(None);
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is the state (field 3); the start time is field 22.
    if fields.first() == Some(&"Z") {
        return Ok(None);
    }
    Ok(fields.get(19).and_then(|f| f.parse().ok()))
}

/// Whether the sandbox's aether still runs. When /proc cannot be read (the edge is out of
/// file descriptors, say) it counts as running: a sandbox is declared lost only on
/// evidence, never because the edge could not look (docs/containers.md "Stopping and cleaning up").
fn alive(st: &ContainerState) -> bool {
    st.pid > 0 && judged_alive(st.pid, start_time(st.pid), st.start_time)
}

/// The sandboxes this backend has files of (a disk in `disks`, a directory in `dir`) that
/// are not in `keep`, sorted: what an edge's cleanup at start removes.
pub fn stray_ids(disks: &Disks, dir: &Path, keep: &HashSet<String>) -> Vec<String> {
    let mut ids: HashSet<String> = disks.list().into_iter().collect();
    if let Ok(rd) = std::fs::read_dir(dir) {
        ids.extend(
            rd.flatten()
                .filter_map(|e| e.file_name().into_string().ok()),
        );
    }
    let mut ids: Vec<String> = ids.into_iter().filter(|id| !keep.contains(id)).collect();
    ids.sort();
    ids
}

/// What one look at /proc says of a process recorded with `recorded` as its start time.
pub fn judged_alive(pid: u32, looked: std::io::Result<Option<u64>>, recorded: u64) -> bool {
    match looked {
        Ok(t) => t == Some(recorded),
        Err(e) => {
            tracing::warn!(pid, error = %e, "cannot read /proc to probe a sandbox; taken as alive");
            true
        }
    }
}

#[async_trait]
impl Backend for ContainerBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn runtime_kind(&self) -> &'static str {
        "linux"
    }

    fn check_spec(&self, spec: &pb::SandboxSpec) -> Result<(), BackendError> {
        let bad = |message: String| BackendError::Config {
            backend: self.name.clone(),
            message,
        };
        if spec.memory_limit_mb < MIN_MEMORY_MB {
            return Err(bad(format!(
                "memory_limit_mb {} is below this backend's minimum of {MIN_MEMORY_MB} MB (the sandbox's agents and a shell need it; docs/containers.md)",
                spec.memory_limit_mb
            )));
        }
        if spec.cpu_cores_limit < MIN_CPU_CORES {
            return Err(bad(format!(
                "cpu_cores_limit {} is below this backend's minimum of {MIN_CPU_CORES} cores",
                spec.cpu_cores_limit
            )));
        }
        if spec.disk_mb < MIN_DISK_MB {
            return Err(bad(format!(
                "disk_mb {} is below this backend's minimum of {MIN_DISK_MB} MB",
                spec.disk_mb
            )));
        }
        // The image's own /etc/passwd (the topmost layer that has one) must know init_user;
        // numeric uids need no entry. A missing image is the creation's not_found.
        if let Some(lowers) = self.images.local(&spec.image) {
            check_user(lowers, &init_user(&spec.init_user, ""), &spec.image).map_err(bad)?;
        }
        Ok(())
    }

    async fn create(&self, req: &CreateRequest) -> Result<BackendState, BackendError> {
        let id = req.sandbox_id.as_str();
        if req.snapshot.is_some() {
            return Err(BackendError::Unsupported {
                backend: self.name.clone(),
                op: "restore from a memory snapshot",
            });
        }
        let image = match &req.fork {
            Some(files) => self.images.resolve_fork(&req.spec.image, files).await?,
            None => self.images.resolve(id, &req.spec.image).await?,
        };
        if image.vm_snapshot.is_some() {
            return Err(BackendError::Invalid {
                sandbox_id: id.to_string(),
                message: format!(
                    "image {} is a microVM's memory snapshot: it runs on the microvm backend only",
                    req.spec.image
                ),
            });
        }
        if !image.layers.is_empty() {
            // A store image's users are known only now (check_spec saw no layers).
            check_user(
                &image.lowers,
                &init_user(&req.spec.init_user, &image.user),
                &req.spec.image,
            )
            .map_err(|message| BackendError::Invalid {
                sandbox_id: id.to_string(),
                message,
            })?;
        }
        for p in req.spec.readonly_paths.iter().chain(&req.spec.masked_paths) {
            setup::check_sandbox_path(p).map_err(|message| BackendError::Invalid {
                sandbox_id: id.to_string(),
                message,
            })?;
        }
        let dir = self.sandbox_dir(id);
        let sock = dir.join("aether.sock");
        if sock.as_os_str().len() > 100 {
            return Err(create_err(
                id,
                format!(
                    "socket path {} is too long for a unix socket; use a shorter state_dir",
                    sock.display()
                ),
            ));
        }
        // Its network: the policy first (a bad rule changes nothing), then a slot, which
        // the destroy below gives back if the creation fails.
        let net =
            super::super::netslot::reserve(self.network.as_deref(), &self.name, id, &req.spec)?;
        self.images.maybe_reclaim();
        let result = match self.images.mark_in_use(id, &image.layers).await {
            Ok(()) => {
                self.create_inner(req, image, &dir, &sock, net.as_ref())
                    .await
            }
            Err(e) => Err(e),
        };
        match result {
            Ok(state) => Ok(state),
            Err(e) => match self.destroy(id, None, net.map(|(slot, _)| slot)).await {
                Ok(()) => Err(e),
                Err(cleanup) => {
                    tracing::warn!(sandbox_id = id, error = %crate::types::chain(&cleanup), "cleaning up a failed creation");
                    Err(BackendError::CleanupFailed {
                        primary: Box::new(e),
                        cleanup: Box::new(cleanup),
                    })
                }
            },
        }
    }

    async fn stop(&self, sandbox: &Handle<'_>) -> Result<(), BackendError> {
        let st = Self::state_of(sandbox);
        self.destroy(sandbox.sandbox_id, Some(st.loop_device), st.net_slot)
            .await
    }

    async fn pause(&self, sandbox: &Handle<'_>) -> Result<BackendState, BackendError> {
        let cg = self.cgroups.open(sandbox.sandbox_id);
        let id = sandbox.sandbox_id.to_string();
        let step = |source: Box<dyn std::error::Error + Send + Sync>| BackendError::Step {
            op: "pause",
            sandbox_id: id.clone(),
            source,
        };
        tokio::task::spawn_blocking(move || cg.freeze())
            .await
            .map_err(|e| step(Box::new(e)))?
            .map_err(|e| step(Box::new(e)))?;
        Ok(sandbox.state.clone())
    }

    async fn resume(&self, sandbox: &Handle<'_>) -> Result<BackendState, BackendError> {
        let cg = self.cgroups.open(sandbox.sandbox_id);
        let id = sandbox.sandbox_id.to_string();
        let step = |source: Box<dyn std::error::Error + Send + Sync>| BackendError::Step {
            op: "resume",
            sandbox_id: id.clone(),
            source,
        };
        tokio::task::spawn_blocking(move || cg.thaw())
            .await
            .map_err(|e| step(Box::new(e)))?
            .map_err(|e| step(Box::new(e)))?;
        Ok(sandbox.state.clone())
    }

    async fn probe(&self, sandbox: &Handle<'_>) -> Health {
        if alive(&Self::state_of(sandbox)) {
            Health::Alive
        } else {
            Health::Lost("aether exited".into())
        }
    }

    async fn adopt(
        &self,
        sandbox: &Handle<'_>,
        _recorded: Recorded,
    ) -> Result<Adopted, BackendError> {
        let st = Self::state_of(sandbox);
        let cg = self.cgroups.open(sandbox.sandbox_id);
        if !alive(&st) || !cg.exists() {
            return Err(BackendError::Lost {
                sandbox_id: sandbox.sandbox_id.to_string(),
                message: "aether is gone".into(),
            });
        }
        self.images.hold(sandbox.sandbox_id, &st.layers);
        if let Some(slot) = st.net_slot {
            super::super::netslot::adopt(self.network.as_deref(), sandbox, slot).await?;
        }
        let marker = self.sandbox_dir(sandbox.sandbox_id).join(pack::PACKING);
        if marker.exists() {
            // The edge died while a pack held the sandbox frozen: it was not paused.
            if let Err(e) = cg.thaw() {
                tracing::warn!(sandbox_id = %sandbox.sandbox_id, error = %crate::types::chain(&e), "thawing a sandbox left frozen by a pack");
            }
            let _ = std::fs::remove_file(&marker);
        }
        Ok(Adopted {
            state: sandbox.state.clone(),
            paused: cg.frozen(),
        })
    }

    async fn update_network(&self, sandbox: &Handle<'_>) -> Result<(), BackendError> {
        let slot = Self::state_of(sandbox).net_slot;
        super::super::netslot::update(self.network.as_deref(), sandbox, slot).await
    }

    async fn cleanup(&self, keep: &HashSet<String>) -> Result<CleanupReport, BackendError> {
        // Only what this state dir holds is ours. A cgroup under the same edge id without a
        // directory or disk here belongs to another cluster that uses the same edge id (the
        // cgroup tree is machine-wide); ours never lose their directory before their cgroup.
        let ids = stray_ids(&self.disks, &self.dir, keep);
        let mut report = CleanupReport::default();
        report
            .removed
            .extend(self.images.release_strays(keep).await);
        let mut failed = Vec::new();
        for id in ids {
            // One sandbox that will not go does not keep the others.
            // Its network slot is not held; the network's own cleanup below removes it.
            match self.destroy(&id, None, None).await {
                Ok(()) => report.removed.push(format!("container {id}")),
                Err(BackendError::Operation { message, .. }) => failed.push((id, message)),
                Err(e) => failed.push((id, e.to_string())),
            }
        }
        if let Some(net) = &self.network {
            match net.cleanup().await {
                Ok(removed) => report.removed.extend(removed),
                Err(e) => failed.push(("network".into(), crate::types::chain(&e))),
            }
        }
        if !failed.is_empty() {
            let ids: Vec<&str> = failed.iter().map(|(id, _)| id.as_str()).collect();
            let messages: Vec<String> = failed.iter().map(|(id, m)| format!("{id}: {m}")).collect();
            return Err(BackendError::Operation {
                op: "cleanup",
                sandbox_id: ids.join(", "),
                message: messages.join("; "),
            });
        }
        Ok(report)
    }

    async fn release_node(&self) -> Result<(), BackendError> {
        if let Some(net) = &self.network {
            if let Err(e) = net.shutdown().await {
                tracing::warn!(error = %crate::types::chain(&e), "removing the edge's nftables table");
            }
        }
        let pool = self.pool.clone();
        let _ = tokio::task::spawn_blocking(move || pool.clear()).await;
        let cgroups = self.cgroups.clone();
        let step = "removing the edge's cgroup parent";
        match tokio::task::spawn_blocking(move || cgroups.remove_parents()).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(CgroupError::Remove { path, source })) => Err(BackendError::Io {
                step,
                path: path.display().to_string(),
                source,
            }),
            Ok(Err(e)) => Err(BackendError::Io {
                step,
                path: String::new(),
                source: std::io::Error::other(e),
            }),
            Err(e) => Err(BackendError::Io {
                step,
                path: String::new(),
                source: std::io::Error::other(e),
            }),
        }
    }

    fn runtime(&self) -> Option<&dyn Runtime> {
        Some(self)
    }

    fn packer(&self) -> Option<&dyn Packer> {
        Some(self)
    }
}

impl ContainerBackend {
    async fn create_inner(
        &self,
        req: &CreateRequest,
        image: Resolved,
        dir: &Path,
        sock: &Path,
        net: Option<&(u32, Policy)>,
    ) -> Result<BackendState, BackendError> {
        let id = req.sandbox_id.as_str();
        let spec = &req.spec;
        let limits = Limits {
            cpu_cores: spec.cpu_cores_limit,
            idle: spec.qos == "BE",
            memory_mb: spec.memory_limit_mb,
            pids_max: self.pids_max,
            disk_io: self.disk_io,
        };
        let (cgroups, disks, dir2, id2) = (
            self.cgroups.clone(),
            self.disks.clone(),
            dir.to_path_buf(),
            id.to_string(),
        );
        let disk_mb = spec.disk_mb.max(1) as u64;
        let limits2 = limits.clone();
        let pool = self.pool.clone();
        let (cg, prepared) = tokio::task::spawn_blocking(
            move || -> Result<(SandboxCgroup, Option<PreparedDisk>), String> {
                std::fs::create_dir_all(&dir2)
                    .map_err(|e| format!("{}: {e}", dir2.display(), e = crate::types::chain(&e)))?;
                let prepared = pool.take(&id2, disk_mb);
                if prepared.is_none() {
                    disks
                        .create(&id2, disk_mb)
                        .map_err(|e| crate::types::chain(&e))?;
                }
                let cg = cgroups
                    .create(&id2, &limits2)
                    .map_err(|e| crate::types::chain(&e))?;
                Ok((cg, prepared))
            },
        )
        .await
        .map_err(|e| create_err(id, e))?
        .map_err(|e| create_err(id, e))?;
        let layers = image.layers.clone();
        let mut setup_spec = self.setup_spec(req, image, &cg, &limits);
        if let (Some(network), Some((slot, _))) = (&self.network, net) {
            setup_spec.resolv_conf =
                Some(network.resolv_conf(*slot).map_err(|e| create_err(id, e))?);
        }
        setup_spec.prepared_disk = prepared.as_ref().map(|p| PreparedDiskRef {
            edge_pid: std::process::id(),
            mount_fd: p.mount_fd(),
            device: p.device_number(),
        });
        let res = self.run_setup(&setup_spec).await;
        // The sandbox's mount holds the prepared disk now (or it failed and the disk goes).
        drop(prepared);
        let res = res.map_err(|e| create_err(id, e))?;
        if let (Some(io), Some((maj, min))) = (&self.disk_io, res.loop_device.split_once(':')) {
            if let (Ok(maj), Ok(min)) = (maj.parse(), min.parse()) {
                cg.set_disk_io(maj, min, io)
                    .map_err(|e| create_err(id, e))?;
            }
        }
        if self.core_sched
            && !res.core_sched
            && !self.warned_core_sched.swap(true, Ordering::Relaxed)
        {
            tracing::info!("this kernel has no core scheduling; sandboxes run without a core-scheduling cookie");
        }
        // The sandbox's network and aether's start are independent: the veth, addresses and
        // rules are written while aether comes up, and both are done before the caller gets
        // the sandbox (docs/network.md "Creation").
        let attach = async {
            let (Some(network), Some((slot, policy))) = (&self.network, net) else {
                return Ok(());
            };
            // aether is its netns's first process and is alive: the path is its netns.
            let path = format!("/proc/{}/ns/net", res.pid);
            let ns = std::fs::File::open(&path).map_err(|e| {
                create_err(
                    id,
                    format!("opening {path}: {e}", e = crate::types::chain(&e)),
                )
            })?;
            network
                .attach(std::os::fd::AsFd::as_fd(&ns), *slot, policy)
                .await
                .map(|_| ())
                .map_err(|e| {
                    create_err(
                        id,
                        format!("connecting its network: {}", crate::types::chain(&e)),
                    )
                })
        };
        let st = ContainerState {
            net_slot: net.map(|(slot, _)| *slot),
            pid: res.pid,
            start_time: start_time(res.pid)
                .map_err(|e| create_err(id, format!("reading aether's start time: {e}")))?
                .ok_or_else(|| create_err(id, "aether exited at start"))?,
            socket: sock.to_path_buf(),
            loop_device: res.loop_device.clone(),
            layers: layers.iter().map(|d| d.hex().to_string()).collect(),
        };
        let ch = crate::rpc::uds::uds_channel(sock.to_path_buf());
        let mut client = pb::runtime_client::RuntimeClient::new(ch.clone());
        let first = tokio::time::timeout(AGENT_START_TIMEOUT, async {
            let mut s = client.watch(pb::Empty {}).await?.into_inner();
            s.message().await
        });
        let (attached, first) = tokio::join!(attach, first);
        attached?;
        match first {
            Ok(Ok(Some(_))) => {}
            Ok(Ok(None)) => return Err(create_err(id, "aether closed its Watch stream at start")),
            Ok(Err(e)) => {
                return Err(create_err(
                    id,
                    format!("aether did not start: {}", e.message()),
                ))
            }
            Err(_) => return Err(create_err(id, "aether did not answer in time")),
        }
        self.channels().insert(id.to_string(), ch);
        serde_json::to_value(&st).map_err(|e| create_err(id, e))
    }
}

#[async_trait]
impl Runtime for ContainerBackend {
    async fn channel(&self, sandbox: &Handle<'_>) -> Result<Channel, BackendError> {
        if let Some(ch) = self.channels().get(sandbox.sandbox_id) {
            return Ok(ch.clone());
        }
        let st = Self::state_of(sandbox);
        if !alive(&st) {
            return Err(BackendError::Lost {
                sandbox_id: sandbox.sandbox_id.to_string(),
                message: "aether is gone".into(),
            });
        }
        let ch = crate::rpc::uds::uds_channel(st.socket.clone());
        self.channels()
            .insert(sandbox.sandbox_id.to_string(), ch.clone());
        Ok(ch)
    }
}

mod pack;

#[cfg(test)]
mod tests {
    #[test]
    fn a_sandbox_is_lost_only_on_evidence() {
        use super::judged_alive;
        assert!(judged_alive(7, Ok(Some(42)), 42));
        // Gone, a zombie, or another process with the pid: lost.
        assert!(!judged_alive(7, Ok(None), 42));
        assert!(!judged_alive(7, Ok(Some(43)), 42));
        // The edge out of file descriptors cannot look: not lost.
        let emfile = std::io::Error::from_raw_os_error(libc::EMFILE);
        assert!(judged_alive(7, Err(emfile), 42));
        // This very process, read for real.
        let me = std::process::id();
        let t = super::start_time(me).unwrap().unwrap();
        assert!(judged_alive(me, super::start_time(me), t));
        assert_eq!(super::start_time(u32::MAX >> 1).unwrap(), None);
    }

    use super::*;
    use crate::backends::container::cgroup::tests::{fake_v2, limits};
    use crate::backends::container::cgroup::{CgroupVersion, Cgroups};

    #[test]
    fn the_state_directory_is_hidden_where_a_lower_layer_holds_it() {
        let st = Path::new("/var/lib/opendsec");
        assert_eq!(
            hidden_state(st, &[PathBuf::from("/")]),
            vec!["/var/lib/opendsec"]
        );
        assert_eq!(
            hidden_state(
                st,
                &[PathBuf::from("/nonexistent-x"), PathBuf::from("/var")]
            ),
            vec!["/lib/opendsec"]
        );
        assert!(hidden_state(st, &[PathBuf::from("/srv/images/debian")]).is_empty());
    }

    /// A stop that cannot end the processes leaves the directory and disk for the next try
    /// (and the edge's cleanup at start, which knows a sandbox by them).
    #[test]
    fn a_sandbox_whose_processes_survive_the_kill_keeps_its_directory_and_disk() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let root = tmp.path().join("cg");
        let sb = fake_v2(&root, "e1.a");
        let cg = Cgroups::at(&root, CgroupVersion::V2, "opendsec/e1")
            .create("e1.a", &limits())
            .expect("create");
        // This test's own process: the fake's cgroup.kill kills nothing, so it "survives".
        std::fs::write(sb.join("cgroup.procs"), format!("{}\n", std::process::id()))
            .expect("procs");
        let disks = Disks::new(tmp.path().join("disks"));
        let disk = disks.path("e1.a");
        std::fs::create_dir_all(disk.parent().expect("parent")).expect("disks dir");
        std::fs::write(&disk, b"image").expect("disk");
        let dir = tmp.path().join("sandboxes/e1.a");
        std::fs::create_dir_all(&dir).expect("dir");
        let failed = destroy_steps(&cg, &disk, None, &disks, "e1.a", &dir);
        assert_eq!(failed.len(), 1, "{failed:?}");
        assert!(failed[0].contains("SIGKILL"), "{failed:?}");
        assert!(
            dir.exists(),
            "the directory went with processes still running"
        );
        assert!(disk.exists(), "the disk went with processes still running");
    }
}
