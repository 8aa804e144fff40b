//! Container sandboxes from images in the shared store (docs/images.md "How nodes use
//! images"): an image of 60 layers (more than one page of overlay options holds), with a
//! deleted file and a replaced directory, stacked from the node's layer cache; its env,
//! workdir and user as the sessions' defaults; sandboxes that keep running, and new ones that
//! still start, when the store goes away; in-use records; unknown images. As root.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use opendsec::backends::{self, Backend, BackendContext, CreateRequest, Handle};
use opendsec::config::BackendConfig;
use opendsec::images::digest::Digest;
use opendsec::images::name::ImageRef;
use opendsec::images::store::{ImageManifest, Store};
use opendsec::pb::{self, runtime_client::RuntimeClient};
use opendsec::types::Reason;

const LAYERS: usize = 60;

fn busybox(rootfs: &Path) {
    common::busybox_into(rootfs, &["sh", "cat", "ls", "id", "pwd", "echo", "test"]);
}

/// Puts a layer made by `fill` into the store; its digest is only its name here.
fn layer(store: &Store, n: usize, fill: impl FnOnce(&Path)) -> Digest {
    let d = Digest::of(format!("test layer {n} {}", std::process::id()).as_bytes());
    store
        .put_layer(&d, |r| {
            fill(r);
            Ok(())
        })
        .expect("layer");
    d
}

fn image(store: &Store) -> ImageManifest {
    let mut layers = vec![layer(store, 0, |r| {
        busybox(r);
        std::fs::create_dir_all(r.join("etc")).expect("etc");
        std::fs::write(
            r.join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/srv:/bin/sh\n",
        )
        .expect("passwd");
        std::fs::write(r.join("etc/group"), "root:x:0:\napp:x:1000:\n").expect("group");
        std::fs::write(r.join("etc/gone"), "deleted above\n").expect("gone");
        std::fs::create_dir_all(r.join("srv/old")).expect("srv");
        std::fs::write(r.join("srv/old/x"), "replaced above\n").expect("x");
    })];
    // The importer expands an opaque directory into whiteouts of what lies below.
    layers.push(layer(store, 1, |r| {
        std::fs::create_dir_all(r.join("etc")).expect("etc");
        common::whiteout(&r.join("etc/gone"));
        std::fs::create_dir_all(r.join("srv/old")).expect("srv");
        common::whiteout(&r.join("srv/old/x"));
        std::fs::write(r.join("srv/old/new"), "new\n").expect("new");
    }));
    for n in 2..LAYERS {
        layers.push(layer(store, n, |r| {
            std::fs::create_dir_all(r.join("layers")).expect("layers");
            std::fs::write(r.join("layers").join(n.to_string()), format!("{n}\n")).expect("w");
        }));
    }
    ImageManifest {
        layers,
        env: vec!["PATH=/bin".into(), "GREETING=from-the-store".into()],
        workdir: "/srv".into(),
        user: "app".into(),
        ..Default::default()
    }
}

fn backend(state: &Path, edge: &str, store: &Path) -> Arc<dyn Backend> {
    let ctx = BackendContext {
        edge_id: edge.into(),
        state_dir: state.to_path_buf(),
        agent_dir: PathBuf::from(env!("CARGO_BIN_EXE_opendsec"))
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default(),
        images: BTreeMap::new(),
        image_store: Some(store.to_path_buf()),
        network: None,
    };
    let cfg = BackendConfig {
        runtime: "linux".into(),
        ..Default::default()
    };
    match backends::build("container", &cfg, &ctx) {
        Ok(b) => b,
        Err(e) => panic!("building the container backend: {e}"),
    }
}

fn spec(image: &str) -> pb::SandboxSpec {
    pb::SandboxSpec {
        backend: "container".into(),
        image: image.into(),
        cpu_cores_limit: 1.0,
        memory_limit_mb: 256,
        disk_mb: 64,
        ..Default::default()
    }
}

async fn shell(b: &Arc<dyn Backend>, h: &Handle<'_>, cmd: &str) -> (String, String) {
    let rt = b.runtime().expect("runtime capability");
    let ch = rt.channel(h).await.expect("channel");
    let r = RuntimeClient::new(ch)
        .run_shell(pb::RunShellRequest {
            sandbox_id: h.sandbox_id.into(),
            cmd: cmd.into(),
            timeout: 30.0,
            ..Default::default()
        })
        .await
        .expect("run_shell")
        .into_inner();
    (
        String::from_utf8_lossy(&r.stdout).into_owned(),
        String::from_utf8_lossy(&r.stderr).into_owned(),
    )
}

const CHECK: &str = "id -u; pwd; echo $GREETING; cat /etc/gone 2>/dev/null || echo gone; \
                     ls /srv/old; cat /layers/2 /layers/59";
const EXPECTED: &str = "1000\n/srv\nfrom-the-store\ngone\nnew\n2\n59\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sixty_layer_store_image_runs_from_the_cache_and_outlives_the_store() {
    if !opendsec::sys::root_or_skip("the store image container tests") {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    // The store may be on NFS (scripts/test-nfs.sh); the node's state never is.
    let store_tmp = common::store_tempdir();
    let (state, store_dir) = (tmp.path().join("state"), store_tmp.path().join("store"));
    let store = Store::open(&store_dir).expect("store");
    let manifest = image(&store);
    let name = ImageRef::parse("root/t/busy:1").expect("name");
    store
        .write_manifest(&name, &manifest, false)
        .expect("manifest");
    let edge = "csi-1";
    let b = backend(&state, edge, &store_dir);

    let (id, sp) = (format!("{edge}.a"), spec("root/t/busy:1"));
    let st = b
        .create(&CreateRequest {
            fork: None,
            snapshot: None,
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: sp.clone(),
        })
        .await
        .expect("create from the store");
    let h = Handle {
        sandbox_id: &id,
        spec: &sp,
        state: &st,
    };
    let (out, err) = shell(&b, &h, CHECK).await;
    assert_eq!(out, EXPECTED, "stderr: {err}");
    // The record keeps the layers, so a restarted edge keeps their cached copies too.
    let recorded: opendsec::backends::container::ContainerState =
        serde_json::from_value(st.clone()).expect("state");
    assert_eq!(recorded.layers.len(), LAYERS);
    // Every layer copied once into the node's cache, nothing left half-copied.
    let cache = state.join(edge).join("layers");
    for d in &manifest.layers {
        assert!(cache.join(d.hex()).join("rootfs").is_dir(), "{d} cached");
    }
    assert_eq!(
        std::fs::read_dir(cache.join("tmp")).expect("tmp").count(),
        0
    );
    // The store knows which layers this sandbox stacks.
    let inuse = store_dir.join("inuse").join(edge).join(&id);
    let rec = std::fs::read_to_string(&inuse).expect("in-use record");
    assert_eq!(rec.lines().count(), LAYERS);

    // A creation's own user wins over the image's.
    let (id_root, mut sp_root) = (format!("{edge}.root"), spec("root/t/busy:1"));
    sp_root.init_user = "root".into();
    let st_root = b
        .create(&CreateRequest {
            fork: None,
            snapshot: None,
            sandbox_id: id_root.clone(),
            project: "root".into(),
            spec: sp_root.clone(),
        })
        .await
        .expect("create as root");
    let h_root = Handle {
        sandbox_id: &id_root,
        spec: &sp_root,
        state: &st_root,
    };
    assert_eq!(shell(&b, &h_root, "id -u").await.0, "0\n");
    b.stop(&h_root).await.expect("stop");

    // The store goes away (an NFS outage): the running sandbox reads on, and a new one of
    // the cached image still starts; an image it never had is unavailable, not a crash.
    let away = store_tmp.path().join("store-away");
    std::fs::rename(&store_dir, &away).expect("store away");
    assert_eq!(shell(&b, &h, CHECK).await.0, EXPECTED);
    let e = b
        .create(&CreateRequest {
            fork: None,
            snapshot: None,
            sandbox_id: format!("{edge}.b"),
            project: "root".into(),
            spec: spec("root/t/busy:1"),
        })
        .await
        .expect_err("no manifest to read while the store is away");
    assert!(
        matches!(e.reason(), Reason::NotFound | Reason::Unavailable),
        "{e}"
    );
    std::fs::rename(&away, &store_dir).expect("store back");

    // Unknown images and malformed names: nothing made.
    for (img, reason) in [
        ("root/t/nope:1", Reason::NotFound),
        ("root/t/Busy:1", Reason::Invalid),
        ("busy", Reason::NotFound),
    ] {
        let bad = format!("{edge}.bad");
        let e = b
            .create(&CreateRequest {
                fork: None,
                snapshot: None,
                sandbox_id: bad.clone(),
                project: "root".into(),
                spec: spec(img),
            })
            .await
            .err()
            .unwrap_or_else(|| panic!("{img} must fail"));
        assert_eq!(e.reason(), reason, "{img}: {e}");
        assert!(!store_dir.join("inuse").join(edge).join(&bad).exists());
        assert!(!state.join(edge).join("containers").join(&bad).exists());
    }

    b.stop(&h).await.expect("stop");
    assert!(!inuse.exists(), "stop drops the in-use record");
    // A record left by a crash goes with the edge's cleanup.
    std::fs::write(
        store_dir
            .join("inuse")
            .join(edge)
            .join(format!("{edge}.crashed")),
        "x\n",
    )
    .expect("stray record");
    let report = b.cleanup(&HashSet::new()).await.expect("cleanup");
    assert!(
        report.removed.iter().any(|r| r.contains("crashed")),
        "{report:?}"
    );
    assert_eq!(
        std::fs::read_dir(store_dir.join("inuse").join(edge))
            .expect("inuse")
            .count(),
        0
    );
}
