//! envd's `process.Process` service (docs/e2b.md "The in-sandbox API"): commands and
//! terminals, each call one call of the apiserver's runtime API with the caller's token.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::{IntoResponse, Response};

use super::connect::{self, Code, Codec, ConnectError, Envelopes};
use super::envd::EnvdCall;
use super::ids::ENV_PREFIX;
use super::Gateway;
use crate::pb;
use crate::pb::envd::process as e2b;

/// How long the environment variables a sandbox was created with are kept (the gateway's
/// only cache: docs/e2b.md "How E2B's ideas map onto ours").
const ENV_TTL: Duration = Duration::from_secs(60);
/// Entries past which the cache drops what has expired.
const ENV_CACHE_MAX: usize = 4096;

/// Environment variables, shared by the calls that use them.
type Env = Arc<HashMap<String, String>>;

/// The creation environment of sandboxes, by sandbox id, for one minute.
#[derive(Default)]
pub struct EnvCache(std::sync::Mutex<HashMap<String, (Instant, Env)>>);

impl EnvCache {
    fn get(&self, id: &str) -> Option<Env> {
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        m.get(id)
            .filter(|(at, _)| at.elapsed() < ENV_TTL)
            .map(|(_, env)| env.clone())
    }

    fn put(&self, id: &str, env: Env) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if m.len() >= ENV_CACHE_MAX {
            m.retain(|_, (at, _)| at.elapsed() < ENV_TTL);
        }
        m.insert(id.to_string(), (Instant::now(), env));
    }
}

/// The `envVars` the sandbox was created with (its `e2b.env.*` labels).
/// Errors: the apiserver's, for a sandbox the caller cannot see.
async fn creation_env(g: &Gateway, call: &EnvdCall) -> Result<Env, ConnectError> {
    if let Some(env) = g.envs.get(&call.sandbox_id) {
        return Ok(env);
    }
    let sb = g
        .api()
        .get_sandbox(g.req(
            &call.caller,
            pb::SandboxRef {
                id: call.sandbox_id.clone(),
            },
        ))
        .await?
        .into_inner();
    let env: HashMap<String, String> = sb
        .spec
        .map(|s| s.labels)
        .unwrap_or_default()
        .into_iter()
        .filter_map(|(k, v)| k.strip_prefix(ENV_PREFIX).map(|k| (k.to_string(), v)))
        .collect();
    let env = Arc::new(env);
    g.envs.put(&call.sandbox_id, env.clone());
    Ok(env)
}

/// `POST /process.Process/{method}`: Start and Connect stream, StreamInput reads a stream,
/// the others are unary. Errors travel as the Connect protocol says: in the stream's end
/// envelope for streams, as an HTTP status for unary calls.
pub async fn call(
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
    let fail = |e: ConnectError| connect::failed(codec, stream, e);
    let call = match envd {
        Ok(c) => c,
        Err(e) => return fail(super::envd::refuse_after_body(e, body).await),
    };
    let streaming = matches!(method.as_str(), "Start" | "Connect" | "StreamInput");
    if streaming != stream {
        // The envelope framing follows the content type: a stream's body read as a unary
        // message (or the reverse) would be read wrong, so it is refused by name.
        return fail(ConnectError::new(
            Code::InvalidArgument,
            format!(
                "process.Process/{} is {}: send it as application/{}",
                crate::types::names::shown(&method),
                if streaming {
                    "a streaming method"
                } else {
                    "a unary method"
                },
                if streaming {
                    "connect+json (or connect+proto)"
                } else {
                    "json (or proto)"
                },
            ),
        ));
    }
    match method.as_str() {
        "Start" => start(g, call, codec, &headers, body).await,
        "Connect" => connect_to(g, call, codec, &headers, body).await,
        "StreamInput" => stream_input(g, call, codec, body).await,
        "List" => {
            let r = async {
                connect::request::<e2b::ListRequest>(codec, stream, body).await?;
                list(&g, &call).await
            }
            .await;
            connect::unary(codec, call.checked(&g, r).await)
        }
        "SendInput" => {
            let r = async {
                let req: e2b::SendInputRequest = connect::request(codec, stream, body).await?;
                send_input(&g, &call, req.process, req.input).await?;
                Ok(e2b::SendInputResponse {})
            }
            .await;
            connect::unary(codec, call.checked(&g, r).await)
        }
        "SendSignal" => {
            let r = async {
                let req: e2b::SendSignalRequest = connect::request(codec, stream, body).await?;
                let signal = match e2b::Signal::try_from(req.signal) {
                    Ok(e2b::Signal::Sigkill) => 9,
                    Ok(e2b::Signal::Sigterm) => 15,
                    _ => {
                        return Err(ConnectError::new(
                            Code::InvalidArgument,
                            "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM",
                        ))
                    }
                };
                let req = pb::SignalProcessRequest {
                    sandbox_id: call.sandbox_id.clone(),
                    process: Some(selector(&call, req.process)?),
                    signal,
                };
                g.api().signal_process(g.req(&call.caller, req)).await?;
                Ok(e2b::SendSignalResponse {})
            }
            .await;
            connect::unary(codec, call.checked(&g, r).await)
        }
        "CloseStdin" => {
            let r = async {
                let req: e2b::CloseStdinRequest = connect::request(codec, stream, body).await?;
                let p = selector(&call, req.process)?;
                g.api().close_process_input(g.req(&call.caller, p)).await?;
                Ok(e2b::CloseStdinResponse {})
            }
            .await;
            connect::unary(codec, call.checked(&g, r).await)
        }
        "Update" => {
            let r = async {
                let req: e2b::UpdateRequest = connect::request(codec, stream, body).await?;
                let size = req.pty.and_then(|p| p.size).ok_or_else(|| {
                    ConnectError::new(Code::InvalidArgument, "pty.size is required")
                })?;
                let req = pb::ResizePtyRequest {
                    sandbox_id: call.sandbox_id.clone(),
                    process: Some(selector(&call, req.process)?),
                    cols: size.cols,
                    rows: size.rows,
                };
                g.api().resize_process_pty(g.req(&call.caller, req)).await?;
                Ok(e2b::UpdateResponse {})
            }
            .await;
            connect::unary(codec, call.checked(&g, r).await)
        }
        other => fail(ConnectError::new(
            Code::Unimplemented,
            format!(
                "process.Process/{} is not a method of this service",
                crate::types::names::shown(other)
            ),
        )),
    }
}

/// E2B's process selector as ours. Errors: `invalid_argument` without one.
fn selector(
    call: &EnvdCall,
    s: Option<e2b::ProcessSelector>,
) -> Result<pb::ProcessRef, ConnectError> {
    let mut r = pb::ProcessRef {
        sandbox_id: call.sandbox_id.clone(),
        ..Default::default()
    };
    match s.and_then(|s| s.selector) {
        Some(e2b::process_selector::Selector::Pid(p)) => r.pid = p,
        Some(e2b::process_selector::Selector::Tag(t)) => r.tag = t,
        None => {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                "process: a pid or a tag is required",
            ))
        }
    }
    Ok(r)
}

async fn list(g: &Gateway, call: &EnvdCall) -> Result<e2b::ListResponse, ConnectError> {
    let req = pb::ListProcessesRequest {
        sandbox_id: call.sandbox_id.clone(),
    };
    let r = g
        .api()
        .list_processes(g.req(&call.caller, req))
        .await?
        .into_inner();
    // The creation's envVars went into every Start here; envd keeps them apart and lists
    // what the Start itself gave, so they are taken out again (a command's own value for
    // one of them stays).
    let defaults = creation_env(g, call).await?;
    let processes = r
        .processes
        .into_iter()
        .map(|p| e2b::ProcessInfo {
            config: Some(e2b::ProcessConfig {
                cmd: p.cmd,
                args: p.args,
                envs: p
                    .env
                    .into_iter()
                    .filter(|(k, v)| defaults.get(k) != Some(v))
                    .collect(),
                cwd: (!p.cwd.is_empty()).then_some(p.cwd),
            }),
            pid: p.pid,
            tag: (!p.tag.is_empty()).then_some(p.tag),
        })
        .collect();
    Ok(e2b::ListResponse { processes })
}

async fn send_input(
    g: &Gateway,
    call: &EnvdCall,
    process: Option<e2b::ProcessSelector>,
    input: Option<e2b::ProcessInput>,
) -> Result<(), ConnectError> {
    let (data, pty) = match input.and_then(|i| i.input) {
        Some(e2b::process_input::Input::Stdin(d)) => (d, false),
        Some(e2b::process_input::Input::Pty(d)) => (d, true),
        None => {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                "input is required",
            ))
        }
    };
    let req = pb::ProcessInputRequest {
        sandbox_id: call.sandbox_id.clone(),
        process: Some(selector(call, process)?),
        data,
        pty,
    };
    g.api().send_process_input(g.req(&call.caller, req)).await?;
    Ok(())
}

/// `Start`: runs a command (or a terminal, with `pty`) and streams its events. At the call's
/// deadline (`connect-timeout-ms`, the SDK's command timeout) the process is killed and the
/// stream ends with `deadline_exceeded`, so a timed-out command is gone, not left running.
async fn start(
    g: Arc<Gateway>,
    call: EnvdCall,
    codec: Codec,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    let r = async {
        let req: e2b::StartRequest = connect::request(codec, true, body).await?;
        let p = req.process.unwrap_or_default();
        if p.cmd.is_empty() {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                "process.cmd is required",
            ));
        }
        let mut env: HashMap<String, String> = (*creation_env(&g, &call).await?).clone();
        env.extend(p.envs);
        let size = req.pty.as_ref().and_then(|p| p.size);
        let sreq = pb::StartProcessRequest {
            sandbox_id: call.sandbox_id.clone(),
            cmd: p.cmd,
            args: p.args,
            env,
            cwd: p.cwd.unwrap_or_default(),
            user: call.user.clone(),
            tag: req.tag.unwrap_or_default(),
            stdin: req.stdin.unwrap_or(true),
            pty: req.pty.is_some(),
            pty_cols: size.map_or(80, |s| s.cols),
            pty_rows: size.map_or(24, |s| s.rows),
            request_id: String::new(),
        };
        Ok(g.api()
            .start_process(g.req(&call.caller, sreq))
            .await?
            .into_inner())
    }
    .await;
    match r {
        Ok(events) => relay(g, call, codec, headers, events, true, |event| {
            e2b::StartResponse { event: Some(event) }
        }),
        Err(e) => connect::stream_error(codec, call.explain(&g, e).await),
    }
}

/// `Connect`: follows a running process's output from now on.
async fn connect_to(
    g: Arc<Gateway>,
    call: EnvdCall,
    codec: Codec,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    let r = async {
        let req: e2b::ConnectRequest = connect::request(codec, true, body).await?;
        let creq = pb::ConnectProcessRequest {
            sandbox_id: call.sandbox_id.clone(),
            process: Some(selector(&call, req.process)?),
            live: true,
            ..Default::default()
        };
        Ok(g.api()
            .connect_process(g.req(&call.caller, creq))
            .await?
            .into_inner())
    }
    .await;
    match r {
        Ok(events) => relay(g, call, codec, headers, events, false, |event| {
            e2b::ConnectResponse { event: Some(event) }
        }),
        Err(e) => connect::stream_error(codec, call.explain(&g, e).await),
    }
}

/// One of our process events as E2B's; `None` for one E2B has no word for.
fn event_of(e: pb::ProcessEvent) -> Option<e2b::ProcessEvent> {
    use e2b::process_event::{
        data_event::Output, DataEvent, EndEvent, Event, KeepAlive, StartEvent,
    };
    use pb::process_event::Kind;
    let data = |o| Event::Data(DataEvent { output: Some(o) });
    let event = match e.kind? {
        Kind::StartPid(pid) => Event::Start(StartEvent { pid }),
        Kind::Stdout(b) => data(Output::Stdout(b)),
        Kind::Stderr(b) => data(Output::Stderr(b)),
        Kind::Pty(b) => data(Output::Pty(b)),
        Kind::Keepalive(_) => Event::Keepalive(KeepAlive {}),
        Kind::End(end) => Event::End(EndEvent {
            exit_code: end.exit_code,
            exited: end.exited,
            status: end.status,
            error: (!end.error.is_empty()).then_some(end.error),
        }),
    };
    Some(e2b::ProcessEvent { event: Some(event) })
}

/// Streams `events` to the caller, each wrapped by `wrap`, with a keepalive event whenever
/// the stream was silent for the `Keepalive-Ping-Interval`, and ends it at the call's
/// deadline (killing the process first when `kill_at_deadline`).
fn relay<T, F>(
    g: Arc<Gateway>,
    call: EnvdCall,
    codec: Codec,
    headers: &HeaderMap,
    mut events: tonic::Streaming<pb::ProcessEvent>,
    kill_at_deadline: bool,
    wrap: F,
) -> Response
where
    T: connect::Msg,
    F: Fn(e2b::ProcessEvent) -> T + Send + 'static,
{
    let deadline = connect::timeout(headers).map(|t| tokio::time::Instant::now() + t);
    let every = connect::keepalive(headers);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, ConnectError>>(64);
    tokio::spawn(async move {
        let mut pid = 0u32;
        loop {
            let far = tokio::time::Instant::now() + Duration::from_secs(86400 * 365);
            let next = tokio::select! {
                m = events.message() => m,
                _ = tokio::time::sleep(every) => {
                    let ka = e2b::ProcessEvent {
                        event: Some(e2b::process_event::Event::Keepalive(
                            e2b::process_event::KeepAlive {},
                        )),
                    };
                    if tx.send(Ok(connect::encode(codec, &wrap(ka)))).await.is_err() {
                        return;
                    }
                    continue;
                }
                _ = tokio::time::sleep_until(deadline.unwrap_or(far)) => {
                    if kill_at_deadline && pid > 0 {
                        let req = pb::SignalProcessRequest {
                            sandbox_id: call.sandbox_id.clone(),
                            process: Some(pb::ProcessRef {
                                sandbox_id: call.sandbox_id.clone(),
                                pid,
                                ..Default::default()
                            }),
                            signal: 9,
                        };
                        if let Err(e) = g.api().signal_process(g.req(&call.caller, req)).await {
                            tracing::debug!(pid, error = %e.message(), "killing a timed-out command");
                        }
                    }
                    let _ = tx
                        .send(Err(ConnectError::new(
                            Code::DeadlineExceeded,
                            "the command's timeout passed; it was killed",
                        )))
                        .await;
                    return;
                }
            };
            match next {
                Ok(Some(e)) => {
                    if let Some(pb::process_event::Kind::StartPid(p)) = &e.kind {
                        pid = *p;
                    }
                    let Some(ev) = event_of(e) else { continue };
                    if tx
                        .send(Ok(connect::encode(codec, &wrap(ev))))
                        .await
                        .is_err()
                    {
                        return;
                    }
                }
                Ok(None) => return,
                Err(s) => {
                    let _ = tx.send(Err(ConnectError::from(s))).await;
                    return;
                }
            }
        }
    });
    let out = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) });
    connect::server_stream(codec, out)
}

/// `StreamInput`: a client stream of input, its first message naming the process. The
/// answer comes as a stream of one empty message (or the error).
async fn stream_input(g: Arc<Gateway>, call: EnvdCall, codec: Codec, body: Body) -> Response {
    let r = async {
        let mut env = Envelopes::new(body);
        let mut process: Option<e2b::ProcessSelector> = None;
        while let Some(bytes) = env.next().await? {
            let msg: e2b::StreamInputRequest = connect::decode(codec, &bytes)?;
            use e2b::stream_input_request::Event;
            match msg.event {
                Some(Event::Start(s)) => process = s.process,
                Some(Event::Data(d)) => {
                    let p = process.clone().ok_or_else(|| {
                        ConnectError::new(Code::InvalidArgument, "input before the start event")
                    })?;
                    send_input(&g, &call, Some(p), d.input).await?;
                }
                Some(Event::Keepalive(_)) | None => {}
            }
        }
        Ok(connect::encode(codec, &e2b::StreamInputResponse {}))
    }
    .await;
    connect::server_stream(codec, futures::stream::once(async move { r }))
}
