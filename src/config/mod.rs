//! The cluster config: one JSON file shared by every role (docs/configuration.md). Read once at
//! start, validated before any socket or mount, then passed down as plain data.
//! Durations are seconds (fractions allowed); 0 or absent means the default.

mod e2b;
mod edge;
pub use e2b::{E2bConfig, E2bGateway, E2bTemplate, DEFAULT_E2B_READY_PORT};
pub use edge::{BackendConfig, CapacityConfig, EdgeConfig, EdgeNetworkConfig, DEFAULT_DNS_PORT};

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::types::names;

/// A config file could not be read or is invalid; the message names the field.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("reading config {path}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("parsing config {path}")]
    Parse {
        path: String,
        source: serde_json::Error,
    },
    #[error("invalid config: {0}")]
    Invalid(String),
}

/// The whole cluster config (docs/configuration.md).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    pub tls: TlsConfig,
    pub service_token: String,
    pub iam: IamConfig,
    pub watcher: WatcherConfig,
    pub apiserver: Vec<ApiserverConfig>,
    pub placement: PlacementConfig,
    pub admission: AdmissionConfig,
    pub image_store: ImageStoreConfig,
    pub network: NetworkConfig,
    pub edges: Vec<EdgeConfig>,
    pub edge_template: Option<EdgeConfig>,
    pub fleet: serde_json::Value,
    pub e2b: E2bConfig,
    pub extensions: serde_json::Value,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TlsConfig {
    pub dir: String,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ImageStoreConfig {
    pub root: String,
}

/// docs/configuration.md `network`: the cluster-wide network policy (docs/network.md).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NetworkConfig {
    /// Rule set name → destinations (domains, IPv4 addresses or networks, with optional
    /// `:port[/protocol]`).
    pub rule_sets: BTreeMap<String, Vec<String>>,
    /// Rule → allowed, for every sandbox, under its own `network_rules`.
    pub default_rules: BTreeMap<String, bool>,
    /// Resolvers of the edges' DNS proxies, `address` or `address:port`; empty = the host's
    /// `/etc/resolv.conf`.
    pub upstream_dns: Vec<String>,
}

impl NetworkConfig {
    /// The rule sets and default rules, parsed and checked.
    /// Errors: `Invalid` naming the rule set or default rule and the entry.
    pub fn rules(&self) -> Result<crate::netpol::ClusterRules, ConfigError> {
        crate::netpol::ClusterRules::new(&self.rule_sets, &self.default_rules)
            .map_err(|e| ConfigError::Invalid(e.to_string()))
    }
    /// `upstream_dns` as socket addresses (port 53 unless given); empty = use the host's.
    /// Errors: `Invalid` naming the entry that is not an IP address or address:port.
    pub fn upstream_dns(&self) -> Result<Vec<std::net::SocketAddr>, ConfigError> {
        self.upstream_dns
            .iter()
            .map(|s| {
                let a = s
                    .parse::<std::net::SocketAddr>()
                    .or_else(|_| s.parse().map(|ip| std::net::SocketAddr::new(ip, 53)))
                    .ok()
                    .filter(|a| a.port() != 0);
                a.ok_or_else(|| {
                    ConfigError::Invalid(format!(
                        "network.upstream_dns: {} is not an IP address or address:port",
                        names::shown(s)
                    ))
                })
            })
            .collect()
    }
}

/// docs/configuration.md `iam`: a standalone IAM at `addr` (state in `state`), or Raft
/// `replicas` (docs/iam-replicas.md).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IamConfig {
    pub replicas: Vec<IamReplica>,
    pub addr: String,
    /// State file; empty = memory only.
    pub state: String,
    pub admin_id: String,
    pub admin_token: String,
    pub admin_token_file: String,
    pub root_quota: BTreeMap<String, f64>,
    pub max_token_ttl_s: i64,
}

/// One IAM replica (docs/iam-replicas.md).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct IamReplica {
    /// A decimal number, unique among the replicas (also its certificate's id).
    pub id: String,
    /// Its `Iam` gRPC address, `host:port`.
    pub addr: String,
    /// Its Raft address, `host:port`, reached by the other replicas only.
    pub raft_addr: String,
    /// Its Raft log and snapshots (default `/var/lib/opendsec/iam`).
    pub data_dir: String,
}

/// A replica id: a decimal number from 0 to 999999999 without leading zeros.
pub fn valid_replica_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= 9
        && id.bytes().all(|b| b.is_ascii_digit())
        && (id == "0" || !id.starts_with('0'))
}

impl IamConfig {
    /// The addresses IAM's clients call: every replica's, or the standalone `addr`.
    pub fn addrs(&self) -> Vec<String> {
        if self.replicas.is_empty() {
            vec![self.addr.clone()]
        } else {
            self.replicas.iter().map(|r| r.addr.clone()).collect()
        }
    }

    /// The replica `id`, if the config has it.
    pub fn replica(&self, id: &str) -> Option<&IamReplica> {
        self.replicas.iter().find(|r| r.id == id)
    }
}

impl IamReplica {
    /// The replica id as a number (checked by `Config::validate`).
    pub fn number(&self) -> u64 {
        self.id.parse().unwrap_or(0)
    }

    /// `data_dir`, or its default.
    pub fn data_dir(&self) -> &str {
        if self.data_dir.is_empty() {
            "/var/lib/opendsec/iam"
        } else {
            &self.data_dir
        }
    }
}

/// docs/configuration.md `watcher`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WatcherConfig {
    pub replicas: Vec<WatcherReplica>,
    pub addr: String,
    pub probe_interval: f64,
    pub probe_timeout: f64,
    pub unhealthy_after: u32,
    pub reconcile_interval: f64,
    pub reconcile_min_age: f64,
    pub lost_edge_grace: f64,
    pub unbound_max_age: f64,
    pub lock_ttl: f64,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WatcherReplica {
    pub id: String,
    pub addr: String,
}

/// docs/configuration.md `apiserver[]`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ApiserverConfig {
    pub addr: String,
    pub audit_dir: String,
    pub audit_max_mb: u64,
    pub audit_keep: u32,
    pub audit_runtime: bool,
    pub snapshot_refresh: f64,
}

/// docs/configuration.md `placement`.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PlacementConfig {
    pub k: u32,
    pub max_attempts: u32,
    pub reject_penalty: f64,
    pub overlay_grace: f64,
    pub usage_floor: f64,
    pub burst_threshold: f64,
    pub burst_eligible_images: Vec<String>,
}

/// docs/configuration.md `admission`. Timeouts: 0 = default, -1 = none. Rates: -1 disables.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AdmissionConfig {
    pub default_ttl_running_stop_s: i64,
    pub default_ttl_max_s: i64,
    pub max_ttl_max_s: i64,
    pub request_rate: f64,
    pub request_burst: f64,
    pub create_rate: f64,
    pub create_burst: f64,
    pub auth_fail_rate: f64,
    pub max_inflight_creates: i64,
}

fn or(v: f64, d: f64) -> f64 {
    if v > 0.0 {
        v
    } else {
        d
    }
}

impl WatcherConfig {
    pub fn probe_interval(&self) -> f64 {
        or(self.probe_interval, 1.0)
    }
    pub fn probe_timeout(&self) -> f64 {
        or(self.probe_timeout, 0.5)
    }
    pub fn unhealthy_after(&self) -> u32 {
        if self.unhealthy_after == 0 {
            3
        } else {
            self.unhealthy_after
        }
    }
    pub fn reconcile_interval(&self) -> f64 {
        or(self.reconcile_interval, 30.0)
    }
    pub fn reconcile_min_age(&self) -> f64 {
        or(self.reconcile_min_age, 60.0)
    }
    pub fn lost_edge_grace(&self) -> f64 {
        or(self.lost_edge_grace, 120.0)
    }
    pub fn unbound_max_age(&self) -> f64 {
        or(self.unbound_max_age, 600.0)
    }
    /// Lease time of the reconciliation lock, seconds (default 10).
    pub fn lock_ttl(&self) -> f64 {
        or(self.lock_ttl, 10.0)
    }
    /// The replica entry `id` of `replicas`.
    pub fn replica(&self, id: &str) -> Option<&WatcherReplica> {
        self.replicas.iter().find(|r| r.id == id)
    }
    /// Checks `replicas` (ids usable in certificates, unique, with addresses; not together
    /// with `addr`) and `lock_ttl` (3 to 3600 s: a holder counts on TTL − 2 s). `Invalid`.
    fn check(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.lock_ttl != 0.0 && !(3.0..=3600.0).contains(&self.lock_ttl) {
            return bad(format!(
                "watcher.lock_ttl {}: from 3 to 3600 seconds (a holder counts on TTL - 2 s)",
                self.lock_ttl
            ));
        }
        if !self.replicas.is_empty() && !self.addr.is_empty() {
            return bad("watcher: set replicas or addr, not both".into());
        }
        let mut seen = std::collections::HashSet::new();
        for r in &self.replicas {
            if crate::pki::Identity::new(crate::pki::Role::Watcher, &r.id).is_err() {
                return bad(format!(
                    "watcher.replicas: id {:?}: 1 to 64 of A-Z a-z 0-9 . _ -",
                    r.id
                ));
            }
            if !seen.insert(r.id.as_str()) {
                return bad(format!("watcher.replicas: duplicate id {:?}", r.id));
            }
            if r.addr.is_empty() {
                return bad(format!("watcher.replicas: replica {:?} has no addr", r.id));
            }
        }
        Ok(())
    }
    /// The watcher addresses, single or replicated.
    pub fn addrs(&self) -> Vec<String> {
        if self.replicas.is_empty() {
            if self.addr.is_empty() {
                vec![]
            } else {
                vec![self.addr.clone()]
            }
        } else {
            self.replicas.iter().map(|r| r.addr.clone()).collect()
        }
    }
}

impl ApiserverConfig {
    pub fn audit_max_mb(&self) -> u64 {
        if self.audit_max_mb == 0 {
            256
        } else {
            self.audit_max_mb
        }
    }
    pub fn audit_keep(&self) -> u32 {
        if self.audit_keep == 0 {
            8
        } else {
            self.audit_keep
        }
    }
    pub fn snapshot_refresh(&self) -> f64 {
        or(self.snapshot_refresh, 1.0)
    }
}

impl PlacementConfig {
    pub fn k(&self) -> usize {
        if self.k == 0 {
            2
        } else {
            self.k as usize
        }
    }
    pub fn max_attempts(&self) -> u32 {
        if self.max_attempts == 0 {
            3
        } else {
            self.max_attempts
        }
    }
    pub fn reject_penalty(&self) -> f64 {
        or(self.reject_penalty, 2.0)
    }
    pub fn overlay_grace(&self) -> f64 {
        or(self.overlay_grace, 2.0)
    }
    /// -1 counts actual use always (floor 0).
    pub fn usage_floor(&self) -> f64 {
        if self.usage_floor < 0.0 {
            0.0
        } else {
            or(self.usage_floor, 0.2)
        }
    }
}

impl AdmissionConfig {
    pub fn default_ttl_running_stop_s(&self) -> i64 {
        if self.default_ttl_running_stop_s == 0 {
            3600
        } else {
            self.default_ttl_running_stop_s
        }
    }
    pub fn default_ttl_max_s(&self) -> i64 {
        if self.default_ttl_max_s == 0 {
            86400
        } else {
            self.default_ttl_max_s
        }
    }
    pub fn max_ttl_max_s(&self) -> i64 {
        if self.max_ttl_max_s == 0 {
            604800
        } else {
            self.max_ttl_max_s
        }
    }
    /// Calls per second per principal; `None` = unlimited.
    pub fn request_rate(&self) -> Option<f64> {
        rate(self.request_rate, 10000.0)
    }
    pub fn request_burst(&self) -> f64 {
        or(self.request_burst, 2.0 * self.request_rate().unwrap_or(0.0))
    }
    pub fn create_rate(&self) -> Option<f64> {
        rate(self.create_rate, 2000.0)
    }
    pub fn create_burst(&self) -> f64 {
        or(self.create_burst, 32768.0)
    }
    pub fn auth_fail_rate(&self) -> Option<f64> {
        rate(self.auth_fail_rate, 5.0)
    }
    pub fn max_inflight_creates(&self) -> Option<usize> {
        if self.max_inflight_creates < 0 {
            None
        } else if self.max_inflight_creates == 0 {
            Some(2048)
        } else {
            Some(self.max_inflight_creates as usize)
        }
    }
}

fn rate(v: f64, d: f64) -> Option<f64> {
    if v < 0.0 {
        None
    } else if v == 0.0 {
        Some(d)
    } else {
        Some(v)
    }
}

impl IamConfig {
    pub fn admin_id(&self) -> &str {
        if self.admin_id.is_empty() {
            "admin"
        } else {
            &self.admin_id
        }
    }
    /// The admin token, from `admin_token` or `admin_token_file`.
    pub fn admin_token(&self) -> Result<String, ConfigError> {
        if !self.admin_token.is_empty() {
            return Ok(self.admin_token.clone());
        }
        if !self.admin_token_file.is_empty() {
            return std::fs::read_to_string(&self.admin_token_file)
                .map(|s| s.trim().to_string())
                .map_err(|source| ConfigError::Read {
                    path: self.admin_token_file.clone(),
                    source,
                });
        }
        Ok(String::new())
    }
}

impl Config {
    /// Reads and validates a config file.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let cfg: Config = serde_json::from_str(&text).map_err(|source| ConfigError::Parse {
            path: path.display().to_string(),
            source,
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the constraints of docs/configuration.md that can be checked without the machine.
    /// `iam.replicas`: ids decimal and unique, addresses set and distinct, at most 7.
    fn check_iam_replicas(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        let reps = &self.iam.replicas;
        if reps.len() > 7 {
            return bad(format!(
                "iam.replicas: {} replicas; 1, 3 or 5 are usual, at most 7",
                reps.len()
            ));
        }
        let mut ids = std::collections::BTreeSet::new();
        let mut addrs = std::collections::BTreeSet::new();
        for r in reps {
            if !valid_replica_id(&r.id) {
                return bad(format!(
                    "iam.replicas: id {} is not a decimal number (0 to 999999999)",
                    names::shown(&r.id)
                ));
            }
            if !ids.insert(r.id.clone()) {
                return bad(format!("iam.replicas: id {} appears twice", r.id));
            }
            for (what, a) in [("addr", &r.addr), ("raft_addr", &r.raft_addr)] {
                if a.is_empty() {
                    return bad(format!("iam.replicas: replica {} has no {what}", r.id));
                }
                if !addrs.insert(a.clone()) {
                    return bad(format!("iam.replicas: address {a} appears twice"));
                }
            }
        }
        if !reps.is_empty()
            && self.iam.admin_token.is_empty()
            && self.iam.admin_token_file.is_empty()
        {
            return bad(
                "iam.replicas: set iam.admin_token or iam.admin_token_file (replicas bootstrap with it)"
                    .into(),
            );
        }
        Ok(())
    }

    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.tls.dir.is_empty() && self.service_token.is_empty() {
            return bad("at least one of tls.dir and service_token must be set".into());
        }
        if !self.tls.dir.is_empty() && !self.service_token.is_empty() {
            return bad(
                "tls.dir and service_token are both set: the service token is for development \
                 clusters without TLS; remove it"
                    .into(),
            );
        }
        let tok = self.iam.admin_token()?;
        if tok.contains("change-me") {
            return bad(
                "iam.admin_token still holds the placeholder \"change-me\"; set a real secret"
                    .into(),
            );
        }
        if !tok.is_empty() {
            names::parse_token(&tok)
                .map_err(|e| ConfigError::Invalid(format!("iam.admin_token: {}", e.message)))?;
        }
        names::check_principal_id(self.iam.admin_id())
            .map_err(|e| ConfigError::Invalid(format!("iam.admin_id: {}", e.message)))?;
        for k in self.iam.root_quota.keys() {
            if !names::QUOTA_KEYS.contains(&k.as_str()) {
                return bad(format!("iam.root_quota: unknown key {k:?}"));
            }
        }
        self.check_iam_replicas()?;
        self.watcher.check()?;
        if self.iam.max_token_ttl_s < 0 {
            return bad("iam.max_token_ttl_s may not be negative".into());
        }
        if self.admission.max_ttl_max_s < 0 {
            return bad("admission.max_ttl_max_s may not be negative".into());
        }
        self.network.rules()?;
        self.network.upstream_dns()?;
        // Parsed so that a spec-shaped file loads, but nothing reads them yet: a value set
        // there would be silently ignored, so it is refused like an unknown field.
        unused("fleet", &self.fleet, "fleet management")?;
        self.e2b.validate()?;
        if let Some(t) = &self.edge_template {
            t.network.subnet().map_err(|e| match e {
                ConfigError::Invalid(m) => ConfigError::Invalid(format!("edge_template: {m}")),
                other => other,
            })?;
        }
        let mut seen = std::collections::HashSet::new();
        for e in &self.edges {
            e.validate()?;
            if !seen.insert(e.id.clone()) {
                return bad(format!("edges: duplicate id {:?}", e.id));
            }
        }
        if self.placement.k > 64 {
            return bad("placement.k must be at most 64".into());
        }
        Ok(())
    }

    /// The config of edge `id`: its entry in `edges`, else `edge_template` with that id.
    pub fn edge(&self, id: &str) -> Option<EdgeConfig> {
        if let Some(e) = self.edges.iter().find(|e| e.id == id) {
            return Some(e.clone());
        }
        self.edge_template.clone().map(|mut t| {
            t.id = id.to_string();
            t
        })
    }
}

/// Refuses a config subtree that this build parses but does not use, unless it sets nothing
/// (absent, `null`, `{}` or `[]`). Errors: `Invalid` naming the field and the missing feature.
pub(crate) fn unused(field: &str, v: &serde_json::Value, feature: &str) -> Result<(), ConfigError> {
    let empty = match v {
        serde_json::Value::Null => true,
        serde_json::Value::Object(m) => m.is_empty(),
        serde_json::Value::Array(a) => a.is_empty(),
        _ => false,
    };
    if empty {
        return Ok(());
    }
    Err(ConfigError::Invalid(format!(
        "{field}: {feature} is not built yet, so this field would be ignored; remove it"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> Config {
        let mut c = Config {
            service_token: "s".into(),
            ..Default::default()
        };
        c.iam.admin_token = "dsk.admin.secret".into();
        c
    }

    #[test]
    fn placeholder_admin_token_is_refused() {
        let mut c = base();
        c.iam.admin_token = "dsk.admin.change-me-please".into();
        assert!(c.validate().is_err());
        assert!(base().validate().is_ok());
    }

    #[test]
    fn watcher_replicas_and_lock_ttl_are_checked() {
        let rep = |id: &str| WatcherReplica {
            id: id.into(),
            addr: format!("10.0.0.1:72{}", id.len()),
        };
        let mut c = base();
        c.watcher.replicas = vec![rep("0"), rep("w-1")];
        c.validate().unwrap();
        assert_eq!(c.watcher.lock_ttl(), 10.0);
        assert_eq!(
            c.watcher.replica("w-1").map(|r| r.addr.as_str()),
            Some("10.0.0.1:723")
        );
        type Change<'a> = Box<dyn Fn(&mut Config) + 'a>;
        let cases: Vec<(Change, &str)> = vec![
            (
                Box::new(|c| c.watcher.replicas[1].id = "0".into()),
                "duplicate id",
            ),
            (
                Box::new(|c| c.watcher.replicas[1].id = "a/b".into()),
                "id \"a/b\"",
            ),
            (
                Box::new(|c| c.watcher.replicas[1].addr.clear()),
                "has no addr",
            ),
            (
                Box::new(|c| c.watcher.addr = "10.0.0.9:7200".into()),
                "not both",
            ),
            (
                Box::new(|c| c.watcher.lock_ttl = 2.5),
                "from 3 to 3600 seconds",
            ),
            (
                Box::new(|c| c.watcher.lock_ttl = 3601.0),
                "from 3 to 3600 seconds",
            ),
            (
                Box::new(|c| c.watcher.lock_ttl = f64::NAN),
                "from 3 to 3600 seconds",
            ),
        ];
        for (change, want) in cases {
            let mut c = c.clone();
            change(&mut c);
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{e} lacks {want}");
        }
    }

    #[test]
    fn iam_replicas_are_checked() {
        let rep = |id: &str, port: u16| IamReplica {
            id: id.into(),
            addr: format!("10.0.0.{port}:7001"),
            raft_addr: format!("10.0.0.{port}:7011"),
            data_dir: String::new(),
        };
        let mut c = base();
        c.iam.replicas = vec![rep("0", 1), rep("1", 2), rep("2", 3)];
        c.validate().unwrap();
        assert_eq!(c.iam.addrs().len(), 3);
        assert_eq!(c.iam.replica("2").map(IamReplica::number), Some(2));
        assert_eq!(c.iam.replicas[0].data_dir(), "/var/lib/opendsec/iam");
        type Change<'a> = Box<dyn Fn(&mut Config) + 'a>;
        let cases: Vec<(Change, &str)> = vec![
            (
                Box::new(|c| c.iam.replicas[1].id = "a".into()),
                "not a decimal number",
            ),
            (
                Box::new(|c| c.iam.replicas[1].id = "01".into()),
                "not a decimal number",
            ),
            (
                Box::new(|c| c.iam.replicas[1].id = "".into()),
                "not a decimal number",
            ),
            (
                Box::new(|c| c.iam.replicas[1].id = "0".into()),
                "appears twice",
            ),
            (
                Box::new(|c| c.iam.replicas[1].raft_addr.clear()),
                "has no raft_addr",
            ),
            (Box::new(|c| c.iam.replicas[1].addr.clear()), "has no addr"),
            (
                Box::new(|c| c.iam.replicas[1].raft_addr = c.iam.replicas[0].addr.clone()),
                "appears twice",
            ),
            (Box::new(|c| c.iam.admin_token.clear()), "admin_token"),
            (
                Box::new(|c| {
                    let more: Vec<IamReplica> =
                        (3..8).map(|i| rep(&i.to_string(), 10 + i as u16)).collect();
                    c.iam.replicas.extend(more);
                }),
                "at most 7",
            ),
        ];
        for (change, want) in cases {
            let mut bad = c.clone();
            change(&mut bad);
            let e = bad.validate().unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
    }

    #[test]
    fn unknown_fields_are_refused() {
        let r: Result<Config, _> = serde_json::from_str(r#"{"service_token":"x","admision":{}}"#);
        assert!(r.is_err());
    }

    #[test]
    fn tls_or_a_service_token_but_not_both() {
        let mut c = Config::default();
        c.iam.admin_token = "dsk.admin.secret".into();
        let e = c.validate().unwrap_err().to_string();
        assert!(
            e.contains("at least one of tls.dir and service_token"),
            "{e}"
        );
        c.tls.dir = "/etc/opendsec/pki".into();
        c.validate().unwrap();
        c.service_token = "s".into();
        let e = c.validate().unwrap_err().to_string();
        assert!(e.contains("both set"), "{e}");
        c.tls.dir.clear();
        c.validate().unwrap();
    }

    #[test]
    fn unused_subtrees_are_refused_when_set() {
        let set = [r#"{"fleet":{"cloud":"aws"}}"#];
        for text in set {
            let mut c: Config = serde_json::from_str(text).unwrap();
            c.service_token = "s".into();
            c.iam.admin_token = "dsk.admin.secret".into();
            let e = c.validate().unwrap_err().to_string();
            assert!(e.contains("is not built yet"), "{text}: {e}");
        }
        let empty = [
            r#"{"network":{}}"#,
            r#"{"network":{"default_rules":{"*":true}}}"#,
            r#"{"network":{"upstream_dns":["10.0.0.2","192.0.2.53:5353"]}}"#,
            r#"{"fleet":null}"#,
            r#"{"edges":[{"id":"n1"}]}"#,
        ];
        for text in empty {
            let mut c: Config = serde_json::from_str(text).unwrap();
            c.service_token = "s".into();
            c.iam.admin_token = "dsk.admin.secret".into();
            c.validate().unwrap_or_else(|e| panic!("{text}: {e}"));
        }
    }

    #[test]
    fn edge_network_is_checked() {
        let with = |net: &str| -> Result<(), String> {
            let text = format!(r#"{{"edges":[{{"id":"n1","network":{net}}}]}}"#);
            let mut c: Config = serde_json::from_str(&text).map_err(|e| e.to_string())?;
            c.service_token = "s".into();
            c.iam.admin_token = "dsk.admin.secret".into();
            c.validate().map_err(|e| e.to_string())
        };
        with(r#"{"enabled":true}"#).unwrap();
        with(r#"{"enabled":true,"subnet":"172.20.0.0/22","dns_port":5300}"#).unwrap();
        let c: Config =
            serde_json::from_str(r#"{"edges":[{"id":"n1","network":{"enabled":true}}]}"#).unwrap();
        let n = &c.edges[0].network;
        assert_eq!(n.subnet().unwrap().to_string(), "10.88.0.0/16");
        assert_eq!(n.dns_port(), 15353);
        assert!(with(r#"{"bridge":"br0"}"#)
            .unwrap_err()
            .contains("unknown field"));
        for (net, want) in [
            (
                r#"{"subnet":"10.88.0.1/16"}"#,
                "invalid config: edge n1: network.subnet \"10.88.0.1/16\": bad IPv4 network: \
                 host bits set; the network is 10.88.0.0/16",
            ),
            (
                r#"{"subnet":"10.88.0.0/31"}"#,
                "invalid config: edge n1: network.subnet \"10.88.0.0/31\": network subnet \
                 10.88.0.0/31: too small for one sandbox (a /30 at least)",
            ),
            (
                r#"{"subnet":"192.0.2.0/24"}"#,
                "invalid config: edge n1: network.subnet \"192.0.2.0/24\": not inside a \
                 private range (such as 10.0.0.0/8 or 172.16.0.0/12)",
            ),
        ] {
            assert_eq!(with(net).unwrap_err(), want, "{net}");
        }
    }

    #[test]
    fn network_rules_are_checked_first() {
        let cases = [
            (
                r#"{"network":{"rule_sets":{"pypi":["pypi.org:0"]}}}"#,
                "invalid config: network.rule_sets \"pypi\": entry \"pypi.org:0\": port \
                 outside 1-65535",
            ),
            (
                r#"{"network":{"default_rules":{"npm":true}}}"#,
                "invalid config: network.default_rules: network rule \"npm\": no rule set \
                 named \"npm\" in network.rule_sets",
            ),
            (
                r#"{"network":{"upstream_dns":["dns.example"]}}"#,
                "invalid config: network.upstream_dns: \"dns.example\" is not an IP address \
                 or address:port",
            ),
        ];
        for (text, want) in cases {
            let mut c: Config = serde_json::from_str(text).unwrap();
            c.service_token = "s".into();
            c.iam.admin_token = "dsk.admin.secret".into();
            assert_eq!(c.validate().unwrap_err().to_string(), want, "{text}");
        }
        let c: Config = serde_json::from_str(
            r#"{"network":{"rule_sets":{"mirror":["10.30.0.10:443/tcp"]},
                "default_rules":{"mirror":true},"upstream_dns":["10.0.0.2","[::1]:5353"]}}"#,
        )
        .unwrap();
        assert_eq!(c.network.rules().unwrap().defaults().len(), 1);
        assert_eq!(
            c.network.upstream_dns().unwrap(),
            [
                "10.0.0.2:53".parse().unwrap(),
                "[::1]:5353".parse().unwrap()
            ]
        );
        let r: Result<Config, _> = serde_json::from_str(r#"{"network":{"rulesets":{}}}"#);
        assert!(r.is_err());
    }

    #[test]
    fn defaults_follow_the_spec() {
        let c = base();
        assert_eq!(c.admission.max_ttl_max_s(), 604800);
        assert_eq!(c.admission.create_burst(), 32768.0);
        assert_eq!(c.admission.request_burst(), 20000.0);
        assert_eq!(c.placement.k(), 2);
        assert_eq!(c.watcher.unhealthy_after(), 3);
        assert_eq!(c.iam.admin_id(), "admin");
    }
}
