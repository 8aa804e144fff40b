//! E2B's template build API (docs/e2b.md "Template builds"): `Template.build()` of E2B's
//! SDKs asks for a build (`POST /v3/templates`), uploads the files of its `COPY` steps
//! (`GET /templates/{id}/files/{hash}`, then a `PUT` to the link it got), starts the build
//! with the template's steps (`POST /v2/templates/{id}/builds/{build}`) and polls its status
//! and logs (`GET .../status`). The steps run in a container sandbox of the caller's
//! ([`super::build`]); the result is an image of the caller's project, `<name>:<tag>`, which
//! `Sandbox.create("<name>")` then starts from.
//!
//! A build and its upload links live in the gateway that took the request (its status is
//! polled there); uploaded files are kept in `e2b.build_dir` for a day, by their hash, per
//! caller, so a second build of the same files uploads nothing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path as UrlPath, RawQuery, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;

use super::build::{self, Step, TemplateSpec};
use super::create::{field, object, only};
use super::{ApiError, Caller, Gateway};
use crate::images::name::ImageRef;
use crate::pb;
use crate::types::names::shown;

/// The tag of a build whose name has none (E2B's own).
pub const DEFAULT_TAG: &str = "default";
/// Builds one caller may have running at once.
const MAX_RUNNING: usize = 4;
/// Builds remembered in all; the oldest finished ones go first.
const MAX_BUILDS: usize = 1024;
/// How long a finished build's status stays readable.
const KEEP_FINISHED: Duration = Duration::from_secs(3600);
/// How long an upload link holds.
const LINK_FOR: Duration = Duration::from_secs(3600);
/// How long an uploaded file is kept for later builds.
const KEEP_FILES: Duration = Duration::from_secs(86_400);
/// The largest file one `COPY` step uploads (a tar of its sources).
pub const MAX_UPLOAD: u64 = 4 << 30;
/// How long a build waits for its steps before it is given up.
const WAIT_FOR_STEPS: Duration = Duration::from_secs(600);
/// Log entries one status answer holds at most (E2B's `limit` default).
const MAX_LIMIT: usize = 100;

/// Where a build is (E2B's `TemplateBuildStatus`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Waiting,
    Building,
    Ready,
    Error,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Waiting => "waiting",
            Status::Building => "building",
            Status::Ready => "ready",
            Status::Error => "error",
        }
    }
}

/// What a build has said and where it is.
struct Progress {
    status: Status,
    /// E2B's `BuildLogEntry` objects, in order.
    entries: Vec<Value>,
    /// E2B's `BuildStatusReason` once it failed.
    reason: Option<Value>,
    started: bool,
    finished_at: Option<Instant>,
}

/// One build of a template: asked for by `POST /v3/templates`, run once its steps come.
pub struct Build {
    pub id: String,
    /// E2B's template id: the name without its tag.
    pub template: String,
    /// The images it makes, `<project>/<name>:<tag>`, the first the name's own tag.
    pub images: Vec<String>,
    pub cpu: Option<f64>,
    pub memory_mb: Option<i64>,
    owner: [u8; 32],
    /// When it was asked for: a build whose steps never come is given up after
    /// [`WAIT_FOR_STEPS`].
    asked: Instant,
    progress: Mutex<Progress>,
}

/// The log levels E2B's SDKs know.
#[derive(Clone, Copy)]
pub enum Level {
    Info,
    Error,
}

impl Build {
    /// Adds a log entry (`step` names the 1-based step, `base` or `finalize`).
    pub fn log(&self, level: Level, message: impl Into<String>, step: Option<&str>) {
        let mut e = json!({
            "timestamp": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
            "level": match level { Level::Info => "info", Level::Error => "error" },
            "message": message.into(),
        });
        if let (Some(s), Some(o)) = (step, e.as_object_mut()) {
            o.insert("step".into(), s.into());
        }
        let mut p = self.lock();
        // A step that prints without end cannot grow the gateway's memory without end.
        if p.entries.len() < MAX_ENTRIES {
            p.entries.push(e);
        } else if p.entries.len() == MAX_ENTRIES {
            p.entries.push(json!({
                "timestamp": chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                "level": "warn",
                "message": format!("more than {MAX_ENTRIES} log lines: the rest are not kept"),
            }));
        }
    }

    /// Ends the build: `ready`, or `error` with `message` (naming `step` when a step failed).
    pub fn finish(&self, outcome: Result<(), (String, Option<String>)>) {
        match &outcome {
            Ok(()) => self.log(Level::Info, "Build finished", Some("finalize")),
            Err((m, step)) => self.log(Level::Error, m.clone(), step.as_deref()),
        }
        let mut p = self.lock();
        p.finished_at = Some(Instant::now());
        match outcome {
            Ok(()) => p.status = Status::Ready,
            Err((message, step)) => {
                p.status = Status::Error;
                let mut r = json!({"message": message});
                if let (Some(s), Some(o)) = (step, r.as_object_mut()) {
                    o.insert("step".into(), s.into());
                }
                p.reason = Some(r);
            }
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Progress> {
        self.progress.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn status(&self) -> Status {
        self.lock().status
    }

    /// Whether the build still takes one of its caller's places: started and not finished,
    /// or waiting for its steps for less than [`WAIT_FOR_STEPS`] (one waiting longer is
    /// given up here).
    fn running(&self) -> bool {
        match self.status() {
            Status::Building => true,
            Status::Waiting if self.asked.elapsed() < WAIT_FOR_STEPS => true,
            Status::Waiting => {
                self.finish(Err((
                    format!(
                        "its steps did not come within {} s",
                        WAIT_FOR_STEPS.as_secs()
                    ),
                    None,
                )));
                false
            }
            Status::Ready | Status::Error => false,
        }
    }
}

/// Most log entries a build keeps.
const MAX_ENTRIES: usize = 10_000;

/// A link to upload one file: its hash, for whom, until when.
struct Link {
    hash: String,
    owner: [u8; 32],
    until: Instant,
}

/// The builds and upload links of this gateway.
pub struct Builds {
    builds: Mutex<HashMap<String, Arc<Build>>>,
    links: Mutex<HashMap<String, Link>>,
    dir: PathBuf,
}

impl Builds {
    /// Builds keeping uploaded files under `dir` (`e2b.build_dir`; empty = the system's
    /// temporary directory's `opendsec-e2b-builds`).
    pub fn new(dir: &str) -> Builds {
        let dir = if dir.is_empty() {
            std::env::temp_dir().join("opendsec-e2b-builds")
        } else {
            PathBuf::from(dir)
        };
        Builds {
            builds: Mutex::default(),
            links: Mutex::default(),
            dir,
        }
    }

    fn all(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Build>>> {
        self.builds.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Build `id` of `template`, if it is `owner`'s.
    fn get(&self, template: &str, id: &str, owner: &[u8; 32]) -> Option<Arc<Build>> {
        self.all()
            .get(id)
            .filter(|b| b.template == template && &b.owner == owner)
            .cloned()
    }

    /// The file uploaded for `hash` by `owner`.
    pub fn file(&self, owner: &[u8; 32], hash: &str) -> PathBuf {
        self.dir.join(hex::encode(&owner[..16])).join(hash)
    }

    /// Registers `b`. Errors: 429 when its owner runs [`MAX_RUNNING`] builds already.
    fn add(&self, b: Build) -> Result<Arc<Build>, ApiError> {
        let mut all = self.all();
        all.retain(|_, b| {
            b.lock()
                .finished_at
                .is_none_or(|t| t.elapsed() < KEEP_FINISHED)
        });
        let running = all
            .values()
            .filter(|x| x.owner == b.owner && x.running())
            .count();
        if running >= MAX_RUNNING {
            let mut e = ApiError::new(
                429,
                format!("{running} template builds of this caller are not finished yet; at most {MAX_RUNNING} at once"),
            );
            e.retry = true;
            return Err(e);
        }
        if all.len() >= MAX_BUILDS {
            return Err(ApiError::new(
                503,
                format!("this gateway follows {MAX_BUILDS} template builds already"),
            ));
        }
        let b = Arc::new(b);
        all.insert(b.id.clone(), b.clone());
        Ok(b)
    }
}

/// Who owns what a caller builds and uploads: a digest of its token.
pub(super) fn owner_of(caller: &Caller) -> [u8; 32] {
    Sha256::digest(caller.token.as_bytes()).into()
}

/// A random build id in UUID form (E2B's SDKs parse build ids of tags as UUIDs).
fn new_build_id() -> String {
    let mut b: [u8; 16] = rand::random();
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h = hex::encode(b);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// A template name `name[:tag]` as E2B's SDKs send it: the template id and the tag
/// (`default` when none). Errors: 400 for a name holding `/` (a project is the caller's
/// own here) or one that makes no image name in `project`.
pub fn template_name(project: &str, name: &str) -> Result<(String, String), ApiError> {
    if name.contains('/') {
        return Err(ApiError::bad_request(format!(
            "template name {}: templates are made in the caller's project ({project}); give the name alone",
            shown(name)
        )));
    }
    let (base, tag) = match name.split_once(':') {
        Some((b, t)) => (b, t),
        None => (name, DEFAULT_TAG),
    };
    image_name(project, base, tag)?;
    Ok((base.to_string(), tag.to_string()))
}

/// The image of template `name` at `tag` in `project`. Errors: 400 when it is no image name.
pub fn image_name(project: &str, name: &str, tag: &str) -> Result<String, ApiError> {
    let full = format!("{project}/{name}:{tag}");
    ImageRef::parse(&full).map_err(|f| {
        ApiError::bad_request(format!("template name {}: {}", shown(name), f.message))
    })?;
    Ok(full)
}

/// Keys of a build request; any other is refused.
const REQUEST_KEYS: &[&str] = &["name", "alias", "tags", "cpuCount", "memoryMB", "teamID"];

/// `POST /v3/templates` (and `/v2/templates`): a build of the template the body names, run
/// once its steps come; 202 with E2B's `TemplateRequestResponseV3`. Errors: 400 for a
/// malformed body, a name that makes no image name, `minFreeDiskMb` (not honoured); 429
/// when the caller runs [`MAX_RUNNING`] builds.
pub async fn request_build(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let m = object(&body)?;
    only(&m, REQUEST_KEYS, "template build")?;
    let name = match field(&m, "name").or_else(|| field(&m, "alias")) {
        Some(Value::String(n)) if !n.is_empty() => n.clone(),
        _ => return Err(ApiError::bad_request("name must be given, a string")),
    };
    let (template, tag) = template_name(&caller.project, &name)?;
    if g.has_template(&template) {
        return Err(ApiError::bad_request(format!(
            "template name {}: a template of this cluster's config has it, which              Sandbox.create would start instead; choose another",
            shown(&template)
        )));
    }
    let mut tags = vec![tag];
    if let Some(v) = field(&m, "tags") {
        let list = v
            .as_array()
            .ok_or_else(|| ApiError::bad_request("tags must be a list of strings"))?;
        for t in list {
            let t = t
                .as_str()
                .ok_or_else(|| ApiError::bad_request("tags must be a list of strings"))?;
            image_name(&caller.project, &template, t)?;
            if !tags.iter().any(|x| x == t) {
                tags.push(t.to_string());
            }
        }
    }
    let count = |key: &str| -> Result<Option<i64>, ApiError> {
        field(&m, key)
            .map(|v| {
                v.as_i64().filter(|n| *n >= 1).ok_or_else(|| {
                    ApiError::bad_request(format!("{key} must be a whole number ≥ 1"))
                })
            })
            .transpose()
    };
    let cpu = count("cpuCount")?.map(|c| c as f64);
    let memory_mb = count("memoryMB")?;
    let images = tags
        .iter()
        .map(|t| image_name(&caller.project, &template, t))
        .collect::<Result<Vec<_>, _>>()?;
    let b = g.builds.add(Build {
        id: new_build_id(),
        template: template.clone(),
        images,
        cpu,
        memory_mb,
        owner: owner_of(&caller),
        asked: Instant::now(),
        progress: Mutex::new(Progress {
            status: Status::Waiting,
            entries: Vec::new(),
            reason: None,
            started: false,
            finished_at: None,
        }),
    })?;
    tracing::info!(build = %b.id, template = %template, "template build requested");
    Ok((
        StatusCode::ACCEPTED,
        axum::Json(json!({
            "templateID": template,
            "buildID": b.id,
            "public": false,
            "names": [name],
            "tags": tags,
            "aliases": [template],
        })),
    )
        .into_response())
}

/// Whether `h` is a files hash as E2B's SDKs make them (64 lowercase hex digits).
fn is_hash(h: &str) -> bool {
    h.len() == 64
        && h.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// `GET /templates/{id}/files/{hash}`: whether the caller's file of that hash is here
/// already, and else a link to upload it to (a `PUT` this gateway takes without an API key,
/// for an hour); 201 with E2B's `TemplateBuildFileUpload`. Errors: 400 for a hash that is
/// no hash, 404 when the caller has no build of that template.
pub async fn file_link(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    UrlPath((template, hash)): UrlPath<(String, String)>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    if !is_hash(&hash) {
        return Err(ApiError::bad_request(format!(
            "files hash {}: 64 lowercase hex digits",
            shown(&hash)
        )));
    }
    let owner = owner_of(&caller);
    let known = g
        .builds
        .all()
        .values()
        .any(|b| b.template == template && b.owner == owner);
    if !known {
        return Err(ApiError::new(
            404,
            format!("template {} has no build of this caller", shown(&template)),
        ));
    }
    let path = g.builds.file(&owner, &hash);
    let present = tokio::fs::metadata(&path).await.is_ok_and(|m| m.is_file());
    let mut body = json!({"present": present});
    if !present {
        let cap = hex::encode(rand::random::<[u8; 24]>());
        {
            let mut links = g.builds.links.lock().unwrap_or_else(|p| p.into_inner());
            links.retain(|_, l| l.until > Instant::now());
            links.insert(
                cap.clone(),
                Link {
                    hash: hash.clone(),
                    owner,
                    until: Instant::now() + LINK_FOR,
                },
            );
        }
        let host = super::header_text(&headers, "host");
        let host = if host.is_empty() { "localhost" } else { host };
        let url = format!(
            "{}://{host}/templates/{}/files/{hash}?upload={cap}",
            g.scheme, template
        );
        if let Some(o) = body.as_object_mut() {
            o.insert("url".into(), url.into());
        }
    }
    Ok((StatusCode::CREATED, axum::Json(body)).into_response())
}

/// `PUT /templates/{id}/files/{hash}?upload=<link>`: the file of a `COPY` step (a tar,
/// gzip-compressed or not), kept for the caller whose link it is. The link is the
/// authority: no API key comes with it. Errors: 403 for a link that is not one (or expired,
/// or for another hash), 413 over [`MAX_UPLOAD`], 400 for a body that breaks off.
pub async fn upload(
    State(g): State<Arc<Gateway>>,
    UrlPath((_template, hash)): UrlPath<(String, String)>,
    RawQuery(raw): RawQuery,
    body: Body,
) -> Result<Response, ApiError> {
    let cap = raw
        .as_deref()
        .unwrap_or_default()
        .split('&')
        .find_map(|p| p.strip_prefix("upload="))
        .unwrap_or_default()
        .to_string();
    let owner = {
        let links = g.builds.links.lock().unwrap_or_else(|p| p.into_inner());
        match links.get(&cap) {
            Some(l) if l.hash == hash && l.until > Instant::now() => l.owner,
            _ => {
                return Err(ApiError::new(
                    403,
                    "this upload link is not one of this gateway's, or it expired",
                ))
            }
        }
    };
    let dest = g.builds.file(&owner, &hash);
    let dir = dest
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| g.builds.dir.clone());
    let fail = |what: &str, e: std::io::Error| {
        ApiError::new(
            500,
            format!("keeping the upload ({what} {}): {e}", dir.display()),
        )
    };
    tokio::fs::create_dir_all(&dir)
        .await
        .map_err(|e| fail("making", e))?;
    forget_old_files(&g.builds.dir).await;
    let tmp = dir.join(format!(
        ".{hash}.{}",
        hex::encode(rand::random::<[u8; 6]>())
    ));
    let mut f = tokio::fs::File::create(&tmp)
        .await
        .map_err(|e| fail("writing in", e))?;
    let mut stream = body.into_data_stream();
    let mut total: u64 = 0;
    let r: Result<(), ApiError> = async {
        while let Some(chunk) = stream.next().await {
            let chunk =
                chunk.map_err(|e| ApiError::bad_request(format!("the upload broke off: {e}")))?;
            total += chunk.len() as u64;
            if total > MAX_UPLOAD {
                return Err(ApiError::new(
                    413,
                    format!("an upload of one COPY step is at most {MAX_UPLOAD} bytes"),
                ));
            }
            f.write_all(&chunk)
                .await
                .map_err(|e| fail("writing in", e))?;
        }
        f.flush().await.map_err(|e| fail("writing in", e))?;
        tokio::fs::rename(&tmp, &dest)
            .await
            .map_err(|e| fail("writing in", e))
    }
    .await;
    if r.is_err() {
        let _ = tokio::fs::remove_file(&tmp).await;
    }
    r?;
    g.builds
        .links
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .remove(&cap);
    tracing::info!(hash = %hash, bytes = total, "template build file uploaded");
    Ok(StatusCode::OK.into_response())
}

/// Removes uploaded files older than [`KEEP_FILES`] (at most once an hour: it walks the
/// directory).
async fn forget_old_files(dir: &Path) {
    static LAST: Mutex<Option<Instant>> = Mutex::new(None);
    {
        let mut last = LAST.lock().unwrap_or_else(|p| p.into_inner());
        if last.is_some_and(|t| t.elapsed() < Duration::from_secs(3600)) {
            return;
        }
        *last = Some(Instant::now());
    }
    let dir = dir.to_path_buf();
    let _ = tokio::task::spawn_blocking(move || {
        let Ok(owners) = std::fs::read_dir(&dir) else {
            return;
        };
        for o in owners.flatten() {
            let Ok(files) = std::fs::read_dir(o.path()) else {
                continue;
            };
            for f in files.flatten() {
                let old = f
                    .metadata()
                    .and_then(|m| m.modified())
                    .ok()
                    .and_then(|t| t.elapsed().ok())
                    .is_some_and(|age| age > KEEP_FILES);
                if old {
                    let _ = std::fs::remove_file(f.path());
                }
            }
        }
    })
    .await;
}

/// `POST /v2/templates/{id}/builds/{build}`: the template's steps (E2B's
/// `TemplateBuildStartV2`); the build runs in the background; 202. Errors: 400 for steps
/// this gateway cannot run (naming the step and why), 404 for a build that is not the
/// caller's, 409 for one started already.
pub async fn start_build(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    UrlPath((template, id)): UrlPath<(String, String)>,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    let b = g
        .builds
        .get(&template, &id, &owner_of(&caller))
        .ok_or_else(|| not_found(&template, &id))?;
    let spec = match object(&body).and_then(|m| parse_spec(&m)) {
        Ok(s) => s,
        Err(e) => {
            // A build whose steps were refused is over: it holds none of its caller's places.
            if b.status() == Status::Waiting {
                b.finish(Err((e.message.clone(), None)));
            }
            return Err(e);
        }
    };
    {
        let mut p = b.lock();
        if p.started {
            return Err(ApiError::new(
                409,
                format!("build {} was started already", shown(&id)),
            ));
        }
        p.started = true;
        p.status = Status::Building;
    }
    b.log(Level::Info, "Build started", None);
    tracing::info!(build = %b.id, template = %template, steps = spec.steps.len(), "template build started");
    tokio::spawn(build::run(g.clone(), caller, b, spec));
    Ok(StatusCode::ACCEPTED.into_response())
}

fn not_found(template: &str, id: &str) -> ApiError {
    ApiError::new(
        404,
        format!(
            "build {} of template {} not found (builds are followed by the gateway that took them)",
            shown(id),
            shown(template)
        ),
    )
}

/// The keys of a template's build body; any other is refused.
const SPEC_KEYS: &[&str] = &[
    "fromImage",
    "fromTemplate",
    "fromImageRegistry",
    "force",
    "steps",
    "startCmd",
    "readyCmd",
];

/// The template of a build body. Errors: 400 naming what cannot be done: a private
/// registry, both or neither base, a step type other than RUN, COPY, ENV, WORKDIR and
/// USER, or arguments that do not fit the type.
pub fn parse_spec(m: &Map<String, Value>) -> Result<TemplateSpec, ApiError> {
    only(m, SPEC_KEYS, "template")?;
    if field(m, "fromImageRegistry").is_some() {
        return Err(ApiError::bad_request(
            "fromImageRegistry: registry credentials are not supported by this gateway; import \
             the image into the cluster's store (opendsec ctl image import) and build from it",
        ));
    }
    let text = |key: &str| -> Result<Option<String>, ApiError> {
        match field(m, key) {
            None => Ok(None),
            Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
            Some(Value::String(_)) => Ok(None),
            Some(_) => Err(ApiError::bad_request(format!("{key} must be a string"))),
        }
    };
    let base = match (text("fromImage")?, text("fromTemplate")?) {
        (Some(i), None) => build::Base::Image(i),
        (None, Some(t)) => build::Base::Template(t),
        _ => {
            return Err(ApiError::bad_request(
                "exactly one of fromImage and fromTemplate must be given",
            ))
        }
    };
    let mut steps = Vec::new();
    let list = match field(m, "steps") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(_) => return Err(ApiError::bad_request("steps must be a list")),
    };
    for (i, s) in list.iter().enumerate() {
        steps.push(parse_step(i + 1, s)?);
    }
    Ok(TemplateSpec {
        base,
        steps,
        start_cmd: text("startCmd")?.unwrap_or_default(),
        ready_cmd: text("readyCmd")?.unwrap_or_default(),
    })
}

/// Step `n` (1-based). Errors: 400 naming it.
fn parse_step(n: usize, v: &Value) -> Result<Step, ApiError> {
    let bad = |why: String| ApiError::bad_request(format!("steps[{}]: {why}", n - 1));
    let o = v
        .as_object()
        .ok_or_else(|| bad("a step is an object".into()))?;
    let kind = o
        .get("type")
        .and_then(Value::as_str)
        .ok_or_else(|| bad("type must be a string".into()))?;
    let args: Vec<String> = match o.get("args") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| x.as_str().map(String::from))
            .collect::<Option<_>>()
            .ok_or_else(|| bad("args must be strings".into()))?,
        Some(_) => return Err(bad("args must be a list of strings".into())),
    };
    let arg = |i: usize| args.get(i).cloned().unwrap_or_default();
    let step = match kind {
        "RUN" => {
            if arg(0).is_empty() || args.len() > 2 {
                return Err(bad("RUN takes a command and, optionally, a user".into()));
            }
            Step::Run {
                cmd: arg(0),
                user: arg(1),
            }
        }
        "COPY" => {
            let hash = o
                .get("filesHash")
                .and_then(Value::as_str)
                .unwrap_or_default();
            if !is_hash(hash) {
                return Err(bad("COPY needs the filesHash of its uploaded files".into()));
            }
            if arg(0).is_empty() || arg(1).is_empty() || args.len() > 4 {
                return Err(bad(
                    "COPY takes a source, a destination, a user and a mode".into()
                ));
            }
            let mode = arg(3);
            if !mode.is_empty()
                && (mode.len() > 4 || !mode.bytes().all(|b| (b'0'..=b'7').contains(&b)))
            {
                return Err(bad(format!(
                    "COPY mode {} is not an octal mode",
                    shown(&mode)
                )));
            }
            Step::Copy {
                src: arg(0),
                dest: arg(1),
                user: arg(2),
                mode,
                hash: hash.to_string(),
            }
        }
        "ENV" => {
            if args.is_empty() || !args.len().is_multiple_of(2) {
                return Err(bad("ENV takes names and values, in pairs".into()));
            }
            let mut pairs = Vec::new();
            for kv in args.chunks(2) {
                let [k, v] = kv else { continue };
                let (k, v) = (k.clone(), v.clone());
                if k.is_empty() || k.contains('=') || k.contains('\0') || v.contains('\0') {
                    return Err(bad(format!("ENV {} is not a variable name", shown(&k))));
                }
                pairs.push((k, v));
            }
            Step::Env(pairs)
        }
        "WORKDIR" => {
            if arg(0).is_empty() || args.len() != 1 {
                return Err(bad("WORKDIR takes one path".into()));
            }
            Step::Workdir(arg(0))
        }
        "USER" => {
            let u = arg(0);
            let ok = !u.is_empty()
                && u.len() <= 32
                && !u.starts_with('-')
                && u.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
            if !ok || args.len() > 2 {
                return Err(bad(format!("USER {} is not a user name", shown(&u))));
            }
            if args.get(1).is_some_and(|s| s == "true") {
                return Err(bad(
                    "USER with sudo rights is not supported by this gateway".into(),
                ));
            }
            Step::User(u)
        }
        other => {
            return Err(bad(format!(
            "step type {} is not supported by this gateway (RUN, COPY, ENV, WORKDIR and USER are)",
            shown(other)
        )))
        }
    };
    Ok(step)
}

/// `GET /templates/{id}/builds/{build}/status?logsOffset=N&limit=M`: where the build is and
/// its log entries from `logsOffset` on (at most `limit`, 100); 200 with E2B's
/// `TemplateBuildInfo`. Errors: 404 for a build that is not the caller's, 400 for a bad
/// offset or limit.
pub async fn build_status(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    UrlPath((template, id)): UrlPath<(String, String)>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    let b = g
        .builds
        .get(&template, &id, &owner_of(&caller))
        .ok_or_else(|| not_found(&template, &id))?;
    let (mut offset, mut limit) = (0usize, MAX_LIMIT);
    for pair in raw
        .as_deref()
        .unwrap_or_default()
        .split('&')
        .filter(|p| !p.is_empty())
    {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let n = || {
            v.parse::<usize>()
                .map_err(|_| ApiError::bad_request(format!("{k} must be a whole number ≥ 0")))
        };
        match k {
            "logsOffset" => offset = n()?,
            "limit" => limit = n()?.min(MAX_LIMIT),
            _ => {}
        }
    }
    let p = b.lock();
    let entries: Vec<Value> = p.entries.iter().skip(offset).take(limit).cloned().collect();
    let mut body = json!({
        "templateID": b.template,
        "buildID": b.id,
        "status": p.status.as_str(),
        "logs": [],
        "logEntries": entries,
    });
    if let (Some(r), Some(o)) = (&p.reason, body.as_object_mut()) {
        o.insert("reason".into(), r.clone());
    }
    Ok(axum::Json(body).into_response())
}

/// `GET /templates/aliases/{name}`: whether a template of that name exists for the caller
/// (`Template.exists`): 200 `{templateID, public}`, 404 when not; 403 for one of a project
/// the caller may not use.
pub async fn alias(
    State(g): State<Arc<Gateway>>,
    caller: Caller,
    UrlPath(name): UrlPath<String>,
) -> Result<Response, ApiError> {
    if g.has_template(&name) {
        return Ok(axum::Json(json!({"templateID": name, "public": true})).into_response());
    }
    let (template, tag) = template_name(&caller.project, &name)?;
    let image = image_name(&caller.project, &template, &tag)?;
    g.api()
        .get_image(g.req(&caller, pb::ImageRef { name: image }))
        .await?;
    Ok(axum::Json(json!({"templateID": template, "public": false})).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_ids_are_uuids_of_version_4() {
        let id = new_build_id();
        let parts: Vec<&str> = id.split('-').collect();
        assert_eq!(
            parts.iter().map(|p| p.len()).collect::<Vec<_>>(),
            [8, 4, 4, 4, 12]
        );
        assert!(parts[2].starts_with('4'), "{id}");
        assert!("89ab".contains(&parts[3][..1]), "{id}");
        assert_ne!(new_build_id(), id);
    }

    #[test]
    fn names_are_the_callers_images_with_the_default_tag() {
        assert_eq!(
            template_name("root", "my-tpl").unwrap(),
            ("my-tpl".into(), "default".into())
        );
        assert_eq!(
            template_name("root", "my-tpl:v2").unwrap(),
            ("my-tpl".into(), "v2".into())
        );
        for bad in ["team/x", "UPPER", "a b", ":v1", "x:"] {
            assert_eq!(template_name("root", bad).unwrap_err().status, 400, "{bad}");
        }
    }

    fn step(v: Value) -> Result<Step, ApiError> {
        parse_step(1, &v)
    }

    #[test]
    fn every_step_type_is_read_and_anything_else_refused_by_name() {
        let h = "a".repeat(64);
        assert!(matches!(
            step(json!({"type": "RUN", "args": ["echo hi", "root"], "force": false})),
            Ok(Step::Run { ref cmd, ref user }) if cmd == "echo hi" && user == "root"
        ));
        assert!(matches!(
            step(json!({"type": "COPY", "args": ["a", "/b", "", "0755"], "filesHash": h})),
            Ok(Step::Copy { ref mode, .. }) if mode == "0755"
        ));
        assert!(matches!(
            step(json!({"type": "ENV", "args": ["A", "1", "B", "2"]})),
            Ok(Step::Env(ref p)) if p.len() == 2
        ));
        assert!(matches!(
            step(json!({"type": "WORKDIR", "args": ["/app"]})),
            Ok(Step::Workdir(_))
        ));
        assert!(matches!(
            step(json!({"type": "USER", "args": ["user"]})),
            Ok(Step::User(_))
        ));
        for (bad, says) in [
            (
                json!({"type": "ARG", "args": ["x"]}),
                "step type \"ARG\" is not supported",
            ),
            (
                json!({"type": "COPY", "args": ["a", "/b", "", ""]}),
                "filesHash",
            ),
            (
                json!({"type": "COPY", "args": ["a", "/b", "", "9"], "filesHash": h}),
                "octal",
            ),
            (json!({"type": "ENV", "args": ["A"]}), "in pairs"),
            (json!({"type": "USER", "args": ["a b"]}), "not a user name"),
            (json!({"type": "USER", "args": ["u", "true"]}), "sudo"),
            (json!({"type": "RUN", "args": []}), "RUN takes"),
            (json!({"type": "RUN", "args": [1]}), "args must be strings"),
        ] {
            let e = step(bad).unwrap_err();
            assert_eq!(e.status, 400);
            assert!(e.message.contains(says), "{}", e.message);
        }
    }

    #[test]
    fn a_template_has_one_base_and_no_registry_credentials() {
        let m = |v: Value| v.as_object().cloned().unwrap();
        assert!(parse_spec(&m(
            json!({"fromTemplate": "base", "steps": [], "force": false})
        ))
        .is_ok());
        for (bad, says) in [
            (json!({"steps": []}), "exactly one"),
            (
                json!({"fromImage": "a", "fromTemplate": "b"}),
                "exactly one",
            ),
            (
                json!({"fromImage": "a", "fromImageRegistry": {"type": "registry"}}),
                "fromImageRegistry",
            ),
            (json!({"fromImage": "a", "surprise": 1}), "surprise"),
        ] {
            let e = parse_spec(&m(bad)).unwrap_err();
            assert!(e.message.contains(says), "{}", e.message);
        }
    }
}
