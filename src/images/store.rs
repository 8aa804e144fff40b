//! The image store's layout on disk (docs/images.md "The store"), shared by every node:
//!
//! ```text
//! <root>/layers/<hex>/rootfs/...     a layer's files, overlay format
//! <root>/layers/<hex>/meta.json      what the layer is (LayerMeta)
//! <root>/images/<project>/<name>/<tag>.json   image manifests (ImageManifest)
//! <root>/snapshots/  <root>/vmdisks/  <root>/inuse/
//! <root>/tmp/                        writes in progress (GC removes what a crash left)
//! ```
//!
//! A layer's directory is named by its diff_id's hex (the digest of its uncompressed tar), so a
//! layer is stored once however it was compressed. Layers are written whole into `tmp/` and
//! renamed into place, after the file system has been synced: a layer directory that exists
//! is complete. Two imports of one layer race harmlessly: the second rename finds the first's
//! directory and its own copy is dropped. Manifests are a temporary file, fsync, rename (or a
//! hard link, which fails when the name exists, where the caller did not ask to overwrite).

use std::collections::BTreeMap;
use std::fs;
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use super::digest::Digest;
use super::name::ImageRef;
use crate::types::Failure;

/// The store's top-level directories, made by [`Store::open`].
pub const DIRS: [&str; 6] = ["layers", "images", "snapshots", "vmdisks", "inuse", "tmp"];

/// What a stored layer is (`layers/<hex>/meta.json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LayerMeta {
    /// The digest of the uncompressed tar: the layer's identity.
    pub diff_id: Option<Digest>,
    /// The blob it was imported from (compressed as it came), if any.
    pub blob: Option<Digest>,
    /// Entries and file bytes written.
    pub entries: u64,
    pub file_bytes: u64,
    /// Extended attributes of the tar that were not kept.
    pub xattrs_dropped: u64,
    /// Directories the layer marks opaque (relative, `""` for its root), kept for their
    /// expansion against the layers below (docs/images.md).
    pub opaque: Vec<String>,
    /// When it was written (RFC 3339, UTC).
    pub created: String,
}

/// The `source` of a snapshot of sandbox `id`, which tells the snapshots taken of one
/// sandbox apart (the E2B gateway lists them by it).
pub fn snapshot_source(id: &str) -> String {
    format!("snapshot of sandbox {id}")
}

/// A new, unique name for a memory snapshot's directory under `snapshots/`: when it was
/// made (unix seconds) and 64 random bits.
pub fn new_snapshot_name() -> String {
    let secs = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("{secs}-{:016x}", rand::random::<u64>())
}

/// An image: its layers bottom first, and the defaults its sandboxes start with
/// (`images/<project>/<name>/<tag>.json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ImageManifest {
    /// The layers' diff_ids, bottom first (OCI order).
    pub layers: Vec<Digest>,
    /// `KEY=value` defaults, in order.
    pub env: Vec<String>,
    pub workdir: String,
    pub user: String,
    /// The image this one was made from (`pack_diff`), as `project/name:tag`.
    pub parent: String,
    /// Where it came from (`docker.io/library/python:3.12`, a file), for people.
    pub source: String,
    pub created: String,
    /// The principal that registered it.
    pub created_by: String,
    /// Made by `create_snapshot` (the files as they were; with `memory`, a microVM's too).
    pub snapshot: bool,
    pub memory: bool,
    /// A memory snapshot's directory under `snapshots/` ("" for an image of layers): its
    /// sandboxes are restored from it, not started from `layers`.
    pub vm_snapshot: String,
    /// A memory snapshot's memory (MiB): its sandboxes must ask for as much.
    pub memory_mb: u64,
    /// Anything else worth keeping about it.
    pub labels: BTreeMap<String, String>,
}

/// Failures of the store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("image store {root}: {what}")]
    Io {
        root: PathBuf,
        what: String,
        #[source]
        source: io::Error,
    },
    /// The name is taken and the caller did not ask to overwrite (`conflict`).
    #[error("image {0} exists (overwrite replaces it)")]
    Exists(String),
    /// No such image (`not_found`).
    #[error("image {0} not found")]
    NotFound(String),
    /// A manifest that is not ours to read (`internal`: the store was changed by hand).
    #[error("image {image}: manifest {path} cannot be read")]
    BadManifest {
        image: String,
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
}

impl StoreError {
    /// The caller-facing failure.
    pub fn to_failure(&self) -> Failure {
        let msg = crate::types::chain(self);
        match self {
            StoreError::Exists(_) => Failure::conflict(msg),
            StoreError::NotFound(_) => Failure::not_found(msg),
            StoreError::Io { .. } | StoreError::BadManifest { .. } => Failure::internal(msg),
        }
    }
}

/// An open image store.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

/// A layer being written under `tmp/`: removed when dropped unless committed.
#[derive(Debug)]
pub struct Staging {
    dir: PathBuf,
    done: bool,
}

impl Staging {
    /// The directory the layer's files go into (empty when staged).
    pub fn rootfs(&self) -> PathBuf {
        self.dir.join("rootfs")
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if !self.done {
            if let Err(e) = fs::remove_dir_all(&self.dir) {
                tracing::warn!(dir = %self.dir.display(), error = %e, "removing a staged layer");
            }
        }
    }
}

impl Store {
    /// Opens the store at `root`, making its directories where they are missing.
    /// Errors: `Io` when they cannot be made.
    pub fn open(root: &Path) -> Result<Store, StoreError> {
        let s = Store {
            root: root.to_path_buf(),
        };
        for d in DIRS {
            fs::create_dir_all(root.join(d)).map_err(|e| s.io(format!("making {d}/"), e))?;
        }
        Ok(s)
    }

    /// The store at `root` as it is, making nothing: for readers (edges) that must start
    /// while the store is unreachable, and find out when they use it.
    pub fn at(root: &Path) -> Store {
        Store {
            root: root.to_path_buf(),
        }
    }

    /// The store's root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn io(&self, what: impl Into<String>, source: io::Error) -> StoreError {
        StoreError::Io {
            root: self.root.clone(),
            what: what.into(),
            source,
        }
    }

    /// `layers/<hex>`: the layer's directory (its files in `rootfs/`).
    pub fn layer_dir(&self, diff_id: &Digest) -> PathBuf {
        self.root.join("layers").join(diff_id.hex())
    }

    /// Whether the layer is stored (complete: only whole layers are renamed into place).
    pub fn has_layer(&self, diff_id: &Digest) -> bool {
        self.layer_dir(diff_id).join("meta.json").is_file()
    }

    /// [`Store::has_layer`] for a writer about to name the layer in a new manifest (an import
    /// or pack that finds it stored already): also marks it as just used, so that a garbage
    /// collection running meanwhile counts it inside its grace period instead of removing
    /// it before the manifest that will name it exists (docs/images.md "Deletion and garbage
    /// collection"). A mark that cannot be set is logged; the layer is still reported.
    pub fn reuse_layer(&self, diff_id: &Digest) -> bool {
        let meta = self.layer_dir(diff_id).join("meta.json");
        if !meta.is_file() {
            return false;
        }
        if let Err(e) = fs::File::open(&meta).and_then(|f| f.set_modified(SystemTime::now())) {
            tracing::warn!(layer = %diff_id, error = %e, "marking a stored layer as used");
        }
        true
    }

    /// A fresh, empty layer directory under `tmp/`.
    pub fn stage(&self) -> Result<Staging, StoreError> {
        let name = format!(
            "layer-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        );
        let dir = self.root.join("tmp").join(name);
        dir_0755(&dir).map_err(|e| self.io("staging a layer", e))?;
        let staging = Staging { dir, done: false };
        dir_0755(&staging.rootfs()).map_err(|e| self.io("staging a layer", e))?;
        Ok(staging)
    }

    /// Puts a staged layer in place as `meta.diff_id`: its meta written, the file system
    /// synced, then one rename. When another writer put the same layer in place first, ours
    /// is dropped and theirs kept (they hold the same bytes: the name is their digest).
    pub fn commit_layer(&self, mut staging: Staging, meta: &LayerMeta) -> Result<(), StoreError> {
        let Some(diff_id) = &meta.diff_id else {
            return Err(self.io(
                "committing a layer",
                io::Error::new(io::ErrorKind::InvalidInput, "the layer has no diff_id"),
            ));
        };
        let body = serde_json::to_vec_pretty(meta)
            .map_err(|e| self.io("encoding a layer's meta", e.into()))?;
        write_synced(&staging.dir.join("meta.json"), &body)
            .map_err(|e| self.io("writing a layer's meta", e))?;
        // One syncfs instead of an fsync per file: the layer is durable before it is visible.
        let dirfd = fs::File::open(&staging.dir).map_err(|e| self.io("syncing a layer", e))?;
        rustix::fs::syncfs(&dirfd).map_err(|e| self.io("syncing a layer", e.into()))?;
        let dest = self.layer_dir(diff_id);
        match fs::rename(&staging.dir, &dest) {
            Ok(()) => {
                staging.done = true;
                sync_dir(&self.root.join("layers")).map_err(|e| self.io("syncing layers/", e))?;
                Ok(())
            }
            // ENOTEMPTY/EEXIST: the layer is there already; `staging` is dropped (removed).
            Err(e)
                if matches!(e.raw_os_error(), Some(libc::ENOTEMPTY) | Some(libc::EEXIST))
                    && self.reuse_layer(diff_id) =>
            {
                Ok(())
            }
            Err(e) => Err(self.io(format!("putting layer {diff_id} in place"), e)),
        }
    }

    /// Stages a layer, lets `fill` write its files into the given `rootfs` directory, and
    /// commits it as `diff_id` (the caller vouches for the digest: a layer made here, not
    /// read from a tar). Errors: `Io`, from staging, `fill` or the commit.
    pub fn put_layer(
        &self,
        diff_id: &Digest,
        fill: impl FnOnce(&Path) -> io::Result<()>,
    ) -> Result<(), StoreError> {
        let staging = self.stage()?;
        fill(&staging.rootfs()).map_err(|e| self.io(format!("writing layer {diff_id}"), e))?;
        let meta = LayerMeta {
            diff_id: Some(diff_id.clone()),
            created: chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
            ..Default::default()
        };
        self.commit_layer(staging, &meta)
    }

    /// `snapshots/<name>`, a memory snapshot's directory, for a `name` of
    /// [`new_snapshot_name`]'s form (anything else, a path among them, is `None`).
    pub fn snapshot_dir(&self, name: &str) -> Option<PathBuf> {
        let ok = !name.is_empty()
            && name.len() <= 64
            && name
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        ok.then(|| self.root.join("snapshots").join(name))
    }

    /// Removes memory snapshot `name` (gone already is fine). It is moved into `tmp/`
    /// first, so `snapshots/` never holds a half-removed one. Errors: `Io`.
    pub fn remove_snapshot(&self, name: &str) -> Result<(), StoreError> {
        let Some(dir) = self.snapshot_dir(name) else {
            return Ok(());
        };
        let grave = self
            .root
            .join("tmp")
            .join(format!("gc-{name}-{:016x}", rand::random::<u64>()));
        match fs::rename(&dir, &grave) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(self.io(format!("moving snapshot {name} out"), e)),
        }
        fs::remove_dir_all(&grave).map_err(|e| self.io(format!("removing snapshot {name}"), e))
    }

    /// `images/<project>/<name>/<tag>.json`.
    pub fn manifest_path(&self, image: &ImageRef) -> PathBuf {
        let mut p = self.root.join("images");
        for seg in image.project.split('/') {
            p.push(seg);
        }
        p.push(&image.name);
        p.push(format!("{}.json", image.tag));
        p
    }

    /// Writes `image`'s manifest. Without `overwrite` an existing name is `Exists` and is left
    /// as it was. The manifest is complete on disk before the name points at it.
    pub fn write_manifest(
        &self,
        image: &ImageRef,
        m: &ImageManifest,
        overwrite: bool,
    ) -> Result<(), StoreError> {
        let path = self.manifest_path(image);
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        let body =
            serde_json::to_vec_pretty(m).map_err(|e| self.io("encoding a manifest", e.into()))?;
        // A garbage collection may remove the image's directory once it is empty, or the
        // temporary file under `tmp/` when told `-grace 0s`: whatever went is made again.
        let mut attempt = 0;
        loop {
            attempt += 1;
            fs::create_dir_all(&dir)
                .map_err(|e| self.io(format!("making {}", dir.display()), e))?;
            let tmp = self.root.join("tmp").join(format!(
                "manifest-{}-{:016x}.json",
                std::process::id(),
                rand::random::<u64>()
            ));
            write_synced(&tmp, &body).map_err(|e| self.io("writing a manifest", e))?;
            let placed = if overwrite {
                fs::rename(&tmp, &path)
            } else {
                // link(2) fails with EEXIST if the name is taken, atomically: no check-then-write.
                let r = fs::hard_link(&tmp, &path);
                let _ = fs::remove_file(&tmp);
                r
            };
            match placed {
                Ok(()) => {
                    return sync_dir(&dir).map_err(|e| self.io("syncing a manifest's directory", e))
                }
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
                    return Err(StoreError::Exists(image.to_string()))
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound && attempt < 3 => {
                    let _ = fs::remove_file(&tmp);
                }
                Err(e) => {
                    let _ = fs::remove_file(&tmp);
                    return Err(self.io(format!("placing manifest {}", path.display()), e));
                }
            }
        }
    }

    /// Reads `image`'s manifest. Errors: `NotFound`, `BadManifest`, `Io`.
    pub fn read_manifest(&self, image: &ImageRef) -> Result<ImageManifest, StoreError> {
        let path = self.manifest_path(image);
        let body = match fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::NotFound(image.to_string()))
            }
            Err(e) => return Err(self.io(format!("reading {}", path.display()), e)),
        };
        serde_json::from_slice(&body).map_err(|source| StoreError::BadManifest {
            image: image.to_string(),
            path,
            source,
        })
    }
}

impl Store {
    /// Removes `image`'s manifest (its layers stay until garbage collection). Errors:
    /// `NotFound`, `Io`.
    pub fn delete_manifest(&self, image: &ImageRef) -> Result<(), StoreError> {
        let path = self.manifest_path(image);
        match fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                return Err(StoreError::NotFound(image.to_string()))
            }
            Err(e) => return Err(self.io(format!("removing {}", path.display()), e)),
        }
        if let Some(dir) = path.parent() {
            sync_dir(dir).map_err(|e| self.io("syncing a manifest's directory", e))?;
        }
        Ok(())
    }

    /// The images of `project` and of its subprojects, sorted by name. A manifest that cannot
    /// be read is skipped with a warning rather than hiding every other image; a name on disk
    /// that is no valid image name (a file put there by hand) is skipped the same way.
    /// Errors: `Io` for a directory that cannot be read.
    pub fn list_manifests(
        &self,
        project: &str,
    ) -> Result<Vec<(ImageRef, ImageManifest)>, StoreError> {
        let mut base = self.root.join("images");
        for seg in project.split('/') {
            base.push(seg);
        }
        let mut out = Vec::new();
        // (directory, its path below images/): a tag file's directory is the image's name,
        // and the rest of its path is the project.
        // Tag files right under the project's own directory belong to an image of its parent
        // project named like it, so they are not this project's.
        let mut stack = vec![(base, project.to_string(), true)];
        while let Some((dir, rel, top)) = stack.pop() {
            let rd = match fs::read_dir(&dir) {
                Ok(rd) => rd,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(self.io(format!("listing {}", dir.display()), e)),
            };
            for ent in rd {
                let ent = ent.map_err(|e| self.io(format!("listing {}", dir.display()), e))?;
                let Ok(fname) = ent.file_name().into_string() else {
                    continue;
                };
                let ft = ent
                    .file_type()
                    .map_err(|e| self.io(format!("listing {}", dir.display()), e))?;
                if ft.is_dir() {
                    stack.push((ent.path(), format!("{rel}/{fname}"), false));
                    continue;
                }
                if top {
                    continue;
                }
                let Some(tag) = fname.strip_suffix(".json") else {
                    continue;
                };
                if !ft.is_file() {
                    continue;
                }
                let Some((proj, name)) = rel.rsplit_once('/') else {
                    continue;
                };
                let Ok(image) = ImageRef::parse(&format!("{proj}/{name}:{tag}")) else {
                    tracing::warn!(path = %ent.path().display(), "not an image manifest's name; skipped");
                    continue;
                };
                match self.read_manifest(&image) {
                    Ok(m) => out.push((image, m)),
                    // Deleted between listing and reading.
                    Err(StoreError::NotFound(_)) => {}
                    Err(e) => {
                        tracing::warn!(error = %crate::types::chain(&e), "image manifest skipped")
                    }
                }
            }
        }
        out.sort_by_cached_key(|(r, _)| r.to_string());
        Ok(out)
    }
}

/// Makes the directory `path`, mode 0755 whatever the process's umask (mkdir's mode is
/// masked by it, a chmod is not): a layer must look the same whoever imported or copied it.
pub(crate) fn dir_0755(path: &Path) -> io::Result<()> {
    fs::create_dir(path)?;
    fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
}

fn write_synced(path: &Path, body: &[u8]) -> io::Result<()> {
    let mut f = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(path)?;
    f.write_all(body)?;
    f.sync_all()
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    fs::File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn digest(n: u8) -> Digest {
        Digest::of(&[n])
    }

    #[test]
    fn a_layer_is_visible_only_whole_and_a_second_copy_is_dropped() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Store::open(tmp.path()).unwrap();
        for d in DIRS {
            assert!(tmp.path().join(d).is_dir(), "{d}");
        }
        let meta = LayerMeta {
            diff_id: Some(digest(1)),
            ..Default::default()
        };
        let a = s.stage().unwrap();
        fs::write(a.rootfs().join("f"), b"one").unwrap();
        let b = s.stage().unwrap();
        fs::write(b.rootfs().join("f"), b"one").unwrap();
        assert!(!s.has_layer(&digest(1)));
        s.commit_layer(a, &meta).unwrap();
        assert!(s.has_layer(&digest(1)));
        s.commit_layer(b, &meta).unwrap();
        assert_eq!(
            fs::read(s.layer_dir(&digest(1)).join("rootfs/f")).unwrap(),
            b"one"
        );
        // Both stagings are gone: one renamed into place, the other dropped.
        assert_eq!(fs::read_dir(tmp.path().join("tmp")).unwrap().count(), 0);
        let back: LayerMeta =
            serde_json::from_slice(&fs::read(s.layer_dir(&digest(1)).join("meta.json")).unwrap())
                .unwrap();
        assert_eq!(back, meta);
    }

    #[test]
    fn a_dropped_staging_leaves_nothing() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Store::open(tmp.path()).unwrap();
        let st = s.stage().unwrap();
        fs::create_dir_all(st.rootfs().join("a/b")).unwrap();
        std::os::unix::fs::symlink("/etc", st.rootfs().join("a/b/etc")).unwrap();
        drop(st);
        assert_eq!(fs::read_dir(tmp.path().join("tmp")).unwrap().count(), 0);
        assert!(
            Path::new("/etc/passwd").exists(),
            "removal did not follow the symlink"
        );
    }

    #[test]
    fn manifests_are_placed_atomically_and_kept_unless_overwritten() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Store::open(tmp.path()).unwrap();
        let r = ImageRef::parse("root/rl/py:3.12").unwrap();
        assert_eq!(
            s.manifest_path(&r),
            tmp.path().join("images/root/rl/py/3.12.json")
        );
        assert!(matches!(s.read_manifest(&r), Err(StoreError::NotFound(_))));
        let m1 = ImageManifest {
            layers: vec![digest(1)],
            env: vec!["A=1".into()],
            ..Default::default()
        };
        s.write_manifest(&r, &m1, false).unwrap();
        let m2 = ImageManifest {
            layers: vec![digest(1), digest(2)],
            ..Default::default()
        };
        let e = s.write_manifest(&r, &m2, false).unwrap_err();
        assert_eq!(e.to_failure().reason, crate::types::Reason::Conflict);
        assert_eq!(s.read_manifest(&r).unwrap(), m1);
        s.write_manifest(&r, &m2, true).unwrap();
        assert_eq!(s.read_manifest(&r).unwrap(), m2);
        assert_eq!(fs::read_dir(tmp.path().join("tmp")).unwrap().count(), 0);
        assert_eq!(
            s.read_manifest(&ImageRef::parse("root/rl/py:nope").unwrap())
                .unwrap_err()
                .to_failure()
                .reason,
            crate::types::Reason::NotFound
        );
    }

    #[test]
    fn listing_covers_subprojects_and_not_the_parent_and_delete_removes_one() {
        let tmp = tempfile::tempdir().unwrap();
        let s = Store::open(tmp.path()).unwrap();
        let names = [
            "root/rl:1", // project root, name rl: not root/rl's
            "root/rl/py:3.12",
            "root/rl/py:3.13",
            "root/rl/a/tool:v1",
            "root/rlx/py:1", // a sibling, not a subproject
        ];
        for n in names {
            let r = ImageRef::parse(n).unwrap();
            s.write_manifest(&r, &ImageManifest::default(), false)
                .unwrap();
        }
        // Put there by hand: not a valid tag, and not a manifest at all.
        fs::write(tmp.path().join("images/root/rl/py/BAD TAG.json"), b"{}").unwrap();
        fs::write(tmp.path().join("images/root/rl/py/notes.txt"), b"x").unwrap();
        let listed = |p: &str| -> Vec<String> {
            s.list_manifests(p)
                .unwrap()
                .into_iter()
                .map(|(r, _)| r.to_string())
                .collect()
        };
        assert_eq!(
            listed("root/rl"),
            ["root/rl/a/tool:v1", "root/rl/py:3.12", "root/rl/py:3.13"]
        );
        assert_eq!(listed("root").len(), 5);
        assert!(listed("root/none").is_empty());
        let r = ImageRef::parse("root/rl/py:3.12").unwrap();
        s.delete_manifest(&r).unwrap();
        assert_eq!(
            s.delete_manifest(&r).unwrap_err().to_failure().reason,
            crate::types::Reason::NotFound
        );
        assert_eq!(listed("root/rl"), ["root/rl/a/tool:v1", "root/rl/py:3.13"]);
    }
}
