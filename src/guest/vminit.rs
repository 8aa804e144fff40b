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
    Ok(Booted { config, port })
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
