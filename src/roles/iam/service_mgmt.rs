//! Management RPCs (docs/concepts.md): projects, principals, grants, tokens, usage, backup and restore.
//! Each authenticates its caller from the bearer token; the permission rules are checked by
//! `apply` for changes and here for reads.

use tonic::Request;

use super::backup::Backup;
use super::command::{Command, Outcome};
use super::service::{IamService, Identity};
use super::state::ROOT;
use super::{tokens, usage, views};
use crate::pb;
use crate::types::{names, now_s, Failure};

/// The principal a request names, or the caller when empty.
fn or_caller(principal: &str, id: &Identity) -> String {
    if principal.is_empty() {
        id.actor.principal.clone()
    } else {
        principal.to_string()
    }
}

impl IamService {
    fn project_view(&self, o: Outcome) -> Result<pb::Project, Failure> {
        match o {
            Outcome::Project(path) => views::project(&self.store().read(), &path),
            o => Err(super::service::unexpected(o)),
        }
    }

    fn token_info(&self, principal: &str, token_id: &str) -> Result<pb::TokenInfo, Failure> {
        let st = self.store().read();
        st.principals
            .get(principal)
            .and_then(|p| p.tokens.get(token_id))
            .map(|t| views::token_info(principal, token_id, t))
            .ok_or_else(|| Failure::not_found(format!("token {token_id} of {principal} is gone")))
    }

    #[tracing::instrument(name = "iam.who_am_i", skip_all)]
    pub(super) async fn rpc_who_am_i(
        &self,
        req: Request<pb::Empty>,
    ) -> Result<pb::WhoAmIResponse, Failure> {
        let id = self.caller(&req).await?;
        Ok(pb::WhoAmIResponse {
            principal: id.actor.principal,
            project: id.project,
            kind: id.kind,
            token_id: id.actor.token_id,
        })
    }

    #[tracing::instrument(name = "iam.create_project", skip_all, fields(project = %req.get_ref().parent, principal))]
    pub(super) async fn rpc_create_project(
        &self,
        req: Request<pb::CreateProjectRequest>,
    ) -> Result<pb::Project, Failure> {
        let id = self.caller(&req).await?;
        tracing::Span::current().record("principal", id.actor.principal.as_str());
        let r = req.into_inner();
        let quota = views::quota(&r.quota)?;
        let o = self
            .store()
            .propose(Command::CreateProject {
                actor: id.actor,
                parent: r.parent,
                name: r.name,
                quota,
                now: now_s(),
            })
            .await?;
        self.project_view(o)
    }

    #[tracing::instrument(name = "iam.get_project", skip_all, fields(project = %req.get_ref().project))]
    pub(super) async fn rpc_get_project(
        &self,
        req: Request<pb::ProjectRef>,
    ) -> Result<pb::Project, Failure> {
        let id = self.caller(&req).await?;
        let path = if req.get_ref().project.is_empty() {
            ROOT
        } else {
            req.get_ref().project.as_str()
        };
        let st = self.store().read();
        st.project(path)?;
        if !st.holds_any(&id.actor.principal, path) {
            return Err(Failure::forbidden(format!(
                "principal {:?} holds no permission on {path}",
                id.actor.principal
            )));
        }
        views::project(&st, path)
    }

    #[tracing::instrument(name = "iam.set_quota", skip_all, fields(project = %req.get_ref().project))]
    pub(super) async fn rpc_set_quota(
        &self,
        req: Request<pb::SetQuotaRequest>,
    ) -> Result<pb::Project, Failure> {
        let id = self.caller(&req).await?;
        let r = req.into_inner();
        let quota = views::quota(&r.quota)?;
        let o = self
            .store()
            .propose(Command::SetQuota {
                actor: id.actor,
                project: r.project,
                quota,
                now: now_s(),
            })
            .await?;
        self.project_view(o)
    }

    #[tracing::instrument(name = "iam.delete_project", skip_all, fields(project = %req.get_ref().project))]
    pub(super) async fn rpc_delete_project(
        &self,
        req: Request<pb::ProjectRef>,
    ) -> Result<pb::Empty, Failure> {
        let id = self.caller(&req).await?;
        self.store()
            .propose(Command::DeleteProject {
                actor: id.actor,
                project: req.into_inner().project,
                now: now_s(),
            })
            .await?;
        Ok(pb::Empty {})
    }

    #[tracing::instrument(name = "iam.create_principal", skip_all, fields(project = %req.get_ref().project, principal = %req.get_ref().principal_id))]
    pub(super) async fn rpc_create_principal(
        &self,
        req: Request<pb::CreatePrincipalRequest>,
    ) -> Result<pb::CreatePrincipalResponse, Failure> {
        let id = self.caller(&req).await?;
        let r = req.into_inner();
        names::check_principal_id(&r.principal_id)?;
        let (token, new) = tokens::issue(&r.principal_id);
        let cmd = Command::CreatePrincipal {
            actor: id.actor,
            project: r.project,
            principal: r.principal_id.clone(),
            kind: r.kind,
            token: new,
            ttl: r.ttl,
            now: now_s(),
        };
        match self.store().propose(cmd).await? {
            Outcome::Token {
                principal,
                token_id,
            } => {
                let info = self.token_info(&principal, &token_id)?;
                Ok(pb::CreatePrincipalResponse {
                    principal_id: principal,
                    token,
                    token_info: Some(info),
                })
            }
            o => Err(super::service::unexpected(o)),
        }
    }

    #[tracing::instrument(name = "iam.delete_principal", skip_all, fields(principal = %req.get_ref().principal))]
    pub(super) async fn rpc_delete_principal(
        &self,
        req: Request<pb::PrincipalRef>,
    ) -> Result<pb::Empty, Failure> {
        let id = self.caller(&req).await?;
        let principal = or_caller(&req.get_ref().principal, &id);
        self.store()
            .propose(Command::DeletePrincipal {
                actor: id.actor,
                principal,
                now: now_s(),
            })
            .await?;
        Ok(pb::Empty {})
    }

    #[tracing::instrument(name = "iam.grant", skip_all, fields(project = %req.get_ref().project, principal = %req.get_ref().principal, grant))]
    pub(super) async fn rpc_grant(
        &self,
        req: Request<pb::GrantRequest>,
        grant: bool,
    ) -> Result<pb::Project, Failure> {
        tracing::Span::current().record("grant", grant);
        let id = self.caller(&req).await?;
        let r = req.into_inner();
        let permissions = views::permissions(&r.permissions)?;
        let now = now_s();
        let cmd = if grant {
            Command::Grant {
                actor: id.actor,
                project: r.project,
                principal: r.principal,
                permissions,
                now,
            }
        } else {
            Command::Revoke {
                actor: id.actor,
                project: r.project,
                principal: r.principal,
                permissions,
                now,
            }
        };
        let o = self.store().propose(cmd).await?;
        self.project_view(o)
    }

    #[tracing::instrument(name = "iam.create_token", skip_all, fields(principal = %req.get_ref().principal))]
    pub(super) async fn rpc_create_token(
        &self,
        req: Request<pb::CreateTokenRequest>,
    ) -> Result<pb::CreateTokenResponse, Failure> {
        let id = self.caller(&req).await?;
        let r = req.into_inner();
        let principal = or_caller(&r.principal, &id);
        names::check_principal_id(&principal)?;
        let (token, new) = tokens::issue(&principal);
        let cmd = Command::CreateToken {
            actor: id.actor,
            principal,
            token: new,
            ttl: r.ttl,
            description: r.description,
            now: now_s(),
        };
        match self.store().propose(cmd).await? {
            Outcome::Token {
                principal,
                token_id,
            } => Ok(pb::CreateTokenResponse {
                token,
                info: Some(self.token_info(&principal, &token_id)?),
            }),
            o => Err(super::service::unexpected(o)),
        }
    }

    #[tracing::instrument(name = "iam.list_tokens", skip_all, fields(principal = %req.get_ref().principal))]
    pub(super) async fn rpc_list_tokens(
        &self,
        req: Request<pb::PrincipalRef>,
    ) -> Result<pb::ListTokensResponse, Failure> {
        let id = self.caller(&req).await?;
        let principal = or_caller(&req.get_ref().principal, &id);
        let st = self.store().read();
        let p = st.require_token_manager(&id.actor.principal, &principal)?;
        Ok(pb::ListTokensResponse {
            tokens: p
                .tokens
                .iter()
                .map(|(tid, t)| views::token_info(&principal, tid, t))
                .collect(),
        })
    }

    #[tracing::instrument(name = "iam.revoke_token", skip_all, fields(principal = %req.get_ref().principal))]
    pub(super) async fn rpc_revoke_token(
        &self,
        req: Request<pb::RevokeTokenRequest>,
    ) -> Result<pb::Empty, Failure> {
        let id = self.caller(&req).await?;
        let r = req.into_inner();
        let principal = or_caller(&r.principal, &id);
        self.store()
            .propose(Command::RevokeToken {
                actor: id.actor,
                principal,
                token_id: r.token_id,
                now: now_s(),
            })
            .await?;
        Ok(pb::Empty {})
    }

    #[tracing::instrument(name = "iam.get_usage", skip_all, fields(project = %req.get_ref().project))]
    pub(super) async fn rpc_get_usage(
        &self,
        req: Request<pb::GetUsageRequest>,
    ) -> Result<pb::UsageReport, Failure> {
        let id = self.caller(&req).await?;
        let r = req.get_ref();
        let path = if r.project.is_empty() {
            ROOT
        } else {
            r.project.as_str()
        };
        let st = self.store().read();
        st.project(path)?;
        st.require(&id.actor.principal, path, "project.admin")?;
        let rows = usage::report(&st, path, &r.start, &r.end, r.daily, now_s())?;
        Ok(pb::UsageReport {
            rows: rows.iter().map(views::usage_row).collect(),
        })
    }

    #[tracing::instrument(name = "iam.backup", skip_all)]
    pub(super) async fn rpc_backup(
        &self,
        req: Request<pb::Empty>,
    ) -> Result<pb::IamBackupResponse, Failure> {
        let id = self.root_admin(&req).await?;
        let backup = Backup::of(&self.store().read(), now_s());
        tracing::info!(principal = %id.actor.principal, "IAM backup taken");
        Ok(pb::IamBackupResponse {
            data: backup.encode()?,
        })
    }

    /// The caller, who must hold `project.admin` on root (backup, restore, membership).
    /// Errors: `unauthenticated`, `forbidden`.
    async fn root_admin<T>(&self, req: &Request<T>) -> Result<Identity, Failure> {
        let id = self.caller(req).await?;
        self.store()
            .read()
            .require(&id.actor.principal, ROOT, "project.admin")?;
        Ok(id)
    }

    /// The replicas as this one sees them (`project.admin` on root): every voter and learner
    /// with its addresses, which one leads, and on the leader how far each has the log. A
    /// standalone IAM is one member, id "0".
    #[tracing::instrument(name = "iam.members", skip_all)]
    pub(super) async fn rpc_members(
        &self,
        req: Request<pb::Empty>,
    ) -> Result<pb::IamMembersResponse, Failure> {
        self.root_admin(&req).await?;
        self.members_view().await
    }

    async fn members_view(&self) -> Result<pb::IamMembersResponse, Failure> {
        let super::IamStore::Replicated(r) = self.store() else {
            let known = self.inner.members.get().cloned().unwrap_or_default();
            return Ok(pb::IamMembersResponse {
                members: vec![pb::IamMember {
                    id: "0".into(),
                    addr: known.first().map(|m| m.addr.clone()).unwrap_or_default(),
                    leader: true,
                    voter: true,
                    ..Default::default()
                }],
                answered_by: "0".into(),
                ..Default::default()
            });
        };
        let st = r
            .status()
            .await
            .ok_or_else(|| Failure::unavailable("IAM replica is stopped"))?;
        let member = |raft: u64, voter: bool| {
            let n = super::replica::replica_id(raft);
            let c = st.members.iter().find(|m| m.id == n);
            pb::IamMember {
                id: n.to_string(),
                addr: c.map(|c| c.addr.clone()).unwrap_or_default(),
                raft_addr: c.map(|c| c.raft_addr.clone()).unwrap_or_default(),
                leader: st.leader == raft,
                voter,
                matched: st
                    .progress
                    .iter()
                    .find(|(id, _)| *id == raft)
                    .map_or(0, |(_, m)| *m),
            }
        };
        let mut members: Vec<pb::IamMember> = st.voters.iter().map(|v| member(*v, true)).collect();
        members.extend(st.learners.iter().map(|l| member(*l, false)));
        Ok(pb::IamMembersResponse {
            members,
            answered_by: super::replica::replica_id(st.id).to_string(),
            term: st.term,
            commit: st.commit,
        })
    }

    /// Adds a replica (`project.admin` on root; docs/iam-replicas.md "Membership") as a
    /// learner, which the leader makes a voter once it has caught up: the replica should be
    /// running with `-join` at those addresses. Answers with the members once the learner
    /// is added here. Errors: `invalid` for a bad id or address or on a
    /// standalone IAM, `conflict` for a member's id or address, `unavailable` (see
    /// [`Replica::change_member`](super::replica::Replica::change_member)).
    #[tracing::instrument(name = "iam.member_add", skip_all, fields(replica = %req.get_ref().id))]
    pub(super) async fn rpc_member_add(
        &self,
        req: Request<pb::IamMemberAddRequest>,
    ) -> Result<pb::IamMembersResponse, Failure> {
        let who = self.root_admin(&req).await?;
        let r = req.get_ref();
        let id = replica_number(&r.id)?;
        for (flag, a) in [("-raft-addr", &r.raft_addr), ("-iam-addr", &r.iam_addr)] {
            check_host_port(flag, a)?;
        }
        if r.raft_addr == r.iam_addr {
            return Err(Failure::invalid(
                "-raft-addr and -iam-addr must be different addresses",
            ));
        }
        let replica = self.replicated()?;
        replica
            .change_member(super::replica::Change::Add(super::replica::Member {
                id,
                addr: r.iam_addr.clone(),
                raft_addr: r.raft_addr.clone(),
            }))
            .await?;
        tracing::warn!(principal = %who.actor.principal, replica = id, raft_addr = %r.raft_addr, "IAM replica added");
        self.members_view().await
    }

    /// Removes a member, voter or learner (`project.admin` on root). Errors: `invalid` for a bad id, the last
    /// voter or a standalone IAM, `not_found` for a non-member, `unavailable` (see
    /// [`Replica::change_member`](super::replica::Replica::change_member)).
    #[tracing::instrument(name = "iam.member_remove", skip_all, fields(replica = %req.get_ref().id))]
    pub(super) async fn rpc_member_remove(
        &self,
        req: Request<pb::IamMemberRemoveRequest>,
    ) -> Result<pb::IamMembersResponse, Failure> {
        let who = self.root_admin(&req).await?;
        let id = replica_number(&req.get_ref().id)?;
        self.replicated()?
            .change_member(super::replica::Change::Remove(id))
            .await?;
        tracing::warn!(principal = %who.actor.principal, replica = id, "IAM replica removed");
        if self.store().failed() {
            // This replica removed itself: what it would list is no longer the group.
            return Ok(pb::IamMembersResponse::default());
        }
        self.members_view().await
    }

    fn replicated(&self) -> Result<&super::replica::Replica, Failure> {
        match self.store() {
            super::IamStore::Replicated(r) => Ok(r),
            super::IamStore::Standalone(_) => Err(Failure::invalid(
                "IAM runs standalone: to replicate it, move to iam.replicas (backup, new cluster, restore; docs/iam-replicas.md)",
            )),
        }
    }

    #[tracing::instrument(name = "iam.restore", skip_all)]
    pub(super) async fn rpc_restore(
        &self,
        req: Request<pb::IamRestoreRequest>,
    ) -> Result<pb::Empty, Failure> {
        let id = self.root_admin(&req).await?;
        let backup = Backup::decode(&req.get_ref().data)?;
        let principal = id.actor.principal.clone();
        self.store()
            .propose(Command::Restore {
                actor: id.actor,
                backup: Box::new(backup),
                now: now_s(),
            })
            .await?;
        tracing::warn!(principal = %principal, "IAM restored from a backup");
        Ok(pb::Empty {})
    }
}

/// A replica id as the config writes it. Errors: `invalid`.
fn replica_number(id: &str) -> Result<u64, Failure> {
    if !crate::config::valid_replica_id(id) {
        return Err(Failure::invalid(format!(
            "replica id {} is not a decimal number (0 to 999999999)",
            names::shown(id)
        )));
    }
    id.parse()
        .map_err(|_| Failure::invalid(format!("replica id {id} is not a number")))
}

/// `host:port` with a port from 1 to 65535 (an IPv6 host in brackets), as the transport
/// dials it. Errors: `invalid`, naming the flag.
fn check_host_port(flag: &str, addr: &str) -> Result<(), Failure> {
    let ok = addr.rsplit_once(':').is_some_and(|(host, port)| {
        let bracketed = host.starts_with('[') && host.ends_with(']');
        !host.is_empty()
            && !host.contains(['/', ' ', '@'])
            && (bracketed || !host.contains(':'))
            && port.parse::<u16>().is_ok_and(|p| p > 0)
    }) && crate::rpc::client::endpoint(addr, std::time::Duration::from_secs(1)).is_ok();
    if !ok {
        return Err(Failure::invalid(format!(
            "{flag}: {} is not host:port",
            names::shown(addr)
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn member_ids_and_addresses_are_checked() {
        assert_eq!(replica_number("3").unwrap(), 3);
        for bad in ["", "x", "03", "-1", "1234567890", "1 "] {
            assert!(replica_number(bad).is_err(), "{bad:?}");
        }
        for good in ["10.0.0.3:7011", "iam-3.internal:7011", "[fe80::1]:7011"] {
            assert!(check_host_port("-raft-addr", good).is_ok(), "{good}");
        }
        for bad in [
            "",
            ":7011",
            "host",
            "host:0",
            "host:65536",
            "fe80::1:7011",
            "a b:1",
            "u@h:1",
            "h/x:1",
        ] {
            let f = check_host_port("-raft-addr", bad).unwrap_err();
            assert!(f.message.starts_with("-raft-addr: "), "{bad}: {f}");
        }
    }
}
