//! docs/configuration.md `edges[]` and `edge_template`, with their backends.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::ConfigError;
use crate::types::names;

/// One edge (node control plane).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EdgeConfig {
    pub id: String,
    pub addr: String,
    pub advertise: String,
    pub zone: String,
    pub capacity: CapacityConfig,
    pub cpu_overcommit: f64,
    pub mem_overcommit: f64,
    pub disk_overcommit: f64,
    /// MB; 0 = automatic (10% of RAM, at least 128), -1 = off.
    pub mem_reserve_mb: i64,
    /// MB; 0 = automatic (5% of the fs, at least 1024), -1 = off.
    pub disk_reserve_mb: i64,
    pub cpu_pressure_limit: f64,
    pub paused_mem_charge: Option<f64>,
    pub persist_state: Option<bool>,
    pub keep_sandboxes_on_exit: bool,
    pub stopped_retention: f64,
    pub state_dir: String,
    pub agent_dir: String,
    pub images: BTreeMap<String, Vec<String>>,
    pub network: EdgeNetworkConfig,
    pub gpu: serde_json::Value,
    pub backends: BTreeMap<String, BackendConfig>,
}

/// `edges[].network` (docs/configuration.md, docs/network.md): sandbox networking.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EdgeNetworkConfig {
    /// Off (the default), sandboxes have only a loopback interface.
    pub enabled: bool,
    /// The sandboxes' address pool, a /30 each; empty for 10.88.0.0/16.
    pub subnet: String,
    /// The port of the edge's DNS proxy on each sandbox's gateway; 0 for 15353.
    pub dns_port: u16,
}

/// The default `edges[].network.dns_port`.
pub const DEFAULT_DNS_PORT: u16 = 15353;

impl EdgeNetworkConfig {
    /// `subnet`, parsed (10.88.0.0/16 when empty).
    /// Errors: `Invalid` for what is not an IPv4 network with zero host bits, a network
    /// smaller than a /30, or one outside the private ranges (sandbox addresses must never
    /// be public ones, which rules could then name).
    pub fn subnet(&self) -> Result<crate::netpol::Ipv4Net, ConfigError> {
        if self.subnet.is_empty() {
            return Ok(crate::netpol::DEFAULT_SUBNET);
        }
        let bad = |why: String| {
            ConfigError::Invalid(format!(
                "network.subnet {}: {why}",
                names::shown(&self.subnet)
            ))
        };
        let net: crate::netpol::Ipv4Net = self
            .subnet
            .parse()
            .map_err(|e: crate::netpol::RuleProblem| bad(e.to_string()))?;
        crate::netpol::slot_count(net).map_err(|e| bad(e.to_string()))?;
        if !crate::netpol::PRIVATE_RANGES
            .iter()
            .any(|p| p.contains(net.addr()) && p.contains(net.last()))
        {
            return Err(bad(
                "not inside a private range (such as 10.0.0.0/8 or 172.16.0.0/12)".into(),
            ));
        }
        Ok(net)
    }
    /// `dns_port`, 15353 when unset.
    pub fn dns_port(&self) -> u16 {
        if self.dns_port == 0 {
            DEFAULT_DNS_PORT
        } else {
            self.dns_port
        }
    }
}

/// `capacity`: unset fields are measured from the host (real backends) or unlimited (sim).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CapacityConfig {
    pub cpu_cores: f64,
    pub memory_mb: i64,
    pub gpus: i64,
    pub disk_mb: i64,
}

/// One backend of an edge (`edges[].backends.<name>`). Runtime-specific fields live side by
/// side, as in docs/configuration.md; each runtime reads its own.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BackendConfig {
    pub runtime: String,
    pub max_sandboxes: i64,
    pub default_disk_mb: i64,
    pub disk_io: serde_json::Value,
    pub core_sched: Option<bool>,
    // linux
    pub pids_max: i64,
    /// Disks of each size kept attached and mounted ahead of their sandboxes
    /// (docs/architecture.md "Prepared disks"); `None`: 2; 0: none.
    pub prepared_disks: Option<i64>,
    pub pause_reclaim: bool,
    pub warm_pool: BTreeMap<String, i64>,
    pub layer_cache: Option<bool>,
    // firecracker / qemu
    pub kernel: String,
    pub firecracker: String,
    pub jailer: String,
    pub uid_base: i64,
    pub vm_overhead_mb: i64,
    pub erofs_images: bool,
    pub image_pmem: bool,
    pub free_page_reporting: bool,
    pub cold_age_s: f64,
    pub zram_pct: i64,
    pub cold_boot_dirty_tracking: Option<bool>,
    pub qemu: String,
    pub full_init: bool,
    // sim
    pub create_latency_ms: f64,
    pub latency_sigma: f64,
    pub failure_rate: f64,
}

impl BackendConfig {
    pub fn runtime(&self) -> &str {
        if self.runtime.is_empty() {
            "sim"
        } else {
            &self.runtime
        }
    }
    pub fn default_disk_mb(&self) -> i64 {
        if self.default_disk_mb <= 0 {
            10240
        } else {
            self.default_disk_mb
        }
    }
}

impl EdgeConfig {
    pub fn zone(&self) -> &str {
        if self.zone.is_empty() {
            "onprem"
        } else {
            &self.zone
        }
    }
    pub fn cpu_overcommit(&self) -> f64 {
        if self.cpu_overcommit > 0.0 {
            self.cpu_overcommit
        } else {
            8.0
        }
    }
    pub fn mem_overcommit(&self) -> f64 {
        if self.mem_overcommit > 0.0 {
            self.mem_overcommit
        } else {
            1.0
        }
    }
    pub fn disk_overcommit(&self) -> f64 {
        if self.disk_overcommit > 0.0 {
            self.disk_overcommit
        } else {
            1.0
        }
    }
    pub fn stopped_retention(&self) -> f64 {
        if self.stopped_retention > 0.0 {
            self.stopped_retention
        } else {
            600.0
        }
    }
    pub fn state_dir(&self) -> &str {
        if self.state_dir.is_empty() {
            "/var/lib/opendsec"
        } else {
            &self.state_dir
        }
    }
    /// The backends, `{"sim": {}}` when none are configured.
    pub fn backends(&self) -> BTreeMap<String, BackendConfig> {
        if self.backends.is_empty() {
            let mut m = BTreeMap::new();
            m.insert("sim".to_string(), BackendConfig::default());
            m
        } else {
            self.backends.clone()
        }
    }
    /// Whether records are written to disk: on by default when any backend is real.
    pub fn persist_state(&self) -> bool {
        self.persist_state
            .unwrap_or_else(|| self.backends().values().any(|b| b.runtime() != "sim"))
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        names::check_edge_id(&self.id)
            .map_err(|e| ConfigError::Invalid(format!("edges: {}", e.message)))?;
        let id = &self.id;
        self.network.subnet().map_err(|e| match e {
            ConfigError::Invalid(m) => ConfigError::Invalid(format!("edge {id}: {m}")),
            other => other,
        })?;
        if !matches!(self.zone(), "onprem" | "cloud") {
            return Err(ConfigError::Invalid(format!(
                "edge {id}: zone must be onprem or cloud, not {:?}",
                self.zone
            )));
        }
        for (name, b) in self.backends() {
            if !matches!(b.runtime(), "sim" | "linux" | "firecracker" | "qemu") {
                return Err(ConfigError::Invalid(format!(
                    "edge {id}: backend {name}: unknown runtime {:?}",
                    b.runtime
                )));
            }
            if !(0.0..=1.0).contains(&b.failure_rate) {
                return Err(ConfigError::Invalid(format!(
                    "edge {id}: backend {name}: failure_rate must be within 0..1"
                )));
            }
            if b.create_latency_ms < 0.0 || b.latency_sigma < 0.0 {
                return Err(ConfigError::Invalid(format!(
                    "edge {id}: backend {name}: latencies may not be negative"
                )));
            }
        }
        if let Some(c) = self.paused_mem_charge {
            if !(0.0..=1.0).contains(&c) {
                return Err(ConfigError::Invalid(format!(
                    "edge {id}: paused_mem_charge must be within 0..1"
                )));
            }
        }
        Ok(())
    }
}
