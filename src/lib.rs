//! OpenDsec: sandbox infrastructure in one executable. See docs/architecture.md for the layout.
#![deny(unsafe_code)]

pub mod backends;
pub mod cli;
pub mod config;
pub mod guest;
pub mod images;
pub mod netpol;
pub mod pb;
pub mod pki;
pub mod roles;
pub mod rpc;
pub mod rt;
pub mod shutdown;
pub mod sys;
pub mod telemetry;
pub mod types;

/// This build's version, as `opendsec version` prints it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
