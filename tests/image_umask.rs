//! A layer keeps the modes its tar gives, whatever the umask of the process that imports it
//! or copies it into a node's layer cache (docs/images.md "Untrusted layers", "How nodes use
//! images"): the store must look the same whoever wrote it. A test binary of its own because
//! the umask is the whole process's. Needs root (layer files keep their owners); under
//! CI=true a missing privilege fails.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use nix::sys::stat::{umask, Mode};
use opendsec::images::cache::Layers;
use opendsec::images::digest::Digest;
use opendsec::images::layer::{import_layer, Expected};
use opendsec::images::store::Store;
use opendsec::images::unpack::Limits;

/// (name, mode) of the layer's entries: a name ending in `/` is a directory.
const ENTRIES: &[(&str, u32)] = &[
    ("etc/", 0o755),
    ("etc/hostname", 0o644),
    ("etc/shadow", 0o600),
    ("usr/bin/", 0o755),
    ("usr/bin/tool", 0o755),
    ("usr/bin/su", 0o4755),
    ("root/", 0o700),
    ("root/run.sh", 0o700),
    ("srv/shared/", 0o1777),
    // No entries for its directories: they are made 0755.
    ("opt/app/data", 0o640),
];

/// Directories only an entry's path makes.
const IMPLICIT: &[&str] = &["opt", "opt/app", "srv"];

fn tar() -> Vec<u8> {
    let mut b = tar::Builder::new(Vec::new());
    for (name, mode) in ENTRIES {
        let mut h = tar::Header::new_gnu();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_mode(*mode);
        match name.strip_suffix('/') {
            Some(dir) => {
                h.set_entry_type(tar::EntryType::Directory);
                h.set_size(0);
                b.append_data(&mut h, dir, &[][..]).unwrap();
            }
            None => {
                h.set_entry_type(tar::EntryType::Regular);
                h.set_size(2);
                b.append_data(&mut h, name, &b"x\n"[..]).unwrap();
            }
        }
    }
    b.into_inner().unwrap()
}

fn mode(p: &Path) -> u32 {
    std::fs::symlink_metadata(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .permissions()
        .mode()
        & 0o7777
}

/// Every entry of the layer at `rootfs` has the tar's mode; the directories around it (the
/// layer's own, `rootfs`, the implicit ones) are 0755.
fn check(rootfs: &Path, what: &str) {
    for (name, want) in ENTRIES {
        let p = rootfs.join(name.trim_end_matches('/'));
        assert_eq!(mode(&p), *want, "{what}: {name}: {:o}", mode(&p));
    }
    for dir in IMPLICIT {
        assert_eq!(mode(&rootfs.join(dir)), 0o755, "{what}: {dir}");
    }
    assert_eq!(mode(rootfs), 0o755, "{what}: rootfs");
    let layer_dir = rootfs.parent().unwrap();
    assert_eq!(mode(layer_dir), 0o755, "{what}: {}", layer_dir.display());
}

/// A tmpfs at `dir`, so that the cache copy cannot hardlink the store's files (whose inodes
/// carry the modes already) and has to copy them; lazily unmounted when dropped.
struct Tmpfs<'a>(&'a Path);

impl<'a> Tmpfs<'a> {
    fn at(dir: &'a Path) -> Tmpfs<'a> {
        nix::mount::mount(
            Some("tmpfs"),
            dir,
            Some("tmpfs"),
            nix::mount::MsFlags::empty(),
            Some("size=16m"),
        )
        .unwrap();
        Tmpfs(dir)
    }
}

impl Drop for Tmpfs<'_> {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn layers_keep_the_tars_modes_under_umask_077() {
    if !opendsec::sys::root_or_skip("the umask tests") {
        return;
    }
    // The whole process's umask; nothing else runs in this binary.
    umask(Mode::from_bits_truncate(0o077));
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("store")).unwrap());
    let raw = tar();
    let diff_id = Digest::of(&raw);
    let expected = Expected {
        blob: Some(diff_id.clone()),
        diff_id: Some(diff_id.clone()),
    };
    import_layer(&store, &raw[..], &expected, "l1", &[], Limits::default()).unwrap();
    check(&store.layer_dir(&diff_id).join("rootfs"), "the store");

    // The node's cache, on the store's file system (hardlinks) and on another (copies).
    let same = dir.path().join("cache");
    let other = dir.path().join("tmpfs");
    std::fs::create_dir(&other).unwrap();
    let _mounted = Tmpfs::at(&other);
    for cache in [same, other.join("cache")] {
        let layers = Layers::new(store.clone(), Some(cache.clone())).unwrap();
        let rootfs = layers.get(&diff_id).await.unwrap();
        assert_eq!(rootfs, cache.join(diff_id.hex()).join("rootfs"));
        check(&rootfs, &format!("the cache at {}", cache.display()));
    }
}
