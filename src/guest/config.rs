//! What the container setup (or a VM's init) hands aether: a JSON file named by
//! `opendsec aether --config PATH`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Where the agent executable appears inside every sandbox: bound read-only there in a
/// container, on the read-only agent disk mounted at [`AGENT_DIR`] in a microVM.
pub const AGENT_PATH: &str = "/run/opendsec/bin/opendsec";
/// The directory of [`AGENT_PATH`] (a microVM's agent disk is mounted there).
pub const AGENT_DIR: &str = "/run/opendsec/bin";
/// The agent's file name in [`AGENT_DIR`].
pub const AGENT_FILE: &str = "opendsec";

/// aether's start-up configuration (`/run/opendsec/aether.json` in containers).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AetherConfig {
    /// The sandbox's id, for logs.
    pub sandbox_id: String,
    /// An inherited, already listening unix socket (containers: fd 3, bound by the setup
    /// process on the host side, so the sandbox cannot replace the socket file).
    pub listen_fd: Option<i32>,
    /// Otherwise a path to bind and listen on (tests, VMs).
    pub socket: String,
    /// Where sessions keep their sockets and output records (a tmpfs, root-owned).
    pub run_dir: String,
    /// The executable to start chronus from (the read-only agent binary).
    pub agent: String,
    /// The sandbox's default user (`init_user`): a name or `uid[:gid]`; "" = root.
    pub init_user: String,
    /// The image's environment, the base of every session's and process's environment.
    pub env: BTreeMap<String, String>,
    /// The image's working directory, the default cwd ("" = the user's home, else `/`).
    pub workdir: String,
    /// True when aether is PID 1 of its pid namespace: it reaps orphans and, on SIGTERM,
    /// ends every process of the sandbox.
    pub pid1: bool,
    /// Lower the OOM score of aether itself (-1000) where the kernel allows, and give
    /// session shells and processes a higher one, so the OOM killer takes the sandbox's
    /// processes and not the agents.
    pub protect_from_oom: bool,
    /// The sandbox's disk size in MB, named when a write finds it full (0: unknown).
    pub disk_mb: u64,
    /// The sandbox's own cgroup as mounted inside it (containers: /sys/fs/cgroup), where
    /// chronus counts OOM kills for `ShellResult.oom_killed`; "" = none.
    pub cgroup_dir: String,
    /// Inherited fds of a cgroup's `cgroup.procs` (or v1 `tasks`), one per split cgroup
    /// hierarchy, opened for writing outside the sandbox (inside, the cgroup tree is
    /// read-only). aether's are the process API's (`workload/procs/`): it moves every
    /// process it starts there before the exec. The copy of the config a chronus gets names
    /// that session's own cgroup (`workload/s<N>/`), which its shell joins before its exec;
    /// so the workload never shares the agents' cgroup (docs/architecture.md "Cgroups").
    /// In a microVM aether opens them itself (docs/microvm.md "Cgroups in the guest").
    /// Empty outside sandboxes.
    pub workload_cgroup_fds: Vec<i32>,
    /// Inherited directory fds of the sandbox's `workload/` cgroup, in the same hierarchies
    /// and order, where aether makes each session's cgroup when the session starts. Empty
    /// where sessions get no cgroup of their own (then their shells join the
    /// `workload_cgroup_fds`); never passed to chronus.
    pub workload_cgroup_dir_fds: Vec<i32>,
    /// The memory limit in bytes aether gives each session's cgroup (0: none written): a
    /// little less than the workload's, so one session's fork bomb leaves the others room.
    #[serde(default)]
    pub session_memory_max: i64,
    /// In the copy of the config a chronus gets: an inherited directory fd of its session's
    /// cgroup (`workload/s<N>/`, in the hierarchy with `cgroup.kill` or `pids.max`), where
    /// it makes each command's own cgroup `c<id>` so that a timeout kills the whole command
    /// (docs/sessions.md "Timeouts"). `None`: commands share the session's cgroup.
    pub command_cgroup_dir_fd: Option<i32>,
    /// The `pids.max` aether gives each session's cgroup (0: none written): a little less
    /// than the sandbox's `pids_max`, so one session's fork bomb leaves the others room.
    pub session_pids_max: i64,
    /// In the copy of the config a chronus gets: an inherited fd that signals when its
    /// session's memory cgroup runs out of memory, so that chronus kills everything the
    /// session runs but its shell (docs/sessions.md "Out of memory"). `None`: no memory
    /// cgroup of its own, or no way to watch it.
    pub session_oom_fd: Option<OomFd>,
}

/// How a session's out-of-memory events reach its chronus, with what tells a fresh event
/// from a stale one: both inherited fds of the session's memory cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct OomFd {
    pub kind: OomKind,
    /// The fd that signals an OOM (see [`OomKind`]).
    pub events: i32,
    /// The cgroup's memory use in bytes, open for reading: v1 `memory.usage_in_bytes`, v2
    /// `memory.current`. An event only counts while the use is still near the limit.
    pub usage: i32,
}

/// Which kind of fd [`OomFd::events`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OomKind {
    /// cgroup v1: an eventfd registered for the session's `memory.oom_control` through
    /// `cgroup.event_control`; each OOM adds to its count.
    Eventfd,
    /// cgroup v2: the session's `memory.events`, open for reading; the kernel flags it
    /// (`POLLPRI`) when a counter changes, and its `oom` and `oom_kill` lines count.
    MemoryEvents,
}

impl OomFd {
    /// The fd numbers, for inheriting them.
    pub fn fds(self) -> [i32; 2] {
        [self.events, self.usage]
    }
}

#[cfg(test)]
mod agent_path_tests {
    use super::*;

    #[test]
    fn the_agent_s_directory_and_name_make_its_path() {
        assert_eq!(format!("{AGENT_DIR}/{AGENT_FILE}"), AGENT_PATH);
    }
}
