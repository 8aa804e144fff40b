//! The edge role: the node control plane (docs/architecture.md). Final admission, the sandbox
//! state machine, TTLs, durable records and re-adoption, lease release, reporting to the
//! watchers, and forwarding of runtime calls to the sandbox's agent. It serves
//! `opendsec.v1.Edge` and `opendsec.v1.Runtime` on one listener.
//!
//! Files: `create` (CreateSandboxes), `ops` (the other calls), `rules` (UpdateNetwork),
//! `machine` (states), `admission` (capacity and pressure), `ttl`, `record` and `store`
//! (persistence), `recover` (startup), `leases` (IAM), `host` (/proc), `status`, `loops`,
//! `metrics`, `service` and `runtime` (gRPC).

mod admission;
mod create;
pub mod freed;
mod host;
mod leases;
mod loops;
mod machine;
mod metrics;
mod node;
mod ops;
mod pack;
mod record;
mod recover;
mod rules;
mod runtime;
mod service;
mod snapshot;
mod status;
mod store;
mod ttl;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use crate::backends::{self, Backend, BackendContext, BackendError};
use crate::config::{Config, ConfigError};
use crate::pb;
use crate::rpc;
use crate::shutdown::Shutdown;
use crate::telemetry::Ready;

pub use leases::{BatchConfig, IamLeases, LeaseSink, ReleaseItem, Releaser};
pub use record::SandboxRecord;
pub use recover::RecoverReport;
pub use runtime::{Forwarded, SandboxScoped};
pub use store::{EdgeFlagsState, Store, StoreError};

/// How long shutdown keeps trying to release queued leases.
const RELEASE_FLUSH: Duration = Duration::from_secs(5);

/// Why the edge could not start.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error("edge {0:?} is neither in `edges` nor covered by `edge_template`")]
    UnknownEdge(String),
    #[error("edge {edge_id}: TLS")]
    Tls {
        edge_id: String,
        source: crate::rpc::tls::TlsError,
    },
    #[error("edge {edge_id}: TLS settings")]
    Serve {
        edge_id: String,
        source: tonic::transport::Error,
    },
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("building backend {name}")]
    Backend { name: String, source: BackendError },
    #[error("edge {edge_id}: sandbox records")]
    Store { edge_id: String, source: StoreError },
    #[error("edge {edge_id}: IAM client")]
    Client {
        edge_id: String,
        source: rpc::client::ClientError,
    },
    #[error("edge {edge_id}: listener")]
    Listener {
        edge_id: String,
        source: std::io::Error,
    },
    #[error("edge {edge_id}: sandbox networking")]
    Network {
        edge_id: String,
        source: Box<crate::netpol::network::NetworkError>,
    },
    #[error("edge {edge_id}: sandbox DNS")]
    Dns {
        edge_id: String,
        source: crate::netpol::dns::DnsProxyError,
    },
    #[error("edge {edge_id}: starting the runtime of its operations")]
    Runtime {
        edge_id: String,
        source: std::io::Error,
    },
}

/// Starts edge `edge_id` with the backends of its config (`cfg.edge(&edge_id)`: its entry
/// in `edges`, else `edge_template`). Recovers recorded sandboxes before serving, serves
/// Edge and Runtime on `listener` until `shutdown` fires, then (without
/// `keep_sandboxes_on_exit`) stops the sandboxes of real backends and flushes lease
/// releases. The returned task ends when all of that is done.
pub async fn start(
    cfg: Arc<Config>,
    edge_id: String,
    listener: tokio::net::TcpListener,
    shutdown: Shutdown,
    ready: Ready,
) -> Result<tokio::task::JoinHandle<()>, EdgeError> {
    let ec = cfg
        .edge(&edge_id)
        .ok_or_else(|| EdgeError::UnknownEdge(edge_id.clone()))?;
    ec.validate()?;
    let network = network(&cfg, &ec, &edge_id)?;
    // The proxy before any sandbox: a recovered one resolves again at once.
    let dns = match &network {
        Some(net) => Some(
            crate::netpol::dns::DnsProxy::start(
                net.clone(),
                ec.network.dns_port(),
                &crate::netpol::dns::Upstream::from_config(cfg.network.upstream_dns()?),
            )
            .await
            .map_err(|source| EdgeError::Dns {
                edge_id: edge_id.clone(),
                source,
            })?,
        ),
        None => None,
    };
    let ctx = context(&cfg, &ec, &edge_id, network);
    let mut built = BTreeMap::new();
    for (name, bc) in ec.backends() {
        let b = backends::build(&name, &bc, &ctx).map_err(|source| EdgeError::Backend {
            name: name.clone(),
            source,
        })?;
        built.insert(name, b);
    }
    let serving = start_with_backends(cfg, edge_id, built, listener, shutdown, ready).await?;
    Ok(tokio::spawn(async move {
        let _ = serving.await;
        // After the backends let go of their sandboxes: they resolve until then.
        if let Some(d) = dns {
            d.stop().await;
        }
    }))
}

/// The edge's sandbox networking, when `edges[].network.enabled` and a backend runs real
/// sandboxes (a simulated one has no network to set up).
// Returned once, at start, like `start`'s own error.
#[allow(clippy::result_large_err)]
fn network(
    cfg: &Config,
    ec: &crate::config::EdgeConfig,
    edge_id: &str,
) -> Result<Option<Arc<crate::netpol::network::Network>>, EdgeError> {
    if !ec.network.enabled || ec.backends().values().all(|b| b.runtime() == "sim") {
        return Ok(None);
    }
    let net = crate::netpol::network::Network::start(
        edge_id,
        ec.network.subnet()?,
        ec.network.dns_port(),
        cfg.network.rules()?,
    )
    .map_err(|source| EdgeError::Network {
        edge_id: edge_id.to_string(),
        source: Box::new(source),
    })?;
    Ok(Some(Arc::new(net)))
}

fn context(
    cfg: &Config,
    ec: &crate::config::EdgeConfig,
    edge_id: &str,
    network: Option<Arc<crate::netpol::network::Network>>,
) -> BackendContext {
    let agent_dir = if ec.agent_dir.is_empty() {
        std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(PathBuf::from))
            .unwrap_or_default()
    } else {
        PathBuf::from(&ec.agent_dir)
    };
    BackendContext {
        edge_id: edge_id.to_string(),
        state_dir: PathBuf::from(ec.state_dir()),
        agent_dir,
        images: ec
            .images
            .iter()
            .map(|(k, v)| (k.clone(), v.iter().map(PathBuf::from).collect()))
            .collect(),
        image_store: Some(&cfg.image_store.root)
            .filter(|r| !r.is_empty())
            .map(PathBuf::from),
        network,
    }
}

/// As `start`, with backends built by the caller (tests, and backends with capabilities the
/// factory does not build yet). Backend names must match the edge config's `backends`
/// where limits (`max_sandboxes`, `default_disk_mb`) are wanted.
pub async fn start_with_backends(
    cfg: Arc<Config>,
    edge_id: String,
    backends: BTreeMap<String, Arc<dyn Backend>>,
    listener: tokio::net::TcpListener,
    shutdown: Shutdown,
    ready: Ready,
) -> Result<tokio::task::JoinHandle<()>, EdgeError> {
    let ec = cfg
        .edge(&edge_id)
        .ok_or_else(|| EdgeError::UnknownEdge(edge_id.clone()))?;
    ec.validate()?;
    let tls_err = |source| EdgeError::Tls {
        edge_id: edge_id.clone(),
        source,
    };
    let me = crate::pki::Identity::new(crate::pki::Role::Edge, &edge_id).map_err(|e| {
        tls_err(crate::rpc::tls::TlsError::Bad {
            path: cfg.tls.dir.clone().into(),
            why: e.to_string(),
        })
    })?;
    let tls = crate::rpc::tls::for_component(&cfg, &me).map_err(tls_err)?;
    let mut builder =
        rpc::serve::builder(tls.as_deref(), crate::rpc::acl::Policy::Edge).map_err(|source| {
            EdgeError::Serve {
                edge_id: edge_id.clone(),
                source,
            }
        })?;
    let dialer = crate::rpc::client::Dialer::new(tls).map_err(tls_err)?;
    let local = listener
        .local_addr()
        .map_err(|source| EdgeError::Listener {
            edge_id: edge_id.clone(),
            source,
        })?;
    let addr = if ec.advertise.is_empty() {
        local.to_string()
    } else {
        ec.advertise.clone()
    };
    let configured = ec.backends();
    let real = backends.values().any(|b| !b.simulated());
    let persist = ec.persist_state.unwrap_or(real);
    let state_dir = PathBuf::from(ec.state_dir());
    let store = if persist {
        Some(
            Store::open(&state_dir, &edge_id).map_err(|source| EdgeError::Store {
                edge_id: edge_id.clone(),
                source,
            })?,
        )
    } else {
        None
    };
    let sink: Arc<dyn LeaseSink> = Arc::new(
        IamLeases::new(&cfg.iam.addrs(), &cfg.service_token, &dialer).map_err(|source| {
            EdgeError::Client {
                edge_id: edge_id.clone(),
                source,
            }
        })?,
    );
    let (releaser, releaser_task) = Releaser::spawn(sink.clone(), BatchConfig::default());
    let slots = backends
        .into_iter()
        .map(|(name, backend)| {
            let bc = configured.get(&name).cloned().unwrap_or_default();
            (
                name,
                node::Slot {
                    backend,
                    max_sandboxes: bc.max_sandboxes.max(0),
                    default_disk_mb: bc.default_disk_mb(),
                },
            )
        })
        .collect();
    let mut probe = host::HostProbe::new("/proc", state_dir.clone());
    let (probe_back, first) = tokio::task::spawn_blocking(move || {
        let s = probe.sample();
        (probe, s)
    })
    .await
    .map_err(|e| EdgeError::Listener {
        edge_id: edge_id.clone(),
        source: std::io::Error::other(crate::types::chain(&e)),
    })?;
    probe = probe_back;
    let core = Arc::new(node::Core {
        edge_id: edge_id.clone(),
        addr,
        service_token: cfg.service_token.clone(),
        dialer,
        watchers: cfg.watcher.addrs(),
        slots,
        entries: Mutex::new(Default::default()),
        alloc: Mutex::new(Default::default()),
        host: RwLock::new(first),
        capacity: RwLock::new(Default::default()),
        reserves: RwLock::new(Default::default()),
        draining: AtomicBool::new(false),
        drain_lock: tokio::sync::Mutex::new(()),
        store,
        leases: sink,
        releaser: releaser.clone(),
        paused_mem_charge: ec.paused_mem_charge.unwrap_or(1.0),
        retention: ec.stopped_retention().ceil() as i64,
        lease_checks: tokio::sync::Semaphore::new(64),
        real,
        incarnation: hex::encode(rand::random::<[u8; 8]>()),
        image_store: Some(&cfg.image_store.root)
            .filter(|r| !r.is_empty())
            .map(PathBuf::from),
        cfg: ec.clone(),
    });
    loops::sample_into(&core, first);
    core.recover().await.map_err(|source| EdgeError::Store {
        edge_id: edge_id.clone(),
        source,
    })?;

    let work = Arc::new(
        crate::rt::Dedicated::per_cpu("edge-work").map_err(|source| EdgeError::Runtime {
            edge_id: edge_id.clone(),
            source,
        })?,
    );
    let loop_tasks = loops::spawn(core.clone(), probe, shutdown.clone());
    let router = builder
        .add_service(
            pb::edge_server::EdgeServer::new(service::EdgeService {
                core: core.clone(),
                work: work.clone(),
            })
            .max_decoding_message_size(rpc::MAX_MESSAGE)
            .max_encoding_message_size(rpc::MAX_MESSAGE),
        )
        .add_service(
            pb::runtime_server::RuntimeServer::new(runtime::EdgeRuntime { core: core.clone() })
                .max_decoding_message_size(rpc::MAX_MESSAGE)
                .max_encoding_message_size(rpc::MAX_MESSAGE),
        );
    ready.set(true, "edge");
    tracing::info!(edge_id = %edge_id, addr = %core.addr, listen = %local, backends = ?core.slots.keys().collect::<Vec<_>>(), persist, "edge serving");
    let keep = ec.keep_sandboxes_on_exit;
    Ok(tokio::spawn(async move {
        if let Err(e) = rpc::serve::serve(router, listener, shutdown.clone()).await {
            tracing::error!(edge_id = %core.edge_id, error = %crate::types::chain(&e), "edge server failed");
            shutdown.fire();
        }
        ready.set(false, "edge");
        for t in loop_tasks {
            let _ = t.await;
        }
        if !keep {
            core.stop_all_real().await;
        }
        for (name, slot) in &core.slots {
            if let Err(e) = slot.backend.release_node().await {
                tracing::warn!(edge_id = %core.edge_id, backend = %name, error = %e, "releasing the node's backend state");
            }
        }
        let left = releaser.close(RELEASE_FLUSH).await;
        let _ = releaser_task.await;
        // Operations still running there are dropped with it; the caller's retry after a
        // restart finds their records.
        drop(work);
        tracing::info!(edge_id = %core.edge_id, leases_left = left, "edge stopped");
    }))
}

#[cfg(test)]
mod tests;
