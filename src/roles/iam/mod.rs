//! The iam role (docs/concepts.md, docs/architecture.md): projects, principals, tokens, permissions, quotas,
//! quota leases and usage, standalone: state in memory, or durable in `cfg.iam.state`.
//!
//! State changes only through deterministic [`command::Command`]s applied by
//! [`apply::apply`]; [`store::Store`] group-commits them to a log next to the state file, and
//! [`service::IamService`] serves iam.proto's `Iam` service over it.
//!
//! Failed-authentication limit: a locked-out address gets `rate_limited` for new tokens
//! (see [`limiter`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use crate::config::Config;
use crate::shutdown::Shutdown;
use crate::telemetry::Ready;

pub mod apply;
pub mod apply_kv;
mod apply_leases;
mod apply_principals;
mod backing;
pub mod backup;
pub mod command;
pub mod limiter;
pub mod raftlog;
pub mod replica;
pub mod replicated;
pub mod service;
mod service_internal;
mod service_kv;
mod service_mgmt;
pub mod state;
pub mod store;
pub mod tokens;
pub mod usage;
pub mod views;

#[cfg(test)]
mod testutil;

pub use backing::IamStore;
pub use service::IamService;
pub use store::{Store, StoreOptions};

/// How long in-flight calls may take to finish after shutdown fires.
const DRAIN: Duration = Duration::from_secs(10);

/// Why the iam role could not start or keep its state.
#[derive(Debug, thiserror::Error)]
pub enum IamError {
    #[error("{what} {}", path.display())]
    Io {
        what: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("reading snapshot {}", path.display())]
    Snapshot {
        path: PathBuf,
        source: serde_json::Error,
    },
    #[error("log {} line {line}: {message}", path.display())]
    Log {
        path: PathBuf,
        line: usize,
        message: String,
    },
    #[error("state {} is in use by another IAM (its log is locked)", path.display())]
    Locked { path: PathBuf },
    #[error("iam config: {0}")]
    Config(String),
    #[error("bootstrapping IAM: {0}")]
    Bootstrap(crate::types::Failure),
    #[error("opening the IAM store: {0}")]
    Task(String),
    #[error("iam: TLS")]
    Tls(#[from] crate::rpc::tls::TlsError),
    #[error("iam: TLS settings")]
    Serve(#[from] tonic::transport::Error),
    #[error("iam: starting the replica")]
    Replica(#[source] Box<replica::ReplicaError>),
}

/// A built IAM: the service to serve and the store under it (close it after serving).
pub struct Iam {
    pub service: IamService,
    pub store: Store,
}

/// Builds IAM from the config: checks the `iam` section (the admin token again: placeholders
/// holding `change-me` are refused), opens the store (memory only when `iam.state` is empty),
/// bootstraps it at first start (root, the administrator with every permission on root and
/// the config's admin token) and applies `root_quota` / `max_token_ttl_s` on later starts.
pub async fn build(cfg: &Config) -> Result<Iam, IamError> {
    let (admin_id, admin_token) = admin_of(cfg)?;
    state::check_quota_map(&cfg.iam.root_quota)
        .map_err(|f| IamError::Config(format!("root_quota: {}", f.message)))?;
    if cfg.iam.max_token_ttl_s < 0 {
        return Err(IamError::Config(
            "max_token_ttl_s may not be negative".into(),
        ));
    }
    let path = (!cfg.iam.state.is_empty()).then(|| PathBuf::from(&cfg.iam.state));
    let store =
        tokio::task::spawn_blocking(move || Store::open(path.as_deref(), StoreOptions::default()))
            .await
            .map_err(|e| IamError::Task(e.to_string()))??;
    if let Err(e) = settle(&store.clone().into(), cfg, &admin_id, admin_token).await {
        store.close().await;
        return Err(e);
    }
    let service = IamService::new(
        store.clone(),
        &cfg.service_token,
        cfg.admission.auth_fail_rate(),
    );
    service.set_members(vec![crate::config::IamReplica {
        id: IAM_ID.into(),
        addr: cfg.iam.addr.clone(),
        ..Default::default()
    }]);
    Ok(Iam { service, store })
}

/// The admin id and bootstrap token of the config, checked (placeholders are refused).
fn admin_of(cfg: &Config) -> Result<(String, Option<command::NewToken>), IamError> {
    let admin_id = cfg.iam.admin_id().to_string();
    crate::types::names::check_principal_id(&admin_id)
        .map_err(|f| IamError::Config(format!("admin_id: {}", f.message)))?;
    let token = cfg
        .iam
        .admin_token()
        .map_err(|e| IamError::Config(e.to_string()))?;
    let admin_token = if token.is_empty() {
        None
    } else {
        Some(tokens::configured(&admin_id, &token).map_err(IamError::Config)?)
    };
    Ok((admin_id, admin_token))
}

/// Bootstraps a fresh state, or brings the operator settings of a bootstrapped one in line
/// with the config. On a replica every replica tries: the first bootstrap to commit wins,
/// and the others find the state bootstrapped (after a consistent read) and settle it.
async fn settle(
    store: &IamStore,
    cfg: &Config,
    admin_id: &str,
    admin_token: Option<command::NewToken>,
) -> Result<(), IamError> {
    store.fresh().await.map_err(IamError::Bootstrap)?;
    let (booted, settings, current_admin) = {
        let st = store.read();
        (st.bootstrapped(), st.settings.clone(), st.admin_id.clone())
    };
    let root_quota = cfg.iam.root_quota.clone();
    let max_token_ttl_s = cfg.iam.max_token_ttl_s;
    if !booted {
        if admin_token.is_none() {
            tracing::warn!("iam.admin_token is not set: the administrator has no token");
        }
        let now = crate::types::now_s();
        let cmd = command::Command::Bootstrap {
            admin_id: admin_id.to_string(),
            admin_token,
            root_quota,
            max_token_ttl_s,
            now,
        };
        match store.propose(cmd).await {
            Ok(_) => {
                tracing::info!(
                    principal = admin_id,
                    "IAM bootstrapped: root project and administrator created"
                );
                return Ok(());
            }
            // Another replica bootstrapped first.
            Err(f) if f.reason == crate::types::Reason::Conflict && store.replicated() => {
                return Box::pin(settle(store, cfg, admin_id, None)).await;
            }
            Err(f) => return Err(IamError::Bootstrap(f)),
        }
    }
    if current_admin != admin_id {
        tracing::warn!(principal = %current_admin, configured = admin_id, "admin_id differs from the bootstrapped administrator; it is used only at bootstrap");
    }
    if settings.root_quota != root_quota || settings.max_token_ttl_s != max_token_ttl_s {
        store
            .propose(command::Command::Configure {
                root_quota,
                max_token_ttl_s,
            })
            .await
            .map_err(IamError::Bootstrap)?;
        tracing::info!("iam settings updated from the config");
    }
    Ok(())
}

/// Serves `router` on `listener` until it fails or `shutdown` fires, then gives calls in
/// flight [`DRAIN`] to finish.
async fn serve_iam(
    router: tonic::transport::server::Router<
        tower::layer::util::Stack<crate::rpc::acl::AclLayer, tower::layer::util::Identity>,
    >,
    listener: TcpListener,
    shutdown: &Shutdown,
) {
    let mut server = tokio::spawn(crate::rpc::serve::serve(router, listener, shutdown.clone()));
    tokio::select! {
        r = &mut server => {
            if let Ok(Err(e)) = r {
                tracing::error!(error = %e, "iam server failed");
            }
        }
        _ = shutdown.wait() => {
            if tokio::time::timeout(DRAIN, &mut server).await.is_err() {
                tracing::warn!("iam calls did not finish within the drain timeout");
                server.abort();
            }
        }
    }
}

/// The identity of a standalone IAM in its certificate (docs/tls.md "Identities").
pub const IAM_ID: &str = "0";

/// Starts the iam role: builds it, serves `Iam` on `listener` until `shutdown` fires, sets
/// `ready`, then closes the store (its files and lock) before the returned task ends.
pub async fn start(
    cfg: Arc<Config>,
    listener: TcpListener,
    shutdown: Shutdown,
    ready: Ready,
) -> Result<JoinHandle<()>, IamError> {
    let me = crate::pki::Identity::new(crate::pki::Role::Iam, IAM_ID)
        .map_err(|e| IamError::Config(e.to_string()))?;
    let tls = crate::rpc::tls::for_component(&cfg, &me)?;
    let mut builder = crate::rpc::serve::builder(tls.as_deref(), crate::rpc::acl::Policy::Iam)?;
    let iam = build(&cfg).await?;
    let router = builder.add_service(iam.service.clone().server());
    metrics::gauge!("opendsec_iam_leader").set(1.0);
    tracing::info!(addr = ?listener.local_addr().ok(), state = %cfg.iam.state, "iam serving");
    ready.set(true, "iam");
    Ok(tokio::spawn(async move {
        serve_iam(router, listener, &shutdown).await;
        ready.set(false, "iam");
        metrics::gauge!("opendsec_iam_leader").set(0.0);
        iam.store.close().await;
        tracing::info!("iam stopped");
    }))
}
