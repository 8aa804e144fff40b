//! Garbage collection of the image store (docs/images.md "Deletion and cleanup"): removes the
//! layers that no manifest and no running sandbox (`inuse/`) refers to, and what interrupted
//! writes left in `tmp/`, sparing anything younger than the grace period, so an import in
//! progress (its layers are in place before its manifest) keeps what it wrote. A layer goes by
//! one rename into `tmp/` first, so `layers/` never holds a half-removed layer. Memory
//! snapshots (`snapshots/<name>`) no manifest names go the same way.
//!
//! Every manifest must be readable: a store with one that is not is not collected at all,
//! since the layers that manifest names cannot be told apart from garbage.

use std::collections::HashSet;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::digest::Digest;
use super::store::{ImageManifest, Store};

/// How a collection runs.
#[derive(Debug, Clone, Copy)]
pub struct GcOptions {
    /// Anything modified more recently than this stays.
    pub grace: Duration,
    /// Report what would go, remove nothing.
    pub dry_run: bool,
}

/// One thing removed (or, in a dry run, that would be).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Removed {
    /// `layer <hex>`, `snapshot <name>` or `tmp/<name>`.
    pub what: String,
    /// Bytes its removal frees: the blocks allocated to its regular files that no other
    /// link holds (a sparse RAM file counts what it holds, not its length; a disk a
    /// running copy still links counts nothing).
    pub bytes: u64,
}

/// What a collection did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct GcReport {
    pub removed: Vec<Removed>,
    /// Layers kept because something refers to them.
    pub kept_referenced: usize,
    /// Unreferenced layers and leftovers kept because they are younger than the grace.
    pub kept_young: usize,
}

/// Why a collection could not run.
#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error("image store {root}: {what}")]
    Io {
        root: PathBuf,
        what: String,
        #[source]
        source: io::Error,
    },
    /// A manifest or in-use record that cannot be read: nothing was removed.
    #[error("image store {root}: {path} cannot be read ({why}); nothing was removed")]
    Unreadable {
        root: PathBuf,
        path: PathBuf,
        why: String,
    },
}

/// Collects `store`. Errors: `Unreadable` (nothing removed), `Io` (a directory that cannot be
/// listed, a removal that failed: what was removed before it stays removed).
pub fn collect(store: &Store, o: &GcOptions) -> Result<GcReport, GcError> {
    let root = store.root().to_path_buf();
    let io_err = |what: String| {
        let root = root.clone();
        move |source| GcError::Io { root, what, source }
    };
    let referenced = referenced(store)?;
    let now = SystemTime::now();
    let young = |p: &Path| -> bool {
        let newest = newest_mtime(p);
        now.duration_since(newest).unwrap_or_default() < o.grace
    };
    let mut report = GcReport::default();
    // Layers, and memory snapshots no manifest names (a deleted image's that a crash left,
    // or one an edge wrote for an image never registered). Copies restored from a snapshot
    // hold its files by hard links or copies of their own, so it can go while they run.
    let is_layer = |hex: &str| Digest::parse(&format!("sha256:{hex}")).is_ok();
    let is_snapshot = |name: &str| store.snapshot_dir(name).is_some();
    let kinds: [Kind<'_>; 2] = [
        ("layers", "layer", &is_layer, str::to_string),
        ("snapshots", "snapshot", &is_snapshot, snapshot_key),
    ];
    for (top, kind, valid, key) in kinds {
        let parent = root.join(top);
        let mut names: Vec<String> = list(&parent).map_err(io_err(format!("listing {top}/")))?;
        names.sort();
        for name in names {
            let dir = parent.join(&name);
            if !valid(&name) {
                tracing::warn!(path = %dir.display(), "not a {kind}'s name; left alone");
                continue;
            }
            if referenced.contains(&key(&name)) {
                report.kept_referenced += 1;
                continue;
            }
            if young(&dir) {
                report.kept_young += 1;
                continue;
            }
            let bytes = tree_bytes(&dir);
            if !o.dry_run {
                let grave = root
                    .join("tmp")
                    .join(format!("gc-{name}-{:016x}", rand::random::<u64>()));
                fs::rename(&dir, &grave).map_err(io_err(format!("moving {kind} {name} out")))?;
                fs::remove_dir_all(&grave).map_err(io_err(format!("removing {kind} {name}")))?;
            }
            report.removed.push(Removed {
                what: format!("{kind} {name}"),
                bytes,
            });
        }
    }
    let tmp = root.join("tmp");
    let mut names = list(&tmp).map_err(io_err("listing tmp/".into()))?;
    names.sort();
    for name in names {
        let p = tmp.join(&name);
        // Our own graves go whatever their age: they were removed above in this run or
        // were left by a collection that stopped half way.
        if !name.starts_with("gc-") && young(&p) {
            report.kept_young += 1;
            continue;
        }
        let bytes = tree_bytes(&p);
        if !o.dry_run {
            let r = if p.is_dir() && !p.is_symlink() {
                fs::remove_dir_all(&p)
            } else {
                fs::remove_file(&p)
            };
            match r {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(io_err(format!("removing tmp/{name}"))(e)),
            }
        }
        report.removed.push(Removed {
            what: format!("tmp/{name}"),
            bytes,
        });
    }
    if !o.dry_run {
        prune_empty(&root.join("images"), &young);
    }
    Ok(report)
}

/// Removes the directories under `dir` that hold nothing (an image whose last tag was
/// deleted, a project whose last image was), deepest first, sparing those changed within the
/// grace. rmdir(2) refuses a directory that is not empty, so a manifest written meanwhile
/// stays, and its writer makes the directory again if it went first
/// ([`Store::write_manifest`]). Returns how many went; a directory that cannot go is left.
fn prune_empty(dir: &Path, young: &dyn Fn(&Path) -> bool) -> usize {
    let mut gone = 0;
    let Ok(rd) = fs::read_dir(dir) else {
        return 0;
    };
    for e in rd.flatten() {
        if !e.file_type().is_ok_and(|t| t.is_dir()) {
            continue;
        }
        let sub = e.path();
        gone += prune_empty(&sub, young);
        if !young(&sub) && fs::remove_dir(&sub).is_ok() {
            gone += 1;
        }
    }
    gone
}

/// A directory of entries that go when nothing names them: its name, what an entry is,
/// which names are entries, and an entry's key in [`referenced`]'s set.
type Kind<'a> = (
    &'a str,
    &'a str,
    &'a dyn Fn(&str) -> bool,
    fn(&str) -> String,
);

/// How [`referenced`] holds a memory snapshot's directory name (a layer's hex has no `:`).
fn snapshot_key(name: &str) -> String {
    format!("snapshot:{name}")
}

/// The layers (as hex) that some manifest or in-use record names, and the memory snapshots
/// (as [`snapshot_key`]) that some manifest names.
fn referenced(store: &Store) -> Result<HashSet<String>, GcError> {
    let root = store.root().to_path_buf();
    let mut out = HashSet::new();
    let unreadable = |path: &Path, why: String| GcError::Unreadable {
        root: root.clone(),
        path: path.to_path_buf(),
        why,
    };
    let mut files = Vec::new();
    walk_files(&root.join("images"), &mut files)
        .map_err(|e| unreadable(&root.join("images"), e.to_string()))?;
    for f in files
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "json"))
    {
        let text = fs::read_to_string(f).map_err(|e| unreadable(f, e.to_string()))?;
        let m: ImageManifest =
            serde_json::from_str(&text).map_err(|e| unreadable(f, e.to_string()))?;
        out.extend(m.layers.iter().map(|d| d.hex().to_string()));
        if !m.vm_snapshot.is_empty() {
            out.insert(snapshot_key(&m.vm_snapshot));
        }
    }
    let mut records = Vec::new();
    walk_files(&root.join("inuse"), &mut records)
        .map_err(|e| unreadable(&root.join("inuse"), e.to_string()))?;
    for f in &records {
        let text = match fs::read_to_string(f) {
            Ok(t) => t,
            // Released while we looked: it no longer holds anything.
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(unreadable(f, e.to_string())),
        };
        for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let d = Digest::parse(line).map_err(|e| unreadable(f, e.to_string()))?;
            out.insert(d.hex().to_string());
        }
    }
    Ok(out)
}

fn list(dir: &Path) -> io::Result<Vec<String>> {
    match fs::read_dir(dir) {
        Ok(rd) => Ok(rd
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .collect()),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e),
    }
}

fn walk_files(dir: &Path, out: &mut Vec<PathBuf>) -> io::Result<()> {
    let rd = match fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for e in rd {
        let e = e?;
        let ft = e.file_type()?;
        if ft.is_dir() {
            walk_files(&e.path(), out)?;
        } else if ft.is_file() {
            out.push(e.path());
        }
    }
    Ok(())
}

/// The newest modification time of `p` and of what lies directly in it (a layer's
/// `meta.json` is written last, when it is committed).
fn newest_mtime(p: &Path) -> SystemTime {
    let of = |p: &Path| {
        fs::symlink_metadata(p)
            .and_then(|m| m.modified())
            .unwrap_or(SystemTime::UNIX_EPOCH)
    };
    let mut newest = of(p);
    if let Ok(rd) = fs::read_dir(p) {
        for e in rd.flatten() {
            newest = newest.max(of(&e.path()));
        }
    }
    newest
}

fn tree_bytes(p: &Path) -> u64 {
    let Ok(m) = fs::symlink_metadata(p) else {
        return 0;
    };
    if m.is_file() {
        use std::os::unix::fs::MetadataExt;
        return if m.nlink() > 1 { 0 } else { m.blocks() * 512 };
    }
    if !m.is_dir() {
        return 0;
    }
    fs::read_dir(p)
        .map(|rd| rd.flatten().map(|e| tree_bytes(&e.path())).sum())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allocated(p: &Path) -> u64 {
        use std::os::unix::fs::MetadataExt;
        fs::metadata(p).expect("metadata").blocks() * 512
    }
    use crate::images::name::ImageRef;

    fn age(p: &Path, secs: u64) {
        let t = SystemTime::now() - Duration::from_secs(secs);
        let f = fs::File::open(p).expect("open");
        f.set_modified(t).expect("set mtime");
        if p.is_dir() {
            for e in fs::read_dir(p).expect("dir").flatten() {
                fs::File::open(e.path())
                    .and_then(|f| f.set_modified(t))
                    .expect("mtime");
            }
        }
    }

    #[test]
    fn memory_snapshots_no_manifest_names_go_after_the_grace() {
        let d = tempfile::tempdir().expect("tempdir");
        let store = Store::open(d.path()).expect("store");
        let snap = |name: &str| {
            let dir = store.snapshot_dir(name).expect("a snapshot's name");
            fs::create_dir_all(&dir).expect("snapshot dir");
            fs::write(dir.join("memory"), b"ram").expect("memory");
            dir
        };
        let (named, orphan, young) = (snap("1-named"), snap("2-orphan"), snap("3-young"));
        // The orphan's RAM is sparse (1 GiB long, one page written) and its disk is linked
        // by a copy that still runs: what its removal frees is the one page.
        fs::OpenOptions::new()
            .write(true)
            .open(orphan.join("memory"))
            .and_then(|f| f.set_len(1 << 30))
            .expect("sparse memory");
        let held = d.path().join("held-by-a-copy");
        fs::write(&held, vec![7u8; 1 << 20]).expect("disk");
        fs::hard_link(&held, orphan.join("disk.ext4")).expect("link");
        let frees = allocated(&orphan.join("memory"));
        assert!(frees > 0 && frees < 1 << 20, "{frees}");
        fs::create_dir_all(d.path().join("snapshots/Not_Ours")).expect("stranger");
        store
            .write_manifest(
                &ImageRef::parse("root/warm:1").expect("name"),
                &ImageManifest {
                    snapshot: true,
                    memory: true,
                    vm_snapshot: "1-named".into(),
                    ..Default::default()
                },
                false,
            )
            .expect("manifest");
        for p in [&named, &orphan, &d.path().join("snapshots/Not_Ours")] {
            age(p, 2 * 86400);
        }
        let r = collect(
            &store,
            &GcOptions {
                grace: Duration::from_secs(86400),
                dry_run: false,
            },
        )
        .expect("gc");
        let what: Vec<&str> = r.removed.iter().map(|r| r.what.as_str()).collect();
        assert_eq!(what, ["snapshot 2-orphan"]);
        assert_eq!(r.removed[0].bytes, frees);
        assert!(held.exists(), "the copy keeps its link");
        assert!(!orphan.exists());
        assert!(named.join("memory").exists() && young.join("memory").exists());
        assert!(d.path().join("snapshots/Not_Ours").exists());
        assert_eq!(
            list(&d.path().join("tmp")).expect("tmp"),
            Vec::<String>::new()
        );
        assert!(store.snapshot_dir("../layers").is_none() && store.snapshot_dir("").is_none());
    }

    #[test]
    fn unreferenced_old_layers_and_leftovers_go_referenced_young_and_in_use_ones_stay() {
        let d = tempfile::tempdir().expect("tempdir");
        let store = Store::open(d.path()).expect("store");
        let layer = |body: &[u8]| {
            let dg = Digest::of(body);
            store
                .put_layer(&dg, |r| fs::write(r.join("f"), body))
                .expect("layer");
            dg
        };
        let (kept, in_use, old, young) = (
            layer(b"kept"),
            layer(b"inuse"),
            layer(b"old"),
            layer(b"young"),
        );
        store
            .write_manifest(
                &ImageRef::parse("root/a:1").expect("name"),
                &ImageManifest {
                    layers: vec![kept.clone()],
                    ..Default::default()
                },
                false,
            )
            .expect("manifest");
        fs::create_dir_all(d.path().join("inuse/edge-1")).expect("inuse");
        fs::write(
            d.path().join("inuse/edge-1/edge-1.x"),
            format!("{in_use}\n"),
        )
        .expect("record");
        fs::create_dir_all(d.path().join("tmp/layer-1-dead/rootfs")).expect("leftover");
        fs::create_dir_all(d.path().join("tmp/layer-2-busy/rootfs")).expect("in progress");
        fs::create_dir_all(d.path().join("layers/not-a-digest")).expect("stranger");
        for l in [&kept, &in_use, &old] {
            age(&store.layer_dir(l), 2 * 86400);
        }
        age(&d.path().join("tmp/layer-1-dead"), 2 * 86400);
        age(&d.path().join("layers/not-a-digest"), 2 * 86400);

        let o = GcOptions {
            grace: Duration::from_secs(86400),
            dry_run: true,
        };
        let dry = collect(&store, &o).expect("dry run");
        let what: Vec<&str> = dry.removed.iter().map(|r| r.what.as_str()).collect();
        assert_eq!(
            what,
            [format!("layer {}", old.hex()).as_str(), "tmp/layer-1-dead"]
        );
        let dir = store.layer_dir(&old);
        let meta = allocated(&dir.join("meta.json"));
        let file = allocated(&dir.join("rootfs/f"));
        assert!(file > 0 && meta > 0);
        assert_eq!(dry.removed[0].bytes, file + meta, "the file and meta.json");
        assert!(store.has_layer(&old), "a dry run removes nothing");

        let real = collect(
            &store,
            &GcOptions {
                dry_run: false,
                ..o
            },
        )
        .expect("gc");
        assert_eq!(real.removed, dry.removed);
        assert_eq!((real.kept_referenced, real.kept_young), (2, 2));
        assert!(!store.has_layer(&old));
        for l in [&kept, &in_use, &young] {
            assert!(store.has_layer(l));
        }
        assert!(d.path().join("tmp/layer-2-busy").exists());
        assert!(d.path().join("layers/not-a-digest").exists());
        let left: Vec<String> = list(&d.path().join("tmp")).expect("tmp");
        assert_eq!(left, ["layer-2-busy"], "no grave left behind");

        // One unreadable manifest: nothing goes.
        fs::write(d.path().join("images/root/a/2.json"), b"{broken").expect("broken");
        age(&store.layer_dir(&young), 2 * 86400);
        let e = collect(
            &store,
            &GcOptions {
                dry_run: false,
                ..o
            },
        )
        .expect_err("unreadable");
        assert!(matches!(e, GcError::Unreadable { .. }), "{e}");
        assert!(store.has_layer(&young));
    }

    #[test]
    fn empty_image_directories_go_after_the_grace_and_a_new_manifest_makes_them_again() {
        let d = tempfile::tempdir().expect("tempdir");
        let store = Store::open(d.path()).expect("store");
        let layer = Digest::of(b"l");
        store
            .put_layer(&layer, |r| fs::write(r.join("f"), b"l"))
            .expect("layer");
        let m = ImageManifest {
            layers: vec![layer.clone()],
            ..Default::default()
        };
        let (gone, kept) = (
            ImageRef::parse("root/team/gone:1").expect("name"),
            ImageRef::parse("root/team/kept:1").expect("name"),
        );
        store.write_manifest(&gone, &m, false).expect("manifest");
        store.write_manifest(&kept, &m, false).expect("manifest");
        store.delete_manifest(&gone).expect("delete");
        let images = d.path().join("images");
        let o = |grace| GcOptions {
            grace: Duration::from_secs(grace),
            dry_run: false,
        };
        collect(&store, &o(86400)).expect("gc");
        assert!(images.join("root/team/gone").is_dir(), "young: kept");
        collect(&store, &o(0)).expect("gc");
        assert!(!images.join("root/team/gone").exists());
        assert!(
            images.join("root/team/kept/1.json").is_file(),
            "not empty: kept"
        );
        store.delete_manifest(&kept).expect("delete");
        collect(&store, &o(0)).expect("gc");
        assert!(
            !images.join("root").exists() && images.is_dir(),
            "images/ itself stays"
        );
        // The next image of the project makes its directories again.
        store.write_manifest(&kept, &m, false).expect("manifest");
        assert_eq!(store.read_manifest(&kept).expect("read").layers, m.layers);
    }

    #[test]
    fn a_layer_found_stored_by_a_writer_is_young_again() {
        let d = tempfile::tempdir().expect("tempdir");
        let store = Store::open(d.path()).expect("store");
        let layer = Digest::of(b"old");
        store
            .put_layer(&layer, |r| fs::write(r.join("f"), b"old"))
            .expect("layer");
        age(&store.layer_dir(&layer), 2 * 86400);
        assert!(store.reuse_layer(&layer));
        assert!(!store.reuse_layer(&Digest::of(b"absent")));
        let r = collect(
            &store,
            &GcOptions {
                grace: Duration::from_secs(3600),
                dry_run: false,
            },
        )
        .expect("gc");
        assert!(r.removed.is_empty() && store.has_layer(&layer), "{r:?}");
    }
}
