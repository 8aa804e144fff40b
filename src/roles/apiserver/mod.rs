//! The apiserver role (docs/architecture.md): the cluster's only entry. It authenticates and
//! authorizes through IAM (cached), admits, places, creates on edges, forwards lifecycle and
//! runtime calls to the edge named in the sandbox id, and forwards IAM management calls with
//! the caller's own token. It keeps no state of its own: any apiserver serves any request.

pub mod admission;
mod audit;
mod auth;
mod create;
mod edges;
mod fork;
mod forward;
mod images;
mod memsnap;
pub mod placement;
mod service;

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{RwLock, Semaphore};

use crate::config::Config;
use crate::pb;
use crate::shutdown::Shutdown;
use crate::telemetry::Ready;
use crate::types::now_s;

/// Starting an apiserver failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiserverError {
    #[error("apiserver: no entry {0} in the config's apiserver list")]
    NoEntry(usize),
    #[error("apiserver: IAM address")]
    Client(#[from] crate::rpc::client::ClientError),
    #[error("apiserver: audit log")]
    Audit(#[from] audit::AuditError),
    #[error("apiserver: image store")]
    Images(#[from] crate::images::store::StoreError),
    #[error("apiserver: network rules")]
    Network(#[from] crate::config::ConfigError),
    #[error("apiserver: TLS")]
    Tls(#[from] crate::rpc::tls::TlsError),
    #[error("apiserver: TLS settings")]
    Serve(#[from] tonic::transport::Error),
    #[error("apiserver: reading the sandbox access token key")]
    GrantKey(#[source] std::io::Error),
}

/// Shared state of one apiserver.
pub(crate) struct Inner {
    pub cfg: Arc<Config>,
    pub auth: Arc<auth::AuthCache>,
    pub iam: pb::iam_client::IamClient<crate::rpc::failover::IamChannel>,
    pub snapshot: RwLock<Arc<pb::Snapshot>>,
    /// How this apiserver reaches IAM, the watchers and the edges.
    pub dialer: crate::rpc::client::Dialer,
    pub snapshot_at: std::sync::atomic::AtomicI64,
    pub overlay: Mutex<placement::Overlay>,
    pub params: placement::Params,
    pub calls: admission::Limiter,
    pub creates: admission::Limiter,
    pub inflight: Option<Arc<Semaphore>>,
    pub edges: edges::EdgeClients,
    pub audit: Option<audit::Audit>,
    pub audit_runtime: bool,
    /// Sandbox id → its project and creator, so operations need not ask the edge first.
    /// Neither ever changes for an id.
    pub owners: Mutex<std::collections::HashMap<String, forward::Owner>>,
    /// The shared image store (`image_store.root`), when the cluster has one.
    pub images: Option<Arc<crate::images::store::Store>>,
    /// Placement draws k candidates; `random` (k = 1) is the `bench -compare` baseline.
    pub k: usize,
    /// The config's rule sets and default rules, parsed once, to check `network_rules`.
    pub net_rules: crate::netpol::ClusterRules,
}

/// Serves the public DSec service for entry `index` of `cfg.apiserver` on `listener`.
/// Ready while IAM and a watcher snapshot have answered within the last 15 s.
pub async fn start(
    cfg: Arc<Config>,
    index: usize,
    listener: TcpListener,
    shutdown: Shutdown,
    ready: Ready,
) -> Result<tokio::task::JoinHandle<()>, ApiserverError> {
    start_with(cfg, index, listener, shutdown, ready, None).await
}

/// As `start`, with the placement `k` overridden (benchmarks).
pub async fn start_with(
    cfg: Arc<Config>,
    index: usize,
    listener: TcpListener,
    shutdown: Shutdown,
    ready: Ready,
    k: Option<usize>,
) -> Result<tokio::task::JoinHandle<()>, ApiserverError> {
    let entry = cfg.apiserver.get(index).cloned().unwrap_or_default();
    if !cfg.apiserver.is_empty() && index >= cfg.apiserver.len() {
        return Err(ApiserverError::NoEntry(index));
    }
    let me = crate::pki::Identity::new(crate::pki::Role::Apiserver, &index.to_string()).map_err(
        |e| crate::rpc::tls::TlsError::Bad {
            path: cfg.tls.dir.clone().into(),
            why: e.to_string(),
        },
    )?;
    let tls = crate::rpc::tls::for_component(&cfg, &me)?;
    let builder = crate::rpc::serve::builder(tls.as_deref(), crate::rpc::acl::Policy::Public)?;
    let dialer = crate::rpc::client::Dialer::new(tls)?;
    let ch = dialer.failover(
        &cfg.iam.addrs(),
        Duration::from_secs(2),
        crate::pki::Role::Iam,
        crate::rpc::failover::IAM_PATIENCE,
    )?;
    let iam = pb::iam_client::IamClient::new(ch)
        .max_decoding_message_size(crate::rpc::MAX_MESSAGE)
        .max_encoding_message_size(crate::rpc::MAX_MESSAGE);
    let grants = crate::rpc::grant::GrantKey::for_config(&cfg).map_err(ApiserverError::GrantKey)?;
    let auth = Arc::new(auth::AuthCache::new(
        iam.clone(),
        cfg.service_token.clone(),
        grants,
    ));
    let audit = if entry.audit_dir.is_empty() {
        None
    } else {
        Some(audit::Audit::open(
            &entry.audit_dir,
            entry.audit_max_mb(),
            entry.audit_keep(),
        )?)
    };
    let images = if cfg.image_store.root.is_empty() {
        None
    } else {
        let root = std::path::Path::new(&cfg.image_store.root);
        Some(Arc::new(crate::images::store::Store::open(root)?))
    };
    let net_rules = cfg.network.rules()?;
    let adm = &cfg.admission;
    let params = placement::Params::from_config(&cfg.placement);
    let inner = Arc::new(Inner {
        auth: auth.clone(),
        iam,
        snapshot: RwLock::new(Arc::new(pb::Snapshot::default())),
        snapshot_at: std::sync::atomic::AtomicI64::new(0),
        overlay: Mutex::new(placement::Overlay::default()),
        k: k.unwrap_or(params.k),
        params,
        calls: admission::Limiter::new(adm.request_rate(), adm.request_burst()),
        creates: admission::Limiter::new(adm.create_rate(), adm.create_burst()),
        inflight: adm
            .max_inflight_creates()
            .map(|n| Arc::new(Semaphore::new(n))),
        edges: edges::EdgeClients::new(cfg.service_token.clone(), dialer.clone()),
        dialer,
        audit,
        audit_runtime: entry.audit_runtime,
        owners: Mutex::new(std::collections::HashMap::new()),
        images,
        net_rules,
        cfg: cfg.clone(),
    });

    let e = tokio::spawn(auth.clone().epoch_loop(shutdown.clone()));
    let s = tokio::spawn(snapshot_loop(
        inner.clone(),
        entry.snapshot_refresh(),
        shutdown.clone(),
        ready.clone(),
    ));
    let svc = pb::d_sec_server::DSecServer::from_arc(Arc::new(service::Api {
        inner: inner.clone(),
    }))
    .max_decoding_message_size(crate::rpc::MAX_MESSAGE)
    .max_encoding_message_size(crate::rpc::MAX_MESSAGE);
    // One span per request, like IAM's and the edge's: the method now, the principal
    // once authenticated, the project and sandbox once the call names them (Api::finish).
    let router = builder
        .trace_fn(|req| {
            let method = req.uri().path().rsplit('/').next().unwrap_or_default();
            tracing::info_span!(
                "apiserver",
                method = %method,
                principal = tracing::field::Empty,
                project = tracing::field::Empty,
                sandbox_id = tracing::field::Empty
            )
        })
        .add_service(svc);
    let sd = shutdown.clone();
    Ok(tokio::spawn(async move {
        if let Err(err) = crate::rpc::serve::serve(router, listener, sd).await {
            tracing::error!(error = %crate::types::chain(&err), "apiserver failed");
        }
        ready.set(false, "apiserver");
        let _ = e.await;
        let _ = s.await;
    }))
}

/// Fetches the cluster snapshot from the watchers every `every` seconds (the first that
/// answers); keeps the last one when none does. Also drives readiness.
async fn snapshot_loop(inner: Arc<Inner>, every: f64, shutdown: Shutdown, ready: Ready) {
    let addrs = inner.cfg.watcher.addrs();
    let clients: Vec<_> = addrs
        .iter()
        .filter_map(|a| {
            inner
                .dialer
                .channel(a, Duration::from_secs(2), crate::pki::Role::Watcher)
                .ok()
        })
        .map(|c| {
            pb::watcher_client::WatcherClient::new(c)
                .max_decoding_message_size(crate::rpc::MAX_MESSAGE)
        })
        .collect();
    let mut first = 0usize;
    loop {
        let n = clients.len();
        for (i, c) in clients.iter().cycle().skip(first).take(n).enumerate() {
            let mut c = c.clone();
            let mut req = crate::rpc::client::internal(
                pb::GetSnapshotRequest { min_version: 0 },
                &inner.cfg.service_token,
            );
            req.set_timeout(Duration::from_secs(2));
            match c.get_snapshot(req).await {
                Ok(r) => {
                    let snap = r.into_inner();
                    if snap.version > 0 {
                        inner
                            .overlay
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .observe(&snap);
                        inner.edges.learn(&snap);
                        *inner.snapshot.write().await = Arc::new(snap);
                        inner.snapshot_at.store(now_s(), Ordering::Relaxed);
                    }
                    first = (first + i) % clients.len();
                    break;
                }
                Err(s) => tracing::debug!(error = %s.message(), "snapshot fetch failed"),
            }
        }
        inner
            .overlay
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .expire(inner.params.overlay_grace);
        let now = now_s();
        let ok = now - inner.snapshot_at.load(Ordering::Relaxed) <= 15
            && now - inner.auth.last_iam_ok.load(Ordering::Relaxed) <= 15;
        ready.set(ok, "apiserver");
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_secs_f64(every)) => {},
            _ = shutdown.wait() => return,
        }
    }
}
