//! Container sandboxes with networking (docs/network.md): the container backend with the
//! edge's [`Network`], in a world the test builds (a fresh host netns and an "internet"
//! netns behind one uplink, tests/common/netns.rs). A sandbox gets `eth0` with its /30, a
//! default route and `/etc/resolv.conf` naming its gateway; its rules hold (an allowed
//! address answers, the rest times out); a restarted edge adopts it with its rules and
//! removes strays; a stop and a failed creation leave no veth, chain or rule; a rule update
//! applies at once, and taking an allowance back cuts an open connection; with networking
//! off a sandbox has only `lo`. Root only.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::{BTreeMap, HashMap};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::netns::{host_ip, in_fresh_netns, names, run, world, SandboxNs};
use opendsec::backends::{self, Backend, BackendContext, CreateRequest, Handle, Recorded};
use opendsec::config::BackendConfig;
use opendsec::netpol::network::Network;
use opendsec::netpol::{ClusterRules, LinkPlan, DEFAULT_SUBNET};
use opendsec::pb::{self, runtime_client::RuntimeClient};
use opendsec::types::Reason;

fn root_or_skip() -> bool {
    opendsec::sys::root_or_skip("the container network tests")
}

const EDGE: &str = "cn";

fn network() -> Arc<Network> {
    let rules = ClusterRules::new(
        &[("docs".to_string(), vec!["192.0.2.10:80".to_string()])].into(),
        &Default::default(),
    )
    .unwrap();
    Arc::new(Network::start(EDGE, DEFAULT_SUBNET, 15353, rules).unwrap())
}

fn backend(state: &Path, network: Option<Arc<Network>>) -> Arc<dyn Backend> {
    let ctx = BackendContext {
        edge_id: EDGE.into(),
        state_dir: state.to_path_buf(),
        agent_dir: PathBuf::from(env!("CARGO_BIN_EXE_opendsec"))
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default(),
        images: BTreeMap::from([("host".to_string(), vec![PathBuf::from("/")])]),
        image_store: None,
        network,
    };
    let cfg = BackendConfig {
        runtime: "linux".into(),
        prepared_disks: Some(0),
        ..Default::default()
    };
    backends::build("container", &cfg, &ctx).unwrap()
}

fn spec(rules: &[(&str, bool)]) -> pb::SandboxSpec {
    pb::SandboxSpec {
        backend: "container".into(),
        image: "host".into(),
        cpu_cores_limit: 1.0,
        memory_limit_mb: 512,
        disk_mb: 64,
        network_rules: rules
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect::<HashMap<_, _>>(),
        ..Default::default()
    }
}

async fn create(
    b: &Arc<dyn Backend>,
    id: &str,
    spec: &pb::SandboxSpec,
) -> Result<serde_json::Value, backends::BackendError> {
    b.create(&CreateRequest {
        fork: None,
        snapshot: None,
        sandbox_id: id.into(),
        project: "root".into(),
        spec: spec.clone(),
    })
    .await
}

/// Runs `cmd` with bash in the sandbox: (exit code, stdout).
async fn sh(b: &Arc<dyn Backend>, h: &Handle<'_>, cmd: &str) -> (i32, String) {
    let ch = b.runtime().unwrap().channel(h).await.unwrap();
    let r = RuntimeClient::new(ch)
        .run_shell(pb::RunShellRequest {
            sandbox_id: h.sandbox_id.into(),
            cmd: cmd.into(),
            timeout: 30.0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    (r.exit_code, String::from_utf8_lossy(&r.stdout).into_owned())
}

/// A TCP exchange with `addr:port` from inside the sandbox, given up after 2 s: `echo` when
/// the echo came back, `timeout` when nothing answered (dropped).
const TRY_TCP: &str = r#"try() { timeout 2 bash -c "exec 3<>/dev/tcp/$1/$2; echo ping >&3; head -n1 <&3" && echo echo || echo timeout; }"#;

async fn reach(b: &Arc<dyn Backend>, h: &Handle<'_>, addr: &str, port: u16) -> String {
    let (_, out) = sh(b, h, &format!("{TRY_TCP}; try {addr} {port}")).await;
    out.lines().last().unwrap_or_default().to_string()
}

/// From inside a sandbox: three UDP datagrams to 192.0.2.10:80 built by hand on a raw
/// socket, with the source 10.88.0.9 (a neighbour's), 192.0.2.99 (a public address) and
/// its own (payloads `nb`, `pub`, `own`).
const FORGE_UDP: &str = r#"python3 - <<'EOF'
import socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW)
def send(src, payload):
    udp = struct.pack("!HHHH", 40000, 80, 8 + len(payload), 0) + payload
    ip = struct.pack("!BBHHHBBH4s4s", 0x45, 0, 20 + len(udp), 0, 0, 64, 17, 0,
                     socket.inet_aton(src), socket.inet_aton("192.0.2.10"))
    s.sendto(ip + udp, ("192.0.2.10", 0))
send("10.88.0.9", b"nb")
send("192.0.2.99", b"pub")
send("10.88.0.2", b"own")
print("sent")
EOF"#;

fn with_rules<'a>(
    id: &'a str,
    spec: &'a pb::SandboxSpec,
    state: &'a serde_json::Value,
) -> Handle<'a> {
    Handle {
        sandbox_id: id,
        spec,
        state,
    }
}

/// Starts `cmd` with bash in the sandbox without waiting for it.
async fn sh_background(b: &Arc<dyn Backend>, h: &Handle<'_>, cmd: &str) {
    let ch = b.runtime().unwrap().channel(h).await.unwrap();
    RuntimeClient::new(ch)
        .run_shell(pb::RunShellRequest {
            sandbox_id: h.sandbox_id.into(),
            cmd: cmd.into(),
            session: "held".into(),
            background: true,
            ..Default::default()
        })
        .await
        .unwrap();
}

/// The contents of `path` in the sandbox once it is not empty (up to 10 s), or "".
async fn wait_for_file(b: &Arc<dyn Backend>, h: &Handle<'_>, path: &str) -> String {
    let (_, out) = sh(
        b,
        h,
        &format!("for i in $(seq 200); do [ -s {path} ] && break; sleep 0.05; done; cat {path} 2>/dev/null"),
    )
    .await;
    out
}

/// One TCP connection to 192.0.2.10:80 held open from inside a sandbox: an echo of `one`
/// is written to /tmp/c1; once /tmp/go exists, `two` is sent on the same connection and
/// /tmp/c2 gets its echo, or `timeout` when none came within 2 s.
const HELD_TCP: &str = r#"python3 - >/tmp/held.log 2>&1 <<'EOF'
import os, socket, time
s = socket.create_connection(("192.0.2.10", 80), timeout=2)
s.sendall(b"one\n")
open("/tmp/c1", "w").write(s.recv(16).decode())
while not os.path.exists("/tmp/go"):
    time.sleep(0.02)
s.sendall(b"two\n")
try:
    got = s.recv(16).decode()
except socket.timeout:
    got = "timeout"
open("/tmp/c2", "w").write(got)
EOF"#;

fn host_links() -> Vec<String> {
    names(&host_ip(&["link", "show"]))
}

#[test]
fn a_networked_sandbox_lives_and_dies_with_its_network() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let w = world();
        let tmp = tempfile::tempdir().unwrap();
        let net = network();
        let b = backend(tmp.path(), Some(net.clone()));
        let s = spec(&[("docs", true)]);
        let id = format!("{EDGE}.net1");
        let st = create(&b, &id, &s).await.unwrap();
        assert_eq!(st["net_slot"], 0);
        let h = Handle {
            sandbox_id: &id,
            spec: &s,
            state: &st,
        };
        let (code, out) = sh(
            &b,
            &h,
            "cat /etc/resolv.conf; ls /sys/class/net; ip -4 -o addr show dev eth0 | awk '{print $4}'; ip route",
        )
        .await;
        assert_eq!(code, 0, "{out}");
        assert!(out.contains("nameserver 10.88.0.1\n"), "{out}");
        assert!(out.contains("eth0\nlo\n"), "{out}");
        assert!(out.contains("10.88.0.2/30\n"), "{out}");
        assert!(out.contains("default via 10.88.0.1 dev eth0"), "{out}");
        // The rule set `docs` allows 192.0.2.10:80 and nothing else.
        assert_eq!(reach(&b, &h, "192.0.2.10", 80).await, "echo");
        assert_eq!(reach(&b, &h, "192.0.2.10", 443).await, "timeout");
        assert_eq!(reach(&b, &h, "198.51.100.10", 80).await, "timeout");
        assert_eq!(reach(&b, &h, "10.30.0.10", 80).await, "timeout");
        // Its root cannot reconfigure its link (no CAP_NET_ADMIN): no second address, no
        // new route.
        let (code, out) = sh(
            &b,
            &h,
            "ip addr add 10.88.0.9/32 dev eth0 2>&1; ip route add 192.0.2.0/24 dev eth0 2>&1",
        )
        .await;
        assert_ne!(code, 0);
        assert_eq!(out.matches("Operation not permitted").count(), 2, "{out}");

        // CAP_NET_RAW it has (as in Docker): a raw socket sends UDP with a forged source
        // (another sandbox's address, a public one); only its own source gets through.
        let udp = common::netns::record_udp(&w.internet.ns, 80);
        let (code, out) = sh(&b, &h, FORGE_UDP).await;
        assert_eq!(code, 0, "{out}");
        let got: Vec<Vec<u8>> = std::iter::from_fn(|| {
            udp.recv_timeout(std::time::Duration::from_millis(1500))
                .ok()
        })
        .map(|(_, payload)| payload)
        .collect();
        assert_eq!(got, [b"own".to_vec()], "{out}");

        // The edge restarts: a new Network and backend adopt the sandbox, its rules hold,
        // and a stray veth (a slot nobody holds) goes.
        drop(b);
        let stray = SandboxNs::start();
        let plan = LinkPlan::new(DEFAULT_SUBNET, 9).unwrap();
        opendsec::netpol::attach(stray.ns.as_fd(), &plan)
            .await
            .unwrap();
        net.firewall()
            .attach(&plan.addrs, &Default::default())
            .unwrap();
        // Restarted with another subnet, the edge's table would not filter the sandbox's
        // veth: the sandbox is lost (and the edge ends it), never adopted unfiltered.
        {
            let moved = Network::start(
                EDGE,
                "10.89.0.0/16".parse().unwrap(),
                15353,
                ClusterRules::default(),
            )
            .unwrap();
            let b3 = backend(tmp.path(), Some(Arc::new(moved)));
            let e = b3
                .adopt(&h, Recorded::Running)
                .await
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("no veth odsv0a590000 in subnet 10.89.0.0/16"),
                "{e}"
            );
        }
        let net2 = network();
        let b2 = backend(tmp.path(), Some(net2.clone()));
        b2.adopt(&h, Recorded::Running).await.unwrap();
        let rep = b2.cleanup(&[id.clone()].into()).await.unwrap();
        assert!(
            rep.removed.contains(&"veth odsv0a580024".to_string())
                && rep.removed.contains(&"rules of network slot 9".to_string()),
            "{:?}",
            rep.removed
        );
        assert_eq!(net2.firewall().slots().unwrap(), [0]);
        assert_eq!(reach(&b2, &h, "192.0.2.10", 80).await, "echo");
        assert_eq!(reach(&b2, &h, "198.51.100.10", 80).await, "timeout");

        // The next sandbox takes the next free slot; the stop gives everything back.
        let id2 = format!("{EDGE}.net2");
        let st2 = create(&b2, &id2, &spec(&[])).await.unwrap();
        assert_eq!(st2["net_slot"], 1);
        let s2 = spec(&[]);
        let h2 = Handle {
            sandbox_id: &id2,
            spec: &s2,
            state: &st2,
        };
        assert_eq!(reach(&b2, &h2, "192.0.2.10", 80).await, "timeout");
        b2.stop(&h).await.unwrap();
        b2.stop(&h2).await.unwrap();
        assert_eq!(host_links(), ["lo", "up0"]);
        assert!(net2.firewall().slots().unwrap().is_empty());
        // The edge exits with no sandbox left: its table goes too.
        assert!(run("nft", &["list", "tables"]).contains("inet opendsec-cn"));
        b2.release_node().await.unwrap();
        assert_eq!(run("nft", &["list", "tables"]), "");
    });
}

/// `UpdateNetwork` at the backend: an allowance applies at once; a rule that does not
/// resolve changes nothing; taking the allowance back (replacing the rules with none) stops
/// an open TCP connection from passing data at once; a paused sandbox's rules change too
/// and hold once it resumes.
#[test]
fn a_rule_update_applies_at_once_and_taking_it_back_cuts_open_connections() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let _w = world();
        let tmp = tempfile::tempdir().unwrap();
        let net = network();
        let b = backend(tmp.path(), Some(net.clone()));
        let id = format!("{EDGE}.upd");
        let (none, open, bad) = (
            spec(&[]),
            spec(&[("192.0.2.10", true)]),
            spec(&[("npm", true)]),
        );
        let st = create(&b, &id, &none).await.unwrap();
        // The edge hands the backend the sandbox's spec with the new rules.
        let handle = |s| with_rules(&id, s, &st);
        let (none, open, bad) = (&none, &open, &bad);
        // Created with no allowance: the test host does not answer.
        assert_eq!(reach(&b, &handle(none), "192.0.2.10", 80).await, "timeout");

        b.update_network(&handle(open)).await.unwrap();
        let h = handle(open);
        assert_eq!(reach(&b, &h, "192.0.2.10", 80).await, "echo");
        assert_eq!(reach(&b, &h, "192.0.2.10", 443).await, "echo");
        assert_eq!(reach(&b, &h, "198.51.100.10", 80).await, "timeout");

        // A rule set the config lacks: invalid, and the rules in force stay.
        let e = b.update_network(&handle(bad)).await.unwrap_err();
        assert_eq!(e.reason(), Reason::Invalid);
        assert!(e.to_string().contains("no rule set named"), "{e}");
        assert_eq!(reach(&b, &h, "192.0.2.10", 80).await, "echo");

        // A connection opened while allowed, then the allowance taken back.
        sh_background(&b, &h, HELD_TCP).await;
        assert_eq!(wait_for_file(&b, &h, "/tmp/c1").await, "one\n");
        b.update_network(&handle(none)).await.unwrap();
        let h = handle(none);
        sh(&b, &h, "touch /tmp/go").await;
        assert_eq!(
            wait_for_file(&b, &h, "/tmp/c2").await,
            "timeout",
            "{}",
            sh(&b, &h, "cat /tmp/held.log").await.1
        );
        assert_eq!(reach(&b, &h, "192.0.2.10", 80).await, "timeout");

        // Paused (frozen), its chains still change; resumed, it has the new rules.
        b.pause(&h).await.unwrap();
        b.update_network(&handle(open)).await.unwrap();
        let h = handle(open);
        b.resume(&h).await.unwrap();
        assert_eq!(reach(&b, &h, "192.0.2.10", 80).await, "echo");

        b.stop(&h).await.unwrap();
        assert_eq!(host_links(), ["lo", "up0"]);
        assert!(net.firewall().slots().unwrap().is_empty());
    });
}

#[test]
fn bad_rules_and_failed_creations_leave_nothing() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let tmp = tempfile::tempdir().unwrap();
        let net = network();
        let b = backend(tmp.path(), Some(net.clone()));
        // A rule naming a rule set the config lacks: invalid, and nothing made.
        let e = create(&b, &format!("{EDGE}.bad"), &spec(&[("npm", true)]))
            .await
            .unwrap_err();
        assert_eq!(e.reason(), Reason::Invalid);
        assert!(
            e.to_string()
                .contains("network_rules: network rule \"npm\": no rule set named"),
            "{e}"
        );
        // A creation that fails after its slot was taken (the slot's veth name is held by
        // a link that is not ours) leaves no veth or rule of its own.
        common::netns::host_ip_do(&["link", "add", "odsv0a580000", "type", "bridge"]);
        let e = create(&b, &format!("{EDGE}.fail"), &spec(&[("docs", true)]))
            .await
            .unwrap_err();
        assert!(e.to_string().contains("connecting its network"), "{e}");
        assert_eq!(host_links(), ["lo", "odsv0a580000"]);
        assert!(net.firewall().slots().unwrap().is_empty());
        // Slot 0 is not handed out while a link of its name exists: the next is 1.
        assert_eq!(net.reserve().unwrap(), 1);
    });
}

#[test]
fn without_networking_a_sandbox_has_only_loopback() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let tmp = tempfile::tempdir().unwrap();
        let b = backend(tmp.path(), None);
        let id = format!("{EDGE}.lo");
        let s = spec(&[]);
        let st = create(&b, &id, &s).await.unwrap();
        assert!(st["net_slot"].is_null());
        let h = Handle {
            sandbox_id: &id,
            spec: &s,
            state: &st,
        };
        let (_, out) = sh(&b, &h, "ls /sys/class/net").await;
        assert_eq!(out, "lo\n");
        b.stop(&h).await.unwrap();
    });
}
