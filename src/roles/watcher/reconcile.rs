//! Quota reconciliation (docs/architecture.md): every `reconcile_interval`, on the watcher
//! holding the reconciliation lock,
//! each healthy edge's live leases go to IAM, which adopts what it did not know and releases
//! what the edge no longer holds (never leases younger than `reconcile_min_age`). An edge
//! unhealthy for longer than `lost_edge_grace` is reconciled as empty, returning its quota.
//! Each edge is reconciled on its own, so one unreachable edge only skips itself. Leases no
//! edge ever claimed are swept after `unbound_max_age`.

use std::sync::Arc;
use std::time::Duration;

use crate::rpc::failover::IamChannel;

use super::Inner;
use crate::pb;
use crate::shutdown::Shutdown;
use crate::types::now_f;

async fn leases_of(
    cfg: &crate::config::Config,
    dialer: &crate::rpc::client::Dialer,
    id: &str,
    addr: &str,
) -> Result<(String, Vec<pb::LeaseInfo>), String> {
    let t = Duration::from_secs(10);
    let ch = dialer
        .channel_to(
            addr,
            Duration::from_secs(2),
            crate::pki::Role::Edge,
            Some(id),
        )
        .map_err(|e| crate::types::chain(&e))?;
    let mut c =
        pb::edge_client::EdgeClient::new(ch).max_decoding_message_size(crate::rpc::MAX_MESSAGE);
    let mut req =
        crate::rpc::client::internal(pb::StatusRequest { with_leases: true }, &cfg.service_token);
    req.set_timeout(t);
    let st = c
        .status(req)
        .await
        .map_err(|s| s.message().to_string())?
        .into_inner();
    Ok((st.edge_id, st.leases))
}

/// One reconciliation round over every known edge, by the holder of the reconciliation
/// lock only (checked again before each call: a round can outlast the hold). Each call
/// carries the hold's fence, so one that commits after another watcher took the lock (a
/// resent call, say) changes nothing.
pub(crate) async fn round(inner: &Inner, iam: &mut pb::iam_client::IamClient<IamChannel>) {
    if !inner.leadership.holds() {
        return;
    }
    let cfg = &inner.cfg;
    // IAM counts whole seconds; rounding down could release a lease created this second.
    let min_age = cfg.watcher.reconcile_min_age().ceil() as i64;
    let now = now_f();
    let edges: Vec<(String, String, bool, f64)> = inner
        .edges
        .read()
        .await
        .iter()
        .map(|(id, e)| (id.clone(), e.addr.clone(), e.healthy, e.unhealthy_since))
        .collect();
    for (id, addr, healthy, since) in edges {
        let leases = if healthy {
            match leases_of(cfg, &inner.dialer, &id, &addr).await {
                Ok((eid, l)) if eid == id => l,
                Ok(_) | Err(_) => continue,
            }
        } else if since > 0.0 && now - since > cfg.watcher.lost_edge_grace() {
            Vec::new()
        } else {
            continue;
        };
        let Some(fence) = inner.leadership.fence() else {
            return;
        };
        let req = crate::rpc::client::internal(
            pb::ReconcileRequest {
                edge_id: id.clone(),
                leases,
                min_age_s: min_age,
                fence,
            },
            &cfg.service_token,
        );
        match iam.reconcile(req).await {
            Ok(r) => {
                let r = r.into_inner();
                if r.adopted > 0 || r.released > 0 {
                    tracing::info!(edge_id = %id, adopted = r.adopted, released = r.released, "leases reconciled");
                }
            }
            Err(s) => tracing::debug!(edge_id = %id, error = %s.message(), "reconcile failed"),
        }
    }
    let Some(fence) = inner.leadership.fence() else {
        return;
    };
    let req = crate::rpc::client::internal(
        pb::SweepUnboundRequest {
            max_age_s: cfg.watcher.unbound_max_age() as i64,
            fence,
        },
        &cfg.service_token,
    );
    if let Err(s) = iam.sweep_unbound(req).await {
        tracing::debug!(error = %s.message(), "sweep of unbound leases failed");
    }
}

pub(crate) async fn run(
    inner: Arc<Inner>,
    mut iam: pb::iam_client::IamClient<IamChannel>,
    shutdown: Shutdown,
) {
    let every = Duration::from_secs_f64(inner.cfg.watcher.reconcile_interval());
    loop {
        tokio::select! {
            _ = tokio::time::sleep(every) => {},
            _ = shutdown.wait() => return,
        }
        round(&inner, &mut iam).await;
    }
}
