//! `CreateSnapshot` with `memory` (docs/images.md "Memory snapshots"): the sandbox's edge
//! writes a microVM's memory snapshot into the store's `snapshots/<dir>`, then the image is
//! registered here naming that directory. Sandboxes created from the image are restored
//! from it, with the processes it had running.

use super::auth::Caller;
use super::images::{blocking, info, now_rfc3339, PUBLISH};
use super::Inner;
use crate::images::name::ImageRef;
use crate::images::store::{new_snapshot_name, ImageManifest, StoreError};
use crate::pb;
use crate::rpc::failure_from_status;
use crate::types::Failure;

impl Inner {
    /// Saves sandbox `id` (a running or paused microVM) with its memory as image `image`.
    /// With `overwrite`, an image of that name is replaced and its own memory snapshot
    /// removed. Errors: `invalid` (names, a backend without memory snapshots, no image
    /// store), `forbidden` (no `sandbox.operate` on the sandbox's project, no
    /// `layer.publish` on the image's), `not_found`, `conflict` (the name exists and
    /// `overwrite` is off; a sandbox neither running nor paused), `internal` (saving the VM
    /// failed; nothing is registered and its files are removed).
    pub(crate) async fn memory_snapshot(
        &self,
        caller: &Caller,
        id: &str,
        image: &str,
        overwrite: bool,
    ) -> Result<pb::ImageInfo, Failure> {
        let name = ImageRef::parse(image)?;
        let store = self.store()?;
        let addr = self.authorize_sandbox(caller, id).await?;
        self.auth.authorize(caller, &name.project, PUBLISH).await?;
        if !overwrite {
            let (s, n) = (store.clone(), name.clone());
            blocking(move || match s.manifest_path(&n).exists() {
                true => Err(StoreError::Exists(n.to_string()).to_failure()),
                false => Ok(()),
            })
            .await?;
        }
        let dir = new_snapshot_name();
        let taken = self
            .edges
            .edge(&addr)?
            .snapshot_sandbox(self.edges.req(pb::EdgeSnapshotRequest {
                id: id.to_string(),
                dir: dir.clone(),
            }))
            .await
            .map_err(|s| failure_from_status(&s));
        let taken = match taken {
            Ok(t) => t.into_inner(),
            Err(f) => {
                // Whatever a failed or cut-off snapshot left goes now (else gc takes it).
                super::fork::remove_snapshot(store.clone(), dir).await;
                return Err(f);
            }
        };
        let principal = caller.principal.clone();
        let id = id.to_string();
        blocking(move || {
            // The parent's defaults; a parent deleted since the sandbox started has none.
            let parent = ImageRef::parse(&taken.image)
                .ok()
                .and_then(|p| store.read_manifest(&p).ok())
                .unwrap_or_default();
            let replaced = store
                .read_manifest(&name)
                .ok()
                .map(|m| m.vm_snapshot)
                .filter(|d| !d.is_empty());
            let m = ImageManifest {
                env: parent.env,
                workdir: parent.workdir,
                user: parent.user,
                parent: taken.image.clone(),
                source: crate::images::store::snapshot_source(&id),
                created: now_rfc3339(),
                created_by: principal,
                snapshot: true,
                memory: true,
                vm_snapshot: dir.clone(),
                memory_mb: u64::from(taken.memory_mb),
                ..Default::default()
            };
            if let Err(e) = store.write_manifest(&name, &m, overwrite) {
                if let Err(r) = store.remove_snapshot(&dir) {
                    tracing::warn!(dir = %dir, error = %crate::types::chain(&r), "removing an unregistered snapshot");
                }
                return Err(e.to_failure());
            }
            if let Some(old) = replaced.filter(|d| *d != dir) {
                // Copies made from it hold its files by links of their own.
                if let Err(e) = store.remove_snapshot(&old) {
                    tracing::warn!(dir = %old, error = %crate::types::chain(&e), "removing a replaced snapshot (gc takes it later)");
                }
            }
            tracing::info!(image = %name, sandbox_id = %id, dir = %dir, bytes = taken.bytes, paused_ms = taken.paused_ms, "memory snapshot registered");
            Ok(info(&name, &m))
        })
        .await
    }
}
