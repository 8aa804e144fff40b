//! `opendsec ctl`: the CLI of 10-cli.

use std::process::ExitCode;

/// Runs `opendsec ctl <args...>`; returns the process exit code.
pub fn main(_args: Vec<String>) -> ExitCode {
    eprintln!("error: internal: ctl is not built yet");
    ExitCode::from(1)
}
