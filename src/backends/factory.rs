//! Builds a backend from its config (`edges[].backends.<name>`, docs/configuration.md).

use std::sync::Arc;

use super::{container::ContainerBackend, sim::SimBackend, Backend, BackendContext, BackendError};
use crate::config::BackendConfig;

/// Builds the backend `name` from `cfg`. Runtimes `sim`, `linux` (containers) and `qemu`
/// (microVMs) are built; `firecracker` fails with `BackendError::Config` ("runtime ... is
/// not built yet"), as does an unknown runtime, a sim config out of range, or a `qemu`
/// backend without its kernel.
pub fn build(
    name: &str,
    cfg: &BackendConfig,
    ctx: &BackendContext,
) -> Result<Arc<dyn Backend>, BackendError> {
    match cfg.runtime() {
        "sim" => Ok(Arc::new(SimBackend::new(name, cfg)?)),
        "linux" => Ok(Arc::new(ContainerBackend::new(name, cfg, ctx)?)),
        "qemu" => Ok(Arc::new(super::microvm::MicrovmBackend::new(
            name, cfg, ctx,
        )?)),
        r @ "firecracker" => Err(BackendError::Config {
            backend: name.to_string(),
            message: format!(
                "runtime {r:?} is not built yet in this version; use runtime \"qemu\""
            ),
        }),
        other => Err(BackendError::Config {
            backend: name.to_string(),
            message: format!("unknown runtime {other:?}"),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sim_is_built_and_firecracker_is_not_yet() {
        let ctx = BackendContext::default();
        let b = build("sim", &BackendConfig::default(), &ctx).map_err(|e| e.to_string());
        let b = match b {
            Ok(b) => b,
            Err(e) => panic!("sim should build: {e}"),
        };
        assert_eq!(b.name(), "sim");
        assert_eq!(b.runtime_kind(), "sim");
        assert!(b.simulated());
        let cfg = BackendConfig {
            runtime: "firecracker".into(),
            ..Default::default()
        };
        let err = build("x", &cfg, &ctx)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("not built yet"), "{err}");
        // A qemu backend is built, and needs its guest kernel.
        let cfg = BackendConfig {
            runtime: "qemu".into(),
            ..Default::default()
        };
        let err = build("vm", &cfg, &ctx)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("\"kernel\" is required"), "{err}");
        let cfg = BackendConfig {
            runtime: "docker".into(),
            ..Default::default()
        };
        assert!(build("x", &cfg, &ctx).is_err());
    }
}
