//! `opendsec ctl pki`: the cluster's CA and component certificates (docs/tls.md), made
//! offline from files; no connection to a cluster. Output is JSON naming the files written.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use argh::FromArgs;

use crate::config::Config;
use crate::pki::{save_issued, Ca, Identity, PkiError, Role, CA_CERT};
use crate::types::{Failure, Reason};

#[derive(FromArgs, Debug)]
/// the cluster's CA and component certificates (docs/tls.md)
#[argh(help_triggers("-h", "--help", "help"))]
struct PkiArgs {
    #[argh(subcommand)]
    cmd: PkiCmd,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
enum PkiCmd {
    Init(InitArgs),
    Ca(CaArgs),
    Issue(IssueArgs),
    Rotate(RotateArgs),
}

#[derive(FromArgs, Debug)]
/// one step of rotating the CA of a certificate directory without downtime (docs/tls.md
/// "Rotating the CA"): 1 trust a new CA beside the old, 2 reissue every component
/// certificate from it, 3 drop the old CA; deliver the files and restart the roles one at a
/// time after each
#[argh(subcommand, name = "rotate", help_triggers("-h", "--help", "help"))]
struct RotateArgs {
    /// the certificate directory (ca.crt, ca.key and the components' certificates)
    #[argh(option)]
    dir: String,
    /// the step: 1, 2 or 3
    #[argh(option)]
    step: u8,
    /// step 2: days each certificate is valid, never past the CA (default 365)
    #[argh(option, default = "365")]
    days: i64,
    /// step 1: days the new CA is valid (default 3650)
    #[argh(option, default = "3650")]
    ca_days: i64,
}

#[derive(FromArgs, Debug)]
/// create a cluster CA and a certificate for every component in a cluster config (which
/// must be valid)
#[argh(subcommand, name = "init", help_triggers("-h", "--help", "help"))]
struct InitArgs {
    /// the cluster config (JSON)
    #[argh(option)]
    config: String,
    /// directory to write ca.crt, ca.key and <role>-<id>.crt/.key to
    #[argh(option)]
    out: String,
    /// days each component certificate is valid, never past the CA (default 365)
    #[argh(option, default = "365")]
    days: i64,
    /// days the CA is valid (default 3650)
    #[argh(option, default = "3650")]
    ca_days: i64,
    /// host names or IP addresses the apiservers' certificates also name (the load
    /// balancer's), comma separated
    #[argh(option, default = "String::new()")]
    hosts: String,
}

#[derive(FromArgs, Debug)]
/// create a new CA only (the first step of a CA rotation)
#[argh(subcommand, name = "ca", help_triggers("-h", "--help", "help"))]
struct CaArgs {
    /// directory to write ca.crt and ca.key to
    #[argh(option)]
    out: String,
    /// days the CA is valid (default 3650)
    #[argh(option, default = "3650")]
    days: i64,
}

#[derive(FromArgs, Debug)]
/// issue a certificate for one component from a CA's directory
#[argh(subcommand, name = "issue", help_triggers("-h", "--help", "help"))]
struct IssueArgs {
    /// the CA's directory (ca.crt and ca.key)
    #[argh(option)]
    ca: String,
    /// edge, apiserver, watcher, iam, fleet, node, ops or e2b
    #[argh(option)]
    role: String,
    /// the component's id (an edge's id, a replica's, an apiserver's index)
    #[argh(option)]
    id: String,
    /// host names or IP addresses the certificate also names, comma separated
    #[argh(option, default = "String::new()")]
    hosts: String,
    /// directory to write <role>-<id>.crt and .key to
    #[argh(option)]
    out: String,
    /// days it is valid, never past the CA (default 365)
    #[argh(option, default = "365")]
    days: i64,
}

/// Runs `opendsec ctl pki ...` (`args` starting with `pki`). Exit 0; 1 with `error:
/// <reason>: <message>`; 2 on a usage error.
pub fn main(args: &[String]) -> ExitCode {
    let a: PkiArgs =
        match crate::cli::flags::parse("opendsecctl pki", args.get(1..).unwrap_or_default()) {
            Ok(a) => a,
            Err(code) => return code,
        };
    let r = match a.cmd {
        PkiCmd::Init(a) => init(&a),
        PkiCmd::Ca(a) => ca(&a),
        PkiCmd::Issue(a) => issue(&a),
        PkiCmd::Rotate(a) => rotate(&a),
    };
    match r.and_then(|v| {
        serde_json::to_string_pretty(&v)
            .map_err(|e| Failure::internal(e.to_string()))
            .map(|s| println!("{s}"))
    }) {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("error: {}: {}", f.reason, f.message);
            ExitCode::from(1)
        }
    }
}

fn failure(e: PkiError) -> Failure {
    let reason = match &e {
        PkiError::Io { source, .. } if source.kind() == std::io::ErrorKind::NotFound => {
            Reason::NotFound
        }
        PkiError::Io { source, .. } if source.kind() == std::io::ErrorKind::PermissionDenied => {
            Reason::Forbidden
        }
        PkiError::Exists(_) => Reason::Conflict,
        PkiError::Io { .. } | PkiError::Make(_) => Reason::Internal,
        _ => Reason::Invalid,
    };
    Failure::new(reason, e.to_string())
}

fn hosts_of(s: &str) -> Vec<String> {
    s.split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(str::to_string)
        .collect()
}

/// A new CA in `out`; one that is there (`ca.key` or `ca.crt`) is never replaced: every
/// certificate of the cluster hangs on it. Errors: `conflict` for a CA there.
fn new_ca(out: &Path, days: i64) -> Result<Ca, Failure> {
    let ca = Ca::generate(days).map_err(failure)?;
    ca.save(out).map_err(failure)?;
    Ok(ca)
}

fn ca(a: &CaArgs) -> Result<serde_json::Value, Failure> {
    let out = PathBuf::from(&a.out);
    new_ca(&out, a.days)?;
    Ok(serde_json::json!({ "ca": out.join(CA_CERT) }))
}

/// `pki issue`'s checks beyond the identity's: an IAM replica's id is the decimal number
/// configs and `iam member add` take, and its certificate names the host the other
/// replicas dial (`invalid` otherwise; docs/iam-replicas.md "Membership").
fn check_issue(role: Role, id: &str, hosts: &[String]) -> Result<(), Failure> {
    if role != Role::Iam {
        return Ok(());
    }
    if !crate::config::valid_replica_id(id) {
        return Err(Failure::invalid(format!(
            "-id {id:?}: an IAM replica's id is a decimal number without leading zeros"
        )));
    }
    if hosts.is_empty() {
        return Err(Failure::invalid(
            "-hosts: the other IAM replicas dial this one by its host; name it (-hosts HOST)",
        ));
    }
    Ok(())
}

fn issue(a: &IssueArgs) -> Result<serde_json::Value, Failure> {
    let role = Role::parse(&a.role).map_err(failure)?;
    check_issue(role, &a.id, &hosts_of(&a.hosts))?;
    let who = Identity::new(role, &a.id).map_err(failure)?;
    let ca = Ca::load(Path::new(&a.ca)).map_err(failure)?;
    let issued = ca
        .issue(&who, &hosts_of(&a.hosts), a.days)
        .map_err(failure)?;
    let cert = save_issued(Path::new(&a.out), &who, &issued).map_err(failure)?;
    Ok(serde_json::json!({ "identity": who.uri(), "certificate": cert }))
}

fn rotate(a: &RotateArgs) -> Result<serde_json::Value, Failure> {
    use crate::pki::rotate;
    let dir = Path::new(&a.dir);
    match a.step {
        1 => {
            crate::pki::check_days(a.ca_days).map_err(failure)?;
            let next = rotate::step1(dir, a.ca_days).map_err(failure)?;
            Ok(serde_json::json!({ "step": 1, "bundle": dir.join(CA_CERT), "new_ca": next }))
        }
        2 => {
            crate::pki::check_days(a.days).map_err(failure)?;
            let written = rotate::step2(dir, a.days).map_err(failure)?;
            Ok(serde_json::json!({ "step": 2, "certificates": written }))
        }
        3 => {
            let checked = rotate::step3(dir).map_err(failure)?;
            let ids: Vec<String> = checked.iter().map(Identity::uri).collect();
            Ok(serde_json::json!({ "step": 3, "ca": dir.join(CA_CERT), "checked": ids }))
        }
        n => Err(Failure::invalid(format!("-step {n}: 1, 2 or 3"))),
    }
}

fn init(a: &InitArgs) -> Result<serde_json::Value, Failure> {
    let text = std::fs::read_to_string(&a.config).map_err(|e| {
        Failure::new(
            if e.kind() == std::io::ErrorKind::NotFound {
                Reason::NotFound
            } else {
                Reason::Invalid
            },
            format!("{}: {e}", a.config),
        )
    })?;
    let cfg: Config = serde_json::from_str(&text)
        .map_err(|e| Failure::new(Reason::Invalid, format!("{}: {e}", a.config)))?;
    // The certificates do not depend on how components authenticate: a config without
    // `tls.dir` yet (the usual order: certificates first, then the config that uses them)
    // is checked as if it named it.
    let mut checked = cfg.clone();
    if checked.tls.dir.is_empty() {
        checked.tls.dir = "pki".into();
        checked.service_token.clear();
    }
    checked
        .validate()
        .map_err(|e| Failure::new(Reason::Invalid, format!("{}: {e}", a.config)))?;
    let hosts = hosts_of(&a.hosts);
    let components = crate::pki::cluster::components(&cfg).map_err(failure)?;
    // Everything is checked before anything is written.
    for h in hosts
        .iter()
        .chain(components.iter().filter_map(|(_, h)| h.as_ref()))
    {
        crate::pki::check_host(h).map_err(failure)?;
    }
    crate::pki::check_days(a.days)
        .and_then(|()| crate::pki::check_days(a.ca_days))
        .map_err(failure)?;
    let out = PathBuf::from(&a.out);
    let ca = new_ca(&out, a.ca_days)?;
    let written =
        crate::pki::cluster::issue_all(&ca, &components, &hosts, a.days, &out).map_err(failure)?;
    crate::pki::cluster::ensure_grant_key(&out).map_err(failure)?;
    Ok(serde_json::json!({ "ca": out.join(CA_CERT), "certificates": written }))
}
