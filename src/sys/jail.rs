//! A jail for a program the node runs on a sandbox's behalf, a microVM's QEMU
//! (docs/microvm.md "The jail"). Between fork and exec the child enters new mount, IPC,
//! UTS and network namespaces, builds a root on a small tmpfs that holds only the paths it
//! was given (bind mounts at their own paths, so the program's arguments need no
//! rewriting), pivots into it, detaches the host's tree, and drops to a uid and gid of its
//! own with no capabilities left. Everything the child does is planned here, in the
//! parent: the child only makes syscalls on prepared C strings.

use std::collections::BTreeSet;
use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Component, Path, PathBuf};

/// One step of building the jail's root, every path already prefixed with the root.
#[derive(Debug)]
enum Step {
    Mkdir(CString),
    /// An empty file to bind a file onto.
    Touch(CString),
    Bind {
        src: CString,
        dst: CString,
        read_only: bool,
        /// A device node: its mount keeps device access.
        device: bool,
    },
    Symlink {
        target: CString,
        at: CString,
    },
}

/// Why a jail cannot be planned.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    #[error("{0:?} is not an absolute path without . or .. components")]
    BadPath(PathBuf),
    #[error("{0:?} would be inside a path of the host shown read-only or as a link (/usr, /lib, ...): a VM's files cannot live there")]
    Covered(PathBuf),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// A planned jail; see the module doc. Build it with [`Jail::new`], [`Jail::bind`],
/// [`Jail::device`], [`Jail::symlink`], then [`Jail::enter_at_exec`].
#[derive(Debug)]
pub struct Jail {
    root: PathBuf,
    root_c: CString,
    old_in_root: CString,
    old_after: CString,
    slash: CString,
    tmpfs: CString,
    tmpfs_opts: CString,
    made: BTreeSet<PathBuf>,
    /// Paths bound as whole directories: a path under one is visible already.
    bound_dirs: Vec<PathBuf>,
    /// Symbolic links made inside: nothing can be made under one.
    links: Vec<PathBuf>,
    /// RLIMIT_FSIZE, bytes: the largest file the program may write.
    file_size_limit: Option<u64>,
    steps: Vec<Step>,
    uid: u32,
    gid: u32,
    groups: Vec<libc::gid_t>,
    cwd: CString,
}

fn cstr(p: &Path) -> Result<CString, JailError> {
    CString::new(p.as_os_str().as_bytes()).map_err(|_| JailError::BadPath(p.to_path_buf()))
}

fn checked(p: &Path) -> Result<(), JailError> {
    let plain = p.is_absolute()
        && p.components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    if plain {
        Ok(())
    } else {
        Err(JailError::BadPath(p.to_path_buf()))
    }
}

impl Jail {
    /// A jail whose root is mounted on `root` (an empty directory of the host, used only as
    /// a mount point inside the child's own mount namespace, so any number of jails can
    /// share it) and whose program runs as `uid`:`gid` with no supplementary groups.
    /// Errors: `BadPath` when `root` is not a plain absolute path.
    pub fn new(root: &Path, uid: u32, gid: u32) -> Result<Jail, JailError> {
        checked(root)?;
        Ok(Jail {
            root: root.to_path_buf(),
            root_c: cstr(root)?,
            old_in_root: cstr(&root.join(".old"))?,
            old_after: c"/.old".to_owned(),
            slash: c"/".to_owned(),
            tmpfs: c"tmpfs".to_owned(),
            tmpfs_opts: c"mode=0755,size=256k,nr_inodes=4096".to_owned(),
            made: BTreeSet::new(),
            bound_dirs: Vec::new(),
            links: Vec::new(),
            file_size_limit: None,
            steps: Vec::new(),
            uid,
            gid,
            groups: Vec::new(),
            cwd: c"/".to_owned(),
        })
    }

    /// The largest file, in bytes, the program may write or extend (RLIMIT_FSIZE): a
    /// writer past it gets SIGXFSZ.
    pub fn file_size_limit(&mut self, bytes: u64) {
        self.file_size_limit = Some(bytes);
    }

    /// Supplementary groups the program keeps (the group of `/dev/kvm`).
    pub fn groups(&mut self, groups: &[u32]) {
        self.groups = groups.to_vec();
    }

    /// The working directory inside the jail (`/` by default).
    pub fn cwd(&mut self, dir: &Path) -> Result<(), JailError> {
        checked(dir)?;
        self.cwd = cstr(dir)?;
        Ok(())
    }

    fn inside(&self, p: &Path) -> PathBuf {
        let rel = p.strip_prefix("/").unwrap_or(p);
        self.root.join(rel)
    }

    fn covered(&self, p: &Path) -> bool {
        self.bound_dirs.iter().any(|d| p.starts_with(d))
    }

    fn parents(&mut self, p: &Path) -> Result<(), JailError> {
        let mut at = PathBuf::from("/");
        let comps: Vec<_> = p.components().collect();
        for c in comps.iter().take(comps.len().saturating_sub(1)) {
            if let Component::Normal(n) = c {
                at.push(n);
                if self.made.insert(at.clone()) {
                    self.steps.push(Step::Mkdir(cstr(&self.inside(&at))?));
                }
            }
        }
        Ok(())
    }

    fn add_bind(&mut self, src: &Path, read_only: bool, device: bool) -> Result<(), JailError> {
        checked(src)?;
        if self.covered(src) {
            return Ok(());
        }
        let meta = std::fs::metadata(src).map_err(|source| JailError::Io {
            path: src.to_path_buf(),
            source,
        })?;
        self.parents(src)?;
        let dst = cstr(&self.inside(src))?;
        if self.made.insert(src.to_path_buf()) {
            self.steps.push(if meta.is_dir() {
                Step::Mkdir(dst.clone())
            } else {
                Step::Touch(dst.clone())
            });
        }
        if meta.is_dir() {
            self.bound_dirs.push(src.to_path_buf());
        }
        self.steps.push(Step::Bind {
            src: cstr(src)?,
            dst,
            read_only,
            device,
        });
        Ok(())
    }

    /// Makes `path` (a file or a directory of the host) visible at the same path inside,
    /// read-only or writable as the host allows. A path under a directory bound already is
    /// visible through it. Errors: `BadPath`, `Io` when `path` does not exist.
    pub fn bind(&mut self, path: &Path, read_only: bool) -> Result<(), JailError> {
        self.add_bind(path, read_only, false)
    }

    /// As `bind`, for a file that must be shown as itself, writable where asked: one under
    /// a directory bound already (read-only) or under a link made inside is refused.
    /// Errors: `Covered`, and `bind`'s.
    pub fn bind_own(&mut self, path: &Path, read_only: bool) -> Result<(), JailError> {
        if self.covered(path) || self.links.iter().any(|l| path.starts_with(l)) {
            return Err(JailError::Covered(path.to_path_buf()));
        }
        self.add_bind(path, read_only, false)
    }

    /// Makes the device node `path` (`/dev/null`, `/dev/kvm`) usable inside.
    pub fn device(&mut self, path: &Path) -> Result<(), JailError> {
        self.add_bind(path, false, true)
    }

    /// Makes `at` inside a symbolic link to `target` (`/lib` to `usr/lib` on a merged-/usr
    /// host).
    pub fn symlink(&mut self, at: &Path, target: &Path) -> Result<(), JailError> {
        checked(at)?;
        self.parents(at)?;
        if self.made.insert(at.to_path_buf()) {
            self.links.push(at.to_path_buf());
            self.steps.push(Step::Symlink {
                target: cstr(target)?,
                at: cstr(&self.inside(at))?,
            });
        }
        Ok(())
    }

    /// Makes the host's top-level `name` (`/usr`, `/lib64`, ...) visible as it is on the
    /// host: a symbolic link is copied, a directory bound read-only; a missing one is left
    /// out. Errors: `BadPath`, `Io` reading the link.
    pub fn mirror(&mut self, path: &Path) -> Result<(), JailError> {
        match std::fs::symlink_metadata(path) {
            Err(_) => Ok(()),
            Ok(m) if m.file_type().is_symlink() => {
                let target = std::fs::read_link(path).map_err(|source| JailError::Io {
                    path: path.to_path_buf(),
                    source,
                })?;
                self.symlink(path, &target)
            }
            Ok(m) if m.is_dir() => self.bind(path, true),
            Ok(_) => Ok(()),
        }
    }

    /// Has `cmd`'s child enter the jail after the steps registered before this call (so
    /// join cgroups first) and before exec. The program's path must be visible inside.
    /// A step that fails ends the spawn with its errno, after a line on the child's
    /// stderr naming the step and path ("opendsec jail: bind /x: ...").
    pub fn enter_at_exec(self, cmd: &mut std::process::Command) {
        use std::os::unix::process::CommandExt;
        // SAFETY: the closure runs in the child between fork and exec, where only
        // async-signal-safe calls are allowed: it makes raw syscalls (unshare, mount,
        // mkdir, open, close, symlink, pivot_root, umount2, rmdir, chdir, setgroups,
        // setresgid, setresuid, prctl, write) on C strings and integers prepared in the
        // parent and moved in, and builds its error from errno without allocating.
        unsafe {
            cmd.pre_exec(move || self.enter());
        }
    }

    /// The child's side. Never allocates.
    fn enter(&self) -> io::Result<()> {
        let flags =
            libc::CLONE_NEWNS | libc::CLONE_NEWIPC | libc::CLONE_NEWUTS | libc::CLONE_NEWNET;
        // SAFETY: every call below is a raw syscall on NUL-terminated strings owned by
        // `self`, which outlives them, or on integers; see `enter_at_exec`.
        unsafe {
            // A session of its own: nothing of the edge's session (its terminal's signals,
            // SIGCONT that any member may send to another) reaches it, or it them.
            check(libc::setsid(), b"setsid", None)?;
            check(libc::unshare(flags), b"unshare", None)?;
            check(
                libc::mount(
                    std::ptr::null(),
                    self.slash.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REC | libc::MS_PRIVATE,
                    std::ptr::null(),
                ),
                b"make / private",
                None,
            )?;
            check(
                libc::mount(
                    self.tmpfs.as_ptr(),
                    self.root_c.as_ptr(),
                    self.tmpfs.as_ptr(),
                    libc::MS_NOSUID | libc::MS_NODEV,
                    self.tmpfs_opts.as_ptr().cast(),
                ),
                b"mount the root",
                Some(&self.root_c),
            )?;
            for s in &self.steps {
                match s {
                    Step::Mkdir(p) => {
                        if libc::mkdir(p.as_ptr(), 0o755) == -1
                            && io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST)
                        {
                            return fail(b"mkdir", Some(p));
                        }
                    }
                    Step::Touch(p) => {
                        let fd = libc::open(
                            p.as_ptr(),
                            libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC,
                            0o600,
                        );
                        check(fd, b"create", Some(p))?;
                        libc::close(fd);
                    }
                    Step::Bind {
                        src,
                        dst,
                        read_only,
                        device,
                    } => {
                        check(
                            libc::mount(
                                src.as_ptr(),
                                dst.as_ptr(),
                                std::ptr::null(),
                                // Not recursive: a mount below the path would keep its
                                // own flags (writable, suid) through the remount below.
                                libc::MS_BIND,
                                std::ptr::null(),
                            ),
                            b"bind",
                            Some(src),
                        )?;
                        let mut f = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID;
                        if *read_only {
                            f |= libc::MS_RDONLY;
                        }
                        if !*device {
                            f |= libc::MS_NODEV;
                        }
                        check(
                            libc::mount(
                                std::ptr::null(),
                                dst.as_ptr(),
                                std::ptr::null(),
                                f,
                                std::ptr::null(),
                            ),
                            b"remount",
                            Some(src),
                        )?;
                    }
                    Step::Symlink { target, at } => {
                        check(
                            libc::symlink(target.as_ptr(), at.as_ptr()),
                            b"symlink",
                            Some(at),
                        )?;
                    }
                }
            }
            check(
                libc::mkdir(self.old_in_root.as_ptr(), 0o700),
                b"mkdir",
                Some(&self.old_in_root),
            )?;
            check(
                libc::syscall(
                    libc::SYS_pivot_root,
                    self.root_c.as_ptr(),
                    self.old_in_root.as_ptr(),
                ) as i32,
                b"pivot_root",
                Some(&self.root_c),
            )?;
            check(
                libc::chdir(self.slash.as_ptr()),
                b"chdir",
                Some(&self.slash),
            )?;
            check(
                libc::umount2(self.old_after.as_ptr(), libc::MNT_DETACH),
                b"detach the host's tree",
                None,
            )?;
            check(
                libc::rmdir(self.old_after.as_ptr()),
                b"rmdir",
                Some(&self.old_after),
            )?;
            // The tmpfs itself read-only: nothing inside can add files beside the binds.
            check(
                libc::mount(
                    std::ptr::null(),
                    self.slash.as_ptr(),
                    std::ptr::null(),
                    libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV,
                    std::ptr::null(),
                ),
                b"remount / read-only",
                None,
            )?;
            check(libc::chdir(self.cwd.as_ptr()), b"chdir", Some(&self.cwd))?;
            check(
                libc::setgroups(self.groups.len(), self.groups.as_ptr()),
                b"setgroups",
                None,
            )?;
            check(
                libc::setresgid(self.gid, self.gid, self.gid),
                b"setresgid",
                None,
            )?;
            check(
                libc::setresuid(self.uid, self.uid, self.uid),
                b"setresuid",
                None,
            )?;
            // A session keyring of its own: the edge's (root's keys that its possessor may
            // read) is not QEMU's.
            check(
                libc::syscall(
                    libc::SYS_keyctl,
                    KEYCTL_JOIN_SESSION_KEYRING,
                    std::ptr::null::<libc::c_char>(),
                ) as i32,
                b"keyctl join session keyring",
                None,
            )?;
            if let Some(bytes) = self.file_size_limit {
                let lim = libc::rlimit {
                    rlim_cur: bytes,
                    rlim_max: bytes,
                };
                check(
                    libc::setrlimit(libc::RLIMIT_FSIZE, &lim),
                    b"setrlimit fsize",
                    None,
                )?;
            }
            check(
                libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0),
                b"no_new_privs",
                None,
            )?;
        }
        Ok(())
    }
}

/// keyctl(2)'s operation that joins a new anonymous session keyring (name NULL).
const KEYCTL_JOIN_SESSION_KEYRING: libc::c_long = 1;

/// `ret == -1`: the step's line on stderr, then errno. Async-signal-safe.
fn check(ret: i32, what: &[u8], path: Option<&CString>) -> io::Result<()> {
    if ret == -1 {
        fail(what, path)
    } else {
        Ok(())
    }
}

fn fail(what: &[u8], path: Option<&CString>) -> io::Result<()> {
    // Taken first: the writes below may change errno.
    let e = io::Error::last_os_error();
    let say = |b: &[u8]| {
        // SAFETY: write(2) of a borrowed buffer to fd 2; the result is ignored, as a
        // diagnostic that cannot be written changes nothing.
        unsafe {
            libc::write(2, b.as_ptr().cast(), b.len());
        }
    };
    say(b"opendsec jail: ");
    say(what);
    if let Some(p) = path {
        say(b" ");
        say(p.as_bytes());
    }
    say(b": failed\n");
    Err(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_that_could_leave_the_root_are_refused() {
        for bad in ["relative/x", "/a/../etc", "../x"] {
            assert!(
                matches!(Jail::new(Path::new(bad), 1, 1), Err(JailError::BadPath(_))),
                "{bad}"
            );
        }
        let mut j = Jail::new(Path::new("/tmp/j"), 1, 1).unwrap();
        assert!(matches!(
            j.bind(Path::new("/usr/../etc/shadow"), true),
            Err(JailError::BadPath(_))
        ));
        assert!(matches!(
            j.bind(Path::new("/no/such/file/here"), true),
            Err(JailError::Io { .. })
        ));
    }

    #[test]
    fn a_file_of_its_own_under_a_bound_directory_or_a_link_is_refused() {
        let mut j = Jail::new(Path::new("/j"), 1, 1).unwrap();
        j.bind(Path::new("/usr"), true).unwrap();
        j.symlink(Path::new("/lib"), Path::new("usr/lib")).unwrap();
        for p in ["/usr/bin/env", "/lib/x"] {
            assert!(
                matches!(j.bind_own(Path::new(p), false), Err(JailError::Covered(_))),
                "{p}"
            );
        }
        j.bind_own(Path::new("/dev/null"), true).unwrap();
    }

    #[test]
    fn parents_are_made_once_and_paths_under_a_bound_directory_are_not_bound_again() {
        let mut j = Jail::new(Path::new("/j"), 1, 1).unwrap();
        j.bind(Path::new("/usr"), true).unwrap();
        j.bind(Path::new("/usr/bin/env"), true).unwrap();
        j.symlink(Path::new("/lib"), Path::new("usr/lib")).unwrap();
        j.device(Path::new("/dev/null")).unwrap();
        let shown: Vec<String> = j
            .steps
            .iter()
            .map(|s| match s {
                Step::Mkdir(p) => format!("mkdir {}", p.to_string_lossy()),
                Step::Touch(p) => format!("touch {}", p.to_string_lossy()),
                Step::Bind {
                    src,
                    dst,
                    read_only,
                    device,
                } => format!(
                    "bind {} {} ro={read_only} dev={device}",
                    src.to_string_lossy(),
                    dst.to_string_lossy()
                ),
                Step::Symlink { target, at } => {
                    format!(
                        "symlink {} {}",
                        target.to_string_lossy(),
                        at.to_string_lossy()
                    )
                }
            })
            .collect();
        assert_eq!(
            shown,
            [
                "mkdir /j/usr",
                "bind /usr /j/usr ro=true dev=false",
                "symlink usr/lib /j/lib",
                "mkdir /j/dev",
                "touch /j/dev/null",
                "bind /dev/null /j/dev/null ro=false dev=true",
            ]
        );
    }
}
