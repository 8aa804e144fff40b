//! A client channel over the replicas of one service (IAM's, docs/iam-replicas.md): calls
//! go to the replica that answered last; a call that cannot reach it, or that it answers
//! `unavailable` (it has no majority, or is stopping), is sent again to the next replica,
//! round the list, until one answers or [`Failover::new`]'s patience runs out.
//!
//! Sending a call again is safe only for calls whose effect does not double: IAM's are
//! (admissions and releases are keyed by lease id, a replayed creation finds its object and
//! answers `conflict`). Over a single address the channel adds nothing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use http_body_util::BodyExt;
use tonic::body::Body;
use tonic::codegen::http;
use tonic::transport::Channel;
use tower::ServiceExt;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// gRPC's UNAVAILABLE.
const UNAVAILABLE: &str = "14";

/// What IAM's clients call IAM through.
pub type IamChannel = Failover;

/// How long a call to IAM keeps trying the replicas after its first failure: an election
/// takes 1 to 2 s, a replica without a majority answers after its 5 s commit timeout.
pub const IAM_PATIENCE: Duration = Duration::from_secs(10);

/// A channel that fails over between replicas; clones share the preferred replica.
#[derive(Clone)]
pub struct Failover {
    channels: Arc<[Channel]>,
    current: Arc<AtomicUsize>,
    patience: Duration,
}

impl std::fmt::Debug for Failover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Failover")
            .field("replicas", &self.channels.len())
            .finish()
    }
}

impl Failover {
    /// Over `channels` (one per replica, in the config's order), sending a call again for up
    /// to `patience` after it first failed. Panics never; an empty list fails every call.
    pub fn new(channels: Vec<Channel>, patience: Duration) -> Failover {
        Failover {
            channels: channels.into(),
            current: Arc::default(),
            patience,
        }
    }
}

/// True when the response is a trailers-only `unavailable` (how a server refuses a call it
/// could not do).
fn unavailable(resp: &http::Response<Body>) -> bool {
    resp.headers()
        .get("grpc-status")
        .is_some_and(|v| v.as_bytes() == UNAVAILABLE.as_bytes())
}

impl tower::Service<http::Request<Body>> for Failover {
    type Response = http::Response<Body>;
    type Error = BoxError;
    type Future = BoxFuture<'static, Result<Self::Response, BoxError>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), BoxError>> {
        // Each call readies its own clone of a replica's channel.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<Body>) -> Self::Future {
        let channels = self.channels.clone();
        let current = self.current.clone();
        let patience = self.patience;
        Box::pin(async move {
            match &*channels {
                [only] => Ok(only.clone().oneshot(req).await?),
                _ => failover(&channels, &current, patience, req).await,
            }
        })
    }
}

/// Sends `req` to the preferred replica, then round the others (see the module).
async fn failover(
    channels: &[Channel],
    current: &AtomicUsize,
    patience: Duration,
    req: http::Request<Body>,
) -> Result<http::Response<Body>, BoxError> {
    let n = channels.len();
    if n == 0 {
        return Err("no replica addresses configured".into());
    }
    let (parts, body) = req.into_parts();
    // Unary calls: the request is small and must be sent again as it was.
    let bytes = body.collect().await?.to_bytes();
    let mut first_failure: Option<Instant> = None;
    let mut i = current.load(Ordering::Relaxed) % n;
    let mut tried = 0usize;
    loop {
        let mut again = http::Request::new(Body::new(http_body_util::Full::new(bytes.clone())));
        *again.method_mut() = parts.method.clone();
        *again.uri_mut() = parts.uri.clone();
        *again.version_mut() = parts.version;
        *again.headers_mut() = parts.headers.clone();
        let Some(ch) = channels.get(i) else {
            return Err("replica index out of range".into());
        };
        let r = ch.clone().oneshot(again).await;
        let failed = match &r {
            Ok(resp) => unavailable(resp),
            Err(_) => true,
        };
        if !failed {
            current.store(i, Ordering::Relaxed);
            return Ok(r?);
        }
        let since = *first_failure.get_or_insert_with(Instant::now);
        if since.elapsed() >= patience {
            return Ok(r?);
        }
        tracing::debug!(replica = i, "call failed over to the next replica");
        i = (i + 1) % n;
        tried += 1;
        if tried.is_multiple_of(n) {
            // Every replica failed once: give an election time before the next round.
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}
