//! envd's directory watches (docs/e2b.md "The in-sandbox API"): `WatchDir`, the stream the
//! async Python and JS SDKs read, and `CreateWatcher`, `GetWatcherEvents` and
//! `RemoveWatcher`, which the sync Python SDK polls. The watches themselves are aether's,
//! in the sandbox; the gateway only translates, so it keeps nothing between calls.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::HeaderMap;
use axum::response::Response;
use tokio_stream::wrappers::ReceiverStream;

use super::connect::{self, Code, Codec, ConnectError};
use super::envd::EnvdCall;
use super::Gateway;
use crate::pb;
use crate::pb::envd::filesystem as fs;

/// Our watch request for E2B's fields.
fn request(
    call: &EnvdCall,
    path: String,
    recursive: bool,
    include_entry: bool,
    allow_network_mounts: bool,
) -> pb::WatchDirRequest {
    pb::WatchDirRequest {
        sandbox_id: call.sandbox_id.clone(),
        path,
        recursive,
        include_entry,
        allow_network_mounts,
        session: call.session(),
        user: call.user.clone(),
    }
}

/// One of our file events as E2B's; `None` for a type E2B has no word for (`start`,
/// which [`watch_dir`] turns into E2B's start event).
fn event_of(e: pb::FileEvent) -> Option<fs::FilesystemEvent> {
    let kind = match e.r#type.as_str() {
        "create" => fs::EventType::Create,
        "write" => fs::EventType::Write,
        "remove" => fs::EventType::Remove,
        "rename" => fs::EventType::Rename,
        "chmod" => fs::EventType::Chmod,
        _ => return None,
    };
    Some(fs::FilesystemEvent {
        name: e.name,
        r#type: kind as i32,
        entry: e.entry.map(super::files::entry_of),
    })
}

fn message(event: fs::watch_dir_response::Event) -> fs::WatchDirResponse {
    fs::WatchDirResponse { event: Some(event) }
}

/// `WatchDir`: E2B's `start` event for ours (the watch is in place), then the directory's events,
/// a `keepalive` whenever the stream was silent for the `Keepalive-Ping-Interval`, and at
/// the call's deadline (`connect-timeout-ms`, the SDK's watch timeout) the end with
/// `deadline_exceeded`. The watch ends when the caller hangs up.
pub async fn watch_dir(
    g: Arc<Gateway>,
    call: EnvdCall,
    codec: Codec,
    headers: &HeaderMap,
    body: Body,
) -> Response {
    let r = async {
        let req: fs::WatchDirRequest = connect::request(codec, true, body).await?;
        let w = request(
            &call,
            req.path,
            req.recursive,
            req.include_entry,
            req.allow_network_mounts,
        );
        Ok(g.api()
            .watch_dir(g.req(&call.caller, w))
            .await?
            .into_inner())
    }
    .await;
    let mut events = match r {
        Ok(s) => s,
        Err(e) => return connect::stream_error(codec, call.explain(&g, e).await),
    };
    let deadline = connect::timeout(headers).map(|t| tokio::time::Instant::now() + t);
    let every = connect::keepalive(headers);
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, ConnectError>>(64);
    use fs::watch_dir_response::{Event, KeepAlive, StartEvent};
    tokio::spawn(async move {
        let far = tokio::time::Instant::now() + Duration::from_secs(86400 * 365);
        loop {
            let out = tokio::select! {
                // The caller hung up: dropping `events` ends the watch in the sandbox now,
                // not at the next event.
                _ = tx.closed() => return,
                m = events.message() => match m {
                    Ok(Some(e)) if e.r#type == "start" => Ok(message(Event::Start(StartEvent {}))),
                    Ok(Some(e)) => match event_of(e) {
                        Some(ev) => Ok(message(Event::Filesystem(ev))),
                        None => continue,
                    },
                    Ok(None) => return,
                    Err(s) => Err(call.explain(&g, ConnectError::from(s)).await),
                },
                _ = tokio::time::sleep(every) => Ok(message(Event::Keepalive(KeepAlive {}))),
                _ = tokio::time::sleep_until(deadline.unwrap_or(far)) => Err(ConnectError::new(
                    Code::DeadlineExceeded,
                    "the watch's timeout passed",
                )),
            };
            let end = out.is_err();
            if tx
                .send(out.map(|m| connect::encode(codec, &m)))
                .await
                .is_err()
                || end
            {
                return;
            }
        }
    });
    connect::server_stream(codec, ReceiverStream::new(rx))
}

/// `CreateWatcher`: a watcher kept in the sandbox; its id goes back to the SDK.
pub async fn create(g: &Gateway, call: &EnvdCall, codec: Codec, body: Body) -> Response {
    let r = async {
        let req: fs::CreateWatcherRequest = connect::request(codec, false, body).await?;
        let w = request(
            call,
            req.path,
            req.recursive,
            req.include_entry,
            req.allow_network_mounts,
        );
        let r = g.api().create_watcher(g.req(&call.caller, w)).await?;
        Ok(fs::CreateWatcherResponse {
            watcher_id: r.into_inner().watcher_id,
        })
    }
    .await;
    connect::unary(codec, call.checked(g, r).await)
}

/// `GetWatcherEvents`: the watcher's events since the last call; `failed_precondition`
/// (the SDK's `SandboxException`) when some were lost for a full buffer, since E2B's
/// answer has no field for a gap.
pub async fn events(g: &Gateway, call: &EnvdCall, codec: Codec, body: Body) -> Response {
    let r = async {
        let req: fs::GetWatcherEventsRequest = connect::request(codec, false, body).await?;
        let w = pb::WatcherRef {
            sandbox_id: call.sandbox_id.clone(),
            watcher_id: req.watcher_id,
        };
        let got = g
            .api()
            .get_watcher_events(g.req(&call.caller, w))
            .await?
            .into_inner();
        // E2B's answer has no word for a gap, and events missed without a word would
        // mislead: the watcher says so instead (it goes on, with its later events).
        if got.dropped > 0 {
            return Err(ConnectError::new(
                Code::FailedPrecondition,
                format!(
                    "{} events or more were lost: more came than the watcher holds between two reads; read more often, or watch again",
                    got.dropped
                ),
            ));
        }
        Ok(fs::GetWatcherEventsResponse {
            events: got.events.into_iter().filter_map(event_of).collect(),
        })
    }
    .await;
    connect::unary(codec, call.checked(g, r).await)
}

/// `RemoveWatcher`: ends the watcher.
pub async fn remove(g: &Gateway, call: &EnvdCall, codec: Codec, body: Body) -> Response {
    let r = async {
        let req: fs::RemoveWatcherRequest = connect::request(codec, false, body).await?;
        let w = pb::WatcherRef {
            sandbox_id: call.sandbox_id.clone(),
            watcher_id: req.watcher_id,
        };
        g.api().remove_watcher(g.req(&call.caller, w)).await?;
        Ok(fs::RemoveWatcherResponse {})
    }
    .await;
    connect::unary(codec, call.checked(g, r).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_event_type_maps_and_unknown_ones_are_skipped() {
        for (ours, theirs) in [
            ("create", fs::EventType::Create),
            ("write", fs::EventType::Write),
            ("remove", fs::EventType::Remove),
            ("rename", fs::EventType::Rename),
            ("chmod", fs::EventType::Chmod),
        ] {
            let e = event_of(pb::FileEvent {
                name: "a/b".into(),
                r#type: ours.into(),
                entry: None,
            })
            .expect(ours);
            assert_eq!((e.name.as_str(), e.r#type), ("a/b", theirs as i32));
            assert!(e.entry.is_none());
        }
        let e = pb::FileEvent {
            name: "x".into(),
            r#type: "open".into(),
            entry: None,
        };
        assert!(event_of(e).is_none());
    }
}
