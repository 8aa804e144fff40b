//! `opendsec ctl bench`: placement benchmark on an in-process simulated cluster (filled in below).

use std::process::ExitCode;

/// Entry for `bench`.
pub fn main(_args: &[String]) -> ExitCode {
    eprintln!("error: invalid: bench is not built yet");
    ExitCode::from(2)
}
