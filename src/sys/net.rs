//! Network interface flags by ioctl: bringing up `lo` in a new network namespace, without a
//! netlink library for one flag.

use std::io;
use std::os::fd::AsRawFd;

use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};

use super::cvt;

/// Sets IFF_UP on interface `name` (e.g. `lo`) in the caller's network namespace.
pub fn set_up(name: &str) -> io::Result<()> {
    let sock = socket(
        AddressFamily::Inet,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(io::Error::from)?;
    let fd = sock.as_raw_fd();
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    let bytes = name.as_bytes();
    if bytes.len() >= req.ifr_name.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "interface name too long",
        ));
    }
    for (d, s) in req.ifr_name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: `req` is a valid ifreq with a NUL-terminated name; SIOCGIFFLAGS writes only
    // its flags member, and `fd` stays open (owned by `sock`) for the call.
    cvt(unsafe { libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req) })?;
    // SAFETY: the kernel just filled the flags member of the union, so reading it is defined.
    unsafe {
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
    }
    // SAFETY: as above; SIOCSIFFLAGS only reads the name and flags.
    cvt(unsafe { libc::ioctl(fd, libc::SIOCSIFFLAGS, &req) })?;
    Ok(())
}
