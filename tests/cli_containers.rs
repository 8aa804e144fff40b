//! The CLI against real container sandboxes (`cluster up -runtime linux`; root): what a user
//! sees when a command's `-timeout` expires.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;
use common::{root_or_skip, UpOptions};

#[test]
fn an_expired_timeout_prints_only_the_clis_message() {
    if !root_or_skip("an_expired_timeout_prints_only_the_clis_message") {
        return;
    }
    let c = common::cluster_up(&UpOptions {
        extra: vec!["-runtime".into(), "linux".into()],
        ..Default::default()
    });
    let created = c
        .ctl(&[
            "sandbox",
            "create",
            "-backend",
            "container",
            "-image",
            "host",
            "-mem",
            "256",
        ])
        .ok()
        .json();
    let id = created["id"].as_str().unwrap().to_string();
    for cmd in ["sleep 30", "sleep 30; echo never", "trap '' TERM; sleep 30"] {
        let r = c.ctl(&["exec", "-timeout", "1", &id, cmd]);
        assert_eq!(r.code, 124, "{cmd}: {}", r.err);
        assert_eq!(r.out, "", "{cmd}");
        assert_eq!(
            r.err, "opendsecctl: command timed out\n",
            "{cmd}: nothing but the CLI's own message (no shell job notice, no internal path)"
        );
    }
    let r = c.ctl(&["exec", &id, "echo still here"]).ok();
    assert_eq!(r.out, "still here\n");
    c.ctl(&["sandbox", "stop", &id]).ok();
}
