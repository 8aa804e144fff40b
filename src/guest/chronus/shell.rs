//! The session's long-lived shell and the protocol chronus speaks with it.
//!
//! Each command's text is written to `<dir>/cmd/<id>.sh`; chronus sends the shell one line
//! that sources it with stdin from /dev/null and stdout/stderr appended to two FIFOs that
//! chronus reads, then reports `<id> <status> <pwd>\0` on the control FIFO. Sourcing (not
//! a subshell) keeps `cd`, `export` and functions; a syntax error fails the `.` only, and
//! `exit` ends the shell, which chronus then restarts in the last known directory.
//! Background commands run in a subshell `( ... ) &` and also report their pid
//! (`<id> p <pid>\0`).

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use tokio::io::AsyncWriteExt;
use tokio::net::unix::pipe;
use tokio::sync::oneshot;

use crate::guest::reaper::{Exit, Reaper};

/// How to start the session's shell.
#[derive(Debug, Clone)]
pub struct ShellSpec {
    /// bash, or sh when the image has no bash.
    pub program: PathBuf,
    pub args: Vec<String>,
    /// The whole environment (the shell starts with nothing else).
    pub env: BTreeMap<String, String>,
    /// Directories to try, in order, when the last known one is gone.
    pub fallback_dirs: Vec<PathBuf>,
    /// Give the shell (and so its commands) oom_score_adj 1000.
    pub oom_first: bool,
    /// Open `workload/cgroup.procs` files: the shell moves itself there before its exec,
    /// so it and its commands never run in the agents' cgroup.
    pub cgroup_procs_fds: Vec<std::os::fd::RawFd>,
}

impl ShellSpec {
    /// bash from the environment's `PATH` (then /bin/bash), else sh.
    pub fn find(env: BTreeMap<String, String>, fallback_dirs: Vec<PathBuf>, oom: bool) -> Self {
        let path = env.get("PATH").cloned().unwrap_or_default();
        let find = |name: &str| {
            path.split(':')
                .filter(|d| !d.is_empty())
                .map(|d| Path::new(d).join(name))
                .chain([Path::new("/bin").join(name)])
                .find(|p| p.is_file())
        };
        let (program, args) = match find("bash") {
            Some(p) => (p, vec!["--noprofile".into(), "--norc".into()]),
            None => (find("sh").unwrap_or_else(|| "/bin/sh".into()), vec![]),
        };
        ShellSpec {
            program,
            args,
            env,
            fallback_dirs,
            oom_first: oom,
            cgroup_procs_fds: Vec::new(),
        }
    }
}

/// A running shell.
pub struct Shell {
    pub pid: i32,
    stdin: pipe::Sender,
    /// Resolves when the shell ends.
    pub exit: oneshot::Receiver<Exit>,
}

impl Shell {
    /// Starts the shell in `cwd`, else in the first fallback directory that works.
    /// Errors: no directory works, or the program cannot be run.
    pub fn spawn(spec: &ShellSpec, cwd: &Path, reaper: &Reaper) -> std::io::Result<Shell> {
        let mut last = None;
        for dir in std::iter::once(cwd).chain(spec.fallback_dirs.iter().map(PathBuf::as_path)) {
            let mut c = Command::new(&spec.program);
            c.args(&spec.args)
                .env_clear()
                .envs(&spec.env)
                .env("PWD", dir)
                .current_dir(dir)
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::null());
            if !spec.cgroup_procs_fds.is_empty() {
                crate::sys::process::join_cgroups_at_exec(&mut c, &spec.cgroup_procs_fds);
            }
            match c.spawn() {
                Ok(mut child) => {
                    let pid = child.id();
                    let exit = reaper.watch(pid);
                    if spec.oom_first {
                        // Raising one's own processes' score needs no privilege.
                        let _ = std::fs::write(format!("/proc/{pid}/oom_score_adj"), "1000");
                    }
                    let stdin = child
                        .stdin
                        .take()
                        .ok_or_else(|| std::io::Error::other("shell without stdin"))?;
                    let stdin = pipe::Sender::from_owned_fd(OwnedFd::from(stdin))?;
                    return Ok(Shell {
                        pid: pid as i32,
                        stdin,
                        exit,
                    });
                }
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or_else(|| std::io::Error::other("no directory to start the shell in")))
    }

    /// Sends one line. Errors: the shell is gone (EPIPE).
    pub async fn send(&mut self, line: &str) -> std::io::Result<()> {
        self.stdin.write_all(line.as_bytes()).await
    }
}

/// Quotes `s` for the shell: single quotes, with each `'` written as `'\''`.
pub fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Whether `k` may be exported as a variable name.
pub fn valid_env_name(k: &str) -> bool {
    let mut cs = k.chars();
    matches!(cs.next(), Some(c) if c.is_ascii_alphabetic() || c == '_')
        && cs.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Paths of one command's files.
pub struct CmdFiles {
    pub script: PathBuf,
    pub out: PathBuf,
    pub err: PathBuf,
    pub ctl: PathBuf,
}

/// What runs the command's script: sourced in the session shell, or in a subshell when
/// the call sets its own directory or variables (they apply to this command only).
fn body(f: &CmdFiles, cwd: &str, env: &BTreeMap<String, String>, subshell: bool) -> String {
    let script = quote(&f.script.to_string_lossy());
    if cwd.is_empty() && env.is_empty() {
        return if subshell {
            format!("( . {script} )")
        } else {
            format!("{{ . {script} ; }}")
        };
    }
    let mut parts = Vec::new();
    if !cwd.is_empty() {
        parts.push(format!("cd -- {}", quote(cwd)));
    }
    for (k, v) in env {
        parts.push(format!("export {}", quote(&format!("{k}={v}"))));
    }
    parts.push(format!(". {script}"));
    format!("( {} )", parts.join(" && "))
}

/// The line that runs foreground command `id`.
pub fn foreground_line(id: i64, f: &CmdFiles, cwd: &str, env: &BTreeMap<String, String>) -> String {
    format!(
        "{} </dev/null >>{} 2>>{}; command printf '%s %s %s\\0' {id} \"$?\" \"$PWD\" >>{}\n",
        body(f, cwd, env, false),
        quote(&f.out.to_string_lossy()),
        quote(&f.err.to_string_lossy()),
        quote(&f.ctl.to_string_lossy()),
    )
}

/// The line that starts background command `id` in a subshell and reports its pid.
pub fn background_line(id: i64, f: &CmdFiles, cwd: &str, env: &BTreeMap<String, String>) -> String {
    let ctl = quote(&f.ctl.to_string_lossy());
    format!(
        "( {} </dev/null >>{} 2>>{}; command printf '%s %s %s\\0' {id} \"$?\" \"$PWD\" >>{ctl} ) \
         </dev/null >/dev/null 2>&1 & command printf '%s p %s\\0' {id} \"$!\" >>{ctl}\n",
        body(f, cwd, env, true),
        quote(&f.out.to_string_lossy()),
        quote(&f.err.to_string_lossy()),
    )
}

/// A message on the control FIFO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ctl {
    /// Command `id` ended with `status`, the shell then being in `pwd`.
    Done { id: i64, status: i32, pwd: String },
    /// Background command `id` runs in subshell `pid`.
    Pid { id: i64, pid: i32 },
}

/// Parses one control message (without its NUL); `None` for anything else (the session's
/// own commands can write to the FIFO, so junk is ignored).
pub fn parse_ctl(msg: &[u8]) -> Option<Ctl> {
    let text = std::str::from_utf8(msg).ok()?;
    let mut f = text.splitn(3, ' ');
    let id: i64 = f.next()?.parse().ok()?;
    let second = f.next()?;
    let third = f.next()?;
    if second == "p" {
        return Some(Ctl::Pid {
            id,
            pid: third.parse().ok()?,
        });
    }
    Some(Ctl::Done {
        id,
        status: second.parse().ok()?,
        pwd: third.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quoting_and_names() {
        assert_eq!(quote("a'b"), r"'a'\''b'");
        assert!(valid_env_name("_A1"));
        assert!(!valid_env_name("1A"));
        assert!(!valid_env_name("A-B"));
        assert!(!valid_env_name(""));
    }

    #[test]
    fn control_messages() {
        assert_eq!(
            parse_ctl(b"3 0 /a b"),
            Some(Ctl::Done {
                id: 3,
                status: 0,
                pwd: "/a b".into()
            })
        );
        assert_eq!(parse_ctl(b"4 p 99"), Some(Ctl::Pid { id: 4, pid: 99 }));
        assert_eq!(parse_ctl(b"junk"), None);
        assert_eq!(parse_ctl(b"4 p x"), None);
    }

    #[test]
    fn lines_run_in_a_real_shell() {
        let d = tempfile::tempdir().expect("tempdir");
        let f = CmdFiles {
            script: d.path().join("c.sh"),
            out: d.path().join("o"),
            err: d.path().join("e"),
            ctl: d.path().join("ctl"),
        };
        std::fs::write(&f.script, "echo \"$X\" ; pwd ; echo oops >&2").expect("write");
        let env = BTreeMap::from([("X".to_string(), "it's".to_string())]);
        let line = foreground_line(1, &f, "/", &env);
        let st = Command::new("sh").args(["-c", &line]).status().expect("sh");
        assert!(st.success());
        assert_eq!(std::fs::read(&f.out).expect("out"), b"it's\n/\n");
        assert_eq!(std::fs::read(&f.err).expect("err"), b"oops\n");
        let ctl = std::fs::read(&f.ctl).expect("ctl");
        let msg = ctl.strip_suffix(b"\0").expect("nul");
        match parse_ctl(msg) {
            Some(Ctl::Done {
                id: 1, status: 0, ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }
}
