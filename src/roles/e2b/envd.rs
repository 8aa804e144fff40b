//! E2B's in-sandbox API ("envd") as the gateway serves it (docs/e2b.md "The in-sandbox
//! API"): which sandbox a request is for, who makes it, and `/health`. The services are in
//! `process` (commands and terminals).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::{ConnectInfo, FromRequestParts};
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;

use super::connect::{Code, ConnectError};
use super::{ids, Caller, Gateway};

/// The port envd listens on in an E2B sandbox; requests for it are ours to serve.
pub const ENVD_PORT: u16 = 49983;

/// An envd request: the sandbox (our id), the caller (their token, sent as the envd access
/// token), and the user it names (`Authorization: Basic <user:>`; empty = the sandbox's
/// default).
pub struct EnvdCall {
    pub sandbox_id: String,
    pub caller: Caller,
    pub user: String,
}

/// The sandbox and port a request is for: the `E2b-Sandbox-Id` and `E2b-Sandbox-Port`
/// headers (envd's port when the second is absent), else (with `e2b.domain` set) a host
/// `<port>-<sandbox>.<domain>`. `None` when neither names one; the port is `None` when it is
/// given but is no port (not a number within 1..=65535).
pub fn target(headers: &HeaderMap, domain: Option<&str>) -> Option<(String, Option<u16>)> {
    let h = |k: &str| headers.get(k).and_then(|v| v.to_str().ok()).map(str::trim);
    // Digits only, no sign and no leading zero: one spelling per port.
    let port = |p: &str| {
        (p.bytes().all(|b| b.is_ascii_digit()) && !p.starts_with('0'))
            .then(|| p.parse::<u16>().ok())
            .flatten()
    };
    if let Some(id) = h("e2b-sandbox-id").filter(|s| !s.is_empty()) {
        let mut given = headers.get_all("e2b-sandbox-port").iter();
        let p = match (given.next(), given.next()) {
            (None, _) => Some(ENVD_PORT),
            (Some(v), None) => v.to_str().ok().and_then(|v| port(v.trim())),
            // Two ports named: which one was meant cannot be told.
            (Some(_), Some(_)) => None,
        };
        return Some((id.to_string(), p));
    }
    let host = h("host")?;
    let host = host.rsplit_once(':').map_or(host, |(h, p)| {
        if p.bytes().all(|b| b.is_ascii_digit()) {
            h
        } else {
            host
        }
    });
    let label = host.strip_suffix(domain?)?.strip_suffix('.')?;
    let (p, id) = label.split_once('-')?;
    Some((id.to_string(), port(p)))
}

impl FromRequestParts<Arc<Gateway>> for EnvdCall {
    type Rejection = ConnectError;

    /// Errors: `unavailable` "sandbox ... was not found" (the phrase the SDKs read) without
    /// a sandbox or for an id that cannot be ours; `unauthenticated` without
    /// `X-Access-Token`; `invalid_argument` for a malformed `Authorization`.
    async fn from_request_parts(
        parts: &mut Parts,
        g: &Arc<Gateway>,
    ) -> Result<EnvdCall, ConnectError> {
        let h = &parts.headers;
        let (e2b_id, _port) = target(h, g.domain.as_deref()).ok_or_else(|| {
            ConnectError::new(
                Code::Unavailable,
                "no sandbox named: the sandbox was not found",
            )
        })?;
        let sandbox_id = ids::from_e2b(&e2b_id).ok_or_else(|| {
            ConnectError::new(
                Code::Unavailable,
                format!(
                    "sandbox {} was not found",
                    crate::types::names::shown(&e2b_id)
                ),
            )
        })?;
        let token = super::header_text(h, "x-access-token");
        if token.is_empty() {
            return Err(ConnectError::new(
                Code::Unauthenticated,
                "no X-Access-Token: the sandbox's envdAccessToken is required",
            ));
        }
        g.known.check(g, token).await?;
        let user = basic_user(h)?;
        let addr = parts
            .extensions
            .get::<ConnectInfo<SocketAddr>>()
            .map(|c| c.0.ip().to_string())
            .unwrap_or_default();
        Ok(EnvdCall {
            sandbox_id,
            caller: Caller {
                token: token.to_string(),
                project: g.project.clone(),
                addr,
            },
            user,
        })
    }
}

/// The user of `Authorization: Basic base64("<user>:")`; empty without the header.
/// Errors: `invalid_argument` for another scheme or bad base64.
fn basic_user(h: &HeaderMap) -> Result<String, ConnectError> {
    let Some(v) = h.get("authorization").and_then(|v| v.to_str().ok()) else {
        return Ok(String::new());
    };
    let bad = || ConnectError::new(Code::InvalidArgument, "Authorization must be Basic <user:>");
    let b64 = v.strip_prefix("Basic ").ok_or_else(bad)?;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|_| bad())?;
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    Ok(text.split(':').next().unwrap_or_default().to_string())
}

/// How long a token the apiserver recognised is taken as known.
const KNOWN_FOR: std::time::Duration = std::time::Duration::from_secs(10);
/// Digests kept before the expired ones are dropped.
const KNOWN_MAX: usize = 4096;

/// Digests of tokens the apiserver recognised in the last [`KNOWN_FOR`]. An in-sandbox call
/// with another token gets `unauthenticated` before its body is read, so nobody without a
/// token can make the gateway hold large bodies (the apiserver still checks every call).
#[derive(Default)]
pub struct KnownTokens(std::sync::Mutex<std::collections::HashMap<[u8; 32], std::time::Instant>>);

impl KnownTokens {
    /// Errors: `unauthenticated` for a token the apiserver refuses; its other failures.
    pub async fn check(&self, g: &Gateway, token: &str) -> Result<(), tonic::Status> {
        use sha2::Digest;
        let key: [u8; 32] = sha2::Sha256::digest(token.as_bytes()).into();
        let fresh = {
            let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
            m.get(&key).is_some_and(|at| at.elapsed() < KNOWN_FOR)
        };
        if fresh {
            return Ok(());
        }
        g.api()
            .who_am_i(crate::rpc::client::with_token(crate::pb::Empty {}, token))
            .await?;
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() >= KNOWN_MAX {
            m.retain(|_, at| at.elapsed() < KNOWN_FOR);
        }
        m.insert(key, std::time::Instant::now());
        Ok(())
    }
}

/// `GET /health`: 204 while the sandbox the request names runs or is paused; E2B's 502
/// "The sandbox was not found" once it is gone, stopped or not the caller's (the SDKs'
/// `is_running()` and their probe after a failed call read it). Without a sandbox or a token
/// it says whether the gateway serves.
pub async fn health(
    axum::extract::State(g): axum::extract::State<Arc<Gateway>>,
    headers: HeaderMap,
) -> Response {
    let Some((e2b_id, _)) = target(&headers, g.domain.as_deref()) else {
        return StatusCode::NO_CONTENT.into_response();
    };
    let token = super::header_text(&headers, "x-access-token");
    if token.is_empty() {
        return StatusCode::NO_CONTENT.into_response();
    }
    let gone = || {
        let body = serde_json::json!({"sandboxId": e2b_id, "message": "The sandbox was not found", "code": 502});
        (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
    };
    let Some(id) = ids::from_e2b(&e2b_id) else {
        return gone();
    };
    match sandbox_gone(&g, token, &id).await {
        Ok(true) => gone(),
        Ok(false) => StatusCode::NO_CONTENT.into_response(),
        Err(s) => ConnectError::from(s).into_response(),
    }
}

/// Whether sandbox `id` (ours) is gone for the caller with `token`: ended, unknown, or not
/// theirs to see. Errors: the apiserver's other failures.
pub async fn sandbox_gone(g: &Gateway, token: &str, id: &str) -> Result<bool, tonic::Status> {
    let req = crate::rpc::client::with_token(crate::pb::SandboxRef { id: id.into() }, token);
    match g.api().get_sandbox(req).await {
        Ok(sb) => {
            use crate::pb::SandboxState as S;
            Ok(matches!(
                S::try_from(sb.get_ref().state),
                Ok(S::Stopping | S::Stopped | S::Failed)
            ))
        }
        Err(s)
            if s.code() == tonic::Code::NotFound || s.code() == tonic::Code::PermissionDenied =>
        {
            Ok(true)
        }
        Err(s) => Err(s),
    }
}

/// E2B's words for a sandbox that is gone, which its SDKs turn into
/// `SandboxNotRunningException` (the phrase "was not found" is what they look for).
pub fn not_found_error(e2b_or_our_id: &str) -> ConnectError {
    ConnectError::new(
        Code::Unavailable,
        format!(
            "sandbox {} was not found",
            crate::types::names::shown(&ids::to_e2b(e2b_or_our_id))
        ),
    )
}

impl EnvdCall {
    /// `e`, except that a `not_found`, `failed_precondition` or `already_exists` failure of a sandbox that
    /// turns out to be gone (killed, timed out) becomes E2B's "was not found" (see
    /// [`not_found_error`]): the apiserver's own answer for it would read as a missing file
    /// or a refused operation. Costs one `GetSandbox`, on those failures only.
    pub async fn explain(&self, g: &Gateway, e: ConnectError) -> ConnectError {
        if matches!(
            e.code,
            Code::NotFound | Code::FailedPrecondition | Code::AlreadyExists
        ) && matches!(
            sandbox_gone(g, &self.caller.token, &self.sandbox_id).await,
            Ok(true)
        ) {
            return not_found_error(&self.sandbox_id);
        }
        e
    }

    /// `r` with its error as [`EnvdCall::explain`] gives it.
    pub async fn checked<T>(
        &self,
        g: &Gateway,
        r: Result<T, ConnectError>,
    ) -> Result<T, ConnectError> {
        match r {
            Err(e) => Err(self.explain(g, e).await),
            ok => ok,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(
                axum::http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                v.parse().unwrap(),
            );
        }
        h
    }

    #[test]
    fn requests_name_their_sandbox_by_header_or_host() {
        let h = headers(&[("E2b-Sandbox-Id", "n1-ab"), ("E2b-Sandbox-Port", "49999")]);
        assert_eq!(target(&h, None), Some(("n1-ab".into(), Some(49999))));
        let h = headers(&[("e2b-sandbox-id", "n1-ab")]);
        assert_eq!(target(&h, None), Some(("n1-ab".into(), Some(ENVD_PORT))));
        for bad in ["0", "65536", "http", "", "-1", "+80", "080", "8000.0"] {
            let h = headers(&[("e2b-sandbox-id", "n1-ab"), ("e2b-sandbox-port", bad)]);
            assert_eq!(target(&h, None), Some(("n1-ab".into(), None)), "{bad}");
        }
        let h = headers(&[("host", "49983-node-0-ab.sb.example.com:443")]);
        assert_eq!(
            target(&h, Some("sb.example.com")),
            Some(("node-0-ab".into(), Some(49983)))
        );
        let mut h = headers(&[("e2b-sandbox-id", "n1-ab"), ("e2b-sandbox-port", "80")]);
        h.append("e2b-sandbox-port", "90".parse().unwrap());
        assert_eq!(target(&h, None), Some(("n1-ab".into(), None)));
        let h = headers(&[("host", "0-node-0-ab.sb.example.com")]);
        assert_eq!(
            target(&h, Some("sb.example.com")),
            Some(("node-0-ab".into(), None))
        );
        assert_eq!(target(&h, Some("other.com")), None);
        // Without a domain, hosts name no sandbox.
        assert_eq!(target(&h, None), None);
        assert_eq!(target(&headers(&[("host", "127.0.0.1:7400")]), None), None);
    }

    #[test]
    fn the_user_comes_from_basic_auth() {
        assert_eq!(basic_user(&headers(&[])).unwrap(), "");
        let h = headers(&[("authorization", "Basic dXNlcjo=")]);
        assert_eq!(basic_user(&h).unwrap(), "user");
        assert!(basic_user(&headers(&[("authorization", "Bearer x")])).is_err());
    }
}
