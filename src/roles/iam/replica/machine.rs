//! The replicated state machine of an IAM replica: the IAM state that [`apply`] changes, plus
//! the tags of the entries applied lately, so that a proposal sent twice (a replica proposes
//! again when a leader change may have lost its first copy) changes the state once.
//!
//! Every replica applies the same entries in the same order, so the skip decisions, like the
//! state, are the same everywhere; the recent tags travel in snapshots for that reason.

use std::collections::{HashSet, VecDeque};

use serde::{Deserialize, Serialize};

use super::super::apply::apply;
use super::super::command::{Command, Outcome};
use super::super::state::IamState;
use crate::types::Failure;

/// How many recent entry tags are remembered. A proposal is proposed again for at most a few
/// seconds, far fewer entries than this even at tens of thousands of commits a second.
pub const RECENT_TAGS: usize = 1 << 16;

/// One log entry's payload: the command and the tag its proposer gave it.
#[derive(Debug, Serialize, Deserialize)]
pub struct Envelope {
    /// Random, chosen once per proposal and kept when it is proposed again.
    pub tag: u128,
    pub cmd: Command,
}

impl Envelope {
    /// The entry bytes (JSON, as the standalone log and backups).
    pub fn encode(&self) -> Vec<u8> {
        // Serializing plain data into a Vec does not fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(data: &[u8]) -> Result<Envelope, serde_json::Error> {
        serde_json::from_slice(data)
    }
}

/// What applying one entry did.
#[derive(Debug)]
pub enum Applied {
    /// The command's result (its failure included: a refused command changes nothing on any
    /// replica).
    Result(Result<Outcome, Failure>),
    /// The tag was applied before: nothing changed.
    Duplicate,
}

/// The tags of the latest [`RECENT_TAGS`] applied entries.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct Tags {
    recent: VecDeque<u128>,
    seen: HashSet<u128>,
}

impl Tags {
    /// Records `tag`; false when it is among the recent ones already.
    fn first_time(&mut self, tag: u128) -> bool {
        if !self.seen.insert(tag) {
            return false;
        }
        self.recent.push_back(tag);
        while self.recent.len() > RECENT_TAGS {
            if let Some(old) = self.recent.pop_front() {
                self.seen.remove(&old);
            }
        }
        true
    }
}

/// Applies one entry's envelope to `state`, unless its tag was applied lately.
pub fn apply_entry(state: &mut IamState, tags: &mut Tags, env: &Envelope) -> Applied {
    if !tags.first_time(env.tag) {
        return Applied::Duplicate;
    }
    Applied::Result(apply(state, &env.cmd))
}

/// One replica of the group as every replica knows it: the membership's addresses, changed
/// only by committed membership changes, so that a replica added after the config was written
/// is reached at the address it was added with.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// The replica id (the config's `id`; its raft id is this plus one).
    pub id: u64,
    /// Its `Iam` gRPC address.
    pub addr: String,
    /// Its Raft address.
    pub raft_addr: String,
}

/// The context of a membership change entry: who asked (to answer them) and, for an
/// addition, the new member's addresses.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MemberChange {
    pub tag: u128,
    pub member: Member,
}

impl MemberChange {
    pub fn encode(&self) -> Vec<u8> {
        // Serializing plain data into a Vec does not fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn decode(data: &[u8]) -> Result<MemberChange, serde_json::Error> {
        serde_json::from_slice(data)
    }
}

/// Sets `m` in `members` (replacing the entry with its id), kept sorted by id.
pub fn put_member(members: &mut Vec<Member>, m: Member) {
    members.retain(|o| o.id != m.id);
    members.push(m);
    members.sort_by_key(|m| m.id);
}

#[derive(Serialize)]
struct SnapshotRef<'a> {
    state: &'a IamState,
    recent: &'a VecDeque<u128>,
    members: &'a [Member],
}

#[derive(Deserialize)]
struct SnapshotOwned {
    state: IamState,
    recent: VecDeque<u128>,
    /// Absent in snapshots from before membership changes existed: the config's then.
    #[serde(default)]
    members: Option<Vec<Member>>,
}

/// What a snapshot holds.
pub struct Machine {
    pub state: IamState,
    pub tags: Tags,
    /// `None`: the snapshot does not say (empty bytes, or an older snapshot).
    pub members: Option<Vec<Member>>,
}

/// The snapshot bytes of a machine.
pub fn encode_snapshot(state: &IamState, tags: &Tags, members: &[Member]) -> Vec<u8> {
    serde_json::to_vec(&SnapshotRef {
        state,
        recent: &tags.recent,
        members,
    })
    .unwrap_or_default()
}

/// A machine from snapshot bytes (empty bytes: the initial machine).
pub fn decode_snapshot(data: &[u8]) -> Result<Machine, serde_json::Error> {
    if data.is_empty() {
        return Ok(Machine {
            state: IamState::default(),
            tags: Tags::default(),
            members: None,
        });
    }
    let s: SnapshotOwned = serde_json::from_slice(data)?;
    let mut state = s.state;
    state.rebuild_index();
    let seen = s.recent.iter().copied().collect();
    Ok(Machine {
        state,
        tags: Tags {
            recent: s.recent,
            seen,
        },
        members: s.members,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn configure(q: f64) -> Command {
        Command::Configure {
            root_quota: [("cpu_cores".to_string(), q)].into_iter().collect(),
            max_token_ttl_s: 0,
        }
    }

    fn env(tag: u128, q: f64) -> Envelope {
        Envelope {
            tag,
            cmd: configure(q),
        }
    }

    #[test]
    fn a_tag_applies_once_and_survives_a_snapshot() {
        let (mut st, mut tags) = (IamState::default(), Tags::default());
        let e = env(7, 1.0);
        assert!(matches!(
            apply_entry(&mut st, &mut tags, &e),
            Applied::Result(_)
        ));
        assert!(matches!(
            apply_entry(&mut st, &mut tags, &e),
            Applied::Duplicate
        ));
        let members = vec![Member {
            id: 3,
            addr: "a:1".into(),
            raft_addr: "a:2".into(),
        }];
        let m = decode_snapshot(&encode_snapshot(&st, &tags, &members)).unwrap();
        let (mut st2, mut tags2) = (m.state, m.tags);
        assert_eq!((&st2, &tags2), (&st, &tags));
        assert_eq!(m.members, Some(members));
        // A snapshot from before membership changes names no members.
        let old = serde_json::json!({"state": st, "recent": [7]}).to_string();
        assert_eq!(decode_snapshot(old.as_bytes()).unwrap().members, None);
        assert!(matches!(
            apply_entry(&mut st2, &mut tags2, &e),
            Applied::Duplicate
        ));
        assert!(matches!(
            apply_entry(&mut st2, &mut tags2, &env(8, 2.0)),
            Applied::Result(_)
        ));
        assert_eq!(decode_snapshot(b"").unwrap().tags, Tags::default());
        let raw = Envelope::decode(&e.encode()).unwrap();
        assert_eq!((raw.tag, raw.cmd), (7, configure(1.0)));
        // Tags use the whole 128 bits.
        let big = Envelope::decode(&env(u128::MAX, 1.0).encode()).unwrap();
        assert_eq!(big.tag, u128::MAX);
    }

    #[test]
    fn only_the_latest_tags_are_remembered() {
        let (mut st, mut tags) = (IamState::default(), Tags::default());
        for tag in 0..(RECENT_TAGS as u128 + 10) {
            apply_entry(&mut st, &mut tags, &env(tag, 1.0));
        }
        assert_eq!(tags.recent.len(), RECENT_TAGS);
        assert_eq!(tags.seen.len(), RECENT_TAGS);
        assert!(matches!(
            apply_entry(&mut st, &mut tags, &env(3, 1.0)),
            Applied::Result(_)
        ));
        assert!(matches!(
            apply_entry(&mut st, &mut tags, &env(RECENT_TAGS as u128 + 9, 1.0)),
            Applied::Duplicate
        ));
    }
}
