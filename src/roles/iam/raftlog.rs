//! The durable Raft log of an IAM replica: raft-rs's `Storage` over a redb file (one
//! `raft.redb` per replica). It holds the log entries, the hard state (term, vote, commit),
//! the membership (conf state) and the latest snapshot of the state machine, and every
//! change is one redb transaction made durable (fsync) before it returns, which is what
//! raft-rs's `Ready` order needs: persist, then send the messages that depend on it.
//!
//! Layout: table `entries` (index → encoded `Entry`), table `meta` (`hard_state`,
//! `conf_state`, `snapshot` → encoded protobuf). The first and last index, the hard and
//! conf state and the snapshot are also kept in memory; entries are read from the file.
//!
//! A snapshot here is the state machine at an applied index (`snapshot_at`): taking one
//! drops the entries it covers, so `first_index` is its index + 1 and its term answers
//! `term(index)`, as raft-rs expects after compaction.

use std::path::Path;
use std::sync::RwLock;

use protobuf::Message;
use raft::prelude::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, StorageError};
use redb::{Database, ReadableTable, TableDefinition};

const ENTRIES: TableDefinition<u64, &[u8]> = TableDefinition::new("entries");
const META: TableDefinition<&str, &[u8]> = TableDefinition::new("meta");
const HARD_STATE: &str = "hard_state";
const CONF_STATE: &str = "conf_state";
const SNAPSHOT: &str = "snapshot";

/// Why the log could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("raft log {path}: {source}")]
    Db {
        path: String,
        source: Box<redb::Error>,
    },
    #[error("raft log: decoding {what}: {source}")]
    Decode {
        what: &'static str,
        source: protobuf::ProtobufError,
    },
    #[error("raft log: appending at {first} after {last}: a gap")]
    Gap { first: u64, last: u64 },
    #[error("raft log: entry {index} is compacted (the log starts at {first})")]
    Compacted { index: u64, first: u64 },
    #[error("raft log: entry {index} is not there (the log ends at {last})")]
    Unavailable { index: u64, last: u64 },
}

impl From<LogError> for raft::Error {
    fn from(e: LogError) -> raft::Error {
        match e {
            LogError::Compacted { .. } => raft::Error::Store(StorageError::Compacted),
            LogError::Unavailable { .. } => raft::Error::Store(StorageError::Unavailable),
            other => raft::Error::Store(StorageError::Other(Box::new(other))),
        }
    }
}

#[derive(Default)]
struct Mem {
    first: u64,
    last: u64,
    hard: HardState,
    conf: ConfState,
    snapshot: Snapshot,
}

/// A replica's durable Raft log; cheap to share behind an `Arc`.
pub struct RaftLog {
    db: Database,
    path: String,
    mem: RwLock<Mem>,
}

fn decode<M: Message>(what: &'static str, b: &[u8]) -> Result<M, LogError> {
    M::parse_from_bytes(b).map_err(|source| LogError::Decode { what, source })
}

fn encode<M: Message>(m: &M) -> Vec<u8> {
    // Writing a message to a Vec cannot fail: no I/O, and our messages have no required
    // fields.
    m.write_to_bytes().unwrap_or_default()
}

impl RaftLog {
    /// Opens (or creates) the log at `path`. Errors: `Db`, `Decode`.
    pub fn open(path: &Path) -> Result<RaftLog, LogError> {
        let p = path.display().to_string();
        let db_err = |e: redb::Error| LogError::Db {
            path: p.clone(),
            source: Box::new(e),
        };
        let db = Database::create(path).map_err(|e| db_err(e.into()))?;
        let log = RaftLog {
            db,
            path: p.clone(),
            mem: RwLock::new(Mem::default()),
        };
        // The tables exist from the first open on, so reads never meet a missing table.
        let tx = db_call(&log.path, log.db.begin_write())?;
        db_call(&log.path, tx.open_table(ENTRIES))?;
        db_call(&log.path, tx.open_table(META))?;
        db_call(&log.path, tx.commit())?;
        log.load()?;
        Ok(log)
    }

    fn load(&self) -> Result<(), LogError> {
        let tx = db_call(&self.path, self.db.begin_read())?;
        let meta = db_call(&self.path, tx.open_table(META))?;
        let get = |k: &str| -> Result<Option<Vec<u8>>, LogError> {
            Ok(db_call(&self.path, meta.get(k))?.map(|v| v.value().to_vec()))
        };
        let mut m = Mem::default();
        if let Some(b) = get(HARD_STATE)? {
            m.hard = decode("hard state", &b)?;
        }
        if let Some(b) = get(CONF_STATE)? {
            m.conf = decode("conf state", &b)?;
        }
        if let Some(b) = get(SNAPSHOT)? {
            m.snapshot = decode("snapshot", &b)?;
        }
        let entries = db_call(&self.path, tx.open_table(ENTRIES))?;
        let snap_index = m.snapshot.get_metadata().index;
        m.first = snap_index + 1;
        m.last = match db_call(&self.path, entries.last())? {
            Some((k, _)) => k.value(),
            None => snap_index,
        };
        *self.mem.write().unwrap_or_else(|p| p.into_inner()) = m;
        Ok(())
    }

    /// Appends `ents` (contiguous), replacing any entries from the first one's index on
    /// (a new leader's log wins over an uncommitted suffix), and sets the hard state `hard`
    /// when given, in one durable transaction. Errors: `Gap` where `ents` would leave a
    /// hole, `Compacted` where they start inside the snapshot, `Db`.
    pub fn append(&self, ents: &[Entry], hard: Option<&HardState>) -> Result<(), LogError> {
        let (first, last) = {
            let m = self.mem.read().unwrap_or_else(|p| p.into_inner());
            (m.first, m.last)
        };
        if let Some(e) = ents.first() {
            if e.index < first {
                return Err(LogError::Compacted {
                    index: e.index,
                    first,
                });
            }
            if e.index > last + 1 {
                return Err(LogError::Gap {
                    first: e.index,
                    last,
                });
            }
        }
        let tx = db_call(&self.path, self.db.begin_write())?;
        {
            let mut t = db_call(&self.path, tx.open_table(ENTRIES))?;
            if let Some(e) = ents.first() {
                db_call(&self.path, t.retain_in(e.index.., |_, _| false))?;
            }
            for e in ents {
                db_call(&self.path, t.insert(e.index, encode(e).as_slice()))?;
            }
            if let Some(h) = hard {
                let mut meta = db_call(&self.path, tx.open_table(META))?;
                db_call(&self.path, meta.insert(HARD_STATE, encode(h).as_slice()))?;
            }
        }
        db_call(&self.path, tx.commit())?;
        let mut m = self.mem.write().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = ents.last() {
            m.last = e.index;
        }
        if let Some(h) = hard {
            m.hard = h.clone();
        }
        Ok(())
    }

    /// Sets the membership. Errors: `Db`.
    pub fn set_conf_state(&self, cs: &ConfState) -> Result<(), LogError> {
        self.put_meta(CONF_STATE, &encode(cs))?;
        self.mem.write().unwrap_or_else(|p| p.into_inner()).conf = cs.clone();
        Ok(())
    }

    /// Sets the hard state alone. Errors: `Db`.
    pub fn set_hard_state(&self, hs: &HardState) -> Result<(), LogError> {
        self.put_meta(HARD_STATE, &encode(hs))?;
        self.mem.write().unwrap_or_else(|p| p.into_inner()).hard = hs.clone();
        Ok(())
    }

    /// Moves the commit index forward, without an fsync of its own: a commit index that a
    /// crash loses is learned again from the leader, and the next durable write carries it.
    /// Errors: `Db`.
    pub fn set_commit(&self, commit: u64) -> Result<(), LogError> {
        let mut hs = self
            .mem
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .hard
            .clone();
        if hs.commit >= commit {
            return Ok(());
        }
        hs.commit = commit;
        let mut tx = db_call(&self.path, self.db.begin_write())?;
        tx.set_durability(redb::Durability::None);
        {
            let mut meta = db_call(&self.path, tx.open_table(META))?;
            db_call(&self.path, meta.insert(HARD_STATE, encode(&hs).as_slice()))?;
        }
        db_call(&self.path, tx.commit())?;
        self.mem.write().unwrap_or_else(|p| p.into_inner()).hard = hs;
        Ok(())
    }

    /// The snapshot stored last (empty before the first).
    pub fn last_snapshot(&self) -> Snapshot {
        self.mem
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .snapshot
            .clone()
    }

    fn put_meta(&self, key: &str, value: &[u8]) -> Result<(), LogError> {
        let tx = db_call(&self.path, self.db.begin_write())?;
        {
            let mut meta = db_call(&self.path, tx.open_table(META))?;
            db_call(&self.path, meta.insert(key, value))?;
        }
        db_call(&self.path, tx.commit())
    }

    /// Records the state machine `data` as applied up to `index` (≤ the last entry) and
    /// drops the entries it covers. Errors: `Compacted` for an index before the current
    /// snapshot's, `Unavailable` past the last entry, `Db`.
    pub fn snapshot_at(&self, index: u64, data: Vec<u8>) -> Result<(), LogError> {
        let term = self.term_of(index)?;
        let (conf, cur) = {
            let m = self.mem.read().unwrap_or_else(|p| p.into_inner());
            (m.conf.clone(), m.snapshot.get_metadata().index)
        };
        if index < cur {
            return Err(LogError::Compacted {
                index,
                first: cur + 1,
            });
        }
        let mut snap = Snapshot::default();
        snap.set_data(data.into());
        let meta: &mut SnapshotMetadata = snap.mut_metadata();
        meta.index = index;
        meta.term = term;
        meta.set_conf_state(conf);
        let tx = db_call(&self.path, self.db.begin_write())?;
        {
            let mut t = db_call(&self.path, tx.open_table(ENTRIES))?;
            db_call(&self.path, t.retain_in(..=index, |_, _| false))?;
            let mut meta = db_call(&self.path, tx.open_table(META))?;
            db_call(&self.path, meta.insert(SNAPSHOT, encode(&snap).as_slice()))?;
        }
        db_call(&self.path, tx.commit())?;
        let mut m = self.mem.write().unwrap_or_else(|p| p.into_inner());
        m.first = index + 1;
        m.last = m.last.max(index);
        m.snapshot = snap;
        Ok(())
    }

    /// Replaces the log with a leader's snapshot (a replica that fell behind, or a new
    /// one): every entry goes, the membership and commit become the snapshot's. Errors:
    /// `Compacted` for a snapshot older than ours, `Db`.
    pub fn apply_snapshot(&self, snap: &Snapshot) -> Result<(), LogError> {
        let meta = snap.get_metadata();
        let (first, mut hard) = {
            let m = self.mem.read().unwrap_or_else(|p| p.into_inner());
            (m.first, m.hard.clone())
        };
        if meta.index < first.saturating_sub(1) {
            return Err(LogError::Compacted {
                index: meta.index,
                first,
            });
        }
        hard.term = hard.term.max(meta.term);
        hard.commit = meta.index;
        let conf = meta.get_conf_state().clone();
        let tx = db_call(&self.path, self.db.begin_write())?;
        {
            let mut t = db_call(&self.path, tx.open_table(ENTRIES))?;
            db_call(&self.path, t.retain(|_, _| false))?;
            let mut m = db_call(&self.path, tx.open_table(META))?;
            db_call(&self.path, m.insert(SNAPSHOT, encode(snap).as_slice()))?;
            db_call(&self.path, m.insert(HARD_STATE, encode(&hard).as_slice()))?;
            db_call(&self.path, m.insert(CONF_STATE, encode(&conf).as_slice()))?;
        }
        db_call(&self.path, tx.commit())?;
        let mut m = self.mem.write().unwrap_or_else(|p| p.into_inner());
        m.first = meta.index + 1;
        m.last = meta.index;
        m.hard = hard;
        m.conf = conf;
        m.snapshot = snap.clone();
        Ok(())
    }

    fn term_of(&self, idx: u64) -> Result<u64, LogError> {
        let (first, last, snap) = {
            let m = self.mem.read().unwrap_or_else(|p| p.into_inner());
            (m.first, m.last, m.snapshot.get_metadata().clone())
        };
        if idx == snap.index {
            return Ok(snap.term);
        }
        if idx < first {
            return Err(LogError::Compacted { index: idx, first });
        }
        if idx > last {
            return Err(LogError::Unavailable { index: idx, last });
        }
        let tx = db_call(&self.path, self.db.begin_read())?;
        let t = db_call(&self.path, tx.open_table(ENTRIES))?;
        match db_call(&self.path, t.get(idx))? {
            Some(v) => Ok(decode::<Entry>("entry", v.value())?.term),
            None => Err(LogError::Unavailable { index: idx, last }),
        }
    }

    fn entries_in(
        &self,
        low: u64,
        high: u64,
        max_size: Option<u64>,
    ) -> Result<Vec<Entry>, LogError> {
        let (first, last) = {
            let m = self.mem.read().unwrap_or_else(|p| p.into_inner());
            (m.first, m.last)
        };
        if low < first {
            return Err(LogError::Compacted { index: low, first });
        }
        if high > last + 1 {
            return Err(LogError::Unavailable {
                index: high - 1,
                last,
            });
        }
        let tx = db_call(&self.path, self.db.begin_read())?;
        let t = db_call(&self.path, tx.open_table(ENTRIES))?;
        let mut out = Vec::new();
        let mut size = 0u64;
        for item in db_call(&self.path, t.range(low..high))? {
            let (_, v) = db_call(&self.path, item)?;
            let bytes = v.value();
            size += bytes.len() as u64;
            // At least one entry, however large; then only while within max_size.
            if !out.is_empty() && max_size.is_some_and(|m| size > m) {
                break;
            }
            out.push(decode("entry", bytes)?);
        }
        Ok(out)
    }
}

/// Runs a redb call, naming the file in its error.
fn db_call<T, E: Into<redb::Error>>(path: &str, r: Result<T, E>) -> Result<T, LogError> {
    r.map_err(|e| LogError::Db {
        path: path.to_string(),
        source: Box::new(e.into()),
    })
}

impl raft::Storage for RaftLog {
    fn initial_state(&self) -> raft::Result<RaftState> {
        let m = self.mem.read().unwrap_or_else(|p| p.into_inner());
        Ok(RaftState::new(m.hard.clone(), m.conf.clone()))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        _context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        Ok(self.entries_in(low, high, max_size.into())?)
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        Ok(self.term_of(idx)?)
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.mem.read().unwrap_or_else(|p| p.into_inner()).first)
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.mem.read().unwrap_or_else(|p| p.into_inner()).last)
    }

    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        let m = self.mem.read().unwrap_or_else(|p| p.into_inner());
        if m.snapshot.get_metadata().index < request_index {
            // The caller takes a newer one (snapshot_at) and raft asks again.
            return Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        Ok(m.snapshot.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use raft::Storage;

    /// The indexes of the entries in the file.
    fn stored(log: &RaftLog) -> Vec<u64> {
        let tx = log.db.begin_read().unwrap();
        let t = tx.open_table(ENTRIES).unwrap();
        t.iter().unwrap().map(|r| r.unwrap().0.value()).collect()
    }

    fn entry(index: u64, term: u64, data: &[u8]) -> Entry {
        Entry {
            index,
            term,
            data: data.to_vec().into(),
            ..Default::default()
        }
    }

    fn ctx() -> GetEntriesContext {
        GetEntriesContext::empty(false)
    }

    #[test]
    fn entries_and_hard_state_survive_a_reopen() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raft.redb");
        {
            let log = RaftLog::open(&path).unwrap();
            assert_eq!(
                (log.first_index().unwrap(), log.last_index().unwrap()),
                (1, 0)
            );
            let hs = HardState {
                term: 2,
                vote: 3,
                commit: 2,
                ..Default::default()
            };
            let ents: Vec<Entry> = (1..=3).map(|i| entry(i, 1 + i / 2, b"x")).collect();
            log.append(&ents, Some(&hs)).unwrap();
            let cs = ConfState {
                voters: vec![1, 2, 3],
                ..Default::default()
            };
            log.set_conf_state(&cs).unwrap();
        }
        let log = RaftLog::open(&path).unwrap();
        let st = log.initial_state().unwrap();
        assert_eq!(
            (st.hard_state.term, st.hard_state.vote, st.hard_state.commit),
            (2, 3, 2)
        );
        assert_eq!(st.conf_state.voters, vec![1, 2, 3]);
        assert_eq!(
            (log.first_index().unwrap(), log.last_index().unwrap()),
            (1, 3)
        );
        let got = log.entries(1, 4, None, ctx()).unwrap();
        assert_eq!(
            got.iter().map(|e| e.term).collect::<Vec<_>>(),
            vec![1, 2, 2]
        );
        assert_eq!(log.term(3).unwrap(), 2);
        // max_size: at least one entry, then only what fits.
        assert_eq!(log.entries(1, 4, Some(0), ctx()).unwrap().len(), 1);
        // Out of range: raft-rs's errors, no panic.
        assert!(matches!(
            log.entries(1, 6, None, ctx()),
            Err(raft::Error::Store(StorageError::Unavailable))
        ));
        assert!(matches!(
            log.term(9),
            Err(raft::Error::Store(StorageError::Unavailable))
        ));
    }

    #[test]
    fn a_new_leaders_entries_replace_a_conflicting_suffix_and_gaps_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let log = RaftLog::open(&dir.path().join("raft.redb")).unwrap();
        let ents: Vec<Entry> = (1..=5).map(|i| entry(i, 1, b"old")).collect();
        log.append(&ents, None).unwrap();
        log.append(&[entry(3, 2, b"new")], None).unwrap();
        assert_eq!(stored(&log), vec![1, 2, 3]);
        assert_eq!(log.last_index().unwrap(), 3);
        let got = log.entries(1, 4, None, ctx()).unwrap();
        assert_eq!(got[2].get_data(), b"new");
        assert!(matches!(
            log.append(&[entry(5, 2, b"gap")], None),
            Err(LogError::Gap { first: 5, last: 3 })
        ));
        assert_eq!(log.last_index().unwrap(), 3);
    }

    #[test]
    fn a_snapshot_compacts_the_log_and_answers_for_its_index() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raft.redb");
        {
            let log = RaftLog::open(&path).unwrap();
            let ents: Vec<Entry> = (1..=10).map(|i| entry(i, i / 4 + 1, b"e")).collect();
            log.append(&ents, None).unwrap();
            let cs = ConfState {
                voters: vec![1],
                ..Default::default()
            };
            log.set_conf_state(&cs).unwrap();
            log.snapshot_at(6, b"state at 6".to_vec()).unwrap();
            assert!(matches!(
                log.snapshot_at(4, b"older".to_vec()),
                Err(LogError::Compacted { .. })
            ));
        }
        let log = RaftLog::open(&path).unwrap();
        assert_eq!(stored(&log), vec![7, 8, 9, 10]);
        assert_eq!(
            (log.first_index().unwrap(), log.last_index().unwrap()),
            (7, 10)
        );
        assert_eq!(log.term(6).unwrap(), 2);
        assert!(matches!(
            log.term(5),
            Err(raft::Error::Store(StorageError::Compacted))
        ));
        assert!(matches!(
            log.entries(5, 8, None, ctx()),
            Err(raft::Error::Store(StorageError::Compacted))
        ));
        let s = log.snapshot(6, 2).unwrap();
        assert_eq!(s.get_metadata().index, 6);
        assert_eq!(s.get_metadata().get_conf_state().voters, vec![1]);
        assert_eq!(s.get_data(), b"state at 6");
        assert!(matches!(
            log.snapshot(8, 2),
            Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable
            ))
        ));
        // A follower given a leader's newer snapshot drops its whole log for it.
        let mut leader = Snapshot::default();
        leader.mut_metadata().index = 20;
        leader.mut_metadata().term = 5;
        leader.mut_metadata().mut_conf_state().voters = vec![1, 2, 3];
        leader.set_data(b"state at 20".to_vec().into());
        log.apply_snapshot(&leader).unwrap();
        assert!(stored(&log).is_empty());
        assert_eq!(
            (log.first_index().unwrap(), log.last_index().unwrap()),
            (21, 20)
        );
        let st = log.initial_state().unwrap();
        assert_eq!((st.hard_state.term, st.hard_state.commit), (5, 20));
        assert_eq!(st.conf_state.voters, vec![1, 2, 3]);
        log.append(&[entry(21, 5, b"next")], None).unwrap();
        assert_eq!(log.term(20).unwrap(), 5);
        assert_eq!(log.term(21).unwrap(), 5);
    }
}
