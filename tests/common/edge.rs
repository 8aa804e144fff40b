//! An edge started in the test's own process (`roles::edge::start` on a port of its own),
//! for the integration tests that talk to one edge's gRPC services directly. Included with
//! `#[path = "common/edge.rs"] mod edge_harness;`.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::Duration;

use opendsec::config::Config;
use opendsec::pb::edge_client::EdgeClient;
use opendsec::rpc;
use opendsec::shutdown::Shutdown;
use opendsec::telemetry::Ready;
use tonic::transport::Channel;

/// A running edge: its address, and how to stop it.
pub struct Edge {
    pub addr: String,
    shutdown: Shutdown,
    task: tokio::task::JoinHandle<()>,
}

impl Edge {
    /// Starts edge `id` of `cfg` on 127.0.0.1 and returns once it serves (it reports
    /// ready). Panics when it cannot start.
    pub async fn start(cfg: Arc<Config>, id: &str) -> Edge {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .unwrap_or_else(|e| panic!("bind: {e}"));
        let addr = l.local_addr().unwrap_or_else(|e| panic!("{e}")).to_string();
        let shutdown = Shutdown::new();
        let ready = Ready::default();
        let task = opendsec::roles::edge::start(cfg, id.into(), l, shutdown.clone(), ready.clone())
            .await
            .unwrap_or_else(|e| panic!("start: {e}"));
        assert!(ready.get(), "ready once serving");
        Edge {
            addr,
            shutdown,
            task,
        }
    }

    pub fn channel(&self) -> Channel {
        rpc::client::channel(&self.addr, Duration::from_secs(2)).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn client(&self) -> EdgeClient<Channel> {
        EdgeClient::new(self.channel())
    }

    /// Stops the edge and waits (at most `within`) for it to end. Panics when it does not.
    pub async fn stop(self, within: Duration) {
        self.shutdown.fire();
        tokio::time::timeout(within, self.task)
            .await
            .unwrap_or_else(|_| panic!("edge did not stop within {within:?}"))
            .unwrap_or_else(|e| panic!("{e}"));
    }
}
