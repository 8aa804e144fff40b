//! The probe loop: every `probe_interval`, each edge's `Status` concurrently, with
//! `probe_timeout`; `unhealthy_after` consecutive failures (or an unexpected id) make an edge
//! unhealthy. Each round publishes a new snapshot version.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use futures::future::join_all;
use tonic::transport::Channel;

use super::Inner;
use crate::pb;
use crate::shutdown::Shutdown;
use crate::telemetry::Ready;
use crate::types::now_f;

/// Probes one edge; `Err` carries why the probe counts as failed.
async fn probe_one(
    cfg: &crate::config::Config,
    id: &str,
    ch: Channel,
    timeout: Duration,
) -> Result<pb::EdgeState, String> {
    let mut c = pb::edge_client::EdgeClient::new(ch);
    let mut req =
        crate::rpc::client::internal(pb::StatusRequest { with_leases: false }, &cfg.service_token);
    req.set_timeout(timeout);
    let st = tokio::time::timeout(timeout, c.status(req))
        .await
        .map_err(|_| "probe timed out".to_string())?
        .map_err(|s| s.message().to_string())?
        .into_inner();
    if st.edge_id != id {
        return Err(format!("answered as edge {:?}", st.edge_id));
    }
    Ok(st.state.unwrap_or_default())
}

pub(crate) async fn run(inner: Arc<Inner>, shutdown: Shutdown, ready: Ready) {
    let cfg = inner.cfg.clone();
    let interval = Duration::from_secs_f64(cfg.watcher.probe_interval());
    let timeout = Duration::from_secs_f64(cfg.watcher.probe_timeout());
    let mut version: u64 = 0;
    // Channels are kept per address: reconnecting every second would cost a TCP handshake each.
    let mut channels: HashMap<(String, String), Channel> = HashMap::new();
    loop {
        let targets: Vec<(String, String)> = inner
            .edges
            .read()
            .await
            .iter()
            .map(|(id, e)| (id.clone(), e.addr.clone()))
            .collect();
        channels.retain(|k, _| targets.iter().any(|t| t == k));
        let mut probes = Vec::with_capacity(targets.len());
        for (id, addr) in &targets {
            // Keyed by id and address: over mTLS the edge at `addr` must be `id`.
            let key = (id.clone(), addr.clone());
            let ch = match channels.get(&key) {
                Some(c) => Ok(c.clone()),
                None => inner
                    .dialer
                    .channel_to(addr, timeout, crate::pki::Role::Edge, Some(id))
                    .inspect(|c| {
                        channels.insert(key, c.clone());
                    }),
            };
            let cfg = cfg.clone();
            let id = id.clone();
            probes.push(async move {
                let t0 = std::time::Instant::now();
                let r = match ch {
                    Ok(ch) => probe_one(&cfg, &id, ch, timeout).await,
                    Err(e) => Err(crate::types::chain(&e)),
                };
                (id, r, t0.elapsed().as_millis() as u64)
            });
        }
        let results = join_all(probes).await;
        let now = now_f();
        {
            let mut edges = inner.edges.write().await;
            for (id, res, ms) in results {
                let Some(e) = edges.get_mut(&id) else {
                    continue;
                };
                if let Err(why) = &res {
                    // The misses that lead to "edge unhealthy" are what a busy edge's
                    // trouble looks like; an edge known to be down would repeat them at
                    // every probe.
                    if e.healthy {
                        tracing::info!(edge_id = %id, reason = %why, ms, "edge probe failed");
                    } else {
                        tracing::debug!(edge_id = %id, reason = %why, ms, "edge probe failed");
                    }
                }
                match res {
                    Ok(state) => {
                        e.state = state;
                        e.failures = 0;
                        e.healthy = true;
                        e.unhealthy_since = 0.0;
                        e.state.last_seen = now as i64;
                    }
                    Err(why) => {
                        e.failures = e.failures.saturating_add(1);
                        if e.failures >= cfg.watcher.unhealthy_after() && e.healthy {
                            tracing::warn!(edge_id = %id, reason = %why, "edge unhealthy");
                            e.healthy = false;
                            e.unhealthy_since = now;
                        } else if e.failures >= cfg.watcher.unhealthy_after()
                            && e.unhealthy_since == 0.0
                        {
                            e.unhealthy_since = now;
                        }
                    }
                }
            }
            version += 1;
            let mut snap = pb::Snapshot {
                version,
                generated_at: now as i64,
                edges: Vec::with_capacity(edges.len()),
            };
            let (mut healthy, mut unhealthy, mut draining) = (0, 0, 0);
            for (id, e) in edges.iter() {
                let mut s = e.state.clone();
                s.id = id.clone();
                s.addr = e.addr.clone();
                s.healthy = e.healthy;
                s.consecutive_failures = e.failures;
                if e.healthy {
                    healthy += 1
                } else {
                    unhealthy += 1
                }
                if s.draining {
                    draining += 1
                }
                snap.edges.push(s);
            }
            metrics::gauge!("opendsec_watcher_edges_healthy").set(healthy as f64);
            metrics::gauge!("opendsec_watcher_edges_unhealthy").set(unhealthy as f64);
            metrics::gauge!("opendsec_watcher_edges_draining").set(draining as f64);
            *inner.snapshot.write().await = Arc::new(snap);
        }
        ready.set(true, "watcher");
        tokio::select! {
            _ = tokio::time::sleep(interval) => {},
            _ = shutdown.wait() => return,
        }
    }
}
