//! The iam role (13-iam, 22-components §3): projects, principals, tokens, permissions, quotas,
//! quota leases and usage, standalone (memory or a durable state file).
//!
//! State changes only through deterministic [`command::Command`]s applied by
//! [`apply::apply`]; [`store::Store`] group-commits them to a log next to the state file.

pub mod apply;
mod apply_leases;
mod apply_principals;
pub mod backup;
pub mod command;
pub mod state;
pub mod tokens;
pub mod usage;

#[cfg(test)]
mod testutil;
