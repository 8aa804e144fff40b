//! aether: one per sandbox, usually its PID 1 (docs/architecture.md). `opendsec aether
//! --config PATH` reads an [`AetherConfig`], serves the runtime API on a unix socket (an
//! inherited listening fd, or a path it binds), routes session calls to one chronus per
//! session, and answers ListSessions, CloseSession and Watch itself. A tokio
//! current-thread runtime keeps an idle agent's memory small.

pub mod cgroups;
pub mod requests;
pub mod restore;
pub mod service;
pub mod sessions;

use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use argh::FromArgs;
use tokio::signal::unix::{signal, SignalKind};

use crate::guest::config::AetherConfig;
use crate::guest::reaper::Reaper;
use crate::guest::{log_init, uds};

/// Why aether could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum AetherError {
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
    #[error("config {path}: {why}")]
    BadConfig { path: String, why: String },
    #[error("preparing run dir {path}")]
    RunDir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("taking the inherited listening socket fd {fd}")]
    ListenFd { fd: i32, source: std::io::Error },
    #[error("binding {path}")]
    Bind {
        path: String,
        source: std::io::Error,
    },
    #[error("taking the sessions' cgroups")]
    SessionCgroups(#[source] cgroups::SessionCgroupError),
    #[error("starting the runtime: {0}")]
    Runtime(std::io::Error),
    #[error("serving")]
    Serve(#[from] tonic::transport::Error),
}

/// aether's flags.
#[derive(FromArgs, Debug)]
/// aether: the agent in a sandbox serving the runtime API.
pub struct AetherArgs {
    /// the config file (JSON, see AetherConfig)
    #[argh(option, default = "String::new()")]
    pub config: String,
    /// run as a microVM's PID 1 from its initramfs: bring the VM up and serve on the
    /// agent's virtio-serial port (docs/microvm.md "In the guest")
    #[argh(switch)]
    pub vm_init: bool,
    /// the second stage of --vm-init, re-executed from the agent disk once the sandbox's
    /// root is `/` (docs/microvm.md "In the guest")
    #[argh(switch)]
    pub vm_rooted: bool,
}

/// Where aether takes the edge's connections.
enum Listen {
    Unix(tokio::net::UnixListener),
    /// A microVM's agent port (a virtio-serial device), spoken in `portmux` frames.
    Port(PathBuf),
}

/// `opendsec aether --config PATH`: serves until SIGTERM, then exits 0; 1 if it cannot
/// start.
pub fn main(args: Vec<String>) -> ExitCode {
    let a: AetherArgs = match crate::cli::flags::parse("aether", &args) {
        Ok(a) => a,
        Err(code) => return code,
    };
    log_init();
    // First, before anything of the sandbox runs: its root must not ptrace aether or read
    // its memory (docs/architecture.md, "In the sandbox").
    if let Err(e) = crate::sys::process::set_nondumpable() {
        tracing::error!(error = %e, "cannot make aether non-dumpable");
        return ExitCode::FAILURE;
    }
    if a.vm_init || a.vm_rooted {
        return vm_main(a.vm_rooted);
    }
    let r = load(&a.config).and_then(|cfg| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(AetherError::Runtime)?;
        rt.block_on(async {
            let l = listener(&cfg)?;
            run(cfg, Listen::Unix(l)).await
        })
    });
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!(error = %crate::types::chain(&e), "aether failed");
            ExitCode::FAILURE
        }
    }
}

/// `--vm-init`: PID 1 of a microVM. It never returns while the VM runs; when it cannot
/// bring the VM up or stops serving, it says why on the console and powers the VM off (a
/// PID 1 that exits panics the kernel).
fn vm_main(rooted: bool) -> ExitCode {
    if std::process::id() != 1 {
        tracing::error!("--vm-init is for a microVM's PID 1");
        return ExitCode::from(2);
    }
    // A panic is a failure like any other: said on the console, then the VM powers off
    // (the default hook has printed the panic's message by then).
    let r = std::panic::catch_unwind(|| if rooted { vm_serve() } else { vm_first_stage() })
        .unwrap_or_else(|_| Err("the agent panicked".into()));
    if let Err(e) = r {
        tracing::error!(error = %e, "the VM's init failed");
    }
    // The console's driver sends what was written in the background: without the wait
    // the VM's last words would be lost with it, and the node reports them.
    let _ = nix::sys::termios::tcdrain(std::io::stderr());
    let _ = nix::sys::reboot::reboot(nix::sys::reboot::RebootMode::RB_POWER_OFF);
    ExitCode::FAILURE
}

/// The first stage, from the initramfs: brings the VM up, enters the sandbox's root and
/// re-executes the agent from the agent disk, so the initramfs's copy of the binary (the
/// guest's memory, for as long as a process maps it) is freed. Returns only on failure.
fn vm_first_stage() -> Result<(), String> {
    use crate::guest::vminit;
    let booted = vminit::boot().map_err(|e| e.to_string())?;
    let agent = vminit::enter_sandbox_root().map_err(|e| e.to_string())?;
    vminit::hand_off(&vminit::Handoff {
        config: booted.config,
        port: booted.port,
    })
    .map_err(|e| e.to_string())?;
    let path =
        std::ffi::CString::new(agent.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
    let argv = [c"opendsec", c"aether", c"--vm-rooted"];
    let e = nix::unistd::execv(&path, &argv).err();
    Err(format!("exec {}: {e:?}", agent.display()))
}

/// The second stage, in the sandbox's root: serves the runtime API on the agent port.
fn vm_serve() -> Result<(), String> {
    use crate::guest::vminit;
    let h = vminit::take_handoff().map_err(|e| e.to_string())?;
    let c = h.config;
    vminit::write_identity(&c).map_err(|e| e.to_string())?;
    // While aether is the only process and single-threaded: it moves itself to agent/.
    let cg = crate::guest::vmcgroups::setup(c.pids_max)
        .map_err(|e| format!("the guest's cgroups: {e}"))?;
    let cfg = AetherConfig {
        sandbox_id: c.sandbox_id,
        run_dir: "/run/opendsec".into(),
        agent: vminit::AGENT_PATH.into(),
        init_user: c.init_user,
        env: c.env,
        workdir: c.workdir,
        pid1: true,
        protect_from_oom: true,
        disk_mb: c.disk_mb,
        cgroup_dir: cg.workload_dir,
        workload_cgroup_fds: vec![std::os::fd::IntoRawFd::into_raw_fd(cg.procs)],
        workload_cgroup_dir_fds: vec![std::os::fd::IntoRawFd::into_raw_fd(cg.workload)],
        session_pids_max: cg.session_pids_max,
        session_memory_max: cg.session_memory_max,
        ..Default::default()
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(run(cfg, Listen::Port(h.port)))
        .map_err(|e| crate::types::chain(&e).to_string())
}

const PORT_POLL_MIN: std::time::Duration = std::time::Duration::from_millis(20);
const PORT_POLL_MAX: std::time::Duration = std::time::Duration::from_millis(100);

/// Serves `svc` on a microVM's agent port until the port cannot be read: each host
/// connection's sessions become connections of the runtime server.
async fn serve_port<S: crate::pb::runtime_server::Runtime>(
    svc: S,
    port: &Path,
) -> Result<(), AetherError> {
    use crate::guest::portmux::Mux;
    let open = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(port)
            .map_err(AetherError::Runtime)
    };
    // One open for the life of the VM: opening a port drops what was queued for it.
    let r = open()?;
    let w = r.try_clone().map_err(AetherError::Runtime)?;
    let (acc_tx, acc_rx) = tokio::sync::mpsc::channel(16);
    let mut reader = Mux::guest(
        tokio::fs::File::from_std(r),
        tokio::fs::File::from_std(w),
        acc_tx,
    );
    tokio::spawn(async move {
        // The port reads end-of-stream at once while no host is connected (before the
        // edge's first connection, after a restore, and poll() says the same), so it is
        // looked at again: every 20 ms at first, backing off to 100 ms while no host comes,
        // which bounds both what an idle VM spends and how late it answers a restore.
        let mut pause = PORT_POLL_MIN;
        loop {
            let started = std::time::Instant::now();
            if let Err(e) = reader.run().await {
                tracing::warn!(error = %e, "agent port");
            }
            pause = if started.elapsed() > PORT_POLL_MAX {
                PORT_POLL_MIN
            } else {
                (pause * 2).min(PORT_POLL_MAX)
            };
            tokio::time::sleep(pause).await;
        }
    });
    let incoming = tokio_stream::StreamExt::map(
        tokio_stream::wrappers::ReceiverStream::new(acc_rx),
        Ok::<_, std::io::Error>,
    );
    let guest = crate::pb::guest_server::GuestServer::new(restore::VmGuest);
    uds::serve_incoming(svc, Some(guest), incoming, std::future::pending()).await?;
    Ok(())
}

/// Reads and checks the config: `agent` and `run_dir` are required, and a socket.
pub fn load(path: &str) -> Result<AetherConfig, AetherError> {
    let text = std::fs::read_to_string(path).map_err(|source| AetherError::ReadConfig {
        path: path.to_string(),
        source,
    })?;
    let cfg: AetherConfig =
        serde_json::from_str(&text).map_err(|source| AetherError::ParseConfig {
            path: path.to_string(),
            source,
        })?;
    let bad = |why: &str| AetherError::BadConfig {
        path: path.to_string(),
        why: why.to_string(),
    };
    if cfg.agent.is_empty() {
        return Err(bad("agent is empty"));
    }
    if cfg.run_dir.is_empty() {
        return Err(bad("run_dir is empty"));
    }
    if cfg.listen_fd.is_none() && cfg.socket.is_empty() {
        return Err(bad("neither listen_fd nor socket is set"));
    }
    Ok(cfg)
}

/// Makes `run_dir` (0755) and `run_dir/sessions` (0711: session users pass through to
/// their own dir but cannot list the others).
fn prepare_run_dir(run_dir: &Path) -> std::io::Result<()> {
    let sessions = run_dir.join("sessions");
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o755)
        .create(&sessions)?;
    std::fs::set_permissions(run_dir, std::fs::Permissions::from_mode(0o755))?;
    std::fs::set_permissions(&sessions, std::fs::Permissions::from_mode(0o711))
}

fn listener(cfg: &AetherConfig) -> Result<tokio::net::UnixListener, AetherError> {
    let std_l = match cfg.listen_fd {
        Some(fd) => crate::sys::fd::take_unix_listener(fd)
            .map_err(|source| AetherError::ListenFd { fd, source })?,
        None => {
            let _ = std::fs::remove_file(&cfg.socket);
            let l = std::os::unix::net::UnixListener::bind(&cfg.socket).map_err(|source| {
                AetherError::Bind {
                    path: cfg.socket.clone(),
                    source,
                }
            })?;
            let _ = std::fs::set_permissions(&cfg.socket, std::fs::Permissions::from_mode(0o600));
            l
        }
    };
    std_l.set_nonblocking(true).map_err(AetherError::Runtime)?;
    tokio::net::UnixListener::from_std(std_l).map_err(AetherError::Runtime)
}

async fn run(cfg: AetherConfig, listen: Listen) -> Result<(), AetherError> {
    if cfg.protect_from_oom {
        if let Err(e) = std::fs::write("/proc/self/oom_score_adj", "-1000") {
            // Expected without CAP_SYS_RESOURCE.
            tracing::debug!(error = %crate::types::chain(&e), "cannot lower aether's OOM score");
        }
    }
    for fd in &cfg.workload_cgroup_fds {
        // Only chronus gets them (explicitly, at its exec): a workload process holding one
        // could move the agents into the workload's cgroup.
        if let Err(e) = crate::sys::process::set_cloexec(*fd, true) {
            tracing::warn!(fd, error = %e, "inherited workload cgroup fd");
        }
    }
    let is_pid1 = cfg.pid1 && std::process::id() == 1;
    if !is_pid1 {
        // Orphans of the sandbox come here, as they would to a PID 1.
        if let Err(e) = nix::sys::prctl::set_child_subreaper(true) {
            tracing::debug!(error = %crate::types::chain(&e), "cannot become a subreaper");
        }
    }
    let reaper = Reaper::start().map_err(AetherError::Runtime)?;
    prepare_run_dir(Path::new(&cfg.run_dir)).map_err(|source| AetherError::RunDir {
        path: PathBuf::from(&cfg.run_dir),
        source,
    })?;
    let cfg = Arc::new(cfg);
    let procs = crate::guest::procs::Procs::new(cfg.clone(), reaper.clone(), PathBuf::from("/"));
    let workload = cgroups::Workload::take(&cfg).map_err(AetherError::SessionCgroups)?;
    let sessions = sessions::Sessions::new(cfg.clone(), reaper, workload.map(Arc::new));
    let svc = service::Aether {
        sessions: sessions.clone(),
        procs: procs.clone(),
        watchers: crate::guest::watch::registry::Watchers::new(),
    };
    let mut term = signal(SignalKind::terminate()).map_err(AetherError::Runtime)?;
    let mut int = signal(SignalKind::interrupt()).map_err(AetherError::Runtime)?;
    // The default session starts now, beside the rest of the sandbox's start (the edge's
    // connection, its record, the caller's answer): started only once the edge's first
    // Watch came, it was not ready when the first command arrived, which then waited for
    // it (about 5 ms of a first command's 13, docs/benchmarks.md).
    {
        let sessions = sessions.clone();
        tokio::spawn(async move { sessions.prewarm().await });
    }
    tracing::info!(sandbox_id = %cfg.sandbox_id, pid1 = is_pid1, "aether serving");
    let serving = async move {
        match listen {
            Listen::Unix(l) => Ok(uds::serve(svc, l, std::future::pending()).await?),
            Listen::Port(p) => serve_port(svc, &p).await,
        }
    };
    tokio::select! {
        r = serving => r?,
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
    if is_pid1 {
        // PID 1 of the sandbox's pid namespace: -1 reaches every other process in it.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(-1),
            nix::sys::signal::Signal::SIGKILL,
        );
    } else {
        procs.kill_all();
        sessions.close_all().await;
    }
    tracing::info!(sandbox_id = %cfg.sandbox_id, "aether stopped");
    Ok(())
}
