//! Calls on existing sandboxes: the edge is named in the sandbox id (`<edge>.<random>`), so
//! no lookup table is needed. Every call checks `sandbox.operate` on the sandbox's project.

use super::auth::Caller;
use super::Inner;
use crate::pb;
use crate::roles::edge::freed::{FreedReport, FREED_HEADER};
use crate::rpc::failure_from_status;
use crate::types::{names, Failure};

/// The edge part of a sandbox id; `invalid` when the id cannot be one.
/// Whose a sandbox is: its project and the principal that created it.
#[derive(Clone, Debug)]
pub struct Owner {
    pub project: String,
    pub principal: String,
}

pub(crate) fn edge_of(id: &str) -> Result<&str, Failure> {
    let bad = || Failure::invalid(format!("sandbox id {id:?} is not <edge-id>.<random>"));
    let (edge, rest) = id.split_once('.').ok_or_else(bad)?;
    if rest.is_empty()
        || rest.len() > 64
        || !rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
    {
        return Err(bad());
    }
    names::check_edge_id(edge).map_err(|_| bad())?;
    Ok(edge)
}

impl Inner {
    /// The cluster snapshot; `unavailable` until the first one arrived from a watcher (a
    /// freshly started apiserver): without it every edge would look unknown, and callers
    /// would be told `not_found` or `invalid` instead of retrying.
    pub(crate) async fn current_snapshot(&self) -> Result<std::sync::Arc<pb::Snapshot>, Failure> {
        let snap = self.snapshot.read().await.clone();
        if snap.version == 0 {
            return Err(Failure::unavailable(
                "this apiserver has no cluster snapshot from a watcher yet; retry",
            ));
        }
        Ok(snap)
    }

    /// The address of `edge` from the snapshot; `not_found` when the cluster has no such edge.
    pub(crate) async fn addr_of(&self, edge: &str) -> Result<String, Failure> {
        let snap = self.current_snapshot().await?;
        match snap.edges.iter().find(|e| e.id == edge) {
            Some(e) => Ok(e.addr.clone()),
            None => Err(Failure::not_found(format!(
                "no edge {edge:?} in the cluster"
            ))),
        }
    }

    /// Authorizes `sandbox.operate` on the sandbox's project and returns the edge address.
    /// A sandbox access token passes for its own sandbox only (the calls that take one are
    /// chosen by the service's `begin_as`). Errors: `invalid` id, `forbidden`, the edge's.
    pub(crate) async fn authorize_sandbox(
        &self,
        caller: &Caller,
        id: &str,
    ) -> Result<String, Failure> {
        let edge = edge_of(id)?;
        if let Some(own) = &caller.grant {
            if own != id {
                return Err(super::auth::grant_only());
            }
            return self.addr_of(edge).await;
        }
        let project = self.owner_of(id).await?.project;
        tracing::Span::current().record("project", project.as_str());
        self.auth
            .authorize(caller, &project, "sandbox.operate")
            .await?;
        self.addr_of(edge).await
    }

    /// The project and creator of sandbox `id`: cached, else asked of its edge (and kept).
    /// Errors: `invalid` id, the edge's (`not_found` for an id it never had or forgot).
    pub(crate) async fn owner_of(&self, id: &str) -> Result<Owner, Failure> {
        let cached = self
            .owners
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(id)
            .cloned();
        if let Some(o) = cached {
            return Ok(o);
        }
        let addr = self.addr_of(edge_of(id)?).await?;
        let sb = self
            .edges
            .edge(&addr)?
            .get_sandbox(self.edges.req(pb::SandboxRef { id: id.to_string() }))
            .await
            .map_err(|s| failure_from_status(&s))?
            .into_inner();
        Ok(self.remember_owner(&sb))
    }

    /// Keeps the project and creator of `sb` for [`Self::owner_of`].
    pub(crate) fn remember_owner(&self, sb: &pb::Sandbox) -> Owner {
        let o = Owner {
            project: sb.project.clone(),
            principal: sb.principal.clone(),
        };
        let mut m = self.owners.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() > 1_000_000 {
            m.clear();
        }
        m.insert(sb.id.clone(), o.clone());
        o
    }

    /// Runs one lifecycle call (`op`) on the sandbox's edge after authorization.
    pub(crate) async fn lifecycle(
        &self,
        caller: &Caller,
        id: &str,
        op: &str,
    ) -> Result<pb::Sandbox, Failure> {
        let addr = self.authorize_sandbox(caller, id).await?;
        let mut c = self.edges.edge(&addr)?;
        let r = pb::SandboxRef { id: id.to_string() };
        let out = match op {
            "get" => c.get_sandbox(self.edges.req(r)).await,
            "stop" => {
                let resp = c.stop_sandbox(self.edges.req(r)).await;
                if let Ok(resp) = &resp {
                    self.note_freed(id, resp.metadata());
                }
                resp
            }
            "pause" => c.pause_sandbox(self.edges.req(r)).await,
            "resume" => c.resume_sandbox(self.edges.req(r)).await,
            "touch" => c.touch_sandbox(self.edges.req(r)).await,
            _ => return Err(Failure::internal(format!("unknown lifecycle call {op}"))),
        };
        out.map(|r| r.into_inner())
            .map_err(|s| failure_from_status(&s))
    }

    /// A stop's answer says what it gave back on its edge: placement stops counting it
    /// before the next snapshot does.
    fn note_freed(&self, id: &str, md: &tonic::metadata::MetadataMap) {
        let Ok(edge) = edge_of(id) else { return };
        let Some(report) = md
            .get(FREED_HEADER)
            .and_then(|v| v.to_str().ok())
            .and_then(FreedReport::decode)
        else {
            return;
        };
        self.overlay
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .free(edge, id, report);
    }

    pub(crate) async fn set_timeout(
        &self,
        caller: &Caller,
        req: pb::SetSandboxTimeoutRequest,
    ) -> Result<pb::Sandbox, Failure> {
        let max = self.cfg.admission.max_ttl_max_s();
        if req.timeout_s <= 0 || (max > 0 && req.timeout_s > max) {
            return Err(Failure::invalid(format!(
                "timeout_s {} must be within [1, {max}]",
                req.timeout_s
            )));
        }
        let addr = self.authorize_sandbox(caller, &req.id).await?;
        self.edges
            .edge(&addr)?
            .set_sandbox_timeout(self.edges.req(req))
            .await
            .map(|r| r.into_inner())
            .map_err(|s| failure_from_status(&s))
    }

    /// `UpdateNetwork` (docs/network.md "Changing a sandbox's rules"): checks `rules` as
    /// admission checks a spec's `network_rules` (so a malformed rule is refused here,
    /// `invalid` naming the entry, before any edge is asked), authorizes `sandbox.operate`,
    /// and forwards to the sandbox's edge, which merges or replaces, applies and records
    /// them. Returns the sandbox with its new rules. Errors: `invalid`, `forbidden`,
    /// `not_found`, the edge's (`conflict` for an ended sandbox, `invalid` on an edge
    /// without networking).
    pub(crate) async fn update_network(
        &self,
        caller: &Caller,
        req: pb::UpdateNetworkRequest,
    ) -> Result<pb::Sandbox, Failure> {
        super::admission::check_network_rules("rules", &req.rules, &self.net_rules)?;
        let addr = self.authorize_sandbox(caller, &req.id).await?;
        self.edges
            .edge(&addr)?
            .update_network(self.edges.req(req))
            .await
            .map(|r| r.into_inner())
            .map_err(|s| failure_from_status(&s))
    }

    /// Lists the project's (and subprojects') sandboxes across every edge. An unreachable
    /// or unhealthy edge is skipped and named in `unreachable_edges`: the others' sandboxes
    /// are still listed.
    pub(crate) async fn list(
        &self,
        caller: &Caller,
        req: pb::ListSandboxesRequest,
    ) -> Result<pb::ListSandboxesResponse, Failure> {
        let project = if req.project.is_empty() {
            "root".to_string()
        } else {
            req.project.clone()
        };
        names::check_project_path(&project)?;
        self.auth
            .authorize(caller, &project, "sandbox.operate")
            .await?;
        let snap = self.current_snapshot().await?;
        let mut unreachable: Vec<String> = snap
            .edges
            .iter()
            .filter(|e| !e.healthy)
            .map(|e| e.id.clone())
            .collect();
        let calls = snap.edges.iter().filter(|e| e.healthy).map(|e| {
            let r = pb::EdgeListRequest {
                project: project.clone(),
                task_id: req.task_id.clone(),
                include_ended: req.include_ended,
            };
            let client = self.edges.edge(&e.addr);
            async move {
                let listed = match client {
                    Ok(mut c) => c
                        .list_sandboxes(self.edges.req(r))
                        .await
                        .map(|r| r.into_inner().sandboxes)
                        .map_err(|s| failure_from_status(&s)),
                    Err(f) => Err(f),
                };
                (e.id.as_str(), listed)
            }
        });
        let mut all = Vec::new();
        for (edge, listed) in futures::future::join_all(calls).await {
            match listed {
                Ok(v) => all.extend(v),
                Err(f) => {
                    tracing::warn!(edge_id = edge, error = %f.message, "an edge did not answer a list");
                    unreachable.push(edge.to_string());
                }
            }
        }
        unreachable.sort();
        all.sort_by(|a, b| {
            a.created_at
                .cmp(&b.created_at)
                .then_with(|| a.id.cmp(&b.id))
        });
        Ok(pb::ListSandboxesResponse {
            sandboxes: all,
            unreachable_edges: unreachable,
        })
    }

    /// pause_task / resume_task / stop_task over every edge.
    pub(crate) async fn task_action(
        &self,
        caller: &Caller,
        req: pb::TaskRequest,
        action: &str,
    ) -> Result<pb::TaskActionResult, Failure> {
        let project = if req.project.is_empty() {
            "root".to_string()
        } else {
            req.project.clone()
        };
        names::check_project_path(&project)?;
        if req.task_id.is_empty() || req.task_id.len() > 256 {
            return Err(Failure::invalid("task_id must be 1 to 256 characters"));
        }
        self.auth
            .authorize(caller, &project, "sandbox.operate")
            .await?;
        let snap = self.current_snapshot().await?;
        let calls = snap.edges.iter().filter(|e| e.healthy).map(|e| {
            let r = pb::EdgeTaskRequest {
                project: project.clone(),
                task_id: req.task_id.clone(),
                action: action.to_string(),
            };
            let client = self.edges.edge(&e.addr);
            let id = e.id.clone();
            async move {
                match client {
                    Ok(mut c) => c
                        .task_action(self.edges.req(r))
                        .await
                        .map(|r| r.into_inner())
                        .map_err(|s| format!("edge {id}: {}", failure_from_status(&s))),
                    Err(f) => Err(format!("edge {id}: {f}")),
                }
            }
        });
        let mut out = pb::TaskActionResult::default();
        for r in futures::future::join_all(calls).await {
            match r {
                Ok(t) => {
                    out.affected += t.affected;
                    out.failed += t.failed;
                    out.errors.extend(t.errors);
                }
                Err(e) => out.errors.push(e),
            }
        }
        Ok(out)
    }

    /// Edge drain (needs project.admin on root).
    pub(crate) async fn drain(
        &self,
        caller: &Caller,
        req: pb::DrainEdgeRequest,
    ) -> Result<pb::EdgeState, Failure> {
        names::check_edge_id(&req.edge_id)?;
        self.auth.authorize(caller, "root", "project.admin").await?;
        let addr = self.addr_of(&req.edge_id).await?;
        self.edges
            .edge(&addr)?
            .drain(self.edges.req(req))
            .await
            .map(|r| r.into_inner())
            .map_err(|s| failure_from_status(&s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sandbox_ids_name_their_edge() {
        assert_eq!(edge_of("node-a1.k3m9x").unwrap(), "node-a1");
        for bad in ["", "nodot", "Node.x", "a.", "a.b/c", ".x"] {
            assert!(edge_of(bad).is_err(), "{bad}");
        }
    }
}
