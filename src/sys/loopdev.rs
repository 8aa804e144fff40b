//! Loop devices: attach a file as a block device (`LOOP_CTL_GET_FREE` or `LOOP_CTL_ADD`,
//! then `LOOP_CONFIGURE`), detach one, and list the devices backed by files under a
//! directory (for cleanup).
//!
//! Many sandboxes start at once, each attaching from its own setup process.
//! `LOOP_CTL_GET_FREE` hands every concurrent caller the same lowest free device, so all but
//! one lose the `LOOP_CONFIGURE` race with `EBUSY`, ask again, and collide again (about 250
//! attachers at once used to exhaust every retry). So a caller that loses once stops asking
//! for the shared free device and makes a fresh one of its own with `LOOP_CTL_ADD(-1)`: the
//! kernel gives each such call a distinct new number, which no other attacher is waiting for.
//! Devices made this way stay (unbound) after their sandbox is gone and are handed out again
//! by `LOOP_CTL_GET_FREE`, so their number follows the peak of concurrent sandboxes.
//!
//! A container sandbox's writable disk is an ext4 image on a loop device, mounted only in the
//! sandbox's own mount namespace. Attached with autoclear, the device frees itself when its
//! last user goes away: the sandbox's mount namespace holds the only mount, so when the
//! sandbox dies nothing is left to detach.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::stat::{major, makedev, minor, mknod, Mode, SFlag};

use super::cvt;

/// The block major of loop devices (Documentation/admin-guide/devices.txt).
const LOOP_MAJOR: u32 = 7;

// ioctl numbers from <linux/loop.h>; loop uses plain numbers, not `_IOW` encodings.
const LOOP_SET_FD: libc::c_ulong = 0x4C00;
const LOOP_CLR_FD: libc::c_ulong = 0x4C01;
const LOOP_SET_STATUS64: libc::c_ulong = 0x4C04;
const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;
const LOOP_CONFIGURE: libc::c_ulong = 0x4C0A;
const LOOP_CTL_ADD: libc::c_ulong = 0x4C80;
const LOOP_CTL_GET_FREE: libc::c_ulong = 0x4C82;

const LO_FLAGS_READ_ONLY: u32 = 1;
const LO_FLAGS_AUTOCLEAR: u32 = 4;
const LO_NAME_SIZE: usize = 64;

/// How often `attach` tries another device when the one it got was taken (or removed) by
/// another attacher first. After the first loss every try is a device of its own, so a loss
/// after that needs a concurrent `LOOP_CTL_GET_FREE` caller to pick exactly that new device.
const ATTACH_ATTEMPTS: u32 = 64;

/// `struct loop_info64` of <linux/loop.h>.
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; LO_NAME_SIZE],
    lo_crypt_name: [u8; LO_NAME_SIZE],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// `struct loop_config` of <linux/loop.h> (`LOOP_CONFIGURE`, Linux 5.8+).
#[repr(C)]
#[derive(Clone, Copy)]
struct LoopConfig {
    fd: u32,
    block_size: u32,
    info: LoopInfo64,
    reserved: [u64; 8],
}

impl LoopInfo64 {
    fn new(backing: &Path, flags: u32) -> LoopInfo64 {
        let mut name = [0u8; LO_NAME_SIZE];
        // Informational only (losetup shows it); the kernel keeps the real path itself.
        let bytes = backing.as_os_str().as_encoded_bytes();
        let n = bytes.len().min(LO_NAME_SIZE - 1);
        if let (Some(dst), Some(src)) = (name.get_mut(..n), bytes.get(..n)) {
            dst.copy_from_slice(src);
        }
        LoopInfo64 {
            lo_device: 0,
            lo_inode: 0,
            lo_rdevice: 0,
            lo_offset: 0,
            lo_sizelimit: 0,
            lo_number: 0,
            lo_encrypt_type: 0,
            lo_encrypt_key_size: 0,
            lo_flags: flags,
            lo_file_name: name,
            lo_crypt_name: [0; LO_NAME_SIZE],
            lo_encrypt_key: [0; 32],
            lo_init: [0; 2],
        }
    }
}

/// An attached loop device. Holds the open `/dev/loopN`: with autoclear, dropping this
/// before anything else (a mount) uses the device detaches it, so keep it until the
/// sandbox has mounted its disk.
#[derive(Debug)]
pub struct LoopDevice {
    file: File,
    path: PathBuf,
    number: u32,
    rdev: (u32, u32),
}

impl LoopDevice {
    /// Attaches `backing` to a free loop device, read-only or read-write, with autoclear
    /// (detach when the last user closes it) or not. Creates `/dev/loopN` when the node is
    /// missing (a container's /dev). Retries when a concurrent attacher takes the same free
    /// device. Errors: /dev/loop-control or the backing file cannot be opened, the kernel
    /// refuses (`EBUSY` after every retry, `ENOSPC` when no device can be made).
    pub fn attach(backing: &Path, read_only: bool, autoclear: bool) -> io::Result<LoopDevice> {
        let backing_file = OpenOptions::new()
            .read(true)
            .write(!read_only)
            .custom_flags(libc::O_CLOEXEC)
            .open(backing)?;
        let mut flags = 0;
        if read_only {
            flags |= LO_FLAGS_READ_ONLY;
        }
        if autoclear {
            flags |= LO_FLAGS_AUTOCLEAR;
        }
        let control = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_CLOEXEC)
            .open("/dev/loop-control")?;
        let mut last = io::Error::from_raw_os_error(libc::EBUSY);
        for attempt in 0..ATTACH_ATTEMPTS {
            let number = if attempt == 0 {
                free_device(&control)?
            } else {
                new_device(&control)?
            };
            let path = PathBuf::from(format!("/dev/loop{number}"));
            match open_and_configure(&path, number, &backing_file, backing, read_only, flags) {
                Ok(dev) => return Ok(dev),
                // Someone else bound this device between our getting its number and
                // configuring it, or removed it meanwhile: make a fresh one.
                Err(e) if lost_race(&e) => {
                    last = e;
                    if attempt > 8 {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(last)
    }

    /// `/dev/loopN`.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// N of `/dev/loopN`.
    pub fn number(&self) -> u32 {
        self.number
    }

    /// The device's (major, minor), e.g. for `io.max` (`7:N` unless the loop module
    /// reserves minors for partitions).
    pub fn major_minor(&self) -> (u32, u32) {
        self.rdev
    }
}

/// The open device, e.g. to hand to the sandbox's setup process.
impl AsFd for LoopDevice {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }
}

/// Whether an attach step failed because another process got to the device first: it is
/// bound (`EBUSY`), or it went away between our getting its number and opening it.
fn lost_race(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EBUSY) | Some(libc::ENXIO) | Some(libc::ENODEV) | Some(libc::ENOENT)
    )
}

/// The lowest unbound loop device (made by the kernel when none is free).
fn free_device(control: &File) -> io::Result<u32> {
    // SAFETY: LOOP_CTL_GET_FREE takes no argument; `control` is an open fd of
    // /dev/loop-control for the duration of the call.
    let n = cvt(unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_GET_FREE as _) })?;
    u32::try_from(n).map_err(|_| io::Error::other("negative loop number"))
}

/// A new loop device with a number no other device has (`LOOP_CTL_ADD` of -1: the kernel
/// picks the lowest unused index under its lock, so concurrent callers never get the same).
fn new_device(control: &File) -> io::Result<u32> {
    // SAFETY: LOOP_CTL_ADD takes an integer argument (-1: any free index) and touches no
    // memory of ours; `control` is an open fd of /dev/loop-control for the call.
    let n =
        cvt(unsafe { libc::ioctl(control.as_raw_fd(), LOOP_CTL_ADD as _, -1 as libc::c_long) })?;
    u32::try_from(n).map_err(|_| io::Error::other("negative loop number"))
}

/// Opens `/dev/loop<number>` (making the node where /dev lacks it) and binds `backing` to it.
fn open_and_configure(
    path: &Path,
    number: u32,
    backing_file: &File,
    backing: &Path,
    read_only: bool,
    flags: u32,
) -> io::Result<LoopDevice> {
    ensure_node(path, number)?;
    let dev = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)?;
    configure(dev.as_fd(), backing_file, backing, flags)?;
    let st = dev.metadata()?;
    let rdev = (major(st.rdev()) as u32, minor(st.rdev()) as u32);
    Ok(LoopDevice {
        file: dev,
        path: path.to_path_buf(),
        number,
        rdev,
    })
}

/// Binds `backing` to the device: `LOOP_CONFIGURE`, or on kernels before 5.8
/// `LOOP_SET_FD` + `LOOP_SET_STATUS64`.
fn configure(dev: BorrowedFd<'_>, backing: &File, path: &Path, flags: u32) -> io::Result<()> {
    let fd = u32::try_from(backing.as_raw_fd()).map_err(|_| io::Error::other("bad fd"))?;
    let cfg = LoopConfig {
        fd,
        block_size: 0,
        info: LoopInfo64::new(path, flags),
        reserved: [0; 8],
    };
    // SAFETY: `dev` is an open loop device fd; `cfg` is a fully initialised `loop_config`
    // with the layout of <linux/loop.h> that outlives the call, which only reads it.
    let r = cvt(unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CONFIGURE as _, &cfg) });
    match r {
        Ok(_) => return Ok(()),
        Err(e) if matches!(e.raw_os_error(), Some(libc::EINVAL) | Some(libc::ENOTTY)) => {}
        Err(e) => return Err(e),
    }
    // Old kernel without LOOP_CONFIGURE. LOOP_SET_FD cannot set read-only itself: the device
    // is read-only when the backing fd is (we opened it so).
    // SAFETY: `dev` and `backing` are open fds for the duration of the call; LOOP_SET_FD
    // takes the backing fd as its integer argument.
    cvt(unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_SET_FD as _, backing.as_raw_fd()) })?;
    let info = LoopInfo64::new(path, flags & LO_FLAGS_AUTOCLEAR);
    // SAFETY: `info` is a fully initialised `loop_info64` that outlives the call, which
    // only reads it; `dev` is open.
    let r = cvt(unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_SET_STATUS64 as _, &info) });
    if let Err(e) = r {
        // Leave the device unbound rather than half-configured.
        // SAFETY: LOOP_CLR_FD takes no argument; `dev` is open.
        let _ = unsafe { libc::ioctl(dev.as_raw_fd(), LOOP_CLR_FD as _, 0) };
        return Err(e);
    }
    Ok(())
}

/// Makes `/dev/loopN` when udev/devtmpfs did not (a container's own /dev).
fn ensure_node(path: &Path, number: u32) -> io::Result<()> {
    match fs::metadata(path) {
        Ok(m) if m.file_type().is_block_device() => return Ok(()),
        Ok(_) => {
            return Err(io::Error::other(format!(
                "{} exists and is not a block device",
                path.display()
            )))
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let (maj, min) = sysfs_dev(number).unwrap_or((LOOP_MAJOR, number));
    match mknod(
        path,
        SFlag::S_IFBLK,
        Mode::from_bits_truncate(0o660),
        makedev(maj.into(), min.into()),
    ) {
        Ok(()) | Err(nix::errno::Errno::EEXIST) => Ok(()),
        Err(e) => Err(e.into()),
    }
}

/// The device number the kernel gave loopN (`/sys/block/loopN/dev`, "7:N").
fn sysfs_dev(number: u32) -> Option<(u32, u32)> {
    let s = fs::read_to_string(format!("/sys/block/loop{number}/dev")).ok()?;
    let (a, b) = s.trim().split_once(':')?;
    Some((a.parse().ok()?, b.parse().ok()?))
}

/// Detaches a loop device (`LOOP_CLR_FD`). A device still in use (mounted) is detached by
/// the kernel when its last user goes (it turns on autoclear). Detaching a device that is
/// not attached succeeds. Errors: the device cannot be opened, or the kernel refuses.
pub fn detach(dev: &Path) -> io::Result<()> {
    let f = match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(dev)
    {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    // SAFETY: LOOP_CLR_FD takes no argument; `f` is an open fd for the duration of the call.
    match cvt(unsafe { libc::ioctl(f.as_raw_fd(), LOOP_CLR_FD as _, 0) }) {
        Ok(_) => Ok(()),
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => Ok(()),
        Err(e) => Err(e),
    }
}

/// Every attached loop device whose backing file lies under `backing_prefix`, as
/// (`/dev/loopN`, backing file), from `/sys/block/loop*/loop/backing_file`. A backing file
/// deleted while attached is reported by its old path. Unreadable entries are skipped.
/// Reads every loop device of the host (thousands after bursts): where the device is known,
/// [`attached_as`] reads one.
pub fn attached(backing_prefix: &Path) -> Vec<(PathBuf, PathBuf)> {
    let mut out = Vec::new();
    let Ok(entries) = fs::read_dir("/sys/block") else {
        return out;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.starts_with("loop") {
            continue;
        }
        if let Some(found) = backed_by(&entry.path(), name, backing_prefix) {
            out.push(found);
        }
    }
    out.sort();
    out
}

/// The loop device `major:minor` (as `attached` reports it) when it is attached to a
/// backing file under `backing_prefix`; `None` when it is detached, backs something else
/// (it was reused) or is not a loop device.
pub fn attached_as(major_minor: &str, backing_prefix: &Path) -> Option<(PathBuf, PathBuf)> {
    let sys = fs::canonicalize(Path::new("/sys/dev/block").join(major_minor)).ok()?;
    let name = sys.file_name()?.to_str()?.to_string();
    if !name.starts_with("loop") {
        return None;
    }
    backed_by(&sys, &name, backing_prefix)
}

/// What loop device `major_minor` is attached to now, as sysfs tells it, for error messages:
/// its backing file, or why there is none.
pub fn describe(major_minor: &str) -> String {
    let Ok(sys) = fs::canonicalize(Path::new("/sys/dev/block").join(major_minor)) else {
        return format!("no block device {major_minor}");
    };
    match fs::read_to_string(sys.join("loop/backing_file")) {
        Ok(b) => format!("it backs {}", b.trim_end_matches('\n')),
        Err(e) => format!("{}: {e}", sys.display()),
    }
}

/// (`/dev/<name>`, backing file) of the loop device at sysfs directory `sys` when its
/// backing file lies under `backing_prefix`.
///
/// sysfs names the backing file by its path from the root of the mount it was opened on,
/// seen from the reader's root. A device attached inside a sandbox's setup namespace holds
/// a mount that pivot_root detached, so when the state directory is a mount of its own
/// (`/tmp`, `/data`) sysfs shows only the part below that mount. So when `backing_prefix`
/// is the backing file itself and the path does not match, the device and inode the
/// kernel keeps for it decide.
fn backed_by(sys: &Path, name: &str, backing_prefix: &Path) -> Option<(PathBuf, PathBuf)> {
    let backing = fs::read_to_string(sys.join("loop/backing_file")).ok()?;
    let backing = backing.trim_end_matches('\n');
    let backing = backing.strip_suffix(" (deleted)").unwrap_or(backing);
    let backing = PathBuf::from(backing);
    let dev = PathBuf::from(format!("/dev/{name}"));
    if backing.starts_with(backing_prefix) {
        return Some((dev, backing));
    }
    let md = fs::metadata(backing_prefix).ok().filter(|m| m.is_file())?;
    let (lo_device, lo_inode) = backing_id(&dev).ok()?;
    (lo_device == md.dev() && lo_inode == md.ino()).then(|| (dev, backing_prefix.to_path_buf()))
}

/// The (device, inode) of the file loop device `dev` is attached to (`LOOP_GET_STATUS64`).
fn backing_id(dev: &Path) -> io::Result<(u64, u64)> {
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(dev)?;
    let mut info = LoopInfo64::new(Path::new(""), 0);
    // SAFETY: `f` is an open block device fd for the call; `info` is a writable
    // `loop_info64` with the layout of <linux/loop.h>, which LOOP_GET_STATUS64 fills; on a
    // device that is not a loop device the ioctl fails without writing.
    cvt(unsafe { libc::ioctl(f.as_raw_fd(), LOOP_GET_STATUS64 as _, &mut info) })?;
    Ok((info.lo_device, info.lo_inode))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::sync::Arc;
    use std::time::Instant;

    use crate::sys::root_or_skip;

    /// A small ext4 image in `dir`.
    fn image(dir: &Path, name: &str) -> PathBuf {
        let p = dir.join(name);
        File::create(&p)
            .and_then(|f| f.set_len(16 << 20))
            .expect("image file");
        let st = Command::new("mkfs.ext4")
            .args(["-q", "-F", "-O", "^has_journal"])
            .arg(&p)
            .status()
            .expect("mkfs.ext4");
        assert!(st.success());
        p
    }

    /// Waits (bounded) until loopN has no backing file any more.
    fn wait_detached(number: u32) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        let f = format!("/sys/block/loop{number}/loop/backing_file");
        while Instant::now() < deadline {
            if !Path::new(&f).exists() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    #[test]
    fn a_device_attached_in_a_gone_mount_namespace_is_still_found_by_its_file() {
        if !root_or_skip("a_device_attached_in_a_gone_mount_namespace") {
            return;
        }
        // The state directory on a mount of its own, as /tmp or /data are on many hosts;
        // the device attached from a mount namespace that then goes away, as a sandbox's
        // setup does: sysfs then names the file from the tmpfs's root only.
        let dir = tempfile::tempdir().expect("tempdir");
        let m = dir.path().join("m");
        fs::create_dir(&m).expect("mkdir");
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "tmpfs"])
            .arg(&m)
            .status()
            .expect("mount");
        assert!(ok.success());
        let img = image(&m, "a.img");
        let out = Command::new("unshare")
            .args(["-m", "--propagation", "private", "losetup", "-f", "--show"])
            .arg(&img)
            .output()
            .expect("losetup");
        let dev = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let found = (|| {
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let name = Path::new(&dev).file_name()?.to_str()?.to_string();
            let majmin = fs::read_to_string(format!("/sys/block/{name}/dev")).ok()?;
            let shown = describe(majmin.trim());
            Some((attached_as(majmin.trim(), &img), shown))
        })();
        let _ = Command::new("losetup").args(["-d", &dev]).status();
        let _ = Command::new("umount").arg("-l").arg(&m).status();
        let (found, shown) = found.expect("the device's sysfs entry");
        assert_eq!(shown, "it backs /a.img", "the case this guards");
        assert_eq!(found, Some((PathBuf::from(&dev), img.clone())));
    }

    #[test]
    fn attach_mount_write_and_autoclear() {
        if !root_or_skip("attach_mount_write_and_autoclear") {
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let img = image(dir.path(), "a.img");
        let dev = LoopDevice::attach(&img, false, true).expect("attach");
        assert!(dev.path().starts_with("/dev"));
        let (maj, min) = dev.major_minor();
        assert_eq!(maj, LOOP_MAJOR);
        assert_eq!(Some((maj, min)), sysfs_dev(dev.number()));
        let found = attached(dir.path());
        assert_eq!(found, vec![(dev.path().to_path_buf(), img.clone())]);
        // The one device alone, by the `major:minor` a sandbox's record keeps.
        let majmin = format!("{maj}:{min}");
        assert_eq!(
            attached_as(&majmin, dir.path()),
            Some((dev.path().to_path_buf(), img.clone()))
        );
        assert_eq!(attached_as(&majmin, Path::new("/elsewhere")), None);
        assert_eq!(
            attached_as("1:3", dir.path()),
            None,
            "/dev/null is no loop device"
        );
        assert_eq!(attached_as("junk", dir.path()), None);

        // Mount in a private mount namespace of a thread of our own, as the sandbox's
        // setup process does, so the host mount table never sees it.
        let devpath = dev.path().to_path_buf();
        let mnt = dir.path().join("mnt");
        fs::create_dir(&mnt).expect("mkdir mnt");
        let m = mnt.clone();
        std::thread::spawn(move || {
            use nix::mount::{mount, umount, MsFlags};
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS).expect("unshare");
            mount(
                None::<&str>,
                "/",
                None::<&str>,
                MsFlags::MS_REC | MsFlags::MS_PRIVATE,
                None::<&str>,
            )
            .expect("make / private");
            mount(
                Some(&devpath),
                &m,
                Some("ext4"),
                MsFlags::empty(),
                None::<&str>,
            )
            .expect("mount");
            fs::write(m.join("hello"), b"hi").expect("write");
            umount(&m).expect("umount");
            mount(
                Some(&devpath),
                &m,
                Some("ext4"),
                MsFlags::MS_RDONLY,
                None::<&str>,
            )
            .expect("remount");
            assert_eq!(fs::read(m.join("hello")).expect("read"), b"hi");
            // Leave it mounted: the namespace dies with this thread and takes the mount along.
        })
        .join()
        .expect("mount thread");
        let number = dev.number();
        drop(dev);
        assert!(
            wait_detached(number),
            "autoclear left loop{number} attached"
        );
        assert!(attached(dir.path()).is_empty());
    }

    #[test]
    fn read_only_and_detach_without_autoclear() {
        if !root_or_skip("read_only_and_detach_without_autoclear") {
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let img = image(dir.path(), "ro.img");
        let dev = LoopDevice::attach(&img, true, false).expect("attach");
        let number = dev.number();
        let ro = fs::read_to_string(format!("/sys/block/loop{number}/ro")).expect("ro");
        assert_eq!(ro.trim(), "1");
        let path = dev.path().to_path_buf();
        drop(dev);
        // Without autoclear the device stays bound after the last close.
        assert_eq!(attached(dir.path()).len(), 1);
        detach(&path).expect("detach");
        assert!(wait_detached(number));
        // Detaching again is fine.
        detach(&path).expect("detach twice");
    }

    #[test]
    fn concurrent_attach_gets_distinct_devices() {
        if !root_or_skip("concurrent_attach_gets_distinct_devices") {
            return;
        }
        let dir = Arc::new(tempfile::tempdir().expect("tempdir"));
        let first = image(dir.path(), "0.img");
        let imgs: Vec<PathBuf> = (0..8)
            .map(|i| {
                let p = dir.path().join(format!("{i}.img"));
                if i > 0 {
                    fs::copy(&first, &p).expect("copy image");
                }
                p
            })
            .collect();
        let handles: Vec<_> = imgs
            .into_iter()
            .map(|p| {
                std::thread::spawn(move || LoopDevice::attach(&p, false, true).expect("attach"))
            })
            .collect();
        let devs: Vec<LoopDevice> = handles
            .into_iter()
            .map(|h| h.join().expect("join"))
            .collect();
        let mut numbers: Vec<u32> = devs.iter().map(|d| d.number()).collect();
        numbers.sort();
        numbers.dedup();
        assert_eq!(numbers.len(), 8, "devices shared: {numbers:?}");
        assert_eq!(attached(dir.path()).len(), 8);
        drop(devs);
        for n in numbers {
            assert!(wait_detached(n));
        }
    }

    /// A burst of sandboxes starting at once: 200 attachers released together all get a
    /// device (the herd on `LOOP_CTL_GET_FREE` used to exhaust its retries from about 250
    /// attaches at once, and 200 threads here already failed some).
    #[test]
    fn a_burst_of_concurrent_attaches_never_exhausts() {
        if !root_or_skip("a_burst_of_concurrent_attaches_never_exhausts") {
            return;
        }
        const N: usize = 200;
        let dir = tempfile::tempdir().expect("tempdir");
        // Any file is a block device's backing; sparse ones cost nothing.
        let imgs: Vec<PathBuf> = (0..N)
            .map(|i| {
                let p = dir.path().join(format!("{i}.img"));
                File::create(&p)
                    .and_then(|f| f.set_len(1 << 20))
                    .expect("backing file");
                p
            })
            .collect();
        let gate = Arc::new(std::sync::Barrier::new(N));
        let handles: Vec<_> = imgs
            .into_iter()
            .map(|p| {
                let gate = gate.clone();
                std::thread::spawn(move || {
                    gate.wait();
                    LoopDevice::attach(&p, false, true)
                })
            })
            .collect();
        let results: Vec<io::Result<LoopDevice>> = handles
            .into_iter()
            .map(|h| h.join().expect("join"))
            .collect();
        let failed: Vec<String> = results
            .iter()
            .filter_map(|r| r.as_ref().err().map(|e| e.to_string()))
            .collect();
        let devs: Vec<LoopDevice> = results.into_iter().flatten().collect();
        let mut numbers: Vec<u32> = devs.iter().map(|d| d.number()).collect();
        numbers.sort();
        numbers.dedup();
        let attached_n = attached(dir.path()).len();
        drop(devs);
        for n in &numbers {
            assert!(wait_detached(*n));
        }
        assert_eq!(failed, Vec::<String>::new(), "attaches failed");
        assert_eq!(numbers.len(), N, "devices shared");
        assert_eq!(attached_n, N);
    }
}
