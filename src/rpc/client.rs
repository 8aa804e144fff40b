//! Client channels between roles and from the CLI: lazy connections over HTTP/2 on the
//! addresses of the config, plaintext or mutual TLS ([`Dialer`]), with the message limits and
//! keepalives every role uses (docs/tls.md "Connections").

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use tonic::metadata::MetadataValue;
use tonic::transport::{Channel, Endpoint};

use super::tls::{Tls, TlsError};
use crate::pki::Role;

/// A channel could not be built for this address.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("bad address {addr:?}")]
    BadAddress {
        addr: String,
        source: tonic::transport::Error,
    },
    #[error("TLS settings for {addr}")]
    Tls {
        addr: String,
        source: tonic::transport::Error,
    },
    #[error("TLS settings for {addr}: {why}")]
    Identity { addr: String, why: String },
}

/// How a component reaches the others: plaintext (development clusters with a
/// `service_token`), or mutual TLS with its own certificate, accepting only a server of the
/// role it meant to reach.
#[derive(Clone, Default)]
pub struct Dialer {
    tls: Option<Arc<Tls>>,
    configs: Arc<HashMap<Role, Arc<rustls::ClientConfig>>>,
}

impl std::fmt::Debug for Dialer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dialer").field("tls", &self.tls).finish()
    }
}

impl Dialer {
    /// Plaintext connections.
    pub fn plain() -> Dialer {
        Dialer::default()
    }

    /// Mutual TLS with `tls`, or plaintext with `None`. Errors: what rustls refused in the
    /// material (it was checked at load, so this is not expected).
    pub fn new(tls: Option<Arc<Tls>>) -> Result<Dialer, TlsError> {
        let Some(tls) = tls else {
            return Ok(Dialer::plain());
        };
        let mut configs = HashMap::new();
        for r in [Role::Iam, Role::Watcher, Role::Edge, Role::Apiserver] {
            configs.insert(r, tls.client_config(r)?);
        }
        Ok(Dialer {
            tls: Some(tls),
            configs: Arc::new(configs),
        })
    }

    /// The TLS material, when on.
    pub fn tls(&self) -> Option<&Arc<Tls>> {
        self.tls.as_ref()
    }

    /// A lazily connecting channel to the `expect` component at `addr` (`host:port`).
    /// Errors: `BadAddress`.
    pub fn channel(
        &self,
        addr: &str,
        connect_timeout: Duration,
        expect: Role,
    ) -> Result<Channel, ClientError> {
        let ep = endpoint(addr, connect_timeout)?;
        match self.configs.get(&expect) {
            Some(cfg) => Ok(super::tls::channel(ep, cfg.clone(), expect)),
            None => Ok(ep.connect_lazy()),
        }
    }

    /// A channel over IAM's replicas at `addrs`, failing over between them (see
    /// [`super::failover`]) for up to `patience`. Errors: `BadAddress`.
    pub fn failover(
        &self,
        addrs: &[String],
        connect_timeout: Duration,
        expect: Role,
        patience: Duration,
    ) -> Result<super::failover::Failover, ClientError> {
        let channels = addrs
            .iter()
            .map(|a| Ok((a.clone(), self.channel(a, connect_timeout, expect)?)))
            .collect::<Result<Vec<_>, ClientError>>()?;
        Ok(super::failover::Failover::new(
            channels,
            patience,
            super::failover::iam_resendable,
        ))
    }

    /// As [`Dialer::channel`], and with `id` accepting only the server of that identity
    /// (an edge by its id). Errors: `BadAddress`, `Tls`.
    pub fn channel_to(
        &self,
        addr: &str,
        connect_timeout: Duration,
        expect: Role,
        id: Option<&str>,
    ) -> Result<Channel, ClientError> {
        let (Some(tls), Some(id)) = (&self.tls, id) else {
            return self.channel(addr, connect_timeout, expect);
        };
        let ep = endpoint(addr, connect_timeout)?;
        let cfg = tls
            .client_config_for(expect, Some(id))
            .map_err(|e| ClientError::Identity {
                addr: addr.to_string(),
                why: e.to_string(),
            })?;
        Ok(super::tls::channel(ep, cfg, expect))
    }

    /// The endpoint of an apiserver's public port at `addr`, for channels balanced over
    /// several: over TLS with this component's certificate when on. Errors: `BadAddress`,
    /// `Tls`.
    pub fn public_endpoint(
        &self,
        addr: &str,
        connect_timeout: Duration,
    ) -> Result<Endpoint, ClientError> {
        match &self.tls {
            None => endpoint(addr, connect_timeout),
            Some(tls) => endpoint(&https(addr), connect_timeout)?
                .tls_config(tls.public_client())
                .map_err(|source| ClientError::Tls {
                    addr: addr.to_string(),
                    source,
                }),
        }
    }
}

/// `addr` as an `https://` URI (tonic's own TLS applies only to those).
pub fn https(addr: &str) -> String {
    let bare = addr
        .strip_prefix("http://")
        .or_else(|| addr.strip_prefix("https://"))
        .unwrap_or(addr);
    format!("https://{bare}")
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
