//! `CreateSandboxes` on the edge (docs/architecture.md "Creating a sandbox", step 5): final admission per item,
//! the record written before the backend is called, the backend's creation, RUNNING
//! recorded, then (in the background) the IAM lease check that deletes orphans.
//!
//! Idempotent per sandbox id: an id the edge already knows returns its record (after any
//! operation on it finishes), never a second sandbox.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::OwnedMutexGuard;

use super::admission::{fits, pressures};
use super::leases::bound_here;
use super::machine::Op;
use super::metrics;
use super::node::{lock, read, Core, Entry};
use super::ops::Cause;
use super::record::SandboxRecord;
use crate::backends::CreateRequest;
use crate::pb::{self, SandboxState};
use crate::rpc::status::error_detail;
use crate::types::{names, now_s, Failure, Reason, Res};

/// Default CPU cores and memory (MB) when a spec sets none (docs/concepts.md).
const DEFAULT_CPU: f64 = 1.0;
const DEFAULT_MEM_MB: i64 = 2048;

// One per item of a batch call, short-lived: boxing the large variant buys nothing.
#[allow(clippy::large_enum_variant)]
enum Item {
    Done(Result<pb::Sandbox, Failure>),
    Existing(Arc<Entry>),
    New(Arc<Entry>, OwnedMutexGuard<()>),
}

impl Core {
    /// Checks a spec and fills in the resources this edge accounts: 1 core, 2048 MB and
    /// the backend's `default_disk_mb` when unset. Errors: `invalid` (unknown backend, bad
    /// numbers).
    pub fn normalize(&self, spec: Option<pb::SandboxSpec>) -> Result<pb::SandboxSpec, Failure> {
        let mut s = spec.ok_or_else(|| Failure::invalid("spec is required"))?;
        let Some(slot) = self.slots.get(&s.backend) else {
            let offered: Vec<&str> = self.slots.keys().map(String::as_str).collect();
            return Err(Failure::invalid(format!(
                "edge {} has no backend {:?} (it offers {})",
                self.edge_id,
                s.backend,
                offered.join(", ")
            )));
        };
        if !self.cfg.network.enabled && !s.network_rules.is_empty() {
            return Err(self.no_networking());
        }
        if !s.cpu_cores_limit.is_finite() || s.cpu_cores_limit < 0.0 {
            return Err(Failure::invalid(format!(
                "cpu_cores_limit must be ≥ 0, not {}",
                s.cpu_cores_limit
            )));
        }
        for (field, v) in [
            ("memory_limit_mb", s.memory_limit_mb),
            ("disk_mb", s.disk_mb),
            ("gpus", i64::from(s.gpus)),
        ] {
            if v < 0 {
                return Err(Failure::invalid(format!("{field} must be ≥ 0, not {v}")));
            }
        }
        if s.cpu_cores_limit == 0.0 {
            s.cpu_cores_limit = DEFAULT_CPU;
        }
        if s.memory_limit_mb == 0 {
            s.memory_limit_mb = DEFAULT_MEM_MB;
        }
        if s.disk_mb == 0 {
            s.disk_mb = slot.default_disk_mb;
        }
        Ok(s)
    }

    /// What a creation or `UpdateNetwork` asking for network rules gets on an edge without
    /// sandbox networking: `invalid`, naming the node setting.
    pub(crate) fn no_networking(&self) -> Failure {
        Failure::invalid(format!(
            "network_rules: edge {} has no sandbox networking (its \
             edges[].network.enabled is false), so its sandboxes have only a loopback \
             interface; leave network_rules empty",
            self.edge_id
        ))
    }

    /// Creates the batch's sandboxes; one result per item, in order. Errors for the whole
    /// call: `invalid` spec.
    #[cfg(test)]
    pub async fn create_batch(
        self: &Arc<Self>,
        spec: Option<pb::SandboxSpec>,
        items: Vec<pb::EdgeCreateItem>,
    ) -> Result<Vec<pb::EdgeCreateResult>, Failure> {
        self.create_batch_from(spec, items, None).await
    }

    /// [`Core::create_batch`], with a fork's copies starting from `fork`'s files, or for a
    /// microVM's fork restored from its memory snapshot (docs/images.md "Fork"). Errors for
    /// the whole call: `invalid` spec, fork files or snapshot name, `unavailable` (a
    /// snapshot without an image store).
    pub async fn create_batch_from(
        self: &Arc<Self>,
        spec: Option<pb::SandboxSpec>,
        items: Vec<pb::EdgeCreateItem>,
        fork: Option<pb::ForkFiles>,
    ) -> Result<Vec<pb::EdgeCreateResult>, Failure> {
        let (fork, snapshot) = match &fork {
            Some(f) if !f.snapshot.is_empty() => (None, Some(self.snapshot_dir(&f.snapshot)?)),
            Some(f) => (Some(crate::backends::ForkFiles::from_pb(f)?), None),
            None => (None, None),
        };
        let digest = spec
            .as_ref()
            .map(crate::types::spec_digest::spec_digest)
            .unwrap_or_default();
        let spec = self.normalize(spec)?;
        let backend_name = spec.backend.clone();
        let (backend, max) = match self.slots.get(&backend_name) {
            Some(s) => (s.backend.clone(), s.max_sandboxes),
            None => return Err(Failure::invalid(format!("no backend {backend_name:?}"))),
        };
        // A spec this backend cannot start fails here, before anything is made.
        backend.check_spec(&spec).map_err(|e| e.to_failure())?;
        let want = Res {
            memory_mb: backend.memory_charge_mb(&spec),
            ..Res::of_spec(&spec)
        };
        let started = Instant::now();
        let now = now_s();
        let press = pressures(&read(&self.reserves), &read(&self.host));
        let cap = read(&self.capacity);
        let draining = self.draining.load(Ordering::Relaxed);
        let mut redo = self.redo_checks(&items).await;

        // 1. Idempotency and admission, item by item.
        let mut slots: Vec<Item> = Vec::with_capacity(items.len());
        {
            let mut map = lock(&self.entries);
            for it in &items {
                if let Err(f) = self.check_item(it) {
                    slots.push(Item::Done(Err(f)));
                    continue;
                }
                if let Some(e) = map.get(&it.sandbox_id) {
                    match redo.remove(&it.sandbox_id) {
                        // Interrupted by a restart: created again below (the new record replaces it).
                        Some((old, Ok(()))) if Arc::ptr_eq(&old, e) => {}
                        Some((old, Err(f))) if Arc::ptr_eq(&old, e) => {
                            slots.push(Item::Done(Err(f)));
                            continue;
                        }
                        _ => {
                            let known = lock(&e.rec).spec_digest.clone();
                            if !known.is_empty() && known != digest {
                                slots.push(Item::Done(Err(Failure::conflict(format!(
                                    "sandbox {} was created with a different spec under the same idempotency_key; use a new key for a new sandbox",
                                    it.sandbox_id
                                )))));
                            } else {
                                slots.push(Item::Existing(e.clone()));
                            }
                            continue;
                        }
                    }
                }
                let verdict = if draining {
                    Err(("draining", format!("edge {} is draining", self.edge_id)))
                } else if let Some(p) = press.first() {
                    let label = match p.kind {
                        "memory" => "memory_pressure",
                        "disk" => "disk_pressure",
                        _ => "cpu_pressure",
                    };
                    Err((
                        label,
                        press
                            .iter()
                            .map(|p| p.message.as_str())
                            .collect::<Vec<_>>()
                            .join("; "),
                    ))
                } else {
                    let mut alloc = lock(&self.alloc);
                    match fits(&want, &backend_name, max, &alloc, &cap) {
                        Ok(()) => {
                            alloc.add(&backend_name, &want);
                            Ok(alloc.seq)
                        }
                        Err(r) => Err((r.label, r.message)),
                    }
                };
                let since_seq = match verdict {
                    Ok(seq) => seq,
                    Err((label, message)) => {
                        metrics::rejected(&self.edge_id, label);
                        slots.push(Item::Done(Err(Failure::new(
                            Reason::NoCapacity,
                            format!("edge {}: {message}", self.edge_id),
                        ))));
                        continue;
                    }
                };
                let rec = SandboxRecord::creating(
                    &it.sandbox_id,
                    &self.edge_id,
                    &it.lease_id,
                    &it.project,
                    &it.principal,
                    spec.clone(),
                    now,
                );
                let entry = Arc::new(Entry::new(SandboxRecord {
                    spec_digest: digest.clone(),
                    ..rec
                }));
                entry.since_seq.store(since_seq, Ordering::SeqCst);
                let Ok(guard) = entry.op.clone().try_lock_owned() else {
                    // A fresh mutex is never held; undo the reservation if it were.
                    lock(&self.alloc).sub(&backend_name, &want);
                    slots.push(Item::Done(Err(Failure::internal(
                        "new sandbox lock was held",
                    ))));
                    continue;
                };
                map.insert(it.sandbox_id.clone(), entry.clone());
                slots.push(Item::New(entry, guard));
            }
        }

        // 2. Record CREATING before the backend is called (concurrent writes), staged
        //    without fsync: a crash that loses the CREATING record leaves nothing that the
        //    restart does not clean up (see `Store::stage_many`).
        if let Some(store) = &self.store {
            let idx: Vec<usize> = (0..slots.len())
                .filter(|&i| matches!(slots.get(i), Some(Item::New(..))))
                .collect();
            let recs: Vec<SandboxRecord> = slots
                .iter()
                .filter_map(|s| {
                    if let Item::New(e, _) = s {
                        Some(e.snapshot())
                    } else {
                        None
                    }
                })
                .collect();
            let written = store.stage_many(&recs).await;
            for (&i, res) in idx.iter().zip(written) {
                if let (Err(e), Some(slot)) = (res, slots.get_mut(i)) {
                    if let Item::New(entry, _) = &*slot {
                        let id = entry.snapshot().id().to_string();
                        tracing::error!(sandbox_id = %id, edge_id = %self.edge_id, error = %crate::types::chain(&e), "recording a new sandbox");
                        lock(&self.entries).remove(&id);
                        lock(&self.alloc).sub(&backend_name, &want);
                        let _ = store.remove(&id).await;
                    }
                    *slot = Item::Done(Err(Failure::internal(format!(
                        "recording the sandbox on edge {}: {e}",
                        self.edge_id,
                        e = crate::types::chain(&e)
                    ))));
                }
            }
        }

        // 3. The backend creates them, concurrently.
        let new: Vec<(usize, Arc<Entry>)> = slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                if let Item::New(e, _) = s {
                    Some((i, e.clone()))
                } else {
                    None
                }
            })
            .collect();
        let made = futures::future::join_all(new.iter().map(|(_, e)| {
            let rec = e.snapshot();
            let b = backend.clone();
            let (fork, snapshot) = (fork.clone(), snapshot.clone());
            async move {
                let req = CreateRequest {
                    sandbox_id: rec.id().to_string(),
                    project: rec.sandbox.project.clone(),
                    spec: rec.spec(),
                    fork,
                    snapshot,
                };
                let t = Instant::now();
                let r = b.create(&req).await;
                (r, t.elapsed())
            }
        }))
        .await;

        // 4. RUNNING or FAILED, recorded.
        let done_at = now_s();
        let mut after = Vec::with_capacity(new.len());
        let mut failures = Vec::with_capacity(new.len());
        for ((_, entry), (r, took)) in new.iter().zip(made) {
            metrics::create_seconds(&backend_name, metrics::outcome(&r), took.as_secs_f64());
            let rec = match r {
                Ok(state) => {
                    metrics::created(&self.edge_id);
                    failures.push(None);
                    self.update(entry, |r| {
                        r.backend_state = state;
                        r.set_state(SandboxState::Running);
                        r.sandbox.last_active_at = done_at;
                    })
                }
                Err(e) => {
                    tracing::warn!(sandbox_id = %entry.snapshot().id(), edge_id = %self.edge_id, error = %crate::types::chain(&e), "creation failed");
                    failures.push(Some(e.to_failure()));
                    self.update(entry, |r| {
                        r.end(SandboxState::Failed, done_at, crate::types::chain(&e))
                    })
                }
            };
            after.push(rec);
        }
        // In place before anyone is answered, durable right after (`Store::write_behind`).
        self.persist_many_behind(&after).await;
        for r in after.iter().filter(|r| r.is_ended()) {
            self.release_lease(r, true);
        }

        // 5. Answers in item order; existing ids wait for their operation to finish.
        let mut new_results: std::collections::HashMap<usize, Result<pb::Sandbox, Failure>> =
            Default::default();
        for (((i, _), f), rec) in new.iter().zip(failures).zip(&after) {
            new_results.insert(*i, f.map_or_else(|| Ok(rec.sandbox.clone()), Err));
        }
        let mut out = Vec::with_capacity(slots.len());
        let mut check = Vec::new();
        for (i, s) in slots.into_iter().enumerate() {
            let r = match s {
                Item::Done(r) => r,
                Item::New(entry, guard) => {
                    drop(guard);
                    let r = new_results
                        .remove(&i)
                        .unwrap_or_else(|| Ok(entry.snapshot().sandbox));
                    if r.is_ok() {
                        check.push(entry.snapshot().id().to_string());
                    }
                    r
                }
                Item::Existing(entry) => {
                    let _g = entry.op.lock().await;
                    Ok(entry.snapshot().sandbox)
                }
            };
            out.push(match r {
                Ok(sb) => pb::EdgeCreateResult {
                    sandbox: Some(sb),
                    error: None,
                },
                Err(f) => pb::EdgeCreateResult {
                    sandbox: None,
                    error: Some(error_detail(&f)),
                },
            });
        }
        tracing::debug!(edge_id = %self.edge_id, items = out.len(), took_ms = started.elapsed().as_millis() as u64, "batch created");

        // 6. Where does IAM bind each new lease? (background)
        for id in check {
            let me = self.clone();
            tokio::spawn(async move { me.check_lease(&id).await });
        }
        Ok(out)
    }

    /// Retries of creations that an edge restart interrupted (recovery marked them FAILED,
    /// `interrupted`, and queued their leases for release). The caller is still waiting for
    /// them, so a retry with the same sandbox and lease id creates the sandbox again, once
    /// (a) that release has settled, so it cannot take back the lease the retry was admitted
    /// with, and (b) IAM binds the lease to this sandbox here. Until then the item is
    /// `unavailable` and the apiserver or the SDK retries it. Returns, per sandbox id, the
    /// entry checked and whether it may be created again.
    async fn redo_checks(
        &self,
        items: &[pb::EdgeCreateItem],
    ) -> std::collections::HashMap<String, (Arc<Entry>, Result<(), Failure>)> {
        let candidates: std::collections::HashMap<String, (String, Arc<Entry>)> = {
            let map = lock(&self.entries);
            items
                .iter()
                .filter_map(|it| {
                    let e = map.get(&it.sandbox_id)?;
                    let r = lock(&e.rec);
                    (r.interrupted
                        && r.is_ended()
                        && r.sandbox.lease_id == it.lease_id
                        && !it.lease_id.is_empty())
                    .then(|| (it.sandbox_id.clone(), (it.lease_id.clone(), e.clone())))
                })
                .collect()
        };
        let checks = candidates.into_iter().map(|(id, (lease, entry))| async move {
            let verdict = if self.releaser.is_pending(&lease) {
                Err(Failure::unavailable(format!("sandbox {id}: its creation was interrupted by an edge restart and its lease is still being released; retry")))
            } else {
                match self.leases.lookup(&lease).await {
                    Ok(Some(info)) if info.edge_id == self.edge_id && info.sandbox_id == id => Ok(()),
                    Ok(_) => Err(Failure::unavailable(format!("sandbox {id}: its creation was interrupted by an edge restart and IAM does not bind lease {lease} to it; retry"))),
                    Err(f) => Err(Failure::unavailable(format!("sandbox {id}: its creation was interrupted by an edge restart and IAM could not be asked about lease {lease}: {}", f.message))),
                }
            };
            (id, (entry, verdict))
        });
        futures::future::join_all(checks)
            .await
            .into_iter()
            .collect()
    }

    /// Checks one item's ids: `<this-edge>.<suffix>` with a suffix of 1..64 characters of
    /// `[A-Za-z0-9_-]`, a valid project path, and bounded lease and principal ids.
    fn check_item(&self, it: &pb::EdgeCreateItem) -> Result<(), Failure> {
        let suffix = it
            .sandbox_id
            .strip_prefix(&self.edge_id)
            .and_then(|s| s.strip_prefix('.'));
        let ok = suffix.is_some_and(|s| {
            !s.is_empty()
                && s.len() <= 64
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        });
        if !ok {
            return Err(Failure::invalid(format!(
                "sandbox id {:?} must be {}.<1 to 64 of [A-Za-z0-9_-]>",
                it.sandbox_id, self.edge_id
            )));
        }
        names::check_project_path(&it.project)?;
        if it.lease_id.len() > 256 || it.principal.len() > 256 {
            return Err(Failure::invalid(
                "lease_id and principal must be at most 256 characters",
            ));
        }
        Ok(())
    }

    /// After a creation: asks IAM where the lease is bound. Bound to another edge or
    /// sandbox, or released: the sandbox is deleted at once (its lease is not ours to
    /// release). IAM unreachable: kept.
    pub(crate) async fn check_lease(&self, id: &str) {
        let Ok(_permit) = self.lease_checks.acquire().await else {
            return;
        };
        let Some(entry) = self.get(id) else { return };
        let lease = entry.snapshot().sandbox.lease_id;
        if lease.is_empty() {
            return;
        }
        let why = match self.leases.lookup(&lease).await {
            Err(f) => {
                tracing::debug!(sandbox_id = %id, error = %f, "lease lookup failed; keeping the sandbox");
                return;
            }
            Ok(Some(info)) if bound_here(&info, &self.edge_id, id) => return,
            Ok(Some(info)) => format!(
                "lease {lease} is bound to sandbox {} on edge {}; this copy was abandoned",
                info.sandbox_id, info.edge_id
            ),
            Ok(None) => format!("lease {lease} was released; this copy was abandoned"),
        };
        tracing::warn!(sandbox_id = %id, edge_id = %self.edge_id, why = %why, "deleting orphan sandbox");
        self.update(&entry, |r| r.lease_foreign = true);
        if let Err(f) = self.lifecycle(id, Op::Stop, Cause::Edge(why)).await {
            tracing::warn!(sandbox_id = %id, error = %f, "stopping orphan sandbox");
        }
    }
}
