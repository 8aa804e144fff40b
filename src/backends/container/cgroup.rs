//! Per-sandbox cgroups, by files, on cgroup v2 and on v1 (or a hybrid of both).
//!
//! Production hosts are pure v2 (one hierarchy at /sys/fs/cgroup); the build machines are
//! v1-hybrid (each controller on its own v1 hierarchy, an empty cgroup2 beside them). So the
//! layout is detected per controller from /proc/self/mountinfo and the v2 root's
//! `cgroup.controllers`: each controller is used on whichever hierarchy holds it, and a
//! sandbox's cgroup is one directory `<parent>/<sandbox_id>` in every hierarchy used.
//!
//! Limits (22-components §6, 15-configuration `pids_max`, `disk_io`): CPU quota, `cpu.idle`
//! for best-effort sandboxes, memory without swap, a process count, disk I/O throttles on the
//! sandbox's loop device; the freezer pauses a sandbox.

use std::collections::BTreeSet;
use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// The CFS period for CPU quotas, in µs (the kernel's default).
const CPU_PERIOD_US: i64 = 100_000;
/// The smallest quota the kernel accepts, in µs.
const CPU_MIN_QUOTA_US: i64 = 1_000;
/// How long `freeze` waits for the kernel to report FROZEN.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long `kill_all` waits for the cgroup to empty.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long `remove` retries an rmdir that finds the cgroup still busy (exiting tasks).
const RMDIR_TIMEOUT: Duration = Duration::from_secs(1);

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
    #[error("detecting cgroups from {path}: {source}")]
    Detect { path: PathBuf, source: io::Error },
    /// A controller the backend cannot do without is on no hierarchy.
    #[error("no mounted cgroup hierarchy holds the {controller} controller")]
    NoController { controller: &'static str },
    /// The parent path or a sandbox id is not usable as a cgroup path.
    #[error("{what} {value:?} is not a usable cgroup name")]
    InvalidName { what: &'static str, value: String },
    /// Making a cgroup directory failed.
    #[error("creating cgroup {path}: {source}")]
    Mkdir { path: PathBuf, source: io::Error },
    /// Writing a control file failed (a limit, a controller, a freeze).
    #[error("writing {value:?} to {path}: {source}")]
    Write {
        path: PathBuf,
        value: String,
        source: io::Error,
    },
    /// Reading a control file failed.
    #[error("reading {path}: {source}")]
    Read { path: PathBuf, source: io::Error },
    /// Moving a process into the cgroup failed.
    #[error("moving pid {pid} into {path}: {source}")]
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
    #[error("killing pid {pid} of {path}: {source}")]
    Signal {
        pid: u32,
        path: PathBuf,
        source: nix::errno::Errno,
    },
    /// Processes were still in the cgroup after the kill deadline.
    #[error("cgroup {path} still has {left} processes after {waited_ms} ms of SIGKILL")]
    KillTimeout {
        path: PathBuf,
        left: usize,
        waited_ms: u64,
    },
    /// Removing a cgroup directory failed.
    #[error("removing cgroup {path}: {source}")]
    Remove { path: PathBuf, source: io::Error },
}

/// A controller the backend uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ctl {
    Cpu,
    Cpuacct,
    Memory,
    Pids,
    Freezer,
    Io,
}

impl Ctl {
    const ALL: [Ctl; 6] = [
        Ctl::Cpu,
        Ctl::Cpuacct,
        Ctl::Memory,
        Ctl::Pids,
        Ctl::Freezer,
        Ctl::Io,
    ];

    fn v1_name(self) -> &'static str {
        match self {
            Ctl::Cpu => "cpu",
            Ctl::Cpuacct => "cpuacct",
            Ctl::Memory => "memory",
            Ctl::Pids => "pids",
            Ctl::Freezer => "freezer",
            Ctl::Io => "blkio",
        }
    }

    /// The v2 controller to enable, or `None` where v2 has it built in (freezer) or folded
    /// into another (cpuacct into cpu).
    fn v2_name(self) -> Option<&'static str> {
        match self {
            Ctl::Cpu => Some("cpu"),
            Ctl::Memory => Some("memory"),
            Ctl::Pids => Some("pids"),
            Ctl::Io => Some("io"),
            Ctl::Cpuacct | Ctl::Freezer => None,
        }
    }
}

/// One mounted hierarchy the sandboxes use.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Hierarchy {
    mount: PathBuf,
    v2: bool,
    /// v1: the controllers as mounted, e.g. `memory` or `cpu,cpuacct`; v2: empty.
    name: String,
}

/// Which hierarchy (an index into `hierarchies`) holds each controller.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct Placement {
    cpu: Option<usize>,
    memory: Option<usize>,
    pids: Option<usize>,
    io: Option<usize>,
    freezer: Option<usize>,
}

#[derive(Debug)]
struct Layout {
    parent: PathBuf,
    hierarchies: Vec<Hierarchy>,
    at: Placement,
    /// The v2 controllers to enable in the ancestors' `cgroup.subtree_control`.
    v2_enable: Vec<&'static str>,
}

/// The detected cgroup layout and the parent under which sandboxes get their cgroups.
/// Cheap to clone.
#[derive(Debug, Clone)]
pub struct Cgroups {
    layout: Arc<Layout>,
}

/// One cgroup mount from /proc/self/mountinfo.
#[derive(Debug, Clone, PartialEq, Eq)]
struct CgroupMount {
    mount: PathBuf,
    v2: bool,
    /// v1: the controllers of the hierarchy (only those named in the super options).
    controllers: Vec<String>,
}

/// Parses the cgroup and cgroup2 mounts out of /proc/self/mountinfo text. Read-only mounts
/// are skipped (nothing can be created there).
fn parse_mountinfo(text: &str) -> Vec<CgroupMount> {
    let mut out = Vec::new();
    for line in text.lines() {
        let Some((pre, post)) = line.split_once(" - ") else {
            continue;
        };
        let pre: Vec<&str> = pre.split(' ').collect();
        let post: Vec<&str> = post.split(' ').collect();
        if pre.len() < 6 || post.len() < 3 {
            continue;
        }
        let v2 = match post[0] {
            "cgroup" => false,
            "cgroup2" => true,
            _ => continue,
        };
        if pre[5].split(',').any(|o| o == "ro") {
            continue;
        }
        let controllers = if v2 {
            Vec::new()
        } else {
            post[2]
                .split(',')
                .filter(|o| Ctl::ALL.iter().any(|c| c.v1_name() == *o))
                .map(str::to_string)
                .collect()
        };
        out.push(CgroupMount {
            mount: PathBuf::from(unescape_mount(pre[4])),
            v2,
            controllers,
        });
    }
    out
}

/// Undoes mountinfo's octal escapes (`\040` for a space).
fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Decides which hierarchy holds each controller: a v1 hierarchy that has it, else the v2
/// one when its root lists it in `cgroup.controllers`. The freezer falls back to v2, where
/// it is built in. The first mount of a hierarchy wins (the same one may be mounted twice).
fn place(mounts: &[CgroupMount], v2_controllers: &[String]) -> (Vec<Hierarchy>, Placement) {
    let mut hierarchies: Vec<Hierarchy> = Vec::new();
    let mut index = |h: Hierarchy| -> usize {
        match hierarchies
            .iter()
            .position(|x| x.v2 == h.v2 && x.name == h.name)
        {
            Some(i) => i,
            None => {
                hierarchies.push(h);
                hierarchies.len() - 1
            }
        }
    };
    let v2_mount = mounts.iter().find(|m| m.v2);
    let mut at = Placement::default();
    for ctl in Ctl::ALL {
        let v1 = mounts
            .iter()
            .find(|m| !m.v2 && m.controllers.iter().any(|c| c == ctl.v1_name()));
        let slot = if let Some(m) = v1 {
            Some(index(Hierarchy {
                mount: m.mount.clone(),
                v2: false,
                name: m.controllers.join(","),
            }))
        } else if let Some(m) = v2_mount {
            let on_v2 = match ctl.v2_name() {
                Some(n) => v2_controllers.iter().any(|c| c == n),
                None => ctl == Ctl::Freezer,
            };
            on_v2.then(|| {
                index(Hierarchy {
                    mount: m.mount.clone(),
                    v2: true,
                    name: String::new(),
                })
            })
        } else {
            None
        };
        match ctl {
            Ctl::Cpu => at.cpu = slot,
            Ctl::Memory => at.memory = slot,
            Ctl::Pids => at.pids = slot,
            Ctl::Io => at.io = slot,
            Ctl::Freezer => at.freezer = slot,
            // Only accounted: it needs its directory (processes join it) but no file of ours.
            Ctl::Cpuacct => {}
        }
    }
    (hierarchies, at)
}

/// A single path component: no separators, not `.` or `..`, not empty.
fn valid_component(s: &str) -> bool {
    !s.is_empty() && s != "." && s != ".." && !s.contains('/') && !s.contains('\0')
}

/// `opendsec/<edge_id>` as a relative path; `None` when a component is unusable.
fn parent_path(parent: &str) -> Option<PathBuf> {
    let trimmed = parent.trim_matches('/');
    if trimmed.is_empty() {
        return Some(PathBuf::new());
    }
    trimmed
        .split('/')
        .all(valid_component)
        .then(|| PathBuf::from(trimmed))
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
                slot.is_some_and(|i| hierarchies[i].v2)
            })
            .filter_map(|c| c.v2_name())
            .collect();
        Cgroups {
            layout: Arc::new(Layout {
                parent,
                hierarchies,
                at,
                v2_enable,
            }),
        }
    }

    /// `V2` when the memory controller is on cgroup v2, else `V1`.
    pub fn version(&self) -> CgroupVersion {
        let l = &self.layout;
        match l.at.memory {
            Some(i) if l.hierarchies[i].v2 => CgroupVersion::V2,
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
            fs::create_dir_all(&dir).map_err(|source| CgroupError::Mkdir { path: dir, source })?;
        }
        let cg = self.open(sandbox_id);
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
                None => return Ok(()),
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
    fn dir(&self, h: usize) -> PathBuf {
        let l = &self.layout;
        l.hierarchies[h].mount.join(&l.parent).join(&self.id)
    }

    fn dirs(&self) -> impl Iterator<Item = PathBuf> + '_ {
        (0..self.layout.hierarchies.len()).map(|i| self.dir(i))
    }

    fn is_v2(&self, h: usize) -> bool {
        self.layout.hierarchies[h].v2
    }

    /// Every hierarchy's `cgroup.procs` of this cgroup: the sandbox's setup process writes
    /// "0" to each to join before it starts anything.
    pub fn procs_files(&self) -> Vec<PathBuf> {
        self.dirs().map(|d| d.join("cgroup.procs")).collect()
    }

    /// Moves `pid` (the whole process) into this cgroup in every hierarchy. Errors: `Join`
    /// with the procs file the kernel refused (the process is gone: `ESRCH`).
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

    /// Applies `limits` (see [`Cgroups::create`]); also what a warm sandbox taken for a
    /// request with other limits needs. Errors: `Write` with the file the kernel refused.
    pub fn set_limits(&self, limits: &Limits) -> Result<(), CgroupError> {
        let at = self.layout.at.clone();
        if let Some(h) = at.cpu {
            self.set_cpu(h, limits)?;
        }
        if let Some(h) = at.memory {
            self.set_memory(h, limits.memory_mb)?;
        }
        if let Some(h) = at.pids {
            let v = if limits.pids_max > 0 {
                limits.pids_max.to_string()
            } else {
                "max".into()
            };
            write_file(&self.dir(h).join("pids.max"), &v)?;
        }
        Ok(())
    }

    fn set_cpu(&self, h: usize, limits: &Limits) -> Result<(), CgroupError> {
        let dir = self.dir(h);
        let quota = (limits.cpu_cores.is_finite() && limits.cpu_cores > 0.0).then(|| {
            ((limits.cpu_cores * CPU_PERIOD_US as f64).round() as i64).max(CPU_MIN_QUOTA_US)
        });
        if self.is_v2(h) {
            let q = quota.map_or("max".to_string(), |q| q.to_string());
            write_file(&dir.join("cpu.max"), &format!("{q} {CPU_PERIOD_US}"))?;
            let idle = if limits.idle { "1" } else { "0" };
            if !write_if_present(&dir.join("cpu.idle"), idle)? {
                // Kernels before 5.15: the lowest weight is the closest to idle.
                let weight = if limits.idle { "1" } else { "100" };
                write_if_present(&dir.join("cpu.weight"), weight)?;
            }
        } else {
            write_file(&dir.join("cpu.cfs_period_us"), &CPU_PERIOD_US.to_string())?;
            write_file(
                &dir.join("cpu.cfs_quota_us"),
                &quota.unwrap_or(-1).to_string(),
            )?;
            let shares = if limits.idle { "2" } else { "1024" };
            write_file(&dir.join("cpu.shares"), shares)?;
        }
        Ok(())
    }

    fn set_memory(&self, h: usize, memory_mb: i64) -> Result<(), CgroupError> {
        let dir = self.dir(h);
        let bytes = (memory_mb > 0).then(|| memory_mb.saturating_mul(1 << 20));
        if self.is_v2(h) {
            let v = bytes.map_or("max".to_string(), |b| b.to_string());
            write_file(&dir.join("memory.max"), &v)?;
            write_if_present(&dir.join("memory.swap.max"), "0")?;
            return Ok(());
        }
        let v = bytes.unwrap_or(-1).to_string();
        let limit = dir.join("memory.limit_in_bytes");
        let memsw = dir.join("memory.memsw.limit_in_bytes");
        // memsw must stay >= the memory limit: lowering goes limit first, raising memsw
        // first. Try the first order; EINVAL means it was a raise.
        match write_raw(&limit, &v) {
            Ok(()) => {
                write_if_present(&memsw, &v)?;
            }
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) && memsw.exists() => {
                write_file(&memsw, &v)?;
                write_file(&limit, &v)?;
            }
            Err(source) => {
                return Err(CgroupError::Write {
                    path: limit,
                    value: v,
                    source,
                })
            }
        }
        // The OOM killer must act in the sandbox (not hang it at the limit).
        write_if_present(&dir.join("memory.oom_control"), "0")?;
        Ok(())
    }

    /// Freezes every process of the sandbox and returns once the kernel reports the cgroup
    /// frozen. Errors: `NoFreezer`, `Write`, or `FreezeTimeout` after about 2 s (the cgroup
    /// is thawed again then).
    pub fn freeze(&self) -> Result<(), CgroupError> {
        self.freeze_within(FREEZE_TIMEOUT)
    }

    fn freeze_within(&self, timeout: Duration) -> Result<(), CgroupError> {
        let (dir, v2) = self.freezer()?;
        let (file, value) = if v2 {
            (dir.join("cgroup.freeze"), "1")
        } else {
            (dir.join("freezer.state"), "FROZEN")
        };
        write_file(&file, value)?;
        let start = Instant::now();
        let mut pause = Duration::from_micros(200);
        loop {
            if self.frozen() {
                return Ok(());
            }
            if start.elapsed() >= timeout {
                let _ = self.thaw();
                return Err(CgroupError::FreezeTimeout {
                    path: dir,
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(20));
        }
    }

    /// Lets the sandbox's processes run again. Errors: `NoFreezer`, `Write`.
    pub fn thaw(&self) -> Result<(), CgroupError> {
        let (dir, v2) = self.freezer()?;
        if v2 {
            write_file(&dir.join("cgroup.freeze"), "0")
        } else {
            write_file(&dir.join("freezer.state"), "THAWED")
        }
    }

    /// Whether the kernel reports the cgroup frozen (not merely freezing).
    pub fn frozen(&self) -> bool {
        let Ok((dir, v2)) = self.freezer() else {
            return false;
        };
        if v2 {
            fs::read_to_string(dir.join("cgroup.events"))
                .is_ok_and(|s| keyed_value(&s, "frozen") == Some(1))
        } else {
            fs::read_to_string(dir.join("freezer.state")).is_ok_and(|s| s.trim() == "FROZEN")
        }
    }

    fn freezer(&self) -> Result<(PathBuf, bool), CgroupError> {
        match self.layout.at.freezer {
            Some(h) => Ok((self.dir(h), self.is_v2(h))),
            None => Err(CgroupError::NoFreezer {
                path: self.dirs().next().unwrap_or_default(),
            }),
        }
    }

    /// Kills every process in the cgroup and waits (bounded) until it is empty. Uses v2
    /// `cgroup.kill` where there is one; else freezes (so nothing forks or exits meanwhile
    /// and no pid is reused), sends SIGKILL to every member, and thaws so they can die; this
    /// also works on a paused sandbox. Errors: `Signal`, or `KillTimeout` after about 5 s.
    pub fn kill_all(&self) -> Result<(), CgroupError> {
        let start = Instant::now();
        let kill_file = (0..self.layout.hierarchies.len())
            .filter(|h| self.is_v2(*h))
            .map(|h| self.dir(h).join("cgroup.kill"))
            .find(|p| p.exists());
        let mut pause = Duration::from_micros(500);
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                return Ok(());
            }
            if start.elapsed() >= KILL_TIMEOUT {
                return Err(CgroupError::KillTimeout {
                    path: self.dirs().next().unwrap_or_default(),
                    left: pids.len(),
                    waited_ms: start.elapsed().as_millis() as u64,
                });
            }
            match &kill_file {
                Some(f) => write_file(f, "1")?,
                None => self.signal_all()?,
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    fn signal_all(&self) -> Result<(), CgroupError> {
        let has_freezer = self.layout.at.freezer.is_some();
        if has_freezer && !self.frozen() {
            // Best effort: a task stuck in the kernel may keep it FREEZING; kill anyway.
            let _ = self.freeze_within(Duration::from_millis(200));
        }
        for pid in self.pids() {
            let Ok(raw) = i32::try_from(pid) else {
                continue;
            };
            match kill(Pid::from_raw(raw), Signal::SIGKILL) {
                Ok(()) | Err(nix::errno::Errno::ESRCH) => {}
                Err(source) => {
                    return Err(CgroupError::Signal {
                        pid,
                        path: self.dirs().next().unwrap_or_default(),
                        source,
                    })
                }
            }
        }
        if has_freezer {
            // Frozen tasks die only once thawed.
            self.thaw()?;
        }
        Ok(())
    }

    /// Removes the cgroup (and any cgroups the sandbox made below it) in every hierarchy,
    /// killing what still runs in it first. A cgroup that is not there is fine. Errors:
    /// those of [`kill_all`](Self::kill_all), and `Remove` with the directory.
    pub fn remove(&self) -> Result<(), CgroupError> {
        if !self.pids().is_empty() {
            self.kill_all()?;
        }
        for dir in self.dirs() {
            remove_tree(&dir)?;
        }
        tracing::debug!(sandbox_id = %self.id, "cgroup removed");
        Ok(())
    }

    /// Throttles the sandbox's I/O on the block device `major:minor` (its loop device): v2
    /// `io.max`, v1 `blkio.throttle.*`; 0 in `io` removes that limit. Errors:
    /// `NoController` without an io/blkio controller, `Write`.
    pub fn set_disk_io(&self, major: u32, minor: u32, io: &DiskIo) -> Result<(), CgroupError> {
        let h = self
            .layout
            .at
            .io
            .ok_or(CgroupError::NoController { controller: "io" })?;
        let dir = self.dir(h);
        let bps = |mb: i64| (mb > 0).then(|| mb.saturating_mul(1 << 20));
        let ops = |n: i64| (n > 0).then_some(n);
        let vals = [
            ("rbps", "read_bps_device", bps(io.read_mbps)),
            ("wbps", "write_bps_device", bps(io.write_mbps)),
            ("riops", "read_iops_device", ops(io.read_iops)),
            ("wiops", "write_iops_device", ops(io.write_iops)),
        ];
        if self.is_v2(h) {
            let parts: Vec<String> = vals
                .iter()
                .map(|(k, _, v)| format!("{k}={}", v.map_or("max".into(), |v| v.to_string())))
                .collect();
            write_file(
                &dir.join("io.max"),
                &format!("{major}:{minor} {}", parts.join(" ")),
            )
        } else {
            for (_, file, v) in vals {
                write_file(
                    &dir.join(format!("blkio.throttle.{file}")),
                    &format!("{major}:{minor} {}", v.unwrap_or(0)),
                )?;
            }
            Ok(())
        }
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
        fs::read_to_string(self.dir(h).join(file))
            .ok()
            .and_then(|s| keyed_value(&s, "oom_kill"))
            .unwrap_or(0)
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

/// Removes a cgroup directory and the cgroups below it, deepest first. Control files
/// cannot (and need not) be removed: rmdir of a cgroup takes them along. Retries briefly
/// while the kernel still counts exiting tasks (`EBUSY`).
fn remove_tree(dir: &Path) -> Result<(), CgroupError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(source) => {
            return Err(CgroupError::Remove {
                path: dir.to_path_buf(),
                source,
            })
        }
    };
    for e in entries.flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            remove_tree(&e.path())?;
        }
    }
    let start = Instant::now();
    loop {
        match fs::remove_dir(dir) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && start.elapsed() < RMDIR_TIMEOUT => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(source) => {
                return Err(CgroupError::Remove {
                    path: dir.to_path_buf(),
                    source,
                })
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
