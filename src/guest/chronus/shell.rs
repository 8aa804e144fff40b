//! The session's long-lived shell and the protocol chronus speaks with it (docs/sessions.md).
//!
//! Each command's text is written to `<dir>/cmd/<id>.sh`; chronus sends the long-lived
//! shell one line that runs it in a subshell of its own: a job (with bash, its own process
//! group), stdin from /dev/null, stdout/stderr appended to two FIFOs that chronus reads. The
//! subshell `eval`s the script (so no message names the file) and, however it ends
//! (`exit`, a `set -e` failure, the last line), writes the state it ends in (directory,
//! variables, functions, umask) to `<dir>/state/<id>`; the long-lived shell waits for it,
//! takes that state in and reports `<id> <status> <lost> <pwd>\0` on the control FIFO.
//! With bash, a command that changed nothing (most do not) writes only the line that says
//! its dump was whole, and the long-lived shell has nothing to take in: the subshell
//! compares its dump with `<dir>/state/current`, the state the long-lived shell is in.
//! Killing a command (its timeout) is killing its job, never the shell that holds the
//! session's state; a command that leaves no whole dump (killed, `exec`) is reported with
//! `lost` 1 and the session goes on with the state it had before. Background commands run
//! as jobs too and report their pid (`<id> p <pid>\0`), as foreground ones do.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
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
    /// bash or a POSIX sh.
    pub flavor: Flavor,
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
        let (program, args, flavor) = match find("bash") {
            Some(p) => (p, vec!["--noprofile".into(), "--norc".into()], Flavor::Bash),
            None => (
                find("sh").unwrap_or_else(|| "/bin/sh".into()),
                vec![],
                Flavor::Sh,
            ),
        };
        ShellSpec {
            program,
            args,
            env,
            fallback_dirs,
            oom_first: oom,
            flavor,
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
    /// Starts the shell in `cwd`, else in the first fallback directory that works; between
    /// fork and exec it joins the session's cgroups and then those of `extra_joins` (open
    /// join files, close-on-exec). Errors: no directory works, or the program cannot be run.
    pub fn spawn(
        spec: &ShellSpec,
        cwd: &Path,
        reaper: &Reaper,
        extra_joins: &[std::os::fd::RawFd],
    ) -> std::io::Result<Shell> {
        let joins: Vec<std::os::fd::RawFd> = spec
            .cgroup_procs_fds
            .iter()
            .chain(extra_joins)
            .copied()
            .collect();
        let mut last = None;
        for dir in std::iter::once(cwd).chain(spec.fallback_dirs.iter().map(PathBuf::as_path)) {
            let mut c = Command::new(&spec.program);
            // Its messages start with `$0`: "bash: line 1: ...", as with `bash -c`.
            c.arg0(match spec.flavor {
                Flavor::Bash => "bash",
                Flavor::Sh => "sh",
            })
            .args(&spec.args)
            // Its own group: a group kill of a command can never reach chronus.
            .process_group(0)
            .env_clear()
            .envs(&spec.env)
            .env("PWD", dir)
            .current_dir(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
            if !joins.is_empty() {
                crate::sys::process::join_cgroups_at_exec(&mut c, &joins);
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
    /// With bash: the command's whole line, which the shell reads and `eval`s (see
    /// [`eval_line`]).
    pub line: PathBuf,
    pub out: PathBuf,
    pub err: PathBuf,
    pub ctl: PathBuf,
    /// Where the command's shell writes the session state it ends with (see [`Flavor`]),
    /// with sh.
    pub state: PathBuf,
    /// Where it does with bash: one file for the session, as a command that changed nothing
    /// must write the same dump as the command before it (see [`init_line`]).
    pub next: PathBuf,
    /// Present while chronus kills the command's job: the shell then leaves it stopped.
    pub kill: PathBuf,
}

/// Which shell runs the session, and so how its state is carried from one command to the
/// next (docs/sessions.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// bash: the directory, every variable (exported or not, unsets included), functions
    /// and the umask carry over; each command runs in its own process group (`set -m`).
    Bash,
    /// A POSIX sh: the directory, exported variables and the umask carry over.
    Sh,
}

/// The names of every shell variable, as a word list that bash expands without forking
/// (`${!A*}` is every name starting with `A`, and so on).
fn all_names() -> String {
    ('A'..='Z')
        .chain('a'..='z')
        .chain(['_'])
        .map(|c| format!("${{!{c}@}}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// bash's own variables, which it sets itself as commands run (`LINENO`, `PIPESTATUS`, the
/// command hash `BASH_CMDS`, ...) or which change on every read (`RANDOM`, `SECONDS`): a
/// command's dump leaves them out and the restore never unsets them, so that they are the
/// long-lived shell's own and a command that changed nothing has a dump equal to the last.
const BASH_OWN: &str = "BASHPID BASH_ARGC BASH_ARGV BASH_ARGV0 BASH_CMDS BASH_COMMAND \
     BASH_EXECUTION_STRING BASH_LINENO BASH_REMATCH BASH_SOURCE BASH_SUBSHELL COMP_WORDBREAKS DIRSTACK \
     EPOCHREALTIME EPOCHSECONDS FUNCNAME GROUPS HISTCMD LINENO PIPESTATUS RANDOM SECONDS \
     SRANDOM _";

/// The whole content of a bash command's state file when the command changed nothing: the
/// dump was whole, and equal to the session's current state.
pub const UNCHANGED_STATE: &[u8] = b"__opendsec_ok=1\n";

/// The code that ends a command's shell: it writes the state the shell is in to `state`
/// (the last line, `__opendsec_ok=1`, tells a whole dump from a cut one), then exits with
/// the command's status. It runs from the `EXIT` trap (so `exit` and a `set -e` failure
/// keep their state) and after the command's last line. With bash (whose commands' code it
/// is kept in the long-lived shell's `__opendsec_dump`, set by [`init_line`]) a dump equal
/// to `compare` (the current state) is replaced by [`UNCHANGED_STATE`]. Nothing it needs is
/// kept in a variable, which the dump would hold: the paths are written into the code and
/// the status goes through a here-string on fd 5.
fn dump_code(flavor: Flavor, state: &Path, compare: Option<&Path>) -> String {
    let st = quote(&state.to_string_lossy());
    match flavor {
        Flavor::Bash => {
            let cmp = compare.map_or_else(String::new, |c| {
                format!(
                    "builtin mapfile -d '' __opendsec_a <{st} 2>/dev/null; \
                     builtin mapfile -d '' __opendsec_b <{c} 2>/dev/null; \
                     [[ -z \"${{__opendsec_a[0]-}}\" || \"${{__opendsec_a[0]}}\" != \"${{__opendsec_b[0]-}}\" ]] || \
                     builtin printf '__opendsec_ok=1\\n' >{st} 2>/dev/null; ",
                    c = quote(&c.to_string_lossy())
                )
            });
            format!(
                "{{ builtin trap - EXIT; builtin set +eu; builtin unset -v ${{!__opendsec_@}} {own} 2>/dev/null; {{ \
                 builtin printf 'builtin cd -- %q\\n' \"$PWD\"; builtin declare -p; builtin declare -f; \
                 IFS=$' \\t\\n'; builtin printf 'builtin declare -A __opendsec_keep; __opendsec_keep=( '; \
                 builtin printf '[%s]=1 ' {names}; \
                 builtin printf ')\\n'; builtin umask -p; builtin printf '__opendsec_full=1 __opendsec_ok=1\\n'; \
                 }} >{st} 2>/dev/null; {cmp}builtin read -r -u 5 __opendsec_s; builtin exit \"$__opendsec_s\"; }} 5<<<\"$?\"",
                own = BASH_OWN,
                names = all_names()
            )
        }
        Flavor::Sh => format!(
            "__opendsec_s=$?; trap - EXIT; set +eu; __opendsec_pwd=$PWD; export __opendsec_pwd; \
             {{ export -p; printf 'umask %s\\n' \"$(umask)\"; printf '__opendsec_ok=1\\n'; \
             }} >{st} 2>/dev/null; exit \"$__opendsec_s\""
        ),
    }
}

/// bash: the loop that unsets, after a whole dump was taken in, every variable the dump did
/// not list (the command unset it), but for ours and bash's own. Kept in the long-lived
/// shell's `__opendsec_unset`.
fn unset_code() -> String {
    format!(
        "for __opendsec_n in {names}; do case $__opendsec_n in \
         __opendsec_*|{own}) ;; *) [[ -n ${{__opendsec_keep[$__opendsec_n]+1}} ]] || \
         builtin unset -v \"$__opendsec_n\" 2>/dev/null;; esac; done",
        names = all_names(),
        own = BASH_OWN.split_whitespace().collect::<Vec<_>>().join("|")
    )
}

/// The code that takes in a command's state dump in the long-lived shell, setting
/// `__opendsec_lost` to 0 when a whole dump was taken in, else 1 (the shell keeps the state
/// it had before the command).
fn restore_code(flavor: Flavor, state: &Path) -> String {
    let state = quote(&state.to_string_lossy());
    match flavor {
        Flavor::Bash => format!(
            "__opendsec_ok=; __opendsec_full=; builtin unset -v __opendsec_keep; \
             if [ -s {state} ]; then builtin . {state} >/dev/null 2>&1; fi; \
             if [ \"$__opendsec_ok\" = 1 ]; then __opendsec_lost=0; \
             [ \"$__opendsec_full\" != 1 ] || builtin eval \"$__opendsec_unset\"; \
             else __opendsec_lost=1; fi"
        ),
        Flavor::Sh => format!(
            "__opendsec_ok=; __opendsec_pwd=; if [ -s {state} ]; then . {state} >/dev/null 2>&1; fi; \
             if [ \"$__opendsec_ok\" = 1 ]; then __opendsec_lost=0; \
             cd -- \"$__opendsec_pwd\" 2>/dev/null; else __opendsec_lost=1; fi; unset __opendsec_pwd"
        ),
    }
}

/// The first line the long-lived shell gets: job control (each command then runs in its
/// own process group, which a timeout kills as one), and the state a shell of this session
/// last ended a command with (`current`), when there is one (a restarted shell goes on
/// from there). With bash it also keeps the dump's code in a variable (so that each
/// command's line stays short), for commands that dump to `next`, and in a new session it
/// writes the state it starts in to `current`, which a command that changes nothing then
/// matches.
pub fn init_line(flavor: Flavor, current: &Path, next: &Path) -> String {
    let cur = quote(&current.to_string_lossy());
    match flavor {
        Flavor::Bash => format!(
            "builtin set -m 2>/dev/null; __opendsec_dump={dump}; __opendsec_unset={unset}; \
             if [ -s {cur} ]; then builtin . {cur} >/dev/null 2>&1; \
             else ( {first} ) </dev/null >/dev/null 2>&1 & builtin wait $!; fi\n",
            dump = quote(&dump_code(flavor, next, Some(current))),
            unset = quote(&unset_code()),
            first = dump_code(flavor, current, None),
        ),
        Flavor::Sh => format!(
            "set -m 2>/dev/null; if [ -s {cur} ]; then . {cur} >/dev/null 2>&1; \
             cd -- \"$__opendsec_pwd\" 2>/dev/null; unset __opendsec_pwd; fi\n"
        ),
    }
}

/// The short line that has bash run the command line kept in file `line` (at the top
/// level, as if it had come on stdin). bash reads stdin a byte per `read` (it may not read
/// past a line it runs), so a command's 1.2 KiB line cost as many system calls; from a file
/// it is one. `eval`, not `.`, so that no message of the shell names the file.
pub fn eval_line(line: &Path) -> String {
    format!(
        "builtin mapfile -d '' __opendsec_l <{}; builtin eval \"builtin unset -v __opendsec_l; ${{__opendsec_l[0]}}\"\n",
        quote(&line.to_string_lossy())
    )
}

/// The code that runs the command's script in the current (sub)shell: read and `eval`ed,
/// not sourced, so that no message of the shell names the script's internal path.
fn eval_code(flavor: Flavor, script: &Path) -> String {
    let script = quote(&script.to_string_lossy());
    match flavor {
        Flavor::Bash => format!(
            "builtin mapfile -d '' __opendsec_c <{script}; \
             builtin eval \"builtin unset -v __opendsec_c; ${{__opendsec_c[0]}}\""
        ),
        Flavor::Sh => format!("eval \"$(cat {script})\""),
    }
}

/// The body of command `id`'s subshell: the script, then (when `keep`) the state dump.
/// A call's own directory or variables apply to this command only: then nothing is kept.
fn body(flavor: Flavor, f: &CmdFiles, cwd: &str, env: &BTreeMap<String, String>) -> String {
    let run = eval_code(flavor, &f.script);
    if cwd.is_empty() && env.is_empty() {
        return match flavor {
            Flavor::Bash => format!(
                "builtin trap -- \"$__opendsec_dump\" EXIT; {run}; builtin eval \"$__opendsec_dump\""
            ),
            Flavor::Sh => {
                let dump = dump_code(flavor, &f.state, None);
                format!("trap -- {} EXIT; {run}; {dump}", quote(&dump))
            }
        };
    }
    let mut parts = Vec::new();
    if !cwd.is_empty() {
        parts.push(format!("cd -- {}", quote(cwd)));
    }
    for (k, v) in env {
        parts.push(format!("export {}", quote(&format!("{k}={v}"))));
    }
    parts.push(format!("{{ {run}; }}"));
    parts.join(" && ")
}

/// Whether a foreground command with these per-call settings carries its state over.
pub fn keeps_state(cwd: &str, env: &BTreeMap<String, String>) -> bool {
    cwd.is_empty() && env.is_empty()
}

/// The line that runs foreground command `id`: its subshell runs as a job of its own
/// (reported as `<id> p <pid>`), the long-lived shell waits for it (going on a stopped job),
/// takes in the state it ended with, and reports `<id> <status> <lost> <pwd>`.
pub fn foreground_line(
    flavor: Flavor,
    id: i64,
    f: &CmdFiles,
    cwd: &str,
    env: &BTreeMap<String, String>,
) -> String {
    let ctl = quote(&f.ctl.to_string_lossy());
    let b = if flavor == Flavor::Bash {
        "builtin "
    } else {
        ""
    };
    let take = if keeps_state(cwd, env) {
        restore_code(
            flavor,
            match flavor {
                Flavor::Bash => &f.next,
                Flavor::Sh => &f.state,
            },
        )
    } else {
        "__opendsec_lost=0".to_string()
    };
    format!(
        "( {body} ) </dev/null >>{out} 2>>{err} & __opendsec_p=$!; \
         {b}printf '\\0%s p %s\\0' {id} \"$__opendsec_p\" >>{ctl}; \
         {b}wait \"$__opendsec_p\"; __opendsec_st=$?; \
         while {b}kill -0 \"$__opendsec_p\" 2>/dev/null; do [ -e {kill} ] || {b}kill -CONT -- \"-$__opendsec_p\" 2>/dev/null; \
         {b}wait \"$__opendsec_p\"; __opendsec_st=$?; done; \
         {take}; {b}printf '\\0%s %s %s %s\\0' {id} \"$__opendsec_st\" \"$__opendsec_lost\" \"$PWD\" >>{ctl}\n",
        body = body(flavor, f, cwd, env),
        kill = quote(&f.kill.to_string_lossy()),
        out = quote(&f.out.to_string_lossy()),
        err = quote(&f.err.to_string_lossy()),
    )
}

/// The line that starts background command `id` as a job of its own and reports its pid.
/// Its state is never carried over (it runs beside later commands).
pub fn background_line(
    flavor: Flavor,
    id: i64,
    f: &CmdFiles,
    cwd: &str,
    env: &BTreeMap<String, String>,
) -> String {
    let ctl = quote(&f.ctl.to_string_lossy());
    let b = if flavor == Flavor::Bash {
        "builtin "
    } else {
        ""
    };
    let run = eval_code(flavor, &f.script);
    let mut parts = Vec::new();
    if !cwd.is_empty() {
        parts.push(format!("cd -- {}", quote(cwd)));
    }
    for (k, v) in env {
        parts.push(format!("export {}", quote(&format!("{k}={v}"))));
    }
    parts.push(format!("{{ {run}; }}"));
    format!(
        "( ( {inner} ) </dev/null >>{out} 2>>{err}; {b}printf '\\0%s %s 0 %s\\0' {id} \"$?\" \"$PWD\" >>{ctl} ) \
         </dev/null >/dev/null 2>&1 & {b}printf '\\0%s p %s\\0' {id} \"$!\" >>{ctl}\n",
        inner = parts.join(" && "),
        out = quote(&f.out.to_string_lossy()),
        err = quote(&f.err.to_string_lossy()),
    )
}

/// A message on the control FIFO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ctl {
    /// Command `id` ended with `status`, the shell then being in `pwd`; `lost` when the
    /// session could not take in the state the command ended with.
    Done {
        id: i64,
        status: i32,
        lost: bool,
        pwd: String,
    },
    /// Command `id` runs in subshell `pid`, the leader of its own process group when the
    /// shell has job control.
    Pid { id: i64, pid: i32 },
}

/// Parses one control message (without its NUL); `None` for anything else (the session's
/// own commands can write to the FIFO, so junk is ignored).
pub fn parse_ctl(msg: &[u8]) -> Option<Ctl> {
    let text = std::str::from_utf8(msg).ok()?;
    let mut f = text.splitn(4, ' ');
    let id: i64 = f.next()?.parse().ok()?;
    let second = f.next()?;
    let third = f.next()?;
    if second == "p" {
        return Some(Ctl::Pid {
            id,
            pid: third.parse().ok()?,
        });
    }
    let lost = match third {
        "0" => false,
        "1" => true,
        _ => return None,
    };
    Some(Ctl::Done {
        id,
        status: second.parse().ok()?,
        lost,
        pwd: f.next()?.to_string(),
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
            parse_ctl(b"3 0 1 /a b"),
            Some(Ctl::Done {
                id: 3,
                status: 0,
                lost: true,
                pwd: "/a b".into()
            })
        );
        assert_eq!(parse_ctl(b"4 p 99"), Some(Ctl::Pid { id: 4, pid: 99 }));
        assert_eq!(parse_ctl(b"junk"), None);
        assert_eq!(parse_ctl(b"4 p x"), None);
        assert_eq!(parse_ctl(b"4 0 2 /"), None);
    }

    fn files(d: &Path, id: i64) -> CmdFiles {
        CmdFiles {
            script: d.join(format!("{id}.sh")),
            out: d.join(format!("{id}.out")),
            err: d.join(format!("{id}.err")),
            ctl: d.join("ctl"),
            state: d.join(format!("{id}.state")),
            next: d.join("next"),
            kill: d.join(format!("{id}.kill")),
            line: d.join(format!("{id}.line")),
        }
    }

    /// Runs `cmds` one after another in one long-lived shell of `flavor`, as the driver
    /// does (after each command, a line does what `Session::keep_state` does with its state
    /// file); returns each one's (stdout, stderr), the control messages and, per command,
    /// whether its state file said it changed nothing.
    fn run_all(flavor: Flavor, cmds: &[&str]) -> (Vec<(String, String)>, Vec<Ctl>, Vec<bool>) {
        let d = tempfile::tempdir().expect("tempdir");
        let cur = d.path().join("current");
        let log = d.path().join("kept");
        let mut input = init_line(flavor, &cur, &d.path().join("next"));
        for (i, c) in cmds.iter().enumerate() {
            let f = files(d.path(), i as i64 + 1);
            std::fs::write(&f.script, c).expect("write");
            input.push_str(&foreground_line(
                flavor,
                i as i64 + 1,
                &f,
                "",
                &BTreeMap::new(),
            ));
            let st = if flavor == Flavor::Bash {
                &f.next
            } else {
                &f.state
            };
            let (st, cur, log) = (
                quote(&st.to_string_lossy()),
                quote(&cur.to_string_lossy()),
                quote(&log.to_string_lossy()),
            );
            input.push_str(&format!(
                "if [ \"$(command cat {st} 2>/dev/null)\" = __opendsec_ok=1 ]; then \
                 echo same >>{log}; command rm -f {st}; else echo full >>{log}; \
                 [ \"$__opendsec_lost\" != 0 ] || command mv -f {st} {cur}; fi\n"
            ));
        }
        let prog = if flavor == Flavor::Bash { "bash" } else { "sh" };
        let mut child = Command::new(prog)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn");
        {
            let mut stdin = child.stdin.take().expect("stdin");
            std::io::Write::write_all(&mut stdin, input.as_bytes()).expect("feed");
        }
        assert!(child.wait().expect("wait").success());
        let outs = (1..=cmds.len() as i64)
            .map(|i| {
                let f = files(d.path(), i);
                (
                    std::fs::read_to_string(&f.out).unwrap_or_default(),
                    std::fs::read_to_string(&f.err).unwrap_or_default(),
                )
            })
            .collect();
        let ctl = std::fs::read(d.path().join("ctl")).expect("ctl");
        let msgs = ctl
            .split(|b| *b == 0)
            .filter(|m| !m.is_empty())
            .filter_map(parse_ctl)
            .filter(|m| matches!(m, Ctl::Done { .. }))
            .collect();
        let same = std::fs::read_to_string(&log)
            .expect("log")
            .lines()
            .map(|l| l == "same")
            .collect();
        (outs, msgs, same)
    }

    fn status_lost(m: &Ctl) -> (i32, bool) {
        match m {
            Ctl::Done { status, lost, .. } => (*status, *lost),
            Ctl::Pid { .. } => (-2, true),
        }
    }

    #[test]
    fn bash_carries_state_through_exit_and_errexit_but_not_exec() {
        let (outs, msgs, _) = run_all(
            Flavor::Bash,
            &[
                "cd /tmp; export X=1; Y=2; f() { echo fn; }; umask 027",
                "echo \"$X $Y\"; f; umask; pwd",
                "cd /; export Z=3; unset Y; exit 3",
                "echo \"${Y-unset} $Z\"; pwd; set -e; cd /usr; false; echo no",
                "pwd; cd /tmp; exec true",
                // A syntax error stops only its own line: the pwd before it runs.
                "pwd; foo_not_a_command\nif then",
            ],
        );
        assert_eq!(outs[1].0, "1 2\nfn\n0027\n/tmp\n");
        assert_eq!(outs[3].0, "unset 3\n/\n");
        assert_eq!(outs[4].0, "/usr\n");
        assert_eq!(outs[5].0, "/usr\n");
        // No internal path in the shell's messages.
        assert!(!outs[5].1.contains(".sh"), "{}", outs[5].1);
        assert!(outs[5].1.contains("syntax"), "{}", outs[5].1);
        let sl: Vec<(i32, bool)> = msgs.iter().map(status_lost).collect();
        assert_eq!(sl.len(), 6);
        assert_eq!(sl[2], (3, false));
        assert_eq!(sl[3], (1, false));
        assert_eq!(sl[4], (0, true));
    }

    /// A command that changes nothing leaves nothing to take in: its state file says so in
    /// one line, and the long-lived shell keeps its state as it is. What a command does
    /// change (a variable, an unset, a function, the directory) still carries over, and a
    /// change undone within the command counts as none. bash's own variables are the
    /// long-lived shell's: `RANDOM` and `SECONDS` go on working.
    #[test]
    fn bash_takes_in_nothing_after_a_command_that_changed_nothing() {
        let (outs, msgs, same) = run_all(
            Flavor::Bash,
            &[
                "echo hi",
                "true; [[ a =~ a ]]; echo $RANDOM $SECONDS $LINENO >/dev/null",
                "export X=1; Y=2",
                "echo \"$X $Y\"",
                "unset Y; f() { echo fn; }",
                "echo \"${Y-unset}\"; f",
                "Z=1; unset Z; o=$(umask); umask 077; umask \"$o\"; unset o",
                "cd /tmp",
                "pwd; [ $RANDOM != $RANDOM ] || [ $RANDOM != $RANDOM ] && echo random",
                "SECONDS=100",
                "[ \"$SECONDS\" -lt 100 ] && echo own",
            ],
        );
        assert_eq!(outs[0].0, "hi\n");
        assert!(outs.iter().all(|(_, e)| e.is_empty()), "{outs:?}");
        assert_eq!(outs[3].0, "1 2\n");
        assert_eq!(outs[5].0, "unset\nfn\n");
        assert_eq!(outs[8].0, "/tmp\nrandom\n");
        assert_eq!(outs[10].0, "own\n", "SECONDS is the long-lived shell's own");
        assert_eq!(
            same,
            vec![true, true, false, true, false, true, true, false, true, true, true]
        );
        assert!(msgs.iter().all(|m| !status_lost(m).1), "{msgs:?}");
    }

    #[test]
    fn sh_carries_directory_and_exports() {
        let (outs, msgs, _) = run_all(
            Flavor::Sh,
            &["cd /tmp; export X=1; exit 4", "echo \"$X\"; pwd"],
        );
        assert_eq!(outs[1].0, "1\n/tmp\n");
        assert_eq!(status_lost(&msgs[0]), (4, false));
    }

    #[test]
    fn per_call_settings_apply_to_one_command() {
        let d = tempfile::tempdir().expect("tempdir");
        let f = files(d.path(), 1);
        std::fs::write(&f.script, "echo \"$X\" ; pwd ; echo oops >&2").expect("write");
        let env = BTreeMap::from([("X".to_string(), "it's".to_string())]);
        let line = foreground_line(Flavor::Bash, 1, &f, "/", &env);
        let st = Command::new("bash")
            .args(["-c", &line])
            .status()
            .expect("bash");
        assert!(st.success());
        assert_eq!(std::fs::read(&f.out).expect("out"), b"it's\n/\n");
        assert_eq!(std::fs::read(&f.err).expect("err"), b"oops\n");
        let ctl = std::fs::read(&f.ctl).expect("ctl");
        let done = ctl
            .split(|b| *b == 0)
            .filter_map(parse_ctl)
            .find(|m| matches!(m, Ctl::Done { .. }));
        match done {
            Some(Ctl::Done {
                id: 1,
                status: 0,
                lost: false,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
    }
}
