//! Final admission on the node (docs/architecture.md): capacity after
//! overcommit, per-backend `max_sandboxes`, and the memory, disk and CPU pressure checks.
//! Everything here is arithmetic on plain values; the edge supplies the host reading.

use std::collections::BTreeMap;

use super::host::HostSample;
use crate::config::EdgeConfig;
use crate::pb;
use crate::types::Res;

/// Schedulable capacity after overcommit. `None` = unlimited (reported as 0).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Capacity {
    pub cpu_cores: Option<f64>,
    pub memory_mb: Option<i64>,
    pub disk_mb: Option<i64>,
    pub gpus: i64,
}

impl Capacity {
    /// From `capacity`, the overcommit factors and the host (docs/configuration.md `capacity`):
    /// with a real backend and neither `cpu_cores` nor `memory_mb` set, they are the host's
    /// CPU count and total memory (setting only one leaves the other unlimited); without
    /// `disk_mb`, the size of the file system holding `state_dir`. On sim-only edges unset
    /// fields are unlimited. `gpus` defaults to the number of `gpu.devices`.
    pub fn resolve(cfg: &EdgeConfig, host: &HostSample, real_backend: bool) -> Capacity {
        let c = &cfg.capacity;
        let pos_f = |v: f64| (v > 0.0).then_some(v);
        let pos_i = |v: i64| (v > 0).then_some(v);
        let (cpu, mem) = if c.cpu_cores > 0.0 || c.memory_mb > 0 {
            (pos_f(c.cpu_cores), pos_i(c.memory_mb))
        } else if real_backend {
            (pos_f(host.cpus), pos_i(host.mem_total_mb))
        } else {
            (None, None)
        };
        let disk = if c.disk_mb > 0 {
            Some(c.disk_mb)
        } else if real_backend {
            pos_i(host.disk_total_mb)
        } else {
            None
        };
        let gpus = if c.gpus > 0 {
            c.gpus
        } else {
            cfg.gpu
                .get("devices")
                .and_then(|d| d.as_array())
                .map(|a| a.len() as i64)
                .unwrap_or(0)
        };
        Capacity {
            cpu_cores: cpu.map(|v| v * cfg.cpu_overcommit()),
            memory_mb: mem.map(|v| (v as f64 * cfg.mem_overcommit()).floor() as i64),
            disk_mb: disk.map(|v| (v as f64 * cfg.disk_overcommit()).floor() as i64),
            gpus,
        }
    }

    /// As reported in `EdgeState.capacity`: unlimited dimensions are 0.
    pub fn to_pb(self) -> pb::Resources {
        pb::Resources {
            cpu_cores: self.cpu_cores.unwrap_or(0.0),
            memory_mb: self.memory_mb.unwrap_or(0),
            gpus: self.gpus,
            disk_mb: self.disk_mb.unwrap_or(0),
            sandboxes: 0,
        }
    }
}

/// The pressure thresholds, resolved against the host.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Reserves {
    /// Reject while MemAvailable is below this (MB).
    pub mem_mb: Option<i64>,
    /// Reject while the state directory's file system has less free space (MB).
    pub disk_mb: Option<i64>,
    /// Reject while CPU pressure (some avg10, percent) is above this.
    pub cpu_pressure: Option<f64>,
}

impl Reserves {
    /// `mem_reserve_mb`: 0 = 10% of RAM, at least 128 MB; -1 = off. `disk_reserve_mb`: 0 =
    /// 5% of the file system, at least 1024 MB; -1 = off. `cpu_pressure_limit`: 0 = off. A
    /// check whose host figure could not be read is off.
    pub fn resolve(cfg: &EdgeConfig, host: &HostSample) -> Reserves {
        let auto = |set: i64, total: i64, share: f64, floor: i64| -> Option<i64> {
            if set < 0 || total <= 0 {
                None
            } else if set == 0 {
                Some(((total as f64 * share) as i64).max(floor))
            } else {
                Some(set)
            }
        };
        Reserves {
            mem_mb: auto(cfg.mem_reserve_mb, host.mem_total_mb, 0.10, 128),
            disk_mb: auto(cfg.disk_reserve_mb, host.disk_total_mb, 0.05, 1024),
            cpu_pressure: (cfg.cpu_pressure_limit > 0.0).then_some(cfg.cpu_pressure_limit),
        }
    }
}

/// One kind of pressure the node is under.
#[derive(Debug, Clone, PartialEq)]
pub struct Pressure {
    /// `memory`, `disk` or `cpu` (the `pressure` label of `opendsec_edge_under_pressure`).
    pub kind: &'static str,
    pub message: String,
}

/// The pressures the host is under now, memory first.
pub fn pressures(r: &Reserves, host: &HostSample) -> Vec<Pressure> {
    let mut out = Vec::new();
    if let Some(min) = r.mem_mb {
        if host.mem_available_mb < min {
            out.push(Pressure {
                kind: "memory",
                message: format!(
                    "memory pressure: MemAvailable {} MB is below the reserve of {min} MB",
                    host.mem_available_mb
                ),
            });
        }
    }
    if let Some(min) = r.disk_mb {
        if host.disk_free_mb < min {
            out.push(Pressure { kind: "disk", message: format!("disk pressure: {} MB free on the state directory's file system, below the reserve of {min} MB", host.disk_free_mb) });
        }
    }
    if let (Some(max), Some(p)) = (r.cpu_pressure, host.cpu_pressure) {
        if p > max {
            out.push(Pressure {
                kind: "cpu",
                message: format!(
                    "cpu pressure: some avg10 {p:.1}% is above cpu_pressure_limit {max}%"
                ),
            });
        }
    }
    out
}

/// What live sandboxes hold: the total and the count per backend, and how many changes
/// made it so (`seq`, reported as `EdgeState.admitted_seq`): a state read with the
/// allocation under one lock shows exactly the changes up to its `seq`, so the apiserver
/// can tell which of its own placements and stops a snapshot already counts.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Alloc {
    pub total: Res,
    pub by_backend: BTreeMap<String, i64>,
    pub seq: u64,
}

impl Alloc {
    pub fn add(&mut self, backend: &str, r: &Res) {
        self.total.add(r);
        if r.sandboxes != 0 {
            *self.by_backend.entry(backend.to_string()).or_insert(0) += r.sandboxes;
        }
        self.seq += 1;
    }
    pub fn sub(&mut self, backend: &str, r: &Res) {
        self.total.sub(r);
        if let Some(n) = self.by_backend.get_mut(backend) {
            *n = (*n - r.sandboxes).max(0);
        }
        self.seq += 1;
    }
    /// Replaces charge `old` by `new` for a sandbox of `backend`.
    pub fn change(&mut self, backend: &str, old: &Res, new: &Res) {
        if old != new {
            self.sub(backend, old);
            self.add(backend, new);
        }
    }
    pub fn count(&self, backend: &str) -> i64 {
        self.by_backend.get(backend).copied().unwrap_or(0)
    }
}

/// Why a creation was refused: the `reason` label of `opendsec_edge_rejected_total` and the
/// message for the caller (`no_capacity`).
#[derive(Debug, Clone, PartialEq)]
pub struct Rejection {
    pub label: &'static str,
    pub message: String,
}

/// Checks that `want` fits next to `alloc` within `cap` and the backend's `max_sandboxes`
/// (0 = none). The message names each resource that is short.
pub fn fits(
    want: &Res,
    backend: &str,
    max_sandboxes: i64,
    alloc: &Alloc,
    cap: &Capacity,
) -> Result<(), Rejection> {
    if max_sandboxes > 0 && alloc.count(backend) + want.sandboxes > max_sandboxes {
        return Err(Rejection {
            label: "max_sandboxes",
            message: format!(
                "backend {backend} already runs {} sandboxes (max_sandboxes {max_sandboxes})",
                alloc.count(backend)
            ),
        });
    }
    let mut short = Vec::new();
    if let Some(c) = cap.cpu_cores {
        if alloc.total.cpu_cores + want.cpu_cores > c + 1e-9 {
            short.push(format!(
                "cpu_cores: {} requested, {:.2} of {c} free",
                want.cpu_cores,
                (c - alloc.total.cpu_cores).max(0.0)
            ));
        }
    }
    if let Some(c) = cap.memory_mb {
        if alloc.total.memory_mb + want.memory_mb > c {
            short.push(format!(
                "memory_mb: {} requested, {} of {c} free",
                want.memory_mb,
                (c - alloc.total.memory_mb).max(0)
            ));
        }
    }
    if let Some(c) = cap.disk_mb {
        if alloc.total.disk_mb + want.disk_mb > c {
            short.push(format!(
                "disk_mb: {} requested, {} of {c} free",
                want.disk_mb,
                (c - alloc.total.disk_mb).max(0)
            ));
        }
    }
    if want.gpus > 0 && alloc.total.gpus + want.gpus > cap.gpus {
        short.push(format!(
            "gpus: {} requested, {} of {} free",
            want.gpus,
            (cap.gpus - alloc.total.gpus).max(0),
            cap.gpus
        ));
    }
    if short.is_empty() {
        Ok(())
    } else {
        Err(Rejection {
            label: "capacity",
            message: format!("not enough capacity: {}", short.join("; ")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CapacityConfig;

    fn host() -> HostSample {
        HostSample {
            cpus: 4.0,
            mem_total_mb: 16000,
            mem_available_mb: 8000,
            disk_total_mb: 100_000,
            disk_free_mb: 50_000,
            cpu_pressure: Some(10.0),
            cpu_usage: 0.1,
        }
    }

    fn want(cpu: f64, mem: i64, disk: i64) -> Res {
        Res {
            cpu_cores: cpu,
            memory_mb: mem,
            gpus: 0,
            disk_mb: disk,
            sandboxes: 1,
        }
    }

    #[test]
    fn capacity_defaults_to_the_host_with_a_real_backend_and_applies_overcommit() {
        let cfg = EdgeConfig::default();
        let c = Capacity::resolve(&cfg, &host(), true);
        assert_eq!(c.cpu_cores, Some(32.0), "4 cpus × 8");
        assert_eq!(c.memory_mb, Some(16000));
        assert_eq!(c.disk_mb, Some(100_000));
        let sim = Capacity::resolve(&cfg, &host(), false);
        assert_eq!(
            (sim.cpu_cores, sim.memory_mb, sim.disk_mb),
            (None, None, None),
            "sim-only: unlimited"
        );
        assert_eq!(sim.to_pb().memory_mb, 0);
        let cfg = EdgeConfig {
            capacity: CapacityConfig {
                cpu_cores: 10.0,
                ..Default::default()
            },
            cpu_overcommit: 2.0,
            mem_overcommit: 1.5,
            ..Default::default()
        };
        let c = Capacity::resolve(&cfg, &host(), true);
        assert_eq!(c.cpu_cores, Some(20.0));
        assert_eq!(
            c.memory_mb, None,
            "setting only cpu_cores leaves memory unset"
        );
        let cfg = EdgeConfig {
            capacity: CapacityConfig {
                memory_mb: 1000,
                disk_mb: 300,
                gpus: 2,
                ..Default::default()
            },
            mem_overcommit: 1.5,
            disk_overcommit: 2.0,
            ..Default::default()
        };
        let c = Capacity::resolve(&cfg, &host(), false);
        assert_eq!(
            (c.cpu_cores, c.memory_mb, c.disk_mb, c.gpus),
            (None, Some(1500), Some(600), 2)
        );
        let cfg = EdgeConfig {
            gpu: serde_json::json!({"devices": ["/dev/nvidia0", "/dev/nvidia1"]}),
            ..Default::default()
        };
        assert_eq!(Capacity::resolve(&cfg, &host(), true).gpus, 2);
    }

    #[test]
    fn fits_checks_each_dimension_and_names_what_is_short() {
        let cap = Capacity {
            cpu_cores: Some(8.0),
            memory_mb: Some(4096),
            disk_mb: Some(10_000),
            gpus: 0,
        };
        let mut a = Alloc::default();
        assert!(fits(&want(4.0, 2048, 1000), "sim", 0, &a, &cap).is_ok());
        a.add("sim", &want(4.0, 2048, 1000));
        assert!(
            fits(&want(4.0, 2048, 1000), "sim", 0, &a, &cap).is_ok(),
            "exactly full fits"
        );
        a.add("sim", &want(4.0, 2048, 1000));
        let r = fits(&want(0.5, 1, 1), "sim", 0, &a, &cap)
            .err()
            .unwrap_or(Rejection {
                label: "",
                message: String::new(),
            });
        assert_eq!(r.label, "capacity");
        assert!(
            r.message.contains("cpu_cores")
                && r.message.contains("memory_mb")
                && !r.message.contains("disk_mb"),
            "{}",
            r.message
        );
        let g = fits(
            &Res {
                gpus: 1,
                sandboxes: 1,
                ..Default::default()
            },
            "sim",
            0,
            &Alloc::default(),
            &cap,
        );
        assert!(g.err().is_some_and(|r| r.message.contains("gpus")));
        a.sub("sim", &want(4.0, 2048, 1000));
        assert_eq!(a.count("sim"), 1);
        assert!(fits(&want(4.0, 2048, 1000), "sim", 0, &a, &cap).is_ok());
    }

    #[test]
    fn max_sandboxes_is_per_backend() {
        let cap = Capacity::default();
        let mut a = Alloc::default();
        a.add("sim", &want(1.0, 1, 1));
        a.add("sim", &want(1.0, 1, 1));
        a.add("other", &want(1.0, 1, 1));
        let r = fits(&want(1.0, 1, 1), "sim", 2, &a, &cap);
        assert!(r
            .err()
            .is_some_and(|r| r.label == "max_sandboxes" && r.message.contains("max_sandboxes 2")));
        assert!(fits(&want(1.0, 1, 1), "other", 2, &a, &cap).is_ok());
        assert!(
            fits(&want(1.0, 1, 1), "sim", 0, &a, &cap).is_ok(),
            "0 = no limit"
        );
        // A paused sandbox whose memory is partly released changes only memory.
        let old = want(1.0, 1000, 1);
        let new = Res {
            memory_mb: 250,
            ..old
        };
        a.change("sim", &old, &new);
        assert_eq!(a.count("sim"), 2);
    }

    #[test]
    fn reserves_and_pressures() {
        let mut h = host();
        let r = Reserves::resolve(&EdgeConfig::default(), &h);
        assert_eq!(r.mem_mb, Some(1600), "10% of 16000");
        assert_eq!(r.disk_mb, Some(5000), "5% of 100000");
        assert_eq!(r.cpu_pressure, None);
        let small = HostSample {
            mem_total_mb: 512,
            disk_total_mb: 2000,
            ..h
        };
        let rs = Reserves::resolve(&EdgeConfig::default(), &small);
        assert_eq!((rs.mem_mb, rs.disk_mb), (Some(128), Some(1024)), "floors");
        let off = EdgeConfig {
            mem_reserve_mb: -1,
            disk_reserve_mb: -1,
            ..Default::default()
        };
        assert_eq!(Reserves::resolve(&off, &h), Reserves::default());
        assert!(pressures(&r, &h).is_empty());
        h.mem_available_mb = 1000;
        h.disk_free_mb = 10;
        let with_cpu = Reserves {
            cpu_pressure: Some(5.0),
            ..r
        };
        let p = pressures(&with_cpu, &h);
        let kinds: Vec<_> = p.iter().map(|p| p.kind).collect();
        assert_eq!(kinds, vec!["memory", "disk", "cpu"]);
        assert!(p[0].message.contains("1000 MB") && p[0].message.contains("1600 MB"));
        h.cpu_pressure = None;
        assert_eq!(
            pressures(&with_cpu, &h).len(),
            2,
            "no PSI file = no CPU pressure"
        );
    }
}
