//! The in-sandbox agents (22-components §11): aether, PID 1 of each sandbox, serving the
//! runtime API on a unix socket the edge reaches, and chronus, one process per shell
//! session. This module imports no role and no backend; it stays small.

pub mod config;
pub mod procs;
pub mod reaper;
pub mod user;
