//! The microVM tests' shared parts: store layers, the backend (with or without the edge's
//! network), a sandbox spec and creation request, a shell in the guest, and the cleanup
//! of VMs a failed test leaves. As root.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use opendsec::backends::{
    self, Backend, BackendContext, CreateRequest, Handle, SnapshotInfo, SnapshotTarget,
};
use opendsec::config::BackendConfig;
use opendsec::images::digest::Digest;
use opendsec::images::store::Store;
use opendsec::netpol::network::Network;
use opendsec::pb::{self, runtime_client::RuntimeClient};

pub fn layer(store: &Store, n: usize, fill: impl FnOnce(&Path)) -> Digest {
    let d = Digest::of(format!("vm test layer {n} {}", std::process::id()).as_bytes());
    store
        .put_layer(&d, |r| {
            fill(r);
            Ok(())
        })
        .unwrap();
    d
}

/// The microVM backend of edge `edge` on `state`, with images from the store at `store`.
pub fn backend(state: &Path, edge: &str, store: &Path) -> Arc<dyn Backend> {
    backend_with(state, edge, store, false, None)
}

/// [`backend`] with EROFS image disks, and the edge's `network` when given.
pub fn backend_with(
    state: &Path,
    edge: &str,
    store: &Path,
    erofs_images: bool,
    network: Option<Arc<Network>>,
) -> Arc<dyn Backend> {
    backend_configured(state, edge, store, network, |c| {
        c.erofs_images = erofs_images
    })
}

/// [`backend`] with the edge's `network` when given and its config changed by `f`.
pub fn backend_configured(
    state: &Path,
    edge: &str,
    store: &Path,
    network: Option<Arc<Network>>,
    f: impl FnOnce(&mut BackendConfig),
) -> Arc<dyn Backend> {
    let ctx = BackendContext {
        edge_id: edge.into(),
        state_dir: state.to_path_buf(),
        agent_dir: PathBuf::from(super::BIN)
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default(),
        images: BTreeMap::new(),
        image_store: Some(store.to_path_buf()),
        network,
    };
    let mut cfg = BackendConfig {
        runtime: "qemu".into(),
        kernel: super::guest_kernel().display().to_string(),
        vm_overhead_mb: 48,
        ..Default::default()
    };
    f(&mut cfg);
    match backends::build("microvm", &cfg, &ctx) {
        Ok(b) => b,
        Err(e) => panic!("building the microvm backend: {e}"),
    }
}

/// A creation of sandbox `id` in project root, from `snapshot` when given.
pub fn create_request(id: &str, snapshot: Option<PathBuf>, spec: pb::SandboxSpec) -> CreateRequest {
    CreateRequest {
        fork: None,
        snapshot,
        sandbox_id: id.to_string(),
        project: "root".into(),
        spec,
    }
}

pub fn spec(image: &str) -> pb::SandboxSpec {
    pb::SandboxSpec {
        backend: "microvm".into(),
        image: image.into(),
        cpu_cores_limit: 1.5,
        memory_limit_mb: 256,
        disk_mb: 128,
        ..Default::default()
    }
}

/// Runs `cmd` in session `session` (in the background when `background`), whatever its
/// exit code.
pub async fn shell_in(
    b: &Arc<dyn Backend>,
    h: &Handle<'_>,
    session: &str,
    cmd: &str,
    background: bool,
) -> pb::ShellResult {
    let ch = b.runtime().unwrap().channel(h).await.unwrap();
    RuntimeClient::new(ch)
        .run_shell(pb::RunShellRequest {
            sandbox_id: h.sandbox_id.into(),
            cmd: cmd.into(),
            timeout: 60.0,
            session: session.into(),
            background,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
}

pub async fn shell(b: &Arc<dyn Backend>, h: &Handle<'_>, cmd: &str) -> String {
    let ch = b.runtime().unwrap().channel(h).await.unwrap();
    let r = RuntimeClient::new(ch)
        .run_shell(pb::RunShellRequest {
            sandbox_id: h.sandbox_id.into(),
            cmd: cmd.into(),
            timeout: 60.0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(
        r.exit_code,
        0,
        "{cmd}: {}",
        String::from_utf8_lossy(&r.stderr)
    );
    String::from_utf8_lossy(&r.stdout).into_owned()
}

/// The pids in a cgroup file of every hierarchy the sandbox has.
pub fn cgroup_pids(id: &str) -> HashSet<u32> {
    let mut out = HashSet::new();
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    for m in mounts.lines().filter(|l| l.contains(" - cgroup")) {
        let mount = m.split(' ').nth(4).unwrap();
        let walk = walkdir(Path::new(mount));
        for d in walk
            .iter()
            .filter(|d| d.ends_with(id) || d.to_string_lossy().contains(&format!("/{id}/")))
        {
            if let Ok(t) = std::fs::read_to_string(d.join("cgroup.procs")) {
                out.extend(t.lines().filter_map(|l| l.parse::<u32>().ok()));
            }
        }
    }
    out
}

pub fn walkdir(d: &Path) -> Vec<PathBuf> {
    let mut all = vec![d.to_path_buf()];
    let Ok(rd) = std::fs::read_dir(d) else {
        return all;
    };
    for e in rd.flatten() {
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            all.extend(walkdir(&e.path()));
        }
    }
    all
}

/// Kills what is left in the sandboxes' cgroups when the test ends, passed or not: a
/// failed assertion must not leave VMs running on the machine.
pub struct Leftovers(pub Vec<String>);

impl Drop for Leftovers {
    fn drop(&mut self) {
        for id in &self.0 {
            for pid in cgroup_pids(id) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
    }
}

/// A snapshot with memory of the VM of `h` into `dir` (which must not exist).
pub async fn snapshot_with_memory(
    b: &Arc<dyn Backend>,
    h: &Handle<'_>,
    dir: &Path,
) -> SnapshotInfo {
    let (_, info) = b
        .snapshotter()
        .expect("microVMs take snapshots")
        .snapshot(
            h,
            &SnapshotTarget {
                dir: dir.to_path_buf(),
                memory: true,
            },
        )
        .await
        .expect("snapshot");
    info
}
