//! Leases of ended sandboxes go back to IAM (docs/architecture.md): queued and
//! sent with `Iam.ReleaseLeases` after 1000 of them or 50 ms, one call per batch (per
//! distinct end time), retried with backoff while IAM is unreachable, so none is lost while
//! the edge runs. A release someone waits for (a caller's stop: its quota must be free when
//! the stop returns, docs/architecture.md) is sent at once with whatever is queued, and
//! while a batch is in flight the next ones gather behind it, so a burst of stops still
//! costs IAM a few calls. Also the lookup the edge makes after each creation: concurrent lookups are
//! coalesced into one `Iam.GetLeases` call, so a burst of creations costs IAM a few calls
//! rather than one per sandbox.

use std::sync::Arc;
use std::time::Duration;

use crate::rpc::failover::IamChannel;
use async_trait::async_trait;
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;

use crate::pb::{self, iam_client::IamClient};
use crate::rpc;
use crate::types::{Failure, Reason};

/// Where leases go: IAM in production, a fake in tests.
#[async_trait]
pub trait LeaseSink: Send + Sync + 'static {
    /// Releases `lease_ids`, ended at `at` (unix seconds).
    async fn release(&self, lease_ids: Vec<String>, at: i64) -> Result<(), Failure>;
    /// Where a lease is bound; `Ok(None)` when IAM does not hold it (released).
    async fn lookup(&self, lease_id: &str) -> Result<Option<pb::LeaseInfo>, Failure>;
}

/// `LeaseSink` over IAM's gRPC service. Without an IAM address, releases are dropped and
/// lookups fail as `unavailable`.
pub struct IamLeases {
    client: Option<IamClient<IamChannel>>,
    token: String,
    timeout: Duration,
    lookups: std::sync::OnceLock<mpsc::Sender<Lookup>>,
}

type Lookup = (
    String,
    oneshot::Sender<Result<Option<pb::LeaseInfo>, Failure>>,
);

/// Most lease ids one `GetLeases` call carries (IAM accepts up to 4096).
const LOOKUP_BATCH: usize = 1024;

/// Answers queued lookups: takes the first waiting one and everything queued behind it, asks
/// IAM once, and answers each. No waiting to fill a batch: under load the queue fills itself.
async fn coalesce_lookups(
    client: IamClient<IamChannel>,
    token: String,
    timeout: Duration,
    mut rx: mpsc::Receiver<Lookup>,
) {
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while batch.len() < LOOKUP_BATCH {
            match rx.try_recv() {
                Ok(l) => batch.push(l),
                Err(_) => break,
            }
        }
        let ids: Vec<String> = batch.iter().map(|(id, _)| id.clone()).collect();
        let mut req = rpc::client::internal(pb::GetLeasesRequest { lease_ids: ids }, &token);
        req.set_timeout(timeout);
        match client.clone().get_leases(req).await {
            Ok(r) => {
                let mut found: std::collections::HashMap<String, pb::LeaseInfo> = r
                    .into_inner()
                    .leases
                    .into_iter()
                    .map(|l| (l.lease_id.clone(), l))
                    .collect();
                for (id, tx) in batch {
                    let _ = tx.send(Ok(found.remove(&id)));
                }
            }
            Err(s) => {
                let f = rpc::failure_from_status(&s);
                for (_, tx) in batch {
                    let _ = tx.send(Err(f.clone()));
                }
            }
        }
    }
}

impl IamLeases {
    /// A lazily connecting client for IAM at `addrs` (its replicas; none or "" = no IAM),
    /// through `dialer`.
    pub fn new(
        addrs: &[String],
        service_token: &str,
        dialer: &rpc::client::Dialer,
    ) -> Result<IamLeases, rpc::client::ClientError> {
        let timeout = Duration::from_secs(2);
        let client = if addrs.iter().all(|a| a.is_empty()) {
            None
        } else {
            Some(IamClient::new(dialer.failover(
                addrs,
                timeout,
                crate::pki::Role::Iam,
                rpc::failover::IAM_PATIENCE,
            )?))
        };
        Ok(IamLeases {
            client,
            token: service_token.to_string(),
            timeout,
            lookups: std::sync::OnceLock::new(),
        })
    }

    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = rpc::client::internal(msg, &self.token);
        r.set_timeout(self.timeout);
        r
    }
}

#[async_trait]
impl LeaseSink for IamLeases {
    async fn release(&self, lease_ids: Vec<String>, at: i64) -> Result<(), Failure> {
        let Some(c) = &self.client else {
            tracing::debug!(
                count = lease_ids.len(),
                "no IAM configured; leases not released"
            );
            return Ok(());
        };
        let mut c = c.clone();
        c.release_leases(self.request(pb::ReleaseLeasesRequest {
            lease_ids,
            at,
            not_created: false,
        }))
        .await
        .map(|_| ())
        .map_err(|s| rpc::failure_from_status(&s))
    }

    async fn lookup(&self, lease_id: &str) -> Result<Option<pb::LeaseInfo>, Failure> {
        let Some(c) = &self.client else {
            return Err(Failure::unavailable("no IAM configured"));
        };
        // Started on first use, inside the edge's runtime.
        let q = self.lookups.get_or_init(|| {
            let (tx, rx) = mpsc::channel(8192);
            tokio::spawn(coalesce_lookups(
                c.clone(),
                self.token.clone(),
                self.timeout,
                rx,
            ));
            tx
        });
        let (tx, rx) = oneshot::channel();
        q.send((lease_id.to_string(), tx))
            .await
            .map_err(|_| Failure::unavailable("lease lookups stopped"))?;
        rx.await
            .map_err(|_| Failure::unavailable("lease lookup dropped"))?
    }
}

/// Whether IAM's binding of a lease is this sandbox on this edge (an unbound lease counts:
/// nobody else claims it).
pub fn bound_here(info: &pb::LeaseInfo, edge_id: &str, sandbox_id: &str) -> bool {
    (info.edge_id.is_empty() || info.edge_id == edge_id)
        && (info.sandbox_id.is_empty() || info.sandbox_id == sandbox_id)
}

/// One lease to release.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReleaseItem {
    pub lease_id: String,
    /// When the sandbox ended (unix seconds).
    pub at: i64,
    /// `Some((edge, sandbox))`: release only if IAM still binds the lease there (used for
    /// sandboxes whose creation failed or was interrupted: the apiserver may have moved the
    /// lease to another edge meanwhile).
    pub verify: Option<(String, String)>,
}

enum Msg {
    /// A lease to release, and who waits for it to be settled (released, refused, or found
    /// not ours to release).
    Item(ReleaseItem, Option<oneshot::Sender<()>>),
    Close(Duration, oneshot::Sender<usize>),
}

/// Batching parameters.
#[derive(Debug, Clone, Copy)]
pub struct BatchConfig {
    pub max: usize,
    pub wait: Duration,
    pub max_backoff: Duration,
}

impl Default for BatchConfig {
    /// 1000 leases or 50 ms; retries back off up to 2 s.
    fn default() -> Self {
        BatchConfig {
            max: 1000,
            wait: Duration::from_millis(50),
            max_backoff: Duration::from_secs(2),
        }
    }
}

/// Lease ids queued or in flight, with how many times each (shared with the task).
type Pending = Arc<std::sync::Mutex<std::collections::HashMap<String, usize>>>;

fn settle(pending: &Pending, ids: impl IntoIterator<Item = String>) {
    let mut p = pending.lock().unwrap_or_else(|e| e.into_inner());
    for id in ids {
        if let Some(n) = p.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                p.remove(&id);
            }
        }
    }
}

/// The queue of leases to release; cheap to clone.
#[derive(Clone)]
pub struct Releaser {
    tx: mpsc::UnboundedSender<Msg>,
    pending: Pending,
}

impl Releaser {
    /// Starts the batching task.
    pub fn spawn(
        sink: Arc<dyn LeaseSink>,
        cfg: BatchConfig,
    ) -> (Releaser, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let pending = Pending::default();
        let h = tokio::spawn(run(sink, cfg, rx, pending.clone()));
        (Releaser { tx, pending }, h)
    }

    /// Whether a release of `lease_id` is queued or in flight: not yet done, refused, or
    /// found unnecessary (bound elsewhere, already released).
    pub fn is_pending(&self, lease_id: &str) -> bool {
        self.pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .contains_key(lease_id)
    }

    /// Queues one lease (empty ids are ignored).
    pub fn release(&self, item: ReleaseItem) {
        self.enqueue(item, None);
    }

    /// Queues one lease and sends it without waiting to fill a batch; returns once IAM has
    /// settled it (released, refused, or not ours), or at once for an empty id. Never fails:
    /// a release IAM does not take now stays queued and is retried, so a caller bounds the
    /// wait with a timeout of its own.
    pub async fn release_now(&self, item: ReleaseItem) {
        let (tx, rx) = oneshot::channel();
        if self.enqueue(item, Some(tx)) {
            let _ = rx.await;
        }
    }

    /// Whether the item was queued.
    fn enqueue(&self, item: ReleaseItem, waiter: Option<oneshot::Sender<()>>) -> bool {
        if item.lease_id.is_empty() {
            return false;
        }
        let id = item.lease_id.clone();
        *self
            .pending
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry(id.clone())
            .or_default() += 1;
        if self.tx.send(Msg::Item(item, waiter)).is_err() {
            settle(&self.pending, [id]);
            tracing::warn!("lease releaser already stopped; reconciliation will release the lease");
            return false;
        }
        true
    }

    /// Sends what is queued, retrying for up to `deadline`, and stops the task. Returns how
    /// many leases were left unreleased (reconciliation releases them later).
    pub async fn close(&self, deadline: Duration) -> usize {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Close(deadline, tx)).is_err() {
            return 0;
        }
        rx.await.unwrap_or(0)
    }
}

struct Closing {
    until: Instant,
    reply: oneshot::Sender<usize>,
}

/// Lease id → who waits for its release to settle.
type Waiters = std::collections::HashMap<String, Vec<oneshot::Sender<()>>>;

/// What the batching task holds between messages.
#[derive(Default)]
struct Queue {
    pending: Vec<ReleaseItem>,
    closing: Option<Closing>,
    waiters: Waiters,
}

impl Queue {
    /// Takes one message; true when it queued an item.
    fn take(&mut self, m: Option<Msg>) -> bool {
        match m {
            Some(Msg::Item(i, w)) => {
                if let Some(w) = w {
                    self.waiters.entry(i.lease_id.clone()).or_default().push(w);
                }
                self.pending.push(i);
                true
            }
            Some(Msg::Close(d, reply)) => {
                self.closing = Some(Closing {
                    until: Instant::now() + d,
                    reply,
                });
                false
            }
            None => false,
        }
    }

    /// Someone waits for a queued item: send without gathering.
    fn urgent(&self) -> bool {
        !self.waiters.is_empty()
    }

    /// Answers the waiters of every lease no longer queued or in flight.
    fn wake(&mut self, pending_ids: &Pending) {
        if self.waiters.is_empty() {
            return;
        }
        let p = pending_ids.lock().unwrap_or_else(|e| e.into_inner());
        self.waiters.retain(|id, ws| {
            if p.contains_key(id) {
                return true;
            }
            for w in ws.drain(..) {
                let _ = w.send(());
            }
            false
        });
    }
}

async fn run(
    sink: Arc<dyn LeaseSink>,
    cfg: BatchConfig,
    mut rx: mpsc::UnboundedReceiver<Msg>,
    pending_ids: Pending,
) {
    let mut q = Queue::default();
    let mut backoff = Duration::from_millis(100);
    loop {
        if q.pending.is_empty() {
            if let Some(c) = q.closing.take() {
                let _ = c.reply.send(0);
                return;
            }
            let first = rx.recv().await;
            if first.is_none() {
                return;
            }
            if q.take(first) && !q.urgent() {
                // Gather for up to `wait` or until a batch is full (or someone waits).
                let until = Instant::now() + cfg.wait;
                while q.pending.len() < cfg.max && q.closing.is_none() && !q.urgent() {
                    tokio::select! {
                        m = rx.recv() => if !q.take(m) { break },
                        _ = tokio::time::sleep_until(until) => break,
                    }
                }
            }
            continue;
        }
        while q.pending.len() < cfg.max {
            match rx.try_recv() {
                Ok(m) => {
                    q.take(Some(m));
                }
                Err(_) => break,
            }
        }
        let n = q.pending.len().min(cfg.max);
        let batch: Vec<ReleaseItem> = q.pending.drain(..n).collect();
        let mut settled: std::collections::HashMap<String, usize> = Default::default();
        for i in &batch {
            *settled.entry(i.lease_id.clone()).or_default() += 1;
        }
        let retry = send(sink.as_ref(), batch).await;
        for i in &retry {
            if let Some(n) = settled.get_mut(&i.lease_id) {
                *n = n.saturating_sub(1);
            }
        }
        settle(
            &pending_ids,
            settled
                .into_iter()
                .flat_map(|(id, n)| std::iter::repeat_n(id, n)),
        );
        q.wake(&pending_ids);
        if retry.is_empty() {
            backoff = Duration::from_millis(100);
            continue;
        }
        q.pending.splice(0..0, retry);
        if let Some(c) = &q.closing {
            if Instant::now() >= c.until {
                if let Some(c) = q.closing.take() {
                    tracing::warn!(
                        count = q.pending.len(),
                        "leases left unreleased at shutdown; reconciliation releases them"
                    );
                    let _ = c.reply.send(q.pending.len());
                }
                return;
            }
        }
        let mut until = Instant::now() + backoff;
        if let Some(c) = &q.closing {
            until = until.min(c.until);
        }
        backoff = (backoff * 2).min(cfg.max_backoff);
        loop {
            tokio::select! {
                m = rx.recv() => {
                    if m.is_none() { tokio::time::sleep_until(until).await; break }
                    q.take(m);
                }
                _ = tokio::time::sleep_until(until) => break,
            }
        }
    }
}

/// Sends one batch; returns the items to try again.
async fn send(sink: &dyn LeaseSink, batch: Vec<ReleaseItem>) -> Vec<ReleaseItem> {
    let (check, plain): (Vec<_>, Vec<_>) = batch.into_iter().partition(|i| i.verify.is_some());
    let mut retry = Vec::new();
    let mut go = plain;
    let looked = futures::future::join_all(check.iter().map(|i| sink.lookup(&i.lease_id))).await;
    for (item, r) in check.into_iter().zip(looked) {
        let (edge, sandbox) = item.verify.clone().unwrap_or_default();
        match r {
            Ok(Some(info)) if bound_here(&info, &edge, &sandbox) => go.push(item),
            Ok(Some(info)) => {
                tracing::debug!(lease = %item.lease_id, edge_id = %info.edge_id, "lease bound elsewhere; not released")
            }
            Ok(None) => tracing::debug!(lease = %item.lease_id, "lease already released"),
            Err(f) => {
                tracing::debug!(lease = %item.lease_id, error = %f, "lease lookup failed; will retry");
                retry.push(item);
            }
        }
    }
    let mut groups: std::collections::BTreeMap<i64, Vec<ReleaseItem>> = Default::default();
    for i in go {
        groups.entry(i.at).or_default().push(i);
    }
    for (at, items) in groups {
        let ids: Vec<String> = items.iter().map(|i| i.lease_id.clone()).collect();
        match sink.release(ids, at).await {
            Ok(()) => tracing::debug!(count = items.len(), "leases released"),
            Err(f) if matches!(f.reason, Reason::Invalid | Reason::NotFound) => {
                tracing::warn!(count = items.len(), error = %f, "IAM refused lease release; dropped");
            }
            Err(f) => {
                tracing::debug!(count = items.len(), error = %f, "lease release failed; will retry");
                retry.extend(items);
            }
        }
    }
    retry
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    #[derive(Default)]
    struct Fake {
        calls: Mutex<Vec<(Vec<String>, i64)>>,
        fail_first: Mutex<usize>,
        bindings: BTreeMap<String, pb::LeaseInfo>,
    }

    #[async_trait]
    impl LeaseSink for Fake {
        async fn release(&self, lease_ids: Vec<String>, at: i64) -> Result<(), Failure> {
            {
                let mut f = self.fail_first.lock().unwrap_or_else(|p| p.into_inner());
                if *f > 0 {
                    *f -= 1;
                    return Err(Failure::unavailable("iam down"));
                }
            }
            self.calls
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push((lease_ids, at));
            Ok(())
        }
        async fn lookup(&self, lease_id: &str) -> Result<Option<pb::LeaseInfo>, Failure> {
            Ok(self.bindings.get(lease_id).cloned())
        }
    }

    fn item(i: usize, at: i64) -> ReleaseItem {
        ReleaseItem {
            lease_id: format!("L{i}"),
            at,
            verify: None,
        }
    }

    fn released(f: &Fake) -> Vec<String> {
        let mut v: Vec<String> = f
            .calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .flat_map(|c| c.0.clone())
            .collect();
        v.sort();
        v
    }

    #[tokio::test]
    async fn batches_are_at_most_max_and_every_lease_goes_once() {
        let fake = Arc::new(Fake::default());
        let (r, h) = Releaser::spawn(fake.clone(), BatchConfig::default());
        for i in 0..2500 {
            r.release(item(i, 10));
        }
        assert_eq!(r.close(Duration::from_secs(10)).await, 0);
        let _ = h.await;
        let calls = fake.calls.lock().unwrap_or_else(|p| p.into_inner()).clone();
        assert!(calls.iter().all(|c| c.0.len() <= 1000 && c.1 == 10));
        assert!(calls.len() >= 3);
        let mut want: Vec<String> = (0..2500).map(|i| format!("L{i}")).collect();
        want.sort();
        assert_eq!(released(&fake), want);
    }

    #[tokio::test]
    async fn failures_are_retried_until_iam_answers() {
        let fake = Arc::new(Fake {
            fail_first: Mutex::new(3),
            ..Default::default()
        });
        let (r, h) = Releaser::spawn(
            fake.clone(),
            BatchConfig {
                max_backoff: Duration::from_millis(50),
                ..Default::default()
            },
        );
        for i in 0..5 {
            r.release(item(i, 7));
        }
        r.release(item(9, 8));
        assert_eq!(r.close(Duration::from_secs(20)).await, 0);
        let _ = h.await;
        assert_eq!(released(&fake), vec!["L0", "L1", "L2", "L3", "L4", "L9"]);
        let ats: Vec<i64> = fake
            .calls
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|c| c.1)
            .collect();
        assert!(
            ats.contains(&7) && ats.contains(&8),
            "one call per end time"
        );
    }

    #[tokio::test]
    async fn verified_items_go_only_when_bound_here() {
        let mut bindings = BTreeMap::new();
        let info = |edge: &str, sb: &str| pb::LeaseInfo {
            edge_id: edge.into(),
            sandbox_id: sb.into(),
            ..Default::default()
        };
        bindings.insert("L1".to_string(), info("e1", "e1.a"));
        bindings.insert("L2".to_string(), info("e2", "e2.b"));
        bindings.insert("L3".to_string(), info("", ""));
        let fake = Arc::new(Fake {
            bindings,
            ..Default::default()
        });
        let (r, h) = Releaser::spawn(fake.clone(), BatchConfig::default());
        for (l, s) in [
            ("L1", "e1.a"),
            ("L2", "e1.b"),
            ("L3", "e1.c"),
            ("L4", "e1.d"),
        ] {
            r.release(ReleaseItem {
                lease_id: l.into(),
                at: 1,
                verify: Some(("e1".into(), s.into())),
            });
        }
        assert_eq!(r.close(Duration::from_secs(10)).await, 0);
        let _ = h.await;
        assert_eq!(
            released(&fake),
            vec!["L1", "L3"],
            "L2 is bound to e2, L4 is gone"
        );
    }

    #[tokio::test]
    async fn close_gives_up_after_its_deadline_and_counts_what_is_left() {
        let fake = Arc::new(Fake {
            fail_first: Mutex::new(usize::MAX),
            ..Default::default()
        });
        let (r, h) = Releaser::spawn(fake.clone(), BatchConfig::default());
        r.release(item(1, 1));
        r.release(item(2, 1));
        assert_eq!(r.close(Duration::from_millis(300)).await, 2);
        let _ = h.await;
        assert!(released(&fake).is_empty());
    }
}
