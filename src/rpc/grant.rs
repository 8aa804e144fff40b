//! Sandbox access tokens (docs/e2b.md "Access tokens and signed URLs"): a bearer token that
//! lets its holder run commands, file calls, watches and port connections in one sandbox,
//! and nothing else. It is what E2B's SDKs call a sandbox's `envdAccessToken`: the gateway
//! hands it out on create and connect, the SDKs send it as `X-Access-Token` and sign file
//! URLs with it, and the apiserver checks it without asking IAM.
//!
//! The token is `dsg.<sandbox id>.<mac>`, the MAC an HMAC-SHA256 of the sandbox id under a
//! key derived from the cluster's `service_token` (or, with TLS, from `tls.dir/grant.key`):
//! every role that reads the config can check one, none can be forged without the secret, and changing the secret voids them
//! all. A token is good for as long as its sandbox id names a sandbox.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The prefix that tells a sandbox access token from an IAM token (`dsk.`).
pub const PREFIX: &str = "dsg.";

/// The file in `tls.dir` holding the secret sandbox access tokens are made with when the
/// cluster runs with TLS (and has no `service_token`).
pub const GRANT_KEY_FILE: &str = "grant.key";

/// The key sandbox access tokens are made with.
#[derive(Clone)]
pub struct GrantKey([u8; 32]);

impl std::fmt::Debug for GrantKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("GrantKey(..)")
    }
}

type HmacSha256 = Hmac<Sha256>;

fn mac_of(key: &[u8], parts: &[&[u8]]) -> HmacSha256 {
    // HMAC takes keys of any length; new_from_slice cannot fail for it.
    let mut m = <HmacSha256 as Mac>::new_from_slice(key).unwrap_or_else(|_| unreachable!());
    for p in parts {
        m.update(p);
    }
    m
}

impl GrantKey {
    /// The key derived from the cluster's `service_token` (a separate label, so the token
    /// itself never serves as a MAC key). `None` without one.
    pub fn from_service_token(service_token: &str) -> Option<GrantKey> {
        if service_token.is_empty() {
            return None;
        }
        let m = mac_of(
            service_token.as_bytes(),
            &[b"opendsec sandbox access token v1"],
        );
        Some(GrantKey(m.finalize().into_bytes().into()))
    }

    /// The key of a cluster's config: from its `service_token` without TLS, else from the
    /// secret in `tls.dir/grant.key` that `ctl pki init` writes (docs/tls.md "Files").
    /// `None` when there is neither: sandbox access tokens are then off. Errors: the file
    /// exists but cannot be read, or holds less than 32 bytes.
    pub fn for_config(cfg: &crate::config::Config) -> Result<Option<GrantKey>, std::io::Error> {
        if !cfg.service_token.is_empty() || cfg.tls.dir.is_empty() {
            return Ok(GrantKey::from_service_token(&cfg.service_token));
        }
        let path = std::path::Path::new(&cfg.tls.dir).join(GRANT_KEY_FILE);
        let secret = match std::fs::read(&path) {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e),
        };
        let secret = secret.trim_ascii();
        if secret.len() < 32 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{} holds less than 32 bytes", path.display()),
            ));
        }
        let m = mac_of(secret, &[b"opendsec sandbox access token v1 (grant.key)"]);
        Ok(Some(GrantKey(m.finalize().into_bytes().into())))
    }

    fn mac(&self, sandbox_id: &str) -> HmacSha256 {
        mac_of(&self.0, &[b"sandbox:", sandbox_id.as_bytes()])
    }

    /// The access token of `sandbox_id`.
    pub fn mint(&self, sandbox_id: &str) -> String {
        use base64::Engine;
        let tag = self.mac(sandbox_id).finalize().into_bytes();
        format!(
            "{PREFIX}{sandbox_id}.{}",
            base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(tag)
        )
    }

    /// The sandbox `token` is for, when it is one of ours and its MAC holds (compared in
    /// constant time). `None` for anything else.
    pub fn check<'t>(&self, token: &'t str) -> Option<&'t str> {
        use base64::Engine;
        let rest = token.strip_prefix(PREFIX)?;
        let (id, tag) = rest.rsplit_once('.')?;
        if id.is_empty() || id.len() > 200 {
            return None;
        }
        let tag = base64::engine::general_purpose::URL_SAFE_NO_PAD
            .decode(tag)
            .ok()?;
        self.mac(id).verify_slice(&tag).ok()?;
        Some(id)
    }
}

/// Whether `token` has the shape of a sandbox access token (whether or not it holds).
pub fn is_grant(token: &str) -> bool {
    token.starts_with(PREFIX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_token_names_its_sandbox_and_nothing_else_passes() {
        let k = GrantKey::from_service_token("secret").expect("key");
        let t = k.mint("edge-1.0123456789abcdef");
        assert!(is_grant(&t));
        assert_eq!(k.check(&t), Some("edge-1.0123456789abcdef"));
        // Another sandbox's id with this MAC, another key, a changed MAC, garbage.
        let other = t.replace("0123456789abcdef", "0123456789abcdee");
        assert_eq!(k.check(&other), None);
        let k2 = GrantKey::from_service_token("other").expect("key");
        assert_eq!(k2.check(&t), None);
        let mut bad = t.clone();
        bad.pop();
        bad.push(if t.ends_with('A') { 'B' } else { 'A' });
        assert_eq!(k.check(&bad), None);
        for junk in [
            "",
            "dsg.",
            "dsg..",
            "dsg.x",
            "dsg.x.",
            "dsk.a.b.c",
            "dsg.x.!!!",
        ] {
            assert_eq!(k.check(junk), None, "{junk:?}");
        }
        assert!(GrantKey::from_service_token("").is_none());
        assert_eq!(format!("{k:?}"), "GrantKey(..)");
    }
}
