//! TTL decisions (docs/concepts.md), as a pure function of a record, a call count and `now`.
//!
//! - idle timeout `ttl_running_stop`: a RUNNING sandbox with no runtime call in flight whose
//!   last activity is more than that many seconds old;
//! - lifetime `ttl_max`: counted from creation, paused time included;
//! - with `ttl_paused_s` > 0, either pauses instead of stopping, and the sandbox is stopped
//!   after `ttl_paused_s` more seconds paused;
//! - ended records are dropped `stopped_retention` seconds after they ended;
//! - a sandbox resumed after its lifetime has passed (a TTL pause, then a call that resumed
//!   it) has no lifetime from then on when it has an idle timeout, which governs it instead;
//!   without one the lifetime stays, and ends it again at once.
//!
//! Values ≤ 0 mean "none" (the apiserver fills in defaults before the edge sees a spec).
//! Times are whole Unix seconds, so "more than N seconds" is `now > start + N`.

use super::record::SandboxRecord;
use crate::pb::SandboxState;

/// The record's `message` when the idle timeout ends a sandbox.
pub const IDLE_MESSAGE: &str = "idle timeout (ttl_running_stop) reached";
/// The record's `message` when the lifetime ends a sandbox.
pub const LIFETIME_MESSAGE: &str = "lifetime (ttl_max) reached";

/// What the TTL loop does to one sandbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TtlAction {
    /// Pause it (`ttl_paused_s` > 0), with why.
    Pause(String),
    /// Stop it, with why.
    Stop(String),
    /// Forget the ended record.
    Drop,
}

/// Decides what is due for `rec` at `now`. `calls_in_flight` is the number of runtime calls
/// running in the sandbox; `retention` is `stopped_retention` in seconds.
pub fn decide(
    rec: &SandboxRecord,
    calls_in_flight: u32,
    now: i64,
    retention: i64,
) -> Option<TtlAction> {
    let sb = &rec.sandbox;
    let spec = sb.spec.clone().unwrap_or_default();
    let lifetime_end = (spec.ttl_max > 0).then(|| sb.created_at.saturating_add(spec.ttl_max));
    let paused_keep = spec.ttl_paused_s.max(0);
    match rec.state() {
        SandboxState::Running => {
            let why = if lifetime_end.is_some_and(|end| now > end) {
                LIFETIME_MESSAGE
            } else if spec.ttl_running_stop > 0
                && calls_in_flight == 0
                && now > sb.last_active_at.saturating_add(spec.ttl_running_stop)
            {
                IDLE_MESSAGE
            } else {
                return None;
            };
            Some(if paused_keep > 0 {
                TtlAction::Pause(why.to_string())
            } else {
                TtlAction::Stop(why.to_string())
            })
        }
        SandboxState::Paused => {
            // A TTL pause keeps it ttl_paused_s from then; a caller's pause keeps it until the
            // lifetime (plus ttl_paused_s). Idle time does not run while paused.
            let (from, why) = if rec.ttl_paused_at > 0 {
                (rec.ttl_paused_at, paused_reason(&sb.message))
            } else {
                (lifetime_end?, LIFETIME_MESSAGE.to_string())
            };
            if now > from.saturating_add(paused_keep) {
                let msg = if rec.ttl_paused_at > 0 {
                    format!("{why}; kept paused for ttl_paused_s ({paused_keep} s)")
                } else {
                    why
                };
                Some(TtlAction::Stop(msg))
            } else {
                None
            }
        }
        SandboxState::Stopped | SandboxState::Failed => {
            let end = if sb.ended_at > 0 {
                sb.ended_at
            } else {
                sb.created_at
            };
            (now > end.saturating_add(retention)).then_some(TtlAction::Drop)
        }
        _ => None,
    }
}

/// What a resume at `now` does to the TTLs of `spec` (a sandbox created at `created_at`):
/// a lifetime already spent is dropped when an idle timeout is left to end the sandbox
/// (docs/concepts.md "Timeouts"), since it would end it again at once. Returns whether it
/// dropped it.
pub fn on_resume(spec: &mut crate::pb::SandboxSpec, created_at: i64, now: i64) -> bool {
    let spent = spec.ttl_max > 0 && now > created_at.saturating_add(spec.ttl_max);
    if spent && spec.ttl_running_stop > 0 {
        spec.ttl_max = 0;
        return true;
    }
    false
}

/// The original reason of a TTL pause, from the message the pause left.
fn paused_reason(message: &str) -> String {
    let m = message.strip_prefix("paused: ").unwrap_or(message);
    if m.is_empty() {
        IDLE_MESSAGE.to_string()
    } else {
        m.to_string()
    }
}

/// The message a TTL pause leaves on the record.
pub fn pause_message(why: &str) -> String {
    format!("paused: {why}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb;

    fn rec(idle: i64, max: i64, paused: i64) -> SandboxRecord {
        let spec = pb::SandboxSpec {
            backend: "sim".into(),
            ttl_running_stop: idle,
            ttl_max: max,
            ttl_paused_s: paused,
            ..Default::default()
        };
        let mut r = SandboxRecord::creating("e.a", "e", "L", "root", "p", spec, 1000);
        r.set_state(SandboxState::Running);
        r
    }

    #[test]
    fn idle_timeout_needs_no_call_in_flight() {
        let mut r = rec(60, 0, 0);
        r.sandbox.last_active_at = 1100;
        assert_eq!(
            decide(&r, 0, 1160, 600),
            None,
            "exactly 60 s is not more than 60 s"
        );
        assert_eq!(
            decide(&r, 0, 1161, 600),
            Some(TtlAction::Stop(IDLE_MESSAGE.into()))
        );
        assert_eq!(
            decide(&r, 1, 5000, 600),
            None,
            "a call in flight keeps it from being idle"
        );
    }

    #[test]
    fn lifetime_counts_from_creation_even_with_calls() {
        let mut r = rec(0, 100, 0);
        r.sandbox.last_active_at = 1099;
        assert_eq!(decide(&r, 3, 1100, 600), None);
        assert_eq!(
            decide(&r, 3, 1101, 600),
            Some(TtlAction::Stop(LIFETIME_MESSAGE.into()))
        );
    }

    #[test]
    fn no_ttls_means_none() {
        let r = rec(0, 0, 0);
        assert_eq!(decide(&r, 0, i64::MAX / 2, 600), None);
        let r = rec(-1, -1, 0);
        assert_eq!(decide(&r, 0, i64::MAX / 2, 600), None);
    }

    #[test]
    fn ttl_paused_pauses_then_stops_later() {
        let mut r = rec(10, 0, 30);
        assert_eq!(
            decide(&r, 0, 1011, 600),
            Some(TtlAction::Pause(IDLE_MESSAGE.into()))
        );
        // The loop pauses it at 1011.
        r.set_state(SandboxState::Paused);
        r.ttl_paused_at = 1011;
        r.sandbox.message = pause_message(IDLE_MESSAGE);
        assert_eq!(decide(&r, 0, 1041, 600), None);
        match decide(&r, 0, 1042, 600) {
            Some(TtlAction::Stop(m)) => assert!(
                m.starts_with(IDLE_MESSAGE) && m.contains("ttl_paused_s"),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn paused_time_does_not_count_as_idle() {
        let mut r = rec(10, 0, 0);
        r.set_state(SandboxState::Paused);
        assert_eq!(
            decide(&r, 0, 1_000_000, 600),
            None,
            "a caller's pause without lifetime lasts"
        );
        // Resumed: idle restarts from the resume (the edge sets last_active_at then).
        r.set_state(SandboxState::Running);
        r.sandbox.last_active_at = 999_990;
        assert_eq!(decide(&r, 0, 1_000_000, 600), None);
        assert!(decide(&r, 0, 1_000_001, 600).is_some());
    }

    #[test]
    fn paused_sandboxes_end_at_their_lifetime() {
        let mut r = rec(0, 50, 0);
        r.set_state(SandboxState::Paused);
        assert_eq!(decide(&r, 0, 1050, 600), None);
        assert_eq!(
            decide(&r, 0, 1051, 600),
            Some(TtlAction::Stop(LIFETIME_MESSAGE.into()))
        );
        let mut r = rec(0, 50, 20);
        r.set_state(SandboxState::Paused);
        assert_eq!(
            decide(&r, 0, 1070, 600),
            None,
            "ttl_paused_s more after the lifetime"
        );
        assert!(matches!(decide(&r, 0, 1071, 600), Some(TtlAction::Stop(_))));
    }

    #[test]
    fn a_resume_after_the_lifetime_leaves_the_idle_timeout_in_charge() {
        // An E2B sandbox with autoPause: lifetime 100 s, the same idle timeout, kept paused.
        let mut r = rec(100, 100, 3600);
        assert_eq!(
            decide(&r, 0, 1101, 600),
            Some(TtlAction::Pause(LIFETIME_MESSAGE.into()))
        );
        r.set_state(SandboxState::Paused);
        r.ttl_paused_at = 1101;
        // A call resumes it at 1500: the spent lifetime goes, idle time restarts.
        let mut spec = r.sandbox.spec.clone().unwrap_or_default();
        assert!(on_resume(&mut spec, r.sandbox.created_at, 1500));
        assert_eq!((spec.ttl_max, spec.ttl_running_stop), (0, 100));
        r.sandbox.spec = Some(spec);
        r.set_state(SandboxState::Running);
        r.sandbox.last_active_at = 1500;
        assert_eq!(decide(&r, 0, 1501, 600), None, "not paused again at once");
        assert_eq!(
            decide(&r, 0, 1601, 600),
            Some(TtlAction::Pause(IDLE_MESSAGE.into()))
        );
        // Before its lifetime, or with no idle timeout to end it, a resume changes nothing.
        let mut spec = rec(100, 100, 3600).sandbox.spec.unwrap_or_default();
        assert!(!on_resume(&mut spec, 1000, 1050));
        assert_eq!(spec.ttl_max, 100);
        let mut spec = rec(-1, 100, 3600).sandbox.spec.unwrap_or_default();
        assert!(!on_resume(&mut spec, 1000, 1500));
        assert_eq!(spec.ttl_max, 100);
    }

    #[test]
    fn ended_records_are_dropped_after_retention() {
        let mut r = rec(0, 0, 0);
        r.end(SandboxState::Stopped, 2000, "stopped");
        assert_eq!(decide(&r, 0, 2600, 600), None);
        assert_eq!(decide(&r, 0, 2601, 600), Some(TtlAction::Drop));
        r.set_state(SandboxState::Creating);
        assert_eq!(
            decide(&r, 0, 1 << 40, 600),
            None,
            "transitional states are left alone"
        );
    }
}
