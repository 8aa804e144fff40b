//! `PackSandbox`: a sandbox's writable layer becomes one new layer of the image store, for
//! `pack_diff` and container snapshots (docs/images.md "Images from sandboxes"). It runs
//! under the sandbox's operation lock, so no stop, pause or resume runs during the copy. For
//! a fork of a backend with memory snapshots (a microVM), a memory snapshot is taken instead
//! (docs/images.md "Fork").

use std::time::Instant;

use super::metrics;
use super::node::{as_handle, handle, Core};
use crate::images::pack::Scrub;
use crate::pb;
use crate::types::Failure;

impl Core {
    /// Packs sandbox `req.id` (running or paused); for a fork (`fork_snapshot` set) of a
    /// backend with memory snapshots, writes one into `<store>/snapshots/<fork_snapshot>`
    /// instead and answers `memory` with no layers. Errors: `invalid` (bad scrub globs or
    /// snapshot name, a backend that cannot pack, a node-local image, a device node in its
    /// files), `not_found`, `conflict` (a sandbox in another state), `unavailable` (no image
    /// store), `internal` (freezing or reading its disk, or saving the VM, failed).
    pub async fn pack(&self, req: pb::EdgePackRequest) -> Result<pb::EdgePackResponse, Failure> {
        let scrub = if req.default_scrub || !req.scrub.is_empty() {
            Scrub::new(req.default_scrub, &req.scrub)?
        } else {
            Scrub::none()
        };
        let entry = self.entry(&req.id)?;
        let _g = entry.op.lock().await;
        let rec = entry.snapshot();
        let id = rec.id().to_string();
        let what = if req.fork_snapshot.is_empty() {
            "pack"
        } else {
            "fork"
        };
        let backend = self.backend_while_live(&rec, what)?;
        if !req.fork_snapshot.is_empty() && backend.snapshotter().is_some() {
            let dir = self.snapshot_dir(&req.fork_snapshot)?;
            // Logged under the RPC that asked (PackSandbox); this line says what it did.
            tracing::info!(snapshot = %req.fork_snapshot, "fork: saving a memory snapshot rather than packing");
            let s = self.snapshot_locked(&rec, &backend, dir).await?;
            return Ok(pb::EdgePackResponse {
                image: s.image,
                memory: true,
                ..Default::default()
            });
        }
        let Some(packer) = backend.packer() else {
            let hint = if backend.snapshotter().is_some() {
                " (it saves a sandbox with its memory: create_snapshot(memory=True), or ctl image snapshot -memory)"
            } else {
                ""
            };
            return Err(Failure::invalid(format!(
                "sandbox {id}: the {} backend cannot save a sandbox's files as an image{hint}",
                backend.name()
            )));
        };
        let parts = handle(&rec);
        let t = Instant::now();
        let r = packer.pack(&as_handle(&id, &parts), &scrub).await;
        metrics::op_done(backend.name(), "pack", &r, t);
        let p = r.map_err(|e| {
            tracing::warn!(error = %crate::types::chain(&e), "pack failed");
            e.to_failure()
        })?;
        tracing::info!(diff_id = %p.diff_id, entries = p.packed.entries, bytes = p.packed.file_bytes, scrubbed = p.packed.scrubbed, secs = t.elapsed().as_secs_f64(), "sandbox packed");
        Ok(pb::EdgePackResponse {
            image: rec.spec().image,
            layers: p.layers.iter().map(|d| d.to_string()).collect(),
            entries: p.packed.entries,
            file_bytes: p.packed.file_bytes,
            scrubbed: p.packed.scrubbed,
            memory: false,
        })
    }
}
