//! Connection settings (docs/cli.md) and calls with failover.
//!
//! The connection options `-addr`, `-token`, `-project`, `-ca` and `-deadline` may appear
//! anywhere on the command line (before `--`), so they are taken out before argh parses the
//! command. Options beat the `OPENDSEC_*` variables.

use std::future::Future;
use std::time::{Duration, Instant};

use tonic::transport::Channel;

use super::{values, CtlError};
use crate::pb::d_sec_client::DSecClient;
use crate::rpc;
use crate::types::{names, Failure, Reason};

/// The default time limit of a whole command (docs/cli.md `-deadline`).
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(300);

/// How long one apiserver address gets to accept a connection before the next is tried.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The connection options as given on the command line (`None` = not given).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ConnFlags {
    pub addr: Option<String>,
    pub token: Option<String>,
    pub project: Option<String>,
    pub ca: Option<String>,
    pub deadline: Option<String>,
}

/// Takes the connection options out of normalized arguments (`--addr x`, `--addr=x`; see
/// `cli::flags::normalize`), anywhere before a `--`, and splits any other `--name=value` into
/// `--name value` for argh. Returns the options and what is left for argh.
/// Errors: `Usage` when an option has no value.
pub fn split_flags(args: &[String]) -> Result<(ConnFlags, Vec<String>), CtlError> {
    let mut flags = ConnFlags::default();
    let mut rest = Vec::with_capacity(args.len());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--" {
            rest.push(a.clone());
            rest.extend(it.cloned());
            break;
        }
        let (name, inline) = match a.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n, Some(v.to_string())),
            _ => (a.as_str(), None),
        };
        let slot = match name {
            "--addr" => &mut flags.addr,
            "--token" => &mut flags.token,
            "--project" => &mut flags.project,
            "--ca" => &mut flags.ca,
            "--deadline" => &mut flags.deadline,
            _ => {
                match inline {
                    Some(v) => {
                        rest.push(name.to_string());
                        rest.push(v);
                    }
                    None => rest.push(a.clone()),
                }
                continue;
            }
        };
        let value = match inline {
            Some(v) => v,
            None => it.next().cloned().ok_or_else(|| {
                CtlError::Usage(format!("No value provided for option '{name}'."))
            })?,
        };
        *slot = Some(value);
    }
    Ok((flags, rest))
}

/// Resolved settings: options first, then the environment, then defaults.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Apiserver addresses in the order they are tried; may be empty until a call needs one.
    pub addrs: Vec<String>,
    pub token: String,
    /// Default project (`-project`, `OPENDSEC_PROJECT`, `root`); checked when a call needs it.
    pub project: String,
    pub ca: Option<String>,
    /// Time limit of the whole command; `None` for none (`-deadline 0`).
    pub deadline: Option<Duration>,
    /// Whether `-deadline` was given (exec stretches the default to fit its `-timeout`).
    pub deadline_given: bool,
}

impl Settings {
    /// Resolves `flags` against the environment (`env` looks a variable up; empty counts as
    /// unset). Errors: `invalid` for a bad `-deadline`.
    pub fn resolve(
        flags: &ConnFlags,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Settings, CtlError> {
        let pick = |flag: &Option<String>, var: &str| -> Option<String> {
            flag.clone().or_else(|| env(var)).filter(|v| !v.is_empty())
        };
        let addrs = pick(&flags.addr, "OPENDSEC_ADDR")
            .map(|a| {
                a.split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default();
        let deadline = match &flags.deadline {
            None => Some(DEFAULT_DEADLINE),
            Some(d) => Some(values::duration("deadline", d)?).filter(|d| !d.is_zero()),
        };
        Ok(Settings {
            addrs,
            token: pick(&flags.token, "OPENDSEC_TOKEN").unwrap_or_default(),
            project: pick(&flags.project, "OPENDSEC_PROJECT").unwrap_or_else(|| "root".into()),
            ca: pick(&flags.ca, "OPENDSEC_CA"),
            deadline,
            deadline_given: flags.deadline.is_some(),
        })
    }

    /// Opens (lazily) a client per address, over TLS when `-ca` (`OPENDSEC_CA`) names the
    /// cluster's CA certificate: the server is checked against the address's host, or
    /// `api.opendsec.internal` with several addresses (docs/tls.md "Callers").
    /// Errors: `invalid` without any address, with a bad address or a bad `-project`;
    /// `not_found` / `invalid` for a CA file that is missing or holds no certificate.
    pub fn connect(&self, started: Instant) -> Result<Conn, Failure> {
        if self.addrs.is_empty() {
            return Err(Failure::invalid(
                "no apiserver address: set -addr or OPENDSEC_ADDR",
            ));
        }
        names::check_project_path(&self.project)
            .map_err(|f| Failure::invalid(format!("-project: {}", f.message)))?;
        let ca = match &self.ca {
            None => None,
            Some(path) => Some(read_ca(path)?),
        };
        let mut clients = Vec::with_capacity(self.addrs.len());
        for addr in &self.addrs {
            let bad = |e: &dyn std::error::Error| {
                Failure::invalid(format!("-addr: {e}", e = crate::types::chain(e)))
            };
            let ch = match &ca {
                None => rpc::client::channel(addr, CONNECT_TIMEOUT).map_err(|e| bad(&e))?,
                Some(ca) => {
                    let name = if self.addrs.len() > 1 {
                        crate::pki::API_DNS_NAME.to_string()
                    } else {
                        host_of(addr)
                    };
                    let tls = tonic::transport::ClientTlsConfig::new()
                        .ca_certificate(tonic::transport::Certificate::from_pem(ca))
                        .domain_name(name);
                    rpc::client::endpoint(&rpc::client::https(addr), CONNECT_TIMEOUT)
                        .map_err(|e| bad(&e))?
                        .tls_config(tls)
                        .map_err(|e| bad(&e))?
                        .connect_lazy()
                }
            };
            let c = DSecClient::new(ch)
                .max_decoding_message_size(rpc::MAX_MESSAGE)
                .max_encoding_message_size(rpc::MAX_MESSAGE);
            clients.push((addr.clone(), c));
        }
        Ok(Conn {
            clients,
            token: self.token.clone(),
            project: self.project.clone(),
            deadline_at: self.deadline.and_then(|d| started.checked_add(d)),
        })
    }
}

/// The CA bundle at `path`, checked to hold certificates. Errors: `not_found`, `invalid`.
fn read_ca(path: &str) -> Result<Vec<u8>, Failure> {
    let p = std::path::Path::new(path);
    let pem = std::fs::read(p).map_err(|e| {
        let reason = if e.kind() == std::io::ErrorKind::NotFound {
            crate::types::Reason::NotFound
        } else {
            crate::types::Reason::Invalid
        };
        Failure::new(reason, format!("-ca {path}: {e}"))
    })?;
    crate::rpc::tls::pem_certs(p, &pem)
        .map_err(|e| Failure::invalid(format!("-ca: {}", crate::types::chain(&e))))?;
    Ok(pem)
}

/// The host of `host:port` (brackets of an IPv6 address dropped), the name a single
/// apiserver's certificate is checked against.
fn host_of(addr: &str) -> String {
    let bare = addr
        .strip_prefix("https://")
        .or_else(|| addr.strip_prefix("http://"))
        .unwrap_or(addr);
    let host = match bare.rsplit_once(':') {
        Some((h, _)) => h,
        None => bare,
    };
    host.trim_start_matches('[')
        .trim_end_matches(']')
        .to_string()
}

/// Clients for every configured apiserver, tried in order.
pub struct Conn {
    clients: Vec<(String, DSecClient<Channel>)>,
    token: String,
    /// The default project, checked.
    pub project: String,
    deadline_at: Option<Instant>,
}

impl Conn {
    /// Wraps a message with the bearer token and the time left before the deadline.
    pub fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = if self.token.is_empty() {
            tonic::Request::new(msg)
        } else {
            rpc::client::with_token(msg, &self.token)
        };
        if let Some(at) = self.deadline_at {
            req.set_timeout(
                at.saturating_duration_since(Instant::now())
                    .max(Duration::from_millis(1)),
            );
        }
        req
    }

    /// The first configured apiserver's client, for a call whose request is a stream (which
    /// cannot be sent again to the next address).
    /// Errors: `invalid` when no address is configured.
    pub fn client(&self) -> Result<DSecClient<Channel>, Failure> {
        self.clients
            .first()
            .map(|(_, c)| c.clone())
            .ok_or_else(|| Failure::invalid("no apiserver address (-addr, OPENDSEC_ADDR)"))
    }

    /// Makes one call, trying the next address while the answer is `unavailable`.
    /// `f` gets a client and the wrapped request, e.g.
    /// `conn.call(req, |mut c, r| async move { c.get_sandbox(r).await })`.
    /// Errors: the call's failure (reason from ErrorInfo); when every address is
    /// `unavailable`, one `unavailable` naming each address and why.
    pub async fn call<T, R, F, Fut>(&self, msg: T, f: F) -> Result<R, Failure>
    where
        T: Clone,
        F: Fn(DSecClient<Channel>, tonic::Request<T>) -> Fut,
        Fut: Future<Output = Result<tonic::Response<R>, tonic::Status>>,
    {
        let mut why = Vec::new();
        for (addr, client) in &self.clients {
            match f(client.clone(), self.request(msg.clone())).await {
                Ok(resp) => return Ok(resp.into_inner()),
                Err(status) => {
                    let failure = rpc::failure_from_status(&status);
                    if failure.reason != Reason::Unavailable {
                        return Err(failure);
                    }
                    why.push(format!("{addr}: {}", failure.message));
                }
            }
        }
        Err(Failure::unavailable(why.join("; ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn connection_flags_anywhere_before_dashdash() {
        let args = crate::cli::flags::normalize(&s(&[
            "sandbox",
            "stop",
            "-addr",
            "a:1,b:2",
            "ID",
            "-token=tok",
            "-deadline",
            "30s",
            "--",
            "-project",
            "x",
        ]));
        let (f, rest) = split_flags(&args).unwrap();
        assert_eq!(f.addr.as_deref(), Some("a:1,b:2"));
        assert_eq!(f.token.as_deref(), Some("tok"));
        assert_eq!(f.deadline.as_deref(), Some("30s"));
        assert_eq!(f.project, None);
        assert_eq!(rest, s(&["sandbox", "stop", "ID", "--", "-project", "x"]));
    }

    #[test]
    fn other_inline_values_are_split_for_argh() {
        let args =
            crate::cli::flags::normalize(&s(&["sandbox", "create", "-cpu=2", "-net=pypi,!npm"]));
        let (_, rest) = split_flags(&args).unwrap();
        assert_eq!(
            rest,
            s(&["sandbox", "create", "--cpu", "2", "--net", "pypi,!npm"])
        );
    }

    #[test]
    fn missing_value_is_a_usage_error() {
        let args = crate::cli::flags::normalize(&s(&["whoami", "-addr"]));
        assert!(matches!(split_flags(&args), Err(CtlError::Usage(_))));
    }

    #[test]
    fn options_beat_environment_and_defaults_apply() {
        let env = |k: &str| match k {
            "OPENDSEC_ADDR" => Some("e:1, e:2".to_string()),
            "OPENDSEC_TOKEN" => Some("envtok".to_string()),
            "OPENDSEC_CA" => Some(String::new()),
            _ => None,
        };
        let st = Settings::resolve(
            &ConnFlags {
                token: Some("flagtok".into()),
                ..Default::default()
            },
            env,
        )
        .unwrap();
        assert_eq!(st.addrs, vec!["e:1", "e:2"]);
        assert_eq!(st.token, "flagtok");
        assert_eq!(st.project, "root");
        assert_eq!(st.ca, None);
        assert_eq!(st.deadline, Some(DEFAULT_DEADLINE));
        assert!(!st.deadline_given);
        let st = Settings::resolve(
            &ConnFlags {
                deadline: Some("0".into()),
                ..Default::default()
            },
            |_| None,
        )
        .unwrap();
        assert_eq!(st.deadline, None);
        assert!(Settings::resolve(
            &ConnFlags {
                deadline: Some("soon".into()),
                ..Default::default()
            },
            |_| None
        )
        .is_err());
    }

    #[test]
    fn connect_checks_tls_address_and_project() {
        let base = Settings::resolve(&ConnFlags::default(), |_| None).unwrap();
        let e = base.connect(Instant::now()).err().unwrap();
        assert!(e.message.contains("OPENDSEC_ADDR"), "{}", e.message);
        let tls = Settings {
            ca: Some("/ca.crt".into()),
            addrs: vec!["127.0.0.1:1".into()],
            ..base.clone()
        };
        let e = tls.connect(Instant::now()).err().unwrap();
        assert_eq!(e.reason, Reason::NotFound, "{}", e.message);
        assert!(e.message.contains("-ca /ca.crt"), "{}", e.message);
        let dir = tempfile::tempdir().unwrap();
        let not_pem = dir.path().join("ca.crt");
        std::fs::write(&not_pem, "not a certificate").unwrap();
        let tls = Settings {
            ca: Some(not_pem.display().to_string()),
            ..tls
        };
        let e = tls.connect(Instant::now()).err().unwrap();
        assert_eq!(e.reason, Reason::Invalid, "{}", e.message);
        let proj = Settings {
            project: "team-a".into(),
            addrs: vec!["127.0.0.1:1".into()],
            ..base
        };
        assert_eq!(
            proj.connect(Instant::now()).err().unwrap().reason,
            Reason::Invalid
        );
    }
}
