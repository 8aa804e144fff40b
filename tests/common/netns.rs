//! Network namespaces for the network tests: a fresh "host" netns on a thread of its own,
//! sandbox netns held by `unshare -n sleep` children, `ip -j` readers, and the test world of
//! docs/testing.md "Network tests": an "internet" netns behind one uplink, with echo servers
//! on documentation addresses and a private one. Root only.

use std::fs::File;
use std::future::Future;
use std::io::ErrorKind;
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::fd::AsFd;
use std::os::unix::fs::MetadataExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sched::CloneFlags;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Runs `f` on a dedicated thread inside a fresh network namespace (the test's host), on a
/// runtime built by that thread, so every socket the test and the code under test open "on
/// the host" is in that namespace: a current-thread runtime, or with `workers` a
/// multi-thread one (the edge's shape), whose worker threads inherit the namespace from the
/// thread that starts them. The namespace goes away with the threads.
pub fn in_fresh_netns<F, Fut>(workers: Option<usize>, f: F)
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
pub struct SandboxNs {
    pub child: Child,
    pub ns: File,
}

impl SandboxNs {
    pub fn start() -> SandboxNs {
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

    pub fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// `ip -j ARGS` inside the sandbox's netns.
    pub fn ip(&self, args: &[&str]) -> Value {
        let pid = self.pid();
        let mut full = vec!["-t", &pid, "-n", "ip", "-j"];
        full.extend_from_slice(args);
        json_of("nsenter", &full)
    }

    /// Runs `ip ARGS` (not JSON) inside the sandbox's netns, to set up a test case.
    pub fn ip_do(&self, args: &[&str]) {
        let pid = self.pid();
        let mut full = vec!["-t", &pid, "-n", "ip"];
        full.extend_from_slice(args);
        run("nsenter", &full);
    }

    /// A file's contents as the sandbox's netns sees it (`/proc/sys/net` follows the netns).
    pub fn read(&self, path: &str) -> String {
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

pub fn run(cmd: &str, args: &[&str]) -> String {
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

pub fn json_of(cmd: &str, args: &[&str]) -> Value {
    let text = run(cmd, args);
    if text.trim().is_empty() {
        return Value::Array(vec![]);
    }
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{cmd} {args:?}: {e}: {text}"))
}

/// `ip -j ARGS` in the test's host netns (the calling thread's).
pub fn host_ip(args: &[&str]) -> Value {
    let mut full = vec!["-j"];
    full.extend_from_slice(args);
    json_of("ip", &full)
}

pub fn host_ip_do(args: &[&str]) {
    run("ip", args);
}

pub fn names(links: &Value) -> Vec<String> {
    let mut v: Vec<String> = links
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["ifname"].as_str().unwrap().to_string())
        .collect();
    v.sort();
    v
}

pub fn link<'a>(links: &'a Value, name: &str) -> &'a Value {
    links
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["ifname"] == name)
        .unwrap_or_else(|| panic!("no {name} in {links}"))
}

/// `(family, address, prefix length)` of each address of `name`.
pub fn addrs(links: &Value, name: &str) -> Vec<(String, String, u64)> {
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

/// An IPv4 address as [`addrs`] lists it.
pub fn inet(a: &str, prefix: u64) -> (String, String, u64) {
    ("inet".into(), a.into(), prefix)
}

pub const PUBLIC_A: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 10);
pub const PUBLIC_B: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
pub const PRIVATE: Ipv4Addr = Ipv4Addr::new(10, 30, 0, 10);
pub const UPLINK_HOST: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 1);
/// How long a connect may take before the test calls it dropped. Answers in these
/// namespaces take well under a millisecond.
pub const DROPPED_AFTER: Duration = Duration::from_millis(1500);

/// Runs `f` on a thread of its own inside netns `ns`, on a current-thread runtime.
pub fn in_ns<T: Send + 'static>(
    ns: &File,
    f: impl FnOnce() -> std::pin::Pin<Box<dyn std::future::Future<Output = T>>> + Send + 'static,
) -> std::thread::JoinHandle<T> {
    let ns = ns.try_clone().unwrap();
    std::thread::spawn(move || {
        nix::sched::setns(ns.as_fd(), CloneFlags::CLONE_NEWNET).unwrap();
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
            .block_on(f())
    })
}

/// Echo servers on `ports` of every address of netns `ns`, for the life of the process.
pub fn serve_echo(ns: &File, ports: &[u16]) {
    let ports = ports.to_vec();
    let (tx, rx) = std::sync::mpsc::channel();
    in_ns(ns, move || {
        Box::pin(async move {
            let mut ls = Vec::new();
            for p in ports {
                ls.push(tokio::net::TcpListener::bind(("0.0.0.0", p)).await.unwrap());
            }
            tx.send(()).unwrap();
            let mut tasks = Vec::new();
            for l in ls {
                tasks.push(tokio::spawn(async move {
                    loop {
                        let (mut s, _) = l.accept().await.unwrap();
                        tokio::spawn(async move {
                            let mut buf = [0u8; 256];
                            while let Ok(n) = s.read(&mut buf).await {
                                if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                                    break;
                                }
                            }
                        });
                    }
                }));
            }
            for t in tasks {
                let _ = t.await;
            }
        })
    });
    rx.recv().unwrap();
}

/// Connects from netns `ns` (bound to `from` when given) to `to`, sends a line and reads
/// it back: `Ok` when the echo came, else the error (`TimedOut` for a dropped packet).
pub fn exchange(ns: &File, from: Option<Ipv4Addr>, to: SocketAddrV4) -> std::io::Result<()> {
    in_ns(ns, move || {
        Box::pin(async move {
            let sock = tokio::net::TcpSocket::new_v4()?;
            if let Some(a) = from {
                sock.bind(SocketAddr::from((a, 0)))?;
            }
            let mut s = tokio::time::timeout(DROPPED_AFTER, sock.connect(to.into()))
                .await
                .map_err(|_| std::io::Error::from(ErrorKind::TimedOut))??;
            s.write_all(b"ping\n").await?;
            let mut buf = [0u8; 5];
            tokio::time::timeout(DROPPED_AFTER, s.read_exact(&mut buf))
                .await
                .map_err(|_| std::io::Error::from(ErrorKind::TimedOut))??;
            assert_eq!(&buf, b"ping\n");
            Ok(())
        })
    })
    .join()
    .unwrap()
}

pub fn assert_passes(ns: &File, to: (Ipv4Addr, u16)) {
    let to = SocketAddrV4::new(to.0, to.1);
    if let Err(e) = exchange(ns, None, to) {
        panic!("{to}: expected to pass, got {e}");
    }
}

pub fn assert_dropped(ns: &File, from: Option<Ipv4Addr>, to: (Ipv4Addr, u16)) {
    let to = SocketAddrV4::new(to.0, to.1);
    match exchange(ns, from, to) {
        Err(e) if e.kind() == ErrorKind::TimedOut => {}
        other => panic!("{to} from {from:?}: expected dropped (timed out), got {other:?}"),
    }
}

/// The world: the internet netns with its servers and the uplink, and forwarding on in the
/// calling thread's (the host's) netns.
pub struct World {
    pub internet: SandboxNs,
}

pub fn world() -> World {
    let internet = SandboxNs::start();
    let pid = internet.pid();
    host_ip_do(&[
        "link", "add", "up0", "type", "veth", "peer", "name", "up1", "netns", &pid,
    ]);
    host_ip_do(&["addr", "add", "203.0.113.1/24", "dev", "up0"]);
    host_ip_do(&["link", "set", "up0", "up"]);
    host_ip_do(&["route", "add", "default", "via", "203.0.113.2"]);
    internet.ip_do(&["addr", "add", "203.0.113.2/24", "dev", "up1"]);
    internet.ip_do(&["link", "set", "up1", "up"]);
    internet.ip_do(&["link", "set", "lo", "up"]);
    for a in [PUBLIC_A, PUBLIC_B, PRIVATE] {
        internet.ip_do(&["addr", "add", &format!("{a}/32"), "dev", "lo"]);
    }
    opendsec::netpol::link::enable_ipv4_forwarding().unwrap();
    serve_echo(&internet.ns, &[80, 443, 8080]);
    World { internet }
}

/// Records the UDP datagrams that reach port `port` of netns `ns`: (source, payload), sent
/// on the returned channel, for the life of the process.
pub fn record_udp(ns: &File, port: u16) -> std::sync::mpsc::Receiver<(SocketAddr, Vec<u8>)> {
    let (tx, rx) = std::sync::mpsc::channel();
    let (ready_tx, ready_rx) = std::sync::mpsc::channel();
    in_ns(ns, move || {
        Box::pin(async move {
            let sock = tokio::net::UdpSocket::bind(("0.0.0.0", port))
                .await
                .unwrap();
            ready_tx.send(()).unwrap();
            let mut buf = [0u8; 1500];
            while let Ok((n, from)) = sock.recv_from(&mut buf).await {
                if tx.send((from, buf[..n].to_vec())).is_err() {
                    break;
                }
            }
        })
    });
    ready_rx.recv().unwrap();
    rx
}
