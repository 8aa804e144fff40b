//! gRPC channels over unix sockets: the edge to aether, aether to chronus.

use std::path::PathBuf;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use tonic::transport::{Channel, Endpoint};

/// A lazily connected channel to the gRPC server listening on the unix socket `path`
/// (reconnects on its own after a break). The authority in the URI is a placeholder.
pub fn uds_channel(path: PathBuf) -> Channel {
    let ep = Endpoint::from_static("http://uds.local")
        .connect_timeout(Duration::from_secs(5))
        .tcp_nodelay(true);
    ep.connect_with_connector_lazy(tower::service_fn(move |_| {
        let path = path.clone();
        async move {
            let s = tokio::net::UnixStream::connect(path).await?;
            Ok::<_, std::io::Error>(TokioIo::new(s))
        }
    }))
}
