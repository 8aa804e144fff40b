//! One session's commands: starting them (files, FIFOs, readers), ending them (reading in
//! what is buffered, then `done`), and answering for their output by offset, whole or as
//! a stream.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::stat::Mode;
use tokio::net::unix::pipe;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use super::cmdcgroup::CommandCgroups;
use super::shell::{self, CmdFiles};
use super::table::{read_record, Limits, Snap, Stream, Table};
pub use crate::guest::lock;
use crate::pb;
use crate::types::Failure;

/// A command for the shell driver, in submission order.
pub struct Job {
    pub id: i64,
    pub line: String,
    pub background: bool,
    pub timeout: Option<Duration>,
}

/// What the shell reports at a foreground command's end: its status, whether the session
/// could not take in its state, and the directory the shell is then in.
#[derive(Debug, Clone)]
pub struct Report {
    pub status: i32,
    pub lost: bool,
    pub pwd: String,
}

/// The foreground command the shell runs now, and who waits for its control message.
pub type Foreground = Option<(i64, oneshot::Sender<Report>)>;

/// Longest timeout or wait honoured, in seconds (ten years): larger values would overflow
/// the clock arithmetic.
pub const MAX_SECONDS: f64 = 315_360_000.0;

/// Bytes per streamed chunk.
const CHUNK: u64 = 1 << 20;
/// Reads per wakeup before a reader yields to other tasks (one thread serves them all).
const READS_PER_TURN: usize = 16;

/// A session's state shared by the service, the shell driver and the readers.
pub struct Session {
    dir: PathBuf,
    flavor: shell::Flavor,
    pub table: Mutex<Table>,
    /// The shell's current directory, from the `$PWD` each foreground command reports.
    pub cwd: Mutex<PathBuf>,
    pub fg: Mutex<Foreground>,
    /// Where each command gets a cgroup of its own, when the session's cgroup allows it.
    pub cgroups: Option<CommandCgroups>,
    /// The command whose subshell the shell is about to fork from inside that command's
    /// cgroup, and the shell's pid: the command's pid report moves the shell on into a new
    /// cgroup (src/guest/chronus/cmdcgroup.rs).
    pub forking: Mutex<Option<(i64, i32)>>,
    /// Notified on every pid report.
    pub pid_reported: tokio::sync::Notify,
    jobs: mpsc::UnboundedSender<Job>,
}

impl Session {
    /// A session keeping its files in `dir` (`cmd/`, `io/`, `rec/`, `ctl`), starting in
    /// `cwd`, its commands in cgroups of their own below `cgroups` when given; the receiver
    /// feeds the shell driver.
    pub fn new(
        dir: PathBuf,
        limits: Limits,
        cwd: PathBuf,
        flavor: shell::Flavor,
        cgroups: Option<CommandCgroups>,
    ) -> (Arc<Session>, mpsc::UnboundedReceiver<Job>) {
        let (jobs, rx) = mpsc::unbounded_channel();
        let s = Session {
            flavor,
            table: Mutex::new(Table::new(dir.join("rec"), limits)),
            dir,
            cwd: Mutex::new(cwd),
            fg: Mutex::new(None),
            cgroups,
            forking: Mutex::new(None),
            pid_reported: tokio::sync::Notify::new(),
            jobs,
        };
        (Arc::new(s), rx)
    }

    /// The control FIFO's path.
    pub fn ctl_path(&self) -> PathBuf {
        self.dir.join("ctl")
    }

    /// The state the session's shell last ended a command with (a restarted shell starts
    /// from it).
    pub fn current_state_path(&self) -> PathBuf {
        self.dir.join("state").join("current")
    }

    /// Where a bash session's foreground commands write the state they end with.
    pub fn next_state_path(&self) -> PathBuf {
        self.dir.join("state").join("next")
    }

    fn files(&self, id: i64) -> CmdFiles {
        CmdFiles {
            next: self.next_state_path(),
            script: self.dir.join("cmd").join(format!("{id}.sh")),
            line: self.dir.join("cmd").join(format!("{id}.line")),
            out: self.dir.join("io").join(format!("{id}.out")),
            err: self.dir.join("io").join(format!("{id}.err")),
            ctl: self.ctl_path(),
            state: self.dir.join("state").join(id.to_string()),
            kill: self.kill_marker(id),
        }
    }

    /// The file whose presence tells the shell that command `id`'s job is being killed.
    pub fn kill_marker(&self, id: i64) -> PathBuf {
        self.dir.join("state").join(format!("{id}.kill"))
    }

    /// Takes in command `id`'s state dump: kept as the session's current state when the
    /// shell took it in whole (`lost` false) and it is not [`shell::UNCHANGED_STATE`] (the
    /// current state stays), else deleted.
    pub fn keep_state(&self, id: i64, lost: bool) {
        let state = match self.flavor {
            shell::Flavor::Bash => self.next_state_path(),
            shell::Flavor::Sh => self.files(id).state,
        };
        if !lost && state.exists() && !is_unchanged(&state) {
            if let Err(e) = std::fs::rename(&state, self.current_state_path()) {
                tracing::debug!(cmd_id = id, error = %e, "cannot keep a state dump");
            }
        } else {
            let _ = std::fs::remove_file(state);
        }
    }

    pub fn snap(&self, id: i64) -> Option<Snap> {
        lock(&self.table).snap(id)
    }

    /// Starts a command (or finds the one this request id started) and returns its id.
    /// Errors: `invalid` for a bad variable name, NUL bytes or a negative timeout;
    /// `internal` when its files cannot be made.
    pub fn start(self: &Arc<Self>, req: &pb::RunShellRequest) -> Result<i64, Failure> {
        for (k, v) in &req.env {
            if !shell::valid_env_name(k) {
                return Err(Failure::invalid(format!(
                    "env: {k:?} is not a variable name"
                )));
            }
            if v.contains('\0') {
                return Err(Failure::invalid(format!("env: the value of {k} holds NUL")));
            }
        }
        if req.cwd.contains('\0') {
            return Err(Failure::invalid("cwd holds NUL"));
        }
        if !(req.timeout >= 0.0 && req.timeout.is_finite()) {
            return Err(Failure::invalid(format!(
                "timeout {} is not a number of seconds >= 0",
                req.timeout
            )));
        }
        let id = {
            let mut t = lock(&self.table);
            if let Some(id) = t.by_request(&req.request_id) {
                return Ok(id);
            }
            t.insert(req.background, &req.request_id).0
        };
        let env: BTreeMap<String, String> = req.env.clone().into_iter().collect();
        let files = self.files(id);
        let line = if req.background {
            shell::background_line(self.flavor, id, &files, &req.cwd, &env)
        } else {
            shell::foreground_line(self.flavor, id, &files, &req.cwd, &env)
        };
        let prepared = self.prepare(id, &files, &req.cmd).and_then(|()| {
            if self.flavor != shell::Flavor::Bash {
                return Ok(line);
            }
            write_private(&files.line, line.as_bytes())?;
            Ok(shell::eval_line(&files.line))
        });
        let line = match prepared {
            Ok(l) => l,
            Err(e) => {
                lock(&self.table).remove(id);
                // The session's paths are internal: logged, never told to the caller.
                tracing::warn!(cmd_id = id, dir = %self.dir.display(), error = %e, "cannot prepare a command");
                return Err(Failure::internal(format!(
                    "cannot prepare command {id}: {}",
                    e.kind()
                )));
            }
        };
        let job = Job {
            id,
            line,
            background: req.background,
            timeout: (req.timeout > 0.0)
                .then(|| Duration::from_secs_f64(req.timeout.min(MAX_SECONDS))),
        };
        if self.jobs.send(job).is_err() {
            lock(&self.table).remove(id);
            return Err(Failure::unavailable("the session's shell driver is gone"));
        }
        Ok(id)
    }

    /// Writes the script, makes the two FIFOs and starts their readers.
    fn prepare(self: &Arc<Self>, id: i64, f: &CmdFiles, cmd: &str) -> std::io::Result<()> {
        write_private(&f.script, cmd.as_bytes())?;
        let mut keepers = Vec::new();
        let mut drains = Vec::new();
        for (which, path) in [(Stream::Out, &f.out), (Stream::Err, &f.err)] {
            let _ = std::fs::remove_file(path);
            nix::unistd::mkfifo(path, Mode::from_bits_truncate(0o600))
                .map_err(std::io::Error::from)?;
            let r = std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(path)?;
            let w = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(path)?;
            let rx = pipe::Receiver::from_owned_fd(OwnedFd::from(r))?;
            let rec = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .open(lock(&self.table).record_path(id, which))?;
            let (dtx, drx) = oneshot::channel();
            tokio::spawn(pump(self.clone(), id, which, rx, rec, drx));
            keepers.push(OwnedFd::from(w));
            drains.push(dtx);
        }
        let mut t = lock(&self.table);
        if let Some(c) = t.get_mut(id) {
            c.keepers = keepers;
            c.drains = drains;
        }
        Ok(())
    }

    /// Marks when the shell was given command `id` (its duration counts from here).
    pub fn mark_started(&self, id: i64) {
        let oom = super::oom::count();
        if let Some(c) = lock(&self.table).get_mut(id) {
            c.started = std::time::Instant::now();
            c.oom_before = oom;
        }
    }

    /// Ends command `id`: lets go of its FIFOs, has the readers take in what is buffered,
    /// then marks it done. A second call for the same command does nothing.
    pub async fn finish(&self, id: i64, exit_code: i32, timed_out: bool, state_lost: bool) {
        let (keepers, drains) = {
            let mut t = lock(&self.table);
            let Some(c) = t.get_mut(id) else { return };
            if c.finishing {
                return;
            }
            c.finishing = true;
            (
                std::mem::take(&mut c.keepers),
                std::mem::take(&mut c.drains),
            )
        };
        drop(keepers);
        let mut acks = Vec::new();
        for d in drains {
            let (tx, rx) = oneshot::channel();
            if d.send(tx).is_ok() {
                acks.push(rx);
            }
        }
        for a in acks {
            let _ = tokio::time::timeout(Duration::from_secs(5), a).await;
        }
        let oom_after = super::oom::count();
        if let Some(c) = lock(&self.table).get_mut(id) {
            c.done = true;
            c.exit_code = exit_code;
            c.timed_out = timed_out;
            c.oom_killed = super::oom::killed(c.oom_before, oom_after, exit_code);
            c.state_lost = state_lost;
            c.duration = c.started.elapsed().as_secs_f64();
            c.changed.send_modify(|v| *v += 1);
        }
        let f = self.files(id);
        for p in [f.script, f.line, f.out, f.err, f.state, f.kill] {
            let _ = std::fs::remove_file(p);
        }
        if let Some(cg) = &self.cgroups {
            // What the command left running (`server &`) keeps its cgroup until it ends.
            cg.done(id);
        }
        tracing::debug!(cmd_id = id, exit_code, timed_out, "command ended");
    }

    /// Records a failure to run command `id` as its stderr and ends it with `code`.
    pub async fn fail(&self, id: i64, code: i32, why: &str) {
        {
            let mut t = lock(&self.table);
            let path = t.record_path(id, Stream::Err);
            if let Ok(mut f) = std::fs::OpenOptions::new().append(true).open(path) {
                let _ = t.append(
                    id,
                    Stream::Err,
                    format!("chronus: {why}\n").as_bytes(),
                    &mut f,
                );
            }
        }
        self.finish(id, code, false, false).await;
    }

    /// Waits until command `id` is done, or `deadline` passes (`None`: no limit).
    /// Errors: `not_found` for an unknown or evicted command.
    pub async fn wait_done(&self, id: i64, deadline: Option<Instant>) -> Result<(), Failure> {
        let mut rx = lock(&self.table)
            .subscribe(id)
            .ok_or_else(|| not_found(id))?;
        loop {
            match self.snap(id) {
                None => return Err(not_found(id)),
                Some(s) if s.done => return Ok(()),
                Some(_) => {}
            }
            let changed = rx.changed();
            match deadline {
                Some(d) => match tokio::time::timeout_at(d, changed).await {
                    Err(_) => return Ok(()),
                    Ok(Err(_)) => return Err(not_found(id)),
                    Ok(Ok(())) => {}
                },
                None => changed.await.map_err(|_| not_found(id))?,
            }
        }
    }

    /// Command `id`'s result with up to the call limit of each stream from the offsets.
    /// Errors: `not_found` (unknown or evicted), `invalid` (negative offset).
    pub async fn result(
        &self,
        id: i64,
        out_off: i64,
        err_off: i64,
    ) -> Result<pb::ShellResult, Failure> {
        if out_off < 0 || err_off < 0 {
            return Err(Failure::invalid("offsets must be >= 0"));
        }
        let (s, out_path, err_path, call) = {
            let t = lock(&self.table);
            let s = t.snap(id).ok_or_else(|| not_found(id))?;
            (
                s,
                t.record_path(id, Stream::Out),
                t.record_path(id, Stream::Err),
                t.limits.call,
            )
        };
        let stdout = part(id, out_path, out_off as u64, s.out.len, call).await?;
        let stderr = part(id, err_path, err_off as u64, s.err.len, call).await?;
        let truncated = (out_off as u64 + stdout.len() as u64) < s.out.len
            || (err_off as u64 + stderr.len() as u64) < s.err.len;
        let mut r = bare(id, &s, out_off, err_off);
        r.stdout = stdout;
        r.stderr = stderr;
        r.truncated = truncated;
        Ok(r)
    }

    /// Streams command `id`'s output from the offsets as it comes, then its end: the
    /// messages of StreamShell (`started` first when `started`) and StreamOutput.
    /// Errors: `not_found` at once for an unknown command, later in the stream if evicted.
    pub fn stream(
        self: &Arc<Self>,
        id: i64,
        out_off: i64,
        err_off: i64,
        started: bool,
    ) -> Result<mpsc::Receiver<Result<pb::ShellChunk, tonic::Status>>, Failure> {
        if out_off < 0 || err_off < 0 {
            return Err(Failure::invalid("offsets must be >= 0"));
        }
        let mut changed = lock(&self.table)
            .subscribe(id)
            .ok_or_else(|| not_found(id))?;
        let (tx, rx) = mpsc::channel(4);
        let me = self.clone();
        tokio::spawn(async move {
            use pb::shell_chunk::Kind;
            if started {
                let first = pb::ShellChunk {
                    kind: Some(Kind::Started(id)),
                    offset: 0,
                };
                if tx.send(Ok(first)).await.is_err() {
                    return;
                }
            }
            let (mut o, mut e) = (out_off as u64, err_off as u64);
            loop {
                let Some(s) = me.snap(id) else {
                    let _ = tx.send(Err(crate::rpc::to_status(&not_found(id)))).await;
                    return;
                };
                for (which, off, len) in [
                    (Stream::Out, &mut o, s.out.len),
                    (Stream::Err, &mut e, s.err.len),
                ] {
                    while *off < len {
                        let path = lock(&me.table).record_path(id, which);
                        let data = match read_record(path, *off, (len - *off).min(CHUNK)).await {
                            Ok(d) if !d.is_empty() => d,
                            Ok(_) => break,
                            Err(_) => {
                                let _ = tx.send(Err(crate::rpc::to_status(&not_found(id)))).await;
                                return;
                            }
                        };
                        let at = *off as i64;
                        *off += data.len() as u64;
                        let kind = match which {
                            Stream::Out => Kind::Stdout(data),
                            Stream::Err => Kind::Stderr(data),
                        };
                        let msg = pb::ShellChunk {
                            kind: Some(kind),
                            offset: at,
                        };
                        if tx.send(Ok(msg)).await.is_err() {
                            return;
                        }
                    }
                }
                if s.done && o >= s.out.len && e >= s.err.len {
                    let end = pb::ShellChunk {
                        kind: Some(Kind::Exit(bare(id, &s, o as i64, e as i64))),
                        offset: 0,
                    };
                    let _ = tx.send(Ok(end)).await;
                    return;
                }
                tokio::select! {
                    r = changed.changed() => if r.is_err() {
                        let _ = tx.send(Err(crate::rpc::to_status(&not_found(id)))).await;
                        return;
                    },
                    _ = tx.closed() => return,
                }
            }
        });
        Ok(rx)
    }
}

/// The result fields of a snapshot, without output.
/// Writes `data` to a new file `path` (0600), replacing one that was there.
fn write_private(path: &Path, data: &[u8]) -> std::io::Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut file| std::io::Write::write_all(&mut file, data))
}

fn bare(id: i64, s: &Snap, out_off: i64, err_off: i64) -> pb::ShellResult {
    pb::ShellResult {
        cmd_id: id,
        exit_code: s.exit_code,
        stdout: vec![],
        stderr: vec![],
        done: s.done,
        timed_out: s.timed_out,
        oom_killed: s.oom_killed,
        state_lost: s.state_lost,
        duration: s.duration,
        truncated: false,
        dropped_bytes: (s.out.dropped + s.err.dropped) as i64,
        stdout_offset: out_off,
        stderr_offset: err_off,
        stdout_total: s.out.len as i64,
        stderr_total: s.err.len as i64,
    }
}

fn not_found(id: i64) -> Failure {
    Failure::not_found(format!(
        "command {id} is not in this session (unknown, or its output was evicted)"
    ))
}

async fn part(id: i64, path: PathBuf, off: u64, len: u64, call: u64) -> Result<Vec<u8>, Failure> {
    if off >= len {
        return Ok(vec![]);
    }
    read_record(path, off, (len - off).min(call))
        .await
        .map_err(|_| not_found(id))
}

/// Reads one stream of command `id` from its FIFO into its record until end of file; on a
/// drain request (the command ended) it first takes in all that is buffered, then
/// acknowledges. Readers outlive their command while a process it left behind still holds
/// the FIFO, so late output is recorded too.
async fn pump(
    s: Arc<Session>,
    id: i64,
    which: Stream,
    rx: pipe::Receiver,
    mut rec: std::fs::File,
    mut drain: oneshot::Receiver<oneshot::Sender<()>>,
) {
    let mut buf = vec![0u8; 64 << 10];
    let mut pending = true;
    loop {
        tokio::select! {
            r = rx.readable() => {
                if r.is_err() {
                    return;
                }
                match take_with(&s, id, which, &mut rec, &mut buf, ready_read(&rx)) {
                    Taken::Eof => return,
                    Taken::More => tokio::task::yield_now().await,
                    Taken::Empty => {}
                }
            }
            ack = &mut drain, if pending => {
                pending = false;
                let mut eof = false;
                loop {
                    match take_with(&s, id, which, &mut rec, &mut buf, raw_read(&rx)) {
                        Taken::Eof => { eof = true; break; }
                        Taken::More => continue,
                        Taken::Empty => break,
                    }
                }
                if let Ok(ack) = ack {
                    let _ = ack.send(());
                }
                if eof {
                    return;
                }
            }
        }
    }
}

enum Taken {
    /// The FIFO is empty for now.
    Empty,
    /// Stopped after a turn's worth of reads; more may be waiting.
    More,
    /// No writer is left.
    Eof,
}

/// Why one read of a FIFO read nothing (its end is `Ok(0)`).
enum Read {
    /// Nothing is there now.
    Empty,
    /// Interrupted: read again.
    Again,
    /// The FIFO cannot be read any more.
    Broken,
}

/// Up to a turn's worth of reads with `read`, each appended to command `id`'s record of
/// `which`.
fn take_with(
    s: &Session,
    id: i64,
    which: Stream,
    rec: &mut std::fs::File,
    buf: &mut [u8],
    mut read: impl FnMut(&mut [u8]) -> Result<usize, Read>,
) -> Taken {
    for _ in 0..READS_PER_TURN {
        match read(buf) {
            Ok(0) => return Taken::Eof,
            Ok(n) => {
                if let Err(e) =
                    lock(&s.table).append(id, which, buf.get(..n).unwrap_or_default(), rec)
                {
                    tracing::warn!(cmd_id = id, error = %crate::types::chain(&e), "cannot write an output record");
                }
            }
            Err(Read::Empty) => return Taken::Empty,
            Err(Read::Again) => {}
            Err(Read::Broken) => return Taken::Eof,
        }
    }
    Taken::More
}

/// Reads `rx` itself rather than through tokio's readiness ([`ready_read`]): at a
/// command's end its output is in the pipe, yet the reactor may not have seen it (under
/// load it often has not), and `try_read` answers `WouldBlock` from that stale readiness
/// without reading, which returned commands with their output missing.
fn raw_read(rx: &pipe::Receiver) -> impl FnMut(&mut [u8]) -> Result<usize, Read> + '_ {
    move |b| {
        nix::unistd::read(rx, b).map_err(|e| match e {
            nix::errno::Errno::EAGAIN => Read::Empty,
            nix::errno::Errno::EINTR => Read::Again,
            _ => Read::Broken,
        })
    }
}

/// Reads `rx` as far as tokio saw it readable.
fn ready_read(rx: &pipe::Receiver) -> impl FnMut(&mut [u8]) -> Result<usize, Read> + '_ {
    move |b| {
        rx.try_read(b).map_err(|e| match e.kind() {
            std::io::ErrorKind::WouldBlock => Read::Empty,
            std::io::ErrorKind::Interrupted => Read::Again,
            _ => Read::Broken,
        })
    }
}

/// Makes the session's working directories and control FIFO under `dir`.
/// Errors: the file system's.
pub fn make_dirs(dir: &Path) -> std::io::Result<()> {
    for sub in ["cmd", "io", "rec", "state"] {
        let p = dir.join(sub);
        if p.exists() {
            std::fs::remove_dir_all(&p)?;
        }
        std::fs::DirBuilder::new().mode(0o700).create(&p)?;
    }
    let ctl = dir.join("ctl");
    let _ = std::fs::remove_file(&ctl);
    nix::unistd::mkfifo(&ctl, Mode::from_bits_truncate(0o600)).map_err(std::io::Error::from)
}

/// Whether the state file at `p` says its command changed nothing.
fn is_unchanged(p: &std::path::Path) -> bool {
    let short = std::fs::metadata(p).is_ok_and(|m| m.len() == shell::UNCHANGED_STATE.len() as u64);
    short && std::fs::read(p).is_ok_and(|b| b == shell::UNCHANGED_STATE)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::io::Write;

    /// Output already in the FIFO when the command ends is in its result, even when the
    /// reactor has not yet seen it readable (a current-thread runtime that never parked
    /// between the write and the end is that case, every time).
    #[tokio::test(flavor = "current_thread")]
    async fn output_in_the_fifo_at_the_end_is_taken_in() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("s");
        std::fs::create_dir(&dir).unwrap();
        make_dirs(&dir).unwrap();
        let (s, _jobs) = Session::new(
            dir.clone(),
            Limits::default(),
            tmp.path().to_path_buf(),
            shell::Flavor::Bash,
            None,
        );
        let id = s
            .start(&pb::RunShellRequest {
                cmd: "true".into(),
                ..Default::default()
            })
            .unwrap();
        let mut w = std::fs::OpenOptions::new()
            .write(true)
            .open(dir.join("io").join(format!("{id}.out")))
            .unwrap();
        w.write_all(b"grep says this\n--\nand that\n").unwrap();
        drop(w);
        s.finish(id, 0, false, false).await;
        let r = s.result(id, 0, 0).await.unwrap();
        assert!(r.done);
        assert_eq!(r.stdout, b"grep says this\n--\nand that\n");
    }
}
