//! gRPC over unix sockets between the agents: aether serves the runtime API on one, and
//! reaches each session's chronus on another.

use std::path::{Path, PathBuf};
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint, Uri};

use crate::pb::runtime_client::RuntimeClient;
use crate::pb::runtime_server::{Runtime, RuntimeServer};
use crate::rpc::MAX_MESSAGE;

/// Connects to the runtime service on the unix socket `path` (eagerly, so a caller polling
/// for a freshly started server sees the failure). Errors: the transport's, when nothing
/// accepts on `path`.
pub async fn connect(path: &Path) -> Result<RuntimeClient<Channel>, tonic::transport::Error> {
    let path: PathBuf = path.to_path_buf();
    // The URI is required by the API and ignored by the connector.
    let ch = endpoint("http://chronus", Duration::from_secs(5))
        .connect_with_connector(tower::service_fn(move |_: Uri| {
            let path = path.clone();
            async move {
                let s = tokio::net::UnixStream::connect(path).await?;
                Ok::<_, std::io::Error>(TokioIo::new(s))
            }
        }))
        .await?;
    Ok(RuntimeClient::new(ch)
        .max_decoding_message_size(MAX_MESSAGE)
        .max_encoding_message_size(MAX_MESSAGE))
}

/// The runtime API's client settings over a connector of the caller's (`uri` is required by
/// tonic and ignored by the connector): `connect_timeout`, and flow-control windows large
/// enough for file transfers (4 MiB a stream, 16 MiB a connection).
pub fn endpoint(uri: &'static str, connect_timeout: Duration) -> Endpoint {
    Endpoint::from_static(uri)
        .connect_timeout(connect_timeout)
        .initial_stream_window_size(Some(4 << 20))
        .initial_connection_window_size(Some(16 << 20))
}

/// Serves `svc` on `listener` until `shutdown` resolves, with the 80 MB message limit.
pub async fn serve<S: Runtime>(
    svc: S,
    listener: tokio::net::UnixListener,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error> {
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    serve_incoming(svc, None, incoming, shutdown).await
}

/// [`serve`] over any stream of connections (a microVM's agent port gives its sessions).
/// `guest`, where given, is served beside it (a microVM's aether: the edge's own calls).
pub async fn serve_incoming<S, I, IO>(
    svc: S,
    guest: Option<crate::pb::guest_server::GuestServer<crate::guest::aether::restore::VmGuest>>,
    incoming: I,
    shutdown: impl std::future::Future<Output = ()>,
) -> Result<(), tonic::transport::Error>
where
    S: Runtime,
    I: tokio_stream::Stream<Item = std::io::Result<IO>>,
    IO: tokio::io::AsyncRead
        + tokio::io::AsyncWrite
        + tonic::transport::server::Connected
        + Unpin
        + Send
        + 'static,
{
    tonic::transport::Server::builder()
        .initial_stream_window_size(Some(4 << 20))
        .initial_connection_window_size(Some(16 << 20))
        .add_service(
            RuntimeServer::new(svc)
                .max_decoding_message_size(MAX_MESSAGE)
                .max_encoding_message_size(MAX_MESSAGE),
        )
        .add_optional_service(guest)
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
}
