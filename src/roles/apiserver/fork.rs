//! `ForkSandbox` (docs/images.md "Fork"): one snapshot of the source's files, then `count`
//! ordinary creations from it. The source's edge packs its writable layer into the image
//! store (the source frozen only for that copy), the layers are handed to the copies'
//! edges with the source's image defaults, and each copy is authorized, charged and placed
//! like any creation, on the source's node first. The snapshot is registered as no image:
//! the copies' in-use records keep its layer while they run, `image gc` takes it after.
//! A microVM's edge takes a memory snapshot instead (into the store's `snapshots/`), the
//! copies are restored from it, and it is removed once they are made (each holds its files
//! by links of its own).

use std::sync::Arc;
use std::time::Instant;

use super::auth::Caller;
use super::create::{self, Fork};
use super::Inner;
use crate::images::name::ImageRef;
use crate::images::store::{new_snapshot_name, Store};
use crate::pb::{self, SandboxState};
use crate::rpc::failure_from_status;
use crate::types::Failure;

/// The most copies one call makes (docs/images.md "Fork").
pub(crate) const MAX_COPIES: u32 = 256;

/// A fork ready to run: the copies' project and spec, and where their files come from.
pub(crate) struct Prepared {
    pub project: String,
    pub spec: pb::SandboxSpec,
    pub fork: Fork,
    pub items: Vec<create::Item>,
}

/// Checks the request alone, before anything is asked of a node. Errors: `invalid`.
pub(crate) fn check(req: &pb::ForkSandboxRequest) -> Result<(), Failure> {
    if req.count == 0 || req.count > MAX_COPIES {
        return Err(Failure::invalid(format!(
            "count {} must be within 1..{MAX_COPIES}",
            req.count
        )));
    }
    if req.idempotency_key.len() > 256 {
        return Err(Failure::invalid(
            "idempotency_key longer than 256 characters",
        ));
    }
    if req.ttl_running_stop < -1 {
        return Err(Failure::invalid(format!(
            "ttl_running_stop {} must be >= 0 (0 for the cluster default, -1 for none)",
            req.ttl_running_stop
        )));
    }
    if req.ttl_max < 0 {
        return Err(Failure::invalid(format!(
            "ttl_max {} must be >= 0 (0 for the cluster default)",
            req.ttl_max
        )));
    }
    Ok(())
}

impl Inner {
    /// Snapshots the source and makes the copies' spec. Errors: `invalid` (the request, a
    /// backend that cannot copy files, a node-local image), `forbidden` (no
    /// `sandbox.operate` on the source's project), `not_found`, `conflict` (a source
    /// neither running nor paused), `unavailable` (the source's edge, the image store).
    pub(crate) async fn prepare_fork(
        &self,
        caller: &Caller,
        req: &pb::ForkSandboxRequest,
    ) -> Result<Prepared, Failure> {
        check(req)?;
        let addr = self.authorize_sandbox(caller, &req.id).await?;
        let mut edge = self.edges.edge(&addr)?;
        let source = edge
            .get_sandbox(self.edges.req(pb::SandboxRef { id: req.id.clone() }))
            .await
            .map_err(|s| failure_from_status(&s))?
            .into_inner();
        if !matches!(source.state(), SandboxState::Running | SandboxState::Paused) {
            return Err(Failure::conflict(format!(
                "sandbox {}: cannot fork a sandbox that is {}",
                req.id,
                source.state().as_str_name()
            )));
        }
        let mut spec = source.spec.clone().unwrap_or_default();
        spec.labels.extend(req.labels.clone());
        if !req.task_id.is_empty() {
            spec.task_id = req.task_id.clone();
        }
        spec.ttl_running_stop = req.ttl_running_stop;
        spec.ttl_max = req.ttl_max;
        let spec = super::admission::normalize_spec(&spec, &self.cfg.admission, &self.net_rules)?;
        if !spec.image.contains('/') {
            return Err(Failure::invalid(format!(
                "sandbox {}: a fork copies the files of a sandbox of a store image; {:?} is a node-local image",
                req.id, spec.image
            )));
        }
        let store = self.images.clone().ok_or_else(|| {
            Failure::invalid("this cluster has no image store, which a fork's copies start from")
        })?;
        let started = Instant::now();
        let dir = new_snapshot_name();
        let packed = edge
            .pack_sandbox(self.edges.req(pb::EdgePackRequest {
                id: req.id.clone(),
                scrub: Vec::new(),
                default_scrub: false,
                fork_snapshot: dir.clone(),
            }))
            .await
            .map_err(|s| failure_from_status(&s));
        let packed = match packed {
            Ok(p) => p.into_inner(),
            Err(f) => {
                // What a memory snapshot cut off left (else gc takes it).
                remove_snapshot(store.clone(), dir).await;
                return Err(f);
            }
        };
        tracing::info!(sandbox_id = %req.id, layers = packed.layers.len(), file_bytes = packed.file_bytes, memory = packed.memory, secs = started.elapsed().as_secs_f64(), "fork snapshot taken");
        // The source image's defaults, as the source started with them; an image deleted
        // since has none to give (its sandboxes' own settings still travel in the spec).
        let image = spec.image.clone();
        let defaults = tokio::task::spawn_blocking(move || {
            ImageRef::parse(&image)
                .ok()
                .and_then(|r| store.read_manifest(&r).ok())
                .unwrap_or_default()
        })
        .await
        .unwrap_or_default();
        let key = if req.idempotency_key.is_empty() {
            hex::encode(rand::random::<[u8; 16]>())
        } else {
            req.idempotency_key.clone()
        };
        // Keys of their own, so a fork's copies never collide with a batch under the same key.
        let items = create::items(
            caller,
            &source.project,
            &format!("fork/{}/{key}", req.id),
            0..req.count,
        );
        Ok(Prepared {
            project: source.project,
            spec,
            fork: Fork {
                files: pb::ForkFiles {
                    layers: packed.layers,
                    env: defaults.env,
                    workdir: defaults.workdir,
                    user: defaults.user,
                    snapshot: if packed.memory { dir } else { String::new() },
                },
                source_edge: source.edge_id,
            },
            items,
        })
    }
}

/// Runs a prepared fork's creations, relaying each copy to `tx`, and records
/// `opendsec_apiserver_fork_seconds` (snapshot to last copy; `held`: every copy made landed
/// on the source's node).
pub(crate) async fn run(
    inner: Arc<Inner>,
    caller: Caller,
    p: Prepared,
    started: Instant,
    tx: tokio::sync::mpsc::Sender<Result<pb::CreateSandboxesItem, tonic::Status>>,
) {
    let (relay_tx, mut relay_rx) = tokio::sync::mpsc::channel(256);
    let source_edge = p.fork.source_edge.clone();
    let snapshot = p.fork.files.snapshot.clone();
    let store = inner.images.clone();
    let batch = tokio::spawn(create::run_batch(
        inner,
        caller,
        p.project,
        p.spec,
        Some(p.fork),
        p.items,
        relay_tx,
    ));
    let mut held = true;
    while let Some(item) = relay_rx.recv().await {
        if let Ok(pb::CreateSandboxesItem {
            sandbox: Some(sb), ..
        }) = &item
        {
            held &= sb.edge_id == source_edge;
        }
        if tx.send(item).await.is_err() {
            break;
        }
    }
    drop(relay_rx);
    let _ = batch.await;
    if let (false, Some(store)) = (snapshot.is_empty(), store) {
        // Every copy is made (or failed): each holds the snapshot's files by links of its own.
        remove_snapshot(store, snapshot).await;
    }
    metrics::histogram!("opendsec_apiserver_fork_seconds", "held" => if held { "true" } else { "false" })
        .record(started.elapsed().as_secs_f64());
}

/// Removes memory snapshot `dir` from the store, off the async threads; a failure is
/// logged (`image gc` takes what is left).
pub(super) async fn remove_snapshot(store: Arc<Store>, dir: String) {
    let name = dir.clone();
    let r = tokio::task::spawn_blocking(move || store.remove_snapshot(&name)).await;
    match r {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(dir = %dir, error = %crate::types::chain(&e), "removing a memory snapshot (gc takes it later)")
        }
        Err(e) => tracing::warn!(dir = %dir, error = %e, "removing a memory snapshot"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(count: u32) -> pb::ForkSandboxRequest {
        pb::ForkSandboxRequest {
            id: "e1.abc".into(),
            count,
            ..Default::default()
        }
    }

    #[test]
    fn counts_outside_1_to_256_and_negative_timeouts_are_invalid() {
        assert!(check(&req(1)).is_ok());
        assert!(check(&req(256)).is_ok());
        for bad in [0, 257, u32::MAX] {
            let e = check(&req(bad)).unwrap_err();
            assert_eq!(e.reason, crate::types::Reason::Invalid);
            assert!(e.message.contains("1..256"), "{}", e.message);
        }
        let e = check(&pb::ForkSandboxRequest {
            ttl_max: -5,
            ..req(2)
        })
        .unwrap_err();
        assert!(e.message.contains("ttl_max -5"), "{}", e.message);
        // No idle timeout at all (the E2B gateway's copies live by their lifetime alone).
        assert!(check(&pb::ForkSandboxRequest {
            ttl_running_stop: -1,
            ..req(2)
        })
        .is_ok());
        let e = check(&pb::ForkSandboxRequest {
            ttl_running_stop: -2,
            ..req(2)
        })
        .unwrap_err();
        assert!(e.message.contains("ttl_running_stop -2"), "{}", e.message);
        let e = check(&pb::ForkSandboxRequest {
            idempotency_key: "k".repeat(257),
            ..req(2)
        })
        .unwrap_err();
        assert!(e.message.contains("idempotency_key"), "{}", e.message);
    }
}
