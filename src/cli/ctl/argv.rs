//! Shaping the argument list before argh sees it, for the two commands whose positional
//! arguments are free text: `exec` (a command line) and `cp` (where `-` is stdin/stdout).
//! argh takes every word starting with `-` as an option, so these words go after a `--`.

/// The connection options every command takes (normalized form); each takes a value.
const CONN_OPTIONS: [&str; 5] = ["--addr", "--token", "--project", "--ca", "--deadline"];

/// `exec`'s own options (normalized form); each takes a value.
const EXEC_OPTIONS: [&str; 3] = ["--session", "--user", "--timeout"];

fn takes_value(name: &str, also: &[&str]) -> bool {
    CONN_OPTIONS.contains(&name) || also.contains(&name)
}

/// How many of the first words are connection options (with their values) before the
/// command name, e.g. 2 for `-addr x exec ...`.
pub fn leading_options(args: &[String]) -> usize {
    let mut i = 0;
    while let Some(a) = args.get(i) {
        let n = crate::cli::flags::normalize(std::slice::from_ref(a))
            .pop()
            .unwrap_or_default();
        match n.split_once('=') {
            Some((k, _)) if takes_value(k, &[]) => i += 1,
            None if takes_value(&n, &[]) => i += 2,
            _ => break,
        }
    }
    i.min(args.len())
}

/// Reshapes original `exec ...` arguments (`args[0] == "exec"`) for argh: the CLI's own
/// options (`-session`, `-user`, `-timeout`, the connection options, `-h`/`-help`) are taken
/// from anywhere before a `--`, normalized; the first other word not starting with `-` is the
/// sandbox id; every other word, in order and exactly as typed (`-c`, `-la`, `-`), is the
/// command, placed after a `--`. So `exec $ID python3 -c 'print(6*7)'` needs no `--`; a
/// `--` is needed only for command words that look like the CLI's own options.
pub fn exec(args: &[String]) -> Vec<String> {
    let mut opts = vec!["exec".to_string()];
    let mut cmd = Vec::new();
    let mut id_seen = false;
    let mut ended = false;
    let mut it = args.iter().skip(1);
    while let Some(a) = it.next() {
        if ended {
            cmd.push(a.clone());
            continue;
        }
        if a == "--" {
            ended = true;
            continue;
        }
        let n = crate::cli::flags::normalize(std::slice::from_ref(a))
            .pop()
            .unwrap_or_default();
        let name = n.split_once('=').map(|(k, _)| k).unwrap_or(&n);
        if takes_value(name, &EXEC_OPTIONS) {
            opts.push(n.clone());
            if !n.contains('=') {
                if let Some(v) = it.next() {
                    opts.push(v.clone());
                }
            }
        } else if n == "-h" || n == "--help" {
            opts.push(n);
        } else if !id_seen && !a.starts_with('-') {
            id_seen = true;
            opts.push(a.clone());
        } else {
            cmd.push(a.clone());
        }
    }
    if !cmd.is_empty() {
        opts.push("--".into());
        opts.extend(cmd);
    }
    opts
}

/// Reshapes normalized `cp ...` arguments (`args[0] == "cp"`): words starting with `-` other
/// than a bare `-` stay options (help, or an error); the positional words, `-` included, go
/// after a `--` in their order. A lone `help` stays help.
pub fn cp(args: &[String]) -> Vec<String> {
    let mut opts = vec!["cp".to_string()];
    let mut pos = Vec::new();
    let mut ended = false;
    for a in args.iter().skip(1) {
        if ended {
            pos.push(a.clone());
        } else if a == "--" {
            ended = true;
        } else if a.starts_with('-') && a != "-" {
            opts.push(a.clone());
        } else {
            pos.push(a.clone());
        }
    }
    if matches!(pos.as_slice(), [p] if p == "help") {
        opts.push("help".into());
    } else if !pos.is_empty() {
        opts.push("--".into());
        opts.extend(pos);
    }
    opts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    #[test]
    fn exec_command_words_stay_as_typed() {
        assert_eq!(
            exec(&s(&["exec", "ID", "python3", "-c", "print(6*7)"])),
            s(&["exec", "ID", "--", "python3", "-c", "print(6*7)"])
        );
        assert_eq!(
            exec(&s(&["exec", "ID", "ls", "-la", "-"])),
            s(&["exec", "ID", "--", "ls", "-la", "-"])
        );
        // The CLI's options anywhere before --, normalized; after --, all command.
        assert_eq!(
            exec(&s(&[
                "exec",
                "-session",
                "s",
                "ID",
                "echo",
                "-timeout=5",
                "hi",
                "-addr",
                "a:1",
                "--",
                "-user",
                "x"
            ])),
            s(&[
                "exec",
                "--session",
                "s",
                "ID",
                "--timeout=5",
                "--addr",
                "a:1",
                "--",
                "echo",
                "hi",
                "-user",
                "x"
            ])
        );
        assert_eq!(exec(&s(&["exec", "-h"])), s(&["exec", "--help"]));
        assert_eq!(exec(&s(&["exec", "ID"])), s(&["exec", "ID"]));
    }

    #[test]
    fn leading_connection_options_are_counted() {
        assert_eq!(
            leading_options(&s(&["-addr", "x", "-token=t", "exec", "ID"])),
            3
        );
        assert_eq!(leading_options(&s(&["exec", "-addr", "x"])), 0);
        assert_eq!(leading_options(&s(&["-session", "s", "exec"])), 0);
        assert_eq!(leading_options(&s(&["-addr"])), 1);
    }

    #[test]
    fn cp_dash_is_a_positional() {
        assert_eq!(
            cp(&s(&["cp", "-", "id:/x"])),
            s(&["cp", "--", "-", "id:/x"])
        );
        assert_eq!(
            cp(&s(&["cp", "id:/x", "-", "--help"])),
            s(&["cp", "--help", "--", "id:/x", "-"])
        );
        assert_eq!(
            cp(&s(&["cp", "--", "--weird", "id:/x"])),
            s(&["cp", "--", "--weird", "id:/x"])
        );
        assert_eq!(cp(&s(&["cp", "help"])), s(&["cp", "help"]));
    }
}
