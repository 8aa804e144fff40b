//! The node's layer cache (docs/images.md "How nodes use images"): each layer a container
//! stacks is copied whole from the image store to `<dir>/<hex>/rootfs` the first time it is
//! used (hardlinked where the store is on the node's own file system), and later containers
//! stack the copy, so running containers never read the store and
//! do not notice when it (often NFS) goes away. Layers are immutable, so a copy is keyed by
//! the layer's digest and never refreshed. A copy is made in `<dir>/tmp/` and renamed into
//! place whole; one copy per layer at a time in this process, and a copy finished first by
//! another process (a second backend on the node) wins the rename.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::digest::Digest;
use super::store::Store;

/// Why a layer could not be had.
#[derive(Debug, thiserror::Error)]
pub enum CacheError {
    /// The manifest names a layer the store does not hold (a damaged store).
    #[error("layer {0} is not in the image store")]
    Missing(String),
    #[error("layer cache {what}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
}

/// Where a node finds its layers: in its cache (copied on first use), or straight in the
/// store when `layer_cache` is off.
#[derive(Debug)]
pub struct Layers {
    store: Arc<Store>,
    /// None: stack the store's own layer directories.
    cache: Option<PathBuf>,
    /// Per-layer locks of copies in progress, so concurrent creations copy a layer once.
    copying: Mutex<HashMap<String, Arc<tokio::sync::Mutex<()>>>>,
    seq: AtomicU64,
    /// Held while a use finds and touches a cached copy, and while a reclaim checks and
    /// moves one away: a copy just found is never reclaimed under its user.
    reclaiming: Mutex<()>,
}

impl Layers {
    /// Layers of `store`, copied to `cache` (made if missing) when given. Leftovers of copies
    /// interrupted by a crash (`<cache>/tmp/*`) are removed here. Errors: `Io`.
    pub fn new(store: Arc<Store>, cache: Option<PathBuf>) -> Result<Layers, CacheError> {
        if let Some(dir) = &cache {
            let tmp = dir.join("tmp");
            if tmp.exists() {
                std::fs::remove_dir_all(&tmp).map_err(|source| CacheError::Io {
                    what: format!("removing interrupted copies in {}", tmp.display()),
                    source,
                })?;
            }
            std::fs::create_dir_all(&tmp).map_err(|source| CacheError::Io {
                what: format!("making {}", tmp.display()),
                source,
            })?;
        }
        Ok(Layers {
            store,
            cache,
            copying: Mutex::new(HashMap::new()),
            seq: AtomicU64::new(0),
            reclaiming: Mutex::new(()),
        })
    }

    /// The image store these layers come from.
    pub fn store(&self) -> &Arc<Store> {
        &self.store
    }

    /// The `rootfs` directory of `layer` to stack, copying it into the cache first when it is
    /// not there yet. Errors: `Missing` (not in the store), `Io` (the store unreachable, the
    /// node's disk full).
    pub async fn get(&self, layer: &Digest) -> Result<PathBuf, CacheError> {
        let Some(dir) = &self.cache else {
            let d = self.store.layer_dir(layer);
            let store = self.store.clone();
            let layer2 = layer.clone();
            let has = tokio::task::spawn_blocking(move || store.has_layer(&layer2))
                .await
                .unwrap_or(false);
            if !has {
                return Err(CacheError::Missing(layer.to_string()));
            }
            return Ok(d.join("rootfs"));
        };
        let at = dir.join(layer.hex());
        if self.found(&at) {
            return Ok(at.join("rootfs"));
        }
        let lock = {
            let mut m = match self.copying.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            m.entry(layer.hex().to_string()).or_default().clone()
        };
        let _held = lock.lock().await;
        if !at.is_dir() {
            let n = self.seq.fetch_add(1, Ordering::Relaxed);
            let tmp = dir
                .join("tmp")
                .join(format!("{}.{}.{n}", layer.hex(), std::process::id()));
            let (store, layer2, at2) = (self.store.clone(), layer.clone(), at.clone());
            let started = std::time::Instant::now();
            let copied = tokio::task::spawn_blocking(move || copy_in(&store, &layer2, &tmp, &at2))
                .await
                .map_err(|e| CacheError::Io {
                    what: format!("copying layer {layer}"),
                    source: std::io::Error::other(e.to_string()),
                })??;
            self.found(&at);
            tracing::info!(
                layer = %layer,
                entries = copied.entries,
                linked = copied.linked,
                bytes = copied.file_bytes,
                ms = started.elapsed().as_millis() as u64,
                "layer copied to the node's cache"
            );
        }
        {
            let mut m = match self.copying.lock() {
                Ok(g) => g,
                Err(p) => p.into_inner(),
            };
            if Arc::strong_count(&lock) <= 2 {
                m.remove(layer.hex());
            }
        }
        Ok(at.join("rootfs"))
    }
}

impl Layers {
    fn hold_reclaim(&self) -> std::sync::MutexGuard<'_, ()> {
        match self.reclaiming.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        }
    }

    /// Whether the cached copy `at` is there; if so its time of last use becomes now.
    fn found(&self, at: &Path) -> bool {
        let _g = self.hold_reclaim();
        match std::fs::File::open(at) {
            Ok(f) if at.is_dir() => {
                if let Err(e) = f.set_modified(std::time::SystemTime::now()) {
                    tracing::debug!(path = %at.display(), error = %e, "marking a cached layer used");
                }
                true
            }
            _ => false,
        }
    }

    /// Removes the cached copies not used for `idle` whose digests (hex) are not in `keep`
    /// (the layers of this node's sandboxes), and returns what went. A copy is moved into
    /// `tmp/` and removed from there. Nothing to do without a cache. Failures are logged:
    /// what could not go stays for the next round.
    pub fn reclaim(
        &self,
        idle: std::time::Duration,
        keep: &std::collections::HashSet<String>,
    ) -> Vec<String> {
        let Some(dir) = &self.cache else {
            return Vec::new();
        };
        let Ok(rd) = std::fs::read_dir(dir) else {
            return Vec::new();
        };
        let now = std::time::SystemTime::now();
        let mut gone = Vec::new();
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name == "tmp" || keep.contains(&name) {
                continue;
            }
            let grave = dir.join("tmp").join(format!(
                "reclaim-{name}-{}",
                self.seq.fetch_add(1, Ordering::Relaxed)
            ));
            {
                let _g = self.hold_reclaim();
                let used = e.metadata().and_then(|m| m.modified()).unwrap_or(now);
                if now.duration_since(used).unwrap_or_default() < idle {
                    continue;
                }
                if let Err(err) = std::fs::rename(e.path(), &grave) {
                    tracing::warn!(layer = %name, error = %err, "reclaiming a cached layer");
                    continue;
                }
            }
            if let Err(err) = std::fs::remove_dir_all(&grave) {
                tracing::warn!(path = %grave.display(), error = %err, "removing a reclaimed layer");
            }
            gone.push(name);
        }
        gone
    }
}

/// Copies the stored `layer` to `tmp`, flushes it, and renames it to `at`. A copy already at
/// `at` (another process's) wins; ours is removed.
fn copy_in(
    store: &Store,
    layer: &Digest,
    tmp: &Path,
    at: &Path,
) -> Result<super::copy::Copied, CacheError> {
    if !store.has_layer(layer) {
        return Err(CacheError::Missing(layer.to_string()));
    }
    let io = |what: String| move |source| CacheError::Io { what, source };
    let discard = |r: Result<super::copy::Copied, CacheError>| {
        if r.is_err() {
            let _ = std::fs::remove_dir_all(tmp);
        }
        r
    };
    discard((|| {
        super::store::dir_0755(tmp).map_err(io(format!("making {}", tmp.display())))?;
        // Links where the store shares the cache's file system (no bytes copied, and the
        // copy still outlives the store's own removal of the layer); a copy elsewhere (NFS).
        let copied =
            super::copy::link_tree(&store.layer_dir(layer).join("rootfs"), &tmp.join("rootfs"))
                .map_err(io(format!("copying layer {layer}")))?;
        // Whole on disk before it is in place: after a power cut a layer is there or not.
        let fd = std::fs::File::open(tmp).map_err(io(format!("opening {}", tmp.display())))?;
        rustix::fs::syncfs(&fd).map_err(|e| CacheError::Io {
            what: format!("flushing layer {layer}"),
            source: e.into(),
        })?;
        match std::fs::rename(tmp, at) {
            Ok(()) => Ok(copied),
            Err(_) if at.is_dir() => {
                let _ = std::fs::remove_dir_all(tmp);
                Ok(copied)
            }
            Err(e) => Err(CacheError::Io {
                what: format!("moving layer {layer} into place"),
                source: e,
            }),
        }
    })())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored(store: &Store, body: &[u8]) -> Digest {
        let d = Digest::of(body);
        store
            .put_layer(&d, |r| {
                std::fs::create_dir_all(r.join("etc"))?;
                std::fs::write(r.join("etc/os-release"), body)
            })
            .expect("layer");
        d
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn copies_a_layer_once_for_many_concurrent_users_and_then_needs_no_store() {
        let d = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(Store::open(&d.path().join("store")).expect("store"));
        let layer = stored(&store, b"ID=test\n");
        let cache_dir = d.path().join("cache");
        std::fs::create_dir_all(cache_dir.join("tmp/leftover.1.0")).expect("leftover");
        let layers = Arc::new(Layers::new(store.clone(), Some(cache_dir.clone())).expect("new"));
        assert!(
            !cache_dir.join("tmp/leftover.1.0").exists(),
            "interrupted copies go at start"
        );

        let calls = (0..16).map(|_| {
            let (layers, layer) = (layers.clone(), layer.clone());
            tokio::spawn(async move { layers.get(&layer).await })
        });
        for c in futures::future::join_all(calls).await {
            let p = c.expect("join").expect("get");
            assert_eq!(p, cache_dir.join(layer.hex()).join("rootfs"));
        }
        assert_eq!(
            std::fs::read(cache_dir.join(layer.hex()).join("rootfs/etc/os-release")).expect("read"),
            b"ID=test\n"
        );
        assert_eq!(
            std::fs::read_dir(cache_dir.join("tmp"))
                .expect("tmp")
                .count(),
            0,
            "one copy, nothing left in tmp"
        );
        // The store gone: a cached layer is still had.
        std::fs::remove_dir_all(d.path().join("store")).expect("rm store");
        assert!(layers.get(&layer).await.is_ok());
        let other = Digest::of(b"not stored");
        assert!(matches!(
            layers.get(&other).await,
            Err(CacheError::Io { .. } | CacheError::Missing(_))
        ));
    }

    #[tokio::test]
    async fn unused_copies_are_reclaimed_and_those_in_use_or_used_lately_stay() {
        let d = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(Store::open(&d.path().join("store")).expect("store"));
        let (a, b) = (stored(&store, b"a"), stored(&store, b"b"));
        let cache = d.path().join("cache");
        let layers = Layers::new(store, Some(cache.clone())).expect("new");
        layers.get(&a).await.expect("a");
        layers.get(&b).await.expect("b");
        let hour = std::time::Duration::from_secs(3600);
        // Both just used: nothing goes.
        assert!(layers.reclaim(hour, &Default::default()).is_empty());
        // Idle long enough: the one not kept goes, whole, and nothing is left in tmp.
        let keep: std::collections::HashSet<String> = [a.hex().to_string()].into();
        assert_eq!(
            layers.reclaim(std::time::Duration::ZERO, &keep),
            vec![b.hex().to_string()]
        );
        assert!(cache.join(a.hex()).join("rootfs/etc/os-release").is_file());
        assert!(!cache.join(b.hex()).exists());
        assert_eq!(
            std::fs::read_dir(cache.join("tmp")).expect("tmp").count(),
            0
        );
        // Used again, it is copied again.
        assert!(layers
            .get(&b)
            .await
            .expect("b again")
            .join("etc/os-release")
            .is_file());
    }

    #[tokio::test]
    async fn without_a_cache_the_store_layer_is_stacked_and_a_missing_one_is_missing() {
        let d = tempfile::tempdir().expect("tempdir");
        let store = Arc::new(Store::open(d.path()).expect("store"));
        let layer = stored(&store, b"ID=direct\n");
        let layers = Layers::new(store.clone(), None).expect("new");
        assert_eq!(
            layers.get(&layer).await.expect("get"),
            store.layer_dir(&layer).join("rootfs")
        );
        let other = Digest::of(b"x");
        assert!(matches!(
            layers.get(&other).await,
            Err(CacheError::Missing(_))
        ));
    }
}
