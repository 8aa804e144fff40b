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

fn issue(a: &IssueArgs) -> Result<serde_json::Value, Failure> {
    let who = Role::parse(&a.role)
        .and_then(|r| Identity::new(r, &a.id))
        .map_err(failure)?;
    let ca = Ca::load(Path::new(&a.ca)).map_err(failure)?;
    let issued = ca
        .issue(&who, &hosts_of(&a.hosts), a.days)
        .map_err(failure)?;
    let cert = save_issued(Path::new(&a.out), &who, &issued).map_err(failure)?;
    Ok(serde_json::json!({ "identity": who.uri(), "certificate": cert }))
}

/// The host part of a `host:port` address, when it names one machine (not a wildcard).
fn addr_host(addr: &str) -> Option<String> {
    let host = match addr.rsplit_once(':') {
        Some((h, _)) => h.trim_start_matches('[').trim_end_matches(']'),
        None => addr,
    };
    match host {
        "" | "0.0.0.0" | "::" => None,
        h => Some(h.to_string()),
    }
}

/// Every component instance `cfg` names, with the host of its configured address: IAM
/// (its replicas' `id`s, else `0`), the watcher replicas (`id`, else `0`), the apiservers
/// (by index), the edges (`id`) and the E2B gateways (by index).
pub fn components(cfg: &Config) -> Result<Vec<(Identity, Option<String>)>, PkiError> {
    let mut out = Vec::new();
    if cfg.iam.replicas.is_empty() {
        out.push((Identity::new(Role::Iam, "0")?, addr_host(&cfg.iam.addr)));
    }
    for (i, r) in cfg.iam.replicas.iter().enumerate() {
        let id = r
            .get("id")
            .and_then(|v| v.as_str())
            .map_or_else(|| i.to_string(), str::to_string);
        let addr = r.get("addr").and_then(|v| v.as_str()).unwrap_or_default();
        out.push((Identity::new(Role::Iam, &id)?, addr_host(addr)));
    }
    if cfg.watcher.replicas.is_empty() {
        out.push((
            Identity::new(Role::Watcher, "0")?,
            addr_host(&cfg.watcher.addr),
        ));
    }
    for r in &cfg.watcher.replicas {
        out.push((Identity::new(Role::Watcher, &r.id)?, addr_host(&r.addr)));
    }
    for (i, a) in cfg.apiserver.iter().enumerate() {
        out.push((
            Identity::new(Role::Apiserver, &i.to_string())?,
            addr_host(&a.addr),
        ));
    }
    for e in &cfg.edges {
        out.push((Identity::new(Role::Edge, &e.id)?, addr_host(&e.addr)));
    }
    for (i, g) in cfg.e2b.gateways.iter().enumerate() {
        out.push((
            Identity::new(Role::E2b, &i.to_string())?,
            addr_host(&g.addr),
        ));
    }
    Ok(out)
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
    // The certificates do not depend on how components authenticate today: a config
    // that turns TLS on is checked as if it named a service token instead.
    let mut checked = cfg.clone();
    if !checked.tls.dir.is_empty() {
        checked.tls.dir.clear();
        if checked.service_token.is_empty() {
            checked.service_token = "pki-init".into();
        }
    }
    checked
        .validate()
        .map_err(|e| Failure::new(Reason::Invalid, format!("{}: {e}", a.config)))?;
    let hosts = hosts_of(&a.hosts);
    let components = components(&cfg).map_err(failure)?;
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
    let mut written = Vec::new();
    for (who, own) in components {
        // Only the apiservers answer at the load balancer's names: an edge (the machine
        // that runs sandboxes) must hold no certificate for them.
        let mut names = if who.role == Role::Apiserver {
            hosts.clone()
        } else {
            Vec::new()
        };
        names.extend(own);
        let issued = ca.issue(&who, &names, a.days).map_err(failure)?;
        written.push(save_issued(&out, &who, &issued).map_err(failure)?);
    }
    Ok(serde_json::json!({ "ca": out.join(CA_CERT), "certificates": written }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_component_s_own_address_is_one_of_its_hosts_unless_a_wildcard() {
        assert_eq!(addr_host("10.0.0.1:7100").as_deref(), Some("10.0.0.1"));
        assert_eq!(
            addr_host("n1.internal:9461").as_deref(),
            Some("n1.internal")
        );
        assert_eq!(addr_host("[fd00::1]:7100").as_deref(), Some("fd00::1"));
        assert_eq!(addr_host("0.0.0.0:7100"), None);
        assert_eq!(addr_host(""), None);
    }
}
