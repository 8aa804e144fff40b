//! Three IAM replicas as separate processes (mutual TLS from `pki init`), with a watcher, an
//! edge and an apiserver, as docs/iam-replicas.md sets them up. While clients create and stop
//! sandboxes, the leader is killed with SIGKILL again and again (then followers): no call
//! fails, and afterwards every project made during the drill is there and the quota in use
//! is exactly zero. With two of three replicas down creation fails `unavailable`, and it
//! works again once one is back. Two watchers elect their reconciler with IAM's lock.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;
use common::{free_port, BIN};

const ADMIN: &str = "dsk.admin.0123456789abcdef0123456789abcdef";

struct Proc {
    args: Vec<String>,
    log: PathBuf,
    cfg: PathBuf,
    child: Option<Child>,
}

impl Proc {
    fn start(dir: &Path, cfg: &Path, args: &[&str], log: &str) -> Proc {
        let mut p = Proc {
            args: args.iter().map(|s| s.to_string()).collect(),
            log: dir.join(log),
            cfg: cfg.to_path_buf(),
            child: None,
        };
        p.spawn();
        p
    }

    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        self.child = Some(
            Command::new(BIN)
                .args(&self.args)
                .arg("-config")
                .arg(&self.cfg)
                .stderr(log)
                .spawn()
                .unwrap(),
        );
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill(); // SIGKILL
            let _ = c.wait();
        }
    }

    /// SIGTERM: a clean stop.
    fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            common::terminate(&mut c);
        }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

struct Cluster {
    dir: tempfile::TempDir,
    api: u16,
    ca: PathBuf,
    iams: Vec<Proc>,
    iam_metrics: Vec<u16>,
    watchers: Vec<Proc>,
    watcher_metrics: Vec<u16>,
    edge: Proc,
    _others: Vec<Proc>,
}

impl Cluster {
    fn start() -> Cluster {
        Cluster::start_with(3)
    }

    /// A cluster with `replicas` IAM replicas, or a standalone IAM with a state file for 0,
    /// and one watcher.
    fn start_with(replicas: usize) -> Cluster {
        Cluster::start_full(replicas, 1)
    }

    /// `start_with`, with `watchers` watchers: several are `watcher.replicas` `w0`, `w1`, …
    /// with a 3 s lock and quick reconciliation (an edge lost for 1 s is released).
    fn start_full(replicas: usize, watchers: usize) -> Cluster {
        let dir = tempfile::tempdir().unwrap();
        let pki = dir.path().join("pki");
        let [watcher, api, edge] = [(); 3].map(|()| free_port());
        let watcher_cfg = if watchers > 1 {
            let reps: Vec<serde_json::Value> = (0..watchers)
                .map(|i| serde_json::json!({"id": format!("w{i}"), "addr": format!("127.0.0.1:{}", free_port())}))
                .collect();
            serde_json::json!({"replicas": reps, "probe_interval": 0.25, "lock_ttl": 3,
                               "reconcile_interval": 0.5, "lost_edge_grace": 1,
                               "reconcile_min_age": 1})
        } else {
            serde_json::json!({"addr": format!("127.0.0.1:{watcher}"), "probe_interval": 0.25})
        };
        let n = replicas.max(1);
        let replicas: Vec<serde_json::Value> = (0..replicas)
            .map(|i| {
                serde_json::json!({
                    "id": i.to_string(),
                    "addr": format!("127.0.0.1:{}", free_port()),
                    "raft_addr": format!("127.0.0.1:{}", free_port()),
                    "data_dir": dir.path().join(format!("iam-{i}")),
                })
            })
            .collect();
        let cfg = serde_json::json!({
            "tls": {"dir": pki},
            "iam": if replicas.is_empty() {
                serde_json::json!({"addr": format!("127.0.0.1:{}", free_port()),
                                   "state": dir.path().join("iam.state"), "admin_token": ADMIN})
            } else {
                serde_json::json!({"replicas": replicas, "admin_token": ADMIN})
            },
            "watcher": watcher_cfg,
            "apiserver": [{"addr": format!("127.0.0.1:{api}"), "snapshot_refresh": 0.25}],
            "edges": [{"id": "n1", "addr": format!("127.0.0.1:{edge}"),
                       "capacity": {"cpu_cores": 64, "memory_mb": 65536, "disk_mb": 655360},
                       "mem_reserve_mb": -1, "disk_reserve_mb": -1,
                       "backends": {"sim": {"runtime": "sim"}}}]
        });
        let cfg_path = dir.path().join("opendsec.json");
        std::fs::write(&cfg_path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
        common::pki_init(&cfg_path, &pki);
        let iam_metrics: Vec<u16> = (0..n).map(|_| free_port()).collect();
        let iams = (0..n)
            .map(|i| {
                let m = format!("127.0.0.1:{}", iam_metrics[i]);
                let id = i.to_string();
                let mut args = vec!["iam", "-metrics", &m];
                if !replicas.is_empty() {
                    args.extend(["-replica", &id]);
                }
                Proc::start(dir.path(), &cfg_path, &args, &format!("iam-{i}.log"))
            })
            .collect();
        let watcher_metrics: Vec<u16> = (0..watchers).map(|_| free_port()).collect();
        let watchers: Vec<Proc> = (0..watchers)
            .map(|i| {
                let m = format!("127.0.0.1:{}", watcher_metrics[i]);
                let id = format!("w{i}");
                let mut args = vec!["watcher", "-metrics", &m];
                if watcher_metrics.len() > 1 {
                    args.extend(["-replica", &id]);
                }
                Proc::start(dir.path(), &cfg_path, &args, &format!("watcher-{i}.log"))
            })
            .collect();
        let edge = Proc::start(dir.path(), &cfg_path, &["edge", "-id", "n1"], "edge.log");
        let others = vec![Proc::start(
            dir.path(),
            &cfg_path,
            &["apiserver", "-index", "0"],
            "api.log",
        )];
        let c = Cluster {
            ca: pki.join("ca.crt"),
            dir,
            api,
            iams,
            iam_metrics,
            watchers,
            watcher_metrics,
            edge,
            _others: others,
        };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let o = c.ctl(&["status"]);
            if o.status.success()
                && String::from_utf8_lossy(&o.stdout).contains("\"healthy\": true")
            {
                break;
            }
            assert!(Instant::now() < deadline, "never ready:\n{}", c.logs());
            std::thread::sleep(Duration::from_millis(200));
        }
        c
    }

    fn ctl(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .arg("ctl")
            .args(args)
            .env("OPENDSEC_ADDR", format!("127.0.0.1:{}", self.api))
            .env("OPENDSEC_TOKEN", ADMIN)
            .env("OPENDSEC_CA", &self.ca)
            .env_remove("OPENDSEC_PROJECT")
            .output()
            .unwrap()
    }

    fn logs(&self) -> String {
        let mut names: Vec<String> = std::fs::read_dir(self.dir.path())
            .unwrap()
            .filter_map(|e| e.ok()?.file_name().into_string().ok())
            .filter(|n| n.ends_with(".log"))
            .collect();
        names.sort();
        names
            .iter()
            .map(|l| {
                let text = std::fs::read_to_string(self.dir.path().join(l)).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(40).collect();
                format!(
                    "--- {l}\n{}\n",
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )
            })
            .collect()
    }

    /// The replica whose /metrics says it leads.
    fn leader(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            for (i, port) in self.iam_metrics.iter().enumerate() {
                if self.iams[i].child.is_none() {
                    continue;
                }
                if let Some((200, body)) = common::http_get(*port, "/metrics") {
                    if body.lines().any(|l| l == "opendsec_iam_leader 1") {
                        return i;
                    }
                }
            }
            assert!(Instant::now() < deadline, "no leader:\n{}", self.logs());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The one watcher whose /metrics says it holds the reconciliation lock, once exactly
    /// one running watcher says so and no other does.
    fn lock_holder(&self) -> usize {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let holders: Vec<usize> = self
                .watcher_metrics
                .iter()
                .enumerate()
                .filter(|(i, _)| self.watchers[*i].child.is_some())
                .filter(|(_, port)| {
                    common::http_get(**port, "/metrics").is_some_and(|(code, body)| {
                        code == 200 && body.lines().any(|l| l == "opendsec_watcher_leader 1")
                    })
                })
                .map(|(i, _)| i)
                .collect();
            if let [one] = holders[..] {
                return one;
            }
            assert!(
                Instant::now() < deadline,
                "holders {holders:?}:\n{}",
                self.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `ctl sandbox create` of a sim sandbox in `project`, which must succeed.
    fn create_sandbox(&self, project: &str) {
        let o = self.ctl(&["sandbox", "create", "-backend", "sim", "-project", project]);
        assert!(o.status.success(), "{}\n{}", text(&o), self.logs());
    }

    fn root_usage(&self) -> f64 {
        let o = self.ctl(&["project", "get", "root"]);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let p: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        p["usage"]["sandboxes"].as_f64().unwrap_or(0.0)
    }
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// Two watchers over three IAM replicas: both probe, only the holder of IAM's lock
/// reconciles. SIGKILL of the holder hands the lock to the other (it runs out after its
/// TTL), a restarted watcher does not take it back, the new holder releases the quota of a
/// lost edge, and a clean stop frees the lock for the other at once.
#[test]
fn the_reconciliation_lock_moves_to_another_watcher_when_its_holder_dies() {
    let mut c = Cluster::start_full(3, 2);
    let first = c.lock_holder();
    let second = 1 - first;
    for port in &c.watcher_metrics {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !common::http_get(*port, "/metrics")
            .is_some_and(|(_, b)| b.lines().any(|l| l == "opendsec_watcher_edges_healthy 1"))
        {
            assert!(
                Instant::now() < deadline,
                "a watcher does not probe:\n{}",
                c.logs()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    c.create_sandbox("root");
    c.create_sandbox("root");
    assert_eq!(c.root_usage(), 2.0);

    c.watchers[first].kill();
    assert_eq!(c.lock_holder(), second, "{}", c.logs());
    c.watchers[first].spawn();
    std::thread::sleep(Duration::from_secs(4));
    assert_eq!(
        c.lock_holder(),
        second,
        "the restarted watcher took the lock back"
    );
    let body = common::http_get(c.watcher_metrics[first], "/metrics").map(|(_, b)| b);
    assert!(
        body.is_some_and(|b| b.lines().any(|l| l == "opendsec_watcher_leader 0")),
        "{}",
        c.logs()
    );

    // The edge is lost: after lost_edge_grace the holder releases its sandboxes' quota.
    c.edge.kill();
    let deadline = Instant::now() + Duration::from_secs(60);
    while c.root_usage() != 0.0 {
        assert!(
            Instant::now() < deadline,
            "quota never released:\n{}",
            c.logs()
        );
        std::thread::sleep(Duration::from_millis(250));
    }
    assert!(c.watchers[second].log_text().contains("leases reconciled"));
    assert!(
        !c.watchers[first].log_text().contains("leases reconciled"),
        "a watcher without the lock reconciled"
    );

    // A clean stop frees the lock, and the other takes it.
    c.watchers[second].stop();
    assert!(c.watchers[second]
        .log_text()
        .contains("freed the reconciliation lock"));
    assert_eq!(c.lock_holder(), first);
}

#[test]
fn sigkill_of_leaders_and_followers_under_load_fails_no_call() {
    let mut c = Cluster::start();
    let stop = Arc::new(AtomicBool::new(false));
    let failures = Arc::new(Mutex::new(Vec::<String>::new()));
    let projects = Arc::new(Mutex::new(Vec::<String>::new()));
    let done = Arc::new(Mutex::new(0usize));
    let env = (format!("127.0.0.1:{}", c.api), c.ca.clone());
    let mut workers = Vec::new();
    for w in 0..2 {
        let (stop, failures, projects, done, env) = (
            stop.clone(),
            failures.clone(),
            projects.clone(),
            done.clone(),
            env.clone(),
        );
        workers.push(std::thread::spawn(move || {
            let ctl = |args: &[&str]| {
                Command::new(BIN)
                    .arg("ctl")
                    .args(args)
                    .env("OPENDSEC_ADDR", &env.0)
                    .env("OPENDSEC_TOKEN", ADMIN)
                    .env("OPENDSEC_CA", &env.1)
                    .env_remove("OPENDSEC_PROJECT")
                    .output()
                    .unwrap()
            };
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let o = ctl(&["sandbox", "create", "-backend", "sim"]);
                if !o.status.success() {
                    failures
                        .lock()
                        .unwrap()
                        .push(format!("create: {}", text(&o)));
                    continue;
                }
                let sb: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
                let id = sb["id"].as_str().unwrap().to_string();
                let o = ctl(&["sandbox", "stop", &id]);
                if !o.status.success() {
                    failures
                        .lock()
                        .unwrap()
                        .push(format!("stop {id}: {}", text(&o)));
                }
                // A management change through the apiserver: committed or refused, never lost.
                // A creation is not sent twice behind the caller's back (its fate may be
                // unknown when a replica dies): the caller retries an `unavailable` one, and
                // a `conflict` then means the first try committed.
                if i % 3 == 0 {
                    let name = format!("w{w}-{i}");
                    let mut retried = false;
                    loop {
                        let o = ctl(&["project", "create", "root", &name]);
                        let out = text(&o);
                        if o.status.success() || (retried && out.contains("conflict")) {
                            projects.lock().unwrap().push(name);
                            break;
                        }
                        if !out.contains("unavailable") || retried {
                            failures.lock().unwrap().push(format!("project: {out}"));
                            break;
                        }
                        retried = true;
                    }
                }
                *done.lock().unwrap() += 1;
            }
        }));
    }
    // Three leaders killed, then two followers, each brought back after a second.
    let mut kills = Vec::new();
    for round in 0..5 {
        std::thread::sleep(Duration::from_secs(3));
        let leader = c.leader();
        let victim = if round < 3 { leader } else { (leader + 1) % 3 };
        c.iams[victim].kill();
        kills.push((victim, victim == leader));
        std::thread::sleep(Duration::from_secs(1));
        c.iams[victim].spawn();
    }
    std::thread::sleep(Duration::from_secs(3));
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    let failures = failures.lock().unwrap().clone();
    assert!(
        failures.is_empty(),
        "{} failed calls, first: {}\n{}",
        failures.len(),
        failures[0],
        c.logs()
    );
    let done = *done.lock().unwrap();
    assert!(done >= 10, "only {done} create/stop rounds");
    // Every acknowledged project is there, from whichever replica answers.
    for p in projects.lock().unwrap().iter() {
        let o = c.ctl(&["project", "get", &format!("root/{p}")]);
        assert!(o.status.success(), "project {p} lost: {}", text(&o));
    }
    // Every sandbox was stopped: once the edge has released the leases, none is counted.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let used = c.root_usage();
        if used == 0.0 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{used} sandboxes still counted after every one was stopped\n{}",
            c.logs()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("{done} rounds, kills {kills:?}");

    // Two of three down: creation fails with `unavailable`...
    let leader = c.leader();
    for i in 0..3 {
        if i != leader {
            c.iams[i].kill();
        }
    }
    let o = c.ctl(&["sandbox", "create", "-backend", "sim"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("unavailable"), "{}", text(&o));
    // ...and works again within 60 s of one coming back.
    let back = (leader + 1) % 3;
    c.iams[back].spawn();
    let t0 = Instant::now();
    loop {
        let o = c.ctl(&["sandbox", "create", "-backend", "sim"]);
        if o.status.success() {
            break;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "no creation within 60 s: {}\n{}",
            text(&o),
            c.logs()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    eprintln!(
        "creation worked again {:?} after a replica came back",
        t0.elapsed()
    );
}

/// The move from one IAM with a state file to three replicas (docs/iam-replicas.md): back
/// up the old IAM, start the replicated cluster (it bootstraps with the same admin token),
/// restore. What the backup held is then served by every replica, leader killed or not.
#[test]
fn a_standalone_iam_moves_to_three_replicas_by_backup_and_restore() {
    let keep = tempfile::tempdir().unwrap();
    let backup = keep.path().join("iam.json.gz");
    {
        let old = Cluster::start_with(0);
        let o = old.ctl(&["project", "create", "root", "team", "-quota", "sandboxes=7"]);
        assert!(o.status.success(), "{}", text(&o));
        let o = old.ctl(&["iam", "backup", "-out", backup.to_str().unwrap()]);
        assert!(o.status.success(), "{}", text(&o));
    }
    let mut new = Cluster::start();
    let o = new.ctl(&["project", "get", "root/team"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let o = new.ctl(&["iam", "restore", backup.to_str().unwrap()]);
    assert!(o.status.success(), "{}\n{}", text(&o), new.logs());
    let quota = |c: &Cluster| {
        let o = c.ctl(&["project", "get", "root/team"]);
        assert!(o.status.success(), "{}\n{}", text(&o), c.logs());
        let p: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        p["quota"]["sandboxes"].as_f64()
    };
    assert_eq!(quota(&new), Some(7.0));
    // `iam members`: the three replicas with their addresses, one of them leading.
    let o = new.ctl(&["iam", "members"]);
    assert!(o.status.success(), "{}", text(&o));
    let m: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let members = m["members"].as_array().unwrap();
    assert_eq!(members.len(), 3, "{m}");
    let leader = new.leader();
    for (i, x) in members.iter().enumerate() {
        assert_eq!(x["id"], i.to_string(), "{m}");
        assert_eq!(x["voter"], true, "{m}");
        assert!(
            x["raft_addr"].as_str().unwrap().starts_with("127.0.0.1:"),
            "{m}"
        );
        assert_eq!(x["leader"].as_bool().unwrap_or(false), i == leader, "{m}");
    }
    // Committed on a majority: the restored state outlives its leader.
    new.iams[leader].kill();
    assert_eq!(quota(&new), Some(7.0));
    new.create_sandbox("root/team");
}

/// A replica's command line must match the config: the errors say what to change.
#[test]
fn replica_flags_are_checked_against_the_config() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, iam: serde_json::Value| {
        let p = dir.path().join(name);
        let cfg = serde_json::json!({"service_token": "s", "iam": iam});
        std::fs::write(&p, cfg.to_string()).unwrap();
        p
    };
    let standalone = write(
        "one.json",
        serde_json::json!({"addr": "127.0.0.1:0", "admin_token": ADMIN}),
    );
    let replicated = write(
        "three.json",
        serde_json::json!({"admin_token": ADMIN, "replicas": [
            {"id": "0", "addr": "127.0.0.1:1", "raft_addr": "127.0.0.1:2",
             "data_dir": dir.path().join("d0")}]}),
    );
    let run = |cfg: &Path, args: &[&str]| {
        let o = Command::new(BIN)
            .arg("iam")
            .arg("-config")
            .arg(cfg)
            .args(args)
            .output()
            .unwrap();
        (
            o.status.code(),
            String::from_utf8_lossy(&o.stderr).to_string(),
        )
    };
    for (cfg, args, want) in [
        (
            &standalone,
            &["-replica", "0"][..],
            "the config has no iam.replicas",
        ),
        (&replicated, &[][..], "choose one with -replica ID"),
        (
            &replicated,
            &["-replica", "7"][..],
            "no replica with that id",
        ),
        (&replicated, &["-join"][..], "choose one with -replica ID"),
        (&standalone, &["-join"][..], "give -replica ID too"),
    ] {
        let (code, err) = run(cfg, args);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
    // Nothing was created for the refused replica.
    assert!(!dir.path().join("d0").exists());
    // The watcher's -replica, against watcher.replicas.
    let watchers = dir.path().join("watchers.json");
    let cfg = serde_json::json!({"service_token": "s",
        "iam": {"addr": "127.0.0.1:0", "admin_token": ADMIN},
        "watcher": {"replicas": [{"id": "w0", "addr": "127.0.0.1:1"}]}});
    std::fs::write(&watchers, cfg.to_string()).unwrap();
    for (cfg, args, want) in [
        (
            &standalone,
            &["-replica", "w0"][..],
            "the config has no watcher.replicas",
        ),
        (&watchers, &[][..], "choose one with -replica ID"),
        (
            &watchers,
            &["-replica", "w9"][..],
            "not an id of watcher.replicas",
        ),
    ] {
        let o = Command::new(BIN)
            .arg("watcher")
            .arg("-config")
            .arg(cfg)
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains(want), "{args:?}: {err}");
    }
}

/// Replacing a lost replica as docs/iam-replicas.md describes: replica 2's machine is gone,
/// so it is removed; a new replica 3 at new addresses starts with `-join` (not ready: it
/// waits to be added), is added, is caught up from the leader's snapshot, and counts for
/// the majority. Bad membership changes get clear errors and change nothing.
#[test]
fn a_lost_replica_is_replaced_by_one_that_joins_and_is_caught_up_by_snapshot() {
    let mut c = Cluster::start();
    let o = c.ctl(&["project", "create", "root", "team", "-quota", "sandboxes=5"]);
    assert!(o.status.success(), "{}", text(&o));
    c.iams[2].kill();
    let ids = |o: &Output| -> Vec<String> {
        assert!(o.status.success(), "{}", text(o));
        let m: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        m["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x["id"].as_str().unwrap().to_string())
            .collect()
    };
    let bad: [(&[&str], &str); 5] = [
        (&["remove", "7"], "not_found: replica 7 is not a member"),
        (&["remove", "x"], "invalid: replica id"),
        (
            &[
                "add",
                "1",
                "-raft-addr",
                "127.0.0.1:1",
                "-iam-addr",
                "127.0.0.1:2",
            ],
            "conflict: replica 1 is already a member",
        ),
        (
            &[
                "add",
                "3",
                "-raft-addr",
                "nohost",
                "-iam-addr",
                "127.0.0.1:2",
            ],
            "invalid: -raft-addr",
        ),
        (&["add", "3", "-iam-addr", "127.0.0.1:2"], "-raft-addr"),
    ];
    for (args, want) in bad {
        let mut a = vec!["iam", "member"];
        a.extend(args);
        let o = c.ctl(&a);
        assert_ne!(o.status.code(), Some(0), "{args:?}");
        assert!(text(&o).contains(want), "{args:?}: {}", text(&o));
    }
    assert_eq!(ids(&c.ctl(&["iam", "members"])), ["0", "1", "2"]);
    assert_eq!(ids(&c.ctl(&["iam", "member", "remove", "2"])), ["0", "1"]);

    // The new machine: the config names replica 3 where 2 was; its certificate from the CA.
    let cfg_path = c.dir.path().join("opendsec.json");
    let mut cfg: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    let (addr, raft_addr) = (
        format!("127.0.0.1:{}", free_port()),
        format!("127.0.0.1:{}", free_port()),
    );
    cfg["iam"]["replicas"][2] = serde_json::json!({
        "id": "3", "addr": addr, "raft_addr": raft_addr,
        "data_dir": c.dir.path().join("iam-3"),
    });
    let new_cfg = c.dir.path().join("opendsec-new.json");
    std::fs::write(&new_cfg, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    let pki = c.dir.path().join("pki");
    let o = Command::new(BIN)
        .args(["ctl", "pki", "issue", "-ca"])
        .arg(&pki)
        .args(["-role", "iam", "-id", "3", "-hosts", "127.0.0.1", "-out"])
        .arg(&pki)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let metrics = free_port();
    let m = format!("127.0.0.1:{metrics}");
    c.iams.push(Proc::start(
        c.dir.path(),
        &new_cfg,
        &["iam", "-metrics", &m, "-replica", "3", "-join"],
        "iam-3.log",
    ));
    c.iam_metrics.push(metrics);
    let ready = || common::http_get(metrics, "/readyz").map(|(code, _)| code);
    let t0 = Instant::now();
    while ready().is_none() {
        assert!(t0.elapsed() < Duration::from_secs(30), "{}", c.logs());
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(1500));
    assert_ne!(
        ready(),
        Some(200),
        "a joining replica is not ready before it is added"
    );

    let o = c.ctl(&[
        "iam",
        "member",
        "add",
        "3",
        "-raft-addr",
        &raft_addr,
        "-iam-addr",
        &addr,
    ]);
    assert_eq!(ids(&o), ["0", "1", "3"]);
    let m: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let three = &m["members"][2];
    assert_eq!(
        (three["addr"].as_str(), three["raft_addr"].as_str()),
        (Some(addr.as_str()), Some(raft_addr.as_str()))
    );
    // It joins as a learner and becomes a voter once it has caught up.
    let t0 = Instant::now();
    loop {
        let o = c.ctl(&["iam", "members"]);
        let m: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
        let voters: Vec<&str> = m["members"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|x| x["voter"] == true)
            .filter_map(|x| x["id"].as_str())
            .collect();
        if voters == ["0", "1", "3"] {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "{m}\n{}", c.logs());
        std::thread::sleep(Duration::from_millis(100));
    }
    let t0 = Instant::now();
    while ready() != Some(200) {
        assert!(t0.elapsed() < Duration::from_secs(30), "{}", c.logs());
        std::thread::sleep(Duration::from_millis(100));
    }
    let log = std::fs::read_to_string(c.dir.path().join("iam-3.log")).unwrap();
    assert!(log.contains("installed a leader's snapshot"), "{log}");

    // Replica 3 now counts: with 0 gone, only 1 and 3 make a majority.
    c.iams[0].kill();
    let o = c.ctl(&["project", "get", "root/team"]);
    assert!(o.status.success(), "{}\n{}", text(&o), c.logs());
    c.create_sandbox("root/team");
    let o = c.ctl(&["project", "get", "root/team"]);
    let p: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(p["usage"]["sandboxes"].as_f64(), Some(1.0), "{p}");

    // A removed replica that still runs is not ready.
    let o = c.ctl(&["iam", "member", "remove", "1"]);
    assert!(o.status.success(), "{}\n{}", text(&o), c.logs());
    let one = c.iam_metrics[1];
    let t0 = Instant::now();
    while common::http_get(one, "/readyz").map(|(code, _)| code) == Some(200) {
        assert!(t0.elapsed() < Duration::from_secs(10), "{}", c.logs());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(
        common::http_get(one, "/readyz").map(|(code, _)| code),
        Some(503),
        "it still runs, and says it is not ready"
    );
}
