//! A SIGKILL at any point loses no acknowledged command: a child process (this test binary,
//! re-executed) commits admissions concurrently to a durable store, snapshotting often, and
//! prints each acknowledged lease; the parent kills it mid-stream and reopens the state.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command as Process, Stdio};

use opendsec::roles::iam::command::{AdmitItem, Command, NewToken, Outcome};
use opendsec::roles::iam::state::Actor;
use opendsec::roles::iam::tokens::hash_secret;
use opendsec::roles::iam::{Store, StoreOptions};
use opendsec::types::Res;

const CHILD_ENV: &str = "OPENDSEC_IAM_CRASH_CHILD";
const NOW: i64 = 1_790_000_000;

fn admin() -> Actor {
    Actor {
        principal: "admin".into(),
        token_id: "primary".into(),
        secret_hash: hash_secret("s"),
    }
}

fn admit(lease: String) -> Command {
    let item = AdmitItem {
        lease_id: lease.clone(),
        project: "root".into(),
        resources: Res {
            cpu_cores: 0.5,
            ..Default::default()
        },
        edge_id: "e1".into(),
        sandbox_id: format!("e1.{lease}"),
        keep_binding: false,
        spec_digest: String::new(),
    };
    Command::Admit {
        actor: admin(),
        image_project: String::new(),
        items: vec![item],
        now: NOW,
    }
}

/// The child: commits admissions from 4 tasks until killed, printing `ack <lease>` after each.
fn child(path: &Path) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let store = Store::open(Some(path), StoreOptions { snapshot_every: 40 }).unwrap();
        let boot = Command::Bootstrap {
            admin_id: "admin".into(),
            admin_token: Some(NewToken {
                id: "primary".into(),
                hash: hash_secret("s"),
            }),
            root_quota: Default::default(),
            max_token_ttl_s: 0,
            now: NOW,
        };
        store.propose(boot).await.unwrap();
        let mut tasks = Vec::new();
        for t in 0..4 {
            let store = store.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..100_000 {
                    let lease = format!("l{t}-{i}");
                    let out = store.propose(admit(lease.clone())).await.unwrap();
                    assert!(matches!(out, Outcome::Admitted { .. }));
                    let mut so = std::io::stdout().lock();
                    writeln!(so, "ack {lease}").unwrap();
                    so.flush().unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
}

#[test]
fn sigkill_loses_no_acknowledged_command() {
    if let Ok(path) = std::env::var(CHILD_ENV) {
        child(Path::new(&path));
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("iam.json");
    let mut proc = Process::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "sigkill_loses_no_acknowledged_command",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let out = proc.stdout.take().unwrap();
    let mut acked = Vec::new();
    for line in BufReader::new(out).lines() {
        let line = line.unwrap();
        if let Some(l) = line.strip_prefix("ack ") {
            acked.push(l.to_string());
            if acked.len() >= 400 {
                break;
            }
        }
    }
    proc.kill().unwrap(); // SIGKILL
    proc.wait().unwrap();
    assert!(
        acked.len() >= 400,
        "the child stopped early after {} acks",
        acked.len()
    );

    let store = Store::open(Some(&path), StoreOptions::default()).unwrap();
    let st = store.read().clone();
    for l in &acked {
        assert!(st.leases.contains_key(l), "acknowledged lease {l} lost");
    }
    // Usage agrees with the leases that survived.
    assert_eq!(
        st.projects["root"].usage.sandboxes as usize,
        st.leases.len()
    );
}
