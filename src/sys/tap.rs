//! TAP devices for microVMs (docs/microvm.md "Network"): the node opens the device and
//! hands QEMU the descriptor, so that QEMU, in a network namespace of its own with no
//! `/dev/net/tun`, needs no privilege for its network.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd};

use super::cvt;

/// Opens the TAP device `name` in the calling thread's network namespace, making it when
/// there is none: Ethernet frames without packet information, with virtio-net's header
/// (`IFF_VNET_HDR`, what QEMU's virtio-net uses for offloads). With `persist` the device
/// stays when the descriptor closes (a paused VM's QEMU is gone; its tap is not).
/// Needs CAP_NET_ADMIN. Errors: opening `/dev/net/tun`, `InvalidInput` for a name over 15
/// bytes or with a NUL, the ioctls' errno.
pub fn open(name: &str, persist: bool) -> io::Result<OwnedFd> {
    // SAFETY: ifreq is plain old data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    let bytes = name.as_bytes();
    if bytes.is_empty() || bytes.len() >= req.ifr_name.len() || bytes.contains(&0) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("bad tap name {name:?}"),
        ));
    }
    for (d, s) in req.ifr_name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI | libc::IFF_VNET_HDR) as i16;
    let tun: OwnedFd = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/net/tun")?
        .into();
    // SAFETY: `req` is a valid ifreq with a NUL-terminated name and the flags set;
    // TUNSETIFF reads it and writes back the name, within the struct. `tun` is open.
    cvt(unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF, &mut req) })?;
    if persist {
        // SAFETY: TUNSETPERSIST takes an integer argument by value; `tun` is open.
        cvt(unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETPERSIST, 1 as libc::c_ulong) })?;
    }
    Ok(tun)
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn a_persistent_tap_stays_and_opens_again() {
        if !crate::sys::root_or_skip("a_persistent_tap_stays_and_opens_again") {
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let pin = t.path().join("netns");
        crate::sys::netns::create_pinned(&pin).unwrap();
        let ns = crate::sys::netns::open_pinned(&pin).unwrap();
        let links = || {
            crate::sys::netns::run_in(ns.as_fd(), || {
                std::fs::read_to_string("/proc/thread-self/net/dev").unwrap()
            })
            .unwrap()
        };
        let first = crate::sys::netns::run_in(ns.as_fd(), || open("tap0", true)).unwrap();
        let first = first.unwrap();
        drop(first);
        assert!(links().contains("tap0:"), "{}", links());
        // A second open attaches to the same device (what each QEMU start does).
        let again = crate::sys::netns::run_in(ns.as_fd(), || open("tap0", true)).unwrap();
        assert!(again.is_ok());
        assert_eq!(
            open("a-name-longer-than-15", false).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
        crate::sys::netns::remove_pinned(&pin).unwrap();
    }
}
