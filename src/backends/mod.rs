//! Sandbox backends: the `Backend` trait every backend implements, its optional capability
//! traits, and the factory that builds a backend from `edges[].backends.<name>`
//! (docs/configuration.md, docs/architecture.md).
//!
//! A backend knows how to make, stop, pause and resume one sandbox on this node, nothing more:
//! admission, records, TTLs and leases belong to the edge. Backends never import roles and
//! never build a `tonic::Status`; they fail with [`BackendError`].
//!
//! What a backend needs to remember about a sandbox (a pid, socket paths, a snapshot's
//! generation) it returns as [`BackendState`]; the edge persists it in the sandbox's record
//! and hands it back on every later call, also after an edge restart (`adopt`). So a backend
//! may keep in-memory caches, but must be able to work from the state alone.

mod caps;
pub mod container;
mod error;
mod factory;
pub mod microvm;
pub mod netslot;
pub mod sim;

use std::collections::HashSet;
use std::path::PathBuf;

use async_trait::async_trait;

use crate::pb;

pub use caps::{
    ImageLister, Loss, LossReporter, Networked, PackedLayer, Packer, Runtime, SnapshotInfo,
    SnapshotTarget, Snapshotter, Versioned,
};
pub use error::BackendError;
pub use factory::build;

/// Backend-private state of one sandbox, persisted by the edge in the sandbox's record
/// (JSON; `null` when the backend keeps none).
pub type BackendState = serde_json::Value;

/// What the edge gives a backend to create one sandbox.
#[derive(Debug, Clone, PartialEq)]
pub struct CreateRequest {
    /// `<edge-id>.<suffix>`; safe as a file name.
    pub sandbox_id: String,
    /// The owning project (for labels and logs).
    pub project: String,
    /// The spec with resources filled in: `cpu_cores_limit` > 0, `memory_limit_mb` > 0 and
    /// `disk_mb` > 0 (the backend's `default_disk_mb` when the request set none).
    pub spec: pb::SandboxSpec,
    /// Set for a fork's copy: the files it starts from instead of `spec.image`'s manifest.
    pub fork: Option<ForkFiles>,
    /// A microVM snapshot directory to restore the sandbox from (its memory, processes and
    /// files), instead of booting `spec.image`; backends without memory snapshots refuse
    /// it (`Unsupported`).
    pub snapshot: Option<PathBuf>,
}

/// What a fork's copies stack (docs/images.md "Fork"): the source's store layers and its
/// packed writable layer, with the defaults of the source's image.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ForkFiles {
    /// Bottom first, all in the image store.
    pub layers: Vec<crate::images::digest::Digest>,
    /// `KEY=value`, in order.
    pub env: Vec<String>,
    pub workdir: String,
    pub user: String,
}

impl ForkFiles {
    /// From the wire. Errors: `invalid` naming a layer that is no digest.
    pub fn from_pb(f: &pb::ForkFiles) -> Result<ForkFiles, crate::types::Failure> {
        let layers = f
            .layers
            .iter()
            .map(|l| {
                crate::images::digest::Digest::parse(l).map_err(|e| {
                    crate::types::Failure::invalid(format!(
                        "fork layer {}: {e}",
                        crate::types::names::shown(l)
                    ))
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        if layers.is_empty() {
            return Err(crate::types::Failure::invalid(
                "a fork's files need at least one layer",
            ));
        }
        Ok(ForkFiles {
            layers,
            env: f.env.clone(),
            workdir: f.workdir.clone(),
            user: f.user.clone(),
        })
    }
}

/// One recorded sandbox as the edge hands it to the backend.
#[derive(Debug, Clone, Copy)]
pub struct Handle<'a> {
    pub sandbox_id: &'a str,
    pub spec: &'a pb::SandboxSpec,
    pub state: &'a BackendState,
}

/// The state a sandbox was recorded in when the edge stopped, for `adopt`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recorded {
    Running,
    Paused,
}

/// A sandbox taken over again after an edge restart.
#[derive(Debug, Clone, PartialEq)]
pub struct Adopted {
    /// The backend's state from now on.
    pub state: BackendState,
    /// Whether the sandbox is in fact paused (a pause interrupted by the restart may have
    /// completed or not; the backend says which).
    pub paused: bool,
}

/// The answer of a liveness probe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Health {
    Alive,
    /// Gone, with why (for the record's `message`).
    Lost(String),
}

/// What `cleanup` removed: leftovers of sandboxes the edge has no record of.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CleanupReport {
    /// One entry per thing removed (a cgroup, a process, a disk, a netns), for the log.
    pub removed: Vec<String>,
}

/// Where a backend may keep its files and find the agents; given by the edge.
#[derive(Debug, Clone, Default)]
pub struct BackendContext {
    pub edge_id: String,
    /// The edge's `state_dir` (disks, snapshots, jails live under it).
    pub state_dir: PathBuf,
    /// Directory holding aether and chronus (`agent_dir`).
    pub agent_dir: PathBuf,
    /// Node-local images (`edges[].images`): name → lower directories, topmost first.
    pub images: std::collections::BTreeMap<String, Vec<PathBuf>>,
    /// The shared image store's root (`image_store.root`), if the cluster has one.
    pub image_store: Option<PathBuf>,
    /// The edge's sandbox networking (`edges[].network.enabled`), shared by its backends;
    /// `None` when off: sandboxes have only a loopback interface.
    pub network: Option<std::sync::Arc<crate::netpol::network::Network>>,
}

/// A sandbox backend (docs/architecture.md). One instance serves every sandbox
/// of one configured backend name on one edge; calls for different sandboxes may run
/// concurrently, the edge never runs two lifecycle calls for one sandbox at once.
#[async_trait]
pub trait Backend: Send + Sync {
    /// The configured name (`microvm`, `container`, `sim`, ...), what creations name.
    fn name(&self) -> &str;
    /// The runtime behind it: `sim`, `linux`, `firecracker` or `qemu`.
    fn runtime_kind(&self) -> &'static str;
    /// True when the backend runs nothing (sim): nothing to stop when the edge exits, and
    /// runtime calls are refused.
    fn simulated(&self) -> bool {
        false
    }
    /// True when a pause gives the sandbox's memory back to the host (microVMs; containers
    /// with `pause_reclaim`), so admission charges paused sandboxes `paused_mem_charge`.
    fn pause_frees_memory(&self) -> bool {
        false
    }
    /// What a running sandbox takes of its node's memory beyond its `memory_limit_mb`: a
    /// floor and an overhead, in MiB, zero by default. A microVM's guest gets at least 128
    /// MiB and its VMM (page tables, device buffers) `vm_overhead_mb` on top
    /// (docs/configuration.md). The edge advertises it in `EdgeState.memory_charges` so that
    /// placement charges what admission will.
    fn memory_charge(&self) -> pb::MemoryCharge {
        pb::MemoryCharge::default()
    }
    /// The memory, in MiB, a running sandbox of `spec` takes from its node: what admission
    /// charges and a resume needs back, `memory_charge` applied to the spec's
    /// `memory_limit_mb`. A quota is charged the spec's figure, never this one.
    fn memory_charge_mb(&self, spec: &pb::SandboxSpec) -> i64 {
        crate::types::charged_memory_mb(&self.memory_charge(), spec.memory_limit_mb)
    }

    /// Checks a creation's spec (resources filled in) against what this backend can start,
    /// before anything is made, so a spec that cannot start fails at admission. Errors:
    /// `Config` (reason `invalid`) naming the field and the limit.
    fn check_spec(&self, _spec: &pb::SandboxSpec) -> Result<(), BackendError> {
        Ok(())
    }
    /// Makes and starts the sandbox. On error nothing of it is left running.
    async fn create(&self, req: &CreateRequest) -> Result<BackendState, BackendError>;
    /// Stops the sandbox and removes its file system and processes (running or paused).
    /// Stopping a sandbox that is already gone succeeds.
    async fn stop(&self, sandbox: &Handle<'_>) -> Result<(), BackendError>;
    /// Pauses a running sandbox (freezer, or snapshot and exit for microVMs).
    async fn pause(&self, sandbox: &Handle<'_>) -> Result<BackendState, BackendError>;
    /// Resumes a paused sandbox.
    async fn resume(&self, sandbox: &Handle<'_>) -> Result<BackendState, BackendError>;
    /// Checks that a running sandbox is alive.
    async fn probe(&self, sandbox: &Handle<'_>) -> Health;
    /// Takes over a sandbox recorded before an edge restart (reconnects to its process or
    /// VM and agent). Errors: `Adopt` or `Lost` when it cannot be taken over; the edge then
    /// marks it FAILED and releases it.
    async fn adopt(
        &self,
        sandbox: &Handle<'_>,
        recorded: Recorded,
    ) -> Result<Adopted, BackendError>;
    /// Applies a running or paused sandbox's changed `network_rules` at once
    /// (`UpdateNetwork`, docs/network.md "Changing a sandbox's rules"): `sandbox.spec` carries
    /// the new rules. The edge calls it under the sandbox's operation lock and records the
    /// rules only when it succeeds, so on error the sandbox keeps its old rules, in force and
    /// on record. A paused sandbox's rules change too (its resume needs nothing more).
    /// The default suits backends whose sandboxes have no network of their own (sim): there
    /// is nothing to apply, the record is all.
    /// Errors: `Invalid` naming a rule that does not resolve, or when the sandbox has no
    /// network to apply allowances to; `Step` when the rules could not be written (the old
    /// ones stay in force).
    async fn update_network(&self, _sandbox: &Handle<'_>) -> Result<(), BackendError> {
        Ok(())
    }
    /// Removes what is left on the node of sandboxes whose ids are not in `keep` (cgroups,
    /// processes, disks, networks). Called once at start, after adoption.
    async fn cleanup(&self, keep: &HashSet<String>) -> Result<CleanupReport, BackendError>;
    /// The edge is exiting (after it stopped its sandboxes, or kept them): removes what the
    /// backend made on the node for itself and no longer needs (empty cgroup parents).
    /// Anything a kept sandbox still uses stays. Errors: `Io` with what could not go.
    async fn release_node(&self) -> Result<(), BackendError> {
        Ok(())
    }

    /// The gRPC connection to aether, for runtime calls.
    fn runtime(&self) -> Option<&dyn Runtime> {
        None
    }
    /// Reports sandboxes that die on their own.
    fn loss_reporter(&self) -> Option<&dyn LossReporter> {
        None
    }
    /// Snapshots (fork, `create_snapshot`).
    fn snapshotter(&self) -> Option<&dyn Snapshotter> {
        None
    }
    /// `pack_diff`.
    fn packer(&self) -> Option<&dyn Packer> {
        None
    }
    /// Needs sandbox networking.
    fn networked(&self) -> Option<&dyn Networked> {
        None
    }
    /// Runs only fixed local images.
    fn image_lister(&self) -> Option<&dyn ImageLister> {
        None
    }
    /// Reports runtime versions.
    fn versioned(&self) -> Option<&dyn Versioned> {
        None
    }
}
