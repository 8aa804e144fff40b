//! A session's commands and their output records (22-components §11 "Output limits"): each
//! stream of each command is appended to a record file in the session dir, up to a per
//! stream limit (the rest is counted in `dropped`); the session's records are bounded too,
//! the records of the oldest finished commands going first.

use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use tokio::sync::{oneshot, watch};

/// Output limits in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Recorded bytes per stream of one command (64 MiB).
    pub record: u64,
    /// Recorded bytes of all the session's commands together (512 MiB).
    pub session: u64,
    /// Bytes per stream returned by one RunShell/GetOutput answer (16 MiB).
    pub call: u64,
}

/// The environment variable through which tests lower the limits:
/// `record,session,call` in bytes, read once at start.
pub const LIMITS_ENV: &str = "OPENDSEC_CHRONUS_LIMITS";

impl Default for Limits {
    fn default() -> Self {
        Limits {
            record: 64 << 20,
            session: 512 << 20,
            call: 16 << 20,
        }
    }
}

impl Limits {
    /// The defaults, or the values of [`LIMITS_ENV`] when it holds three positive numbers.
    pub fn from_env() -> Limits {
        std::env::var(LIMITS_ENV)
            .ok()
            .and_then(|v| Limits::parse(&v))
            .unwrap_or_default()
    }

    /// Parses `record,session,call`; `None` unless all three are positive integers.
    pub fn parse(v: &str) -> Option<Limits> {
        let n: Vec<u64> = v
            .split(',')
            .map(|x| x.trim().parse::<u64>().ok().filter(|n| *n > 0))
            .collect::<Option<Vec<u64>>>()?;
        match n.as_slice() {
            [record, session, call] => Some(Limits {
                record: *record,
                session: *session,
                call: *call,
            }),
            _ => None,
        }
    }
}

/// Which output stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Out,
    Err,
}

impl Stream {
    fn ext(self) -> &'static str {
        match self {
            Stream::Out => "out",
            Stream::Err => "err",
        }
    }
}

/// One stream's record: bytes recorded (the file's length) and bytes dropped past a limit.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rec {
    pub len: u64,
    pub dropped: u64,
}

/// A command of the session.
pub struct Cmd {
    pub background: bool,
    pub request_id: String,
    pub started: Instant,
    pub out: Rec,
    pub err: Rec,
    /// Set once the end is known and the output read in (see `finish`).
    pub done: bool,
    /// Set when `finish` began; a second finish is ignored.
    pub finishing: bool,
    pub exit_code: i32,
    pub timed_out: bool,
    /// Seconds from start to end.
    pub duration: f64,
    /// The pid of a background command's subshell, once the shell reported it.
    pub pid: Option<i32>,
    /// Bumped on new output and at the end; waiters subscribe.
    pub changed: watch::Sender<u64>,
    /// Write ends of the command's FIFOs held by chronus until the command ends, so the
    /// readers see no end of file before the shell opened them.
    pub keepers: Vec<OwnedFd>,
    /// Asks each stream's reader to read what is buffered and acknowledge.
    pub drains: Vec<oneshot::Sender<oneshot::Sender<()>>>,
}

/// A snapshot of a command, taken under the lock.
#[derive(Debug, Clone, Copy)]
pub struct Snap {
    pub out: Rec,
    pub err: Rec,
    pub done: bool,
    pub exit_code: i32,
    pub timed_out: bool,
    pub duration: f64,
    pub background: bool,
    pub pid: Option<i32>,
}

/// Finished commands kept (their metadata) beyond which the oldest are forgotten even if
/// their records are small.
const MAX_FINISHED: usize = 10_000;

/// The session's commands; guarded by one mutex in `Session`.
pub struct Table {
    pub limits: Limits,
    rec_dir: PathBuf,
    next_id: i64,
    cmds: BTreeMap<i64, Cmd>,
    by_request: HashMap<String, i64>,
    total: u64,
}

impl Table {
    /// An empty table whose records live in `rec_dir`.
    pub fn new(rec_dir: PathBuf, limits: Limits) -> Table {
        Table {
            limits,
            rec_dir,
            next_id: 1,
            cmds: BTreeMap::new(),
            by_request: HashMap::new(),
            total: 0,
        }
    }

    /// The record file of one stream of command `id`.
    pub fn record_path(&self, id: i64, s: Stream) -> PathBuf {
        record_path(&self.rec_dir, id, s)
    }

    /// The command a request id already started, if any.
    pub fn by_request(&self, request_id: &str) -> Option<i64> {
        if request_id.is_empty() {
            return None;
        }
        self.by_request.get(request_id).copied()
    }

    /// Adds a command and returns its id (1, 2, ...).
    pub fn insert(&mut self, background: bool, request_id: &str) -> (i64, watch::Receiver<u64>) {
        self.forget_old();
        let id = self.next_id;
        self.next_id += 1;
        let (changed, rx) = watch::channel(0);
        self.cmds.insert(
            id,
            Cmd {
                background,
                request_id: request_id.to_string(),
                started: Instant::now(),
                out: Rec::default(),
                err: Rec::default(),
                done: false,
                finishing: false,
                exit_code: -1,
                timed_out: false,
                duration: 0.0,
                pid: None,
                changed,
                keepers: vec![],
                drains: vec![],
            },
        );
        if !request_id.is_empty() {
            self.by_request.insert(request_id.to_string(), id);
        }
        (id, rx)
    }

    /// Removes a command whose setup failed.
    pub fn remove(&mut self, id: i64) {
        self.evict(id);
    }

    pub fn get_mut(&mut self, id: i64) -> Option<&mut Cmd> {
        self.cmds.get_mut(&id)
    }

    /// Subscribes to a command's changes.
    pub fn subscribe(&self, id: i64) -> Option<watch::Receiver<u64>> {
        self.cmds.get(&id).map(|c| c.changed.subscribe())
    }

    pub fn snap(&self, id: i64) -> Option<Snap> {
        self.cmds.get(&id).map(|c| Snap {
            out: c.out,
            err: c.err,
            done: c.done,
            exit_code: c.exit_code,
            timed_out: c.timed_out,
            duration: c.duration,
            background: c.background,
            pid: c.pid,
        })
    }

    /// Pids of the running background commands' subshells.
    pub fn background_pids(&self) -> Vec<i32> {
        self.cmds
            .values()
            .filter(|c| c.background && !c.done)
            .filter_map(|c| c.pid)
            .collect()
    }

    /// Records `data` read from stream `s` of command `id` into `file` (its record),
    /// within the limits; the rest is counted as dropped. Output of a forgotten command is
    /// discarded. Errors: writing the record file.
    pub fn append(
        &mut self,
        id: i64,
        s: Stream,
        data: &[u8],
        file: &mut std::fs::File,
    ) -> std::io::Result<()> {
        let Some(c) = self.cmds.get(&id) else {
            return Ok(());
        };
        let rec = match s {
            Stream::Out => c.out,
            Stream::Err => c.err,
        };
        let n = data.len() as u64;
        let mut take = n.min(self.limits.record.saturating_sub(rec.len));
        if take > 0 && self.total + take > self.limits.session {
            self.evict_for(take, id);
            take = take.min(self.limits.session.saturating_sub(self.total));
        }
        if take > 0 {
            file.write_all(data.get(..take as usize).unwrap_or_default())?;
        }
        self.total += take;
        if let Some(c) = self.cmds.get_mut(&id) {
            let r = match s {
                Stream::Out => &mut c.out,
                Stream::Err => &mut c.err,
            };
            r.len += take;
            r.dropped += n - take;
            c.changed.send_modify(|v| *v += 1);
        }
        Ok(())
    }

    /// Evicts the records of the oldest finished commands (never `keep`) until `need` more
    /// bytes fit in the session's limit, or no finished command is left.
    fn evict_for(&mut self, need: u64, keep: i64) {
        while self.total + need > self.limits.session {
            let oldest = self
                .cmds
                .iter()
                .find(|(id, c)| **id != keep && c.done)
                .map(|(id, _)| *id);
            match oldest {
                Some(id) => self.evict(id),
                None => return,
            }
        }
    }

    /// Forgets command `id`: deletes its records; `get_output` of it is then `not_found`.
    fn evict(&mut self, id: i64) {
        if let Some(c) = self.cmds.remove(&id) {
            self.total = self.total.saturating_sub(c.out.len + c.err.len);
            if !c.request_id.is_empty() {
                self.by_request.remove(&c.request_id);
            }
            let _ = std::fs::remove_file(self.record_path(id, Stream::Out));
            let _ = std::fs::remove_file(self.record_path(id, Stream::Err));
            // Wake waiters so they see it gone.
            c.changed.send_modify(|v| *v += 1);
        }
    }

    fn forget_old(&mut self) {
        let finished = self.cmds.values().filter(|c| c.done).count();
        if finished < MAX_FINISHED {
            return;
        }
        let old: Vec<i64> = self
            .cmds
            .iter()
            .filter(|(_, c)| c.done)
            .take(finished + 1 - MAX_FINISHED)
            .map(|(id, _)| *id)
            .collect();
        for id in old {
            self.evict(id);
        }
    }
}

/// The record file of one stream of command `id` under `rec_dir`.
pub fn record_path(rec_dir: &Path, id: i64, s: Stream) -> PathBuf {
    rec_dir.join(format!("{id}.{}", s.ext()))
}

/// Reads up to `max` bytes of a record from `offset` (fewer at its end). Errors: the file
/// is gone (evicted) or unreadable.
pub async fn read_record(path: PathBuf, offset: u64, max: u64) -> std::io::Result<Vec<u8>> {
    if max == 0 {
        return Ok(vec![]);
    }
    tokio::task::spawn_blocking(move || {
        let f = std::fs::File::open(&path)?;
        let mut buf = vec![0u8; max as usize];
        let mut got = 0usize;
        while let Some(rest) = buf.get_mut(got..).filter(|r| !r.is_empty()) {
            let n = f.read_at(rest, offset + got as u64)?;
            if n == 0 {
                break;
            }
            got += n;
        }
        buf.truncate(got);
        Ok(buf)
    })
    .await
    .map_err(std::io::Error::other)?
}

#[cfg(test)]
mod tests {
    use super::*;

    fn open(t: &Table, id: i64, s: Stream) -> std::fs::File {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(t.record_path(id, s))
            .expect("open")
    }

    #[test]
    fn limits_parse() {
        assert_eq!(
            Limits::parse("10,100,5"),
            Some(Limits {
                record: 10,
                session: 100,
                call: 5
            })
        );
        assert_eq!(Limits::parse("10,100"), None);
        assert_eq!(Limits::parse("10,0,5"), None);
        assert_eq!(Limits::parse("a,b,c"), None);
    }

    #[test]
    fn record_limit_drops_and_session_limit_evicts_oldest_finished() {
        let d = tempfile::tempdir().expect("tempdir");
        let mut t = Table::new(
            d.path().to_path_buf(),
            Limits {
                record: 10,
                session: 25,
                call: 5,
            },
        );
        let (a, _) = t.insert(false, "r1");
        let mut f = open(&t, a, Stream::Out);
        t.append(a, Stream::Out, b"0123456789abc", &mut f)
            .expect("append");
        let s = t.snap(a).expect("snap");
        assert_eq!((s.out.len, s.out.dropped), (10, 3));
        t.get_mut(a).expect("a").done = true;
        let (b, _) = t.insert(false, "");
        let mut f = open(&t, b, Stream::Err);
        t.append(b, Stream::Err, b"0123456789", &mut f)
            .expect("append");
        let (c, _) = t.insert(false, "");
        let mut f = open(&t, c, Stream::Out);
        // 20 recorded + 10 > 25: the finished `a` goes.
        t.append(c, Stream::Out, b"0123456789", &mut f)
            .expect("append");
        assert!(t.snap(a).is_none());
        assert_eq!(t.by_request("r1"), None);
        assert!(!t.record_path(a, Stream::Out).exists());
        assert_eq!(t.snap(c).expect("c").out.len, 10);
        // b and c run: nothing can go, so the rest is dropped.
        t.append(c, Stream::Out, b"", &mut f).expect("append");
        let (e, _) = t.insert(false, "");
        let mut f = open(&t, e, Stream::Out);
        t.append(e, Stream::Out, b"0123456789", &mut f)
            .expect("append");
        let s = t.snap(e).expect("e");
        assert_eq!((s.out.len, s.out.dropped), (5, 5));
    }
}
