//! A replicated IAM (docs/iam-replicas.md): the same deterministic commands as the
//! standalone store, committed through Raft (tikv's raft-rs) to a majority of replicas before
//! anyone is answered, and applied in log order on every replica.
//!
//! [`Replica`] is the handle the service uses: `read` for the local state, `propose` for a
//! change (answered when the change is applied here, after its commit), `read_index` before
//! a read that must see every change committed before it began. Any replica takes proposals:
//! a follower's go to the leader inside Raft, and the follower answers when it applies them.
//! One thread per replica owns the Raft node ([`node`]); peers' messages arrive through
//! [`Replica::step`] and leave through a [`Transport`].
//!
//! Raft ids are the replica ids of the config plus one (raft-rs reserves 0).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard};
use std::time::Duration;

use raft::prelude::{ConfState, Message};
use raft::Storage;
use tokio::sync::oneshot;

use super::command::{Command, Outcome};
use super::raftlog::{LogError, RaftLog};
use super::state::IamState;
use crate::types::Failure;

pub mod machine;
pub use machine::Member;
mod node;
pub mod transport;

#[cfg(test)]
mod tests;

/// The raft-rs id of a replica id from the config.
pub fn raft_id(replica: u64) -> u64 {
    replica + 1
}

/// The replica id of a raft-rs id.
pub fn replica_id(raft: u64) -> u64 {
    raft.saturating_sub(1)
}

/// Where a replica's messages go: implementations queue and never block the node thread.
/// Each message's `to` is a raft id. A transport that knows a peer is down, or that a
/// snapshot went out (or did not), tells the node through `reporter`.
pub trait Transport: Send + Sync + 'static {
    fn send(&self, msgs: Vec<Message>, reporter: &Reporter);

    /// The peers changed (a membership change committed, or a snapshot brought another
    /// membership): from now on send to these (raft id, Raft address) only. Called from the
    /// node thread; must not block.
    fn set_peers(&self, _peers: &[(u64, String)]) {}
}

/// Feedback from a transport to its node.
#[derive(Clone)]
pub struct Reporter {
    tx: Sender<Input>,
}

impl Reporter {
    /// `to` could not be reached: Raft slows down sending to it.
    pub fn unreachable(&self, to: u64) {
        let _ = self.tx.send(Input::Unreachable(to));
    }

    /// A snapshot to `to` was delivered (`ok`) or lost.
    pub fn snapshot_sent(&self, to: u64, ok: bool) {
        let _ = self.tx.send(Input::SnapshotSent { to, ok });
    }
}

pub(crate) enum Input {
    Propose {
        tag: u128,
        data: Vec<u8>,
        reply: oneshot::Sender<Result<Outcome, Failure>>,
    },
    ReadIndex(oneshot::Sender<Result<(), Failure>>),
    ChangeMember {
        change: Change,
        reply: oneshot::Sender<Result<(), Failure>>,
    },
    Step(Box<Message>),
    Unreachable(u64),
    SnapshotSent {
        to: u64,
        ok: bool,
    },
    Status(oneshot::Sender<Status>),
    Close(oneshot::Sender<()>),
}

/// A membership change asked of [`Replica::change_member`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// Add a voter at these addresses.
    Add(Member),
    /// Remove the voter with this replica id.
    Remove(u64),
}

/// A replica's view of the group (raft ids).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    pub id: u64,
    /// 0 = none known.
    pub leader: u64,
    pub term: u64,
    pub commit: u64,
    pub applied: u64,
    pub voters: Vec<u64>,
    pub learners: Vec<u64>,
    /// On the leader: each member's matched index.
    pub progress: Vec<(u64, u64)>,
    /// Snapshots from a leader installed since this replica started.
    pub snapshots_installed: u64,
    /// The members' addresses as this replica knows them.
    pub members: Vec<Member>,
    /// This replica was removed from the group.
    pub removed: bool,
}

/// How a replica runs.
#[derive(Debug, Clone)]
pub struct Options {
    /// This replica's raft id.
    pub id: u64,
    /// The voters of a new group (raft ids): used only when the log is empty and `join` is
    /// false.
    pub voters: Vec<u64>,
    /// The members' addresses (the config's replicas): used until a snapshot or a
    /// membership change says otherwise.
    pub members: Vec<Member>,
    /// Holds `raft.redb`.
    pub dir: PathBuf,
    /// Start with no membership and wait for a leader to add this replica.
    pub join: bool,
    /// Raft's clock: elections after 10–20 ticks without a leader, heartbeats every tick.
    pub tick: Duration,
    /// How long a change or a consistent read may wait for a majority before it fails with
    /// `unavailable`.
    pub commit_timeout: Duration,
    /// Take a snapshot (and drop the log before it) every this many applied entries.
    pub snapshot_every: u64,
    /// Export `opendsec_iam_leader` and `opendsec_iam_leases` (false in tests that run
    /// several replicas in one process).
    pub metrics: bool,
}

impl Options {
    /// The defaults for a replica `id` (raft id) of `voters` with its files in `dir`.
    pub fn new(id: u64, voters: Vec<u64>, dir: PathBuf) -> Options {
        Options {
            id,
            voters,
            members: Vec::new(),
            dir,
            join: false,
            tick: Duration::from_millis(100),
            commit_timeout: Duration::from_secs(5),
            snapshot_every: 10_000,
            metrics: true,
        }
    }
}

/// Why a replica could not start.
#[derive(Debug, thiserror::Error)]
pub enum ReplicaError {
    #[error("IAM replica data directory {}: {source}", path.display())]
    Dir {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("IAM replica: reading its snapshot: {0}")]
    Snapshot(serde_json::Error),
    #[error("IAM replica: {0}")]
    Raft(#[from] raft::Error),
    #[error("IAM replica: starting its thread: {0}")]
    Thread(std::io::Error),
}

pub(crate) struct Shared {
    state: RwLock<IamState>,
    leader: AtomicU64,
    is_leader: AtomicBool,
    failed: AtomicBool,
    /// Set once a committed membership change removed this replica: it no longer hears
    /// from the group, so nothing it holds can be trusted as current.
    removed: AtomicBool,
    /// The members' addresses as the node knows them, for [`Replica::leader_addr`].
    members: RwLock<Vec<Member>>,
}

/// Handle on a running replica; clones share it.
#[derive(Clone)]
pub struct Replica {
    shared: Arc<Shared>,
    tx: Sender<Input>,
    id: u64,
}

/// raft-rs logs through slog; its warnings and errors go to our log, the rest is dropped.
struct SlogToTracing;

impl slog::Drain for SlogToTracing {
    type Ok = ();
    type Err = slog::Never;

    fn log(&self, r: &slog::Record<'_>, _: &slog::OwnedKVList) -> Result<(), slog::Never> {
        match r.level() {
            slog::Level::Critical | slog::Level::Error => {
                tracing::error!(target: "raft", "{}", r.msg())
            }
            slog::Level::Warning => tracing::warn!(target: "raft", "{}", r.msg()),
            _ => tracing::trace!(target: "raft", "{}", r.msg()),
        }
        Ok(())
    }
}

impl Replica {
    /// Opens (or creates) the replica's log in `opts.dir`, rebuilds its state from the last
    /// snapshot (the committed entries after it are applied again by Raft), and starts its
    /// thread. Blocking (file I/O). Errors: `Dir`, `Log`, `Snapshot`, `Raft`, `Thread`.
    pub fn open(opts: Options, transport: Arc<dyn Transport>) -> Result<Replica, ReplicaError> {
        std::fs::create_dir_all(&opts.dir).map_err(|source| ReplicaError::Dir {
            path: opts.dir.clone(),
            source,
        })?;
        // The log holds token hashes: owner-only, as the standalone state file.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&opts.dir, std::fs::Permissions::from_mode(0o700)).map_err(
            |source| ReplicaError::Dir {
                path: opts.dir.clone(),
                source,
            },
        )?;
        let log = RaftLog::open(&opts.dir.join("raft.redb"))?;
        let initial = log.initial_state()?;
        let fresh = initial.hard_state == Default::default()
            && initial.conf_state == ConfState::default()
            && log.last_index()? == 0;
        if fresh && !opts.join {
            log.set_conf_state(&ConfState {
                voters: opts.voters.clone(),
                ..Default::default()
            })?;
        }
        let snap = log.last_snapshot();
        if !snap.is_empty() {
            // The state restarts from the snapshot and the entries after it are applied
            // again, membership changes included: the membership must restart from the
            // snapshot's too, or it would run ahead of the state (and of `members`).
            log.set_conf_state(snap.get_metadata().get_conf_state())?;
        }
        let machine::Machine {
            state,
            tags,
            members,
        } = machine::decode_snapshot(snap.get_data()).map_err(ReplicaError::Snapshot)?;
        let members = members.unwrap_or_else(|| opts.members.clone());
        let applied = snap.get_metadata().index;
        let conf = log.initial_state()?.conf_state;
        let removed = !conf.voters.is_empty()
            && !conf.voters.contains(&opts.id)
            && !conf.learners.contains(&opts.id);
        let cfg = raft::Config {
            id: opts.id,
            election_tick: 10,
            heartbeat_tick: 1,
            applied,
            check_quorum: true,
            pre_vote: true,
            max_size_per_msg: 1 << 20,
            max_inflight_msgs: 256,
            ..Default::default()
        };
        cfg.validate()?;
        let logger = slog::Logger::root(SlogToTracing, slog::o!());
        let raw = raft::RawNode::new(&cfg, log, &logger)?;
        let shared = Arc::new(Shared {
            state: RwLock::new(state),
            leader: AtomicU64::new(0),
            is_leader: AtomicBool::new(false),
            failed: AtomicBool::new(false),
            removed: AtomicBool::new(removed),
            members: RwLock::new(members.clone()),
        });
        let (tx, rx) = std::sync::mpsc::channel();
        let reporter = Reporter { tx: tx.clone() };
        let id = opts.id;
        let restored = node::Restored {
            tags,
            members,
            applied,
        };
        let node = node::Node::new(raw, shared.clone(), restored, transport, reporter, opts);
        let guard = shared.clone();
        let metrics = node.exports_metrics();
        std::thread::Builder::new()
            .name(format!("iam-raft-{}", replica_id(id)))
            .spawn(move || {
                // raft-rs panics on what it holds impossible: then this replica stops
                // answering as a member (its callers fail over) instead of serving a
                // frozen state as if it still led.
                let run = std::panic::AssertUnwindSafe(move || node.run(rx));
                if std::panic::catch_unwind(run).is_err() {
                    tracing::error!("IAM replica's Raft thread panicked; the replica stopped");
                    guard.failed.store(true, Ordering::Relaxed);
                    guard.leader.store(0, Ordering::Relaxed);
                    guard.is_leader.store(false, Ordering::Relaxed);
                    if metrics {
                        metrics::gauge!("opendsec_iam_leader").set(0.0);
                    }
                }
            })
            .map_err(ReplicaError::Thread)?;
        Ok(Replica { shared, tx, id })
    }

    /// This replica's raft id.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The state as applied here. Hold the guard briefly: applying waits for it.
    pub fn read(&self) -> RwLockReadGuard<'_, IamState> {
        self.shared
            .state
            .read()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Commits `cmd` and answers with its result once it is applied here. `unavailable` when
    /// no majority commits it within the commit timeout (it may still commit later: the
    /// caller must treat the change as unknown) or when the replica is stopped.
    pub async fn propose(&self, cmd: Command) -> Result<Outcome, Failure> {
        if let Some(f) = self.refusal() {
            return Err(f);
        }
        let tag = rand::random::<u128>();
        let data = machine::Envelope { tag, cmd }.encode();
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Input::Propose { tag, data, reply })
            .map_err(|_| Failure::unavailable("IAM replica is stopped"))?;
        rx.await
            .map_err(|_| Failure::unavailable("IAM replica stopped before answering"))?
    }

    /// Waits until this replica has applied everything committed when the call began
    /// (Raft's read index, confirmed by a majority). `unavailable` without a majority.
    pub async fn read_index(&self) -> Result<(), Failure> {
        if let Some(f) = self.refusal() {
            return Err(f);
        }
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Input::ReadIndex(reply))
            .map_err(|_| Failure::unavailable("IAM replica is stopped"))?;
        rx.await
            .map_err(|_| Failure::unavailable("IAM replica stopped before answering"))?
    }

    /// Adds or removes one voter (docs/iam-replicas.md "Membership"), answering once the
    /// change is applied here. An added replica must run with `-join` (or hold this group's
    /// log); the leader sends it a snapshot. Errors: `conflict` for an id already a member
    /// or an address another member has, `not_found` for removing a non-member, `invalid`
    /// for removing the last voter, `unavailable` without a leader, when another change is
    /// still in progress, or when the change does not commit within the commit timeout (it
    /// may still commit: look at the members before trying again).
    pub async fn change_member(&self, change: Change) -> Result<(), Failure> {
        if let Some(f) = self.refusal() {
            return Err(f);
        }
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Input::ChangeMember { change, reply })
            .map_err(|_| Failure::unavailable("IAM replica is stopped"))?;
        rx.await
            .map_err(|_| Failure::unavailable("IAM replica stopped before answering"))?
    }

    /// Why this replica takes no calls at all, if it does not.
    fn refusal(&self) -> Option<Failure> {
        if self.shared.failed.load(Ordering::Relaxed) {
            Some(Failure::unavailable(
                "IAM replica failed to persist its log; restart it",
            ))
        } else if self.shared.removed.load(Ordering::Relaxed) {
            Some(Failure::unavailable(
                "this IAM replica was removed from the group (iam member remove)",
            ))
        } else {
            None
        }
    }

    /// True once a committed change removed this replica from the group.
    pub fn removed(&self) -> bool {
        self.shared.removed.load(Ordering::Relaxed)
    }

    /// Hands a peer's message to the node.
    pub fn step(&self, m: Message) {
        let _ = self.tx.send(Input::Step(Box::new(m)));
    }

    /// The node's view of the group; `None` once stopped.
    pub async fn status(&self) -> Option<Status> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Input::Status(reply)).ok()?;
        rx.await.ok()
    }

    /// The raft id of the leader as last seen (0 = none).
    pub fn leader(&self) -> u64 {
        self.shared.leader.load(Ordering::Relaxed)
    }

    /// The `Iam` address of the leader as last seen, if it is known and has one.
    pub fn leader_addr(&self) -> Option<String> {
        let leader = replica_id(self.shared.leader.load(Ordering::Relaxed));
        if self.shared.leader.load(Ordering::Relaxed) == 0 {
            return None;
        }
        self.shared
            .members
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .find(|m| m.id == leader && !m.addr.is_empty())
            .map(|m| m.addr.clone())
    }

    /// True while this replica leads.
    pub fn is_leader(&self) -> bool {
        self.shared.is_leader.load(Ordering::Relaxed)
    }

    /// True once a write to the log failed (the replica has stopped), or once the replica
    /// was removed from the group: either way it must not answer from its state.
    pub fn failed(&self) -> bool {
        self.shared.failed.load(Ordering::Relaxed) || self.shared.removed.load(Ordering::Relaxed)
    }

    /// Stops the node; returns once its log file is closed. Waiting proposals are answered
    /// `unavailable`.
    pub async fn close(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Input::Close(tx)).is_ok() {
            let _ = rx.await;
        }
    }
}
