//! The container backend (runtime `linux`) on its own, without an edge: create a sandbox from
//! the `host` image, run commands in it through aether, pause, resume, adopt it from a second
//! backend instance (what an edge restart does), stop it, and find nothing left behind.
//! Needs root; under CI=true a missing privilege fails the test.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use opendsec::backends::{self, Backend, BackendContext, CreateRequest, Handle, Health, Recorded};
use opendsec::config::BackendConfig;
use opendsec::pb::{self, runtime_client::RuntimeClient};
use opendsec::types::Reason;

fn root_or_skip() -> bool {
    opendsec::sys::root_or_skip("the container backend tests")
}

fn ctx(state: &Path, edge: &str) -> BackendContext {
    BackendContext {
        edge_id: edge.into(),
        state_dir: state.to_path_buf(),
        agent_dir: PathBuf::from(env!("CARGO_BIN_EXE_opendsec"))
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_default(),
        images: BTreeMap::from([("host".to_string(), vec![PathBuf::from("/")])]),
        image_store: None,
        network: None,
    }
}

fn backend(state: &Path, edge: &str) -> Arc<dyn Backend> {
    backend_with(state, edge, BTreeMap::new())
}

fn backend_with(
    state: &Path,
    edge: &str,
    extra_images: BTreeMap<String, Vec<PathBuf>>,
) -> Arc<dyn Backend> {
    let cfg = BackendConfig {
        runtime: "linux".into(),
        ..Default::default()
    };
    let mut c = ctx(state, edge);
    c.images.extend(extra_images);
    match backends::build("container", &cfg, &c) {
        Ok(b) => b,
        Err(e) => panic!("building the container backend: {e}"),
    }
}

fn spec() -> pb::SandboxSpec {
    pb::SandboxSpec {
        backend: "container".into(),
        image: "host".into(),
        cpu_cores_limit: 1.0,
        memory_limit_mb: 512,
        disk_mb: 256,
        ..Default::default()
    }
}

async fn shell(b: &Arc<dyn Backend>, h: &Handle<'_>, cmd: &str) -> pb::ShellResult {
    let rt = b.runtime().expect("runtime capability");
    let ch = rt.channel(h).await.expect("channel");
    let mut c = RuntimeClient::new(ch);
    c.run_shell(pb::RunShellRequest {
        sandbox_id: h.sandbox_id.into(),
        cmd: cmd.into(),
        timeout: 30.0,
        ..Default::default()
    })
    .await
    .expect("run_shell")
    .into_inner()
}

fn leftovers(state: &Path, edge: &str, id: &str) -> Vec<String> {
    let mut out = Vec::new();
    for p in [
        state.join(edge).join("containers").join(id),
        state.join(edge).join("disks").join(format!("{id}.img")),
    ] {
        if p.exists() {
            out.push(p.display().to_string());
        }
    }
    if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
        for h in rd.flatten() {
            let p = h.path().join("opendsec").join(edge).join(id);
            if p.exists() {
                out.push(p.display().to_string());
            }
        }
    }
    // Prepared disks (spares, docs/architecture.md "Prepared disks") are the backend's own,
    // not a sandbox's; `prepared_disks_are_taken_and_none_outlives_the_backend` counts them.
    for (dev, backing) in opendsec::sys::loopdev::attached(state) {
        if !backing.to_string_lossy().contains("/.spare/") {
            out.push(format!("{} -> {}", dev.display(), backing.display()));
        }
    }
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for l in mounts.lines().filter(|l| l.contains(id)) {
        out.push(l.to_string());
    }
    out
}

/// The development image `host` has the host's `/` as its lower layer, and so the cluster's
/// state directory: every sandbox's disk image, the records and the cluster's config and
/// tokens. A sandbox sees it as an empty directory (found by a fresh-user trial: a sandbox
/// read another sandbox's files out of its disk image).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_host_image_hides_the_state_directory() {
    if !root_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path();
    std::fs::write(state.join("cluster.env"), "OPENDSEC_TOKEN=secret\n").expect("secret");
    let edge = "cb-hide";
    let b = backend(state, edge);
    let id = format!("{edge}.hide");
    let spec = spec();
    let st = b
        .create(&CreateRequest {
            fork: None,
            snapshot: None,
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: spec.clone(),
        })
        .await
        .expect("create");
    let h = Handle {
        sandbox_id: &id,
        spec: &spec,
        state: &st,
    };
    let dir = state.canonicalize().expect("canonical");
    let r = shell(
        &b,
        &h,
        &format!(
            "ls -A {d}; cat {d}/cluster.env; head -c 1 {d}/{edge}/disks/{id}.img; echo end",
            d = dir.display()
        ),
    )
    .await;
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    let err = String::from_utf8_lossy(&r.stderr).to_string();
    assert_eq!(out, "end\n", "stderr: {err}");
    assert!(err.contains("No such file"), "{err}");
    // Nor the host's password hashes, nor what the host keeps in its temporary directories
    // (other clusters' state and tokens); those come up empty, writable and with their
    // modes, on the sandbox's own disk.
    let secret = std::path::PathBuf::from(format!("/var/tmp/odc-secret-{}", std::process::id()));
    std::fs::write(&secret, "token\n").expect("host secret");
    let r = shell(
        &b,
        &h,
        &format!(
            "cat /etc/shadow /etc/gshadow {s} 2>/dev/null; ls -A /tmp /var/tmp; \
             stat -c '%a %U' /tmp /var/tmp /etc; echo x > /tmp/y && cat /tmp/y",
            s = secret.display()
        ),
    )
    .await;
    let _ = std::fs::remove_file(&secret);
    assert_eq!(
        String::from_utf8_lossy(&r.stdout),
        "/tmp:\n\n/var/tmp:\n1777 root\n1777 root\n755 root\nx\n",
        "{r:?}"
    );
    assert!(
        std::path::Path::new("/etc/shadow").exists(),
        "the host's own file is untouched"
    );
    b.stop(&h).await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lifecycle_adoption_and_nothing_left() {
    if !root_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path();
    let edge = "cb-0";
    let b = backend(state, edge);
    let id = format!("{edge}.lifecycle");
    let spec = spec();
    let st = b
        .create(&CreateRequest {
            fork: None,
            snapshot: None,
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: spec.clone(),
        })
        .await
        .expect("create");
    let h = Handle {
        sandbox_id: &id,
        spec: &spec,
        state: &st,
    };
    let r = shell(
        &b,
        &h,
        "echo hi; hostname; cat /proc/1/comm; ls /proc | grep -c '^[0-9]'",
    )
    .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.first(), Some(&"hi"));
    assert_eq!(lines.get(1), Some(&"lifecycle"));
    // Only the sandbox's own processes are visible: aether, chronus, the shell and a few.
    let n: usize = lines
        .get(3)
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(999);
    assert!(n < 10, "{n} processes visible: {out}");
    assert_eq!(b.probe(&h).await, Health::Alive);

    // Nothing of the sandbox is in the host's mount table.
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo");
    assert!(!mounts.contains(&id), "sandbox mounts leaked into the host");

    b.pause(&h).await.expect("pause");
    // A second backend instance, as after an edge restart, takes the sandbox over.
    let b2 = backend(state, edge);
    let adopted = b2.adopt(&h, Recorded::Paused).await.expect("adopt");
    assert!(adopted.paused);
    b2.resume(&h).await.expect("resume");
    let r = shell(&b2, &h, "echo again").await;
    assert_eq!(r.stdout, b"again\n");

    b2.stop(&h).await.expect("stop");
    assert_eq!(b2.probe(&h).await, Health::Lost("aether exited".into()));
    assert_eq!(leftovers(state, edge, &id), Vec::<String>::new());
    // Stopping again is fine.
    b2.stop(&h).await.expect("second stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_leave_nothing_and_cleanup_removes_strays() {
    if !root_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path();
    let edge = "cb-1";
    let b = backend(state, edge);
    let mut s = spec();
    s.image = "nope".into();
    let id = format!("{edge}.badimage");
    let e = b
        .create(&CreateRequest {
            fork: None,
            snapshot: None,
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: s,
        })
        .await
        .expect_err("unknown image refused");
    assert_eq!(e.reason(), Reason::NotFound);
    let mut s = spec();
    s.masked_paths = vec!["/etc/../root".into()];
    let e = b
        .create(&CreateRequest {
            fork: None,
            snapshot: None,
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: s,
        })
        .await
        .expect_err("bad path refused");
    assert_eq!(e.reason(), Reason::Invalid);
    assert_eq!(leftovers(state, edge, &id), Vec::<String>::new());

    // A sandbox the edge has no record of is removed by cleanup.
    let stray = format!("{edge}.stray");
    let spec = spec();
    b.create(&CreateRequest {
        fork: None,
        snapshot: None,
        sandbox_id: stray.clone(),
        project: "root".into(),
        spec: spec.clone(),
    })
    .await
    .expect("create");
    // Another cluster on this machine with the same edge id (its own state dir) keeps its
    // sandbox when this one cleans up.
    let other_tmp = tempfile::tempdir().expect("tempdir");
    let other = backend(other_tmp.path(), edge);
    let theirs = format!("{edge}.theirs");
    let st = other
        .create(&CreateRequest {
            fork: None,
            snapshot: None,
            sandbox_id: theirs.clone(),
            project: "root".into(),
            spec: spec.clone(),
        })
        .await
        .expect("create theirs");
    let report = b.cleanup(&HashSet::new()).await.expect("cleanup");
    assert!(
        report.removed.iter().any(|r| r.contains(&stray)),
        "{report:?}"
    );
    assert!(
        !report.removed.iter().any(|r| r.contains(&theirs)),
        "{report:?}"
    );
    assert_eq!(leftovers(state, edge, &stray), Vec::<String>::new());
    let h = Handle {
        sandbox_id: &theirs,
        spec: &spec,
        state: &st,
    };
    assert_eq!(other.probe(&h).await, Health::Alive);
    other.stop(&h).await.expect("stop theirs");
}

/// A tiny image at `dir`: static busybox as the shell and a few tools.
fn busybox_layer(dir: &Path) -> PathBuf {
    std::fs::create_dir_all(dir.join("bin")).expect("mkdir");
    let busybox = ["/bin/busybox", "/usr/bin/busybox"]
        .into_iter()
        .find(|p| Path::new(p).is_file())
        .expect("busybox-static is installed (.ci/run installs it)");
    std::fs::copy(busybox, dir.join("bin/busybox")).expect("copy busybox");
    for tool in ["sh", "head", "test", "echo", "pwd"] {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(tool)).expect("symlink");
    }
    dir.to_path_buf()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bundles_config_gives_env_and_working_directory() {
    if !root_or_skip() {
        return;
    }
    // As `umoci unpack` lays an image out: BUNDLE/rootfs and BUNDLE/config.json.
    let tmp = tempfile::tempdir().expect("tempdir");
    let rootfs = busybox_layer(&tmp.path().join("bundle/rootfs"));
    std::fs::create_dir_all(rootfs.join("srv/app")).expect("mkdir");
    std::fs::write(
        tmp.path().join("bundle/config.json"),
        r#"{"ociVersion": "1.0.2", "process": {"cwd": "/srv/app",
            "env": ["PATH=/bin", "GREETING=from-the-image"], "args": ["sh"]}}"#,
    )
    .expect("config");
    let state = tmp.path().join("state");
    let edge = "cb-3";
    let b = backend_with(
        &state,
        edge,
        BTreeMap::from([("bundled".to_string(), vec![rootfs.clone()])]),
    );
    let id = format!("{edge}.bundled");
    let mut spec = spec();
    spec.image = "bundled".into();
    let st = b
        .create(&CreateRequest {
            fork: None,
            snapshot: None,
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: spec.clone(),
        })
        .await
        .expect("create");
    let h = Handle {
        sandbox_id: &id,
        spec: &spec,
        state: &st,
    };
    let r = shell(&b, &h, "echo $GREETING; pwd").await;
    assert_eq!(r.stdout, b"from-the-image\n/srv/app\n", "{r:?}");
    b.stop(&h).await.expect("stop");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn device_nodes_in_an_image_open_nothing() {
    if !root_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path().join("state");
    // A whole image of its own (overlayfs refuses a lower layer inside another one, so not
    // on top of the host's /).
    let layer = busybox_layer(&tmp.path().join("layer"));
    // A block device node for the host's first disk, as a hostile image could carry.
    let node = layer.join("disk0");
    let made = std::process::Command::new("mknod")
        .arg(&node)
        .args(["b", "253", "0"])
        .status()
        .expect("mknod");
    assert!(made.success());
    let edge = "cb-2";
    let b = backend_with(
        &state,
        edge,
        BTreeMap::from([("withdev".to_string(), vec![layer.clone()])]),
    );
    let id = format!("{edge}.devnode");
    let mut spec = spec();
    spec.image = "withdev".into();
    let st = b
        .create(&CreateRequest {
            fork: None,
            snapshot: None,
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: spec.clone(),
        })
        .await
        .expect("create");
    let h = Handle {
        sandbox_id: &id,
        spec: &spec,
        state: &st,
    };
    let r = shell(&b, &h, "test -b /disk0 && echo is-block; head -c 1 /disk0").await;
    assert_eq!(r.stdout, b"is-block\n");
    assert_ne!(r.exit_code, 0);
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("Permission denied"),
        "{:?}",
        String::from_utf8_lossy(&r.stderr)
    );
    b.stop(&h).await.expect("stop");
}

/// One sandbox of its own backend, for the tests below.
struct Sb {
    b: Arc<dyn Backend>,
    id: String,
    spec: pb::SandboxSpec,
    st: opendsec::backends::BackendState,
    /// Set by [`Sb::stop`]; otherwise dropping stops the sandbox.
    stopped: bool,
    _tmp: tempfile::TempDir,
}

impl Sb {
    async fn new(edge: &str, spec: pb::SandboxSpec) -> Sb {
        let tmp = tempfile::tempdir().expect("tempdir");
        let b = backend(tmp.path(), edge);
        let id = format!("{edge}.t");
        let st = b
            .create(&CreateRequest {
                fork: None,
                snapshot: None,
                sandbox_id: id.clone(),
                project: "root".into(),
                spec: spec.clone(),
            })
            .await
            .expect("create");
        Sb {
            b,
            id,
            spec,
            st,
            stopped: false,
            _tmp: tmp,
        }
    }

    fn h(&self) -> Handle<'_> {
        Handle {
            sandbox_id: &self.id,
            spec: &self.spec,
            state: &self.st,
        }
    }

    async fn client(&self) -> RuntimeClient<tonic::transport::Channel> {
        let rt = self.b.runtime().expect("runtime capability");
        RuntimeClient::new(rt.channel(&self.h()).await.expect("channel"))
    }

    async fn sh(&self, session: &str, cmd: &str) -> pb::ShellResult {
        self.client()
            .await
            .run_shell(pb::RunShellRequest {
                sandbox_id: self.id.clone(),
                cmd: cmd.into(),
                session: session.into(),
                timeout: 60.0,
                ..Default::default()
            })
            .await
            .expect("run_shell")
            .into_inner()
    }

    async fn stop(mut self) {
        self.b.stop(&self.h()).await.expect("stop");
        self.stopped = true;
    }
}

/// A test that fails midway stops its sandbox all the same: a sandbox left running keeps
/// its cgroups (named after the test's fixed edge id) for the next run to trip over.
impl Drop for Sb {
    fn drop(&mut self) {
        if self.stopped {
            return;
        }
        let (b, id, spec, state) = (
            self.b.clone(),
            self.id.clone(),
            self.spec.clone(),
            self.st.clone(),
        );
        // On a thread of its own: drop cannot wait on the test's runtime.
        let _ = std::thread::spawn(move || {
            let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            else {
                return;
            };
            rt.block_on(async {
                let h = Handle {
                    sandbox_id: &id,
                    spec: &spec,
                    state: &state,
                };
                if let Err(e) = b.stop(&h).await {
                    eprintln!("stopping {id} after the test failed: {e}");
                }
            });
        })
        .join();
    }
}

/// Run by the sandbox's root: tries to ptrace, and to open the memory of, aether (PID 1)
/// and every chronus; prints `pid what errno-name` lines.
const ATTACK_PY: &str = r#"
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
PTRACE_ATTACH, PTRACE_DETACH = 16, 17
def name(e):
    return errno.errorcode.get(e, str(e))
targets = [1]
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            argv = open(f"/proc/{p}/cmdline", "rb").read().split(b"\0")
        except OSError:
            continue
        if b"chronus" in argv[:2]:
            targets.append(int(p))
for pid in targets:
    r = libc.ptrace(PTRACE_ATTACH, pid, None, None)
    e = ctypes.get_errno()
    if r == 0:
        os.waitpid(pid, os.__dict__.get("WALL", 0x40000000))
        libc.ptrace(PTRACE_DETACH, pid, None, None)
        print(pid, "attach", "ok")
    else:
        print(pid, "attach", name(e))
    for mode, what in (("rb", "mem-read"), ("r+b", "mem-write")):
        try:
            open(f"/proc/{pid}/mem", mode).close()
            print(pid, what, "ok")
        except OSError as ex:
            print(pid, what, name(ex.errno))
"#;

/// Item: the agents are out of the sandbox root's reach. Without non-dumpable agents the
/// root of the sandbox (same uid, same capabilities as aether) attaches to PID 1 and reads
/// its memory; the same for another session's root chronus.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sandbox_root_cannot_trace_or_read_the_agents() {
    if !root_or_skip() {
        return;
    }
    let sb = Sb::new("cb-9", spec()).await;
    // Another root session, whose chronus the attacker goes after too.
    let r = sb.sh("victim", "true").await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let r = sb
        .sh(
            "attacker",
            &format!("id -u; grep CapEff /proc/self/status; python3 -c '{ATTACK_PY}'"),
        )
        .await;
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    assert_eq!(
        r.exit_code,
        0,
        "{out} {}",
        String::from_utf8_lossy(&r.stderr)
    );
    let mut lines = out.lines();
    assert_eq!(lines.next(), Some("0"), "{out}");
    // CAP_SYS_PTRACE (bit 19) is in no session.
    let cap = lines
        .next()
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|h| u64::from_str_radix(h, 16).ok())
        .expect("CapEff");
    assert_eq!(cap & (1 << 19), 0, "CAP_SYS_PTRACE in the session: {cap:x}");
    let rest: Vec<&str> = lines.collect();
    let pids: HashSet<&str> = rest.iter().filter_map(|l| l.split(' ').next()).collect();
    // aether and at least the two sessions' chronus.
    assert!(pids.len() >= 3, "{out}");
    for l in &rest {
        let f: Vec<&str> = l.split(' ').collect();
        let want = if f.get(1) == Some(&"attach") {
            "EPERM"
        } else {
            "EACCES"
        };
        assert_eq!(f.get(2), Some(&want), "{l}\n{out}");
    }
    // aether's config cannot be rewritten, replaced or unmounted by the sandbox's root.
    let r = sb
        .sh(
            "attacker",
            "echo '{}' > /run/opendsec/aether.json; echo w=$?; \
             mv /run/opendsec/aether.json /tmp/a 2>/dev/null; echo m=$?; \
             rm -f /run/opendsec/aether.json 2>/dev/null; echo r=$?; \
             umount /run/opendsec/aether.json 2>/dev/null || echo u=refused; \
             head -c 1 /run/opendsec/aether.json 2>/dev/null; echo",
        )
        .await;
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    assert_eq!(out, "w=1\nm=1\nr=1\nu=refused\n{\n", "{r:?}");
    assert!(
        String::from_utf8_lossy(&r.stderr).contains("Read-only file system"),
        "{r:?}"
    );
    // SIGSTOP and SIGKILL to PID 1 from inside do nothing; the agents keep answering.
    let r = sb
        .sh("attacker", "kill -STOP 1; kill -KILL 1; echo sent")
        .await;
    assert_eq!(r.stdout, b"sent\n", "{r:?}");
    let r = sb.sh("victim", "echo alive").await;
    assert_eq!(r.stdout, b"alive\n", "{r:?}");
    sb.stop().await;
}

/// Item: OOM is visible. A command the OOM killer ends has `oom_killed`; a plain `kill -9`
/// (the same exit code 137) and a later command do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oom_killed_tells_the_oom_killer_from_kill_9() {
    if !root_or_skip() {
        return;
    }
    let mut s = spec();
    s.memory_limit_mb = 256;
    let sb = Sb::new("cb-10", s).await;
    let r = sb
        .sh("default", "python3 -c 'x = bytearray(1 << 30)'")
        .await;
    assert_eq!((r.exit_code, r.oom_killed), (137, true), "{r:?}");
    // chronus's kill of the session's commands on that OOM does not reach the next ones
    // (its passes used to go on over commands started meanwhile).
    let r = sb.sh("default", "sleep 0.3; echo after").await;
    assert_eq!(
        (r.exit_code, r.stdout.as_slice()),
        (0, &b"after\n"[..]),
        "{r:?}"
    );
    let r = sb.sh("default", "sh -c 'kill -9 $$'").await;
    assert_eq!((r.exit_code, r.oom_killed), (137, false), "{r:?}");
    let r = sb.sh("default", "echo ok").await;
    assert_eq!((r.exit_code, r.oom_killed), (0, false), "{r:?}");
    // In another session as well (its own chronus).
    let r = sb.sh("other", "python3 -c 'x = bytearray(1 << 30)'").await;
    assert_eq!((r.exit_code, r.oom_killed), (137, true), "{r:?}");
    sb.stop().await;
}

/// Item 3 (a session's state is never lost silently): a command that kills its session's
/// chronus fails `not_found` ("the command was lost"), a retry of it (same request id) is
/// refused instead of run again in the new session, and the first command of that new
/// session has `state_lost`, as its directory and variables are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_kills_its_chronus_is_lost_once_and_says_so() {
    if !root_or_skip() {
        return;
    }
    let sb = Sb::new("cb-12", spec()).await;
    let r = sb.sh("default", "cd /tmp && export A=1").await;
    assert_eq!((r.exit_code, r.state_lost), (0, false), "{r:?}");
    let mut c = sb.client().await;
    // $PPID of the command is the session shell's parent: chronus.
    let req = pb::RunShellRequest {
        sandbox_id: sb.id.clone(),
        cmd: "echo ran >> /tmp/runs; kill -9 $PPID; sleep 2".into(),
        session: "default".into(),
        request_id: "rq-kill".into(),
        timeout: 30.0,
        ..Default::default()
    };
    for attempt in ["first", "retry"] {
        let e = c.run_shell(req.clone()).await.expect_err(attempt);
        let f = opendsec::rpc::failure_from_status(&e);
        assert_eq!(f.reason, Reason::NotFound, "{attempt}: {f:?}");
        assert!(f.message.contains("ended while it ran"), "{attempt}: {f:?}");
    }
    let r = sb.sh("default", "pwd; echo A=$A; cat /tmp/runs").await;
    assert_eq!(
        (r.stdout.as_slice(), r.state_lost),
        (&b"/root\nA=\nran\n"[..], true),
        "{r:?}"
    );
    let r = sb.sh("default", "true").await;
    assert_eq!((r.exit_code, r.state_lost), (0, false), "{r:?}");
    sb.stop().await;
}

/// Item 1 (a timeout is a hard stop) against a hostile session: junk its own user writes
/// to the session's control FIFO (no NUL, as `echo` writes) spoiled the next report, and
/// that session's later commands hung past their timeouts. They now run normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn junk_on_the_control_fifo_does_not_hang_the_session() {
    if !root_or_skip() {
        return;
    }
    let sb = Sb::new("cb-13", spec()).await;
    let junk = "n=0; for f in /run/opendsec/sessions/*/ctl; do echo junk > $f && n=$((n+1)); \
                printf 'more junk' > $f; done; echo wrote $n";
    for (cmd, want) in [
        (junk, "wrote 1\n"),
        ("echo next", "next\n"),
        ("cd /tmp && echo again", "again\n"),
        ("pwd", "/tmp\n"),
    ] {
        let r = tokio::time::timeout(std::time::Duration::from_secs(10), sb.sh("default", cmd))
            .await
            .unwrap_or_else(|_| panic!("{cmd}: the session hung"));
        assert_eq!(
            (
                r.exit_code,
                r.timed_out,
                String::from_utf8_lossy(&r.stdout).as_ref()
            ),
            (0, false, want),
            "{cmd}: {r:?}"
        );
    }
    sb.stop().await;
}

/// An unprivileged session cannot become the sandbox's root through a setuid program: a
/// setuid-root copy of `id` left in /tmp by the root session runs as the session's user
/// (`no_new_privs`), while the root session is unchanged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setuid_programs_give_an_unprivileged_session_nothing() {
    if !root_or_skip() {
        return;
    }
    let sb = Sb::new("cb-14", spec()).await;
    let r = sb
        .sh(
            "default",
            "cp /usr/bin/id /tmp/sid && chmod 4755 /tmp/sid && /tmp/sid -u; \
             grep NoNewPrivs /proc/self/status",
        )
        .await;
    assert_eq!(r.stdout, b"0\nNoNewPrivs:\t0\n", "{r:?}");
    let mut c = sb.client().await;
    let r = c
        .run_shell(pb::RunShellRequest {
            sandbox_id: sb.id.clone(),
            cmd: "/tmp/sid -u; grep NoNewPrivs /proc/self/status".into(),
            session: "nobody".into(),
            user: "65534:65534".into(),
            timeout: 30.0,
            ..Default::default()
        })
        .await
        .expect("run_shell")
        .into_inner();
    assert_eq!(r.stdout, b"65534\nNoNewPrivs:\t1\n", "{r:?}");
    sb.stop().await;
}

/// Item: files. A FIFO, socket or device is `invalid` at once (a FIFO blocked the call for
/// ever); a full disk is `invalid` naming disk_mb, not `no_capacity`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn special_files_and_a_full_disk_are_invalid() {
    if !root_or_skip() {
        return;
    }
    let mut s = spec();
    s.disk_mb = 64;
    let sb = Sb::new("cb-11", s).await;
    let r = sb
        .sh(
            "default",
            "mkfifo /tmp/fifo && python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"/tmp/sock\")'",
        )
        .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let mut c = sb.client().await;
    for p in ["/tmp/fifo", "/tmp/sock", "/dev/null", "/dev/zero"] {
        let call = c.read_file(pb::ReadFileRequest {
            sandbox_id: sb.id.clone(),
            path: p.into(),
            ..Default::default()
        });
        let e = tokio::time::timeout(std::time::Duration::from_secs(10), call)
            .await
            .unwrap_or_else(|_| panic!("read_file {p} blocked"))
            .expect_err(p);
        let f = opendsec::rpc::failure_from_status(&e);
        assert_eq!(f.reason, Reason::Invalid, "{p}: {f:?}");
        assert!(f.message.contains("not a regular file"), "{p}: {f:?}");
    }
    let r = sb
        .sh("default", "dd if=/dev/zero of=/fill bs=1M count=100 2>&1")
        .await;
    assert!(
        String::from_utf8_lossy(&r.stdout).contains("No space left"),
        "{r:?}"
    );
    let e = c
        .write_file(pb::WriteFileRequest {
            sandbox_id: sb.id.clone(),
            path: "/tmp/more".into(),
            data: vec![7u8; 4 << 20],
            ..Default::default()
        })
        .await
        .expect_err("disk full");
    let f = opendsec::rpc::failure_from_status(&e);
    assert_eq!(f.reason, Reason::Invalid, "{f:?}");
    assert!(
        f.message
            .contains("no space left on the sandbox's disk (disk_mb 64)"),
        "{f:?}"
    );
    sb.stop().await;
}

async fn shell_in(
    b: &Arc<dyn Backend>,
    h: &Handle<'_>,
    session: &str,
    cmd: &str,
    background: bool,
) -> pb::ShellResult {
    let rt = b.runtime().expect("runtime capability");
    let ch = rt.channel(h).await.expect("channel");
    let mut c = RuntimeClient::new(ch);
    c.run_shell(pb::RunShellRequest {
        sandbox_id: h.sandbox_id.into(),
        cmd: cmd.into(),
        timeout: 30.0,
        session: session.into(),
        background,
        ..Default::default()
    })
    .await
    .expect("run_shell")
    .into_inner()
}

/// The sandbox's cgroup directory holding the pids controller (v1 `pids`, or v2).
fn pids_cgroup(edge: &str, id: &str) -> PathBuf {
    let v1 = Path::new("/sys/fs/cgroup/pids/opendsec")
        .join(edge)
        .join(id);
    if v1.is_dir() {
        return v1;
    }
    Path::new("/sys/fs/cgroup/opendsec").join(edge).join(id)
}

fn read_trim(p: &Path) -> String {
    std::fs::read_to_string(p)
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
        .trim()
        .to_string()
}

/// A backend of edge `edge` whose sandboxes have `pids_max` 512 (448 per session), and one
/// sandbox `<edge>.<name>` of `cpu` cores made with it: its id, spec and state.
async fn pids_512_sandbox(
    state: &Path,
    edge: &str,
    name: &str,
    cpu: f64,
) -> (
    Arc<dyn Backend>,
    String,
    pb::SandboxSpec,
    opendsec::backends::BackendState,
) {
    let cfg = BackendConfig {
        runtime: "linux".into(),
        pids_max: 512,
        ..Default::default()
    };
    let b = match backends::build("container", &cfg, &ctx(state, edge)) {
        Ok(b) => b,
        Err(e) => panic!("building the container backend: {e}"),
    };
    let id = format!("{edge}.{name}");
    let mut spec = spec();
    spec.cpu_cores_limit = cpu;
    let st = b
        .create(&CreateRequest {
            fork: None,
            snapshot: None,
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: spec.clone(),
        })
        .await
        .expect("create");
    (b, id, spec, st)
}

/// A fork bomb fills the workload's pids_max in one session; the agents live in a sibling
/// cgroup with their own pids and a high CPU weight, so a new session still starts, another
/// session still answers, and stop wins the race against the bomb.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_bomb_does_not_starve_the_agents_and_stop_wins() {
    if !root_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path();
    let edge = "cb-bomb";
    let (b, id, spec, st) = pids_512_sandbox(state, edge, "bomb", 0.5).await;
    let h = Handle {
        sandbox_id: &id,
        spec: &spec,
        state: &st,
    };
    // The layout: the shell in workload/, aether (PID 1) in agent/, with their limits.
    let r = shell_in(
        &b,
        &h,
        "other",
        "grep pids /proc/self/cgroup || cat /proc/self/cgroup; echo --; grep pids /proc/1/cgroup || cat /proc/1/cgroup",
        false,
    )
    .await;
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    let Some((mine, aether)) = out.split_once("--") else {
        panic!("no \"--\" in the output: {r:?}");
    };
    // The session's own cgroup below workload/ (the warm `default` session has s1).
    let Some(session_cg) = mine.lines().find_map(|l| {
        l.split_once(":/workload/")
            // `s<N>/c<id>`: the command's own cgroup is below its session's.
            .and_then(|(_, s)| s.trim().split('/').next().map(str::to_string))
    }) else {
        panic!("the shell is not in a session cgroup below workload/: {out}");
    };
    assert!(session_cg.starts_with('s'), "{out}");
    assert!(aether.contains("/agent"), "{out}");
    let pids = pids_cgroup(edge, &id);
    assert_eq!(read_trim(&pids.join("workload/pids.max")), "512");
    // Each session may take all but a margin of the workload's pids_max.
    assert_eq!(
        read_trim(&pids.join("workload").join(&session_cg).join("pids.max")),
        "448"
    );
    assert!(read_trim(&pids.join("agent/pids.max"))
        .parse::<i64>()
        .is_ok());

    let r = shell_in(&b, &h, "bomb", ":(){ :|:& };:", true).await;
    assert!(r.cmd_id > 0, "{r:?}");
    let current = pids.join("workload/pids.current");
    let deadline = std::time::Instant::now() + scaled(30.0);
    while read_trim(&current).parse::<i64>().unwrap_or(0) < 440 {
        assert!(
            std::time::Instant::now() < deadline,
            "the bomb never filled the workload: {}",
            read_trim(&current)
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }

    // The bomb is held at its session's limit: the other sessions keep the margin.
    assert!(read_trim(&current).parse::<i64>().unwrap_or(0) <= 460);
    // While it runs, a new session's first command and a command in another session
    // answer (each forks a job from its session's shell: without a cgroup per session,
    // bash waited in its fork retries for 16.8 s here). The bound is loose: the machine
    // is shared; the requirement is 1 s.
    for (session, cmd, want) in [
        ("fresh", "echo fresh", "fresh\n"),
        ("other", "true", ""),
        ("fresh", "echo again", "again\n"),
    ] {
        let t = std::time::Instant::now();
        let r = shell_in(&b, &h, session, cmd, false).await;
        let took = t.elapsed();
        assert_eq!(
            (r.exit_code, String::from_utf8_lossy(&r.stdout).as_ref()),
            (0, want),
            "{session}: {r:?}"
        );
        assert!(
            took < scaled(8.0),
            "{session} {cmd:?} took {took:?} during the bomb"
        );
    }
    // The bomb is still at it.
    assert!(read_trim(&current).parse::<i64>().unwrap_or(0) >= 400);

    // Closing the bomb's session ends all of it, the orphans that left the session's
    // process tree included (they are in its cgroup), and removes its cgroup.
    let sessions: BTreeSet<PathBuf> = std::fs::read_dir(pids.join("workload"))
        .expect("workload dir")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.is_dir())
        .collect();
    {
        let rt = b.runtime().expect("runtime capability");
        let mut c = RuntimeClient::new(rt.channel(&h).await.expect("channel"));
        c.close_session(pb::CloseSessionRequest {
            sandbox_id: id.clone(),
            session: "bomb".into(),
        })
        .await
        .expect("close the bomb's session");
    }
    let deadline = std::time::Instant::now() + scaled(20.0);
    loop {
        let now: BTreeSet<PathBuf> = std::fs::read_dir(pids.join("workload"))
            .expect("workload dir")
            .flatten()
            .map(|e| e.path())
            .filter(|p| p.is_dir())
            .collect();
        let n = read_trim(&current).parse::<i64>().unwrap_or(0);
        if now.len() + 1 == sessions.len() && n < 20 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the closed bomb session left {n} processes, cgroups {now:?} (before {sessions:?})"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    // Another bomb for stop to race.
    let _ = shell_in(&b, &h, "bomb2", ":(){ :|:& };:", true).await;
    let deadline = std::time::Instant::now() + scaled(30.0);
    while read_trim(&current).parse::<i64>().unwrap_or(0) < 400 {
        assert!(
            std::time::Instant::now() < deadline,
            "the second bomb never filled up"
        );
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }

    let t = std::time::Instant::now();
    b.stop(&h).await.expect("stop wins against the bomb");
    assert!(t.elapsed() < scaled(10.0), "stop took {:?}", t.elapsed());
    assert_eq!(leftovers(state, edge, &id), Vec::<String>::new());
    b.release_node().await.expect("release");
}

/// A creation that fails after its disk, directory and cgroup exist leaves none of them
/// behind at once, and a failed cleanup step keeps both errors and the other steps run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_creation_leaves_nothing_on_the_node() {
    if !root_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path().join("state");
    let edge = "cb-fail";
    // An image whose lower directory is not there: setup fails at the overlay mount,
    // after the disk, its loop device and the cgroup were made.
    let b = backend_with(
        &state,
        edge,
        BTreeMap::from([("gone".to_string(), vec![tmp.path().join("no-such-layer")])]),
    );
    let id = format!("{edge}.gone");
    let mut s = spec();
    s.image = "gone".into();
    let e = b
        .create(&CreateRequest {
            fork: None,
            snapshot: None,
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: s,
        })
        .await
        .expect_err("a missing lower fails");
    assert!(e.to_string().contains("overlay"), "{e}");
    assert_eq!(leftovers(&state, edge, &id), Vec::<String>::new());

    // The disk image's place is taken by a directory: creating fails, and so does removing
    // the disk in the cleanup; the sandbox's directory still goes, and the error says both.
    let id = format!("{edge}.blocked");
    let blocker = state.join(edge).join("disks").join(format!("{id}.img"));
    std::fs::create_dir_all(blocker.join("x")).expect("blocker");
    let e = b
        .create(&CreateRequest {
            fork: None,
            snapshot: None,
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: spec(),
        })
        .await
        .expect_err("blocked disk fails");
    let msg = e.to_string();
    assert!(msg.contains("renaming"), "primary error kept: {msg}");
    assert!(msg.contains("cleaning up"), "cleanup error kept: {msg}");
    assert!(!state.join(edge).join("containers").join(&id).exists());
    std::fs::remove_dir_all(&blocker).expect("unblock");
    assert_eq!(leftovers(&state, edge, &id), Vec::<String>::new());

    // The edge exits: its own cgroup parent goes from every hierarchy.
    b.release_node().await.expect("release");
    if let Ok(rd) = std::fs::read_dir("/sys/fs/cgroup") {
        for h in rd.flatten() {
            let p = h.path().join("opendsec").join(edge);
            assert!(!p.exists(), "{} left behind", p.display());
        }
    }
}

/// Closing a session ends what it started, a daemon whose parent exited included, and
/// removes the session's cgroup; so does a chronus killed from outside (its orphans would
/// otherwise live on under aether, in a cgroup nobody removes). Other sessions are
/// untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_a_session_ends_its_daemons_and_removes_its_cgroup() {
    if !root_or_skip() {
        return;
    }
    let sb = Sb::new("cb-close", spec()).await;
    let keep = sb.sh("keep", "sleep 1001 & echo started").await;
    assert_eq!(keep.stdout, b"started\n", "{keep:?}");
    let r = sb
        .sh(
            "gone",
            "(sleep 1000 </dev/null >/dev/null 2>&1 &); cat /proc/self/cgroup",
        )
        .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let pids = pids_cgroup("cb-close", &sb.id);
    let dir = session_of(&pids, &String::from_utf8_lossy(&r.stdout));
    let held = || {
        read_trim(&dir.join("pids.current"))
            .parse::<i64>()
            .unwrap_or(0)
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    // The daemon is there beside the shell (the subshell that started it has exited).
    while held() != 2 {
        assert!(
            std::time::Instant::now() < deadline,
            "no daemon: {}",
            held()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    let gone_after = |dir: &Path, what: &str| {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while dir.exists() {
            if std::time::Instant::now() >= deadline {
                let held: Vec<String> = std::fs::read_to_string(dir.join("cgroup.procs"))
                    .unwrap_or_default()
                    .lines()
                    .map(|p| {
                        let st = std::fs::read_to_string(format!("/proc/{p}/status"))
                            .unwrap_or_default();
                        let keep: Vec<&str> = st
                            .lines()
                            .filter(|l| {
                                ["Name:", "State:", "PPid:", "NSpid:"]
                                    .iter()
                                    .any(|k| l.starts_with(k))
                            })
                            .collect();
                        format!("{p}: {}", keep.join(" "))
                    })
                    .collect();
                panic!("{what}: the session's cgroup is still there, holding {held:?}");
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    };
    sb.client()
        .await
        .close_session(pb::CloseSessionRequest {
            sandbox_id: sb.id.clone(),
            session: "gone".into(),
        })
        .await
        .expect("close");
    gone_after(&dir, "closed");

    // Again, but its chronus is killed from outside the sandbox.
    let r = sb
        .sh(
            "crashed",
            "(sleep 1000 </dev/null >/dev/null 2>&1 &); cat /proc/self/cgroup",
        )
        .await;
    let dir = session_of(&pids, &String::from_utf8_lossy(&r.stdout));
    let session_dir =
        opendsec::guest::aether::sessions::session_dir(Path::new("/run/opendsec"), "crashed");
    let agents = pids_cgroup("cb-close", &sb.id).join("agent/cgroup.procs");
    let chronus: Vec<i32> = std::fs::read_to_string(&agents)
        .expect("agent procs")
        .lines()
        .filter_map(|l| l.trim().parse::<i32>().ok())
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| {
                String::from_utf8_lossy(&c).contains(session_dir.to_str().unwrap_or("?"))
            })
        })
        .collect();
    assert_eq!(chronus.len(), 1, "the crashed session's chronus");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(chronus[0]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("kill chronus");
    gone_after(&dir, "chronus killed");

    let r = sb.sh("keep", "pgrep -f 'sleep 100[01]' | wc -l").await;
    assert_eq!(
        String::from_utf8_lossy(&r.stdout).trim(),
        "1",
        "only the other session's sleep is left: {r:?}"
    );
    sb.stop().await;
}

/// Kills everything in a sandbox's pids cgroup when the test fails before its stop, so that
/// a fork bomb left running does not load the machine for the tests after it.
struct ReapOnPanic(PathBuf);

impl Drop for ReapOnPanic {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        let _ = std::fs::write(self.0.join("pids.max"), "0");
        for _ in 0..50 {
            let mut any = false;
            for e in walkdir(&self.0) {
                for p in std::fs::read_to_string(e.join("cgroup.procs"))
                    .unwrap_or_default()
                    .lines()
                    .filter_map(|l| l.trim().parse::<i32>().ok())
                {
                    any = true;
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(p),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
            if !any {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(100));
        }
    }
}

/// `dir` and every directory below it.
fn walkdir(dir: &Path) -> Vec<PathBuf> {
    let mut out = vec![dir.to_path_buf()];
    let mut i = 0;
    while let Some(d) = out.get(i).cloned() {
        out.extend(
            std::fs::read_dir(&d)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir()),
        );
        i += 1;
    }
    out
}

/// Runs `cmd` in `session` (as `user`, "" for the session's) with `timeout` seconds.
async fn run_timed(
    b: &Arc<dyn Backend>,
    h: &Handle<'_>,
    session: &str,
    user: &str,
    cmd: &str,
    timeout: f64,
) -> (pb::ShellResult, std::time::Duration) {
    let rt = b.runtime().expect("runtime capability");
    let mut c = RuntimeClient::new(rt.channel(h).await.expect("channel"));
    let t = std::time::Instant::now();
    let r = c
        .run_shell(pb::RunShellRequest {
            sandbox_id: h.sandbox_id.into(),
            cmd: cmd.into(),
            timeout,
            session: session.into(),
            user: user.into(),
            ..Default::default()
        })
        .await
        .expect("run_shell")
        .into_inner();
    (r, t.elapsed())
}

/// How much slower than this machine the tests run: 1, or `OPENDSEC_TEST_TIME_SCALE` where a
/// slower place sets it (scripts/v2-guest.sh sets it for its emulated guest). It widens the
/// time a test gives a command to do something, never what the test asserts of the outcome.
fn time_scale() -> f64 {
    std::env::var("OPENDSEC_TEST_TIME_SCALE")
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| *s >= 1.0)
        .unwrap_or(1.0)
}

/// `secs` seconds, widened by [`time_scale`].
fn scaled(secs: f64) -> std::time::Duration {
    std::time::Duration::from_secs_f64(secs * time_scale())
}

/// The session cgroup (below the sandbox's pids cgroup) that a command's
/// `/proc/self/cgroup` names: `/workload/s<N>/c<id>` gives `workload/s<N>`.
fn session_of(pids: &Path, out: &str) -> PathBuf {
    let Some(path) = out
        .lines()
        .find_map(|l| l.split_once(":pids:").map(|(_, p)| p.trim().to_string()))
        .or_else(|| {
            out.lines()
                .find_map(|l| l.strip_prefix("0::").map(str::to_string))
        })
    else {
        panic!("no cgroup in {out:?}");
    };
    let parts: Vec<&str> = path.trim_start_matches('/').split('/').collect();
    assert!(
        parts.len() == 3
            && parts[0] == "workload"
            && parts[1].starts_with('s')
            && parts[2].starts_with('c'),
        "a command runs in a cgroup of its own below its session's: {path:?} in {out:?}"
    );
    pids.join(parts[0]).join(parts[1])
}

/// A timeout stops the whole command, whatever it does: a script that would go on, a busy
/// loop, processes that ignore SIGTERM or left its process group and tree (`setsid` of an
/// orphan), a python fork storm and a bash fork bomb at the session's pids limit. Each
/// returns within its timeout plus a little, leaves no process behind, and the session's
/// state stays; the same for a session of a user other than root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_stops_the_whole_command_fork_storms_included() {
    if !root_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let edge = "cb-timeout";
    let (b, id, spec, st) = pids_512_sandbox(tmp.path(), edge, "t", 1.0).await;
    let h = Handle {
        sandbox_id: &id,
        spec: &spec,
        state: &st,
    };
    let pids = pids_cgroup(edge, &id);
    let _reap = ReapOnPanic(pids.clone());
    let (r, _) = run_timed(
        &b,
        &h,
        "storm",
        "",
        "cd /usr && export Z=kept && cat /proc/self/cgroup",
        10.0,
    )
    .await;
    assert_eq!(r.exit_code, 0, "{r:?}");
    let session = session_of(&pids, &String::from_utf8_lossy(&r.stdout));
    let current = |dir: &Path| {
        read_trim(&dir.join("pids.current"))
            .parse::<i64>()
            .unwrap_or(-1)
    };
    // Only the session's shell is left in its cgroup (its commands' cgroups included).
    let settles = |dir: PathBuf, what: String| async move {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while current(&dir) != 1 {
            if std::time::Instant::now() >= deadline {
                let mut held = Vec::new();
                for d in std::iter::once(dir.clone()).chain(
                    std::fs::read_dir(&dir)
                        .into_iter()
                        .flatten()
                        .flatten()
                        .map(|e| e.path())
                        .filter(|p| p.is_dir()),
                ) {
                    for p in std::fs::read_to_string(d.join("cgroup.procs"))
                        .unwrap_or_default()
                        .lines()
                    {
                        let comm = std::fs::read_to_string(format!("/proc/{p}/cmdline"))
                            .unwrap_or_default()
                            .replace('\0', " ");
                        held.push(format!("{}: {p} {comm}", d.display()));
                    }
                }
                panic!("{what} left {} processes: {held:#?}", current(&dir));
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    };
    settles(session.clone(), "the first command".into()).await;

    let python_storm = "python3 -c 'import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass'";
    let storms: [(&str, f64, i64); 6] = [
        ("sleep 5; touch /tmp/x; sleep 40", 1.0, 0),
        ("while :; do :; done", 1.0, 0),
        (
            "trap '' TERM; bash -c 'trap \"\" TERM; sleep 100' & (setsid sleep 101 &); sleep 102",
            1.0,
            0,
        ),
        (python_storm, 2.0, 300),
        // The bomb goes to the background at once; the command waits in the foreground. Its
        // `sleep` is forked first and `wait` forks nothing: a shell whose fork fails at the
        // pids limit retries for 15 s and then SIGTERMs its own group, ending the command
        // (exit 143) before a slow machine's timeout.
        ("sleep 100 & s=$!; :(){ :|:& };:; wait $s", 3.0, 300),
        // The orphan of a subshell that left its group and its tree: found by its cgroup only.
        (
            "(setsid bash -c 'sleep 103' </dev/null >/dev/null 2>&1 &); sleep 104",
            1.0,
            0,
        ),
    ];
    for (cmd, timeout, fills) in storms {
        // Under emulation (scripts/v2-guest.sh) a storm needs longer to fill its share. The
        // others keep their timeout: it is what they test (`sleep 5; touch` must not touch).
        let timeout = if fills > 0 {
            timeout * time_scale()
        } else {
            timeout
        };
        let peak = Arc::new(std::sync::atomic::AtomicI64::new(0));
        let watch = {
            let (peak, dir) = (peak.clone(), session.clone());
            tokio::spawn(async move {
                loop {
                    peak.fetch_max(current(&dir), std::sync::atomic::Ordering::Relaxed);
                    tokio::time::sleep(std::time::Duration::from_millis(20)).await;
                }
            })
        };
        let (r, took) = run_timed(&b, &h, "storm", "", cmd, timeout).await;
        watch.abort();
        assert!(
            r.timed_out,
            "{cmd:?}: exit {} after {took:?}, stderr {:?}",
            r.exit_code,
            String::from_utf8_lossy(&r.stderr)
                .chars()
                .take(300)
                .collect::<String>()
        );
        // The requirement is the timeout plus 2 s; the bound is looser, the machine shared.
        assert!(
            took < std::time::Duration::from_secs_f64(timeout + 4.0 * time_scale()),
            "{cmd:?}: a {timeout} s timeout returned after {took:?}"
        );
        let peak = peak.load(std::sync::atomic::Ordering::Relaxed);
        eprintln!("{cmd:?}: timeout {timeout} s, returned after {took:?}, peak {peak} processes");
        assert!(peak >= fills, "{cmd:?} reached only {peak} processes");
        settles(session.clone(), format!("{cmd:?}")).await;
        let (r, _) = run_timed(&b, &h, "storm", "", "pwd; echo $Z", 10.0).await;
        assert_eq!(
            String::from_utf8_lossy(&r.stdout),
            "/usr\nkept\n",
            "{cmd:?}: {r:?}"
        );
    }
    let (r, _) = run_timed(
        &b,
        &h,
        "storm",
        "",
        "sleep 6; test -e /tmp/x && echo there || echo absent",
        20.0,
    )
    .await;
    assert_eq!(
        r.stdout, b"absent\n",
        "the script went on after its timeout"
    );
    // A command that forges its own end report on the session's control FIFO (anything in
    // the session can write there) and goes on running is not believed: its timeout still
    // ends it. The FIFO and the command's id are found from its output file's path.
    let forge = "P=$BASHPID; O=$(readlink /proc/$P/fd/1); I=${O##*/}; I=${I%.out}; \
                 C=${O%/io/*}/ctl; printf '%s 0 0 /forged\\0' $I >> $C; exec -a forger sleep 1050";
    let (r, took) = run_timed(&b, &h, "storm", "", forge, 1.0).await;
    assert!(
        r.timed_out,
        "a forged end report was believed after {took:?}: {r:?}"
    );
    assert!(took < std::time::Duration::from_secs(5), "took {took:?}");
    settles(session.clone(), "the forger".into()).await;
    let (r, _) = run_timed(&b, &h, "storm", "", "pwd; echo $Z", 10.0).await;
    assert_eq!(String::from_utf8_lossy(&r.stdout), "/usr\nkept\n", "{r:?}");

    // What a command leaves running when it ends on its own stays (its cgroup with it).
    let (r, _) = run_timed(&b, &h, "storm", "", "sleep 105 & echo started", 10.0).await;
    assert_eq!(r.stdout, b"started\n", "{r:?}");
    let (r, _) = run_timed(&b, &h, "storm", "", "pgrep -xc sleep", 10.0).await;
    assert_eq!(r.stdout, b"1\n", "the daemon stays: {r:?}");

    // A session of another user: its chronus makes its commands' cgroups too.
    let (r, _) = run_timed(
        &b,
        &h,
        "nobody",
        "nobody",
        "id -u; cat /proc/self/cgroup",
        10.0,
    )
    .await;
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    assert!(out.starts_with("65534\n"), "{r:?}");
    let theirs = session_of(&pids, &out);
    settles(theirs.clone(), "nobody's first command".into()).await;
    let (r, took) = run_timed(
        &b,
        &h,
        "nobody",
        "",
        "(setsid bash -c 'sleep 106' </dev/null >/dev/null 2>&1 &); sleep 107",
        1.0,
    )
    .await;
    assert!(r.timed_out, "{r:?}");
    assert!(took < std::time::Duration::from_secs(5), "took {took:?}");
    settles(theirs, "nobody's timed-out command".into()).await;

    b.stop(&h).await.expect("stop");
    b.release_node().await.expect("release");
}

/// The loop devices of prepared disks (spare images) under `state`.
fn spare_devices(state: &Path) -> Vec<PathBuf> {
    opendsec::sys::loopdev::attached(state)
        .into_iter()
        .filter(|(_, backing)| backing.to_string_lossy().contains("/.spare/"))
        .map(|(dev, _)| dev)
        .collect()
}

async fn wait_for_spares(state: &Path, n: usize) {
    let end = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while spare_devices(state).len() != n {
        assert!(
            std::time::Instant::now() < end,
            "{} prepared disks, wanted {n}",
            spare_devices(state).len()
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// Prepared disks (docs/architecture.md "Prepared disks"): the backend keeps two disks of
/// its default size attached and mounted ahead of time; a creation of that size takes one
/// (the sandbox's loop device was a spare's, and it works as the sandbox's disk), another
/// is made, and releasing the node leaves no loop device, mount or spare image behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prepared_disks_are_taken_and_none_outlives_the_backend() {
    if !root_or_skip() {
        return;
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    let state = tmp.path();
    let b = backend(state, "cb-pd");
    wait_for_spares(state, 2).await;
    let spares: HashSet<PathBuf> = spare_devices(state).into_iter().collect();
    let mut s = spec();
    s.disk_mb = BackendConfig::default().default_disk_mb();
    let id = "cb-pd.a".to_string();
    let st = b
        .create(&CreateRequest {
            fork: None,
            snapshot: None,
            sandbox_id: id.clone(),
            project: "root".into(),
            spec: s.clone(),
        })
        .await
        .expect("create");
    let dev = st["loop_device"].as_str().expect("loop_device").to_string();
    let minor = dev.split_once(':').map(|(_, m)| m).unwrap_or_default();
    assert!(
        spares.contains(&PathBuf::from(format!("/dev/loop{minor}"))),
        "the sandbox's disk {dev} was not one of the prepared {spares:?}"
    );
    let h = Handle {
        sandbox_id: &id,
        spec: &s,
        state: &st,
    };
    let r = shell(
        &b,
        &h,
        "echo kept > /tmp/f && cat /tmp/f && df -k / | tail -1",
    )
    .await;
    let out = String::from_utf8_lossy(&r.stdout).to_string();
    assert!(r.exit_code == 0 && out.starts_with("kept\n"), "{r:?}");
    wait_for_spares(state, 2).await;
    b.stop(&h).await.expect("stop");
    b.release_node().await.expect("release");
    assert_eq!(spare_devices(state), Vec::<PathBuf>::new());
    assert_eq!(leftovers(state, "cb-pd", &id), Vec::<String>::new());
    let spare_dir = state.join("cb-pd").join("disks").join(".spare");
    assert!(!spare_dir.exists(), "{} is left", spare_dir.display());
    let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    assert!(!mounts.contains(".spare"), "{mounts}");
}
