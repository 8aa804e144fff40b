//! A client channel over the replicas of one service (IAM's, docs/iam-replicas.md): calls
//! go to the replica that answered last; a call that cannot reach it, or that it answers
//! `unavailable` (it has no majority, or is stopping), is sent again to the next replica,
//! round the list, until one answers or [`Failover::new`]'s patience runs out.
//!
//! A call that provably never reached a replica (the connection could not be made) is sent
//! to the next one whatever it is. A call whose fate is unknown (the connection broke after
//! it was sent, or the replica answered `unavailable`, which may mean its change commits
//! later) is sent again only when the method's effect does not double ([`iam_resendable`]:
//! reads, and admissions and releases keyed by lease id); the others fail with what the
//! replica said. Over a single address the channel adds nothing.
//!
//! Replicas name their leader's address in every answer ([`LEADER_HEADER`]); the channel
//! then sends the next calls there, sparing the hop a follower makes to forward a change.

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

/// The response header in which an IAM replica names the leader's `Iam` address.
pub const LEADER_HEADER: &str = "x-opendsec-iam-leader";

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
    /// The replicas' addresses, in the channels' order.
    addrs: Arc<[String]>,
    current: Arc<AtomicUsize>,
    patience: Duration,
    resendable: fn(&str) -> bool,
}

/// The IAM methods (by gRPC path) that may be sent again when their first try's fate is
/// unknown: reads, and the lease changes that are keyed by lease id (a second `Admit` of a
/// held lease charges nothing, a second release releases nothing).
pub fn iam_resendable(path: &str) -> bool {
    matches!(
        path.strip_prefix("/opendsec.v1.Iam/"),
        Some(
            "Authenticate"
                | "Authorize"
                | "Admit"
                | "ReleaseLeases"
                | "GetLease"
                | "GetLeases"
                | "Reconcile"
                | "SweepUnbound"
                | "GetEpoch"
                | "WhoAmI"
                | "GetProject"
                | "ListTokens"
                | "GetUsage"
                | "Backup"
                | "Members"
        )
    )
}

/// True when `e` failed before anything was sent: no connection could be made.
fn never_sent(e: &BoxError) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e.as_ref());
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            if matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionRefused
                    | std::io::ErrorKind::AddrNotAvailable
                    | std::io::ErrorKind::HostUnreachable
                    | std::io::ErrorKind::NetworkUnreachable
            ) {
                return true;
            }
        }
        cur = err.source();
    }
    false
}

impl std::fmt::Debug for Failover {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Failover")
            .field("replicas", &self.channels.len())
            .finish()
    }
}

impl Failover {
    /// Over `replicas` (address and channel, in the config's order), sending a call again
    /// for up to `patience` after it first failed; calls whose path `resendable` accepts also
    /// when their first try's fate is unknown. An empty list fails every call.
    pub fn new(
        replicas: Vec<(String, Channel)>,
        patience: Duration,
        resendable: fn(&str) -> bool,
    ) -> Failover {
        let (addrs, channels): (Vec<String>, Vec<Channel>) = replicas.into_iter().unzip();
        Failover {
            channels: channels.into(),
            addrs: addrs.into(),
            current: Arc::default(),
            patience,
            resendable,
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
        let addrs = self.addrs.clone();
        let current = self.current.clone();
        let patience = self.patience;
        let resendable = (self.resendable)(req.uri().path());
        Box::pin(async move {
            match &*channels {
                [only] => Ok(only.clone().oneshot(req).await?),
                _ => {
                    let r = failover(&channels, &current, patience, resendable, req).await;
                    if let Ok(resp) = &r {
                        follow_leader(resp, &addrs, &current);
                    }
                    r
                }
            }
        })
    }
}

/// Prefers the replica a response names as the leader, if it is one of ours.
fn follow_leader(resp: &http::Response<Body>, addrs: &[String], current: &AtomicUsize) {
    let Some(leader) = resp
        .headers()
        .get(LEADER_HEADER)
        .and_then(|v| v.to_str().ok())
    else {
        return;
    };
    if let Some(i) = addrs.iter().position(|a| a == leader) {
        current.store(i, Ordering::Relaxed);
    }
}

/// Sends `req` to the preferred replica, then round the others (see the module).
async fn failover(
    channels: &[Channel],
    current: &AtomicUsize,
    patience: Duration,
    resendable: bool,
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
        let r: Result<_, BoxError> = ch.clone().oneshot(again).await.map_err(Into::into);
        let send_again = match &r {
            Ok(resp) => unavailable(resp) && resendable,
            Err(e) => resendable || never_sent(e),
        };
        if !send_again {
            if r.is_ok() {
                current.store(i, Ordering::Relaxed);
            }
            return r;
        }
        let since = *first_failure.get_or_insert_with(Instant::now);
        if since.elapsed() >= patience {
            return r;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb;
    use std::sync::atomic::AtomicU32;

    /// A replica that counts its calls and names `leader` in its answers.
    #[derive(Clone)]
    struct Fake {
        calls: Arc<AtomicU32>,
        leader: String,
    }

    #[tonic::async_trait]
    impl pb::raft_server::Raft for Fake {
        async fn send(
            &self,
            _: tonic::Request<pb::RaftBatch>,
        ) -> Result<tonic::Response<pb::RaftAck>, tonic::Status> {
            self.calls.fetch_add(1, Ordering::Relaxed);
            let mut r = tonic::Response::new(pb::RaftAck {});
            if let Ok(v) = self.leader.parse() {
                r.metadata_mut().insert(LEADER_HEADER, v);
            }
            Ok(r)
        }
    }

    /// Calls go to the first replica until one names the leader; then to the leader.
    #[tokio::test]
    async fn calls_follow_the_leader_a_replica_names() {
        let mut replicas = Vec::new();
        let mut counts = Vec::new();
        let listeners: Vec<tokio::net::TcpListener> =
            futures::future::join_all((0..3).map(|_| tokio::net::TcpListener::bind("127.0.0.1:0")))
                .await
                .into_iter()
                .map(|l| l.unwrap())
                .collect();
        let addrs: Vec<String> = listeners
            .iter()
            .map(|l| l.local_addr().unwrap().to_string())
            .collect();
        for (i, l) in listeners.into_iter().enumerate() {
            let fake = Fake {
                calls: Arc::default(),
                // Replica 0 names 2; 2 names itself; 1 names an address not in the list.
                leader: match i {
                    1 => "10.9.9.9:1".to_string(),
                    _ => addrs[2].clone(),
                },
            };
            counts.push(fake.calls.clone());
            let incoming = tonic::transport::server::TcpIncoming::from(l);
            tokio::spawn(
                tonic::transport::Server::builder()
                    .add_service(pb::raft_server::RaftServer::new(fake))
                    .serve_with_incoming(incoming),
            );
            let ch = crate::rpc::client::channel(&addrs[i], Duration::from_secs(2)).unwrap();
            replicas.push((addrs[i].clone(), ch));
        }
        let ch = Failover::new(replicas, Duration::from_secs(1), |_| false);
        let mut client = pb::raft_client::RaftClient::new(ch);
        for _ in 0..5 {
            client
                .send(pb::RaftBatch { messages: vec![] })
                .await
                .unwrap();
        }
        let n: Vec<u32> = counts.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        assert_eq!(n, vec![1, 0, 4]);
    }
}
