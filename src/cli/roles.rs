//! Running one role as its own process from the shared config file (docs/configuration.md
//! "Command-line flags of the components"): `opendsec iam|watcher|apiserver|edge -config F`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context};
use argh::FromArgs;

use crate::config::Config;
use crate::shutdown::Shutdown;
use crate::telemetry::Ready;

/// What a server role was started with: the union of the four roles' flags (see
/// [`ReplicaArgs`], [`ApiserverArgs`], [`EdgeArgs`]); a flag a role does not
/// take keeps its default.
#[derive(Debug)]
pub struct RoleFlags {
    pub config: PathBuf,
    pub metrics: String,
    pub log: String,
    pub index: usize,
    pub id: String,
    pub addr: String,
    pub advertise: String,
    pub replica: String,
    pub join: bool,
    pub drain_delay: String,
    pub grace: String,
}

impl RoleFlags {
    fn common(config: PathBuf, metrics: String, log: String, grace: String) -> RoleFlags {
        RoleFlags {
            config,
            metrics,
            log,
            index: 0,
            id: String::new(),
            addr: String::new(),
            advertise: String::new(),
            replica: String::new(),
            join: false,
            drain_delay: String::from("6s"),
            grace,
        }
    }
}

/// One role's command line: the flags every role takes, then `$extra`, so that each role's
/// `-help` lists only what it takes (an `iam -id x` is a usage error, not ignored).
macro_rules! role_args {
    ($name:ident, $what:literal, { $($extra:tt)* }) => {
        #[derive(FromArgs, Debug)]
        #[doc = $what]
        #[doc = " Reads the cluster config (docs/configuration.md). Exit status: 0 after a clean"]
        #[doc = " shutdown (SIGINT or SIGTERM), 1 when the role fails, 2 for a bad command line."]
        #[argh(help_triggers("-h", "--help", "help"))]
        pub struct $name {
            /// the cluster config file (JSON; default /etc/opendsec/opendsec.json)
            #[argh(option, default = "PathBuf::from(\"/etc/opendsec/opendsec.json\")")]
            pub config: PathBuf,
            /// address for /metrics, /healthz and /readyz, e.g. 127.0.0.1:9463 (default: none)
            #[argh(option, default = "String::new()")]
            pub metrics: String,
            /// log level: off, error, warn, info, debug, trace, or directives such as warn,opendsec::roles::watcher=info (default info)
            #[argh(option, default = "String::from(\"info\")")]
            pub log: String,
            /// on shutdown, give calls in flight this long before exiting (default 30s)
            #[argh(option, default = "String::from(\"30s\")")]
            pub grace: String,
            $($extra)*
        }
    };
}

role_args!(IamArgs, "Run IAM (principals, projects, quotas, leases): standalone, or one replica of iam.replicas.", {
    /// which entry of iam.replicas to run, by id (replicated IAM; docs/iam-replicas.md)
    #[argh(option, default = "String::new()")]
    pub replica: String,
    /// a new replica: do not bootstrap; wait until a member adds it (`opendsec ctl iam
    /// member add`), then catch up from the leader
    #[argh(switch)]
    pub join: bool,
});

role_args!(ReplicaArgs, "Run the watcher (edge probes, the cluster snapshot).", {
    /// which entry of `watcher.replicas` to run (required when the config has them)
    #[argh(option, default = "String::new()")]
    pub replica: String,
});

role_args!(ApiserverArgs, "Run an apiserver: the public API.", {
    /// which entry of `apiserver` in the config to run (default 0)
    #[argh(option, default = "0")]
    pub index: usize,
    /// on SIGTERM, fail /readyz and keep serving this long (e.g. 6s) so a load balancer
    /// takes the instance out first (default 6s)
    #[argh(option, default = "String::from(\"6s\")")]
    pub drain_delay: String,
});

role_args!(EdgeArgs, "Run edges: each runs the sandboxes of one node.", {
    /// the edge id(s), comma separated, or `all` (required)
    #[argh(option, default = "String::new()")]
    pub id: String,
    /// listen address overriding the config's (one edge only; default: the config's)
    #[argh(option, default = "String::new()")]
    pub addr: String,
    /// address registered with the watchers (one edge only; default: the config's)
    #[argh(option, default = "String::new()")]
    pub advertise: String,
});

role_args!(E2bArgs, "Run an E2B-compatible gateway (docs/e2b.md).", {
    /// which entry of `e2b.gateways` in the config to run (default 0)
    #[argh(option, default = "0")]
    pub index: usize,
    /// on SIGTERM, fail /readyz and keep serving this long (default 5s)
    #[argh(option, default = "String::from(\"5s\")")]
    pub drain_delay: String,
    /// not taken: the gateway reaches the apiservers over TLS with tls.dir's ca.crt and its
    /// own e2b-<index> certificate (docs/tls.md); refused when set
    #[argh(option, default = "String::new()")]
    pub ca: String,
});

/// Parses `args` as `role`'s flags. Errors: the exit code of a usage error or of `-help`.
fn parse_role(role: &str, args: &[String]) -> Result<RoleFlags, ExitCode> {
    let cmd = format!("opendsec {role}");
    Ok(match role {
        "iam" => {
            let a: IamArgs = super::flags::parse(&cmd, args)?;
            RoleFlags {
                replica: a.replica,
                join: a.join,
                ..RoleFlags::common(a.config, a.metrics, a.log, a.grace)
            }
        }
        "watcher" => {
            let a: ReplicaArgs = super::flags::parse(&cmd, args)?;
            RoleFlags {
                replica: a.replica,
                ..RoleFlags::common(a.config, a.metrics, a.log, a.grace)
            }
        }
        "apiserver" => {
            let a: ApiserverArgs = super::flags::parse(&cmd, args)?;
            RoleFlags {
                index: a.index,
                drain_delay: a.drain_delay,
                ..RoleFlags::common(a.config, a.metrics, a.log, a.grace)
            }
        }
        "e2b" => {
            let a: E2bArgs = super::flags::parse(&cmd, args)?;
            if !a.ca.is_empty() {
                eprintln!(
                    "error: invalid: -ca: the gateway takes ca.crt and its certificate from the config's tls.dir"
                );
                return Err(ExitCode::from(2));
            }
            // The gateway's /readyz is what load balancers check: on by default.
            let metrics = if a.metrics.is_empty() {
                format!("0.0.0.0:{}", crate::config::DEFAULT_E2B_READY_PORT)
            } else {
                a.metrics
            };
            RoleFlags {
                index: a.index,
                drain_delay: a.drain_delay,
                ..RoleFlags::common(a.config, metrics, a.log, a.grace)
            }
        }
        "edge" => {
            let a: EdgeArgs = super::flags::parse(&cmd, args)?;
            RoleFlags {
                id: a.id,
                addr: a.addr,
                advertise: a.advertise,
                ..RoleFlags::common(a.config, a.metrics, a.log, a.grace)
            }
        }
        other => {
            eprintln!("error: invalid: unknown role {other:?}");
            return Err(ExitCode::from(2));
        }
    })
}

/// Parses `6s`, `500ms`, `2m`, `1h` or plain seconds.
pub fn parse_duration(s: &str) -> anyhow::Result<std::time::Duration> {
    let s = s.trim();
    let (num, mult) = if let Some(n) = s.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = s.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = s.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (s, 1.0)
    };
    let v: f64 = num
        .parse()
        .map_err(|_| anyhow!("bad duration {s:?}: use e.g. 6s, 500ms, 2m"))?;
    if !v.is_finite() || v < 0.0 || v * mult > 86400.0 {
        bail!("bad duration {s:?}: must be within 0..24h");
    }
    Ok(std::time::Duration::from_secs_f64(v * mult))
}

/// Entry for `opendsec <role> ...` of a server role.
pub fn main(role: &str, args: &[String]) -> ExitCode {
    let flags = match parse_role(role, args) {
        Ok(f) => f,
        Err(code) => return code,
    };
    if let Err(e) = crate::telemetry::init_logging(&flags.log) {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    if role == "edge" && flags.id.is_empty() {
        // A usage error (exit 2), found before anything is read or started.
        eprintln!("error: invalid: -id is required (an edge id, several comma separated, or all)");
        return ExitCode::from(2);
    }
    super::flags::block_on(run(role, flags))
}

async fn bind(addr: &str, what: &str) -> anyhow::Result<tokio::net::TcpListener> {
    if addr.is_empty() {
        bail!("{what}: no listen address in the config");
    }
    tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("{what}: binding {addr}"))
}

async fn run(role: &str, flags: RoleFlags) -> anyhow::Result<()> {
    // Reading and parsing errors name the file already; an invalid value does not.
    let mut cfg = Config::load(&flags.config).map_err(|e| match e {
        crate::config::ConfigError::Invalid(_) => {
            anyhow::Error::new(e).context(format!("config {}", flags.config.display()))
        }
        e => anyhow::Error::new(e),
    })?;
    if role == "watcher" {
        if cfg.watcher.replicas.is_empty() && !flags.replica.is_empty() {
            bail!(
                "-replica {}: the config has no watcher.replicas",
                flags.replica
            );
        }
        if !cfg.watcher.replicas.is_empty() && cfg.watcher.replica(&flags.replica).is_none() {
            if flags.replica.is_empty() {
                bail!("the config has watcher.replicas: choose one with -replica ID");
            }
            bail!("-replica {}: not an id of watcher.replicas", flags.replica);
        }
    }
    if role == "iam" && cfg.iam.replicas.is_empty() != flags.replica.is_empty() {
        if flags.replica.is_empty() {
            bail!("the config has iam.replicas: choose one with -replica ID");
        }
        bail!("-replica {}: the config has no iam.replicas", flags.replica);
    }
    if flags.join && flags.replica.is_empty() {
        bail!("-join is for a new replica: give -replica ID too");
    }
    let shutdown = Shutdown::new();
    let ready = Ready::default();
    let drain_delay = parse_duration(&flags.drain_delay)?;
    let grace = parse_duration(&flags.grace)?;
    if role == "apiserver" || role == "e2b" {
        // Fail readiness first and keep serving, so the load balancer moves traffic away
        // before the listener closes.
        let signals = Shutdown::new();
        signals.fire_on_signals();
        let name: &'static str = if role == "e2b" { "e2b" } else { "apiserver" };
        let (sd, r) = (shutdown.clone(), ready.clone());
        tokio::spawn(async move {
            signals.wait().await;
            r.drain(name);
            tracing::info!(
                delay_s = drain_delay.as_secs_f64(),
                "draining: /readyz fails, still serving"
            );
            tokio::time::sleep(drain_delay).await;
            sd.fire();
        });
    } else {
        shutdown.fire_on_signals();
    }
    if !flags.metrics.is_empty() {
        let l = bind(&flags.metrics, "metrics").await?;
        tokio::spawn(crate::telemetry::serve_health(
            l,
            ready.clone(),
            shutdown.clone(),
        ));
    }
    let mut handles = Vec::new();
    match role {
        "iam" if !flags.replica.is_empty() => {
            let r = cfg.iam.replica(&flags.replica).cloned().ok_or_else(|| {
                anyhow!(
                    "-replica {}: iam.replicas has no replica with that id",
                    flags.replica
                )
            })?;
            let listeners = crate::roles::iam::replicated::Listeners {
                api: bind(&r.addr, "iam.replicas[].addr").await?,
                raft: bind(&r.raft_addr, "iam.replicas[].raft_addr").await?,
            };
            handles.push(
                crate::roles::iam::replicated::start(
                    Arc::new(cfg),
                    &flags.replica,
                    flags.join,
                    listeners,
                    shutdown.clone(),
                    ready,
                )
                .await?,
            );
        }
        "iam" => {
            let l = bind(&cfg.iam.addr, "iam.addr").await?;
            handles
                .push(crate::roles::iam::start(Arc::new(cfg), l, shutdown.clone(), ready).await?);
        }
        "watcher" => {
            let (id, addr, field) = match cfg.watcher.replica(&flags.replica) {
                Some(r) => (r.id.clone(), r.addr.clone(), "watcher.replicas[].addr"),
                None => (
                    crate::roles::watcher::WATCHER_ID.to_string(),
                    cfg.watcher.addr.clone(),
                    "watcher.addr",
                ),
            };
            let l = bind(&addr, field).await?;
            handles.push(
                crate::roles::watcher::start(Arc::new(cfg), &id, l, shutdown.clone(), ready)
                    .await?,
            );
        }
        "apiserver" => {
            let _ = &ready;
            let entry = cfg.apiserver.get(flags.index).ok_or_else(|| {
                anyhow!(
                    "-index {}: the config has {} apiserver entries",
                    flags.index,
                    cfg.apiserver.len()
                )
            })?;
            let l = bind(&entry.addr, "apiserver.addr").await?;
            handles.push(
                crate::roles::apiserver::start(
                    Arc::new(cfg),
                    flags.index,
                    l,
                    shutdown.clone(),
                    ready,
                )
                .await?,
            );
        }
        "e2b" => {
            let entry = cfg.e2b.gateways.get(flags.index).ok_or_else(|| {
                anyhow!(
                    "-index {}: the config has {} e2b.gateways entries",
                    flags.index,
                    cfg.e2b.gateways.len()
                )
            })?;
            let l = bind(&entry.addr, "e2b.gateways[].addr").await?;
            handles.push(
                crate::roles::e2b::start(Arc::new(cfg), flags.index, l, shutdown.clone(), ready)
                    .await?,
            );
        }
        "edge" => {
            let ids: Vec<String> = if flags.id == "all" {
                cfg.edges.iter().map(|e| e.id.clone()).collect()
            } else {
                flags
                    .id
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect()
            };
            if ids.is_empty() {
                bail!("-id is required (an edge id, several comma separated, or all)");
            }
            if ids.len() > 1 && (!flags.addr.is_empty() || !flags.advertise.is_empty()) {
                bail!("-addr and -advertise apply to one edge only");
            }
            let mut listeners = Vec::new();
            for id in &ids {
                let mut e = cfg
                    .edge(id)
                    .ok_or_else(|| anyhow!("no edge {id:?} in the config and no edge_template"))?;
                if !flags.addr.is_empty() {
                    e.addr = flags.addr.clone();
                }
                if !flags.advertise.is_empty() {
                    e.advertise = flags.advertise.clone();
                }
                e.validate()?;
                listeners.push((id.clone(), bind(&e.addr, &format!("edge {id}")).await?));
                match cfg.edges.iter_mut().find(|x| &x.id == id) {
                    Some(x) => *x = e,
                    None => cfg.edges.push(e),
                }
            }
            let cfg = Arc::new(cfg);
            for (id, l) in listeners {
                handles.push(
                    crate::roles::edge::start(cfg.clone(), id, l, shutdown.clone(), ready.clone())
                        .await?,
                );
            }
        }
        other => bail!("unknown role {other:?}"),
    }
    tracing::info!(role, "started");
    shutdown.wait().await;
    // Calls in flight get `grace` to finish; then the process exits regardless.
    let all = futures::future::join_all(handles);
    if tokio::time::timeout(grace, all).await.is_err() {
        tracing::warn!(
            grace_s = grace.as_secs_f64(),
            "calls still in flight after the grace period; exiting"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(
            parse_duration("6s").unwrap(),
            std::time::Duration::from_secs(6)
        );
        assert_eq!(
            parse_duration("500ms").unwrap(),
            std::time::Duration::from_millis(500)
        );
        assert_eq!(
            parse_duration("2m").unwrap(),
            std::time::Duration::from_secs(120)
        );
        assert_eq!(
            parse_duration("1.5").unwrap(),
            std::time::Duration::from_millis(1500)
        );
        for bad in ["", "x", "-1s", "25h", "NaNs"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
    }
}
