//! Each VM's QEMU runs in a jail of its own (docs/microvm.md "The jail"): a uid and gid of
//! its own from `uid_base`, new mount, IPC, UTS and network namespaces, and a root that
//! holds QEMU's program and libraries and that VM's files alone. This module chooses the
//! uid, gives the VM's files to it, and plans the jail ([`crate::sys::jail`] enters it).

use std::collections::HashSet;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use super::qemu::{Console, Machine};
use crate::sys::jail::Jail;

/// The default `uid_base` (docs/configuration.md): VMs run as uids from one billion up,
/// far from any user or container mapping of the host.
pub const DEFAULT_UID_BASE: u32 = 1_000_000_000;
/// How many uids VMs take from `uid_base`: more than a node runs VMs.
pub const UIDS: u32 = 65536;
/// Where the host's VM uids are claimed, one file per uid naming the config disk of the VM
/// that holds it: every edge and backend of the host shares the range, so two of them
/// never give one uid to two VMs (a uid's processes may signal and trace each other).
pub const UID_REGISTRY: &str = "/run/opendsec/vm-uids";

/// Where each VM's QEMU may run and as whom; see the module doc.
#[derive(Debug)]
pub struct Jailer {
    /// An empty directory, the mount point of every jail's root (each in its own mount
    /// namespace).
    root: PathBuf,
    uid_base: u32,
    /// The sandboxes' directories, each holding its config disk, whose owner is its uid.
    sandboxes: PathBuf,
    /// Held from choosing a uid until the config disk is given to it (with the registry's
    /// lock, which other processes of the host take).
    choosing: Mutex<()>,
    registry: PathBuf,
    /// `/dev/kvm`'s group, which QEMU keeps with KVM; None under emulation.
    kvm_gid: Option<u32>,
}

/// The top-level paths of the host a dynamically linked QEMU needs: its program, its
/// libraries and data (firmware) under `/usr`, and the loader's paths.
const SYSTEM: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
];
/// Single files of the host QEMU reads: the loader's cache.
const SYSTEM_FILES: &[&str] = &["/etc/ld.so.cache"];
/// Devices QEMU may open.
const DEVICES: &[&str] = &["/dev/null", "/dev/zero", "/dev/urandom", "/dev/random"];

impl Jailer {
    /// A jailer whose jails mount on `node_dir/jail` and whose VMs' directories are under
    /// `sandboxes`. `uid_base` 0 means [`DEFAULT_UID_BASE`]. Errors: a text naming the
    /// bad `uid_base` or the directory that could not be made.
    pub fn new(
        node_dir: &Path,
        sandboxes: &Path,
        uid_base: i64,
        kvm: bool,
    ) -> Result<Jailer, String> {
        let base = if uid_base == 0 {
            DEFAULT_UID_BASE
        } else {
            u32::try_from(uid_base)
                .ok()
                .filter(|b| *b >= 1 && b.checked_add(UIDS).is_some())
                .ok_or_else(|| format!("uid_base {uid_base}: must be 1 to {}", u32::MAX - UIDS))?
        };
        let root = node_dir.join("jail");
        std::fs::create_dir_all(&root).map_err(|e| format!("{}: {e}", root.display()))?;
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o755))
            .map_err(|e| format!("{}: {e}", root.display()))?;
        let kvm_gid = if kvm {
            std::fs::metadata("/dev/kvm").ok().map(|m| m.gid())
        } else {
            None
        };
        let registry = PathBuf::from(UID_REGISTRY);
        std::fs::create_dir_all(&registry).map_err(|e| format!("{}: {e}", registry.display()))?;
        std::fs::set_permissions(&registry, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| format!("{}: {e}", registry.display()))?;
        Ok(Jailer {
            root,
            uid_base: base,
            sandboxes: sandboxes.to_path_buf(),
            choosing: Mutex::new(()),
            registry,
            kvm_gid,
        })
    }

    /// Claims `uid` for the VM whose config disk is `config`, the registry's lock held:
    /// true when it is free, already this VM's, or held by a VM that is gone (its config
    /// disk no longer exists or is no longer owned by `uid`).
    fn claim(&self, uid: u32, config: &Path) -> Result<bool, String> {
        use std::io::Write;
        use std::os::unix::ffi::OsStrExt;
        let entry = self.registry.join(uid.to_string());
        let want = config.as_os_str().as_bytes();
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&entry)
        {
            Ok(mut f) => {
                f.write_all(want)
                    .map_err(|e| format!("{}: {e}", entry.display()))?;
                return Ok(true);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(format!("{}: {e}", entry.display())),
        }
        let holder = std::fs::read(&entry).unwrap_or_default();
        if holder == want {
            return Ok(true);
        }
        let holder = PathBuf::from(std::ffi::OsStr::from_bytes(&holder));
        let alive = std::fs::metadata(&holder).is_ok_and(|m| m.uid() == uid);
        if alive {
            return Ok(false);
        }
        std::fs::write(&entry, want).map_err(|e| format!("{}: {e}", entry.display()))?;
        Ok(true)
    }

    /// Gives back the uid of the VM whose config disk is `config` (a stop), if the registry
    /// names it as its holder. Best effort: a holder that is gone is reclaimed anyway.
    pub fn release(&self, config: &Path) {
        use std::os::unix::ffi::OsStrExt;
        let Ok(meta) = std::fs::metadata(config) else {
            return;
        };
        if !self.ours(meta.uid()) {
            return;
        }
        let entry = self.registry.join(meta.uid().to_string());
        if std::fs::read(&entry).is_ok_and(|h| h == config.as_os_str().as_bytes()) {
            let _ = std::fs::remove_file(&entry);
        }
    }

    fn ours(&self, uid: u32) -> bool {
        uid >= self.uid_base && uid - self.uid_base < UIDS
    }

    /// The uid of the VM whose config disk is `config`: its owner when that is one of the
    /// VMs' uids (a resume or restart keeps it), else the lowest uid no other VM of this
    /// node holds, given to the config disk now. Errors: all uids taken; the config
    /// disk's stat or chown.
    pub fn uid_of(&self, config: &Path) -> Result<u32, String> {
        let _one = self
            .choosing
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let lock_path = self.registry.join(".lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| format!("{}: {e}", lock_path.display()))?;
        let _host = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| format!("locking {}: {e}", lock_path.display()))?;
        let owner = std::fs::metadata(config)
            .map_err(|e| format!("{}: {e}", config.display()))?
            .uid();
        if self.ours(owner) && self.claim(owner, config)? {
            return Ok(owner);
        }
        // This node's VMs first, without touching the registry: the common case of a
        // node that holds the host alone.
        let mut taken = HashSet::new();
        if let Ok(rd) = std::fs::read_dir(&self.sandboxes) {
            for e in rd.flatten() {
                if let Ok(m) = std::fs::metadata(e.path().join("config.img")) {
                    if self.ours(m.uid()) {
                        taken.insert(m.uid());
                    }
                }
            }
        }
        let mut uid = None;
        for u in (self.uid_base..self.uid_base + UIDS).filter(|u| !taken.contains(u)) {
            if self.claim(u, config)? {
                uid = Some(u);
                break;
            }
        }
        let uid =
            uid.ok_or_else(|| format!("all {UIDS} VM uids from {} are taken", self.uid_base))?;
        std::os::unix::fs::chown(config, Some(uid), Some(uid))
            .map_err(|e| format!("chown {}: {e}", config.display()))?;
        Ok(uid)
    }

    /// Gives the VM's files to `uid` as QEMU needs them: the writable disk and a shared RAM
    /// file become its own; files it only reads (the node's, the image's, a snapshot's)
    /// become readable to it where they were not. A copy's RAM (a snapshot's memory,
    /// mapped privately) is shared by its siblings and only read where QEMU opens it
    /// read-only (`readonly=on,rom=off`, 8.2 and later); before that QEMU opens it
    /// read-write, so each copy has a file of its own, given to it. The guest kernel is read from
    /// where it is, and must be readable to all. Errors: the path and what failed.
    pub fn prepare(&self, m: &Machine, uid: u32) -> Result<(), String> {
        let own = |p: &Path| {
            std::os::unix::fs::chown(p, Some(uid), Some(uid))
                .map_err(|e| format!("chown {}: {e}", p.display()))
        };
        let readable = |p: &Path, mode: u32| -> Result<(), String> {
            let meta = std::fs::metadata(p).map_err(|e| format!("{}: {e}", p.display()))?;
            if meta.uid() == uid || meta.permissions().mode() & mode == mode {
                return Ok(());
            }
            let want = meta.permissions().mode() & 0o7777 | mode;
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(want))
                .map_err(|e| format!("chmod {}: {e}", p.display()))
        };
        for d in &m.disks {
            if d.read_only {
                readable(&d.path, 0o004)?;
            } else {
                own(&d.path)?;
            }
        }
        if m.ram.shared {
            own(&m.ram.path)?;
        } else if !m.ram.open_read_only {
            // Opened read-write, a file that other links hold (the snapshot's, its other
            // copies') would let this QEMU write their memory: it gets one of its own.
            private_file(&m.ram.path)?;
            own(&m.ram.path)?;
        } else {
            readable(&m.ram.path, 0o004)?;
        }
        if let Some(i) = &m.initrd {
            readable(i, 0o004)?;
        }
        Ok(())
    }

    /// The jail for QEMU at `qemu` running `m` as `uid`. Errors: a path that cannot be
    /// shown inside (missing, or not a plain absolute path).
    pub fn plan(&self, m: &Machine, qemu: &Path, uid: u32) -> Result<Jail, String> {
        let e = |e: crate::sys::jail::JailError| e.to_string();
        let mut j = Jail::new(&self.root, uid, uid).map_err(e)?;
        for s in SYSTEM {
            j.mirror(Path::new(s)).map_err(e)?;
        }
        for f in SYSTEM_FILES {
            if Path::new(f).is_file() {
                j.bind(Path::new(f), true).map_err(e)?;
            }
        }
        for d in DEVICES {
            j.device(Path::new(d)).map_err(e)?;
        }
        if let Some(gid) = self.kvm_gid {
            j.device(Path::new("/dev/kvm")).map_err(e)?;
            j.groups(&[gid]);
        }
        j.bind(qemu, true).map_err(e)?;
        j.bind_own(&m.kernel, true).map_err(e)?;
        if let Some(i) = &m.initrd {
            j.bind_own(i, true).map_err(e)?;
        }
        let mut largest = m.memory_mb << 20;
        for d in &m.disks {
            j.bind_own(&d.path, d.read_only).map_err(e)?;
            if !d.read_only {
                largest = largest.max(std::fs::metadata(&d.path).map_or(0, |md| md.len()));
            }
        }
        // No file QEMU writes grows past its disk or its RAM, with room for a migration
        // stream that holds all of a copy's RAM; its log shares the limit. A guest that took
        // QEMU over cannot fill the node's disk through a file it was given.
        j.file_size_limit(largest + largest / 8 + (64 << 20));
        // Written by QEMU when shared, and opened read-write for a private mapping
        // before QEMU 8.2: then it is the copy's own (see `prepare`).
        j.bind_own(&m.ram.path, !m.ram.shared && m.ram.open_read_only)
            .map_err(e)?;
        if let Console::File(log) = &m.console {
            j.bind_own(log, false).map_err(e)?;
        }
        Ok(j)
    }
}

/// Makes `path` a file that no other link holds, by a copy (a reflink where the file
/// system has them) put in its place. Errors: the path and what failed.
fn private_file(path: &Path) -> Result<(), String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{}: {e}", path.display()))?;
    if meta.nlink() <= 1 {
        return Ok(());
    }
    let tmp = path.with_extension("private");
    let _ = std::fs::remove_file(&tmp);
    crate::backends::container::disk::sparse_copy(path, &tmp)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            format!("a copy of {} of its own: {e}", path.display())
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_vm_keeps_its_uid_and_a_new_one_takes_the_lowest_free() {
        if !crate::sys::root_or_skip("a_vm_keeps_its_uid_and_a_new_one_takes_the_lowest_free") {
            return;
        }
        let t = tempfile::tempdir().unwrap();
        let sandboxes = t.path().join("microvms");
        let j = Jailer::new(t.path(), &sandboxes, 4_000_000_000, false).unwrap();
        let config = |id: &str| {
            let d = sandboxes.join(id);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("config.img"), b"x").unwrap();
            d.join("config.img")
        };
        let (a, b, c) = (config("a"), config("b"), config("c"));
        assert_eq!(j.uid_of(&a).unwrap(), 4_000_000_000);
        assert_eq!(j.uid_of(&b).unwrap(), 4_000_000_001);
        // Asked again (a resume, an edge restart): the same.
        assert_eq!(j.uid_of(&a).unwrap(), 4_000_000_000);
        assert_eq!(std::fs::metadata(&a).unwrap().uid(), 4_000_000_000);
        // Another node of the same host never gets a uid this one holds.
        let other = t.path().join("other");
        let j2 = Jailer::new(&other, &other.join("microvms"), 4_000_000_000, false).unwrap();
        std::fs::create_dir_all(other.join("microvms/x")).unwrap();
        let x = other.join("microvms/x/config.img");
        std::fs::write(&x, b"x").unwrap();
        assert_eq!(j2.uid_of(&x).unwrap(), 4_000_000_002);
        // A stopped VM's uid is free again, once given back or once its files are gone.
        j2.release(&x);
        std::fs::remove_dir_all(sandboxes.join("a")).unwrap();
        assert_eq!(j.uid_of(&c).unwrap(), 4_000_000_000);
        let d = config("d");
        assert_eq!(j.uid_of(&d).unwrap(), 4_000_000_002);
        assert!(Jailer::new(t.path(), &sandboxes, u32::MAX as i64, false).is_err());
        assert!(Jailer::new(t.path(), &sandboxes, -1, false).is_err());
    }

    #[test]
    fn a_copys_memory_is_shared_only_where_qemu_opens_it_read_only() {
        if !crate::sys::root_or_skip("a_copys_memory_is_shared_only_where_qemu_opens_it_read_only")
        {
            return;
        }
        use super::super::qemu::{Accel, RamFile};
        let t = tempfile::tempdir().unwrap();
        let snapshot = t.path().join("memory");
        std::fs::write(&snapshot, b"the snapshot's pages").unwrap();
        std::fs::set_permissions(&snapshot, std::fs::Permissions::from_mode(0o600)).unwrap();
        let j = Jailer::new(t.path(), &t.path().join("microvms"), 4_000_000_000, false).unwrap();
        let copy = |name: &str, open_read_only: bool| {
            let path = t.path().join(name);
            std::fs::hard_link(&snapshot, &path).unwrap();
            let m = Machine {
                kernel: "/k".into(),
                initrd: None,
                append: String::new(),
                init_args: vec![],
                memory_mb: 16,
                vcpus: 1,
                accel: Accel::Tcg { tsc_khz: 0 },
                ram: RamFile {
                    path: path.clone(),
                    shared: false,
                    open_read_only,
                },
                disks: vec![],
                agent_socket: "/s/a".into(),
                qmp_socket: "/s/q".into(),
                listen_fds: None,
                tap_fd: None,
                console: Console::Null,
                incoming: true,
            };
            j.prepare(&m, 4_000_000_007).unwrap();
            std::fs::metadata(&path).unwrap()
        };
        // QEMU 8.2 and later: the copies share the snapshot's file, which they may only read.
        let shared = copy("a", true);
        assert_eq!(shared.ino(), std::fs::metadata(&snapshot).unwrap().ino());
        assert_eq!((shared.uid(), shared.mode() & 0o777), (0, 0o604));
        // Before 8.2 QEMU opens it read-write: the copy gets a file of its own, and the
        // snapshot's stays root's and unwritable to others.
        let own = copy("b", false);
        let snap = std::fs::metadata(&snapshot).unwrap();
        assert_ne!(own.ino(), snap.ino());
        assert_eq!((own.nlink(), own.uid()), (1, 4_000_000_007));
        assert_eq!(
            (snap.uid(), snap.mode() & 0o777, snap.nlink()),
            (0, 0o604, 2)
        );
        assert_eq!(
            std::fs::read(t.path().join("b")).unwrap(),
            b"the snapshot's pages"
        );
        // Prepared again (a resume), a file of its own is kept as it is.
        std::fs::write(t.path().join("b"), b"its own").unwrap();
        private_file(&t.path().join("b")).unwrap();
        let again = std::fs::metadata(t.path().join("b")).unwrap();
        assert_eq!(again.ino(), own.ino());
    }
}
