//! Raft messages between IAM replicas over gRPC (raft.proto's `Raft` service on each
//! replica's `raft_addr`), mutual TLS when the cluster has it: only a certificate of role
//! `iam` may call it, and each peer is dialled expecting its own identity `iam/<id>`.
//!
//! Each peer has a queue and one task that sends what is queued in batches, in order. Raft
//! copes with loss, so nothing here waits or retries a message: a full queue or a failed
//! call drops the messages and tells the node the peer is unreachable, and the task waits
//! before the next call (100 ms, doubling to 2 s) while the peer stays down.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use protobuf::Message as _;
use raft::prelude::{ConfChange, ConfChangeType, EntryType, Message, MessageType};

use crate::types::Failure;
use tokio::sync::mpsc;
use tonic::{Request, Response, Status};

use super::machine::MemberChange;
use super::{replica_id, Replica, Reporter, Transport};
use crate::pb;
use crate::pki::Role;
use crate::rpc;

/// Messages waiting for one peer before new ones are dropped.
const QUEUE: usize = 4096;
/// Most messages in one call.
const BATCH: usize = 256;
/// How long one call may take (a batch with a snapshot of tens of MB included).
const SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest wait between calls to a peer that is down.
const MAX_BACKOFF: Duration = Duration::from_secs(2);

/// Sends to the peers of one replica; their raft ids to their `raft_addr`. The peers follow
/// the group's membership ([`Transport::set_peers`]).
pub struct GrpcTransport {
    peers: Mutex<HashMap<u64, Peer>>,
    reporter: Arc<Mutex<Option<Reporter>>>,
    dialer: rpc::client::Dialer,
    service_token: String,
    rt: tokio::runtime::Handle,
}

/// One peer's queue; dropping it ends the peer's sender task.
struct Peer {
    addr: String,
    queue: mpsc::Sender<Message>,
}

impl GrpcTransport {
    /// A transport to `peers` (raft id → `raft_addr`), each dialled with `dialer` expecting
    /// the identity `iam/<replica id>`, and the component secret on every call. Starts one
    /// task per peer on the current runtime (and later ones there too). Errors: a bad
    /// address.
    pub fn new(
        peers: &[(u64, String)],
        dialer: &rpc::client::Dialer,
        service_token: &str,
    ) -> Result<GrpcTransport, rpc::client::ClientError> {
        let t = GrpcTransport {
            peers: Mutex::default(),
            reporter: Arc::default(),
            dialer: dialer.clone(),
            service_token: service_token.to_string(),
            rt: tokio::runtime::Handle::current(),
        };
        let mut map = HashMap::new();
        for (id, addr) in peers {
            map.insert(*id, t.peer(*id, addr)?);
        }
        *t.peers.lock().unwrap_or_else(PoisonError::into_inner) = map;
        Ok(t)
    }

    fn peer(&self, id: u64, addr: &str) -> Result<Peer, rpc::client::ClientError> {
        // Channels and tasks belong to the runtime; the node thread calls this from outside.
        let _rt = self.rt.enter();
        let ch = self.dialer.channel_to(
            addr,
            Duration::from_secs(2),
            Role::Iam,
            Some(&replica_id(id).to_string()),
        )?;
        let client = pb::raft_client::RaftClient::new(ch)
            .max_decoding_message_size(rpc::MAX_MESSAGE)
            .max_encoding_message_size(rpc::MAX_MESSAGE);
        let (tx, rx) = mpsc::channel(QUEUE);
        self.rt.spawn(sender(
            id,
            client,
            rx,
            self.reporter.clone(),
            self.service_token.clone(),
        ));
        Ok(Peer {
            addr: addr.to_string(),
            queue: tx,
        })
    }
}

impl Transport for GrpcTransport {
    fn send(&self, msgs: Vec<Message>, reporter: &Reporter) {
        {
            let mut r = self.reporter.lock().unwrap_or_else(PoisonError::into_inner);
            if r.is_none() {
                *r = Some(reporter.clone());
            }
        }
        let peers = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        for m in msgs {
            let to = m.to;
            let snap = m.get_msg_type() == MessageType::MsgSnapshot;
            let sent = peers.get(&to).is_some_and(|p| p.queue.try_send(m).is_ok());
            if !sent {
                if snap {
                    reporter.snapshot_sent(to, false);
                }
                reporter.unreachable(to);
            }
        }
    }

    fn set_peers(&self, peers: &[(u64, String)]) {
        let mut cur = self.peers.lock().unwrap_or_else(PoisonError::into_inner);
        cur.retain(|id, p| peers.iter().any(|(i, a)| i == id && *a == p.addr));
        for (id, addr) in peers {
            if cur.contains_key(id) {
                continue;
            }
            match self.peer(*id, addr) {
                Ok(p) => {
                    tracing::info!(peer = replica_id(*id), raft_addr = %addr, "IAM replica now sends to this peer");
                    cur.insert(*id, p);
                }
                // A member added with an address we cannot dial: it stays unreachable
                // (and `iam members` shows it), as a peer that is down.
                Err(e) => {
                    tracing::warn!(peer = replica_id(*id), raft_addr = %addr, error = %e, "IAM replica cannot reach a member")
                }
            }
        }
    }
}

async fn sender(
    to: u64,
    mut client: pb::raft_client::RaftClient<tonic::transport::Channel>,
    mut rx: mpsc::Receiver<Message>,
    reporter: Arc<Mutex<Option<Reporter>>>,
    service_token: String,
) {
    let mut backoff = Duration::ZERO;
    let mut batch = Vec::with_capacity(BATCH);
    while rx.recv_many(&mut batch, BATCH).await > 0 {
        let snapshots = batch
            .iter()
            .filter(|m| m.get_msg_type() == MessageType::MsgSnapshot)
            .count();
        let messages = batch
            .drain(..)
            .map(|m| m.write_to_bytes().unwrap_or_default())
            .collect();
        let req = rpc::client::internal(pb::RaftBatch { messages }, &service_token);
        // A peer that stopped reading must not hold this queue until keepalive notices
        // (about 15 s): Raft resends what still matters after a failed call.
        let ok = match tokio::time::timeout(SEND_TIMEOUT, client.send(req)).await {
            Ok(Ok(_)) => true,
            Ok(Err(s)) => {
                tracing::debug!(peer = replica_id(to), error = %s.message(), "Raft messages not delivered");
                false
            }
            Err(_) => {
                tracing::debug!(peer = replica_id(to), "Raft messages not delivered in time");
                false
            }
        };
        let rep = reporter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if let Some(rep) = &rep {
            for _ in 0..snapshots {
                rep.snapshot_sent(to, ok);
            }
            if !ok {
                rep.unreachable(to);
            }
        }
        if ok {
            backoff = Duration::ZERO;
        } else {
            backoff = (backoff * 2).clamp(Duration::from_millis(100), MAX_BACKOFF);
            tokio::time::sleep(backoff).await;
            // What queued up meanwhile is stale: Raft sends again what still matters.
            // A snapshot dropped here must be reported, or the leader waits for it forever.
            while let Ok(m) = rx.try_recv() {
                if m.get_msg_type() == MessageType::MsgSnapshot {
                    if let Some(rep) = &rep {
                        rep.snapshot_sent(to, false);
                    }
                }
            }
        }
    }
}

/// The `Raft` service of one replica: hands each message to its node.
#[derive(Clone)]
pub struct RaftService {
    replica: Replica,
    service_token: String,
}

impl RaftService {
    /// The service for `replica`; `service_token` "" accepts every caller (plaintext
    /// development clusters), as the other internal services.
    pub fn new(replica: Replica, service_token: &str) -> RaftService {
        RaftService {
            replica,
            service_token: service_token.to_string(),
        }
    }

    /// The tonic server, with the project's message limits.
    pub fn server(self) -> pb::raft_server::RaftServer<RaftService> {
        pb::raft_server::RaftServer::new(self)
            .max_decoding_message_size(rpc::MAX_MESSAGE)
            .max_encoding_message_size(rpc::MAX_MESSAGE)
    }
}

#[tonic::async_trait]
impl pb::raft_server::Raft for RaftService {
    async fn send(&self, req: Request<pb::RaftBatch>) -> Result<Response<pb::RaftAck>, Status> {
        rpc::check_service_token(&req, &self.service_token)?;
        // Under mTLS the sender's certificate names it: a replica speaks only for itself.
        let sender = rpc::acl::caller(&req).map(|who| who.id.clone());
        let me = self.replica.id();
        // The whole batch is checked before any of it reaches the node.
        let mut msgs = Vec::new();
        for b in req.into_inner().messages {
            let m = Message::parse_from_bytes(&b).map_err(|e| {
                rpc::to_status(&crate::types::Failure::invalid(format!(
                    "not a Raft message: {e}"
                )))
            })?;
            check_message(&m, me, sender.as_deref()).map_err(|f| rpc::to_status(&f))?;
            msgs.push(m);
        }
        for m in msgs {
            self.replica.step(m);
        }
        Ok(Response::new(pb::RaftAck {}))
    }
}

/// Refuses what a replica never sends and raft-rs would trip over: a sender id 0 (raft-rs
/// would record a vote for "nobody" and vote again), a sender other than the calling
/// certificate's replica, a message for another replica, a proposal or read request
/// without entries (raft-rs panics on them), and a proposal of anything but plain entries
/// and membership changes made as [`Replica::change_member`] makes them (one voter added
/// or removed, its addresses beside it).
fn check_message(m: &Message, me: u64, sender: Option<&str>) -> Result<(), Failure> {
    if m.to != me {
        return Err(Failure::invalid(format!(
            "a message for replica {} reached replica {}",
            replica_id(m.to),
            replica_id(me)
        )));
    }
    if m.from == 0 {
        return Err(Failure::invalid("a Raft message from replica id 0 (none)"));
    }
    if let Some(s) = sender {
        if s.parse::<u64>().ok().map(super::raft_id) != Some(m.from) {
            return Err(Failure::forbidden(format!(
                "replica {s} sent a message as replica {}",
                replica_id(m.from)
            )));
        }
    }
    match m.get_msg_type() {
        MessageType::MsgPropose if m.entries.is_empty() || !m.entries.iter().all(forwardable) => {
            return Err(Failure::invalid(
                "a forwarded proposal must carry plain entries or one membership change",
            ));
        }
        MessageType::MsgReadIndex if m.entries.is_empty() => {
            return Err(Failure::invalid("a read index request without its context"));
        }
        _ => {}
    }
    Ok(())
}

/// A plain entry, or a membership change of one voter with its well-formed context.
fn forwardable(e: &raft::prelude::Entry) -> bool {
    match e.get_entry_type() {
        EntryType::EntryNormal => true,
        EntryType::EntryConfChange => {
            let Ok(cc) = ConfChange::parse_from_bytes(&e.data) else {
                return false;
            };
            // A member is added as a learner; only the leader makes a voter of it (that
            // change is never forwarded), so a forwarded AddNode is not one of ours.
            let kind_ok = matches!(
                cc.get_change_type(),
                ConfChangeType::AddLearnerNode | ConfChangeType::RemoveNode
            );
            let ctx_ok = MemberChange::decode(&cc.context)
                .is_ok_and(|c| c.member.id.checked_add(1) == Some(cc.node_id));
            kind_ok && cc.node_id != 0 && ctx_ok
        }
        EntryType::EntryConfChangeV2 => false,
    }
}
