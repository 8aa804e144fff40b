//! Serving a tonic router on an already bound listener until shutdown.

use tokio::net::TcpListener;
use tonic::transport::server::TcpIncoming;

use crate::shutdown::Shutdown;

/// Runs `router` on `listener` until `shutdown` fires; in-flight calls finish first.
pub async fn serve(
    router: tonic::transport::server::Router,
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

/// A server builder with the settings every role uses (keepalive, nodelay, no limits on
/// concurrent streams beyond HTTP/2's own).
pub fn builder() -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .tcp_nodelay(true)
        .http2_keepalive_interval(Some(std::time::Duration::from_secs(10)))
        .http2_keepalive_timeout(Some(std::time::Duration::from_secs(5)))
        .initial_stream_window_size(Some(4 << 20))
        .initial_connection_window_size(Some(16 << 20))
}
