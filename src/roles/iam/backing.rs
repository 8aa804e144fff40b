//! What the IAM service runs on: the standalone store (one process, a state file) or a Raft
//! replica (docs/iam-replicas.md). Both take the same commands and give the same state; a
//! replica can also wait for a consistent read.

use std::sync::RwLockReadGuard;

use super::command::{Command, Outcome};
use super::replica::Replica;
use super::state::IamState;
use super::store::Store;
use crate::types::Failure;

/// The standalone store or a replica; clones share it.
#[derive(Clone)]
pub enum IamStore {
    Standalone(Store),
    Replicated(Replica),
}

impl From<Store> for IamStore {
    fn from(s: Store) -> Self {
        IamStore::Standalone(s)
    }
}

impl From<Replica> for IamStore {
    fn from(r: Replica) -> Self {
        IamStore::Replicated(r)
    }
}

impl IamStore {
    /// The state as applied here. Hold the guard briefly.
    pub fn read(&self) -> RwLockReadGuard<'_, IamState> {
        match self {
            IamStore::Standalone(s) => s.read(),
            IamStore::Replicated(r) => r.read(),
        }
    }

    /// Commits `cmd` and answers with its result (see [`Store::propose`],
    /// [`Replica::propose`]).
    pub async fn propose(&self, cmd: Command) -> Result<Outcome, Failure> {
        match self {
            IamStore::Standalone(s) => s.propose(cmd).await,
            IamStore::Replicated(r) => r.propose(cmd).await,
        }
    }

    /// Returns once `read` shows every change committed before the call: at once for the
    /// standalone store, after Raft's read index on a replica (`unavailable` without a
    /// majority).
    pub async fn fresh(&self) -> Result<(), Failure> {
        match self {
            IamStore::Standalone(_) => Ok(()),
            IamStore::Replicated(r) => r.read_index().await,
        }
    }

    /// True on a replica that knows no leader or has stopped: its state may be behind by
    /// any amount, so even what it would allow must be read fresh first.
    pub fn cut_off(&self) -> bool {
        match self {
            IamStore::Standalone(_) => false,
            IamStore::Replicated(r) => r.failed() || r.leader() == 0,
        }
    }

    /// True on a replica (where `read` may trail the leader by a moment).
    pub fn replicated(&self) -> bool {
        matches!(self, IamStore::Replicated(_))
    }

    /// True once a write failed: changes are refused from then on.
    pub fn failed(&self) -> bool {
        match self {
            IamStore::Standalone(s) => s.failed(),
            IamStore::Replicated(r) => r.failed(),
        }
    }

    /// Closes the files (and, for a replica, stops its Raft node).
    pub async fn close(&self) {
        match self {
            IamStore::Standalone(s) => s.close().await,
            IamStore::Replicated(r) => r.close().await,
        }
    }
}
