//! Shared harness of the integration tests: `opendsec cluster up` as a child process (with the
//! environment it prints), `opendsec ctl` runs against it, small HTTP probes, and the visible
//! skip of root-only tests. Each test binary uses part of it.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

pub mod dns;
pub mod layers;
pub mod microvm;
pub mod netns;

/// The executable under test.
pub const BIN: &str = env!("CARGO_BIN_EXE_opendsec");

/// Root-only tests use `opendsec::sys::root_or_skip` (a visible `SKIPPED` line outside CI).
#[allow(unused_imports)] // not every test binary has root-only tests
pub use opendsec::sys::root_or_skip;

/// `opendsec ctl pki init -config cfg -out out`: the CA and every component's certificate.
pub fn pki_init(cfg: &Path, out: &Path) {
    let init = Command::new(BIN)
        .args(["ctl", "pki", "init", "-config"])
        .arg(cfg)
        .arg("-out")
        .arg(out)
        .output()
        .unwrap();
    assert!(
        init.status.success(),
        "{}",
        String::from_utf8_lossy(&init.stderr)
    );
}

/// A free TCP port on 127.0.0.1 (free when asked; good enough for tests).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// `GET path` on 127.0.0.1:port: the status code and the whole response, or `None` when
/// nothing answers.
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    let code = body.split_whitespace().nth(1)?.parse().ok()?;
    Some((code, body))
}

/// How to start `cluster up`; `Default` is one simulated edge on a free port.
#[derive(Clone)]
pub struct UpOptions {
    pub sim_edges: u32,
    /// Extra flags, e.g. `["-metrics", "127.0.0.1:9464"]`.
    pub extra: Vec<String>,
    /// Also write the effective config (`-write-config`) to `Cluster::config_path`.
    pub write_config: bool,
    /// `-log` level (default `warn`).
    pub log: String,
}

impl Default for UpOptions {
    fn default() -> Self {
        UpOptions {
            sim_edges: 1,
            extra: Vec::new(),
            write_config: false,
            log: "warn".into(),
        }
    }
}

/// A `cluster up` child with the environment it printed; stopped with SIGTERM (then SIGKILL)
/// when dropped.
pub struct Cluster {
    pub child: Child,
    pub addr: String,
    pub token: String,
    pub project: String,
    /// The `-write-config` file (exists only with `UpOptions::write_config`).
    pub config_path: PathBuf,
    pub log_path: PathBuf,
    pub dir: tempfile::TempDir,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        terminate(&mut self.child);
    }
}

/// SIGTERM, up to 5 s to exit, then SIGKILL; reaps the child.
pub fn terminate(child: &mut Child) {
    let _ = Command::new("kill")
        .arg("-TERM")
        .arg(child.id().to_string())
        .status();
    for _ in 0..100 {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// `opendsec cluster up` with `o`, its state in `state` and, with `o.write_config`, its
/// config written to `config`: not started, its stdio left to the caller.
pub fn up_command(o: &UpOptions, state: &Path, config: &Path) -> Command {
    let mut cmd = Command::new(BIN);
    cmd.args([
        "cluster",
        "up",
        "-addr",
        "127.0.0.1:0",
        "-disk-reserve-mb",
        "-1",
    ])
    .args(["-log", &o.log, "-sim-edges", &o.sim_edges.to_string()])
    .arg("-state-dir")
    .arg(state)
    .args(&o.extra);
    if o.write_config {
        cmd.arg("-write-config").arg(config);
    }
    cmd
}

/// Starts `opendsec cluster up` with `o` and waits (up to a generous 120 s, so a broken
/// cluster fails the test instead of hanging it) for the three `export` lines.
pub fn cluster_up(o: &UpOptions) -> Cluster {
    let dir = tempfile::tempdir().unwrap();
    let state = dir.path().join("state");
    let log_path = dir.path().join("cluster.log");
    let config_path = dir.path().join("cluster.json");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut child = up_command(o, &state, &config_path)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(log)
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        // Drains to the end, so the cluster never writes to a closed pipe.
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let _ = tx.send(line);
        }
    });
    let (mut addr, mut token, mut project) = (None, None, None);
    while addr.is_none() || token.is_none() || project.is_none() {
        let line = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(l) => l,
            Err(e) => {
                let _ = child.kill();
                let status = child.wait();
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                panic!("cluster up printed no environment ({e}); exit: {status:?}; stderr:\n{log}");
            }
        };
        let Some((k, v)) = line
            .strip_prefix("export ")
            .and_then(|kv| kv.split_once('='))
        else {
            continue;
        };
        match k {
            "OPENDSEC_ADDR" => addr = Some(v.to_string()),
            "OPENDSEC_TOKEN" => token = Some(v.to_string()),
            "OPENDSEC_PROJECT" => project = Some(v.to_string()),
            _ => {}
        }
    }
    Cluster {
        child,
        addr: addr.unwrap(),
        token: token.unwrap(),
        project: project.unwrap(),
        config_path,
        log_path,
        dir,
    }
}

/// What a command printed, and how it exited.
pub struct Run {
    pub code: i32,
    pub out: String,
    pub err: String,
}

impl Run {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_str(&self.out)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}\nstderr: {}", self.out, self.err))
    }
    pub fn ok(self) -> Run {
        assert_eq!(self.code, 0, "stdout: {}\nstderr: {}", self.out, self.err);
        self
    }
}

/// Runs `opendsec <args>` with `env` (and no inherited OPENDSEC_* settings).
pub fn run(args: &[&str], env: &[(&str, &str)]) -> Run {
    let mut cmd = Command::new(BIN);
    cmd.args(args).stdin(Stdio::null());
    for k in [
        "OPENDSEC_ADDR",
        "OPENDSEC_TOKEN",
        "OPENDSEC_PROJECT",
        "OPENDSEC_CA",
    ] {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        out: String::from_utf8_lossy(&out.stdout).into_owned(),
        err: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

impl Cluster {
    /// `opendsec ctl <args>` as the administrator, with the printed environment.
    pub fn ctl(&self, args: &[&str]) -> Run {
        self.ctl_as(&self.token, args)
    }

    /// `opendsec ctl <args>` with another token.
    pub fn ctl_as(&self, token: &str, args: &[&str]) -> Run {
        let mut all = vec!["ctl"];
        all.extend_from_slice(args);
        run(
            &all,
            &[
                ("OPENDSEC_ADDR", &self.addr),
                ("OPENDSEC_TOKEN", token),
                ("OPENDSEC_PROJECT", &self.project),
            ],
        )
    }

    /// What the cluster logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }

    /// The state directory given to `cluster up`.
    pub fn state_dir(&self) -> PathBuf {
        self.dir.path().join("state")
    }
}

/// `path`'s text, or a panic naming it.
pub fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
}

/// A temporary directory to hold an image store: under `OPENDSEC_TEST_NFS_STORE` when that is
/// set (scripts/test-nfs.sh runs the store's tests again on an NFS 4.2 mount, docs/testing.md
/// "The image store on NFS"), else with the other temporary files.
pub fn store_tempdir() -> tempfile::TempDir {
    match std::env::var_os("OPENDSEC_TEST_NFS_STORE") {
        Some(d) if !d.is_empty() => tempfile::tempdir_in(d).unwrap(),
        _ => tempfile::tempdir().unwrap(),
    }
}

/// The guest kernel: `OPENDSEC_TEST_KERNEL`, else Debian's cloud kernel in
/// target/guest-kernel (fetched there the first time).
pub fn guest_kernel() -> PathBuf {
    if let Some(k) = std::env::var_os("OPENDSEC_TEST_KERNEL") {
        return PathBuf::from(k);
    }
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/guest-kernel");
    let find = || {
        std::fs::read_dir(dir.join("boot"))
            .ok()?
            .flatten()
            .map(|e| e.path())
            .find(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("vmlinuz-"))
            })
    };
    if let Some(k) = find() {
        return k;
    }
    let st = Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/kernel/fetch-debian.sh"))
        .arg(&dir)
        .status()
        .expect("run fetch-debian.sh");
    assert!(st.success(), "fetch-debian.sh failed");
    find().expect("a kernel after fetch-debian.sh")
}

/// Puts the host's static busybox at `rootfs/bin/busybox` with `tools` as links to it.
pub fn busybox_into(rootfs: &Path, tools: &[&str]) {
    std::fs::create_dir_all(rootfs.join("bin")).expect("mkdir");
    let bin = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
        .expect("busybox-static is installed (.ci/run installs it)");
    std::fs::copy(bin, rootfs.join("bin/busybox")).expect("copy busybox");
    for tool in tools {
        std::os::unix::fs::symlink("busybox", rootfs.join("bin").join(tool)).expect("symlink");
    }
}

/// A 0:0 character device at `p`: how a layer carries a deletion (a whiteout).
pub fn whiteout(p: &Path) {
    rustix::fs::mknodat(
        rustix::fs::CWD,
        p,
        rustix::fs::FileType::CharacterDevice,
        rustix::fs::Mode::empty(),
        0,
    )
    .expect("whiteout");
}
