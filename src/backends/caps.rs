//! Optional capabilities of a backend (docs/architecture.md). A backend offers
//! one by returning `Some(self)` from the matching accessor of `Backend`; the defaults say
//! `None`, so the sim backend implements none of them.

use std::collections::BTreeMap;
use std::path::PathBuf;

use async_trait::async_trait;

use super::{BackendError, BackendState, Handle};

/// Reaches aether, the agent inside the sandbox, over gRPC. The edge resumes a paused
/// sandbox before asking, so `channel` is only called for a RUNNING sandbox.
#[async_trait]
pub trait Runtime: Send + Sync {
    /// A channel to aether's `opendsec.v1.Runtime` service in this sandbox (over a unix
    /// socket for containers, vsock for VMs). Errors: `Lost` when the agent cannot be reached.
    async fn channel(
        &self,
        sandbox: &Handle<'_>,
    ) -> Result<tonic::transport::Channel, BackendError>;
}

/// One sandbox the backend noticed dying on its own (its agent connection broke).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Loss {
    pub sandbox_id: String,
    /// Why, for the record's `message`, e.g. `aether connection closed`.
    pub message: String,
}

/// Tells the edge when a sandbox dies without being asked to.
pub trait LossReporter: Send + Sync {
    /// The stream of losses; the edge takes it once at start (later calls may return `None`).
    fn losses(&self) -> Option<tokio::sync::mpsc::Receiver<Loss>>;
}

/// Where and how to write a snapshot (fork, `create_snapshot`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotTarget {
    /// Directory the snapshot's files go to (node-local or in the image store).
    pub dir: PathBuf,
    /// Include memory (microVMs: required for a snapshot a VM can continue from).
    pub memory: bool,
}

/// What a snapshot produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SnapshotInfo {
    /// Files written, relative to the target directory.
    pub files: Vec<String>,
    /// Bytes of data the snapshot added (holes excluded; a file it hard-linked from the
    /// node, such as a shared image disk, counts nothing).
    pub bytes: u64,
    /// Runtime versions the snapshot needs to be restored (e.g. `firecracker` → `1.17.0`).
    pub versions: BTreeMap<String, String>,
    /// How long the sandbox stood still for it (ms; 0 where it did not stop).
    pub paused_ms: f64,
}

/// Takes snapshots of a sandbox (fork, `create_snapshot`). The sandbox keeps running; a
/// microVM pauses its vCPUs briefly.
#[async_trait]
pub trait Snapshotter: Send + Sync {
    /// Writes a snapshot of the sandbox to `target`. Returns the backend's state after it
    /// (e.g. the new base of later diff snapshots) and what was written.
    async fn snapshot(
        &self,
        sandbox: &Handle<'_>,
        target: &SnapshotTarget,
    ) -> Result<(BackendState, SnapshotInfo), BackendError>;
}

/// The layer a pack added to the store, and the image it makes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedLayer {
    /// The sandbox's image layers, bottom first, then the new one: the new image's layers.
    pub layers: Vec<crate::images::digest::Digest>,
    /// The new layer's diff_id.
    pub diff_id: crate::images::digest::Digest,
    /// What it holds (see [`crate::images::pack::Packed`]).
    pub packed: crate::images::pack::Packed,
}

/// Builds an image layer from a sandbox's writable layer (`pack_diff` and container
/// snapshots, docs/images.md "Images from sandboxes").
#[async_trait]
pub trait Packer: Send + Sync {
    /// Writes the sandbox's file-system changes into the image store as one new layer,
    /// leaving out what `scrub` matches; the sandbox is frozen for the copy and thawed
    /// after (a paused one stays paused). Errors: `Invalid` (a sandbox of a node-local
    /// image, a device node in its files), `ImageUnavailable` (no store, the store cannot
    /// be written), `Step` (freezing or reading its disk failed).
    async fn pack(
        &self,
        sandbox: &Handle<'_>,
        scrub: &crate::images::pack::Scrub,
    ) -> Result<PackedLayer, BackendError>;
}

/// The backend's sandboxes need sandbox networking (a netns with a veth pair).
pub trait Networked: Send + Sync {
    /// The path of the sandbox's network namespace (e.g. `/proc/<pid>/ns/net` or a bind
    /// mount), for netpol to wire up; `None` while it has none (paused microVM without a
    /// placeholder).
    fn netns(&self, sandbox: &Handle<'_>) -> Option<PathBuf>;
}

/// The backend can only run fixed local images (development).
pub trait ImageLister: Send + Sync {
    /// The image names it can run.
    fn images(&self) -> Vec<String>;
}

/// Reports the versions of the runtime programs the backend uses.
pub trait Versioned: Send + Sync {
    /// Program → version, e.g. `{"firecracker": "1.17.0"}`.
    fn versions(&self) -> BTreeMap<String, String>;
}
