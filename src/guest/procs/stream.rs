//! A caller's view of one process: `start_pid`, then its output from given offsets (what is
//! stored first, then live), `keepalive` while idle, then `end`. Dropping the stream only
//! stops the view; the process runs on.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::process::{Proc, Which};
use super::{ProcessEvents, EVENT_CHUNK};
use crate::pb;
use crate::pb::process_event::Kind;

struct Follower {
    proc: Arc<Proc>,
    changed: watch::Receiver<u64>,
    /// Next offset to send, per stream.
    pos: [u64; 2],
    /// Which stream to look at first, alternated so a busy stdout cannot starve stderr.
    first: usize,
    started: bool,
    done: bool,
    keepalive: Duration,
}

fn event(kind: Kind, offset: u64) -> pb::ProcessEvent {
    pb::ProcessEvent {
        kind: Some(kind),
        offset: offset as i64,
    }
}

/// The events of `proc` from byte offsets `pos` ([stdout or PTY, stderr]); offsets already
/// dropped from the rings resume at the oldest byte kept. Sends `keepalive` after each
/// `keepalive` of silence.
pub(super) fn follow(proc: Arc<Proc>, pos: [u64; 2], keepalive: Duration) -> ProcessEvents {
    let f = Follower {
        changed: proc.subscribe(),
        proc,
        pos,
        first: 0,
        started: false,
        done: false,
        keepalive,
    };
    Box::pin(futures::stream::unfold(f, |mut f| async move {
        let ev = f.next().await?;
        Some((ev, f))
    }))
}

impl Follower {
    async fn next(&mut self) -> Option<pb::ProcessEvent> {
        if self.done {
            return None;
        }
        if !self.started {
            self.started = true;
            return Some(event(Kind::StartPid(self.proc.pid), 0));
        }
        loop {
            // Mark the current version seen before looking, so a change made after the look
            // wakes `changed()` below.
            self.changed.borrow_and_update();
            if let Some(ev) = self.poll() {
                return Some(ev);
            }
            match tokio::time::timeout(self.keepalive, self.changed.changed()).await {
                Err(_idle) => return Some(event(Kind::Keepalive(true), 0)),
                Ok(Ok(())) => {}
                // The process's record is gone without an end: nothing more will come.
                Ok(Err(_)) => {
                    self.done = true;
                    return None;
                }
            }
        }
    }

    /// The next chunk of stored output, or the end once all output has been sent.
    fn poll(&mut self) -> Option<pb::ProcessEvent> {
        let st = self.proc.state();
        for k in 0..2 {
            let i = (self.first + k) % 2;
            let (Some(ring), Some(pos)) = (st.rings.get(i), self.pos.get_mut(i)) else {
                continue;
            };
            if let Some((off, data)) = ring.read(*pos, EVENT_CHUNK) {
                *pos = off + data.len() as u64;
                self.first = (i + 1) % 2;
                let kind = match (i, self.proc.pty) {
                    (i, true) if i == Which::Out as usize => Kind::Pty(data),
                    (i, _) if i == Which::Out as usize => Kind::Stdout(data),
                    _ => Kind::Stderr(data),
                };
                return Some(event(kind, off));
            }
        }
        let end = st.end.clone()?;
        self.done = true;
        Some(event(Kind::End(end), 0))
    }
}
