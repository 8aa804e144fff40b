//! The edge's in-memory state: one entry per sandbox (record, operation lock, calls in
//! flight), the node's allocation, the latest host reading, and the helpers every
//! operation uses to change a record consistently (allocation and disk follow the record).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};

use super::admission::{Alloc, Capacity, Reserves};
use super::host::HostSample;
use super::leases::{LeaseSink, ReleaseItem, Releaser};
use super::record::SandboxRecord;
use super::store::Store;
use crate::backends::{Backend, Handle};
use crate::config::EdgeConfig;
use crate::pb;
use crate::types::Failure;

/// How long a caller's stop waits for IAM to take its lease back.
const RELEASE_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// Locks a std mutex, recovering the data if a panicking thread poisoned it.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn read<T: Copy>(m: &RwLock<T>) -> T {
    *m.read().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn write<T>(m: &RwLock<T>, v: T) {
    *m.write().unwrap_or_else(|p| p.into_inner()) = v;
}

/// One sandbox in memory.
pub(crate) struct Entry {
    /// The operation lock: one lifecycle operation at a time (docs/architecture.md).
    pub op: Arc<tokio::sync::Mutex<()>>,
    pub rec: Mutex<SandboxRecord>,
    /// Runtime calls in flight: the idle timeout does not run while > 0.
    pub calls: AtomicU32,
    /// A TTL action for it is queued or running.
    pub ttl_busy: AtomicBool,
    /// `Alloc::seq` once its charge was in the allocation: states from then on count it.
    pub since_seq: AtomicU64,
}

/// What a sandbox that ended gave back to the allocation: states with `since_seq <=
/// admitted_seq < seq` (of this incarnation) still count `res`; from `seq` on they do not.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Freed {
    pub res: crate::types::Res,
    pub since_seq: u64,
    pub seq: u64,
}

impl Entry {
    pub fn new(rec: SandboxRecord) -> Entry {
        Entry {
            op: Arc::new(tokio::sync::Mutex::new(())),
            rec: Mutex::new(rec),
            calls: AtomicU32::new(0),
            ttl_busy: AtomicBool::new(false),
            since_seq: AtomicU64::new(0),
        }
    }
    pub fn snapshot(&self) -> SandboxRecord {
        lock(&self.rec).clone()
    }
    pub fn calls(&self) -> u32 {
        self.calls.load(Ordering::Relaxed)
    }
}

/// One configured backend.
pub(crate) struct Slot {
    pub backend: Arc<dyn Backend>,
    /// 0 = no limit.
    pub max_sandboxes: i64,
    pub default_disk_mb: i64,
}

/// Everything the edge's services and loops share.
pub(crate) struct Core {
    pub edge_id: String,
    pub cfg: EdgeConfig,
    /// Address registered with the watchers and reported in Status.
    pub addr: String,
    pub service_token: String,
    /// How the edge reaches the watchers (mTLS when `tls.dir` is set).
    pub dialer: crate::rpc::client::Dialer,
    /// Watcher addresses to register with.
    pub watchers: Vec<String>,
    pub slots: BTreeMap<String, Slot>,
    pub entries: Mutex<HashMap<String, Arc<Entry>>>,
    pub alloc: Mutex<Alloc>,
    pub host: RwLock<HostSample>,
    pub capacity: RwLock<Capacity>,
    pub reserves: RwLock<Reserves>,
    pub draining: AtomicBool,
    pub drain_lock: tokio::sync::Mutex<()>,
    pub store: Option<Store>,
    pub leases: Arc<dyn LeaseSink>,
    pub releaser: Releaser,
    pub paused_mem_charge: f64,
    /// `stopped_retention`, seconds.
    pub retention: i64,
    /// Bounds the background IAM lease lookups after creations.
    pub lease_checks: tokio::sync::Semaphore,
    /// Any backend that runs something (capacity defaults to the host's).
    pub real: bool,
    /// A random id of this edge process (EdgeState.incarnation).
    pub incarnation: String,
    /// The image store's root (`image_store.root`), where memory snapshots are written.
    pub image_store: Option<std::path::PathBuf>,
}

impl Core {
    pub fn get(&self, id: &str) -> Option<Arc<Entry>> {
        lock(&self.entries).get(id).cloned()
    }

    /// The entry of `id`, or `not_found`.
    pub fn entry(&self, id: &str) -> Result<Arc<Entry>, Failure> {
        self.get(id).ok_or_else(|| {
            Failure::not_found(format!("sandbox {id:?} not found on edge {}", self.edge_id))
        })
    }

    /// Every entry, for loops and listings.
    pub fn all(&self) -> Vec<Arc<Entry>> {
        lock(&self.entries).values().cloned().collect()
    }

    pub fn backend_of(&self, rec: &SandboxRecord) -> Option<&Arc<dyn Backend>> {
        self.slots.get(rec.backend()).map(|s| &s.backend)
    }

    /// The backend of `rec` when it is running or paused, for work on its files or memory
    /// (`what`: `pack`, `snapshot`). Errors: `conflict` (another state), `internal` (its
    /// backend is not configured here).
    pub fn backend_while_live(
        &self,
        rec: &SandboxRecord,
        what: &str,
    ) -> Result<Arc<dyn Backend>, Failure> {
        let id = rec.id();
        if !matches!(
            rec.state(),
            pb::SandboxState::Running | pb::SandboxState::Paused
        ) {
            return Err(Failure::conflict(format!(
                "sandbox {id}: cannot {what} a sandbox that is {}",
                rec.state().as_str_name()
            )));
        }
        self.backend_of(rec).cloned().ok_or_else(|| {
            Failure::internal(format!(
                "sandbox {id}: backend {:?} is not configured on this edge",
                rec.backend()
            ))
        })
    }

    fn charge(&self, rec: &SandboxRecord) -> crate::types::Res {
        let b = self.backend_of(rec);
        let frees = b.is_some_and(|b| b.pause_frees_memory());
        let running = b
            .zip(rec.sandbox.spec.as_ref())
            .map(|(b, s)| b.memory_charge_mb(s));
        rec.charge_with(running, frees, self.paused_mem_charge)
    }

    /// Adds a record's charge to the allocation (a record entering memory); returns the
    /// allocation's `seq` with it in.
    pub fn account(&self, rec: &SandboxRecord) -> u64 {
        let c = self.charge(rec);
        let mut a = lock(&self.alloc);
        a.add(rec.backend(), &c);
        a.seq
    }

    /// Changes a record; the allocation follows its new charge. Returns the new record.
    pub fn update(&self, entry: &Entry, f: impl FnOnce(&mut SandboxRecord)) -> SandboxRecord {
        self.update_freed(entry, f).0
    }

    /// As `update`; also says what the change gave back when it ended the sandbox (its
    /// charge dropped to nothing), for the apiserver's placement overlay.
    pub fn update_freed(
        &self,
        entry: &Entry,
        f: impl FnOnce(&mut SandboxRecord),
    ) -> (SandboxRecord, Option<Freed>) {
        let mut rec = lock(&entry.rec);
        let old = self.charge(&rec);
        f(&mut rec);
        let new = self.charge(&rec);
        let mut freed = None;
        if old != new {
            let mut a = lock(&self.alloc);
            a.change(rec.backend(), &old, &new);
            if new == crate::types::Res::default() {
                freed = Some(Freed {
                    res: old,
                    since_seq: entry.since_seq.load(Ordering::SeqCst),
                    seq: a.seq,
                });
            }
        }
        (rec.clone(), freed)
    }

    /// Writes a record to disk when `persist_state` is on. A failed write is logged: the
    /// in-memory record stays the truth while the edge runs.
    pub async fn persist(&self, rec: &SandboxRecord) {
        if let Some(s) = &self.store {
            if let Err(e) = s.write(rec).await {
                tracing::error!(sandbox_id = %rec.id(), error = %crate::types::chain(&e), "writing sandbox record");
            }
        }
    }

    /// As `persist`, for many records at once.
    pub async fn persist_many(&self, recs: &[SandboxRecord]) {
        if let Some(s) = &self.store {
            for (r, res) in recs.iter().zip(s.write_many(recs).await) {
                if let Err(e) = res {
                    tracing::error!(sandbox_id = %r.id(), error = %crate::types::chain(&e), "writing sandbox record");
                }
            }
        }
    }

    /// As `persist_many`, made durable behind the caller's answer ([`Store::write_behind`]):
    /// for a creation's RUNNING or FAILED records.
    pub async fn persist_many_behind(&self, recs: &[SandboxRecord]) {
        if let Some(s) = &self.store {
            for (r, res) in recs.iter().zip(s.write_behind(recs).await) {
                if let Err(e) = res {
                    tracing::error!(sandbox_id = %r.id(), error = %crate::types::chain(&e), "writing sandbox record");
                }
            }
        }
    }

    /// Queues the lease of an ended sandbox for release. `verify`: only if IAM still binds
    /// it to this sandbox (creation failed or was interrupted).
    pub fn release_lease(&self, rec: &SandboxRecord, verify: bool) {
        if let Some(item) = self.release_item(rec, verify) {
            self.releaser.release(item);
        }
    }

    /// Releases the lease of an ended sandbox now and waits (up to `RELEASE_WAIT`) until IAM
    /// has taken it, so that the project's quota is free when a caller's stop returns
    /// (docs/architecture.md). IAM slower or unreachable: the release stays queued and is
    /// retried; the wait ends anyway.
    pub async fn release_lease_now(&self, rec: &SandboxRecord, verify: bool) {
        if let Some(item) = self.release_item(rec, verify) {
            if tokio::time::timeout(RELEASE_WAIT, self.releaser.release_now(item))
                .await
                .is_err()
            {
                tracing::warn!(sandbox_id = %rec.id(), edge_id = %self.edge_id, "IAM did not take the lease release in time; it stays queued");
            }
        }
    }

    fn release_item(&self, rec: &SandboxRecord, verify: bool) -> Option<ReleaseItem> {
        if rec.lease_foreign || rec.sandbox.lease_id.is_empty() {
            return None;
        }
        let at = if rec.sandbox.ended_at > 0 {
            rec.sandbox.ended_at
        } else {
            crate::types::now_s()
        };
        Some(ReleaseItem {
            lease_id: rec.sandbox.lease_id.clone(),
            at,
            verify: verify.then(|| (self.edge_id.clone(), rec.id().to_string())),
        })
    }

    /// Forgets an ended record (retention passed).
    pub async fn drop_record(&self, id: &str) {
        {
            let mut m = lock(&self.entries);
            let ended = m.get(id).is_some_and(|e| lock(&e.rec).is_ended());
            if !ended {
                return;
            }
            m.remove(id);
        }
        if let Some(s) = &self.store {
            if let Err(e) = s.remove(id).await {
                tracing::warn!(sandbox_id = %id, error = %crate::types::chain(&e), "removing sandbox record");
            }
        }
    }
}

/// Calls `f` with the backend handle of a record.
pub(crate) fn handle(rec: &SandboxRecord) -> (pb::SandboxSpec, crate::backends::BackendState) {
    (rec.spec(), rec.backend_state.clone())
}

/// Builds a `Handle` from what `handle` returned.
pub(crate) fn as_handle<'a>(
    id: &'a str,
    parts: &'a (pb::SandboxSpec, crate::backends::BackendState),
) -> Handle<'a> {
    Handle {
        sandbox_id: id,
        spec: &parts.0,
        state: &parts.1,
    }
}
