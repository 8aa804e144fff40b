//! The certificates of a whole cluster config: which components it names, issuing them
//! all, and the sandbox access token secret beside them (docs/tls.md "Files").

use std::path::{Path, PathBuf};

use super::{save_issued, Ca, Identity, PkiError, Role};
use crate::config::Config;

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
    // A replica's certificate names the host of its `addr`; its `raft_addr` is expected on
    // the same host (docs/iam-replicas.md).
    for r in &cfg.iam.replicas {
        out.push((Identity::new(Role::Iam, &r.id)?, addr_host(&r.addr)));
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

/// Issues a certificate for each of `components` (from [`components`]) into `out`. Only
/// the apiservers get `lb_hosts` (the load balancer's names): an edge, the machine that runs
/// sandboxes, must hold no certificate for them. Returns the certificates' paths.
/// Errors: as [`Ca::issue`] and [`save_issued`].
pub fn issue_all(
    ca: &Ca,
    components: &[(Identity, Option<String>)],
    lb_hosts: &[String],
    days: i64,
    out: &Path,
) -> Result<Vec<PathBuf>, PkiError> {
    let mut written = Vec::new();
    for (who, own) in components {
        let mut names = if who.role == Role::Apiserver {
            lb_hosts.to_vec()
        } else {
            Vec::new()
        };
        names.extend(own.iter().cloned());
        let issued = ca.issue(who, &names, days)?;
        written.push(save_issued(out, who, &issued)?);
    }
    Ok(written)
}

/// Writes `grant.key` (32 random bytes, hex, 0600) into `dir` unless one is there: the
/// secret apiservers and E2B gateways make sandbox access tokens with when the cluster runs
/// with TLS. Returns whether it wrote one. Errors: `Io`.
pub fn ensure_grant_key(dir: &Path) -> Result<bool, PkiError> {
    let path = dir.join(crate::rpc::grant::GRANT_KEY_FILE);
    if std::fs::symlink_metadata(&path).is_ok() {
        return Ok(false);
    }
    let secret = hex::encode(rand::random::<[u8; 32]>());
    match super::write_new(&path, format!("{secret}\n").as_bytes(), 0o600) {
        Ok(()) => Ok(true),
        Err(PkiError::Exists(_)) => Ok(false),
        Err(e) => Err(e),
    }
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
