//! Byte streams over one serial port (docs/microvm.md "The agent channel"): how the edge
//! reaches aether in a microVM where the VMM has no vsock (QEMU's virtio-serial port, which,
//! unlike vhost vsock, survives a snapshot and a restore).
//!
//! A virtio-serial port is one byte stream with no notion of connections, and the guest
//! cannot tell a host that went away (or a VM restored into a new VMM process) from one that
//! is slow. So both ends speak frames: `[kind u8][session u32 BE][len u32 BE][payload]`.
//! The host opens sessions (each is what a socket connection would be: tonic's HTTP/2
//! connection runs over one), both ends send data and end their half.
//!
//! Every host connection starts a generation: the host sends `RESET` with the magic and a
//! random nonce, the guest ends whatever sessions it still held (a restored copy holds its
//! source's), drops what it had queued for them, and echoes the `RESET`. The host reads
//! nothing before that echo, so bytes the guest wrote for an earlier connection (a write
//! blocked while no host was connected completes on the next one) never reach a new session.
//! A guest that finds a frame that is none of ours (a torn frame of a host that died
//! mid-write) scans for the next `RESET`; a host that does is done with the connection.
//!
//! Everything the guest sends is hostile: the host ignores `RESET` and `OPEN` from it,
//! frames of sessions it did not open, and kills a session whose reader falls behind
//! rather than stall the port for the others.
//!
//! [`Mux::host`] is the edge's end, [`Mux::guest`] aether's; both run over any
//! `AsyncRead + AsyncWrite` halves, so the tests run them over a socket pair.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, DuplexStream};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// The largest payload of one frame.
pub const MAX_PAYLOAD: usize = 64 << 10;
/// Sessions one end holds at most: a guest refuses an `OPEN` past it with `CLOSE`, a host's
/// [`Mux::open`] fails.
pub const MAX_SESSIONS: usize = 1024;
/// The first bytes of a `RESET`'s payload; the nonce follows.
pub const MAGIC: [u8; 8] = *b"ODSECMUX";
/// Bytes a session buffers each way in its duplex.
const SESSION_BUFFER: usize = 256 << 10;
/// Bytes queued toward one session's reader; past that the reader has fallen behind and the
/// session is ended. HTTP/2's flow control keeps a compliant peer's DATA within the runtime
/// connection's 16 MiB window; its other frames (headers, trailers, pings) are not flow
/// controlled, and hundreds of concurrent calls send hundreds of them, so the bound is in
/// bytes with room for those beside a full window, not in frames.
const SESSION_QUEUE_BYTES: usize = 24 << 20;
/// What a frame counts for at least: a frame of a few bytes still costs its allocation.
const FRAME_COST: usize = 256;
/// Frames queued for the port before senders wait.
const QUEUE: usize = 256;
const HEADER: usize = 9;
const RESET_LEN: usize = MAGIC.len() + 8;

/// What one frame says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Host → guest, first on every connection: end every session; the payload is
    /// [`MAGIC`] and a nonce. Guest → host: the same frame back, once done.
    Reset = 0,
    /// Host → guest: a new session.
    Open = 1,
    /// Either way: bytes of a session.
    Data = 2,
    /// Either way: the sender will send no more on this session.
    Close = 3,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        Some(match b {
            0 => Kind::Reset,
            1 => Kind::Open,
            2 => Kind::Data,
            3 => Kind::Close,
            _ => return None,
        })
    }
}

/// One frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub kind: Kind,
    pub session: u32,
    pub payload: Vec<u8>,
}

impl Frame {
    /// A `RESET` carrying `nonce`.
    pub fn reset(nonce: u64) -> Frame {
        let mut payload = MAGIC.to_vec();
        payload.extend_from_slice(&nonce.to_be_bytes());
        Frame {
            kind: Kind::Reset,
            session: 0,
            payload,
        }
    }

    /// The nonce of a well-formed `RESET`; `None` for anything else.
    pub fn nonce(&self) -> Option<u64> {
        if self.kind != Kind::Reset || self.session != 0 || self.payload.len() != RESET_LEN {
            return None;
        }
        let (magic, nonce) = self.payload.split_at(MAGIC.len());
        if magic != MAGIC {
            return None;
        }
        Some(u64::from_be_bytes(nonce.try_into().ok()?))
    }

    fn empty(kind: Kind, session: u32) -> Frame {
        Frame {
            kind,
            session,
            payload: Vec::new(),
        }
    }
}

/// Why the port's stream could not be read.
#[derive(Debug, thiserror::Error)]
pub enum MuxError {
    #[error("port: {0}")]
    Io(#[from] std::io::Error),
    #[error("port: frame kind {0} is none of ours")]
    BadKind(u8),
    #[error("port: frame of {0} bytes is over the {MAX_PAYLOAD}-byte limit")]
    TooLong(usize),
    #[error("port: a RESET without the magic")]
    BadReset,
}

/// Writes one frame.
pub async fn write_frame<W: AsyncWrite + Unpin>(w: &mut W, f: &Frame) -> std::io::Result<()> {
    let mut buf = Vec::with_capacity(HEADER + f.payload.len());
    buf.push(f.kind as u8);
    buf.extend_from_slice(&f.session.to_be_bytes());
    buf.extend_from_slice(&(f.payload.len() as u32).to_be_bytes());
    buf.extend_from_slice(&f.payload);
    w.write_all(&buf).await?;
    w.flush().await
}

/// Reads one frame; `Ok(None)` at the end of the stream (at a frame boundary or not: a
/// torn frame is the end of a VMM that went away mid-write).
pub async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<Frame>, MuxError> {
    let mut head = [0u8; HEADER];
    match r.read_exact(&mut head).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let kind = Kind::from_u8(head[0]).ok_or(MuxError::BadKind(head[0]))?;
    let session = u32::from_be_bytes([head[1], head[2], head[3], head[4]]);
    let len = u32::from_be_bytes([head[5], head[6], head[7], head[8]]) as usize;
    if len > MAX_PAYLOAD {
        return Err(MuxError::TooLong(len));
    }
    let mut payload = vec![0u8; len];
    match r.read_exact(&mut payload).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e.into()),
    }
    let f = Frame {
        kind,
        session,
        payload,
    };
    if kind == Kind::Reset && f.nonce().is_none() {
        return Err(MuxError::BadReset);
    }
    Ok(Some(f))
}

/// Reads bytes until a well-formed `RESET` has gone by, whatever came before it, and
/// returns its nonce; `Ok(None)` at the end of the stream.
async fn scan_reset<R: AsyncRead + Unpin>(r: &mut R) -> Result<Option<u64>, MuxError> {
    let mut want = [0u8; HEADER + MAGIC.len()];
    want[8] = RESET_LEN as u8;
    want[HEADER..].copy_from_slice(&MAGIC);
    let mut window = [0u8; HEADER + MAGIC.len()];
    let mut filled = 0;
    loop {
        let b = match r.read_u8().await {
            Ok(b) => b,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        window.rotate_left(1);
        if let Some(last) = window.last_mut() {
            *last = b;
        }
        filled = (filled + 1).min(window.len());
        if filled == window.len() && window == want {
            let mut nonce = [0u8; 8];
            return match r.read_exact(&mut nonce).await {
                Ok(_) => Ok(Some(u64::from_be_bytes(nonce))),
                Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
                Err(e) => Err(e.into()),
            };
        }
    }
}

/// A frame on its way to the port, with the generation it belongs to.
struct Out {
    generation: u64,
    frame: Frame,
}

/// What both an end's reader and its sessions share.
/// The port's end of one session: its queue, and the bytes waiting in it.
#[derive(Clone)]
struct SessionTx {
    tx: mpsc::UnboundedSender<Vec<u8>>,
    queued: Arc<AtomicUsize>,
}

struct State {
    sessions: Mutex<HashMap<u32, SessionTx>>,
    /// The guest's current generation (bumped by every `RESET` and at every host's end);
    /// frames queued for an older one are dropped unsent. Always 0 on the host.
    generation: AtomicU64,
    /// Cancelled when the host's connection is done: the writer stops and `open` fails.
    dead: CancellationToken,
}

impl State {
    fn sessions(&self) -> std::sync::MutexGuard<'_, HashMap<u32, SessionTx>> {
        self.sessions.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands `payload` to its session; one whose reader has fallen behind, or is gone, is
    /// ended here and `CLOSE`d toward the peer.
    fn deliver(&self, f: Frame, out: &mpsc::WeakSender<Out>) {
        let tx = self.sessions().get(&f.session).cloned();
        let Some(tx) = tx else { return };
        let cost = f.payload.len().max(FRAME_COST);
        let behind = tx.queued.fetch_add(cost, Ordering::SeqCst) + cost > SESSION_QUEUE_BYTES;
        if behind {
            tracing::warn!(session = f.session, "port session fell behind: ended");
        }
        let sent = !behind && tx.tx.send(f.payload).is_ok();
        match sent {
            true => {}
            false => {
                self.sessions().remove(&f.session);
                if let Some(out) = out.upgrade() {
                    let _ = out.try_send(Out {
                        generation: self.generation.load(Ordering::SeqCst),
                        frame: Frame::empty(Kind::Close, f.session),
                    });
                }
            }
        }
    }
}

/// One end of the port: opens (host) or accepts (guest) sessions over it.
pub struct Mux {
    out: mpsc::Sender<Out>,
    state: Arc<State>,
}

impl Mux {
    /// The host's end over a fresh connection to the port: sends `RESET` with a nonce of
    /// its own, then serves sessions opened with [`Mux::open`] until the port's stream ends
    /// or a frame is none of ours; after that the `Mux` is dead and `open` fails.
    pub fn host<R, W>(reader: R, writer: W) -> Arc<Mux>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (mux, rx) = Mux::new();
        let nonce: u64 = rand::random();
        let _ = mux.out.try_send(Out {
            generation: 0,
            frame: Frame::reset(nonce),
        });
        tokio::spawn(pump_out(writer, rx, mux.state.clone(), true));
        // The reader holds the sessions, not the Mux: once the Mux's users and sessions
        // are gone, the writer ends and the connection closes (QEMU serves one client at a
        // time, so a connection kept open would lock every later one out).
        let state = mux.state.clone();
        let out = mux.out.downgrade();
        tokio::spawn(async move {
            let mut reader = BufReader::new(reader);
            match host_in(&state, &mut reader, nonce, &out).await {
                Ok(()) => {}
                // The VMM went away (a stop, a pause, a crash): the edge learns which from
                // the VMM, not from its socket, so this is no news.
                Err(MuxError::Io(e)) => {
                    tracing::debug!(error = %e, "agent port: connection ended");
                }
                Err(e) => tracing::warn!(error = %e, "agent port: connection given up"),
            }
            state.dead.cancel();
            state.sessions().clear();
        });
        mux
    }

    /// The guest's end: every `OPEN` the host sends becomes a stream on `accepted`, once
    /// the returned reader runs ([`GuestReader::run`]).
    pub fn guest<R, W>(reader: R, writer: W, accepted: mpsc::Sender<DuplexStream>) -> GuestReader<R>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (mux, rx) = Mux::new();
        tokio::spawn(pump_out(writer, rx, mux.state.clone(), false));
        GuestReader {
            mux,
            reader: BufReader::new(reader),
            accepted,
        }
    }

    fn new() -> (Arc<Mux>, mpsc::Receiver<Out>) {
        let (out, rx) = mpsc::channel(QUEUE);
        (
            Arc::new(Mux {
                out,
                state: Arc::new(State {
                    sessions: Mutex::new(HashMap::new()),
                    generation: AtomicU64::new(0),
                    dead: CancellationToken::new(),
                }),
            }),
            rx,
        )
    }

    /// Opens a session (host): a stream whose bytes reach the guest's accepted end.
    /// Errors: `BrokenPipe` when the port's connection is done; `Other` when
    /// [`MAX_SESSIONS`] are open.
    pub async fn open(self: &Arc<Mux>) -> std::io::Result<DuplexStream> {
        let closed = || std::io::Error::new(std::io::ErrorKind::BrokenPipe, "port closed");
        if self.state.dead.is_cancelled() {
            return Err(closed());
        }
        let id = {
            let sessions = self.state.sessions();
            if sessions.len() >= MAX_SESSIONS {
                return Err(std::io::Error::other("too many sessions on the agent port"));
            }
            // Random ids: nothing a guest sends can name a session it was not given.
            let mut id: u32 = rand::random();
            while id == 0 || sessions.contains_key(&id) {
                id = rand::random();
            }
            id
        };
        let ours = self.attach(id, 0);
        self.out
            .send(Out {
                generation: 0,
                frame: Frame::empty(Kind::Open, id),
            })
            .await
            .map_err(|_| closed())?;
        Ok(ours)
    }

    /// Number of sessions open (for tests and metrics).
    pub fn sessions(&self) -> usize {
        self.state.sessions().len()
    }

    /// Makes session `id` of `generation`: the user's end of a duplex, whose other end is
    /// pumped to and from the port.
    fn attach(self: &Arc<Mux>, id: u32, generation: u64) -> DuplexStream {
        let (user, ours) = tokio::io::duplex(SESSION_BUFFER);
        let (mut rd, mut wr) = tokio::io::split(ours);
        let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
        let queued = Arc::new(AtomicUsize::new(0));
        self.state.sessions().insert(
            id,
            SessionTx {
                tx,
                queued: queued.clone(),
            },
        );
        // Port → session. The sender goes away with the session (close, reset, port end).
        tokio::spawn(async move {
            while let Some(b) = rx.recv().await {
                queued.fetch_sub(b.len().max(FRAME_COST), Ordering::SeqCst);
                if wr.write_all(&b).await.is_err() {
                    break;
                }
            }
            let _ = wr.shutdown().await;
        });
        // Session → port.
        let out = self.out.clone();
        tokio::spawn(async move {
            let mut buf = vec![0u8; MAX_PAYLOAD];
            loop {
                let n = match rd.read(&mut buf).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let frame = Frame {
                    kind: Kind::Data,
                    session: id,
                    payload: buf.get(..n).unwrap_or_default().to_vec(),
                };
                if out.send(Out { generation, frame }).await.is_err() {
                    break;
                }
            }
            let frame = Frame::empty(Kind::Close, id);
            let _ = out.send(Out { generation, frame }).await;
            // Our half is done; the session stays for the other side's bytes until it
            // closes too (or a reset ends it).
        });
        user
    }
}

/// The host's reader: nothing counts before the guest's echo of our `RESET`; after it,
/// `DATA` and `CLOSE` of our sessions. Returns at the end of the stream; errors at a frame
/// that is none of ours (the connection is then given up, and the next one starts clean).
async fn host_in<R: AsyncRead + Unpin>(
    state: &State,
    reader: &mut R,
    nonce: u64,
    out: &mpsc::WeakSender<Out>,
) -> Result<(), MuxError> {
    // Scanned, not parsed: a stale frame the guest's port cut short would otherwise
    // swallow the echo.
    loop {
        match scan_reset(reader).await? {
            None => return Ok(()),
            Some(n) if n == nonce => break,
            Some(_) => {}
        }
    }
    while let Some(f) = read_frame(reader).await? {
        match f.kind {
            Kind::Data => state.deliver(f, out),
            Kind::Close => {
                state.sessions().remove(&f.session);
            }
            Kind::Reset | Kind::Open => {
                tracing::debug!(kind = ?f.kind, "agent port: a guest's frame the host ignores");
            }
        }
    }
    Ok(())
}

/// The guest's reading half, run by aether: [`GuestReader::run`] reads one host
/// connection's worth of frames (until the host goes away), and runs again on the same
/// port for the next (a virtio-serial port reads end-of-stream while no host is connected).
pub struct GuestReader<R> {
    mux: Arc<Mux>,
    reader: BufReader<R>,
    accepted: mpsc::Sender<DuplexStream>,
}

impl<R: AsyncRead + Unpin> GuestReader<R> {
    /// Reads frames until the port's stream ends, then ends every session (the host that
    /// held them is gone). Bytes before the first `RESET`, and after a frame that is none of
    /// ours until the next `RESET`, are skipped. Errors: the port's read error.
    pub async fn run(&mut self) -> Result<(), MuxError> {
        let r = self.frames().await;
        self.end_generation();
        r
    }

    async fn frames(&mut self) -> Result<(), MuxError> {
        let mut synced = false;
        loop {
            if !synced {
                let Some(nonce) = scan_reset(&mut self.reader).await? else {
                    return Ok(());
                };
                self.reset(nonce).await;
                synced = true;
                continue;
            }
            let f = match read_frame(&mut self.reader).await {
                Ok(Some(f)) => f,
                Ok(None) => return Ok(()),
                Err(MuxError::Io(e)) => return Err(MuxError::Io(e)),
                Err(e) => {
                    tracing::warn!(error = %e, "agent port: waiting for the host's next RESET");
                    synced = false;
                    continue;
                }
            };
            let state = &self.mux.state;
            match f.kind {
                Kind::Reset => {
                    if let Some(nonce) = f.nonce() {
                        self.reset(nonce).await;
                    }
                }
                Kind::Open => self.open(f.session).await,
                Kind::Data => state.deliver(f, &self.mux.out.downgrade()),
                Kind::Close => {
                    state.sessions().remove(&f.session);
                }
            }
        }
    }

    /// Ends every session and starts a new generation: what was queued for the old one is
    /// dropped unsent.
    fn end_generation(&self) -> u64 {
        let state = &self.mux.state;
        state.sessions().clear();
        state.generation.fetch_add(1, Ordering::SeqCst) + 1
    }

    /// A host's `RESET`: a new generation, and the echo that tells the host where it starts.
    async fn reset(&self, nonce: u64) {
        let generation = self.end_generation();
        let _ = self
            .mux
            .out
            .send(Out {
                generation,
                frame: Frame::reset(nonce),
            })
            .await;
    }

    async fn open(&self, id: u32) {
        let state = &self.mux.state;
        let (known, full) = {
            let s = state.sessions();
            (s.contains_key(&id), s.len() >= MAX_SESSIONS)
        };
        if known {
            return;
        }
        let generation = state.generation.load(Ordering::SeqCst);
        if full {
            let _ = self
                .mux
                .out
                .send(Out {
                    generation,
                    frame: Frame::empty(Kind::Close, id),
                })
                .await;
            return;
        }
        let user = self.mux.attach(id, generation);
        if self.accepted.send(user).await.is_err() {
            state.sessions().remove(&id);
        }
    }
}

/// Writes queued frames of the current generation to the port, in order, until every
/// sender is gone or the host's connection is done. A host's writer ends at its first write
/// error; a guest's drops the frame and goes on (its port outlives every host).
async fn pump_out<W: AsyncWrite + Unpin>(
    mut w: W,
    mut rx: mpsc::Receiver<Out>,
    state: Arc<State>,
    host: bool,
) {
    loop {
        let o = tokio::select! {
            _ = state.dead.cancelled() => break,
            o = rx.recv() => match o {
                Some(o) => o,
                None => break,
            },
        };
        if o.generation != state.generation.load(Ordering::SeqCst) {
            continue;
        }
        if let Err(e) = write_frame(&mut w, &o.frame).await {
            tracing::debug!(error = %e, "port write failed");
            if host {
                state.dead.cancel();
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A host and a guest over a socket pair; the guest echoes every session back.
    async fn pair() -> (Arc<Mux>, Arc<Mux>) {
        let (h, g) = tokio::net::UnixStream::pair().expect("pair");
        let (hr, hw) = h.into_split();
        let (gr, gw) = g.into_split();
        let host = Mux::host(hr, hw);
        let (acc_tx, mut acc_rx) = mpsc::channel(8);
        let mut reader = Mux::guest(gr, gw, acc_tx);
        let guest = reader.mux.clone();
        tokio::spawn(async move {
            let _ = reader.run().await;
        });
        tokio::spawn(async move {
            while let Some(s) = acc_rx.recv().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = tokio::io::split(s);
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
        });
        (host, guest)
    }

    #[tokio::test]
    async fn sessions_carry_their_own_bytes_both_ways_and_end_apart() {
        let (host, guest) = pair().await;
        let mut a = host.open().await.expect("open a");
        let mut b = host.open().await.expect("open b");
        // More than one frame's worth, so payloads are split and reassembled in order.
        let big: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let (mut ar, mut aw) = tokio::io::split(&mut a);
        let writer = async {
            aw.write_all(&big).await.expect("write a");
            aw.shutdown().await.expect("shutdown a");
        };
        let reader = async {
            let mut got = Vec::new();
            ar.read_to_end(&mut got).await.expect("read a");
            got
        };
        let ((), got) = tokio::join!(writer, reader);
        assert_eq!(got, big);
        b.write_all(b"only b").await.expect("write b");
        b.shutdown().await.expect("shutdown b");
        let mut got = Vec::new();
        b.read_to_end(&mut got).await.expect("read b");
        assert_eq!(got, b"only b");
        assert!(guest.sessions() <= 2);
    }

    #[tokio::test]
    async fn a_host_whose_users_are_gone_closes_its_connection_to_the_port() {
        let (h, mut g) = tokio::net::UnixStream::pair().expect("pair");
        let (hr, hw) = h.into_split();
        let host = Mux::host(hr, hw);
        let s = host.open().await.expect("open");
        drop(s);
        drop(host);
        // The port's side reads RESET, OPEN, CLOSE, then the end of the stream: a VMM
        // serving one client at a time is free for the next.
        let mut kinds = Vec::new();
        tokio::time::timeout(std::time::Duration::from_secs(5), async {
            while let Some(f) = read_frame(&mut g).await.expect("read") {
                kinds.push(f.kind);
            }
        })
        .await
        .expect("the connection closed");
        assert_eq!(kinds, [Kind::Reset, Kind::Open, Kind::Close]);
    }

    fn frame(kind: Kind, session: u32, payload: &[u8]) -> Frame {
        Frame {
            kind,
            session,
            payload: payload.to_vec(),
        }
    }

    async fn within<T>(what: &str, f: impl std::future::Future<Output = T>) -> T {
        tokio::time::timeout(std::time::Duration::from_secs(10), f)
            .await
            .unwrap_or_else(|_| panic!("{what} within 10 s"))
    }

    /// A guest end over a socket pair, whose host side the test plays by hand.
    fn guest_by_hand() -> (
        tokio::net::unix::OwnedReadHalf,
        tokio::net::unix::OwnedWriteHalf,
        mpsc::Receiver<DuplexStream>,
    ) {
        let (h, g) = tokio::net::UnixStream::pair().expect("pair");
        let (hr, hw) = h.into_split();
        let (gr, gw) = g.into_split();
        let (acc_tx, acc_rx) = mpsc::channel(8);
        let mut reader = Mux::guest(gr, gw, acc_tx);
        tokio::spawn(async move {
            let _ = reader.run().await;
        });
        (hr, hw, acc_rx)
    }

    #[tokio::test]
    async fn a_reset_ends_the_sessions_a_guest_held_from_before_and_is_echoed() {
        let (mut hr, mut hw, mut acc_rx) = guest_by_hand();
        // Bytes before the first RESET are an earlier host's: even a well-formed OPEN there
        // makes no session.
        write_frame(&mut hw, &frame(Kind::Open, 9, b""))
            .await
            .expect("stale open");
        write_frame(&mut hw, &Frame::reset(11))
            .await
            .expect("reset");
        write_frame(&mut hw, &frame(Kind::Open, 7, b""))
            .await
            .expect("open");
        let mut old = within("accepted", acc_rx.recv()).await.expect("accepted");
        let echo = within("echo", read_frame(&mut hr)).await.expect("read");
        assert_eq!(echo.and_then(|f| f.nonce()), Some(11));
        // A new host connection (a restored copy's first) resets: the old session's
        // reader sees the end of its stream, and the guest echoes the new nonce.
        write_frame(&mut hw, &Frame::reset(12))
            .await
            .expect("reset");
        let mut rest = Vec::new();
        within("the old session's end", old.read_to_end(&mut rest))
            .await
            .expect("read");
        assert!(rest.is_empty());
        let echo = within("echo", read_frame(&mut hr)).await.expect("read");
        assert_eq!(echo.and_then(|f| f.nonce()), Some(12));
        assert!(acc_rx.try_recv().is_err(), "the stale OPEN made a session");
    }

    #[tokio::test]
    async fn a_guest_resynchronizes_at_the_next_reset_after_bytes_that_are_none_of_ours() {
        let (mut hr, mut hw, mut acc_rx) = guest_by_hand();
        write_frame(&mut hw, &Frame::reset(1)).await.expect("reset");
        // A torn frame's tail, a frame kind that is none of ours, and a RESET without the
        // magic: the guest skips all of it until a well-formed RESET.
        hw.write_all(&[0x41, 0x42, 9, 0, 0, 0, 1, 0, 0, 0, 0])
            .await
            .expect("junk");
        write_frame(&mut hw, &frame(Kind::Reset, 0, b"not magic"))
            .await
            .expect("bad reset");
        write_frame(&mut hw, &frame(Kind::Open, 5, b""))
            .await
            .expect("ignored open");
        write_frame(&mut hw, &Frame::reset(2)).await.expect("reset");
        write_frame(&mut hw, &frame(Kind::Open, 6, b""))
            .await
            .expect("open");
        write_frame(&mut hw, &frame(Kind::Data, 6, b"hi"))
            .await
            .expect("data");
        let mut s = within("accepted", acc_rx.recv()).await.expect("accepted");
        let mut got = [0u8; 2];
        within("data", s.read_exact(&mut got)).await.expect("read");
        assert_eq!(&got, b"hi");
        s.write_all(b"yo").await.expect("write");
        let mut seen = Vec::new();
        while seen.last() != Some(&frame(Kind::Data, 6, b"yo")) {
            let f = within("frames", read_frame(&mut hr)).await.expect("read");
            seen.push(f.expect("a frame"));
        }
        // The second RESET's echo, then session 6's bytes; nothing for the ignored OPEN.
        // The first echo may be dropped unsent: the second RESET superseded its generation.
        seen.retain(|f| *f != Frame::reset(1));
        assert_eq!(seen, [Frame::reset(2), frame(Kind::Data, 6, b"yo")]);
        assert!(
            acc_rx.try_recv().is_err(),
            "the OPEN after the junk made a session"
        );
    }

    /// A host end over a socket pair, whose guest side the test plays by hand: returns the
    /// host, the guest's halves and the host's nonce.
    async fn host_by_hand() -> (
        Arc<Mux>,
        BufReader<tokio::net::unix::OwnedReadHalf>,
        tokio::net::unix::OwnedWriteHalf,
        u64,
    ) {
        let (h, g) = tokio::net::UnixStream::pair().expect("pair");
        let (hr, hw) = h.into_split();
        let (gr, gw) = g.into_split();
        let host = Mux::host(hr, hw);
        let mut gr = BufReader::new(gr);
        let reset = within("reset", read_frame(&mut gr))
            .await
            .expect("read")
            .expect("a frame");
        let nonce = reset.nonce().expect("a RESET with a nonce");
        (host, gr, gw, nonce)
    }

    #[tokio::test]
    async fn a_host_takes_nothing_from_the_guest_but_its_sessions_bytes_after_the_echo() {
        let (host, mut gr, mut gw, nonce) = host_by_hand().await;
        let mut s = host.open().await.expect("open");
        let open = within("open", read_frame(&mut gr))
            .await
            .expect("read")
            .expect("frame");
        assert_eq!(open.kind, Kind::Open);
        let id = open.session;
        // Before the echo: a stale frame for the very session, a torn one, a RESET with
        // another nonce. After it: RESET and OPEN (the guest's to send neither), another
        // session's bytes, then ours.
        write_frame(&mut gw, &frame(Kind::Data, id, b"stale"))
            .await
            .expect("w");
        gw.write_all(&[2, 0, 0]).await.expect("w");
        write_frame(&mut gw, &Frame::reset(nonce.wrapping_add(1)))
            .await
            .expect("w");
        write_frame(&mut gw, &Frame::reset(nonce)).await.expect("w");
        write_frame(&mut gw, &Frame::reset(nonce)).await.expect("w");
        write_frame(&mut gw, &frame(Kind::Open, id.wrapping_add(1), b""))
            .await
            .expect("w");
        write_frame(&mut gw, &frame(Kind::Data, id.wrapping_add(1), b"other"))
            .await
            .expect("w");
        write_frame(&mut gw, &frame(Kind::Data, id, b"fresh"))
            .await
            .expect("w");
        write_frame(&mut gw, &frame(Kind::Close, id, b""))
            .await
            .expect("w");
        let mut got = Vec::new();
        within("the session's end", s.read_to_end(&mut got))
            .await
            .expect("read");
        assert_eq!(got, b"fresh");
        assert_eq!(host.sessions(), 0);
    }

    #[tokio::test]
    async fn a_host_whose_port_is_gone_or_speaks_junk_is_dead() {
        let (host, gr, gw, _) = host_by_hand().await;
        drop((gr, gw));
        within("the host's end", async {
            while host.open().await.is_ok() {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        })
        .await;
        let e = host.open().await.expect_err("open on a dead port");
        assert_eq!(e.kind(), std::io::ErrorKind::BrokenPipe);

        let (host, mut gr, mut gw, nonce) = host_by_hand().await;
        write_frame(&mut gw, &Frame::reset(nonce))
            .await
            .expect("echo");
        gw.write_all(&[7, 0, 0, 0, 1, 0, 0, 0, 0])
            .await
            .expect("junk");
        within("the host's end", async {
            while host.open().await.is_ok() {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        })
        .await;
        // The writer is done too: the guest side reads the end of the stream.
        within("the connection's end", async {
            while read_frame(&mut gr).await.expect("read").is_some() {}
        })
        .await;
    }

    #[tokio::test]
    async fn a_session_whose_reader_falls_behind_is_ended_and_the_others_go_on() {
        let (host, mut gr, mut gw, nonce) = host_by_hand().await;
        let _slow = host.open().await.expect("open");
        let mut quick = host.open().await.expect("open");
        let mut ids = Vec::new();
        while ids.len() < 2 {
            let f = within("open", read_frame(&mut gr))
                .await
                .expect("read")
                .expect("frame");
            if f.kind == Kind::Open {
                ids.push(f.session);
            }
        }
        write_frame(&mut gw, &Frame::reset(nonce))
            .await
            .expect("echo");
        // More than the slow session's duplex and queue hold, never read.
        let chunk = vec![7u8; MAX_PAYLOAD];
        for _ in 0..((SESSION_QUEUE_BYTES + SESSION_BUFFER) / MAX_PAYLOAD + 8) {
            write_frame(&mut gw, &frame(Kind::Data, ids[0], &chunk))
                .await
                .expect("flood");
        }
        write_frame(&mut gw, &frame(Kind::Data, ids[1], b"still here"))
            .await
            .expect("w");
        let mut got = [0u8; 10];
        within("the other session's bytes", quick.read_exact(&mut got))
            .await
            .expect("read");
        assert_eq!(&got, b"still here");
        let close = within("the slow session's CLOSE", async {
            loop {
                let f = read_frame(&mut gr).await.expect("read").expect("frame");
                if f.kind == Kind::Close {
                    return f.session;
                }
            }
        })
        .await;
        assert_eq!(close, ids[0]);
        assert_eq!(host.sessions(), 1);
    }

    #[tokio::test]
    async fn frames_that_are_none_of_ours_end_the_reader_with_a_reason() {
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&[9, 0, 0, 0, 1, 0, 0, 0, 0])
            .await
            .expect("write");
        assert!(matches!(
            read_frame(&mut b).await,
            Err(MuxError::BadKind(9))
        ));
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&[2, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff])
            .await
            .expect("write");
        assert!(matches!(
            read_frame(&mut b).await,
            Err(MuxError::TooLong(_))
        ));
        // A torn frame is the end of the stream, not an error.
        let (mut a, mut b) = tokio::io::duplex(1024);
        a.write_all(&[2, 0, 0, 0, 1, 0, 0, 0, 10, 1, 2])
            .await
            .expect("write");
        drop(a);
        assert!(read_frame(&mut b).await.expect("read").is_none());
    }
}
