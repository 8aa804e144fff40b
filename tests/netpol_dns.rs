//! The edge's DNS proxy (src/netpol/dns.rs, docs/network.md "DNS") against the real kernel,
//! in a world the test builds (tests/common/netns.rs): sandboxes attached through
//! `Network` as the edge does, the proxy on the host netns, and a test upstream in the
//! "internet" netns that logs every query it gets. Every case asserts the exact outcome.
//! Root only.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::net::{Ipv4Addr, SocketAddr};
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::Duration;

use common::dns::{ask, long_name, serve_upstream, Answer, QueryLog, UPSTREAM};
use common::netns::{
    assert_dropped, assert_passes, in_fresh_netns, world, SandboxNs, World, PRIVATE, PUBLIC_A,
    PUBLIC_B,
};
use hickory_server::proto::op::ResponseCode;
use hickory_server::proto::rr::RecordType;
use opendsec::netpol::dns::{DnsProxy, Upstream};
use opendsec::netpol::network::Network;
use opendsec::netpol::{ClusterRules, DEFAULT_SUBNET};

fn root_or_skip() -> bool {
    opendsec::sys::root_or_skip("the DNS proxy tests")
}

const DNS_PORT: u16 = 15353;

/// The world, its upstream's query log, the edge's network and its proxy.
struct Setup {
    w: World,
    log: QueryLog,
    net: Arc<Network>,
    _proxy: DnsProxy,
}

async fn setup() -> Setup {
    let w = world();
    let log = serve_upstream(&w.internet.ns);
    // Renewals after 2 s rather than 5 min, so that a test sees one.
    let net = Arc::new(
        Network::start("e1", DEFAULT_SUBNET, DNS_PORT, ClusterRules::default())
            .unwrap()
            .with_resolved_timings(Duration::from_secs(2), Duration::from_secs(3000)),
    );
    let proxy = DnsProxy::start(
        net.clone(),
        DNS_PORT,
        &Upstream::Servers(vec![SocketAddr::from((UPSTREAM, 53))]),
    )
    .await
    .unwrap();
    Setup {
        w,
        log,
        net,
        _proxy: proxy,
    }
}

fn at(a: Ipv4Addr) -> SocketAddr {
    SocketAddr::from((a, 53))
}

/// A sandbox attached with `rules`: its netns, its slot and its gateway.
async fn sandbox(net: &Network, rules: &[(&str, bool)]) -> (SandboxNs, u32, Ipv4Addr) {
    let sb = SandboxNs::start();
    let slot = net.reserve().unwrap();
    let rules: std::collections::BTreeMap<String, bool> =
        rules.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let policy = net.policy(&rules).unwrap();
    let a = net.attach(sb.ns.as_fd(), slot, &policy).await.unwrap();
    (sb, slot, a.addrs.gateway)
}

fn ok(records: &[&str]) -> Answer {
    Answer {
        code: ResponseCode::NoError,
        records: records.iter().map(|s| s.to_string()).collect(),
        truncated: false,
    }
}

fn nxdomain() -> Answer {
    Answer {
        code: ResponseCode::NXDomain,
        records: vec![],
        truncated: false,
    }
}

/// Seconds until `addr` leaves the resolved set `dns-<slot>-all`.
fn expires(slot: u32, addr: Ipv4Addr) -> u64 {
    let set = format!("dns-{slot}-all");
    let v = common::netns::json_of("nft", &["-j", "list", "set", "inet", "opendsec-e1", &set]);
    let elems = v["nftables"][1]["set"]["elem"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    elems
        .iter()
        .find(|e| e["elem"]["val"] == addr.to_string())
        .and_then(|e| e["elem"]["expires"].as_u64())
        .unwrap_or_else(|| panic!("{addr} is not in {set}: {v}"))
}

fn asked(log: &QueryLog) -> Vec<String> {
    log.lock().unwrap().iter().map(|(n, _)| n.clone()).collect()
}

#[test]
fn allowed_names_resolve_and_open_their_addresses_denied_names_never_leave() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let Setup {
            w,
            log,
            net,
            _proxy,
        } = setup().await;
        let (sb, _, gw) = sandbox(
            &net,
            &[
                ("public.test", true),
                ("mixed.test", true),
                ("private.test", true),
                ("alias.test", true),
            ],
        )
        .await;

        // Before any answer, nothing is reachable.
        assert_dropped(&sb.ns, None, (PUBLIC_A, 80));
        assert_dropped(&sb.ns, None, (PUBLIC_B, 80));

        // An allowed name (asking the gateway, as resolv.conf says): answered, and its
        // address passes at once, with no wait after the answer.
        let a = ask(&sb.ns, at(gw), "public.test.", RecordType::A, false).unwrap();
        assert_eq!(a, ok(&["A 192.0.2.10"]));
        assert_passes(&sb.ns, (PUBLIC_A, 80));
        // Resolved again at once, it is left alone (no netlink exchange); resolved again
        // after the renewal age (2 s here, 5 min in an edge), its hour starts again.
        let before = expires(0, PUBLIC_A);
        std::thread::sleep(Duration::from_millis(1100));
        let a = ask(&sb.ns, at(gw), "public.test.", RecordType::A, false).unwrap();
        assert_eq!(a, ok(&["A 192.0.2.10"]));
        assert!(expires(0, PUBLIC_A) < before, "renewed before its time");
        std::thread::sleep(Duration::from_millis(1500));
        let a = ask(&sb.ns, at(gw), "public.test.", RecordType::A, false).unwrap();
        assert_eq!(a, ok(&["A 192.0.2.10"]));
        std::thread::sleep(Duration::from_millis(500));
        let after = expires(0, PUBLIC_A);
        // Not renewed, 3.1 s would have passed off it. nft shows whole seconds, cut down, and
        // the renewal came half a second ago: one second less is still renewed.
        assert!(
            after + 1 >= before,
            "not renewed: {before} s, then {after} s"
        );
        // Subdomains of an allowed domain are allowed.
        let a = ask(&sb.ns, at(gw), "sub.public.test.", RecordType::A, true).unwrap();
        assert_eq!(a, ok(&["A 192.0.2.10"]));

        // A name that is not allowed: NXDOMAIN, over UDP and TCP, and the upstream never
        // hears of it; nor of a parent of an allowed name.
        for tcp in [false, true] {
            for name in ["denied.test.", "secret-data.exfil.test.", "test."] {
                let a = ask(&sb.ns, at(gw), name, RecordType::A, tcp).unwrap();
                assert_eq!(a, nxdomain(), "{name} tcp={tcp}");
                let a = ask(&sb.ns, at(gw), name, RecordType::TXT, tcp).unwrap();
                assert_eq!(a, nxdomain(), "{name} TXT tcp={tcp}");
            }
        }
        // A label with a dot in it reads like an allowed name once printed, but is not one.
        for (name, tcp) in [
            ("x\\.public.test.", false),
            ("secret\\.sub.public.test.", true),
        ] {
            let a = ask(&sb.ns, at(gw), name, RecordType::A, tcp).unwrap();
            assert_eq!(a, nxdomain(), "{name}");
        }
        let upstream_saw = asked(&log);
        assert!(
            upstream_saw.iter().all(|n| !n.contains('\\')
                && !n.starts_with("x.public")
                && !n.starts_with("secret.sub")),
            "{upstream_saw:?}"
        );
        for n in ["denied.test", "secret-data.exfil.test", "test"] {
            assert!(
                !upstream_saw.contains(&n.to_string()),
                "{n} reached the upstream: {upstream_saw:?}"
            );
        }

        // DNS rebinding: a private answer is shown but never opened; a mixed answer opens
        // only its public address.
        let a = ask(&sb.ns, at(gw), "private.test.", RecordType::A, false).unwrap();
        assert_eq!(a, ok(&["A 10.30.0.10"]));
        assert_dropped(&sb.ns, None, (PRIVATE, 80));
        let a = ask(&sb.ns, at(gw), "mixed.test.", RecordType::A, false).unwrap();
        assert_eq!(a, ok(&["A 198.51.100.10", "A 10.30.0.10"]));
        assert_passes(&sb.ns, (PUBLIC_B, 80));
        assert_dropped(&sb.ns, None, (PRIVATE, 80));

        // A CNAME chain: the final addresses count for the name asked.
        let a = ask(&sb.ns, at(gw), "alias.test.", RecordType::A, false).unwrap();
        assert_eq!(a, ok(&["CNAME public.test.", "A 192.0.2.10"]));

        // No IPv6: AAAA of an allowed name is empty, and not asked upstream.
        let before = log.lock().unwrap().len();
        let a = ask(&sb.ns, at(gw), "public.test.", RecordType::AAAA, false).unwrap();
        assert_eq!(a, ok(&[]));
        assert_eq!(log.lock().unwrap().len(), before);

        // Queries to any other resolver are answered by the proxy, by the same rules: the
        // test upstream itself and an address with no DNS server at all.
        for server in [UPSTREAM, PUBLIC_B, Ipv4Addr::new(203, 0, 113, 99)] {
            let a = ask(&sb.ns, at(server), "denied.test.", RecordType::A, false).unwrap();
            assert_eq!(a, nxdomain(), "via {server}");
            let a = ask(&sb.ns, at(server), "public.test.", RecordType::A, true).unwrap();
            assert_eq!(a, ok(&["A 192.0.2.10"]), "via {server} over TCP");
        }
        assert!(!asked(&log).contains(&"denied.test".to_string()));
        drop(w);
    });
}

#[test]
fn port_limits_star_long_names_and_strangers() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let Setup {
            w,
            log,
            net,
            _proxy,
        } = setup().await;

        // A port limit on a domain holds for the addresses it resolves to.
        let (limited, _, gw) = sandbox(&net, &[("public.test:8080/tcp", true)]).await;
        let a = ask(&limited.ns, at(gw), "public.test.", RecordType::A, false).unwrap();
        assert_eq!(a, ok(&["A 192.0.2.10"]));
        assert_passes(&limited.ns, (PUBLIC_A, 8080));
        assert_dropped(&limited.ns, None, (PUBLIC_A, 80));
        // What one sandbox resolved opens nothing for another.
        let (other, _, gw2) = sandbox(&net, &[("other.test", true)]).await;
        assert_dropped(&other.ns, None, (PUBLIC_A, 8080));
        let a = ask(&other.ns, at(gw2), "public.test.", RecordType::A, false).unwrap();
        assert_eq!(a, nxdomain());

        // `*`: every name resolves (the longest a name can be included), public addresses
        // pass, private ones do not.
        let (star, _, gw3) = sandbox(&net, &[("*", true)]).await;
        let long = format!("{}.", long_name());
        let a = ask(&star.ns, at(gw3), &long, RecordType::A, true).unwrap();
        assert_eq!(a, ok(&["A 198.51.100.10"]));
        // Over UDP without EDNS the answer exceeds 512 bytes: truncated, as a resolver
        // expects before it asks again over TCP.
        let a = ask(&star.ns, at(gw3), &long, RecordType::A, false).unwrap();
        assert!(a.truncated && a.code == ResponseCode::NoError, "{a:?}");
        let a = ask(&star.ns, at(gw3), "private.test.", RecordType::A, true).unwrap();
        assert_eq!(a, ok(&["A 10.30.0.10"]));
        assert_dropped(&star.ns, None, (PRIVATE, 80));
        let a = ask(&star.ns, at(gw3), "nowhere.test.", RecordType::A, false).unwrap();
        assert_eq!(a, nxdomain(), "the upstream's own NXDOMAIN passes through");
        assert!(asked(&log).contains(&"nowhere.test".to_string()));

        // Nothing but a sandbox reaches the proxy: not the host itself.
        let host = std::fs::File::open("/proc/thread-self/ns/net").unwrap();
        let e = ask(
            &host,
            SocketAddr::from((gw, DNS_PORT)),
            "public.test.",
            RecordType::A,
            false,
        )
        .unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::TimedOut);

        // A sandbox that is gone gets no answers, and its addresses no longer pass.
        let (gone, slot, gw4) = sandbox(&net, &[("public.test", true)]).await;
        let a = ask(&gone.ns, at(gw4), "public.test.", RecordType::A, false).unwrap();
        assert_eq!(a, ok(&["A 192.0.2.10"]));
        net.release(slot).await.unwrap();
        assert!(net
            .sandbox_policy(Ipv4Addr::from(u32::from(gw4) + 1))
            .is_none());
        drop(w);
    });
}

#[test]
fn a_sandbox_flooding_the_proxy_over_tcp_holds_a_few_connections_and_others_are_served() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let Setup {
            w,
            log: _,
            net,
            _proxy,
        } = setup().await;
        let (flooder, _, gw) = sandbox(&net, &[("public.test", true)]).await;
        let (other, _, gw2) = sandbox(&net, &[("public.test", true)]).await;
        let other_ns = other.ns.try_clone().unwrap();
        // Warm: the resolver's own sockets are open before the count.
        for tcp in [false, true] {
            let a = ask(&flooder.ns, at(gw), "public.test.", RecordType::A, tcp).unwrap();
            assert_eq!(a, ok(&["A 192.0.2.10"]));
        }
        let fds_before = std::fs::read_dir("/proc/self/fd").unwrap().count();

        // 600 connections at once, to "servers" all over a documentation range: DNS to any
        // address reaches the proxy. Only PER_SOURCE of them stay open; the proxy closes the rest
        // as it accepts them, and another sandbox is answered over TCP meanwhile.
        let (made, open, other_answer) = common::netns::in_ns(&flooder.ns, move || {
            Box::pin(async move {
                use tokio::io::AsyncReadExt;
                let mut conns = Vec::new();
                for i in 0..600u32 {
                    let to = SocketAddr::from((Ipv4Addr::new(192, 0, 2, 1 + (i % 250) as u8), 53));
                    let c = tokio::time::timeout(
                        Duration::from_secs(5),
                        tokio::net::TcpStream::connect(to),
                    );
                    if let Ok(Ok(s)) = c.await {
                        conns.push(s);
                    }
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
                let mut open = 0;
                for s in &mut conns {
                    let mut b = [0u8; 1];
                    let r = tokio::time::timeout(Duration::from_millis(20), s.read(&mut b));
                    if r.await.is_err() {
                        open += 1;
                    }
                }
                let answer = ask(&other_ns, at(gw2), "public.test.", RecordType::A, true);
                (conns.len(), open, answer)
            })
        })
        .join()
        .unwrap();
        assert_eq!(made, 600, "the proxy accepts (and closes) every connection");
        assert_eq!(open, 4, "at most PER_SOURCE connections stay open");
        assert_eq!(other_answer.unwrap(), ok(&["A 192.0.2.10"]));

        // Once the flood is gone, its places are free again and nothing of it is left.
        let a = ask(&flooder.ns, at(gw), "public.test.", RecordType::A, true).unwrap();
        assert_eq!(a, ok(&["A 192.0.2.10"]));
        let a = ask(&flooder.ns, at(gw), "public.test.", RecordType::A, false).unwrap();
        assert_eq!(a, ok(&["A 192.0.2.10"]));
        // The proxy's tasks close what the flood left as they are scheduled: on a loaded
        // machine that takes a while, so the count is awaited rather than timed.
        let mut fds_after = usize::MAX;
        for _ in 0..100 {
            fds_after = std::fs::read_dir("/proc/self/fd").unwrap().count();
            if fds_after <= fds_before + 2 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(
            fds_after <= fds_before + 2,
            "file descriptors: {fds_before} before, {fds_after} 10 s after"
        );
        drop(w);
    });
}
