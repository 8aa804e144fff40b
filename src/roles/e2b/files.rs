//! envd's files (docs/e2b.md "The in-sandbox API"): `GET /files` (download) and `POST /files`
//! (multipart upload), and the `filesystem.Filesystem` service's Stat, ListDir, MakeDir,
//! Move and Remove, over the apiserver's file calls with the caller's token. Files of any size go in
//! [`CHUNK`]-sized calls.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, RawQuery, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::StreamExt;

use super::connect::{self, Code, ConnectError};
use super::envd::EnvdCall;
use super::ids;
use super::Gateway;
use crate::pb;
use crate::pb::envd::filesystem as fs;

/// Bytes per file call of the apiserver (its limit is 64 MB; smaller keeps memory low).
pub const CHUNK: usize = 8 << 20;
/// Deepest `ListDir` served, and most entries one answer holds.
const MAX_DEPTH: u32 = 16;
const MAX_ENTRIES: usize = 100_000;
/// Most bytes of paths and names one `ListDir` answer holds.
const MAX_LIST_BYTES: usize = 32 << 20;

/// An error of envd's plain HTTP API: `{"code": <status>, "message": ...}` (E2B's SDKs map
/// 400, 401, 404, 429, 502 and 507 to their exceptions).
struct HttpError(StatusCode, String);

impl IntoResponse for HttpError {
    fn into_response(self) -> Response {
        let body = serde_json::json!({"code": self.0.as_u16(), "message": self.1});
        (self.0, axum::Json(body)).into_response()
    }
}

impl From<ConnectError> for HttpError {
    /// The Connect code's HTTP status, except `unavailable`: 502, as E2B's proxy answers
    /// for a sandbox it cannot reach (the SDKs read its message then).
    fn from(e: ConnectError) -> HttpError {
        let status = match e.code {
            Code::Unavailable => StatusCode::BAD_GATEWAY,
            c => c.http_status(),
        };
        HttpError(status, e.message)
    }
}

/// `r`, except that a 404, 409 or 412 for a sandbox that turns out to be gone becomes
/// E2B's 502 "was not found" (as [`EnvdCall::explain`] for the Connect calls).
async fn explained(
    g: &Gateway,
    probe: Option<(String, String)>,
    r: Result<Response, HttpError>,
) -> Response {
    match (r, probe) {
        (Ok(resp), _) => resp,
        (Err(e), Some((id, token)))
            if matches!(
                e.0,
                StatusCode::NOT_FOUND | StatusCode::CONFLICT | StatusCode::PRECONDITION_FAILED
            ) && matches!(super::envd::sandbox_gone(g, &token, &id).await, Ok(true)) =>
        {
            HttpError::from(super::envd::not_found_error(&id)).into_response()
        }
        (Err(e), _) => e.into_response(),
    }
}

/// What [`explained`] needs of a call: the sandbox and the caller's token.
fn probe_of(call: &Result<EnvdCall, ConnectError>) -> Option<(String, String)> {
    call.as_ref()
        .ok()
        .map(|c| (c.sandbox_id.clone(), c.caller.token.clone()))
}

impl From<tonic::Status> for HttpError {
    fn from(s: tonic::Status) -> HttpError {
        HttpError::from(ConnectError::from(s))
    }
}

/// The query of `/files`: `path` and `username` (a signature was checked by
/// [`EnvdCall`]'s extraction).
fn files_query(raw: Option<&str>) -> Result<(String, String), HttpError> {
    let (mut path, mut user) = (String::new(), String::new());
    for pair in raw.unwrap_or_default().split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = ids::percent_decode(v).ok_or_else(|| {
            HttpError(
                StatusCode::BAD_REQUEST,
                format!("query parameter {k} is not well encoded"),
            )
        })?;
        match k {
            "path" => path = v,
            "username" => user = v,
            _ => {}
        }
    }
    Ok((path, user))
}

/// `GET /files?path=P[&username=U]`: the file's bytes, read as `U` (the sandbox's default
/// user without one). Errors: 404 when missing, 400 for a directory or a user the sandbox
/// does not have, 401 without the token, 403 for a file the user may not read.
pub async fn download(
    State(g): State<Arc<Gateway>>,
    call: Result<EnvdCall, ConnectError>,
    RawQuery(raw): RawQuery,
) -> Response {
    let probe = probe_of(&call);
    let r = async {
        let mut call = call?;
        let (path, user) = files_query(raw.as_deref())?;
        call.set_user(user)?;
        if path.is_empty() {
            return Err(HttpError(
                StatusCode::BAD_REQUEST,
                "path is required".into(),
            ));
        }
        // The first chunk now, so a missing file is a 404 rather than a broken body.
        let first = read_chunk(&g, &call, &path, 0).await?;
        let (g, done) = (g.clone(), first.len() < CHUNK);
        let rest = futures::stream::unfold(
            (g, call, path, first.len() as i64, done),
            |(g, call, path, off, done)| async move {
                if done {
                    return None;
                }
                match read_chunk(&g, &call, &path, off).await {
                    Ok(b) if b.is_empty() => None,
                    Ok(b) => {
                        let n = b.len();
                        Some((
                            Ok(Bytes::from(b)),
                            (g, call, path, off + n as i64, n < CHUNK),
                        ))
                    }
                    Err(e) => Some((Err(std::io::Error::other(e.1)), (g, call, path, off, true))),
                }
            },
        );
        let body = futures::stream::once(async move { Ok(Bytes::from(first)) }).chain(rest);
        let mut resp = Response::new(Body::from_stream(body));
        resp.headers_mut().insert(
            header::CONTENT_TYPE,
            header::HeaderValue::from_static("application/octet-stream"),
        );
        Ok(resp)
    }
    .await;
    explained(&g, probe, r).await
}

async fn read_chunk(
    g: &Gateway,
    call: &EnvdCall,
    path: &str,
    offset: i64,
) -> Result<Vec<u8>, HttpError> {
    let req = pb::ReadFileRequest {
        sandbox_id: call.sandbox_id.clone(),
        path: path.to_string(),
        offset,
        length: CHUNK as i64,
        session: call.session(),
        user: call.user.clone(),
    };
    Ok(g.api()
        .read_file(g.req(&call.caller, req))
        .await?
        .into_inner()
        .data)
}

/// `POST /files`: multipart (a part named `file` per file, its filename the destination
/// path, or `?path=` for a single one) or, as envd 0.5.7 takes it, the file itself as an
/// `application/octet-stream` body for `?path=`, gzip-compressed with
/// `Content-Encoding: gzip`. Writes each file, parents created, replacing what was there,
/// in [`CHUNK`]-sized calls as the body arrives, with the metadata of the `X-Metadata-*`
/// headers ([`upload_metadata`]). Answers the non-empty list
/// `[{"path", "name", "type": "file", "metadata"?}]`. Errors: 400 (no file, no path, a
/// path that is a directory, another user, a body that is not what its headers say,
/// metadata refused), 401, 404.
pub async fn upload(
    State(g): State<Arc<Gateway>>,
    call: Result<EnvdCall, ConnectError>,
    RawQuery(raw): RawQuery,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let probe = probe_of(&call);
    // A known caller's refused upload is read through below (see there).
    let known = match &call {
        Ok(_) => true,
        Err(e) => e.code != Code::Unauthenticated,
    };
    let body = SharedBody::new(body);
    let rest = body.clone();
    let r = async {
        let mut call = call?;
        let (query_path, user) = files_query(raw.as_deref())?;
        call.set_user(user)?;
        let ct = headers
            .get(header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        let meta = upload_metadata(&headers)?;
        let mut written = Vec::new();
        if ct.starts_with("application/octet-stream") {
            if query_path.is_empty() {
                return Err(HttpError(
                    StatusCode::BAD_REQUEST,
                    "an octet-stream upload needs ?path=".into(),
                ));
            }
            let raw = tokio_util::io::StreamReader::new(body);
            let at = match content_encoding(&headers)? {
                Encoding::Identity => write_from(&g, &call, &query_path, &meta, raw).await?,
                Encoding::Gzip => {
                    let mut gz = async_compression::tokio::bufread::GzipDecoder::new(raw);
                    gz.multiple_members(true);
                    write_from(&g, &call, &query_path, &meta, gz).await?
                }
            };
            written.push(written_entry(&at, &meta));
        } else if ct.starts_with("multipart/form-data") {
            let boundary = multer::parse_boundary(ct)
                .map_err(|e| HttpError(StatusCode::BAD_REQUEST, format!("multipart: {e}")))?;
            let mut parts = multer::Multipart::new(body, boundary);
            while let Some(part) = parts
                .next_field()
                .await
                .map_err(|e| HttpError(StatusCode::BAD_REQUEST, format!("multipart: {e}")))?
            {
                let path = match part.file_name() {
                    Some(f) if !f.is_empty() && query_path.is_empty() => f.to_string(),
                    _ if !query_path.is_empty() => query_path.clone(),
                    _ => {
                        return Err(HttpError(
                            StatusCode::BAD_REQUEST,
                            "a file part needs its destination as its filename, or ?path=".into(),
                        ))
                    }
                };
                let data = tokio_util::io::StreamReader::new(
                    part.map(|r| r.map_err(std::io::Error::other)),
                );
                let at = write_from(&g, &call, &path, &meta, data).await?;
                written.push(written_entry(&at, &meta));
            }
        } else {
            return Err(HttpError(
                StatusCode::BAD_REQUEST,
                "uploads are multipart/form-data or application/octet-stream".into(),
            ));
        }
        if written.is_empty() {
            return Err(HttpError(
                StatusCode::BAD_REQUEST,
                "no file in the upload".into(),
            ));
        }
        Ok(axum::Json(written).into_response())
    }
    .await;
    if r.is_err() && known {
        // A refusal before the body is read (a bad user, a path that is a directory) would
        // otherwise reach a client still sending it as a broken pipe instead of the answer.
        // Only an authenticated caller's body is read through: anyone else's is never held.
        rest.drain().await;
    }
    explained(&g, probe, r).await
}

/// Longest a refused upload's unread body is read through before the answer goes.
const DRAIN_FOR: std::time::Duration = std::time::Duration::from_secs(30);

type BodyStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static>>;

/// An upload's body ([`idle_bounded`]), shared between the reader that writes it and
/// [`SharedBody::drain`], which reads what a refused upload left.
#[derive(Clone)]
struct SharedBody(Arc<std::sync::Mutex<BodyStream>>);

impl SharedBody {
    fn new(body: Body) -> SharedBody {
        SharedBody(Arc::new(std::sync::Mutex::new(Box::pin(idle_bounded(
            body,
        )))))
    }

    /// Reads and drops the rest of the body, for at most [`DRAIN_FOR`].
    async fn drain(mut self) {
        let _ = tokio::time::timeout(DRAIN_FOR, async {
            while let Some(Ok(_)) = self.next().await {}
        })
        .await;
    }
}

impl futures::Stream for SharedBody {
    type Item = Result<Bytes, std::io::Error>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        // One reader at a time in practice (the writer, then the drain): never contended.
        let mut inner = self.0.lock().unwrap_or_else(|p| p.into_inner());
        inner.as_mut().poll_next(cx)
    }
}

/// How long an upload's body may send nothing before it is given up (envd's idle limit):
/// a stalled client does not hold its connection for ever.
const UPLOAD_IDLE: std::time::Duration = std::time::Duration::from_secs(60);

/// `body`'s bytes, ending with an error after [`UPLOAD_IDLE`] without any.
fn idle_bounded(
    body: Body,
) -> impl futures::Stream<Item = Result<Bytes, std::io::Error>> + Send + 'static {
    let data = body
        .into_data_stream()
        .map(|r| r.map_err(std::io::Error::other));
    tokio_stream::StreamExt::timeout(data, UPLOAD_IDLE).map(|r| {
        r.unwrap_or_else(|_| {
            Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("nothing came for {} s", UPLOAD_IDLE.as_secs()),
            ))
        })
    })
}

/// What an upload answers for each file: its metadata too when it has some.
fn written_entry(path: &str, meta: &Metadata) -> serde_json::Value {
    let name = path.rsplit('/').next().unwrap_or_default();
    let mut v = serde_json::json!({"path": path, "name": name, "type": "file"});
    if let (false, Some(o)) = (meta.is_empty(), v.as_object_mut()) {
        o.insert("metadata".into(), serde_json::json!(meta));
    }
    v
}

/// A file's metadata, by key.
type Metadata = std::collections::HashMap<String, String>;

/// The header prefix of a metadata key on an upload (envd 0.6.2).
const METADATA_HEADER: &str = "x-metadata-";

/// The metadata an upload gives its files: each `X-Metadata-<key>: <value>` header, the
/// key lower-cased (as header names are), the value printable ASCII. Every upload sets its
/// files' metadata to exactly this, so one without such headers clears it, as envd does.
/// The keys and sizes are checked by the agent before it writes (docs/python-sdk.md "File
/// metadata"). Errors: 400 for a value that is not printable ASCII, or a key sent twice.
fn upload_metadata(headers: &HeaderMap) -> Result<Metadata, HttpError> {
    let mut out = Metadata::new();
    for name in headers.keys() {
        let Some(key) = name.as_str().strip_prefix(METADATA_HEADER) else {
            continue;
        };
        let mut values = headers.get_all(name).iter();
        let (Some(v), None) = (values.next(), values.next()) else {
            return Err(HttpError(
                StatusCode::BAD_REQUEST,
                format!("metadata key {key} is sent more than once"),
            ));
        };
        let value = v
            .to_str()
            .ok()
            .filter(|v| v.bytes().all(|b| (0x20..0x7f).contains(&b)))
            .ok_or_else(|| {
                HttpError(
                    StatusCode::BAD_REQUEST,
                    format!("metadata value of {key} is not printable US-ASCII"),
                )
            })?;
        out.insert(key.to_string(), value.to_string());
    }
    Ok(out)
}

/// An upload body's `Content-Encoding`.
enum Encoding {
    Identity,
    Gzip,
}

/// The upload's `Content-Encoding`: none, `identity` or `gzip`. Errors: 400 for another
/// (or several).
fn content_encoding(headers: &HeaderMap) -> Result<Encoding, HttpError> {
    let mut all = headers.get_all(header::CONTENT_ENCODING).iter();
    match (all.next(), all.next()) {
        (None, _) => Ok(Encoding::Identity),
        (Some(v), None) => match v.to_str().map(|s| s.trim().to_ascii_lowercase()) {
            Ok(s) if s.is_empty() || s == "identity" => Ok(Encoding::Identity),
            Ok(s) if s == "gzip" || s == "x-gzip" => Ok(Encoding::Gzip),
            _ => Err(HttpError(
                StatusCode::BAD_REQUEST,
                format!(
                    "Content-Encoding {} is not taken (gzip is)",
                    crate::types::names::shown(&String::from_utf8_lossy(v.as_bytes()))
                ),
            )),
        },
        (Some(_), Some(_)) => Err(HttpError(
            StatusCode::BAD_REQUEST,
            "one Content-Encoding, gzip or none".into(),
        )),
    }
}

/// Writes what `data` reads to `path` in [`CHUNK`]-sized calls as it arrives (an empty
/// body makes an empty file), the first call setting the file's metadata to `meta`; the
/// file's absolute path, as the sandbox resolved `path` (relative to the working directory,
/// `~` the user's home). Errors: 400 for a body that breaks off or does not decode, or
/// metadata the agent refuses.
async fn write_from(
    g: &Gateway,
    call: &EnvdCall,
    path: &str,
    meta: &Metadata,
    data: impl tokio::io::AsyncRead,
) -> Result<String, HttpError> {
    use tokio::io::AsyncReadExt;
    let mut data = std::pin::pin!(data);
    let mut off: i64 = 0;
    let mut written = path.to_string();
    loop {
        let mut buf = Vec::with_capacity(CHUNK);
        (&mut data)
            .take(CHUNK as u64)
            .read_to_end(&mut buf)
            .await
            .map_err(|e| HttpError(StatusCode::BAD_REQUEST, format!("the upload's body: {e}")))?;
        let n = buf.len();
        if n == 0 && off > 0 {
            return Ok(written);
        }
        let at = write_chunk(g, call, path, off, meta, buf).await?;
        if off == 0 {
            written = at;
        }
        off += n as i64;
        if n < CHUNK {
            return Ok(written);
        }
    }
}

/// Writes `data` at `offset` (0 replaces the file, creating missing parents first, as
/// envd does, and sets its metadata to `meta`); the file's absolute path.
async fn write_chunk(
    g: &Gateway,
    call: &EnvdCall,
    path: &str,
    offset: i64,
    meta: &Metadata,
    data: Vec<u8>,
) -> Result<String, HttpError> {
    let req = pb::WriteFileRequest {
        sandbox_id: call.sandbox_id.clone(),
        path: path.to_string(),
        data,
        offset,
        set_metadata: offset == 0,
        metadata: if offset == 0 {
            meta.clone()
        } else {
            Metadata::new()
        },
        session: call.session(),
        user: call.user.clone(),
        ..Default::default()
    };
    match g.api().write_file(g.req(&call.caller, req.clone())).await {
        Ok(r) => return Ok(r.into_inner().path),
        Err(s) if offset == 0 && s.code() == tonic::Code::NotFound => {}
        Err(s) => return Err(s.into()),
    }
    let parent = match path.rsplit_once('/') {
        Some(("", _)) | None => {
            return Err(HttpError(
                StatusCode::NOT_FOUND,
                format!("{path}: not found"),
            ))
        }
        Some((p, _)) => p.to_string(),
    };
    let mk = pb::PathRequest {
        sandbox_id: call.sandbox_id.clone(),
        path: parent,
        session: call.session(),
        user: call.user.clone(),
    };
    match g.api().make_dir(g.req(&call.caller, mk)).await {
        Ok(_) => {}
        // Made meanwhile by another upload: fine.
        Err(s) if crate::rpc::failure_from_status(&s).reason == crate::types::Reason::Conflict => {}
        Err(s) => return Err(s.into()),
    }
    Ok(g.api()
        .write_file(g.req(&call.caller, req))
        .await?
        .into_inner()
        .path)
}

/// `-rw-r--r--` for a mode and a type.
fn permissions(mode: u32, kind: &str) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        "dir" => 'd',
        "symlink" => 'l',
        _ => '-',
    });
    for shift in [6u32, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// Our file record as E2B's entry.
pub(super) fn entry_of(f: pb::FileInfo) -> fs::EntryInfo {
    let kind = match f.r#type.as_str() {
        "file" => fs::FileType::File,
        "dir" => fs::FileType::Directory,
        "symlink" => fs::FileType::Symlink,
        _ => fs::FileType::Unspecified,
    };
    fs::EntryInfo {
        permissions: permissions(f.mode, &f.r#type),
        name: f.name,
        r#type: kind as i32,
        path: f.path,
        size: f.size,
        mode: f.mode & 0o7777,
        modified_time: Some(pbjson_types::Timestamp {
            seconds: f.mtime,
            nanos: 0,
        }),
        is_symlink: f.r#type == "symlink",
        owner: f.owner,
        group: f.group,
        symlink_target: (f.r#type == "symlink").then_some(f.symlink_target),
        metadata: f.metadata.into_iter().collect(),
    }
}

/// `POST /filesystem.Filesystem/{method}`: Stat, ListDir, MakeDir (`already_exists` when the
/// path exists, which the SDKs report as false), Move, Remove, and the watches
/// ([`super::watch`]); another method answers `unimplemented` naming it.
pub async fn filesystem(
    State(g): State<Arc<Gateway>>,
    Path(method): Path<String>,
    envd: Result<EnvdCall, ConnectError>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let (codec, stream) = match connect::codec_of(&headers) {
        Ok(c) => c,
        Err(e) => return e.into_response(),
    };
    let not_yet = |m: &str| {
        ConnectError::new(
            Code::Unimplemented,
            format!(
                "filesystem.Filesystem/{} is not served yet",
                crate::types::names::shown(m)
            ),
        )
    };
    let call = match envd {
        Ok(c) => c,
        Err(e) => {
            let e = super::envd::refuse_after_body(e, body).await;
            return connect::failed(codec, stream, e);
        }
    };
    match method.as_str() {
        "Stat" => {
            let r = async {
                let req: fs::StatRequest = connect::request(codec, stream, body).await?;
                let f = stat(&g, &call, &req.path).await?;
                Ok(fs::StatResponse { entry: Some(f) })
            }
            .await;
            connect::unary(codec, call.checked(&g, r).await)
        }
        "ListDir" => {
            let r = async {
                let req: fs::ListDirRequest = connect::request(codec, stream, body).await?;
                let depth = req.depth.max(1);
                if depth > MAX_DEPTH {
                    return Err(ConnectError::new(
                        Code::InvalidArgument,
                        format!("depth {depth} is over {MAX_DEPTH}"),
                    ));
                }
                let mut entries = Vec::new();
                list(&g, &call, &req.path, depth, &mut entries).await?;
                Ok(fs::ListDirResponse { entries })
            }
            .await;
            connect::unary(codec, call.checked(&g, r).await)
        }
        "MakeDir" => {
            let r = async {
                let req: fs::MakeDirRequest = connect::request(codec, stream, body).await?;
                let mk = pb::PathRequest {
                    sandbox_id: call.sandbox_id.clone(),
                    path: req.path,
                    session: call.session(),
                    user: call.user.clone(),
                };
                let f = g
                    .api()
                    .make_dir(g.req(&call.caller, mk))
                    .await
                    .map_err(|s| {
                        let e = ConnectError::from(s);
                        if e.code == Code::FailedPrecondition {
                            ConnectError::new(Code::AlreadyExists, e.message)
                        } else {
                            e
                        }
                    })?;
                Ok(fs::MakeDirResponse {
                    entry: Some(entry_of(f.into_inner())),
                })
            }
            .await;
            connect::unary(codec, call.checked(&g, r).await)
        }
        "Move" => {
            let r = async {
                let req: fs::MoveRequest = connect::request(codec, stream, body).await?;
                let mv = pb::MoveRequest {
                    sandbox_id: call.sandbox_id.clone(),
                    source: req.source,
                    destination: req.destination,
                    session: call.session(),
                    user: call.user.clone(),
                };
                let f = g.api().r#move(g.req(&call.caller, mv)).await?;
                Ok(fs::MoveResponse {
                    entry: Some(entry_of(f.into_inner())),
                })
            }
            .await;
            connect::unary(codec, call.checked(&g, r).await)
        }
        "Remove" => {
            let r = async {
                let req: fs::RemoveRequest = connect::request(codec, stream, body).await?;
                let rreq = pb::RemoveRequest {
                    sandbox_id: call.sandbox_id.clone(),
                    path: req.path,
                    recursive: true,
                    session: call.session(),
                    user: call.user.clone(),
                };
                match g.api().remove(g.req(&call.caller, rreq)).await {
                    Ok(_) => {}
                    // envd removes with RemoveAll: a path that is not there is removed
                    // already, unless it is the sandbox that is not there.
                    Err(s)
                        if s.code() == tonic::Code::NotFound
                            && matches!(
                                super::envd::sandbox_gone(&g, &call.caller.token, &call.sandbox_id)
                                    .await,
                                Ok(false)
                            ) => {}
                    Err(s) => return Err(s.into()),
                }
                Ok(fs::RemoveResponse {})
            }
            .await;
            connect::unary(codec, call.checked(&g, r).await)
        }
        "WatchDir" => super::watch::watch_dir(g, call, codec, &headers, body).await,
        "CreateWatcher" => super::watch::create(&g, &call, codec, body).await,
        "GetWatcherEvents" => super::watch::events(&g, &call, codec, body).await,
        "RemoveWatcher" => super::watch::remove(&g, &call, codec, body).await,
        other => connect::failed(codec, stream, not_yet(other)),
    }
}

async fn stat(g: &Gateway, call: &EnvdCall, path: &str) -> Result<fs::EntryInfo, ConnectError> {
    let req = pb::PathRequest {
        sandbox_id: call.sandbox_id.clone(),
        path: path.to_string(),
        session: call.session(),
        user: call.user.clone(),
    };
    Ok(entry_of(
        g.api().stat(g.req(&call.caller, req)).await?.into_inner(),
    ))
}

/// The entries under `path`, `depth` levels down (1 = the directory itself), breadth first.
async fn list(
    g: &Gateway,
    call: &EnvdCall,
    path: &str,
    depth: u32,
    out: &mut Vec<fs::EntryInfo>,
) -> Result<(), ConnectError> {
    let mut level = vec![path.to_string()];
    let mut bytes = 0usize;
    for d in 0..depth {
        let mut next = Vec::new();
        for dir in level {
            let req = pb::PathRequest {
                sandbox_id: call.sandbox_id.clone(),
                path: dir,
                session: call.session(),
                user: call.user.clone(),
            };
            let r = g
                .api()
                .list_dir(g.req(&call.caller, req))
                .await?
                .into_inner();
            for f in r.entries {
                if f.r#type == "dir" && d + 1 < depth {
                    next.push(f.path.clone());
                }
                // Names are what can be long (4 KiB paths): they bound the answer too.
                bytes += f.path.len() + f.name.len() + f.symlink_target.len();
                out.push(entry_of(f));
                if out.len() > MAX_ENTRIES || bytes > MAX_LIST_BYTES {
                    return Err(ConnectError::new(
                        Code::ResourceExhausted,
                        format!(
                            "more than {MAX_ENTRIES} entries or {MAX_LIST_BYTES} bytes of names; list less deep"
                        ),
                    ));
                }
            }
        }
        level = next;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permissions_read_like_ls() {
        assert_eq!(permissions(0o644, "file"), "-rw-r--r--");
        assert_eq!(permissions(0o755, "dir"), "drwxr-xr-x");
        assert_eq!(permissions(0o777, "symlink"), "lrwxrwxrwx");
    }

    #[test]
    fn the_files_query_takes_path_and_user_and_leaves_signatures_to_the_extractor() {
        assert_eq!(
            files_query(Some("path=%2Ftmp%2Fa%20b.txt&username=")).ok(),
            Some(("/tmp/a b.txt".to_string(), String::new()))
        );
        assert_eq!(
            files_query(Some(
                "path=/a&username=nobody&signature=v1_x&signature_expiration=9"
            ))
            .ok(),
            Some(("/a".to_string(), "nobody".to_string()))
        );
        assert!(files_query(Some("path=%zz")).is_err());
    }
}
