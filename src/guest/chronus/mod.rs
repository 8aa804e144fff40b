//! chronus: one process per shell session (docs/architecture.md), started by aether as
//! `<agent> chronus --dir <session dir> --user <uid:gid> --config <aether config>`.
//!
//! It binds its socket (`<dir>/chronus.sock`, reachable by root only), becomes a
//! subreaper, drops to the session's user, and serves the session calls: a long-lived
//! shell fed command by command (see `shell`), output records (see `table`), files and
//! HTTP as that user. On SIGTERM it kills every process of the session, then exits.

pub mod cmdcgroup;
pub mod driver;
pub mod files;
pub mod http;
pub mod meta;
pub mod oom;
pub mod oomkill;
pub mod service;
pub mod session;
pub mod shell;
pub mod table;

use std::collections::{BTreeMap, HashSet};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use argh::FromArgs;
use nix::unistd::{AccessFlags, Gid, Uid};
use tokio::net::unix::pipe;

use crate::guest::config::AetherConfig;
use crate::guest::reaper::Reaper;
use crate::guest::user::{self, Credentials};
use crate::guest::{log_init, proctree};

/// Why chronus could not start.
#[derive(Debug, thiserror::Error)]
pub enum ChronusError {
    #[error("reading config {path}")]
    ReadConfig {
        path: String,
        source: std::io::Error,
    },
    #[error("parsing config {path}")]
    ParseConfig {
        path: String,
        source: serde_json::Error,
    },
    #[error("session user")]
    User(#[from] user::UserError),
    #[error("binding {path}")]
    Bind {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("becoming a subreaper: {0}")]
    Subreaper(nix::Error),
    #[error("switching to uid {uid} gid {gid}")]
    DropPrivileges {
        uid: u32,
        gid: u32,
        source: nix::Error,
    },
    #[error("running as uid {current}, cannot become uid {wanted}")]
    NotRoot { current: u32, wanted: u32 },
    #[error("making chronus non-dumpable: {0}")]
    Nondumpable(std::io::Error),
    #[error("setting no_new_privs for an unprivileged session: {0}")]
    NoNewPrivs(std::io::Error),
    #[error("preparing session dir {path}")]
    SessionDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("starting the runtime: {0}")]
    Runtime(std::io::Error),
    #[error("serving")]
    Serve(#[from] tonic::transport::Error),
}

/// chronus's flags.
#[derive(FromArgs, Debug)]
/// chronus: one shell session of a sandbox (started by aether).
pub struct ChronusArgs {
    /// the session's directory: socket, command files, output records
    #[argh(option)]
    pub dir: PathBuf,
    /// the session's user (uid:gid or a name)
    #[argh(option)]
    pub user: String,
    /// aether's config file (environment, working directory, OOM settings)
    #[argh(option)]
    pub config: String,
}

/// `opendsec chronus ...`: runs until SIGTERM; exits 1 if it cannot start.
pub fn main(args: Vec<String>) -> ExitCode {
    let a: ChronusArgs = match crate::cli::flags::parse("chronus", &args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    log_init();
    // aether execs chronus non-dumpable already (see `sys::process::exec_nondumpable`);
    // this covers a chronus started otherwise.
    if let Err(e) = crate::sys::process::set_nondumpable() {
        tracing::error!(error = %e, "cannot make chronus non-dumpable");
        return ExitCode::FAILURE;
    }
    match run(a) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %crate::types::chain(&e), "chronus failed");
            ExitCode::FAILURE
        }
    }
}

/// Reads aether's config: from stdin when `path` is `-` (how aether starts chronus: the
/// sandbox's root can rewrite the file under /run/opendsec, but not what aether read at its
/// start), else from the file.
pub fn read_config(path: &str) -> Result<AetherConfig, ChronusError> {
    let read = if path == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map(|_| s)
    } else {
        std::fs::read_to_string(path)
    };
    let text = read.map_err(|source| ChronusError::ReadConfig {
        path: path.to_string(),
        source,
    })?;
    serde_json::from_str(&text).map_err(|source| ChronusError::ParseConfig {
        path: path.to_string(),
        source,
    })
}

fn run(a: ChronusArgs) -> Result<(), ChronusError> {
    let cfg = read_config(&a.config)?;
    for fd in &cfg.workload_cgroup_fds {
        // For the shell's child to write to before its exec, never for the shell to keep.
        let _ = crate::sys::process::set_cloexec(*fd, true);
    }
    let creds = user::resolve(&a.user, Path::new("/"))?;
    let dir = std::path::absolute(&a.dir).map_err(|source| ChronusError::SessionDir {
        path: a.dir.clone(),
        source,
    })?;
    let sock = dir.join("chronus.sock");
    let _ = std::fs::remove_file(&sock);
    // Bound before dropping privileges: the socket stays root's, mode 0600, so only
    // aether reaches it (the session dir, 0700, keeps other users out as well).
    let listener =
        std::os::unix::net::UnixListener::bind(&sock).map_err(|source| ChronusError::Bind {
            path: sock.clone(),
            source,
        })?;
    let _ = std::fs::set_permissions(&sock, std::fs::Permissions::from_mode(0o600));
    // Tell aether the socket is there: connections queue from now on, so its first call
    // goes out at once instead of polling for the file.
    {
        use std::io::Write;
        let mut out = std::io::stdout();
        let _ = out.write_all(READY_LINE).and_then(|_| out.flush());
    }
    nix::sys::prctl::set_child_subreaper(true).map_err(ChronusError::Subreaper)?;
    drop_privileges(&creds)?;
    // A change of uid or gid resets the flag to `fs.suid_dumpable`, which an administrator
    // may have set to 1: the session's own processes (same uid) must not trace chronus.
    crate::sys::process::set_nondumpable().map_err(ChronusError::Nondumpable)?;
    // An unprivileged session stays unprivileged: no setuid or setcap program it runs
    // (`su`, `passwd`, a setuid copy a root session left in /tmp) gains anything
    // (docs/sessions.md "The session's user"). Root sessions keep them working, as the sandbox's root.
    if creds.uid != 0 {
        crate::sys::process::set_no_new_privs().map_err(ChronusError::NoNewPrivs)?;
    }
    // If aether dies, so does the session (set after the uid change, which clears it).
    let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGTERM);
    session::make_dirs(&dir).map_err(|source| ChronusError::SessionDir {
        path: dir.clone(),
        source,
    })?;
    oom::set_root(&cfg.cgroup_dir);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(ChronusError::Runtime)?;
    rt.block_on(serve(cfg, creds, dir, listener))
}

/// setgroups, setgid, setuid to the session's user (from root); a no-op when already
/// that user. Errors: not root, or a call failed.
fn drop_privileges(c: &Credentials) -> Result<(), ChronusError> {
    let euid = nix::unistd::geteuid();
    if !euid.is_root() {
        if euid.as_raw() == c.uid {
            return Ok(());
        }
        return Err(ChronusError::NotRoot {
            current: euid.as_raw(),
            wanted: c.uid,
        });
    }
    let fail = |source| ChronusError::DropPrivileges {
        uid: c.uid,
        gid: c.gid,
        source,
    };
    let groups: Vec<Gid> = c.groups.iter().map(|g| Gid::from_raw(*g)).collect();
    nix::unistd::setgroups(&groups).map_err(fail)?;
    nix::unistd::setgid(Gid::from_raw(c.gid)).map_err(fail)?;
    nix::unistd::setuid(Uid::from_raw(c.uid)).map_err(fail)?;
    Ok(())
}

/// The first of these the user may enter: the image's working directory, the home
/// directory, `/`.
fn start_dirs(cfg: &AetherConfig, c: &Credentials) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if !cfg.workdir.is_empty() {
        out.push(PathBuf::from(&cfg.workdir));
    }
    out.push(PathBuf::from(&c.home));
    out.push(PathBuf::from("/"));
    out.retain(|p| p.is_dir() && nix::unistd::access(p.as_path(), AccessFlags::X_OK).is_ok());
    if out.is_empty() {
        out.push(PathBuf::from("/"));
    }
    out
}

/// What chronus writes on its stdout once its socket is bound.
pub const READY_LINE: &[u8] = b"ready\n";

async fn serve(
    cfg: AetherConfig,
    creds: Credentials,
    dir: PathBuf,
    listener: std::os::unix::net::UnixListener,
) -> Result<(), ChronusError> {
    let reaper = Reaper::start().map_err(ChronusError::Runtime)?;
    files::set_home(&creds.home);
    let dirs = start_dirs(&cfg, &creds);
    let env = user::environ(&creds, &cfg.env, &BTreeMap::new());
    let mut spec = shell::ShellSpec::find(env, dirs.clone(), cfg.protect_from_oom);
    spec.cgroup_procs_fds = cfg.workload_cgroup_fds.clone();
    let limits = table::Limits::from_env();
    let cwd = dirs.first().cloned().unwrap_or_else(|| PathBuf::from("/"));
    let cgroups = cfg.command_cgroup_dir_fd.and_then(|fd| {
        cmdcgroup::CommandCgroups::take(fd)
            .map_err(|e| tracing::warn!(error = %e, "commands get no cgroups of their own"))
            .ok()
    });
    let (s, jobs) = session::Session::new(dir.clone(), limits, cwd, spec.flavor, cgroups);
    if let Some(fd) = cfg.session_oom_fd {
        oomkill::watch(fd, cfg.session_memory_max, s.clone());
    }
    let ctl = pipe::OpenOptions::new()
        .read_write(true)
        .open_receiver(s.ctl_path())
        .map_err(|source| ChronusError::SessionDir {
            path: s.ctl_path(),
            source,
        })?;
    tokio::spawn(driver::read_ctl(s.clone(), ctl));
    tokio::spawn(driver::run(s.clone(), spec, reaper, jobs));
    listener
        .set_nonblocking(true)
        .map_err(ChronusError::Runtime)?;
    let listener = tokio::net::UnixListener::from_std(listener).map_err(ChronusError::Runtime)?;
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(ChronusError::Runtime)?;
    tracing::info!(
        sandbox_id = %cfg.sandbox_id,
        session = %dir.display(),
        uid = creds.uid,
        "chronus serving"
    );
    let svc = service::Chronus {
        session: s,
        disk_mb: cfg.disk_mb,
    };
    tokio::select! {
        r = crate::guest::uds::serve(svc, listener, std::future::pending()) => r?,
        _ = term.recv() => {
            let me = std::process::id() as i32;
            proctree::kill_tree_until_empty(me, &HashSet::new(), 50, Duration::from_millis(20)).await;
            tracing::info!("session closed");
        }
    }
    Ok(())
}
