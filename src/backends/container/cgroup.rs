//! Per-sandbox cgroups, by files, on cgroup v2 and on v1 (or a hybrid of both).
//!
//! Production hosts are pure v2 (one hierarchy at /sys/fs/cgroup); the build machines are
//! v1-hybrid (each controller on its own v1 hierarchy, an empty cgroup2 beside them). So the
//! layout is detected per controller from /proc/self/mountinfo and the v2 root's
//! `cgroup.controllers`: each controller is used on whichever hierarchy holds it, and a
//! sandbox's cgroup is one directory `<parent>/<sandbox_id>` in every hierarchy used.
//!
//! Limits (docs/configuration.md `pids_max`, `disk_io`): CPU quota, `cpu.idle` for
//! best-effort sandboxes, memory without swap, a process count, disk I/O throttles on the
//! sandbox's loop device; the freezer pauses a sandbox.
//!
//! Inside the sandbox's cgroup, on cgroup v2 and on the v1 hierarchies of `cpu` and `pids`,
//! two children split the agents from what they run (docs/architecture.md "Cgroups"):
//! `agent/` holds aether and every chronus, with a high CPU weight and a small pids reserve
//! of its own; `workload/` holds what they run, with the sandbox's `pids_max`: below it,
//! `procs/` for the processes of the process API and one `s<N>/` per session (its shell and
//! commands), which aether makes when the session starts, each allowed a little less than
//! `pids_max`. A fork bomb then fills its own session's cgroup only: the agents still fork
//! (a new session's chronus) and still get the CPU they need, and the other sessions keep
//! a margin to fork their commands in. Memory, I/O
//! and the freezer stay whole-sandbox limits (the sandbox cgroup itself); on v1 the other
//! hierarchies are not split at all (v1 blkio throttles are not hierarchical).

use std::collections::BTreeSet;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

mod layout;
mod lifecycle;
mod limits;

use layout::{
    parent_path, parse_mountinfo, place, valid_component, CgroupMount, Ctl, Hierarchy, Placement,
};

/// Which cgroup interface the sandboxes' memory limits are on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

/// The limits of one sandbox. Zero or negative means unlimited for each number.
#[derive(Debug, Clone, PartialEq)]
pub struct Limits {
    /// CPU time as a number of cores (0.5 = half a core), enforced by CFS quota.
    pub cpu_cores: f64,
    /// Best-effort: the sandbox runs only on otherwise idle CPU (`cpu.idle`; v1 `cpu.shares`=2).
    pub idle: bool,
    /// Memory limit in MiB; swap is not allowed on top of it.
    pub memory_mb: i64,
    /// Most processes (and threads) at once (`pids_max`, default 4096).
    pub pids_max: i64,
    /// Disk I/O throttles. Needs the device, so it is applied by
    /// [`SandboxCgroup::set_disk_io`] once the sandbox's loop device is known; `create` only
    /// makes sure the io controller is enabled.
    pub disk_io: Option<DiskIo>,
}

/// Disk I/O throttles on one device; 0 means unlimited. MB are MiB (2^20 bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DiskIo {
    pub read_mbps: i64,
    pub write_mbps: i64,
    pub read_iops: i64,
    pub write_iops: i64,
}

/// A failed cgroup step, with the file or directory it failed on.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// The cgroup layout could not be read (/proc/self/mountinfo, `cgroup.controllers`).
    #[error("detecting cgroups from {path}")]
    Detect { path: PathBuf, source: io::Error },
    /// A controller the backend cannot do without is on no hierarchy.
    #[error("no mounted cgroup hierarchy holds the {controller} controller")]
    NoController { controller: &'static str },
    /// The parent path or a sandbox id is not usable as a cgroup path.
    #[error("{what} {value:?} is not a usable cgroup name")]
    InvalidName { what: &'static str, value: String },
    /// Making a cgroup directory failed.
    #[error("creating cgroup {path}")]
    Mkdir { path: PathBuf, source: io::Error },
    /// Writing a control file failed (a limit, a controller, a freeze).
    #[error("writing {value:?} to {path}")]
    Write {
        path: PathBuf,
        value: String,
        source: io::Error,
    },
    /// Reading a control file failed.
    #[error("reading {path}")]
    Read { path: PathBuf, source: io::Error },
    /// Moving a process into the cgroup failed.
    #[error("moving pid {pid} into {path}")]
    Join {
        pid: u32,
        path: PathBuf,
        source: io::Error,
    },
    /// The sandbox has no freezer (no freezer hierarchy and no cgroup v2).
    #[error("cgroup {path} has no freezer")]
    NoFreezer { path: PathBuf },
    /// The kernel did not report the cgroup frozen in time; it was thawed again.
    #[error("cgroup {path} not frozen after {waited_ms} ms")]
    FreezeTimeout { path: PathBuf, waited_ms: u64 },
    /// Sending SIGKILL to a member failed for another reason than it being gone.
    #[error("killing pid {pid} of {path}")]
    Signal {
        pid: u32,
        path: PathBuf,
        source: nix::errno::Errno,
    },
    /// Processes were still in the cgroup after the kill deadline. `states` shows some of
    /// them as `pid:state:flags:pending` (from /proc), for whoever looks into why.
    #[error("cgroup {path} still has {left} processes after {waited_ms} ms of SIGKILL ({states})")]
    KillTimeout {
        path: PathBuf,
        left: usize,
        waited_ms: u64,
        states: String,
    },
    /// Removing a cgroup directory failed.
    #[error("removing cgroup {path}")]
    Remove { path: PathBuf, source: io::Error },
}

/// How far below the sandbox's memory limit (MiB) its workload is held, so that the agents
/// can still allocate while the workload is at its own limit (a fork bomb filling the
/// memory: the kernel reclaims and OOM-kills in the workload, and an agent that had to
/// reclaim too never answered): an eighth of the limit, at least 8 and at most 32 MiB.
pub fn agent_memory_reserve_mb(memory_mb: i64) -> i64 {
    (memory_mb / 8).clamp(8, 32)
}

/// The workload's memory limit (MiB) in a sandbox of `memory_mb` (0: none): the sandbox's
/// less [`agent_memory_reserve_mb`], and never under half of it.
pub fn workload_memory_mb(memory_mb: i64) -> i64 {
    if memory_mb <= 0 {
        return 0;
    }
    memory_mb
        .saturating_sub(agent_memory_reserve_mb(memory_mb))
        .max(memory_mb / 2)
}

/// The memory limit (MiB) of each session's own cgroup in a sandbox of `memory_mb` (0:
/// none): the workload's less an eighth of it (at least 8 MiB), so that a session that fills
/// its memory (a fork bomb) is OOM-killed within itself and leaves the other sessions room
/// to start their commands, as its `pids.max` leaves them processes.
pub fn session_memory_mb(memory_mb: i64) -> i64 {
    let w = workload_memory_mb(memory_mb);
    if w <= 0 {
        return 0;
    }
    w.saturating_sub((w / 8).max(8)).max(w / 2)
}

/// The default `pids_max` of a backend (docs/containers.md; a microVM's guest applies it
/// too, docs/microvm.md "Cgroups in the guest").
pub const DEFAULT_PIDS_MAX: i64 = 4096;

/// The agents' child cgroup of a sandbox: aether and chronus.
pub const AGENT: &str = "agent";
/// The workload's child cgroup of a sandbox: session shells, commands, processes.
pub const WORKLOAD: &str = "workload";
/// The process API's cgroup below `workload/` (the sessions' `s<N>/` are its siblings).
pub const PROCS: &str = "procs";
/// The most processes of the workload that one session (or the process API) may not take:
/// whatever one of them forks, the others keep this many to fork their commands in.
pub const SESSION_PIDS_MARGIN: i64 = 64;
/// The agents' own process (and thread) limit, on top of the workload's `pids_max`: aether,
/// one chronus per session and their runtime threads.
pub const AGENT_PIDS_MAX: i64 = 512;
/// The `pids.max` of each session's cgroup (and of `procs/`) for a sandbox's `pids_max`:
/// `pids_max` less [`SESSION_PIDS_MARGIN`] (a quarter of it when that is less), never
/// below 1; 0 (unlimited) stays unlimited.
pub fn session_pids_max(pids_max: i64) -> i64 {
    if pids_max <= 0 {
        return 0;
    }
    (pids_max - SESSION_PIDS_MARGIN.min(pids_max / 4)).max(1)
}

/// The agents' CPU weight against the workload's default (v2 `cpu.weight`, 100): the most
/// the kernel takes, so the agents run whenever they are runnable.
pub const AGENT_CPU_WEIGHT: &str = "10000";
/// The same on v1 (`cpu.shares`; the default is 1024), for the same 100:1 ratio.
const AGENT_CPU_SHARES: &str = "102400";

/// What the sandbox's setup process does with its cgroups, in this order (see
/// [`SandboxCgroup::setup_steps`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SetupSteps {
    /// 1. Write "0" to each: join the sandbox's own cgroup in every hierarchy, so that the
    ///    cgroup namespace unshared next is rooted there. Each file is `tasks` on v1 and
    ///    `cgroup.procs` on v2; only a single-threaded process may write them (see
    ///    `SandboxCgroup::join_file`).
    pub join: Vec<PathBuf>,
    /// 2. Open each for writing before unsharing the cgroup namespace (a migration is
    ///    checked against the namespace and credentials of the open):
    ///    `workload/procs/tasks` (v1) or `workload/procs/cgroup.procs` (v2) of every split
    ///    hierarchy, for aether to move the process API's processes in, each from its child
    ///    between fork and exec.
    pub workload: Vec<PathBuf>,
    /// 2b. Open each as a directory at the same time: `workload/` of every split hierarchy,
    ///    in the same order, where aether makes each session's cgroup (through the fd: in
    ///    the sandbox the cgroup tree is read-only and rooted at the sandbox).
    pub workload_dirs: Vec<PathBuf>,
    /// 3. After the unshare, write "0" to each: move into `agent/` where there is one.
    pub agent: Vec<PathBuf>,
    /// 4. Then write each value to its file: v2 controllers for the children (only allowed
    ///    once the sandbox's cgroup itself holds no process) and the children's limits.
    pub writes: Vec<(PathBuf, String)>,
}

#[derive(Debug)]
struct Layout {
    parent: PathBuf,
    hierarchies: Vec<Hierarchy>,
    at: Placement,
    /// The v2 controllers to enable in the ancestors' `cgroup.subtree_control`.
    v2_enable: Vec<&'static str>,
    /// Set once the ancestors have them, so later creates skip reading six files.
    v2_enabled: AtomicBool,
}

/// The detected cgroup layout and the parent under which sandboxes get their cgroups.
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct Cgroups {
    layout: Arc<Layout>,
}

impl Cgroups {
    /// Detects the layout of this host's cgroups and places sandboxes under `parent`
    /// (`opendsec/<edge_id>`), relative to each hierarchy's root. Errors: `Detect` when
    /// /proc/self/mountinfo cannot be read, `NoController` without a memory controller,
    /// `InvalidName` for a parent with `..` or empty components.
    pub fn detect(parent: &str) -> Result<Cgroups, CgroupError> {
        let parent_rel = parent_path(parent).ok_or_else(|| CgroupError::InvalidName {
            what: "cgroup parent",
            value: parent.to_string(),
        })?;
        let mountinfo = Path::new("/proc/self/mountinfo");
        let text = fs::read_to_string(mountinfo).map_err(|source| CgroupError::Detect {
            path: mountinfo.into(),
            source,
        })?;
        let mut mounts = parse_mountinfo(&text);
        // Prefer the conventional mount points where a hierarchy is mounted twice.
        mounts.sort_by_key(|m| !m.mount.starts_with("/sys/fs/cgroup"));
        let v2_controllers = match mounts.iter().find(|m| m.v2) {
            Some(m) => {
                let p = m.mount.join("cgroup.controllers");
                fs::read_to_string(&p)
                    .map_err(|source| CgroupError::Detect { path: p, source })?
                    .split_whitespace()
                    .map(str::to_string)
                    .collect()
            }
            None => Vec::new(),
        };
        let (hierarchies, at) = place(&mounts, &v2_controllers);
        if at.memory.is_none() {
            return Err(CgroupError::NoController {
                controller: "memory",
            });
        }
        Ok(Cgroups::from_parts(parent_rel, hierarchies, at))
    }

    /// A layout rooted at `root` without looking at the host, for tests on a directory tree
    /// laid out like a cgroup filesystem: v2 is one hierarchy at `root` holding everything;
    /// v1 is one hierarchy per controller at `root/<controller>` (`cpu`, `cpuacct`, `memory`,
    /// `pids`, `freezer`, `blkio`). An unusable `parent` is used with its bad parts dropped.
    pub fn at(root: &Path, version: CgroupVersion, parent: &str) -> Cgroups {
        let parent_rel: PathBuf = parent.split('/').filter(|c| valid_component(c)).collect();
        let (hierarchies, at) = match version {
            CgroupVersion::V2 => {
                let mounts = [CgroupMount {
                    mount: root.to_path_buf(),
                    v2: true,
                    controllers: Vec::new(),
                }];
                let all: Vec<String> = ["cpu", "memory", "pids", "io"]
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
                place(&mounts, &all)
            }
            CgroupVersion::V1 => {
                let mounts: Vec<CgroupMount> = Ctl::ALL
                    .iter()
                    .map(|c| CgroupMount {
                        mount: root.join(c.v1_name()),
                        v2: false,
                        controllers: vec![c.v1_name().to_string()],
                    })
                    .collect();
                place(&mounts, &[])
            }
        };
        Cgroups::from_parts(parent_rel, hierarchies, at)
    }

    fn from_parts(parent: PathBuf, hierarchies: Vec<Hierarchy>, at: Placement) -> Cgroups {
        let v2_enable = Ctl::ALL
            .iter()
            .filter(|c| {
                let slot = match c {
                    Ctl::Cpu => at.cpu,
                    Ctl::Memory => at.memory,
                    Ctl::Pids => at.pids,
                    Ctl::Io => at.io,
                    Ctl::Cpuacct | Ctl::Freezer => None,
                };
                slot.is_some_and(|i| hierarchies.get(i).is_some_and(|h| h.v2))
            })
            .filter_map(|c| c.v2_name())
            .collect();
        Cgroups {
            layout: Arc::new(Layout {
                parent,
                hierarchies,
                at,
                v2_enable,
                v2_enabled: AtomicBool::new(false),
            }),
        }
    }

    /// `V2` when the memory controller is on cgroup v2, else `V1`.
    pub fn version(&self) -> CgroupVersion {
        let l = &self.layout;
        match l.at.memory {
            Some(i) if l.hierarchies.get(i).is_some_and(|h| h.v2) => CgroupVersion::V2,
            _ => CgroupVersion::V1,
        }
    }

    /// Makes (or finds) the sandbox's cgroup in every hierarchy and sets its limits; on v2
    /// it first enables the controllers in each ancestor's `cgroup.subtree_control`.
    /// Idempotent: calling it again re-applies `limits`. Errors: `InvalidName` for an id that
    /// is not one path component, `Mkdir`, `Write` (a limit the kernel refuses), with the path.
    pub fn create(&self, sandbox_id: &str, limits: &Limits) -> Result<SandboxCgroup, CgroupError> {
        if !valid_component(sandbox_id) {
            return Err(CgroupError::InvalidName {
                what: "sandbox id",
                value: sandbox_id.to_string(),
            });
        }
        let l = &self.layout;
        for h in &l.hierarchies {
            if h.v2 {
                self.enable_v2_controllers(&h.mount)?;
            }
            let dir = h.mount.join(&l.parent).join(sandbox_id);
            fs::create_dir_all(&dir).map_err(|source| CgroupError::Mkdir {
                path: dir.clone(),
                source,
            })?;
        }
        let cg = self.open(sandbox_id);
        if let Some(h) = cg.memory_v1() {
            // Where the workload's processes join (v1 allows the agents in the parent).
            let dir = cg.dir(h).join(WORKLOAD);
            fs::create_dir_all(&dir).map_err(|source| CgroupError::Mkdir { path: dir, source })?;
        }
        for h in 0..l.hierarchies.len() {
            if cg.is_split(h) {
                let procs = Path::new(WORKLOAD).join(PROCS);
                for child in [Path::new(AGENT), Path::new(WORKLOAD), procs.as_path()] {
                    let dir = cg.dir(h).join(child);
                    fs::create_dir_all(&dir)
                        .map_err(|source| CgroupError::Mkdir { path: dir, source })?;
                }
            }
        }
        cg.set_limits(limits)?;
        tracing::debug!(sandbox_id, "cgroup created");
        Ok(cg)
    }

    /// Enables the v2 controllers the sandboxes need in the root and every cgroup down to
    /// the parent (a controller must be enabled in a cgroup's parent to be used in it).
    fn enable_v2_controllers(&self, root: &Path) -> Result<(), CgroupError> {
        let l = &self.layout;
        if l.v2_enable.is_empty() {
            return Ok(());
        }
        // A parent removed meanwhile comes back without controllers: check it is there.
        if l.v2_enabled.load(Ordering::Relaxed) && root.join(&l.parent).is_dir() {
            return Ok(());
        }
        let mut dir = root.to_path_buf();
        let mut components = l.parent.components();
        loop {
            if !dir.exists() {
                fs::create_dir(&dir)
                    .or_else(|e| match e.kind() {
                        io::ErrorKind::AlreadyExists => Ok(()),
                        _ => Err(e),
                    })
                    .map_err(|source| CgroupError::Mkdir {
                        path: dir.clone(),
                        source,
                    })?;
            }
            let available = fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
            let enabled =
                fs::read_to_string(dir.join("cgroup.subtree_control")).unwrap_or_default();
            let missing: Vec<String> = l
                .v2_enable
                .iter()
                .filter(|c| available.split_whitespace().any(|a| a == **c))
                .filter(|c| !enabled.split_whitespace().any(|a| a == **c))
                .map(|c| format!("+{c}"))
                .collect();
            if !missing.is_empty() {
                write_file(&dir.join("cgroup.subtree_control"), &missing.join(" "))?;
            }
            match components.next() {
                Some(c) => dir.push(c),
                None => {
                    l.v2_enabled.store(true, Ordering::Relaxed);
                    return Ok(());
                }
            }
        }
    }

    /// The cgroup of an existing sandbox (adoption, stop); touches nothing. Use
    /// [`SandboxCgroup::exists`] to check it is there.
    pub fn open(&self, sandbox_id: &str) -> SandboxCgroup {
        SandboxCgroup {
            layout: self.layout.clone(),
            id: sandbox_id.to_string(),
        }
    }

    /// Removes the parent (`opendsec/<edge_id>`) and then each of its ancestors below the
    /// hierarchy roots, in every hierarchy, where they are empty: what an exiting edge
    /// leaves when it stops its sandboxes. A parent that still holds a sandbox's cgroup
    /// (one kept running across an edge restart, or another edge's under `opendsec`) stays;
    /// that is not an error. Errors: `Remove` for anything else the kernel refuses; every
    /// hierarchy is tried even after one fails, and the first failure is returned.
    pub fn remove_parents(&self) -> Result<(), CgroupError> {
        let l = &self.layout;
        let mut first_err = None;
        for h in &l.hierarchies {
            let mut rel = l.parent.clone();
            while rel.components().next().is_some() {
                let dir = h.mount.join(&rel);
                match fs::remove_dir(&dir) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    // Not empty: a cgroup (v2 EBUSY, v1 EBUSY/ENOTEMPTY) still lives below.
                    Err(e)
                        if matches!(
                            e.raw_os_error(),
                            Some(libc::EBUSY) | Some(libc::ENOTEMPTY) | Some(libc::EEXIST)
                        ) =>
                    {
                        break
                    }
                    Err(source) => {
                        first_err.get_or_insert(CgroupError::Remove { path: dir, source });
                        break;
                    }
                }
                if !rel.pop() {
                    break;
                }
            }
        }
        // The ancestors are made again (with their controllers) by the next create.
        l.v2_enabled.store(false, Ordering::Relaxed);
        first_err.map_or(Ok(()), Err)
    }

    /// The ids of every sandbox that has a cgroup under the parent in any hierarchy, sorted
    /// (for cleanup of sandboxes the edge has no record of).
    pub fn list(&self) -> Vec<String> {
        let l = &self.layout;
        let mut ids = BTreeSet::new();
        for h in &l.hierarchies {
            let Ok(entries) = fs::read_dir(h.mount.join(&l.parent)) else {
                continue;
            };
            for e in entries.flatten() {
                if e.file_type().is_ok_and(|t| t.is_dir()) {
                    if let Some(name) = e.file_name().to_str() {
                        ids.insert(name.to_string());
                    }
                }
            }
        }
        ids.into_iter().collect()
    }
}

/// One sandbox's cgroup: a directory in every hierarchy in use. Cheap to clone.
#[derive(Debug, Clone)]
pub struct SandboxCgroup {
    layout: Arc<Layout>,
    id: String,
}

impl SandboxCgroup {
    // Every `h` passed here is an index of the layout's own `Placement`, which `place()` made
    // together with `hierarchies` and which never changes after: it is always in range.
    #[allow(clippy::indexing_slicing)]
    fn dir(&self, h: usize) -> PathBuf {
        let l = &self.layout;
        l.hierarchies[h].mount.join(&l.parent).join(&self.id)
    }

    fn dirs(&self) -> impl Iterator<Item = PathBuf> + '_ {
        (0..self.layout.hierarchies.len()).map(|i| self.dir(i))
    }

    fn is_v2(&self, h: usize) -> bool {
        self.layout.hierarchies.get(h).is_some_and(|x| x.v2)
    }

    /// The v1 memory hierarchy, where the workload gets a memory cgroup of its own below
    /// the sandbox's (`workload/`, limited to [`workload_memory_mb`]) and the agents stay in
    /// the sandbox's. On v2, `workload/` is the memory cgroup of everything the agents run.
    fn memory_v1(&self) -> Option<usize> {
        self.layout.at.memory.filter(|h| !self.is_v2(*h))
    }

    /// Whether hierarchy `h` splits the sandbox into `agent/` and `workload/`: cgroup v2,
    /// and the v1 hierarchies of the controllers the split is for (cpu, pids).
    fn is_split(&self, h: usize) -> bool {
        let at = &self.layout.at;
        self.is_v2(h) || at.cpu == Some(h) || at.pids == Some(h)
    }

    /// The directory of child `child` (`agent`, `workload/procs`) in hierarchy `h`, or the
    /// sandbox's own where the hierarchy is not split.
    fn member_dir(&self, h: usize, child: &str) -> PathBuf {
        if self.is_split(h) {
            self.dir(h).join(child)
        } else {
            self.dir(h)
        }
    }

    /// The file of hierarchy `h` that a single-threaded process writes "0" to in order to
    /// move itself in: `tasks` on cgroup v1, `cgroup.procs` on v2 (which has no `tasks`).
    ///
    /// Why not `cgroup.procs` everywhere: a write there moves a whole thread group, so the
    /// kernel takes the global `cgroup_threadgroup_rwsem` for writing, and taking it waits
    /// for an RCU grace period (11–14 ms per join on the v1-hybrid test machine, the
    /// largest step of a creation, docs/benchmarks.md). Writing "0" to v1's `tasks` moves
    /// only the writing thread, and the kernel skips that lock for a thread moving itself
    /// (~0.6 ms). Moving one thread is moving the whole process only when it has one: every
    /// writer of these files is single-threaded at that moment, the setup process (it runs
    /// no runtime and starts no thread, see init.rs) for `join` and `agent`, and a child
    /// between fork and exec (sys::spawn, chronus's session shell) for `workload`. Nothing
    /// multi-threaded may write them: its other threads would stay behind. A pid other than
    /// "0" takes the lock anyway, so [`SandboxCgroup::join`] keeps `cgroup.procs`.
    fn join_file(&self, h: usize) -> &'static str {
        if self.is_v2(h) {
            "cgroup.procs"
        } else {
            "tasks"
        }
    }

    /// Every hierarchy's `cgroup.procs` of the sandbox's process API: `workload/procs/`
    /// where the hierarchy is split, `workload/` in v1's memory hierarchy, else the
    /// sandbox's own.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        let procs = format!("{WORKLOAD}/{PROCS}");
        (0..self.layout.hierarchies.len())
            .map(|h| {
                if self.memory_v1() == Some(h) {
                    self.dir(h).join(WORKLOAD).join("cgroup.procs")
                } else {
                    self.member_dir(h, &procs).join("cgroup.procs")
                }
            })
            .collect()
    }

    /// What the setup process does to put the sandbox's agents into `agent/` and to let
    /// aether move the workload into `workload/` later (see [`SetupSteps`]). `limits` are
    /// the ones given to [`Cgroups::create`]: on v2 the children's limit files only appear
    /// once the controllers are enabled, which step 4 does.
    pub fn setup_steps(&self, limits: &Limits) -> SetupSteps {
        let n = self.layout.hierarchies.len();
        let mut steps = SetupSteps {
            join: (0..n)
                .map(|h| self.dir(h).join(self.join_file(h)))
                .collect(),
            ..Default::default()
        };
        for h in (0..n).filter(|h| self.is_split(*h)) {
            let workload = self.dir(h).join(WORKLOAD);
            steps
                .workload
                .push(workload.join(PROCS).join(self.join_file(h)));
            steps
                .agent
                .push(self.dir(h).join(AGENT).join(self.join_file(h)));
            if self.is_v2(h) {
                let enable = self.child_controllers(h);
                if !enable.is_empty() {
                    // The sandbox's, then the workload's: its sessions get their own pids
                    // and memory limits and an equal CPU weight each (commands, below the
                    // sessions, get no controller: they are charged to their session).
                    steps
                        .writes
                        .push((self.dir(h).join("cgroup.subtree_control"), enable.clone()));
                    steps
                        .writes
                        .push((workload.join("cgroup.subtree_control"), enable));
                }
            }
            steps.workload_dirs.push(workload);
        }
        if let Some(h) = self.memory_v1() {
            // Last in both lists: the process API joins the memory hierarchy's workload/
            // itself (it has no procs/ there), and each session gets its own below it.
            let workload = self.dir(h).join(WORKLOAD);
            steps.workload.push(workload.join(self.join_file(h)));
            steps.workload_dirs.push(workload);
        }
        steps.writes.extend(self.child_limit_writes(limits));
        steps
    }

    /// The v2 controllers the children need in hierarchy `h` ("+cpu +pids"): those of the
    /// split that this hierarchy holds.
    fn child_controllers(&self, h: usize) -> String {
        let at = &self.layout.at;
        let mut v = Vec::new();
        if at.cpu == Some(h) {
            v.push("+cpu");
        }
        if at.pids == Some(h) {
            v.push("+pids");
        }
        if at.memory == Some(h) && self.is_v2(h) {
            v.push("+memory");
        }
        v.join(" ")
    }

    /// The limits of `agent/` and `workload/`: the agents' CPU weight and pids reserve, the
    /// workload's `pids_max`, and the process API's share of it (see [`session_pids_max`]).
    fn child_limit_writes(&self, limits: &Limits) -> Vec<(PathBuf, String)> {
        let at = &self.layout.at;
        let mut out = Vec::new();
        if let Some(h) = at.cpu.filter(|h| self.is_split(*h)) {
            let agent = self.dir(h).join(AGENT);
            if self.is_v2(h) {
                out.push((agent.join("cpu.weight"), AGENT_CPU_WEIGHT.to_string()));
            } else {
                out.push((agent.join("cpu.shares"), AGENT_CPU_SHARES.to_string()));
            }
        }
        if let Some(h) = at.memory.filter(|h| self.is_v2(*h)) {
            let w = workload_memory_mb(limits.memory_mb);
            let v = if w > 0 {
                w.saturating_mul(1 << 20).to_string()
            } else {
                "max".to_string()
            };
            out.push((self.dir(h).join(WORKLOAD).join("memory.max"), v));
        }
        if let Some(h) = at.pids.filter(|h| self.is_split(*h)) {
            out.push((
                self.dir(h).join(AGENT).join("pids.max"),
                AGENT_PIDS_MAX.to_string(),
            ));
            out.push((
                self.dir(h).join(WORKLOAD).join("pids.max"),
                pids_value(limits.pids_max),
            ));
            out.push((
                self.dir(h).join(WORKLOAD).join(PROCS).join("pids.max"),
                pids_value(session_pids_max(limits.pids_max)),
            ));
        }
        out
    }

    /// Moves `pid` (the whole process) into the sandbox's workload in every hierarchy.
    /// Errors: `Join` with the procs file the kernel refused (the process is gone: `ESRCH`).
    pub fn join(&self, pid: u32) -> Result<(), CgroupError> {
        for path in self.procs_files() {
            write_raw(&path, &pid.to_string()).map_err(|source| CgroupError::Join {
                pid,
                path,
                source,
            })?;
        }
        Ok(())
    }

    /// Whether the cgroup directory is there in any hierarchy.
    pub fn exists(&self) -> bool {
        self.dirs().any(|d| d.is_dir())
    }

    /// Every process in the cgroup or a cgroup below it, in any hierarchy, sorted.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids = BTreeSet::new();
        for d in self.dirs() {
            collect_pids(&d, &mut pids);
        }
        pids.into_iter().collect()
    }

    /// The sandbox's current memory use in bytes (page cache included); 0 when unreadable.
    pub fn memory_bytes(&self) -> u64 {
        let Some(h) = self.layout.at.memory else {
            return 0;
        };
        let file = if self.is_v2(h) {
            "memory.current"
        } else {
            "memory.usage_in_bytes"
        };
        fs::read_to_string(self.dir(h).join(file))
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(0)
    }

    /// How many processes the OOM killer killed in the sandbox so far; 0 when unreadable.
    pub fn oom_kills(&self) -> u64 {
        let Some(h) = self.layout.at.memory else {
            return 0;
        };
        let file = if self.is_v2(h) {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        let read = |d: &Path| {
            fs::read_to_string(d.join(file))
                .ok()
                .and_then(|s| keyed_value(&s, "oom_kill"))
                .unwrap_or(0)
        };
        let dir = self.dir(h);
        if self.is_v2(h) {
            // v2's memory.events counts the whole subtree.
            return read(&dir);
        }
        // v1 counts each cgroup's own: the workload's and its sessions' too.
        let workload = dir.join(WORKLOAD);
        let sessions = fs::read_dir(&workload)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| read(&e.path()))
            .sum::<u64>();
        read(&dir) + read(&workload) + sessions
    }

    /// What to bind into the sandbox at /sys/fs/cgroup, as (host directory, name below
    /// /sys/fs/cgroup): v2 alone is `[(dir, "")]` (the mount point itself); v1 hierarchies
    /// are `(dir, "memory")`, `(dir, "cpu,cpuacct")`...; a v2 hierarchy beside v1 ones is
    /// `(dir, "unified")`.
    pub fn mounts(&self) -> Vec<(PathBuf, String)> {
        let hs = &self.layout.hierarchies;
        hs.iter()
            .enumerate()
            .map(|(i, h)| {
                let name = match (h.v2, hs.len()) {
                    (true, 1) => String::new(),
                    (true, _) => "unified".to_string(),
                    (false, _) => h.name.clone(),
                };
                (self.dir(i), name)
            })
            .collect()
    }
}

/// A `pids.max` value: the number, or "max" for 0 and below (unlimited).
pub fn pids_value(n: i64) -> String {
    if n > 0 {
        n.to_string()
    } else {
        "max".into()
    }
}

/// Adds the pids of `dir`'s `cgroup.procs` and of every cgroup below it.
fn collect_pids(dir: &Path, pids: &mut BTreeSet<u32>) {
    if let Ok(s) = fs::read_to_string(dir.join("cgroup.procs")) {
        pids.extend(s.split_whitespace().filter_map(|p| p.parse::<u32>().ok()));
    }
    if let Ok(entries) = fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                collect_pids(&e.path(), pids);
            }
        }
    }
}

/// `key N` out of a flat keyed file (`cgroup.events`, `memory.events`, v1 `oom_control`).
fn keyed_value(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let (k, v) = l.split_once(' ')?;
        (k == key).then(|| v.trim().parse().ok()).flatten()
    })
}

/// Writes a control file in one `write` (the kernel parses each write whole). Never creates
/// the file: a missing control file is an error, as the kernel would make it.
fn write_raw(path: &Path, value: &str) -> io::Result<()> {
    let mut f = OpenOptions::new().write(true).truncate(true).open(path)?;
    f.write_all(value.as_bytes())
}

fn write_file(path: &Path, value: &str) -> Result<(), CgroupError> {
    write_raw(path, value).map_err(|source| CgroupError::Write {
        path: path.to_path_buf(),
        value: value.to_string(),
        source,
    })
}

/// Writes a control file the kernel may not have (an optional feature); `false` when it is
/// missing.
fn write_if_present(path: &Path, value: &str) -> Result<bool, CgroupError> {
    match write_raw(path, value) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(CgroupError::Write {
            path: path.to_path_buf(),
            value: value.to_string(),
            source,
        }),
    }
}

#[cfg(test)]
pub(super) mod tests {
    #[test]
    fn each_session_leaves_the_others_a_margin() {
        use super::session_pids_max;
        assert_eq!(session_pids_max(4096), 4032);
        assert_eq!(session_pids_max(512), 448);
        assert_eq!(session_pids_max(100), 75);
        assert_eq!(session_pids_max(2), 2);
        assert_eq!(session_pids_max(1), 1);
        assert_eq!(session_pids_max(0), 0);
        assert_eq!(session_pids_max(-1), 0);
    }

    use super::lifecycle::remove_tree;
    use super::*;
    use std::process::{Child, Command, Stdio};
    use std::time::{Duration, Instant};

    #[test]
    fn bad_names_are_refused() {
        let dir = tempfile::tempdir().expect("tempdir");
        let cg = Cgroups::at(dir.path(), CgroupVersion::V2, "opendsec/e1");
        for id in ["", ".", "..", "a/b"] {
            let e = cg.create(id, &limits()).expect_err(id);
            assert!(matches!(e, CgroupError::InvalidName { .. }), "{e}");
        }
        assert!(parent_path("opendsec/../x").is_none());
        assert_eq!(
            parent_path("/opendsec/e1/"),
            Some(PathBuf::from("opendsec/e1"))
        );
    }

    pub(crate) fn limits() -> Limits {
        Limits {
            cpu_cores: 1.5,
            idle: true,
            memory_mb: 512,
            pids_max: 4096,
            disk_io: None,
        }
    }

    fn read(p: &Path) -> String {
        fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    /// Lays out `dir` as a kernel would: control files in the ancestors and the sandbox.
    /// A cgroup v2 tree under `root` made of plain files, with sandbox `id` of edge `e1`:
    /// nothing in it is a real process, and its `cgroup.kill` kills nothing.
    pub(crate) fn fake_v2(root: &Path, id: &str) -> PathBuf {
        let all = "cpuset cpu io memory hugetlb pids rdma misc";
        for (d, ctl) in [("", all), ("opendsec", ""), ("opendsec/e1", "")] {
            let d = root.join(d);
            fs::create_dir_all(&d).expect("mkdir");
            // What the parent enabled is what this one has; the test only checks writes.
            fs::write(
                d.join("cgroup.controllers"),
                if ctl.is_empty() { all } else { ctl },
            )
            .expect("controllers");
            fs::write(
                d.join("cgroup.subtree_control"),
                if ctl.is_empty() { "" } else { "cpu" },
            )
            .expect("subtree");
        }
        let sb = root.join("opendsec/e1").join(id);
        fs::create_dir_all(&sb).expect("mkdir sandbox");
        for f in [
            "cpu.max",
            "cpu.idle",
            "memory.max",
            "memory.swap.max",
            "pids.max",
            "io.max",
            "cgroup.procs",
            "cgroup.freeze",
            "cgroup.kill",
        ] {
            fs::write(sb.join(f), "").expect("control file");
        }
        fs::write(sb.join("cgroup.events"), "populated 0\nfrozen 1\n").expect("events");
        fs::write(sb.join("memory.current"), "1234\n").expect("current");
        fs::write(
            sb.join("memory.events"),
            "low 0\nhigh 0\nmax 9\noom 2\noom_kill 2\noom_group_kill 0\n",
        )
        .expect("memory.events");
        sb
    }

    #[test]
    fn v2_writes_limits_and_controllers() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        let sb = fake_v2(root, "e1.a");
        let cgs = Cgroups::at(root, CgroupVersion::V2, "opendsec/e1");
        assert_eq!(cgs.version(), CgroupVersion::V2);
        let cg = cgs.create("e1.a", &limits()).expect("create");
        // The root had cpu already; the others get everything.
        assert_eq!(
            read(&root.join("cgroup.subtree_control")),
            "+memory +pids +io"
        );
        assert_eq!(
            read(&root.join("opendsec/cgroup.subtree_control")),
            "+cpu +memory +pids +io"
        );
        assert_eq!(
            read(&root.join("opendsec/e1/cgroup.subtree_control")),
            "+cpu +memory +pids +io"
        );
        assert_eq!(read(&sb.join("cpu.max")), "150000 100000");
        assert_eq!(read(&sb.join("cpu.idle")), "1");
        assert_eq!(read(&sb.join("memory.max")), (512u64 << 20).to_string());
        assert_eq!(read(&sb.join("memory.swap.max")), "0");
        // The workload's pids_max plus the agents' reserve.
        assert_eq!(read(&sb.join("pids.max")), "4608");
        // What the setup process does: join here, then agent/, enable the children's
        // controllers and give them their limits; workload/ is what aether keeps open.
        // Always `cgroup.procs`: v2 has no `tasks`. Sessions get memory limits of their own
        // (aether writes them); commands below them get no controller.
        let steps = cg.setup_steps(&limits());
        assert_eq!(steps.join, [sb.join("cgroup.procs")]);
        assert_eq!(steps.agent, [sb.join("agent/cgroup.procs")]);
        assert_eq!(steps.workload, [sb.join("workload/procs/cgroup.procs")]);
        assert_eq!(steps.workload_dirs, [sb.join("workload")]);
        let writes: Vec<(PathBuf, &str)> = steps
            .writes
            .iter()
            .map(|(p, v)| (p.clone(), v.as_str()))
            .collect();
        assert_eq!(
            writes,
            [
                (sb.join("cgroup.subtree_control"), "+cpu +pids +memory"),
                (
                    sb.join("workload/cgroup.subtree_control"),
                    "+cpu +pids +memory"
                ),
                (sb.join("agent/cpu.weight"), "10000"),
                // 512 MiB less the agents' reserve of 32 MiB.
                (sb.join("workload/memory.max"), "503316480"),
                (sb.join("agent/pids.max"), "512"),
                (sb.join("workload/pids.max"), "4096"),
                (sb.join("workload/procs/pids.max"), "4032"),
            ]
        );
        assert!(sb.join("agent").is_dir() && sb.join("workload/procs").is_dir());
        // Once the controllers are there, create (a warm sandbox's new limits) sets them.
        for f in [
            "agent/cpu.weight",
            "agent/pids.max",
            "workload/pids.max",
            "workload/procs/pids.max",
        ] {
            fs::write(sb.join(f), "").expect("child control file");
        }
        fs::write(sb.join("workload/procs/cgroup.procs"), "").expect("workload procs");
        cgs.create("e1.a", &limits()).expect("create with children");
        assert_eq!(read(&sb.join("agent/cpu.weight")), "10000");
        assert_eq!(read(&sb.join("agent/pids.max")), "512");
        assert_eq!(read(&sb.join("workload/pids.max")), "4096");
        assert_eq!(read(&sb.join("workload/procs/pids.max")), "4032");

        // Unlimited, not idle; no cpu.idle on this kernel: the weight instead.
        fs::remove_file(sb.join("cpu.idle")).expect("rm cpu.idle");
        fs::write(sb.join("cpu.weight"), "").expect("cpu.weight");
        let unl = Limits {
            cpu_cores: 0.0,
            idle: false,
            memory_mb: 0,
            pids_max: 0,
            disk_io: None,
        };
        cgs.create("e1.a", &unl).expect("create again");
        assert_eq!(read(&sb.join("cpu.max")), "max 100000");
        assert_eq!(read(&sb.join("cpu.weight")), "100");
        assert_eq!(read(&sb.join("memory.max")), "max");
        assert_eq!(read(&sb.join("pids.max")), "max");
        assert_eq!(read(&sb.join("workload/pids.max")), "max");

        let io = DiskIo {
            read_mbps: 1,
            write_mbps: 0,
            read_iops: 100,
            write_iops: 0,
        };
        cg.set_disk_io(7, 3, &io).expect("io");
        assert_eq!(
            read(&sb.join("io.max")),
            "7:3 rbps=1048576 wbps=max riops=100 wiops=max"
        );

        cg.join(42).expect("join");
        assert_eq!(read(&sb.join("workload/procs/cgroup.procs")), "42");
        assert_eq!(cg.procs_files(), [sb.join("workload/procs/cgroup.procs")]);
        assert_eq!(cg.pids(), [42]);
        assert_eq!(cg.memory_bytes(), 1234);
        assert_eq!(cg.oom_kills(), 2);
        assert_eq!(cg.mounts(), [(sb.clone(), String::new())]);
        assert!(cg.exists());
        assert!(!cgs.open("e1.zz").exists());
        assert_eq!(cgs.list(), ["e1.a"]);

        cg.freeze().expect("freeze (the fake says frozen)");
        assert_eq!(read(&sb.join("cgroup.freeze")), "1");
        assert!(cg.frozen());
        cg.thaw().expect("thaw");
        assert_eq!(read(&sb.join("cgroup.freeze")), "0");

        fs::write(sb.join("cgroup.events"), "populated 1\nfrozen 0\n").expect("events");
        let e = cg.freeze().expect_err("never frozen");
        assert!(matches!(e, CgroupError::FreezeTimeout { .. }), "{e}");
        assert_eq!(
            read(&sb.join("cgroup.freeze")),
            "0",
            "thawed after the timeout"
        );

        fs::write(sb.join("cgroup.procs"), "").expect("empty procs");
        fs::write(sb.join("workload/procs/cgroup.procs"), "").expect("empty procs");
        cg.kill_all().expect("kill_all");
        assert_eq!(
            read(&sb.join("cgroup.kill")),
            "",
            "nothing to kill: no write"
        );
        // A live process (this test's, untouched: the fake's cgroup.kill kills nothing).
        fs::write(sb.join("cgroup.procs"), format!("{}\n", std::process::id())).expect("procs");
        // The fake never empties: kill_all keeps writing cgroup.kill until its deadline.
        let e = cg
            .kill_all_within(Duration::from_millis(200), Duration::from_secs(30))
            .expect_err("never empties");
        assert!(matches!(e, CgroupError::KillTimeout { left: 1, .. }), "{e}");
        assert_eq!(read(&sb.join("cgroup.kill")), "1");
        // Dying tasks must get the CPU to exit: the quota was lifted.
        assert_eq!(read(&sb.join("cpu.max")), "max");
        // However long the preparation took, no deadline runs out before a kill was sent
        // (with no time at all, it is still sent once).
        fs::write(sb.join("cgroup.kill"), "").expect("reset kill");
        let e = cg
            .kill_all_within(Duration::ZERO, Duration::ZERO)
            .expect_err("never empties");
        assert!(matches!(e, CgroupError::KillTimeout { left: 1, .. }), "{e}");
        assert_eq!(
            read(&sb.join("cgroup.kill")),
            "1",
            "killed before giving up"
        );

        // A process that is exiting (a zombie: PF_EXITING stays set) is waited for past the
        // first deadline, as the last process of a sandbox whose mounts the kernel is still
        // tearing down is: kill_all returns Ok once it is gone, not KillTimeout.
        let mut child = std::process::Command::new("true")
            .spawn()
            .expect("spawn true");
        let zombie = child.id();
        let until = Instant::now() + Duration::from_secs(10);
        while !fs::read_to_string(format!("/proc/{zombie}/stat")).is_ok_and(|s| {
            s.rsplit_once(')')
                .is_some_and(|(_, r)| r.trim_start().starts_with('Z'))
        }) {
            assert!(Instant::now() < until, "true did not exit");
            std::thread::sleep(Duration::from_millis(5));
        }
        fs::write(sb.join("cgroup.procs"), format!("{zombie}\n")).expect("procs");
        let procs = sb.join("cgroup.procs");
        let emptier = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(600));
            fs::write(procs, "").expect("empty procs");
        });
        let waited = Instant::now();
        cg.kill_all_within(Duration::from_millis(200), Duration::from_secs(30))
            .expect("an exiting process is waited for");
        assert!(
            waited.elapsed() >= Duration::from_millis(500),
            "returned before it was gone"
        );
        emptier.join().expect("emptier");
        let _ = child.wait();
    }

    #[test]
    fn remove_parents_takes_only_empty_ones() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        for version in [CgroupVersion::V1, CgroupVersion::V2] {
            let cgs = Cgroups::at(root, version, "opendsec/e1");
            let others = Cgroups::at(root, version, "opendsec/e2");
            let parents = |c: &Cgroups| -> Vec<PathBuf> {
                c.layout
                    .hierarchies
                    .iter()
                    .map(|h| h.mount.join(&c.layout.parent))
                    .collect()
            };
            for p in parents(&cgs).iter().chain(parents(&others).iter()) {
                fs::create_dir_all(p).expect("mkdir parent");
            }
            // e2 still has a sandbox: its parent and the shared `opendsec` stay.
            let kept = parents(&others)[0].join("e2.a");
            fs::create_dir_all(&kept).expect("mkdir sandbox");
            cgs.remove_parents().expect("remove e1");
            assert!(parents(&cgs).iter().all(|p| !p.exists()), "{version:?}");
            assert!(kept.is_dir());
            fs::remove_dir(&kept).expect("rm sandbox");
            others.remove_parents().expect("remove e2");
            for h in &others.layout.hierarchies {
                assert!(!h.mount.join("opendsec").exists(), "{version:?}");
                assert!(h.mount.is_dir(), "the hierarchy root stays");
            }
            cgs.remove_parents().expect("nothing there is fine");
        }
    }

    #[test]
    fn v1_fake_tree_writes_limits() {
        let dir = tempfile::tempdir().expect("tempdir");
        let root = dir.path();
        let cgs = Cgroups::at(root, CgroupVersion::V1, "opendsec/e1");
        assert_eq!(cgs.version(), CgroupVersion::V1);
        let sb = |c: &str| root.join(c).join("opendsec/e1/e1.a");
        let files = [
            ("cpu", "cpu.cfs_period_us"),
            ("cpu", "cpu.cfs_quota_us"),
            ("cpu", "cpu.shares"),
            ("memory", "memory.limit_in_bytes"),
            ("memory", "memory.oom_control"),
            ("pids", "pids.max"),
        ];
        for (c, f) in files {
            fs::create_dir_all(sb(c)).expect("mkdir");
            fs::write(sb(c).join(f), "").expect("control file");
        }
        let cg = cgs.create("e1.a", &limits()).expect("create");
        assert_eq!(read(&sb("cpu").join("cpu.cfs_period_us")), "100000");
        assert_eq!(read(&sb("cpu").join("cpu.cfs_quota_us")), "150000");
        assert_eq!(read(&sb("cpu").join("cpu.shares")), "2");
        assert_eq!(
            read(&sb("memory").join("memory.limit_in_bytes")),
            (512u64 << 20).to_string()
        );
        assert_eq!(read(&sb("memory").join("memory.oom_control")), "0");
        assert!(!sb("memory").join("memory.memsw.limit_in_bytes").exists());
        assert_eq!(read(&sb("pids").join("pids.max")), "4608");
        // v1 splits only where the split is for (cpu, pids); the freezer and blkio (whose
        // throttles are not hierarchical on v1) keep every process in the sandbox's own
        // cgroup, and memory keeps the agents there, the workload in `workload/` below it.
        for c in ["cpu", "pids"] {
            assert!(sb(c).join("agent").is_dir() && sb(c).join("workload/procs").is_dir());
        }
        for c in ["cpuacct", "memory", "freezer", "blkio"] {
            assert!(!sb(c).join("agent").exists(), "{c}");
        }
        assert!(sb("memory").join("workload").is_dir());
        // Once the kernel's files are there (they are at once in a real tree), the
        // workload's memory is held below the sandbox's by the agents' reserve.
        fs::write(sb("memory").join("workload/memory.limit_in_bytes"), "").expect("limit");
        fs::write(sb("memory").join("workload/memory.oom_control"), "").expect("oom");
        cgs.create("e1.a", &limits()).expect("create again");
        assert_eq!(
            read(&sb("memory").join("workload/memory.limit_in_bytes")),
            (480u64 << 20).to_string()
        );
        // v1: every move of a process by itself goes through `tasks` (no global lock, no
        // RCU grace period); v2 keeps `cgroup.procs` (see v2_writes_limits_and_controllers).
        let steps = cg.setup_steps(&limits());
        assert_eq!(
            steps.join,
            ["cpu", "cpuacct", "memory", "pids", "freezer", "blkio"].map(|c| sb(c).join("tasks"))
        );
        assert_eq!(
            steps.agent,
            [
                sb("cpu").join("agent/tasks"),
                sb("pids").join("agent/tasks")
            ]
        );
        assert_eq!(
            steps.workload,
            [
                sb("cpu").join("workload/procs/tasks"),
                sb("pids").join("workload/procs/tasks"),
                sb("memory").join("workload/tasks")
            ]
        );
        assert_eq!(
            steps.workload_dirs,
            [
                sb("cpu").join("workload"),
                sb("pids").join("workload"),
                sb("memory").join("workload")
            ]
        );
        let writes: Vec<(PathBuf, &str)> = steps
            .writes
            .iter()
            .map(|(p, v)| (p.clone(), v.as_str()))
            .collect();
        assert_eq!(
            writes,
            [
                (sb("cpu").join("agent/cpu.shares"), "102400"),
                (sb("pids").join("agent/pids.max"), "512"),
                (sb("pids").join("workload/pids.max"), "4096"),
                (sb("pids").join("workload/procs/pids.max"), "4032"),
            ]
        );
        assert_eq!(
            cg.procs_files()[0],
            sb("cpu").join("workload/procs/cgroup.procs")
        );
        assert_eq!(
            cg.procs_files()[2],
            sb("memory").join("workload/cgroup.procs")
        );
        for c in ["cpuacct", "freezer", "blkio"] {
            assert!(sb(c).is_dir(), "{c}");
        }
        let names: Vec<String> = cg.mounts().into_iter().map(|m| m.1).collect();
        assert_eq!(
            names,
            ["cpu", "cpuacct", "memory", "pids", "freezer", "blkio"]
        );
        assert_eq!(cg.procs_files().len(), 6);
    }

    // ---- real v1 (or v2) hierarchies of this host: root only ----

    use crate::sys::root_or_skip;

    /// A parent of our own on the host's hierarchies, removed (with everything under it)
    /// when dropped.
    struct HostParent {
        cgs: Cgroups,
    }

    impl HostParent {
        fn new() -> HostParent {
            let parent = format!(
                "opendsec-test/{}-{:08x}",
                std::process::id(),
                rand::random::<u32>()
            );
            HostParent {
                cgs: Cgroups::detect(&parent).expect("detect"),
            }
        }
    }

    impl Drop for HostParent {
        fn drop(&mut self) {
            let l = &self.cgs.layout;
            for h in &l.hierarchies {
                let _ = remove_tree(&h.mount.join(&l.parent));
                // Shared with concurrent tests: only goes when empty.
                let _ = fs::remove_dir(h.mount.join("opendsec-test"));
            }
        }
    }

    /// (utime + stime) of a process in clock ticks.
    fn cpu_ticks(pid: u32) -> u64 {
        let s = read(Path::new(&format!("/proc/{pid}/stat")));
        let after = &s[s.rfind(')').expect("comm") + 2..];
        let f: Vec<&str> = after.split(' ').collect();
        f[11].parse::<u64>().expect("utime") + f[12].parse::<u64>().expect("stime")
    }

    fn spawn(args: &[&str]) -> Child {
        Command::new(args[0])
            .args(&args[1..])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn")
    }

    #[test]
    fn host_lifecycle_limits_freeze_kill_remove() {
        if !root_or_skip("host_lifecycle_limits_freeze_kill_remove") {
            return;
        }
        let hp = HostParent::new();
        let cgs = &hp.cgs;
        let lim = Limits {
            cpu_cores: 0.25,
            idle: false,
            memory_mb: 256,
            pids_max: 64,
            disk_io: None,
        };
        let cg = cgs.create("e1.a", &lim).expect("create");
        cgs.create("e1.a", &lim).expect("create is idempotent");
        assert!(cg.exists());
        assert_eq!(cgs.list(), ["e1.a"]);
        let mem = cg.layout.at.memory.map(|h| cg.dir(h)).expect("memory");
        let pids_dir = cg.layout.at.pids.map(|h| cg.dir(h)).expect("pids");
        assert_eq!(
            read(&pids_dir.join("pids.max")).trim(),
            (64 + AGENT_PIDS_MAX).to_string()
        );
        if cgs.version() == CgroupVersion::V1 {
            assert_eq!(read(&pids_dir.join("workload/pids.max")).trim(), "64");
            assert_eq!(
                read(&pids_dir.join("agent/pids.max")).trim(),
                AGENT_PIDS_MAX.to_string()
            );
        }
        if cgs.version() == CgroupVersion::V1 {
            let cpu = cg.layout.at.cpu.map(|h| cg.dir(h)).expect("cpu");
            assert_eq!(read(&cpu.join("cpu.cfs_quota_us")).trim(), "25000");
            assert_eq!(read(&cpu.join("cpu.cfs_period_us")).trim(), "100000");
            assert_eq!(read(&cpu.join("cpu.shares")).trim(), "1024");
            assert_eq!(
                read(&mem.join("memory.limit_in_bytes")).trim(),
                (256u64 << 20).to_string()
            );
            if mem.join("memory.memsw.limit_in_bytes").exists() {
                assert_eq!(
                    read(&mem.join("memory.memsw.limit_in_bytes")).trim(),
                    (256u64 << 20).to_string()
                );
            }
            assert!(read(&mem.join("memory.oom_control")).contains("oom_kill_disable 0"));
            // Raising the limit has to go memsw first.
            let more = Limits {
                memory_mb: 1024,
                idle: true,
                ..lim.clone()
            };
            cg.set_limits(&more).expect("raise memory");
            assert_eq!(
                read(&mem.join("memory.limit_in_bytes")).trim(),
                (1024u64 << 20).to_string()
            );
            assert_eq!(read(&cpu.join("cpu.shares")).trim(), "2");
            let unl = Limits {
                memory_mb: 0,
                cpu_cores: 0.0,
                pids_max: 0,
                ..lim.clone()
            };
            cg.set_limits(&unl).expect("unlimited");
            assert_eq!(read(&cpu.join("cpu.cfs_quota_us")).trim(), "-1");
            assert_eq!(read(&pids_dir.join("pids.max")).trim(), "max");
            cg.set_limits(&lim).expect("back to the limits");
        } else {
            let dir = cg.dir(0);
            assert_eq!(read(&dir.join("cpu.max")).trim(), "25000 100000");
            assert_eq!(
                read(&dir.join("memory.max")).trim(),
                (256u64 << 20).to_string()
            );
            if dir.join("memory.swap.max").exists() {
                assert_eq!(read(&dir.join("memory.swap.max")).trim(), "0");
            }
            if dir.join("cpu.idle").exists() {
                assert_eq!(read(&dir.join("cpu.idle")).trim(), "0");
            }
        }

        // A busy child: frozen, it gets no CPU.
        let mut busy = spawn(&["sh", "-c", "while :; do :; done"]);
        let mut idle = spawn(&["sleep", "1000"]);
        cg.join(busy.id()).expect("join busy");
        cg.join(idle.id()).expect("join sleep");
        let mut want = vec![busy.id(), idle.id()];
        want.sort();
        assert_eq!(cg.pids(), want);
        assert!(!cg.frozen());
        cg.freeze().expect("freeze");
        assert!(cg.frozen());
        if let Some(h) = cg.layout.at.freezer.filter(|h| !cg.is_v2(*h)) {
            assert_eq!(read(&cg.dir(h).join("freezer.state")).trim(), "FROZEN");
        }
        let t0 = cpu_ticks(busy.id());
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(cpu_ticks(busy.id()), t0, "a frozen child ran");
        cg.thaw().expect("thaw");
        assert!(!cg.frozen());
        let deadline = Instant::now() + Duration::from_secs(10);
        while cpu_ticks(busy.id()) == t0 {
            assert!(Instant::now() < deadline, "the thawed child never ran");
            std::thread::sleep(Duration::from_millis(50));
        }

        // kill_all works on a paused sandbox.
        cg.freeze().expect("freeze again");
        cg.kill_all().expect("kill_all");
        assert!(cg.pids().is_empty());
        for c in [&mut busy, &mut idle] {
            let st = c.wait().expect("reap");
            use std::os::unix::process::ExitStatusExt;
            assert_eq!(st.signal(), Some(libc::SIGKILL));
        }
        cg.remove().expect("remove");
        assert!(!cg.exists());
        cg.remove().expect("remove twice");
        assert!(cgs.list().is_empty());
    }

    /// A bash fork bomb filling its pids limit behind a 0.1-core quota: kill_all empties
    /// the cgroup well within its deadline (it used to give up after 5 s with more than a
    /// thousand processes left: the killed ones could not get the CPU to exit).
    #[test]
    fn host_kill_all_wins_against_a_fork_bomb() {
        if !root_or_skip("host_kill_all_wins_against_a_fork_bomb") {
            return;
        }
        if !Path::new("/bin/bash").exists() {
            eprintln!("skipping host_kill_all_wins_against_a_fork_bomb: no bash");
            return;
        }
        let hp = HostParent::new();
        // The defaults of a sandbox a trainer makes by the thousand: a tenth of a core,
        // pids_max 4096.
        let lim = Limits {
            cpu_cores: 0.1,
            idle: false,
            memory_mb: 2048,
            pids_max: 4096,
            disk_io: None,
        };
        let cg = hp.cgs.create("e1.bomb", &lim).expect("create");
        let mut child = spawn(&["bash", "-c", "read x; :(){ :|:& };:"]);
        cg.join(child.id()).expect("join");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(b"go\n")
            .expect("go");
        // Let it fill the limit.
        let deadline = Instant::now() + Duration::from_secs(20);
        while cg.pids().len() < 3500 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(100));
        }
        let n = cg.pids().len();
        let t = Instant::now();
        let r = cg.kill_all();
        let took = t.elapsed();
        let _ = child.wait();
        r.unwrap_or_else(|e| panic!("kill_all with {n} processes: {e}"));
        assert!(cg.pids().is_empty());
        assert!(took < Duration::from_secs(5), "{n} processes took {took:?}");
        cg.remove().expect("remove");
    }

    #[test]
    fn host_remove_kills_what_is_left() {
        if !root_or_skip("host_remove_kills_what_is_left") {
            return;
        }
        let hp = HostParent::new();
        let cg = hp.cgs.create("e1.b", &limits()).expect("create");
        let mut child = spawn(&["sleep", "1000"]);
        cg.join(child.id()).expect("join");
        cg.remove().expect("remove with a process in it");
        assert!(!cg.exists());
        child.wait().expect("reap");
    }

    #[test]
    fn host_oom_kills_in_the_sandbox() {
        if !root_or_skip("host_oom_kills_in_the_sandbox") {
            return;
        }
        let hp = HostParent::new();
        let lim = Limits {
            memory_mb: 32,
            ..limits()
        };
        let cg = hp.cgs.create("e1.oom", &lim).expect("create");
        assert_eq!(cg.oom_kills(), 0);
        // Joins first, then allocates: `read` holds it until we say go.
        let mut child = spawn(&[
            "sh",
            "-c",
            "read x; exec dd if=/dev/zero of=/dev/null bs=100M count=1",
        ]);
        cg.join(child.id()).expect("join");
        child
            .stdin
            .take()
            .expect("stdin")
            .write_all(b"go\n")
            .expect("go");
        let st = child.wait().expect("reap");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(st.signal(), Some(libc::SIGKILL), "{st:?}");
        assert!(cg.oom_kills() >= 1);
        assert!(cg.memory_bytes() <= 32 << 20);
        cg.remove().expect("remove");
    }

    #[test]
    fn host_disk_io_throttle() {
        if !root_or_skip("host_disk_io_throttle") {
            return;
        }
        let hp = HostParent::new();
        let cg = hp.cgs.create("e1.io", &limits()).expect("create");
        // loop0's numbers (7:0); the rule needs an existing block device.
        let io = DiskIo {
            read_mbps: 2,
            write_mbps: 1,
            read_iops: 0,
            write_iops: 50,
        };
        cg.set_disk_io(7, 0, &io).expect("set");
        let h = cg.layout.at.io.expect("io controller");
        let dir = cg.dir(h);
        if cg.is_v2(h) {
            assert!(read(&dir.join("io.max")).contains("7:0 rbps=2097152 wbps=1048576"));
        } else {
            assert_eq!(
                read(&dir.join("blkio.throttle.read_bps_device")).trim(),
                "7:0 2097152"
            );
            assert_eq!(
                read(&dir.join("blkio.throttle.write_bps_device")).trim(),
                "7:0 1048576"
            );
            assert_eq!(
                read(&dir.join("blkio.throttle.read_iops_device")).trim(),
                ""
            );
            assert_eq!(
                read(&dir.join("blkio.throttle.write_iops_device")).trim(),
                "7:0 50"
            );
            cg.set_disk_io(7, 0, &DiskIo::default()).expect("clear");
            assert_eq!(read(&dir.join("blkio.throttle.read_bps_device")).trim(), "");
        }
        cg.remove().expect("remove");
    }
}
