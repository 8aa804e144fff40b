//! The sandbox's one inotify instance and the watches it feeds. A directory two watches
//! cover is one inotify mark, counted; each watch names the events relative to its own
//! root. One task reads the instance and hands each event to every watch that covers its
//! directory, keeping the watches' trees in step with directories made, moved and removed.

use std::collections::{HashMap, VecDeque};
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, InotifyEvent, WatchDescriptor};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, oneshot};

use super::{check_root, kinds, walk, Options, WatchError, MASK, MAX_DIRS, MAX_MARKS};
use crate::guest::lock;
use crate::pb;

/// A watch's number within the hub.
pub type WatchId = u64;

/// Most events, and bytes of them, waiting for a stream's reader. A reader that falls this
/// far behind loses events, as it would to the kernel's own queue: its watch ends as
/// overflowed. The bytes bound aether's memory (the sandbox's) whatever the names' length.
pub const STREAM_QUEUE: usize = 4096;
pub const STREAM_BYTES: usize = 256 << 10;

/// Most events, and bytes of them, a kept watcher holds between two takes; later ones are
/// counted as dropped.
pub const MAX_HELD: usize = 4096;
pub const MAX_HELD_BYTES: usize = 256 << 10;

/// What an event costs a queue: its name and entry, and the rest as a round number.
pub fn cost(e: &pb::FileEvent) -> usize {
    64 + e.name.len()
        + e.entry
            .as_ref()
            .map_or(0, |f| 64 + f.name.len() + f.path.len())
}

/// A kept watcher's events.
#[derive(Default)]
pub struct Held {
    pub events: VecDeque<pb::FileEvent>,
    pub bytes: usize,
    pub dropped: i64,
}

/// Where a watch's events go.
pub enum Sink {
    /// A stream's queue; `lost` is set when the watch ended because events were lost.
    Stream {
        tx: mpsc::Sender<pb::FileEvent>,
        lost: Arc<AtomicBool>,
        /// Bytes queued ([`cost`]), which the reader's side takes off.
        queued: Arc<AtomicUsize>,
    },
    /// A kept watcher's events, taken by polling.
    Kept(Arc<Mutex<Held>>),
    /// A stream that ended (its directory gone, or events lost): nothing more goes out.
    Ended,
}

struct Watch {
    root: PathBuf,
    opts: Options,
    /// Each directory covered, relative to `root` (empty for `root` itself).
    dirs: HashMap<WatchDescriptor, PathBuf>,
    sink: Sink,
    /// Entries reported as made because a new directory held them when its mark came, by
    /// the read that reported them: the kernel may report the same making in this read
    /// or the next, which is then not reported twice.
    reported: HashMap<PathBuf, u64>,
}

impl Watch {
    fn send(&mut self, e: pb::FileEvent) {
        let size = cost(&e);
        let ended = match &self.sink {
            Sink::Stream { tx, lost, queued } => {
                if queued.load(Ordering::Acquire) + size > STREAM_BYTES {
                    lost.store(true, Ordering::Release);
                    true
                } else {
                    queued.fetch_add(size, Ordering::AcqRel);
                    match tx.try_send(e) {
                        Ok(()) => false,
                        Err(mpsc::error::TrySendError::Full(_)) => {
                            lost.store(true, Ordering::Release);
                            true
                        }
                        Err(mpsc::error::TrySendError::Closed(_)) => true,
                    }
                }
            }
            Sink::Kept(h) => {
                let mut h = lock(h);
                if h.events.len() < MAX_HELD && h.bytes + size <= MAX_HELD_BYTES {
                    h.bytes += size;
                    h.events.push_back(e);
                } else {
                    h.dropped += 1;
                }
                false
            }
            Sink::Ended => false,
        };
        if ended {
            self.sink = Sink::Ended;
        }
    }

    /// The kernel dropped events: a stream ends as overflowed, a kept watcher counts it
    /// and goes on (how many were lost is unknown).
    fn lost(&mut self) {
        match &self.sink {
            Sink::Stream { lost, .. } => {
                lost.store(true, Ordering::Release);
                self.sink = Sink::Ended;
            }
            Sink::Kept(h) => lock(h).dropped += 1,
            Sink::Ended => {}
        }
    }

    /// The watched directory is gone: a stream ends; a kept watcher stays, silent.
    fn end(&mut self) {
        if matches!(self.sink, Sink::Stream { .. }) {
            self.sink = Sink::Ended;
        }
    }
}

#[derive(Default)]
struct State {
    /// How many watches cover each mark.
    marks: HashMap<WatchDescriptor, usize>,
    watches: HashMap<WatchId, Watch>,
    next: WatchId,
    /// Reads dispatched so far.
    reads: u64,
    /// Watches being set up: a mark one of them added but has not counted yet may be one
    /// another watch just let go of, so no mark is removed while they run...
    setups: usize,
    /// ...and the marks let go of meanwhile wait here.
    deferred: Vec<WatchDescriptor>,
}

/// The inotify instance and its watches. Made on a tokio runtime, whose task reads it for
/// as long as aether runs.
pub struct Hub {
    ino: Arc<Inotify>,
    state: Arc<Mutex<State>>,
}

impl Hub {
    /// Makes the instance and starts reading it. Errors: `Limit` (the machine's inotify
    /// instances are used up), `Io`.
    pub fn start() -> Result<Arc<Hub>, WatchError> {
        let here = Path::new("/");
        let ino = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(|e| WatchError::io(here, e))?;
        // The runtime polls a second descriptor of the instance; reads go through `ino`.
        let dup = ino
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| WatchError::of_io(here, &e))?;
        let fd = crate::sys::spawn::register_async(dup).map_err(|e| WatchError::of_io(here, &e))?;
        let hub = Arc::new(Hub {
            ino: Arc::new(ino),
            state: Arc::default(),
        });
        tokio::spawn(read_loop(fd, hub.ino.clone(), hub.state.clone()));
        Ok(hub)
    }

    /// Sets a watch on `root` (absolute) sending to `sink`; returns its id once every mark
    /// is in place. The work runs on its own task, so a caller that stops waiting leaves no
    /// watch behind. Errors: those of [`check_root`], `TooManyDirs`, `TooManyMarks`,
    /// `Limit`, `Io`.
    pub async fn add(
        self: &Arc<Self>,
        root: PathBuf,
        opts: Options,
        sink: Sink,
    ) -> Result<WatchId, WatchError> {
        let hub = self.clone();
        let (tx, rx) = oneshot::channel();
        tokio::spawn(async move {
            let r = hub.add_now(root, opts, sink).await;
            if let Err(Ok(id)) = tx.send(r) {
                hub.remove(id);
            }
        });
        rx.await.map_err(|_| WatchError::Io {
            path: PathBuf::new(),
            source: nix::errno::Errno::ECANCELED,
        })?
    }

    async fn add_now(
        &self,
        root: PathBuf,
        opts: Options,
        sink: Sink,
    ) -> Result<WatchId, WatchError> {
        lock(&self.state).setups += 1;
        let ino = self.ino.clone();
        let r = root.clone();
        let o = opts.clone();
        let set = tokio::task::spawn_blocking(move || {
            let opts = o;
            check_root(&r, &opts)?;
            let wd = ino.add_watch(&r, MASK).map_err(|e| WatchError::io(&r, e))?;
            let mut dirs = HashMap::from([(wd, PathBuf::new())]);
            if !opts.recursive {
                return Ok((dirs, None));
            }
            let walked = walk(
                &ino,
                &r,
                Path::new(""),
                MAX_DIRS - 1,
                opts.access.as_deref(),
            );
            for (wd, rel) in walked.dirs {
                dirs.entry(wd).or_insert(rel);
            }
            Ok((dirs, walked.error))
        })
        .await
        .unwrap_or_else(|e| {
            Err(WatchError::Io {
                path: root.clone(),
                source: nix::errno::Errno::from_raw(if e.is_cancelled() {
                    libc::ECANCELED
                } else {
                    libc::EIO
                }),
            })
        });
        let mut st = lock(&self.state);
        st.setups -= 1;
        let r = match set {
            Err(e) => Err(e),
            Ok((dirs, walk_error)) => {
                let new = dirs.keys().filter(|wd| !st.marks.contains_key(wd)).count();
                let error = walk_error.or_else(|| {
                    (st.marks.len() + new > MAX_MARKS).then_some(WatchError::TooManyMarks)
                });
                match error {
                    Some(e) => {
                        // Marks no watch counts go back (deferred while others set up).
                        let unheld: Vec<_> = dirs
                            .keys()
                            .filter(|wd| !st.marks.contains_key(wd))
                            .copied()
                            .collect();
                        st.deferred.extend(unheld);
                        Err(e)
                    }
                    None => {
                        for wd in dirs.keys() {
                            *st.marks.entry(*wd).or_insert(0) += 1;
                        }
                        let id = st.next;
                        st.next += 1;
                        st.watches.insert(
                            id,
                            Watch {
                                root,
                                opts,
                                dirs,
                                sink,
                                reported: HashMap::new(),
                            },
                        );
                        Ok(id)
                    }
                }
            }
        };
        flush(&self.ino, &mut st);
        r
    }

    /// Ends watch `id`, letting go of its marks. Unknown ids are ignored.
    pub fn remove(&self, id: WatchId) {
        let mut st = lock(&self.state);
        let Some(w) = st.watches.remove(&id) else {
            return;
        };
        for wd in w.dirs.keys() {
            release(&self.ino, &mut st, *wd);
        }
    }

    /// How many marks the watches hold (for tests and metrics).
    pub fn marks(&self) -> usize {
        lock(&self.state).marks.len()
    }
}

/// One watch fewer covers `wd`; the last one removes the mark (later, while setups run).
fn release(ino: &Inotify, st: &mut State, wd: WatchDescriptor) {
    let Some(n) = st.marks.get_mut(&wd) else {
        return;
    };
    *n -= 1;
    if *n > 0 {
        return;
    }
    st.marks.remove(&wd);
    if st.setups > 0 {
        st.deferred.push(wd);
    } else {
        // The kernel may have removed it already (its directory was deleted).
        let _ = ino.rm_watch(wd);
    }
}

/// Removes the deferred marks no watch took up meanwhile, once no setup runs.
fn flush(ino: &Inotify, st: &mut State) {
    if st.setups > 0 {
        return;
    }
    for wd in std::mem::take(&mut st.deferred) {
        if !st.marks.contains_key(&wd) {
            let _ = ino.rm_watch(wd);
        }
    }
}

async fn read_loop(fd: AsyncFd<OwnedFd>, ino: Arc<Inotify>, state: Arc<Mutex<State>>) {
    loop {
        let mut guard = match fd.readable().await {
            Ok(g) => g,
            Err(e) => {
                tracing::error!(error = %e, "watch: the inotify instance cannot be polled; watches get no more events");
                return;
            }
        };
        match guard.try_io(|_| ino.read_events().map_err(std::io::Error::from)) {
            Ok(Ok(events)) => dispatch(&ino, &mut lock(&state), events),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "watch: reading the inotify instance");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(_would_block) => {}
        }
    }
}

/// Hands one read's `events` to the watches that cover their directories.
fn dispatch(ino: &Inotify, st: &mut State, events: Vec<InotifyEvent>) {
    st.reads += 1;
    let read = st.reads;
    for w in st.watches.values_mut() {
        w.reported.retain(|_, at| *at + 1 >= read);
    }
    // Directories moved away in this read, by watch and cookie, until their `IN_MOVED_TO`.
    let mut moved: HashMap<(WatchId, u32), PathBuf> = HashMap::new();
    for ev in events {
        if ev.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
            for w in st.watches.values_mut() {
                w.lost();
            }
            continue;
        }
        if ev.mask.contains(AddWatchFlags::IN_IGNORED) {
            // The kernel dropped the mark: its directory was deleted or unmounted (or we
            // removed it, and then no watch has it).
            st.marks.remove(&ev.wd);
            for w in st.watches.values_mut() {
                if let Some(rel) = w.dirs.remove(&ev.wd) {
                    if rel.as_os_str().is_empty() {
                        w.end();
                    }
                }
            }
            continue;
        }
        let ids: Vec<WatchId> = st
            .watches
            .iter()
            .filter(|(_, w)| w.dirs.contains_key(&ev.wd))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Some(mut w) = st.watches.remove(&id) {
                handle(ino, st, &mut w, id, &ev, &mut moved, read);
                st.watches.insert(id, w);
            }
        }
    }
    // Moved out of the tree, or to a name the next read reports (then watched anew).
    for ((id, _), from) in moved {
        if let Some(mut w) = st.watches.remove(&id) {
            let gone: Vec<WatchDescriptor> = w
                .dirs
                .iter()
                .filter(|(_, d)| d.starts_with(&from))
                .map(|(wd, _)| *wd)
                .collect();
            for wd in gone {
                w.dirs.remove(&wd);
                release(ino, st, wd);
            }
            st.watches.insert(id, w);
        }
    }
}

/// One inotify event for watch `w` (taken out of `st` meanwhile).
fn handle(
    ino: &Inotify,
    st: &mut State,
    w: &mut Watch,
    id: WatchId,
    ev: &InotifyEvent,
    moved: &mut HashMap<(WatchId, u32), PathBuf>,
    read: u64,
) {
    let Some(dir) = w.dirs.get(&ev.wd).cloned() else {
        return;
    };
    let rel = match &ev.name {
        Some(n) => dir.join(n),
        // A directory's own change: below the root its parent reports it already.
        None if dir.as_os_str().is_empty() => PathBuf::from("."),
        None => return,
    };
    // Reported already, from a new directory's contents: neither again, nor walked again.
    let made = AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO;
    let seen = ev.mask.intersects(made) && w.reported.remove(&rel).is_some();
    let mut found = Vec::new();
    if !seen && ev.name.is_some() && ev.mask.contains(AddWatchFlags::IN_ISDIR) && w.opts.recursive {
        if ev.mask.contains(AddWatchFlags::IN_MOVED_FROM) {
            moved.insert((id, ev.cookie), rel.clone());
        } else if ev.mask.contains(AddWatchFlags::IN_MOVED_TO) {
            match moved.remove(&(id, ev.cookie)) {
                // Renamed within the tree: the marks below keep their descriptors and
                // take the new names.
                Some(from) => {
                    for d in w.dirs.values_mut() {
                        if let Ok(rest) = d.strip_prefix(&from) {
                            *d = rel.join(rest);
                        }
                    }
                }
                None => add_dir(ino, st, w, &rel, None),
            }
        } else if ev.mask.contains(AddWatchFlags::IN_CREATE) {
            // What was made inside before its mark was in place is reported as made.
            add_dir(ino, st, w, &rel, Some(&mut found));
        }
    }
    for kind in kinds(ev.mask) {
        if seen && kind == "create" {
            continue;
        }
        let e = event(w, &rel, kind);
        w.send(e);
    }
    for p in found {
        let e = event(w, &p, "create");
        w.send(e);
        w.reported.insert(p, read);
    }
}

/// Covers the new directory `rel` of `w` and those below it, noting in `found` what they
/// held; past the limits that part stays uncovered (a watch cannot refuse a change after
/// the fact), which is logged.
fn add_dir(
    ino: &Inotify,
    st: &mut State,
    w: &mut Watch,
    rel: &Path,
    found: Option<&mut Vec<PathBuf>>,
) {
    let room = MAX_DIRS
        .saturating_sub(w.dirs.len())
        .min(MAX_MARKS.saturating_sub(st.marks.len()));
    if room == 0 {
        tracing::warn!(dir = %rel.display(), "watch: at its most directories; this one is not covered");
        return;
    }
    let path = w.root.join(rel);
    if let Some(a) = &w.opts.access {
        if !std::fs::symlink_metadata(&path).is_ok_and(|m| a.may_list(&m)) {
            return;
        }
    }
    let wd = match ino.add_watch(&path, MASK | AddWatchFlags::IN_DONT_FOLLOW) {
        Ok(wd) => wd,
        Err(e) => {
            tracing::debug!(dir = %rel.display(), error = %e, "watch: a new directory is not covered");
            return;
        }
    };
    hold(st, w, wd, rel.to_path_buf());
    let walked = walk(ino, &w.root, rel, room - 1, w.opts.access.as_deref());
    for (wd, r) in walked.dirs {
        hold(st, w, wd, r);
    }
    if let Some(f) = found {
        f.extend(walked.found);
    }
    if let Some(e) = walked.error {
        tracing::warn!(dir = %rel.display(), error = %e, "watch: part of a new directory is not covered");
    }
}

fn hold(st: &mut State, w: &mut Watch, wd: WatchDescriptor, rel: PathBuf) {
    if w.dirs.insert(wd, rel).is_none() {
        *st.marks.entry(wd).or_insert(0) += 1;
    }
}

/// The event `kind` for `rel`, with the entry's info when the watch includes entries and
/// the entry still exists.
fn event(w: &Watch, rel: &Path, kind: &str) -> pb::FileEvent {
    let entry = if w.opts.include_entry {
        let path = if rel == Path::new(".") {
            w.root.clone()
        } else {
            w.root.join(rel)
        };
        std::fs::symlink_metadata(&path)
            .ok()
            .map(|m| crate::guest::chronus::files::info(&path, &m))
    } else {
        None
    };
    pb::FileEvent {
        name: rel.to_string_lossy().into_owned(),
        r#type: kind.to_string(),
        entry,
    }
}
