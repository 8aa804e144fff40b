//! Picks the role from argv[0] or the first argument, and runs it.

use std::process::ExitCode;

const USAGE: &str = "usage: opendsec <role> [flags]

roles:
  iam        identities, projects, permissions, quotas and leases
  watcher    probes edges, serves the scheduling snapshot, reconciles quotas
  apiserver  the public API: authentication, admission, placement, forwarding
  edge       the node control plane and its backends
  e2b        the E2B-compatible gateway (E2B's SDKs on this cluster)
  cluster    `cluster up`: a whole cluster in one process
  ctl        the CLI (also installed as opendsecctl)
  version    print this build's version

Run `opendsec <role> -help` for a role's flags. Exit status: 0 ok, 1 when the command or
the cluster fails, 2 for a bad command line.";

/// Entry point shared by every name the executable is installed under.
pub fn main(args: Vec<String>) -> ExitCode {
    let argv0 = args
        .first()
        .map(|a| a.rsplit('/').next().unwrap_or(a).to_string())
        .unwrap_or_default();
    let tail = |n: usize| args.get(n..).map(<[String]>::to_vec).unwrap_or_default();
    let (role, rest): (String, Vec<String>) = match argv0.as_str() {
        "opendsecctl" | "opendsec-ctl" => ("ctl".into(), tail(1)),
        a if a.starts_with("opendsec-") => (a.trim_start_matches("opendsec-").to_string(), tail(1)),
        "aether" | "chronus" => (argv0.clone(), tail(1)),
        _ => match args.get(1).map(String::as_str) {
            Some("--role") => (
                args.get(2).cloned().unwrap_or_default(),
                args.get(3..).map(|s| s.to_vec()).unwrap_or_default(),
            ),
            Some(r) => (r.to_string(), tail(2)),
            None => ("help".into(), vec![]),
        },
    };
    match role.as_str() {
        "version" | "--version" | "-version" => {
            println!("opendsec {}", crate::VERSION);
            ExitCode::SUCCESS
        }
        "help" | "-h" | "--help" | "-help" => {
            println!("{USAGE}");
            ExitCode::SUCCESS
        }
        "ctl" => crate::cli::ctl::main(rest),
        "iam" | "watcher" | "apiserver" | "edge" | "e2b" => crate::cli::roles::main(&role, &rest),
        "cluster" => crate::roles::cluster::main(rest),
        // The container setup process (re-executed by the edge); single-threaded by design.
        "sandbox-init" => crate::backends::container::init::main(),
        "aether" => crate::guest::aether::main(rest),
        "chronus" => crate::guest::chronus::main(rest),
        other => {
            eprintln!("opendsec: unknown role {other:?}\n\n{USAGE}");
            ExitCode::from(2)
        }
    }
}
