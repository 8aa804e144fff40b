//! `POST /v2/sandboxes` (and the older `POST /sandboxes`): an E2B creation body turned into a
//! sandbox spec (docs/e2b.md "Creating sandboxes").

use std::collections::HashMap;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value};

use super::ids::{ENV_PREFIX, META_PREFIX, TEMPLATE_LABEL};
use super::{sandboxes, ApiError, Caller, Gateway};
use crate::pb;

/// The timeout of a sandbox whose creation names none, seconds (E2B's default).
pub const DEFAULT_TIMEOUT_S: i64 = 300;
/// How long a sandbox paused by its timeout (`autoPause`) is kept, seconds: the longest
/// `ttl_paused_s` admission takes.
pub const AUTO_PAUSE_KEEP_S: i64 = 30 * 86400;

/// The network rule that lets a sandbox reach every public address.
const ALL_PUBLIC: &str = "*";

/// The keys of a v2 creation body; any other key is refused, never ignored.
const CREATE_KEYS: &[&str] = &[
    "templateID",
    "timeout",
    "autoPause",
    "autoPauseMemory",
    "autoResume",
    "allow_internet_access",
    "network",
    "metadata",
    "envVars",
    "mcp",
    "iam",
    "volumeMounts",
    "secure",
];

/// The keys of a network configuration (creation and `PUT .../network`).
const NETWORK_KEYS: &[&str] = &[
    "allowPublicTraffic",
    "allowOut",
    "denyOut",
    "dnsServers",
    "egressProxy",
    "maskRequestHost",
    "httpsPorts",
    "rules",
    "allow_internet_access",
];

/// Reads a JSON object body. Errors: 400 naming what is wrong.
pub(super) fn object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(Map::new());
    }
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Ok(m),
        Ok(_) => Err(ApiError::bad_request("the body must be a JSON object")),
        Err(e) => Err(ApiError::bad_request(format!("the body is not JSON: {e}"))),
    }
}

/// Refuses keys outside `known` with 400 naming the first (sorted); `null` counts as absent.
pub(super) fn only(m: &Map<String, Value>, known: &[&str], what: &str) -> Result<(), ApiError> {
    let mut unknown: Vec<&String> = m
        .iter()
        .filter(|(k, v)| !v.is_null() && !known.contains(&k.as_str()))
        .map(|(k, _)| k)
        .collect();
    unknown.sort();
    match unknown.first() {
        Some(k) => Err(ApiError::bad_request(format!(
            "{what}: {} is not supported by this gateway",
            crate::types::names::shown(k)
        ))),
        None => Ok(()),
    }
}

/// `m[key]`, with `null` as absent.
pub(super) fn field<'a>(m: &'a Map<String, Value>, key: &str) -> Option<&'a Value> {
    m.get(key).filter(|v| !v.is_null())
}

pub(super) fn bool_field(m: &Map<String, Value>, key: &str) -> Result<Option<bool>, ApiError> {
    field(m, key)
        .map(|v| {
            v.as_bool()
                .ok_or_else(|| ApiError::bad_request(format!("{key} must be true or false")))
        })
        .transpose()
}

/// A whole number of seconds. Errors: 400 unless an integer within 1..=limit (`limit` 0 =
/// no cap of ours), naming the key and the cap (the gateway's `max_timeout_s`: the lesser
/// of `e2b.max_timeout_s` and admission's longest lifetime).
pub(super) fn timeout_field(
    m: &Map<String, Value>,
    key: &str,
    limit: i64,
) -> Result<Option<i64>, ApiError> {
    capped_seconds(m, key, limit, "this cluster's longest timeout")
}

/// A whole number of seconds within 1..=`limit` (0 = no cap), `cap` saying where the cap
/// comes from. Errors: 400 naming the key and the cap.
pub(super) fn capped_seconds(
    m: &Map<String, Value>,
    key: &str,
    limit: i64,
    cap: &str,
) -> Result<Option<i64>, ApiError> {
    let Some(v) = field(m, key) else {
        return Ok(None);
    };
    let t = v.as_i64().filter(|t| *t >= 1).ok_or_else(|| {
        ApiError::bad_request(format!("{key} must be a whole number of seconds ≥ 1"))
    })?;
    if limit > 0 && t > limit {
        return Err(ApiError::bad_request(format!(
            "{key} {t} s is over {cap} of {limit} s"
        )));
    }
    Ok(Some(t))
}

fn string_map(m: &Map<String, Value>, key: &str) -> Result<Vec<(String, String)>, ApiError> {
    let Some(v) = field(m, key) else {
        return Ok(vec![]);
    };
    let obj = v
        .as_object()
        .ok_or_else(|| ApiError::bad_request(format!("{key} must be an object of strings")))?;
    obj.iter()
        .map(|(k, v)| match v.as_str() {
            Some(s) => Ok((k.clone(), s.to_string())),
            None => Err(ApiError::bad_request(format!("{key}.{k} must be a string"))),
        })
        .collect()
}

fn string_list(m: &Map<String, Value>, key: &str) -> Result<Vec<String>, ApiError> {
    let Some(v) = field(m, key) else {
        return Ok(vec![]);
    };
    let arr = v
        .as_array()
        .ok_or_else(|| ApiError::bad_request(format!("{key} must be a list of strings")))?;
    arr.iter()
        .map(|x| {
            x.as_str()
                .map(str::to_string)
                .ok_or_else(|| ApiError::bad_request(format!("{key} must be a list of strings")))
        })
        .collect()
}

/// E2B's network options as `network_rules` (docs/e2b.md "Network"): internet access by
/// default (`*`), `allow_internet_access: false` or `denyOut: ["0.0.0.0/0"]` turning it and
/// the cluster's default rules off, and each `allowOut` entry allowed. Options with no
/// counterpart are refused.
/// Errors: 400 naming the option.
pub(super) fn network_rules(
    g: &Gateway,
    internet: Option<bool>,
    net: Option<&Map<String, Value>>,
) -> Result<HashMap<String, bool>, ApiError> {
    let empty = Map::new();
    let net = net.unwrap_or(&empty);
    only(net, NETWORK_KEYS, "network")?;
    for key in ["dnsServers", "httpsPorts"] {
        if field(net, key)
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty())
        {
            return Err(ApiError::bad_request(format!(
                "network.{key} is not supported by this gateway"
            )));
        }
    }
    for key in ["egressProxy", "maskRequestHost"] {
        if field(net, key).is_some() {
            return Err(ApiError::bad_request(format!(
                "network.{key} is not supported by this gateway"
            )));
        }
    }
    if field(net, "rules")
        .and_then(Value::as_object)
        .is_some_and(|r| !r.is_empty())
    {
        return Err(ApiError::bad_request(
            "network.rules (request transforms) are not supported by this gateway",
        ));
    }
    // Sandbox ports always need the caller's token here, so private traffic is what every
    // sandbox has; a request for public traffic cannot be honoured.
    if bool_field(net, "allowPublicTraffic")? == Some(true) {
        return Err(ApiError::bad_request(
            "network.allowPublicTraffic: sandbox ports always need the token here",
        ));
    }
    let allow = string_list(net, "allowOut")?;
    let deny = string_list(net, "denyOut")?;
    if let Some(d) = deny.iter().find(|d| d.as_str() != "0.0.0.0/0") {
        return Err(ApiError::bad_request(format!(
            "network.denyOut {}: only all traffic (0.0.0.0/0) can be denied; everything \
             else is denied unless allowed",
            crate::types::names::shown(d)
        )));
    }
    let internet = internet
        .or(bool_field(net, "allow_internet_access")?)
        .unwrap_or(true)
        && deny.is_empty();
    if !g.networked {
        if !allow.is_empty() {
            return Err(ApiError::bad_request(
                "network.allowOut: this cluster's sandboxes have no network",
            ));
        }
        return Ok(HashMap::new());
    }
    let mut rules: HashMap<String, bool> = HashMap::new();
    if internet {
        rules.insert(ALL_PUBLIC.into(), true);
    } else {
        rules.insert(ALL_PUBLIC.into(), false);
        for k in &g.default_rules {
            rules.insert(k.clone(), false);
        }
    }
    for a in allow {
        let rule = a.strip_prefix("*.").unwrap_or(&a).to_string();
        rules.insert(rule, true);
    }
    Ok(rules)
}

/// The spec of a creation body, and the template id it names.
/// Errors: 400 for a malformed body or an option that cannot be honoured, 404 for an
/// unknown template.
#[cfg(test)]
fn spec_of(g: &Gateway, m: &Map<String, Value>) -> Result<(pb::SandboxSpec, String), ApiError> {
    let template = template_of(m)?;
    let t = template_settings(g, &template)?;
    spec_with(g, m, template, t)
}

/// The template id a creation body names (`base` when none). Errors: 400 for one that is
/// no string.
fn template_of(m: &Map<String, Value>) -> Result<String, ApiError> {
    match field(m, "templateID") {
        Some(Value::String(t)) if !t.is_empty() => Ok(t.clone()),
        Some(_) => Err(ApiError::bad_request("templateID must be a string")),
        None => Ok("base".to_string()),
    }
}

/// The spec of a creation body for `template`, whose settings are `t`.
fn spec_with(
    g: &Gateway,
    m: &Map<String, Value>,
    template: String,
    t: crate::config::E2bTemplate,
) -> Result<(pb::SandboxSpec, String), ApiError> {
    only(m, CREATE_KEYS, "create")?;
    let timeout = timeout_field(m, "timeout", g.max_timeout_s)?.unwrap_or(DEFAULT_TIMEOUT_S);
    let auto_pause = bool_field(m, "autoPause")?.unwrap_or(false);
    if bool_field(m, "autoPauseMemory")? == Some(false) {
        return Err(ApiError::bad_request(
            "autoPauseMemory false: filesystem-only pauses are not supported; pauses keep \
             the sandbox whole",
        ));
    }
    if let Some(ar) = field(m, "autoResume") {
        let enabled = ar.get("enabled").and_then(Value::as_bool);
        if enabled != Some(true) {
            return Err(ApiError::bad_request(
                "autoResume: any call resumes a paused sandbox here, so it cannot be turned off",
            ));
        }
    }
    if field(m, "mcp").is_some() {
        return Err(ApiError::bad_request(
            "mcp is not supported by this gateway",
        ));
    }
    if field(m, "iam")
        .and_then(|v| v.get("tokens"))
        .and_then(Value::as_object)
        .is_some_and(|t| !t.is_empty())
    {
        return Err(ApiError::bad_request(
            "iam tokens are not supported by this gateway",
        ));
    }
    if field(m, "volumeMounts")
        .and_then(Value::as_array)
        .is_some_and(|v| !v.is_empty())
    {
        return Err(ApiError::bad_request(
            "volumeMounts are not supported by this gateway",
        ));
    }
    let net = match field(m, "network") {
        None => None,
        Some(Value::Object(n)) => Some(n),
        Some(_) => return Err(ApiError::bad_request("network must be an object")),
    };
    let network_rules = network_rules(g, bool_field(m, "allow_internet_access")?, net)?;
    let mut labels = HashMap::new();
    labels.insert(TEMPLATE_LABEL.to_string(), template.clone());
    for (k, v) in string_map(m, "metadata")? {
        labels.insert(format!("{META_PREFIX}{k}"), v);
    }
    for (k, v) in string_map(m, "envVars")? {
        if k.is_empty() || k.contains('=') || k.contains('\0') {
            return Err(ApiError::bad_request(format!(
                "envVars: {} is not an environment variable name",
                crate::types::names::shown(&k)
            )));
        }
        labels.insert(format!("{ENV_PREFIX}{k}"), v);
    }
    let spec = pb::SandboxSpec {
        backend: t.backend,
        image: t.image,
        cpu_cores_limit: t.cpu,
        memory_limit_mb: t.memory_mb,
        disk_mb: t.disk_mb,
        // E2B's timeout is a lifetime from now, whatever the sandbox does. A sandbox its
        // timeout pauses also gets it as its idle timeout, which takes over once a call
        // resumes it past its lifetime (docs/e2b.md "How E2B's ideas map onto ours").
        ttl_running_stop: if auto_pause { timeout } else { -1 },
        ttl_max: timeout,
        ttl_paused_s: if auto_pause { AUTO_PAUSE_KEEP_S } else { 0 },
        network_rules,
        labels,
        ..Default::default()
    };
    Ok((spec, template))
}

/// How often a template's ready command is tried.
const READY_CMD_EVERY: std::time::Duration = std::time::Duration::from_millis(500);

/// Waits until template `t`'s `ready_cmd` (`sh -c`) exits 0 in sandbox `id`, trying it
/// every [`READY_CMD_EVERY`] until `deadline`. Errors: the apiserver's; 504 when it never
/// did.
async fn ready_by_command(
    g: &Gateway,
    caller: &Caller,
    id: &str,
    name: &str,
    t: &crate::config::E2bTemplate,
    deadline: tokio::time::Instant,
) -> Result<(), ApiError> {
    use pb::process_event::Kind;
    loop {
        let req = pb::StartProcessRequest {
            sandbox_id: id.to_string(),
            cmd: "/bin/sh".into(),
            args: vec!["-c".into(), t.ready_cmd.clone()],
            ..Default::default()
        };
        let mut events = g
            .api()
            .start_process(g.req(caller, req))
            .await?
            .into_inner();
        let (mut code, mut said) = (None, Vec::new());
        while let Some(ev) = events.message().await? {
            match ev.kind {
                Some(Kind::Stdout(d)) | Some(Kind::Stderr(d)) if said.len() < 4096 => {
                    said.extend_from_slice(&d)
                }
                Some(Kind::End(e)) => {
                    code = Some(e.exit_code);
                    break;
                }
                _ => {}
            }
        }
        if code == Some(0) {
            return Ok(());
        }
        if tokio::time::Instant::now() + READY_CMD_EVERY >= deadline {
            let said = String::from_utf8_lossy(&said);
            let said: String = said.trim().chars().take(512).collect();
            return Err(ApiError::new(
                504,
                format!(
                    "template {}: its ready command did not succeed within {} s of its start \
                     (last exit {}{}{}); the sandbox was stopped",
                    crate::types::names::shown(name),
                    t.ready_timeout_s.max(1),
                    code.map_or("none".to_string(), |c| c.to_string()),
                    if said.is_empty() { "" } else { ", saying: " },
                    said
                ),
            ));
        }
        tokio::time::sleep(READY_CMD_EVERY).await;
    }
}

/// What template id `template` is: a template of `e2b.templates`, or an image name (one
/// holding `/`), over `default_template`. Errors: 404 for another.
fn template_settings(g: &Gateway, template: &str) -> Result<crate::config::E2bTemplate, ApiError> {
    match g.templates.get(template) {
        Some(t) => Ok(t.over(g.default_template.as_ref())),
        None if template.contains('/') => Ok(crate::config::E2bTemplate {
            image: template.to_string(),
            ..Default::default()
        }
        .over(g.default_template.as_ref())),
        None => Err(ApiError::new(
            404,
            format!(
                "template {} not found: this cluster offers {}",
                crate::types::names::shown(template),
                offered(g)
            ),
        )),
    }
}

/// What template id `template` is for `caller`: as [`template_settings`] says, else a
/// template built through the template API (docs/e2b.md "Template builds"): the image
/// `<project>/<name>:<tag>` of the caller's project (tag `default` without one), its start
/// and ready commands from its labels. Errors: 404 naming the templates offered when there
/// is none; the apiserver's others (403 for an image the caller may not use).
pub(super) async fn resolve_template(
    g: &Gateway,
    caller: &Caller,
    template: &str,
) -> Result<crate::config::E2bTemplate, ApiError> {
    let missing = match template_settings(g, template) {
        Ok(t) => return Ok(t),
        Err(e) => e,
    };
    let Ok((name, tag)) = super::templates::template_name(&caller.project, template) else {
        return Err(missing);
    };
    let image = super::templates::image_name(&caller.project, &name, &tag)?;
    match g
        .api()
        .get_image(g.req(
            caller,
            pb::ImageRef {
                name: image.clone(),
            },
        ))
        .await
    {
        Ok(info) => {
            let labels = info.into_inner().labels;
            let label = |k: &str| labels.get(k).cloned().unwrap_or_default();
            Ok(crate::config::E2bTemplate {
                image,
                start_cmd: label(super::build::START_LABEL),
                ready_cmd: label(super::build::READY_LABEL),
                ..Default::default()
            }
            .over(g.default_template.as_ref()))
        }
        Err(s) if s.code() == tonic::Code::NotFound => Err(missing),
        Err(s) => Err(s.into()),
    }
}

/// Most often a template's ready port is tried while it waits.
const READY_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// Runs template `t`'s `start_cmd` in the new sandbox `id` (`bash -l -c`, a process of the
/// process API tagged `e2b-start`, which outlives this call) and waits until its
/// `ready_port` takes a connection, at most `ready_timeout_s` (docs/e2b.md "Templates").
/// Errors: the apiserver's; 504 when the port did not listen in time.
async fn start_template(
    g: &Gateway,
    caller: &Caller,
    id: &str,
    name: &str,
    t: &crate::config::E2bTemplate,
) -> Result<(), ApiError> {
    if !t.start_cmd.is_empty() {
        let req = pb::StartProcessRequest {
            sandbox_id: id.to_string(),
            cmd: "bash".into(),
            args: vec!["-l".into(), "-c".into(), t.start_cmd.clone()],
            tag: "e2b-start".into(),
            ..Default::default()
        };
        match g.api().start_process(g.req(caller, req)).await {
            Ok(events) => {
                // Its first event says it started; the stream may go, the process stays.
                events.into_inner().message().await?;
            }
            // The tag is taken: the start command runs already, as it does when a keyed
            // creation is replayed (the same sandbox comes back): wait for it, once.
            Err(s)
                if crate::rpc::failure_from_status(&s).reason == crate::types::Reason::Conflict => {
            }
            Err(s) => return Err(s.into()),
        }
    }
    let wait = std::time::Duration::from_secs(t.ready_timeout_s.max(1) as u64);
    let deadline = tokio::time::Instant::now() + wait;
    if !t.ready_cmd.is_empty() {
        return ready_by_command(g, caller, id, name, t, deadline).await;
    }
    if t.ready_port == 0 {
        return Ok(());
    }
    loop {
        match super::ports::open(g, caller, id, t.ready_port).await {
            Ok(_) => return Ok(()),
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::Unavailable | tonic::Code::FailedPrecondition
                ) && tokio::time::Instant::now() + READY_POLL < deadline =>
            {
                tokio::time::sleep(READY_POLL).await;
            }
            Err(s)
                if matches!(
                    s.code(),
                    tonic::Code::Unavailable | tonic::Code::FailedPrecondition
                ) =>
            {
                return Err(ApiError::new(
                    504,
                    format!(
                        "template {}: nothing listened on port {} within {} s of its start_cmd; \
                         the sandbox was stopped",
                        crate::types::names::shown(name),
                        t.ready_port,
                        wait.as_secs()
                    ),
                ))
            }
            Err(s) => return Err(s.into()),
        }
    }
}

fn offered(g: &Gateway) -> String {
    if g.templates.is_empty() {
        "no templates (an image name such as root/py:3.12 works)".into()
    } else {
        g.templates.keys().cloned().collect::<Vec<_>>().join(", ")
    }
}

/// `Idempotency-Key` (`[a-z0-9-]{1,255}`), if given. Errors: 400 for another shape.
fn idempotency_key(h: &HeaderMap) -> Result<String, ApiError> {
    let Some(v) = h.get("idempotency-key") else {
        return Ok(String::new());
    };
    let k = v.to_str().unwrap_or_default();
    if k.is_empty()
        || k.len() > 255
        || !k
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(ApiError::bad_request(
            "Idempotency-Key must be 1 to 255 characters of [a-z0-9-]",
        ));
    }
    Ok(k.to_string())
}

/// `POST /v2/sandboxes` (and `POST /sandboxes` of E2B's 1.x SDKs, the same body): creates
/// a sandbox; 201 with E2B's `Sandbox`.
/// Errors: as [`spec_of`], then the apiserver's (docs/e2b.md "Errors").
pub async fn create(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let m = object(&body)?;
    let template = template_of(&m)?;
    let settings = resolve_template(&g, &caller, &template).await?;
    let (spec, template) = spec_with(&g, &m, template, settings.clone())?;
    let key = idempotency_key(&headers)?;
    let keyed = !key.is_empty();
    let req = pb::CreateSandboxRequest {
        spec: Some(spec),
        project: caller.project.clone(),
        idempotency_key: key,
    };
    let sb = g
        .api()
        .create_sandbox(g.req(&caller, req))
        .await
        .map_err(|s| {
            let mut e = ApiError::from(s);
            // With a key a replay returns the same sandbox, so it is always safe.
            e.retry |= keyed && matches!(e.status, 502..=504);
            e
        })?
        .into_inner();
    if !settings.start_cmd.is_empty() || settings.ready_port > 0 || !settings.ready_cmd.is_empty() {
        // In a task of its own: a caller that hangs up meanwhile (its request timeout) drops
        // this handler, and a sandbox whose template did not start must still be stopped.
        let (g2, c2, id, name) = (g.clone(), caller.clone(), sb.id.clone(), template.clone());
        let started = tokio::spawn(async move {
            let r = start_template(&g2, &c2, &id, &name, &settings).await;
            if r.is_err() {
                // A sandbox whose template did not start is no sandbox of that template.
                let stop = pb::SandboxRef { id: id.clone() };
                if let Err(s) = g2.api().stop_sandbox(g2.req(&c2, stop)).await {
                    tracing::warn!(sandbox = %id, error = %s.message(), "stopping a sandbox whose template did not start");
                }
            }
            r
        });
        started
            .await
            .map_err(|e| ApiError::new(500, format!("starting the template: {e}")))??;
    }
    Ok((
        StatusCode::CREATED,
        axum::Json(sandboxes::sandbox_json(&g, &caller, &sb)),
    )
        .into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gateway(networked: bool) -> Gateway {
        let mut cfg: crate::config::Config = serde_json::from_value(json!({
            "service_token": "s",
            "apiserver": [{"addr": "127.0.0.1:1"}],
            "network": {"default_rules": {"pypi": true}, "rule_sets": {"pypi": ["pypi.org"]}},
            "edges": [{"id": "n1", "network": {"enabled": networked}}],
            "e2b": {
                "gateways": [{"addr": "127.0.0.1:0"}],
                "project": "root/e2b",
                "templates": {"base": {"image": "root/py:3.12", "cpu": 1}},
                "default_template": {"memory_mb": 1024},
                "max_timeout_s": 3600
            }
        }))
        .unwrap();
        cfg.iam.admin_token = "dsk.admin.x".into();
        Gateway::new(&cfg, &crate::rpc::client::Dialer::plain()).unwrap()
    }

    #[tokio::test]
    async fn the_timeout_cap_is_the_lesser_of_the_gateways_and_admissions() {
        let mut cfg: crate::config::Config = serde_json::from_value(json!({
            "service_token": "s",
            "apiserver": [{"addr": "127.0.0.1:1"}],
            "admission": {"max_ttl_max_s": 1000},
            "e2b": {"gateways": [{"addr": "127.0.0.1:0"}], "project": "root", "max_timeout_s": 3600}
        }))
        .unwrap();
        cfg.iam.admin_token = "dsk.admin.x".into();
        let g = Gateway::new(&cfg, &crate::rpc::client::Dialer::plain()).unwrap();
        let e = spec_of(
            &g,
            &body(json!({"templateID": "root/py:1", "timeout": 1001})),
        )
        .unwrap_err();
        assert_eq!(e.status, 400);
        assert!(
            e.message == "timeout 1001 s is over this cluster's longest timeout of 1000 s",
            "{}",
            e.message
        );
        assert!(spec_of(
            &g,
            &body(json!({"templateID": "root/py:1", "timeout": 1000}))
        )
        .is_ok());
    }

    fn body(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    fn rules(pairs: &[(&str, bool)]) -> HashMap<String, bool> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[tokio::test]
    async fn a_creation_body_becomes_a_spec() {
        let g = gateway(true);
        let (s, t) = spec_of(
            &g,
            &body(
                json!({"templateID": "base", "timeout": 120, "autoPause": true,
                "autoResume": {"enabled": true},
                "metadata": {"k": "v"}, "envVars": {"A": "1"}, "secure": true}),
            ),
        )
        .unwrap();
        assert_eq!(t, "base");
        assert_eq!(
            (
                s.image.as_str(),
                s.backend.as_str(),
                s.cpu_cores_limit,
                s.memory_limit_mb
            ),
            ("root/py:3.12", "container", 1.0, 1024)
        );
        assert_eq!(
            (s.ttl_max, s.ttl_running_stop, s.ttl_paused_s),
            (120, 120, AUTO_PAUSE_KEEP_S)
        );
        assert_eq!(s.network_rules, rules(&[("*", true)]));
        let want: HashMap<String, String> = [
            ("e2b.template", "base"),
            ("e2b.meta.k", "v"),
            ("e2b.env.A", "1"),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
        assert_eq!(s.labels, want);
        // Image names are templates with the default template's settings.
        let (s, _) = spec_of(&g, &body(json!({"templateID": "team/img:1"}))).unwrap();
        assert_eq!(
            (s.image.as_str(), s.cpu_cores_limit, s.ttl_max),
            ("team/img:1", 2.0, 300)
        );
    }

    #[tokio::test]
    async fn what_cannot_be_honoured_is_refused_by_name() {
        let g = gateway(true);
        for (b, status, want) in [
            (
                json!({"templateID": "nope"}),
                404,
                "template \"nope\" not found: this cluster offers base",
            ),
            (
                json!({"timeout": 3601}),
                400,
                "timeout 3601 s is over this cluster's longest timeout of 3600 s",
            ),
            (json!({"timeout": 0}), 400, "timeout must be a whole number"),
            (
                json!({"timeout": "5"}),
                400,
                "timeout must be a whole number",
            ),
            (json!({"autoPauseMemory": false}), 400, "filesystem-only"),
            (json!({"autoResume": {"enabled": false}}), 400, "autoResume"),
            (json!({"mcp": {}}), 400, "mcp"),
            (json!({"iam": {"tokens": {"a": {}}}}), 400, "iam tokens"),
            (
                json!({"volumeMounts": [{"name": "v", "path": "/v"}]}),
                400,
                "volumeMounts",
            ),
            (
                json!({"network": {"dnsServers": ["192.0.2.1"]}}),
                400,
                "network.dnsServers",
            ),
            (
                json!({"network": {"egressProxy": {"address": "x:1"}}}),
                400,
                "network.egressProxy",
            ),
            (
                json!({"network": {"denyOut": ["10.0.0.0/8"]}}),
                400,
                "only all traffic",
            ),
            (
                json!({"network": {"allowPublicTraffic": true}}),
                400,
                "allowPublicTraffic",
            ),
            (
                json!({"network": {"weird": 1}}),
                400,
                "network: \"weird\" is not supported",
            ),
            (
                json!({"envVars": {"A=B": "1"}}),
                400,
                "not an environment variable name",
            ),
            (
                json!({"metadata": {"k": 1}}),
                400,
                "metadata.k must be a string",
            ),
            (json!({"templateID": 5}), 400, "templateID must be a string"),
            (
                json!({"unknownKey": 5}),
                400,
                "\"unknownKey\" is not supported",
            ),
        ] {
            let e = spec_of(&g, &body(b.clone())).unwrap_err();
            assert_eq!(e.status, status, "{b}");
            assert!(e.message.contains(want), "{b}: {}", e.message);
        }
        // null is absent, as the SDKs send it.
        assert!(spec_of(&g, &body(json!({"mcp": null, "network": null}))).is_ok());
        assert!(object(b"[1]").is_err() && object(b"{").is_err() && object(b" ").is_ok());
    }

    #[tokio::test]
    async fn network_options_map_onto_rules() {
        let g = gateway(true);
        let net = |v: Value| network_rules(&g, None, v.as_object()).unwrap();
        assert_eq!(net(json!({})), rules(&[("*", true)]));
        assert_eq!(
            net(json!({"allowOut": ["192.0.2.7", "*.example.com"], "denyOut": ["0.0.0.0/0"]})),
            rules(&[
                ("*", false),
                ("pypi", false),
                ("192.0.2.7", true),
                ("example.com", true)
            ])
        );
        assert_eq!(
            network_rules(&g, Some(false), None).unwrap(),
            rules(&[("*", false), ("pypi", false)])
        );
        assert_eq!(
            net(json!({"allow_internet_access": false})),
            rules(&[("*", false), ("pypi", false)])
        );
        // Without sandbox networking there is nothing to open.
        let g = gateway(false);
        assert_eq!(
            network_rules(&g, Some(false), None).unwrap(),
            HashMap::new()
        );
        let e =
            network_rules(&g, None, json!({"allowOut": ["192.0.2.7"]}).as_object()).unwrap_err();
        assert!(e.message.contains("no network"), "{}", e.message);
    }
}
