//! The in-sandbox agents (docs/architecture.md): aether, PID 1 of each sandbox, serving the
//! runtime API on a unix socket the edge reaches, and chronus, one process per shell
//! session. This module imports no role and no backend; it stays small.

pub mod aether;
pub mod chronus;
pub mod config;
pub mod port;
pub mod portmux;
pub mod procs;
pub mod proctree;
pub mod reaper;
pub mod uds;
pub mod user;
pub mod vmcgroups;
pub mod vminit;
pub mod watch;

use std::sync::{Mutex, MutexGuard};

/// Locks a mutex, shrugging off poisoning: every critical section in the agents is a few
/// assignments, so a panicked holder leaves consistent data.
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(p) => p.into_inner(),
    }
}

/// Logging for the agents: stderr, filter from `OPENDSEC_LOG` (default `info`). Lighter
/// than the roles' setup (no metrics recorder): agents run in every sandbox.
pub fn log_init() {
    let level = std::env::var("OPENDSEC_LOG").unwrap_or_else(|_| "info".to_string());
    let filter = tracing_subscriber::EnvFilter::try_new(&level)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
}
