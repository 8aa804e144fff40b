//! The edge's background loops (docs/architecture.md, "Reporting"): TTL
//! expiry and dropping ended records, host sampling and metrics, backend liveness probes
//! and loss reports, and registration with the watchers.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use super::admission::{Capacity, Reserves};
use super::host::HostProbe;
use super::machine::Op;
use super::metrics;
use super::node::{as_handle, handle, lock, write, Core, Entry};
use super::ops::Cause;
use super::ttl::{decide, TtlAction};
use crate::backends::Health;
use crate::pb::{self, watcher_client::WatcherClient, SandboxState};
use crate::rpc;
use crate::shutdown::Shutdown;
use crate::types::now_s;

/// How often TTLs are checked.
const TTL_TICK: Duration = Duration::from_millis(500);
/// How often the host is sampled and gauges refreshed.
const SAMPLE_TICK: Duration = Duration::from_secs(1);
/// How often running sandboxes are probed.
const PROBE_TICK: Duration = Duration::from_secs(10);
/// How often the edge registers with each watcher.
const REGISTER_TICK: Duration = Duration::from_secs(3);

/// Starts every loop; they end when `shutdown` fires.
pub(crate) fn spawn(
    core: Arc<Core>,
    probe: HostProbe,
    shutdown: Shutdown,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut v = vec![
        tokio::spawn(ttl_loop(core.clone(), shutdown.clone())),
        tokio::spawn(sample_loop(core.clone(), probe, shutdown.clone())),
        tokio::spawn(probe_loop(core.clone(), shutdown.clone())),
        tokio::spawn(register_loop(core.clone(), shutdown.clone())),
    ];
    for slot in core.slots.values() {
        if let Some(mut rx) = slot.backend.loss_reporter().and_then(|l| l.losses()) {
            let c = core.clone();
            let sd = shutdown.clone();
            v.push(tokio::spawn(async move {
                loop {
                    tokio::select! {
                        _ = sd.wait() => return,
                        l = rx.recv() => match l {
                            Some(l) => c.mark_lost(&l.sandbox_id, &l.message).await,
                            None => return,
                        },
                    }
                }
            }));
        }
    }
    v
}

async fn every(period: Duration, shutdown: &Shutdown) -> bool {
    tokio::select! {
        _ = shutdown.wait() => false,
        _ = tokio::time::sleep(period) => true,
    }
}

async fn ttl_loop(core: Arc<Core>, shutdown: Shutdown) {
    while every(TTL_TICK, &shutdown).await {
        ttl_pass(&core, now_s()).await;
    }
}

/// One TTL pass at `now`: queues expiries (one at a time per sandbox) and drops ended
/// records past their retention.
pub(crate) async fn ttl_pass(core: &Arc<Core>, now: i64) {
    let mut drop = Vec::new();
    for e in core.all() {
        let action = decide(&lock(&e.rec), e.calls(), now, core.retention);
        match action {
            Some(TtlAction::Drop) => drop.push(lock(&e.rec).id().to_string()),
            Some(_) if !e.ttl_busy.swap(true, Ordering::AcqRel) => {
                let c = core.clone();
                tokio::spawn(async move { expire(&c, &e, now).await });
            }
            _ => {}
        }
    }
    for id in drop {
        core.drop_record(&id).await;
    }
}

/// Re-decides under the operation lock (a call or touch may have come in meanwhile) and
/// acts.
async fn expire(core: &Core, e: &Entry, now: i64) {
    {
        let _g = e.op.lock().await;
        let action = decide(&e.snapshot(), e.calls(), now, core.retention);
        let r = match action {
            Some(TtlAction::Pause(why)) => {
                Some(core.lifecycle_locked(e, Op::Pause, Cause::Ttl(why)).await)
            }
            Some(TtlAction::Stop(why)) => {
                Some(core.lifecycle_locked(e, Op::Stop, Cause::Ttl(why)).await)
            }
            _ => None,
        };
        if let Some(Err(f)) = r {
            tracing::warn!(sandbox_id = %e.snapshot().id(), error = %f, "TTL action failed");
        }
    }
    e.ttl_busy.store(false, Ordering::Release);
}

async fn sample_loop(core: Arc<Core>, mut probe: HostProbe, shutdown: Shutdown) {
    loop {
        let (p, host) = match tokio::task::spawn_blocking(move || {
            let h = probe.sample();
            (probe, h)
        })
        .await
        {
            Ok(r) => r,
            Err(e) => {
                tracing::error!(edge_id = %core.edge_id, error = %crate::types::chain(&e), "host sampling task failed");
                return;
            }
        };
        probe = p;
        sample_into(&core, host);
        metrics::refresh(&core);
        if !every(SAMPLE_TICK, &shutdown).await {
            return;
        }
    }
}

/// Stores a host reading and what follows from it (capacity, reserves).
pub(crate) fn sample_into(core: &Core, host: super::host::HostSample) {
    write(&core.host, host);
    write(
        &core.capacity,
        Capacity::resolve(&core.cfg, &host, core.real),
    );
    write(&core.reserves, Reserves::resolve(&core.cfg, &host));
}

async fn probe_loop(core: Arc<Core>, shutdown: Shutdown) {
    while every(PROBE_TICK, &shutdown).await {
        let running: Vec<_> = core
            .all()
            .into_iter()
            .map(|e| e.snapshot())
            .filter(|r| r.state() == SandboxState::Running)
            .collect();
        for rec in running {
            let Some(b) = core.backend_of(&rec).cloned() else {
                continue;
            };
            if b.simulated() {
                continue;
            }
            let parts = handle(&rec);
            if let Health::Lost(why) = b.probe(&as_handle(rec.id(), &parts)).await {
                core.mark_lost(rec.id(), &why).await;
            }
        }
    }
}

async fn register_loop(core: Arc<Core>, shutdown: Shutdown) {
    let mut clients = Vec::new();
    for addr in core.watchers.clone() {
        match core
            .dialer
            .channel(&addr, Duration::from_secs(2), crate::pki::Role::Watcher)
        {
            Ok(ch) => clients.push((addr, WatcherClient::new(ch))),
            Err(e) => {
                tracing::warn!(edge_id = %core.edge_id, error = %crate::types::chain(&e), "bad watcher address")
            }
        }
    }
    if clients.is_empty() {
        return;
    }
    loop {
        for (addr, c) in &clients {
            let mut c = c.clone();
            let mut req = rpc::client::internal(
                pb::RegisterEdgeRequest {
                    edge_id: core.edge_id.clone(),
                    addr: core.addr.clone(),
                },
                &core.service_token,
            );
            req.set_timeout(Duration::from_secs(2));
            match c.register(req).await {
                Ok(r) => {
                    tracing::trace!(watcher = %addr, known = r.into_inner().known, "registered")
                }
                Err(s) => {
                    tracing::debug!(watcher = %addr, error = %s.message(), "registering with watcher")
                }
            }
        }
        if !every(REGISTER_TICK, &shutdown).await {
            return;
        }
    }
}
