//! An apiserver as its own process, from the config `cluster up` writes: it serves, and on
//! SIGTERM fails /readyz while still serving for `-drain-delay`, then exits.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_opendsec");

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn http_code(port: u16, path: &str) -> Option<u16> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.split_whitespace().nth(1).and_then(|c| c.parse().ok())
}

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn apiserver_process_serves_then_drains_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = dir.path().join("cluster.json");
    let mut up = Command::new(BIN)
        .args([
            "cluster",
            "up",
            "-sim-edges",
            "1",
            "-addr",
            "127.0.0.1:0",
            "-log",
            "warn",
            "-disk-reserve-mb",
            "-1",
        ])
        .arg("-state-dir")
        .arg(dir.path())
        .arg("-write-config")
        .arg(&cfg_path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(up.stdout.take().unwrap()).lines();
    let mut token = String::new();
    for _ in 0..3 {
        let l = lines.next().unwrap().unwrap();
        if let Some(t) = l.strip_prefix("export OPENDSEC_TOKEN=") {
            token = t.to_string();
        }
    }
    let _up = Kill(up);
    // A second apiserver on its own port, as its own process, from the same config.
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let api_port = free_port();
    cfg["apiserver"][0]["addr"] = serde_json::json!(format!("127.0.0.1:{api_port}"));
    let cfg2 = dir.path().join("api.json");
    std::fs::write(&cfg2, serde_json::to_string(&cfg).unwrap()).unwrap();
    let metrics = free_port();
    let api = Command::new(BIN)
        .args([
            "apiserver",
            "-index",
            "0",
            "-log",
            "warn",
            "-drain-delay",
            "2s",
            "-grace",
            "2s",
        ])
        .arg("-config")
        .arg(&cfg2)
        .arg("-metrics")
        .arg(format!("127.0.0.1:{metrics}"))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = api.id();
    let mut api = Kill(api);
    let deadline = Instant::now() + Duration::from_secs(30);
    while http_code(metrics, "/readyz") != Some(200) {
        assert!(Instant::now() < deadline, "apiserver never became ready");
        std::thread::sleep(Duration::from_millis(100));
    }
    let ctl = |args: &[&str]| {
        Command::new(BIN)
            .arg("ctl")
            .args(args)
            .env("OPENDSEC_ADDR", format!("127.0.0.1:{api_port}"))
            .env("OPENDSEC_TOKEN", &token)
            .output()
            .unwrap()
    };
    let out = ctl(&["sandbox", "create", "-backend", "sim"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(pid.to_string())
        .status();
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        http_code(metrics, "/readyz"),
        Some(503),
        "/readyz must fail while draining"
    );
    let out = ctl(&["whoami"]);
    assert!(
        out.status.success(),
        "still serving while draining: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(st) = api.0.try_wait().unwrap() {
            assert!(st.success(), "exit status {st:?}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "apiserver did not exit after drain and grace"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}
