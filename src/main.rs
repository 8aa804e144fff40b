//! Role dispatch only: `opendsec <role> ...`, or a link named after the role
//! (`opendsec-iam`, `opendsecctl`, `aether`, ...).

use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    opendsec::cli::dispatch::main(args)
}
