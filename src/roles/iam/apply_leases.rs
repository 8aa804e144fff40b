//! Quota lease commands (docs/concepts.md, docs/architecture.md): `Admit` (authenticate, authorize and
//! reserve, item by item, idempotent per lease id), `ReleaseLeases`, `Reconcile` with an
//! edge's report, and `SweepUnbound`. Batches cost O(items × depth).

use std::collections::{HashMap, HashSet};

use super::apply::{actor, require_bootstrapped};
use super::command::{AdmitItem, Admitted, LeaseReport, Outcome};
use super::state::{check_id, check_res, Actor, IamState, Lease};
use super::usage;
use crate::types::{names, Failure, Res};

/// Largest batch of one command (the apiserver sends at most 32768 items).
pub const MAX_BATCH: usize = 65536;

fn check_batch(n: usize) -> Result<(), Failure> {
    if n > MAX_BATCH {
        return Err(Failure::invalid(format!(
            "batch of {n} items exceeds {MAX_BATCH}"
        )));
    }
    Ok(())
}

fn check_edge(edge: &str) -> Result<(), Failure> {
    if edge.is_empty() {
        Ok(())
    } else {
        names::check_edge_id(edge)
    }
}

fn check_sandbox_id(id: &str) -> Result<(), Failure> {
    if id.is_empty() {
        Ok(())
    } else {
        check_id("sandbox id", id)
    }
}

/// What one lease holds: its resources, counted as exactly one sandbox.
fn lease_res(r: &Res) -> Res {
    Res { sandboxes: 1, ..*r }
}

pub(super) fn admit(
    st: &mut IamState,
    a: &Actor,
    image_project: &str,
    items: &[AdmitItem],
    now: i64,
) -> Result<Outcome, Failure> {
    actor(st, a, now)?;
    check_batch(items.len())?;
    st.prune_released(now);
    let principal = a.principal.clone();
    // layer.use on the image's project applies to every item alike.
    let image_ok: Result<(), Failure> = if image_project.is_empty() {
        Ok(())
    } else {
        names::check_project_path(image_project)
            .and_then(|_| st.require(&principal, image_project, "layer.use"))
    };
    // sandbox.create per project, checked once per distinct project of the batch.
    let mut create_ok: HashMap<&str, Result<(), Failure>> = HashMap::new();
    let mut seen: HashSet<&str> = HashSet::new();
    let mut results = Vec::with_capacity(items.len());
    for it in items {
        let r = (|| {
            check_id("lease id", &it.lease_id)?;
            if !seen.insert(&it.lease_id) {
                return Err(Failure::invalid(format!(
                    "lease {} appears twice in one batch",
                    it.lease_id
                )));
            }
            check_edge(&it.edge_id)?;
            check_sandbox_id(&it.sandbox_id)?;
            check_res(&it.resources)?;
            let auth = create_ok.entry(&it.project).or_insert_with(|| {
                st.project(&it.project)?;
                st.require(&principal, &it.project, "sandbox.create")
            });
            auth.clone()?;
            image_ok.clone()?;
            admit_one(st, &principal, it, now)
        })();
        results.push(r);
    }
    Ok(Outcome::Admitted { principal, results })
}

/// Reserves (or rebinds) one checked item.
fn admit_one(
    st: &mut IamState,
    principal: &str,
    it: &AdmitItem,
    now: i64,
) -> Result<Admitted, Failure> {
    if let Some(l) = st.leases.get(&it.lease_id) {
        if l.project != it.project {
            return Err(Failure::conflict(format!(
                "lease {} is held in project {}, not {}",
                it.lease_id, l.project, it.project
            )));
        }
        if !l.spec_digest.is_empty()
            && !it.spec_digest.is_empty()
            && l.spec_digest != it.spec_digest
        {
            return Err(Failure::conflict(format!(
                "idempotency_key already made sandbox {} with a different spec; use a new key for a new sandbox",
                l.sandbox_id
            )));
        }
        let prev = Admitted {
            existed: true,
            prev_edge_id: l.edge_id.clone(),
            prev_sandbox_id: l.sandbox_id.clone(),
        };
        let keep = it.keep_binding && !l.edge_id.is_empty();
        if !keep
            && !it.edge_id.is_empty()
            && (l.edge_id != it.edge_id || l.sandbox_id != it.sandbox_id)
        {
            let old_edge = l.edge_id.clone();
            st.index_remove(&old_edge, &it.lease_id);
            st.index_add(&it.edge_id, &it.lease_id);
            if let Some(l) = st.leases.get_mut(&it.lease_id) {
                l.edge_id = it.edge_id.clone();
                l.sandbox_id = it.sandbox_id.clone();
                l.bound_at = now;
            }
        }
        return Ok(prev);
    }
    if let Some(t) = st.released.get(&it.lease_id) {
        if now < *t {
            // Made before the lease was released: a late copy of a resent admission,
            // whose caller was answered long ago. A retry made after the release (the
            // same idempotency key after a failed creation) is a new admission.
            return Err(Failure::conflict(format!(
                "lease {} was released after this admission was made",
                it.lease_id
            )));
        }
    }
    let res = lease_res(&it.resources);
    st.check_quota(&it.project, &res)?;
    st.charge(&it.project, &res);
    let bound_at = if it.edge_id.is_empty() { 0 } else { now };
    st.leases.insert(
        it.lease_id.clone(),
        Lease {
            project: it.project.clone(),
            principal: principal.to_string(),
            resources: res,
            edge_id: it.edge_id.clone(),
            sandbox_id: it.sandbox_id.clone(),
            created_at: now,
            bound_at,
            spec_digest: it.spec_digest.clone(),
        },
    );
    st.index_add(&it.edge_id, &it.lease_id);
    usage::record_started(st, &it.project, now);
    Ok(Admitted {
        existed: false,
        prev_edge_id: String::new(),
        prev_sandbox_id: String::new(),
    })
}

/// Releases one lease that ended at `at`: frees its quota and records its usage, or, when
/// no sandbox was ever made for it (`not_created`), takes back the start its admission
/// counted. Returns whether it was held.
fn release_one(st: &mut IamState, id: &str, at: i64, now: i64, not_created: bool) -> bool {
    let Some(l) = st.leases.remove(id) else {
        return false;
    };
    st.remember_released(id, now);
    st.index_remove(&l.edge_id, id);
    st.uncharge(&l.project, &l.resources);
    if not_created {
        usage::unrecord_started(st, &l.project, l.created_at);
        return true;
    }
    usage::record_held(
        st,
        &l.project,
        &l.resources,
        l.created_at,
        at.max(l.created_at),
        now,
    );
    true
}

pub(super) fn release_leases(
    st: &mut IamState,
    ids: &[String],
    at: i64,
    now: i64,
    not_created: bool,
) -> Result<Outcome, Failure> {
    require_bootstrapped(st)?;
    check_batch(ids.len())?;
    let at = if at <= 0 || at > now { now } else { at };
    let released = ids
        .iter()
        .filter(|id| release_one(st, id, at, now, not_created))
        .count() as i64;
    usage::prune(st, now);
    st.prune_released(now);
    Ok(Outcome::Released(released))
}

/// Checks one reported lease; bad entries are skipped (the rest of the report still counts).
fn report_ok(r: &LeaseReport) -> bool {
    check_id("lease id", &r.lease_id).is_ok()
        && names::check_project_path(&r.project).is_ok()
        && (r.principal.is_empty() || names::check_principal_id(&r.principal).is_ok())
        && check_sandbox_id(&r.sandbox_id).is_ok()
        && check_res(&r.resources).is_ok()
}

/// What a `Reconcile` would change: reports to adopt (unknown leases) or to rebind (known,
/// bound elsewhere), and leases of the edge to release. Computed from a read of the state, so
/// the service commits nothing when an edge's report matches (the steady state).
#[derive(Debug, Default, PartialEq, Eq)]
pub(super) struct ReconcilePlan {
    pub adopt: Vec<usize>,
    pub rebind: Vec<usize>,
    pub release: Vec<String>,
}

impl ReconcilePlan {
    pub fn is_empty(&self) -> bool {
        self.adopt.is_empty() && self.rebind.is_empty() && self.release.is_empty()
    }
}

/// Plans a reconciliation of `edge` with the leases it reports alive: unknown ones are
/// adopted, ones bound elsewhere move here, and the edge's leases it does not report are
/// released unless younger than `min_age_s`. Malformed reports are skipped. `invalid` for a
/// bad edge id, a negative age or an oversized report.
pub(super) fn reconcile_plan(
    st: &IamState,
    edge: &str,
    reported: &[LeaseReport],
    min_age_s: i64,
    now: i64,
) -> Result<ReconcilePlan, Failure> {
    require_bootstrapped(st)?;
    names::check_edge_id(edge)?;
    check_batch(reported.len())?;
    if min_age_s < 0 {
        return Err(Failure::invalid("min_age_s may not be negative"));
    }
    let mut plan = ReconcilePlan::default();
    let mut alive: HashSet<&str> = HashSet::with_capacity(reported.len());
    for (i, r) in reported.iter().enumerate() {
        if !report_ok(r) || !alive.insert(&r.lease_id) {
            continue;
        }
        match st.leases.get(&r.lease_id) {
            Some(l)
                if l.edge_id == edge
                    && (r.sandbox_id.is_empty() || l.sandbox_id == r.sandbox_id) => {}
            Some(_) => plan.rebind.push(i),
            None => plan.adopt.push(i),
        }
    }
    if let Some(ids) = st.by_edge.get(edge) {
        for id in ids.iter().filter(|id| !alive.contains(id.as_str())) {
            let young = st
                .leases
                .get(id)
                .is_some_and(|l| now - l.created_at.max(l.bound_at) < min_age_s);
            if !young {
                plan.release.push(id.clone());
            }
        }
    }
    Ok(plan)
}

pub(super) fn reconcile(
    st: &mut IamState,
    edge: &str,
    reported: &[LeaseReport],
    min_age_s: i64,
    now: i64,
) -> Result<Outcome, Failure> {
    let plan = reconcile_plan(st, edge, reported, min_age_s, now)?;
    for &i in &plan.rebind {
        // The sandbox runs here: bind the lease to where it actually is.
        let Some(r) = reported.get(i) else {
            continue;
        };
        let Some(old) = st.leases.get(&r.lease_id).map(|l| l.edge_id.clone()) else {
            continue;
        };
        st.index_remove(&old, &r.lease_id);
        st.index_add(edge, &r.lease_id);
        if let Some(l) = st.leases.get_mut(&r.lease_id) {
            l.edge_id = edge.to_string();
            if !r.sandbox_id.is_empty() {
                l.sandbox_id = r.sandbox_id.clone();
            }
            l.bound_at = now;
        }
    }
    for &i in &plan.adopt {
        // A sandbox IAM did not know (after a restore, for instance): adopt its lease. It
        // exists already, so it is charged without a quota check; a project that no longer
        // exists is charged to its nearest existing ancestor.
        let Some(r) = reported.get(i) else {
            continue;
        };
        let res = lease_res(&r.resources);
        let created_at = if r.created_at <= 0 || r.created_at > now {
            now
        } else {
            r.created_at
        };
        let project = st.nearest_project(&r.project);
        st.charge(&project, &res);
        let lease = Lease {
            project,
            principal: r.principal.clone(),
            resources: res,
            edge_id: edge.to_string(),
            sandbox_id: r.sandbox_id.clone(),
            created_at,
            bound_at: now,
            spec_digest: String::new(),
        };
        st.leases.insert(r.lease_id.clone(), lease);
        st.index_add(edge, &r.lease_id);
    }
    let released = plan
        .release
        .iter()
        .filter(|id| release_one(st, id, now, now, false))
        .count() as i64;
    usage::prune(st, now);
    st.prune_released(now);
    Ok(Outcome::Reconciled {
        adopted: plan.adopt.len() as i64,
        released,
    })
}

/// Would `ReleaseLeases` of `ids` release anything? (Lets the service skip a commit for
/// retries of releases already applied.)
pub(super) fn any_held(st: &IamState, ids: &[String]) -> bool {
    ids.iter().any(|id| st.leases.contains_key(id))
}

/// Would `SweepUnbound` release anything?
pub(super) fn any_unbound_older(st: &IamState, max_age_s: i64, now: i64) -> bool {
    st.by_edge.get("").is_some_and(|ids| {
        ids.iter().any(|id| {
            st.leases
                .get(id)
                .is_some_and(|l| now - l.created_at >= max_age_s)
        })
    })
}

pub(super) fn sweep_unbound(
    st: &mut IamState,
    max_age_s: i64,
    now: i64,
) -> Result<Outcome, Failure> {
    require_bootstrapped(st)?;
    if max_age_s < 0 {
        return Err(Failure::invalid("max_age_s may not be negative"));
    }
    let mut released = 0i64;
    for id in st.leases_on("") {
        let old = st
            .leases
            .get(&id)
            .is_some_and(|l| now - l.created_at >= max_age_s);
        if old && release_one(st, &id, now, now, false) {
            released += 1;
        }
    }
    usage::prune(st, now);
    st.prune_released(now);
    Ok(Outcome::Released(released))
}

#[cfg(test)]
mod tests {
    use super::super::command::Command;
    use super::super::state::{RELEASED_KEEP_S, ROOT};
    use super::super::testutil::*;
    use super::*;
    use crate::types::Reason;

    fn item(lease: &str, project: &str, cpu: f64, edge: &str) -> AdmitItem {
        AdmitItem {
            lease_id: lease.into(),
            project: project.into(),
            resources: Res {
                cpu_cores: cpu,
                memory_mb: 1024,
                ..Default::default()
            },
            edge_id: edge.into(),
            sandbox_id: if edge.is_empty() {
                String::new()
            } else {
                format!("{edge}.{lease}")
            },
            keep_binding: false,
            spec_digest: String::new(),
        }
    }

    fn admit_cmd(actor: &Actor, image_project: &str, items: Vec<AdmitItem>, now: i64) -> Command {
        Command::Admit {
            actor: actor.clone(),
            image_project: image_project.into(),
            items,
            now,
        }
    }

    fn results(o: Outcome) -> Vec<Result<Admitted, Failure>> {
        match o {
            Outcome::Admitted { results, .. } => results,
            other => panic!("{other:?}"),
        }
    }

    /// root (sandboxes 10) / a (cpu 4); `trainer` may create in root/a and use root's images.
    fn setup() -> (IamState, Actor) {
        let mut st = booted_with_quota(&[("sandboxes", 10.0)]);
        ok(
            &mut st,
            create_project_cmd(&admin(), ROOT, "a", &[("cpu_cores", 4.0)]),
        );
        ok(&mut st, create_project_cmd(&admin(), "root/a", "b", &[]));
        let t = add_principal(&mut st, "root/a", "trainer");
        grant_direct(&mut st, "root/a", "trainer", &["sandbox.create"]);
        grant_direct(&mut st, ROOT, "trainer", &["layer.use"]);
        (st, t)
    }

    fn consistent(st: &IamState) {
        let mut again = st.clone();
        again.recompute_usage();
        again.rebuild_index();
        assert_eq!(&again, st, "usage or index drifted from the leases");
    }

    #[test]
    fn admit_reserves_each_item_independently() {
        let (mut st, t) = setup();
        let items = vec![
            item("l1", "root/a", 2.0, "e1"),
            item("l2", "root/a/b", 2.0, "e1"),
            item("l3", "root/a", 1.0, "e2"),
            item("l4", "root/x", 1.0, ""),
        ];
        let r = results(ok(&mut st, admit_cmd(&t, "", items, NOW)));
        assert!(r[0].is_ok() && r[1].is_ok());
        let e = r[2].as_ref().unwrap_err();
        assert_eq!(e.reason, Reason::QuotaExceeded);
        assert!(
            e.message.contains("root/a") && e.message.contains("cpu_cores"),
            "{}",
            e.message
        );
        assert_eq!(r[3].as_ref().unwrap_err().reason, Reason::NotFound);
        assert_eq!(st.leases.len(), 2);
        assert_eq!(st.projects["root/a"].usage.cpu_cores, 4.0);
        assert_eq!(st.projects[ROOT].usage.sandboxes, 2);
        assert_eq!(st.projects["root/a/b"].usage.sandboxes, 1);
        assert_eq!(st.usage[&usage::day_of(NOW)]["root/a"].sandboxes_started, 1);
        consistent(&st);
    }

    #[test]
    fn admit_needs_sandbox_create_and_layer_use() {
        let (mut st, t) = setup();
        let r = results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("l1", ROOT, 1.0, "")], NOW),
        ));
        let e = r[0].as_ref().unwrap_err();
        assert_eq!(e.reason, Reason::Forbidden);
        assert!(
            e.message.contains("sandbox.create") && e.message.contains("root"),
            "{}",
            e.message
        );
        ok(&mut st, create_project_cmd(&admin(), ROOT, "images", &[]));
        ok(&mut st, create_project_cmd(&admin(), ROOT, "private", &[]));
        let r = results(ok(
            &mut st,
            admit_cmd(&t, "root/images", vec![item("l2", "root/a", 1.0, "")], NOW),
        ));
        assert!(r[0].is_ok());
        st.projects
            .get_mut(ROOT)
            .unwrap()
            .policies
            .get_mut("trainer")
            .unwrap()
            .clear();
        let r = results(ok(
            &mut st,
            admit_cmd(&t, "root/private", vec![item("l3", "root/a", 1.0, "")], NOW),
        ));
        assert!(r[0].as_ref().unwrap_err().message.contains("layer.use"));
        assert_eq!(st.leases.len(), 1);
    }

    #[test]
    fn admit_with_a_bad_token_fails_as_a_whole() {
        let (mut st, mut t) = setup();
        t.secret_hash = "f".repeat(64);
        refused(
            &mut st,
            admit_cmd(&t, "", vec![item("l1", "root/a", 1.0, "")], NOW),
            Reason::Unauthenticated,
        );
    }

    #[test]
    fn a_kept_binding_stays_where_it_is() {
        let (mut st, t) = setup();
        results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("l1", "root/a", 1.0, "e1")], NOW),
        ));
        let retry = AdmitItem {
            keep_binding: true,
            ..item("l1", "root/a", 1.0, "e2")
        };
        let r = results(ok(&mut st, admit_cmd(&t, "", vec![retry], NOW + 1)));
        let a = r[0].as_ref().unwrap();
        assert!(a.existed);
        assert_eq!(a.prev_edge_id, "e1");
        assert_eq!(
            st.leases["l1"].edge_id, "e1",
            "a retry must not move the lease"
        );
        assert_eq!(st.leases_on("e1"), vec!["l1".to_string()]);
        // An unbound lease is bound even when asked to keep its binding.
        results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("l2", "root/a", 1.0, "")], NOW),
        ));
        let bind = AdmitItem {
            keep_binding: true,
            ..item("l2", "root/a", 1.0, "e3")
        };
        results(ok(&mut st, admit_cmd(&t, "", vec![bind], NOW + 2)));
        assert_eq!(st.leases["l2"].edge_id, "e3");
        consistent(&st);
    }

    #[test]
    fn admit_is_idempotent_per_lease_and_rebinds() {
        let (mut st, t) = setup();
        results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("l1", "root/a", 1.0, "")], NOW),
        ));
        let before = st.projects["root/a"].usage;
        let r = results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("l1", "root/a", 1.0, "e1")], NOW + 5),
        ));
        let a = r[0].as_ref().unwrap();
        assert!(a.existed);
        assert_eq!(a.prev_edge_id, "");
        assert_eq!(st.projects["root/a"].usage, before);
        assert_eq!(st.leases["l1"].edge_id, "e1");
        assert_eq!(st.leases["l1"].bound_at, NOW + 5);
        let r = results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("l1", "root/a", 1.0, "e2")], NOW + 6),
        ));
        let a = r[0].as_ref().unwrap();
        assert_eq!(
            (a.prev_edge_id.as_str(), a.prev_sandbox_id.as_str()),
            ("e1", "e1.l1")
        );
        assert_eq!(st.leases_on("e2"), vec!["l1".to_string()]);
        assert!(st.leases_on("e1").is_empty());
        // The same lease id in another project is a conflict, and one batch may not repeat it.
        let r = results(ok(
            &mut st,
            admit_cmd(
                &t,
                "",
                vec![
                    item("l1", "root/a/b", 1.0, "e2"),
                    item("l9", "root/a", 0.5, ""),
                    item("l9", "root/a", 0.5, ""),
                ],
                NOW,
            ),
        ));
        assert_eq!(r[0].as_ref().unwrap_err().reason, Reason::Conflict);
        assert!(r[1].is_ok());
        assert_eq!(r[2].as_ref().unwrap_err().reason, Reason::Invalid);
        assert_eq!(st.usage[&usage::day_of(NOW)]["root/a"].sandboxes_started, 2);
        consistent(&st);
    }

    #[test]
    fn a_key_reused_with_another_spec_is_conflict() {
        let (mut st, t) = setup();
        let first = AdmitItem {
            spec_digest: "d1".into(),
            ..item("l1", "root/a", 1.0, "e1")
        };
        let r = results(ok(&mut st, admit_cmd(&t, "", vec![first.clone()], NOW)));
        assert!(r[0].is_ok());
        // The same spec again: the lease, not a second one.
        let r = results(ok(&mut st, admit_cmd(&t, "", vec![first.clone()], NOW + 1)));
        assert!(r[0].as_ref().unwrap().existed);
        let other = AdmitItem {
            spec_digest: "d2".into(),
            ..first
        };
        let r = results(ok(&mut st, admit_cmd(&t, "", vec![other], NOW + 2)));
        let e = r[0].as_ref().unwrap_err();
        assert_eq!(e.reason, Reason::Conflict);
        assert!(e.message.contains("different spec"), "{}", e.message);
        consistent(&st);
    }

    #[test]
    fn admit_refuses_bad_items() {
        let (mut st, t) = setup();
        let mut bad_cpu = item("l1", "root/a", f64::NAN, "");
        let bad_edge = item("l2", "root/a", 1.0, "Bad Edge");
        let bad_lease = item("", "root/a", 1.0, "");
        bad_cpu.resources.memory_mb = -5;
        let r = results(ok(
            &mut st,
            admit_cmd(&t, "", vec![bad_cpu, bad_edge, bad_lease], NOW),
        ));
        assert!(r
            .iter()
            .all(|r| r.as_ref().unwrap_err().reason == Reason::Invalid));
        assert!(st.leases.is_empty());
    }

    #[test]
    fn lowering_an_ancestor_quota_applies_at_once() {
        let (mut st, t) = setup();
        results(ok(
            &mut st,
            admit_cmd(
                &t,
                "",
                vec![item("l1", "root/a", 0.5, ""), item("l2", "root/a", 0.5, "")],
                NOW,
            ),
        ));
        ok(
            &mut st,
            Command::Configure {
                root_quota: q(&[("sandboxes", 2.0)]),
                max_token_ttl_s: 0,
            },
        );
        let r = results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("l3", "root/a/b", 0.5, "")], NOW),
        ));
        assert!(r[0]
            .as_ref()
            .unwrap_err()
            .message
            .contains("quota of root exceeded"));
    }

    #[test]
    fn releasing_frees_quota_records_usage_and_ignores_unknown_ids() {
        let (mut st, t) = setup();
        results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("l1", "root/a", 4.0, "e1")], NOW),
        ));
        let r = results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("l2", "root/a", 1.0, "e1")], NOW),
        ));
        assert!(r[0].is_err());
        let out = ok(
            &mut st,
            Command::ReleaseLeases {
                lease_ids: vec!["l1".into(), "nope".into()],
                at: NOW + 3600,
                now: NOW + 3700,
                not_created: false,
            },
        );
        assert_eq!(out, Outcome::Released(1));
        assert_eq!(st.projects["root/a"].usage, Res::default());
        assert_eq!(st.projects[ROOT].usage, Res::default());
        let row = st.usage[&usage::day_of(NOW)]["root/a"];
        let hours: f64 = st
            .usage
            .values()
            .filter_map(|m| m.get("root/a"))
            .map(|r| r.cpu_core_hours)
            .sum();
        assert!((hours - 4.0).abs() < 1e-9, "{hours}");
        assert_eq!(row.sandboxes_started, 1);
        // Releasing again is a no-op.
        assert_eq!(
            ok(
                &mut st,
                Command::ReleaseLeases {
                    lease_ids: vec!["l1".into()],
                    at: 0,
                    now: NOW + 3800,
                    not_created: false,
                }
            ),
            Outcome::Released(0)
        );
        let r = results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("l2", "root/a", 1.0, "e1")], NOW + 3800),
        ));
        assert!(r[0].is_ok());
        consistent(&st);
    }

    /// A late copy of an admission (made before the lease was released, committed after)
    /// holds nothing; an admission made after the release (a retry with the same key) does;
    /// the release is remembered for a minute, also across a snapshot.
    #[test]
    fn a_late_copy_of_an_admission_does_not_hold_a_released_lease_again() {
        let (mut st, t) = setup();
        let admit_at = |st: &mut IamState, now: i64| {
            results(ok(
                st,
                admit_cmd(&t, "", vec![item("l1", "root/a", 1.0, "e1")], now),
            ))
            .remove(0)
        };
        let release_at = |st: &mut IamState, now: i64| {
            ok(
                st,
                Command::ReleaseLeases {
                    lease_ids: vec!["l1".into()],
                    at: now,
                    now,
                    not_created: false,
                },
            )
        };
        assert!(admit_at(&mut st, NOW).is_ok());
        assert_eq!(release_at(&mut st, NOW + 5), Outcome::Released(1));
        let before = st.clone();
        let f = admit_at(&mut st, NOW).unwrap_err();
        assert_eq!(f.reason, Reason::Conflict, "{f}");
        assert!(f.message.contains("released after"), "{f}");
        assert_eq!(st, before, "a refused late copy changes nothing");
        assert!(st.leases.is_empty());
        assert_eq!(st.projects[ROOT].usage, Res::default());
        // The released id survives a reload of the state.
        let mut copy: IamState =
            serde_json::from_str(&serde_json::to_string(&st).unwrap()).unwrap();
        copy.rebuild_index();
        assert_eq!(copy, st);
        assert!(admit_at(&mut copy, NOW + 4).is_err());
        // Made at or after the release: a new admission.
        assert!(!admit_at(&mut st, NOW + 5).unwrap().existed);
        assert_eq!(release_at(&mut st, NOW + 6), Outcome::Released(1));
        // Forgotten a minute later (the next command prunes it).
        assert_eq!(
            release_at(&mut st, NOW + 6 + RELEASED_KEEP_S + 1),
            Outcome::Released(0)
        );
        assert!(st.released.is_empty() && st.released_by_time.is_empty());
        assert!(admit_at(&mut st, NOW).is_ok());
        consistent(&st);
    }

    #[test]
    fn a_refused_creation_leaves_no_usage() {
        let (mut st, t) = setup();
        // Another creation of the same project that day keeps its start.
        results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("kept", "root/a", 1.0, "e1")], NOW),
        ));
        results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("l1", "root/a", 2.0, "e1")], NOW),
        ));
        assert_eq!(st.usage[&usage::day_of(NOW)]["root/a"].sandboxes_started, 2);
        let out = ok(
            &mut st,
            Command::ReleaseLeases {
                lease_ids: vec!["l1".into()],
                at: 0,
                now: NOW + 600,
                not_created: true,
            },
        );
        assert_eq!(out, Outcome::Released(1));
        assert_eq!(st.projects["root/a"].usage.cpu_cores, 1.0);
        let row = st.usage[&usage::day_of(NOW)]["root/a"];
        assert_eq!(row.sandboxes_started, 1);
        assert_eq!(row.cpu_core_hours, 0.0);
        // The only creation of a project refused: the project has no usage row at all.
        results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("l2", "root/a/b", 1.0, "e1")], NOW),
        ));
        ok(
            &mut st,
            Command::ReleaseLeases {
                lease_ids: vec!["l2".into()],
                at: 0,
                now: NOW + 600,
                not_created: true,
            },
        );
        assert!(!st.usage[&usage::day_of(NOW)].contains_key("root/a/b"));
        assert_eq!(st.projects["root/a/b"].usage, Res::default());
    }

    #[test]
    fn reconcile_adopts_unknown_and_releases_missing_old_leases() {
        let (mut st, t) = setup();
        results(ok(
            &mut st,
            admit_cmd(
                &t,
                "",
                vec![
                    item("old", "root/a", 1.0, "e1"),
                    item("kept", "root/a", 1.0, "e1"),
                ],
                NOW,
            ),
        ));
        results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("young", "root/a", 1.0, "e1")], NOW + 100),
        ));
        let report = |id: &str| LeaseReport {
            lease_id: id.into(),
            project: "root/a/b".into(),
            principal: "trainer".into(),
            resources: Res {
                cpu_cores: 0.5,
                ..Default::default()
            },
            sandbox_id: format!("e1.{id}"),
            created_at: NOW - 50,
        };
        let kept = LeaseReport {
            project: "root/a".into(),
            ..report("kept")
        };
        let bad = LeaseReport {
            project: "nowhere".into(),
            ..report("bad")
        };
        let cmd = Command::Reconcile {
            edge_id: "e1".into(),
            leases: vec![kept.clone(), report("new"), bad],
            min_age_s: 60,
            now: NOW + 120,
        };
        assert_eq!(
            ok(&mut st, cmd),
            Outcome::Reconciled {
                adopted: 1,
                released: 1
            }
        );
        assert!(
            st.leases.contains_key("young")
                && st.leases.contains_key("kept")
                && st.leases.contains_key("new")
        );
        assert!(!st.leases.contains_key("old") && !st.leases.contains_key("bad"));
        assert_eq!(st.leases["new"].created_at, NOW - 50);
        // A project that does not exist (any more) is charged to its nearest ancestor.
        let gone = LeaseReport {
            project: "root/a/gone/deeper".into(),
            ..report("gone")
        };
        let cmd = Command::Reconcile {
            edge_id: "e1".into(),
            leases: vec![kept.clone(), report("new"), gone],
            min_age_s: 60,
            now: NOW + 120,
        };
        assert_eq!(
            ok(&mut st, cmd),
            Outcome::Reconciled {
                adopted: 1,
                released: 0
            }
        );
        assert_eq!(st.leases["gone"].project, "root/a");
        consistent(&st);
        assert_eq!(st.projects["root/a/b"].usage.sandboxes, 1);
        consistent(&st);
        // Lost edge: an empty report with no minimum age releases everything on it.
        let lost = Command::Reconcile {
            edge_id: "e1".into(),
            leases: vec![],
            min_age_s: 0,
            now: NOW + 130,
        };
        assert_eq!(
            ok(&mut st, lost),
            Outcome::Reconciled {
                adopted: 0,
                released: 4
            }
        );
        assert!(st.leases.is_empty());
        assert_eq!(st.projects[ROOT].usage, Res::default());
        refused(
            &mut st,
            Command::Reconcile {
                edge_id: "E 1".into(),
                leases: vec![],
                min_age_s: 0,
                now: NOW,
            },
            Reason::Invalid,
        );
        refused(
            &mut st,
            Command::Reconcile {
                edge_id: "e1".into(),
                leases: vec![],
                min_age_s: -1,
                now: NOW,
            },
            Reason::Invalid,
        );
    }

    #[test]
    fn a_matching_report_plans_nothing_and_duplicates_count_once() {
        let (mut st, t) = setup();
        results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("l1", "root/a", 1.0, "e1")], NOW),
        ));
        let rep = LeaseReport {
            lease_id: "l1".into(),
            project: "root/a".into(),
            principal: "trainer".into(),
            resources: Res::default(),
            sandbox_id: "e1.l1".into(),
            created_at: NOW,
        };
        assert!(
            reconcile_plan(&st, "e1", std::slice::from_ref(&rep), 0, NOW + 1)
                .unwrap()
                .is_empty()
        );
        assert!(!reconcile_plan(&st, "e1", &[], 0, NOW + 1)
            .unwrap()
            .is_empty());
        assert!(any_held(&st, &["x".into(), "l1".into()]));
        assert!(!any_held(&st, &["x".into()]));
        let new = LeaseReport {
            lease_id: "l2".into(),
            ..rep.clone()
        };
        let cmd = Command::Reconcile {
            edge_id: "e1".into(),
            leases: vec![rep, new.clone(), new],
            min_age_s: 0,
            now: NOW + 1,
        };
        assert_eq!(
            ok(&mut st, cmd),
            Outcome::Reconciled {
                adopted: 1,
                released: 0
            }
        );
        assert_eq!(st.projects["root/a"].usage.sandboxes, 2);
        consistent(&st);
    }

    #[test]
    fn reconcile_moves_a_lease_to_the_edge_that_runs_it() {
        let (mut st, t) = setup();
        results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("l1", "root/a", 1.0, "e1")], NOW),
        ));
        let rep = LeaseReport {
            lease_id: "l1".into(),
            project: "root/a".into(),
            principal: "trainer".into(),
            resources: Res::default(),
            sandbox_id: "e2.x".into(),
            created_at: NOW,
        };
        assert_eq!(
            ok(
                &mut st,
                Command::Reconcile {
                    edge_id: "e2".into(),
                    leases: vec![rep],
                    min_age_s: 0,
                    now: NOW + 1
                }
            ),
            Outcome::Reconciled {
                adopted: 0,
                released: 0
            }
        );
        assert_eq!(st.leases["l1"].edge_id, "e2");
        assert_eq!(st.leases["l1"].sandbox_id, "e2.x");
        consistent(&st);
    }

    #[test]
    fn sweep_releases_only_old_unbound_leases() {
        let (mut st, t) = setup();
        results(ok(
            &mut st,
            admit_cmd(
                &t,
                "",
                vec![
                    item("u-old", "root/a", 1.0, ""),
                    item("bound", "root/a", 1.0, "e1"),
                ],
                NOW,
            ),
        ));
        results(ok(
            &mut st,
            admit_cmd(&t, "", vec![item("u-new", "root/a", 1.0, "")], NOW + 500),
        ));
        assert!(any_unbound_older(&st, 600, NOW + 700));
        assert!(!any_unbound_older(&st, 600, NOW + 599));
        assert_eq!(
            ok(
                &mut st,
                Command::SweepUnbound {
                    max_age_s: 600,
                    now: NOW + 700
                }
            ),
            Outcome::Released(1)
        );
        assert!(st.leases.contains_key("u-new") && st.leases.contains_key("bound"));
        consistent(&st);
    }
}
