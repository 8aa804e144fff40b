//! Running one replica of a replicated IAM (docs/iam-replicas.md): its Raft node on
//! `data_dir`, the `Raft` service on `raft_addr` for the other replicas, and the `Iam`
//! service on `addr` for everyone else, over the same state.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::task::JoinHandle;

use super::replica::transport::{GrpcTransport, RaftService};
use super::replica::{raft_id, Member, Options, Replica};
use super::{admin_of, settle, IamError, IamService, IamStore};
use crate::config::Config;
use crate::pki::{Identity, Role};
use crate::shutdown::Shutdown;
use crate::telemetry::Ready;

/// The listeners of one replica.
pub struct Listeners {
    /// The `Iam` service (`addr`).
    pub api: TcpListener,
    /// The `Raft` service (`raft_addr`).
    pub raft: TcpListener,
}

/// Starts replica `id` of `cfg.iam.replicas`: opens its log, serves `Raft` and `Iam` until
/// `shutdown` fires, then closes its log before the returned task ends. `/readyz` turns
/// ready once the replica holds a bootstrapped state (bootstrapping it with the others on
/// a new cluster); with `join` it never bootstraps and waits to be added by a member.
/// Errors: `Config` for an id the config lacks, `Tls`, `Serve`, `Replica`.
pub async fn start(
    cfg: Arc<Config>,
    id: &str,
    join: bool,
    listeners: Listeners,
    shutdown: Shutdown,
    ready: Ready,
) -> Result<JoinHandle<()>, IamError> {
    let me_cfg = cfg
        .iam
        .replica(id)
        .ok_or_else(|| {
            IamError::Config(format!(
                "-replica {id}: iam.replicas has no replica with that id"
            ))
        })?
        .clone();
    let (admin_id, admin_token) = admin_of(&cfg)?;
    super::state::check_quota_map(&cfg.iam.root_quota)
        .map_err(|f| IamError::Config(format!("root_quota: {}", f.message)))?;
    let me = Identity::new(Role::Iam, id).map_err(|e| IamError::Config(e.to_string()))?;
    let tls = crate::rpc::tls::for_component(&cfg, &me)?;
    let dialer = crate::rpc::client::Dialer::new(tls.clone())?;
    let peers: Vec<(u64, String)> = cfg
        .iam
        .replicas
        .iter()
        .filter(|r| r.id != id)
        .map(|r| (raft_id(r.number()), r.raft_addr.clone()))
        .collect();
    let transport = GrpcTransport::new(&peers, &dialer, &cfg.service_token)
        .map_err(|e| IamError::Config(e.to_string()))?;
    let mut opts = Options::new(
        raft_id(me_cfg.number()),
        cfg.iam
            .replicas
            .iter()
            .map(|r| raft_id(r.number()))
            .collect(),
        me_cfg.data_dir().into(),
    );
    opts.join = join;
    opts.members = cfg
        .iam
        .replicas
        .iter()
        .map(|r| Member {
            id: r.number(),
            addr: r.addr.clone(),
            raft_addr: r.raft_addr.clone(),
        })
        .collect();
    let replica = tokio::task::spawn_blocking(move || Replica::open(opts, Arc::new(transport)))
        .await
        .map_err(|e| IamError::Task(e.to_string()))?
        .map_err(|e| IamError::Replica(Box::new(e)))?;
    let store = IamStore::from(replica.clone());
    let service = IamService::new(
        store.clone(),
        &cfg.service_token,
        cfg.admission.auth_fail_rate(),
    );
    let mut raft_builder =
        crate::rpc::serve::builder(tls.as_deref(), crate::rpc::acl::Policy::Raft)?;
    let raft_router =
        raft_builder.add_service(RaftService::new(replica.clone(), &cfg.service_token).server());
    let mut builder = crate::rpc::serve::builder(tls.as_deref(), crate::rpc::acl::Policy::Iam)?;
    let router = builder.add_service(service.server());
    tracing::info!(
        replica = id,
        addr = ?listeners.api.local_addr().ok(),
        raft_addr = ?listeners.raft.local_addr().ok(),
        data_dir = me_cfg.data_dir(),
        join,
        "iam replica serving"
    );
    let raft_server = tokio::spawn(crate::rpc::serve::serve(
        raft_router,
        listeners.raft,
        shutdown.clone(),
    ));
    let settler = {
        let (store, cfg, shutdown, ready) =
            (store.clone(), cfg.clone(), shutdown.clone(), ready.clone());
        tokio::spawn(async move {
            become_ready(&store, &cfg, join, admin_id, admin_token, &shutdown).await;
            if shutdown.is_fired() {
                return;
            }
            ready.set(true, "iam");
            // A replica that was removed from the group (or whose log failed) answers
            // nothing: not ready, so that load balancers and operators see it.
            let IamStore::Replicated(r) = &store else {
                return;
            };
            loop {
                ready.set(!r.failed(), "iam");
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    _ = shutdown.wait() => return,
                }
            }
        })
    };
    Ok(tokio::spawn(async move {
        super::serve_iam(router, listeners.api, &shutdown).await;
        settler.abort();
        ready.set(false, "iam");
        let _ = raft_server.await;
        store.close().await;
        metrics::gauge!("opendsec_iam_leader").set(0.0);
        tracing::info!("iam replica stopped");
    }))
}

/// Settles the state (see `settle`) once a majority answers, retrying until it does; a
/// joining replica only waits for a bootstrapped state to reach it.
async fn become_ready(
    store: &IamStore,
    cfg: &Config,
    join: bool,
    admin_id: String,
    admin_token: Option<super::command::NewToken>,
    shutdown: &Shutdown,
) {
    let mut logged = false;
    while !shutdown.is_fired() {
        let r = if join {
            match store.fresh().await {
                Ok(()) if store.read().bootstrapped() => Ok(()),
                Ok(()) => Err("no state reached this replica yet".to_string()),
                Err(f) => Err(f.to_string()),
            }
        } else {
            settle(store, cfg, &admin_id, admin_token.clone())
                .await
                .map_err(|e| crate::types::chain(&e))
        };
        match r {
            Ok(()) => return,
            Err(e) => {
                if !logged {
                    if join {
                        tracing::warn!(error = %e, "iam replica waiting to be added (iam member add) and caught up");
                    } else {
                        tracing::warn!(error = %e, "iam replica waiting for a majority of replicas");
                    }
                    logged = true;
                }
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_millis(500)) => {}
                    _ = shutdown.wait() => return,
                }
            }
        }
    }
}
