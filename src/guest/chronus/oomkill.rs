//! A session out of memory: when the kernel finds the session's memory cgroup full with
//! nothing left to reclaim, chronus kills everything the session runs but its shell, at
//! once, as systemd's `OOMPolicy=stop` does for a service (docs/sessions.md "Out of
//! memory").
//!
//! The kernel's own OOM killer ends one process per OOM. A fork bomb refills the cgroup
//! faster than that, and meanwhile every allocation in it waits in reclaim, mostly in the
//! kernel: on kernels that throttle a CPU quota per task at the return to user space
//! (Linux 6.18 and later), that reclaim runs far past the sandbox's quota (1.4 cores of a
//! 0.5-core sandbox here), and the throttling that follows held the agents and every other
//! session up for tens of seconds. Killed whole, the bomb is gone within a second.
//!
//! aether hands chronus the signal with the session's cgroup (`session_oom_fd`): on v1 an
//! eventfd registered for the cgroup's `memory.oom_control`, on v2 its `memory.events`.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use super::session::Session;
use crate::guest::config::OomFd;

/// Kill passes over the session's command cgroups, and the pause between them.
const KILL_PASSES: usize = 40;
const KILL_PAUSE: Duration = Duration::from_millis(25);

/// How often this chronus killed its session's commands on an OOM.
static KILLS: AtomicU64 = AtomicU64::new(0);

/// How often this chronus killed its session's commands on an OOM (added to the kernel's
/// count for `oom_killed`, see [`super::oom::count`]).
pub fn kills() -> u64 {
    KILLS.load(Ordering::SeqCst)
}

/// Takes the inherited `fd` and watches it on a thread of its own for as long as chronus
/// lives. Nothing is watched where the session has no command cgroups (there is then no
/// way to tell its shell from the rest) or the fd cannot be taken (logged).
pub fn watch(fd: OomFd, s: Arc<Session>) {
    if s.cgroups.is_none() {
        return;
    }
    let owned = match crate::sys::fd::take_fd(fd.fd()) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch the session's memory cgroup");
            return;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("oom-watch".into())
        .spawn(move || {
            let mut source = Source::new(fd, owned);
            while source.wait() {
                kill_all(&s);
            }
            tracing::warn!("stopped watching the session's memory cgroup");
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot watch the session's memory cgroup");
    }
}

/// Kills everything the session runs but its shell, pass after pass until none is left.
fn kill_all(s: &Session) {
    let Some(cg) = &s.cgroups else { return };
    // Counted before the first signal: a command it ends reads the count after its end.
    KILLS.fetch_add(1, Ordering::SeqCst);
    // The slots of the moment: a command the caller starts meanwhile is not killed.
    let slots = cg.command_slots();
    let mut first = 0;
    for pass in 0..KILL_PASSES {
        let n = cg.kill_slots(&slots);
        if pass == 0 {
            first = n;
        }
        if n == 0 {
            break;
        }
        std::thread::sleep(KILL_PAUSE);
    }
    tracing::info!(
        processes = first,
        "the session ran out of memory: killed everything it runs but its shell"
    );
}

/// One of the two kinds of OOM signal, with what was last read from it.
struct Source {
    fd: OwnedFd,
    v2: bool,
    /// v2: the `oom` plus `oom_kill` counts last read.
    seen: u64,
}

impl Source {
    fn new(kind: OomFd, fd: OwnedFd) -> Source {
        let mut s = Source {
            fd,
            v2: matches!(kind, OomFd::MemoryEvents(_)),
            seen: 0,
        };
        if s.v2 {
            s.seen = s.read_counts().unwrap_or(0);
        }
        s
    }

    /// Blocks until the session's cgroup has had an OOM since the last call; `false` when
    /// the fd fails (then there is nothing more to wait for).
    fn wait(&mut self) -> bool {
        if !self.v2 {
            // An eventfd read blocks until the count is non-zero and resets it.
            let mut buf = [0u8; 8];
            return loop {
                match nix::unistd::read(&self.fd, &mut buf) {
                    Ok(8) => break true,
                    Err(nix::errno::Errno::EINTR) => continue,
                    _ => break false,
                }
            };
        }
        loop {
            let mut fds = [PollFd::new(self.fd.as_fd(), PollFlags::POLLPRI)];
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(_) => return false,
            }
            // Any counter's change wakes the poll (`max`, `high` too): only OOMs count.
            let Some(now) = self.read_counts() else {
                return false;
            };
            if now > self.seen {
                self.seen = now;
                return true;
            }
        }
    }

    /// v2: the sum of `memory.events`' `oom` and `oom_kill` lines (read from the start; a
    /// read also re-arms the poll).
    fn read_counts(&self) -> Option<u64> {
        let mut buf = [0u8; 512];
        let n = nix::sys::uio::pread(&self.fd, &mut buf, 0).ok()?;
        Some(oom_counts(&String::from_utf8_lossy(buf.get(..n)?)))
    }
}

/// The `oom` and `oom_kill` counts of a v2 `memory.events` text, summed.
fn oom_counts(text: &str) -> u64 {
    text.lines()
        .filter_map(|l| l.split_once(' '))
        .filter(|(k, _)| matches!(*k, "oom" | "oom_kill"))
        .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
        .sum()
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn only_oom_counters_count() {
        let text = "low 0\nhigh 7\nmax 123\noom 2\noom_kill 3\noom_group_kill 0\n";
        assert_eq!(oom_counts(text), 5);
        assert_eq!(oom_counts("max 9\n"), 0);
    }

    /// An eventfd source wakes once per signal and reports a closed fd as the end.
    #[test]
    fn an_eventfd_wakes_the_watch() {
        let efd = nix::sys::eventfd::EventFd::from_flags(nix::sys::eventfd::EfdFlags::EFD_CLOEXEC)
            .expect("eventfd");
        let fd = OwnedFd::from(efd);
        let writer = fd.try_clone().expect("dup");
        let mut src = Source::new(OomFd::Eventfd(-1), fd);
        nix::unistd::write(&writer, &1u64.to_ne_bytes()).expect("signal");
        assert!(src.wait());
    }
}
