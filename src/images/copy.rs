//! Copies a stored layer's tree whole, as it is: regular files, directories, symlinks,
//! hardlinks (kept as links inside the copy), FIFOs and device nodes (the 0:0 whiteouts),
//! with owners, modes (setuid and setgid included) and times. The node's layer cache uses it
//! (docs/images.md "How nodes use images"). Every step goes through directory fds opened
//! with `O_NOFOLLOW`, so a symlink in the tree is copied as a link and never followed.
//! Extended attributes are not copied: the store holds none (opaque directories are
//! expanded at import, so it works on NFS).

use std::collections::HashMap;
use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags, Stat, Timespec, Timestamps};

/// Deeper than any layer the importer writes (its names are at most 4096 bytes).
const MAX_DEPTH: usize = 2048;

/// What a copy wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Copied {
    /// Entries made in the copy, linked ones included.
    pub entries: u64,
    /// Bytes of regular files copied (linked files copy none).
    pub file_bytes: u64,
    /// Entries that are hardlinks to the source's own inode ([`link_tree`]).
    pub linked: u64,
}

/// Copies the directory `src` to `dst`, which must not exist (its parent must). Errors: the
/// first failure, with the path it hit; `dst` may then hold part of the copy, which the
/// caller removes.
pub fn copy_tree(src: &Path, dst: &Path) -> io::Result<Copied> {
    walk(src, dst, false)
}

/// Like [`copy_tree`], but every entry that is not a directory becomes a hardlink to the
/// source's inode when both trees are on one file system: no data is copied, and the copy
/// still outlives the source's removal. Only for trees nobody writes (stored layers are
/// immutable, and overlay never writes a lower layer). Entries that cannot be linked
/// (another file system, the link-count limit) are copied instead.
pub fn link_tree(src: &Path, dst: &Path) -> io::Result<Copied> {
    walk(src, dst, true)
}

fn walk(src: &Path, dst: &Path, link: bool) -> io::Result<Copied> {
    let at = |p: &Path, e: io::Error| io::Error::new(e.kind(), format!("{}: {e}", p.display()));
    let src_fd = rfs::open(src, dir_flags(), Mode::empty()).map_err(|e| at(src, e.into()))?;
    let st = rfs::fstat(&src_fd).map_err(|e| at(src, e.into()))?;
    rfs::mkdir(dst, Mode::from_bits_truncate(0o700)).map_err(|e| at(dst, e.into()))?;
    let dst_fd = rfs::open(dst, dir_flags(), Mode::empty()).map_err(|e| at(dst, e.into()))?;
    let mut c = Copier {
        root: dst_fd.try_clone()?,
        links: HashMap::new(),
        link,
        out: Copied::default(),
    };
    c.dir(&src_fd, &dst_fd, &mut PathBuf::new(), 0)
        .map_err(|(p, e)| at(&src.join(p), e))?;
    finish(&dst_fd, &st).map_err(|e| at(dst, e))?;
    Ok(c.out)
}

fn dir_flags() -> OFlags {
    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC
}

struct Copier {
    /// The copy's root, for hardlinks to entries copied earlier.
    root: OwnedFd,
    /// (device, inode) of a file with more than one link → its path in the copy.
    links: HashMap<(u64, u64), PathBuf>,
    /// Link entries to the source's inodes ([`link_tree`]); cleared on the first `EXDEV`.
    link: bool,
    out: Copied,
}

type Step<T> = Result<T, (PathBuf, io::Error)>;

impl Copier {
    fn dir(&mut self, src: &OwnedFd, dst: &OwnedFd, rel: &mut PathBuf, depth: usize) -> Step<()> {
        if depth > MAX_DEPTH {
            return Err((
                rel.clone(),
                io::Error::other(format!("deeper than {MAX_DEPTH} directories")),
            ));
        }
        let fail = |rel: &Path, e: rustix::io::Errno| (rel.to_path_buf(), io::Error::from(e));
        let names: Vec<OsString> = {
            let mut dir = rfs::Dir::read_from(src).map_err(|e| fail(rel, e))?;
            let mut names = Vec::new();
            for ent in dir.by_ref() {
                let ent = ent.map_err(|e| fail(rel, e))?;
                let n = ent.file_name().to_bytes();
                if n != b"." && n != b".." {
                    names.push(OsStr::from_bytes(n).to_os_string());
                }
            }
            names
        };
        for name in names {
            rel.push(&name);
            self.entry(src, dst, &name, rel, depth)?;
            rel.pop();
        }
        Ok(())
    }

    fn entry(
        &mut self,
        src: &OwnedFd,
        dst: &OwnedFd,
        name: &OsStr,
        rel: &mut PathBuf,
        depth: usize,
    ) -> Step<()> {
        let fail = |rel: &Path, e: io::Error| (rel.to_path_buf(), e);
        let st =
            rfs::statat(src, name, AtFlags::SYMLINK_NOFOLLOW).map_err(|e| fail(rel, e.into()))?;
        let kind = FileType::from_raw_mode(st.st_mode);
        let key = (st.st_dev, st.st_ino);
        if self.link && kind != FileType::Directory {
            match rfs::linkat(src, name, dst, name, AtFlags::empty()) {
                Ok(()) => {
                    self.out.entries += 1;
                    self.out.linked += 1;
                    return Ok(());
                }
                Err(rustix::io::Errno::XDEV) => self.link = false,
                Err(rustix::io::Errno::MLINK | rustix::io::Errno::PERM) => {}
                Err(e) => return Err(fail(rel, e.into())),
            }
        }
        if kind != FileType::Directory && st.st_nlink > 1 {
            if let Some(first) = self.links.get(&key) {
                rfs::linkat(&self.root, first.as_path(), dst, name, AtFlags::empty())
                    .map_err(|e| fail(rel, e.into()))?;
                self.out.entries += 1;
                return Ok(());
            }
        }
        match kind {
            FileType::Directory => {
                rfs::mkdirat(dst, name, Mode::from_bits_truncate(0o700))
                    .map_err(|e| fail(rel, e.into()))?;
                let s = rfs::openat(src, name, dir_flags(), Mode::empty())
                    .map_err(|e| fail(rel, e.into()))?;
                let d = rfs::openat(dst, name, dir_flags(), Mode::empty())
                    .map_err(|e| fail(rel, e.into()))?;
                self.dir(&s, &d, rel, depth + 1)?;
                finish(&d, &st).map_err(|e| fail(rel, e))?;
            }
            FileType::RegularFile => {
                let s = rfs::openat(
                    src,
                    name,
                    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| fail(rel, e.into()))?;
                let d = rfs::openat(
                    dst,
                    name,
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_bits_truncate(0o600),
                )
                .map_err(|e| fail(rel, e.into()))?;
                let (mut s, mut d) = (std::fs::File::from(s), std::fs::File::from(d));
                // std copies File to File with copy_file_range: reflinks where the file
                // system can, no bytes through user space where it cannot.
                let n = io::copy(&mut s, &mut d).map_err(|e| fail(rel, e))?;
                self.out.file_bytes += n;
                finish(&d, &st).map_err(|e| fail(rel, e))?;
            }
            FileType::Symlink => {
                let target =
                    rfs::readlinkat(src, name, Vec::new()).map_err(|e| fail(rel, e.into()))?;
                rfs::symlinkat(target.as_c_str(), dst, name).map_err(|e| fail(rel, e.into()))?;
                finish_at(dst, name, &st, false).map_err(|e| fail(rel, e))?;
            }
            FileType::Fifo | FileType::CharacterDevice | FileType::BlockDevice => {
                rfs::mknodat(dst, name, kind, Mode::from_bits_truncate(0o600), st.st_rdev)
                    .map_err(|e| fail(rel, e.into()))?;
                finish_at(dst, name, &st, true).map_err(|e| fail(rel, e))?;
            }
            FileType::Socket | FileType::Unknown => {
                // A socket is nothing without its process; the importer writes none.
                return Ok(());
            }
        }
        if kind != FileType::Directory && st.st_nlink > 1 {
            self.links.insert(key, rel.clone());
        }
        self.out.entries += 1;
        Ok(())
    }
}

fn times(st: &Stat) -> Timestamps {
    Timestamps {
        last_access: Timespec {
            tv_sec: st.st_atime,
            tv_nsec: st.st_atime_nsec as _,
        },
        last_modification: Timespec {
            tv_sec: st.st_mtime,
            tv_nsec: st.st_mtime_nsec as _,
        },
    }
}

/// Owner, then mode (a chown clears the setuid and setgid bits), then times, on an open fd.
fn finish<F: AsFd>(fd: F, st: &Stat) -> io::Result<()> {
    rfs::fchown(
        &fd,
        Some(rfs::Uid::from_raw(st.st_uid)),
        Some(rfs::Gid::from_raw(st.st_gid)),
    )?;
    rfs::fchmod(&fd, Mode::from_raw_mode(st.st_mode))?;
    rfs::futimens(&fd, &times(st))?;
    Ok(())
}

/// [`finish`] by name, for entries that cannot be opened (symlinks, FIFOs, devices).
/// Symlinks have no mode of their own on Linux.
fn finish_at(dir: &OwnedFd, name: &OsStr, st: &Stat, mode: bool) -> io::Result<()> {
    rfs::chownat(
        dir,
        name,
        Some(rfs::Uid::from_raw(st.st_uid)),
        Some(rfs::Gid::from_raw(st.st_gid)),
        AtFlags::SYMLINK_NOFOLLOW,
    )?;
    if mode {
        rfs::chmodat(dir, name, Mode::from_raw_mode(st.st_mode), AtFlags::empty())?;
    }
    rfs::utimensat(dir, name, &times(st), AtFlags::SYMLINK_NOFOLLOW)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};

    #[test]
    fn copies_every_kind_with_owners_modes_times_and_links() {
        let d = tempfile::tempdir().expect("tempdir");
        let src = d.path().join("src");
        std::fs::create_dir_all(src.join("etc/sub")).expect("mkdir");
        std::fs::write(src.join("etc/passwd"), b"root:x:0:0::/root:/bin/sh\n").expect("write");
        std::fs::write(src.join("suid"), b"#!/bin/sh\n").expect("write");
        std::os::unix::fs::chown(src.join("suid"), Some(1234), Some(5678)).expect("chown");
        std::fs::set_permissions(src.join("suid"), std::fs::Permissions::from_mode(0o4755))
            .expect("chmod");
        std::fs::hard_link(src.join("suid"), src.join("etc/sub/link")).expect("link");
        std::os::unix::fs::symlink("../outside/nowhere", src.join("etc/dangling"))
            .expect("symlink");
        rfs::mknodat(
            rfs::CWD,
            src.join("gone"),
            FileType::CharacterDevice,
            Mode::empty(),
            0,
        )
        .expect("whiteout");
        rfs::mknodat(
            rfs::CWD,
            src.join("fifo"),
            FileType::Fifo,
            Mode::from_bits_truncate(0o640),
            0,
        )
        .expect("fifo");
        std::fs::set_permissions(src.join("etc/sub"), std::fs::Permissions::from_mode(0o1750))
            .expect("chmod dir");
        let old = Timestamps {
            last_access: Timespec {
                tv_sec: 1_000_000,
                tv_nsec: 5,
            },
            last_modification: Timespec {
                tv_sec: 2_000_000,
                tv_nsec: 7,
            },
        };
        rfs::utimensat(rfs::CWD, src.join("etc/passwd"), &old, AtFlags::empty()).expect("utimens");
        rfs::utimensat(rfs::CWD, src.join("etc"), &old, AtFlags::empty()).expect("utimens");

        let dst = d.path().join("dst");
        let got = copy_tree(&src, &dst).expect("copy");
        assert_eq!(got.entries, 8, "{got:?}");

        let m = |p: &str| std::fs::symlink_metadata(dst.join(p)).expect(p);
        assert_eq!(
            std::fs::read(dst.join("etc/passwd")).expect("read"),
            b"root:x:0:0::/root:/bin/sh\n"
        );
        assert_eq!(m("etc/passwd").mtime(), 2_000_000);
        assert_eq!(m("etc/passwd").mtime_nsec(), 7);
        assert_eq!(
            m("etc").mtime(),
            2_000_000,
            "a directory's time is set after its entries"
        );
        assert_eq!(m("suid").mode() & 0o7777, 0o4755);
        assert_eq!((m("suid").uid(), m("suid").gid()), (1234, 5678));
        assert_eq!(
            m("suid").ino(),
            m("etc/sub/link").ino(),
            "a hardlink stays a link"
        );
        assert_eq!(m("suid").nlink(), 2);
        assert_eq!(
            std::fs::read_link(dst.join("etc/dangling")).expect("readlink"),
            Path::new("../outside/nowhere")
        );
        assert!(m("gone").file_type().is_char_device());
        assert_eq!(m("gone").rdev(), 0);
        assert!(m("fifo").file_type().is_fifo());
        assert_eq!(m("fifo").mode() & 0o7777, 0o640);
        assert_eq!(m("etc/sub").mode() & 0o7777, 0o1750);
        // The destination must be new: a second copy onto it fails and changes nothing.
        assert!(copy_tree(&src, &dst).is_err());
        assert_eq!(m("suid").nlink(), 2);
    }

    #[test]
    fn a_linked_tree_shares_inodes_keeps_directories_its_own_and_outlives_the_source() {
        let d = tempfile::tempdir().expect("tempdir");
        let src = d.path().join("src");
        std::fs::create_dir_all(src.join("usr/bin")).expect("mkdir");
        std::fs::write(src.join("usr/bin/tool"), b"tool\n").expect("write");
        std::fs::hard_link(src.join("usr/bin/tool"), src.join("usr/bin/alias")).expect("link");
        std::os::unix::fs::symlink("tool", src.join("usr/bin/sym")).expect("symlink");
        std::fs::set_permissions(src.join("usr/bin"), std::fs::Permissions::from_mode(0o751))
            .expect("chmod dir");

        let dst = d.path().join("dst");
        let got = link_tree(&src, &dst).expect("link");
        assert_eq!(
            (got.entries, got.linked, got.file_bytes),
            (5, 3, 0),
            "{got:?}"
        );
        let m = |p: &Path| std::fs::symlink_metadata(p).expect("stat");
        assert_eq!(
            m(&dst.join("usr/bin/tool")).ino(),
            m(&src.join("usr/bin/tool")).ino()
        );
        assert_eq!(
            m(&dst.join("usr/bin/alias")).ino(),
            m(&dst.join("usr/bin/tool")).ino()
        );
        assert_ne!(m(&dst.join("usr/bin")).ino(), m(&src.join("usr/bin")).ino());
        assert_eq!(m(&dst.join("usr/bin")).mode() & 0o7777, 0o751);
        assert!(m(&dst.join("usr/bin/sym")).file_type().is_symlink());

        std::fs::remove_dir_all(&src).expect("remove the source");
        assert_eq!(
            std::fs::read(dst.join("usr/bin/sym")).expect("read"),
            b"tool\n"
        );
    }
}
