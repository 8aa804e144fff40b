//! Channels to edges, one per address, reused across calls.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tonic::transport::Channel;

use crate::pb;
use crate::types::Failure;

pub(crate) struct EdgeClients {
    service_token: String,
    dialer: crate::rpc::client::Dialer,
    channels: Mutex<HashMap<String, Channel>>,
}

impl EdgeClients {
    pub fn new(service_token: String, dialer: crate::rpc::client::Dialer) -> EdgeClients {
        EdgeClients {
            service_token,
            dialer,
            channels: Mutex::new(HashMap::new()),
        }
    }

    fn channel(&self, addr: &str) -> Result<Channel, Failure> {
        let mut m = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = m.get(addr) {
            return Ok(c.clone());
        }
        let c = self
            .dialer
            .channel(addr, Duration::from_secs(2), crate::pki::Role::Edge)
            .map_err(|e| Failure::internal(crate::types::chain(&e)))?;
        m.insert(addr.to_string(), c.clone());
        Ok(c)
    }

    /// The Edge service at `addr`.
    pub fn edge(&self, addr: &str) -> Result<pb::edge_client::EdgeClient<Channel>, Failure> {
        Ok(pb::edge_client::EdgeClient::new(self.channel(addr)?)
            .max_decoding_message_size(crate::rpc::MAX_MESSAGE)
            .max_encoding_message_size(crate::rpc::MAX_MESSAGE))
    }

    /// The Runtime service at `addr` (served by the edge, forwarded to aether).
    pub fn runtime(
        &self,
        addr: &str,
    ) -> Result<pb::runtime_client::RuntimeClient<Channel>, Failure> {
        Ok(pb::runtime_client::RuntimeClient::new(self.channel(addr)?)
            .max_decoding_message_size(crate::rpc::MAX_MESSAGE)
            .max_encoding_message_size(crate::rpc::MAX_MESSAGE))
    }

    /// Wraps a message for an edge call.
    pub fn req<T>(&self, msg: T) -> tonic::Request<T> {
        crate::rpc::client::internal(msg, &self.service_token)
    }
}
