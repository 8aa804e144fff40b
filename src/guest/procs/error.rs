//! What the process API reports, and the reason each failure carries at the RPC edge.

use std::io;
use std::path::PathBuf;

use crate::guest::user::UserError;
use crate::sys::spawn::SpawnError;
use crate::types::{Failure, Reason};

/// Why a process call failed. [`ProcError::failure`] gives the stable reason.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// `invalid`: the request names no program.
    #[error("no program given (cmd is empty)")]
    EmptyCommand,
    /// `invalid`: `user` is unknown to the sandbox's /etc/passwd or malformed.
    #[error("resolving user {user:?}")]
    ResolveUser {
        user: String,
        #[source]
        source: UserError,
    },
    /// `invalid`: the working directory does not exist or is not a directory.
    #[error("working directory {path:?} is not a directory")]
    Cwd { path: PathBuf },
    /// `not_found`: the program is not on the process's `PATH` (or the path does not exist).
    #[error("program {program:?} not found (PATH={path:?})")]
    ProgramNotFound { program: String, path: String },
    /// `invalid`: a PTY size of zero, or one over 65535.
    #[error("invalid PTY size {cols}x{rows}")]
    PtySize { cols: u32, rows: u32 },
    /// `conflict`: another running process has this tag.
    #[error("tag {tag:?} is taken by running process {pid}")]
    TagTaken { tag: String, pid: u32 },
    /// `unavailable`: a start with this request id is being started right now (a retry
    /// that comes a moment later attaches to it).
    #[error("process of request {request_id:?} is being started")]
    StartInProgress { request_id: String },
    /// `not_found` when exec finds no such file; `invalid` for arguments with NUL bytes, a
    /// program that is not executable (EACCES, ENOEXEC...) or a cwd the user cannot enter;
    /// `internal` otherwise (fork, pipes, setuid...).
    #[error("starting {cmd:?}")]
    Spawn {
        cmd: String,
        #[source]
        source: SpawnError,
    },
    /// `internal`: the child's pipes or PTY could not be registered with the runtime (the
    /// child has been killed).
    #[error("registering the output of process {pid}")]
    Register {
        pid: u32,
        #[source]
        source: io::Error,
    },
    /// `invalid`: the reference has neither a pid nor a tag.
    #[error("no process given (pid 0 and empty tag)")]
    NoSelector,
    /// `invalid`: a negative offset in a connect request.
    #[error("negative offset in connect request (stdout {stdout}, stderr {stderr})")]
    NegativeOffset { stdout: i64, stderr: i64 },
    /// `not_found`: no running or recently ended process matches.
    #[error("no process {0}")]
    NoSuchProcess(String),
    /// `not_found`: the process has ended (input, signals and resizes need a live one).
    #[error("process {pid} has ended")]
    Ended { pid: u32 },
    /// `invalid`: the process was started without stdin, or its stdin was closed.
    #[error("stdin of process {pid} is closed")]
    StdinClosed { pid: u32 },
    /// `invalid`: a PTY call (resize, PTY input) for a process started without a PTY.
    #[error("process {pid} has no PTY")]
    NoPty { pid: u32 },
    /// `invalid`: closing stdin of a PTY process (send Ctrl-D, 0x04, instead).
    #[error("process {pid} runs on a PTY: send Ctrl-D (0x04) instead of closing its stdin")]
    CloseOnPty { pid: u32 },
    /// `invalid`: not a signal number this API sends.
    #[error("unsupported signal {0}")]
    Signal(i32),
    /// `internal`: writing to the process's stdin or PTY failed.
    #[error("writing input to process {pid}")]
    WriteInput {
        pid: u32,
        #[source]
        source: io::Error,
    },
    /// `internal`: TIOCSWINSZ failed.
    #[error("resizing the PTY of process {pid}")]
    Resize {
        pid: u32,
        #[source]
        source: io::Error,
    },
    /// `internal`: kill(2) failed for a reason other than the process being gone.
    #[error("signalling process {pid}")]
    Kill {
        pid: u32,
        #[source]
        source: nix::errno::Errno,
    },
}

impl ProcError {
    /// The stable reason and message for the caller (docs/concepts.md).
    pub fn failure(&self) -> Failure {
        Failure::new(self.reason(), crate::types::chain(self))
    }

    fn reason(&self) -> Reason {
        use ProcError::*;
        match self {
            EmptyCommand
            | ResolveUser { .. }
            | Cwd { .. }
            | PtySize { .. }
            | NoSelector
            | NegativeOffset { .. }
            | StdinClosed { .. }
            | NoPty { .. }
            | CloseOnPty { .. }
            | Signal(_) => Reason::Invalid,
            ProgramNotFound { .. } | NoSuchProcess(_) | Ended { .. } => Reason::NotFound,
            TagTaken { .. } => Reason::Conflict,
            StartInProgress { .. } => Reason::Unavailable,
            Spawn { source, .. } => match source {
                SpawnError::BadString { .. } => Reason::Invalid,
                SpawnError::Child { stage, source, .. } => {
                    match (*stage, source.raw_os_error().unwrap_or(0)) {
                        ("exec", libc::ENOENT) => Reason::NotFound,
                        (
                            "exec" | "chdir",
                            libc::ENOENT
                            | libc::EACCES
                            | libc::ENOEXEC
                            | libc::ENOTDIR
                            | libc::EISDIR
                            | libc::ELOOP
                            | libc::ENAMETOOLONG,
                        ) => Reason::Invalid,
                        _ => Reason::Internal,
                    }
                }
                _ => Reason::Internal,
            },
            WriteInput { .. } | Resize { .. } | Kill { .. } | Register { .. } => Reason::Internal,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons() {
        assert_eq!(
            ProcError::TagTaken {
                tag: "a".into(),
                pid: 3
            }
            .failure()
            .reason,
            Reason::Conflict
        );
        assert_eq!(
            ProcError::Ended { pid: 3 }.failure().reason,
            Reason::NotFound
        );
        assert_eq!(ProcError::Signal(4).failure().reason, Reason::Invalid);
        let enoent = ProcError::Spawn {
            cmd: "x".into(),
            source: SpawnError::Child {
                program: "x".into(),
                stage: "exec",
                source: io::Error::from_raw_os_error(libc::ENOENT),
            },
        };
        assert_eq!(enoent.failure().reason, Reason::NotFound);
    }
}
