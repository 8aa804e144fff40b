//! Serving a tonic router on an already bound listener until shutdown.

use std::time::Duration;

use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;
use tonic::transport::Server;
use tower::layer::util::{Identity, Stack};

use super::acl::{AclLayer, Policy};
use super::tls::Tls;

use crate::shutdown::Shutdown;

/// Runs `router` on `listener` until `shutdown` fires; in-flight calls finish first.
pub async fn serve(
    router: tonic::transport::server::Router<Stack<AclLayer, Identity>>,
    listener: TcpListener,
    shutdown: Shutdown,
) -> Result<(), tonic::transport::Error> {
    let _ = listener.set_ttl(64);
    // The builder's tcp_nodelay applies only to listeners tonic binds itself; without it a
    // streamed reply waits ~40 ms for the client's delayed ACK (Nagle).
    let incoming = TcpIncoming::from(listener).with_nodelay(Some(true));
    router
        .serve_with_incoming_shutdown(incoming, async move { shutdown.wait().await })
        .await
}

/// The server builder every role uses: keepalive pings every 20 s (so a load balancer does
/// not cut a quiet stream), nodelay, large HTTP/2 windows, and with `tls` mutual TLS and
/// the access rules of `policy` (docs/tls.md). Errors: the TLS settings rustls refused.
pub fn builder(
    tls: Option<&Tls>,
    policy: Policy,
) -> Result<Server<Stack<AclLayer, Identity>>, tonic::transport::Error> {
    let mut b = Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(KEEPALIVE_INTERVAL))
        .http2_keepalive_timeout(Some(KEEPALIVE_TIMEOUT))
        .initial_stream_window_size(Some(4 << 20))
        .initial_connection_window_size(Some(16 << 20));
    if let Some(t) = tls {
        b = b.tls_config(t.server())?;
    }
    Ok(b.layer(AclLayer::new(policy, tls.is_some())))
}

/// How often a server pings an idle connection (docs/tls.md "Connections").
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// How long a server waits for a ping's answer before it drops the connection.
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(10);
