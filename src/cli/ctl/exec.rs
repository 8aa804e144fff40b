//! `exec <id> [-session S] [-user U] [-timeout S] [--] <cmd...>` (docs/cli.md `exec`): runs a
//! command through `StreamShell`, streams its stdout and stderr, and exits with its code.

use std::time::Duration;

use argh::FromArgs;

use super::conn::{Conn, Settings};
use super::{output, values, CtlError, Ctx};
use crate::pb;
use crate::pb::shell_chunk::Kind;
use crate::types::{Failure, Reason};

/// Exit code and message when the command's `-timeout` expires (as `timeout(1)` does).
pub const TIMED_OUT_EXIT: u8 = 124;

/// Extra time the whole command gets past its `-timeout` when `-deadline` is not given.
const DEADLINE_SLACK: Duration = Duration::from_secs(60);

/// How many times a broken output stream is picked up again.
const RESUMES: usize = 10;

#[derive(FromArgs, Debug)]
/// run a command in a sandbox, streaming its stdout and stderr, and exit with its exit code.
/// One argument is a whole shell command ('cd /srv && make test | tail'); several are each
/// quoted and joined, as ssh and docker exec do. opendsecctl's own options are recognized
/// anywhere before --: put -- before a command with words like -timeout or -addr.
#[argh(
    subcommand,
    name = "exec",
    help_triggers("-h", "--help"),
    usage = "<id> [-session S] [-user U] [-timeout S] [--] <cmd...>",
    example = "{command_name} $ID python3 -c 'print(6*7)'",
    example = "{command_name} $ID -- ls -la /"
)]
pub struct ExecArgs {
    /// sandbox id
    #[argh(positional)]
    pub id: String,
    /// the command: one shell command, or a program and its arguments
    #[argh(positional)]
    pub cmd: Vec<String>,
    /// session name (default "default")
    #[argh(option)]
    pub session: Option<String>,
    /// the session's user, when this command starts the session: a name or uid[:gid]
    #[argh(option)]
    pub user: Option<String>,
    /// seconds; on expiry the command is killed, "opendsecctl: command timed out" is
    /// printed and the exit code is 124
    #[argh(option)]
    pub timeout: Option<String>,
}

/// Quotes one word for a POSIX shell: left as is when it has only safe characters, else put
/// in single quotes with each `'` written as `'\''` (Python's `shlex.quote`).
pub fn shell_quote(word: &str) -> String {
    let safe = |c: char| c.is_ascii_alphanumeric() || "_@%+=:,./-".contains(c);
    if !word.is_empty() && word.chars().all(safe) {
        word.to_string()
    } else {
        format!("'{}'", word.replace('\'', r"'\''"))
    }
}

/// The shell command for the given words: one word is a whole shell command, taken as is;
/// several are each quoted and joined with spaces. Errors: `invalid` for no command or an
/// empty one.
pub fn command_line(words: &[String]) -> Result<String, CtlError> {
    match words {
        [] => Err(super::CtlError::usage(
            "exec needs a command after the sandbox id",
        )),
        [one] if one.trim().is_empty() => Err(super::CtlError::usage("empty command")),
        [one] => Ok(one.clone()),
        many => Ok(many
            .iter()
            .map(|w| shell_quote(w))
            .collect::<Vec<_>>()
            .join(" ")),
    }
}

impl ExecArgs {
    fn timeout_s(&self) -> Result<Option<f64>, CtlError> {
        self.timeout
            .as_deref()
            .map(|t| values::number_above("timeout", t, 0.0))
            .transpose()
    }

    /// The whole command's time limit: `-deadline` if given, else the default stretched to
    /// cover `-timeout` plus a minute. Errors: `invalid` for a bad `-timeout`.
    pub fn deadline(&self, s: &Settings) -> Result<Option<Duration>, CtlError> {
        let timeout = self.timeout_s()?;
        Ok(match (s.deadline_given, s.deadline, timeout) {
            (false, Some(d), Some(t)) if t < 1e9 => {
                Some(d.max(Duration::from_secs_f64(t) + DEADLINE_SLACK))
            }
            _ => s.deadline,
        })
    }

    /// Runs the command; returns `Exit(code)` with the command's exit code when it is not 0.
    /// Errors: invalid input; the server's failure; `unavailable` when the stream cannot be
    /// picked up again.
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        values::sandbox_id(&self.id)?;
        let cmd = command_line(&self.cmd)?;
        let timeout = self.timeout_s()?.unwrap_or(0.0);
        if let Some(s) = &self.session {
            values::plain("session", s)?;
        }
        if let Some(u) = &self.user {
            values::plain("user", u)?;
        }
        let conn = ctx.connect()?;
        let req = pb::RunShellRequest {
            sandbox_id: self.id.clone(),
            cmd,
            timeout,
            session: self.session.clone().unwrap_or_else(|| "default".into()),
            user: self.user.clone().unwrap_or_default(),
            request_id: format!("ctl-{:032x}", rand::random::<u128>()),
            ..Default::default()
        };
        let result = stream(&conn, req).await?;
        if result.state_lost && !result.timed_out {
            // A timeout says so already; `exec` or a killed shell does not (docs/sessions.md).
            output::err(
                b"opendsecctl: the session did not keep this command's changes to its directory and variables\n",
            )?;
        }
        if result.dropped_bytes > 0 {
            // The command ran on; only the recording stopped (docs/sessions.md).
            output::err(
                format!(
                    "opendsecctl: {} bytes of output past the first 64 MB of a stream were dropped\n",
                    result.dropped_bytes
                )
                .as_bytes(),
            )?;
        }
        if result.timed_out {
            output::err(b"opendsecctl: command timed out\n")?;
            return Err(CtlError::Exit(TIMED_OUT_EXIT));
        }
        if result.oom_killed {
            // The exit code (137) alone reads like any SIGKILL.
            output::err(
                b"opendsecctl: the sandbox's OOM killer ended a process of the command (memory_limit_mb)\n",
            )?;
        }
        match exit_code(result.exit_code) {
            0 => Ok(()),
            c => Err(CtlError::Exit(c)),
        }
    }
}

/// The process exit code for a command's exit code: 0..=255 as is, anything else 255 (so a
/// failure never reads as success).
pub fn exit_code(code: i32) -> u8 {
    u8::try_from(code).unwrap_or(255)
}

/// Where the output streams stand, to pick a broken stream up without repeating anything.
#[derive(Default)]
struct Progress {
    cmd_id: Option<i64>,
    stdout: i64,
    stderr: i64,
}

impl Progress {
    /// The part of a chunk not written yet. Chunks at or past the written length pass whole;
    /// a chunk that starts earlier (re-sent after a resume) is trimmed.
    fn fresh<'a>(written: &mut i64, offset: i64, data: &'a [u8]) -> &'a [u8] {
        let len = data.len() as i64;
        let skip = if offset > 0 && offset < *written {
            (*written - offset).min(len)
        } else {
            0
        };
        let end_by_offset = if offset > 0 { offset + len } else { 0 };
        *written = (*written + len - skip).max(end_by_offset);
        data.get(skip as usize..).unwrap_or_default()
    }
}

/// Streams the command's output to stdout/stderr until its exit record. A stream broken by
/// `unavailable` resumes with `StreamOutput` from the offsets reached (or, before the command
/// started, with the same request id, which never runs a command twice).
async fn stream(conn: &Conn, req: pb::RunShellRequest) -> Result<pb::ShellResult, CtlError> {
    let mut p = Progress::default();
    let mut resumes = 0;
    loop {
        let opened = match p.cmd_id {
            None => {
                conn.call(
                    req.clone(),
                    |mut c, r| async move { c.stream_shell(r).await },
                )
                .await
            }
            Some(cmd_id) => {
                let again = pb::GetOutputRequest {
                    sandbox_id: req.sandbox_id.clone(),
                    session: req.session.clone(),
                    cmd_id,
                    wait: 0.0,
                    stdout_offset: p.stdout,
                    stderr_offset: p.stderr,
                };
                conn.call(again, |mut c, r| async move { c.stream_output(r).await })
                    .await
            }
        };
        let broke = match opened {
            Err(f) => f,
            Ok(mut s) => loop {
                match s.message().await {
                    Ok(Some(chunk)) => match chunk.kind {
                        Some(Kind::Started(id)) => p.cmd_id = Some(id),
                        Some(Kind::Stdout(d)) => {
                            output::out(Progress::fresh(&mut p.stdout, chunk.offset, &d))?
                        }
                        Some(Kind::Stderr(d)) => {
                            output::err(Progress::fresh(&mut p.stderr, chunk.offset, &d))?
                        }
                        Some(Kind::Exit(r)) => return Ok(r),
                        None => {}
                    },
                    Ok(None) => {
                        break Failure::unavailable(
                            "the output stream ended before the command's exit status",
                        )
                    }
                    Err(status) => break crate::rpc::failure_from_status(&status),
                }
            },
        };
        if broke.reason != Reason::Unavailable || resumes >= RESUMES {
            return Err(broke.into());
        }
        resumes += 1;
        tokio::time::sleep(Duration::from_millis(100 * resumes as u64)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn quoting_is_minimal_and_posix() {
        assert_eq!(shell_quote("python3"), "python3");
        assert_eq!(shell_quote("print(6*7)"), "'print(6*7)'");
        assert_eq!(shell_quote(""), "''");
        assert_eq!(shell_quote("it's"), r"'it'\''s'");
        assert_eq!(
            command_line(&s(&["python3", "-c", "print(6*7)"])).unwrap(),
            "python3 -c 'print(6*7)'"
        );
        assert_eq!(
            command_line(&s(&["cd /srv && make | tail"])).unwrap(),
            "cd /srv && make | tail"
        );
        assert!(command_line(&[]).is_err());
        assert!(command_line(&s(&["  "])).is_err());
    }

    /// Each word survives a real POSIX shell unchanged: `sh -c "printf '%s\0' <joined>"`.
    #[test]
    fn quoting_round_trips_through_sh() {
        let words = s(&[
            "plain",
            "two words",
            "",
            "it's",
            "\"double\"",
            "'single'",
            "$HOME",
            "${x:-y}",
            "`id`",
            "$(id)",
            "back\\slash",
            "new\nline",
            "tab\there",
            "glob*?[a]",
            "ünïcødé ✓ 日本語",
            "semi;colon|pipe&amp>redir<",
            "-la",
            "--",
            "~",
            "#comment",
            "!bang",
            "\\'",
            "'\"'\"'",
        ]);
        let joined = command_line(&words).unwrap();
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("printf '%s\\0' {joined}"))
            .env("HOME", "/should/not/expand")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let got: Vec<&str> = text.strip_suffix('\0').unwrap().split('\0').collect();
        assert_eq!(got, words.iter().map(String::as_str).collect::<Vec<_>>());
    }

    #[test]
    fn exit_codes_never_read_as_success() {
        assert_eq!(exit_code(0), 0);
        assert_eq!(exit_code(3), 3);
        assert_eq!(exit_code(255), 255);
        assert_eq!(exit_code(256), 255);
        assert_eq!(exit_code(-1), 255);
    }

    #[test]
    fn resumed_chunks_are_not_written_twice() {
        let mut w = 0i64;
        assert_eq!(Progress::fresh(&mut w, 0, b"hello "), b"hello ");
        assert_eq!(Progress::fresh(&mut w, 6, b"world"), b"world");
        assert_eq!(w, 11);
        // Re-sent from offset 3 after a resume: only the unseen tail is written.
        assert_eq!(Progress::fresh(&mut w, 3, b"lo world!"), b"!");
        assert_eq!(w, 12);
        // A server that leaves offsets unset (0) gets everything written, in order.
        let mut w = 0i64;
        assert_eq!(Progress::fresh(&mut w, 0, b"a"), b"a");
        assert_eq!(Progress::fresh(&mut w, 0, b"b"), b"b");
        assert_eq!(w, 2);
    }

    #[test]
    fn deadline_stretches_to_the_timeout_unless_given() {
        let mut st = Settings::resolve(&Default::default(), |_| None).unwrap();
        let a = ExecArgs {
            id: "x".into(),
            cmd: vec![],
            session: None,
            user: None,
            timeout: Some("600".into()),
        };
        assert_eq!(a.deadline(&st).unwrap(), Some(Duration::from_secs(660)));
        st.deadline_given = true;
        assert_eq!(a.deadline(&st).unwrap(), st.deadline);
        let bad = ExecArgs {
            timeout: Some("-1".into()),
            ..a
        };
        assert!(bad.deadline(&st).is_err());
    }
}
