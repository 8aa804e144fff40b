//! Http: an HTTP/1.1 request made by chronus, so from inside the sandbox's network
//! namespace, to reach services running in it (docs/python-sdk.md).

use std::collections::HashMap;
use std::time::Duration;

use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Bytes;
use hyper::{Method, Request, Uri};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;

use crate::pb;
use crate::types::{Failure, Reason};

/// Largest response body returned.
pub const MAX_BODY: usize = 64 << 20;
/// Seconds a request may take when the call sets no timeout.
pub const DEFAULT_TIMEOUT_S: f64 = 30.0;

/// Makes the request. Errors: `invalid` (not an `http://` URL, bad method or header,
/// body over 64 MiB), `unavailable` (connection refused or broken), `timeout`.
pub async fn request(req: pb::HttpRequest) -> Result<pb::HttpResponse, Failure> {
    let url = req.url.trim();
    if url.starts_with("https://") {
        return Err(Failure::invalid("https is not supported: use http://"));
    }
    if !url.starts_with("http://") {
        return Err(Failure::invalid(format!(
            "url {url:?} is not an http:// URL"
        )));
    }
    let uri: Uri = url
        .parse()
        .map_err(|e| Failure::invalid(format!("url {url:?}: {e}", e = crate::types::chain(&e))))?;
    let port = port_of(&uri)?;
    let method = if req.method.is_empty() {
        Method::GET
    } else {
        Method::from_bytes(req.method.to_ascii_uppercase().as_bytes())
            .map_err(|_| Failure::invalid(format!("method {:?} is not valid", req.method)))?
    };
    if req.timeout < 0.0 || req.timeout.is_nan() {
        return Err(Failure::invalid(format!(
            "timeout {} must be 0 (the default) or more seconds",
            req.timeout
        )));
    }
    let timeout = if req.timeout > 0.0 && req.timeout.is_finite() {
        req.timeout
    } else {
        DEFAULT_TIMEOUT_S
    };
    let mut b = Request::builder().method(method).uri(uri);
    for (k, v) in &req.headers {
        b = b.header(k.as_str(), v.as_str());
    }
    let r = b
        .body(Full::new(Bytes::from(req.body)))
        .map_err(|e| Failure::invalid(format!("request: {e}", e = crate::types::chain(&e))))?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(0)
        .build_http();
    let work = async {
        let resp = client.request(r).await.map_err(|e| {
            if refused(&e) {
                // Nothing listens there: the caller's service, not the path to the
                // sandbox (an edge or aether being down reads otherwise).
                return Failure::new(
                    Reason::Unavailable,
                    format!("{url}: connection refused on port {port} in the sandbox"),
                );
            }
            let why = std::error::Error::source(&e)
                .map(|s| s.to_string())
                .unwrap_or_else(|| crate::types::chain(&e));
            Failure::new(Reason::Unavailable, format!("{url}: {why}"))
        })?;
        let status = resp.status().as_u16() as i32;
        let mut headers: HashMap<String, String> = HashMap::new();
        for (k, v) in resp.headers() {
            let v = String::from_utf8_lossy(v.as_bytes()).into_owned();
            headers
                .entry(k.as_str().to_string())
                .and_modify(|old| {
                    old.push_str(", ");
                    old.push_str(&v);
                })
                .or_insert(v);
        }
        let body = Limited::new(resp.into_body(), MAX_BODY)
            .collect()
            .await
            .map_err(|e| {
                if e.downcast_ref::<http_body_util::LengthLimitError>()
                    .is_some()
                {
                    Failure::invalid(format!("{url}: the response body is over {MAX_BODY} bytes"))
                } else {
                    Failure::unavailable(format!(
                        "{url}: reading the response: {e}",
                        e = crate::types::chain(&*e)
                    ))
                }
            })?
            .to_bytes();
        Ok(pb::HttpResponse {
            status,
            headers,
            body: body.to_vec(),
        })
    };
    match tokio::time::timeout(
        Duration::from_secs_f64(timeout.min(super::session::MAX_SECONDS)),
        work,
    )
    .await
    {
        Ok(r) => r,
        Err(_) => Err(Failure::new(
            Reason::Timeout,
            format!("{url}: no answer within {timeout} s"),
        )),
    }
}

/// The URL's port (80 when it names none). Errors: `invalid` for a port outside 1–65535.
/// Read from the authority's text: `Uri::port` gives `None` for a port that is no u16,
/// and the connector would then go to port 80.
fn port_of(uri: &Uri) -> Result<u16, Failure> {
    let auth = uri.authority().map(|a| a.as_str()).unwrap_or_default();
    let host_port = auth.rsplit('@').next().unwrap_or_default();
    let port = match host_port.rsplit_once(':') {
        // A colon inside an IPv6 literal's brackets is no port separator.
        Some((_, p)) if !p.contains(']') => p,
        _ => "",
    };
    if port.is_empty() {
        return Ok(80);
    }
    match port.parse::<u16>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(bad_port(port)),
    }
}

fn bad_port(p: &str) -> Failure {
    Failure::invalid(format!("url: port {p} is outside 1-65535"))
}

/// Whether the connection was refused (ECONNREFUSED somewhere in the error's chain).
fn refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut cur = Some(e);
    while let Some(c) = cur {
        if let Some(io) = c.downcast_ref::<std::io::Error>() {
            if io.kind() == std::io::ErrorKind::ConnectionRefused {
                return true;
            }
        }
        cur = c.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn refuses_https_and_garbage() {
        let r = |url: &str| pb::HttpRequest {
            url: url.into(),
            ..Default::default()
        };
        let e = request(r("https://127.0.0.1/")).await.expect_err("https");
        assert_eq!(e.reason, Reason::Invalid);
        assert!(e.message.contains("https is not supported"));
        assert_eq!(
            request(r("ftp://x")).await.expect_err("ftp").reason,
            Reason::Invalid
        );
    }

    #[test]
    fn ports_come_from_the_authority() {
        let p = |u: &str| port_of(&u.parse::<Uri>().expect("uri")).map_err(|e| e.reason);
        assert_eq!(p("http://a/"), Ok(80));
        assert_eq!(p("http://a:8080/x"), Ok(8080));
        assert_eq!(p("http://u:pw@a:99/"), Ok(99));
        assert_eq!(p("http://[::1]/"), Ok(80));
        assert_eq!(p("http://[::1]:65535/"), Ok(65535));
        assert_eq!(p("http://[::1]:0/"), Err(Reason::Invalid));
    }

    #[tokio::test]
    async fn a_port_outside_1_to_65535_is_invalid() {
        for port in ["0", "65536", "70000", "99999999999"] {
            let e = request(pb::HttpRequest {
                url: format!("http://127.0.0.1:{port}/"),
                timeout: 5.0,
                ..Default::default()
            })
            .await
            .expect_err(port);
            assert_eq!(e.reason, Reason::Invalid, "port {port}: {e:?}");
            assert!(e.message.contains("port"), "port {port}: {e:?}");
        }
    }

    #[tokio::test]
    async fn refused_is_unavailable_and_a_local_server_answers() {
        // A port nothing listens on: bind, note it, close.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        let e = request(pb::HttpRequest {
            url: format!("http://127.0.0.1:{port}/"),
            ..Default::default()
        })
        .await
        .expect_err("refused");
        assert_eq!(e.reason, Reason::Unavailable);
        assert!(
            e.message
                .contains(&format!("connection refused on port {port} in the sandbox")),
            "{e:?}"
        );

        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let (mut c, _) = l.accept().await.expect("accept");
            let mut buf = [0u8; 4096];
            let _ = c.read(&mut buf).await;
            let _ = c
                .write_all(b"HTTP/1.1 201 Created\r\nx-a: 1\r\ncontent-length: 2\r\n\r\nok")
                .await;
        });
        let r = request(pb::HttpRequest {
            url: format!("http://{addr}/p"),
            method: "post".into(),
            body: b"x".to_vec(),
            ..Default::default()
        })
        .await
        .expect("request");
        assert_eq!((r.status, r.body.as_slice()), (201, &b"ok"[..]));
        assert_eq!(r.headers.get("x-a").map(String::as_str), Some("1"));
    }
}
