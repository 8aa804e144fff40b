//! `sandbox create|get|stop|pause|resume|touch|list|timeout|network|fork` (docs/cli.md).

use std::collections::BTreeMap;
use std::time::Instant;

use argh::FromArgs;

use super::conn::Conn;
use super::{output, values, CtlError, Ctx};
use crate::pb;
use crate::types::{Failure, Reason};

/// Most sandboxes one batch may create (docs/python-sdk.md `run_sandboxes`).
const MAX_COUNT: i64 = 32768;

/// How many times a broken batch stream is started again (same idempotency key, so only
/// what is still missing gets created).
const BATCH_RESUMES: usize = 5;

#[derive(FromArgs, Debug)]
/// create and operate sandboxes
#[argh(subcommand, name = "sandbox", help_triggers("-h", "--help", "help"))]
pub struct SandboxArgs {
    #[argh(subcommand)]
    pub cmd: SandboxCmd,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
#[allow(clippy::large_enum_variant)] // parsed once per process
pub enum SandboxCmd {
    Create(CreateArgs),
    Get(GetArgs),
    Stop(StopArgs),
    Pause(PauseArgs),
    Resume(ResumeArgs),
    Touch(TouchArgs),
    List(ListArgs),
    Timeout(TimeoutArgs),
    Network(NetworkArgs),
    PortForward(super::port::PortForwardArgs),
    Fork(ForkArgs),
}

#[derive(FromArgs, Debug)]
/// create a sandbox, or -count of them. With -count 1 the sandbox's JSON is printed; with
/// more, one line per sandbox in index order ("<index> <id>" or "<index> error <reason>:
/// <message>", tab separated) and a summary; the exit code is then 1 if any failed.
#[argh(
    subcommand,
    name = "create",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} -backend container -image host -cpu 0.5 -mem 512"
)]
pub struct CreateArgs {
    /// container, microvm or sim (default sim, which only simulates: always set it); fncall
    /// and fullvm are not built yet
    #[argh(option, default = "String::from(\"sim\")")]
    pub backend: String,
    /// image, one the edges offer, e.g. host (the development image of `cluster up`)
    #[argh(option)]
    pub image: Option<String>,
    /// CPU cores, fractions allowed (default 1)
    #[argh(option)]
    pub cpu: Option<String>,
    /// memory in MB (default 1024)
    #[argh(option)]
    pub mem: Option<String>,
    /// writable disk in MB; 0 for the backend's default (default 0)
    #[argh(option)]
    pub disk: Option<String>,
    /// GPUs (default 0; GPU sandboxes are not built yet, so only 0 is accepted)
    #[argh(option)]
    pub gpus: Option<String>,
    /// task name, for task actions
    #[argh(option)]
    pub task: Option<String>,
    /// idle timeout in seconds; 0 for the cluster default, -1 for none (default 0)
    #[argh(option)]
    pub ttl_idle: Option<String>,
    /// lifetime in seconds; 0 for the cluster default (default 0)
    #[argh(option)]
    pub ttl_max: Option<String>,
    /// network rules, comma separated, e.g. pypi,github.com:443,192.0.2.0/24; !rule takes back
    /// a cluster default (docs/network.md); needs an edge with networking on
    #[argh(option)]
    pub net: Option<String>,
    /// number of sandboxes, 1 to 32768 (default 1)
    #[argh(option)]
    pub count: Option<String>,
}

/// `-gpus`: only 0 until GPU sandboxes exist, so a request for one is never silently
/// served without. Errors: `invalid` naming the missing feature.
fn gpus(n: i64) -> Result<i32, CtlError> {
    if n != 0 {
        return Err(super::CtlError::usage(format!(
            "-gpus {n}: GPU sandboxes are not built yet; leave -gpus at 0"
        )));
    }
    Ok(0)
}

/// `-net` (docs/network.md "Rules"): a comma-separated list, `!` before a rule taking it
/// back, checked here so a typo fails before anything is sent. Errors: `invalid` naming the
/// bad rule.
fn net(rules: Option<&str>) -> Result<std::collections::HashMap<String, bool>, CtlError> {
    match rules {
        Some(r) => values::net_rules(r),
        None => Ok(Default::default()),
    }
}

macro_rules! id_command {
    ($ty:ident, $name:tt, $doc:tt) => {
        #[derive(FromArgs, Debug)]
        #[doc = $doc]
        #[argh(subcommand, name = $name, help_triggers("-h", "--help", "help"))]
        pub struct $ty {
            /// sandbox id
            #[argh(positional)]
            pub id: String,
        }
    };
}

id_command!(GetArgs, "get", "print a sandbox");
id_command!(StopArgs, "stop", "stop a sandbox and print it");
id_command!(PauseArgs, "pause", "pause a sandbox and print it");
id_command!(ResumeArgs, "resume", "resume a sandbox and print it");
id_command!(
    TouchArgs,
    "touch",
    "reset a sandbox's idle timer (resumes a paused one) and print it"
);

#[derive(FromArgs, Debug)]
/// list the sandboxes of -project and its subprojects
#[argh(subcommand, name = "list", help_triggers("-h", "--help", "help"))]
pub struct ListArgs {
    /// only this task's sandboxes
    #[argh(option)]
    pub task: Option<String>,
    /// include recently ended sandboxes
    #[argh(switch)]
    pub all: bool,
}

#[derive(FromArgs, Debug)]
/// set a sandbox's remaining lifetime: it ends <seconds> from now
#[argh(subcommand, name = "timeout", help_triggers("-h", "--help", "help"))]
pub struct TimeoutArgs {
    /// sandbox id
    #[argh(positional)]
    pub id: String,
    /// seconds from now
    #[argh(positional)]
    pub seconds: String,
}

#[derive(FromArgs, Debug)]
/// change a running or paused sandbox's network rules and print it (docs/network.md): RULE
/// allows, !RULE takes back; merged into its current rules, or with -replace replacing them
/// (-replace alone takes every rule back). Taking an allowance back cuts its open connections.
#[argh(
    subcommand,
    name = "network",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} $ID pypi github.com:443",
    example = "{command_name} $ID '!github.com:443'",
    example = "{command_name} $ID '*' -replace"
)]
pub struct NetworkArgs {
    /// sandbox id
    #[argh(positional)]
    pub id: String,
    /// rules, e.g. pypi github.com:443 '!npm' (a comma also separates rules)
    #[argh(positional)]
    pub rules: Vec<String>,
    /// replace the sandbox's rules with these instead of merging them in
    #[argh(switch)]
    pub replace: bool,
}

impl NetworkArgs {
    /// The request these arguments ask for. Errors: usage, naming a bad rule; no rules
    /// without -replace (which would change nothing).
    fn request(&self) -> Result<pb::UpdateNetworkRequest, CtlError> {
        values::sandbox_id(&self.id)?;
        let rules = if self.rules.is_empty() {
            if !self.replace {
                return Err(CtlError::usage(
                    "RULES: give at least one rule (or -replace alone to take every rule back)",
                ));
            }
            Default::default()
        } else {
            values::rule_list("RULES", &self.rules.join(","))?
        };
        Ok(pb::UpdateNetworkRequest {
            id: self.id.clone(),
            rules,
            replace: self.replace,
        })
    }
}

#[derive(FromArgs, Debug)]
/// copy a running sandbox into -count sandboxes with its files (docs/images.md "Fork"); one
/// line per copy in index order ("<index> <id>" or "<index> error <reason>: <message>", tab
/// separated) and a summary, as for create -count; exit code 1 if any copy failed
#[argh(
    subcommand,
    name = "fork",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} $ID -count 8 -task search-17"
)]
pub struct ForkArgs {
    /// sandbox id
    #[argh(positional)]
    pub id: String,
    /// copies, 1 to 256 (default 1)
    #[argh(option)]
    pub count: Option<String>,
    /// the copies' task (default the source's)
    #[argh(option)]
    pub task: Option<String>,
    /// the copies' idle timeout in seconds; 0 for the cluster default (default 0)
    #[argh(option)]
    pub ttl_idle: Option<String>,
    /// the copies' lifetime in seconds; 0 for the cluster default (default 0)
    #[argh(option)]
    pub ttl_max: Option<String>,
    /// a label added to the copies', KEY=VALUE; repeatable
    #[argh(option)]
    pub label: Vec<String>,
}

impl ForkArgs {
    /// The request these options ask for. Errors: `invalid` naming the option.
    fn request(&self) -> Result<pb::ForkSandboxRequest, CtlError> {
        values::sandbox_id(&self.id)?;
        if let Some(t) = &self.task {
            values::plain("task", t)?;
        }
        let int = |name: &str, v: &Option<String>, default: i64, max: i64| {
            v.as_deref()
                .map(|s| values::int(name, s, if name == "count" { 1 } else { 0 }, max))
                .transpose()
                .map(|x| x.unwrap_or(default))
        };
        let mut labels = std::collections::HashMap::new();
        for l in &self.label {
            match l.split_once('=') {
                Some((k, v)) if !k.is_empty() => {
                    labels.insert(k.to_string(), v.to_string());
                }
                _ => return Err(CtlError::usage(format!("-label {l:?}: expected KEY=VALUE"))),
            }
        }
        Ok(pb::ForkSandboxRequest {
            id: self.id.clone(),
            count: int("count", &self.count, 1, MAX_FORK)? as u32,
            labels,
            task_id: self.task.clone().unwrap_or_default(),
            ttl_running_stop: int("ttl-idle", &self.ttl_idle, 0, i64::MAX)?,
            ttl_max: int("ttl-max", &self.ttl_max, 0, i64::MAX)?,
            idempotency_key: idempotency_key(),
        })
    }
}

/// Most copies one fork makes (docs/python-sdk.md `fork`).
const MAX_FORK: i64 = 256;

impl SandboxArgs {
    /// Runs the subcommand; prints the sandbox (or list) as JSON.
    /// Errors: invalid input before any call; the server's failure otherwise.
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        match self.cmd {
            SandboxCmd::Create(a) => a.run(ctx).await,
            SandboxCmd::Get(a) => lifecycle(ctx, &a.id, Op::Get).await,
            SandboxCmd::Stop(a) => lifecycle(ctx, &a.id, Op::Stop).await,
            SandboxCmd::Pause(a) => lifecycle(ctx, &a.id, Op::Pause).await,
            SandboxCmd::Resume(a) => lifecycle(ctx, &a.id, Op::Resume).await,
            SandboxCmd::Touch(a) => lifecycle(ctx, &a.id, Op::Touch).await,
            SandboxCmd::List(a) => {
                if let Some(t) = &a.task {
                    values::plain("task", t)?;
                }
                let conn = ctx.connect()?;
                let req = pb::ListSandboxesRequest {
                    project: conn.project.clone(),
                    task_id: a.task.unwrap_or_default(),
                    include_ended: a.all,
                };
                let resp = conn
                    .call(req, |mut c, r| async move { c.list_sandboxes(r).await })
                    .await?;
                if !resp.unreachable_edges.is_empty() {
                    eprintln!(
                        "warning: edges {} did not answer: their sandboxes are not listed",
                        resp.unreachable_edges.join(", ")
                    );
                }
                output::json(&list_json(&resp)?)
            }
            SandboxCmd::Timeout(a) => {
                values::sandbox_id(&a.id)?;
                let secs = values::int("seconds", &a.seconds, 0, i64::MAX)?;
                let conn = ctx.connect()?;
                let req = pb::SetSandboxTimeoutRequest {
                    id: a.id,
                    timeout_s: secs,
                };
                let sb = conn
                    .call(
                        req,
                        |mut c, r| async move { c.set_sandbox_timeout(r).await },
                    )
                    .await?;
                output::json(&sb)
            }
            SandboxCmd::Network(a) => {
                let req = a.request()?;
                let conn = ctx.connect()?;
                let sb = conn
                    .call(req, |mut c, r| async move { c.update_network(r).await })
                    .await?;
                output::json(&sb)
            }
            SandboxCmd::PortForward(a) => a.run(ctx).await,
            SandboxCmd::Fork(a) => {
                let req = a.request()?;
                let conn = ctx.connect()?;
                stream_batch(req.count, || {
                    conn.call(
                        req.clone(),
                        |mut c, r| async move { c.fork_sandbox(r).await },
                    )
                })
                .await
            }
        }
    }
}

#[derive(Clone, Copy)]
enum Op {
    Get,
    Stop,
    Pause,
    Resume,
    Touch,
}

async fn lifecycle(ctx: &Ctx, id: &str, op: Op) -> Result<(), CtlError> {
    values::sandbox_id(id)?;
    let conn = ctx.connect()?;
    let req = pb::SandboxRef { id: id.to_string() };
    let sb = conn
        .call(req, |mut c, r| async move {
            match op {
                Op::Get => c.get_sandbox(r).await,
                Op::Stop => c.stop_sandbox(r).await,
                Op::Pause => c.pause_sandbox(r).await,
                Op::Resume => c.resume_sandbox(r).await,
                Op::Touch => c.touch_sandbox(r).await,
            }
        })
        .await?;
    output::json(&sb)
}

impl CreateArgs {
    /// The spec and count these options ask for. Errors: `invalid` naming the option.
    pub fn spec(&self) -> Result<(pb::SandboxSpec, u32), CtlError> {
        values::one_of("backend", &self.backend, &values::BACKENDS)?;
        if self.backend != "sim" && self.image.is_none() {
            return Err(super::CtlError::usage(format!(
                "-image is required for backend {} (e.g. -image host, the development image of cluster up)",
                self.backend
            )));
        }
        if let Some(i) = &self.image {
            if i.is_empty() || i.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(super::CtlError::usage(format!(
                    "-image: bad image name {i:?}"
                )));
            }
        }
        if let Some(t) = &self.task {
            values::plain("task", t)?;
        }
        let cpu = match &self.cpu {
            Some(s) => values::number_above("cpu", s, 0.0)?,
            None => 1.0,
        };
        let opt_int = |name: &str,
                       v: &Option<String>,
                       default: i64,
                       min: i64,
                       max: i64|
         -> Result<i64, CtlError> {
            v.as_deref()
                .map(|s| values::int(name, s, min, max))
                .transpose()
                .map(|x| x.unwrap_or(default))
        };
        let spec = pb::SandboxSpec {
            backend: self.backend.clone(),
            image: self.image.clone().unwrap_or_default(),
            cpu_cores_limit: cpu,
            memory_limit_mb: opt_int("mem", &self.mem, 1024, 1, i64::MAX)?,
            disk_mb: opt_int("disk", &self.disk, 0, 0, i64::MAX)?,
            gpus: gpus(opt_int("gpus", &self.gpus, 0, 0, i32::MAX as i64)?)?,
            task_id: self.task.clone().unwrap_or_default(),
            ttl_running_stop: opt_int("ttl-idle", &self.ttl_idle, 0, -1, i64::MAX)?,
            ttl_max: opt_int("ttl-max", &self.ttl_max, 0, 0, i64::MAX)?,
            network_rules: net(self.net.as_deref())?,
            ..Default::default()
        };
        let count = opt_int("count", &self.count, 1, 1, MAX_COUNT)? as u32;
        Ok((spec, count))
    }

    async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        let (spec, count) = self.spec()?;
        let conn = ctx.connect()?;
        let key = idempotency_key();
        if count == 1 {
            let req = pb::CreateSandboxRequest {
                spec: Some(spec),
                project: conn.project.clone(),
                idempotency_key: key,
            };
            let sb = conn
                .call(req, |mut c, r| async move { c.create_sandbox(r).await })
                .await?;
            return output::json(&sb);
        }
        let req = pb::CreateSandboxesRequest {
            spec: Some(spec),
            project: conn.project.clone(),
            count,
            idempotency_key: key,
        };
        create_batch(&conn, req).await
    }
}

/// A random idempotency key, so that a retry on another apiserver creates nothing twice.
fn idempotency_key() -> String {
    format!("ctl-{:032x}", rand::random::<u128>())
}

/// Results of a batch, printed in index order as soon as each prefix is complete.
struct Batch {
    results: Vec<Option<Result<String, pb::ErrorDetail>>>,
    printed: usize,
}

impl Batch {
    fn new(count: u32) -> Batch {
        Batch {
            results: vec![None; count as usize],
            printed: 0,
        }
    }

    /// Records one item (unknown indexes and repeats are ignored); returns the lines now
    /// ready to print.
    fn record(&mut self, item: pb::CreateSandboxesItem) -> String {
        let i = item.index as usize;
        let Some(slot @ None) = self.results.get_mut(i) else {
            return String::new();
        };
        let r = match (item.sandbox, item.error) {
            (Some(sb), None) => Ok(sb.id),
            (_, Some(e)) => Err(e),
            (None, None) => Err(pb::ErrorDetail {
                reason: Reason::Internal.as_str().into(),
                message: "empty result".into(),
            }),
        };
        *slot = Some(r);
        self.flush()
    }

    /// Gives every item still missing the failure `f`; returns the lines now ready.
    fn fail_missing(&mut self, f: &Failure) -> String {
        for r in self.results.iter_mut().filter(|r| r.is_none()) {
            *r = Some(Err(crate::rpc::status::error_detail(f)));
        }
        self.flush()
    }

    fn complete(&self) -> bool {
        self.results.iter().all(Option::is_some)
    }

    fn received(&self) -> usize {
        self.results.iter().filter(|r| r.is_some()).count()
    }

    fn flush(&mut self) -> String {
        let mut text = String::new();
        while let Some(Some(r)) = self.results.get(self.printed) {
            text.push_str(&output::batch_line(self.printed as u32, r));
            text.push('\n');
            self.printed += 1;
        }
        text
    }

    /// Successes, and failures counted by reason.
    fn tally(&self) -> (usize, BTreeMap<String, usize>) {
        let mut ok = 0;
        let mut failures = BTreeMap::new();
        for r in self.results.iter().flatten() {
            match r {
                Ok(_) => ok += 1,
                Err(e) => *failures.entry(e.reason.clone()).or_insert(0) += 1,
            }
        }
        (ok, failures)
    }
}

/// `CreateSandboxes`: see [`stream_batch`].
async fn create_batch(conn: &Conn, req: pb::CreateSandboxesRequest) -> Result<(), CtlError> {
    stream_batch(req.count, || {
        conn.call(req.clone(), |mut c, r| async move {
            c.create_sandboxes(r).await
        })
    })
    .await
}

/// A streamed creation (`CreateSandboxes`, `ForkSandbox`) of `count` items, each call
/// started by `start`: prints the items in index order, then the summary. A stream that
/// breaks with `unavailable` is started again (the same request, so the same idempotency
/// key: only what is still missing gets created).
async fn stream_batch<F, Fut>(count: u32, start: F) -> Result<(), CtlError>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Streaming<pb::CreateSandboxesItem>, Failure>>,
{
    let started = Instant::now();
    let mut batch = Batch::new(count);
    let mut resumes = 0;
    loop {
        let broke = match start().await {
            // The request itself failed before any item: the whole command fails.
            Err(f) if batch.received() == 0 => return Err(f.into()),
            Err(f) => Some(f),
            Ok(mut stream) => loop {
                match stream.message().await {
                    Ok(Some(item)) => output::out(batch.record(item).as_bytes())?,
                    Ok(None) => break None,
                    Err(s) => break Some(crate::rpc::failure_from_status(&s)),
                }
            },
        };
        if batch.complete() {
            break;
        }
        match broke {
            Some(f) if f.reason == Reason::Unavailable && resumes < BATCH_RESUMES => {
                resumes += 1;
                tokio::time::sleep(std::time::Duration::from_millis(200 * resumes as u64)).await;
            }
            Some(f) if batch.received() == 0 => return Err(f.into()),
            Some(f) => {
                output::out(batch.fail_missing(&f).as_bytes())?;
                break;
            }
            None => {
                let f = Failure::internal("the server ended the batch without this item");
                output::out(batch.fail_missing(&f).as_bytes())?;
                break;
            }
        }
    }
    let (ok, failures) = batch.tally();
    output::out(
        format!(
            "{}\n",
            output::batch_summary(ok, count as usize, started.elapsed(), &failures)
        )
        .as_bytes(),
    )?;
    if ok == count as usize {
        Ok(())
    } else {
        Err(CtlError::Exit(1))
    }
}

/// The list as JSON, `sandboxes` always present: an empty list prints
/// `{"sandboxes": []}`, not `{}`.
fn list_json(resp: &pb::ListSandboxesResponse) -> Result<serde_json::Value, CtlError> {
    let mut v = serde_json::to_value(resp).map_err(|e| {
        Failure::internal(format!("encoding JSON: {e}", e = crate::types::chain(&e)))
    })?;
    if let Some(m) = v.as_object_mut() {
        m.entry("sandboxes")
            .or_insert_with(|| serde_json::Value::Array(Vec::new()));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(f: impl FnOnce(&mut CreateArgs)) -> CreateArgs {
        let mut a = CreateArgs {
            backend: "sim".into(),
            image: None,
            cpu: None,
            mem: None,
            disk: None,
            gpus: None,
            task: None,
            ttl_idle: None,
            ttl_max: None,
            net: None,
            count: None,
        };
        f(&mut a);
        a
    }

    #[test]
    fn spec_defaults_follow_the_spec() {
        let (s, n) = args(|_| {}).spec().unwrap();
        assert_eq!(n, 1);
        assert_eq!(s.backend, "sim");
        assert_eq!(s.cpu_cores_limit, 1.0);
        assert_eq!(s.memory_limit_mb, 1024);
        assert_eq!(
            (s.disk_mb, s.gpus, s.ttl_running_stop, s.ttl_max),
            (0, 0, 0, 0)
        );
        assert!(s.network_rules.is_empty());
    }

    #[test]
    fn spec_from_options() {
        let (s, n) = args(|a| {
            a.backend = "microvm".into();
            a.image = Some("root/py:3.12".into());
            a.cpu = Some("0.5".into());
            a.mem = Some("2048".into());
            a.ttl_idle = Some("-1".into());
            a.count = Some("3".into());
            a.task = Some("job-1".into());
        })
        .spec()
        .unwrap();
        assert_eq!(n, 3);
        assert_eq!(
            (s.backend.as_str(), s.image.as_str(), s.task_id.as_str()),
            ("microvm", "root/py:3.12", "job-1")
        );
        assert_eq!(
            (s.cpu_cores_limit, s.memory_limit_mb, s.ttl_running_stop),
            (0.5, 2048, -1)
        );
        assert!(s.network_rules.is_empty());
    }

    #[test]
    fn features_not_built_yet_are_refused_by_name() {
        let (s, _) = args(|a| a.net = Some("pypi,!npm".into())).spec().unwrap();
        assert_eq!(
            s.network_rules,
            [("pypi".to_string(), true), ("npm".to_string(), false)].into()
        );
        let e = args(|a| a.gpus = Some("1".into())).spec().unwrap_err();
        assert!(e.is_usage());
        assert!(
            e.message().contains("GPU sandboxes are not built yet"),
            "{}",
            e.message()
        );
        assert_eq!(
            args(|a| a.gpus = Some("0".into())).spec().unwrap().0.gpus,
            0
        );
    }

    #[test]
    fn bad_options_are_invalid() {
        type Change = Box<dyn Fn(&mut CreateArgs)>;
        let cases: Vec<(&str, Change)> = vec![
            ("-backend", Box::new(|a| a.backend = "docker".into())),
            ("-cpu", Box::new(|a| a.cpu = Some("two".into()))),
            ("-mem", Box::new(|a| a.mem = Some("0".into()))),
            ("-disk", Box::new(|a| a.disk = Some("-5".into()))),
            ("-gpus", Box::new(|a| a.gpus = Some("99999999999".into()))),
            ("-ttl-idle", Box::new(|a| a.ttl_idle = Some("-2".into()))),
            ("-ttl-max", Box::new(|a| a.ttl_max = Some("1h".into()))),
            ("-net", Box::new(|a| a.net = Some("pypi,,npm".into()))),
            ("-count", Box::new(|a| a.count = Some("32769".into()))),
            ("-image", Box::new(|a| a.image = Some("root/py 3".into()))),
        ];
        for (name, f) in cases {
            let e = args(|a| f(a)).spec().unwrap_err();
            assert!(e.is_usage());
            assert!(e.message().starts_with(name), "{name}: {}", e.message());
        }
    }

    #[test]
    fn batch_prints_in_index_order_and_tallies() {
        let mut b = Batch::new(3);
        let sb = |id: &str| {
            Some(pb::Sandbox {
                id: id.into(),
                ..Default::default()
            })
        };
        assert_eq!(
            b.record(pb::CreateSandboxesItem {
                index: 2,
                sandbox: sb("c"),
                error: None
            }),
            ""
        );
        assert_eq!(
            b.record(pb::CreateSandboxesItem {
                index: 0,
                sandbox: sb("a"),
                error: None
            }),
            "0\ta\n"
        );
        assert_eq!(
            b.record(pb::CreateSandboxesItem {
                index: 9,
                sandbox: sb("x"),
                error: None
            }),
            ""
        );
        assert_eq!(
            b.record(pb::CreateSandboxesItem {
                index: 0,
                sandbox: sb("dup"),
                error: None
            }),
            ""
        );
        assert!(!b.complete());
        assert_eq!(
            b.fail_missing(&Failure::new(Reason::NoCapacity, "full")),
            "1\terror\tno_capacity: full\n2\tc\n"
        );
        assert!(b.complete());
        assert_eq!(b.printed, 3);
        let (ok, f) = b.tally();
        assert_eq!(ok, 2);
        assert_eq!(f.get("no_capacity"), Some(&1));
        assert_eq!(b.results[0], Some(Ok("a".to_string())));
    }
}
