use super::*;
use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};

fn mknod_whiteout(p: &Path) {
    rfs::mknodat(
        rfs::CWD,
        p,
        FileType::CharacterDevice,
        Mode::empty(),
        rfs::makedev(0, 0),
    )
    .expect("mknod");
}

fn open_dir(p: &Path) -> OwnedFd {
    rfs::open(
        p,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .expect("open")
}

struct Fixture {
    _d: tempfile::TempDir,
    store: Store,
    lower: PathBuf,
    upper: PathBuf,
}

/// A lower layer and an overlay upper directory holding each kind of change.
fn fixture() -> Fixture {
    let d = tempfile::tempdir().expect("tempdir");
    let store = Store::open(&d.path().join("store")).expect("store");
    let lower = d.path().join("lower");
    let upper = d.path().join("upper");
    for p in ["etc", "srv/old", "root", "tmp"] {
        fs::create_dir_all(lower.join(p)).expect("mkdir");
    }
    fs::write(lower.join("etc/gone"), b"x").expect("write");
    fs::write(lower.join("srv/old/x"), b"x").expect("write");
    fs::write(lower.join("root/.bash_history"), b"secret").expect("write");
    for p in ["etc", "srv/old", "tmp/build", "root/.cache", "usr/bin"] {
        fs::create_dir_all(upper.join(p)).expect("mkdir");
    }
    fs::write(upper.join("etc/app.conf"), b"port=8000\n").expect("write");
    fs::set_permissions(
        upper.join("etc/app.conf"),
        fs::Permissions::from_mode(0o640),
    )
    .expect("chmod");
    mknod_whiteout(&upper.join("etc/gone"));
    fs::write(upper.join("srv/old/y"), b"y").expect("write");
    rfs::setxattr(
        upper.join("srv/old"),
        OPAQUE_XATTR,
        b"y",
        rfs::XattrFlags::empty(),
    )
    .expect("opaque xattr");
    fs::write(upper.join("tmp/build/obj.o"), vec![7u8; 4096]).expect("write");
    fs::write(upper.join("root/.cache/pip"), b"cache").expect("write");
    fs::write(upper.join("root/.bash_history"), b"secret\nmore").expect("write");
    fs::write(upper.join("usr/bin/tool"), b"#!/bin/sh\necho tool\n").expect("write");
    fs::hard_link(upper.join("usr/bin/tool"), upper.join("usr/bin/tool2")).expect("link");
    std::os::unix::fs::symlink("/etc/shadow", upper.join("usr/bin/escape")).expect("symlink");
    Fixture {
        _d: d,
        store,
        lower,
        upper,
    }
}

fn root_only() -> bool {
    crate::sys::root_or_skip("pack")
}

#[test]
fn a_diff_keeps_changes_whiteouts_and_links_and_drops_the_scrubbed() {
    if !root_only() {
        return;
    }
    let f = fixture();
    let scrub = Scrub::new(true, &["/srv/old/y".into()]).expect("scrub");
    let lowers = vec![f.lower.clone()];
    let (meta, packed) = pack_into_store(
        &f.store,
        open_dir(&f.upper),
        &scrub,
        &lowers,
        u64::MAX,
        "pack of t",
    )
    .expect("pack");
    let rootfs = f
        .store
        .layer_dir(meta.diff_id.as_ref().expect("diff_id"))
        .join("rootfs");
    assert_eq!(
        fs::read(rootfs.join("etc/app.conf")).expect("conf"),
        b"port=8000\n"
    );
    assert_eq!(
        fs::metadata(rootfs.join("etc/app.conf"))
            .expect("meta")
            .mode()
            & 0o7777,
        0o640
    );
    // The upper's whiteout stays a whiteout.
    let wh = fs::symlink_metadata(rootfs.join("etc/gone")).expect("whiteout");
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(&wh.file_type()) && wh.rdev() == 0);
    // The opaque directory is expanded: what the lower had there is whited out; what the
    // caller scrubbed from it is not kept.
    let x = fs::symlink_metadata(rootfs.join("srv/old/x")).expect("expanded");
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(
        &x.file_type()
    ));
    assert!(!rootfs.join("srv/old/y").exists());
    // Scrubbed: /tmp's contents and /root/.cache go; the lower's history is whited out.
    assert!(rootfs.join("tmp").is_dir());
    assert_eq!(fs::read_dir(rootfs.join("tmp")).expect("tmp").count(), 0);
    assert!(fs::symlink_metadata(rootfs.join("root/.cache")).is_err());
    let h = fs::symlink_metadata(rootfs.join("root/.bash_history")).expect("history whiteout");
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(
        &h.file_type()
    ));
    // Links stay links; a symlink is kept as one, never followed.
    let (a, b) = (
        fs::metadata(rootfs.join("usr/bin/tool")).expect("tool"),
        fs::metadata(rootfs.join("usr/bin/tool2")).expect("tool2"),
    );
    assert_eq!(a.ino(), b.ino());
    assert_eq!(
        fs::read_link(rootfs.join("usr/bin/escape")).expect("link"),
        Path::new("/etc/shadow")
    );
    assert_eq!(packed.scrubbed, 4, "{packed:?}");
    // The same files give the same layer.
    let (again, _) = pack_into_store(
        &f.store,
        open_dir(&f.upper),
        &scrub,
        &lowers,
        u64::MAX,
        "again",
    )
    .expect("pack");
    assert_eq!(again.diff_id, meta.diff_id);
}

#[test]
fn a_snapshot_keeps_everything() {
    if !root_only() {
        return;
    }
    let f = fixture();
    let (meta, packed) = pack_into_store(
        &f.store,
        open_dir(&f.upper),
        &Scrub::none(),
        std::slice::from_ref(&f.lower),
        u64::MAX,
        "snapshot",
    )
    .expect("pack");
    let rootfs = f
        .store
        .layer_dir(meta.diff_id.as_ref().expect("diff_id"))
        .join("rootfs");
    assert_eq!(
        fs::read(rootfs.join("tmp/build/obj.o")).expect("obj").len(),
        4096
    );
    assert_eq!(
        fs::read(rootfs.join("root/.cache/pip")).expect("cache"),
        b"cache"
    );
    assert_eq!(packed.scrubbed, 0);
}

#[test]
fn a_device_node_is_refused_naming_it_and_leaves_no_layer() {
    if !root_only() {
        return;
    }
    let f = fixture();
    rfs::mknodat(
        rfs::CWD,
        f.upper.join("etc/disk"),
        FileType::BlockDevice,
        Mode::from_raw_mode(0o600),
        rfs::makedev(7, 0),
    )
    .expect("mknod");
    let e = pack_into_store(
        &f.store,
        open_dir(&f.upper),
        &Scrub::none(),
        &[],
        u64::MAX,
        "p",
    )
    .expect_err("a device node");
    let fl = e.to_failure();
    assert_eq!(fl.reason, crate::types::Reason::Invalid, "{fl:?}");
    assert!(fl.message.contains("etc/disk"), "{}", fl.message);
    assert_eq!(
        fs::read_dir(f.store.root().join("layers"))
            .expect("layers")
            .count(),
        0
    );
}

#[test]
fn sparse_files_beyond_the_disk_are_refused() {
    if !root_only() {
        return;
    }
    let f = fixture();
    // 64 MiB that take no space on the sandbox's disk, but would in the layer.
    let big = fs::File::create(f.upper.join("srv/sparse")).expect("create");
    big.set_len(64 << 20).expect("truncate");
    let e = pack_into_store(
        &f.store,
        open_dir(&f.upper),
        &Scrub::none(),
        &[],
        16 << 20,
        "p",
    )
    .expect_err("beyond the disk");
    let fl = e.to_failure();
    assert_eq!(fl.reason, crate::types::Reason::Invalid, "{fl:?}");
    assert!(
        fl.message.contains("srv/sparse") && fl.message.contains("16 MB"),
        "{}",
        fl.message
    );
    assert_eq!(
        fs::read_dir(f.store.root().join("layers"))
            .expect("layers")
            .count(),
        0
    );
}

#[test]
fn bad_scrub_globs_are_invalid() {
    for g in ["", "/", "a/../b", "./x", "a//b", "[x"] {
        let e = Scrub::new(true, &[g.to_string()]).expect_err(g);
        assert_eq!(e.reason, crate::types::Reason::Invalid, "{g}");
    }
    let many: Vec<String> = (0..=MAX_SCRUB).map(|i| format!("x{i}")).collect();
    assert!(Scrub::new(false, &many).is_err());
    let s = Scrub::new(true, &["srv/repo/.git".into()]).expect("scrub");
    assert!(s.matches(b"tmp/x") && !s.matches(b"tmp") && !s.matches(b"tmp/x/y"));
    assert!(s.matches(b"home/ann/.bash_history") && !s.matches(b"home/a/b/.bash_history"));
    assert!(s.matches(b"srv/repo/.git") && !s.matches(b"srv/repo"));
}
