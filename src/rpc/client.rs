//! Client channels between roles and from the CLI: lazy connections over plaintext HTTP/2 on
//! the addresses of the config, with the message limits and keepalives every role uses.

use std::time::Duration;

use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};

/// A channel could not be built for this address.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("bad address {addr:?}")]
    BadAddress {
        addr: String,
        source: tonic::transport::Error,
    },
}

/// Builds a lazily connecting channel to `addr` (`host:port`). Connection failures surface
/// as `unavailable` on the first call, so callers can retry elsewhere.
pub fn channel(addr: &str, connect_timeout: Duration) -> Result<Channel, ClientError> {
    Ok(endpoint(addr, connect_timeout)?.connect_lazy())
}

/// The endpoint [`channel`] connects to, for channels balanced over several addresses.
/// Errors: `BadAddress`.
pub fn endpoint(addr: &str, connect_timeout: Duration) -> Result<Endpoint, ClientError> {
    let uri = if addr.starts_with("http://") || addr.starts_with("https://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    };
    let ep = Endpoint::from_shared(uri)
        .map_err(|source| ClientError::BadAddress {
            addr: addr.to_string(),
            source,
        })?
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true)
        .initial_stream_window_size(Some(4 << 20))
        .initial_connection_window_size(Some(16 << 20));
    Ok(ep)
}

/// Wraps a message for an internal call: adds the component secret when one is configured.
pub fn internal<T>(msg: T, service_token: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if !service_token.is_empty() {
        if let Ok(v) = MetadataValue::try_from(service_token) {
            req.metadata_mut().insert(super::SERVICE_TOKEN, v);
        }
    }
    req
}

/// Wraps a message for a call on behalf of a caller: its bearer token and address go along.
pub fn on_behalf<T>(
    msg: T,
    service_token: &str,
    bearer: &str,
    client_addr: &str,
) -> tonic::Request<T> {
    let mut req = internal(msg, service_token);
    if let Ok(v) = MetadataValue::try_from(format!("Bearer {bearer}")) {
        req.metadata_mut().insert(super::AUTHORIZATION, v);
    }
    if let Ok(v) = MetadataValue::try_from(client_addr) {
        req.metadata_mut().insert(super::CLIENT_ADDR, v);
    }
    req
}

/// Wraps a message with a caller's bearer token (CLI and tests).
pub fn with_token<T>(msg: T, token: &str) -> tonic::Request<T> {
    let mut req = tonic::Request::new(msg);
    if let Ok(v) = MetadataValue::try_from(format!("Bearer {token}")) {
        req.metadata_mut().insert(super::AUTHORIZATION, v);
    }
    req
}
