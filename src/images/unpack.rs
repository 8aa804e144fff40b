//! Unpacks one untrusted layer tar into an empty directory, in overlay format (docs/images.md
//! "Untrusted layers"): whiteouts become 0:0 character devices, opaque markers are reported
//! for the importer to expand. Nothing a tar holds can write outside that directory: every
//! path is resolved by file descriptors from the directory itself (`openat2` with
//! `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS`, one component at a time), never by string checks
//! alone, and whatever breaks a rule is refused with the entry and the layer named.
//!
//! Refused: `..` components, absolute names, names that are not paths (empty, a component
//! over 255 bytes, the whole over 4096), an entry whose parent is a symlink or not a
//! directory, a hardlink to anything but an earlier non-directory entry of the same layer,
//! whiteouts of `.`, `..` or nothing, device nodes (other than the 0:0 whiteout device),
//! duplicate entries, and entry types other than files, directories, symlinks, hardlinks and
//! FIFOs. The caller removes the directory when this fails.

use std::collections::{HashMap, HashSet};
use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use rustix::fs::{
    self as rfs, AtFlags, FileType, Mode, OFlags, ResolveFlags, Timespec, Timestamps,
};
use tar::EntryType;

use crate::types::names::shown;
use crate::types::Failure;

/// What one unpacked layer holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Unpacked {
    /// Entries written (whiteouts included).
    pub entries: u64,
    /// Bytes of regular files written.
    pub file_bytes: u64,
    /// Whiteouts written (each a 0:0 character device).
    pub whiteouts: u64,
    /// Directories the layer marked opaque (`.wh..wh..opq`), relative, `""` for the root:
    /// the importer expands each against the layers below (docs/images.md).
    pub opaque: Vec<String>,
    /// Extended attributes in the tar that were not kept (the store may be NFS, which has
    /// none), e.g. `security.capability`.
    pub xattrs_dropped: u64,
}

/// Why a layer could not be unpacked.
#[derive(Debug, thiserror::Error)]
pub enum UnpackError {
    /// The tar breaks a rule (`invalid`): the entry and why.
    #[error("layer {layer}: entry {entry}: {why}")]
    Refused {
        layer: String,
        entry: String,
        why: String,
    },
    /// The bytes are not a tar (`invalid`).
    #[error("layer {layer} is not a valid tar")]
    Malformed {
        layer: String,
        #[source]
        source: io::Error,
    },
    /// Writing failed for a reason of the machine's, not of the tar (`internal`).
    #[error("layer {layer}: writing {entry}")]
    Io {
        layer: String,
        entry: String,
        #[source]
        source: io::Error,
    },
}

impl UnpackError {
    /// The caller-facing failure: `invalid` for what the tar did, `internal` for the machine.
    pub fn to_failure(&self) -> Failure {
        let msg = crate::types::chain(self);
        match self {
            UnpackError::Refused { .. } | UnpackError::Malformed { .. } => Failure::invalid(msg),
            UnpackError::Io { .. } => Failure::internal(msg),
        }
    }
}

/// Limits a layer must stay within.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Entries per layer.
    pub max_entries: u64,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_entries: 4 << 20,
        }
    }
}

const WHITEOUT: &[u8] = b".wh.";
const OPAQUE: &[u8] = b".wh..wh..opq";
/// The prefix of aufs's metadata names (the opaque marker aside).
const AUFS_META: &[u8] = b".wh..wh.";
const NAME_MAX: usize = 255;
/// Directory levels a name may have: deeper trees cost a walk per level per entry, and need
/// more descriptors to remove than a process may hold.
const MAX_DEPTH: usize = 256;
const COPY_BUF: usize = 128 << 10;
const PATH_MAX: usize = 4096;

/// Unpacks the uncompressed tar `tar` into `dir` (an existing, empty directory), as layer
/// `layer` (named in errors). Errors: [`UnpackError`]; what was written so far stays in
/// `dir` for the caller to remove.
pub fn unpack_layer<R: Read>(
    tar: R,
    dir: &Path,
    layer: &str,
    limits: Limits,
) -> Result<Unpacked, UnpackError> {
    let root_err = |e: io::Error| UnpackError::Io {
        layer: layer.into(),
        entry: dir.display().to_string(),
        source: e,
    };
    // The layer's root is 0755 whatever the importer's umask made it.
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .map_err(root_err)?;
    let root = rfs::open(
        dir,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| root_err(e.into()))?;
    let mut u = Unpacker {
        layer,
        root,
        seen: HashMap::new(),
        implicit: HashSet::new(),
        dir_times: Vec::new(),
        parent: None,
        buf: Vec::new(),
        out: Unpacked::default(),
    };
    let mut archive = tar::Archive::new(super::metacap::MetaCap::new(tar));
    let entries = archive.entries().map_err(|e| u.malformed(e))?;
    for entry in entries {
        let mut entry = entry.map_err(|e| u.malformed(e))?;
        if u.out.entries >= limits.max_entries {
            return Err(u.refused(
                b"",
                format!("the layer has more than {} entries", limits.max_entries),
            ));
        }
        u.entry(&mut entry)?;
    }
    u.finish()?;
    Ok(u.out)
}

/// What is known of a path this layer already wrote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Seen {
    Dir,
    /// A file, symlink or FIFO: what a hardlink may name.
    File,
    /// A whiteout or an opaque marker.
    Whiteout,
}

struct Unpacker<'a> {
    layer: &'a str,
    root: OwnedFd,
    /// Every path an entry named, and whether it is a directory.
    seen: HashMap<Vec<u8>, Seen>,
    /// Directories made only because a later entry lay inside them: an entry for one of them
    /// may still come (and set its mode), once.
    implicit: HashSet<Vec<u8>>,
    /// Directory mtimes, set at the end (writing into a directory changes its mtime).
    dir_times: Vec<(Vec<u8>, i64)>,
    /// The last parent directory opened, kept because entries come grouped by directory.
    parent: Option<(Vec<u8>, OwnedFd)>,
    /// The copy buffer for file contents, reused.
    buf: Vec<u8>,
    out: Unpacked,
}

/// One entry's metadata, read from its header.
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime: i64,
}

impl Unpacker<'_> {
    fn refused(&self, entry: &[u8], why: impl Into<String>) -> UnpackError {
        UnpackError::Refused {
            layer: self.layer.into(),
            entry: shown(&String::from_utf8_lossy(entry)),
            why: why.into(),
        }
    }

    fn malformed(&self, source: io::Error) -> UnpackError {
        UnpackError::Malformed {
            layer: self.layer.into(),
            source,
        }
    }

    fn io(&self, entry: &[u8], source: impl Into<io::Error>) -> UnpackError {
        UnpackError::Io {
            layer: self.layer.into(),
            entry: shown(&String::from_utf8_lossy(entry)),
            source: source.into(),
        }
    }

    fn entry<R: Read>(&mut self, e: &mut tar::Entry<'_, R>) -> Result<(), UnpackError> {
        let kind = e.header().entry_type();
        if kind == EntryType::XGlobalHeader {
            // A PAX global header (`git archive` writes one): metadata for no file.
            return Ok(());
        }
        let raw = e.path_bytes().into_owned();
        let Some(path) = normalize(&raw).map_err(|why| self.refused(&raw, why))? else {
            // `./` itself: the layer's root, which is ours and keeps its own mode.
            return Ok(());
        };
        let meta = self.meta(e, &raw)?;
        let pax = scan_pax(e).map_err(|err| self.malformed(err))?;
        if pax.sparse {
            return Err(self.refused(&raw, "a sparse file in PAX format, which is not supported"));
        }
        self.out.xattrs_dropped += pax.xattrs;
        let (parent, name) = split_last(&path);
        if name != OPAQUE && name.starts_with(AUFS_META) {
            // aufs's own metadata (`.wh..wh.plnk`, `.wh..wh.aufs`), which Docker skips too.
            return Ok(());
        }
        if name == OPAQUE {
            if !matches!(kind, EntryType::Regular | EntryType::Continuous) {
                return Err(self.refused(&raw, "an opaque marker must be a regular file"));
            }
            let Ok(dir) = String::from_utf8(parent.to_vec()) else {
                return Err(self.refused(&raw, "an opaque directory whose name is not UTF-8"));
            };
            self.open_parent(parent, &raw)?;
            let key = [parent, b"/", OPAQUE].concat();
            self.claim(&key, Seen::Whiteout, &raw)?;
            self.out.opaque.push(dir);
            self.out.entries += 1;
            return Ok(());
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT) {
            if hidden.is_empty() || hidden == b"." || hidden == b".." {
                return Err(self.refused(&raw, "a whiteout must name a file"));
            }
            if !matches!(kind, EntryType::Regular | EntryType::Continuous) {
                return Err(self.refused(&raw, "a whiteout must be a regular file"));
            }
            let target = join(parent, hidden);
            return self.whiteout(parent, hidden, &target, &raw);
        }
        match kind {
            EntryType::Directory => self.directory(&path, parent, name, &meta, &raw),
            EntryType::Regular | EntryType::Continuous => {
                self.claim(&path, Seen::File, &raw)?;
                let dirfd = self.open_parent(parent, &raw)?;
                let fd = rfs::openat(
                    &dirfd,
                    OsStr::from_bytes(name),
                    OFlags::WRONLY
                        | OFlags::CREATE
                        | OFlags::EXCL
                        | OFlags::NOFOLLOW
                        | OFlags::CLOEXEC,
                    Mode::from_bits_truncate(0o600),
                )
                .map_err(|err| self.io(&raw, err))?;
                let mut file = std::fs::File::from(fd);
                // Read and write apart: a short tar is the tar's fault, a full disk is not.
                let mut buf = std::mem::take(&mut self.buf);
                buf.resize(COPY_BUF, 0);
                let copied = loop {
                    let n = match e.read(&mut buf) {
                        Ok(0) => break Ok(()),
                        Ok(n) => n,
                        Err(err) => break Err(self.malformed(err)),
                    };
                    if let Err(err) = file.write_all(buf.get(..n).unwrap_or_default()) {
                        break Err(self.io(&raw, err));
                    }
                    self.out.file_bytes += n as u64;
                };
                self.buf = buf;
                copied?;
                // Owner first: a chown clears the setuid and setgid bits a chmod set.
                rfs::fchown(&file, Some(uid(meta.uid)), Some(gid(meta.gid)))
                    .map_err(|err| self.io(&raw, err))?;
                rfs::fchmod(&file, Mode::from_bits_truncate(meta.mode))
                    .map_err(|err| self.io(&raw, err))?;
                rfs::futimens(&file, &times(meta.mtime)).map_err(|err| self.io(&raw, err))?;
                self.out.entries += 1;
                Ok(())
            }
            EntryType::Symlink => {
                let target = link_name(e);
                if target.is_empty() || target.len() > PATH_MAX || target.contains(&0) {
                    return Err(self.refused(
                        &raw,
                        "a symlink needs a target of 1 to 4096 bytes without NUL",
                    ));
                }
                self.claim(&path, Seen::File, &raw)?;
                let dirfd = self.open_parent(parent, &raw)?;
                rfs::symlinkat(OsStr::from_bytes(&target), &dirfd, OsStr::from_bytes(name))
                    .map_err(|err| self.io(&raw, err))?;
                self.owner_and_time(&dirfd, name, &meta, &raw)?;
                self.out.entries += 1;
                Ok(())
            }
            EntryType::Link => {
                let target_raw = link_name(e);
                let Some(target) = normalize(&target_raw)
                    .map_err(|why| self.refused(&raw, format!("hardlink target: {why}")))?
                else {
                    return Err(self.refused(&raw, "a hardlink to the layer's root"));
                };
                match self.seen.get(&target) {
                    Some(Seen::File) => {}
                    Some(_) => {
                        return Err(self.refused(
                            &raw,
                            "a hardlink must name an earlier file of the layer, not a directory or whiteout",
                        ))
                    }
                    None => {
                        return Err(self.refused(
                            &raw,
                            format!(
                                "hardlink to {}, which is no earlier entry of this layer",
                                shown(&String::from_utf8_lossy(&target_raw))
                            ),
                        ))
                    }
                }
                self.claim(&path, Seen::File, &raw)?;
                let (tparent, tname) = split_last(&target);
                let tdir = self.walk(tparent, &raw, false)?;
                let dirfd = self.open_parent(parent, &raw)?;
                rfs::linkat(
                    &tdir,
                    OsStr::from_bytes(tname),
                    &dirfd,
                    OsStr::from_bytes(name),
                    AtFlags::empty(),
                )
                .map_err(|err| self.io(&raw, err))?;
                self.out.entries += 1;
                Ok(())
            }
            EntryType::Fifo => {
                self.claim(&path, Seen::File, &raw)?;
                let dirfd = self.open_parent(parent, &raw)?;
                rfs::mknodat(
                    &dirfd,
                    OsStr::from_bytes(name),
                    FileType::Fifo,
                    Mode::from_bits_truncate(meta.mode),
                    0,
                )
                .map_err(|err| self.io(&raw, err))?;
                self.owner_and_time(&dirfd, name, &meta, &raw)?;
                rfs::chmodat(
                    &dirfd,
                    OsStr::from_bytes(name),
                    Mode::from_bits_truncate(meta.mode),
                    AtFlags::empty(),
                )
                .map_err(|err| self.io(&raw, err))?;
                self.out.entries += 1;
                Ok(())
            }
            EntryType::Char => {
                // overlayfs's own whiteout, as tars made from an upper directory carry it.
                let dev = (e.header().device_major(), e.header().device_minor());
                if !matches!(dev, (Ok(Some(0)), Ok(Some(0)))) {
                    return Err(self.refused(&raw, "device nodes are not allowed in a layer"));
                }
                self.whiteout(parent, name, &path, &raw)
            }
            EntryType::Block => Err(self.refused(&raw, "device nodes are not allowed in a layer")),
            other => Err(self.refused(
                &raw,
                format!("entry type {other:?} is not allowed in a layer"),
            )),
        }
    }

    fn meta<R: Read>(&self, e: &tar::Entry<'_, R>, raw: &[u8]) -> Result<Meta, UnpackError> {
        let h = e.header();
        let bad = |what: &str| self.refused(raw, format!("its {what} cannot be read"));
        let mode = h.mode().map_err(|_| bad("mode"))? & 0o7777;
        let uid = u32::try_from(h.uid().map_err(|_| bad("uid"))?)
            .ok()
            .filter(|u| *u != u32::MAX)
            .ok_or_else(|| bad("uid"))?;
        let gid = u32::try_from(h.gid().map_err(|_| bad("gid"))?)
            .ok()
            .filter(|g| *g != u32::MAX)
            .ok_or_else(|| bad("gid"))?;
        let mtime = i64::try_from(h.mtime().map_err(|_| bad("mtime"))?).unwrap_or(i64::MAX);
        Ok(Meta {
            mode,
            uid,
            gid,
            mtime,
        })
    }

    /// Records that an entry named `path`; a second entry for it is refused, except an
    /// explicit directory entry for a directory that was made implicitly.
    fn claim(&mut self, path: &[u8], kind: Seen, raw: &[u8]) -> Result<(), UnpackError> {
        if let Some(prev) = self.seen.get(path) {
            if *prev == Seen::Dir && kind == Seen::Dir && self.implicit.remove(path) {
                return Ok(());
            }
            return Err(self.refused(raw, "a second entry for the same path"));
        }
        self.seen.insert(path.to_vec(), kind);
        Ok(())
    }

    fn whiteout(
        &mut self,
        parent: &[u8],
        name: &[u8],
        target: &[u8],
        raw: &[u8],
    ) -> Result<(), UnpackError> {
        self.claim(target, Seen::Whiteout, raw)?;
        let dirfd = self.open_parent(parent, raw)?;
        rfs::mknodat(
            &dirfd,
            OsStr::from_bytes(name),
            FileType::CharacterDevice,
            Mode::empty(),
            rfs::makedev(0, 0),
        )
        .map_err(|err| self.io(raw, err))?;
        self.out.whiteouts += 1;
        self.out.entries += 1;
        Ok(())
    }

    fn directory(
        &mut self,
        path: &[u8],
        parent: &[u8],
        name: &[u8],
        meta: &Meta,
        raw: &[u8],
    ) -> Result<(), UnpackError> {
        let made_before = self.implicit.contains(path);
        self.claim(path, Seen::Dir, raw)?;
        let dirfd = self.open_parent(parent, raw)?;
        if !made_before {
            rfs::mkdirat(
                &dirfd,
                OsStr::from_bytes(name),
                Mode::from_bits_truncate(0o700),
            )
            .map_err(|err| self.io(raw, err))?;
        }
        self.owner_and_time(&dirfd, name, meta, raw)?;
        rfs::chmodat(
            &dirfd,
            OsStr::from_bytes(name),
            Mode::from_bits_truncate(meta.mode),
            AtFlags::empty(),
        )
        .map_err(|err| self.io(raw, err))?;
        self.dir_times.push((path.to_vec(), meta.mtime));
        self.out.entries += 1;
        Ok(())
    }

    /// Owner and mtime of `name` in `dirfd`, never following a symlink.
    fn owner_and_time(
        &self,
        dirfd: &OwnedFd,
        name: &[u8],
        meta: &Meta,
        raw: &[u8],
    ) -> Result<(), UnpackError> {
        rfs::chownat(
            dirfd,
            OsStr::from_bytes(name),
            Some(uid(meta.uid)),
            Some(gid(meta.gid)),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|err| self.io(raw, err))?;
        rfs::utimensat(
            dirfd,
            OsStr::from_bytes(name),
            &times(meta.mtime),
            AtFlags::SYMLINK_NOFOLLOW,
        )
        .map_err(|err| self.io(raw, err))
    }

    /// The directory `parent` (relative, `""` for the root) as an fd, made (mode 0755) where
    /// it does not exist yet. Cached for the next entry.
    fn open_parent(&mut self, parent: &[u8], raw: &[u8]) -> Result<OwnedFd, UnpackError> {
        if let Some((p, fd)) = &self.parent {
            if p == parent {
                return fd.try_clone().map_err(|err| self.io(raw, err));
            }
        }
        let fd = self.walk(parent, raw, true)?;
        self.parent = Some((
            parent.to_vec(),
            fd.try_clone().map_err(|err| self.io(raw, err))?,
        ));
        Ok(fd)
    }

    /// Walks `rel` from the layer's root one component at a time; each step refuses a
    /// symlink (`RESOLVE_NO_SYMLINKS`) and anything outside (`RESOLVE_BENEATH`). With
    /// `make`, missing directories are made and remembered as implicit.
    fn walk(&mut self, rel: &[u8], raw: &[u8], make: bool) -> Result<OwnedFd, UnpackError> {
        let mut cur = self.root.try_clone().map_err(|err| self.io(raw, err))?;
        if rel.is_empty() {
            return Ok(cur);
        }
        let mut sofar: Vec<u8> = Vec::with_capacity(rel.len());
        for comp in rel.split(|b| *b == b'/') {
            if !sofar.is_empty() {
                sofar.push(b'/');
            }
            sofar.extend_from_slice(comp);
            let open = |at: &OwnedFd| {
                rfs::openat2(
                    at,
                    OsStr::from_bytes(comp),
                    // No O_NOFOLLOW: RESOLVE_NO_SYMLINKS refuses a symlink with ELOOP (with
                    // O_NOFOLLOW it would be opened as itself, and fail as ENOTDIR).
                    OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                    Mode::empty(),
                    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
                )
            };
            let next = match open(&cur) {
                Ok(fd) => fd,
                Err(rustix::io::Errno::NOENT) if make && !self.seen.contains_key(&sofar) => {
                    rfs::mkdirat(
                        &cur,
                        OsStr::from_bytes(comp),
                        Mode::from_bits_truncate(0o755),
                    )
                    .map_err(|err| self.io(raw, err))?;
                    // 0755 whatever the importer's umask.
                    rfs::chmodat(
                        &cur,
                        OsStr::from_bytes(comp),
                        Mode::from_bits_truncate(0o755),
                        AtFlags::empty(),
                    )
                    .map_err(|err| self.io(raw, err))?;
                    // Made directories count as entries, so the limit bounds them too.
                    self.out.entries += 1;
                    self.seen.insert(sofar.clone(), Seen::Dir);
                    self.implicit.insert(sofar.clone());
                    open(&cur).map_err(|err| self.io(raw, err))?
                }
                Err(rustix::io::Errno::LOOP) => {
                    return Err(self.refused(
                        raw,
                        format!(
                            "its parent {} is a symlink",
                            shown(&String::from_utf8_lossy(&sofar))
                        ),
                    ))
                }
                Err(rustix::io::Errno::NOTDIR | rustix::io::Errno::NOENT) => {
                    return Err(self.refused(
                        raw,
                        format!(
                            "its parent {} is not a directory",
                            shown(&String::from_utf8_lossy(&sofar))
                        ),
                    ))
                }
                Err(err) => return Err(self.io(raw, err)),
            };
            cur = next;
        }
        Ok(cur)
    }

    fn finish(&mut self) -> Result<(), UnpackError> {
        self.parent = None;
        let dirs = std::mem::take(&mut self.dir_times);
        for (path, mtime) in dirs {
            let (parent, name) = split_last(&path);
            let dirfd = self.walk(parent, &path, false)?;
            rfs::utimensat(
                &dirfd,
                OsStr::from_bytes(name),
                &times(mtime),
                AtFlags::SYMLINK_NOFOLLOW,
            )
            .map_err(|err| self.io(&path, err))?;
        }
        Ok(())
    }
}

/// A tar name as the components it means: `./a//b/` is `a/b`. `None` for the root itself
/// (`./`, `.`, `/`).
/// Errors: why the name is refused.
fn normalize(raw: &[u8]) -> Result<Option<Vec<u8>>, String> {
    if raw.is_empty() {
        return Err("an empty name".into());
    }
    if raw.len() > PATH_MAX {
        return Err(format!("a name longer than {PATH_MAX} bytes"));
    }
    // `/` alone is the root too: umoci writes it so. It names nothing outside the layer, and
    // the root keeps its own mode as it does for `./`.
    if raw.split(|b| *b == b'/').all(|c| c.is_empty() || c == b".") {
        return Ok(None);
    }
    if raw.first() == Some(&b'/') {
        return Err("an absolute name".into());
    }
    if raw.contains(&0) {
        return Err("a name with a NUL byte".into());
    }
    let mut out: Vec<u8> = Vec::with_capacity(raw.len());
    let mut depth = 0;
    for comp in raw.split(|b| *b == b'/') {
        match comp {
            b"" | b"." => continue,
            b".." => return Err("a name with a '..' component".into()),
            c if c.len() > NAME_MAX => {
                return Err(format!("a name component longer than {NAME_MAX} bytes"))
            }
            c => {
                depth += 1;
                if depth > MAX_DEPTH {
                    return Err(format!("a name more than {MAX_DEPTH} levels deep"));
                }
                if !out.is_empty() {
                    out.push(b'/');
                }
                out.extend_from_slice(c);
            }
        }
    }
    Ok(if out.is_empty() { None } else { Some(out) })
}

fn split_last(path: &[u8]) -> (&[u8], &[u8]) {
    match path.iter().rposition(|b| *b == b'/') {
        Some(i) => (
            path.get(..i).unwrap_or_default(),
            path.get(i + 1..).unwrap_or_default(),
        ),
        None => (b"", path),
    }
}

fn join(parent: &[u8], name: &[u8]) -> Vec<u8> {
    if parent.is_empty() {
        name.to_vec()
    } else {
        [parent, b"/", name].concat()
    }
}

/// A symlink's or hardlink's target as the tar names it (long names included).
fn link_name<R: Read>(e: &tar::Entry<'_, R>) -> Vec<u8> {
    e.link_name_bytes()
        .map(|t| t.into_owned())
        .unwrap_or_default()
}

/// What an entry's PAX records say that matters here.
struct Pax {
    /// Extended attributes (not kept).
    xattrs: u64,
    /// A GNU sparse file in PAX form, which the tar reader would take for a plain file.
    sparse: bool,
}

fn scan_pax<R: Read>(e: &mut tar::Entry<'_, R>) -> io::Result<Pax> {
    let mut pax = Pax {
        xattrs: 0,
        sparse: false,
    };
    let Some(exts) = e.pax_extensions()? else {
        return Ok(pax);
    };
    for ext in exts {
        let key = ext?.key_bytes();
        if key.starts_with(b"SCHILY.xattr.") {
            pax.xattrs += 1;
        } else if key.starts_with(b"GNU.sparse.") {
            pax.sparse = true;
        }
    }
    Ok(pax)
}

fn uid(u: u32) -> rustix::fs::Uid {
    rustix::fs::Uid::from_raw(u)
}

fn gid(g: u32) -> rustix::fs::Gid {
    rustix::fs::Gid::from_raw(g)
}

fn times(mtime: i64) -> Timestamps {
    let t = Timespec {
        tv_sec: mtime,
        tv_nsec: 0,
    };
    Timestamps {
        last_access: t,
        last_modification: t,
    }
}

/// Expands the opaque directories `opaque` (relative to `dir`, as [`Unpacked::opaque`] lists
/// them) against the layers below, `lowers` (their `rootfs` directories, any order): for every
/// name one of those directories holds in a lower layer and this layer's does not, a whiteout
/// is written, which is what the opaque marker means to overlayfs. A lower path that is a
/// symlink or not a directory is no merged directory and adds nothing. Returns the number of
/// whiteouts written. Errors: `Io` (`internal`).
pub fn expand_opaque(
    dir: &Path,
    layer: &str,
    opaque: &[String],
    lowers: &[std::path::PathBuf],
) -> Result<u64, UnpackError> {
    let io = |entry: &str, source: io::Error| UnpackError::Io {
        layer: layer.into(),
        entry: shown(entry),
        source,
    };
    let mut written = 0;
    for d in opaque {
        let ours = open_dir_beneath(dir, d)
            .map_err(|e| io(d, e))?
            .ok_or_else(|| io(d, io::Error::from(io::ErrorKind::NotFound)))?;
        let have = dir_names(&ours).map_err(|e| io(d, e))?;
        let mut hidden = std::collections::BTreeSet::new();
        for lower in lowers {
            if let Some(fd) = open_dir_beneath(lower, d).map_err(|e| io(d, e))? {
                hidden.extend(dir_names(&fd).map_err(|e| io(d, e))?);
            }
        }
        for name in hidden.difference(&have) {
            rfs::mknodat(
                &ours,
                OsStr::from_bytes(name),
                FileType::CharacterDevice,
                Mode::empty(),
                rfs::makedev(0, 0),
            )
            .map_err(|e| io(d, e.into()))?;
            written += 1;
        }
    }
    Ok(written)
}

/// `rel` below `base` as a directory fd for reading, resolved without symlinks and never
/// outside `base`; `None` where it is missing, a symlink or not a directory.
fn open_dir_beneath(base: &Path, rel: &str) -> io::Result<Option<OwnedFd>> {
    let root = rfs::open(
        base,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )?;
    if rel.is_empty() {
        return Ok(Some(root));
    }
    match rfs::openat2(
        &root,
        rel,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    ) {
        Ok(fd) => Ok(Some(fd)),
        Err(rustix::io::Errno::NOENT | rustix::io::Errno::NOTDIR | rustix::io::Errno::LOOP) => {
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
}

/// The names in a directory, without `.` and `..`.
pub(crate) fn dir_names(fd: &OwnedFd) -> io::Result<std::collections::BTreeSet<Vec<u8>>> {
    let mut out = std::collections::BTreeSet::new();
    let mut dir = rfs::Dir::read_from(fd)?;
    while let Some(entry) = dir.read() {
        let name = entry?.file_name().to_bytes().to_vec();
        if name != b"." && name != b".." {
            out.insert(name);
        }
    }
    Ok(out)
}
