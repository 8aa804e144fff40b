//! `UpdateNetwork` on the edge (docs/network.md "Changing a sandbox's rules"): a running or
//! paused sandbox's `network_rules` merged with or replaced by the caller's, applied by its
//! backend at once (a container's nftables chains, in one transaction), then written into
//! its record, so that `GetSandbox` shows them and an edge restart adopts the sandbox with
//! them.

use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use super::machine::{plan, Op, Plan};
use super::metrics;
use super::node::Core;
use crate::backends::Handle;
use crate::netpol::{Rule, MAX_NETWORK_RULES};
use crate::pb;
use crate::types::Failure;

/// The rules a sandbox has after an update: with `replace`, `given`; otherwise `current`
/// with `given` laid over it, where a given rule replaces every current spelling of the same
/// rule (`*.github.com: false` takes back `github.com: true`, as it would in one map).
/// Current keys that no longer parse are kept as they are (the backend's check names them).
/// Errors: `invalid` naming a given rule that does not parse.
pub(crate) fn merged_rules(
    current: &HashMap<String, bool>,
    given: HashMap<String, bool>,
    replace: bool,
) -> Result<HashMap<String, bool>, Failure> {
    let mut keys: Vec<&String> = given.keys().collect();
    // Sorted, so that of several bad rules the same one is named every time.
    keys.sort();
    let mut named = BTreeSet::new();
    for k in keys {
        named.insert(Rule::parse(k).map_err(|e| Failure::invalid(format!("rules: {e}")))?);
    }
    if replace {
        return Ok(given);
    }
    let mut out: HashMap<String, bool> = current
        .iter()
        .filter(|(k, _)| Rule::parse(k).map_or(true, |r| !named.contains(&r)))
        .map(|(k, v)| (k.clone(), *v))
        .collect();
    out.extend(given);
    Ok(out)
}

impl Core {
    /// Changes sandbox `id`'s `network_rules`: merged with `rules` (theirs win) or, with
    /// `replace`, replaced by them. The backend applies them first (under the sandbox's
    /// operation lock); only then are they recorded, so a failure changes nothing. Returns
    /// the updated record.
    /// Errors: `not_found`; `conflict` for a sandbox that is not RUNNING or PAUSED;
    /// `invalid` for a malformed rule (naming it), more than [`MAX_NETWORK_RULES`] rules
    /// after the merge, or rules that allow something on an edge without networking; the
    /// backend's (`internal` when the chains could not be written); `internal` when the
    /// record could not be written (the new rules are in force, but an edge restart would
    /// bring back the old ones: retry).
    pub async fn update_network(
        &self,
        id: &str,
        rules: HashMap<String, bool>,
        replace: bool,
    ) -> Result<pb::Sandbox, Failure> {
        let entry = self.entry(id)?;
        let _g = entry.op.lock().await;
        let rec = entry.snapshot();
        if let Plan::Conflict(m) = plan(Op::Update, rec.state()) {
            return Err(Failure::conflict(format!(
                "sandbox {id}: {m}: its network rules cannot change"
            )));
        }
        let mut spec = rec.spec();
        let merged = merged_rules(&spec.network_rules, rules, replace)?;
        if merged.len() > MAX_NETWORK_RULES {
            return Err(Failure::invalid(format!(
                "rules: the sandbox would have {} network rules, at most {MAX_NETWORK_RULES}",
                merged.len()
            )));
        }
        // Only allowances need a network: taking every rule back is fine anywhere.
        if !self.cfg.network.enabled && merged.values().any(|allowed| *allowed) {
            return Err(self.no_networking());
        }
        if merged == spec.network_rules {
            return Ok(rec.sandbox);
        }
        let Some(backend) = self.backend_of(&rec).cloned() else {
            return Err(Failure::internal(format!(
                "sandbox {id}: backend {:?} is not configured on this edge",
                rec.backend()
            )));
        };
        spec.network_rules = merged;
        let h = Handle {
            sandbox_id: id,
            spec: &spec,
            state: &rec.backend_state,
        };
        let t = Instant::now();
        let applied = backend.update_network(&h).await;
        metrics::op_done(backend.name(), "update_network", &applied, t);
        if let Err(e) = applied {
            tracing::warn!(error = %crate::types::chain(&e), "applying new network rules failed; the old ones stay");
            return Err(e.to_failure());
        }
        let after = self.update(&entry, |r| {
            if let Some(s) = r.sandbox.spec.as_mut() {
                s.network_rules = spec.network_rules;
            }
        });
        if let Some(s) = &self.store {
            if let Err(e) = s.write(&after).await {
                tracing::error!(sandbox_id = %id, error = %crate::types::chain(&e), "writing sandbox record");
                return Err(Failure::internal(format!(
                    "sandbox {id}: its new network rules are in force, but writing its record \
                     failed ({e}); an edge restart would bring back the old ones, so retry",
                    e = crate::types::chain(&e)
                )));
            }
        }
        tracing::info!(
            rules = after.spec().network_rules.len(),
            replace,
            "network rules changed"
        );
        Ok(after.sandbox)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, bool)]) -> HashMap<String, bool> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn a_merge_lays_the_given_rules_over_the_current_ones() {
        let cur = map(&[
            ("github.com", true),
            ("192.0.2.0/24:80", true),
            ("pypi", true),
        ]);
        let m = merged_rules(&cur, map(&[("pypi", false), ("npm", true)]), false).unwrap();
        assert_eq!(
            m,
            map(&[
                ("github.com", true),
                ("192.0.2.0/24:80", true),
                ("pypi", false),
                ("npm", true)
            ])
        );
        // Another spelling of a current rule replaces it rather than conflicting with it.
        let m = merged_rules(&cur, map(&[("*.GitHub.com", false)]), false).unwrap();
        assert_eq!(
            m,
            map(&[
                ("*.GitHub.com", false),
                ("192.0.2.0/24:80", true),
                ("pypi", true)
            ])
        );
        let r = merged_rules(&cur, map(&[("npm", true)]), true).unwrap();
        assert_eq!(r, map(&[("npm", true)]));
        assert!(merged_rules(&cur, HashMap::new(), true).unwrap().is_empty());
    }

    #[test]
    fn a_malformed_given_rule_is_invalid_naming_it() {
        let f = merged_rules(
            &HashMap::new(),
            map(&[("x.io:0", true), ("ok.io", true)]),
            false,
        )
        .unwrap_err();
        assert_eq!(f.reason, crate::types::Reason::Invalid);
        assert_eq!(
            f.message,
            "rules: network rule \"x.io:0\": port outside 1-65535"
        );
    }
}
