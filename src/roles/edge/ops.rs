//! Operations on existing sandboxes: stop, pause, resume (by callers, by TTLs, by task
//! actions), touch, SetSandboxTimeout, Get/List, TaskAction and Drain (docs/architecture.md).
//! Every lifecycle step runs under the sandbox's operation lock and follows `machine::plan`.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use tracing::Instrument;

use super::machine::{plan, Op, Plan};
use super::metrics;
use super::node::{as_handle, handle, Core, Entry, Freed};
use super::record::SandboxRecord;
use super::ttl;
use crate::pb::{self, SandboxState};
use crate::types::{names, now_s, Failure, Reason};

/// Why an operation runs, for the record's `message`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Cause {
    /// A caller asked (the API, a task action, a runtime call's resume).
    Caller,
    /// A TTL ran out; the message says which.
    Ttl(String),
    /// The edge itself (shutdown, lease bound elsewhere), with why.
    Edge(String),
}

impl Core {
    /// Runs `op` on sandbox `id` under its operation lock.
    pub async fn lifecycle(&self, id: &str, op: Op, cause: Cause) -> Result<pb::Sandbox, Failure> {
        self.lifecycle_freed(id, op, cause).await.map(|(sb, _)| sb)
    }

    /// As `lifecycle`; also says what this call gave back to the allocation when it ended
    /// the sandbox (None when it was already ended or kept running).
    pub async fn lifecycle_freed(
        &self,
        id: &str,
        op: Op,
        cause: Cause,
    ) -> Result<(pb::Sandbox, Option<Freed>), Failure> {
        let entry = self.entry(id)?;
        let _g = entry.op.lock().await;
        self.lifecycle_locked_freed(&entry, op, cause).await
    }

    /// `lifecycle` for a caller who holds the entry's operation lock.
    pub(crate) async fn lifecycle_locked(
        &self,
        entry: &Entry,
        op: Op,
        cause: Cause,
    ) -> Result<pb::Sandbox, Failure> {
        self.lifecycle_locked_freed(entry, op, cause)
            .await
            .map(|(sb, _)| sb)
    }

    async fn lifecycle_locked_freed(
        &self,
        entry: &Entry,
        op: Op,
        cause: Cause,
    ) -> Result<(pb::Sandbox, Option<Freed>), Failure> {
        let rec = entry.snapshot();
        let id = rec.id().to_string();
        let (via, done, failed) = match plan(op, rec.state()) {
            Plan::AsIs => return Ok((rec.sandbox, None)),
            Plan::Conflict(m) => return Err(Failure::conflict(format!("sandbox {id}: {m}"))),
            Plan::Update => return Ok((rec.sandbox, None)),
            Plan::Run { via, done, failed } => (via, done, failed),
        };
        let Some(backend) = self.backend_of(&rec).cloned() else {
            return Err(Failure::internal(format!(
                "sandbox {id}: backend {:?} is not configured on this edge",
                rec.backend()
            )));
        };
        if op == Op::Resume {
            self.check_resume_room(&rec)?;
        }
        let span = tracing::info_span!("lifecycle", sandbox_id = %id, edge_id = %self.edge_id, op = op.name());
        debug_assert!(super::machine::allowed(rec.state(), via));
        async {
            let mid = self.update(entry, |r| r.set_state(via));
            self.persist(&mid).await;
            let parts = handle(&rec);
            let h = as_handle(&id, &parts);
            let t = Instant::now();
            let result = match op {
                Op::Pause => backend.pause(&h).await.map(Some),
                Op::Resume => backend.resume(&h).await.map(Some),
                Op::Stop => backend.stop(&h).await.map(|()| None),
                Op::Update => Ok(None),
            };
            metrics::op_done(backend.name(), op.name(), &result, t);
            let now = now_s();
            let (after, freed) = match &result {
                Ok(state) => self.update_freed(entry, |r| {
                    if let Some(s) = state {
                        r.backend_state = s.clone();
                    }
                    match op {
                        Op::Stop => r.end(done, now, stop_message(&cause)),
                        Op::Pause => {
                            r.set_state(done);
                            if let Cause::Ttl(why) = &cause {
                                r.ttl_paused_at = now;
                                r.sandbox.message = ttl::pause_message(why);
                            }
                        }
                        _ => {
                            r.set_state(done);
                            if op == Op::Resume {
                                let created = r.sandbox.created_at;
                                if let Some(spec) = r.sandbox.spec.as_mut() {
                                    if ttl::on_resume(spec, created, now) {
                                        tracing::info!("resumed after its lifetime: the idle timeout ends it from now on");
                                    }
                                }
                            }
                            // Paused time does not count toward idle: it restarts now.
                            r.sandbox.last_active_at = now;
                            r.ttl_paused_at = 0;
                            r.sandbox.message.clear();
                        }
                    }
                }),
                Err(e) => {
                    tracing::warn!(error = %crate::types::chain(&e), "backend step failed");
                    self.update_freed(entry, |r| {
                        if op == Op::Stop {
                            r.end(
                                failed,
                                now,
                                format!("stop failed: {e}", e = crate::types::chain(&e)),
                            );
                        } else {
                            r.set_state(failed);
                        }
                    })
                }
            };
            self.persist(&after).await;
            if after.is_ended() {
                // A caller's stop returns with the quota free; TTL and edge stops need not wait.
                if cause == Cause::Caller {
                    self.release_lease_now(&after, false).await;
                } else {
                    self.release_lease(&after, false);
                }
            }
            match result {
                Ok(_) => Ok((after.sandbox, freed)),
                Err(e) => Err(e.to_failure()),
            }
        }
        .instrument(span)
        .await
    }

    /// A resume on a backend whose pause frees memory needs the released memory back.
    fn check_resume_room(&self, rec: &SandboxRecord) -> Result<(), Failure> {
        let Some(b) = self.backend_of(rec) else {
            return Ok(());
        };
        if !b.pause_frees_memory() {
            return Ok(());
        }
        let Some(cap) = super::node::read(&self.capacity).memory_mb else {
            return Ok(());
        };
        let full = b.memory_charge_mb(&rec.spec());
        let held = rec.charge(true, self.paused_mem_charge).memory_mb;
        let used = super::node::lock(&self.alloc).total.memory_mb;
        if used - held + full > cap {
            return Err(Failure::new(
                Reason::NoCapacity,
                format!(
                    "not enough memory on edge {} to resume {}: {} MB needed, {} MB free",
                    self.edge_id,
                    rec.id(),
                    full - held,
                    (cap - used).max(0)
                ),
            ));
        }
        Ok(())
    }

    /// The record of `id`.
    pub fn get_sandbox(&self, id: &str) -> Result<pb::Sandbox, Failure> {
        Ok(self.entry(id)?.snapshot().sandbox)
    }

    /// Records within `project` ("" = all), of `task_id` ("" = any), ended ones only with
    /// `include_ended`; sorted by id.
    pub fn list(&self, project: &str, task_id: &str, include_ended: bool) -> Vec<pb::Sandbox> {
        let mut out: Vec<pb::Sandbox> = self
            .all()
            .iter()
            .map(|e| e.snapshot())
            .filter(|r| matches_filter(r, project, task_id) && (include_ended || !r.is_ended()))
            .map(|r| r.sandbox)
            .collect();
        out.sort_by(|a, b| a.id.cmp(&b.id));
        out
    }

    /// Resets the idle timer, resuming a paused sandbox first (as any runtime call does,
    /// docs/concepts.md "Sandboxes"). Ended sandboxes: `conflict`; a failed resume: its
    /// failure.
    pub async fn touch(&self, id: &str) -> Result<pb::Sandbox, Failure> {
        let entry = self.entry(id)?;
        let rec = entry.snapshot();
        if rec.is_ended() {
            return Err(Failure::conflict(format!(
                "sandbox {id}: cannot touch a sandbox that is {}",
                rec.state().as_str_name()
            )));
        }
        if matches!(
            rec.state(),
            SandboxState::Paused | SandboxState::Pausing | SandboxState::Resuming
        ) {
            self.lifecycle(id, Op::Resume, Cause::Caller).await?;
        }
        Ok(self
            .update(&entry, |r| r.sandbox.last_active_at = now_s())
            .sandbox)
    }

    /// The lifetime becomes the sandbox's current age plus `timeout_s` (> 0, else
    /// `invalid`). Ended sandboxes: `conflict`.
    pub async fn set_timeout(&self, id: &str, timeout_s: i64) -> Result<pb::Sandbox, Failure> {
        if timeout_s <= 0 {
            return Err(Failure::invalid(format!(
                "timeout_s must be > 0, not {timeout_s}"
            )));
        }
        let entry = self.entry(id)?;
        let _g = entry.op.lock().await;
        let rec = entry.snapshot();
        match plan(Op::Update, rec.state()) {
            Plan::Conflict(m) => return Err(Failure::conflict(format!("sandbox {id}: {m}"))),
            Plan::AsIs | Plan::Run { .. } | Plan::Update => {}
        }
        let now = now_s();
        let after = self.update(&entry, |r| {
            let age = (now - r.sandbox.created_at).max(0);
            if let Some(s) = r.sandbox.spec.as_mut() {
                s.ttl_max = age.saturating_add(timeout_s);
            }
        });
        self.persist(&after).await;
        Ok(after.sandbox)
    }

    /// Pauses, resumes or stops every live sandbox of `task_id` within `project` ("" = all
    /// projects). Counts affected and failed, with `<id>: <reason>: <message>` per failure.
    pub async fn task_action(
        &self,
        project: &str,
        task_id: &str,
        action: &str,
    ) -> Result<pb::TaskActionResult, Failure> {
        let op = match action {
            "pause" => Op::Pause,
            "resume" => Op::Resume,
            "stop" => Op::Stop,
            other => {
                return Err(Failure::invalid(format!(
                    "action must be pause, resume or stop, not {other:?}"
                )))
            }
        };
        if task_id.is_empty() {
            return Err(Failure::invalid("task_id is required"));
        }
        if !project.is_empty() {
            names::check_project_path(project)?;
        }
        let ids: Vec<String> = self
            .all()
            .iter()
            .map(|e| e.snapshot())
            .filter(|r| !r.is_ended() && matches_filter(r, project, task_id))
            .map(|r| r.id().to_string())
            .collect();
        let results =
            futures::future::join_all(ids.iter().map(|id| self.lifecycle(id, op, Cause::Caller)))
                .await;
        let mut out = pb::TaskActionResult::default();
        for (id, r) in ids.iter().zip(results) {
            match r {
                Ok(_) => out.affected += 1,
                Err(f) => {
                    out.failed += 1;
                    out.errors
                        .push(format!("{id}: {}: {}", f.reason, f.message));
                }
            }
        }
        Ok(out)
    }

    /// Sets (or with `undo` clears) the draining flag; persisted with `persist_state`.
    /// `edge_id` must be empty or this edge's id (`invalid` otherwise).
    pub async fn drain(&self, edge_id: &str, undo: bool) -> Result<pb::EdgeState, Failure> {
        if !edge_id.is_empty() && edge_id != self.edge_id {
            return Err(Failure::invalid(format!(
                "this is edge {}, not {edge_id:?}",
                self.edge_id
            )));
        }
        let _g = self.drain_lock.lock().await;
        self.draining.store(!undo, Ordering::Relaxed);
        if let Some(s) = &self.store {
            if let Err(e) = s
                .write_flags(&super::store::EdgeFlagsState { draining: !undo })
                .await
            {
                tracing::error!(edge_id = %self.edge_id, error = %crate::types::chain(&e), "writing the draining flag");
                return Err(Failure::internal(format!(
                    "writing the draining flag: {e}",
                    e = crate::types::chain(&e)
                )));
            }
        }
        tracing::info!(edge_id = %self.edge_id, draining = !undo, "drain flag changed");
        Ok(self.edge_state())
    }

    /// Stops every live sandbox of a backend that runs something (shutdown without
    /// `keep_sandboxes_on_exit`).
    pub async fn stop_all_real(self: &Arc<Self>) {
        let ids: Vec<String> = self
            .all()
            .iter()
            .map(|e| e.snapshot())
            .filter(|r| !r.is_ended() && self.backend_of(r).is_some_and(|b| !b.simulated()))
            .map(|r| r.id().to_string())
            .collect();
        let done = futures::future::join_all(
            ids.iter()
                .map(|id| self.lifecycle(id, Op::Stop, Cause::Edge("edge shut down".into()))),
        )
        .await;
        let failed = done.iter().filter(|r| r.is_err()).count();
        tracing::info!(edge_id = %self.edge_id, stopped = ids.len() - failed, failed, "sandboxes stopped at shutdown");
    }

    /// Marks a running sandbox the backend lost as FAILED, releases it and has the backend
    /// remove what is left of it.
    pub async fn mark_lost(&self, id: &str, why: &str) {
        let Some(entry) = self.get(id) else { return };
        let _g = entry.op.lock().await;
        let rec = entry.snapshot();
        if !matches!(rec.state(), SandboxState::Running | SandboxState::Paused) {
            return;
        }
        tracing::warn!(sandbox_id = %id, edge_id = %self.edge_id, why, "sandbox lost");
        let after = self.update(&entry, |r| {
            r.end(
                SandboxState::Failed,
                now_s(),
                format!("sandbox lost: {why}"),
            )
        });
        self.persist(&after).await;
        self.release_lease(&after, false);
        // What the sandbox leaves on the node (processes its agent left behind, cgroups,
        // disk, directory) goes now, not at the edge's next start.
        if let Some(backend) = self.backend_of(&rec).cloned() {
            let parts = handle(&rec);
            if let Err(e) = backend.stop(&as_handle(id, &parts)).await {
                tracing::warn!(sandbox_id = %id, edge_id = %self.edge_id, error = %crate::types::chain(&e), "removing a lost sandbox");
            }
        }
    }
}

fn stop_message(cause: &Cause) -> String {
    match cause {
        Cause::Caller => "stopped on request".to_string(),
        Cause::Ttl(why) => why.clone(),
        Cause::Edge(why) => why.clone(),
    }
}

fn matches_filter(r: &SandboxRecord, project: &str, task_id: &str) -> bool {
    (project.is_empty() || names::project_within(&r.sandbox.project, project))
        && (task_id.is_empty() || r.task_id() == task_id)
}
