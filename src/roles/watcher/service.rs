//! The Watcher gRPC service: snapshots for apiservers, registrations from edges.

use std::sync::Arc;

use tonic::{Request, Response, Status};

use super::{EdgeEntry, Inner};
use crate::pb;
use crate::types::names;

pub(crate) struct WatcherService {
    pub inner: Arc<Inner>,
}

#[tonic::async_trait]
impl pb::watcher_server::Watcher for WatcherService {
    /// The latest snapshot (any version; `min_version` is advisory).
    async fn get_snapshot(
        &self,
        req: Request<pb::GetSnapshotRequest>,
    ) -> Result<Response<pb::Snapshot>, Status> {
        crate::rpc::check_service_token(&req, &self.inner.cfg.service_token)?;
        let snap = self.inner.snapshot.read().await.clone();
        Ok(Response::new((*snap).clone()))
    }

    /// An edge announces itself and its address; a known edge's address is updated.
    async fn register(
        &self,
        req: Request<pb::RegisterEdgeRequest>,
    ) -> Result<Response<pb::RegisterEdgeResponse>, Status> {
        crate::rpc::check_service_token(&req, &self.inner.cfg.service_token)?;
        // Over mTLS an edge registers only itself: its certificate names its id.
        let caller = crate::rpc::acl::caller(&req).cloned();
        let r = req.into_inner();
        names::check_edge_id(&r.edge_id).map_err(|f| crate::rpc::to_status(&f))?;
        if let Some(who) = caller {
            if who.role != crate::pki::Role::Edge || who.id != r.edge_id {
                return Err(crate::rpc::to_status(&crate::types::Failure::forbidden(
                    format!("{who} may not register edge {:?}", r.edge_id),
                )));
            }
        }
        if r.addr.is_empty()
            || r.addr.len() > 256
            || r.addr.parse::<std::net::SocketAddr>().is_err()
        {
            return Err(crate::rpc::to_status(&crate::types::Failure::invalid(
                format!("edge address {:?} is not host:port", r.addr),
            )));
        }
        let mut edges = self.inner.edges.write().await;
        let known = edges.contains_key(&r.edge_id);
        let e = edges
            .entry(r.edge_id.clone())
            .or_insert_with(EdgeEntry::default);
        if e.addr != r.addr {
            tracing::info!(edge_id = %r.edge_id, addr = %r.addr, "edge registered");
            e.addr = r.addr;
        }
        Ok(Response::new(pb::RegisterEdgeResponse { known }))
    }
}
