//! The watcher role (docs/architecture.md, docs/watcher.md): probes every edge each
//! `probe_interval`, serves a versioned cluster snapshot to the apiservers, accepts edge
//! registrations, and drives quota reconciliation with IAM. It keeps no durable state: after
//! a restart its view is rebuilt from the config's edge list, the edges' registrations and
//! probing. Several may run (`watcher.replicas`): all probe and serve snapshots, and only the
//! holder of IAM's reconciliation lock reconciles (see [`lock`]).

pub mod lock;
mod probe;
mod reconcile;
mod service;

use std::collections::BTreeMap;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::RwLock;

use crate::config::Config;
use crate::pb;
use crate::shutdown::Shutdown;
use crate::telemetry::Ready;

/// Starting the watcher failed.
#[derive(Debug, thiserror::Error)]
pub enum WatcherError {
    #[error("watcher: IAM address")]
    IamClient(#[from] crate::rpc::client::ClientError),
    #[error("watcher: TLS")]
    Tls(#[from] crate::rpc::tls::TlsError),
    #[error("watcher: TLS settings")]
    Serve(#[from] tonic::transport::Error),
}

/// The identity of a single watcher (no `watcher.replicas`) in its certificate
/// (docs/tls.md "Identities").
pub const WATCHER_ID: &str = "0";

/// What the watcher knows of one edge.
#[derive(Debug, Clone, Default)]
pub(crate) struct EdgeEntry {
    pub addr: String,
    pub state: pb::EdgeState,
    pub failures: u32,
    pub healthy: bool,
    /// Unix seconds when the edge last turned unhealthy (0 while healthy).
    pub unhealthy_since: f64,
}

/// Shared state of the watcher's tasks.
pub(crate) struct Inner {
    pub cfg: Arc<Config>,
    pub edges: RwLock<BTreeMap<String, EdgeEntry>>,
    pub snapshot: RwLock<Arc<pb::Snapshot>>,
    /// How the watcher reaches IAM and the edges (mTLS when `tls.dir` is set).
    pub dialer: crate::rpc::client::Dialer,
    /// Whether this watcher holds the reconciliation lock.
    pub leadership: Arc<lock::Leadership>,
}

/// Serves the Watcher service on `listener` as watcher `id` (an entry of
/// `watcher.replicas`, else [`WATCHER_ID`]) and spawns the probe, lock and reconcile loops.
/// Ready once the first probe round has produced a snapshot.
pub async fn start(
    cfg: Arc<Config>,
    id: &str,
    listener: TcpListener,
    shutdown: Shutdown,
    ready: Ready,
) -> Result<tokio::task::JoinHandle<()>, WatcherError> {
    let me = crate::pki::Identity::new(crate::pki::Role::Watcher, id).map_err(|e| {
        crate::rpc::tls::TlsError::Bad {
            path: cfg.tls.dir.clone().into(),
            why: e.to_string(),
        }
    })?;
    let tls = crate::rpc::tls::for_component(&cfg, &me)?;
    let mut builder = crate::rpc::serve::builder(tls.as_deref(), crate::rpc::acl::Policy::Watcher)?;
    let dialer = crate::rpc::client::Dialer::new(tls)?;
    let mut edges = BTreeMap::new();
    for e in &cfg.edges {
        if !e.addr.is_empty() {
            let addr = if e.advertise.is_empty() {
                e.addr.clone()
            } else {
                e.advertise.clone()
            };
            edges.insert(
                e.id.clone(),
                EdgeEntry {
                    addr,
                    ..Default::default()
                },
            );
        }
    }
    let inner = Arc::new(Inner {
        cfg: cfg.clone(),
        edges: RwLock::new(edges),
        snapshot: RwLock::new(Arc::new(pb::Snapshot::default())),
        dialer: dialer.clone(),
        leadership: Arc::new(lock::Leadership::default()),
    });
    let iam = pb::iam_client::IamClient::new(dialer.failover(
        &cfg.iam.addrs(),
        std::time::Duration::from_secs(2),
        crate::pki::Role::Iam,
        crate::rpc::failover::IAM_PATIENCE,
    )?);

    let p = tokio::spawn(probe::run(inner.clone(), shutdown.clone(), ready.clone()));
    // Tagged per process: two processes started with one id (a mistake, or a restart
    // overlapping the old process) never renew each other's hold.
    let holder = format!("{}/{}#{:08x}", me.role, me.id, rand::random::<u32>());
    let l = tokio::spawn(lock::run(
        inner.leadership.clone(),
        iam.clone(),
        holder.clone(),
        std::time::Duration::from_secs_f64(cfg.watcher.lock_ttl()),
        cfg.service_token.clone(),
        shutdown.clone(),
    ));
    let unlock_with = iam.clone();
    let r = tokio::spawn(reconcile::run(inner.clone(), iam, shutdown.clone()));
    let svc = pb::watcher_server::WatcherServer::new(service::WatcherService {
        inner: inner.clone(),
    });
    let router = builder.add_service(svc);
    let sd = shutdown.clone();
    Ok(tokio::spawn(async move {
        if let Err(e) = crate::rpc::serve::serve(router, listener, sd).await {
            tracing::error!(error = %crate::types::chain(&e), "watcher server failed");
        }
        ready.set(false, "watcher");
        let _ = p.await;
        let _ = r.await;
        let _ = l.await;
        lock::release(
            &inner.leadership,
            unlock_with,
            holder,
            &inner.cfg.service_token,
        )
        .await;
    }))
}
