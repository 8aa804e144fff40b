//! The kernel's random pool and clock, for a microVM copy that must not share its
//! randomness or its time with the snapshot it came from (docs/microvm.md "Snapshots and
//! copies"). Both ioctls need CAP_SYS_ADMIN: aether, PID 1 of the guest, has it.

use std::io;
use std::os::fd::AsRawFd;

/// `RNDADDENTROPY`, `_IOW('R', 0x03, int[2])`: adds bytes to the input pool and credits
/// them as entropy.
const RNDADDENTROPY: libc::c_ulong = 0x4008_5203;
/// `RNDRESEEDCRNG`, `_IO('R', 0x07)`: reseeds the kernel's CRNG from the input pool now,
/// so every later read (getrandom, /dev/urandom, the uuid sysctl) differs from a copy's.
const RNDRESEEDCRNG: libc::c_ulong = 0x5207;

/// The largest seed taken at once (the kernel's input pool is 256 bytes; more is hashed in
/// but credits nothing).
pub const MAX_SEED: usize = 512;

/// Mixes `seed` into the kernel's random pool, credited at 8 bits a byte, then reseeds the
/// CRNG. Errors: the open or ioctl's errno (EPERM without CAP_SYS_ADMIN), `InvalidInput`
/// for an empty seed or one over [`MAX_SEED`].
pub fn reseed(seed: &[u8]) -> io::Result<()> {
    if seed.is_empty() || seed.len() > MAX_SEED {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("a seed of {} bytes (1..={MAX_SEED})", seed.len()),
        ));
    }
    let dev = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/urandom")?;
    // struct rand_pool_info { int entropy_count; int buf_size; __u32 buf[]; }, as one
    // buffer of ints: the header, then the seed (padded to a whole int).
    let bytes = i32::try_from(seed.len()).unwrap_or(i32::MAX);
    let mut info: Vec<libc::c_int> = vec![bytes.saturating_mul(8), bytes];
    info.extend(seed.chunks(4).map(|chunk| {
        let mut w = [0u8; 4];
        for (d, s) in w.iter_mut().zip(chunk) {
            *d = *s;
        }
        libc::c_int::from_ne_bytes(w)
    }));
    // SAFETY: `dev` is an open fd for the call's duration; RNDADDENTROPY reads the header
    // and then `buf_size` bytes after it, which `info` holds (2 + ceil(len/4) ints).
    super::cvt(unsafe { libc::ioctl(dev.as_raw_fd(), RNDADDENTROPY as _, info.as_ptr()) })?;
    // SAFETY: RNDRESEEDCRNG takes no argument; `dev` is open.
    super::cvt(unsafe { libc::ioctl(dev.as_raw_fd(), RNDRESEEDCRNG as _) })?;
    Ok(())
}

/// Sets the realtime clock to `unix_ns` nanoseconds since the epoch. Errors: EPERM
/// without CAP_SYS_TIME, EINVAL for a time the kernel refuses.
pub fn set_realtime(unix_ns: i64) -> io::Result<()> {
    let ts = libc::timespec {
        tv_sec: unix_ns.div_euclid(1_000_000_000) as libc::time_t,
        tv_nsec: unix_ns.rem_euclid(1_000_000_000) as libc::c_long,
    };
    // SAFETY: `ts` is a valid timespec that lives across the call.
    super::cvt(unsafe { libc::clock_settime(libc::CLOCK_REALTIME, &ts) })?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ioctl_numbers_are_the_kernels() {
        assert_eq!(
            RNDADDENTROPY,
            nix::request_code_write!(b'R', 0x03, 2 * std::mem::size_of::<libc::c_int>())
                as libc::c_ulong
        );
        assert_eq!(
            RNDRESEEDCRNG,
            nix::request_code_none!(b'R', 0x07) as libc::c_ulong
        );
    }

    #[test]
    fn seeds_out_of_bounds_are_refused() {
        for n in [0, MAX_SEED + 1] {
            let e = reseed(&vec![7; n]).unwrap_err();
            assert_eq!(e.kind(), io::ErrorKind::InvalidInput, "{n}");
        }
    }
}
