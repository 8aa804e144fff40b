//! The one function that changes IAM state, and the project-tree commands (docs/concepts.md).
//! Each handler checks every rule before its first mutation, so a command that fails changes
//! nothing, and the result depends only on the state and the command (replicas agree).

use std::collections::{BTreeMap, BTreeSet};

use super::command::{Command, Outcome};
use super::state::{
    check_hash, check_quota_map, check_token_id, Actor, IamState, Principal, Project, Token, ROOT,
};
use super::{apply_kv, apply_leases, apply_principals, backup};
use crate::types::{names, Failure};

/// Applies one command to the state. `Err` means the command was refused and the state is
/// unchanged; its reason is the one the caller sees (`unauthenticated`, `forbidden`,
/// `not_found`, `invalid`, `conflict`, `quota_exceeded`).
pub fn apply(st: &mut IamState, cmd: &Command) -> Result<Outcome, Failure> {
    match cmd {
        Command::Bootstrap {
            admin_id,
            admin_token,
            root_quota,
            max_token_ttl_s,
            now,
        } => bootstrap(
            st,
            admin_id,
            admin_token.as_ref(),
            root_quota,
            *max_token_ttl_s,
            *now,
        ),
        Command::Configure {
            root_quota,
            max_token_ttl_s,
        } => configure(st, root_quota, *max_token_ttl_s),
        Command::CreateProject {
            actor,
            parent,
            name,
            quota,
            now,
        } => create_project(st, actor, parent, name, quota, *now),
        Command::SetQuota {
            actor,
            project,
            quota,
            now,
        } => set_quota(st, actor, project, quota, *now),
        Command::DeleteProject {
            actor,
            project,
            now,
        } => delete_project(st, actor, project, *now),
        Command::CreatePrincipal {
            actor,
            project,
            principal,
            kind,
            token,
            ttl,
            now,
        } => apply_principals::create_principal(
            st, actor, project, principal, kind, token, *ttl, *now,
        ),
        Command::DeletePrincipal {
            actor,
            principal,
            now,
        } => apply_principals::delete_principal(st, actor, principal, *now),
        Command::Grant {
            actor,
            project,
            principal,
            permissions,
            now,
        } => apply_principals::grant(st, actor, project, principal, permissions, *now),
        Command::Revoke {
            actor,
            project,
            principal,
            permissions,
            now,
        } => apply_principals::revoke(st, actor, project, principal, permissions, *now),
        Command::CreateToken {
            actor,
            principal,
            token,
            ttl,
            description,
            now,
        } => apply_principals::create_token(st, actor, principal, token, *ttl, description, *now),
        Command::RevokeToken {
            actor,
            principal,
            token_id,
            now,
        } => apply_principals::revoke_token(st, actor, principal, token_id, *now),
        Command::Admit {
            actor,
            image_project,
            items,
            now,
        } => apply_leases::admit(st, actor, image_project, items, *now),
        Command::ReleaseLeases {
            lease_ids,
            at,
            now,
            not_created,
        } => apply_leases::release_leases(st, lease_ids, *at, *now, *not_created),
        Command::Reconcile {
            edge_id,
            leases,
            min_age_s,
            now,
        } => apply_leases::reconcile(st, edge_id, leases, *min_age_s, *now),
        Command::SweepUnbound { max_age_s, now } => {
            apply_leases::sweep_unbound(st, *max_age_s, *now)
        }
        Command::Restore { actor, backup, now } => backup::restore(st, actor, backup, *now),
        Command::Lock {
            name,
            holder,
            ttl_ms,
            now_ms,
        } => apply_kv::lock(st, name, holder, *ttl_ms, *now_ms),
        Command::Unlock { name, holder } => apply_kv::unlock(st, name, holder),
        Command::KvPut {
            key,
            value,
            if_revision,
        } => apply_kv::put(st, key, value, *if_revision),
        Command::KvDelete { key, if_revision } => apply_kv::delete(st, key, *if_revision),
        Command::Fenced { lock, fence, cmd } => {
            apply_kv::check_fence(st, lock, *fence)?;
            apply(st, cmd)
        }
    }
}

/// Refuses every command but `Bootstrap` until the state is bootstrapped.
pub(super) fn require_bootstrapped(st: &IamState) -> Result<(), Failure> {
    if st.bootstrapped() {
        Ok(())
    } else {
        Err(Failure::unavailable("IAM is not bootstrapped yet"))
    }
}

/// Authenticates the acting principal of a command at `now`.
pub(super) fn actor<'a>(st: &'a IamState, a: &Actor, now: i64) -> Result<&'a Principal, Failure> {
    require_bootstrapped(st)?;
    st.authenticate(a, now)
}

fn bootstrap(
    st: &mut IamState,
    admin_id: &str,
    token: Option<&super::command::NewToken>,
    root_quota: &BTreeMap<String, f64>,
    max_token_ttl_s: i64,
    now: i64,
) -> Result<Outcome, Failure> {
    if st.bootstrapped() {
        return Err(Failure::conflict("IAM is already bootstrapped"));
    }
    names::check_principal_id(admin_id)?;
    check_quota_map(root_quota)?;
    if max_token_ttl_s < 0 {
        return Err(Failure::invalid("max_token_ttl_s may not be negative"));
    }
    if let Some(t) = token {
        check_token_id(&t.id)?;
        check_hash(&t.hash)?;
    }
    let mut root = Project {
        quota: root_quota.clone(),
        created_at: now,
        ..Default::default()
    };
    root.policies.insert(
        admin_id.to_string(),
        names::PERMISSIONS.iter().map(|p| p.to_string()).collect(),
    );
    let mut admin = Principal {
        project: ROOT.into(),
        kind: "user".into(),
        created_at: now,
        created_by: admin_id.into(),
        ..Default::default()
    };
    if let Some(t) = token {
        admin.tokens.insert(
            t.id.clone(),
            Token {
                hash: t.hash.clone(),
                created_at: now,
                expires_at: 0,
                description: "bootstrap".into(),
                created_by: admin_id.into(),
            },
        );
    }
    st.projects.insert(ROOT.into(), root);
    st.principals.insert(admin_id.to_string(), admin);
    st.admin_id = admin_id.to_string();
    st.settings.root_quota = root_quota.clone();
    st.settings.max_token_ttl_s = max_token_ttl_s;
    st.epoch = st.epoch.max(1);
    Ok(Outcome::Project(ROOT.into()))
}

fn configure(
    st: &mut IamState,
    root_quota: &BTreeMap<String, f64>,
    max_token_ttl_s: i64,
) -> Result<Outcome, Failure> {
    require_bootstrapped(st)?;
    check_quota_map(root_quota)?;
    if max_token_ttl_s < 0 {
        return Err(Failure::invalid("max_token_ttl_s may not be negative"));
    }
    st.settings.root_quota = root_quota.clone();
    st.settings.max_token_ttl_s = max_token_ttl_s;
    if let Some(root) = st.projects.get_mut(ROOT) {
        root.quota = root_quota.clone();
    }
    Ok(Outcome::Done)
}

fn create_project(
    st: &mut IamState,
    a: &Actor,
    parent: &str,
    name: &str,
    quota: &BTreeMap<String, f64>,
    now: i64,
) -> Result<Outcome, Failure> {
    actor(st, a, now)?;
    names::check_project_name(name)?;
    st.project(parent)?;
    let path = format!("{parent}/{name}");
    names::check_project_path(&path)?;
    st.require(&a.principal, parent, "project.admin")?;
    if st.projects.contains_key(&path) {
        return Err(Failure::conflict(format!("project {path} already exists")));
    }
    let resolved = st.resolve_quota(parent, quota)?;
    st.projects.insert(
        path.clone(),
        Project {
            quota: resolved,
            created_at: now,
            ..Default::default()
        },
    );
    Ok(Outcome::Project(path))
}

fn set_quota(
    st: &mut IamState,
    a: &Actor,
    project: &str,
    quota: &BTreeMap<String, f64>,
    now: i64,
) -> Result<Outcome, Failure> {
    actor(st, a, now)?;
    st.project(project)?;
    let Some(parent) = names::project_parent(project) else {
        return Err(Failure::invalid(
            "root's quota is set by the operators' config (iam.root_quota)",
        ));
    };
    st.require(&a.principal, parent, "project.admin")?;
    let resolved = st.resolve_quota(parent, quota)?;
    if let Some(p) = st.projects.get_mut(project) {
        p.quota = resolved;
    }
    Ok(Outcome::Project(project.to_string()))
}

fn delete_project(
    st: &mut IamState,
    a: &Actor,
    project: &str,
    now: i64,
) -> Result<Outcome, Failure> {
    actor(st, a, now)?;
    let p = st.project(project)?;
    let Some(parent) = names::project_parent(project) else {
        return Err(Failure::invalid("root cannot be deleted"));
    };
    st.require(&a.principal, parent, "project.admin")?;
    if st.has_children(project) {
        return Err(Failure::conflict(format!(
            "project {project} still has subprojects"
        )));
    }
    if p.usage != Default::default() {
        return Err(Failure::conflict(format!(
            "project {project} still holds quota (running or paused sandboxes)"
        )));
    }
    let own: BTreeSet<&String> = st
        .principals
        .iter()
        .filter(|(_, pr)| pr.project == project)
        .map(|(id, _)| id)
        .collect();
    if let Some(first) = own.iter().next() {
        return Err(Failure::conflict(format!(
            "project {project} still has {} principal(s) of its own, e.g. {first}",
            own.len()
        )));
    }
    st.projects.remove(project);
    // Its grants are gone with it: caches of them must drop.
    st.epoch += 1;
    Ok(Outcome::Done)
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;
    use crate::types::{Reason, Res};

    #[test]
    fn bootstrap_creates_root_and_admin_once() {
        let st = booted();
        assert!(st.projects.contains_key(ROOT));
        let admin = &st.principals["admin"];
        assert_eq!(admin.tokens["primary"].expires_at, 0);
        assert_eq!(
            st.projects[ROOT].policies["admin"].len(),
            names::PERMISSIONS.len()
        );
        let mut st2 = st.clone();
        let again = Command::Bootstrap {
            admin_id: "admin".into(),
            admin_token: None,
            root_quota: BTreeMap::new(),
            max_token_ttl_s: 0,
            now: NOW,
        };
        assert_eq!(
            apply(&mut st2, &again).unwrap_err().reason,
            Reason::Conflict
        );
        assert_eq!(st2, st);
    }

    #[test]
    fn commands_before_bootstrap_are_refused() {
        let mut st = IamState::default();
        let e = apply(&mut st, &create_project_cmd(&admin(), ROOT, "a", &[])).unwrap_err();
        assert_eq!(e.reason, Reason::Unavailable);
        assert_eq!(st, IamState::default());
    }

    #[test]
    fn projects_form_a_tree_with_valid_names() {
        let mut st = booted();
        ok(&mut st, create_project_cmd(&admin(), ROOT, "team-a", &[]));
        ok(
            &mut st,
            create_project_cmd(&admin(), "root/team-a", "rl", &[]),
        );
        assert!(st.projects.contains_key("root/team-a/rl"));
        for bad in ["a/b", "a b", "", ".."] {
            refused(
                &mut st,
                create_project_cmd(&admin(), ROOT, bad, &[]),
                Reason::Invalid,
            );
        }
        refused(
            &mut st,
            create_project_cmd(&admin(), "root/nope", "x", &[]),
            Reason::NotFound,
        );
        refused(
            &mut st,
            create_project_cmd(&admin(), ROOT, "team-a", &[]),
            Reason::Conflict,
        );
    }

    #[test]
    fn creating_a_project_needs_project_admin_on_the_parent() {
        let mut st = booted();
        ok(&mut st, create_project_cmd(&admin(), ROOT, "team-a", &[]));
        let bob = add_principal(&mut st, "root/team-a", "bob");
        refused(
            &mut st,
            create_project_cmd(&bob, "root/team-a", "x", &[]),
            Reason::Forbidden,
        );
        grant_direct(&mut st, "root/team-a", "bob", &["project.admin"]);
        ok(&mut st, create_project_cmd(&bob, "root/team-a", "x", &[]));
        refused(
            &mut st,
            create_project_cmd(&bob, ROOT, "y", &[]),
            Reason::Forbidden,
        );
    }

    #[test]
    fn quotas_are_bounded_by_every_ancestor_and_missing_keys_inherit() {
        let mut st = booted_with_quota(&[("sandboxes", 100.0)]);
        ok(
            &mut st,
            create_project_cmd(
                &admin(),
                ROOT,
                "a",
                &[("sandboxes", 10.0), ("cpu_cores", 20.0)],
            ),
        );
        ok(
            &mut st,
            create_project_cmd(&admin(), "root/a", "b", &[("gpus", 1.0)]),
        );
        assert_eq!(
            st.projects["root/a/b"].quota,
            q(&[("sandboxes", 10.0), ("cpu_cores", 20.0), ("gpus", 1.0)])
        );
        let e = refused(
            &mut st,
            create_project_cmd(&admin(), "root/a", "c", &[("cpu_cores", 21.0)]),
            Reason::Invalid,
        );
        assert!(
            e.message.contains("root/a") && e.message.contains("cpu_cores"),
            "{}",
            e.message
        );
        let e = refused(
            &mut st,
            create_project_cmd(&admin(), ROOT, "d", &[("sandboxes", 101.0)]),
            Reason::Invalid,
        );
        assert!(e.message.contains("root's sandboxes"), "{}", e.message);
        refused(
            &mut st,
            create_project_cmd(&admin(), ROOT, "d", &[("sandboxes", f64::NAN)]),
            Reason::Invalid,
        );
        refused(
            &mut st,
            create_project_cmd(&admin(), ROOT, "d", &[("sandboxes", -1.0)]),
            Reason::Invalid,
        );
        refused(
            &mut st,
            create_project_cmd(&admin(), ROOT, "d", &[("sandboxes", 1e13)]),
            Reason::Invalid,
        );
        refused(
            &mut st,
            create_project_cmd(&admin(), ROOT, "d", &[("disks", 1.0)]),
            Reason::Invalid,
        );
    }

    #[test]
    fn set_quota_needs_admin_on_the_parent_and_replaces_the_whole_quota() {
        let mut st = booted();
        ok(
            &mut st,
            create_project_cmd(&admin(), ROOT, "a", &[("sandboxes", 10.0), ("gpus", 4.0)]),
        );
        ok(
            &mut st,
            create_project_cmd(&admin(), "root/a", "b", &[("sandboxes", 5.0)]),
        );
        let bob = add_principal(&mut st, "root/a", "bob");
        grant_direct(&mut st, "root/a/b", "bob", &["project.admin"]);
        // A project's own admins cannot raise their own quota.
        refused(
            &mut st,
            set_quota_cmd(&bob, "root/a/b", &[("sandboxes", 6.0)]),
            Reason::Forbidden,
        );
        grant_direct(&mut st, "root/a", "bob", &["project.admin"]);
        ok(
            &mut st,
            set_quota_cmd(&bob, "root/a/b", &[("sandboxes", 6.0)]),
        );
        assert_eq!(
            st.projects["root/a/b"].quota,
            q(&[("sandboxes", 6.0), ("gpus", 4.0)])
        );
        let e = refused(
            &mut st,
            set_quota_cmd(&bob, "root/a/b", &[("sandboxes", 11.0)]),
            Reason::Invalid,
        );
        assert!(e.message.contains("root/a's sandboxes"), "{}", e.message);
        refused(
            &mut st,
            set_quota_cmd(&admin(), ROOT, &[("sandboxes", 1.0)]),
            Reason::Invalid,
        );
        refused(
            &mut st,
            set_quota_cmd(&admin(), "root/zz", &[]),
            Reason::NotFound,
        );
    }

    #[test]
    fn only_empty_projects_can_be_deleted_and_never_root() {
        let mut st = booted();
        ok(&mut st, create_project_cmd(&admin(), ROOT, "a", &[]));
        ok(&mut st, create_project_cmd(&admin(), "root/a", "b", &[]));
        refused(&mut st, delete_project_cmd(&admin(), ROOT), Reason::Invalid);
        refused(
            &mut st,
            delete_project_cmd(&admin(), "root/a"),
            Reason::Conflict,
        );
        add_principal(&mut st, "root/a/b", "bob");
        refused(
            &mut st,
            delete_project_cmd(&admin(), "root/a/b"),
            Reason::Conflict,
        );
        st.principals.remove("bob");
        st.charge(
            "root/a/b",
            &Res {
                sandboxes: 1,
                ..Default::default()
            },
        );
        refused(
            &mut st,
            delete_project_cmd(&admin(), "root/a/b"),
            Reason::Conflict,
        );
        st.uncharge(
            "root/a/b",
            &Res {
                sandboxes: 1,
                ..Default::default()
            },
        );
        let epoch = st.epoch;
        ok(&mut st, delete_project_cmd(&admin(), "root/a/b"));
        assert!(!st.projects.contains_key("root/a/b"));
        assert!(st.epoch > epoch);
        ok(&mut st, delete_project_cmd(&admin(), "root/a"));
        refused(
            &mut st,
            delete_project_cmd(&admin(), "root/a"),
            Reason::NotFound,
        );
    }

    #[test]
    fn deleting_needs_admin_on_the_parent() {
        let mut st = booted();
        ok(&mut st, create_project_cmd(&admin(), ROOT, "a", &[]));
        ok(&mut st, create_project_cmd(&admin(), "root/a", "b", &[]));
        let bob = add_principal(&mut st, ROOT, "bob");
        grant_direct(&mut st, "root/a/b", "bob", &["project.admin"]);
        refused(
            &mut st,
            delete_project_cmd(&bob, "root/a/b"),
            Reason::Forbidden,
        );
        grant_direct(&mut st, "root/a", "bob", &["project.admin"]);
        ok(&mut st, delete_project_cmd(&bob, "root/a/b"));
    }

    #[test]
    fn configure_sets_root_quota_and_token_limit() {
        let mut st = booted();
        ok(
            &mut st,
            Command::Configure {
                root_quota: q(&[("gpus", 8.0)]),
                max_token_ttl_s: 3600,
            },
        );
        assert_eq!(st.projects[ROOT].quota, q(&[("gpus", 8.0)]));
        assert_eq!(st.settings.max_token_ttl_s, 3600);
        refused(
            &mut st,
            Command::Configure {
                root_quota: q(&[("gpus", -8.0)]),
                max_token_ttl_s: 0,
            },
            Reason::Invalid,
        );
    }

    #[test]
    fn a_bad_or_expired_actor_token_is_unauthenticated() {
        let mut st = booted();
        let mut wrong = admin();
        wrong.secret_hash = "0".repeat(64);
        refused(
            &mut st,
            create_project_cmd(&wrong, ROOT, "a", &[]),
            Reason::Unauthenticated,
        );
        let mut ghost = admin();
        ghost.principal = "ghost".into();
        refused(
            &mut st,
            create_project_cmd(&ghost, ROOT, "a", &[]),
            Reason::Unauthenticated,
        );
        st.principals
            .get_mut("admin")
            .unwrap()
            .tokens
            .get_mut("primary")
            .unwrap()
            .expires_at = NOW;
        refused(
            &mut st,
            create_project_cmd(&admin(), ROOT, "a", &[]),
            Reason::Unauthenticated,
        );
    }
}
