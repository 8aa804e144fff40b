//! Internal RPCs called by apiservers, watchers and edges (the component secret is checked
//! by the caller of these handlers): authentication, authorization, admission with quota
//! leases, releases, reconciliation and the security epoch.

use tonic::Request;

use super::apply_leases::{self, MAX_BATCH};
use super::command::{AdmitItem, Command, Outcome};
use super::service::{unexpected, IamService};
use super::views;
use crate::pb;
use crate::rpc;
use crate::types::{names, now_s, Failure, Res};

/// A watcher's reconciliation under its fence of the reconciliation lock (0 = none): if
/// another watcher has taken the lock by the time it commits, it changes nothing.
fn fenced(fence: u64, cmd: Command) -> Command {
    if fence == 0 {
        return cmd;
    }
    Command::Fenced {
        lock: super::apply_kv::RECONCILE_LOCK.into(),
        fence,
        cmd: Box::new(cmd),
    }
}

impl IamService {
    /// The address a request's token came from: the forwarded one, else the peer.
    fn addr_of<T>(req: &Request<T>, forwarded: &str) -> String {
        if forwarded.is_empty() {
            rpc::peer_addr(req)
        } else {
            forwarded.to_string()
        }
    }

    #[tracing::instrument(name = "iam.authenticate", skip_all)]
    pub(super) async fn rpc_authenticate(
        &self,
        req: Request<pb::AuthenticateRequest>,
    ) -> Result<pb::AuthenticateResponse, Failure> {
        let addr = Self::addr_of(&req, &req.get_ref().client_addr);
        let id = self.authenticate(&req.get_ref().token, &addr).await?;
        Ok(pb::AuthenticateResponse {
            principal: id.actor.principal,
            project: id.project,
            token_id: id.actor.token_id,
            expires_at: id.expires_at,
            epoch: id.epoch,
            kind: id.kind,
        })
    }

    #[tracing::instrument(name = "iam.authorize", skip_all, fields(principal = %r.principal, project = %r.project))]
    pub(super) async fn rpc_authorize(
        &self,
        r: pb::AuthorizeRequest,
    ) -> Result<pb::AuthorizeResponse, Failure> {
        names::check_permission(&r.permission)?;
        names::check_project_path(&r.project)?;
        if self.store().cut_off() {
            self.store().fresh().await?;
        }
        // A replica may trail a grant made a moment ago through another: a refusal is
        // checked again after a consistent read.
        match self.authorize_here(&r) {
            Ok(a) if !a.allowed && self.store().replicated() => {
                self.store().fresh().await?;
                self.authorize_here(&r)
            }
            Err(f) if f.reason == crate::types::Reason::NotFound && self.store().replicated() => {
                self.store().fresh().await?;
                self.authorize_here(&r)
            }
            other => other,
        }
    }

    fn authorize_here(&self, r: &pb::AuthorizeRequest) -> Result<pb::AuthorizeResponse, Failure> {
        let st = self.store().read();
        let allowed = st.principals.contains_key(&r.principal)
            && st.holds(&r.principal, &r.project, &r.permission);
        // Only a caller the permission covers learns that the project is missing (others are
        // refused as for any project), so nothing about other projects leaks.
        if allowed {
            st.project(&r.project)?;
        }
        Ok(pb::AuthorizeResponse {
            allowed,
            epoch: st.epoch,
        })
    }

    #[tracing::instrument(name = "iam.admit", skip_all, fields(items = req.get_ref().items.len(), principal))]
    pub(super) async fn rpc_admit(
        &self,
        req: Request<pb::AdmitRequest>,
    ) -> Result<pb::AdmitResponse, Failure> {
        let addr = Self::addr_of(&req, &req.get_ref().client_addr);
        let r = req.into_inner();
        if r.items.len() > MAX_BATCH {
            return Err(Failure::invalid(format!(
                "batch of {} items exceeds {MAX_BATCH}",
                r.items.len()
            )));
        }
        let id = self.authenticate(&r.token, &addr).await?;
        tracing::Span::current().record("principal", id.actor.principal.as_str());
        let items: Vec<AdmitItem> = r
            .items
            .into_iter()
            .map(|i| AdmitItem {
                resources: Res::from_pb(i.resources.as_ref()),
                lease_id: i.lease_id,
                project: i.project,
                edge_id: i.edge_id,
                sandbox_id: i.sandbox_id,
                keep_binding: i.keep_binding,
                spec_digest: i.spec_digest,
            })
            .collect();
        let lease_ids: Vec<String> = items.iter().map(|i| i.lease_id.clone()).collect();
        let cmd = Command::Admit {
            actor: id.actor,
            image_project: r.image_project,
            items,
            now: now_s(),
        };
        match self.store().propose(cmd).await? {
            Outcome::Admitted { principal, results } => Ok(pb::AdmitResponse {
                principal,
                results: lease_ids
                    .into_iter()
                    .zip(results)
                    .map(|(lease_id, r)| match r {
                        Ok(a) => pb::AdmitResult {
                            lease_id,
                            error: None,
                            existed: a.existed,
                            edge_id: a.prev_edge_id,
                            sandbox_id: a.prev_sandbox_id,
                        },
                        Err(f) => pb::AdmitResult {
                            lease_id,
                            error: Some(rpc::status::error_detail(&f)),
                            ..Default::default()
                        },
                    })
                    .collect(),
            }),
            o => Err(unexpected(o)),
        }
    }

    #[tracing::instrument(name = "iam.release_leases", skip_all, fields(leases = r.lease_ids.len()))]
    /// Releases `r.lease_ids`; with `edge` (an edge's call over mTLS) only those bound to
    /// that edge, so one edge's certificate cannot free another's quota.
    pub(super) async fn rpc_release_leases(
        &self,
        r: pb::ReleaseLeasesRequest,
        edge: Option<String>,
    ) -> Result<pb::ReleaseLeasesResponse, Failure> {
        // What is held is read before proposing: on a replica, as of now.
        self.store().fresh().await?;
        let lease_ids = match &edge {
            None => r.lease_ids,
            Some(e) => {
                let st = self.store().read();
                r.lease_ids
                    .into_iter()
                    .filter(|id| st.leases.get(id).is_some_and(|l| &l.edge_id == e))
                    .collect()
            }
        };
        if !apply_leases::any_held(&self.store().read(), &lease_ids) {
            return Ok(pb::ReleaseLeasesResponse { released: 0 });
        }
        match self
            .store()
            .propose(Command::ReleaseLeases {
                lease_ids,
                at: r.at,
                now: now_s(),
                not_created: r.not_created,
            })
            .await?
        {
            Outcome::Released(n) => Ok(pb::ReleaseLeasesResponse { released: n }),
            o => Err(unexpected(o)),
        }
    }

    pub(super) async fn rpc_get_lease(
        &self,
        r: pb::GetLeaseRequest,
    ) -> Result<pb::LeaseInfo, Failure> {
        self.store().fresh().await?;
        let st = self.store().read();
        st.leases
            .get(&r.lease_id)
            .map(|l| views::lease_info(&r.lease_id, l))
            .ok_or_else(|| Failure::not_found(format!("lease {:?} not found", r.lease_id)))
    }

    /// The leases among `lease_ids` that IAM holds (with `edge`, an edge's call over mTLS:
    /// only those bound to it); `invalid` past 4096 ids. On a replica, as of the call (an
    /// edge deletes a sandbox whose lease IAM does not hold: a trailing replica must not
    /// answer for a lease admitted a moment ago).
    pub(super) async fn rpc_get_leases(
        &self,
        r: pb::GetLeasesRequest,
        edge: Option<&str>,
    ) -> Result<pb::GetLeasesResponse, Failure> {
        if r.lease_ids.len() > 4096 {
            return Err(Failure::invalid(format!(
                "{} lease ids asked; at most 4096 per call",
                r.lease_ids.len()
            )));
        }
        self.store().fresh().await?;
        let st = self.store().read();
        let leases = r
            .lease_ids
            .iter()
            .filter_map(|id| st.leases.get(id).map(|l| (id, l)))
            .filter(|(_, l)| edge.is_none_or(|e| l.edge_id == e))
            .map(|(id, l)| views::lease_info(id, l))
            .collect();
        Ok(pb::GetLeasesResponse { leases })
    }

    #[tracing::instrument(name = "iam.reconcile", skip_all, fields(edge_id = %r.edge_id, leases = r.leases.len()))]
    pub(super) async fn rpc_reconcile(
        &self,
        r: pb::ReconcileRequest,
    ) -> Result<pb::ReconcileResponse, Failure> {
        let leases: Vec<_> = r.leases.iter().map(views::lease_report).collect();
        self.store().fresh().await?;
        let now = now_s();
        // IAM commits only differences: a report that matches changes nothing.
        if apply_leases::reconcile_plan(
            &self.store().read(),
            &r.edge_id,
            &leases,
            r.min_age_s,
            now,
        )?
        .is_empty()
        {
            return Ok(pb::ReconcileResponse {
                adopted: 0,
                released: 0,
            });
        }
        let cmd = fenced(
            r.fence,
            Command::Reconcile {
                edge_id: r.edge_id,
                leases,
                min_age_s: r.min_age_s,
                now,
            },
        );
        match self.store().propose(cmd).await? {
            Outcome::Reconciled { adopted, released } => {
                if adopted > 0 || released > 0 {
                    tracing::info!(adopted, released, "leases reconciled");
                }
                Ok(pb::ReconcileResponse { adopted, released })
            }
            o => Err(unexpected(o)),
        }
    }

    #[tracing::instrument(name = "iam.sweep_unbound", skip_all)]
    pub(super) async fn rpc_sweep_unbound(
        &self,
        r: pb::SweepUnboundRequest,
    ) -> Result<pb::SweepUnboundResponse, Failure> {
        self.store().fresh().await?;
        let now = now_s();
        if r.max_age_s >= 0
            && !apply_leases::any_unbound_older(&self.store().read(), r.max_age_s, now)
        {
            return Ok(pb::SweepUnboundResponse { released: 0 });
        }
        let cmd = fenced(
            r.fence,
            Command::SweepUnbound {
                max_age_s: r.max_age_s,
                now,
            },
        );
        match self.store().propose(cmd).await? {
            Outcome::Released(n) => Ok(pb::SweepUnboundResponse { released: n }),
            o => Err(unexpected(o)),
        }
    }
}
