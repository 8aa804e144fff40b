//! Each session's own cgroup below the sandbox's `workload/` (docs/architecture.md
//! "Cgroups"): aether makes `workload/s<N>/` when a session starts, with a `pids.max` a
//! little below the sandbox's `pids_max`, and removes it when the session has ended. A fork
//! bomb in one session then fills that session's cgroup only, and every other session (a
//! new one included) can still fork its commands.
//!
//! aether reaches `workload/` through directory fds the setup process opened outside the
//! sandbox: inside, the cgroup tree is mounted read-only and rooted at the sandbox, and the
//! sandbox's root cannot write to it. The fds never reach a session: chronus gets only its
//! own session's join files.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};

use nix::errno::Errno;
use nix::fcntl::{openat, OFlag};
use nix::sys::stat::{mkdirat, Mode};
use nix::unistd::{unlinkat, UnlinkatFlags};

use crate::guest::config::AetherConfig;

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
    next: AtomicU64,
}

/// A session's cgroup: its name below `workload/`, and the files its shell joins through
/// (`tasks` on cgroup v1, `cgroup.procs` on v2), one per hierarchy, close-on-exec.
pub struct SessionCgroup {
    pub name: String,
    pub join: Vec<OwnedFd>,
}

impl SessionCgroup {
    /// The join files' fd numbers, for chronus's config.
    pub fn fds(&self) -> Vec<RawFd> {
        self.join.iter().map(|f| f.as_raw_fd()).collect()
    }
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
        Ok(Some(Workload::new(dirs, cfg.session_pids_max)))
    }

    /// A workload over `dirs` whose sessions get `pids.max` = `pids_max` (0: not written).
    pub fn new(dirs: Vec<OwnedFd>, pids_max: i64) -> Workload {
        Workload {
            dirs,
            pids_max,
            next: AtomicU64::new(1),
        }
    }

    /// Makes a new session's cgroup `s<N>` in every hierarchy, gives it its `pids.max`
    /// (where the hierarchy has the pids controller) and opens its join files. What it
    /// made is removed again on a failure. Errors: `Mkdir`, `File`.
    pub fn make_session(&self) -> Result<SessionCgroup, SessionCgroupError> {
        let name = format!("s{}", self.next.fetch_add(1, Ordering::Relaxed));
        let made = self.make_in_all(&name);
        if made.is_err() {
            self.remove(&name);
        }
        made
    }

    fn make_in_all(&self, name: &str) -> Result<SessionCgroup, SessionCgroupError> {
        let mut join = Vec::with_capacity(self.dirs.len());
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
            join.push(self.open_join(dir, name)?);
        }
        Ok(SessionCgroup {
            name: name.to_string(),
            join,
        })
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

    /// The processes in session cgroup `name` (the union over the hierarchies), as pids of
    /// the reader's pid namespace (the kernel translates them).
    fn pids(&self, name: &str) -> Vec<i32> {
        let path = format!("{name}/cgroup.procs");
        let mut out = std::collections::BTreeSet::new();
        for dir in &self.dirs {
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
        out.into_iter().collect()
    }

    /// Removes session cgroup `name` in every hierarchy; `false` while one still holds a
    /// process (`EBUSY`: the caller tries again later). A cgroup that is gone counts as
    /// removed.
    pub fn remove(&self, name: &str) -> bool {
        let mut all = true;
        for dir in &self.dirs {
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
        let s = w.make_session().unwrap();
        assert_eq!(s.name, "s1");
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
        // A real cgroup's control files go with its rmdir; a fake's must go first.
        drop(s);
        for f in ["v1/s1/tasks", "v1/s1/pids.max", "v2/s1/cgroup.procs"] {
            std::fs::remove_file(t.path().join(f)).unwrap();
        }
        assert!(w.remove("s1"));
        assert!(!v1.join("s1").exists() && !v2.join("s1").exists());
        assert!(w.remove("s1"), "gone counts as removed");
        // Names are never reused; a failure (no join file) removes what it made.
        let e = w
            .make_session()
            .err()
            .expect("no join file in a plain directory");
        assert!(e.to_string().contains("s2/cgroup.procs"), "{e}");
        assert!(!v1.join("s2").exists());
    }
}
