//! The `container` backend, runtime `linux` (docs/architecture.md, docs/containers.md).

pub mod agent;
mod backend;
pub mod cgroup;
pub mod disk;
pub mod diskpool;
pub mod image;
pub mod init;
pub mod policy;
pub mod resolve;
pub mod rootfs;
pub mod setup;

pub(crate) use backend::check_user;
pub use backend::{
    judged_alive, start_time, stray_ids, ContainerBackend, ContainerState, MIN_CPU_CORES,
    MIN_DISK_MB, MIN_MEMORY_MB,
};
