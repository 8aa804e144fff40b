//! The container backend (`runtime: linux`, 22-components §6): per-sandbox cgroups and
//! writable disks; the rest of the backend builds on these.

pub mod cgroup;
pub mod disk;
