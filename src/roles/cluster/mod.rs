//! `opendsec cluster up` (10-cli "Local clusters and benchmarks"): a whole cluster in one
//! process — IAM, a watcher, apiservers and edges wired together over real loopback sockets,
//! so what runs here is what production runs. Also the scheduling benchmark `bench`.

pub mod bench;
mod local;
mod up;

pub use local::{LocalCluster, UpOptions};

use std::process::ExitCode;

/// Entry for `opendsec cluster <sub> ...`.
pub fn main(args: Vec<String>) -> ExitCode {
    match args.first().map(String::as_str) {
        Some("up") => up::main(args.get(1..).unwrap_or_default()),
        Some("-h") | Some("--help") | Some("-help") | Some("help") | None => {
            println!("usage: opendsec cluster up [flags]   (see `opendsec cluster up --help`)");
            ExitCode::SUCCESS
        }
        Some(other) => {
            eprintln!("error: invalid: unknown cluster command {other:?}; known: up");
            ExitCode::from(2)
        }
    }
}

/// Entry for the CLI's `opendsec ctl cluster ...` and `opendsec ctl bench ...` (args start
/// with `cluster` or `bench`).
pub fn ctl_main(args: Vec<String>) -> ExitCode {
    match args.first().map(String::as_str) {
        Some("cluster") => main(args.get(1..).unwrap_or_default().to_vec()),
        Some("bench") => bench::main(args.get(1..).unwrap_or_default()),
        _ => {
            eprintln!("error: invalid: expected `cluster up` or `bench`");
            ExitCode::from(2)
        }
    }
}
