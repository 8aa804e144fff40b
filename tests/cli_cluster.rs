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

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_opendsec");

/// A `cluster up` child; stopped with SIGTERM (then SIGKILL) when dropped.
struct Cluster {
    child: Child,
    addr: String,
    token: String,
    project: String,
    _dir: tempfile::TempDir,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .arg("-TERM")
            .arg(self.child.id().to_string())
            .status();
        for _ in 0..100 {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn cluster_up() -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let log_path = dir.path().join("cluster.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = Command::new(BIN)
        .args([
            "cluster",
            "up",
            "-sim-edges",
            "1",
            "-addr",
            "127.0.0.1:0",
            "-disk-reserve-mb",
            "-1",
            "-log",
            "warn",
        ])
        .arg("-state-dir")
        .arg(&state)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let (mut addr, mut token, mut project) = (None, None, None);
    while addr.is_none() || token.is_none() || project.is_none() {
        // A generous bound so a broken cluster fails the test instead of hanging it.
        let line = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(l) => l,
            Err(e) => {
                let _ = child.kill();
                let status = child.wait();
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                panic!("cluster up printed no environment ({e}); exit: {status:?}; stderr:\n{log}");
            }
        };
        let Some((k, v)) = line
            .strip_prefix("export ")
            .and_then(|kv| kv.split_once('='))
        else {
            continue;
        };
        match k {
            "OPENDSEC_ADDR" => addr = Some(v.to_string()),
            "OPENDSEC_TOKEN" => token = Some(v.to_string()),
            "OPENDSEC_PROJECT" => project = Some(v.to_string()),
            _ => {}
        }
    }
    Cluster {
        child,
        addr: addr.unwrap(),
        token: token.unwrap(),
        project: project.unwrap(),
        _dir: dir,
    }
}

struct Run {
    code: i32,
    out: String,
    err: String,
}

impl Run {
    fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.out)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}\nstderr: {}", self.out, self.err))
    }
    fn ok(self) -> Run {
        assert_eq!(self.code, 0, "stdout: {}\nstderr: {}", self.out, self.err);
        self
    }
}

impl Cluster {
    /// `opendsec ctl <args>` as the administrator, with the printed environment.
    fn ctl(&self, args: &[&str]) -> Run {
        self.ctl_as(&self.token, args)
    }

    fn ctl_as(&self, token: &str, args: &[&str]) -> Run {
        let out = Command::new(BIN)
            .arg("ctl")
            .args(args)
            .env_remove("OPENDSEC_CA")
            .env("OPENDSEC_ADDR", &self.addr)
            .env("OPENDSEC_TOKEN", token)
            .env("OPENDSEC_PROJECT", &self.project)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        Run {
            code: out.status.code().unwrap_or(-1),
            out: String::from_utf8_lossy(&out.stdout).into_owned(),
            err: String::from_utf8_lossy(&out.stderr).into_owned(),
        }
    }
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

/// Retries `f` until it holds: for effects the spec gives "about 1 s" (token revocation).
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
