//! The failed-authentication limit (docs/concepts.md, docs/configuration.md `admission.auth_fail_rate`):
//! once one client address fails more than `auth_fail_rate` authentications per second, new
//! tokens from it are not checked for [`LOCKOUT`]; they get `rate_limited` (the same answer
//! whether the token is right or wrong, so a locked-out guesser learns nothing). Tokens that
//! authenticated from that address within [`REMEMBER`] keep working.
//!
//! Failures are counted in a token bucket per address (capacity and refill = the rate), so a
//! burst of `rate` failures passes and the next one within the second locks the address out.

use std::collections::hash_map::RandomState;
use std::collections::HashMap;
use std::hash::BuildHasher;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::types::{Failure, Reason};

/// How long a locked-out address's new tokens are refused.
pub const LOCKOUT: Duration = Duration::from_secs(30);
/// How long a token that authenticated from an address stays trusted there.
pub const REMEMBER: Duration = Duration::from_secs(3600);
/// Most tokens remembered per address.
const MAX_GOOD: usize = 256;
/// Addresses tracked before stale ones are dropped.
const MAX_ADDRS: usize = 65536;

struct Entry {
    tokens: f64,
    last: Instant,
    locked_until: Option<Instant>,
    /// Token fingerprint -> last success.
    good: HashMap<u64, Instant>,
}

/// Per-address failed-authentication limiter. `rate` `None` disables it.
pub struct AuthLimiter {
    rate: Option<f64>,
    hasher: RandomState,
    addrs: Mutex<HashMap<String, Entry>>,
}

impl AuthLimiter {
    /// `rate`: failures per second allowed per address (`cfg.admission.auth_fail_rate()`).
    pub fn new(rate: Option<f64>) -> AuthLimiter {
        AuthLimiter {
            rate: rate.filter(|r| *r > 0.0),
            hasher: RandomState::new(),
            addrs: Mutex::new(HashMap::new()),
        }
    }

    fn fingerprint(&self, token: &str) -> u64 {
        self.hasher.hash_one(token)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Entry>> {
        self.addrs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Before checking `token` from `addr`: `rate_limited` while the address is locked out
    /// and the token did not authenticate from it recently.
    pub fn check(&self, addr: &str, token: &str, now: Instant) -> Result<(), Failure> {
        if self.rate.is_none() {
            return Ok(());
        }
        let map = self.lock();
        let Some(e) = map.get(addr) else {
            return Ok(());
        };
        match e.locked_until {
            Some(until) if now < until => {
                let fp = self.fingerprint(token);
                if e.good
                    .get(&fp)
                    .is_some_and(|t| now.duration_since(*t) < REMEMBER)
                {
                    Ok(())
                } else {
                    Err(Failure::new(
                        Reason::RateLimited,
                        "too many failed authentications from this address; try again later",
                    ))
                }
            }
            _ => Ok(()),
        }
    }

    /// Records a failed authentication from `addr`; may lock the address out.
    pub fn failed(&self, addr: &str, now: Instant) {
        let Some(rate) = self.rate else { return };
        let mut map = self.lock();
        if map.len() >= MAX_ADDRS && !map.contains_key(addr) {
            prune(&mut map, now);
        }
        let e = map.entry(addr.to_string()).or_insert_with(|| Entry {
            tokens: rate,
            last: now,
            locked_until: None,
            good: HashMap::new(),
        });
        e.tokens =
            (e.tokens + now.saturating_duration_since(e.last).as_secs_f64() * rate).min(rate);
        e.last = now;
        if e.tokens >= 1.0 {
            e.tokens -= 1.0;
        } else if e.locked_until.is_none_or(|u| u <= now) {
            tracing::warn!(
                client_addr = addr,
                "failed authentications over the limit; locking out new tokens"
            );
            e.locked_until = Some(now + LOCKOUT);
        }
    }

    /// Records that `token` authenticated from `addr`.
    pub fn succeeded(&self, addr: &str, token: &str, now: Instant) {
        if self.rate.is_none() {
            return;
        }
        let fp = self.fingerprint(token);
        let mut map = self.lock();
        // Remembered even before any failure, so a later lockout still lets this token in.
        let Some(e) = map.get_mut(addr) else {
            if map.len() >= MAX_ADDRS {
                prune(&mut map, now);
            }
            let mut good = HashMap::new();
            good.insert(fp, now);
            map.insert(
                addr.to_string(),
                Entry {
                    tokens: self.rate.unwrap_or(1.0),
                    last: now,
                    locked_until: None,
                    good,
                },
            );
            return;
        };
        if e.good.len() >= MAX_GOOD && !e.good.contains_key(&fp) {
            if let Some(oldest) = e.good.iter().min_by_key(|(_, t)| **t).map(|(k, _)| *k) {
                e.good.remove(&oldest);
            }
        }
        e.good.insert(fp, now);
    }
}

/// Drops addresses with no lockout and nothing remembered recently; if still full, forgets
/// the unlocked ones.
fn prune(map: &mut HashMap<String, Entry>, now: Instant) {
    map.retain(|_, e| {
        e.locked_until.is_some_and(|u| u > now)
            || e.good.values().any(|t| now.duration_since(*t) < REMEMBER)
    });
    if map.len() >= MAX_ADDRS {
        map.retain(|_, e| e.locked_until.is_some_and(|u| u > now));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn more_than_rate_failures_per_second_lock_out_new_tokens() {
        let l = AuthLimiter::new(Some(5.0));
        let t0 = Instant::now();
        l.succeeded("10.0.0.1", "dsk.good.t.s", t0);
        for _ in 0..5 {
            l.failed("10.0.0.1", t0);
            l.check("10.0.0.1", "dsk.guess.t.x", t0).unwrap();
        }
        l.failed("10.0.0.1", t0);
        let e = l.check("10.0.0.1", "dsk.guess.t.y", t0).unwrap_err();
        assert_eq!(e.reason, Reason::RateLimited);
        // A token that authenticated from there keeps working; other addresses are not affected.
        l.check("10.0.0.1", "dsk.good.t.s", t0).unwrap();
        l.check("10.0.0.2", "dsk.guess.t.y", t0).unwrap();
        // The lockout ends.
        l.check(
            "10.0.0.1",
            "dsk.guess.t.y",
            t0 + LOCKOUT + Duration::from_millis(1),
        )
        .unwrap();
    }

    #[test]
    fn failures_spread_over_time_stay_under_the_limit() {
        let l = AuthLimiter::new(Some(5.0));
        let t0 = Instant::now();
        for i in 0..100u64 {
            let t = t0 + Duration::from_millis(250 * i);
            l.failed("a", t);
            l.check("a", "dsk.x.t.y", t).unwrap();
        }
    }

    #[test]
    fn disabled_limit_never_locks_out() {
        let l = AuthLimiter::new(None);
        let t0 = Instant::now();
        for _ in 0..1000 {
            l.failed("a", t0);
        }
        l.check("a", "dsk.x.t.y", t0).unwrap();
    }
}
