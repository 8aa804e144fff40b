//! Byte streams over one serial port (docs/microvm.md "The agent channel"): how the edge
//! reaches aether in a microVM where the VMM has no vsock (QEMU's virtio-serial port, which,
//! unlike vhost vsock, survives a snapshot and a restore).
//!
//! A virtio-serial port is one byte stream with no notion of connections, and the guest
//! cannot tell a host that went away (or a VM restored into a new VMM process) from one that
//! is slow. So both ends speak frames: `[kind u8][session u32 BE][len u32 BE][payload]`.
//! The host opens sessions (each is what a socket connection would be: tonic's HTTP/2
//! connection runs over one), both ends send data and end their half, and the host starts
//! every connection to the port with `RESET`, which ends whatever sessions the guest still
//! held from before (a restored copy holds its source's).
//!
//! [`Mux::host`] is the edge's end, [`Mux::guest`] aether's; both run over any
//! `AsyncRead + AsyncWrite` halves, so the tests run them over a socket pair.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::sync::mpsc;

/// The largest payload of one frame.
pub const MAX_PAYLOAD: usize = 64 << 10;
/// Bytes a session buffers each way before its sender waits.
const SESSION_BUFFER: usize = 256 << 10;
/// Frames queued for the port before senders wait.
const QUEUE: usize = 256;
const HEADER: usize = 9;

/// What one frame says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Host → guest, first on every connection: end every session.
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

/// Why the port's stream could not be read.
#[derive(Debug, thiserror::Error)]
pub enum MuxError {
    #[error("port: {0}")]
    Io(#[from] std::io::Error),
    #[error("port: frame kind {0} is none of ours")]
    BadKind(u8),
    #[error("port: frame of {0} bytes is over the {MAX_PAYLOAD}-byte limit")]
    TooLong(usize),
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
    Ok(Some(Frame {
        kind,
        session,
        payload,
    }))
}

type Sessions = Arc<Mutex<HashMap<u32, mpsc::Sender<Vec<u8>>>>>;

fn lock(s: &Sessions) -> std::sync::MutexGuard<'_, HashMap<u32, mpsc::Sender<Vec<u8>>>> {
    s.lock().unwrap_or_else(|p| p.into_inner())
}

/// One end of the port: opens (host) or accepts (guest) sessions over it.
pub struct Mux {
    out: mpsc::Sender<Frame>,
    sessions: Sessions,
    next: AtomicU32,
}

impl Mux {
    /// The host's end over a fresh connection to the port: sends `RESET`, then serves
    /// sessions opened with [`Mux::open`] until the port's stream ends.
    pub fn host<R, W>(reader: R, writer: W) -> Arc<Mux>
    where
        R: AsyncRead + Unpin + Send + 'static,
        W: AsyncWrite + Unpin + Send + 'static,
    {
        let (mux, rx) = Mux::new();
        let _ = mux.out.try_send(Frame {
            kind: Kind::Reset,
            session: 0,
            payload: Vec::new(),
        });
        tokio::spawn(pump_out(writer, rx));
        // The reader holds the sessions, not the Mux: once the Mux's users and sessions
        // are gone, the writer ends and the connection closes (QEMU serves one client at a
        // time, so a connection kept open would lock every later one out).
        let sessions = mux.sessions.clone();
        tokio::spawn(async move {
            let mut reader = reader;
            if let Err(e) = pump_in(&sessions, &mut reader, None).await {
                tracing::debug!(error = %e, "port closed");
            }
            lock(&sessions).clear();
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
        tokio::spawn(pump_out(writer, rx));
        GuestReader {
            mux,
            reader,
            accepted,
        }
    }

    fn new() -> (Arc<Mux>, mpsc::Receiver<Frame>) {
        let (out, rx) = mpsc::channel(QUEUE);
        (
            Arc::new(Mux {
                out,
                sessions: Arc::new(Mutex::new(HashMap::new())),
                next: AtomicU32::new(1),
            }),
            rx,
        )
    }

    /// Opens a session (host): a stream whose bytes reach the guest's accepted end.
    /// Errors: `BrokenPipe` when the port is gone.
    pub async fn open(self: &Arc<Mux>) -> std::io::Result<DuplexStream> {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let ours = self.attach(id);
        self.out
            .send(Frame {
                kind: Kind::Open,
                session: id,
                payload: Vec::new(),
            })
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::BrokenPipe, "port closed"))?;
        Ok(ours)
    }

    /// Number of sessions open (for tests and metrics).
    pub fn sessions(&self) -> usize {
        lock(&self.sessions).len()
    }

    /// Makes session `id`: the user's end of a duplex, whose other end is pumped to and
    /// from the port.
    fn attach(self: &Arc<Mux>, id: u32) -> DuplexStream {
        let (user, ours) = tokio::io::duplex(SESSION_BUFFER);
        let (mut rd, mut wr) = tokio::io::split(ours);
        let (tx, mut rx) = mpsc::channel::<Vec<u8>>(64);
        lock(&self.sessions).insert(id, tx);
        // Port → session. The sender goes away with the session (close, reset, port end).
        tokio::spawn(async move {
            while let Some(b) = rx.recv().await {
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
                let f = Frame {
                    kind: Kind::Data,
                    session: id,
                    payload: buf.get(..n).unwrap_or_default().to_vec(),
                };
                if out.send(f).await.is_err() {
                    break;
                }
            }
            let _ = out
                .send(Frame {
                    kind: Kind::Close,
                    session: id,
                    payload: Vec::new(),
                })
                .await;
            // Our half is done; the session stays for the other side's bytes until it
            // closes too (or a reset ends it).
        });
        user
    }
}

/// Makes a session on the guest for an `OPEN` and hands it to `accepted`.
type Accept<'a> = (&'a Arc<Mux>, &'a mpsc::Sender<DuplexStream>);

/// Reads frames from the port and hands them to `sessions`; `accept` is set on the guest,
/// where `OPEN` makes a session. Returns at the end of the stream.
async fn pump_in<R: AsyncRead + Unpin>(
    sessions: &Sessions,
    reader: &mut R,
    accept: Option<Accept<'_>>,
) -> Result<(), MuxError> {
    while let Some(f) = read_frame(reader).await? {
        match f.kind {
            Kind::Reset => {
                // Dropping each sender ends its session's port → session pump, which
                // shuts the user's read half: the server sees end of stream.
                lock(sessions).clear();
            }
            Kind::Open => {
                if let Some((mux, acc)) = accept {
                    let user = mux.attach(f.session);
                    if acc.send(user).await.is_err() {
                        lock(sessions).remove(&f.session);
                    }
                }
            }
            Kind::Data => {
                let tx = lock(sessions).get(&f.session).cloned();
                if let Some(tx) = tx {
                    if tx.send(f.payload).await.is_err() {
                        lock(sessions).remove(&f.session);
                    }
                }
            }
            Kind::Close => {
                lock(sessions).remove(&f.session);
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
    reader: R,
    accepted: mpsc::Sender<DuplexStream>,
}

impl<R: AsyncRead + Unpin> GuestReader<R> {
    /// Reads frames until the port's stream ends, then ends every session (the host that
    /// held them is gone). Errors: a frame that is none of ours, or the port's read error.
    pub async fn run(&mut self) -> Result<(), MuxError> {
        let sessions = self.mux.sessions.clone();
        let r = pump_in(
            &sessions,
            &mut self.reader,
            Some((&self.mux, &self.accepted)),
        )
        .await;
        lock(&self.mux.sessions).clear();
        r
    }
}

/// Writes queued frames to the port, in order, until every sender is gone.
async fn pump_out<W: AsyncWrite + Unpin>(mut w: W, mut rx: mpsc::Receiver<Frame>) {
    while let Some(f) = rx.recv().await {
        if let Err(e) = write_frame(&mut w, &f).await {
            tracing::debug!(error = %e, "port write failed");
            break;
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

    #[tokio::test]
    async fn a_reset_ends_the_sessions_a_guest_held_from_before() {
        let (h, g) = tokio::net::UnixStream::pair().expect("pair");
        let (hr, mut hw) = h.into_split();
        let (gr, gw) = g.into_split();
        let (acc_tx, mut acc_rx) = mpsc::channel(8);
        let mut reader = Mux::guest(gr, gw, acc_tx);
        tokio::spawn(async move {
            let _ = reader.run().await;
        });
        let frame = |kind, session| Frame {
            kind,
            session,
            payload: Vec::new(),
        };
        write_frame(&mut hw, &frame(Kind::Open, 7))
            .await
            .expect("open");
        let mut old = acc_rx.recv().await.expect("accepted");
        // A new host connection (a restored copy's first) resets: the old session's
        // reader sees the end of its stream.
        write_frame(&mut hw, &frame(Kind::Reset, 0))
            .await
            .expect("reset");
        let mut rest = Vec::new();
        tokio::time::timeout(
            std::time::Duration::from_secs(5),
            old.read_to_end(&mut rest),
        )
        .await
        .expect("the old session ended")
        .expect("read");
        assert!(rest.is_empty());
        drop(hr);
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
