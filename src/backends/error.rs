//! `BackendError`: what a backend reports when a lifecycle step fails. Backends never build a
//! `tonic::Status`; the edge maps each variant to a reason (`BackendError::reason`) and turns
//! it into a `Failure` at its own boundary.

use crate::types::Reason;

/// A failed backend step. Variants are named after the step and carry the sandbox id (or
/// the backend's name) and what went wrong.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The backend's config cannot be used (unknown or not yet built runtime, bad field).
    #[error("backend {backend}: {message}")]
    Config { backend: String, message: String },
    /// Creating the sandbox failed; nothing of it is left running.
    #[error("creating sandbox {sandbox_id}: {message}")]
    Create { sandbox_id: String, message: String },
    /// Stopping, pausing or resuming failed (`op` is `stop`, `pause`, `resume`).
    #[error("{op} of sandbox {sandbox_id}: {message}")]
    Operation {
        op: &'static str,
        sandbox_id: String,
        message: String,
    },
    /// Stopping, pausing or resuming failed (`op` as in `Operation`), with its typed cause.
    #[error("{op} of sandbox {sandbox_id}")]
    Step {
        op: &'static str,
        sandbox_id: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// A step failed, and removing what it had made failed too: both are kept, the step's
    /// error first (its reason is the caller's).
    #[error(
        "{}; cleaning up after it failed too: {}",
        crate::types::chain(&**.primary),
        crate::types::chain(&**.cleanup)
    )]
    CleanupFailed {
        primary: Box<BackendError>,
        cleanup: Box<BackendError>,
    },
    /// The sandbox is gone on the node (its process, VM or agent died).
    #[error("sandbox {sandbox_id} is lost: {message}")]
    Lost { sandbox_id: String, message: String },
    /// The memory snapshot a creation restores from was removed before it was held (an
    /// image gc with a grace shorter than a fork): final, a retry finds it gone too.
    #[error("memory snapshot {dir} was removed before this copy restored it{hint}")]
    SnapshotGone { dir: String, hint: &'static str },
    /// A recorded sandbox could not be taken over again after an edge restart.
    #[error("adopting sandbox {sandbox_id}: {message}")]
    Adopt { sandbox_id: String, message: String },
    /// The backend does not offer this operation (a capability it lacks).
    #[error("backend {backend} does not support {op}")]
    Unsupported { backend: String, op: &'static str },
    /// The node is out of something the backend needs right now (uids, addresses, disk).
    #[error("backend {backend}: {message}")]
    Exhausted { backend: String, message: String },
    /// The request cannot be served as asked (a bad path, a bad field).
    #[error("sandbox {sandbox_id}: {message}")]
    Invalid { sandbox_id: String, message: String },
    /// The image is not on this node, and not in the image store.
    #[error("image {image:?} is not on this edge or in the image store")]
    ImageNotFound { image: String },
    /// The image store cannot be read now, or a layer cannot be copied to the node.
    #[error("image {image}: {message}")]
    ImageUnavailable { image: String, message: String },
    /// Packing the sandbox's files into a layer failed; the reason is the pack's.
    #[error("sandbox {sandbox_id}: packing its files")]
    Pack {
        sandbox_id: String,
        #[source]
        source: crate::images::pack::PackError,
    },
    /// A file or device step failed.
    #[error("{step} {path}")]
    Io {
        step: &'static str,
        path: String,
        source: std::io::Error,
    },
}

impl BackendError {
    /// The stable reason a caller sees for this error (docs/concepts.md).
    pub fn reason(&self) -> Reason {
        match self {
            BackendError::Config { .. }
            | BackendError::Unsupported { .. }
            | BackendError::Invalid { .. } => Reason::Invalid,
            BackendError::Lost { .. }
            | BackendError::ImageNotFound { .. }
            | BackendError::SnapshotGone { .. } => Reason::NotFound,
            BackendError::Exhausted { .. } => Reason::NoCapacity,
            BackendError::ImageUnavailable { .. } => Reason::Unavailable,
            BackendError::CleanupFailed { primary, .. } => primary.reason(),
            BackendError::Pack { source, .. } => source.to_failure().reason,
            BackendError::Create { .. }
            | BackendError::Operation { .. }
            | BackendError::Step { .. }
            | BackendError::Adopt { .. }
            | BackendError::Io { .. } => Reason::Internal,
        }
    }

    /// This error as a domain failure for the caller.
    pub fn to_failure(&self) -> crate::types::Failure {
        crate::types::Failure::new(self.reason(), crate::types::chain(self))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reasons_follow_the_kind_of_error() {
        let c = BackendError::Config {
            backend: "vm".into(),
            message: "runtime qemu is not built yet".into(),
        };
        assert_eq!(c.reason(), Reason::Invalid);
        assert!(c.to_string().contains("not built yet"));
        let e = BackendError::Exhausted {
            backend: "vm".into(),
            message: "no uid left".into(),
        };
        assert_eq!(e.to_failure().reason, Reason::NoCapacity);
        let l = BackendError::Lost {
            sandbox_id: "e.x".into(),
            message: "agent gone".into(),
        };
        assert_eq!(l.reason(), Reason::NotFound);
        let k = BackendError::Create {
            sandbox_id: "e.x".into(),
            message: "boom".into(),
        };
        assert_eq!(k.reason(), Reason::Internal);
        assert_eq!(k.to_failure().message, "creating sandbox e.x: boom");
    }

    #[test]
    fn a_failed_cleanup_keeps_both_errors_and_the_primary_reason() {
        let primary = BackendError::Invalid {
            sandbox_id: "e.x".into(),
            message: "no such user".into(),
        };
        let cleanup = BackendError::Step {
            op: "stop",
            sandbox_id: "e.x".into(),
            source: Box::new(std::io::Error::from_raw_os_error(libc::EBUSY)),
        };
        let both = BackendError::CleanupFailed {
            primary: Box::new(primary),
            cleanup: Box::new(cleanup),
        };
        let f = both.to_failure();
        assert_eq!(f.reason, Reason::Invalid);
        assert!(
            f.message.starts_with("sandbox e.x: no such user; "),
            "{}",
            f.message
        );
        assert!(
            f.message
                .contains("stop of sandbox e.x: Device or resource busy"),
            "{}",
            f.message
        );
        assert_eq!(f.message.matches("busy").count(), 1, "{}", f.message);
    }
}
