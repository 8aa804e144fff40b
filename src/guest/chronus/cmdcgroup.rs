//! A cgroup per command below the session's own (`workload/s<N>/c<id>/`, one hierarchy:
//! the one with `cgroup.kill` or the pids controller), so that a command is killed whole
//! on its timeout: every process it started is in it, the orphans that left its process
//! tree and any process group or session it made included, and none of them can leave
//! (inside the sandbox the cgroup tree is read-only). See docs/sessions.md "Timeouts".
//!
//! A command's subshell is forked by the session's long-lived shell, so chronus moves the
//! shell into the command's cgroup just before it sends the command's line and back into
//! the session's cgroup once the shell reports the subshell's pid (that report is written
//! after the fork): the subshell is born in the command's cgroup and the shell spends only
//! that instant there, forking nothing else.
//!
//! Killing: v2's `cgroup.kill` where there is one; else `pids.max` 0 (nothing in the
//! cgroup can fork any more, so the members listed are all there will be), then SIGKILL to
//! each, pass after pass until none is left. On v2 without `cgroup.kill` (before Linux
//! 5.14) the cgroup is frozen while its members are signalled.

use std::collections::BTreeSet;
use std::os::fd::{OwnedFd, RawFd};
use std::sync::Mutex;

use nix::errno::Errno;
use nix::fcntl::{openat, OFlag};
use nix::sys::signal::{kill, Signal};
use nix::sys::stat::{mkdirat, Mode};
use nix::unistd::{unlinkat, Pid, UnlinkatFlags};

use super::session::lock;

/// The session cgroup's directory (of one hierarchy) and its own join file, where the
/// commands' cgroups are made.
pub struct CommandCgroups {
    dir: OwnedFd,
    /// `tasks` (v1) or `cgroup.procs` (v2) of the session's cgroup: the shell's way back.
    session_join: OwnedFd,
    v1: bool,
    /// Commands whose cgroup was made and the shell moved into it.
    entered: Mutex<BTreeSet<i64>>,
    /// Commands whose reported subshell was found in their cgroup: all of such a command
    /// is there, so killing the cgroup kills the command.
    verified: Mutex<BTreeSet<i64>>,
    /// Command cgroups that still held processes when their command ended (its own
    /// background processes, or killed ones not yet gone): removed once empty.
    left: Mutex<BTreeSet<i64>>,
}

/// Errors making a command's cgroup or moving the shell.
#[derive(Debug, thiserror::Error)]
pub enum CommandCgroupError {
    #[error("{step} command cgroup {name}")]
    Step {
        step: &'static str,
        name: String,
        #[source]
        source: Errno,
    },
}

impl CommandCgroups {
    /// Takes the inherited directory fd `fd` of the session's cgroup (aether's
    /// `command_cgroup_dir_fd`) and opens the session's own join file in it. Errors: the fd
    /// is not an open directory, or the join file cannot be opened.
    pub fn take(fd: RawFd) -> std::io::Result<CommandCgroups> {
        let dir = crate::sys::fd::take_dir(fd)?;
        let v1 = has(&dir, "tasks");
        let session_join = openat(
            &dir,
            if v1 { "tasks" } else { "cgroup.procs" },
            OFlag::O_WRONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(std::io::Error::from)?;
        Ok(CommandCgroups {
            dir,
            session_join,
            v1,
            entered: Mutex::new(BTreeSet::new()),
            verified: Mutex::new(BTreeSet::new()),
            left: Mutex::new(BTreeSet::new()),
        })
    }

    /// Makes command `id`'s cgroup and moves `shell` (the session's shell, single-threaded)
    /// into it, so that the next process it forks is born there. Errors: `Step` (the
    /// command then runs in the session's cgroup; nothing is left made).
    pub fn enter(&self, id: i64, shell: i32) -> Result<(), CommandCgroupError> {
        let name = name(id);
        let err = |step, source| CommandCgroupError::Step {
            step,
            name: name.clone(),
            source,
        };
        match mkdirat(&self.dir, name.as_str(), Mode::from_bits_truncate(0o755)) {
            Ok(()) | Err(Errno::EEXIST) => {}
            Err(e) => return Err(err("making", e)),
        }
        let join = format!("{name}/{}", if self.v1 { "tasks" } else { "cgroup.procs" });
        let moved = openat(
            &self.dir,
            join.as_str(),
            OFlag::O_WRONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| err("opening", e))
        .and_then(|f| {
            nix::unistd::write(&f, shell.to_string().as_bytes())
                .map(drop)
                .map_err(|e| err("moving the shell into", e))
        });
        match moved {
            Ok(()) => {
                lock(&self.entered).insert(id);
                Ok(())
            }
            Err(e) => {
                let _ = unlinkat(&self.dir, name.as_str(), UnlinkatFlags::RemoveDir);
                Err(e)
            }
        }
    }

    /// Whether `pid`, reported as command `id`'s subshell, is to be believed: `None` when
    /// the command has no cgroup (nothing to check against), else whether `pid` is in the
    /// command's cgroup, remembered when it is. A report that names another process
    /// (anything in the session may write to the control FIFO) is not believed; nor is the
    /// true one once the subshell has already ended, which costs nothing: its end report
    /// follows.
    pub fn adopt(&self, id: i64, pid: i32) -> Option<bool> {
        if !lock(&self.entered).contains(&id) {
            return None;
        }
        if !self.members(&name(id)).contains(&pid) {
            return Some(false);
        }
        lock(&self.verified).insert(id);
        Some(true)
    }

    /// Whether command `id`'s subshell was found in its cgroup (see [`adopt`](Self::adopt)).
    pub fn holds(&self, id: i64) -> bool {
        lock(&self.verified).contains(&id)
    }

    /// Moves `shell` back into the session's cgroup (after it forked the command's
    /// subshell, or when the command never started). Errors: `Step`.
    pub fn leave(&self, shell: i32) -> Result<(), CommandCgroupError> {
        nix::unistd::write(&self.session_join, shell.to_string().as_bytes())
            .map(drop)
            .map_err(|source| CommandCgroupError::Step {
                step: "moving the shell out of",
                name: "the session's".into(),
                source,
            })
    }

    /// One pass of killing everything in command `id`'s cgroup; returns how many processes
    /// it held (0: empty), `None` when the command has no cgroup. Processes forked
    /// meanwhile are caught by the next pass on v2 without `cgroup.kill` only; elsewhere
    /// none can be forked. The shell must be out of it first ([`leave`](Self::leave)).
    pub fn kill(&self, id: i64) -> Option<usize> {
        if !lock(&self.entered).contains(&id) {
            return None;
        }
        let name = name(id);
        if !self.v1 && self.write(&name, "cgroup.kill", "1") {
            return Some(self.members(&name).len());
        }
        let frozen = !self.v1 && self.write(&name, "cgroup.freeze", "1");
        if self.v1 {
            // pids.max 0: a fork in the cgroup fails from now on.
            self.write(&name, "pids.max", "0");
        }
        let pids = self.members(&name);
        for pid in &pids {
            // Never aether (1) nor a pid of another namespace (0).
            if *pid > 1 {
                let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
            }
        }
        if frozen {
            // Frozen tasks that got SIGKILL exit once thawed.
            self.write(&name, "cgroup.freeze", "0");
        }
        Some(pids.len())
    }

    /// Command `id` ended: removes its cgroup if it is empty, else keeps it to try again
    /// later; also removes the earlier ones that have emptied since.
    pub fn done(&self, id: i64) {
        if !lock(&self.entered).remove(&id) {
            return;
        }
        lock(&self.verified).remove(&id);
        let mut left = lock(&self.left);
        left.insert(id);
        left.retain(|id| !self.remove(*id));
    }

    /// Removes command `id`'s cgroup; `false` while it holds a process.
    fn remove(&self, id: i64) -> bool {
        match unlinkat(&self.dir, name(id).as_str(), UnlinkatFlags::RemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => true,
            Err(_) => false,
        }
    }

    /// The pids in command cgroup `name` (of chronus's pid namespace).
    fn members(&self, name: &str) -> Vec<i32> {
        let path = format!("{name}/cgroup.procs");
        let Ok(f) = openat(
            &self.dir,
            path.as_str(),
            OFlag::O_RDONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) else {
            return Vec::new();
        };
        let mut text = String::new();
        let _ = std::io::Read::read_to_string(&mut std::fs::File::from(f), &mut text);
        text.lines()
            .filter_map(|l| l.trim().parse::<i32>().ok())
            .collect()
    }

    /// Writes `value` to `name/file`; whether it was written (a file the kernel does not
    /// have is not).
    fn write(&self, name: &str, file: &str, value: &str) -> bool {
        let path = format!("{name}/{file}");
        openat(
            &self.dir,
            path.as_str(),
            OFlag::O_WRONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .and_then(|f| nix::unistd::write(&f, value.as_bytes()))
        .is_ok()
    }
}

fn name(id: i64) -> String {
    format!("c{id}")
}

fn has(dir: &OwnedFd, path: &str) -> bool {
    nix::sys::stat::fstatat(dir, path, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW).is_ok()
}
