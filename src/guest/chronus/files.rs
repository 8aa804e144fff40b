//! File calls, made by chronus as the session's user, relative paths resolved against the
//! shell's current directory (docs/python-sdk.md).

use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use super::meta;
use crate::guest::user;
use crate::pb;
use crate::types::{Failure, Reason};

/// Most bytes one ReadFile returns or one WriteFile takes.
pub const MAX_FILE_CALL: u64 = 64 << 20;

/// Resolves `p` against `cwd`. Errors: `invalid` for an empty path or one holding NUL.
pub fn resolve(cwd: &Path, p: &str) -> Result<PathBuf, Failure> {
    if p.is_empty() {
        return Err(Failure::invalid("path is empty"));
    }
    if p.contains('\0') {
        return Err(Failure::invalid("path holds NUL"));
    }
    let home = || HOME.get().map_or(Path::new("/"), PathBuf::as_path);
    if p == "~" {
        return Ok(home().to_path_buf());
    }
    if let Some(rest) = p.strip_prefix("~/") {
        return Ok(home().join(rest));
    }
    Ok(cwd.join(p))
}

/// The home directory of the user this chronus serves, which `~` names in paths.
static HOME: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// Sets what `~` means to [`resolve`]: the session user's home (once; later calls change
/// nothing, as a chronus serves one user).
pub fn set_home(home: &str) {
    let _ = HOME.set(PathBuf::from(if home.is_empty() { "/" } else { home }));
}

/// Maps an I/O error of `op` on `path` to its reason: ENOENT `not_found`, EACCES, EPERM
/// and EROFS `forbidden`, others `invalid`. A full disk (ENOSPC, EDQUOT) is `invalid` as
/// well, the sandbox's own limit and not the cluster's (`no_capacity` would tell the
/// caller to retry elsewhere): "no space left on the sandbox's disk (disk_mb N)", N being
/// `disk_mb` when known (not 0).
pub fn failure(op: &str, path: &Path, e: &std::io::Error, disk_mb: u64) -> Failure {
    let reason = match e.raw_os_error() {
        Some(libc::ENOENT) | Some(libc::ENOTDIR) => Reason::NotFound,
        Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => Reason::Forbidden,
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => {
            let limit = if disk_mb > 0 {
                format!(" (disk_mb {disk_mb})")
            } else {
                String::new()
            };
            return Failure::invalid(format!(
                "{op} {}: no space left on the sandbox's disk{limit}",
                path.display()
            ));
        }
        _ if e.kind() == std::io::ErrorKind::NotFound => Reason::NotFound,
        _ => Reason::Invalid,
    };
    Failure::new(
        reason,
        format!("{op} {}: {e}", path.display(), e = crate::types::chain(&e)),
    )
}

/// Opens `path` for reading without blocking on a FIFO or a device, and refuses what is
/// not a regular file or a directory: the type is taken from the opened descriptor (no
/// race with a rename), then blocking mode comes back for the reads. Errors: `invalid`
/// "not a regular file" (a FIFO, socket or device), the file system's.
fn open_regular(path: &Path) -> Result<(std::fs::File, std::fs::Metadata), Failure> {
    let not_regular = || {
        Failure::invalid(format!(
            "{} is not a regular file (a FIFO, socket or device): read_file reads files",
            path.display()
        ))
    };
    let f = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)
    {
        Ok(f) => f,
        // A unix socket cannot be opened at all.
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => return Err(not_regular()),
        Err(e) => return Err(failure("open", path, &e, 0)),
    };
    let m = f.metadata().map_err(|e| failure("stat", path, &e, 0))?;
    if !(m.is_file() || m.is_dir()) {
        return Err(not_regular());
    }
    nix::fcntl::fcntl(
        &f,
        nix::fcntl::FcntlArg::F_SETFL(nix::fcntl::OFlag::empty()),
    )
    .map_err(|e| failure("fcntl", path, &std::io::Error::from(e), 0))?;
    Ok((f, m))
}

/// Describes `path` from its (not followed) metadata: owner and group by name
/// ([`user::names`]), a symlink's target, the file's metadata ([`meta::read`]).
pub fn info(path: &Path, m: &std::fs::Metadata) -> pb::FileInfo {
    let ft = m.file_type();
    let kind = if ft.is_symlink() {
        "symlink"
    } else if ft.is_dir() {
        "dir"
    } else if ft.is_file() {
        "file"
    } else {
        "other"
    };
    let names = user::names();
    let (symlink_target, metadata) = if ft.is_symlink() {
        let target = std::fs::read_link(path)
            .map(|t| t.to_string_lossy().into_owned())
            .unwrap_or_default();
        (target, Default::default())
    } else if ft.is_file() || ft.is_dir() {
        (String::new(), meta::read(path))
    } else {
        // Devices, FIFOs and sockets keep no user attributes.
        (String::new(), Default::default())
    };
    pb::FileInfo {
        name: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.to_string_lossy().into_owned()),
        r#type: kind.to_string(),
        size: m.len() as i64,
        mode: m.mode() & 0o7777,
        mtime: m.mtime(),
        path: path.to_string_lossy().into_owned(),
        owner: names.user(m.uid()),
        group: names.group(m.gid()),
        symlink_target,
        metadata,
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Failure> + Send + 'static,
) -> Result<T, Failure> {
    tokio::task::spawn_blocking(f).await.map_err(|e| {
        Failure::internal(format!(
            "file call failed: {e}",
            e = crate::types::chain(&e)
        ))
    })?
}

/// ReadFile: `length` bytes from `offset` (0 = to the end); empty past the end.
/// Errors: `invalid` for negative numbers, a length over 64 MiB, or more than 64 MiB left
/// to the end with length 0 (read in pieces); the file system's, mapped by [`failure`].
pub async fn read(cwd: PathBuf, req: pb::ReadFileRequest) -> Result<pb::ReadFileResponse, Failure> {
    if req.offset < 0 || req.length < 0 {
        return Err(Failure::invalid("offset and length must be >= 0"));
    }
    if req.length as u64 > MAX_FILE_CALL {
        return Err(Failure::invalid(format!(
            "length {} is over the {} bytes one read_file returns: read in pieces with offset and length",
            req.length, MAX_FILE_CALL
        )));
    }
    let path = resolve(&cwd, &req.path)?;
    blocking(move || {
        let (f, m) = open_regular(&path)?;
        if m.is_dir() {
            return Err(Failure::invalid(format!(
                "{} is a directory",
                path.display()
            )));
        }
        let offset = req.offset as u64;
        if m.len() == 0 {
            // /proc and other files that report no size: read what comes.
            let mut data = Vec::new();
            let mut r = std::io::BufReader::new(f);
            std::io::copy(&mut (&mut r).take(offset), &mut std::io::sink())
                .map_err(|e| failure("read", &path, &e, 0))?;
            let cap = if req.length == 0 {
                MAX_FILE_CALL + 1
            } else {
                req.length as u64
            };
            r.take(cap)
                .read_to_end(&mut data)
                .map_err(|e| failure("read", &path, &e, 0))?;
            if data.len() as u64 > MAX_FILE_CALL {
                return Err(too_big(&path));
            }
            return Ok(pb::ReadFileResponse { data });
        }
        if offset >= m.len() {
            return Ok(pb::ReadFileResponse { data: vec![] });
        }
        let left = m.len() - offset;
        let want = if req.length == 0 {
            if left > MAX_FILE_CALL {
                return Err(too_big(&path));
            }
            left
        } else {
            left.min(req.length as u64)
        };
        let mut data = vec![0u8; want as usize];
        let mut got = 0usize;
        while let Some(rest) = data.get_mut(got..).filter(|r| !r.is_empty()) {
            match f.read_at(rest, offset + got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(failure("read", &path, &e, 0)),
            }
        }
        data.truncate(got);
        Ok(pb::ReadFileResponse { data })
    })
    .await
}

fn too_big(path: &Path) -> Failure {
    Failure::invalid(format!(
        "{} has more than {MAX_FILE_CALL} bytes to read: read it in pieces with offset and length",
        path.display()
    ))
}

/// WriteFile: creates or truncates (or appends to) the file, or with `offset` > 0 writes
/// the data at that offset keeping the rest (one chunk of a larger write: repeating it
/// changes nothing, so it can be retried); a new file gets `mode`, 0 meaning 0644; a
/// non-zero `mode` is also applied to an existing file. With `set_metadata` the file's
/// metadata becomes `metadata` once the data is written ([`meta::replace`]). The parent
/// must exist. Errors: `invalid` for data over 64 MiB, a negative offset, an offset with
/// `append`, metadata [`meta::check`] refuses or the file system cannot keep, a path
/// that is not a regular file (a FIFO, socket or device: refused at once), a full
/// disk (see [`failure`]; `disk_mb` is the sandbox's, 0 if unknown); the file system's (a
/// missing parent is `not_found`).
pub async fn write(
    cwd: PathBuf,
    disk_mb: u64,
    req: pb::WriteFileRequest,
) -> Result<pb::FileInfo, Failure> {
    if req.data.len() as u64 > MAX_FILE_CALL {
        return Err(Failure::invalid(format!(
            "{} bytes is over the {MAX_FILE_CALL} bytes one write_file takes: write in pieces with offset",
            req.data.len()
        )));
    }
    if req.offset < 0 {
        return Err(Failure::invalid(format!(
            "offset {} must be >= 0",
            req.offset
        )));
    }
    if req.offset > 0 && req.append {
        return Err(Failure::invalid(
            "offset and append exclude each other: append writes at the end",
        ));
    }
    if req.set_metadata {
        meta::check(&req.metadata).map_err(|e| Failure::invalid(e.to_string()))?;
    }
    let path = resolve(&cwd, &req.path)?;
    blocking(move || {
        let fail = |op: &str, e: &std::io::Error| failure(op, &path, e, disk_mb);
        let mode = if req.mode == 0 {
            0o644
        } else {
            req.mode & 0o7777
        };
        let not_regular = || {
            Failure::invalid(format!(
                "{} is not a regular file (a FIFO, socket or device): write_file writes files",
                path.display()
            ))
        };
        let mut o = std::fs::OpenOptions::new();
        // Non-blocking open: a FIFO without a reader would block the call (and a thread of
        // chronus) forever; with one, it is refused below.
        o.write(true)
            .create(true)
            .mode(mode)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY);
        if req.append {
            o.append(true);
        } else if req.offset == 0 {
            o.truncate(true);
        }
        let mut f = match o.open(&path) {
            Ok(f) => f,
            // A FIFO without a reader, or a unix socket.
            Err(e) if e.raw_os_error() == Some(libc::ENXIO) => return Err(not_regular()),
            Err(e) => return Err(fail("open", &e)),
        };
        if !f.metadata().map_err(|e| fail("stat", &e))?.is_file() {
            return Err(not_regular());
        }
        nix::fcntl::fcntl(
            &f,
            nix::fcntl::FcntlArg::F_SETFL(if req.append {
                nix::fcntl::OFlag::O_APPEND
            } else {
                nix::fcntl::OFlag::empty()
            }),
        )
        .map_err(|e| fail("fcntl", &std::io::Error::from(e)))?;
        let written = if req.offset > 0 {
            f.write_all_at(&req.data, req.offset as u64)
        } else {
            f.write_all(&req.data)
        };
        written.map_err(|e| fail("write", &e))?;
        if req.mode != 0 {
            f.set_permissions(std::fs::Permissions::from_mode(mode))
                .map_err(|e| fail("chmod", &e))?;
        }
        if req.set_metadata {
            meta::replace(&f, &path, &req.metadata)?;
        }
        let m = f.metadata().map_err(|e| fail("stat", &e))?;
        Ok(info(&path, &m))
    })
    .await
}

/// ListDir: the entries of a directory, by name. Errors: `invalid` for a path that is
/// not a directory; the file system's.
pub async fn list(cwd: PathBuf, req: pb::PathRequest) -> Result<pb::ListDirResponse, Failure> {
    let path = resolve(&cwd, &req.path)?;
    blocking(move || {
        if std::fs::metadata(&path).is_ok_and(|m| !m.is_dir()) {
            return Err(Failure::invalid(format!(
                "{} is not a directory",
                path.display()
            )));
        }
        let rd = std::fs::read_dir(&path).map_err(|e| failure("list", &path, &e, 0))?;
        let mut entries = Vec::new();
        for e in rd {
            let e = e.map_err(|e| failure("list", &path, &e, 0))?;
            let p = e.path();
            // An entry removed meanwhile is skipped.
            if let Ok(m) = std::fs::symlink_metadata(&p) {
                entries.push(info(&p, &m));
            }
        }
        entries.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(pb::ListDirResponse { entries })
    })
    .await
}

/// Stat: the path's information (a symlink is described, not followed).
/// Errors: the file system's.
pub async fn stat(cwd: PathBuf, req: pb::PathRequest) -> Result<pb::FileInfo, Failure> {
    let path = resolve(&cwd, &req.path)?;
    blocking(move || {
        let m = std::fs::symlink_metadata(&path).map_err(|e| failure("stat", &path, &e, 0))?;
        Ok(info(&path, &m))
    })
    .await
}

/// MakeDir: the directory and its missing parents (mode 0755 before the umask).
/// Errors: `conflict` when the directory already exists (E2B's `make_dir` reports false),
/// `invalid` when something else is there; the file system's.
pub async fn make_dir(cwd: PathBuf, req: pb::PathRequest) -> Result<pb::FileInfo, Failure> {
    let path = resolve(&cwd, &req.path)?;
    blocking(move || {
        if let Ok(m) = std::fs::metadata(&path) {
            if !m.is_dir() {
                return Err(Failure::invalid(format!(
                    "{} already exists and is not a directory",
                    path.display()
                )));
            }
            return Err(Failure::conflict(format!(
                "{} already exists",
                path.display()
            )));
        }
        if std::fs::symlink_metadata(&path).is_ok() {
            return Err(Failure::invalid(format!(
                "{} is a symlink to nothing",
                path.display()
            )));
        }
        std::fs::create_dir_all(&path).map_err(|e| failure("mkdir", &path, &e, 0))?;
        let m = std::fs::symlink_metadata(&path).map_err(|e| failure("stat", &path, &e, 0))?;
        Ok(info(&path, &m))
    })
    .await
}

/// Move: renames `source` to `destination` (replacing a file there, as rename(2) does),
/// creating the destination's missing parents. Errors: the file system's (a missing source
/// is `not_found`; across file systems, `invalid`).
pub async fn rename(cwd: PathBuf, req: pb::MoveRequest) -> Result<pb::FileInfo, Failure> {
    let from = resolve(&cwd, &req.source)?;
    let to = resolve(&cwd, &req.destination)?;
    blocking(move || {
        std::fs::symlink_metadata(&from).map_err(|e| failure("move", &from, &e, 0))?;
        if let Some(parent) = to.parent() {
            std::fs::create_dir_all(parent).map_err(|e| failure("mkdir", parent, &e, 0))?;
        }
        std::fs::rename(&from, &to).map_err(|e| failure("move", &to, &e, 0))?;
        let m = std::fs::symlink_metadata(&to).map_err(|e| failure("stat", &to, &e, 0))?;
        Ok(info(&to, &m))
    })
    .await
}

/// Remove: a file or symlink, an empty directory, or (`recursive`) a whole tree.
/// Errors: the file system's (a non-empty directory without `recursive` is `invalid`).
pub async fn remove(cwd: PathBuf, req: pb::RemoveRequest) -> Result<pb::Empty, Failure> {
    let path = resolve(&cwd, &req.path)?;
    blocking(move || {
        let m = std::fs::symlink_metadata(&path).map_err(|e| failure("remove", &path, &e, 0))?;
        let r = if m.is_dir() {
            if req.recursive {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_dir(&path)
            }
        } else {
            std::fs::remove_file(&path)
        };
        r.map_err(|e| failure("remove", &path, &e, 0))?;
        Ok(pb::Empty {})
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tilde_is_the_home_and_relative_paths_start_from_cwd() {
        set_home("/home/t");
        let cwd = Path::new("/work");
        assert_eq!(resolve(cwd, "~").unwrap(), PathBuf::from("/home/t"));
        assert_eq!(resolve(cwd, "~/a/b").unwrap(), PathBuf::from("/home/t/a/b"));
        assert_eq!(resolve(cwd, "a/~").unwrap(), PathBuf::from("/work/a/~"));
        assert_eq!(resolve(cwd, "~x").unwrap(), PathBuf::from("/work/~x"));
        assert_eq!(resolve(cwd, "/abs").unwrap(), PathBuf::from("/abs"));
        assert!(resolve(cwd, "").is_err());
    }

    #[tokio::test]
    async fn listing_a_file_and_making_a_directory_where_a_file_is_are_invalid() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("f");
        std::fs::write(&f, b"x").unwrap();
        let req = |p: &Path| pb::PathRequest {
            path: p.display().to_string(),
            ..Default::default()
        };
        let cwd = d.path().to_path_buf();
        let e = list(cwd.clone(), req(&f)).await.unwrap_err();
        assert_eq!(e.reason, Reason::Invalid, "{e:?}");
        let e = make_dir(cwd.clone(), req(&f)).await.unwrap_err();
        assert_eq!(e.reason, Reason::Invalid, "{e:?}");
        let e = make_dir(cwd.clone(), req(d.path())).await.unwrap_err();
        assert_eq!(e.reason, Reason::Conflict, "{e:?}");
    }

    #[test]
    fn errors_map_to_reasons() {
        let p = Path::new("/x");
        let f = |n| failure("op", p, &std::io::Error::from_raw_os_error(n), 0).reason;
        assert_eq!(f(libc::ENOENT), Reason::NotFound);
        assert_eq!(f(libc::EACCES), Reason::Forbidden);
        assert_eq!(f(libc::EPERM), Reason::Forbidden);
        assert_eq!(f(libc::EROFS), Reason::Forbidden);
        assert_eq!(f(libc::ENOSPC), Reason::Invalid);
        assert_eq!(f(libc::EDQUOT), Reason::Invalid);
        let full = failure(
            "write",
            p,
            &std::io::Error::from_raw_os_error(libc::ENOSPC),
            256,
        );
        assert_eq!(full.reason, Reason::Invalid);
        assert!(
            full.message
                .contains("no space left on the sandbox's disk (disk_mb 256)"),
            "{full:?}"
        );
        assert_eq!(f(libc::EISDIR), Reason::Invalid);
    }

    #[tokio::test]
    async fn make_dir_makes_parents_once_and_move_makes_the_destination_parents() {
        let d = tempfile::tempdir().expect("tempdir");
        let cwd = d.path().to_path_buf();
        let p = |path: &str| pb::PathRequest {
            path: path.into(),
            ..Default::default()
        };
        let i = make_dir(cwd.clone(), p("a/b/c")).await.expect("mkdir");
        assert_eq!((i.name.as_str(), i.r#type.as_str()), ("c", "dir"));
        assert!(d.path().join("a/b/c").is_dir());
        let e = make_dir(cwd.clone(), p("a/b")).await.expect_err("exists");
        assert_eq!(e.reason, Reason::Conflict);
        std::fs::write(d.path().join("a/f"), b"x").expect("write");
        let mv = |from: &str, to: &str| pb::MoveRequest {
            source: from.into(),
            destination: to.into(),
            ..Default::default()
        };
        let i = rename(cwd.clone(), mv("a/f", "x/y/g")).await.expect("move");
        assert_eq!((i.name.as_str(), i.size), ("g", 1));
        assert_eq!(std::fs::read(d.path().join("x/y/g")).expect("read"), b"x");
        assert!(!d.path().join("a/f").exists());
        let e = rename(cwd.clone(), mv("a/f", "z")).await.expect_err("gone");
        assert_eq!(e.reason, Reason::NotFound);
    }

    #[tokio::test]
    async fn write_read_list_stat_remove() {
        let d = tempfile::tempdir().expect("tempdir");
        let cwd = d.path().to_path_buf();
        let w = |path: &str, data: &[u8], append: bool| pb::WriteFileRequest {
            path: path.into(),
            data: data.to_vec(),
            append,
            ..Default::default()
        };
        let i = write(cwd.clone(), 0, w("a.txt", b"hello", false))
            .await
            .expect("write");
        assert_eq!((i.size, i.mode, i.r#type.as_str()), (5, 0o644, "file"));
        write(cwd.clone(), 0, w("a.txt", b" world", true))
            .await
            .expect("append");
        let r = read(
            cwd.clone(),
            pb::ReadFileRequest {
                path: "a.txt".into(),
                offset: 6,
                length: 3,
                ..Default::default()
            },
        )
        .await
        .expect("read");
        assert_eq!(r.data, b"wor");
        let past = read(
            cwd.clone(),
            pb::ReadFileRequest {
                path: "a.txt".into(),
                offset: 100,
                ..Default::default()
            },
        )
        .await
        .expect("read");
        assert!(past.data.is_empty());
        let e = write(cwd.clone(), 0, w("no/such/b", b"", false))
            .await
            .expect_err("parent");
        assert_eq!(e.reason, Reason::NotFound);
        std::fs::create_dir(d.path().join("sub")).expect("mkdir");
        let l = list(
            cwd.clone(),
            pb::PathRequest {
                path: ".".into(),
                ..Default::default()
            },
        )
        .await
        .expect("list");
        let names: Vec<_> = l.entries.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["a.txt", "sub"]);
        let s = stat(
            cwd.clone(),
            pb::PathRequest {
                path: "sub".into(),
                ..Default::default()
            },
        )
        .await
        .expect("stat");
        assert_eq!(s.r#type, "dir");
        let rm = |p: &str, recursive| pb::RemoveRequest {
            path: p.into(),
            recursive,
            ..Default::default()
        };
        std::fs::write(d.path().join("sub/x"), b"x").expect("write");
        assert_eq!(
            remove(cwd.clone(), rm("sub", false))
                .await
                .expect_err("not empty")
                .reason,
            Reason::Invalid
        );
        remove(cwd.clone(), rm("sub", true)).await.expect("rm -r");
        remove(cwd.clone(), rm("a.txt", false)).await.expect("rm");
        assert_eq!(
            stat(
                cwd,
                pb::PathRequest {
                    path: "a.txt".into(),
                    ..Default::default()
                }
            )
            .await
            .expect_err("gone")
            .reason,
            Reason::NotFound
        );
    }

    #[tokio::test]
    async fn metadata_owner_and_link_targets_are_described() {
        let d = tempfile::tempdir().expect("tempdir");
        let cwd = d.path().to_path_buf();
        let w = |data: &[u8], meta: Option<&[(&str, &str)]>| pb::WriteFileRequest {
            path: "m.txt".into(),
            data: data.to_vec(),
            set_metadata: meta.is_some(),
            metadata: meta
                .unwrap_or_default()
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ..Default::default()
        };
        let st = |p: &str| {
            stat(
                cwd.clone(),
                pb::PathRequest {
                    path: p.into(),
                    ..Default::default()
                },
            )
        };
        let i = write(
            cwd.clone(),
            0,
            w(b"1", Some(&[("kind", "report"), ("v", "1")])),
        )
        .await
        .expect("write");
        assert_eq!(i.metadata.get("kind").map(String::as_str), Some("report"));
        assert_eq!(i.metadata.len(), 2);
        // The tests run as root, and root is uid 0's first name everywhere.
        assert_eq!((i.owner.as_str(), i.group.as_str()), ("root", "root"));
        // A write without metadata keeps it; one with metadata replaces all of it.
        write(cwd.clone(), 0, w(b"2", None)).await.expect("write");
        assert_eq!(st("m.txt").await.expect("stat").metadata.len(), 2);
        write(cwd.clone(), 0, w(b"3", Some(&[("v", "2")])))
            .await
            .expect("write");
        let m = st("m.txt").await.expect("stat").metadata;
        assert_eq!(
            m.into_iter().collect::<Vec<_>>(),
            [("v".to_string(), "2".to_string())]
        );
        // A bad key is refused before anything is written.
        let e = write(cwd.clone(), 0, w(b"4", Some(&[("a b", "x")])))
            .await
            .expect_err("bad key");
        assert_eq!(e.reason, Reason::Invalid);
        assert!(e.message.contains("metadata key"), "{e:?}");
        assert_eq!(std::fs::read(d.path().join("m.txt")).expect("read"), b"3");
        write(cwd.clone(), 0, w(b"5", Some(&[])))
            .await
            .expect("write");
        assert!(st("m.txt").await.expect("stat").metadata.is_empty());
        std::os::unix::fs::symlink("m.txt", d.path().join("l")).expect("symlink");
        let l = st("l").await.expect("stat");
        assert_eq!(
            (l.r#type.as_str(), l.symlink_target.as_str()),
            ("symlink", "m.txt")
        );
        assert!(st("m.txt").await.expect("stat").symlink_target.is_empty());
    }

    fn rd(path: &str) -> pb::ReadFileRequest {
        pb::ReadFileRequest {
            path: path.into(),
            ..Default::default()
        }
    }

    /// Without the check a FIFO with no writer blocks the read for ever, and so the call.
    #[tokio::test]
    async fn fifos_sockets_and_devices_are_not_read() {
        let d = tempfile::tempdir().expect("tempdir");
        let cwd = d.path().to_path_buf();
        nix::unistd::mkfifo(
            &d.path().join("fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o644),
        )
        .expect("mkfifo");
        let _sock = std::os::unix::net::UnixListener::bind(d.path().join("sock")).expect("bind");
        for p in ["fifo", "sock", "/dev/null", "/dev/zero"] {
            let r =
                tokio::time::timeout(std::time::Duration::from_secs(10), read(cwd.clone(), rd(p)))
                    .await
                    .unwrap_or_else(|_| panic!("read_file of {p} blocked"));
            let e = r.expect_err(p);
            assert_eq!(e.reason, Reason::Invalid, "{p}: {e:?}");
            assert!(e.message.contains("not a regular file"), "{p}: {e:?}");
        }
        // /proc files report no size and still read.
        let r = read(cwd.clone(), rd("/proc/self/status"))
            .await
            .expect("proc");
        assert!(r.data.starts_with(b"Name:"));
        // Nor written: without a reader, a FIFO's open would block the call for ever, and
        // with one the data would go to whoever reads it.
        let wr = |p: &str| pb::WriteFileRequest {
            path: p.into(),
            data: b"x".to_vec(),
            ..Default::default()
        };
        let refused = |p: &'static str| {
            let cwd = cwd.clone();
            async move {
                let r =
                    tokio::time::timeout(std::time::Duration::from_secs(10), write(cwd, 0, wr(p)))
                        .await
                        .unwrap_or_else(|_| panic!("write_file of {p} blocked"));
                let e = r.expect_err(p);
                assert_eq!(e.reason, Reason::Invalid, "{p}: {e:?}");
                assert!(e.message.contains("not a regular file"), "{p}: {e:?}");
            }
        };
        for p in ["fifo", "sock", "/dev/null"] {
            refused(p).await;
        }
        let _reader = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(d.path().join("fifo"))
            .expect("reader");
        refused("fifo").await;
    }

    #[tokio::test]
    async fn a_write_at_an_offset_keeps_the_rest_and_can_be_repeated() {
        let d = tempfile::tempdir().expect("tempdir");
        let cwd = d.path().to_path_buf();
        let w = |data: &[u8], offset: i64, append: bool| pb::WriteFileRequest {
            path: "f".into(),
            data: data.to_vec(),
            offset,
            append,
            ..Default::default()
        };
        write(cwd.clone(), 0, w(b"0123456789", 0, false))
            .await
            .expect("first");
        for _ in 0..2 {
            let i = write(cwd.clone(), 0, w(b"ab", 4, false))
                .await
                .expect("chunk");
            assert_eq!(i.size, 10);
        }
        let i = write(cwd.clone(), 0, w(b"xyz", 10, false))
            .await
            .expect("tail");
        assert_eq!(i.size, 13);
        assert_eq!(
            std::fs::read(d.path().join("f")).expect("read"),
            b"0123ab6789xyz"
        );
        for bad in [w(b"x", -1, false), w(b"x", 3, true)] {
            let e = write(cwd.clone(), 0, bad).await.expect_err("bad");
            assert_eq!(e.reason, Reason::Invalid);
        }
    }
}
