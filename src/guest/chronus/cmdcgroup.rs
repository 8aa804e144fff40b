//! A cgroup per command below the session's own (`workload/s<N>/c<n>/`, one hierarchy:
//! the one with `cgroup.kill` or the pids controller), so that a command is killed whole
//! on its timeout: every process it started is in it, the orphans that left its process
//! tree and any process group or session it made included, and none of them can leave
//! (inside the sandbox the cgroup tree is read-only). See docs/sessions.md "Timeouts".
//!
//! A command's subshell is forked by the session's long-lived shell, so the shell always
//! waits for its next command inside a fresh cgroup of its own (a "slot"): it joins the
//! first one between its fork and exec, and once it reports a command's subshell (that
//! report is written after the fork) a thread of chronus moves it on into the next slot,
//! while the command runs. The command keeps the slot it was forked in. Moving the shell
//! ahead of time keeps the kernel's cost of a cgroup move off the command's path: the
//! first move into a new cgroup after a quiet spell waits for an RCU grace period (about
//! 10 ms here, docs/benchmarks.md).
//!
//! Killing: v2's `cgroup.kill` where there is one; else `pids.max` 0 (nothing in the
//! cgroup can fork any more, so the members listed are all there will be), then SIGKILL to
//! each, pass after pass until none is left. On v2 without `cgroup.kill` (before Linux
//! 5.14) the cgroup is frozen while its members are signalled.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::{OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use nix::errno::Errno;
use nix::fcntl::{openat, OFlag};
use nix::sys::signal::{kill, Signal};
use nix::sys::stat::{mkdirat, Mode};
use nix::unistd::{unlinkat, Pid, UnlinkatFlags};
use tokio::sync::oneshot;

use super::session::lock;

/// The session cgroup's directory (of one hierarchy), where the commands' cgroups are made,
/// and which of them holds what.
pub struct CommandCgroups {
    dir: Arc<OwnedFd>,
    v1: bool,
    next: AtomicU64,
    /// The slot the shell waits in for its next command, once it is there.
    shell: Mutex<ShellSlot>,
    /// Commands, the slot each was forked in and the pid of the shell that forked it.
    entered: Mutex<BTreeMap<i64, (u64, i32)>>,
    /// Commands whose reported subshell was found in their slot: all of such a command is
    /// there, so killing the slot kills the command.
    verified: Mutex<BTreeSet<i64>>,
    /// The slot the shell last joined (0: none, it is in the session's cgroup): never
    /// killed, whatever command took it.
    shell_at: Arc<AtomicU64>,
    /// Slots whose command ended (or that the shell left unused), removed once empty by
    /// the thread that moves the shell on: an rmdir on the command's path would wait for
    /// the kernel's cgroup lock, which a concurrent move holds through an RCU grace period.
    left: Arc<Mutex<BTreeSet<u64>>>,
}

#[derive(Default)]
struct ShellSlot {
    /// The slot the shell is in and no command has taken yet.
    free: Option<u64>,
    /// A move of the shell into a new slot that has not been waited for: the slot, and
    /// whether the move worked.
    moving: Option<(u64, oneshot::Receiver<bool>)>,
}

impl CommandCgroups {
    /// Takes the inherited directory fd `fd` of the session's cgroup (aether's
    /// `command_cgroup_dir_fd`). Errors: the fd is not an open directory.
    pub fn take(fd: RawFd) -> std::io::Result<CommandCgroups> {
        let dir = crate::sys::fd::take_dir(fd)?;
        let v1 = has(&dir, "tasks");
        Ok(CommandCgroups {
            dir: Arc::new(dir),
            v1,
            next: AtomicU64::new(1),
            shell: Mutex::new(ShellSlot::default()),
            shell_at: Arc::new(AtomicU64::new(0)),
            entered: Mutex::new(BTreeMap::new()),
            verified: Mutex::new(BTreeSet::new()),
            left: Arc::new(Mutex::new(BTreeSet::new())),
        })
    }

    /// Makes a new slot for a shell about to be spawned and opens the file its child joins
    /// it through before the exec (`join_cgroups_at_exec`); [`placed`](Self::placed) once
    /// it runs. `None` when the slot cannot be made (the shell then waits in the session's
    /// cgroup, and its commands run there).
    pub fn slot_for_spawn(&self) -> Option<(u64, OwnedFd)> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        match make_slot(&self.dir, self.v1, n) {
            Ok(join) => Some((n, join)),
            Err(e) => {
                tracing::debug!(slot = n, error = %e, "no cgroup for the shell's commands");
                None
            }
        }
    }

    /// The shell spawned with slot `n` runs (it joined it before its exec).
    pub fn placed(&self, n: u64) {
        self.shell_at.store(n, Ordering::Relaxed);
        let mut sh = lock(&self.shell);
        if let Some(old) = sh.free.replace(n) {
            lock(&self.left).insert(old);
        }
        sh.moving = None;
    }

    /// A shell could not be spawned with slot `n`: remove it.
    pub fn discard(&self, n: u64) {
        let _ = unlinkat(&*self.dir, name(n).as_str(), UnlinkatFlags::RemoveDir);
    }

    /// Moves `shell` into a new slot, on a thread of its own (the move may wait for the
    /// kernel); [`take_slot`](Self::take_slot) waits for it. Called once the shell has
    /// forked the command whose slot it was in.
    pub fn move_on(&self, shell: i32) {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        {
            let mut sh = lock(&self.shell);
            if let Some(old) = sh.free.take() {
                lock(&self.left).insert(old);
            }
            sh.moving = Some((n, rx));
        }
        let (dir, v1, at) = (self.dir.clone(), self.v1, self.shell_at.clone());
        let left = self.left.clone();
        tokio::task::spawn_blocking(move || {
            let moved = make_slot(&dir, v1, n)
                .and_then(|join| nix::unistd::write(&join, shell.to_string().as_bytes()).map(drop));
            if moved.is_ok() {
                at.store(n, Ordering::Relaxed);
            }
            if let Err(e) = &moved {
                tracing::debug!(slot = n, error = %e, "cannot move the shell into a new cgroup");
                let _ = unlinkat(&*dir, name(n).as_str(), UnlinkatFlags::RemoveDir);
            }
            let _ = tx.send(moved.is_ok());
            lock(&left).retain(|n| !remove(&dir, *n));
        });
    }

    /// Waits until the shell is out of every slot a command has taken (its last move is
    /// done); `true` when it is in a free slot now.
    pub async fn settle(&self) -> bool {
        let moving = lock(&self.shell).moving.take();
        if let Some((n, rx)) = moving {
            let ok = rx.await.unwrap_or(false);
            let mut sh = lock(&self.shell);
            if ok && sh.moving.is_none() {
                if let Some(old) = sh.free.replace(n) {
                    lock(&self.left).insert(old);
                }
            }
        }
        lock(&self.shell).free.is_some()
    }

    /// Gives the free slot of `shell` to command `id` (the subshell it forks next is born
    /// there); `false` when there is none (see [`settle`](Self::settle)).
    pub fn take_slot(&self, id: i64, shell: i32) -> bool {
        let Some(n) = lock(&self.shell).free.take() else {
            return false;
        };
        lock(&self.entered).insert(id, (n, shell));
        true
    }

    /// Whether a child of the shell still lives in command `id`'s slot: the subshell the
    /// shell forked for it (a foreground command's, or a background command's outer one).
    /// `None` when the command has no slot. The shell reports a command's end only once
    /// that child has ended, so an end report while it lives was written by something else
    /// in the session (anything there can write to the control FIFO) and is not believed.
    pub fn subshell_lives(&self, id: i64) -> Option<bool> {
        let (n, shell) = *lock(&self.entered).get(&id)?;
        Some(self.members(n).into_iter().any(|p| {
            p != shell
                && std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|st| {
                    let mut f = st
                        .rsplit_once(')')
                        .map(|(_, r)| r)
                        .unwrap_or("")
                        .split_whitespace();
                    let state = f.next().unwrap_or("Z");
                    let ppid = f.next().and_then(|v| v.parse::<i32>().ok());
                    state != "Z" && state != "X" && ppid == Some(shell)
                })
        }))
    }

    /// Whether `pid`, reported as command `id`'s subshell, is to be believed: `None` when
    /// the command has no slot (nothing to check against), else whether `pid` is in the
    /// command's slot, remembered when it is. A report that names another process
    /// (anything in the session may write to the control FIFO) is not believed; nor is the
    /// true one once the subshell has already ended, which costs nothing: its end report
    /// follows.
    pub fn adopt(&self, id: i64, pid: i32) -> Option<bool> {
        let (n, shell) = *lock(&self.entered).get(&id)?;
        // The shell itself waits in the slot until it forks: a report naming it (forged
        // before the fork) would move it on, and the command would be born elsewhere.
        if pid == shell || !self.members(n).contains(&pid) {
            return Some(false);
        }
        lock(&self.verified).insert(id);
        Some(true)
    }

    /// Whether command `id`'s subshell was found in its slot (see [`adopt`](Self::adopt)).
    pub fn holds(&self, id: i64) -> bool {
        lock(&self.verified).contains(&id)
    }

    /// One pass of killing everything in command `id`'s slot; returns how many processes
    /// it held (0: empty), `None` when the command has none. Processes forked meanwhile are
    /// caught by the next pass on v2 without `cgroup.kill` only; elsewhere none can be
    /// forked. `None` as well while the shell is still in it: [`settle`](Self::settle)
    /// after [`move_on`](Self::move_on) first.
    pub fn kill(&self, id: i64) -> Option<usize> {
        let (n, _) = *lock(&self.entered).get(&id)?;
        if n == self.shell_at.load(Ordering::Relaxed) {
            // The shell has not left it (its move failed or is not done): killing the
            // slot would kill the session's shell.
            return None;
        }
        Some(self.kill_slot(n))
    }

    /// The slots of everything the session runs but its shell: every command's slot,
    /// running or ended (what an ended command left running is still there), except the
    /// one the shell is in and the free one it waits in. For a session out of memory
    /// (docs/sessions.md "Out of memory"), killed with [`kill_slots`](Self::kill_slots).
    pub fn command_slots(&self) -> Vec<u64> {
        let spare = {
            let sh = lock(&self.shell);
            [sh.free, sh.moving.as_ref().map(|(n, _)| *n)]
        };
        let shell_at = self.shell_at.load(Ordering::Relaxed);
        let mut slots: BTreeSet<u64> = lock(&self.entered).values().map(|(n, _)| *n).collect();
        slots.extend(lock(&self.left).iter().copied());
        slots
            .into_iter()
            .filter(|n| *n != shell_at && !spare.contains(&Some(*n)))
            .collect()
    }

    /// One pass of killing everything in `slots` (from [`command_slots`](Self::command_slots):
    /// a command started since has a slot of its own, which is left alone), the shell's
    /// slot never; returns how many processes they held.
    pub fn kill_slots(&self, slots: &[u64]) -> usize {
        let shell_at = self.shell_at.load(Ordering::Relaxed);
        slots
            .iter()
            .filter(|n| **n != shell_at)
            .map(|n| self.kill_slot(*n))
            .sum()
    }

    /// One pass of killing everything in slot `n`; returns how many processes it held.
    fn kill_slot(&self, n: u64) -> usize {
        let name = name(n);
        if !self.v1 && self.write(&name, "cgroup.kill", "1") {
            return self.members(n).len();
        }
        let frozen = !self.v1 && self.write(&name, "cgroup.freeze", "1");
        if self.v1 {
            // pids.max 0: a fork in the cgroup fails from now on.
            self.write(&name, "pids.max", "0");
        }
        let pids = self.members(n);
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
        pids.len()
    }

    /// Command `id` ended: its slot is removed once empty (after the shell's next move),
    /// so no cgroup call is made on the command's path.
    pub fn done(&self, id: i64) {
        let Some((n, _)) = lock(&self.entered).remove(&id) else {
            return;
        };
        lock(&self.verified).remove(&id);
        lock(&self.left).insert(n);
    }

    /// The pids in slot `n` (of chronus's pid namespace).
    fn members(&self, n: u64) -> Vec<i32> {
        let path = format!("{}/cgroup.procs", name(n));
        let Ok(f) = openat(
            &*self.dir,
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
            &*self.dir,
            path.as_str(),
            OFlag::O_WRONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .and_then(|f| nix::unistd::write(&f, value.as_bytes()))
        .is_ok()
    }
}

/// Makes slot `n` below `dir` and opens the file a process joins it through (`tasks` on
/// v1, moving one thread: the shell is single-threaded; `cgroup.procs` on v2).
fn make_slot(dir: &OwnedFd, v1: bool, n: u64) -> Result<OwnedFd, Errno> {
    let name = name(n);
    match mkdirat(dir, name.as_str(), Mode::from_bits_truncate(0o755)) {
        Ok(()) => {}
        // Left by an earlier chronus in a cgroup of the same name: one it killed on v1
        // kept `pids.max` 0 (see `kill_slot`), which would fail every fork of the command.
        Err(Errno::EEXIST) if v1 => {
            let limit = format!("{name}/pids.max");
            if has(dir, &limit) {
                let f = openat(
                    dir,
                    limit.as_str(),
                    OFlag::O_WRONLY | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )?;
                nix::unistd::write(&f, b"max")?;
            }
        }
        Err(Errno::EEXIST) => {}
        Err(e) => return Err(e),
    }
    let join = format!("{name}/{}", if v1 { "tasks" } else { "cgroup.procs" });
    openat(
        dir,
        join.as_str(),
        OFlag::O_WRONLY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .inspect_err(|_| {
        let _ = unlinkat(dir, name.as_str(), UnlinkatFlags::RemoveDir);
    })
}

/// Removes slot `n` below `dir`; `false` while it holds a process.
fn remove(dir: &OwnedFd, n: u64) -> bool {
    match unlinkat(dir, name(n).as_str(), UnlinkatFlags::RemoveDir) {
        Ok(()) | Err(Errno::ENOENT) => true,
        Err(_) => false,
    }
}

fn name(n: u64) -> String {
    format!("c{n}")
}

fn has(dir: &OwnedFd, path: &str) -> bool {
    nix::sys::stat::fstatat(dir, path, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW).is_ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::os::fd::IntoRawFd;

    /// A slot left by an earlier chronus that killed it (v1 `pids.max` 0) is taken with
    /// its limit lifted, so its command can fork.
    #[test]
    fn a_leftover_killed_slot_gets_its_pids_limit_back() {
        let t = tempfile::tempdir().unwrap();
        std::fs::create_dir(t.path().join("c3")).unwrap();
        std::fs::write(t.path().join("c3/tasks"), "").unwrap();
        std::fs::write(t.path().join("c3/pids.max"), "0").unwrap();
        let dir = OwnedFd::from(std::fs::File::open(t.path()).unwrap());
        make_slot(&dir, true, 3).expect("slot 3");
        assert_eq!(
            std::fs::read_to_string(t.path().join("c3/pids.max")).unwrap(),
            "max"
        );
    }

    /// On a plain directory laid out as a v1 pids cgroup: only the shell's child in the
    /// command's slot is believed as its subshell, never the shell itself nor a stranger.
    #[test]
    fn a_pid_report_is_believed_only_for_a_member_that_is_not_the_shell() {
        let t = tempfile::tempdir().unwrap();
        std::fs::write(t.path().join("tasks"), "").unwrap();
        // The kernel makes a new cgroup's files; here slot 1's are made first.
        std::fs::create_dir(t.path().join("c1")).unwrap();
        std::fs::write(t.path().join("c1/tasks"), "").unwrap();
        let fd = std::fs::File::open(t.path()).unwrap().into_raw_fd();
        let cg = CommandCgroups::take(fd).unwrap();
        let (n, _join) = cg.slot_for_spawn().expect("slot 1");
        assert_eq!(n, 1);
        cg.placed(n);
        let shell = 4242;
        assert!(cg.take_slot(7, shell));
        assert_eq!(cg.adopt(8, 99), None, "a command without a slot");
        std::fs::write(t.path().join("c1/cgroup.procs"), format!("{shell}\n")).unwrap();
        assert_eq!(
            cg.adopt(7, shell),
            Some(false),
            "the shell is not the subshell"
        );
        assert_eq!(cg.adopt(7, 5151), Some(false), "not in the slot");
        std::fs::write(t.path().join("c1/cgroup.procs"), format!("{shell}\n5151\n")).unwrap();
        assert_eq!(cg.adopt(7, 5151), Some(true));
        assert!(cg.holds(7));
        // The shell is still in slot 1 (it never moved on): the slot is never killed.
        assert_eq!(cg.kill(7), None);
    }
}
