//! `opendsec ctl` (also installed as `opendsecctl`): the CLI of docs/cli.md.
//!
//! Flow: single-dash options are normalized (`cli::flags`), the connection options are taken
//! out wherever they are (`conn`), argh parses the command (one file per command group), and
//! the command runs on a small tokio runtime under the `-deadline`. Output is protobuf JSON
//! (`output`); failures print `error: <reason>: <message>` and exit 1, usage errors exit 2.

use std::process::ExitCode;
use std::time::Instant;

use argh::FromArgs;

use crate::types::{Failure, Reason};

mod admin;
mod argv;
mod conn;
mod cp;
mod exec;
mod image;
mod output;
mod pki;
mod port;
mod principal;
mod progress;
mod project;
mod sandbox;
mod task;
mod token;
mod usage;
mod values;

pub use output::single_dash;

/// Why a command did not succeed; each kind has its exit code.
#[derive(Debug, thiserror::Error)]
pub enum CtlError {
    /// Bad command line syntax (argh's message); exit 2.
    #[error("{0}")]
    Usage(String),
    /// A failure with a reason, from the server or from checking input; exit 1.
    #[error(transparent)]
    Failed(#[from] Failure),
    /// Exit with this code, having printed what there was (exec's exit code, a closed pipe).
    #[error("exit status {0}")]
    Exit(u8),
}

impl CtlError {
    /// A bad value or a missing argument on the command line (exit 2).
    pub fn usage(message: impl Into<String>) -> CtlError {
        CtlError::Usage(message.into())
    }

    /// Whether this is a usage error (exit 2).
    pub fn is_usage(&self) -> bool {
        matches!(self, CtlError::Usage(_))
    }

    /// The message, as printed after `error: <reason>: `.
    pub fn message(&self) -> String {
        match self {
            CtlError::Failed(f) => f.message.clone(),
            e => e.to_string(),
        }
    }
}

/// What every command gets: the resolved settings and when the command started.
pub struct Ctx {
    pub settings: conn::Settings,
    pub started: Instant,
}

impl Ctx {
    /// Clients for the configured apiservers. Errors: see `conn::Settings::connect`.
    pub fn connect(&self) -> Result<conn::Conn, Failure> {
        self.settings.connect(self.started)
    }
}

#[derive(FromArgs, Debug)]
/// opendsecctl: create and operate sandboxes, manage projects, principals and tokens, and
/// inspect the cluster. Output is JSON unless noted; failures print "error: <reason>:
/// <message>" and exit 1.
#[argh(
    help_triggers("-h", "--help", "help"),
    note = "The connection options may come before or after a command's own arguments.\n`cluster up` and `bench` run an in-process cluster and a scheduling benchmark.\nRun `opendsecctl <command> help` for a command's options."
)]
struct Ctl {
    /// apiserver address host:port; several, comma separated, are tried in turn (env
    /// OPENDSEC_ADDR)
    #[argh(option)]
    addr: Option<String>,
    /// token (env OPENDSEC_TOKEN; prefer the variable, it stays out of shell history)
    #[argh(option)]
    token: Option<String>,
    /// default project (env OPENDSEC_PROJECT; default root)
    #[argh(option)]
    project: Option<String>,
    /// cluster CA certificate; set, TLS is used (env OPENDSEC_CA)
    #[argh(option)]
    ca: Option<String>,
    /// time limit for the whole command, e.g. 30s, 5m, 1h or seconds; 0 for none (default 5m)
    #[argh(option)]
    deadline: Option<String>,
    #[argh(subcommand)]
    cmd: Cmd,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
enum Cmd {
    Sandbox(sandbox::SandboxArgs),
    Exec(exec::ExecArgs),
    Cp(cp::CpArgs),
    Task(task::TaskArgs),
    Project(project::ProjectArgs),
    Principal(principal::PrincipalArgs),
    Grant(principal::GrantArgs),
    Revoke(principal::RevokeArgs),
    Token(token::TokenArgs),
    Whoami(token::WhoamiArgs),
    Usage(usage::UsageArgs),
    Image(image::ImageArgs),
    Status(admin::StatusArgs),
    Edge(admin::EdgeArgs),
    Iam(admin::IamArgs),
    Version(admin::VersionArgs),
}

/// Runs `opendsec ctl <args...>` (`args` without the program name); returns the exit code:
/// 0 on success, 1 on a failure, 2 on a usage error, or exec's command's own code.
pub fn main(args: Vec<String>) -> ExitCode {
    match args.first().map(String::as_str) {
        // cluster up and bench live in src/roles/cluster/ (their own flags, connection
        // options included); they get the whole ctl argument list, starting with the name.
        Some("cluster") | Some("bench") => crate::roles::cluster::ctl_main(args),
        // Offline: files in, files out, no connection options.
        Some("pki") => pki::main(&args),
        _ => match run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => report(e),
        },
    }
}

/// Prints an error in the CLI's one format and picks the exit code.
fn report(e: CtlError) -> ExitCode {
    match e {
        CtlError::Usage(msg) => {
            let one_line: Vec<&str> = msg
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect();
            eprintln!(
                "error: invalid: {}",
                output::single_dash(&one_line.join(" "))
            );
            eprintln!("Run 'opendsecctl help' or 'opendsecctl <command> help' for usage.");
            ExitCode::from(2)
        }
        CtlError::Failed(f) => {
            eprintln!("error: {}: {}", f.reason, f.message);
            ExitCode::from(1)
        }
        CtlError::Exit(code) => ExitCode::from(code),
    }
}

/// A parsed command line.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)] // parsed once per process
enum Parsed {
    /// Help was asked for: this text goes to stdout.
    Help(String),
    Run(conn::ConnFlags, Cmd),
}

/// Parses the command line (without the program name).
/// Errors: `Usage` with argh's message.
fn parse(args: &[String]) -> Result<Parsed, CtlError> {
    // Connection options may come before the command name.
    let lead = argv::leading_options(args);
    let (lead_args, cmd_args) = args.split_at_checked(lead).unwrap_or((args, &[]));
    let mut normalized = crate::cli::flags::normalize(lead_args);
    match cmd_args.first().map(String::as_str) {
        // exec's command words stay exactly as typed (see argv::exec).
        Some("exec") if matches!(cmd_args, [_, h] if h == "help") => {
            normalized.extend(["exec".into(), "--help".into()])
        }
        Some("exec") => normalized.extend(argv::exec(cmd_args)),
        _ => normalized.extend(crate::cli::flags::normalize(cmd_args)),
    }
    let (flags, mut rest) = conn::split_flags(&normalized)?;
    if rest.is_empty() {
        return Err(CtlError::Usage("no command given".into()));
    }
    if rest.first().is_some_and(|c| c == "cp") {
        rest = argv::cp(&rest);
    }
    let strs: Vec<&str> = rest.iter().map(String::as_str).collect();
    match Ctl::from_args(&["opendsecctl"], &strs) {
        Ok(ctl) => {
            // split_flags took these out already; argh declares them for the help text.
            let flags = conn::ConnFlags {
                addr: flags.addr.or(ctl.addr),
                token: flags.token.or(ctl.token),
                project: flags.project.or(ctl.project),
                ca: flags.ca.or(ctl.ca),
                deadline: flags.deadline.or(ctl.deadline),
            };
            Ok(Parsed::Run(flags, ctl.cmd))
        }
        Err(early) => match early.status {
            Ok(()) => Ok(Parsed::Help(output::single_dash(&early.output))),
            Err(()) => Err(CtlError::Usage(early.output)),
        },
    }
}

fn run(args: &[String]) -> Result<(), CtlError> {
    let (flags, cmd) = match parse(args)? {
        Parsed::Help(text) => return output::out(text.as_bytes()),
        Parsed::Run(flags, cmd) => (flags, cmd),
    };
    let mut settings = conn::Settings::resolve(&flags, |k| std::env::var(k).ok())?;
    if let Cmd::Exec(e) = &cmd {
        settings.deadline = e.deadline(&settings)?;
    }
    if matches!(&cmd, Cmd::Image(i) if i.unbounded()) && !settings.deadline_given {
        settings.deadline = None;
    }
    let limit = settings.deadline;
    let ctx = Ctx {
        settings,
        started: Instant::now(),
    };
    under_deadline(limit, dispatch(cmd, &ctx))
}

/// Runs `fut` on a small runtime of its own, failing with `timeout` once `limit` passes.
/// The runtime is shut down without waiting: dropping it would wait for blocking work still
/// running (an import's layer writes, which no future can cancel), so a deadline would only
/// fire once the whole import had ended. What such work leaves in the store is `image gc`'s.
/// Errors: `internal` when the runtime cannot start, `timeout`, and `fut`'s own.
fn under_deadline<F>(limit: Option<std::time::Duration>, fut: F) -> Result<(), CtlError>
where
    F: std::future::Future<Output = Result<(), CtlError>>,
{
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| {
            Failure::internal(format!(
                "starting the async runtime: {e}",
                e = crate::types::chain(&e)
            ))
        })?;
    let r = rt.block_on(async move {
        match limit {
            None => fut.await,
            Some(d) => match tokio::time::timeout(d, fut).await {
                Ok(r) => r,
                Err(_) => Err(Failure::new(
                    Reason::Timeout,
                    format!(
                        "the command ran past its -deadline of {}",
                        output::go_duration(d)
                    ),
                )
                .into()),
            },
        }
    });
    rt.shutdown_background();
    r
}

async fn dispatch(cmd: Cmd, ctx: &Ctx) -> Result<(), CtlError> {
    match cmd {
        Cmd::Sandbox(a) => a.run(ctx).await,
        Cmd::Exec(a) => a.run(ctx).await,
        Cmd::Cp(a) => a.run(ctx).await,
        Cmd::Task(a) => a.run(ctx).await,
        Cmd::Project(a) => a.run(ctx).await,
        Cmd::Principal(a) => a.run(ctx).await,
        Cmd::Grant(a) => a.run(ctx).await,
        Cmd::Revoke(a) => a.run(ctx).await,
        Cmd::Token(a) => a.run(ctx).await,
        Cmd::Whoami(a) => a.run(ctx).await,
        Cmd::Usage(a) => a.run(ctx).await,
        Cmd::Image(a) => a.run(ctx).await,
        Cmd::Status(a) => a.run(ctx).await,
        Cmd::Edge(a) => a.run(ctx).await,
        Cmd::Iam(a) => a.run(ctx).await,
        Cmd::Version(a) => a.run(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(v: &[&str]) -> Vec<String> {
        v.iter().map(|x| x.to_string()).collect()
    }

    fn parsed(v: &[&str]) -> (conn::ConnFlags, Cmd) {
        match parse(&s(v)) {
            Ok(Parsed::Run(f, c)) => (f, c),
            Ok(Parsed::Help(_)) => panic!("help for {v:?}"),
            Err(e) => panic!("{v:?}: {e}"),
        }
    }

    #[test]
    fn single_dash_options_after_positionals() {
        let (flags, cmd) = parsed(&["sandbox", "stop", "node-a.1", "-addr", "x:1"]);
        assert_eq!(flags.addr.as_deref(), Some("x:1"));
        let Cmd::Sandbox(sandbox::SandboxArgs {
            cmd: sandbox::SandboxCmd::Stop(a),
        }) = cmd
        else {
            panic!("{cmd:?}")
        };
        assert_eq!(a.id, "node-a.1");
        // The same with the option first.
        let (flags, _) = parsed(&["-addr", "x:1", "sandbox", "stop", "node-a.1"]);
        assert_eq!(flags.addr.as_deref(), Some("x:1"));
    }

    #[test]
    fn create_options_in_any_order_with_negative_values() {
        let (_, cmd) = parsed(&[
            "sandbox",
            "create",
            "-count",
            "3",
            "-backend",
            "microvm",
            "-ttl-idle",
            "-1",
            "-net",
            "pypi,!npm",
        ]);
        let Cmd::Sandbox(sandbox::SandboxArgs {
            cmd: sandbox::SandboxCmd::Create(c),
        }) = cmd
        else {
            panic!()
        };
        assert_eq!(c.backend, "microvm");
        assert_eq!(c.count.as_deref(), Some("3"));
        assert_eq!(c.ttl_idle.as_deref(), Some("-1"));
        assert_eq!(c.net.as_deref(), Some("pypi,!npm"));
    }

    #[test]
    fn exec_command_words_and_double_dash() {
        let (_, cmd) = parsed(&[
            "exec", "ID", "-session", "s1", "--", "ls", "-la", "-addr", "help",
        ]);
        let Cmd::Exec(e) = cmd else { panic!() };
        assert_eq!(e.id, "ID");
        assert_eq!(e.session.as_deref(), Some("s1"));
        assert_eq!(e.cmd, s(&["ls", "-la", "-addr", "help"]));
        // Options after the command words are still the CLI's own (before any --).
        let (flags, cmd) = parsed(&[
            "-token", "t", "exec", "ID", "echo", "hi", "-timeout", "5", "-addr", "a:1", "-la",
        ]);
        assert_eq!(flags.token.as_deref(), Some("t"));
        let Cmd::Exec(e) = cmd else { panic!() };
        assert_eq!(e.cmd, s(&["echo", "hi", "-la"]));
        assert_eq!(e.timeout.as_deref(), Some("5"));
        assert_eq!(flags.addr.as_deref(), Some("a:1"));
        // The spec's example needs no --: unknown dash words belong to the command.
        let (_, cmd) = parsed(&["exec", "ID", "python3", "-c", "print(6*7)"]);
        let Cmd::Exec(e) = cmd else { panic!() };
        assert_eq!(e.cmd, s(&["python3", "-c", "print(6*7)"]));
    }

    #[test]
    fn the_deadline_does_not_wait_for_blocking_work() {
        let started = Instant::now();
        let r = under_deadline(Some(std::time::Duration::from_millis(200)), async {
            // Blocking work no future can cancel, as an import's layer writes are.
            let _ = tokio::task::spawn_blocking(|| {
                std::thread::sleep(std::time::Duration::from_secs(10))
            })
            .await;
            Ok(())
        });
        let took = started.elapsed();
        match r {
            Err(CtlError::Failed(f)) => assert_eq!(f.reason, Reason::Timeout, "{f:?}"),
            other => panic!("{other:?}"),
        }
        // Generous: the point is not waiting out the 10 s sleep.
        assert!(took < std::time::Duration::from_secs(5), "took {took:?}");
    }

    #[test]
    fn cp_takes_dash_for_stdio() {
        let (_, cmd) = parsed(&["cp", "-", "ID:/x", "-addr", "a:1"]);
        let Cmd::Cp(c) = cmd else { panic!() };
        assert_eq!((c.src.as_str(), c.dst.as_str()), ("-", "ID:/x"));
    }

    #[test]
    fn help_everywhere_and_usage_errors() {
        for v in [
            &["help"][..],
            &["-h"],
            &["--help"],
            &["sandbox", "help"],
            &["sandbox", "create", "-h"],
            &["exec", "help"],
            &["exec", "-help"],
            &["exec", "ID", "-h"],
            &["cp", "help"],
            &["cp", "-h"],
            &["iam", "backup", "help"],
            &["token", "create", "--help"],
            &["usage", "help"],
        ] {
            let Ok(Parsed::Help(text)) = parse(&s(v)) else {
                panic!("{v:?}")
            };
            assert!(text.starts_with("Usage: opendsecctl"), "{text}");
            assert!(!text.contains(" --h"), "{text}");
        }
        assert!(matches!(
            parse(&s(&["sandbox", "fly"])),
            Err(CtlError::Usage(_))
        ));
        assert!(matches!(parse(&s(&[])), Err(CtlError::Usage(_))));
        assert!(
            matches!(parse(&s(&["iam", "backup"])), Err(CtlError::Usage(m)) if m.contains("out"))
        );
    }
}
