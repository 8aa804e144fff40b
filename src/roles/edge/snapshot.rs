//! `SnapshotSandbox`: a microVM's memory snapshot written into the image store's
//! `snapshots/<dir>`, for `create_snapshot(memory=True)` and a microVM's fork
//! (docs/images.md "Memory snapshots", "Fork"). It runs under the sandbox's operation lock,
//! so no stop, pause or resume runs while the VM's state is saved.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use super::metrics;
use super::node::{as_handle, handle, Core};
use super::record::SandboxRecord;
use crate::backends::{Backend, SnapshotTarget};
use crate::images::store::Store;
use crate::pb;
use crate::types::Failure;

impl Core {
    /// Snapshots sandbox `req.id` (running or paused) with its memory into
    /// `<store>/snapshots/<req.dir>`, which must not exist; a running VM stands still for
    /// the copy and goes on, a paused one stays paused. Errors: `invalid` (a bad `dir`, a
    /// backend without memory snapshots), `not_found`, `conflict` (a sandbox in another
    /// state), `unavailable` (no image store), `internal` (saving the VM failed).
    pub async fn snapshot(
        &self,
        req: pb::EdgeSnapshotRequest,
    ) -> Result<pb::EdgeSnapshotResponse, Failure> {
        let entry = self.entry(&req.id)?;
        let _g = entry.op.lock().await;
        let rec = entry.snapshot();
        let backend = self.backend_while_live(&rec, "snapshot")?;
        if backend.snapshotter().is_none() {
            return Err(Failure::invalid(format!(
                "sandbox {}: the {} backend keeps no memory to snapshot (memory=True is \
                 for microVMs; a snapshot without it keeps a container's files)",
                rec.id(),
                backend.name()
            )));
        }
        let dir = self.snapshot_dir(&req.dir)?;
        self.snapshot_locked(&rec, &backend, dir).await
    }

    /// `<store>/snapshots/<name>`. Errors: `unavailable` (no image store), `invalid` (a
    /// name that is no snapshot directory's, a path among them).
    pub fn snapshot_dir(&self, name: &str) -> Result<PathBuf, Failure> {
        let Some(root) = &self.image_store else {
            return Err(Failure::unavailable(
                "this cluster has no image store (image_store.root) to keep snapshots in",
            ));
        };
        Store::at(root).snapshot_dir(name).ok_or_else(|| {
            Failure::invalid(format!(
                "{} is no snapshot directory name",
                crate::types::names::shown(name)
            ))
        })
    }

    /// Has `backend`'s snapshotter write `rec`'s memory snapshot into `dir`; the caller
    /// holds the sandbox's operation lock and has checked that the backend has one.
    /// Errors: as [`Core::snapshot`].
    pub(crate) async fn snapshot_locked(
        &self,
        rec: &SandboxRecord,
        backend: &Arc<dyn Backend>,
        dir: PathBuf,
    ) -> Result<pb::EdgeSnapshotResponse, Failure> {
        let id = rec.id().to_string();
        let Some(snapshotter) = backend.snapshotter() else {
            return Err(Failure::internal(format!(
                "sandbox {id}: the {} backend has no snapshots",
                backend.name()
            )));
        };
        let parts = handle(rec);
        let t = Instant::now();
        let target = SnapshotTarget {
            dir: dir.clone(),
            memory: true,
        };
        let r = snapshotter.snapshot(&as_handle(&id, &parts), &target).await;
        metrics::op_done(backend.name(), "snapshot", &r, t);
        let (_, info) = r.map_err(|e| {
            tracing::warn!(error = %crate::types::chain(&e), "snapshot failed");
            e.to_failure()
        })?;
        tracing::info!(dir = %dir.display(), bytes = info.bytes, paused_ms = info.paused_ms, secs = t.elapsed().as_secs_f64(), "memory snapshot taken");
        let spec = rec.spec();
        Ok(pb::EdgeSnapshotResponse {
            image: spec.image.clone(),
            memory_mb: u32::try_from(spec.memory_limit_mb).unwrap_or(u32::MAX),
            vcpus: spec.cpu_cores_limit.ceil().max(1.0) as u32,
            bytes: info.bytes,
            paused_ms: info.paused_ms,
        })
    }
}
