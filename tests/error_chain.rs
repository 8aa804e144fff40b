//! An error's causes are printed once: each cause is either an error's `source` or part of its
//! message, never both (docs/architecture.md "Rules of the codebase"). Walks the chains of
//! real errors and checks the binary's own output.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::error::Error;

mod common;

/// Fails when an error's message already holds the text of its source (the cause would be
/// printed twice by anything that prints the chain).
fn assert_each_cause_once(e: &(dyn Error + 'static)) {
    let mut cur: Option<&(dyn Error + 'static)> = Some(e);
    let mut depth = 0;
    while let Some(err) = cur {
        let text = err.to_string();
        if let Some(src) = err.source() {
            let s = src.to_string();
            assert!(
                !text.contains(&s),
                "{text:?} repeats its source {s:?} (full chain: {})",
                opendsec::types::chain(e)
            );
        }
        cur = err.source();
        depth += 1;
    }
    assert!(depth >= 2, "expected a chain, got {:?}", e.to_string());
}

#[test]
fn config_errors_keep_their_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.json");
    let e = opendsec::config::Config::load(&missing).unwrap_err();
    assert_each_cause_once(&e);
    let whole = opendsec::types::chain(&e);
    assert_eq!(
        whole.matches("No such file or directory").count(),
        1,
        "{whole}"
    );

    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, "{not json").unwrap();
    let e = opendsec::config::Config::load(&bad).unwrap_err();
    assert_each_cause_once(&e);
    assert!(
        opendsec::types::chain(&e).contains("key must be a string"),
        "{e}"
    );
}

#[test]
fn the_binary_prints_the_chain_once() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.json");
    let r = common::run(&["iam", "-config", missing.to_str().unwrap()], &[]);
    assert_eq!(r.code, 1, "{}", r.err);
    assert_eq!(
        r.err.matches("No such file or directory").count(),
        1,
        "the cause is printed once: {}",
        r.err
    );
    // And the file once ("loading F: reading config F: ..." before).
    assert_eq!(
        r.err.matches(missing.to_str().unwrap()).count(),
        1,
        "the file is named once: {}",
        r.err
    );
    let r = common::run(
        &["cluster", "up", "-config", missing.to_str().unwrap()],
        &[],
    );
    assert_eq!(r.code, 1, "{}", r.err);
    assert_eq!(
        r.err.matches("No such file or directory").count(),
        1,
        "{}",
        r.err
    );
}

#[test]
fn a_bad_command_line_exits_2_and_help_exits_0_in_single_dash_style() {
    for role in ["iam", "watcher", "apiserver", "edge"] {
        let r = common::run(&[role, "-nosuchflag"], &[]);
        assert_eq!(r.code, 2, "{role}: {}", r.err);
        let h = common::run(&[role, "-help"], &[]);
        assert_eq!(h.code, 0, "{role}: {}", h.err);
        assert!(
            h.out.contains("  -config ") && !h.out.contains("--"),
            "{role}:\n{}",
            h.out
        );
        assert!(
            h.out.contains("(default info)"),
            "{role} shows defaults:\n{}",
            h.out
        );
    }
    let h = common::run(&["cluster", "up", "-h"], &[]);
    assert_eq!(h.code, 0, "{}", h.err);
    assert!(!h.out.contains("--"), "{}", h.out);
    assert!(
        h.out.contains("(default 4)") && h.out.contains("(default 1)"),
        "{}",
        h.out
    );
    let r = common::run(&["cluster", "up", "-nosuchflag"], &[]);
    assert_eq!(r.code, 2, "{}", r.err);
    let h = common::run(&["ctl", "bench", "-help"], &[]);
    assert_eq!(h.code, 0, "{}", h.err);
    assert!(
        !h.out.contains(" --") && h.out.contains("(default 8)"),
        "{}",
        h.out
    );
}

/// Usage errors a fresh user met that used to be accepted or looked like something else: a
/// `-log` word that is no level (it logged nothing), `cluster` without a command (exit 0),
/// clusters of no edge or apiserver (one was started instead), `edge` without `-id` (exit 1)
/// and a flag value that does not parse (no `error:` prefix). Each exits 2 with an `error:`
/// line naming what was wrong.
#[test]
fn usage_errors_exit_2_and_name_what_was_wrong() {
    for (args, want) in [
        (&["iam", "-log", "verbose"][..], "-log \"verbose\""),
        (
            &["edge", "-log", "info,loud"][..],
            "\"loud\" is not a log level",
        ),
        (
            &["cluster", "up", "-log", "verbose"][..],
            "-log \"verbose\"",
        ),
        (&["cluster"][..], "missing cluster command"),
        (&["cluster", "up", "-sim-edges", "0"][..], "-sim-edges 0"),
        (&["cluster", "up", "-apiservers", "0"][..], "-apiservers 0"),
        (&["edge"][..], "-id is required"),
        (&["apiserver", "-index", "-1"][..], "index"),
        (&["iam", "-nosuchflag"][..], "nosuchflag"),
    ] {
        let r = common::run(args, &[]);
        assert!(
            r.code != 0 && r.err.starts_with("error: ") && r.err.contains(want),
            "{args:?}: exit {} {}",
            r.code,
            r.err
        );
    }
    for args in [
        &["iam", "-log", "verbose"][..],
        &["cluster"][..],
        &["edge"][..],
        &["apiserver", "-index", "-1"][..],
        // A flag of another role is refused, not ignored.
        &["iam", "-id", "node-0"][..],
        &["watcher", "-index", "1"][..],
        &["apiserver", "-advertise", "x:1"][..],
        &["edge", "-id", "node-0", "-drain-delay", "1s"][..],
        &["cluster", "up", "-sim-edges", "0"][..],
        &["cluster", "up", "-apiservers", "0"][..],
        // -tls makes certificates for a generated cluster only.
        &["cluster", "up", "-tls", "-config", "/nonexistent.json"][..],
    ] {
        assert_eq!(common::run(args, &[]).code, 2, "{args:?}");
    }
}

#[test]
fn each_role_lists_only_its_own_flags() {
    let common_flags = ["-config", "-metrics", "-log", "-grace"];
    for (role, own, others) in [
        (
            "iam",
            &["-replica", "-join"][..],
            &["-id", "-index", "-drain-delay", "-advertise"][..],
        ),
        (
            "watcher",
            &["-replica"][..],
            &["-id", "-index", "-drain-delay", "-join"][..],
        ),
        (
            "apiserver",
            &["-index", "-drain-delay"][..],
            &["-id", "-replica", "-advertise"][..],
        ),
        (
            "edge",
            &["-id", "-addr", "-advertise"][..],
            &["-index", "-replica", "-drain-delay"][..],
        ),
        (
            "e2b",
            &["-index", "-drain-delay", "-ca"][..],
            &["-id", "-replica", "-advertise"][..],
        ),
    ] {
        let r = common::run(&[role, "-help"], &[]);
        assert_eq!(r.code, 0, "{role}: {}", r.err);
        let flags: Vec<&str> = r
            .out
            .lines()
            .filter_map(|l| l.split_whitespace().next())
            .filter(|w| w.starts_with('-'))
            .collect();
        for f in common_flags.iter().chain(own) {
            assert!(flags.contains(f), "{role} -help lacks {f}: {}", r.out);
        }
        for f in others {
            assert!(!flags.contains(f), "{role} -help lists {f}: {}", r.out);
        }
    }
}

#[test]
fn a_log_written_to_a_file_has_no_colour_codes() {
    let c = common::cluster_up(&common::UpOptions {
        log: "info".into(),
        ..Default::default()
    });
    c.ctl(&["whoami"]).ok();
    drop(c.ctl(&["status"]));
    let log = c.log();
    assert!(log.contains("INFO"), "an info log was written: {log}");
    assert!(
        !log.contains('\u{1b}'),
        "ANSI escape codes in a log file:\n{log}"
    );
}
