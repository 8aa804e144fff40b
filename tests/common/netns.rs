//! Network namespaces for the network tests: a fresh "host" netns on a thread of its own,
//! sandbox netns held by `unshare -n sleep` children, and `ip -j` readers. Root only.

use std::fs::File;
use std::future::Future;
use std::os::unix::fs::MetadataExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use nix::sched::CloneFlags;
use serde_json::Value;

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
