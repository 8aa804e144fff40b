//! A cluster of role processes with mutual TLS, set up as docs/tls.md tells an operator:
//! `ctl pki init` on the config, `tls.dir` in it, each role started on its own. The CLI
//! reaches it with `-ca`, a sandbox lives and ends, and each role exports when its
//! certificates expire.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::path::Path;
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

mod common;
use common::{free_port, BIN};

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn role(dir: &Path, cfg: &Path, args: &[&str], log: &str) -> Kill {
    Kill(
        Command::new(BIN)
            .args(args)
            .arg("-config")
            .arg(cfg)
            .stderr(std::fs::File::create(dir.join(log)).unwrap())
            .spawn()
            .unwrap(),
    )
}

#[test]
fn role_processes_talk_mtls_from_pki_init() {
    let tmp = tempfile::tempdir().unwrap();
    let pki = tmp.path().join("pki");
    let [iam, watcher, api, edge, metrics] = [(); 5].map(|()| free_port());
    let admin = "dsk.admin.0123456789abcdef0123456789abcdef";
    let cfg = serde_json::json!({
        "tls": {"dir": pki},
        "iam": {"addr": format!("127.0.0.1:{iam}"), "admin_token": admin},
        "watcher": {"addr": format!("127.0.0.1:{watcher}"), "probe_interval": 0.25},
        "apiserver": [{"addr": format!("127.0.0.1:{api}"), "snapshot_refresh": 0.25}],
        "edges": [{"id": "n1", "addr": format!("127.0.0.1:{edge}"),
                   "capacity": {"cpu_cores": 8, "memory_mb": 8192, "disk_mb": 65536},
                   "mem_reserve_mb": -1, "disk_reserve_mb": -1,
                   "backends": {"sim": {"runtime": "sim"}}}]
    });
    let cfg_path = tmp.path().join("opendsec.json");
    std::fs::write(&cfg_path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    common::pki_init(&cfg_path, &pki);

    let _iam = role(tmp.path(), &cfg_path, &["iam"], "iam.log");
    let _w = role(tmp.path(), &cfg_path, &["watcher"], "watcher.log");
    let _e = role(tmp.path(), &cfg_path, &["edge", "-id", "n1"], "edge.log");
    let metrics_addr = format!("127.0.0.1:{metrics}");
    let _a = role(
        tmp.path(),
        &cfg_path,
        &["apiserver", "-index", "0", "-metrics", &metrics_addr],
        "api.log",
    );
    let ca = pki.join("ca.crt");
    let ctl = |args: &[&str], with_ca: bool| -> Output {
        let mut c = Command::new(BIN);
        c.arg("ctl")
            .args(args)
            .env("OPENDSEC_ADDR", format!("127.0.0.1:{api}"))
            .env("OPENDSEC_TOKEN", admin)
            .env_remove("OPENDSEC_CA")
            .env_remove("OPENDSEC_PROJECT");
        if with_ca {
            c.env("OPENDSEC_CA", &ca);
        }
        c.output().unwrap()
    };
    let logs = || {
        ["iam.log", "watcher.log", "edge.log", "api.log"]
            .iter()
            .map(|l| {
                format!(
                    "--- {l}\n{}",
                    std::fs::read_to_string(tmp.path().join(l)).unwrap_or_default()
                )
            })
            .collect::<String>()
    };
    // Ready once the apiserver sees the edge through the watcher (mTLS both hops).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let o = ctl(&["status"], true);
        if o.status.success() && String::from_utf8_lossy(&o.stdout).contains("\"healthy\": true") {
            break;
        }
        assert!(Instant::now() < deadline, "never ready:\n{}", logs());
        std::thread::sleep(Duration::from_millis(200));
    }
    let o = ctl(&["whoami"], true);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("\"principal\": \"admin\""));
    // A sandbox's life: admitted by IAM, placed from the watcher's snapshot, run by the edge.
    let o = ctl(&["sandbox", "create", "-backend", "sim"], true);
    assert!(
        o.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&o.stderr),
        logs()
    );
    let sb: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let id = sb["id"].as_str().unwrap().to_string();
    assert!(id.starts_with("n1."), "{sb}");
    let o = ctl(&["sandbox", "stop", &id], true);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // Plaintext gets nothing from the public port.
    let o = ctl(&["whoami"], false);
    assert_eq!(o.status.code(), Some(1));
    // When the certificates expire, for the alert 30 days ahead.
    let (code, body) = common::http_get(metrics, "/metrics").unwrap();
    assert_eq!(code, 200);
    for who in ["opendsec://apiserver/0", "ca"] {
        let line = body
            .lines()
            .find(|l| {
                l.starts_with("opendsec_tls_cert_expiry_timestamp_seconds")
                    && l.contains(&format!("identity=\"{who}\""))
            })
            .unwrap_or_else(|| panic!("no expiry of {who} in:\n{body}"));
        let at: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs_f64();
        assert!(at > now + 300.0 * 86400.0, "{line}");
    }
}
