//! `pack_diff` and container snapshots on the container backend (docs/images.md "Images
//! from sandboxes"): the sandbox's writable layer, read from a second, detached mount of its
//! disk, becomes one layer of the store while the sandbox is frozen.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use rustix::fs::{self as rfs, Mode, OFlags};

use super::ContainerBackend;
use crate::backends::{BackendError, Handle, PackedLayer, Packer};
use crate::images::digest::Digest;
use crate::images::pack::{pack_into_store, Scrub};

/// In the sandbox's directory while a pack holds it frozen: a sandbox adopted after an edge
/// died mid-pack is thawed (it was running before the pack froze it).
pub(super) const PACKING: &str = "packing";

/// The file sandbox networking writes into every sandbox (relative to `/`).
const RESOLV_CONF: &str = "etc/resolv.conf";

#[async_trait]
impl Packer for ContainerBackend {
    async fn pack(&self, sandbox: &Handle<'_>, scrub: &Scrub) -> Result<PackedLayer, BackendError> {
        let id = sandbox.sandbox_id.to_string();
        let st = Self::state_of(sandbox);
        let invalid = |message: String| BackendError::Invalid {
            sandbox_id: id.clone(),
            message,
        };
        if st.layers.is_empty() {
            return Err(invalid(format!(
                "its image {:?} is node-local, not in the image store: only sandboxes of store images can be packed",
                sandbox.spec.image
            )));
        }
        let store = self
            .images
            .store()
            .ok_or_else(|| BackendError::ImageUnavailable {
                image: sandbox.spec.image.clone(),
                message: "this node has no image store".into(),
            })?;
        let mut layers = Vec::with_capacity(st.layers.len() + 1);
        for hex in &st.layers {
            let d = Digest::parse(&format!("sha256:{hex}"))
                .map_err(|e| invalid(format!("its recorded layer {hex:?}: {e}")))?;
            layers.push(d);
        }
        let lowers: Vec<PathBuf> = layers
            .iter()
            .map(|d| store.layer_dir(d).join("rootfs"))
            .collect();
        let cg = self.cgroups.open(&id);
        let disk = self.disks.path(&id);
        let marker = self.sandbox_dir(&id).join(PACKING);
        // The resolv.conf the node wrote is the node's, not the sandbox's work.
        let scrub = if st.net_slot.is_some() {
            scrub
                .with_node_files(&[RESOLV_CONF])
                .map_err(|f| invalid(f.message))?
        } else {
            scrub.clone()
        };
        let step = |e: String| BackendError::Step {
            op: "pack",
            sandbox_id: id.clone(),
            source: e.into(),
        };
        let id2 = id.clone();
        let done = tokio::task::spawn_blocking(move || {
            let max_bytes = std::fs::metadata(&disk)
                .map_err(|e| format!("reading {}: {e}", disk.display()))?
                .len();
            let upper = open_upper(&st.loop_device, &disk)
                .map_err(|e| format!("opening its writable layer: {e}"))?;
            // A paused sandbox is frozen already and stays so; a running one is frozen for
            // the copy only, so the layer is one moment of its files.
            let freeze = !cg.frozen();
            if freeze {
                std::fs::write(&marker, b"")
                    .map_err(|e| format!("writing {}: {e}", marker.display()))?;
                if let Err(e) = cg.freeze() {
                    let _ = std::fs::remove_file(&marker);
                    return Err(format!("freezing it: {}", crate::types::chain(&e)));
                }
            }
            let name = format!("the writable layer of sandbox {id2}");
            let packed = pack_into_store(&store, upper, &scrub, &lowers, max_bytes, &name);
            if freeze {
                match cg.thaw() {
                    Ok(()) => {
                        let _ = std::fs::remove_file(&marker);
                    }
                    Err(e) => tracing::error!(sandbox_id = %id2, error = %crate::types::chain(&e), "thawing after a pack"),
                }
            }
            Ok(packed)
        })
        .await
        .map_err(|e| step(e.to_string()))?
        .map_err(step)?;
        let (meta, packed) = done.map_err(|source| BackendError::Pack {
            sandbox_id: id.clone(),
            source,
        })?;
        let diff_id = meta
            .diff_id
            .ok_or_else(|| step("the store wrote a layer without a diff_id".into()))?;
        layers.push(diff_id.clone());
        Ok(PackedLayer {
            layers,
            diff_id,
            packed,
        })
    }
}

/// The sandbox's overlay upper directory on a detached mount of its disk (the kernel shares
/// the superblock of the mount the sandbox uses, so this sees its files as they are). The
/// mount goes when the fd is closed.
fn open_upper(loop_device: &str, disk: &Path) -> std::io::Result<OwnedFd> {
    let (dev, _) = crate::sys::loopdev::attached_as(loop_device, disk).ok_or_else(|| {
        std::io::Error::other(format!(
            "loop device {loop_device} no longer backs {} ({})",
            disk.display(),
            crate::sys::loopdev::describe(loop_device)
        ))
    })?;
    let mnt = crate::sys::mountfd::mount_detached("ext4", &dev)?;
    Ok(rfs::openat(
        &mnt,
        "upper",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )?)
}
