//! Layer import against untrusted tars (docs/images.md "Untrusted layers"): a corpus of
//! hand-made malicious tars, each refused with `invalid` naming the entry and the layer, with
//! nothing changed around the store (a checksummed canary tree) and nothing left in it; a
//! well-formed layer in overlay format; and a property test feeding generated and corrupted
//! tars. Needs root (owners and whiteout devices); under CI=true a missing privilege fails.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use opendsec::images::digest::Digest;
use opendsec::images::layer::{import_layer, Expected, LayerError};
use opendsec::images::store::Store;
use opendsec::images::unpack::Limits;
use opendsec::types::Reason;
use proptest::prelude::*;

fn root_or_skip() -> bool {
    opendsec::sys::root_or_skip("the layer import tests")
}

/// One tar entry, written byte by byte so that names the `tar` crate's builder would refuse
/// (`..`, absolute, empty) can be made.
#[derive(Debug, Clone)]
struct E {
    name: Vec<u8>,
    kind: u8,
    data: Vec<u8>,
    link: Vec<u8>,
    dev: (u32, u32),
    mode: u32,
    uid: u32,
}

fn e(name: &str, kind: u8) -> E {
    E {
        name: name.as_bytes().to_vec(),
        kind,
        data: vec![],
        link: vec![],
        dev: (0, 0),
        mode: if kind == b'5' { 0o755 } else { 0o644 },
        uid: 0,
    }
}
fn file(name: &str, data: &str) -> E {
    E {
        data: data.as_bytes().to_vec(),
        ..e(name, b'0')
    }
}
fn dir(name: &str) -> E {
    e(name, b'5')
}
fn symlink(name: &str, to: &str) -> E {
    E {
        link: to.as_bytes().to_vec(),
        ..e(name, b'2')
    }
}
fn hardlink(name: &str, to: &str) -> E {
    E {
        link: to.as_bytes().to_vec(),
        ..e(name, b'1')
    }
}
fn device(name: &str, kind: u8, dev: (u32, u32)) -> E {
    E {
        dev,
        ..e(name, kind)
    }
}

/// A PAX header (`x` for the next entry, `g` global) holding `records`.
fn pax(kind: u8, records: &[(&str, &str)]) -> E {
    let mut data = Vec::new();
    for (k, v) in records {
        let body = format!(" {k}={v}\n");
        // The length counts its own digits.
        let mut n = body.len() + 1;
        while format!("{n}{body}").len() != n {
            n += 1;
        }
        data.extend_from_slice(format!("{n}{body}").as_bytes());
    }
    E {
        data,
        ..e("PaxHeaders/x", kind)
    }
}

fn octal(field: &mut [u8], v: u64) {
    let s = format!("{:0w$o}\0", v, w = field.len() - 1);
    field.copy_from_slice(s.as_bytes());
}

fn header(name: &[u8], kind: u8, size: u64, link: &[u8], x: &E) -> [u8; 512] {
    let mut h = [0u8; 512];
    h[..name.len()].copy_from_slice(name);
    octal(&mut h[100..108], u64::from(x.mode));
    octal(&mut h[108..116], u64::from(x.uid));
    octal(&mut h[116..124], 0);
    octal(&mut h[124..136], size);
    octal(&mut h[136..148], 1_700_000_000);
    h[156] = kind;
    h[157..157 + link.len()].copy_from_slice(link);
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    octal(&mut h[329..337], u64::from(x.dev.0));
    octal(&mut h[337..345], u64::from(x.dev.1));
    h[148..156].copy_from_slice(b"        ");
    let sum: u64 = h.iter().map(|b| u64::from(*b)).sum();
    let s = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(s.as_bytes());
    h
}

fn pad(out: &mut Vec<u8>, data: &[u8]) {
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512, 0);
}

fn tar(entries: &[E]) -> Vec<u8> {
    let mut out = Vec::new();
    for x in entries {
        // Names and link targets over a header field's size go in GNU long-name entries.
        let mut name = x.name.clone();
        if name.len() >= 100 {
            let mut long = name.clone();
            long.push(0);
            out.extend_from_slice(&header(b"././@LongLink", b'L', long.len() as u64, b"", x));
            pad(&mut out, &long);
            name.truncate(99);
        }
        let mut link = x.link.clone();
        if link.len() >= 100 {
            let mut long = link.clone();
            long.push(0);
            out.extend_from_slice(&header(b"././@LongLink", b'K', long.len() as u64, b"", x));
            pad(&mut out, &long);
            link.truncate(99);
        }
        out.extend_from_slice(&header(&name, x.kind, x.data.len() as u64, &link, x));
        pad(&mut out, &x.data);
    }
    out.extend_from_slice(&[0u8; 1024]);
    out
}

/// A store inside `base/store`, beside a canary tree `base/canary` that nothing may change.
struct World {
    _tmp: tempfile::TempDir,
    base: PathBuf,
    store: Store,
}

impl World {
    fn new() -> World {
        let tmp = tempfile::tempdir().unwrap();
        let base = tmp.path().to_path_buf();
        for d in ["canary/etc", "canary/deep/er"] {
            std::fs::create_dir_all(base.join(d)).unwrap();
        }
        std::fs::write(
            base.join("canary/etc/passwd"),
            "root:x:0:0::/root:/bin/sh\n",
        )
        .unwrap();
        std::fs::write(base.join("canary/deep/er/f"), "keep").unwrap();
        std::os::unix::fs::symlink("../etc", base.join("canary/deep/etc")).unwrap();
        let store = Store::open(&base.join("store")).unwrap();
        World {
            _tmp: tmp,
            base,
            store,
        }
    }

    /// Every path under `base` with its type, mode, owner, size, link target and contents.
    fn snapshot(&self) -> BTreeMap<PathBuf, String> {
        let mut out = BTreeMap::new();
        walk(&self.base, &self.base, &mut out);
        out
    }

    fn import(&self, bytes: &[u8]) -> Result<(), LayerError> {
        import_layer(
            &self.store,
            bytes,
            &Expected::default(),
            "sha256:test",
            &[],
            Limits::default(),
        )
        .map(|_| ())
    }
}

fn walk(base: &Path, p: &Path, out: &mut BTreeMap<PathBuf, String>) {
    let md = std::fs::symlink_metadata(p).unwrap();
    let what = if md.file_type().is_symlink() {
        format!("link {:?}", std::fs::read_link(p).unwrap())
    } else if md.is_file() {
        format!("file {:?}", std::fs::read(p).unwrap())
    } else if md.is_dir() {
        "dir".to_string()
    } else {
        format!("other rdev {}", md.rdev())
    };
    out.insert(
        p.strip_prefix(base).unwrap().to_path_buf(),
        format!(
            "{what} mode {:o} uid {} gid {}",
            md.mode(),
            md.uid(),
            md.gid()
        ),
    );
    if md.is_dir() {
        for c in std::fs::read_dir(p).unwrap() {
            walk(base, &c.unwrap().path(), out);
        }
    }
}

/// A unique absolute path that an escape would create.
fn outside() -> String {
    format!("/tmp/opendsec-escape-{:016x}", rand_u64())
}

fn rand_u64() -> u64 {
    let mut b = [0u8; 8];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut b))
        .unwrap();
    u64::from_le_bytes(b)
}

#[test]
fn malicious_tars_are_refused_naming_the_entry_and_change_nothing() {
    if !root_or_skip() {
        return;
    }
    let abs = outside();
    let abs_rel = abs.trim_start_matches('/').to_string();
    let long_component = "x".repeat(256);
    let long_name = format!("{}/f", ["dd"; 1400].join("/"));
    let too_deep = format!("{}/f", ["d"; 256].join("/"));
    let cases: Vec<(&str, Vec<E>, &str, &str)> = vec![
        ("dot-dot", vec![file("../escape", "x")], "../escape", "'..'"),
        (
            "deep dot-dot",
            vec![dir("a"), file("a/../../../canary/etc/passwd", "x")],
            "a/../../../canary/etc/passwd",
            "'..'",
        ),
        ("absolute", vec![file(&abs, "x")], &abs, "absolute"),
        (
            "through a symlink to /",
            vec![symlink("root", "/"), file(&format!("root/{abs_rel}"), "x")],
            "root/",
            "symlink",
        ),
        (
            "through a symlink upwards",
            vec![symlink("up", "../../.."), file("up/canary/etc/passwd", "x")],
            "up/canary",
            "symlink",
        ),
        (
            "through a symlinked directory deep down",
            vec![dir("a"), symlink("a/b", "/tmp"), file("a/b/c/d", "x")],
            "a/b/c/d",
            "symlink",
        ),
        (
            "hardlink upwards",
            vec![hardlink("h", "../../canary/etc/passwd")],
            "\"h\"",
            "'..'",
        ),
        (
            "hardlink absolute",
            vec![hardlink("h", "/etc/passwd")],
            "\"h\"",
            "absolute",
        ),
        (
            "hardlink to a later entry",
            vec![hardlink("h", "later"), file("later", "x")],
            "\"h\"",
            "no earlier entry",
        ),
        (
            "hardlink to a directory",
            vec![dir("d"), hardlink("h", "d")],
            "\"h\"",
            "directory",
        ),
        (
            "hardlink through a symlink",
            vec![symlink("s", "/etc"), hardlink("h", "s/passwd")],
            "\"h\"",
            "no earlier entry",
        ),
        (
            "whiteout of ..",
            vec![dir("a"), file("a/.wh..", "")],
            "a/.wh..",
            "whiteout",
        ),
        (
            "whiteout of nothing",
            vec![file(".wh.", "")],
            ".wh.",
            "whiteout",
        ),
        (
            "whiteout upwards",
            vec![file("../.wh.canary", "")],
            "../.wh.canary",
            "'..'",
        ),
        (
            "a device node",
            vec![device("null", b'3', (1, 3))],
            "null",
            "device",
        ),
        (
            "a block device",
            vec![device("sda", b'4', (8, 0))],
            "sda",
            "device",
        ),
        (
            "a duplicate file",
            vec![file("f", "one"), file("f", "two")],
            "\"f\"",
            "second entry",
        ),
        (
            "a file replaced by a symlink",
            vec![file("f", "one"), symlink("f", "/etc/passwd")],
            "\"f\"",
            "second entry",
        ),
        (
            "a symlink written through",
            vec![symlink("f", "../../canary/etc/passwd"), file("f", "pwned")],
            "\"f\"",
            "second entry",
        ),
        (
            "a whiteout of its own file",
            vec![file("f", "one"), file(".wh.f", "")],
            ".wh.f",
            "second entry",
        ),
        (
            "a file below a file",
            vec![file("a", "x"), file("a/b", "y")],
            "a/b",
            "not a directory",
        ),
        (
            "a component too long",
            vec![file(&long_component, "x")],
            "xxxx",
            "longer than 255",
        ),
        (
            "a name too long",
            vec![file(&long_name, "x")],
            "dd/dd",
            "longer than 4096",
        ),
        ("an empty name", vec![file("", "x")], "\"\"", "empty name"),
        (
            "a name too deep",
            vec![file(&too_deep, "x")],
            "d/d/d",
            "levels deep",
        ),
        (
            "a symlink target with a NUL",
            vec![E {
                link: [&b"a\0"[..], &[b'b'; 120][..]].concat(),
                ..e("s", b'2')
            }],
            "\"s\"",
            "without NUL",
        ),
        (
            "a PAX sparse file",
            vec![
                pax(
                    b'x',
                    &[
                        ("GNU.sparse.major", "1"),
                        ("GNU.sparse.minor", "0"),
                        ("GNU.sparse.name", "var/sparse"),
                    ],
                ),
                file("var/GNUSparseFile.0/sparse", "1\n0\n4\nabcd"),
            ],
            "GNUSparseFile",
            "sparse",
        ),
        (
            "an unknown entry type",
            vec![e("odd", b'Z')],
            "odd",
            "not allowed",
        ),
        (
            "a symlink without a target",
            vec![symlink("s", "")],
            "\"s\"",
            "target",
        ),
    ];
    assert!(cases.len() >= 15);
    for (what, entries, entry, why) in cases {
        let w = World::new();
        let before = w.snapshot();
        let err = w.import(&tar(&entries)).expect_err(what);
        let f = err.to_failure();
        assert_eq!(f.reason, Reason::Invalid, "{what}: {f:?}");
        assert!(
            f.message.contains(entry)
                && f.message.contains(why)
                && f.message.contains("sha256:test"),
            "{what}: {}",
            f.message
        );
        assert_eq!(
            w.snapshot(),
            before,
            "{what}: something changed around or in the store"
        );
        assert!(!Path::new(&abs).exists(), "{what}: wrote {abs}");
    }
    // Not a tar at all.
    let w = World::new();
    let before = w.snapshot();
    let f = w.import(&[0x55u8; 4096]).unwrap_err().to_failure();
    assert_eq!(f.reason, Reason::Invalid, "{f:?}");
    assert!(f.message.contains("not a valid tar"), "{}", f.message);
    assert_eq!(w.snapshot(), before);
}

fn good_layer() -> Vec<E> {
    vec![
        dir("./"),
        // umoci names the root `/`: the root itself, not an absolute name.
        dir("/"),
        dir("./etc/"),
        E {
            mode: 0o4755,
            uid: 1000,
            ..file("./usr/bin/tool", "#!/bin/sh\n")
        },
        file("etc/hostname", "box\n"),
        hardlink("etc/hostname.bak", "etc/hostname"),
        symlink("etc/link", "../usr/bin/tool"),
        symlink("abs", "/etc/passwd"),
        e("run/fifo", b'6'),
        file("var/.wh.cache", ""),
        device("opt", b'3', (0, 0)),
        dir("srv"),
        file("srv/.wh..wh..opq", ""),
        file("srv/new", "n"),
        // An explicit entry for a directory made implicitly before.
        E {
            mode: 0o700,
            ..dir("usr")
        },
        // What Docker and containerd skip: a PAX global header, aufs's own metadata.
        pax(b'g', &[("comment", "made by git archive")]),
        dir(".wh..wh.plnk"),
        file(".wh..wh.aufs", ""),
        file("deep/.wh..wh.orph", ""),
    ]
}

#[test]
fn a_good_layer_is_stored_once_in_overlay_format() {
    if !root_or_skip() {
        return;
    }
    let w = World::new();
    let raw = tar(&good_layer());
    let diff_id = Digest::of(&raw);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    gz.write_all(&raw).unwrap();
    let gz = gz.finish().unwrap();
    let expected = Expected {
        blob: Some(Digest::of(&gz)),
        diff_id: Some(diff_id.clone()),
    };
    let meta = import_layer(&w.store, &gz[..], &expected, "l1", &[], Limits::default()).unwrap();
    assert_eq!(meta.diff_id.as_ref(), Some(&diff_id));
    assert_eq!(meta.opaque, vec!["srv".to_string()]);
    let root = w.store.layer_dir(&diff_id).join("rootfs");
    let md = |p: &str| std::fs::symlink_metadata(root.join(p)).unwrap();
    assert_eq!(
        std::fs::read(root.join("usr/bin/tool")).unwrap(),
        b"#!/bin/sh\n"
    );
    assert_eq!(md("usr/bin/tool").permissions().mode() & 0o7777, 0o4755);
    assert_eq!(md("usr/bin/tool").uid(), 1000);
    assert_eq!(md("usr").permissions().mode() & 0o7777, 0o700);
    assert_eq!(md("usr/bin").permissions().mode() & 0o7777, 0o755);
    assert_eq!(md("etc/hostname").ino(), md("etc/hostname.bak").ino());
    assert_eq!(
        std::fs::read_link(root.join("abs")).unwrap(),
        Path::new("/etc/passwd")
    );
    assert!(md("run/fifo").file_type().is_fifo());
    for wh in ["var/cache", "opt"] {
        assert!(
            md(wh).file_type().is_char_device() && md(wh).rdev() == 0,
            "{wh}"
        );
    }
    assert!(!root.join("srv/.wh..wh..opq").exists());
    for skipped in [
        ".wh..wh.plnk",
        ".wh..wh.aufs",
        ".wh.aufs",
        "deep/.wh..wh.orph",
        "deep/.wh.orph",
        "PaxHeaders",
    ] {
        assert!(
            std::fs::symlink_metadata(root.join(skipped)).is_err(),
            "{skipped}"
        );
    }
    assert_eq!(md("etc/hostname").mtime(), 1_700_000_000);
    assert_eq!(md("etc").mtime(), 1_700_000_000);
    assert_eq!(
        std::fs::read_dir(w.base.join("store/tmp")).unwrap().count(),
        0
    );

    // The same layer again, zstd this time: known by its diff_id, it is not read at all.
    let zst = zstd::encode_all(&raw[..], 1).unwrap();
    let again = Expected {
        blob: Some(Digest::of(&zst)),
        diff_id: Some(diff_id.clone()),
    };
    import_layer(
        &w.store,
        &b"not even read"[..],
        &again,
        "l1",
        &[],
        Limits::default(),
    )
    .unwrap();
    // Without a diff_id to go by, it is read, checked, and the second copy dropped.
    let m = import_layer(
        &w.store,
        &zst[..],
        &Expected::default(),
        "l1",
        &[],
        Limits::default(),
    )
    .unwrap();
    assert_eq!(
        (m.diff_id, m.blob),
        (Some(diff_id.clone()), Some(Digest::of(&zst)))
    );
    assert_eq!(
        std::fs::read_dir(w.base.join("store/layers"))
            .unwrap()
            .count(),
        1
    );
    assert_eq!(
        std::fs::read_dir(w.base.join("store/tmp")).unwrap().count(),
        0
    );
}

/// A metadata entry (GNU long name, PAX header) claiming gigabytes is refused at its header:
/// the tar reader would otherwise hold all of it in memory. Here the claim is backed by real
/// bytes, 64 MiB of them, as a compressed layer could carry at no cost.
#[test]
fn huge_metadata_entries_are_refused_before_they_are_read() {
    if !root_or_skip() {
        return;
    }
    for (kind, name) in [
        (b'L', &b"././@LongLink"[..]),
        (b'x', &b"PaxHeaders/big"[..]),
    ] {
        let size = 64u64 << 20;
        let mut bytes = header(name, kind, size, b"", &e("x", kind)).to_vec();
        bytes.resize(bytes.len() + size as usize, b'a');
        bytes.extend_from_slice(&tar(&[file("f", "x")]));
        let w = World::new();
        let before = w.snapshot();
        let f = w.import(&bytes).unwrap_err().to_failure();
        assert_eq!(f.reason, Reason::Invalid, "{f:?}");
        let shown = String::from_utf8_lossy(name);
        assert!(
            f.message.contains(&*shown) && f.message.contains("more than"),
            "{}",
            f.message
        );
        assert_eq!(w.snapshot(), before);
    }
}

#[test]
fn a_layer_that_is_not_what_the_image_says_is_refused() {
    if !root_or_skip() {
        return;
    }
    let w = World::new();
    let raw = tar(&good_layer());
    let before = w.snapshot();
    for expected in [
        Expected {
            diff_id: Some(Digest::of(b"other")),
            blob: None,
        },
        Expected {
            diff_id: None,
            blob: Some(Digest::of(b"other")),
        },
    ] {
        let f = import_layer(&w.store, &raw[..], &expected, "l9", &[], Limits::default())
            .unwrap_err()
            .to_failure();
        assert_eq!(f.reason, Reason::Invalid, "{f:?}");
        assert!(
            f.message.contains("layer l9") && f.message.contains("the image says"),
            "{}",
            f.message
        );
        assert_eq!(w.snapshot(), before);
    }
    let f = import_layer(
        &w.store,
        &raw[..],
        &Expected::default(),
        "l9",
        &[],
        Limits { max_entries: 3 },
    )
    .unwrap_err()
    .to_failure();
    assert!(f.message.contains("more than 3 entries"), "{}", f.message);
    assert_eq!(w.snapshot(), before);
}

fn arb_name() -> impl Strategy<Value = String> {
    let comp = prop_oneof![
        Just("a".to_string()),
        Just("b".to_string()),
        Just("..".to_string()),
        Just(".".to_string()),
        Just("".to_string()),
        Just(".wh.a".to_string()),
        Just(".wh..".to_string()),
        Just(".wh..wh..opq".to_string()),
        Just("canary".to_string()),
        "[a-c]{1,3}",
    ];
    (any::<bool>(), prop::collection::vec(comp, 1..5))
        .prop_map(|(abs, parts)| format!("{}{}", if abs { "/" } else { "" }, parts.join("/")))
}

fn arb_entry() -> impl Strategy<Value = E> {
    (
        arb_name(),
        prop_oneof![
            Just(b'0'),
            Just(b'1'),
            Just(b'2'),
            Just(b'3'),
            Just(b'5'),
            Just(b'6'),
            Just(b'Z')
        ],
        arb_name(),
        "[a-z]{0,8}",
        (0u32..2, 0u32..2),
    )
        .prop_map(|(name, kind, link, data, dev)| E {
            data: if kind == b'0' {
                data.into_bytes()
            } else {
                vec![]
            },
            link: link.into_bytes(),
            dev,
            ..e(&name, kind)
        })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    /// Generated tars: whatever they hold, the import never panics, never changes anything
    /// outside its layer, and leaves either one whole layer or nothing.
    #[test]
    fn generated_tars_stay_inside_their_layer(entries in prop::collection::vec(arb_entry(), 1..12)) {
        if !root_or_skip() {
            return Ok(());
        }
        let w = World::new();
        let before = w.snapshot();
        let result = w.import(&tar(&entries));
        let mut after = w.snapshot();
        after.retain(|p, _| !p.starts_with("store/layers/"));
        let mut want = before.clone();
        want.retain(|p, _| !p.starts_with("store/layers/"));
        prop_assert_eq!(&after, &want);
        let layers = std::fs::read_dir(w.base.join("store/layers")).unwrap().count();
        prop_assert_eq!(layers, usize::from(result.is_ok()));
        if let Err(e) = result {
            let f = e.to_failure();
            prop_assert_eq!(f.reason, Reason::Invalid, "{:?}", f);
        }
    }

    /// Valid tars with bytes changed: refused or imported, never a panic or a stray file.
    #[test]
    fn corrupted_tars_never_escape(flips in prop::collection::vec((0usize..8192, any::<u8>()), 1..16)) {
        if !root_or_skip() {
            return Ok(());
        }
        let w = World::new();
        let mut raw = tar(&good_layer());
        for (at, b) in flips {
            let n = raw.len();
            raw[at % n] = b;
        }
        let before = w.snapshot();
        let result = w.import(&raw);
        let mut after = w.snapshot();
        after.retain(|p, _| !p.starts_with("store/layers/"));
        let mut want = before.clone();
        want.retain(|p, _| !p.starts_with("store/layers/"));
        prop_assert_eq!(&after, &want);
        if result.is_err() {
            prop_assert_eq!(std::fs::read_dir(w.base.join("store/layers")).unwrap().count(), 0);
        }
    }
}

/// A full disk is the machine's failure (`internal`), not a bad tar, and leaves nothing.
#[test]
fn a_full_store_is_internal_not_invalid() {
    if !root_or_skip() {
        return;
    }
    let mnt = tempfile::tempdir().unwrap();
    let st = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=256k", "tmpfs"])
        .arg(mnt.path())
        .status()
        .unwrap();
    assert!(st.success());
    let store = Store::open(&mnt.path().join("store")).unwrap();
    let big = "x".repeat(1 << 20);
    let r = import_layer(
        &store,
        &tar(&[file("big", &big)])[..],
        &Expected::default(),
        "full",
        &[],
        Limits::default(),
    );
    let tmp_left = std::fs::read_dir(mnt.path().join("store/tmp"))
        .unwrap()
        .count();
    let _ = std::process::Command::new("umount")
        .arg(mnt.path())
        .status();
    let f = r.unwrap_err().to_failure();
    assert_eq!(f.reason, Reason::Internal, "{f:?}");
    assert!(f.message.contains("No space left"), "{}", f.message);
    assert_eq!(tmp_left, 0);
}

/// A source that breaks off midway (a registry's connection reset) is `unavailable`, not a
/// bad layer, and leaves nothing.
#[test]
fn a_source_that_breaks_off_is_unavailable() {
    if !root_or_skip() {
        return;
    }
    struct Breaks(Vec<u8>, usize);
    impl std::io::Read for Breaks {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.1 >= 4096 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::ConnectionReset,
                    "connection reset by the registry",
                ));
            }
            let n = buf.len().min(512).min(self.0.len() - self.1);
            buf[..n].copy_from_slice(&self.0[self.1..self.1 + n]);
            self.1 += n;
            Ok(n)
        }
    }
    let w = World::new();
    let before = w.snapshot();
    let raw = tar(&[file("big", &"x".repeat(64 << 10))]);
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::none());
    gz.write_all(&raw).unwrap();
    for blob in [raw.clone(), gz.finish().unwrap()] {
        let f = import_layer(
            &w.store,
            Breaks(blob, 0),
            &Expected::default(),
            "net",
            &[],
            Limits::default(),
        )
        .unwrap_err()
        .to_failure();
        assert_eq!(f.reason, Reason::Unavailable, "{f:?}");
        assert!(f.message.contains("connection reset"), "{}", f.message);
        assert_eq!(w.snapshot(), before);
    }
}
