//! What the CLI prints (10-cli): protobuf JSON (fields at their default value left out), the
//! lines and summary of batch creation, and help text in the spec's single-dash style.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::Duration;

use super::CtlError;
use crate::pb::ErrorDetail;
use crate::types::Failure;

/// Prints a message in protobuf's JSON form (pbjson: proto field names, int64 as strings,
/// enums by name, fields at default values left out), pretty, one trailing newline.
/// Errors: `internal` if the message cannot be serialized; see [`out`] for write errors.
pub fn json<T: serde::Serialize>(msg: &T) -> Result<(), CtlError> {
    let text = serde_json::to_string_pretty(msg)
        .map_err(|e| Failure::internal(format!("encoding JSON: {e}")))?;
    out(format!("{text}\n").as_bytes())
}

/// Writes bytes to stdout and flushes. A closed pipe (`| head`) ends the command quietly
/// with exit code 141, as a shell reports a SIGPIPE death; other errors are `internal`.
pub fn out(bytes: &[u8]) -> Result<(), CtlError> {
    let mut o = std::io::stdout().lock();
    o.write_all(bytes)
        .and_then(|_| o.flush())
        .map_err(write_error)
}

/// Writes bytes to stderr and flushes (exec's streamed stderr). Errors as for [`out`].
pub fn err(bytes: &[u8]) -> Result<(), CtlError> {
    let mut e = std::io::stderr().lock();
    e.write_all(bytes)
        .and_then(|_| e.flush())
        .map_err(write_error)
}

fn write_error(e: std::io::Error) -> CtlError {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        CtlError::Exit(141)
    } else {
        CtlError::Failed(Failure::internal(format!("writing output: {e}")))
    }
}

/// One line of batch creation output (10-cli `sandbox create -count N`), without newline:
/// `<index>\t<id>` or `<index>\terror\t<reason>: <message>`. Tabs and newlines inside a
/// message become spaces, so each item stays one line.
pub fn batch_line(index: u32, result: &Result<String, ErrorDetail>) -> String {
    match result {
        Ok(id) => format!("{index}\t{id}"),
        Err(e) => {
            let msg: String = e
                .message
                .chars()
                .map(|c| {
                    if c == '\n' || c == '\t' || c == '\r' {
                        ' '
                    } else {
                        c
                    }
                })
                .collect();
            format!("{index}\terror\t{}: {msg}", e.reason)
        }
    }
}

/// The summary after batch lines, as the Go tool printed it:
/// `created 3/4 in 412ms; failures: map[no_capacity:1]` (reasons in sorted order).
pub fn batch_summary(
    created: usize,
    total: usize,
    elapsed: Duration,
    failures: &BTreeMap<String, usize>,
) -> String {
    let map: Vec<String> = failures.iter().map(|(r, n)| format!("{r}:{n}")).collect();
    format!(
        "created {created}/{total} in {}; failures: map[{}]",
        go_duration(elapsed),
        map.join(" ")
    )
}

/// Formats a duration the way Go's `time.Duration` prints it, rounded to milliseconds:
/// `0s`, `412ms`, `1.5s`, `2m3.25s`, `1h0m5s`.
pub fn go_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0s".into();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let h = ms / 3_600_000;
    let m = (ms / 60_000) % 60;
    let s = (ms / 1000) % 60;
    let frac = ms % 1000;
    let mut secs = s.to_string();
    if frac > 0 {
        let f = format!("{frac:03}");
        secs.push('.');
        secs.push_str(f.trim_end_matches('0'));
    }
    if h > 0 {
        format!("{h}h{m}m{secs}s")
    } else if m > 0 {
        format!("{m}m{secs}s")
    } else {
        format!("{secs}s")
    }
}

/// Rewrites argh's help and error text into the spec's single-dash style: `--cpu` becomes
/// `-cpu`; a bare `--` (end of options) stays. Rows of the options table keep their
/// descriptions aligned.
pub fn single_dash(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for (n, line) in text.split('\n').enumerate() {
        if n > 0 {
            out.push('\n');
        }
        let (fixed, removed) = single_dash_line(line);
        // An options row ("  --cpu    CPU cores"): pad the gap before the description.
        match (
            removed,
            line.starts_with("  -"),
            fixed[2.min(fixed.len())..].find("  "),
        ) {
            (r, true, Some(gap)) if r > 0 => {
                let at = gap + 2;
                out.push_str(&fixed[..at]);
                out.push_str(&" ".repeat(r));
                out.push_str(&fixed[at..]);
            }
            _ => out.push_str(&fixed),
        }
    }
    out
}

fn single_dash_line(line: &str) -> (String, usize) {
    let b = line.as_bytes();
    let mut out = String::with_capacity(line.len());
    let mut removed = 0;
    let mut i = 0;
    while i < line.len() {
        let at_word_start = i
            .checked_sub(1)
            .and_then(|j| b.get(j))
            .is_none_or(|c| matches!(c, b' ' | b'[' | b'|' | b'(' | b'`' | b'\''));
        if at_word_start
            && b.get(i) == Some(&b'-')
            && b.get(i + 1) == Some(&b'-')
            && b.get(i + 2).is_some_and(|c| c.is_ascii_lowercase())
        {
            out.push('-');
            removed += 1;
            i += 2;
            continue;
        }
        // Copy one whole character (help text may hold non-ASCII).
        let ch_len = line[i..].chars().next().map(char::len_utf8).unwrap_or(1);
        out.push_str(&line[i..i + ch_len]);
        i += ch_len;
    }
    (out, removed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_lines_for_success_and_failure() {
        assert_eq!(batch_line(0, &Ok("node-a1.4k2m".into())), "0\tnode-a1.4k2m");
        let e = ErrorDetail {
            reason: "quota_exceeded".into(),
            message: "project root/a: sandboxes\nover".into(),
        };
        assert_eq!(
            batch_line(7, &Err(e)),
            "7\terror\tquota_exceeded: project root/a: sandboxes over"
        );
    }

    #[test]
    fn summary_like_go() {
        let mut f = BTreeMap::new();
        assert_eq!(
            batch_summary(3, 3, Duration::from_millis(412), &f),
            "created 3/3 in 412ms; failures: map[]"
        );
        f.insert("quota_exceeded".to_string(), 2);
        f.insert("no_capacity".to_string(), 1);
        assert_eq!(
            batch_summary(1, 4, Duration::from_millis(1500), &f),
            "created 1/4 in 1.5s; failures: map[no_capacity:1 quota_exceeded:2]"
        );
    }

    #[test]
    fn go_durations() {
        assert_eq!(go_duration(Duration::ZERO), "0s");
        assert_eq!(go_duration(Duration::from_micros(999)), "0s");
        assert_eq!(go_duration(Duration::from_millis(5)), "5ms");
        assert_eq!(go_duration(Duration::from_secs(2)), "2s");
        assert_eq!(go_duration(Duration::from_millis(61_050)), "1m1.05s");
        assert_eq!(go_duration(Duration::from_secs(3605)), "1h0m5s");
    }

    #[test]
    fn help_in_single_dash_style() {
        let argh = "Usage: opendsecctl exec <id> [<cmd...>] [--session <session>] [--]\n  --timeout  seconds\n  -h, --help  display usage information\n  a--b";
        assert_eq!(
            single_dash(argh),
            "Usage: opendsecctl exec <id> [-session <session>] [--]\n  -timeout   seconds\n  -h, -help   display usage information\n  a--b"
                .replace("exec <id> [", "exec <id> [<cmd...>] [")
        );
        assert_eq!(
            single_dash("Unrecognized argument: --la"),
            "Unrecognized argument: -la"
        );
        assert_eq!(single_dash("ünï --x"), "ünï -x");
    }
}
