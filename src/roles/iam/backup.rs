//! Backup and restore (docs/concepts.md): gzipped JSON of principals, projects (quotas and grants),
//! token hashes, usage, the epoch and the key-value area. Leases are not in backups: a restore keeps the current
//! ones and reconciliation registers the rest again from the edges.

use std::collections::BTreeMap;
use std::io::{Read, Write};

use flate2::{read::GzDecoder, write::GzEncoder, Compression};
use serde::{Deserialize, Serialize};

use super::apply::actor;
use super::apply_kv;
use super::command::Outcome;
use super::state::{
    check_hash, check_quota_map, check_token_id, Actor, IamState, KvValue, Principal, Project,
    UsageRow, ROOT,
};
use crate::types::{names, Failure};

/// The `format` field of every backup.
pub const FORMAT: &str = "opendsec-iam-backup";
/// Largest decompressed backup accepted (a gzip bomb guard).
pub const MAX_DECOMPRESSED: u64 = 1 << 30;

/// One project as backed up: its quota and grants (usage is derived from leases).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ProjectBackup {
    pub quota: BTreeMap<String, f64>,
    pub policies: BTreeMap<String, std::collections::BTreeSet<String>>,
    pub created_at: i64,
}

/// The content of a backup file (after gunzip).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Backup {
    pub format: String,
    pub version: u32,
    pub created_at: i64,
    pub admin_id: String,
    pub epoch: u64,
    pub projects: BTreeMap<String, ProjectBackup>,
    pub principals: BTreeMap<String, Principal>,
    pub usage: BTreeMap<i64, BTreeMap<String, UsageRow>>,
    /// The key-value area (docs/iam-replicas.md "Locks and the key-value area"). Locks are
    /// not backed up: their holders take them again.
    pub kv: BTreeMap<String, KvValue>,
}

impl Backup {
    /// Takes a backup of `st` at `now`.
    pub fn of(st: &IamState, now: i64) -> Backup {
        Backup {
            format: FORMAT.into(),
            version: 1,
            created_at: now,
            admin_id: st.admin_id.clone(),
            epoch: st.epoch,
            projects: st
                .projects
                .iter()
                .map(|(k, p)| {
                    (
                        k.clone(),
                        ProjectBackup {
                            quota: p.quota.clone(),
                            policies: p.policies.clone(),
                            created_at: p.created_at,
                        },
                    )
                })
                .collect(),
            principals: st.principals.clone(),
            usage: st.usage.clone(),
            kv: st.kv.clone(),
        }
    }

    /// Gzipped JSON bytes.
    pub fn encode(&self) -> Result<Vec<u8>, Failure> {
        let mut gz = GzEncoder::new(Vec::new(), Compression::default());
        serde_json::to_writer(&mut gz, self).map_err(|e| {
            Failure::internal(format!("encoding backup: {e}", e = crate::types::chain(&e)))
        })?;
        gz.flush().and_then(|_| gz.finish()).map_err(|e| {
            Failure::internal(format!(
                "compressing backup: {e}",
                e = crate::types::chain(&e)
            ))
        })
    }

    /// Parses gzipped JSON bytes; anything malformed is `invalid`. The content is checked
    /// by [`Backup::check`] (and again when the restore applies).
    pub fn decode(data: &[u8]) -> Result<Backup, Failure> {
        let mut json = Vec::new();
        GzDecoder::new(data)
            .take(MAX_DECOMPRESSED + 1)
            .read_to_end(&mut json)
            .map_err(|e| {
                Failure::invalid(format!(
                    "backup is not gzip data: {e}",
                    e = crate::types::chain(&e)
                ))
            })?;
        if json.len() as u64 > MAX_DECOMPRESSED {
            return Err(Failure::invalid(format!(
                "backup larger than {MAX_DECOMPRESSED} bytes decompressed"
            )));
        }
        let b: Backup = serde_json::from_slice(&json).map_err(|e| {
            Failure::invalid(format!(
                "backup is not valid JSON: {e}",
                e = crate::types::chain(&e)
            ))
        })?;
        b.check()?;
        Ok(b)
    }

    /// Checks the backup is a whole, consistent IAM content: the format, a root, every
    /// project's parent, valid names, quotas, permissions and token hashes, and principals
    /// whose projects exist. Errors are `invalid` and name the offending entry.
    pub fn check(&self) -> Result<(), Failure> {
        if self.format != FORMAT || self.version != 1 {
            return Err(Failure::invalid(format!(
                "not an IAM backup (format {:?} version {})",
                self.format, self.version
            )));
        }
        if !self.projects.contains_key(ROOT) {
            return Err(Failure::invalid("backup has no root project"));
        }
        for (path, p) in &self.projects {
            names::check_project_path(path)
                .map_err(|e| Failure::invalid(format!("backup: {}", e.message)))?;
            if let Some(parent) = names::project_parent(path) {
                if !self.projects.contains_key(parent) {
                    return Err(Failure::invalid(format!(
                        "backup: project {path} has no parent {parent}"
                    )));
                }
            }
            check_quota_map(&p.quota)
                .map_err(|e| Failure::invalid(format!("backup: project {path}: {}", e.message)))?;
            for (who, perms) in &p.policies {
                names::check_principal_id(who)?;
                for perm in perms {
                    names::check_permission(perm).map_err(|e| {
                        Failure::invalid(format!("backup: project {path}: {}", e.message))
                    })?;
                }
            }
        }
        for (id, p) in &self.principals {
            names::check_principal_id(id)?;
            if !self.projects.contains_key(&p.project) {
                return Err(Failure::invalid(format!(
                    "backup: principal {id} belongs to missing project {:?}",
                    p.project
                )));
            }
            for (tid, t) in &p.tokens {
                check_token_id(tid)?;
                check_hash(&t.hash).map_err(|e| {
                    Failure::invalid(format!("backup: token {id}.{tid}: {}", e.message))
                })?;
            }
        }
        for (key, v) in &self.kv {
            apply_kv::check_key(key)
                .map_err(|e| Failure::invalid(format!("backup: {}", e.message)))?;
            if v.value.len() > apply_kv::MAX_VALUE_LEN {
                return Err(Failure::invalid(format!(
                    "backup: key {key} holds {} bytes; at most {}",
                    v.value.len(),
                    apply_kv::MAX_VALUE_LEN
                )));
            }
        }
        if apply_kv::area_bytes(&self.kv) > apply_kv::MAX_BYTES {
            return Err(Failure::invalid(format!(
                "backup: the key-value area exceeds {} bytes",
                apply_kv::MAX_BYTES
            )));
        }
        if self.kv.len() > apply_kv::MAX_KEYS {
            return Err(Failure::invalid(format!(
                "backup: {} keys; at most {}",
                self.kv.len(),
                apply_kv::MAX_KEYS
            )));
        }
        Ok(())
    }
}

/// Applies a restore: needs `project.admin` on root; the backup must hold the current
/// administrator. Keeps the leases and operator settings, recomputes usage from the leases
/// and bumps the epoch past both the current and the backed-up one.
pub(super) fn restore(
    st: &mut IamState,
    a: &Actor,
    b: &Backup,
    now: i64,
) -> Result<Outcome, Failure> {
    actor(st, a, now)?;
    st.require(&a.principal, ROOT, "project.admin")?;
    b.check()?;
    if !b.principals.contains_key(&st.admin_id) {
        return Err(Failure::invalid(format!(
            "backup lacks the administrator {}; refusing to lock it out",
            st.admin_id
        )));
    }
    st.projects = b
        .projects
        .iter()
        .map(|(k, p)| {
            (
                k.clone(),
                Project {
                    quota: p.quota.clone(),
                    policies: p.policies.clone(),
                    created_at: p.created_at,
                    ..Default::default()
                },
            )
        })
        .collect();
    if let Some(root) = st.projects.get_mut(ROOT) {
        root.quota = st.settings.root_quota.clone();
    }
    st.principals = b.principals.clone();
    st.usage = b.usage.clone();
    apply_kv::restore(st, &b.kv);
    st.epoch = st.epoch.max(b.epoch) + 1;
    // Leases of projects the backup lacks count in their nearest existing ancestor.
    let moved: Vec<(String, String)> = st
        .leases
        .iter()
        .filter(|(_, l)| !st.projects.contains_key(&l.project))
        .map(|(id, l)| (id.clone(), st.nearest_project(&l.project)))
        .collect();
    for (id, project) in moved {
        if let Some(l) = st.leases.get_mut(&id) {
            l.project = project;
        }
    }
    st.recompute_usage();
    Ok(Outcome::Done)
}

#[cfg(test)]
mod tests {
    use super::super::command::{AdmitItem, Command};
    use super::super::testutil::*;
    use super::*;
    use crate::types::{Reason, Res};

    fn restore_cmd(actor: &Actor, b: Backup) -> Command {
        Command::Restore {
            actor: actor.clone(),
            backup: Box::new(b),
            now: NOW,
        }
    }

    #[test]
    fn backup_round_trips_through_gzip() {
        let mut st = booted();
        ok(
            &mut st,
            create_project_cmd(&admin(), ROOT, "a", &[("sandboxes", 3.0)]),
        );
        let b = Backup::of(&st, NOW);
        let bytes = b.encode().unwrap();
        assert_eq!(&bytes[..2], &[0x1f, 0x8b]);
        assert_eq!(Backup::decode(&bytes).unwrap(), b);
        assert_eq!(
            Backup::decode(b"not gzip").unwrap_err().reason,
            Reason::Invalid
        );
    }

    #[test]
    fn restore_replaces_everything_but_leases_and_bumps_the_epoch() {
        let mut st = booted();
        ok(&mut st, create_project_cmd(&admin(), ROOT, "a", &[]));
        let b = Backup::of(&st, NOW);
        // After the backup: a new project, a principal and a lease in root/a.
        ok(&mut st, create_project_cmd(&admin(), ROOT, "later", &[]));
        add_principal(&mut st, ROOT, "bob");
        let item = AdmitItem {
            lease_id: "l1".into(),
            project: "root/a".into(),
            resources: Res {
                cpu_cores: 1.0,
                ..Default::default()
            },
            edge_id: "e1".into(),
            sandbox_id: "e1.x".into(),
            keep_binding: false,
            spec_digest: String::new(),
        };
        let item2 = AdmitItem {
            lease_id: "l2".into(),
            project: "root/later".into(),
            ..item.clone()
        };
        ok(
            &mut st,
            Command::Admit {
                actor: admin(),
                image_project: String::new(),
                items: vec![item, item2],
                now: NOW,
            },
        );
        let epoch = st.epoch;
        ok(&mut st, restore_cmd(&admin(), b));
        assert!(!st.projects.contains_key("root/later"));
        assert!(!st.principals.contains_key("bob"));
        assert!(st.leases.contains_key("l1"));
        assert_eq!(st.projects["root/a"].usage.sandboxes, 1);
        assert_eq!(st.projects[ROOT].usage.cpu_cores, 2.0);
        // The lease of a project the backup lacks now counts in root.
        assert_eq!(st.leases["l2"].project, ROOT);
        ok(&mut st, create_project_cmd(&admin(), ROOT, "later", &[]));
        assert_eq!(st.projects["root/later"].usage, Res::default());
        assert!(st.epoch > epoch);
    }

    fn put(key: &str, value: &[u8]) -> Command {
        Command::KvPut {
            key: key.into(),
            value: value.to_vec(),
            if_revision: None,
        }
    }

    #[test]
    fn the_key_value_area_is_backed_up_and_restored_with_new_revisions() {
        let mut st = booted();
        ok(&mut st, put("nodes/a", b"1"));
        let old = st.kv["nodes/a"].revision;
        let b = Backup::decode(&Backup::of(&st, NOW).encode().unwrap()).unwrap();
        ok(&mut st, put("nodes/b", b"x"));
        ok(&mut st, put("nodes/a", b"2"));
        let last = st.revision;
        ok(&mut st, restore_cmd(&admin(), b.clone()));
        assert_eq!(st.kv.keys().collect::<Vec<_>>(), ["nodes/a"]);
        assert_eq!(st.kv["nodes/a"].value, b"1");
        assert!(st.kv["nodes/a"].revision > last);
        // A compare-and-set made against what was there before the restore fails.
        refused(
            &mut st,
            Command::KvPut {
                key: "nodes/a".into(),
                value: b"3".to_vec(),
                if_revision: Some(old),
            },
            Reason::Conflict,
        );
        let mut bad = b;
        bad.kv.insert("elsewhere/x".into(), KvValue::default());
        refused(&mut st, restore_cmd(&admin(), bad), Reason::Invalid);
    }

    #[test]
    fn restore_needs_admin_on_root_and_a_sound_backup() {
        let mut st = booted();
        ok(&mut st, create_project_cmd(&admin(), ROOT, "a", &[]));
        let good = Backup::of(&st, NOW);
        let bob = add_principal(&mut st, ROOT, "bob");
        grant_direct(&mut st, "root/a", "bob", &["project.admin"]);
        refused(&mut st, restore_cmd(&bob, good.clone()), Reason::Forbidden);
        let mut orphan = good.clone();
        orphan
            .projects
            .insert("root/x/y".into(), ProjectBackup::default());
        refused(&mut st, restore_cmd(&admin(), orphan), Reason::Invalid);
        let mut no_admin = good.clone();
        no_admin.principals.remove("admin");
        refused(&mut st, restore_cmd(&admin(), no_admin), Reason::Invalid);
        let mut bad_perm = good.clone();
        bad_perm
            .projects
            .get_mut("root/a")
            .unwrap()
            .policies
            .insert("admin".into(), ["root.all".to_string()].into());
        refused(&mut st, restore_cmd(&admin(), bad_perm), Reason::Invalid);
        let mut wrong_format = good;
        wrong_format.format = "something".into();
        refused(
            &mut st,
            restore_cmd(&admin(), wrong_format),
            Reason::Invalid,
        );
    }
}
