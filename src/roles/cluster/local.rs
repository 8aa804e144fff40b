//! Building and running a local cluster from options or from a config file.

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::config::{ApiserverConfig, BackendConfig, CapacityConfig, Config, EdgeConfig};
use crate::shutdown::Shutdown;
use crate::telemetry::Ready;

/// Starting a local cluster failed.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    #[error("binding {what} on {addr}")]
    Bind {
        what: String,
        addr: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Unsupported(String),
    #[error(transparent)]
    Config(#[from] crate::config::ConfigError),
    #[error(transparent)]
    Iam(#[from] crate::roles::iam::IamError),
    #[error(transparent)]
    Watcher(#[from] crate::roles::watcher::WatcherError),
    #[error(transparent)]
    Apiserver(#[from] crate::roles::apiserver::ApiserverError),
    #[error(transparent)]
    Edge(#[from] crate::roles::edge::EdgeError),
    #[error(transparent)]
    E2b(#[from] crate::roles::e2b::GatewayError),
    #[error("the cluster did not become ready within {0} s")]
    NotReady(u64),
    #[error("starting the runtime of {role}")]
    Runtime {
        role: String,
        source: std::io::Error,
    },
    #[error("state directory {path}")]
    StateDir {
        path: String,
        source: std::io::Error,
    },
    #[error("certificates in {path}")]
    Pki {
        path: String,
        source: crate::pki::PkiError,
    },
}

/// What `cluster up` generates without `-config`.
#[derive(Debug, Clone)]
pub struct UpOptions {
    pub sim_edges: usize,
    pub apiservers: usize,
    /// Runtime of the `container` backend: `sim` or `linux`.
    pub runtime: String,
    pub state_dir: String,
    pub host_image: bool,
    pub disk_reserve_mb: i64,
    pub audit_dir: String,
    /// Also audit runtime calls and queries (`apiserver[].audit_runtime`).
    pub audit_runtime: bool,
    /// Listen address of the first apiserver (`127.0.0.1:0` picks a free port).
    pub addr: String,
    /// Simulated creation latency of the sim backends (median, ms) and its spread.
    pub create_latency_ms: f64,
    pub latency_sigma: f64,
    /// Placement's k override (1 = random placement).
    pub k: Option<usize>,
    /// Rates per principal; -1 disables the limit.
    pub create_rate: f64,
    pub request_rate: f64,
    /// IAM state file (empty = memory).
    pub iam_state: String,
    /// The shared image store (`image_store.root`); empty = `<state_dir>/images`, so the
    /// embedded cluster always has one.
    pub image_store: String,
    /// Sandbox networking on the generated linux edges (docs/network.md): edge `i` gets the
    /// subnet 10.(88+i).0.0/16 and DNS port 15353+i.
    pub network: bool,
    /// Listen address of the E2B gateway (docs/e2b.md); empty = no gateway.
    pub e2b_addr: String,
    /// `network.upstream_dns`: the resolvers the sandboxes' DNS proxy asks (empty = the
    /// host's).
    pub upstream_dns: Vec<String>,
    /// The guest kernel of the generated linux edges' `microvm` backend (runtime `qemu`,
    /// docs/microvm.md); empty = no microvm backend.
    pub microvm_kernel: String,
    /// Run with mutual TLS between the roles and TLS on the public port, with a CA and
    /// certificates in `<state_dir>/pki` (the CA is made once and kept; `cluster up -tls`).
    pub tls: bool,
}

impl Default for UpOptions {
    fn default() -> Self {
        UpOptions {
            sim_edges: 4,
            apiservers: 1,
            runtime: "sim".into(),
            state_dir: "/var/lib/opendsec".into(),
            host_image: true,
            disk_reserve_mb: 512,
            audit_dir: String::new(),
            audit_runtime: false,
            addr: "127.0.0.1:7100".into(),
            create_latency_ms: 0.0,
            latency_sigma: 0.0,
            k: None,
            create_rate: 0.0,
            request_rate: 0.0,
            iam_state: String::new(),
            image_store: String::new(),
            network: false,
            e2b_addr: String::new(),
            upstream_dns: Vec::new(),
            microvm_kernel: String::new(),
            tls: false,
        }
    }
}

/// A running local cluster.
pub struct LocalCluster {
    /// The effective config, with the bound addresses.
    pub cfg: Arc<Config>,
    /// Addresses of the apiservers.
    pub api_addrs: Vec<String>,
    /// The administrator's token.
    pub admin_token: String,
    /// Address of the E2B gateway, when one runs.
    pub e2b_addr: Option<String>,
    /// Stops every role but IAM (`down` stops IAM after them).
    pub shutdown: Shutdown,
    iam_shutdown: Shutdown,
    iam: JoinHandle<()>,
    handles: Vec<JoinHandle<()>>,
    readies: Vec<Ready>,
    /// One per role; dropped (shut down) once the roles have ended.
    runtimes: Vec<crate::rt::Dedicated>,
}

/// Starts a role on a runtime of its own: `start` gets `listener`, moved onto it. In one
/// process as in separate ones, one role's queue of work then cannot hold up another's
/// answers; above all, a burst of creations on the edge and in the apiserver cannot make the
/// watcher's probe of the edge time out (docs/architecture.md "Runtimes").
async fn on_own_runtime<F, Fut, E>(
    runtimes: &mut Vec<crate::rt::Dedicated>,
    role: &str,
    listener: TcpListener,
    start: F,
) -> Result<JoinHandle<()>, ClusterError>
where
    F: FnOnce(TcpListener) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = Result<JoinHandle<()>, E>> + Send + 'static,
    E: Into<ClusterError> + Send + 'static,
{
    let failed = |source: std::io::Error| ClusterError::Runtime {
        role: role.to_string(),
        source,
    };
    let rt = crate::rt::Dedicated::per_cpu(role).map_err(failed)?;
    let listener = listener.into_std().map_err(failed)?;
    let name = role.to_string();
    let started = rt
        .spawn(async move {
            let l = TcpListener::from_std(listener)
                .map_err(|source| ClusterError::Runtime { role: name, source })?;
            start(l).await.map_err(Into::into)
        })
        .await;
    runtimes.push(rt);
    started.map_err(|e| failed(std::io::Error::other(crate::types::chain(&e))))?
}

async fn bind(addr: &str, what: &str) -> Result<TcpListener, ClusterError> {
    TcpListener::bind(addr)
        .await
        .map_err(|source| ClusterError::Bind {
            what: what.to_string(),
            addr: addr.to_string(),
            source,
        })
}

fn local_addr(l: &TcpListener) -> String {
    l.local_addr().map(|a| a.to_string()).unwrap_or_default()
}

fn secret() -> String {
    hex::encode(rand::random::<[u8; 20]>())
}

/// The certificates of a generated cluster in `dir`: its CA (made on first use, then kept,
/// so callers' `OPENDSEC_CA` stays good across restarts), a fresh certificate for every
/// component (the apiservers' also for `127.0.0.1` and `localhost`), and `grant.key`.
fn local_pki(cfg: &Config, dir: &std::path::Path) -> Result<(), crate::pki::PkiError> {
    use crate::pki::{cluster, Ca};
    let ca = if dir.join(crate::pki::CA_KEY).exists() {
        Ca::load(dir)?
    } else {
        let ca = Ca::generate(3650)?;
        ca.save(dir)?;
        ca
    };
    let hosts = ["127.0.0.1".to_string(), "localhost".to_string()];
    cluster::issue_all(&ca, &cluster::components(cfg)?, &hosts, 365, dir)?;
    cluster::ensure_grant_key(dir)?;
    Ok(())
}

impl LocalCluster {
    /// Generates a config from `o`, binds every listener, and starts every role.
    pub async fn up(o: &UpOptions) -> Result<LocalCluster, ClusterError> {
        let linux = match o.runtime.as_str() {
            "sim" => false,
            "linux" => true,
            other => {
                return Err(ClusterError::Unsupported(format!(
                    "-runtime {other:?}: use sim or linux"
                )))
            }
        };
        std::fs::create_dir_all(&o.state_dir).map_err(|source| ClusterError::StateDir {
            path: o.state_dir.clone(),
            source,
        })?;
        let mut cfg = Config {
            service_token: secret(),
            ..Default::default()
        };
        cfg.image_store.root = if o.image_store.is_empty() {
            std::path::Path::new(&o.state_dir)
                .join("images")
                .display()
                .to_string()
        } else {
            o.image_store.clone()
        };
        let admin_token = format!("dsk.admin.{}", secret());
        cfg.iam.admin_token = admin_token.clone();
        cfg.iam.state = o.iam_state.clone();
        cfg.network.upstream_dns = o.upstream_dns.clone();
        cfg.network.upstream_dns()?;
        let iam_l = bind("127.0.0.1:0", "iam").await?;
        cfg.iam.addr = local_addr(&iam_l);
        let w_l = bind("127.0.0.1:0", "watcher").await?;
        cfg.watcher.addr = local_addr(&w_l);
        cfg.watcher.probe_interval = 0.25;
        cfg.watcher.reconcile_interval = 5.0;
        cfg.apiserver = Vec::new();
        let mut api_ls = Vec::new();
        for i in 0..o.apiservers.max(1) {
            let addr = if i == 0 {
                o.addr.clone()
            } else {
                "127.0.0.1:0".to_string()
            };
            let l = bind(&addr, "apiserver").await?;
            cfg.apiserver.push(ApiserverConfig {
                addr: local_addr(&l),
                audit_dir: o.audit_dir.clone(),
                audit_runtime: o.audit_runtime,
                snapshot_refresh: 0.25,
                ..Default::default()
            });
            api_ls.push(l);
        }
        cfg.admission.create_rate = o.create_rate;
        cfg.admission.request_rate = o.request_rate;
        let mut edge_ls = Vec::new();
        for i in 0..o.sim_edges.max(1) {
            let l = bind("127.0.0.1:0", "edge").await?;
            let sim = BackendConfig {
                runtime: "sim".into(),
                create_latency_ms: o.create_latency_ms,
                latency_sigma: o.latency_sigma,
                default_disk_mb: 1024,
                ..Default::default()
            };
            let mut backends = BTreeMap::new();
            backends.insert("sim".to_string(), sim.clone());
            if linux {
                let container = BackendConfig {
                    runtime: "linux".into(),
                    default_disk_mb: 1024,
                    ..Default::default()
                };
                backends.insert("container".to_string(), container);
                if !o.microvm_kernel.is_empty() {
                    let microvm = BackendConfig {
                        runtime: "qemu".into(),
                        kernel: o.microvm_kernel.clone(),
                        default_disk_mb: 1024,
                        ..Default::default()
                    };
                    backends.insert("microvm".to_string(), microvm);
                }
            } else {
                backends.insert("container".to_string(), sim);
            }
            let mut images = BTreeMap::new();
            if o.host_image {
                images.insert("host".to_string(), vec!["/".to_string()]);
            }
            // Simulated edges run nothing, so their capacity is a scheduling fiction sized
            // for benchmarks of tens of thousands of sandboxes.
            // Real containers are admitted against the host's own size (measured).
            let capacity = if linux {
                CapacityConfig::default()
            } else {
                CapacityConfig {
                    cpu_cores: 8192.0,
                    memory_mb: 64 << 20,
                    gpus: 0,
                    disk_mb: 64 << 20,
                }
            };
            cfg.edges.push(EdgeConfig {
                id: if linux {
                    format!("node-{i}")
                } else {
                    format!("sim-{i}")
                },
                addr: local_addr(&l),
                capacity,
                backends,
                images,
                state_dir: o.state_dir.clone(),
                disk_reserve_mb: o.disk_reserve_mb,
                mem_reserve_mb: if linux { 0 } else { -1 },
                persist_state: Some(linux),
                network: edge_network(linux && o.network, i)?,
                ..Default::default()
            });
            edge_ls.push(l);
        }
        let e2b_l = if o.e2b_addr.is_empty() {
            None
        } else {
            let l = bind(&o.e2b_addr, "e2b gateway").await?;
            cfg.e2b = local_e2b(&local_addr(&l), o.host_image);
            cfg.e2b.build_dir = std::path::Path::new(&o.state_dir)
                .join("e2b-builds")
                .display()
                .to_string();
            Some(l)
        };
        if o.tls {
            let dir = std::path::Path::new(&o.state_dir).join("pki");
            local_pki(&cfg, &dir).map_err(|source| ClusterError::Pki {
                path: dir.display().to_string(),
                source,
            })?;
            cfg.tls.dir = dir.display().to_string();
            cfg.service_token.clear();
        }
        cfg.validate()?;
        let ls = Listeners {
            iam: iam_l,
            watcher: w_l,
            apiservers: api_ls,
            edges: edge_ls,
            e2b: e2b_l,
        };
        Self::start(cfg, admin_token, ls, o.k).await
    }

    /// Starts every role of a config file in this process, on the configured addresses.
    pub async fn from_config(mut cfg: Config) -> Result<LocalCluster, ClusterError> {
        cfg.validate()?;
        let admin_token = cfg.iam.admin_token()?;
        let iam_l = bind(&cfg.iam.addr, "iam").await?;
        let waddr = cfg.watcher.addrs().first().cloned().unwrap_or_default();
        let w_l = bind(&waddr, "watcher").await?;
        let mut api_ls = Vec::new();
        for a in &cfg.apiserver {
            api_ls.push(bind(&a.addr, "apiserver").await?);
        }
        let mut edge_ls = Vec::new();
        for e in &cfg.edges {
            edge_ls.push(bind(&e.addr, &format!("edge {}", e.id)).await?);
        }
        // Addresses with port 0 become the bound ones, so the config printed is usable.
        cfg.iam.addr = local_addr(&iam_l);
        cfg.watcher.addr = local_addr(&w_l);
        cfg.watcher.replicas.clear();
        for (a, l) in cfg.apiserver.iter_mut().zip(&api_ls) {
            a.addr = local_addr(l);
        }
        for (e, l) in cfg.edges.iter_mut().zip(&edge_ls) {
            e.addr = local_addr(l);
        }
        // The first gateway of the config runs here; a cluster of processes runs the rest.
        let e2b_l = match cfg.e2b.gateways.first_mut() {
            None => None,
            Some(g) => {
                let l = bind(&g.addr, "e2b gateway").await?;
                g.addr = local_addr(&l);
                Some(l)
            }
        };
        let ls = Listeners {
            iam: iam_l,
            watcher: w_l,
            apiservers: api_ls,
            edges: edge_ls,
            e2b: e2b_l,
        };
        Self::start(cfg, admin_token, ls, None).await
    }

    async fn start(
        cfg: Config,
        admin_token: String,
        ls: Listeners,
        k: Option<usize>,
    ) -> Result<LocalCluster, ClusterError> {
        let Listeners {
            iam: iam_l,
            watcher: w_l,
            apiservers: api_ls,
            edges: edge_ls,
            e2b: e2b_l,
        } = ls;
        let cfg = Arc::new(cfg);
        let shutdown = Shutdown::new();
        // IAM stops last: edges release the leases of the sandboxes they stop on the way out.
        let iam_shutdown = Shutdown::new();
        let mut handles = Vec::new();
        let mut readies = Vec::new();
        let mut runtimes = Vec::new();
        let r = Ready::default();
        let iam = {
            let (cfg, sd, r) = (cfg.clone(), iam_shutdown.clone(), r.clone());
            on_own_runtime(&mut runtimes, "iam", iam_l, move |l| {
                crate::roles::iam::start(cfg, l, sd, r)
            })
            .await?
        };
        readies.push(r);
        for (e, l) in cfg.edges.clone().iter().zip(edge_ls) {
            let r = Ready::default();
            let (cfg, id, sd, r2) = (cfg.clone(), e.id.clone(), shutdown.clone(), r.clone());
            handles.push(
                on_own_runtime(&mut runtimes, "edge", l, move |l| {
                    crate::roles::edge::start(cfg, id, l, sd, r2)
                })
                .await?,
            );
            readies.push(r);
        }
        let r = Ready::default();
        {
            let (cfg, sd, r) = (cfg.clone(), shutdown.clone(), r.clone());
            handles.push(
                on_own_runtime(&mut runtimes, "watcher", w_l, move |l| {
                    crate::roles::watcher::start(cfg, crate::roles::watcher::WATCHER_ID, l, sd, r)
                })
                .await?,
            );
        }
        readies.push(r);
        let mut api_addrs = Vec::new();
        for (i, l) in api_ls.into_iter().enumerate() {
            api_addrs.push(local_addr(&l));
            let r = Ready::default();
            let (cfg, sd, r2) = (cfg.clone(), shutdown.clone(), r.clone());
            handles.push(
                on_own_runtime(&mut runtimes, "apiserver", l, move |l| {
                    crate::roles::apiserver::start_with(cfg, i, l, sd, r2, k)
                })
                .await?,
            );
            readies.push(r);
        }
        let mut e2b_addr = None;
        if let Some(l) = e2b_l {
            e2b_addr = Some(local_addr(&l));
            let r = Ready::default();
            let (cfg, sd, r2) = (cfg.clone(), shutdown.clone(), r.clone());
            handles.push(
                on_own_runtime(&mut runtimes, "e2b", l, move |l| {
                    crate::roles::e2b::start(cfg, 0, l, sd, r2)
                })
                .await?,
            );
            readies.push(r);
        }
        let c = LocalCluster {
            cfg,
            api_addrs,
            admin_token,
            e2b_addr,
            shutdown,
            iam_shutdown,
            iam,
            handles,
            readies,
            runtimes,
        };
        c.wait_ready(30).await?;
        Ok(c)
    }

    /// Waits until every role reports ready and the watcher has seen every edge.
    pub async fn wait_ready(&self, secs: u64) -> Result<(), ClusterError> {
        let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(secs);
        loop {
            if self.readies.iter().all(|r| r.get()) {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                return Err(ClusterError::NotReady(secs));
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// A readiness flag that is true while every role is ready.
    pub fn all_ready(&self) -> bool {
        self.readies.iter().all(|r| r.get())
    }

    /// Stops every role and waits for them; IAM last, so that edges can release the leases
    /// of the sandboxes they stop.
    pub async fn down(self) {
        self.shutdown.fire();
        for h in self.handles {
            let _ = tokio::time::timeout(std::time::Duration::from_secs(10), h).await;
        }
        self.iam_shutdown.fire();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(10), self.iam).await;
        drop(self.runtimes);
    }
}

/// The listeners of every role, bound before any role starts.
struct Listeners {
    iam: TcpListener,
    watcher: TcpListener,
    apiservers: Vec<TcpListener>,
    edges: Vec<TcpListener>,
    e2b: Option<TcpListener>,
}

/// The image of E2B's code interpreter template, as packaging/code-interpreter/build.sh
/// builds it and the docs import it (docs/e2b.md "Code interpreter").
pub const CODE_INTERPRETER_IMAGE: &str = "root/code-interpreter:v1";

/// The generated cluster's E2B gateway: sandboxes in the root project; template `base` is
/// the development image `host` when it is offered; `code-interpreter-v1` runs our code
/// interpreter server from [`CODE_INTERPRETER_IMAGE`] (a creation fails with the image's
/// `not_found` until it is imported).
fn local_e2b(addr: &str, host_image: bool) -> crate::config::E2bConfig {
    let mut templates = BTreeMap::new();
    templates.insert(
        "code-interpreter-v1".to_string(),
        crate::config::E2bTemplate {
            image: CODE_INTERPRETER_IMAGE.into(),
            backend: "container".into(),
            cpu: 1.0,
            memory_mb: 1024,
            start_cmd:
                "exec /opt/code-interpreter/venv/bin/python /opt/code-interpreter/server.py \
                        --port 49999 --cwd /home/user"
                    .into(),
            ready_port: 49999,
            ready_timeout_s: 60,
            ..Default::default()
        },
    );
    if host_image {
        templates.insert(
            "base".to_string(),
            crate::config::E2bTemplate {
                image: "host".into(),
                backend: "container".into(),
                cpu: 1.0,
                memory_mb: 512,
                ..Default::default()
            },
        );
    }
    crate::config::E2bConfig {
        gateways: vec![crate::config::E2bGateway {
            addr: addr.to_string(),
            ..Default::default()
        }],
        project: "root".into(),
        templates,
        ..Default::default()
    }
}

/// The network settings of generated edge `i`: distinct subnets and DNS ports, so that the
/// edges of one machine never take each other's addresses or veths.
// Returned once, at start, like the cluster's other start errors.
#[allow(clippy::result_large_err)]
fn edge_network(on: bool, i: usize) -> Result<crate::config::EdgeNetworkConfig, ClusterError> {
    if !on {
        return Ok(Default::default());
    }
    let second = u8::try_from(88 + i).map_err(|_| {
        ClusterError::Unsupported(format!("-network: at most 168 edges, not {}", i + 1))
    })?;
    Ok(crate::config::EdgeNetworkConfig {
        enabled: true,
        subnet: format!("10.{second}.0.0/16"),
        dns_port: 15353 + i as u16,
    })
}
