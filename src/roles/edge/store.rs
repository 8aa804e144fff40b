//! Durable records (`persist_state`, docs/architecture.md): one
//! file per sandbox, `<state_dir>/edges/<edge_id>/sandboxes/<id>.json`, and the edge's own
//! flags in `<state_dir>/edges/<edge_id>/edge.json`. Every write is temp file → fsync →
//! rename → fsync of the directory. Batches are written concurrently on the blocking pool,
//! with one directory fsync at the end, so thousands of records do not take thousands of
//! sequential fsyncs. The exceptions are a creation's records: its CREATING record is
//! staged without fsync ([`Store::stage_many`]) and its RUNNING or FAILED record is made
//! durable behind the caller's answer ([`Store::write_behind`]); why both are safe is told
//! there.

use std::collections::BTreeSet;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::record::SandboxRecord;

/// A record could not be written, read or removed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("{step} {path}")]
    Io {
        step: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("encoding record of {id}")]
    Encode {
        id: String,
        source: serde_json::Error,
    },
    #[error("writer task for {path} failed: {message}")]
    Join { path: String, message: String },
}

/// The edge's own durable flags.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct EdgeFlagsState {
    pub draining: bool,
}

/// Most blocking writers one batch uses at once.
const WRITERS: usize = 64;

/// One record to write: (index in the call, temp path, final path, encoded bytes).
type WriteJob = (usize, PathBuf, PathBuf, Result<Vec<u8>, StoreError>);

/// A record file that did not parse (renamed to `<name>.corrupt`): its path and the error.
pub type Unreadable = (PathBuf, String);

/// The record directory of one edge.
#[derive(Debug, Clone)]
pub struct Store {
    edge_dir: PathBuf,
    dir: PathBuf,
    seq: Arc<AtomicU64>,
    /// fsync calls made so far (files and directories), for tests and the benchmarks.
    syncs: Arc<AtomicU64>,
    /// The thread that makes written-behind records durable.
    syncer: Arc<Syncer>,
}

/// Work for the record syncer thread.
enum SyncJob {
    /// A record file written behind: fsync it (and then the directory).
    Path(PathBuf),
    /// Answered once every job queued before it is done.
    Barrier(tokio::sync::oneshot::Sender<()>),
}

/// Makes written-behind records durable off the callers' path ([`Store::write_behind`]): a
/// thread takes every path queued since its last round, fsyncs each file that is still
/// there and then the directory once, so that a burst of creations costs a few group
/// syncs, not two fsyncs on each creation's path. It ends when the last `Store` clone is
/// dropped, after the jobs already queued.
#[derive(Debug)]
struct Syncer {
    tx: Mutex<mpsc::Sender<SyncJob>>,
    /// Held by a round while it syncs; tests hold it to keep the syncer from running.
    #[cfg_attr(not(test), allow(dead_code))]
    gate: Arc<Mutex<()>>,
}

impl Syncer {
    fn start(dir: PathBuf, syncs: Arc<AtomicU64>) -> std::io::Result<Syncer> {
        let (tx, rx) = mpsc::channel();
        let gate = Arc::new(Mutex::new(()));
        let g = gate.clone();
        std::thread::Builder::new()
            .name("edge-record-sync".into())
            .spawn(move || sync_rounds(&dir, &rx, &syncs, &g))?;
        Ok(Syncer {
            tx: Mutex::new(tx),
            gate,
        })
    }

    /// Queues a job; false when the thread is gone (it ended with a panic).
    fn send(&self, job: SyncJob) -> bool {
        let tx = self.tx.lock().unwrap_or_else(|p| p.into_inner());
        tx.send(job).is_ok()
    }
}

/// The syncer thread's loop: one round per wake-up, over everything queued by then.
fn sync_rounds(dir: &Path, rx: &mpsc::Receiver<SyncJob>, syncs: &AtomicU64, gate: &Mutex<()>) {
    while let Ok(first) = rx.recv() {
        let _round = gate.lock().unwrap_or_else(|p| p.into_inner());
        let mut paths = BTreeSet::new();
        let mut barriers = Vec::new();
        for job in std::iter::once(first).chain(rx.try_iter()) {
            match job {
                SyncJob::Path(p) => {
                    paths.insert(p);
                }
                SyncJob::Barrier(b) => barriers.push(b),
            }
        }
        if !paths.is_empty() {
            for p in &paths {
                match std::fs::File::open(p).and_then(|f| f.sync_all()) {
                    Ok(()) => {
                        syncs.fetch_add(1, Ordering::Relaxed);
                    }
                    // Removed (or replaced and removed) since: nothing left to keep.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        tracing::warn!(path = %p.display(), error = %crate::types::chain(&e), "syncing a sandbox record")
                    }
                }
            }
            match sync_dir(dir) {
                Ok(()) => {
                    syncs.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => {
                    tracing::warn!(path = %dir.display(), error = %crate::types::chain(&e), "syncing the record directory")
                }
            }
        }
        for b in barriers {
            let _ = b.send(());
        }
    }
}

/// Whether a write waits for the disk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Durability {
    /// fsync of each file before its rename, fsync of the directory after.
    Synced,
    /// write and rename only: on disk at the kernel's leisure or with the next synced write.
    Staged,
}

fn io<'a>(step: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> StoreError + 'a {
    move |source| StoreError::Io {
        step,
        path: path.display().to_string(),
        source,
    }
}

impl Store {
    /// Opens (creating) `<state_dir>/edges/<edge_id>/sandboxes`.
    pub fn open(state_dir: &Path, edge_id: &str) -> Result<Store, StoreError> {
        let edge_dir = state_dir.join("edges").join(edge_id);
        let dir = edge_dir.join("sandboxes");
        std::fs::create_dir_all(&dir).map_err(io("creating", &dir))?;
        let syncs = Arc::new(AtomicU64::new(0));
        let syncer = Syncer::start(dir.clone(), syncs.clone())
            .map_err(io("starting the record syncer for", &dir))?;
        Ok(Store {
            edge_dir,
            dir,
            seq: Arc::new(AtomicU64::new(0)),
            syncs,
            syncer: Arc::new(syncer),
        })
    }

    /// How many fsync calls this store (and its clones) made so far, of files and of
    /// directories together.
    pub fn syncs(&self) -> u64 {
        self.syncs.load(Ordering::Relaxed)
    }

    /// The file of sandbox `id`.
    pub fn path_of(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Writes one record durably.
    pub async fn write(&self, rec: &SandboxRecord) -> Result<(), StoreError> {
        let mut r = self.write_many(std::slice::from_ref(rec)).await;
        r.pop().unwrap_or(Ok(()))
    }

    /// Writes records durably and concurrently; one result per record, in order.
    pub async fn write_many(&self, recs: &[SandboxRecord]) -> Vec<Result<(), StoreError>> {
        self.write_all(recs, Durability::Synced).await
    }

    /// Writes the CREATING records of new sandboxes without waiting for the disk (temp
    /// file → write → rename, no fsync): one result per record, in order. Only for records
    /// that no caller has been answered about yet, which the next write of the same record
    /// (RUNNING or FAILED, [`Store::write_behind`]) replaces and makes durable. So no fsync
    /// waits on a creation's path (docs/benchmarks.md).
    ///
    /// What a crash can leave instead of such a record, and why each ends right:
    /// - the record, whole: as when it was synced; recovery marks it FAILED `interrupted`,
    ///   releases its lease and the backend's cleanup removes what was made.
    /// - no record, or a file with nothing or part of it (it is set aside as corrupt): the
    ///   edge has no record of the sandbox, so the backend's cleanup at start removes what
    ///   was made of it (cleanup keeps only live records' sandboxes), the caller, never
    ///   answered, retries and the retry creates it anew, and a lease nobody retries is
    ///   released by the watcher's reconciliation (the edge does not hold it).
    /// - an older record of the same id (an interrupted creation's FAILED one, being
    ///   created again): ended and interrupted as before, so the retry works as before.
    pub async fn stage_many(&self, recs: &[SandboxRecord]) -> Vec<Result<(), StoreError>> {
        self.write_all(recs, Durability::Staged).await
    }

    /// Writes records as [`Store::stage_many`] does (temp file → write → rename, no fsync on
    /// the caller's path) and has the syncer thread make them durable right after, in group
    /// rounds: one result per record, in order, once each is renamed into place. For a
    /// creation's RUNNING or FAILED record, whose fsync would otherwise be two disk cache
    /// flushes on every creation's path (docs/benchmarks.md).
    ///
    /// Why it is safe: the records exist so that a crashed edge finds its sandboxes again.
    /// A crash of the edge process (or its restart) keeps every renamed file, fsynced or
    /// not: the kernel's page cache holds it. Only a crash of the machine itself loses what
    /// was not yet synced, and that also ends every sandbox of the machine; what it can
    /// leave (an older CREATING record, a torn file or none) ends as a lost CREATING record
    /// does (see [`Store::stage_many`]): the record is marked failed, or set aside, and the
    /// backend's cleanup removes what is left of the sandbox.
    pub async fn write_behind(&self, recs: &[SandboxRecord]) -> Vec<Result<(), StoreError>> {
        let res = self.write_all(recs, Durability::Staged).await;
        for (rec, r) in recs.iter().zip(&res) {
            if r.is_ok() && !self.syncer.send(SyncJob::Path(self.path_of(rec.id()))) {
                tracing::error!(sandbox_id = %rec.id(), "the record syncer is gone; the record stays unsynced");
            }
        }
        res
    }

    /// Waits until every record written behind before this call is durable (or its sync
    /// failed and was logged).
    pub async fn flush(&self) {
        let (tx, rx) = tokio::sync::oneshot::channel();
        if self.syncer.send(SyncJob::Barrier(tx)) {
            let _ = rx.await;
        }
    }

    /// Keeps the syncer thread from starting a round while the guard lives.
    #[cfg(test)]
    pub fn hold_syncs(&self) -> std::sync::MutexGuard<'_, ()> {
        self.syncer.gate.lock().unwrap_or_else(|p| p.into_inner())
    }

    async fn write_all(
        &self,
        recs: &[SandboxRecord],
        durability: Durability,
    ) -> Vec<Result<(), StoreError>> {
        if recs.is_empty() {
            return Vec::new();
        }
        let mut jobs: Vec<WriteJob> = Vec::with_capacity(recs.len());
        for (i, r) in recs.iter().enumerate() {
            let n = self.seq.fetch_add(1, Ordering::Relaxed);
            let tmp = self.dir.join(format!(".{}.{n}.tmp", r.id()));
            let bytes = serde_json::to_vec(r).map_err(|source| StoreError::Encode {
                id: r.id().to_string(),
                source,
            });
            jobs.push((i, tmp, self.path_of(r.id()), bytes));
        }
        let per = jobs.len().div_ceil(WRITERS);
        let sync = durability == Durability::Synced;
        let mut tasks = Vec::new();
        while !jobs.is_empty() {
            let chunk: Vec<_> = jobs.drain(..per.min(jobs.len())).collect();
            let syncs = self.syncs.clone();
            tasks.push(tokio::task::spawn_blocking(move || {
                chunk
                    .into_iter()
                    .map(|(i, tmp, path, bytes)| {
                        let r = bytes.and_then(|b| write_file(&tmp, &path, &b, sync));
                        if sync {
                            syncs.fetch_add(1, Ordering::Relaxed);
                        }
                        (i, r)
                    })
                    .collect::<Vec<_>>()
            }));
        }
        let mut out: Vec<Option<Result<(), StoreError>>> = (0..recs.len()).map(|_| None).collect();
        for t in futures::future::join_all(tasks).await {
            match t {
                Ok(done) => {
                    for (i, r) in done {
                        if let Some(slot) = out.get_mut(i) {
                            *slot = Some(r);
                        }
                    }
                }
                Err(e) => {
                    tracing::error!(error = %crate::types::chain(&e), "record writer task failed")
                }
            }
        }
        let dir_err = if sync {
            let dir = self.dir.clone();
            self.syncs.fetch_add(1, Ordering::Relaxed);
            match tokio::task::spawn_blocking(move || sync_dir(&dir)).await {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(crate::types::chain(&e)),
                Err(e) => Some(crate::types::chain(&e)),
            }
        } else {
            None
        };
        out.into_iter()
            .zip(recs)
            .map(|(r, rec)| match (r, &dir_err) {
                (None, _) => Err(StoreError::Join {
                    path: self.path_of(rec.id()).display().to_string(),
                    message: "writer task ended early".into(),
                }),
                (Some(Ok(())), Some(m)) => Err(StoreError::Join {
                    path: self.dir.display().to_string(),
                    message: format!("directory fsync: {m}"),
                }),
                (Some(r), _) => r,
            })
            .collect()
    }

    /// Removes the record of `id` (gone already is fine).
    pub async fn remove(&self, id: &str) -> Result<(), StoreError> {
        let path = self.path_of(id);
        tokio::task::spawn_blocking(move || match std::fs::remove_file(&path) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io("removing", &path)(e)),
        })
        .await
        .map_err(|e| StoreError::Join {
            path: id.to_string(),
            message: crate::types::chain(&e),
        })?
    }

    /// Reads every record. Leftover temp files are removed; files that do not parse are
    /// renamed to `<name>.corrupt` and returned by path with the error, for the log.
    pub fn load_all(&self) -> Result<(Vec<SandboxRecord>, Vec<Unreadable>), StoreError> {
        let mut recs = Vec::new();
        let mut bad = Vec::new();
        let entries = std::fs::read_dir(&self.dir).map_err(io("listing", &self.dir))?;
        for e in entries {
            let e = e.map_err(io("listing", &self.dir))?;
            let path = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if name.ends_with(".tmp") {
                let _ = std::fs::remove_file(&path);
                continue;
            }
            if !name.ends_with(".json") {
                continue;
            }
            let parsed = std::fs::read(&path)
                .map_err(|e| crate::types::chain(&e))
                .and_then(|b| {
                    serde_json::from_slice::<SandboxRecord>(&b).map_err(|e| crate::types::chain(&e))
                });
            match parsed {
                Ok(r) if format!("{}.json", r.id()) == name => recs.push(r),
                Ok(r) => bad.push((path, format!("file holds sandbox {:?}", r.id()))),
                Err(m) => bad.push((path, m)),
            }
        }
        for (p, _) in &bad {
            let mut aside = p.clone().into_os_string();
            aside.push(".corrupt");
            let _ = std::fs::rename(p, aside);
        }
        recs.sort_by(|a, b| a.id().cmp(b.id()));
        Ok((recs, bad))
    }

    /// Reads the edge's flags (defaults when never written).
    pub fn read_flags(&self) -> Result<EdgeFlagsState, StoreError> {
        let path = self.edge_dir.join("edge.json");
        match std::fs::read(&path) {
            Ok(b) => serde_json::from_slice(&b).map_err(|source| StoreError::Encode {
                id: "edge.json".into(),
                source,
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(EdgeFlagsState::default()),
            Err(e) => Err(io("reading", &path)(e)),
        }
    }

    /// Writes the edge's flags durably.
    pub async fn write_flags(&self, flags: &EdgeFlagsState) -> Result<(), StoreError> {
        let bytes = serde_json::to_vec(flags).map_err(|source| StoreError::Encode {
            id: "edge.json".into(),
            source,
        })?;
        let dir = self.edge_dir.clone();
        tokio::task::spawn_blocking(move || {
            let path = dir.join("edge.json");
            write_file(&dir.join(".edge.json.tmp"), &path, &bytes, true)?;
            sync_dir(&dir).map_err(io("syncing", &dir))
        })
        .await
        .map_err(|e| StoreError::Join {
            path: "edge.json".into(),
            message: crate::types::chain(&e),
        })?
    }
}

/// temp file → write → fsync (when `sync`) → rename.
fn write_file(tmp: &Path, path: &Path, bytes: &[u8], sync: bool) -> Result<(), StoreError> {
    let mut f = std::fs::File::create(tmp).map_err(io("creating", tmp))?;
    f.write_all(bytes).map_err(io("writing", tmp))?;
    if sync {
        f.sync_all().map_err(io("syncing", tmp))?;
    }
    drop(f);
    std::fs::rename(tmp, path).map_err(io("renaming", tmp))
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb::{self, SandboxState};

    fn rec(id: &str) -> SandboxRecord {
        let spec = pb::SandboxSpec {
            backend: "sim".into(),
            memory_limit_mb: 64,
            ..Default::default()
        };
        SandboxRecord::creating(id, "e1", &format!("L-{id}"), "root", "p", spec, 5)
    }

    #[tokio::test]
    async fn records_round_trip_and_batches_write_all() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = Store::open(dir.path(), "e1").unwrap_or_else(|e| panic!("{e}"));
        let recs: Vec<_> = (0..300).map(|i| rec(&format!("e1.s{i:03}"))).collect();
        let res = s.write_many(&recs).await;
        assert_eq!(res.len(), 300);
        assert!(res.iter().all(|r| r.is_ok()));
        let mut one = rec("e1.s007");
        one.set_state(SandboxState::Running);
        s.write(&one).await.unwrap_or_else(|e| panic!("{e}"));
        s.remove("e1.s000").await.unwrap_or_else(|e| panic!("{e}"));
        s.remove("e1.s000")
            .await
            .unwrap_or_else(|e| panic!("removing twice: {e}"));
        let (back, bad) = s.load_all().unwrap_or_else(|e| panic!("{e}"));
        assert!(bad.is_empty());
        assert_eq!(back.len(), 299);
        assert_eq!(
            back.iter().find(|r| r.id() == "e1.s007").map(|r| r.state()),
            Some(SandboxState::Running)
        );
        assert!(dir.path().join("edges/e1/sandboxes/e1.s001.json").exists());
    }

    #[tokio::test]
    async fn corrupt_files_and_temp_leftovers_are_set_aside() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = Store::open(dir.path(), "e1").unwrap_or_else(|e| panic!("{e}"));
        s.write(&rec("e1.good"))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let sdir = dir.path().join("edges/e1/sandboxes");
        std::fs::write(sdir.join("e1.bad.json"), b"{not json").unwrap_or_else(|e| panic!("{e}"));
        std::fs::write(sdir.join(".e1.x.3.tmp"), b"half").unwrap_or_else(|e| panic!("{e}"));
        let (back, bad) = s.load_all().unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(back.len(), 1);
        assert_eq!(bad.len(), 1);
        assert!(sdir.join("e1.bad.json.corrupt").exists());
        assert!(!sdir.join(".e1.x.3.tmp").exists());
    }

    #[tokio::test]
    async fn flags_persist() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
        let s = Store::open(dir.path(), "e1").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(s.read_flags().ok(), Some(EdgeFlagsState::default()));
        s.write_flags(&EdgeFlagsState { draining: true })
            .await
            .unwrap_or_else(|e| panic!("{e}"));
        let again = Store::open(dir.path(), "e1").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(
            again.read_flags().ok(),
            Some(EdgeFlagsState { draining: true })
        );
    }
}
