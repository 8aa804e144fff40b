//! The edge's metrics (docs/architecture.md). Counters and histograms are recorded where
//! things happen; gauges are refreshed by the sampling loop (`refresh`).

use std::sync::atomic::Ordering;

use super::admission::pressures;
use super::node::{lock, read, Core};
use crate::pb::SandboxState;

const STATES: [SandboxState; 8] = [
    SandboxState::Creating,
    SandboxState::Running,
    SandboxState::Pausing,
    SandboxState::Paused,
    SandboxState::Resuming,
    SandboxState::Stopping,
    SandboxState::Stopped,
    SandboxState::Failed,
];

/// `opendsec_edge_rejected_total{edge, reason}`: `draining`, `memory_pressure`,
/// `disk_pressure`, `cpu_pressure`, `capacity`, `max_sandboxes`.
pub fn rejected(edge: &str, reason: &'static str) {
    metrics::counter!("opendsec_edge_rejected_total", "edge" => edge.to_string(), "reason" => reason).increment(1);
}

/// `opendsec_edge_created_total{edge}`.
pub fn created(edge: &str) {
    metrics::counter!("opendsec_edge_created_total", "edge" => edge.to_string()).increment(1);
}

/// `opendsec_edge_create_seconds{backend, reason}`: admission to running.
pub fn create_seconds(backend: &str, reason: &'static str, secs: f64) {
    metrics::histogram!("opendsec_edge_create_seconds", "backend" => backend.to_string(), "reason" => reason).record(secs);
}

/// `opendsec_edge_op_seconds{backend, op, reason}`: pause, resume, stop.
pub fn op_seconds(backend: &str, op: &'static str, reason: &'static str, secs: f64) {
    metrics::histogram!("opendsec_edge_op_seconds", "backend" => backend.to_string(), "op" => op, "reason" => reason).record(secs);
}

/// The `reason` label of a backend call's outcome: `ok`, or its error's reason.
pub fn outcome<T>(r: &Result<T, crate::backends::BackendError>) -> &'static str {
    r.as_ref()
        .err()
        .map(|e| e.reason().as_str())
        .unwrap_or("ok")
}

/// [`op_seconds`] of a backend call begun at `since` that ended with `r`.
pub fn op_done<T>(
    backend: &str,
    op: &'static str,
    r: &Result<T, crate::backends::BackendError>,
    since: std::time::Instant,
) {
    op_seconds(backend, op, outcome(r), since.elapsed().as_secs_f64());
}

/// Sets every gauge from the edge's current state.
pub fn refresh(core: &Core) {
    let edge = core.edge_id.clone();
    let mut counts: std::collections::HashMap<(String, i32), i64> = Default::default();
    for e in core.all() {
        let r = lock(&e.rec);
        *counts
            .entry((r.backend().to_string(), r.sandbox.state))
            .or_default() += 1;
    }
    for b in core.slots.keys() {
        for s in STATES {
            let n = counts.get(&(b.clone(), s as i32)).copied().unwrap_or(0);
            metrics::gauge!("opendsec_edge_sandboxes", "edge" => edge.clone(), "backend" => b.clone(), "state" => s.as_str_name()).set(n as f64);
        }
    }
    let cap = read(&core.capacity).to_pb();
    let alloc = lock(&core.alloc).total;
    for (res, c, a) in [
        ("cpu_cores", cap.cpu_cores, alloc.cpu_cores),
        ("memory_mb", cap.memory_mb as f64, alloc.memory_mb as f64),
        ("gpus", cap.gpus as f64, alloc.gpus as f64),
        ("disk_mb", cap.disk_mb as f64, alloc.disk_mb as f64),
    ] {
        metrics::gauge!("opendsec_edge_capacity", "edge" => edge.clone(), "resource" => res).set(c);
        metrics::gauge!("opendsec_edge_allocated", "edge" => edge.clone(), "resource" => res)
            .set(a);
    }
    let draining = core.draining.load(Ordering::Relaxed);
    metrics::gauge!("opendsec_edge_draining", "edge" => edge.clone()).set(if draining {
        1.0
    } else {
        0.0
    });
    let host = read(&core.host);
    let press = pressures(&read(&core.reserves), &host);
    for kind in ["memory", "disk", "cpu"] {
        let on = press.iter().any(|p| p.kind == kind);
        metrics::gauge!("opendsec_edge_under_pressure", "edge" => edge.clone(), "pressure" => kind)
            .set(if on { 1.0 } else { 0.0 });
    }
    metrics::gauge!("opendsec_edge_mem_available_mb", "edge" => edge.clone())
        .set(host.mem_available_mb as f64);
    metrics::gauge!("opendsec_edge_disk_available_mb", "edge" => edge)
        .set(host.disk_free_mb as f64);
}
