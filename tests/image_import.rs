//! Importing images from local sources into the store (docs/images.md "Import"): an OCI
//! layout directory, the same as an OCI archive, a `docker save` tar and an index to choose
//! linux/amd64 from; layers shared between images stored once, opaque directories expanded
//! against the layers below, the image's env, workdir and user kept, and bad sources refused
//! with `invalid` naming what is wrong. Needs root (layer files keep their owners).

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;
use common::layers::{gzip, layer};

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use opendsec::images::digest::Digest;
use opendsec::images::import::{import, Options, Progress};
use opendsec::images::name::ImageRef;
use opendsec::images::store::Store;
use opendsec::types::Reason;
use serde_json::json;

fn root_or_skip() -> bool {
    opendsec::sys::root_or_skip("the image import tests")
}

/// The three layers of the test image: a base, one that deletes a file and makes `srv`
/// opaque, and a gzip-compressed top.
fn layers() -> Vec<(Vec<u8>, Vec<u8>)> {
    let l1 = layer(&[
        ("etc/", ""),
        ("etc/keep", "k"),
        ("etc/gone", "g"),
        ("srv/", ""),
        ("srv/a", "a"),
        ("srv/b", "b"),
    ]);
    let l2 = layer(&[
        ("etc/.wh.gone", ""),
        ("srv/", ""),
        ("srv/.wh..wh..opq", ""),
        ("srv/c", "c"),
    ]);
    let l3 = layer(&[("usr/bin/tool", "#!/bin/sh\n")]);
    vec![(l1.clone(), l1), (l2.clone(), l2), (gzip(&l3), l3)]
}

fn put_blob(dir: &Path, body: &[u8]) -> Digest {
    let d = Digest::of(body);
    let p = dir.join("blobs/sha256").join(d.hex());
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, body).unwrap();
    d
}

fn config(diff_ids: &[Digest]) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Env": ["PATH=/usr/bin:/bin", "LANG=C.UTF-8"], "WorkingDir": "/srv", "User": "1000:1000"},
        "rootfs": {"type": "layers", "diff_ids": diff_ids.iter().map(|d| d.to_string()).collect::<Vec<_>>()},
    }))
    .unwrap()
}

/// Writes an OCI layout of the test image into `dir` (its manifest tagged `tag`), or with
/// `via_index` behind an index that lists an arm64 image first. Returns the diff_ids.
fn oci_layout(
    dir: &Path,
    tag: &str,
    via_index: bool,
    diff_ids_override: Option<Vec<Digest>>,
) -> Vec<Digest> {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("oci-layout"), r#"{"imageLayoutVersion":"1.0.0"}"#).unwrap();
    let ls = layers();
    let diff_ids: Vec<Digest> = ls.iter().map(|(_, raw)| Digest::of(raw)).collect();
    let mut descs = Vec::new();
    for (i, (blob, _)) in ls.iter().enumerate() {
        let d = put_blob(dir, blob);
        let mt = if i == 2 {
            "application/vnd.oci.image.layer.v1.tar+gzip"
        } else {
            "application/vnd.oci.image.layer.v1.tar"
        };
        descs.push(json!({"mediaType": mt, "digest": d.to_string(), "size": blob.len()}));
    }
    let cfg = config(diff_ids_override.as_ref().unwrap_or(&diff_ids));
    let cfg_d = put_blob(dir, &cfg);
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_d.to_string(), "size": cfg.len()},
        "layers": descs,
    }))
    .unwrap();
    let m_d = put_blob(dir, &manifest);
    let mut top = json!({
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "digest": m_d.to_string(),
        "size": manifest.len(),
        "annotations": {"org.opencontainers.image.ref.name": tag},
    });
    if via_index {
        let other = put_blob(dir, b"{}");
        let index = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "manifests": [
                {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": other.to_string(), "size": 2,
                 "platform": {"architecture": "arm64", "os": "linux"}},
                {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": m_d.to_string(), "size": manifest.len(),
                 "platform": {"architecture": "amd64", "os": "linux"}},
            ],
        }))
        .unwrap();
        let i_d = put_blob(dir, &index);
        top = json!({
            "mediaType": "application/vnd.oci.image.index.v1+json",
            "digest": i_d.to_string(),
            "size": index.len(),
            "annotations": {"org.opencontainers.image.ref.name": tag},
        });
    }
    std::fs::write(
        dir.join("index.json"),
        serde_json::to_vec(&json!({"schemaVersion": 2, "manifests": [top]})).unwrap(),
    )
    .unwrap();
    diff_ids
}

/// A tar of the directory `dir` (an OCI archive of a layout).
fn tar_dir(dir: &Path, out: &Path) {
    let mut b = tar::Builder::new(std::fs::File::create(out).unwrap());
    b.append_dir_all(".", dir).unwrap();
    b.finish().unwrap();
}

/// A `docker save` tar (the form before Docker 25) of the test image, tagged `repo_tag`.
fn docker_save(out: &Path, repo_tag: &str) -> Vec<Digest> {
    let ls = layers();
    let diff_ids: Vec<Digest> = ls.iter().map(|(_, raw)| Digest::of(raw)).collect();
    let cfg = config(&diff_ids);
    let cfg_name = format!("{}.json", Digest::of(&cfg).hex());
    let mut b = tar::Builder::new(std::fs::File::create(out).unwrap());
    let mut add = |name: &str, body: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_uid(0);
        h.set_gid(0);
        h.set_mtime(1_700_000_000);
        h.set_size(body.len() as u64);
        h.set_mode(0o644);
        b.append_data(&mut h, name, body).unwrap();
    };
    let mut names = Vec::new();
    for (i, (_, raw)) in ls.iter().enumerate() {
        // docker save holds every layer uncompressed, named by an id of its own.
        let name = format!("layer{i}/layer.tar");
        add(&name, raw);
        names.push(name);
    }
    add(&cfg_name, &cfg);
    let manifest =
        serde_json::to_vec(&json!([{"Config": cfg_name, "RepoTags": [repo_tag], "Layers": names}]))
            .unwrap();
    add("manifest.json", &manifest);
    b.finish().unwrap();
    diff_ids
}

struct World {
    tmp: tempfile::TempDir,
    store: Store,
}

impl World {
    fn new() -> World {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(&tmp.path().join("store")).unwrap();
        World { tmp, store }
    }
    fn path(&self, p: &str) -> PathBuf {
        self.tmp.path().join(p)
    }
    fn import(
        &self,
        src: &Path,
        sel: &str,
        target: &str,
        overwrite: bool,
    ) -> Result<Vec<Progress>, opendsec::types::Failure> {
        let src = if sel.is_empty() {
            src.display().to_string()
        } else {
            format!("{}#{sel}", src.display())
        };
        let seen = std::cell::RefCell::new(Vec::new());
        let r = import(
            &self.store,
            &src,
            &ImageRef::parse(target).unwrap(),
            Options {
                overwrite,
                ..Default::default()
            },
            &|p| seen.borrow_mut().push(p),
        );
        let seen = seen.into_inner();
        // Every layer read is announced with its blob's size and read to its end.
        let mut want: Option<(usize, u64)> = None;
        for p in &seen {
            match p {
                Progress::Started {
                    index,
                    size: Some(s),
                    ..
                } => want = Some((*index, *s)),
                Progress::Imported { index, .. } => {
                    if let Some((i, s)) = want.take() {
                        assert_eq!(i, *index, "{seen:?}");
                        let last = seen.iter().rev().find_map(|q| match q {
                            Progress::Read { index: j, bytes } if *j == i => Some(*bytes),
                            _ => None,
                        });
                        assert_eq!(last, Some(s), "{seen:?}");
                    }
                }
                _ => {}
            }
        }
        let done = seen
            .into_iter()
            .filter(|p| matches!(p, Progress::Cached { .. } | Progress::Imported { .. }))
            .collect();
        r.map(|_| done).map_err(|e| e.to_failure())
    }
    fn layer_count(&self) -> usize {
        std::fs::read_dir(self.path("store/layers"))
            .unwrap()
            .count()
    }
}

#[test]
fn an_oci_layout_is_imported_with_its_defaults_and_opaque_dirs_expanded() {
    if !root_or_skip() {
        return;
    }
    let w = World::new();
    let diff_ids = oci_layout(&w.path("layout"), "1", false, None);
    let seen = w
        .import(&w.path("layout"), "", "root/rl/py:1", false)
        .unwrap();
    assert!(
        matches!(
            seen.as_slice(),
            [
                Progress::Imported {
                    index: 1,
                    count: 3,
                    ..
                },
                _,
                Progress::Imported { index: 3, .. }
            ]
        ),
        "{seen:?}"
    );
    let m = w
        .store
        .read_manifest(&ImageRef::parse("root/rl/py:1").unwrap())
        .unwrap();
    assert_eq!(m.layers, diff_ids);
    assert_eq!(m.env, vec!["PATH=/usr/bin:/bin", "LANG=C.UTF-8"]);
    assert_eq!((m.workdir.as_str(), m.user.as_str()), ("/srv", "1000:1000"));
    assert!(m.source.ends_with("layout#1"), "{}", m.source);

    let l2 = w.store.layer_dir(&diff_ids[1]).join("rootfs");
    let whiteout = |p: &Path| {
        let md = std::fs::symlink_metadata(p).unwrap();
        md.file_type().is_char_device() && md.rdev() == 0
    };
    // srv/ is opaque in layer 2: what layer 1 had there is whited out, its own file kept.
    assert!(whiteout(&l2.join("srv/a")) && whiteout(&l2.join("srv/b")));
    assert_eq!(std::fs::read(l2.join("srv/c")).unwrap(), b"c");
    assert!(whiteout(&l2.join("etc/gone")));
    assert!(!l2.join("etc/keep").exists());
    let l3 = w.store.layer_dir(&diff_ids[2]).join("rootfs");
    assert_eq!(
        std::fs::read(l3.join("usr/bin/tool")).unwrap(),
        b"#!/bin/sh\n"
    );

    // The name is taken now: refused before the source is even opened.
    let f = w
        .import(&w.path("no-such-source"), "", "root/rl/py:1", false)
        .unwrap_err();
    assert_eq!(f.reason, Reason::Conflict, "{f:?}");
    // With overwrite, the same image again: every layer is in the store already.
    let seen = w
        .import(&w.path("layout"), "", "root/rl/py:1", true)
        .unwrap();
    assert!(
        seen.iter().all(|p| matches!(p, Progress::Cached { .. })),
        "{seen:?}"
    );
    assert_eq!(w.layer_count(), 3);
}

#[test]
fn archives_docker_save_tars_and_indexes_share_the_stored_layers() {
    if !root_or_skip() {
        return;
    }
    let w = World::new();
    oci_layout(&w.path("layout"), "v1", true, None);
    tar_dir(&w.path("layout"), &w.path("image.oci.tar"));
    let seen = w
        .import(&w.path("image.oci.tar"), "app:v1", "root/app:v1", false)
        .unwrap();
    assert_eq!(seen.len(), 3);
    assert_eq!(w.layer_count(), 3);
    let diff_ids = docker_save(&w.path("saved.tar"), "myimage:dev");
    let seen = w
        .import(&w.path("saved.tar"), "", "root/rl/myimage:dev", false)
        .unwrap();
    assert!(
        seen.iter().all(|p| matches!(p, Progress::Cached { .. })),
        "{seen:?}"
    );
    assert_eq!(w.layer_count(), 3);
    let m = w
        .store
        .read_manifest(&ImageRef::parse("root/rl/myimage:dev").unwrap())
        .unwrap();
    assert_eq!(m.layers, diff_ids);
    assert_eq!(m.workdir, "/srv");

    // A fresh store: the docker save tar's layers are read from it, uncompressed.
    let w2 = World::new();
    docker_save(&w2.path("saved.tar"), "myimage:dev");
    w2.import(&w2.path("saved.tar"), "myimage:dev", "root/x:1", false)
        .unwrap();
    assert_eq!(w2.layer_count(), 3);
}

#[test]
fn bad_sources_are_invalid_and_leave_nothing() {
    if !root_or_skip() {
        return;
    }
    let w = World::new();
    let f = w
        .import(&w.path("nothing"), "", "root/x:1", false)
        .unwrap_err();
    assert_eq!(f.reason, Reason::Invalid, "{f:?}");

    std::fs::create_dir_all(w.path("empty")).unwrap();
    let f = w
        .import(&w.path("empty"), "", "root/x:1", false)
        .unwrap_err();
    assert!(
        f.reason == Reason::Invalid && f.message.contains("neither an OCI layout"),
        "{f:?}"
    );

    oci_layout(&w.path("layout"), "1", false, None);
    let f = w
        .import(&w.path("layout"), "nope:2", "root/x:1", false)
        .unwrap_err();
    assert!(
        f.reason == Reason::Invalid
            && f.message.contains("no image named")
            && f.message.contains("it has: 1"),
        "{f:?}"
    );

    // A config whose diff_ids are not the layers': the first layer fails its check.
    let wrong = vec![Digest::of(b"1"), Digest::of(b"2"), Digest::of(b"3")];
    oci_layout(&w.path("lying"), "1", false, Some(wrong));
    let f = w
        .import(&w.path("lying"), "", "root/x:1", false)
        .unwrap_err();
    assert!(
        f.reason == Reason::Invalid && f.message.contains("the image says"),
        "{f:?}"
    );

    // A blob that was changed after its digest was taken.
    oci_layout(&w.path("tampered"), "1", false, None);
    let blobs = w.path("tampered/blobs/sha256");
    let layer1 = Digest::of(&layers()[0].0);
    std::fs::write(blobs.join(layer1.hex()), layer(&[("evil", "x")])).unwrap();
    let f = w
        .import(&w.path("tampered"), "", "root/x:1", false)
        .unwrap_err();
    assert!(
        f.reason == Reason::Invalid && f.message.contains("its digest"),
        "{f:?}"
    );

    // A missing blob.
    oci_layout(&w.path("missing"), "1", false, None);
    std::fs::remove_file(w.path("missing/blobs/sha256").join(layer1.hex())).unwrap();
    let f = w
        .import(&w.path("missing"), "", "root/x:1", false)
        .unwrap_err();
    assert!(
        f.reason == Reason::Invalid && f.message.contains("it has no"),
        "{f:?}"
    );

    assert_eq!(w.layer_count(), 0);
    assert_eq!(std::fs::read_dir(w.path("store/tmp")).unwrap().count(), 0);
    assert!(!w.path("store/images/root/x").exists());
}
