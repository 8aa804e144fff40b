//! The executable must run where there is nothing else: the agents are mounted into arbitrary
//! images (busybox, Alpine). Copy it into an empty directory and run it chrooted there.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::process::Command;

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("Uid:"))
                .map(|l| l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

#[test]
fn runs_in_an_empty_chroot() {
    if !is_root() {
        assert_ne!(
            std::env::var("CI").as_deref(),
            Ok("true"),
            "CI runs as root: this test must not be skipped there"
        );
        eprintln!("skipping: chroot needs root");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(env!("CARGO_BIN_EXE_opendsec"), dir.path().join("opendsec")).unwrap();
    assert_eq!(
        std::fs::read_dir(dir.path()).unwrap().count(),
        1,
        "the chroot holds only the binary"
    );
    let out = Command::new("chroot")
        .arg(dir.path())
        .arg("/opendsec")
        .arg("version")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        format!("opendsec {}", env!("CARGO_PKG_VERSION"))
    );
}

#[test]
fn dispatches_on_argv0_and_on_the_first_argument() {
    let dir = tempfile::tempdir().unwrap();
    let link = dir.path().join("opendsecctl");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_opendsec"), &link).unwrap();
    let out = Command::new(&link).arg("version").output().unwrap();
    assert!(out.status.success());
    let out = Command::new(env!("CARGO_BIN_EXE_opendsec"))
        .arg("no-such-role")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
}
