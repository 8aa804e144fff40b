//! The control plane's sandbox endpoints other than creation: get, list, kill, timeouts,
//! pause and connect, metrics and network updates (docs/e2b.md "What works").

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::{Path, RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use super::create::{
    bool_field, capped_seconds, field, network_rules, object, only, timeout_field,
    DEFAULT_TIMEOUT_S,
};
use super::ids::{self, META_PREFIX, TEMPLATE_LABEL};
use super::{ApiError, Caller, Gateway, ENVD_VERSION};
use crate::pb::{self, SandboxState};
use crate::types::now_s;

/// The `clientID` E2B's Python SDK requires in every sandbox it reads (any string).
const CLIENT_ID: &str = "opendsec";
/// Most sandboxes one list page holds (E2B's cap on `limit`).
const MAX_PAGE: usize = 100;

fn state_of(sb: &pb::Sandbox) -> SandboxState {
    SandboxState::try_from(sb.state).unwrap_or(SandboxState::StateUnspecified)
}

fn ended(s: SandboxState) -> bool {
    matches!(
        s,
        SandboxState::Stopping | SandboxState::Stopped | SandboxState::Failed
    )
}

fn paused(s: SandboxState) -> bool {
    matches!(s, SandboxState::Paused | SandboxState::Pausing)
}

fn template_of(sb: &pb::Sandbox) -> String {
    let spec = sb.spec.clone().unwrap_or_default();
    spec.labels
        .get(TEMPLATE_LABEL)
        .cloned()
        .unwrap_or(spec.image)
}

/// Seconds until the sandbox's timeout; `None` when it has none.
fn remaining(sb: &pb::Sandbox, now: i64) -> Option<i64> {
    let max = sb.spec.as_ref().map_or(0, |s| s.ttl_max);
    (max > 0).then(|| sb.created_at.saturating_add(max).saturating_sub(now))
}

/// E2B's `Sandbox` (create, connect, fork): its envd and traffic access tokens are the
/// sandbox's access token, which the SDK's in-sandbox calls and port requests carry next
/// and signs file URLs with (docs/e2b.md "Access tokens and signed URLs").
pub(super) fn sandbox_json(g: &Gateway, caller: &Caller, sb: &pb::Sandbox) -> Value {
    let t = template_of(sb);
    let token = g.envd_token(caller, &sb.id);
    json!({
        "templateID": t,
        "alias": t,
        "sandboxID": ids::to_e2b(&sb.id),
        "clientID": CLIENT_ID,
        "envdVersion": ENVD_VERSION,
        "envdAccessToken": token,
        "trafficAccessToken": token,
        "domain": g.domain,
    })
}

/// E2B's `ListedSandbox`: the fields `SandboxDetail` shares with it.
fn listed_json(sb: &pb::Sandbox) -> Value {
    let spec = sb.spec.clone().unwrap_or_default();
    let t = template_of(sb);
    let end = match remaining(sb, sb.created_at) {
        Some(r) => sb.created_at.saturating_add(r),
        // No lifetime: E2B has no way to say so; a date far away.
        None => sb.created_at.saturating_add(100 * 365 * 86400),
    };
    json!({
        "templateID": t,
        "alias": t,
        "sandboxID": ids::to_e2b(&sb.id),
        "clientID": CLIENT_ID,
        "startedAt": ids::rfc3339(sb.created_at),
        "endAt": ids::rfc3339(end),
        "envdVersion": ENVD_VERSION,
        "cpuCount": spec.cpu_cores_limit.ceil().max(1.0) as i64,
        "memoryMB": spec.memory_limit_mb,
        "diskSizeMB": spec.disk_mb,
        "state": if paused(state_of(sb)) { "paused" } else { "running" },
        "metadata": ids::labelled(&spec.labels, META_PREFIX),
    })
}

/// E2B's `SandboxDetail` (`GET /sandboxes/{id}`).
fn detail_json(g: &Gateway, caller: &Caller, sb: &pb::Sandbox) -> Value {
    let spec = sb.spec.clone().unwrap_or_default();
    let mut v = listed_json(sb);
    let rules = &spec.network_rules;
    let internet = rules.get("*").copied().unwrap_or(false);
    let mut allow: Vec<&String> = rules
        .iter()
        .filter(|(k, on)| **on && k.as_str() != "*")
        .map(|(k, _)| k)
        .collect();
    allow.sort();
    if let Some(o) = v.as_object_mut() {
        o.insert(
            "envdAccessToken".into(),
            g.envd_token(caller, &sb.id).into(),
        );
        o.insert("domain".into(), json!(g.domain));
        o.insert("allowInternetAccess".into(), internet.into());
        o.insert(
            "network".into(),
            json!({
                "allowOut": allow,
                "denyOut": if internet { vec![] } else { vec!["0.0.0.0/0"] },
            }),
        );
        o.insert(
            "lifecycle".into(),
            json!({
                "autoResume": true,
                "onTimeout": if spec.ttl_paused_s > 0 { "pause" } else { "kill" },
            }),
        );
        o.insert("pauseMode".into(), "full".into());
    }
    v
}

/// Our id of `e2b_id`. Errors: 404 for one that cannot be ours.
fn our_id(e2b_id: &str) -> Result<String, ApiError> {
    ids::from_e2b(e2b_id).ok_or_else(|| ApiError::sandbox_not_found(e2b_id))
}

/// The live sandbox behind `e2b_id`. Errors: 404 when unknown, not visible to the caller's
/// token, or ended (E2B forgets killed sandboxes); the apiserver's other failures.
pub(super) async fn live(
    g: &Gateway,
    caller: &Caller,
    e2b_id: &str,
) -> Result<pb::Sandbox, ApiError> {
    let id = our_id(e2b_id)?;
    let sb = g
        .api()
        .get_sandbox(g.req(caller, pb::SandboxRef { id }))
        .await
        .map_err(gone(e2b_id))?
        .into_inner();
    if ended(state_of(&sb)) {
        return Err(ApiError::sandbox_not_found(e2b_id));
    }
    Ok(sb)
}

/// A 404 from the apiserver, reworded as E2B words it (the SDKs print the message).
pub(super) fn not_found_as(e: ApiError, e2b_id: &str) -> ApiError {
    if e.status == 404 {
        ApiError::sandbox_not_found(e2b_id)
    } else {
        e
    }
}

/// The error of a call about sandbox `e2b_id`, its 404 as [`not_found_as`].
fn gone(e2b_id: &str) -> impl Fn(tonic::Status) -> ApiError + '_ {
    move |s| not_found_as(ApiError::from(s), e2b_id)
}

/// A JSON object body with only the `known` keys. Errors: 400 as [`object`] and [`only`].
pub(super) fn fields(
    body: &[u8],
    known: &[&str],
    what: &str,
) -> Result<serde_json::Map<String, Value>, ApiError> {
    let m = object(body)?;
    only(&m, known, what)?;
    Ok(m)
}

/// Refuses `memory: false`, which asks for what this gateway does not do: a pause or resume
/// without the sandbox's memory. Errors: 400 with `why`.
fn keeps_memory(m: &serde_json::Map<String, Value>, why: &str) -> Result<(), ApiError> {
    if bool_field(m, "memory")? == Some(false) {
        return Err(ApiError::bad_request(format!("memory false: {why}")));
    }
    Ok(())
}

const NO_COLD_BOOT: &str = "resuming by a cold boot is not supported; resumes keep memory";

/// Sets the timeout to `t` from now when less than that is left (never shortens).
async fn extend(g: &Gateway, caller: &Caller, sb: &pb::Sandbox, t: i64) -> Result<(), ApiError> {
    if remaining(sb, now_s()).is_some_and(|r| r < t) {
        let req = pb::SetSandboxTimeoutRequest {
            id: sb.id.clone(),
            timeout_s: t,
        };
        g.api().set_sandbox_timeout(g.req(caller, req)).await?;
    }
    Ok(())
}

/// `GET /sandboxes/{id}`: E2B's `SandboxDetail`. Errors: 404 as [`live`].
pub async fn get_info(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let sb = live(&g, &caller, &id).await?;
    Ok(axum::Json(detail_json(&g, &caller, &sb)).into_response())
}

/// The list call's query (`GET /v2/sandboxes`); unknown parameters are ignored, as the
/// query of a GET carries no options that change what happens.
#[derive(Debug, Default)]
pub struct ListQuery {
    metadata: Option<String>,
    state: Option<String>,
    order: Option<String>,
    started_after: Option<String>,
    template: Option<String>,
    next_token: Option<String>,
    limit: Option<String>,
}

impl ListQuery {
    /// Parses a raw query string (the last of repeated parameters wins). Errors: 400 for a
    /// broken percent escape.
    fn parse(raw: Option<&str>) -> Result<ListQuery, ApiError> {
        let mut q = ListQuery::default();
        for pair in raw.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = ids::percent_decode(v).ok_or_else(|| {
                ApiError::bad_request(format!(
                    "query parameter {} is not well encoded",
                    crate::types::names::shown(k)
                ))
            })?;
            let slot = match k {
                "metadata" => &mut q.metadata,
                "state" => &mut q.state,
                "order" => &mut q.order,
                "startedAfter" => &mut q.started_after,
                "template" => &mut q.template,
                "nextToken" => &mut q.next_token,
                "limit" => &mut q.limit,
                _ => continue,
            };
            *slot = Some(v);
        }
        Ok(q)
    }
}

/// What a list keeps: the caller's filters.
struct Filter {
    running: bool,
    paused: bool,
    metadata: BTreeMap<String, String>,
    template: Option<String>,
    started_after: Option<i64>,
}

impl Filter {
    fn keeps(&self, sb: &pb::Sandbox) -> bool {
        let st = state_of(sb);
        if ended(st) || (paused(st) && !self.paused) || (!paused(st) && !self.running) {
            return false;
        }
        let labels = sb.spec.as_ref().map(|s| &s.labels);
        let meta_ok = self
            .metadata
            .iter()
            .all(|(k, v)| labels.and_then(|l| l.get(&format!("{META_PREFIX}{k}"))) == Some(v));
        meta_ok
            && self.template.as_ref().is_none_or(|t| &template_of(sb) == t)
            && self.started_after.is_none_or(|a| sb.created_at >= a)
    }
}

async fn listed(
    g: &Gateway,
    caller: &Caller,
    f: &Filter,
) -> Result<(Vec<pb::Sandbox>, Vec<String>), ApiError> {
    let req = pb::ListSandboxesRequest {
        project: caller.project.clone(),
        ..Default::default()
    };
    let r = g
        .api()
        .list_sandboxes(g.req(caller, req))
        .await?
        .into_inner();
    if !r.unreachable_edges.is_empty() {
        tracing::warn!(edges = ?r.unreachable_edges, "list is missing the sandboxes of unreachable edges");
    }
    let kept = r.sandboxes.into_iter().filter(|s| f.keeps(s)).collect();
    Ok((kept, r.unreachable_edges))
}

/// `GET /v2/sandboxes`: running and paused sandboxes of the caller's project, filtered by
/// `metadata`, `state`, `template` and `startedAfter`, ordered by start time (`order`,
/// newest first by default), `limit` (≤ 100) at a time with `x-next-token`.
/// Errors: 400 naming a malformed parameter.
pub async fn list(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let q = ListQuery::parse(raw.as_deref())?;
    let (mut running, mut paused) = (true, true);
    if let Some(s) = q.state.as_deref().filter(|s| !s.is_empty()) {
        (running, paused) = (false, false);
        for part in s.split(',') {
            match part {
                "running" => running = true,
                "paused" => paused = true,
                other => {
                    return Err(ApiError::bad_request(format!(
                        "state {}: running or paused",
                        crate::types::names::shown(other)
                    )))
                }
            }
        }
    }
    let desc = match q.order.as_deref() {
        None | Some("") | Some("desc") => true,
        Some("asc") => false,
        Some(o) => {
            return Err(ApiError::bad_request(format!(
                "order {}: asc or desc",
                crate::types::names::shown(o)
            )))
        }
    };
    let limit = match q.limit.as_deref() {
        None | Some("") => MAX_PAGE,
        Some(l) => l
            .parse::<usize>()
            .ok()
            .filter(|l| (1..=MAX_PAGE).contains(l))
            .ok_or_else(|| ApiError::bad_request(format!("limit must be within 1..={MAX_PAGE}")))?,
    };
    let f =
        Filter {
            running,
            paused,
            metadata: ids::metadata_filter(q.metadata.as_deref().unwrap_or_default())
                .map_err(ApiError::bad_request)?,
            template: q.template.filter(|t| !t.is_empty()),
            started_after: match q.started_after.as_deref().filter(|s| !s.is_empty()) {
                None => None,
                Some(s) => Some(ids::parse_rfc3339(s).ok_or_else(|| {
                    ApiError::bad_request("startedAfter must be an RFC 3339 time")
                })?),
            },
        };
    let after = match q.next_token.as_deref().filter(|t| !t.is_empty()) {
        None => None,
        Some(t) => Some(ids::parse_page_token(t).map_err(ApiError::bad_request)?),
    };
    let (mut all, _) = listed(&g, &caller, &f).await?;
    all.sort_by(|a, b| (a.created_at, &a.id).cmp(&(b.created_at, &b.id)));
    if desc {
        all.reverse();
    }
    let start = match &after {
        None => 0,
        Some((at, id)) => all
            .iter()
            .position(|s| {
                let k = (s.created_at, &s.id);
                if desc {
                    k < (*at, id)
                } else {
                    k > (*at, id)
                }
            })
            .unwrap_or(all.len()),
    };
    let page: Vec<&pb::Sandbox> = all.iter().skip(start).take(limit).collect();
    let more = all.len() > start + page.len();
    let body: Vec<Value> = page.iter().map(|s| listed_json(s)).collect();
    let mut r = axum::Json(body).into_response();
    if let (true, Some(last)) = (more, page.last()) {
        if let Ok(v) = ids::page_token(last.created_at, &last.id).parse() {
            r.headers_mut().insert("x-next-token", v);
        }
    }
    Ok(r)
}

/// `GET /sandboxes` (E2B's 1.x SDKs): the running sandboxes, filtered by `metadata`.
pub async fn list_v1(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let q = ListQuery::parse(raw.as_deref())?;
    let f = Filter {
        running: true,
        paused: false,
        metadata: ids::metadata_filter(q.metadata.as_deref().unwrap_or_default())
            .map_err(ApiError::bad_request)?,
        template: None,
        started_after: None,
    };
    let (all, _) = listed(&g, &caller, &f).await?;
    let body: Vec<Value> = all.iter().map(listed_json).collect();
    Ok(axum::Json(body).into_response())
}

/// `DELETE /sandboxes/{id}`: stops the sandbox; 204. Errors: 404 as [`live`] (the SDK's
/// `kill()` then returns false).
pub async fn kill(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    let sb = live(&g, &caller, &id).await?;
    g.api()
        .stop_sandbox(g.req(&caller, pb::SandboxRef { id: sb.id }))
        .await
        .map_err(gone(&id))?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST /sandboxes/{id}/timeout` `{"timeout": s}`: the sandbox ends `s` seconds from now
/// (longer or shorter than before); 204. Errors: 400 for a missing or out-of-range timeout
/// (over `e2b.max_timeout_s` is refused, never cut), 404 as [`live`].
pub async fn set_timeout(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let m = fields(&body, &["timeout"], "timeout")?;
    let t = timeout_field(&m, "timeout", g.max_timeout_s)?
        .ok_or_else(|| ApiError::bad_request("timeout is required"))?;
    let sb = live(&g, &caller, &id).await?;
    let req = pb::SetSandboxTimeoutRequest {
        id: sb.id,
        timeout_s: t,
    };
    g.api()
        .set_sandbox_timeout(g.req(&caller, req))
        .await
        .map_err(gone(&id))?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// The longest a refresh keeps a sandbox, seconds (E2B's).
const MAX_REFRESH_S: i64 = 3600;

/// `POST /sandboxes/{id}/refreshes` `{"duration": s}` (≤ 3600; default 300): keeps the
/// sandbox at least `s` more seconds, never shortening its timeout; 204.
pub async fn refresh(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let m = fields(&body, &["duration"], "refreshes")?;
    let d = capped_seconds(&m, "duration", MAX_REFRESH_S, "a refresh's longest")?
        .unwrap_or(DEFAULT_TIMEOUT_S);
    let sb = live(&g, &caller, &id).await?;
    extend(&g, &caller, &sb, d).await?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST /sandboxes/{id}/pause`: 204 once paused. Errors: 409 when it already is (the
/// SDK's `pause()` returns false), 400 for a filesystem-only pause (`memory: false`), 404.
pub async fn pause(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let m = fields(&body, &["memory", "requireHealthyGuest"], "pause")?;
    keeps_memory(
        &m,
        "filesystem-only pauses are not supported; pauses keep the sandbox whole",
    )?;
    bool_field(&m, "requireHealthyGuest")?;
    let sb = live(&g, &caller, &id).await?;
    if paused(state_of(&sb)) {
        return Err(ApiError::new(
            409,
            format!(
                "sandbox {} is already paused",
                crate::types::names::shown(&id)
            ),
        ));
    }
    g.api()
        .pause_sandbox(g.req(&caller, pb::SandboxRef { id: sb.id }))
        .await
        .map_err(gone(&id))?;
    Ok(StatusCode::NO_CONTENT.into_response())
}

/// `POST /v2/sandboxes/{id}/connect` `{"timeout"?: s}`: a paused sandbox is resumed (201)
/// and kept at least `s` (default 300) seconds; a running one (200) gets a longer timeout
/// when `s` is given, never a shorter one. Returns E2B's `Sandbox`.
/// Errors: 400 for `memory: false` (a cold boot), 404 as [`live`].
pub async fn connect(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let m = fields(&body, &["timeout", "memory"], "connect")?;
    keeps_memory(&m, NO_COLD_BOOT)?;
    let t = timeout_field(&m, "timeout", g.max_timeout_s)?;
    let sb = live(&g, &caller, &id).await?;
    let (status, sb) = if paused(state_of(&sb)) {
        let sb = resume_and_extend(&g, &caller, &sb, &id, t.unwrap_or(DEFAULT_TIMEOUT_S)).await?;
        (StatusCode::CREATED, sb)
    } else {
        if let Some(t) = t {
            extend(&g, &caller, &sb, t).await?;
        }
        (StatusCode::OK, sb)
    };
    Ok((status, axum::Json(sandbox_json(&g, &caller, &sb))).into_response())
}

/// Extends first, so the lifetime that paused it does not pause it again at once.
async fn resume_and_extend(
    g: &Gateway,
    caller: &Caller,
    sb: &pb::Sandbox,
    e2b_id: &str,
    t: i64,
) -> Result<pb::Sandbox, ApiError> {
    extend(g, caller, sb, t).await?;
    let sb = g
        .api()
        .resume_sandbox(g.req(caller, pb::SandboxRef { id: sb.id.clone() }))
        .await
        .map_err(gone(e2b_id))?
        .into_inner();
    Ok(sb)
}

/// `POST /sandboxes/{id}/resume` (E2B's older SDKs): 201 with E2B's `Sandbox`.
/// Errors: 409 when it is running, 404 as [`live`].
pub async fn resume(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let m = fields(&body, &["timeout", "autoPause", "memory"], "resume")?;
    keeps_memory(&m, NO_COLD_BOOT)?;
    if field(&m, "autoPause").is_some() {
        return Err(ApiError::bad_request(
            "autoPause on resume is not supported; set it at creation",
        ));
    }
    let t = timeout_field(&m, "timeout", g.max_timeout_s)?;
    let sb = live(&g, &caller, &id).await?;
    if !paused(state_of(&sb)) {
        return Err(ApiError::new(
            409,
            format!(
                "sandbox {} is already running",
                crate::types::names::shown(&id)
            ),
        ));
    }
    let sb = resume_and_extend(&g, &caller, &sb, &id, t.unwrap_or(DEFAULT_TIMEOUT_S)).await?;
    Ok((
        StatusCode::CREATED,
        axum::Json(sandbox_json(&g, &caller, &sb)),
    )
        .into_response())
}

/// `GET /sandboxes/{id}/metrics`: an empty list (no metrics are collected yet, and an empty
/// list is the honest answer). Errors: 404 as [`live`].
pub async fn metrics(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
) -> Result<Response, ApiError> {
    live(&g, &caller, &id).await?;
    Ok(axum::Json(Vec::<Value>::new()).into_response())
}

/// `PUT /sandboxes/{id}/network`: replaces the sandbox's network configuration (omitted keys
/// clear), as at creation; 204. Errors: 400 as at creation, 404 as [`live`].
pub async fn update_network(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    Path(id): Path<String>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let m = object(&body)?;
    let rules = network_rules(&g, None, Some(&m))?;
    let sb = live(&g, &caller, &id).await?;
    let req = pb::UpdateNetworkRequest {
        id: sb.id,
        rules,
        replace: true,
    };
    g.api()
        .update_network(g.req(&caller, req))
        .await
        .map_err(gone(&id))?;
    Ok(StatusCode::NO_CONTENT.into_response())
}
