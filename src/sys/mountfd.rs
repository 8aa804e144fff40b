//! Detached mounts (the mount API of Linux 5.2 on): a file system mounted nowhere, held by
//! an fd, and attached later in another process's mount namespace. The edge mounts
//! prepared sandbox disks this way ahead of their sandbox (docs/architecture.md "Prepared
//! disks"); the sandbox's setup process takes the fd from the edge and attaches it in the
//! sandbox's own namespace.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use rustix::mount::{
    fsconfig_create, fsconfig_set_string, fsmount, fsopen, move_mount, FsMountFlags, FsOpenFlags,
    MountAttrFlags, MoveMountFlags,
};
use rustix::process::{getppid, pidfd_getfd, pidfd_open, Pid, PidfdFlags, PidfdGetfdFlags};

/// Mounts the `fstype` file system on block device `source` (nodev) and returns the
/// detached mount's fd (close-on-exec), attached nowhere: closing it unmounts it. Errors:
/// the kernel's (no such file system, a bad device, a kernel before 5.2: `ENOSYS`).
pub fn mount_detached(fstype: &str, source: &Path) -> io::Result<OwnedFd> {
    let fs = fsopen(fstype, FsOpenFlags::FSOPEN_CLOEXEC)?;
    fsconfig_set_string(fs.as_fd(), "source", source)?;
    fsconfig_create(fs.as_fd())?;
    Ok(fsmount(
        fs.as_fd(),
        FsMountFlags::FSMOUNT_CLOEXEC,
        // nodev: a device node in an image or written by the sandbox opens nothing.
        MountAttrFlags::MOUNT_ATTR_NODEV,
    )?)
}

/// Attaches the detached mount `mount` at `target` in the caller's mount namespace. A
/// mount is attached once; after that the fd only refers to it. Errors: the kernel's
/// (`EINVAL` for a mount attached already).
pub fn attach(mount: BorrowedFd<'_>, target: &Path) -> io::Result<()> {
    Ok(move_mount(
        mount,
        "",
        rustix::fs::CWD,
        target,
        MoveMountFlags::MOVE_MOUNT_F_EMPTY_PATH,
    )?)
}

/// A copy of fd `fd` of the parent process `parent` (pidfd_getfd, Linux 5.6 on), for a
/// child that did not inherit it. Checked to be that parent still, so a parent that died
/// (the child is then re-parented) gives `ESRCH`, never another process's fd. Errors: the
/// kernel's (`EBADF`: no such fd in the parent).
pub fn fd_of_parent(parent: u32, fd: i32) -> io::Result<OwnedFd> {
    let pid = i32::try_from(parent)
        .ok()
        .and_then(Pid::from_raw)
        .ok_or_else(|| io::Error::from_raw_os_error(libc::ESRCH))?;
    let pidfd = pidfd_open(pid, PidfdFlags::empty())?;
    // Checked after the pidfd is open: if the parent is still ours now, the pidfd is it.
    if getppid() != Some(pid) {
        return Err(io::Error::from_raw_os_error(libc::ESRCH));
    }
    Ok(pidfd_getfd(pidfd.as_fd(), fd, PidfdGetfdFlags::empty())?)
}
