//! The agents' reaper, in a test process of its own (it reaps every child).

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::time::Duration;

use opendsec::guest::reaper::{Exit, Reaper};

#[tokio::test]
// The children are reaped by the Reaper, which is what this tests.
#[allow(clippy::zombie_processes)]
async fn statuses_reach_their_watchers() {
    let r = Reaper::start().expect("reaper");
    let c = std::process::Command::new("sh")
        .args(["-c", "exit 7"])
        .spawn()
        .expect("spawn");
    let rx = r.watch(c.id());
    assert_eq!(rx.await.ok(), Some(Exit::Code(7)));
    let c = std::process::Command::new("sh")
        .args(["-c", "kill -9 $$"])
        .spawn()
        .expect("spawn");
    // Let it end before anyone watches: the status waits for its watcher.
    tokio::time::sleep(Duration::from_millis(200)).await;
    r.reap_now();
    let rx = r.watch(c.id());
    assert_eq!(rx.await.ok().map(Exit::shell_code), Some(137));
}
