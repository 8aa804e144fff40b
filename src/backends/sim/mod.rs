//! The `sim` backend: a simulated lifecycle that runs nothing (docs/concepts.md), for tests
//! and scheduling benchmarks. Creation takes a lognormal time with median
//! `create_latency_ms` (0 = instant) and shape `latency_sigma`, and fails with probability
//! `failure_rate`; pause, resume, stop and adopt always succeed.

use std::collections::HashSet;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, LogNormal};

use super::{
    Adopted, Backend, BackendError, BackendState, CleanupReport, CreateRequest, Handle, Health,
    Recorded,
};
use crate::config::BackendConfig;

/// Longest simulated creation, whatever the distribution draws.
const MAX_DELAY: Duration = Duration::from_secs(600);

/// A simulated backend. Holds no per-sandbox state.
pub struct SimBackend {
    name: String,
    latency: Option<LogNormal<f64>>,
    failure_rate: f64,
    rng: Mutex<StdRng>,
}

impl SimBackend {
    /// Builds it from `create_latency_ms` (≥ 0), `latency_sigma` (≥ 0) and `failure_rate`
    /// (0..1). Errors: `Config` for values out of range.
    pub fn new(name: &str, cfg: &BackendConfig) -> Result<SimBackend, BackendError> {
        Self::with_rng(name, cfg, StdRng::from_os_rng())
    }

    /// As `new`, with a given random source (tests pass a seeded one).
    pub fn with_rng(
        name: &str,
        cfg: &BackendConfig,
        rng: StdRng,
    ) -> Result<SimBackend, BackendError> {
        let bad = |m: &str| BackendError::Config {
            backend: name.to_string(),
            message: m.to_string(),
        };
        if !(0.0..=1.0).contains(&cfg.failure_rate) {
            return Err(bad("failure_rate must be within 0..1"));
        }
        if !(cfg.create_latency_ms >= 0.0 && cfg.create_latency_ms.is_finite()) {
            return Err(bad("create_latency_ms must be a number ≥ 0"));
        }
        if !(cfg.latency_sigma >= 0.0 && cfg.latency_sigma.is_finite()) {
            return Err(bad("latency_sigma must be a number ≥ 0"));
        }
        let latency = if cfg.create_latency_ms > 0.0 {
            Some(
                LogNormal::new(cfg.create_latency_ms.ln(), cfg.latency_sigma).map_err(|e| {
                    bad(&format!(
                        "latency distribution: {e}",
                        e = crate::types::chain(&e)
                    ))
                })?,
            )
        } else {
            None
        };
        Ok(SimBackend {
            name: name.to_string(),
            latency,
            failure_rate: cfg.failure_rate,
            rng: Mutex::new(rng),
        })
    }

    /// Draws one creation: how long it takes and whether it fails.
    fn draw(&self) -> (Duration, bool) {
        let mut rng = match self.rng.lock() {
            Ok(g) => g,
            Err(p) => p.into_inner(),
        };
        let delay = match &self.latency {
            Some(d) => {
                let ms: f64 = d.sample(&mut *rng);
                Duration::try_from_secs_f64(ms / 1000.0)
                    .unwrap_or(MAX_DELAY)
                    .min(MAX_DELAY)
            }
            None => Duration::ZERO,
        };
        let fail = self.failure_rate > 0.0 && rng.random::<f64>() < self.failure_rate;
        (delay, fail)
    }
}

#[async_trait]
impl Backend for SimBackend {
    fn name(&self) -> &str {
        &self.name
    }
    fn runtime_kind(&self) -> &'static str {
        "sim"
    }
    fn simulated(&self) -> bool {
        true
    }

    async fn create(&self, req: &CreateRequest) -> Result<BackendState, BackendError> {
        if req.snapshot.is_some() {
            return Err(BackendError::Unsupported {
                backend: self.name.clone(),
                op: "restore from a memory snapshot",
            });
        }
        let (delay, fail) = self.draw();
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
        }
        if fail {
            return Err(BackendError::Create {
                sandbox_id: req.sandbox_id.clone(),
                message: "simulated failure (failure_rate)".into(),
            });
        }
        Ok(BackendState::Null)
    }
    async fn stop(&self, _sandbox: &Handle<'_>) -> Result<(), BackendError> {
        Ok(())
    }
    async fn pause(&self, sandbox: &Handle<'_>) -> Result<BackendState, BackendError> {
        Ok(sandbox.state.clone())
    }
    async fn resume(&self, sandbox: &Handle<'_>) -> Result<BackendState, BackendError> {
        Ok(sandbox.state.clone())
    }
    async fn probe(&self, _sandbox: &Handle<'_>) -> Health {
        Health::Alive
    }
    async fn adopt(
        &self,
        sandbox: &Handle<'_>,
        recorded: Recorded,
    ) -> Result<Adopted, BackendError> {
        Ok(Adopted {
            state: sandbox.state.clone(),
            paused: recorded == Recorded::Paused,
        })
    }
    async fn cleanup(&self, _keep: &HashSet<String>) -> Result<CleanupReport, BackendError> {
        Ok(CleanupReport::default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb;

    fn cfg(latency: f64, sigma: f64, fail: f64) -> BackendConfig {
        BackendConfig {
            create_latency_ms: latency,
            latency_sigma: sigma,
            failure_rate: fail,
            ..Default::default()
        }
    }

    fn req() -> CreateRequest {
        CreateRequest {
            sandbox_id: "e1.a".into(),
            project: "root".into(),
            spec: pb::SandboxSpec::default(),
            fork: None,
            snapshot: None,
        }
    }

    #[test]
    fn out_of_range_configs_are_refused() {
        assert!(SimBackend::new("sim", &cfg(0.0, 0.0, 1.5)).is_err());
        assert!(SimBackend::new("sim", &cfg(-1.0, 0.0, 0.0)).is_err());
        assert!(SimBackend::new("sim", &cfg(5.0, -0.5, 0.0)).is_err());
        assert!(SimBackend::new("sim", &cfg(f64::NAN, 0.0, 0.0)).is_err());
    }

    #[test]
    fn latency_draws_have_the_configured_median() {
        let b = SimBackend::with_rng("sim", &cfg(100.0, 0.5, 0.0), StdRng::seed_from_u64(7))
            .map_err(|e| e.to_string());
        let Ok(b) = b else { panic!("build") };
        let mut v: Vec<f64> = (0..2001)
            .map(|_| b.draw().0.as_secs_f64() * 1000.0)
            .collect();
        v.sort_by(|a, b| a.total_cmp(b));
        let median = v[1000];
        assert!((80.0..125.0).contains(&median), "median {median}");
        assert!(
            v[0] < median && v[2000] > median,
            "sigma 0.5 spreads the draws"
        );
        // sigma 0: every draw is the median.
        let Ok(fixed) = SimBackend::with_rng("sim", &cfg(40.0, 0.0, 0.0), StdRng::seed_from_u64(1))
        else {
            panic!("build")
        };
        assert!((fixed.draw().0.as_secs_f64() * 1000.0 - 40.0).abs() < 1e-6);
        // 0 = instant.
        let Ok(instant) = SimBackend::new("sim", &cfg(0.0, 3.0, 0.0)) else {
            panic!("build")
        };
        assert_eq!(instant.draw().0, Duration::ZERO);
    }

    #[tokio::test]
    async fn failure_rate_decides_creations() {
        let Ok(always) = SimBackend::new("sim", &cfg(0.0, 0.0, 1.0)) else {
            panic!("build")
        };
        let err = always
            .create(&req())
            .await
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("simulated failure"), "{err}");
        let Ok(never) = SimBackend::new("sim", &cfg(0.0, 0.0, 0.0)) else {
            panic!("build")
        };
        let Ok(half) = SimBackend::with_rng("sim", &cfg(0.0, 0.0, 0.5), StdRng::seed_from_u64(3))
        else {
            panic!("build")
        };
        for _ in 0..20 {
            assert!(never.create(&req()).await.is_ok());
        }
        let mut failed = 0;
        for _ in 0..400 {
            if half.create(&req()).await.is_err() {
                failed += 1;
            }
        }
        assert!(
            (120..280).contains(&failed),
            "{failed} of 400 failed at rate 0.5"
        );
    }

    #[tokio::test]
    async fn lifecycle_calls_succeed_and_keep_state() {
        let Ok(b) = SimBackend::new("sim", &cfg(0.0, 0.0, 0.0)) else {
            panic!("build")
        };
        let spec = pb::SandboxSpec::default();
        let st = serde_json::json!({"k": 1});
        let h = Handle {
            sandbox_id: "e1.a",
            spec: &spec,
            state: &st,
        };
        assert_eq!(b.pause(&h).await.ok(), Some(st.clone()));
        assert_eq!(b.resume(&h).await.ok(), Some(st.clone()));
        assert!(b.stop(&h).await.is_ok());
        assert_eq!(b.probe(&h).await, Health::Alive);
        let a = b.adopt(&h, Recorded::Paused).await.ok();
        assert_eq!(
            a,
            Some(Adopted {
                state: st.clone(),
                paused: true
            })
        );
        assert!(b.runtime().is_none() && b.snapshotter().is_none() && b.versioned().is_none());
        assert_eq!(
            b.cleanup(&HashSet::new()).await.ok(),
            Some(CleanupReport::default())
        );
    }
}
