//! Command lines: role dispatch (`opendsec <role>`), the role runners, and the CLI
//! `opendsec ctl` (docs/cli.md).

pub mod ctl;
pub mod dispatch;
pub mod flags;
pub mod roles;
