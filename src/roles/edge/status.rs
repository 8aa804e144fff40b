//! `Status` for the watcher (docs/architecture.md): the node's `EdgeState`
//! and, on request, the leases of its live sandboxes for reconciliation.

use std::sync::atomic::Ordering;

use super::admission::pressures;
use super::node::{lock, read, Core};
use crate::pb;

impl Core {
    /// This edge as the watcher sees it. Capacity is after overcommit, 0 where unlimited;
    /// `sandboxes_by_backend` counts live (creating, running, paused) sandboxes.
    pub fn edge_state(&self) -> pb::EdgeState {
        let host = read(&self.host);
        let press = pressures(&read(&self.reserves), &host);
        // The allocation and its sequence come from one read: a state with admitted_seq N
        // shows exactly the changes up to N.
        let alloc = lock(&self.alloc).clone();
        let admitted_seq = alloc.seq;
        let mut allocated = alloc.total.to_pb();
        // Simulated sandboxes use nothing: the host's load on a sim-only edge (several may share
        // one machine, as in `cluster up`) says nothing about where the next one fits, and
        // reporting it would herd placement onto whichever edge sampled lowest.
        let simulated =
            !self.slots.is_empty() && self.slots.values().all(|s| s.backend.simulated());
        let (cpu_usage, mem_usage) = if simulated {
            (0.0, 0.0)
        } else {
            (host.cpu_usage, host.mem_usage())
        };
        allocated.sandboxes = alloc.by_backend.values().sum();
        pb::EdgeState {
            id: self.edge_id.clone(),
            addr: self.addr.clone(),
            healthy: true,
            draining: self.draining.load(Ordering::Relaxed),
            zone: self.cfg.zone().to_string(),
            backends: self.slots.keys().cloned().collect(),
            capacity: Some(read(&self.capacity).to_pb()),
            allocated: Some(allocated),
            sandboxes_by_backend: self
                .slots
                .keys()
                .map(|b| (b.clone(), alloc.count(b)))
                .collect(),
            max_sandboxes: self
                .slots
                .iter()
                .map(|(b, s)| (b.clone(), s.max_sandboxes.max(0)))
                .collect(),
            mem_available_mb: host.mem_available_mb,
            disk_available_mb: host.disk_free_mb,
            under_pressure: !press.is_empty(),
            pressure_reason: press
                .iter()
                .map(|p| p.message.as_str())
                .collect::<Vec<_>>()
                .join("; "),
            cpu_usage,
            mem_usage,
            images: self.cfg.images.keys().cloned().collect(),
            last_seen: 0,
            consecutive_failures: 0,
            version: crate::VERSION.to_string(),
            admitted_seq,
            incarnation: self.incarnation.clone(),
            memory_charges: self
                .slots
                .iter()
                .map(|(b, s)| (b.clone(), s.backend.memory_charge()))
                .filter(|(_, c)| c.floor_mb > 0 || c.overhead_mb > 0)
                .collect(),
        }
    }

    /// `EdgeStatus`, with the leases of every live sandbox when asked.
    pub fn status(&self, with_leases: bool) -> pb::EdgeStatus {
        let leases = if with_leases {
            let mut v: Vec<pb::LeaseInfo> = self
                .all()
                .iter()
                .map(|e| e.snapshot())
                .filter(|r| !r.is_ended() && !r.lease_foreign && !r.sandbox.lease_id.is_empty())
                .map(|r| r.lease_info())
                .collect();
            v.sort_by(|a, b| a.lease_id.cmp(&b.lease_id));
            v
        } else {
            Vec::new()
        };
        pb::EdgeStatus {
            edge_id: self.edge_id.clone(),
            state: Some(self.edge_state()),
            leases,
        }
    }
}
