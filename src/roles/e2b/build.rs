//! Running a template build (docs/e2b.md "Template builds"): a container sandbox of the
//! caller's from the template's base, its steps run in it in order (RUN as a shell command,
//! COPY by unpacking the uploaded tar, ENV, WORKDIR and USER as the settings of the steps
//! after them and of the image), then its writable layer packed (`PackDiff`) into an image
//! per tag, carrying the template's environment, working directory, user, and its start
//! and ready commands as the labels `e2b.start_cmd` and `e2b.ready_cmd`. The sandbox is
//! stopped whatever happens. Every call is the caller's own, so its permissions and quota
//! apply.

use std::collections::HashMap;
use std::sync::Arc;

use super::templates::{Build, Level};
use super::{Caller, Gateway};
use crate::config::E2bTemplate;
use crate::pb;
use crate::types::names::shown;

/// The image label holding a built template's start command.
pub const START_LABEL: &str = "e2b.start_cmd";
/// The image label holding a built template's ready command.
pub const READY_LABEL: &str = "e2b.ready_cmd";
/// The label marking a build's sandbox, its value the build id.
const BUILD_LABEL: &str = "e2b.build";
/// The longest a build's sandbox lives, seconds.
const BUILD_LIFETIME_S: i64 = 3600;
/// Bytes per write of an uploaded file into the sandbox.
const CHUNK: usize = 8 << 20;
/// E2B's base image, which `Template().from_base_image()` names: the `base` template here.
const E2B_BASE_IMAGE: &str = "e2bdev/base";

/// What a template starts from.
#[derive(Debug, Clone)]
pub enum Base {
    /// `fromImage`: an image of the cluster's store, `<project>/<name>:<tag>`.
    Image(String),
    /// `fromTemplate`: a template of `e2b.templates`, or one built before.
    Template(String),
}

/// One step of a template.
#[derive(Debug, Clone)]
pub enum Step {
    /// A shell command (`sh -c`), as `user` when given, else the template's user so far.
    Run {
        cmd: String,
        user: String,
    },
    /// The files the SDK uploaded as `hash`, matched by `src` (a path or glob relative to the
    /// build context), to `dest`, owned by `user` and with `mode` when given.
    Copy {
        src: String,
        dest: String,
        user: String,
        mode: String,
        hash: String,
    },
    Env(Vec<(String, String)>),
    Workdir(String),
    User(String),
}

/// A template as a build body gives it.
#[derive(Debug, Clone)]
pub struct TemplateSpec {
    pub base: Base,
    pub steps: Vec<Step>,
    pub start_cmd: String,
    pub ready_cmd: String,
}

/// A failed build: what went wrong, and the step (`base`, `1`..`N`, `finalize`).
type Failed = (String, Option<String>);

fn at(step: &str) -> impl Fn(String) -> Failed + '_ {
    move |m| (m, Some(step.to_string()))
}

/// Runs build `b` of `spec` for `caller` to its end, which `b` records.
pub async fn run(g: Arc<Gateway>, caller: Caller, b: Arc<Build>, spec: TemplateSpec) {
    let outcome = build(&g, &caller, &b, &spec).await;
    if let Err((m, _)) = &outcome {
        tracing::info!(build = %b.id, template = %b.template, error = %m, "template build failed");
    } else {
        tracing::info!(build = %b.id, template = %b.template, "template build finished");
    }
    b.finish(outcome);
}

/// The settings of the base and the image they name.
async fn base_of(
    g: &Gateway,
    caller: &Caller,
    base: &Base,
) -> Result<(E2bTemplate, pb::ImageInfo), Failed> {
    let fail = at("base");
    let settings = match base {
        Base::Image(i) if i == E2B_BASE_IMAGE => super::create::resolve_template(g, caller, "base")
            .await
            .map_err(|e| fail(e.message))?,
        Base::Image(i) if i.contains('/') => E2bTemplate {
            image: i.clone(),
            ..Default::default()
        }
        .over(g.default_template.as_ref()),
        Base::Image(i) => {
            return Err(fail(format!(
                "fromImage {}: images come from the cluster's store; import it (opendsec ctl \
                 image import) and name it as <project>/<name>:<tag>",
                shown(i)
            )))
        }
        Base::Template(t) => super::create::resolve_template(g, caller, t)
            .await
            .map_err(|e| fail(e.message))?,
    };
    if !settings.image.contains('/') {
        return Err(fail(format!(
            "the base image {} is one of the nodes' own, not of the cluster's store: a \
             template is built from a store image",
            shown(&settings.image)
        )));
    }
    let info = g
        .api()
        .get_image(g.req(
            caller,
            pb::ImageRef {
                name: settings.image.clone(),
            },
        ))
        .await
        .map_err(|s| {
            fail(format!(
                "the base image {}: {}",
                settings.image,
                s.message()
            ))
        })?
        .into_inner();
    Ok((settings, info))
}

async fn build(
    g: &Arc<Gateway>,
    caller: &Caller,
    b: &Build,
    spec: &TemplateSpec,
) -> Result<(), Failed> {
    let (settings, base) = base_of(g, caller, &spec.base).await?;
    b.log(
        Level::Info,
        format!("Starting a sandbox of {}", settings.image),
        Some("base"),
    );
    let mut labels = HashMap::new();
    labels.insert(BUILD_LABEL.to_string(), b.id.clone());
    let sandbox_spec = pb::SandboxSpec {
        backend: settings.backend.clone(),
        image: settings.image.clone(),
        cpu_cores_limit: b.cpu.unwrap_or(settings.cpu),
        memory_limit_mb: b.memory_mb.unwrap_or(settings.memory_mb),
        disk_mb: settings.disk_mb,
        ttl_running_stop: -1,
        ttl_max: BUILD_LIFETIME_S,
        // Steps fetch what they install, as on E2B.
        network_rules: if g.networked {
            [("*".to_string(), true)].into_iter().collect()
        } else {
            HashMap::new()
        },
        labels,
        ..Default::default()
    };
    let sb = g
        .api()
        .create_sandbox(g.req(
            caller,
            pb::CreateSandboxRequest {
                spec: Some(sandbox_spec),
                project: caller.project.clone(),
                idempotency_key: String::new(),
            },
        ))
        .await
        .map_err(|s| at("base")(format!("starting the build's sandbox: {}", s.message())))?
        .into_inner();
    let r = steps_and_image(g, caller, b, spec, &sb.id, &base).await;
    let stop = pb::SandboxRef { id: sb.id.clone() };
    if let Err(s) = g.api().stop_sandbox(g.req(caller, stop)).await {
        tracing::warn!(sandbox = %sb.id, error = %s.message(), "stopping a template build's sandbox");
    }
    r
}

/// The template's settings as its steps leave them.
#[derive(Default)]
struct Settings {
    env: Vec<(String, String)>,
    workdir: String,
    user: String,
}

async fn steps_and_image(
    g: &Gateway,
    caller: &Caller,
    b: &Build,
    spec: &TemplateSpec,
    sandbox: &str,
    base: &pb::ImageInfo,
) -> Result<(), Failed> {
    let sh = Shell {
        g,
        caller,
        b,
        sandbox,
    };
    let mut s = Settings::default();
    for (i, step) in spec.steps.iter().enumerate() {
        let n = (i + 1).to_string();
        let fail = at(&n);
        let env: HashMap<String, String> = s.env.iter().cloned().collect();
        match step {
            Step::Run { cmd, user } => {
                b.log(Level::Info, format!("RUN {cmd}"), Some(&n));
                let user = if user.is_empty() { &s.user } else { user };
                let code = sh
                    .run(cmd, &[], user, &s.workdir, &env, Some(&n))
                    .await
                    .map_err(&fail)?;
                if code != 0 {
                    return Err(fail(format!("RUN {}: exited with {code}", shown(cmd))));
                }
            }
            Step::Env(pairs) => {
                for (k, v) in pairs {
                    s.env.retain(|(x, _)| x != k);
                    s.env.push((k.clone(), v.clone()));
                }
            }
            Step::Workdir(p) => {
                let dir = absolute(&s.workdir, &base.workdir, p);
                b.log(Level::Info, format!("WORKDIR {dir}"), Some(&n));
                let code = sh
                    .run(
                        "mkdir -p \"$1\"",
                        std::slice::from_ref(&dir),
                        &s.user,
                        "",
                        &env,
                        Some(&n),
                    )
                    .await
                    .map_err(&fail)?;
                if code != 0 {
                    return Err(fail(format!("WORKDIR {dir}: mkdir exited with {code}")));
                }
                s.workdir = dir;
            }
            Step::User(u) => {
                b.log(Level::Info, format!("USER {u}"), Some(&n));
                let code = sh
                    .run(
                        ADD_USER,
                        std::slice::from_ref(u),
                        "root",
                        "",
                        &HashMap::new(),
                        Some(&n),
                    )
                    .await
                    .map_err(&fail)?;
                if code != 0 {
                    return Err(fail(format!(
                        "USER {u}: no such user, and it could not be added"
                    )));
                }
                s.user = u.clone();
            }
            Step::Copy {
                src,
                dest,
                user,
                mode,
                hash,
            } => {
                b.log(Level::Info, format!("COPY {src} {dest}"), Some(&n));
                copy(&sh, &s, &base.workdir, src, dest, user, mode, hash, &n).await?;
            }
        }
    }
    finalize(g, caller, b, spec, sandbox, base, &s).await
}

/// Adds user `$1` (with a group of its name and a home in /home) unless it exists:
/// `useradd`, else busybox's `adduser`, else by hand with the next free uid from 1000.
const ADD_USER: &str = r#"set -e
id -u "$1" >/dev/null 2>&1 && exit 0
if command -v useradd >/dev/null 2>&1; then
  useradd -m -s /bin/sh "$1"
elif command -v adduser >/dev/null 2>&1; then
  adduser -D "$1"
else
  uid=1000
  while cut -d: -f3 /etc/passwd /etc/group | grep -qx "$uid"; do uid=$((uid + 1)); done
  echo "$1:x:$uid:$uid::/home/$1:/bin/sh" >> /etc/passwd
  echo "$1:x:$uid:" >> /etc/group
  mkdir -p "/home/$1"
fi
# A home the image had already (root's) becomes the new user's.
home=$(grep "^$1:" /etc/passwd | cut -d: -f6)
if [ -n "$home" ] && [ -d "$home" ]; then chown "$(id -u "$1"):$(id -g "$1")" "$home"; fi
"#;

/// Unpacks the tar `$1` (`$2`: 1 when gzip-compressed) and copies what `$3` (its matched
/// sources' directory in the tar; `$4` 1 when they came from a glob) holds to `$5`, then
/// gives it owner `$6` and mode `$7` when set. One file or symlink goes to `$5` itself, or
/// into it when that is a directory or ends with `/`; a directory or glob's contents go
/// into `$5`.
const COPY_SCRIPT: &str = r#"set -e
a=$1; gz=$2; p=$3; glob=$4; dest=$5; owner=$6; mode=$7
t=$(mktemp -d)
if [ "$gz" = 1 ]; then tar -xzf "$a" -C "$t"; else tar -xf "$a" -C "$t"; fi
rm -f "$a"
src="$t/$p"
set --
if [ "$glob" = 0 ] && { [ -L "$src" ] || [ ! -d "$src" ]; }; then
  case "$dest" in
    */) mkdir -p "$dest"; target="$dest$(basename "$src")" ;;
    *) if [ -d "$dest" ] && [ ! -L "$dest" ]; then target="$dest/$(basename "$src")";
       else mkdir -p "$(dirname "$dest")"; target="$dest"; fi ;;
  esac
  cp -a "$src" "$target"
  set -- "$target"
else
  mkdir -p "$dest"
  for e in "$src"/* "$src"/.[!.]* "$src"/..?*; do
    [ -e "$e" ] || [ -L "$e" ] || continue
    cp -a "$e" "$dest/"
    set -- "$@" "$dest/$(basename "$e")"
  done
fi
rm -rf "$t"
if [ -n "$owner" ] && [ $# -gt 0 ]; then
  case "$owner" in *:*) ;; *) if grep -q "^$owner:" /etc/group 2>/dev/null; then owner="$owner:$owner"; fi ;; esac
  chown -R "$owner" "$@"
fi
if [ -n "$mode" ] && [ $# -gt 0 ]; then chmod -R "$mode" "$@"; fi
"#;

/// `dest` made absolute: from the template's working directory so far, else the base
/// image's, else `/`.
fn absolute(workdir: &str, image_workdir: &str, dest: &str) -> String {
    if dest.starts_with('/') {
        return dest.to_string();
    }
    let from = [workdir, image_workdir, "/"]
        .into_iter()
        .find(|w| !w.is_empty())
        .unwrap_or("/");
    format!("{}/{dest}", from.trim_end_matches('/'))
}

/// The directory of a COPY source's matches within its tar (relative to the build
/// context), and whether the source was a glob.
fn source_dir(src: &str) -> (String, bool) {
    let mut parts = Vec::new();
    let mut glob = false;
    for c in src.split('/').filter(|c| !c.is_empty() && *c != ".") {
        if c.contains(['*', '?', '[']) {
            glob = true;
            break;
        }
        parts.push(c);
    }
    if parts.is_empty() {
        (".".into(), glob)
    } else {
        (parts.join("/"), glob)
    }
}

#[allow(clippy::too_many_arguments)]
async fn copy(
    sh: &Shell<'_>,
    s: &Settings,
    image_workdir: &str,
    src: &str,
    dest: &str,
    user: &str,
    mode: &str,
    hash: &str,
    n: &str,
) -> Result<(), Failed> {
    let fail = at(n);
    let file =
        sh.g.builds
            .file(&super::templates::owner_of(sh.caller), hash);
    let data = tokio::fs::read(&file).await.map_err(|_| {
        fail(format!(
            "COPY {}: its files were not uploaded (hash {hash})",
            shown(src)
        ))
    })?;
    let gz = data.starts_with(&[0x1f, 0x8b]);
    let inside = format!("/tmp/.e2b-copy-{}", &hash[..16]);
    let mut off = 0usize;
    loop {
        let end = (off + CHUNK).min(data.len());
        let req = pb::WriteFileRequest {
            sandbox_id: sh.sandbox.to_string(),
            path: inside.clone(),
            data: data.get(off..end).unwrap_or_default().to_vec(),
            offset: off as i64,
            user: "root".into(),
            session: "e2b-build".into(),
            ..Default::default()
        };
        sh.g.api()
            .write_file(sh.g.req(sh.caller, req))
            .await
            .map_err(|st| fail(format!("COPY {}: {}", shown(src), st.message())))?;
        off = end;
        if off >= data.len() {
            break;
        }
    }
    let (dir, glob) = source_dir(src);
    let owner = if user.is_empty() && s.user != "root" {
        s.user.clone()
    } else {
        user.to_string()
    };
    let args = [
        inside,
        if gz { "1" } else { "0" }.to_string(),
        dir,
        if glob { "1" } else { "0" }.to_string(),
        absolute(&s.workdir, image_workdir, dest),
        owner,
        mode.to_string(),
    ];
    let code = sh
        .run(COPY_SCRIPT, &args, "root", "", &HashMap::new(), Some(n))
        .await
        .map_err(&fail)?;
    if code != 0 {
        return Err(fail(format!(
            "COPY {} {}: exited with {code}",
            shown(src),
            shown(dest)
        )));
    }
    Ok(())
}

/// Packs the sandbox into the build's images with the template's settings.
async fn finalize(
    g: &Gateway,
    caller: &Caller,
    b: &Build,
    spec: &TemplateSpec,
    sandbox: &str,
    base: &pb::ImageInfo,
    s: &Settings,
) -> Result<(), Failed> {
    let fail = at("finalize");
    b.log(Level::Info, "Saving the template", Some("finalize"));
    let first = b.images.first().cloned().unwrap_or_default();
    // Packed under a name of its own first, so each tag's image is written whole, once.
    let scratch = format!("{first}-build-{}", b.id.get(..8).unwrap_or_default());
    let packed = g
        .api()
        .pack_diff(g.req(
            caller,
            pb::PackDiffRequest {
                id: sandbox.to_string(),
                image: scratch.clone(),
                scrub: vec![],
                overwrite: true,
            },
        ))
        .await
        .map_err(|st| fail(format!("saving the sandbox: {}", st.message())))?
        .into_inner();
    let mut env: Vec<String> = base.env.clone();
    for (k, v) in &s.env {
        env.retain(|kv| kv.split_once('=').map_or(kv.as_str(), |(x, _)| x) != k);
        env.push(format!("{k}={v}"));
    }
    let mut labels = HashMap::new();
    if !spec.start_cmd.is_empty() {
        labels.insert(START_LABEL.to_string(), spec.start_cmd.clone());
    }
    if !spec.ready_cmd.is_empty() {
        labels.insert(READY_LABEL.to_string(), spec.ready_cmd.clone());
    }
    let mut result = Ok(());
    for name in &b.images {
        let info = pb::ImageInfo {
            name: name.clone(),
            layers: packed.layers.clone(),
            env: env.clone(),
            workdir: if s.workdir.is_empty() {
                base.workdir.clone()
            } else {
                s.workdir.clone()
            },
            user: if s.user.is_empty() {
                base.user.clone()
            } else {
                s.user.clone()
            },
            parent: packed.parent.clone(),
            source: format!("E2B template build {}", b.id),
            labels: labels.clone(),
            ..Default::default()
        };
        if let Err(st) = g
            .api()
            .register_image(g.req(
                caller,
                pb::RegisterImageRequest {
                    image: Some(info),
                    overwrite: true,
                    dry_run: false,
                },
            ))
            .await
        {
            result = Err(fail(format!("saving {name}: {}", st.message())));
            break;
        }
        b.log(Level::Info, format!("Saved {name}"), Some("finalize"));
    }
    let del = pb::ImageRef {
        name: scratch.clone(),
    };
    if let Err(st) = g.api().delete_image(g.req(caller, del)).await {
        tracing::warn!(image = %scratch, error = %st.message(), "removing a template build's scratch image");
    }
    result
}

/// Runs shell commands in the build's sandbox, their output its log.
struct Shell<'a> {
    g: &'a Gateway,
    caller: &'a Caller,
    b: &'a Build,
    sandbox: &'a str,
}

impl Shell<'_> {
    /// Runs `script` (`sh -c`, `args` as `$1`...) as `user` in `cwd` (both "" = the image's)
    /// with `env` added; its output lines go to the build's log for `step` (when given).
    /// Its exit code (-1 when a signal ended it). Errors: the apiserver's, as text.
    async fn run(
        &self,
        script: &str,
        args: &[String],
        user: &str,
        cwd: &str,
        env: &HashMap<String, String>,
        step: Option<&str>,
    ) -> Result<i32, String> {
        use pb::process_event::Kind;
        let mut argv = vec!["-c".to_string(), script.to_string(), "sh".to_string()];
        argv.extend(args.iter().cloned());
        let req = pb::StartProcessRequest {
            sandbox_id: self.sandbox.to_string(),
            cmd: "/bin/sh".into(),
            args: argv,
            env: env.clone(),
            cwd: cwd.to_string(),
            user: user.to_string(),
            ..Default::default()
        };
        let mut events = self
            .g
            .api()
            .start_process(self.g.req(self.caller, req))
            .await
            .map_err(|s| s.message().to_string())?
            .into_inner();
        let mut out = Lines::default();
        loop {
            let ev = events
                .message()
                .await
                .map_err(|s| s.message().to_string())?;
            let Some(ev) = ev else {
                return Err("the command's output ended without its exit".into());
            };
            match ev.kind {
                Some(Kind::Stdout(d)) | Some(Kind::Stderr(d)) | Some(Kind::Pty(d)) => {
                    for line in out.push(&d) {
                        self.b.log(Level::Info, line, step);
                    }
                }
                Some(Kind::End(e)) => {
                    if let Some(line) = out.rest() {
                        self.b.log(Level::Info, line, step);
                    }
                    return Ok(e.exit_code);
                }
                _ => {}
            }
        }
    }
}

/// Output split into lines as it comes.
#[derive(Default)]
struct Lines(Vec<u8>);

impl Lines {
    /// The whole lines `d` completes (a line over 16 KiB is cut there).
    fn push(&mut self, d: &[u8]) -> Vec<String> {
        self.0.extend_from_slice(d);
        let mut out = Vec::new();
        while let Some(i) = self.0.iter().position(|b| *b == b'\n') {
            let line: Vec<u8> = self.0.drain(..=i).collect();
            out.push(String::from_utf8_lossy(line.get(..i).unwrap_or_default()).into_owned());
        }
        if self.0.len() > 16 << 10 {
            out.push(String::from_utf8_lossy(&self.0).into_owned());
            self.0.clear();
        }
        out
    }

    fn rest(&mut self) -> Option<String> {
        (!self.0.is_empty())
            .then(|| String::from_utf8_lossy(&std::mem::take(&mut self.0)).into_owned())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_sources_name_their_directory_in_the_tar() {
        assert_eq!(source_dir("local.txt"), ("local.txt".into(), false));
        assert_eq!(source_dir("./sub/"), ("sub".into(), false));
        assert_eq!(source_dir("."), (".".into(), false));
        assert_eq!(source_dir("sub/*.txt"), ("sub".into(), true));
        assert_eq!(source_dir("**/*.py"), (".".into(), true));
        assert_eq!(source_dir("a/b[12]/c"), ("a".into(), true));
    }

    #[test]
    fn relative_destinations_start_from_the_working_directory() {
        assert_eq!(absolute("", "", "x"), "/x");
        assert_eq!(absolute("", "/home/user", "x/y"), "/home/user/x/y");
        assert_eq!(absolute("/app/", "/home/user", "x"), "/app/x");
        assert_eq!(absolute("/app", "", "/abs/"), "/abs/");
    }

    #[test]
    fn output_becomes_lines() {
        let mut l = Lines::default();
        assert_eq!(l.push(b"a\nb"), vec!["a"]);
        assert_eq!(l.push(b"c\n\nd"), vec!["bc", ""]);
        assert_eq!(l.rest().as_deref(), Some("d"));
        assert_eq!(l.rest(), None);
    }
}
