//! Drives the session's shell: hands it one job at a time, waits for a foreground
//! command's control message (or the shell's death), enforces timeouts, restarts the shell
//! when it died, and routes control messages from the FIFO.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::session::{lock, Job, Session};
use super::shell::{parse_ctl, Ctl, Shell, ShellSpec};
use crate::guest::proctree;
use crate::guest::reaper::Reaper;

/// How long a timed-out foreground command's processes are killed, pass after pass, before
/// the shell itself is taken for the culprit (a builtin loop) and restarted.
const KILL_PASSES: usize = 40;
const KILL_PAUSE: Duration = Duration::from_millis(50);

/// The exit code of a command that timed out.
pub const TIMED_OUT_CODE: i32 = -1;

struct Driver {
    s: Arc<Session>,
    spec: ShellSpec,
    reaper: Reaper,
    shell: Option<Shell>,
}

/// Runs jobs in order until the session ends. The shell starts at once (so the first
/// command does not wait for it) and again after it died.
pub async fn run(
    s: Arc<Session>,
    spec: ShellSpec,
    reaper: Reaper,
    mut jobs: mpsc::UnboundedReceiver<Job>,
) {
    let mut d = Driver {
        s,
        spec,
        reaper,
        shell: None,
    };
    if let Err(e) = d.ensure_shell() {
        tracing::warn!(error = %e, "cannot start the session's shell");
    }
    while let Some(job) = jobs.recv().await {
        d.run_job(job).await;
    }
}

impl Driver {
    /// Keeps a live shell, starting one in the last known directory when there is none.
    fn ensure_shell(&mut self) -> std::io::Result<()> {
        if let Some(sh) = self.shell.as_mut() {
            if matches!(sh.exit.try_recv(), Err(oneshot::error::TryRecvError::Empty)) {
                return Ok(());
            }
            self.shell = None;
        }
        let cwd = lock(&self.s.cwd).clone();
        let sh = Shell::spawn(&self.spec, &cwd, &self.reaper)?;
        tracing::debug!(pid = sh.pid, "session shell started");
        self.shell = Some(sh);
        Ok(())
    }

    /// Sends `line` to a live shell, starting a fresh one once if the first is gone.
    async fn send(&mut self, line: &str) -> std::io::Result<()> {
        for attempt in 0..2 {
            self.ensure_shell()?;
            let Some(sh) = self.shell.as_mut() else {
                continue;
            };
            match sh.send(line).await {
                Ok(()) => return Ok(()),
                Err(e) if attempt == 1 => return Err(e),
                Err(_) => {
                    // It died after the check; reap it, then try a fresh one.
                    let _ = tokio::time::timeout(Duration::from_secs(1), &mut sh.exit).await;
                    self.shell = None;
                }
            }
        }
        Err(std::io::Error::other("the shell keeps dying"))
    }

    async fn run_job(&mut self, job: Job) {
        self.s.mark_started(job.id);
        if job.background {
            if let Err(e) = self.send(&job.line).await {
                self.s
                    .fail(job.id, 127, &format!("cannot start the shell: {e}"))
                    .await;
                return;
            }
            tokio::spawn(watch_background(self.s.clone(), job.id, job.timeout));
            return;
        }
        let (tx, mut rx) = oneshot::channel();
        *lock(&self.s.fg) = Some((job.id, tx));
        if let Err(e) = self.send(&job.line).await {
            lock(&self.s.fg).take();
            self.s
                .fail(job.id, 127, &format!("cannot start the shell: {e}"))
                .await;
            return;
        }
        let deadline = job.timeout.map(|t| Instant::now() + t);
        let Some(sh) = self.shell.as_mut() else {
            return;
        };
        let outcome = tokio::select! {
            r = &mut rx => Outcome::Reported(r.ok()),
            e = &mut sh.exit => Outcome::ShellDied(e.map(|e| e.shell_code()).unwrap_or(-1)),
            _ = sleep_until(deadline) => Outcome::TimedOut,
        };
        match outcome {
            Outcome::Reported(Some((status, pwd))) => {
                *lock(&self.s.cwd) = pwd.into();
                self.s.finish(job.id, status, false).await;
            }
            Outcome::Reported(None) => self.s.finish(job.id, -1, false).await,
            Outcome::ShellDied(code) => {
                self.shell = None;
                self.s.finish(job.id, code, false).await;
            }
            Outcome::TimedOut => self.time_out(job.id, rx).await,
        }
        lock(&self.s.fg).take();
    }

    /// Kills what the timed-out foreground command started, pass after pass, keeping the
    /// shell; if the command does not end, it is the shell itself: kill and restart it.
    async fn time_out(&mut self, id: i64, mut rx: oneshot::Receiver<(i32, String)>) {
        let skip: HashSet<i32> = lock(&self.s.table).background_pids().into_iter().collect();
        let Some(sh) = self.shell.as_mut() else {
            self.s.finish(id, TIMED_OUT_CODE, true).await;
            return;
        };
        let pid = sh.pid;
        tracing::info!(
            cmd_id = id,
            pid,
            "command timed out; killing what it started"
        );
        for _ in 0..KILL_PASSES {
            proctree::kill_tree(pid, false, &skip);
            tokio::select! {
                r = &mut rx => {
                    if let Ok((_, pwd)) = r {
                        *lock(&self.s.cwd) = pwd.into();
                    }
                    self.s.finish(id, TIMED_OUT_CODE, true).await;
                    return;
                }
                _ = &mut sh.exit => {
                    self.shell = None;
                    self.s.finish(id, TIMED_OUT_CODE, true).await;
                    return;
                }
                _ = tokio::time::sleep(KILL_PAUSE) => {}
            }
        }
        proctree::kill_tree(pid, true, &skip);
        let _ = tokio::time::timeout(Duration::from_secs(2), &mut sh.exit).await;
        self.shell = None;
        self.s.finish(id, TIMED_OUT_CODE, true).await;
    }
}

enum Outcome {
    Reported(Option<(i32, String)>),
    ShellDied(i32),
    TimedOut,
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => std::future::pending().await,
    }
}

/// Ends a background command on its timeout (killing its subshell's tree), or when its
/// subshell vanished without reporting (killed from outside).
async fn watch_background(s: Arc<Session>, id: i64, timeout: Option<Duration>) {
    let start = Instant::now();
    let mut misses = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let Some(snap) = s.snap(id) else { return };
        if snap.done {
            return;
        }
        if timeout.is_some_and(|t| start.elapsed() >= t) {
            if let Some(pid) = snap.pid {
                proctree::kill_tree(pid, true, &HashSet::new());
            }
            s.finish(id, TIMED_OUT_CODE, true).await;
            return;
        }
        match snap.pid {
            Some(pid) if !proctree::alive(pid) => {
                misses += 1;
                // Its report may still be on the way: give it a few turns.
                if misses >= 5 {
                    s.finish(id, -1, false).await;
                    return;
                }
            }
            _ => misses = 0,
        }
    }
}

/// Reads control messages (NUL-terminated) from the session's control FIFO for as long
/// as chronus lives, and routes them.
pub async fn read_ctl(s: Arc<Session>, mut rx: pipe::Receiver) {
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = [0u8; 4096];
    loop {
        let n = match rx.read(&mut chunk).await {
            Ok(0) | Err(_) => {
                // Opened read-write, so this does not happen; do not spin if it does.
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
            Ok(n) => n,
        };
        buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
        while let Some(pos) = buf.iter().position(|b| *b == 0) {
            let msg: Vec<u8> = buf.drain(..=pos).collect();
            route(&s, msg.split_last().map(|(_, m)| m).unwrap_or_default());
        }
        if buf.len() > 64 << 10 {
            // Junk written by the session's own commands; drop it.
            buf.clear();
        }
    }
}

fn route(s: &Arc<Session>, msg: &[u8]) {
    match parse_ctl(msg) {
        Some(Ctl::Pid { id, pid }) => {
            if let Some(c) = lock(&s.table).get_mut(id) {
                if c.background && c.pid.is_none() {
                    c.pid = Some(pid);
                }
            }
        }
        Some(Ctl::Done { id, status, pwd }) => {
            let fg = {
                let mut g = lock(&s.fg);
                if g.as_ref().is_some_and(|(i, _)| *i == id) {
                    g.take()
                } else {
                    None
                }
            };
            if let Some((_, tx)) = fg {
                let _ = tx.send((status, pwd));
                return;
            }
            if s.snap(id).is_some_and(|c| c.background && !c.done) {
                let s = s.clone();
                tokio::spawn(async move { s.finish(id, status, false).await });
            }
        }
        None => tracing::debug!("ignoring a malformed control message"),
    }
}
