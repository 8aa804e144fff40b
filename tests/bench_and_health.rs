//! `ctl bench -compare` runs both placement modes end to end, and `cluster up -metrics`
//! serves /metrics, /healthz and /readyz.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_opendsec");

#[test]
fn bench_compares_random_with_power_of_two() {
    let out = Command::new(BIN)
        .args([
            "ctl",
            "bench",
            "-compare",
            "-edges",
            "3",
            "-count",
            "300",
            "-concurrency",
            "8",
            "-batch",
            "600",
            "-json",
        ])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let medians = v["medians"].as_array().unwrap();
    let modes: Vec<&str> = medians
        .iter()
        .map(|m| m["placement"].as_str().unwrap())
        .collect();
    assert_eq!(modes, vec!["random", "power-of-2"]);
    for m in medians {
        assert_eq!(m["single_failed"], 0);
        assert_eq!(m["batch_failed"], 0);
        assert_eq!(m["batch_count"], 600);
        assert!(m["single_per_s"].as_f64().unwrap() > 0.0);
        assert!(m["max_over_mean"].as_f64().unwrap() >= 1.0);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn get(port: u16, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).unwrap();
    let code = body
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (code, body)
}

#[test]
fn cluster_up_serves_health_and_metrics_and_writes_its_config() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let cfg = dir.path().join("cluster.json");
    let mut child = Command::new(BIN)
        .args([
            "cluster",
            "up",
            "-sim-edges",
            "2",
            "-addr",
            "127.0.0.1:0",
            "-log",
            "warn",
            "-disk-reserve-mb",
            "-1",
        ])
        .arg("-state-dir")
        .arg(dir.path())
        .arg("-metrics")
        .arg(format!("127.0.0.1:{port}"))
        .arg("-write-config")
        .arg(&cfg)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut env = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(60);
    while env.len() < 3 && Instant::now() < deadline {
        match lines.next() {
            Some(Ok(l)) => env.push(l),
            _ => break,
        }
    }
    let result = std::panic::catch_unwind(|| {
        assert!(
            env[0].starts_with("export OPENDSEC_ADDR=127.0.0.1:"),
            "{env:?}"
        );
        assert!(
            env[1].starts_with("export OPENDSEC_TOKEN=dsk.admin."),
            "{env:?}"
        );
        assert_eq!(env[2], "export OPENDSEC_PROJECT=root");
        let (code, _) = get(port, "/healthz");
        assert_eq!(code, 200);
        let (code, _) = get(port, "/readyz");
        assert_eq!(code, 200);
        let (code, body) = get(port, "/metrics");
        assert_eq!(code, 200);
        for name in [
            "opendsec_build_info",
            "opendsec_ready",
            "opendsec_watcher_edges_healthy",
            "opendsec_iam_leader",
            "opendsec_edge_sandboxes",
        ] {
            assert!(body.contains(name), "metric {name} missing");
        }
        let text = std::fs::read_to_string(&cfg).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["edges"].as_array().unwrap().len(), 2);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(
            std::fs::metadata(&cfg).unwrap().permissions().mode() & 0o777,
            0o600,
            "the config holds secrets"
        );
    });
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    let _ = child.wait();
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}
