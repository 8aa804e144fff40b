//! What the edge hands the container setup process (`opendsec sandbox-init`, on its stdin as
//! JSON) and what the setup process answers (one JSON line on stdout).

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::cgroup::SetupSteps;
use crate::guest::config::AetherConfig;

/// One sandbox's setup, decided by the edge.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SetupSpec {
    pub sandbox_id: String,
    /// The sandbox's host-side directory (`<state_dir>/containers/<id>`): holds `mnt/` (a
    /// mount point used only inside the sandbox's mount namespace) and `aether.sock`.
    pub dir: PathBuf,
    /// The sparse ext4 image holding the writable upper layer.
    pub disk_image: PathBuf,
    /// A disk the edge prepared (docs/architecture.md "Prepared disks"): attached and
    /// mounted already, to be copied from the edge and attached in place of `disk_image`.
    pub prepared_disk: Option<PreparedDiskRef>,
    /// The image's lower directories, topmost first.
    pub lowers: Vec<PathBuf>,
    /// How the setup process joins the sandbox's cgroups: the sandbox's own before
    /// unsharing (so every process of the sandbox starts inside and the cgroup namespace is
    /// rooted there), then `agent/`, keeping `workload/` open for aether.
    pub cgroup: SetupSteps,
    /// What to bind read-only at /sys/fs/cgroup: (host dir, name below /sys/fs/cgroup; ""
    /// for the directory itself on cgroup v2).
    pub cgroup_mounts: Vec<(PathBuf, String)>,
    /// The agent executable to bind read-only at [`AGENT_PATH`].
    pub agent: PathBuf,
    pub hostname: String,
    /// Caller's extra read-only and masked paths (absolute, validated by the edge).
    pub readonly_paths: Vec<String>,
    pub masked_paths: Vec<String>,
    /// Paths of the image the sandbox must not see, hidden through the upper layer (empty
    /// for images; the development image `host` hides the host's secrets and temporary
    /// directories, docs/containers.md "The host image").
    #[serde(default)]
    pub hidden_lower: Vec<String>,
    /// Ask for a core-scheduling cookie.
    pub core_sched: bool,
    /// With sandbox networking, the `/etc/resolv.conf` the sandbox gets (its gateway's DNS
    /// proxy); `None` leaves the image's.
    #[serde(default)]
    pub resolv_conf: Option<String>,
    /// aether's configuration, written to [`AETHER_CONFIG`] inside.
    pub aether: AetherConfig,
}

/// Where a prepared disk's detached mount is: fd `mount_fd` of the edge, process
/// `edge_pid` (the setup process's parent), on loop device `device` (`major:minor`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PreparedDiskRef {
    pub edge_pid: u32,
    pub mount_fd: i32,
    pub device: String,
}

/// The setup process's answer.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SetupResult {
    /// aether's pid in the host's pid namespace.
    pub pid: u32,
    /// The loop device of the writable layer, `major:minor` (for `disk_io` limits).
    pub loop_device: String,
    /// Whether a core-scheduling cookie was made (false where the kernel lacks it).
    pub core_sched: bool,
    /// Set when setup failed (then `pid` is 0).
    pub error: String,
}

/// Where the agent executable appears inside the sandbox.
pub use crate::guest::config::AGENT_PATH;
/// Where aether's configuration appears inside the sandbox.
pub const AETHER_CONFIG: &str = "/run/opendsec/aether.json";
/// The run directory inside the sandbox (sessions, records).
pub const RUN_DIR: &str = "/run/opendsec";
/// The file descriptor aether inherits its listening socket on.
pub const LISTEN_FD: i32 = 3;
/// The first of the fds aether inherits the sandbox's `workload/procs/cgroup.procs` files
/// on (one per split hierarchy, consecutive), followed by as many `workload/` directories.
pub const WORKLOAD_FD: i32 = 4;

/// Docker's default masked paths (hidden behind an empty file or directory).
pub const DEFAULT_MASKED: &[&str] = &[
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];

/// Docker's default read-only paths.
pub const DEFAULT_READONLY: &[&str] = &[
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

pub use crate::types::names::check_sandbox_path;

/// Checks a lower directory for overlayfs's option syntax (`:` and `,` separate options).
pub fn check_lower(p: &std::path::Path) -> Result<(), String> {
    let s = p.to_string_lossy();
    if s.contains([':', ',', '\n']) || !p.is_absolute() {
        return Err(format!(
            "lower directory {s:?} must be absolute without ':' or ','"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_paths() {
        assert!(check_sandbox_path("/etc/secret").is_ok());
        assert!(check_sandbox_path("/proc/sys").is_ok());
        assert!(check_sandbox_path("/running").is_ok());
        for bad in [
            "etc",
            "/a/../b",
            "/",
            "/./x",
            "/a\0",
            "/run",
            "/run/opendsec",
            "//run//opendsec/bin",
            "/run/opendsec/aether.json",
            "/proc",
            "/dev/",
            "/",
        ] {
            assert!(check_sandbox_path(bad).is_err(), "{bad}");
        }
        assert!(check_lower(std::path::Path::new("/a:b")).is_err());
        assert!(check_lower(std::path::Path::new("/srv/img")).is_ok());
    }
}
