//! The thread that owns a replica's `RawNode`: it ticks, steps peer messages, proposes, and
//! handles each `Ready` in raft-rs's documented order (messages a leader may send at once;
//! snapshot; committed entries applied; new entries and hard state persisted; then the
//! messages that needed them persisted). Nothing else touches the node, so no lock is held
//! across Raft's steps.
//!
//! Proposals wait for their entry to be applied here; a proposal that has not committed
//! after [`REPROPOSE`] is proposed again with the same tag (a leader change may have lost it;
//! the tag makes a second copy a no-op), and one still not committed after the commit
//! timeout is answered `unavailable`.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use protobuf::Message as _;
use raft::prelude::{
    ConfChange, ConfChangeSingle, ConfChangeType, ConfChangeV2, Entry, EntryType, Message, Snapshot,
};
use raft::{RawNode, StateRole, Storage};
use tokio::sync::oneshot;

use super::super::command::Outcome;
use super::super::raftlog::RaftLog;
use super::machine::{self, Applied, Envelope, Member, MemberChange, Tags};
use super::{raft_id, replica_id, Change, Input, Options, Reporter, Shared, Status, Transport};
use crate::types::Failure;

/// How long a proposal waits for its commit before it is proposed again.
pub const REPROPOSE: Duration = Duration::from_millis(1000);
/// A learner this many entries or fewer behind the commit index has caught up: under load
/// the commit index never stands still, and a voter may trail it too.
const PROMOTE_LAG: u64 = 256;
/// Ticks a learner must look caught up and answering before it is made a voter: two
/// election timeouts, so that one which went silent (raft-rs clears `recent_active` once
/// per election timeout) is not promoted on a stale flag.
const PROMOTE_TICKS: u32 = 20;

struct Pending {
    data: Vec<u8>,
    reply: oneshot::Sender<Result<Outcome, Failure>>,
    since: Instant,
    proposed: Instant,
}

type ReadReply = oneshot::Sender<Result<(), Failure>>;

/// A membership change proposed here, answered when its entry is applied. Never proposed
/// again: raft-rs allows one change in flight, and a lost one is for the operator to retry.
struct PendingChange {
    reply: oneshot::Sender<Result<(), Failure>>,
    since: Instant,
}

struct PendingRead {
    reply: oneshot::Sender<Result<(), Failure>>,
    since: Instant,
    asked: Instant,
}

/// What a node starts from: its last snapshot's tags and members, and the index it was
/// taken at.
pub(super) struct Restored {
    pub tags: Tags,
    pub members: Vec<Member>,
    pub applied: u64,
}

/// The node thread's own state.
pub(super) struct Node {
    raw: RawNode<RaftLog>,
    shared: Arc<Shared>,
    tags: Tags,
    transport: Arc<dyn Transport>,
    reporter: Reporter,
    opts: Options,
    proposals: HashMap<u128, Pending>,
    changes: HashMap<u128, PendingChange>,
    /// The members' addresses (see [`Member`]).
    members: Vec<Member>,
    /// Take a snapshot after this Ready whatever the count: a new member must be sent one
    /// that already names it (raft-rs refuses a snapshot whose membership lacks it).
    snapshot_now: bool,
    /// This leader was removed: it hands leadership to the most caught-up voter once the
    /// Ready is done (raft-rs leaves a removed leader leading).
    step_down: bool,
    /// Ticks this replica has led since it was removed: past a few election timeouts
    /// without a successful hand-over it stops leading by itself.
    removed_leading: u32,
    /// Learner raft id -> ticks in a row it has looked caught up (see `promote_learners`).
    caught_up: HashMap<u64, u32>,
    /// The lost-log error was logged (once is enough).
    lost_log_reported: bool,
    /// Read requests by context, before the leader has confirmed an index for them.
    reads: HashMap<u64, PendingRead>,
    /// Confirmed reads waiting for the apply index to reach theirs (index, asked at, reply).
    confirmed: Vec<(u64, Instant, ReadReply)>,
    /// Read contexts: a random prefix per start (so that replicas, and this one before a
    /// restart, never share a context: raft-rs ignores a context already pending) and a
    /// counter.
    read_prefix: u64,
    next_read: u64,
    /// A leader became known during the last Ready.
    leader_known: bool,
    applied: u64,
    snapshot_index: u64,
    installed: u64,
}

impl Node {
    pub(super) fn new(
        raw: RawNode<RaftLog>,
        shared: Arc<Shared>,
        restored: Restored,
        transport: Arc<dyn Transport>,
        reporter: Reporter,
        opts: Options,
    ) -> Node {
        let Restored {
            tags,
            members,
            applied,
        } = restored;
        let node = Node {
            raw,
            shared,
            tags,
            transport,
            reporter,
            opts,
            proposals: HashMap::new(),
            changes: HashMap::new(),
            members,
            snapshot_now: false,
            step_down: false,
            removed_leading: 0,
            caught_up: HashMap::new(),
            lost_log_reported: false,
            reads: HashMap::new(),
            confirmed: Vec::new(),
            read_prefix: rand::random(),
            leader_known: false,
            next_read: 1,
            applied,
            snapshot_index: applied,
            installed: 0,
        };
        node.peers_changed();
        node
    }

    /// Points the transport at the members other than this one (none known: the transport
    /// keeps the peers it was made with).
    fn peers_changed(&self) {
        if self.members.is_empty() {
            return;
        }
        self.shared
            .members
            .write()
            .unwrap_or_else(PoisonError::into_inner)
            .clone_from(&self.members);
        let me = replica_id(self.opts.id);
        let peers: Vec<(u64, String)> = self
            .members
            .iter()
            .filter(|m| m.id != me)
            .map(|m| (raft_id(m.id), m.raft_addr.clone()))
            .collect();
        self.transport.set_peers(&peers);
    }

    /// Runs until `Close` or until every handle is gone.
    pub(super) fn run(mut self, rx: Receiver<Input>) {
        let mut next_tick = Instant::now() + self.opts.tick;
        let mut close = None;
        loop {
            let wait = next_tick.saturating_duration_since(Instant::now());
            match rx.recv_timeout(wait) {
                Ok(Input::Close(c)) => {
                    close = Some(c);
                    break;
                }
                Ok(input) => {
                    self.handle(input);
                    // Take whatever else is queued before handling the Ready: one fsync
                    // for many proposals and messages.
                    while let Ok(more) = rx.try_recv() {
                        if let Input::Close(c) = more {
                            close = Some(c);
                            break;
                        }
                        self.handle(more);
                    }
                    if close.is_some() {
                        break;
                    }
                }
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => break,
            }
            if Instant::now() >= next_tick {
                self.raw.tick();
                self.on_tick();
                next_tick += self.opts.tick;
                if next_tick < Instant::now() {
                    next_tick = Instant::now() + self.opts.tick;
                }
            }
            if let Err(e) = self.on_ready() {
                tracing::error!(error = %e, "IAM replica could not persist its Raft log; stopping it");
                self.shared.failed.store(true, Ordering::Relaxed);
                break;
            }
        }
        self.shared.leader.store(0, Ordering::Relaxed);
        self.shared.is_leader.store(false, Ordering::Relaxed);
        for (_, p) in self.proposals.drain() {
            let _ = p
                .reply
                .send(Err(Failure::unavailable("IAM replica stopped")));
        }
        for (_, r) in self.reads.drain() {
            let _ = r
                .reply
                .send(Err(Failure::unavailable("IAM replica stopped")));
        }
        for (_, _, r) in self.confirmed.drain(..) {
            let _ = r.send(Err(Failure::unavailable("IAM replica stopped")));
        }
        for (_, c) in self.changes.drain() {
            let _ = c
                .reply
                .send(Err(Failure::unavailable("IAM replica stopped")));
        }
        // Release the log file before answering Close, so the same directory can be opened
        // again at once.
        drop(self.raw);
        if let Some(c) = close {
            let _ = c.send(());
        }
    }

    /// Whether this node sets the role's metrics.
    pub(super) fn exports_metrics(&self) -> bool {
        self.opts.metrics
    }

    fn handle(&mut self, input: Input) {
        match input {
            Input::Propose { tag, data, reply } => {
                let now = Instant::now();
                // A proposal that finds no leader waits in `proposals` and goes out again
                // at the next REPROPOSE.
                let _ = self.raw.propose(vec![], data.clone());
                self.proposals.insert(
                    tag,
                    Pending {
                        data,
                        reply,
                        since: now,
                        proposed: now,
                    },
                );
            }
            Input::ReadIndex(reply) => {
                let ctx = self.next_read;
                self.next_read += 1;
                self.raw.read_index(self.read_ctx(ctx));
                let now = Instant::now();
                self.reads.insert(
                    ctx,
                    PendingRead {
                        reply,
                        since: now,
                        asked: now,
                    },
                );
            }
            Input::ChangeMember { change, reply } => {
                if let Err(f) = self.propose_change(change, reply) {
                    tracing::debug!(error = %f.message, "membership change not proposed");
                }
            }
            Input::Step(m) => {
                // Only members propose, read or ask for leadership; a replica that was
                // removed (or not added yet) is heard only as raft-rs allows (votes,
                // appends from a leader that is ahead, its hand-over).
                let asks = matches!(
                    m.get_msg_type(),
                    raft::prelude::MessageType::MsgPropose
                        | raft::prelude::MessageType::MsgReadIndex
                        | raft::prelude::MessageType::MsgTransferLeader
                );
                if asks && self.raw.raft.prs().get(m.from).is_none() {
                    tracing::debug!(
                        from = replica_id(m.from),
                        "dropping a request from a non-member"
                    );
                    return;
                }
                // A leader never tells a member to commit past what it acknowledged having:
                // past our last entry, this replica lost a log it had acknowledged (its data
                // directory went). raft-rs would panic; Raft's safety needs it to come back
                // as a new member instead.
                if m.get_msg_type() == raft::prelude::MessageType::MsgHeartbeat
                    && m.commit > self.raw.raft.raft_log.last_index()
                {
                    if !std::mem::replace(&mut self.lost_log_reported, true) {
                        tracing::error!(
                            commit = m.commit,
                            "this IAM replica is still a member but lost the log it had \
                             acknowledged (an emptied data directory): remove it (`iam member \
                             remove ID`), then add it again (`iam member add`)"
                        );
                    }
                    return;
                }
                if let Err(e) = self.raw.step(*m) {
                    tracing::debug!(error = %e, "dropping a Raft message");
                }
            }
            Input::Unreachable(id) => self.raw.report_unreachable(id),
            Input::SnapshotSent { to, ok } => self.raw.report_snapshot(
                to,
                if ok {
                    raft::SnapshotStatus::Finish
                } else {
                    raft::SnapshotStatus::Failure
                },
            ),
            Input::Status(reply) => {
                let _ = reply.send(self.status());
            }
            Input::Close(_) => {}
        }
    }

    fn status(&self) -> Status {
        let r = &self.raw.raft;
        let conf = self.raw.store().initial_state().map(|s| s.conf_state);
        Status {
            id: r.id,
            leader: r.leader_id,
            term: r.term,
            commit: r.raft_log.committed,
            applied: self.applied,
            voters: conf.as_ref().map(|c| sorted(&c.voters)).unwrap_or_default(),
            learners: conf.map(|c| sorted(&c.learners)).unwrap_or_default(),
            progress: if r.state == StateRole::Leader {
                r.prs().iter().map(|(id, p)| (*id, p.matched)).collect()
            } else {
                Vec::new()
            },
            snapshots_installed: self.installed,
            members: self.members.clone(),
            removed: self.shared.removed.load(Ordering::Relaxed),
        }
    }

    /// Checks a membership change against the group as this replica knows it and proposes
    /// it; the answer comes when it is applied (or from `on_tick` when it times out). A
    /// refusal is answered at once and also returned, for the log.
    fn propose_change(
        &mut self,
        change: Change,
        reply: oneshot::Sender<Result<(), Failure>>,
    ) -> Result<(), Failure> {
        let refuse = |reply: oneshot::Sender<Result<(), Failure>>, f: Failure| {
            let _ = reply.send(Err(f.clone()));
            Err(f)
        };
        if self.shared.removed.load(Ordering::Relaxed) {
            return refuse(
                reply,
                Failure::unavailable("this IAM replica was removed from the group"),
            );
        }
        let conf = match self.raw.store().initial_state() {
            Ok(s) => s.conf_state,
            Err(e) => return refuse(reply, Failure::internal(e.to_string())),
        };
        let member_of =
            |id: u64| conf.voters.contains(&raft_id(id)) || conf.learners.contains(&raft_id(id));
        let tag = rand::random::<u128>();
        let mut cc = ConfChange::default();
        let member = match change {
            Change::Add(m) => {
                if member_of(m.id) {
                    return refuse(
                        reply,
                        Failure::conflict(format!("replica {} is already a member", m.id)),
                    );
                }
                if let Some(o) = self.members.iter().find(|o| {
                    member_of(o.id)
                        && [&o.addr, &o.raft_addr]
                            .iter()
                            .any(|a| **a == m.addr || **a == m.raft_addr)
                }) {
                    return refuse(
                        reply,
                        Failure::conflict(format!(
                            "replica {} already uses one of these addresses",
                            o.id
                        )),
                    );
                }
                // A learner first: it counts for no majority until it has caught up (see
                // `promote_learners`), so an unreachable or slow new replica never stalls
                // the group.
                cc.set_change_type(ConfChangeType::AddLearnerNode);
                m
            }
            Change::Remove(id) => {
                if !member_of(id) {
                    return refuse(
                        reply,
                        Failure::not_found(format!("replica {id} is not a member")),
                    );
                }
                if conf.voters == [raft_id(id)] {
                    return refuse(
                        reply,
                        Failure::invalid(format!("replica {id} is the only voter left")),
                    );
                }
                cc.set_change_type(ConfChangeType::RemoveNode);
                Member {
                    id,
                    addr: String::new(),
                    raft_addr: String::new(),
                }
            }
        };
        cc.node_id = raft_id(member.id);
        cc.context = MemberChange { tag, member }.encode().into();
        if self.raw.raft.has_pending_conf() {
            return refuse(
                reply,
                Failure::unavailable(
                    "another membership change is in progress; try again in a moment",
                ),
            );
        }
        if let Err(e) = self.raw.propose_conf_change(vec![], cc) {
            return refuse(
                reply,
                Failure::unavailable(format!(
                    "IAM has no leader to take the membership change ({e})"
                )),
            );
        }
        self.changes.insert(
            tag,
            PendingChange {
                reply,
                since: Instant::now(),
            },
        );
        Ok(())
    }

    /// On the leader: makes a learner that has caught up (replicating, within
    /// [`PROMOTE_LAG`] entries of the commit index, answering, for [`PROMOTE_TICKS`] ticks)
    /// a voter, one change at a time.
    fn promote_learners(&mut self) {
        let r = &self.raw.raft;
        if r.state != StateRole::Leader || self.shared.removed.load(Ordering::Relaxed) {
            self.caught_up.clear();
            return;
        }
        let Ok(conf) = self.raw.store().initial_state().map(|s| s.conf_state) else {
            return;
        };
        let committed = r.raft_log.committed;
        let mut counts = HashMap::new();
        for id in conf.learners {
            let Some(p) = r.prs().get(id) else { continue };
            // Replicating: it acknowledged entries after any snapshot it needed.
            if p.state != raft::ProgressState::Replicate || p.matched + PROMOTE_LAG < committed {
                continue;
            }
            let n = self.caught_up.get(&id).copied().unwrap_or(0);
            // The tick on which raft-rs has just cleared the flag neither counts nor resets.
            counts.insert(id, if p.recent_active { n + 1 } else { n });
        }
        self.caught_up = counts;
        if r.has_pending_conf() {
            return;
        }
        let Some(id) = sorted(&self.caught_up.keys().copied().collect::<Vec<_>>())
            .into_iter()
            .find(|id| self.caught_up.get(id).is_some_and(|n| *n >= PROMOTE_TICKS))
        else {
            return;
        };
        let member = self
            .members
            .iter()
            .find(|m| raft_id(m.id) == id)
            .cloned()
            .unwrap_or(Member {
                id: replica_id(id),
                addr: String::new(),
                raft_addr: String::new(),
            });
        let mut cc = ConfChange::default();
        cc.set_change_type(ConfChangeType::AddNode);
        cc.node_id = id;
        cc.context = MemberChange {
            tag: rand::random::<u128>(),
            member,
        }
        .encode()
        .into();
        match self.raw.propose_conf_change(vec![], cc) {
            Ok(()) => tracing::info!(
                replica = replica_id(id),
                "IAM learner caught up; proposing it as a voter"
            ),
            Err(e) => tracing::debug!(error = %e, "promoting an IAM learner failed"),
        }
    }

    fn on_tick(&mut self) {
        let now = Instant::now();
        self.promote_learners();
        if self.shared.removed.load(Ordering::Relaxed) && self.raw.raft.state == StateRole::Leader {
            // A removed leader takes no proposals (it is not in its own progress), yet the
            // others hear its heartbeats and never elect: hand over until it works (a lost
            // MsgTimeoutNow or a dead heir cancels a transfer), and at last just stop
            // leading, so that the others' election timers run out.
            self.removed_leading += 1;
            if self.removed_leading > 30 {
                let term = self.raw.raft.term;
                tracing::warn!("removed IAM leader found no heir; stepping down");
                self.raw.raft.become_follower(term, raft::INVALID_ID);
            } else if self.raw.raft.lead_transferee.is_none() {
                self.step_down = true;
            }
        }
        let timeout = self.opts.commit_timeout;
        let failure = self.no_quorum("the change");
        for (_, p) in self
            .proposals
            .extract_if(|_, p| now.duration_since(p.since) >= timeout)
        {
            let _ = p.reply.send(Err(failure.clone()));
        }
        for p in self.proposals.values_mut() {
            if now.duration_since(p.proposed) >= REPROPOSE {
                p.proposed = now;
                let _ = self.raw.propose(vec![], p.data.clone());
            }
        }
        let failure = self.no_quorum("the membership change");
        for (_, c) in self
            .changes
            .extract_if(|_, c| now.duration_since(c.since) >= timeout)
        {
            let mut f = failure.clone();
            f.message
                .push_str(" (it may still be made: look at `iam members` before trying again)");
            let _ = c.reply.send(Err(f));
        }
        let failure = self.no_quorum("a consistent read");
        for (_, r) in self
            .reads
            .extract_if(|_, r| now.duration_since(r.since) >= timeout)
        {
            let _ = r.reply.send(Err(failure.clone()));
        }
        let mut again = Vec::new();
        for (c, r) in self.reads.iter_mut() {
            if now.duration_since(r.asked) >= REPROPOSE {
                r.asked = now;
                again.push(*c);
            }
        }
        for c in again {
            let ctx = self.read_ctx(c);
            self.raw.read_index(ctx);
        }
        let (late, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.confirmed)
            .into_iter()
            .partition(|(_, since, _)| now.duration_since(*since) >= timeout);
        self.confirmed = waiting;
        for (_, _, reply) in late {
            let _ = reply.send(Err(failure.clone()));
        }
    }

    fn repropose_all(&mut self) {
        let now = Instant::now();
        for p in self.proposals.values_mut() {
            p.proposed = now;
            let _ = self.raw.propose(vec![], p.data.clone());
        }
        for (c, r) in self.reads.iter_mut() {
            r.asked = now;
            let mut ctx = self.read_prefix.to_be_bytes().to_vec();
            ctx.extend_from_slice(&c.to_be_bytes());
            self.raw.read_index(ctx);
        }
    }

    fn no_quorum(&self, what: &str) -> Failure {
        let leader = self.raw.raft.leader_id;
        if leader == raft::INVALID_ID {
            Failure::unavailable(format!(
                "IAM has no leader (fewer than a majority of replicas reachable): {what} timed out"
            ))
        } else {
            Failure::unavailable(format!(
                "IAM replica {} did not confirm {what} in time",
                leader.saturating_sub(1)
            ))
        }
    }

    fn send(&self, msgs: Vec<Message>) {
        if !msgs.is_empty() {
            self.transport.send(msgs, &self.reporter);
        }
    }

    fn on_ready(&mut self) -> Result<(), String> {
        if !self.raw.has_ready() {
            return Ok(());
        }
        let mut ready = self.raw.ready();
        if let Some(ss) = ready.ss() {
            self.shared.leader.store(ss.leader_id, Ordering::Relaxed);
            let lead = ss.raft_state == StateRole::Leader;
            self.shared.is_leader.store(lead, Ordering::Relaxed);
            if self.opts.metrics {
                metrics::gauge!("opendsec_iam_leader").set(if lead { 1.0 } else { 0.0 });
            }
            tracing::info!(
                leader = ss.leader_id.saturating_sub(1),
                role = ?ss.raft_state,
                term = self.raw.raft.term,
                "IAM Raft state changed"
            );
            // What waited for a leader goes to the new one as soon as this Ready is done
            // (not at the next REPROPOSE): failover then costs the election alone.
            self.leader_known = ss.leader_id != raft::INVALID_ID;
        }
        self.send(ready.take_messages());
        if !ready.snapshot().is_empty() {
            let snap = ready.snapshot().clone();
            self.install(&snap)?;
        }
        let committed = ready.take_committed_entries();
        self.apply(committed)?;
        let hs = ready.hs().cloned();
        if !ready.entries().is_empty() || hs.is_some() {
            self.raw
                .store()
                .append(ready.entries(), hs.as_ref())
                .map_err(|e| e.to_string())?;
        }
        for rs in ready.take_read_states() {
            self.confirm_read(&rs.request_ctx, rs.index);
        }
        self.send(ready.take_persisted_messages());
        let mut light = self.raw.advance(ready);
        if let Some(commit) = light.commit_index() {
            self.raw
                .store()
                .set_commit(commit)
                .map_err(|e| e.to_string())?;
        }
        self.send(light.take_messages());
        let committed = light.take_committed_entries();
        self.apply(committed)?;
        self.raw.advance_apply();
        self.answer_reads();
        self.maybe_snapshot()?;
        if std::mem::take(&mut self.step_down) {
            let me = self.opts.id;
            let heir = self
                .raw
                .raft
                .prs()
                .iter()
                // A voter: raft-rs ignores a hand-over to a learner.
                .filter(|(id, p)| {
                    **id != me
                        && p.recent_active
                        && self.raw.raft.prs().conf().voters().contains(**id)
                })
                .max_by_key(|(_, p)| p.matched)
                .map(|(id, _)| *id);
            if let Some(heir) = heir {
                tracing::info!(
                    to = replica_id(heir),
                    "removed IAM leader handing over leadership"
                );
                self.raw.transfer_leader(heir);
                return self.on_ready();
            }
        }
        if std::mem::take(&mut self.leader_known) {
            // Proposing inside a Ready is not allowed: raft-rs wants no new messages
            // between `ready` and `advance`.
            self.repropose_all();
            return self.on_ready();
        }
        Ok(())
    }

    fn read_ctx(&self, n: u64) -> Vec<u8> {
        let mut ctx = self.read_prefix.to_be_bytes().to_vec();
        ctx.extend_from_slice(&n.to_be_bytes());
        ctx
    }

    fn confirm_read(&mut self, ctx: &[u8], index: u64) {
        let Some((prefix, n)) = ctx.split_at_checked(8) else {
            return;
        };
        let (Ok(prefix), Ok(n)) = (<[u8; 8]>::try_from(prefix), <[u8; 8]>::try_from(n)) else {
            return;
        };
        if u64::from_be_bytes(prefix) != self.read_prefix {
            return;
        }
        if let Some(r) = self.reads.remove(&u64::from_be_bytes(n)) {
            self.confirmed.push((index, r.since, r.reply));
        }
    }

    fn answer_reads(&mut self) {
        let applied = self.applied;
        let (done, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.confirmed)
            .into_iter()
            .partition(|(index, _, _)| *index <= applied);
        self.confirmed = waiting;
        for (_, _, reply) in done {
            let _ = reply.send(Ok(()));
        }
    }

    /// A leader's snapshot: the log and the state machine become it.
    fn install(&mut self, snap: &Snapshot) -> Result<(), String> {
        let machine::Machine {
            state,
            tags,
            members,
        } = machine::decode_snapshot(snap.get_data()).map_err(|e| format!("snapshot: {e}"))?;
        self.raw
            .store()
            .apply_snapshot(snap)
            .map_err(|e| e.to_string())?;
        if let Some(m) = members {
            self.members = m;
            self.peers_changed();
        }
        self.check_removed(snap.get_metadata().get_conf_state());
        *self
            .shared
            .state
            .write()
            .unwrap_or_else(PoisonError::into_inner) = state;
        self.tags = tags;
        self.applied = snap.get_metadata().index;
        self.snapshot_index = self.applied;
        self.installed += 1;
        tracing::info!(
            index = self.applied,
            "IAM replica installed a leader's snapshot"
        );
        Ok(())
    }

    fn apply(&mut self, entries: Vec<Entry>) -> Result<(), String> {
        if entries.is_empty() {
            return Ok(());
        }
        let mut answers = Vec::new();
        let mut changed = Vec::new();
        let shared = self.shared.clone();
        {
            let mut st = shared.state.write().unwrap_or_else(PoisonError::into_inner);
            for e in &entries {
                self.applied = e.index;
                match e.get_entry_type() {
                    EntryType::EntryNormal => {
                        if e.data.is_empty() {
                            continue; // a new leader's empty entry
                        }
                        let env = match Envelope::decode(&e.data) {
                            Ok(env) => env,
                            Err(err) => {
                                // The same bytes fail the same way on every replica.
                                tracing::error!(index = e.index, error = %err, "skipping an unreadable IAM log entry");
                                continue;
                            }
                        };
                        if let Applied::Result(r) =
                            machine::apply_entry(&mut st, &mut self.tags, &env)
                        {
                            if let Some(p) = self.proposals.remove(&env.tag) {
                                answers.push((p.reply, r));
                            }
                        }
                    }
                    EntryType::EntryConfChange | EntryType::EntryConfChangeV2 => {
                        if let Some(answer) = self.apply_conf_change(e)? {
                            changed.push(answer);
                        }
                    }
                }
            }
            if self.opts.metrics {
                metrics::gauge!("opendsec_iam_leases").set(st.leases.len() as f64);
            }
        }
        for (reply, r) in answers {
            let _ = reply.send(r);
        }
        for (reply, r) in changed {
            let _ = reply.send(r);
        }
        Ok(())
    }

    /// Applies a committed membership change: raft-rs's membership, the members' addresses,
    /// the transport's peers. An entry that does not decode, or that raft-rs refuses (say,
    /// removing the last voter), is skipped: the same bytes do the same on every replica.
    /// Returns the answer for a change proposed here.
    #[allow(clippy::type_complexity)]
    fn apply_conf_change(
        &mut self,
        e: &Entry,
    ) -> Result<Option<(oneshot::Sender<Result<(), Failure>>, Result<(), Failure>)>, String> {
        let decoded = if e.get_entry_type() == EntryType::EntryConfChange {
            ConfChange::parse_from_bytes(&e.data).map(to_v2)
        } else {
            ConfChangeV2::parse_from_bytes(&e.data)
        };
        let cc = match decoded {
            Ok(cc) => cc,
            Err(err) => {
                tracing::error!(index = e.index, error = %err, "skipping an unreadable membership change");
                return Ok(None);
            }
        };
        let ctx = MemberChange::decode(&cc.context).ok();
        let pending = ctx.as_ref().and_then(|c| self.changes.remove(&c.tag));
        // An addition of a member (two additions racing through replicas that had not
        // applied the first): raft-rs would make it a no-op, but it must not rewrite the
        // member's addresses either. Every replica decides the same from the same log.
        // Making a learner a voter is the one addition of a member that is allowed.
        let before = self.raw.raft.prs().conf().to_conf_state();
        let already = cc.changes.iter().any(|ch| match ch.get_change_type() {
            ConfChangeType::AddNode => before.voters.contains(&ch.node_id),
            ConfChangeType::AddLearnerNode => {
                before.voters.contains(&ch.node_id) || before.learners.contains(&ch.node_id)
            }
            ConfChangeType::RemoveNode => false,
        });
        if already {
            tracing::warn!(index = e.index, "skipping the addition of a member");
            return Ok(pending.map(|p| {
                (
                    p.reply,
                    Err(Failure::conflict("that replica is already a member")),
                )
            }));
        }
        let cs = match self.raw.apply_conf_change(&cc) {
            Ok(cs) => cs,
            Err(err) => {
                tracing::error!(index = e.index, error = %err, "skipping a membership change raft refused");
                return Ok(pending.map(|p| {
                    (
                        p.reply,
                        Err(Failure::invalid(format!(
                            "membership change refused: {err}"
                        ))),
                    )
                }));
            }
        };
        self.conf_changed(&cs)?;
        for ch in &cc.changes {
            let id = replica_id(ch.node_id);
            match ch.get_change_type() {
                ConfChangeType::AddNode if before.learners.contains(&ch.node_id) => {
                    // A promotion: the member and its addresses are known already.
                    tracing::info!(replica = id, "IAM learner is now a voter");
                }
                ConfChangeType::AddNode | ConfChangeType::AddLearnerNode => {
                    let m = ctx
                        .as_ref()
                        .map(|c| c.member.clone())
                        .filter(|m| m.id == id)
                        .unwrap_or(Member {
                            id,
                            addr: String::new(),
                            raft_addr: String::new(),
                        });
                    machine::put_member(&mut self.members, m);
                    self.snapshot_now = true;
                }
                ConfChangeType::RemoveNode => self.members.retain(|m| m.id != id),
            }
        }
        self.peers_changed();
        self.check_removed(&cs);
        Ok(pending.map(|p| (p.reply, Ok(()))))
    }

    /// Marks this replica removed when the membership no longer has it.
    fn check_removed(&mut self, cs: &raft::prelude::ConfState) {
        let gone = !cs.voters.is_empty()
            && !cs.voters.contains(&self.opts.id)
            && !cs.learners.contains(&self.opts.id);
        if gone && self.raw.raft.state == StateRole::Leader {
            self.step_down = true;
        }
        // Added again later (the same id back), it takes part again.
        if !gone && self.shared.removed.swap(false, Ordering::Relaxed) {
            tracing::info!("this IAM replica was added to the group again");
        }
        if gone && !self.shared.removed.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                "this IAM replica was removed from the group; it answers nothing from now on"
            );
            self.shared.leader.store(0, Ordering::Relaxed);
            self.shared.is_leader.store(false, Ordering::Relaxed);
        }
    }

    fn conf_changed(&self, cs: &raft::prelude::ConfState) -> Result<(), String> {
        self.raw
            .store()
            .set_conf_state(cs)
            .map_err(|e| e.to_string())?;
        let replicas: Vec<u64> = sorted(&cs.voters).into_iter().map(replica_id).collect();
        tracing::info!(voters = ?replicas, "IAM membership changed");
        Ok(())
    }

    /// Takes a snapshot every `snapshot_every` entries, after a member was added, and once
    /// at the start of the log: a replica that joins (or lost its disk) must learn the
    /// membership from a snapshot, since the first membership is not in the log.
    fn maybe_snapshot(&mut self) -> Result<(), String> {
        let added = std::mem::take(&mut self.snapshot_now);
        let first = self.snapshot_index == 0;
        let due = self.applied >= self.snapshot_index + self.opts.snapshot_every.max(1);
        if !(first || due || added) || self.applied <= self.snapshot_index {
            return Ok(());
        }
        let data = {
            let st = self
                .shared
                .state
                .read()
                .unwrap_or_else(PoisonError::into_inner);
            machine::encode_snapshot(&st, &self.tags, &self.members)
        };
        self.raw
            .store()
            .snapshot_at(self.applied, data)
            .map_err(|e| e.to_string())?;
        self.snapshot_index = self.applied;
        tracing::debug!(index = self.applied, "IAM replica took a snapshot");
        Ok(())
    }
}

/// A single change as the one-change form of `ConfChangeV2` (as raft-rs converts it).
fn to_v2(mut c: ConfChange) -> ConfChangeV2 {
    let mut single = ConfChangeSingle::default();
    single.set_change_type(c.get_change_type());
    single.node_id = c.node_id;
    let mut v2 = ConfChangeV2::default();
    v2.mut_changes().push(single);
    v2.set_context(c.take_context());
    v2
}

fn sorted(ids: &[u64]) -> Vec<u64> {
    let mut v = ids.to_vec();
    v.sort_unstable();
    v
}
