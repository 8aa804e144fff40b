//! The CLI against a real in-process cluster: `opendsec cluster up -sim-edges 1` in a child
//! process, then `opendsec ctl ...` with the environment it prints: sandbox create, get,
//! list, stop, batches and tasks; projects, principals, grants, tokens and quotas; status,
//! usage and IAM backup.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::os::unix::fs::PermissionsExt;
use std::time::{Duration, Instant};

mod common;
use common::{Cluster, UpOptions};

fn cluster_up() -> Cluster {
    common::cluster_up(&UpOptions::default())
}

fn ids(list: &serde_json::Value) -> Vec<String> {
    list["sandboxes"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|s| s["id"].as_str().map(String::from))
                .collect()
        })
        .unwrap_or_default()
}

/// Retries `f` until it holds: for effects documented as "about 1 s" (token revocation).
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "never happened: {what}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn sandboxes_through_a_real_cluster() {
    let c = cluster_up();
    assert_eq!(c.project, "root");

    let sb = c
        .ctl(&[
            "sandbox", "create", "-backend", "sim", "-task", "job-1", "-cpu", "0.5", "-mem", "512",
        ])
        .ok()
        .json();
    let id = sb["id"].as_str().unwrap().to_string();
    assert_eq!(sb["state"], "RUNNING");
    assert_eq!(sb["project"], "root");
    assert_eq!(sb["spec"]["memory_limit_mb"], "512");
    assert_eq!(sb["spec"]["cpu_cores_limit"], 0.5);

    let got = c.ctl(&["sandbox", "get", &id]).ok().json();
    assert_eq!(got["id"], id.as_str());
    assert!(ids(&c.ctl(&["sandbox", "list"]).ok().json()).contains(&id));
    assert!(ids(&c.ctl(&["sandbox", "list", "-task", "job-1"]).ok().json()).contains(&id));
    assert!(!ids(&c.ctl(&["sandbox", "list", "-task", "job-none"]).ok().json()).contains(&id));
    assert_eq!(
        c.ctl(&["sandbox", "pause", &id]).ok().json()["state"],
        "PAUSED"
    );
    assert_eq!(
        c.ctl(&["sandbox", "resume", &id]).ok().json()["state"],
        "RUNNING"
    );

    // A batch: one line per sandbox in index order, then the summary.
    let r = c
        .ctl(&["sandbox", "create", "-count", "3", "-task", "job-2"])
        .ok();
    let lines: Vec<&str> = r.out.lines().collect();
    assert_eq!(lines.len(), 4, "{}", r.out);
    for (i, l) in lines[..3].iter().enumerate() {
        let (idx, sid) = l.split_once('\t').unwrap();
        assert_eq!(idx, i.to_string());
        assert!(!sid.starts_with("error"), "{l}");
    }
    assert!(
        lines[3].starts_with("created 3/3 in ") && lines[3].ends_with("; failures: map[]"),
        "{}",
        lines[3]
    );
    let t = c.ctl(&["task", "stop", "job-2"]).ok().json();
    assert_eq!(
        (t["affected"].as_str(), t["failed"].as_str()),
        (Some("3"), Some("0")),
        "{t}"
    );

    let st = c.ctl(&["sandbox", "stop", &id]).ok().json();
    assert_eq!(st["state"], "STOPPED");
    assert!(!ids(&c.ctl(&["sandbox", "list"]).ok().json()).contains(&id));

    let r = c.ctl(&["sandbox", "get", "edge-nope.abc"]);
    assert_eq!(r.code, 1);
    assert!(r.err.starts_with("error: not_found: "), "{}", r.err);

    let s = c.ctl(&["status"]).ok().json();
    assert_eq!(s["edges"].as_array().map(Vec::len), Some(1), "{s}");
}

#[test]
fn projects_principals_grants_and_tokens() {
    let c = cluster_up();
    assert_eq!(c.ctl(&["whoami"]).ok().json()["principal"], "admin");

    let p = c
        .ctl(&[
            "project",
            "create",
            "root",
            "team-a",
            "-quota",
            "sandboxes=2,cpu_cores=8",
        ])
        .ok()
        .json();
    assert_eq!(p["path"], "root/team-a");
    assert_eq!(p["quota"]["sandboxes"], 2.0);
    let created = c
        .ctl(&[
            "principal",
            "create",
            "root/team-a",
            "trainer",
            "-kind",
            "agent",
        ])
        .ok()
        .json();
    let trainer = created["token"].as_str().unwrap().to_string();
    assert!(trainer.starts_with("dsk.trainer."), "{created}");

    // No permissions yet.
    let r = c.ctl_as(&trainer, &["sandbox", "create", "-project", "root/team-a"]);
    assert!(r.err.starts_with("error: forbidden: "), "{}", r.err);
    let g = c
        .ctl(&[
            "grant",
            "root/team-a",
            "trainer",
            "sandbox.create,sandbox.operate",
        ])
        .ok()
        .json();
    let perms = g["policies"]["trainer"]["permissions"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(perms.len(), 2, "{g}");
    assert_eq!(
        c.ctl_as(&trainer, &["whoami"]).ok().json()["principal"],
        "trainer"
    );

    // Permissions hold on the project, not on root; the quota holds on the project.
    c.ctl_as(&trainer, &["sandbox", "create", "-project", "root/team-a"])
        .ok();
    let r = c.ctl_as(&trainer, &["sandbox", "create", "-project", "root"]);
    assert!(r.err.starts_with("error: forbidden: "), "{}", r.err);
    let r = c.ctl_as(
        &trainer,
        &[
            "sandbox",
            "create",
            "-project",
            "root/team-a",
            "-count",
            "2",
        ],
    );
    assert_eq!(r.code, 1, "{}", r.out);
    assert!(r.out.contains("\terror\tquota_exceeded: "), "{}", r.out);
    assert!(
        r.out.contains("created 1/2 in ") && r.out.contains("failures: map[quota_exceeded:1]"),
        "{}",
        r.out
    );
    let got = c.ctl(&["project", "get", "root/team-a"]).ok().json();
    assert_eq!(got["usage"]["sandboxes"], 2.0, "{got}");

    // A second token, listed, then revoked: it stops working.
    let t2 = c
        .ctl(&[
            "token",
            "create",
            "trainer",
            "-desc",
            "gpu-node-07",
            "-ttl",
            "3600",
        ])
        .ok()
        .json();
    let t2_secret = t2["token"].as_str().unwrap().to_string();
    let t2_id = t2["info"]["id"].as_str().unwrap().to_string();
    let list = c.ctl(&["token", "list", "trainer"]).ok().json();
    let listed: Vec<&str> = list["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|t| t["id"].as_str())
        .collect();
    assert!(listed.contains(&t2_id.as_str()), "{list}");
    assert!(
        !c.ctl(&["token", "list", "trainer"])
            .out
            .contains(&t2_secret),
        "token list shows a secret"
    );
    assert_eq!(
        c.ctl_as(&t2_secret, &["whoami"]).ok().json()["principal"],
        "trainer"
    );
    c.ctl(&["token", "revoke", "trainer", &t2_id]).ok();
    eventually("a revoked token is refused", || {
        c.ctl_as(&t2_secret, &["whoami"])
            .err
            .starts_with("error: unauthenticated: ")
    });

    // Revoking every permission takes creation away again.
    c.ctl(&["revoke", "root/team-a", "trainer"]).ok();
    eventually("a revoked permission is refused", || {
        c.ctl_as(&trainer, &["sandbox", "list", "-project", "root/team-a"])
            .err
            .starts_with("error: forbidden: ")
    });

    let r = c.ctl(&["usage", "root", "-csv"]).ok();
    assert!(r.out.starts_with("day,project,sandboxes_started,sandbox_hours,cpu_core_hours,memory_gb_hours,gpu_hours\n"), "{}", r.out);

    let dir = tempfile::tempdir().unwrap();
    let backup = dir.path().join("iam.json.gz");
    c.ctl(&["iam", "backup", "-out", backup.to_str().unwrap()])
        .ok();
    let data = std::fs::read(&backup).unwrap();
    assert!(data.starts_with(&[0x1f, 0x8b]), "not gzip");
    assert_eq!(
        std::fs::metadata(&backup).unwrap().permissions().mode() & 0o777,
        0o600
    );

    let r = c.ctl(&["project", "delete", "root/team-a"]);
    assert_eq!(
        r.code, 1,
        "a project with principals and usage is not empty"
    );
    assert!(r.err.starts_with("error: "), "{}", r.err);
}

/// `cluster up | head -1` must not stop the cluster: printing its environment block to a
/// closed pipe once panicked the process (a broken pipe), taking IAM, the watcher and the
/// edges down with it while a reader that had what it needed went on using them.
#[test]
fn cluster_up_keeps_running_when_its_stdout_is_closed() {
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("cluster.json");
    let o = UpOptions {
        write_config: true,
        ..Default::default()
    };
    let mut child = common::up_command(&o, &dir.path().join("state"), &config)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // The reader is gone before the first line is written.
    drop(child.stdout.take());
    struct Stop(std::process::Child);
    impl Drop for Stop {
        fn drop(&mut self) {
            common::terminate(&mut self.0);
        }
    }
    let mut child = Stop(child);
    eventually("the config file is written", || config.exists());
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&config).unwrap()).unwrap();
    let addr = cfg["apiserver"][0]["addr"].as_str().unwrap().to_string();
    let token = cfg["iam"]["admin_token"].as_str().unwrap().to_string();
    // The block is printed after the config is written; give it time to fail.
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        child.0.try_wait().unwrap().is_none(),
        "cluster up exited once its stdout was closed"
    );
    common::run(
        &["ctl", "whoami"],
        &[("OPENDSEC_ADDR", &addr), ("OPENDSEC_TOKEN", &token)],
    )
    .ok();
}
