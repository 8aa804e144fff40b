//! `image import|list|get|delete|compose|pack|snapshot|gc|store-check|save` (docs/cli.md,
//! docs/images.md).
//!
//! `image import` runs on a machine that mounts the image store: it asks the API whether the
//! name may be registered (a dry run: permission, name taken), writes the layers into the store
//! itself, then registers the image through the API.

use std::collections::HashMap;
use std::path::PathBuf;

use argh::FromArgs;

use super::{output, CtlError, Ctx};
use crate::images::auth::{self, Credentials};
use crate::images::import::{import_layers, import_resolved, Options};
use crate::images::name::ImageRef;
use crate::images::registry::{Registry, RegistryOptions};
use crate::images::store::Store;
use crate::pb;
use crate::types::Failure;

#[derive(FromArgs, Debug)]
/// import, list, show, compose and delete images in the shared image store
#[argh(subcommand, name = "image", help_triggers("-h", "--help", "help"))]
pub struct ImageArgs {
    #[argh(subcommand)]
    pub cmd: ImageCmd,
}

#[derive(FromArgs, Debug)]
#[argh(subcommand)]
pub enum ImageCmd {
    Import(ImportArgs),
    List(ListArgs),
    Get(GetArgs),
    Delete(DeleteArgs),
    Compose(ComposeArgs),
    Pack(PackArgs),
    Snapshot(SnapshotArgs),
    Gc(GcArgs),
    StoreCheck(StoreCheckArgs),
    Save(SaveArgs),
}

#[derive(FromArgs, Debug)]
/// save a registry image (its linux/amd64 image) as an OCI archive, for machines without
/// access to the registry to `image import ./FILE`; needs no cluster
#[argh(
    subcommand,
    name = "save",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} python:3.12 -out python-3.12.tar"
)]
pub struct SaveArgs {
    /// the registry image, e.g. python:3.12 or host:5000/team/app:1
    #[argh(positional)]
    pub src: String,
    /// the archive to write (replaced if it exists)
    #[argh(option)]
    pub out: String,
    /// the registry user (with -password-stdin)
    #[argh(option)]
    pub username: Option<String>,
    /// read the registry password or access token from stdin
    #[argh(switch)]
    pub password_stdin: bool,
    /// a docker-format credentials file to use before $REGISTRY_AUTH_FILE, $DOCKER_CONFIG
    /// and ~/.docker/config.json
    #[argh(option)]
    pub registry_auth: Option<String>,
    /// talk to the registry over plain HTTP (a registry without TLS)
    #[argh(switch)]
    pub plain_http: bool,
    /// print no progress
    #[argh(switch, short = 'q')]
    pub quiet: bool,
}

#[derive(FromArgs, Debug)]
/// check whether a file system (a newly mounted NAS, say) can hold the image store: prints
/// ok, FAIL or warn per item and exits 1 when a required item fails (as root; no cluster)
#[argh(
    subcommand,
    name = "store-check",
    help_triggers("-h", "--help", "help")
)]
pub struct StoreCheckArgs {
    /// the image store's mount point (env OPENDSEC_IMAGE_STORE)
    #[argh(option)]
    pub store: Option<String>,
}

#[derive(FromArgs, Debug)]
/// remove the layers no image and no running sandbox refers to, and interrupted writes,
/// sparing anything younger than -grace (works on the store only, as root)
#[argh(subcommand, name = "gc", help_triggers("-h", "--help", "help"))]
pub struct GcArgs {
    /// the image store's mount point (env OPENDSEC_IMAGE_STORE)
    #[argh(option)]
    pub store: Option<String>,
    /// keep what changed more recently than this (default 24h)
    #[argh(option, default = "String::from(\"24h\")")]
    pub grace: String,
    /// list what would go, remove nothing
    #[argh(switch)]
    pub dry_run: bool,
}

#[derive(FromArgs, Debug)]
/// import an image into the store and register it (as root, on a machine that mounts the
/// store); no time limit unless -deadline is given
#[argh(
    subcommand,
    name = "import",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} python:3.12 -as root/py:3.12 -store /mnt/opendsec-images\n{command_name} 10.0.0.5:5000/base:1 -as root/base:1 -plain-http\necho \"$TOKEN\" | {command_name} harbor.example.com/team/app:1.0 -as root/app:1.0 -username 'robot$ci' -password-stdin\n{command_name} ./app.tar -as root/app:1\n{command_name} ./bundle.tar#app:1 -as root/app:1"
)]
pub struct ImportArgs {
    /// the source: a registry image (python:3.12, host:5000/team/app:1), or a local OCI
    /// layout directory, OCI archive or docker save tar, starting with / or . (PATH#name:tag
    /// picks one image of several)
    #[argh(positional)]
    pub src: String,
    /// the image's name, project/name:tag
    #[argh(option, long = "as")]
    pub target: String,
    /// the image store's mount point (env OPENDSEC_IMAGE_STORE)
    #[argh(option)]
    pub store: Option<String>,
    /// replace an image of the same name
    #[argh(switch)]
    pub overwrite: bool,
    /// print no progress
    #[argh(switch, short = 'q')]
    pub quiet: bool,
    /// the registry user (with -password-stdin)
    #[argh(option)]
    pub username: Option<String>,
    /// read the registry password or access token from stdin
    #[argh(switch)]
    pub password_stdin: bool,
    /// a docker-format credentials file to use before $REGISTRY_AUTH_FILE, $DOCKER_CONFIG
    /// and ~/.docker/config.json
    #[argh(option)]
    pub registry_auth: Option<String>,
    /// talk to the registry over plain HTTP (a registry without TLS)
    #[argh(switch)]
    pub plain_http: bool,
}

#[derive(FromArgs, Debug)]
/// list the images of a project (default -project) and its subprojects
#[argh(subcommand, name = "list", help_triggers("-h", "--help", "help"))]
pub struct ListArgs {
    /// project path, e.g. root/rl
    #[argh(positional)]
    pub project: Option<String>,
}

#[derive(FromArgs, Debug)]
/// show an image: its layers (bottom first) and defaults
#[argh(subcommand, name = "get", help_triggers("-h", "--help", "help"))]
pub struct GetArgs {
    /// project/name:tag
    #[argh(positional)]
    pub name: String,
}

#[derive(FromArgs, Debug)]
/// delete an image's registration (image gc reclaims its layers)
#[argh(subcommand, name = "delete", help_triggers("-h", "--help", "help"))]
pub struct DeleteArgs {
    /// project/name:tag
    #[argh(positional)]
    pub name: String,
}

#[derive(FromArgs, Debug)]
/// stack images bottom first into a new one, copying no data
#[argh(
    subcommand,
    name = "compose",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} root/rl/swe-4821:v1 root/rl/python:3.12 root/rl/django-ws:a1b2 root/tools/agent-kit:3"
)]
pub struct ComposeArgs {
    /// the new image's name, then its parts bottom first
    #[argh(positional)]
    pub names: Vec<String>,
    /// an environment variable KEY=value added after the parts' (repeatable)
    #[argh(option)]
    pub env: Vec<String>,
    /// the working directory (default: the topmost part's)
    #[argh(option)]
    pub workdir: Option<String>,
    /// the default user (default: the topmost part's)
    #[argh(option)]
    pub user: Option<String>,
    /// replace an image of the same name
    #[argh(switch)]
    pub overwrite: bool,
}

#[derive(FromArgs, Debug)]
/// save a container sandbox's file changes against its image as a new image (pack_diff);
/// /tmp, /var/tmp, caches and shell history are left out
#[argh(
    subcommand,
    name = "pack",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} $ID root/rl/repo-env:v1 -scrub srv/repo/.git"
)]
pub struct PackArgs {
    /// the sandbox
    #[argh(positional)]
    pub id: String,
    /// the new image, project/name:tag
    #[argh(positional)]
    pub name: String,
    /// more paths to leave out, globs relative to / separated by commas (* stops at /)
    #[argh(option)]
    pub scrub: Vec<String>,
    /// replace an image of the same name
    #[argh(switch)]
    pub overwrite: bool,
}

#[derive(FromArgs, Debug)]
/// save a sandbox's files as they are as a new image (a snapshot)
#[argh(
    subcommand,
    name = "snapshot",
    help_triggers("-h", "--help", "help"),
    example = "{command_name} $ID root/rl/step-40:v1"
)]
pub struct SnapshotArgs {
    /// the sandbox
    #[argh(positional)]
    pub id: String,
    /// the new image, project/name:tag
    #[argh(positional)]
    pub name: String,
    /// keep memory too (microVMs only)
    #[argh(switch)]
    pub memory: bool,
    /// replace an image of the same name
    #[argh(switch)]
    pub overwrite: bool,
}

impl ImageArgs {
    /// Whether this command runs without the default time limit (an import or a
    /// collection can take long).
    pub fn unbounded(&self) -> bool {
        matches!(
            self.cmd,
            ImageCmd::Import(_)
                | ImageCmd::Gc(_)
                | ImageCmd::StoreCheck(_)
                | ImageCmd::Save(_)
                | ImageCmd::Pack(_)
                | ImageCmd::Snapshot(_)
        )
    }

    /// Runs the subcommand and prints the image (or images, or `{}` after a delete) as JSON.
    /// Errors: `invalid` for bad names, sources or values; the server's failure; the
    /// store's (`internal`) and the layers' (`invalid`) for an import.
    pub async fn run(self, ctx: &Ctx) -> Result<(), CtlError> {
        match self.cmd {
            ImageCmd::Import(a) => import(a, ctx, |k| std::env::var(k).ok()).await,
            ImageCmd::List(a) => {
                let conn = ctx.connect()?;
                let req = pb::ListImagesRequest {
                    project: a.project.unwrap_or_else(|| conn.project.clone()),
                };
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.list_images(r).await })
                        .await?,
                )
            }
            ImageCmd::Get(a) => {
                ImageRef::parse(&a.name)?;
                let conn = ctx.connect()?;
                let req = pb::ImageRef { name: a.name };
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.get_image(r).await })
                        .await?,
                )
            }
            ImageCmd::Delete(a) => {
                ImageRef::parse(&a.name)?;
                let conn = ctx.connect()?;
                let req = pb::ImageRef { name: a.name };
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.delete_image(r).await })
                        .await?,
                )
            }
            ImageCmd::Gc(a) => gc(a, |k| std::env::var(k).ok()).await,
            ImageCmd::StoreCheck(a) => store_check(a, |k| std::env::var(k).ok()).await,
            ImageCmd::Save(a) => save(a, |k| std::env::var(k).ok()).await,
            ImageCmd::Pack(a) => {
                ImageRef::parse(&a.name)?;
                let req = pb::PackDiffRequest {
                    id: a.id,
                    image: a.name,
                    scrub: split_list(&a.scrub),
                    overwrite: a.overwrite,
                };
                crate::images::pack::Scrub::new(true, &req.scrub)?;
                let conn = ctx.connect()?;
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.pack_diff(r).await })
                        .await?,
                )
            }
            ImageCmd::Snapshot(a) => {
                ImageRef::parse(&a.name)?;
                let req = pb::CreateSnapshotRequest {
                    id: a.id,
                    image: a.name,
                    memory: a.memory,
                    overwrite: a.overwrite,
                };
                let conn = ctx.connect()?;
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.create_snapshot(r).await })
                        .await?,
                )
            }
            ImageCmd::Compose(a) => {
                let req = compose_request(a)?;
                let conn = ctx.connect()?;
                output::json(
                    &conn
                        .call(req, |mut c, r| async move { c.compose_image(r).await })
                        .await?,
                )
            }
        }
    }
}

/// `-scrub a,b -scrub c` → `[a, b, c]` (empty items dropped).
fn split_list(v: &[String]) -> Vec<String> {
    v.iter()
        .flat_map(|s| s.split(','))
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn compose_request(a: ComposeArgs) -> Result<pb::ComposeImageRequest, CtlError> {
    let Some((name, parts)) = a.names.split_first() else {
        return Err(CtlError::usage(
            "image compose needs the new image's name and at least one part",
        ));
    };
    if parts.is_empty() {
        return Err(CtlError::usage("image compose needs at least one part"));
    }
    ImageRef::parse(name)?;
    for p in parts {
        ImageRef::parse(p)?;
    }
    let mut env = HashMap::new();
    for kv in &a.env {
        let Some((k, v)) = kv.split_once('=') else {
            return Err(CtlError::usage(format!("-env {kv:?}: expected KEY=value")));
        };
        crate::images::compose::check_env(k, v)?;
        env.insert(k.to_string(), v.to_string());
    }
    Ok(pb::ComposeImageRequest {
        name: name.clone(),
        parts: parts.to_vec(),
        env,
        workdir: a.workdir.unwrap_or_default(),
        user: a.user.unwrap_or_default(),
        overwrite: a.overwrite,
    })
}

/// `image gc`: prints a line per thing removed (`removed layer <hex> (12.3 MB)`, or `would
/// remove` with -dry-run) and a summary. Errors: `invalid` (a bad -grace), `internal` (the
/// store cannot be read or a removal failed; a manifest that cannot be read stops it before
/// anything is removed).
async fn gc(a: GcArgs, env: impl Fn(&str) -> Option<String>) -> Result<(), CtlError> {
    let dir = store_dir(a.store, &env)?;
    if !dir.join("layers").is_dir() && !dir.join("images").is_dir() {
        return Err(Failure::invalid(format!(
            "{} is not an image store (it has no layers/ or images/)",
            dir.display()
        ))
        .into());
    }
    let opts = crate::images::gc::GcOptions {
        grace: super::values::duration("grace", &a.grace)?,
        dry_run: a.dry_run,
    };
    let report = tokio::task::spawn_blocking(move || {
        let store = crate::images::store::Store::at(&dir);
        crate::images::gc::collect(&store, &opts)
    })
    .await
    .map_err(|e| Failure::internal(format!("image gc: {e}")))?
    .map_err(|e| Failure::internal(crate::types::chain(&e)))?;
    let verb = if a.dry_run { "would remove" } else { "removed" };
    let mut total = 0u64;
    for r in &report.removed {
        total += r.bytes;
        println!("{verb} {} ({:.1} MB)", r.what, r.bytes as f64 / 1e6);
    }
    println!(
        "{verb} {} item(s), {:.1} MB; kept {} layer(s) and snapshot(s) in use and {} item(s) younger than {}",
        report.removed.len(),
        total as f64 / 1e6,
        report.kept_referenced,
        report.kept_young,
        a.grace
    );
    Ok(())
}

/// The registry flags `image import` and `image save` share.
struct RegistryFlags<'a> {
    username: &'a Option<String>,
    password_stdin: bool,
    registry_auth: Option<&'a str>,
    plain_http: bool,
    quiet: bool,
}

/// The [`RegistryFlags`] of an `ImportArgs` or a `SaveArgs`. argh cannot flatten one struct
/// of flags into both, so each declares the fields; this reads them in one place.
macro_rules! registry_flags {
    ($a:expr) => {
        RegistryFlags {
            username: &$a.username,
            password_stdin: $a.password_stdin,
            registry_auth: $a.registry_auth.as_deref(),
            plain_http: $a.plain_http,
            quiet: $a.quiet,
        }
    };
}

/// `image save`: writes the archive, then prints `{"reference", "manifest", "layers",
/// "bytes", "out"}`. Errors: as `image import` from a registry (`invalid`, `unauthenticated`,
/// `not_found`, `unavailable`); nothing is left at `-out` when it fails.
async fn save(a: SaveArgs, env: impl Fn(&str) -> Option<String>) -> Result<(), CtlError> {
    if is_local(&a.src) {
        return Err(CtlError::usage(format!(
            "image save takes a registry image, not the local path {:?}",
            a.src
        )));
    }
    let opts = registry_options(&a.src, &registry_flags!(a), &env)?;
    let (src, out, quiet) = (a.src, PathBuf::from(&a.out), a.quiet);
    let rt = tokio::runtime::Handle::current();
    let o = out.clone();
    let saved = tokio::task::spawn_blocking(move || {
        let last = std::cell::Cell::new(std::time::Instant::now());
        crate::images::registry::save(&rt, &src, &opts, &o, &|bytes| {
            if !quiet && last.get().elapsed().as_secs() >= 1 {
                eprintln!("{:.1} MB written", bytes as f64 / 1e6);
                last.set(std::time::Instant::now());
            }
        })
    })
    .await
    .map_err(|e| Failure::internal(format!("image save: {e}")))?
    .map_err(|e| e.to_failure())?;
    output::json(&serde_json::json!({
        "reference": saved.reference,
        "manifest": saved.manifest,
        "layers": saved.layers,
        "bytes": saved.bytes,
        "out": out.display().to_string(),
    }))
}

/// `image store-check`: a line per item, then the verdict. Errors: `internal` when the
/// scratch directory cannot be made; a failed required item exits 1 (after the lines).
async fn store_check(
    a: StoreCheckArgs,
    env: impl Fn(&str) -> Option<String>,
) -> Result<(), CtlError> {
    let dir = store_dir(a.store, &env)?;
    let d = dir.clone();
    let items = tokio::task::spawn_blocking(move || crate::images::check::store_check(&d))
        .await
        .map_err(|e| Failure::internal(format!("image store-check: {e}")))?
        .map_err(|e| Failure::internal(format!("{}: {e}", dir.display())))?;
    let (lines, ok) = crate::images::check::report(&dir, &items);
    for l in &lines {
        println!("{l}");
    }
    if ok {
        Ok(())
    } else {
        Err(CtlError::Exit(1))
    }
}

/// The store directory: `-store`, else `OPENDSEC_IMAGE_STORE`. Errors: a usage error.
fn store_dir(
    flag: Option<String>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<PathBuf, CtlError> {
    flag.or_else(|| env("OPENDSEC_IMAGE_STORE"))
        .filter(|s| !s.is_empty())
        .map(PathBuf::from)
        .ok_or_else(|| {
            CtlError::usage("this image command needs -store DIR (or OPENDSEC_IMAGE_STORE): the image store's mount point")
        })
}

/// Whether `src` names a local file or directory: local paths start with `/` or `.`;
/// everything else is a registry reference, never looked up on disk (docs/cli.md).
fn is_local(src: &str) -> bool {
    src.starts_with('/') || src.starts_with('.')
}

/// Refuses a registry reference that is also a path here (`myimage.tar`, `layout#1`): the
/// caller almost surely meant the file, and it must not become a registry lookup (a
/// network call) by accident. Errors: a usage error saying to write `./`.
fn not_a_path_here(src: &str) -> Result<(), CtlError> {
    let path = src.split_once('#').map_or(src, |(p, _)| p);
    if std::path::Path::new(path).exists() {
        return Err(CtlError::usage(format!(
            "{src:?} is a path here: write ./{src} to use it (a source not starting with / or . is a registry image)"
        )));
    }
    Ok(())
}

/// How to reach the registry `src` names, from the flags: refuses a name that is a path here,
/// parses the reference, finds the credentials. Errors: as [`credentials`], and `invalid` for a
/// reference that does not parse.
fn registry_options(
    src: &str,
    flags: &RegistryFlags<'_>,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<RegistryOptions, CtlError> {
    not_a_path_here(src)?;
    let r = crate::images::registry::parse_reference(src).map_err(|e| e.to_failure())?;
    let credentials = credentials(
        flags,
        r.registry(),
        r.repository(),
        &mut std::io::stdin(),
        env,
    )?;
    Ok(RegistryOptions {
        plain_http: flags.plain_http,
        credentials,
    })
}

/// The registry credentials: `-username` with `-password-stdin` (read from `stdin`), else what
/// the credentials files hold for the registry, else none. Errors: a usage error for one
/// flag without the other, `invalid` for a broken credentials file.
fn credentials(
    a: &RegistryFlags<'_>,
    registry: &str,
    repository: &str,
    stdin: &mut dyn std::io::Read,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Credentials, CtlError> {
    match (&a.username, a.password_stdin) {
        (Some(u), true) => {
            let mut p = String::new();
            stdin
                .read_to_string(&mut p)
                .map_err(|e| CtlError::usage(format!("-password-stdin: reading stdin: {e}")))?;
            let p = p.trim_end_matches(['\n', '\r']).to_string();
            if p.is_empty() {
                return Err(CtlError::usage("-password-stdin: stdin held no password"));
            }
            Ok(Credentials::Basic {
                username: u.clone(),
                password: p,
            })
        }
        (Some(_), false) => Err(CtlError::usage(
            "-username needs -password-stdin (passwords are never taken on the command line)",
        )),
        (None, true) => Err(CtlError::usage("-password-stdin needs -username")),
        (None, false) => {
            // A file named on the command line must be there; the environment's are optional.
            if let Some(f) = a.registry_auth {
                if !std::path::Path::new(f).is_file() {
                    return Err(
                        Failure::invalid(format!("-registry-auth {f:?}: no such file")).into(),
                    );
                }
            }
            let files = auth::default_files(a.registry_auth, env);
            match auth::lookup(&files, registry, repository).map_err(|e| e.to_failure())? {
                Some((c, file)) => {
                    if !a.quiet {
                        eprintln!("using the credentials for {registry} in {}", file.display());
                    }
                    Ok(c)
                }
                None => Ok(Credentials::Anonymous),
            }
        }
    }
}

async fn import(
    a: ImportArgs,
    ctx: &Ctx,
    env: impl Fn(&str) -> Option<String>,
) -> Result<(), CtlError> {
    let target = ImageRef::parse(&a.target)?;
    let dir = store_dir(a.store.clone(), &env)?;
    let local = is_local(&a.src);
    if local {
        for (set, flag) in [
            (a.plain_http, "-plain-http"),
            (a.username.is_some(), "-username"),
            (a.password_stdin, "-password-stdin"),
            (a.registry_auth.is_some(), "-registry-auth"),
        ] {
            if set {
                return Err(CtlError::usage(format!(
                    "{flag} is for registry sources; {:?} is a local path",
                    a.src
                )));
            }
        }
    }
    // Credentials before anything else: a bad flag or file changes nothing.
    let registry_opts = if local {
        None
    } else {
        Some(registry_options(&a.src, &registry_flags!(a), &env)?)
    };
    let conn = ctx.connect()?;
    // Ask first, so a name that is taken or not ours fails before any layer is written.
    let probe = pb::RegisterImageRequest {
        image: Some(pb::ImageInfo {
            name: target.to_string(),
            ..Default::default()
        }),
        overwrite: a.overwrite,
        dry_run: true,
    };
    conn.call(probe, |mut c, r| async move { c.register_image(r).await })
        .await?;
    let store = Store::open(&dir).map_err(|e| e.to_failure())?;
    let (src, quiet, overwrite) = (a.src, a.quiet, a.overwrite);
    let opts = Options {
        overwrite,
        ..Default::default()
    };
    let manifest = match registry_opts {
        None => tokio::task::spawn_blocking(move || {
            let display = super::progress::Display::new(quiet);
            import_layers(&store, &src, opts, &|p| display.show(p)).map_err(|e| e.to_failure())
        })
        .await
        .map_err(|e| Failure::internal(format!("the import task: {e}")))??,
        Some(ro) => {
            let (registry, image) = Registry::resolve(&src, &ro)
                .await
                .map_err(|e| e.to_failure())?;
            if !quiet {
                eprintln!("{}: {} layer(s)", registry.reference(), image.layers.len());
            }
            tokio::task::spawn_blocking(move || {
                let display = super::progress::Display::new(quiet);
                let name = registry.reference();
                import_resolved(&store, &registry, image, name, opts, &|p| display.show(p))
                    .map_err(|e| e.to_failure())
            })
            .await
            .map_err(|e| Failure::internal(format!("the import task: {e}")))??
        }
    };
    let req = pb::RegisterImageRequest {
        image: Some(pb::ImageInfo {
            name: target.to_string(),
            layers: manifest.layers.iter().map(|d| d.to_string()).collect(),
            env: manifest.env,
            workdir: manifest.workdir,
            user: manifest.user,
            source: manifest.source,
            ..Default::default()
        }),
        overwrite,
        dry_run: false,
    };
    output::json(
        &conn
            .call(req, |mut c, r| async move { c.register_image(r).await })
            .await?,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compose_takes_the_name_then_the_parts_and_checks_env() {
        let a = |names: &[&str], env: &[&str]| ComposeArgs {
            names: names.iter().map(|s| s.to_string()).collect(),
            env: env.iter().map(|s| s.to_string()).collect(),
            workdir: None,
            user: None,
            overwrite: false,
        };
        let r = compose_request(a(&["root/n:1", "root/a:1", "root/b:2"], &["A=1=2"])).unwrap();
        assert_eq!(r.name, "root/n:1");
        assert_eq!(r.parts, ["root/a:1", "root/b:2"]);
        assert_eq!(r.env.get("A").map(String::as_str), Some("1=2"));
        assert!(compose_request(a(&["root/n:1"], &[]))
            .unwrap_err()
            .is_usage());
        assert!(compose_request(a(&["root/n:1", "root/a"], &["noequals"]))
            .unwrap_err()
            .is_usage());
        let e = compose_request(a(&["root/N:1", "root/a"], &[])).unwrap_err();
        assert!(!e.is_usage() && e.message().contains("name"), "{e}");
    }

    #[test]
    fn the_store_comes_from_the_flag_or_the_environment() {
        let none = |_: &str| None;
        let env = |k: &str| (k == "OPENDSEC_IMAGE_STORE").then(|| "/mnt/s".to_string());
        assert!(store_dir(None, &none).unwrap_err().is_usage());
        assert_eq!(store_dir(None, &env).unwrap(), PathBuf::from("/mnt/s"));
        assert_eq!(
            store_dir(Some("/x".into()), &env).unwrap(),
            PathBuf::from("/x")
        );
    }
}
