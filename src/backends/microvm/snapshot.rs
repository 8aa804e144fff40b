//! A microVM snapshot on disk (docs/microvm.md "Snapshots and copies"): one directory with
//! everything a copy needs to carry on where the VM was, and nothing the node may change
//! under it.
//!
//! ```text
//! <dir>/memory      the guest's RAM (sparse), mapped copy-on-write by every copy
//! <dir>/state.mig   QEMU's migration stream: devices and CPUs (and the RAM, where the VM's
//!                   RAM was itself a private mapping; `memory` is then all holes)
//! <dir>/disk.ext4   the writable disk as it was (sparse); each copy gets its own copy
//! <dir>/image.ext4  the image disk, hard-linked where the file system allows
//! <dir>/agent.ext4  the agent disk the guest's aether runs from, likewise
//! <dir>/vm.json     what it is (SnapshotMeta); written last, so its presence means whole
//! ```
//!
//! The image and agent disks travel with it because the guest has them mounted and their
//! blocks cached in its memory: a copy given another build of either would read garbage.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use serde::{Deserialize, Serialize};

pub const MEMORY: &str = "memory";
pub const STATE: &str = "state.mig";
pub const DISK: &str = "disk.ext4";
pub const IMAGE_DISK: &str = "image.ext4";
pub const AGENT_DISK: &str = "agent.ext4";
pub const META: &str = "vm.json";
/// The layout this code writes and reads.
pub const FORMAT: u32 = 1;

/// What a snapshot is (`vm.json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SnapshotMeta {
    pub format: u32,
    /// Guest memory (MiB) and vCPUs: a copy must have the same, as the stream holds them.
    pub memory_mb: i64,
    pub vcpus: u32,
    /// The store layers (hex) the image disk was made of, bottom first.
    pub layers: Vec<String>,
    /// The image the source ran.
    pub image: String,
    /// The sandbox it was taken of.
    pub source: String,
    /// How long the source's vCPUs were stopped for it (ms; 0 for a paused source).
    pub paused_ms: f64,
    /// The user the source's init ran as (empty in snapshots older than this field).
    pub init_user: String,
    /// The QEMU build and accelerator it ran on (`QEMU emulator version …; tcg`): a copy
    /// restores only on the same. Empty: not known.
    pub machine: String,
    /// The source had a network device (its node's networking was on): a copy has the
    /// same devices, so it restores only where networking is on too, and vice versa.
    pub nic: bool,
}

/// Reads `<dir>/vm.json`. Errors: a message naming what is missing or wrong (not a
/// snapshot, another format).
pub fn read_meta(dir: &Path) -> Result<SnapshotMeta, String> {
    let path = dir.join(META);
    let text = std::fs::read(&path)
        .map_err(|e| format!("{} is no whole microVM snapshot: {e}", dir.display()))?;
    let m: SnapshotMeta =
        serde_json::from_slice(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if m.format != FORMAT {
        return Err(format!(
            "{}: snapshot format {} (this node reads {FORMAT})",
            path.display(),
            m.format
        ));
    }
    Ok(m)
}

/// Checks that every file of the snapshot in `dir` is a regular file (no link to elsewhere
/// on the host: QEMU and the copy follow what they are given). Errors: the first that is
/// missing or is not.
pub fn check_files(dir: &Path) -> Result<(), String> {
    for name in [MEMORY, STATE, DISK, IMAGE_DISK, AGENT_DISK, META] {
        let p = dir.join(name);
        match std::fs::symlink_metadata(&p) {
            Ok(m) if m.file_type().is_file() => {}
            Ok(_) => return Err(format!("{} is not a regular file", p.display())),
            Err(e) => {
                return Err(format!(
                    "{} is no whole microVM snapshot: {}: {e}",
                    dir.display(),
                    p.display()
                ))
            }
        }
    }
    Ok(())
}

/// Writes `<dir>/vm.json` through a synced temporary file, after syncing the directory's
/// other files, then syncs the directory and its parent: a snapshot whose `vm.json` is on
/// disk is whole on disk (an image may name it at once). Errors: the step that failed.
pub fn write_meta(dir: &Path, m: &SnapshotMeta) -> Result<(), String> {
    for name in [MEMORY, STATE, DISK, IMAGE_DISK, AGENT_DISK] {
        let p = dir.join(name);
        std::fs::File::open(&p)
            .and_then(|f| f.sync_all())
            .map_err(|e| format!("syncing {}: {e}", p.display()))?;
    }
    let tmp = dir.join(".vm.json.tmp");
    let json = serde_json::to_vec_pretty(m).map_err(|e| e.to_string())?;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    f.write_all(&json)
        .and_then(|()| f.sync_all())
        .map_err(|e| format!("{}: {e}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(META)).map_err(|e| format!("{}: {e}", tmp.display()))?;
    for d in [Some(dir), dir.parent()].into_iter().flatten() {
        std::fs::File::open(d)
            .and_then(|f| f.sync_all())
            .map_err(|e| format!("syncing {}: {e}", d.display()))?;
    }
    Ok(())
}

/// Puts `from` (an immutable disk) at `to`: a hard link, else a sparse copy.
pub fn link_or_copy(from: &Path, to: &Path) -> std::io::Result<()> {
    if std::fs::hard_link(from, to).is_ok() {
        return Ok(());
    }
    crate::backends::container::disk::sparse_copy(from, to)
}

/// Makes `path` a file of `mb` MiB, all holes (0600).
pub fn empty_memory(path: &Path, mb: i64) -> std::io::Result<()> {
    let f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    f.set_len(u64::try_from(mb).unwrap_or(0) << 20)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    #[test]
    fn meta_round_trips_and_other_formats_are_refused() {
        let d = tempfile::tempdir().unwrap();
        for n in [MEMORY, STATE, DISK, IMAGE_DISK, AGENT_DISK] {
            std::fs::write(d.path().join(n), b"x").unwrap();
        }
        let m = SnapshotMeta {
            format: FORMAT,
            memory_mb: 256,
            vcpus: 1,
            layers: vec!["ab".into()],
            image: "p/i:1".into(),
            source: "e.1".into(),
            paused_ms: 3.5,
            init_user: "app".into(),
            machine: "QEMU emulator version 7.2.22; tcg".into(),
            nic: true,
        };
        write_meta(d.path(), &m).unwrap();
        assert_eq!(read_meta(d.path()).unwrap(), m);
        write_meta(d.path(), &SnapshotMeta { format: 9, ..m }).unwrap();
        assert!(read_meta(d.path()).unwrap_err().contains("format 9"));
        let e = read_meta(&d.path().join("none")).unwrap_err();
        assert!(e.contains("no whole microVM snapshot"), "{e}");
    }

    #[test]
    fn links_in_a_snapshot_are_refused() {
        let d = tempfile::tempdir().unwrap();
        for n in [MEMORY, STATE, DISK, IMAGE_DISK, AGENT_DISK, META] {
            std::fs::write(d.path().join(n), b"x").unwrap();
        }
        check_files(d.path()).unwrap();
        std::fs::remove_file(d.path().join(MEMORY)).unwrap();
        std::os::unix::fs::symlink("/etc/shadow", d.path().join(MEMORY)).unwrap();
        let e = check_files(d.path()).unwrap_err();
        assert!(e.contains("not a regular file"), "{e}");
        std::fs::remove_file(d.path().join(MEMORY)).unwrap();
        assert!(check_files(d.path()).unwrap_err().contains("no whole"));
    }

    #[test]
    fn empty_memory_is_all_holes() {
        use std::os::unix::fs::MetadataExt;
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("m");
        empty_memory(&p, 64).unwrap();
        let md = std::fs::metadata(&p).unwrap();
        assert_eq!((md.len(), md.blocks()), (64 << 20, 0));
    }
}
