//! Prepared disks: sandbox disks made ahead of their sandbox, so that a creation takes
//! one instead of making it (docs/architecture.md "Prepared disks"). A prepared disk is a
//! spare image (a sparse copy of the size's template), attached to a loop device with
//! autoclear, its ext4 mounted as a detached mount (in no mount namespace) with `upper/`
//! and `work/` made in it. The setup process of the sandbox that takes it copies the mount's
//! fd from the edge and attaches it in the sandbox's own namespace.
//!
//! Making a disk on the creation's path cost 4 to 8 ms here: the template copy, the loop
//! device's `LOOP_CONFIGURE` (which flushes the backing file's device: 3 to 4 ms on a quiet
//! host, 20 ms under load, and no flag avoids it), the ext4 mount and the two directories.
//!
//! Nothing here outlives the edge: the loop device and the mount are held by fds of the
//! edge alone, so an edge that exits (or is killed) frees both, and its next start deletes
//! the spare images ([`super::disk::Disks::remove_spares`]).

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::disk::Disks;
use crate::sys::loopdev::LoopDevice;

/// One disk ready for a sandbox.
#[derive(Debug)]
pub struct PreparedDisk {
    /// The image (a spare until [`DiskPool::take`] renames it for its sandbox).
    pub image: PathBuf,
    /// The detached ext4 mount, with `upper/` and `work/` in it.
    pub mount: OwnedFd,
    /// The loop device, held open until the sandbox's mount holds it.
    pub device: LoopDevice,
}

impl PreparedDisk {
    /// The fd number of the mount, for the setup process to copy (`pidfd_getfd`).
    pub fn mount_fd(&self) -> i32 {
        self.mount.as_raw_fd()
    }

    /// The loop device as `major:minor`.
    pub fn device_number(&self) -> String {
        let (major, minor) = self.device.major_minor();
        format!("{major}:{minor}")
    }

    /// Unmounts and detaches the disk (closing its fds), then deletes its image.
    fn discard(self) {
        let image = self.image.clone();
        drop(self);
        let _ = std::fs::remove_file(image);
    }
}

/// Prepared disks by size, `depth` of each size that was asked for (the backend's
/// default size from the start), made again on threads of their own as they are taken.
pub struct DiskPool {
    disks: Disks,
    depth: usize,
    ready: Mutex<HashMap<u64, Vec<PreparedDisk>>>,
    /// Sizes a thread is making disks of now.
    filling: Mutex<HashSet<u64>>,
    /// Set by [`clear`](DiskPool::clear): nothing is made or handed out any more.
    closed: std::sync::atomic::AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl DiskPool {
    /// A pool over `disks` keeping `depth` disks of each size asked for (0: none, every
    /// creation makes its own). Deletes spare images an earlier edge left.
    pub fn new(disks: Disks, depth: usize) -> Arc<DiskPool> {
        disks.remove_spares();
        Arc::new(DiskPool {
            disks,
            depth,
            ready: Mutex::new(HashMap::new()),
            filling: Mutex::new(HashSet::new()),
            closed: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// A prepared disk of `size_mb` for `sandbox_id`, its image renamed to the sandbox's;
    /// `None` when none is ready (the caller makes one the usual way). Starts making more.
    pub fn take(self: &Arc<Self>, sandbox_id: &str, size_mb: u64) -> Option<PreparedDisk> {
        if self.depth == 0 || self.is_closed() {
            return None;
        }
        let got = lock(&self.ready).get_mut(&size_mb).and_then(Vec::pop);
        self.fill(size_mb);
        let mut disk = got?;
        match self.disks.adopt(&disk.image, sandbox_id) {
            Ok(path) => {
                disk.image = path;
                Some(disk)
            }
            Err(e) => {
                tracing::warn!(error = %crate::types::chain(&e), "a prepared disk could not be given to its sandbox");
                let _ = std::fs::remove_file(&disk.image);
                None
            }
        }
    }

    /// Starts making disks of `size_mb` until `depth` are ready, unless that is under way.
    pub fn fill(self: &Arc<Self>, size_mb: u64) {
        if self.depth == 0 || self.is_closed() || !lock(&self.filling).insert(size_mb) {
            return;
        }
        let pool = self.clone();
        let spawned = std::thread::Builder::new()
            .name("disk-pool".into())
            .spawn(move || {
                while !pool.is_closed()
                    && lock(&pool.ready).get(&size_mb).map_or(0, Vec::len) < pool.depth
                {
                    match prepare(&pool.disks, size_mb) {
                        Ok(d) => {
                            let mut ready = lock(&pool.ready);
                            // Checked under the lock `clear` takes: a disk made meanwhile goes.
                            if pool.is_closed() {
                                drop(ready);
                                d.discard();
                                break;
                            }
                            ready.entry(size_mb).or_default().push(d);
                        }
                        Err(e) => {
                            tracing::warn!(size_mb, error = %e, "cannot prepare a sandbox disk; creations make their own");
                            break;
                        }
                    }
                }
                lock(&pool.filling).remove(&size_mb);
            });
        if spawned.is_err() {
            lock(&self.filling).remove(&size_mb);
        }
    }

    /// How many disks of `size_mb` are ready.
    pub fn ready(&self, size_mb: u64) -> usize {
        lock(&self.ready).get(&size_mb).map_or(0, Vec::len)
    }

    fn is_closed(&self) -> bool {
        self.closed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Drops every ready disk (their mounts and loop devices go with the fds), deletes the
    /// spare images, and makes no more (the node is being released).
    pub fn clear(&self) {
        let all: Vec<PreparedDisk> = {
            let mut ready = lock(&self.ready);
            self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
            ready.drain().flat_map(|(_, v)| v).collect()
        };
        for d in all {
            d.discard();
        }
        self.disks.remove_spares();
    }
}

/// Makes one prepared disk of `size_mb`.
fn prepare(disks: &Disks, size_mb: u64) -> Result<PreparedDisk, String> {
    let image = disks
        .create_spare(size_mb)
        .map_err(|e| crate::types::chain(&e))?;
    let made = mount_spare(&image);
    if made.is_err() {
        let _ = std::fs::remove_file(&image);
    }
    let (device, mount) = made?;
    Ok(PreparedDisk {
        image,
        mount,
        device,
    })
}

fn mount_spare(image: &Path) -> Result<(LoopDevice, OwnedFd), String> {
    let err = |step: &str, e: std::io::Error| format!("{step} {}: {e}", image.display());
    let device = LoopDevice::attach(image, false, true).map_err(|e| err("attaching", e))?;
    let mount = crate::sys::mountfd::mount_detached("ext4", device.path())
        .map_err(|e| err("mounting", e))?;
    for (dir, mode) in [("upper", 0o755), ("work", 0o700)] {
        nix::sys::stat::mkdirat(&mount, dir, nix::sys::stat::Mode::from_bits_truncate(mode))
            .map_err(|e| err(&format!("making {dir}/ in"), e.into()))?;
    }
    Ok((device, mount))
}
