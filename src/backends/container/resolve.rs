//! Which lower directories a container stacks for its image, and the defaults its sessions
//! start with (docs/images.md "How nodes use images"). A name without `/` is a node-local
//! image (`edges[].images`); `project/name:tag` is read from the image store, its layers
//! taken from the node's layer cache (copied there on first use) or from the store itself
//! with `layer_cache: false`. While a sandbox runs, `inuse/<edge>/<sandbox>` in the store
//! lists its layers, so `image gc` keeps them even when its image is deleted (a pack_diff or
//! fork still needs them).

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::backends::BackendError;
use crate::images::cache::{CacheError, Layers};
use crate::images::digest::Digest;
use crate::images::name::ImageRef;
use crate::images::store::{Store, StoreError};

/// What a creation stacks and starts with.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resolved {
    /// Lower directories, topmost first.
    pub lowers: Vec<PathBuf>,
    pub env: BTreeMap<String, String>,
    /// "" when the image sets none.
    pub workdir: String,
    /// The image's default user ("" when it sets none): the sandbox's `init_user` when the
    /// creation names none.
    pub user: String,
    /// The store layers, bottom first (empty for a node-local image).
    pub layers: Vec<Digest>,
    /// A memory snapshot's directory in the store (`snapshots/<name>`): the image is a
    /// microVM's saved state, to restore rather than stack (no `lowers`, no `layers`).
    pub vm_snapshot: Option<PathBuf>,
}

/// How long a cached layer copy no sandbox of the node uses stays (docs/images.md).
pub const CACHE_IDLE: Duration = Duration::from_secs(6 * 3600);
/// How often creations look for copies to reclaim.
const RECLAIM_EVERY: Duration = Duration::from_secs(600);

/// The images a container backend can start.
pub struct Images {
    local: BTreeMap<String, Vec<PathBuf>>,
    layers: Option<Arc<Layers>>,
    edge_id: String,
    /// The store layers (hex) each of this backend's sandboxes stacks: never reclaimed.
    using: Mutex<HashMap<String, Vec<String>>>,
    last_reclaim: Mutex<Option<Instant>>,
}

impl Images {
    /// `local`: node-local images (checked already); `store`: the image store's root, if the
    /// cluster has one; `cache`: the node's layer cache directory (None: `layer_cache` off).
    /// Errors: `Config` when the cache directory cannot be made.
    pub fn new(
        backend: &str,
        edge_id: &str,
        local: BTreeMap<String, Vec<PathBuf>>,
        store: Option<&Path>,
        cache: Option<PathBuf>,
    ) -> Result<Images, BackendError> {
        let layers = match store {
            None => None,
            Some(root) => Some(Arc::new(
                Layers::new(Arc::new(Store::at(root)), cache).map_err(|e| {
                    BackendError::Config {
                        backend: backend.to_string(),
                        message: crate::types::chain(&e),
                    }
                })?,
            )),
        };
        Ok(Images {
            local,
            layers,
            edge_id: edge_id.to_string(),
            using: Mutex::new(HashMap::new()),
            last_reclaim: Mutex::new(None),
        })
    }

    /// The image store, if the cluster has one.
    pub fn store(&self) -> Option<Arc<Store>> {
        self.layers.as_ref().map(|l| l.store().clone())
    }

    /// The lowers of a node-local image, if it is one.
    pub fn local(&self, image: &str) -> Option<&Vec<PathBuf>> {
        self.local.get(image)
    }

    /// Resolves `image` for a creation. Errors: `ImageNotFound` (`not_found`: no such local
    /// image, no image store, or no such image in it), `Invalid` (a malformed store name),
    /// `ImageUnavailable` (`unavailable`: the store cannot be read now, or a layer cannot be
    /// copied to the node).
    pub async fn resolve(&self, sandbox_id: &str, image: &str) -> Result<Resolved, BackendError> {
        if let Some(lowers) = self.local.get(image) {
            let d = lowers
                .first()
                .map(|top| super::image::defaults(top))
                .unwrap_or_default();
            return Ok(Resolved {
                lowers: lowers.clone(),
                env: d.env,
                workdir: d.workdir,
                ..Default::default()
            });
        }
        let not_found = || BackendError::ImageNotFound {
            image: image.to_string(),
        };
        let (Some(layers), true) = (&self.layers, image.contains('/')) else {
            return Err(not_found());
        };
        let name = ImageRef::parse(image).map_err(|f| BackendError::Invalid {
            sandbox_id: sandbox_id.to_string(),
            message: f.message,
        })?;
        let store = layers.store().clone();
        let unavailable = |message: String| BackendError::ImageUnavailable {
            image: image.to_string(),
            message,
        };
        let manifest = tokio::task::spawn_blocking(move || store.read_manifest(&name))
            .await
            .map_err(|e| unavailable(e.to_string()))?
            .map_err(|e| match e {
                StoreError::NotFound(_) => not_found(),
                e => unavailable(crate::types::chain(&e)),
            })?;
        if !manifest.vm_snapshot.is_empty() {
            let dir = layers
                .store()
                .snapshot_dir(&manifest.vm_snapshot)
                // A store changed by hand: no retry mends it, so not `unavailable`.
                .ok_or_else(|| BackendError::Create {
                    sandbox_id: sandbox_id.to_string(),
                    message: format!(
                        "image {image}: its manifest names snapshot {:?}, which is no \
                         snapshot's name (the store was changed by hand)",
                        manifest.vm_snapshot
                    ),
                })?;
            return Ok(Resolved {
                user: manifest.user,
                workdir: manifest.workdir,
                vm_snapshot: Some(dir),
                ..Default::default()
            });
        }
        self.stack(
            image,
            manifest.layers,
            &manifest.env,
            manifest.workdir,
            manifest.user,
        )
        .await
    }

    /// Resolves a fork copy's files (docs/images.md "Fork"): `files.layers` from the store,
    /// whatever `image`'s manifest says now (it may be gone), with the source's defaults.
    /// Errors: `ImageNotFound` (no image store), `ImageUnavailable` (a layer cannot be
    /// copied to the node).
    pub async fn resolve_fork(
        &self,
        image: &str,
        files: &crate::backends::ForkFiles,
    ) -> Result<Resolved, BackendError> {
        if self.layers.is_none() {
            return Err(BackendError::ImageNotFound {
                image: image.to_string(),
            });
        }
        self.stack(
            image,
            files.layers.clone(),
            &files.env,
            files.workdir.clone(),
            files.user.clone(),
        )
        .await
    }

    /// The cached copies of `layers` (bottom first), topmost first, with the defaults.
    async fn stack(
        &self,
        image: &str,
        layers_bottom_first: Vec<Digest>,
        env: &[String],
        workdir: String,
        user: String,
    ) -> Result<Resolved, BackendError> {
        let unavailable = |message: String| BackendError::ImageUnavailable {
            image: image.to_string(),
            message,
        };
        let Some(layers) = &self.layers else {
            return Err(BackendError::ImageNotFound {
                image: image.to_string(),
            });
        };
        let mut lowers = Vec::with_capacity(layers_bottom_first.len());
        for l in layers_bottom_first.iter().rev() {
            lowers.push(layers.get(l).await.map_err(|e| match e {
                CacheError::Missing(_) => unavailable(format!(
                    "{} (the store is damaged: `opendsec ctl image store-check`)",
                    crate::types::chain(&e)
                )),
                e => unavailable(crate::types::chain(&e)),
            })?);
        }
        let env = env
            .iter()
            .filter_map(|kv| kv.split_once('='))
            .filter(|(k, _)| !k.is_empty())
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        Ok(Resolved {
            lowers,
            env,
            workdir,
            user,
            layers: layers_bottom_first,
            vm_snapshot: None,
        })
    }

    fn using(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<String>>> {
        match self.using.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Notes that `sandbox_id` stacks the layers `hexes` (a sandbox taken over after a
    /// restart), so their cached copies stay.
    pub fn hold(&self, sandbox_id: &str, hexes: &[String]) {
        if !hexes.is_empty() {
            self.using().insert(sandbox_id.to_string(), hexes.to_vec());
        }
    }

    /// At most every ten minutes, removes in the background the cached copies that no
    /// sandbox of this backend stacks and none used for [`CACHE_IDLE`].
    pub fn maybe_reclaim(&self) {
        let Some(layers) = self.layers.clone() else {
            return;
        };
        {
            let mut last = match self.last_reclaim.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            if last.is_some_and(|t| t.elapsed() < RECLAIM_EVERY) {
                return;
            }
            *last = Some(Instant::now());
        }
        let keep: HashSet<String> = self.using().values().flatten().cloned().collect();
        tokio::task::spawn_blocking(move || {
            let gone = layers.reclaim(CACHE_IDLE, &keep);
            if !gone.is_empty() {
                tracing::info!(
                    layers = gone.len(),
                    "reclaimed cached layer copies no sandbox used for 6 h"
                );
            }
        });
    }

    fn inuse_dir(&self) -> Option<PathBuf> {
        self.layers
            .as_ref()
            .map(|l| l.store().root().join("inuse").join(&self.edge_id))
    }

    /// Records that `sandbox_id` stacks `layers` (a no-op for node-local images). Errors:
    /// `ImageUnavailable` when the store cannot be written.
    pub async fn mark_in_use(
        &self,
        sandbox_id: &str,
        layers: &[Digest],
    ) -> Result<(), BackendError> {
        let Some(dir) = self.inuse_dir().filter(|_| !layers.is_empty()) else {
            return Ok(());
        };
        let hexes: Vec<String> = layers.iter().map(|d| d.hex().to_string()).collect();
        self.hold(sandbox_id, &hexes);
        let body: String = layers.iter().map(|d| format!("{d}\n")).collect();
        let id = sandbox_id.to_string();
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            std::fs::create_dir_all(&dir)?;
            let tmp = dir.join(format!(".{id}.tmp"));
            std::fs::write(&tmp, body)?;
            std::fs::rename(&tmp, dir.join(&id))
        })
        .await
        .map_err(|e| std::io::Error::other(e.to_string()))
        .and_then(|r| r)
        .map_err(|e| BackendError::ImageUnavailable {
            image: format!("(in-use record of {sandbox_id})"),
            message: e.to_string(),
        })
    }

    /// Drops `sandbox_id`'s in-use record, if any. A store that cannot be written is logged:
    /// a record left behind only keeps layers from `image gc` longer.
    pub async fn release(&self, sandbox_id: &str) {
        self.using().remove(sandbox_id);
        let Some(dir) = self.inuse_dir() else {
            return;
        };
        let p = dir.join(sandbox_id);
        let r = tokio::task::spawn_blocking(move || std::fs::remove_file(&p)).await;
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::NotFound => {}
            Ok(Err(e)) => {
                tracing::warn!(sandbox_id, error = %e, "removing the sandbox's in-use record")
            }
            Err(e) => {
                tracing::warn!(sandbox_id, error = %e, "removing the sandbox's in-use record")
            }
        }
    }

    /// Drops the in-use records of this edge's sandboxes not in `keep` (after a crash).
    /// Returns what went.
    pub async fn release_strays(&self, keep: &HashSet<String>) -> Vec<String> {
        let Some(dir) = self.inuse_dir() else {
            return Vec::new();
        };
        let keep = keep.clone();
        tokio::task::spawn_blocking(move || {
            let mut gone = Vec::new();
            let Ok(rd) = std::fs::read_dir(&dir) else {
                return gone;
            };
            for e in rd.flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                let id = name.trim_start_matches('.').trim_end_matches(".tmp");
                if !keep.contains(id) && std::fs::remove_file(e.path()).is_ok() {
                    gone.push(format!("in-use record {name}"));
                }
            }
            gone
        })
        .await
        .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::images::store::ImageManifest;

    fn layer(store: &Store, file: &str, body: &[u8]) -> Digest {
        let d = Digest::of(body);
        store
            .put_layer(&d, |r| std::fs::write(r.join(file), body))
            .expect("layer");
        d
    }

    #[tokio::test]
    async fn a_store_image_resolves_to_cached_layers_topmost_first_with_its_defaults() {
        let d = tempfile::tempdir().expect("tempdir");
        let store = Store::open(&d.path().join("store")).expect("store");
        let (a, b) = (layer(&store, "a", b"bottom"), layer(&store, "b", b"top"));
        let name = ImageRef::parse("root/py:1").expect("name");
        store
            .write_manifest(
                &name,
                &ImageManifest {
                    layers: vec![a.clone(), b.clone()],
                    env: vec!["PATH=/opt/bin:/bin".into(), "EMPTY=".into(), "junk".into()],
                    workdir: "/srv".into(),
                    user: "1000:1000".into(),
                    ..Default::default()
                },
                false,
            )
            .expect("manifest");
        let cache = d.path().join("cache");
        let images = Images::new(
            "container",
            "edge-1",
            BTreeMap::new(),
            Some(&d.path().join("store")),
            Some(cache.clone()),
        )
        .expect("images");
        let r = images
            .resolve("edge-1.x", "root/py:1")
            .await
            .expect("resolve");
        assert_eq!(
            r.lowers,
            vec![
                cache.join(b.hex()).join("rootfs"),
                cache.join(a.hex()).join("rootfs")
            ]
        );
        assert_eq!(r.env.get("PATH").map(String::as_str), Some("/opt/bin:/bin"));
        assert_eq!(r.env.get("EMPTY").map(String::as_str), Some(""));
        assert_eq!(r.env.len(), 2);
        assert_eq!((r.workdir.as_str(), r.user.as_str()), ("/srv", "1000:1000"));

        // Unknown images, names that are no store name, and local names with no such image.
        for bad in ["root/nope:1", "host", ""] {
            assert!(
                matches!(
                    images.resolve("edge-1.x", bad).await,
                    Err(BackendError::ImageNotFound { .. })
                ),
                "{bad}"
            );
        }
        assert!(matches!(
            images.resolve("edge-1.x", "root/Bad:1").await,
            Err(BackendError::Invalid { .. })
        ));
        // A memory snapshot's image resolves to its directory; one whose manifest names no
        // snapshot directory (a store changed by hand) is an internal error, not a
        // passing unavailability.
        for (tag, dir, ok) in [("2", "7-warm", true), ("3", "../layers", false)] {
            store
                .write_manifest(
                    &ImageRef::parse(&format!("root/py:{tag}")).expect("name"),
                    &ImageManifest {
                        snapshot: true,
                        memory: true,
                        vm_snapshot: dir.into(),
                        ..Default::default()
                    },
                    false,
                )
                .expect("manifest");
            let r = images.resolve("edge-1.x", &format!("root/py:{tag}")).await;
            if ok {
                assert_eq!(
                    r.expect("a snapshot image").vm_snapshot,
                    store.snapshot_dir(dir)
                );
            } else {
                let e = r.expect_err("a bad snapshot name");
                assert_eq!(e.reason(), crate::types::Reason::Internal, "{e}");
            }
        }

        // In-use records: written, listed under the edge, released one by one and as strays.
        images
            .mark_in_use("edge-1.x", &r.layers)
            .await
            .expect("mark");
        images
            .mark_in_use("edge-1.y", &r.layers)
            .await
            .expect("mark");
        let rec = d.path().join("store/inuse/edge-1");
        assert_eq!(
            std::fs::read_to_string(rec.join("edge-1.x")).expect("read"),
            format!("{a}\n{b}\n")
        );
        images.release("edge-1.x").await;
        assert!(!rec.join("edge-1.x").exists());
        let keep: HashSet<String> = ["edge-1.z".to_string()].into();
        assert_eq!(
            images.release_strays(&keep).await,
            vec!["in-use record edge-1.y".to_string()]
        );
        assert_eq!(std::fs::read_dir(&rec).expect("dir").count(), 0);
    }
}
