//! An apiserver as its own process, from the config `cluster up` writes: it serves, and on
//! SIGTERM fails /readyz while still serving for `-drain-delay`, then exits.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::process::{Child, Command};
use std::time::{Duration, Instant};

mod common;
use common::{free_port, UpOptions, BIN};

fn http_code(port: u16, path: &str) -> Option<u16> {
    common::http_get(port, path).map(|(code, _)| code)
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
    let up = common::cluster_up(&UpOptions {
        write_config: true,
        ..Default::default()
    });
    let token = up.token.clone();
    let dir = tempfile::tempdir().unwrap();
    let cfg_path = up.config_path.clone();
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
            "info",
            "-drain-delay",
            "2s",
            "-grace",
            "2s",
        ])
        .arg("-config")
        .arg(&cfg2)
        .arg("-metrics")
        .arg(format!("127.0.0.1:{metrics}"))
        .stderr(std::fs::File::create(dir.path().join("api.log")).unwrap())
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
        "still serving while draining: {}\napiserver log:\n{}\ncluster log:\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(dir.path().join("api.log")).unwrap_or_default(),
        std::fs::read_to_string(&up.log_path).unwrap_or_default()
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
