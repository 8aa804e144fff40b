//! Drives the session's shell: hands it one job at a time, waits for a foreground
//! command's control message (or the shell's death), enforces timeouts by killing the
//! command's job (never the shell, which holds the session's state), restarts the shell
//! when it died (from the last state a command ended with), and routes control messages
//! from the FIFO (docs/sessions.md).

use std::collections::HashSet;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::AsyncReadExt;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::session::{lock, Job, Report, Session};
use super::shell::{init_line, parse_ctl, Ctl, Shell, ShellSpec};
use crate::guest::proctree;
use crate::guest::reaper::Reaper;

/// Passes of killing a timed-out command's job, `KILL_PAUSE` apart, before the shell itself
/// is taken for stuck and restarted (it reports as soon as the job's leader is reaped).
pub(super) const KILL_PASSES: usize = 40;
pub(super) const KILL_PAUSE: Duration = Duration::from_millis(25);
/// How long the shell may take to report a job's pid (it does so before anything else).
const PID_WAIT: Duration = Duration::from_secs(1);

/// How long an end report is checked against the command's subshell (1 ms apart at first,
/// then further) before it is taken for forged.
const DONE_CHECK_WITHIN: Duration = Duration::from_secs(1);

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
    if let Err(e) = d.ensure_shell().await {
        tracing::warn!(error = %crate::types::chain(&e), "cannot start the session's shell");
    }
    while let Some(job) = jobs.recv().await {
        d.run_job(job).await;
    }
}

impl Driver {
    /// Keeps a live shell, starting one in the last known directory when there is none; a
    /// new shell first takes in the session's last kept state.
    async fn ensure_shell(&mut self) -> std::io::Result<()> {
        if let Some(sh) = self.shell.as_mut() {
            if matches!(sh.exit.try_recv(), Err(oneshot::error::TryRecvError::Empty)) {
                return Ok(());
            }
            self.shell = None;
        }
        let cwd = lock(&self.s.cwd).clone();
        // It waits for its first command in a cgroup of its own, joined before its exec.
        let slot = self.s.cgroups.as_ref().and_then(|cg| cg.slot_for_spawn());
        let joins: Vec<RawFd> = slot.iter().map(|(_, f)| f.as_raw_fd()).collect();
        let spawned = Shell::spawn(&self.spec, &cwd, &self.reaper, &joins);
        if let (Some((n, _)), Some(cg)) = (&slot, &self.s.cgroups) {
            if spawned.is_ok() {
                cg.placed(*n);
            } else {
                cg.discard(*n);
            }
        }
        let mut sh = spawned?;
        tracing::debug!(pid = sh.pid, "session shell started");
        sh.send(&init_line(
            self.spec.flavor,
            &self.s.current_state_path(),
            &self.s.next_state_path(),
        ))
        .await?;
        self.shell = Some(sh);
        Ok(())
    }

    /// Sends `line` to a live shell, starting a fresh one once if the first is gone.
    async fn send(&mut self, line: &str) -> std::io::Result<()> {
        for attempt in 0..2 {
            let started = self.ensure_shell().await;
            if let Err(e) = started {
                if attempt == 1 {
                    return Err(e);
                }
                self.shell = None;
                continue;
            }
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
        self.enter_cgroup(job.id).await;
        if job.background {
            if let Err(e) = self.send(&job.line).await {
                self.leave_cgroup(job.id);
                self.s
                    .fail(
                        job.id,
                        127,
                        &format!("cannot start the shell: {}", e.kind()),
                    )
                    .await;
                return;
            }
            // The next command must not move the shell out of this one's cgroup before it
            // forked this one's subshell.
            self.wait_for_pid(job.id).await;
            tokio::spawn(watch_background(self.s.clone(), job.id, job.timeout));
            return;
        }
        // What an earlier command that never reported left there is not this one's state.
        let _ = std::fs::remove_file(self.s.next_state_path());
        let (tx, mut rx) = oneshot::channel();
        *lock(&self.s.fg) = Some((job.id, tx));
        if let Err(e) = self.send(&job.line).await {
            lock(&self.s.fg).take();
            self.leave_cgroup(job.id);
            self.s
                .fail(
                    job.id,
                    127,
                    &format!("cannot start the shell: {}", e.kind()),
                )
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
        if !matches!(outcome, Outcome::TimedOut) {
            // Out before its cgroup is removed (a subshell that ended before its pid report
            // was read leaves the shell there until now).
            leave_cgroup(&self.s, job.id);
        }
        match outcome {
            Outcome::Reported(Some(r)) => {
                *lock(&self.s.cwd) = r.pwd.into();
                self.s.keep_state(job.id, r.lost);
                self.s.finish(job.id, r.status, false, r.lost).await;
            }
            Outcome::Reported(None) => self.s.finish(job.id, -1, false, true).await,
            Outcome::ShellDied(code) => {
                // Killed from inside (`kill $$`): the next shell starts from the last kept
                // state, without this command's changes.
                self.shell = None;
                self.kill_orphans(job.id);
                self.s.finish(job.id, code, false, true).await;
            }
            Outcome::TimedOut => self.time_out(job.id, rx).await,
        }
        lock(&self.s.fg).take();
        self.leave_cgroup(job.id);
    }

    /// Gives command `id` the cgroup the shell waits in, where the subshell it forks next is
    /// born; the command's pid report moves the shell on into a new one (`route`). Waits
    /// only when the shell's last move is not done yet (it started when the last command
    /// was forked). Without a cgroup for it the command runs in the session's, and is
    /// killed by its process tree alone.
    async fn enter_cgroup(&mut self, id: i64) {
        let s = self.s.clone();
        let Some(cg) = &s.cgroups else { return };
        let stale = lock(&s.forking).take();
        if let Some((_, shell)) = stale {
            // An earlier command's subshell that never reported: the shell is still in
            // that command's cgroup.
            cg.move_on(shell);
        }
        if self.ensure_shell().await.is_err() {
            return;
        }
        let Some(shell) = self.shell.as_ref().map(|sh| sh.pid) else {
            return;
        };
        let mut free = cg.settle().await;
        if !free {
            cg.move_on(shell);
            free = cg.settle().await;
        }
        if free && cg.take_slot(id, shell) {
            *lock(&s.forking) = Some((id, shell));
        } else {
            tracing::debug!(cmd_id = id, "command runs in the session's cgroup");
        }
    }

    /// Waits (at most `PID_WAIT`) until the shell has reported command `id`'s subshell,
    /// when the command has a cgroup of its own.
    async fn wait_for_pid(&self, id: i64) {
        if !lock(&self.s.forking).is_some_and(|(i, _)| i == id) {
            return;
        }
        let until = Instant::now() + PID_WAIT;
        loop {
            let reported = self.s.pid_reported.notified();
            tokio::pin!(reported);
            reported.as_mut().enable();
            if self.s.snap(id).is_none_or(|c| c.pid.is_some() || c.done) {
                return;
            }
            tokio::select! {
                _ = reported => {}
                _ = tokio::time::sleep_until(until) => return,
            }
        }
    }

    /// Moves the shell on out of command `id`'s cgroup if it is still there (its subshell
    /// never reported, or the command was killed before).
    fn leave_cgroup(&self, id: i64) {
        leave_cgroup(&self.s, id);
    }

    /// Kills what is left of command `id`'s job (its shell died without reporting).
    fn kill_orphans(&self, id: i64) {
        self.leave_cgroup(id);
        let leader = self.s.snap(id).and_then(|c| c.pid);
        self.kill_pass(id, leader, false);
    }

    /// One pass of killing command `id`: its cgroup's every process where it has one; its
    /// job by process group and tree (`leader`, when the shell reported it) unless its
    /// subshell was found in that cgroup (then all of it is there). Returns how many live
    /// processes of it were found.
    fn kill_pass(&self, id: i64, leader: Option<i32>, group_only: bool) -> usize {
        kill_pass(&self.s, id, leader, group_only)
    }

    /// Kills the timed-out foreground command's job, pass after pass, until the shell has
    /// reaped it and reported and nothing of it is left; the shell and the session's state
    /// stay. A shell that does not report is stuck: it is killed and restarted.
    async fn time_out(&mut self, id: i64, mut rx: oneshot::Receiver<Report>) {
        let pid = self.job_pid(id, &mut rx).await;
        let Some(sh) = self.shell.as_mut() else {
            self.s.finish(id, TIMED_OUT_CODE, true, true).await;
            return;
        };
        tracing::info!(cmd_id = id, pid = ?pid, "command timed out; killing its job");
        // Never kill the shell with the command's cgroup: it must have moved on first.
        leave_cgroup(&self.s, id);
        let s = self.s.clone();
        if let Some(cg) = &s.cgroups {
            cg.settle().await;
        }
        // The shell continues a stopped job (there is no terminal to do it from) unless this
        // file says the job is being killed: the group stop must hold while it is.
        if let Err(e) = std::fs::write(self.s.kill_marker(id), b"") {
            tracing::debug!(cmd_id = id, error = %e, "cannot mark a job as being killed");
        }
        let mut report: Option<Report> = None;
        if let Some(Some(r)) = pid.as_ref().err() {
            report = Some(r.clone());
        }
        for _ in 0..KILL_PASSES {
            let left = kill_pass(&self.s, id, pid.as_ref().ok().copied(), report.is_some());
            if report.is_some() && left == 0 {
                break;
            }
            if report.is_some() {
                tokio::time::sleep(KILL_PAUSE).await;
                continue;
            }
            tokio::select! {
                r = &mut rx => match r {
                    Ok(r) => report = Some(r),
                    Err(_) => break,
                },
                _ = &mut sh.exit => {
                    self.shell = None;
                    break;
                }
                _ = tokio::time::sleep(KILL_PAUSE) => {}
            }
        }
        let mut lost = true;
        match report {
            Some(r) => {
                // 0 only when the job wrote its whole state before it was killed.
                lost = r.lost;
                *lock(&self.s.cwd) = r.pwd.into();
                self.s.keep_state(id, lost);
            }
            None => {
                if let Some(sh) = self.shell.as_mut() {
                    tracing::warn!(
                        cmd_id = id,
                        "the shell did not report a killed job; restarting it"
                    );
                    let shell_pid = sh.pid;
                    proctree::kill_tree(shell_pid, true, &HashSet::new());
                    let _ = tokio::time::timeout(Duration::from_secs(2), &mut sh.exit).await;
                }
                self.shell = None;
                self.kill_pass(id, pid.as_ref().ok().copied(), false);
            }
        }
        self.s.finish(id, TIMED_OUT_CODE, true, lost).await;
    }

    /// The pid of command `id`'s job, waiting a little for the shell to report it; `Err`
    /// with the command's end report when it ended meanwhile (or `None` when neither came).
    async fn job_pid(
        &self,
        id: i64,
        rx: &mut oneshot::Receiver<Report>,
    ) -> Result<i32, Option<Report>> {
        let until = Instant::now() + PID_WAIT;
        loop {
            if let Some(p) = self.s.snap(id).and_then(|c| c.pid) {
                return Ok(p);
            }
            if Instant::now() >= until {
                return Err(None);
            }
            tokio::select! {
                r = &mut *rx => return Err(r.ok()),
                _ = tokio::time::sleep(Duration::from_millis(5)) => {}
            }
        }
    }
}

enum Outcome {
    Reported(Option<Report>),
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
            leave_cgroup(&s, id);
            for pass in 0..KILL_PASSES {
                if kill_pass(&s, id, snap.pid, pass > 0) == 0 {
                    break;
                }
                tokio::time::sleep(KILL_PAUSE).await;
            }
            s.finish(id, TIMED_OUT_CODE, true, false).await;
            return;
        }
        match snap.pid {
            Some(pid) if !proctree::alive(pid) => {
                misses += 1;
                // Its report may still be on the way: give it a few turns.
                if misses >= 5 {
                    s.finish(id, -1, false, false).await;
                    return;
                }
            }
            _ => misses = 0,
        }
    }
}

/// Moves the shell on out of command `id`'s cgroup, into a new one, if it is still in it
/// (see [`Driver::enter_cgroup`]); the move is done on a thread of its own.
fn leave_cgroup(s: &Session, id: i64) {
    let Some(cg) = &s.cgroups else { return };
    let shell = {
        let mut f = lock(&s.forking);
        match *f {
            Some((i, shell)) if i == id => {
                *f = None;
                shell
            }
            _ => return,
        }
    };
    cg.move_on(shell);
}

/// See [`Driver::kill_pass`].
fn kill_pass(s: &Session, id: i64, leader: Option<i32>, group_only: bool) -> usize {
    let in_cgroup = s.cgroups.as_ref().and_then(|cg| {
        let n = cg.kill(id)?;
        Some((n, cg.holds(id)))
    });
    match in_cgroup {
        Some((n, true)) => n,
        other => {
            let in_job = leader.map_or(0, |p| proctree::kill_job(p, group_only));
            other.map_or(0, |(n, _)| n).max(in_job)
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
        // The shell writes each message as `\0<message>\0` in one write (atomic on a
        // pipe), so junk the session wrote without a NUL ends at the next message's first
        // NUL and is dropped on its own, instead of spoiling the message after it.
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
            // The subshell is forked (when it is in the command's cgroup, not a forged
            // report): the shell leaves the command's cgroup.
            let believed = s.cgroups.as_ref().and_then(|cg| cg.adopt(id, pid));
            if believed == Some(false) {
                return;
            }
            leave_cgroup(s, id);
            if let Some(c) = lock(&s.table).get_mut(id) {
                if c.pid.is_none() && !c.done {
                    c.pid = Some(pid);
                }
            }
            s.pid_reported.notify_waiters();
        }
        Some(Ctl::Done {
            id,
            status,
            lost,
            pwd,
        }) => {
            let report = Report { status, lost, pwd };
            match s.cgroups.as_ref().and_then(|cg| cg.subshell_lives(id)) {
                Some(true) => {
                    // Believed only once the command's subshell has ended: a background
                    // command's outer subshell writes its report just before it exits.
                    let s = s.clone();
                    tokio::spawn(async move {
                        let until = Instant::now() + DONE_CHECK_WITHIN;
                        let mut pause = Duration::from_millis(1);
                        while Instant::now() < until {
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(Duration::from_millis(50));
                            let lives = s.cgroups.as_ref().and_then(|cg| cg.subshell_lives(id));
                            if lives != Some(true) {
                                done(&s, id, report);
                                return;
                            }
                        }
                        tracing::warn!(
                            cmd_id = id,
                            "ignoring an end report while the command's subshell still runs"
                        );
                    });
                }
                _ => done(s, id, report),
            }
        }
        None => tracing::debug!("ignoring a malformed control message"),
    }
}

/// Command `id` ended with `report`: its waiting foreground call gets it, or a background
/// command is finished.
fn done(s: &Arc<Session>, id: i64, report: Report) {
    let fg = {
        let mut g = lock(&s.fg);
        if g.as_ref().is_some_and(|(i, _)| *i == id) {
            g.take()
        } else {
            None
        }
    };
    if let Some((_, tx)) = fg {
        let _ = tx.send(report);
        return;
    }
    if s.snap(id).is_some_and(|c| c.background && !c.done) {
        let s = s.clone();
        tokio::spawn(async move { s.finish(id, report.status, false, false).await });
    }
}
