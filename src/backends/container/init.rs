//! The container setup process (`opendsec sandbox-init`), re-executed by the edge from a
//! sealed memfd copy of its own binary, as runc does (docs/architecture.md). It reads a
//! [`SetupSpec`] on stdin, joins the sandbox's cgroup, unshares the mount, pid, uts, ipc, net
//! and cgroup namespaces and forks the sandbox's PID 1, which builds the root file system,
//! pivots into it, restricts itself (seccomp, capabilities) and execs aether. The setup
//! process prints one [`SetupResult`] line and exits, so the sandbox is not a child of the
//! edge and outlives it.
//!
//! It runs no async runtime and no thread: `fork` is only sound that way.

use std::convert::Infallible;
use std::ffi::CString;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::net::UnixListener;
use std::process::ExitCode;

use nix::sched::{unshare, CloneFlags};
use nix::sys::signal::{kill, Signal};
use nix::unistd::{pipe2, Pid};

use super::policy;
use super::rootfs;
use super::setup::{SetupResult, SetupSpec, AETHER_CONFIG, AGENT_PATH, LISTEN_FD, WORKLOAD_FD};
use crate::sys::loopdev::LoopDevice;
use crate::sys::process::{
    close_fds_from, dup_to, fork_single_threaded, sched_core_create, Forked,
};

/// Where fds are parked before being placed at the numbers aether expects.
const HANDED_DOWN_ABOVE: rustix::fd::RawFd = 64;

/// A failed setup step.
#[derive(Debug, thiserror::Error)]
pub enum InitError {
    #[error("reading the setup spec: {0}")]
    Spec(String),
    #[error("{step}")]
    Sys {
        step: &'static str,
        source: std::io::Error,
    },
    #[error(transparent)]
    Rootfs(#[from] rootfs::RootfsError),
    #[error(transparent)]
    Policy(#[from] policy::PolicyError),
    #[error("sandbox setup failed: {0}")]
    Child(String),
}

fn sys<T, E: Into<std::io::Error>>(step: &'static str, r: Result<T, E>) -> Result<T, InitError> {
    r.map_err(|e| InitError::Sys {
        step,
        source: e.into(),
    })
}

/// Entry point of `opendsec sandbox-init`; exit code 0 with a result line, 1 with an error
/// line (both JSON [`SetupResult`]s on stdout).
pub fn main() -> ExitCode {
    let mut input = String::new();
    let result = match std::io::stdin().read_to_string(&mut input) {
        Err(e) => Err(InitError::Spec(crate::types::chain(&e))),
        Ok(_) => match serde_json::from_str::<SetupSpec>(&input) {
            Err(e) => Err(InitError::Spec(crate::types::chain(&e))),
            Ok(spec) => run(&spec),
        },
    };
    let (out, code) = match result {
        Ok(r) => (r, ExitCode::SUCCESS),
        Err(e) => (
            SetupResult {
                error: crate::types::chain(&e),
                ..Default::default()
            },
            ExitCode::from(1),
        ),
    };
    let line = serde_json::to_string(&out).unwrap_or_default();
    let _ = writeln!(std::io::stdout(), "{line}");
    code
}

fn run(spec: &SetupSpec) -> Result<SetupResult, InitError> {
    // A session of its own: no signal for the edge's terminal or process group reaches it.
    sys("setsid", nix::unistd::setsid())?;
    let steps = &spec.cgroup;
    for procs in &steps.join {
        sys("join cgroup", std::fs::write(procs, "0"))?;
    }
    // Opened here, in the host's cgroup namespace and as root: a later move through them
    // is checked against that, not against whoever writes (a session's unprivileged
    // chronus) or the sandbox's own namespace (which does not reach `workload/`).
    let mut workload = Vec::with_capacity(steps.workload.len());
    for procs in &steps.workload {
        let f = std::fs::OpenOptions::new().write(true).open(procs);
        workload.push(sys("open workload cgroup", f)?);
    }
    // Directories, for aether to make each session's cgroup in (by fd: inside, the tree is
    // read-only and rooted at the sandbox), in the same order.
    for dir in &steps.workload_dirs {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY)
            .open(dir);
        workload.push(sys("open workload cgroup directory", f)?);
    }

    // Copied while the edge is still this process's parent (the sandbox's PID 1, forked
    // below, is not its child); attached by that PID 1 in the sandbox's mount namespace.
    let prepared = match &spec.prepared_disk {
        Some(p) => Some(sys(
            "copy the prepared disk from the edge",
            crate::sys::mountfd::fd_of_parent(p.edge_pid, p.mount_fd),
        )?),
        None => None,
    };

    sys(
        "unshare",
        unshare(
            CloneFlags::CLONE_NEWNS
                | CloneFlags::CLONE_NEWUTS
                | CloneFlags::CLONE_NEWIPC
                | CloneFlags::CLONE_NEWNET
                | CloneFlags::CLONE_NEWCGROUP
                | CloneFlags::CLONE_NEWPID,
        ),
    )?;
    // The agents go to `agent/`; the sandbox's own cgroup is left empty, which v2 needs
    // before the children can get their controllers.
    for procs in &steps.agent {
        sys("join agent cgroup", std::fs::write(procs, "0"))?;
    }
    for (file, value) in &steps.writes {
        sys("write cgroup limit", std::fs::write(file, value))?;
    }
    let (r, w) = sys("pipe", pipe2(nix::fcntl::OFlag::O_CLOEXEC))?;
    match sys("fork", fork_single_threaded())? {
        Forked::Child => {
            drop(r);
            let err = match child(spec, &w, &workload, prepared) {
                Ok(never) => match never {},
                Err(e) => e,
            };
            let mut f = std::fs::File::from(w);
            let _ = write!(f, "err {err}");
            std::process::exit(1);
        }
        Forked::Parent { child } => {
            drop((w, prepared));
            let mut msg = String::new();
            let _ = std::fs::File::from(r).read_to_string(&mut msg);
            match msg.strip_prefix("ok ") {
                Some(rest) => {
                    let mut it = rest.split_whitespace();
                    Ok(SetupResult {
                        pid: child as u32,
                        loop_device: it.next().unwrap_or_default().to_string(),
                        core_sched: it.next() == Some("core"),
                        error: String::new(),
                    })
                }
                None => {
                    let _ = kill(Pid::from_raw(child), Signal::SIGKILL);
                    let why = msg.strip_prefix("err ").unwrap_or("the setup process died");
                    Err(InitError::Child(why.to_string()))
                }
            }
        }
    }
}

/// PID 1 of the new pid namespace: builds the sandbox and becomes aether.
fn child(
    spec: &SetupSpec,
    report: &OwnedFd,
    workload: &[std::fs::File],
    prepared: Option<OwnedFd>,
) -> Result<Infallible, InitError> {
    rootfs::make_private()?;
    let (disk, root) = rootfs::scratch(&spec.dir)?;
    let device = match (prepared, &spec.prepared_disk) {
        (Some(mount), Some(p)) => {
            // Attached and mounted by the edge ahead of time; its mount now moves into the
            // sandbox's namespace, and holds the device from then on.
            sys(
                "attach the prepared disk",
                crate::sys::mountfd::attach(mount.as_fd(), &disk),
            )?;
            drop(mount);
            rootfs::overlay_on(&disk, &root, &spec.lowers, &spec.hidden_lower)?;
            p.device.clone()
        }
        _ => {
            let dev = sys(
                "attach loop device",
                LoopDevice::attach(&spec.disk_image, false, true),
            )?;
            let (major, minor) = dev.major_minor();
            rootfs::overlay(dev.path(), &disk, &root, &spec.lowers, &spec.hidden_lower)?;
            // The mount now holds the device; with autoclear it frees itself once the
            // sandbox's mount namespace is gone.
            drop(dev);
            format!("{major}:{minor}")
        }
    };
    rootfs::populate(&root, spec)?;
    let sock = spec.dir.join("aether.sock");
    let _ = std::fs::remove_file(&sock);
    // Bound on the host side before the pivot: the sandbox never sees the socket file, so
    // it cannot swap it for a link to something else.
    let listener = sys("bind aether socket", UnixListener::bind(&sock))?;
    rootfs::pivot(&root)?;
    sys("sethostname", nix::unistd::sethostname(&spec.hostname))?;
    if let Some(conf) = &spec.resolv_conf {
        rootfs::write_resolv_conf(conf)?;
    }
    rootfs::restrict(&spec.readonly_paths, &spec.masked_paths)?;
    sys("bring up lo", crate::sys::net::set_up("lo"))?;
    let core = spec.core_sched && sched_core_create().is_ok();
    policy::install_seccomp()?;
    policy::drop_capabilities()?;
    let line = format!("ok {device} {}", if core { "core" } else { "nocore" });
    sys("report", nix::unistd::write(report, line.as_bytes()))?;
    // From here on a failure shows as aether never answering; the edge times out and
    // removes the sandbox.
    // Everything handed down first goes above the target numbers, so that placing one
    // never overwrites another that happens to sit on its target.
    let high = |fd: std::os::fd::BorrowedFd<'_>| {
        rustix::io::fcntl_dupfd_cloexec(fd, HANDED_DOWN_ABOVE).map_err(std::io::Error::from)
    };
    let listener_high = sys("move listener", high(listener.as_fd()))?;
    let mut workload_high = Vec::with_capacity(workload.len());
    for f in workload {
        workload_high.push(sys("move workload cgroup", high(f.as_fd()))?);
    }
    sys("dup listener", dup_to(listener_high.as_fd(), LISTEN_FD))?;
    let mut next_fd = WORKLOAD_FD;
    for f in &workload_high {
        sys("dup workload cgroup", dup_to(f.as_fd(), next_fd))?;
        next_fd += 1;
    }
    let null = sys(
        "open /dev/null",
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null"),
    )?;
    for fd in 0..=2 {
        sys("redirect stdio", dup_to(null.as_fd(), fd))?;
    }
    sys("close inherited fds", close_fds_from(next_fd as u32))?;
    let path = cstr(AGENT_PATH)?;
    let argv = [cstr("aether")?, cstr("--config")?, cstr(AETHER_CONFIG)?];
    let env = [cstr(
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    )?];
    let e = nix::unistd::execve(&path, &argv, &env);
    Err(InitError::Sys {
        step: "exec aether",
        source: match e {
            Err(e) => e.into(),
            Ok(never) => match never {},
        },
    })
}

fn cstr(s: &str) -> Result<CString, InitError> {
    CString::new(s).map_err(|e| InitError::Spec(crate::types::chain(&e)))
}
