//! `ConnectPort` at its end (docs/network.md "Ports into a sandbox"): a TCP connection to
//! `127.0.0.1:<port>` made by aether, which lives in the sandbox's network namespace, so the
//! loopback is the sandbox's own and the sandbox's egress rules do not apply. The edge and
//! the apiserver only pass the frames on ([`forward`]).

use std::net::Ipv4Addr;
use std::pin::Pin;
use std::time::Duration;

use futures::{Stream, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tonic::Status;

use crate::pb;
use crate::rpc::to_status;
use crate::types::Failure;

/// The most bytes one frame carries.
pub const MAX_FRAME: usize = 64 * 1024;
/// How long connecting to the port may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// A stream of frames, one way.
pub type Frames = Pin<Box<dyn Stream<Item = Result<pb::PortFrame, Status>> + Send + 'static>>;

/// The port a first frame names, or `invalid`.
pub fn port_of(first: &pb::PortFrame) -> Result<u16, Failure> {
    u16::try_from(first.port)
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| Failure::invalid(format!("port: {} is outside 1-65535", first.port)))
}

/// How long a caller may take to send its first frame.
pub const FIRST_FRAME_TIMEOUT: Duration = Duration::from_secs(10);

/// The caller's first frame, which names the sandbox and the port.
/// Errors: `invalid` when the stream ends (or fails) before it; `timeout` when it does not
/// come within [`FIRST_FRAME_TIMEOUT`] (a call held open without one would hold a
/// connection slot for nothing).
pub async fn first_frame(
    inbound: &mut (impl Stream<Item = Result<pb::PortFrame, Status>> + Unpin),
) -> Result<pb::PortFrame, Status> {
    match tokio::time::timeout(FIRST_FRAME_TIMEOUT, inbound.next()).await {
        Ok(Some(Ok(f))) => Ok(f),
        Ok(Some(Err(s))) => Err(s),
        Ok(None) => Err(to_status(&Failure::invalid(
            "ConnectPort: the stream ended before its first frame (sandbox_id, port)",
        ))),
        Err(_) => Err(to_status(&Failure::new(
            crate::types::Reason::Timeout,
            format!(
                "ConnectPort: no first frame (sandbox_id, port) within {}s",
                FIRST_FRAME_TIMEOUT.as_secs()
            ),
        ))),
    }
}

/// Sends what `rd` reads as data frames to `tx`, then an `eof` frame at its end (or at a
/// read error); stops early when `tx` is closed. The caller's half of a `ConnectPort`.
pub async fn send_reads<R: tokio::io::AsyncRead + Unpin>(
    mut rd: R,
    tx: tokio::sync::mpsc::Sender<pb::PortFrame>,
) {
    let mut buf = vec![0u8; MAX_FRAME];
    loop {
        let frame = match rd.read(&mut buf).await {
            Ok(0) | Err(_) => pb::PortFrame {
                eof: true,
                ..Default::default()
            },
            Ok(n) => pb::PortFrame {
                data: buf.get(..n).unwrap_or_default().to_vec(),
                ..Default::default()
            },
        };
        let eof = frame.eof;
        if tx.send(frame).await.is_err() || eof {
            break;
        }
    }
}

/// The caller's frames from `first` on, ending at the first error (a cancelled call): what
/// a forwarding hop sends on.
pub fn forward(
    first: pb::PortFrame,
    rest: impl Stream<Item = Result<pb::PortFrame, Status>> + Send + 'static,
) -> impl Stream<Item = pb::PortFrame> + Send + 'static {
    futures::stream::once(async move { first }).chain(
        rest.take_while(|r| futures::future::ready(r.is_ok()))
            .filter_map(|r| futures::future::ready(r.ok())),
    )
}

/// Connects to `first.port` on this namespace's loopback and pumps frames both ways: the
/// returned stream starts with a frame holding only the port (connected), then the data
/// the service sends, then an `eof` frame; it ends once both directions are done. The
/// caller's `eof` (or the end of its stream) half-closes the connection.
/// Errors: `invalid` port; `unavailable` when nothing listens there or the connect fails.
pub async fn connect(
    first: pb::PortFrame,
    inbound: impl Stream<Item = Result<pb::PortFrame, Status>> + Send + Unpin + 'static,
) -> Result<Frames, Failure> {
    let port = port_of(&first)?;
    let stream = match tokio::time::timeout(
        CONNECT_TIMEOUT,
        tokio::net::TcpStream::connect((Ipv4Addr::LOCALHOST, port)),
    )
    .await
    {
        Ok(Ok(s)) => s,
        Ok(Err(e)) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            return Err(Failure::unavailable(format!(
                "port {port}: nothing listens on it in the sandbox (connection refused)"
            )))
        }
        Ok(Err(e)) => return Err(Failure::unavailable(format!("port {port}: {e}"))),
        Err(_) => {
            return Err(Failure::unavailable(format!(
                "port {port}: connecting timed out after {}s",
                CONNECT_TIMEOUT.as_secs()
            )))
        }
    };
    let _ = stream.set_nodelay(true);
    let (mut rd, mut wr) = stream.into_split();
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<pb::PortFrame, Status>>(8);
    let frame = move |data: Vec<u8>, eof: bool| pb::PortFrame {
        port: u32::from(port),
        data,
        eof,
        ..Default::default()
    };
    // Capacity 8 holds the first frame.
    let _ = tx.try_send(Ok(frame(Vec::new(), false)));
    // The writer holds a sender too: the stream ends when both directions are done.
    let held = tx.clone();
    let mut inbound = inbound;
    tokio::spawn(async move {
        let mut next = Some(first);
        while let Some(f) = next.take() {
            if !f.data.is_empty() && wr.write_all(&f.data).await.is_err() {
                break;
            }
            if f.eof {
                break;
            }
            next = match inbound.next().await {
                Some(Ok(f)) => Some(f),
                _ => None,
            };
        }
        let _ = wr.shutdown().await;
        drop(held);
    });
    tokio::spawn(async move {
        let mut buf = vec![0u8; MAX_FRAME];
        loop {
            tokio::select! {
                _ = tx.closed() => break,
                r = rd.read(&mut buf) => {
                    let item = match r {
                        Ok(0) => {
                            let _ = tx.send(Ok(frame(Vec::new(), true))).await;
                            break;
                        }
                        Ok(n) => Ok(frame(buf.get(..n).unwrap_or_default().to_vec(), false)),
                        Err(e) => {
                            let f = Failure::unavailable(format!("port {port}: {e}"));
                            let _ = tx.send(Err(to_status(&f))).await;
                            break;
                        }
                    };
                    if tx.send(item).await.is_err() {
                        break;
                    }
                }
            }
        }
    });
    Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
}
