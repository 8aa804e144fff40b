//! Registry credentials for `image import` (docs/images.md "Import from a registry"): what
//! `docker login` (or `podman login`) saved, in the docker credentials format
//! (`{"auths": {"host": {"auth": base64("user:password")}}}`), including the credential
//! helpers it names (`credsStore`, `credHelpers`: `docker-credential-<name> get`).
//! The files are read in the order [`default_files`] gives; the first one with an entry for
//! the registry wins.

use std::collections::HashMap;
use std::fmt;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use base64::Engine;
use serde::Deserialize;

use crate::types::Failure;

/// How to authenticate to a registry.
#[derive(Clone, PartialEq, Eq, Default)]
pub enum Credentials {
    /// No credentials: the registry's anonymous access (and its token service's).
    #[default]
    Anonymous,
    /// HTTP Basic credentials, also what a bearer token service is asked with.
    Basic { username: String, password: String },
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Credentials::Anonymous => write!(f, "Anonymous"),
            Credentials::Basic { username, .. } => write!(f, "Basic({username}, <redacted>)"),
        }
    }
}

/// Why credentials could not be read (`invalid`: the file or helper is broken).
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("credentials file {file}: {why}")]
    BadFile { file: String, why: String },
    #[error("credential helper docker-credential-{helper}: {why}")]
    Helper { helper: String, why: String },
}

impl AuthError {
    /// The caller-facing failure.
    pub fn to_failure(&self) -> Failure {
        Failure::invalid(self.to_string())
    }
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct ConfigFile {
    #[serde(default)]
    auths: HashMap<String, Entry>,
    #[serde(default)]
    creds_store: Option<String>,
    #[serde(default)]
    cred_helpers: HashMap<String, String>,
}

#[derive(Deserialize, Default)]
struct Entry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
}

/// The credentials files, in the order they are consulted: `-registry-auth FILE` (when
/// given), `$REGISTRY_AUTH_FILE`, `$DOCKER_CONFIG/config.json`, `~/.docker/config.json`
/// (docs/cli.md "image import").
pub fn default_files(flag: Option<&str>, env: &dyn Fn(&str) -> Option<String>) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let set = |k: &str| env(k).filter(|v| !v.is_empty());
    if let Some(f) = flag {
        files.push(PathBuf::from(f));
    }
    if let Some(f) = set("REGISTRY_AUTH_FILE") {
        files.push(PathBuf::from(f));
    }
    if let Some(d) = set("DOCKER_CONFIG") {
        files.push(Path::new(&d).join("config.json"));
    }
    if let Some(h) = set("HOME") {
        files.push(Path::new(&h).join(".docker/config.json"));
    }
    files
}

/// The key a registry host has in a credentials file: Docker Hub's is its v1 index URL.
fn key_host(key: &str) -> &str {
    let k = key
        .strip_prefix("https://")
        .or_else(|| key.strip_prefix("http://"))
        .unwrap_or(key);
    let host = k.split('/').next().unwrap_or(k);
    match host {
        "docker.io" | "index.docker.io" | "registry-1.docker.io" => "docker.io",
        h => h,
    }
}

/// The credentials for `registry` (`docker.io`, `host:5000`) and `repository` found in
/// `files` (missing files are skipped), with the file they came from; `None` when no file
/// names the registry. An entry for `host/namespace` (podman's form) is preferred to the
/// host's when the repository is under it. Errors: [`AuthError`] for a file that is not
/// valid JSON or an entry that does not decode, and for a helper that fails.
pub fn lookup(
    files: &[PathBuf],
    registry: &str,
    repository: &str,
) -> Result<Option<(Credentials, PathBuf)>, AuthError> {
    let host = key_host(registry);
    for file in files {
        let body = match std::fs::read(file) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => {
                return Err(AuthError::BadFile {
                    file: file.display().to_string(),
                    why: e.to_string(),
                })
            }
        };
        let bad = |why: String| AuthError::BadFile {
            file: file.display().to_string(),
            why,
        };
        let cfg: ConfigFile =
            serde_json::from_slice(&body).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        if let Some(c) = from_auths(&cfg.auths, host, repository).map_err(bad)? {
            return Ok(Some((c, file.clone())));
        }
        let helper = cfg
            .cred_helpers
            .iter()
            .find(|(k, _)| key_host(k) == host)
            .map(|(_, h)| h.clone())
            .or(cfg.creds_store.clone());
        if let Some(h) = helper {
            if let Some(c) = from_helper(&h, registry)? {
                return Ok(Some((c, file.clone())));
            }
        }
    }
    Ok(None)
}

/// The best `auths` entry for the host: the longest `host/prefix` the repository is under,
/// else the host's own.
fn from_auths(
    auths: &HashMap<String, Entry>,
    host: &str,
    repository: &str,
) -> Result<Option<Credentials>, String> {
    let mut best: Option<(usize, &String, &Entry)> = None;
    for (key, e) in auths {
        if key_host(key) != host {
            continue;
        }
        let k = key
            .strip_prefix("https://")
            .or_else(|| key.strip_prefix("http://"))
            .unwrap_or(key);
        let path = k
            .split_once('/')
            .map_or("", |(_, p)| p.trim_end_matches('/'));
        // Docker Hub's key is `https://index.docker.io/v1/`: its path is no namespace.
        let path = if path == "v1" || path == "v2" {
            ""
        } else {
            path
        };
        let under =
            path.is_empty() || repository == path || repository.starts_with(&format!("{path}/"));
        if under && best.is_none_or(|(len, _, _)| path.len() > len) {
            best = Some((path.len(), key, e));
        }
    }
    let Some((_, key, e)) = best else {
        return Ok(None);
    };
    if let (Some(u), Some(p)) = (&e.username, &e.password) {
        return Ok(Some(Credentials::Basic {
            username: u.clone(),
            password: p.clone(),
        }));
    }
    let Some(auth) = e.auth.as_deref().filter(|a| !a.is_empty()) else {
        return Ok(None);
    };
    let raw = base64::engine::general_purpose::STANDARD
        .decode(auth.trim())
        .map_err(|e| format!("{key}: auth is not base64: {e}"))?;
    let text = String::from_utf8(raw).map_err(|_| format!("{key}: auth is not UTF-8"))?;
    let (u, p) = text
        .split_once(':')
        .ok_or_else(|| format!("{key}: auth is not user:password"))?;
    Ok(Some(Credentials::Basic {
        username: u.to_string(),
        password: p.to_string(),
    }))
}

/// Asks `docker-credential-<helper> get` (the docker credential helper protocol: the
/// server on stdin, `{"Username","Secret"}` on stdout). A helper that has none for the
/// server (its "credentials not found in native keychain") gives `None`.
fn from_helper(helper: &str, registry: &str) -> Result<Option<Credentials>, AuthError> {
    let fail = |why: String| AuthError::Helper {
        helper: helper.to_string(),
        why,
    };
    if helper.is_empty()
        || !helper
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
    {
        return Err(fail("not a helper name".into()));
    }
    let server = if key_host(registry) == "docker.io" {
        "https://index.docker.io/v1/"
    } else {
        registry
    };
    let mut child = Command::new(format!("docker-credential-{helper}"))
        .arg("get")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| fail(e.to_string()))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin
            .write_all(server.as_bytes())
            .map_err(|e| fail(e.to_string()))?;
    }
    let out = child.wait_with_output().map_err(|e| fail(e.to_string()))?;
    if !out.status.success() {
        if String::from_utf8_lossy(&out.stdout).contains("credentials not found") {
            return Ok(None);
        }
        return Err(fail(format!("get failed ({})", out.status)));
    }
    #[derive(Deserialize)]
    #[serde(rename_all = "PascalCase")]
    struct Reply {
        username: String,
        secret: String,
    }
    let r: Reply =
        serde_json::from_slice(&out.stdout).map_err(|e| fail(format!("its reply: {e}")))?;
    Ok(Some(Credentials::Basic {
        username: r.username,
        password: r.secret,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn basic(u: &str, p: &str) -> Credentials {
        Credentials::Basic {
            username: u.into(),
            password: p.into(),
        }
    }

    #[test]
    fn saved_logins_are_found_by_host_docker_hub_and_namespace_in_file_order() {
        let d = tempfile::tempdir().unwrap();
        let b64 = |s: &str| base64::engine::general_purpose::STANDARD.encode(s);
        let first = d.path().join("auth.json");
        std::fs::write(
            &first,
            serde_json::json!({"auths": {
                "reg.local:5000/team": {"auth": b64("team:t0ken")},
                "reg.local:5000": {"auth": b64("any:pw:with:colons")},
            }})
            .to_string(),
        )
        .unwrap();
        let second = d.path().join("config.json");
        std::fs::write(
            &second,
            serde_json::json!({"auths": {
                "https://index.docker.io/v1/": {"auth": b64("hubuser:hubpw")},
                "reg.local:5000": {"auth": b64("never:used")},
                "http://other:80/": {"username": "u", "password": "p"},
            }})
            .to_string(),
        )
        .unwrap();
        let files = [d.path().join("missing.json"), first.clone(), second.clone()];
        let got = |reg: &str, repo: &str| lookup(&files, reg, repo).unwrap();
        assert_eq!(
            got("reg.local:5000", "team/app"),
            Some((basic("team", "t0ken"), first.clone()))
        );
        assert_eq!(
            got("reg.local:5000", "teamx/app"),
            Some((basic("any", "pw:with:colons"), first.clone()))
        );
        assert_eq!(
            got("docker.io", "library/python"),
            Some((basic("hubuser", "hubpw"), second.clone()))
        );
        assert_eq!(
            got("other:80", "x"),
            Some((basic("u", "p"), second.clone()))
        );
        assert_eq!(got("nowhere:1", "x"), None);
        assert_eq!(
            format!("{:?}", basic("u", "secret")),
            "Basic(u, <redacted>)"
        );

        std::fs::write(&first, b"{not json").unwrap();
        let e = lookup(&files, "reg.local:5000", "a").unwrap_err();
        assert!(e.to_string().contains("auth.json"), "{e}");
        std::fs::write(&first, r#"{"auths": {"reg.local:5000": {"auth": "%%%"}}}"#).unwrap();
        let e = lookup(&files, "reg.local:5000", "a").unwrap_err();
        assert!(e.to_string().contains("base64"), "{e}");
    }

    #[test]
    fn the_files_come_from_the_flag_then_the_environment() {
        let env = |k: &str| match k {
            "REGISTRY_AUTH_FILE" => Some("/r/auth.json".to_string()),
            "DOCKER_CONFIG" => Some("/d".to_string()),
            "HOME" => Some("/home/u".to_string()),
            _ => None,
        };
        assert_eq!(
            default_files(Some("/f.json"), &env),
            [
                PathBuf::from("/f.json"),
                PathBuf::from("/r/auth.json"),
                PathBuf::from("/d/config.json"),
                PathBuf::from("/home/u/.docker/config.json")
            ]
        );
        assert!(default_files(None, &|_| None).is_empty());
    }

    #[test]
    fn a_helper_name_cannot_be_a_path() {
        assert!(from_helper("../../bin/sh", "reg").is_err());
    }
}
