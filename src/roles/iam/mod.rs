//! The IAM role (placeholder until the IAM branch lands).

use std::sync::Arc;

/// Starting IAM failed.
#[derive(Debug, thiserror::Error)]
pub enum IamError {
    #[error("iam: not built yet")]
    NotBuilt,
}

/// Serves the Iam service on `listener`.
pub async fn start(_cfg: Arc<crate::config::Config>, _listener: tokio::net::TcpListener, _shutdown: crate::shutdown::Shutdown, _ready: crate::telemetry::Ready) -> Result<tokio::task::JoinHandle<()>, IamError> {
    Err(IamError::NotBuilt)
}
