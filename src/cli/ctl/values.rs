//! Parsing and checking of option values before any call is made (docs/cli.md): numbers, Go-style
//! durations, `-net` rules, `-quota` pairs, permission lists, dates and ids. Every bad value is
//! a usage error (exit 2) whose message names the option and the offending value (cut to 64
//! characters).

use std::collections::HashMap;
use std::time::Duration;

use super::CtlError;
use crate::types::names;
use crate::types::names::shown;

/// Largest file `cp` moves in one call (docs/cli.md `cp`: up to 64 MB).
pub const MAX_FILE: u64 = 64 * 1024 * 1024;

/// Backends a sandbox can be created on (docs/cli.md `sandbox create -backend`).
pub const BACKENDS: [&str; 5] = ["microvm", "container", "fncall", "fullvm", "sim"];

/// Principal kinds (docs/concepts.md).
pub const KINDS: [&str; 3] = ["agent", "user", "service"];

/// Parses a whole number for option `name`, within `min..=max`.
/// Errors: `invalid` naming the option, e.g. `-mem: "abc" is not a whole number`.
pub fn int(name: &str, s: &str, min: i64, max: i64) -> Result<i64, CtlError> {
    let v: i64 = s
        .trim()
        .parse()
        .map_err(|_| invalid(format!("-{name}: {} is not a whole number", shown(s))))?;
    if v < min || v > max {
        return Err(invalid(format!(
            "-{name}: {v} is out of range ({min} to {max})"
        )));
    }
    Ok(v)
}

/// Parses a finite number (fractions allowed) for option `name`, greater than `above`.
/// Errors: `invalid` naming the option.
pub fn number_above(name: &str, s: &str, above: f64) -> Result<f64, CtlError> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| invalid(format!("-{name}: {} is not a number", shown(s))))?;
    if !v.is_finite() || v <= above {
        return Err(invalid(format!(
            "-{name}: {} must be a number above {above}",
            shown(s)
        )));
    }
    Ok(v)
}

/// Parses a duration: Go's form (`300ms`, `30s`, `5m`, `1h30m`, `1.5h`) or plain seconds
/// (`30`, `2.5`). Zero is allowed (callers give it a meaning, e.g. "no limit").
/// Errors: `invalid` for anything else, negative values included.
pub fn duration(name: &str, s: &str) -> Result<Duration, CtlError> {
    let bad = || {
        invalid(format!(
            "-{name}: {} is not a duration (e.g. 30s, 5m, 1h, or seconds)",
            shown(s)
        ))
    };
    let t = s.trim();
    if t.is_empty() {
        return Err(bad());
    }
    if let Ok(secs) = t.parse::<f64>() {
        return if (0.0..1e12).contains(&secs) {
            Ok(Duration::from_secs_f64(secs))
        } else {
            Err(bad())
        };
    }
    let mut total = 0f64;
    let mut rest = t;
    while !rest.is_empty() {
        let num_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        if num_len == 0 {
            return Err(bad());
        }
        let value: f64 = rest[..num_len].parse().map_err(|_| bad())?;
        rest = &rest[num_len..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(bad()),
        };
        rest = &rest[unit_len..];
        total += value * scale;
    }
    if !total.is_finite() || total >= 1e12 {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(total))
}

/// Parses `-net` (docs/network.md "Rules"): comma separated rules, `!rule` meaning `false`.
/// A rule is a rule set name, a domain (`github.com`, `*.github.com`), an IPv4 address or
/// network, or `*`, optionally with `:port`, `:lo-hi` and `/tcp` or `/udp`; the syntax is
/// the server's own (`netpol`), so what passes here passes there but for rule set names,
/// which only the server knows.
/// Errors: usage, naming the offending entry; an empty list or a rule given both with and
/// without `!` is one too.
pub fn net_rules(s: &str) -> Result<HashMap<String, bool>, CtlError> {
    rule_list("-net", s)
}

/// [`net_rules`] for rules given under another name (`what`, which starts the message):
/// `sandbox network`'s `RULES`.
pub fn rule_list(what: &str, s: &str) -> Result<HashMap<String, bool>, CtlError> {
    if s.split(',').any(|e| e.trim().is_empty()) {
        return Err(invalid(format!(
            "{what}: bad rule \"\": empty rule in {}",
            shown(s)
        )));
    }
    crate::netpol::parse_rule_list(s)
        .map(|m| m.into_iter().collect())
        .map_err(|e| invalid(format!("{what}: {e}")))
}

/// Parses `-quota k=v,...` (docs/concepts.md): keys `sandboxes`, `cpu_cores`, `memory_mb`, `gpus`;
/// values non-negative, whole numbers except `cpu_cores`.
/// Errors: `invalid` naming an unknown key, a repeated key or a bad value.
pub fn quota(s: &str) -> Result<HashMap<String, f64>, CtlError> {
    let mut out = HashMap::new();
    for pair in s.split(',') {
        let (k, v) = pair
            .split_once('=')
            .ok_or_else(|| invalid(format!("-quota: {} is not key=value", shown(pair))))?;
        if !names::QUOTA_KEYS.contains(&k) {
            return Err(invalid(format!(
                "-quota: unknown key {k:?}; known: {}",
                names::QUOTA_KEYS.join(", ")
            )));
        }
        let n: f64 = v
            .trim()
            .parse()
            .map_err(|_| invalid(format!("-quota: {k}={} is not a number", shown(v))))?;
        if !n.is_finite() || n < 0.0 {
            return Err(invalid(format!("-quota: {k}={v} must be zero or more")));
        }
        if k != "cpu_cores" && n.fract() != 0.0 {
            return Err(invalid(format!("-quota: {k}={v} must be a whole number")));
        }
        if out.insert(k.to_string(), n).is_some() {
            return Err(invalid(format!(
                "-quota: key {k:?} is given more than once"
            )));
        }
    }
    Ok(out)
}

/// Parses a comma separated permission list (docs/concepts.md), dropping repeats, keeping order.
/// Errors: a usage error for an empty list entry or an unknown permission.
pub fn permissions(s: &str) -> Result<Vec<String>, CtlError> {
    let mut out: Vec<String> = Vec::new();
    for p in s.split(',') {
        if p.is_empty() {
            return Err(invalid(format!("empty permission in {}", shown(s))));
        }
        names::check_permission(p).map_err(|f| invalid(f.message))?;
        if !out.iter().any(|x| x == p) {
            out.push(p.to_string());
        }
    }
    Ok(out)
}

/// Checks a `YYYY-MM-DD` date (usage `-from`/`-to`).
/// Errors: `invalid` naming the option and the value.
pub fn date(name: &str, s: &str) -> Result<(), CtlError> {
    let bad = || invalid(format!("-{name}: {} is not a date YYYY-MM-DD", shown(s)));
    let b = s.as_bytes();
    if b.len() != 10 || b.get(4) != Some(&b'-') || b.get(7) != Some(&b'-') {
        return Err(bad());
    }
    let num = |r: std::ops::Range<usize>| -> Result<u32, CtlError> {
        let part = &s[r];
        if !part.bytes().all(|c| c.is_ascii_digit()) {
            return Err(bad());
        }
        part.parse().map_err(|_| bad())
    };
    let (y, m, d) = (num(0..4)?, num(5..7)?, num(8..10)?);
    chrono::NaiveDate::from_ymd_opt(y as i32, m, d)
        .map(|_| ())
        .ok_or_else(bad)
}

/// Checks a sandbox id as given on the command line: not empty, no spaces or control chars.
/// Errors: `invalid`.
pub fn sandbox_id(s: &str) -> Result<(), CtlError> {
    if s.is_empty() || s.len() > 256 || s.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(invalid(format!("bad sandbox id {}", shown(s))));
    }
    Ok(())
}

/// Checks a plain name (task, session, token id): 1 to 256 characters, no control chars.
/// Errors: `invalid` naming `what`.
pub fn plain(what: &str, s: &str) -> Result<(), CtlError> {
    if s.is_empty() || s.len() > 256 || s.chars().any(|c| c.is_control()) {
        return Err(invalid(format!("bad {what} {}", shown(s))));
    }
    Ok(())
}

/// Checks `value` is one of `allowed` for option `name`.
/// Errors: `invalid` listing the allowed values.
pub fn one_of(name: &str, value: &str, allowed: &[&str]) -> Result<(), CtlError> {
    if allowed.contains(&value) {
        Ok(())
    } else {
        Err(invalid(format!(
            "-{name}: {value:?} is not one of {}",
            allowed.join(", ")
        )))
    }
}

/// A value that does not parse: a usage error (exit 2, docs/cli.md "Exit codes").
fn invalid(message: String) -> CtlError {
    CtlError::usage(message)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_go_style_and_plain_seconds() {
        assert_eq!(duration("d", "30s").unwrap(), Duration::from_secs(30));
        assert_eq!(duration("d", "5m").unwrap(), Duration::from_secs(300));
        assert_eq!(duration("d", "1h").unwrap(), Duration::from_secs(3600));
        assert_eq!(duration("d", "1h30m").unwrap(), Duration::from_secs(5400));
        assert_eq!(duration("d", "1.5h").unwrap(), Duration::from_secs(5400));
        assert_eq!(duration("d", "250ms").unwrap(), Duration::from_millis(250));
        assert_eq!(duration("d", "45").unwrap(), Duration::from_secs(45));
        assert_eq!(duration("d", "2.5").unwrap(), Duration::from_millis(2500));
        assert_eq!(duration("d", "0").unwrap(), Duration::ZERO);
        for bad in [
            "", "5x", "m", "-5s", "-3", "1h-", "s5", "1..2s", "inf", "NaN",
        ] {
            let e = duration("deadline", bad).unwrap_err();
            assert!(e.is_usage(), "{bad}");
            assert!(e.message().contains("-deadline"), "{}", e.message());
        }
    }

    #[test]
    fn net_rules_parse_with_negation() {
        let r = net_rules("pypi,github.com:443,!npm").unwrap();
        assert_eq!(r.len(), 3);
        assert!(r["pypi"]);
        assert!(r["github.com:443"]);
        assert!(!r["npm"]);
        let r = net_rules("!*").unwrap();
        assert!(!r["*"]);
        for ok in [
            "*:443",
            "10.0.0.0/8:5432/tcp",
            "example.com:8000-8080",
            "1.1.1.1:53/udp",
            "*.github.com",
            "203.0.113.7",
        ] {
            assert!(net_rules(ok).is_ok(), "{ok}");
        }
    }

    #[test]
    fn net_rules_reject_bad_syntax() {
        for bad in [
            "",
            "pypi,",
            ",pypi",
            "!",
            "a b",
            "1.2.3.256",
            "10.0.0.0/33",
            "x:0",
            "x:65536",
            "x:80/icmp",
            "x:90-80",
            "-bad.com",
            "pypi,!pypi",
            "x:",
            ":80",
            "a..b",
            "x:80/tcp/udp",
            "ex%ample.com",
        ] {
            let e = net_rules(bad).unwrap_err();
            assert!(e.is_usage(), "{bad}");
            assert!(e.message().starts_with("-net:"), "{}", e.message());
        }
    }

    #[test]
    fn quota_pairs() {
        let q = quota("sandboxes=1000,cpu_cores=4000.5,memory_mb=4096000,gpus=0").unwrap();
        assert_eq!(q["sandboxes"], 1000.0);
        assert_eq!(q["cpu_cores"], 4000.5);
        assert_eq!(q["memory_mb"], 4096000.0);
        assert_eq!(q["gpus"], 0.0);
        let e = quota("disk=5").unwrap_err();
        assert!(
            e.message().contains("unknown key \"disk\""),
            "{}",
            e.message()
        );
        for bad in [
            "sandboxes",
            "sandboxes=",
            "sandboxes=-1",
            "sandboxes=1.5",
            "cpu_cores=x",
            "gpus=1,gpus=2",
            "",
            "cpu_cores=inf",
        ] {
            assert!(quota(bad).unwrap_err().is_usage(), "{bad}");
        }
    }

    #[test]
    fn numbers_and_permissions() {
        assert_eq!(int("mem", "1024", 1, i64::MAX).unwrap(), 1024);
        assert!(int("mem", "10x", 1, 100)
            .unwrap_err()
            .message()
            .contains("-mem"));
        assert!(int("count", "0", 1, 32768).is_err());
        assert!(int("count", "32769", 1, 32768).is_err());
        assert_eq!(number_above("cpu", "0.5", 0.0).unwrap(), 0.5);
        assert!(number_above("cpu", "0", 0.0).is_err());
        assert!(number_above("cpu", "nan", 0.0).is_err());
        assert_eq!(
            permissions("sandbox.create,sandbox.operate,sandbox.create").unwrap(),
            vec!["sandbox.create", "sandbox.operate"]
        );
        assert!(permissions("sandbox.create,,layer.use").is_err());
        assert!(permissions("sandbox.fly").is_err());
    }

    #[test]
    fn dates() {
        assert!(date("from", "2026-10-01").is_ok());
        assert!(date("from", "2024-02-29").is_ok());
        for bad in [
            "2026-13-01",
            "2026-02-30",
            "2026-1-01",
            "20261001",
            "2026-10-0x",
            "+026-10-01",
        ] {
            assert!(date("from", bad).is_err(), "{bad}");
        }
    }
}
