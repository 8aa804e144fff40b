//! Spawning a process as a given user (docs/architecture.md "Rules of the codebase"): a new session, an optional
//! controlling PTY, supplementary groups, gid and uid, an explicit environment and working
//! directory, `oom_score_adj`, and every inherited fd above stderr closed at exec.
//!
//! The caller reaps the child (aether reaps every child with `waitpid(-1)`, see
//! `guest::reaper`); this module never waits for it.

use std::collections::BTreeMap;
use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use nix::fcntl::{open, OFlag};
use nix::sys::stat::Mode;
use nix::unistd::{pipe2, ForkResult};

use crate::sys::pty;

/// Who the child runs as.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ids {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups; empty clears the ones the agent has.
    pub groups: Vec<u32>,
}

/// What to start and how.
#[derive(Debug, Clone, Default)]
pub struct SpawnSpec {
    /// The executable: an absolute path, or a relative one containing `/` (resolved against
    /// `cwd` by exec). No `PATH` search happens here.
    pub program: PathBuf,
    /// `argv[0]` as the program sees it ("" = `program`).
    pub argv0: String,
    /// `argv[1..]`.
    pub args: Vec<String>,
    /// The whole environment: nothing of the agent's own leaks in.
    pub env: BTreeMap<String, String>,
    /// Working directory (must exist).
    pub cwd: PathBuf,
    /// `None` keeps the agent's own credentials (tests that are not root).
    pub ids: Option<Ids>,
    /// Keep stdin as a pipe the caller writes to; `false` gives `/dev/null`. Ignored with a
    /// PTY (the terminal is the input).
    pub stdin: bool,
    /// Run on a new PTY of (cols, rows) instead of pipes: stdin, stdout and stderr are the
    /// terminal, which becomes the session's controlling terminal.
    pub pty: Option<(u16, u16)>,
    /// Written to `/proc/self/oom_score_adj` in the child before it drops privileges
    /// (-1000..=1000).
    pub oom_score_adj: Option<i32>,
    /// Open `cgroup.procs` files the child writes "0" to before it drops privileges: the
    /// sandbox's `workload/` cgroup, so that the program never runs beside the agents.
    pub cgroup_procs_fds: Vec<RawFd>,
}

/// A started child: its pid and the agent's ends of its stdio (all close-on-exec).
#[derive(Debug)]
pub struct Spawned {
    pub pid: u32,
    /// Write end of its stdin pipe (`None` without `stdin` or with a PTY).
    pub stdin: Option<OwnedFd>,
    /// Read ends of its stdout and stderr pipes (`None` with a PTY).
    pub stdout: Option<OwnedFd>,
    pub stderr: Option<OwnedFd>,
    /// The PTY's master side: read it for output, write it for input, resize through it.
    pub pty: Option<OwnedFd>,
}

/// Why a child could not be started.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// An argument, variable or path holds a NUL byte (or a variable name is empty or holds
    /// `=`): it cannot be passed to exec.
    #[error("{what} cannot be passed to exec (NUL byte, or '=' in a variable name)")]
    BadString { what: String },
    #[error("opening a PTY")]
    OpenPty(#[source] io::Error),
    #[error("creating the child's {what}")]
    Stdio {
        what: &'static str,
        #[source]
        source: io::Error,
    },
    #[error("fork")]
    Fork(#[source] io::Error),
    /// The child's setup or exec failed at `stage` (`exec`, `chdir`, `setuid`...);
    /// `source` carries its errno. The child has exited with 127; the caller's reaper
    /// collects it.
    #[error("starting {program:?}: {stage}")]
    Child {
        program: PathBuf,
        stage: &'static str,
        #[source]
        source: io::Error,
    },
}

const OOM_SCORE_ADJ: &CStr = c"/proc/self/oom_score_adj";

/// The steps of the child's setup, reported back through the error pipe by index.
const STAGES: [&str; 12] = [
    "dup2",
    "setsid",
    "TIOCSCTTY",
    "oom_score_adj",
    "setgroups",
    "setgid",
    "setuid",
    "chdir",
    "close_range",
    "exec",
    "join workload cgroup",
    "PR_SET_CHILD_SUBREAPER",
];

/// Everything the child needs, prepared before fork: between fork and exec only
/// async-signal-safe calls are allowed (no allocation: the parent has other threads).
struct Plan<'a> {
    program: &'a CStr,
    argv: &'a [*const libc::c_char],
    envp: &'a [*const libc::c_char],
    cwd: &'a CStr,
    stdio: [RawFd; 3],
    report: RawFd,
    pty: bool,
    oom: Option<&'a [u8]>,
    ids: Option<(libc::uid_t, libc::gid_t, &'a [libc::gid_t])>,
    cgroup_fds: &'a [RawFd],
}

fn cstring(what: impl Fn() -> String, bytes: impl Into<Vec<u8>>) -> Result<CString, SpawnError> {
    CString::new(bytes).map_err(|_| SpawnError::BadString { what: what() })
}

/// Starts `spec` with fork and exec (not `std::process::Command`: on an exec failure it
/// waits for the child itself, which races with a `waitpid(-1)` reaper and panics).
/// The child leads a new session, so signalling its process group reaches what it starts
/// and a PTY can become its controlling terminal. It is also a child subreaper (kept across
/// exec): what its descendants orphan (a daemon that forked away, a `setsid` job of a
/// terminal) becomes its child rather than the agent's, so killing its tree ends them too. Returns once exec has succeeded; a
/// failure of the child's setup or exec is `SpawnError::Child` with the stage and errno.
pub fn spawn(spec: &SpawnSpec) -> Result<Spawned, SpawnError> {
    let program = cstring(
        || format!("program {:?}", spec.program),
        spec.program.as_os_str().as_bytes(),
    )?;
    let argv0 = if spec.argv0.is_empty() {
        spec.program.as_os_str().as_bytes().to_vec()
    } else {
        spec.argv0.clone().into_bytes()
    };
    let mut argv = vec![cstring(|| "argv[0]".into(), argv0)?];
    for (i, a) in spec.args.iter().enumerate() {
        argv.push(cstring(|| format!("argument {}", i + 1), a.as_str())?);
    }
    let mut envp = Vec::with_capacity(spec.env.len());
    for (k, v) in &spec.env {
        if k.is_empty() || k.contains('=') {
            return Err(SpawnError::BadString {
                what: format!("variable {k:?}"),
            });
        }
        envp.push(cstring(|| format!("variable {k:?}"), format!("{k}={v}"))?);
    }
    let cwd = cstring(
        || format!("cwd {:?}", spec.cwd),
        spec.cwd.as_os_str().as_bytes(),
    )?;
    let argv_ptrs: Vec<*const libc::c_char> = argv
        .iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let envp_ptrs: Vec<*const libc::c_char> = envp
        .iter()
        .map(|c| c.as_ptr())
        .chain(std::iter::once(std::ptr::null()))
        .collect();
    let oom = spec.oom_score_adj.map(|v| v.to_string().into_bytes());
    let groups: Vec<libc::gid_t> = spec
        .ids
        .as_ref()
        .map(|i| i.groups.clone())
        .unwrap_or_default();

    // The parent's ends (returned) and the child's ends (closed in the parent after fork).
    let stdio_err = |what| {
        move |e: nix::Error| SpawnError::Stdio {
            what,
            source: e.into(),
        }
    };
    let mut child_side: Vec<OwnedFd> = Vec::new();
    let (mut stdin, mut stdout, mut stderr, mut master) = (None, None, None, None);
    let stdio: [RawFd; 3] = if let Some((cols, rows)) = spec.pty {
        let p = pty::open_pty(cols, rows).map_err(SpawnError::OpenPty)?;
        let fd = p.slave.as_raw_fd();
        child_side.push(p.slave);
        master = Some(p.master);
        [fd, fd, fd]
    } else {
        let input = if spec.stdin {
            let (r, w) = pipe2(OFlag::O_CLOEXEC).map_err(stdio_err("stdin pipe"))?;
            stdin = Some(w);
            r
        } else {
            open(
                c"/dev/null",
                OFlag::O_RDONLY | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .map_err(stdio_err("/dev/null"))?
        };
        let (or, ow) = pipe2(OFlag::O_CLOEXEC).map_err(stdio_err("stdout pipe"))?;
        let (er, ew) = pipe2(OFlag::O_CLOEXEC).map_err(stdio_err("stderr pipe"))?;
        stdout = Some(or);
        stderr = Some(er);
        let fds = [input.as_raw_fd(), ow.as_raw_fd(), ew.as_raw_fd()];
        child_side.extend([input, ow, ew]);
        fds
    };
    let (report_r, report_w) = pipe2(OFlag::O_CLOEXEC).map_err(stdio_err("error pipe"))?;

    let plan = Plan {
        program: &program,
        argv: &argv_ptrs,
        envp: &envp_ptrs,
        cwd: &cwd,
        stdio,
        report: report_w.as_raw_fd(),
        pty: spec.pty.is_some(),
        oom: oom.as_deref(),
        ids: spec.ids.as_ref().map(|i| (i.uid, i.gid, groups.as_slice())),
        cgroup_fds: &spec.cgroup_procs_fds,
    };
    // SAFETY: the parent has other threads, so the child may only make async-signal-safe
    // calls until exec: `exec_child` uses nothing but raw syscalls on data prepared above
    // (no allocation, no locks, no unwinding) and never returns.
    let pid = match unsafe { nix::unistd::fork() } {
        Err(e) => return Err(SpawnError::Fork(e.into())),
        Ok(ForkResult::Child) => exec_child(&plan),
        Ok(ForkResult::Parent { child }) => child.as_raw() as u32,
    };
    // Close the child's ends here: EOF on its output (EIO on a PTY master) must come once
    // the child and its descendants are done with them.
    drop(child_side);
    drop(report_w);
    let mut buf = [0u8; 5];
    let mut got = 0;
    while let Some(rest) = buf.get_mut(got..).filter(|r| !r.is_empty()) {
        match nix::unistd::read(report_r.as_fd(), rest) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => break,
        }
    }
    if got == 0 {
        // EOF: the pipe closed at exec (CLOEXEC), so exec succeeded.
        return Ok(Spawned {
            pid,
            stdin,
            stdout,
            stderr,
            pty: master,
        });
    }
    let stage = STAGES.get(buf[0] as usize).copied().unwrap_or("setup");
    let errno = if got == buf.len() {
        i32::from_le_bytes([buf[1], buf[2], buf[3], buf[4]])
    } else {
        libc::EIO
    };
    Err(SpawnError::Child {
        program: spec.program.clone(),
        stage,
        source: io::Error::from_raw_os_error(errno),
    })
}

/// The child after fork: sets itself up as `plan` says and execs. On failure it writes
/// the stage and errno to `plan.report` and exits with 127. Only async-signal-safe calls.
fn exec_child(plan: &Plan<'_>) -> ! {
    // SAFETY: fcntl(F_DUPFD_CLOEXEC) on an fd this child owns. The copy is above 2, so
    // it survives the dup2s onto 0-2 even if the agent ran with those closed.
    let moved = unsafe { libc::fcntl(plan.report, libc::F_DUPFD_CLOEXEC, 3) };
    let report = if moved == -1 { plan.report } else { moved };
    let (stage, errno) = setup_and_exec(plan);
    let e = errno.to_le_bytes();
    let msg = [stage, e[0], e[1], e[2], e[3]];
    // SAFETY: write(2) from a live stack buffer to an fd this child owns; _exit(2) ends the
    // process without running the parent's atexit handlers or destructors.
    unsafe {
        libc::write(report, msg.as_ptr().cast(), msg.len());
        libc::_exit(127)
    }
}

/// Sets up the child and execs; returns only on failure: the index of the failed stage in [`STAGES`] and the errno.
fn setup_and_exec(plan: &Plan<'_>) -> (u8, i32) {
    let errno = || {
        io::Error::last_os_error()
            .raw_os_error()
            .unwrap_or(libc::EIO)
    };
    macro_rules! check {
        ($stage:expr, $call:expr) => {
            if $call == -1 {
                return ($stage, errno());
            }
        };
    }
    // SAFETY: for every call below: plain syscalls on integers, fds this child owns and
    // NUL-terminated strings and pointer arrays prepared by the parent before fork, which
    // stay alive in this copy of its memory; nothing allocates or takes a lock.
    unsafe {
        // The agent's signal mask and dispositions are not the program's: unblock
        // everything and restore the defaults (Rust ignores SIGPIPE).
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::sigprocmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
        for sig in 1..32 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::signal(sig, libc::SIG_DFL);
            }
        }
        // Move the stdio sources above 2 first: if the agent runs with fds 0-2 closed,
        // they may be among them, and dup2 onto 0-2 would clobber them.
        let mut src = [0; 3];
        for (dst, fd) in src.iter_mut().zip(plan.stdio.iter()) {
            *dst = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, 3);
            check!(0, *dst);
        }
        for (i, fd) in src.iter().enumerate() {
            check!(0, libc::dup2(*fd, i as i32));
        }
        check!(1, libc::setsid());
        check!(11, libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0));
        if plan.pty {
            check!(2, libc::ioctl(0, libc::TIOCSCTTY, 0));
        }
        // Into the workload's cgroup before anything of the program runs (and while still
        // root, though the kernel checks the opener of the files).
        for fd in plan.cgroup_fds {
            if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                return (10, errno());
            }
        }
        if let Some(v) = plan.oom {
            // Before setuid: once the credentials change, /proc/self belongs to root.
            let fd = libc::open(OOM_SCORE_ADJ.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
            check!(3, fd);
            check!(3, libc::write(fd, v.as_ptr().cast(), v.len()) as i32);
            libc::close(fd);
        }
        if let Some((uid, gid, groups)) = plan.ids {
            check!(4, libc::setgroups(groups.len(), groups.as_ptr()));
            check!(5, libc::setgid(gid));
            check!(6, libc::setuid(uid));
        }
        // After setuid, as Go's os/exec does: the user must be able to enter it.
        check!(7, libc::chdir(plan.cwd.as_ptr()));
        if cloexec_from(3).is_err() {
            return (8, errno());
        }
        libc::execve(
            plan.program.as_ptr(),
            plan.argv.as_ptr(),
            plan.envp.as_ptr(),
        );
        (9, errno())
    }
}

/// Makes one of a child's stdio fds (a [`Spawned`] pipe end or PTY master) non-blocking and
/// registers it with the current tokio runtime, for reading and writing without a thread
/// per fd. Errors: fcntl's, or the runtime's (`ENOSPC` from epoll...). Panics outside a
/// runtime, as tokio does.
pub fn register_async(fd: OwnedFd) -> io::Result<tokio::io::unix::AsyncFd<OwnedFd>> {
    use nix::fcntl::{fcntl, FcntlArg};
    let flags = OFlag::from_bits_truncate(fcntl(fd.as_fd(), FcntlArg::F_GETFL)?);
    fcntl(fd.as_fd(), FcntlArg::F_SETFL(flags | OFlag::O_NONBLOCK))?;
    // SAFETY: the AsyncFd owns `fd` (an OwnedFd): it stays open and refers to the same open
    // file description until the AsyncFd is dropped, and `as_raw_fd` always returns it.
    unsafe { tokio::io::unix::AsyncFd::register(fd) }.map_err(|e| e.into_parts().1)
}

/// Marks every fd from `first` up close-on-exec, so nothing the agent holds (sockets,
/// other processes' pipes) leaks into the program. CLOEXEC rather than closing: std's own
/// exec-error pipe must stay open until exec.
fn cloexec_from(first: u32) -> io::Result<()> {
    // SAFETY: close_range takes three integers and touches only this process's fd table;
    // with CLOSE_RANGE_CLOEXEC it closes nothing, so no fd std still needs goes away.
    let r = unsafe {
        libc::syscall(
            libc::SYS_close_range,
            first,
            u32::MAX,
            libc::CLOSE_RANGE_CLOEXEC,
        )
    };
    if crate::sys::cvt(r).is_ok() {
        return Ok(());
    }
    // Kernels before 5.11: set the flag one fd at a time, up to the fd limit.
    let max = nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE)
        .map(|(soft, _)| soft.min(1 << 20))
        .unwrap_or(1024);
    for fd in first as u64..max {
        // SAFETY: fcntl(F_SETFD) on a number that may or may not be an open fd: a closed
        // one fails with EBADF, which is ignored; no memory is passed.
        unsafe { libc::fcntl(fd as i32, libc::F_SETFD, libc::FD_CLOEXEC) };
    }
    Ok(())
}

// Tested through guest::procs in tests/guest_procs.rs (spawned children must be reaped by
// the agent's reaper, which needs a test process of its own).
