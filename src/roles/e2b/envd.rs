//! E2B's in-sandbox API ("envd") as the gateway serves it (docs/e2b.md "The in-sandbox
//! API"): which sandbox a request is for, who makes it, and `/health`. The services are in
//! `process` (commands and terminals).

use std::sync::Arc;

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine;

use super::connect::{Code, ConnectError};
use super::{ids, Caller, Gateway};

/// The port envd listens on in an E2B sandbox; requests for it are ours to serve.
pub const ENVD_PORT: u16 = 49983;

/// An envd request: the sandbox (our id), the caller (the token sent as the envd access
/// token), and the user it names (`Authorization: Basic <user:>`, or a `/files` call's
/// `username`; empty = the sandbox's default).
pub struct EnvdCall {
    pub sandbox_id: String,
    pub caller: Caller,
    pub user: String,
}

impl EnvdCall {
    /// The session this call's file requests run in (docs/e2b.md "The in-sandbox API"):
    /// the default one without a user, `e2b:<user>` for a user named, whose first call
    /// fixes that session's user.
    pub fn session(&self) -> String {
        if self.user.is_empty() {
            String::new()
        } else {
            format!("e2b:{}", self.user)
        }
    }

    /// Takes `user` (a `/files` call's `username`) as the call's user when given.
    /// Errors: `invalid_argument` for what cannot be a user name.
    pub fn set_user(&mut self, user: String) -> Result<(), ConnectError> {
        if !user.is_empty() {
            check_user(&user)?;
            self.user = user;
        }
        Ok(())
    }
}

/// A user as the SDKs name one: a name of the sandbox's /etc/passwd or a uid, 1 to 64 of
/// letters, digits, `.`, `_` and `-`, not starting with `-` (whether the sandbox has it is
/// the sandbox's to say). Errors: `invalid_argument` naming it.
fn check_user(u: &str) -> Result<(), ConnectError> {
    let ok = !u.is_empty()
        && u.len() <= 64
        && !u.starts_with('-')
        && u.bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(ConnectError::new(
            Code::InvalidArgument,
            format!("user {} is not a user name", crate::types::names::shown(u)),
        ))
    }
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
        let mut token = super::header_text(h, "x-access-token").to_string();
        let mut signed = false;
        if token.is_empty() {
            token = signed_file_url(parts, g, &sandbox_id)?.ok_or_else(|| {
                ConnectError::new(
                    Code::Unauthenticated,
                    "no X-Access-Token: the sandbox's envdAccessToken is required",
                )
            })?;
            signed = true;
        }
        let addr = super::peer_ip(&parts.extensions);
        g.known.check(g, &token, &addr, Some(&sandbox_id)).await?;
        // A signed URL's user is the one it was signed for (its `username`, which the
        // handler takes): no header may name another.
        let user = if signed {
            if h.contains_key("authorization") {
                return Err(ConnectError::new(
                    Code::Unauthenticated,
                    "signed URL: its user is the signed username; send no Authorization",
                ));
            }
            String::new()
        } else {
            basic_user(h)?
        };
        Ok(EnvdCall {
            sandbox_id,
            caller: Caller {
                token,
                project: g.project.clone(),
                addr,
            },
            user,
        })
    }
}

/// The sandbox access token a signed `/files` URL stands for (docs/e2b.md "Access tokens and
/// signed URLs"): with `signature=v1_<base64 of sha256("<path>:<read|write>:<username>:
/// <token>[:<expiration>]")>` in the query, as E2B's SDKs make it, where `token` is the
/// sandbox's access token and the operation is `read` for GET and `write` for POST.
/// `None` for a request without a signature. Errors: `unauthenticated` for a signature
/// that does not hold (compared in constant time), an expiration passed or not a number,
/// and where the gateway makes no access tokens.
fn signed_file_url(
    parts: &Parts,
    g: &Gateway,
    sandbox_id: &str,
) -> Result<Option<String>, ConnectError> {
    use subtle::ConstantTimeEq;
    let q = parts.uri.query().unwrap_or_default();
    let (mut path, mut user, mut signature, mut expiration) = (None, None, None, None);
    for pair in q.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let slot = match k {
            "path" => &mut path,
            "username" => &mut user,
            "signature" => &mut signature,
            "signature_expiration" => &mut expiration,
            _ => continue,
        };
        *slot = ids::percent_decode(v);
    }
    let Some(signature) = signature else {
        return Ok(None);
    };
    let refused =
        |why: &str| ConnectError::new(Code::Unauthenticated, format!("signed URL: {why}"));
    let op = match (parts.uri.path(), parts.method.as_str()) {
        ("/files", "GET") => "read",
        ("/files", "POST") => "write",
        _ => return Err(refused("only /files is signed")),
    };
    let key = g.grants.as_ref().ok_or_else(|| {
        refused(
            "this gateway makes no access tokens (no service_token, or no grant.key in tls.dir)",
        )
    })?;
    let token = key.mint(sandbox_id);
    let mut raw = format!(
        "{}:{op}:{}:{token}",
        path.unwrap_or_default(),
        user.unwrap_or_default()
    );
    if let Some(exp) = &expiration {
        let at: i64 = exp
            .parse()
            .map_err(|_| refused("signature_expiration is not a number"))?;
        if at <= crate::types::now_s() {
            return Err(refused(&format!("it expired at {at} (unix seconds)")));
        }
        raw.push(':');
        raw.push_str(exp);
    }
    use sha2::Digest;
    let digest = sha2::Sha256::digest(raw.as_bytes());
    let want = format!(
        "v1_{}",
        base64::engine::general_purpose::STANDARD_NO_PAD.encode(digest)
    );
    if want.as_bytes().ct_eq(signature.as_bytes()).into() {
        Ok(Some(token))
    } else {
        Err(refused("the signature does not match"))
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
    // `<user>:<password>`, the password empty: a `:` in the user part is the user's, and
    // refused below as `/files`'s `username` is.
    let user = text.rsplit_once(':').map_or(text.as_str(), |(u, _)| u);
    if !user.is_empty() {
        check_user(user)?;
    }
    Ok(user.to_string())
}

/// How long a token the apiserver recognised is taken as known.
const KNOWN_FOR: std::time::Duration = std::time::Duration::from_secs(10);
/// Digests kept before the expired ones are dropped.
const KNOWN_MAX: usize = 4096;

/// Digests of (token, client address) pairs the apiserver recognised in the last
/// [`KNOWN_FOR`]. An in-sandbox call
/// with another token gets `unauthenticated` before its body is read, so nobody without a
/// token can make the gateway hold large bodies (the apiserver still checks every call).
#[derive(Default)]
pub struct KnownTokens(std::sync::Mutex<std::collections::HashMap<[u8; 32], std::time::Instant>>);

impl KnownTokens {
    /// Checks `token` for a call on `sandbox` (ours; `None` for the control plane). A
    /// sandbox access token is checked here, and holds only for its own sandbox; others are
    /// asked of the apiserver, on behalf of the client at `addr` (so IAM's failed-
    /// authentication limit counts that client, not the gateway). Errors:
    /// `unauthenticated` for a token refused; `rate_limited` for a client locked out; the
    /// apiserver's other failures.
    pub async fn check(
        &self,
        g: &Gateway,
        token: &str,
        addr: &str,
        sandbox: Option<&str>,
    ) -> Result<(), tonic::Status> {
        if crate::rpc::grant::is_grant(token) {
            let for_sandbox = g.grants.as_ref().and_then(|k| k.check(token));
            return match (for_sandbox, sandbox) {
                (Some(id), Some(s)) if id == s => Ok(()),
                (Some(_), None) => Err(tonic::Status::unauthenticated(
                    "a sandbox's envdAccessToken is not an API key: send your API key",
                )),
                _ => Err(tonic::Status::unauthenticated(
                    "X-Access-Token is not this sandbox's envdAccessToken",
                )),
            };
        }
        // Keyed by the client's address too: a token known from one address says nothing
        // for a locked-out one, which must get the same answer for every token.
        use sha2::Digest;
        let key: [u8; 32] = sha2::Sha256::new()
            .chain_update(token.as_bytes())
            .chain_update([0])
            .chain_update(addr.as_bytes())
            .finalize()
            .into();
        let fresh = {
            let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
            m.get(&key).is_some_and(|at| at.elapsed() < KNOWN_FOR)
        };
        if fresh {
            return Ok(());
        }
        g.api()
            .who_am_i(crate::rpc::client::on_behalf(
                crate::pb::Empty {},
                &g.service_token,
                token,
                addr,
            ))
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
    parts: axum::http::request::Parts,
) -> Response {
    let headers = &parts.headers;
    let Some((e2b_id, _)) = target(headers, g.domain.as_deref()) else {
        return StatusCode::NO_CONTENT.into_response();
    };
    let token = super::header_text(headers, "x-access-token");
    if token.is_empty() {
        return StatusCode::NO_CONTENT.into_response();
    }
    let addr = super::peer_ip(&parts.extensions);
    let gone = || {
        let body = serde_json::json!({"sandboxId": e2b_id, "message": "The sandbox was not found", "code": 502});
        (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
    };
    let Some(id) = ids::from_e2b(&e2b_id) else {
        return gone();
    };
    // Checked as every envd call is, with the caller's address: asked straight of the
    // apiserver, a bad token would count against the gateway's own address and lock every
    // other client out (found by a new user's trial).
    if let Err(s) = g.known.check(&g, token, &addr, Some(&id)).await {
        return ConnectError::from(s).into_response();
    }
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

/// A call refused before its body is read, `e`: a known caller's (small) body is read
/// through first, for at most 1 MiB and 5 s, so a client still sending it gets the answer
/// rather than a broken connection; an unauthenticated one's is never read.
pub async fn refuse_after_body(e: ConnectError, body: axum::body::Body) -> ConnectError {
    if e.code != Code::Unauthenticated {
        let _ = tokio::time::timeout(
            std::time::Duration::from_secs(5),
            axum::body::to_bytes(body, 1 << 20),
        )
        .await;
    }
    e
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

    fn gateway() -> Gateway {
        let mut cfg: crate::config::Config = serde_json::from_value(serde_json::json!({
            "service_token": "s",
            "apiserver": [{"addr": "127.0.0.1:1"}],
            "e2b": {"gateways": [{"addr": "127.0.0.1:0"}], "project": "root"}
        }))
        .unwrap();
        cfg.iam.admin_token = "dsk.admin.x".into();
        Gateway::new(&cfg, &crate::rpc::client::Dialer::plain()).unwrap()
    }

    /// A request's parts for `method uri`.
    fn parts(method: &str, uri: &str) -> Parts {
        axum::http::Request::builder()
            .method(method)
            .uri(uri)
            .body(())
            .unwrap()
            .into_parts()
            .0
    }

    /// The signature E2B's SDK makes (`e2b/sandbox/signature.py`), percent-encoded.
    fn sign(token: &str, path: &str, op: &str, exp: Option<i64>) -> String {
        use sha2::Digest;
        let mut raw = format!("{path}:{op}::{token}");
        if let Some(e) = exp {
            raw.push_str(&format!(":{e}"));
        }
        let b64 = base64::engine::general_purpose::STANDARD_NO_PAD
            .encode(sha2::Sha256::digest(raw.as_bytes()));
        format!("v1_{}", b64.replace('+', "%2B").replace('/', "%2F"))
    }

    #[tokio::test]
    async fn a_signed_file_url_stands_for_the_sandbox_token_for_its_path_operation_and_time() {
        let g = gateway();
        let id = "n1.abc";
        let token = g.grants.as_ref().unwrap().mint(id);
        let p = "/tmp/a%20b.txt";
        let now = crate::types::now_s();
        let ok = format!(
            "/files?path={p}&signature={}",
            sign(&token, "/tmp/a b.txt", "read", None)
        );
        assert_eq!(
            signed_file_url(&parts("GET", &ok), &g, id).unwrap(),
            Some(token.clone())
        );
        let exp = now + 60;
        let ok = format!(
            "/files?path={p}&signature={}&signature_expiration={exp}",
            sign(&token, "/tmp/a b.txt", "write", Some(exp))
        );
        assert_eq!(
            signed_file_url(&parts("POST", &ok), &g, id).unwrap(),
            Some(token.clone())
        );
        // No signature: not a signed URL.
        assert_eq!(
            signed_file_url(&parts("GET", "/files?path=/x"), &g, id).unwrap(),
            None
        );
        let refused = [
            // The same URL for another operation, sandbox or path.
            ("GET", ok.clone(), id),
            ("POST", ok.clone(), "n1.abd"),
            ("POST", ok.replace("a%20b", "a%20c"), id),
            // Another expiration than the one signed, one passed, one not a number.
            (
                "POST",
                ok.replace(&exp.to_string(), &(exp + 1).to_string()),
                id,
            ),
            (
                "GET",
                format!(
                    "/files?path={p}&signature={}&signature_expiration={}",
                    sign(&token, "/tmp/a b.txt", "read", Some(now - 1)),
                    now - 1
                ),
                id,
            ),
            (
                "GET",
                format!("/files?path={p}&signature=v1_x&signature_expiration=soon"),
                id,
            ),
            // Only /files is signed.
            (
                "POST",
                format!(
                    "/process.Process/Start?signature={}",
                    sign(&token, "", "write", None)
                ),
                id,
            ),
        ];
        for (m, uri, sb) in refused {
            let e = signed_file_url(&parts(m, &uri), &g, sb).expect_err(&uri);
            assert_eq!(e.code, Code::Unauthenticated, "{uri}");
        }
    }

    #[test]
    fn the_user_comes_from_basic_auth() {
        assert_eq!(basic_user(&headers(&[])).unwrap(), "");
        let h = headers(&[("authorization", "Basic dXNlcjo=")]);
        assert_eq!(basic_user(&h).unwrap(), "user");
        assert!(basic_user(&headers(&[("authorization", "Bearer x")])).is_err());
        // "root:0:" is the user "root:0", which is no user name (as `username=root:0` is not).
        let b64 = |t: &str| base64::engine::general_purpose::STANDARD.encode(t);
        let h = headers(&[("authorization", &format!("Basic {}", b64("root:0:")))]);
        assert_eq!(basic_user(&h).unwrap_err().code, Code::InvalidArgument);
        let h = headers(&[("authorization", &format!("Basic {}", b64("nobody")))]);
        assert_eq!(basic_user(&h).unwrap(), "nobody");
    }
}
