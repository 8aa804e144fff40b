//! Serving the gateway's port (docs/e2b.md "Limits"): HTTP/1.1 and HTTP/2 on each
//! connection, in the clear or over TLS ([`tls_acceptor`]), at most [`Limits::max`] at once and [`Limits::per_address`] from one client
//! address (one more is closed at once), and a connection that does not send a request's
//! headers within [`HEADER_TIMEOUT`] (an idle keep-alive one included) is closed, so idle
//! sockets cannot pile up, starve the process of file descriptors, or let one client shut
//! the others out.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use axum::extract::ConnectInfo;
use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tower::ServiceExt;

use crate::shutdown::Shutdown;

/// Connections served at once, by default (`e2b.gateways[].max_connections`).
pub const MAX_CONNECTIONS: usize = 4096;
/// Connections served at once from one client address, by default
/// (`e2b.gateways[].max_connections_per_address`).
pub const MAX_CONNECTIONS_PER_ADDRESS: usize = 1024;
/// How long a connection may take to send a request's headers.
pub const HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// Why the gateway's TLS certificate or key could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("e2b: tls_cert {path}")]
    Cert {
        path: String,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("e2b: tls_cert {0} holds no certificate")]
    NoCert(String),
    #[error("e2b: tls_key {path}")]
    Key {
        path: String,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("e2b: tls_cert and tls_key do not make a server certificate")]
    Config(#[from] rustls::Error),
}

/// A TLS acceptor for the PEM certificate chain `cert` (the server's own first) and the
/// private key `key` (PKCS#8, PKCS#1 or SEC1), read once, offering HTTP/2 and HTTP/1.1 by
/// ALPN with TLS 1.2 and 1.3. Errors: [`TlsError`].
pub fn tls_acceptor(cert: &str, key: &str) -> Result<tokio_rustls::TlsAcceptor, TlsError> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer};
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|it| it.collect::<Result<Vec<_>, _>>())
        .map_err(|source| TlsError::Cert {
            path: cert.to_string(),
            source,
        })?;
    if chain.is_empty() {
        return Err(TlsError::NoCert(cert.to_string()));
    }
    let key = PrivateKeyDer::from_pem_file(key).map_err(|source| TlsError::Key {
        path: key.to_string(),
        source,
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut c = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_no_client_auth()
        .with_single_cert(chain, key)?;
    c.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(tokio_rustls::TlsAcceptor::from(Arc::new(c)))
}

/// A connection's byte stream, in the clear or TLS.
trait Io: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static {}
impl<T: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static> Io for T {}

/// What one gateway port takes.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Connections at once.
    pub max: usize,
    /// Connections at once from one client address.
    pub per_address: usize,
    /// How long a connection may go without sending a request's headers.
    pub header_timeout: Duration,
}

/// The open connections of each client address.
#[derive(Default)]
struct PerAddress(Mutex<HashMap<IpAddr, usize>>);

/// One connection counted against its address; uncounted when dropped.
struct Counted(Arc<PerAddress>, IpAddr);

impl PerAddress {
    /// Counts a connection from `ip` unless it already has `limit`.
    fn take(self: &Arc<Self>, ip: IpAddr, limit: usize) -> Option<Counted> {
        // A panic elsewhere cannot leave the counts half-written: each step is one insert.
        let mut m = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        let n = m.entry(ip).or_insert(0);
        if *n >= limit {
            return None;
        }
        *n += 1;
        Some(Counted(self.clone(), ip))
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        let mut m = self.0 .0.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(n) = m.get_mut(&self.1) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.1);
            }
        }
    }
}

/// Serves `app` on `listener` until `shutdown`, within `limits`: at most `max` connections
/// at once and `per_address` from one client address, each closed when it sends no request
/// headers for `header_timeout` (with `tls`, the handshake must be done within that too);
/// then lets the connections finish their requests (the role's grace period bounds that).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    shutdown: Shutdown,
    limits: Limits,
    tls: Option<tokio_rustls::TlsAcceptor>,
) {
    let Limits {
        max,
        per_address,
        header_timeout,
    } = limits;
    let slots = Arc::new(Semaphore::new(max));
    let by_address = Arc::new(PerAddress::default());
    loop {
        let (sock, peer) = tokio::select! {
            _ = shutdown.wait() => break,
            r = listener.accept() => match r {
                Ok(x) => x,
                Err(e) => {
                    // EMFILE and friends: wait a moment rather than spin.
                    tracing::warn!(error = %e, "accepting a connection");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let Some(counted) = by_address.take(peer.ip(), per_address) else {
            tracing::debug!(%peer, per_address, "connection refused: too many open from this address");
            metrics::counter!("opendsec_e2b_connections_refused_total").increment(1);
            drop(sock);
            continue;
        };
        let Ok(permit) = slots.clone().try_acquire_owned() else {
            tracing::debug!(%peer, max, "connection refused: too many open");
            metrics::counter!("opendsec_e2b_connections_refused_total").increment(1);
            drop(sock);
            continue;
        };
        let permit = (permit, counted);
        let _ = sock.set_nodelay(true);
        let (app, sd, tls) = (app.clone(), shutdown.clone(), tls.clone());
        tokio::spawn(async move {
            let io: Box<dyn Io> = match tls {
                None => Box::new(sock),
                Some(acceptor) => {
                    match tokio::time::timeout(header_timeout, acceptor.accept(sock)).await {
                        Ok(Ok(s)) => Box::new(s),
                        Ok(Err(e)) => {
                            tracing::debug!(%peer, error = %e, "closed: TLS handshake failed");
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%peer, "closed: no TLS handshake within the header timeout");
                            return;
                        }
                    }
                }
            };
            // Set once a request arrived: before that, nothing (not even the choice between
            // HTTP/1.1 and HTTP/2, which waits for the first bytes) may take longer than
            // `header_timeout`.
            let started = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let seen = started.clone();
            let service = hyper::service::service_fn(
                move |mut req: hyper::Request<hyper::body::Incoming>| {
                    seen.store(true, std::sync::atomic::Ordering::Relaxed);
                    req.extensions_mut().insert(ConnectInfo(peer));
                    app.clone().oneshot(req.map(axum::body::Body::new))
                },
            );
            let mut b = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            b.http1()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout);
            b.http2()
                .timer(TokioTimer::new())
                .keep_alive_interval(Some(Duration::from_secs(30)));
            let conn = b.serve_connection_with_upgrades(TokioIo::new(io), service);
            tokio::pin!(conn);
            let first = tokio::time::timeout(header_timeout, conn.as_mut()).await;
            if first.is_err() && !started.load(std::sync::atomic::Ordering::Relaxed) {
                tracing::debug!(%peer, "closed: no request within the header timeout");
                drop(permit);
                return;
            }
            if first.is_ok() {
                drop(permit);
                return;
            }
            tokio::select! {
                r = conn.as_mut() => {
                    if let Err(e) = r {
                        tracing::debug!(%peer, error = %e, "connection ended");
                    }
                }
                _ = sd.wait() => {
                    conn.as_mut().graceful_shutdown();
                    let _ = conn.await;
                }
            }
            drop(permit);
        });
    }
    // Every connection done: all slots back.
    let _ = slots.acquire_many(max as u32).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn app_on(max: usize, header_timeout: Duration) -> (SocketAddr, Shutdown) {
        app_limited(Limits {
            max,
            per_address: max,
            header_timeout,
        })
        .await
    }

    async fn app_limited(limits: Limits) -> (SocketAddr, Shutdown) {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let app = Router::new().route(
            "/",
            axum::routing::get(|ConnectInfo(p): ConnectInfo<SocketAddr>| async move {
                p.ip().to_string()
            }),
        );
        let sd = Shutdown::new();
        tokio::spawn(serve(l, app, sd.clone(), limits, None));
        (addr, sd)
    }

    async fn get(addr: SocketAddr) -> String {
        let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        out
    }

    #[tokio::test]
    async fn connections_over_the_limit_are_closed_and_the_rest_served() {
        let (addr, sd) = app_on(2, HEADER_TIMEOUT).await;
        let idle1 = tokio::net::TcpStream::connect(addr).await.unwrap();
        let idle2 = tokio::net::TcpStream::connect(addr).await.unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        // A third is closed without an answer while two are held.
        let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = third.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
        let mut buf = Vec::new();
        let n = third.read_to_end(&mut buf).await.unwrap_or(0);
        assert_eq!(n, 0);
        drop((idle1, idle2));
        tokio::time::sleep(Duration::from_millis(100)).await;
        let r = get(addr).await;
        assert!(
            r.starts_with("HTTP/1.1 200") && r.ends_with("127.0.0.1"),
            "{r}"
        );
        sd.fire();
    }

    #[tokio::test]
    async fn one_address_cannot_take_every_connection() {
        let (addr, sd) = app_limited(Limits {
            max: 4,
            per_address: 2,
            header_timeout: HEADER_TIMEOUT,
        })
        .await;
        // Two held from 127.0.0.1: a third from there is closed...
        let held = [
            tokio::net::TcpStream::connect(addr).await.unwrap(),
            tokio::net::TcpStream::connect(addr).await.unwrap(),
        ];
        tokio::time::sleep(Duration::from_millis(100)).await;
        let mut third = tokio::net::TcpStream::connect(addr).await.unwrap();
        let _ = third.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
        let mut buf = Vec::new();
        assert_eq!(third.read_to_end(&mut buf).await.unwrap_or(0), 0);
        // ...while another address is served (127.0.0.2 is loopback too).
        let other = tokio::net::TcpSocket::new_v4().unwrap();
        other.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut s = other.connect(addr).await.unwrap();
        s.write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).await.unwrap();
        assert!(out.ends_with("127.0.0.2"), "{out}");
        // Closing one frees its address's slot.
        drop(held);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(get(addr).await.starts_with("HTTP/1.1 200"));
        sd.fire();
    }

    #[tokio::test]
    async fn a_connection_that_sends_no_headers_is_closed() {
        let (addr, sd) = app_on(8, Duration::from_millis(300)).await;
        let mut part = tokio::net::TcpStream::connect(addr).await.unwrap();
        part.write_all(b"GET / HT").await.unwrap();
        let mut idle = tokio::net::TcpStream::connect(addr).await.unwrap();
        for s in [&mut part, &mut idle] {
            let mut buf = Vec::new();
            let read = tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf)).await;
            assert!(read.is_ok(), "the connection is still open");
        }
        sd.fire();
    }

    /// A self-signed certificate for `localhost` in `dir`: (cert path, key path, its DER).
    fn self_signed(
        dir: &std::path::Path,
    ) -> (String, String, rustls::pki_types::CertificateDer<'static>) {
        let ck = rcgen::generate_simple_self_signed(vec!["localhost".to_string()]).unwrap();
        let (c, k) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&c, ck.cert.pem()).unwrap();
        std::fs::write(&k, ck.signing_key.serialize_pem()).unwrap();
        (
            c.display().to_string(),
            k.display().to_string(),
            ck.cert.der().clone(),
        )
    }

    #[tokio::test]
    async fn tls_serves_http1_and_http2_and_closes_the_clear() {
        let d = tempfile::tempdir().unwrap();
        let (cert, key, der) = self_signed(d.path());
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let app = Router::new().route("/", axum::routing::get(|| async { "over tls" }));
        let sd = Shutdown::new();
        let limits = Limits {
            max: 8,
            per_address: 8,
            header_timeout: Duration::from_secs(5),
        };
        tokio::spawn(serve(
            l,
            app,
            sd.clone(),
            limits,
            Some(tls_acceptor(&cert, &key).unwrap()),
        ));

        let mut roots = rustls::RootCertStore::empty();
        roots.add(der).unwrap();
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let connect = |alpn: &[&[u8]]| {
            let mut c = rustls::ClientConfig::builder_with_provider(provider.clone())
                .with_safe_default_protocol_versions()
                .unwrap()
                .with_root_certificates(roots.clone())
                .with_no_client_auth();
            c.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
            async move {
                let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
                tokio_rustls::TlsConnector::from(Arc::new(c))
                    .connect("localhost".try_into().unwrap(), tcp)
                    .await
                    .unwrap()
            }
        };
        let mut s = connect(&[b"http/1.1"]).await;
        s.write_all(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut out = String::new();
        let _ = s.read_to_string(&mut out).await;
        assert!(
            out.starts_with("HTTP/1.1 200") && out.ends_with("over tls"),
            "{out}"
        );
        // A client offering HTTP/2 gets it.
        let s = connect(&[b"h2", b"http/1.1"]).await;
        assert_eq!(s.get_ref().1.alpn_protocol(), Some(&b"h2"[..]));
        // HTTP in the clear is no TLS handshake: closed with no answer.
        let mut plain = tokio::net::TcpStream::connect(addr).await.unwrap();
        plain
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let mut buf = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), plain.read_to_end(&mut buf)).await;
        assert!(!String::from_utf8_lossy(&buf).contains("over tls"));
        sd.fire();
    }

    #[test]
    fn unusable_certificates_and_keys_are_named() {
        let d = tempfile::tempdir().unwrap();
        let (cert, key, _) = self_signed(d.path());
        let missing = d.path().join("missing").display().to_string();
        assert!(matches!(
            tls_acceptor(&missing, &key),
            Err(TlsError::Cert { .. })
        ));
        let empty = d.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let empty = empty.display().to_string();
        assert!(matches!(
            tls_acceptor(&empty, &key),
            Err(TlsError::NoCert(_))
        ));
        // The certificate's file holds no key.
        assert!(matches!(
            tls_acceptor(&cert, &cert),
            Err(TlsError::Key { .. })
        ));
        // Another key than the certificate's.
        let other = rcgen::KeyPair::generate().unwrap();
        let other_path = d.path().join("other.pem");
        std::fs::write(&other_path, other.serialize_pem()).unwrap();
        let e = tls_acceptor(&cert, &other_path.display().to_string());
        assert!(matches!(e, Err(TlsError::Config(_))), "{:?}", e.err());
        assert!(tls_acceptor(&cert, &key).is_ok());
    }
}
