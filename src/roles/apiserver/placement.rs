//! Placement (docs/architecture.md): filter the snapshot's edges, then power-of-k — draw k
//! candidates at random and take the least loaded. Each apiserver overlays on the snapshot
//! the sandboxes it just placed (not yet in the snapshot) and takes off those it just
//! stopped (still in it), and ranks edges that rejected a creation for lack of room last for
//! `reject_penalty` seconds. When nothing fits it tells `not_found` (no edge has the image or
//! backend) from `no_capacity` (every edge that could run it is full), with skip reasons.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use rand::seq::IndexedRandom;
use rand::Rng;

use crate::config::PlacementConfig;
use crate::pb;
use crate::roles::edge::freed::FreedReport;
use crate::types::{Failure, Reason, Res};

/// What placement needs to know of a request.
#[derive(Debug, Clone)]
pub struct Request<'a> {
    pub backend: &'a str,
    /// Edge-local image name (no `/`), checked against `EdgeState.images`; None = any edge.
    pub local_image: Option<&'a str>,
    pub res: Res,
    /// An edge to take whenever it fits and is not penalized (a fork's source node, whose
    /// layer cache already holds the copies' files: docs/images.md "Fork").
    pub prefer: Option<&'a str>,
}

/// One recent placement: when, what, and once the edge has answered, the edge state that
/// includes it (incarnation, admitted_seq).
struct Placed {
    at: Instant,
    /// What the request asked for: how the caller names this placement.
    res: Res,
    /// What it takes of the edge (`charged`), what the overlay counts.
    charge: Res,
    shown_by: Option<(String, u64)>,
    /// The sandbox, once created.
    sandbox_id: String,
}

/// One recent stop: when, and the edge states that still count it.
struct Stopped {
    at: Instant,
    report: FreedReport,
}

/// What the overlay adds to and takes off an edge state's allocation.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Extra {
    pub add: Res,
    pub sub: Res,
}

impl Extra {
    /// `e`'s allocation with the overlay applied (never below zero).
    fn alloc(&self, e: &pb::EdgeState) -> Res {
        let mut a = Res::from_pb(e.allocated.as_ref());
        a.add(&self.add);
        a.sub(&self.sub);
        a
    }
}

/// Recent placements not yet visible in the snapshot, recent stops the snapshot still
/// counts, and recent rejections.
#[derive(Default)]
pub struct Overlay {
    placed: HashMap<String, Vec<Placed>>,
    stopped: HashMap<String, Vec<Stopped>>,
    penalties: HashMap<String, Instant>,
}

impl Overlay {
    /// Counts a placement of `res` toward `edge`'s load as `charge` (what it takes of that
    /// edge, `charged`) until the snapshot shows it, for `grace` at most
    /// (docs/configuration.md `overlay_grace`). `remove` and `settle` name it by `res`.
    pub fn add(&mut self, edge: &str, res: Res, charge: Res) {
        self.placed
            .entry(edge.to_string())
            .or_default()
            .push(Placed {
                at: Instant::now(),
                res,
                charge,
                shown_by: None,
                sandbox_id: String::new(),
            });
    }
    /// Takes back a placement that did not happen (the edge rejected it).
    pub fn remove(&mut self, edge: &str, res: &Res) {
        if let Some(v) = self.placed.get_mut(edge) {
            if let Some(i) = v
                .iter()
                .rposition(|p| p.res == *res && p.shown_by.is_none())
            {
                v.swap_remove(i);
            }
        }
    }
    /// Records that the edge created sandbox `sandbox_id` of `res`: every state of edge
    /// process `incarnation` with `admitted_seq >= seq` counts it in `allocated`.
    pub fn settle(&mut self, edge: &str, res: &Res, incarnation: &str, seq: u64, sandbox_id: &str) {
        if let Some(v) = self.placed.get_mut(edge) {
            if let Some(p) = v.iter_mut().find(|p| p.res == *res && p.shown_by.is_none()) {
                p.shown_by = Some((incarnation.to_string(), seq));
                p.sandbox_id = sandbox_id.to_string();
            }
        }
    }
    /// Records that a stop of `sandbox_id` on `edge` gave `report.res` back. A placement
    /// of it the overlay still counts goes; states of that incarnation with `since_seq <=
    /// admitted_seq < seq` still count it, so placement takes it off theirs until the
    /// snapshot catches up (or `grace` passes).
    pub fn free(&mut self, edge: &str, sandbox_id: &str, report: FreedReport) {
        if let Some(v) = self.placed.get_mut(edge) {
            v.retain(|p| p.sandbox_id != sandbox_id);
        }
        self.stopped
            .entry(edge.to_string())
            .or_default()
            .push(Stopped {
                at: Instant::now(),
                report,
            });
    }
    /// Drops the placements and stops a new snapshot shows (or that a restarted edge
    /// reports for itself), so nothing is counted twice.
    pub fn observe(&mut self, snap: &pb::Snapshot) {
        for e in &snap.edges {
            if let Some(v) = self.placed.get_mut(&e.id) {
                v.retain(|p| !shows(e, p));
            }
            if let Some(v) = self.stopped.get_mut(&e.id) {
                v.retain(|s| {
                    s.report.incarnation == e.incarnation && e.admitted_seq < s.report.seq
                });
            }
        }
        self.placed.retain(|_, v| !v.is_empty());
        self.stopped.retain(|_, v| !v.is_empty());
    }
    /// Ranks `edge` last until `penalty` has passed.
    pub fn penalize(&mut self, edge: &str, penalty: Duration) {
        self.penalties
            .insert(edge.to_string(), Instant::now() + penalty);
    }
    /// Drops overlay entries older than `grace` and expired penalties.
    pub fn expire(&mut self, grace: Duration) {
        let now = Instant::now();
        self.placed.retain(|_, v| {
            v.retain(|p| now.duration_since(p.at) < grace);
            !v.is_empty()
        });
        self.stopped.retain(|_, v| {
            v.retain(|s| now.duration_since(s.at) < grace);
            !v.is_empty()
        });
        self.penalties.retain(|_, until| *until > now);
    }
    /// What the overlay changes in edge state `e`.
    pub fn extra(&self, e: &pb::EdgeState) -> Extra {
        let mut x = Extra::default();
        if let Some(v) = self.placed.get(&e.id) {
            // A placement `e` already counts is skipped here, not only dropped by the next
            // `observe`: the snapshot that shows it can arrive before the edge's answer
            // settles it, and no newer one comes while the edge stays unchanged.
            for p in v.iter().filter(|p| !shows(e, p)) {
                x.add.add(&p.charge);
            }
        }
        if let Some(v) = self.stopped.get(&e.id) {
            for s in v {
                let r = &s.report;
                if r.incarnation == e.incarnation
                    && r.since_seq <= e.admitted_seq
                    && e.admitted_seq < r.seq
                {
                    x.sub.add(&r.res);
                }
            }
        }
        x
    }
    fn penalized(&self, edge: &str) -> bool {
        self.penalties
            .get(edge)
            .is_some_and(|u| *u > Instant::now())
    }
}

/// Whether edge state `e` counts placement `p` itself: a state of the same edge process at or
/// after the admission that created it, or one of a restarted process (which reports what it
/// holds).
fn shows(e: &pb::EdgeState, p: &Placed) -> bool {
    match &p.shown_by {
        None => false,
        Some((inc, seq)) => *inc != e.incarnation || e.admitted_seq >= *seq,
    }
}

fn share(used: f64, cap: f64) -> f64 {
    if cap <= 0.0 {
        0.0
    } else {
        used / cap
    }
}

/// The load of an edge: the highest of its allocated share and its actual CPU and memory use;
/// actual use below `floor` does not count.
pub fn load(e: &pb::EdgeState, extra: &Extra, floor: f64) -> f64 {
    let cap = Res::from_pb(e.capacity.as_ref());
    let alloc = extra.alloc(e);
    let a = share(alloc.cpu_cores, cap.cpu_cores)
        .max(share(alloc.memory_mb as f64, cap.memory_mb as f64));
    let cpu = if e.cpu_usage < floor {
        0.0
    } else {
        e.cpu_usage
    };
    let mem = if e.mem_usage < floor {
        0.0
    } else {
        e.mem_usage
    };
    a.max(cpu).max(mem)
}

/// What `req` takes of edge `e`: its resources, with the memory its backend charges on that
/// edge (`EdgeState.memory_charges`: a microVM's guest floor and VMM overhead), the figure
/// the edge's own admission will charge. Quotas are charged `req.res` alone.
pub fn charged(e: &pb::EdgeState, req: &Request) -> Res {
    let mut r = req.res;
    if let Some(c) = e.memory_charges.get(req.backend) {
        r.memory_mb = crate::types::charged_memory_mb(c, r.memory_mb);
    }
    r
}

/// Why an edge could not take the request; counted into the error message.
fn skip_reason(e: &pb::EdgeState, req: &Request, extra: &Extra) -> Option<&'static str> {
    if !e.healthy {
        return Some("unhealthy");
    }
    if e.draining {
        return Some("draining");
    }
    if e.under_pressure {
        return Some("pressure");
    }
    let cap = Res::from_pb(e.capacity.as_ref());
    let alloc = extra.alloc(e);
    let want = charged(e, req);
    if cap.cpu_cores > 0.0 && alloc.cpu_cores + want.cpu_cores > cap.cpu_cores + 1e-9 {
        return Some("cpu");
    }
    if cap.memory_mb > 0 && alloc.memory_mb + want.memory_mb > cap.memory_mb {
        return Some("memory");
    }
    if want.gpus > 0 && alloc.gpus + want.gpus > cap.gpus {
        return Some("gpus");
    }
    if cap.disk_mb > 0 && alloc.disk_mb + want.disk_mb > cap.disk_mb {
        return Some("disk");
    }
    let max = e.max_sandboxes.get(req.backend).copied().unwrap_or(0);
    let have = e
        .sandboxes_by_backend
        .get(req.backend)
        .copied()
        .unwrap_or(0)
        .saturating_add(extra.add.sandboxes)
        .saturating_sub(extra.sub.sandboxes)
        .max(0);
    if max > 0 && have >= max {
        return Some("max_sandboxes");
    }
    None
}

/// Picks an edge for `req` from `snap`, power-of-`k` over the edges that fit, non-penalized
/// edges first. Errors: `not_found` when no edge offers the backend or image (`invalid` for a
/// backend no edge knows), `no_capacity` naming the skip reasons otherwise.
pub fn choose<R: Rng>(
    snap: &pb::Snapshot,
    overlay: &Overlay,
    req: &Request,
    k: usize,
    floor: f64,
    exclude: &[String],
    rng: &mut R,
) -> Result<String, Failure> {
    let mut offers_backend = false;
    let mut has_image = false;
    let mut skips: BTreeMap<&'static str, usize> = BTreeMap::new();
    let mut fit: Vec<(&pb::EdgeState, Extra)> = Vec::new();
    for e in &snap.edges {
        if !e.backends.iter().any(|b| b == req.backend) {
            continue;
        }
        offers_backend = true;
        if let Some(img) = req.local_image {
            if !e.images.iter().any(|i| i == img) {
                continue;
            }
        }
        has_image = true;
        if exclude.iter().any(|x| x == &e.id) {
            *skips.entry("rejected").or_default() += 1;
            continue;
        }
        let extra = overlay.extra(e);
        match skip_reason(e, req, &extra) {
            Some(why) => *skips.entry(why).or_default() += 1,
            None => fit.push((e, extra)),
        }
    }
    if !offers_backend {
        return Err(Failure::invalid(format!(
            "unknown backend {:?}: no edge offers it",
            req.backend
        )));
    }
    if !has_image {
        let img = req.local_image.unwrap_or_default();
        return Err(Failure::not_found(format!(
            "image {img:?} does not exist on any edge offering backend {:?}",
            req.backend
        )));
    }
    if fit.is_empty() {
        let why: Vec<String> = skips.iter().map(|(k, v)| format!("{k}: {v}")).collect();
        return Err(Failure::new(
            Reason::NoCapacity,
            format!(
                "no edge can take the sandbox now (skipped {})",
                why.join(", ")
            ),
        ));
    }
    if let Some(p) = req.prefer {
        if let Some((e, _)) = fit
            .iter()
            .find(|(e, _)| e.id == p && !overlay.penalized(&e.id))
        {
            return Ok(e.id.clone());
        }
    }
    let fresh: Vec<&(&pb::EdgeState, Extra)> = fit
        .iter()
        .filter(|(e, _)| !overlay.penalized(&e.id))
        .collect();
    let pool: Vec<&(&pb::EdgeState, Extra)> = if fresh.is_empty() {
        fit.iter().collect()
    } else {
        fresh
    };
    let k = k.max(1).min(pool.len());
    let picked: Vec<&&(&pb::EdgeState, Extra)> = pool.choose_multiple(rng, k).collect();
    let best = picked
        .into_iter()
        .min_by(|a, b| {
            load(a.0, &a.1, floor)
                .partial_cmp(&load(b.0, &b.1, floor))
                .unwrap_or(std::cmp::Ordering::Equal)
        })
        .map(|x| x.0.id.clone());
    best.ok_or_else(|| Failure::new(Reason::NoCapacity, "no edge can take the sandbox now"))
}

/// Placement parameters read from the config once.
#[derive(Debug, Clone)]
pub struct Params {
    pub k: usize,
    pub max_attempts: u32,
    pub reject_penalty: Duration,
    pub overlay_grace: Duration,
    pub usage_floor: f64,
}

impl Params {
    pub fn from_config(p: &PlacementConfig) -> Params {
        Params {
            k: p.k(),
            max_attempts: p.max_attempts(),
            reject_penalty: Duration::from_secs_f64(p.reject_penalty()),
            overlay_grace: Duration::from_secs_f64(p.overlay_grace()),
            usage_floor: p.usage_floor(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    fn edge(id: &str, cpu: f64, alloc_cpu: f64) -> pb::EdgeState {
        pb::EdgeState {
            id: id.into(),
            healthy: true,
            backends: vec!["sim".into()],
            capacity: Some(pb::Resources {
                cpu_cores: cpu,
                memory_mb: 1 << 20,
                ..Default::default()
            }),
            allocated: Some(pb::Resources {
                cpu_cores: alloc_cpu,
                ..Default::default()
            }),
            images: vec!["host".into()],
            ..Default::default()
        }
    }

    fn req(cpu: f64) -> Request<'static> {
        Request {
            backend: "sim",
            local_image: None,
            res: Res {
                cpu_cores: cpu,
                memory_mb: 1,
                sandboxes: 1,
                ..Default::default()
            },
            prefer: None,
        }
    }

    #[test]
    fn a_preferred_edge_is_taken_while_it_fits_and_skipped_once_full_or_penalized() {
        let snap = pb::Snapshot {
            edges: vec![edge("a", 10.0, 8.0), edge("b", 10.0, 1.0)],
            ..Default::default()
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let r = Request {
            prefer: Some("a"),
            ..req(1.0)
        };
        // The more loaded edge, because it is preferred.
        assert_eq!(
            choose(&snap, &Overlay::default(), &r, 2, 0.2, &[], &mut rng).unwrap(),
            "a"
        );
        // It cannot take 3 cores: the least loaded one instead.
        let big = Request {
            prefer: Some("a"),
            ..req(3.0)
        };
        assert_eq!(
            choose(&snap, &Overlay::default(), &big, 2, 0.2, &[], &mut rng).unwrap(),
            "b"
        );
        let mut ov = Overlay::default();
        ov.penalize("a", Duration::from_secs(60));
        assert_eq!(choose(&snap, &ov, &r, 2, 0.2, &[], &mut rng).unwrap(), "b");
    }

    #[test]
    fn a_backends_memory_charge_counts_in_placement_and_the_overlay_but_not_in_the_request() {
        // One edge of 1000 MiB whose `vm` backend takes max(M, 128) + 64 per sandbox.
        let mut e = edge("a", 10.0, 0.0);
        e.backends = vec!["vm".into(), "sim".into()];
        e.capacity = Some(pb::Resources {
            cpu_cores: 10.0,
            memory_mb: 1000,
            ..Default::default()
        });
        e.memory_charges.insert(
            "vm".into(),
            pb::MemoryCharge {
                floor_mb: 128,
                overhead_mb: 64,
            },
        );
        let snap = pb::Snapshot {
            edges: vec![e.clone()],
            ..Default::default()
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let vm = |mb: i64| Request {
            backend: "vm",
            res: Res {
                memory_mb: mb,
                ..req(1.0).res
            },
            ..req(1.0)
        };
        let ov = Overlay::default();
        assert_eq!(charged(&e, &vm(900)).memory_mb, 964);
        assert_eq!(charged(&e, &vm(16)).memory_mb, 192);
        // A backend without a charge takes its memory_limit_mb.
        let sim = Request {
            res: Res {
                memory_mb: 950,
                ..req(1.0).res
            },
            ..req(1.0)
        };
        assert_eq!(charged(&e, &sim).memory_mb, 950);
        assert_eq!(
            choose(&snap, &ov, &sim, 2, 0.2, &[], &mut rng).unwrap(),
            "a"
        );
        assert_eq!(
            choose(&snap, &ov, &vm(936), 2, 0.2, &[], &mut rng).unwrap(),
            "a"
        );
        // 937 + 64 is more than the edge has, though 937 alone fits.
        let f = choose(&snap, &ov, &vm(937), 2, 0.2, &[], &mut rng).unwrap_err();
        assert_eq!(f.reason, Reason::NoCapacity);
        assert!(f.message.contains("memory: 1"), "{}", f.message);
        // The overlay counts a placement's charge: after one of 16 MiB (192 charged) a
        // second of 16 fits, but one of 808 (872 charged) no longer does.
        let mut ov = Overlay::default();
        ov.add("a", vm(16).res, charged(&e, &vm(16)));
        assert_eq!(ov.extra(&e).add.memory_mb, 192);
        assert_eq!(
            choose(&snap, &ov, &vm(744), 2, 0.2, &[], &mut rng).unwrap(),
            "a"
        );
        let f = choose(&snap, &ov, &vm(745), 2, 0.2, &[], &mut rng).unwrap_err();
        assert_eq!(f.reason, Reason::NoCapacity);
        // It is named by what the request asked for.
        ov.remove("a", &vm(16).res);
        assert_eq!(ov.extra(&e).add.memory_mb, 0);
    }

    #[test]
    fn power_of_k_takes_the_least_loaded_of_all_when_k_covers_them() {
        let snap = pb::Snapshot {
            edges: vec![
                edge("a", 10.0, 9.0),
                edge("b", 10.0, 1.0),
                edge("c", 10.0, 5.0),
            ],
            ..Default::default()
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for _ in 0..20 {
            assert_eq!(
                choose(&snap, &Overlay::default(), &req(1.0), 3, 0.2, &[], &mut rng).unwrap(),
                "b"
            );
        }
    }

    #[test]
    fn full_edges_are_skipped_with_reasons() {
        let snap = pb::Snapshot {
            edges: vec![edge("a", 10.0, 10.0), edge("b", 10.0, 9.5)],
            ..Default::default()
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let e = choose(&snap, &Overlay::default(), &req(1.0), 2, 0.2, &[], &mut rng).unwrap_err();
        assert_eq!(e.reason, Reason::NoCapacity);
        assert!(e.message.contains("cpu: 2"), "{}", e.message);
    }

    #[test]
    fn missing_image_is_not_found_and_unknown_backend_invalid() {
        let snap = pb::Snapshot {
            edges: vec![edge("a", 10.0, 0.0)],
            ..Default::default()
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let r = Request {
            local_image: Some("nope"),
            ..req(1.0)
        };
        assert_eq!(
            choose(&snap, &Overlay::default(), &r, 2, 0.2, &[], &mut rng)
                .unwrap_err()
                .reason,
            Reason::NotFound
        );
        let r = Request {
            backend: "microvm",
            ..req(1.0)
        };
        assert_eq!(
            choose(&snap, &Overlay::default(), &r, 2, 0.2, &[], &mut rng)
                .unwrap_err()
                .reason,
            Reason::Invalid
        );
    }

    #[test]
    fn overlay_counts_until_the_snapshot_catches_up() {
        let snap = pb::Snapshot {
            edges: vec![edge("a", 2.0, 0.0)],
            ..Default::default()
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut ov = Overlay::default();
        ov.add("a", req(2.0).res, req(2.0).res);
        assert_eq!(
            choose(&snap, &ov, &req(1.0), 2, 0.2, &[], &mut rng)
                .unwrap_err()
                .reason,
            Reason::NoCapacity
        );
        ov.remove("a", &req(2.0).res);
        assert!(choose(&snap, &ov, &req(1.0), 2, 0.2, &[], &mut rng).is_ok());
    }

    #[test]
    fn a_placement_the_snapshot_shows_is_counted_once() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut ov = Overlay::default();
        let one = req(1.0).res;
        ov.add("a", one, one);
        ov.settle("a", &one, "inc-1", 7, "a.1");
        // A snapshot from before the creation: still counted.
        let mut before = edge("a", 2.0, 0.0);
        before.incarnation = "inc-1".into();
        before.admitted_seq = 6;
        let snap = pb::Snapshot {
            edges: vec![before],
            ..Default::default()
        };
        ov.observe(&snap);
        assert_eq!(ov.extra(&snap.edges[0]).add.cpu_cores, 1.0);
        // The snapshot shows it (1 core allocated): the overlay stops counting it, so a
        // second 1-core sandbox fits on the 2-core edge.
        let mut after = edge("a", 2.0, 1.0);
        after.incarnation = "inc-1".into();
        after.admitted_seq = 7;
        let snap = pb::Snapshot {
            edges: vec![after],
            ..Default::default()
        };
        ov.observe(&snap);
        assert_eq!(ov.extra(&snap.edges[0]).add.cpu_cores, 0.0);
        assert!(choose(&snap, &ov, &req(1.0), 2, 0.2, &[], &mut rng).is_ok());
        // An unanswered placement stays until the grace runs out; a restarted edge (new
        // incarnation) reports what it holds itself.
        ov.add("a", one, one);
        ov.observe(&snap);
        assert_eq!(ov.extra(&snap.edges[0]).add.cpu_cores, 1.0);
        ov.settle("a", &one, "inc-0", 99, "a.2");
        ov.observe(&snap);
        assert_eq!(ov.extra(&snap.edges[0]).add.cpu_cores, 0.0);
    }

    #[test]
    fn a_snapshot_that_shows_a_placement_before_it_settles_counts_it_once() {
        // The edge's new state reaches the snapshot before its answer to the creation does;
        // no newer snapshot follows while nothing changes on the edge.
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut ov = Overlay::default();
        let one = req(1.0).res;
        ov.add("a", one, one);
        let mut shown = edge("a", 2.0, 1.0);
        shown.incarnation = "inc-1".into();
        shown.admitted_seq = 7;
        let snap = pb::Snapshot {
            edges: vec![shown],
            ..Default::default()
        };
        ov.observe(&snap);
        ov.settle("a", &one, "inc-1", 7, "a.1");
        assert_eq!(ov.extra(&snap.edges[0]).add.cpu_cores, 0.0);
        assert!(choose(&snap, &ov, &req(1.0), 2, 0.2, &[], &mut rng).is_ok());
    }

    #[test]
    fn penalized_edges_come_last_but_are_not_excluded() {
        let snap = pb::Snapshot {
            edges: vec![edge("a", 10.0, 0.0), edge("b", 10.0, 5.0)],
            ..Default::default()
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut ov = Overlay::default();
        ov.penalize("a", Duration::from_secs(60));
        assert_eq!(
            choose(&snap, &ov, &req(1.0), 2, 0.2, &[], &mut rng).unwrap(),
            "b"
        );
        ov.penalize("b", Duration::from_secs(60));
        assert_eq!(
            choose(&snap, &ov, &req(1.0), 2, 0.2, &[], &mut rng).unwrap(),
            "a"
        );
    }

    #[test]
    fn a_stop_the_snapshot_still_counts_is_taken_off_until_it_catches_up() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let mut ov = Overlay::default();
        let two = req(2.0).res;
        // The snapshot was taken while the 2-core sandbox ran (seq 5), the stop made seq 6.
        let mut full = edge("a", 2.0, 2.0);
        full.incarnation = "inc-1".into();
        full.admitted_seq = 5;
        let snap = pb::Snapshot {
            edges: vec![full],
            ..Default::default()
        };
        assert_eq!(
            choose(&snap, &ov, &req(2.0), 2, 0.2, &[], &mut rng)
                .unwrap_err()
                .reason,
            Reason::NoCapacity
        );
        ov.free(
            "a",
            "a.x",
            FreedReport {
                incarnation: "inc-1".into(),
                since_seq: 4,
                seq: 6,
                res: two,
            },
        );
        assert!(choose(&snap, &ov, &req(2.0), 2, 0.2, &[], &mut rng).is_ok());
        // A state from before the sandbox existed (seq 3) does not count it: nothing to take off.
        let mut before = snap.edges[0].clone();
        before.admitted_seq = 3;
        before.allocated = Some(pb::Resources::default());
        assert_eq!(ov.extra(&before).sub, Res::default());
        // Another incarnation reports for itself.
        let mut other = snap.edges[0].clone();
        other.incarnation = "inc-2".into();
        assert_eq!(ov.extra(&other).sub, Res::default());
        // The snapshot that shows the stop drops it.
        let mut after = edge("a", 2.0, 0.0);
        after.incarnation = "inc-1".into();
        after.admitted_seq = 6;
        let snap = pb::Snapshot {
            edges: vec![after],
            ..Default::default()
        };
        ov.observe(&snap);
        assert_eq!(ov.extra(&snap.edges[0]), Extra::default());
        // Created and stopped between two snapshots: its placement goes, nothing is taken
        // off the snapshot (which never counted it).
        ov.add("a", two, two);
        ov.settle("a", &two, "inc-1", 8, "a.y");
        assert_eq!(ov.extra(&snap.edges[0]).add, two);
        ov.free(
            "a",
            "a.y",
            FreedReport {
                incarnation: "inc-1".into(),
                since_seq: 7,
                seq: 9,
                res: two,
            },
        );
        assert_eq!(ov.extra(&snap.edges[0]), Extra::default());
        assert!(choose(&snap, &ov, &req(2.0), 2, 0.2, &[], &mut rng).is_ok());
    }

    #[test]
    fn usage_below_the_floor_does_not_count() {
        let mut a = edge("a", 10.0, 0.0);
        a.cpu_usage = 0.15;
        assert_eq!(load(&a, &Extra::default(), 0.2), 0.0);
        a.cpu_usage = 0.5;
        assert_eq!(load(&a, &Extra::default(), 0.2), 0.5);
    }
}
