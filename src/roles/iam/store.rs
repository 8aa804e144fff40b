//! The standalone store: the state in memory behind a read-write lock, and one writer thread
//! that applies queued commands in batches. With a state file, each batch's commands are
//! appended to `<state>.log` and fsynced once before any caller of the batch is answered
//! (group commit); every `snapshot_every` commands a full snapshot is written (temp file,
//! fsync, rename) and the log truncated. At open: load the snapshot, replay the log (a torn
//! last line is dropped: it was never acknowledged). A SIGKILL loses no acknowledged command.
//!
//! Files: `<state>` = `{"seq": N, "state": {...}}` (the state after command N);
//! `<state>.log` = one `{"seq": n, "cmd": {...}}` line per applied command; `<state>.tmp`
//! while a snapshot is written. The log is locked (flock) so two IAMs cannot share a state.

use std::fs::{File, OpenOptions};
use std::io::{BufWriter, Read, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use super::apply::apply;
use super::command::{Command, Outcome};
use super::state::IamState;
use super::IamError;
use crate::types::Failure;

/// Most commands one batch (one fsync) takes.
const MAX_BATCH: usize = 256;
/// Commands waiting for the writer before proposers wait.
const QUEUE: usize = 8192;

/// Tuning of the store.
#[derive(Debug, Clone)]
pub struct StoreOptions {
    /// Write a snapshot and truncate the log after this many commands (default 10000).
    pub snapshot_every: u64,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            snapshot_every: 10_000,
        }
    }
}

struct Job {
    cmd: Command,
    reply: oneshot::Sender<Result<Outcome, Failure>>,
}

enum Msg {
    Cmd(Box<Job>),
    Close(oneshot::Sender<()>),
}

struct Shared {
    state: RwLock<IamState>,
    failed: AtomicBool,
}

/// Handle on the store; clones share it.
#[derive(Clone)]
pub struct Store {
    shared: Arc<Shared>,
    tx: mpsc::Sender<Msg>,
}

#[derive(Serialize)]
struct SnapshotRef<'a> {
    seq: u64,
    state: &'a IamState,
}

#[derive(Deserialize)]
struct SnapshotOwned {
    seq: u64,
    state: IamState,
}

#[derive(Serialize)]
struct EntryRef<'a> {
    seq: u64,
    cmd: &'a Command,
}

#[derive(Deserialize)]
struct EntryOwned {
    seq: u64,
    cmd: Command,
}

/// The log's path for a state file.
pub fn log_path(state: &Path) -> PathBuf {
    let mut s = state.as_os_str().to_owned();
    s.push(".log");
    PathBuf::from(s)
}

fn tmp_path(state: &Path) -> PathBuf {
    let mut s = state.as_os_str().to_owned();
    s.push(".tmp");
    PathBuf::from(s)
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> IamError {
    let path = path.to_path_buf();
    move |source| IamError::Io { what, path, source }
}

/// The durable side of the writer: the open, locked log and the snapshot path.
struct Files {
    state: PathBuf,
    log: File,
    seq: u64,
    since_snapshot: u64,
}

impl Store {
    /// Opens the store: memory only with `path` `None`, else loads `path` and replays its log.
    /// Blocking (file I/O); errors name the file (`IamError::Io`, `Snapshot`, `Log`, `Locked`).
    pub fn open(path: Option<&Path>, opts: StoreOptions) -> Result<Store, IamError> {
        let (state, files) = match path {
            None => (IamState::default(), None),
            Some(p) => {
                let (st, f) = load(p)?;
                (st, Some(f))
            }
        };
        metrics::gauge!("opendsec_iam_leases").set(state.leases.len() as f64);
        let shared = Arc::new(Shared {
            state: RwLock::new(state),
            failed: AtomicBool::new(false),
        });
        let (tx, rx) = mpsc::channel(QUEUE);
        let sh = shared.clone();
        std::thread::Builder::new()
            .name("iam-writer".into())
            .spawn(move || writer(sh, rx, files, opts))
            .map_err(|source| IamError::Io {
                what: "starting the writer thread",
                path: PathBuf::new(),
                source,
            })?;
        Ok(Store { shared, tx })
    }

    /// Reads the state. Hold the guard briefly: the writer waits for it.
    pub fn read(&self) -> RwLockReadGuard<'_, IamState> {
        self.shared
            .state
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Queues a command and waits until it is applied (and durable, with a state file).
    /// `Err` is the command's own failure, or `unavailable` when the store is closed or failed.
    pub async fn propose(&self, cmd: Command) -> Result<Outcome, Failure> {
        if self.shared.failed.load(Ordering::Relaxed) {
            return Err(Failure::unavailable(
                "IAM store failed to persist; restart IAM",
            ));
        }
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Msg::Cmd(Box::new(Job { cmd, reply })))
            .await
            .map_err(|_| Failure::unavailable("IAM store is closed"))?;
        rx.await
            .map_err(|_| Failure::unavailable("IAM store closed before answering"))?
    }

    /// True once a write failed: the store answers `unavailable` from then on.
    pub fn failed(&self) -> bool {
        self.shared.failed.load(Ordering::Relaxed)
    }

    /// Stops the writer after the commands queued so far; returns once its files are closed
    /// (and unlocked), so the same state file can be opened again.
    pub async fn close(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Close(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }
}

/// Loads the snapshot and replays the log; locks the log.
fn load(path: &Path) -> Result<(IamState, Files), IamError> {
    let (mut state, mut seq) =
        match File::open(path) {
            Ok(f) => {
                let snap: SnapshotOwned = serde_json::from_reader(std::io::BufReader::new(f))
                    .map_err(|source| IamError::Snapshot {
                        path: path.to_path_buf(),
                        source,
                    })?;
                (snap.state, snap.seq)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (IamState::default(), 0),
            Err(e) => return Err(io_err("reading the snapshot", path)(e)),
        };
    state.rebuild_index();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(io_err("creating the state directory", dir))?;
    }
    let lp = log_path(path);
    // Token hashes live here: owner-only.
    let mut log = OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .mode(0o600)
        .open(&lp)
        .map_err(io_err("opening the log", &lp))?;
    match log.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Err(IamError::Locked { path: lp }),
        Err(std::fs::TryLockError::Error(e)) => return Err(io_err("locking the log", &lp)(e)),
    }
    let mut bytes = Vec::new();
    log.read_to_end(&mut bytes)
        .map_err(io_err("reading the log", &lp))?;
    let mut good = 0usize;
    let mut line_no = 0usize;
    while let Some(rest) = bytes.get(good..).filter(|r| !r.is_empty()) {
        let Some(nl) = rest.iter().position(|b| *b == b'\n') else {
            tracing::warn!(path = %lp.display(), bytes = bytes.len() - good, "dropping a torn last log line (never acknowledged)");
            break;
        };
        line_no += 1;
        let line = rest.get(..nl).unwrap_or_default();
        let entry: EntryOwned = match serde_json::from_slice(line) {
            Ok(e) => e,
            Err(e) if good + nl + 1 == bytes.len() => {
                tracing::warn!(path = %lp.display(), error = %crate::types::chain(&e), "dropping an unreadable last log line");
                break;
            }
            Err(e) => {
                return Err(IamError::Log {
                    path: lp,
                    line: line_no,
                    message: crate::types::chain(&e),
                })
            }
        };
        if entry.seq > seq {
            if entry.seq != seq + 1 {
                return Err(IamError::Log {
                    path: lp,
                    line: line_no,
                    message: format!("sequence jumps from {seq} to {}", entry.seq),
                });
            }
            if let Err(f) = apply(&mut state, &entry.cmd) {
                // Only applied commands are logged, and apply is deterministic.
                tracing::warn!(seq = entry.seq, error = %f, "a logged command no longer applies");
            }
            seq = entry.seq;
        }
        good += nl + 1;
    }
    if good < bytes.len() {
        log.set_len(good as u64)
            .map_err(io_err("truncating the torn log", &lp))?;
        log.sync_all().map_err(io_err("syncing the log", &lp))?;
    }
    tracing::info!(path = %path.display(), seq, replayed = line_no, "IAM state loaded");
    Ok((
        state,
        Files {
            state: path.to_path_buf(),
            log,
            seq,
            since_snapshot: line_no as u64,
        },
    ))
}

/// Writes a snapshot durably: temp file, fsync, rename, fsync of the directory.
fn write_snapshot(path: &Path, seq: u64, state: &IamState) -> Result<(), IamError> {
    let tmp = tmp_path(path);
    let f = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(io_err("creating the snapshot", &tmp))?;
    let mut w = BufWriter::with_capacity(1 << 20, f);
    serde_json::to_writer(&mut w, &SnapshotRef { seq, state }).map_err(|source| {
        IamError::Snapshot {
            path: tmp.clone(),
            source,
        }
    })?;
    let f = w
        .into_inner()
        .map_err(|e| io_err("writing the snapshot", &tmp)(e.into_error()))?;
    f.sync_all().map_err(io_err("syncing the snapshot", &tmp))?;
    std::fs::rename(&tmp, path).map_err(io_err("renaming the snapshot", path))?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_err("syncing the state directory", dir))?;
    Ok(())
}

impl Files {
    /// Appends a batch's lines and fsyncs once.
    fn append(&mut self, lines: &[u8]) -> Result<(), IamError> {
        let lp = log_path(&self.state);
        self.log
            .write_all(lines)
            .map_err(io_err("appending to the log", &lp))?;
        self.log.sync_data().map_err(io_err("syncing the log", &lp))
    }

    /// Snapshots the state and empties the log.
    fn snapshot(&mut self, shared: &Shared) -> Result<(), IamError> {
        {
            let st = shared.state.read().unwrap_or_else(PoisonError::into_inner);
            write_snapshot(&self.state, self.seq, &st)?;
        }
        let lp = log_path(&self.state);
        self.log
            .set_len(0)
            .map_err(io_err("truncating the log", &lp))?;
        self.log
            .sync_all()
            .map_err(io_err("syncing the log", &lp))?;
        self.since_snapshot = 0;
        tracing::info!(path = %self.state.display(), seq = self.seq, "IAM snapshot written");
        Ok(())
    }
}

/// The writer thread: batches, applies, persists, answers.
fn writer(
    shared: Arc<Shared>,
    mut rx: mpsc::Receiver<Msg>,
    mut files: Option<Files>,
    opts: StoreOptions,
) {
    let mut close: Option<oneshot::Sender<()>> = None;
    while close.is_none() {
        let Some(first) = rx.blocking_recv() else {
            break;
        };
        let mut batch: Vec<Box<Job>> = Vec::with_capacity(MAX_BATCH);
        match first {
            Msg::Cmd(j) => batch.push(j),
            Msg::Close(c) => close = Some(c),
        }
        while close.is_none() && batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(Msg::Cmd(j)) => batch.push(j),
                Ok(Msg::Close(c)) => close = Some(c),
                Err(_) => break,
            }
        }
        if batch.is_empty() {
            continue;
        }
        let mut results = Vec::with_capacity(batch.len());
        let mut lines = Vec::new();
        let mut leases = 0usize;
        for job in &batch {
            let r = {
                let mut st = shared.state.write().unwrap_or_else(PoisonError::into_inner);
                let r = apply(&mut st, &job.cmd);
                leases = st.leases.len();
                r
            };
            if r.is_ok() {
                if let Some(f) = files.as_mut() {
                    f.seq += 1;
                    f.since_snapshot += 1;
                    if let Err(e) = serde_json::to_writer(
                        &mut lines,
                        &EntryRef {
                            seq: f.seq,
                            cmd: &job.cmd,
                        },
                    ) {
                        tracing::error!(error = %crate::types::chain(&e), "encoding a command for the log");
                    }
                    lines.push(b'\n');
                }
            }
            results.push(r);
        }
        metrics::gauge!("opendsec_iam_leases").set(leases as f64);
        let persisted = match files.as_mut() {
            Some(f) if !lines.is_empty() => f.append(&lines),
            _ => Ok(()),
        };
        if let Err(e) = persisted {
            tracing::error!(error = %crate::types::chain(&e), "IAM could not persist a batch; refusing further changes");
            shared.failed.store(true, Ordering::Relaxed);
            for job in batch {
                let _ = job.reply.send(Err(Failure::internal(format!(
                    "IAM could not persist the change: {e}",
                    e = crate::types::chain(&e)
                ))));
            }
            break;
        }
        for (job, r) in batch.into_iter().zip(results) {
            let _ = job.reply.send(r);
        }
        if let Some(f) = files.as_mut() {
            if f.since_snapshot >= opts.snapshot_every.max(1) {
                if let Err(e) = f.snapshot(&shared) {
                    // The log still holds everything: keep going, try again later.
                    tracing::error!(error = %crate::types::chain(&e), "IAM snapshot failed; the log keeps growing");
                    f.since_snapshot = 0;
                }
            }
        }
    }
    // Answer whatever is still queued, then release the files (and the lock).
    rx.close();
    while let Ok(m) = rx.try_recv() {
        match m {
            Msg::Cmd(j) => {
                let _ = j
                    .reply
                    .send(Err(Failure::unavailable("IAM store is closed")));
            }
            Msg::Close(c) => {
                let _ = c.send(());
            }
        }
    }
    drop(files);
    if let Some(c) = close {
        let _ = c.send(());
    }
}

#[cfg(test)]
mod tests {
    use super::super::command::{AdmitItem, NewToken};
    use super::super::state::{Actor, ROOT};
    use super::super::tokens::hash_secret;
    use super::*;
    use crate::types::{Reason, Res};

    const NOW: i64 = 1_790_000_000;

    fn admin() -> Actor {
        Actor {
            principal: "admin".into(),
            token_id: "primary".into(),
            secret_hash: hash_secret("s"),
        }
    }

    fn bootstrap() -> Command {
        Command::Bootstrap {
            admin_id: "admin".into(),
            admin_token: Some(NewToken {
                id: "primary".into(),
                hash: hash_secret("s"),
            }),
            root_quota: Default::default(),
            max_token_ttl_s: 0,
            now: NOW,
        }
    }

    fn project(name: &str) -> Command {
        Command::CreateProject {
            actor: admin(),
            parent: ROOT.into(),
            name: name.into(),
            quota: Default::default(),
            now: NOW,
        }
    }

    fn admit(lease: &str) -> Command {
        let item = AdmitItem {
            lease_id: lease.into(),
            project: ROOT.into(),
            resources: Res {
                cpu_cores: 1.0,
                ..Default::default()
            },
            edge_id: "e1".into(),
            sandbox_id: format!("e1.{lease}"),
            keep_binding: false,
            spec_digest: String::new(),
        };
        Command::Admit {
            actor: admin(),
            image_project: String::new(),
            items: vec![item],
            now: NOW,
        }
    }

    fn state_file(dir: &tempfile::TempDir) -> PathBuf {
        dir.path().join("iam.json")
    }

    async fn run(store: &Store, cmds: Vec<Command>) {
        for c in cmds {
            store.propose(c).await.expect("command applies");
        }
    }

    #[tokio::test]
    async fn memory_only_store_applies_commands() {
        let s = Store::open(None, StoreOptions::default()).unwrap();
        run(&s, vec![bootstrap(), project("a")]).await;
        assert!(s.read().projects.contains_key("root/a"));
        let e = s.propose(project("a")).await.unwrap_err();
        assert_eq!(e.reason, Reason::Conflict);
        s.close().await;
        assert_eq!(
            s.propose(project("b")).await.unwrap_err().reason,
            Reason::Unavailable
        );
    }

    #[tokio::test]
    async fn committed_state_survives_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let path = state_file(&dir);
        let s = Store::open(Some(&path), StoreOptions::default()).unwrap();
        run(&s, vec![bootstrap(), project("a"), admit("l1")]).await;
        // A refused command is not logged.
        assert!(s.propose(project("a")).await.is_err());
        let before = s.read().clone();
        s.close().await;
        let s2 = Store::open(Some(&path), StoreOptions::default()).unwrap();
        assert_eq!(*s2.read(), before);
        assert_eq!(s2.read().leases_on("e1"), vec!["l1".to_string()]);
        s2.close().await;
    }

    #[tokio::test]
    async fn state_files_are_owner_only_and_their_directory_is_created() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nested/iam.json");
        let s = Store::open(Some(&path), StoreOptions { snapshot_every: 1 }).unwrap();
        run(&s, vec![bootstrap()]).await;
        s.close().await;
        for p in [path.clone(), log_path(&path)] {
            let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
            assert_eq!(mode, 0o600, "{}", p.display());
        }
    }

    #[tokio::test]
    async fn a_second_store_on_the_same_file_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = state_file(&dir);
        let s = Store::open(Some(&path), StoreOptions::default()).unwrap();
        assert!(matches!(
            Store::open(Some(&path), StoreOptions::default()),
            Err(IamError::Locked { .. })
        ));
        s.close().await;
        Store::open(Some(&path), StoreOptions::default())
            .unwrap()
            .close()
            .await;
    }

    #[tokio::test]
    async fn a_torn_last_line_is_dropped_and_the_log_stays_usable() {
        let dir = tempfile::tempdir().unwrap();
        let path = state_file(&dir);
        let s = Store::open(Some(&path), StoreOptions::default()).unwrap();
        run(&s, vec![bootstrap(), project("a")]).await;
        let before = s.read().clone();
        s.close().await;
        let lp = log_path(&path);
        let mut f = OpenOptions::new().append(true).open(&lp).unwrap();
        f.write_all(br#"{"seq":3,"cmd":{"op":"create_pro"#).unwrap();
        drop(f);
        let s = Store::open(Some(&path), StoreOptions::default()).unwrap();
        assert_eq!(*s.read(), before);
        run(&s, vec![project("b")]).await;
        let after = s.read().clone();
        s.close().await;
        let s = Store::open(Some(&path), StoreOptions::default()).unwrap();
        assert_eq!(*s.read(), after);
        s.close().await;
    }

    #[tokio::test]
    async fn a_corrupt_line_inside_the_log_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        let path = state_file(&dir);
        let s = Store::open(Some(&path), StoreOptions::default()).unwrap();
        run(&s, vec![bootstrap(), project("a")]).await;
        s.close().await;
        let lp = log_path(&path);
        let text = std::fs::read_to_string(&lp).unwrap();
        std::fs::write(&lp, format!("garbage\n{text}")).unwrap();
        assert!(matches!(
            Store::open(Some(&path), StoreOptions::default()),
            Err(IamError::Log { line: 1, .. })
        ));
    }

    #[tokio::test]
    async fn snapshots_truncate_the_log_and_replay_skips_what_they_hold() {
        let dir = tempfile::tempdir().unwrap();
        let path = state_file(&dir);
        let s = Store::open(Some(&path), StoreOptions { snapshot_every: 3 }).unwrap();
        let cmds: Vec<Command> = std::iter::once(bootstrap())
            .chain((0..7).map(|i| project(&format!("p{i}"))))
            .collect();
        run(&s, cmds.clone()).await;
        let fin = s.read().clone();
        s.close().await;
        assert!(path.exists());
        let lines = std::fs::read_to_string(log_path(&path))
            .unwrap()
            .lines()
            .count();
        assert!(lines < 3, "log not truncated: {lines} lines");
        let s = Store::open(Some(&path), StoreOptions::default()).unwrap();
        assert_eq!(*s.read(), fin);
        s.close().await;

        // A crash between the snapshot's rename and the log's truncation: the log still holds
        // commands the snapshot already contains. They must not apply twice.
        let dir = tempfile::tempdir().unwrap();
        let path = state_file(&dir);
        let s = Store::open(Some(&path), StoreOptions::default()).unwrap();
        run(
            &s,
            vec![
                bootstrap(),
                admit("l1"),
                admit("l2"),
                project("x"),
                admit("l3"),
            ],
        )
        .await;
        let fin = s.read().clone();
        s.close().await;
        let mut at3 = IamState::default();
        for c in [bootstrap(), admit("l1"), admit("l2")] {
            apply(&mut at3, &c).unwrap();
        }
        write_snapshot(&path, 3, &at3).unwrap();
        let s = Store::open(Some(&path), StoreOptions::default()).unwrap();
        assert_eq!(*s.read(), fin);
        assert_eq!(s.read().projects[ROOT].usage.sandboxes, 3);
        s.close().await;
    }

    #[tokio::test]
    async fn fractional_values_reload_exactly_from_snapshot_and_log() {
        let dir = tempfile::tempdir().unwrap();
        let path = state_file(&dir);
        let s = Store::open(Some(&path), StoreOptions { snapshot_every: 3 }).unwrap();
        run(&s, vec![bootstrap()]).await;
        for (i, cpu) in [0.1, 0.7, 1.0 / 3.0, 2.0 / 7.0, 1e-7, 123.456789]
            .into_iter()
            .enumerate()
        {
            let mut c = admit(&format!("f{i}"));
            if let Command::Admit { items, .. } = &mut c {
                items[0].resources.cpu_cores = cpu;
            }
            run(&s, vec![c]).await;
        }
        run(
            &s,
            vec![Command::ReleaseLeases {
                lease_ids: vec!["f1".into(), "f3".into()],
                at: NOW + 4321,
                now: NOW + 7777,
                not_created: false,
            }],
        )
        .await;
        let before = s.read().clone();
        s.close().await;
        let s = Store::open(Some(&path), StoreOptions::default()).unwrap();
        assert_eq!(*s.read(), before);
        s.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_proposals_are_all_committed() {
        let dir = tempfile::tempdir().unwrap();
        let path = state_file(&dir);
        let s = Store::open(Some(&path), StoreOptions { snapshot_every: 50 }).unwrap();
        run(&s, vec![bootstrap()]).await;
        let mut tasks = Vec::new();
        for t in 0..8 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..40 {
                    s.propose(admit(&format!("l{t}-{i}"))).await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        assert_eq!(s.read().leases.len(), 320);
        s.close().await;
        let s = Store::open(Some(&path), StoreOptions::default()).unwrap();
        assert_eq!(s.read().leases.len(), 320);
        assert_eq!(s.read().projects[ROOT].usage.sandboxes, 320);
        s.close().await;
    }
}
