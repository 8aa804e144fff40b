//! Creation (docs/architecture.md): place first, then admit (one IAM
//! `Admit` authenticates, authorizes and reserves quota for a whole chunk), then create on the
//! chosen edges; an edge answering `no_capacity` or `unavailable` is penalized and the items
//! go to another edge (the lease rebound in IAM), up to `max_attempts`; leases of items that
//! end up nowhere are released.
//!
//! Idempotency: a lease id is derived from (principal, project, idempotency key, index), and
//! the sandbox id from the lease id, so a retried creation finds its lease in IAM (`existed`)
//! and goes back to the edge that holds it, whose create is idempotent per sandbox id.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::auth::Caller;
use super::placement::{self, Request};
use super::Inner;
use crate::pb;
use crate::rpc::{client, failure_from_status};
use crate::types::{names, Failure, Reason, Res};

/// One sandbox to create.
#[derive(Debug, Clone)]
pub(crate) struct Item {
    pub index: u32,
    pub lease_id: String,
    suffix: String,
}

/// Derives the items of a creation from its idempotency key.
pub(crate) fn items(
    caller: &Caller,
    project: &str,
    key: &str,
    indices: impl Iterator<Item = u32>,
) -> Vec<Item> {
    indices
        .map(|i| {
            let mut h = Sha256::new();
            for part in [
                caller.principal.as_bytes(),
                project.as_bytes(),
                key.as_bytes(),
                &i.to_le_bytes(),
            ] {
                h.update((part.len() as u64).to_le_bytes());
                h.update(part);
            }
            let digest: [u8; 32] = h.finalize().into();
            let lease_id = hex::encode(&digest[..16]);
            let suffix = lease_id[..16].to_string();
            Item {
                index: i,
                lease_id,
                suffix,
            }
        })
        .collect()
}

/// A creation's fixed parts.
pub(crate) struct Job<'a> {
    pub caller: &'a Caller,
    pub project: &'a str,
    pub spec: &'a pb::SandboxSpec,
    /// A fork's copies: the files they start from, and the source's edge, preferred.
    pub fork: Option<&'a Fork>,
}

/// What makes a batch a fork (docs/images.md "Fork").
#[derive(Debug, Clone)]
pub(crate) struct Fork {
    pub files: pb::ForkFiles,
    pub source_edge: String,
}

struct Live {
    item: Item,
    edge: String,
    /// Edges that refused it (no room, unreachable): tried elsewhere first.
    tried: Vec<String>,
    admitted: bool,
}

fn sandbox_id(edge: &str, item: &Item) -> String {
    format!("{edge}.{}", item.suffix)
}

impl Inner {
    fn place(
        &self,
        snap: &pb::Snapshot,
        req: &Request,
        exclude: &[String],
    ) -> Result<String, Failure> {
        let mut rng = rand::rng();
        let mut ov = self.overlay.lock().unwrap_or_else(|p| p.into_inner());
        let edge = placement::choose(
            snap,
            &ov,
            req,
            self.k,
            self.params.usage_floor,
            exclude,
            &mut rng,
        )?;
        let charge = snap
            .edges
            .iter()
            .find(|e| e.id == edge)
            .map_or(req.res, |e| placement::charged(e, req));
        ov.add(&edge, req.res, charge);
        Ok(edge)
    }

    /// Places an item again after edges refused it: on an edge it has not tried if one
    /// fits, else back on one that refused it but has room now by the snapshot and the
    /// overlay (ranked last while penalized), so that a one-edge cluster never runs out of
    /// candidates because its only edge once said no.
    fn replace(
        &self,
        snap: &pb::Snapshot,
        req: &Request,
        tried: &[String],
    ) -> Result<String, Failure> {
        match self.place(snap, req, tried) {
            Err(f) if f.reason == Reason::NoCapacity && !tried.is_empty() => {
                self.place(snap, req, &[]).map_err(|_| f)
            }
            r => r,
        }
    }

    fn unplace(&self, edge: &str, res: &Res, penalize: bool) {
        let mut ov = self.overlay.lock().unwrap_or_else(|p| p.into_inner());
        ov.remove(edge, res);
        if penalize {
            ov.penalize(edge, self.params.reject_penalty);
        }
    }

    fn edge_addr(snap: &pb::Snapshot, edge: &str) -> Option<String> {
        snap.edges
            .iter()
            .find(|e| e.id == edge)
            .map(|e| e.addr.clone())
    }

    /// Admits `live` (bound to their current edges). Whole-call failures (authentication,
    /// IAM down) come back as `Err`; per-item failures are returned as failed items.
    async fn admit(
        &self,
        job: &Job<'_>,
        live: &mut Vec<Live>,
        res: &Res,
        keep_binding: bool,
        done: &mut Vec<(u32, Result<pb::Sandbox, Failure>)>,
    ) -> Result<(), Failure> {
        if live.is_empty() {
            return Ok(());
        }
        let image_project = names::image_project(&job.spec.image)
            .unwrap_or_default()
            .to_string();
        // Ties the idempotency key to this spec: the same key with another is `conflict`.
        let digest = crate::types::spec_digest::spec_digest(job.spec);
        let items = live
            .iter()
            .map(|l| pb::AdmitItem {
                lease_id: l.item.lease_id.clone(),
                project: job.project.to_string(),
                resources: Some(res.to_pb()),
                edge_id: l.edge.clone(),
                sandbox_id: sandbox_id(&l.edge, &l.item),
                keep_binding,
                spec_digest: digest.clone(),
            })
            .collect();
        let req = pb::AdmitRequest {
            token: job.caller.token.clone(),
            client_addr: job.caller.client_addr.clone(),
            image_project,
            items,
        };
        let resp = self
            .iam
            .clone()
            .admit(client::internal(req, &self.cfg.service_token))
            .await
            .map_err(|s| failure_from_status(&s))?
            .into_inner();
        let by_id: HashMap<String, pb::AdmitResult> = resp
            .results
            .into_iter()
            .map(|r| (r.lease_id.clone(), r))
            .collect();
        let mut keep = Vec::with_capacity(live.len());
        for mut l in live.drain(..) {
            match by_id.get(&l.item.lease_id) {
                None => {
                    self.unplace(&l.edge, res, false);
                    done.push((
                        l.item.index,
                        Err(Failure::internal("IAM did not answer for this lease")),
                    ));
                }
                Some(r) => match &r.error {
                    Some(e) => {
                        self.unplace(&l.edge, res, false);
                        done.push((
                            l.item.index,
                            Err(crate::rpc::status::failure_from_detail(e)),
                        ));
                    }
                    None => {
                        l.admitted = true;
                        // A retry: the lease stayed on the edge that holds it; go back there.
                        if keep_binding && r.existed && !r.edge_id.is_empty() && r.edge_id != l.edge
                        {
                            self.unplace(&l.edge, res, false);
                            l.edge = r.edge_id.clone();
                        }
                        keep.push(l);
                    }
                },
            }
        }
        *live = keep;
        Ok(())
    }

    /// Releases the leases of items created nowhere: `(lease id, made nothing)`, where "made
    /// nothing" (`made_nothing`) takes the admission back from the usage report too.
    async fn release(&self, leases: Vec<(String, bool)>) {
        let (refused, failed): (Vec<_>, Vec<_>) = leases.into_iter().partition(|(_, n)| *n);
        for (group, not_created) in [(refused, true), (failed, false)] {
            if group.is_empty() {
                continue;
            }
            let lease_ids = group.into_iter().map(|(id, _)| id).collect();
            let req = client::internal(
                pb::ReleaseLeasesRequest {
                    lease_ids,
                    at: 0,
                    not_created,
                },
                &self.cfg.service_token,
            );
            if let Err(s) = self.iam.clone().release_leases(req).await {
                // The watcher's reconciliation and SweepUnbound return them later.
                tracing::warn!(error = %s.message(), "releasing leases of failed creations failed");
            }
        }
    }

    /// Creates every item; returns one result per item (any order). `Err` only for a failure
    /// of the whole call before anything was created (authentication, permission, IAM down).
    pub(crate) async fn create_items(
        &self,
        job: &Job<'_>,
        items: Vec<Item>,
    ) -> Result<Vec<(u32, Result<pb::Sandbox, Failure>)>, Failure> {
        let res = Res::of_spec(job.spec);
        let local_image = if job.spec.image.is_empty() || job.spec.image.contains('/') {
            None
        } else {
            Some(job.spec.image.as_str())
        };
        let req = Request {
            backend: &job.spec.backend,
            local_image,
            res,
            prefer: job.fork.map(|f| f.source_edge.as_str()),
        };
        let snap = self.current_snapshot().await?;
        let mut done = Vec::with_capacity(items.len());
        let mut live = Vec::with_capacity(items.len());
        for it in items {
            match self.place(&snap, &req, &[]) {
                Ok(edge) => live.push(Live {
                    item: it,
                    edge,
                    tried: Vec::new(),
                    admitted: false,
                }),
                Err(f) => done.push((it.index, Err(f))),
            }
        }
        // An image or backend nobody has fails every item alike: say it once, create nothing.
        if live.is_empty() {
            if let Some((_, Err(f))) = done.first() {
                if matches!(f.reason, Reason::Invalid | Reason::NotFound) {
                    return Err(f.clone());
                }
            }
            return Ok(done);
        }
        self.admit(job, &mut live, &res, true, &mut done).await?;
        let mut attempt = 1;
        while !live.is_empty() {
            let mut by_edge: BTreeMap<String, Vec<Live>> = BTreeMap::new();
            for l in live.drain(..) {
                by_edge.entry(l.edge.clone()).or_default().push(l);
            }
            let calls = by_edge.into_iter().map(|(edge, group)| {
                let snap = snap.clone();
                async move {
                    let items: Vec<pb::EdgeCreateItem> = group
                        .iter()
                        .map(|l| pb::EdgeCreateItem {
                            sandbox_id: sandbox_id(&edge, &l.item),
                            lease_id: l.item.lease_id.clone(),
                            project: job.project.to_string(),
                            principal: job.caller.principal.clone(),
                        })
                        .collect();
                    let outcome = match Self::edge_addr(&snap, &edge) {
                        None => Err(Failure::unavailable(format!(
                            "edge {edge} is not in the cluster snapshot"
                        ))),
                        Some(addr) => match self.edges.edge(&addr) {
                            Err(f) => Err(f),
                            Ok(mut c) => c
                                .create_sandboxes(self.edges.req(pb::EdgeCreateRequest {
                                    spec: Some(job.spec.clone()),
                                    items,
                                    fork: job.fork.map(|f| f.files.clone()),
                                }))
                                .await
                                .map(|r| r.into_inner())
                                .map_err(|s| failure_from_status(&s)),
                        },
                    };
                    (edge, group, outcome)
                }
            });
            let outcomes = futures::future::join_all(calls).await;
            let mut retry = Vec::new();
            let mut release = Vec::new();
            for (edge, group, outcome) in outcomes {
                match outcome {
                    Err(f) => {
                        let again = matches!(
                            f.reason,
                            Reason::Unavailable | Reason::NoCapacity | Reason::Timeout
                        );
                        for mut l in group {
                            self.unplace(&edge, &res, again);
                            if again && attempt < self.params.max_attempts {
                                l.tried.push(edge.clone());
                                retry.push((l, f.clone()));
                            } else {
                                release.push((l.item.lease_id.clone(), made_nothing(&f)));
                                done.push((l.item.index, Err(f.clone())));
                            }
                        }
                    }
                    Ok(resp) => {
                        let (inc, seq) = (resp.incarnation, resp.admitted_seq);
                        let mut results = resp.results.into_iter();
                        for mut l in group {
                            match results.next() {
                                Some(pb::EdgeCreateResult {
                                    sandbox: Some(sb),
                                    error: None,
                                }) => {
                                    self.overlay
                                        .lock()
                                        .unwrap_or_else(|p| p.into_inner())
                                        .settle(&edge, &res, &inc, seq, &sb.id);
                                    self.remember_owner(&sb);
                                    done.push((l.item.index, Ok(sb)));
                                }
                                other => {
                                    let f = match other.and_then(|r| r.error) {
                                        Some(e) => crate::rpc::status::failure_from_detail(&e),
                                        None => Failure::internal(
                                            "edge gave no result for this sandbox",
                                        ),
                                    };
                                    // No room (or the edge going away) ranks the edge
                                    // last for a while and tries elsewhere. A failure of
                                    // this one creation (`internal`) says nothing of the
                                    // edge's room: no penalty, and the item stays failed
                                    // (its lease is the edge's to release; moving it now
                                    // would race that release).
                                    let refused = matches!(
                                        f.reason,
                                        Reason::NoCapacity | Reason::Unavailable
                                    );
                                    self.unplace(&edge, &res, refused);
                                    if refused && attempt < self.params.max_attempts {
                                        l.tried.push(edge.clone());
                                        retry.push((l, f));
                                    } else {
                                        release.push((l.item.lease_id.clone(), made_nothing(&f)));
                                        done.push((l.item.index, Err(f)));
                                    }
                                }
                            }
                        }
                    }
                }
            }
            attempt += 1;
            if !retry.is_empty() {
                metrics::counter!("opendsec_apiserver_placement_retries_total")
                    .increment(retry.len() as u64);
                let snap_now = self.snapshot.read().await.clone();
                for (mut l, last) in retry {
                    match self.replace(&snap_now, &req, &l.tried) {
                        Ok(edge) => {
                            l.edge = edge;
                            live.push(l);
                        }
                        Err(f) => {
                            release.push((l.item.lease_id.clone(), made_nothing(&last)));
                            done.push((l.item.index, Err(replacement_failure(f, last))));
                        }
                    }
                }
                // Rebind the moved leases to their new edges.
                if let Err(f) = self.admit(job, &mut live, &res, false, &mut done).await {
                    for l in live.drain(..) {
                        // Refused where it was last sent, or never answered: not known.
                        release.push((l.item.lease_id.clone(), false));
                        done.push((l.item.index, Err(f.clone())));
                    }
                }
            }
            self.release(release).await;
        }
        Ok(done)
    }
}

/// Whether an edge's answer `f` to a creation means it made nothing: a refusal (`invalid`,
/// `no_capacity`, ...) does; `internal` (the creation was tried and failed), `unavailable`
/// and `timeout` (the edge may have made it before the answer was lost) do not.
fn made_nothing(f: &Failure) -> bool {
    !matches!(
        f.reason,
        Reason::Internal | Reason::Unavailable | Reason::Timeout
    )
}

/// The failure of an item whose edge failed with `last` and for which no other edge was
/// found (`placing`). An edge that was unreachable (restarting) is not a lack of capacity:
/// the item fails `unavailable`, which callers retry, unless placement failed for a reason
/// of its own (`invalid`, `not_found`). An edge that was full stays `no_capacity`; one
/// whose creation failed (`internal`) stays `internal`.
fn replacement_failure(placing: Failure, last: Failure) -> Failure {
    // A creation that failed on its edge and found no other stays that failure: the
    // cluster did not run out of room.
    if last.reason == Reason::Internal && placing.reason == Reason::NoCapacity {
        return last;
    }
    let transient = matches!(last.reason, Reason::Unavailable | Reason::Timeout);
    if transient && placing.reason == Reason::NoCapacity {
        return Failure::new(
            Reason::Unavailable,
            format!(
                "{}; no other edge could take it ({})",
                last.message, placing.message
            ),
        );
    }
    placing
}

/// Runs a creation of `items` in chunks, at most `parallel` chunks at once, sending each
/// item's result as soon as it is known.
pub(crate) async fn run_batch(
    inner: Arc<Inner>,
    caller: Caller,
    project: String,
    spec: pb::SandboxSpec,
    fork: Option<Fork>,
    items: Vec<Item>,
    tx: tokio::sync::mpsc::Sender<Result<pb::CreateSandboxesItem, tonic::Status>>,
) {
    use futures::StreamExt;
    const CHUNK: usize = 512;
    let chunks: Vec<Vec<Item>> = items.chunks(CHUNK).map(|c| c.to_vec()).collect();
    let caller = &caller;
    let project = project.as_str();
    let spec = &spec;
    let fork = fork.as_ref();
    let inner = &inner;
    let tx = &tx;
    let mut fatal: Option<Failure> = None;
    let mut s = futures::stream::iter(chunks.into_iter().map(|chunk| async move {
        // The caller has gone (a deadline, a broken connection): create nothing more. Its retry
        // with the same key creates what is missing; chunks already started finish.
        if tx.is_closed() {
            return None;
        }
        inner
            .creates
            .take(&caller.principal, chunk.len() as f64)
            .await;
        if tx.is_closed() {
            return None;
        }
        let _permits = match &inner.inflight {
            Some(sem) => sem
                .clone()
                .acquire_many_owned(chunk.len() as u32)
                .await
                .ok(),
            None => None,
        };
        let job = Job {
            caller,
            project,
            spec,
            fork,
        };
        let indices: Vec<u32> = chunk.iter().map(|i| i.index).collect();
        match inner.create_items(&job, chunk).await {
            Ok(results) => {
                for (index, r) in results {
                    let item = match r {
                        Ok(sb) => pb::CreateSandboxesItem {
                            index,
                            sandbox: Some(sb),
                            error: None,
                        },
                        Err(f) => pb::CreateSandboxesItem {
                            index,
                            sandbox: None,
                            error: Some(crate::rpc::status::error_detail(&f)),
                        },
                    };
                    if tx.send(Ok(item)).await.is_err() {
                        return None;
                    }
                }
                None
            }
            Err(f) => {
                // `unavailable` (no snapshot yet, IAM unreachable) ends the stream too: the SDK
                // then asks again with the same key, instead of taking per-item errors as final.
                if matches!(
                    f.reason,
                    Reason::Unauthenticated
                        | Reason::Forbidden
                        | Reason::Invalid
                        | Reason::NotFound
                        | Reason::Unavailable
                ) {
                    return Some(f);
                }
                for index in indices {
                    let item = pb::CreateSandboxesItem {
                        index,
                        sandbox: None,
                        error: Some(crate::rpc::status::error_detail(&f)),
                    };
                    if tx.send(Ok(item)).await.is_err() {
                        return None;
                    }
                }
                None
            }
        }
    }))
    .buffer_unordered(4);
    while let Some(r) = s.next().await {
        if let Some(f) = r {
            fatal = Some(f);
            break;
        }
    }
    if let Some(f) = fatal {
        let _ = tx.send(Err(crate::rpc::to_status(&f))).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caller(p: &str) -> Caller {
        Caller {
            principal: p.into(),
            project: "root".into(),
            token: String::new(),
            client_addr: String::new(),
            grant: None,
        }
    }

    #[test]
    fn an_unreachable_edge_with_nowhere_else_to_go_is_unavailable_not_no_capacity() {
        let placing = Failure::new(
            Reason::NoCapacity,
            "no edge can take the sandbox now (skipped rejected: 1)",
        );
        let f = replacement_failure(
            placing.clone(),
            Failure::unavailable("edge e1: connection refused"),
        );
        assert_eq!(f.reason, Reason::Unavailable);
        assert!(
            f.message.contains("connection refused") && f.message.contains("skipped rejected: 1"),
            "{}",
            f.message
        );
        assert_eq!(
            replacement_failure(placing.clone(), Failure::new(Reason::Timeout, "t")).reason,
            Reason::Unavailable
        );
        // A full edge stays no_capacity; placement's own verdicts stay as they are.
        assert_eq!(
            replacement_failure(placing, Failure::new(Reason::NoCapacity, "edge e1: full")).reason,
            Reason::NoCapacity
        );
        assert_eq!(
            replacement_failure(Failure::invalid("bad"), Failure::unavailable("x")).reason,
            Reason::Invalid
        );
        let e = replacement_failure(
            Failure::new(Reason::NoCapacity, "skipped rejected: 1"),
            Failure::internal("attach loop device: busy"),
        );
        assert_eq!(e.reason, Reason::Internal);
        assert!(e.message.contains("attach loop device"), "{}", e.message);
    }

    #[test]
    fn lease_ids_are_stable_per_key_and_distinct_across_indices_and_principals() {
        let a = items(&caller("a"), "root", "k", 0..3);
        let again = items(&caller("a"), "root", "k", 0..3);
        let other = items(&caller("b"), "root", "k", 0..3);
        assert_eq!(a[1].lease_id, again[1].lease_id);
        assert_ne!(a[0].lease_id, a[1].lease_id);
        assert_ne!(a[0].lease_id, other[0].lease_id);
        assert_eq!(
            sandbox_id("e1", &a[0]),
            format!("e1.{}", &a[0].lease_id[..16])
        );
    }
}
