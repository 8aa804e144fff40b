//! One reaper per agent process. aether (PID 1) and chronus (a subreaper) inherit orphans,
//! so they must reap every child with `waitpid(-1)`; a per-child `wait` (tokio's `Child`)
//! would race with that. So agents spawn with `std::process::Command`, then [`Reaper::watch`]
//! the pid, and this loop hands each exit status to whoever watches it; orphans are reaped
//! and forgotten.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::oneshot;

/// How a watched child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// `exit(code)`.
    Code(i32),
    /// Killed by this signal.
    Signal(i32),
}

impl Exit {
    /// The shell's convention: the code, or 128 + the signal number.
    pub fn shell_code(self) -> i32 {
        match self {
            Exit::Code(c) => c,
            Exit::Signal(s) => 128 + s,
        }
    }
}

/// Statuses of children nobody watched yet are kept this long (a child may end between
/// `spawn` and `watch`).
const UNCLAIMED_TTL: Duration = Duration::from_secs(60);
/// At most this many unclaimed statuses are kept.
const MAX_UNCLAIMED: usize = 4096;
/// Children reaped per turn of the loop before it yields.
const REAP_BATCH: usize = 256;

#[derive(Default)]
struct Inner {
    watchers: HashMap<i32, oneshot::Sender<Exit>>,
    unclaimed: HashMap<i32, (Exit, Instant)>,
}

/// Reaps every child of this process; see the module doc.
#[derive(Clone, Default)]
pub struct Reaper {
    inner: Arc<Mutex<Inner>>,
}

impl Reaper {
    /// Starts the reaping loop on the current tokio runtime (on SIGCHLD, and every second in
    /// case a signal was coalesced). Errors: the SIGCHLD handler cannot be installed.
    pub fn start() -> std::io::Result<Reaper> {
        let r = Reaper::default();
        let mut sigchld = signal(SignalKind::child())?;
        let me = r.clone();
        tokio::spawn(async move {
            loop {
                if me.reap_some() == REAP_BATCH {
                    // More may be waiting (a fork bomb's orphans come without end): let the
                    // rest of this single-threaded agent run before the next batch.
                    tokio::task::yield_now().await;
                    continue;
                }
                let _ = tokio::time::timeout(Duration::from_secs(1), sigchld.recv()).await;
            }
        });
        Ok(r)
    }

    /// Reaps every child that has ended, without blocking.
    pub fn reap_now(&self) {
        while self.reap_some() == REAP_BATCH {}
    }

    /// Reaps up to [`REAP_BATCH`] ended children; returns how many.
    fn reap_some(&self) -> usize {
        let mut n = 0;
        // Err is ECHILD: no children left.
        while n < REAP_BATCH {
            let Ok(st) = waitpid(Pid::from_raw(-1), Some(WaitPidFlag::WNOHANG)) else {
                break;
            };
            let (pid, exit) = match st {
                WaitStatus::Exited(p, c) => (p.as_raw(), Exit::Code(c)),
                WaitStatus::Signaled(p, s, _) => (p.as_raw(), Exit::Signal(s as i32)),
                WaitStatus::StillAlive => break,
                _ => continue,
            };
            n += 1;
            let mut g = match self.inner.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            match g.watchers.remove(&pid) {
                Some(tx) => {
                    let _ = tx.send(exit);
                }
                None => {
                    let now = Instant::now();
                    // Pruned only when full: orphans (thousands under a fork bomb) are reaped
                    // here too, and a scan per reap would make the loop quadratic.
                    if g.unclaimed.len() >= MAX_UNCLAIMED {
                        g.unclaimed
                            .retain(|_, (_, at)| now.duration_since(*at) < UNCLAIMED_TTL);
                        if g.unclaimed.len() >= MAX_UNCLAIMED {
                            g.unclaimed.clear();
                        }
                    }
                    g.unclaimed.insert(pid, (exit, now));
                }
            }
        }
        n
    }

    /// Resolves when child `pid` ends. Call right after spawning it.
    pub fn watch(&self, pid: u32) -> oneshot::Receiver<Exit> {
        let (tx, rx) = oneshot::channel();
        let pid = pid as i32;
        let mut g = match self.inner.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        match g.unclaimed.remove(&pid) {
            Some((exit, _)) => {
                let _ = tx.send(exit);
            }
            None => {
                g.watchers.insert(pid, tx);
            }
        }
        rx
    }
}

// Tested in tests/guest_reaper.rs, a process of its own: waitpid(-1) would steal the
// statuses of other tests' children.
