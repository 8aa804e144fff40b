//! `opendsec.v1.Edge`: the edge's gRPC service (proto/opendsec/v1/cluster.proto). Each call
//! checks the component secret, runs in a span, and turns a `Failure` into a status in one
//! place (`rpc::to_status`).

use std::sync::Arc;

use tonic::{Request, Response, Status};
use tracing::Instrument;

use super::machine::Op;
use super::node::Core;
use super::ops::Cause;
use crate::pb;
use crate::rpc::{check_service_token, to_status};
use crate::types::Failure;

pub(crate) struct EdgeService {
    pub core: Arc<Core>,
    /// Where creations and lifecycle operations run: never on the runtime that answers
    /// RPCs, so that a burst of them cannot hold up `Status` (the watcher's probe, whose
    /// timeout is 0.5 s) behind a queue of its own work (docs/architecture.md "Runtimes").
    pub work: Arc<crate::rt::Dedicated>,
}

fn answer<T>(r: Result<T, Failure>) -> Result<Response<T>, Status> {
    r.map(Response::new).map_err(|f| to_status(&f))
}

/// Runs `work` to the end in a task of its own on `rt`. tonic drops a handler's future when
/// the caller goes away (an apiserver killed mid-call); a creation or lifecycle operation
/// cut off there would stay CREATING or STOPPING for good, and a retry of it would find it
/// stuck. Detached, it finishes and records its outcome, and the retry gets that.
async fn detached<T: Send + 'static>(
    rt: &crate::rt::Dedicated,
    work: impl std::future::Future<Output = Result<T, Failure>> + Send + 'static,
) -> Result<T, Failure> {
    rt.spawn(work).await.unwrap_or_else(|e| {
        Err(Failure::internal(format!(
            "edge task failed: {e}",
            e = crate::types::chain(&e)
        )))
    })
}

impl EdgeService {
    fn span(&self, method: &'static str, sandbox_id: &str) -> tracing::Span {
        tracing::info_span!("edge", method, edge_id = %self.core.edge_id, sandbox_id = %sandbox_id)
    }

    async fn op(
        &self,
        req: Request<pb::SandboxRef>,
        method: &'static str,
        op: Op,
    ) -> Result<Response<pb::Sandbox>, Status> {
        check_service_token(&req, &self.core.service_token)?;
        let id = req.into_inner().id;
        let span = self.span(method, &id);
        let core = self.core.clone();
        let r = detached(
            &self.work,
            async move { core.lifecycle_freed(&id, op, Cause::Caller).await }.instrument(span),
        )
        .await;
        let (sb, freed) = r.map_err(|f| to_status(&f))?;
        let mut resp = Response::new(sb);
        if let Some(f) = freed {
            let report = super::freed::FreedReport {
                incarnation: self.core.incarnation.clone(),
                since_seq: f.since_seq,
                seq: f.seq,
                res: f.res,
            };
            if let Ok(v) = report.encode().parse() {
                resp.metadata_mut().insert(super::freed::FREED_HEADER, v);
            }
        }
        Ok(resp)
    }
}

#[tonic::async_trait]
impl pb::edge_server::Edge for EdgeService {
    async fn status(
        &self,
        req: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::EdgeStatus>, Status> {
        check_service_token(&req, &self.core.service_token)?;
        Ok(Response::new(
            self.core.status(req.into_inner().with_leases),
        ))
    }

    async fn create_sandboxes(
        &self,
        req: Request<pb::EdgeCreateRequest>,
    ) -> Result<Response<pb::EdgeCreateResponse>, Status> {
        check_service_token(&req, &self.core.service_token)?;
        let r = req.into_inner();
        let span = self.span(
            "CreateSandboxes",
            r.items.first().map(|i| i.sandbox_id.as_str()).unwrap_or(""),
        );
        let core = self.core.clone();
        let seq_core = self.core.clone();
        answer(
            detached(
                &self.work,
                async move { core.create_batch_from(r.spec, r.items, r.fork).await }
                    .instrument(span),
            )
            .await
            .map(|results| pb::EdgeCreateResponse {
                results,
                // Every sandbox of this batch is in the allocation by now: a state with
                // this sequence or later counts it.
                admitted_seq: super::node::lock(&seq_core.alloc).seq,
                incarnation: seq_core.incarnation.clone(),
            }),
        )
    }

    async fn get_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        check_service_token(&req, &self.core.service_token)?;
        answer(self.core.get_sandbox(&req.into_inner().id))
    }

    async fn list_sandboxes(
        &self,
        req: Request<pb::EdgeListRequest>,
    ) -> Result<Response<pb::ListSandboxesResponse>, Status> {
        check_service_token(&req, &self.core.service_token)?;
        let r = req.into_inner();
        Ok(Response::new(pb::ListSandboxesResponse {
            sandboxes: self.core.list(&r.project, &r.task_id, r.include_ended),
            unreachable_edges: Vec::new(),
        }))
    }

    async fn stop_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        self.op(req, "StopSandbox", Op::Stop).await
    }

    async fn pause_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        self.op(req, "PauseSandbox", Op::Pause).await
    }

    async fn resume_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        self.op(req, "ResumeSandbox", Op::Resume).await
    }

    async fn touch_sandbox(
        &self,
        req: Request<pb::SandboxRef>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        check_service_token(&req, &self.core.service_token)?;
        answer(self.core.touch(&req.into_inner().id).await)
    }

    async fn set_sandbox_timeout(
        &self,
        req: Request<pb::SetSandboxTimeoutRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        check_service_token(&req, &self.core.service_token)?;
        let r = req.into_inner();
        let span = self.span("SetSandboxTimeout", &r.id);
        answer(
            self.core
                .set_timeout(&r.id, r.timeout_s)
                .instrument(span)
                .await,
        )
    }

    async fn update_network(
        &self,
        req: Request<pb::UpdateNetworkRequest>,
    ) -> Result<Response<pb::Sandbox>, Status> {
        check_service_token(&req, &self.core.service_token)?;
        let r = req.into_inner();
        let span = self.span("UpdateNetwork", &r.id);
        let core = self.core.clone();
        // Detached: cut off between the backend's chains and the record, the two would
        // disagree until the edge's next restart.
        answer(
            detached(
                &self.work,
                async move { core.update_network(&r.id, r.rules, r.replace).await }
                    .instrument(span),
            )
            .await,
        )
    }

    async fn task_action(
        &self,
        req: Request<pb::EdgeTaskRequest>,
    ) -> Result<Response<pb::TaskActionResult>, Status> {
        check_service_token(&req, &self.core.service_token)?;
        let r = req.into_inner();
        let span = tracing::info_span!("edge", method = "TaskAction", edge_id = %self.core.edge_id, project = %r.project, task = %r.task_id, action = %r.action);
        answer(
            self.core
                .task_action(&r.project, &r.task_id, &r.action)
                .instrument(span)
                .await,
        )
    }

    async fn pack_sandbox(
        &self,
        req: Request<pb::EdgePackRequest>,
    ) -> Result<Response<pb::EdgePackResponse>, Status> {
        check_service_token(&req, &self.core.service_token)?;
        let r = req.into_inner();
        let span = self.span("PackSandbox", &r.id);
        let core = self.core.clone();
        // Detached: a pack cut off mid-copy would leave the sandbox frozen.
        answer(
            detached(
                &self.work,
                async move { core.pack(r).await }.instrument(span),
            )
            .await,
        )
    }

    async fn snapshot_sandbox(
        &self,
        req: Request<pb::EdgeSnapshotRequest>,
    ) -> Result<Response<pb::EdgeSnapshotResponse>, Status> {
        check_service_token(&req, &self.core.service_token)?;
        let r = req.into_inner();
        let span = self.span("SnapshotSandbox", &r.id);
        let core = self.core.clone();
        // Detached: a snapshot cut off mid-copy would leave the VM stopped.
        answer(
            detached(
                &self.work,
                async move { core.snapshot(r).await }.instrument(span),
            )
            .await,
        )
    }

    async fn drain(
        &self,
        req: Request<pb::DrainEdgeRequest>,
    ) -> Result<Response<pb::EdgeState>, Status> {
        check_service_token(&req, &self.core.service_token)?;
        let r = req.into_inner();
        answer(self.core.drain(&r.edge_id, r.undo).await)
    }
}
