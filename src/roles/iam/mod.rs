//! The iam role (13-iam, 22-components §3): projects, principals, tokens, permissions, quotas,
//! quota leases and usage, standalone (memory or a durable state file).
//!
//! State changes only through deterministic [`command::Command`]s applied by
//! [`apply::apply`]; [`store::Store`] group-commits them to a log next to the state file.

use std::path::PathBuf;

pub mod apply;
mod apply_leases;
mod apply_principals;
pub mod backup;
pub mod command;
pub mod state;
pub mod store;
pub mod tokens;
pub mod usage;

#[cfg(test)]
mod testutil;

/// Why the iam role could not start or keep its state.
#[derive(Debug, thiserror::Error)]
pub enum IamError {
    #[error("{what} {}: {source}", path.display())]
    Io { what: &'static str, path: PathBuf, source: std::io::Error },
    #[error("reading snapshot {}: {source}", path.display())]
    Snapshot { path: PathBuf, source: serde_json::Error },
    #[error("log {} line {line}: {message}", path.display())]
    Log { path: PathBuf, line: usize, message: String },
    #[error("state {} is in use by another IAM (its log is locked)", path.display())]
    Locked { path: PathBuf },
    #[error("iam config: {0}")]
    Config(String),
    #[error("bootstrapping IAM: {0}")]
    Bootstrap(crate::types::Failure),
}
