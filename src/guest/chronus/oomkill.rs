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
//!
//! An event only counts while the cgroup is still full. The kernel signals before its own
//! OOM killer picks a victim, and this thread may run well after that (it shares the
//! sandbox's CPU quota): once the kernel's victim is gone, the caller may already have
//! started its next command, which a late kill would end. So the watch takes the slots of
//! the moment first, then reads the cgroup's use: still within [`NEAR_LIMIT`] of the limit
//! means nothing has been freed since, so no command was started since either.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use super::session::Session;
use crate::guest::config::{OomFd, OomKind};

// Kill passes over the session's command cgroups, and the pause between them: as for a
// timed-out command's job.
use super::driver::{KILL_PASSES, KILL_PAUSE};

/// How often this chronus killed its session's commands on an OOM.
static KILLS: AtomicU64 = AtomicU64::new(0);

/// How often this chronus killed its session's commands on an OOM (added to the kernel's
/// count for `oom_killed`, see [`super::oom::count`]).
pub fn kills() -> u64 {
    KILLS.load(Ordering::SeqCst)
}

/// An OOM event counts while the cgroup's use is at least its limit less 1/`NEAR_LIMIT`
/// of it (16 MiB of a 256 MiB session): a full cgroup's use sits within a few pages of the
/// limit, and the kernel's victim frees far more than that.
const NEAR_LIMIT: i64 = 16;

/// Takes the inherited fds of `fd` and watches them on a thread of its own for as long as
/// chronus lives; `limit` is the session's memory limit in bytes (`session_memory_max`; 0:
/// unknown, then every event counts). Nothing is watched where the session has no command
/// cgroups (there is then no way to tell its shell from the rest) or an fd cannot be taken
/// (logged).
pub fn watch(fd: OomFd, limit: i64, s: Arc<Session>) {
    if s.cgroups.is_none() {
        return;
    }
    let taken = crate::sys::fd::take_fd(fd.events)
        .and_then(|events| Ok((events, crate::sys::fd::take_fd(fd.usage)?)));
    let (events, usage) = match taken {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(error = %e, "cannot watch the session's memory cgroup");
            return;
        }
    };
    let spawned = std::thread::Builder::new()
        .name("oom-watch".into())
        .spawn(move || {
            let mut source = Source::new(fd.kind, events);
            while source.wait() {
                let Some(cg) = &s.cgroups else { break };
                // The slots before the use: see the module's comment.
                let slots = cg.command_slots();
                let used = read_number(&usage);
                if still_full(used, limit) {
                    kill_all(&s, &slots);
                } else {
                    tracing::debug!(used, limit, "an OOM event the session has recovered from");
                }
            }
            tracing::warn!("stopped watching the session's memory cgroup");
        });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "cannot watch the session's memory cgroup");
    }
}

/// Whether a cgroup using `used` bytes (None: unreadable) of its `limit` (0: unknown) is
/// still full enough for an OOM event to count.
fn still_full(used: Option<i64>, limit: i64) -> bool {
    match used {
        Some(used) if limit > 0 => used >= limit - limit / NEAR_LIMIT,
        _ => true,
    }
}

/// The number a cgroup file such as `memory.current` holds, read from its start.
fn read_number(fd: &OwnedFd) -> Option<i64> {
    let mut buf = [0u8; 32];
    let n = nix::sys::uio::pread(fd, &mut buf, 0).ok()?;
    String::from_utf8_lossy(buf.get(..n)?).trim().parse().ok()
}

/// Kills everything in `slots` (everything the session ran but its shell when the event
/// came: a command the caller starts meanwhile is not killed), pass after pass until none
/// is left.
fn kill_all(s: &Session, slots: &[u64]) {
    let Some(cg) = &s.cgroups else { return };
    // Counted before the first signal: a command it ends reads the count after its end.
    KILLS.fetch_add(1, Ordering::SeqCst);
    let mut first = 0;
    for pass in 0..KILL_PASSES {
        let n = cg.kill_slots(slots);
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
    fn new(kind: OomKind, fd: OwnedFd) -> Source {
        let mut s = Source {
            fd,
            v2: kind == OomKind::MemoryEvents,
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

    /// An event counts while the use is within 1/16 of the limit, or where either is unknown.
    #[test]
    fn an_event_counts_only_while_the_cgroup_is_full() {
        let limit = 256 << 20;
        assert!(still_full(Some(limit), limit));
        assert!(still_full(Some(limit - (limit / 16)), limit));
        assert!(!still_full(Some(limit - (limit / 16) - 4096), limit));
        assert!(!still_full(Some(3 << 20), limit));
        assert!(still_full(None, limit));
        assert!(still_full(Some(0), 0));
    }

    #[test]
    fn a_usage_file_reads_as_its_number() {
        let f = tempfile::tempfile().expect("tempfile");
        std::io::Write::write_all(&mut &f, b"268369920\n").expect("write");
        assert_eq!(read_number(&OwnedFd::from(f)), Some(268369920));
    }

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
        let mut src = Source::new(OomKind::Eventfd, fd);
        nix::unistd::write(&writer, &1u64.to_ne_bytes()).expect("signal");
        assert!(src.wait());
    }
}
