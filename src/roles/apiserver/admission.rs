//! Admission (docs/configuration.md `admission`): per-principal token buckets for calls and
//! creations, and the defaults and limits of docs/configuration.md. A single creation over the rate is
//! `rate_limited`; a batch waits for its tokens instead, so rate limiting never fails part
//! of a batch.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::config::AdmissionConfig;
use crate::netpol::{ClusterRules, MAX_NETWORK_RULES};
use crate::pb;
use crate::types::{names, Failure};

/// A token bucket: `rate` tokens per second, at most `burst` banked.
#[derive(Debug, Clone)]
struct Bucket {
    tokens: f64,
    last: Instant,
}

/// Buckets keyed by principal; `None` rate = unlimited.
pub struct Limiter {
    rate: Option<f64>,
    burst: f64,
    buckets: Mutex<HashMap<String, Bucket>>,
}

impl Limiter {
    pub fn new(rate: Option<f64>, burst: f64) -> Limiter {
        Limiter {
            rate,
            burst: burst.max(1.0),
            buckets: Mutex::new(HashMap::new()),
        }
    }

    /// Takes `n` tokens now if the bucket holds them; otherwise takes nothing and returns
    /// how long until it would.
    pub fn try_take(&self, key: &str, n: f64) -> Result<(), Duration> {
        let Some(rate) = self.rate else { return Ok(()) };
        let now = Instant::now();
        let mut m = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() > 100_000 {
            // Idle full buckets carry no information; dropping them bounds memory.
            let burst = self.burst;
            m.retain(|_, b| b.tokens + now.duration_since(b.last).as_secs_f64() * rate < burst);
        }
        let b = m.entry(key.to_string()).or_insert(Bucket {
            tokens: self.burst,
            last: now,
        });
        b.tokens = (b.tokens + now.duration_since(b.last).as_secs_f64() * rate).min(self.burst);
        b.last = now;
        if b.tokens >= n {
            b.tokens -= n;
            Ok(())
        } else {
            Err(Duration::from_secs_f64(((n - b.tokens) / rate).max(0.001)))
        }
    }

    /// Waits until `n` tokens (at most the burst at a time) are taken.
    pub async fn take(&self, key: &str, n: f64) {
        let mut left = n;
        while left > 0.0 {
            let chunk = left.min(self.burst);
            match self.try_take(key, chunk) {
                Ok(()) => left -= chunk,
                Err(wait) => tokio::time::sleep(wait.min(Duration::from_millis(200))).await,
            }
        }
    }
}

/// The most any one request may ask for: beyond these a value is absurd, not ambitious.
const MAX_CPU: f64 = 4096.0;
const MAX_MEMORY_MB: i64 = 64 << 20;
const MAX_DISK_MB: i64 = 64 << 20;
const MAX_GPUS: i32 = 64;
const MAX_LABELS: usize = 64;
const MAX_TEXT: usize = 256;
/// At most this many `readonly_paths` and `masked_paths` together (each is a mount).
const MAX_RESTRICTED_PATHS: usize = 64;

/// Checks network rules (a spec's `network_rules`, an `UpdateNetwork`'s `rules`) as the
/// edges will read them: at most [`MAX_NETWORK_RULES`], each well formed, rule sets known to
/// `net` (docs/network.md "Rules"). Errors: `invalid`, the message starting with `field` and
/// naming the offending entry.
pub fn check_network_rules(
    field: &str,
    rules: &HashMap<String, bool>,
    net: &ClusterRules,
) -> Result<(), Failure> {
    if rules.len() > MAX_NETWORK_RULES {
        return Err(Failure::invalid(format!(
            "{field}: {} given, at most {MAX_NETWORK_RULES}",
            rules.len()
        )));
    }
    net.check(rules)
        .map_err(|e| Failure::invalid(format!("{field}: {e}")))?;
    Ok(())
}

/// Fills the defaults (docs/concepts.md "Sandboxes") into `spec` and checks every field;
/// `net` (the config's rule sets and default rules) checks `network_rules` (docs/network.md
/// "Rules"). Errors are `invalid`, naming the field and value (a network rule by its entry);
/// nothing is changed on error.
pub fn normalize_spec(
    spec: &pb::SandboxSpec,
    adm: &AdmissionConfig,
    net: &ClusterRules,
) -> Result<pb::SandboxSpec, Failure> {
    let mut s = spec.clone();
    if s.backend.is_empty() {
        return Err(Failure::invalid(
            "backend is required (microvm, container, fncall, fullvm or sim)",
        ));
    }
    if s.backend.len() > 64
        || !s
            .backend
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(Failure::invalid(format!("unknown backend {:?}", s.backend)));
    }
    if s.cpu_cores_limit == 0.0 {
        s.cpu_cores_limit = 1.0;
    }
    if !s.cpu_cores_limit.is_finite() || s.cpu_cores_limit < 0.0 || s.cpu_cores_limit > MAX_CPU {
        return Err(Failure::invalid(format!(
            "cpu_cores_limit {} must be within (0, {MAX_CPU}]",
            s.cpu_cores_limit
        )));
    }
    if s.memory_limit_mb == 0 {
        s.memory_limit_mb = 2048;
    }
    if s.memory_limit_mb < 0 || s.memory_limit_mb > MAX_MEMORY_MB {
        return Err(Failure::invalid(format!(
            "memory_limit_mb {} must be within [1, {MAX_MEMORY_MB}]",
            s.memory_limit_mb
        )));
    }
    if s.disk_mb < 0 || s.disk_mb > MAX_DISK_MB {
        return Err(Failure::invalid(format!(
            "disk_mb {} must be within [0, {MAX_DISK_MB}]",
            s.disk_mb
        )));
    }
    if s.gpus < 0 || s.gpus > MAX_GPUS {
        return Err(Failure::invalid(format!(
            "gpus {} must be within [0, {MAX_GPUS}]",
            s.gpus
        )));
    }
    if s.gpus > 0 {
        // Placement would count the GPUs but no backend attaches one: refuse rather than
        // hand out a sandbox without what was asked for.
        return Err(Failure::invalid(format!(
            "gpus {}: GPU sandboxes are not built yet; set gpus to 0",
            s.gpus
        )));
    }
    if !matches!(s.gpu_mode.as_str(), "" | "exclusive" | "shared") {
        return Err(Failure::invalid(format!(
            "gpu_mode {:?} must be exclusive or shared",
            s.gpu_mode
        )));
    }
    if s.qos.is_empty() {
        s.qos = "LS".into();
    }
    if !matches!(s.qos.as_str(), "LS" | "BE") {
        return Err(Failure::invalid(format!(
            "qos {:?} must be LS or BE",
            s.qos
        )));
    }
    match s.ttl_running_stop {
        0 => s.ttl_running_stop = adm.default_ttl_running_stop_s(),
        -1 => {}
        t if t < 0 => {
            return Err(Failure::invalid(format!(
                "ttl_running_stop {t} must be >= 0 (or -1 for none)"
            )))
        }
        _ => {}
    }
    let max = adm.max_ttl_max_s();
    match s.ttl_max {
        0 => s.ttl_max = adm.default_ttl_max_s(),
        t if t < 0 => return Err(Failure::invalid(format!("ttl_max {t} must be >= 0"))),
        _ => {}
    }
    if max > 0 && (s.ttl_max > max || s.ttl_max < 0) {
        return Err(Failure::invalid(format!(
            "ttl_max {} exceeds the limit of {max} s (admission.max_ttl_max_s)",
            s.ttl_max
        )));
    }
    if s.ttl_paused_s < 0 || s.ttl_paused_s > 30 * 86400 {
        return Err(Failure::invalid(format!(
            "ttl_paused_s {} must be within [0, 2592000]",
            s.ttl_paused_s
        )));
    }
    // A store image may name its own default user (a Dockerfile's USER), which the edge
    // applies when the creation names none; every other image runs as root by default.
    if s.init_user.is_empty() && !s.image.contains('/') {
        s.init_user = "root".into();
    }
    for (what, v) in [
        ("image", &s.image),
        ("init_user", &s.init_user),
        ("task_id", &s.task_id),
    ] {
        if v.len() > MAX_TEXT || v.chars().any(|c| c.is_control()) {
            return Err(Failure::invalid(format!(
                "{what} {v:?} is too long or holds control characters"
            )));
        }
    }
    if !s.init_user.is_empty() {
        check_init_user(&s.init_user)?;
    }
    if s.labels.len() > MAX_LABELS {
        return Err(Failure::invalid(format!(
            "labels: {} given, at most {MAX_LABELS}",
            s.labels.len()
        )));
    }
    if let Some((k, _)) = s
        .labels
        .iter()
        .filter(|(k, v)| k.is_empty() || k.len() > 128 || v.len() > MAX_TEXT)
        .min_by(|a, b| a.0.cmp(b.0))
    {
        return Err(Failure::invalid(format!(
            "label {k:?}: keys are 1..128 characters and values up to {MAX_TEXT}"
        )));
    }
    check_network_rules("network_rules", &s.network_rules, net)?;
    if s.readonly_paths.len() + s.masked_paths.len() > MAX_RESTRICTED_PATHS {
        return Err(Failure::invalid(format!(
            "readonly_paths and masked_paths: at most {MAX_RESTRICTED_PATHS} paths in all"
        )));
    }
    for p in s.readonly_paths.iter().chain(s.masked_paths.iter()) {
        names::check_sandbox_path(p).map_err(Failure::invalid)?;
    }
    if s.image.contains('/') {
        // One spelling per image (`:latest` filled in), so idempotency keys and placement
        // see the same name.
        s.image = crate::images::name::ImageRef::parse(&s.image)?.to_string();
    }
    Ok(s)
}

/// `init_user` is a name or `uid[:gid]`, or `name:gid` (docs/concepts.md): a group part that
/// is not a number, a name no passwd file can hold (whitespace, `/`, a second `:`) or the id
/// 4294967295 (which `setuid` takes for "leave unchanged", so the sandbox would keep root)
/// can start on no backend. Whether the image knows the name is the edge's check.
fn check_init_user(v: &str) -> Result<(), Failure> {
    let bad = |why: &str| Err(Failure::invalid(format!("init_user {v:?}: {why}")));
    let (user, group) = match v.split_once(':') {
        Some((u, g)) => (u, Some(g)),
        None => (v, None),
    };
    if user.is_empty() {
        return bad("the user part is empty");
    }
    if user
        .chars()
        .any(|c| c.is_whitespace() || c == '/' || c == ':')
    {
        return bad("a user name has no whitespace, '/' or ':'");
    }
    let id_ok = |t: &str| t.parse::<u32>().map(|n| n < u32::MAX);
    if user.bytes().all(|b| b.is_ascii_digit()) && !id_ok(user).unwrap_or(false) {
        return bad("a uid is below 4294967295");
    }
    if let Some(g) = group {
        if !id_ok(g).unwrap_or(false) {
            return bad("the part after ':' is a numeric gid below 4294967295");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> pb::SandboxSpec {
        pb::SandboxSpec {
            backend: "sim".into(),
            ..Default::default()
        }
    }

    #[test]
    fn defaults_are_filled() {
        let s = normalize_spec(
            &spec(),
            &AdmissionConfig::default(),
            &ClusterRules::default(),
        )
        .unwrap();
        assert_eq!(
            (
                s.cpu_cores_limit,
                s.memory_limit_mb,
                s.ttl_running_stop,
                s.ttl_max
            ),
            (1.0, 2048, 3600, 86400)
        );
        assert_eq!((s.qos.as_str(), s.init_user.as_str()), ("LS", "root"));
    }

    #[test]
    fn bad_values_are_invalid_naming_the_field() {
        let adm = AdmissionConfig::default();
        type Mutate = Box<dyn Fn(&mut pb::SandboxSpec)>;
        let cases: Vec<(&str, Mutate)> = vec![
            ("backend", Box::new(|s| s.backend.clear())),
            ("cpu_cores_limit", Box::new(|s| s.cpu_cores_limit = -1.0)),
            ("cpu_cores_limit", Box::new(|s| s.cpu_cores_limit = -1e-9)),
            (
                "cpu_cores_limit",
                Box::new(|s| s.cpu_cores_limit = f64::NAN),
            ),
            (
                "cpu_cores_limit",
                Box::new(|s| s.cpu_cores_limit = f64::INFINITY),
            ),
            (
                "cpu_cores_limit",
                Box::new(|s| s.cpu_cores_limit = f64::NEG_INFINITY),
            ),
            ("cpu_cores_limit", Box::new(|s| s.cpu_cores_limit = 1e9)),
            ("memory_limit_mb", Box::new(|s| s.memory_limit_mb = -5)),
            (
                "memory_limit_mb",
                Box::new(|s| s.memory_limit_mb = i64::MIN),
            ),
            (
                "memory_limit_mb",
                Box::new(|s| s.memory_limit_mb = i64::MAX),
            ),
            ("disk_mb", Box::new(|s| s.disk_mb = -1)),
            ("gpus", Box::new(|s| s.gpus = -1)),
            ("gpus", Box::new(|s| s.gpus = 1)),
            (
                "network_rules",
                Box::new(|s| {
                    s.network_rules.insert("pypi".into(), true);
                }),
            ),
            ("ttl_max", Box::new(|s| s.ttl_max = 604801)),
            ("ttl_max", Box::new(|s| s.ttl_max = -3)),
            ("ttl_running_stop", Box::new(|s| s.ttl_running_stop = -2)),
            ("ttl_paused_s", Box::new(|s| s.ttl_paused_s = -1)),
            ("qos", Box::new(|s| s.qos = "XX".into())),
            ("image", Box::new(|s| s.image = "bad project/x:1".into())),
            ("init_user", Box::new(|s| s.init_user = "a b".into())),
            ("init_user", Box::new(|s| s.init_user = "../x".into())),
            ("init_user", Box::new(|s| s.init_user = "bob:staff".into())),
            ("init_user", Box::new(|s| s.init_user = "1000:".into())),
            ("init_user", Box::new(|s| s.init_user = ":1000".into())),
            ("init_user", Box::new(|s| s.init_user = "a:1:2".into())),
            ("init_user", Box::new(|s| s.init_user = "4294967295".into())),
            (
                "init_user",
                Box::new(|s| s.init_user = "99999999999".into()),
            ),
            (
                "init_user",
                Box::new(|s| s.init_user = "0:4294967295".into()),
            ),
            ("init_user", Box::new(|s| s.init_user = "root\n".into())),
            (
                "\"step\"",
                Box::new(|s| {
                    s.labels.insert("ok".into(), "1".into());
                    s.labels.insert("step".into(), "x".repeat(MAX_TEXT + 1));
                }),
            ),
            (
                "\"\"",
                Box::new(|s| {
                    s.labels.insert(String::new(), "1".into());
                }),
            ),
            (
                "labels: 65 given",
                Box::new(|s| {
                    for i in 0..=MAX_LABELS {
                        s.labels.insert(format!("k{i}"), "v".into());
                    }
                }),
            ),
        ];
        for (i, (field, f)) in cases.iter().enumerate() {
            let mut s = spec();
            f(&mut s);
            let e = normalize_spec(&s, &adm, &ClusterRules::default()).unwrap_err();
            assert_eq!(e.reason, crate::types::Reason::Invalid, "case {i}");
            assert!(
                e.message.contains(field),
                "case {i}: {:?} does not name {field}",
                e.message
            );
        }
    }

    #[test]
    fn malformed_network_rules_are_invalid_naming_the_entry() {
        let adm = AdmissionConfig::default();
        let net = ClusterRules::new(
            &[("pypi".to_string(), vec!["pypi.org:443".to_string()])].into(),
            &Default::default(),
        )
        .unwrap();
        for (rule, says) in [
            (
                "github.com:70000",
                "\"github.com:70000\": port outside 1-65535",
            ),
            ("exa mple.com", "\"exa mple.com\""),
            ("10.0.0.1/8", "host bits set; the network is 10.0.0.0/8"),
            ("2001:db8::1", "IPv6"),
            ("npm", "no rule set named \"npm\""),
            ("x.io/tcp", "\"x.io/tcp\""),
        ] {
            let mut s = spec();
            s.network_rules.insert(rule.into(), true);
            let e = normalize_spec(&s, &adm, &net).unwrap_err();
            assert_eq!(e.reason, crate::types::Reason::Invalid, "{rule}");
            assert!(
                e.message.starts_with("network_rules: ") && e.message.contains(says),
                "{rule}: {:?}",
                e.message
            );
        }
        // Well-formed rules pass (whether the edge has networking is the edge's to say).
        let mut s = spec();
        s.network_rules.insert("pypi".into(), true);
        s.network_rules.insert("*.github.com:443/tcp".into(), true);
        let n = normalize_spec(&s, &adm, &net).unwrap();
        assert_eq!(n.network_rules, s.network_rules);
        let mut s = spec();
        for i in 0..=MAX_NETWORK_RULES {
            s.network_rules.insert(format!("h{i}.example.com"), true);
        }
        let e = normalize_spec(&s, &adm, &net).unwrap_err();
        assert!(e.message.contains("at most 1024"), "{:?}", e.message);
    }

    #[test]
    fn init_users_that_can_exist_pass() {
        let adm = AdmissionConfig::default();
        for u in [
            "",
            "root",
            "0",
            "1000",
            "1000:1000",
            "nobody",
            "svc-user.1",
            "bob:50",
            "4294967294",
        ] {
            let s = pb::SandboxSpec {
                init_user: u.into(),
                ..spec()
            };
            let got = normalize_spec(&s, &adm, &ClusterRules::default())
                .unwrap_or_else(|e| panic!("{u:?}: {e:?}"));
            assert_eq!(got.init_user, if u.is_empty() { "root" } else { u });
        }
    }

    #[test]
    fn buckets_refuse_past_the_burst() {
        let l = Limiter::new(Some(1.0), 3.0);
        assert!(l.try_take("p", 3.0).is_ok());
        assert!(l.try_take("p", 1.0).is_err());
        assert!(l.try_take("q", 1.0).is_ok());
        let unlimited = Limiter::new(None, 1.0);
        assert!(unlimited.try_take("p", 1e9).is_ok());
    }
}
