//! The two executables the container backend needs: the setup program, re-executed from a
//! sealed memfd copy of the edge's own binary (the CVE-2019-5736 guard: nothing the sandbox
//! does can reach the file the edge runs), and the agent binary bound read-only into each
//! sandbox, installed per version under `<state_dir>/agents/<digest>/` so a running sandbox
//! keeps the binary it started with (docs/architecture.md).

use std::fs;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use nix::sys::memfd::{memfd_create, MFdFlags};
use sha2::{Digest, Sha256};

/// A failed step preparing the executables.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("{step} {path}")]
    Io {
        step: &'static str,
        path: String,
        source: std::io::Error,
    },
}

fn io<T>(step: &'static str, path: &Path, r: std::io::Result<T>) -> Result<T, AgentError> {
    r.map_err(|source| AgentError::Io {
        step,
        path: path.display().to_string(),
        source,
    })
}

/// The sealed in-memory copy of this executable that setup processes are started from.
pub struct SetupExe {
    fd: OwnedFd,
}

impl SetupExe {
    /// Copies the executable `exe` (normally `/proc/self/exe`) into a memfd and seals it
    /// against any change.
    pub fn new(exe: &Path) -> Result<SetupExe, AgentError> {
        let fd = io(
            "memfd_create",
            exe,
            memfd_create(
                "opendsec-setup",
                MFdFlags::MFD_CLOEXEC | MFdFlags::MFD_ALLOW_SEALING,
            )
            .map_err(std::io::Error::from),
        )?;
        let mut src = io("open", exe, fs::File::open(exe))?;
        let mut dst = fs::File::from(fd);
        io("copy", exe, std::io::copy(&mut src, &mut dst))?;
        io("flush", exe, dst.flush())?;
        let fd = OwnedFd::from(dst);
        let seals = SealFlag::F_SEAL_SEAL
            | SealFlag::F_SEAL_SHRINK
            | SealFlag::F_SEAL_GROW
            | SealFlag::F_SEAL_WRITE;
        io(
            "seal",
            exe,
            fcntl(&fd, FcntlArg::F_ADD_SEALS(seals)).map_err(std::io::Error::from),
        )?;
        Ok(SetupExe { fd })
    }

    /// The path to exec: the memfd through /proc/self/fd. The kernel opens it before the
    /// exec closes close-on-exec descriptors, so the copy needs no inheritable fd.
    pub fn path(&self) -> PathBuf {
        PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()))
    }
}

/// Installs the agent executable `src` as `<state_dir>/agents/<sha256[..16]>/opendsec`
/// (0555, written temp → fsync → rename) unless that version is already there; returns its
/// path. The file is never rewritten, so sandboxes that bound it keep their version.
pub fn install(src: &Path, state_dir: &Path) -> Result<PathBuf, AgentError> {
    let mut f = io("open agent", src, fs::File::open(src))?;
    let mut bytes = Vec::new();
    io("read agent", src, f.read_to_end(&mut bytes))?;
    let digest = hex::encode(Sha256::digest(&bytes));
    let dir = state_dir.join("agents").join(&digest[..16]);
    let dst = dir.join("opendsec");
    if dst.is_file() {
        return Ok(dst);
    }
    io("mkdir", &dir, fs::create_dir_all(&dir))?;
    let tmp = dir.join(format!(".opendsec.{}", std::process::id()));
    {
        let mut t = io("create", &tmp, fs::File::create(&tmp))?;
        io("write", &tmp, t.write_all(&bytes))?;
        io("fsync", &tmp, t.sync_all())?;
    }
    io(
        "chmod",
        &tmp,
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o555)),
    )?;
    io("rename", &dst, fs::rename(&tmp, &dst))?;
    Ok(dst)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn install_is_versioned_and_idempotent() {
        let d = tempfile::tempdir().expect("tempdir");
        let src = d.path().join("bin");
        fs::write(&src, b"v1").expect("write");
        let a = install(&src, d.path()).expect("install");
        assert_eq!(fs::read(&a).expect("read"), b"v1");
        assert_eq!(install(&src, d.path()).expect("again"), a);
        fs::write(&src, b"v2").expect("write");
        let b = install(&src, d.path()).expect("v2");
        assert_ne!(a, b);
        assert_eq!(fs::read(&a).expect("read"), b"v1");
    }

    #[test]
    fn setup_exe_is_sealed() {
        let e = SetupExe::new(Path::new("/proc/self/exe")).expect("memfd");
        let meta = fs::metadata(e.path()).expect("stat");
        assert!(meta.len() > 0);
        assert!(fs::OpenOptions::new()
            .write(true)
            .open(e.path())
            .and_then(|mut f| f.write_all(b"x"))
            .is_err());
    }
}
