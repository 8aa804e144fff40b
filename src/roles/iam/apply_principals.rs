//! Principal, permission and token commands (docs/concepts.md): bounded delegation, token
//! lifetimes and the security epoch. Every rule is checked before the first mutation.

use super::apply::actor;
use super::command::{NewToken, Outcome};
use super::state::{check_hash, check_token_id, Actor, IamState, Principal, Token};
use crate::types::{names, Failure};

/// Principal kinds: a label only (docs/concepts.md).
pub const KINDS: [&str; 3] = ["user", "service", "agent"];
/// Most tokens one principal may hold.
pub const MAX_TOKENS: usize = 1000;
/// Longest accepted token description.
const MAX_DESCRIPTION: usize = 256;
/// Longest lifetime ever accepted, whatever the config (100 years).
const MAX_TTL: i64 = 100 * 365 * 86400;

/// The expiry of a token issued at `now` with lifetime `ttl` (docs/concepts.md): with a
/// limit, a missing ttl takes the limit and a longer one is `invalid`; without, a missing ttl
/// never expires (0).
pub fn expiry(max_token_ttl_s: i64, ttl: i64, now: i64) -> Result<i64, Failure> {
    if !(0..=MAX_TTL).contains(&ttl) {
        return Err(Failure::invalid(format!(
            "ttl {ttl} must be from 0 to {MAX_TTL} seconds"
        )));
    }
    if max_token_ttl_s > 0 {
        if ttl > max_token_ttl_s {
            return Err(Failure::invalid(format!(
                "ttl {ttl} exceeds the cluster's max_token_ttl_s {max_token_ttl_s}"
            )));
        }
        Ok(now + if ttl == 0 { max_token_ttl_s } else { ttl })
    } else if ttl == 0 {
        Ok(0)
    } else {
        Ok(now + ttl)
    }
}

fn check_new_token(p: Option<&Principal>, t: &NewToken) -> Result<(), Failure> {
    check_token_id(&t.id)?;
    check_hash(&t.hash)?;
    if let Some(p) = p {
        if p.tokens.contains_key(&t.id) {
            return Err(Failure::conflict(format!(
                "token id {} is already in use",
                t.id
            )));
        }
        if p.tokens.len() >= MAX_TOKENS {
            return Err(Failure::invalid(format!(
                "a principal may hold at most {MAX_TOKENS} tokens; revoke some first"
            )));
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
pub(super) fn create_principal(
    st: &mut IamState,
    a: &Actor,
    project: &str,
    id: &str,
    kind: &str,
    token: &NewToken,
    ttl: i64,
    now: i64,
) -> Result<Outcome, Failure> {
    actor(st, a, now)?;
    st.project(project)?;
    names::check_principal_id(id)?;
    let kind = if kind.is_empty() { "agent" } else { kind };
    if !KINDS.contains(&kind) {
        return Err(Failure::invalid(format!(
            "kind {kind:?} must be one of {}",
            KINDS.join(", ")
        )));
    }
    st.require(&a.principal, project, "project.admin")?;
    if st.principals.contains_key(id) {
        return Err(Failure::conflict(format!("principal {id} already exists")));
    }
    check_new_token(None, token)?;
    let expires_at = expiry(st.settings.max_token_ttl_s, ttl, now)?;
    let mut p = Principal {
        project: project.into(),
        kind: kind.into(),
        created_at: now,
        created_by: a.principal.clone(),
        ..Default::default()
    };
    p.tokens.insert(
        token.id.clone(),
        Token {
            hash: token.hash.clone(),
            created_at: now,
            expires_at,
            description: String::new(),
            created_by: a.principal.clone(),
        },
    );
    st.principals.insert(id.to_string(), p);
    Ok(Outcome::Token {
        principal: id.to_string(),
        token_id: token.id.clone(),
    })
}

pub(super) fn delete_principal(
    st: &mut IamState,
    a: &Actor,
    id: &str,
    now: i64,
) -> Result<Outcome, Failure> {
    actor(st, a, now)?;
    let p = st.principal(id)?;
    st.require(&a.principal, &p.project, "project.admin")?;
    if id == st.admin_id {
        return Err(Failure::invalid(format!(
            "the administrator {id} cannot be deleted"
        )));
    }
    st.principals.remove(id);
    for pr in st.projects.values_mut() {
        pr.policies.remove(id);
    }
    st.epoch += 1;
    Ok(Outcome::Done)
}

fn check_permissions(perms: &[String]) -> Result<(), Failure> {
    perms.iter().try_for_each(|p| names::check_permission(p))
}

pub(super) fn grant(
    st: &mut IamState,
    a: &Actor,
    project: &str,
    principal: &str,
    perms: &[String],
    now: i64,
) -> Result<Outcome, Failure> {
    actor(st, a, now)?;
    st.project(project)?;
    st.principal(principal)?;
    if perms.is_empty() {
        return Err(Failure::invalid("grant needs at least one permission"));
    }
    check_permissions(perms)?;
    // Bounded delegation: project.admin here, and every granted permission held here.
    st.require(&a.principal, project, "project.admin")?;
    for p in perms {
        if !st.holds(&a.principal, project, p) {
            return Err(Failure::forbidden(format!(
                "principal {:?} cannot grant {p} on {project}: it does not hold {p} there",
                a.principal
            )));
        }
    }
    if let Some(pr) = st.projects.get_mut(project) {
        pr.policies
            .entry(principal.to_string())
            .or_default()
            .extend(perms.iter().cloned());
    }
    Ok(Outcome::Project(project.to_string()))
}

pub(super) fn revoke(
    st: &mut IamState,
    a: &Actor,
    project: &str,
    principal: &str,
    perms: &[String],
    now: i64,
) -> Result<Outcome, Failure> {
    actor(st, a, now)?;
    st.project(project)?;
    names::check_principal_id(principal)?;
    check_permissions(perms)?;
    st.require(&a.principal, project, "project.admin")?;
    if principal == st.admin_id && project == super::state::ROOT {
        return Err(Failure::invalid(format!(
            "the administrator {principal} holds every permission on root; it cannot be revoked"
        )));
    }
    if let Some(pr) = st.projects.get_mut(project) {
        if perms.is_empty() {
            pr.policies.remove(principal);
        } else if let Some(set) = pr.policies.get_mut(principal) {
            for p in perms {
                set.remove(p);
            }
            if set.is_empty() {
                pr.policies.remove(principal);
            }
        }
    }
    st.epoch += 1;
    Ok(Outcome::Project(project.to_string()))
}

pub(super) fn create_token(
    st: &mut IamState,
    a: &Actor,
    principal: &str,
    token: &NewToken,
    ttl: i64,
    description: &str,
    now: i64,
) -> Result<Outcome, Failure> {
    actor(st, a, now)?;
    let p = st.require_token_manager(&a.principal, principal)?;
    if description.len() > MAX_DESCRIPTION || description.chars().any(|c| c.is_control()) {
        return Err(Failure::invalid(format!(
            "description must be at most {MAX_DESCRIPTION} printable characters"
        )));
    }
    check_new_token(Some(p), token)?;
    let expires_at = expiry(st.settings.max_token_ttl_s, ttl, now)?;
    let t = Token {
        hash: token.hash.clone(),
        created_at: now,
        expires_at,
        description: description.into(),
        created_by: a.principal.clone(),
    };
    if let Some(p) = st.principals.get_mut(principal) {
        p.tokens.insert(token.id.clone(), t);
    }
    Ok(Outcome::Token {
        principal: principal.to_string(),
        token_id: token.id.clone(),
    })
}

pub(super) fn revoke_token(
    st: &mut IamState,
    a: &Actor,
    principal: &str,
    token_id: &str,
    now: i64,
) -> Result<Outcome, Failure> {
    actor(st, a, now)?;
    let p = st.require_token_manager(&a.principal, principal)?;
    if !p.tokens.contains_key(token_id) {
        return Err(Failure::not_found(format!(
            "principal {principal} has no token {token_id:?}"
        )));
    }
    // The administrator cannot be deleted; losing its last working token would lock everyone
    // out of IAM just the same.
    if principal == st.admin_id {
        let live = p
            .tokens
            .iter()
            .filter(|(id, t)| id.as_str() != token_id && (t.expires_at == 0 || t.expires_at > now))
            .count();
        if live == 0 {
            return Err(Failure::invalid(format!("token {token_id:?} is the administrator's last working token; issue another one before revoking it")));
        }
    }
    if let Some(p) = st.principals.get_mut(principal) {
        p.tokens.remove(token_id);
    }
    st.epoch += 1;
    Ok(Outcome::Done)
}

#[cfg(test)]
mod tests {
    use super::super::command::Command;
    use super::super::state::ROOT;
    use super::super::testutil::*;
    use super::super::tokens::hash_secret;
    use super::*;
    use crate::types::Reason;

    #[test]
    fn the_administrators_last_token_cannot_be_revoked() {
        let mut st = booted();
        let before = st.clone();
        refused(
            &mut st,
            Command::RevokeToken {
                actor: admin(),
                principal: "admin".into(),
                token_id: "primary".into(),
                now: NOW,
            },
            Reason::Invalid,
        );
        assert_eq!(st, before);
        // With a second token it can go; then the second is the last one.
        ok(
            &mut st,
            Command::CreateToken {
                actor: admin(),
                principal: "admin".into(),
                token: new_token("t2"),
                ttl: 0,
                description: String::new(),
                now: NOW,
            },
        );
        ok(
            &mut st,
            Command::RevokeToken {
                actor: admin(),
                principal: "admin".into(),
                token_id: "primary".into(),
                now: NOW,
            },
        );
        assert!(!st.principals["admin"].tokens.contains_key("primary"));
    }

    fn new_token(id: &str) -> NewToken {
        NewToken {
            id: id.into(),
            hash: hash_secret(&format!("secret-{id}")),
        }
    }

    fn create_principal_cmd(
        actor: &Actor,
        project: &str,
        id: &str,
        kind: &str,
        ttl: i64,
    ) -> Command {
        Command::CreatePrincipal {
            actor: actor.clone(),
            project: project.into(),
            principal: id.into(),
            kind: kind.into(),
            token: new_token("tfirst"),
            ttl,
            now: NOW,
        }
    }

    fn grant_cmd(actor: &Actor, project: &str, principal: &str, p: &[&str]) -> Command {
        Command::Grant {
            actor: actor.clone(),
            project: project.into(),
            principal: principal.into(),
            permissions: perms(p),
            now: NOW,
        }
    }

    fn revoke_cmd(actor: &Actor, project: &str, principal: &str, p: &[&str]) -> Command {
        Command::Revoke {
            actor: actor.clone(),
            project: project.into(),
            principal: principal.into(),
            permissions: perms(p),
            now: NOW,
        }
    }

    fn create_token_cmd(actor: &Actor, principal: &str, id: &str, ttl: i64) -> Command {
        Command::CreateToken {
            actor: actor.clone(),
            principal: principal.into(),
            token: new_token(id),
            ttl,
            description: "node-7".into(),
            now: NOW,
        }
    }

    fn as_actor(principal: &str, id: &str) -> Actor {
        Actor {
            principal: principal.into(),
            token_id: id.into(),
            secret_hash: hash_secret(&format!("secret-{id}")),
        }
    }

    #[test]
    fn creating_a_principal_issues_its_first_token() {
        let mut st = booted();
        ok(&mut st, create_project_cmd(&admin(), ROOT, "a", &[]));
        let out = ok(
            &mut st,
            create_principal_cmd(&admin(), "root/a", "trainer", "", 0),
        );
        assert_eq!(
            out,
            Outcome::Token {
                principal: "trainer".into(),
                token_id: "tfirst".into()
            }
        );
        let p = &st.principals["trainer"];
        assert_eq!((p.project.as_str(), p.kind.as_str()), ("root/a", "agent"));
        assert_eq!(p.tokens["tfirst"].expires_at, 0);
        // A new principal holds no permission.
        assert!(!st.holds_any("trainer", "root/a"));
        // The token works as an actor right away.
        st.authenticate(&as_actor("trainer", "tfirst"), NOW)
            .unwrap();
    }

    #[test]
    fn principal_ids_are_unique_and_kinds_checked() {
        let mut st = booted();
        ok(&mut st, create_project_cmd(&admin(), ROOT, "a", &[]));
        ok(
            &mut st,
            create_principal_cmd(&admin(), "root/a", "trainer", "user", 0),
        );
        refused(
            &mut st,
            create_principal_cmd(&admin(), ROOT, "trainer", "user", 0),
            Reason::Conflict,
        );
        refused(
            &mut st,
            create_principal_cmd(&admin(), ROOT, "x", "robot", 0),
            Reason::Invalid,
        );
        for bad in ["a.b", "a/b", "a b", ""] {
            refused(
                &mut st,
                create_principal_cmd(&admin(), ROOT, bad, "", 0),
                Reason::Invalid,
            );
        }
        refused(
            &mut st,
            create_principal_cmd(&admin(), "root/none", "x", "", 0),
            Reason::NotFound,
        );
        let bob = add_principal(&mut st, "root/a", "bob");
        refused(
            &mut st,
            create_principal_cmd(&bob, "root/a", "x", "", 0),
            Reason::Forbidden,
        );
        grant_direct(&mut st, "root/a", "bob", &["project.admin"]);
        ok(&mut st, create_principal_cmd(&bob, "root/a", "x", "", 0));
    }

    #[test]
    fn token_lifetime_follows_max_token_ttl() {
        assert_eq!(expiry(0, 0, 100).unwrap(), 0);
        assert_eq!(expiry(0, 50, 100).unwrap(), 150);
        assert_eq!(expiry(3600, 0, 100).unwrap(), 3700);
        assert_eq!(expiry(3600, 60, 100).unwrap(), 160);
        assert_eq!(expiry(3600, 3601, 100).unwrap_err().reason, Reason::Invalid);
        assert_eq!(expiry(0, -1, 100).unwrap_err().reason, Reason::Invalid);
        let mut st = booted();
        ok(
            &mut st,
            Command::Configure {
                root_quota: q(&[]),
                max_token_ttl_s: 3600,
            },
        );
        refused(
            &mut st,
            create_principal_cmd(&admin(), ROOT, "x", "", 7200),
            Reason::Invalid,
        );
        ok(&mut st, create_principal_cmd(&admin(), ROOT, "x", "", 0));
        assert_eq!(st.principals["x"].tokens["tfirst"].expires_at, NOW + 3600);
        refused(
            &mut st,
            create_token_cmd(&admin(), "x", "t2", 7200),
            Reason::Invalid,
        );
    }

    #[test]
    fn expired_tokens_stop_working() {
        let mut st = booted();
        ok(&mut st, create_principal_cmd(&admin(), ROOT, "x", "", 60));
        grant_direct(&mut st, ROOT, "x", &["project.admin"]);
        st.authenticate(&as_actor("x", "tfirst"), NOW + 59).unwrap();
        assert_eq!(
            st.authenticate(&as_actor("x", "tfirst"), NOW + 60)
                .unwrap_err()
                .reason,
            Reason::Unauthenticated
        );
        let mut late = create_project_cmd(&as_actor("x", "tfirst"), ROOT, "p", &[]);
        if let Command::CreateProject { now, .. } = &mut late {
            *now = NOW + 61;
        }
        refused(&mut st, late, Reason::Unauthenticated);
    }

    #[test]
    fn the_administrator_cannot_be_deleted_or_lose_root() {
        let mut st = booted();
        refused(
            &mut st,
            Command::DeletePrincipal {
                actor: admin(),
                principal: "admin".into(),
                now: NOW,
            },
            Reason::Invalid,
        );
        refused(
            &mut st,
            revoke_cmd(&admin(), ROOT, "admin", &[]),
            Reason::Invalid,
        );
        assert!(st.holds("admin", ROOT, "fleet.operate"));
    }

    #[test]
    fn deleting_a_principal_removes_its_grants_and_bumps_the_epoch() {
        let mut st = booted();
        ok(&mut st, create_project_cmd(&admin(), ROOT, "a", &[]));
        ok(
            &mut st,
            create_principal_cmd(&admin(), "root/a", "x", "", 0),
        );
        ok(&mut st, grant_cmd(&admin(), ROOT, "x", &["layer.use"]));
        let bob = add_principal(&mut st, ROOT, "bob");
        refused(
            &mut st,
            Command::DeletePrincipal {
                actor: bob.clone(),
                principal: "x".into(),
                now: NOW,
            },
            Reason::Forbidden,
        );
        grant_direct(&mut st, "root/a", "bob", &["project.admin"]);
        let epoch = st.epoch;
        ok(
            &mut st,
            Command::DeletePrincipal {
                actor: bob,
                principal: "x".into(),
                now: NOW,
            },
        );
        assert!(!st.principals.contains_key("x"));
        assert!(!st.projects[ROOT].policies.contains_key("x"));
        assert_eq!(st.epoch, epoch + 1);
        refused(
            &mut st,
            Command::DeletePrincipal {
                actor: admin(),
                principal: "x".into(),
                now: NOW,
            },
            Reason::NotFound,
        );
    }

    #[test]
    fn delegation_is_bounded_by_what_the_granter_holds() {
        let mut st = booted();
        ok(&mut st, create_project_cmd(&admin(), ROOT, "a", &[]));
        let lead = add_principal(&mut st, "root/a", "lead");
        add_principal(&mut st, "root/a", "worker");
        refused(
            &mut st,
            grant_cmd(&lead, "root/a", "worker", &["sandbox.create"]),
            Reason::Forbidden,
        );
        ok(
            &mut st,
            grant_cmd(
                &admin(),
                "root/a",
                "lead",
                &["project.admin", "sandbox.create"],
            ),
        );
        ok(
            &mut st,
            grant_cmd(&lead, "root/a", "worker", &["sandbox.create"]),
        );
        let e = refused(
            &mut st,
            grant_cmd(
                &lead,
                "root/a",
                "worker",
                &["sandbox.create", "layer.publish"],
            ),
            Reason::Forbidden,
        );
        assert!(e.message.contains("layer.publish"), "{}", e.message);
        // Not above its own project.
        refused(
            &mut st,
            grant_cmd(&lead, ROOT, "worker", &["sandbox.create"]),
            Reason::Forbidden,
        );
        // Inherited permissions may be granted on subprojects.
        ok(&mut st, create_project_cmd(&lead, "root/a", "sub", &[]));
        ok(
            &mut st,
            grant_cmd(&lead, "root/a/sub", "worker", &["project.admin"]),
        );
        refused(
            &mut st,
            grant_cmd(&admin(), ROOT, "worker", &["root.everything"]),
            Reason::Invalid,
        );
        refused(
            &mut st,
            grant_cmd(&admin(), ROOT, "worker", &[]),
            Reason::Invalid,
        );
        refused(
            &mut st,
            grant_cmd(&admin(), ROOT, "nobody", &["layer.use"]),
            Reason::NotFound,
        );
        refused(
            &mut st,
            grant_cmd(&admin(), "root/zz", "worker", &["layer.use"]),
            Reason::NotFound,
        );
    }

    #[test]
    fn revoke_needs_project_admin_bumps_the_epoch_and_empty_means_all() {
        let mut st = booted();
        ok(&mut st, create_project_cmd(&admin(), ROOT, "a", &[]));
        add_principal(&mut st, "root/a", "worker");
        let lead = add_principal(&mut st, "root/a", "lead");
        ok(
            &mut st,
            grant_cmd(
                &admin(),
                "root/a",
                "worker",
                &["sandbox.create", "sandbox.operate", "layer.use"],
            ),
        );
        refused(
            &mut st,
            revoke_cmd(&lead, "root/a", "worker", &["layer.use"]),
            Reason::Forbidden,
        );
        grant_direct(&mut st, "root/a", "lead", &["project.admin"]);
        let epoch = st.epoch;
        ok(
            &mut st,
            revoke_cmd(&lead, "root/a", "worker", &["layer.use"]),
        );
        assert_eq!(st.epoch, epoch + 1);
        assert!(!st.holds("worker", "root/a", "layer.use"));
        assert!(st.holds("worker", "root/a", "sandbox.create"));
        ok(&mut st, revoke_cmd(&lead, "root/a", "worker", &[]));
        assert!(!st.projects["root/a"].policies.contains_key("worker"));
        assert_eq!(st.epoch, epoch + 2);
    }

    #[test]
    fn principals_manage_their_own_tokens_and_admins_their_principals() {
        let mut st = booted();
        ok(&mut st, create_project_cmd(&admin(), ROOT, "a", &[]));
        ok(
            &mut st,
            create_principal_cmd(&admin(), "root/a", "x", "", 0),
        );
        let x = as_actor("x", "tfirst");
        ok(&mut st, create_token_cmd(&x, "x", "t2", 0));
        assert_eq!(st.principals["x"].tokens["t2"].description, "node-7");
        assert_eq!(st.principals["x"].tokens["t2"].created_by, "x");
        refused(
            &mut st,
            create_token_cmd(&x, "x", "t2", 0),
            Reason::Conflict,
        );
        // Another principal without project.admin on root/a may not.
        let bob = add_principal(&mut st, ROOT, "bob");
        refused(
            &mut st,
            create_token_cmd(&bob, "x", "t3", 0),
            Reason::Forbidden,
        );
        refused(
            &mut st,
            Command::RevokeToken {
                actor: bob.clone(),
                principal: "x".into(),
                token_id: "t2".into(),
                now: NOW,
            },
            Reason::Forbidden,
        );
        // x may not manage bob's.
        refused(
            &mut st,
            create_token_cmd(&x, "bob", "t3", 0),
            Reason::Forbidden,
        );
        grant_direct(&mut st, "root/a", "bob", &["project.admin"]);
        ok(&mut st, create_token_cmd(&bob, "x", "t3", 0));
        let epoch = st.epoch;
        ok(
            &mut st,
            Command::RevokeToken {
                actor: bob,
                principal: "x".into(),
                token_id: "t2".into(),
                now: NOW,
            },
        );
        assert_eq!(st.epoch, epoch + 1);
        assert_eq!(
            st.authenticate(&as_actor("x", "t2"), NOW)
                .unwrap_err()
                .reason,
            Reason::Unauthenticated
        );
        refused(
            &mut st,
            Command::RevokeToken {
                actor: x.clone(),
                principal: "x".into(),
                token_id: "t2".into(),
                now: NOW,
            },
            Reason::NotFound,
        );
        // Revoking its own last token locks the principal out of further commands.
        ok(
            &mut st,
            Command::RevokeToken {
                actor: x.clone(),
                principal: "x".into(),
                token_id: "tfirst".into(),
                now: NOW,
            },
        );
        refused(
            &mut st,
            create_token_cmd(&x, "x", "t9", 0),
            Reason::Unauthenticated,
        );
    }

    #[test]
    fn token_inputs_are_checked() {
        let mut st = booted();
        let mut bad_id = create_token_cmd(&admin(), "admin", "t.1", 0);
        refused(&mut st, bad_id.clone(), Reason::Invalid);
        if let Command::CreateToken {
            token, description, ..
        } = &mut bad_id
        {
            token.id = "t1".into();
            *description = "x".repeat(300);
        }
        refused(&mut st, bad_id, Reason::Invalid);
        refused(
            &mut st,
            create_token_cmd(&admin(), "nobody", "t1", 0),
            Reason::NotFound,
        );
    }
}
