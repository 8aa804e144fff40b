//! The DNS proxy over TCP (docs/network.md "DNS"), with the limits a sandbox cannot get
//! around: at most [`PER_SOURCE`] open connections per source address and [`TOTAL`] in all.
//! hickory-server's own TCP listener has no such limit, so one sandbox opening connections
//! without end took every file descriptor of the edge, and with them the edge's connections
//! to every other sandbox. A connection over a limit is closed as soon as it is accepted,
//! which costs the proxy nothing; UDP, which sandboxes use first, is not affected.
//!
//! Each connection carries queries in the RFC 1035 §4.2.2 framing (a two-byte length, then the
//! message), answered in order by the proxy's handler; a connection that sends nothing for
//! [`super::dns::TCP_IDLE`], does not read its answers for as long, or sends a message that is
//! not DNS is closed.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hickory_server::net::runtime::TokioTime;
use hickory_server::net::xfer::Protocol;
use hickory_server::net::NetError;
use hickory_server::proto::rr::Record;
use hickory_server::proto::serialize::binary::BinEncoder;
use hickory_server::server::{Request, RequestHandler, ResponseHandler, ResponseInfo};
use hickory_server::zone_handler::MessageResponse;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;

/// Open connections one source address may hold. A resolver opens one at a time, after a
/// truncated UDP answer.
pub const PER_SOURCE: usize = 4;
/// Open connections of all sources together: what the proxy's file descriptors are bounded
/// by.
pub const TOTAL: usize = 256;

/// Serves `listener` with `handler` until the returned task is aborted, which closes every
/// connection too.
pub fn spawn<H: RequestHandler + Clone>(
    listener: TcpListener,
    handler: H,
    idle: Duration,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(accept_loop(listener, handler, idle))
}

async fn accept_loop<H: RequestHandler + Clone>(listener: TcpListener, handler: H, idle: Duration) {
    let total = Arc::new(Semaphore::new(TOTAL));
    let sources = Arc::new(Mutex::new(HashMap::new()));
    // Owned here, so aborting this task aborts every connection.
    let mut conns = JoinSet::new();
    loop {
        let (stream, src) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                // Out of file descriptors (the process's or the system's): accepting again at
                // once would spin.
                tracing::debug!(error = %e, "DNS proxy: accepting a TCP connection");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        while conns.try_join_next().is_some() {}
        let Ok(permit) = total.clone().try_acquire_owned() else {
            tracing::debug!(%src, "DNS proxy: TCP connections at the limit; closed");
            continue;
        };
        let Some(held) = SourceHold::take(&sources, src.ip()) else {
            tracing::debug!(%src, "DNS proxy: this source's TCP connections at the limit; closed");
            continue;
        };
        conns.spawn(serve(stream, src, handler.clone(), idle, (permit, held)));
    }
}

/// One of a source's connections; dropping it gives the place back.
struct SourceHold {
    sources: Arc<Mutex<HashMap<IpAddr, usize>>>,
    ip: IpAddr,
}

impl SourceHold {
    fn take(sources: &Arc<Mutex<HashMap<IpAddr, usize>>>, ip: IpAddr) -> Option<SourceHold> {
        let mut map = match sources.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let n = map.entry(ip).or_insert(0);
        if *n >= PER_SOURCE {
            return None;
        }
        *n += 1;
        Some(SourceHold {
            sources: sources.clone(),
            ip,
        })
    }
}

impl Drop for SourceHold {
    fn drop(&mut self) {
        let mut map = match self.sources.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        if let Some(n) = map.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                map.remove(&self.ip);
            }
        }
    }
}

async fn serve<H: RequestHandler>(
    mut stream: TcpStream,
    src: SocketAddr,
    handler: H,
    idle: Duration,
    _held: (OwnedSemaphorePermit, SourceHold),
) {
    loop {
        let mut len = [0u8; 2];
        if !matches!(
            tokio::time::timeout(idle, stream.read_exact(&mut len)).await,
            Ok(Ok(_))
        ) {
            return;
        }
        let mut msg = vec![0u8; usize::from(u16::from_be_bytes(len))];
        if !matches!(
            tokio::time::timeout(idle, stream.read_exact(&mut msg)).await,
            Ok(Ok(_))
        ) {
            return;
        }
        let Ok(request) = Request::from_bytes(msg, src, Protocol::Tcp) else {
            tracing::debug!(%src, "DNS proxy: not a DNS message over TCP; closed");
            return;
        };
        let answer = Answer::default();
        handler
            .handle_request::<_, TokioTime>(&request, answer.clone())
            .await;
        let Some(bytes) = answer.take() else {
            return;
        };
        let Ok(n) = u16::try_from(bytes.len()) else {
            return;
        };
        let mut framed = Vec::with_capacity(bytes.len() + 2);
        framed.extend_from_slice(&n.to_be_bytes());
        framed.extend_from_slice(&bytes);
        if !matches!(
            tokio::time::timeout(idle, stream.write_all(&framed)).await,
            Ok(Ok(()))
        ) {
            return;
        }
    }
}

/// Where the handler's answer to one query is written.
#[derive(Clone, Default)]
struct Answer(Arc<Mutex<Option<Vec<u8>>>>);

impl Answer {
    fn take(&self) -> Option<Vec<u8>> {
        match self.0.lock() {
            Ok(mut g) => g.take(),
            Err(p) => p.into_inner().take(),
        }
    }
}

#[async_trait::async_trait]
impl ResponseHandler for Answer {
    async fn send_response<'a>(
        &mut self,
        response: MessageResponse<
            '_,
            'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
            impl Iterator<Item = &'a Record> + Send + 'a,
        >,
    ) -> Result<ResponseInfo, NetError> {
        let mut bytes = Vec::with_capacity(512);
        let mut encoder = BinEncoder::new(&mut bytes);
        encoder.set_max_size(u16::MAX);
        let info = response.destructive_emit(&mut encoder)?;
        match self.0.lock() {
            Ok(mut g) => *g = Some(bytes),
            Err(p) => *p.into_inner() = Some(bytes),
        }
        Ok(info)
    }
}
