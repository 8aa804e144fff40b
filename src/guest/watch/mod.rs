//! Directory watches for the file API (docs/python-sdk.md "Watching a directory"), held by aether,
//! so a watch outlives sessions and the sandbox's own processes, root included, cannot reach
//! it. Events are named relative to the watched directory and typed the way E2B's envd types
//! them (fsnotify's reading of inotify's masks), since E2B's SDKs are the main callers.
//!
//! All of a sandbox's watches share one inotify instance ([`hub::Hub`]): sandboxes run as
//! the host's uid 0, whose inotify instances (`fs.inotify.max_user_instances`, 128 by
//! default) the whole machine shares, so a sandbox takes one however many watches it has.
//! [`registry::Watchers`] is the face aether serves: streams, kept watchers, and their
//! number.

pub mod hub;
pub mod registry;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::errno::Errno;
use nix::sys::inotify::{AddWatchFlags, Inotify, WatchDescriptor};

use crate::types::{Failure, Reason};

/// Most directories one watch covers, and most a sandbox's watches cover together (each an
/// inotify mark: kernel memory, and a share of the host root's `fs.inotify.max_user_watches`).
pub const MAX_DIRS: usize = 16_384;
pub const MAX_MARKS: usize = 32_768;

/// What each directory is watched for. `IN_CLOSE_WRITE` is left out as envd leaves it out:
/// a write is `IN_MODIFY`.
const MASK: AddWatchFlags = AddWatchFlags::IN_CREATE
    .union(AddWatchFlags::IN_MODIFY)
    .union(AddWatchFlags::IN_DELETE)
    .union(AddWatchFlags::IN_MOVED_FROM)
    .union(AddWatchFlags::IN_MOVED_TO)
    .union(AddWatchFlags::IN_ATTRIB)
    .union(AddWatchFlags::IN_DELETE_SELF)
    .union(AddWatchFlags::IN_MOVE_SELF)
    .union(AddWatchFlags::IN_ONLYDIR);

/// File system types whose changes made elsewhere inotify never sees (`statfs`' `f_type`):
/// NFS, SMB, CIFS, SMB2, Ceph and FUSE (sshfs and kin), E2B's list.
const NETWORK_FS: [(i64, &str); 6] = [
    (0x6969, "nfs"),
    (0x517b, "smb"),
    (0xff53_4d42, "cifs"),
    (0xfe53_4d42, "smb2"),
    (0x00c3_6400, "ceph"),
    (0x6573_5546, "fuse"),
];

/// Why a watch could not be set or went on no longer.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    #[error("{0} does not exist")]
    NotFound(PathBuf),
    #[error("{0} is not a directory")]
    NotADirectory(PathBuf),
    #[error("{0}: the session's user may not list it")]
    Forbidden(PathBuf),
    #[error("{path} is on a network file system ({fs}), where changes made elsewhere are not seen; allow_network_mounts watches it anyway")]
    NetworkMount { path: PathBuf, fs: &'static str },
    #[error("{path} has more than {MAX_DIRS} directories below it; watch a smaller tree")]
    TooManyDirs { path: PathBuf },
    #[error("the sandbox's watches cover {MAX_MARKS} directories, their most; stop one first")]
    TooManyMarks,
    #[error("the machine's inotify limit is reached ({what})")]
    Limit { what: &'static str },
    #[error("watching {path}: {source}")]
    Io { path: PathBuf, source: Errno },
    #[error("changes came faster than they were read, so some were lost; watch again")]
    Overflow,
}

impl WatchError {
    /// The reason callers get: `not_found`; `invalid` (not a directory); `forbidden` (the
    /// user may not list it); `conflict` (a
    /// network mount, which `allow_network_mounts` allows: E2B's failed precondition);
    /// `quota_exceeded` (too big a tree, the sandbox's or the kernel's limits);
    /// `unavailable` (events lost: watching again is the remedy); `internal` otherwise.
    pub fn failure(&self) -> Failure {
        let reason = match self {
            WatchError::NotFound(_) => Reason::NotFound,
            WatchError::NotADirectory(_) => Reason::Invalid,
            WatchError::Forbidden(_) => Reason::Forbidden,
            WatchError::NetworkMount { .. } => Reason::Conflict,
            WatchError::TooManyDirs { .. }
            | WatchError::TooManyMarks
            | WatchError::Limit { .. } => Reason::QuotaExceeded,
            WatchError::Overflow => Reason::Unavailable,
            WatchError::Io { .. } => Reason::Internal,
        };
        Failure::new(reason, self.to_string())
    }

    fn io(path: &Path, e: Errno) -> WatchError {
        match e {
            Errno::ENOENT => WatchError::NotFound(path.to_path_buf()),
            Errno::ENOTDIR => WatchError::NotADirectory(path.to_path_buf()),
            Errno::ENOSPC => WatchError::Limit {
                what: "fs.inotify.max_user_watches",
            },
            Errno::EMFILE => WatchError::Limit {
                what: "fs.inotify.max_user_instances",
            },
            e => WatchError::Io {
                path: path.to_path_buf(),
                source: e,
            },
        }
    }

    fn of_io(path: &Path, e: &std::io::Error) -> WatchError {
        WatchError::io(path, Errno::from_raw(e.raw_os_error().unwrap_or(libc::EIO)))
    }
}

/// What a watch covers and carries.
#[derive(Debug, Clone, Default)]
pub struct Options {
    pub recursive: bool,
    pub include_entry: bool,
    pub allow_network_mounts: bool,
    /// Whose permissions the watch keeps to; `None` for root, who lists everything.
    pub access: Option<Arc<Access>>,
}

/// A user's right to list directories, which a watch on their behalf keeps to: aether
/// watches as root, so it checks what the kernel would have checked for the user. By the
/// mode bits (owner, group, others), as for a process without capabilities; ACLs are not
/// read, so an ACL that grants more than the bits is not honoured (never the reverse in
/// the common case: the group bits carry an ACL's mask).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Access {
    pub uid: u32,
    pub gid: u32,
    pub groups: Vec<u32>,
}

impl Access {
    /// Whether the user may read and search the directory `m` describes.
    pub fn may_list(&self, m: &std::fs::Metadata) -> bool {
        use std::os::unix::fs::MetadataExt;
        let mode = m.mode();
        let bits = if m.uid() == self.uid {
            mode >> 6
        } else if m.gid() == self.gid || self.groups.contains(&m.gid()) {
            mode >> 3
        } else {
            mode
        };
        bits & 0o5 == 0o5
    }
}

/// Checks that `root` can be watched with `opts`: a directory (a symlink to one is
/// followed, as envd follows it) the user may list, not on a network file system unless
/// allowed. Blocking. Errors: `NotFound`, `NotADirectory`, `Forbidden`, `NetworkMount`.
fn check_root(root: &Path, opts: &Options) -> Result<(), WatchError> {
    let meta = std::fs::metadata(root).map_err(|e| WatchError::of_io(root, &e))?;
    if !meta.is_dir() {
        return Err(WatchError::NotADirectory(root.to_path_buf()));
    }
    if opts.access.as_ref().is_some_and(|a| !a.may_list(&meta)) {
        return Err(WatchError::Forbidden(root.to_path_buf()));
    }
    if !opts.allow_network_mounts {
        if let Some(fs) = network_fs(root) {
            return Err(WatchError::NetworkMount {
                path: root.to_path_buf(),
                fs,
            });
        }
    }
    Ok(())
}

/// Marks on the directories found below `root/rel` (not `rel` itself), at most `room` of
/// them: each as (descriptor, path relative to `root`), and every entry met (relative to
/// `root`, for reporting what a new directory already held). Symlinks are not followed; a
/// directory gone meanwhile, or one `access` may not list, is skipped (its name is still
/// met: the user sees it in its parent). Blocking. Errors: `TooManyDirs` past `room` (the
/// marks added so far are returned with it, for the caller to give back), `Limit`.
struct Walked {
    dirs: Vec<(WatchDescriptor, PathBuf)>,
    found: Vec<PathBuf>,
    error: Option<WatchError>,
}

fn walk(ino: &Inotify, root: &Path, rel: &Path, room: usize, access: Option<&Access>) -> Walked {
    let mut w = Walked {
        dirs: Vec::new(),
        found: Vec::new(),
        error: None,
    };
    let mut stack = vec![rel.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(root.join(&dir)) else {
            continue;
        };
        for entry in entries.flatten() {
            let child = dir.join(entry.file_name());
            w.found.push(child.clone());
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            if let Some(a) = access {
                if !entry.metadata().is_ok_and(|m| a.may_list(&m)) {
                    continue;
                }
            }
            if w.dirs.len() >= room {
                w.error = Some(WatchError::TooManyDirs {
                    path: root.to_path_buf(),
                });
                return w;
            }
            match ino.add_watch(&root.join(&child), MASK | AddWatchFlags::IN_DONT_FOLLOW) {
                Ok(wd) => {
                    w.dirs.push((wd, child.clone()));
                    stack.push(child);
                }
                Err(e @ (Errno::ENOSPC | Errno::EMFILE)) => {
                    w.error = Some(WatchError::io(root, e));
                    return w;
                }
                // Gone or replaced by a file since it was listed.
                Err(_) => {}
            }
        }
    }
    w
}

/// envd's event types for an inotify mask, in envd's order (one inotify event can be
/// several: a file made and written before the read).
fn kinds(mask: AddWatchFlags) -> Vec<&'static str> {
    let has = |f: AddWatchFlags| mask.intersects(f);
    let mut out = Vec::new();
    if has(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO) {
        out.push("create");
    }
    if has(AddWatchFlags::IN_MOVE_SELF | AddWatchFlags::IN_MOVED_FROM) {
        out.push("rename");
    }
    if has(AddWatchFlags::IN_ATTRIB) {
        out.push("chmod");
    }
    if has(AddWatchFlags::IN_MODIFY) {
        out.push("write");
    }
    if has(AddWatchFlags::IN_DELETE | AddWatchFlags::IN_DELETE_SELF) {
        out.push("remove");
    }
    out
}

/// The network file system `path` is on, if it is on one.
fn network_fs(path: &Path) -> Option<&'static str> {
    let st = nix::sys::statfs::statfs(path).ok()?;
    let t = st.filesystem_type().0 as i64;
    NETWORK_FS
        .iter()
        .find(|(magic, _)| *magic == t)
        .map(|(_, name)| *name)
}

#[cfg(test)]
mod tests;
