//! The container backend (runtime `linux`) on its own, without an edge: create a sandbox from
//! the `host` image, run commands in it through aether, pause, resume, adopt it from a second
//! backend instance (what an edge restart does), stop it, and find nothing left behind.
//! Needs root; under CI=true a missing privilege fails the test.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use opendsec::backends::{self, Backend, BackendContext, CreateRequest, Handle, Health, Recorded};
use opendsec::config::BackendConfig;
use opendsec::pb::{self, runtime_client::RuntimeClient};
use opendsec::types::Reason;

fn root_or_skip() -> bool {
    opendsec::sys::root_or_skip("the container backend tests")
}

fn ctx(state: &Path, edge: &str) -> BackendContext {
    BackendContext {
        edge_id: edge.into(),
        state_dir: state.to_path_buf(),
        agent_dir: PathBuf::from(env!("CARGO_BIN_EXE_opendsec"))
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default(),
        images: BTreeMap::from([("host".to_string(), vec![PathBuf::from("/")])]),
    }
}

fn backend(state: &Path, edge: &str) -> Arc<dyn Backend> {
    backend_with(state, edge, BTreeMap::new())
}

fn backend_with(
    state: &Path,
    edge: &str,
    extra_images: BTreeMap<String, Vec<PathBuf>>,
) -> Arc<dyn Backend> {
    let cfg = BackendConfig {
        runtime: "linux".into(),
        ..Default::default()
    };
    let mut c = ctx(state, edge);
    c.images.extend(extra_images);
    match backends::build("container", &cfg, &c) {
        Ok(b) => b,
        Err(e) => panic!("building the container backend: {e}"),
    }
}

fn spec() -> pb::SandboxSpec {
    pb::SandboxSpec {
        backend: "container".into(),
        image: "host".into(),
        cpu_cores_limit: 1.0,
        memory_limit_mb: 512,
        disk_mb: 256,
        ..Default::default()
    }
}

async fn shell(b: &Arc<dyn Backend>, h: &Handle<'_>, cmd: &str) -> pb::ShellResult {
    let rt = b.runtime().expect("runtime capability");
    let ch = rt.channel(h).await.expect("channel");
    let mut c = RuntimeClient::new(ch);
    c.run_shell(pb::RunShellRequest {
        sandbox_id: h.sandbox_id.into(),
        cmd: cmd.into(),
        timeout: 30.0,
        ..Default::default()
    })
    .await
    .expect("run_shell")
    .into_inner()
}

fn leftovers(state: &Path, edge: &str, id: &str) -> Vec<String> {
    let mut out = Vec::new();
    for p in [
        state.join(edge).join("containers").join(id),
        state.join(edge).join("disks").join(format!("{id}.img")),
    ] {
        if p.exists() {
            out.push(p.display().to_string());
        }
    }
    if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
        for h in rd.flatten() {
            let p = h.path().join("opendsec").join(edge).join(id);
            if p.exists() {
                out.push(p.display().to_string());
            }
        }
    }
    for (dev, backing) in opendsec::sys::loopdev::attached(state) {
        out.push(format!("{} -> {}", dev.display(), backing.display()));
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for l in mounts.lines().filter(|l| l.contains(id)) {
        out.push(l.to_string());
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_adoption_and_nothing_left() {
    if !root_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path();
    let edge = "cb-0";
    let b = backend(state, edge);
    let id = format!("{edge}.lifecycle");
    let spec = spec();
    let st = b
        .create(&CreateRequest {
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: spec.clone(),
        })
        .await
        .expect("create");
    let h = Handle {
        sandbox_id: &id,
        spec: &spec,
        state: &st,
    };
    let r = shell(
        &b,
        &h,
        "echo hi; hostname; cat /proc/1/comm; ls /proc | grep -c '^[0-9]'",
    )
    .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first(), Some(&"hi"));
    assert_eq!(lines.get(1), Some(&"lifecycle"));
    // Only the sandbox's own processes are visible: aether, chronus, the shell and a few.
    let n: usize = lines
        .get(3)
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(999);
    assert!(n < 10, "{n} processes visible: {out}");
    assert_eq!(b.probe(&h).await, Health::Alive);

    // Nothing of the sandbox is in the host's mount table.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert!(!mounts.contains(&id), "sandbox mounts leaked into the host");

    b.pause(&h).await.expect("pause");
    // A second backend instance, as after an edge restart, takes the sandbox over.
    let b2 = backend(state, edge);
    let adopted = b2.adopt(&h, Recorded::Paused).await.expect("adopt");
    assert!(adopted.paused);
    b2.resume(&h).await.expect("resume");
    let r = shell(&b2, &h, "echo again").await;
    assert_eq!(r.stdout, b"again\n");

    b2.stop(&h).await.expect("stop");
    assert_eq!(b2.probe(&h).await, Health::Lost("aether exited".into()));
    assert_eq!(leftovers(state, edge, &id), Vec::<String>::new());
    // Stopping again is fine.
    b2.stop(&h).await.expect("second stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_leave_nothing_and_cleanup_removes_strays() {
    if !root_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path();
    let edge = "cb-1";
    let b = backend(state, edge);
    let mut s = spec();
    s.image = "nope".into();
    let id = format!("{edge}.badimage");
    let e = b
        .create(&CreateRequest {
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: s,
        })
        .await
        .expect_err("unknown image refused");
    assert_eq!(e.reason(), Reason::NotFound);
    let mut s = spec();
    s.masked_paths = vec!["/etc/../root".into()];
    let e = b
        .create(&CreateRequest {
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: s,
        })
        .await
        .expect_err("bad path refused");
    assert_eq!(e.reason(), Reason::Invalid);
    assert_eq!(leftovers(state, edge, &id), Vec::<String>::new());

    // A sandbox the edge has no record of is removed by cleanup.
    let stray = format!("{edge}.stray");
    let spec = spec();
    b.create(&CreateRequest {
        sandbox_id: stray.clone(),
        project: "root".into(),
        spec: spec.clone(),
    })
    .await
    .expect("create");
    // Another cluster on this machine with the same edge id (its own state dir) keeps its
    // sandbox when this one cleans up.
    let other_tmp = tempfile::tempdir().expect("tempdir");
    let other = backend(other_tmp.path(), edge);
    let theirs = format!("{edge}.theirs");
    let st = other
        .create(&CreateRequest {
            sandbox_id: theirs.clone(),
            project: "root".into(),
            spec: spec.clone(),
        })
        .await
        .expect("create theirs");
    let report = b.cleanup(&HashSet::new()).await.expect("cleanup");
    assert!(
        report.removed.iter().any(|r| r.contains(&stray)),
        "{report:?}"
    );
    assert!(
        !report.removed.iter().any(|r| r.contains(&theirs)),
        "{report:?}"
    );
    assert_eq!(leftovers(state, edge, &stray), Vec::<String>::new());
    let h = Handle {
        sandbox_id: &theirs,
        spec: &spec,
        state: &st,
    };
    assert_eq!(other.probe(&h).await, Health::Alive);
    other.stop(&h).await.expect("stop theirs");
}

/// A tiny image at `dir`: static busybox as the shell and a few tools.
fn busybox_layer(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir.join("bin")).expect("mkdir");
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
        .expect("busybox-static is installed (.ci/run installs it)");
    std::fs::copy(busybox, dir.join("bin/busybox")).expect("copy busybox");
    for tool in ["sh", "head", "test", "echo", "pwd"] {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(tool)).expect("symlink");
    }
    dir.to_path_buf()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bundles_config_gives_env_and_working_directory() {
    if !root_or_skip() {
        return;
    }
    // As `umoci unpack` lays an image out: BUNDLE/rootfs and BUNDLE/config.json.
    let tmp = tempfile::tempdir().expect("tempdir");
    let rootfs = busybox_layer(&tmp.path().join("bundle/rootfs"));
    std::fs::create_dir_all(rootfs.join("srv/app")).expect("mkdir");
    std::fs::write(
        tmp.path().join("bundle/config.json"),
        r#"{"ociVersion": "1.0.2", "process": {"cwd": "/srv/app",
            "env": ["PATH=/bin", "GREETING=from-the-image"], "args": ["sh"]}}"#,
    )
    .expect("config");
    let state = tmp.path().join("state");
    let edge = "cb-3";
    let b = backend_with(
        &state,
        edge,
        BTreeMap::from([("bundled".to_string(), vec![rootfs.clone()])]),
    );
    let id = format!("{edge}.bundled");
    let mut spec = spec();
    spec.image = "bundled".into();
    let st = b
        .create(&CreateRequest {
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: spec.clone(),
        })
        .await
        .expect("create");
    let h = Handle {
        sandbox_id: &id,
        spec: &spec,
        state: &st,
    };
    let r = shell(&b, &h, "echo $GREETING; pwd").await;
    assert_eq!(r.stdout, b"from-the-image\n/srv/app\n", "{r:?}");
    b.stop(&h).await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_nodes_in_an_image_open_nothing() {
    if !root_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path().join("state");
    // A whole image of its own (overlayfs refuses a lower layer inside another one, so not
    // on top of the host's /).
    let layer = busybox_layer(&tmp.path().join("layer"));
    // A block device node for the host's first disk, as a hostile image could carry.
    let node = layer.join("disk0");
    let made = std::process::Command::new("mknod")
        .arg(&node)
        .args(["b", "253", "0"])
        .status()
        .expect("mknod");
    assert!(made.success());
    let edge = "cb-2";
    let b = backend_with(
        &state,
        edge,
        BTreeMap::from([("withdev".to_string(), vec![layer.clone()])]),
    );
    let id = format!("{edge}.devnode");
    let mut spec = spec();
    spec.image = "withdev".into();
    let st = b
        .create(&CreateRequest {
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: spec.clone(),
        })
        .await
        .expect("create");
    let h = Handle {
        sandbox_id: &id,
        spec: &spec,
        state: &st,
    };
    let r = shell(&b, &h, "test -b /disk0 && echo is-block; head -c 1 /disk0").await;
    assert_eq!(r.stdout, b"is-block\n");
    assert_ne!(r.exit_code, 0);
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("Permission denied"),
        "{:?}",
        String::from_utf8_lossy(&r.stderr)
    );
    b.stop(&h).await.expect("stop");
}
