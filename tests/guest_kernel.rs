//! The guest kernel's config (docs/microvm.md "Guest kernel"): `packaging/kernel/build.sh
//! --config-only` resolves `packaging/kernel/microvm.config` over `make tinyconfig` and the
//! kernel's `kvm_guest.config` from Debian's kernel source; every line of the fragment
//! holds in what it resolves, and where the source and compiler are those the committed
//! `packaging/kernel/config-6.12` came from, the result is that file.
//!
//! The full build (about 10 minutes on two cores) is not run here; docs/microvm.md says
//! how it was last run and booted.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;
use std::process::Command;

fn packaging() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/packaging/kernel"))
}

/// The fragment's settings, `(CONFIG_X, value)`.
fn fragment() -> Vec<(String, String)> {
    std::fs::read_to_string(packaging().join("microvm.config"))
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(|l| {
            let (k, v) = l.split_once('=').unwrap_or_else(|| panic!("{l:?}"));
            (k.to_string(), v.to_string())
        })
        .collect()
}

/// The fragment's lines `config` (a resolved `.config`) does not hold.
fn unheld(config: &str) -> Vec<String> {
    let set: Vec<&str> = config
        .lines()
        .filter(|l| l.starts_with("CONFIG_"))
        .collect();
    fragment()
        .into_iter()
        .filter(|(k, v)| {
            let line = format!("{k}={v}");
            if v == "n" {
                set.iter().any(|l| l.starts_with(&format!("{k}=")))
            } else {
                !set.contains(&line.as_str())
            }
        })
        .map(|(k, v)| format!("{k}={v}"))
        .collect()
}

/// A config's settings without its comments (the header names the release).
fn settings(config: &str) -> Vec<&str> {
    config
        .lines()
        .filter(|l| l.starts_with("CONFIG_"))
        .collect()
}

/// The release a config was resolved for, from its header ("Linux/x86 6.12.118 Kernel
/// Configuration").
fn release(config: &str) -> String {
    config
        .lines()
        .find_map(|l| l.strip_prefix("# Linux/x86 "))
        .and_then(|l| l.split_whitespace().next())
        .unwrap()
        .to_string()
}

#[test]
fn the_committed_config_holds_every_line_of_the_fragment() {
    let committed = std::fs::read_to_string(packaging().join("config-6.12")).unwrap();
    assert!(fragment().len() > 100);
    assert_eq!(unheld(&committed), Vec::<String>::new());
    // What the guest cannot boot without, whatever the fragment says.
    for line in [
        "CONFIG_VIRTIO_MMIO=y",
        "CONFIG_VIRTIO_BLK=y",
        "CONFIG_VIRTIO_CONSOLE=y",
        "CONFIG_ACPI=y",
        "CONFIG_PCI=y",
        "CONFIG_OVERLAY_FS=y",
        "CONFIG_EROFS_FS=y",
        "CONFIG_EXT4_FS=y",
        "CONFIG_CGROUPS=y",
        "# CONFIG_MODULES is not set",
    ] {
        assert!(committed.lines().any(|l| l == line), "{line}");
    }
}

#[test]
fn build_sh_resolves_the_fragment_and_the_committed_config() {
    assert!(
        nix::unistd::geteuid().is_root(),
        "build.sh installs Debian's kernel source where it is missing: run as root"
    );
    let out = tempfile::tempdir().unwrap();
    let run = Command::new("bash")
        .arg(packaging().join("build.sh"))
        .arg("--config-only")
        .arg(out.path())
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "build.sh --config-only: {}{}",
        String::from_utf8_lossy(&run.stdout),
        String::from_utf8_lossy(&run.stderr)
    );
    let path = String::from_utf8_lossy(&run.stdout).trim().to_string();
    let resolved = std::fs::read_to_string(&path).unwrap();
    assert_eq!(unheld(&resolved), Vec::<String>::new());
    let committed = std::fs::read_to_string(packaging().join("config-6.12")).unwrap();
    // The compiler decides settings too (what it supports).
    let compiler = |c: &str| {
        c.lines()
            .find(|l| l.starts_with("CONFIG_CC_VERSION_TEXT="))
            .map(str::to_string)
    };
    if release(&resolved) == release(&committed) && compiler(&resolved) == compiler(&committed) {
        assert_eq!(
            settings(&resolved),
            settings(&committed),
            "packaging/kernel/config-6.12 is not what build.sh resolves: refresh it from {path}"
        );
    } else {
        // Another source or compiler may add settings of its own; the fragment's still
        // hold (above).
        eprintln!(
            "the kernel source is {} ({:?}) and config-6.12 came from {} ({:?}): refresh it \
             from {path}",
            release(&resolved),
            compiler(&resolved),
            release(&committed),
            compiler(&committed)
        );
    }
}
