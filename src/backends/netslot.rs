//! A sandbox's place in its edge's network (docs/network.md), as the container and microVM
//! backends share it: the policy and slot a creation takes, `UpdateNetwork`, adoption after
//! an edge restart, and the release at a stop. How the slot's veth reaches the sandbox is
//! each backend's own (a container's netns is its init's; a VM's is pinned, with a tap).

use std::sync::Arc;
use std::time::Duration;

use super::{BackendError, Handle};
use crate::netpol::network::{Network, NetworkError};
use crate::netpol::Policy;

/// When releasing a stopped sandbox's slot failed, how long to wait before each new try.
pub const RELEASE_RETRIES: [Duration; 5] = [
    Duration::from_secs(2),
    Duration::from_secs(10),
    Duration::from_secs(30),
    Duration::from_secs(60),
    Duration::from_secs(300),
];

/// For a new sandbox `id` on an edge with networking: its policy first (a bad rule changes
/// nothing), then a slot, which the caller gives back with [`release`] if the creation
/// fails. None without networking (the edge has refused rules that would allow anything).
/// Errors: `Invalid` (a rule that does not resolve), `Exhausted` (no free slot).
pub fn reserve(
    network: Option<&Network>,
    backend: &str,
    id: &str,
    spec: &crate::pb::SandboxSpec,
) -> Result<Option<(u32, Policy)>, BackendError> {
    let Some(n) = network else {
        return Ok(None);
    };
    let policy = n
        .policy(&spec.network_rules)
        .map_err(|e| BackendError::Invalid {
            sandbox_id: id.to_string(),
            message: format!("network_rules: {e}"),
        })?;
    let slot = n.reserve().map_err(|e| BackendError::Exhausted {
        backend: backend.to_string(),
        message: crate::types::chain(&e),
    })?;
    Ok(Some((slot, policy)))
}

/// `UpdateNetwork` of `sandbox`, which holds `slot` (None: created while the edge's
/// networking was off, so it has only `lo`). Errors: `Invalid` (a rule that does not
/// resolve; allowing anything to a sandbox without a network), `Step` (the table).
pub async fn update(
    network: Option<&Network>,
    sandbox: &Handle<'_>,
    slot: Option<u32>,
) -> Result<(), BackendError> {
    let id = sandbox.sandbox_id;
    let Some(net) = network else {
        // No networking: its sandboxes have only `lo`, and the edge refuses rules that
        // would allow anything, so an empty set is all that gets here.
        return Ok(());
    };
    let invalid = |message: String| BackendError::Invalid {
        sandbox_id: id.to_string(),
        message,
    };
    // The policy first: a rule that does not resolve changes nothing.
    let policy = net
        .policy(&sandbox.spec.network_rules)
        .map_err(|e| invalid(format!("network_rules: {e}")))?;
    let Some(slot) = slot else {
        // Nothing to take back, and nothing an allowance of its own could open.
        if sandbox.spec.network_rules.values().all(|allowed| !allowed) {
            return Ok(());
        }
        return Err(invalid(
            "it was created while this edge's sandbox networking was off and has only a \
             loopback interface; its network_rules cannot allow anything"
                .into(),
        ));
    };
    net.update(slot, &policy)
        .await
        .map_err(|e| BackendError::Step {
            op: "network update",
            sandbox_id: id.to_string(),
            source: Box::new(e),
        })
}

/// Holds `slot` again for `sandbox`, adopted after an edge restart, and rewrites its rules.
/// A slot whose veth is gone or that the subnet no longer has makes the sandbox lost:
/// nothing of this table would filter its traffic. Other failures are logged, not fatal:
/// the sandbox keeps whatever rules survived, and a sandbox without its chains reaches
/// nothing (the table drops what no chain accepts). Errors: `Lost`.
pub async fn adopt(
    network: Option<&Network>,
    sandbox: &Handle<'_>,
    slot: u32,
) -> Result<(), BackendError> {
    let id = sandbox.sandbox_id;
    let Some(net) = network else {
        tracing::warn!(sandbox_id = id, slot, "sandbox has a network slot but this edge's networking is off; its veth stays until it stops");
        return Ok(());
    };
    let policy = net.policy(&sandbox.spec.network_rules).unwrap_or_else(|e| {
        tracing::warn!(sandbox_id = id, error = %e, "its network rules no longer resolve (the config changed); it may reach nothing");
        Policy::default()
    });
    match net.adopt(slot, &policy).await {
        Ok(()) => Ok(()),
        Err(e @ (NetworkError::NotHere { .. } | NetworkError::Slot(_))) => {
            Err(BackendError::Lost {
                sandbox_id: id.to_string(),
                message: crate::types::chain(&e).to_string(),
            })
        }
        Err(e) => {
            tracing::warn!(sandbox_id = id, slot, error = %crate::types::chain(&e), "writing an adopted sandbox's network rules");
            Ok(())
        }
    }
}

/// Releases `slot` of a stopped sandbox; when that fails, it is tried again in the
/// background ([`RELEASE_RETRIES`]) and the failure is returned for the stop's error.
pub async fn release(network: Option<&Arc<Network>>, slot: Option<u32>) -> Option<String> {
    let (Some(net), Some(slot)) = (network, slot) else {
        return None;
    };
    let e = net.release(slot).await.err()?;
    net.release_later(slot, &RELEASE_RETRIES);
    Some(format!(
        "removing its network (slot {slot}): {}",
        crate::types::chain(&e)
    ))
}
