//! `opendsec cluster up`: flags, startup, the environment to export, and running until a
//! signal.

use std::process::ExitCode;

use argh::FromArgs;

use super::local::{LocalCluster, UpOptions};

#[derive(FromArgs, Debug)]
/// Run a whole OpenDsec cluster in this process (development and tests). Prints the
/// environment to export, then serves until SIGINT or SIGTERM. Exit status: 0 after a clean
/// shutdown, 1 when the cluster fails to start or fails, 2 for a bad command line.
#[argh(help_triggers("-h", "--help", "help"))]
struct UpFlags {
    /// cluster config file; without it a cluster is generated from the flags below
    #[argh(option, default = "String::new()")]
    config: String,
    /// edges of the generated cluster (default 4)
    #[argh(option, default = "4")]
    sim_edges: usize,
    /// apiservers of the generated cluster (default 1)
    #[argh(option, default = "1")]
    apiservers: usize,
    /// runtime of the generated edges' `container` backend: sim (simulated) or linux (real
    /// containers; needs root) (default sim)
    #[argh(option, default = "String::from(\"sim\")")]
    runtime: String,
    /// the guest kernel of the microvm backend (runtime qemu) of the generated linux edges,
    /// or `none` for no microvm backend (default: the newest installed /boot/vmlinuz-* with
    /// its modules, when QEMU is installed)
    #[argh(option, default = "String::new()")]
    microvm_kernel: String,
    /// shared image store directory (default: images under -state-dir)
    #[argh(option, default = "String::new()")]
    image_store: String,
    /// sandbox state directory (default /var/lib/opendsec)
    #[argh(option, default = "String::from(\"/var/lib/opendsec\")")]
    state_dir: String,
    /// offer the development image `host` (the host's / read-only; development only)
    /// (default true)
    #[argh(option, default = "true")]
    host_image: bool,
    /// reject creations while the state directory has less free space (MB); -1 disables
    /// (default 512)
    #[argh(option, default = "512")]
    disk_reserve_mb: i64,
    /// create a CA and certificates in <state-dir>/pki and run with mTLS between the roles
    /// and TLS on the public port (prints OPENDSEC_CA)
    #[argh(switch)]
    tls: bool,
    /// apiserver audit log directory (default: no audit log)
    #[argh(option, default = "String::new()")]
    audit_dir: String,
    /// address for /metrics, /healthz and /readyz, e.g. :9464 (default: none)
    #[argh(option, default = "String::new()")]
    metrics: String,
    /// write the effective config (with the bound addresses) to this file (default: none)
    #[argh(option, default = "String::new()")]
    write_config: String,
    /// log level: error, warn, info, debug (default info)
    #[argh(option, default = "String::from(\"info\")")]
    log: String,
    /// listen address of the (first) apiserver; port 0 picks a free one (default
    /// 127.0.0.1:7100)
    #[argh(option, default = "String::from(\"127.0.0.1:7100\")")]
    addr: String,
    /// IAM state file (default: none, state in memory only)
    #[argh(option, default = "String::new()")]
    iam_state: String,
    /// sandbox networking on the linux edges (docs/network.md): auto (on with -runtime
    /// linux), on or off (default auto)
    #[argh(option, default = "String::from(\"auto\")")]
    network: String,
    /// listen address of the E2B gateway (docs/e2b.md); `off` runs none (default
    /// 127.0.0.1:7400, or port 0 when -addr has port 0)
    #[argh(option, default = "String::new()")]
    e2b_addr: String,
    /// median simulated creation time of the sim backends, ms (default 0)
    #[argh(option, default = "0.0")]
    sim_latency_ms: f64,
    /// the resolvers sandboxes' DNS proxy asks, address[:port], comma-separated (default:
    /// the host's, from /etc/resolv.conf)
    #[argh(option, default = "String::new()")]
    upstream_dns: String,
}

/// Runs `cluster up` with `args` (after `up`).
pub fn main(args: &[String]) -> ExitCode {
    let f: UpFlags = match crate::cli::flags::parse("opendsec cluster up", args) {
        Ok(f) => f,
        Err(code) => return code,
    };
    if let Err(e) = crate::telemetry::init_logging(&f.log) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    if let Err(why) = check_flags(&f) {
        // A usage error (exit 2), found before anything starts.
        eprintln!("error: invalid: {why}");
        return ExitCode::from(2);
    }
    crate::cli::flags::block_on(run(f))
}

/// Flag values `cluster up` cannot run with: none of them starts anything.
fn check_flags(f: &UpFlags) -> Result<(), &'static str> {
    if !matches!(f.network.as_str(), "auto" | "on" | "off" | "true" | "false") {
        return Err("-network: auto, on or off");
    }
    if matches!(f.network.as_str(), "on" | "true") && f.runtime != "linux" {
        return Err("-network on: sandbox networking needs -runtime linux");
    }
    if f.tls && !f.config.is_empty() {
        return Err("-tls makes certificates for a generated cluster; with -config, set tls.dir in the config (opendsec ctl pki init)");
    }
    if f.config.is_empty() && f.sim_edges == 0 {
        // A cluster of no edge runs nothing; one edge used to start in its place.
        return Err("-sim-edges 0: a cluster needs at least one edge");
    }
    if f.config.is_empty() && f.apiservers == 0 {
        return Err("-apiservers 0: a cluster needs at least one apiserver");
    }
    if !f.microvm_kernel.is_empty() && f.microvm_kernel != "none" && f.runtime != "linux" {
        return Err("-microvm-kernel needs -runtime linux (VMs are real; sim edges run nothing)");
    }
    Ok(())
}

/// The microvm backend's kernel: `-microvm-kernel`, else for real edges the newest installed
/// Debian kernel (`/boot/vmlinuz-*` whose `/lib/modules/<version>` is there) when QEMU is
/// installed too, else none.
fn microvm_kernel(f: &UpFlags) -> String {
    if f.microvm_kernel == "none" {
        return String::new();
    }
    if !f.microvm_kernel.is_empty() {
        return std::path::absolute(&f.microvm_kernel)
            .map(|p| p.display().to_string())
            .unwrap_or_else(|_| f.microvm_kernel.clone());
    }
    if f.runtime != "linux" {
        return String::new();
    }
    if crate::backends::microvm::qemu_binary().is_none() {
        tracing::info!(
            "no microvm backend: no qemu-system-x86_64 on PATH (Debian: qemu-system-x86)"
        );
        return String::new();
    }
    let mut found: Vec<(String, std::path::PathBuf)> = std::fs::read_dir("/boot")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let version = name.strip_prefix("vmlinuz-")?.to_string();
            std::path::Path::new("/lib/modules")
                .join(&version)
                .is_dir()
                .then(|| (version, e.path()))
        })
        .collect();
    found.sort();
    match found.pop() {
        Some((_, path)) => {
            tracing::info!(kernel = %path.display(), "microVMs use the installed kernel");
            path.display().to_string()
        }
        None => {
            tracing::info!(
                "no microvm backend: no installed kernel (/boot/vmlinuz-* with its \
                 /lib/modules); give one with -microvm-kernel (packaging/kernel/fetch-debian.sh \
                 or packaging/kernel/build.sh make one)"
            );
            String::new()
        }
    }
}

/// The gateway's address: `off` none, else as given, else 7400 beside the apiserver's host
/// (port 0 when the apiserver's is 0, so that clusters side by side never collide).
fn e2b_addr(flag: &str, api: &str) -> String {
    match flag {
        "off" => String::new(),
        "" => {
            let port = if api.ends_with(":0") { 0 } else { 7400 };
            let host = api.rsplit_once(':').map_or("127.0.0.1", |(h, _)| h);
            let host = if host.is_empty() { "127.0.0.1" } else { host };
            format!("{host}:{port}")
        }
        a => a.to_string(),
    }
}

fn metrics_addr(a: &str) -> String {
    if a.starts_with(':') {
        format!("127.0.0.1{a}")
    } else {
        a.to_string()
    }
}

async fn run(f: UpFlags) -> anyhow::Result<()> {
    use anyhow::Context;
    let cluster = if f.config.is_empty() {
        let o = UpOptions {
            sim_edges: f.sim_edges,
            apiservers: f.apiservers,
            runtime: f.runtime.clone(),
            state_dir: f.state_dir.clone(),
            host_image: f.host_image,
            disk_reserve_mb: f.disk_reserve_mb,
            audit_dir: f.audit_dir.clone(),
            addr: f.addr.clone(),
            iam_state: f.iam_state.clone(),
            image_store: f.image_store.clone(),
            create_latency_ms: f.sim_latency_ms,
            network: match f.network.as_str() {
                "on" | "true" => true,
                "off" | "false" => false,
                _ => f.runtime == "linux",
            },
            e2b_addr: e2b_addr(&f.e2b_addr, &f.addr),
            upstream_dns: f
                .upstream_dns
                .split(',')
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from)
                .collect(),
            microvm_kernel: microvm_kernel(&f),
            tls: f.tls,
            ..Default::default()
        };
        LocalCluster::up(&o).await?
    } else {
        let cfg = crate::config::Config::load(std::path::Path::new(&f.config))?;
        LocalCluster::from_config(cfg).await?
    };
    if !f.write_config.is_empty() {
        let text = serde_json::to_string_pretty(&*cluster.cfg)?;
        write_private(&f.write_config, text.as_bytes())
            .with_context(|| format!("writing {}", f.write_config))?;
    }
    let ready = crate::telemetry::Ready::default();
    if !f.metrics.is_empty() {
        let addr = metrics_addr(&f.metrics);
        let l = tokio::net::TcpListener::bind(&addr)
            .await
            .with_context(|| format!("binding metrics {addr}"))?;
        tokio::spawn(crate::telemetry::serve_health(
            l,
            ready.clone(),
            cluster.shutdown.clone(),
        ));
    }
    ready.set(true, "cluster");
    // One write, and its failure ignored: a reader that stops early (`cluster up | head -1`,
    // a test harness done with the block) must not take the cluster down with a panic on
    // a broken pipe.
    let mut env = format!(
        "export OPENDSEC_ADDR={}\nexport OPENDSEC_TOKEN={}\nexport OPENDSEC_PROJECT=root\n",
        cluster.api_addrs.join(","),
        cluster.admin_token
    );
    if !cluster.cfg.tls.dir.is_empty() {
        let ca = std::path::Path::new(&cluster.cfg.tls.dir).join(crate::pki::CA_CERT);
        env.push_str(&format!("export OPENDSEC_CA={}\n", ca.display()));
    }
    if !cluster.cfg.image_store.root.is_empty() {
        env.push_str(&format!(
            "export OPENDSEC_IMAGE_STORE={}\n",
            cluster.cfg.image_store.root
        ));
    }
    if let Some(a) = &cluster.e2b_addr {
        // E2B's SDKs reach the control plane and the sandboxes through the gateway.
        env.push_str(&format!(
            "export E2B_API_URL=http://{a}\nexport E2B_SANDBOX_URL=http://{a}\nexport E2B_API_KEY={}\n",
            cluster.admin_token
        ));
    }
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(env.as_bytes()).and_then(|()| out.flush());
    }
    eprintln!(
        "# cluster up: {} edge(s), {} apiserver(s); Ctrl-C stops it",
        cluster.cfg.edges.len(),
        cluster.api_addrs.len()
    );
    cluster.shutdown.fire_on_signals();
    cluster.shutdown.wait().await;
    cluster.down().await;
    Ok(())
}

/// Writes a file readable by its owner only (it holds the admin token and service secret).
fn write_private(path: &str, data: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(path)?;
    f.write_all(data)?;
    f.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;
    use argh::FromArgs;

    fn flags(args: &[&str]) -> UpFlags {
        UpFlags::from_args(&["cluster up"], args).unwrap()
    }

    #[test]
    fn microvm_kernel_none_means_no_microvm_backend() {
        let f = flags(&["--runtime", "linux", "--microvm-kernel", "none"]);
        assert!(check_flags(&f).is_ok());
        assert_eq!(microvm_kernel(&f), "");
        // `none` is not a file name, with the simulated runtime either.
        assert!(check_flags(&flags(&["--microvm-kernel", "none"])).is_ok());
        let f = flags(&["--runtime", "linux", "--microvm-kernel", "/k/vmlinuz"]);
        assert_eq!(microvm_kernel(&f), "/k/vmlinuz");
        assert!(check_flags(&flags(&["--microvm-kernel", "/k/vmlinuz"])).is_err());
    }
}
