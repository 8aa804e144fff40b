//! aether's `opendsec.v1.Guest`, served in a microVM beside the runtime API and reached by
//! the edge alone (the edge forwards the runtime API only): what a restored VM must do
//! before anything of the sandbox runs on (docs/microvm.md "Snapshots and copies").

use tonic::{Request, Response, Status};

use crate::pb;
use crate::rpc::to_status;
use crate::types::Failure;

/// The smallest seed a restore is given: 256 bits, a full reseed of the kernel's CRNG.
pub const MIN_SEED: usize = 32;

/// The Guest service of a microVM's aether.
pub struct VmGuest;

/// Checks a PostRestore request. Errors: `invalid`, naming the field.
pub fn check(r: &pb::PostRestoreRequest) -> Result<(), Failure> {
    if r.sandbox_id.len() > 255 {
        return Err(Failure::invalid("sandbox_id must be at most 255 bytes"));
    }
    let h = r.hostname.as_bytes();
    if h.len() > 64
        || !h
            .iter()
            .all(|c| c.is_ascii_alphanumeric() || *c == b'-' || *c == b'.')
    {
        return Err(Failure::invalid(format!(
            "hostname {:?} must be at most 64 letters, digits, '-' or '.'",
            crate::types::names::shown(&r.hostname)
        )));
    }
    if r.seed.len() < MIN_SEED || r.seed.len() > crate::sys::random::MAX_SEED {
        return Err(Failure::invalid(format!(
            "a seed of {} bytes; {MIN_SEED} to {} are taken",
            r.seed.len(),
            crate::sys::random::MAX_SEED
        )));
    }
    Ok(())
}

#[tonic::async_trait]
impl pb::guest_server::Guest for VmGuest {
    /// Reseeds the kernel's RNG, sets the clock, and takes the identity given (an empty
    /// `sandbox_id` or `hostname` keeps the guest's). Errors: `invalid`
    /// (see [`check`]), `internal` naming the step the guest refused.
    async fn post_restore(
        &self,
        req: Request<pb::PostRestoreRequest>,
    ) -> Result<Response<pb::Empty>, Status> {
        let r = req.into_inner();
        check(&r).map_err(|f| to_status(&f))?;
        let step = |what: &str, e: &dyn std::fmt::Display| {
            to_status(&Failure::internal(format!(
                "after the restore, {what}: {e}"
            )))
        };
        crate::sys::random::reseed(&r.seed).map_err(|e| step("reseeding the RNG", &e))?;
        if r.unix_time_ns > 0 {
            crate::sys::random::set_realtime(r.unix_time_ns)
                .map_err(|e| step("setting the clock", &e))?;
        }
        if !r.hostname.is_empty() {
            nix::unistd::sethostname(&r.hostname).map_err(|e| step("setting the hostname", &e))?;
        }
        if !r.sandbox_id.is_empty() {
            crate::guest::vminit::write_machine_id(&r.sandbox_id)
                .map_err(|e| step("writing the machine-id", &crate::types::chain(&e)))?;
        }
        tracing::info!(sandbox_id = %r.sandbox_id, "restored: seed and clock, and the identity given");
        Ok(Response::new(pb::Empty {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req() -> pb::PostRestoreRequest {
        pb::PostRestoreRequest {
            sandbox_id: "n1.abc".into(),
            hostname: "sbx-abc".into(),
            seed: vec![1; 32],
            unix_time_ns: 1,
        }
    }

    #[test]
    fn bad_requests_are_invalid() {
        assert!(check(&req()).is_ok());
        // A resume keeps the guest's identity: both may be empty.
        assert!(check(&pb::PostRestoreRequest {
            sandbox_id: String::new(),
            hostname: String::new(),
            ..req()
        })
        .is_ok());
        let bad = [
            pb::PostRestoreRequest {
                sandbox_id: "s".repeat(256),
                ..req()
            },
            pb::PostRestoreRequest {
                hostname: "a b".into(),
                ..req()
            },
            pb::PostRestoreRequest {
                hostname: "h".repeat(65),
                ..req()
            },
            pb::PostRestoreRequest {
                seed: vec![1; 31],
                ..req()
            },
            pb::PostRestoreRequest {
                seed: vec![1; 513],
                ..req()
            },
        ];
        for r in bad {
            assert_eq!(
                check(&r).unwrap_err().reason,
                crate::types::Reason::Invalid,
                "{r:?}"
            );
        }
    }
}
