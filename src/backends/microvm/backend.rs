//! `MicrovmBackend`: the `Backend` of runtime `qemu` (docs/microvm.md "The backend"). Each
//! sandbox is one QEMU process running the `microvm` machine, in the sandbox's own cgroup,
//! with four disks: the node's agent disk, the image's disk (one per image per node, its
//! layers flattened), the sandbox's sparse writable ext4 disk and its config disk. aether
//! is the guest's PID 1 and serves the runtime API on a virtio-serial port, which QEMU
//! offers on a unix socket in the sandbox's directory.
//!
//! The state the edge records is QEMU's pid and start time and the store layers the image
//! stacks; everything else is found again by the sandbox id, so an edge restart re-adopts
//! running VMs by reconnecting to their sockets.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use sha2::Digest as _;
use tonic::transport::Channel;

use super::console::ConsoleTail;
use super::jail::Jailer;
use super::qemu::{Accel, Console, Disk, Machine, RamFile};
use super::qmp::Qmp;
use super::{agent_channel, disks, initramfs, snapshot};
use crate::backends::container::cgroup::{Cgroups, Limits};
use crate::backends::container::disk::Disks;
use crate::backends::container::resolve::Images;
use crate::backends::netslot;
use crate::backends::{
    Adopted, Backend, BackendContext, BackendError, BackendState, CleanupReport, CreateRequest,
    Handle, Health, Recorded, Runtime, SnapshotInfo, SnapshotTarget, Snapshotter,
};
use crate::config::BackendConfig;
use crate::guest::vminit::{VmConfig, AGENT_SERIAL, CONFIG_SERIAL, IMAGE_SERIAL, RW_SERIAL};

/// The default `vm_overhead_mb` (docs/configuration.md): QEMU itself, page tables and
/// device buffers, charged on top of the guest's memory.
pub const DEFAULT_VM_OVERHEAD_MB: i64 = 64;
/// The least guest memory: the cloud kernel, aether and a session's shell fit in 64 MiB
/// with room to spare; below it the guest's own OOM killer takes the agent's sessions.
pub const MIN_MEMORY_MB: i64 = 128;
/// The least CPU: under emulation a VM at a quarter of a core boots in about 20 s; below
/// that its boot outlasts the creation's wait.
pub const MIN_CPU_CORES: f64 = 0.25;

/// How long a new VM has to answer on its agent port: a boot under emulation (TCG) takes
/// 4 to 6 s alone and several times that beside other boots on 2 cores.
const BOOT_TIMEOUT_TCG: Duration = Duration::from_secs(180);
const BOOT_TIMEOUT_KVM: Duration = Duration::from_secs(30);
/// Threads of one QEMU: vCPUs, the main loop, I/O and RCU threads.
const QEMU_PIDS_MAX: i64 = 256;
/// The kernel's parameters: the serial console stays quiet (its output goes nowhere, see
/// [`MicrovmBackend::machine`]); a panic ends the VM.
const APPEND: &str = "console=ttyS0 quiet panic=-1 reboot=t";

/// The RAM QEMU gives a guest whose `memory_limit_mb` is `limit` (MiB): the limit, at
/// least [`MIN_MEMORY_MB`], except exactly 2048, which becomes 2049. With 2048 MiB QEMU's
/// microvm machine loads the initramfs so that it ends at the top of RAM, over the ACPI
/// tables the firmware put there, and the guest dies at boot (QEMU 7.2 and 10.0 alike);
/// one MiB more moves the top of RAM away from the initramfs. Admission and snapshots keep
/// counting the limit.
fn guest_ram_mb(limit: i64) -> u64 {
    match limit.max(MIN_MEMORY_MB) as u64 {
        2048 => 2049,
        mb => mb,
    }
}

/// What the edge records for one VM.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VmState {
    /// QEMU's pid.
    pub pid: u32,
    /// Its start time (clock ticks since boot, /proc/<pid>/stat field 22).
    pub start_time: u64,
    /// The store layers (hex) its image disk was made from, kept in the node's cache and
    /// the store's in-use records while it runs.
    pub layers: Vec<String>,
    /// Its image disk, which a resume attaches again.
    pub image_disk: PathBuf,
    /// Paused: QEMU has exited, the VM's devices and CPU state are in `state.mig` and its
    /// memory in the RAM file, both in the sandbox's directory.
    pub paused: bool,
    /// A copy of a snapshot: its RAM is a private copy-on-write mapping of this file (the
    /// snapshot's `memory`), and its pauses keep the RAM in `state.mig`. Empty: the VM's
    /// own RAM file, `ram` in its directory, shared.
    pub ram: PathBuf,
    /// The agent disk the guest runs from; empty: the node's.
    pub agent_disk: PathBuf,
    /// The snapshot a copy was restored from.
    pub snapshot: PathBuf,
    /// The user its init runs as, resolved at boot (the spec's `init_user`, else the
    /// image's, else root); a copy keeps its snapshot's. Empty: recorded before this field.
    pub init_user: String,
    /// The QEMU build and accelerator its running QEMU started on (`MicrovmBackend`'s
    /// `machine` then): what its snapshots record, even after the node's QEMU changed
    /// under it. Empty: recorded before this field, not known.
    pub machine: String,
    /// Its slot in the edge's network (docs/microvm.md "Network"); None: created while
    /// the edge's networking was off, it has only a loopback interface.
    pub net_slot: Option<u32>,
}

/// The microVM backend; see the module doc.
pub struct MicrovmBackend {
    name: String,
    /// The processes and threads of a VM's workload (`pids_max`), limited in the guest.
    pids_max: i64,
    qemu: PathBuf,
    kernel: PathBuf,
    accel: Accel,
    /// The QEMU build and accelerator VMs run on here (`QEMU emulator version …; tcg`): a
    /// VM's saved state restores only on the same. Empty when QEMU did not say.
    machine: String,
    initrd: PathBuf,
    agent_disk: PathBuf,
    images: Images,
    /// Image disks, one per image content.
    image_dir: PathBuf,
    /// Per-sandbox directories: sockets, config disk, guest RAM.
    dir: PathBuf,
    disks: Disks,
    cgroups: Cgroups,
    overhead_mb: i64,
    /// Each VM's uid and jail (docs/microvm.md "The jail").
    jailer: std::sync::Arc<Jailer>,
    /// The image disks' file system (`erofs_images`).
    image_format: disks::ImageFormat,
    /// QEMU maps a copy's RAM from a file it opens read-only (8.2 and later), so copies
    /// share their snapshot's memory file; before 8.2 the jailer gives each copy a file
    /// of its own (`Jailer::prepare`).
    private_ram_read_only: bool,
    /// Whether QEMU takes a migration file through an fd set (`file:/dev/fdset/N`, 9.0
    /// and later); before, it is handed over for `fd:`, which later QEMUs deprecate for
    /// anything but sockets.
    file_migration: bool,
    /// The edge's sandbox networking, when it is on.
    network: Option<std::sync::Arc<crate::netpol::network::Network>>,
    /// Held while an image disk is made, so two creations of one image make it once.
    building: tokio::sync::Mutex<()>,
    channels: Mutex<HashMap<String, Channel>>,
}

fn cfg_err(backend: &str, message: impl std::fmt::Display) -> BackendError {
    BackendError::Config {
        backend: backend.to_string(),
        message: message.to_string(),
    }
}

fn create_err(id: &str, message: impl std::fmt::Display) -> BackendError {
    BackendError::Create {
        sandbox_id: id.to_string(),
        message: message.to_string(),
    }
}

/// What a VM's saved state depends on here: QEMU's version line and the accelerator
/// (`QEMU emulator version 7.2.22 (Debian …); tcg`); empty when `qemu --version` fails.
fn machine_of(qemu: &Path, accel: Accel) -> String {
    let version = std::process::Command::new(qemu)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(|l| l.trim().to_string())
        })
        .unwrap_or_default();
    if version.is_empty() {
        return version;
    }
    let accel = match accel {
        Accel::Kvm => "kvm",
        Accel::Tcg { .. } => "tcg",
    };
    format!("{version}; {accel}")
}

/// Whether the QEMU of `machine` (`machine_of`, as a VM's `VmState::machine` records it:
/// "QEMU emulator version X.Y.Z; accel") is `major.minor` or later; false when it did
/// not say.
pub fn qemu_at_least(machine: &str, major: u32, minor: u32) -> bool {
    let Some(v) = machine
        .strip_prefix("QEMU emulator version ")
        .and_then(|r| r.split([' ', ';']).next())
    else {
        return false;
    };
    let mut n = v.split('.').map(|x| x.parse::<u32>().unwrap_or(0));
    let (a, b) = (n.next().unwrap_or(0), n.next().unwrap_or(0));
    (a, b) >= (major, minor)
}

/// The guest kernel as a jailed QEMU can read it: `kernel` itself when it is readable to
/// all (Debian's are), else a copy readable to all in the node's directory (some
/// distributions keep `/boot/vmlinuz-*` 0600).
fn readable_kernel(kernel: &Path, node: &Path) -> Result<PathBuf, String> {
    use std::os::unix::fs::PermissionsExt;
    let meta = std::fs::metadata(kernel).map_err(|e| format!("{}: {e}", kernel.display()))?;
    if meta.permissions().mode() & 0o004 != 0 {
        return Ok(kernel.to_path_buf());
    }
    std::fs::create_dir_all(node).map_err(|e| format!("{}: {e}", node.display()))?;
    let copy = node.join("vmlinuz");
    let tmp = node.join("vmlinuz.tmp");
    std::fs::copy(kernel, &tmp).map_err(|e| format!("copying {}: {e}", kernel.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))
        .and_then(|()| std::fs::rename(&tmp, &copy))
        .map_err(|e| format!("{}: {e}", copy.display()))?;
    Ok(copy)
}

/// Whether hardware virtualization works here: `/dev/kvm` opens and the CPU offers VMX or
/// SVM. A nested paravirtual KVM (a PVM guest) has `/dev/kvm` without either flag and does
/// not boot stock guest kernels, so it counts as none.
fn kvm_works() -> bool {
    let opens = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    // A jailed QEMU opens it through its group (not root's) or as anyone.
    let jailed = std::fs::metadata("/dev/kvm").is_ok_and(|m| {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let mode = m.permissions().mode();
        mode & 0o006 == 0o006 || (m.gid() != 0 && mode & 0o060 == 0o060)
    });
    let flags = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let hw = flags
        .lines()
        .filter(|l| l.starts_with("flags"))
        .any(|l| l.split_whitespace().any(|f| f == "vmx" || f == "svm"));
    // Only where KVM would otherwise be used is its mode worth a word.
    if hw && opens && !jailed {
        tracing::warn!("/dev/kvm opens for root only (or group root): a VM's jailed QEMU could not use it, so VMs are emulated; give /dev/kvm a group of its own with rw (Debian: kvm, 0660)");
    }
    if opens && !hw {
        tracing::info!("/dev/kvm is here but the CPU offers neither VMX nor SVM (a nested paravirtual KVM): VMs are emulated");
    }
    opens && jailed && hw
}

/// A copy of the agent binary without its debug sections (`strip`, when installed), made
/// once per binary in `dir`: it goes into every initramfs and agent disk, where a third of
/// the size boots faster. Without `strip` the binary is used as it is.
fn stripped_agent(src: &Path, dir: &Path) -> Result<PathBuf, String> {
    let bytes = std::fs::read(src).map_err(|e| format!("reading {}: {e}", src.display()))?;
    let digest = hex::encode(sha2::Sha256::digest(&bytes));
    let out = dir.join(format!("agent-{}", digest.get(..16).unwrap_or(&digest)));
    if out.is_file() {
        return Ok(out);
    }
    std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    let tmp = dir.join(format!(
        ".agent-{}-{:08x}",
        std::process::id(),
        rand::random::<u32>()
    ));
    let stripped = std::process::Command::new("strip")
        .arg("-o")
        .arg(&tmp)
        .arg(src)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !stripped {
        std::fs::write(&tmp, &bytes).map_err(|e| format!("writing {}: {e}", tmp.display()))?;
    }
    std::fs::rename(&tmp, &out).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        format!("renaming {}: {e}", out.display())
    })?;
    Ok(out)
}

/// What names an image's content for its disk: the digests of its store layers, or for a
/// node-local image its directories and when each last changed.
fn image_key(layers: &[String], lowers: &[PathBuf]) -> String {
    let mut h = sha2::Sha256::new();
    if layers.is_empty() {
        for l in lowers {
            h.update(l.as_os_str().as_encoded_bytes());
            let changed = std::fs::metadata(l)
                .and_then(|m| m.modified())
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map_or(0, |d| d.as_nanos());
            h.update(changed.to_le_bytes());
        }
    } else {
        for l in layers {
            h.update(l.as_bytes());
            h.update(b"\n");
        }
    }
    let hex = hex::encode(h.finalize());
    hex.get(..32).unwrap_or(&hex).to_string()
}

/// The host name a sandbox's id gives: its suffix, letters, digits and `-` only.
fn hostname_of(id: &str) -> String {
    let host = id.rsplit('.').next().unwrap_or(id);
    let h: String = host
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || *c == '-')
        .take(63)
        .collect();
    if h.is_empty() {
        "sandbox".into()
    } else {
        h
    }
}

impl MicrovmBackend {
    /// Builds the backend: finds QEMU (`qemu`, else `qemu-system-x86_64` on PATH) and the
    /// guest kernel (`kernel`, required), chooses KVM or emulation (one log line), and
    /// makes the node's initramfs and agent disk for this binary (from `agent_dir`'s
    /// `opendsec-aether` or `opendsec` if present, else this executable). Errors: `Config`
    /// naming what is missing or the step that failed.
    pub fn new(
        name: &str,
        cfg: &BackendConfig,
        ctx: &BackendContext,
    ) -> Result<MicrovmBackend, BackendError> {
        if !nix::unistd::geteuid().is_root() {
            return Err(cfg_err(name, "runtime \"qemu\" needs root"));
        }
        if cfg.kernel.is_empty() {
            return Err(cfg_err(
                name,
                "\"kernel\" is required: a guest kernel (vmlinuz) for the VMs \
                 (docs/microvm.md \"Guest kernel\")",
            ));
        }
        let kernel = PathBuf::from(&cfg.kernel);
        if !kernel.is_absolute() || !kernel.is_file() {
            return Err(cfg_err(
                name,
                format!(
                    "kernel {}: no such file (an absolute path)",
                    kernel.display()
                ),
            ));
        }
        let qemu = if cfg.qemu.is_empty() {
            super::qemu_binary().ok_or_else(|| {
                cfg_err(
                    name,
                    "qemu-system-x86_64 is not on PATH (Debian: qemu-system-x86); or set \"qemu\"",
                )
            })?
        } else {
            PathBuf::from(&cfg.qemu)
        };
        let accel = if kvm_works() {
            Accel::Kvm
        } else {
            Accel::Tcg {
                tsc_khz: super::qemu::host_tsc_khz(),
            }
        };
        let machine = machine_of(&qemu, accel);
        tracing::info!(backend = name, accel = ?accel, machine = %machine, kernel = %kernel.display(), "microVMs start with this accelerator");
        let base = ctx.state_dir.join(&ctx.edge_id);
        let node = base.join("vm");
        let src = ["opendsec-aether", "opendsec"]
            .iter()
            .map(|n| ctx.agent_dir.join(n))
            .find(|p| p.is_file())
            .unwrap_or_else(|| PathBuf::from("/proc/self/exe"));
        let agent = stripped_agent(&src, &node).map_err(|m| cfg_err(name, m))?;
        let agent_disk =
            disks::agent_disk(&agent, &node).map_err(|e| cfg_err(name, crate::types::chain(&e)))?;
        let initrd = node_initrd(&agent, &kernel, &node).map_err(|m| cfg_err(name, m))?;
        let cgroups =
            Cgroups::detect(&format!("opendsec/{}", ctx.edge_id)).map_err(|e| cfg_err(name, e))?;
        let dir = base.join("microvms");
        std::fs::create_dir_all(&dir)
            .map_err(|e| cfg_err(name, format!("{}: {e}", dir.display())))?;
        let kernel = readable_kernel(&kernel, &node).map_err(|m| cfg_err(name, m))?;
        let jailer = Jailer::new(&node, &dir, cfg.uid_base, accel == Accel::Kvm)
            .map_err(|m| cfg_err(name, m))?;
        let private_ram_read_only = qemu_at_least(&machine, 8, 2);
        let file_migration = qemu_at_least(&machine, 9, 0);
        let image_format = if cfg.erofs_images {
            if disks::mkfs_erofs().is_none() {
                return Err(cfg_err(
                    name,
                    "erofs_images needs mkfs.erofs (Debian: erofs-utils)",
                ));
            }
            disks::ImageFormat::Erofs
        } else {
            disks::ImageFormat::Ext4
        };
        let cache = cfg.layer_cache.unwrap_or(true).then(|| base.join("layers"));
        let images = Images::new(
            name,
            &ctx.edge_id,
            ctx.images.clone(),
            ctx.image_store.as_deref(),
            cache,
        )?;
        Ok(MicrovmBackend {
            name: name.to_string(),
            pids_max: if cfg.pids_max > 0 {
                cfg.pids_max
            } else {
                crate::backends::container::cgroup::DEFAULT_PIDS_MAX
            },
            qemu,
            kernel,
            accel,
            machine,
            initrd,
            agent_disk,
            images,
            image_dir: node.join("images"),
            dir,
            disks: Disks::new(base.join("vm-disks")),
            cgroups,
            overhead_mb: if cfg.vm_overhead_mb > 0 {
                cfg.vm_overhead_mb
            } else {
                DEFAULT_VM_OVERHEAD_MB
            },
            jailer: std::sync::Arc::new(jailer),
            image_format,
            private_ram_read_only,
            file_migration,
            network: ctx.network.clone(),
            building: tokio::sync::Mutex::new(()),
            channels: Mutex::new(HashMap::new()),
        })
    }

    fn sandbox_dir(&self, id: &str) -> PathBuf {
        self.dir.join(id)
    }

    fn agent_socket(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("agent.sock")
    }

    fn channels(&self) -> std::sync::MutexGuard<'_, HashMap<String, Channel>> {
        self.channels
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn state_of(h: &Handle<'_>) -> VmState {
        serde_json::from_value(h.state.clone()).unwrap_or_default()
    }

    /// QEMU's command line for sandbox `id`. The serial console goes nowhere (a guest's
    /// root could write to it without end, and a file of it would fill the node's disk);
    /// `start_qemu` reads a boot's console until the agent answers.
    fn machine(
        &self,
        id: &str,
        spec: &crate::pb::SandboxSpec,
        st: &VmState,
        incoming: bool,
    ) -> Machine {
        let dir = self.sandbox_dir(id);
        let ram = if st.ram.as_os_str().is_empty() {
            RamFile {
                path: dir.join("ram"),
                shared: true,
                open_read_only: false,
            }
        } else {
            RamFile {
                path: st.ram.clone(),
                shared: false,
                open_read_only: self.private_ram_read_only,
            }
        };
        let agent_disk = if st.agent_disk.as_os_str().is_empty() {
            self.agent_disk.clone()
        } else {
            st.agent_disk.clone()
        };
        Machine {
            kernel: self.kernel.clone(),
            initrd: Some(self.initrd.clone()),
            append: APPEND.into(),
            init_args: vec!["aether".into(), "--vm-init".into()],
            memory_mb: guest_ram_mb(spec.memory_limit_mb),
            vcpus: vcpus_of(spec),
            accel: self.accel,
            ram,
            disks: vec![
                Disk {
                    path: agent_disk,
                    read_only: true,
                    serial: AGENT_SERIAL.into(),
                },
                Disk {
                    path: st.image_disk.clone(),
                    read_only: true,
                    serial: IMAGE_SERIAL.into(),
                },
                Disk {
                    path: self.disks.path(id),
                    read_only: false,
                    serial: RW_SERIAL.into(),
                },
                Disk {
                    path: dir.join("config.img"),
                    read_only: true,
                    serial: CONFIG_SERIAL.into(),
                },
            ],
            agent_socket: self.agent_socket(id),
            qmp_socket: self.qmp_socket(id),
            listen_fds: None,
            tap_fd: None,
            console: Console::Null,
            incoming,
        }
    }

    /// The image disk for `lowers`, made the first time this node starts the image.
    async fn image_disk(
        &self,
        image: &str,
        layers: &[String],
        lowers: &[PathBuf],
    ) -> Result<PathBuf, BackendError> {
        if lowers
            .iter()
            .any(|l| l.canonicalize().is_ok_and(|c| c == Path::new("/")))
        {
            return Err(BackendError::ImageUnavailable {
                image: image.to_string(),
                message: "the development image of the host's / cannot become a VM's disk; \
                          use an image from the image store"
                    .into(),
            });
        }
        let key = image_key(layers, lowers);
        let _one = self.building.lock().await;
        let (lowers, dir) = (lowers.to_vec(), self.image_dir.clone());
        let format = self.image_format;
        tokio::task::spawn_blocking(move || disks::image_disk(&lowers, &key, &dir, format))
            .await
            .map_err(|e| BackendError::ImageUnavailable {
                image: image.to_string(),
                message: e.to_string(),
            })?
            .map_err(|e| BackendError::ImageUnavailable {
                image: image.to_string(),
                message: crate::types::chain(&e).to_string(),
            })
    }

    /// Starts QEMU for `machine` in the sandbox's cgroup and its jail (docs/microvm.md
    /// "The jail"), serving the agent port and QMP on sockets made here, and with the tap
    /// of the VM's network namespace when it is `networked`; returns its pid, and for a
    /// boot (not a restore) the console's reader, to be dropped once the agent answers.
    async fn start_qemu(
        &self,
        id: &str,
        machine: &Machine,
        networked: bool,
    ) -> Result<(u32, Option<ConsoleTail>), BackendError> {
        let uid = self
            .jailer
            .uid_of(&self.sandbox_dir(id).join("config.img"))
            .map_err(|m| create_err(id, m))?;
        self.jailer
            .prepare(machine, uid)
            .map_err(|m| create_err(id, m))?;
        let listen = |p: &Path| {
            let _ = std::fs::remove_file(p);
            std::os::unix::net::UnixListener::bind(p)
                .map_err(|e| create_err(id, format!("{}: {e}", p.display())))
        };
        let agent = listen(&self.agent_socket(id))?;
        let qmp = listen(&self.qmp_socket(id))?;
        let fds = [
            std::os::fd::AsRawFd::as_raw_fd(&agent),
            std::os::fd::AsRawFd::as_raw_fd(&qmp),
        ];
        let tap = if networked {
            let pin = self.netns_path(id);
            let tap = tokio::task::spawn_blocking(move || {
                let ns = crate::sys::netns::open_pinned(&pin)
                    .map_err(|e| format!("its network namespace: {e}"))?;
                crate::netpol::vmns::open_tap(std::os::fd::AsFd::as_fd(&ns))
                    .map_err(|e| crate::types::chain(&e).to_string())
            })
            .await
            .map_err(|e| create_err(id, e))?
            .map_err(|m| create_err(id, m))?;
            Some(tap)
        } else {
            None
        };
        let mut machine = machine.clone();
        machine.listen_fds = Some((fds[0], fds[1]));
        let mut inherited = fds.to_vec();
        // A boot's console is read until the agent answers; a restored guest's says
        // nothing the node needs.
        let console = if machine.incoming {
            None
        } else {
            let (node, qemu) = std::os::unix::net::UnixStream::pair()
                .map_err(|e| create_err(id, format!("the console's socket pair: {e}")))?;
            let fd = std::os::fd::AsRawFd::as_raw_fd(&qemu);
            machine.console = Console::Fd(fd);
            inherited.push(fd);
            Some((node, qemu))
        };
        if let Some(t) = &tap {
            let fd = std::os::fd::AsRawFd::as_raw_fd(t);
            machine.tap_fd = Some(fd);
            inherited.push(fd);
        }
        let args = machine.args().map_err(|e| create_err(id, e))?;
        let jail = self
            .jailer
            .plan(&machine, &self.qemu, uid)
            .map_err(|m| create_err(id, format!("planning QEMU's jail: {m}")))?;
        let cg = self.cgroups.open(id);
        let procs: Vec<std::fs::File> = cg
            .procs_files()
            .iter()
            .map(|p| {
                std::fs::OpenOptions::new()
                    .write(true)
                    .open(p)
                    .map_err(|e| create_err(id, format!("opening {}: {e}", p.display())))
            })
            .collect::<Result<_, _>>()?;
        let log = std::fs::File::create(self.sandbox_dir(id).join("qemu.log"))
            .map_err(|e| create_err(id, format!("creating qemu.log: {e}")))?;
        let mut cmd = std::process::Command::new(&self.qemu);
        cmd.args(&args)
            .env_clear()
            .current_dir(self.sandbox_dir(id))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log);
        let procs_fds: Vec<i32> = procs.iter().map(std::os::fd::AsRawFd::as_raw_fd).collect();
        crate::sys::process::join_cgroups_at_exec(&mut cmd, &procs_fds);
        crate::sys::process::inherit_at_exec(&mut cmd, &inherited);
        // Last: the cgroup files are the host's, out of the jail's reach.
        jail.enter_at_exec(&mut cmd);
        let mut cmd = tokio::process::Command::from(cmd);
        cmd.kill_on_drop(false);
        let child = tokio::task::spawn_blocking(move || cmd.spawn())
            .await
            .map_err(|e| create_err(id, e))?
            .map_err(|e| {
                let log = log_tail(&self.sandbox_dir(id).join("qemu.log"));
                create_err(
                    id,
                    format!(
                        "starting {}: {e}{}",
                        self.qemu.display(),
                        tail(&log).map(|t| format!(" ({t})")).unwrap_or_default()
                    ),
                )
            })?;
        drop((procs, tap));
        // QEMU holds the sockets now; the node's copies would keep a dead VM's port
        // accepting connections nobody serves, and QEMU's console end open after QEMU.
        drop((agent, qmp));
        let console = match console {
            None => None,
            Some((node, qemu)) => {
                drop(qemu);
                match ConsoleTail::spawn(node) {
                    Ok(t) => Some(t),
                    Err(e) => {
                        tracing::warn!(sandbox_id = %id, error = %e, "cannot read the VM's console");
                        None
                    }
                }
            }
        };
        let pid = child
            .id()
            .ok_or_else(|| create_err(id, "QEMU exited at once"))?;
        // Reaped when it exits, whoever stops it; its liveness is judged by its pid.
        tokio::spawn(async move {
            let mut child = child;
            let _ = child.wait().await;
        });
        Ok((pid, console))
    }

    /// Waits until the VM's aether answers on its port, or QEMU ends, or `limit` passes.
    /// Errors: `Create`, with what QEMU logged last and, for a boot, the last lines of
    /// the guest's `console`.
    async fn wait_for_agent(
        &self,
        id: &str,
        pid: u32,
        start_time: u64,
        limit: Duration,
        console: Option<&ConsoleTail>,
    ) -> Result<Channel, BackendError> {
        let last_words = |t: String| {
            if t.is_empty() {
                String::new()
            } else {
                format!("; the guest's console ended with:\n{t}")
            }
        };
        let socket = self.agent_socket(id);
        let started = Instant::now();
        let mut wait = Duration::from_millis(10);
        loop {
            let attempt = async {
                let ch = agent_channel(&socket).await.ok()?;
                let mut c = crate::pb::runtime_client::RuntimeClient::new(ch.clone());
                c.list_sessions(crate::pb::ListSessionsRequest::default())
                    .await
                    .ok()?;
                Some(ch)
            };
            if let Ok(Some(ch)) = tokio::time::timeout(Duration::from_secs(5), attempt).await {
                return Ok(ch);
            }
            if !qemu_alive(pid, start_time) {
                let words = match console {
                    Some(c) => c.last_words(Duration::from_secs(1)).await,
                    None => String::new(),
                };
                let log = log_tail(&self.sandbox_dir(id).join("qemu.log"));
                return Err(create_err(
                    id,
                    format!(
                        "the VM ended before its agent answered{}{}",
                        tail(&log)
                            .map(|t| format!(": QEMU said {t:?}"))
                            .unwrap_or_default(),
                        last_words(words)
                    ),
                ));
            }
            if started.elapsed() > limit {
                return Err(create_err(
                    id,
                    format!(
                        "the VM's agent did not answer within {limit:?}{}",
                        last_words(console.map(ConsoleTail::text).unwrap_or_default())
                    ),
                ));
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(Duration::from_millis(200));
        }
    }

    /// Removes everything of sandbox `id`: QEMU (with everything in its cgroup), the
    /// cgroup, the writable disk and the sandbox's directory. Missing pieces are fine.
    /// Errors: `Operation` listing every step that failed (each is tried).
    async fn destroy(&self, id: &str) -> Result<(), BackendError> {
        self.channels().remove(id);
        self.images.release(id).await;
        let cg = self.cgroups.open(id);
        let (disks, dir) = (self.disks.clone(), self.sandbox_dir(id));
        let sid = id.to_string();
        let jailer = self.jailer.clone();
        let failed = tokio::task::spawn_blocking(move || {
            let mut failed = Vec::new();
            if cg.exists() {
                match cg.kill_all() {
                    Err(e) => failed.push(e.to_string()),
                    Ok(()) => {
                        if let Err(e) = cg.remove() {
                            failed.push(e.to_string());
                        }
                    }
                }
            }
            if !failed.is_empty() {
                // QEMU may still hold its files: they stay for the next cleanup.
                return failed;
            }
            if let Err(e) = disks.remove(&sid) {
                failed.push(crate::types::chain(&e).to_string());
            }
            // QEMU is gone: its uid is free for the host's next VM. Its network namespace
            // ends with the pin, the slot's veth with it.
            jailer.release(&dir.join("config.img"));
            if let Err(e) = crate::sys::netns::remove_pinned(&dir.join("netns")) {
                failed.push(format!("unpinning its network namespace: {e}"));
            }
            match std::fs::remove_dir_all(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => failed.push(format!("removing {}: {e}", dir.display())),
            }
            failed
        })
        .await
        .map_err(|e| BackendError::Operation {
            op: "stop",
            sandbox_id: id.to_string(),
            message: e.to_string(),
        })?;
        if failed.is_empty() {
            Ok(())
        } else {
            Err(BackendError::Operation {
                op: "stop",
                sandbox_id: id.to_string(),
                message: failed.join("; "),
            })
        }
    }

    /// Where the VM's network namespace is pinned (docs/microvm.md "Network").
    fn netns_path(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("netns")
    }

    /// Gives VM `id` its network in `slot`: a namespace of its own pinned in its directory,
    /// the slot's veth as its `eth0` under `policy`, and the tap its QEMU gets
    /// (`crate::netpol::vmns`). What was made stays for [`Self::destroy`] and the slot's
    /// release when a step fails. Errors: `Internal`-kind creation errors naming the step.
    async fn connect(
        &self,
        id: &str,
        slot: u32,
        policy: &crate::netpol::Policy,
    ) -> Result<(), BackendError> {
        let Some(network) = &self.network else {
            return Err(create_err(id, "this edge's networking is off"));
        };
        let pin = self.netns_path(id);
        let ns = tokio::task::spawn_blocking(move || {
            crate::sys::netns::create_pinned(&pin)?;
            crate::sys::netns::open_pinned(&pin)
        })
        .await
        .map_err(|e| create_err(id, e))?
        .map_err(|e| create_err(id, format!("making its network namespace: {e}")))?;
        let attached = network
            .attach(std::os::fd::AsFd::as_fd(&ns), slot, policy)
            .await
            .map_err(|e| {
                create_err(
                    id,
                    format!("connecting its network: {}", crate::types::chain(&e)),
                )
            })?;
        let dns = attached.addrs.gateway;
        tokio::task::spawn_blocking(move || {
            crate::netpol::vmns::setup(std::os::fd::AsFd::as_fd(&ns), dns)
        })
        .await
        .map_err(|e| create_err(id, e))?
        .map_err(|e| {
            create_err(
                id,
                format!("its network namespace: {}", crate::types::chain(&e)),
            )
        })
    }

    fn qmp_socket(&self, id: &str) -> PathBuf {
        self.sandbox_dir(id).join("qmp.sock")
    }

    /// Pauses a running VM: stops its CPUs, writes its devices' state to `state.mig` (the
    /// RAM file, shared, stays out of the stream), has QEMU exit and gives the RAM file's
    /// pages back to the node. If a step before QEMU's exit fails, the VM runs on.
    /// Errors: `Lost` when QEMU is gone, `Operation` with the step that failed.
    async fn pause_vm(&self, sandbox: &Handle<'_>) -> Result<VmState, BackendError> {
        let id = sandbox.sandbox_id;
        let mut st = Self::state_of(sandbox);
        if st.paused {
            return Ok(st);
        }
        if !qemu_alive(st.pid, st.start_time) {
            return Err(BackendError::Lost {
                sandbox_id: id.to_string(),
                message: "the VM's QEMU exited".into(),
            });
        }
        let err = |m: String| op_err("pause", id, m);
        let mut q = Qmp::connect(&self.qmp_socket(id))
            .await
            .map_err(|e| err(e.to_string()))?;
        q.execute("stop", None)
            .await
            .map_err(|e| err(e.to_string()))?;
        let dir = self.sandbox_dir(id);
        let saved = self.save_state(&mut q, &dir).await;
        if let Err(m) = saved {
            // The VM goes on as it was.
            let _ = std::fs::remove_file(dir.join(STATE_FILE));
            return Err(err(match continue_vm(&mut q).await {
                Ok(()) => m,
                Err(c) => format!("{m}; then continuing the VM failed: {c}"),
            }));
        }
        self.channels().remove(id);
        let _ = q.execute("quit", None).await;
        wait_gone(st.pid, st.start_time).await;
        // wait_gone counts a zombie as gone; until the reaper takes it, it is still in the
        // cgroup, where a resume's QEMU is about to go.
        let cg = self.cgroups.open(id);
        let started = Instant::now();
        while !cg.pids().is_empty() && started.elapsed() < QUIT_TIMEOUT {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        // A copy's RAM was private: it went with QEMU, and its pages are in the stream.
        let ram = st.ram.as_os_str().is_empty().then(|| dir.join("ram"));
        let mark = dir.join(PAUSED_MARK);
        tokio::task::spawn_blocking(move || -> std::io::Result<()> {
            if let Some(ram) = ram {
                release_ram(&ram)?;
            }
            std::fs::File::create(&mark)?.sync_all()
        })
        .await
        .map_err(|e| err(e.to_string()))?
        .map_err(|e| err(format!("releasing the VM's memory: {e}")))?;
        st.pid = 0;
        st.start_time = 0;
        st.paused = true;
        Ok(st)
    }

    /// Migrates the stopped VM behind `q` into `<dir>/state.mig`, synced.
    async fn save_state(&self, q: &mut Qmp, dir: &Path) -> Result<(), String> {
        ignore_shared_ram(q).await?;
        // The default 128 MiB/s holds even a stopped VM's stream back, and a copy's
        // stream carries its whole RAM.
        q.execute(
            "migrate-set-parameters",
            Some(serde_json::json!({"max-bandwidth": MIGRATE_BANDWIDTH})),
        )
        .await
        .map_err(|e| e.to_string())?;
        let path = dir.join(STATE_FILE);
        let file = {
            use std::os::unix::fs::OpenOptionsExt;
            std::fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(0o600)
                .open(&path)
                .map_err(|e| format!("{}: {e}", path.display()))?
        };
        let (uri, set) = self.hand_over(q, &file).await?;
        if let Err(e) = q
            .execute("migrate", Some(serde_json::json!({ "uri": uri })))
            .await
        {
            forget_set(q, set).await;
            return Err(e.to_string());
        }
        let done = migration_done(q).await;
        if done.is_err() {
            // A migration left running would refuse the next one.
            let _ = q.execute("migrate_cancel", None).await;
        }
        forget_set(q, set).await;
        done?;
        file.sync_all()
            .map_err(|e| format!("{}: {e}", path.display()))
    }

    /// Resumes a paused VM: a new QEMU on the same disks and RAM file, waiting for a
    /// migration, fed `state.mig`, then continued; the agent answers as before, its
    /// sessions and processes where they were. Errors: `Operation` with the step that
    /// failed (the VM stays paused: its files are untouched).
    async fn resume_vm(&self, sandbox: &Handle<'_>) -> Result<VmState, BackendError> {
        let id = sandbox.sandbox_id;
        let mut st = Self::state_of(sandbox);
        if !st.paused {
            return Ok(st);
        }
        let err = |m: String| op_err("resume", id, m);
        let dir = self.sandbox_dir(id);
        if st.image_disk.as_os_str().is_empty() {
            // Recorded before the record named it: the image's disk is found again by the
            // image, as its creation made it.
            let image = self.images.resolve(id, &sandbox.spec.image).await?;
            st.image_disk = self
                .image_disk(&sandbox.spec.image, &st.layers, &image.lowers)
                .await?;
        }
        let (pid, start_time, ch) = self
            .start_restored(id, sandbox.spec, &st, &dir.join(STATE_FILE), err)
            .await?;
        // The clock stood still while it was paused; its identity stays.
        if let Err(e) = post_restore(&ch, id, false).await {
            tracing::warn!(sandbox_id = %id, error = %e, "the resumed VM did not take the clock and seed");
        }
        self.channels().insert(id.to_string(), ch);
        let _ = std::fs::remove_file(dir.join(PAUSED_MARK));
        let _ = std::fs::remove_file(dir.join(STATE_FILE));
        st.pid = pid;
        st.start_time = start_time;
        st.paused = false;
        st.machine = self.machine.clone();
        Ok(st)
    }

    /// Starts QEMU for VM `st` waiting for a migration, feeds it `stream`, continues it
    /// and waits for its agent; returns QEMU's pid, start time and the agent's channel.
    /// A QEMU that did not take the stream is killed. Errors: `err` of the restore's
    /// failure; `Create` from starting QEMU or the agent's wait.
    async fn start_restored(
        &self,
        id: &str,
        spec: &crate::pb::SandboxSpec,
        st: &VmState,
        stream: &Path,
        err: impl Fn(String) -> BackendError,
    ) -> Result<(u32, u64, Channel), BackendError> {
        let machine = self.machine(id, spec, st, true);
        let (pid, _) = self.start_qemu(id, &machine, st.net_slot.is_some()).await?;
        let start_time = crate::backends::container::start_time(pid)
            .ok()
            .flatten()
            .unwrap_or_default();
        if let Err(m) = self.restore_state(id, stream, pid, start_time).await {
            if let Ok(p) = i32::try_from(pid) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            wait_gone(pid, start_time).await;
            return Err(err(m));
        }
        let ch = self
            .wait_for_agent(id, pid, start_time, BOOT_TIMEOUT_KVM, None)
            .await?;
        Ok((pid, start_time, ch))
    }

    /// Feeds the migration stream `path` to the new QEMU `pid` and continues the VM.
    async fn restore_state(
        &self,
        id: &str,
        path: &Path,
        pid: u32,
        start_time: u64,
    ) -> Result<(), String> {
        let dir = self.sandbox_dir(id);
        let socket = self.qmp_socket(id);
        let started = Instant::now();
        let mut q = loop {
            match Qmp::connect(&socket).await {
                Ok(q) => break q,
                Err(e) => {
                    if !qemu_alive(pid, start_time) || started.elapsed() > MIGRATE_TIMEOUT {
                        let log = log_tail(&dir.join("qemu.log"));
                        return Err(format!(
                            "QEMU's QMP socket: {e}{}",
                            tail(&log)
                                .map(|t| format!("; QEMU said {t:?}"))
                                .unwrap_or_default()
                        ));
                    }
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        };
        ignore_shared_ram(&mut q).await?;
        let file = std::fs::File::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let (uri, set) = self.hand_over(&mut q, &file).await?;
        let loaded = match q
            .execute("migrate-incoming", Some(serde_json::json!({ "uri": uri })))
            .await
        {
            Ok(_) => Self::until_loaded(&mut q, started).await,
            Err(e) => Err(e.to_string()),
        };
        forget_set(&mut q, set).await;
        loaded?;
        q.execute("cont", None).await.map_err(|e| e.to_string())?;
        Ok(())
    }

    /// Hands QEMU the migration file `file` and returns the URI it is known by, with the
    /// fd set it went into (QEMU 9.0 on: `file:/dev/fdset/N`; before: `fd:state`).
    async fn hand_over(
        &self,
        q: &mut Qmp,
        file: &std::fs::File,
    ) -> Result<(String, Option<u64>), String> {
        let fd = std::os::fd::AsFd::as_fd(file);
        if self.file_migration {
            let set = q.add_fd(fd).await.map_err(|e| e.to_string())?;
            Ok((format!("file:/dev/fdset/{set}"), Some(set)))
        } else {
            q.send_fd("state", fd).await.map_err(|e| e.to_string())?;
            Ok(("fd:state".into(), None))
        }
    }

    /// Waits until an incoming migration has loaded (the VM stands `paused`), from
    /// `started` on. Errors: another state, or [`MIGRATE_TIMEOUT`].
    async fn until_loaded(q: &mut Qmp, started: Instant) -> Result<(), String> {
        loop {
            let status = q.status().await.map_err(|e| e.to_string())?;
            match status.as_str() {
                "paused" | "postmigrate" => break,
                "inmigrate" | "prelaunch" => {}
                other => return Err(format!("the restored VM is {other}, not paused")),
            }
            if started.elapsed() > MIGRATE_TIMEOUT {
                return Err(format!("restore not done within {MIGRATE_TIMEOUT:?}"));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }

    /// Writes a snapshot of the VM to `target` (see [`snapshot`]): a running VM's vCPUs
    /// stop for the stream and the copies of its RAM and disk, then go on; a paused VM's
    /// saved files are copied as they are. Errors: `Lost` (QEMU gone), `Operation` with
    /// the step that failed (the target is then removed; the VM runs on as it was).
    async fn snapshot_vm(
        &self,
        sandbox: &Handle<'_>,
        target: &Path,
    ) -> Result<snapshot::SnapshotMeta, BackendError> {
        let id = sandbox.sandbox_id;
        let st = Self::state_of(sandbox);
        let err = |m: String| op_err("snapshot", id, m);
        if !st.paused && !qemu_alive(st.pid, st.start_time) {
            return Err(BackendError::Lost {
                sandbox_id: id.to_string(),
                message: "the VM's QEMU exited".into(),
            });
        }
        {
            use std::os::unix::fs::DirBuilderExt;
            // 0700: it holds the guest's memory.
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(target)
                .map_err(|e| err(format!("creating {}: {e}", target.display())))?;
        }
        let r = self.write_snapshot(sandbox, &st, target).await;
        if r.is_err() {
            let _ = std::fs::remove_dir_all(target);
        }
        r.map_err(err)
    }

    async fn write_snapshot(
        &self,
        sandbox: &Handle<'_>,
        st: &VmState,
        target: &Path,
    ) -> Result<snapshot::SnapshotMeta, String> {
        let id = sandbox.sandbox_id;
        let dir = self.sandbox_dir(id);
        let mut meta = snapshot::SnapshotMeta {
            format: snapshot::FORMAT,
            memory_mb: sandbox.spec.memory_limit_mb.max(MIN_MEMORY_MB),
            vcpus: vcpus_of(sandbox.spec),
            layers: st.layers.clone(),
            image: sandbox.spec.image.clone(),
            source: id.to_string(),
            paused_ms: 0.0,
            init_user: st.init_user.clone(),
            machine: st.machine.clone(),
            nic: st.net_slot.is_some(),
        };
        let files = {
            let (dir, target, st) = (dir.clone(), target.to_path_buf(), st.clone());
            let disk = self.disks.path(id);
            let agent = if st.agent_disk.as_os_str().is_empty() {
                self.agent_disk.clone()
            } else {
                st.agent_disk.clone()
            };
            let mb = meta.memory_mb;
            move || -> Result<(), String> {
                let at = |what: &'static str| move |e: std::io::Error| format!("{what}: {e}");
                if st.ram.as_os_str().is_empty() {
                    crate::backends::container::disk::sparse_copy(
                        &dir.join("ram"),
                        &target.join(snapshot::MEMORY),
                    )
                    .map_err(at("copying the RAM"))?;
                } else {
                    // A copy's RAM is private and goes whole into its stream.
                    snapshot::empty_memory(&target.join(snapshot::MEMORY), guest_ram_mb(mb) as i64)
                        .map_err(at("making the memory file"))?;
                }
                crate::backends::container::disk::sparse_copy(&disk, &target.join(snapshot::DISK))
                    .map_err(at("copying the writable disk"))?;
                snapshot::link_or_copy(&st.image_disk, &target.join(snapshot::IMAGE_DISK))
                    .map_err(at("keeping the image disk"))?;
                snapshot::link_or_copy(&agent, &target.join(snapshot::AGENT_DISK))
                    .map_err(at("keeping the agent disk"))
            }
        };
        if st.paused {
            let (from, to) = (dir.join(STATE_FILE), target.join(snapshot::STATE));
            tokio::task::spawn_blocking(move || -> Result<(), String> {
                crate::backends::container::disk::sparse_copy(&from, &to)
                    .map_err(|e| format!("copying the saved state: {e}"))?;
                files()
            })
            .await
            .map_err(|e| e.to_string())??;
        } else {
            if !qemu_alive(st.pid, st.start_time) {
                return Err("the VM's QEMU exited".into());
            }
            let mut q = Qmp::connect(&self.qmp_socket(id))
                .await
                .map_err(|e| e.to_string())?;
            let stopped = Instant::now();
            q.execute("stop", None).await.map_err(|e| e.to_string())?;
            let saved = match self.save_state(&mut q, target).await {
                Ok(()) => tokio::task::spawn_blocking(files)
                    .await
                    .map_err(|e| e.to_string())
                    .and_then(|r| r),
                Err(e) => Err(e),
            };
            // Whatever came of it, the VM goes on.
            let cont = continue_vm(&mut q).await;
            meta.paused_ms = stopped.elapsed().as_secs_f64() * 1000.0;
            match (saved, cont) {
                (Ok(()), Ok(())) => {}
                (Err(e), Ok(())) => return Err(e),
                (Ok(()), Err(c)) => {
                    return Err(format!("continuing the VM after its snapshot: {c}"))
                }
                (Err(e), Err(c)) => return Err(format!("{e}; then continuing the VM failed: {c}")),
            }
        }
        let (t, m) = (target.to_path_buf(), meta.clone());
        tokio::task::spawn_blocking(move || snapshot::write_meta(&t, &m))
            .await
            .map_err(|e| e.to_string())??;
        Ok(meta)
    }

    /// Creates sandbox `req` as a copy of the snapshot in `from`: its own writable disk
    /// (a copy of the snapshot's) and config disk, the snapshot's RAM mapped
    /// copy-on-write, its stream restored, and then the guest told its new identity.
    /// Errors: `Invalid` (not a snapshot; memory, vCPUs or disk size other than the snapshot's),
    /// `Create` with the step that failed.
    async fn restore_vm(
        &self,
        req: &CreateRequest,
        from: &Path,
        net: Option<&(u32, crate::netpol::Policy)>,
    ) -> Result<VmState, BackendError> {
        let id = &req.sandbox_id;
        let invalid = |message: String| BackendError::Invalid {
            sandbox_id: id.clone(),
            message,
        };
        let from = from.to_path_buf();
        let (meta, disk_bytes) = {
            let f = from.clone();
            let checked = tokio::task::spawn_blocking(move || {
                snapshot::check_files(&f)?;
                let disk = std::fs::metadata(f.join(snapshot::DISK))
                    .map(|m| m.len())
                    .map_err(|e| format!("{}: {e}", f.join(snapshot::DISK).display()))?;
                Ok::<_, String>((snapshot::read_meta(&f)?, disk))
            })
            .await
            .map_err(|e| create_err(id, e))?;
            match checked {
                Ok(v) => v,
                Err(m) => return Err(self.snapshot_gone(req, &from).await.unwrap_or(invalid(m))),
            }
        };
        // The copy's disk is the snapshot's, whose file system fills it: another size
        // would be a spec the sandbox does not have.
        let disk_mb = disk_bytes >> 20;
        if u64::try_from(req.spec.disk_mb).ok() != Some(disk_mb) {
            return Err(invalid(format!(
                "the snapshot's disk has {disk_mb} MB; a copy must have the same (asked: disk_mb {})",
                req.spec.disk_mb
            )));
        }
        let memory_mb = req.spec.memory_limit_mb.max(MIN_MEMORY_MB);
        if meta.memory_mb != memory_mb || meta.vcpus != vcpus_of(&req.spec) {
            return Err(invalid(format!(
                "the snapshot's VM has {} MiB and {} vCPUs; a copy must have the same (asked: {memory_mb} MiB, {} vCPUs)",
                meta.memory_mb,
                meta.vcpus,
                vcpus_of(&req.spec)
            )));
        }
        if !meta.machine.is_empty() && !self.machine.is_empty() && meta.machine != self.machine {
            return Err(invalid(format!(
                "the snapshot was taken on {:?} and this node runs {:?}: a VM's saved state restores only on the same QEMU and accelerator",
                meta.machine, self.machine
            )));
        }
        // The copy's devices are its source's, and its guest configured the network it had.
        if meta.nic != net.is_some() {
            return Err(invalid(format!(
                "the snapshot's VM had {} network device and this node's sandbox networking is {}: a copy has its source's devices",
                if meta.nic { "a" } else { "no" },
                if net.is_some() { "on" } else { "off" }
            )));
        }
        // The copy's processes already run as the snapshot's user, and its config disk is
        // never read again: another user cannot be honoured, so it is refused, not ignored.
        let asked = &req.spec.init_user;
        // A snapshot of a VM booted by an older build does not know its user: no check.
        if !asked.is_empty() && !meta.init_user.is_empty() && *asked != meta.init_user {
            return Err(invalid(format!(
                "init_user {asked:?}: a copy of a memory snapshot runs as its snapshot did ({:?}); leave init_user unset",
                meta.init_user
            )));
        }
        let digests = meta
            .layers
            .iter()
            .map(|h| crate::images::digest::Digest::parse(&format!("sha256:{h}")))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| invalid(format!("the snapshot's layers: {e}")))?;
        self.images.mark_in_use(id, &digests).await?;
        let cfg = VmConfig {
            sandbox_id: id.clone(),
            hostname: hostname_of(id),
            disk_mb: req.spec.disk_mb.max(1) as u64,
            ..Default::default()
        };
        if let Err(e) = self
            .make_files(
                id,
                &req.spec,
                cfg,
                NewDisk::CopyOf(from.join(snapshot::DISK)),
            )
            .await
        {
            return Err(self.snapshot_gone(req, &from).await.unwrap_or(e));
        }
        if let Some((slot, policy)) = net {
            self.connect(id, *slot, policy).await?;
        }
        // The copy holds the snapshot's files by hard links of its own where it can, so
        // that removing the snapshot never pulls them from under a copy that still runs
        // or will resume.
        let held = {
            let (d, f) = (self.sandbox_dir(id), from.clone());
            let held = tokio::task::spawn_blocking(move || {
                let at = |name: &str| (f.join(name), d.join(format!("snap-{name}")));
                let disk = |name: &str| -> Result<PathBuf, String> {
                    let (from, to) = at(name);
                    snapshot::link_or_copy(&from, &to)
                        .map(|()| to)
                        .map_err(|e| format!("keeping the snapshot's {name}: {e}"))
                };
                // The memory too: a copy that mapped the snapshot's own file would lose it
                // (or, on NFS, fault on it) once the image is deleted.
                // And the device state, read once below: a deletion from now on changes
                // nothing for this copy.
                Ok::<_, String>((
                    disk(snapshot::IMAGE_DISK)?,
                    disk(snapshot::MEMORY)?,
                    disk(snapshot::AGENT_DISK)?,
                    disk(snapshot::STATE)?,
                ))
            })
            .await
            .map_err(|e| create_err(id, e))?;
            match held {
                Ok(v) => v,
                Err(m) => {
                    return Err(self
                        .snapshot_gone(req, &from)
                        .await
                        .unwrap_or(create_err(id, m)))
                }
            }
        };
        let (image_disk, ram, agent_disk, state) = held;
        let mut st = VmState {
            layers: meta.layers.clone(),
            image_disk,
            ram,
            agent_disk,
            snapshot: from.clone(),
            init_user: meta.init_user.clone(),
            machine: self.machine.clone(),
            net_slot: net.map(|n| n.0),
            ..Default::default()
        };
        let (pid, start_time, ch) = self
            .start_restored(id, &req.spec, &st, &state, |m| create_err(id, m))
            .await?;
        // Read once, by the restore; a snapshot of a copy holds the whole RAM in it.
        if let Err(e) = tokio::fs::remove_file(&state).await {
            tracing::debug!(sandbox_id = %id, error = %e, "removing the restored device state");
        }
        post_restore(&ch, id, true)
            .await
            .map_err(|m| create_err(id, m))?;
        self.channels().insert(id.clone(), ch);
        st.pid = pid;
        st.start_time = start_time;
        Ok(st)
    }

    /// Why a restore from `from` failed when the snapshot went away under it, None when it
    /// is still whole: a copy of an image deleted meanwhile gets `not_found` for the image,
    /// and `unavailable` if the name was overwritten by another snapshot (a retry restores
    /// that); a fork's copy whose snapshot an image gc with a short grace took gets
    /// `not_found` (final: every node would find it gone).
    async fn snapshot_gone(&self, req: &CreateRequest, from: &Path) -> Option<BackendError> {
        let f = from.to_path_buf();
        let whole = tokio::task::spawn_blocking(move || snapshot::check_files(&f).is_ok())
            .await
            .unwrap_or(true);
        if whole {
            return None;
        }
        if req.snapshot.is_some() {
            return Some(BackendError::SnapshotGone {
                dir: from.display().to_string(),
                hint: " (an image gc with a grace shorter than the fork?)",
            });
        }
        // The manifest alone says what became of the image: resolving it again could copy
        // a new image's layers just to name an error.
        let (store, image) = (self.images.store()?, req.spec.image.clone());
        let name = crate::images::name::ImageRef::parse(&image).ok()?;
        let now = tokio::task::spawn_blocking(move || store.read_manifest(&name))
            .await
            .ok()?;
        match now {
            Err(crate::images::store::StoreError::NotFound(_)) => {
                Some(BackendError::ImageNotFound { image })
            }
            // Overwritten meanwhile: the name stands for another snapshot, which a retry
            // restores.
            Ok(m) if !m.vm_snapshot.is_empty() && !from.ends_with(&m.vm_snapshot) => {
                Some(BackendError::ImageUnavailable {
                    image,
                    message: "it was overwritten while this copy was being made; try again".into(),
                })
            }
            _ => None,
        }
    }

    /// Makes a new VM's directory, writable disk (from `disk`) and config disk, and its
    /// cgroup; and its own RAM file, unless its disk is a snapshot's (a copy maps the
    /// snapshot's memory).
    async fn make_files(
        &self,
        id: &str,
        spec: &crate::pb::SandboxSpec,
        cfg: VmConfig,
        disk: NewDisk,
    ) -> Result<(), BackendError> {
        let (disks, sid, d) = (self.disks.clone(), id.to_string(), self.sandbox_dir(id));
        tokio::task::spawn_blocking(move || -> Result<(), String> {
            use std::os::unix::fs::OpenOptionsExt;
            make_sandbox_dir(&d)?;
            let made = match &disk {
                NewDisk::Empty(mb) => {
                    // QEMU opens the RAM file it is given as it is; made here, it is 0600
                    // whatever QEMU's umask would give.
                    std::fs::OpenOptions::new()
                        .write(true)
                        .create(true)
                        .truncate(true)
                        .mode(0o600)
                        .open(d.join("ram"))
                        .map_err(|e| format!("creating the RAM file: {e}"))?;
                    disks.create(&sid, *mb)
                }
                NewDisk::CopyOf(from) => disks.create_from(&sid, from),
            };
            made.map_err(|e| crate::types::chain(&e).to_string())?;
            disks::config_disk(&d.join("config.img"), &cfg)
                .map_err(|e| crate::types::chain(&e).to_string())
        })
        .await
        .map_err(|e| create_err(id, e))?
        .map_err(|m| create_err(id, m))?;
        self.cgroups
            .create(id, &self.limits(spec))
            .map(|_| ())
            .map_err(|e| create_err(id, e))
    }

    /// The sandbox cgroup's limits: the guest's memory with QEMU's overhead on top (what
    /// admission charges), the CPU quota, QEMU's threads.
    fn limits(&self, spec: &crate::pb::SandboxSpec) -> Limits {
        Limits {
            cpu_cores: spec.cpu_cores_limit,
            idle: false,
            memory_mb: self.memory_charge_mb(spec),
            pids_max: QEMU_PIDS_MAX,
            disk_io: None,
        }
    }

    async fn create_vm(
        &self,
        req: &CreateRequest,
        net: Option<&(u32, crate::netpol::Policy)>,
    ) -> Result<VmState, BackendError> {
        let id = &req.sandbox_id;
        let image = self.images.resolve(id, &req.spec.image).await?;
        if let Some(from) = &image.vm_snapshot {
            // An image made by create_snapshot(memory=True): a copy of that VM.
            return self.restore_vm(req, from, net).await;
        }
        let init_user = [req.spec.init_user.as_str(), image.user.as_str()]
            .into_iter()
            .find(|u| !u.is_empty())
            .unwrap_or("root")
            .to_string();
        // As for containers: a user the image does not know would boot a VM in which every
        // command fails.
        crate::backends::container::check_user(&image.lowers, &init_user, &req.spec.image)
            .map_err(|message| BackendError::Invalid {
                sandbox_id: id.clone(),
                message,
            })?;
        let layers: Vec<String> = image.layers.iter().map(|d| d.hex().to_string()).collect();
        self.images.mark_in_use(id, &image.layers).await?;
        let image_disk = self
            .image_disk(&req.spec.image, &layers, &image.lowers)
            .await?;
        let cfg = VmConfig {
            sandbox_id: id.clone(),
            hostname: hostname_of(id),
            env: image.env,
            workdir: image.workdir,
            init_user: init_user.clone(),
            disk_mb: req.spec.disk_mb.max(1) as u64,
            pids_max: self.pids_max,
            // The node's end of its tap answers DNS (docs/microvm.md "Network").
            nameservers: net
                .map(|_| vec![crate::netpol::vmns::GATEWAY.to_string()])
                .unwrap_or_default(),
            net: net.map(|_| guest_net()),
        };
        let disk_mb = req.spec.disk_mb.max(1) as u64;
        self.make_files(id, &req.spec, cfg, NewDisk::Empty(disk_mb))
            .await?;
        if let Some((slot, policy)) = net {
            self.connect(id, *slot, policy).await?;
        }
        let mut st = VmState {
            net_slot: net.map(|n| n.0),
            layers,
            image_disk,
            // The build the guest mounts: a snapshot or resume after an upgrade of the
            // node must give it this one, not the node's newer one.
            agent_disk: self.agent_disk.clone(),
            init_user,
            machine: self.machine.clone(),
            ..Default::default()
        };
        let machine = self.machine(id, &req.spec, &st, false);
        let (pid, console) = self.start_qemu(id, &machine, st.net_slot.is_some()).await?;
        let start_time = crate::backends::container::start_time(pid)
            .ok()
            .flatten()
            .unwrap_or_default();
        let limit = match self.accel {
            Accel::Kvm => BOOT_TIMEOUT_KVM,
            Accel::Tcg { .. } => BOOT_TIMEOUT_TCG,
        };
        let ch = self
            .wait_for_agent(id, pid, start_time, limit, console.as_ref())
            .await?;
        // From here QEMU drops what the guest writes to its console.
        drop(console);
        self.channels().insert(id.clone(), ch);
        st.pid = pid;
        st.start_time = start_time;
        Ok(st)
    }
}

/// The guest's interface, the same in every VM (docs/microvm.md "Network").
fn guest_net() -> crate::guest::vminit::GuestNet {
    use crate::netpol::vmns;
    crate::guest::vminit::GuestNet {
        mac: vmns::GUEST_MAC.into(),
        address: vmns::GUEST,
        prefix: vmns::PREFIX,
        gateway: vmns::GATEWAY,
        mtu: vmns::MTU,
    }
}

/// How long a migration to or from a state file may take: the stream holds the devices and
/// CPU state (tens of KB; a shared RAM file is left out), or a copy's whole RAM (its
/// mapping is private), about 1 GiB/s here.
const MIGRATE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a VM stopped for a migration has to run again.
const CONTINUE_TIMEOUT: Duration = Duration::from_secs(10);
/// The migration bandwidth (bytes/s): unbounded in effect, the stream goes to a local file.
const MIGRATE_BANDWIDTH: u64 = 64 << 30;
/// How long a restored guest has to take its new identity.
const POST_RESTORE_TIMEOUT: Duration = Duration::from_secs(10);

/// Tells a restored VM's aether who it is now, with fresh randomness and the clock
/// (docs/microvm.md "Snapshots and copies"). Errors: the call's status, as text.
/// `copy`: a new sandbox from a snapshot takes the identity of `id`; a resumed one keeps
/// its own (and a hostname its user set).
async fn post_restore(ch: &Channel, id: &str, copy: bool) -> Result<(), String> {
    let mut c = crate::pb::guest_client::GuestClient::new(ch.clone());
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
        .unwrap_or_default();
    let req = crate::pb::PostRestoreRequest {
        sandbox_id: if copy { id.to_string() } else { String::new() },
        hostname: if copy { hostname_of(id) } else { String::new() },
        seed: rand::random::<[u8; 64]>().to_vec(),
        unix_time_ns: now,
    };
    match tokio::time::timeout(POST_RESTORE_TIMEOUT, c.post_restore(req)).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(s)) => Err(format!("PostRestore: {}", s.message())),
        Err(_) => Err(format!(
            "PostRestore: no answer within {POST_RESTORE_TIMEOUT:?}"
        )),
    }
}

/// How long QEMU has to exit after `quit` before it is killed.
const QUIT_TIMEOUT: Duration = Duration::from_secs(10);
/// The migration stream of a paused VM, in its directory.
const STATE_FILE: &str = "state.mig";
/// Written (and synced) once the stream and the RAM file are complete: a paused VM whose
/// edge died mid-pause is paused only if this is there.
const PAUSED_MARK: &str = "paused";

/// Where a new VM's writable disk comes from.
enum NewDisk {
    /// An empty disk of this many MiB.
    Empty(u64),
    /// A copy of a snapshot's disk.
    CopyOf(PathBuf),
}

/// The VM's vCPUs: its CPU limit rounded up.
fn vcpus_of(spec: &crate::pb::SandboxSpec) -> u32 {
    spec.cpu_cores_limit.ceil().max(1.0) as u32
}

/// Makes the sandbox's directory, 0700: it holds the guest's RAM and migration stream,
/// its memory.
fn make_sandbox_dir(d: &Path) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(d)
        .map_err(|e| format!("creating {}: {e}", d.display()))?;
    std::fs::set_permissions(d, std::os::unix::fs::PermissionsExt::from_mode(0o700))
        .map_err(|e| format!("chmod {}: {e}", d.display()))
}

fn op_err(op: &'static str, id: &str, message: impl std::fmt::Display) -> BackendError {
    BackendError::Operation {
        op,
        sandbox_id: id.to_string(),
        message: message.to_string(),
    }
}

/// Polls `query-migrate` until the migration completes. Errors: its failure, or a timeout.
async fn migration_done(q: &mut Qmp) -> Result<(), String> {
    let started = Instant::now();
    loop {
        let v = q
            .execute("query-migrate", None)
            .await
            .map_err(|e| e.to_string())?;
        match v.get("status").and_then(serde_json::Value::as_str) {
            Some("completed") => return Ok(()),
            Some(s @ ("failed" | "cancelled")) => {
                let why = v
                    .get("error-desc")
                    .and_then(serde_json::Value::as_str)
                    .unwrap_or_default();
                return Err(format!("migration {s}: {why}"));
            }
            _ => {}
        }
        if started.elapsed() > MIGRATE_TIMEOUT {
            return Err(format!("migration not done within {MIGRATE_TIMEOUT:?}"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Continues a VM stopped for a migration, and checks that it runs. QEMU reports a
/// migration's end before it leaves `finish-migrate`, and refuses `cont` until then.
/// Errors: the status it stayed in, or QMP's error.
async fn continue_vm(q: &mut Qmp) -> Result<(), String> {
    let started = Instant::now();
    loop {
        let status = q.status().await.map_err(|e| e.to_string())?;
        match status.as_str() {
            "running" => return Ok(()),
            "finish-migrate" | "inmigrate" => {}
            _ => {
                if let Err(e) = q.execute("cont", None).await {
                    if started.elapsed() > CONTINUE_TIMEOUT {
                        return Err(format!("the VM stays {status}: {e}"));
                    }
                }
            }
        }
        if started.elapsed() > CONTINUE_TIMEOUT {
            return Err(format!("the VM stays {status}"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Leaves the shared RAM file out of the migration stream (`x-ignore-shared`); both ends
/// of a migration must set it.
async fn ignore_shared_ram(q: &mut Qmp) -> Result<(), String> {
    q.execute(
        "migrate-set-capabilities",
        Some(serde_json::json!({"capabilities": [
            {"capability": "x-ignore-shared", "state": true}
        ]})),
    )
    .await
    .map(|_| ())
    .map_err(|e| e.to_string())
}

/// Drops fd set `set` (QEMU's copy of a migration file), when there is one: the
/// migration's own copy closes when it ends, the set's only with the QMP connection.
async fn forget_set(q: &mut Qmp, set: Option<u64>) {
    if let Some(set) = set {
        let _ = q
            .execute("remove-fd", Some(serde_json::json!({ "fdset-id": set })))
            .await;
    }
}

/// Waits until QEMU `pid` has exited; kills it after [`QUIT_TIMEOUT`].
async fn wait_gone(pid: u32, start_time: u64) {
    let started = Instant::now();
    while qemu_alive(pid, start_time) {
        if started.elapsed() > QUIT_TIMEOUT {
            if let Ok(p) = i32::try_from(pid) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(p),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Writes the RAM file's dirty pages to disk and drops them from the page cache, so the
/// paused VM's memory is the node's again (it was charged to the sandbox's cgroup).
fn release_ram(path: &Path) -> std::io::Result<()> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    f.sync_all()?;
    nix::fcntl::posix_fadvise(
        &f,
        0,
        0,
        nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED,
    )
    .map_err(std::io::Error::from)
}

/// The last line QEMU wrote, if any.
/// The last 4 KiB of QEMU's log `path` (a QEMU its guest took over could have written
/// without end), lossily as text; empty when unreadable.
fn log_tail(path: &Path) -> String {
    use std::io::{Read, Seek, SeekFrom};
    let Ok(mut f) = std::fs::File::open(path) else {
        return String::new();
    };
    let len = f.metadata().map(|m| m.len()).unwrap_or(0);
    let _ = f.seek(SeekFrom::Start(len.saturating_sub(4096)));
    let mut buf = Vec::with_capacity(4096);
    let _ = f.take(4096).read_to_end(&mut buf);
    String::from_utf8_lossy(&buf).into_owned()
}

fn tail(log: &str) -> Option<&str> {
    log.lines().rev().map(str::trim).find(|l| !l.is_empty())
}

/// Whether QEMU still runs. /proc that cannot be read counts as running: a VM is declared
/// lost only on evidence.
fn qemu_alive(pid: u32, start_time: u64) -> bool {
    pid > 0
        && crate::backends::container::judged_alive(
            pid,
            crate::backends::container::start_time(pid),
            start_time,
        )
}

/// The node's initramfs for `kernel` and the agent binary `agent`: `initrd-<digest>` in
/// `dir`, made once per pair (the kernel's modules go in).
fn node_initrd(agent: &Path, kernel: &Path, dir: &Path) -> Result<PathBuf, String> {
    let mut h = sha2::Sha256::new();
    h.update(agent.as_os_str().as_encoded_bytes());
    h.update(b"\0");
    h.update(kernel.as_os_str().as_encoded_bytes());
    let modules = initramfs::modules_of(kernel);
    if let Some(m) = &modules {
        h.update(b"\0");
        h.update(m.as_os_str().as_encoded_bytes());
    }
    let hex = hex::encode(h.finalize());
    let out = dir.join(format!("initrd-{}", hex.get(..16).unwrap_or(&hex)));
    if out.is_file() {
        return Ok(out);
    }
    initramfs::build(agent, modules.as_deref(), &out)
        .map_err(|e| format!("building the initramfs: {}", crate::types::chain(&e)))?;
    Ok(out)
}

#[async_trait]
impl Backend for MicrovmBackend {
    fn name(&self) -> &str {
        &self.name
    }

    fn runtime_kind(&self) -> &'static str {
        "qemu"
    }

    fn check_spec(&self, spec: &crate::pb::SandboxSpec) -> Result<(), BackendError> {
        if spec.memory_limit_mb < MIN_MEMORY_MB {
            return Err(BackendError::Config {
                backend: self.name.clone(),
                message: format!(
                    "memory_limit_mb {} is below the least a microVM boots with ({MIN_MEMORY_MB})",
                    spec.memory_limit_mb
                ),
            });
        }
        if spec.cpu_cores_limit < MIN_CPU_CORES {
            return Err(BackendError::Config {
                backend: self.name.clone(),
                message: format!(
                    "cpu_cores_limit {} is below the least a microVM boots with ({MIN_CPU_CORES})",
                    spec.cpu_cores_limit
                ),
            });
        }
        let host_root = self.images.local(&spec.image).is_some_and(|lowers| {
            lowers
                .iter()
                .any(|l| l.canonicalize().is_ok_and(|c| c == Path::new("/")))
        });
        if host_root {
            return Err(BackendError::Config {
                backend: self.name.clone(),
                message: format!(
                    "image {:?} is the host's own / (the development image), which cannot \
                     become a VM's disk; use an image from the image store",
                    spec.image
                ),
            });
        }
        Ok(())
    }

    async fn update_network(&self, sandbox: &Handle<'_>) -> Result<(), BackendError> {
        let slot = Self::state_of(sandbox).net_slot;
        netslot::update(self.network.as_deref(), sandbox, slot).await
    }

    async fn create(&self, req: &CreateRequest) -> Result<BackendState, BackendError> {
        let id = &req.sandbox_id;
        if req.fork.is_some() {
            return Err(BackendError::Unsupported {
                backend: self.name.clone(),
                op: "fork",
            });
        }
        let span = tracing::info_span!("microvm_create", sandbox_id = %id);
        // The policy and a slot first: a bad rule changes nothing.
        let net = netslot::reserve(self.network.as_deref(), &self.name, id, &req.spec)?;
        let made = async {
            match &req.snapshot {
                Some(from) => self.restore_vm(req, from, net.as_ref()).await,
                None => self.create_vm(req, net.as_ref()).await,
            }
        };
        match tracing::Instrument::instrument(made, span).await {
            Ok(st) => serde_json::to_value(&st).map_err(|e| create_err(id, e)),
            Err(e) => {
                if let Err(d) = self.destroy(id).await {
                    tracing::warn!(sandbox_id = %id, error = %d, "cleaning up a failed creation");
                }
                if let Some(m) = netslot::release(self.network.as_ref(), net.map(|n| n.0)).await {
                    tracing::warn!(sandbox_id = %id, error = %m, "cleaning up a failed creation");
                }
                Err(e)
            }
        }
    }

    async fn stop(&self, sandbox: &Handle<'_>) -> Result<(), BackendError> {
        let destroyed = self.destroy(sandbox.sandbox_id).await;
        let slot = Self::state_of(sandbox).net_slot;
        let net_failed = netslot::release(self.network.as_ref(), slot).await;
        match (destroyed, net_failed) {
            (Err(e), _) => Err(e),
            (Ok(()), Some(message)) => Err(BackendError::Operation {
                op: "stop",
                sandbox_id: sandbox.sandbox_id.to_string(),
                message,
            }),
            (Ok(()), None) => Ok(()),
        }
    }

    async fn pause(&self, sandbox: &Handle<'_>) -> Result<BackendState, BackendError> {
        let span = tracing::info_span!("microvm_pause", sandbox_id = %sandbox.sandbox_id);
        let st = tracing::Instrument::instrument(self.pause_vm(sandbox), span).await?;
        serde_json::to_value(&st).map_err(|e| op_err("pause", sandbox.sandbox_id, e))
    }

    async fn resume(&self, sandbox: &Handle<'_>) -> Result<BackendState, BackendError> {
        let span = tracing::info_span!("microvm_resume", sandbox_id = %sandbox.sandbox_id);
        let st = tracing::Instrument::instrument(self.resume_vm(sandbox), span).await?;
        serde_json::to_value(&st).map_err(|e| op_err("resume", sandbox.sandbox_id, e))
    }

    fn pause_frees_memory(&self) -> bool {
        true
    }

    fn memory_charge(&self) -> crate::pb::MemoryCharge {
        crate::pb::MemoryCharge {
            floor_mb: MIN_MEMORY_MB,
            overhead_mb: self.overhead_mb,
        }
    }

    async fn probe(&self, sandbox: &Handle<'_>) -> Health {
        let st = Self::state_of(sandbox);
        if st.paused || qemu_alive(st.pid, st.start_time) {
            Health::Alive
        } else {
            Health::Lost("the VM's QEMU exited".into())
        }
    }

    async fn adopt(
        &self,
        sandbox: &Handle<'_>,
        _recorded: Recorded,
    ) -> Result<Adopted, BackendError> {
        let id = sandbox.sandbox_id;
        let mut st = Self::state_of(sandbox);
        let lost = |message: &str| BackendError::Lost {
            sandbox_id: id.to_string(),
            message: message.to_string(),
        };
        let dir = self.sandbox_dir(id);
        let paused_here = dir.join(PAUSED_MARK).is_file() && dir.join(STATE_FILE).is_file();
        if qemu_alive(st.pid, st.start_time) {
            // A pause the edge died in before QEMU quit: the VM may be stopped; it goes on.
            if let Ok(mut q) = Qmp::connect(&self.qmp_socket(id)).await {
                if matches!(q.status().await.as_deref(), Ok("paused" | "postmigrate")) {
                    let _ = q.execute("cont", None).await;
                }
            }
            let _ = std::fs::remove_file(dir.join(STATE_FILE));
            st.paused = false;
        } else if paused_here {
            // Paused, whether or not the edge lived to record it.
            st.pid = 0;
            st.start_time = 0;
            st.paused = true;
        } else {
            return Err(lost("the VM's QEMU is gone"));
        }
        if let Some(slot) = st.net_slot {
            let pinned = self.netns_path(id);
            if crate::sys::netns::open_pinned(&pinned).is_err() {
                return Err(lost("its network namespace is gone"));
            }
            netslot::adopt(self.network.as_deref(), sandbox, slot).await?;
        }
        self.images.hold(id, &st.layers);
        Ok(Adopted {
            state: serde_json::to_value(&st).map_err(|e| BackendError::Adopt {
                sandbox_id: id.to_string(),
                message: e.to_string(),
            })?,
            paused: st.paused,
        })
    }

    async fn cleanup(&self, keep: &HashSet<String>) -> Result<CleanupReport, BackendError> {
        let ids = crate::backends::container::stray_ids(&self.disks, &self.dir, keep);
        let mut report = CleanupReport::default();
        report
            .removed
            .extend(self.images.release_strays(keep).await);
        let mut failed = Vec::new();
        for id in ids {
            match self.destroy(&id).await {
                Ok(()) => report.removed.push(format!("microvm {id}")),
                Err(e) => failed.push(format!("{id}: {e}")),
            }
        }
        if failed.is_empty() {
            Ok(report)
        } else {
            Err(BackendError::Operation {
                op: "cleanup",
                sandbox_id: String::new(),
                message: failed.join("; "),
            })
        }
    }

    fn runtime(&self) -> Option<&dyn Runtime> {
        Some(self)
    }

    fn snapshotter(&self) -> Option<&dyn Snapshotter> {
        Some(self)
    }
}

#[async_trait]
impl Snapshotter for MicrovmBackend {
    /// A snapshot with memory into `target.dir`, which must not exist (see
    /// [`snapshot`]). Errors: `Invalid` without `memory` (a VM's files alone are no state
    /// it can go on from), `Lost`, `Operation`.
    async fn snapshot(
        &self,
        sandbox: &Handle<'_>,
        target: &SnapshotTarget,
    ) -> Result<(BackendState, SnapshotInfo), BackendError> {
        if !target.memory {
            return Err(BackendError::Invalid {
                sandbox_id: sandbox.sandbox_id.to_string(),
                message: "a microVM's snapshot keeps its memory (memory=True)".into(),
            });
        }
        let span = tracing::info_span!("microvm_snapshot", sandbox_id = %sandbox.sandbox_id);
        let meta =
            tracing::Instrument::instrument(self.snapshot_vm(sandbox, &target.dir), span).await?;
        tracing::info!(sandbox_id = %sandbox.sandbox_id, paused_ms = meta.paused_ms, "microVM snapshot taken");
        let names = [
            snapshot::MEMORY,
            snapshot::STATE,
            snapshot::DISK,
            snapshot::IMAGE_DISK,
            snapshot::AGENT_DISK,
            snapshot::META,
        ];
        let bytes = names
            .iter()
            .filter_map(|n| std::fs::metadata(target.dir.join(n)).ok())
            .filter(|m| std::os::unix::fs::MetadataExt::nlink(m) == 1)
            .map(|m| std::os::unix::fs::MetadataExt::blocks(&m) * 512)
            .sum();
        Ok((
            sandbox.state.clone(),
            SnapshotInfo {
                files: names.iter().map(|n| n.to_string()).collect(),
                bytes,
                versions: BTreeMap::from([("qemu".to_string(), meta.machine.clone())]),
                paused_ms: meta.paused_ms,
            },
        ))
    }
}

#[async_trait]
impl Runtime for MicrovmBackend {
    async fn channel(&self, sandbox: &Handle<'_>) -> Result<Channel, BackendError> {
        let id = sandbox.sandbox_id;
        if let Some(ch) = self.channels().get(id) {
            return Ok(ch.clone());
        }
        let ch = agent_channel(&self.agent_socket(id))
            .await
            .map_err(|e| BackendError::Lost {
                sandbox_id: id.to_string(),
                message: format!("the VM's agent port: {e}"),
            })?;
        self.channels().insert(id.to_string(), ch.clone());
        Ok(ch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_guest_of_exactly_2048_mib_gets_one_more() {
        assert_eq!(guest_ram_mb(2048), 2049);
        assert_eq!(guest_ram_mb(2047), 2047);
        assert_eq!(guest_ram_mb(4096), 4096);
        assert_eq!(guest_ram_mb(16), MIN_MEMORY_MB as u64);
    }

    #[test]
    fn the_qemu_version_is_read_from_the_machine_line() {
        let m = "QEMU emulator version 7.2.22 (Debian 1:7.2+dfsg-7+deb12u18); tcg";
        assert!(qemu_at_least(m, 7, 2));
        assert!(!qemu_at_least(m, 8, 2));
        assert!(qemu_at_least("QEMU emulator version 8.2.0; kvm", 8, 2));
        assert!(qemu_at_least("QEMU emulator version 10.0.1", 8, 2));
        assert!(!qemu_at_least("", 1, 0));
    }
}
