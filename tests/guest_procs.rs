//! aether's process API (guest::procs), in a test process of its own: the reaper reaps every
//! child of this process with waitpid(-1). All tests share one runtime and one reaper; each
//! has its own process table.

// Tests may unwrap, expect, panic and index (the codebase's rules are for non-test code).
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::indexing_slicing
)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures::StreamExt;
use opendsec::guest::config::AetherConfig;
use opendsec::guest::procs::{ProcError, ProcessEvents, Procs};
use opendsec::guest::reaper::Reaper;
use opendsec::pb;
use opendsec::pb::process_event::Kind;
use opendsec::types::Reason;

const WAIT: Duration = Duration::from_secs(20);

struct World {
    rt: tokio::runtime::Runtime,
    reaper: Reaper,
    root: tempfile::TempDir,
}

fn world() -> &'static World {
    static W: OnceLock<World> = OnceLock::new();
    W.get_or_init(|| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("runtime");
        let reaper = rt.block_on(async { Reaper::start() }).expect("reaper");
        let root = tempfile::tempdir().expect("tempdir");
        std::fs::create_dir_all(root.path().join("etc")).expect("mkdir");
        std::fs::write(
            root.path().join("etc/passwd"),
            "root:x:0:0:root:/root:/bin/sh\ntester:x:1000:1000::/tmp:/bin/sh\n",
        )
        .expect("passwd");
        std::fs::write(root.path().join("etc/group"), "root:x:0:\n").expect("group");
        World { rt, reaper, root }
    })
}

/// Runs `f` on the shared runtime with a fresh table.
fn run<F, Fut>(cfg: AetherConfig, f: F)
where
    F: FnOnce(Procs) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    let w = world();
    let procs = Procs::new(Arc::new(cfg), w.reaper.clone(), w.root.path().to_path_buf());
    w.rt.block_on(async {
        let p = procs.clone();
        f(p).await;
        procs.kill_all();
    });
}

fn is_root() -> bool {
    opendsec::sys::root_or_skip("this test")
}

fn req(cmd: &str, args: &[&str]) -> pb::StartProcessRequest {
    pb::StartProcessRequest {
        cmd: cmd.into(),
        args: args.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn sh(script: &str) -> pb::StartProcessRequest {
    req("sh", &["-c", script])
}

fn by_pid(pid: u32) -> Option<pb::ProcessRef> {
    Some(pb::ProcessRef {
        pid,
        ..Default::default()
    })
}

fn by_tag(tag: &str) -> Option<pb::ProcessRef> {
    Some(pb::ProcessRef {
        tag: tag.into(),
        ..Default::default()
    })
}

fn reason<T>(r: Result<T, ProcError>) -> Reason {
    match r {
        Ok(_) => panic!("expected an error"),
        Err(e) => e.failure().reason,
    }
}

/// What a caller has seen on one stream; checks that every chunk starts where the previous
/// one of its stream ended.
#[derive(Debug, Default)]
struct Seen {
    pid: u32,
    base: [u64; 2],
    out: Vec<u8>,
    err: Vec<u8>,
    pty: Vec<u8>,
    end: Option<pb::ProcessEnd>,
    keepalives: usize,
    events: usize,
}

impl Seen {
    fn from(stdout: u64, stderr: u64) -> Seen {
        Seen {
            base: [stdout, stderr],
            ..Default::default()
        }
    }

    fn take(&mut self, e: pb::ProcessEvent) {
        assert!(self.end.is_none(), "event after end: {e:?}");
        let kind = e.kind.expect("kind");
        if self.events == 0 {
            assert!(matches!(kind, Kind::StartPid(_)), "first event: {kind:?}");
        }
        self.events += 1;
        let off = e.offset as u64;
        match kind {
            Kind::StartPid(p) => {
                assert_eq!(self.events, 1, "start_pid only first");
                self.pid = p;
            }
            Kind::Stdout(d) => {
                assert_eq!(off, self.base[0] + self.out.len() as u64, "stdout offset");
                self.out.extend(d);
            }
            Kind::Pty(d) => {
                assert_eq!(off, self.base[0] + self.pty.len() as u64, "pty offset");
                self.pty.extend(d);
            }
            Kind::Stderr(d) => {
                assert_eq!(off, self.base[1] + self.err.len() as u64, "stderr offset");
                self.err.extend(d);
            }
            Kind::End(end) => self.end = Some(end),
            Kind::Keepalive(_) => self.keepalives += 1,
        }
    }

    fn out(&self) -> String {
        String::from_utf8_lossy(&self.out).into_owned()
    }
    fn pty(&self) -> String {
        String::from_utf8_lossy(&self.pty).into_owned()
    }
    fn end(&self) -> &pb::ProcessEnd {
        self.end.as_ref().expect("ended")
    }
}

async fn next(ev: &mut ProcessEvents) -> Option<pb::ProcessEvent> {
    tokio::time::timeout(WAIT, ev.next())
        .await
        .expect("an event in time")
}

/// Reads until `done(seen)` holds.
async fn until(ev: &mut ProcessEvents, seen: &mut Seen, done: impl Fn(&Seen) -> bool) {
    while !done(seen) {
        let e = next(ev).await.expect("stream ended early");
        seen.take(e);
    }
}

/// Reads to the end event and checks that the stream closes after it.
async fn to_end(ev: &mut ProcessEvents, seen: &mut Seen) {
    until(ev, seen, |s| s.end.is_some()).await;
    assert!(next(ev).await.is_none(), "stream closes after end");
}

async fn run_to_end(p: &Procs, r: pb::StartProcessRequest) -> Seen {
    let mut ev = p.start(r).await.expect("start");
    let mut seen = Seen::default();
    to_end(&mut ev, &mut seen).await;
    seen
}

#[test]
fn echo_gives_pid_stdout_and_exit_0() {
    run(AetherConfig::default(), |p| async move {
        let s = run_to_end(&p, req("echo", &["hello", "world"])).await;
        assert!(s.pid > 0);
        assert_eq!(s.out(), "hello world\n");
        assert!(s.err.is_empty());
        let e = s.end();
        assert_eq!((e.exit_code, e.exited), (0, true));
        assert_eq!((e.status.as_str(), e.error.as_str()), ("exit status 0", ""));
    });
}

#[test]
fn exit_codes_and_signals() {
    run(AetherConfig::default(), |p| async move {
        let s = run_to_end(&p, sh("echo oops >&2; exit 3")).await;
        assert_eq!(s.err, b"oops\n");
        let e = s.end();
        assert_eq!((e.exit_code, e.exited), (3, true));
        assert_eq!(
            (e.status.as_str(), e.error.as_str()),
            ("exit status 3", "exit status 3")
        );

        let s = run_to_end(&p, sh("kill -9 $$")).await;
        let e = s.end();
        assert_eq!((e.exit_code, e.exited), (-1, false));
        assert_eq!(e.status, "signal: killed");
    });
}

#[test]
fn stdin_open_echoes_input_until_closed() {
    run(AetherConfig::default(), |p| async move {
        let mut r = req("cat", &[]);
        r.stdin = true;
        let mut ev = p.start(r).await.expect("start");
        let mut s = Seen::default();
        until(&mut ev, &mut s, |s| s.pid != 0).await;
        let pid = s.pid;
        let input = move |data: &[u8]| pb::ProcessInputRequest {
            process: by_pid(pid),
            data: data.to_vec(),
            ..Default::default()
        };
        p.send_input(input(b"abc\n")).await.expect("input");
        until(&mut ev, &mut s, |s| s.out() == "abc\n").await;
        p.send_input(input(b"def")).await.expect("input");
        p.close_input(by_pid(pid).expect("ref"))
            .await
            .expect("close");
        to_end(&mut ev, &mut s).await;
        assert_eq!(s.out(), "abc\ndef");
        assert_eq!(s.end().exit_code, 0);
        // The process has ended: input is refused as `not_found`.
        assert_eq!(reason(p.send_input(input(b"x")).await), Reason::NotFound);

        // A closed stdin of a running process is `invalid`.
        let mut r = req("sleep", &["30"]);
        r.stdin = true;
        let mut ev = p.start(r).await.expect("start");
        let mut s = Seen::default();
        until(&mut ev, &mut s, |s| s.pid != 0).await;
        let pid = s.pid;
        let input = pb::ProcessInputRequest {
            process: by_pid(pid),
            data: b"x".to_vec(),
            ..Default::default()
        };
        p.send_input(input.clone()).await.expect("open stdin");
        p.close_input(by_pid(pid).expect("ref"))
            .await
            .expect("close");
        p.close_input(by_pid(pid).expect("ref"))
            .await
            .expect("close twice");
        assert_eq!(reason(p.send_input(input).await), Reason::Invalid);
    });
}

#[test]
fn stdin_closed_means_dev_null() {
    run(AetherConfig::default(), |p| async move {
        let s = run_to_end(&p, req("cat", &[])).await;
        assert!(s.out.is_empty());
        assert_eq!(s.end().exit_code, 0);
        let s = run_to_end(&p, sh("readlink /proc/self/fd/0")).await;
        assert_eq!(s.out(), "/dev/null\n");

        let mut ev = p.start(req("sleep", &["30"])).await.expect("start");
        let mut s = Seen::default();
        until(&mut ev, &mut s, |s| s.pid != 0).await;
        let input = pb::ProcessInputRequest {
            process: by_pid(s.pid),
            data: b"x".to_vec(),
            ..Default::default()
        };
        assert_eq!(reason(p.send_input(input).await), Reason::Invalid);
    });
}

#[test]
fn pty_is_a_terminal_and_resizes() {
    run(AetherConfig::default(), |p| async move {
        let mut r = req("tty", &[]);
        r.pty = true;
        let s = run_to_end(&p, r).await;
        assert!(
            s.pty().starts_with("/dev/pts/"),
            "tty printed {:?}",
            s.pty()
        );
        assert!(s.out.is_empty() && s.err.is_empty());
        assert_eq!(s.end().exit_code, 0);

        let mut r = sh("stty size; read x; stty size");
        r.pty = true;
        r.pty_cols = 80;
        r.pty_rows = 24;
        let mut ev = p.start(r).await.expect("start");
        let mut s = Seen::default();
        until(&mut ev, &mut s, |s| s.pty().contains("24 80")).await;
        let resize = |pid, cols, rows| pb::ResizePtyRequest {
            process: by_pid(pid),
            cols,
            rows,
            ..Default::default()
        };
        assert_eq!(
            reason(p.resize(resize(s.pid, 0, 10)).await),
            Reason::Invalid
        );
        p.resize(resize(s.pid, 100, 40)).await.expect("resize");
        p.send_input(pb::ProcessInputRequest {
            process: by_pid(s.pid),
            data: b"\n".to_vec(),
            pty: true,
            ..Default::default()
        })
        .await
        .expect("input");
        to_end(&mut ev, &mut s).await;
        assert!(s.pty().contains("40 100"), "output {:?}", s.pty());
        assert_eq!(s.end().exit_code, 0);
        // Closing a PTY's stdin and resizing a pipe process are `invalid`.
        let mut r = req("sleep", &["30"]);
        r.pty = true;
        let mut ev = p.start(r).await.expect("start");
        let mut s = Seen::default();
        until(&mut ev, &mut s, |s| s.pid != 0).await;
        assert_eq!(
            reason(p.close_input(by_pid(s.pid).expect("ref")).await),
            Reason::Invalid
        );
        let mut ev = p.start(req("sleep", &["30"])).await.expect("start");
        let mut s = Seen::default();
        until(&mut ev, &mut s, |s| s.pid != 0).await;
        assert_eq!(
            reason(p.resize(resize(s.pid, 80, 24)).await),
            Reason::Invalid
        );
    });
}

#[test]
fn tags_list_and_conflicts() {
    run(AetherConfig::default(), |p| async move {
        let mut r = req("sleep", &["30"]);
        r.tag = "srv".into();
        r.env = HashMap::from([("A".to_string(), "1".to_string())]);
        r.cwd = "/tmp".into();
        let mut ev = p.start(r.clone()).await.expect("start");
        let mut s = Seen::default();
        until(&mut ev, &mut s, |s| s.pid != 0).await;
        assert_eq!(reason(p.start(r.clone()).await), Reason::Conflict);

        let list = p.list().await;
        let info = list.iter().find(|i| i.pid == s.pid).expect("listed");
        assert_eq!((info.tag.as_str(), info.cmd.as_str()), ("srv", "sleep"));
        assert_eq!(info.args, vec!["30".to_string()]);
        assert_eq!(info.env.get("A").map(String::as_str), Some("1"));
        assert_eq!(info.cwd, "/tmp");

        // Addressed by tag: SIGTERM ends it, and it leaves the list.
        p.signal(pb::SignalProcessRequest {
            process: by_tag("srv"),
            signal: 15,
            ..Default::default()
        })
        .await
        .expect("signal by tag");
        to_end(&mut ev, &mut s).await;
        assert_eq!(s.end().status, "signal: terminated");
        assert!(p.list().await.iter().all(|i| i.pid != s.pid));
        // The tag is free again; the ended one is still reachable until then.
        let mut c = p
            .connect(pb::ConnectProcessRequest {
                process: by_tag("srv"),
                ..Default::default()
            })
            .await
            .expect("connect ended by tag");
        let mut s2 = Seen::default();
        to_end(&mut c, &mut s2).await;
        assert_eq!(s2.pid, s.pid);
        let mut ev = p.start(r).await.expect("tag reusable");
        let mut s3 = Seen::default();
        until(&mut ev, &mut s3, |s| s.pid != 0).await;
        assert_ne!(s3.pid, s.pid);
        assert_eq!(
            reason(
                p.connect(pb::ConnectProcessRequest {
                    process: by_tag("nope"),
                    ..Default::default()
                })
                .await
            ),
            Reason::NotFound
        );
        assert_eq!(
            reason(
                p.connect(pb::ConnectProcessRequest {
                    process: None,
                    ..Default::default()
                })
                .await
            ),
            Reason::Invalid
        );
    });
}

#[test]
fn reconnect_with_offsets_loses_and_repeats_nothing() {
    run(AetherConfig::default(), |p| async move {
        let script = "i=0; while [ $i -lt 300 ]; do echo out $i; echo err $i >&2; i=$((i+1)); \
                      [ $((i % 20)) -eq 0 ] && sleep 0.02; done";
        let expected_out: String = (0..300).map(|i| format!("out {i}\n")).collect();
        let expected_err: String = (0..300).map(|i| format!("err {i}\n")).collect();
        let mut ev = p.start(sh(script)).await.expect("start");
        let mut first = Seen::default();
        until(&mut ev, &mut first, |s| {
            s.out.len() > 100 && !s.err.is_empty()
        })
        .await;
        drop(ev); // the caller goes away mid-way; the process runs on
        let pid = first.pid;

        let (o, e) = (first.out.len() as u64, first.err.len() as u64);
        let mut ev = p
            .connect(pb::ConnectProcessRequest {
                process: by_pid(pid),
                stdout_offset: o as i64,
                stderr_offset: e as i64,
                ..Default::default()
            })
            .await
            .expect("connect");
        let mut rest = Seen::from(o, e);
        to_end(&mut ev, &mut rest).await;
        assert_eq!(rest.pid, pid, "connect starts with start_pid");
        let mut out = first.out.clone();
        out.extend(&rest.out);
        let mut err = first.err.clone();
        err.extend(&rest.err);
        assert_eq!(String::from_utf8_lossy(&out), expected_out);
        assert_eq!(String::from_utf8_lossy(&err), expected_err);
        assert_eq!(rest.end().exit_code, 0);
    });
}

#[test]
fn connect_after_the_end_gets_the_tail_and_end() {
    run(AetherConfig::default(), |p| async move {
        let s = run_to_end(&p, req("echo", &["hello"])).await;
        let mut ev = p
            .connect(pb::ConnectProcessRequest {
                process: by_pid(s.pid),
                stdout_offset: 3,
                ..Default::default()
            })
            .await
            .expect("connect");
        let mut tail = Seen::from(3, 0);
        to_end(&mut ev, &mut tail).await;
        assert_eq!(tail.out(), "lo\n");
        assert_eq!(tail.end(), s.end());
        // `live` skips what is stored: only start_pid and end.
        let mut ev = p
            .connect(pb::ConnectProcessRequest {
                process: by_pid(s.pid),
                live: true,
                ..Default::default()
            })
            .await
            .expect("connect live");
        let mut live = Seen::from(6, 0);
        to_end(&mut ev, &mut live).await;
        assert!(live.out.is_empty());
        assert_eq!(live.events, 2);
        assert_eq!(
            reason(
                p.connect(pb::ConnectProcessRequest {
                    process: by_pid(s.pid),
                    stdout_offset: -1,
                    ..Default::default()
                })
                .await
            ),
            Reason::Invalid
        );
    });
}

#[test]
fn sigkill_by_pid_and_kill_all() {
    run(AetherConfig::default(), |p| async move {
        let mut ev = p.start(req("sleep", &["30"])).await.expect("start");
        let mut s = Seen::default();
        until(&mut ev, &mut s, |s| s.pid != 0).await;
        let sig = |signal| pb::SignalProcessRequest {
            process: by_pid(s.pid),
            signal,
            ..Default::default()
        };
        assert_eq!(reason(p.signal(sig(0)).await), Reason::Invalid);
        assert_eq!(reason(p.signal(sig(99)).await), Reason::Invalid);
        // Dropping the stream does not end the process.
        drop(ev);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(p.list().await.iter().any(|i| i.pid == s.pid));
        p.signal(sig(9)).await.expect("SIGKILL");
        let mut ev = p
            .connect(pb::ConnectProcessRequest {
                process: by_pid(s.pid),
                ..Default::default()
            })
            .await
            .expect("connect");
        let mut s = Seen::default();
        to_end(&mut ev, &mut s).await;
        let e = s.end();
        assert_eq!(
            (e.exit_code, e.exited, e.status.as_str()),
            (-1, false, "signal: killed")
        );
        // Gone: E2B's kill() reads `not_found` as "already gone".
        assert_eq!(reason(p.signal(sig(9)).await), Reason::NotFound);
        assert_eq!(
            reason(
                p.signal(pb::SignalProcessRequest {
                    process: by_pid(1 << 30),
                    signal: 9,
                    ..Default::default()
                })
                .await
            ),
            Reason::NotFound
        );

        // kill_all ends everything the table started, including what they started.
        let mut a = p.start(sh("sleep 30 & wait")).await.expect("a");
        let mut b = p.start(req("sleep", &["30"])).await.expect("b");
        let (mut sa, mut sb) = (Seen::default(), Seen::default());
        until(&mut a, &mut sa, |s| s.pid != 0).await;
        until(&mut b, &mut sb, |s| s.pid != 0).await;
        p.kill_all();
        to_end(&mut a, &mut sa).await;
        to_end(&mut b, &mut sb).await;
        assert_eq!(sa.end().status, "signal: killed");
        assert_eq!(sb.end().status, "signal: killed");
        assert!(p.list().await.is_empty());
    });
}

#[test]
fn env_cwd_and_fds() {
    let cfg = AetherConfig {
        env: [("IMG".to_string(), "img".to_string())].into(),
        ..Default::default()
    };
    run(cfg, |p| async move {
        let mut r = sh("echo $FOO $IMG $HOME $USER; pwd");
        r.env = HashMap::from([("FOO".to_string(), "bar".to_string())]);
        r.cwd = "/usr".into();
        let s = run_to_end(&p, r).await;
        let user = if nix::unistd::geteuid().is_root() {
            "root"
        } else {
            ""
        };
        if !user.is_empty() {
            assert_eq!(s.out(), "bar img /root root\n/usr\n");
        }
        // Only stdin, stdout and stderr are inherited (ls opens the directory as fd 3).
        let s = run_to_end(&p, req("ls", &["/proc/self/fd"])).await;
        assert_eq!(s.out(), "0\n1\n2\n3\n");
        // A cwd that is not a directory is `invalid`.
        let mut r = req("true", &[]);
        r.cwd = "/nonexistent-dir".into();
        assert_eq!(reason(p.start(r).await), Reason::Invalid);
        // The workdir of the image is the default cwd.
    });
    let cfg = AetherConfig {
        workdir: "/etc".into(),
        ..Default::default()
    };
    run(cfg, |p| async move {
        let s = run_to_end(&p, req("pwd", &[])).await;
        assert_eq!(s.out(), "/etc\n");
    });
}

#[test]
fn unknown_programs_are_not_found() {
    run(AetherConfig::default(), |p| async move {
        assert_eq!(
            reason(p.start(req("no-such-program-xyz", &[])).await),
            Reason::NotFound
        );
        assert_eq!(
            reason(p.start(req("/nonexistent/prog", &[])).await),
            Reason::NotFound
        );
        assert_eq!(reason(p.start(req("", &[])).await), Reason::Invalid);
        // Exec failures come back from the child (with the reaper running: std's spawn
        // would wait for the failed child itself and panic).
        let dir = tempfile::tempdir().expect("tempdir");
        let plain = dir.path().join("plain");
        std::fs::write(&plain, "echo hi\n").expect("write");
        let plain = plain.to_string_lossy().into_owned();
        assert_eq!(reason(p.start(req(&plain, &[])).await), Reason::Invalid); // EACCES
        let garbage = dir.path().join("garbage");
        std::fs::write(&garbage, [0u8, 1, 2, 3]).expect("write");
        std::fs::set_permissions(
            &garbage,
            std::os::unix::fs::PermissionsExt::from_mode(0o755),
        )
        .expect("chmod");
        let garbage = garbage.to_string_lossy().into_owned();
        assert_eq!(reason(p.start(req(&garbage, &[])).await), Reason::Invalid); // ENOEXEC
        assert_eq!(
            reason(p.start(req("echo", &["a\0b"])).await),
            Reason::Invalid
        );
        let mut r = req("true", &[]);
        r.user = "mallory".into();
        assert_eq!(reason(p.start(r).await), Reason::Invalid);
        assert!(p.list().await.is_empty());
    });
}

#[test]
fn user_1000_and_oom_score() {
    if !is_root() {
        return;
    }
    let cfg = AetherConfig {
        protect_from_oom: true,
        ..Default::default()
    };
    run(cfg, |p| async move {
        let mut r = sh("id -u; id -g; id -G; pwd; echo $HOME; cat /proc/self/oom_score_adj");
        r.user = "1000".into();
        let s = run_to_end(&p, r).await;
        assert_eq!(s.out(), "1000\n1000\n1000\n/tmp\n/tmp\n1000\n");
        // By name, from the sandbox's passwd (`id -un` would read the host's).
        let mut r = sh("id -u; echo $USER");
        r.user = "tester".into();
        let s = run_to_end(&p, r).await;
        assert_eq!(s.out(), "1000\ntester\n");
    });
    // A cwd the user cannot enter is `invalid` (chdir happens after setuid).
    run(AetherConfig::default(), |p| async move {
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::set_permissions(
            dir.path(),
            std::os::unix::fs::PermissionsExt::from_mode(0o700),
        )
        .expect("chmod");
        let mut r = req("true", &[]);
        r.user = "1000".into();
        r.cwd = dir.path().to_string_lossy().into_owned();
        assert_eq!(reason(p.start(r).await), Reason::Invalid);
    });
    // init_user is the default user.
    let cfg = AetherConfig {
        init_user: "1000".into(),
        ..Default::default()
    };
    run(cfg, |p| async move {
        let s = run_to_end(&p, req("id", &["-u"])).await;
        assert_eq!(s.out(), "1000\n");
    });
}

#[test]
fn keepalives_while_idle_and_request_ids() {
    let w = world();
    let procs = Procs::new(
        Arc::new(AetherConfig::default()),
        w.reaper.clone(),
        PathBuf::from(w.root.path()),
    )
    .with_keepalive(Duration::from_millis(100));
    w.rt.block_on(async {
        let mut r = sh("sleep 0.5; echo done");
        r.request_id = "req-1".into();
        let mut ev = procs.start(r.clone()).await.expect("start");
        // A retry with the same request id attaches to the same process.
        let mut again = procs.start(r).await.expect("retry");
        let mut s = Seen::default();
        to_end(&mut ev, &mut s).await;
        assert!(s.keepalives >= 1, "keepalives: {}", s.keepalives);
        assert_eq!(s.out(), "done\n");
        let mut s2 = Seen::default();
        to_end(&mut again, &mut s2).await;
        assert_eq!((s2.pid, s2.out()), (s.pid, "done\n".to_string()));
    });
}

#[test]
fn output_beyond_the_ring_drops_the_oldest_and_never_blocks() {
    run(AetherConfig::default(), |p| async move {
        const TOTAL: u64 = 20 << 20;
        let ring = opendsec::guest::procs::OUTPUT_RING_BYTES as u64;
        // Nobody reads the stream: the process must still run to its end.
        let mut r = req("head", &["-c", &TOTAL.to_string(), "/dev/zero"]);
        r.tag = "big".into();
        drop(p.start(r).await.expect("start"));
        let connect = |live| pb::ConnectProcessRequest {
            process: by_tag("big"),
            live,
            ..Default::default()
        };
        let mut live = p.connect(connect(true)).await.expect("connect live");
        while let Some(e) = next(&mut live).await {
            if matches!(e.kind, Some(Kind::End(_))) {
                break;
            }
        }
        // From offset 0: what is left starts where the kept tail starts.
        let mut ev = p.connect(connect(false)).await.expect("connect from 0");
        let mut s = Seen::from(TOTAL - ring, 0);
        to_end(&mut ev, &mut s).await;
        assert_eq!(s.out.len() as u64, ring, "the last {ring} bytes are kept");
        assert_eq!(s.end().exit_code, 0);
    });
}
