//! Named locks with a TTL and the key-value area (docs/iam-replicas.md "Locks and the
//! key-value area"). Watchers (and later fleet) elect a leader with a lock; fleet keeps its
//! small durable records in the area. Both are replicated with the rest of IAM's state, and
//! every change of a key or of a lock's holder takes the next revision of one counter, so
//! revisions order them cluster-wide and compare-and-set can detect any write in between.
//!
//! Time is the proposer's (`now_ms` in the command), as everywhere in `apply`: every
//! replica decides the same. Holders allow for clocks that differ (see the watcher's
//! `lock` module).

use super::command::Outcome;
use super::state::{IamState, KvValue, LockHold};
use crate::types::{Failure, Reason};

/// The prefixes keys must start with: fleet's machines, releases and rollouts.
pub const KV_PREFIXES: &[&str] = &["nodes/", "releases/", "rollouts/"];
/// Longest key, in bytes.
pub const MAX_KEY_LEN: usize = 256;
/// Largest value, in bytes: the area is for small records.
pub const MAX_VALUE_LEN: usize = 64 * 1024;
/// Most keys the area holds (`no_capacity` past it).
pub const MAX_KEYS: usize = 100_000;
/// Most bytes of keys and values the area holds (`no_capacity` past it): the whole state
/// travels in one snapshot message to a replica that catches up, under the 80 MiB limit.
pub const MAX_BYTES: usize = 32 << 20;
/// The lock watchers elect their reconciler with (docs/watcher.md).
pub const RECONCILE_LOCK: &str = "watcher-reconcile";
/// Most locks held at once (`no_capacity` past it).
pub const MAX_LOCKS: usize = 1024;
/// Shortest and longest lock TTL, in milliseconds.
pub const MIN_TTL_MS: i64 = 1_000;
pub const MAX_TTL_MS: i64 = 3_600_000;

/// Checks a lock name: 1 to 64 of `a-z 0-9 -`, starting with a letter or digit. `invalid`.
pub fn check_lock_name(name: &str) -> Result<(), Failure> {
    let ok = (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-');
    if ok {
        Ok(())
    } else {
        Err(Failure::invalid(format!(
            "lock name {name:?}: 1 to 64 of a-z, 0-9 and '-', not starting with '-'"
        )))
    }
}

/// Checks a holder name: 1 to 128 printable ASCII characters without spaces. `invalid`.
pub fn check_holder(holder: &str) -> Result<(), Failure> {
    if (1..=128).contains(&holder.len()) && holder.bytes().all(|b| b.is_ascii_graphic()) {
        Ok(())
    } else {
        Err(Failure::invalid(format!(
            "lock holder {holder:?}: 1 to 128 printable characters without spaces"
        )))
    }
}

/// Checks a key: one of [`KV_PREFIXES`] and a non-empty rest, at most [`MAX_KEY_LEN`]
/// printable ASCII bytes without spaces, no `..` or `//`. `invalid`.
pub fn check_key(key: &str) -> Result<(), Failure> {
    let prefixed = KV_PREFIXES
        .iter()
        .any(|p| key.len() > p.len() && key.starts_with(p));
    if !prefixed {
        return Err(Failure::invalid(format!(
            "key {key:?} must start with one of {} and name something after it",
            KV_PREFIXES.join(", ")
        )));
    }
    let ok = key.len() <= MAX_KEY_LEN
        && key.bytes().all(|b| b.is_ascii_graphic())
        && !key.contains("..")
        && !key.contains("//");
    if ok {
        Ok(())
    } else {
        Err(Failure::invalid(format!(
            "key {key:?}: at most {MAX_KEY_LEN} printable characters, no spaces, '..' or '//'"
        )))
    }
}

/// Checks a listing prefix: empty (everything), or a key prefix inside one of
/// [`KV_PREFIXES`]. `invalid`.
pub fn check_prefix(prefix: &str) -> Result<(), Failure> {
    let inside = prefix.is_empty() || KV_PREFIXES.iter().any(|p| prefix.starts_with(p));
    if inside && prefix.len() <= MAX_KEY_LEN && prefix.bytes().all(|b| b.is_ascii_graphic()) {
        return Ok(());
    }
    Err(Failure::invalid(format!(
        "prefix {prefix:?} must be empty or start with one of {}",
        KV_PREFIXES.join(", ")
    )))
}

/// Checks a write before it is proposed (and again when it applies): the key, and the
/// value's size. `invalid`.
pub fn check_put(key: &str, value: &[u8]) -> Result<(), Failure> {
    check_key(key)?;
    if value.len() > MAX_VALUE_LEN {
        return Err(Failure::invalid(format!(
            "value of {} bytes; at most {MAX_VALUE_LEN}",
            value.len()
        )));
    }
    Ok(())
}

/// Bytes of keys and values in the area.
pub fn area_bytes(kv: &std::collections::BTreeMap<String, KvValue>) -> usize {
    kv.iter().map(|(k, v)| k.len() + v.value.len()).sum()
}

/// `Fenced`: the lock `lock` must still be held with fence `fence` (nobody took it since,
/// and its holder did not free it). `conflict` otherwise.
pub(super) fn check_fence(st: &IamState, lock: &str, fence: u64) -> Result<(), Failure> {
    match st.locks.get(lock) {
        Some(h) if h.fence == fence => Ok(()),
        Some(h) => Err(Failure::conflict(format!(
            "lock {lock} has moved on to {} (fence {}, not {fence})",
            h.holder, h.fence
        ))),
        None => Err(Failure::conflict(format!(
            "lock {lock} is no longer held (fence {fence})"
        ))),
    }
}

/// Who holds `name` at `now_ms`, if anyone (an expired hold counts as free).
pub fn holder_at(st: &IamState, name: &str, now_ms: i64) -> Option<LockHold> {
    st.locks
        .get(name)
        .filter(|h| now_ms < h.expires_at_ms)
        .cloned()
}

fn held_by_other(name: &str, h: &LockHold, now_ms: i64) -> Failure {
    Failure::conflict(format!(
        "lock {name} is held by {} for {} ms more",
        h.holder,
        h.expires_at_ms - now_ms
    ))
}

/// Refuses a lock request that would fail, without changing anything: for the service to
/// answer before proposing (a refused request need not take a log entry).
pub fn check_lock(st: &IamState, name: &str, holder: &str, now_ms: i64) -> Result<(), Failure> {
    check_lock_name(name)?;
    check_holder(holder)?;
    match holder_at(st, name, now_ms) {
        Some(h) if h.holder != holder => Err(held_by_other(name, &h, now_ms)),
        _ => Ok(()),
    }
}

/// `Lock`: takes a free or expired lock (a new fence) or renews the holder's own; a renewal
/// never shortens the hold. `conflict` while another holds it, `invalid` for a bad name,
/// holder or TTL, `no_capacity` past [`MAX_LOCKS`].
pub(super) fn lock(
    st: &mut IamState,
    name: &str,
    holder: &str,
    ttl_ms: i64,
    now_ms: i64,
) -> Result<Outcome, Failure> {
    check_lock(st, name, holder, now_ms)?;
    if !(MIN_TTL_MS..=MAX_TTL_MS).contains(&ttl_ms) {
        return Err(Failure::invalid(format!(
            "lock TTL {ttl_ms} ms: from {MIN_TTL_MS} to {MAX_TTL_MS}"
        )));
    }
    let until = now_ms.saturating_add(ttl_ms);
    match st.locks.get_mut(name) {
        Some(h) if h.holder == holder && now_ms < h.expires_at_ms => {
            h.expires_at_ms = h.expires_at_ms.max(until);
            Ok(Outcome::Locked {
                fence: h.fence,
                expires_at_ms: h.expires_at_ms,
            })
        }
        _ => {
            if !st.locks.contains_key(name) && st.locks.len() >= MAX_LOCKS {
                // Holds that ran out make room (their fences are then no longer valid).
                st.locks.retain(|_, h| now_ms < h.expires_at_ms);
            }
            if !st.locks.contains_key(name) && st.locks.len() >= MAX_LOCKS {
                return Err(Failure::new(
                    Reason::NoCapacity,
                    format!("{MAX_LOCKS} locks are held already"),
                ));
            }
            st.revision += 1;
            st.locks.insert(
                name.to_string(),
                LockHold {
                    holder: holder.to_string(),
                    expires_at_ms: until,
                    fence: st.revision,
                },
            );
            Ok(Outcome::Locked {
                fence: st.revision,
                expires_at_ms: until,
            })
        }
    }
}

/// `Unlock`: frees a lock `holder` holds (expired or not). `not_found` when nobody holds it,
/// `conflict` when another does.
pub(super) fn unlock(st: &mut IamState, name: &str, holder: &str) -> Result<Outcome, Failure> {
    check_lock_name(name)?;
    check_holder(holder)?;
    match st.locks.get(name) {
        None => Err(Failure::not_found(format!("lock {name} is not held"))),
        Some(h) if h.holder != holder => Err(Failure::conflict(format!(
            "lock {name} is held by {}, not {holder}",
            h.holder
        ))),
        Some(_) => {
            st.locks.remove(name);
            Ok(Outcome::Done)
        }
    }
}

/// Checks `if_revision` against the key's current revision (`None` = absent).
fn compare(key: &str, current: Option<u64>, if_revision: Option<u64>) -> Result<(), Failure> {
    match (if_revision, current) {
        (None, _) => Ok(()),
        (Some(0), None) => Ok(()),
        (Some(0), Some(r)) => Err(Failure::conflict(format!(
            "key {key} exists (revision {r})"
        ))),
        (Some(want), Some(r)) if want == r => Ok(()),
        (Some(want), Some(r)) => Err(Failure::conflict(format!(
            "key {key} is at revision {r}, not {want}"
        ))),
        (Some(want), None) => Err(Failure::conflict(format!(
            "key {key} does not exist (expected revision {want})"
        ))),
    }
}

/// `KvPut`: writes `key` at the next revision. `conflict` when `if_revision` does not match,
/// `invalid` for a bad key or a value over [`MAX_VALUE_LEN`], `no_capacity` past
/// [`MAX_KEYS`].
pub(super) fn put(
    st: &mut IamState,
    key: &str,
    value: &[u8],
    if_revision: Option<u64>,
) -> Result<Outcome, Failure> {
    check_put(key, value)?;
    let current = st.kv.get(key);
    compare(key, current.map(|v| v.revision), if_revision)?;
    if current.is_none() && st.kv.len() >= MAX_KEYS {
        return Err(Failure::new(
            Reason::NoCapacity,
            format!("the key-value area holds {MAX_KEYS} keys already"),
        ));
    }
    let freed = current.map_or(0, |v| key.len() + v.value.len());
    if st.kv_bytes - freed + key.len() + value.len() > MAX_BYTES {
        return Err(Failure::new(
            Reason::NoCapacity,
            format!("the key-value area would exceed {MAX_BYTES} bytes"),
        ));
    }
    st.kv_bytes = st.kv_bytes - freed + key.len() + value.len();
    st.revision += 1;
    st.kv.insert(
        key.to_string(),
        KvValue {
            value: value.to_vec(),
            revision: st.revision,
        },
    );
    Ok(Outcome::Revision(st.revision))
}

/// `KvDelete`: removes `key`, taking the next revision. `not_found` when absent,
/// `conflict` when `if_revision` does not match.
pub(super) fn delete(
    st: &mut IamState,
    key: &str,
    if_revision: Option<u64>,
) -> Result<Outcome, Failure> {
    check_key(key)?;
    let current = match st.kv.get(key) {
        Some(v) => v.revision,
        None => return Err(Failure::not_found(format!("key {key} not found"))),
    };
    compare(key, Some(current), if_revision)?;
    if let Some(v) = st.kv.remove(key) {
        st.kv_bytes -= key.len() + v.value.len();
    }
    st.revision += 1;
    Ok(Outcome::Revision(st.revision))
}

/// Replaces the area with `restored` (a backup's), giving every key a new revision so that
/// a compare-and-set made against what was there before fails.
pub(super) fn restore(st: &mut IamState, restored: &std::collections::BTreeMap<String, KvValue>) {
    st.kv = restored
        .iter()
        .map(|(k, v)| {
            st.revision += 1;
            (
                k.clone(),
                KvValue {
                    value: v.value.clone(),
                    revision: st.revision,
                },
            )
        })
        .collect();
    st.kv_bytes = area_bytes(&st.kv);
}

#[cfg(test)]
mod tests {
    use super::super::command::Command;
    use super::super::testutil::*;
    use super::*;

    fn lock_cmd(name: &str, holder: &str, ttl_ms: i64, now_ms: i64) -> Command {
        Command::Lock {
            name: name.into(),
            holder: holder.into(),
            ttl_ms,
            now_ms,
        }
    }

    fn put_cmd(key: &str, value: &[u8], if_revision: Option<u64>) -> Command {
        Command::KvPut {
            key: key.into(),
            value: value.to_vec(),
            if_revision,
        }
    }

    const T: i64 = NOW * 1000;

    #[test]
    fn a_lock_is_held_until_it_expires_renewed_by_its_holder_and_fenced() {
        let mut st = booted();
        let Outcome::Locked {
            fence,
            expires_at_ms,
        } = ok(&mut st, lock_cmd("w", "watcher/1", 10_000, T))
        else {
            panic!("not locked")
        };
        assert_eq!(expires_at_ms, T + 10_000);
        let before = st.clone();
        let f = refused(
            &mut st,
            lock_cmd("w", "watcher/2", 10_000, T + 9_999),
            Reason::Conflict,
        );
        assert!(
            f.message.contains("held by watcher/1 for 1 ms more"),
            "{}",
            f.message
        );
        assert_eq!(st, before);
        // A renewal keeps the fence and never shortens the hold (a proposer whose clock is
        // behind cannot give the lock away early).
        assert_eq!(
            ok(&mut st, lock_cmd("w", "watcher/1", 10_000, T + 5_000)),
            Outcome::Locked {
                fence,
                expires_at_ms: T + 15_000
            }
        );
        assert_eq!(
            ok(&mut st, lock_cmd("w", "watcher/1", 10_000, T + 1_000)),
            Outcome::Locked {
                fence,
                expires_at_ms: T + 15_000
            }
        );
        // Expired: the next taker gets a greater fence; the old holder is refused.
        let Outcome::Locked { fence: f2, .. } =
            ok(&mut st, lock_cmd("w", "watcher/2", 10_000, T + 15_000))
        else {
            panic!("not locked")
        };
        assert!(f2 > fence);
        refused(
            &mut st,
            lock_cmd("w", "watcher/1", 10_000, T + 16_000),
            Reason::Conflict,
        );
        // Only the holder unlocks; then anyone takes it at once.
        refused(
            &mut st,
            Command::Unlock {
                name: "w".into(),
                holder: "watcher/1".into(),
            },
            Reason::Conflict,
        );
        ok(
            &mut st,
            Command::Unlock {
                name: "w".into(),
                holder: "watcher/2".into(),
            },
        );
        refused(
            &mut st,
            Command::Unlock {
                name: "w".into(),
                holder: "watcher/2".into(),
            },
            Reason::NotFound,
        );
        let Outcome::Locked { fence: f3, .. } =
            ok(&mut st, lock_cmd("w", "watcher/1", 10_000, T + 16_000))
        else {
            panic!("not locked")
        };
        assert!(f3 > f2);
        // Bad input changes nothing.
        let before = st.clone();
        refused(
            &mut st,
            lock_cmd("W", "watcher/1", 10_000, T),
            Reason::Invalid,
        );
        refused(&mut st, lock_cmd("w", "", 10_000, T), Reason::Invalid);
        refused(&mut st, lock_cmd("w", "a b", 10_000, T), Reason::Invalid);
        refused(
            &mut st,
            lock_cmd("w", "watcher/1", 999, T + 16_000),
            Reason::Invalid,
        );
        refused(
            &mut st,
            lock_cmd("w", "watcher/1", MAX_TTL_MS + 1, T + 16_000),
            Reason::Invalid,
        );
        assert_eq!(st, before);
    }

    #[test]
    fn key_value_writes_take_growing_revisions_and_compare_and_set_holds() {
        let mut st = booted();
        let Outcome::Revision(r1) = ok(&mut st, put_cmd("nodes/a", b"one", Some(0))) else {
            panic!("no revision")
        };
        refused(
            &mut st,
            put_cmd("nodes/a", b"again", Some(0)),
            Reason::Conflict,
        );
        let Outcome::Revision(r2) = ok(&mut st, put_cmd("releases/r1", b"x", None)) else {
            panic!("no revision")
        };
        assert!(r2 > r1);
        // A stale revision loses; the current one wins.
        let before = st.clone();
        refused(
            &mut st,
            put_cmd("nodes/a", b"two", Some(r2)),
            Reason::Conflict,
        );
        assert_eq!(st, before);
        let Outcome::Revision(r3) = ok(&mut st, put_cmd("nodes/a", b"two", Some(r1))) else {
            panic!("no revision")
        };
        assert_eq!(
            st.kv["nodes/a"],
            KvValue {
                value: b"two".to_vec(),
                revision: r3
            }
        );
        refused(
            &mut st,
            Command::KvDelete {
                key: "nodes/a".into(),
                if_revision: Some(r1),
            },
            Reason::Conflict,
        );
        let Outcome::Revision(r4) = ok(
            &mut st,
            Command::KvDelete {
                key: "nodes/a".into(),
                if_revision: Some(r3),
            },
        ) else {
            panic!("no revision")
        };
        assert!(r4 > r3);
        assert!(!st.kv.contains_key("nodes/a"));
        refused(
            &mut st,
            Command::KvDelete {
                key: "nodes/a".into(),
                if_revision: None,
            },
            Reason::NotFound,
        );
        // Locks take revisions from the same counter.
        let Outcome::Locked { fence, .. } = ok(&mut st, lock_cmd("w", "watcher/1", 10_000, T))
        else {
            panic!("not locked")
        };
        assert_eq!(fence, r4 + 1);
        // Bad keys and values change nothing.
        let before = st.clone();
        for key in [
            "",
            "nodes/",
            "other/a",
            "nodes/a b",
            "nodes/../x",
            "nodes//x",
        ] {
            refused(&mut st, put_cmd(key, b"v", None), Reason::Invalid);
        }
        refused(
            &mut st,
            put_cmd(&format!("nodes/{}", "k".repeat(MAX_KEY_LEN)), b"v", None),
            Reason::Invalid,
        );
        refused(
            &mut st,
            put_cmd("nodes/big", &vec![0; MAX_VALUE_LEN + 1], None),
            Reason::Invalid,
        );
        assert_eq!(st, before);
        // The area survives the state's JSON (snapshots) byte for byte.
        ok(&mut st, put_cmd("rollouts/x", &[0, 255, 10], None));
        let json = serde_json::to_vec(&st).unwrap();
        let back: IamState = serde_json::from_slice(&json).unwrap();
        assert_eq!(back.kv, st.kv);
        assert_eq!(back.locks, st.locks);
        assert_eq!(back.revision, st.revision);
    }

    #[test]
    fn a_fenced_command_applies_only_under_the_current_hold_and_spent_locks_make_room() {
        let mut st = booted();
        let sweep = |fence| Command::Fenced {
            lock: RECONCILE_LOCK.into(),
            fence,
            cmd: Box::new(Command::SweepUnbound {
                max_age_s: 0,
                now: NOW,
            }),
        };
        refused(&mut st, sweep(1), Reason::Conflict);
        let Outcome::Locked { fence, .. } =
            ok(&mut st, lock_cmd(RECONCILE_LOCK, "watcher/a", 10_000, T))
        else {
            panic!("not locked")
        };
        assert_eq!(ok(&mut st, sweep(fence)), Outcome::Released(0));
        // Renewed: the same fence still works. Taken over: it no longer does.
        ok(
            &mut st,
            lock_cmd(RECONCILE_LOCK, "watcher/a", 10_000, T + 5_000),
        );
        ok(&mut st, sweep(fence));
        ok(
            &mut st,
            lock_cmd(RECONCILE_LOCK, "watcher/b", 10_000, T + 20_000),
        );
        let before = st.clone();
        refused(&mut st, sweep(fence), Reason::Conflict);
        assert_eq!(st, before);
        // Locks past MAX_LOCKS: refused while all are held, room made once some ran out.
        for i in 1..MAX_LOCKS {
            ok(&mut st, lock_cmd(&format!("l{i}"), "x", 1_000, T));
        }
        refused(
            &mut st,
            lock_cmd("one-more", "x", 1_000, T + 500),
            Reason::NoCapacity,
        );
        ok(&mut st, lock_cmd("one-more", "x", 1_000, T + 1_000));
        assert_eq!(st.locks.len(), 2);
        // The area's size is capped in bytes too.
        let big = vec![7u8; MAX_VALUE_LEN];
        let fit = MAX_BYTES / (MAX_VALUE_LEN + 16);
        for i in 0..fit {
            ok(&mut st, put_cmd(&format!("nodes/{i:08}"), &big, None));
        }
        let f = refused(
            &mut st,
            put_cmd("nodes/over", &big, None),
            Reason::NoCapacity,
        );
        assert!(f.message.contains("bytes"), "{f}");
        // Replacing a value frees its old bytes first; deleting frees them.
        ok(&mut st, put_cmd("nodes/00000000", &big, None));
        ok(
            &mut st,
            Command::KvDelete {
                key: "nodes/00000000".into(),
                if_revision: None,
            },
        );
        ok(&mut st, put_cmd("nodes/over", &big, None));
        let mut copy = st.clone();
        copy.rebuild_index();
        assert_eq!(copy.kv_bytes, st.kv_bytes);
    }

    #[test]
    fn prefixes_are_checked_for_listing() {
        assert!(check_prefix("").is_ok());
        assert!(check_prefix("nodes/").is_ok());
        assert!(check_prefix("releases/2026").is_ok());
        assert_eq!(check_prefix("node").unwrap_err().reason, Reason::Invalid);
        assert_eq!(check_prefix("x/").unwrap_err().reason, Reason::Invalid);
    }
}
