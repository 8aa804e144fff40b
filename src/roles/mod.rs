//! The server roles. Each is config → build (bind, construct) → spawn (tasks) → drain, and
//! talks to the others only through their gRPC services.

pub mod apiserver;
pub mod cluster;
pub mod e2b;
pub mod edge;
pub mod iam;
pub mod watcher;
