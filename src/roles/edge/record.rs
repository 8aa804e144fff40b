//! `SandboxRecord`: what the edge knows about one sandbox, in memory and (with
//! `persist_state`) on disk as `<state_dir>/edges/<edge_id>/sandboxes/<id>.json`.

use serde::{Deserialize, Serialize};

use crate::backends::BackendState;
use crate::pb::{self, SandboxState};
use crate::types::Res;

/// One sandbox: the API record plus the edge's own bookkeeping. Persisted as JSON (the
/// `sandbox` field in proto-JSON form).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SandboxRecord {
    /// The record callers see (docs/concepts.md).
    pub sandbox: pb::Sandbox,
    /// The backend's private state (pids, paths), handed back on every backend call.
    #[serde(default)]
    pub backend_state: BackendState,
    /// Unix seconds at which a TTL paused it (`ttl_paused_s`); 0 = not paused by a TTL.
    #[serde(default)]
    pub ttl_paused_at: i64,
    /// IAM binds the lease to another edge or sandbox (or released it): this edge must
    /// never release it.
    #[serde(default)]
    pub lease_foreign: bool,
    /// FAILED because the edge restarted during its creation (not a backend failure): a
    /// retry of the same creation may create it again (`create_batch`).
    #[serde(default)]
    pub interrupted: bool,
    /// Digest of the spec it was created from (`types::spec_digest`); "" = unknown. A
    /// creation of the same id with another spec is `conflict`.
    #[serde(default)]
    pub spec_digest: String,
}

impl SandboxRecord {
    /// A new record in CREATING.
    pub fn creating(
        id: &str,
        edge_id: &str,
        lease_id: &str,
        project: &str,
        principal: &str,
        spec: pb::SandboxSpec,
        now: i64,
    ) -> SandboxRecord {
        SandboxRecord {
            sandbox: pb::Sandbox {
                id: id.to_string(),
                project: project.to_string(),
                principal: principal.to_string(),
                edge_id: edge_id.to_string(),
                spec: Some(spec),
                state: SandboxState::Creating as i32,
                created_at: now,
                last_active_at: now,
                ended_at: 0,
                message: String::new(),
                lease_id: lease_id.to_string(),
            },
            backend_state: BackendState::Null,
            ttl_paused_at: 0,
            lease_foreign: false,
            interrupted: false,
            spec_digest: String::new(),
        }
    }

    pub fn id(&self) -> &str {
        &self.sandbox.id
    }

    /// The lifecycle state (an unknown number reads as FAILED).
    pub fn state(&self) -> SandboxState {
        SandboxState::try_from(self.sandbox.state).unwrap_or(SandboxState::Failed)
    }

    pub fn set_state(&mut self, s: SandboxState) {
        self.sandbox.state = s as i32;
    }

    /// Ends the sandbox: STOPPED or FAILED, with `ended_at` and `message`.
    pub fn end(&mut self, s: SandboxState, now: i64, message: impl Into<String>) {
        self.set_state(s);
        self.sandbox.ended_at = now;
        self.sandbox.message = message.into();
    }

    pub fn spec(&self) -> pb::SandboxSpec {
        self.sandbox.spec.clone().unwrap_or_default()
    }

    pub fn backend(&self) -> &str {
        self.sandbox
            .spec
            .as_ref()
            .map(|s| s.backend.as_str())
            .unwrap_or("")
    }

    pub fn task_id(&self) -> &str {
        self.sandbox
            .spec
            .as_ref()
            .map(|s| s.task_id.as_str())
            .unwrap_or("")
    }

    /// STOPPED or FAILED.
    pub fn is_ended(&self) -> bool {
        is_ended(self.state())
    }

    /// What the sandbox holds of the node's capacity now: its resources while live (with
    /// memory times `paused_mem_charge` while PAUSED on a backend whose pause frees memory),
    /// nothing once ended.
    pub fn charge(&self, pause_frees_memory: bool, paused_mem_charge: f64) -> Res {
        self.charge_with(None, pause_frees_memory, paused_mem_charge)
    }

    /// As `charge`, with `running_mb` (the backend's `memory_charge_mb`, guest memory plus
    /// VMM overhead for a microVM) as the memory while not paused; None = the spec's.
    pub fn charge_with(
        &self,
        running_mb: Option<i64>,
        pause_frees_memory: bool,
        paused_mem_charge: f64,
    ) -> Res {
        if self.is_ended() {
            return Res::default();
        }
        let mut r = Res::of_spec(
            self.sandbox
                .spec
                .as_ref()
                .unwrap_or(&pb::SandboxSpec::default()),
        );
        if pause_frees_memory && self.state() == SandboxState::Paused {
            // The VMM is gone: what is held is a share of the saved guest memory.
            r.memory_mb = (r.memory_mb as f64 * paused_mem_charge.clamp(0.0, 1.0)).ceil() as i64;
        } else if let Some(mb) = running_mb {
            r.memory_mb = mb;
        }
        r
    }

    /// The lease as reported to the watcher for reconciliation.
    pub fn lease_info(&self) -> pb::LeaseInfo {
        let res = Res::of_spec(
            self.sandbox
                .spec
                .as_ref()
                .unwrap_or(&pb::SandboxSpec::default()),
        );
        pb::LeaseInfo {
            lease_id: self.sandbox.lease_id.clone(),
            project: self.sandbox.project.clone(),
            principal: self.sandbox.principal.clone(),
            resources: Some(res.to_pb()),
            edge_id: self.sandbox.edge_id.clone(),
            sandbox_id: self.sandbox.id.clone(),
            created_at: self.sandbox.created_at,
            bound_at: self.sandbox.created_at,
        }
    }
}

/// STOPPED or FAILED.
pub fn is_ended(s: SandboxState) -> bool {
    matches!(s, SandboxState::Stopped | SandboxState::Failed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec() -> SandboxRecord {
        let spec = pb::SandboxSpec {
            backend: "sim".into(),
            cpu_cores_limit: 2.0,
            memory_limit_mb: 1000,
            disk_mb: 500,
            task_id: "t".into(),
            ..Default::default()
        };
        SandboxRecord::creating("e1.a", "e1", "L1", "root/p", "alice", spec, 100)
    }

    #[test]
    fn json_round_trip_keeps_everything() {
        let mut r = rec();
        r.backend_state = serde_json::json!({"pid": 42});
        r.ttl_paused_at = 7;
        r.set_state(SandboxState::Paused);
        let text = serde_json::to_string(&r).unwrap_or_default();
        assert!(text.contains("\"PAUSED\""), "proto-JSON state name: {text}");
        let back: SandboxRecord = serde_json::from_str(&text).unwrap_or_else(|_| rec());
        assert_eq!(back, r);
    }

    #[test]
    fn charge_depends_on_state_and_backend() {
        let mut r = rec();
        r.set_state(SandboxState::Running);
        let c = r.charge(true, 0.25);
        assert_eq!(
            (c.cpu_cores, c.memory_mb, c.disk_mb, c.sandboxes),
            (2.0, 1000, 500, 1)
        );
        r.set_state(SandboxState::Paused);
        assert_eq!(
            r.charge(false, 0.25).memory_mb,
            1000,
            "sim pause keeps memory"
        );
        assert_eq!(r.charge(true, 0.25).memory_mb, 250);
        assert_eq!(r.charge(true, 0.25).sandboxes, 1);
        r.end(SandboxState::Stopped, 200, "stopped");
        assert_eq!(r.charge(true, 1.0), Res::default());
        assert_eq!(r.sandbox.ended_at, 200);
        assert!(r.is_ended());
    }
}
