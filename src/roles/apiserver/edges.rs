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
    /// Channels by (address, edge id): the id, from the snapshot, is what the edge's
    /// certificate must name over mTLS.
    channels: Mutex<HashMap<(String, String), Channel>>,
    /// Edge id by address, from the latest snapshot.
    ids: Mutex<HashMap<String, String>>,
}

impl EdgeClients {
    pub fn new(service_token: String, dialer: crate::rpc::client::Dialer) -> EdgeClients {
        EdgeClients {
            service_token,
            dialer,
            channels: Mutex::new(HashMap::new()),
            ids: Mutex::new(HashMap::new()),
        }
    }

    /// Learns which edge is at which address from a snapshot.
    pub fn learn(&self, snap: &pb::Snapshot) {
        let ids = snap
            .edges
            .iter()
            .map(|e| (e.addr.clone(), e.id.clone()))
            .collect();
        *self.ids.lock().unwrap_or_else(|p| p.into_inner()) = ids;
    }

    fn channel(&self, addr: &str) -> Result<Channel, Failure> {
        let id = self
            .ids
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(addr)
            .cloned()
            .unwrap_or_default();
        let key = (addr.to_string(), id);
        let mut m = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = m.get(&key) {
            return Ok(c.clone());
        }
        let c = self
            .dialer
            .channel_to(
                addr,
                Duration::from_secs(2),
                crate::pki::Role::Edge,
                Some(key.1.as_str()).filter(|i| !i.is_empty()),
            )
            .map_err(|e| Failure::internal(crate::types::chain(&e)))?;
        m.insert(key, c.clone());
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
