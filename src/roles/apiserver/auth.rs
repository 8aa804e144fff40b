//! The apiserver's authentication and authorization caches (docs/architecture.md): results are
//! kept per token and client address 30 s (never past the token's own expiry), and dropped whenever IAM's security epoch
//! moves, which a background task checks every second — so a revocation bites within ~1 s.
//! A refusal is kept only 1 s: a grant does not move the epoch (it would empty every
//! apiserver's caches for a change that takes nothing away), so this is what makes a grant
//! take effect within about a second as well.

use std::collections::HashMap;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant};

use crate::rpc::failover::IamChannel;
use sha2::{Digest, Sha256};

use crate::pb;
use crate::pb::iam_client::IamClient;
use crate::rpc::grant::{self, GrantKey};
use crate::rpc::{client, failure_from_status};
use crate::shutdown::Shutdown;
use crate::types::{now_s, Failure};

const TTL: Duration = Duration::from_secs(30);
/// How long a refused permission is remembered (see the module comment).
const DENY_TTL: Duration = Duration::from_secs(1);

/// An authenticated caller.
#[derive(Debug, Clone)]
pub struct Caller {
    pub principal: String,
    /// The principal's own project (`whoami`).
    #[allow(dead_code)]
    pub project: String,
    pub token: String,
    pub client_addr: String,
    /// For a sandbox access token (`dsg.`, docs/e2b.md "Access tokens and signed URLs"): the
    /// one sandbox it may act on, and then only by runtime calls and `GetSandbox`.
    pub grant: Option<String>,
}

#[derive(Clone)]
struct TokenEntry {
    principal: String,
    project: String,
    expires_at: i64,
    at: Instant,
}

/// (principal, project, permission).
type AuthzKey = (String, String, String);

/// Caches over IAM's Authenticate and Authorize.
pub struct AuthCache {
    iam: IamClient<IamChannel>,
    service_token: String,
    /// Checks sandbox access tokens; none without a `service_token`.
    grants: Option<GrantKey>,
    tokens: RwLock<HashMap<[u8; 32], TokenEntry>>,
    authz: RwLock<HashMap<AuthzKey, (bool, Instant)>>,
    epoch: AtomicU64,
    /// Unix seconds of IAM's last answer (readiness).
    pub last_iam_ok: AtomicI64,
}

/// A cached authentication holds for the address it was made from only: IAM's failed-
/// authentication limit answers a locked-out address alike for every token, and a result
/// cached for another address would tell a guesser there which of its tokens is real.
fn key_of(token: &str, client_addr: &str) -> [u8; 32] {
    Sha256::new()
        .chain_update(token.as_bytes())
        .chain_update([0])
        .chain_update(client_addr.as_bytes())
        .finalize()
        .into()
}

impl AuthCache {
    /// A cache over `iam`; `grants` checks sandbox access tokens (none: they are refused).
    pub fn new(
        iam: IamClient<IamChannel>,
        service_token: String,
        grants: Option<GrantKey>,
    ) -> AuthCache {
        AuthCache {
            iam,
            grants,
            service_token,
            tokens: RwLock::new(HashMap::new()),
            authz: RwLock::new(HashMap::new()),
            epoch: AtomicU64::new(0),
            last_iam_ok: AtomicI64::new(0),
        }
    }

    fn note_epoch(&self, epoch: u64) {
        let old = self.epoch.swap(epoch, Ordering::SeqCst);
        if old != epoch {
            self.clear();
        }
    }

    /// Drops every cached result.
    pub fn clear(&self) {
        self.tokens
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.authz
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// The address a call's token came from, for IAM's failed-authentication limit and the
    /// audit log: the client address a component (the E2B gateway) forwarded on a caller's
    /// behalf when the call carries the component secret (with TLS: comes with a gateway's
    /// certificate), else the peer's IP. Without it
    /// every caller of a gateway would share the gateway's address, so one caller's bad
    /// tokens would lock all of them out.
    pub fn client_addr<T>(&self, req: &tonic::Request<T>) -> String {
        let component = match crate::rpc::acl::caller(req) {
            Some(who) => who.role == crate::pki::Role::E2b,
            None => {
                !self.service_token.is_empty()
                    && crate::rpc::check_service_token(req, &self.service_token).is_ok()
            }
        };
        if component {
            crate::rpc::peer_addr(req)
        } else {
            req.remote_addr()
                .map(|a| a.ip().to_string())
                .unwrap_or_default()
        }
    }

    /// Token → caller. A sandbox access token is checked here, without IAM ([`GrantKey`]).
    /// Errors: `unauthenticated` (bad, expired, revoked), `rate_limited` (address locked out
    /// after failures), `unavailable` (IAM unreachable).
    pub async fn authenticate(&self, token: &str, client_addr: &str) -> Result<Caller, Failure> {
        if token.is_empty() {
            return Err(Failure::unauthenticated(
                "no token: send authorization: Bearer dsk.<principal>.<id>.<secret>",
            ));
        }
        if grant::is_grant(token) {
            let id = self
                .grants
                .as_ref()
                .and_then(|k| k.check(token))
                .ok_or_else(|| {
                    Failure::unauthenticated(
                        "not a valid sandbox access token (or the cluster's service_token changed)",
                    )
                })?;
            return Ok(Caller {
                principal: format!("sandbox-token:{id}"),
                project: String::new(),
                token: token.to_string(),
                client_addr: client_addr.to_string(),
                grant: Some(id.to_string()),
            });
        }
        let k = key_of(token, client_addr);
        if let Some(e) = self
            .tokens
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&k)
        {
            if e.at.elapsed() < TTL && (e.expires_at == 0 || e.expires_at > now_s()) {
                return Ok(Caller {
                    principal: e.principal.clone(),
                    project: e.project.clone(),
                    token: token.to_string(),
                    client_addr: client_addr.to_string(),
                    grant: None,
                });
            }
        }
        let req = client::internal(
            pb::AuthenticateRequest {
                token: token.to_string(),
                client_addr: client_addr.to_string(),
            },
            &self.service_token,
        );
        let r = self
            .iam
            .clone()
            .authenticate(req)
            .await
            .map_err(|s| failure_from_status(&s))?
            .into_inner();
        self.last_iam_ok.store(now_s(), Ordering::Relaxed);
        self.note_epoch(r.epoch);
        let mut m = self.tokens.write().unwrap_or_else(|p| p.into_inner());
        if m.len() > 200_000 {
            m.clear();
        }
        m.insert(
            k,
            TokenEntry {
                principal: r.principal.clone(),
                project: r.project.clone(),
                expires_at: r.expires_at,
                at: Instant::now(),
            },
        );
        Ok(Caller {
            principal: r.principal,
            project: r.project,
            token: token.to_string(),
            client_addr: client_addr.to_string(),
            grant: None,
        })
    }

    /// Checks `perm` for the caller on `project`; a sandbox access token holds no
    /// permission. Errors: `forbidden` naming the permission and project, `unavailable`.
    pub async fn authorize(
        &self,
        caller: &Caller,
        project: &str,
        perm: &str,
    ) -> Result<(), Failure> {
        if caller.grant.is_some() {
            return Err(grant_only());
        }
        let k = (
            caller.principal.clone(),
            project.to_string(),
            perm.to_string(),
        );
        if let Some((ok, at)) = self.authz.read().unwrap_or_else(|p| p.into_inner()).get(&k) {
            if at.elapsed() < if *ok { TTL } else { DENY_TTL } {
                return if *ok {
                    Ok(())
                } else {
                    Err(forbidden(caller, project, perm))
                };
            }
        }
        let req = client::internal(
            pb::AuthorizeRequest {
                principal: caller.principal.clone(),
                project: project.to_string(),
                permission: perm.to_string(),
            },
            &self.service_token,
        );
        let r = self
            .iam
            .clone()
            .authorize(req)
            .await
            .map_err(|s| failure_from_status(&s))?
            .into_inner();
        self.last_iam_ok.store(now_s(), Ordering::Relaxed);
        self.note_epoch(r.epoch);
        let mut m = self.authz.write().unwrap_or_else(|p| p.into_inner());
        if m.len() > 200_000 {
            m.clear();
        }
        m.insert(k, (r.allowed, Instant::now()));
        if r.allowed {
            Ok(())
        } else {
            Err(forbidden(caller, project, perm))
        }
    }

    /// Polls IAM's epoch every second; a change clears the caches.
    pub async fn epoch_loop(self: Arc<Self>, shutdown: Shutdown) {
        loop {
            let req = client::internal(pb::Empty {}, &self.service_token);
            match tokio::time::timeout(Duration::from_secs(2), self.iam.clone().get_epoch(req))
                .await
            {
                Ok(Ok(r)) => {
                    self.last_iam_ok.store(now_s(), Ordering::Relaxed);
                    self.note_epoch(r.into_inner().epoch);
                }
                Ok(Err(s)) => tracing::debug!(error = %s.message(), "IAM epoch check failed"),
                Err(_) => tracing::debug!("IAM epoch check timed out"),
            }
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_secs(1)) => {},
                _ = shutdown.wait() => return,
            }
        }
    }
}

/// What a sandbox access token is refused with outside what it may do.
pub fn grant_only() -> Failure {
    Failure::forbidden(
        "a sandbox access token runs commands, file calls, watches and port connections in its \
         own sandbox, and nothing else: use an API token",
    )
}

fn forbidden(c: &Caller, project: &str, perm: &str) -> Failure {
    Failure::forbidden(format!(
        "principal {:?} lacks permission {perm} on project {project:?}",
        c.principal
    ))
}
