//! Token material (docs/concepts.md): issuing `dsk.<principal>.<id>.<secret>` tokens and hashing
//! secrets. Only the proposer calls the random parts; `apply` sees ids and hashes only.

use rand::distr::{Alphanumeric, SampleString};
use sha2::{Digest, Sha256};

use super::command::NewToken;
use crate::types::names;

/// Characters of a token id and of a secret.
const ID_LEN: usize = 12;
const SECRET_LEN: usize = 40;

/// Lowercase hex SHA-256 of a token secret: what the state keeps instead of the secret.
pub fn hash_secret(secret: &str) -> String {
    hex::encode(Sha256::digest(secret.as_bytes()))
}

/// Issues a fresh token for `principal`: returns the full token (shown once to the caller)
/// and the id and hash that go into the command.
pub fn issue(principal: &str) -> (String, NewToken) {
    let mut rng = rand::rng();
    let id = format!(
        "t{}",
        Alphanumeric.sample_string(&mut rng, ID_LEN).to_lowercase()
    );
    let secret = Alphanumeric.sample_string(&mut rng, SECRET_LEN);
    let token = format!("dsk.{principal}.{id}.{secret}");
    (
        token,
        NewToken {
            hash: hash_secret(&secret),
            id,
        },
    )
}

/// The id and hash of a configured token (the bootstrap admin token), checked to belong to
/// `principal`. Errors name the problem; placeholders holding `change-me` are refused.
pub fn configured(principal: &str, token: &str) -> Result<NewToken, String> {
    if token.contains("change-me") {
        return Err(
            "the admin token still holds the placeholder \"change-me\"; set a real secret".into(),
        );
    }
    let parts = names::parse_token(token).map_err(|e| e.message)?;
    if parts.principal != principal {
        return Err(format!(
            "the admin token belongs to {:?}, not to admin_id {principal:?}",
            parts.principal
        ));
    }
    Ok(NewToken {
        id: parts.id.to_string(),
        hash: hash_secret(parts.secret),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn issued_tokens_parse_back_to_their_hash() {
        let (tok, nt) = issue("trainer");
        let p = names::parse_token(&tok).unwrap();
        assert_eq!(p.principal, "trainer");
        assert_eq!(p.id, nt.id);
        assert_eq!(hash_secret(p.secret), nt.hash);
        assert_ne!(issue("trainer").1, nt);
    }

    #[test]
    fn configured_admin_tokens() {
        let nt = configured("admin", "dsk.admin.s3cret").unwrap();
        assert_eq!(nt.id, "primary");
        assert_eq!(nt.hash, hash_secret("s3cret"));
        assert_eq!(configured("admin", "dsk.admin.t1.s3cret").unwrap().id, "t1");
        assert!(configured("admin", "dsk.admin.change-me").is_err());
        assert!(configured("admin", "dsk.bob.x").is_err());
        assert!(configured("admin", "garbage").is_err());
    }
}
