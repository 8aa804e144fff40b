//! Enforcement (src/netpol/nft.rs, docs/network.md "Enforcement") against the real kernel,
//! in a world the test builds and removes: a fresh "host" netns (the edge's), an "internet"
//! netns linked to it by one veth (203.0.113.0/24) holding test servers on documentation
//! addresses (192.0.2.10, 198.51.100.10) and on a private one (10.30.0.10), and sandboxes
//! (`unshare -n sleep` children) attached with their veth and chains as the edge does. No
//! packet leaves these namespaces: the host netns has no route but the uplink. Every case
//! asserts the exact outcome: a dropped packet is a connect that times out (never a refusal,
//! which would mean something answered). Root only.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::fs::File;
use std::io::ErrorKind;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::os::fd::AsFd;

use common::netns::{
    assert_dropped, assert_passes, exchange, in_fresh_netns, in_ns, run, serve_echo, world,
    SandboxNs, DROPPED_AFTER, PRIVATE, PUBLIC_A, PUBLIC_B, UPLINK_HOST,
};
use opendsec::netpol::{attach, ClusterRules, Firewall, LinkPlan, Policy, DEFAULT_SUBNET};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn root_or_skip() -> bool {
    opendsec::sys::root_or_skip("the network enforcement tests")
}

const DNS_PORT: u16 = 15353;
/// A service of the host (an apiserver, IAM): no sandbox may reach it.
const HOST_SERVICE_PORT: u16 = 7000;

fn policy(rules: &[(&str, bool)]) -> Policy {
    ClusterRules::default()
        .resolve(rules.iter().map(|(k, v)| (k.to_string(), *v)))
        .unwrap()
}

/// A sandbox attached at `slot` with `rules`: its netns, and its address.
async fn sandbox(fw: &Firewall, slot: u32, rules: &[(&str, bool)]) -> (SandboxNs, Ipv4Addr) {
    let sb = SandboxNs::start();
    let plan = LinkPlan::new(DEFAULT_SUBNET, slot).unwrap();
    let a = attach(sb.ns.as_fd(), &plan).await.unwrap();
    fw.attach(&a.addrs, &policy(rules)).unwrap();
    (sb, a.addrs.sandbox)
}

fn firewall() -> Firewall {
    let fw = Firewall::new("e1", DEFAULT_SUBNET, DNS_PORT);
    fw.install_base().unwrap();
    fw
}

#[test]
fn default_deny_and_each_rule_kind() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let w = world();
        let fw = firewall();

        // Nothing allowed: every destination is dropped.
        let (none, _) = sandbox(&fw, 1, &[]).await;
        for to in [(PUBLIC_A, 80), (PUBLIC_B, 443), (PRIVATE, 80)] {
            assert_dropped(&none.ns, None, to);
        }

        // An address with a port: that port only.
        let (one, _) = sandbox(&fw, 2, &[("192.0.2.10:80", true)]).await;
        assert_passes(&one.ns, (PUBLIC_A, 80));
        assert_dropped(&one.ns, None, (PUBLIC_A, 443));
        assert_dropped(&one.ns, None, (PUBLIC_B, 80));

        // A port range with a protocol.
        let (range, _) = sandbox(&fw, 3, &[("198.51.100.0/24:400-500/tcp", true)]).await;
        assert_passes(&range.ns, (PUBLIC_B, 443));
        assert_dropped(&range.ns, None, (PUBLIC_B, 80));
        assert_dropped(&range.ns, None, (PUBLIC_B, 8080));

        // `*`: every public address, no private one.
        let (star, _) = sandbox(&fw, 4, &[("*", true)]).await;
        assert_passes(&star.ns, (PUBLIC_A, 443));
        assert_passes(&star.ns, (PUBLIC_B, 8080));
        assert_dropped(&star.ns, None, (PRIVATE, 80));

        // A private network named outright is reachable.
        let (private, _) = sandbox(&fw, 5, &[("10.30.0.0/16", true)]).await;
        assert_passes(&private.ns, (PRIVATE, 80));
        assert_dropped(&private.ns, None, (PUBLIC_A, 80));

        // Apart from DNS, no service of the host: not on the gateway, not on the uplink.
        let _service = std::net::TcpListener::bind(("0.0.0.0", HOST_SERVICE_PORT)).unwrap();
        let gateway = LinkPlan::new(DEFAULT_SUBNET, 4).unwrap().addrs.gateway;
        assert_dropped(&star.ns, None, (gateway, HOST_SERVICE_PORT));
        assert_dropped(&star.ns, None, (UPLINK_HOST, HOST_SERVICE_PORT));
        drop(w);
    });
}

/// The rules of `chain` with their handles, as `nft -a` lists them.
fn rules_with_handles(chain: &str) -> String {
    run(
        "nft",
        &["-a", "list", "chain", "inet", "opendsec-e1", chain],
    )
}

#[test]
fn an_update_keeping_the_layout_changes_only_set_elements_and_another_rewrites_the_chain() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let w = world();
        let fw = firewall();
        let (sb, _) = sandbox(&fw, 6, &[("192.0.2.10:80", true), ("pypi.org", true)]).await;
        assert_passes(&sb.ns, (PUBLIC_A, 80));
        let before = rules_with_handles("out-6");

        // Other networks and ports, `*` with a port, another domain without a limit: the
        // same layout, so the same rules (same handles) and new elements only.
        fw.update(
            6,
            &policy(&[
                ("198.51.100.10:8080", true),
                ("*:443", true),
                ("files.example", true),
            ]),
        )
        .unwrap();
        assert_eq!(rules_with_handles("out-6"), before);
        assert_passes(&sb.ns, (PUBLIC_B, 8080));
        assert_passes(&sb.ns, (PUBLIC_A, 443));
        assert_dropped(&sb.ns, None, (PUBLIC_A, 80));

        // A domain under a new port limit needs a resolved set and its rule: the chain is
        // written again, and what the policy allows still passes.
        fw.update(
            6,
            &policy(&[("198.51.100.10:8080", true), ("github.com:443", true)]),
        )
        .unwrap();
        let after = rules_with_handles("out-6");
        assert_ne!(after, before);
        assert!(
            after.contains("@dns-6-any-443 tcp dport 443 accept"),
            "{after}"
        );
        assert!(!after.contains("@dns-6-all"), "{after}");
        assert_passes(&sb.ns, (PUBLIC_B, 8080));
        assert_dropped(&sb.ns, None, (PUBLIC_A, 443));

        // Overlapping networks with different ports (neither inside the other) take a
        // second layer; both apply.
        fw.update(
            6,
            &policy(&[("192.0.2.0/24:80", true), ("192.0.2.10:70-90/tcp", true)]),
        )
        .unwrap();
        let listed = run("nft", &["list", "table", "inet", "opendsec-e1"]);
        assert!(listed.contains("set x-6-1"), "{listed}");
        assert_passes(&sb.ns, (PUBLIC_A, 80));
        assert_dropped(&sb.ns, None, (PUBLIC_A, 443));
        assert_dropped(&sb.ns, None, (PUBLIC_B, 8080));

        // Back to one layer: the rules stay (elements only), the second layer is emptied.
        let two = rules_with_handles("out-6");
        fw.update(6, &policy(&[("192.0.2.10:80", true)])).unwrap();
        assert_eq!(rules_with_handles("out-6"), two);
        let second = run("nft", &["list", "set", "inet", "opendsec-e1", "x-6-1"]);
        assert!(!second.contains("elements"), "{second}");
        assert_passes(&sb.ns, (PUBLIC_A, 80));
        assert_dropped(&sb.ns, None, (PUBLIC_A, 8080));
        drop(sb);
        drop(w);
    });
}

#[test]
fn forged_sources_inbound_connections_and_taking_a_rule_back() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let _w = world();
        let fw = firewall();
        // Both allow 10.0.0.0/8, their neighbours' addresses included: still no
        // connection between them may open, in either direction.
        let (a, a_addr) = sandbox(&fw, 1, &[("*", true), ("10.0.0.0/8", true)]).await;
        let (b, b_addr) = sandbox(&fw, 2, &[("*", true), ("10.0.0.0/8", true)]).await;

        // New connections into a sandbox: from another sandbox (TCP, and UDP, which would
        // need no reply to arrive) and from the host.
        serve_echo(&a.ns, &[9000]);
        assert_dropped(&b.ns, None, (a_addr, 9000));
        let udp = common::netns::record_udp(&a.ns, 9001);
        in_ns(&b.ns, move || {
            Box::pin(async move {
                let s = tokio::net::UdpSocket::bind("0.0.0.0:0").await.unwrap();
                s.send_to(b"hello", (a_addr, 9001)).await.unwrap();
            })
        })
        .join()
        .unwrap();
        assert!(
            udp.recv_timeout(DROPPED_AFTER).is_err(),
            "a datagram from a neighbour arrived"
        );
        match exchange(
            &File::open("/proc/thread-self/ns/net").unwrap(),
            None,
            SocketAddrV4::new(a_addr, 9000),
        ) {
            Err(e) if e.kind() == ErrorKind::TimedOut => {}
            other => panic!("host → sandbox: expected dropped, got {other:?}"),
        }

        // (Last, as it gives `a` its neighbour's address, which would spoil the above.)
        // Root in a sandbox gives itself another address (its neighbour's, or any in the
        // subnet) and sends from it: nothing passes.
        a.ip_do(&["addr", "add", &format!("{b_addr}/32"), "dev", "eth0"]);
        a.ip_do(&["addr", "add", "10.88.7.7/32", "dev", "eth0"]);
        assert_passes(&a.ns, (PUBLIC_A, 80));
        assert_dropped(&a.ns, Some(b_addr), (PUBLIC_A, 80));
        assert_dropped(&a.ns, Some("10.88.7.7".parse().unwrap()), (PUBLIC_A, 80));

        // Taking a rule back cuts an open connection at once.
        let ns = a.ns.try_clone().unwrap();
        let (go_tx, go_rx) = tokio::sync::oneshot::channel::<()>();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let conn = in_ns(&ns, move || {
            Box::pin(async move {
                let mut s = tokio::net::TcpStream::connect((PUBLIC_A, 80))
                    .await
                    .unwrap();
                let mut buf = [0u8; 5];
                s.write_all(b"ping\n").await.unwrap();
                s.read_exact(&mut buf).await.unwrap();
                ready_tx.send(()).unwrap();
                go_rx.await.unwrap();
                s.write_all(b"pong\n").await.unwrap();
                tokio::time::timeout(DROPPED_AFTER, s.read_exact(&mut buf)).await
            })
        });
        ready_rx.recv().unwrap();
        fw.update(1, &policy(&[])).unwrap();
        go_tx.send(()).unwrap();
        assert!(
            conn.join().unwrap().is_err(),
            "the echo came back after the update"
        );
        assert_dropped(&a.ns, None, (PUBLIC_A, 80));
        // And given back, new connections pass again.
        fw.update(1, &policy(&[("192.0.2.0/24", true)])).unwrap();
        assert_passes(&a.ns, (PUBLIC_A, 80));
        assert_dropped(&a.ns, None, (PUBLIC_B, 80));

        // A restarted edge rewrites its base chains; the sandboxes keep their rules.
        fw.install_base().unwrap();
        assert_passes(&a.ns, (PUBLIC_A, 80));
        assert_passes(&b.ns, (PUBLIC_B, 80));
    });
}

#[test]
fn detach_leaves_nothing_of_the_sandbox() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let fw = firewall();
        let base = run("nft", &["list", "table", "inet", "opendsec-e1"]);
        let (sb, _) = sandbox(
            &fw,
            7,
            &[
                ("github.com:443", true),
                ("pypi.org", true),
                ("192.0.2.0/24", true),
            ],
        )
        .await;
        let listed = run("nft", &["list", "table", "inet", "opendsec-e1"]);
        for want in [
            "set dns-7-any-443",
            "set dns-7-all",
            "chain out-7",
            "chain in-7",
            // Its veth and address in the guard set, its chains in the maps.
            "elements = { \"odsv0a58001c\" . 10.88.0.30 }",
            "\"odsv0a58001c\" : jump out-7",
            "\"odsv0a58001c\" : jump in-7",
            "ip daddr . meta l4proto . th dport @x-7-0 accept",
            "192.0.2.0/24 . 0-255 . 0-65535",
            "ip daddr @private drop",
            "ip daddr . meta l4proto . th dport @s-7 accept",
            "ip daddr @dns-7-all accept",
            // DNS goes to the gateway of the sender's /30.
            "udp dport 53 dnat ip to ip saddr & 255.255.255.253 | 0.0.0.1:15353",
            // ICMP errors about its own connections reach it whatever the port limits.
            "meta l4proto icmp ct state related accept",
        ] {
            assert!(listed.contains(want), "no {want:?} in:\n{listed}");
        }
        assert_eq!(fw.slots().unwrap(), [7]);
        assert!(fw.detach(7).unwrap());
        assert!(!fw.detach(7).unwrap());
        assert_eq!(fw.slots().unwrap(), Vec::<u32>::new());
        let after = run("nft", &["list", "table", "inet", "opendsec-e1"]);
        assert_eq!(after, base, "the table differs from before the sandbox");
        drop(sb);
        assert!(fw.remove().unwrap());
        assert!(!fw.remove().unwrap());
    });
}

#[test]
fn a_released_slot_is_the_last_handed_out_again() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(None, || async {
        // Four slots in a /28.
        let subnet = "10.88.0.0/28".parse().unwrap();
        let net = opendsec::netpol::network::Network::start(
            "e1",
            subnet,
            DNS_PORT,
            ClusterRules::default(),
        )
        .unwrap();
        assert_eq!(net.reserve().unwrap(), 0);
        assert_eq!(net.reserve().unwrap(), 1);
        net.release(0).await.unwrap();
        // Not 0 again at once: the kernel may still track its address's connections.
        assert_eq!(net.reserve().unwrap(), 2);
        assert_eq!(net.reserve().unwrap(), 3);
        assert_eq!(net.reserve().unwrap(), 0);
        let e = net.reserve().unwrap_err().to_string();
        assert_eq!(
            e,
            "sandbox network 10.88.0.0/28: all 4 addresses are in use"
        );
        net.release(2).await.unwrap();
        assert_eq!(net.reserve().unwrap(), 2);
        assert!(net.shutdown().await.is_ok());
    });
}

#[test]
fn an_update_after_the_table_changed_behind_the_edge_applies_from_what_the_table_holds() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let w = world();
        let fw = firewall();
        let (sb, _) = sandbox(
            &fw,
            3,
            &[("public.test:8080", true), ("192.0.2.10:80", true)],
        )
        .await;
        // The edge remembers writing dns-3-any-8080; an operator removed it by hand.
        run("nft", &["flush", "chain", "inet", "opendsec-e1", "out-3"]);
        run("nft", &["flush", "chain", "inet", "opendsec-e1", "in-3"]);
        run(
            "nft",
            &["delete", "set", "inet", "opendsec-e1", "dns-3-any-8080"],
        );
        // The update's deletion of that set is refused (ENOENT); the edge then asks the
        // table what the slot has and applies the update against that.
        fw.update(3, &policy(&[("198.51.100.10:8080", true)]))
            .unwrap();
        assert_passes(&sb.ns, (PUBLIC_B, 8080));
        assert_dropped(&sb.ns, None, (PUBLIC_A, 80));
        // And the next update knows the table again.
        fw.update(3, &policy(&[("192.0.2.10:80", true)])).unwrap();
        assert_passes(&sb.ns, (PUBLIC_A, 80));
        assert_dropped(&sb.ns, None, (PUBLIC_B, 8080));
        drop(sb);
        drop(w);
    });
}

#[test]
fn a_restarted_edge_replaces_what_the_table_holds_of_a_slot() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(None, || async {
        let fw = firewall();
        let (sb, addr) = sandbox(&fw, 4, &[("192.0.2.10:80", true)]).await;
        let (other, _) = sandbox(&fw, 5, &[]).await;
        // A new edge process over the same table: it knows nothing of slot 4 but what the
        // table says, and its attach (adoption) must replace, not add to, the slot's rules.
        let fw2 = firewall();
        let plan = LinkPlan::new(DEFAULT_SUBNET, 4).unwrap();
        fw2.attach(&plan.addrs, &policy(&[("198.51.100.10", true)]))
            .unwrap();
        let table = run("nft", &["list", "table", "inet", "opendsec-e1"]);
        let veth = opendsec::netpol::host_veth_name(plan.addrs.network);
        for want in [
            format!("\"{veth}\" . {addr}"),
            format!("\"{veth}\" : jump out-4"),
        ] {
            assert_eq!(table.matches(&want).count(), 1, "{want:?} in:\n{table}");
        }
        assert!(
            !table.contains("192.0.2.10"),
            "the old policy is gone:\n{table}"
        );
        // A slot it has written and removed is written again from nothing.
        assert!(fw2.detach(4).unwrap());
        fw2.attach(&plan.addrs, &policy(&[])).unwrap();
        let table = run("nft", &["list", "table", "inet", "opendsec-e1"]);
        assert_eq!(table.matches(&format!("\"{veth}\" . {addr}")).count(), 1);
        assert_eq!(fw2.slots().unwrap(), [4, 5]);
        drop((sb, other));
    });
}

#[test]
fn sandboxes_attached_and_detached_at_once_all_succeed_and_leave_nothing() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(None, || async {
        let fw = firewall();
        let base = run("nft", &["list", "table", "inet", "opendsec-e1"]);
        // Eight sandboxes' lifecycles at once, and the edge's cleanup listing meanwhile:
        // every listing a concurrent change interrupts (the kernel flags the dump) is read
        // again, so none of them fails.
        let mut threads = Vec::new();
        for t in 0..8u32 {
            let fw = fw.clone();
            threads.push(std::thread::spawn(move || {
                for round in 0..15u32 {
                    let slot = 100 + t * 20 + round;
                    let addrs = LinkPlan::new(DEFAULT_SUBNET, slot).unwrap().addrs;
                    fw.attach(
                        &addrs,
                        &policy(&[("pypi.org:443", true), ("192.0.2.0/24", true)]),
                    )
                    .unwrap_or_else(|e| panic!("attach {slot}: {e}"));
                    assert!(fw
                        .detach(slot)
                        .unwrap_or_else(|e| panic!("detach {slot}: {e}")));
                }
            }));
        }
        let lister = {
            let fw = fw.clone();
            std::thread::spawn(move || {
                for _ in 0..40 {
                    fw.slots().unwrap_or_else(|e| panic!("slots: {e}"));
                }
            })
        };
        for t in threads {
            t.join().unwrap();
        }
        lister.join().unwrap();
        assert_eq!(fw.slots().unwrap(), Vec::<u32>::new());
        assert_eq!(run("nft", &["list", "table", "inet", "opendsec-e1"]), base);
    });
}

#[test]
fn a_release_that_failed_is_tried_again_until_it_goes() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(None, || async {
        let net = std::sync::Arc::new(
            opendsec::netpol::network::Network::start(
                "e1",
                DEFAULT_SUBNET,
                DNS_PORT,
                ClusterRules::default(),
            )
            .unwrap(),
        );
        let sb = SandboxNs::start();
        let slot = net.reserve().unwrap();
        let a = net
            .attach(sb.ns.as_fd(), slot, &policy(&[("192.0.2.10", true)]))
            .await
            .unwrap();
        let veth = a.host_name.clone();
        // A jump from a chain the edge does not know pins the sandbox's chain: the kernel
        // refuses to delete it (EBUSY), so the release fails, as one does when the edge is
        // short of memory or file descriptors.
        run("nft", &["add", "chain", "inet", "opendsec-e1", "pin"]);
        let out = format!("out-{slot}");
        run(
            "nft",
            &["add", "rule", "inet", "opendsec-e1", "pin", "jump", &out],
        );
        let e = net.release(slot).await.unwrap_err().to_string();
        assert!(e.contains("Device or resource busy"), "{e}");
        assert!(
            net.is_held(slot),
            "a slot whose release failed is not handed out"
        );

        let pause = std::time::Duration::from_millis(200);
        net.release_later(slot, &[pause; 50]);
        tokio::time::sleep(pause * 3).await;
        assert!(net.is_held(slot), "released while still pinned");
        run("nft", &["flush", "chain", "inet", "opendsec-e1", "pin"]);
        let end = std::time::Instant::now() + pause * 20;
        while net.is_held(slot) && std::time::Instant::now() < end {
            tokio::time::sleep(pause / 4).await;
        }
        assert!(!net.is_held(slot), "the release was not tried again");
        let table = run("nft", &["list", "table", "inet", "opendsec-e1"]);
        assert!(!table.contains(&out), "{out} is left:\n{table}");
        let links = run("ip", &["-o", "link"]);
        assert!(!links.contains(&veth), "{veth} is left:\n{links}");
        drop(sb);
    });
}

/// An ICMP echo from inside netns `ns` (its pid) to `to`: "reply" or "timeout". A raw
/// socket, as any sandbox root has.
fn ping(sb: &SandboxNs, to: Ipv4Addr) -> String {
    const PING: &str = r#"
import socket, struct, sys
def csum(b):
    s = sum(struct.unpack('!%dH' % (len(b) // 2), b))
    s = (s >> 16) + (s & 0xffff)
    s += s >> 16
    return ~s & 0xffff
body = struct.pack('!HH', 0x4242, 1) + b'opendsec'
pkt = struct.pack('!BBH', 8, 0, csum(struct.pack('!BBH', 8, 0, 0) + body)) + body
s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
s.settimeout(1.5)
s.sendto(pkt, (sys.argv[1], 0))
try:
    while True:
        d, a = s.recvfrom(2048)
        if a[0] == sys.argv[1] and d[(d[0] & 15) * 4] == 0:
            print('reply')
            break
except socket.timeout:
    print('timeout')
"#;
    let pid = sb.pid();
    let to = to.to_string();
    run("nsenter", &["-t", &pid, "-n", "python3", "-c", PING, &to])
        .trim()
        .to_string()
}

/// Whether a datagram of [`send_udp`] reached the recorder.
fn arrived(udp: &std::sync::mpsc::Receiver<(std::net::SocketAddr, Vec<u8>)>) -> bool {
    udp.recv_timeout(DROPPED_AFTER)
        .is_ok_and(|(_, payload)| payload == b"datagram")
}

/// Sends one UDP datagram from `ns` to `to`.
fn send_udp(ns: &File, to: (Ipv4Addr, u16)) {
    in_ns(ns, move || {
        Box::pin(async move {
            let s = tokio::net::UdpSocket::bind("0.0.0.0:0").await.unwrap();
            s.send_to(b"datagram", to).await.unwrap();
        })
    })
    .join()
    .unwrap();
}

#[test]
fn udp_icmp_port_protocols_and_the_ranges_star_leaves_out() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let w = world();
        // Cloud metadata and carrier-grade NAT addresses, served like the rest.
        for a in ["169.254.169.254/32", "100.64.0.10/32"] {
            w.internet.ip_do(&["addr", "add", a, "dev", "lo"]);
        }
        let udp = common::netns::record_udp(&w.internet.ns, 5353);
        let fw = firewall();

        // Nothing allowed: no UDP, no ICMP.
        let (none, _) = sandbox(&fw, 1, &[]).await;
        send_udp(&none.ns, (PUBLIC_A, 5353));
        assert!(!arrived(&udp), "a datagram got out of a deny-all sandbox");
        assert_eq!(ping(&none, PUBLIC_A), "timeout");

        // An address without a port limit: every protocol, ICMP included.
        let (addr, _) = sandbox(&fw, 2, &[("192.0.2.10", true)]).await;
        send_udp(&addr.ns, (PUBLIC_A, 5353));
        assert!(arrived(&udp));
        assert_eq!(ping(&addr, PUBLIC_A), "reply");
        assert_eq!(ping(&addr, PUBLIC_B), "timeout");

        // `:port/udp`: that port over UDP only; not TCP, not ICMP.
        let (udp_only, _) = sandbox(&fw, 3, &[("192.0.2.10:5353/udp", true)]).await;
        send_udp(&udp_only.ns, (PUBLIC_A, 5353));
        assert!(arrived(&udp));
        assert_dropped(&udp_only.ns, None, (PUBLIC_A, 80));
        assert_eq!(ping(&udp_only, PUBLIC_A), "timeout");

        // `*` is public addresses only: not cloud metadata, not 100.64/10, not private.
        let metadata = Ipv4Addr::new(169, 254, 169, 254);
        let cgnat = Ipv4Addr::new(100, 64, 0, 10);
        let (star, _) = sandbox(&fw, 4, &[("*", true)]).await;
        assert_passes(&star.ns, (PUBLIC_B, 80));
        assert_eq!(ping(&star, PUBLIC_B), "reply");
        for private in [metadata, cgnat, PRIVATE] {
            assert_dropped(&star.ns, None, (private, 80));
            assert_eq!(ping(&star, private), "timeout", "{private}");
        }
        // Named outright, a private address is reachable.
        let (named, _) = sandbox(&fw, 5, &[("169.254.169.254:80", true)]).await;
        assert_passes(&named.ns, (metadata, 80));
        assert_dropped(&named.ns, None, (cgnat, 80));
    });
}

#[test]
fn two_hundred_sandboxes_come_and_go_leaving_nothing() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let net = opendsec::netpol::network::Network::start(
            "e1",
            DEFAULT_SUBNET,
            DNS_PORT,
            ClusterRules::default(),
        )
        .unwrap();
        let base = run("nft", &["list", "table", "inet", "opendsec-e1"]);
        let rules: std::collections::BTreeMap<String, bool> = [
            ("pypi.org", true),
            ("github.com:443/tcp", true),
            ("192.0.2.0/24:80", true),
            ("*:8443", true),
        ]
        .iter()
        .map(|(k, v)| (k.to_string(), *v))
        .collect();
        let policy = net.policy(&rules).unwrap();
        let mut live = Vec::new();
        for _ in 0..200 {
            let sb = SandboxNs::start();
            let slot = net.reserve().unwrap();
            net.attach(sb.ns.as_fd(), slot, &policy).await.unwrap();
            live.push((sb, slot));
        }
        assert_eq!(net.firewall().slots().unwrap().len(), 200);
        let listed = run("nft", &["list", "table", "inet", "opendsec-e1"]);
        assert!(
            listed.contains("set dns-199-tcp-443"),
            "no sets of the last slot"
        );
        for (sb, slot) in live {
            net.release(slot).await.unwrap();
            drop(sb);
        }
        assert!(net.firewall().slots().unwrap().is_empty());
        assert_eq!(
            run("nft", &["list", "table", "inet", "opendsec-e1"]),
            base,
            "chains, sets or rules of a sandbox are left"
        );
        let links = run("ip", &["-o", "link", "show"]);
        assert!(!links.contains("odsv"), "veths left:\n{links}");
        let addrs = run("ip", &["-o", "-4", "addr", "show"]);
        assert!(!addrs.contains("10.88."), "addresses left:\n{addrs}");
        assert!(net.shutdown().await.unwrap());
    });
}

/// `count` rules of every kind at once: domains with a port each (a resolved set each),
/// networks with port ranges and plain addresses, none of which the test's servers have.
fn filler(count: usize) -> Vec<(String, bool)> {
    let mut rules = Vec::new();
    for i in 0..count {
        let rule = match i % 3 {
            0 => format!("d{i}.example:{}/tcp", 1000 + i),
            1 => format!("198.18.{}.0/24:{}-{}/tcp", i % 250, 2000 + i, 2100 + i),
            _ => format!("198.19.{}.{}", i / 250, i % 250),
        };
        rules.push((rule, true));
    }
    rules
}

#[test]
fn a_policy_of_the_most_rules_a_sandbox_may_have_applies_updates_and_goes() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let w = world();
        let fw = firewall();
        let base = run("nft", &["list", "table", "inet", "opendsec-e1"]);
        let max = opendsec::netpol::MAX_NETWORK_RULES;
        let with = |extra: &str| {
            let mut rules = filler(max - 1);
            rules.push((extra.to_string(), true));
            let rules: Vec<(&str, bool)> = rules.iter().map(|(k, v)| (k.as_str(), *v)).collect();
            policy(&rules)
        };

        // Attach: one transaction of a few thousand messages, far past the default netlink
        // buffers, which refused it (EMSGSIZE) or lost its acknowledgements (ENOBUFS).
        let sb = SandboxNs::start();
        let plan = LinkPlan::new(DEFAULT_SUBNET, 9).unwrap();
        let a = attach(sb.ns.as_fd(), &plan).await.unwrap();
        fw.attach(&a.addrs, &with("192.0.2.10:80")).unwrap();
        // Its networks are elements of one layer set (none of them overlap): two " . " each.
        let layer = run("nft", &["list", "set", "inet", "opendsec-e1", "x-9-0"]);
        let elements = layer.matches(" . ").count() / 2;
        assert!(
            elements >= 2 * (max - 1) / 3,
            "{elements} elements in x-9-0"
        );
        let sets = run("nft", &["list", "sets", "inet"]);
        assert!(
            sets.matches("set dns-9-").count() >= max / 3,
            "one resolved set per domain port"
        );
        assert_passes(&sb.ns, (PUBLIC_A, 80));
        assert_dropped(&sb.ns, None, (PUBLIC_A, 443));
        assert_dropped(&sb.ns, None, (PUBLIC_B, 8080));

        // Replaced whole by another policy as large: the new rule holds, the old one is gone.
        fw.update(9, &with("198.51.100.10:8080")).unwrap();
        assert_passes(&sb.ns, (PUBLIC_B, 8080));
        assert_dropped(&sb.ns, None, (PUBLIC_A, 80));

        // A change the kernel refuses (a resolved set the policy does not have) names the
        // refusal, changes nothing, and the table's next change goes through.
        let bad = opendsec::netpol::PortLimit::Ports(
            opendsec::netpol::PortRange::new(9, 9).unwrap(),
            Some(opendsec::netpol::Proto::Udp),
        );
        let e = fw
            .add_resolved(9, &[bad], &[Ipv4Addr::new(192, 0, 2, 10)], false)
            .unwrap_err();
        let shown = format!("{e}");
        assert!(
            matches!(
                e,
                opendsec::netpol::NftError::Commit {
                    source: opendsec::netpol::BatchError::Refused {
                        errno: nix::errno::Errno::ENOENT,
                        ..
                    },
                    ..
                }
            ),
            "{shown}"
        );
        assert_passes(&sb.ns, (PUBLIC_B, 8080));
        assert!(fw.detach(9).unwrap());
        assert_eq!(
            run("nft", &["list", "table", "inet", "opendsec-e1"]),
            base,
            "the table differs from before the sandbox"
        );
        drop(sb);
        drop(w);
    });
}
