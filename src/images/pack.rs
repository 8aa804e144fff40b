//! Packs a container's writable layer (its overlay upper directory) into a layer of the
//! store: `pack_diff` (build residue scrubbed) and container snapshots (kept as they are),
//! docs/images.md "Images from sandboxes".
//!
//! The upper directory belongs to the sandbox, so its contents are hostile: it is walked by
//! file descriptors from the directory itself, never following a symlink (`O_NOFOLLOW`, and
//! `openat` one component at a time), and what it holds is written as an OCI layer tar
//! (overlay whiteouts become `.wh.` entries, opaque directories `.wh..wh..opq`) which the
//! importer then unpacks by its own rules ([`crate::images::layer::import_layer`]), so a
//! packed layer is checked exactly as an imported one is. Device nodes other than whiteouts
//! are refused; sockets are skipped (a tar cannot hold one).

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{self, Read, Write};
use std::os::fd::OwnedFd;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rustix::fs::{self as rfs, AtFlags, FileType, Mode, OFlags, ResolveFlags};
use tar::{EntryType, Header};

use super::layer::{import_layer, Expected, LayerError};
use super::store::{LayerMeta, Store};
use super::unpack::{dir_names, Limits};
use crate::types::names::shown;
use crate::types::Failure;

/// What `pack_diff` removes unless told otherwise (globs relative to `/`; docs/images.md
/// "Images from sandboxes"): temporary files, caches and shell and Python history.
pub const DEFAULT_SCRUB: [&str; 6] = [
    "tmp/*",
    "var/tmp/*",
    "root/.cache",
    "root/.bash_history",
    "home/*/.bash_history",
    "root/.python_history",
];
/// Globs a caller may add to one pack.
pub const MAX_SCRUB: usize = 64;
const MAX_DEPTH: usize = 256;
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";

/// Why a pack failed.
#[derive(Debug, thiserror::Error)]
pub enum PackError {
    /// The sandbox's files hold what no image layer may (`invalid`): the entry and why.
    #[error("entry {entry}: {why}")]
    Refused { entry: String, why: String },
    /// Reading the writable layer failed (`internal`).
    #[error("reading {entry} of the writable layer")]
    Read {
        entry: String,
        #[source]
        source: io::Error,
    },
    /// The layer could not be written into the store.
    #[error(transparent)]
    Layer(#[from] LayerError),
}

impl PackError {
    /// The shared failure: `invalid` for a refused entry, the store's reason otherwise.
    pub fn to_failure(&self) -> Failure {
        match self {
            PackError::Refused { .. } => Failure::invalid(crate::types::chain(self)),
            PackError::Read { .. } => Failure::internal(crate::types::chain(self)),
            PackError::Layer(e) => e.to_failure(),
        }
    }
}

/// The paths a pack leaves out: matched against each entry's path relative to `/` (no
/// leading `/`); `*` stops at `/`. A matched directory goes with all it holds.
#[derive(Debug, Clone)]
pub struct Scrub {
    set: globset::GlobSet,
    globs: Vec<String>,
}

impl Scrub {
    /// [`DEFAULT_SCRUB`] when `defaults`, then `extra` (a leading `/` is allowed and ignored).
    /// Errors: `invalid` for more than [`MAX_SCRUB`] globs, an empty glob, one naming `..`
    /// or the root, or one globset cannot parse, naming it.
    pub fn new(defaults: bool, extra: &[String]) -> Result<Scrub, Failure> {
        if extra.len() > MAX_SCRUB {
            return Err(Failure::invalid(format!(
                "scrub takes at most {MAX_SCRUB} globs, not {}",
                extra.len()
            )));
        }
        let mut globs: Vec<String> = if defaults {
            DEFAULT_SCRUB.iter().map(|s| s.to_string()).collect()
        } else {
            Vec::new()
        };
        for g in extra {
            let rel = g.trim_start_matches('/').trim_end_matches('/');
            if rel.is_empty()
                || rel.len() > 4096
                || rel
                    .split('/')
                    .any(|c| c == ".." || c == "." || c.is_empty())
                || rel.contains('\0')
            {
                return Err(Failure::invalid(format!(
                    "scrub glob {}: a path relative to / without empty, . or .. components",
                    shown(g)
                )));
            }
            globs.push(rel.to_string());
        }
        Scrub::build(globs)
    }

    fn build(globs: Vec<String>) -> Result<Scrub, Failure> {
        let mut b = globset::GlobSetBuilder::new();
        for g in &globs {
            let glob = globset::GlobBuilder::new(g)
                .literal_separator(true)
                .backslash_escape(true)
                .build()
                .map_err(|e| Failure::invalid(format!("scrub glob {}: {e}", shown(g))))?;
            b.add(glob);
        }
        let set = b
            .build()
            .map_err(|e| Failure::invalid(format!("scrub globs: {e}")))?;
        Ok(Scrub { set, globs })
    }

    /// These globs and the files the node wrote into the sandbox for itself (its
    /// `/etc/resolv.conf` with sandbox networking), which are no part of what a user made.
    /// `extra` holds fixed, valid globs.
    /// Errors: as [`Scrub::new`] (never, for valid globs).
    pub fn with_node_files(&self, extra: &[&str]) -> Result<Scrub, Failure> {
        let mut globs = self.globs.clone();
        globs.extend(extra.iter().map(|g| g.to_string()));
        Scrub::build(globs)
    }

    /// Leaves nothing out (a snapshot).
    pub fn none() -> Scrub {
        Scrub {
            set: globset::GlobSet::empty(),
            globs: Vec::new(),
        }
    }

    /// The globs, defaults first.
    pub fn globs(&self) -> &[String] {
        &self.globs
    }

    fn matches(&self, rel: &[u8]) -> bool {
        !self.globs.is_empty() && self.set.is_match(Path::new(OsStr::from_bytes(rel)))
    }
}

/// What a pack wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Packed {
    /// Tar entries written (whiteouts included).
    pub entries: u64,
    /// Bytes of regular files.
    pub file_bytes: u64,
    /// Paths the scrub list left out (each a whiteout where a lower layer has the path).
    pub scrubbed: u64,
}

/// Writes the overlay upper directory `upper` as an OCI layer tar to `out`, leaving out what
/// `scrub` matches (a whiteout in its place where one of `lowers`, the `rootfs` directories
/// below, has the path, so it is gone from the image too). Entries come in name order, so
/// the same files give the same tar and the same layer. Regular files may add up to
/// `max_bytes` (a sandbox's disk size: more than that are sparse files, which the layer would
/// hold in full, so a small disk could fill the store). Errors: [`PackError`].
pub fn write_diff<W: Write>(
    upper: &OwnedFd,
    scrub: &Scrub,
    lowers: &[PathBuf],
    max_bytes: u64,
    out: W,
) -> Result<Packed, PackError> {
    let mut w = Walker {
        tar: tar::Builder::new(out),
        scrub,
        lowers,
        max_bytes,
        links: HashMap::new(),
        packed: Packed::default(),
    };
    let root = rfs::openat(
        upper,
        ".",
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .map_err(|e| read_err(b"/", e.into()))?;
    if opaque(&root) {
        w.whiteout(b"", b".wh..wh..opq")?;
    }
    w.dir(&root, b"", 0)?;
    w.tar
        .finish()
        .map_err(|e| read_err(b"(the tar's end)", e))?;
    Ok(w.packed)
}

fn read_err(entry: &[u8], source: io::Error) -> PackError {
    PackError::Read {
        entry: shown(&String::from_utf8_lossy(entry)),
        source,
    }
}

fn opaque(dir: &OwnedFd) -> bool {
    let mut v = [0u8; 4];
    matches!(rfs::fgetxattr(dir, OPAQUE_XATTR, &mut v), Ok(n) if v.get(..n) == Some(&b"y"[..]))
}

struct Walker<'a, W: Write> {
    tar: tar::Builder<W>,
    scrub: &'a Scrub,
    lowers: &'a [PathBuf],
    max_bytes: u64,
    /// (dev, ino) of files with more than one link → the path written first.
    links: HashMap<(u64, u64), Vec<u8>>,
    packed: Packed,
}

impl<W: Write> Walker<'_, W> {
    fn dir(&mut self, fd: &OwnedFd, prefix: &[u8], depth: usize) -> Result<(), PackError> {
        if depth > MAX_DEPTH {
            return Err(PackError::Refused {
                entry: shown(&String::from_utf8_lossy(prefix)),
                why: format!("more than {MAX_DEPTH} directory levels"),
            });
        }
        let names = dir_names(fd).map_err(|e| read_err(prefix, e))?;
        for name in names {
            let rel = if prefix.is_empty() {
                name.clone()
            } else {
                [prefix, b"/", &name].concat()
            };
            self.entry(fd, prefix, &name, &rel, depth)?;
        }
        Ok(())
    }

    fn entry(
        &mut self,
        parent: &OwnedFd,
        prefix: &[u8],
        name: &[u8],
        rel: &[u8],
        depth: usize,
    ) -> Result<(), PackError> {
        let n = OsStr::from_bytes(name);
        let st = rfs::statat(parent, n, AtFlags::SYMLINK_NOFOLLOW)
            .map_err(|e| read_err(rel, e.into()))?;
        let kind = FileType::from_raw_mode(st.st_mode);
        let whiteout = kind == FileType::CharacterDevice && st.st_rdev == 0;
        if self.scrub.matches(rel) {
            self.packed.scrubbed += 1;
            if whiteout || self.in_lowers(rel) {
                self.whiteout(prefix, &[b".wh.", name].concat())?;
            }
            return Ok(());
        }
        let mut h = Header::new_gnu();
        h.set_mode(st.st_mode & 0o7777);
        h.set_uid(u64::from(st.st_uid));
        h.set_gid(u64::from(st.st_gid));
        h.set_mtime(u64::try_from(st.st_mtime).unwrap_or(0));
        h.set_size(0);
        let path = Path::new(OsStr::from_bytes(rel));
        match kind {
            FileType::CharacterDevice if whiteout => {
                return self.whiteout(prefix, &[b".wh.", name].concat());
            }
            FileType::CharacterDevice | FileType::BlockDevice => {
                return Err(PackError::Refused {
                    entry: shown(&String::from_utf8_lossy(rel)),
                    why: "a device node: image layers hold none".into(),
                });
            }
            FileType::Socket => return Ok(()),
            FileType::Directory => {
                let fd = rfs::openat(
                    parent,
                    n,
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                )
                .map_err(|e| read_err(rel, e.into()))?;
                h.set_entry_type(EntryType::Directory);
                self.append(&mut h, path, io::empty(), rel)?;
                if opaque(&fd) {
                    self.whiteout(rel, b".wh..wh..opq")?;
                }
                return self.dir(&fd, rel, depth + 1);
            }
            FileType::Symlink => {
                let target =
                    rfs::readlinkat(parent, n, Vec::new()).map_err(|e| read_err(rel, e.into()))?;
                h.set_entry_type(EntryType::Symlink);
                self.tar
                    .append_link(
                        &mut h,
                        path,
                        Path::new(OsStr::from_bytes(target.as_bytes())),
                    )
                    .map_err(|e| read_err(rel, e))?;
            }
            FileType::Fifo => {
                h.set_entry_type(EntryType::Fifo);
                self.append(&mut h, path, io::empty(), rel)?;
            }
            FileType::RegularFile => {
                let key = (st.st_dev, st.st_ino);
                if st.st_nlink > 1 {
                    if let Some(first) = self.links.get(&key).cloned() {
                        h.set_entry_type(EntryType::Link);
                        self.tar
                            .append_link(&mut h, path, Path::new(OsStr::from_bytes(&first)))
                            .map_err(|e| read_err(rel, e))?;
                        self.packed.entries += 1;
                        return Ok(());
                    }
                    self.links.insert(key, rel.to_vec());
                }
                let f = rfs::openat(
                    parent,
                    n,
                    OFlags::RDONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC | OFlags::NOCTTY,
                    Mode::empty(),
                )
                .map_err(|e| read_err(rel, e.into()))?;
                let size = u64::try_from(st.st_size).unwrap_or(0);
                if self.packed.file_bytes.saturating_add(size) > self.max_bytes {
                    return Err(PackError::Refused {
                        entry: shown(&String::from_utf8_lossy(rel)),
                        why: format!(
                            "the files add up to more than {} MB, the sandbox's disk (sparse files are stored in full)",
                            self.max_bytes >> 20
                        ),
                    });
                }
                h.set_entry_type(EntryType::Regular);
                h.set_size(size);
                self.append(
                    &mut h,
                    path,
                    Exactly::new(std::fs::File::from(f), size),
                    rel,
                )?;
                self.packed.file_bytes += size;
            }
            FileType::Unknown => {
                return Err(PackError::Refused {
                    entry: shown(&String::from_utf8_lossy(rel)),
                    why: "a file of unknown type".into(),
                })
            }
        }
        self.packed.entries += 1;
        Ok(())
    }

    fn append<R: Read>(
        &mut self,
        h: &mut Header,
        path: &Path,
        data: R,
        rel: &[u8],
    ) -> Result<(), PackError> {
        self.tar
            .append_data(h, path, data)
            .map_err(|e| read_err(rel, e))?;
        if h.entry_type() == EntryType::Directory {
            self.packed.entries += 1;
        }
        Ok(())
    }

    /// A whiteout entry `name` (`.wh.<x>` or the opaque marker) in directory `dir`.
    fn whiteout(&mut self, dir: &[u8], name: &[u8]) -> Result<(), PackError> {
        let rel = if dir.is_empty() {
            name.to_vec()
        } else {
            [dir, b"/", name].concat()
        };
        let mut h = Header::new_gnu();
        h.set_entry_type(EntryType::Regular);
        h.set_mode(0o600);
        h.set_uid(0);
        h.set_gid(0);
        h.set_size(0);
        h.set_mtime(0);
        self.tar
            .append_data(&mut h, Path::new(OsStr::from_bytes(&rel)), io::empty())
            .map_err(|e| read_err(&rel, e))?;
        self.packed.entries += 1;
        Ok(())
    }

    /// Whether a layer below has `rel` (never following a symlink on the way).
    fn in_lowers(&self, rel: &[u8]) -> bool {
        self.lowers.iter().any(|l| {
            let Ok(root) = rfs::open(
                l,
                OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
                Mode::empty(),
            ) else {
                return false;
            };
            rfs::openat2(
                &root,
                OsStr::from_bytes(rel),
                OFlags::PATH | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::empty(),
                ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
            )
            .is_ok()
        })
    }
}

/// Reads exactly `size` bytes: the file's, then zeros if it got shorter since it was
/// measured (a tar entry must hold what its header says).
struct Exactly<R> {
    inner: io::Take<R>,
    left: u64,
}

impl<R: Read> Exactly<R> {
    fn new(r: R, size: u64) -> Self {
        Exactly {
            inner: r.take(size),
            left: size,
        }
    }
}

impl<R: Read> Read for Exactly<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.left == 0 {
            return Ok(0);
        }
        let n = match self.inner.read(buf)? {
            0 => {
                let n = buf
                    .len()
                    .min(usize::try_from(self.left).unwrap_or(usize::MAX));
                if let Some(tail) = buf.get_mut(..n) {
                    tail.fill(0);
                }
                n
            }
            n => n,
        };
        self.left -= n as u64;
        Ok(n)
    }
}

/// A pipe's read end that fails at its end unless the writer said it finished: a pack that
/// broke off must never be taken for a short but whole layer.
struct Finished {
    inner: io::PipeReader,
    done: Arc<AtomicBool>,
}

impl Read for Finished {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        if n == 0 && !buf.is_empty() && !self.done.load(Ordering::SeqCst) {
            return Err(io::Error::other("the pack stopped before its end"));
        }
        Ok(n)
    }
}

/// Packs `upper` (see [`write_diff`], `max_bytes` too) straight into `store` as a new layer,
/// named `layer` in errors, its opaque directories expanded against `lowers`. Returns the layer's meta
/// (its `diff_id` names it) and what was packed. Nothing of a failed pack stays in the store
/// but what `image gc` removes. Errors: [`PackError`].
pub fn pack_into_store(
    store: &Store,
    upper: OwnedFd,
    scrub: &Scrub,
    lowers: &[PathBuf],
    max_bytes: u64,
    layer: &str,
) -> Result<(LayerMeta, Packed), PackError> {
    let (r, w) = io::pipe().map_err(|e| read_err(b"(a pipe)", e))?;
    let done = Arc::new(AtomicBool::new(false));
    let (scrub2, lowers2, done2) = (scrub.clone(), lowers.to_vec(), done.clone());
    let writer = std::thread::Builder::new()
        .name("pack".into())
        .spawn(move || {
            let mut out = io::BufWriter::with_capacity(256 << 10, w);
            let packed = write_diff(&upper, &scrub2, &lowers2, max_bytes, &mut out)?;
            out.flush().map_err(|e| read_err(b"(the pipe)", e))?;
            done2.store(true, Ordering::SeqCst);
            Ok::<Packed, PackError>(packed)
        })
        .map_err(|e| read_err(b"(a thread)", e))?;
    let imported = import_layer(
        store,
        Finished { inner: r, done },
        &Expected::default(),
        layer,
        lowers,
        Limits::default(),
    );
    let packed = match writer.join() {
        Ok(r) => r,
        Err(_) => Err(read_err(b"(the pack thread)", io::Error::other("panicked"))),
    };
    // The writer's own failure says more than the reader's "stopped before its end".
    let packed = packed?;
    Ok((imported?, packed))
}

#[cfg(test)]
mod tests;
