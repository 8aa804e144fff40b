//! Startup, before serving (docs/architecture.md): read the
//! records; hand RUNNING and PAUSED sandboxes (and ones caught mid-pause or mid-resume) to
//! their backends to adopt; mark CREATING ones FAILED and STOPPING ones STOPPED and release
//! their leases; keep ended records for their retention; then let each backend clean up
//! leftovers that match no record. A CREATING one is marked `interrupted`: the caller's
//! retry of that creation creates it again (`create_batch`).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::node::{as_handle, handle, lock, Core, Entry};
use super::record::SandboxRecord;
use super::store::StoreError;
use crate::backends::Recorded;
use crate::pb::SandboxState;
use crate::types::now_s;

/// What recovery found, for the log and tests.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RecoverReport {
    pub adopted: usize,
    pub failed: usize,
    pub stopped: usize,
    pub kept_ended: usize,
    pub corrupt: usize,
}

impl Core {
    /// Loads and re-adopts the recorded sandboxes (no-op without `persist_state`).
    pub async fn recover(self: &Arc<Self>) -> Result<RecoverReport, StoreError> {
        let Some(store) = &self.store else {
            return Ok(RecoverReport::default());
        };
        let flags = store.read_flags()?;
        self.draining.store(flags.draining, Ordering::Relaxed);
        let (recs, bad) = store.load_all()?;
        let mut report = RecoverReport {
            corrupt: bad.len(),
            ..Default::default()
        };
        for (p, why) in &bad {
            tracing::warn!(edge_id = %self.edge_id, path = %p.display(), why = %why, "unreadable sandbox record set aside");
        }
        let now = now_s();
        let adopted =
            futures::future::join_all(recs.into_iter().map(|r| self.recover_one(r, now))).await;
        let mut changed = Vec::new();
        for (rec, was_changed, release) in adopted {
            match rec.state() {
                SandboxState::Running | SandboxState::Paused => report.adopted += 1,
                SandboxState::Failed if was_changed => report.failed += 1,
                SandboxState::Stopped if was_changed => report.stopped += 1,
                _ => report.kept_ended += 1,
            }
            if release {
                self.release_lease(&rec, true);
            }
            if was_changed {
                changed.push(rec.clone());
            }
            let seq = self.account(&rec);
            let entry = Entry::new(rec);
            entry
                .since_seq
                .store(seq, std::sync::atomic::Ordering::SeqCst);
            lock(&self.entries).insert(entry.snapshot().id().to_string(), Arc::new(entry));
        }
        self.persist_many(&changed).await;

        // Leftovers: everything not belonging to a live record. Every backend is given
        // every live sandbox of the edge, not only its own: backends share some of what
        // they keep per sandbox (the image store's in-use records of the edge), and ids are
        // unique across them, so nothing of one backend's is another's to remove.
        let keep: HashSet<String> = self
            .all()
            .iter()
            .map(|e| e.snapshot())
            .filter(|r| !r.is_ended())
            .map(|r| r.id().to_string())
            .collect();
        for (name, slot) in &self.slots {
            match slot.backend.cleanup(&keep).await {
                Ok(rep) if !rep.removed.is_empty() => {
                    tracing::info!(edge_id = %self.edge_id, backend = %name, removed = ?rep.removed, "cleaned up leftovers")
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::warn!(edge_id = %self.edge_id, backend = %name, error = %crate::types::chain(&e), "cleaning up leftovers")
                }
            }
        }
        tracing::info!(edge_id = %self.edge_id, ?report, "records recovered");
        Ok(report)
    }

    /// One record: returns it as it is now, whether it changed, and whether its lease is to
    /// be released (verified against IAM).
    async fn recover_one(&self, mut rec: SandboxRecord, now: i64) -> (SandboxRecord, bool, bool) {
        let recorded = match rec.state() {
            SandboxState::Running | SandboxState::Pausing => Recorded::Running,
            SandboxState::Paused | SandboxState::Resuming => Recorded::Paused,
            SandboxState::Creating => {
                rec.end(
                    SandboxState::Failed,
                    now,
                    "the edge restarted during creation",
                );
                rec.interrupted = true;
                return (rec, true, true);
            }
            SandboxState::Stopping => {
                rec.end(
                    SandboxState::Stopped,
                    now,
                    "stopped: the edge restarted while stopping it",
                );
                return (rec, true, true);
            }
            _ => return (rec, false, false),
        };
        let Some(backend) = self.backend_of(&rec).cloned() else {
            let msg = format!(
                "backend {:?} is no longer configured on this edge",
                rec.backend()
            );
            rec.end(SandboxState::Failed, now, msg);
            return (rec, true, true);
        };
        let id = rec.id().to_string();
        let parts = handle(&rec);
        match backend.adopt(&as_handle(&id, &parts), recorded).await {
            Ok(a) => {
                let before = rec.state();
                let state = if a.paused {
                    SandboxState::Paused
                } else {
                    SandboxState::Running
                };
                let changed = before != state || a.state != rec.backend_state;
                rec.backend_state = a.state;
                rec.set_state(state);
                // Idle time is not known across the restart; it starts again now.
                rec.sandbox.last_active_at = now.max(rec.sandbox.last_active_at);
                (rec, changed, false)
            }
            Err(e) => {
                tracing::warn!(sandbox_id = %id, edge_id = %self.edge_id, error = %crate::types::chain(&e), "could not adopt sandbox");
                rec.end(
                    SandboxState::Failed,
                    now,
                    format!(
                        "could not adopt after an edge restart: {e}",
                        e = crate::types::chain(&e)
                    ),
                );
                (rec, true, true)
            }
        }
    }
}
