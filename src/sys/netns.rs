//! Network namespaces that outlive their processes: a microVM's is pinned by a bind mount
//! of its nsfs file, so that it stays while the VM is paused (no process in it) and an edge
//! that restarts opens it again (docs/microvm.md "Network").

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::Path;

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};

/// Runs `f` on a new thread that has entered the network namespace `netns`, and returns
/// what it returns. The caller's threads keep their own namespace: only the short-lived
/// thread moves (setns of CLONE_NEWNET applies to the calling thread). Sockets `f` opens
/// stay in `netns` for their whole life, wherever they are used later.
/// Errors: the thread could not start, or `setns` failed (not a netns; no CAP_SYS_ADMIN).
pub fn run_in<T, F>(netns: BorrowedFd<'_>, f: F) -> io::Result<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    let fd: OwnedFd = netns.try_clone_to_owned()?;
    std::thread::Builder::new()
        .name("netns".into())
        .spawn(move || -> io::Result<T> {
            setns(fd.as_fd(), CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            drop(fd);
            Ok(f())
        })?
        .join()
        .map_err(|_| io::Error::other("the netns thread panicked"))?
}

/// Makes a new, empty network namespace (only `lo`, down) and pins it at `path`, a file
/// made here (`EEXIST` if one is there). Needs CAP_SYS_ADMIN. On error nothing is left.
pub fn create_pinned(path: &Path) -> io::Result<()> {
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    let target = path.to_path_buf();
    let made = std::thread::Builder::new()
        .name("netns-new".into())
        .spawn(move || -> io::Result<()> {
            // This thread only, which ends right after: the namespace lives on in the mount.
            unshare(CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            mount(
                Some("/proc/thread-self/ns/net"),
                &target,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
            .map_err(io::Error::from)
        })?
        .join()
        .map_err(|_| io::Error::other("the netns thread panicked"))
        .and_then(|r| r);
    if made.is_err() {
        let _ = std::fs::remove_file(path);
    }
    made
}

/// Opens the namespace pinned at `path`. Errors: `NotFound`; `InvalidInput` when the file
/// there is not a pinned network namespace (nothing mounted on it: a namespace lost).
pub fn open_pinned(path: &Path) -> io::Result<OwnedFd> {
    let f = std::fs::File::open(path)?;
    // nsfs's magic: an empty file left where the mount went away is no namespace.
    const NSFS_MAGIC: i64 = 0x6e73_6673;
    let st = nix::sys::statfs::fstatfs(&f).map_err(io::Error::from)?;
    if st.filesystem_type().0 as i64 != NSFS_MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} is not a pinned network namespace", path.display()),
        ));
    }
    Ok(f.into())
}

/// Unpins the namespace at `path` and removes the file; the namespace ends once nothing
/// else holds it (its interfaces with it: a veth's peer goes too). Idempotent: `Ok(false)`
/// when there was no file. Errors: the unmount or removal.
pub fn remove_pinned(path: &Path) -> io::Result<bool> {
    match umount2(path, MntFlags::MNT_DETACH) {
        Ok(()) | Err(nix::Error::EINVAL) | Err(nix::Error::ENOENT) => {}
        Err(e) => return Err(e.into()),
    }
    match std::fs::remove_file(path) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used, clippy::expect_used)]
mod tests {
    use super::*;

    fn netns_inode(fd: BorrowedFd<'_>) -> u64 {
        nix::sys::stat::fstat(fd).unwrap().st_ino
    }

    #[test]
    fn a_pinned_namespace_outlives_its_thread_and_is_gone_once_removed() {
        if !crate::sys::root_or_skip(
            "a_pinned_namespace_outlives_its_thread_and_is_gone_once_removed",
        ) {
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let pin = t.path().join("netns");
        create_pinned(&pin).unwrap();
        assert_eq!(
            create_pinned(&pin).unwrap_err().kind(),
            io::ErrorKind::AlreadyExists
        );
        let ns = open_pinned(&pin).unwrap();
        let own = std::fs::File::open("/proc/thread-self/ns/net").unwrap();
        assert_ne!(netns_inode(ns.as_fd()), netns_inode(own.as_fd()));
        // Inside: only lo; and the caller's thread stayed where it was.
        let pinned = netns_inode(ns.as_fd());
        let (links, inside) = run_in(ns.as_fd(), || {
            let dev = std::fs::read_to_string("/proc/thread-self/net/dev").unwrap();
            let links: Vec<String> = dev
                .lines()
                .skip(2)
                .filter_map(|l| l.split(':').next())
                .map(|n| n.trim().to_string())
                .collect();
            let me = std::fs::File::open("/proc/thread-self/ns/net").unwrap();
            (links, netns_inode(me.as_fd()))
        })
        .unwrap();
        assert_eq!((links, inside), (vec!["lo".to_string()], pinned));
        let here = std::fs::File::open("/proc/thread-self/ns/net").unwrap();
        assert_eq!(netns_inode(here.as_fd()), netns_inode(own.as_fd()));
        drop(ns);
        assert!(remove_pinned(&pin).unwrap());
        assert!(!pin.exists());
        assert!(!remove_pinned(&pin).unwrap());
        // An empty file where a pin was is refused.
        std::fs::write(&pin, b"").unwrap();
        assert_eq!(
            open_pinned(&pin).unwrap_err().kind(),
            io::ErrorKind::InvalidInput
        );
    }
}
