//! Pausing and ending a sandbox's processes: the freezer, killing every member, and
//! removing the cgroup.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::{keyed_value, write_file, CgroupError, SandboxCgroup};

/// How long `freeze` waits for the kernel to report FROZEN.
const FREEZE_TIMEOUT: Duration = Duration::from_secs(2);
/// How long one freeze of `kill_all` waits for FROZEN before killing anyway.
const FREEZE_IN_KILL: Duration = Duration::from_millis(1000);
/// How long `kill_all` waits for the cgroup to empty while a process in it is not yet
/// exiting (it escaped the signal, or the kernel has not got to it).
const KILL_TIMEOUT: Duration = Duration::from_secs(5);
/// How long `kill_all` waits for processes that are already exiting: nothing can stop them
/// now, but the last one out tears down the sandbox's namespaces and mounts (overlay, ext4
/// on its loop device), which a burst of thousands of stops at once queues in the kernel
/// for many seconds (bench/burst.sh, docs/benchmarks.md).
const EXIT_TIMEOUT: Duration = Duration::from_secs(120);
/// `PF_EXITING` in `/proc/<pid>/stat`'s flags: the task is in `do_exit`.
const PF_EXITING: u64 = 0x4;
/// How long `remove` retries an rmdir that finds the cgroup still busy (exiting tasks).
const RMDIR_TIMEOUT: Duration = Duration::from_secs(1);

impl SandboxCgroup {
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

    /// Kills every process in the cgroup and waits (bounded) until it is empty; works on a
    /// paused sandbox and wins against a fork bomb. v2 `cgroup.kill` where there is one
    /// (the kernel also kills what is forked meanwhile); else freeze, SIGKILL every member,
    /// thaw: once the freezer reports FROZEN nothing forks or exits, so the pid list read
    /// then is complete and no pid in it is reused; frozen tasks die when thawed. After the
    /// first kill the sandbox's CPU quota and idleness are lifted: a killed task still has
    /// to run to exit. Errors: `Signal`, or `KillTimeout` after about 5 s from the first
    /// kill while a process is not yet exiting, or after about 120 s while all that are left
    /// are exiting (their namespaces' teardown).
    pub fn kill_all(&self) -> Result<(), CgroupError> {
        self.kill_all_within(KILL_TIMEOUT, EXIT_TIMEOUT)
    }

    /// [`kill_all`](Self::kill_all) with its two deadlines: `live` while a process left is
    /// not exiting, `exiting` while all are.
    pub(super) fn kill_all_within(
        &self,
        live: Duration,
        exiting: Duration,
    ) -> Result<(), CgroupError> {
        if self.pids().is_empty() {
            return Ok(());
        }
        let kill_file = (0..self.layout.hierarchies.len())
            .filter(|h| self.is_v2(*h))
            .map(|h| self.dir(h).join("cgroup.kill"))
            .find(|p| p.exists());
        // The deadlines count from the first kill, once the quota is lifted: in a burst of
        // thousands of stops, lifting it (the kernel walks every CPU cgroup under one lock)
        // took longer than the whole first deadline, which then ran out before a single
        // SIGKILL had been sent and left the sandbox running.
        let mut start: Option<Instant> = None;
        let mut pause = Duration::from_micros(500);
        loop {
            let pids = self.pids();
            if pids.is_empty() {
                return Ok(());
            }
            let waited = start.map(|s| s.elapsed()).unwrap_or_default();
            if start.is_some()
                && waited >= live
                && (waited >= exiting || !pids.iter().all(|p| is_exiting(*p)))
            {
                let start = start.unwrap_or_else(Instant::now);
                return Err(CgroupError::KillTimeout {
                    path: self.dirs().next().unwrap_or_default(),
                    left: pids.len(),
                    waited_ms: start.elapsed().as_millis() as u64,
                    states: pids
                        .iter()
                        .take(4)
                        .map(|p| describe(*p))
                        .collect::<Vec<_>>()
                        .join(" "),
                });
            }
            match &kill_file {
                Some(f) => write_file(f, "1")?,
                None => self.freeze_kill_thaw()?,
            }
            if start.is_none() {
                // Killed tasks still have to run to exit: behind a 0.1-core quota thousands
                // of them take many seconds.
                self.release_cpu();
                start = Some(Instant::now());
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_millis(50));
        }
    }

    /// Lets every task of the sandbox run at full speed (no quota, not idle), so that
    /// killed tasks exit at once. Best effort: a sandbox that is being killed has no use
    /// for its limits, and a failure here only makes the kill slower.
    fn release_cpu(&self) {
        let Some(h) = self.layout.at.cpu else {
            return;
        };
        let dir = self.dir(h);
        if self.is_v2(h) {
            let _ = write_file(&dir.join("cpu.max"), "max");
            let _ = super::write_if_present(&dir.join("cpu.idle"), "0");
        } else {
            let _ = write_file(&dir.join("cpu.cfs_quota_us"), "-1");
            let _ = super::write_if_present(&dir.join("cpu.idle"), "0");
            let _ = write_file(&dir.join("cpu.shares"), "1024");
        }
    }

    /// One round of freeze, SIGKILL every member, thaw (see [`kill_all`](Self::kill_all)).
    fn freeze_kill_thaw(&self) -> Result<(), CgroupError> {
        let has_freezer = self.layout.at.freezer.is_some();
        if has_freezer && !self.frozen() {
            // A task stuck in the kernel may keep it FREEZING: then kill what is there
            // anyway, and the next round catches what was forked meanwhile.
            let _ = self.freeze_within(FREEZE_IN_KILL);
        }
        let signalled = self.signal_all();
        if has_freezer {
            // Frozen tasks die only once thawed; thaw even when a signal failed.
            self.thaw()?;
        }
        signalled
    }

    fn signal_all(&self) -> Result<(), CgroupError> {
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
}

/// Whether process `pid` (of the host's pid namespace) is dying: in `do_exit`, gone, or
/// with a SIGKILL pending (it dies as soon as it gets a CPU, which in a burst of thousands
/// of stops takes seconds). A signal has nothing left to do to it.
fn is_exiting(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return true;
    };
    // "pid (comm) state ppid pgrp session tty_nr tpgid flags ...": comm may hold any byte,
    // so the fields are counted from the last ')'.
    let flags = stat
        .rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(6))
        .and_then(|f| f.parse::<u64>().ok());
    if flags.is_some_and(|f| f & PF_EXITING != 0) {
        return true;
    }
    fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|st| sigkill_pending(&st))
}

/// `pid:state:flags:pending` of a process that would not die: its state letter and flags
/// (hex) from /proc/<pid>/stat, and whether SIGKILL is pending; `pid:gone` once it is gone.
fn describe(pid: u32) -> String {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return format!("{pid}:gone");
    };
    let mut rest = stat
        .rsplit_once(')')
        .map(|(_, r)| r.split_whitespace())
        .into_iter()
        .flatten();
    let state = rest.next().unwrap_or("?").to_string();
    let flags = rest
        .nth(5)
        .and_then(|f| f.parse::<u64>().ok())
        .unwrap_or_default();
    let pending =
        fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|st| sigkill_pending(&st));
    format!(
        "{pid}:{state}:{flags:x}:{}",
        if pending { "kill" } else { "-" }
    )
}

/// Whether a `/proc/<pid>/status` text shows SIGKILL pending, for the thread (`SigPnd`) or
/// the whole process (`ShdPnd`): bit 9 − 1 of the hex masks.
fn sigkill_pending(status: &str) -> bool {
    const SIGKILL_BIT: u64 = 1 << (libc::SIGKILL - 1);
    status
        .lines()
        .filter_map(|l| {
            l.strip_prefix("SigPnd:")
                .or_else(|| l.strip_prefix("ShdPnd:"))
        })
        .filter_map(|v| u64::from_str_radix(v.trim(), 16).ok())
        .any(|m| m & SIGKILL_BIT != 0)
}

/// Removes a cgroup directory and the cgroups below it, deepest first. Control files
/// cannot (and need not) be removed: rmdir of a cgroup takes them along. Retries briefly
/// while the kernel still counts exiting tasks (`EBUSY`).
pub(super) fn remove_tree(dir: &Path) -> Result<(), CgroupError> {
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

#[cfg(test)]
mod tests {
    use super::sigkill_pending;

    #[test]
    fn a_pending_sigkill_is_read_from_either_mask() {
        let status = |sig: &str, shd: &str| {
            format!("Name:\tsleep\nState:\tR (running)\nSigPnd:\t{sig}\nShdPnd:\t{shd}\nSigBlk:\t0000000000000100\n")
        };
        assert!(!sigkill_pending(&status(
            "0000000000000000",
            "0000000000000000"
        )));
        assert!(sigkill_pending(&status(
            "0000000000000000",
            "0000000000000100"
        )));
        assert!(sigkill_pending(&status(
            "0000000000000100",
            "0000000000000000"
        )));
        // SIGTERM (bit 14) pending is not SIGKILL; a blocked SIGKILL mask is not pending.
        assert!(!sigkill_pending(&status(
            "0000000000004000",
            "0000000000004000"
        )));
        assert!(!sigkill_pending("garbage"));
    }
}
