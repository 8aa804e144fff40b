//! Resource vectors: what a sandbox asks for, what a node has, what a project may hold.

use crate::pb;

/// The node memory, in MiB, that a running sandbox of `memory_limit_mb` takes under
/// `charge`: `max(memory_limit_mb, floor_mb) + overhead_mb` (docs/microvm.md).
pub fn charged_memory_mb(charge: &pb::MemoryCharge, memory_limit_mb: i64) -> i64 {
    memory_limit_mb
        .max(charge.floor_mb)
        .saturating_add(charge.overhead_mb.max(0))
}

/// CPU cores, memory (MB), GPUs, disk (MB) and a sandbox count, added and compared as one.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Res {
    pub cpu_cores: f64,
    pub memory_mb: i64,
    pub gpus: i64,
    pub disk_mb: i64,
    pub sandboxes: i64,
}

impl Res {
    pub fn add(&mut self, o: &Res) {
        self.cpu_cores += o.cpu_cores;
        self.memory_mb += o.memory_mb;
        self.gpus += o.gpus;
        self.disk_mb += o.disk_mb;
        self.sandboxes += o.sandboxes;
    }
    pub fn sub(&mut self, o: &Res) {
        self.cpu_cores = (self.cpu_cores - o.cpu_cores).max(0.0);
        // Float drift from many add/sub pairs must not leave a phantom fraction of a core.
        if self.cpu_cores < 1e-9 {
            self.cpu_cores = 0.0;
        }
        self.memory_mb = (self.memory_mb - o.memory_mb).max(0);
        self.gpus = (self.gpus - o.gpus).max(0);
        self.disk_mb = (self.disk_mb - o.disk_mb).max(0);
        self.sandboxes = (self.sandboxes - o.sandboxes).max(0);
    }
    pub fn to_pb(self) -> pb::Resources {
        pb::Resources {
            cpu_cores: self.cpu_cores,
            memory_mb: self.memory_mb,
            gpus: self.gpus,
            disk_mb: self.disk_mb,
            sandboxes: self.sandboxes,
        }
    }
    pub fn from_pb(r: Option<&pb::Resources>) -> Res {
        match r {
            Some(r) => Res {
                cpu_cores: r.cpu_cores,
                memory_mb: r.memory_mb,
                gpus: r.gpus,
                disk_mb: r.disk_mb,
                sandboxes: r.sandboxes,
            },
            None => Res::default(),
        }
    }
    /// What one sandbox of this spec holds (quota and node accounting).
    pub fn of_spec(s: &pb::SandboxSpec) -> Res {
        Res {
            cpu_cores: s.cpu_cores_limit,
            memory_mb: s.memory_limit_mb,
            gpus: s.gpus as i64,
            disk_mb: s.disk_mb,
            sandboxes: 1,
        }
    }
}
