//! `opendsec e2b` as its own process (docs/e2b.md "For administrators"): it serves E2B's
//! control plane for a cluster started apart from it, answers `/readyz`, and on SIGTERM
//! fails `/readyz` at once while it keeps serving for `-drain-delay`, then exits 0.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// One HTTP/1.1 request to 127.0.0.1:port: the status and the body.
fn call(port: u16, method: &str, path: &str, key: &str, body: &str) -> (u16, String) {
    call_from("127.0.0.1", port, method, path, &[("X-API-KEY", key)], body)
}

/// One HTTP/1.1 request to 127.0.0.1:port from the loopback address `from` (any of
/// 127.0.0.0/8), with `headers`: the status and the body.
fn call_from(
    from: &str,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String) {
    let sock = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(async {
            let s = tokio::net::TcpSocket::new_v4().unwrap();
            s.bind(format!("{from}:0").parse().unwrap()).unwrap();
            s.connect(([127, 0, 0, 1], port).into())
                .await
                .unwrap()
                .into_std()
                .unwrap()
        });
    sock.set_nonblocking(false).unwrap();
    let mut s = sock;
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut head = String::new();
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: x\r\n{head}Content-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let code = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = out
        .split_once("\r\n\r\n")
        .map(|x| x.1.to_string())
        .unwrap_or_default();
    (code, body)
}

fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A cluster without a gateway, and `opendsec e2b` for it started apart (index 1 of two
/// gateways in its config, with `extra` flags): the cluster, the config's path, the gateway's
/// process, its port and its `/readyz` port, once ready.
fn gateway(
    extra: &[&str],
) -> (
    common::Cluster,
    std::path::PathBuf,
    std::process::Child,
    u16,
    u16,
) {
    let c = common::cluster_up(&common::UpOptions {
        write_config: true,
        extra: vec!["-e2b-addr".into(), "off".into()],
        ..Default::default()
    });
    // The cluster's own config, with a gateway on a port of our choosing.
    let mut cfg: serde_json::Value = serde_json::from_str(&common::read(&c.config_path)).unwrap();
    let (port, ready) = (common::free_port(), common::free_port());
    cfg["e2b"] = serde_json::json!({
        "gateways": [{"addr": "127.0.0.1:1"}, {"addr": format!("127.0.0.1:{port}")}],
        "project": "root",
        "templates": {"base": {"image": "host"}}
    });
    let path = c.dir.path().join("e2b.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let log = std::fs::File::create(c.dir.path().join("e2b.log")).unwrap();
    let gw = Command::new(common::BIN)
        .args(["e2b", "-config"])
        .arg(&path)
        .args(["-index", "1", "-log", "info"])
        .args(extra)
        .args(["-metrics", &format!("127.0.0.1:{ready}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .unwrap();
    wait_for("/readyz", || {
        common::http_get(ready, "/readyz").is_some_and(|(code, _)| code == 200)
    });

    (c, path, gw, port, ready)
}

#[test]
fn a_gateway_of_its_own_serves_drains_and_stops() {
    let (c, path, mut gw, port, ready) = gateway(&["-drain-delay", "2s"]);
    let (code, body) = call(
        port,
        "POST",
        "/v2/sandboxes",
        &c.token,
        r#"{"templateID":"base"}"#,
    );
    assert_eq!(code, 201, "{body}");
    let sb: serde_json::Value = serde_json::from_str(&body).unwrap();
    let id = sb["sandboxID"].as_str().unwrap().to_string();
    assert_eq!(sb["templateID"], "base");
    // The same sandbox through the cluster's own API, under our id.
    let (edge, suffix) = id.rsplit_once('-').unwrap();
    let ours = common::run(
        &["ctl", "sandbox", "get", &format!("{edge}.{suffix}")],
        &[("OPENDSEC_ADDR", &c.addr), ("OPENDSEC_TOKEN", &c.token)],
    );
    assert_eq!(ours.code, 0, "{}", ours.err);
    assert!(
        ours.out.contains("\"e2b.template\": \"base\""),
        "{}",
        ours.out
    );
    // Another caller's token is refused by the apiserver, as for any call.
    let (code, body) = call(port, "GET", &format!("/sandboxes/{id}"), "dsk.x.y", "");
    assert_eq!(code, 401, "{body}");

    // SIGTERM: /readyz fails at once, calls are still served during the drain delay.
    let _ = Command::new("kill")
        .args(["-TERM", &gw.id().to_string()])
        .status();
    wait_for("/readyz to fail", || {
        common::http_get(ready, "/readyz").is_none_or(|(code, _)| code == 503)
    });
    let (code, body) = call(port, "GET", &format!("/sandboxes/{id}"), &c.token, "");
    assert_eq!(code, 200, "{body}");
    let started = Instant::now();
    let status = loop {
        if let Some(s) = gw.try_wait().unwrap() {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "the gateway did not stop"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    assert!(started.elapsed() >= Duration::from_secs(1));
    // A wrong index is a clear start error.
    let r = common::run(
        &[
            "e2b",
            "-config",
            path.to_str().unwrap(),
            "-index",
            "5",
            "-metrics",
            "127.0.0.1:0",
        ],
        &[],
    );
    assert_eq!(r.code, 1, "{}", r.err);
    assert!(
        r.err
            .contains("-index 5: the config has 2 e2b.gateways entries"),
        "{}",
        r.err
    );
}

/// IAM locks out an address after too many failed authentications
/// (`admission.auth_fail_rate`). Through the gateway that address is the gateway's client,
/// not the gateway: one client's bad keys lock out that client only, and a sandbox port
/// answers the lockout as the control plane does (429), not as a closed port.
#[test]
fn bad_keys_through_the_gateway_lock_out_their_client_not_the_gateway() {
    let (c, _path, mut gw, port, _ready) = gateway(&[]);
    let fresh = c
        .ctl(&["principal", "create", "root", "fresh", "-kind", "agent"])
        .ok()
        .json()["token"]
        .as_str()
        .unwrap()
        .to_string();
    c.ctl(&["grant", "root", "fresh", "sandbox.create,sandbox.operate"])
        .ok();
    // A guesser at 127.0.0.2: refused, then locked out.
    let mut codes = Vec::new();
    for i in 0..12 {
        let key = format!("dsk.fresh.guess{i}.wrong");
        let (code, body) = call_from(
            "127.0.0.2",
            port,
            "GET",
            "/v2/sandboxes",
            &[("X-API-KEY", &key)],
            "",
        );
        assert!(code == 401 || code == 429, "{code} {body}");
        codes.push(code);
    }
    assert_eq!(codes.first(), Some(&401), "{codes:?}");
    assert_eq!(codes.last(), Some(&429), "{codes:?}");
    // From there even a good key it never used is refused for now, on a port as on the
    // control plane: the same 429, not E2B's "port is not open" 502.
    let port_headers = [
        ("E2b-Sandbox-Id", "node-0-0123456789abcdef"),
        ("E2b-Sandbox-Port", "8000"),
        ("X-Access-Token", fresh.as_str()),
    ];
    let (code, body) = call_from("127.0.0.2", port, "GET", "/", &port_headers, "");
    assert_eq!(code, 429, "{body}");
    assert!(body.contains("too many failed authentications"), "{body}");
    // Every other client of the gateway goes on: the good key, first used from 127.0.0.1.
    let (code, body) = call(port, "GET", "/v2/sandboxes", &fresh, "");
    assert_eq!(code, 200, "{body}");
    // That key, now known to the gateway and the apiserver from 127.0.0.1, still gets the
    // locked-out address the answer every key gets there: a guesser learns nothing from it.
    let fresh_key = [("X-API-KEY", fresh.as_str())];
    let (code, body) = call_from("127.0.0.2", port, "GET", "/v2/sandboxes", &fresh_key, "");
    assert_eq!(code, 429, "{body}");
    let (code, body) = call_from("127.0.0.2", port, "GET", "/", &port_headers, "");
    assert_eq!(code, 429, "{body}");
    // A guesser at 127.0.0.3 on envd's /health (the SDKs' is_running()), which checks no
    // key of its own first: locked out itself, the gateway's other clients not.
    let mut codes = Vec::new();
    for i in 0..12 {
        let key = format!("dsk.fresh.health{i}.wrong");
        let headers = [
            ("E2b-Sandbox-Id", "node-0-0123456789abcdef"),
            ("X-Access-Token", key.as_str()),
        ];
        let (code, _) = call_from("127.0.0.3", port, "GET", "/health", &headers, "");
        codes.push(code);
    }
    assert_eq!(codes.last(), Some(&429), "{codes:?}");
    let newer = c
        .ctl(&["principal", "create", "root", "newer", "-kind", "agent"])
        .ok()
        .json()["token"]
        .as_str()
        .unwrap()
        .to_string();
    c.ctl(&["grant", "root", "newer", "sandbox.create,sandbox.operate"])
        .ok();
    let (code, body) = call(port, "GET", "/v2/sandboxes", &newer, "");
    assert_eq!(code, 200, "{body}");
    common::terminate(&mut gw);
}
