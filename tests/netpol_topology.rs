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

use std::fs::File;
use std::future::Future;
use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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

/// Runs `f` on a dedicated thread inside a fresh network namespace (the test's host), on a
/// runtime built by that thread, so every socket the test and the code under test open "on
/// the host" is in that namespace: a current-thread runtime, or with `workers` a
/// multi-thread one (the edge's shape), whose worker threads inherit the namespace from the
/// thread that starts them. The namespace goes away with the threads.
fn in_fresh_netns<F, Fut>(workers: Option<usize>, f: F)
where
    F: FnOnce() -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send + 'static,
{
    let t = std::thread::spawn(move || {
        nix::sched::unshare(CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
        let rt = match workers {
            None => tokio::runtime::Builder::new_current_thread(),
            Some(n) => {
                let mut b = tokio::runtime::Builder::new_multi_thread();
                b.worker_threads(n);
                b
            }
        }
        .enable_all()
        .build()
        .unwrap();
        rt.block_on(f());
    });
    if let Err(p) = t.join() {
        std::panic::resume_unwind(p);
    }
}

/// A sandbox's network namespace: an `unshare -n sleep` child, killed (by its pid) and
/// reaped on drop.
struct SandboxNs {
    child: Child,
    ns: File,
}

impl SandboxNs {
    fn start() -> SandboxNs {
        let mut child = Command::new("unshare")
            .args(["-n", "sleep", "1000"])
            .stdin(Stdio::null())
            .spawn()
            .expect("unshare -n sleep");
        let pid = child.id();
        let mine = std::fs::metadata("/proc/thread-self/ns/net").unwrap().ino();
        let path = format!("/proc/{pid}/ns/net");
        let deadline = Instant::now() + Duration::from_secs(20);
        // Until unshare(2) has run in the child, its netns is still ours.
        loop {
            if let Ok(m) = std::fs::metadata(&path) {
                if m.ino() != mine {
                    break;
                }
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the child {pid} never got its own netns");
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let ns = File::open(&path).unwrap();
        SandboxNs { child, ns }
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// `ip -j ARGS` inside the sandbox's netns.
    fn ip(&self, args: &[&str]) -> Value {
        let pid = self.pid();
        let mut full = vec!["-t", &pid, "-n", "ip", "-j"];
        full.extend_from_slice(args);
        json_of("nsenter", &full)
    }

    /// Runs `ip ARGS` (not JSON) inside the sandbox's netns, to set up a test case.
    fn ip_do(&self, args: &[&str]) {
        let pid = self.pid();
        let mut full = vec!["-t", &pid, "-n", "ip"];
        full.extend_from_slice(args);
        run("nsenter", &full);
    }

    /// A file's contents as the sandbox's netns sees it (`/proc/sys/net` follows the netns).
    fn read(&self, path: &str) -> String {
        let pid = self.pid();
        let out = run("nsenter", &["-t", &pid, "-n", "cat", path]);
        out.trim().to_string()
    }
}

impl Drop for SandboxNs {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn run(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{cmd} {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn json_of(cmd: &str, args: &[&str]) -> Value {
    let text = run(cmd, args);
    if text.trim().is_empty() {
        return Value::Array(vec![]);
    }
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{cmd} {args:?}: {e}: {text}"))
}

/// `ip -j ARGS` in the test's host netns (the calling thread's).
fn host_ip(args: &[&str]) -> Value {
    let mut full = vec!["-j"];
    full.extend_from_slice(args);
    json_of("ip", &full)
}

fn host_ip_do(args: &[&str]) {
    run("ip", args);
}

fn names(links: &Value) -> Vec<String> {
    let mut v: Vec<String> = links
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["ifname"].as_str().unwrap().to_string())
        .collect();
    v.sort();
    v
}

fn link<'a>(links: &'a Value, name: &str) -> &'a Value {
    links
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["ifname"] == name)
        .unwrap_or_else(|| panic!("no {name} in {links}"))
}

/// `(family, address, prefix length)` of each address of `name`.
fn addrs(links: &Value, name: &str) -> Vec<(String, String, u64)> {
    link(links, name)["addr_info"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            (
                a["family"].as_str().unwrap().to_string(),
                a["local"].as_str().unwrap().to_string(),
                a["prefixlen"].as_u64().unwrap(),
            )
        })
        .collect()
}

fn flags(links: &Value, name: &str) -> Vec<String> {
    link(links, name)["flags"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f.as_str().unwrap().to_string())
        .collect()
}

fn inet(a: &str, prefix: u64) -> (String, String, u64) {
    ("inet".into(), a.into(), prefix)
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
        assert_eq!(a.host_name, "odsv1");
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
        assert_eq!(names(&host), ["lo", "odsv1"]);
        assert_eq!(addrs(&host, "odsv1"), [inet("10.88.0.5", 30)]);
        assert_eq!(
            link(&host, "odsv1")["ifindex"].as_u64(),
            Some(u64::from(a.host_index))
        );
        assert!(flags(&host, "odsv1").contains(&"LOWER_UP".to_string()));
        assert_eq!(
            std::fs::read_to_string("/proc/sys/net/ipv6/conf/odsv1/disable_ipv6")
                .unwrap()
                .trim(),
            "1"
        );
        assert_eq!(
            host_ip(&["-d", "link", "show", "odsv1"])[0]["inet6_addr_gen_mode"],
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

        assert_eq!(list_strays("odsv").await.unwrap(), ["odsv1"]);
        assert!(detach("odsv1").await.unwrap());
        assert_eq!(names(&host_ip(&["link", "show"])), ["lo"]);
        assert_eq!(names(&sb.ip(&["link", "show"])), ["lo"]);
        // Idempotent.
        assert!(!detach("odsv1").await.unwrap());
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
        host_ip_do(&["link", "add", "odsv2", "type", "bridge"]);
        let e = attach(sb.ns.as_fd(), &LinkPlan::new(DEFAULT_SUBNET, 2).unwrap())
            .await
            .unwrap_err();
        assert!(matches!(e, LinkError::CreateVeth { .. }), "{e:?}");
        assert_eq!(os_error(&e), Some(libc::EEXIST), "{e:?}");
        let host = host_ip(&["-d", "link", "show"]);
        assert_eq!(names(&host), ["lo", "odsv2"]);
        assert_eq!(link(&host, "odsv2")["linkinfo"]["info_kind"], "bridge");
        assert_eq!(names(&sb.ip(&["link", "show"])), ["lo"]);
        // detach refuses what is not a veth, and leaves it.
        let e = detach("odsv2").await.unwrap_err();
        assert!(matches!(e, LinkError::NotVeth { .. }), "{e:?}");
        assert_eq!(names(&host_ip(&["link", "show"])), ["lo", "odsv2"]);

        // The sandbox already has an eth0.
        let sb2 = SandboxNs::start();
        sb2.ip_do(&["link", "add", "eth0", "type", "bridge"]);
        let e = attach(sb2.ns.as_fd(), &LinkPlan::new(DEFAULT_SUBNET, 3).unwrap())
            .await
            .unwrap_err();
        assert!(matches!(e, LinkError::CreateVeth { .. }), "{e:?}");
        assert_eq!(os_error(&e), Some(libc::EEXIST), "{e:?}");
        assert_eq!(names(&host_ip(&["link", "show"])), ["lo", "odsv2"]);
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
        assert_eq!(names(&host_ip(&["link", "show"])), ["lo", "odsv2"]);
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
            "veth odsv4: adding the default route via 10.88.0.17 in the sandbox netns"
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
        assert_eq!(a.host_name, "odsv4");
        assert!(detach("odsv4").await.unwrap());
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
        assert_eq!(list_strays("odsv").await.unwrap(), ["odsv5", "odsv6"]);
        assert_eq!(list_strays("other").await.unwrap(), ["other0", "other1"]);
        assert!(detach("odsv5").await.unwrap());
        assert_eq!(list_strays("odsv").await.unwrap(), ["odsv6"]);
        assert_eq!(names(&sb5.ip(&["link", "show"])), ["lo"]);
        assert_eq!(names(&sb6.ip(&["link", "show"])), ["eth0", "lo"]);
        assert!(detach("odsv6").await.unwrap());
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
        assert_eq!(a.host_name, "odsv63");
        let host = host_ip(&["addr", "show"]);
        assert_eq!(addrs(&host, "odsv63"), [inet("172.31.0.253", 30)]);
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
        assert!(!detach("odsv63").await.unwrap());
    });
}
