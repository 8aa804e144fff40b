//! Taking ownership of file descriptors a parent handed down by number (aether's listening
//! socket, `listen_fd` in its config, and its cgroup directories).

use std::io;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;

use super::cvt;

/// Takes ownership of the inherited, already listening unix socket `fd`.
///
/// Checks that `fd` is open and is a socket that listens (`SO_ACCEPTCONN`), and marks it
/// close-on-exec; the caller
/// must not use the number again afterwards, and must call this at most once per fd.
/// Errors: `EBADF` for a closed fd, `InvalidInput` when it is not a listening socket.
pub fn take_unix_listener(fd: RawFd) -> io::Result<UnixListener> {
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(libc::EBADF));
    }
    // SAFETY: F_GETFD only reads the descriptor flags of `fd`; a closed fd returns EBADF.
    cvt(unsafe { libc::fcntl(fd, libc::F_GETFD) })?;
    let mut listening: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `listening` and `len` are valid for writes of the sizes passed; the kernel
    // checks that `fd` is a socket (ENOTSOCK otherwise).
    cvt(unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ACCEPTCONN,
            (&mut listening as *mut libc::c_int).cast(),
            &mut len,
        )
    })?;
    if listening == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("fd {fd} is a socket that does not listen"),
        ));
    }
    // SAFETY: `fd` is open (checked above) and was handed to this process to own: the
    // config that names it is the only reference, and callers take it once, so no other
    // owner will close it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    // Inherited fds lack close-on-exec: without it every process the agent starts (the
    // sandbox's own commands) would hold the listening socket and could accept on it.
    nix::fcntl::fcntl(
        &owned,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )
    .map_err(io::Error::from)?;
    Ok(UnixListener::from(owned))
}

/// Takes ownership of the inherited directory `fd` (aether's `workload/` cgroup
/// directories), marking it close-on-exec. The same rules as [`take_unix_listener`]: the
/// caller must not use the number again, and takes each fd at most once.
/// Errors: `EBADF` for a closed fd, `ENOTDIR` when it is not a directory.
pub fn take_dir(fd: RawFd) -> io::Result<OwnedFd> {
    take_if(
        fd,
        |mode| mode & libc::S_IFMT == libc::S_IFDIR,
        libc::ENOTDIR,
    )
}

/// Takes ownership of the inherited `fd`, whatever it is (a session's OOM eventfd or its
/// `memory.events`), marking it close-on-exec; the rules of [`take_dir`].
/// Errors: `EBADF` for a closed fd.
pub fn take_fd(fd: RawFd) -> io::Result<OwnedFd> {
    take_if(fd, |_| true, libc::EBADF)
}

/// Takes `fd` when `wanted(st_mode)`, else leaves it open and fails with `errno`.
fn take_if(fd: RawFd, wanted: impl Fn(u32) -> bool, errno: i32) -> io::Result<OwnedFd> {
    if fd < 0 {
        return Err(io::Error::from_raw_os_error(libc::EBADF));
    }
    // SAFETY: F_GETFD only reads the descriptor flags of `fd`; a closed fd returns EBADF.
    cvt(unsafe { libc::fcntl(fd, libc::F_GETFD) })?;
    // SAFETY: `fd` is open (checked above) and was handed to this process to own, as in
    // `take_unix_listener`.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    let st = nix::sys::stat::fstat(&owned).map_err(io::Error::from)?;
    if !wanted(st.st_mode) {
        // Not ours to close after all: hand the number back untouched.
        let _ = std::os::fd::IntoRawFd::into_raw_fd(owned);
        return Err(io::Error::from_raw_os_error(errno));
    }
    nix::fcntl::fcntl(
        &owned,
        nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::FD_CLOEXEC),
    )
    .map_err(io::Error::from)?;
    Ok(owned)
}

/// Sends `bytes` on the connected unix stream `sock` with `fd` attached (`SCM_RIGHTS`), as
/// QEMU's `getfd` wants a file passed. Waits while the socket's buffer is full. Errors:
/// the socket's (`EPIPE` once the peer is gone).
pub async fn send_with_fd(
    sock: &tokio::net::UnixStream,
    bytes: &[u8],
    fd: std::os::fd::BorrowedFd<'_>,
) -> io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    use std::os::fd::AsRawFd;
    let fds = [fd.as_raw_fd()];
    let iov = [io::IoSlice::new(bytes)];
    loop {
        sock.writable().await?;
        let sent = sock.try_io(tokio::io::Interest::WRITABLE, || {
            sendmsg::<()>(
                sock.as_raw_fd(),
                &iov,
                &[ControlMessage::ScmRights(&fds)],
                MsgFlags::MSG_NOSIGNAL,
                None,
            )
            .map_err(io::Error::from)
        });
        match sent {
            // A short send of a line QEMU reads whole would leave half a command: the
            // lines sent here are a few dozen bytes, far below any socket buffer.
            Ok(n) if n == bytes.len() => return Ok(()),
            Ok(n) => {
                return Err(io::Error::other(format!(
                    "sent {n} of {} bytes with a file descriptor",
                    bytes.len()
                )))
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::IntoRawFd;

    #[tokio::test]
    async fn a_file_descriptor_goes_with_the_bytes() {
        use std::io::{Read, Seek, Write};
        let (a, b) = std::os::unix::net::UnixStream::pair().expect("pair");
        a.set_nonblocking(true).expect("nonblocking");
        let a = tokio::net::UnixStream::from_std(a).expect("tokio");
        let mut f = tempfile::tempfile().expect("file");
        f.write_all(b"passed along").expect("write");
        send_with_fd(&a, b"getfd\n", std::os::fd::AsFd::as_fd(&f))
            .await
            .expect("send");
        let mut buf = [0u8; 16];
        let mut space = nix::cmsg_space!([RawFd; 1]);
        let mut iov = [io::IoSliceMut::new(&mut buf)];
        let msg = nix::sys::socket::recvmsg::<()>(
            std::os::fd::AsRawFd::as_raw_fd(&b),
            &mut iov,
            Some(&mut space),
            nix::sys::socket::MsgFlags::empty(),
        )
        .expect("recvmsg");
        let fds: Vec<RawFd> = msg
            .cmsgs()
            .expect("cmsgs")
            .filter_map(|c| match c {
                nix::sys::socket::ControlMessageOwned::ScmRights(fds) => Some(fds),
                _ => None,
            })
            .flatten()
            .collect();
        assert_eq!(msg.bytes, 6);
        assert_eq!(fds.len(), 1);
        let mut got = take_fd(fds[0]).map(std::fs::File::from).expect("take");
        got.rewind().expect("rewind");
        let mut text = String::new();
        got.read_to_string(&mut text).expect("read");
        assert_eq!(text, "passed along");
    }

    #[test]
    fn takes_a_listening_socket_and_refuses_others() {
        let d = tempfile::tempdir().expect("tempdir");
        let l = UnixListener::bind(d.path().join("s")).expect("bind");
        // As inherited: without close-on-exec.
        nix::fcntl::fcntl(
            &l,
            nix::fcntl::FcntlArg::F_SETFD(nix::fcntl::FdFlag::empty()),
        )
        .expect("clear");
        let fd = l.into_raw_fd();
        let l = take_unix_listener(fd).expect("take");
        assert!(l.local_addr().is_ok());
        let flags = nix::fcntl::fcntl(&l, nix::fcntl::FcntlArg::F_GETFD).expect("flags");
        assert_ne!(flags & libc::FD_CLOEXEC, 0);
        let f = std::fs::File::open("/dev/null").expect("open");
        let err = take_unix_listener(std::os::fd::AsRawFd::as_raw_fd(&f)).expect_err("file");
        assert_eq!(err.raw_os_error(), Some(libc::ENOTSOCK));
        assert!(take_unix_listener(-1).is_err());
    }

    #[test]
    fn takes_a_directory_and_refuses_others() {
        let d = tempfile::tempdir().expect("tempdir");
        let dir = std::fs::File::open(d.path()).expect("open dir");
        let dir = take_dir(dir.into_raw_fd()).expect("take dir");
        let flags = nix::fcntl::fcntl(&dir, nix::fcntl::FcntlArg::F_GETFD).expect("flags");
        assert_ne!(flags & libc::FD_CLOEXEC, 0);
        let f = std::fs::File::open("/dev/null").expect("open");
        let err = take_dir(std::os::fd::AsRawFd::as_raw_fd(&f)).expect_err("file");
        assert_eq!(err.raw_os_error(), Some(libc::ENOTDIR));
        // Still open: not taken.
        assert!(nix::fcntl::fcntl(&f, nix::fcntl::FcntlArg::F_GETFD).is_ok());
        assert!(take_dir(-1).is_err());
    }
}
