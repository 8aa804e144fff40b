//! The read-only disks a microVM gets besides its writable one (docs/microvm.md "Disks"):
//! the agent disk, holding this build's binary, made once per node and binary and shared by
//! every VM; and each VM's config disk. The writable disk is the container backend's
//! sparse ext4 disk (`container::disk`), attached to QEMU instead of a loop device.
//!
//! Read-only disks are ext4 without a journal, made by `mkfs.ext4 -d` from a directory:
//! nothing ever writes them, and the guest mounts them read-only with `noload`.

use std::fs;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use sha2::Digest;

use crate::guest::vminit::{self, VmConfig, AGENT_FILE};

/// Space an ext4 image gets beyond its files' sizes: metadata, inode tables, and files
/// rounded up to whole blocks.
const SLACK_MB: u64 = 8;

/// Why a disk could not be made.
#[derive(Debug, thiserror::Error)]
pub enum DisksError {
    #[error("{what} {path}")]
    Io {
        what: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// mkfs.ext4 is not installed, could not start, or failed.
    #[error("making {path}: {message}")]
    Mkfs { path: PathBuf, message: String },
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> DisksError {
    let path = path.to_path_buf();
    move |source| DisksError::Io { what, path, source }
}

/// The agent disk for `binary` in `dir`: `agent-<first 16 hex of its SHA-256>.ext4`, made
/// the first time (into a temporary name, then renamed, so racing edges each see a whole
/// one) and reused after. The binary is copied as given; strip it first to keep the disk
/// small. Errors: `Io` reading the binary or writing the disk, `Mkfs`.
pub fn agent_disk(binary: &Path, dir: &Path) -> Result<PathBuf, DisksError> {
    let digest = file_digest(binary)?;
    let out = dir.join(format!(
        "agent-{}.ext4",
        digest.get(..16).unwrap_or(&digest)
    ));
    if out.is_file() {
        return Ok(out);
    }
    fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
    // A staging directory of this build's own, removed whatever happens.
    let stage = Staging(dir.join(format!(
        ".agent-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    )));
    let files = stage.0.join("files");
    fs::create_dir_all(&files).map_err(io_err("creating", &files))?;
    let copy = files.join(AGENT_FILE);
    fs::copy(binary, &copy).map_err(io_err("copying the agent to", &copy))?;
    let tmp = stage.0.join("disk.ext4");
    ext4_from(&tmp, &files)?;
    fs::rename(&tmp, &out).map_err(io_err("renaming a new agent disk to", &out))?;
    Ok(out)
}

/// A directory removed with everything in it when dropped.
struct Staging(PathBuf);

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.0);
    }
}

/// Writes the config disk for `cfg` at `path` (mode 0600: it holds the sandbox's env).
/// Errors: `Io`.
pub fn config_disk(path: &Path, cfg: &VmConfig) -> Result<(), DisksError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .and_then(|mut f| f.write_all(&vminit::config_disk(cfg)))
        .map_err(io_err("writing the config disk", path))
}

/// The hex SHA-256 of a file's bytes.
fn file_digest(path: &Path) -> Result<String, DisksError> {
    let mut f = fs::File::open(path).map_err(io_err("opening", path))?;
    let mut h = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(io_err("reading", path))?;
        if n == 0 {
            break;
        }
        h.update(buf.get(..n).unwrap_or_default());
    }
    Ok(hex::encode(h.finalize()))
}

/// Bytes `dir`'s regular files take, each rounded up to 4 KiB blocks.
fn tree_size(dir: &Path) -> io::Result<u64> {
    let mut total = 0;
    for e in fs::read_dir(dir)? {
        let e = e?;
        let t = e.file_type()?;
        if t.is_dir() {
            total += tree_size(&e.path())? + 4096;
        } else {
            total += e.metadata()?.len().div_ceil(4096) * 4096;
        }
    }
    Ok(total)
}

/// Makes a journal-less ext4 image at `out` holding `dir`'s files, owned by root, sized to
/// them plus [`SLACK_MB`]. Errors: `Io`, `Mkfs`.
fn ext4_from(out: &Path, dir: &Path) -> Result<(), DisksError> {
    let err = |message: String| DisksError::Mkfs {
        path: out.to_path_buf(),
        message,
    };
    let program = crate::backends::container::disk::mkfs_program()
        .ok_or_else(|| err("mkfs.ext4 not found (e2fsprogs)".into()))?;
    let used = tree_size(dir).map_err(io_err("measuring", dir))?;
    // An eighth more for the inode tables and directories of many small files.
    let size_mb = (used + used / 8).div_ceil(1 << 20) + SLACK_MB;
    let f = fs::File::create(out).map_err(io_err("creating", out))?;
    f.set_len(size_mb << 20).map_err(io_err("sizing", out))?;
    drop(f);
    let run = Command::new(program)
        .env_clear()
        .args(["-q", "-F", "-m", "0", "-b", "4096"])
        .args(["-O", "^has_journal,^resize_inode"])
        .args(["-E", "root_owner=0:0"])
        .arg("-d")
        .arg(dir)
        .arg(out)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| err(format!("starting {}: {e}", program.display())))?;
    if !run.status.success() {
        return Err(err(format!(
            "{} exited with {}: {}",
            program.display(),
            run.status,
            String::from_utf8_lossy(&run.stderr).trim()
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of an ext4 image, read on the host with debugfs (empty when it is not there).
    fn debugfs_cat(disk: &Path, path: &str) -> Vec<u8> {
        Command::new("debugfs")
            .args(["-R", &format!("cat {path}")])
            .arg(disk)
            .stderr(Stdio::null())
            .output()
            .map(|o| o.stdout)
            .unwrap_or_default()
    }

    #[test]
    fn an_agent_disk_holds_the_binary_and_is_made_once_per_binary() {
        let dir = tempfile::tempdir().expect("dir");
        let bin = dir.path().join("opendsec");
        let body: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
        fs::write(&bin, &body).expect("binary");
        let disks = dir.path().join("disks");
        let disk = agent_disk(&bin, &disks).expect("agent disk");
        assert_eq!(debugfs_cat(&disk, &format!("/{AGENT_FILE}")), body);
        let made = fs::metadata(&disk)
            .expect("stat")
            .modified()
            .expect("mtime");
        // The same binary: the same disk, not made again; nothing else left behind.
        assert_eq!(agent_disk(&bin, &disks).expect("again"), disk);
        assert_eq!(
            fs::metadata(&disk)
                .expect("stat")
                .modified()
                .expect("mtime"),
            made
        );
        let names: Vec<_> = fs::read_dir(&disks)
            .expect("list")
            .flatten()
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        // Another binary: another disk.
        fs::write(&bin, b"another build").expect("binary");
        let other = agent_disk(&bin, &disks).expect("other");
        assert_ne!(other, disk);
        assert_eq!(
            debugfs_cat(&other, &format!("/{AGENT_FILE}")),
            b"another build"
        );
    }

    #[test]
    fn a_config_disk_reads_back_and_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().expect("dir");
        let path = dir.path().join("config.img");
        let cfg = VmConfig {
            sandbox_id: "n1.abc".into(),
            env: [("TOKEN".to_string(), "secret".to_string())].into(),
            ..Default::default()
        };
        config_disk(&path, &cfg).expect("write");
        assert_eq!(
            vminit::parse_config(&fs::read(&path).expect("read")).expect("parse"),
            cfg
        );
        let mode = fs::metadata(&path).expect("stat").permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
}
