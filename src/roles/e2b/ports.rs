//! Ports of a sandbox through the gateway (docs/e2b.md "Ports"): a request naming a sandbox
//! port other than envd's (`E2b-Sandbox-Port`, or a host `<port>-<sandbox>.<domain>`) is
//! passed to that port on the sandbox's loopback over the apiserver's `ConnectPort`, with
//! the caller's token; its answer comes back as it streams, and a WebSocket (any upgrade)
//! becomes a byte stream both ways. Sandbox ports always need the token.

use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use hyper_util::rt::TokioIo;
use tokio::io::AsyncWriteExt;

use super::envd::{self, ENVD_PORT};
use super::{ids, Caller, Gateway};
use crate::guest::port::MAX_FRAME;
use crate::pb;

/// Headers that carry the caller's secrets or our routing: never passed to the sandbox.
const OURS: &[&str] = &[
    "x-access-token",
    "e2b-traffic-access-token",
    "x-api-key",
    "e2b-sandbox-id",
    "e2b-sandbox-port",
];

/// Headers of one hop (RFC 9110 §7.6.1), not passed on, except for an upgrade's.
const HOP: &[&str] = &[
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// E2B's proxy answers, whose phrases the SDKs look for: 502 with `sandboxId` and
/// `message`.
fn proxy_error(e2b_id: &str, port: u16, message: &str) -> Response {
    let body =
        serde_json::json!({"sandboxId": e2b_id, "message": message, "port": port, "code": 502});
    (StatusCode::BAD_GATEWAY, axum::Json(body)).into_response()
}

/// Sends requests for a sandbox port other than envd's to [`proxy`]; the rest go on.
pub async fn dispatch(State(g): State<Arc<Gateway>>, req: Request, next: Next) -> Response {
    match envd::target(req.headers(), g.domain.as_deref()) {
        Some((id, None)) => {
            let body = serde_json::json!({"code": 400, "message": format!(
                "sandbox {}: the port named (E2b-Sandbox-Port or the host's first label) is not a port within 1..65535",
                crate::types::names::shown(&id))});
            (StatusCode::BAD_REQUEST, axum::Json(body)).into_response()
        }
        Some((id, Some(port))) if port != ENVD_PORT => proxy(g, req, id, port).await,
        _ => next.run(req).await,
    }
}

/// The caller's token for a port: `X-Access-Token`, `E2B-Traffic-Access-Token` (the code
/// interpreter SDKs) or `X-API-Key`.
fn token(h: &HeaderMap) -> Option<String> {
    ["x-access-token", "e2b-traffic-access-token", "x-api-key"]
        .iter()
        .filter_map(|k| h.get(*k).and_then(|v| v.to_str().ok()))
        .map(str::trim)
        .find(|t| !t.is_empty())
        .map(str::to_string)
}

async fn proxy(g: Arc<Gateway>, mut req: Request, e2b_id: String, port: u16) -> Response {
    let Some(token) = token(req.headers()) else {
        let body = serde_json::json!({"code": 401, "message":
            "sandbox ports need the caller's token: X-Access-Token or E2B-Traffic-Access-Token"});
        return (StatusCode::UNAUTHORIZED, axum::Json(body)).into_response();
    };
    let Some(sandbox_id) = ids::from_e2b(&e2b_id) else {
        return proxy_error(&e2b_id, port, "The sandbox was not found");
    };
    let caller = Caller {
        token,
        project: g.project.clone(),
        addr: super::peer_ip(req.extensions()),
    };
    let io = match open(&g, &caller, &sandbox_id, port).await {
        Ok(io) => io,
        Err(s) if s.code() == tonic::Code::NotFound => {
            return proxy_error(&e2b_id, port, "The sandbox was not found")
        }
        // The caller's own trouble (no such token, not theirs, locked out or rate limited,
        // a bad request): said as the control plane says it, never as a closed port.
        Err(s)
            if matches!(
                s.code(),
                tonic::Code::Unauthenticated
                    | tonic::Code::PermissionDenied
                    | tonic::Code::ResourceExhausted
                    | tonic::Code::InvalidArgument
            ) =>
        {
            let f = crate::rpc::failure_from_status(&s);
            return super::ApiError::from(f).into_response();
        }
        // A killed or timed-out sandbox refuses as "not running": say it is gone.
        Err(_)
            if matches!(
                envd::sandbox_gone(&g, &caller.token, &sandbox_id).await,
                Ok(true)
            ) =>
        {
            return proxy_error(&e2b_id, port, "The sandbox was not found")
        }
        Err(_) => return proxy_error(&e2b_id, port, "The sandbox is running but port is not open"),
    };
    let (mut sender, conn) = match hyper::client::conn::http1::handshake(TokioIo::new(io)).await {
        Ok(x) => x,
        Err(_) => return proxy_error(&e2b_id, port, "The sandbox is running but port is not open"),
    };
    tokio::spawn(async move {
        let _ = conn.with_upgrades().await;
    });
    let upgrade = req.headers().contains_key(header::UPGRADE);
    let client_upgrade = upgrade.then(|| hyper::upgrade::on(&mut req));
    let (parts, body) = req.into_parts();
    let mut out = hyper::Request::builder().method(parts.method.clone()).uri(
        parts
            .uri
            .path_and_query()
            .map_or("/", |p| p.as_str())
            .to_string(),
    );
    for (k, v) in parts.headers.iter() {
        let name = k.as_str();
        if OURS.contains(&name) || (HOP.contains(&name) && !upgrade) {
            continue;
        }
        out = out.header(k, v);
    }
    let Ok(out) = out.body(body) else {
        return proxy_error(&e2b_id, port, "the request could not be passed on");
    };
    let mut resp = match sender.send_request(out).await {
        Ok(r) => r,
        Err(_) => return proxy_error(&e2b_id, port, "The sandbox is running but port is not open"),
    };
    if resp.status() == StatusCode::SWITCHING_PROTOCOLS {
        let server_side = hyper::upgrade::on(&mut resp);
        if let Some(client_side) = client_upgrade {
            tokio::spawn(async move {
                if let (Ok(c), Ok(s)) = (client_side.await, server_side.await) {
                    let (mut c, mut s) = (TokioIo::new(c), TokioIo::new(s));
                    let _ = tokio::io::copy_bidirectional(&mut c, &mut s).await;
                }
            });
        }
        let (parts, _) = resp.into_parts();
        return Response::from_parts(parts, Body::empty());
    }
    let (mut parts, body) = resp.into_parts();
    for h in HOP {
        parts.headers.remove(HeaderName::from_static(h));
    }
    parts.headers.insert(
        "x-opendsec-sandbox",
        HeaderValue::from_str(&e2b_id).unwrap_or(HeaderValue::from_static("")),
    );
    Response::from_parts(parts, Body::new(body))
}

/// One TCP connection to `port` on the sandbox's loopback, as a local byte stream.
/// Errors: the apiserver's (`not_found`, `unauthenticated`, `forbidden`), or `unavailable`
/// when nothing listens there.
pub(super) async fn open(
    g: &Gateway,
    caller: &Caller,
    sandbox_id: &str,
    port: u16,
) -> Result<tokio::io::DuplexStream, tonic::Status> {
    let (tx, rx) = tokio::sync::mpsc::channel::<pb::PortFrame>(8);
    let first = pb::PortFrame {
        sandbox_id: sandbox_id.to_string(),
        port: u32::from(port),
        ..Default::default()
    };
    // The channel has room: nothing was sent yet.
    let _ = tx.try_send(first);
    let stream =
        futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|f| (f, rx)) });
    let mut frames = g
        .api()
        .connect_port(g.req(caller, stream))
        .await?
        .into_inner();
    // The first answer says whether the port took the connection.
    let first = frames.message().await?;
    let (ours, theirs) = tokio::io::duplex(4 * MAX_FRAME);
    let (rd, mut wr) = tokio::io::split(theirs);
    if let Some(f) = first {
        if !f.data.is_empty() {
            let _ = wr.write_all(&f.data).await;
        }
        if f.eof {
            let _ = wr.shutdown().await;
        }
    }
    tokio::spawn(crate::guest::port::send_reads(rd, tx));
    tokio::spawn(async move {
        while let Ok(Some(f)) = frames.message().await {
            if !f.data.is_empty() && wr.write_all(&f.data).await.is_err() {
                break;
            }
            if f.eof {
                break;
            }
        }
        let _ = wr.shutdown().await;
    });
    Ok(ours)
}
