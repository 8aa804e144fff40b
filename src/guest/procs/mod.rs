//! The process API (docs/architecture.md, docs/concepts.md): aether's own table of standalone
//! processes, outside sessions. Each runs a program (not a shell) as a given user, with its
//! own pid, an optional tag, stdin (a pipe, or none), signals and an optional PTY. Its output
//! is kept in memory (the last [`OUTPUT_RING_BYTES`] per stream), so a caller whose stream
//! broke reattaches with `connect` and byte offsets, and nothing is repeated or lost; a
//! dropped stream never ends the process. Ended processes stay addressable for
//! [`ENDED_TTL`], so late `connect`s still get the tail of the output and the end.
//!
//! E2B's envd process service (Start, Connect, SendInput, StreamInput, CloseStdin,
//! SendSignal, Update, List) is built on this by the E2B gateway; the mapping notes are on
//! each method.
//!
//! Unknown programs: `start` fails with `not_found` ([`ProcError::ProgramNotFound`], or the
//! exec's ENOENT) and no process, pid or stream exists. The same holds for every error
//! `start` returns: once a stream is returned, the process runs and the stream ends with
//! `end`.

mod error;
mod launch;
mod process;
mod ring;
mod stream;

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use nix::sys::signal::{kill, killpg, Signal};
use nix::unistd::Pid;

pub use error::ProcError;
use process::{Input, Proc, Which};

use crate::guest::config::AetherConfig;
use crate::guest::reaper::Reaper;
use crate::pb;

/// A process's events, as `start` and `connect` return them: `start_pid` first, then
/// `stdout`/`stderr` (or `pty`) chunks with their byte offsets and `keepalive`s, then `end`.
pub type ProcessEvents = std::pin::Pin<Box<dyn futures::Stream<Item = pb::ProcessEvent> + Send>>;

/// Output kept per stream of each process (stdout, stderr; a PTY's output is one stream).
pub const OUTPUT_RING_BYTES: usize = 16 << 20;
/// A `keepalive` event goes out after this long without another event (E2B's SDKs ask for
/// 50 s with `Keepalive-Ping-Interval: 50`; proxies close idle streams otherwise).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(50);
/// How long an ended process stays addressable (for late `connect`s).
pub const ENDED_TTL: Duration = Duration::from_secs(60);
/// After a process exits, its output is read until EOF, or until it has been idle this long
/// (a background child may still hold the pipe)...
pub const DRAIN_IDLE: Duration = Duration::from_millis(100);
/// ...or for at most this long.
pub const DRAIN_MAX: Duration = Duration::from_secs(2);
/// `oom_score_adj` of started processes when the config protects the agents from the OOM
/// killer: the sandbox's own processes go first.
pub const PROCESS_OOM_SCORE_ADJ: i32 = 1000;
/// PTY size when a request asks for a PTY without one (cols, rows).
pub const DEFAULT_PTY_SIZE: (u32, u32) = (80, 24);
/// Bytes read from an output fd at once.
const READ_CHUNK: usize = 64 << 10;
/// Largest output chunk in one event.
const EVENT_CHUNK: usize = 64 << 10;

#[derive(Default)]
struct Table {
    by_pid: HashMap<u32, Arc<Proc>>,
    /// Tags and request ids of starts in progress (between the check and the insert).
    starting_tags: HashSet<String>,
    starting_ids: HashSet<String>,
}

struct Inner {
    cfg: Arc<AetherConfig>,
    reaper: Reaper,
    root: PathBuf,
    table: Mutex<Table>,
}

/// The process table of one aether. Cheap to clone; all clones share the table.
#[derive(Clone)]
pub struct Procs {
    inner: Arc<Inner>,
    keepalive: Duration,
}

impl Procs {
    /// An empty table. `root` is where the sandbox's /etc/passwd is (`/` inside a sandbox);
    /// processes are reaped through `reaper`.
    pub fn new(cfg: Arc<AetherConfig>, reaper: Reaper, root: PathBuf) -> Procs {
        Procs {
            inner: Arc::new(Inner {
                cfg,
                reaper,
                root,
                table: Mutex::new(Table::default()),
            }),
            keepalive: KEEPALIVE_INTERVAL,
        }
    }

    /// The same table, with streams that send `keepalive` after `every` of silence instead
    /// of [`KEEPALIVE_INTERVAL`] (E2B lets the client choose; tests want it short).
    pub fn with_keepalive(mut self, every: Duration) -> Procs {
        self.keepalive = every.max(Duration::from_millis(10));
        self
    }

    fn table(&self) -> MutexGuard<'_, Table> {
        match self.inner.table.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Starts `req.cmd` with `req.args` (no shell: E2B sends `/bin/bash -l -c CMD` itself)
    /// and returns its events from the beginning. `stdin: false` gives the process
    /// /dev/null (E2B: `stdin` absent means true); `pty` runs it on a terminal of
    /// `pty_cols` x `pty_rows` (0 x 0: 80 x 24) whose output arrives as `pty` events.
    /// A `request_id` seen before (while that process is still in the table) returns the
    /// events of that process instead of starting another.
    /// Errors: `invalid` (empty cmd, bad user, cwd, PTY size), `not_found` (program),
    /// `conflict` (tag of a running process), `internal` (fork/exec).
    pub async fn start(&self, req: pb::StartProcessRequest) -> Result<ProcessEvents, ProcError> {
        let spec = launch::prepare(&self.inner.cfg, &self.inner.root, &req)?;
        {
            let mut t = self.table();
            if !req.request_id.is_empty() {
                if let Some(p) = t.by_pid.values().find(|p| p.request_id == req.request_id) {
                    return Ok(stream::follow(p.clone(), [0, 0], self.keepalive));
                }
                if !t.starting_ids.insert(req.request_id.clone()) {
                    return Err(ProcError::StartInProgress {
                        request_id: req.request_id.clone(),
                    });
                }
            }
            if !req.tag.is_empty() {
                let taken = t
                    .by_pid
                    .values()
                    .find(|p| p.tag == req.tag && p.is_running())
                    .map(|p| p.pid);
                let taken = taken.or(t.starting_tags.contains(&req.tag).then_some(0));
                if let Some(pid) = taken {
                    t.starting_ids.remove(&req.request_id);
                    return Err(ProcError::TagTaken {
                        tag: req.tag.clone(),
                        pid,
                    });
                }
                t.starting_tags.insert(req.tag.clone());
            }
        }
        let started = self.spawn(&req, spec);
        let mut t = self.table();
        t.starting_tags.remove(&req.tag);
        t.starting_ids.remove(&req.request_id);
        let proc = started?;
        t.by_pid.insert(proc.pid, proc.clone());
        drop(t);
        Ok(stream::follow(proc, [0, 0], self.keepalive))
    }

    /// Forks and execs, registers the pid with the reaper and starts the task that drives
    /// the process to its end.
    fn spawn(
        &self,
        req: &pb::StartProcessRequest,
        spec: crate::sys::spawn::SpawnSpec,
    ) -> Result<Arc<Proc>, ProcError> {
        let spawn_err = |source| ProcError::Spawn {
            cmd: req.cmd.clone(),
            source,
        };
        let s = crate::sys::spawn::spawn(&spec).map_err(spawn_err)?;
        let exit = self.inner.reaper.watch(s.pid);
        let pid = s.pid;
        // From here on the child runs; registering its fds cannot fail short of the
        // runtime's reactor being gone, and then the reaper still collects the child.
        let fd_err = |source: std::io::Error| {
            // Without its fds nobody could see or end it: end it now (the reaper collects it).
            let _ = kill(Pid::from_raw(pid as i32), Signal::SIGKILL);
            ProcError::Register { pid, source }
        };
        let mut outputs = Vec::new();
        let mut input = None;
        let mut master = None;
        if let Some(m) = s.pty {
            let m = Arc::new(crate::sys::spawn::register_async(m).map_err(fd_err)?);
            outputs.push((Which::Out, m.clone()));
            input = Some(Input::Pty(m.clone()));
            master = Some(m);
        } else {
            if let Some(fd) = s.stdout {
                outputs.push((
                    Which::Out,
                    Arc::new(crate::sys::spawn::register_async(fd).map_err(fd_err)?),
                ));
            }
            if let Some(fd) = s.stderr {
                outputs.push((
                    Which::Err,
                    Arc::new(crate::sys::spawn::register_async(fd).map_err(fd_err)?),
                ));
            }
            if let Some(fd) = s.stdin {
                input = Some(Input::Pipe(
                    crate::sys::spawn::register_async(fd).map_err(fd_err)?,
                ));
            }
        }
        let info = pb::ProcessInfo {
            pid,
            tag: req.tag.clone(),
            cmd: req.cmd.clone(),
            args: req.args.clone(),
            env: req.env.clone(),
            cwd: spec.cwd.to_string_lossy().into_owned(),
        };
        let proc = Arc::new(Proc::new(info, req.request_id.clone(), input, master));
        tracing::info!(
            sandbox_id = %self.inner.cfg.sandbox_id,
            pid,
            cmd = %req.cmd,
            tag = %req.tag,
            pty = proc.pty,
            "process started"
        );
        let table = Arc::downgrade(&self.inner);
        let p = proc.clone();
        tokio::spawn(async move {
            process::drive(p.clone(), exit, outputs).await;
            // Keep the record for late connects, then forget it (unless the pid is already
            // another process's).
            tokio::time::sleep(ENDED_TTL).await;
            if let Some(inner) = table.upgrade() {
                let mut t = match inner.table.lock() {
                    Ok(g) => g,
                    Err(e) => e.into_inner(),
                };
                if t.by_pid.get(&p.pid).is_some_and(|q| Arc::ptr_eq(q, &p)) {
                    t.by_pid.remove(&p.pid);
                }
            }
        });
        Ok(proc)
    }

    /// The process `r` names: by pid when non-zero, else by tag (a running process first,
    /// else the one that ended last). Errors: `NoSelector`, `NoSuchProcess`.
    fn find(&self, r: Option<&pb::ProcessRef>) -> Result<Arc<Proc>, ProcError> {
        let (pid, tag) = r.map(|r| (r.pid, r.tag.as_str())).unwrap_or((0, ""));
        let t = self.table();
        let now = Instant::now();
        let live = |p: &&Arc<Proc>| !process::expired(&p.state(), now, ENDED_TTL);
        if pid != 0 {
            return t
                .by_pid
                .get(&pid)
                .filter(live)
                .cloned()
                .ok_or_else(|| ProcError::NoSuchProcess(format!("with pid {pid}")));
        }
        if tag.is_empty() {
            return Err(ProcError::NoSelector);
        }
        let mut best: Option<(&Arc<Proc>, Option<Instant>)> = None;
        for p in t.by_pid.values().filter(|p| p.tag == tag).filter(live) {
            let ended = p.state().ended_at;
            let better = match (&best, ended) {
                (None, _) => true,
                (Some((_, Some(_))), None) => true, // running beats ended
                (Some((_, Some(b))), Some(e)) => e > *b,
                (Some((_, None)), _) => false,
            };
            if better {
                best = Some((p, ended));
            }
        }
        best.map(|(p, _)| p.clone())
            .ok_or_else(|| ProcError::NoSuchProcess(format!("with tag {tag:?}")))
    }

    /// Attaches to a process: `start_pid`, then its output from `stdout_offset` and
    /// `stderr_offset` (a PTY's output counts as stdout; offsets already dropped from the
    /// ring resume at the oldest byte kept), live output, and `end`. `live: true` skips what
    /// is stored and follows from now on (E2B's Connect). Works on a process that ended less
    /// than [`ENDED_TTL`] ago: the rest of its output, then `end`.
    /// Errors: `invalid` (no pid or tag, negative offset), `not_found`.
    pub async fn connect(
        &self,
        req: pb::ConnectProcessRequest,
    ) -> Result<ProcessEvents, ProcError> {
        if req.stdout_offset < 0 || req.stderr_offset < 0 {
            return Err(ProcError::NegativeOffset {
                stdout: req.stdout_offset,
                stderr: req.stderr_offset,
            });
        }
        let p = self.find(req.process.as_ref())?;
        let pos = if req.live {
            let st = p.state();
            [st.rings[0].end(), st.rings[1].end()]
        } else {
            [req.stdout_offset as u64, req.stderr_offset as u64]
        };
        Ok(stream::follow(p, pos, self.keepalive))
    }

    /// Writes `data` to the process's stdin (or, with `pty` or for a PTY process, to its
    /// terminal), waiting while the pipe is full. E2B's StreamInput is a sequence of these.
    /// Errors: `invalid` (stdin closed or never opened; `pty` for a process without one),
    /// `not_found` (no such process, or it has ended), `internal` (the write failed).
    pub async fn send_input(&self, req: pb::ProcessInputRequest) -> Result<(), ProcError> {
        let p = self.find(req.process.as_ref())?;
        let pid = p.pid;
        if req.pty && !p.pty {
            return Err(ProcError::NoPty { pid });
        }
        if !p.is_running() {
            return Err(ProcError::Ended { pid });
        }
        let input = p.input.lock().await;
        let fd = match &*input {
            Some(Input::Pipe(fd)) => fd,
            Some(Input::Pty(fd)) => &**fd,
            None if !p.is_running() => return Err(ProcError::Ended { pid }),
            None => return Err(ProcError::StdinClosed { pid }),
        };
        match process::write_all(fd, &req.data).await {
            Ok(()) => Ok(()),
            // The reading side is gone: the process has ended (or is ending).
            Err(e) if matches!(e.raw_os_error(), Some(libc::EPIPE | libc::EIO)) => {
                Err(ProcError::Ended { pid })
            }
            Err(source) => Err(ProcError::WriteInput { pid, source }),
        }
    }

    /// Closes the process's stdin, so it reads EOF (E2B's CloseStdin). Closing it again is
    /// not an error. Errors: `invalid` (a PTY process: send Ctrl-D, 0x04, instead),
    /// `not_found`.
    pub async fn close_input(&self, req: pb::ProcessRef) -> Result<(), ProcError> {
        let p = self.find(Some(&req))?;
        if p.pty {
            return Err(ProcError::CloseOnPty { pid: p.pid });
        }
        if !p.is_running() {
            return Err(ProcError::Ended { pid: p.pid });
        }
        *p.input.lock().await = None;
        Ok(())
    }

    /// Sends `signal` (a standard signal number, 1..=31; E2B sends 9 and 15) to the
    /// process's group (it leads its own session, so what it started in that group gets it
    /// too) and to the process itself. SIGKILL ends its whole tree first, so that what left
    /// the group (a terminal's jobs, each in a group of its own; `setsid` children) goes with
    /// it: the tree is stopped, then killed, so nothing forks its way out meanwhile.
    /// Errors: `invalid` (signal number), `not_found` (no such process, or it has ended:
    /// E2B's kill() then returns false), `internal`.
    pub async fn signal(&self, req: pb::SignalProcessRequest) -> Result<(), ProcError> {
        let sig = match Signal::try_from(req.signal) {
            Ok(s) if (1..=31).contains(&req.signal) => s,
            _ => return Err(ProcError::Signal(req.signal)),
        };
        let p = self.find(req.process.as_ref())?;
        if !p.is_running() {
            return Err(ProcError::Ended { pid: p.pid });
        }
        if sig == Signal::SIGKILL {
            let pid = p.pid as i32;
            let killed = tokio::task::spawn_blocking(move || {
                crate::guest::proctree::kill_tree(pid, true, &HashSet::new())
            })
            .await
            .unwrap_or(0);
            // What is left of its group (members that are not its descendants).
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
            if killed > 0 {
                return Ok(());
            }
        }
        send(p.pid, sig)
    }

    /// Resizes the process's terminal (E2B's Update with a PTY); the program gets SIGWINCH.
    /// Errors: `invalid` (no PTY, a zero size or over 65535), `not_found`, `internal`.
    pub async fn resize(&self, req: pb::ResizePtyRequest) -> Result<(), ProcError> {
        let p = self.find(req.process.as_ref())?;
        let pid = p.pid;
        if !p.pty {
            return Err(ProcError::NoPty { pid });
        }
        let (cols, rows) = match (u16::try_from(req.cols), u16::try_from(req.rows)) {
            (Ok(c), Ok(r)) if c > 0 && r > 0 => (c, r),
            _ => {
                return Err(ProcError::PtySize {
                    cols: req.cols,
                    rows: req.rows,
                })
            }
        };
        let master = p.master().ok_or(ProcError::Ended { pid })?;
        crate::sys::pty::set_size(std::os::fd::AsFd::as_fd(master.get_ref()), cols, rows)
            .map_err(|source| ProcError::Resize { pid, source })
    }

    /// The running processes: pid, tag, cmd, args, the env the request gave (not the whole
    /// environment) and the resolved cwd; ordered by pid.
    pub async fn list(&self) -> Vec<pb::ProcessInfo> {
        let t = self.table();
        let mut out: Vec<pb::ProcessInfo> = t
            .by_pid
            .values()
            .filter(|p| p.is_running())
            .map(|p| p.info.clone())
            .collect();
        out.sort_by_key(|i| i.pid);
        out
    }

    /// SIGKILLs every running process of the table and its process group (sandbox
    /// shutdown). Their ends are recorded as usual once the reaper collects them.
    pub fn kill_all(&self) {
        let running: Vec<u32> = self
            .table()
            .by_pid
            .values()
            .filter(|p| p.is_running())
            .map(|p| p.pid)
            .collect();
        for pid in running {
            if let Err(e) = send(pid, Signal::SIGKILL) {
                tracing::warn!(pid, error = %crate::types::chain(&e), "kill_all: SIGKILL failed");
            }
        }
    }
}

/// Signals the group `pid` leads and `pid` itself (it may have left its group). A process
/// already gone is `Ended`.
fn send(pid: u32, sig: Signal) -> Result<(), ProcError> {
    let target = Pid::from_raw(pid as i32);
    let group = killpg(target, sig);
    match kill(target, sig) {
        Ok(()) => Ok(()),
        Err(nix::errno::Errno::ESRCH) if group.is_ok() => Ok(()),
        Err(nix::errno::Errno::ESRCH) => Err(ProcError::Ended { pid }),
        Err(source) => Err(ProcError::Kill { pid, source }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // aether's gRPC service holds a Procs and awaits its futures inside tonic handlers.
    #[allow(dead_code)]
    fn shareable_and_send(p: Procs) {
        fn is<T: Send + Sync + Clone + 'static>(_: &T) {}
        fn send<T: Send>(_: T) {}
        is(&p);
        send(p.start(Default::default()));
        send(p.connect(Default::default()));
        send(p.send_input(Default::default()));
        send(p.close_input(Default::default()));
        send(p.signal(Default::default()));
        send(p.resize(Default::default()));
        send(p.list());
    }
}
