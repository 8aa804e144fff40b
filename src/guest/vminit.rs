//! aether as a microVM's PID 1 (`opendsec aether --vm-init`, docs/microvm.md "In the
//! guest"): it starts from the initramfs the edge built, mounts the kernel's file systems,
//! loads the modules the initramfs lists (a modular kernel sees no disk and no agent port
//! before), reads the VM's config disk, and finds the agent's virtio-serial port, which it
//! then serves the runtime API on (see `portmux`).
//!
//! Disks are found by the serial number the edge gives each (`/sys/block/vd*/serial`), not
//! by their order, which the guest kernel does not promise.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use nix::mount::{mount, MsFlags};
use serde::{Deserialize, Serialize};

/// The agent port's name (the VMM's side names it the same).
pub const AGENT_PORT: &str = "org.opendsec.agent";
/// The serial number of the config disk.
pub const CONFIG_SERIAL: &str = "odsec-config";
/// The serial numbers of the read-only agent disk (the binary, as [`AGENT_FILE`]), the
/// read-only image disk and the sandbox's writable disk.
pub const AGENT_SERIAL: &str = "odsec-agent";
pub const IMAGE_SERIAL: &str = "odsec-image";
pub const RW_SERIAL: &str = "odsec-rw";
/// Where the agent disk is mounted in the sandbox's root (where a container has its agent
/// too), and the binary's name on it.
pub use crate::guest::config::{AGENT_DIR, AGENT_FILE, AGENT_PATH};
/// Where the first stage leaves the second its config, in the sandbox's `/run`.
pub const HANDOFF: &str = "/run/opendsec/vm.json";
/// Where the sandbox's root is assembled before it becomes `/`.
const NEW_ROOT: &str = "/mnt/root";
/// The config disk's first bytes; the JSON follows, then zeros.
pub const CONFIG_MAGIC: &[u8] = b"OPENDSEC-VM-CONFIG\n";
/// The most a config disk is read.
const MAX_CONFIG: usize = 1 << 20;
/// How long devices may take to appear after their modules loaded.
const DEVICE_WAIT: Duration = Duration::from_secs(20);

/// What the edge tells a VM at boot, on its config disk.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct VmConfig {
    pub sandbox_id: String,
    pub hostname: String,
    /// The image's environment.
    pub env: std::collections::BTreeMap<String, String>,
    pub workdir: String,
    pub init_user: String,
    pub disk_mb: u64,
    /// The sandbox's `pids_max`, the guest's `workload/` cgroup's (0: none;
    /// docs/microvm.md "Cgroups in the guest").
    pub pids_max: i64,
    /// The resolvers written to `/etc/resolv.conf`; none: the image's file stays.
    pub nameservers: Vec<String>,
    /// The guest's network interface, when the VM has one.
    pub net: Option<GuestNet>,
}

/// The guest's network interface (docs/microvm.md "Network"): the same in every VM, so
/// that copies of a snapshot need no change.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GuestNet {
    /// The NIC's MAC address, how the guest finds it (`02:fc:00:00:00:02`).
    pub mac: String,
    /// Its IPv4 address and prefix length.
    pub address: std::net::Ipv4Addr,
    pub prefix: u8,
    /// The default route's gateway.
    pub gateway: std::net::Ipv4Addr,
    pub mtu: u32,
}

/// What the first stage (from the initramfs) hands the second (from the agent disk, in
/// the sandbox's root).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Handoff {
    pub config: VmConfig,
    pub port: PathBuf,
}

/// Why the VM could not be brought up.
#[derive(Debug, thiserror::Error)]
pub enum VmInitError {
    #[error("mounting {what}")]
    Mount { what: String, source: nix::Error },
    #[error("loading module {name}")]
    Module {
        name: String,
        source: std::io::Error,
    },
    #[error("no virtio-serial port named {AGENT_PORT} appeared in {0:?}")]
    NoPort(Duration),
    #[error("config disk: {0}")]
    Config(String),
    /// The network interface the config names did not come up.
    #[error("network interface {what}: {message}")]
    Net { what: String, message: String },
    #[error("no disk with serial {serial} appeared in {limit:?}")]
    NoDisk { serial: String, limit: Duration },
    /// A step of assembling or entering the sandbox's root.
    #[error("{what}: {source}")]
    Root {
        what: String,
        source: std::io::Error,
    },
}

fn root_err(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> VmInitError {
    let what = what.into();
    move |source| VmInitError::Root { what, source }
}

fn nix_root_err(what: impl Into<String>) -> impl FnOnce(nix::Error) -> VmInitError {
    let what = what.into();
    move |e| VmInitError::Root {
        what,
        source: e.into(),
    }
}

/// The VM, brought up: its config and the agent port's device.
#[derive(Debug)]
pub struct Booted {
    pub config: VmConfig,
    pub port: PathBuf,
}

fn mount_fs(fstype: &str, target: &str, flags: MsFlags) -> Result<(), VmInitError> {
    let _ = std::fs::create_dir_all(target);
    mount(Some(fstype), target, Some(fstype), flags, None::<&str>).map_err(|source| {
        VmInitError::Mount {
            what: format!("{fstype} on {target}"),
            source,
        }
    })
}

/// Mounts `/dev`, `/proc`, `/sys` and a `/run` tmpfs, loads the initramfs's modules,
/// reads the config disk and finds the agent port. Errors: what could not be done; the
/// caller (PID 1) reports it on the console and powers off.
pub fn boot() -> Result<Booted, VmInitError> {
    let nosuid = MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC | MsFlags::MS_NODEV;
    mount_fs("devtmpfs", "/dev", MsFlags::MS_NOSUID | MsFlags::MS_NOEXEC)?;
    mount_fs("proc", "/proc", nosuid)?;
    mount_fs("sysfs", "/sys", nosuid)?;
    mount_fs("tmpfs", "/run", MsFlags::MS_NOSUID | MsFlags::MS_NODEV)?;
    load_modules(Path::new("/modules"))?;
    let port = wait_for(DEVICE_WAIT, find_port).ok_or(VmInitError::NoPort(DEVICE_WAIT))?;
    // The edge always gives one: a VM without it would come up as no sandbox in particular.
    let config_dev = wait_for(DEVICE_WAIT, || find_disk(CONFIG_SERIAL)).ok_or_else(|| {
        VmInitError::Config(format!(
            "no disk with serial {CONFIG_SERIAL} in {DEVICE_WAIT:?}"
        ))
    })?;
    let config = read_config(&config_dev)?;
    if !config.hostname.is_empty() {
        let _ = nix::unistd::sethostname(&config.hostname);
    }
    // The guest's loopback, as a container's: servers in the sandbox answer on 127.0.0.1.
    if let Err(e) = crate::sys::net::set_up("lo") {
        tracing::warn!(error = %e, "cannot bring up the guest's lo");
    }
    if let Some(net) = &config.net {
        configure_net(net)?;
    }
    Ok(Booted { config, port })
}

/// Brings up the interface of `net`, found by its MAC address (waiting for it as for the
/// disks): IPv6 off, its address, MTU and the default route (docs/microvm.md "Network").
/// Errors: `Net`, naming the step.
pub fn configure_net(net: &GuestNet) -> Result<(), VmInitError> {
    let err = |what: &str, message: String| VmInitError::Net {
        what: what.to_string(),
        message,
    };
    let mac = net.mac.to_ascii_lowercase();
    let name = wait_for(DEVICE_WAIT, || interface_with_mac(&mac))
        .ok_or_else(|| err(&mac, format!("did not appear in {DEVICE_WAIT:?}")))?;
    let ipv6 = format!("/proc/sys/net/ipv6/conf/{name}/disable_ipv6");
    if Path::new(&ipv6).exists() {
        std::fs::write(&ipv6, "1").map_err(|e| err(&name, format!("{ipv6}: {e}")))?;
    }
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_io()
        .build()
        .map_err(|e| err(&name, format!("a runtime for netlink: {e}")))?;
    rt.block_on(async {
        use futures::TryStreamExt;
        let nl = |step: &str| {
            let (name, step) = (name.clone(), step.to_string());
            move |e: rtnetlink::Error| err(&name, format!("{step}: {e}"))
        };
        let (conn, handle, _) =
            rtnetlink::new_connection().map_err(|e| err(&name, format!("netlink: {e}")))?;
        let task = tokio::spawn(conn);
        let index = handle
            .link()
            .get()
            .match_name(name.clone())
            .execute()
            .try_next()
            .await
            .map_err(nl("finding it"))?
            .map(|m| m.header.index)
            .ok_or_else(|| err(&name, "gone".into()))?;
        handle
            .address()
            .add(index, std::net::IpAddr::V4(net.address), net.prefix)
            .execute()
            .await
            .map_err(nl("its address"))?;
        handle
            .link()
            .set(
                rtnetlink::LinkUnspec::new_with_index(index)
                    .mtu(net.mtu)
                    .up()
                    .build(),
            )
            .execute()
            .await
            .map_err(nl("bringing it up"))?;
        let route = rtnetlink::RouteMessageBuilder::<std::net::Ipv4Addr>::new()
            .gateway(net.gateway)
            .output_interface(index)
            .build();
        handle
            .route()
            .add(route)
            .execute()
            .await
            .map_err(nl("the default route"))?;
        task.abort();
        Ok(())
    })
}

/// The name of the interface whose MAC address is `mac` (lower case), if there is one.
fn interface_with_mac(mac: &str) -> Option<String> {
    std::fs::read_dir("/sys/class/net")
        .ok()?
        .flatten()
        .find_map(|e| {
            let addr = std::fs::read_to_string(e.path().join("address")).ok()?;
            (addr.trim() == mac).then(|| e.file_name().to_string_lossy().into_owned())
        })
}

/// The device of the disk with `serial`, waiting for it as for the port.
fn wait_disk(serial: &str) -> Result<PathBuf, VmInitError> {
    wait_for(DEVICE_WAIT, || find_disk(serial)).ok_or_else(|| VmInitError::NoDisk {
        serial: serial.to_string(),
        limit: DEVICE_WAIT,
    })
}

/// Mounts the read-only file system on `dev` (EROFS or ext4, whichever it is) at `target`.
fn mount_ro(dev: &Path, target: &str, flags: MsFlags) -> Result<(), VmInitError> {
    std::fs::create_dir_all(target).map_err(root_err(format!("mkdir {target}")))?;
    let mut last = nix::Error::EINVAL;
    for fstype in ["erofs", "ext4"] {
        // noload: a read-only ext4 disk's journal is never replayed.
        let data = (fstype == "ext4").then_some("noload");
        match mount(
            Some(dev),
            target,
            Some(fstype),
            flags | MsFlags::MS_RDONLY,
            data,
        ) {
            Ok(()) => return Ok(()),
            Err(e) => last = e,
        }
    }
    Err(nix_root_err(format!(
        "mounting {} on {target}",
        dev.display()
    ))(last))
}

/// Assembles the sandbox's root from its disks and makes it `/` (what `switch_root` does):
/// the image disk read-only under an overlay whose upper layer is on the writable disk,
/// the kernel's file systems and `/run` moved into it, the agent disk read-only at
/// [`AGENT_DIR`]; the initramfs's files are deleted (their memory is the guest's) and the
/// process chroots into the new root. Returns the agent to exec for the second stage.
/// Errors: a disk that never appeared, a mount or a step that failed.
pub fn enter_sandbox_root() -> Result<PathBuf, VmInitError> {
    let image = wait_disk(IMAGE_SERIAL)?;
    let rw = wait_disk(RW_SERIAL)?;
    let agent = wait_disk(AGENT_SERIAL)?;
    mount_ro(&image, "/mnt/image", MsFlags::empty())?;
    // Mounted here while /dev still holds its device, moved into place below.
    mount_ro(&agent, "/mnt/agent", MsFlags::MS_NODEV | MsFlags::MS_NOSUID)?;
    std::fs::create_dir_all("/mnt/rw").map_err(root_err("mkdir /mnt/rw"))?;
    mount(
        Some(&rw),
        "/mnt/rw",
        Some("ext4"),
        MsFlags::MS_NOATIME,
        None::<&str>,
    )
    .map_err(nix_root_err(format!(
        "mounting {} on /mnt/rw",
        rw.display()
    )))?;
    for d in ["/mnt/rw/upper", "/mnt/rw/work", NEW_ROOT] {
        std::fs::create_dir_all(d).map_err(root_err(format!("mkdir {d}")))?;
    }
    mount(
        Some("overlay"),
        NEW_ROOT,
        Some("overlay"),
        MsFlags::empty(),
        Some("lowerdir=/mnt/image,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work"),
    )
    .map_err(nix_root_err("mounting the overlay root"))?;
    for d in ["/dev", "/proc", "/sys", "/run"] {
        let to = format!("{NEW_ROOT}{d}");
        std::fs::create_dir_all(&to).map_err(root_err(format!("mkdir {to}")))?;
        mount(
            Some(d),
            to.as_str(),
            None::<&str>,
            MsFlags::MS_MOVE,
            None::<&str>,
        )
        .map_err(nix_root_err(format!("moving {d}")))?;
    }
    let agent_dir = format!("{NEW_ROOT}{AGENT_DIR}");
    std::fs::create_dir_all(&agent_dir).map_err(root_err(format!("mkdir {agent_dir}")))?;
    mount(
        Some("/mnt/agent"),
        agent_dir.as_str(),
        None::<&str>,
        MsFlags::MS_MOVE,
        None::<&str>,
    )
    .map_err(nix_root_err("moving the agent disk"))?;
    let root_dev = nix::sys::stat::stat("/")
        .map_err(nix_root_err("stat /"))?
        .st_dev;
    std::env::set_current_dir(NEW_ROOT).map_err(root_err("chdir to the new root"))?;
    clear_initramfs(Path::new("/"), root_dev);
    mount(Some("."), "/", None::<&str>, MsFlags::MS_MOVE, None::<&str>)
        .map_err(nix_root_err("moving the new root onto /"))?;
    nix::unistd::chroot(".").map_err(nix_root_err("chroot"))?;
    std::env::set_current_dir("/").map_err(root_err("chdir /"))?;
    Ok(PathBuf::from(AGENT_PATH))
}

/// Deletes what the initramfs holds under `dir`: files of the device `dev` only (mount
/// points, such as the new root, belong to other devices and are left). Best effort: what
/// cannot be deleted only costs its memory.
fn clear_initramfs(dir: &Path, dev: u64) {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return;
    };
    for e in rd.flatten() {
        let p = e.path();
        let Ok(st) = nix::sys::stat::lstat(&p) else {
            continue;
        };
        if st.st_dev != dev {
            continue;
        }
        if st.st_mode & nix::libc::S_IFMT == nix::libc::S_IFDIR {
            clear_initramfs(&p, dev);
            let _ = std::fs::remove_dir(&p);
        } else {
            let _ = std::fs::remove_file(&p);
        }
    }
}

/// In the sandbox's root: writes `/etc/machine-id` (from the sandbox id, so a sandbox
/// keeps its own across restarts and each copy of a snapshot gets the id it is given) and,
/// when the config names resolvers, `/etc/resolv.conf`. Symbolic links resolve inside the
/// sandbox's root, as the process is already chrooted. Errors: the file that could not be
/// written.
pub fn write_identity(cfg: &VmConfig) -> Result<(), VmInitError> {
    write_machine_id(&cfg.sandbox_id)?;
    if !cfg.nameservers.is_empty() {
        let text: String = cfg
            .nameservers
            .iter()
            .map(|n| format!("nameserver {n}\n"))
            .collect();
        let _ = std::fs::remove_file("/etc/resolv.conf");
        std::fs::write("/etc/resolv.conf", text).map_err(root_err("/etc/resolv.conf"))?;
    }
    Ok(())
}

/// Writes `/etc/machine-id` for sandbox `sandbox_id`: the first 16 bytes of the id's
/// SHA-256, in hex (a machine-id's 32 hex digits). Errors: the file that could not be
/// written.
pub fn write_machine_id(sandbox_id: &str) -> Result<(), VmInitError> {
    use sha2::Digest;
    let _ = std::fs::create_dir_all("/etc");
    let digest = sha2::Sha256::digest(sandbox_id.as_bytes());
    let id = hex::encode(digest.get(..16).unwrap_or_default());
    // A new file, not a write through what is there: the sandbox's root may have left a
    // link in its place.
    let _ = std::fs::remove_file("/etc/machine-id");
    std::fs::write("/etc/machine-id", format!("{id}\n")).map_err(root_err("/etc/machine-id"))
}

/// Leaves `h` for the second stage at [`HANDOFF`] (0600, in the new root's `/run`).
pub fn hand_off(h: &Handoff) -> Result<(), VmInitError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let json = serde_json::to_vec(h).map_err(|e| VmInitError::Config(e.to_string()))?;
    if let Some(dir) = Path::new(HANDOFF).parent() {
        std::fs::create_dir_all(dir).map_err(root_err(format!("mkdir {}", dir.display())))?;
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(HANDOFF)
        .and_then(|mut f| f.write_all(&json))
        .map_err(root_err(HANDOFF))
}

/// The second stage's start: what the first left at [`HANDOFF`]. Errors: `Config` when
/// it is missing or not a [`Handoff`].
pub fn take_handoff() -> Result<Handoff, VmInitError> {
    let bytes =
        std::fs::read(HANDOFF).map_err(|e| VmInitError::Config(format!("{HANDOFF}: {e}")))?;
    serde_json::from_slice(&bytes).map_err(|e| VmInitError::Config(format!("{HANDOFF}: {e}")))
}

/// Loads the modules named in `dir/order`, in order. A module the kernel already has
/// (built in, or loaded) is fine. Errors: a module that is there and fails to load.
pub fn load_modules(dir: &Path) -> Result<(), VmInitError> {
    let order = std::fs::read_to_string(dir.join("order")).unwrap_or_default();
    // The order file names each module's file (`virtio_blk.ko`, or `.ko.xz`/`.ko.zst`/
    // `.ko.gz` as the kernel's package ships it): the kernel inflates a compressed one itself
    // when asked to (MODULE_INIT_COMPRESSED_FILE, Linux 5.17+ built with module
    // decompression, as distribution kernels that compress their modules are).
    const MODULE_INIT_COMPRESSED_FILE: u32 = 4;
    for file in order.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let name = file.split(".ko").next().unwrap_or(file);
        let path = dir.join(file);
        let Ok(f) = std::fs::File::open(&path) else {
            continue;
        };
        let flags = if file.ends_with(".ko") {
            nix::kmod::ModuleInitFlags::empty()
        } else {
            nix::kmod::ModuleInitFlags::from_bits_retain(MODULE_INIT_COMPRESSED_FILE)
        };
        match nix::kmod::finit_module(&f, c"", flags) {
            Ok(()) | Err(nix::Error::EEXIST) => {}
            Err(e) => {
                return Err(VmInitError::Module {
                    name: name.to_string(),
                    source: e.into(),
                })
            }
        }
    }
    Ok(())
}

fn wait_for<T>(limit: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let start = Instant::now();
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if start.elapsed() > limit {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The device of the port named [`AGENT_PORT`], once it exists.
fn find_port() -> Option<PathBuf> {
    let rd = std::fs::read_dir("/sys/class/virtio-ports").ok()?;
    for e in rd.flatten() {
        let name = std::fs::read_to_string(e.path().join("name")).unwrap_or_default();
        if name.trim() == AGENT_PORT {
            let dev = Path::new("/dev").join(e.file_name());
            if dev.exists() {
                return Some(dev);
            }
        }
    }
    None
}

/// The block device whose serial number is `serial`.
pub fn find_disk(serial: &str) -> Option<PathBuf> {
    let rd = std::fs::read_dir("/sys/block").ok()?;
    for e in rd.flatten() {
        let s = std::fs::read_to_string(e.path().join("serial")).unwrap_or_default();
        if s.trim() == serial {
            return Some(Path::new("/dev").join(e.file_name()));
        }
    }
    None
}

/// Reads a config disk: [`CONFIG_MAGIC`], then the JSON up to the first zero byte.
pub fn read_config(dev: &Path) -> Result<VmConfig, VmInitError> {
    use std::io::Read;
    let mut buf = Vec::new();
    std::fs::File::open(dev)
        .and_then(|f| f.take(MAX_CONFIG as u64).read_to_end(&mut buf))
        .map_err(|e| VmInitError::Config(format!("{}: {e}", dev.display())))?;
    parse_config(&buf)
}

/// The config a config disk's bytes hold. Errors: `Config` without the magic, or for JSON
/// that is not a [`VmConfig`].
pub fn parse_config(bytes: &[u8]) -> Result<VmConfig, VmInitError> {
    let rest = bytes
        .strip_prefix(CONFIG_MAGIC)
        .ok_or_else(|| VmInitError::Config("no config magic".into()))?;
    let end = rest.iter().position(|b| *b == 0).unwrap_or(rest.len());
    serde_json::from_slice(rest.get(..end).unwrap_or_default())
        .map_err(|e| VmInitError::Config(e.to_string()))
}

/// A config disk's bytes for `cfg`, padded to whole 512-byte sectors.
pub fn config_disk(cfg: &VmConfig) -> Vec<u8> {
    let mut b = CONFIG_MAGIC.to_vec();
    b.extend_from_slice(&serde_json::to_vec(cfg).unwrap_or_default());
    let len = b.len().div_ceil(512) * 512;
    b.resize(len.max(512), 0);
    b
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clearing_the_initramfs_deletes_its_device_s_files_only() {
        let dir = tempfile::tempdir().expect("dir");
        let root = dir.path();
        std::fs::create_dir_all(root.join("modules/sub")).expect("mkdir");
        std::fs::write(root.join("init"), b"x").expect("init");
        std::fs::write(root.join("modules/sub/a.ko"), b"x").expect("ko");
        std::os::unix::fs::symlink("/etc/passwd", root.join("link")).expect("link");
        let dev = nix::sys::stat::stat(root).expect("stat").st_dev;
        // Another device's files (a mount point's) are left.
        clear_initramfs(root, dev.wrapping_add(1));
        assert!(root.join("modules/sub/a.ko").exists());
        clear_initramfs(root, dev);
        let left: Vec<_> = std::fs::read_dir(root).expect("list").flatten().collect();
        assert!(left.is_empty(), "{left:?}");
        // The link was removed, not followed.
        assert!(Path::new("/etc/passwd").exists());
    }

    #[test]
    fn a_config_disk_reads_back_as_written_and_others_are_refused() {
        let cfg = VmConfig {
            sandbox_id: "n1.abc".into(),
            hostname: "sbx".into(),
            disk_mb: 64,
            ..Default::default()
        };
        let disk = config_disk(&cfg);
        assert_eq!(disk.len() % 512, 0);
        assert_eq!(parse_config(&disk).expect("parse"), cfg);
        assert!(matches!(
            parse_config(&[0u8; 512]),
            Err(VmInitError::Config(_))
        ));
        let mut bad = CONFIG_MAGIC.to_vec();
        bad.extend_from_slice(b"{\"nope\": 1}");
        assert!(matches!(parse_config(&bad), Err(VmInitError::Config(_))));
    }
}
