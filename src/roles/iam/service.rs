//! The `opendsec.v1.Iam` gRPC service (iam.proto). Internal RPCs (Authenticate, Authorize,
//! Admit, ReleaseLeases, GetLease, Reconcile, SweepUnbound, GetEpoch) need the component
//! secret (`service_token`); management RPCs authenticate their caller from the
//! `authorization: Bearer` metadata. Handlers live in `service_internal` and `service_mgmt`;
//! this file holds the shared plumbing and the trait impl, and is the only place their
//! `Failure`s become statuses (through `rpc::to_status`).

use std::sync::Arc;
use std::time::Instant;

use tonic::{Request, Response, Status};

use super::backing::IamStore;
use super::limiter::AuthLimiter;
use super::state::Actor;
use super::tokens::hash_secret;
use crate::pb;
use crate::rpc;
use crate::types::{names, now_s, Failure};

/// The failure for a command whose outcome is not the kind its handler proposed (a bug).
pub(super) fn unexpected(o: super::command::Outcome) -> Failure {
    Failure::internal(format!("unexpected outcome {o:?}"))
}

/// An authenticated caller.
#[derive(Debug, Clone)]
pub struct Identity {
    pub actor: Actor,
    /// The principal's own project.
    pub project: String,
    pub kind: String,
    /// Unix seconds; 0 = never.
    pub expires_at: i64,
    pub epoch: u64,
}

/// The id of the edge making this call over mTLS: an edge may look up and release only the
/// leases bound to it (docs/tls.md "Who may call what"). `None` for any other caller.
fn calling_edge<T>(req: &Request<T>) -> Option<String> {
    rpc::acl::caller(req)
        .filter(|who| who.role == crate::pki::Role::Edge)
        .map(|who| who.id.clone())
}

/// The IAM service; clones share the store and the limiter.
#[derive(Clone)]
pub struct IamService {
    pub(super) inner: Arc<Inner>,
}

pub(super) struct Inner {
    pub(super) store: IamStore,
    pub(super) service_token: String,
    pub(super) limiter: AuthLimiter,
    /// The replicas of the config (a standalone IAM: one, id "0"), for `Members`.
    pub(super) members: std::sync::OnceLock<Vec<crate::config::IamReplica>>,
}

impl IamService {
    /// A service over `store`. `service_token` "" accepts every internal caller;
    /// `auth_fail_rate` is `cfg.admission.auth_fail_rate()` (`None` = no limit).
    pub fn new(
        store: impl Into<IamStore>,
        service_token: &str,
        auth_fail_rate: Option<f64>,
    ) -> IamService {
        IamService {
            inner: Arc::new(Inner {
                store: store.into(),
                service_token: service_token.to_string(),
                limiter: AuthLimiter::new(auth_fail_rate),
                members: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Sets the replicas `Members` describes (their addresses); once.
    pub fn set_members(&self, members: Vec<crate::config::IamReplica>) {
        let _ = self.inner.members.set(members);
    }

    /// The tonic server for this service, with the project's message size limits.
    pub fn server(self) -> pb::iam_server::IamServer<IamService> {
        pb::iam_server::IamServer::new(self)
            .max_decoding_message_size(rpc::MAX_MESSAGE)
            .max_encoding_message_size(rpc::MAX_MESSAGE)
    }

    pub(super) fn store(&self) -> &IamStore {
        &self.inner.store
    }

    /// Checks the component secret of an internal call (`unauthenticated`).
    pub(super) fn internal<T>(&self, req: &Request<T>) -> Result<(), Status> {
        rpc::check_service_token(req, &self.inner.service_token)
    }

    /// The client address of a management call: the forwarded `x-opendsec-client-addr` only
    /// when the component secret checks out (or none is configured), else the peer's IP.
    pub(super) fn client_addr<T>(&self, req: &Request<T>) -> String {
        if rpc::check_service_token(req, &self.inner.service_token).is_ok() {
            rpc::peer_addr(req)
        } else {
            req.remote_addr()
                .map(|a| a.ip().to_string())
                .unwrap_or_default()
        }
    }

    /// Authenticates `token` from `addr` against the current state, through the
    /// failed-authentication limiter: `unauthenticated` for a malformed, unknown, revoked or
    /// expired token; `rate_limited` for a new token from a locked-out address.
    ///
    /// On a replica a token it does not know yet may have been made a moment ago through
    /// another: such a failure is checked again after a consistent read before it counts.
    pub(super) async fn authenticate(&self, token: &str, addr: &str) -> Result<Identity, Failure> {
        if self.store().cut_off() {
            // A revoked token must not keep working on a replica cut off from the others.
            self.store().fresh().await?;
        }
        match self.authenticate_here(token, addr, !self.store().replicated()) {
            Err(f)
                if f.reason == crate::types::Reason::Unauthenticated
                    && self.store().replicated() =>
            {
                self.store().fresh().await?;
                self.authenticate_here(token, addr, true)
            }
            r => r,
        }
    }

    /// Authenticates against the state as applied here; a failure counts against `addr`
    /// only when `count` (the last try).
    fn authenticate_here(&self, token: &str, addr: &str, count: bool) -> Result<Identity, Failure> {
        let t0 = Instant::now();
        let limiter = &self.inner.limiter;
        limiter.check(addr, token, t0)?;
        let parts = match names::parse_token(token) {
            Ok(p) => p,
            Err(e) => {
                limiter.failed(addr, t0);
                return Err(e);
            }
        };
        let actor = Actor {
            principal: parts.principal.to_string(),
            token_id: parts.id.to_string(),
            secret_hash: hash_secret(parts.secret),
        };
        let now = now_s();
        let st = self.store().read();
        let found = st.authenticate(&actor, now).map(|p| {
            let expires_at = p
                .tokens
                .get(&actor.token_id)
                .map(|t| t.expires_at)
                .unwrap_or(0);
            (p.project.clone(), p.kind.clone(), expires_at)
        });
        let epoch = st.epoch;
        drop(st);
        match found {
            Ok((project, kind, expires_at)) => {
                limiter.succeeded(addr, token, t0);
                Ok(Identity {
                    actor,
                    project,
                    kind,
                    expires_at,
                    epoch,
                })
            }
            Err(e) => {
                if count {
                    limiter.failed(addr, t0);
                    tracing::debug!(principal = %actor.principal, client_addr = addr, "authentication failed");
                }
                Err(e)
            }
        }
    }

    /// The caller of a management RPC, from its bearer token. On a replica, after a
    /// consistent read: management calls see every change committed before them, whichever
    /// replica took it.
    pub(super) async fn caller<T>(&self, req: &Request<T>) -> Result<Identity, Failure> {
        let token = rpc::bearer(req);
        if token.is_empty() {
            return Err(Failure::unauthenticated(
                "missing authorization: Bearer <token>",
            ));
        }
        let addr = self.client_addr(req);
        self.store().fresh().await?;
        self.authenticate(&token, &addr).await
    }
}

/// A handler's result as a gRPC reply.
impl IamService {
    /// The answer, with the leader's address for clients that prefer to call it
    /// ([`rpc::failover::LEADER_HEADER`]): a follower forwards every change to the leader,
    /// which costs a hop.
    fn reply<T>(&self, r: Result<T, Failure>) -> Result<Response<T>, Status> {
        let leader = match self.store() {
            super::IamStore::Replicated(rep) => rep
                .leader_addr()
                .and_then(|a| tonic::metadata::MetadataValue::try_from(a.as_str()).ok()),
            super::IamStore::Standalone(_) => None,
        };
        match r {
            Ok(v) => {
                let mut resp = Response::new(v);
                if let Some(l) = leader {
                    resp.metadata_mut().insert(rpc::failover::LEADER_HEADER, l);
                }
                Ok(resp)
            }
            Err(f) => {
                let mut st = rpc::to_status(&f);
                if let Some(l) = leader {
                    st.metadata_mut().insert(rpc::failover::LEADER_HEADER, l);
                }
                Err(st)
            }
        }
    }
}

#[tonic::async_trait]
impl pb::iam_server::Iam for IamService {
    async fn authenticate(
        &self,
        req: Request<pb::AuthenticateRequest>,
    ) -> Result<Response<pb::AuthenticateResponse>, Status> {
        self.internal(&req)?;
        self.reply(self.rpc_authenticate(req).await)
    }
    async fn authorize(
        &self,
        req: Request<pb::AuthorizeRequest>,
    ) -> Result<Response<pb::AuthorizeResponse>, Status> {
        self.internal(&req)?;
        self.reply(self.rpc_authorize(req.into_inner()).await)
    }
    async fn admit(
        &self,
        req: Request<pb::AdmitRequest>,
    ) -> Result<Response<pb::AdmitResponse>, Status> {
        self.internal(&req)?;
        self.reply(self.rpc_admit(req).await)
    }
    async fn release_leases(
        &self,
        req: Request<pb::ReleaseLeasesRequest>,
    ) -> Result<Response<pb::ReleaseLeasesResponse>, Status> {
        self.internal(&req)?;
        let edge = calling_edge(&req);
        self.reply(self.rpc_release_leases(req.into_inner(), edge).await)
    }
    async fn get_lease(
        &self,
        req: Request<pb::GetLeaseRequest>,
    ) -> Result<Response<pb::LeaseInfo>, Status> {
        self.internal(&req)?;
        self.reply(self.rpc_get_lease(req.into_inner()).await)
    }
    async fn get_leases(
        &self,
        req: Request<pb::GetLeasesRequest>,
    ) -> Result<Response<pb::GetLeasesResponse>, Status> {
        self.internal(&req)?;
        let edge = calling_edge(&req);
        self.reply(self.rpc_get_leases(req.into_inner(), edge.as_deref()).await)
    }
    async fn reconcile(
        &self,
        req: Request<pb::ReconcileRequest>,
    ) -> Result<Response<pb::ReconcileResponse>, Status> {
        self.internal(&req)?;
        self.reply(self.rpc_reconcile(req.into_inner()).await)
    }
    async fn sweep_unbound(
        &self,
        req: Request<pb::SweepUnboundRequest>,
    ) -> Result<Response<pb::SweepUnboundResponse>, Status> {
        self.internal(&req)?;
        self.reply(self.rpc_sweep_unbound(req.into_inner()).await)
    }
    async fn lock(
        &self,
        req: Request<pb::LockRequest>,
    ) -> Result<Response<pb::LockResponse>, Status> {
        self.internal(&req)?;
        let caller = rpc::acl::caller(&req).cloned();
        self.reply(self.rpc_lock(req.into_inner(), caller.as_ref()).await)
    }
    async fn unlock(&self, req: Request<pb::UnlockRequest>) -> Result<Response<pb::Empty>, Status> {
        self.internal(&req)?;
        let caller = rpc::acl::caller(&req).cloned();
        self.reply(self.rpc_unlock(req.into_inner(), caller.as_ref()).await)
    }
    async fn kv_get(
        &self,
        req: Request<pb::KvGetRequest>,
    ) -> Result<Response<pb::KvEntry>, Status> {
        self.internal(&req)?;
        self.reply(self.rpc_kv_get(req.into_inner()).await)
    }
    async fn kv_list(
        &self,
        req: Request<pb::KvListRequest>,
    ) -> Result<Response<pb::KvListResponse>, Status> {
        self.internal(&req)?;
        self.reply(self.rpc_kv_list(req.into_inner()).await)
    }
    async fn kv_put(
        &self,
        req: Request<pb::KvPutRequest>,
    ) -> Result<Response<pb::KvPutResponse>, Status> {
        self.internal(&req)?;
        self.reply(self.rpc_kv_put(req.into_inner()).await)
    }
    async fn kv_delete(
        &self,
        req: Request<pb::KvDeleteRequest>,
    ) -> Result<Response<pb::KvPutResponse>, Status> {
        self.internal(&req)?;
        self.reply(self.rpc_kv_delete(req.into_inner()).await)
    }
    async fn get_epoch(
        &self,
        req: Request<pb::Empty>,
    ) -> Result<Response<pb::EpochResponse>, Status> {
        self.internal(&req)?;
        // A trailing replica's epoch would let a revoked token live on in the apiservers'
        // caches: read it after a read index.
        if let Err(f) = self.store().fresh().await {
            return self.reply(Err(f));
        }
        self.reply(Ok(pb::EpochResponse {
            epoch: self.store().read().epoch,
        }))
    }

    async fn who_am_i(
        &self,
        req: Request<pb::Empty>,
    ) -> Result<Response<pb::WhoAmIResponse>, Status> {
        self.reply(self.rpc_who_am_i(req).await)
    }
    async fn create_project(
        &self,
        req: Request<pb::CreateProjectRequest>,
    ) -> Result<Response<pb::Project>, Status> {
        self.reply(self.rpc_create_project(req).await)
    }
    async fn get_project(
        &self,
        req: Request<pb::ProjectRef>,
    ) -> Result<Response<pb::Project>, Status> {
        self.reply(self.rpc_get_project(req).await)
    }
    async fn set_quota(
        &self,
        req: Request<pb::SetQuotaRequest>,
    ) -> Result<Response<pb::Project>, Status> {
        self.reply(self.rpc_set_quota(req).await)
    }
    async fn delete_project(
        &self,
        req: Request<pb::ProjectRef>,
    ) -> Result<Response<pb::Empty>, Status> {
        self.reply(self.rpc_delete_project(req).await)
    }
    async fn create_principal(
        &self,
        req: Request<pb::CreatePrincipalRequest>,
    ) -> Result<Response<pb::CreatePrincipalResponse>, Status> {
        self.reply(self.rpc_create_principal(req).await)
    }
    async fn delete_principal(
        &self,
        req: Request<pb::PrincipalRef>,
    ) -> Result<Response<pb::Empty>, Status> {
        self.reply(self.rpc_delete_principal(req).await)
    }
    async fn grant(&self, req: Request<pb::GrantRequest>) -> Result<Response<pb::Project>, Status> {
        self.reply(self.rpc_grant(req, true).await)
    }
    async fn revoke(
        &self,
        req: Request<pb::GrantRequest>,
    ) -> Result<Response<pb::Project>, Status> {
        self.reply(self.rpc_grant(req, false).await)
    }
    async fn create_token(
        &self,
        req: Request<pb::CreateTokenRequest>,
    ) -> Result<Response<pb::CreateTokenResponse>, Status> {
        self.reply(self.rpc_create_token(req).await)
    }
    async fn list_tokens(
        &self,
        req: Request<pb::PrincipalRef>,
    ) -> Result<Response<pb::ListTokensResponse>, Status> {
        self.reply(self.rpc_list_tokens(req).await)
    }
    async fn revoke_token(
        &self,
        req: Request<pb::RevokeTokenRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        self.reply(self.rpc_revoke_token(req).await)
    }
    async fn get_usage(
        &self,
        req: Request<pb::GetUsageRequest>,
    ) -> Result<Response<pb::UsageReport>, Status> {
        self.reply(self.rpc_get_usage(req).await)
    }
    async fn backup(
        &self,
        req: Request<pb::Empty>,
    ) -> Result<Response<pb::IamBackupResponse>, Status> {
        self.reply(self.rpc_backup(req).await)
    }
    async fn restore(
        &self,
        req: Request<pb::IamRestoreRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        self.reply(self.rpc_restore(req).await)
    }
    async fn members(
        &self,
        req: Request<pb::Empty>,
    ) -> Result<Response<pb::IamMembersResponse>, Status> {
        self.reply(self.rpc_members(req).await)
    }

    async fn member_add(
        &self,
        req: Request<pb::IamMemberAddRequest>,
    ) -> Result<Response<pb::IamMembersResponse>, Status> {
        self.reply(self.rpc_member_add(req).await)
    }

    async fn member_remove(
        &self,
        req: Request<pb::IamMemberRemoveRequest>,
    ) -> Result<Response<pb::IamMembersResponse>, Status> {
        self.reply(self.rpc_member_remove(req).await)
    }
}
