//! microVMs with the edge's network (docs/microvm.md "Network"), in the world the network
//! tests build (a fresh host netns and an "internet" netns, tests/common/netns.rs): a VM
//! gets the guest address behind its tap, its traffic leaves as its slot's address under
//! its rules, its DNS reaches the edge's proxy port, a forged source gets nowhere, and the
//! network survives a pause, a rule update, an edge restart and a copy from a snapshot,
//! which keeps the guest's configuration and gets a slot of its own. A stop leaves no veth,
//! namespace or rule. Under emulation; as root.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::collections::HashMap;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use common::microvm::{
    backend_with, create_request, layer, shell, snapshot_with_memory, Leftovers,
};
use common::netns::{host_ip, in_fresh_netns, in_ns, names, record_udp, world, UPLINK_HOST};
use opendsec::backends::microvm::VmState;
use opendsec::backends::{Backend, Handle, Recorded};
use opendsec::images::name::ImageRef;
use opendsec::images::store::{ImageManifest, Store};
use opendsec::netpol::network::Network;
use opendsec::netpol::{ClusterRules, DEFAULT_SUBNET};
use opendsec::pb;
use opendsec::types::Reason;

const EDGE: &str = "mvn";
const DNS_PORT: u16 = 15354;
/// A TCP server in the internet netns, allowed by rule set `docs`, that records who
/// connects.
const RECORDER: (Ipv4Addr, u16) = (Ipv4Addr::new(198, 51, 100, 10), 7000);

fn network() -> Arc<Network> {
    let rules = ClusterRules::new(
        &[(
            "docs".to_string(),
            vec![
                "192.0.2.10:80".to_string(),
                "198.51.100.10:7000".to_string(),
            ],
        )]
        .into(),
        &Default::default(),
    )
    .unwrap();
    Arc::new(Network::start(EDGE, DEFAULT_SUBNET, DNS_PORT, rules).unwrap())
}

fn spec(rules: &[(&str, bool)]) -> pb::SandboxSpec {
    pb::SandboxSpec {
        network_rules: rules
            .iter()
            .map(|(k, v)| (k.to_string(), *v))
            .collect::<HashMap<_, _>>(),
        cpu_cores_limit: 1.0,
        ..common::microvm::spec("root/t/net:1")
    }
}

/// A store with image `root/t/net:1`: busybox with its network tools.
fn store(dir: &Path) {
    let store = Store::open(dir).unwrap();
    let base = layer(&store, 10, |r| {
        common::busybox_into(
            r,
            &[
                "sh", "cat", "echo", "ip", "nc", "nslookup", "sleep", "timeout", "grep", "ls",
            ],
        );
        std::fs::create_dir_all(r.join("etc")).unwrap();
        std::fs::write(r.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
        std::fs::write(r.join("etc/group"), "root:x:0:\n").unwrap();
    });
    store
        .write_manifest(
            &ImageRef::parse("root/t/net:1").unwrap(),
            &ImageManifest {
                layers: vec![base],
                env: vec!["PATH=/bin".into()],
                ..Default::default()
            },
            false,
        )
        .unwrap();
}

/// Who connected to [`RECORDER`], as (source address, first line).
fn serve_recorder(ns: &std::fs::File) -> Recorder {
    let (tx, rx) = std::sync::mpsc::channel();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    in_ns(ns, move || {
        Box::pin(async move {
            use tokio::io::AsyncReadExt;
            let l = tokio::net::TcpListener::bind(RECORDER).await.unwrap();
            ready_tx.send(()).unwrap();
            loop {
                let (mut s, from) = l.accept().await.unwrap();
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 64];
                    let n = tokio::time::timeout(Duration::from_secs(3), s.read(&mut buf))
                        .await
                        .ok()
                        .and_then(Result::ok)
                        .unwrap_or(0);
                    let line = String::from_utf8_lossy(&buf[..n]).trim().to_string();
                    let _ = tx.send((from, line));
                });
            }
        })
    });
    ready_rx.recv().unwrap();
    std::sync::Mutex::new(rx)
}

type Recorder = std::sync::Mutex<std::sync::mpsc::Receiver<(SocketAddr, String)>>;

/// From inside the VM: a TCP exchange with the echo server at `addr:port`, given up after
/// 3 s: "ping" when the echo came back, "" when nothing answered.
async fn reach(b: &Arc<dyn Backend>, h: &Handle<'_>, addr: &str, port: u16) -> String {
    shell(
        b,
        h,
        &format!("echo ping | timeout 3 nc -w 2 {addr} {port} 2>/dev/null; true"),
    )
    .await
    .trim()
    .to_string()
}

/// Sends `line` from inside the VM to [`RECORDER`] and returns who the recorder saw say it
/// (None: nothing arrived within 4 s).
async fn recorded(
    b: &Arc<dyn Backend>,
    h: &Handle<'_>,
    rx: &Recorder,
    line: &str,
) -> Option<Ipv4Addr> {
    shell(
        b,
        h,
        &format!(
            "echo {line} | timeout 3 nc -w 2 {} {} >/dev/null 2>&1; true",
            RECORDER.0, RECORDER.1
        ),
    )
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(4);
    while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
        let got = rx.lock().unwrap().recv_timeout(left);
        match got {
            Ok((SocketAddr::V4(from), got)) if got == line => return Some(*from.ip()),
            Ok(_) => continue,
            Err(_) => break,
        }
    }
    None
}

/// Has the VM ask its resolver for `name` and returns the source address the query had
/// when it reached the edge's proxy port.
async fn dns_source(
    b: &Arc<dyn Backend>,
    h: &Handle<'_>,
    rx: &std::sync::Mutex<std::sync::mpsc::Receiver<(SocketAddr, Vec<u8>)>>,
    name: &str,
) -> Ipv4Addr {
    shell(
        b,
        h,
        &format!("(timeout 3 nslookup {name}.test >/dev/null 2>&1 &); true"),
    )
    .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while let Some(left) = deadline.checked_duration_since(std::time::Instant::now()) {
        let got = rx.lock().unwrap().recv_timeout(left);
        match got {
            Ok((SocketAddr::V4(from), query))
                if query.windows(name.len()).any(|w| w == name.as_bytes()) =>
            {
                return *from.ip()
            }
            Ok(_) => continue,
            Err(_) => break,
        }
    }
    panic!("no DNS query for {name}.test reached the edge");
}

fn host_links() -> Vec<String> {
    names(&host_ip(&["link", "show"]))
}

#[test]
fn a_microvm_on_the_network_keeps_it_through_pause_restart_and_copies() {
    if !opendsec::sys::root_or_skip(
        "a_microvm_on_the_network_keeps_it_through_pause_restart_and_copies",
    ) {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let w = world();
        let recorder = serve_recorder(&w.internet.ns);
        let tmp = tempfile::tempdir().unwrap();
        let (state, store_dir) = (tmp.path().join("state"), tmp.path().join("store"));
        store(&store_dir);
        let ids = [format!("{EDGE}.a"), format!("{EDGE}.c")];
        let _leftovers = Leftovers(ids.to_vec());
        let net = network();
        let b = backend_with(&state, EDGE, &store_dir, false, Some(net.clone()));
        let s = spec(&[("docs", true)]);
        let st = b
            .create(&create_request(&ids[0], None, s.clone()))
            .await
            .expect("create a networked VM");
        let vm: VmState = serde_json::from_value(st.clone()).unwrap();
        assert_eq!(vm.net_slot, Some(0));
        let h = Handle {
            sandbox_id: &ids[0],
            spec: &s,
            state: &st,
        };
        let vms = state.join(EDGE).join("microvms");
        assert!(vms.join(&ids[0]).join("netns").exists());
        assert!(host_links().iter().any(|l| l.starts_with("odsv")));

        // The guest: the same address behind the same gateway in every VM, its resolver
        // the tap's end.
        let out = shell(
            &b,
            &h,
            "cat /etc/resolv.conf; ip -4 -o addr show; ip route; cat /sys/class/net/eth0/address",
        )
        .await;
        assert!(out.contains("nameserver 169.254.0.1\n"), "{out}");
        assert!(out.contains("eth0    inet 169.254.0.2/30"), "{out}");
        assert!(out.contains("default via 169.254.0.1 dev eth0"), "{out}");
        assert!(out.contains("02:fc:00:00:00:02"), "{out}");

        // Its rules hold: `docs` allows 192.0.2.10:80 and the recorder, nothing else (the
        // node's own addresses included); what reaches the internet is the node's
        // uplink address, as for a container.
        assert_eq!(reach(&b, &h, "192.0.2.10", 80).await, "ping");
        assert_eq!(reach(&b, &h, "192.0.2.10", 443).await, "");
        assert_eq!(reach(&b, &h, "10.30.0.10", 80).await, "");
        assert_eq!(reach(&b, &h, "203.0.113.1", 22).await, "");
        assert_eq!(reach(&b, &h, "10.88.0.1", 22).await, "");
        assert_eq!(
            recorded(&b, &h, &recorder, "first").await,
            Some(UPLINK_HOST)
        );

        // Its DNS goes to the edge's proxy port on its gateway, from the slot's address
        // (10.88.0.2), which the edge's rules and proxy know it by.
        let host_ns = std::fs::File::open("/proc/thread-self/ns/net").unwrap();
        let dns = std::sync::Mutex::new(record_udp(&host_ns, DNS_PORT));
        assert_eq!(
            dns_source(&b, &h, &dns, "probe").await,
            Ipv4Addr::new(10, 88, 0, 2)
        );

        // Its root takes another source address: nothing of it gets out.
        shell(
            &b,
            &h,
            "ip addr add 169.254.0.9/32 dev eth0 && ip route replace default via 169.254.0.1 dev eth0 src 169.254.0.9",
        )
        .await;
        assert_eq!(recorded(&b, &h, &recorder, "forged").await, None);
        shell(
            &b,
            &h,
            "ip route replace default via 169.254.0.1 dev eth0 src 169.254.0.2 && ip addr del 169.254.0.9/32 dev eth0",
        )
        .await;

        // Paused (no QEMU), its namespace and veth stay; resumed, it reaches again.
        let paused = b.pause(&h).await.expect("pause");
        let hp = Handle {
            sandbox_id: &ids[0],
            spec: &s,
            state: &paused,
        };
        assert!(host_links().iter().any(|l| l.starts_with("odsv")));
        let resumed = b.resume(&hp).await.expect("resume");
        let h = Handle {
            sandbox_id: &ids[0],
            spec: &s,
            state: &resumed,
        };
        assert_eq!(reach(&b, &h, "192.0.2.10", 80).await, "ping");

        // A rule update applies at once.
        let closed = spec(&[]);
        let hc = Handle {
            sandbox_id: &ids[0],
            spec: &closed,
            state: &resumed,
        };
        b.update_network(&hc).await.expect("take the rules back");
        assert_eq!(reach(&b, &hc, "192.0.2.10", 80).await, "");
        b.update_network(&h).await.expect("allow docs again");
        assert_eq!(reach(&b, &h, "192.0.2.10", 80).await, "ping");

        // A copy from a memory snapshot: its guest keeps the address it configured, and
        // it leaves as a slot of its own.
        let snap = tmp.path().join("snap");
        snapshot_with_memory(&b, &h, &snap).await;
        // A node without networking cannot give the copy the NIC its source had.
        let offline = backend_with(
            &tmp.path().join("offline"),
            "mvn-off",
            &store_dir,
            false,
            None,
        );
        let err = offline
            .create(&create_request("mvn-off.x", Some(snap.clone()), s.clone()))
            .await
            .unwrap_err();
        assert_eq!(err.reason(), Reason::Invalid, "{err}");
        assert!(err.to_string().contains("network device"), "{err}");
        let copy_st = b
            .create(&create_request(&ids[1], Some(snap.clone()), s.clone()))
            .await
            .expect("a copy");
        let copy: VmState = serde_json::from_value(copy_st.clone()).unwrap();
        assert_eq!(copy.net_slot, Some(1));
        let hcopy = Handle {
            sandbox_id: &ids[1],
            spec: &s,
            state: &copy_st,
        };
        let out = shell(&b, &hcopy, "ip -4 -o addr show dev eth0").await;
        assert!(out.contains("inet 169.254.0.2/30"), "{out}");
        assert_eq!(
            dns_source(&b, &hcopy, &dns, "copy").await,
            Ipv4Addr::new(10, 88, 0, 6)
        );
        assert_eq!(
            dns_source(&b, &h, &dns, "source").await,
            Ipv4Addr::new(10, 88, 0, 2)
        );
        assert_eq!(
            recorded(&b, &hcopy, &recorder, "copy").await,
            Some(UPLINK_HOST)
        );

        // The edge restarts: a new Network and backend adopt both, and their rules hold.
        drop(b);
        drop(net);
        let net = network();
        let b = backend_with(&state, EDGE, &store_dir, false, Some(net.clone()));
        b.adopt(&h, Recorded::Running).await.expect("adopt the VM");
        b.adopt(&hcopy, Recorded::Running)
            .await
            .expect("adopt the copy");
        assert_eq!(reach(&b, &h, "192.0.2.10", 80).await, "ping");
        assert_eq!(reach(&b, &hcopy, "192.0.2.10", 80).await, "ping");
        assert_eq!(reach(&b, &hcopy, "192.0.2.10", 443).await, "");

        // Stopped: no veth, namespace or rule of theirs is left.
        b.stop(&h).await.expect("stop the VM");
        b.stop(&hcopy).await.expect("stop the copy");
        assert!(
            !host_links().iter().any(|l| l.starts_with("odsv")),
            "{:?}",
            host_links()
        );
        assert!(!vms.join(&ids[0]).exists() && !vms.join(&ids[1]).exists());
        assert_eq!(net.firewall().slots().unwrap(), Vec::<u32>::new());
        assert!(!net.is_held(0) && !net.is_held(1));
        net.firewall().remove().unwrap();
    });
}
