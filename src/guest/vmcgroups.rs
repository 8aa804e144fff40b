//! A microVM's cgroups (docs/microvm.md "Cgroups in the guest"): aether, the guest's PID 1,
//! makes in the guest kernel's cgroup v2 hierarchy the split a container's setup makes on
//! the host (docs/architecture.md "Cgroups"):
//!
//! ```text
//! /            the guest's root cgroup: the kernel's threads
//! ├── agent/   aether and every chronus: cpu.weight 10000, pids.max 512
//! └── workload/  pids.max = pids_max, memory.max = the guest's memory less the agents' reserve
//!     ├── procs/ the process API's processes
//!     └── s<N>/  one per session, made by aether as in a container
//! ```
//!
//! aether keeps `workload/` and `workload/procs/cgroup.procs` open from a mount of its
//! own, then detaches that mount: the sandbox sees the hierarchy read-only at
//! `/sys/fs/cgroup`, as in a container. The guest's root can remount it (it is root of the
//! guest kernel, docs/microvm.md "In the guest"); the split is there so that one session's
//! fork bomb leaves the agents and the other sessions room, not to hold the guest's root.

use std::os::fd::OwnedFd;
use std::path::Path;

use nix::fcntl::{open, OFlag};
use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sys::stat::Mode;

use crate::backends::container::cgroup::{
    pids_value, session_memory_mb, session_pids_max, workload_memory_mb, AGENT, AGENT_CPU_WEIGHT,
    AGENT_PIDS_MAX, PROCS, WORKLOAD,
};

/// Where the sandbox sees the hierarchy (read-only).
pub const MOUNT: &str = "/sys/fs/cgroup";
/// Where aether mounts it writable while it makes the split; detached after.
const PRIVATE: &str = "/run/opendsec/.cgroup";
/// The controllers the split uses, where the guest kernel has them.
const CONTROLLERS: &[&str] = &["cpu", "pids", "memory"];

/// What went wrong making the guest's cgroups.
#[derive(Debug, thiserror::Error)]
pub enum VmCgroupError {
    #[error("{what}: {source}")]
    Step { what: String, source: nix::Error },
    #[error("{path}: {source}")]
    File {
        path: String,
        source: std::io::Error,
    },
}

fn step(what: impl Into<String>) -> impl FnOnce(nix::Error) -> VmCgroupError {
    let what = what.into();
    move |source| VmCgroupError::Step { what, source }
}

fn write(path: &Path, value: &str) -> Result<(), VmCgroupError> {
    std::fs::write(path, value).map_err(|source| VmCgroupError::File {
        path: path.display().to_string(),
        source,
    })
}

fn mkdir(path: &Path) -> Result<(), VmCgroupError> {
    match std::fs::create_dir(path) {
        Err(e) if e.kind() != std::io::ErrorKind::AlreadyExists => Err(VmCgroupError::File {
            path: path.display().to_string(),
            source: e,
        }),
        _ => Ok(()),
    }
}

/// The guest's split, made: what aether's config takes.
#[derive(Debug)]
pub struct GuestCgroups {
    /// `workload/`, open on a mount no process in the guest can reach.
    pub workload: OwnedFd,
    /// `workload/procs/cgroup.procs`, open for writing.
    pub procs: OwnedFd,
    /// The `workload/` directory as the sandbox sees it, where OOM kills are counted.
    pub workload_dir: String,
    /// Each session's `pids.max` (0: none) and memory limit in bytes (0: none).
    pub session_pids_max: i64,
    pub session_memory_max: i64,
}

/// The memory the guest kernel offers (MiB), from `/proc/meminfo`'s MemTotal (0: unread).
fn guest_memory_mb() -> i64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.split_whitespace().next())
                .and_then(|kb| kb.parse::<i64>().ok())
        })
        .map_or(0, |kb| kb >> 10)
}

/// The limits the split writes for a sandbox of `pids_max` (0: none) in a guest of
/// `memory_mb` (0: unknown, none written): `(file below the root, value)`, in order,
/// for the controllers in `have`.
fn limit_writes(pids_max: i64, memory_mb: i64, have: &[&str]) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if have.contains(&"cpu") {
        out.push((format!("{AGENT}/cpu.weight"), AGENT_CPU_WEIGHT.to_string()));
    }
    if have.contains(&"pids") {
        out.push((format!("{AGENT}/pids.max"), AGENT_PIDS_MAX.to_string()));
        out.push((format!("{WORKLOAD}/pids.max"), pids_value(pids_max)));
        out.push((
            format!("{WORKLOAD}/{PROCS}/pids.max"),
            pids_value(session_pids_max(pids_max)),
        ));
    }
    let w = workload_memory_mb(memory_mb);
    if have.contains(&"memory") && w > 0 {
        out.push((
            format!("{WORKLOAD}/memory.max"),
            w.saturating_mul(1 << 20).to_string(),
        ));
    }
    out
}

/// Makes the split for a sandbox of `pids_max` and moves aether into `agent/`; then
/// shows the hierarchy read-only at [`MOUNT`]. aether must be the guest's PID 1 with its
/// root's capabilities. Errors: the step that failed; aether then reports it and powers
/// the VM off.
pub fn setup(pids_max: i64) -> Result<GuestCgroups, VmCgroupError> {
    let private = Path::new(PRIVATE);
    mkdir(private)?;
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount(
        Some("cgroup2"),
        private,
        Some("cgroup2"),
        flags,
        None::<&str>,
    )
    .map_err(step("mounting cgroup2"))?;
    let made = split(private, pids_max);
    // The sandbox's view, read-only; then the writable mount goes, whatever happened.
    let shown = match &made {
        Ok(_) => show(private, flags),
        Err(_) => Ok(()),
    };
    // A writable mount left behind would let any process of the guest rewrite the split.
    let gone = umount2(private, MntFlags::MNT_DETACH).map_err(step("detaching cgroup2"));
    let _ = std::fs::remove_dir(private);
    shown?;
    gone?;
    made
}

/// Binds the hierarchy mounted at `private` on [`MOUNT`], read-only.
fn show(private: &Path, flags: MsFlags) -> Result<(), VmCgroupError> {
    mount(
        Some(private),
        MOUNT,
        None::<&str>,
        MsFlags::MS_BIND,
        None::<&str>,
    )
    .map_err(step(format!("binding the hierarchy on {MOUNT}")))?;
    mount(
        None::<&str>,
        MOUNT,
        None::<&str>,
        MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | flags,
        None::<&str>,
    )
    .map_err(step(format!("making {MOUNT} read-only")))
}

/// The split below `root` (the writable mount), aether moved into `agent/`, and the open
/// `workload/` files.
fn split(root: &Path, pids_max: i64) -> Result<GuestCgroups, VmCgroupError> {
    let available = std::fs::read_to_string(root.join("cgroup.controllers")).map_err(|source| {
        VmCgroupError::File {
            path: root.join("cgroup.controllers").display().to_string(),
            source,
        }
    })?;
    let have: Vec<&str> = CONTROLLERS
        .iter()
        .copied()
        .filter(|c| available.split_whitespace().any(|a| a == *c))
        .collect();
    let enable: String = have
        .iter()
        .map(|c| format!("+{c}"))
        .collect::<Vec<_>>()
        .join(" ");
    for d in [AGENT, WORKLOAD] {
        mkdir(&root.join(d))?;
    }
    // aether's own cgroup first: no process of the workload ever runs where it does.
    write(&root.join(AGENT).join("cgroup.procs"), "0")?;
    if !enable.is_empty() {
        write(&root.join("cgroup.subtree_control"), &enable)?;
        write(&root.join(WORKLOAD).join("cgroup.subtree_control"), &enable)?;
    }
    mkdir(&root.join(WORKLOAD).join(PROCS))?;
    let memory_mb = guest_memory_mb();
    for (file, value) in limit_writes(pids_max, memory_mb, &have) {
        write(&root.join(file), &value)?;
    }
    let workload = open(
        &root.join(WORKLOAD),
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(step("opening workload/"))?;
    let procs = open(
        &root.join(WORKLOAD).join(PROCS).join("cgroup.procs"),
        OFlag::O_WRONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .map_err(step("opening workload/procs/cgroup.procs"))?;
    let has_memory = have.contains(&"memory");
    Ok(GuestCgroups {
        workload,
        procs,
        workload_dir: format!("{MOUNT}/{WORKLOAD}"),
        session_pids_max: if have.contains(&"pids") {
            session_pids_max(pids_max)
        } else {
            0
        },
        session_memory_max: if has_memory {
            session_memory_mb(memory_mb).saturating_mul(1 << 20)
        } else {
            0
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_s_limits_follow_the_sandbox_and_the_guest_s_memory() {
        let all = limit_writes(4096, 1024, &["cpu", "pids", "memory"]);
        let get = |f: &str| {
            all.iter()
                .find(|(k, _)| k == f)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        assert_eq!(get("agent/cpu.weight"), "10000");
        assert_eq!(get("agent/pids.max"), "512");
        assert_eq!(get("workload/pids.max"), "4096");
        assert_eq!(get("workload/procs/pids.max"), "4032");
        // 1024 MiB less the agents' reserve of 32 MiB.
        assert_eq!(get("workload/memory.max"), (992u64 << 20).to_string());
        // No limit given: none written; a controller the kernel lacks: nothing for it.
        let none = limit_writes(0, 0, &["pids"]);
        assert_eq!(
            none,
            vec![
                ("agent/pids.max".to_string(), "512".to_string()),
                ("workload/pids.max".to_string(), "max".to_string()),
                ("workload/procs/pids.max".to_string(), "max".to_string()),
            ]
        );
    }
}
