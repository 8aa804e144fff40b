//! One started process: what it was started with, its output rings, its input side, and the
//! task that reads its output until it ends and then records how it ended.

use std::io;
use std::os::fd::OwnedFd;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::io::unix::AsyncFd;
use tokio::sync::{oneshot, watch};

use super::ring::Ring;
use super::{DRAIN_IDLE, DRAIN_MAX, OUTPUT_RING_BYTES, READ_CHUNK};
use crate::guest::reaper::Exit;
use crate::pb;

/// Which output stream (a PTY's output counts as `Out`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Which {
    Out = 0,
    Err = 1,
}

/// Where input goes.
pub(super) enum Input {
    Pipe(AsyncFd<OwnedFd>),
    Pty(Arc<AsyncFd<OwnedFd>>),
}

/// Output and end state, under one lock so a reader sees a consistent picture: once `end`
/// is set, both rings are complete.
pub(super) struct State {
    pub rings: [Ring; 2],
    pub end: Option<pb::ProcessEnd>,
    pub ended_at: Option<Instant>,
}

/// A process the table started.
pub(super) struct Proc {
    pub pid: u32,
    pub tag: String,
    pub request_id: String,
    pub pty: bool,
    /// pid, tag, cmd, args, the request's env and the resolved cwd (what `list` shows).
    pub info: pb::ProcessInfo,
    state: Mutex<State>,
    /// Bumped after every change of `state`; followers wait on it.
    changed: watch::Sender<u64>,
    /// `None` once closed (or when started without stdin).
    pub input: tokio::sync::Mutex<Option<Input>>,
    /// The PTY's master side, for resizes; `None` without a PTY or once ended.
    pub master: Mutex<Option<Arc<AsyncFd<OwnedFd>>>>,
}

impl Proc {
    pub fn new(
        info: pb::ProcessInfo,
        request_id: String,
        input: Option<Input>,
        master: Option<Arc<AsyncFd<OwnedFd>>>,
    ) -> Proc {
        Proc {
            pid: info.pid,
            tag: info.tag.clone(),
            request_id,
            pty: master.is_some(),
            info,
            state: Mutex::new(State {
                rings: [Ring::new(OUTPUT_RING_BYTES), Ring::new(OUTPUT_RING_BYTES)],
                end: None,
                ended_at: None,
            }),
            changed: watch::channel(0).0,
            input: tokio::sync::Mutex::new(input),
            master: Mutex::new(master),
        }
    }

    /// The state, even if a panicking thread poisoned the lock (the data stays usable).
    pub fn state(&self) -> MutexGuard<'_, State> {
        match self.state.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    pub fn is_running(&self) -> bool {
        self.state().end.is_none()
    }

    /// A receiver that wakes after each change of the state.
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    fn push(&self, which: Which, data: &[u8]) {
        if let Some(ring) = self.state().rings.get_mut(which as usize) {
            ring.push(data);
        }
        self.changed.send_modify(|v| *v += 1);
    }

    fn finish(&self, end: pb::ProcessEnd) {
        {
            let mut st = self.state();
            st.end = Some(end);
            st.ended_at = Some(Instant::now());
        }
        self.changed.send_modify(|v| *v += 1);
    }

    pub fn master(&self) -> Option<Arc<AsyncFd<OwnedFd>>> {
        match self.master.lock() {
            Ok(g) => g.clone(),
            Err(p) => p.into_inner().clone(),
        }
    }
}

/// Writes all of `data`, waiting while the pipe or terminal is full.
pub(super) async fn write_all(fd: &AsyncFd<OwnedFd>, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        let mut guard = fd.writable().await?;
        match guard.try_io(|f| Ok(nix::unistd::write(f.get_ref(), data)?)) {
            Ok(Ok(n)) => data = data.get(n..).unwrap_or_default(),
            Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
            Ok(Err(e)) => return Err(e),
            Err(_would_block) => {}
        }
    }
    Ok(())
}

/// Drives one process to its end: reads every output fd into the rings while it runs; once
/// it has exited, keeps reading until each fd reports EOF, is idle for [`DRAIN_IDLE`], or
/// [`DRAIN_MAX`] has passed (a background child may hold the pipe open forever); then closes
/// its input and records the end.
pub(super) async fn drive(
    proc: Arc<Proc>,
    exit: oneshot::Receiver<Exit>,
    outputs: Vec<(Which, Arc<AsyncFd<OwnedFd>>)>,
) {
    let (exited_tx, exited_rx) = watch::channel(false);
    let pumps = futures::future::join_all(
        outputs
            .into_iter()
            .map(|(which, fd)| pump(&proc, which, fd, exited_rx.clone())),
    );
    let waiter = async {
        let exit = exit.await;
        let _ = exited_tx.send(true);
        exit
    };
    let (errors, exit) = futures::join!(pumps, waiter);
    let mut end = end_of(exit.ok());
    if let Some(e) = errors.into_iter().flatten().next() {
        if end.error.is_empty() {
            end.error = e;
        }
    }
    tracing::info!(pid = proc.pid, status = %end.status, "process ended");
    proc.finish(end);
    // Then close the input side (calls from now on see the end first). A writer still
    // blocked on a pipe that a descendant holds open keeps the lock until its caller gives
    // up; don't wait for it forever.
    match proc.master.lock() {
        Ok(mut g) => *g = None,
        Err(p) => *p.into_inner() = None,
    }
    if let Ok(mut input) = tokio::time::timeout(DRAIN_MAX, proc.input.lock()).await {
        *input = None;
    }
}

/// Copies one output fd into its ring; returns an error message if reading failed.
async fn pump(
    proc: &Proc,
    which: Which,
    fd: Arc<AsyncFd<OwnedFd>>,
    mut exited: watch::Receiver<bool>,
) -> Option<String> {
    let mut buf = vec![0u8; READ_CHUNK];
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        let ready = match deadline {
            None => tokio::select! {
                r = fd.readable() => r,
                _ = exited.wait_for(|e| *e) => {
                    deadline = Some(tokio::time::Instant::now() + DRAIN_MAX);
                    continue;
                }
            },
            Some(d) => {
                let wait = DRAIN_IDLE.min(d.saturating_duration_since(tokio::time::Instant::now()));
                match tokio::time::timeout(wait, fd.readable()).await {
                    Ok(r) => r,
                    Err(_idle) => return None,
                }
            }
        };
        let mut guard = match ready {
            Ok(g) => g,
            Err(e) => return Some(format!("reading output: {e}")),
        };
        match guard.try_io(|f| Ok(nix::unistd::read(f.get_ref(), &mut buf)?)) {
            Ok(Ok(0)) => return None,
            Ok(Ok(n)) => proc.push(which, buf.get(..n).unwrap_or_default()),
            // A PTY master reports EIO once no process holds the slave side: its EOF.
            Ok(Err(e)) if e.raw_os_error() == Some(libc::EIO) => return None,
            Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {}
            Ok(Err(e)) => return Some(format!("reading output: {e}")),
            Err(_would_block) => {}
        }
    }
}

/// The end event for an exit status, in the words of Go's `os.ProcessState` (what E2B's
/// envd reports): `exit status 3`, `signal: killed`. A signal gives exit code -1 and
/// `exited: false`; `error` repeats the status unless the process exited with 0.
pub(super) fn end_of(exit: Option<Exit>) -> pb::ProcessEnd {
    match exit {
        Some(Exit::Code(c)) => {
            let status = format!("exit status {c}");
            pb::ProcessEnd {
                exit_code: c,
                exited: true,
                error: if c == 0 {
                    String::new()
                } else {
                    status.clone()
                },
                status,
            }
        }
        Some(Exit::Signal(s)) => {
            let status = format!("signal: {}", signal_name(s));
            pb::ProcessEnd {
                exit_code: -1,
                exited: false,
                error: status.clone(),
                status,
            }
        }
        None => pb::ProcessEnd {
            exit_code: -1,
            exited: false,
            status: "unknown".into(),
            error: "the process's exit status was lost".into(),
        },
    }
}

/// Go's names for the signals (`syscall.Signal.String()` on Linux).
fn signal_name(s: i32) -> String {
    let name = match s {
        1 => "hangup",
        2 => "interrupt",
        3 => "quit",
        4 => "illegal instruction",
        5 => "trace/breakpoint trap",
        6 => "aborted",
        7 => "bus error",
        8 => "floating point exception",
        9 => "killed",
        10 => "user defined signal 1",
        11 => "segmentation fault",
        12 => "user defined signal 2",
        13 => "broken pipe",
        14 => "alarm clock",
        15 => "terminated",
        24 => "CPU time limit exceeded",
        25 => "file size limit exceeded",
        26 => "virtual timer expired",
        27 => "profiling timer expired",
        31 => "bad system call",
        _ => return format!("signal {s}"),
    };
    name.to_string()
}

/// How long ended processes stay addressable, measured from their end.
pub(super) fn expired(st: &State, now: Instant, ttl: Duration) -> bool {
    st.ended_at
        .is_some_and(|at| now.saturating_duration_since(at) >= ttl)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_as_go_prints_them() {
        let e = end_of(Some(Exit::Code(0)));
        assert_eq!(
            (e.exit_code, e.exited, e.status.as_str(), e.error.as_str()),
            (0, true, "exit status 0", "")
        );
        let e = end_of(Some(Exit::Code(3)));
        assert_eq!((e.exit_code, e.error.as_str()), (3, "exit status 3"));
        let e = end_of(Some(Exit::Signal(9)));
        assert_eq!(
            (e.exit_code, e.exited, e.status.as_str()),
            (-1, false, "signal: killed")
        );
        assert_eq!(end_of(Some(Exit::Signal(15))).status, "signal: terminated");
        assert_eq!(end_of(Some(Exit::Signal(40))).status, "signal: signal 40");
    }
}
