//! Builds a backend from its config (`edges[].backends.<name>`, docs/configuration.md).

use std::sync::Arc;

use super::{container::ContainerBackend, sim::SimBackend, Backend, BackendContext, BackendError};
use crate::config::BackendConfig;

/// Builds the backend `name` from `cfg`. Runtimes `sim` and `linux` (containers) are built; `firecracker`
/// and `qemu` fail with `BackendError::Config` ("runtime ... is not built yet"), as does an
/// unknown runtime or a sim config out of range.
pub fn build(
    name: &str,
    cfg: &BackendConfig,
    ctx: &BackendContext,
) -> Result<Arc<dyn Backend>, BackendError> {
    match cfg.runtime() {
        "sim" => Ok(Arc::new(SimBackend::new(name, cfg)?)),
        "linux" => Ok(Arc::new(ContainerBackend::new(name, cfg, ctx)?)),
        r @ ("firecracker" | "qemu") => Err(BackendError::Config {
            backend: name.to_string(),
            message: format!("runtime {r:?} is not built yet in this version; use runtime \"sim\""),
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
    fn sim_is_built_and_real_runtimes_are_not_yet() {
        let ctx = BackendContext::default();
        let b = build("sim", &BackendConfig::default(), &ctx).map_err(|e| e.to_string());
        let b = match b {
            Ok(b) => b,
            Err(e) => panic!("sim should build: {e}"),
        };
        assert_eq!(b.name(), "sim");
        assert_eq!(b.runtime_kind(), "sim");
        assert!(b.simulated());
        for r in ["firecracker", "qemu"] {
            let cfg = BackendConfig {
                runtime: r.into(),
                ..Default::default()
            };
            let err = build("x", &cfg, &ctx)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(err.contains("not built yet"), "{r}: {err}");
        }
        let cfg = BackendConfig {
            runtime: "docker".into(),
            ..Default::default()
        };
        assert!(build("x", &cfg, &ctx).is_err());
    }
}
