//! A sandbox's directory watches as aether serves them: at most [`MAX_WATCHES`] at once,
//! streamed or kept, and the kept ones' events until a caller takes them (docs/python-sdk.md
//! "Watching a directory"). The E2B gateway keeps no state, so the watchers its polling SDK
//! makes live here.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt};
use tokio::sync::{mpsc, OnceCell};
use tokio_stream::wrappers::ReceiverStream;

use super::hub::{cost, Held, Hub, Sink, WatchId, STREAM_QUEUE};
use super::{Options, WatchError};
use crate::guest::lock;
use crate::pb;
use crate::types::{Failure, Reason};

/// Most watches a sandbox has at once, streams and kept watchers together.
pub const MAX_WATCHES: usize = 64;

/// A kept watcher whose events nobody took for this long ends: its caller is gone (E2B's
/// sync SDK leaves its watchers behind when a program ends without `stop()`), and it held
/// one of the [`MAX_WATCHES`] places.
pub const KEPT_IDLE: Duration = Duration::from_secs(600);

struct Kept {
    held: Arc<Mutex<Held>>,
    taken_at: Instant,
    /// Ends the watch when dropped.
    _handle: Handle,
}

#[derive(Default)]
struct State {
    open: usize,
    kept: HashMap<String, Kept>,
}

/// The sandbox's watches. Cheap to clone.
#[derive(Clone, Default)]
pub struct Watchers {
    hub: Arc<OnceCell<Arc<Hub>>>,
    state: Arc<Mutex<State>>,
}

/// A watch and its place among the [`MAX_WATCHES`]: dropping it ends the watch and gives
/// the place back.
struct Handle {
    hub: Arc<Hub>,
    id: WatchId,
    state: Arc<Mutex<State>>,
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.hub.remove(self.id);
        let mut s = lock(&self.state);
        s.open = s.open.saturating_sub(1);
    }
}

impl Watchers {
    pub fn new() -> Watchers {
        Watchers::default()
    }

    /// The sandbox's inotify instance, made at the first watch.
    async fn hub(&self) -> Result<Arc<Hub>, Failure> {
        self.hub
            .get_or_try_init(|| async { Hub::start() })
            .await
            .cloned()
            .map_err(|e| e.failure())
    }

    /// Sets a watch on `root` (absolute) sending to `sink`. Errors: `quota_exceeded` at
    /// [`MAX_WATCHES`]; those of [`Hub::add`] ([`WatchError::failure`]).
    async fn open(&self, root: PathBuf, opts: Options, sink: Sink) -> Result<Handle, Failure> {
        self.expire();
        {
            let mut s = lock(&self.state);
            if s.open >= MAX_WATCHES {
                return Err(Failure::new(
                    Reason::QuotaExceeded,
                    format!(
                        "the sandbox has {MAX_WATCHES} directory watches, its most; stop one first"
                    ),
                ));
            }
            s.open += 1;
        }
        let hub = match self.hub().await {
            Ok(h) => h,
            Err(f) => {
                lock(&self.state).open -= 1;
                return Err(f);
            }
        };
        match hub.add(root, opts, sink).await {
            Ok(id) => Ok(Handle {
                hub,
                id,
                state: self.state.clone(),
            }),
            Err(e) => {
                lock(&self.state).open -= 1;
                Err(e.failure())
            }
        }
    }

    /// A stream of `root`'s events, the watch in place when this returns: first a `start`
    /// event (no name), so that a caller knows when changes begin to count, then the
    /// changes. It ends when the directory is gone, with an `unavailable` error when events
    /// were lost (the kernel's queue overflowed, or the reader fell [`STREAM_QUEUE`] events
    /// behind), and the watch ends when the stream is dropped. Errors: those of
    /// [`Watchers::open`].
    pub async fn stream(
        &self,
        root: PathBuf,
        opts: Options,
    ) -> Result<impl Stream<Item = Result<pb::FileEvent, Failure>> + Send + 'static, Failure> {
        let (tx, rx) = mpsc::channel(STREAM_QUEUE);
        let lost = Arc::new(AtomicBool::new(false));
        let queued = Arc::new(AtomicUsize::new(0));
        let handle = self
            .open(
                root,
                opts,
                Sink::Stream {
                    tx,
                    lost: lost.clone(),
                    queued: queued.clone(),
                },
            )
            .await?;
        let start = pb::FileEvent {
            r#type: "start".to_string(),
            ..Default::default()
        };
        let end = futures::stream::once(async move {
            lost.load(Ordering::Acquire)
                .then(|| Err(WatchError::Overflow.failure()))
        })
        .filter_map(futures::future::ready);
        Ok(futures::stream::once(async { Ok(start) })
            .chain(ReceiverStream::new(rx).map(move |e| {
                queued.fetch_sub(cost(&e), Ordering::AcqRel);
                Ok(e)
            }))
            .chain(end)
            .map(move |item| {
                // The watch lives as long as its stream.
                let _held = &handle;
                item
            }))
    }

    /// A kept watcher on `root`; returns its id. Its events wait for [`Watchers::take`];
    /// when the directory is gone it stays, with no new events, until removed. Errors:
    /// those of [`Watchers::open`].
    pub async fn create(&self, root: PathBuf, opts: Options) -> Result<String, Failure> {
        let held = Arc::new(Mutex::new(Held::default()));
        let handle = self.open(root, opts, Sink::Kept(held.clone())).await?;
        let id = hex::encode(rand::random::<[u8; 8]>());
        lock(&self.state).kept.insert(
            id.clone(),
            Kept {
                held,
                taken_at: Instant::now(),
                _handle: handle,
            },
        );
        Ok(id)
    }

    /// Ends the kept watchers nobody read for [`KEPT_IDLE`].
    fn expire(&self) {
        let gone: Vec<Kept> = {
            let mut s = lock(&self.state);
            let ids: Vec<String> = s
                .kept
                .iter()
                .filter(|(_, k)| k.taken_at.elapsed() >= KEPT_IDLE)
                .map(|(id, _)| id.clone())
                .collect();
            ids.iter().filter_map(|id| s.kept.remove(id)).collect()
        };
        // Dropped outside the lock: each handle takes it to give its place back.
        drop(gone);
    }

    /// The events of watcher `id` since the last take, and how many were dropped since.
    /// Errors: `not_found` for an unknown id (or one not read for [`KEPT_IDLE`]).
    pub fn take(&self, id: &str) -> Result<pb::WatcherEvents, Failure> {
        self.expire();
        let held = {
            let mut s = lock(&self.state);
            let k = s.kept.get_mut(id).ok_or_else(|| unknown(id))?;
            k.taken_at = Instant::now();
            k.held.clone()
        };
        let mut h = lock(&held);
        h.bytes = 0;
        Ok(pb::WatcherEvents {
            events: std::mem::take(&mut h.events).into(),
            dropped: std::mem::take(&mut h.dropped),
        })
    }

    /// Ends watcher `id`. Errors: `not_found` for an unknown id.
    pub fn remove(&self, id: &str) -> Result<(), Failure> {
        let kept = lock(&self.state)
            .kept
            .remove(id)
            .ok_or_else(|| unknown(id))?;
        // Dropped outside the lock: the handle takes it to give its place back.
        drop(kept);
        Ok(())
    }

    /// How many directories the sandbox's watches cover (inotify marks).
    pub fn marks(&self) -> usize {
        self.hub.get().map_or(0, |h| h.marks())
    }
}

fn unknown(id: &str) -> Failure {
    Failure::not_found(format!(
        "watcher {} does not exist (removed, unread for {} s, or the sandbox restarted)",
        crate::types::names::shown(id),
        KEPT_IDLE.as_secs()
    ))
}
