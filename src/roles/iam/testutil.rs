//! Helpers for the state-machine unit tests: a bootstrapped state, actors, and `apply`
//! wrappers that check a refused command left the state untouched.

use std::collections::BTreeMap;

use super::apply::apply;
use super::command::{Command, NewToken, Outcome};
use super::state::{Actor, IamState, Principal, Token};
use super::tokens::hash_secret;
use crate::types::{Failure, Reason};

/// A fixed "now": 2026-09-22T..Z.
pub const NOW: i64 = 1_790_000_000;

pub fn q(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

pub fn booted_with_quota(root_quota: &[(&str, f64)]) -> IamState {
    let mut st = IamState::default();
    let cmd = Command::Bootstrap {
        admin_id: "admin".into(),
        admin_token: Some(NewToken {
            id: "primary".into(),
            hash: hash_secret("adminsecret"),
        }),
        root_quota: q(root_quota),
        max_token_ttl_s: 0,
        now: NOW - 1000,
    };
    apply(&mut st, &cmd).expect("bootstrap");
    st
}

pub fn booted() -> IamState {
    booted_with_quota(&[])
}

/// The administrator acting with its bootstrap token `dsk.admin.adminsecret`.
pub fn admin() -> Actor {
    Actor {
        principal: "admin".into(),
        token_id: "primary".into(),
        secret_hash: hash_secret("adminsecret"),
    }
}

/// Inserts a principal directly (token `dsk.<id>.t1.sec-<id>`) and returns it as an actor.
pub fn add_principal(st: &mut IamState, project: &str, id: &str) -> Actor {
    let mut p = Principal {
        project: project.into(),
        kind: "agent".into(),
        ..Default::default()
    };
    p.tokens.insert(
        "t1".into(),
        Token {
            hash: hash_secret(&format!("sec-{id}")),
            ..Default::default()
        },
    );
    st.principals.insert(id.into(), p);
    Actor {
        principal: id.into(),
        token_id: "t1".into(),
        secret_hash: hash_secret(&format!("sec-{id}")),
    }
}

/// Grants directly, bypassing the rules (test setup).
pub fn grant_direct(st: &mut IamState, project: &str, principal: &str, perms: &[&str]) {
    let set = st
        .projects
        .get_mut(project)
        .expect("project")
        .policies
        .entry(principal.into())
        .or_default();
    for p in perms {
        set.insert(p.to_string());
    }
}

/// Applies a command that must succeed.
pub fn ok(st: &mut IamState, cmd: Command) -> Outcome {
    match apply(st, &cmd) {
        Ok(o) => o,
        Err(e) => panic!("{} refused: {e}", cmd.name()),
    }
}

/// Applies a command that must be refused with `reason`, and checks it changed nothing.
pub fn refused(st: &mut IamState, cmd: Command, reason: Reason) -> Failure {
    let before = st.clone();
    match apply(st, &cmd) {
        Ok(o) => panic!("{} applied ({o:?}), expected {reason}", cmd.name()),
        Err(e) => {
            assert_eq!(e.reason, reason, "{}: {e}", cmd.name());
            assert_eq!(
                *st,
                before,
                "{} changed the state although refused",
                cmd.name()
            );
            e
        }
    }
}

pub fn create_project_cmd(
    actor: &Actor,
    parent: &str,
    name: &str,
    quota: &[(&str, f64)],
) -> Command {
    Command::CreateProject {
        actor: actor.clone(),
        parent: parent.into(),
        name: name.into(),
        quota: q(quota),
        now: NOW,
    }
}

pub fn set_quota_cmd(actor: &Actor, project: &str, quota: &[(&str, f64)]) -> Command {
    Command::SetQuota {
        actor: actor.clone(),
        project: project.into(),
        quota: q(quota),
        now: NOW,
    }
}

pub fn delete_project_cmd(actor: &Actor, project: &str) -> Command {
    Command::DeleteProject {
        actor: actor.clone(),
        project: project.into(),
        now: NOW,
    }
}

pub fn perms(p: &[&str]) -> Vec<String> {
    p.iter().map(|s| s.to_string()).collect()
}
