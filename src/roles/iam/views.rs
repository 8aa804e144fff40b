//! Conversions between the state and the protobuf messages of iam.proto / opendsec.proto.

use std::collections::{BTreeMap, HashMap};

use super::command::LeaseReport;
use super::state::{IamState, Lease, Token};
use super::usage::ReportRow;
use crate::pb;
use crate::types::{names, Failure, Res};

/// The `Project` message of `path`: quota, usage (the four quota keys), direct policies and
/// direct subprojects (full paths). `not_found` when absent.
pub fn project(st: &IamState, path: &str) -> Result<pb::Project, Failure> {
    let p = st.project(path)?;
    let u = &p.usage;
    let usage: HashMap<String, f64> = [
        ("sandboxes", u.sandboxes as f64),
        ("cpu_cores", u.cpu_cores),
        ("memory_mb", u.memory_mb as f64),
        ("gpus", u.gpus as f64),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect();
    Ok(pb::Project {
        path: path.to_string(),
        quota: p.quota.iter().map(|(k, v)| (k.clone(), *v)).collect(),
        usage,
        policies: p
            .policies
            .iter()
            .map(|(who, perms)| {
                (
                    who.clone(),
                    pb::PermissionList {
                        permissions: perms.iter().cloned().collect(),
                    },
                )
            })
            .collect(),
        children: st.children(path),
    })
}

/// A token's public description (never its hash).
pub fn token_info(principal: &str, id: &str, t: &Token) -> pb::TokenInfo {
    pb::TokenInfo {
        id: id.to_string(),
        principal: principal.to_string(),
        created_at: t.created_at,
        expires_at: t.expires_at,
        description: t.description.clone(),
        created_by: t.created_by.clone(),
    }
}

/// A lease as `LeaseInfo`.
pub fn lease_info(id: &str, l: &Lease) -> pb::LeaseInfo {
    pb::LeaseInfo {
        lease_id: id.to_string(),
        project: l.project.clone(),
        principal: l.principal.clone(),
        resources: Some(l.resources.to_pb()),
        edge_id: l.edge_id.clone(),
        sandbox_id: l.sandbox_id.clone(),
        created_at: l.created_at,
        bound_at: l.bound_at,
    }
}

/// An edge's `LeaseInfo` report as a command input.
pub fn lease_report(l: &pb::LeaseInfo) -> LeaseReport {
    LeaseReport {
        lease_id: l.lease_id.clone(),
        project: l.project.clone(),
        principal: l.principal.clone(),
        resources: Res::from_pb(l.resources.as_ref()),
        sandbox_id: l.sandbox_id.clone(),
        created_at: l.created_at,
    }
}

/// A usage report row as `UsageRow`.
pub fn usage_row(r: &ReportRow) -> pb::UsageRow {
    pb::UsageRow {
        project: r.project.clone(),
        day: r.day.clone(),
        sandboxes_started: r.row.sandboxes_started,
        sandbox_hours: r.row.sandbox_hours,
        cpu_core_hours: r.row.cpu_core_hours,
        memory_gb_hours: r.row.memory_gb_hours,
        gpu_hours: r.row.gpu_hours,
    }
}

/// A quota map from a request, checked for keys and values (`invalid`).
pub fn quota(q: &HashMap<String, f64>) -> Result<BTreeMap<String, f64>, Failure> {
    let out: BTreeMap<String, f64> = q.iter().map(|(k, v)| (k.clone(), *v)).collect();
    super::state::check_quota_map(&out)?;
    Ok(out)
}

/// Permissions from a request, each checked (`invalid`).
pub fn permissions(p: &[String]) -> Result<Vec<String>, Failure> {
    p.iter().try_for_each(|x| names::check_permission(x))?;
    Ok(p.to_vec())
}

#[cfg(test)]
mod tests {
    use super::super::testutil::*;
    use super::*;

    #[test]
    fn project_view_shows_quota_usage_policies_and_children() {
        let mut st = booted();
        ok(
            &mut st,
            create_project_cmd(&admin(), "root", "a", &[("sandboxes", 4.0)]),
        );
        st.charge(
            "root/a",
            &Res {
                sandboxes: 1,
                cpu_cores: 0.5,
                ..Default::default()
            },
        );
        let v = project(&st, "root").unwrap();
        assert_eq!(v.children, vec!["root/a".to_string()]);
        assert_eq!(
            v.policies["admin"].permissions.len(),
            names::PERMISSIONS.len()
        );
        let a = project(&st, "root/a").unwrap();
        assert_eq!(a.quota["sandboxes"], 4.0);
        assert_eq!(a.usage["cpu_cores"], 0.5);
        assert_eq!(a.usage["sandboxes"], 1.0);
        assert!(project(&st, "root/b").is_err());
    }

    #[test]
    fn request_quotas_are_checked() {
        let mut q = HashMap::new();
        q.insert("sandboxes".to_string(), f64::NAN);
        assert!(quota(&q).is_err());
        q.insert("sandboxes".to_string(), 3.0);
        assert_eq!(quota(&q).unwrap()["sandboxes"], 3.0);
        assert!(permissions(&["sandbox.create".into(), "x".into()]).is_err());
    }
}
