//! OOM kills as chronus sees them: the sandbox's own cgroup, mounted read-only at
//! /sys/fs/cgroup inside the sandbox (docs/architecture.md, "A container sandbox"), counts the
//! processes the kernel's OOM killer ended. A command's `oom_killed` compares the count at
//! its start and at its end (see [`killed`]).
//!
//! Layouts: cgroup v2 alone (the sandbox's cgroup is /sys/fs/cgroup itself, `memory.events`),
//! and v1-hybrid (one directory per hierarchy, the memory controller's in
//! /sys/fs/cgroup/memory with `memory.oom_control`; on some hosts it is v2's, in
//! /sys/fs/cgroup/unified). The sandbox's processes may live in child cgroups (the agents'
//! and the workload's), so the counters of the whole subtree are summed.

use std::path::{Path, PathBuf};

/// Where the sandbox's cgroup is mounted inside it.
pub const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The cgroup directory this chronus counts in, set once at its start.
static ROOT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Sets where [`count`] looks (aether's `cgroup_dir`); "" leaves it unset: outside a
/// sandbox the host's counters say nothing about a session.
pub fn set_root(dir: &str) {
    if !dir.is_empty() {
        let _ = ROOT.set(PathBuf::from(dir));
    }
}

/// [`kills`] under the root set by [`set_root`], plus this chronus's own kills of its
/// session's commands on an OOM ([`super::oomkill`]: its SIGKILL may reach the process
/// before the kernel's does, which then counts nothing); `None` when no root was set.
pub fn count() -> Option<u64> {
    ROOT.get()
        .and_then(|r| kills(r))
        .map(|n| n + super::oomkill::kills())
}

/// How deep below the sandbox's cgroup counters are summed (bounds the walk).
const MAX_DEPTH: usize = 8;
/// Most cgroups read per count.
const MAX_CGROUPS: usize = 4096;

/// The OOM kills recorded in the memory hierarchy under `root` (normally
/// [`CGROUP_ROOT`]), or `None` where no counter is readable (no memory controller, an old
/// kernel, not in a sandbox).
pub fn kills(root: &Path) -> Option<u64> {
    for dir in [
        root.to_path_buf(),
        root.join("memory"),
        root.join("unified"),
    ] {
        if let Some(kind) = Counter::find(&dir) {
            let mut n = 0u64;
            let mut seen = 0usize;
            sum(&dir, kind, 0, &mut n, &mut seen);
            return Some(n);
        }
    }
    None
}

/// Whether the OOM killer ended a process of a command: the count rose while it ran
/// (`before`, `after` from [`kills`]) and the command ended by SIGKILL (exit code 137, as
/// the shell reports a child it lost that way). The count is the sandbox's, so a kill in
/// another session alone does not mark a command that ended otherwise; and a plain
/// `kill -9` leaves the count as it was.
pub fn killed(before: Option<u64>, after: Option<u64>, exit_code: i32) -> bool {
    const SIGKILLED: i32 = 128 + libc::SIGKILL;
    match (before, after) {
        (Some(b), Some(a)) => a > b && exit_code == SIGKILLED,
        _ => false,
    }
}

#[derive(Clone, Copy)]
enum Counter {
    /// v2, the cgroup's own events (`memory.events.local`, kernel 5.2 on).
    V2Local,
    /// v2 before 5.2: `memory.events` counted the cgroup's own events then.
    V2,
    /// v1 `memory.oom_control` (kernel 4.13 on), the cgroup's own kills.
    V1,
}

impl Counter {
    fn find(dir: &Path) -> Option<Counter> {
        [
            (Counter::V2Local, "memory.events.local"),
            (Counter::V1, "memory.oom_control"),
            (Counter::V2, "memory.events"),
        ]
        .into_iter()
        .find(|(_, f)| dir.join(f).is_file())
        .map(|(c, _)| c)
    }

    fn file(self) -> &'static str {
        match self {
            Counter::V2Local => "memory.events.local",
            Counter::V2 => "memory.events",
            Counter::V1 => "memory.oom_control",
        }
    }
}

/// Adds `dir`'s own count and its children's. Each file counts the kills of its own
/// cgroup only, so nothing is counted twice.
fn sum(dir: &Path, kind: Counter, depth: usize, n: &mut u64, seen: &mut usize) {
    if *seen >= MAX_CGROUPS {
        return;
    }
    *seen += 1;
    if let Ok(text) = std::fs::read_to_string(dir.join(kind.file())) {
        *n = n.saturating_add(oom_kill(&text).unwrap_or(0));
    }
    if depth >= MAX_DEPTH {
        return;
    }
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    let children: Vec<PathBuf> = rd
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
        .map(|e| e.path())
        .collect();
    for c in children {
        sum(&c, kind, depth + 1, n, seen);
    }
}

/// The `oom_kill N` line of a flat keyed file.
fn oom_kill(text: &str) -> Option<u64> {
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace();
        match (it.next(), it.next()) {
            (Some("oom_kill"), Some(v)) => v.parse().ok(),
            _ => None,
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn put(p: &Path, text: &str) {
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, text).unwrap();
    }

    #[test]
    fn v2_sums_the_subtree_of_local_counts() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        assert_eq!(kills(r), None);
        put(
            &r.join("memory.events"),
            "low 0\nhigh 0\nmax 3\noom 2\noom_kill 9\n",
        );
        put(&r.join("memory.events.local"), "oom 0\noom_kill 1\n");
        assert_eq!(kills(r), Some(1));
        put(&r.join("workload/memory.events.local"), "oom_kill 2\n");
        put(&r.join("agent/memory.events.local"), "oom_kill 0\n");
        put(&r.join("workload/x/memory.events.local"), "oom_kill 4\n");
        assert_eq!(kills(r), Some(7));
    }

    #[test]
    fn v1_hybrid_reads_oom_control_below_memory() {
        let d = tempfile::tempdir().unwrap();
        let r = d.path();
        std::fs::create_dir_all(r.join("pids")).unwrap();
        put(&r.join("unified/cgroup.procs"), "");
        put(
            &r.join("memory/memory.oom_control"),
            "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n",
        );
        assert_eq!(kills(r), Some(2));
        put(
            &r.join("memory/workload/memory.oom_control"),
            "oom_kill 3\n",
        );
        assert_eq!(kills(r), Some(5));
    }

    #[test]
    fn killed_needs_a_rise_and_sigkill() {
        assert!(killed(Some(1), Some(2), 137));
        assert!(!killed(Some(2), Some(2), 137), "plain kill -9");
        assert!(!killed(Some(1), Some(2), 0), "another command's kill");
        assert!(!killed(None, None, 137));
    }
}
