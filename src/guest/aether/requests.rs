//! The request ids of the commands aether forwarded, per session and chronus, so that a
//! retry of a command whose chronus died is refused instead of run again by the session's
//! next chronus (which never saw the id). chronus itself keeps a command's request id only
//! for as long as it lives (docs/sessions.md "A session whose chronus ends").

use std::collections::{HashMap, VecDeque};

use crate::types::Failure;

/// How many request ids are kept; the oldest go first. A retry comes within the SDK's
/// retry window (seconds), long before this many other commands have been sent.
const KEPT: usize = 4096;

/// Request id → the session and the pid of the chronus it was forwarded to.
#[derive(Default)]
pub struct Requests {
    by_id: HashMap<String, (String, i32)>,
    order: VecDeque<String>,
}

impl Requests {
    /// Notes that `request_id` of session `session` goes to chronus `pid`, unless it was
    /// sent to an earlier chronus of that session: then it is `not_found` (the command's
    /// record died with that chronus) and nothing is noted. Empty ids are not kept.
    pub fn forward(&mut self, session: &str, request_id: &str, pid: i32) -> Result<(), Failure> {
        if request_id.is_empty() {
            return Ok(());
        }
        match self.by_id.get(request_id) {
            Some((s, p)) if s == session && *p != pid => Err(lost(session)),
            Some(_) => Ok(()),
            None => {
                if self.order.len() >= KEPT {
                    if let Some(old) = self.order.pop_front() {
                        self.by_id.remove(&old);
                    }
                }
                self.by_id
                    .insert(request_id.to_string(), (session.to_string(), pid));
                self.order.push_back(request_id.to_string());
                Ok(())
            }
        }
    }
}

/// The failure of a command whose session's chronus ended while it ran: `not_found`, so the
/// SDK does not retry it (a retry would run it in a fresh session).
pub fn lost(session: &str) -> Failure {
    Failure::not_found(format!(
        "the command was lost: session {session:?} ended while it ran (something in the \
         sandbox killed the session's agent); its next command starts the session afresh"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::Reason;

    #[test]
    fn a_retry_to_a_later_chronus_is_lost_and_others_pass() {
        let mut r = Requests::default();
        assert!(r.forward("default", "req-1", 10).is_ok());
        // The same chronus again (the SDK's retry after a lost connection): chronus itself
        // answers it from its own record.
        assert!(r.forward("default", "req-1", 10).is_ok());
        let e = r.forward("default", "req-1", 11).unwrap_err();
        assert_eq!(e.reason, Reason::NotFound);
        assert!(e.message.contains("session \"default\" ended"), "{e:?}");
        assert!(r.forward("default", "req-2", 11).is_ok());
        assert!(r.forward("other", "req-3", 12).is_ok());
        assert!(r.forward("default", "", 13).is_ok());
    }

    #[test]
    fn only_the_newest_ids_are_kept() {
        let mut r = Requests::default();
        for i in 0..KEPT + 1 {
            assert!(r.forward("s", &format!("id-{i}"), 1).is_ok());
        }
        assert_eq!(r.by_id.len(), KEPT);
        // The oldest is forgotten: a late retry of it is forwarded as new.
        assert!(r.forward("s", "id-0", 2).is_ok());
        assert!(r.forward("s", &format!("id-{KEPT}"), 2).is_err());
    }
}
