//! docs/configuration.md `e2b`: the E2B-compatible gateway (docs/e2b.md).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::ConfigError;

/// The gateway's default `/readyz` and `/metrics` port (docs/configuration.md
/// `fleet.ready_ports`).
pub const DEFAULT_E2B_READY_PORT: u16 = 9467;

/// The `e2b` section. Absent or empty, no gateway runs.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct E2bConfig {
    /// Gateway instances; `opendsec e2b -index N` runs entry N.
    pub gateways: Vec<E2bGateway>,
    /// The project sandboxes are created in (a request may name another with the
    /// `X-OpenDsec-Project` header). Required with gateways.
    pub project: String,
    /// The sandboxes' domain returned to SDKs (`<port>-<sandbox>.<domain>`); empty = none,
    /// callers set `E2B_SANDBOX_URL`.
    pub domain: String,
    /// E2B template id → what a sandbox of it is.
    pub templates: BTreeMap<String, E2bTemplate>,
    /// The settings of a template id that is an image name (holds `/`), and the defaults of
    /// every template's unset fields.
    pub default_template: Option<E2bTemplate>,
    /// The longest timeout a caller may ask for, seconds; 0 = only admission's cap.
    pub max_timeout_s: i64,
    /// Where template builds keep the files their `COPY` steps uploaded (docs/e2b.md
    /// "Template builds"); empty = `opendsec-e2b-builds` in the system's temporary
    /// directory.
    pub build_dir: String,
}

/// The longest `ready_timeout_s` a template may have, seconds (a creation waits that long).
pub const MAX_READY_TIMEOUT_S: i64 = 600;

/// One gateway instance.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct E2bGateway {
    /// Listen address, `host:port` (e.g. `10.0.0.11:7400`).
    pub addr: String,
    /// PEM certificate chain and key: both set, the gateway serves HTTPS itself.
    pub tls_cert: String,
    pub tls_key: String,
    /// Connections served at once (default 4096); one more is closed at once.
    pub max_connections: Option<usize>,
    /// Connections served at once from one client address (default 1024), so that one
    /// client cannot shut the others out. Behind a load balancer, whose few addresses
    /// carry every client, set it to `max_connections`.
    pub max_connections_per_address: Option<usize>,
}

/// What the sandboxes of one E2B template are. Unset fields take `default_template`'s, then
/// the defaults below.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(default, deny_unknown_fields)]
pub struct E2bTemplate {
    /// Image name (`root/py:3.12`) or an edge-local image.
    pub image: String,
    /// Backend; default `container` (the only sandbox backend of this build).
    pub backend: String,
    /// CPU cores; default 2.
    pub cpu: f64,
    /// Memory, MB; default 512.
    pub memory_mb: i64,
    /// Writable disk, MB; 0 = the backend's default.
    pub disk_mb: i64,
    /// Started with `bash -l -c` in every new sandbox of the template.
    pub start_cmd: String,
    /// Wait for this TCP port to listen in the sandbox before handing it out; 0 = none.
    pub ready_port: u16,
    /// Or wait until this shell command (`sh -c`) exits 0 in the sandbox, tried every
    /// half second; empty = none.
    pub ready_cmd: String,
    /// Longest wait for `ready_port` or `ready_cmd`, seconds; default 60.
    pub ready_timeout_s: i64,
}

impl E2bTemplate {
    /// `self` with its unset fields taken from `base`, then from the built-in defaults.
    pub fn over(&self, base: Option<&E2bTemplate>) -> E2bTemplate {
        let d = base.cloned().unwrap_or_default();
        let pick_s = |a: &str, b: &str, c: &str| {
            if !a.is_empty() {
                a.to_string()
            } else if !b.is_empty() {
                b.to_string()
            } else {
                c.to_string()
            }
        };
        let pick_i = |a: i64, b: i64, c: i64| {
            if a > 0 {
                a
            } else if b > 0 {
                b
            } else {
                c
            }
        };
        E2bTemplate {
            image: pick_s(&self.image, &d.image, ""),
            backend: pick_s(&self.backend, &d.backend, "container"),
            cpu: if self.cpu > 0.0 {
                self.cpu
            } else if d.cpu > 0.0 {
                d.cpu
            } else {
                2.0
            },
            memory_mb: pick_i(self.memory_mb, d.memory_mb, 512),
            disk_mb: pick_i(self.disk_mb, d.disk_mb, 0),
            start_cmd: pick_s(&self.start_cmd, &d.start_cmd, ""),
            ready_port: if self.ready_port > 0 {
                self.ready_port
            } else {
                d.ready_port
            },
            ready_cmd: pick_s(&self.ready_cmd, &d.ready_cmd, ""),
            ready_timeout_s: pick_i(self.ready_timeout_s, d.ready_timeout_s, 60),
        }
    }
}

impl E2bConfig {
    /// Checks the section. Errors: `Invalid` naming the field.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(format!("e2b.{m}")));
        if self.gateways.is_empty() {
            if !self.templates.is_empty() || !self.project.is_empty() {
                return bad("gateways: templates or a project are set but no gateway".into());
            }
            return Ok(());
        }
        if self.project.is_empty() {
            return bad("project is required with gateways".into());
        }
        crate::types::names::check_project_path(&self.project)
            .map_err(|e| ConfigError::Invalid(format!("e2b.project: {}", e.message)))?;
        for (i, g) in self.gateways.iter().enumerate() {
            if g.addr.is_empty() {
                return bad(format!("gateways[{i}].addr is required"));
            }
            if g.tls_cert.is_empty() != g.tls_key.is_empty() {
                return bad(format!(
                    "gateways[{i}]: set both tls_cert and tls_key, or neither"
                ));
            }
            if g.max_connections == Some(0) || g.max_connections_per_address == Some(0) {
                return bad(format!(
                    "gateways[{i}]: max_connections and max_connections_per_address must be at least 1"
                ));
            }
        }
        if self.max_timeout_s < 0 {
            return bad("max_timeout_s may not be negative".into());
        }
        if self.domain.contains('/') || self.domain.contains(':') {
            return bad(format!("domain {:?} must be a DNS name", self.domain));
        }
        let all = self.templates.iter().map(|(k, t)| (k.as_str(), t)).chain(
            self.default_template
                .iter()
                .map(|t| ("default_template", t)),
        );
        for (name, t) in all {
            if name.is_empty() || name.len() > 128 {
                return bad(format!("templates: {name:?} must be 1 to 128 characters"));
            }
            let full = t.over(self.default_template.as_ref());
            if name != "default_template" && full.image.is_empty() {
                return bad(format!("templates.{name}.image is required"));
            }
            if t.cpu < 0.0 || !t.cpu.is_finite() || t.memory_mb < 0 || t.disk_mb < 0 {
                return bad(format!(
                    "templates.{name}: cpu, memory_mb and disk_mb must be positive"
                ));
            }
            if !(0..=MAX_READY_TIMEOUT_S).contains(&t.ready_timeout_s) {
                return bad(format!(
                    "templates.{name}.ready_timeout_s must be 0 to {MAX_READY_TIMEOUT_S}"
                ));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<(), String> {
        let c: E2bConfig = serde_json::from_str(text).map_err(|e| e.to_string())?;
        c.validate().map_err(|e| e.to_string())
    }

    #[test]
    fn sections_are_checked_naming_the_field() {
        assert_eq!(parse("{}"), Ok(()));
        let ok = r#"{"gateways":[{"addr":"127.0.0.1:7400","max_connections":100,
            "max_connections_per_address":100}],"project":"root/e2b",
            "templates":{"base":{"image":"root/py:3.12","cpu":1}},"max_timeout_s":3600}"#;
        assert_eq!(parse(ok), Ok(()));
        for (text, want) in [
            (r#"{"addr":":3000"}"#, "unknown field `addr`"),
            (
                r#"{"gateways":[{"addr":"a:1"}]}"#,
                "e2b.project is required",
            ),
            (r#"{"project":"root"}"#, "no gateway"),
            (
                r#"{"gateways":[{}],"project":"root"}"#,
                "e2b.gateways[0].addr is required",
            ),
            (
                r#"{"gateways":[{"addr":"a:1","tls_cert":"c"}],"project":"root"}"#,
                "set both tls_cert and tls_key",
            ),
            (
                r#"{"gateways":[{"addr":"a:1"}],"project":"root","templates":{"base":{}}}"#,
                "e2b.templates.base.image is required",
            ),
            (
                r#"{"gateways":[{"addr":"a:1"}],"project":"root",
                    "templates":{"ci":{"image":"root/ci:1","ready_port":1,"ready_timeout_s":601}}}"#,
                "ready_timeout_s must be 0 to 600",
            ),
            (
                r#"{"gateways":[{"addr":"a:1","max_connections_per_address":0}],"project":"root"}"#,
                "must be at least 1",
            ),
            (
                r#"{"gateways":[{"addr":"a:1","max_connections":-5}],"project":"root"}"#,
                "invalid value",
            ),
            (
                r#"{"gateways":[{"addr":"a:1"}],"project":"root","max_timeout_s":-1}"#,
                "max_timeout_s may not be negative",
            ),
            (
                r#"{"gateways":[{"addr":"a:1"}],"project":"root","domain":"http://x"}"#,
                "must be a DNS name",
            ),
        ] {
            let e = parse(text).unwrap_err();
            assert!(e.contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn a_template_takes_unset_fields_from_the_default_then_built_ins() {
        let base = E2bTemplate {
            image: "root/py:3.12".into(),
            memory_mb: 1024,
            ..Default::default()
        };
        let t = E2bTemplate {
            cpu: 1.0,
            ..Default::default()
        }
        .over(Some(&base));
        assert_eq!(
            t,
            E2bTemplate {
                image: "root/py:3.12".into(),
                backend: "container".into(),
                cpu: 1.0,
                memory_mb: 1024,
                disk_mb: 0,
                start_cmd: String::new(),
                ready_port: 0,
                ready_cmd: String::new(),
                ready_timeout_s: 60,
            }
        );
    }
}
