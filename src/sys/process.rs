//! Process-wide operations of the container setup process: fork, closing inherited file
//! descriptors, seccomp installation and core-scheduling cookies.

use std::io;

use super::cvt;

/// Which side of a [`fork`] this is.
pub enum Forked {
    Parent { child: i32 },
    Child,
}

/// `fork(2)`. Only for single-threaded callers: the container setup process calls it before
/// any runtime or thread exists, so the child's copy of the address space holds no lock
/// taken by another thread.
pub fn fork_single_threaded() -> io::Result<Forked> {
    // SAFETY: the caller is single-threaded (the setup process runs no runtime and spawns no
    // thread), so the child inherits no lock held by a thread that does not exist in it, and
    // may go on running ordinary Rust code.
    let pid = cvt(unsafe { libc::fork() })?;
    Ok(if pid == 0 {
        Forked::Child
    } else {
        Forked::Parent { child: pid }
    })
}

/// Closes every file descriptor from `first` up, so that nothing the edge had open leaks into
/// a sandbox.
pub fn close_fds_from(first: u32) -> io::Result<()> {
    // SAFETY: close_range takes plain integers and touches no memory of ours; the caller
    // holds no Rust object owning a descriptor at or above `first` that it uses afterwards
    // (it is about to exec).
    cvt(unsafe { libc::syscall(libc::SYS_close_range, first, u32::MAX, 0u32) } as i64)?;
    Ok(())
}

/// Installs a seccomp BPF program for the calling thread *without* setting
/// `no_new_privs` (the caller holds CAP_SYS_ADMIN), so setuid programs in the sandbox keep
/// working, as with Docker's defaults. `filter` is a list of classic BPF instructions.
pub fn install_seccomp(filter: &[libc::sock_filter]) -> io::Result<()> {
    let len = u16::try_from(filter.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "seccomp program too long"))?;
    let prog = libc::sock_fprog {
        len,
        filter: filter.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: `prog` points at `filter`, which outlives the call; the kernel copies the
    // program during the call and does not keep the pointer.
    cvt(unsafe {
        libc::prctl(
            libc::PR_SET_SECCOMP,
            libc::SECCOMP_MODE_FILTER as libc::c_ulong,
            &prog as *const libc::sock_fprog as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    })?;
    Ok(())
}

const PR_SCHED_CORE: libc::c_int = 62;
const PR_SCHED_CORE_CREATE: libc::c_ulong = 1;
const PIDTYPE_TGID: libc::c_ulong = 1;

/// Gives the calling process a new core-scheduling cookie, inherited by its children, so no
/// other sandbox's tasks share a physical core's SMT siblings with it at once. Errors:
/// `EINVAL`/`ENODEV` where the kernel lacks core scheduling.
pub fn sched_core_create() -> io::Result<()> {
    // SAFETY: PR_SCHED_CORE_CREATE for pid 0 (the caller) takes integers only.
    cvt(unsafe {
        libc::prctl(
            PR_SCHED_CORE,
            PR_SCHED_CORE_CREATE,
            0 as libc::c_ulong,
            PIDTYPE_TGID,
            0 as libc::c_ulong,
        )
    })?;
    Ok(())
}

/// Makes `target` a copy of `fd` that survives exec (no FD_CLOEXEC), for handing
/// descriptors to an exec'd program at fixed numbers (stdio, aether's listener on 3).
pub fn dup_to(fd: std::os::fd::BorrowedFd<'_>, target: i32) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    let raw = fd.as_raw_fd();
    if raw == target {
        // SAFETY: F_SETFD on a descriptor we borrow (open for the call) takes an integer.
        cvt(unsafe { libc::fcntl(raw, libc::F_SETFD, 0) })?;
    } else {
        // SAFETY: dup2 takes integers; whatever `target` held is replaced atomically, and
        // the caller owns no Rust object for `target` that it keeps using (it is about to
        // exec).
        cvt(unsafe { libc::dup2(raw, target) })?;
    }
    Ok(())
}

/// Makes the calling process non-dumpable (`PR_SET_DUMPABLE` 0): without CAP_SYS_PTRACE,
/// which no sandbox session holds, nothing can ptrace it or open its `/proc/<pid>/mem`,
/// even a process of the same uid (the sandbox's root against a root agent), and its
/// `/proc/<pid>` files belong to root. exec and every change of the effective uid or gid
/// reset the flag, so the agents call this after each (see docs/architecture.md,
/// "In the sandbox"). Errors: the prctl's errno.
pub fn set_nondumpable() -> io::Result<()> {
    nix::sys::prctl::set_dumpable(false).map_err(io::Error::from)
}

/// Sets `no_new_privs` on the calling process, for good (it is inherited by children and
/// kept across exec): exec of a setuid, setgid or file-capability program no longer grants
/// anything. Errors: the prctl's errno.
pub fn set_no_new_privs() -> io::Result<()> {
    nix::sys::prctl::set_no_new_privs().map_err(io::Error::from)
}

/// Whether the calling process is dumpable (see [`set_nondumpable`]).
pub fn is_dumpable() -> io::Result<bool> {
    nix::sys::prctl::get_dumpable().map_err(io::Error::from)
}

/// The real gid a child of [`exec_nondumpable`] runs with until it sets its gids itself.
pub const EXEC_REAL_GID: libc::gid_t = 65534;

/// Has `cmd`'s child exec with a real gid ([`EXEC_REAL_GID`]) different from its effective
/// one: the kernel then makes the new program non-dumpable from its first instruction,
/// as for a setgid program (`fs.suid_dumpable`, 0 unless an administrator changed it),
/// instead of dumpable until it reaches [`set_nondumpable`], a window in which a process
/// of the same uid could attach. The capabilities stay those of the effective uid. The
/// child must set its gids (setgid) before it relies on its real gid; exec also runs it
/// in secure mode (`AT_SECURE`: the C library drops `LD_*`, `TMPDIR` and the like from
/// its environment). Does nothing for a parent whose effective uid or gid is not 0 (it
/// could not set such a real gid; tests run agents unprivileged).
pub fn exec_nondumpable(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    if !(nix::unistd::geteuid().is_root() && nix::unistd::getegid().as_raw() == 0) {
        return;
    }
    // SAFETY: the closure runs in the forked child before exec, where only
    // async-signal-safe calls are allowed; it makes one setresgid syscall (raw, not the
    // C library's wrapper, which synchronises across threads) and allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            let r = libc::syscall(
                libc::SYS_setresgid,
                EXEC_REAL_GID,
                libc::gid_t::MAX,
                libc::gid_t::MAX,
            );
            cvt(r as i64).map(|_| ())
        });
    }
}

/// Sets or clears close-on-exec on `fd` (one the caller holds by number, e.g. inherited).
/// Errors: `EBADF` for a closed fd.
pub fn set_cloexec(fd: std::os::fd::RawFd, on: bool) -> io::Result<()> {
    let flag = if on { libc::FD_CLOEXEC } else { 0 };
    // SAFETY: F_SETFD on a number takes an integer and touches no memory; a closed fd
    // fails with EBADF.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFD, flag) })?;
    Ok(())
}

/// Makes the child of `cmd` move itself into a cgroup before it execs: it writes "0" to
/// each of `procs_fds`, open `cgroup.procs` files (one per hierarchy). The kernel checks
/// such a move against the credentials and cgroup namespace of whoever opened the file, so
/// a child that already runs as an unprivileged user can still be moved by a file its
/// privileged ancestor opened. The fds should be close-on-exec (the program must not
/// keep them). A failed write fails the spawn with its errno.
pub fn join_cgroups_at_exec(cmd: &mut std::process::Command, procs_fds: &[std::os::fd::RawFd]) {
    use std::os::unix::process::CommandExt;
    let fds = procs_fds.to_vec();
    // SAFETY: the closure runs in the child between fork and exec, where only
    // async-signal-safe calls are allowed: it makes nothing but write(2) calls on integers
    // and a static buffer, and builds its error from errno without allocating.
    unsafe {
        cmd.pre_exec(move || {
            for fd in &fds {
                if libc::write(*fd, b"0".as_ptr().cast(), 1) != 1 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}

/// Makes `fds` (close-on-exec in this process) survive into the program `cmd` runs: the
/// child clears the flag on each between fork and exec.
pub fn inherit_at_exec(cmd: &mut std::process::Command, fds: &[std::os::fd::RawFd]) {
    use std::os::unix::process::CommandExt;
    let fds = fds.to_vec();
    // SAFETY: the closure runs in the child between fork and exec: fcntl(F_SETFD) on
    // integers is async-signal-safe, and nothing allocates.
    unsafe {
        cmd.pre_exec(move || {
            for fd in &fds {
                if libc::fcntl(*fd, libc::F_SETFD, 0) == -1 {
                    return Err(io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}
