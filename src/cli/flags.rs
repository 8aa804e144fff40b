//! Go-style flags: the spec's commands take `-flag value` with one dash. argh wants two, so
//! single-dash long flags are rewritten before parsing.

/// Rewrites `-name` and `-name=value` to `--name`/`--name=value` and `-h` to `--help`, leaving
/// other one-letter flags,
/// `--name`, `-` and everything after `--` as they are. Negative numbers stay values.
pub fn normalize(args: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut rest = false;
    for a in args {
        if rest {
            out.push(a.clone());
            continue;
        }
        if a == "--" {
            rest = true;
            out.push(a.clone());
            continue;
        }
        if a == "-h" {
            out.push("--help".to_string());
            continue;
        }
        let b = a.as_bytes();
        let is_long_single = b.len() > 2 && b[0] == b'-' && b[1] != b'-' && !b[1].is_ascii_digit() && b[1] != b'.';
        if is_long_single {
            out.push(format!("-{a}"));
        } else {
            out.push(a.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn single_dash_becomes_double() {
        assert_eq!(normalize(&s(&["-addr", "x", "-h", "--log", "-5", "--", "-la"])), s(&["--addr", "x", "--help", "--log", "-5", "--", "-la"]));
    }
}
