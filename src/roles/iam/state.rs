//! IAM's whole state (docs/concepts.md, docs/architecture.md): the project tree with quotas, usage and
//! policies, principals with their token hashes, quota leases, daily usage and the security
//! epoch. Plain data, serialized as JSON in snapshots; it changes only through
//! [`super::apply::apply`]. The read-only rule checks every command and query shares live here.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use serde::{Deserialize, Serialize};

use crate::types::{names, Failure, Reason, Res};

/// The root project's path.
pub const ROOT: &str = "root";
/// Largest quota value accepted (anything above is a mistake, not a limit).
pub const MAX_QUOTA: f64 = 1e12;
/// Slack for float comparisons of fractional CPU cores.
const EPS: f64 = 1e-9;

/// The whole IAM state. Maps are ordered so that every replica iterates (and sums floats) in
/// the same order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct IamState {
    /// Project path (`root/team-a`) -> project.
    pub projects: BTreeMap<String, Project>,
    /// Principal id -> principal (ids are unique cluster-wide).
    pub principals: BTreeMap<String, Principal>,
    /// Lease id -> quota lease (one per live sandbox).
    pub leases: BTreeMap<String, Lease>,
    /// UTC day (days since 1970-01-01) -> project path -> usage of that project's own sandboxes.
    pub usage: BTreeMap<i64, BTreeMap<String, UsageRow>>,
    /// Security epoch: bumped by every revocation so caches of authentication drop.
    pub epoch: u64,
    /// The bootstrap administrator (config `iam.admin_id`).
    pub admin_id: String,
    /// Operator settings from the config, replicated so that `apply` stays deterministic.
    pub settings: Settings,
    /// Lease id -> when it was released (the releasing command's `now`), kept for
    /// [`RELEASED_KEEP_S`]: an admission made before that time is a late copy (a resent
    /// `Admit` that committed after the release) and must not hold the lease again.
    #[serde(default)]
    pub released: BTreeMap<String, i64>,
    /// Lock name -> its holder (docs/iam-replicas.md "Locks and the key-value area").
    pub locks: BTreeMap<String, LockHold>,
    /// The key-value area: key -> value and the revision of its last write.
    pub kv: BTreeMap<String, KvValue>,
    /// The last revision given out, to a key-value write or a lock taken; it only grows,
    /// so it orders every such change cluster-wide.
    pub revision: u64,
    /// Edge id ("" = not bound) -> ids of the leases bound there. Derived; rebuilt on load.
    #[serde(skip)]
    pub by_edge: HashMap<String, BTreeSet<String>>,
    /// `released` by time, for pruning. Derived; rebuilt on load.
    #[serde(skip)]
    pub released_by_time: BTreeSet<(i64, String)>,
    /// Bytes of keys and values in `kv`. Derived; rebuilt on load.
    #[serde(skip)]
    pub kv_bytes: usize,
}

/// How long a released lease id is remembered (seconds). Copies of one admission are all
/// proposed within IAM clients' patience and the commit timeout (about 15 s): a minute
/// covers them with room to spare.
pub const RELEASED_KEEP_S: i64 = 60;

/// Who holds a lock, until when (milliseconds, the proposers' clocks).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct LockHold {
    /// The holder's name, `role/id` (`watcher/1`).
    pub holder: String,
    /// Unix milliseconds after which anyone may take it.
    pub expires_at_ms: i64,
    /// The revision given when this holder took it (a fencing token: it grows with every
    /// change of holder and stays the same across renewals).
    pub fence: u64,
}

/// One key of the key-value area.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct KvValue {
    /// The value as written; IAM does not interpret it. Base64 in JSON.
    #[serde(with = "b64")]
    pub value: Vec<u8>,
    /// The revision of its last write.
    pub revision: u64,
}

/// Serde of bytes as standard base64 text (snapshots, logs and backups are JSON).
pub mod b64 {
    use base64::Engine;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&base64::engine::general_purpose::STANDARD.encode(v))
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u8>, D::Error> {
        let text = String::deserialize(d)?;
        base64::engine::general_purpose::STANDARD
            .decode(text)
            .map_err(serde::de::Error::custom)
    }
}

/// Config values `apply` needs (docs/configuration.md `iam.root_quota`, `iam.max_token_ttl_s`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Settings {
    /// Root's quota; a missing key is unlimited.
    pub root_quota: BTreeMap<String, f64>,
    /// Longest token lifetime in seconds; 0 = no limit.
    pub max_token_ttl_s: i64,
}

/// One project of the tree.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Project {
    /// Quota keys (`sandboxes`, `cpu_cores`, `memory_mb`, `gpus`) -> limit; missing = unlimited.
    pub quota: BTreeMap<String, f64>,
    /// What the project and all its subprojects hold at once (sum of their leases).
    pub usage: Res,
    /// Principal -> permissions held directly on this project.
    pub policies: BTreeMap<String, BTreeSet<String>>,
    /// Unix seconds.
    pub created_at: i64,
}

/// A principal: a person, service or agent calling the API.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Principal {
    /// The project it was created in; that project's admins manage it.
    pub project: String,
    /// `user`, `service` or `agent`: a label only.
    pub kind: String,
    /// Token id -> token.
    pub tokens: BTreeMap<String, Token>,
    pub created_at: i64,
    pub created_by: String,
}

/// A token: only the hash of its secret is kept.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Token {
    /// Lowercase hex SHA-256 of the secret part of `dsk.<principal>.<id>.<secret>`.
    pub hash: String,
    pub created_at: i64,
    /// Unix seconds; 0 = never.
    pub expires_at: i64,
    pub description: String,
    pub created_by: String,
}

/// A quota lease: the resources one sandbox holds, charged to its project and every ancestor.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Lease {
    pub project: String,
    pub principal: String,
    pub resources: Res,
    /// The edge the sandbox runs on; "" = not bound yet.
    pub edge_id: String,
    pub sandbox_id: String,
    pub created_at: i64,
    /// When it was last bound to an edge; 0 = never.
    pub bound_at: i64,
    /// Digest of the spec it was admitted for; "" = unknown (admitted before digests).
    pub spec_digest: String,
}

/// Usage of one project's own sandboxes on one UTC day (docs/concepts.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct UsageRow {
    pub sandboxes_started: i64,
    pub sandbox_hours: f64,
    pub cpu_core_hours: f64,
    pub memory_gb_hours: f64,
    pub gpu_hours: f64,
}

impl UsageRow {
    pub fn add(&mut self, o: &UsageRow) {
        self.sandboxes_started += o.sandboxes_started;
        self.sandbox_hours += o.sandbox_hours;
        self.cpu_core_hours += o.cpu_core_hours;
        self.memory_gb_hours += o.memory_gb_hours;
        self.gpu_hours += o.gpu_hours;
    }
}

/// The acting principal of a command, as the proposer authenticated it: the token is checked
/// again when the command applies, so a revocation ordered before it wins.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Actor {
    pub principal: String,
    pub token_id: String,
    /// Hex SHA-256 of the token's secret.
    pub secret_hash: String,
}

/// `path` and each of its ancestors, root first, without allocating.
pub fn ancestors(path: &str) -> impl Iterator<Item = &str> {
    path.match_indices('/')
        .map(move |(i, _)| &path[..i])
        .chain(std::iter::once(path))
}

/// The value of quota key `key` in a resource vector.
pub fn res_key(r: &Res, key: &str) -> f64 {
    match key {
        "sandboxes" => r.sandboxes as f64,
        "cpu_cores" => r.cpu_cores,
        "memory_mb" => r.memory_mb as f64,
        "gpus" => r.gpus as f64,
        _ => 0.0,
    }
}

/// Checks a quota map: known keys, finite values in 0..=1e12. Errors are `invalid`.
pub fn check_quota_map(q: &BTreeMap<String, f64>) -> Result<(), Failure> {
    for (k, v) in q {
        if !names::QUOTA_KEYS.contains(&k.as_str()) {
            return Err(Failure::invalid(format!(
                "unknown quota key {k:?}; known: {}",
                names::QUOTA_KEYS.join(", ")
            )));
        }
        if !v.is_finite() || *v < 0.0 || *v > MAX_QUOTA {
            return Err(Failure::invalid(format!(
                "quota {k}={v} must be a number from 0 to {MAX_QUOTA}"
            )));
        }
    }
    Ok(())
}

/// Checks a resource request: finite, not negative, not absurd. Errors are `invalid`.
pub fn check_res(r: &Res) -> Result<(), Failure> {
    let ok = r.cpu_cores.is_finite()
        && (0.0..=MAX_QUOTA).contains(&r.cpu_cores)
        && (0..=MAX_QUOTA as i64).contains(&r.memory_mb)
        && (0..=MAX_QUOTA as i64).contains(&r.gpus)
        && (0..=MAX_QUOTA as i64).contains(&r.disk_mb);
    if ok {
        Ok(())
    } else {
        Err(Failure::invalid(format!(
            "resources cpu_cores={} memory_mb={} gpus={} disk_mb={} must be finite and from 0 to {MAX_QUOTA}",
            r.cpu_cores, r.memory_mb, r.gpus, r.disk_mb
        )))
    }
}

/// Checks an opaque id (lease, sandbox, token id): 1..=128 printable characters without spaces.
pub fn check_id(what: &str, id: &str) -> Result<(), Failure> {
    if id.is_empty() || id.len() > 128 || id.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(Failure::invalid(format!(
            "{what} {id:?} must be 1 to 128 characters without spaces"
        )));
    }
    Ok(())
}

/// Checks a token id: like [`check_id`], and without `.` (it is a field of the token).
pub fn check_token_id(id: &str) -> Result<(), Failure> {
    check_id("token id", id)?;
    if id.contains('.') {
        return Err(Failure::invalid(format!(
            "token id {id:?} may not contain '.'"
        )));
    }
    Ok(())
}

/// Checks a stored hash: 64 lowercase hex digits.
pub fn check_hash(h: &str) -> Result<(), Failure> {
    if h.len() == 64
        && h.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    {
        Ok(())
    } else {
        Err(Failure::invalid(
            "token hash must be 64 lowercase hex digits",
        ))
    }
}

impl IamState {
    /// True once `Bootstrap` has applied.
    pub fn bootstrapped(&self) -> bool {
        self.projects.contains_key(ROOT)
    }

    /// The project at `path`: `invalid` for a malformed path, `not_found` when absent.
    pub fn project(&self, path: &str) -> Result<&Project, Failure> {
        names::check_project_path(path)?;
        self.projects
            .get(path)
            .ok_or_else(|| Failure::not_found(format!("project {path:?} not found")))
    }

    /// The principal `id`: `invalid` for a malformed id, `not_found` when absent.
    pub fn principal(&self, id: &str) -> Result<&Principal, Failure> {
        names::check_principal_id(id)?;
        self.principals
            .get(id)
            .ok_or_else(|| Failure::not_found(format!("principal {id:?} not found")))
    }

    /// Does `principal` hold `perm` on `project`, directly or on an ancestor? The administrator
    /// holds everything; `project.admin` on root also acts as `fleet.view` and `fleet.operate`.
    pub fn holds(&self, principal: &str, project: &str, perm: &str) -> bool {
        if principal == self.admin_id && self.principals.contains_key(principal) {
            return true;
        }
        let direct = |p: &str, perm: &str| {
            self.projects
                .get(p)
                .and_then(|pr| pr.policies.get(principal))
                .is_some_and(|s| s.contains(perm))
        };
        if ancestors(project).any(|p| direct(p, perm)) {
            return true;
        }
        perm.starts_with("fleet.") && direct(ROOT, "project.admin")
    }

    /// Like [`holds`](Self::holds) but a `forbidden` failure naming permission and project.
    pub fn require(&self, principal: &str, project: &str, perm: &str) -> Result<(), Failure> {
        if self.holds(principal, project, perm) {
            Ok(())
        } else {
            Err(Failure::forbidden(format!(
                "principal {principal:?} lacks {perm} on {project}"
            )))
        }
    }

    /// Does `principal` hold any permission on `project` (or an ancestor)?
    pub fn holds_any(&self, principal: &str, project: &str) -> bool {
        names::PERMISSIONS
            .iter()
            .any(|p| self.holds(principal, project, p))
    }

    /// Checks an actor's token at time `now`: the principal exists, the token id exists (it
    /// was not revoked), the hash matches and it has not expired. Errors are `unauthenticated`.
    pub fn authenticate(&self, actor: &Actor, now: i64) -> Result<&Principal, Failure> {
        let bad = || Failure::unauthenticated("token not valid: unknown, revoked or wrong secret");
        let p = self.principals.get(&actor.principal).ok_or_else(bad)?;
        let t = p.tokens.get(&actor.token_id).ok_or_else(bad)?;
        if !crate::rpc::constant_time_eq(t.hash.as_bytes(), actor.secret_hash.as_bytes()) {
            return Err(bad());
        }
        if t.expires_at != 0 && now >= t.expires_at {
            return Err(Failure::unauthenticated(format!(
                "token {} of {} expired at {}",
                actor.token_id, actor.principal, t.expires_at
            )));
        }
        Ok(p)
    }

    /// May `actor` manage `target`'s tokens? Itself, or with `project.admin` on its project.
    pub fn require_token_manager(&self, actor: &str, target: &str) -> Result<&Principal, Failure> {
        let p = self.principal(target)?;
        if actor != target {
            self.require(actor, &p.project, "project.admin")?;
        }
        Ok(p)
    }

    /// `path` itself when it exists, else its nearest existing ancestor (root, at worst).
    /// Leases always name an existing project, so usage stays the sum of the leases.
    pub fn nearest_project(&self, path: &str) -> String {
        ancestors(path)
            .filter(|a| self.projects.contains_key(*a))
            .last()
            .unwrap_or(ROOT)
            .to_string()
    }

    /// Direct subprojects of `path`, as full paths, in order.
    pub fn children(&self, path: &str) -> Vec<String> {
        let prefix = format!("{path}/");
        self.projects
            .range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
            .filter(|(k, _)| !k[prefix.len()..].contains('/'))
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Does `path` have any subproject?
    pub fn has_children(&self, path: &str) -> bool {
        let prefix = format!("{path}/");
        self.projects
            .range(prefix.clone()..)
            .next()
            .is_some_and(|(k, _)| k.starts_with(&prefix))
    }

    /// The smallest limit of `key` along `path` and its ancestors, if any level sets one.
    pub fn tightest<'a>(&self, path: &'a str, key: &str) -> Option<(f64, &'a str)> {
        let mut best: Option<(f64, &'a str)> = None;
        for a in ancestors(path) {
            if let Some(v) = self.projects.get(a).and_then(|p| p.quota.get(key)) {
                if best.is_none_or(|(b, _)| *v < b) {
                    best = Some((*v, a));
                }
            }
        }
        best
    }

    /// Resolves a quota for a project under `parent`: given keys must not exceed any ancestor
    /// (`invalid`, naming level and key); missing keys take the tightest ancestor limit.
    pub fn resolve_quota(
        &self,
        parent: &str,
        given: &BTreeMap<String, f64>,
    ) -> Result<BTreeMap<String, f64>, Failure> {
        check_quota_map(given)?;
        let mut out = BTreeMap::new();
        for key in names::QUOTA_KEYS {
            match (given.get(key), self.tightest(parent, key)) {
                (Some(v), Some((limit, level))) if *v > limit + EPS => {
                    return Err(Failure::invalid(format!(
                        "quota {key}={v} exceeds {level}'s {key}={limit}"
                    )));
                }
                (Some(v), _) => {
                    out.insert(key.to_string(), *v);
                }
                (None, Some((limit, _))) => {
                    out.insert(key.to_string(), limit);
                }
                (None, None) => {}
            }
        }
        Ok(out)
    }

    /// Checks that `res` more fits the quota of `project` and every ancestor; `quota_exceeded`
    /// names the first level and key that would go over.
    pub fn check_quota(&self, project: &str, res: &Res) -> Result<(), Failure> {
        for a in ancestors(project) {
            let Some(p) = self.projects.get(a) else {
                continue;
            };
            for (key, limit) in &p.quota {
                let used = res_key(&p.usage, key);
                let asked = res_key(res, key);
                if asked > 0.0 && used + asked > limit + EPS {
                    return Err(Failure::new(
                        Reason::QuotaExceeded,
                        format!("quota of {a} exceeded: {key} limit {limit}, in use {used}, asked {asked}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Adds `res` to the usage of `project` and every existing ancestor.
    pub fn charge(&mut self, project: &str, res: &Res) {
        for a in ancestors(project) {
            if let Some(p) = self.projects.get_mut(a) {
                p.usage.add(res);
            }
        }
    }

    /// Subtracts `res` from the usage of `project` and every existing ancestor.
    pub fn uncharge(&mut self, project: &str, res: &Res) {
        for a in ancestors(project) {
            if let Some(p) = self.projects.get_mut(a) {
                p.usage.sub(res);
            }
        }
    }

    /// Recomputes every project's usage from the leases (after a restore).
    pub fn recompute_usage(&mut self) {
        for p in self.projects.values_mut() {
            p.usage = Res::default();
        }
        let leases: Vec<(String, Res)> = self
            .leases
            .values()
            .map(|l| (l.project.clone(), l.resources))
            .collect();
        for (project, res) in leases {
            self.charge(&project, &res);
        }
    }

    /// Records that lease `id` is bound to `edge` ("" = unbound) in the derived index.
    pub fn index_add(&mut self, edge: &str, id: &str) {
        self.by_edge
            .entry(edge.to_string())
            .or_default()
            .insert(id.to_string());
    }

    /// Removes lease `id` from `edge`'s entry of the derived index.
    pub fn index_remove(&mut self, edge: &str, id: &str) {
        if let Some(set) = self.by_edge.get_mut(edge) {
            set.remove(id);
            if set.is_empty() {
                self.by_edge.remove(edge);
            }
        }
    }

    /// Rebuilds the derived lease index (after loading a snapshot).
    pub fn rebuild_index(&mut self) {
        let mut idx: HashMap<String, BTreeSet<String>> = HashMap::new();
        for (id, l) in &self.leases {
            idx.entry(l.edge_id.clone()).or_default().insert(id.clone());
        }
        self.by_edge = idx;
        self.released_by_time = self
            .released
            .iter()
            .map(|(id, t)| (*t, id.clone()))
            .collect();
        self.kv_bytes = super::apply_kv::area_bytes(&self.kv);
    }

    /// Remembers that lease `id` was released at `now`.
    pub fn remember_released(&mut self, id: &str, now: i64) {
        if let Some(old) = self.released.insert(id.to_string(), now) {
            self.released_by_time.remove(&(old, id.to_string()));
        }
        self.released_by_time.insert((now, id.to_string()));
    }

    /// Forgets released lease ids older than [`RELEASED_KEEP_S`] before `now`.
    pub fn prune_released(&mut self, now: i64) {
        while let Some((t, id)) = self.released_by_time.first().cloned() {
            if t >= now - RELEASED_KEEP_S {
                break;
            }
            self.released_by_time.pop_first();
            self.released.remove(&id);
        }
    }

    /// Lease ids bound to `edge` ("" = unbound), in order.
    pub fn leases_on(&self, edge: &str) -> Vec<String> {
        self.by_edge
            .get(edge)
            .map(|s| s.iter().cloned().collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn quota(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    fn tree() -> IamState {
        let mut st = IamState {
            admin_id: "admin".into(),
            ..Default::default()
        };
        st.principals.insert(
            "admin".into(),
            Principal {
                project: ROOT.into(),
                ..Default::default()
            },
        );
        st.principals.insert(
            "bob".into(),
            Principal {
                project: "root/a".into(),
                ..Default::default()
            },
        );
        st.projects.insert(
            ROOT.into(),
            Project {
                quota: quota(&[("sandboxes", 10.0)]),
                ..Default::default()
            },
        );
        st.projects.insert(
            "root/a".into(),
            Project {
                quota: quota(&[("sandboxes", 5.0), ("cpu_cores", 8.0)]),
                ..Default::default()
            },
        );
        st.projects.insert("root/a/b".into(), Project::default());
        st.projects.insert("root/ab".into(), Project::default());
        st
    }

    #[test]
    fn ancestors_walk_root_first() {
        assert_eq!(
            ancestors("root/a/b").collect::<Vec<_>>(),
            vec!["root", "root/a", "root/a/b"]
        );
        assert_eq!(ancestors("root").collect::<Vec<_>>(), vec!["root"]);
    }

    #[test]
    fn permissions_are_inherited_and_imply_nothing_else() {
        let mut st = tree();
        st.projects
            .get_mut("root/a")
            .unwrap()
            .policies
            .insert("bob".into(), ["sandbox.create".to_string()].into());
        assert!(st.holds("bob", "root/a", "sandbox.create"));
        assert!(st.holds("bob", "root/a/b", "sandbox.create"));
        assert!(!st.holds("bob", "root", "sandbox.create"));
        assert!(!st.holds("bob", "root/ab", "sandbox.create"));
        assert!(!st.holds("bob", "root/a", "sandbox.operate"));
        // project.admin implies nothing else below root.
        st.projects
            .get_mut("root/a")
            .unwrap()
            .policies
            .insert("bob".into(), ["project.admin".to_string()].into());
        assert!(!st.holds("bob", "root/a", "sandbox.create"));
        assert!(!st.holds("bob", "root", "fleet.view"));
        let e = st.require("bob", "root/a", "layer.use").unwrap_err();
        assert_eq!(e.reason, Reason::Forbidden);
        assert!(
            e.message.contains("layer.use") && e.message.contains("root/a"),
            "{}",
            e.message
        );
    }

    #[test]
    fn admin_on_root_acts_as_fleet_permissions() {
        let mut st = tree();
        st.projects
            .get_mut(ROOT)
            .unwrap()
            .policies
            .insert("bob".into(), ["project.admin".to_string()].into());
        assert!(st.holds("bob", ROOT, "fleet.view"));
        assert!(st.holds("bob", ROOT, "fleet.operate"));
        assert!(!st.holds("bob", ROOT, "layer.publish"));
    }

    #[test]
    fn the_administrator_holds_everything() {
        let st = tree();
        for p in names::PERMISSIONS {
            assert!(st.holds("admin", "root/a/b", p));
        }
    }

    #[test]
    fn children_are_direct_only() {
        let st = tree();
        assert_eq!(
            st.children(ROOT),
            vec!["root/a".to_string(), "root/ab".to_string()]
        );
        assert_eq!(st.children("root/a"), vec!["root/a/b".to_string()]);
        assert!(st.has_children("root/a"));
        assert!(!st.has_children("root/a/b"));
        assert!(!st.has_children("root/ab"));
    }

    #[test]
    fn quota_resolution_takes_the_tightest_and_refuses_more() {
        let st = tree();
        let q = st
            .resolve_quota("root/a", &quota(&[("gpus", 2.0)]))
            .unwrap();
        assert_eq!(
            q,
            quota(&[("sandboxes", 5.0), ("cpu_cores", 8.0), ("gpus", 2.0)])
        );
        let e = st
            .resolve_quota("root/a", &quota(&[("sandboxes", 7.0)]))
            .unwrap_err();
        assert_eq!(e.reason, Reason::Invalid);
        assert!(
            e.message.contains("root/a") && e.message.contains("sandboxes"),
            "{}",
            e.message
        );
        let e = st
            .resolve_quota("root/a", &quota(&[("sandboxes", 11.0)]))
            .unwrap_err();
        assert!(e.message.contains("sandboxes"));
        for bad in [f64::NAN, -1.0, 2e12, f64::INFINITY] {
            assert_eq!(
                st.resolve_quota("root", &quota(&[("gpus", bad)]))
                    .unwrap_err()
                    .reason,
                Reason::Invalid
            );
        }
        assert_eq!(
            st.resolve_quota("root", &quota(&[("disks", 1.0)]))
                .unwrap_err()
                .reason,
            Reason::Invalid
        );
    }

    #[test]
    fn quota_is_checked_at_every_level() {
        let mut st = tree();
        let one = Res {
            sandboxes: 1,
            cpu_cores: 1.0,
            ..Default::default()
        };
        for _ in 0..5 {
            st.check_quota("root/a/b", &one).unwrap();
            st.charge("root/a/b", &one);
        }
        let e = st.check_quota("root/a/b", &one).unwrap_err();
        assert_eq!(e.reason, Reason::QuotaExceeded);
        assert!(
            e.message.contains("root/a") && e.message.contains("sandboxes"),
            "{}",
            e.message
        );
        // The root level limits its other children too.
        for _ in 0..5 {
            st.check_quota("root/ab", &one).unwrap();
            st.charge("root/ab", &one);
        }
        let e = st.check_quota("root/ab", &one).unwrap_err();
        assert!(
            e.message.contains("quota of root exceeded"),
            "{}",
            e.message
        );
        st.uncharge("root/a/b", &one);
        assert_eq!(st.projects["root/a"].usage.sandboxes, 4);
        assert_eq!(st.projects[ROOT].usage.sandboxes, 9);
        st.check_quota("root/ab", &one).unwrap();
    }

    #[test]
    fn input_checks() {
        assert!(check_res(&Res {
            cpu_cores: f64::NAN,
            ..Default::default()
        })
        .is_err());
        assert!(check_res(&Res {
            memory_mb: -1,
            ..Default::default()
        })
        .is_err());
        assert!(check_res(&Res {
            cpu_cores: 2.5,
            memory_mb: 512,
            ..Default::default()
        })
        .is_ok());
        assert!(check_hash(&"a".repeat(64)).is_ok());
        assert!(check_hash(&"A".repeat(64)).is_err());
        assert!(check_token_id("t1").is_ok());
        assert!(check_token_id("t.1").is_err());
        assert!(check_id("lease id", "").is_err());
    }
}
