//! The sandbox network topology (src/netpol/link.rs) against the real kernel: veth pairs,
//! addresses, routes and IPv6 off, made over rtnetlink, checked with `ip -j` from iproute2.
//! Each test builds its own world and never touches the machine's interfaces: its "host" is a
//! fresh network namespace that a dedicated thread unshares (every netlink socket and `ip`
//! run of the test comes from that thread), and each "sandbox" is an `unshare -n sleep`
//! child whose `/proc/PID/ns/net` is opened. Needs root; under CI=true a missing privilege
//! fails the test.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

mod common;

use std::fs::File;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use common::netns::{addrs, host_ip, host_ip_do, in_fresh_netns, inet, link, names, SandboxNs};
use nix::sched::CloneFlags;
use opendsec::netpol::link::{Ipv6, LinkError};
use opendsec::netpol::{
    attach, detach, list_strays, slot_count, Ipv4Net, LinkPlan, DEFAULT_SUBNET,
};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn root_or_skip() -> bool {
    opendsec::sys::root_or_skip("the network topology tests")
}

fn flags(links: &Value, name: &str) -> Vec<String> {
    link(links, name)["flags"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect()
}

fn os_error(e: &LinkError) -> Option<i32> {
    use std::error::Error;
    e.source()
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .and_then(|io| io.raw_os_error())
}

/// Connects from inside `ns` to `to` and exchanges a line, on a thread of its own (which
/// enters the netns and then ends).
fn connect_from(ns: &File, to: SocketAddr) -> std::thread::JoinHandle<std::io::Result<Vec<u8>>> {
    let ns = ns.try_clone().unwrap();
    std::thread::spawn(move || {
        nix::sched::setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
        let mut s = TcpStream::connect_timeout(&to, Duration::from_secs(10))?;
        s.set_read_timeout(Some(Duration::from_secs(10)))?;
        s.write_all(b"ping\n")?;
        let mut buf = vec![0u8; 5];
        s.read_exact(&mut buf)?;
        Ok(buf)
    })
}

#[test]
fn attach_links_the_sandbox_and_detach_removes_everything() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(None, || async {
        let sb = SandboxNs::start();
        let plan = LinkPlan::new(DEFAULT_SUBNET, 1).unwrap();
        let a = attach(sb.ns.as_fd(), &plan).await.unwrap();
        assert_eq!(a.host_name, "odsv0a580004");
        assert_eq!(a.addrs.gateway, Ipv4Addr::new(10, 88, 0, 5));
        assert_eq!(a.addrs.sandbox, Ipv4Addr::new(10, 88, 0, 6));
        assert_eq!(a.ipv6, Ipv6::Off);

        // The sandbox: lo and eth0, up; eth0 has its /30 and nothing else (no IPv6).
        let links = sb.ip(&["addr", "show"]);
        assert_eq!(names(&links), ["eth0", "lo"]);
        assert_eq!(addrs(&links, "eth0"), [inet("10.88.0.6", 30)]);
        assert_eq!(
            link(&links, "eth0")["ifindex"].as_u64(),
            Some(u64::from(a.sandbox_index))
        );
        assert!(flags(&links, "eth0").contains(&"UP".to_string()));
        assert!(flags(&links, "eth0").contains(&"LOWER_UP".to_string()));
        assert!(flags(&links, "lo").contains(&"UP".to_string()));
        assert!(addrs(&links, "lo").contains(&inet("127.0.0.1", 8)));
        let routes: Vec<(String, String, String)> = sb
            .ip(&["-4", "route", "show"])
            .as_array()
            .unwrap()
            .iter()
            .map(|r| {
                (
                    r["dst"].as_str().unwrap().to_string(),
                    r["gateway"].as_str().unwrap_or("").to_string(),
                    r["dev"].as_str().unwrap().to_string(),
                )
            })
            .collect();
        assert_eq!(
            routes,
            [
                ("default".into(), "10.88.0.5".into(), "eth0".into()),
                ("10.88.0.4/30".into(), String::new(), "eth0".into()),
            ]
        );
        let v6_on_eth0: Vec<Value> = sb
            .ip(&["-6", "route", "show"])
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["dev"] == "eth0")
            .cloned()
            .collect();
        assert!(v6_on_eth0.is_empty(), "{v6_on_eth0:?}");
        assert_eq!(sb.read("/proc/sys/net/ipv6/conf/eth0/disable_ipv6"), "1");
        let eth0 = sb.ip(&["-d", "link", "show", "eth0"]);
        assert_eq!(eth0[0]["inet6_addr_gen_mode"], "none");
        assert_eq!(eth0[0]["linkinfo"]["info_kind"], "veth");

        // The host side: the gateway address only, IPv6 off there too.
        let host = host_ip(&["addr", "show"]);
        assert_eq!(names(&host), ["lo", "odsv0a580004"]);
        assert_eq!(addrs(&host, "odsv0a580004"), [inet("10.88.0.5", 30)]);
        assert_eq!(
            link(&host, "odsv0a580004")["ifindex"].as_u64(),
            Some(u64::from(a.host_index))
        );
        assert!(flags(&host, "odsv0a580004").contains(&"LOWER_UP".to_string()));
        assert_eq!(
            std::fs::read_to_string("/proc/sys/net/ipv6/conf/odsv0a580004/disable_ipv6")
                .unwrap()
                .trim(),
            "1"
        );
        // The host's veth answers ARP for its gateway address only.
        for (key, want) in [("arp_ignore", "1"), ("arp_announce", "2")] {
            let path = format!("/proc/sys/net/ipv4/conf/odsv0a580004/{key}");
            assert_eq!(std::fs::read_to_string(path).unwrap().trim(), want, "{key}");
        }
        assert_eq!(
            host_ip(&["-d", "link", "show", "odsv0a580004"])[0]["inet6_addr_gen_mode"],
            "none"
        );
        // The sandbox's netns was never the host's: eth0 is not here.
        assert!(!names(&host).contains(&"eth0".to_string()));

        // Traffic: the sandbox connects to a listener on its gateway address in the host
        // netns, from its own address.
        let listener = tokio::net::TcpListener::bind((a.addrs.gateway, 0))
            .await
            .unwrap();
        let to = listener.local_addr().unwrap();
        let client = connect_from(&sb.ns, to);
        let (mut conn, peer) = tokio::time::timeout(Duration::from_secs(20), listener.accept())
            .await
            .expect("no connection from the sandbox")
            .unwrap();
        assert_eq!(peer.ip(), std::net::IpAddr::V4(a.addrs.sandbox));
        let mut line = [0u8; 5];
        conn.read_exact(&mut line).await.unwrap();
        assert_eq!(&line, b"ping\n");
        conn.write_all(b"pong\n").await.unwrap();
        assert_eq!(client.join().unwrap().unwrap(), b"pong\n");
        drop(conn);
        drop(listener);

        assert_eq!(list_strays("odsv").await.unwrap(), ["odsv0a580004"]);
        assert!(detach("odsv0a580004").await.unwrap());
        assert_eq!(names(&host_ip(&["link", "show"])), ["lo"]);
        assert_eq!(names(&sb.ip(&["link", "show"])), ["lo"]);
        // Idempotent.
        assert!(!detach("odsv0a580004").await.unwrap());
        assert!(list_strays("odsv").await.unwrap().is_empty());
    });
}

#[test]
fn a_name_clash_on_either_side_makes_nothing_and_removes_nothing() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        // The host-side name is taken (by a link that is not ours).
        let sb = SandboxNs::start();
        host_ip_do(&["link", "add", "odsv0a580008", "type", "bridge"]);
        let e = attach(sb.ns.as_fd(), &LinkPlan::new(DEFAULT_SUBNET, 2).unwrap())
            .await
            .unwrap_err();
        assert!(matches!(e, LinkError::CreateVeth { .. }), "{e:?}");
        assert_eq!(os_error(&e), Some(libc::EEXIST), "{e:?}");
        let host = host_ip(&["-d", "link", "show"]);
        assert_eq!(names(&host), ["lo", "odsv0a580008"]);
        assert_eq!(
            link(&host, "odsv0a580008")["linkinfo"]["info_kind"],
            "bridge"
        );
        assert_eq!(names(&sb.ip(&["link", "show"])), ["lo"]);
        // detach refuses what is not a veth, and leaves it.
        let e = detach("odsv0a580008").await.unwrap_err();
        assert!(matches!(e, LinkError::NotVeth { .. }), "{e:?}");
        assert_eq!(names(&host_ip(&["link", "show"])), ["lo", "odsv0a580008"]);

        // The sandbox already has an eth0.
        let sb2 = SandboxNs::start();
        sb2.ip_do(&["link", "add", "eth0", "type", "bridge"]);
        let e = attach(sb2.ns.as_fd(), &LinkPlan::new(DEFAULT_SUBNET, 3).unwrap())
            .await
            .unwrap_err();
        assert!(matches!(e, LinkError::CreateVeth { .. }), "{e:?}");
        assert_eq!(os_error(&e), Some(libc::EEXIST), "{e:?}");
        assert_eq!(names(&host_ip(&["link", "show"])), ["lo", "odsv0a580008"]);
        let inside = sb2.ip(&["-d", "addr", "show"]);
        assert_eq!(names(&inside), ["eth0", "lo"]);
        assert_eq!(link(&inside, "eth0")["linkinfo"]["info_kind"], "bridge");
        assert!(addrs(&inside, "eth0").is_empty());

        // Not a network namespace at all.
        let uts = File::open("/proc/self/ns/uts").unwrap();
        let e = attach(uts.as_fd(), &LinkPlan::new(DEFAULT_SUBNET, 4).unwrap())
            .await
            .unwrap_err();
        assert!(matches!(e, LinkError::CreateVeth { .. }), "{e:?}");
        assert_eq!(names(&host_ip(&["link", "show"])), ["lo", "odsv0a580008"]);
        assert!(list_strays("odsv").await.unwrap().is_empty());
    });
}

#[test]
fn a_failure_midway_removes_the_pair() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(None, || async {
        // The sandbox already has a default route: the last step fails, after the pair was
        // made and both ends configured.
        let sb = SandboxNs::start();
        sb.ip_do(&["link", "set", "lo", "up"]);
        sb.ip_do(&["route", "add", "default", "dev", "lo"]);
        let e = attach(sb.ns.as_fd(), &LinkPlan::new(DEFAULT_SUBNET, 4).unwrap())
            .await
            .unwrap_err();
        assert!(matches!(e, LinkError::Route { .. }), "{e:?}");
        assert_eq!(os_error(&e), Some(libc::EEXIST), "{e:?}");
        assert_eq!(
            e.to_string(),
            "veth odsv0a580010: adding the default route via 10.88.0.17 in the sandbox netns"
        );
        assert_eq!(names(&host_ip(&["link", "show"])), ["lo"]);
        assert_eq!(names(&sb.ip(&["link", "show"])), ["lo"]);
        assert!(host_ip(&["-4", "addr", "show"])
            .as_array()
            .unwrap()
            .iter()
            .all(|l| l["ifname"] == "lo"));
        assert!(list_strays("odsv").await.unwrap().is_empty());

        // The same slot attaches cleanly once the sandbox is sane: nothing of the failure is
        // in the way.
        let sb2 = SandboxNs::start();
        let a = attach(sb2.ns.as_fd(), &LinkPlan::new(DEFAULT_SUBNET, 4).unwrap())
            .await
            .unwrap();
        assert_eq!(a.host_name, "odsv0a580010");
        assert!(detach("odsv0a580010").await.unwrap());
    });
}

#[test]
fn list_strays_reports_our_veths_only() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        let sb5 = SandboxNs::start();
        let sb6 = SandboxNs::start();
        attach(sb5.ns.as_fd(), &LinkPlan::new(DEFAULT_SUBNET, 5).unwrap())
            .await
            .unwrap();
        attach(sb6.ns.as_fd(), &LinkPlan::new(DEFAULT_SUBNET, 6).unwrap())
            .await
            .unwrap();
        host_ip_do(&["link", "add", "odsv77", "type", "bridge"]);
        host_ip_do(&[
            "link", "add", "other0", "type", "veth", "peer", "name", "other1",
        ]);
        assert_eq!(
            list_strays("odsv").await.unwrap(),
            ["odsv0a580014", "odsv0a580018"]
        );
        assert_eq!(list_strays("other").await.unwrap(), ["other0", "other1"]);
        assert!(detach("odsv0a580014").await.unwrap());
        assert_eq!(list_strays("odsv").await.unwrap(), ["odsv0a580018"]);
        assert_eq!(names(&sb5.ip(&["link", "show"])), ["lo"]);
        assert_eq!(names(&sb6.ip(&["link", "show"])), ["eth0", "lo"]);
        assert!(detach("odsv0a580018").await.unwrap());
        assert!(list_strays("odsv").await.unwrap().is_empty());
        assert_eq!(
            names(&host_ip(&["link", "show"])),
            ["lo", "odsv77", "other0", "other1"]
        );
    });
}

#[test]
fn the_pair_goes_when_the_sandbox_netns_dies() {
    if !root_or_skip() {
        return;
    }
    in_fresh_netns(Some(2), || async {
        // A subnet other than the default, and its last slot.
        let subnet = Ipv4Net::new(Ipv4Addr::new(172, 31, 0, 0), 24).unwrap();
        assert_eq!(slot_count(subnet).unwrap(), 64);
        let sb = SandboxNs::start();
        let a = attach(sb.ns.as_fd(), &LinkPlan::new(subnet, 63).unwrap())
            .await
            .unwrap();
        assert_eq!(a.host_name, "odsvac1f00fc");
        let host = host_ip(&["addr", "show"]);
        assert_eq!(addrs(&host, "odsvac1f00fc"), [inet("172.31.0.253", 30)]);
        assert_eq!(
            addrs(&sb.ip(&["addr", "show"]), "eth0"),
            [inet("172.31.0.254", 30)]
        );
        // The sandbox's last process exits and its netns with it: the kernel deletes the
        // pair (the netns is cleaned up asynchronously, so wait for it).
        drop(sb);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = list_strays("odsv").await.unwrap();
            if left.is_empty() {
                break;
            }
            assert!(Instant::now() < deadline, "still there: {left:?}");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(names(&host_ip(&["link", "show"])), ["lo"]);
        assert!(!detach("odsvac1f00fc").await.unwrap());
    });
}
