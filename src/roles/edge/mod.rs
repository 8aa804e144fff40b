//! The edge role (placeholder until the edge branch lands).

use std::sync::Arc;

/// Starting an edge failed.
#[derive(Debug, thiserror::Error)]
pub enum EdgeError {
    #[error("edge: not built yet")]
    NotBuilt,
}

/// Serves the Edge service on `listener`.
pub async fn start(_cfg: Arc<crate::config::Config>, _edge_id: String, _listener: tokio::net::TcpListener, _shutdown: crate::shutdown::Shutdown, _ready: crate::telemetry::Ready) -> Result<tokio::task::JoinHandle<()>, EdgeError> {
    Err(EdgeError::NotBuilt)
}
