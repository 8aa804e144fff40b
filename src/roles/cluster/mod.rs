//! `opendsec cluster up` (docs/cli.md): a whole cluster in one
//! process — IAM, a watcher, apiservers and edges wired together over real loopback sockets,
//! so what runs here is what production runs. Also the scheduling benchmark `bench`.

pub mod bench;
mod local;
mod up;

pub use local::{LocalCluster, UpOptions};

use std::process::ExitCode;

const CLUSTER_USAGE: &str =
    "usage: opendsec cluster up [flags]   (see `opendsec cluster up -help`)";

/// Entry for `opendsec cluster <sub> ...`: exit 0 for help, 2 for a missing or unknown
/// command.
pub fn main(args: Vec<String>) -> ExitCode {
    match args.first().map(String::as_str) {
        Some("up") => up::main(args.get(1..).unwrap_or_default()),
        Some("-h") | Some("--help") | Some("-help") | Some("help") => {
            println!("{CLUSTER_USAGE}");
            ExitCode::SUCCESS
        }
        // No command is a usage error, as for any other command that needs one.
        None => {
            eprintln!("error: invalid: missing cluster command\n{CLUSTER_USAGE}");
            ExitCode::from(2)
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
