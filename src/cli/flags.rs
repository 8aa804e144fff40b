//! Go-style flags: the commands take `-flag value` with one dash. argh wants two, so
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
        let is_long_single = matches!(b, [b'-', c, _, ..]
            if *c != b'-' && !c.is_ascii_digit() && *c != b'.');
        if is_long_single {
            out.push(format!("-{a}"));
        } else {
            out.push(a.clone());
        }
    }
    out
}

/// Parses Go-style `args` into `T`; `Err(code)` after printing help (exit 0) or a usage
/// error (exit 2).
pub fn parse<T: argh::FromArgs>(
    command: &str,
    args: &[String],
) -> Result<T, std::process::ExitCode> {
    let args = normalize(args);
    let refs: Vec<&str> = args.iter().map(String::as_str).collect();
    T::from_args(&[command], &refs).map_err(|e| {
        if e.status.is_ok() {
            // argh writes `--flag`; the commands are documented and typed with one dash.
            println!("{}", crate::cli::ctl::single_dash(&e.output));
            std::process::ExitCode::SUCCESS
        } else {
            // A usage error reads as `opendsec ctl`'s do: `error: invalid: ...`.
            let out = crate::cli::ctl::single_dash(&e.output);
            let out = out.trim_start();
            if out.starts_with("error:") {
                eprintln!("{out}");
            } else {
                eprintln!("error: invalid: {out}");
            }
            std::process::ExitCode::from(2)
        }
    })
}

/// Runs `fut` on a new multi-threaded runtime; an error prints its whole cause chain as
/// `error: ...` and exits 1.
pub fn block_on<F: std::future::Future<Output = anyhow::Result<()>>>(
    fut: F,
) -> std::process::ExitCode {
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!(
                "error: internal: starting the runtime: {e}",
                e = crate::types::chain(&e)
            );
            return std::process::ExitCode::from(1);
        }
    };
    match rt.block_on(fut) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn single_dash_becomes_double() {
        assert_eq!(
            normalize(&s(&["-addr", "x", "-h", "--log", "-5", "--", "-la"])),
            s(&["--addr", "x", "--help", "--log", "-5", "--", "-la"])
        );
    }
}
