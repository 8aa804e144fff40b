//! The deterministic commands that change IAM state (docs/architecture.md "Rules of the codebase"). Every value that is not a
//! function of the state (time, token ids, secret hashes) is chosen by the proposer and
//! written into the command, so a log of commands replays to the same state on any replica.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::backup::Backup;
use super::state::Actor;
use crate::types::{Failure, Res};

/// A token being issued: its id and the hash of its secret (the secret itself never enters
/// a command, a log or a snapshot).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewToken {
    pub id: String,
    /// Hex SHA-256 of the secret.
    pub hash: String,
}

/// One sandbox's reservation in an `Admit` batch.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AdmitItem {
    pub lease_id: String,
    pub project: String,
    pub resources: Res,
    /// "" = not bound to an edge yet.
    pub edge_id: String,
    pub sandbox_id: String,
    /// Leave an existing binding as it is (see `keep_binding` in iam.proto).
    #[serde(default)]
    pub keep_binding: bool,
    /// The spec's digest (`spec_digest` in iam.proto); "" = not checked.
    #[serde(default)]
    pub spec_digest: String,
}

/// A lease an edge reports alive (`Reconcile`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaseReport {
    pub lease_id: String,
    pub project: String,
    pub principal: String,
    pub resources: Res,
    pub sandbox_id: String,
    /// Unix seconds; 0 or later than the command's `now` = `now`.
    pub created_at: i64,
}

/// Every state change of IAM. `now` fields are unix seconds chosen by the proposer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    /// First start: the root project and the administrator with every permission on root
    /// and (when configured) the bootstrap token. `conflict` once bootstrapped.
    Bootstrap {
        admin_id: String,
        admin_token: Option<NewToken>,
        root_quota: BTreeMap<String, f64>,
        max_token_ttl_s: i64,
        now: i64,
    },
    /// Applies the operator settings of the config at a later start (root quota, token TTL).
    Configure {
        root_quota: BTreeMap<String, f64>,
        max_token_ttl_s: i64,
    },
    CreateProject {
        actor: Actor,
        parent: String,
        name: String,
        quota: BTreeMap<String, f64>,
        now: i64,
    },
    SetQuota {
        actor: Actor,
        project: String,
        quota: BTreeMap<String, f64>,
        now: i64,
    },
    DeleteProject {
        actor: Actor,
        project: String,
        now: i64,
    },
    /// Creates a principal and its first token; `ttl` 0 = the default lifetime.
    CreatePrincipal {
        actor: Actor,
        project: String,
        principal: String,
        kind: String,
        token: NewToken,
        ttl: i64,
        now: i64,
    },
    DeletePrincipal {
        actor: Actor,
        principal: String,
        now: i64,
    },
    Grant {
        actor: Actor,
        project: String,
        principal: String,
        permissions: Vec<String>,
        now: i64,
    },
    /// Empty `permissions` = all held directly on the project.
    Revoke {
        actor: Actor,
        project: String,
        principal: String,
        permissions: Vec<String>,
        now: i64,
    },
    CreateToken {
        actor: Actor,
        principal: String,
        token: NewToken,
        ttl: i64,
        description: String,
        now: i64,
    },
    RevokeToken {
        actor: Actor,
        principal: String,
        token_id: String,
        now: i64,
    },
    /// Authenticates, authorizes and reserves quota for each item independently.
    Admit {
        actor: Actor,
        image_project: String,
        items: Vec<AdmitItem>,
        now: i64,
    },
    /// Releases leases that ended at `at` (0 or later than `now` = `now`); unknown ids are ignored.
    /// `not_created`: no sandbox was ever made for them, so their admissions leave no usage.
    ReleaseLeases {
        lease_ids: Vec<String>,
        at: i64,
        now: i64,
        #[serde(default)]
        not_created: bool,
    },
    /// The leases alive on `edge_id`: unknown ones are adopted, missing ones older than
    /// `min_age_s` are released (an empty list with `min_age_s` 0 releases the edge's all).
    Reconcile {
        edge_id: String,
        leases: Vec<LeaseReport>,
        min_age_s: i64,
        now: i64,
    },
    /// Releases leases bound to no edge and older than `max_age_s`.
    SweepUnbound { max_age_s: i64, now: i64 },
    /// Replaces everything but leases and operator settings with a backup; bumps the epoch.
    Restore {
        actor: Actor,
        backup: Box<Backup>,
        now: i64,
    },
    /// Takes the named lock for `holder` until `now_ms + ttl_ms`, or renews it if `holder`
    /// has it (`conflict` while another holds it). Unix milliseconds.
    Lock {
        name: String,
        holder: String,
        ttl_ms: i64,
        now_ms: i64,
    },
    /// Gives up the named lock (`holder` must hold it, expired or not).
    Unlock { name: String, holder: String },
    /// Writes a key of the key-value area. `if_revision`: `Some(0)` = only if absent,
    /// `Some(r)` = only if its last write was revision `r` (compare-and-set).
    KvPut {
        key: String,
        #[serde(with = "super::state::b64")]
        value: Vec<u8>,
        if_revision: Option<u64>,
    },
    /// Deletes a key; `if_revision` as for `KvPut`.
    KvDelete {
        key: String,
        if_revision: Option<u64>,
    },
    /// Applies `cmd` only while lock `lock` is still held with fence `fence` (`conflict`
    /// otherwise): a call from a holder that has since lost the lock, committed late,
    /// changes nothing.
    Fenced {
        lock: String,
        fence: u64,
        cmd: Box<Command>,
    },
}

impl Command {
    /// The command's name, for logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Command::Bootstrap { .. } => "bootstrap",
            Command::Configure { .. } => "configure",
            Command::CreateProject { .. } => "create_project",
            Command::SetQuota { .. } => "set_quota",
            Command::DeleteProject { .. } => "delete_project",
            Command::CreatePrincipal { .. } => "create_principal",
            Command::DeletePrincipal { .. } => "delete_principal",
            Command::Grant { .. } => "grant",
            Command::Revoke { .. } => "revoke",
            Command::CreateToken { .. } => "create_token",
            Command::RevokeToken { .. } => "revoke_token",
            Command::Admit { .. } => "admit",
            Command::ReleaseLeases { .. } => "release_leases",
            Command::Reconcile { .. } => "reconcile",
            Command::SweepUnbound { .. } => "sweep_unbound",
            Command::Restore { .. } => "restore",
            Command::Lock { .. } => "lock",
            Command::Unlock { .. } => "unlock",
            Command::KvPut { .. } => "kv_put",
            Command::KvDelete { .. } => "kv_delete",
            Command::Fenced { cmd, .. } => cmd.name(),
        }
    }
}

/// What an admitted (or rebound) item reports back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Admitted {
    /// The lease was already held: a retry; nothing was charged again.
    pub existed: bool,
    /// Where the lease was bound before this call ("" if new).
    pub prev_edge_id: String,
    pub prev_sandbox_id: String,
}

/// The result of a command that applied.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Done,
    /// The project the command created or changed.
    Project(String),
    /// A token was issued to `principal` (principal creation or token creation).
    Token {
        principal: String,
        token_id: String,
    },
    /// Per-item results of `Admit`, in item order, and the acting principal.
    Admitted {
        principal: String,
        results: Vec<Result<Admitted, Failure>>,
    },
    /// Number of leases released.
    Released(i64),
    Reconciled {
        adopted: i64,
        released: i64,
    },
    /// The lock is held by the proposer until `expires_at_ms`; `fence` as in
    /// [`super::state::LockHold`].
    Locked {
        fence: u64,
        expires_at_ms: i64,
    },
    /// The revision a key-value write or delete was given.
    Revision(u64),
}
