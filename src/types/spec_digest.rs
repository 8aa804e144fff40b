//! A stable digest of a sandbox spec: what ties an idempotency key to the sandbox it made.
//! The same key with another spec is `conflict`, not the old sandbox (docs/architecture.md).

use prost::Message;
use sha2::{Digest, Sha256};

use crate::pb;

/// Lowercase hex SHA-256 of `spec`. Protobuf encodes map fields in no fixed order, so the
/// maps (labels, network rules) are hashed sorted, after the rest.
pub fn spec_digest(spec: &pb::SandboxSpec) -> String {
    let mut rest = spec.clone();
    let labels = std::mem::take(&mut rest.labels);
    let rules = std::mem::take(&mut rest.network_rules);
    let mut h = Sha256::new();
    let body = rest.encode_to_vec();
    h.update((body.len() as u64).to_le_bytes());
    h.update(&body);
    let mut labels: Vec<(String, String)> = labels.into_iter().collect();
    labels.sort();
    for (k, v) in labels {
        for part in [k.as_bytes(), v.as_bytes()] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part);
        }
    }
    h.update([0xff]);
    let mut rules: Vec<(String, bool)> = rules.into_iter().collect();
    rules.sort();
    for (k, v) in rules {
        h.update((k.len() as u64).to_le_bytes());
        h.update(k.as_bytes());
        h.update([u8::from(v)]);
    }
    hex::encode(h.finalize())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_specs_have_equal_digests_and_any_field_changes_it() {
        let mut a = pb::SandboxSpec {
            backend: "sim".into(),
            cpu_cores_limit: 1.0,
            ..Default::default()
        };
        for i in 0..20 {
            a.labels.insert(format!("k{i}"), format!("v{i}"));
        }
        let b = a.clone();
        assert_eq!(spec_digest(&a), spec_digest(&b));
        let mut c = a.clone();
        c.cpu_cores_limit = 2.0;
        assert_ne!(spec_digest(&a), spec_digest(&c));
        let mut d = a.clone();
        d.labels.insert("k0".into(), "other".into());
        assert_ne!(spec_digest(&a), spec_digest(&d));
    }
}
