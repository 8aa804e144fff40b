//! A role whose stderr is a closed pipe (`opendsec edge ... 2>&1 | head`, a log shipper that
//! died) still stops on SIGTERM: a log line it cannot write is dropped, never a panic that
//! takes the signal handler with it.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::io::Read;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{free_port, BIN};

#[test]
fn a_role_with_a_closed_stderr_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = serde_json::json!({
        "service_token": "s",
        "iam": {"addr": format!("127.0.0.1:{}", free_port()),
                "admin_token": "dsk.admin.0123456789abcdef0123456789abcdef"},
        "watcher": {"addr": format!("127.0.0.1:{}", free_port())},
        "apiserver": [{"addr": format!("127.0.0.1:{}", free_port())}],
        "edges": [{"id": "e1", "addr": format!("127.0.0.1:{}", free_port()),
                   "capacity": {"cpu_cores": 8, "memory_mb": 8192, "disk_mb": 65536},
                   "mem_reserve_mb": -1, "disk_reserve_mb": -1,
                   "backends": {"sim": {"runtime": "sim"}}}]
    });
    let path = dir.path().join("c.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    // The hang this guards against struck about every other time: several rounds each.
    let roles = [
        &["edge", "-id", "e1"][..],
        &["apiserver", "-drain-delay", "0s"][..],
    ];
    for &role in roles.iter().cycle().take(8) {
        let mut child = Command::new(BIN)
            .args(role)
            .arg("-config")
            .arg(&path)
            .args(["-log", "debug"])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        // Read its first lines, then close the pipe: every later log line meets EPIPE.
        let mut err = child.stderr.take().unwrap();
        let mut first = [0u8; 64];
        err.read_exact(&mut first).unwrap();
        drop(err);
        std::thread::sleep(Duration::from_millis(500));
        let kill = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status()
            .unwrap();
        assert!(kill.success());
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = child.try_wait().unwrap() {
                assert!(st.code().is_some(), "{role:?} ended by a signal: {st}");
                break;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!("{role:?} did not stop on SIGTERM with its stderr closed");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
