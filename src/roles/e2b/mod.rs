//! The E2B-compatible gateway (docs/e2b.md): E2B's control-plane REST API on one port,
//! translated into calls to the apiserver made with the caller's own token, so permissions,
//! quotas, rate limits and the audit log apply as to any caller. It keeps no state.

mod build;
mod connect;
mod create;
mod envd;
mod error;
mod files;
mod ids;
mod ports;
mod process;
mod sandboxes;
mod serve;
mod snapshots;
mod templates;
mod watch;

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::request::Parts;
use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;
use tonic::transport::{Channel, Endpoint};

use crate::config::{Config, E2bTemplate};
use crate::pb::d_sec_client::DSecClient;
use crate::shutdown::Shutdown;
use crate::telemetry::Ready;

pub use error::ApiError;

/// The envd version the gateway reports to SDKs. They switch features on by it
/// (docs/e2b.md "Versions"); it moves up as the gateway serves more of envd.
pub const ENVD_VERSION: &str = "0.6.4";

/// The gateway could not start.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    #[error("e2b: no gateway entry {0} in the config")]
    NoEntry(usize),
    #[error("e2b: no apiserver in the config")]
    NoApiserver,
    #[error("e2b: apiserver address")]
    Address(#[from] crate::rpc::client::ClientError),
    #[error(transparent)]
    Tls(#[from] serve::TlsError),
    #[error("e2b: TLS to the apiservers")]
    ClientTls(#[from] crate::rpc::tls::TlsError),
    #[error("e2b: reading the sandbox access token key")]
    GrantKey(#[source] std::io::Error),
}

/// What every request handler shares: the apiserver client and the config, read once.
pub struct Gateway {
    api: DSecClient<Channel>,
    service_token: String,
    /// Makes and checks sandbox access tokens, E2B's `envdAccessToken` (docs/e2b.md
    /// "Access tokens and signed URLs"); none without a `service_token`.
    grants: Option<crate::rpc::grant::GrantKey>,
    project: String,
    domain: Option<String>,
    templates: std::collections::BTreeMap<String, E2bTemplate>,
    default_template: Option<E2bTemplate>,
    max_timeout_s: i64,
    /// Whether the cluster's edges have sandbox networking: without it a sandbox gets no
    /// rules (and no network), and network options are refused.
    networked: bool,
    /// The cluster's default rules, turned off for a sandbox without internet access.
    default_rules: Vec<String>,
    /// The environment variables sandboxes were created with, for one minute.
    envs: process::EnvCache,
    /// Tokens the apiserver recognised lately (their digests), so an in-sandbox call is
    /// refused before its body is read unless its token is one.
    known: envd::KnownTokens,
    /// Template builds this gateway follows, and their uploaded files.
    builds: templates::Builds,
    /// `https` when this gateway serves TLS, else `http`: the scheme of links it makes.
    scheme: &'static str,
}

impl Gateway {
    /// Builds the gateway of `cfg`, with a channel balanced over every apiserver, reached
    /// through `dialer` (TLS with the gateway's certificate when the cluster has TLS).
    /// Errors: `NoApiserver`, `Address` for an address that is not `host:port`, `GrantKey`.
    pub fn new(cfg: &Config, dialer: &crate::rpc::client::Dialer) -> Result<Gateway, GatewayError> {
        let mut eps: Vec<Endpoint> = Vec::new();
        for a in &cfg.apiserver {
            eps.push(dialer.public_endpoint(&a.addr, Duration::from_secs(5))?);
        }
        if eps.is_empty() {
            return Err(GatewayError::NoApiserver);
        }
        let api = DSecClient::new(Channel::balance_list(eps.into_iter()))
            .max_decoding_message_size(crate::rpc::MAX_MESSAGE)
            .max_encoding_message_size(crate::rpc::MAX_MESSAGE);
        let e = &cfg.e2b;
        let networked = cfg
            .edges
            .iter()
            .chain(cfg.edge_template.iter())
            .any(|x| x.network.enabled);
        Ok(Gateway {
            api,
            service_token: cfg.service_token.clone(),
            grants: crate::rpc::grant::GrantKey::for_config(cfg).map_err(GatewayError::GrantKey)?,
            project: e.project.clone(),
            domain: (!e.domain.is_empty()).then(|| e.domain.clone()),
            templates: e.templates.clone(),
            default_template: e.default_template.clone(),
            // The cap callers meet first: e2b.max_timeout_s, or admission's longest lifetime
            // (a timeout is a lifetime here), so an over-long timeout is refused in E2B's
            // words rather than as the apiserver's ttl_max.
            max_timeout_s: match (e.max_timeout_s, cfg.admission.max_ttl_max_s()) {
                (0, a) => a,
                (m, a) if a > 0 => m.min(a),
                (m, _) => m,
            },
            networked,
            default_rules: cfg.network.default_rules.keys().cloned().collect(),
            envs: process::EnvCache::default(),
            known: envd::KnownTokens::default(),
            builds: templates::Builds::new(&e.build_dir),
            scheme: "http",
        })
    }

    /// Whether `name` is a template of `e2b.templates`.
    fn has_template(&self, name: &str) -> bool {
        self.templates.contains_key(name)
    }

    /// The HTTP routes of the control plane and of envd (docs/e2b.md "What works").
    pub fn router(self: Arc<Self>) -> Router {
        let control = Router::new()
            .route("/v2/sandboxes", post(create::create).get(sandboxes::list))
            .route("/sandboxes", post(create::create).get(sandboxes::list_v1))
            .route(
                "/sandboxes/{id}",
                get(sandboxes::get_info).delete(sandboxes::kill),
            )
            .route("/sandboxes/{id}/timeout", post(sandboxes::set_timeout))
            .route("/sandboxes/{id}/refreshes", post(sandboxes::refresh))
            .route("/sandboxes/{id}/pause", post(sandboxes::pause))
            .route("/v2/sandboxes/{id}/connect", post(sandboxes::connect))
            .route("/sandboxes/{id}/connect", post(sandboxes::connect))
            .route("/sandboxes/{id}/resume", post(sandboxes::resume))
            .route("/sandboxes/{id}/metrics", get(sandboxes::metrics))
            .route(
                "/sandboxes/{id}/network",
                axum::routing::put(sandboxes::update_network),
            )
            .route(
                "/sandboxes/{id}/snapshots",
                post(snapshots::create_snapshot),
            )
            .route("/snapshots", get(snapshots::list_snapshots))
            .route(
                "/templates/{id}",
                axum::routing::delete(snapshots::delete_snapshot),
            )
            .route("/sandboxes/{id}/fork", post(snapshots::fork))
            .route("/v3/templates", post(templates::request_build))
            .route("/v2/templates", post(templates::request_build))
            .route("/templates/{id}/files/{hash}", get(templates::file_link))
            .route(
                "/v2/templates/{id}/builds/{build}",
                post(templates::start_build),
            )
            .route(
                "/templates/{id}/builds/{build}/status",
                get(templates::build_status),
            )
            .route("/templates/aliases/{name}", get(templates::alias))
            .route_layer(axum::middleware::from_fn_with_state(
                self.clone(),
                control_body,
            ));
        // envd, the in-sandbox API: its paths never clash with the control plane's. Its
        // bodies stream (uploads, a terminal's input), so they are not read ahead.
        Router::new()
            .merge(control)
            .route("/process.Process/{method}", post(process::call))
            .route("/health", get(envd::health))
            .route("/files", get(files::download).post(files::upload))
            // A template build's upload: its link is its authority, and its body streams.
            .route(
                "/templates/{id}/files/{hash}",
                axum::routing::put(templates::upload),
            )
            .route("/filesystem.Filesystem/{method}", post(files::filesystem))
            .fallback(not_served)
            .method_not_allowed_fallback(not_allowed)
            .layer(axum::middleware::map_response(json_errors))
            // Requests for a sandbox's own ports go to it whatever their path, and its
            // answers come back untouched.
            .layer(axum::middleware::from_fn_with_state(
                self.clone(),
                ports::dispatch,
            ))
            .with_state(self)
    }

    /// Wraps `msg` for the apiserver as a call of `caller`.
    fn req<T>(&self, caller: &Caller, msg: T) -> tonic::Request<T> {
        crate::rpc::client::on_behalf(msg, &self.service_token, &caller.token, &caller.addr)
    }

    /// The envd access token E2B's SDKs get for sandbox `id` (ours): its sandbox access
    /// token, or the caller's own token where the cluster has no `service_token`.
    fn envd_token(&self, caller: &Caller, id: &str) -> String {
        match &self.grants {
            Some(k) => k.mint(id),
            None => caller.token.clone(),
        }
    }

    /// The client for one call (clones share the channel).
    fn api(&self) -> DSecClient<Channel> {
        self.api.clone()
    }
}

async fn not_served(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        404,
        format!(
            "{} is not an endpoint of this API",
            crate::types::names::shown(uri.path())
        ),
    )
}

/// Every failure the gateway itself answers is JSON `{"code", "message"}`: the framework's
/// own refusals (a body over the limit, a header that is not text) come as plain text or
/// nothing, and E2B's SDKs cannot parse that.
async fn json_errors(r: axum::response::Response) -> axum::response::Response {
    let status = r.status();
    let json = r
        .headers()
        .get(axum::http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.contains("json"));
    if !(status.is_client_error() || status.is_server_error()) || json {
        return r;
    }
    let (_, body) = r.into_parts();
    let text = axum::body::to_bytes(body, 4096).await.unwrap_or_default();
    let mut message = String::from_utf8_lossy(&text).trim().to_string();
    if message.is_empty() {
        message = status.canonical_reason().unwrap_or("error").to_string();
    }
    axum::response::IntoResponse::into_response(ApiError::new(status.as_u16(), message))
}

async fn not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        405,
        format!(
            "{method} is not a method of {}",
            crate::types::names::shown(uri.path())
        ),
    )
}

/// The IP a request came from (what the gateway forwards to the apiserver as the caller's
/// address), or "" where the server recorded none.
fn peer_ip(ext: &axum::http::Extensions) -> String {
    ext.get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0.ip().to_string())
        .unwrap_or_default()
}

/// Who is calling: the API key (an OpenDsec token), the project to work in, and the peer.
#[derive(Clone)]
pub struct Caller {
    pub token: String,
    pub project: String,
    pub addr: String,
}

impl FromRequestParts<Arc<Gateway>> for Caller {
    type Rejection = ApiError;

    /// Errors: 401 without `X-API-Key`; 400 for a project header that is not text.
    async fn from_request_parts(parts: &mut Parts, g: &Arc<Gateway>) -> Result<Caller, ApiError> {
        let h = &parts.headers;
        let token = header_text(h, "x-api-key");
        if token.is_empty() {
            return Err(ApiError::unauthenticated(
                "no API key: set E2B_API_KEY to an OpenDsec token",
            ));
        }
        let project = match h.get("x-opendsec-project") {
            None => g.project.clone(),
            Some(v) => v
                .to_str()
                .map_err(|_| ApiError::bad_request("X-OpenDsec-Project is not text"))?
                .to_string(),
        };
        let addr = peer_ip(&parts.extensions);
        Ok(Caller {
            token: token.to_string(),
            project,
            addr,
        })
    }
}

/// Starts gateway `index` of `cfg.e2b.gateways` on `listener` (HTTP/1.1 and HTTP/2, over TLS
/// when the entry has `tls_cert` and `tls_key`); it serves until `shutdown`. `ready` turns
/// true once it serves. Errors: `NoEntry`, `NoApiserver`, `Address`, `Tls`.
pub async fn start(
    cfg: Arc<Config>,
    index: usize,
    listener: TcpListener,
    shutdown: Shutdown,
    ready: Ready,
) -> Result<tokio::task::JoinHandle<()>, GatewayError> {
    let Some(entry) = cfg.e2b.gateways.get(index) else {
        return Err(GatewayError::NoEntry(index));
    };
    let limits = serve::Limits {
        max: entry.max_connections.unwrap_or(serve::MAX_CONNECTIONS),
        per_address: entry
            .max_connections_per_address
            .unwrap_or(serve::MAX_CONNECTIONS_PER_ADDRESS),
        header_timeout: serve::HEADER_TIMEOUT,
    };
    let tls = if entry.tls_cert.is_empty() {
        None
    } else {
        Some(serve::tls_acceptor(&entry.tls_cert, &entry.tls_key)?)
    };
    let me = crate::pki::Identity::new(crate::pki::Role::E2b, &index.to_string()).map_err(|e| {
        crate::rpc::tls::TlsError::Bad {
            path: cfg.tls.dir.clone().into(),
            why: e.to_string(),
        }
    })?;
    let dialer = crate::rpc::client::Dialer::new(crate::rpc::tls::for_component(&cfg, &me)?)?;
    let mut g = Gateway::new(&cfg, &dialer)?;
    if tls.is_some() {
        g.scheme = "https";
    }
    let g = Arc::new(g);
    let app = g.router().layer(axum::middleware::from_fn(trace));
    ready.set(true, "e2b");
    Ok(tokio::spawn(serve::serve(
        listener, app, shutdown, limits, tls,
    )))
}

/// Header `name` as text, trimmed; "" when absent or not text.
pub(crate) fn header_text<'a>(h: &'a axum::http::HeaderMap, name: &str) -> &'a str {
    h.get(name)
        .and_then(|v| v.to_str().ok())
        .map(str::trim)
        .unwrap_or_default()
}

/// The most a control-plane request body may hold (E2B's bodies are small JSON objects).
const MAX_CONTROL_BODY: usize = 2 << 20;
/// How long a control-plane request body may take to arrive, once its headers have.
const CONTROL_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Control-plane requests: the caller's token is checked (`WhoAmI`, remembered as for the
/// in-sandbox API) before the body is read, and the whole body (at most 2 MB) must arrive
/// within 30 s, so nobody can hold the gateway's connections with bodies that never end.
/// Errors: 401 for an unknown token, 408 for a body that did not arrive in time, 413 for
/// one over the limit, 400 for one that broke off.
async fn control_body(
    axum::extract::State(g): axum::extract::State<Arc<Gateway>>,
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse;
    let token = header_text(req.headers(), "x-api-key").to_string();
    // No token at all: the handler's Caller answers 401 with E2B's words.
    if !token.is_empty() {
        if let Err(s) = g
            .known
            .check(&g, &token, &peer_ip(req.extensions()), None)
            .await
        {
            return ApiError::from(s).into_response();
        }
    }
    let (parts, body) = req.into_parts();
    match read_within(body, MAX_CONTROL_BODY, CONTROL_BODY_TIMEOUT).await {
        Ok(bytes) => {
            next.run(axum::extract::Request::from_parts(
                parts,
                axum::body::Body::from(bytes),
            ))
            .await
        }
        Err(e) => e.into_response(),
    }
}

/// The whole of `body`, at most `limit` bytes, within `timeout`. Errors: 408 when it did
/// not arrive in time, 413 over the limit, 400 when it broke off.
async fn read_within(
    body: axum::body::Body,
    limit: usize,
    timeout: std::time::Duration,
) -> Result<axum::body::Bytes, ApiError> {
    match tokio::time::timeout(timeout, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(b)) => Ok(b),
        Err(_) => Err(ApiError::new(
            408,
            format!(
                "the request body did not arrive within {} s",
                timeout.as_secs_f64()
            ),
        )),
        Ok(Err(e)) => {
            let over = std::error::Error::source(&e)
                .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
            Err(if over {
                ApiError::new(413, format!("the request body is over {limit} bytes"))
            } else {
                ApiError::bad_request(format!("the request body broke off: {e}"))
            })
        }
    }
}

/// A tracing span per request: method and path, and the status and time once served.
async fn trace(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use tracing::Instrument;
    let span = tracing::info_span!("e2b", method = %req.method(), path = %req.uri().path());
    let started = std::time::Instant::now();
    let r = next.run(req).instrument(span.clone()).await;
    tracing::debug!(
        parent: &span,
        status = r.status().as_u16(),
        ms = started.elapsed().as_secs_f64() * 1e3,
        "served"
    );
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt;
    use std::time::Duration;

    #[tokio::test]
    async fn a_control_body_must_arrive_whole_in_time_and_within_the_limit() {
        let body = axum::body::Body::from("{\"a\":1}");
        let got = read_within(body, 64, Duration::from_secs(1)).await;
        assert_eq!(got.unwrap().as_ref(), b"{\"a\":1}");
        // A body that starts and never ends: 408 once the time is up.
        let stalled = futures::stream::once(async {
            Ok::<_, std::io::Error>(axum::body::Bytes::from_static(b"{"))
        })
        .chain(futures::stream::pending());
        let body = axum::body::Body::from_stream(stalled);
        let e = read_within(body, 64, Duration::from_millis(200))
            .await
            .unwrap_err();
        assert_eq!(e.status, 408, "{e:?}");
        let e = read_within(
            axum::body::Body::from(vec![b' '; 65]),
            64,
            Duration::from_secs(1),
        )
        .await
        .unwrap_err();
        assert_eq!(e.status, 413, "{e:?}");
        let broken = futures::stream::iter([
            Ok(axum::body::Bytes::from_static(b"{")),
            Err(std::io::Error::other("reset")),
        ]);
        let e = read_within(
            axum::body::Body::from_stream(broken),
            64,
            Duration::from_secs(1),
        )
        .await
        .unwrap_err();
        assert_eq!(e.status, 400, "{e:?}");
    }
}
