//! The reconciliation lock (docs/watcher.md "Several watchers"): every watcher probes and
//! serves snapshots, but only the one holding IAM's lock `watcher-reconcile` reconciles
//! quotas and sweeps unbound leases, so two watchers never release the same edge's leases
//! from views that differ.
//!
//! The holder renews every TTL/3 and counts itself the holder until "the time it sent the
//! request + TTL − 2 s" by its own clock. IAM gives the lock away only after "its proposer's
//! time + TTL", measured from a moment after the request was sent, so as long as clocks
//! differ by less than 2 s the old holder has stopped before another starts. A request that
//! fails for any reason other than another holder leaves the hold to run out on its own.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::pb;
use crate::rpc::failover::IamChannel;
use crate::shutdown::Shutdown;
use crate::types::Reason;

/// The IAM lock watchers elect their reconciler with.
pub const LOCK_NAME: &str = crate::roles::iam::apply_kv::RECONCILE_LOCK;
/// How much sooner than IAM a holder stops counting on its hold.
const MARGIN: Duration = Duration::from_secs(2);
/// How soon a failed request (other than another holder) is made again.
const RETRY: Duration = Duration::from_millis(500);

/// Whether this watcher holds the reconciliation lock: until when by its own clock, and
/// with which fence.
#[derive(Debug, Default)]
pub(crate) struct Leadership {
    held: Mutex<Option<(Instant, u64)>>,
}

impl Leadership {
    /// The fence of the hold while this watcher may reconcile, else `None`. Calls made under
    /// it carry the fence, so IAM refuses them once another watcher has the lock.
    pub fn fence(&self) -> Option<u64> {
        self.held
            .lock()
            .ok()
            .and_then(|h| *h)
            .filter(|(until, _)| Instant::now() < *until)
            .map(|(_, fence)| fence)
    }

    /// True while this watcher may reconcile.
    pub fn holds(&self) -> bool {
        self.fence().is_some()
    }

    fn set(&self, held: Option<(Instant, u64)>) {
        if let Ok(mut h) = self.held.lock() {
            *h = held;
        }
    }
}

/// Takes and renews the lock as `holder` (`watcher/<id>`) until shutdown (then [`release`]
/// frees it, once reconciliation has stopped). `ttl`: `watcher.lock_ttl`, at least 3 s.
pub(crate) async fn run(
    leadership: std::sync::Arc<Leadership>,
    mut iam: pb::iam_client::IamClient<IamChannel>,
    holder: String,
    ttl: Duration,
    service_token: String,
    shutdown: Shutdown,
) {
    // Three renewals fit in a hold, so one or two lost requests do not end it.
    let every = ttl.saturating_sub(MARGIN) / 3;
    let mut held = false;
    loop {
        let sent = Instant::now();
        let mut req = crate::rpc::client::internal(
            pb::LockRequest {
                name: LOCK_NAME.into(),
                holder: holder.clone(),
                ttl_ms: ttl.as_millis() as i64,
            },
            &service_token,
        );
        // An answer later than the next renewal is not counted on.
        req.set_timeout(every);
        let r = tokio::select! {
            r = iam.lock(req) => r,
            _ = shutdown.wait() => break,
        };
        // After a failure (IAM starting, or electing a leader) ask again soon: a hold
        // runs out after TTL − 2 s, and a watcher starting up should not wait TTL/3.
        let mut next = every;
        match r {
            Ok(r) => {
                leadership.set(Some((sent + ttl.saturating_sub(MARGIN), r.get_ref().fence)));
                if !held {
                    tracing::info!(holder = %holder, fence = r.get_ref().fence, "took the reconciliation lock");
                    metrics::gauge!("opendsec_watcher_leader").set(1.0);
                    held = true;
                }
            }
            Err(s) if crate::rpc::status::failure_from_status(&s).reason == Reason::Conflict => {
                leadership.set(None);
                if held {
                    tracing::warn!(holder = %holder, error = %s.message(), "lost the reconciliation lock");
                    held = false;
                }
                metrics::gauge!("opendsec_watcher_leader").set(0.0);
                tracing::debug!(error = %s.message(), "another watcher reconciles");
            }
            // The hold, if any, runs out by itself (`Leadership::holds`).
            Err(s) => {
                tracing::debug!(error = %s.message(), "renewing the reconciliation lock failed");
                next = next.min(RETRY);
                if held && !leadership.holds() {
                    tracing::warn!(holder = %holder, error = %s.message(), "the reconciliation lock's hold ran out: IAM did not renew it");
                    metrics::gauge!("opendsec_watcher_leader").set(0.0);
                    held = false;
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(next.saturating_sub(sent.elapsed())) => {},
            _ = shutdown.wait() => break,
        }
    }
    metrics::gauge!("opendsec_watcher_leader").set(0.0);
}

/// Frees the lock if this watcher holds it, so another takes over at its next request
/// rather than after the TTL. Call it once reconciliation has stopped: a round still
/// running must not overlap the next holder's.
pub(crate) async fn release(
    leadership: &Leadership,
    mut iam: pb::iam_client::IamClient<IamChannel>,
    holder: String,
    service_token: &str,
) {
    if !leadership.holds() {
        return;
    }
    leadership.set(None);
    let mut req = crate::rpc::client::internal(
        pb::UnlockRequest {
            name: LOCK_NAME.into(),
            holder: holder.clone(),
        },
        service_token,
    );
    req.set_timeout(Duration::from_secs(1));
    // Bounded: without an IAM majority the call would be resent for IAM's whole patience,
    // and the others take the lock anyway once the hold runs out.
    match tokio::time::timeout(Duration::from_secs(2), iam.unlock(req)).await {
        Ok(Ok(_)) => tracing::info!(holder = %holder, "freed the reconciliation lock"),
        Ok(Err(s)) => {
            tracing::warn!(error = %s.message(), "could not free the reconciliation lock; the others take it when its hold runs out")
        }
        Err(_) => {
            tracing::warn!("IAM did not answer in 2 s; the reconciliation lock is left to run out")
        }
    }
}
