//! Each session's own cgroup below the sandbox's `workload/` (docs/architecture.md
//! "Cgroups"): aether makes `workload/s<N>/` when a session starts, with a `pids.max` a
//! little below the sandbox's `pids_max`, and removes it when the session has ended. A fork
//! bomb in one session then fills that session's cgroup only, and every other session (a
//! new one included) can still fork its commands.
//!
//! aether reaches `workload/` through directory fds the setup process opened outside the
//! sandbox: inside, the cgroup tree is mounted read-only and rooted at the sandbox, and the
//! sandbox's root cannot write to it. The fds never reach a session: chronus gets only its
//! own session's join files, and one directory fd of its session's cgroup where it makes a
//! cgroup per command (`s<N>/c<id>`, src/guest/chronus/cmdcgroup.rs) so that a timed-out
//! command is killed whole. A session of another user than root gets its cgroup's directory
//! and join files chowned to that user (cgroup delegation): chronus runs as that user, and
//! the session's own processes still cannot write there (read-only mount, no
//! CAP_SYS_ADMIN).

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::errno::Errno;
use nix::fcntl::{openat, OFlag};
use nix::sys::stat::{mkdirat, Mode};
use nix::unistd::{unlinkat, UnlinkatFlags};

use crate::guest::config::{AetherConfig, OomFd, OomKind};

/// Errors making or removing a session's cgroup.
#[derive(Debug, thiserror::Error)]
pub enum SessionCgroupError {
    /// An inherited `workload/` fd is not an open directory.
    #[error("taking inherited workload cgroup directory fd {fd}")]
    Inherit {
        fd: RawFd,
        #[source]
        source: std::io::Error,
    },
    /// `mkdir` of the session's cgroup failed.
    #[error("making session cgroup {name}")]
    Mkdir {
        name: String,
        #[source]
        source: Errno,
    },
    /// Opening or writing one of its files failed.
    #[error("{step} {name}/{file}")]
    File {
        step: &'static str,
        name: String,
        file: &'static str,
        #[source]
        source: Errno,
    },
}

/// The sandbox's `workload/` cgroup directories (one per split hierarchy) and the
/// `pids.max` each session's cgroup gets.
pub struct Workload {
    dirs: Vec<OwnedFd>,
    pids_max: i64,
    /// Each session's memory limit in bytes (0: none written).
    memory_max: i64,
    next: AtomicU64,
}

/// A session's cgroup: its name below `workload/`, the files its shell joins through
/// (`tasks` on cgroup v1, `cgroup.procs` on v2), one per hierarchy, and the directory of
/// the hierarchy where its commands get cgroups of their own (the one with `cgroup.kill`
/// or `pids.max`; `None` when none has either), all close-on-exec.
pub struct SessionCgroup {
    pub name: String,
    pub join: Vec<OwnedFd>,
    pub command_dir: Option<OwnedFd>,
    /// What tells the session's chronus that its memory cgroup ran out of memory (see
    /// [`oom_watch`]); `None` without a memory hierarchy or where it cannot be watched.
    pub oom: Option<OomWatch>,
}

/// The two fds of a session's memory cgroup its chronus watches (see [`OomFd`]).
pub struct OomWatch {
    pub kind: OomKind,
    pub events: OwnedFd,
    pub usage: OwnedFd,
}

impl SessionCgroup {
    /// The join files' fd numbers, for chronus's config.
    pub fn fds(&self) -> Vec<RawFd> {
        self.join.iter().map(|f| f.as_raw_fd()).collect()
    }

    /// The command cgroups' directory fd number, for chronus's config.
    pub fn command_dir_fd(&self) -> Option<RawFd> {
        self.command_dir.as_ref().map(|f| f.as_raw_fd())
    }

    /// The out-of-memory fd, for chronus's config.
    pub fn oom_fd(&self) -> Option<OomFd> {
        self.oom.as_ref().map(|w| OomFd {
            kind: w.kind,
            events: w.events.as_raw_fd(),
            usage: w.usage.as_raw_fd(),
        })
    }
}

/// Opens what tells a session that cgroup `name` below `dir` ran out of memory: v1 (the
/// cgroup has `memory.oom_control`) an eventfd registered for it through
/// `cgroup.event_control`, v2 (`memory.events`) that file for reading; and with it the
/// cgroup's usage file. `None` where the hierarchy has no memory controller; a failure is
/// logged and also gives `None`: the kernel's own OOM killer still works, only more slowly
/// (docs/sessions.md "Out of memory").
pub fn oom_watch(dir: &OwnedFd, name: &str) -> Option<OomWatch> {
    let ro = OFlag::O_RDONLY | OFlag::O_CLOEXEC;
    let control = format!("{name}/memory.oom_control");
    let events = format!("{name}/memory.events");
    let made = if has_file(dir, &control) {
        (|| -> Result<OomWatch, Errno> {
            let oom = openat(dir, control.as_str(), ro, Mode::empty())?;
            let ctl = openat(
                dir,
                format!("{name}/cgroup.event_control").as_str(),
                OFlag::O_WRONLY | OFlag::O_CLOEXEC,
                Mode::empty(),
            )?;
            let usage = openat(
                dir,
                format!("{name}/memory.usage_in_bytes").as_str(),
                ro,
                Mode::empty(),
            )?;
            let efd =
                nix::sys::eventfd::EventFd::from_flags(nix::sys::eventfd::EfdFlags::EFD_CLOEXEC)?;
            let line = format!("{} {}", efd.as_raw_fd(), oom.as_raw_fd());
            nix::unistd::write(&ctl, line.as_bytes())?;
            // The registration lives as long as the eventfd does; the files may go.
            Ok(OomWatch {
                kind: OomKind::Eventfd,
                events: OwnedFd::from(efd),
                usage,
            })
        })()
    } else if has_file(dir, &events) {
        (|| -> Result<OomWatch, Errno> {
            Ok(OomWatch {
                kind: OomKind::MemoryEvents,
                events: openat(dir, events.as_str(), ro, Mode::empty())?,
                usage: openat(
                    dir,
                    format!("{name}/memory.current").as_str(),
                    ro,
                    Mode::empty(),
                )?,
            })
        })()
    } else {
        return None;
    };
    made.map_err(|e| {
        tracing::warn!(session_cgroup = name, error = %e, "cannot watch the session's memory cgroup for OOM");
    })
    .ok()
}

impl Workload {
    /// Takes the inherited `workload/` directory fds of `cfg`; `None` when there are none
    /// (sessions then share the process API's cgroup). Errors: `Inherit`.
    pub fn take(cfg: &AetherConfig) -> Result<Option<Workload>, SessionCgroupError> {
        if cfg.workload_cgroup_dir_fds.is_empty() {
            return Ok(None);
        }
        let mut dirs = Vec::with_capacity(cfg.workload_cgroup_dir_fds.len());
        for fd in &cfg.workload_cgroup_dir_fds {
            let d = crate::sys::fd::take_dir(*fd)
                .map_err(|source| SessionCgroupError::Inherit { fd: *fd, source })?;
            dirs.push(d);
        }
        let mut w = Workload::new(dirs, cfg.session_pids_max);
        w.memory_max = cfg.session_memory_max;
        Ok(Some(w))
    }

    /// A workload over `dirs` whose sessions get `pids.max` = `pids_max` (0: not written).
    pub fn new(dirs: Vec<OwnedFd>, pids_max: i64) -> Workload {
        Workload {
            dirs,
            pids_max,
            memory_max: 0,
            next: AtomicU64::new(1),
        }
    }

    /// Makes a new session's cgroup `s<N>` in every hierarchy, gives it its `pids.max`
    /// (where the hierarchy has the pids controller), hands it to `owner` (uid, gid) when
    /// the session runs as another user than root, and opens its join files and its
    /// command cgroups' directory. What it made is removed again on a failure. Errors:
    /// `Mkdir`, `File`.
    pub fn make_session(
        &self,
        owner: Option<(u32, u32)>,
    ) -> Result<SessionCgroup, SessionCgroupError> {
        let name = format!("s{}", self.next.fetch_add(1, Ordering::Relaxed));
        let made = self.make_in_all(&name, owner);
        if made.is_err() {
            self.remove(&name);
        }
        made
    }

    fn make_in_all(
        &self,
        name: &str,
        owner: Option<(u32, u32)>,
    ) -> Result<SessionCgroup, SessionCgroupError> {
        let mut join = Vec::with_capacity(self.dirs.len());
        let mut command_dir = None;
        let mut oom = None;
        for dir in &self.dirs {
            match mkdirat(dir, name, Mode::from_bits_truncate(0o755)) {
                // Left by an earlier aether? Names are never reused within one: take it.
                Ok(()) | Err(Errno::EEXIST) => {}
                Err(source) => {
                    return Err(SessionCgroupError::Mkdir {
                        name: name.to_string(),
                        source,
                    })
                }
            }
            if self.pids_max > 0 {
                self.write(dir, name, "pids.max", &self.pids_max.to_string())?;
            }
            if self.memory_max > 0 {
                let v = self.memory_max.to_string();
                // Whichever the hierarchy has: v2, or v1 (limit first: memsw must not be
                // below it, and a new cgroup's memsw is unlimited).
                self.write(dir, name, "memory.max", &v)?;
                self.write(dir, name, "memory.limit_in_bytes", &v)?;
                self.write(dir, name, "memory.memsw.limit_in_bytes", &v)?;
            }
            if let Some((uid, gid)) = owner.filter(|(uid, _)| *uid != 0) {
                self.delegate(dir, name, uid, gid)?;
            }
            join.push(self.open_join(dir, name)?);
            if oom.is_none() && self.memory_max > 0 {
                oom = oom_watch(dir, name);
            }
            if command_dir.is_none()
                && ["cgroup.kill", "pids.max"]
                    .iter()
                    .any(|f| has_file(dir, &format!("{name}/{f}")))
            {
                let d = openat(
                    dir,
                    name,
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|source| SessionCgroupError::File {
                    step: "opening",
                    name: name.to_string(),
                    file: ".",
                    source,
                })?;
                command_dir = Some(d);
            }
        }
        Ok(SessionCgroup {
            name: name.to_string(),
            join,
            command_dir,
            oom,
        })
    }

    /// Gives session cgroup `name`'s directory and the files a process joins through to
    /// `uid`:`gid`, so that chronus, running as the session's user, can make its command
    /// cgroups there and move its shell in and out of them (the kernel checks write access
    /// to `cgroup.procs` of the common ancestor on v2, and the owner of new files is their
    /// maker).
    fn delegate(
        &self,
        dir: &OwnedFd,
        name: &str,
        uid: u32,
        gid: u32,
    ) -> Result<(), SessionCgroupError> {
        let owner = (
            Some(nix::unistd::Uid::from_raw(uid)),
            Some(nix::unistd::Gid::from_raw(gid)),
        );
        for (file, path) in [
            (".", name.to_string()),
            ("cgroup.procs", format!("{name}/cgroup.procs")),
            ("tasks", format!("{name}/tasks")),
        ] {
            match nix::unistd::fchownat(
                dir,
                path.as_str(),
                owner.0,
                owner.1,
                nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
            ) {
                Ok(()) | Err(Errno::ENOENT) => {}
                Err(source) => {
                    return Err(SessionCgroupError::File {
                        step: "handing to the session's user",
                        name: name.to_string(),
                        file,
                        source,
                    })
                }
            }
        }
        Ok(())
    }

    /// Writes `value` to `name/file` where the file exists (a hierarchy without that
    /// controller has none).
    fn write(
        &self,
        dir: &OwnedFd,
        name: &str,
        file: &'static str,
        value: &str,
    ) -> Result<(), SessionCgroupError> {
        let err = |step, source| SessionCgroupError::File {
            step,
            name: name.to_string(),
            file,
            source,
        };
        let path = format!("{name}/{file}");
        let f = match openat(
            dir,
            path.as_str(),
            OFlag::O_WRONLY | OFlag::O_CLOEXEC,
            Mode::empty(),
        ) {
            Ok(f) => f,
            Err(Errno::ENOENT) => return Ok(()),
            Err(e) => return Err(err("opening", e)),
        };
        nix::unistd::write(&f, value.as_bytes()).map_err(|e| err("writing", e))?;
        Ok(())
    }

    /// Opens the file a process joins `name` through: v1's `tasks` where there is one
    /// (it moves only the writing thread, which is all of the single-threaded child that
    /// writes it before its exec, and it skips the wait for an RCU grace period that a
    /// `cgroup.procs` write takes), else `cgroup.procs` (v2).
    fn open_join(&self, dir: &OwnedFd, name: &str) -> Result<OwnedFd, SessionCgroupError> {
        let flags = OFlag::O_WRONLY | OFlag::O_CLOEXEC;
        let tasks = format!("{name}/tasks");
        match openat(dir, tasks.as_str(), flags, Mode::empty()) {
            Ok(f) => return Ok(f),
            Err(Errno::ENOENT) => {}
            Err(source) => {
                return Err(SessionCgroupError::File {
                    step: "opening",
                    name: name.to_string(),
                    file: "tasks",
                    source,
                })
            }
        }
        let procs = format!("{name}/cgroup.procs");
        openat(dir, procs.as_str(), flags, Mode::empty()).map_err(|source| {
            SessionCgroupError::File {
                step: "opening",
                name: name.to_string(),
                file: "cgroup.procs",
                source,
            }
        })
    }

    /// Kills every process in session cgroup `name`, those that left the session's process
    /// tree included (a bash fork bomb's orphans): v2's `cgroup.kill` where there is one,
    /// else SIGKILL to each process listed, pass after pass, until none is left or
    /// `passes` are done. Returns how many were left after the last pass.
    pub async fn kill(&self, name: &str, passes: usize) -> usize {
        let kill = format!("{name}/cgroup.kill");
        for dir in &self.dirs {
            if let Ok(f) = openat(
                dir,
                kill.as_str(),
                OFlag::O_WRONLY | OFlag::O_CLOEXEC,
                Mode::empty(),
            ) {
                let _ = nix::unistd::write(&f, b"1");
            }
        }
        let mut left = 0;
        for pass in 0..passes.max(1) {
            let pids = self.pids(name);
            left = pids.len();
            if left == 0 {
                break;
            }
            for pid in pids {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            if pass + 1 < passes {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
        }
        left
    }

    /// The processes in session cgroup `name` and the command cgroups below it (the union
    /// over the hierarchies), as pids of
    /// the reader's pid namespace (the kernel translates them).
    fn pids(&self, name: &str) -> Vec<i32> {
        let mut out = std::collections::BTreeSet::new();
        for dir in &self.dirs {
            let groups = std::iter::once(name.to_string())
                .chain(self.children(dir, name).map(|c| format!("{name}/{c}")));
            for group in groups {
                let path = format!("{group}/cgroup.procs");
                let Ok(f) = openat(
                    dir,
                    path.as_str(),
                    OFlag::O_RDONLY | OFlag::O_CLOEXEC,
                    Mode::empty(),
                ) else {
                    continue;
                };
                let mut text = String::new();
                let _ = std::io::Read::read_to_string(&mut std::fs::File::from(f), &mut text);
                out.extend(
                    text.lines()
                        .filter_map(|l| l.trim().parse::<i32>().ok())
                        // 0: a process of another pid namespace; never aether itself.
                        .filter(|p| *p > 1),
                );
            }
        }
        out.into_iter().collect()
    }

    /// The cgroups chronus made below session cgroup `name` in the hierarchy of `dir` (its
    /// commands' `c<id>`); none when it has none or cannot be read.
    fn children(&self, dir: &OwnedFd, name: &str) -> impl Iterator<Item = String> {
        let found = nix::dir::Dir::openat(
            dir,
            name,
            OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .map(|mut d| {
            d.iter()
                .flatten()
                .filter(|e| e.file_type() == Some(nix::dir::Type::Directory))
                .filter_map(|e| e.file_name().to_str().ok().map(str::to_string))
                .filter(|n| n != "." && n != "..")
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
        found.into_iter()
    }

    /// Removes session cgroup `name` in every hierarchy, its command cgroups first; `false`
    /// while one still holds a process (`EBUSY`: the caller tries again later). A cgroup
    /// that is gone counts as removed.
    pub fn remove(&self, name: &str) -> bool {
        let mut all = true;
        for dir in &self.dirs {
            for c in self.children(dir, name) {
                let path = format!("{name}/{c}");
                if let Err(e) = unlinkat(dir, path.as_str(), UnlinkatFlags::RemoveDir) {
                    if e != Errno::ENOENT {
                        all = false;
                    }
                }
            }
            match unlinkat(dir, name, UnlinkatFlags::RemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => {}
                Err(e) => {
                    tracing::debug!(cgroup = name, error = %e, "cannot remove a session cgroup yet");
                    all = false;
                }
            }
        }
        all
    }
}

/// Whether `path` below `dir` exists.
fn has_file(dir: &OwnedFd, path: &str) -> bool {
    nix::sys::stat::fstatat(dir, path, nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW).is_ok()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn dir_fd(p: &std::path::Path) -> OwnedFd {
        OwnedFd::from(std::fs::File::open(p).unwrap())
    }

    /// On plain directories (no kernel behind them) the layout is what a v1 `pids`
    /// hierarchy with a `tasks` file and a v2 one with `cgroup.procs` look like.
    #[test]
    fn makes_limits_joins_and_removes_a_session_cgroup() {
        let t = tempfile::tempdir().unwrap();
        let v1 = t.path().join("v1");
        let v2 = t.path().join("v2");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::create_dir_all(&v2).unwrap();
        // The kernel makes the control files of a new cgroup; here they are made first.
        std::fs::create_dir_all(v1.join("s1")).unwrap();
        std::fs::write(v1.join("s1/tasks"), "").unwrap();
        std::fs::write(v1.join("s1/pids.max"), "").unwrap();
        std::fs::create_dir_all(v2.join("s1")).unwrap();
        std::fs::write(v2.join("s1/cgroup.procs"), "").unwrap();
        let w = Workload::new(vec![dir_fd(&v1), dir_fd(&v2)], 4032);
        // Handed to the session's user (any uid will do as root; as another user, itself).
        let me = nix::unistd::geteuid();
        let user = if me.is_root() { 4321 } else { me.as_raw() };
        let s = w.make_session(Some((user, user))).unwrap();
        assert_eq!(s.name, "s1");
        for p in ["v1/s1", "v1/s1/tasks", "v2/s1", "v2/s1/cgroup.procs"] {
            let st = nix::sys::stat::stat(&t.path().join(p)).unwrap();
            assert_eq!((st.st_uid, st.st_gid), (user, user), "{p}");
        }
        // Commands get their cgroups where the pids controller (or cgroup.kill) is: v1's.
        let cmd_dir = s.command_dir_fd().expect("a command cgroup directory");
        assert_eq!(
            std::fs::read_link(format!("/proc/self/fd/{cmd_dir}")).unwrap(),
            v1.join("s1")
        );
        assert_eq!(
            std::fs::read_to_string(v1.join("s1/pids.max")).unwrap(),
            "4032"
        );
        // No pids.max in v2's fake: nothing written, no error.
        assert!(!v2.join("s1/pids.max").exists());
        let fds = s.fds();
        assert_eq!(fds.len(), 2);
        for (fd, file) in fds
            .iter()
            .zip([v1.join("s1/tasks"), v2.join("s1/cgroup.procs")])
        {
            let target = std::fs::read_link(format!("/proc/self/fd/{fd}")).unwrap();
            assert_eq!(target, file);
            let flags = nix::fcntl::fcntl(
                s.join.iter().find(|f| f.as_raw_fd() == *fd).unwrap(),
                nix::fcntl::FcntlArg::F_GETFD,
            )
            .unwrap();
            assert_ne!(flags & libc::FD_CLOEXEC, 0, "join fds are close-on-exec");
        }
        // A real cgroup's control files go with its rmdir; a fake's must go first. The
        // session's command cgroups go with it.
        drop(s);
        std::fs::create_dir(v1.join("s1/c7")).unwrap();
        for f in ["v1/s1/tasks", "v1/s1/pids.max", "v2/s1/cgroup.procs"] {
            std::fs::remove_file(t.path().join(f)).unwrap();
        }
        assert!(w.remove("s1"));
        assert!(!v1.join("s1").exists() && !v2.join("s1").exists());
        assert!(w.remove("s1"), "gone counts as removed");
        // Names are never reused; a failure (no join file) removes what it made.
        let e = w
            .make_session(None)
            .err()
            .expect("no join file in a plain directory");
        assert!(e.to_string().contains("s2/cgroup.procs"), "{e}");
        assert!(!v1.join("s2").exists());
    }

    /// Each session gets the memory limit it was given, in whichever file its hierarchy
    /// has (v2 `memory.max`; v1 `memory.limit_in_bytes` then `memory.memsw.limit_in_bytes`),
    /// so that a session that fills its memory is OOM-killed within itself.
    #[test]
    fn gives_each_session_its_memory_limit() {
        let t = tempfile::tempdir().unwrap();
        let v1 = t.path().join("memory");
        let v2 = t.path().join("v2");
        for (d, files) in [
            (
                &v1,
                &[
                    "tasks",
                    "memory.limit_in_bytes",
                    "memory.memsw.limit_in_bytes",
                ][..],
            ),
            (&v2, &["cgroup.procs", "memory.max"][..]),
        ] {
            std::fs::create_dir_all(d.join("s1")).unwrap();
            for f in files {
                std::fs::write(d.join("s1").join(f), "").unwrap();
            }
        }
        let mut w = Workload::new(vec![dir_fd(&v1), dir_fd(&v2)], 0);
        w.memory_max = 420 << 20;
        let s = w.make_session(None).unwrap();
        let want = (420u64 << 20).to_string();
        for f in [
            "memory/s1/memory.limit_in_bytes",
            "memory/s1/memory.memsw.limit_in_bytes",
            "v2/s1/memory.max",
        ] {
            assert_eq!(
                std::fs::read_to_string(t.path().join(f)).unwrap(),
                want,
                "{f}"
            );
        }
        assert!(!v1.join("s1/memory.max").exists());
        drop(s);
    }
}
