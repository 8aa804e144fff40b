//! `ctl bench -compare` runs both placement modes end to end, and `cluster up -metrics`
//! serves /metrics, /healthz and /readyz.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::process::Command;

mod common;
use common::BIN;

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

fn get(port: u16, path: &str) -> (u16, String) {
    common::http_get(port, path).unwrap_or((0, String::new()))
}

#[test]
fn cluster_up_serves_health_and_metrics_and_writes_its_config() {
    let port = common::free_port();
    let up = common::cluster_up(&common::UpOptions {
        sim_edges: 2,
        extra: vec!["-metrics".into(), format!("127.0.0.1:{port}")],
        write_config: true,
        ..Default::default()
    });
    let cfg = up.config_path.clone();
    let env = [
        format!("export OPENDSEC_ADDR={}", up.addr),
        format!("export OPENDSEC_TOKEN={}", up.token),
        format!("export OPENDSEC_PROJECT={}", up.project),
    ];
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
    drop(up);
    if let Err(e) = result {
        std::panic::resume_unwind(e);
    }
}
