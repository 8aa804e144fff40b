//! `opendsec ctl image store-check` (docs/images.md "Checking a file system") against real
//! file systems: the machine's own (every required item ok, exit 0, nothing left behind) and a
//! ramfs, which has no xattrs and finds no holes (user.* xattrs FAIL, exit 1; the others warn).
//! The ramfs is mounted in a mount namespace of the command's own, so nothing outlives it.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::process::Command;

const BIN: &str = env!("CARGO_BIN_EXE_opendsec");

#[test]
fn a_local_file_system_passes_and_a_ramfs_fails_its_required_xattrs() {
    if !opendsec::sys::root_or_skip("the store-check tests") {
        return;
    }
    let d = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["ctl", "image", "store-check", "-store"])
        .arg(d.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        text.lines().filter(|l| l.starts_with("ok ")).count(),
        13,
        "{text}"
    );
    assert!(text.ends_with("can hold the image store\n"), "{text}");
    assert_eq!(std::fs::read_dir(d.path().join("tmp")).unwrap().count(), 0);

    let r = d.path().join("ramfs");
    std::fs::create_dir(&r).unwrap();
    let out = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(r#"mount -t ramfs ramfs "$1" && exec "$2" ctl image store-check -store "$1""#)
        .args(["sh", r.to_str().unwrap(), BIN])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(1),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let line = |prefix: &str| {
        text.lines()
            .find(|l| l.contains(prefix))
            .unwrap_or("")
            .to_string()
    };
    assert!(line("user.* xattrs").starts_with("FAIL "), "{text}");
    assert!(line("trusted.* xattrs").starts_with("warn "), "{text}");
    assert!(line("holes of sparse files").starts_with("warn "), "{text}");
    assert!(line("hard links").starts_with("ok "), "{text}");
    assert!(
        text.ends_with("cannot hold the image store: 1 required item(s) failed\n"),
        "{text}"
    );
}
