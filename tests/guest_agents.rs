//! aether and chronus end to end: the real binary as `opendsec aether --config ...` on a
//! unix socket in a temp dir, driven through `RuntimeClient`. Needs root (sessions of
//! another user); each test starts its own aether and stops it (by pid) at the end.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::HashMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use futures::StreamExt;
use opendsec::pb::{self, runtime_client::RuntimeClient, shell_chunk::Kind};
use opendsec::rpc::failure_from_status;
use opendsec::types::Reason;
use tonic::transport::Channel;

use opendsec::sys::root_or_skip;

/// How aether gets its socket and its place.
enum Launch {
    /// It binds `socket`.
    Socket,
    /// It takes an inherited listening fd 3.
    InheritedFd,
    /// PID 1 of a new pid namespace (the child is `unshare`).
    Pid1,
}

struct Agent {
    child: Child,
    dir: tempfile::TempDir,
    c: RuntimeClient<Channel>,
}

impl Agent {
    /// Starts aether; `limits` lowers chronus's output limits (`record,session,call`).
    async fn start(limits: Option<&str>) -> Agent {
        Agent::start_with(limits, Launch::Socket).await
    }

    async fn start_with(limits: Option<&str>, how: Launch) -> Agent {
        let dir = tempfile::tempdir().expect("tempdir");
        // Sessions of uid 1000 must reach their own dir under run/.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))
            .expect("chmod");
        let sock = dir.path().join("aether.sock");
        let bin = env!("CARGO_BIN_EXE_opendsec");
        let mut cfg = serde_json::json!({
            "sandbox_id": "test",
            "socket": sock,
            "run_dir": dir.path().join("run"),
            "agent": bin,
            "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8"},
            "protect_from_oom": true,
            // Where chronus counts OOM kills; a test may put a counter there.
            "cgroup_dir": dir.path().join("cg"),
        });
        let cfg_path = dir.path().join("aether.json");
        let mut cmd = match how {
            Launch::Socket => Command::new(bin),
            Launch::InheritedFd => {
                // As the container setup does: bound outside, handed down as fd 3.
                let l = std::os::unix::net::UnixListener::bind(&sock).expect("bind");
                cfg["socket"] = "".into();
                cfg["listen_fd"] = 3.into();
                // Handed over as bash's stdin (std dups it in the child only), moved to 3.
                let mut c = Command::new("bash");
                c.arg("-c")
                    .arg("exec 3<&0 0</dev/null; exec \"$0\" \"$@\"")
                    .arg(bin)
                    .stdin(std::process::Stdio::from(std::os::fd::OwnedFd::from(l)));
                c
            }
            Launch::Pid1 => {
                cfg["pid1"] = true.into();
                let mut c = Command::new("unshare");
                c.args(["--pid", "--fork", "--mount-proc", "--kill-child"])
                    .arg(bin);
                c
            }
        };
        std::fs::write(&cfg_path, cfg.to_string()).expect("config");
        cmd.arg("aether").arg("--config").arg(&cfg_path);
        cmd.env("OPENDSEC_LOG", "warn");
        match limits {
            Some(l) => cmd.env("OPENDSEC_CHRONUS_LIMITS", l),
            None => cmd.env_remove("OPENDSEC_CHRONUS_LIMITS"),
        };
        let child = cmd.spawn().expect("spawn aether");
        let deadline = Instant::now() + Duration::from_secs(20);
        let c = loop {
            if sock.exists() {
                if let Ok(c) = opendsec::guest::uds::connect(&sock).await {
                    break c;
                }
            }
            assert!(Instant::now() < deadline, "aether did not start");
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        Agent { child, dir, c }
    }

    fn path(&self, p: &str) -> PathBuf {
        self.dir.path().join(p)
    }

    /// SIGTERM (aether closes its sessions), then SIGKILL if it lingers.
    fn stop(mut self) {
        let pid = nix::unistd::Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    async fn run(&mut self, r: pb::RunShellRequest) -> pb::ShellResult {
        self.c.run_shell(r).await.expect("run_shell").into_inner()
    }

    async fn sh(&mut self, cmd: &str) -> pb::ShellResult {
        self.run(req(cmd)).await
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        // A failed test must not leave its aether behind.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn req(cmd: &str) -> pb::RunShellRequest {
    pb::RunShellRequest {
        cmd: cmd.into(),
        ..Default::default()
    }
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn reason(s: tonic::Status) -> Reason {
    failure_from_status(&s).reason
}

fn alive(pid: i32) -> bool {
    opendsec::guest::proctree::alive(pid)
}

async fn wait_gone(pid: i32) -> bool {
    for _ in 0..100 {
        if !alive(pid) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

async fn read_pid(p: &Path) -> i32 {
    for _ in 0..200 {
        if let Ok(t) = std::fs::read_to_string(p) {
            if let Ok(pid) = t.trim().parse() {
                return pid;
            }
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("no pid in {}", p.display());
}

#[tokio::test]
async fn shell_state_exit_codes_and_bytes() {
    if !root_or_skip("shell_state_exit_codes_and_bytes") {
        return;
    }
    let mut a = Agent::start(None).await;
    let r = a.sh("cd /tmp && export X=1 && f() { echo fn; }").await;
    assert_eq!((r.cmd_id, r.exit_code, r.done), (1, 0, true));
    let r = a.sh("pwd; echo $X; f").await;
    assert_eq!((r.cmd_id, text(&r.stdout)), (2, "/tmp\n1\nfn\n".into()));

    let r = a.sh("echo out; echo err >&2; (exit 4)").await;
    assert_eq!(
        (r.exit_code, text(&r.stdout), text(&r.stderr)),
        (4, "out\n".into(), "err\n".into())
    );
    assert_eq!((r.stdout_total, r.stderr_total, r.truncated), (4, 4, false));

    // protect_from_oom: commands are the OOM killer's first choice.
    assert_eq!(
        text(&a.sh("cat /proc/self/oom_score_adj").await.stdout),
        "1000\n"
    );
    // A timeout too large for the clock is taken as "very long", not a crash.
    let mut q = req("echo long");
    q.timeout = 1e300;
    assert_eq!(text(&a.run(q).await.stdout), "long\n");

    // Commands read /dev/null, not the shell's command stream.
    let r = a.sh("cat; echo after-cat").await;
    assert_eq!(text(&r.stdout), "after-cat\n");

    let r = a.sh("if then fi (").await;
    assert_ne!(r.exit_code, 0);
    assert!(text(&r.stderr).contains("syntax"), "{}", text(&r.stderr));
    assert_eq!(text(&a.sh("echo $X; f").await.stdout), "1\nfn\n");

    let r = a.sh("echo bye; exit 3").await;
    assert_eq!((r.exit_code, text(&r.stdout)), (3, "bye\n".into()));
    let r = a.sh("pwd; echo ok").await;
    assert_eq!((r.exit_code, text(&r.stdout)), (0, "/tmp\nok\n".into()));

    // env and cwd apply to one command only.
    let mut q = req("pwd; echo $Y");
    q.cwd = "/".into();
    q.env = HashMap::from([("Y".to_string(), "it's 2".to_string())]);
    assert_eq!(text(&a.run(q).await.stdout), "/\nit's 2\n");
    assert_eq!(
        text(&a.sh("pwd; echo ${Y:-none}").await.stdout),
        "/tmp\nnone\n"
    );
    let mut bad = req("true");
    bad.env = HashMap::from([("A-B".to_string(), "x".to_string())]);
    assert_eq!(
        reason(a.c.run_shell(bad).await.expect_err("bad env")),
        Reason::Invalid
    );

    // Binary and UTF-8 output byte for byte.
    let r = a
        .sh(r"printf '\000\377\376 h\303\251llo \342\230\203'; printf '\001\002' >&2")
        .await;
    assert_eq!(r.stdout, b"\x00\xff\xfe h\xc3\xa9llo \xe2\x98\x83");
    assert_eq!(r.stderr, b"\x01\x02");

    let mut bad = req("true");
    bad.session = "a\nb".into();
    assert_eq!(
        reason(a.c.run_shell(bad).await.expect_err("name")),
        Reason::Invalid
    );
    a.stop();
}

#[tokio::test]
async fn timeouts_kill_what_the_command_started() {
    if !root_or_skip("timeouts_kill_what_the_command_started") {
        return;
    }
    let mut a = Agent::start(None).await;
    a.sh("export Z=kept").await;
    let pidfile = a.path("child.pid");
    let mut q = req(&format!(
        "trap '' TERM; bash -c 'trap \"\" TERM; echo $$ > {}; sleep 100'",
        pidfile.display()
    ));
    q.timeout = 1.0;
    let r = a.run(q).await;
    assert!(r.timed_out && r.done, "{r:?}");
    assert!(r.exit_code == -1 || r.exit_code == 137, "{r:?}");
    let child = read_pid(&pidfile).await;
    assert!(wait_gone(child).await, "child {child} survived");
    assert_eq!(text(&a.sh("echo $Z").await.stdout), "kept\n");

    // A builtin loop is the shell itself: it is restarted in the same directory.
    a.sh("cd /usr").await;
    let mut q = req("while :; do :; done");
    q.timeout = 0.5;
    let r = a.run(q).await;
    assert!(r.timed_out, "{r:?}");
    let r = a.sh("pwd").await;
    assert_eq!((r.exit_code, text(&r.stdout)), (0, "/usr\n".into()));

    // A background command's timeout kills its tree too.
    let bgpid = a.path("bg.pid");
    let mut q = req(&format!("sleep 100 & echo $! > {}; wait", bgpid.display()));
    q.background = true;
    q.timeout = 0.5;
    let id = a.run(q).await.cmd_id;
    let r =
        a.c.get_output(pb::GetOutputRequest {
            cmd_id: id,
            wait: 20.0,
            ..Default::default()
        })
        .await
        .expect("get_output")
        .into_inner();
    assert!(r.done && r.timed_out, "{r:?}");
    assert!(wait_gone(read_pid(&bgpid).await).await);
    a.stop();
}

#[tokio::test]
async fn background_commands_and_retries() {
    if !root_or_skip("background_commands_and_retries") {
        return;
    }
    let mut a = Agent::start(None).await;
    let mut q = req("sleep 1; echo done-bg; exit 6");
    q.background = true;
    let r = a.run(q).await;
    assert!(!r.done);
    let id = r.cmd_id;
    // Later commands are not blocked by it.
    assert_eq!(text(&a.sh("echo fg").await.stdout), "fg\n");
    let r =
        a.c.get_output(pb::GetOutputRequest {
            cmd_id: id,
            wait: 20.0,
            ..Default::default()
        })
        .await
        .expect("get_output")
        .into_inner();
    assert_eq!(
        (r.done, r.exit_code, text(&r.stdout)),
        (true, 6, "done-bg\n".into())
    );
    let e =
        a.c.get_output(pb::GetOutputRequest {
            cmd_id: 999,
            ..Default::default()
        })
        .await
        .expect_err("unknown");
    assert_eq!(reason(e), Reason::NotFound);
    let mut q = pb::GetOutputRequest {
        cmd_id: 1,
        ..Default::default()
    };
    q.session = "never-started".into();
    assert_eq!(
        reason(a.c.get_output(q).await.expect_err("no session")),
        Reason::NotFound
    );

    // A retry with the same request id, after the end and while running, runs nothing.
    let log = a.path("log");
    let mut q = req(&format!("echo x >> {}; echo hi", log.display()));
    q.request_id = "r1".into();
    let first = a.run(q.clone()).await;
    let again = a.run(q).await;
    assert_eq!(first.cmd_id, again.cmd_id);
    assert_eq!(text(&again.stdout), "hi\n");
    let slow = a.path("slow");
    let mut q = req(&format!("sleep 1; echo y >> {}", slow.display()));
    q.request_id = "r2".into();
    let mut c2 = a.c.clone();
    let q2 = q.clone();
    let t = tokio::spawn(async move { c2.run_shell(q2).await.expect("run").into_inner() });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let b = a.run(q).await;
    let f = t.await.expect("join");
    assert_eq!(f.cmd_id, b.cmd_id);
    assert_eq!(std::fs::read_to_string(&log).expect("log"), "x\n");
    assert_eq!(std::fs::read_to_string(&slow).expect("slow"), "y\n");
    a.stop();
}

async fn collect(
    mut s: tonic::Streaming<pb::ShellChunk>,
) -> (Vec<pb::ShellChunk>, Vec<u8>, Vec<u8>) {
    let mut all = Vec::new();
    let (mut out, mut err) = (Vec::new(), Vec::new());
    while let Some(m) = s.next().await {
        let m = m.expect("chunk");
        match &m.kind {
            Some(Kind::Stdout(d)) => {
                assert_eq!(m.offset as usize, out.len());
                out.extend_from_slice(d);
            }
            Some(Kind::Stderr(d)) => {
                assert_eq!(m.offset as usize, err.len());
                err.extend_from_slice(d);
            }
            _ => {}
        }
        all.push(m);
    }
    (all, out, err)
}

#[tokio::test]
async fn streams_resume_from_offsets() {
    if !root_or_skip("streams_resume_from_offsets") {
        return;
    }
    let mut a = Agent::start(None).await;
    let s =
        a.c.stream_shell(req(
            "for i in 1 2 3; do echo line$i; sleep 0.1; done; echo e >&2; exit 2",
        ))
        .await
        .expect("stream")
        .into_inner();
    let (all, out, err) = collect(s).await;
    let id = match all.first().and_then(|m| m.kind.clone()) {
        Some(Kind::Started(id)) => id,
        other => panic!("first message {other:?}"),
    };
    match all.last().and_then(|m| m.kind.clone()) {
        Some(Kind::Exit(r)) => {
            assert_eq!((r.cmd_id, r.exit_code, r.done), (id, 2, true));
            assert!(r.stdout.is_empty());
            assert_eq!(r.stdout_total, 18);
        }
        other => panic!("last message {other:?}"),
    }
    assert_eq!(
        (text(&out), text(&err)),
        ("line1\nline2\nline3\n".into(), "e\n".into())
    );

    // Resume the finished command from an offset.
    let mut s =
        a.c.stream_output(pb::GetOutputRequest {
            cmd_id: id,
            stdout_offset: 6,
            ..Default::default()
        })
        .await
        .expect("resume")
        .into_inner();
    let mut got = Vec::new();
    let mut ended = false;
    while let Some(m) = s.next().await {
        let m = m.expect("chunk");
        match m.kind {
            Some(Kind::Stdout(d)) => {
                assert_eq!(m.offset as usize, 6 + got.len());
                got.extend_from_slice(&d);
            }
            Some(Kind::Exit(_)) => ended = true,
            _ => {}
        }
    }
    assert!(ended);
    assert_eq!(text(&got), "line2\nline3\n");

    // Break a stream of a running command, then resume where it broke.
    let mut s =
        a.c.stream_shell(req("echo a; sleep 1; echo b"))
            .await
            .expect("stream")
            .into_inner();
    let id = match s.next().await.and_then(|m| m.ok()).and_then(|m| m.kind) {
        Some(Kind::Started(id)) => id,
        other => panic!("{other:?}"),
    };
    let first = s.next().await.and_then(|m| m.ok()).expect("first chunk");
    let Some(Kind::Stdout(d)) = first.kind else {
        panic!("{first:?}")
    };
    assert_eq!(d, b"a\n");
    drop(s);
    let mut s =
        a.c.stream_output(pb::GetOutputRequest {
            cmd_id: id,
            stdout_offset: 2,
            ..Default::default()
        })
        .await
        .expect("resume")
        .into_inner();
    let mut rest = Vec::new();
    while let Some(m) = s.next().await {
        if let Some(Kind::Stdout(d)) = m.expect("chunk").kind {
            rest.extend_from_slice(&d);
        }
    }
    assert_eq!(rest, b"b\n");
    a.stop();
}

#[tokio::test]
async fn lowered_limits_drop_truncate_and_evict() {
    if !root_or_skip("lowered_limits_drop_truncate_and_evict") {
        return;
    }
    let mut a = Agent::start(Some("1000,3000,300")).await;
    let r = a
        .sh("head -c 5000 /dev/zero | tr '\\0' a; echo tail >&2")
        .await;
    assert_eq!((r.done, r.exit_code), (true, 0));
    assert_eq!(
        (r.stdout_total, r.dropped_bytes, r.stdout.len()),
        (1000, 4000, 300)
    );
    assert!(r.truncated);
    assert_eq!(r.stderr, b"tail\n");
    let id = r.cmd_id;
    let mut all = r.stdout.clone();
    while (all.len() as i64) < r.stdout_total {
        let g =
            a.c.get_output(pb::GetOutputRequest {
                cmd_id: id,
                stdout_offset: all.len() as i64,
                stderr_offset: 5,
                ..Default::default()
            })
            .await
            .expect("get_output")
            .into_inner();
        assert_eq!(g.stdout_offset as usize, all.len());
        assert!(g.stderr.is_empty());
        all.extend_from_slice(&g.stdout);
        assert_eq!(g.truncated, (all.len() as i64) < g.stdout_total);
    }
    assert_eq!(all, vec![b'a'; 1000]);
    // 1005 + 3 x 1000 > 3000: the oldest finished command's records go.
    for _ in 0..3 {
        a.sh("head -c 1000 /dev/zero").await;
    }
    let e =
        a.c.get_output(pb::GetOutputRequest {
            cmd_id: id,
            ..Default::default()
        })
        .await
        .expect_err("evicted");
    assert_eq!(reason(e), Reason::NotFound);
    a.stop();
}

#[tokio::test]
async fn real_record_limit_is_64_mib() {
    if !root_or_skip("real_record_limit_is_64_mib") {
        return;
    }
    let mut a = Agent::start(None).await;
    let r = a.sh("head -c 70M /dev/zero; echo fine").await;
    assert_eq!((r.done, r.exit_code), (true, 0));
    assert_eq!(r.stdout_total, 64 << 20);
    assert_eq!(r.dropped_bytes, (6 << 20) + 5);
    assert_eq!(r.stdout.len(), 16 << 20);
    assert!(r.truncated);
    a.stop();
}

#[tokio::test]
async fn unprivileged_sessions_are_fenced() {
    if !root_or_skip("unprivileged_sessions_are_fenced") {
        return;
    }
    let mut a = Agent::start(None).await;
    let secret = a.path("secret");
    a.sh(&format!(
        "umask 077; echo s3cret > {}; echo root-output",
        secret.display()
    ))
    .await;
    let root_dir = opendsec::guest::aether::sessions::session_dir(&a.path("run"), "default");
    let as_agent = |cmd: String| pb::RunShellRequest {
        cmd,
        session: "agent".into(),
        user: "1000".into(),
        ..Default::default()
    };
    let r = a.run(as_agent("id -u; echo $HOME".into())).await;
    assert_eq!(text(&r.stdout).lines().next(), Some("1000"));
    let r = a.run(as_agent(format!("cat {}", secret.display()))).await;
    assert_ne!(r.exit_code, 0);
    assert!(
        text(&r.stderr).contains("Permission denied"),
        "{}",
        text(&r.stderr)
    );
    let r = a
        .run(as_agent("echo x > /etc/opendsec-test-nope".into()))
        .await;
    assert_ne!(r.exit_code, 0);
    let r = a
        .run(as_agent(format!("ls {}/rec", root_dir.display())))
        .await;
    assert_ne!(r.exit_code, 0);
    let r = a
        .run(as_agent(format!(
            "python3 -c \"import socket; s=socket.socket(socket.AF_UNIX); s.connect('{}/chronus.sock')\"",
            root_dir.display()
        )))
        .await;
    assert_ne!(r.exit_code, 0, "{}", text(&r.stdout));
    // The session's user is fixed by its first call: another one is refused, the same one
    // (however it is written) or none runs as it.
    let mut q = as_agent("id -u".into());
    q.user = "root".into();
    let e = a.c.run_shell(q).await.expect_err("other user");
    let f = failure_from_status(&e);
    assert_eq!(f.reason, Reason::Invalid);
    assert!(
        f.message.contains("\"agent\"") && f.message.contains("1000") && f.message.contains("root"),
        "{}",
        f.message
    );
    let mut q = as_agent("id -u".into());
    q.user = "1000:1000".into();
    assert_eq!(text(&a.run(q).await.stdout), "1000\n");
    let mut q = as_agent("id -u".into());
    q.user = String::new();
    assert_eq!(text(&a.run(q).await.stdout), "1000\n");
    // File calls run as the session's user too.
    let e =
        a.c.read_file(pb::ReadFileRequest {
            path: secret.to_string_lossy().into(),
            session: "agent".into(),
            ..Default::default()
        })
        .await
        .expect_err("secret");
    assert_eq!(reason(e), Reason::Forbidden);
    let e =
        a.c.write_file(pb::WriteFileRequest {
            path: "/etc/opendsec-test-nope".into(),
            data: b"x".to_vec(),
            session: "agent".into(),
            ..Default::default()
        })
        .await
        .expect_err("etc");
    assert_eq!(reason(e), Reason::Forbidden);
    assert!(!Path::new("/etc/opendsec-test-nope").exists());
    let l =
        a.c.list_sessions(pb::ListSessionsRequest::default())
            .await
            .expect("list")
            .into_inner();
    assert_eq!(l.sessions, ["agent", "default"]);
    a.stop();
}

fn pattern(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut v = Vec::with_capacity(n);
    while v.len() < n {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(n);
    v
}

#[tokio::test]
async fn file_calls() {
    if !root_or_skip("file_calls") {
        return;
    }
    let mut a = Agent::start(None).await;
    let w = a.path("w");
    std::fs::create_dir(&w).expect("mkdir");
    a.sh(&format!("cd {}", w.display())).await;
    let write = |path: &str, data: &[u8], append: bool, mode: u32| pb::WriteFileRequest {
        path: path.into(),
        data: data.to_vec(),
        append,
        mode,
        ..Default::default()
    };
    let i =
        a.c.write_file(write("rel.txt", b"hello", false, 0))
            .await
            .expect("write")
            .into_inner();
    assert_eq!((i.size, i.mode, i.r#type.as_str()), (5, 0o644, "file"));
    assert_eq!(std::fs::read(w.join("rel.txt")).expect("on disk"), b"hello");
    a.c.write_file(write("rel.txt", b" world", true, 0o600))
        .await
        .expect("append");
    let read = |path: &str, offset: i64, length: i64| pb::ReadFileRequest {
        path: path.into(),
        offset,
        length,
        ..Default::default()
    };
    let d =
        a.c.read_file(read("rel.txt", 0, 0))
            .await
            .expect("read")
            .into_inner()
            .data;
    assert_eq!(d, b"hello world");
    let path = |p: &str| pb::PathRequest {
        path: p.into(),
        ..Default::default()
    };
    let s = a.c.stat(path("rel.txt")).await.expect("stat").into_inner();
    assert_eq!((s.size, s.mode), (11, 0o600));
    assert_eq!(s.path, w.join("rel.txt").to_string_lossy());
    std::fs::create_dir(w.join("sub")).expect("mkdir");
    std::os::unix::fs::symlink("rel.txt", w.join("link")).expect("symlink");
    let l = a.c.list_dir(path(".")).await.expect("list").into_inner();
    let names: Vec<(String, String)> = l.entries.into_iter().map(|e| (e.name, e.r#type)).collect();
    assert_eq!(
        names,
        [
            ("link".to_string(), "symlink".to_string()),
            ("rel.txt".into(), "file".into()),
            ("sub".into(), "dir".into())
        ]
    );
    let e =
        a.c.write_file(write("nope/x", b"", false, 0))
            .await
            .expect_err("parent");
    assert_eq!(reason(e), Reason::NotFound);
    std::fs::write(w.join("sub/f"), b"f").expect("write");
    let rm = |p: &str, recursive| pb::RemoveRequest {
        path: p.into(),
        recursive,
        ..Default::default()
    };
    a.c.remove(rm("sub", true)).await.expect("rm -r");
    assert!(!w.join("sub").exists());
    let e = a.c.stat(path("sub")).await.expect_err("gone");
    assert_eq!(reason(e), Reason::NotFound);

    // The 64 MiB limit per call.
    let big = w.join("big");
    std::fs::write(&big, vec![7u8; (64 << 20) + 1]).expect("big");
    let e = a.c.read_file(read("big", 0, 0)).await.expect_err("too big");
    assert_eq!(reason(e), Reason::Invalid);
    let tail =
        a.c.read_file(read("big", 64 << 20, 0))
            .await
            .expect("tail")
            .into_inner();
    assert_eq!(tail.data, [7u8]);
    let e =
        a.c.write_file(write("big2", &vec![0u8; (64 << 20) + 1], false, 0))
            .await
            .expect_err("too big");
    assert_eq!(reason(e), Reason::Invalid);
    std::fs::remove_file(&big).expect("rm");

    // 200 MB in 32 MiB pieces, byte for byte.
    let data = pattern(200_000_000, 42);
    for (i, piece) in data.chunks(32 << 20).enumerate() {
        a.c.write_file(write("round", piece, i > 0, 0))
            .await
            .expect("write piece");
    }
    let mut back = Vec::with_capacity(data.len());
    loop {
        let part =
            a.c.read_file(read("round", back.len() as i64, 32 << 20))
                .await
                .expect("read piece")
                .into_inner()
                .data;
        if part.is_empty() {
            break;
        }
        back.extend_from_slice(&part);
    }
    assert!(back == data, "round trip differs");
    a.stop();
}

#[tokio::test]
async fn close_session_kills_its_processes() {
    if !root_or_skip("close_session_kills_its_processes") {
        return;
    }
    let mut a = Agent::start(None).await;
    let p1 = a.path("p1");
    let p2 = a.path("p2");
    let mut q = req(&format!(
        "sleep 300 & echo $! > {}; (setsid sleep 301 & echo $! > {}); sleep 302",
        p1.display(),
        p2.display()
    ));
    q.session = "s2".into();
    q.background = true;
    a.run(q).await;
    let (a1, a2) = (read_pid(&p1).await, read_pid(&p2).await);
    assert!(alive(a1) && alive(a2));
    a.c.close_session(pb::CloseSessionRequest {
        session: "s2".into(),
        ..Default::default()
    })
    .await
    .expect("close");
    assert!(wait_gone(a1).await && wait_gone(a2).await);
    let l =
        a.c.list_sessions(pb::ListSessionsRequest::default())
            .await
            .expect("list")
            .into_inner();
    assert!(l.sessions.is_empty(), "{:?}", l.sessions);
    let e =
        a.c.close_session(pb::CloseSessionRequest {
            session: "s2".into(),
            ..Default::default()
        })
        .await
        .expect_err("closed");
    assert_eq!(reason(e), Reason::NotFound);
    // The name can be used again: a fresh session.
    let mut q = req("echo again");
    q.session = "s2".into();
    assert_eq!(a.run(q).await.cmd_id, 1);
    a.stop();
}

#[tokio::test]
async fn http_to_a_server_in_the_sandbox_and_watch() {
    if !root_or_skip("http_to_a_server_in_the_sandbox_and_watch") {
        return;
    }
    let mut a = Agent::start(None).await;
    let www = a.path("www");
    std::fs::create_dir(&www).expect("mkdir");
    std::fs::write(www.join("hello.txt"), "hi from inside").expect("write");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let mut q = req(&format!(
        "exec python3 -m http.server {port} --bind 127.0.0.1"
    ));
    q.cwd = www.to_string_lossy().into();
    q.background = true;
    a.run(q).await;
    let url = format!("http://127.0.0.1:{port}/hello.txt");
    let deadline = Instant::now() + Duration::from_secs(20);
    let r = loop {
        match a
            .c
            .http(pb::HttpRequest {
                url: url.clone(),
                timeout: 5.0,
                ..Default::default()
            })
            .await
        {
            Ok(r) => break r.into_inner(),
            Err(e) => {
                assert_eq!(reason(e), Reason::Unavailable);
                assert!(Instant::now() < deadline, "server did not come up");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!((r.status, r.body.as_slice()), (200, &b"hi from inside"[..]));
    assert!(r.headers.contains_key("content-length"));
    let e =
        a.c.http(pb::HttpRequest {
            url: "https://127.0.0.1/".into(),
            ..Default::default()
        })
        .await
        .expect_err("https");
    assert_eq!(reason(e), Reason::Invalid);

    let mut w = a.c.watch(pb::Empty {}).await.expect("watch").into_inner();
    let first = w.next().await.expect("event").expect("ok");
    let second = w.next().await.expect("event").expect("ok");
    assert!(first.at > 0 && second.at >= first.at);
    // The process API is aether's own table, reached through the same socket.
    let mut events =
        a.c.start_process(pb::StartProcessRequest {
            cmd: "echo".into(),
            args: vec!["from-procs".into()],
            ..Default::default()
        })
        .await
        .expect("start_process")
        .into_inner();
    let mut out = Vec::new();
    let mut ended = None;
    while let Some(ev) = events.next().await {
        match ev.expect("event").kind {
            Some(pb::process_event::Kind::Stdout(b)) => out.extend(b),
            Some(pb::process_event::Kind::End(e)) => ended = Some(e.exit_code),
            _ => {}
        }
    }
    assert_eq!((out.as_slice(), ended), (&b"from-procs\n"[..], Some(0)));
    a.stop();
}

#[tokio::test]
async fn inherited_socket_fd_stays_out_of_the_sandbox() {
    if !root_or_skip("inherited_socket_fd_stays_out_of_the_sandbox") {
        return;
    }
    let mut a = Agent::start_with(None, Launch::InheritedFd).await;
    let ino = std::fs::metadata(a.path("aether.sock"))
        .expect("sock")
        .ino();
    let r = a
        .sh("for f in /proc/$$/fd/* /proc/self/fd/*; do readlink $f; done")
        .await;
    let mut fds = text(&r.stdout);
    // And chronus's own (and every other descendant's).
    let none = std::collections::HashSet::new();
    for p in opendsec::guest::proctree::descendants(a.child.id() as i32, &none) {
        for e in std::fs::read_dir(format!("/proc/{p}/fd"))
            .into_iter()
            .flatten()
            .flatten()
        {
            if let Ok(l) = std::fs::read_link(e.path()) {
                fds.push_str(&format!("{p}: {}\n", l.display()));
            }
        }
    }
    // The socket inode of the listener differs from the file's; compare with what aether
    // itself holds as fd 3.
    let held = std::fs::read_link(format!("/proc/{}/fd/3", a.child.id()))
        .expect("aether fd 3")
        .to_string_lossy()
        .into_owned();
    assert!(held.starts_with("socket:"), "{held} ({ino})");
    assert!(!fds.contains(&held), "{fds}");
    a.stop();
}

#[tokio::test]
async fn pid1_ends_every_process_on_sigterm() {
    if !root_or_skip("pid1_ends_every_process_on_sigterm") {
        return;
    }
    let mut a = Agent::start_with(None, Launch::Pid1).await;
    let r = a.sh("echo $$; sleep 300 & echo started").await;
    assert_eq!(text(&r.stdout).lines().nth(1), Some("started"));
    let mut q = req("sleep 301");
    q.session = "other".into();
    q.background = true;
    a.run(q).await;
    let r = a.sh("cat /proc/1/cmdline | tr '\\0' ' '").await;
    assert!(text(&r.stdout).contains("aether"), "{}", text(&r.stdout));
    let unshare = a.child.id() as i32;
    let none = std::collections::HashSet::new();
    let mut tree = Vec::new();
    for _ in 0..100 {
        tree = opendsec::guest::proctree::descendants(unshare, &none);
        if tree.len() >= 7 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // aether, 2 x (chronus, bash), sleep 300, the background subshell and sleep 301.
    assert!(tree.len() >= 7, "{tree:?}");
    let aether = tree
        .iter()
        .copied()
        .find(|p| {
            std::fs::read_to_string(format!("/proc/{p}/stat"))
                .map(|s| s.split_whitespace().nth(3) == Some(&unshare.to_string()))
                .unwrap_or(false)
        })
        .expect("aether");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(aether),
        nix::sys::signal::Signal::SIGTERM,
    )
    .expect("sigterm");
    let st = tokio::task::spawn_blocking(move || a.child.wait().expect("wait"))
        .await
        .expect("join");
    assert!(st.success(), "{st:?}");
    for p in tree {
        assert!(wait_gone(p).await, "{p} survived");
    }
}

#[tokio::test]
async fn the_warm_default_session_never_fixes_the_user() {
    if !root_or_skip("the_warm_default_session_never_fixes_the_user") {
        return;
    }
    // aether starts `default` ahead of time as init_user (root); it is no session yet, and a
    // first call as another user still gets that user.
    let mut a = Agent::start(None).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let listed =
        a.c.list_sessions(pb::ListSessionsRequest::default())
            .await
            .expect("list")
            .into_inner()
            .sessions;
    assert!(listed.is_empty(), "{listed:?}");
    let mut q = req("id -u");
    q.user = "1000".into();
    assert_eq!(text(&a.run(q).await.stdout), "1000\n");
    a.stop();

    // The first call as init_user takes the warm one.
    let mut b = Agent::start(None).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(text(&b.sh("id -u").await.stdout), "0\n");
    let listed =
        b.c.list_sessions(pb::ListSessionsRequest::default())
            .await
            .expect("list")
            .into_inner()
            .sessions;
    assert_eq!(listed, vec!["default".to_string()]);
    // Later calls as another user, or one the sandbox does not have, are refused.
    for other in ["1000", "nosuchuser"] {
        let mut q = req("id -u");
        q.user = other.into();
        let e = b.c.run_shell(q).await.expect_err("other user");
        let f = failure_from_status(&e);
        assert_eq!(f.reason, Reason::Invalid, "{}", f.message);
        assert!(
            f.message.contains("\"default\"")
                && f.message.contains(other)
                && f.message.contains("uid 0"),
            "{}",
            f.message
        );
    }
    let mut q = req("id -u");
    q.user = "root".into();
    assert_eq!(text(&b.run(q).await.stdout), "0\n");
    b.stop();
}

/// A session's own processes can kill its chronus (it runs as the session's user); the
/// session then starts again on its next call, as the user its first call fixed, never as
/// init_user (root): an unprivileged session must not become a root one. Closing it frees
/// the name for another user.
#[tokio::test]
async fn a_session_whose_chronus_was_killed_starts_again_as_its_user() {
    if !root_or_skip("a_session_whose_chronus_was_killed_starts_again_as_its_user") {
        return;
    }
    let mut a = Agent::start(None).await;
    let q = |cmd: &str, user: &str| {
        let mut q = req(cmd);
        q.session = "agent".into();
        q.user = user.into();
        q
    };
    assert_eq!(text(&a.run(q("id -u", "1000")).await.stdout), "1000\n");
    // The command's subshell's $PPID is the session shell's parent: chronus.
    let _ = a.c.run_shell(q("kill -9 $PPID", "")).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let out = loop {
        match a.c.run_shell(q("id -u", "")).await {
            Ok(r) => break r.into_inner(),
            Err(e) => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "no session again: {e}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    };
    assert_eq!(text(&out.stdout), "1000\n", "{out:?}");
    let e =
        a.c.run_shell(q("id -u", "root"))
            .await
            .expect_err("another user");
    let f = failure_from_status(&e);
    assert_eq!(f.reason, Reason::Invalid, "{}", f.message);
    assert!(f.message.contains("uid 1000"), "{}", f.message);
    a.c.close_session(pb::CloseSessionRequest {
        session: "agent".into(),
        ..Default::default()
    })
    .await
    .expect("close");
    assert_eq!(text(&a.run(q("id -u", "root")).await.stdout), "0\n");
    a.stop();
}

/// `oom_killed` follows the sandbox cgroup's OOM kill count over the command's lifetime
/// (here a fake v2 counter the command itself bumps, as the kernel would while it runs),
/// and needs the command to end by SIGKILL: a plain kill -9, or a count that rose while a
/// command ended otherwise, is no OOM kill of that command.
#[tokio::test]
async fn oom_killed_follows_the_cgroup_count() {
    if !root_or_skip("oom_killed_follows_the_cgroup_count") {
        return;
    }
    let mut a = Agent::start(None).await;
    let cg = a.path("cg");
    std::fs::create_dir_all(cg.join("workload")).expect("mkdir");
    std::fs::write(cg.join("memory.events.local"), "oom 0\noom_kill 0\n").expect("write");
    let counter = cg.join("workload/memory.events.local");
    std::fs::write(&counter, "oom_kill 0\n").expect("write");
    std::fs::set_permissions(&cg, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let bump = |n: u32| format!("printf 'oom_kill {n}\\n' > {}", counter.display());
    let r = a.sh("sh -c 'kill -9 $$'").await;
    assert_eq!((r.exit_code, r.oom_killed), (137, false), "{r:?}");
    let r = a.sh(&format!("{}; sh -c 'kill -9 $$'", bump(1))).await;
    assert_eq!((r.exit_code, r.oom_killed), (137, true), "{r:?}");
    let r = a.sh(&format!("{}; true", bump(2))).await;
    assert_eq!((r.exit_code, r.oom_killed), (0, false), "{r:?}");
    let r = a.sh("sh -c 'kill -9 $$'").await;
    assert_eq!((r.exit_code, r.oom_killed), (137, false), "{r:?}");
    a.stop();
}

/// Live (non-zombie) processes of `uid`, as (pid, comm), leaving out chronus itself.
fn procs_of(uid: u32) -> Vec<(i32, String)> {
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").expect("proc").flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
            continue;
        };
        let field = |k: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(k))
                .map(|v| v.trim().to_string())
                .unwrap_or_default()
        };
        let real_uid = field("Uid:")
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_string();
        if real_uid != uid.to_string() || field("State:").starts_with('Z') {
            continue;
        }
        let comm = field("Name:");
        // chronus runs from /proc/self/exe.
        if comm == "opendsec" || comm == "exe" {
            continue;
        }
        out.push((pid, comm));
    }
    out
}

/// Waits until only the session's own shell is left among `uid`'s processes.
async fn only_the_shell_left(uid: u32) -> Vec<(i32, String)> {
    let mut left = procs_of(uid);
    for _ in 0..60 {
        if left.len() <= 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        left = procs_of(uid);
    }
    left
}

#[tokio::test]
async fn a_timeout_stops_the_whole_command_and_keeps_the_session() {
    if !root_or_skip("a_timeout_stops_the_whole_command_and_keeps_the_session") {
        return;
    }
    let mut a = Agent::start(None).await;
    a.sh("cd /usr && export Z=kept && Y=shellvar").await;

    // The script itself stops, not only its current child.
    let marker = a.path("marker");
    let mut q = req(&format!("sleep 5; touch {}; sleep 40", marker.display()));
    q.timeout = 1.0;
    let t0 = Instant::now();
    let r = a.run(q).await;
    assert!(r.timed_out && r.done, "{r:?}");
    assert!(r.state_lost, "{r:?}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    tokio::time::sleep(Duration::from_secs(6).saturating_sub(t0.elapsed())).await;
    assert!(!marker.exists(), "the script went on after its timeout");

    // A builtin loop runs in the command's job, not in the session's shell: the session's
    // directory and variables stay.
    let mut q = req("while :; do :; done");
    q.timeout = 1.0;
    let t0 = Instant::now();
    let r = a.run(q).await;
    assert!(r.timed_out, "{r:?}");
    assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
    let r = a.sh("pwd; echo $Z $Y").await;
    assert_eq!(text(&r.stdout), "/usr\nkept shellvar\n");

    // Fork storms, bounded by a process limit (the test runs on the host), as an
    // unprivileged session: they stop within the timeout plus a little, nothing of them is
    // left, and the session answers.
    let uid = 4242;
    let storm = |cmd: &str| pb::RunShellRequest {
        cmd: cmd.into(),
        session: "storm".into(),
        user: uid.to_string(),
        timeout: 1.0,
        ..Default::default()
    };
    let mut first = storm("cd /tmp; export W=1");
    first.timeout = 0.0;
    a.run(first).await;
    let storms = [
        "ulimit -u 300; python3 -c 'import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass'",
        // The classic bomb detaches (`&`): the command waits, the bomb rages in its job.
        "ulimit -u 300; b() { b | b & }; b; sleep 100",
        "ulimit -u 300; b() { b | b; }; b",
        "trap '' TERM; bash -c 'trap \"\" TERM; sleep 100' & setsid sleep 101 & sleep 102",
    ];
    for cmd in storms {
        let t0 = Instant::now();
        let r = a.run(storm(cmd)).await;
        assert!(r.timed_out, "{cmd}: {r:?}");
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{cmd}: {:?}",
            t0.elapsed()
        );
        let left = only_the_shell_left(uid).await;
        assert_eq!(left.len(), 1, "{cmd}: left behind: {left:?}");
        let mut q = storm("pwd; echo $W");
        q.timeout = 0.0;
        let r = a.run(q).await;
        assert_eq!(text(&r.stdout), "/tmp\n1\n", "{cmd}");
    }
    a.stop();
}

#[tokio::test]
async fn a_command_that_ends_its_shell_keeps_the_session_state() {
    if !root_or_skip("a_command_that_ends_its_shell_keeps_the_session_state") {
        return;
    }
    let mut a = Agent::start(None).await;
    let r = a
        .sh("cd /tmp; export A=1; B=2; f() { echo fn; }; exit 3")
        .await;
    assert_eq!((r.exit_code, r.state_lost), (3, false), "{r:?}");
    let r = a.sh("pwd; echo $A $B; f").await;
    assert_eq!(text(&r.stdout), "/tmp\n1 2\nfn\n");

    let r = a
        .sh("set -e; cd /usr; export C=3; unset B; false; echo no")
        .await;
    assert_eq!((r.exit_code, text(&r.stdout)), (1, String::new()));
    assert!(!r.state_lost);
    let r = a.sh("pwd; echo $C ${B-unset}").await;
    assert_eq!(text(&r.stdout), "/usr\n3 unset\n");

    // exec leaves no state behind: the session goes on from before it, and says so.
    let r = a.sh("cd /; export D=4; exec true").await;
    assert_eq!((r.exit_code, r.state_lost), (0, true), "{r:?}");
    let r = a.sh("pwd; echo ${D-unset} $C").await;
    assert_eq!(text(&r.stdout), "/usr\nunset 3\n");

    // A command that kills the session's shell: a new one starts from the last state.
    let r = a.sh("kill -9 $$").await;
    assert!(r.state_lost, "{r:?}");
    let r = a.sh("pwd; echo $A $C; f").await;
    assert_eq!(text(&r.stdout), "/usr\n1 3\nfn\n");
    a.stop();
}

#[tokio::test]
async fn no_notice_or_internal_path_leaks_into_later_commands() {
    if !root_or_skip("no_notice_or_internal_path_leaks_into_later_commands") {
        return;
    }
    let mut a = Agent::start(None).await;
    // A job of one command killed from outside: no "Killed" in the next ones.
    let pidfile = a.path("job.pid");
    a.sh(&format!("sleep 100 & echo $! > {}", pidfile.display()))
        .await;
    let pid = read_pid(&pidfile).await;
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    assert!(wait_gone(pid).await);
    for _ in 0..2 {
        let r = a.sh("sleep 0.3; echo ok").await;
        assert_eq!(
            (text(&r.stdout), text(&r.stderr)),
            ("ok\n".into(), String::new())
        );
    }
    // A background command killed by its timeout while a foreground one runs.
    let mut q = req("sleep 100");
    q.background = true;
    q.timeout = 0.3;
    a.run(q).await;
    let r = a.sh("sleep 1.5; echo ok").await;
    assert_eq!(
        (text(&r.stdout), text(&r.stderr)),
        ("ok\n".into(), String::new())
    );
    let r = a.sh("sleep 2 & echo started").await;
    assert_eq!(text(&r.stderr), "");
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let r = a.sh("echo ok").await;
    assert_eq!(text(&r.stderr), "");

    // The shell's messages never name the session's files.
    let run = a.path("run").to_string_lossy().into_owned();
    for cmd in [
        "if then fi (",
        "no_such_command_x",
        "echo 'unclosed",
        ". /nonexistent",
    ] {
        let r = a.sh(cmd).await;
        let err = text(&r.stderr);
        assert_ne!(r.exit_code, 0, "{cmd}");
        assert!(!err.is_empty(), "{cmd}");
        assert!(
            !err.contains(&run) && !err.contains("sessions/") && !err.contains(".sh"),
            "{cmd}: {err}"
        );
    }
    a.stop();
}
