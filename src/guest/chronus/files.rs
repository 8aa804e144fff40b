//! File calls, made by chronus as the session's user, relative paths resolved against the
//! shell's current directory (09-python-sdk "Files").

use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

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
    Ok(cwd.join(p))
}

/// Maps an I/O error of `op` on `path` to its reason: ENOENT `not_found`, EACCES, EPERM
/// and EROFS `forbidden`, ENOSPC and EDQUOT `no_capacity`, others `invalid`.
pub fn failure(op: &str, path: &Path, e: &std::io::Error) -> Failure {
    let reason = match e.raw_os_error() {
        Some(libc::ENOENT) | Some(libc::ENOTDIR) => Reason::NotFound,
        Some(libc::EACCES) | Some(libc::EPERM) | Some(libc::EROFS) => Reason::Forbidden,
        Some(libc::ENOSPC) | Some(libc::EDQUOT) => Reason::NoCapacity,
        _ if e.kind() == std::io::ErrorKind::NotFound => Reason::NotFound,
        _ => Reason::Invalid,
    };
    Failure::new(reason, format!("{op} {}: {e}", path.display()))
}

/// Describes `path` from its (not followed) metadata.
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
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, Failure> + Send + 'static,
) -> Result<T, Failure> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Failure::internal(format!("file call failed: {e}")))?
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
        let f = std::fs::File::open(&path).map_err(|e| failure("open", &path, &e))?;
        let m = f.metadata().map_err(|e| failure("stat", &path, &e))?;
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
                .map_err(|e| failure("read", &path, &e))?;
            let cap = if req.length == 0 {
                MAX_FILE_CALL + 1
            } else {
                req.length as u64
            };
            r.take(cap)
                .read_to_end(&mut data)
                .map_err(|e| failure("read", &path, &e))?;
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
                Err(e) => return Err(failure("read", &path, &e)),
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

/// WriteFile: creates or truncates (or appends to) the file; a new file gets `mode`, 0
/// meaning 0644; a non-zero `mode` is also applied to an existing file. The parent must
/// exist. Errors: `invalid` for data over 64 MiB; the file system's (a missing parent is
/// `not_found`).
pub async fn write(cwd: PathBuf, req: pb::WriteFileRequest) -> Result<pb::FileInfo, Failure> {
    if req.data.len() as u64 > MAX_FILE_CALL {
        return Err(Failure::invalid(format!(
            "{} bytes is over the {MAX_FILE_CALL} bytes one write_file takes: write in pieces with append",
            req.data.len()
        )));
    }
    let path = resolve(&cwd, &req.path)?;
    blocking(move || {
        let mode = if req.mode == 0 {
            0o644
        } else {
            req.mode & 0o7777
        };
        let mut o = std::fs::OpenOptions::new();
        o.write(true).create(true).mode(mode);
        if req.append {
            o.append(true);
        } else {
            o.truncate(true);
        }
        let mut f = o.open(&path).map_err(|e| failure("open", &path, &e))?;
        f.write_all(&req.data)
            .map_err(|e| failure("write", &path, &e))?;
        if req.mode != 0 {
            f.set_permissions(std::fs::Permissions::from_mode(mode))
                .map_err(|e| failure("chmod", &path, &e))?;
        }
        let m = f.metadata().map_err(|e| failure("stat", &path, &e))?;
        Ok(info(&path, &m))
    })
    .await
}

/// ListDir: the entries of a directory, by name. Errors: the file system's.
pub async fn list(cwd: PathBuf, req: pb::PathRequest) -> Result<pb::ListDirResponse, Failure> {
    let path = resolve(&cwd, &req.path)?;
    blocking(move || {
        let rd = std::fs::read_dir(&path).map_err(|e| failure("list", &path, &e))?;
        let mut entries = Vec::new();
        for e in rd {
            let e = e.map_err(|e| failure("list", &path, &e))?;
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
        let m = std::fs::symlink_metadata(&path).map_err(|e| failure("stat", &path, &e))?;
        Ok(info(&path, &m))
    })
    .await
}

/// Remove: a file or symlink, an empty directory, or (`recursive`) a whole tree.
/// Errors: the file system's (a non-empty directory without `recursive` is `invalid`).
pub async fn remove(cwd: PathBuf, req: pb::RemoveRequest) -> Result<pb::Empty, Failure> {
    let path = resolve(&cwd, &req.path)?;
    blocking(move || {
        let m = std::fs::symlink_metadata(&path).map_err(|e| failure("remove", &path, &e))?;
        let r = if m.is_dir() {
            if req.recursive {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_dir(&path)
            }
        } else {
            std::fs::remove_file(&path)
        };
        r.map_err(|e| failure("remove", &path, &e))?;
        Ok(pb::Empty {})
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_map_to_reasons() {
        let p = Path::new("/x");
        let f = |n| failure("op", p, &std::io::Error::from_raw_os_error(n)).reason;
        assert_eq!(f(libc::ENOENT), Reason::NotFound);
        assert_eq!(f(libc::EACCES), Reason::Forbidden);
        assert_eq!(f(libc::EPERM), Reason::Forbidden);
        assert_eq!(f(libc::EROFS), Reason::Forbidden);
        assert_eq!(f(libc::ENOSPC), Reason::NoCapacity);
        assert_eq!(f(libc::EISDIR), Reason::Invalid);
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
        let i = write(cwd.clone(), w("a.txt", b"hello", false))
            .await
            .expect("write");
        assert_eq!((i.size, i.mode, i.r#type.as_str()), (5, 0o644, "file"));
        write(cwd.clone(), w("a.txt", b" world", true))
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
        let e = write(cwd.clone(), w("no/such/b", b"", false))
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
}
